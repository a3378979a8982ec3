"""Tensor parallelism (`tp_size`): which parameters AutoTP splits and how, what cannot be split, and 2-rank runs
(TP 2, one data-parallel rank) against the same run on one rank: the same losses, the same exported model (at the
run's end and by export.py from a checkpoint), an exact resume."""
import json
import re
import shutil

import pytest
import torch
from conftest import free_port, launch, read_metrics, run_entry
from test_export import logits, same_weights

from config import ConfigError
from engine.zero_checkpoint import missing_files
from parallel.tensor import SPLIT, check_tp, tp_config
from models.registry import model_config

STEPS = ["--max_steps", "10", "--warmup_steps", "2", "--save_every", "5", "--eval_every", "0", "--log_every", "1",
         "--micro_batch_size", "8"]


def meta(name: str, **overrides):
    from transformers import AutoModelForImageClassification

    config = model_config(name, 10, 224 if name.startswith("swin") and name != "swin-debug" else 16)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return AutoModelForImageClassification.from_config(config)


def matching(specs: list, name: str) -> list:
    """The specs whose patterns match `name` as DeepSpeed's AutoTP matches them (re.match)."""
    return [s for s in specs if any(re.match(p, name) for p in s["patterns"])]


@pytest.mark.parametrize("name", ["vit-debug", "vit-base", "swin-tiny"])
def test_every_block_linear_is_split_and_nothing_else(name):
    """Each block's query, key, value and fc1 column-wise, its attention output and fc2 row-wise, each by exactly
    one spec; embeddings, norms, Swin's patch merging and the head by none; Swin's relative position bias
    tables replicated with their gradients summed over the tensor group."""
    model = meta(name)
    specs = tp_config(model, 2)["partition_config"]["layer_specs"]
    split, bias_tables = {}, []
    for param, _ in model.named_parameters():
        found = matching(specs, param)
        assert len(found) <= 1, (param, found)
        if found and found[0]["partition_type"] == "skip":
            assert found[0]["grad_allreduce"] and param.endswith("relative_position_bias_table")
            bias_tables.append(param)
        elif found:
            split[param] = found[0]["partition_type"]
    blocks = sum(1 for n, _ in model.named_parameters() if n.endswith("layernorm_before.weight"))
    assert len(split) == len(SPLIT) * blocks and blocks > 0
    for param, how in split.items():
        kind = param.rsplit(".", 2)[-2]
        assert how == {"q_proj": "column", "k_proj": "column", "v_proj": "column", "fc1": "column", "o_proj": "row",
                       "fc2": "row"}[kind], param
    assert not any("classifier" in p or "embeddings" in p or "norm" in p or "downsample" in p for p in split)
    assert len(bias_tables) == (blocks if name.startswith("swin") else 0)


def test_what_tensor_parallelism_cannot_split_is_named():
    swin = model_config("swin-debug", 10, 16)  # heads (1, 2)
    with pytest.raises(ConfigError, match=r"tp_size 2 does not divide the 1 attention heads of stage 1 of swin"):
        check_tp(swin, 2, 2, 2)
    swin.num_heads = [2, 4]
    check_tp(swin, 2, 2, 2)
    vit = model_config("vit-debug", 10, 16)  # 2 heads, MLP 64
    with pytest.raises(ConfigError, match=r"tp_size 4 does not divide the 2 attention heads of every block of vit"):
        check_tp(vit, 4, 4, 4)
    vit.intermediate_size = 65
    with pytest.raises(ConfigError, match=r"tp_size 2 does not divide the MLP's hidden units \(65\)"):
        check_tp(vit, 2, 2, 2)
    vit.intermediate_size = 64
    for world, per_node in ((3, 3), (4, 1)):
        with pytest.raises(ConfigError, match=rf"must divide the ranks per node \({per_node}\) and the world size "
                                              rf"\({world}\)"):
            check_tp(vit, 2, world, per_node)
    check_tp(vit, 2, 4, 2)


@pytest.fixture(scope="module")
def swin_dir(tmp_path_factory):
    """A Swin whose every stage's heads split in two (swin-debug's first stage has one head)."""
    from transformers import SwinConfig, SwinForImageClassification

    out = tmp_path_factory.mktemp("swin-tp")
    torch.manual_seed(0)
    SwinForImageClassification(SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                          window_size=4, num_labels=10)).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def one_rank(debug_args, swin_dir, tmp_path_factory):
    """Each model's run on one rank without tensor parallelism: the reference."""
    root = tmp_path_factory.mktemp("tp1")
    runs = {}
    for model in ("vit-debug", swin_dir):
        out = root / ("vit" if model == "vit-debug" else "swin")
        launch(debug_args + STEPS + ["--model", model, "--drop_path", "0.1", "--output_dir", out], nproc=1)
        runs[model] = out
    return runs


def losses(run_dir) -> list:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


