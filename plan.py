"""Plan a run before making it: per-rank peak memory by part and the step time of a configuration on a cluster,
or, given a global batch, every configuration that fits, fastest first, and the best written out as a recipe.

    python plan.py --model vit-22b --image_size 224 --num_labels 1000 --precision bf16 \\
        --world_size 1024 --ranks_per_node 8 --device h100-80gb --global_batch 65536 --out plans/vit-22b
    python plan.py --config configs/digits-vit.yaml --world_size 2 --device cpu --device_tflops 0.11 \\
        --device_memory_gb 12                                    # one configuration, as train.py would run it

Every train.py key (config.py) is accepted and means what it means there; the cluster keys are below. Nothing
is built: the model is profiled on the meta device. docs/planner.md says what is counted and assumed.
"""
import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import replace

from config import Config, ConfigError, parse, to_dict


def cluster_args(argv):
    # no abbreviations: the keys left for train.py's parser (--tp_size) must not be read as a prefix of one here
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--world_size", type=int, default=8, help="ranks (devices) in the job")
    parser.add_argument("--ranks_per_node", type=int, default=8, help="ranks per node")
    parser.add_argument("--device", default="h100-80gb", help="a device name (see --list_devices) or 'cpu'")
    parser.add_argument("--device_memory_gb", type=float, help="memory per device in GiB (overrides the table)")
    parser.add_argument("--device_tflops", type=float, help="dense TFLOP/s per device (overrides the table)")
    parser.add_argument("--host_memory_gb", type=float, help="host memory per node in GiB, for ZeRO-Offload "
                                                              "(overrides the table)")
    parser.add_argument("--device_mem_gbs", type=float, help="GB/s of device memory (overrides the table; cpu: "
                                                              "measured, 10 if not given)")
    parser.add_argument("--intra_gbs", type=float, help="GB/s per direction per device within a node")
    parser.add_argument("--inter_gbs", type=float, help="GB/s per direction per device between nodes")
    parser.add_argument("--mfu", type=float, help="fraction of peak FLOP/s the step's matmuls reach (0.4)")
    parser.add_argument("--mbu", type=float, help="fraction of the memory bandwidth memory-bound operators reach "
                                                  "(0.7)")
    parser.add_argument("--overlap", type=float, default=0.0, help="fraction of communication hidden (0)")
    parser.add_argument("--global_batch", type=int, help="search every configuration with this global batch")
    parser.add_argument("--tp_sizes", default="",
                        help="tensor-parallel sizes a search tries, comma-separated (default: tp_size if the "
                             "configuration sets it above 1, else every power of two the model and nodes allow)")
    parser.add_argument("--sp_sizes", default="",
                        help="sequence-parallel sizes a search tries, comma-separated (ViT classifiers; default: the "
                             "recipe's sp_size): each splits the tokens over that many ranks of a node")
    parser.add_argument("--pp_sizes", default="",
                        help="pipeline sizes a search tries, comma-separated (ViT classifiers under fsdp2 and ddp; "
                             "default: the recipe's pp_size): each cuts the blocks into that many stages over "
                             "consecutive ranks")
    parser.add_argument("--top", type=int, default=10, help="configurations listed by a search")
    parser.add_argument("--allow_quantized", action="store_true",
                        help="let a search pick a configuration that changes the arithmetic (ZeRO++'s int8 weights "
                             "and int4 gradients, ZeRO-Offload's CPU Adam); listed either way, marked *")
    parser.add_argument("--out", help="write the best configuration here: config.yaml, ds_config.json, launch.sh")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--picture", metavar="PNG", help="draw the per-rank memory breakdown of the listed configurations")
    parser.add_argument("--list_devices", action="store_true")
    parser.add_argument("--calibrate", metavar="JSON",
                        help="measure here what a plan of this configuration assumes (its operators' FLOP rate and "
                             "bandwidth at this micro-batch, the memory and, under torchrun, the all-gather "
                             "bandwidth; the engine's host seconds per block and per step) and write it to JSON")
    parser.add_argument("--host_stages", default="1,2,3",
                        help="--calibrate: the ZeRO stages the host probe measures, comma-separated (a plan at another "
                             "stage assumes the host's share)")
    parser.add_argument("--host_rounds", type=int, default=3,
                        help="--calibrate: how many times the host probe runs its grid over, each figure the median "
                             "of its rounds (planner/host.py)")
    parser.add_argument("--no_host_probe", action="store_true",
                        help="--calibrate without the host probe (the engine's seconds per block and per step)")
    parser.add_argument("--calibration", metavar="JSON",
                        help="plan with what --calibrate measured, in place of --mfu, --mbu, --device_mem_gbs and "
                             "--intra_gbs (a --global_batch search then tries only the calibrated micro-batch)")
    return parser.parse_known_args(argv)


