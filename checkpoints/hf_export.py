"""The trained model as a Hugging Face directory: the weights gathered from the engine (its `full_state_dict`: under
ZeRO-3 one module at a time), checked finite, written beside the image processor and renamed into place when complete."""
import os
import shutil
import sys

import torch
import torch.distributed as dist

import compat


def export_hf_model(engine, processor, out_dir: str, rank: int, encoder_dir: str = "") -> bool:
    """A Hugging Face directory `from_pretrained` loads (a classifier's: `pipeline("image-classification",
    model=out_dir)`), and with `encoder_dir` an MAE model's encoder alone there (`mae_encoder`); False (and nothing
    written) if a weight is not finite."""
    state_dict = engine.full_state_dict(rank)
    bad = [k for k, v in state_dict.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        print(f"error: not exported: {len(bad)} weight tensors hold inf or NaN ({', '.join(bad[:3])}"
              f"{', ...' if len(bad) > 3 else ''})", file=sys.stderr, flush=True)
    elif rank == 0:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one shard: a bar says nothing
        partial = out_dir + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        engine.module.save_pretrained(partial, state_dict=state_dict)
        record_architecture(partial, engine.module)
        processor.save_pretrained(partial)
        replace(partial, out_dir)
        if encoder_dir:
            shutil.rmtree(encoder_dir + ".partial", ignore_errors=True)
            mae_encoder(engine.module.config, state_dict).save_pretrained(encoder_dir + ".partial")
            processor.save_pretrained(encoder_dir + ".partial")
            replace(encoder_dir + ".partial", encoder_dir)
    exported = [not bad]
    dist.broadcast_object_list(exported, src=0)  # only rank 0 holds the weights
    return exported[0]


def record_architecture(out_dir: str, module):
    """config.json names the model's own class (save_pretrained wrote the class FSDP2 made of it)."""
    import json

    name = compat.model_class(module).__name__
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    if config.get("architectures") != [name]:
        config["architectures"] = [name]
        with open(path, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


def replace(partial: str, out_dir: str):
    """`partial`, written whole, becomes `out_dir`: a kill before this leaves the previous `out_dir` whole."""
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.rename(partial, out_dir)


def mae_encoder(config, state_dict: dict):
    """transformers' ViTModel (no pooler) holding an MAE model's encoder: its patch embedding, class token, fixed
    sin-cos position embeddings, blocks and final norm, whose names and shapes are ViT's. A classifier loads it
    (`model: DIR`) with a new head, as MAE's fine-tuning starts (He et al. 2022: there, with global average pooling
    in place of the class token, which transformers' ViT classifier uses)."""
    from transformers import ViTConfig, ViTModel

    vit = ViTConfig(hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                    num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size,
                    hidden_act=config.hidden_act, layer_norm_eps=config.layer_norm_eps, image_size=config.image_size,
                    patch_size=config.patch_size, num_channels=config.num_channels, qkv_bias=config.qkv_bias)
    with torch.device("meta"):
        model = ViTModel(vit, add_pooling_layer=False)
    encoder = {k[len("vit."):]: v for k, v in state_dict.items() if k.startswith("vit.")}
    model.load_state_dict(encoder, strict=True, assign=True)
    return model
