"""export.py: a training checkpoint of any ZeRO stage becomes a Hugging Face directory whose logits equal those of
the live model (the run's own export at the same step, hf_model/)."""

import pytest
import torch
from conftest import run_entry


def weights(model_dir) -> dict:
    """A classifier directory's weights as its class loads them (export.py and save_pretrained name them
    differently on disk)."""
    from transformers import AutoModelForImageClassification

    return AutoModelForImageClassification.from_pretrained(model_dir).state_dict()


def same_weights(a, b) -> list:
    """The names whose tensors differ between two model directories (all of them if the names differ)."""
    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys():
        return sorted(set(wa) ^ set(wb))
    return [k for k in wa if not wa[k].equal(wb[k])]


def logits(model_dir, images):
    from transformers import AutoModelForImageClassification

    model = AutoModelForImageClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(images).logits


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_exports_to_the_live_models_logits(stage_runs, tmp_path, stage):
    run = stage_runs["vit-debug", stage]
    out = tmp_path / "exported"
    proc = run_entry("export", f"{run}/checkpoints/step0000060", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"to {out}" in proc.stdout and not (tmp_path / "exported.partial").exists()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(out, images), logits(f"{run}/hf_model", images), rtol=0, atol=1e-6)

    from transformers import pipeline
    from PIL import Image

    classify = pipeline("image-classification", model=str(out))
    assert len(classify(Image.new("RGB", (16, 16)), top_k=3)) == 3

    again = run_entry("export", f"{run}/checkpoints/step0000060", out, timeout=60)
    assert again.returncode == 2 and again.stderr.strip().endswith("exists: choose a new directory")
