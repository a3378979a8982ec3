"""Activation checkpointing in this process: what each policy saves, measured by the profiler, the block profile
and the budget planner. Every policy against `none` under the engines: tests/integration/test_checkpointing.py."""
import copy

import pytest
import torch
from ac.budget import activation_peak, default_hierarchical_k, plan_for_budget
from ac.policies import apply_activation_checkpointing, parse_policy
from ac.profile import PROFILE_BATCH, BlockProfile, profile_blocks
from config import ConfigError
from models import build_model, find_blocks
from loop.peak_memory import allocation_curve, measure_activation_bytes, memory_trace, trace_events


@pytest.fixture(scope="module")
def vit_small():
    torch.manual_seed(0)
    model, _ = build_model("vit-small", 10, 64, 8)  # ViT-S, 65 tokens: the CPU benchmark's shape
    return model, torch.randn(8, 3, 64, 64)


def synthetic_profile():
    # a Swin-like shape: early blocks hold big activations for few FLOPs
    sizes = [(800, 100), (800, 100), (400, 200), (400, 200), (200, 400), (200, 400)]
    # full recompute stops before the last third of the FLOPs; selective reruns one small matmul
    return [BlockProfile(f"b{i}", i // 2, none, none // 2, none // 10, flops, flops * 2 // 3, flops // 20, flops // 100)
            for i, (none, flops) in enumerate(sizes)]


def test_policies_reduce_measured_activation_memory(vit_small):
    model, images = vit_small
    measured = {}
    for ac in ("none", "light", "selective", "hierarchical", "full"):
        m = copy.deepcopy(model)
        apply_activation_checkpointing(m, ac, "cpu", images, log=lambda *a: None)
        measured[ac] = measure_activation_bytes(m, images)
    assert measured["none"] > measured["light"] > measured["selective"] > measured["hierarchical"] > measured["full"] > 0
    # light gives up its blocks' norm and activation outputs, selective also the residual sums, and the profile
    # counts exactly those
    profile = profile_blocks(model, images)
    assert measured["none"] - measured["light"] == sum(p.bytes_none - p.bytes_light for p in profile)
    assert measured["light"] - measured["selective"] == sum(p.bytes_light - p.bytes_selective for p in profile) > 0
    assert measured["light"] < 0.7 * measured["none"]
    assert measured["selective"] < 0.6 * measured["none"]  # the target: at least 40% less
    assert measured["full"] < 0.1 * measured["none"]


def test_profile_counts_blocks_flops_and_bytes(vit_small):
    model, images = vit_small
    profile = profile_blocks(model, images)
    assert len(profile) == 12 and len({p.bytes_none for p in profile}) == 1  # ViT blocks are alike
    p = profile[0]
    assert p.bytes_full < p.bytes_selective < p.bytes_none
    tokens, hidden = 8 * 65, 384
    linear_flops = 2 * tokens * hidden * (4 * hidden + 2 * 4 * hidden)  # qkv + out, fc1 + fc2
    attention_flops = 2 * 2 * 8 * 65 * 65 * hidden  # q @ k^T and p @ v: counted on CPU too (models/__init__.py)
    assert p.flops == linear_flops + attention_flops
    assert p.bytes_full == tokens * hidden * 4  # the block input, fp32
    assert p.bytes_grad == tokens * 4 * hidden * 4 + p.bytes_full  # fc1's output gradient and the input's
    # what the recompute reruns: full stops before fc2 (nothing after it is saved); selective reruns only the
    # out-projection, to rebuild the residual sum the second norm reads (fp32: 4 bytes an element), in every block
    linear = 2 * tokens * hidden * hidden
    assert all(b.flops_full == b.flops - 4 * linear and b.flops_selective == linear for b in profile)
    assert all(b.bytes_light - b.bytes_selective == 4 * tokens * hidden for b in profile)
    assert all(b.selective_elems == b.light_elems + tokens * hidden for b in profile)


def test_selective_keeps_the_hook_of_the_linear_it_reruns_alone():
    """After the first forward that saves for a backward, a ViT block's linear layers other than the attention
    out-projection lose their hooks (a hooked module takes torch's slower call path); the next forwards still
    rebuild the residual sum: they keep the same bytes, and the gradients stay `none`'s, bit for bit."""
    torch.manual_seed(0)
    model, _ = build_model("vit-debug", 10, 16)
    images = torch.randn(2, 3, 16, 16)
    selective = copy.deepcopy(model)
    apply_activation_checkpointing(selective, "selective", "cpu", images, log=lambda *a: None)
    linears = [m for b in find_blocks(selective) for m in b.module.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m._forward_hooks for m in linears)
    first, second = (measure_activation_bytes(selective, images) for _ in range(2))
    hooked = [m for m in linears if m._forward_hooks]
    assert len(hooked) == len(find_blocks(selective)) < len(linears)
    assert all(m is b.module.get_submodule("attention.o_proj") for m, b in zip(hooked, find_blocks(selective)))
    profile = profile_blocks(model, images)
    assert first == second and measure_activation_bytes(model, images) - second == sum(
        p.bytes_none - p.bytes_selective for p in profile)
    for m in (model, selective):
        for _ in range(2):
            m(images).logits.square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), selective.parameters()))


