"""The FSDP2 engine (`engine: fsdp2`, engine/fsdp2.py) through train.py: the same steps as DeepSpeed's, exact and
elastic resume from its DCP checkpoints, the export, and what it refuses. Every policy bitwise equal to `none` under
it: tests/integration/test_checkpointing.py."""
import json
import re

import pytest
import torch
from conftest import check_input, launch, read_metrics
from safetensors.torch import load_file


FINE_TUNING = ["--layer_decay", "0.75", "--drop_path", "0.1", "--mixup", "0.8", "--cutmix", "1.0", "--ema_decay", "0.9"]


@pytest.mark.parametrize("extra", [[], FINE_TUNING, ["--freeze", "backbone"]], ids=["plain", "fine-tuning", "probe"])
def test_fsdp2_steps_as_deepspeed_does(debug_args, tmp_path, extra):
    """20 steps of the debug ViT from one seed on 2 ranks, ZeRO-2 and FSDP2 (the same AdamW, clipping, schedule and
    data): the losses and gradient norms agree within fp32 reduction order (1e-5 relative); with layer-wise lr
    decay, stochastic depth, mixup and cutmix and an EMA, and with the backbone frozen (a linear probe), too."""
    args = debug_args + ["--model", "vit-debug", "--max_steps", "20", "--eval_every", "0", "--save_every", "0", *extra]
    launch(args + ["--output_dir", tmp_path / "ds"])
    proc = launch(args + ["--output_dir", tmp_path / "fsdp2", "--engine", "fsdp2"])
    assert "FSDP2 (kept after forward) | AdamW" in proc.stdout
    assert json.load(open(tmp_path / "fsdp2" / "fsdp2_config.json"))["reshard_after_forward"] is False
    if extra:  # the EMA's (or the probe's) export: the same model within the same tolerance
        ds_summary, f_summary = (json.load(open(tmp_path / run / "summary.json")) for run in ("ds", "fsdp2"))
        assert f_summary["val_top1"] == pytest.approx(ds_summary["val_top1"], abs=0.01)
    ds, fsdp2 = read_metrics(tmp_path / "ds"), read_metrics(tmp_path / "fsdp2")
    assert [r["step"] for r in fsdp2] == list(range(1, 21))
    for a, b in zip(ds, fsdp2):
        assert b["lr"] == a["lr"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]


def test_fsdp2_resumes_exactly_on_two_ranks_and_on_one(debug_args, tmp_path):
    """ZeRO-3's analogue (resharding after forward) with an EMA: a resume from the step-5 DCP checkpoint on 2
    ranks and on 1 rank accumulating 2 micro-batches continues the run bitwise (losses, exported weights), and the
    export equals the checkpoint's weights bitwise; HSDP's 2-D mesh too (below)."""
    args = debug_args + ["--model", "vit-debug", "--engine", "fsdp2", "--zero_stage", "3", "--max_steps", "10",
                         "--save_every", "5", "--eval_every", "0", "--ema_decay", "0.9"]
    full = tmp_path / "full"
    launch(args + ["--output_dir", full])
    expected = {r["step"]: r["loss"] for r in read_metrics(full)}
    step5 = full / "checkpoints" / "step0000005"
    assert json.load(open(step5 / "train_state.json"))["engine"] == "fsdp2"
    for name, extra, nproc in [("same", [], 2), ("one-rank", ["--grad_accum_steps", "2"], 1)]:
        out = tmp_path / name
        proc = launch(args + extra + ["--output_dir", out, "--resume", step5], nproc=nproc)
        assert "at step 5" in proc.stdout and "data order restarts" not in proc.stdout
        assert {r["step"]: r["loss"] for r in read_metrics(out)} == {s: expected[s] for s in range(6, 11)}, name
        resumed = load_file(out / "hf_model" / "model.safetensors")
        for key, value in load_file(full / "hf_model" / "model.safetensors").items():
            assert resumed[key].equal(value), (name, key)
    # HSDP on 2 ranks (2 replicas of 1 shard: the gradients all-reduced across the replicas, the norm summed within
    # a replica) takes the same steps bitwise, and its checkpoint (each shard once, the EMA from the first replica)
    # resumes on 1 rank of the 1-D mesh bitwise
    hsdp = tmp_path / "hsdp"
    proc = launch(args + ["--replicate_degree", "2", "--output_dir", hsdp])
    assert "HSDP (2 replicas x 1 shard, resharded after forward)" in proc.stdout
    assert {r["step"]: r["loss"] for r in read_metrics(hsdp)} == expected
    assert sorted(p.name for p in (hsdp / "checkpoints" / "step0000005" / "ema").iterdir()) == ["rank00000.pt"]
    out = tmp_path / "hsdp-to-one"
    launch(args + ["--grad_accum_steps", "2", "--output_dir", out, "--resume", hsdp / "checkpoints" / "step0000005"],
           nproc=1)
    assert {r["step"]: r["loss"] for r in read_metrics(out)} == {s: expected[s] for s in range(6, 11)}
    resumed = load_file(out / "hf_model" / "model.safetensors")
    assert all(resumed[k].equal(v) for k, v in load_file(full / "hf_model" / "model.safetensors").items())
    # the export is the weights of the last checkpoint, read from DCP's files (in the model's own parameter names,
    # which save_pretrained writes as the checkpoint format's)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForImageClassification

    dcp_to_torch_save(full / "checkpoints" / "step0000010", tmp_path / "step10.pt")
    saved = torch.load(tmp_path / "step10.pt", weights_only=False)["model"]
    exported = AutoModelForImageClassification.from_pretrained(full / "hf_model").state_dict()
    assert saved.keys() == exported.keys() and len(saved) == 40
    assert all(saved[k].equal(exported[k]) for k in saved)
    assert json.load(open(full / "hf_model" / "config.json"))["architectures"] == ["ViTForImageClassification"]


