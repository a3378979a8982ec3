"""Scaling laws on the digits: a grid of ViT sizes (width x depth) trained for several step budgets, the laws
fitted, and checked held-out.

    .venv/bin/python -m benchmarks.scaling                     # ~25 min on 2 cores: 18 runs, 2 at a time
    .venv/bin/python -m benchmarks.scaling --report_only       # refit and redraw from runs.jsonl

Each run is `train.py` on one rank (two runs at a time on 2 cores) with the recipe's keys, a generated size
(`vit-w<W>-d<D>`, models/registry.py) and `max_steps` (its cosine schedule ends there, as the Chinchilla runs'
do). A run records its parameters N, images seen D, training FLOPs C (the planner's forward FLOPs per image,
`plan.py --json`, x3 for the backward, x D) and final val error E = 1 - val top-1. Then:

- the saturating power law of Zhai et al. (2022) on the compute frontier: E(C) = a (C + d)^-b + c;
- the two-term law of Hoffmann et al. (2022) over every run: E(N, D) = e + A / N^alpha + B / D^beta;

both fitted with a robust loss (scipy's least_squares, soft L1) on log error from several starting points, with
95% bootstrap intervals over the runs. Held out: the largest model's runs (two-term law) and the run of largest
compute (frontier law) are left out of the fits, and their errors predicted; a prediction whose interval holds
the measured error is met. The two-term law then sizes a model for a compute budget (the compute-optimal N and
D). Writes benchmarks/results/scaling/: runs.jsonl, report.md, scaling.png.
"""
import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from launch.job import run as launch_train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results", "scaling")
RECIPE = "configs/digits-vit.yaml"
SIZES = ("vit-w32-d2", "vit-w32-d4", "vit-w64-d2", "vit-w64-d4", "vit-w64-d6", "vit-w128-d4")
STEPS = (150, 300, 600)
MICRO_BATCH = 32  # one rank: a step is 32 images
BOOTSTRAP = 200


# ---------------------------------------------------------------------------------------------------- the laws
def frontier_law(c, a, b, cc, d):
    """Zhai et al.'s saturating power law in compute."""
    return a * (c + d) ** (-b) + cc


def two_term_law(n, d, e, a, alpha, b, beta):
    """Hoffmann et al.'s law in parameters and data."""
    return e + a / n ** alpha + b / d ** beta


def _robust_fit(residual, starts, bounds):
    """The least-squares fit (soft L1 on the residuals) of the best of several starting points."""
    from scipy.optimize import least_squares

    best = None
    for x0 in starts:
        try:
            r = least_squares(residual, x0, bounds=bounds, loss="soft_l1", f_scale=0.1, max_nfev=5000)
        except ValueError:
            continue
        if r.success and (best is None or r.cost < best.cost):
            best = r
    if best is None:
        raise RuntimeError("no starting point converged")
    return best.x


def fit_frontier(c: np.ndarray, err: np.ndarray) -> np.ndarray:
    """(a, b, c, d) of E = a (C + d)^-b + c on log error; C in units of its smallest value (well-scaled)."""
    scale = c.min()
    x = c / scale

    def residual(p):
        return np.log(frontier_law(x, *p)) - np.log(err)

    lo_err = float(err.min())
    starts = [(a, b, cc * lo_err, d) for a in (0.5, 2.0) for b in (0.2, 0.6, 1.2) for cc in (0.0, 0.5)
              for d in (0.0, 1.0)]
    a, b, cc, d = _robust_fit(residual, starts, ([1e-6, 1e-3, 0.0, 0.0], [1e3, 4.0, lo_err, 1e3]))
    # back to C's own units: a (C/s + d)^-b = a s^b (C + d s)^-b
    return np.array([a * scale ** b, b, cc, d * scale])


