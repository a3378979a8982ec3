"""Fine-tuning from pretrained weights, on 2 real ranks: the two-stage recipe (a linear probe under ZeRO-3 with
every block recomputed, then full fine-tuning from its export), the learning rates layer-wise decay makes
DeepSpeed apply under ZeRO 1, 2 and 3, stochastic depth, and an EMA of the weights across a resume."""
import json
import os
import re

import pytest
import torch
from conftest import launch, read_metrics
from safetensors.torch import load_file

from models import build_model

FAST = ["--image_size", "16", "--micro_batch_size", "16", "--num_workers", "0", "--shuffle_buffer", "200",
        "--progress", "false"]
PRETRAINED_LABELS = 7  # the pretrained directory's head; the digits have 10 classes


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A pretrained directory as `save_pretrained` writes it, with a head for another number of classes."""
    path = tmp_path_factory.mktemp("pretrained") / "vit"
    build_model("vit-debug", PRETRAINED_LABELS, 16, seed=5)[0].save_pretrained(path)
    return str(path)


def weights(run_dir):
    return load_file(os.path.join(run_dir, "model.safetensors"))


@pytest.fixture(scope="module")
def probe(pretrained, digits, tmp_path_factory):
    """Stage 1 of configs/digits-probe.yaml, shrunk: the backbone frozen, ZeRO-3, `ac: full`, a new head."""
    out = tmp_path_factory.mktemp("probe") / "run"
    proc = launch(["--config", "configs/digits-probe.yaml", "--model", pretrained, "--train_shards", digits["train"],
                   "--val_shards", digits["val"], "--max_steps", "4", "--warmup_steps", "1", "--eval_every", "0",
                   "--save_every", "0", "--output_dir", out] + FAST)
    return proc, str(out)


def test_linear_probe_trains_only_a_new_head(probe, pretrained):
    proc, out = probe
    assert f"has {PRETRAINED_LABELS} classes; its classifier head is re-initialised for 10" in proc.stdout
    assert re.search(r"freeze: [\d,]+ of [\d,]+ parameters are frozen \(backbone\); 330 train", proc.stdout)
    before, after = weights(pretrained), weights(os.path.join(out, "hf_model"))
    initial = build_model(pretrained, 10, 16)[0].state_dict()  # the new head, from the run's seed
    assert set(before) == set(after)
    for name in before:
        if name.startswith("classifier."):  # trained: every element moved from its initial value, by at most
            # what 4 AdamW steps at lr 1e-3 can move it (|update| <= lr (1 - beta1) / sqrt(1 - beta2) each)
            moved = (after[name] - initial[name]).abs()
            assert after[name].shape[0] == 10 and (moved > 0).all() and moved.max() < 4 * 1e-3 * 3.17, name
        else:  # frozen under ZeRO-3 with recomputation: bitwise the pretrained weights
            assert torch.equal(before[name], after[name]), name
    config = json.load(open(os.path.join(out, "hf_model", "config.json")))
    assert len(config["id2label"]) == 10
    losses = [r["loss"] for r in read_metrics(out)]
    assert all(map(torch.isfinite, torch.tensor(losses)))


def layer_of(name: str, depth: int) -> int:
    """Layer id of a saved ViT weight: embeddings 0, encoder layer i is i + 1, the rest (final norm, head) L + 1."""
    if "embeddings" in name:
        return 0
    match = re.search(r"encoder\.layer\.(\d+)\.", name)
    return int(match.group(1)) + 1 if match else depth + 1


def applied_lr(before: dict, after: dict) -> dict[int, float]:
    """Median |update| per layer after one AdamW step without weight decay. Adam's first step moves every
    element by lr x g / (|g| + eps), so by the learning rate DeepSpeed applied to it."""
    depth = 1 + max(int(m.group(1)) for n in before if (m := re.search(r"encoder\.layer\.(\d+)\.", n)))
    steps = {}
    for name in before:
        steps.setdefault(layer_of(name, depth), []).append((after[name] - before[name]).abs().flatten())
    return {layer: torch.cat(d).median().item() for layer, d in steps.items()}, depth


LR, DECAY = 1e-3, 0.5
ONE_STEP = ["--max_steps", "1", "--warmup_steps", "0", "--weight_decay", "0", "--lr", LR, "--layer_decay", DECAY,
            "--eval_every", "0", "--save_every", "0"]


def check_layer_lrs(before_dir, run_dir):
    lrs, depth = applied_lr(weights(before_dir), weights(os.path.join(run_dir, "hf_model")))
    assert sorted(lrs) == list(range(depth + 2))
    for layer, lr in lrs.items():
        assert lr == pytest.approx(LR * DECAY ** (depth + 1 - layer), rel=0.01), (layer, lrs)


def test_full_finetune_from_the_probe(probe, digits, tmp_path):
    """Stage 2 of the recipe (configs/digits-finetune.yaml, ZeRO-2) from stage 1's export: one step of layer-wise
    decayed learning rates, as applied, with stochastic depth on."""
    _, probe_out = probe
    out = tmp_path / "finetune"
    proc = launch(["--config", "configs/digits-finetune.yaml", "--model", os.path.join(probe_out, "hf_model"),
                   "--train_shards", digits["train"], "--val_shards", digits["val"], "--export_ema", "false",
                   "--output_dir", out] + FAST + ONE_STEP)
    assert "re-initialised" not in proc.stdout  # the probe's head already has 10 classes
    check_layer_lrs(os.path.join(probe_out, "hf_model"), out)


@pytest.mark.parametrize("stage", [1, 3])
def test_layer_decay_applied_under_zero(stage, probe, debug_args, tmp_path):
    before, out = os.path.join(probe[1], "hf_model"), tmp_path / "run"
    launch(debug_args + ["--model", before, "--zero_stage", stage, "--output_dir", out] + ONE_STEP)
    check_layer_lrs(before, out)


def test_drop_path_rates_and_modes():
    model, _ = build_model("vit-debug", 10, 16, drop_path=0.2)
    plain, _ = build_model("vit-debug", 10, 16)
    rates = [m.rate for n, m in model.named_modules() if type(m).__name__ == "DropPath"]
    assert rates == [0.0, 0.2]  # block 0 and block 1 of 2; each block draws once per branch
    x = torch.randn(64, 3, 16, 16)
    model.eval(), plain.eval()
    assert torch.equal(model(x).logits, plain(x).logits)  # no effect at evaluation
    drop = next(m for m in model.modules() if type(m).__name__ == "DropPath").train()
    drop.rate = 0.2
    out = drop(torch.ones(2000, 5, 8))  # per sample: the branch dropped (0) or kept and scaled by 1 / 0.8
    per_sample = out.flatten(1)
    assert ((per_sample == 0).all(1) | (per_sample == 1.25).all(1)).all()
    assert (per_sample[:, 0] == 0).float().mean().item() == pytest.approx(0.2, abs=0.03)


@pytest.fixture(scope="module")
def ema_run(debug_args, tmp_path_factory):
    """ZeRO-3 on 2 ranks with an EMA of the weights: 6 steps, evaluated and saved every 3, the EMA exported."""
    out = tmp_path_factory.mktemp("ema") / "run"
    args = debug_args + ["--model", "vit-debug", "--zero_stage", "3", "--max_steps", "6", "--eval_every", "3", "--save_every", "3",
                         "--ema_decay", "0.9", "--export_ema", "true"]
    launch(args + ["--output_dir", out])
    return args, str(out)


def test_ema_follows_its_update_rule(debug_args, tmp_path):
    """One rank, ZeRO-2, 2 steps with a checkpoint after each and decay 0.9 (a swapped decay would show): the EMA
    in the step-2 checkpoint is the seed's initial weights averaged with each step's weights in turn, e <- 0.9 e +
    0.1 w, computed here in float64 (not with the code's own lerp): equal to fp32 rounding, and not the live
    weights."""
    run = tmp_path / "run"
    launch(debug_args + ["--model", "vit-debug", "--zero_stage", 2, "--max_steps", 2, "--save_every", 1,
                         "--eval_every", 0, "--ema_decay", 0.9, "--output_dir", run], nproc=1)
    live = [dict(build_model("vit-debug", 10, 16)[0].named_parameters())]  # the seed's initial weights
    for step in (1, 2):
        live.append(torch.load(run / "checkpoints" / f"step{step:07d}" / "mp_rank_00_model_states.pt",
                               weights_only=False)["module"])
    pieces = torch.load(run / "checkpoints" / "step0000002" / "ema" / "rank00000.pt", weights_only=True)["pieces"]
    for name, w0 in live[0].items():
        expected = w0.detach().double()
        for weights in live[1:]:
            expected = 0.9 * expected + 0.1 * weights[name].double()
        ema = pieces[name][0][:w0.numel()].view(w0.shape)
        assert ema.dtype == torch.float32
        torch.testing.assert_close(ema.double(), expected, rtol=1e-6, atol=1e-7, msg=name)
        assert not torch.equal(ema, live[2][name]), name


def test_ema_is_exact_across_a_resume(ema_run, tmp_path):
    args, out = ema_run
    resumed = tmp_path / "resumed"
    launch(args + ["--output_dir", resumed, "--resume", os.path.join(out, "checkpoints", "step0000003")])
    a, b = weights(os.path.join(out, "hf_model")), weights(resumed / "hf_model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for run in (out, resumed):
        evaluated = [r for r in read_metrics(run) if "val_top1" in r]
        assert evaluated and all(0 <= r["val_ema_top1"] <= 1 for r in evaluated)
    assert read_metrics(out)[-1]["val_ema_top1"] == read_metrics(resumed)[-1]["val_ema_top1"]


def test_evaluating_the_ema_leaves_training_unchanged(ema_run, tmp_path):
    """Under ZeRO-3 the evaluation at step 3 swaps the EMA into the weights' partitions and back: steps 4-6 train
    bitwise as they do without an EMA."""
    args, out = ema_run
    plain = tmp_path / "plain"
    launch(args + ["--ema_decay", "0", "--export_ema", "false", "--output_dir", plain])
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(plain)]
    assert "val_ema_top1" not in read_metrics(plain)[2] and "val_ema_top1" in read_metrics(out)[2]


def test_ema_is_sharded_and_reassembles_on_another_world_size(ema_run, tmp_path):
    """Each rank's file holds its half of every parameter; one rank reading the two-rank checkpoint exports the
    average those halves make."""
    args, out = ema_run
    folder = os.path.join(out, "checkpoints", "step0000003", "ema")
    files = [torch.load(os.path.join(folder, f), weights_only=True)["pieces"] for f in sorted(os.listdir(folder))]
    assert len(files) == 2
    reference = build_model("vit-debug", 10, 16)[0]
    shapes = {n: p.shape for n, p in reference.named_parameters()}
    total = sum(s.numel() for s in shapes.values())
    for pieces in files:
        held = sum(piece.numel() for piece, _ in pieces.values())
        assert total / 2 <= held <= total / 2 + len(shapes)  # a half, padded by at most one element per tensor
    whole = {n: torch.cat([files[0][n][0], files[1][n][0]])[:shapes[n].numel()].view(shapes[n]) for n in shapes}
    one = tmp_path / "one-rank"
    launch(args + ["--max_steps", "3", "--output_dir", one, "--resume",
                   os.path.join(out, "checkpoints", "step0000003")], nproc=1)
    exported = build_model(str(one / "hf_model"), 10, 16)[0].state_dict()
    assert all(torch.equal(exported[n], whole[n]) for n in shapes)