def device_of(a):
    from planner.devices import DEVICES, Device

    if a.device == "cpu":
        missing = [k for k in ("device_tflops", "device_memory_gb") if getattr(a, k) is None]
        if missing:
            raise ConfigError(f"device cpu: give {' and '.join('--' + k for k in missing)} (measured figures)")
        base = Device("cpu", 0, 0, 10, 1, 0.0, mem_gbs=10.0)
    elif a.device in DEVICES:
        base = DEVICES[a.device]
    else:
        raise ConfigError(f"unknown device '{a.device}' (one of: {', '.join(DEVICES)}, or cpu with "
                          f"--device_tflops and --device_memory_gb)")
    return replace(base, flops=a.device_tflops * 1e12 if a.device_tflops else base.flops,
                   memory_gib=a.device_memory_gb or base.memory_gib, intra_gbs=a.intra_gbs or base.intra_gbs,
                   inter_gbs=a.inter_gbs or base.inter_gbs, host_memory_gib=a.host_memory_gb or base.host_memory_gib,
                   mem_gbs=a.device_mem_gbs or base.mem_gbs)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def sharding(e: dict) -> str:
    """A configuration's engine and sharding in words, the engine's own: ZeRO-3, ZeRO-3++ (ZeRO++), ZeRO-3 off
    (offload), FSDP2 with or without resharding after the forward, DDP."""
    from engine.registry import engine_class

    return engine_class(e["engine"]).plan_label(e)