def fit_two_term(n: np.ndarray, d: np.ndarray, err: np.ndarray) -> np.ndarray:
    """(e, A, alpha, B, beta) of E = e + A/N^alpha + B/D^beta on log error (N and D scaled by their smallest)."""
    sn, sd = n.min(), d.min()
    xn, xd = n / sn, d / sd

    def residual(p):
        return np.log(two_term_law(xn, xd, *p)) - np.log(err)

    lo_err = float(err.min())
    starts = [(e * lo_err, a, al, a, be) for e in (0.0, 0.5) for a in (0.1, 1.0) for al in (0.3, 1.0)
              for be in (0.3, 1.0)]
    e, a, al, b, be = _robust_fit(residual, starts, ([0.0, 0.0, 0.0, 0.0, 0.0], [lo_err, 1e3, 3.0, 1e3, 3.0]))
    return np.array([e, a * sn ** al, al, b * sd ** be, be])


def bootstrap(fit, predict, arrays: tuple, seed: int = 0, resamples: int = BOOTSTRAP):
    """The 2.5% and 97.5% percentiles of `predict(fit(resampled arrays))` over runs resampled with replacement
    (a resample whose fit fails is skipped and counted)."""
    rng = np.random.default_rng(seed)
    k = len(arrays[0])
    values, failed = [], 0
    for _ in range(resamples):
        pick = rng.integers(0, k, k)
        if len(set(pick.tolist())) < 4:
            failed += 1
            continue
        try:
            values.append(predict(fit(*(a[pick] for a in arrays))))
        except RuntimeError:
            failed += 1
    values = np.array(values)
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5)), failed


def compute_frontier(runs: list) -> list:
    """The runs no cheaper run beats: sorted by compute, each with a lower error than every cheaper one."""
    out, best = [], math.inf
    for r in sorted(runs, key=lambda r: r["flops"]):
        if r["error"] < best:
            out.append(r)
            best = r["error"]
    return out


OPTIMAL_RANGE = (1e3, 1e12)  # parameters the compute-optimal search spans


def compute_optimal(params: np.ndarray, budget: float, flops_per_param_image: float) -> tuple[float, float]:
    """(N, D) minimising the two-term law at training compute `budget`, with C = k N D (N at an end of
    OPTIMAL_RANGE: the law has no interior optimum there)."""
    ns = np.logspace(math.log10(OPTIMAL_RANGE[0]), math.log10(OPTIMAL_RANGE[1]), 4000)
    ds = budget / (flops_per_param_image * ns)
    i = int(np.argmin(two_term_law(ns, ds, *params)))
    return float(ns[i]), float(ds[i])