def test_async_checkpoints_are_exact_and_atomic(debug_args, tmp_path):
    """async_save: checkpoints copied to host memory and written by DCP's thread while training goes on, committed
    when the next save starts. A rank's failed background write (ENOSPC) is one warning and training goes on with
    the same losses; a job that dies with a write not yet committed leaves a .partial that --resume latest
    removes, resuming from the newest committed checkpoint (itself written in the background) to the
    uninterrupted run's losses and weights, bitwise."""
    args = debug_args + ["--model", "vit-debug", "--engine", "fsdp2", "--zero_stage", "3", "--max_steps", "10",
                         "--save_every", "2", "--eval_every", "0", "--keep_last", "2", "--ema_decay", "0.9",
                         "--async_save", "true"]
    launch(args + ["--output_dir", tmp_path / "async"])
    expected = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "async")}
    ckpts = tmp_path / "async" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step0000008", "step0000010"]
    assert json.load(open(tmp_path / "async" / "summary.json"))["checkpoint_seconds_this_launch"] > 0

    proc = launch(args + ["--output_dir", tmp_path / "enospc"], faults={"ENOSPC_AT": "4:1"})
    assert re.search(r"warning: checkpoint step0000004 not written \(.*rank 1: No space left on device",
                     proc.stdout + proc.stderr)
    assert {r["step"]: r["loss"] for r in read_metrics(tmp_path / "enospc")} == expected
    assert sorted(p.name for p in (tmp_path / "enospc" / "checkpoints").iterdir()) == \
        ["latest", "step0000008", "step0000010"]

    died = tmp_path / "died"  # rank 1's 5th loss raises: step 4's write started, never committed
    proc = launch(args + ["--output_dir", died], faults={"RAISE": "1:5"}, check=False)
    assert proc.returncode != 0
    assert sorted(p.name for p in (died / "checkpoints").iterdir()) == \
        ["latest", "step0000002", "step0000004.partial"]
    assert (died / "checkpoints" / "latest").read_text() == "step0000002"
    proc = launch(args + ["--output_dir", died, "--resume", "latest"])
    assert "removed step0000004.partial" in proc.stdout + proc.stderr
    assert {r["step"]: r["loss"] for r in read_metrics(died)} == expected
    weights = load_file(tmp_path / "async" / "hf_model" / "model.safetensors")
    resumed = load_file(died / "hf_model" / "model.safetensors")
    assert all(resumed[k].equal(v) for k, v in weights.items())


def test_a_checkpoint_of_the_other_engine_is_one_line(debug_args, tmp_path):
    args = debug_args + ["--model", "vit-debug", "--max_steps", "2", "--save_every", "2", "--eval_every", "0"]
    launch(args + ["--output_dir", tmp_path / "ds"], nproc=1)
    proc = launch(args + ["--output_dir", tmp_path / "f", "--engine", "fsdp2", "--resume",
                          tmp_path / "ds" / "checkpoints" / "step0000002"], nproc=1, check=False)
    assert proc.returncode == 2
    assert "was written by engine deepspeed and this run uses fsdp2; resume it with --engine deepspeed" in proc.stderr
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("extra, says", [
    (["--tp_size", "2"], "engine fsdp2 with tp_size 2: tensor parallelism (DeepSpeed's AutoTP) is not available "
                         "under engine fsdp2; use tp_size 1 or engine deepspeed"),
    (["--optimizer", "muon"], "engine fsdp2 with optimizer muon: the Muon optimizer (DeepSpeed's) is not available "
                              "under engine fsdp2; use optimizer adamw or engine deepspeed"),
    (["--ds_config", "ds_configs/zero3.json"], "engine fsdp2 with ds_config ds_configs/zero3.json: a DeepSpeed JSON"),
    (["--precision", "fp16"], "engine fsdp2 with precision fp16"),
    (["--engine", "megatron"], "config key 'engine' must be one of ('deepspeed', 'fsdp2', 'ddp'), got 'megatron'"),
    (["--replicate_degree", "0"], "config key 'replicate_degree' must be positive, got 0"),
    (["--replicate_degree", "2"], "replicate_degree 2 does not divide the world size (1)"),
    (["--engine", "deepspeed", "--replicate_degree", "2"], "engine deepspeed with replicate_degree 2: HSDP"),
    (["--engine", "deepspeed", "--async_save", "true"], "engine deepspeed with async_save True: checkpoints written "
                                                        "in the background (DCP's async_save) is not available under "
                                                        "engine deepspeed; use async_save false or engine fsdp2"),
    (["--engine", "ddp", "--tp_size", "2"], "engine ddp with tp_size 2: tensor parallelism"),
    (["--engine", "ddp", "--replicate_degree", "2"], "engine ddp with replicate_degree 2: HSDP"),
])
def test_what_fsdp2_does_not_do_is_one_line(extra, says, capsys, monkeypatch, tmp_path):
    code, err = check_input(["--engine", "fsdp2", *extra, "--output_dir", tmp_path / "run"], capsys, monkeypatch)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not (tmp_path / "run").exists()
