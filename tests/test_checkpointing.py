"""Activation checkpointing: every policy leaves the numbers unchanged under ZeRO 1-3, and saves what it says."""
import copy
import json
import os

import pytest
import torch
from ac.budget import activation_peak, default_hierarchical_k, plan_for_budget
from ac.policies import apply_activation_checkpointing, parse_policy
from ac.profile import PROFILE_BATCH, BlockProfile, profile_blocks
from conftest import fork_launch, launch, read_metrics
from config import ConfigError
from models import build_model, find_blocks
from engine.memory import allocation_curve, measure_activation_bytes, memory_trace, trace_events


# ZeRO-1 and ZeRO-2 both keep the whole weights, which is what the checkpointing meets, as under tensor parallelism
# below (ZeRO-1, by default): their runs here are slow; ZeRO-3's, whose gathers the recompute must meet, is not
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3,
                                   "fsdp2"])
def test_every_policy_matches_none_bitwise_under_zero(stage, tmp_path):
    """4 training steps, 2 ranks, vit-debug and swin-debug: losses and final weights equal `none` exactly, and
    the FLOPs the backward repeats are the ones the plan counted; under ZeRO 1-3 and under the FSDP2 engine."""
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    # PYTHONFAULTHANDLER: a rank that dies in C++ still prints its Python stack (how the exit abort that
    # `exit_distributed` fixes was found)
    proc = fork_launch([stage, out], 2, env, timeout=300, module="tests.ac_equivalence")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    compat_found = results.pop("compat")  # tests/test_compat.py's share of this run
    assert len(results) == 14
    for key, r in results.items():
        model, policy = key.split("|")
        none = results[f"{model}|none"]
        assert r["losses"] == none["losses"], key
        assert r["weights_numel"] == none["weights_numel"] > 0 and r["weights_sha256"] == none["weights_sha256"], key
        if policy in ("full", "selective", "light"):
            assert set(r["policies"]) == {policy}
        # the backward repeats exactly the matmul and attention FLOPs the profile predicted: under ZeRO-3 too,
        # where DeepSpeed's linear would make every recompute run the block's last matmul as well
        assert r["flops"] - none["flops"] == r["recompute_flops_planned"], key
    assert results["vit-debug|auto"]["policies"] != ["none", "none"]  # the mid budget forced some recompute
    if stage == "fsdp2":
        assert compat_found["optimizer"] == ["AdamW", False]  # torch's foreach AdamW, as DeepSpeed's side on CPU
        return
    # what engine/compat.py relies on in DeepSpeed: its CPU all-reduce buffer under the name it computes, and
    # (ZeRO-3) DeepSpeed's process-wide linear, which it replaces
    assert compat_found["shm_released"] is True
    assert compat_found["optimizer"] == ["AdamW", False]
    if stage in (1, 2):
        # what the planner charges ZeRO-1/2 for a step's communication is what DeepSpeed sent: it all-reduces
        # the gradients (2(N-1)/N of each bucket per rank) and all-gathers the updated weights ((N-1) times
        # each rank's partition); a scalar all-reduce or two (the gradient norm) aside
        from planner.estimate import comm_bytes

        logged = compat_found["zero_collectives"]
        sent = logged["bytes"]
        assert set(sent) <= {"all_reduce", "all_gather_into_tensor"}, sent
        world = 2
        measured = sent["all_reduce"] * 2 * (world - 1) / world + sent["all_gather_into_tensor"] * (world - 1)
        intra, inter = comm_bytes(logged["params"], stage, 1, world, world, 4, logged["zero"])
        assert inter == 0 and measured == pytest.approx(intra, rel=0.01)
    if stage == 3:
        assert compat_found["zero3_linear_replaced"] is True
        # partitioned construction: every policy above ran on a model built inside deepspeed.zero.Init (its
        # profile and `auto` plan included), whose initial weights equal the whole model's from the same seed
        assert compat_found["vit-debug_init_equal"] is True and compat_found["swin-debug_init_equal"] is True
        for model in ("vit-debug", "swin-debug"):
            partitioned, whole = compat_found[f"{model}_decay_groups"]
            assert partitioned == whole and whole[0] > 0
        # a local directory loads into the partitions and gives the logits it gives in one process
        assert compat_found["local_dir_partitioned"] is True
        assert compat_found["local_dir_max_rel_diff"] < 1e-6


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_every_policy_matches_none_bitwise_under_tensor_parallelism(stage, tmp_path):
    """The same 4 steps on 2 ranks as one tensor group (tp_size 2, vit-debug): every policy's losses and the
    final weights of rank 0's shard equal `none`'s exactly, recomputing a block replays its all-reduces; the
    FLOPs a rank's backward repeats are the ones the plan counted from its share of the model."""
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    proc = fork_launch([stage, out, 2], 2, env, timeout=300, module="tests.ac_equivalence")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    results.pop("compat")
    assert len(results) == 7
    none = results["vit-debug|none"]
    for key, r in results.items():
        assert r["losses"] == none["losses"], key
        assert r["weights_numel"] == none["weights_numel"] > 0 and r["weights_sha256"] == none["weights_sha256"], key
        assert r["flops"] - none["flops"] == r["recompute_flops_planned"], key
    assert set(results["vit-debug|selective"]["policies"]) == {"selective"}
    assert results["vit-debug|auto"]["policies"] != ["none", "none"]


