"""Process groups: what the launcher set, starting DeepSpeed's communication, and leaving without an abort."""
import contextlib
import io
import logging
import os
import socket
import sys

import torch
import torch.distributed as dist

from engine.compat import quiet_deepspeed_deprecations, release_deepspeed_shm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as the launcher set them; one rank without a launcher."""
    if "RANK" not in os.environ:  # plain `python train.py`
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_world = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"  # torchrun / deepspeed
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), int(local_world)


def init_distributed(local_rank: int) -> torch.device:
    """Join the process group through DeepSpeed (NCCL on GPUs, gloo on its CPU accelerator); returns this
    rank's device."""
    if not torch.cuda.is_available():  # said, DeepSpeed picks its CPU accelerator without a warning per process
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # heavy: imported once the input is known to be good

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines describe its own set-up, every rank
    quiet_deepspeed_deprecations()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        deepspeed.init_distributed()
    # every rank prints that its CPU communication op was built (or loaded from the cache); other lines pass
    sys.stdout.writelines(line for line in printed.getvalue().splitlines(keepends=True)
                          if not line.endswith("built successfully\n"))
    dist.barrier()
    release_deepspeed_shm(dist.get_rank())
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def exit_distributed(code: int = 0):
    """End a distributed process: a barrier, the process groups destroyed, stdio flushed, then `os._exit`.

    Gloo's worker threads free a finished collective's tensors themselves, which takes the GIL, and the groups
    outlive `destroy_process_group` (DeepSpeed and FSDP keep references), so those threads stay up. One that
    gets there after interpreter finalization has begun is stopped by CPython inside a C++ destructor, and the
    process aborts after all its work is done (docs/troubleshooting.md). Callers close their own files first.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
