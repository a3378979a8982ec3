"""What every engine behind engine/base.py's interface does, run on the DDP engine (engine/ddp.py, the one added
through the interface alone): the same steps as DeepSpeed's, exact resume on 2 ranks and 2 -> 1, the export that
`pipeline()` loads, `export.py` of its checkpoint (the live weights and the EMA's), and `accelerate launch`'s
multi-process path. Every `ac` policy bitwise equal to `none` under it: tests/integration/test_checkpointing.py."""
import json

import pytest
import torch
from conftest import launch, read_metrics, run_entry
from safetensors.torch import load_file


def test_ddp_steps_as_deepspeed_does(debug_args, tmp_path):
    """20 steps of the debug ViT on 2 ranks with stochastic depth, ZeRO-2 and DDP: the same losses and gradient
    norms within fp32 reduction order (1e-5 relative), the same learning rates."""
    args = debug_args + ["--model", "vit-debug", "--max_steps", "20", "--eval_every", "0", "--save_every", "0",
                         "--drop_path", "0.1"]
    launch(args + ["--output_dir", tmp_path / "ds"])
    proc = launch(args + ["--output_dir", tmp_path / "ddp", "--engine", "ddp"])
    assert "DDP (replicated) | AdamW" in proc.stdout
    assert json.load(open(tmp_path / "ddp" / "ddp_config.json"))["engine"] == "ddp"
    ds, ddp = read_metrics(tmp_path / "ds"), read_metrics(tmp_path / "ddp")
    assert [r["step"] for r in ddp] == list(range(1, 21))
    for a, b in zip(ds, ddp):
        assert b["lr"] == a["lr"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]


def test_ddp_resumes_exactly_on_two_ranks_and_on_one_and_exports(debug_args, tmp_path):
    """With an EMA: a resume from the step-5 checkpoint on 2 ranks, and on 1 rank accumulating 2 micro-batches (the
    same global batch, the same sums), continues the run bitwise (losses, exported weights); the checkpoint holds
    the weights once;
    export.py turns it into a directory `pipeline()` loads, with the live weights bitwise those of the run's own
    export at that step, and with --ema the EMA's."""
    args = debug_args + ["--model", "vit-debug", "--engine", "ddp", "--max_steps", "10", "--save_every", "5",
                         "--eval_every", "0", "--ema_decay", "0.9"]
    full = tmp_path / "full"
    launch(args + ["--output_dir", full])
    expected = {r["step"]: r["loss"] for r in read_metrics(full)}
    step5, step10 = full / "checkpoints" / "step0000005", full / "checkpoints" / "step0000010"
    assert json.load(open(step5 / "train_state.json"))["engine"] == "ddp"
    # the replicated weights and states once: rank 0's file holds them, rank 1's is empty
    assert {p.name: p.stat().st_size > 0 for p in step5.glob("*.distcp")} == {"__0_0.distcp": True, "__1_0.distcp": False}
    for name, extra, nproc in [("same", [], 2), ("one-rank", ["--grad_accum_steps", "2"], 1)]:
        out = tmp_path / name
        proc = launch(args + extra + ["--output_dir", out, "--resume", step5], nproc=nproc)
        assert "at step 5" in proc.stdout and "data order restarts" not in proc.stdout
        assert {r["step"]: r["loss"] for r in read_metrics(out)} == {s: expected[s] for s in range(6, 11)}, name
        resumed = load_file(out / "hf_model" / "model.safetensors")
        for key, value in load_file(full / "hf_model" / "model.safetensors").items():
            assert resumed[key].equal(value), (name, key)

    from transformers import AutoModelForImageClassification, pipeline
    from PIL import Image

    live = AutoModelForImageClassification.from_pretrained(full / "hf_model").state_dict()
    for flag, out in (([], tmp_path / "exported"), (["--ema"], tmp_path / "exported-ema")):
        proc = run_entry("export", step10, out, *flag)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = AutoModelForImageClassification.from_pretrained(out).state_dict()
        differ = [k for k in live if not got[k].equal(live[k])]
        assert (differ == []) == (not flag), differ  # the EMA's weights are not the live ones
        classify = pipeline("image-classification", model=str(out))
        assert len(classify(Image.new("RGB", (16, 16)), top_k=3)) == 3
    ema = load_file(tmp_path / "exported-ema" / "model.safetensors")
    shadow = torch.load(step10 / "ema" / "rank00000.pt", weights_only=True)["pieces"]
    name = "classifier.weight"
    assert ema[name].equal(shadow[name][0].reshape(ema[name].shape))


def test_ddp_runs_under_accelerate_launch(debug_args, tmp_path):
    """accelerate launch's multi-process path (MULTI_CPU here, MULTI_GPU on GPUs) with --engine ddp: the same
    losses as the forked ranks."""
    args = debug_args + ["--model", "vit-debug", "--engine", "ddp", "--max_steps", "6", "--eval_every", "0",
                         "--save_every", "0"]
    launch(args + ["--output_dir", tmp_path / "fork"])
    launch(args + ["--output_dir", tmp_path / "acc"], launcher="accelerate")
    forked, accelerated = read_metrics(tmp_path / "fork"), read_metrics(tmp_path / "acc")
    assert [r["loss"] for r in accelerated] == [r["loss"] for r in forked]