def describe(e: dict) -> str:
    m, cal = e["memory"], e["calibrated"]
    tp, pp = e["tp_size"], e.get("pp_size", 1)
    lines = [f"{e['model']} ({e['params'] / 1e9:.3f}B params" + (" per rank of a tensor group" if tp > 1 else "")
             + f"), {e['image_size']}px, {e['precision']} | {sharding(e)}"
             + (f" x tensor parallel {tp}" if tp > 1 else "")
             + (f" x sequence parallel {e['sp_size']}" if e.get("sp_size", 1) > 1 else "")
             + (f" x pipeline {pp} ({e['pp_schedule']}, {e['pp_microbatches']} pieces a micro-batch, bubble "
                f"{e['bubble']:.0%}" + (f", blocks cut {e['pp_split']}" if e.get("pp_split") else "") + ")"
                if pp > 1 else "")
             + f" | micro-batch {e['micro_batch_size']} x {e['grad_accum_steps']} accumulation x "
             f"{e['world_size'] // tp // e.get('sp_size', 1) // pp} "
             f"{'data-parallel ' if tp * e.get('sp_size', 1) * pp > 1 else ''}ranks "
             f"= {e['global_batch']} images | ac {e['ac']} {e['plan']} | {e['world_size']} x {e['device']}, "
             f"{e['ranks_per_node']} per node",
             "per-rank peak memory (GiB): " + ", ".join(f"{k} {gib(v)}" for k, v in m.items())
             + f" | peak {gib(e['peak_bytes'])} at the {e['peak_moment'].replace('_', ' ')} of "
               f"{gib(e['capacity_bytes'])} usable: {'fits' if e['fits'] else 'DOES NOT FIT'}",
             f"step: {e['step_s'] * 1e3:.1f} ms = compute {e['compute_s'] * 1e3:.1f} ms "
             f"({e['flops_per_step_per_rank'] / 1e12:.2f} TFLOP per rank, recompute {e['recompute_fraction']:.1%}, at "
             + (f"{cal['flops_per_s'] / 1e9:.1f} GFLOP/s as calibrated" if cal else f"{e['assumptions']['mfu']:.0%} of peak")
             + f"; of it {e['memory_bound_s'] * 1e3:.1f} ms moving "
             f"{e['memory_bytes_per_step_per_rank'] / 1e9:.2f} GB through memory-bound operators at "
             + (f"{cal['bytes_per_s'] / 1e9:.1f} GB/s as calibrated (the optimizer's at {e['assumptions']['mem_gbs']:.1f})"
                if cal else f"{e['assumptions']['mbu']:.0%} of {e['assumptions']['mem_gbs']:g} GB/s")
             + f") + communication {e['comm_s'] * 1e3:.1f} ms "
             f"({e['comm_bytes_per_step_per_rank'] / 1e9:.2f} GB per rank, {e['comm_bytes_between_nodes'] / 1e9:.2f} GB of it "
             f"between nodes at {e['assumptions']['inter_gbs']:g} GB/s, within at {e['assumptions']['intra_gbs']:g} GB/s; "
             f"{e['assumptions']['overlap']:.0%} hidden)"
             + (f" + tensor-parallel all-reduces {e['tp_comm_s'] * 1e3:.1f} ms ("
                f"{e['tp_comm_bytes_per_step_per_rank'] / 1e9:.2f} GB per rank within the node, not hidden)"
                if tp > 1 else "")
             + (f" + sequence-parallel all-to-alls {e['sp_comm_s'] * 1e3:.1f} ms ("
                f"{e['sp_comm_bytes_per_step_per_rank'] / 1e9:.2f} GB per rank within the node, not hidden)"
                if e.get("sp_size", 1) > 1 else "")
             + (f" + between stages {e['pp_comm_s'] * 1e3:.1f} ms ({e['pp_comm_bytes_per_step_per_rank'] / 1e9:.2f} GB "
                f"per rank, not hidden)" if pp > 1 else "")
             + (f" + offload {e['offload']['offload_s'] * 1e3:.1f} ms" if e["offload"]["offload_s"] else "")
             + f" | {e['images_per_s']:.0f} images/s"]
    if pp > 1:  # where the step's peak is, stage by stage
        lines.append("stages (blocks: peak GiB, pieces held, ac plan): " + "; ".join(
            f"{st['blocks']}: {gib(st['peak_bytes'])}, {st['held']}, {st['plan']}" for st in e["stages"]))
    h = e["host"]
    lines.append(f"host: {h['micro_s'] * 1e3:.1f} ms per micro-batch "
                 + ("measured (--calibration)" if h["measured"] else f"assumed ({e['assumptions']['op_overhead_s'] * 1e6:g} "
                    f"us per operator)")
                 + f" against the device's {h['device_micro_s'] * 1e3:.1f} ms: "
                 + (f"HOST-BOUND; micro-batch {h['saturating_micro_batch']} would keep the device busy" if h["bound"]
                    else f"the device is the bound (it stays busy from micro-batch {h['saturating_micro_batch']})"))
    off = e["offload"]
    if off["optimizer"] or off["params"]:
        what = " and ".join(w for w, on in (("optimizer states", off["optimizer"]), ("weights", off["params"])) if on)
        lines.append(f"ZeRO-Offload: {what} in host memory, {gib(off['host_bytes_per_rank'])} GiB per rank, "
                     f"{gib(off['host_bytes_per_node'])} GiB per node; {off['pcie_bytes_per_step_per_rank'] / 1e9:.2f} "
                     f"GB per rank over PCIe at {e['assumptions']['host_gbs']:g} GB/s and the host's Adam "
                     f"{off['host_adam_s'] * 1e3:.1f} ms per step")
    return "\n".join(lines)


def tp_candidates(text: str, flag: str = "--tp_sizes"):
    """--tp_sizes (or --sp_sizes) as a list of sizes (None: the search's default)."""
    if not text:
        return None
    try:
        sizes = sorted({int(t) for t in text.split(",")})
    except ValueError:
        sizes = [0]
    if sizes[0] < 1:
        raise ConfigError(f"{flag} takes positive integers, comma-separated; got '{text}'")
    return sizes


