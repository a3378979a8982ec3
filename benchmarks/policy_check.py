"""Every activation-checkpointing policy against `none` under one ZeRO stage, in one process per rank: the losses
of the same steps from the same seed, each policy's step time and peak memory. GPU: bf16 (offload included);
CPU: fp32 (no offload). benchmarks/gpu_check.sh runs it; the exactness tests are tests/ac_equivalence.py's.

    torchrun --nproc_per_node 1 -m benchmarks.policy_check --out policies.json [--model vit-small --image_size 64]
"""
import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from config import Config
from loop.distributed import exit_distributed, init_distributed
from engine.build import build_engine, build_training_model, engine_config
from loop.timing import clock
from models import model_config

FIXED = ("none", "full", "every_n:2", "selective", "hierarchical")


def run_policy(cfg: Config, ac: str, world: int, rank: int, device: torch.device, steps: int) -> dict:
    cfg.ac = ac
    precision, ds = engine_config(cfg, model_config(cfg.model, cfg.num_labels, cfg.image_size,
                                                    cfg.patch_size).hidden_size, world)
    torch.manual_seed(cfg.seed)
    model, _ = build_training_model(cfg, ds)
    built = build_engine(model, cfg, world, device.type, log=lambda *a: None)
    engine = built.engine
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(1)  # stochastic depth draws the same numbers under every policy
    losses, times = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(cfg.micro_batch_size, 3, cfg.image_size, cfg.image_size, generator=g)
        y = torch.randint(0, cfg.num_labels, (cfg.micro_batch_size,), generator=g)
        start = clock(device)
        loss = F.cross_entropy(engine(x.to(device, built.dtype)).logits.float(), y.to(device))
        engine.backward(loss)
        engine.step()
        times.append(clock(device) - start)
        losses.append(loss.item())
    result = {"losses": losses, "step_ms_median": 1e3 * statistics.median(times[2:] or times),
              "peak_alloc_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
              "planned_peak_bytes": built.ac_plan.get("peak_bytes_planned"),
              "blocks": [b["policy"] for b in built.ac_plan["blocks"]]}
    engine.destroy()
    del engine, built, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="vit-small")
    parser.add_argument("--image_size", type=int, default=64)
    parser.add_argument("--patch_size", type=int, default=8)
    parser.add_argument("--micro_batch_size", type=int, default=32)
    parser.add_argument("--zero_stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = init_distributed(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = Config(model=args.model, image_size=args.image_size, patch_size=args.patch_size,
                 micro_batch_size=args.micro_batch_size, zero_stage=args.zero_stage, warmup_steps=5,
                 max_steps=args.steps, drop_path=0.1)
    policies = list(FIXED) + (["offload"] if device.type == "cuda" else [])
    results = {}
    for ac in policies:
        results[ac] = run_policy(cfg, ac, world, rank, device, args.steps)
    planned = [results[p]["planned_peak_bytes"] for p in ("full", "none")]
    if all(planned):  # a budget halfway between full's and none's planned peaks: a mixed plan
        budget = (planned[0] + planned[1]) / 2 / 2**30
        results["auto"] = dict(run_policy(cfg, f"auto:{budget:.6f}", world, rank, device, args.steps),
                               budget_gib=budget)
    reference = results["none"]["losses"]
    for r in results.values():
        r["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], reference))
        r["bitwise_equal"] = r["losses"] == reference
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "image_size": args.image_size, "patch_size": args.patch_size,
                       "micro_batch_size": args.micro_batch_size, "zero_stage": args.zero_stage, "ranks": world,
                       "precision": engine_config(cfg, 1, world)[0], "steps": args.steps, "policies": results}, f,
                      indent=1)
        for name, r in results.items():
            print(f"{name:14s} last loss {r['losses'][-1]:.6f} | max |diff| vs none {r['max_abs_loss_diff']:.2e} | "
                  f"{r['step_ms_median']:.1f} ms/step")
    exit_distributed(0)


if __name__ == "__main__":
    main()
