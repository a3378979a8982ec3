"""Experiment trackers beside TensorBoard: MLflow and W&B, chosen by `report_to` and fed by RunLog on rank 0 from
what the loop already read (no extra device read).

- MLflow (`tracking_uri`, else $MLFLOW_TRACKING_URI, else MLflow's default store): the resolved config as
  parameters, tags (engine, ZeRO stage, world size, commit, task, model), every logged step's metrics, the run's
  files and pictures as artifacts. A background thread sends them in order; what fails is kept and retried every
  few seconds, so a server that goes away costs one warning, and what is still unsent at the end is listed.
- W&B: offline unless $WANDB_MODE says otherwise (`wandb sync <output_dir>/wandb/offline-run-*` uploads it later);
  the same metrics, config, tags, pictures and files, in `<output_dir>/wandb/`.

A run's tracker ids sit in `<output_dir>/tracking.json`: `--resume` continues the same tracked runs (on any number
of ranks, after a kill -9 too); a run without --resume starts new ones.
"""
import collections
import io
import json
import os
import subprocess
import sys
import threading
import time

from config import Config, ConfigError

STATE_FILE = "tracking.json"
RETRY_SECONDS = 5.0  # a failed send is retried this often
CLOSE_SECONDS = 30.0  # at the end, how long unsent operations are retried before they are listed
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chosen(cfg: Config) -> list[str]:
    """The trackers `report_to` names, in its order ("none": no tracker, metrics.jsonl only)."""
    names = [n.strip() for n in cfg.report_to.split(",") if n.strip()]
    return [] if names == ["none"] else names


def mlflow_uri(cfg: Config) -> str:
    return cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def project(cfg: Config, tracker: str) -> str:
    env = {"mlflow": "MLFLOW_EXPERIMENT_NAME", "wandb": "WANDB_PROJECT"}[tracker]
    return cfg.project or os.environ.get(env, "") or "vit-training"


def run_name(cfg: Config) -> str:
    return cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir))


def wandb_mode() -> str:
    return os.environ.get("WANDB_MODE", "offline")


def source_commit() -> str:
    """The checkout's commit, with "+dirty" when tracked files differ from it; "" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode:
            return ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return ""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def mlflow_quick_failures():
    """MLflow retries a failed request for minutes by default; here a failure returns at once and the sender
    retries it (each variable stays as the user set it)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def check_reachable(cfg: Config):
    """A tracker the user asked for that does not answer: ConfigError (one line, exit 2) before anything is
    written. Rank 0 only: the other ranks never talk to a tracker."""
    names = chosen(cfg)
    if "mlflow" in names:
        mlflow_quick_failures()
        from mlflow.tracking import MlflowClient

        uri = mlflow_uri(cfg)
        try:
            MlflowClient(uri or None).search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - any failure of the store is the same answer for the user
            raise ConfigError(f"report_to mlflow: the tracking store {uri or '(MLflow default)'} does not answer "
                              f"({first_line(e)}); start it, set tracking_uri, or leave mlflow out of report_to") \
                from None
    if "wandb" in names and wandb_mode() == "online":
        import urllib.error
        import urllib.request

        base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        try:
            urllib.request.urlopen(base, timeout=10).close()
        except urllib.error.HTTPError:
            pass  # it answered
        except (OSError, ValueError) as e:
            raise ConfigError(f"report_to wandb: WANDB_MODE is online but {base} does not answer ({first_line(e)});"
                              f" set WANDB_MODE=offline (the default here) and `wandb sync` later") from None


