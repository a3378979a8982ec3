"""Every recipe in configs/: its keys parse, its shard specs expand as WebDataset patterns, the GPU recipes fit
the hardware they name by the planner, and 2 steps of each run on CPU with its model shrunk to debug size and
the digits in place of its data (the digits on a canvas for segmentation; every other key as the recipe sets
it). The fine-tuning pairs (digits-probe then digits-finetune, digits-mae then digits-mae-finetune) run in
tests/integration/test_finetune.py and tests/integration/test_task_training.py."""
import glob
import json
import os

import pytest
import yaml
from conftest import REPO, launch, read_metrics, run_plan, seg_shards
from webdataset.shardlists import expand_urls

import config
from models import build_model

RECIPES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "configs", "*.yaml")))
FINETUNE_PAIR = ("digits-probe.yaml", "digits-finetune.yaml", "digits-mae-finetune.yaml")
GPU_RECIPES = [r for r in RECIPES if not r.startswith("digits-")]
# a task's metric in metrics.jsonl, and the debug-sized stand-ins for a recipe's masks
METRIC = {"classification": "val_top1", "mae": "val_loss", "simmim": "val_loss", "segmentation": "val_miou"}


def recipe(name):
    with open(os.path.join(REPO, "configs", name)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_keys_and_patterns(name):
    keys = recipe(name)
    cfg = config.parse(["--config", os.path.join(REPO, "configs", name)])  # unknown keys and bad values raise
    assert {k: getattr(cfg, k) for k in keys} == keys  # each key as the recipe wrote it, after parsing
    for key in ("train_shards", "val_shards"):
        if not name.startswith("digits-"):  # the GPU recipes name their shard directory: every shard of its split
            assert "{" not in keys[key] and "*" not in keys[key], keys[key]
        else:
            urls = expand_urls(keys[key])
            assert len(set(urls)) == len(urls) > 0, keys[key]
    if name.startswith("imagenet-"):  # lengths in epochs, as the papers give them
        assert keys["epochs"] > 0 and keys["warmup_epochs"] > 0 and "max_steps" not in keys
    text = open(os.path.join(REPO, "configs", name)).read()
    assert "Expected" in text  # every recipe says what it should reach


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_fits_its_node(name):
    """The planner's verdict for one node of 8 x 80 GB, which the recipes name."""
    keys = recipe(name)
    model = keys["model"]  # a pretrained directory: the registry model of its shape
    if "/" in model:
        model = "vit-huge" if "vit-huge" in model else "vit-large"
    proc = run_plan("--config", f"configs/{name}", "--model", model, "--world_size", 8, "--ranks_per_node", 8,
                    "--device", "a100-80gb", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["fits"] and plan["peak_bytes"] < 0.8 * plan["capacity_bytes"], plan


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("pretrained") / "vit"
    build_model("vit-debug", 21, 16, seed=1)[0].save_pretrained(path)
    return str(path)


# the digits task recipes are trained to the end by benchmarks/digits_tasks.py, their keys by test_task_training.py
@pytest.mark.parametrize("name", [pytest.param(r, marks=pytest.mark.slow) if r in ("digits-mae.yaml",
                                  "digits-simmim.yaml", "digits-segmentation.yaml") else r for r in RECIPES if r not in FINETUNE_PAIR])
def test_recipe_runs_shrunk(name, digits, pretrained, request, tmp_path):
    keys = recipe(name)
    task = keys.get("task", "classification")
    family = keys["model"].split("-")[0]
    model = pretrained if "/" in keys["model"] else {"swin": "swin-debug", "segformer": "segformer-debug"}.get(
        family, "vit-debug")
    size = 32 if family == "segformer" else 16  # SegFormer's first stage reduces its keys 8x8: 32 px at least
    if task == "segmentation":  # the digits on a canvas: 11 classes
        shards, labels = seg_shards(request.getfixturevalue("digits_seg")), 11
    else:
        shards, labels = ["--train_shards", digits["train"], "--val_shards", digits["val"]], 10
    extra = ["--mask_patch_size", 4] if task == "simmim" else []  # 16 px: four blocks a side
    if keys.get("sp_size", 1) > 1:  # a node's sequence group: the two ranks here
        extra += ["--sp_size", 2]
    out = tmp_path / "run"
    launch(["--config", f"configs/{name}", "--model", model, "--num_labels", labels, "--image_size", size, *shards,
            *extra, "--micro_batch_size", 8, "--max_steps", 2, "--warmup_steps", 1, "--eval_every", 0,
            "--save_every", 0, "--num_workers", 0, "--shuffle_buffer", 100, "--progress", "false",
            "--output_dir", out], timeout=180)  # 2 ranks
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2] and METRIC[task] in records[-1]
    assert ("val_ema_top1" in records[-1]) == bool(keys.get("ema_decay"))
