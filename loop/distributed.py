"""Process groups: what the launcher set, starting DeepSpeed's communication, and leaving without an abort."""
import contextlib
import datetime
import io
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

import compat
from compat import quiet_deepspeed_deprecations, release_deepspeed_shm

DEFAULT_TIMEOUT_S = 1800  # torch's own default for gloo and NCCL
STORE_TIMEOUT_S = 5  # the watchdog's and a failing rank's wait for the store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) as the launcher set them; one rank without a launcher."""
    if "RANK" not in os.environ:  # plain `python train.py`
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), ranks_per_node()


def ranks_per_node() -> int:
    """This node's ranks, as torchrun (LOCAL_WORLD_SIZE) or DeepSpeed's launcher (LOCAL_SIZE) set them; 1 without."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1")


class DistributedError(RuntimeError):
    """The ranks could not form their process group: one line saying where and how long this rank waited."""


def wait_for_master(addr: str, port: int, timeout_s: float):
    """Return once a TCP connection to the master's address succeeds; DistributedError after `timeout_s`. Checked
    before torch connects, whose own timeout is logged with a C++ stack trace per retry. The retries start 10 ms
    apart and grow by half up to 0.5 s: ranks started together find the master's store within a tenth of a
    second of its listening, and a thousand ranks waiting minutes for node 0 try twice a second each."""
    deadline, pause = time.monotonic() + timeout_s, 0.01
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except socket.gaierror as e:
            raise DistributedError(f"cannot resolve the master address {addr} ({e.strerror}): MASTER_ADDR must be "
                                   f"node 0's name or IP as this node resolves it") from None
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"rank {os.environ.get('RANK')} cannot reach the master at {addr}:{port} within {timeout_s:g} s "
                    f"(dist_timeout): is node 0 running, is {addr}:{port} reachable from this node (firewall, "
                    f"interface), and did every node get the same MASTER_ADDR and MASTER_PORT? "
                    f"({e.strerror or type(e).__name__})") from None
            time.sleep(pause)
            pause = min(1.5 * pause, 0.5)


def check_device_memory(gib: float) -> str | None:
    """Why `device_memory_gb` cannot cap this machine's GPUs, or None (0: nothing to cap)."""
    if not gib:
        return None
    if not torch.cuda.is_available():
        return f"device_memory_gb {gib:g} caps a GPU's memory and this machine has none; leave it 0"
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if gib > total:
        return f"device_memory_gb {gib:g} is more than this GPU's {total:.1f} GiB"
    return None


