"""Scaling laws on the digits: a grid of ViT widths trained for several step budgets and seeds, the laws
fitted, and checked held out.

    .venv/bin/python -m benchmarks.scaling                     # ~20 min on 2 cores: 30 runs, 2 at a time
    .venv/bin/python -m benchmarks.scaling --report_only       # refit and redraw from runs.jsonl

Each run is `train.py` on one rank (two runs at a time on 2 cores) with the recipe's keys, a generated size
(`vit-w<W>-d<D>`, models/registry.py), `max_steps` (its cosine schedule ends there, as the Chinchilla runs'
do) and a `seed`. A run records its parameters N, images seen D, training FLOPs C (the planner's forward FLOPs
per image, `plan.py --json`, x3 for the backward, x D) and final val error E = 1 - val top-1; a point (size,
steps) is its seeds' geometric mean. Then:

- the saturating power law of Zhai et al. (2022) on the compute frontier: E(C) = a C^-b + c (their offset d
  fixed at 0: three free parameters);
- the two-term law of Hoffmann et al. (2022) over every point: E(N, D) = e + A / N^alpha + B / D^beta;

both fitted by least squares on log error from several starting points. Held out: the largest model's
longest point (two-term law) and the point of largest compute (frontier law) are left out of the fits and
predicted, with 95% prediction intervals (the delta method; the variance the larger of the fit's residuals'
and the seeds' own; Student's t). The verdict is met or missed when the interval holds the measured error or
not, "not measured" when a law has fewer points than twice its free parameters or the points one seed each,
and "degenerate" when a parameter ends at a bound of its fit. tests/unit/test_scaling.py checks the intervals'
coverage on synthetic points at the committed grid's design. The two-term law then sizes a model for a compute
budget (the compute-optimal N and D). Writes benchmarks/results/scaling/: runs.jsonl, analysis.json, report.md,
scaling.png.
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
SIZES = ("vit-w16-d2", "vit-w32-d2", "vit-w64-d2", "vit-w128-d2", "vit-w192-d2")  # width only: depth 2 trains
STEPS = (300, 600, 1200)
SEEDS = (0, 1)  # seeds per (size, steps): their spread is the noise every interval carries
MICRO_BATCH = 32  # one rank: a step is 32 images
LEVEL = 0.95  # every interval's stated coverage


def _commit() -> str:
    """This checkout's commit, with "+" when the working tree differs from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")



# ---------------------------------------------------------------------------------------------------- the laws
def frontier_law(c, a, b, cc):
    """Zhai et al.'s saturating power law in compute, with their offset d fixed at 0 (three free parameters)."""
    return a * c ** (-b) + cc


def two_term_law(n, d, e, a, alpha, b, beta):
    """Hoffmann et al.'s law in parameters and data."""
    return e + a / n ** alpha + b / d ** beta


FRONTIER_NAMES = ("a", "b", "c")
TWO_TERM_NAMES = ("e", "A", "α", "B", "β")


