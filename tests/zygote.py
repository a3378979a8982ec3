"""A process that imports train.py and its libraries once, then forks a fresh rank process for each request:
conftest.launch's `fork` launcher. Each rank is a real process running train.py's `main` with the environment a
launcher gives it (RANK, WORLD_SIZE, MASTER_ADDR, ...); what it skips is the interpreter start and the imports
(most of a debug run's time on 2 cores). The zygote itself runs nothing else (but `warm`'s probe), so every fork
starts from the state of a fresh `python train.py` after its imports.

    python -m tests.zygote      # requests and replies are JSON lines on stdin and stdout

{"fork": {"module", "argv", "env", "cwd", "stdout", "stderr", "group"}} -> {"pid"}: a rank running
`module.main(argv)` (train.py's, or another entry with a `main`), its output appended to those two files (one file
when they are the same path), in process group `group` (0: a new group, led by this rank, as a launcher's job).
{"poll": [pid, ...]} -> {"codes": {pid: code}}: those of the ranks that have ended, reaped (-N: killed by signal N).

A rank whose environment sets benchmarks/inject's variables (INJECT_*) gets its faults as a fresh interpreter
would: the project's modules are imported again after benchmarks/inject/sitecustomize.py has patched what they use.
"""
import importlib
import importlib.util
import json
import os
import sys

# train.py and what its ranks import while they run (DeepSpeed at the process group's start, matplotlib on rank 0)
PRELOAD = ("train", "export", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.tensorboard",
           "runlog.figures")
PROJECT = {"train", "config", "compat", "engine", "models", "parallel", "ac", "data", "loop", "runlog", "checkpoints", "planner",
           "launch", "plan", "export"}


def install_faults(cwd: str):
    """benchmarks/inject's faults, installed before the project's modules are imported again."""
    for name in [m for m in sys.modules if m.split(".")[0] in PROJECT]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location("inject_faults", os.path.join(cwd, "benchmarks", "inject",
                                                                                 "sitecustomize.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def show_warnings():
    """Drop the catch-all `ignore` the zygote's own PYTHONWARNINGS=ignore put behind the filters the libraries
    installed at import: what is left is the filter list of an interpreter started without it, after the same
    imports (an ignored warning is not recorded as shown, so each is still shown once)."""
    import warnings

    warnings.filters[:] = [f for f in warnings.filters if f != ("ignore", None, Warning, None, 0)]
    warnings._filters_mutated()


def rank(request: dict):
    """The forked child: become the rank the request describes, run its module's main, exit with its code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    err = out if request["stderr"] == request["stdout"] else \
        os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if any(key.startswith("INJECT_") for key in os.environ):
        install_faults(request["cwd"])
    if os.environ.get("PYTHONWARNINGS") != "ignore":  # warnings on, as in an interpreter started without it
        show_warnings()
    if os.environ.get("TORCH_COMPILE_DISABLE") == "1":  # what torch reads from it at import
        import torch._dynamo

        torch._dynamo.config.disable = True
    module = importlib.import_module(request["module"])
    sys.argv = [module.__file__, *request["argv"]]
    code = 0
    try:
        result = module.main(request["argv"])
        code = result if isinstance(result, int) else 0  # an entry's `raise SystemExit(main())`
    except SystemExit as e:  # as the interpreter treats it: None is 0, a message is printed and is 1
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter ends on an uncaught exception: through sys.excepthook (fail_fast's)
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(replies):
    for line in sys.stdin:
        request = json.loads(line)
        if "fork" in request:
            sys.stderr.flush()
            pid = os.fork()
            group = request["fork"].get("group", 0)
            if pid == 0:
                replies.close()
                os.setpgid(0, group)  # here and in the parent: set before either goes on
                rank(request["fork"])
            try:
                os.setpgid(pid, group or pid)
            except OSError:  # the child has set it and ended already
                pass
            reply = {"pid": pid}
        else:
            codes = {}
            for pid in request["poll"]:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # reaped by an earlier poll
                    continue
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            reply = {"codes": codes}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def load_shm_op():
    """DeepSpeed's CPU shared-memory all-reduce, loaded (built on first use) as its CPU accelerator loads it at
    the process group's start, if this machine can build it: the ops' probe (a compiler run) is done too."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)


def warm():
    """What every rank works out the same way before its process group forms, done once here on CPU: DeepSpeed's
    ops' probe and shared-memory all-reduce (each rank still initialises its own). Both are caches a fresh
    process fills on first use."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as loop.distributed.init_distributed sets it
        load_shm_op()


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the libraries print outside a rank reaches no reply
    for name in PRELOAD:
        importlib.import_module(name)
    warm()
    serve(replies)