@pytest.fixture(scope="module")
def vit_small():
    torch.manual_seed(0)
    model, _ = build_model("vit-small", 10, 64, 8)  # ViT-S, 65 tokens: the CPU benchmark's shape
    return model, torch.randn(8, 3, 64, 64)


def test_policies_reduce_measured_activation_memory(vit_small):
    model, images = vit_small
    measured = {}
    for ac in ("none", "light", "selective", "hierarchical", "full"):
        m = copy.deepcopy(model)
        apply_activation_checkpointing(m, ac, "cpu", images, log=lambda *a: None)
        measured[ac] = measure_activation_bytes(m, images)
    assert measured["none"] > measured["light"] > measured["selective"] > measured["hierarchical"] > measured["full"] > 0
    # light gives up its blocks' norm and activation outputs, and the profile counts exactly those
    profile = profile_blocks(model, images)
    assert measured["none"] - measured["light"] == sum(p.bytes_none - p.bytes_light for p in profile)
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
    # compute ops in forward order: q, k, v, attention, out-projection, fc1, fc2. The backward needs all but
    # the out-projection's and fc2's outputs, in every block (address reuse once made this vary by process)
    assert all(b.keep == [True, True, True, True, False, True, False] for b in profile)
    # what the recompute reruns: full stops before fc2 (nothing after it is saved); selective reruns only the
    # out-projection, whose output the next norm's saved input is computed from
    linear = 2 * tokens * hidden * hidden
    assert all(b.flops_full == b.flops - 4 * linear and b.flops_selective == linear for b in profile)


def test_swin_selective_keeps_what_attention_reads_as_copies():
    """transformers' Swin attention saves contiguous copies of q, k, v (q scaled) and of the attention output:
    keeping those matmul outputs costs the copies' bytes and spares rerunning them. What selective reruns is
    the out-projection (its residual sum is what the next norm saves) and the window scores q @ k^T."""
    torch.manual_seed(0)
    model, _ = build_model("swin-debug", 10, 16)
    for b, p in zip(find_blocks(model), profile_blocks(model, torch.randn(2, 3, 16, 16))):
        # q, k, v, scores, scores @ v, out-projection, fc1, fc2
        assert p.keep == [True, True, True, False, True, False, True, False]
        hidden = b.module.attention.o_proj.in_features
        tokens, window = p.bytes_full // (4 * hidden), model.config.window_size ** 2
        assert p.flops_selective == 2 * tokens * hidden * hidden + 2 * tokens * window * hidden


@pytest.mark.parametrize("name", ["vit-debug", "swin-debug"])
def test_small_batch_profile_scales_exactly(name):
    """The plan profiles PROFILE_BATCH images and scales: the bytes and FLOPs equal the full batch's profile."""
    torch.manual_seed(0)
    model, _ = build_model(name, 10, 16)
    images = torch.randn(8, 3, 16, 16)
    full = profile_blocks(model, images)
    small = [p.scaled(8 / PROFILE_BATCH) for p in profile_blocks(model, images[:PROFILE_BATCH])]
    for s, f in zip(small, full):
        assert (s.bytes_none, s.bytes_selective, s.bytes_full, s.bytes_grad, s.flops, s.flops_full, s.flops_selective,
                s.keep) == (f.bytes_none, f.bytes_selective, f.bytes_full, f.bytes_grad, f.flops, f.flops_full,
                            f.flops_selective, f.keep)
        # Swin's relative-position bias is built once per forward, whatever the batch: its cheap-op count is
        # the one figure that does not scale (up to 5.8% off here, at swin-debug's tiny width)
        assert s.cheap_elems == pytest.approx(f.cheap_elems, rel=0.1)
    # weights are not activations: a block's saved bytes hold no parameter storage
    assert full[0].bytes_none % 8 == 0 and full[0].bytes_none > 0
    # the plan profiles a slice of the batch it is given: the stem saves its input, counted at the slice's
    # size, not at the whole batch's that a view's storage spans (which scaled came out 4x too large here)
    plan = apply_activation_checkpointing(model, "none", "cpu", images)
    assert plan["activation_bytes_outside_blocks"] == full.bytes_outside > 0


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


