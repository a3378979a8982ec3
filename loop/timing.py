"""The clock every timed region in this project reads: train.py's images/s, the benchmark worker's step times and
the planner's operator replay.

A CUDA kernel, a copy or an NCCL collective returns to the host as soon as it is queued, so a bare
`time.perf_counter()` after a step times the host's enqueueing, not the step, and flatters whichever engine makes
the fewest host syncs. `clock(device)` waits for the device first; on the CPU every operator has finished when it
returns, so there it is `perf_counter` alone.
"""
import time

import torch


def synchronize(device: torch.device):
    """Wait until the work queued on `device` is done (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has finished what was queued on it: the start or end of a timed region."""
    synchronize(device)
    return time.perf_counter()
