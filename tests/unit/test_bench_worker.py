"""The benchmark worker's step schedule: its timed steps run what a compiled job compiled."""
import contextlib

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.registry import lookup_backend
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from ac.policies import traced_policy
from benchmarks.bench_worker import Spec, step_schedule
import compat


@pytest.mark.parametrize("profiled,warmup,timed,flops", [(2, 5, 30, True), (1, 0, 1, True), (2, 1, 8, False)])
def test_the_timed_steps_follow_the_profiled_and_warm_up_ones_and_the_flop_counted_step_comes_last(
        profiled, warmup, timed, flops):
    steps, timed_steps, flop_step = step_schedule(Spec(profiled_steps=profiled, warmup_steps=warmup,
                                                       timed_steps=timed, count_flops=flops))
    assert list(timed_steps) == list(range(profiled + warmup + 1, profiled + warmup + timed + 1))
    assert flop_step == (profiled + warmup + timed + 1 if flops else 0)
    assert list(steps) == list(range(1, profiled + warmup + timed + flops + 1))


def _light():  # the context compiled `light` checkpoints each block with (ac/policies.py)
    return create_selective_checkpoint_contexts(traced_policy())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def _inner(self, h):
        return self.fc2(nn.functional.gelu(self.fc1(h))) + h

    def forward(self, h):
        return checkpoint(self._inner, h, use_reentrant=False, context_fn=_light)


def test_every_timed_step_of_a_compiled_checkpointed_job_runs_its_compiled_blocks():
    """Steps as the worker runs them, on compiled blocks under `light`'s traced policy: each timed step calls
    every block's compiled graph. torch.compile stops compiling a block it meets under the FLOP counter's dispatch
    mode for good (pytorch/pytorch#190286): the same FLOP step placed before the timed ones leaves them eager."""
    spec = Spec(profiled_steps=2, warmup_steps=1, timed_steps=2, count_flops=True)
    steps, timed, flop_step = step_schedule(spec)

    def compiled_calls_per_step(order):
        torch._dynamo.reset()
        calls = [0]

        def counting(gm, inputs):
            compiled = lookup_backend("aot_eager")(gm, inputs)

            def run(*args):
                calls[0] += 1
                return compiled(*args)
            return run

        torch.manual_seed(0)
        blocks = nn.ModuleList([_Block() for _ in range(3)])
        for block in blocks:
            block.compile(backend=counting)
        per_step = {}
        for step in order:
            before = calls[0]
            with compat.flop_counter() if step == flop_step else contextlib.nullcontext():
                h = torch.randn(2, 8)
                for block in blocks:
                    h = block(h)
                h.sum().backward()
            per_step[step] = calls[0] - before
        return per_step

    scheduled = compiled_calls_per_step(steps)
    assert all(scheduled[step] == 3 for step in timed)
    # the hazard the schedule avoids: the counted step right after the profiled ones
    counted_early = compiled_calls_per_step([1, 2, flop_step, *timed])
    assert counted_early[1] == 3 and all(counted_early[step] == 0 for step in timed)
    torch._dynamo.reset()