class _Sender(threading.Thread):
    """Sends a tracker's operations in order from a background thread. A failed send stays at the head of the
    queue and is retried every RETRY_SECONDS: the training loop never waits on the network."""

    def __init__(self, name: str, warn):
        super().__init__(name=f"{name}-sender", daemon=True)
        self.tracker, self.warn = name, warn
        self.metrics = []  # (key, value, step, timestamp_ms), sent in batches
        self.ops = collections.deque()  # (description, callable)
        self.cv = threading.Condition()
        self.closing, self.deadline, self.down = False, 0.0, False
        self.send_metrics = None  # callable(list) set by the tracker
        self.on_sent = lambda step: None  # called with the last step whose every metric value has been sent
        self.start()

    def put_metrics(self, values: list):
        with self.cv:
            self.metrics.extend(values)
            self.cv.notify()

    def put(self, what: str, fn):
        with self.cv:
            self.ops.append((what, fn))
            self.cv.notify()

    def run(self):
        while True:
            with self.cv:
                while not (self.metrics or self.ops or self.closing):
                    self.cv.wait()
                if not (self.metrics or self.ops):
                    return
                batch = self.metrics[:1000]  # MLflow's log_batch takes at most 1000 metrics
                op = None if batch else self.ops[0]
            try:
                self.send_metrics(batch) if batch else op[1]()
            except Exception as e:  # noqa: BLE001 - the run goes on whatever the tracker says
                if not self.down:
                    self.warn(f"warning: {self.tracker}: could not send {'metrics' if batch else op[0]} "
                              f"({first_line(e)}); training goes on, metrics.jsonl keeps every value, and what is "
                              f"not sent is retried every {RETRY_SECONDS:g} s")
                self.down = True
                with self.cv:
                    if self.closing and time.monotonic() >= self.deadline:
                        return
                    wait = RETRY_SECONDS if not self.closing else min(RETRY_SECONDS, self.deadline - time.monotonic())
                    self.cv.wait(max(wait, 0.0))
                continue
            with self.cv:
                if batch:
                    del self.metrics[:len(batch)]
                    through = self.metrics[0][2] - 1 if self.metrics else batch[-1][2]
                else:
                    self.ops.popleft()
            if batch:
                self.on_sent(through)
            if self.down:
                self.down = False
                self.warn(f"{self.tracker}: the tracking server answers again; what was held back is being sent")

    def close(self, seconds: float) -> list[str]:
        """Sends what is queued within `seconds`; what is left, described (metric values and their steps, then
        each other operation)."""
        with self.cv:
            self.closing, self.deadline = True, time.monotonic() + seconds
            self.cv.notify()
        self.join(seconds + 15.0)  # a send in flight ends within MLFLOW_HTTP_REQUEST_TIMEOUT
        with self.cv:
            left = []
            if self.metrics:
                steps = [m[2] for m in self.metrics]
                left.append(f"{len(self.metrics)} metric values of steps {min(steps)}-{max(steps)}")
            return left + [what for what, _ in self.ops]


class MLflowTracker:
    name = "mlflow"

    def __init__(self, cfg: Config, state: dict | None, params: dict, tags: dict, warn, save_state, logged: list):
        """`logged`: the records metrics.jsonl keeps (a resumed run's); those past the step the previous
        launch confirmed sent (a kill -9 loses what was in flight) are sent again."""
        mlflow_quick_failures()
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(mlflow_uri(cfg) or None)
        if state:  # the same run, continued (its parameters as logged; a changed one is tagged)
            self.run_id = state["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            before = client.get_run(self.run_id).data.params
            changed = {k: v for k, v in params.items() if k in before and before[k] != v}
            params = {k: v for k, v in params.items() if k not in before}
            tags = {**tags, **{f"resumed.{k}": v for k, v in changed.items()}}
        else:
            name = project(cfg, "mlflow")
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
            nested = {"mlflow.parentRunId": cfg.tracking_parent} if cfg.tracking_parent else {}
            self.run_id = client.create_run(experiment_id, run_name=run_name(cfg), tags=nested).info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 parameters
            client.log_batch(self.run_id, params=items[i:i + 100])
        client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
        sent_through = state.get("sent_through", 0) if state else 0
        self.state = {"run_id": self.run_id, "tracking_uri": client.tracking_uri, "sent_through": sent_through}
        self.save_state = save_state
        self.sender = _Sender("mlflow", warn)
        self.sender.send_metrics = self._send_metrics
        self.sender.on_sent = self._sent
        for record in logged:
            if record["step"] > sent_through:
                self.metrics(record["step"], {k: v for k, v in record.items() if k != "step" and v is not None})

    def _sent(self, step: int):
        if step > self.state["sent_through"]:
            self.state["sent_through"] = step
            self.save_state()

    def _send_metrics(self, values):
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, t, s) for k, v, s, t in values])

    def metrics(self, step: int, values: dict):
        now = int(time.time() * 1000)
        self.sender.put_metrics([(k, v, step, now) for k, v in values.items()])

    def image(self, key: str, step: int, png: bytes):
        from PIL import Image

        name = f"figures/{key.replace('/', '-')}-step{step:07d}.png"
        self.sender.put(name, lambda: self.client.log_image(self.run_id, Image.open(io.BytesIO(png)),
                                                            artifact_file=name))

    def files(self, paths: list[str], folder: str = ""):
        for path in paths:
            what = os.path.join(folder, os.path.basename(path))
            if os.path.isdir(path):
                self.sender.put(what, lambda p=path, w=what: self.client.log_artifacts(self.run_id, p, w))
            elif os.path.exists(path):
                self.sender.put(what, lambda p=path: self.client.log_artifact(self.run_id, p, folder or None))

    def close(self, status: str, seconds: float = CLOSE_SECONDS) -> list[str]:
        self.sender.put(f"the run's status {status}", lambda: self.client.set_terminated(self.run_id, status))
        return self.sender.close(seconds)


