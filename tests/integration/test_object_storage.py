"""Shards and checkpoints on object storage, against a real S3 API: moto's S3 server, started here on loopback as its
own process. Credentials and the endpoint reach train.py as a user's would, through the AWS SDK's variables."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import fsspec
import pytest
from conftest import REPO, free_port, launch, read_metrics
from test_data import png, read_epoch, write_shard
from test_reliability import start, wait_for

from checkpoints.sync import Mirror, restore
from config import ConfigError


@pytest.fixture(scope="module")
def s3(digits):
    """The server's endpoint, with the SDK's variables set for this process and the jobs it starts; the digits
    shards uploaded to s3://shards/digits/."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "moto's server did not start"
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                             "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test",
                      AWS_DEFAULT_REGION="us-east-1")
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    for bucket in ("shards", "runs"):
        fs.mkdir(bucket)
    fs.put(digits["dir"] + "/", "shards/digits/", recursive=True)
    yield {"endpoint": endpoint, "fs": fs}
    server.kill()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def s3_args(debug_args):
    """The debug run's keys with its shards read from the bucket (the same files)."""
    args = list(map(str, debug_args))
    args[args.index("--train_shards") + 1] = "s3://shards/digits/train-{000000..000003}.tar"
    args[args.index("--val_shards") + 1] = "s3://shards/digits/val-000000.tar"
    return args


def test_shards_from_s3_killed_and_resumed_on_a_new_disk_from_the_mirror(s3, stage_runs, debug_args, tmp_path):
    """2 ranks read the digits from the bucket and mirror their checkpoints to it (sync_to); the job is killed with
    SIGKILL once the mirror holds step 20, and its whole output_dir is deleted, as a new node would have it. The
    relaunch with --resume latest downloads step 20 from the mirror and trains steps 21-60 to the losses of the
    same run on local shards, bitwise; the mirror ends with step 60, the export (config.json last) and the
    records."""
    run = tmp_path / "run"
    args = s3_args(debug_args) + ["--model", "vit-debug", "--zero_stage", 2, "--save_every", 10, "--keep_last", 2,
                                  "--sync_to", "s3://runs/kill", "--output_dir", run]
    fs = s3["fs"]
    proc = start(args)

    def mirrored(tag):
        try:
            return fs.cat_file("runs/kill/checkpoints/latest").decode() == tag
        except FileNotFoundError:
            return False
        finally:
            fs.invalidate_cache()

    wait_for(lambda: mirrored("step0000020"), proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=90)
    import shutil

    shutil.rmtree(run)
    resumed = launch(args + ["--resume", "latest"])
    assert "sync_to: step0000020 downloaded from s3://runs/kill" in resumed.stdout, resumed.stdout[-3000:]
    assert "at step 20" in resumed.stdout
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(21, 61))
    reference = read_metrics(stage_runs["vit-debug", 2])
    assert [r["loss"] for r in records] == [r["loss"] for r in reference[20:]]
    fs.invalidate_cache()
    assert fs.cat_file("runs/kill/checkpoints/latest") == b"step0000060"
    local = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step"))
    remote = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("runs/kill/checkpoints") if "/step" in p)
    assert remote == local  # pruned as the local directory is
    for name in ("hf_model/config.json", "hf_model/model.safetensors", "metrics.jsonl", "summary.json"):
        assert fs.exists(f"runs/kill/{name}"), name


def test_corrupt_shards_on_s3_are_skipped_and_counted(s3, tmp_path):
    """The local path's bad-data case, read from the bucket by 2 ranks x 2 workers: the bad samples and the
    shard cut mid-member are skipped and counted, the batches stay equal in number across ranks."""
    good = lambda s, i: (f"s{s}_{i:03d}", {"png": png(i), "cls": str(i % 10).encode()})  # noqa: E731
    write_shard(tmp_path / "train-000000.tar", [good(0, i) for i in range(40)])
    write_shard(tmp_path / "train-000001.tar", [good(1, i) for i in range(30)] + [
        ("bad_image", {"png": b"\x89PNG not an image", "cls": b"1"}), ("no_label", {"png": png(1)}),
        ("bad_label", {"png": png(1), "cls": b"seven"}), ("label_42", {"png": png(1), "cls": b"42"}),
    ] + [good(1, i) for i in range(30, 36)])
    write_shard(tmp_path / "train-000002.tar", [good(2, i) for i in range(40)])
    with open(tmp_path / "train-000002.tar", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "train-000002.tar") // 2 + 100)
    info = {"splits": {"train": {"filenames": [f"train-00000{i}.tar" for i in range(3)], "shard_lengths": [40] * 3}}}
    (tmp_path / "_info.json").write_text(json.dumps(info))
    s3["fs"].put(str(tmp_path) + "/", "shards/bad/", recursive=True)

    epoch = read_epoch("s3://shards/bad/train-{000000..000002}.tar", world_size=2, num_workers=2, mbs=4,
                       num_labels=10)
    assert [len(batches) for batches, _ in epoch.values()] == [14, 14]
    keys = [k for batches, _ in epoch.values() for batch in batches for k in batch]
    assert not {"bad_image", "no_label", "bad_label", "label_42"} & set(keys)
    assert len({k for k in keys if k.startswith("s2_")}) <= 25
    assert sum(loader.skipped for _, loader in epoch.values()) >= 4


