"""parallel/sequence.py's input checks: what sequence parallelism refuses, each in one line, on the models' own
configs (no process: the runs are in tests/integration/test_sequence_parallel.py)."""
import pytest

from models.registry import model_config
from parallel import sequence


@pytest.mark.parametrize("model, sp, world, tp, task, says", [
    ("vit-digits", 2, 2, 1, "classification", None),
    ("vit-digits", 1, 3, 1, "mae", None),  # sp_size 1: nothing to check
    ("vit-digits", 3, 4, 1, "classification", "sp_size 3 does not divide the world size (4)"),
    ("vit-digits", 2, 4, 2, "classification", None),  # 4 heads: 2 per tensor rank, 1 per sequence rank
    ("vit-digits", 2, 6, 2, "classification", "sp_size 2 x tp_size 2 does not divide the world size (6)"),
    ("vit-debug", 2, 4, 2, "classification", "sp_size 2 x tp_size 2 does not divide the model's 2 attention heads"),
    ("vit-digits", 2, 2, 1, "simmim", None),  # SimMIM on a ViT: the mask token in place before the split
    ("vit-digits", 2, 2, 1, "segmentation", "with task segmentation"),
    ("vit-digits", 2, 2, 1, "mae", None),  # MAE: its encoder split, its decoder whole
    ("swin-debug", 2, 2, 1, "classification", "with a swin model"),
    ("vit-digits", 8, 8, 1, "classification", "does not divide the model's 4 attention heads"),
])
def test_what_sequence_parallelism_refuses(model, sp, world, tp, task, says):
    why = sequence.check(model_config(model, 10, 16 if model == "vit-digits" else 32), sp, world, tp, task)
    assert (why is None) if says is None else (says in why), why


def test_attention_dropout_is_refused_where_ranks_would_draw_it_apart():
    config = model_config("vit-digits", 10, 16)
    config.attention_probs_dropout_prob = 0.1
    assert "attention dropout" in sequence.check(config, 2, 2)


def test_a_sequence_group_takes_one_rank_of_each_tensor_group():
    """8 ranks as 2 data x 2 sequence x 2 tensor: tensor groups are consecutive (AutoTP's), so a sequence group
    holds the ranks of one tensor rank within a model-parallel block of 4; without tensor parallelism the groups
    are consecutive."""
    groups = {r: sequence.layout(r, 2, 2) for r in range(8)}
    assert groups[0] == ([0, 2], 0) and groups[2] == ([0, 2], 1) and groups[3] == ([1, 3], 1)
    assert groups[5] == ([5, 7], 0) and groups[6] == ([4, 6], 1)
    assert {tuple(g) for g, _ in groups.values()} == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert [sequence.layout(r, 4)[0] for r in (0, 5)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [sequence.layout(r, 4)[1] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_auto_budgets_a_ranks_share_of_the_tokens():
    """`ac auto:<GB>` under sp_size 2 budgets the activations one rank holds (half of each block's): at a budget
    between a rank's share and the whole sequence's, the split run keeps every activation and the unsplit one
    recomputes."""
    from ac.policies import choose_plan
    from config import parse
    from engine.parallelize import rank_profile
    from planner.estimate import _blocks_of

    profiles = [rank_profile(parse(["--model", "vit-digits", "--image_size", "16", "--sp_size", str(sp)]), "cpu",
                             "fp32", []) for sp in (1, 2)]
    kept = [sum(p.bytes_none for p in prof) for prof in profiles]
    assert kept[1] == sum(round(p.bytes_none / 2) + round(p.bytes_full / 2) for p in profiles[0])  # a rank's half
    fixed = {"backward": 0, "optimizer_step": 0}
    budget = (profiles[0].bytes_outside + (kept[0] + kept[1]) / 2) / 2**30
    plans = [choose_plan(f"auto:{budget}", _blocks_of(prof), prof, fixed) for prof in profiles]
    assert plans[1] == ["none"] * len(plans[1]) and plans[0] != ["none"] * len(plans[0]), plans
