"""DeepSpeed's own ViT sequence parallelism (`deepspeed.sequence.auto_sp.auto_wrap_model_for_sp`, which wraps each
ViT attention in `UlyssesSPViTAttention`) beside this repo's (parallel/sequence.py), each checked against one rank.

    .venv/bin/python -m benchmarks.ulysses_check              # 2 CPU ranks (gloo), ~30 s; writes its report
    .venv/bin/python -m benchmarks.ulysses_check --out DIR    # elsewhere (the tests)

One seeded ViT-S/4 at 32 px (64 patches and a CLS token), one batch of 8 images, fp32. Every rank computes the
unsplit model's loss and gradients (the reference), then each split over the 2 ranks' sequence group:

- parallel/sequence.py as train.py applies it (the tokens split after the embeddings, attention by all-to-alls,
  the sequence gathered before the final norm); its gradients summed over the group / sp_size (what the
  engines' average over every rank makes of them);
- DeepSpeed's AutoSP on the same model: its wrapper expects each rank to hold the CLS token and a slice of the
  patches (split here by a forward hook on the embeddings, as its docstring asks), all-gathers the patches, runs
  the wrapped attention on the whole sequence and keeps its slice; the classifier reads the CLS token each rank
  holds. transformers 5.24's ViTLayer passes the attention mask positionally, which the wrapper's
  `forward(hidden_states, **kwargs)` does not take: a first attempt records that failure, then a shim passes it
  by keyword. Its gradients are compared averaged and summed over the group.

Writes benchmarks/results/sequence/deepspeed-ulysses/: results.json, environment.json, report.md.
"""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "benchmarks", "results", "sequence", "deepspeed-ulysses")
SHAPE = dict(name="vit-small", num_labels=10, image_size=32, patch_size=4)
BATCH = 8


def relative(a, b, floor: float) -> float:
    """max |a - b| / max(max |b|, floor) over a tensor: `floor` keeps a gradient that is zero in exact arithmetic
    (the key projection's bias: a shift of every key leaves each softmax as it is) from dividing by its rounding."""
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


