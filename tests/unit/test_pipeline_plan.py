"""The planner's pipeline dimension (planner/estimate.py's pipeline_estimate) on its own terms: which stage holds
what under each schedule, and what the pieces buy. Its figures against measured runs are a benchmark's, not
these tests'."""
from dataclasses import replace

import pytest

from config import parse
from planner.devices import DEVICES
from planner.estimate import estimate

H100 = DEVICES["h100-80gb"]


def plan(pp: int, **keys):
    cfg = parse(["--model", "vit-large", "--engine", "fsdp2", "--image_size", "224", "--num_labels", "1000",
                 "--micro_batch_size", "32", "--ac", "none", "--zero_stage", "2"])
    return estimate(replace(cfg, pp_size=pp, **keys), {}, "bf16", 64, 8, H100)


def test_under_1f1b_the_first_stage_holds_the_most_and_under_gpipe_every_stage_holds_every_piece():
    one_f = plan(4)  # 16 pieces of 2 images: 1F1B's stage s holds 4 - s of them
    gpipe = plan(4, pp_schedule="gpipe")
    assert one_f["pp_microbatches"] == 16 and [s["held"] for s in one_f["stages"]] == [4, 3, 2, 1]
    assert [s["held"] for s in gpipe["stages"]] == [16] * 4
    peaks = [s["peak_bytes"] for s in one_f["stages"]]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    assert all(g["peak_bytes"] > o["peak_bytes"] for g, o in zip(gpipe["stages"], one_f["stages"]))
    assert one_f["peak_bytes"] == peaks[0] and one_f["fits"]


def test_more_pieces_shrink_the_bubble_and_the_step():
    few, many = plan(4, pp_microbatches=4), plan(4, pp_microbatches=16)
    assert few["bubble"] == pytest.approx(3 / 7) and many["bubble"] == pytest.approx(3 / 19)
    assert many["step_s"] < few["step_s"]
    # the pipelined micro-batch: the slowest stage's stretched by (M + P - 1) / M
    slowest = max(s["micro_s"] for s in many["stages"])
    assert many["compute_s"] == pytest.approx(slowest * 19 / 16 + many["optimizer_s"], rel=0.05)


def test_a_pipeline_reads_fewer_micro_batches_and_its_stages_hold_their_share_of_the_weights():
    whole, staged = plan(1), plan(4)
    assert whole["global_batch"] == 32 * 64 and staged["global_batch"] == 32 * 16
    # each stage's FSDP2 shard: about a quarter of the blocks' weights over a quarter of the ranks
    assert staged["memory"]["weights"] == pytest.approx(whole["memory"]["weights"], rel=0.15)
    assert staged["pp_comm_bytes_per_step_per_rank"] > 0 and whole.get("pp_comm_s", 0) == 0


def test_pp_split_moves_blocks_and_the_stages_work_and_memory_follow():
    """`pp_split` 5,7,7,5 of ViT-L's 24 blocks: the stages hold those blocks; the end stages, with fewer blocks,
    do less of the micro-batch's work than under the even cut, the middle ones more; 1F1B's first stage, which
    holds the most pieces, peaks lower with 5 blocks than with 6."""
    even, uneven = plan(4), plan(4, pp_split="5,7,7,5")
    assert [s["blocks"] for s in uneven["stages"]] == ["0-4", "5-11", "12-18", "19-23"]
    assert [s["blocks"] for s in even["stages"]] == ["0-5", "6-11", "12-17", "18-23"]
    for i in (0, 3):
        assert uneven["stages"][i]["micro_s"] < even["stages"][i]["micro_s"]
    for i in (1, 2):
        assert uneven["stages"][i]["micro_s"] > even["stages"][i]["micro_s"]
    assert uneven["stages"][0]["peak_bytes"] < even["stages"][0]["peak_bytes"]


def test_the_search_tries_the_cuts_and_writes_the_fastest(tmp_path):
    """plan.py --pp_sizes 4 on ViT-B/16's 12 blocks: the search estimates the even cut and 1 or 2 blocks moved
    off each end stage (pipeline.candidate_splits), a plan's pp_split is the fastest one's, and a recipe that
    sets pp_split is searched with that cut alone."""
    import contextlib
    import io
    import json

    import plan
    from parallel import pipeline

    assert pipeline.candidate_splits(12, 4) == ["", "2,4,4,2", "1,5,5,1"]

    def searched(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            plan.main(["--model", "vit-base", "--image_size", "224", "--num_labels", "1000", "--precision", "bf16",
                       "--world_size", "16", "--ranks_per_node", "8", "--device", "h100-80gb", "--global_batch",
                       "1024", "--pp_sizes", "4", "--json", "--top", "1000", *extra])
        return [e for e in json.loads(out.getvalue())["feasible"] if e["pp_size"] == 4]

    found = searched()
    assert {e["pp_split"] for e in found} == {"", "2,4,4,2", "1,5,5,1"}
    fastest = min(found, key=lambda e: e["step_s"])
    same = [e for e in found if (e["engine"], e["micro_batch_size"], e["ac"], e.get("reshard")) ==
            (fastest["engine"], fastest["micro_batch_size"], fastest["ac"], fastest.get("reshard"))]
    assert fastest["step_s"] == min(e["step_s"] for e in same) and len({e["pp_split"] for e in same}) == 3
    assert {e["pp_split"] for e in searched("--engine", "fsdp2", "--pp_size", "4", "--pp_split", "2,4,4,2")} == \
        {"2,4,4,2"}
