"""Run by tests/integration/test_checkpointing.py on 2 ranks: every AC policy against `none`.

    deepspeed --num_gpus 2 --module tests.ac_equivalence ZERO_STAGE OUT.json [TP_SIZE]
    deepspeed --num_gpus 2 --module tests.ac_equivalence fsdp2 OUT.json       # the FSDP2 engine (resharding)
    deepspeed --num_gpus 2 --module tests.ac_equivalence ddp OUT.json         # the DDP engine

(the tests fork its ranks from the zygote instead: conftest.fork_launch with module="tests.ac_equivalence").

For vit-debug and swin-debug, each policy trains 4 steps from the same seed on the same per-rank batches
under the given ZeRO stage, through train.py's own `build_engine`; rank 0 writes the losses and a digest of
the final weights per policy, and what the compat functions found (tests/unit/test_compat.py reads those). With
TP_SIZE > 1, vit-debug alone (swin-debug's first stage has one head) under DeepSpeed's AutoTP, the ranks of a
tensor group reading the same batches, rank 0's digest that of its shard, and no compat findings.
"""
import hashlib
import json
import sys

import deepspeed
import torch
import torch.nn.functional as F

from ac.budget import activation_peak
from ac.profile import profile_blocks, profile_model
from config import Config
import compat
from loop.distributed import exit_distributed
from engine.memory import zero_memory_bytes
from loop.optim import param_groups
from engine.build import build_engine, build_training_model, engine_config
from parallel.tensor import layout, rank_params
from models import build_model

def main(argv):
    stage, out, *rest = [int(a) if a.isdigit() else a for a in argv if not a.startswith("--local_rank")]
    tp = rest[0] if rest else 1
    engine_name = stage if isinstance(stage, str) else "deepspeed"
    stage = 3 if isinstance(stage, str) else stage  # FSDP2 reshards after forward, ZeRO-3's trade
    zero3 = stage == 3 and engine_name == "deepspeed"  # DeepSpeed's partitioned parameters
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    data_rank = layout(rank, tp)[0]
    torch.distributed.barrier()
    results = {"compat": {"shm_released": compat.release_deepspeed_shm(rank)}}
    for name in ("vit-debug", "swin-debug") if tp == 1 else ("vit-debug",):
        torch.manual_seed(0)
        probe, _ = build_model(name, 10, 16)
        # stochastic depth on: every policy must replay its random draws exactly
        cfg = Config(model=name, zero_stage=stage, micro_batch_size=8, lr=1e-3, warmup_steps=1, max_steps=4,
                     weight_decay=0.05, drop_path=0.1, tp_size=tp, engine=engine_name)
        # what the blocks of one tensor rank save (the planner's profile of its share under TP)
        prof = profile_blocks(probe, torch.randn(8, 3, 16, 16)) if tp == 1 else profile_model(cfg, "cpu")[0]
        precision, ds = engine_config(cfg, probe.config.hidden_size, world)
        fixed = zero_memory_bytes(rank_params(probe, tp), stage, world // tp, precision, ds)
        lowest, highest = (activation_peak(prof, [how] * len(prof)) for how in ("full", "none"))
        mid = max(fixed["backward"] + prof.bytes_outside + (lowest + highest) / 2, fixed["optimizer_step"]) / 2**30
        for ac in ("none", "light", "full", "every_n:2", "selective", "hierarchical", f"auto:{mid:.9f}"):
            torch.manual_seed(0)
            model, _ = build_training_model(cfg, ds)  # under ZeRO-3, partitioned as it is built
            if zero3 and ac == "none" and tp == 1:  # the seed alone sets the weights: partitioned equals whole, bitwise
                params = list(model.parameters())
                whole_model = build_model(name, 10, 16, seed=cfg.seed)[0]
                with deepspeed.zero.GatheredParameters(params):
                    whole = dict(whole_model.named_parameters())
                    results["compat"][f"{name}_init_equal"] = all(p.equal(whole[n]) for n, p in model.named_parameters())
                # AdamW's groups read the shape as defined, not the partition's
                results["compat"][f"{name}_decay_groups"] = [[len(g["params"]) for g in param_groups(m, 0.05)]
                                                             for m in (model, whole_model)]
            cfg.ac = ac
            built = build_engine(model, cfg, world, "cpu", log=lambda *a: None)  # train.py's own wrapping
            engine, plan = built.engine, built.ac_plan
            # the update DeepSpeed steps: torch's AdamW, foreach on CPU (ds_config's "fused" reaches torch)
            results["compat"]["optimizer"] = [type(engine.torch_optimizer).__name__,
                                              engine.torch_optimizer.defaults.get("fused")]
            if zero3 and tp == 1:
                results["compat"]["zero3_linear_replaced"] = torch.nn.functional.linear is compat._zero3_linear
            torch.manual_seed(1)  # once: drop path draws the same numbers whatever the policy
            losses = []
            # ZeRO-1/2 (vit-debug, `none`): the last step's collectives, through DeepSpeed's own comms logger
            logged = engine_name == "deepspeed" and stage in (1, 2) and name == "vit-debug" and ac == "none" and tp == 1
            for step in range(4):
                g = torch.Generator().manual_seed(100 * step + data_rank)
                x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
                if logged and step == 3:
                    deepspeed.comm.configure(enabled=True, prof_all=True)
                # every step's forward and backward counted (recompute included); the last step's counter is kept
                with compat.flop_counter() as counter:
                    loss = F.cross_entropy(engine(x).logits, y)
                    engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            if logged:  # {collective: bytes of its tensor argument, summed over its calls}
                deepspeed.comm.configure(enabled=False)
                raw = deepspeed.comm.comm.comms_logger.get_raw_data()
                results["compat"]["zero_collectives"] = {
                    "params": sum(p.numel() for p in engine.module.parameters()), "zero": ds["zero_optimization"],
                    "bytes": {op: sum(size * v[0] for size, v in sizes.items()) for op, sizes in raw.items()}}
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=zero3):  # FSDP2: each shard gathered whole
                flat = torch.cat([(p.full_tensor() if compat.is_dtensor(p) else p).detach().flatten() for p in params])
            # every weight, bit for bit: the digest of their bytes in the model's own dtype
            results[f"{name}|{ac.split(':')[0]}"] = {"losses": losses, "weights_numel": flat.numel(),
                                                     "weights_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                                                     "policies": [b["policy"] for b in plan["blocks"]],
                                                     "flops": counter.get_total_flops(),
                                                     "recompute_flops_planned": plan["recompute_matmul_flops"]}
            engine.destroy()
    if zero3 and tp == 1:  # a local Hugging Face directory loads into ZeRO-3 partitions and computes what it does whole
        hf_dir = out + ".hf"
        if rank == 0:
            build_model("vit-debug", 10, 16, seed=3)[0].save_pretrained(hf_dir)
        torch.distributed.barrier()
        cfg = Config(model=hf_dir, zero_stage=3, micro_batch_size=8)
        model, _ = build_training_model(cfg, engine_config(cfg, 32, world)[1])
        results["compat"]["local_dir_partitioned"] = all(compat.is_zero3_partitioned(p) for p in model.parameters())
        engine = build_engine(model, cfg, world, "cpu", log=lambda *a: None).engine
        engine.eval()
        images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            logits = engine(images).logits
            whole = build_model(hf_dir, 10, 16)[0].eval()(images).logits
        results["compat"]["local_dir_max_rel_diff"] = ((logits - whole).abs().max() / whole.abs().max()).item()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    exit_distributed(0)  # the result is written and closed; avoids gloo's abort at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1:])