def by_size(found: list, key: str, what: str, allow_quantized: bool = False, extra=lambda e: "") -> str:
    """The pick (`pick`) of each size of `key` ("tp_size", "sp_size") searched, against the one without it;
    `extra(e)`: what a line adds after the peak."""
    short = key.split("_")[0]
    best = {n: pick([e for e in found if e[key] == n], allow_quantized) for n in {e[key] for e in found}}
    if len(best) < 2:
        return ""
    lines = ["", "", f"the fastest of each {what} size:"]
    plain = best.get(1)
    for n, e in sorted(best.items()):
        against = f", {e['images_per_s'] / plain['images_per_s']:.2f}x {short} 1's" if plain and n > 1 else ""
        lines.append(f"  {short} {n}: {sharding(e)}, micro-batch {e['micro_batch_size']} x "
                     f"{e['grad_accum_steps']}, ac {e['ac']}: {e['step_s']:.3f} s a step, {e['images_per_s']:.0f} "
                     f"images/s, peak {gib(e['peak_bytes'])} GiB{extra(e)}{against}")
    return "\n".join(lines)


def by_sp_size(found: list, allow_quantized: bool = False) -> str:
    return by_size(found, "sp_size", "sequence-parallel", allow_quantized,
                   lambda e: f", all-to-alls {e['sp_comm_s'] * 1e3:.0f} ms")


def by_pp_size(found: list, allow_quantized: bool = False) -> str:
    return by_size(found, "pp_size", "pipeline", allow_quantized,
                   lambda e: f", bubble {e['bubble']:.0%} of {e['pp_microbatches']} pieces, between stages "
                             f"{e['pp_comm_s'] * 1e3:.0f} ms" if e["pp_size"] > 1 else "")


def by_tp_size(found: list, allow_quantized: bool = False) -> str:
    return by_size([e for e in found if e["sp_size"] == 1 and e["pp_size"] == 1], "tp_size", "tensor-parallel",
                   allow_quantized)


def by_engine(found: list, allow_quantized: bool = False) -> str:
    """The pick (`pick`) of each engine searched, and where their step times differ most."""
    best = {name: pick([e for e in found if e["engine"] == name], allow_quantized)
            for name in dict.fromkeys(e["engine"] for e in found)}
    if len(best) < 2:
        return ""
    lines = ["", "", "the fastest of each engine:"]
    for name, e in best.items():
        lines.append(f"  {name}: {sharding(e)}, micro-batch {e['micro_batch_size']} x {e['grad_accum_steps']}, ac "
                     f"{e['ac']}: {e['step_s']:.3f} s a step ({e['compute_s']:.3f} compute, {e['comm_s']:.3f} "
                     f"communication of {e['comm_bytes_per_step_per_rank'] / 1e9:.2f} GB per rank), peak "
                     f"{gib(e['peak_bytes'])} GiB, {e['images_per_s']:.0f} images/s")
    ranked = sorted(best.items(), key=lambda kv: kv[1]["step_s"])
    (fast_name, fast), (slow_name, slow) = ranked[0], ranked[-1]  # the fastest engine against the slowest
    terms = {"compute": slow["compute_s"] - fast["compute_s"], "communication": slow["comm_s"] - fast["comm_s"],
             "tensor-parallel all-reduces": slow["tp_comm_s"] - fast["tp_comm_s"],
             "offload": slow["offload"]["offload_s"] - fast["offload"]["offload_s"]}
    why, gap = max(terms.items(), key=lambda kv: kv[1])
    if slow["step_s"] - fast["step_s"] < 1e-6:
        lines.append("  they are level: no engine's step is shorter here")
    else:
        lines.append(f"  {fast_name} is {slow['step_s'] / fast['step_s']:.2f}x faster than {slow_name}, mostly by {why} "
                     f"({gap * 1e3:.1f} ms shorter; the step {(slow['step_s'] - fast['step_s']) * 1e3:.1f} ms in all"
                     + (f"; its micro-batch {fast['micro_batch_size']} against {slow['micro_batch_size']}"
                        if fast["micro_batch_size"] != slow["micro_batch_size"] else "") + ")")
    return "\n".join(lines)


