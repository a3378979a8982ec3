"""Checkpoint and resume under ZeRO-3: the step, the LR schedule, the weights and the data position carry over."""
import os

import pytest
from conftest import launch, read_metrics
from safetensors.torch import load_file


def test_resume_continues_exactly(debug_args, tmp_path):
    # 2 ranks x 2 workers x 32 images: 22 steps per epoch, so the resumed stretch 16-30 crosses an epoch
    args = debug_args + ["--model", "vit-debug", "--zero_stage", "3", "--max_steps", "30", "--save_every", "15",
                         "--eval_every", "0", "--num_workers", "2", "--micro_batch_size", "32"]
    full = tmp_path / "full"
    proc = launch(args + ["--output_dir", full])
    assert "22 steps per epoch" in proc.stdout
    full_records = {r["step"]: r for r in read_metrics(full)}

    # continue from the step-15 checkpoint of that run in a fresh directory
    resumed = tmp_path / "resumed"
    proc = launch(args + ["--output_dir", resumed, "--resume", full / "checkpoints" / "step0000015"])
    assert "at step 15" in proc.stdout and "data order restarts" not in proc.stdout
    records = read_metrics(resumed)
    assert [r["step"] for r in records] == list(range(16, 31))
    for r in records:  # same weights, optimizer state, schedule position and samples: the same numbers
        assert r["lr"] == pytest.approx(full_records[r["step"]]["lr"], rel=1e-12)
        assert r["loss"] == full_records[r["step"]]["loss"], r["step"]

    # `resume: latest` in the finished run's own directory: nothing left to train, same weights exported
    before = load_file(full / "hf_model" / "model.safetensors")
    os.remove(full / "hf_model" / "model.safetensors")
    proc = launch(args + ["--output_dir", full, "--resume", "latest"])
    assert "at step 30" in proc.stdout and "done:" in proc.stdout
    after = load_file(full / "hf_model" / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].equal(after[name]), name
    assert [r["step"] for r in read_metrics(full)] == list(range(1, 31))


def test_changed_data_layout_restarts_the_data_order_and_says_so(debug_args, tmp_path):
    args = debug_args + ["--model", "vit-debug", "--max_steps", "4", "--save_every", "2", "--eval_every", "0"]
    launch(args + ["--output_dir", tmp_path / "a"], nproc=1)
    proc = launch(args + ["--output_dir", tmp_path / "b", "--resume", tmp_path / "a" / "checkpoints" / "step0000002",
                          "--num_workers", "2"], nproc=1)
    assert "data order restarts (the 1 data streams per rank do not split over 2 workers" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [3, 4]


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(debug_args, tmp_path, engine):
    """Each checkpoint records its files' sizes at the save: `--resume latest` skips a newest checkpoint whose
    largest file was cut short (a failed copy), says so, and continues from the one before, bitwise; resuming
    that damaged checkpoint by name is one line and exit 2."""
    args = debug_args + ["--model", "vit-debug", "--engine", engine, "--max_steps", "10", "--save_every", "5",
                         "--eval_every", "0"]
    run = tmp_path / "run"
    launch(args + ["--output_dir", run])
    expected = {r["step"]: r["loss"] for r in read_metrics(run)}
    newest = run / "checkpoints" / "step0000010"
    largest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 2)
    proc = launch(args + ["--output_dir", tmp_path / "other", "--resume", newest], check=False)
    assert proc.returncode == 2 and f"error: resume: checkpoint {newest} is damaged" in proc.stderr
    proc = launch(args + ["--output_dir", run, "--resume", "latest"])
    assert f"warning: checkpoint {newest} is damaged ({largest.relative_to(newest)} is " in proc.stderr
    assert "at step 5" in proc.stdout
    assert {r["step"]: r["loss"] for r in read_metrics(run)} == expected  # and step 10 saved again, whole