def cap_device_memory(device: torch.device, gib: float) -> float:
    """Let this process's caching allocator use at most `gib` GiB of its GPU (a smaller device's memory, on a larger
    one): the fraction set, or 0 for no cap. An allocation past it raises CUDA's out-of-memory error."""
    if not gib or device.type != "cuda":
        return 0.0
    fraction = min(1.0, gib * 2**30 / torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def flush_cpu_denormals():
    """Compute on the CPU with denormal floats flushed to zero, as GPUs' bf16 paths do. Swin's shifted windows
    add -100 to masked attention logits, so about half its attention probabilities underflow to denormals,
    which x86 multiplies an order of magnitude slower; values below 1.2e-38
    are far below anything fp32 training resolves. Every CPU run and benchmark job calls it, on every engine."""
    torch.set_flush_denormal(True)


def init_distributed(local_rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the process group through DeepSpeed (NCCL on GPUs, gloo on its CPU accelerator); returns this
    rank's device. `timeout_s` bounds the wait for the master's address and for the other ranks (and, after
    that, every collective); past it, DistributedError names the address and port."""
    if os.environ.get("RANK", "0") != "0":  # rank 0's process or launcher serves the address; the others connect
        wait_for_master(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)
    if not torch.cuda.is_available():  # said, DeepSpeed picks its CPU accelerator without a warning per process
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = compat.import_deepspeed()  # heavy: imported once the input is known to be good

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines describe its own set-up, every rank
    quiet_deepspeed_deprecations()
    printed = io.StringIO()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        with contextlib.redirect_stdout(printed):
            deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s))
            dist.barrier()  # every rank has joined
    except (RuntimeError, dist.DistError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():  # the store's port is taken
            raise DistributedError(
                f"rank {os.environ.get('RANK')} could not serve the process group's store at {where}: the port is in "
                f"use by another process (another job, or a rank of one not yet exited); launch with another "
                f"--master_port (MASTER_PORT), or once that process has exited") from None
        raise DistributedError(
            f"rank {os.environ.get('RANK')} could not form the process group through the master at {where} within "
            f"{timeout_s:g} s (dist_timeout): did every node start, with the same MASTER_ADDR, MASTER_PORT and "
            f"world size? ({first})") from None
    # every rank prints that its CPU communication op was built (or loaded from the cache); other lines pass
    sys.stdout.writelines(line for line in printed.getvalue().splitlines(keepends=True)
                          if not line.endswith("built successfully\n"))
    release_deepspeed_shm(dist.get_rank())
    if not torch.cuda.is_available():
        flush_cpu_denormals()
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


# markers of a failed collective in the errors gloo and NCCL raise (plain RuntimeErrors from gloo)
COMM_ERROR_MARKERS = ("gloo", "NCCL", "Timed out", "Connection closed by peer", "Connection reset by peer")


def is_comm_error(e: BaseException) -> bool:
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and
                                             any(m in str(e) for m in COMM_ERROR_MARKERS))


STEP = re.compile(r"step \d+")  # a heartbeat of the training loop (Heartbeat.beat)


class Heartbeat:
    """Every rank records what it is doing (the step) in the process group's store, at `heartbeat/<rank>`; when a
    collective fails, or this rank makes no progress for `timeout_s`, the report says where each rank last was,
    which names the rank that died or stalled. A rank that fails (`fail_fast`) says so in the store, and every other
    rank's watchdog ends its own process within a second of reading it.

    The watchdog is this rank's own clock, not the backend's: DeepSpeed's shared-memory all-reduce (CPU ranks on
    one node) waits for a stalled peer without any timeout, and a hung NCCL kernel may not raise either. It reads
    the main loop's progress (`beat`), never the process's: a rank whose main thread has died is not alive.
    """

    POLL_S = 1.0

    def __init__(self, rank: int, world_size: int, timeout_s: float, exit_code: int):
        from compat import default_store

        self.store, self.rank, self.world_size = default_store(), rank, world_size
        self.what, self.since = "starting", time.monotonic()
        self.timeout_s, self.exit_code, self.failing = timeout_s, exit_code, False
        # one key per launch attempt: torchrun's store outlives a restart of the workers
        self.failed_key = f"failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.watch_store = None  # the watchdog's own connection to the store (_watcher_store)
        self.lock, self.written = threading.Lock(), None  # `written`: what the store holds for this rank
        threading.Thread(target=self._watch, daemon=True, name="heartbeat").start()

    def _watcher_store(self):
        """The watchdog's own client of the store, with a short timeout: a store whose host is stopped (a rank
        under SIGSTOP hosts it under `deepspeed`) must not hold the watchdog past its own deadline."""
        if self.watch_store is None and isinstance(self.store, dist.TCPStore):
            try:
                self.watch_store = dist.TCPStore(self.store.host, self.store.port, is_master=False,
                                                 timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
            except Exception:  # the host is not answering: try again at the next poll
                return None
        return self.watch_store

    def beat(self, what: str):
        """Where this rank is now. A step ("step N") that follows another step is kept here and the watchdog writes
        it to the store at its next poll (at most once a second), so that the loop's steps make no round trip to the
        store; anything else (evaluating, saving, loading, and the first step after them) is written at once, so that
        the store never says a rank is still setting up once it has stepped."""
        self.what, self.since = what, time.monotonic()
        if not (STEP.fullmatch(what) and STEP.fullmatch(self.written or "")):
            self.publish(self.store)

    def publish(self, store):
        """The store's `heartbeat/<rank>` set to where this rank is, if it holds something older."""
        with self.lock:
            what = self.what
            if store is not None and what != self.written:
                store.set(f"heartbeat/{self.rank}", what)
                self.written = what

    def _watch(self):
        while True:
            time.sleep(min(self.POLL_S, self.timeout_s / 4))
            store = self._watcher_store()
            try:
                self.publish(store)
            except Exception:  # the store's host is ending or stopped: the checks below still hold
                pass
            self.stop_if_another_failed(store)
            stuck = time.monotonic() - self.since
            if stuck > self.timeout_s:
                self.fail(f"no progress for {stuck:.0f} s at '{self.what}' (dist_timeout {self.timeout_s:g} s)")

    def announce_failure(self, what: str):
        """Tell every rank that this rank failed (`what`: one line); best effort. The read after the write returns
        once the store holds it, before this process ends and its peers' collectives fail."""
        self.failing = True
        try:
            self.store.set(self.failed_key, what)
            self.store.check([self.failed_key])
        except Exception:  # the store's host is gone: the launcher ends the others
            pass

    def stop_if_another_failed(self, store=None):
        """End this process (exit 1) if another rank announced its failure: its line is the job's reason."""
        store = store or self.store
        try:
            failed = not self.failing and store.check([self.failed_key])
            reason = failed and store.get(self.failed_key).decode()
        except Exception:  # the store's host is ending or stopped: the caller's own checks still hold
            return
        if failed:
            print(f"error: rank {self.rank}: stopping at {self.what}, because {reason}", file=sys.stderr, flush=True)
            os._exit(EXIT_FAILED)

    def fail(self, what: str):
        self.store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))  # ending: no wait on a stopped host
        self.stop_if_another_failed()  # a collective that failed because another rank had: that rank's reason
        print(f"error: rank {self.rank}: {what}. Where the ranks last reported: {self.report()}. Another rank died or "
              f"stalled (out of memory, a hung data read, a lost node): one behind the others, or the first whose "
              f"own log stops", file=sys.stderr, flush=True)
        os._exit(self.exit_code)

    def report(self) -> str:
        try:
            self.store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
            self.publish(self.store)
            seen = []
            for r in range(self.world_size):
                key = f"heartbeat/{r}"
                seen.append(f"rank {r}: {self.store.get(key).decode() if self.store.check([key]) else 'not started'}")
            return "; ".join(seen)
        except Exception:  # the store's host is the one that stopped
            return (f"the master's store did not answer within {STORE_TIMEOUT_S} s: its host (rank 0's node) is the one "
                    f"that stopped")


