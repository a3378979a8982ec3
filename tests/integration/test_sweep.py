"""sweep.py's Optuna studies with real train.py launches: bad study files fail before any trial, a pruner ends a
losing trial's whole job and frees its port, the report, best.yaml and pictures come out, and two workers share
a study in a real PostgreSQL server started here (initdb, pg_ctl) with one of them killed mid-trial."""
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from conftest import REPO, free_port, run_entry

PG_BIN = os.path.dirname(os.path.realpath(shutil.which("initdb") or "/usr/lib/postgresql/15/bin/initdb"))


def sweep(*args, timeout=600, check=True):
    proc = run_entry("sweep", *args, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def write_study(path, digits, **keys):
    study = {"overrides": {"model": "vit-debug", "image_size": 16, "micro_batch_size": 16, "max_steps": 20,
                           "warmup_steps": 5, "eval_every": 10, "save_every": 0, "num_workers": 0,
                           "shuffle_buffer": 200, "train_shards": digits["train"], "val_shards": digits["val"],
                           "lr": 0.003},
             "space": {"lr": {"type": "categorical", "choices": [0.003, 1.0e-7]}},
             "sampler": "grid", "trials": 2, "launcher": "python", "nproc_per_node": 1}
    study.update(keys)
    path.write_text(yaml.safe_dump(study))
    return path


def port_free(port: int) -> bool:
    """A launch could listen on `port` now: nothing listens there (SO_REUSEADDR, as torch's TCPStore binds: a
    closed connection's TIME_WAIT does not hold the port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def jobs_of(folder) -> list:
    """Processes whose command line names `folder` (a trial's train.py ranks or launcher)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(folder) in part for part in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


# ---------------------------------------------------------------------------------------------------- bad input
def main_in_process(args, capsys, monkeypatch) -> tuple[int, list]:
    """sweep.main in this process, the code a launch of sweep.py runs: (exit code, non-blank stderr lines)."""
    import sweep

    monkeypatch.chdir(REPO)
    capsys.readouterr()
    handler = signal.getsignal(signal.SIGTERM)  # main() installs its own
    try:
        sweep.main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        signal.signal(signal.SIGTERM, handler)
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("keys, message", [
    ({"space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2}}},
     "space key 'learning_rate' is not a train.py key"),
    ({"space": {"lr": {"type": "float", "low": 1e-2, "high": 1e-4}}}, "the range [0.01, 0.0001] is empty"),
    ({"space": {"model": {"type": "categorical", "choices": ["vit-debug", "vit-nonexistent"]}}},
     "with {'model': 'vit-nonexistent'}"),
    ({"space": {}}, "the space is empty"),
    ({"sampler": "bayes"}, "sampler must be one of tpe, random, grid, cmaes"),
    ({"trails": 3}, "unknown key 'trails'"),
    ({"objectives": [{"metric": "val_top1", "direction": "maximize"},
                     {"metric": "images_per_sec", "direction": "maximize"}], "pruner": "median"},
     "Optuna prunes single-objective studies only"),
])
def test_a_bad_study_is_one_line_and_no_trial(digits, tmp_path, keys, message, capsys, monkeypatch):
    study = write_study(tmp_path / "study.yaml", digits, **keys)
    code, lines = main_in_process(["--study", study, "--output_dir", tmp_path / "out"], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_recipe_no_trial_can_run_is_one_line_and_no_trial(digits, tmp_path, capsys, monkeypatch):
    """The base recipe is checked once by train.py's own input checks, before any trial: shards that are not
    there are one line and exit 2, no trial launched, no folder written."""
    missing = {**digits, "train": str(tmp_path / "gone" / "train-{000000..000003}.tar")}
    study = write_study(tmp_path / "study.yaml", missing)
    code, lines = main_in_process(["--study", study, "--output_dir", tmp_path / "out"], capsys, monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert "its base recipe cannot run: train_shards" in lines[0] and "4 of 4 shards not found" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_storage_that_does_not_answer_is_one_line(digits, tmp_path, capsys, monkeypatch):
    study = write_study(tmp_path / "study.yaml", digits)
    url = f"postgresql://sweeper:secret@127.0.0.1:{free_port()}/sweeps"
    code, lines = main_in_process(["--study", study, "--output_dir", tmp_path / "out", "--storage", url], capsys,
                                  monkeypatch)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: storage postgresql://sweeper:***@127.0.0.1") and "does not answer" in lines[0]
    assert "secret" not in lines[0] and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------- a study
def test_a_pruned_study_on_the_digits(digits, tmp_path):
    """Two 2-rank torchrun trials minimising the training loss: the recipe's lr first (enqueued), then lr 1.0,
    whose loss the median pruner finds above the first trial's at the same step (the same data order: the seed):
    its whole job is killed (the launcher and both ranks), its processes are gone and its port is free. The report, best.yaml (which train.py reads) and the
    history picture are written; a rerun continues the study and starts no trial."""
    study = write_study(tmp_path / "study.yaml", digits, pruner="median", sampler="random", seed=1,
                        pruner_startup_trials=1,  # here: pruned against the recipe's trial alone
                        launcher="torchrun", nproc_per_node=2,  # torchrun starts each rank in its own session
                        space={"lr": {"type": "categorical", "choices": [0.003, 1.0]}},
                        objectives=[{"metric": "loss", "direction": "minimize"}])
    out = tmp_path / "out"
    proc = sweep("--study", study, "--output_dir", out)
    import optuna

    loaded = optuna.load_study(study_name="study", storage=f"sqlite:///{out}/study.db")
    first, second = loaded.trials
    assert first.user_attrs["recipe"] and first.params == {"lr": 0.003} and first.state.name == "COMPLETE"
    assert second.params == {"lr": 1.0} and second.state.name == "PRUNED", proc.stdout
    step = second.user_attrs["pruned_at_step"]
    assert 1 < step < 20  # the first step is the same in both (the loss before any update)
    assert port_free(second.user_attrs["port"]) and port_free(first.user_attrs["port"])
    assert not jobs_of(out / "trials"), "a trial's job outlived the sweep"
    assert f"trial 1: pruned | lr=1 | pruned at step {step}" in proc.stdout
    report = (out / "report.md").read_text()
    assert f"| 1 | pruned | 1 |" in report and "the recipe" in report and f"pruned at step {step}" in report
    assert (out / "history.png").stat().st_size > 10_000
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["lr"] == 0.003 and best["model"] == "vit-debug" and best["output_dir"] == "runs/study-best"
    again = sweep("--study", study, "--output_dir", out)
    assert "trial " not in again.stdout and len(optuna.load_study(
        study_name="study", storage=f"sqlite:///{out}/study.db").trials) == 2
    from config import parse

    assert parse(["--config", str(out / "best.yaml")]).max_steps == 20  # a recipe train.py reads
    # the report from the storage alone, on another machine's folder: no trial folder there
    elsewhere = tmp_path / "elsewhere"
    proc = sweep("--study", study, "--output_dir", elsewhere, "--storage", f"sqlite:///{out}/study.db",
                 "--report_only")
    assert not (elsewhere / "trials" / "0000").exists() and yaml.safe_load((elsewhere / "best.yaml").read_text()) == best
    assert f"| 1 | pruned | 1 |" in (elsewhere / "report.md").read_text()
    assert first.user_attrs["run_dir"] == f"{socket.gethostname()}:{out / 'trials' / '0000'}"


# slow (~20 s): two more launches; the default run's pruned study checks a trial's launch, end and record
@pytest.mark.slow
def test_a_failing_and_an_infeasible_trial_are_recorded_and_the_study_goes_on(digits, tmp_path):
    """A trial whose job fails (a non-finite loss at lr 1e9: train.py's exit 5) is FAIL with its error line; one
    the planner predicts does not fit is FAIL as infeasible, never launched; the recipe's trial completes."""
    study = write_study(tmp_path / "study.yaml", digits, sampler="grid", trials=4,
                        space={"lr": {"type": "categorical", "choices": [0.003, 1.0e9]},
                               "micro_batch_size": {"type": "categorical", "choices": [16, 65536]}},
                        screen={"device": "cpu", "device_memory_gb": 4, "device_tflops": 0.1})
    # the overrides fix max_bad_steps low so the non-finite trial ends fast
    spec = yaml.safe_load(study.read_text())
    spec["overrides"].update(max_bad_steps=2, max_steps=10, eval_every=0)
    study.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    proc = sweep("--study", study, "--output_dir", out)
    import optuna

    trials = optuna.load_study(study_name="study", storage=f"sqlite:///{out}/study.db").trials
    states = {(t.params["lr"], t.params["micro_batch_size"]): t for t in trials}
    assert states[0.003, 16].state.name == "COMPLETE"
    infeasible = [t for t in trials if t.params["micro_batch_size"] == 65536]
    assert infeasible and all(t.state.name == "FAIL" and t.user_attrs["error"].startswith("infeasible: predicted "
                              "peak") and "port" not in t.user_attrs for t in infeasible), proc.stdout
    failed = states[1.0e9, 16]
    assert failed.state.name == "FAIL" and failed.user_attrs["error"].startswith("exit 5: error: step"), \
        failed.user_attrs
    assert "the recipe" in next(line for line in (out / "report.md").read_text().splitlines()
                                if line.startswith("| " + str(states[0.003, 16].number) + " |"))
    assert all("predicted_step_s" in t.user_attrs for t in trials)
    assert "measured_step_s" in states[0.003, 16].user_attrs


# ---------------------------------------------------------------------------------------------------- PostgreSQL
class Postgres:
    """A PostgreSQL server in a temporary folder on a free loopback port (as the `postgres` user when run as
    root: initdb refuses root)."""

    def __init__(self, root):
        self.root, self.port = str(root), free_port()
        os.makedirs(self.root, exist_ok=True)
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.root, "postgres")
        data = os.path.join(self.root, "data")
        self.run(f"{PG_BIN}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self.run(f"{PG_BIN}/pg_ctl", "-D", data, "-l", os.path.join(self.root, "server.log"), "-w", "-o",
                 f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1", "start")
        self.data = data
        self.run(f"{PG_BIN}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "sweeps")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/sweeps"

    def run(self, *cmd):
        subprocess.run(self.as_user + list(cmd), check=True, capture_output=True, timeout=120)

    def stop(self):
        self.run(f"{PG_BIN}/pg_ctl", "-D", self.data, "-m", "immediate", "stop")


@pytest.fixture
def postgres():
    if not os.path.exists(f"{PG_BIN}/initdb"):
        pytest.fail("PostgreSQL's initdb is not installed (the machine's PostgreSQL 15 is what this test runs)")
    root = tempfile.mkdtemp(prefix="sweep-pg-")  # outside pytest's folders, which the postgres user cannot enter
    server = Postgres(root)
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


# slow (~50 s): a PostgreSQL server, two workers and a heartbeat grace to wait out; the default run's studies go
# through the same trial loop on SQLite
@pytest.mark.slow
def test_two_workers_share_a_study_in_postgresql_and_a_killed_one_is_retried(digits, tmp_path, postgres):
    """Two `sweep.py --worker` processes on one study in PostgreSQL; worker A is killed with its trial's job (a
    lost node) mid-trial. Its trial goes stale (heartbeat 2 s), fails without an error of its own, and worker B
    runs its copy: every trial of the budget runs once to the end, none is lost, none runs twice at the same time."""
    study = write_study(tmp_path / "study.yaml", digits, sampler="random", trials=4, heartbeat_seconds=2,
                        space={"lr": {"type": "float", "low": 1e-3, "high": 5e-3, "log": True}})
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def worker(name):
        return subprocess.Popen([sys.executable, "sweep.py", "--study", str(study), "--output_dir", str(out),
                                 "--storage", postgres.url, "--worker"], cwd=REPO, env=env, text=True,
                                stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT)

    a, b = worker("a"), worker("b")  # both create the study: one does, the other loads it
    import optuna

    storage = optuna.storages.RDBStorage(postgres.url)
    deadline = time.monotonic() + 180
    while True:  # a trial of A's running, with its job
        try:
            trials = optuna.load_study(study_name="study", storage=storage).get_trials(deepcopy=False)
        except KeyError:  # not created yet
            trials = []
        victim = next((t for t in trials if t.state.name == "RUNNING" and t.user_attrs.get("worker_pid") == a.pid
                       and "job_pgid" in t.user_attrs), None)
        if victim is not None:
            break
        assert a.poll() is None, open(tmp_path / "a.log").read()[-2000:]
        assert time.monotonic() < deadline, "worker A never ran a trial"
        time.sleep(0.1)
    time.sleep(1.0)  # mid-trial
    a.kill()
    os.killpg(victim.user_attrs["job_pgid"], signal.SIGKILL)
    a.wait()
    assert b.wait(timeout=300) == 0, open(tmp_path / "b.log").read()[-3000:]
    trials = optuna.load_study(study_name="study", storage=storage).get_trials(deepcopy=False)
    states = [t.state.name for t in trials]
    assert states.count("COMPLETE") == 4, states
    lost = [t for t in trials if t.state.name == "FAIL"]
    assert [t.number for t in lost] == [victim.number] and "error" not in lost[0].user_attrs
    copy = next(t for t in trials if t.state.name == "COMPLETE" and t.params == victim.params
                and t.number != victim.number)
    assert copy.user_attrs["worker_pid"] == b.pid
    assert not any(t.state.name in ("RUNNING", "WAITING") for t in trials)
    report = sweep("--study", study, "--output_dir", out, "--storage", postgres.url, "--report_only")
    assert "4 complete" in (out / "report.md").read_text(), report.stdout


def test_the_shipped_study_files_load():
    """configs/sweeps/*.yaml pass every check a study gets before its first trial."""
    import sweep

    paths = sorted(glob.glob(os.path.join(REPO, "configs", "sweeps", "*.yaml")))
    assert paths
    for path in paths:
        spec = sweep.load_spec(path)
        assert spec.trials > 0 and spec.space


def test_the_pictures_and_the_journal_storage(tmp_path):
    """sweep.py's outputs on studies filled in-process (no launch): two objectives draw a Pareto front and the
    importances, one objective its history; a study in Optuna's journal file (the shared-file-system storage)
    is created, continued by a second open, and counted."""
    import optuna

    import sweep

    spec = sweep.StudySpec(name="pics", space={"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
                                               "drop_path": {"type": "float", "low": 0.0, "high": 0.3}},
                           objectives=[{"metric": "val_top1", "direction": "maximize"},
                                       {"metric": "images_per_sec", "direction": "maximize"}])
    storage = sweep.open_storage(f"journal:{tmp_path / 'study.log'}", 30)
    base = type("Base", (), {"max_steps": 100, "lr": 2e-3, "drop_path": 0.0})()
    study = sweep.open_study(spec, storage, base)
    [recipe] = study.trials  # the recipe's values, waiting: the first trial asked runs them
    assert recipe.state.name == "WAITING" and recipe.system_attrs["fixed_params"] == {"lr": 2e-3, "drop_path": 0.0}
    for i in range(6):
        trial = study.ask()
        values = sweep.suggest(trial, spec.space)
        study.tell(trial, [0.9 - values["drop_path"], 100 * values["lr"] ** 0.1])
    again = sweep.open_study(spec, sweep.open_storage(f"journal:{tmp_path / 'study.log'}", 30), base)
    assert len(again.trials) == 6 and again.trials[0].params == {"lr": 2e-3, "drop_path": 0.0}
    assert sweep.counted(again) == (6, 0, 0)
    out = tmp_path / "out"
    out.mkdir()
    assert sorted(sweep.draw(again, spec, str(out))) == ["importances.png", "pareto.png"]
    assert all((out / name).stat().st_size > 10_000 for name in ("importances.png", "pareto.png"))
    single = sweep.StudySpec(name="one", space=spec.space)
    one = optuna.create_study(direction="maximize")
    for i in range(3):
        trial = one.ask()
        one.tell(trial, sweep.suggest(trial, single.space)["lr"])
    assert sorted(sweep.draw(one, single, str(out))) == ["history.png", "importances.png"]
