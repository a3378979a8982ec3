"""Muon through DeepSpeed's own support, on 2 real ranks: DeepSpeed steps the 2-D weight matrices with Muon and
everything else with AdamW. AdamW's first step moves every element by the learning rate; Muon's orthogonalised
update has the same top singular value for every matrix of a shape, whatever its gradient's scale, times
sqrt(rows / cols) for a tall one."""
import pytest
import torch
from conftest import launch

from models import build_model

LR, MUON_LR = 1e-3, 0.02


def muon_run(stage, muon_lr, debug_args, out):
    """One step of Muon under ZeRO-`stage` from the seed's weights: {name: (shape, top singular value of ΔW)} of
    the 2-D matrices Muon steps, and {name: median |ΔW|} of the rest. Without clipping: DeepSpeed writes Muon's
    update where the gradients were and clips it with them (by the global norm of all of them)."""
    proc = launch(debug_args + ["--model", "vit-debug", "--optimizer", "muon", "--zero_stage", stage, "--lr", LR,
                                "--muon_lr", muon_lr, "--max_steps", 1, "--warmup_steps", 0, "--weight_decay", 0,
                                "--grad_clip", 0, "--eval_every", 0, "--save_every", 0, "--output_dir", out])
    assert "| MuonWithAuxAdam |" in proc.stdout
    before = dict(build_model("vit-debug", 10, 16)[0].named_parameters())  # the seed's initial weights
    after = dict(build_model(str(out / "hf_model"), 10, 16)[0].named_parameters())
    top, rest = {}, {}
    for name, p in before.items():
        step = (after[name] - p).detach()
        if p.ndim == 2 and "embeddings" not in name:
            top[name] = (tuple(p.shape), torch.linalg.svdvals(step).max().item())
        elif p.ndim < 2 and "k_proj.bias" not in name:  # a key bias gets no gradient: softmax ignores it
            rest[name] = step.abs().median().item()
    return top, rest


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_muon_steps_matrices_and_adamw_the_rest(stage, debug_args, tmp_path, monkeypatch):
    """DeepSpeed's Muon moves W by muon_lr x its Newton-Schulz orthogonalisation of the momentum, whose singular
    values lie in about (0.5, 1.5) (the quintic iteration's spread, as its docstring states), times
    sqrt(rows / cols) for a tall matrix. Under ZeRO-2 a second run at half the muon_lr moves every matrix by half
    as much (the same gradients: the same first step), and leaves AdamW's parameters where the first run did.
    DeepSpeed compiles its iteration with torch.compile: the ZeRO-2 runs take it eager (the same function, without
    the compile's time), the ZeRO-3 variant compiled."""
    if stage == 2:
        monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    top, rest = muon_run(stage, MUON_LR, debug_args, tmp_path / "run")
    assert len(top) == 13  # 6 per block (q, k, v, o, fc1, fc2) and the classifier
    assert all(v == pytest.approx(LR, rel=0.01) for v in rest.values()), rest  # AdamW's first step: lr each
    square = [v for shape, v in top.values() if shape == (32, 32)]
    tall = [v for shape, v in top.values() if shape == (64, 32)]
    assert all(0.5 * MUON_LR < v < 1.5 * MUON_LR for v in square), square
    assert max(square) / min(square) < 1.1 and max(tall) / min(tall) < 1.1
    assert sum(tall) / len(tall) / (sum(square) / len(square)) == pytest.approx(2 ** 0.5, rel=0.1)
    if stage == 2:
        half, rest_half = muon_run(stage, MUON_LR / 2, debug_args, tmp_path / "half")
        assert all(half[name][1] == pytest.approx(v / 2, rel=1e-3) for name, (_, v) in top.items()), (top, half)
        assert rest_half == rest
