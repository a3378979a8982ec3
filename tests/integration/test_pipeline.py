"""Pipeline parallelism (parallel/pipeline.py) in real train.py runs under FSDP2 and DDP: two ranks that each hold a
stage train as one rank does, resume on any number of stages, and export a model that runs whole."""
import pytest
import torch
from conftest import check_input, launch, read_metrics, run_entry


def steps(run_dir) -> dict:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def assert_close_steps(got: dict, expected: dict, first: int, last: int):
    assert sorted(got) == list(range(first, last + 1))
    for s in range(first, last + 1):
        assert got[s]["loss"] == pytest.approx(expected[s]["loss"], rel=1e-5), s
        assert got[s]["grad_norm"] == pytest.approx(expected[s]["grad_norm"], rel=1e-5), s


def test_two_stages_train_resume_whole_and_export_as_one_rank_does(debug_args, tmp_path):
    """8 steps of vit-debug on one rank, and on two ranks with pp_size 2 (one data rank: the same global batch of
    16, cut into 4 pieces under 1F1B): the same losses and gradient norms within fp32 reduction order (1e-5
    relative), the same val top-1, exported models with the same logits (export.py of the two-stage checkpoint
    gives its run's export's logits exactly); the pipeline's checkpoint at step 4 resumed on one rank without
    stages goes on as the one-rank run."""
    args = debug_args + ["--model", "vit-debug", "--engine", "fsdp2", "--max_steps", "8", "--eval_every", "8",
                         "--save_every", "4"]
    one = tmp_path / "one"
    launch(args + ["--output_dir", one], nproc=1)
    expected = steps(one)
    pp = tmp_path / "pp"
    proc = launch(args + ["--pp_size", "2", "--output_dir", pp])
    assert "pipeline: 2 stages of blocks 0-0 | 1-1 | 1f1b, 4 pieces of 4 images per micro-batch | bubble 20%" \
        in proc.stdout
    assert "= 1 data x 2 pipeline stages | global batch 16 = 16 micro x 1 accum x 1 ranks" in proc.stdout
    assert_close_steps(steps(pp), expected, 1, 8)
    evals = [(a, b) for a, b in zip(read_metrics(one), read_metrics(pp)) if "val_top1" in a]
    assert evals and all(b["val_top1"] == a["val_top1"] for a, b in evals)

    from transformers import AutoModelForImageClassification

    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        logits = [AutoModelForImageClassification.from_pretrained(d / "hf_model").eval()(pixel_values=images).logits
                  for d in (one, pp)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    # export.py, in one process, reads the two stages' checkpoint as one model: the run's own export's logits
    out = tmp_path / "exported"
    proc = run_entry("export", pp / "checkpoints" / "step0000008", out)
    assert proc.returncode == 0, proc.stderr
    with torch.no_grad():
        exported = AutoModelForImageClassification.from_pretrained(out).eval()(pixel_values=images).logits
    assert torch.equal(exported, logits[1])

    whole = tmp_path / "whole"
    proc = launch(args + ["--output_dir", whole, "--resume", pp / "checkpoints" / "step0000004"], nproc=1)
    assert "at step 4" in proc.stdout and "data order restarts" not in proc.stdout
    assert_close_steps(steps(whole), expected, 5, 8)


@pytest.mark.parametrize("args, says", [
    (["--engine", "fsdp2", "--pp_size", "2"], "error: pp_size 2 does not divide the world size (1)"),
    (["--engine", "deepspeed", "--pp_size", "2"],
     "error: engine deepspeed with pp_size 2: pipeline parallelism (torch.distributed.pipelining's stages) is not "
     "available under engine deepspeed; use pp_size 1 or engine fsdp2 / ddp"),
    (["--engine", "fsdp2", "--pp_size", "2", "--pp_schedule", "zb"],
     "error: config key 'pp_schedule' must be one of ('1f1b', 'gpipe'), got 'zb'"),
])
def test_a_pipeline_that_cannot_run_is_one_line(debug_args, capsys, monkeypatch, args, says):
    code, err = check_input(debug_args + args, capsys, monkeypatch)
    assert code == 2 and err == [says], err


@pytest.mark.slow
def test_schedules_policies_and_resumes_under_the_pipeline(debug_args, tmp_path):
    """vit-digits (6 blocks) on two stages for 6 steps, a checkpoint at 3: GPipe gives 1F1B's steps within fp32
    reduction order; `full`, `selective` and `every_n:2` checkpointing give bitwise the steps of `none` under
    1F1B; resumed on the same two stages the run goes on bitwise; a one-rank checkpoint resumed on two stages
    goes on as the two-stage run."""
    args = debug_args + ["--model", "vit-digits", "--engine", "fsdp2", "--max_steps", "6", "--eval_every", "0",
                         "--save_every", "3", "--drop_path", "0.1"]
    base = tmp_path / "none"
    launch(args + ["--pp_size", "2", "--output_dir", base])
    expected = steps(base)
    gpipe = tmp_path / "gpipe"
    launch(args + ["--pp_size", "2", "--pp_schedule", "gpipe", "--output_dir", gpipe])
    assert_close_steps(steps(gpipe), expected, 1, 6)
    for policy in ("full", "selective", "every_n:2"):
        out = tmp_path / policy.replace(":", "")
        launch(args + ["--pp_size", "2", "--ac", policy, "--output_dir", out])
        assert {s: (r["loss"], r["grad_norm"]) for s, r in steps(out).items()} == \
            {s: (r["loss"], r["grad_norm"]) for s, r in expected.items()}, policy
    same = tmp_path / "same"
    launch(args + ["--pp_size", "2", "--output_dir", same, "--resume", base / "checkpoints" / "step0000003"])
    assert {s: r["loss"] for s, r in steps(same).items()} == {s: expected[s]["loss"] for s in range(4, 7)}
    one = tmp_path / "one"
    launch(args + ["--drop_path", "0", "--output_dir", one], nproc=1)
    split = tmp_path / "split"
    launch(args + ["--drop_path", "0", "--pp_size", "2", "--output_dir", split, "--resume",
                   one / "checkpoints" / "step0000003"])
    assert_close_steps(steps(split), steps(one), 4, 6)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_two_pipelines_of_two_stages_train_as_two_data_ranks(debug_args, tmp_path, engine):
    """4 ranks as 2 data ranks x 2 stages (each stage sharded, or replicated, over 2 ranks) against 2 data ranks
    without stages: the same global batch, the same losses and gradient norms within 1e-5; the 4-rank run's
    checkpoint at step 3 resumed on the same grid goes on bitwise."""
    args = debug_args + ["--model", "vit-debug", "--engine", engine, "--max_steps", "6", "--eval_every", "6",
                         "--save_every", "3"]
    flat = tmp_path / "flat"
    launch(args + ["--output_dir", flat])
    grid = tmp_path / "grid"
    proc = launch(args + ["--pp_size", "2", "--output_dir", grid], nproc=4)
    assert "= 2 data x 2 pipeline stages" in proc.stdout
    assert_close_steps(steps(grid), steps(flat), 1, 6)
    again = tmp_path / "again"
    launch(args + ["--pp_size", "2", "--output_dir", again, "--resume", grid / "checkpoints" / "step0000003"],
           nproc=4)
    assert {s: r["loss"] for s, r in steps(again).items()} == {s: r["loss"] for s, r in steps(grid).items() if s > 3}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_the_ema_of_two_stages_is_one_ranks_and_resumes_whole(debug_args, tmp_path, engine):
    """ema_decay 0.9 on two stages against one rank without: the same val_ema_top1; each checkpoint's ema/ files
    (a stage's weights each, FSDP2 shards or DDP's whole tensors) reassemble into one rank's EMA within fp32
    reduction order; the two-stage checkpoint at step 4 resumed on one rank carries its EMA on to one rank's."""
    from loop.ema import read_ema
    from models import build_model

    args = debug_args + ["--model", "vit-debug", "--engine", engine, "--max_steps", "8", "--eval_every", "8",
                         "--save_every", "4", "--ema_decay", "0.9"]
    one, pp, whole = tmp_path / "one", tmp_path / "pp", tmp_path / "whole"
    launch(args + ["--output_dir", one], nproc=1)
    launch(args + ["--pp_size", "2", "--output_dir", pp])
    launch(args + ["--output_dir", whole, "--resume", pp / "checkpoints" / "step0000004"], nproc=1)
    assert_close_steps(steps(pp), steps(one), 1, 8)
    shapes = dict(build_model("vit-debug", 10, 16)[0].named_parameters())
    for run, step in ((pp, 4), (pp, 8), (whole, 8)):
        folder = run / "checkpoints" / f"step{step:07d}" / "ema"
        if run == pp:
            assert sorted(f.name for f in folder.iterdir()) == ["rank00000.pt", "rank00001.pt"]
        got = read_ema(folder, shapes)
        expected = read_ema(one / "checkpoints" / f"step{step:07d}" / "ema", shapes)
        assert set(got) == set(expected) == set(shapes)
        for name in shapes:  # atol: the key's bias, which no softmax sees, takes AdamW's steps on rounding noise
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    expected = {r["step"]: r["val_ema_top1"] for r in read_metrics(one) if "val_ema_top1" in r}
    for run in (pp, whole):
        assert {r["step"]: r["val_ema_top1"] for r in read_metrics(run) if "val_ema_top1" in r} == expected, run


@pytest.mark.slow
def test_a_stage_killed_mid_run_ends_the_job_and_the_relaunch_resumes_exactly(debug_args, tmp_path):
    """kill -9 of rank 1 (the last stage) of a two-stage FSDP2 job under torchrun after its step-10 checkpoint:
    the job ends within seconds (rank 0 is not left waiting on a receive), and `--resume latest` goes on to the
    uninterrupted two-stage run's losses bitwise."""
    import os
    import signal
    import subprocess
    import time

    import psutil
    from conftest import REPO, free_port, launcher_command

    args = debug_args + ["--model", "vit-digits", "--engine", "fsdp2", "--pp_size", "2", "--max_steps", "30",
                         "--save_every", "10", "--eval_every", "0", "--preempt_grace", "2"]
    reference = tmp_path / "reference"
    launch(args + ["--output_dir", reference])
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    cmd = launcher_command("torchrun", 2, str(free_port())) + [str(a) for a in args + ["--output_dir", run]]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step0000010" / "train_state.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.02)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
        victim = next(p for p in ranks if p.environ().get("RANK") == "1")
        killed = time.monotonic()
        victim.kill()
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode != 0 and time.monotonic() - killed < 30, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    proc = launch(args + ["--output_dir", run, "--resume", "latest"])
    assert "at step 10" in proc.stdout or "at step 20" in proc.stdout
    got, expected = steps(run), steps(reference)
    assert {s: got[s]["loss"] for s in range(21, 31)} == {s: expected[s]["loss"] for s in range(21, 31)}


@pytest.mark.slow
def test_an_uneven_split_trains_as_one_rank_does(debug_args, tmp_path):
    """vit-digits' 6 blocks cut 2 | 4 by pp_split on two ranks: the start-up line names the cut, and 6 steps give
    one rank's losses and gradient norms within fp32 reduction order."""
    args = debug_args + ["--model", "vit-digits", "--engine", "fsdp2", "--max_steps", "6", "--eval_every", "0",
                         "--save_every", "0"]
    one = tmp_path / "one"
    launch(args + ["--output_dir", one], nproc=1)
    split = tmp_path / "split"
    proc = launch(args + ["--pp_size", "2", "--pp_split", "2,4", "--output_dir", split])
    assert "pipeline: 2 stages of blocks 0-1 | 2-5" in proc.stdout
    assert_close_steps(steps(split), steps(one), 1, 6)