EXIT_FAILED = 1  # an exception on some rank ended the job


def fail_fast(heartbeat: Heartbeat, run_dir: str, before_exit: list):
    """From here on, an uncaught exception on this rank ends the whole job within seconds instead of leaving the
    other ranks waiting in their next collective until `dist_timeout`:
    - the full traceback goes to `<run_dir>/errors/rank<N>.txt`, one line to stderr naming the rank, where it was
      (the heartbeat's step and phase) and the exception;
    - every callable in `before_exit` runs (the logs' flushes: nothing already written is lost);
    - the store tells the other ranks, whose watchdogs stop them (exit 1), and this process ends at once with exit
      code 1, whatever threads are left (`os._exit`).
    An error of a collective is the other ranks' failure seen from here: it keeps its own line and exit code
    (where every rank was; the heartbeat's code)."""
    def hook(kind, value, tb):
        first = str(value).strip().splitlines()[0] if str(value).strip() else ""
        if is_comm_error(value):
            heartbeat.fail(f"a collective failed ({first or kind.__name__})")
        line = f"rank {heartbeat.rank} failed at {heartbeat.what}: {kind.__name__}" + (f": {first}" if first else "")
        path = os.path.join(run_dir, "errors", f"rank{heartbeat.rank}.txt")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(line + "\n\n" + "".join(traceback.format_exception(kind, value, tb)))
            where = f" (traceback: {path})"
        except OSError:
            where = ""
            traceback.print_exception(kind, value, tb)
        print(f"error: {line}{where}", file=sys.stderr, flush=True)
        heartbeat.announce_failure(line)
        for fn in before_exit:
            try:
                fn()
            except Exception:  # a log that cannot be flushed must not keep the job alive
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)

    sys.excepthook = hook
