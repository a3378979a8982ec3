"""The GPU check: what one call on the one-H200 machine measures, in parts, each under its own time limit, inside
one time budget, with every result written to the output folder (benchmarks/gpu_check.sh runs it; read it first).

    python3 -m benchmarks.gpu_check OUT                      # the second version's parts (1 7 8 9) in the budget
    PARTS="5 6" python3 -m benchmarks.gpu_check OUT          # those parts only: a second call
    SMOKE=1 python3 -m benchmarks.gpu_check OUT              # on CPU, tiny shapes, fp32: the same files

Parts (the default, the check's second version: 1, 7, 8 and 9; the first version's 2-6 by PARTS):
  1 machine   versions (against benchmarks/device/stack.txt), the device, a GEMM's rate (bf16 8192^3: MFU's peak)
  7 trainer   ViT-L/16 at 224^2 through train.py (synthetic data, bf16) at plan.py's micro-batch: FSDP2 at none,
              light and selective; DeepSpeed ZeRO-3 at none and light, ZeRO-2 and ZeRO-1 at none
  8 compiled  part 7's FSDP2 + none with each block compiled, and ZeRO-3 + none under DeepCompile
  9 worker    part 7's FSDP2 + none through the benchmark worker's plain FSDP2 (train.py within 5% of it?)
  10 race     the seed's race where memory binds: ViT-H/14 at 224^2, bf16, the GPU capped at 40 GiB, a global
              batch of 256; plain FSDP2 (the worker: none, Hugging Face's full and every-2) against this project's
              policies under FSDP2 and DeepSpeed, each at the largest micro-batch plan.py fits (confirmed: halved
              once on a failure); plain ZeRO-3's peak at the winner's micro-batch. A second call: PARTS="1 10"
  2 vit-l     ViT-L/16 at 224^2, micro-batch 32: FSDP2, ZeRO-2 and ZeRO-3 at none, selective and full
              (train_bench.py's gpu-check suite: images/s, MFU, torch.cuda peaks against plan.py's)
  3 digits    train.py's main job (configs/digits-vit.yaml) in bf16 on one rank, with its evaluation, under
              DeepSpeed (the recipe's engine) and under FSDP2 (`--engine fsdp2`)
  4 policies  every activation-checkpointing policy's losses against none's under ZeRO-3, in bf16
  5 planned   part 2 at the micro-batch plan.py picks for one H200
  6 compile   part 3's job under torch.compile, and under DeepSpeed's compiler (deepcompile) with ZeRO-3

OUT receives: gpu_check.log (every command and its output), results.json (every figure), report.md (the tables
and the targets), pareto.png (part 2's images/s against peak memory) and traces/ (at most 3 gzipped CUDA traces of
one warm step). Nothing else: the runs' own folders stay in a scratch folder. A part that does not fit the
remaining budget is not started; the summary names the PARTS of a second call.
"""
import csv
import datetime
import glob
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.environ.get("SMOKE", "") not in ("", "0")
BUDGET_S = float(os.environ.get("BUDGET_S", 1500 if SMOKE else 480))
TRACE_LIMIT_BYTES = 15 * 2**20  # a returned file's limit is 16 MiB
# the configurations whose warm step is kept as a trace
TRACED = ("deepspeed-zero3-none", "deepspeed-zero3-selective", "fsdp2-reshard-none")
# the targets on the H200 (docs/benchmarks.md)
TARGET_MFU, TARGET_DS_SPEED, TARGET_SELECTIVE, TARGET_PEAK_ERROR = 0.40, 0.95, 1.10, 0.10
# the second version's (docs/benchmarks.md): MFU through train.py, and the plain FSDP2 script's best
# ViT-L/16 images/s on one H200 (2026-12-04, micro-batch 256: results/gpu-check/2026-12-04-parts-1-4/README.md)
TARGET_TRAINER_MFU, PLAIN_SCRIPT_BEST = 0.45, 1152


class Part:
    def __init__(self, number: int, name: str, expected_s: tuple, limit_s: tuple, what: str):
        self.number, self.name, self.what = number, name, what
        self.expected_s, self.limit_s = expected_s[SMOKE], limit_s[SMOKE]


# (GPU, smoke) seconds: what a part is expected to take, and its limit (docs/benchmarks.md: on the GPU, parts 1-4 fill
# a first call's budget, 5-6 a second's)
PARTS = [Part(1, "machine", (25, 15), (90, 60), "versions, device, GEMM rate"),
         Part(2, "vit-l", (330, 90), (420, 200), "ViT-L/16, micro-batch 32, 3 engines x 3 policies"),
         Part(3, "digits", (120, 100), (240, 200), "train.py's main job, bf16, with evaluation, DeepSpeed and FSDP2"),
         Part(4, "policies", (60, 30), (150, 120), "every ac policy against none, ZeRO-3, bf16"),
         Part(5, "planned", (420, 90), (480, 200), "ViT-L/16 at plan.py's micro-batch"),
         Part(6, "compile", (150, 60), (240, 150), "torch.compile and deepcompile"),
         Part(7, "trainer", (220, 150), (330, 300), "ViT-L/16 through train.py at plan.py's micro-batch"),
         Part(9, "worker", (40, 40), (90, 120), "part 7's FSDP2 + none through the benchmark worker"),
         Part(8, "compiled", (200, 120), (300, 300), "part 7's FSDP2 compiled per block; ZeRO-3 under DeepCompile"),
         Part(10, "race", (330, 200), (450, 400), "ViT-H/14 at an A100-40GB's memory: plain FSDP2 against ours")]
DEFAULT_PARTS = (1, 7, 8, 9)


class Timeout(Exception):
    """The part running reached its limit."""


