import json

import pytest
from config import Config, ConfigError
from engine.ds_config import build_ds_config
from engine.memory import zero_memory_bytes
from loop.optim import lr_schedule, param_groups


def test_auto_fields_come_from_the_run_config():
    cfg = Config(zero_stage=3, micro_batch_size=8, grad_accum_steps=4, lr=1e-3, weight_decay=0.1, grad_clip=0.5)
    ds = build_ds_config(cfg, hidden_size=1024, world_size=16, precision="bf16")
    assert ds["train_batch_size"] == 8 * 4 * 16
    assert ds["train_micro_batch_size_per_gpu"] == 8 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["optimizer"]["params"]["lr"] == 1e-3 and ds["optimizer"]["params"]["weight_decay"] == 0.1
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    # Hugging Face's rule, from hidden_size rather than DeepSpeed's LLM-sized 5e8 defaults
    assert zero["reduce_bucket_size"] == 1024 * 1024
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
    assert zero["stage3_param_persistence_threshold"] == 0  # biases and norms travel with their block
    assert "auto" not in json.dumps(ds)


def test_fixed_memory_follows_zero_accounting():
    """Per rank, fp32, what DeepSpeed holds when the backward starts: weights (whole under ZeRO-1/2) plus the
    fp32 master partition and AdamW's moments (12 bytes per parameter over the ranks); ZeRO-2 its gradient
    partition (one rank reduces at the start of the backward); ZeRO-3 a weight and a gradient partition, its
    prefetch bucket and the weights it may hold gathered at once. The optimizer step adds the flat gradient, an
    fp32 partition (under ZeRO-3 on CPU one sub-group of it: a block's parameters), under ZeRO-1 the reduced gradient
    partition, which ZeRO-2 and 3 hold already, and with torch's foreach AdamW (the CPU's) two more of the flat
    gradient's size: its temporaries. The fused update (GPUs) has none."""
    n, world, hidden = 300_000_000, 8, 1024
    ds = {stage: build_ds_config(Config(zero_stage=stage), hidden, world, "fp32") for stage in (1, 2, 3)}
    sizes = {stage: zero_memory_bytes(n, stage, world, "fp32", ds[stage]) for stage in (1, 2, 3)}
    gathered = 4 * (int(0.9 * hidden**2) + 24 * hidden**2)  # prefetch bucket + stage3_max_live_parameters
    assert sizes[1]["backward"] == pytest.approx(n * (4 + 12 / world))
    assert sizes[2]["backward"] == pytest.approx(n * (4 + 16 / world))
    assert sizes[3]["backward"] == pytest.approx(n * 20 / world + gathered)
    block = 12 * hidden**2
    assert ds[3]["zero_optimization"]["sub_group_size"] == block < n / world
    for stage in (1, 2, 3):
        assert ds[stage]["optimizer"]["params"]["fused"] is False  # this CPU machine
        flat = block if stage == 3 else n / world
        reduced = n / world if stage == 1 else 0
        assert sizes[stage]["optimizer_step"] - sizes[stage]["backward"] == pytest.approx(4 * (3 * flat + reduced))
        gpu = build_ds_config(Config(zero_stage=stage), hidden, world, "fp32", gpu=True)
        assert gpu["optimizer"]["params"]["fused"] is True and gpu["zero_optimization"].get("overlap_comm", True)
        fused = zero_memory_bytes(n, stage, world, "fp32", gpu)
        # on a GPU ZeRO-3 steps its whole partition at once (sub_group_size 1e9 > n / world)
        assert fused["optimizer_step"] - fused["backward"] == pytest.approx(4 * (n / world + reduced))
    # gradients accumulated over micro-batches stay between backwards: whole under ZeRO-1, partitioned under 2
    accum = {stage: build_ds_config(Config(zero_stage=stage, grad_accum_steps=4), hidden, world, "fp32")
             for stage in (1, 2)}
    assert zero_memory_bytes(n, 1, world, "fp32", accum[1])["backward"] == pytest.approx(n * (8 + 12 / world))
    assert zero_memory_bytes(n, 2, world, "fp32", accum[2])["backward"] == pytest.approx(n * (4 + 16 / world))
    # a template whose reuse distance spans the model keeps every gathered weight
    ds[3]["zero_optimization"]["stage3_max_reuse_distance"] = n
    assert zero_memory_bytes(n, 3, world, "fp32", ds[3])["backward"] == \
        pytest.approx(n * (20 / world + 4) + 4 * int(0.9 * hidden**2))


