"""The pictures a run writes to TensorBoard beside its scalars: validation images with their predicted and true
labels (or label maps), the confusion matrix of each evaluation, and the activation-checkpointing plan per
block."""
import matplotlib

matplotlib.use("Agg")  # files only, no display; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

GRID = 4  # the prediction grid is GRID x GRID images


def predictions(images, labels, predicted, names):
    """A grid of validation images titled "predicted / true", in red where they differ. `images`: (N, 3, H, W)
    uint8, as the loader gives them."""
    n = min(len(images), GRID * GRID)
    fig, axes = plt.subplots(GRID, GRID, figsize=(2 * GRID, 2.2 * GRID))
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= n:
            continue
        ax.imshow(images[i].numpy().transpose(1, 2, 0), interpolation="nearest")
        right = predicted[i] == labels[i]
        ax.set_title(f"{names[predicted[i]]} / {names[labels[i]]}", fontsize=9, color="black" if right else "red")
    fig.suptitle("validation: predicted / true")
    fig.tight_layout()
    return fig


def confusion(matrix, names):
    """Row-normalised confusion matrix (rows: true class, columns: predicted), with the counts written in when
    there are few classes."""
    counts = np.asarray(matrix, dtype=np.float64)
    rates = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    k = len(names)
    size = min(12, 2 + 0.45 * k)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    if k <= 30:
        ax.set_xticks(range(k), names, rotation=90, fontsize=8)
        ax.set_yticks(range(k), names, fontsize=8)
        for i in range(k):
            for j in range(k):
                if counts[i, j]:
                    ax.text(j, i, int(counts[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if rates[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion: {np.trace(counts) / max(counts.sum(), 1):.2%} correct of {int(counts.sum())}")
    fig.tight_layout()
    return fig


def segmentation(images, masks, predicted, names, ignore_index: int):
    """Rows of validation images, their true label map and the predicted one, in one colour per class (black:
    ignored pixels), with a legend of the classes shown."""
    n = len(images)
    colours = plt.get_cmap("tab20" if len(names) > 10 else "tab10")(np.arange(len(names)) % 20)[:, :3]
    fig, axes = plt.subplots(n, 3, figsize=(6, 2 * n + 0.6), squeeze=False)

    def paint(labels):
        labels = np.asarray(labels)
        out = np.zeros(labels.shape + (3,))
        known = labels != ignore_index
        out[known] = colours[np.clip(labels[known], 0, len(names) - 1)]
        return out

    for i in range(n):
        for ax, picture, title in zip(axes[i], (images[i].numpy().transpose(1, 2, 0), paint(masks[i]),
                                                paint(predicted[i])), ("image", "true", "predicted")):
            ax.imshow(picture, interpolation="nearest")
            ax.axis("off")
            if i == 0:
                ax.set_title(title, fontsize=9)
    seen = sorted(set(np.unique(np.asarray(masks))) | set(np.unique(np.asarray(predicted))) - {ignore_index})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[c]) for c in seen if c < len(names)]
    fig.legend(handles, [names[c] for c in seen if c < len(names)], loc="lower center", ncol=min(6, len(handles)),
               fontsize=7)
    fig.tight_layout(rect=(0, 0.6 / (2 * n + 0.6), 1, 1))
    return fig


POLICY_BYTES = {"none": "bytes_none", "light": "bytes_light", "selective": "bytes_selective", "full": "bytes_full"}
POLICY_FLOPS = {"none": None, "light": None, "selective": "flops_selective", "full": "flops_full"}


def ac_plan(plan: dict):
    """Per block: the activation bytes it keeps for the backward under its policy (beside what `none` would
    keep) and the FLOPs its backward recomputes, as ac_plan.json records them."""
    blocks, profile = plan["blocks"], plan["profile"]
    x = np.arange(len(blocks))
    kept = [p[POLICY_BYTES.get(b["policy"], "bytes_full")] / 2**20 for b, p in zip(blocks, profile)]
    none = [p["bytes_none"] / 2**20 for p in profile]
    flops = [p[POLICY_FLOPS[b["policy"]]] / 1e9 if POLICY_FLOPS.get(b["policy"]) else 0.0
             for b, p in zip(blocks, profile)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.35 * len(blocks) + 2), 6), sharex=True)
    top.bar(x, none, color="lightgray", label="kept without recomputation")
    top.bar(x, kept, color="tab:blue", label="kept under the plan")
    top.set_ylabel("activations (MiB)")
    top.legend(fontsize=8)
    bottom.bar(x, flops, color="tab:orange")
    bottom.set_ylabel("recomputed (GFLOP)")
    many = len(blocks) > 12
    bottom.set_xticks(x, [f"{i} {b['policy']}" for i, b in enumerate(blocks)], rotation=90 if many else 0,
                      fontsize=7 if many else 9)
    bottom.set_xlabel("block and its policy")
    top.set_title(f"activation checkpointing '{plan['ac']}'\n{plan['activation_bytes_planned'] / 2**20:.1f} MiB of "
                  f"activations kept, {plan['recompute_flops_fraction']:.1%} of the step's FLOPs recomputed")
    fig.tight_layout()
    return fig