def synthetic_profile():
    # a Swin-like shape: early blocks hold big activations for few FLOPs
    sizes = [(800, 100), (800, 100), (400, 200), (400, 200), (200, 400), (200, 400)]
    # full recompute stops before the last third of the FLOPs; selective reruns one small matmul
    return [BlockProfile(f"b{i}", i // 2, none, none // 2, none // 10, flops, flops * 2 // 3, flops // 20, flops // 100,
                         None)
            for i, (none, flops) in enumerate(sizes)]


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
    before it still hold theirs: with the last block selective, the peak lies above the kept total."""
    profile = synthetic_profile()
    plan = ["none"] * 5 + ["selective"]
    kept = sum(p.bytes_none for p in profile[:5])
    assert activation_peak(profile, plan) == kept + profile[5].bytes_none > kept + profile[5].bytes_selective
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


def test_train_logs_the_plan_and_its_figures(debug_args, tmp_path):
    proc = launch(debug_args + ["--max_steps", "3", "--eval_every", "0", "--ac", "hierarchical", "--output_dir",
                                tmp_path], nproc=1)
    assert "ac hierarchical:" in proc.stdout
    plan = json.loads((tmp_path / "ac_plan.json").read_text())
    assert [b["policy"] for b in plan["blocks"]] == ["full"] * 3 + ["selective"] * 3  # vit-digits: half of 6 alike blocks
    records = read_metrics(tmp_path)
    record = records[-1]
    assert record["ac/activation_bytes"] == plan["activation_bytes_planned"] < plan["activation_bytes_none"]
    assert 0 < record["ac/recompute_flops_frac"] < 0.34
    # the one profiled step: its measured peak allocation lies above the activations the plan keeps
    assert [r["step"] for r in records if "mem/step_peak_alloc_bytes" in r] == [2]
    assert records[1]["mem/step_peak_alloc_bytes"] > plan["activation_bytes_planned"]


def test_selective_composes_with_bf16_and_grad_accumulation(debug_args, tmp_path):
    """Runs end to end (bf16 is slow on these CPUs; its speed and accuracy are GPU questions)."""
    launch(debug_args + ["--model", "vit-debug", "--max_steps", "2", "--eval_every", "0", "--micro_batch_size", "4",
                         "--grad_accum_steps", "2", "--precision", "bf16", "--ac", "selective", "--output_dir",
                         tmp_path], nproc=1)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and all(r["loss"] == r["loss"] for r in records)  # no NaN
    assert json.loads((tmp_path / "ds_config.json").read_text())["bf16"]["enabled"] is True


COMPILED_POLICIES = [("deepspeed", ac) for ac in ("none", "full", "every_n:2", "selective", "hierarchical",
                                                   "auto:0.0015")] + \
    [("fsdp2", ac) for ac in ("none", "full", "selective", "hf:full", "hf:every_n:2")]


@pytest.mark.slow  # each compiled job compiles for 20-40 s on 2 cores: ~8 min
def test_compile_keeps_the_losses_of_eager_under_both_engines_and_every_policy():
    """The benchmark worker (train.py's wrapping for DeepSpeed ZeRO-3; FSDP2 with each block compiled in place)
    on 2 ranks, compiled, at every checkpointing policy: the losses of 4 steps equal eager's to fp32 rounding
    (inductor fuses and orders the arithmetic its own way)."""
    from benchmarks.train_bench import run_worker

    base = dict(model="vit-debug", image_size=16, micro_batch_size=8, zero=3, profiled_steps=1, timed_steps=3,
                count_flops=False)
    eager, tail = run_worker(dict(base, engine="fsdp2", ac="none"), 2, 1, 300)
    assert not tail and not eager["compiled"], tail
    for engine, ac in COMPILED_POLICIES:
        result, tail = run_worker(dict(base, engine=engine, ac=ac, compile=True), 2, 1, 600)
        assert not tail, f"{engine} {ac}: {tail}"
        assert result["compiled"], f"{engine} {ac}"
        assert result["losses"] == pytest.approx(eager["losses"], rel=1e-5), f"{engine} {ac}"
        if ac.startswith("auto"):  # the budget chose a mix, not one policy everywhere
            assert len(set(result["ac_plan"]["blocks"])) > 1, result["ac_plan"]


@pytest.mark.slow  # torch.compile on 2 CPU cores compiles for most of a minute
def test_compile_composes_with_selective_under_zero3(debug_args, tmp_path):
    """`compile: true` (DeepSpeed's engine.compile()) over selective checkpointing and ZeRO-3's hooks: 2 ranks,
    real DeepSpeed, the same losses as eager to fp32 rounding (inductor fuses differently)."""
    losses = {}
    for compiled in ("false", "true"):
        out = tmp_path / compiled
        proc = launch(debug_args + ["--model", "vit-debug", "--max_steps", "3", "--eval_every", "0", "--save_every",
                                    "0", "--micro_batch_size", "8", "--zero_stage", "3", "--ac", "selective",
                                    "--compile", compiled, "--output_dir", out])
        assert ("the model is compiled by torch.compile" in proc.stdout) == (compiled == "true")
        losses[compiled] = [r["loss"] for r in read_metrics(out)]
    assert len(losses["true"]) == 3
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)
