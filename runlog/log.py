"""What a run records, in one object: the run directory's files (config.yaml, the engine's config: ds_config.json,
fsdp2_config.json or ddp_config.json; ac_plan.json, hf_config/), metrics.jsonl, the trackers `report_to` names (TensorBoard's scalars, text and pictures; MLflow's
and W&B's runs: runlog/tracking.py), the progress bar and summary.json.

Rank 0 writes; on every other rank each method does nothing, so the training loop calls them unconditionally.
"""
import json
import math
import os
import sys

import yaml

from config import Config, to_dict
import compat
from runlog import tracking


def _record_step(line: str) -> float:
    """The step of a metrics.jsonl line; infinity for a blank or cut-off one (a kill mid-write), which is dropped."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


class RunLog:
    def __init__(self, cfg: Config, rank: int, start_step: int, engine_config: tuple[str, dict], ac_plan: dict, module,
                 processor, flush_logs: list, tags: dict):
        """Writes the run's description into `cfg.output_dir` and opens its logs, continuing them at `start_step`
        (records past it, from a run that went further before it was resumed, are dropped). `engine_config`: (its
        file name, the engine's resolved config). The logs' flushes
        join `flush_logs`, which a failing rank runs before it exits. `tags`: what the trackers file the run
        under (engine, world size, commit...)."""
        from tqdm import tqdm

        self.on, self.cfg = rank == 0, cfg
        labelled = cfg.task in ("classification", "segmentation")
        self.labels = [module.config.id2label[i] for i in range(cfg.num_labels)] if labelled else []
        self.bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not self.on or not cfg.progress,
                        dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)
        self.tb, self.trackers = None, []
        if not self.on:
            return
        out = cfg.output_dir
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        config_file, config = engine_config
        with open(os.path.join(out, config_file), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(out, "ac_plan.json"), "w") as f:
            json.dump(ac_plan, f, indent=1)
        module.config.architectures = [compat.model_class(module).__name__]  # as save_pretrained records it
        module.config.save_pretrained(os.path.join(out, "hf_config"))  # for export.py
        processor.save_pretrained(os.path.join(out, "hf_config"))
        metrics_path = os.path.join(out, "metrics.jsonl")
        kept = []
        if os.path.exists(metrics_path):  # drop records past the checkpoint we resumed from
            with open(metrics_path) as f:
                kept = [line for line in f if _record_step(line) <= start_step]
            with open(metrics_path, "w") as f:
                f.writelines(kept)
        self.metrics = open(metrics_path, "a")
        flush_logs.append(self.metrics.flush)
        if "tensorboard" in tracking.chosen(cfg):
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(out, "tb"), purge_step=start_step + 1)
            flush_logs.append(self.tb.flush)
            # what the run is, beside its scalars: the config and the checkpointing plan
            self.tb.add_text("config", "```\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False) + "```", start_step)
        params = {k: str(v) for k, v in to_dict(cfg).items()}
        self.trackers = tracking.open_trackers(cfg, bool(cfg.resume), params, tags, self.warn,
                                               [json.loads(line) for line in kept])
        flush_logs.append(lambda: self.close_trackers("FAILED", seconds=5.0))  # a failing rank's run says so
        self._files([os.path.join(out, name) for name in ("config.yaml", config_file, "ac_plan.json")])
        from runlog import figures  # matplotlib: on the writing rank only

        self._figure("ac/plan", figures.ac_plan(ac_plan), start_step)

    def _figure(self, key: str, fig, step: int):
        """A picture in TensorBoard and each tracker (rendered once), then closed."""
        if self.trackers:
            png = tracking.figure_png(fig)
            for tracker in self.trackers:
                tracker.image(key, step, png)
        if self.tb is not None:
            self.tb.add_figure(key, fig, step)  # closes it
        else:
            import matplotlib.pyplot as plt

            plt.close(fig)

    def _files(self, paths: list[str], folder: str = ""):
        for tracker in self.trackers:
            tracker.files(paths, folder)

    def record(self, record: dict):
        """One step's metrics: a metrics.jsonl line (non-finite values as null) and a TensorBoard scalar each."""
        if not self.on:
            return
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        step = record["step"]
        values = {key: value for key, value in record.items() if key != "step" and value is not None}
        if self.tb is not None:
            for key, value in values.items():
                tag = key if "/" in key else ("val/" if key.startswith("val_") else "train/") + key
                self.tb.add_scalar(tag, value, step)
        for tracker in self.trackers:  # under metrics.jsonl's names
            tracker.metrics(step, values)

    def evaluation(self, step: int, result, ema_result=None):
        """An evaluation's line above the bar, and a classifier's prediction grid and confusion matrix in
        TensorBoard."""
        if not self.on:
            return
        self.bar.write(f"step {step}: val {result.describe()}" + (
            f" | EMA {ema_result.describe()}" if ema_result else ""))
        if self.tb is None and not self.trackers:  # report_to none: no picture is drawn
            return
        from runlog import figures

        if result.shown is not None and self.cfg.task == "segmentation":
            from data.loader import IGNORE_INDEX

            self._figure("val/masks", figures.segmentation(*result.shown, self.labels, IGNORE_INDEX), step)
        elif result.shown is not None:
            self._figure("val/predictions", figures.predictions(*result.shown, self.labels), step)
        if result.confusion is not None:
            self._figure("val/confusion", figures.confusion(result.confusion.numpy(), self.labels), step)

    def progress(self, loss: float, images_per_sec: float):
        self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{images_per_sec:.0f}", refresh=False)
        self.bar.update()

    def warn(self, line: str):
        """A line on stderr above the progress bar (rank 0; the trackers' sender threads too)."""
        if self.on:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)

    def write(self, line: str):
        """A line printed above the progress bar (rank 0)."""
        if self.on:
            self.bar.write(line)

    def end_progress(self):
        self.bar.close()

    def model(self, hf_dir: str):
        """With log_model, the exported model's folder to every tracker."""
        if self.on and self.cfg.log_model:
            self._files([hf_dir])

    def close_trackers(self, status: str, seconds: float = tracking.CLOSE_SECONDS):
        """Ends each tracker's run with `status` (FINISHED, FAILED, KILLED), first sending what it holds; what
        could not be sent is listed."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                left = tracker.close(status, seconds)
            except Exception as e:  # noqa: BLE001 - a tracker never fails the run
                left = [f"the end of the run ({tracking.first_line(e)})"]
            if left:
                self.warn(f"warning: {tracker.name}: not sent ({len(left)}): " + "; ".join(left[:20])
                           + ("; ..." if len(left) > 20 else "") + " (metrics.jsonl holds every metric)")

    def close(self, status: str = "FINISHED"):
        self.bar.close()
        if self.on:
            self.metrics.close()
            if self.tb is not None:
                self.tb.close()
            self.close_trackers(status)

    def summary(self, summary: dict, line: str):
        """summary.json and the run's last line."""
        if not self.on:
            return
        with open(os.path.join(self.cfg.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(line)
