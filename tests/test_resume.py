"""Checkpoint and resume under ZeRO-3: the step, the LR schedule and the weights carry over."""
import os

import pytest
from conftest import launch, read_metrics
from safetensors.torch import load_file


def test_resume_continues_at_next_step(debug_args, tmp_path):
    args = debug_args + ["--model", "vit-debug", "--zero_stage", "3", "--max_steps", "20", "--save_every", "10",
                         "--eval_every", "0"]
    full = tmp_path / "full"
    launch(args + ["--output_dir", full])
    full_records = {r["step"]: r for r in read_metrics(full)}

    # continue from the step-10 checkpoint of that run in a fresh directory
    resumed = tmp_path / "resumed"
    proc = launch(args + ["--output_dir", resumed, "--resume", full / "checkpoints" / "step0000010"])
    assert "at step 10" in proc.stdout
    records = read_metrics(resumed)
    assert [r["step"] for r in records] == list(range(11, 21))
    for r in records:  # same schedule position as the uninterrupted run
        assert r["lr"] == pytest.approx(full_records[r["step"]]["lr"], rel=1e-12)
    assert records[0]["loss"] < full_records[1]["loss"]  # trained weights, not a fresh init

    # `resume: latest` in the finished run's own directory: nothing left to train, same weights exported
    before = load_file(full / "hf_model" / "model.safetensors")
    os.remove(full / "hf_model" / "model.safetensors")
    proc = launch(args + ["--output_dir", full, "--resume", "latest"])
    assert "at step 20" in proc.stdout and "done:" in proc.stdout
    after = load_file(full / "hf_model" / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].equal(after[name]), name
    assert [r["step"] for r in read_metrics(full)] == list(range(1, 21))
