"""Sweep train.py's hyperparameters with an Optuna study: every trial is its own train.py launch.

    python sweep.py --study configs/sweeps/digits.yaml                  # SQLite in the output folder, one worker
    python sweep.py --study my-study.yaml --storage postgresql://user@db/sweeps --worker    # one of many workers
    python sweep.py --study my-study.yaml --storage journal:/shared/sweeps/study.log          # a shared file system

A study file (YAML; its keys are StudySpec's below) names the base recipe, the keys each trial fixes, the search
space over any train.py key, the objective(s), the sampler, the pruner, how many trials and how long. Each trial
gets a fresh master port and folder (`<output_dir>/trials/NNNN/`); the planner screens it first (`screen`), so a
configuration predicted not to fit is recorded as infeasible without a launch; a pruner reads the evaluations
train.py writes to metrics.jsonl and ends a losing trial's job (its whole process group); a trial that fails
(exit code, a non-finite loss, out of memory) is recorded with its error line and the study goes on. Rerunning
the same command continues the study; a worker killed mid-trial leaves a trial that another worker retries
(Optuna's heartbeat). At the end (not with --worker): report.md, best.yaml (the best trial's resolved config, a
recipe for `train.py --config`) and PNG pictures in the output folder (docs/sweeps.md).
"""
import argparse
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import yaml

import launch.job
from config import KEYS, ConfigError, parse, to_dict

REPO = os.path.dirname(os.path.abspath(__file__))
EXIT_BAD_INPUT = 2


@dataclass
class StudySpec:
    """Every key of a study file, its default and meaning: the one place they are defined."""
    name: str = ""  # the study's name in its storage; "" = the study file's name without .yaml
    recipe: str = ""  # the base train.py recipe (YAML); "" = config.py's defaults
    overrides: dict = field(default_factory=dict)  # train.py keys every trial sets (shorter runs, eval_every...)
    space: dict = field(default_factory=dict)  # key: {type: float|int|categorical, low, high, log, step, choices}
    objectives: list = field(default_factory=lambda: [{"metric": "val_top1", "direction": "maximize"}])  # 1 or 2: a metric of summary.json or metrics.jsonl (peak_mem_bytes: its maximum)
    sampler: str = "tpe"  # tpe | random | grid (every key categorical or stepped) | cmaes
    sampler_startup_trials: int = 0  # tpe: random trials before it models the space; 0 = a third of trials
    pruner: str = "none"  # none | median | successive_halving | hyperband: on the first objective as metrics.jsonl records it (val_*: each evaluation; loss: each step), one objective only
    pruner_warmup_steps: int = 0  # steps before a trial can be pruned (median: n_warmup_steps; halving/hyperband: min_resource)
    pruner_startup_trials: int = 0  # median: complete trials before any pruning, and the fewest a trial is compared with at a step; 0 = max(3, trials // 4)
    trials: int = 10  # trials in the study, all workers together (a failed one counts; a retried one once)
    timeout_minutes: float = 0.0  # no new trial starts after this long in one invocation; 0 = no limit
    launcher: str = "torchrun"  # deepspeed | torchrun | accelerate | python (one rank)
    nproc_per_node: int = 2  # ranks per trial
    seed: int = 0  # the sampler's seed
    heartbeat_seconds: int = 30  # a RUNNING trial whose worker has not beaten for 2x this is retried
    screen: dict = field(default_factory=dict)  # plan.py's cluster keys (device, device_memory_gb, device_tflops...); {} = no screening


SPACE_TYPES = ("float", "int", "categorical")
SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
LAUNCHERS = launch.job.LAUNCHERS


class TrialFailed(Exception):
    """A trial's job failed or could not start; the study records it and goes on."""


