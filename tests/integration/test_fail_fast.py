"""An error inside the loop ends the job in seconds; bad labels are data faults, not crashes.

The exception is injected from outside the code (benchmarks/inject, on PYTHONPATH): `F.cross_entropy`'s Nth call on
one rank raises, in the real processes each launcher starts.
"""
import io
import os
import re
import socket
import tarfile
import time

import pytest
from conftest import check_input, launch, read_metrics, with_faults



def port_is_free(port: int) -> bool:
    """Nothing listens on the port any more: a new job's store can bind it (with SO_REUSEADDR, as torch's does;
    the closed connections' TIME_WAIT entries do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(port)))
            s.listen()
            return True
        except OSError:
            return False


@pytest.mark.parametrize("launcher", ["deepspeed", pytest.param("torchrun", marks=pytest.mark.slow),
                                      pytest.param("accelerate", marks=pytest.mark.slow)])  # the same hook, other launchers
def test_an_exception_on_one_rank_ends_the_job_in_seconds(debug_args, tmp_path, monkeypatch, launcher):
    for key, value in with_faults(dict(os.environ), {"RAISE": "1:3"}).items():  # rank 1, the third step's loss
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    started = time.monotonic()
    proc = launch(debug_args + ["--max_steps", 40, "--save_every", 2, "--output_dir", out], launcher=launcher,
                  check=False, timeout=120)
    seconds = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert seconds < 60  # start-up included; the default dist_timeout is 1800 s
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 1 failed")]
    assert lines == [f"error: rank 1 failed at step 3: RuntimeError: injected: the task's loss failed (traceback: "
                     f"{out}/errors/rank1.txt)"], proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in (out / "errors" / "rank1.txt").read_text()
    assert "rank 0: stopping at step 3, because rank 1 failed" in proc.stderr
    # nothing written is lost: the first two steps' records and the checkpoint of step 2, which `latest` names
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step0000002"
    assert port_is_free(proc.port)


def relabel(src: str, dst, labels: dict):
    """A copy of the tar shard `src` whose samples numbered in `labels` ({index: label}) carry that label."""
    with tarfile.open(src) as tar_in, tarfile.open(dst, "w") as tar_out:
        index, last_key = -1, None
        for member in tar_in.getmembers():
            data = tar_in.extractfile(member).read()
            key, ext = member.name.split(".", 1)
            if key != last_key:
                index, last_key = index + 1, key
            if ext == "cls" and index in labels:
                data = str(labels[index]).encode()
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            tar_out.addfile(info, io.BytesIO(data))


def test_a_label_outside_num_labels_is_skipped_and_counted(digits, debug_args, tmp_path):
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(digits["dir"], shards)
    bad = {i: 42 for i in range(0, 300, 10)}  # 30 samples of the second shard: a few, not most
    relabel(f"{digits['dir']}/train-000001.tar", shards / "train-000001.tar", bad)
    out = tmp_path / "run"
    args = debug_args + ["--model", "vit-debug", "--micro_batch_size", 64, "--train_shards",
                         f"{shards}/train-{{000000..000003}}.tar", "--max_steps", 12, "--eval_every", 0, "--save_every",
                         0, "--output_dir", out]  # past the first epoch (11 steps)
    proc = launch(args, warnings=True)
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "outside [0, 10) (num_labels)" in line]
    assert warned and all("train-000001.tar" in line for line in warned), proc.stdout[-3000:]
    assert read_metrics(out)[-1]["data/skipped"] >= len(bad)  # the first epoch reads each of them once


def test_shards_whose_labels_are_mostly_out_of_range_are_one_error(digits, debug_args, tmp_path, capsys,
                                                                  monkeypatch):
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(digits["dir"], shards)
    relabel(f"{digits['dir']}/train-000000.tar", shards / "train-000000.tar", {i: 100 + i for i in range(64)})
    out = tmp_path / "run"
    code, lines = check_input(debug_args + ["--train_shards", f"{shards}/train-{{000000..000003}}.tar",
                                            "--output_dir", out], capsys, monkeypatch)
    assert code == 2
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "num_labels 10" in errors[0] and "the largest is 163" in errors[0], lines
    assert not out.exists()


@pytest.mark.parametrize("command, status", [("false", "exited with status 1"),
                                             ("sh -c 'echo AccessDenied >&2; exit 3'", "exited with status 3 (AccessDenied)")])
def test_a_failing_pipe_source_is_one_line_before_training(debug_args, tmp_path, command, status, capsys,
                                                           monkeypatch):
    out = tmp_path / "run"
    code, lines = check_input(debug_args + ["--train_shards", f"pipe:{command}", "--output_dir", out], capsys,
                              monkeypatch)
    assert code == 2
    assert lines == [f"error: train_shards 'pipe:{command}': command '{command}' {status}"], lines
    assert not out.exists()


def test_a_pipe_source_failing_mid_run_is_skipped_counted_and_named(digits, debug_args, tmp_path):
    from benchmarks.fault_injection import pipe_failing_after_counts

    script = tmp_path / "fetch.sh"  # the third shard: whole while the ranks count it, then cut off with exit 7
    script.write_text(pipe_failing_after_counts("train-000002.tar", str(tmp_path / "reads")))
    out = tmp_path / "run"
    spec = f"pipe:sh {script} {digits['dir']}/train-{{000000..000003}}.tar"
    proc = launch(debug_args + ["--model", "vit-debug", "--micro_batch_size", 64, "--train_shards", spec,
                                "--max_steps", 12, "--eval_every", 0, "--save_every", 0, "--output_dir", out],
                  warnings=True)  # past the first epoch (11 steps): the shard is read after its count
    named = [line for line in (proc.stdout + proc.stderr).splitlines() if "exited with status 7" in line]
    assert named and all("000002.tar" in line for line in named), proc.stdout[-3000:]
    assert read_metrics(out)[-1]["data/skipped"] > 0


@pytest.fixture
def checkpointed(debug_args, tmp_path):
    """A vit-debug run of 4 steps with checkpoints at steps 2 and 4."""
    out = tmp_path / "first"
    launch(debug_args + ["--model", "vit-debug", "--max_steps", 4, "--save_every", 2, "--eval_every", 0,
                         "--output_dir", out], nproc=1)
    return out


def test_resuming_another_models_checkpoint_is_one_line(checkpointed, debug_args, tmp_path):
    out = tmp_path / "other"
    # 2 ranks, from a 1-rank checkpoint: refused before the conversion to the universal format (or any load)
    proc = launch(debug_args + ["--model", "vit-narrow", "--max_steps", 6, "--resume", checkpointed / "checkpoints",
                                "--output_dir", out], check=False, timeout=120)
    assert proc.returncode == 2
    assert not (checkpointed / "checkpoints" / "step0000004_universal").exists()
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"error: resume: {checkpointed}/checkpoints/step0000004 is a checkpoint of another model \(\d+ parameters "
        r"differ; first: vit\.embeddings\.cls_token is \[1, 1, 32\] there and \[1, 1, 64\] here\): resume a "
        r"checkpoint of this model, or start this one in another output_dir", errors[0]), errors


def test_a_strict_load_error_of_an_older_checkpoint_is_one_line():
    """Checkpoints without `param_shapes` in train_state.json meet torch's strict load: its error, as DeepSpeed
    raises it, becomes the same one line."""
    import torch

    from checkpoints.manager import describe_load_error

    small, large = torch.nn.Sequential(torch.nn.Linear(4, 2)), torch.nn.Sequential(torch.nn.Linear(8, 2))
    with pytest.raises(RuntimeError) as e:
        small.load_state_dict(large.state_dict())
    assert describe_load_error(e.value, "ckpt") == (
        "resume: ckpt is a checkpoint of another model (1 parameter differs; first: 0.weight is [2, 8] there and "
        "[2, 4] here): resume a checkpoint of this model, or start this one in another output_dir")
    with pytest.raises(RuntimeError) as e:
        small.load_state_dict({"0.weight": small[0].weight})
    assert "first: 0.bias is missing from it" in describe_load_error(e.value, "ckpt")
    assert describe_load_error(RuntimeError("CUDA out of memory"), "ckpt") is None


def test_latest_naming_a_missing_checkpoint_is_a_warning(checkpointed, debug_args):
    (checkpointed / "checkpoints" / "latest").write_text("step0000009")
    proc = launch(debug_args + ["--model", "vit-debug", "--max_steps", 6, "--save_every", 0, "--eval_every", 0,
                                "--resume", "latest", "--output_dir", checkpointed], nproc=1)
    assert (f"warning: {checkpointed}/checkpoints/latest names step0000009, which is not there: resuming from "
            f"step0000004, the newest complete checkpoint") in proc.stderr
    assert [r["step"] for r in read_metrics(checkpointed)] == [1, 2, 3, 4, 5, 6]


def test_a_truncated_weight_file_is_one_line(tmp_path, debug_args, capsys, monkeypatch):
    from models import build_model

    model_dir = tmp_path / "model"
    build_model("vit-debug", 10, 16)[0].save_pretrained(model_dir)
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    out = tmp_path / "run"
    code, errors = check_input(debug_args + ["--model", model_dir, "--output_dir", out], capsys, monkeypatch)
    assert code == 2
    assert len(errors) == 1 and errors[0].startswith(f"error: model: {weights} is truncated: its tensors end at byte "
                                                     f"{size:,} and the file holds {size // 2:,}"), errors
    assert not out.exists()


def test_no_fault_hook_is_read_by_the_training_code():
    """Faults come from outside (benchmarks/inject): train.py and the library read no injection variable."""
    from conftest import REPO

    files = ["train.py", "config.py", "plan.py", "export.py"] + [
        os.path.join(d, f) for d in ("ac", "engine", "models", "data", "planner") for f in os.listdir(os.path.join(REPO, d))
        if f.endswith(".py")]
    readers = [f for f in files if "INJECT" in open(os.path.join(REPO, f)).read()]
    assert readers == []