class Stopped(Exception):
    """SIGTERM or SIGINT: the call was stopped from outside."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Check:
    """The state of one call: the scratch folder, the log, the results, the deadline of the part running."""

    def __init__(self, out: str):
        self.out, self.work = out, tempfile.mkdtemp(prefix="gpu_check_")
        os.makedirs(out, exist_ok=True)
        self.log = open(os.path.join(out, "gpu_check.log"), "a")
        self.started = time.monotonic()
        self.deadline = None
        self.results = {"date": datetime.date.today().isoformat(), "commit": commit(), "smoke": SMOKE,
                        "budget_s": BUDGET_S, "parts": {}}
        self.part, self.partial, self.running = None, {}, None  # the part running, its figures so far, its job
        self.env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
        self.extensions = extensions()  # what this call builds is the difference at its end
        if SMOKE:
            self.env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # ------------------------------------------------------------------ what is kept as it ends
    def start_part(self, name: str):
        self.part, self.partial, self.running = name, {}, None

    def jobs(self) -> dict:
        """The running part's jobs, kept as each ends (`keep`): what a part stopped midway still reports."""
        return self.partial.setdefault("jobs", {})

    def begin(self, name: str):
        """The job `name` starts: results.json says it is the one running."""
        self.running = name
        self.save()

    def keep(self, name: str, job: dict, where: dict | None = None) -> dict:
        """A finished job's figures, into the running part's jobs (or `where`) and results.json at once."""
        (self.jobs() if where is None else where)[name] = job
        self.running = None
        self.save()
        return job

    def save(self):
        """results.json as it stands, written whole (a temporary file renamed): a call killed at any moment leaves
        every job finished before it."""
        results = dict(self.results, seconds=round(self.elapsed(), 1))
        if self.part and self.part not in results["parts"]:
            results["parts"] = {**results["parts"], self.part: {"status": "running", "figures": self.partial,
                                                                "running": self.running}}
        tmp = os.path.join(self.out, ".results.json.tmp")
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(tmp, os.path.join(self.out, "results.json"))

    def say(self, line: str):
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, cmd: list, env: dict = None) -> int:
        """One command in its own process group, its output into the log; the group is killed at the part's
        deadline, and on anything else that ends the wait (SIGTERM, SIGINT: `Stopped`), so no child outlives it."""
        self.log.write(f"\n$ {' '.join(map(str, cmd))}\n")
        self.log.flush()
        proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                env={**self.env, **(env or {})}, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise Timeout from None
        except BaseException:
            kill_group(proc)
            raise

    def torchrun(self, script: str, *args, env=None) -> int:
        from launch.job import command

        return self.run(command("torchrun", 1, script=[script, *map(str, args)]), env)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (its children, theirs, ...), read from /proc. torchrun starts each rank in a
    session of its own, so the launcher's process group does not hold them."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_group(proc: subprocess.Popen):
    """SIGKILL to a child, every process below it (a launcher's ranks, in their own sessions) and its process
    group, then reap the child."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def commit() -> str:
    """The commit of the tree this call runs: GPU_CHECK_COMMIT when the caller names it, else .whl/COMMIT, which
    benchmarks/device/wheels.sh writes when it prepares the tree (the copied tree has no .git of its own, and an
    enclosing repository's HEAD would be another commit)."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        with open(os.path.join(REPO, ".whl", "COMMIT")) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown (no .whl/COMMIT: prepare the tree with make wheels)"


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- the parts
def machine(check: Check) -> dict:
    out = os.path.join(check.work, "machine.json")
    if check.run([sys.executable, "-m", "benchmarks.gpu_check", "--machine", out]) != 0:
        raise RuntimeError("the machine probe failed (gpu_check.log)")
    return read_json(out)


def probe_machine(out: str):
    """Run in a child process: versions, the device and the GEMM rate MFU is read against."""
    import importlib.metadata as metadata
    import platform

    import torch

    from benchmarks.device.stack import pins

    expected = pins("installed") | pins("carried")
    versions = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "webdataset", "numpy", "safetensors"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    differ = {k: {"installed": v, "stack.txt": expected[k]} for k, v in versions.items()
              if k in expected and (v or "").split("+")[0] != expected[k]}
    cuda = torch.cuda.is_available()
    result = {"python": platform.python_version(), "versions": versions, "differ_from_stack": differ,
              "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if cuda else cpu_name(),
              "device_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    device = "cuda" if cuda else "cpu"
    from loop.timing import clock

    a = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ a
    rates = []
    for _ in range(5):
        start = clock(torch.device(device))
        for _ in range(10):
            a @ a
        rates.append(10 * 2 * n**3 / (clock(torch.device(device)) - start) / 1e12)
    rates.sort()
    result["gemm"] = {"n": n, "dtype": str(dtype).split(".")[-1], "tflops_median": rates[2], "tflops_min": rates[0],
                      "tflops_max": rates[-1]}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "CPU")


def extensions() -> set:
    """The C++/CUDA ops built so far in torch's extension cache (DeepSpeed JIT-builds its ops there)."""
    from pathlib import Path

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    return {str(p.relative_to(root)) for p in root.glob("*/*") if p.is_dir()} if root.is_dir() else set()


def suite(check: Check, name: str, micro_batch_size: int = 0, traces: bool = False, host_probe: bool = True) -> dict:
    out = os.path.join(check.work, name)
    env = {}
    if traces:  # each job's warm-up step (after its 2 profiled steps) traced
        env = {"BENCH_TRACE_DIR": os.path.join(check.work, "traces"), "BENCH_TRACE_STEP": "3"}
        os.makedirs(env["BENCH_TRACE_DIR"], exist_ok=True)
    rc = check.run([sys.executable, "-m", "benchmarks.train_bench", "--suite", "gpu-check-smoke" if SMOKE else "gpu-check",
                    "--out", out] + (["--micro_batch_size", micro_batch_size] if micro_batch_size else [])
                   + ([] if host_probe else ["--no_host_probe"]), env)
    if not os.path.exists(os.path.join(out, "results.csv")):
        raise RuntimeError(f"the suite wrote no results (exit {rc}; gpu_check.log)")
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    planner = read_json(os.path.join(out, "planner.json")) if os.path.exists(os.path.join(out, "planner.json")) else []
    with open(os.path.join(out, "results.md")) as f:
        markdown = f.read()
    return {"exit": rc, "rows": rows, "planner": planner, "dir": out, "results_md": markdown}


def vit_l(check: Check) -> dict:
    result = suite(check, "suite-mb32", traces=True)
    shutil.copy(os.path.join(result["dir"], "pareto.png"), os.path.join(check.out, "pareto.png"))
    return result


def digits_shards(check: Check):
    if not os.path.exists(os.path.join(REPO, "data", "digits", "_info.json")):
        if check.run([sys.executable, "data/make_shards.py", "digits", "data/digits"]) != 0:
            raise RuntimeError("writing the digits shards failed (gpu_check.log)")


def train_job(check: Check, name: str, *extra) -> dict:
    digits_shards(check)
    out = os.path.join(check.work, name)
    args = ["--config", "configs/digits-vit.yaml", "--save_every", 0, "--output_dir", out, "--progress", "false"]
    args += ["--precision", "fp32", "--max_steps", 40, "--eval_every", 20] if SMOKE else ["--precision", "bf16"]
    started = time.monotonic()
    rc = check.torchrun("train.py", *args, *extra)
    if rc != 0 or not os.path.exists(os.path.join(out, "summary.json")):
        raise RuntimeError(f"train.py exited {rc} (gpu_check.log)")
    summary = read_json(os.path.join(out, "summary.json"))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    return {"val_top1": summary["val_top1"], "images_per_sec": summary["images_per_sec"],
            "steps": summary["steps_this_launch"], "seconds": round(time.monotonic() - started, 1),
            "peak_mem_bytes": last.get("peak_mem_bytes"), "loss": last["loss"]}


def digits(check: Check) -> dict:
    """The main job under each engine; an engine's failure is its entry, the other still runs."""
    from benchmarks.suites import DEEPSPEED, FSDP2

    jobs = check.partial  # {engine: its job}
    for engine in (DEEPSPEED, FSDP2):
        check.begin(engine)
        try:
            check.keep(engine, train_job(check, f"digits-{engine}", "--engine", engine), jobs)
        except RuntimeError as e:
            check.keep(engine, {"error": str(e)}, jobs)
    if all("error" in job for job in jobs.values()):
        raise RuntimeError("; ".join(f"{k}: {v['error']}" for k, v in jobs.items()))
    return jobs


def policies(check: Check) -> dict:
    out = os.path.join(check.work, "policies.json")
    shape = ["--model", "vit-debug", "--image_size", 16, "--patch_size", 0, "--micro_batch_size", 8, "--steps", 6] \
        if SMOKE else ["--steps", 20]
    rc = check.torchrun("-m", "benchmarks.policy_check", "--out", out, *shape)
    if rc != 0 or not os.path.exists(out):
        raise RuntimeError(f"policy_check.py exited {rc} (gpu_check.log)")
    return read_json(out)


def planned_micro_batch(check: Check) -> int:
    """The micro-batch of plan.py's fastest configuration of ViT-L/16 on one H200 at a global batch of 256 (smoke:
    vit-debug on a CPU of 8 GiB)."""
    out = os.path.join(check.work, "plan.json")
    cluster = ["--model", "vit-debug", "--image_size", 16, "--device", "cpu", "--device_memory_gb", 8,
               "--device_tflops", 0.1, "--global_batch", 32] if SMOKE else \
        ["--model", "vit-large", "--image_size", 224, "--patch_size", 16, "--device", "h200", "--global_batch", 256]
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, "plan.py", *map(str, cluster), "--num_labels", "10", "--precision",
                               "fp32" if SMOKE else "bf16", "--world_size", "1", "--ranks_per_node", "1", "--json"],
                              cwd=REPO, env=check.env, stdout=f, stderr=check.log, text=True,
                              timeout=max(1.0, check.deadline - time.monotonic()))
    if proc.returncode != 0:
        raise RuntimeError(f"plan.py exited {proc.returncode} (gpu_check.log)")
    return int(read_json(out)["best"]["micro_batch_size"])


