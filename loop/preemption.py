"""Preemption: SIGTERM or SIGUSR1 (what Slurm and Kubernetes send before they kill a job) ends the run cleanly.

The first signal sets a flag that train.py all-reduces with the step's loss, so every rank learns of it at the
end of the same optimizer step, whichever rank got it; they then write a checkpoint together and exit with
EXIT_PREEMPTED. If that has not happened within `grace_s` seconds of the signal, the process exits with
EXIT_GRACE_EXPIRED (the last complete checkpoint stays). A second signal more than DUPLICATE_WINDOW_S after the
first exits at once; one within it is the same request delivered twice (a scheduler signals every process and
the launcher passes the signal on to its ranks as well).

The signals are read by a thread from Python's wakeup fd, not by a Python-level handler, which would run only
when the main thread returns to the interpreter: a rank blocked in a collective still exits on time.
"""
import os
import signal
import sys
import threading
import time

EXIT_PREEMPTED = 3  # a checkpoint of the current step was written: relaunch with --resume latest
EXIT_GRACE_EXPIRED = 4  # the grace period ran out first: the previous checkpoint is the newest
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DUPLICATE_WINDOW_S = 1.0


class Preemption:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signal = None  # the first signal received
        self._first_at = None
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in SIGNALS:  # a Python-level handler must be set for the wakeup fd to receive the signal
            signal.signal(sig, lambda *_: None)
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True, name="preemption").start()

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _watch(self, read_fd: int):
        while True:
            for signum in os.read(read_fd, 64):
                if signum in SIGNALS:
                    self._on_signal(signum)

    def _on_signal(self, signum: int):
        now = time.monotonic()
        if self._first_at is None:
            self._first_at, self.signal = now, signum
            timer = threading.Timer(self.grace_s, self._expire)
            timer.daemon = True
            timer.start()
        elif now - self._first_at > DUPLICATE_WINDOW_S:
            os._exit(128 + signum)

    def _expire(self):
        print(f"error: {signal.Signals(self.signal).name} received {self.grace_s:g} s ago (preempt_grace) and the "
              f"step and checkpoint have not finished: exiting without them; the newest complete checkpoint stays",
              file=sys.stderr, flush=True)
        os._exit(EXIT_GRACE_EXPIRED)