class Fit:
    """A law fitted by least squares on log error, in its own scaled units (each input over its smallest value):
    the parameters `x`, the Jacobian of log E at the points, the residual sum of squares, and the names of the
    parameters that ended at a bound."""

    def __init__(self, log_model, log_jac, inputs: tuple, err: np.ndarray, starts, lower, upper, names):
        from scipy.optimize import least_squares

        self.scales = tuple(float(v.min()) for v in inputs)
        self.log_model, self.names = log_model, names
        scaled = tuple(v / s for v, s in zip(inputs, self.scales))
        y = np.log(err)
        best = None
        for x0 in starts:
            try:
                r = least_squares(lambda p: log_model(p, *scaled) - y, x0, jac=lambda p: log_jac(p, *scaled),
                                  bounds=(lower, upper), max_nfev=5000)
            except ValueError:
                continue
            if r.success and np.all(np.isfinite(r.fun)) and (best is None or r.cost < best.cost):
                best = r
        if best is None:
            raise RuntimeError("no starting point converged")
        self.x, self.jac, self.rss, self.points = best.x, best.jac, 2.0 * best.cost, len(y)
        self.at_bound = [n for n, v, lo, hi in zip(names, best.x, lower, upper)
                         if v <= lo + 1e-6 * max(1.0, abs(lo)) or v >= hi - 1e-6 * max(1.0, abs(hi))]

    def log_predict(self, x, *inputs) -> float:
        return float(self.log_model(x, *(np.asarray(v, dtype=float) / s for v, s in zip(inputs, self.scales))))

    def interval(self, inputs: tuple, noise: tuple, level: float = LEVEL) -> tuple[float, float, float]:
        """(prediction, low, high) of E at `inputs`: a prediction interval for a new point's mean over as many
        seeds as the fitted points had. Its variance is s^2 (1 + g (J'J)^-1 g), g the gradient of log E there
        (the delta method), s^2 the larger of the fit's residual variance (k - p degrees of freedom) and the
        seeds' own variance of a point's mean (`noise`: that and its degrees of freedom), Student's t."""
        from scipy.stats import t

        p = len(self.x)
        fit_var, fit_df = self.rss / (self.points - p), self.points - p
        var, df = (fit_var, fit_df) if fit_var >= noise[0] else noise
        centre = self.log_predict(self.x, *inputs)
        g = np.zeros(p)
        for j in range(p):  # central differences, scaled to each parameter
            h = 1e-6 * max(1.0, abs(self.x[j]))
            up, down = self.x.copy(), self.x.copy()
            up[j] += h
            down[j] = max(down[j] - h, 0.0)
            g[j] = (self.log_predict(up, *inputs) - self.log_predict(down, *inputs)) / (up[j] - down[j])
        leverage = float(g @ np.linalg.pinv(self.jac.T @ self.jac) @ g)
        half = float(t.ppf(0.5 + level / 2, df)) * math.sqrt(var * (1.0 + leverage))
        return math.exp(centre), math.exp(centre - half), math.exp(centre + half)


def _fit_frontier(c: np.ndarray, err: np.ndarray) -> Fit:
    def log_model(p, x):
        return np.log(frontier_law(x, *p))

    def log_jac(p, x):  # d log E / d (a, b, c)
        a, b, _ = p
        power = x ** (-b)
        total = frontier_law(x, *p)
        return np.stack([power, -a * power * np.log(x), np.ones_like(x)], axis=1) / total[:, None]

    starts = [(a, b, 0.5 * float(err.min())) for a in (0.3, 3.0) for b in (0.2, 0.6, 1.2)]
    return Fit(log_model, log_jac, (c,), err, starts, [1e-6, 0.0, 0.0], [1e4, 4.0, 1.0], FRONTIER_NAMES)


def _fit_two_term(n: np.ndarray, d: np.ndarray, err: np.ndarray) -> Fit:
    def log_model(p, xn, xd):
        return np.log(two_term_law(xn, xd, *p))

    def log_jac(p, xn, xd):  # d log E / d (e, A, alpha, B, beta)
        _, a, alpha, b, beta = p
        pn, pd = xn ** (-alpha), xd ** (-beta)
        total = two_term_law(xn, xd, *p)
        return np.stack([np.ones_like(xn), pn, -a * pn * np.log(xn), pd, -b * pd * np.log(xd)],
                        axis=1) / total[:, None]

    starts = [(e * float(err.min()), a, ex, a, ex) for e in (0.0, 0.5) for a in (0.1, 1.0) for ex in (0.3, 1.0)]
    return Fit(log_model, log_jac, (n, d), err, starts, [0.0] * 5, [1.0, 1e4, 4.0, 1e4, 4.0], TWO_TERM_NAMES)


