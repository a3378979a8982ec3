"""train.py's loop reads the device once per logging interval: the host-device synchronisations of a 2-rank run,
counted by tests/syncs.py at every step and charged to whoever makes them."""
import json
import os

import pytest
from conftest import fork_launch, read_metrics

STEPS, LOG_EVERY = 24, 8


# DeepSpeed's own reads a step after the first two (docs/configuration.md's table; fp32, clipping, foreach AdamW):
# ZeRO-1/2: is_invalid_grad_norm 3, torch AdamW's step count 2; ZeRO-3: 1 and 2
DEEPSPEED_READS = {2: 5, 3: 3}


# ZeRO-3: slow (~12 s), the same loop under another stage; the default run holds ZeRO-2's count and the loop's reads
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_loop_reads_the_device_once_per_logging_interval(debug_args, tmp_path, stage):
    counts = tmp_path / "syncs.json"
    run = tmp_path / "run"
    # mixing on: its random draws are the host's and its permutation goes to the device without a wait
    args = debug_args + ["--model", "vit-debug", "--zero_stage", stage, "--max_steps", STEPS, "--log_every", LOG_EVERY,
                         "--eval_every", 0, "--save_every", 0, "--mixup", 0.8, "--cutmix", 1.0, "--output_dir", run]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", SYNC_COUNTS=str(counts))
    proc = fork_launch(args, 2, env, timeout=300, module="tests.syncs")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        phases = json.load(open(f"{counts}.{rank}"))["phases"]
        ours = {step: phases.get(f"step {step}", {}).get("train", 0) for step in range(1, STEPS + 1)}
        # the first two steps are read alone (warm-up; the profiled step on CPU), then every LOG_EVERY steps
        reads = {1, 2} | set(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
        assert ours == {step: int(step in reads) for step in ours}, (rank, ours)
        assert phases[f"step {STEPS}, evaluating"]["train"] > 0  # the counter sees the project's reads
        theirs = [phases.get(f"step {step}", {}).get("deepspeed", 0) for step in range(3, STEPS + 1)]
        assert theirs == [DEEPSPEED_READS[stage]] * len(theirs), (rank, theirs)
    # every step is still recorded, each with its own loss
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert len({r["loss"] for r in records}) == STEPS