def checkpoint(ckpt_dir, tag, payload: bytes):
    """A complete checkpoint as manager.finish leaves one: its files and a train_state.json listing their sizes."""
    path = ckpt_dir / tag
    path.mkdir(parents=True)
    (path / "model.pt").write_bytes(payload)
    (path / "optim.pt").write_bytes(payload * 2)
    state = {"step": int(tag[4:]), "files": {"model.pt": len(payload), "optim.pt": 2 * len(payload)}}
    (path / "train_state.json").write_text(json.dumps(state))


def test_an_upload_cut_short_leaves_the_mirror_at_the_previous_checkpoint(s3, tmp_path):
    """The mirror's protocol against the server: step 10 uploaded whole; step 20's upload fails after its first
    file (the connection lost, as a job killed mid-upload leaves it): `latest` still names step 10, step 20 is
    not a complete remote checkpoint, and a new disk restores step 10, checked file by file. A remote file cut
    short is found at the download, by its size."""
    ckpts = tmp_path / "a" / "checkpoints"
    checkpoint(ckpts, "step0000010", b"ten" * 1000)
    checkpoint(ckpts, "step0000020", b"twenty" * 1000)
    mirror = Mirror("s3://runs/cut")
    mirror.check()
    lines = []
    mirror.start(str(ckpts), "step0000010", ["step0000010"], lines.append)
    assert mirror.wait(lines.append) and "sync_to: step0000010 uploaded" in lines[-1]

    put, calls = mirror.fs.put_file, []

    def lost_after_one(*args, **kwargs):
        calls.append(args[0])
        if len(calls) > 1:
            raise ConnectionResetError("connection reset by peer")
        return put(*args, **kwargs)

    mirror.fs.put_file = lost_after_one
    mirror.start(str(ckpts), "step0000020", ["step0000010", "step0000020"], lines.append)
    assert not mirror.wait(lines.append)
    assert lines[-1].startswith("warning: sync_to: uploading step0000020 to s3://runs/cut failed "
                                "(ConnectionResetError: connection reset by peer)")
    mirror.fs.put_file = put
    mirror.fs.invalidate_cache()
    assert mirror.fs.cat_file("runs/cut/checkpoints/latest") == b"step0000010"
    assert mirror.remote_tags() == ["step0000010"] and mirror.fs.exists("runs/cut/checkpoints/step0000020/model.pt")

    new_disk = tmp_path / "b" / "checkpoints"
    assert restore(mirror, str(new_disk), rank=0, log=lines.append) == "step0000010"
    assert (new_disk / "latest").read_text() == "step0000010"
    assert (new_disk / "step0000010" / "optim.pt").read_bytes() == b"ten" * 2000
    assert restore(mirror, str(new_disk), rank=0, log=lines.append) is None  # nothing newer remotely

    mirror.fs.pipe_file("runs/cut/checkpoints/step0000010/optim.pt", b"cut")
    with pytest.raises(ConfigError, match=r"step0000010 is damaged \(optim.pt is 3 bytes, 6,000 when written\)"):
        restore(mirror, str(tmp_path / "c" / "checkpoints"), rank=0, log=lines.append)


def test_a_store_that_cannot_serve_is_one_line_and_exit_2_before_training(s3, debug_args, tmp_path):
    """A mirror whose endpoint nothing answers: one error line naming it, exit 2, nothing written. Shards in a
    bucket that does not exist: the check's one line (train.py prints a DataError as this one)."""
    from data.shards import DataError, parse_spec

    with pytest.raises(DataError) as missing:
        parse_spec("s3://no-such-bucket/digits", "train_shards")
    assert str(missing.value) == ("train_shards 's3://no-such-bucket/digits': nothing there (FileNotFoundError: The "
                                  "specified bucket does not exist)")
    args = list(map(str, debug_args)) + ["--model", "vit-debug", "--output_dir", str(tmp_path / "run"),
                                         "--sync_to", "s3://runs/x"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_MAX_ATTEMPTS="1")  # the SDK's retries: none
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: sync_to 's3://runs/x' is not writable: EndpointConnectionError: Could not connect to the"), proc.stderr
    assert not (tmp_path / "run").exists()