def fit_frontier(c: np.ndarray, err: np.ndarray) -> np.ndarray:
    """(a, b, c) of E = a C^-b + c, in C's own units."""
    return frontier_params(_fit_frontier(c, err))


def frontier_params(f: Fit) -> np.ndarray:
    """A frontier fit's (a, b, c) in C's own units."""
    a, b, cc = f.x
    return np.array([a * f.scales[0] ** b, b, cc])


def fit_two_term(n: np.ndarray, d: np.ndarray, err: np.ndarray) -> np.ndarray:
    """(e, A, alpha, B, beta) of E = e + A/N^alpha + B/D^beta, in N's and D's own units."""
    return two_term_params(_fit_two_term(n, d, err))


def two_term_params(f: Fit) -> np.ndarray:
    """A two-term fit's (e, A, alpha, B, beta) in N's and D's own units."""
    e, a, al, b, be = f.x
    return np.array([e, a * f.scales[0] ** al, al, b * f.scales[1] ** be, be])


def points_of(runs: list) -> list:
    """One point per (size, steps): its seeds' errors, their geometric mean (the point's error), and the
    variance of their log."""
    groups = {}
    for r in runs:
        groups.setdefault((r["size"], r["steps"]), []).append(r)
    out = []
    for (size, steps), mine in groups.items():
        logs = np.log([r["error"] for r in mine])
        out.append({"size": size, "steps": steps, "params": mine[0]["params"], "images": mine[0]["images"],
                    "flops": mine[0]["flops"], "seeds": len(mine), "errors": [r["error"] for r in mine],
                    "error": float(np.exp(logs.mean())), "log_var": float(logs.var(ddof=1)) if len(mine) > 1 else 0.0})
    return sorted(out, key=lambda p: (p["params"], p["steps"]))


def seed_noise(points: list) -> tuple[float, int]:
    """The seeds' pooled variance of a point's mean log error, and its degrees of freedom (0: one seed each)."""
    df = sum(p["seeds"] - 1 for p in points)
    if df == 0:
        return 0.0, 0
    pooled = sum((p["seeds"] - 1) * p["log_var"] for p in points) / df
    return pooled / statistics.median(p["seeds"] for p in points), df


def verdict(fit: Fit, noise: tuple, interval: tuple, measured: float) -> tuple[str, str]:
    """met / missed / degenerate / not measured, and why when it is neither met nor missed."""
    p = len(fit.x)
    if fit.points < 2 * p:
        return "not measured", f"{fit.points} points for {p} free parameters (fewer than twice as many)"
    if noise[1] == 0:
        return "not measured", "one seed per point: no seed-to-seed noise for the interval to carry"
    if fit.at_bound:
        return "degenerate", f"{', '.join(fit.at_bound)} at a bound of the fit: the points do not pin the law down"
    if not all(math.isfinite(v) for v in interval):
        return "degenerate", "the interval is not finite"
    return ("met" if interval[1] <= measured <= interval[2] else "missed"), ""


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


