"""A process that imports train.py and its libraries once, then forks a fresh rank process for each request:
conftest.launch's `fork` launcher. Each rank is a real process running train.py's `main` with the environment a
launcher gives it (RANK, WORLD_SIZE, MASTER_ADDR, ...); what it skips is the interpreter start and the imports
(most of a debug run's time on 2 cores). The zygote itself runs nothing else, so every fork starts from the state
of a fresh `python train.py` after its imports.

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
PRELOAD = ("train", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.tensorboard",
           "engine.figures")
PROJECT = {"train", "config", "engine", "models", "ac", "data", "planner", "plan", "export"}


def install_faults(cwd: str):
    """benchmarks/inject's faults, installed before the project's modules are imported again."""
    for name in [m for m in sys.modules if m.split(".")[0] in PROJECT]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location("inject_faults", os.path.join(cwd, "benchmarks", "inject",
                                                                                 "sitecustomize.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


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
    module = importlib.import_module(request["module"])
    sys.argv = [module.__file__, *request["argv"]]
    code = 0
    try:
        module.main(request["argv"])
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


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the libraries print outside a rank reaches no reply
    for name in PRELOAD:
        importlib.import_module(name)
    serve(replies)
