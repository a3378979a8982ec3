"""A process that imports train.py and its libraries once, then forks a fresh rank process for each request:
conftest.launch's `fork` launcher. Each rank is a real process running train.py's `main` with the environment a
launcher gives it (RANK, WORLD_SIZE, MASTER_ADDR, ...); what it skips is the interpreter start and the imports
(most of a debug run's time on 2 cores). The zygote itself runs nothing else, so every fork starts from the state
of a fresh `python train.py` after its imports.

    python -m tests.zygote      # requests and replies are JSON lines on stdin and stdout

{"fork": {"module", "argv", "env", "cwd", "stdout", "stderr"}} -> {"pid"}: a rank running `module.main(argv)`
(train.py's, or another entry with a `main`), its output in those two files.
{"wait": true} -> {"pid", "code"}: the next rank to end, and its exit code (-N: killed by signal N).
"""
import importlib
import json
import os
import sys
import traceback

# train.py and what its ranks import while they run (DeepSpeed at the process group's start)
PRELOAD = ("train", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.tensorboard")


def rank(request: dict):
    """The forked child: become the rank the request describes, run its module's main, exit with its code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
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
    except BaseException:
        traceback.print_exc()
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
            if pid == 0:
                replies.close()
                rank(request["fork"])
            reply = {"pid": pid}
        else:
            pid, status = os.wait()
            reply = {"pid": pid, "code": os.waitstatus_to_exitcode(status)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # what the libraries print outside a rank reaches no reply
    for name in PRELOAD:
        importlib.import_module(name)
    serve(replies)
