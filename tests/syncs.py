"""A training rank that counts its host-device synchronisations, by the phase of the run and by who makes them:
conftest forks a rank running this module's `main`, which installs the counter and runs train.py's `main`.

A synchronisation is what makes the host wait for a GPU: a read of a tensor's value (`item`, `float`, `int`,
`bool`: the dispatcher's `_local_scalar_dense`), `tolist`, `numpy`, a `torch.tensor(..., device=...)` built from
host data, loop.timing.synchronize and, in the project's code, `cpu` and a blocking `to(device)` copy. On the CPU
none of them waits; counted here, they are what a GPU run would wait on. Each is charged to the innermost frame
outside torch and the standard library: the project's training code (train.py, compat.py, engine/, loop/, runlog/,
checkpoints/, parallel/, ac/, models/, data/transforms.py: "train"), DeepSpeed ("deepspeed") or anything else ("other": the data loader's host-side
tensors, transformers). The phase is what the rank last told its heartbeat ("step 12", "step 30, evaluating").

SYNC_COUNTS names the JSON file written as the run ends, one per rank (`<path>.<rank>`): {"phases": {phase: {owner:
count}}, "sites": {owner: {"file:line": count}}} (the sites over the loop's steps).
"""
import collections
import json
import os
import sys
import sysconfig

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARIES = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"], os.path.abspath(__file__))
TRAINING = tuple(os.path.join(REPO, p) for p in ("train.py", "compat.py", "engine/", "loop/", "runlog/", "checkpoints/",
                                                  "parallel/", "ac/", "models/", "data/transforms.py"))
COUNTS = collections.defaultdict(collections.Counter)
PHASE = ["starting"]


SITES = collections.defaultdict(collections.Counter)  # {owner: {"path:line": count}} over the steps


def count(only_train=False):
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(LIBRARIES):
        frame = frame.f_back
    path = frame.f_code.co_filename if frame is not None else ""
    owner = "train" if path.startswith(TRAINING) else "deepspeed" if f"{os.sep}deepspeed{os.sep}" in path else "other"
    if only_train and owner != "train":
        return
    COUNTS[PHASE[0]][owner] += 1
    if PHASE[0].startswith("step ") and "," not in PHASE[0]:
        SITES[owner][f"{os.path.relpath(path, REPO) if path.startswith(REPO) else path.split('site-packages/')[-1]}:"
                     f"{frame.f_lineno if frame is not None else 0}"] += 1


class Reads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            count()
        return func(*args, **(kwargs or {}))


def counting(fn, when=lambda *a, **k: True, only_train=False):
    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            count(only_train)
        return fn(*args, **kwargs)
    return wrapper


def moves(self, *args, **kwargs) -> bool:
    """A `to` that copies to a device and waits for it."""
    to_device = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[:1]) or any(
        isinstance(a, torch.Tensor) for a in args[:1])
    return to_device and not kwargs.get("non_blocking", len(args) > 2 and args[2])


def install():
    import loop.distributed
    import loop.timing

    for name in ("tolist", "numpy"):
        setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    # a copy to the device is one only if the tensor is not there already, which a CPU run cannot tell: these count
    # for the project's code alone, which moves nothing that is on the device already
    torch.Tensor.cpu = counting(torch.Tensor.cpu, only_train=True)
    torch.Tensor.to = counting(torch.Tensor.to, moves, only_train=True)
    torch.tensor = counting(torch.tensor, lambda *a, **k: k.get("device") is not None)
    loop.timing.synchronize = counting(loop.timing.synchronize)
    beat = loop.distributed.Heartbeat.beat

    def traced(self, what):
        PHASE[0] = what
        return beat(self, what)
    loop.distributed.Heartbeat.beat = traced


def main(argv):
    import train

    install()
    exit_distributed = train.exit_distributed

    def written_first(code=0):
        with open(f"{os.environ['SYNC_COUNTS']}.{os.environ.get('RANK', '0')}", "w") as f:
            json.dump({"phases": COUNTS, "sites": SITES}, f, indent=1)
        exit_distributed(code)
    train.exit_distributed = written_first
    with Reads():
        train.main(argv)
