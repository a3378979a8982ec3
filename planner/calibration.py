"""The rates a plan takes from the device it runs on, measured (planner/replay.py): the model's own operators'
FLOP rate and bandwidth at its micro-batch, a streaming add's bandwidth, the all-gather bandwidth, and the
engine's host seconds per block and per step (planner/host.py)."""
import sys
from dataclasses import replace

import torch

from config import Config
import compat
from engine.ds_config import DTYPES
from models.tasks import meta_model
from planner.devices import Device


CALIBRATION_KEYS = ("model", "image_size", "patch_size", "micro_batch_size", "precision")
CALIBRATION_RATES = ("flops_per_s", "bytes_per_s", "stream_gbs", "comm_gbs")  # the rates a plan takes from it


def calibrate(cfg: Config, precision: str, device: torch.device, progress=None, host: bool = True,
              host_progress=None, host_stages=(1, 2, 3), host_rounds: int = 3) -> dict:
    """What this rank measures for a plan of `cfg` (planner/replay.py): the FLOP rate and bandwidth the model's own
    operators reach at its micro-batch, forward and backward; a streaming add's bandwidth (the optimizer's); in a
    process group, the all-gather bandwidth between its ranks; and, with `host` (in a process group), the
    engine's host seconds per block and per step under the ZeRO stages `host_stages`, each the median of
    `host_rounds` rounds (planner/host.py). Under torchrun every rank measures at once, sharing the node as a
    run's ranks do."""
    import torch.distributed as dist

    from planner.host import probe
    from planner.replay import collective_gbs, record, replay, stream_gbs

    dtype = DTYPES[precision]
    model = meta_model(cfg).to(dtype)
    images = torch.empty(cfg.micro_batch_size, 3, cfg.image_size, cfg.image_size, device="meta", dtype=dtype)
    with compat.sdpa_as_on(device.type):
        counts = record(model, images)
    ops = replay(counts, device, progress=progress)
    probed, failed = None, None
    if host and dist.is_initialized():
        try:
            probed = probe(cfg, precision, device, dist.get_world_size(), stages=host_stages, progress=host_progress,
                           rounds=host_rounds)
        except Exception as e:  # the rates stand without it: a plan then assumes the host (planner/estimate.py)
            failed = f"{type(e).__name__}: {e}"
            print(f"warning: the host probe failed, the calibration has none: {failed}", file=sys.stderr)
    return {**{k: getattr(cfg, k) for k in CALIBRATION_KEYS}, "precision": precision, "device": device.type,
            "threads": torch.get_num_threads(), "flops_per_s": ops.flops_per_s, "bytes_per_s": ops.bytes_per_s,
            "stream_gbs": stream_gbs(device), "comm_gbs": collective_gbs(device), "distinct_ops": ops.distinct_ops,
            "replay_seconds": {"compute_forward": ops.compute_forward_s, "compute_backward": ops.compute_backward_s,
                               "memory_forward": ops.memory_forward_s, "memory_backward": ops.memory_backward_s},
            "failed_ops": list(ops.failed), "host": probed, "host_error": failed}


def slowest(per_rank: list) -> dict:
    """One calibration from every rank's (a step waits for the slowest rank at every collective): the replay of
    the rank that took longest, the lowest streaming and all-gather bandwidths, and each rank's figures."""
    from planner.host import slowest_host

    slow = max(per_rank, key=lambda r: sum(r["replay_seconds"].values()))
    host = slowest_host([r["host"] for r in per_rank]) if all(r.get("host") for r in per_rank) else None
    return {**slow, **{k: min(r[k] for r in per_rank) for k in ("stream_gbs", "comm_gbs")}, "host": host,
            "ranks": len(per_rank),
            "per_rank": [{k: r.get(k) for k in (*CALIBRATION_RATES, "replay_seconds", "host")} for r in per_rank]}


def median_calibration(samples: list) -> dict:
    """One calibration from several of the same shape, measured at different times (a suite's repeats): the
    sample whose replay took the median time, whole (its rates belong together), with every sample's rates."""
    ranked = sorted(samples, key=lambda c: sum(c["replay_seconds"].values()))
    host = next((c["host"] for c in samples if c.get("host")), None)  # a suite probes the host once
    return {**ranked[(len(ranked) - 1) // 2], "host": host,
            "samples": [{k: c[k] for k in CALIBRATION_RATES} for c in samples]}


def calibrated(device: Device, calibration: dict) -> tuple[Device, dict]:
    """(the device with the calibration's measured bandwidths, the model's operator rates and the host probe
    for estimate())."""
    device = replace(device, mem_gbs=calibration["stream_gbs"],
                     intra_gbs=calibration["comm_gbs"] or device.intra_gbs)
    return device, {**{k: calibration[k] for k in ("flops_per_s", "bytes_per_s")}, "host": calibration.get("host")}
