"""The planner's model, in this process: its meta-device profile against the real-tensor one, its parameter
counts against the published ones, its model-state bytes against DeepSpeed's own estimators, its host, communication
and tensor-parallel terms, and its predictions of the committed H200 runs. plan.py's command line:
tests/integration/test_planner.py."""
import json
import os
from dataclasses import replace

import pytest
import torch
from ac.profile import profile_blocks
from conftest import REPO
from config import Config
import compat
from engine.memory import zero_memory_parts
from models.registry import build_model
from models.tasks import meta_model


# published sizes: Dosovitskiy et al. 2021, Zhai et al. 2022 (ViT-g/14), Dehghani et al. 2023 (ViT-22B), Liu et
# al. 2021 (Swin), all with a 1000-class head at 224 px
PUBLISHED = {"vit-base": 86e6, "vit-large": 304e6, "vit-huge": 632e6, "vit-giant": 1.0e9, "vit-22b": 21.7e9,
             "swin-tiny": 28e6, "swin-base": 88e6}


# a host probe as planner/host.py writes it: ZeRO-3 costs 10 ms per block without checkpointing, 12 ms with full
# recompute and 14 ms with selective, 10 ms per micro-batch besides; the bare model 2 ms per block
PROBED = {"blocks": [2, 6], "stages": {"3": {
    "micro": {"none": [0.03, 0.07], "selective": [0.034, 0.09], "full": [0.032, 0.08]},
    "plain": {m: [0.004, 0.012] for m in ("none", "selective", "full")}, "step": [0.004, 0.008]}}}


@pytest.mark.parametrize("name,image", [("vit-debug", 16), ("swin-debug", 16), ("vit-small", 32),
                                        ("swin-tiny-w4", 128)])
def test_meta_profile_equals_the_real_one(name, image):
    """Saved bytes (every policy's), FLOPs and recompute work per block, from a forward on the meta device with
    CPU attention kernels, equal those of the built model's real forward, and so do the bytes its memory-bound
    operators move."""
    x = torch.randn(2, 3, image, image)
    real = profile_blocks(build_model(name, 10, image)[0], x)
    with compat.sdpa_as_on("cpu"):
        meta = profile_blocks(meta_model(replace(Config(), model=name, image_size=image)), x.to("meta"))
    assert [p.__dict__ for p in meta] == [p.__dict__ for p in real]
    assert meta.bytes_outside == real.bytes_outside and sum(p.bytes_none for p in real) > 0
    # the memory-bound operators' traffic, which the step time charges at the memory bandwidth
    assert meta.moved_bytes == real.moved_bytes > 0


@pytest.mark.parametrize("name", PUBLISHED)
def test_registry_sizes_have_the_published_parameter_counts(name):
    model = meta_model(replace(Config(), model=name, image_size=224, num_labels=1000))
    n = sum(p.numel() for p in model.parameters())
    assert n == pytest.approx(PUBLISHED[name], rel=0.015), n