# ---------------------------------------------------------------------------------------------------- the runs
def forward_flops(size: str, recipe: str = RECIPE) -> tuple[int, float]:
    """(parameters, forward FLOPs per image) of a size at the recipe's image size, from the planner."""
    cmd = [sys.executable, "plan.py", "--config", recipe, "--model", size, "--micro_batch_size", str(MICRO_BATCH),
           "--world_size", "1", "--ranks_per_node", "1", "--device", "cpu", "--device_tflops", "0.1",
           "--device_memory_gb", "16", "--json"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    plan = json.loads(out.stdout)
    return plan["params"], plan["forward_flops_per_image"]


def train(size: str, steps: int, tmp: str, recipe: str = RECIPE) -> dict:
    out_dir = os.path.join(tmp, f"{size}-{steps}")
    start = time.monotonic()
    done = launch_train(launcher="python", nproc=1, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                        config=recipe, model=size, max_steps=steps, micro_batch_size=MICRO_BATCH,
                        warmup_steps=max(10, steps // 10), eval_every=0, save_every=0, progress=False,
                        report_to="none", num_workers=0, output_dir=out_dir)
    if not done.ok:
        raise RuntimeError(f"{size} {steps} steps failed: {done.output.strip().splitlines()[-1:]}")
    summary = done.summary
    return {"size": size, "steps": steps, "images": steps * MICRO_BATCH, "val_top1": summary["val_top1"],
            "error": 1.0 - summary["val_top1"], "seconds": round(time.monotonic() - start, 1)}


def run_grid(sizes, steps, parallel: int, out: str, recipe: str = RECIPE) -> list:
    """Every (size, steps) not yet in runs.jsonl, `parallel` at a time, each appended as it finishes."""
    path = os.path.join(out, "runs.jsonl")
    done = {(r["size"], r["steps"]) for r in read_runs(path)}
    flops = {s: forward_flops(s, recipe) for s in sizes}
    todo = [(s, n) for n in steps for s in sizes if (s, n) not in done]
    print(f"scaling: {len(todo)} runs to train ({len(done)} already in {path})", flush=True)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(parallel) as pool:
        for r in pool.map(lambda job: train(*job, tmp, recipe), todo):
            params, fwd = flops[r["size"]]
            r.update(params=params, forward_flops_per_image=fwd, flops=3.0 * fwd * r["images"])
            with open(path, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"  {r['size']} x {r['steps']} steps: val top-1 {r['val_top1']:.2%} ({r['seconds']:.0f} s)",
                  flush=True)
    return read_runs(path)


def read_runs(path: str) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------------------------------------- analysis
def analyse(runs: list) -> dict:
    """Both laws fitted without the held-out runs, their predictions of those with intervals, and the
    compute-optimal size for 10x the largest run's compute."""
    largest = max(runs, key=lambda r: r["params"])["size"]
    train_runs = [r for r in runs if r["size"] != largest]
    held = max((r for r in runs if r["size"] == largest), key=lambda r: r["images"])
    n, d, e = (np.array([r[k] for r in train_runs], dtype=float) for k in ("params", "images", "error"))
    two = fit_two_term(n, d, e)
    two_pred = float(two_term_law(held["params"], held["images"], *two))
    two_lo, two_hi, two_failed = bootstrap(fit_two_term, lambda p: two_term_law(held["params"], held["images"], *p),
                                           (n, d, e))

    top = max(runs, key=lambda r: r["flops"])
    frontier = compute_frontier([r for r in runs if r is not top])
    c, fe = (np.array([r[k] for r in frontier], dtype=float) for k in ("flops", "error"))
    front = fit_frontier(c, fe)
    front_pred = float(frontier_law(top["flops"], *front))
    front_lo, front_hi, front_failed = bootstrap(fit_frontier, lambda p: frontier_law(top["flops"], *p), (c, fe))

    everything = fit_two_term(*(np.array([r[k] for r in runs], dtype=float) for k in ("params", "images", "error")))
    k = statistics.median(3 * r["forward_flops_per_image"] / r["params"] for r in runs)
    budget = 10 * max(r["flops"] for r in runs)
    n_opt, d_opt = compute_optimal(everything, budget, k)
    n_share = (two[1] / held["params"] ** two[2]) / two_pred  # of the predicted error, the parameters' term
    return {"two_term": {"params": two.tolist(), "held_out": held, "predicted": two_pred, "interval": [two_lo, two_hi],
                         "n_term_share": n_share,
                         "failed_resamples": two_failed, "met": two_lo <= held["error"] <= two_hi},
            "frontier": {"params": front.tolist(), "points": [(r["size"], r["steps"]) for r in frontier],
                         "held_out": top, "predicted": front_pred, "interval": [front_lo, front_hi],
                         "failed_resamples": front_failed, "met": front_lo <= top["error"] <= front_hi,
                         # a fit pinned at a bound: the exponent at its cap, or the floor at the best error seen
                         "at_bound": bool(front[1] >= 3.99 or front[2] >= 0.999 * float(fe.min()))},
            "two_term_all": everything.tolist(), "flops_per_param_image": k,
            "optimal": {"budget_flops": budget, "params": n_opt, "images": d_opt,
                        "at_edge": not OPTIMAL_RANGE[0] * 1.01 < n_opt < OPTIMAL_RANGE[1] / 1.01,
                        "predicted_error": float(two_term_law(n_opt, d_opt, *everything))}}


def report(runs: list, result: dict, out: str, env: dict):
    two, front, opt = result["two_term"], result["frontier"], result["optimal"]
    e, a, al, b, be = two["params"]
    fa, fb, fc, fd = front["params"]
    lines = [
        f"# Scaling laws: {env['recipe']} ({env['date']}, commit {env['commit']})", "",
        f"{len(runs)} runs: sizes {', '.join(sorted({r['size'] for r in runs}, key=lambda s: (len(s), s)))} x "
        f"{', '.join(str(s) for s in sorted({r['steps'] for r in runs}))} steps of {MICRO_BATCH} images, one rank "
        f"each ({env['recipe']}'s keys, fp32, {env['machine']}). Error = 1 - final val top-1" + (
            " (359 images: one image is 0.28%)" if env["recipe"] == RECIPE else "") + "."
        f" FLOPs: the planner's forward count x 3 x images.", "",
        "| size | params | steps | images | training FLOPs | val top-1 | error | seconds |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["params"], r["steps"])):
        lines.append(f"| {r['size']} | {r['params']:,} | {r['steps']} | {r['images']:,} | {r['flops']:.3g} | "
                     f"{r['val_top1']:.2%} | {r['error']:.4f} | {r['seconds']:.0f} |")
    held, top = two["held_out"], front["held_out"]
    sizing = (
        f"Fitted on every run, the two-term law has no compute-optimal size inside {OPTIMAL_RANGE[0]:.0e}-"
        f"{OPTIMAL_RANGE[1]:.0e} parameters for {opt['budget_flops']:.3g} training FLOPs (10x the largest run): its "
        f"minimum lies at the search's edge ({opt['params']:,.0f}), since the law fitted to these runs does not trade "
        f"parameters against data. Not reported as a size." if opt["at_edge"] else None)
    lines += [
        "", "## Held out", "",
        f"- **Two-term law** E = e + A/N^α + B/D^β, fitted without {held['size']}'s runs: e = {e:.4f}, A = {a:.3g}, "
        f"α = {al:.3f}, B = {b:.3g}, β = {be:.3f}. It predicts {held['size']} at {held['steps']} steps: "
        f"{two['predicted']:.4f} [{two['interval'][0]:.4f}, {two['interval'][1]:.4f}] (95% bootstrap over runs, "
        f"{two['failed_resamples']} of {BOOTSTRAP} resamples unfit); measured {held['error']:.4f}: "
        f"**{'met' if two['met'] else 'MISSED'}**. The parameters' term is {two['n_term_share']:.1%} of that "
        f"prediction" + (": the fit found no gain from parameters on these runs (at these step budgets the deeper "
                         "models train worse, an optimisation limit the law does not describe)."
                         if two["n_term_share"] < 0.05 else "."),
        f"- **Frontier law** E = a (C + d)^-b + c, fitted on the compute frontier without the run of largest compute "
        f"({len(front['points'])} points: {', '.join(f'{s} x {n}' for s, n in front['points'])}): a = {fa:.3g}, "
        f"b = {fb:.3f}, c = {fc:.4f}, d = {fd:.3g}. It predicts {top['size']} at {top['steps']} steps "
        f"({top['flops']:.3g} FLOPs): {front['predicted']:.4f} [{front['interval'][0]:.4f}, "
        f"{front['interval'][1]:.4f}] ({front['failed_resamples']} resamples unfit); measured {top['error']:.4f}: "
        f"**{'met' if front['met'] else 'MISSED'}**." + (
            " The fit sits at a bound (the exponent at its cap of 4, or the floor c at the best error it was given): "
            "the frontier's points do not pin the law down, and the verdict says the floor held, not that the law "
            "extrapolates." if front["at_bound"] else ""),
        "", "## Sizing", "",
        sizing or
        f"Fitted on every run, the two-term law puts the compute-optimal model for {opt['budget_flops']:.3g} "
        f"training FLOPs (10x the largest run) at {opt['params']:,.0f} parameters trained on {opt['images']:,.0f} "
        f"images (C = {result['flops_per_param_image']:.3g} FLOPs per parameter per image, the median over the "
        f"runs), predicted error {opt['predicted_error']:.4f}." + (
            f" On 1,438 training images such a run is {opt['images'] / 1438:.0f} epochs: this is an exercise of the "
            f"method, not advice for the digits." if env["recipe"] == RECIPE else ""),
        "", "![scaling](scaling.png)"]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(runs: list, result: dict, out: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size"] for r in runs}, key=lambda s: next(r["params"] for r in runs if r["size"] == s))
    colours = {s: plt.cm.viridis(i / max(1, len(sizes) - 1)) for i, s in enumerate(sizes)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in runs:
        left.scatter(r["flops"], r["error"], color=colours[r["size"]], s=30)
    front = result["frontier"]
    cs = np.logspace(math.log10(min(r["flops"] for r in runs)), math.log10(max(r["flops"] for r in runs) * 3), 200)
    left.plot(cs, frontier_law(cs, *front["params"]), "k-", lw=1, label="frontier law (fit without the largest C)")
    top = front["held_out"]
    left.errorbar([top["flops"]], [front["predicted"]], yerr=[[front["predicted"] - front["interval"][0]],
                                                              [front["interval"][1] - front["predicted"]]],
                  fmt="s", color="red", capsize=4, label="prediction, 95% interval")
    left.scatter([top["flops"]], [top["error"]], marker="*", s=160, color="red", label="held-out run")
    left.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="val error (1 - top-1)",
             title="Error against compute")
    left.legend(fontsize=8)
    two = result["two_term"]
    for s in sizes:
        mine = sorted((r for r in runs if r["size"] == s), key=lambda r: r["images"])
        right.scatter([r["images"] for r in mine], [r["error"] for r in mine], color=colours[s], s=30, label=s)
        ds = np.logspace(math.log10(mine[0]["images"]), math.log10(mine[-1]["images"] * 2), 100)
        right.plot(ds, two_term_law(mine[0]["params"], ds, *two["params"]), color=colours[s], lw=1,
                   ls="--" if s == two["held_out"]["size"] else "-")
    right.set(xscale="log", yscale="log", xlabel="images seen", ylabel="val error",
              title=f"Two-term law (dashed: {two['held_out']['size']}, held out)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"), dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help="registry or generated sizes, comma-separated")
    p.add_argument("--steps", default=",".join(map(str, STEPS)), help="step budgets, comma-separated")
    p.add_argument("--recipe", default=RECIPE, help="the train.py recipe every run starts from")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (one rank and one thread each)")
    p.add_argument("--out", default=OUT)
    p.add_argument("--report_only", action="store_true", help="refit and redraw from runs.jsonl")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.report_only:
        runs = read_runs(os.path.join(a.out, "runs.jsonl"))
    else:
        runs = run_grid(a.sizes.split(","), [int(s) for s in a.steps.split(",")], a.parallel, a.out, a.recipe)
    result = analyse(runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    machine = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "?") + f", {os.cpu_count()} cores"
    env = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": machine, "recipe": a.recipe}
    with open(os.path.join(a.out, "analysis.json"), "w") as f:
        json.dump({**result, **env}, f, indent=1)
    report(runs, result, a.out, env)
    plot(runs, result, a.out)
    print(f"scaling: two-term law {'met' if result['two_term']['met'] else 'MISSED'}, frontier law "
          f"{'met' if result['frontier']['met'] else 'MISSED'}: {os.path.join(a.out, 'report.md')}")


if __name__ == "__main__":
    main()
