"""Resume on another number of ranks, through DeepSpeed's universal checkpoint: a 2-rank checkpoint continues
on 1 rank that accumulates 2 micro-batches per step (the same global batch), and a 1-rank one on 2 ranks, under
ZeRO 1, 2 and 3. The next 10 losses equal the uninterrupted run's bitwise (the gradients of two ranks' halved
losses sum to what one rank's two accumulated halves give), the data order continues, and the original checkpoint
is never modified. From the first step, the two clip by the same gradient norm."""
import hashlib
import json
import os

import numpy as np
import pytest
from conftest import STAGES, launch, read_metrics

# ZeRO-3 in the default run; ZeRO-1 and 2 take the same path through the universal format (`-m slow`, for the
# suite's time)
ELASTIC_STAGES = [pytest.param(s, marks=pytest.mark.slow) if s != 3 else s for s in STAGES]

NEXT = 10  # losses compared after the resume


def fingerprint(directory):
    """{file: sha256} of everything in a checkpoint directory."""
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory))}


def losses_from(run_dir, first, n=NEXT):
    records = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    return np.array([records[s] for s in range(first, first + n)])


@pytest.mark.parametrize("stage", ELASTIC_STAGES)
def test_two_ranks_resume_on_one(stage_runs, debug_args, tmp_path, stage):
    reference = stage_runs["vit-debug", stage]
    ckpt = os.path.join(reference, "checkpoints", "step0000030")
    before = fingerprint(ckpt)
    args = debug_args + ["--model", "vit-debug", "--zero_stage", stage, "--grad_accum_steps", 2, "--eval_every", 0,
                         "--save_every", 0, "--output_dir", tmp_path / "one", "--resume", ckpt]
    proc = launch(args, nproc=1)
    assert "checkpoint written by 2 ranks, this run has 1: converting it to DeepSpeed's universal format" in proc.stdout
    assert "at step 30" in proc.stdout and "data order restarts" not in proc.stdout
    assert "global batch 32 = 16 micro x 2 accum x 1 ranks" in proc.stdout
    np.testing.assert_array_equal(losses_from(tmp_path / "one", 31), losses_from(reference, 31))
    assert fingerprint(ckpt) == before  # the original checkpoint is only read
    universal = ckpt + "_universal"
    assert os.path.isdir(os.path.join(universal, "zero")) and not os.path.exists(universal + ".partial")
    assert json.load(open(os.path.join(universal, "train_state.json")))["world_size"] == 2


@pytest.mark.parametrize("stage", ELASTIC_STAGES)
def test_one_rank_resumes_on_two(debug_args, tmp_path, stage):
    """A 1-rank run accumulating 2 micro-batches, stopped at its step-10 checkpoint and continued on 2 ranks,
    gives the 1-rank run's own next 10 losses."""
    args = debug_args + ["--model", "vit-debug", "--zero_stage", stage, "--max_steps", 20, "--eval_every", 0]
    one = tmp_path / "one"
    launch(args + ["--grad_accum_steps", 2, "--save_every", 10, "--output_dir", one], nproc=1)
    two = tmp_path / "two"
    proc = launch(args + ["--save_every", 0, "--output_dir", two, "--resume", one / "checkpoints" / "step0000010"])
    assert "checkpoint written by 1 ranks, this run has 2" in proc.stdout
    assert "at step 10" in proc.stdout and "data order restarts" not in proc.stdout
    np.testing.assert_array_equal(losses_from(two, 11), losses_from(one, 11))


@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s != 2 else s for s in STAGES])
def test_the_gradient_norm_does_not_depend_on_the_number_of_ranks(debug_args, tmp_path, stage):
    """2 ranks and 1 rank accumulating 2 micro-batches clip by the same global gradient norm, to the fp32 bit:
    ZeRO-1/2 keep its sum in float64 through the all-reduce (compat.py), as ZeRO-3 does (whose norm stays
    float64 and may differ in float64's last bit). The Swin's first-step norm differs in its last fp32 bit between
    the two under DeepSpeed's own ZeRO-1/2 norm."""
    args = debug_args + ["--model", "swin-debug", "--zero_stage", stage, "--max_steps", 4, "--eval_every", 0,
                         "--save_every", 0]
    launch(args + ["--output_dir", tmp_path / "two"])
    launch(args + ["--grad_accum_steps", 2, "--output_dir", tmp_path / "one"], nproc=1)
    two, one = ([(np.float32(r["grad_norm"]), r["loss"]) for r in read_metrics(tmp_path / run)]
                for run in ("two", "one"))
    assert len(two) == 4 and two == one