def planned(check: Check) -> dict:
    mb = planned_micro_batch(check)
    check.say(f"   plan.py's micro-batch: {mb}")
    # the host probe ran in the first suite (the same model): not again in the device's time
    return dict(suite(check, "suite-planned", micro_batch_size=mb, host_probe=False), micro_batch_size=mb)


def compiled(check: Check) -> dict:
    result = {}
    for name, extra in [("torch.compile", ["--compile", "true"]),
                        ("deepcompile", ["--compile", "true", "--zero_stage", 3,
                                         "--ds_config", "ds_configs/zero3_deepcompile.json"])]:
        if SMOKE and name == "deepcompile":
            result[name] = {"skipped": "deepcompile needs a GPU"}
            continue
        try:
            result[name] = train_job(check, name.replace(".", "_"), *extra)
        except RuntimeError as e:
            result[name] = {"error": str(e)}
    return result


# ----------------------------------------------------------------------------- the second version: train.py on ViT-L
VIT_L = ["--model", "vit-large", "--image_size", 224, "--patch_size", 16, "--num_labels", 1000, "--precision", "bf16"]
SMOKE_SHAPE = ["--model", "vit-debug", "--image_size", 16, "--num_labels", 10, "--precision", "fp32"]
TRAINER_STEPS, STEADY_FROM = (16, 5), (8, 3)  # (GPU, smoke): steps of a job, and the first step its speed counts
TRAINER_RUNS = [("fsdp2", 3, "none"), ("fsdp2", 3, "light"), ("fsdp2", 3, "selective"), ("deepspeed", 3, "none"),
                ("deepspeed", 3, "light"), ("deepspeed", 2, "none"), ("deepspeed", 1, "none")]


def trainer_job(check: Check, name: str, engine: str, stage: int, ac: str, micro: int, *extra) -> dict:
    """One train.py job on synthetic data: its steady images/s, peak memory and the loss it ended at."""
    out = os.path.join(check.work, name)
    steps, first = TRAINER_STEPS[SMOKE], STEADY_FROM[SMOKE]
    args = [*(SMOKE_SHAPE if SMOKE else VIT_L), "--engine", engine, "--zero_stage", stage, "--ac", ac,
            "--micro_batch_size", micro, "--data_mode", "synthetic", "--max_steps", steps, "--log_every", 4,
            "--eval_every", 0, "--save_every", 0, "--warmup_steps", 1000, "--output_dir", out, "--progress", "false",
            *extra]
    started = time.monotonic()
    rc = check.torchrun("train.py", *args)
    if rc != 0 or not os.path.exists(os.path.join(out, "summary.json")):
        return {"error": f"train.py exited {rc} (gpu_check.log)", "seconds": round(time.monotonic() - started, 1)}
    from benchmarks.measure import steady_images_per_sec

    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(os.path.join(out, "hf_model"), ignore_errors=True)  # the scratch disk: a ViT-L export is 1.2 GB
    return {"engine": engine, "zero_stage": stage, "ac": ac, "micro_batch_size": micro, "extra": list(map(str, extra)),
            "images_per_sec": steady_images_per_sec(records, first),
            "images_per_sec_all": read_json(os.path.join(out, "summary.json"))["images_per_sec"],
            "peak_mem_bytes": max(r.get("peak_mem_bytes") or 0 for r in records), "loss": records[-1]["loss"],
            "seconds": round(time.monotonic() - started, 1)}


def forward_flops_per_image() -> float:
    """The model's forward FLOPs per image (matmuls and attention), from the planner's profile on the meta device."""
    from ac.profile import profile_model
    from config import Config

    cfg = Config(model="vit-debug", image_size=16, num_labels=10, micro_batch_size=1) if SMOKE else \
        Config(model="vit-large", image_size=224, patch_size=16, num_labels=1000, micro_batch_size=1)
    return profile_model(cfg, "cpu" if SMOKE else "cuda")[0].forward_flops


def with_mfu(check: Check, job: dict, flops: float) -> dict:
    gemm = check.results["parts"].get("machine", {}).get("figures", {}).get("gemm", {}).get("tflops_median")
    if job.get("images_per_sec") and gemm:
        job["mfu"] = job["images_per_sec"] * 3 * flops / (gemm * 1e12)
    return job


def trainer_figures(check: Check) -> dict:
    """Part 7's figures, where it ran in this call ({} otherwise)."""
    return check.results["parts"].get("trainer", {}).get("figures") or {}


def trainer_micro_batch(check: Check) -> int:
    """Part 7's micro-batch, or plan.py's where part 7 did not run in this call."""
    return trainer_figures(check).get("micro_batch_size") or planned_micro_batch(check)