def pick(found: list, allow_quantized: bool = False) -> dict:
    """The fastest configuration, but one that changes the arithmetic (ZeRO++ quantized, offload's CPU Adam) only
    when allowed, or when nothing else fits."""
    plain = [e for e in found if allow_quantized or not e.get("numerics")]
    return (plain or found)[0]


def why(best: dict, found: list) -> str:
    """One line: what made `best` win over the next fastest configuration (the step's term that differs most), and
    what it passed over for changing the arithmetic."""
    lines = []
    faster = [e for e in found if e["step_s"] < best["step_s"] and e.get("numerics")]
    if faster:
        e = faster[0]
        lines.append(f"passed over: {sharding(e)} at {e['step_s']:.3f} s a step ({e['step_s'] / best['step_s'] - 1:+.1%}), "
                     f"which changes the arithmetic ({e['numerics']}); --allow_quantized picks it")
    others = [e for e in found if e is not best and not e.get("numerics")]
    if not others:
        return "\n".join(lines + ["why: the only configuration that fits"])
    e = others[0]
    terms = {"compute": e["compute_s"] - best["compute_s"], "communication": e["comm_s"] - best["comm_s"],
             "tensor-parallel all-reduces": e["tp_comm_s"] - best["tp_comm_s"],
             "offload": e["offload"]["offload_s"] - best["offload"]["offload_s"]}
    term, gap = max(terms.items(), key=lambda kv: kv[1])  # the term the winner saves most on
    runner = f"{sharding(e)}, micro-batch {e['micro_batch_size']} x {e['grad_accum_steps']}, ac {e['ac']}"
    if e["step_s"] - best["step_s"] < 1e-6:
        decided = (f"fewer accumulation steps decided ({best['grad_accum_steps']} against {e['grad_accum_steps']})"
                   if best["grad_accum_steps"] < e["grad_accum_steps"] else
                   f"the lower peak decided ({gib(best['peak_bytes'])} against {gib(e['peak_bytes'])} GiB)")
        lines.append(f"why: as fast as {runner}; {decided}")
    else:
        lines.append(f"why: {(e['step_s'] - best['step_s']) * 1e3:.1f} ms a step faster than the next, {runner}: "
                     f"its {term} is {gap * 1e3:.1f} ms shorter")
    return "\n".join(lines)


def table(found: list, top: int) -> str:
    sp = any(e["sp_size"] > 1 for e in found)  # the sequence-parallel columns when the search tried it
    pp = any(e["pp_size"] > 1 for e in found)  # the pipeline's
    rows = ["| # | engine (++: ZeRO++, off: offload; *: changes the arithmetic) | TP |" + (" SP |" if sp else "")
            + (" PP |" if pp else "")
            + " micro | accum | ac | peak GiB | step s | images/s | compute s | comm s | TP comm s |"
            + (" SP comm s |" if sp else "") + (" PP comm s |" if pp else ""), "|---" * (12 + 2 * sp + 2 * pp) + "|"]
    for i, e in enumerate(found[:top]):
        rows.append(f"| {i + 1} | {sharding(e)}{' *' if e.get('numerics') else ''} | {e['tp_size']} | "
                    + (f"{e['sp_size']} | " if sp else "") + (f"{e['pp_size']} | " if pp else "")
                    + f"{e['micro_batch_size']} | "
                    f"{e['grad_accum_steps']} | {e['ac']} | {gib(e['peak_bytes'])} | {e['step_s']:.3f} | "
                    f"{e['images_per_s']:.0f} | {e['compute_s']:.3f} | {e['comm_s']:.3f} | {e['tp_comm_s']:.3f} |"
                    + (f" {e['sp_comm_s']:.3f} |" if sp else "") + (f" {e.get('pp_comm_s', 0.0):.3f} |" if pp else ""))
    return "\n".join(rows)