@pytest.mark.parametrize("template,message", [
    ({"train_batch_size": 100}, "train_batch_size = 100 but"),
    ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu = 4"),
    ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage = 1"),
    ({"bf16": {"enabled": True}}, "bf16.enabled = True"),
    ({"scheduler": {"type": "WarmupLR"}}, "has a 'scheduler'"),
    ({"zero_optimization": {"stage": "auto", "offload_param": {"device": "auto"}}}, "cannot fill"),
])
def test_contradictions_are_errors(tmp_path, template, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(template))
    with pytest.raises(ConfigError, match=message):
        build_ds_config(Config(ds_config=str(path), zero_stage=2), 384, 2, "fp32")


def test_agreeing_explicit_values_are_kept(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "gradient_clipping": 1.0,
                                "zero_optimization": {"stage": 2, "reduce_bucket_size": 12345}}))
    ds = build_ds_config(Config(ds_config=str(path), zero_stage=2, micro_batch_size=32), 384, 2, "fp32")
    assert ds["zero_optimization"]["reduce_bucket_size"] == 12345


def test_schedule_warms_up_linearly_then_decays_to_min_lr():
    cfg = Config(lr=1e-3, min_lr=1e-5, warmup_steps=10, max_steps=100)
    f = lr_schedule(cfg)
    assert [f(s) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.01 + 0.99 * 0.5)
    assert f(100) == pytest.approx(0.01) and f(1000) == pytest.approx(0.01)


def test_no_weight_decay_on_norms_biases_position_embeddings_and_class_token():
    from models import build_model

    model, _ = build_model("vit-debug", 10, 16)
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "vit.embeddings.cls_token" in no_decay_names and "vit.embeddings.position_embeddings" in no_decay_names
    assert all(p.ndim >= 2 for p in decay["params"])
    assert any(n.endswith("layernorm_before.weight") for n in no_decay_names)
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.05


def test_gpu_sizes_bucket_several_blocks_and_keep_small_parameters_gathered():
    """On a GPU the "auto" sizes cut ZeRO's per-tensor and per-bucket host work: buckets of 4 blocks, biases and
    norms (up to 10 h elements) persistent, one block prefetched, the optimizer over the whole partition; the
    memory model counts the live and prefetched blocks. On CPU they stay the measured ones."""
    hidden, world, n = 1024, 8, 300_000_000
    block = 12 * hidden**2
    zero = build_ds_config(Config(zero_stage=3), hidden, world, "bf16", gpu=True)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4 * block and zero["stage3_prefetch_bucket_size"] == block
    assert zero["stage3_param_persistence_threshold"] == 10 * hidden
    assert zero["sub_group_size"] == 10**9 and zero["overlap_comm"] is True
    cpu = build_ds_config(Config(zero_stage=3), hidden, world, "fp32", gpu=False)["zero_optimization"]
    assert cpu["reduce_bucket_size"] == hidden**2 and cpu["stage3_param_persistence_threshold"] == 0
    assert cpu["sub_group_size"] == block and cpu["overlap_comm"] is False
    gathered = zero_memory_bytes(n, 3, world, "bf16", {"zero_optimization": zero})["zero3_gathered"]
    assert gathered == 2 * (block + 3 * block)  # bf16: the prefetched block and three live ones
    for stage in (1, 2):
        z = build_ds_config(Config(zero_stage=stage), hidden, world, "bf16", gpu=True)["zero_optimization"]
        assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 4 * block
