"""The models of masked-image pretraining and segmentation (models/tasks.py) and their masks (data/masking.py): blocks
found by structure, every checkpointing policy exact, masks a function of (seed, step, slot)."""
import pytest
import torch

from ac.policies import apply_activation_checkpointing
from config import ConfigError
from data.masking import mae_noise, simmim_mask
from models.blocks import find_blocks
from models.tasks import build_task_model

# (registry model, task, image size): the debug sizes; the Swin at 32 px has 16x16 and 8x8 token stages
MODELS = {
    "vit mae": ("vit-debug", "mae", 16),
    "vit simmim": ("vit-debug", "simmim", 16),
    "swin simmim": ("swin-debug", "simmim", 32),
    "swin segmentation": ("swin-debug", "segmentation", 32),
    "segformer segmentation": ("segformer-debug", "segmentation", 32),
}
BLOCKS = {
    "vit mae": ["vit.layers.0", "vit.layers.1", "decoder.decoder_layers.0"],
    "vit simmim": ["vit.layers.0", "vit.layers.1"],
    "swin simmim": ["swin.encoder.layers.0.blocks.0", "swin.encoder.layers.1.blocks.0"],
    "swin segmentation": ["backbone.swin.encoder.layers.0.blocks.0", "backbone.swin.encoder.layers.1.blocks.0"],
    "segformer segmentation": [f"segformer.stages.{i}.blocks.0" for i in range(4)],
}


