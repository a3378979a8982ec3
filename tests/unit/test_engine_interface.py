"""engine/base.py's interface and what the registry's engines declare through it: every engine implements every
part, every refusal comes from one table in one wording, and the planner's per-engine terms are the engines'."""
import dataclasses

import pytest

from config import Config
from engine.base import FEATURES, Capabilities, Engine, Sizes, refusal
from engine.ddp import DDPEngine
from engine.registry import ENGINES, check_engine, engine_class, written_by

INSTANCE = {"module", "pending", "async_save", "skipped_steps"}  # set by each engine's constructor


def test_every_engine_implements_every_part_of_the_interface():
    parts = ({n for n in dir(Engine) if not n.startswith("_")} | set(Engine.__annotations__)) - INSTANCE
    assert {"wrap", "memory", "comm_bytes", "save_checkpoint", "full_state_dict", "checkpoint_format"} <= parts
    for name, engine in ENGINES.items():
        assert engine.name == name and engine.config_file.endswith("_config.json")
        assert [p for p in sorted(parts) if not hasattr(engine, p)] == [], name
        fmt = engine.checkpoint_format
        assert all(callable(getattr(fmt, m)) for m in ("check", "convert", "load_tag", "read_weights",
                                                       "remove_derived")), name
    assert set(ENGINES) == {"deepspeed", "fsdp2", "ddp"}


def test_every_refusal_comes_from_the_one_table():
    """Each feature's refusal names the key, what it is, the setting without it and the engines that have it."""
    assert {f.capability for f in FEATURES} == {f.name for f in dataclasses.fields(Capabilities)}
    caps = {n: e.capabilities for n, e in ENGINES.items()}
    cases = {"tp_size": 2, "optimizer": "muon", "ds_config": "x.json", "precision": "fp16", "async_save": True,
             "replicate_degree": 2, "pp_size": 2}
    for f in FEATURES:
        cfg = Config(**{f.key: cases[f.key]})
        for name, engine in ENGINES.items():
            why = refusal(name, engine.capabilities, cfg, caps)
            if getattr(engine.capabilities, f.capability):
                assert why is None, (name, f.key)
                continue
            have = [n for n, c in caps.items() if getattr(c, f.capability)]
            assert why == (f"engine {name} with {f.key} {cases[f.key]}: {f.what} is not available under engine "
                           f"{name}; use {f.off}" + (f" or engine {' / '.join(have)}" if have else ""))
    with pytest.raises(ValueError, match="config key 'engine' must be one of \\('deepspeed', 'fsdp2', 'ddp'\\)"):
        check_engine(Config(engine="megatron"))
    assert check_engine(Config(engine="ddp")) is DDPEngine
    assert written_by({}) is engine_class("deepspeed") and written_by({"engine": "ddp"}) is DDPEngine


def test_the_planners_terms_are_the_engines():
    """DDP: 16 bytes a parameter beside the activations (fp32 weights and gradients, AdamW's two moments), the
    foreach update's model-sized temporary at the step, one ring all-reduce of fp32 gradients a step (across
    nodes when the ranks span them); every engine searched by its own variants."""
    n = 10**6
    parts, fixed = DDPEngine.memory(Config(), Sizes(n, n // 10, n // 20), 8, "bf16", {}, gpu=False)
    assert fixed["backward"] == 16 * n and fixed["optimizer_step"] == 20 * n
    assert sum(v for k, v in parts.items() if k != "optimizer_step_temporaries") == 16 * n
    assert DDPEngine.comm_bytes(Config(), n, 8, 8, 2, {}) == (2 * 7 / 8 * 4 * n, 0.0)
    assert DDPEngine.comm_bytes(Config(), n, 16, 8, 2, {}) == (0.0, 2 * 15 / 16 * 4 * n)
    zero3 = engine_class("deepspeed")
    assert zero3.memory(Config(zero_stage=3), Sizes(n, 0, 0), 8, "fp32", {}, gpu=True)[1]["backward"] < 16 * n
    variants = {name: e.search_variants(16, 8, 1) for name, e in ENGINES.items()}
    assert {v["zero_stage"] for v in variants["deepspeed"]} == {1, 2, 3} and variants["ddp"] == [{}]
    assert {v["replicate_degree"] for v in variants["fsdp2"]} == {1, 2}
    assert all(e.search_variants(16, 8, 2) == [] for n, e in ENGINES.items() if n != "deepspeed")
    quantized = {"zero_optimization": {"zero_quantized_weights": True, "zero_quantized_gradients": True}}
    assert "int8 weights" in zero3.numerics(Config(), quantized) and zero3.numerics(Config(), {}) is None
    assert DDPEngine.numerics(Config(), quantized) is None
