"""The digits end to end for the tasks beyond classification: MAE pretraining then fine-tuning of its encoder,
against the same fine-tuning from random weights, SimMIM pretraining of a Swin, and the segmentation default
(UperNet over a Swin) with SegFormer-B0 on the same recipe, each trained to the end on 2 CPU ranks with its
recipe in configs/.

    .venv/bin/python -m benchmarks.digits_tasks              # ~20 min on 2 cores
    .venv/bin/python -m benchmarks.digits_tasks --report_only

Runs are `train.py` itself under torchrun, in a temporary directory. Writes benchmarks/results/digits-tasks/:
runs.jsonl (each run's evaluations and summary), results.md and curves.png (MAE's and SimMIM's val loss; val
top-1 of the fine-tuning from MAE and from random weights; each segmentation's val mIoU and pixel accuracy).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from launch.job import run as launch_train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results", "digits-tasks")


def torchrun(recipe: str, out: str, *overrides) -> dict:
    """One run of `recipe` on 2 ranks into `out`: its evaluations (step, metrics) and summary.json."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)), PYTHONWARNINGS="ignore")
    print(" ".join(["train.py", "--config", recipe, *overrides]), flush=True)
    done = launch_train(list(overrides), nproc=2, env=env, config=recipe, output_dir=out, progress=False)
    if not done.ok:
        raise RuntimeError(f"{recipe} failed:\n{done.output[-3000:]}")
    records = done.metrics
    evals = [{k: v for k, v in r.items() if k == "step" or k.startswith("val_")} for r in records
             if any(k.startswith("val_") for k in r)]
    summary = dict(done.summary)
    summary.pop("confusion", None)
    return {"recipe": recipe, "overrides": list(overrides), "evals": evals, "summary": summary,
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]}


def run_all(tmp: str) -> list:
    for name in ("digits", "digits-seg"):  # the recipes' shards, as `make data` writes them
        if not os.path.isfile(os.path.join(REPO, "data", name, "_info.json")):
            subprocess.run([sys.executable, "data/make_shards.py", name, os.path.join("data", name)], cwd=REPO,
                           check=True)
    mae = os.path.join(tmp, "mae")
    runs = [dict(torchrun("configs/digits-mae.yaml", mae), label="MAE pretraining")]
    runs.append(dict(torchrun("configs/digits-mae-finetune.yaml", os.path.join(tmp, "ft"), "--model",
                              os.path.join(mae, "encoder")), label="fine-tuned from the MAE encoder"))
    runs.append(dict(torchrun("configs/digits-mae-finetune.yaml", os.path.join(tmp, "scratch"), "--model",
                              "vit-digits"), label="the same fine-tuning from random weights"))
    runs.append(dict(torchrun("configs/digits-simmim.yaml", os.path.join(tmp, "simmim")),
                     label="SimMIM pretraining"))
    runs.append(dict(torchrun("configs/digits-segmentation.yaml", os.path.join(tmp, "seg")),
                     label="segmentation (UperNet over swin-digits)"))
    runs.append(dict(torchrun("configs/digits-segmentation.yaml", os.path.join(tmp, "segformer"), "--model",
                              "segformer-b0"), label="segmentation (SegFormer-B0)"))
    return runs


def report(runs: list, when: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["label"]: r for r in runs}
    mae, ft, scratch, seg = (by[k] for k in ("MAE pretraining", "fine-tuned from the MAE encoder",
                                             "the same fine-tuning from random weights",
                                             "segmentation (UperNet over swin-digits)"))
    simmim = by.get("SimMIM pretraining")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot([e["step"] for e in mae["evals"]], [e["val_loss"] for e in mae["evals"]], "o-",
                 label="MAE (MSE, normalised pixels)")
    if simmim:
        axes[0].plot([e["step"] for e in simmim["evals"]], [e["val_loss"] for e in simmim["evals"]], "s--",
                     label="SimMIM (L1, raw pixels)")
    axes[0].set(title="pretraining (digits-mae, digits-simmim)", xlabel="step", ylabel="val loss (masked patches)")
    axes[0].legend(fontsize=8)
    for run, style in ((ft, "o-"), (scratch, "s--")):
        axes[1].plot([e["step"] for e in run["evals"]], [100 * e["val_top1"] for e in run["evals"]], style,
                     label=run["label"])
    axes[1].set(title="fine-tuning (configs/digits-mae-finetune.yaml)", xlabel="step", ylabel="val top-1 (%)")
    axes[1].legend(fontsize=8)
    segformer = by.get("segmentation (SegFormer-B0)")
    for run, name in ((seg, "UperNet"), (segformer, "SegFormer-B0")):
        for key, style in (("val_miou", "o-"), ("val_pixel_acc", "s--")):
            if run:
                axes[2].plot([e["step"] for e in run["evals"]], [100 * e[key] for e in run["evals"]], style,
                             label=f"{name} {key[4:]}")
    axes[2].set(title="segmentation (configs/digits-segmentation.yaml)", xlabel="step", ylabel="%")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "curves.png"), dpi=90)

    def minutes(run):
        return f"{run['summary']['seconds_this_launch'] / 60:.1f}"

    lines = [f"# The digits end to end: pretraining, fine-tuning, segmentation ({when})", "",
             "2 CPU ranks (torchrun), fp32, each run its recipe in configs/ trained to the end; "
             "`python -m benchmarks.digits_tasks`. One seed each: the figures show that each task trains end to end, "
             "not a seed-averaged comparison.", "",
             "| run | steps | result | minutes |", "|---|---|---|---|",
             f"| {mae['label']} | {mae['summary']['step']} | val loss {mae['evals'][0]['val_loss']:.4f} at step "
             f"{mae['evals'][0]['step']} -> {mae['summary']['val_loss']:.4f} (train loss {mae['first_loss']:.4f} "
             f"at step 1) | {minutes(mae)} |"]
    if simmim:
        first, last = simmim["evals"][0], simmim["summary"]
        lines.append(f"| {simmim['label']} | {last['step']} | val loss {first['val_loss']:.4f} at step "
                     f"{first['step']} -> {last['val_loss']:.4f} (train loss {simmim['first_loss']:.4f} at step 1) | "
                     f"{minutes(simmim)} |")
    for run in (ft, scratch):
        lines.append(f"| {run['label']} | {run['summary']['step']} | val top-1 {run['summary']['val_top1']:.2%} "
                     f"(at step {run['evals'][0]['step']}: {run['evals'][0]['val_top1']:.2%}) | {minutes(run)} |")
    for run in (seg, segformer) if segformer else (seg,):
        lines.append(f"| {run['label']} | {run['summary']['step']} | val mIoU {run['summary']['val_miou']:.2%}, "
                     f"pixel accuracy {run['summary']['val_pixel_acc']:.2%} | {minutes(run)} |")
    lines += ["", "![curves](curves.png)", ""]
    with open(os.path.join(OUT, "results.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report_only", action="store_true", help="rewrite results.md and curves.png from runs.jsonl")
    args = ap.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "runs.jsonl")
    if not args.report_only:
        with tempfile.TemporaryDirectory() as tmp:
            runs = run_all(tmp)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in runs)
    with open(path) as f:
        runs = [json.loads(line) for line in f]
    report(runs, datetime.date.fromtimestamp(os.path.getmtime(path)).isoformat())


if __name__ == "__main__":
    main()