def test_model_state_bytes_equal_deepspeeds_estimators():
    """DeepSpeed counts, per GPU without offload, 16-bit weights (ZeRO-2: whole; ZeRO-3: only an allowance of 4
    bytes per parameter of the largest layer for gathered weights, which the planner replaces by zero3_gathered
    and its weight partition) plus 18 bytes per parameter / N for the
    16-bit gradient, fp32 gradient, fp32 master and AdamW partitions; the planner's parts hold the same, its fp32
    gradient partition being the first of the optimizer step's temporaries."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n, per_node, nodes, largest = 21_743_000_000, 8, 128, 453_000_000
    world = per_node * nodes
    for stage in (2, 3):
        parts = zero_memory_parts(n, stage, world, "bf16", {"zero_optimization": {}})
        ours = parts["weights"] * (stage == 2) + parts["gradients"] + parts["optimizer_states"] + 4 * n / world
        if stage == 2:
            _, theirs = estimate_zero2_model_states_mem_needs(n, per_node, nodes, cpu_offload=False)
        else:
            _, theirs, layer = estimate_zero3_model_states_mem_needs(n, largest, per_node, nodes, cpu_offload=False)
            theirs -= layer  # their allowance for the largest gathered layer; ours is zero3_gathered
        assert ours == pytest.approx(theirs, abs=4), stage


@pytest.mark.parametrize("name", ["vit-base", "vit-large"])
def test_vit_block_activations_follow_korthikanti(name):
    """Korthikanti et al. 2022 count a transformer layer's saved activations in 16-bit training as
    s·b·h·(34 + 5·a·s/h) bytes. What HF's ViT block saves under bf16 with FlashAttention-2, measured by the meta
    profile, is that formula adjusted for three differences: no dropout masks (dropout 0: −2·sbh), no attention
    matrix (FlashAttention saves its fp32 log-sum-exp instead: −5·a·s²·b + 4·a·s·b), and layer norm's fp32 mean
    and reciprocal deviation (2 norms × 8 bytes per token: +16·s·b); a few bytes of the kernel's RNG state
    remain."""
    from ac.profile import profile_model as profile
    from models.registry import VIT_SIZES

    h, _, a, _, patch = VIT_SIZES[name]
    s, b = (224 // patch) ** 2 + 1, 2
    cfg = replace(Config(), model=name, image_size=224, num_labels=1000, micro_batch_size=b)
    block = profile(cfg, "cuda", torch.bfloat16)[0][0]
    korthikanti = s * b * h * 34 + 5 * a * s * s * b
    adjusted = korthikanti - 2 * s * b * h - 5 * a * s * s * b + 4 * a * s * b + 16 * s * b
    assert 0 <= block.bytes_none - adjusted <= 64, (block.bytes_none, adjusted)
    assert block.bytes_none < korthikanti  # the attention matrix FlashAttention does not keep


def test_validate_counts_a_row_whose_jobs_failed(tmp_path):
    """A suite row whose every job failed is not dropped from validate's count: it is counted among the rows and
    named as not measured, beside the rows it predicts."""
    from benchmarks.validate import unmeasured, validation_table

    head = "shape,config,engine,compile,jobs_ok\n"
    (tmp_path / "results.csv").write_text(head + "S,ZeRO-3 + none,deepspeed,False,0\nS,ZeRO-2 + none,deepspeed,False,5\n"
                                          "S,FSDP2 + none,fsdp2,False,0\nS,ZeRO-3 + full,deepspeed,True,0\n")
    missing = unmeasured(str(tmp_path / "results.csv"))
    assert missing == [("S", "ZeRO-3 + none")]  # eager DeepSpeed rows only, as validate predicts
    assert validation_table([], missing) == ("no DeepSpeed rows to compare: 1 not measured (every job failed: "
                                             "ZeRO-3 + none at S)")
    row = {"shape": "S", "config": "ZeRO-2 + none", "peak_predicted": 2**20, "peak_measured": 2**20, "peak_error": 0.0,
           "step_predicted": 1.0, "compute_s": 1.0, "memory_bound_s": 0.1, "comm_s": 0.0, "host_micro_s": 0.1,
           "host_bound": False, "step_assumed": 1.0, "step_measured": 1.0, "step_error": 0.0, "step_error_assumed": 0.0}
    summary = validation_table([row], missing).splitlines()[-1]
    assert summary.startswith("2 rows, 1 with the calibrated step within 25%")
    assert summary.endswith("; 1 of them not measured (every job failed: ZeRO-3 + none at S)")


def test_host_seconds_follow_the_probes_lines():
    """Per policy, a block costs its line's slope; a micro-batch the none line's intercept besides; the optimizer
    step its own line; on a CPU the bare model's seconds are taken off first (the replay holds them)."""
    from planner.host import host_seconds

    mixed = ["full", "selective", "none"] * 4
    gpu = host_seconds(PROBED, 3, mixed, serial=False)
    assert gpu["micro_s"] == pytest.approx(0.01 + 4 * (0.012 + 0.014 + 0.01))
    assert gpu["step_s"] == pytest.approx(0.002 + 12 * 0.001)
    cpu = host_seconds(PROBED, 3, ["none"] * 12 + ["offload"], serial=True)  # offload: a block kept whole
    assert cpu["micro_s"] == pytest.approx(0.01 + 13 * (0.01 - 0.002))
    assert cpu["step_s"] == pytest.approx(0.002 + 13 * 0.001)  # the step is the same on either
    # the bare model's timings before each policy's engine differ by noise alone: their median is taken off
    figures = PROBED["stages"]["3"]
    noisy = {**PROBED, "stages": {"3": {**figures, "plain": {"none": [0.001, 0.030], "selective": [0.004, 0.012],
                                                             "full": [0.010, 0.011]}}}}
    assert host_seconds(noisy, 3, ["none"] * 13, serial=True)["micro_s"] == pytest.approx(cpu["micro_s"])


