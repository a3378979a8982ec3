import pytest
import torch
from models import NAMES, build_model, find_blocks, model_config
from transformers import AutoModelForImageClassification

# (blocks, millions of parameters) at 224x224 with a 1000-class head: the papers' figures (ViT-22B: its
# shape in HF's serial ViT block with biases, hence not exactly 21.7B)
EXPECTED = {"vit-tiny": (12, 5.7), "vit-small": (12, 22.1), "vit-base": (12, 86.6), "vit-large": (24, 304.3),
            "vit-huge": (32, 632.0), "vit-giant": (40, 1012.6), "vit-22b": (48, 21758.5), "swin-tiny": (12, 28.3),
            "swin-small": (24, 49.6), "swin-base": (24, 87.8), "swin-large": (24, 196.5)}


@pytest.mark.parametrize("name", EXPECTED)
def test_registry_sizes_and_blocks(name):
    with torch.device("meta"):  # shapes only: ViT-22B would need 87 GB
        model = AutoModelForImageClassification.from_config(model_config(name, 1000, 224))
    blocks, params = EXPECTED[name]
    found = find_blocks(model)
    assert len(found) == blocks
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(params, abs=0.05)
    assert [b.index for b in found] == list(range(blocks))
    if name.startswith("swin"):
        assert sorted({b.stage for b in found}) == [0, 1, 2, 3]


def test_blocks_are_the_repeated_attention_layers_not_the_stages():
    model, _ = build_model("swin-debug", 10, 16)
    names = [type(b.module).__name__ for b in find_blocks(model)]
    assert names == ["SwinLayer", "SwinLayer"]
    model, _ = build_model("vit-debug", 10, 16)
    assert [type(b.module).__name__ for b in find_blocks(model)] == ["ViTLayer", "ViTLayer"]


def test_same_seed_same_weights():
    torch.manual_seed(0)
    a, _ = build_model("vit-debug", 10, 16)
    torch.manual_seed(0)
    b, _ = build_model("vit-debug", 10, 16)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.equal(q), n


@pytest.mark.parametrize("name", ["vit-debug", "swin-debug"])
def test_initial_weights_depend_on_the_seed_alone(name):
    """Not on the global RNG's state (nor, tests/ac_equivalence.py checks, on the world size or ZeRO-3's
    partitioning): a 1-rank debug run and a 512-rank run start from the same model."""
    torch.manual_seed(1)
    a, _ = build_model(name, 10, 16, seed=5)
    torch.manual_seed(2)
    torch.randn(100)
    b, _ = build_model(name, 10, 16, seed=5)
    c, _ = build_model(name, 10, 16, seed=6)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert p.equal(q), n
        if p.std() > 0:  # random, not constant (norms, biases)
            assert not p.equal(r), n


def test_local_directory_with_new_head(tmp_path):
    model, processor = build_model("vit-debug", 10, 16, class_names=[str(i) for i in range(10)])
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = build_model(str(tmp_path), 3, 16)
    assert loaded.config.num_labels == 3 and loaded.classifier.out_features == 3
    assert loaded.vit.embeddings.patch_embeddings.projection.weight.equal(
        model.vit.embeddings.patch_embeddings.projection.weight)
    assert loaded_processor.size == {"height": 16, "width": 16}


def test_a_checkpoint_fine_tuned_at_another_resolution_has_its_position_embeddings_resampled(tmp_path):
    """A ViT saved at 16 px (8x8 patches) and loaded at 32 px (16x16): its other weights as saved, and its logits
    those of transformers' own `interpolate_pos_encoding` forward of the saved model at 32 px; a backbone without
    a classifier (train.py's MAE encoder/) too; at the saved size the table is left as it is."""
    model, processor = build_model("vit-debug", 10, 16)
    model.eval().save_pretrained(tmp_path / "classifier")
    model.vit.save_pretrained(tmp_path / "backbone")
    said = []
    loaded, loaded_processor = build_model(str(tmp_path / "classifier"), 10, 32, log=said.append)
    assert loaded.vit.embeddings.position_embeddings.shape == (1, 257, 32) and loaded.config.image_size == 32
    assert "trained at 16px; its position embeddings are resampled (bicubic) to 32px's 16x16 patches" in said[0]
    saved = model.state_dict()
    assert all(v.equal(saved[k]) for k, v in loaded.state_dict().items() if "position_embeddings" not in k)
    assert loaded_processor.size == {"height": 32, "width": 32}
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(images, interpolate_pos_encoding=True).logits
        assert torch.allclose(loaded.eval()(images).logits, expected, atol=1e-6)
        backbone, _ = build_model(str(tmp_path / "backbone"), 3, 32)
        assert torch.allclose(backbone.eval().vit(images).last_hidden_state,
                              model.vit(images, interpolate_pos_encoding=True).last_hidden_state, atol=1e-6)
    same, _ = build_model(str(tmp_path / "classifier"), 10, 16)
    assert same.vit.embeddings.position_embeddings.equal(model.vit.embeddings.position_embeddings)


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown model 'vit-colossal'"):
        build_model("vit-colossal", 10, 16)


def test_every_registry_name_is_listed_in_the_error():
    with pytest.raises(ValueError) as e:
        model_config("x", 10, 16)
    assert all(n in str(e.value) for n in NAMES)
