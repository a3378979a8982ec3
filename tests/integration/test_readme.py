"""The README's "Train on your own data" path, run as written on a small image folder: its shard commands (and the
ranges they print), its plan, its launch on one node and on two (loopback) nodes, its resume and its export. The
model and the lengths are shrunk by keys added at the end of each line, which win over the recipe; paths are
substituted; nothing else changes."""
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, read_metrics, run_plan
from PIL import Image

from launch.job import command
from loop.distributed import free_port

SHRINK = ["--model", "vit-debug", "--image_size", "16", "--num_labels", "3", "--micro_batch_size", "4",
          "--grad_accum_steps", "1", "--precision", "fp32", "--num_workers", "0", "--eval_every", "0",
          "--save_every", "2", "--warmup_steps", "1", "--progress", "false", "--report_to", "none",
          "--data_mode", "epoch", "--ema_decay", "0"]


def readme_section(title: str) -> list[str]:
    """The shell lines of a README section's code blocks, continuation lines joined."""
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line:
                lines.append(line)
    return lines


def image_folder(root):
    """3 classes x (6 train + 2 val) 16x16 PNGs, the ImageNet layout."""
    for split, n in (("train", 6), ("val", 2)):
        for c, colour in enumerate(((200, 30, 30), (30, 200, 30), (30, 30, 200))):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (16, 16), tuple(v + 5 * i for v in colour)).save(folder / f"{i}.png")


def test_the_readmes_own_data_path_runs_as_written(tmp_path):
    image_folder(tmp_path / "imagenet")
    lines = readme_section("Train on your own data (GPUs)")
    run = tmp_path / "runs" / "x"

    def substitute(line: str) -> list[str]:
        line = line.replace("~/imagenet", str(tmp_path / "imagenet")).replace("data/in1k", str(tmp_path / "in1k"))
        line = line.replace("plans/vitl", str(tmp_path / "plans" / "vitl")).replace("runs/x", str(run))
        return shlex.split(line)

    shards = [substitute(line) for line in lines if line.startswith("python data/make_shards.py")]
    assert len(shards) == 2
    printed = []
    for args in shards:
        proc = subprocess.run([sys.executable, *args[1:], "--workers", "1"], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        printed.append(proc.stdout)
    # each prints the range of its split and the directory that reads them all; the range names every shard
    for split, out, n in (("train", printed[0], 18), ("val", printed[1], 6)):
        spec = re.search(rf"^{split}: {n} samples in 1 shards -> (\S+) \((\w+_shards): (\S+) reads them all\)", out, re.M)
        assert spec and spec.group(3) == str(tmp_path / "in1k"), out
        assert spec.group(1) == f"{tmp_path}/in1k/{split}-{{000000..000000}}.tar"

    plan_line = next(substitute(line) for line in lines if line.startswith("python plan.py"))
    proc = run_plan(*plan_line[2:])
    assert proc.returncode == 0, proc.stderr
    assert "why: " in proc.stdout and os.path.isfile(tmp_path / "plans" / "vitl" / "config.yaml")

    launches = [substitute(line) for line in lines if line.startswith("torchrun")]
    assert len(launches) == 3  # one node, many nodes, the resume
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # one node: the recipe's epochs, cut to 2 steps
    one = launches[0]
    at = one.index("train.py")
    cmd = command("torchrun", 2) + one[at + 1:] + SHRINK + ["--max_steps", "2", "--output_dir", tmp_path / "one"]
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "one")] == [1, 2]
    # two nodes of one rank each, the plan's recipe with the keys the line adds (--epochs 1 for its 300: 18 images
    # at a global batch of 8, 3 steps; --lr composes with the plan)
    many = [a.replace("300", "1") if prev == "--epochs" else a for prev, a in zip([None, *launches[1]], launches[1])]
    at = many.index("train.py")
    port = free_port()
    nodes = [subprocess.Popen([str(c) for c in command("torchrun", 1, port, nnodes=2, node_rank=rank) + many[at + 1:]
                               + SHRINK + ["--output_dir", run]], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outs[0][-3000:]
    assert "steps 0->3 (1 epochs)" in outs[0] and "world size 2 (2 node(s) x 1" in outs[0]
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["lr"] < 4e-3
    # the resume line: the run is complete, so it continues nothing and exports again
    resume = launches[2]
    at = resume.index("train.py")
    cmd = command("torchrun", 2) + resume[at + 1:] + SHRINK + ["--epochs", "1", "--output_dir", run]
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    export = next(substitute(line) for line in lines if line.startswith("python export.py"))
    export = [a.replace("step0030000", "step0000003") for a in export]
    proc = subprocess.run([sys.executable, *export[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from transformers import pipeline

    classify = pipeline("image-classification", model=export[-1])
    assert len(classify(Image.new("RGB", (16, 16)), top_k=3)) == 3


@pytest.mark.parametrize("doc", ["README.md", "docs/data.md", "docs/launching.md"])
def test_the_docs_shard_commands_name_what_make_shards_writes(doc):
    """Every brace range over ImageNet-style shards in these pages covers a whole split as make_shards.py names it
    (from 000000), and the README reads shards by their directory."""
    text = open(os.path.join(REPO, doc)).read()
    for start, end in re.findall(r"data/in1k/(?:train|val)-\{(\d+)\.\.(\d+)\}", text):
        assert start == "000000" and len(end) == 6, (doc, start, end)
    if doc == "README.md":
        assert "--train_shards data/in1k --val_shards data/in1k" in text
        assert all(len(line) <= 160 for line in text.splitlines())
        assert len(text.splitlines()) <= 200
