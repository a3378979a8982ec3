"""Experiment tracking (runlog/tracking.py) against the real trackers: an MLflow tracking server started here on
loopback (SQLite store, a temporary artifact folder) and W&B in offline mode. A 2-rank run's tracked metrics
equal its metrics.jsonl; a server killed mid-run costs a warning, not the run, and gets what it missed once it
answers again; kill -9 and --resume latest continue the same tracked run; a server that is down at the start
is one line and exit 2 with nothing written."""
import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import BIN, REPO, ForkedJob, check_input, free_port, launch, read_metrics

from runlog import tracking


class MLflowServer:
    """`mlflow server` in its own process group (its workers die with it), on a fixed port and store so that a
    restart is the same server."""

    def __init__(self, root):
        self.root, self.port = str(root), free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.start()

    def start(self):
        log = open(os.path.join(self.root, "server.log"), "a")
        self.proc = subprocess.Popen(
            [f"{BIN}/mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
             "--artifacts-destination", f"{self.root}/artifacts", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"], stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).close()
                return
            except OSError:
                assert self.proc.poll() is None, open(os.path.join(self.root, "server.log")).read()[-3000:]
                assert time.monotonic() < deadline, "the MLflow server did not start"
                time.sleep(0.25)

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MLflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.kill()


def tracked_history(client, run_id, key) -> dict:
    """{step: value} of an MLflow metric; a step logged twice (a resumed run re-logs the steps after its
    checkpoint) keeps its newest value, as metrics.jsonl keeps the resumed run's line."""
    history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}


def assert_mlflow_equals_metrics(client, run_id, run_dir):
    records = read_metrics(run_dir)
    keys = {k for r in records for k in r if k != "step"}
    assert {"loss", "lr", "grad_norm", "images_per_sec", "val_top1"} <= keys
    for key in sorted(keys):
        assert tracked_history(client, run_id, key) == {r["step"]: r[key] for r in records
                                                        if r.get(key) is not None}, key


def wandb_history(run_dir) -> dict:
    """{step: {key: value}} from the offline run's log, read by W&B's own reader (`wandb leet inspect`)."""
    [log] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    out = subprocess.run([f"{BIN}/wandb", "leet", "inspect", "--json", log], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    history = {}
    for line in out.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            item = record["history"]["item"]
            history.setdefault(item["_step"], {}).update(item)
    return history


# ---------------------------------------------------------------------------------------------------- input
def test_report_to_names_trackers(debug_args, tmp_path, capsys, monkeypatch):
    for value, why in (("tensorboard,comet", "unknown tracker 'comet'"), ("none,mlflow", "or only none"),
                       (",", "name trackers")):
        code, lines = check_input(debug_args + ["--report_to", value, "--output_dir", tmp_path / "r"], capsys,
                                  monkeypatch)
        assert code == 2 and len(lines) == 1 and why in lines[0], lines
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("report_to: [tensorboard, wandb]\n")
    from config import parse

    assert parse(["--config", str(recipe)]).report_to == "tensorboard,wandb"
    assert tracking.chosen(parse(["--report_to", "none"])) == []
    assert not (tmp_path / "r").exists()


def test_a_tracking_server_down_at_start_is_one_line_and_nothing_written(debug_args, tmp_path, capsys, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = tmp_path / "run"
    start = time.monotonic()
    code, lines = check_input(debug_args + ["--report_to", "mlflow", "--tracking_uri", dead, "--output_dir", run],
                              capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: report_to mlflow: the tracking store {dead} does not answer"), lines
    assert time.monotonic() - start < 30  # MLflow's own retries (minutes by default) are off
    assert not run.exists()


# ---------------------------------------------------------------------------------------------------- sender
def test_the_sender_holds_back_what_fails_and_sends_it_when_the_server_answers(monkeypatch):
    """runlog/tracking._Sender with a send that fails while `down` is set: one warning, nothing lost, everything
    sent in order once it answers; at the end what is still unsent is listed, not waited on forever."""
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.05)
    lines, sent, down = [], [], [True]

    def send(values):
        if down[0]:
            raise ConnectionError("Connection refused")
        sent.extend(values)

    sender = tracking._Sender("mlflow", lines.append)
    sender.send_metrics = send
    sender.put_metrics([("loss", 1.0, 1, 0), ("loss", 0.5, 2, 0)])
    sender.put("config.yaml", lambda: send([("file", 0, 0, 0)]))
    time.sleep(0.3)
    assert sent == [] and len(lines) == 1 and "could not send metrics (ConnectionError: Connection refused)" in \
        lines[0] and "training goes on" in lines[0]
    down[0] = False
    assert sender.close(5.0) == []
    assert sent == [("loss", 1.0, 1, 0), ("loss", 0.5, 2, 0), ("file", 0, 0, 0)]
    assert lines[1] == "mlflow: the tracking server answers again; what was held back is being sent"

    down[0] = True
    sender = tracking._Sender("mlflow", lines.append)
    sender.send_metrics = send
    sender.put_metrics([("loss", 1.0, 3, 0), ("lr", 0.1, 7, 0)])
    sender.put("figures/val-confusion-step0000030.png", lambda: send([]))
    start = time.monotonic()
    assert sender.close(0.3) == ["2 metric values of steps 3-7", "figures/val-confusion-step0000030.png"]
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------------------------------- runs
def test_a_two_rank_run_logs_to_mlflow_and_wandb_and_survives_a_server_restart(debug_args, mlflow_server, tmp_path):
    """report_to tensorboard,mlflow,wandb on 2 ranks; the MLflow server is killed once the run has logged
    steps, and started again: the run finishes with exit 0 and one warning, and the server ends up with every
    value of metrics.jsonl (the held-back ones sent when it answered again), the config as parameters, the tags,
    the run's files and pictures. W&B's offline run holds the same metrics."""
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    args = debug_args + ["--model", "vit-debug", "--report_to", "tensorboard,mlflow,wandb", "--tracking_uri",
                         mlflow_server.uri, "--project", "tests", "--output_dir", run, "--log_every", 5]
    job = ForkedJob(args, 2, env)
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 5:
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    mlflow_server.kill()
    killed_at = len((run / "metrics.jsonl").read_text().splitlines())
    mlflow_server.start()  # within the run's end, which keeps retrying what it holds for 30 s
    out, err = job.communicate(timeout=180)
    assert job.returncode == 0, err[-3000:]
    assert killed_at < 60, "the run ended before the server was killed"
    assert "warning: mlflow: could not send" in err and "training goes on" in err, err[-3000:]
    assert "mlflow: the tracking server answers again" in err
    assert "warning: mlflow: not sent" not in err

    state = json.loads((run / "tracking.json").read_text())
    client = mlflow_server.client()
    tracked = client.get_run(state["mlflow"]["run_id"])
    assert tracked.info.status == "FINISHED" and tracked.info.run_name == "run"
    assert client.get_experiment(tracked.info.experiment_id).name == "tests"
    assert tracked.data.params["micro_batch_size"] == "16" and tracked.data.params["report_to"] == \
        "tensorboard,mlflow,wandb"
    assert {k: tracked.data.tags[k] for k in ("engine", "zero_stage", "world_size", "task", "model")} == {
        "engine": "deepspeed", "zero_stage": "2", "world_size": "2", "task": "classification", "model": "vit-debug"}
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert tracked.data.tags["commit"].startswith(head)
    assert_mlflow_equals_metrics(client, tracked.info.run_id, run)
    files = {a.path for a in client.list_artifacts(tracked.info.run_id)}
    assert {"config.yaml", "ds_config.json", "ac_plan.json"} <= files
    figures = {a.path for a in client.list_artifacts(tracked.info.run_id, "figures")}
    assert {"figures/ac-plan-step0000000.png", "figures/val-confusion-step0000060.png",
            "figures/val-predictions-step0000030.png"} <= figures

    history = wandb_history(run)
    for record in read_metrics(run):
        logged = history[record["step"]]
        assert {k: logged.get(k) for k, v in record.items() if k != "step" and v is not None} == \
            {k: v for k, v in record.items() if k != "step" and v is not None}
    assert history[60]["val/confusion._type"] == "image-file"
    assert state["wandb"]["mode"] == "offline"
    assert (run / "tb").is_dir()  # TensorBoard as before


def test_kill_9_and_resume_continue_the_same_tracked_run(debug_args, mlflow_server, tmp_path):
    """kill -9 of the whole job after its step-30 checkpoint, then --resume latest on ONE rank: tracking.json's
    run continues (the same MLflow run, FINISHED, its metrics those of metrics.jsonl); a fresh output folder
    makes a new run, which with log_model gets the exported model; a run whose rank raises ends FAILED."""
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    args = debug_args + ["--model", "vit-debug", "--report_to", "mlflow", "--tracking_uri", mlflow_server.uri,
                         "--output_dir", run]
    job = ForkedJob(args, 2, env)
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step0000030" / "train_state.json").exists():
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    job.kill()
    job.wait(60)
    run_id = json.loads((run / "tracking.json").read_text())["mlflow"]["run_id"]
    client = mlflow_server.client()
    assert client.get_run(run_id).info.status == "RUNNING"  # as a kill leaves it

    launch(args + ["--resume", "latest"], nproc=1)
    assert json.loads((run / "tracking.json").read_text())["mlflow"]["run_id"] == run_id
    tracked = client.get_run(run_id)
    assert tracked.info.status == "FINISHED"
    assert_mlflow_equals_metrics(client, run_id, run)
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 61))

    other = tmp_path / "other"  # with the exported model sent too (log_model)
    launch(args[:-1] + [other, "--max_steps", 2, "--eval_every", 0, "--save_every", 0, "--log_model", "true"],
           nproc=1)
    other_id = json.loads((other / "tracking.json").read_text())["mlflow"]["run_id"]
    assert other_id != run_id
    sent = {a.path: a.file_size for a in client.list_artifacts(other_id, "hf_model")}
    assert sent["hf_model/model.safetensors"] == (other / "hf_model" / "model.safetensors").stat().st_size

    failed = tmp_path / "failed"  # a rank that raises: fail-fast marks the run FAILED on its way out
    proc = launch(args[:-1] + [failed, "--max_steps", 4, "--eval_every", 0, "--save_every", 0], nproc=1,
                  faults={"RAISE": "0:2"}, check=False)
    assert proc.returncode != 0
    failed_id = json.loads((failed / "tracking.json").read_text())["mlflow"]["run_id"]
    assert client.get_run(failed_id).info.status == "FAILED"


# slow (~35 s): a whole two-trial study; the default run checks train.py's MLflow runs themselves
@pytest.mark.slow
def test_a_sweep_logs_its_trials_as_nested_runs(digits, mlflow_server, tmp_path):
    """sweep.py with mlflow in the base config's report_to: the study is an MLflow run, each launched trial a run
    nested under it (mlflow.parentRunId) with the trial's values as parameters and its state as a tag; the pruned
    one ends KILLED; the study's run ends with the counts of trials by state."""
    import yaml

    study = tmp_path / "nested.yaml"
    study.write_text(yaml.safe_dump({
        "overrides": {"model": "vit-debug", "image_size": 16, "micro_batch_size": 16, "max_steps": 20,
                      "warmup_steps": 5, "eval_every": 10, "save_every": 0, "num_workers": 0, "shuffle_buffer": 200,
                      "train_shards": digits["train"], "val_shards": digits["val"], "lr": 0.003,
                      "report_to": "mlflow", "tracking_uri": mlflow_server.uri, "project": "sweeps"},
        "space": {"lr": {"type": "categorical", "choices": [0.003, 1.0]}}, "sampler": "random", "seed": 1,
        "pruner": "median", "objectives": [{"metric": "loss", "direction": "minimize"}], "trials": 2,
        "launcher": "python", "nproc_per_node": 1}))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "sweep.py", "--study", str(study), "--output_dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow_server.client()
    experiment = client.get_experiment_by_name("sweeps")
    [parent] = client.search_runs([experiment.experiment_id], "tags.sweep = 'nested'")
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_complete"] == 1 and \
        parent.data.metrics["trials_pruned"] == 1 and parent.data.tags["best.lr"] == "0.003"
    children = client.search_runs([experiment.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_trial = {r.data.tags["sweep.trial"]: r for r in children}
    assert set(by_trial) == {"0", "1"}
    assert by_trial["0"].data.params["lr"] == "0.003" and by_trial["0"].data.tags["sweep.state"] == "complete"
    assert by_trial["0"].info.status == "FINISHED" and by_trial["0"].info.run_name == "nested-trial-0000"
    assert by_trial["1"].data.params["lr"] == "1.0" and by_trial["1"].data.tags["sweep.state"] == "pruned"
    assert by_trial["1"].info.status == "KILLED"