def train(size: str, steps: int, seed: int, tmp: str, recipe: str = RECIPE) -> dict:
    out_dir = os.path.join(tmp, f"{size}-{steps}-{seed}")
    start = time.monotonic()
    done = launch_train(launcher="python", nproc=1, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                        config=recipe, model=size, max_steps=steps, micro_batch_size=MICRO_BATCH, seed=seed,
                        warmup_steps=max(10, steps // 10), eval_every=0, save_every=0, progress=False,
                        report_to="none", num_workers=0, output_dir=out_dir)
    if not done.ok:
        raise RuntimeError(f"{size} {steps} steps seed {seed} failed: {done.output.strip().splitlines()[-1:]}")
    summary = done.summary
    return {"size": size, "steps": steps, "seed": seed, "commit": _commit(), "images": steps * MICRO_BATCH, "val_top1": summary["val_top1"],
            "error": 1.0 - summary["val_top1"], "seconds": round(time.monotonic() - start, 1)}


def run_grid(sizes, steps, seeds, parallel: int, out: str, recipe: str = RECIPE) -> list:
    """Every (size, steps, seed) not yet in runs.jsonl, `parallel` at a time (the longest first), each appended as
    it finishes."""
    path = os.path.join(out, "runs.jsonl")
    done = {(r["size"], r["steps"], r.get("seed", 0)) for r in read_runs(path)}
    flops = {s: forward_flops(s, recipe) for s in sizes}
    todo = [(s, n, k) for k in seeds for n in steps for s in sizes if (s, n, k) not in done]
    todo.sort(key=lambda job: -job[1] * flops[job[0]][1])  # the longest first: the pool ends together
    print(f"scaling: {len(todo)} runs to train ({len(done)} already in {path})", flush=True)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(parallel) as pool:
        for r in pool.map(lambda job: train(*job, tmp, recipe), todo):
            params, fwd = flops[r["size"]]
            r.update(params=params, forward_flops_per_image=fwd, flops=3.0 * fwd * r["images"])
            with open(path, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(f"  {r['size']} x {r['steps']} steps, seed {r['seed']}: val top-1 {r['val_top1']:.2%} ({r['seconds']:.0f} s)",
                  flush=True)
    return read_runs(path)


def read_runs(path: str) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------------------------------------------- analysis
def held_out_two_term(points: list, noise: tuple) -> dict:
    """The two-term law fitted without the largest model's points, and its prediction of that model's longest."""
    largest = max(points, key=lambda r: r["params"])["size"]
    train_points = [r for r in points if r["size"] != largest]
    held = max((r for r in points if r["size"] == largest), key=lambda r: r["images"])
    n, d, e = (np.array([r[k] for r in train_points], dtype=float) for k in ("params", "images", "error"))
    fit = _fit_two_term(n, d, e)
    predicted = fit.interval((held["params"], held["images"]), noise)
    said, why = verdict(fit, noise, predicted, held["error"])
    params = two_term_params(fit)
    return {"params": params.tolist(), "held_out": held, "predicted": predicted[0], "interval": list(predicted[1:]),
            "fitted_points": fit.points, "at_bound": fit.at_bound, "verdict": said, "why": why,
            "n_term_share": (params[1] / held["params"] ** params[2]) / predicted[0]}


def held_out_frontier(points: list, noise: tuple) -> dict:
    """The frontier law fitted on the compute frontier without the point of largest compute, and its prediction
    of that point."""
    top = max(points, key=lambda r: r["flops"])
    frontier = compute_frontier([r for r in points if r is not top])
    c, e = (np.array([r[k] for r in frontier], dtype=float) for k in ("flops", "error"))
    fit = _fit_frontier(c, e)
    predicted = fit.interval((top["flops"],), noise)
    said, why = verdict(fit, noise, predicted, top["error"])
    return {"params": frontier_params(fit).tolist(), "points": [(r["size"], r["steps"]) for r in frontier],
            "held_out": top, "predicted": predicted[0], "interval": list(predicted[1:]), "fitted_points": fit.points,
            "at_bound": fit.at_bound, "verdict": said, "why": why}


def seed_sigma(runs: list) -> float:
    """A single seed's standard deviation of log error, pooled over the points."""
    points = points_of(runs)
    variance, _ = seed_noise(points)
    return math.sqrt(variance * statistics.median(p["seeds"] for p in points))


def known_laws(runs: list) -> dict:
    """For the coverage check: a two-term law and a frontier law with known parameters, scaled to the grid's design
    (each term of the two-term law 0.3 at the smallest N and D over a floor of 0.02; the frontier 0.5 above its floor
    of 0.03 at the smallest compute), as functions of a run."""
    n0, d0, c0 = (min(r[k] for r in runs) for k in ("params", "images", "flops"))
    two = (0.02, 0.3 * n0 ** 0.5, 0.5, 0.3 * d0 ** 0.8, 0.8)
    front = (0.5 * c0 ** 0.5, 0.5, 0.03)
    return {"two_term": lambda r: two_term_law(r["params"], r["images"], *two),
            "frontier": lambda r: frontier_law(r["flops"], *front)}


def coverage(runs: list, wanted: int = 100, most: int = 400, seed: int = 0) -> dict:
    """How the intervals do at the grid's design: synthetic grids (the runs' sizes, budgets and seeds; each error
    drawn from a law of `known_laws` with log-normal noise of the grid's own seed-to-seed sigma), until `wanted`
    verdicts are met or missed (at most `most` grids). {law: {verdict: count}, "sigma": sigma}."""
    sigma = seed_sigma(runs)
    out = {"sigma": sigma}
    held_out = {"two_term": held_out_two_term, "frontier": held_out_frontier}
    for name, error_of in known_laws(runs).items():
        rng = np.random.default_rng(seed)
        said = {}
        while said.get("met", 0) + said.get("missed", 0) < wanted and sum(said.values()) < most:
            points = points_of([dict(r, error=float(error_of(r) * math.exp(rng.normal(0, sigma)))) for r in runs])
            verdict_ = held_out[name](points, seed_noise(points))["verdict"]
            said[verdict_] = said.get(verdict_, 0) + 1
        out[name] = said
    return out


def analyse(runs: list) -> dict:
    """Both laws fitted on the points (each (size, steps), its seeds' geometric mean) without their held-out
    point, their predictions of it with 95% prediction intervals and a verdict, and the compute-optimal size for
    10x the largest run's compute."""
    points = points_of(runs)
    noise = seed_noise(points)
    inputs = tuple(np.array([r[k] for r in points], dtype=float) for k in ("params", "images", "error"))
    whole = _fit_two_term(*inputs)
    everything, degenerate = two_term_params(whole), whole.at_bound
    k = statistics.median(3 * r["forward_flops_per_image"] / r["params"] for r in runs)
    budget = 10 * max(r["flops"] for r in runs)
    n_opt, d_opt = compute_optimal(everything, budget, k)
    return {"points": points, "noise": {"variance_of_a_mean": noise[0], "df": noise[1]}, "level": LEVEL,
            "two_term": held_out_two_term(points, noise), "frontier": held_out_frontier(points, noise),
            "two_term_all": everything.tolist(), "flops_per_param_image": k,
            "optimal": {"budget_flops": budget, "params": n_opt, "images": d_opt, "at_bound": degenerate,
                        "at_edge": not OPTIMAL_RANGE[0] * 1.01 < n_opt < OPTIMAL_RANGE[1] / 1.01,
                        "predicted_error": float(two_term_law(n_opt, d_opt, *everything))}}


def _coverage_line(cov: dict) -> str:
    def one(name: str, said: dict) -> str:
        measured = said.get("met", 0) + said.get("missed", 0)
        others = ", ".join(f"{v} {k}" for k, v in sorted(said.items()) if k not in ("met", "missed"))
        return (f"the {name} held the held-out point in {said.get('met', 0)} of {measured} measured grids"
                + (f" ({others} of {sum(said.values())})" if others else ""))

    return (f"At this grid's design and seed-to-seed noise (σ = {cov['sigma']:.2f} in log error per seed), synthetic "
            f"grids drawn from laws with known parameters (benchmarks/scaling.py's `coverage`): "
            f"{one('two-term law', cov['two_term'])}; {one('frontier law', cov['frontier'])}.")


def _said(law: dict) -> str:
    return f"**{law['verdict']}**" + (f" ({law['why']})" if law["why"] else "")


def report(runs: list, result: dict, out: str, env: dict):
    two, front, opt = result["two_term"], result["frontier"], result["optimal"]
    e, a, al, b, be = two["params"]
    fa, fb, fc = front["params"]
    points, noise = result["points"], result["noise"]
    seeds = sorted({r.get("seed", 0) for r in runs})
    lines = [
        f"# Scaling laws: {env['recipe']} ({env['date']}, commit {env['commit']})", "",
        f"{len(runs)} runs: sizes {', '.join(sorted({r['size'] for r in runs}, key=lambda s: (len(s), s)))} x "
        f"{', '.join(str(s) for s in sorted({r['steps'] for r in runs}))} steps of {MICRO_BATCH} images x seeds "
        f"{', '.join(map(str, seeds))}, one rank each ({env['recipe']}'s keys, fp32, {env['machine']}). Error = 1 - "
        "final val top-1" + (" (359 images: one image is 0.28%)" if env["recipe"] == RECIPE else "") + "; a "
        "point's error is its seeds' geometric mean. FLOPs: the planner's forward count x 3 x images. Trained at "
        f"{', '.join(sorted({r.get('commit', '?') for r in runs}))} ('+': with uncommitted changes).", "",
        "| size | params | steps | images | training FLOPs | val top-1 by seed | error | seconds |",
        "|---|---|---|---|---|---|---|---|"]
    for pt in points:
        mine = sorted((r for r in runs if (r["size"], r["steps"]) == (pt["size"], pt["steps"])),
                      key=lambda r: r.get("seed", 0))
        tops = ", ".join(f"{r['val_top1']:.2%}" for r in mine)
        lines.append(f"| {pt['size']} | {pt['params']:,} | {pt['steps']} | {pt['images']:,} | {pt['flops']:.3g} | "
                     f"{tops} | {pt['error']:.4f} | {sum(r['seconds'] for r in mine):.0f} |")
    lines += ["", f"Seed-to-seed noise: a point's mean log error varies by {math.sqrt(noise['variance_of_a_mean']):.3f} "
              f"(standard deviation, {noise['df']} degrees of freedom), about {math.expm1(math.sqrt(noise['variance_of_a_mean'])):.0%} "
              f"of its error."]
    held, top = two["held_out"], front["held_out"]
    sizing = (
        f"Fitted on every point, the two-term law is degenerate ({', '.join(opt['at_bound'])} at a bound of the "
        f"fit): no compute-optimal size is reported." if opt.get("at_bound") else None) or (
        f"Fitted on every run, the two-term law has no compute-optimal size inside {OPTIMAL_RANGE[0]:.0e}-"
        f"{OPTIMAL_RANGE[1]:.0e} parameters for {opt['budget_flops']:.3g} training FLOPs (10x the largest run): its "
        f"minimum lies at the search's edge ({opt['params']:,.0f}), since the law fitted to these runs does not trade "
        f"parameters against data. Not reported as a size." if opt["at_edge"] else None)
    lines += [
        "", "## Held out", "",
        f"Each prediction carries a {LEVEL:.0%} prediction interval for a point's mean over as many seeds: the delta "
        f"method on the least-squares fit of log error, its variance the larger of the fit's residuals' and the seeds' "
        f"own, Student's t. A law fitted on fewer points than twice its free parameters is not measured; one with a "
        f"parameter at a bound of its fit is degenerate (tests/unit/test_scaling.py checks the intervals' coverage on "
        f"synthetic points at this grid's design).", "",
        _coverage_line(result["coverage"]), "",
        f"- **Two-term law** E = e + A/N^α + B/D^β, fitted on {two['fitted_points']} points without "
        f"{held['size']}'s: e = {e:.4f}, A = {a:.3g}, α = {al:.3f}, B = {b:.3g}, β = {be:.3f}. It predicts "
        f"{held['size']} at {held['steps']} steps: {two['predicted']:.4f} [{two['interval'][0]:.4f}, "
        f"{two['interval'][1]:.4f}]; measured {held['error']:.4f}: {_said(two)}. The parameters' term is "
        f"{two['n_term_share']:.1%} of that prediction.",
        f"- **Frontier law** E = a C^-b + c (Zhai et al.'s offset d fixed at 0), fitted on the compute frontier "
        f"without the run of largest compute ({front['fitted_points']} points: "
        f"{', '.join(f'{s} x {n}' for s, n in front['points'])}): a = {fa:.3g}, b = {fb:.3f}, c = {fc:.4f}. It "
        f"predicts {top['size']} at {top['steps']} steps ({top['flops']:.3g} FLOPs): {front['predicted']:.4f} "
        f"[{front['interval'][0]:.4f}, {front['interval'][1]:.4f}]; measured {top['error']:.4f}: {_said(front)}.",
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
    points = result["points"]
    for pt in points:
        spread = [[max(0.0, pt["error"] - min(pt["errors"]))], [max(0.0, max(pt["errors"]) - pt["error"])]]
        left.errorbar([pt["flops"]], [pt["error"]], yerr=spread, fmt="o", ms=5, color=colours[pt["size"]], capsize=2)
    front = result["frontier"]
    cs = np.logspace(math.log10(min(r["flops"] for r in runs)), math.log10(max(r["flops"] for r in runs) * 3), 200)
    left.plot(cs, frontier_law(cs, *front["params"]), "k-", lw=1, label="frontier law (fit without the largest C)")
    top = front["held_out"]
    left.errorbar([top["flops"]], [front["predicted"]], yerr=[[front["predicted"] - front["interval"][0]],
                                                              [front["interval"][1] - front["predicted"]]],
                  fmt="s", color="red", capsize=4, label=f"prediction, {LEVEL:.0%} interval: {front['verdict']}")
    left.scatter([top["flops"]], [top["error"]], marker="*", s=160, color="red", label="held-out point (seeds' mean)")
    left.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="val error (1 - top-1)",
             title="Error against compute")
    left.legend(fontsize=8)
    two = result["two_term"]
    for s in sizes:
        mine = sorted((r for r in points if r["size"] == s), key=lambda r: r["images"])
        right.scatter([r["images"] for r in mine], [r["error"] for r in mine], color=colours[s], s=30, label=s)
        ds = np.logspace(math.log10(mine[0]["images"]), math.log10(mine[-1]["images"] * 2), 100)
        right.plot(ds, two_term_law(mine[0]["params"], ds, *two["params"]), color=colours[s], lw=1,
                   ls="--" if s == two["held_out"]["size"] else "-")
    right.set(xscale="log", yscale="log", xlabel="images seen", ylabel="val error",
              title=f"Two-term law (dashed: {two['held_out']['size']}, held out: {two['verdict']})")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"), dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help="registry or generated sizes, comma-separated")
    p.add_argument("--steps", default=",".join(map(str, STEPS)), help="step budgets, comma-separated")
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="seeds per size and budget (two or more)")
    p.add_argument("--recipe", default=RECIPE, help="the train.py recipe every run starts from")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (one rank and one thread each)")
    p.add_argument("--out", default=OUT)
    p.add_argument("--report_only", action="store_true", help="refit and redraw from runs.jsonl")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.report_only:
        runs = read_runs(os.path.join(a.out, "runs.jsonl"))
    else:
        runs = run_grid(a.sizes.split(","), [int(s) for s in a.steps.split(",")],
                        [int(s) for s in a.seeds.split(",")], a.parallel, a.out, a.recipe)
    result = analyse(runs)
    result["coverage"] = coverage(runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    machine = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "?") + f", {os.cpu_count()} cores"
    env = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": machine, "recipe": a.recipe}
    with open(os.path.join(a.out, "analysis.json"), "w") as f:
        json.dump({**result, **env}, f, indent=1)
    report(runs, result, a.out, env)
    plot(runs, result, a.out)
    print(f"scaling: two-term law {result['two_term']['verdict']}, frontier law {result['frontier']['verdict']}: "
          f"{os.path.join(a.out, 'report.md')}")


if __name__ == "__main__":
    main()