def inputs(task: str, model, image_size: int, step: int = 0):
    """A micro-batch of 4 for `task`, its masks from data/masking.py."""
    images = torch.randn(4, 3, image_size, image_size, generator=torch.Generator().manual_seed(step))
    if task == "mae":
        return {"pixel_values": images, "noise": mae_noise(0, step, 0, 4, (image_size // 2) ** 2)}
    if task == "simmim":
        patch = model.config.patch_size
        return {"pixel_values": images,
                "bool_masked_pos": simmim_mask(0, step, 0, 4, image_size, patch, 2 * patch, 0.6)}
    labels = torch.randint(0, 11, (4, image_size, image_size), generator=torch.Generator().manual_seed(step))
    labels[:, 0] = 255  # the ignore index
    return {"pixel_values": images, "labels": labels}


def loss_and_grads(name: str, task: str, image_size: int, ac: str):
    model, _ = build_task_model(name, task, 11, image_size, seed=3)
    batch = inputs(task, model, image_size)
    # the blocks' profile from one forward of the images (what `selective` keeps and `hierarchical` reads)
    plan = apply_activation_checkpointing(model, ac, "cpu", profile_images=batch["pixel_values"], log=lambda *_: None)
    assert [b["policy"] for b in plan["blocks"]].count("none") < len(plan["blocks"]) or ac == "none"
    torch.manual_seed(0)  # SegFormer's decoder drops out
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(MODELS), ids=list(MODELS))
def test_every_policy_gives_nones_loss_and_gradients_bitwise(case):
    """MAE (encoder and decoder blocks), SimMIM on ViT and Swin, UperNet over Swin, SegFormer: the blocks are found by
    structure, and under full, selective, every other block and hierarchical recompute the loss and every
    gradient equal `none`'s bitwise (one process; the masks fixed by seed, step and slot)."""
    name, task, size = MODELS[case]
    assert [b.name for b in find_blocks(build_task_model(name, task, 11, size)[0])] == BLOCKS[case]
    loss, grads = loss_and_grads(name, task, size, "none")
    assert torch.isfinite(loss) and len(grads) > 0
    for ac in ("full", "selective", "every_n:2", "hierarchical:1"):
        other_loss, other = loss_and_grads(name, task, size, ac)
        assert torch.equal(other_loss, loss), (ac, other_loss, loss)
        assert other.keys() == grads.keys() and all(torch.equal(other[k], grads[k]) for k in grads), ac


def test_mae_encoder_sees_only_the_kept_patches_and_the_loss_is_on_normalised_pixels():
    """mask_ratio 0.75 of 64 patches: the encoder's output holds the class token and 16 patches; the loss is the
    paper's: the masked patches' pixels normalised per patch (norm_pix_loss); the position tables are MAE's."""
    model, _ = build_task_model("vit-debug", "mae", 10, 16, mask_ratio=0.75)
    batch = inputs("mae", model, 16)
    out = model(**batch, output_hidden_states=True)
    assert model.config.norm_pix_loss and out.hidden_states[-1].shape == (4, 1 + 16, 32)
    assert int(out.mask.sum()) == 4 * 48
    # the noise decides the mask: the kept patches are the 16 of lowest noise
    kept = batch["noise"].argsort(dim=1)[:, :16]
    assert torch.equal(out.mask.gather(1, kept), torch.zeros(4, 16))
    # the frozen sin-cos position tables, which transformers' own init leaves at zero: the class token's row zero,
    # the patches' sines and cosines, the decoder's (here as wide as the encoder) the same
    table = model.vit.embeddings.position_embeddings[0]
    assert not table.requires_grad and table[0].abs().max() == 0 and table[1:].abs().max() > 0.99
    assert torch.equal(table, model.decoder.decoder_pos_embed[0])


def test_simmim_masks_whole_blocks_at_the_ratio_and_repeat_with_seed_step_and_slot():
    """32 px, patch 2, mask blocks of 8 px: 16 blocks, round(0.6 x 16) = 10 masked per image, each a whole 4x4
    patch square; the same (seed, step, slot) gives the same mask, another slot or step another."""
    mask = simmim_mask(0, 5, 1, 3, 32, 2, 8, 0.6)
    assert mask.shape == (3, 256) and mask.dtype == torch.bool
    grid = mask.view(3, 16, 16)
    blocks = grid.unfold(1, 4, 4).unfold(2, 4, 4).reshape(3, 16, 16)
    assert ((blocks.sum(-1) == 0) | (blocks.sum(-1) == 16)).all()
    assert (blocks.all(-1).sum(-1) == 10).all()
    assert torch.equal(simmim_mask(0, 5, 1, 3, 32, 2, 8, 0.6), mask)
    assert not torch.equal(simmim_mask(0, 5, 2, 3, 32, 2, 8, 0.6), mask)
    assert not torch.equal(simmim_mask(0, 6, 1, 3, 32, 2, 8, 0.6), mask)
    assert torch.equal(mae_noise(1, 2, 3, 4, 64), mae_noise(1, 2, 3, 4, 64))
    assert not torch.equal(mae_noise(1, 2, 3, 4, 64), mae_noise(1, 2, 4, 4, 64))
    with pytest.raises(ValueError, match="mask_patch_size 6 must be a multiple of the patch size 4"):
        simmim_mask(0, 0, 0, 1, 32, 4, 6, 0.5)


@pytest.mark.parametrize("name,task,message", [
    ("swin-debug", "mae", "task mae needs a ViT"),
    ("vit-debug", "segmentation", "task segmentation needs a Swin backbone"),
    ("vit-debug", "depth", "unknown task 'depth'"),
    ("segformer-debug", "mae", "task mae needs a ViT"),
    ("segformer-debug", "simmim", "task simmim needs a ViT or a Swin"),
])
def test_a_task_the_model_cannot_do_is_one_error(name, task, message):
    with pytest.raises(ConfigError, match=message):
        build_task_model(name, task, 10, 32)


def test_a_model_without_blocks_found_is_one_error():
    """A model whose blocks the structure search does not find (a ResNet: no attention in its ModuleLists) is a
    ConfigError naming it, under every policy, `none` included (ZeRO-3's block gathering needs them too)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    model = ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1]))
    assert find_blocks(model) == []
    for ac in ("none", "full"):
        with pytest.raises(ConfigError, match=f"ac '{ac}': no transformer blocks found in ResNetForImageClassification"):
            apply_activation_checkpointing(model, ac, "cpu", log=lambda *_: None)
