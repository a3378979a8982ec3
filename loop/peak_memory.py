"""How much memory a step allocated: the GPU allocator's peak, or on CPU, where torch keeps no allocator
statistics, the profiler's memory events."""
import contextlib
import json
import os
import resource
import sys
import tempfile

import torch

# kineto logs a line at every profiler start and stop unless its log level is above them
KINETO_QUIET_LEVEL = "6"
# c10's CPU allocator warns (once per process) when a block allocated before the profiling started is freed
# under it; a profiled training step always frees such blocks, and the peak counts only what it allocates
ALLOCATOR_WARNING = "Memory block of unknown size was allocated before the profiling started"


def peak_memory_bytes() -> int:
    """GPU: the allocator's peak. CPU: the process's peak resident set (no allocator statistics there)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def _stderr_without(text: str):
    """Hold what C++ code writes to file descriptor 2 and pass on every line but those containing `text` at the
    end. Python's own writes (sys.stderr: an error line, a preemption's message) go straight through, so that a
    process that ends inside (`os._exit`) loses none of them."""
    sys.stderr.flush()
    saved, python_stderr = os.dup(2), sys.stderr
    with tempfile.TemporaryFile() as held:
        sys.stderr = open(saved, "w", buffering=1, encoding=python_stderr.encoding, errors="backslashreplace",
                          closefd=False)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if text not in line:
                    sys.stderr.write(line)
            sys.stderr.flush()


@contextlib.contextmanager
def memory_profiler():
    """torch's CPU profiler recording memory events, without the log lines it prints at every start and stop
    and the allocator's warning about blocks allocated before it."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)  # read when the profiler first starts
    with _stderr_without(ALLOCATOR_WARNING), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


def trace_events(prof) -> list:
    """The events of a finished profiler run, as its chrome trace lists them."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            return json.load(trace)["traceEvents"]


def allocation_curve(events: list) -> list[tuple[float, int]]:
    """(time, bytes allocated) before the first and after each of a CPU profiler run's "[memory]" events, in
    time order: the CPU counterpart of torch.cuda.memory_allocated().

    The events' own running "Total Allocated" is not used: a free on a thread the profiler is not active on
    is neither recorded nor taken off that count, and gloo's worker threads drop the last reference to a
    finished asynchronous collective's tensors (ZeRO-3's gathers, FSDP2's all-gathers). A block the trace still
    holds whose address is allocated again was freed unseen, so it is dropped then, the latest moment it can
    have been freed; a block freed unseen and never reused stays counted, so the curve is never below the
    real one (docs/benchmarks.md).
    """
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return []
    allocated = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]  # from before the profiler
    live, curve = {}, [(memory[0]["ts"], allocated)]
    for e in memory:
        address, size = e["args"]["Addr"], e["args"]["Bytes"]
        if size > 0:
            allocated += size - live.pop(address, 0)
            live[address] = size
        else:
            allocated -= live.pop(address, -size)
        curve.append((e["ts"], allocated))
    return curve


def memory_trace(prof) -> tuple[int, int, int]:
    """(allocated before, peak, allocated after) from a CPU profiler run with profile_memory=True."""
    curve = allocation_curve(trace_events(prof))
    if not curve:
        return 0, 0, 0
    return curve[0][1], max(v for _, v in curve), curve[-1][1]


def measure_activation_bytes(model, images: torch.Tensor) -> int:
    """Bytes a training forward leaves allocated for the backward (activations plus the logits), measured:
    the caching allocator's count on GPU, the profiler's memory events on CPU."""
    if images.is_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(images).logits
        torch.cuda.synchronize()
        retained = torch.cuda.memory_allocated() - before
        del out
        return retained
    with memory_profiler() as prof:
        out = model(images).logits
    before, _, after = memory_trace(prof)
    del out
    return after - before