class WandbTracker:
    name = "wandb"

    def __init__(self, cfg: Config, state: dict | None, params: dict, tags: dict, warn, save_state, logged: list):
        import wandb

        self.wandb = wandb
        kwargs = {} if os.environ.get("WANDB_DIR") else {"dir": cfg.output_dir}
        self.run = wandb.init(project=project(cfg, "wandb"), name=run_name(cfg), mode=wandb_mode(),
                              id=state["id"] if state else None, resume="allow" if state else None,
                              config={**params, **{f"tag.{k}": v for k, v in tags.items()}},
                              tags=[f"{k}:{v}"[:64] for k, v in tags.items() if v != ""],
                              settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True),
                              **kwargs)
        self.state = {"id": self.run.id, "project": self.run.project, "mode": wandb_mode()}

    def metrics(self, step: int, values: dict):
        self.run.log(values, step=step)

    def image(self, key: str, step: int, png: bytes):
        from PIL import Image

        self.run.log({key: self.wandb.Image(Image.open(io.BytesIO(png)))}, step=step)

    def files(self, paths: list[str], folder: str = ""):
        """The run's files as one artifact (type run-files), a folder as its own (type model)."""
        files = [p for p in paths if os.path.isfile(p)]
        if files:
            artifact = self.wandb.Artifact(f"run-{self.run.id}-files", type="run-files")
            for path in files:
                artifact.add_file(path, name=os.path.join(folder, os.path.basename(path)))
            self.run.log_artifact(artifact)
        for path in paths:
            if os.path.isdir(path):
                artifact = self.wandb.Artifact(f"run-{self.run.id}-{os.path.basename(path)}", type="model")
                artifact.add_dir(path)
                self.run.log_artifact(artifact)

    def close(self, status: str, seconds: float = CLOSE_SECONDS) -> list[str]:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        self.wandb.teardown()  # the service process ends with the run, not at an exit that os._exit skips
        return []


def read_state(output_dir: str) -> dict:
    try:
        with open(os.path.join(output_dir, STATE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def open_trackers(cfg: Config, resuming: bool, params: dict, tags: dict, warn, logged: list) -> list:
    """The trackers `report_to` names beside TensorBoard, each continuing the run `tracking.json` records when
    resuming (`logged`: the records metrics.jsonl keeps); their state written back there, atomically, whenever it
    changes."""
    state = read_state(cfg.output_dir) if resuming else {}
    opened, lock = [], threading.Lock()
    path = os.path.join(cfg.output_dir, STATE_FILE)

    def save_state():
        with lock:
            with open(path + ".tmp", "w") as f:
                json.dump({t.name: t.state for t in opened}, f, indent=1)
            os.replace(path + ".tmp", path)

    for name in chosen(cfg):
        if name == "mlflow":
            previous = state.get("mlflow")
            if previous and previous.get("tracking_uri") != _mlflow_store(cfg):
                warn(f"mlflow: tracking.json's run is in {previous.get('tracking_uri')}, this run logs to "
                     f"{_mlflow_store(cfg)}: a new MLflow run starts there")
                previous = None
            opened.append(MLflowTracker(cfg, previous, params, tags, warn, save_state, logged if previous else []))
        elif name == "wandb":
            opened.append(WandbTracker(cfg, state.get("wandb"), params, tags, warn, save_state, logged))
    if opened:
        save_state()
    return opened


def _mlflow_store(cfg: Config) -> str:
    """The store MLflow's client resolves (its default when neither tracking_uri nor the variable names one)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(mlflow_uri(cfg) or None).tracking_uri


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def warn_stderr(line: str):
    print(line, file=sys.stderr, flush=True)