def test_compiled_light_and_selective_are_an_operator_policy_the_partitioner_applies():
    """Under torch.compile `light` and `selective` are decided when each block is traced (ac/policies.py's
    traced_policy), not by the recipes' hooks: the compiled forward keeps less than compiled `none`'s, `selective`
    less than `light` by the out-projection's output (the linear the profile names reruns), measured by the
    profiler's memory events, and the gradients equal eager `none`'s to fp32 rounding. The partitioner is
    inductor's (min-cut, inductor's decompositions) without its code generation (`aot_eager_decomp_partition`),
    which keeps the test in seconds; tests/integration/test_checkpointing.py compiles with inductor."""
    torch.manual_seed(0)
    model, _ = build_model("vit-debug", 10, 16)
    images = torch.randn(4, 3, 16, 16)
    profile = profile_blocks(model, images)
    assert all(p.rerun_linears == (3,) for p in profile)  # query, key, value, then the out-projection
    reference = copy.deepcopy(model)
    reference(images).logits.square().sum().backward()
    measured = {}
    for ac in ("none", "light", "selective"):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        plan = apply_activation_checkpointing(m, ac, "cpu", profile=profile, compiled=True, log=lambda *a: None)
        assert plan.get("traced", False) == (ac != "none")
        for b in find_blocks(m):
            b.module.compile(backend="aot_eager_decomp_partition")
        m(images).logits.square().sum().backward()  # compiles
        m.zero_grad()
        measured[ac] = measure_activation_bytes(m, images)
        m(images).logits.square().sum().backward()
        for (name, a), b in zip(reference.named_parameters(), m.parameters()):
            assert b.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), (ac, name)
    torch._dynamo.reset()
    tokens, hidden, blocks = 4 * ((16 // model.config.patch_size) ** 2 + 1), model.config.hidden_size, len(profile)
    assert measured["none"] > measured["light"] > measured["selective"] > 0, measured
    assert measured["light"] - measured["selective"] == blocks * tokens * hidden * 4, measured  # fp32


def test_swin_selective_keeps_what_light_keeps():
    """A Swin block's residual sums pass its window reversal (and, shifted, a roll) on their way from the
    out-projection: no residual sum is a linear's output plus a kept tensor, so `selective` rebuilds what `light`
    does, reruns no matmul, and the profile says so."""
    torch.manual_seed(0)
    model, _ = build_model("swin-debug", 10, 16)
    images = torch.randn(2, 3, 16, 16)
    profile = profile_blocks(model, images)
    assert all(p.bytes_selective == p.bytes_light < p.bytes_none and p.flops_selective == 0 and
               p.selective_elems == p.light_elems and p.rerun_linears == () for p in profile)
    measured = {}
    for ac in ("light", "selective"):
        m = copy.deepcopy(model)
        apply_activation_checkpointing(m, ac, "cpu", images, log=lambda *a: None)
        measured[ac] = measure_activation_bytes(m, images)
    assert measured["light"] == measured["selective"]


@pytest.mark.parametrize("name", ["vit-debug", "swin-debug"])
def test_small_batch_profile_scales_exactly(name):
    """The plan profiles PROFILE_BATCH images and scales: the bytes and FLOPs equal the full batch's profile."""
    torch.manual_seed(0)
    model, _ = build_model(name, 10, 16)
    images = torch.randn(8, 3, 16, 16)
    full = profile_blocks(model, images)
    small = [p.scaled(8 / PROFILE_BATCH) for p in profile_blocks(model, images[:PROFILE_BATCH])]
    for s, f in zip(small, full):
        assert (s.bytes_none, s.bytes_light, s.bytes_selective, s.bytes_full, s.bytes_grad, s.flops, s.flops_full,
                s.flops_selective) == (f.bytes_none, f.bytes_light, f.bytes_selective, f.bytes_full, f.bytes_grad,
                                       f.flops, f.flops_full, f.flops_selective)
        # Swin's relative-position bias is built once per forward, whatever the batch: its cheap-op count is
        # the one figure that does not scale (up to 5.8% off here, at swin-debug's tiny width)
        assert s.cheap_elems == pytest.approx(f.cheap_elems, rel=0.1)
    # weights are not activations: a block's saved bytes hold no parameter storage
    assert full[0].bytes_none % 8 == 0 and full[0].bytes_none > 0
    # the plan profiles a slice of the batch it is given: the stem saves its input, counted at the slice's
    # size, not at the whole batch's that a view's storage spans (which scaled came out 4x too large here)
    plan = apply_activation_checkpointing(model, "none", "cpu", images)
    assert plan["activation_bytes_outside_blocks"] == full.bytes_outside > 0


@pytest.mark.parametrize("model,task,image,drop_path,tp", [
    ("vit-digits", "classification", 32, 0.1, 1),  # block 0 drops at rate 0: it runs apart from the others
    ("vit-digits", "mae", 32, 0.0, 1),  # the decoder's blocks are a second list
    ("vit-base", "classification", 64, 0.0, 2),  # one rank's share under tensor parallelism
    ("swin-tiny-w4", "simmim", 128, 0.1, 1),  # shifted and unshifted windows: two kinds per stage
    ("segformer-b2", "segmentation", 64, 0.1, 1),
])
def test_profile_of_one_block_per_kind_equals_every_blocks(model, task, image, drop_path, tp):
    """The planner's profile runs one block of each kind and repeats it: every figure equals a forward of them all."""
    from dataclasses import asdict, replace

    from ac.profile import _distinct_blocks, profile_model
    from config import Config
    from models.tasks import meta_model

    cfg = replace(Config(), model=model, task=task, image_size=image, drop_path=drop_path, tp_size=tp, patch_size=0)
    short, n_short, largest_short = profile_model(cfg, "cuda", torch.bfloat16)
    every, n_every, largest_every = profile_model(cfg, "cuda", torch.bfloat16, every_block=True)
    assert [asdict(p) for p in short] == [asdict(p) for p in every] and len(every) == len(find_blocks(meta_model(cfg)))
    for figure in ("bytes_outside", "grad_outside", "forward_flops", "ops", "moved_bytes"):
        assert getattr(short, figure) == getattr(every, figure) > 0 or figure == "grad_outside", figure
    assert (n_short, largest_short) == (n_every, largest_every)
    kinds = len(set(_distinct_blocks(meta_model(cfg)).values()))
    assert kinds < len(every), kinds
    if model == "swin-tiny-w4":
        assert kinds == 2 * 4 < 12  # stage 3's six blocks run as two


def test_profile_leaves_nothing_allocated():
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model, _ = build_model("vit-debug", 10, 16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        profile_blocks(model, torch.randn(4, 3, 16, 16))
    before, peak, after = memory_trace(prof)
    assert peak > before and after == before


def test_allocation_curve_drops_a_free_the_profiler_did_not_record():
    """A tensor dropped on a thread the profiler is not active on (as gloo's workers drop finished collectives'
    tensors): the profiler records no free and its "Total Allocated" keeps the block; once the allocator hands
    the address out again, the curve does not."""
    import threading

    from torch.profiler import ProfilerActivity, profile

    size = 16 * 1024  # floats: 64 KiB, from the heap, whose freed blocks are handed out again
    held, again = [], []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        held.append(torch.ones(size))
        address = held[0].data_ptr()
        dropper = threading.Thread(target=held.clear)
        dropper.start()
        dropper.join()
        while len(again) < 64 and address not in {t.data_ptr() for t in again}:
            again.append(torch.ones(size // 2))  # smaller: an aligned allocation fits into the freed block
        n_again = len(again)
        again.clear()
    assert n_again < 64, "the allocator did not hand the dropped block's address out again"
    events = trace_events(prof)
    frees = [e for e in events if e.get("name") == "[memory]" and e["args"]["Bytes"] < 0]
    assert len(frees) == n_again, "the profiler recorded the other thread's free: the correction is not needed"
    curve = [v for _, v in allocation_curve(events)]
    before = curve[0]
    assert curve[1] == before + 4 * size  # the first block; its free is missing
    assert curve[-1] == before  # everything was freed
    # once its address came back, the first block is no longer counted: the peak holds the new blocks only
    assert max(curve) == before + max(4 * size + (n_again - 1) * 2 * size, n_again * 2 * size)


def test_auto_plan_fits_every_budget_with_least_recompute():
    profile = synthetic_profile()
    none = sum(p.bytes_none for p in profile)
    floor = activation_peak(profile, ["full"] * 6)  # full recompute still rematerialises one block at a time
    previous = -1
    for budget in [none, int(none * 0.8), int(none * 0.5), int(none * 0.4), floor]:
        plan, used, recompute = plan_for_budget(profile, budget)
        assert used <= budget
        assert recompute >= previous  # tighter budget, never less recompute
        previous = recompute
    assert plan_for_budget(profile, none)[0] == ["none"] * 6
    # at the floor the peak is block 1's recompute on top of block 0's input: the later blocks need not go full
    plan, peak, _ = plan_for_budget(profile, floor)
    assert peak == floor and plan[:2] == ["full", "full"] and plan != ["full"] * 6
    plan, _, _ = plan_for_budget(profile, int(none * 0.4))
    # the first blocks to go full are the early ones: most bytes saved per FLOP recomputed
    assert plan.index("full") == 0
    with pytest.raises(ConfigError, match="below what full recompute"):
        plan_for_budget(profile, floor - 1)


def test_activation_peak_counts_the_recomputed_block():
    """A recomputed block rematerialises what it would have saved during its backward, while the blocks
    before it still hold theirs: with the last block full, the peak lies above the kept total. `selective`'s
    recipes rebuild one tensor at a time: its block holds what it kept."""
    profile = synthetic_profile()
    plan = ["none"] * 5 + ["full"]
    kept = sum(p.bytes_none for p in profile[:5])
    assert activation_peak(profile, plan) == kept + profile[5].bytes_none > kept + profile[5].bytes_full
    assert activation_peak(profile, ["none"] * 5 + ["selective"]) == kept + profile[5].bytes_selective
    assert activation_peak(profile, ["none"] * 6) == sum(p.bytes_none for p in profile)
    for budget in range(900, 2800, 100):  # the plan is judged by its peak, not by what it keeps
        plan, peak, _ = plan_for_budget(profile, budget)
        assert peak == activation_peak(profile, plan) <= budget
    # and each block's backward holds its gradients on top
    for p in profile:
        p.bytes_grad = p.bytes_none // 4
    assert activation_peak(profile, ["none"] * 6) == sum(p.bytes_none for p in profile) + profile[5].bytes_grad


def test_hierarchical_default_k_from_measured_sizes():
    profile = synthetic_profile()  # bytes per stage: 1600, 800, 400 -> stage 0 holds more than half
    assert default_hierarchical_k(profile, by_stage=True) == 1
    assert default_hierarchical_k(profile, by_stage=False) == 2  # blocks 0+1 = 1600 of 2800


def test_no_nested_checkpointing():
    model, _ = build_model("swin-debug", 10, 16)
    model.activation_checkpointing_enable()
    with pytest.raises(ConfigError, match="would recompute twice"):
        apply_activation_checkpointing(model, "full", "cpu", None)
    model, _ = build_model("swin-debug", 10, 16)
    apply_activation_checkpointing(model, "full", "cpu", None)
    wrapped = [n for n, m in model.named_modules() if "forward" in vars(m)]  # an instance forward: wrapped
    assert wrapped == [b.name for b in find_blocks(model)]  # blocks only, never a stage around them
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.parametrize("ac", ["sometimes", "every_n:0", "auto:-1", "auto:", "full:3"])
def test_unknown_policy(ac):
    with pytest.raises(ConfigError, match="unknown activation checkpointing policy"):
        parse_policy(ac)


def test_offload_needs_a_gpu():
    model, _ = build_model("vit-debug", 10, 16)
    with pytest.raises(ConfigError, match="needs a GPU"):
        apply_activation_checkpointing(model, "offload", "cpu", None)
