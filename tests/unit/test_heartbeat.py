"""The heartbeat's store writes, in this process: a one-rank gloo group on a TCPStore (a thread, not a process)."""
import time

import torch.distributed as dist

from conftest import free_port
from loop.distributed import Heartbeat


def test_the_first_step_is_written_at_once_and_later_steps_at_the_next_poll():
    """A rank that has stepped never reads as still setting up (the stalled-rank report names where each rank is):
    the first step after a phase goes to the store at once; the steps after it wait for the watchdog's poll."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        beat = Heartbeat(0, 1, timeout_s=1e9, exit_code=3)
        held = lambda: beat.store.get("heartbeat/0").decode()  # noqa: E731
        beat.beat("opening the logs")
        assert held() == "opening the logs"
        beat.beat("step 1")
        assert held() == "step 1"
        beat.written = "step 1"  # the watchdog may have polled in between: the next step is deferred either way
        beat.beat("step 2")
        deadline = time.monotonic() + 5 * Heartbeat.POLL_S
        while held() != "step 2":
            assert time.monotonic() < deadline, held()
            time.sleep(0.05)
        beat.beat("step 2, evaluating")
        assert held() == "step 2, evaluating"
    finally:
        dist.destroy_process_group()