# the default run: both models, ZeRO-1 and ZeRO-3, selective and full recompute; the other combinations of the
# same parts under -m slow
CASES = {  # model, ZeRO stage, checkpointing
    "vit zero3 selective": ("vit-debug", 3, "selective"),
    "swin zero1 full": ("swin", 1, "full"),
    "vit zero1 none": pytest.param(("vit-debug", 1, "none"), marks=pytest.mark.slow),
    "vit zero2 full": pytest.param(("vit-debug", 2, "full"), marks=pytest.mark.slow),
    "swin zero3 selective": pytest.param(("swin", 3, "selective"), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_two_tensor_parallel_ranks_train_as_one_rank(one_rank, debug_args, swin_dir, tmp_path, case):
    """TP 2 on 2 ranks reads the one rank's micro-batches and takes its steps: losses within 1e-5 relative (only
    the all-reduces' order of additions differs), the same validation result, an export with its logits within
    rtol 1e-4, and export.py's merge of the last checkpoint with the run's export's weights and logits bitwise;
    every rank's checkpoint files; resumed at step 5, the same losses bitwise."""
    model, stage, ac = case
    model = swin_dir if model == "swin" else model
    args = debug_args + STEPS + ["--model", model, "--drop_path", "0.1", "--zero_stage", stage, "--ac", ac,
                                 "--tp_size", "2"]
    proc = launch(args + ["--output_dir", tmp_path / "run"])
    assert "= 1 data x 2 tensor parallel | global batch 8 = 8 micro x 1 accum x 1 ranks" in proc.stdout
    reference = one_rank[model]
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "run")), torch.tensor(losses(reference)), rtol=1e-5,
                               atol=0)
    summary, expected = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "run", reference))
    assert summary["val_top1"] == expected["val_top1"] and summary["confusion"] == expected["confusion"]
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(tmp_path / "run" / "hf_model", images), logits(reference / "hf_model", images),
                               rtol=1e-4, atol=1e-5)
    proc = run_entry("export", tmp_path / "run" / "checkpoints" / "step0000010", tmp_path / "exported")
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(logits(tmp_path / "exported", images), logits(tmp_path / "run" / "hf_model", images),
                               rtol=0, atol=0)
    assert same_weights(tmp_path / "exported", tmp_path / "run" / "hf_model") == []  # every weight, bitwise
    if stage == 3:  # a rank's partitions missing: one line, exit 2, nothing written
        broken = tmp_path / "broken" / "checkpoints" / "step0000010"
        shutil.copytree(tmp_path / "run" / "checkpoints" / "step0000010", broken)
        shutil.copytree(tmp_path / "run" / "hf_config", tmp_path / "broken" / "hf_config")
        (broken / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
        proc = run_entry("export", broken, tmp_path / "none")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "lacks zero_pp_rank_0_mp_rank_01_optim_states.pt" in proc.stderr and not (tmp_path / "none").exists()
    checkpoint = tmp_path / "run" / "checkpoints" / "step0000005"
    assert missing_files(str(checkpoint), 2, stage, 2) == []
    assert json.loads((checkpoint / "train_state.json").read_text())["tp_size"] == 2
    launch(args + ["--output_dir", tmp_path / "resumed", "--resume", checkpoint])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "run")[5:]


def test_unshard_joins_split_weights_and_checks_replicas():
    """Column shards join along rows, row shards along columns, a replicated tensor is its replicas' value; replicas
    that differ, or shards that are no split of the model's shape, are errors naming the weight."""
    from parallel.tensor import unshard

    w = torch.randn(6, 4)
    assert torch.equal(unshard("q.weight", list(w.chunk(2, 0)), (6, 4)), w)
    assert torch.equal(unshard("o.weight", list(w.chunk(2, 1)), (6, 4)), w)
    assert torch.equal(unshard("norm.weight", [w, w.clone()], (6, 4)), w)
    with pytest.raises(ValueError, match="norm.weight is replicated over the tensor group but differs"):
        unshard("norm.weight", [w, w + 1], (6, 4))
    with pytest.raises(ValueError, match=r"fc.weight: shards of shape \[3, 2\] are not a 2-way split"):
        unshard("fc.weight", [w[:3, :2], w[3:, 2:]], (6, 4))


# slow (two 2-rank loopback nodes, most of a minute): TP on one node is the default run's (the cases above)
@pytest.mark.slow
def test_tensor_and_data_parallel_on_two_nodes_of_two_ranks(debug_args, tmp_path):
    """2-D: 2 torchrun nodes of 2 ranks, each node one tensor group (TP 2), the nodes data-parallel under ZeRO-3,
    against 2 ranks of data parallelism alone: the same micro-batches per step, the same losses within 1e-5;
    resumed on 2 nodes from step 5, the same losses bitwise; its last checkpoint, in 2 x 2 ZeRO-3 partitions,
    exported with the final model's weights bitwise."""
    from test_multinode import run_nodes, torchrun_node

    args = debug_args + STEPS + ["--model", "vit-debug", "--zero_stage", "3", "--ac", "selective"]
    port = free_port()
    outs = run_nodes([torchrun_node(r, port, args + ["--tp_size", 2, "--output_dir", tmp_path / "2d"], ranks=2)
                      for r in (0, 1)])
    assert "world size 4 (2 node(s) x 2, cpu, 1 threads per rank) = 2 data x 2 tensor parallel" in outs[0]
    launch(args + ["--output_dir", tmp_path / "dp"])
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "2d")), torch.tensor(losses(tmp_path / "dp")),
                               rtol=1e-5, atol=0)
    checkpoint = tmp_path / "2d" / "checkpoints" / "step0000005"
    assert missing_files(str(checkpoint), 4, 3, 2) == []
    port = free_port()
    run_nodes([torchrun_node(r, port, args + ["--tp_size", 2, "--output_dir", tmp_path / "resumed", "--resume",
                                              checkpoint], ranks=2) for r in (0, 1)])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "2d")[5:]
    proc = run_entry("export", tmp_path / "2d" / "checkpoints" / "step0000010", tmp_path / "exported")
    assert proc.returncode == 0, proc.stderr[-3000:]
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(tmp_path / "exported", images), logits(tmp_path / "2d" / "hf_model", images),
                               rtol=0, atol=0)
    assert same_weights(tmp_path / "exported", tmp_path / "2d" / "hf_model") == []