def trainer(check: Check) -> dict:
    micro = planned_micro_batch(check)
    check.say(f"   plan.py's micro-batch: {micro}")
    flops = forward_flops_per_image()
    check.partial.update(micro_batch_size=micro, forward_flops_per_image=flops)
    jobs = check.jobs()
    for engine, stage, ac in TRAINER_RUNS:
        name = f"{engine}-zero{stage}-{ac}"
        check.begin(name)
        check.keep(name, with_mfu(check, trainer_job(check, name, engine, stage, ac, micro), flops))
        check.say(f"   {name}: " + (f"{jobs[name]['images_per_sec']:.0f} img/s" if jobs[name].get("images_per_sec")
                                     else jobs[name].get("error", "")))
    return {"micro_batch_size": micro, "forward_flops_per_image": flops, "jobs": jobs}


def compiled_trainer(check: Check) -> dict:
    micro = trainer_micro_batch(check)
    flops = trainer_figures(check).get("forward_flops_per_image") or forward_flops_per_image()
    jobs = {"fsdp2-zero3-none-compiled": ("fsdp2", 3, ["--compile", "true"]),
            "deepspeed-zero3-none-deepcompile": ("deepspeed", 3, ["--compile", "true", "--ds_config",
                                                                  "ds_configs/zero3_deepcompile.json"])}
    check.partial["micro_batch_size"] = micro
    kept = check.jobs()
    for name, (engine, stage, extra) in jobs.items():
        if SMOKE and "deepcompile" in name:
            check.keep(name, {"skipped": "DeepCompile needs a GPU"})
            continue
        check.begin(name)
        check.keep(name, with_mfu(check, trainer_job(check, name, engine, stage, "none", micro, *extra), flops))
    return {"micro_batch_size": micro, "jobs": kept}


def worker(check: Check) -> dict:
    """Part 7's FSDP2 + none through benchmarks/bench_worker.py's plain FSDP2 (fully_shard per block, torch's clip)."""
    micro = trainer_micro_batch(check)
    shape = {"model": "vit-debug", "image_size": 16, "patch_size": 0} if SMOKE else \
        {"model": "vit-large", "image_size": 224, "patch_size": 16}
    spec = {"engine": "fsdp2", **shape, "micro_batch_size": micro, "reshard": True, "ac": "none", "num_labels": 1000,
            "profiled_steps": 2, "warmup_steps": 2, "timed_steps": 8 if not SMOKE else 2, "count_flops": False}
    out = os.path.join(check.work, "worker.json")
    rc = check.torchrun("-m", "benchmarks.bench_worker", "--spec", json.dumps(spec), "--out", out)
    if rc != 0 or not os.path.exists(out):
        raise RuntimeError(f"bench_worker exited {rc} (gpu_check.log)")
    result = read_json(out)
    figures = {"spec": spec, "images_per_sec": result["images_per_sec"], "peak_alloc_bytes": result["peak_alloc_bytes"]}
    trained = trainer_figures(check).get("jobs", {}).get("fsdp2-zero3-none", {}).get("images_per_sec")
    if trained:
        figures["trainer_over_worker"] = trained / result["images_per_sec"]
    return figures




# ----------------------------------------------------------------------------- the report
# ----------------------------------------------------------------------------- part 10: the race where memory binds
# ViT-H/14 at 224², bf16, one GPU capped at an A100-40GB's memory (train.py's device_memory_gb, the worker's too):
# each configuration at the largest micro-batch plan.py says fits, accumulating to the same global batch.
# Smoke: vit-debug, fp32, on CPU (no cap: the planner's budget is a CPU's 8 GiB).
RACE_SHAPE = {"model": "vit-huge", "image_size": 224, "patch_size": 14, "num_labels": 1000}
RACE_SMOKE_SHAPE = {"model": "vit-debug", "image_size": 16, "patch_size": 0, "num_labels": 10}
RACE_BUDGET_GIB, RACE_GLOBAL_BATCH = (40, 8), (256, 16)  # (GPU, smoke)
RACE_MICROS = (4, 8, 16, 32, 64, 128, 256)
RACE_STEPS, RACE_STEADY_FROM = (10, 4), (5, 2)
# plain FSDP2 as its users run it (the benchmark worker: fully_shard per block, resharding, Hugging Face's own
# checkpointing), and the planner's policy that counts the same recompute
RACE_PLAIN = [("none", "none"), ("hf:full", "full"), ("hf:every_n:2", "every_n:2")]
# this project's: either engine, its policies
RACE_OURS = [("fsdp2", 3, "light"), ("fsdp2", 3, "selective"), ("fsdp2", 3, "full"), ("deepspeed", 3, "light"),
             ("deepspeed", 3, "selective"), ("deepspeed", 2, "light")]