def test_the_host_is_charged_after_the_operators_on_cpu_and_beside_them_on_gpus():
    """estimate() with a probe: on a CPU each micro-batch adds the host's seconds to its operators' and the step
    its optimizer's; on a GPU a micro-batch takes the longer of the two, it is host-bound when the host's is
    longer, and the micro-batch that saturates the device is the first whose operators outlast the host."""
    import math

    from engine.ds_config import build_ds_config
    from planner.devices import DEVICES, Device
    from planner.estimate import estimate
    from planner.host import host_seconds

    cfg = Config(model="vit-small", image_size=64, patch_size=8, micro_batch_size=4, grad_accum_steps=3, zero_stage=3)
    ds = build_ds_config(cfg, 384, 2, "fp32")
    cpu = Device("cpu", 1e11, 1e6, 10.0, 10.0, 0.0, mem_gbs=10.0)
    rates = {"flops_per_s": 5e10, "bytes_per_s": 5e9}
    bare = estimate(cfg, ds, "fp32", 2, 2, cpu, rates=rates)
    probed = estimate(cfg, ds, "fp32", 2, 2, cpu, rates={**rates, "host": PROBED})
    host = host_seconds(PROBED, 3, ["none"] * 12, serial=True)
    assert not bare["host"]["measured"] and probed["host"]["measured"]
    assert probed["compute_s"] - bare["compute_s"] == pytest.approx(3 * host["micro_s"] + host["step_s"])
    assert probed["host"]["micro_s"] == pytest.approx(host["micro_s"])
    h200 = replace(DEVICES["h200"], op_overhead_s=0.0)
    for flops, bound in ((1e15, True), (1e11, False)):
        gpu_rates = {"flops_per_s": flops, "bytes_per_s": 1e12}
        bare = estimate(cfg, ds, "bf16", 2, 2, h200, rates=gpu_rates)
        e = estimate(cfg, ds, "bf16", 2, 2, h200, rates={**gpu_rates, "host": PROBED})
        total = host_seconds(PROBED, 3, ["none"] * 12, serial=False)
        device_micro = e["host"]["device_micro_s"]
        assert e["host"]["bound"] is bound and e["host"]["micro_s"] == pytest.approx(total["micro_s"])
        expected = 3 * max(device_micro, total["micro_s"]) + max(bare["compute_s"] - 3 * device_micro,
                                                                 total["step_s"])
        assert e["compute_s"] == pytest.approx(expected)
        saturating = e["host"]["saturating_micro_batch"]
        assert saturating == math.ceil(total["micro_s"] / (device_micro / cfg.micro_batch_size))
        assert (saturating > cfg.micro_batch_size) is bound


