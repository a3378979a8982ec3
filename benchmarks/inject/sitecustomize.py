"""Faults for the tests and the fault-injection harness, installed from outside train.py.

Put this folder on PYTHONPATH and set one of the variables below: Python imports `sitecustomize` when each process
of the job starts, and this one patches the functions a fault hits as their modules are imported. Without the
variables it installs nothing; train.py itself reads none of them.

    INJECT_RAISE=RANK:N         the Nth training loss (models.tasks.task_loss) on RANK raises a RuntimeError
    INJECT_NAN_AT=S1,S2         every loss of the steps S1, S2 (every rank) is NaN
    INJECT_ENOSPC_AT=S:R,...    rank R's checkpoint files at step S are cut half-way and fail with ENOSPC, as on a
                                full disk

Steps are read from the heartbeat, whose `beat("step N")` starts each step of train.py's loop.
"""
import importlib.abc
import importlib.util
import os
import re
import sys

RAISE = os.environ.get("INJECT_RAISE", "")
NAN_AT = {int(s) for s in os.environ.get("INJECT_NAN_AT", "").split(",") if s.strip()}
ENOSPC_AT = {tuple(map(int, s.split(":"))) for s in os.environ.get("INJECT_ENOSPC_AT", "").split(",") if s.strip()}
STEP = [0]  # the step train.py's loop is in, from its heartbeat


def rank() -> int:
    """This process's rank, read when a fault is due (plain `python train.py` sets RANK itself, after start-up)."""
    return int(os.environ.get("RANK", "0"))


def patch_after_import(name: str, patch):
    """Call `patch(module)` once `name` has been imported and executed, before anyone uses it (now, when it has
    been imported already)."""
    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)  # once: find the real module below this finder
            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    patch(module)
                spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def track_steps(distributed):
    beat = distributed.Heartbeat.beat

    def traced(self, what):
        if match := re.fullmatch(r"step (\d+)", what):
            STEP[0] = int(match.group(1))
        return beat(self, what)
    distributed.Heartbeat.beat = traced


def faulty_loss(tasks):
    task_loss, calls = tasks.task_loss, [0]
    raise_rank, raise_at = map(int, RAISE.split(":")) if RAISE else (None, None)

    def loss(*args, **kwargs):
        calls[0] += 1
        if calls[0] == raise_at and rank() == raise_rank:
            raise RuntimeError("injected: the task's loss failed")
        out = task_loss(*args, **kwargs)
        return out * float("nan") if STEP[0] in NAN_AT else out
    tasks.task_loss = loss


def full_disk(checkpoint):
    import errno
    import io

    import torch

    save = checkpoint.save

    def faulty_save(engine, ckpt_dir, step, *args, **kwargs):
        if (step, rank()) not in ENOSPC_AT:
            return save(engine, ckpt_dir, step, *args, **kwargs)
        writer = getattr(getattr(engine, "ds", None), "checkpoint_engine", None)  # DeepSpeed's file writer
        if writer is None:  # the torch engines: DCP's writer of this rank's shard file
            return dcp_full_disk(save, engine, ckpt_dir, step, *args, **kwargs)
        original = writer.save

        def half_written(state_dict, path):
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            with open(path, "wb") as f:
                f.write(buffer.getbuffer()[:buffer.tell() // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        writer.save = half_written
        try:
            return save(engine, ckpt_dir, step, *args, **kwargs)
        finally:
            writer.save = original
    checkpoint.save = faulty_save


def dcp_full_disk(save, engine, ckpt_dir, step, *args, **kwargs):
    """This rank's DCP file cut short by ENOSPC (torch.distributed.checkpoint's FileSystemWriter)."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def half_written(self, plan, planner):
        path = os.path.join(str(self.path), f"__{rank()}_0.distcp")
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    background = engine.async_save and not kwargs.get("wait", True)
    if background:  # the write in flight finishes with the writer intact (save would commit it first)
        sys.modules["checkpoints.manager"].commit_pending(engine, kwargs.get("log", print))
    FileSystemWriter.write_data = half_written
    if not background:
        try:
            return save(engine, ckpt_dir, step, *args, **kwargs)
        finally:
            FileSystemWriter.write_data = original
    # a background write (async_save): the writer stays faulty until the engine has waited for it
    wait = engine.wait_checkpoint

    def waited():
        try:
            return wait()
        finally:
            FileSystemWriter.write_data = original
            engine.wait_checkpoint = wait

    result = save(engine, ckpt_dir, step, *args, **kwargs)
    engine.wait_checkpoint = waited
    return result


if NAN_AT:
    patch_after_import("loop.distributed", track_steps)
if RAISE or NAN_AT:
    patch_after_import("models.tasks", faulty_loss)
if ENOSPC_AT:
    patch_after_import("checkpoints.manager", full_disk)
