"""Muon through DeepSpeed's own support, on 2 real ranks: DeepSpeed steps the 2-D weight matrices with Muon and
everything else with AdamW. AdamW's first step moves every element by the learning rate; Muon's orthogonalised
update has the same top singular value for every matrix of a shape, whatever its gradient's scale, times
sqrt(rows / cols) for a tall one."""
import pytest
import torch
from conftest import launch

from models import build_model

LR, MUON_LR = 1e-3, 0.02


@pytest.mark.parametrize("stage", [2, 3])
def test_muon_steps_matrices_and_adamw_the_rest(stage, debug_args, tmp_path):
    out = tmp_path / "run"
    proc = launch(debug_args + ["--model", "vit-debug", "--optimizer", "muon", "--zero_stage", stage, "--lr", LR,
                                "--muon_lr", MUON_LR, "--max_steps", 1, "--warmup_steps", 0, "--weight_decay", 0,
                                "--eval_every", 0, "--save_every", 0, "--output_dir", out])
    assert "| MuonWithAuxAdam |" in proc.stdout
    before = dict(build_model("vit-debug", 10, 16)[0].named_parameters())  # the seed's initial weights
    after = dict(build_model(str(out / "hf_model"), 10, 16)[0].named_parameters())
    top = {}
    for name, p in before.items():
        step = (after[name] - p).detach()
        if p.ndim == 2 and "embeddings" not in name:
            top[name] = (tuple(p.shape), torch.linalg.svdvals(step).max().item())
            assert step.abs().median().item() < LR / 2, name  # not AdamW's sign-like step
        elif p.ndim < 2 and "k_proj.bias" not in name:  # a key bias gets no gradient: softmax ignores it
            assert step.abs().median().item() == pytest.approx(LR, rel=0.01), name
    assert len(top) == 13  # 6 per block (q, k, v, o, fc1, fc2) and the classifier
    square = [v for shape, v in top.values() if shape == (32, 32)]
    tall = [v for shape, v in top.values() if shape == (64, 32)]
    assert max(square) / min(square) < 1.1 and max(tall) / min(tall) < 1.1
    assert sum(tall) / len(tall) / (sum(square) / len(square)) == pytest.approx(2 ** 0.5, rel=0.1)