def race_micro(engine: str, stage: int, ac: str) -> int:
    """The largest of RACE_MICROS whose planned peak fits the race's budget (plan.py's estimate, bf16 on the
    H200 capped; smoke: fp32 on a CPU of 8 GiB), 0 when none does."""
    from dataclasses import replace

    from config import Config
    from engine.registry import engine_class
    from models.registry import model_config, width
    from planner.devices import DEVICES, Device
    from planner.estimate import estimate

    shape = RACE_SMOKE_SHAPE if SMOKE else RACE_SHAPE
    precision = "fp32" if SMOKE else "bf16"
    device = Device("cpu", 1e11, RACE_BUDGET_GIB[1], 10, 10, 0.0, mem_gbs=10) if SMOKE else \
        replace(DEVICES["h200"], memory_gib=RACE_BUDGET_GIB[0])
    hidden = width(model_config(shape["model"], shape["num_labels"], shape["image_size"], shape["patch_size"]))
    best = 0
    for micro in RACE_MICROS:
        if micro > RACE_GLOBAL_BATCH[SMOKE]:
            break
        cfg = Config(**shape, engine=engine, zero_stage=stage, ac=ac, micro_batch_size=micro, precision=precision,
                     grad_accum_steps=RACE_GLOBAL_BATCH[SMOKE] // micro)
        engine_config = engine_class(engine).engine_config(cfg, hidden, 1, precision, 1, gpu=not SMOKE)
        if estimate(cfg, engine_config, precision, 1, 1, device)["fits"]:
            best = micro
    return best


def race_trainer_job(check: Check, name: str, engine: str, stage: int, ac: str, micro: int, capped: bool = True) -> dict:
    shape = RACE_SMOKE_SHAPE if SMOKE else RACE_SHAPE
    out = os.path.join(check.work, name)
    args = [*(f for k, v in shape.items() for f in (f"--{k}", v)), "--precision", "fp32" if SMOKE else "bf16",
            "--engine", engine, "--zero_stage", stage, "--ac", ac, "--micro_batch_size", micro,
            "--grad_accum_steps", RACE_GLOBAL_BATCH[SMOKE] // micro, "--data_mode", "synthetic", "--max_steps",
            RACE_STEPS[SMOKE], "--log_every", 1, "--eval_every", 0, "--save_every", 0, "--warmup_steps", 1000,
            "--output_dir", out, "--progress", "false",
            *(["--device_memory_gb", RACE_BUDGET_GIB[0]] if capped and not SMOKE else [])]
    started = time.monotonic()
    rc = check.torchrun("train.py", *args)
    if rc != 0 or not os.path.exists(os.path.join(out, "summary.json")):
        return {"error": f"train.py exited {rc} (gpu_check.log)", "micro_batch_size": micro,
                "seconds": round(time.monotonic() - started, 1)}
    from benchmarks.measure import steady_images_per_sec

    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(os.path.join(out, "hf_model"), ignore_errors=True)
    return {"side": "ours", "engine": engine, "zero_stage": stage, "ac": ac, "micro_batch_size": micro,
            "images_per_sec": steady_images_per_sec(records, RACE_STEADY_FROM[SMOKE]),
            "peak_mem_bytes": max(r.get("peak_mem_bytes") or 0 for r in records), "loss": records[-1]["loss"],
            "seconds": round(time.monotonic() - started, 1)}


def race_worker_job(check: Check, name: str, ac: str, micro: int) -> dict:
    shape = RACE_SMOKE_SHAPE if SMOKE else RACE_SHAPE
    spec = {"engine": "fsdp2", **shape, "micro_batch_size": micro, "grad_accum_steps": RACE_GLOBAL_BATCH[SMOKE] // micro,
            "reshard": True, "ac": ac, "profiled_steps": 1, "warmup_steps": RACE_STEADY_FROM[SMOKE] - 2,
            "timed_steps": RACE_STEPS[SMOKE] - RACE_STEADY_FROM[SMOKE] + 1, "count_flops": False,
            "device_memory_gb": 0 if SMOKE else RACE_BUDGET_GIB[0]}
    out = os.path.join(check.work, f"{name}.json")
    started = time.monotonic()
    rc = check.torchrun("-m", "benchmarks.bench_worker", "--spec", json.dumps(spec), "--out", out)
    if rc != 0 or not os.path.exists(out):
        return {"error": f"bench_worker exited {rc} (gpu_check.log)", "micro_batch_size": micro,
                "seconds": round(time.monotonic() - started, 1)}
    result = read_json(out)
    return {"side": "plain", "engine": "fsdp2", "zero_stage": 3, "ac": ac, "micro_batch_size": micro,
            "images_per_sec": result["images_per_sec"], "peak_mem_bytes": max(result["peak_alloc_bytes"]),
            "loss": result["losses"][-1], "seconds": round(time.monotonic() - started, 1)}


def confirmed(check: Check, run, micro: int) -> dict:
    """`run(micro)` at the planned micro-batch; when it fails (out of memory under the cap), once more at half."""
    job = run(micro)
    if "error" in job and micro > RACE_MICROS[0]:
        check.say(f"   failed at micro-batch {micro}; once more at {micro // 2}")
        job = dict(run(micro // 2), first_try={"micro_batch_size": micro, "error": job["error"]})
    return job


def race(check: Check) -> dict:
    """Plain FSDP2's best against this project's best (either engine, any policy) and DeepSpeed's best, each
    configuration at its largest fitting micro-batch under the cap; and the peak of plain ZeRO-3 (none, no cap)
    at this project's best's micro-batch, for the memory target."""
    check.partial.update(budget_gib=RACE_BUDGET_GIB[SMOKE], global_batch=RACE_GLOBAL_BATCH[SMOKE],
                         shape=RACE_SMOKE_SHAPE if SMOKE else RACE_SHAPE)
    jobs = check.jobs()
    for ac, planned_as in RACE_PLAIN:
        name = f"plain-fsdp2-{ac.replace(':', '_')}"
        micro = race_micro("fsdp2", 3, planned_as)
        check.begin(name)
        check.keep(name, confirmed(check, lambda m, n=name, a=ac: race_worker_job(check, n, a, m), micro) if micro
                   else {"error": "plan.py: no micro-batch fits the budget"})
        check.say(f"   {name}: " + (f"{jobs[name]['images_per_sec']:.0f} img/s at micro {jobs[name]['micro_batch_size']}"
                                     if jobs[name].get("images_per_sec") else jobs[name].get("error", "")))
    for engine, stage, ac in RACE_OURS:
        name = f"{engine}-zero{stage}-{ac}"
        micro = race_micro(engine, stage, ac)
        check.begin(name)
        check.keep(name, confirmed(check, lambda m, n=name, e=engine, z=stage, a=ac:
                                   race_trainer_job(check, n, e, z, a, m), micro) if micro
                   else {"error": "plan.py: no micro-batch fits the budget"})
        check.say(f"   {name}: " + (f"{jobs[name]['images_per_sec']:.0f} img/s at micro {jobs[name]['micro_batch_size']}"
                                     if jobs[name].get("images_per_sec") else jobs[name].get("error", "")))
    ours = [(j["images_per_sec"], k) for k, j in jobs.items() if j.get("side") == "ours" and j.get("images_per_sec")]
    if ours:  # plain ZeRO-3 at the winner's micro-batch, uncapped: what the memory target compares with
        best = jobs[max(ours)[1]]
        name = "deepspeed-zero3-none-uncapped"
        check.begin(name)
        check.keep(name, dict(race_trainer_job(check, name, "deepspeed", 3, "none", best["micro_batch_size"],
                                               capped=False), side="reference"))
    return {"budget_gib": RACE_BUDGET_GIB[SMOKE], "global_batch": RACE_GLOBAL_BATCH[SMOKE],
            "shape": RACE_SMOKE_SHAPE if SMOKE else RACE_SHAPE, "jobs": jobs}


def race_targets(parts: dict) -> list:
    """The seed's claim where memory binds: this project's best >= 1.15x plain FSDP2's best (one repeat each:
    points), its peak <= 0.7x plain ZeRO-3's at the same micro-batch; DeepSpeed's best, reported."""
    from benchmarks.suites import DEEPSPEED

    figures = parts.get("race", {}).get("figures") or {}
    jobs = figures.get("jobs") or {}
    if not jobs:
        return []
    done = {k: j for k, j in jobs.items() if j.get("images_per_sec")}
    plain = [(j["images_per_sec"], k) for k, j in done.items() if j.get("side") == "plain"]
    ours = [(j["images_per_sec"], k) for k, j in done.items() if j.get("side") == "ours"]
    deepspeed = [(j["images_per_sec"], k) for k, j in done.items() if j.get("side") == "ours" and
                 j["engine"] == DEEPSPEED]
    budget = f"{figures.get('budget_gib')} GiB"
    rows = [(f"race job {k}", "failed (gpu_check.log)", "not measured") for k, j in jobs.items() if k not in done]
    target = f"this project's best >= 1.15x plain FSDP2's best at {budget}"
    if plain and ours:
        (o, ok), (p, pk) = max(ours), max(plain)
        rows.append((target, f"{o / p:.3f}x ({ok} at micro {done[ok]['micro_batch_size']}: {o:.0f} img/s; {pk} at "
                             f"micro {done[pk]['micro_batch_size']}: {p:.0f})", "met" if o / p >= 1.15 else "missed"))
    else:
        rows.append((target, "a side has no finished job", "not measured"))
    reference = done.get("deepspeed-zero3-none-uncapped")
    target = "this project's best's peak <= 0.7x plain ZeRO-3's at the same micro-batch"
    if ours and reference:
        ok = max(ours)[1]
        ratio = done[ok]["peak_mem_bytes"] / reference["peak_mem_bytes"]
        rows.append((target, f"{ratio:.3f}x ({done[ok]['peak_mem_bytes'] / 2**30:.1f} vs "
                             f"{reference['peak_mem_bytes'] / 2**30:.1f} GiB)", "met" if ratio <= 0.7 else "missed"))
    else:
        rows.append((target, "no reference job", "not measured"))
    if deepspeed and plain:
        d, dk = max(deepspeed)
        rows.append((f"DeepSpeed's best against plain FSDP2's best at {budget}", f"{d / max(plain)[0]:.3f}x ({dk})",
                     "reported"))
    return rows


RUNNERS = {"machine": machine, "vit-l": vit_l, "digits": digits, "policies": policies, "planned": planned,
           "compile": compiled, "trainer": trainer, "compiled": compiled_trainer, "worker": worker, "race": race}


def number(row: dict, key: str):
    try:
        return float(row[key])
    except (KeyError, TypeError, ValueError):
        return None


def ratio_row(target: str, a, b, key: str, judge) -> tuple:
    """(target, measured, verdict) of a over b in `key`: "not measured" when a side did not run or has no
    positive figure; else judge(ratio) gives the text and whether it is met."""
    x, y = (number(r, key) if r else None for r in (a, b))
    if not x or not y or x <= 0 or y <= 0:
        missing = [name for name, r, v in (("first", a, x), ("second", b, y)) if not r or not v or v <= 0]
        return target, f"no {key} for the {' and '.join(missing)} side", "not measured"
    text, met = judge(x / y)
    return target, text, "met" if met else "missed"


def targets(results: dict) -> list:
    """(target, measured, verdict) rows of the H200 targets from the parts that ran; one repeat each, so every
    ratio is a point, not an interval."""
    rows = []
    parts = results["parts"]
    for part, label in (("vit-l", "micro-batch 32"), ("planned", "planned micro-batch")):
        figures = parts.get(part, {}).get("figures")
        if not figures:
            continue
        by = {r["config"]: r for r in figures["rows"] if int(r.get("jobs_ok") or 0)}
        if part == "planned":
            for engine, prefix in (("FSDP2", "FSDP2"), ("DeepSpeed", "ZeRO-")):
                ran = [c for c in by if c.startswith(prefix)]
                # an MFU of 0 is a measurement (missed); a configuration without one is not measured
                mfus = [(number(by[c], "mfu"), c) for c in ran if number(by[c], "mfu") is not None]
                target = f"ViT-L/16 MFU >= {TARGET_MFU:.0%} under {engine} ({label})"
                if mfus:
                    best = max(mfus)
                    rows.append((target, f"{best[0]:.1%} ({best[1]})", "met" if best[0] >= TARGET_MFU else "missed"))
                elif ran:
                    rows.append((target, f"no MFU in {', '.join(ran)}", "not measured"))
        for ac in ("none", "selective", "full"):
            ds, fs = by.get(f"ZeRO-3 + {ac}"), by.get(f"FSDP2 + {ac}")
            if ds or fs:
                rows.append(ratio_row(f"ZeRO-3 >= {TARGET_DS_SPEED}x FSDP2's images/s at {ac} ({label})",
                                      ds, fs, "images_per_sec", lambda r: (f"{r:.3f}x", r >= TARGET_DS_SPEED)))
        for prefix in ("FSDP2", "ZeRO-3", "ZeRO-2"):
            sel, none = by.get(f"{prefix} + selective"), by.get(f"{prefix} + none")
            if sel or none:
                rows.append(ratio_row(f"{prefix}: selective <= +{TARGET_SELECTIVE - 1:.0%} step time over none "
                                      f"({label})", sel, none, "step_ms",
                                      lambda r: (f"{r - 1:+.1%}", r <= TARGET_SELECTIVE)))
        for r in figures["planner"]:
            rows.append((f"plan.py's peak within {TARGET_PEAK_ERROR:.0%} of the allocator's: {r['config']} ({label})",
                         f"{r['peak_error']:+.1%} ({r['peak_predicted'] / 2**30:.2f} vs "
                         f"{r['peak_measured'] / 2**30:.2f} GiB)",
                         "met" if abs(r["peak_error"]) <= TARGET_PEAK_ERROR else "missed"))
            if r.get("host_micro_s") is not None:  # the host probe against the device's step (planner/host.py)
                rows.append((f"plan.py's step within 25% of the measured one, the host charged: {r['config']} "
                             f"({label})", f"{r['step_error']:+.1%} ({r['step_predicted'] * 1e3:.0f} vs "
                             f"{r['step_measured'] * 1e3:.0f} ms; host {r['host_micro_s'] * 1e3:.0f} ms per "
                             f"micro-batch{', host-bound' if r['host_bound'] else ''})",
                             "met" if abs(r["step_error"]) <= 0.25 else "missed"))
    rows += trainer_targets(parts)
    rows += race_targets(parts)
    return rows


def trainer_targets(parts: dict) -> list:
    """The second version's targets on part 7's train.py jobs (one repeat each: points, not intervals)."""
    ran = {**((parts.get("trainer", {}).get("figures") or {}).get("jobs") or {}),
           **((parts.get("compiled", {}).get("figures") or {}).get("jobs") or {})}
    jobs = {k: v for k, v in ran.items() if v.get("images_per_sec")}
    if not jobs:
        return []
    rows = [(f"train.py job {k}", "no images/s (failed or stopped)", "not measured") for k in ran if k not in jobs]
    best = max(jobs.items(), key=lambda kv: kv[1]["images_per_sec"])
    target = f"ViT-L/16 through train.py: MFU >= {TARGET_TRAINER_MFU:.0%} (best engine)"
    if best[1].get("mfu") is not None:
        rows.append((target, f"{best[1]['mfu']:.1%} ({best[0]})",
                     "met" if best[1]["mfu"] >= TARGET_TRAINER_MFU else "missed"))
    else:
        rows.append((target, f"no MFU for {best[0]}", "not measured"))
    rows.append((f"best >= 1.0x the plain FSDP2 script's best ({PLAIN_SCRIPT_BEST:,} img/s)",
                 f"{best[1]['images_per_sec'] / PLAIN_SCRIPT_BEST:.3f}x ({best[0]})",
                 "met" if best[1]["images_per_sec"] >= PLAIN_SCRIPT_BEST else "missed"))
    deepspeed = [(v["images_per_sec"], k) for k, v in jobs.items() if k.startswith("deepspeed")]
    if deepspeed:
        ds = max(deepspeed)
        rows.append((f"DeepSpeed's best >= 0.9x the plain script's best", f"{ds[0] / PLAIN_SCRIPT_BEST:.3f}x ({ds[1]})",
                     "met" if ds[0] >= 0.9 * PLAIN_SCRIPT_BEST else "missed"))
    for ac in ("none", "light"):
        ds, fs = ran.get(f"deepspeed-zero3-{ac}"), ran.get(f"fsdp2-zero3-{ac}")
        if ds or fs:
            rows.append(ratio_row(f"ZeRO-3 >= 0.8x FSDP2 at equal micro-batch ({ac})", ds, fs, "images_per_sec",
                                  lambda r: (f"{r:.3f}x", r >= 0.8)))
    for engine in ("fsdp2-zero3", "deepspeed-zero3"):
        none = jobs.get(f"{engine}-none")
        for ac in ("light", "selective"):
            other = jobs.get(f"{engine}-{ac}")
            if none and other:
                extra = none["images_per_sec"] / other["images_per_sec"] - 1  # step time over none's
                rows.append((f"{engine}: {ac} <= +10% step time over none", f"{extra:+.1%}",
                             "met" if extra <= 0.10 else "missed"))
    worker = (parts.get("worker", {}).get("figures") or {}).get("trainer_over_worker")
    if worker:
        rows.append(("train.py's FSDP2 within 5% of the worker's plain FSDP2", f"{worker:.3f}x",
                     "met" if abs(worker - 1) <= 0.05 else "missed"))
    return rows


def headline(name: str, figures: dict) -> str:
    if name == "machine":
        g = figures["gemm"]
        return (f"{figures['device']}, torch {figures['versions']['torch']}, {g['dtype']} GEMM {g['tflops_median']:.1f} "
                f"TFLOP/s" + (f"; differs from stack.txt: {', '.join(figures['differ_from_stack'])}"
                              if figures["differ_from_stack"] else ""))
    if name in ("vit-l", "planned"):
        ok = [r for r in figures["rows"] if int(r.get("jobs_ok") or 0)]
        best = max(ok, key=lambda r: number(r, "images_per_sec")) if ok else None
        return (f"{len(ok)} of {len(figures['rows'])} configurations ran" +
                (f"; fastest {best['config']} {number(best, 'images_per_sec'):.0f} img/s, MFU {number(best, 'mfu'):.1%}"
                 if best else "") + (f" (micro-batch {figures['micro_batch_size']})" if name == "planned" else ""))
    if name == "digits":
        return "; ".join(f"{engine}: " + (f"val top-1 {job['val_top1']:.2%}, {job['images_per_sec']:.0f} img/s, "
                                          f"{job['seconds']} s" if "error" not in job else job["error"])
                         for engine, job in figures.items())
    if name == "policies":
        worst = max(figures["policies"].items(), key=lambda kv: kv[1]["max_abs_loss_diff"])
        exact = sum(r["bitwise_equal"] for r in figures["policies"].values())
        return (f"{exact} of {len(figures['policies'])} policies bitwise equal to none; largest loss difference "
                f"{worst[1]['max_abs_loss_diff']:.1e} ({worst[0]})")
    if name in ("trainer", "compiled"):
        ran = {k: v for k, v in figures["jobs"].items() if v.get("images_per_sec")}
        best = max(ran.items(), key=lambda kv: kv[1]["images_per_sec"]) if ran else None
        return (f"{len(ran)} of {len(figures['jobs'])} jobs ran at micro-batch {figures['micro_batch_size']}" +
                (f"; fastest {best[0]} {best[1]['images_per_sec']:.0f} img/s" +
                 (f", MFU {best[1]['mfu']:.1%}" if best[1].get("mfu") else "") if best else ""))
    if name == "race":
        ran = {k: v for k, v in figures["jobs"].items() if v.get("images_per_sec")}
        best = {side: max(((v["images_per_sec"], k) for k, v in ran.items() if v.get("side") == side), default=None)
                for side in ("plain", "ours")}
        return (f"{len(ran)} of {len(figures['jobs'])} jobs ran under {figures['budget_gib']} GiB" +
                "".join(f"; {side}'s best {b[1]} {b[0]:.0f} img/s" for side, b in best.items() if b))
    if name == "worker":
        return (f"worker FSDP2 {figures['images_per_sec']:.0f} img/s" +
                (f"; train.py {figures['trainer_over_worker']:.3f}x of it" if "trainer_over_worker" in figures else ""))
    if name == "compile":
        return "; ".join(f"{k}: " + (f"{v['images_per_sec']:.0f} img/s" if "images_per_sec" in v else
                                     v.get("error") or v.get("skipped", "")) for k, v in figures.items())
    return ""


def table(header: list, rows: list) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
                     ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def write_report(check: Check):
    results, parts = check.results, check.results["parts"]
    summary = [(p.number, p.name, parts[p.name]["status"], parts[p.name].get("seconds", ""),
                parts[p.name].get("headline", parts[p.name].get("error", ""))) for p in PARTS if p.name in parts]
    lines = [f"# GPU check{' (SMOKE: CPU, tiny shapes, fp32: checks the script, measures nothing)' if SMOKE else ''}",
             "", f"{results['date']} | commit {results['commit']} | {check.elapsed():.0f} s of a {BUDGET_S:.0f} s "
             f"budget | `bash benchmarks/gpu_check.sh`", "", "## Summary", "",
             table(["part", "name", "status", "seconds", "result"], summary), "",
             f"C++/CUDA ops built during the call (JIT): {', '.join(results['jit_builds']) or 'none'}", ""]
    if results.get("rerun"):
        lines += [f"Not done: run `{results['rerun']}` in a second call.", ""]
    rows = targets(results)
    if rows:
        lines += ["## Targets", "", "One repeat per configuration: each figure is a point, not an interval.", "",
                  table(["target", "measured", "verdict"], rows), ""]
    for name, title in (("vit-l", "ViT-L/16, micro-batch 32"), ("planned", "ViT-L/16 at plan.py's micro-batch")):
        figures = parts.get(name, {}).get("figures")
        if figures:
            body = figures["results_md"].split("\n## ", 1)[-1]
            lines += [f"## {title}", "", "## " + body, ""]
    policies_part = parts.get("policies", {}).get("figures")
    if policies_part:
        lines += [f"## Activation-checkpointing policies: {policies_part['model']}, ZeRO-{policies_part['zero_stage']}, "
                  f"{policies_part['precision']}, {policies_part['steps']} steps", "",
                  table(["policy", "last loss", "max abs loss diff vs none", "bitwise equal", "ms/step", "peak MiB"],
                        [(k, f"{v['losses'][-1]:.6f}", f"{v['max_abs_loss_diff']:.2e}", v["bitwise_equal"],
                          f"{v['step_ms_median']:.1f}",
                          f"{v['peak_alloc_bytes'] / 2**20:.0f}" if v["peak_alloc_bytes"] else "n/a (CPU)")
                         for k, v in policies_part["policies"].items()]), ""]
    for name, title in (("trainer", "ViT-L/16 through train.py"), ("compiled", "ViT-L/16 through train.py, compiled")):
        figures = parts.get(name, {}).get("figures")
        if figures:
            lines += [f"## {title}, micro-batch {figures['micro_batch_size']}, synthetic data", "",
                      table(["job", "images/s (steady)", "images/s (all)", "MFU", "peak GiB", "last loss", "seconds"],
                            [(k, f"{v['images_per_sec']:.0f}" if v.get("images_per_sec") else
                              v.get("error") or v.get("skipped", ""),
                              f"{v['images_per_sec_all']:.0f}" if v.get("images_per_sec_all") else "",
                              f"{v['mfu']:.1%}" if v.get("mfu") else "",
                              f"{v['peak_mem_bytes'] / 2**30:.2f}" if v.get("peak_mem_bytes") else "",
                              f"{v['loss']:.4f}" if "loss" in v else "", v.get("seconds", ""))
                             for k, v in figures["jobs"].items()]), ""]
    for name in ("digits", "compile", "worker"):
        figures = parts.get(name, {}).get("figures")
        if figures:
            lines += [f"## {name}", "", "```", json.dumps(figures, indent=1), "```", ""]
    with open(os.path.join(check.out, "report.md"), "w") as f:
        f.write("\n".join(lines))
    return summary


def keep_traces(check: Check):
    """At most 3 gzipped traces of part 2's warm steps, each under the return limit."""
    kept = []
    for name in TRACED:
        found = sorted(glob.glob(os.path.join(check.work, "traces", f"{name}-step*_rank0.json")))
        if not found:
            continue
        os.makedirs(os.path.join(check.out, "traces"), exist_ok=True)
        target = os.path.join(check.out, "traces", os.path.basename(found[0]) + ".gz")
        with open(found[0], "rb") as src, gzip.open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
        if os.path.getsize(target) > TRACE_LIMIT_BYTES:
            os.remove(target)
            check.say(f"   trace {os.path.basename(found[0])} is over the return limit: not kept")
        else:
            kept.append(os.path.relpath(target, check.out))
    return kept


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--machine"]:
        return probe_machine(argv[1]) or 0
    if len(argv) != 1:
        sys.exit(__doc__)
    check = Check(argv[0])
    wanted = {int(p) for p in os.environ.get("PARTS", " ".join(map(str, DEFAULT_PARTS))).split()}
    interrupted = []

    def stop(signum, frame):  # from outside: the part running ends (its child's group killed), what there is is written
        if not interrupted:
            interrupted.append(signum)
            raise Stopped(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    check.save()
    check.say(f"GPU check{' (smoke)' if SMOKE else ''}: parts {sorted(wanted)}, budget {BUDGET_S:.0f} s, "
              f"scratch {check.work}")
    try:
        for part in PARTS:
            if part.number not in wanted:
                continue
            left = BUDGET_S - check.elapsed()
            if interrupted or part.expected_s > left:
                check.results["parts"][part.name] = {"status": "not reached", "number": part.number}
                check.say(f"== {part.number}. {part.name}: not started " + (
                    f"(stopped by {signal.Signals(interrupted[0]).name})" if interrupted else
                    f"({left:.0f} s left, {part.expected_s} s expected)"))
                continue
            check.say(f"== {part.number}. {part.name}: {part.what} (limit {min(part.limit_s, left):.0f} s)")
            check.deadline = time.monotonic() + min(part.limit_s, left)
            started = time.monotonic()
            entry = {"number": part.number}
            check.start_part(part.name)
            try:
                entry["figures"] = RUNNERS[part.name](check)
                entry["status"] = "ok"
                entry["headline"] = headline(part.name, entry["figures"])
            except (Timeout, Stopped) as e:  # the jobs it finished are kept; the one running is named
                stopped = isinstance(e, Stopped)
                entry.update(status=f"stopped ({e})" if stopped else "timed out",
                             error=f"stopped by {e} after {time.monotonic() - started:.0f} s" if stopped else
                             f"stopped at its limit ({min(part.limit_s, left):.0f} s)", cut=check.running)
                if check.partial:
                    entry["figures"] = check.partial
            except Exception as e:  # noqa: BLE001  a part's failure is reported; the next part still runs
                entry.update(status="failed", error=f"{type(e).__name__}: {e}")
                if check.partial:
                    entry["figures"] = check.partial
            entry["seconds"] = round(time.monotonic() - started, 1)
            check.results["parts"][part.name] = entry
            check.part = None
            check.save()
            check.say(f"   {entry['status']} in {entry['seconds']} s: {entry.get('headline') or entry.get('error')}")
    except Stopped:  # between parts: nothing was running
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # what there is gets written, whatever comes next
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if interrupted:
            check.results["stopped"] = signal.Signals(interrupted[0]).name
        parts = check.results["parts"]
        redo = [str(p.number) for p in PARTS if p.name in parts and parts[p.name]["status"] != "ok"]
        if redo:
            check.results["rerun"] = f"PARTS=\"{' '.join(redo)}\" bash benchmarks/gpu_check.sh"
        check.results["traces"] = keep_traces(check)
        check.results["jit_builds"] = sorted(extensions() - check.extensions)
        check.results["seconds"] = round(check.elapsed(), 1)
        for entry in parts.values():  # the runs' folders are scratch, deleted below
            if isinstance(entry.get("figures"), dict):
                entry["figures"].pop("dir", None)
        check.save()
        summary = write_report(check)
        check.say("\n" + table(["part", "name", "status", "seconds", "result"], summary))
        if redo:
            check.say(f"\nnot done: {check.results['rerun']}")
        check.say(f"\nwritten: {', '.join(sorted(os.listdir(check.out)))} in {check.out}")
        check.log.close()
        shutil.rmtree(check.work, ignore_errors=True)
    return 128 + interrupted[0] if interrupted else 0 if not redo else 1


if __name__ == "__main__":
    sys.exit(main())
