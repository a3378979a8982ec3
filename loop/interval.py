"""What the training loop measures between two reads of the device: a logging interval.

A step's loss stays on the device, summed over its micro-batches; its gradient norm stays there too when DeepSpeed
gives it as a tensor. The host keeps what it knows without asking the device (the learning rate, the data loader's
counts, the seconds spent waiting for data). At the interval's end one all-reduce carries every step's loss and
counts, together with the preemption flag, and one read brings them to the host: the loop's only synchronisation
with the device in the interval. A step's kernels all precede that read on the device, so the clock read after it
closes the interval's time.
"""
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class StepRecord:
    step: int
    lr: float
    skipped: int  # samples this rank's loader skipped (bad data) in the step
    padded: int  # samples it padded
    data_wait: float  # seconds this rank waited for data
    applied: bool  # DeepSpeed applied the optimizer step (it skips one with non-finite gradients)
    ds_skipped_steps: int  # the steps DeepSpeed has skipped so far
    peak_mem_bytes: int
    grad_norm: float | None = None  # from DeepSpeed as a float; a tensor's is read at the interval's end
    loss_sum: float | None = None  # read at the interval's end
    extra: dict = field(default_factory=dict)  # more keys for metrics.jsonl


class Interval:
    def __init__(self, device: torch.device, started: float):
        self.device, self.started = device, started
        self.records, self.losses, self.norms = [], [], []

    def add(self, record: StepRecord, loss_sum: torch.Tensor, grad_norm):
        """One step: its record, this rank's loss sum over its micro-batches (a device scalar) and DeepSpeed's
        gradient norm (a float, a device tensor or None)."""
        if isinstance(grad_norm, torch.Tensor):
            self.norms.append((len(self.records), grad_norm.detach().reshape(()).double()))
        else:
            record.grad_norm = grad_norm
        self.records.append(record)
        self.losses.append(loss_sum.detach().reshape(()).double())

    def close(self, preempt_requested: bool, world_size: int) -> "Closed":
        """Every rank's sums for each step, read once (see Closed)."""
        n = len(self.records)
        host_seconds = time.perf_counter() - self.started  # this rank's, before the read
        host = torch.tensor([[r.skipped, r.padded] for r in self.records]
                            + [[float(preempt_requested), host_seconds]], dtype=torch.float64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        losses = torch.stack(self.losses + [torch.zeros((), dtype=torch.float64, device=self.device)])
        packed = torch.cat([losses.unsqueeze(1), host.to(self.device, non_blocking=True)], dim=1)  # (steps + 1, 3)
        dist.all_reduce(packed)
        # DeepSpeed's gradient norm is already the global one: no all-reduce
        flat = torch.cat([packed.flatten()] + [norm.unsqueeze(0) for _, norm in self.norms])
        values = flat.tolist()  # the interval's one read of the device
        seconds = time.perf_counter() - self.started
        for i, record in enumerate(self.records):
            record.loss_sum, record.skipped, record.padded = values[3 * i], int(values[3 * i + 1]), int(
                values[3 * i + 2])
        for j, (i, _) in enumerate(self.norms):
            self.records[i].grad_norm = values[3 * (n + 1) + j]
        return Closed(self.records, values[3 * n + 1] > 0, seconds, values[3 * n + 2] / world_size / n)


@dataclass
class Closed:
    records: list  # the interval's StepRecords, with loss_sum, skipped and padded summed over ranks, grad_norm read
    preempted: bool  # a rank was asked to stop (loop/preemption.py)
    seconds: float  # the interval's, on this rank's clock, once the device had finished it
    step_seconds: float  # the mean over ranks of the host's seconds per step: the same value on every rank
