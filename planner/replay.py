"""Operator replay: what this machine's device takes for a model's own operators, at the shapes, layouts and
dtypes a training step runs them with, forward and backward. The planner's step time charges matmuls at a
FLOP rate and the other operators at a memory bandwidth (planner/estimate.py); a replay measures both rates for
one model and micro-batch, so that a plan made here, or on one GPU of the target kind, charges what the
model's operators run at rather than a square GEMM's rate and a streaming add's bandwidth.

One training step's forward and backward run on the meta device under a dispatch recorder (nothing allocated,
so any model records), which sees every operator autograd runs too: the gradients' matmuls, the attention
backward kernel, the copies a view's backward makes of a gradient in another layout. Each distinct operator
then runs on real tensors of the recorded shapes and strides, alone, from inputs it did not make;
docs/planner.md says what that leaves out."""
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch

import compat
from loop.timing import synchronize
from ac.profile import VIEW_OPS


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass
class Replay:
    """Seconds one micro-batch spends in the compute operators (those with a FLOP formula: matmuls, attention,
    convolutions and their backward kernels) and in the others, forward and backward; the forward's compute
    FLOPs and the bytes its other operators read and write (as the checkpointing profile counts them);
    operators that did not replay (charged nothing)."""
    compute_forward_s: float = 0.0
    compute_backward_s: float = 0.0
    memory_forward_s: float = 0.0
    memory_backward_s: float = 0.0
    compute_flops: int = 0
    moved_bytes: int = 0
    distinct_ops: int = 0
    failed: tuple = ()

    @property
    def flops_per_s(self) -> float:
        """The forward's compute FLOPs, three times over (the planner charges the backward at twice the
        forward), per second of compute operators forward and backward."""
        return 3 * self.compute_flops / max(self.compute_forward_s + self.compute_backward_s, 1e-12)

    @property
    def bytes_per_s(self) -> float:
        """The forward's memory traffic, three times over (the planner's backward moves twice the forward's),
        per second of the other operators forward and backward."""
        return 3 * self.moved_bytes / max(self.memory_forward_s + self.memory_backward_s, 1e-12)


def _spec(value):
    """A hashable description of an operator argument: tensors by shape, stride and dtype; sequences element
    by element; anything else as itself."""
    if isinstance(value, torch.Tensor):
        return TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_spec(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _spec(v)) for k, v in value.items()))
    return value


class _Recorder(compat.dispatch_mode_class()):
    """Every operator that moves data or computes (views excepted), counted by signature and phase."""

    def __init__(self):
        super().__init__()
        self.counts, self.backward = Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and compat.op_packet(func) not in VIEW_OPS:
            flops = compat.flop_count(func, args, kwargs, out)
            ins = [a for arg in args for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
            moved = 0 if flops else sum(t.numel() * t.element_size() for t in (
                *ins, *(out if isinstance(out, (tuple, list)) else (out,))) if isinstance(t, torch.Tensor))
            self.counts[(func, _spec(args), _spec(kwargs), self.backward, flops, moved)] += 1
        return out


def record(model, images: torch.Tensor) -> Counter:
    """The operators one forward and backward of `model` (on the meta device) run, by signature, with their
    counts: (operator, argument specs, keyword specs, in the backward, FLOPs, bytes moved) -> count."""
    recorder = _Recorder()
    with torch.random.fork_rng(devices=[]), compat.functional_linear_is_torchs(), recorder:
        loss = model(images).logits.sum()
        recorder.backward = True
        loss.backward()
    model.zero_grad(set_to_none=True)
    return recorder.counts


def _materialise(spec, device):
    """A real tensor for a TensorSpec (random values; zeros for integers and booleans, valid as indices), with
    the recorded layout; an expanded tensor (stride 0) as its size-1 base expanded again."""
    if isinstance(spec, tuple):
        return tuple(_materialise(s, device) for s in spec)
    if not isinstance(spec, TensorSpec):
        return spec
    base_shape = tuple(1 if st == 0 else n for n, st in zip(spec.shape, spec.stride))
    base_stride = tuple(1 if st == 0 else st for st in spec.stride)
    t = torch.empty_strided(base_shape, base_stride, dtype=spec.dtype, device=device)
    if spec.dtype.is_floating_point:
        t.copy_(torch.randn(base_shape, device=device).to(spec.dtype))
    else:
        t.zero_()
    return t.expand(spec.shape) if base_shape != spec.shape else t


def stream_gbs(device: torch.device, n: int = 2**24, reps: int = 5) -> float:
    """GB/s of an elementwise add over 64 MiB fp32 tensors (two read, one written): the bandwidth a streaming
    memory-bound operator reaches on `device` (the median of `reps`)."""
    a, b, c = (torch.randn(n, device=device) for _ in range(3))
    return 3 * 4 * n / _time(lambda: torch.add(a, b, out=c), _sync(device), reps) / 1e9


def collective_gbs(device: torch.device, n: int = 2**24, reps: int = 5) -> float:
    """GB/s one rank sends in an all-gather of `n` fp32 values over the default process group, ring-counted as
    the planner counts ZeRO's traffic: (world - 1) / world of the gathered bytes per rank (the median of
    `reps`); 0.0 outside a process group of two or more ranks."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return 0.0
    world = dist.get_world_size()
    part = torch.randn(n // world, device=device)
    whole = torch.empty(part.numel() * world, device=device)

    def gather():
        dist.barrier()
        dist.all_gather_into_tensor(whole, part)
    return (world - 1) / world * 4 * whole.numel() / _time(gather, _sync(device), reps) / 1e9


def _sync(device: torch.device):
    """What waits for `device`'s queued work (loop.timing)."""
    return lambda: synchronize(device)


def _time(fn, sync, reps: int) -> float:
    """The median of `reps` timed calls of `fn` after one untimed, or of 3 where that one took over 10 ms (a
    long operator varies less)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    times = []
    for _ in range(reps if time.perf_counter() - start < 0.01 else min(reps, 3)):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def replay(counts: Counter, device: torch.device, reps: int = 5, progress=None) -> Replay:
    """Time every recorded operator on `device`, without autograd (its backward operators were recorded as
    themselves). `progress(done, total)` after each."""
    sync = _sync(device)
    result, failed = Replay(distinct_ops=len(counts)), []
    for i, ((func, arg_specs, kwarg_specs, backward, flops, moved), n) in enumerate(counts.items()):
        try:
            with torch.no_grad():
                args = [_materialise(s, device) for s in arg_specs]
                kwargs = {k: _materialise(s, device) for k, s in kwarg_specs}
                seconds = n * _time(lambda: func(*args, **kwargs), sync, reps)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            failed.append(f"{func}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}")
            continue
        finally:
            if progress:
                progress(i + 1, len(counts))
        if flops:
            result.compute_forward_s += 0 if backward else seconds
            result.compute_backward_s += seconds if backward else 0
            result.compute_flops += 0 if backward else n * flops
        else:
            result.memory_forward_s += 0 if backward else seconds
            result.memory_backward_s += seconds if backward else 0
            result.moved_bytes += 0 if backward else n * moved
    result.failed = tuple(failed)
    return result