def test_zeropp_sends_a_quarter_of_zero3s_bytes_between_nodes():
    """Wang et al. 2023: ZeRO-3 moves 3M bytes across nodes per step (two weight gathers, one gradient
    reduce-scatter, in 16-bit); ZeRO++ moves 0.75M (int8 forward gather, backward gather within the node from
    hpZ's secondary partition, int4 gradients). hpZ's secondary partition holds the 16-bit weights over a node."""
    from engine.memory import comm_bytes

    n, world, node = 21_758_000_000, 1024, 8
    plain = comm_bytes(n, 3, 1, world, node, 2, {})
    zeropp = {"zero_hpz_partition_size": node, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    plus = comm_bytes(n, 3, 1, world, node, 2, zeropp)
    assert plain[0] == 0 and plain[1] == pytest.approx(3 * n * 2 * (world - 1) / world)
    assert plus[1] == pytest.approx(0.25 * plain[1])
    assert plus[0] == pytest.approx(n * 2 * (node - 1) / node)  # the backward's gather, over NVLink
    parts = zero_memory_parts(n, 3, world, "bf16", {"zero_optimization": zeropp})
    assert parts["zero3_secondary"] == pytest.approx(2 * n / node, abs=1)


def test_zero_offload_moves_the_states_to_the_host():
    """ZeRO-Offload (ds_configs/zero3_offload.json): the fp32 master, AdamW's moments, the fp32 gradient partition
    and the step leave the device; with the parameters offloaded, the weights' partition too. What remains on
    the device is ZeRO-3's gathered weights."""
    from engine.memory import offloaded_bytes

    n, world = 1_000_000_000, 8
    template = json.load(open(os.path.join(REPO, "ds_configs", "zero3_offload.json")))["zero_optimization"]
    offload = {"zero_optimization": {k: v for k, v in template.items() if k.startswith("offload_")}}
    plain = zero_memory_parts(n, 3, world, "bf16", {"zero_optimization": {}})
    parts = zero_memory_parts(n, 3, world, "bf16", offload)
    assert plain["optimizer_states"] > 0 and plain["weights"] > 0 and plain["gradients"] > 0
    assert parts["optimizer_states"] == parts["optimizer_step_temporaries"] == parts["weights"] == 0
    assert parts["gradients"] == 0
    assert offloaded_bytes(n, 3, world, "bf16", offload) == pytest.approx((12 + 4 + 2) * n / world, abs=1)
    assert offloaded_bytes(n, 3, world, "bf16", {"zero_optimization": {}}) == 0


@pytest.mark.parametrize("name", ["vit-debug", "swin-debug"])
def test_replay_records_the_profiles_work_and_replays_every_operator(name):
    """The replay's recording of a step (forward and backward on meta) holds the forward's FLOPs and memory
    traffic exactly as the checkpointing profile counts them, which the planner charges at the replayed rates;
    its backward has twice the forward's matmul FLOPs, less the input's gradient the stem does not compute;
    every operator then runs on real tensors."""
    from planner.replay import record, replay

    cfg = replace(Config(), model=name, image_size=16, num_labels=10)
    images = torch.empty(4, 3, 16, 16, device="meta")
    with compat.sdpa_as_on("cpu"):
        prof = profile_blocks(meta_model(cfg), images)
        counts = record(meta_model(cfg), images)
    forward = [(k, n) for k, n in counts.items() if not k[3]]
    backward = [(k, n) for k, n in counts.items() if k[3]]
    assert sum(k[4] * n for k, n in forward) == prof.forward_flops
    assert sum(k[5] * n for k, n in forward) == prof.moved_bytes
    assert 1.8 * prof.forward_flops < sum(k[4] * n for k, n in backward) <= 2.5 * prof.forward_flops
    result = replay(counts, torch.device("cpu"), reps=1)
    assert result.failed == () and result.distinct_ops == len(counts)
    assert min(result.compute_forward_s, result.compute_backward_s, result.memory_forward_s,
               result.memory_backward_s) > 0
    assert result.compute_flops == prof.forward_flops and result.moved_bytes == prof.moved_bytes


def test_one_tensor_rank_profiles_its_share_of_the_model():
    """The planner's model of a tensor rank (parallel/tensor.shard_like_autotp, on the meta device): at
    tp_size 2 a rank holds half of each block's six matrices and of the column-split biases and the whole rest
    (rank_params' count), its blocks do half the matmul and attention FLOPs, save less, and their input, what the
    tensor group all-reduces, is whole; Swin's stages split the same way."""
    from ac.profile import profile_model
    from parallel.tensor import rank_params

    cfg = replace(Config(), model="vit-small", image_size=64, patch_size=8, micro_batch_size=2)
    one, n1, _ = profile_model(cfg, "cpu")
    two, n2, _ = profile_model(replace(cfg, tp_size=2), "cpu")
    d, blocks = 384, 12
    assert n1 - n2 == blocks * (12 * d * d + 7 * d) // 2  # q, k, v, o: 4d², fc1, fc2: 8d²; biases of q, k, v, fc1
    assert n2 == rank_params(meta_model(cfg), 2)
    for a, b in zip(one, two):
        assert b.flops * 2 == a.flops and b.bytes_full == a.bytes_full and b.bytes_none < a.bytes_none
    swin = replace(Config(), model="swin-base", image_size=224, num_labels=1000, micro_batch_size=2)
    one, n1, _ = profile_model(swin, "cpu")
    two, n2, _ = profile_model(replace(swin, tp_size=2), "cpu")
    assert n2 == rank_params(meta_model(swin), 2) and n2 < n1
    assert [b.flops * 2 for b in two] == [a.flops for a in one]


def test_tensor_parallel_all_reduces_are_charged_per_block():
    """Each block's input is all-reduced twice in its forward and twice in its backward, twice more when it is
    recomputed whole; a ring all-reduce over a group of t sends 2(t-1)/t of it; nothing without TP."""
    from ac.profile import profile_model
    from planner.devices import Device
    from planner.estimate import estimate, tp_allreduce_bytes
    from engine.ds_config import build_ds_config

    cfg = replace(Config(), model="vit-small", image_size=64, patch_size=8, micro_batch_size=4, grad_accum_steps=2,
                  tp_size=2)
    prof = profile_model(cfg, "cpu")[0]
    block_input = prof[0].bytes_full
    assert block_input == 4 * 65 * 384 * 4  # fp32 activations of 65 tokens of width 384
    assert tp_allreduce_bytes(prof, ["none"] * 12, 2) == 12 * 4 * block_input * 2 * 1 / 2
    assert tp_allreduce_bytes(prof, ["full"] * 6 + ["none"] * 6, 2) == (6 * 6 + 6 * 4) * block_input
    assert tp_allreduce_bytes(prof, ["none"] * 12, 1) == 0
    device = Device("cpu", 1e11, 1e6, 10.0, 10.0, 0.0, mem_gbs=10.0)
    e = estimate(cfg, build_ds_config(cfg, 384, 8, "fp32"), "fp32", 8, 8, device)
    assert e["tp_comm_bytes_per_step_per_rank"] == 2 * 12 * 4 * block_input  # two micro-batches
    assert e["tp_comm_s"] == pytest.approx(e["tp_comm_bytes_per_step_per_rank"] / 10e9)
    assert e["global_batch"] == 4 * 2 * 4  # four data-parallel ranks of two


def test_sequence_parallelism_shares_the_blocks_and_charges_its_all_to_alls():
    """Under sp_size s a rank holds an s-th of each block's activations, FLOPs and traffic (the stem and head
    whole); each block sends four all-to-alls of its share of the input forward, four backward, four more when
    recomputed whole, (s-1)/s of each leaving the rank; ZeRO still partitions over every rank, and a sequence
    group reads one micro-batch."""
    from ac.profile import profile_model
    from engine.ds_config import build_ds_config
    from planner.devices import Device
    from planner.estimate import estimate, sp_alltoall_bytes

    cfg = replace(Config(), model="vit-small", image_size=64, patch_size=8, micro_batch_size=4, grad_accum_steps=2)
    prof = profile_model(cfg, "cpu")[0]
    share = prof.sequence_share(2)
    # a rank's half, and the attention's output back from its all-to-all: a copy of the block input's half
    assert [b.bytes_none for b in share] == [round(b.bytes_none / 2) + round(b.bytes_full / 2) for b in prof]
    assert [b.bytes_full for b in share] == [round(b.bytes_full / 2) for b in prof]
    assert share.bytes_outside == prof.bytes_outside and share.forward_flops < prof.forward_flops
    block_flops = sum(b.flops for b in prof)
    assert share.forward_flops == round(prof.forward_flops - block_flops / 2)
    assert sp_alltoall_bytes(share, ["none"] * 12, 2) == 12 * 4 * 2 * share[0].bytes_full / 2
    assert sp_alltoall_bytes(share, ["full"] * 12, 2) == 12 * 4 * 3 * share[0].bytes_full / 2
    assert sp_alltoall_bytes(prof, ["none"] * 12, 1) == 0
    device = Device("cpu", 1e11, 1e6, 10.0, 10.0, 0.0, mem_gbs=10.0)
    one = estimate(cfg, build_ds_config(cfg, 384, 8, "fp32"), "fp32", 8, 8, device)
    two = estimate(replace(cfg, sp_size=2), build_ds_config(cfg, 384, 8, "fp32"), "fp32", 8, 8, device)
    assert two["memory"]["weights"] == one["memory"]["weights"]  # partitioned over all 8 ranks either way
    assert two["memory"]["activations"] < 0.6 * one["memory"]["activations"]
    assert two["sp_comm_bytes_per_step_per_rank"] == 2 * sp_alltoall_bytes(share, ["none"] * 12, 2)
    assert two["sp_comm_s"] == pytest.approx(two["sp_comm_bytes_per_step_per_rank"] / 10e9)
    assert (one["global_batch"], two["global_batch"]) == (4 * 2 * 8, 4 * 2 * 4)


def test_fsdp2_sends_its_gathers_and_one_fp32_reduce_scatter():
    """The FSDP2 engine per step: each micro-batch all-gathers the weights in the compute dtype for its forward
    and, resharding, again for its backward; the gradients are reduce-scattered once, in fp32."""
    from engine.memory import fsdp2_comm_bytes

    n, world, node = 1_000_000, 16, 8
    share = (world - 1) / world
    assert fsdp2_comm_bytes(n, True, 1, world, node, 2) == (0.0, pytest.approx((2 * 2 + 4) * n * share))
    assert fsdp2_comm_bytes(n, False, 4, world, node, 2) == (0.0, pytest.approx((4 * 2 + 4) * n * share))
    assert fsdp2_comm_bytes(n, True, 1, node, node, 2)[1] == 0.0  # one node: nothing between nodes


def test_the_planner_predicts_the_h200_runs():
    """plan.py against the committed H200 check (ViT-L/16, bf16, micro-batch 256 through train.py, both engines,
    one GPU): every peak within 5% of the allocator's and every step within 25% of the measured one."""
    from benchmarks.docs import h200_planner_errors  # what docs/planner.md renders: one computation for both

    _, _, errors = h200_planner_errors()
    assert len(errors) == 7
    for name, (peak_error, step_error) in errors.items():
        assert abs(peak_error) <= 0.05, name
        assert abs(step_error) <= 0.25, name


def test_mae_under_sequence_parallelism_splits_its_encoder_and_keeps_its_decoder_whole():
    """MAE's profile under sp_size 2: the encoder's blocks (`vit.`) an s-th each, the decoder's whole on every
    rank, and all-to-alls for the encoder's blocks alone."""
    from ac.profile import profile_model
    from parallel import sequence
    from planner.estimate import sp_alltoall_bytes

    cfg = replace(Config(), task="mae", model="vit-small", image_size=64, patch_size=8, micro_batch_size=4)
    prof = profile_model(cfg, "cpu")[0]
    split = sequence.split_blocks(b.name for b in prof)
    decoder = [b.name for b in prof if b.name not in split]
    assert len(split) == 12 and decoder and all(n.startswith("decoder.") for n in decoder)
    share = prof.sequence_share(2, split)
    for whole, part in zip(prof, share):
        assert part.bytes_none == (round(whole.bytes_none / 2) + round(whole.bytes_full / 2) if whole.name in split
                                   else whole.bytes_none)
    encoder_flops = sum(b.flops for b in prof if b.name in split)
    assert share.forward_flops == round(prof.forward_flops - encoder_flops / 2)
    plan = ["none"] * len(prof)
    assert sp_alltoall_bytes(share, plan, 2, split) == sum(4 * 2 * b.bytes_full for b in share if b.name in split) / 2
