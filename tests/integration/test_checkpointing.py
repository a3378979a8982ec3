"""Activation checkpointing under the engines: every policy leaves the numbers unchanged under ZeRO 1-3, FSDP2, DDP
and tensor parallelism, and train.py logs its plan. What each policy saves: tests/unit/test_profile.py."""
import json
import os

import pytest
from conftest import fork_launch, launch, read_metrics


# ZeRO-1 and ZeRO-2 both keep the whole weights, which is what the checkpointing meets, as under tensor parallelism
# below (ZeRO-1, by default): their runs here are slow; ZeRO-3's, whose gathers the recompute must meet, is not
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3,
                                   "fsdp2", "ddp"])
def test_every_policy_matches_none_bitwise_under_zero(stage, tmp_path):
    """4 training steps, 2 ranks, vit-debug and swin-debug: losses and final weights equal `none` exactly, and
    the FLOPs the backward repeats are the ones the plan counted; under ZeRO 1-3 and under the FSDP2 and DDP
    engines."""
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    # PYTHONFAULTHANDLER: a rank that dies in C++ still prints its Python stack (how the exit abort that
    # `exit_distributed` fixes was found)
    proc = fork_launch([stage, out], 2, env, timeout=300, module="tests.ac_equivalence")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    compat_found = results.pop("compat")  # tests/unit/test_compat.py's share of this run
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
    if stage in ("fsdp2", "ddp"):
        assert compat_found["optimizer"] == ["AdamW", False]  # torch's foreach AdamW, as DeepSpeed's side on CPU
        return
    # what compat.py relies on in DeepSpeed: its CPU all-reduce buffer under the name it computes, and
    # (ZeRO-3) DeepSpeed's process-wide linear, which it replaces
    assert compat_found["shm_released"] is True
    assert compat_found["optimizer"] == ["AdamW", False]
    if stage in (1, 2):
        # what the planner charges ZeRO-1/2 for a step's communication is what DeepSpeed sent: it all-reduces
        # the gradients (2(N-1)/N of each bucket per rank) and all-gathers the updated weights ((N-1) times
        # each rank's partition); a scalar all-reduce or two (the gradient norm) aside
        from engine.memory import comm_bytes

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


# ZeRO-3 under tensor parallelism: slow; the default run has ZeRO-1 under it, and ZeRO-3 and FSDP2 without it (above)
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


COMPILED_POLICIES = [("deepspeed", ac) for ac in ("none", "full", "every_n:2", "light", "selective", "hierarchical",
                                                   "auto:0.0015")] + \
    [("fsdp2", ac) for ac in ("none", "full", "light", "selective", "hf:full", "hf:every_n:2")]


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
        # light and selective: torch.compile applies them when it traces, not the recipes' hooks
        plan = result.get("ac_plan") or {"blocks": [], "traced": None}
        assert bool(plan["traced"]) == bool({"light", "selective"} & set(plan["blocks"])), f"{engine} {ac}"
        assert plan["traced"] or ac not in ("light", "selective"), f"{engine} {ac}"
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