# ---------------------------------------------------------------------------------------------------- the study file
def load_spec(path: str) -> StudySpec:
    """The study file, checked: an unknown key, an empty range, a model that does not exist or a train.py key
    that does not exist is a ConfigError (one line, exit 2, no trial launched)."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read study file '{path}': {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"study file '{path}' is not valid YAML: {e}") from None
    known = {f.name: f for f in dataclasses.fields(StudySpec)}
    if not isinstance(raw, dict) or (unknown := [k for k in raw if k not in known]):
        raise ConfigError(f"study file '{path}': unknown key {unknown[0]!r} (known: {', '.join(known)})"
                          if isinstance(raw, dict) else f"study file '{path}' must hold a mapping of key: value")
    spec = StudySpec(**raw)
    spec.name = spec.name or os.path.splitext(os.path.basename(path))[0]
    for key, kinds in (("overrides", dict), ("space", dict), ("objectives", list), ("screen", dict)):
        if not isinstance(getattr(spec, key), kinds):
            raise ConfigError(f"study file '{path}': {key} must be a {kinds.__name__}")
    for key, choices in (("sampler", SAMPLERS), ("pruner", PRUNERS), ("launcher", LAUNCHERS)):
        if getattr(spec, key) not in choices:
            raise ConfigError(f"study file '{path}': {key} must be one of {', '.join(choices)}, got "
                              f"{getattr(spec, key)!r}")
    if spec.sampler_startup_trials < 0 or spec.pruner_startup_trials < 0:
        raise ConfigError(f"study file '{path}': sampler_startup_trials and pruner_startup_trials must be >= 0")
    if spec.trials <= 0 or spec.nproc_per_node <= 0 or spec.heartbeat_seconds <= 0:
        raise ConfigError(f"study file '{path}': trials, nproc_per_node and heartbeat_seconds must be positive")
    if spec.launcher == "python" and spec.nproc_per_node != 1:
        raise ConfigError(f"study file '{path}': launcher python starts one rank; set nproc_per_node 1 or another "
                          f"launcher")
    if not spec.space:
        raise ConfigError(f"study file '{path}': the space is empty: name at least one train.py key to search")
    for key, dist in spec.space.items():
        check_dimension(path, key, dist, spec.sampler)
    if not 1 <= len(spec.objectives) <= 2 or not all(
            isinstance(o, dict) and set(o) == {"metric", "direction"} and o["direction"] in ("maximize", "minimize")
            for o in spec.objectives):
        raise ConfigError(f"study file '{path}': objectives are 1 or 2 of {{metric: NAME, direction: maximize|"
                          f"minimize}}")
    if spec.pruner != "none" and len(spec.objectives) > 1:
        raise ConfigError(f"study file '{path}': pruner {spec.pruner} with two objectives: Optuna prunes "
                          f"single-objective studies only; set pruner none")
    for values in trial_configs(spec):  # every categorical choice, on the base config: a missing model fails here
        check_trial_config(path, spec, values)
    check_base_input(path, spec)
    return spec


def check_base_input(path: str, spec: StudySpec):
    """train.py's own input checks on the base recipe, once, before any trial: its shards, labels, model files and
    trackers (in a scratch output folder, removed after), so that a recipe no trial can run is one line, not
    every trial failing alike."""
    import contextlib
    import io
    import tempfile

    import train

    with tempfile.TemporaryDirectory() as scratch:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                train.check_run(parse(train_args(spec, {}, os.path.join(scratch, "check"))), spec.nproc_per_node, 0)
        except (ConfigError, ValueError, OSError) as e:
            raise ConfigError(f"study file '{path}': its base recipe cannot run: {e}") from None


def check_dimension(path: str, key: str, dist, sampler: str):
    where = f"study file '{path}': space key {key!r}"
    if key not in KEYS or key in ("output_dir", "resume"):
        raise ConfigError(f"{where} is not a train.py key that a trial can set (config.py lists them)")
    if not isinstance(dist, dict) or dist.get("type") not in SPACE_TYPES:
        raise ConfigError(f"{where}: give {{type: float|int|categorical, ...}}")
    if dist["type"] == "categorical":
        if not isinstance(dist.get("choices"), list) or not dist["choices"]:
            raise ConfigError(f"{where}: categorical needs a non-empty list of choices")
        return
    low, high = dist.get("low"), dist.get("high")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) or not low < high:
        raise ConfigError(f"{where}: the range [{low}, {high}] is empty (low < high needed)")
    if dist.get("log") and low <= 0:
        raise ConfigError(f"{where}: a log range needs low > 0, got {low}")
    if sampler == "grid" and not dist.get("step"):
        raise ConfigError(f"{where}: the grid sampler needs choices or a step for every key")


def trial_configs(spec: StudySpec):
    """The base config with each categorical choice in turn (and once plainly): what load_spec checks."""
    yield {}
    for key, dist in spec.space.items():
        for choice in dist.get("choices", []) if dist["type"] == "categorical" else []:
            yield {key: choice}


def train_args(spec: StudySpec, values: dict, output_dir: str) -> list[str]:
    """train.py's arguments for a trial: the recipe, the fixed keys, the trial's values, its folder."""
    args = ["--config", spec.recipe] if spec.recipe else []
    for key, value in {**spec.overrides, **values}.items():
        args += [f"--{key}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return args + ["--output_dir", output_dir, "--progress", "false"]


def check_trial_config(path: str, spec: StudySpec, values: dict):
    from models.tasks import run_config

    try:
        cfg = parse(train_args(spec, values, "runs/sweep-check"))
        run_config(cfg)
    except (ConfigError, ValueError, OSError) as e:
        raise ConfigError(f"study file '{path}'" + (f" with {values}" if values else "") + f": {e}") from None


# ---------------------------------------------------------------------------------------------------- storage
def open_storage(url: str, heartbeat_seconds: int):
    """Optuna's storage for `url` (sqlite:///..., postgresql://..., journal:PATH), with the heartbeat that retries
    a dead worker's trial; a database that does not answer is a ConfigError."""
    import warnings

    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if url.startswith("journal:"):
        return JournalStorage(JournalFileBackend(url[len("journal:"):]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its heartbeat experimental
        retry = RetryHeartbeatStaleTrialCallback(max_retry=3)
        try:
            kwargs = {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}
            return RDBStorage(url, heartbeat_interval=heartbeat_seconds, grace_period=2 * heartbeat_seconds,
                              heartbeat_stale_trial_callback=retry, engine_kwargs=kwargs)
        except Exception as e:  # noqa: BLE001 - SQLAlchemy's many errors are one answer for the user
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"storage {redact(url)} does not answer ({type(e).__name__}: {text[:300]})") from None


def redact(url: str) -> str:
    """A storage URL without its password."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':')[0]}:***@{host}" if ":" in creds else url
    return url


def sampler_of(spec: StudySpec):
    import optuna

    if spec.sampler == "grid":
        grid = {}
        for key, dist in spec.space.items():
            if dist["type"] == "categorical":
                grid[key] = dist["choices"]
            else:
                n = int(round((dist["high"] - dist["low"]) / dist["step"]))
                grid[key] = [dist["low"] + i * dist["step"] for i in range(n + 1)]
        return optuna.samplers.GridSampler(grid, seed=spec.seed)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=spec.seed)
    if spec.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=spec.seed)
    return optuna.samplers.TPESampler(seed=spec.seed, multivariate=True, n_startup_trials=startup_trials(spec)[0])


def startup_trials(spec: StudySpec) -> tuple[int, int]:
    """(TPE's random start-up trials, the median pruner's complete trials before it prunes): at most a third of the
    study random, so that TPE models most of it; a trial pruned only against the median of several complete ones,
    never the first alone. Optuna's own defaults (10 random trials; prune against 5) assume studies of hundreds."""
    return (spec.sampler_startup_trials or max(1, spec.trials // 3),
            spec.pruner_startup_trials or max(3, spec.trials // 4))


def pruner_of(spec: StudySpec, max_steps: int):
    import optuna

    if spec.pruner == "median":
        n = startup_trials(spec)[1]
        return optuna.pruners.MedianPruner(n_startup_trials=n, n_warmup_steps=spec.pruner_warmup_steps,
                                           n_min_trials=n)
    if spec.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=spec.pruner_warmup_steps or "auto")
    if spec.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, spec.pruner_warmup_steps), max_resource=max_steps)
    return optuna.pruners.NopPruner()


def open_study(spec: StudySpec, storage, base):
    """The study, created or continued; a new one's first trial is the recipe's own values."""
    import optuna

    kwargs = dict(study_name=spec.name, storage=storage, sampler=sampler_of(spec), pruner=pruner_of(spec, base.max_steps),
                  directions=[o["direction"] for o in spec.objectives])
    try:
        study = optuna.create_study(**kwargs)
    except optuna.exceptions.DuplicatedStudyError:  # another worker, or an earlier invocation, created it
        return optuna.create_study(load_if_exists=True, **kwargs)
    recipe = {key: getattr(base, key) for key in spec.space}
    study.set_user_attr("recipe_values", recipe)  # the report marks the trial that ran them
    if all(in_space(spec.space[key], value) for key, value in recipe.items()) and spec.sampler != "grid":
        # the shipped recipe first (by the invocation that created the study): the report says how far the sweep
        # moved from it. The grid sampler would not count an enqueued point as visited: it runs its grid.
        study.enqueue_trial(recipe, user_attrs={"recipe": True})
    return study


def in_space(dist: dict, value) -> bool:
    if dist["type"] == "categorical":
        return value in dist["choices"]
    return isinstance(value, (int, float)) and dist["low"] <= value <= dist["high"]


def suggest(trial, space: dict) -> dict:
    values = {}
    for key, dist in space.items():
        if dist["type"] == "categorical":
            values[key] = trial.suggest_categorical(key, dist["choices"])
        elif dist["type"] == "int":
            values[key] = trial.suggest_int(key, int(dist["low"]), int(dist["high"]), step=int(dist.get("step", 1)),
                                            log=bool(dist.get("log")))
        else:
            values[key] = trial.suggest_float(key, float(dist["low"]), float(dist["high"]), step=dist.get("step"),
                                              log=bool(dist.get("log")))
    return values


# ---------------------------------------------------------------------------------------------------- a trial
def screen(spec: StudySpec, args: list[str]) -> dict | None:
    """plan.py's prediction for a trial (peak bytes, capacity, step seconds), or None without `screen`."""
    if not spec.screen:
        return None
    import contextlib
    import io

    import plan as planner_cli  # plan.py's own reading of the keys, in this process (a second is seconds of imports)

    cluster = {"world_size": spec.nproc_per_node, "ranks_per_node": spec.nproc_per_node, **spec.screen}
    argv = [*args[:-4], *[a for k, v in cluster.items() for a in (f"--{k}", str(v))], "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        planner_cli.main(argv)  # exits 1 when the configuration does not fit, after its JSON
    try:
        plan = json.loads(out.getvalue())
    except ValueError:
        raise TrialFailed(f"the planner could not plan it: {last_error(err.getvalue() + out.getvalue())}") from None
    return {"peak_bytes": plan["peak_bytes"], "capacity_bytes": plan["capacity_bytes"], "fits": plan["fits"],
            "step_s": plan["step_s"]}


def last_error(text: str) -> str:
    """The line a failed job ends with: its last `error:` line, else its last non-blank line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "error:" in line[:40]]
    return (errors or lines or ["(no output)"])[-1][:500]


def read_records(path: str, offset: int) -> tuple[list, int]:
    """The whole lines of metrics.jsonl after byte `offset`, and the offset after them."""
    try:
        with open(path) as f:
            f.seek(offset)
            text = f.read()
    except FileNotFoundError:
        return [], offset
    complete = text[:text.rfind("\n") + 1]
    records = []
    for line in complete.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records, offset + len(complete.encode())


def stop_job(proc: subprocess.Popen):
    """Ends a trial's whole job and waits for it: its process group and every descendant (torchrun starts each
    rank in a session of its own, so the group alone would leave the ranks running)."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def objective_values(spec: StudySpec, run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    records, _ = read_records(os.path.join(run_dir, "metrics.jsonl"), 0)
    values = []
    for o in spec.objectives:
        metric = o["metric"]
        if metric == "peak_mem_bytes":
            value = max((r[metric] for r in records if r.get(metric) is not None), default=None)
        elif metric in summary:
            value = summary[metric]
        else:
            value = next((r[metric] for r in reversed(records) if r.get(metric) is not None), None)
        if value is None or not math.isfinite(value):
            raise TrialFailed(f"the run did not record {metric} (summary.json, metrics.jsonl)")
        values.append(float(value))
    return values


def run_trial(trial, spec: StudySpec, output_dir: str, parent_run: str) -> list[float] | float:
    """One trial: its values, the planner's screen, its job watched for pruning, its objective(s). A failure is
    TrialFailed with the trial's `error` attribute set (what tells it from a trial whose worker died)."""
    import optuna

    state = "complete"
    try:
        return _run_trial(trial, spec, output_dir, parent_run)
    except TrialFailed as e:
        state = "fail"
        trial.set_user_attr("error", str(e))
        raise
    except optuna.TrialPruned:
        state = "pruned"
        raise
    finally:
        if parent_run:
            mark_nested_run(os.path.join(output_dir, "trials", f"{trial.number:04d}"), trial.number, state)


def _run_trial(trial, spec: StudySpec, output_dir: str, parent_run: str) -> list[float] | float:
    import optuna

    values = suggest(trial, spec.space)
    run_dir = os.path.join(output_dir, "trials", f"{trial.number:04d}")
    trial.set_user_attr("run_dir", f"{socket.gethostname()}:{os.path.abspath(run_dir)}")  # where its files are
    args = train_args(spec, values, run_dir)
    predicted = screen(spec, args)
    if parent_run:  # each trial a nested MLflow run under the study's
        args += ["--tracking_parent", parent_run, "--run_name", f"{spec.name}-trial-{trial.number:04d}"]
    if predicted:
        trial.set_user_attr("predicted_step_s", predicted["step_s"])
        trial.set_user_attr("predicted_peak_gib", predicted["peak_bytes"] / 2**30)
        if not predicted["fits"]:
            why = (f"infeasible: predicted peak {predicted['peak_bytes'] / 2**30:.2f} GiB > "
                   f"{predicted['capacity_bytes'] / 2**30:.2f} GiB usable (not launched)")
            trial.set_user_attr("error", why)
            raise TrialFailed(why)
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(output_dir, "trials", f"{trial.number:04d}.log")
    started = time.monotonic()
    open(log_path, "w").close()
    job = launch.job.start(args, launcher=spec.launcher, nproc=spec.nproc_per_node, log_path=log_path)
    proc = job.proc
    trial.set_user_attr("port", job.port)
    trial.set_user_attr("job_pgid", proc.pid)  # the job's process group: launcher and ranks
    trial.set_user_attr("worker_pid", os.getpid())
    metric, offset, reached = spec.objectives[0]["metric"], 0, 0
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            records, offset = read_records(os.path.join(run_dir, "metrics.jsonl"), offset)
            for record in records:
                reached = max(reached, record["step"])
                if record.get(metric) is not None and len(spec.objectives) == 1:  # evaluations, or every step
                    trial.report(record[metric], record["step"])
                    if trial.should_prune():
                        stop_job(proc)
                        trial.set_user_attr("pruned_at_step", record["step"])
                        trial.set_user_attr("seconds", time.monotonic() - started)
                        raise optuna.TrialPruned(f"pruned at step {record['step']}")
    except BaseException:
        stop_job(proc)  # an interrupted worker leaves no job behind
        raise
    trial.set_user_attr("seconds", time.monotonic() - started)
    trial.set_user_attr("steps", reached)
    if proc.returncode != 0:
        with open(log_path) as f:
            why = f"exit {proc.returncode}: {last_error(f.read())}"
        trial.set_user_attr("error", why)
        raise TrialFailed(why)
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            measured = json.load(f).get("images_per_sec")
    except (OSError, ValueError):
        measured = None
    if measured:
        base = parse(args)
        trial.set_user_attr("measured_step_s", base.micro_batch_size * base.grad_accum_steps *
                            spec.nproc_per_node / measured)
    result = objective_values(spec, run_dir)
    return result[0] if len(result) == 1 else result


# ---------------------------------------------------------------------------------------------------- the loop
def counted(study) -> tuple[int, int, int]:
    """(trials that count against the budget: finished, failed by their job, running or waiting; of them waiting;
    running). A trial failed by a stale heartbeat does not count: its retry does."""
    from optuna.trial import TrialState

    n = waiting = running = 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.FAIL and "error" not in t.user_attrs:
            continue  # its worker died; RetryHeartbeatStaleTrialCallback enqueued a copy
        n += 1
        waiting += t.state == TrialState.WAITING
        running += t.state == TrialState.RUNNING
    return n, waiting, running


def run_trials(study, spec: StudySpec, output_dir: str, parent_run: str):
    """Trials until the study holds `trials` of them, finished; meanwhile another worker's trial may go stale
    (its worker died), fail and come back as a waiting copy, which a live worker runs."""
    import warnings

    import optuna

    start = time.monotonic()
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental
            optuna.storages.fail_stale_trials(study)
        n, waiting, running = counted(study)
        if waiting or n < spec.trials:
            if spec.timeout_minutes and time.monotonic() - start > spec.timeout_minutes * 60:
                print(f"sweep: the time budget ({spec.timeout_minutes:g} min) is spent: no new trial")
                return
            study.optimize(lambda t: run_trial(t, spec, output_dir, parent_run), n_trials=1, catch=(TrialFailed,),
                           gc_after_trial=False,
                           callbacks=[lambda _, trial: print(describe_trial(trial, spec), flush=True)])
        elif running:  # another worker's: wait for it to finish, or to be found stale and retried
            time.sleep(min(5.0, spec.heartbeat_seconds))
        else:
            return


def describe_trial(t, spec: StudySpec) -> str:
    values = t.values if t.values else None
    shown = ", ".join(f"{k}={fmt(v)}" for k, v in t.params.items())
    what = {"COMPLETE": lambda: " ".join(f"{o['metric']} {fmt(v)}" for o, v in zip(spec.objectives, values)),
            "PRUNED": lambda: f"pruned at step {t.user_attrs.get('pruned_at_step', '?')}",
            "FAIL": lambda: t.user_attrs.get("error", "its worker stopped (retried)")}.get(t.state.name,
                                                                                          lambda: t.state.name)()
    return f"trial {t.number}: {t.state.name.lower()} | {shown} | {what}"


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ---------------------------------------------------------------------------------------------------- outputs
def write_report(study, spec: StudySpec, output_dir: str) -> str:
    """report.md, best.yaml and the pictures; returns the report's path."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    keys = list(spec.space)
    names = [o["metric"] for o in spec.objectives]
    started = min((t.datetime_start for t in trials if t.datetime_start), default=None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# Sweep `{spec.name}`", "",
             f"Started {started:%Y-%m-%d %H:%M} at commit {commit or '?'}, on {os.cpu_count()} cores."
             if started else "No trial yet.", "",
             f"{len(trials)} trials: " + ", ".join(
                 f"{sum(t.state == s for t in trials)} {s.name.lower()}" for s in
                 (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)
                 if any(t.state == s for t in trials)) +
             ". Objective: " + ", ".join(f"{o['direction']} {o['metric']}" for o in spec.objectives) + "; sampler "
             f"{spec.sampler}, pruner {spec.pruner}; launcher {spec.launcher} x {spec.nproc_per_node}; base "
             f"{spec.recipe or 'config.py defaults'} with {spec.overrides}.", "",
             "| trial | state | " + " | ".join(keys) + " | " + " | ".join(names) +
             " | steps | seconds | step s (planned / measured) | note |",
             "|---" * (len(keys) + len(names) + 6) + "|"]
    for t in trials:
        a = t.user_attrs
        # a pruned trial's value is its last intermediate one, not a result: shown in its note
        objective = [fmt(v) for v in t.values] if t.values and t.state == TrialState.COMPLETE else [""] * len(names)
        planned = f"{a['predicted_step_s']:.3g}" if "predicted_step_s" in a else "-"
        measured = f"{a['measured_step_s']:.3g}" if "measured_step_s" in a else "-"
        note = "the recipe" if is_recipe(study, t) else ""
        if t.state == TrialState.FAIL:
            note = (note + "; " if note else "") + a.get("error", "its worker stopped; retried as a later trial")
        if t.state == TrialState.PRUNED:
            last = f" ({names[0]} {fmt(t.values[0])} there)" if t.values else ""
            note = (note + "; " if note else "") + f"pruned at step {a.get('pruned_at_step', '?')}{last}"
        lines.append(f"| {t.number} | {t.state.name.lower()} | " + " | ".join(fmt(t.params.get(k, "")) for k in keys)
                     + " | " + " | ".join(objective) + f" | {a.get('pruned_at_step', a.get('steps', ''))} | "
                     f"{a.get('seconds', 0):.0f} | {planned} / {measured} | {note} |")
    lines += ["", "Each trial's files are in `trials/NNNN` of the output folder of the worker that ran it; the study "
                  "records that folder as the trial's `run_dir` (host:path), and this report and `best.yaml` are "
                  "built from the study alone."]
    screened = [t for t in trials if t.state == TrialState.FAIL and "infeasible" in t.user_attrs.get("error", "")]
    if spec.screen:
        lines.append(f"Screened by the planner for {spec.screen} before launch: " + (
            "; ".join(f"trial {t.number} ({', '.join(f'{k}={fmt(v)}' for k, v in t.params.items())}: "
                      f"{t.user_attrs['error']})" for t in screened) if screened else "every trial fitted") + ".")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trials if len(names) > 1 else [study.best_trial]
        lines += ["", "Best" + (" (the Pareto front)" if len(best) > 1 else "") + ": " + "; ".join(
            f"trial {t.number} ({', '.join(f'{k}={fmt(v)}' for k, v in t.params.items())}: "
            f"{', '.join(f'{n} {fmt(v)}' for n, v in zip(names, t.values))})" for t in best)]
        recipe = next((t for t in complete if is_recipe(study, t)), None)
        if recipe and len(names) == 1:
            b = best[0]
            lines.append(f"The recipe's own values (trial {recipe.number}) gave {names[0]} {fmt(recipe.values[0])}; "
                         f"the best {fmt(b.values[0])} ({b.values[0] - recipe.values[0]:+.4g}).")
        elif recipe:
            signs = [1 if o["direction"] == "maximize" else -1 for o in spec.objectives]
            better = [t for t in complete if t is not recipe and all(s * (a - r) >= 0 for s, a, r in
                                                                     zip(signs, t.values, recipe.values))
                      and any(s * (a - r) > 0 for s, a, r in zip(signs, t.values, recipe.values))]
            lines.append(f"The recipe's own values (trial {recipe.number}) gave " + ", ".join(
                f"{n} {fmt(v)}" for n, v in zip(names, recipe.values)) + "; " + (
                "trials " + ", ".join(str(t.number) for t in better) + " beat it on both objectives (the best of "
                "them: " + ", ".join(f"{n} {fmt(v)}" for n, v in zip(names, max(
                    better, key=lambda t: signs[0] * t.values[0]).values)) + ")" if better else
                "no trial beat it on both objectives: it is on the Pareto front"
                if recipe in best else "no trial beat it on both objectives") + ".")
        write_best(best[0], spec, output_dir)
        lines += ["", f"`best.yaml`: trial {best[0].number}'s resolved config, for `train.py --config "
                      f"{os.path.join(output_dir, 'best.yaml')}`."]
    pictures = draw(study, spec, output_dir)
    lines += [""] + [f"![{name}]({name})" for name in pictures]
    path = os.path.join(output_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def is_recipe(study, trial) -> bool:
    return bool(trial.user_attrs.get("recipe")) or trial.params == study.user_attrs.get("recipe_values")


def write_best(trial, spec: StudySpec, output_dir: str):
    """best.yaml: the base recipe with the trial's values, resolved as train.py reads them; from the study alone
    (the trial's own folder may be on another node)."""
    resolved = to_dict(parse(train_args(spec, trial.params, os.path.join("runs", f"{spec.name}-best"))))
    resolved["progress"] = True
    with open(os.path.join(output_dir, "best.yaml"), "w") as f:
        f.write(f"# sweep {spec.name}: trial {trial.number}, {', '.join(f'{k}={fmt(v)}' for k, v in trial.params.items())}"
                f"\n")
        yaml.safe_dump(resolved, f, sort_keys=False)


def draw(study, spec: StudySpec, output_dir: str) -> list[str]:
    """Optuna's own pictures as PNG: the optimisation history, the parameters' importances (with two complete
    trials or more), the Pareto front (two objectives)."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as vis
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    names = [o["metric"] for o in spec.objectives]
    wanted = []
    if len(names) == 1:
        wanted.append(("history.png", lambda: vis.plot_optimization_history(study, target_name=names[0])))
    else:
        wanted.append(("pareto.png", lambda: vis.plot_pareto_front(study, target_names=names)))
    varied = [k for k in spec.space if len({t.params.get(k) for t in complete}) > 1]
    if len(complete) >= 2 and varied:
        wanted.append(("importances.png", lambda: vis.plot_param_importances(
            study, target=(lambda t: t.values[0]) if len(names) > 1 else None, target_name=names[0])))
    drawn = []
    for name, plot in wanted:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            try:
                ax = plot()
            except (ValueError, RuntimeError) as e:
                print(f"sweep: {name} not drawn ({e})", file=sys.stderr)
                continue
        fig = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
        fig.tight_layout()
        fig.savefig(os.path.join(output_dir, name), dpi=110)
        plt.close(fig)
        drawn.append(name)
    return drawn


# ---------------------------------------------------------------------------------------------------- tracking
def parent_run(study, base, spec: StudySpec) -> str:
    """With mlflow in the base config's report_to: the study's MLflow run (created once, its id kept in the
    study), under which each trial's run nests."""
    from runlog import tracking

    if "mlflow" not in tracking.chosen(base):
        return ""
    if "mlflow_run_id" in study.user_attrs:
        return study.user_attrs["mlflow_run_id"]
    tracking.check_reachable(base)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking.mlflow_uri(base) or None)
    name = tracking.project(base, "mlflow")
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    run_id = client.create_run(experiment_id, run_name=f"sweep-{spec.name}",
                               tags={"sweep": spec.name, "sampler": spec.sampler, "pruner": spec.pruner}).info.run_id
    study.set_user_attr("mlflow_run_id", run_id)
    return run_id


def mark_nested_run(run_dir: str, number: int, state: str):
    """The trial's MLflow run tagged with its trial number and state; a pruned trial's (its job killed) ends
    KILLED, a failed one's FAILED (train.py ends a finished one's itself)."""
    from runlog import tracking

    run = tracking.read_state(run_dir).get("mlflow")
    if not run:
        return  # not launched (infeasible), or it failed before its logs opened
    tracking.mlflow_quick_failures()
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(run["tracking_uri"])
        client.set_tag(run["run_id"], "sweep.trial", str(number))
        client.set_tag(run["run_id"], "sweep.state", state)
        if state != "complete":
            client.set_terminated(run["run_id"], "KILLED" if state == "pruned" else "FAILED")
    except Exception as e:  # noqa: BLE001 - the study goes on whatever the tracker says
        print(f"warning: mlflow: trial {number}'s run not updated ({tracking.first_line(e)})", file=sys.stderr)


def close_parent(study, base, run_id: str):
    if not run_id:
        return
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    from runlog import tracking

    tracking.mlflow_quick_failures()
    client = MlflowClient(tracking.mlflow_uri(base) or None)
    trials = study.get_trials(deepcopy=False)
    for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
        client.log_metric(run_id, f"trials_{state.name.lower()}", sum(t.state == state for t in trials))
    if any(t.state == TrialState.COMPLETE for t in trials) and len(study.directions) == 1:
        client.log_metric(run_id, "best_value", study.best_value)
        for k, v in study.best_params.items():  # tags: a rerun of the study may find another best
            client.set_tag(run_id, f"best.{k}", str(v))
    client.set_terminated(run_id, "FINISHED")


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--study", required=True, help="the study file (YAML; StudySpec's keys)")
    parser.add_argument("--output_dir", help="report, best.yaml, pictures, trials/ (default runs/sweeps/<name>)")
    parser.add_argument("--storage", help="sqlite:///PATH (default: study.db in the output folder), "
                                          "postgresql://..., or journal:PATH (a shared file system)")
    parser.add_argument("--worker", action="store_true", help="run trials of a shared study; leave the report to the "
                                                              "main invocation")
    parser.add_argument("--trials", type=int, help="override the study file's trials")
    parser.add_argument("--report_only", action="store_true", help="write the report of the study as it stands")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # SIGTERM (a scheduler's, a user's kill) unwinds like Ctrl-C: the running trial's job is ended first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        spec = load_spec(args.study)  # every check that can fail before a trial starts
        if args.trials:
            spec.trials = args.trials
        output_dir = args.output_dir or os.path.join("runs", "sweeps", spec.name)
        if args.storage:  # a database that does not answer leaves no folder behind
            storage = open_storage(args.storage, spec.heartbeat_seconds)
        os.makedirs(output_dir if args.report_only else os.path.join(output_dir, "trials"), exist_ok=True)
        if not args.storage:
            storage = open_storage(f"sqlite:///{os.path.abspath(output_dir)}/study.db", spec.heartbeat_seconds)
        base = parse(train_args(spec, {}, output_dir))
        study = open_study(spec, storage, base)
        parent = parent_run(study, base, spec)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    if not args.report_only:
        run_trials(study, spec, output_dir, parent)
    if not args.worker:
        close_parent(study, base, parent)
        print(f"sweep: report {write_report(study, spec, output_dir)}")


if __name__ == "__main__":
    main()