def draw(estimates: list, path: str, title: str):
    """Stacked bars: each configuration's per-rank memory by part, its planned peak (the larger of the backward's
    and the optimizer step's), and the device's usable memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = list(estimates[0]["memory"])
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(estimates) + 1.5), 5.5))
    labels = [f"{sharding(e)}{f' TP{t}' if (t := e['tp_size']) > 1 else ''} "
              f"mb{e['micro_batch_size']}x{e['grad_accum_steps']}\n{e['ac']}" for e in estimates]
    bottom = [0.0] * len(estimates)
    for part in parts:
        heights = [e["memory"][part] / 2**30 for e in estimates]
        # the temporaries exist at the optimizer step, when the activations are freed: drawn apart, hatched
        later = part == "optimizer_step_temporaries"
        ax.bar(labels, heights, bottom=bottom, hatch="//" if later else None, alpha=0.5 if later else 1.0,
               label="optimizer step temporaries (at the step, activations freed)" if later else part.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.scatter(labels, [e["peak_bytes"] / 2**30 for e in estimates], marker="_", s=400, color="black", zorder=3,
               label="planned peak")
    ax.axhline(estimates[0]["capacity_bytes"] / 2**30, color="red", linestyle="--", label="usable device memory")
    ax.set_ylabel("GiB per rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plan(best: dict, cfg, out: str, a, searched: str = "") -> list[str]:
    """The plan as a recipe (config.yaml: train.py's keys) that composes with the keys a run adds: the
    optimizer, the schedule and the batch are train.py's keys, never baked into an engine config. A DeepSpeed
    template other than the stage's own (ZeRO++, offload) is copied beside it as it is, its optimizer, batch and
    precision fields "auto", which train.py fills. `searched`: the search's printed table and picks, kept as
    search.md (the docs render their worked plans from it). Returns the files written."""
    import shutil

    import yaml

    os.makedirs(out, exist_ok=True)
    defaults = to_dict(Config())
    keys = to_dict(cfg)
    written = ["config.yaml"]
    if cfg.ds_config:
        shutil.copy(cfg.ds_config, os.path.join(out, "ds_config.json"))
        keys["ds_config"] = os.path.join(out, "ds_config.json")
        written.append("ds_config.json")
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(f"# plan.py's best configuration for {a.world_size} x {best['device']} (plan.json: the estimate).\n"
                f"# Add train_shards, val_shards, output_dir and the schedule (lr, epochs or max_steps, ...) of your "
                f"run,\n# here or on the command line: train.py fills the engine's config from them.\n")
        planned = {"model", "num_labels", "image_size", "precision", "engine", "zero_stage", "replicate_degree",
                   "tp_size", "micro_batch_size", "grad_accum_steps", "ac"}  # written even where they are defaults
        yaml.safe_dump({k: v for k, v in keys.items() if v != defaults[k] or k in planned}, f, sort_keys=False)
    with open(os.path.join(out, "plan.json"), "w") as f:
        json.dump(best, f, indent=1)
    if searched:
        with open(os.path.join(out, "search.md"), "w") as f:
            f.write(searched + "\n")
        written.append("search.md")
    nodes = math.ceil(a.world_size / a.ranks_per_node)
    with open(os.path.join(out, "launch.sh"), "w") as f:
        f.write("#!/bin/bash\n# one line per node (NODE_RANK 0..{n}); MASTER_ADDR: node 0's address\n".format(n=nodes - 1)
                + f"torchrun --nnodes {nodes} --nproc_per_node {a.ranks_per_node} --node_rank $NODE_RANK "
                  f"--master_addr $MASTER_ADDR --master_port 29500 train.py --config {out}/config.yaml \"$@\"\n")
    return written + ["plan.json", "launch.sh"]


def run_calibration(cfg, precision: str, out: str, host: bool = True, host_stages=(1, 2, 3),
                    host_rounds: int = 3) -> int:
    """--calibrate: every rank of the launch (a one-rank group without a launcher) measures at once; rank 0
    writes the slowest rank's figures. Needs the device it calibrates: a GPU for bf16 plans, the CPU for fp32
    ones."""
    import torch
    import torch.distributed as dist

    from loop.distributed import exit_distributed, free_port, init_distributed
    from planner.calibration import calibrate, slowest

    if precision != "fp32" and not torch.cuda.is_available():
        raise ConfigError(f"calibrating {precision} needs the GPU it would run on; on CPU, calibrate fp32")
    if "WORLD_SIZE" not in os.environ:  # the host probe runs the engine, which needs a process group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    device = init_distributed(int(os.environ.get("LOCAL_RANK", 0)))
    from tqdm import tqdm

    quiet = dist.get_rank() != 0
    bars = {}

    def progress_of(desc: str, unit: str):
        def progress(done: int, total: int):
            bar = bars.get(desc) or bars.setdefault(desc, tqdm(desc=desc, unit=unit, total=total, disable=quiet))
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
        return progress
    mine = calibrate(cfg, precision, device, progress_of(f"replaying {cfg.model}'s operators", "op"), host=host,
                     host_progress=progress_of(f"probing the host (2 depths x ZeRO {'/'.join(map(str, host_stages))} x "
                                               f"3 policies x {host_rounds} rounds)", "run"), host_stages=host_stages,
                     host_rounds=host_rounds)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        result = slowest(per_rank)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{cfg.model} micro-batch {cfg.micro_batch_size} {precision} on {result['ranks']} x {result['device']}: "
              f"operators {result['flops_per_s'] / 1e9:.1f} GFLOP/s and {result['bytes_per_s'] / 1e9:.1f} GB/s, "
              f"streaming {result['stream_gbs']:.1f} GB/s, all-gather {result['comm_gbs']:.2f} GB/s per rank"
              + (f"; {len(result['failed_ops'])} operators did not replay" if result["failed_ops"] else "")
              + (f"; host per block (ZeRO-{max(int(s) for s in result['host']['stages'])}, none) "
                 f"{host_block_ms(result['host']):.1f} ms" if result["host"] else "")
              + f": {out}")
    exit_distributed(0)


def host_block_ms(host: dict) -> float:
    from planner.host import host_seconds

    stage = max(int(s) for s in host["stages"])
    return 1e3 * host_seconds(host, stage, ["none"], serial=False)["per_block_s"]["none"]


def load_calibration(path: str, cfg, precision: str) -> dict:
    from planner.calibration import CALIBRATION_KEYS

    try:
        with open(path) as f:
            calibration = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the calibration {path}: {e}") from None
    want = {**{k: getattr(cfg, k) for k in CALIBRATION_KEYS}, "precision": precision}
    differ = [f"{k} {calibration.get(k)} (not {v})" for k, v in want.items() if calibration.get(k) != v]
    if differ:
        raise ConfigError(f"{path} calibrated another configuration: {', '.join(differ)}")
    return calibration


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():  # DeepSpeed's CPU accelerator, named: it would print that it guessed it
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    a, rest = cluster_args(argv)
    try:
        from engine.registry import check_engine, engine_class
        from planner.calibration import calibrated
        from planner.devices import DEFAULT_MBU, DEFAULT_MFU, DEVICES
        from planner.estimate import estimate
        from planner.search import search, smallest_cluster
        from parallel.tensor import check_tp
        from models.registry import model_config, width

        if a.list_devices:
            for d in DEVICES.values():
                print(f"{d.name}: {d.flops / 1e12:g} TFLOP/s bf16 dense, {d.memory_gib:g} GiB, "
                      f"{d.intra_gbs:g} GB/s in a node, {d.inter_gbs:g} GB/s between nodes, {d.host_gbs:g} GB/s to "
                      f"the host, {d.host_memory_gib:g} GiB of host memory per node")
            return 0
        cfg = parse(rest)
        check_engine(cfg)
        if cfg.model_parallel > 1 and (a.calibrate or a.calibration):
            raise ConfigError("a calibration measures the model unsplit: calibrate and plan with it at tp_size, "
                              "sp_size and pp_size 1")
        precision = cfg.precision if cfg.precision != "auto" else ("bf16" if a.device != "cpu" else "fp32")
        if a.calibrate:
            stages = [s.strip() for s in a.host_stages.split(",")]
            if set(stages) - {"1", "2", "3"}:
                raise ConfigError(f"--host_stages takes ZeRO stages 1, 2 and 3, comma-separated; got '{a.host_stages}'")
            if a.host_rounds < 1:
                raise ConfigError(f"--host_rounds must be at least 1; got {a.host_rounds}")
            return run_calibration(cfg, precision, a.calibrate, host=not a.no_host_probe,
                                   host_stages=tuple(sorted({int(s) for s in stages})), host_rounds=a.host_rounds)
        device = device_of(a)
        if a.world_size < 1 or a.ranks_per_node < 1:
            raise ConfigError("world_size and ranks_per_node must be at least 1")
        hidden = width(model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size))
        def ds_for(c):  # the engine config of a candidate
            return engine_class(c.engine).engine_config(c, hidden, a.world_size, precision, a.ranks_per_node,
                                                        gpu=a.device != "cpu")
        mfu, mbu, rates = a.mfu or DEFAULT_MFU, a.mbu or DEFAULT_MBU, None
        if a.calibration:  # one micro-batch's rates: a search with them tries only that micro-batch
            device, rates = calibrated(device, load_calibration(a.calibration, cfg, precision))
            mbu = 1.0  # measured
        if a.global_batch:
            # both engines, unless --engine names one
            engines = [cfg.engine] if any(x == "--engine" or x.startswith("--engine=") for x in rest) else None
            found = search(cfg, ds_for, precision, a.world_size, a.ranks_per_node, device, a.global_batch, mfu,
                           a.overlap, mbu=mbu, rates=rates, tp=tp_candidates(a.tp_sizes, "--tp_sizes"),
                           sp=tp_candidates(a.sp_sizes, "--sp_sizes"), pp=tp_candidates(a.pp_sizes, "--pp_sizes"),
                           engines=engines)
            if not found:
                smallest, with_offload = smallest_cluster(cfg, ds_for, precision, a.ranks_per_node, device)
                raise ConfigError(
                    f"no configuration of {cfg.model} fits {a.world_size} x {device.name} "
                    f"({device.memory_gib:g} GiB) at global batch {a.global_batch}: " + (
                        f"the smallest cluster on which it fits at all (ZeRO-3{' with ZeRO-Offload' if with_offload else ''}, "
                        f"full recompute, micro-batch 1) is {smallest} ranks" if smallest
                        else "it does not fit on any cluster up to 2^20 ranks"))
            best = pick(found, a.allow_quantized)
            if a.json:
                print(json.dumps({"best": best, "feasible": found[:a.top], "count": len(found)}, indent=1))
            searched = (f"{len(found)} configurations fit; the fastest {min(a.top, len(found))}:\n{table(found, a.top)}"
                        f"{by_tp_size(found, a.allow_quantized)}{by_sp_size(found, a.allow_quantized)}"
                        f"{by_pp_size(found, a.allow_quantized)}"
                        f"{by_engine(found, a.allow_quantized)}\n\nbest:\n"
                        f"{describe(best)}\n{why(best, found)}")
            if not a.json:
                print(searched)
            if a.picture:
                draw(found[:a.top], a.picture, f"{cfg.model}, {a.world_size} x {device.name}, global batch "
                                               f"{a.global_batch}: the {min(a.top, len(found))} fastest that fit")
            if a.out:
                chosen = replace(cfg, engine=best["engine"], zero_stage=best["zero_stage"], tp_size=best["tp_size"],
                                 sp_size=best["sp_size"], pp_size=best["pp_size"],
                                 pp_microbatches=best.get("pp_microbatches", 0), pp_split=best.get("pp_split", ""),
                                 replicate_degree=best["replicate_degree"],
                                 micro_batch_size=best["micro_batch_size"],
                                 grad_accum_steps=best["grad_accum_steps"], ac=best["ac"], precision=precision,
                                 ds_config=best["ds_config_template"])
                written = write_plan(best, chosen, a.out, a, f"python plan.py {shlex.join(argv)}\n\n{searched}")
                if not a.json:
                    print(f"written: {', '.join(os.path.join(a.out, w) for w in written)}")
            return 0
        check_tp(model_config(cfg.model, cfg.num_labels, cfg.image_size, cfg.patch_size), cfg.tp_size, a.world_size,
                 a.ranks_per_node)
        e = estimate(cfg, ds_for(cfg), precision, a.world_size, a.ranks_per_node, device, mfu, a.overlap,
                     mbu=mbu, rates=rates)
        print(json.dumps(e, indent=1) if a.json else describe(e))
        if a.picture:
            draw([e], a.picture, f"{cfg.model}, {a.world_size} x {device.name}")
        return 0 if e["fits"] else 1
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