def worker() -> dict:
    import copy

    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from models.registry import build_model
    from parallel import sequence

    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    images, labels = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    base = build_model(**SHAPE, seed=0)[0].train()

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(pixel_values=images).logits, labels)
        loss.backward()
        # the wrapped attention's parameters under their unwrapped names
        return loss.detach(), {n.replace(".inner.attn.", "."): p.grad.detach().clone()
                               for n, p in model.named_parameters()}

    ref_loss, ref_grads = step(copy.deepcopy(base))

    def compare(loss, grads, combine):
        out = {}
        for how in combine:
            reduced = {}
            for n, g in grads.items():
                g = g.clone()
                dist.all_reduce(g)
                reduced[n] = g / (world if how in ("mean", "sum / sp_size") else 1)
            floor = 1e-4 * max(float(g.abs().max()) for g in ref_grads.values())
            errors = {n: relative(reduced[n], ref_grads[n], floor) for n in ref_grads}
            worst = max(errors, key=errors.get)
            embed = [v for n, v in errors.items() if "embeddings" in n]
            flat = torch.cat([reduced[n].flatten() for n in ref_grads])
            flat_ref = torch.cat([ref_grads[n].flatten() for n in ref_grads])
            out[how] = {"global_relative_error": float((flat - flat_ref).norm() / flat_ref.norm()),
                        "max_relative_error": errors[worst], "worst_parameter": worst,
                        "embeddings_max_relative_error": max(embed),
                        "parameters_within_1e-5": sum(v <= 1e-5 for v in errors.values()),
                        "parameters": len(errors)}
        return {"loss": float(loss), "loss_relative_error": abs(float(loss) - float(ref_loss)) / float(ref_loss),
                "gradients": out}

    results = {"reference_loss": float(ref_loss)}
    ours = copy.deepcopy(base)
    sequence.apply(ours, world, rank, world)
    results["this repo (parallel/sequence.py)"] = compare(*step(ours), ["sum / sp_size"])

    from deepspeed.sequence.auto_sp import auto_wrap_model_for_sp

    group = dist.new_group(list(range(world)))

    def split_patches(module, args, out):  # the CLS token on every rank, a slice of the patches each
        patches = out.shape[1] - 1
        local = patches // world
        return torch.cat([out[:, :1], out[:, 1 + rank * local:1 + (rank + 1) * local]], dim=1)

    theirs = copy.deepcopy(base)
    theirs.vit.embeddings.register_forward_hook(split_patches)
    auto_wrap_model_for_sp(theirs, group)
    try:
        theirs(pixel_values=images)
        results["deepspeed as wrapped"] = "ran"
    except Exception as e:  # noqa: BLE001 (what a user of transformers 5.24 meets)
        results["deepspeed as wrapped"] = f"{type(e).__name__}: {e}"
    from models.blocks import find_blocks

    class KeywordMask(torch.nn.Module):
        """ViTLayer calls `attention(hidden_states, attention_mask)`; the wrapper takes the mask by keyword."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden_states, attention_mask=None, **kwargs):
            return self.inner(hidden_states, attention_mask=attention_mask, **kwargs)

    for block in find_blocks(theirs):
        block.module.attention = KeywordMask(block.module.attention)
    results["deepspeed (UlyssesSPViTAttention, mask by keyword)"] = compare(*step(theirs), ["mean", "sum"])
    return results


def report(results: dict, env: dict) -> str:
    ours = results["this repo (parallel/sequence.py)"]
    theirs = results["deepspeed (UlyssesSPViTAttention, mask by keyword)"]
    lines = [f"# DeepSpeed's ViT sequence parallelism against this repo's, checked against one rank "
             f"({env['date']}, commit {env['git_commit']})", "",
             f"ViT-S/4 at 32 px (64 patches and a CLS token), a batch of {BATCH}, fp32, 2 CPU ranks (gloo); "
             f"torch {env['torch']}, deepspeed {env['deepspeed']}, transformers {env['transformers']}. Every "
             "rank computes the unsplit model's loss and gradients first; each split is compared with them "
             "(`benchmarks/ulysses_check.py`). A parameter's error is its largest deviation over the larger of its "
             "largest reference gradient and 1e-4 of the largest over all parameters (the key projection's bias has "
             "a gradient of zero in exact arithmetic: its rounding is no scale).", "",
             "| implementation | loss, relative error | gradients combined over the group | all gradients, "
             "relative error (norm) | worst parameter's relative error | its name | patch and position embeddings | "
             "parameters within 1e-5 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in (("this repo (parallel/sequence.py)", ours), ("DeepSpeed AutoSP (UlyssesSPViTAttention)", theirs)):
        for how, g in r["gradients"].items():
            lines.append(f"| {name} | {r['loss_relative_error']:.1e} | {how} | {g['global_relative_error']:.2e} | "
                         f"{g['max_relative_error']:.2e} | "
                         f"`{g['worst_parameter']}` | {g['embeddings_max_relative_error']:.2e} | "
                         f"{g['parameters_within_1e-5']} of {g['parameters']} |")
    lines += ["", f"DeepSpeed's wrapper on transformers' ViT as `auto_wrap_model_for_sp` leaves it: "
              f"{results['deepspeed as wrapped']}.", "",
              "Read: both forwards give the unsplit loss. DeepSpeed's wrapper gathers the patches with "
              "`deepspeed.comm.all_gather`, which carries no gradient: a rank's attention sees the other ranks' "
              "patches (and its own, from the gathered buffer) as constants, so the gradient reaching the tokens "
              "through attention is lost and only the residual path carries it back; the parameters before the "
              "last attention get wrong gradients whichever way they are combined. It also runs the whole "
              "attention on every rank (its memory is saved outside attention alone) and reads each rank's "
              "length with a `.item()` per layer. This repo's all-to-alls (compat.all_to_all_autograd) and "
              "gather (compat.all_gather_autograd) carry the gradient, and its split gives the unsplit "
              "gradients within fp32 rounding."]
    return "\n".join(lines) + "\n"


def versions() -> dict:
    """The date, the commit and the versions this ran under (no timing here: no GEMM or bandwidth measured)."""
    import datetime
    import subprocess

    import deepspeed
    import torch
    import transformers

    from benchmarks.measure import cpu_name

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return {"date": datetime.date.today().isoformat(), "git_commit": commit + (" (with uncommitted changes)" if dirty
                                                                              else ""),
            "cpu": cpu_name(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__}


def main():
    if "RANK" in os.environ:
        results = worker()
        import torch.distributed as dist

        if dist.get_rank() == 0:
            with open(os.environ["ULYSSES_OUT"], "w") as f:
                json.dump(results, f, indent=1)
        return
    import argparse
    import tempfile

    from launch.job import run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=OUT, help="where results.json, environment.json and report.md go")
    out = parser.parse_args().out

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "results.json")
        done = run(nproc=2, launcher="torchrun", script=["-m", "benchmarks.ulysses_check"],
                   env=dict(os.environ, ULYSSES_OUT=path, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                   timeout=600)
        if done.returncode != 0:
            sys.exit(f"error: the 2-rank check failed:\n{done.output[-3000:]}")
        with open(path) as f:
            results = json.load(f)
    env = versions()
    os.makedirs(out, exist_ok=True)
    for name, data in (("results.json", results), ("environment.json", env)):
        with open(os.path.join(out, name), "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    text = report(results, env)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
