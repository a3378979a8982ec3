"""parallel/pipeline.py without a process: how the blocks and the micro-batch are cut, and what the pipeline
refuses, each in one line, on the models' own configs (the runs are in tests/integration/test_pipeline.py)."""
import pytest
import torch

from config import parse
from models.registry import build_model, model_config
from models.blocks import find_blocks
from parallel import pipeline


@pytest.mark.parametrize("blocks, stages, expected", [
    (6, 2, [(0, 3), (3, 6)]),
    (7, 3, [(0, 2), (2, 4), (4, 7)]),  # the remainder to the later stages, which hold fewer pieces under 1F1B
    (24, 8, [(3 * s, 3 * s + 3) for s in range(8)]),
    (2, 2, [(0, 1), (1, 2)]),
])
def test_the_blocks_are_cut_in_order_as_evenly_as_they_divide(blocks, stages, expected):
    cut = pipeline.stage_blocks(blocks, stages)
    assert [(r.start, r.stop) for r in cut] == expected
    assert [i for r in cut for i in r] == list(range(blocks))


def test_pp_split_cuts_the_blocks_as_it_lists_them():
    cut = pipeline.stage_blocks(24, 4, "5,7,7,5")
    assert [(r.start, r.stop) for r in cut] == [(0, 5), (5, 12), (12, 19), (19, 24)]
    assert pipeline.stage_blocks(6, 2, " ") == pipeline.stage_blocks(6, 2)  # unset: as even as they divide


@pytest.mark.parametrize("stages, micro, given, pieces", [
    (2, 32, 0, 4),  # 1 / (4 + 1) = 20%: the fewest pieces at or under the bound
    (4, 32, 0, 16),  # 3 / 15 = 20%
    (4, 36, 0, 12),  # 12 divides 36: 3 / 15 = 20%
    (8, 16, 0, 16),  # no divisor reaches 20% (7 / 23 at 16): one image a piece
    (2, 32, 8, 8),  # given
])
def test_the_pieces_keep_the_bubble_at_or_under_a_fifth(stages, micro, given, pieces):
    got = pipeline.microbatches(stages, given, micro)
    assert got == pieces
    if not given and got < micro:
        assert pipeline.bubble(stages, got) <= pipeline.MAX_BUBBLE
        smaller = [m for m in range(1, got) if micro % m == 0]
        assert all(pipeline.bubble(stages, m) > pipeline.MAX_BUBBLE for m in smaller)


@pytest.mark.parametrize("model, args, world, says", [
    ("vit-digits", [], 2, None),
    ("vit-digits", ["--pp_size", "1"], 3, None),  # nothing to check
    ("vit-digits", [], 3, "pp_size 2 does not divide the world size (3)"),
    ("vit-digits", ["--sp_size", "2"], 4, "with tp_size or sp_size > 1"),
    ("vit-digits", ["--task", "mae"], 2, "with task mae"),
    ("swin-debug", [], 2, "with a swin model"),
    ("vit-debug", ["--pp_size", "4"], 4, "pp_size 4 is more stages than the model's 2 blocks"),
    ("vit-digits", ["--pp_microbatches", "5"], 2, "pp_microbatches 5 does not divide micro_batch_size 32"),
    ("vit-digits", ["--replicate_degree", "2"], 4, "with replicate_degree > 1"),
    ("vit-digits", ["--pp_split", "2,4"], 2, None),
    ("vit-digits", ["--pp_split", "2,2"], 2, "pp_split '2,2' gives 2 stages 4 blocks; the model has 6 blocks over "
                                             "pp_size 2 stages"),
    ("vit-digits", ["--pp_split", "1,2,3"], 2, "gives 3 stages 6 blocks"),
    ("vit-digits", ["--pp_split", "6,0"], 2, "pp_split '6,0': comma-separated block counts, each at least 1"),
    ("vit-digits", ["--pp_split", "three,3"], 2, "comma-separated block counts"),
    ("vit-digits", ["--pp_size", "1", "--pp_split", "3,3"], 2, "pp_split needs pp_size > 1"),
])
def test_what_the_pipeline_refuses(model, args, world, says):
    cfg = parse(["--engine", "fsdp2", "--pp_size", "2", "--model", model, *args])
    why = pipeline.check(model_config(model, 10, 16 if model.startswith("vit") else 32), cfg, world)
    assert (why is None) if says is None else (says in why), why


def test_a_stage_keeps_its_modules_under_their_own_names_and_computes_its_part():
    """Two stages of vit-digits, each cut from a whole model built from the same seed: their parameters are the
    whole model's, under the same names, split without overlap; images through stage 0 then stage 1 give the
    whole model's logits."""
    whole = build_model("vit-digits", 10, 16, seed=0)[0].eval()
    stages = [build_model("vit-digits", 10, 16, seed=0)[0].eval() for _ in range(2)]
    for s, model in enumerate(stages):
        pipeline.split(model, s, 2)
    names = [dict(m.named_parameters()) for m in stages]
    assert not set(names[0]) & set(names[1])
    assert set(names[0]) | set(names[1]) == set(dict(whole.named_parameters()))
    assert [len(find_blocks(m)) for m in stages] == [3, 3]
    assert "classifier.weight" in names[1] and not any("embeddings" in n for n in names[1])
    uneven = build_model("vit-digits", 10, 16, seed=0)[0].eval()
    assert list(pipeline.split(uneven, 0, 2, "2,4")) == [0, 1] and len(find_blocks(uneven)) == 2
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](images)), whole(pixel_values=images).logits)


@pytest.mark.parametrize("schedule, held", [("1f1b", [4, 3, 2, 1]), ("gpipe", [8, 8, 8, 8])])
def test_a_stage_holds_the_pieces_its_schedule_keeps_in_flight(schedule, held):
    assert [pipeline.in_flight(schedule, s, 4, 8) for s in range(4)] == held
    assert pipeline.in_flight("1f1b", 0, 4, 2) == 2  # never more than there are


def test_auto_recomputes_more_on_the_first_stage_which_holds_more_pieces():
    """vit-digits on two 1F1B stages, 4 pieces: stage 0 holds 2 pieces' activations at once, stage 1 one; at a
    budget between what they need, `auto` keeps every activation on stage 1 and recomputes on stage 0."""
    from ac.policies import choose_plan
    from ac.profile import profile_model
    from planner.estimate import _blocks_of

    cfg = parse(["--engine", "fsdp2", "--pp_size", "2", "--model", "vit-digits", "--image_size", "16"])
    whole = profile_model(cfg, "cpu")[0]
    names = [[p.name for p in whole][r.start:r.stop] for r in pipeline.stage_blocks(len(whole), 2)]
    stages = [pipeline.stage_profile(whole, names[s], cfg, s) for s in range(2)]
    kept = [sum(p.bytes_none for p in prof) for prof in stages]
    assert kept[0] == pytest.approx(2 * kept[1], rel=0.01)
    fixed = {"backward": 0, "optimizer_step": 0}
    budget = (stages[1].bytes_outside + (kept[0] + kept[1]) / 2) / 2**30  # room for stage 1's, not stage 0's
    plans = [choose_plan(f"auto:{budget}", _blocks_of(prof), prof, fixed) for prof in stages]
    assert plans[1] == ["none"] * 3 and plans[0] != ["none"] * 3, plans
