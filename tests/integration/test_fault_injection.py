"""The fast variant of benchmarks/fault_injection.py: one real 2-rank job per fault that the other reliability
tests do not already inject (a kill mid-save, mid-evaluation and mid-export, a failed and a full checkpoint disk, a
truncated shard, and preemption, stalls and a dead rank under the launchers not covered there), each continued with
`--resume latest` and compared with the uninterrupted debug run of conftest.stage_runs. The faults whose launcher
plays no part (the job killed whole, or not ended) hit jobs forked from conftest's zygote (`fork`)."""
import pytest
from conftest import DEBUG_ARGS, fork_start, launch

from benchmarks import fault_injection
from benchmarks.fault_injection import Episode, can_mount, run_all

CASES = [("kill-save", 3, "fork"), ("kill-eval", 2, "fork"), ("kill-export", 1, "fork"),
         ("enospc", 3, "fork"), ("disk-full", 2, "fork"), ("shard-truncate", 2, "fork"),
         pytest.param("sigterm", 2, "accelerate", marks=pytest.mark.slow),  # SIGTERM: also tests/integration/test_reliability.py
         # kill -9 of one rank: test_reliability's default case (deepspeed's launcher) and test_pipeline's slow one
         pytest.param("kill-rank", 3, "torchrun", marks=pytest.mark.slow),
         # a stall waits out dist_timeout; test_reliability stalls a rank under deepspeed's launcher by default
         pytest.param("stall", 2, "torchrun", marks=pytest.mark.slow),
         pytest.param("stall", 1, "accelerate", marks=pytest.mark.slow)]


def _id(case):
    kind, stage, launcher = case.values if hasattr(case, "values") else case
    return f"{kind}-zero{stage}-{launcher}"


@pytest.mark.parametrize("kind,stage,launcher", CASES, ids=[_id(c) for c in CASES])
def test_fault_is_survived(stage_runs, digits, tmp_path, monkeypatch, kind, stage, launcher):
    monkeypatch.setattr(fault_injection, "start", fork_start(fault_injection.start))
    if kind == "disk-full" and not can_mount():
        pytest.skip("mounting a tmpfs needs root or CAP_SYS_ADMIN; the enospc case covers a failing write")
    # checkpoints every 20 steps (not the reference's 30): saving changes no loss, and gives the kills a recent one
    base = DEBUG_ARGS + ["--model", "vit-debug", "--save_every", 20]
    ep = Episode(kind=kind, stage=stage, launcher=launcher, aim="")
    run_all([ep], 0, base, digits, {stage: stage_runs["vit-debug", stage]}, str(tmp_path), log=lambda s: None)
    detail = f"{ep}\n{open(tmp_path / f'000-{kind}' / 'log.txt').read()[-3000:]}"
    assert ep.hit, detail  # the fault landed where it was aimed
    assert ep.finished and not ep.lost, detail
    assert ep.losses_equal, detail
    if kind == "shard-truncate":
        assert ep.compared_steps > 0 and "data/skipped" in ep.counted, detail
        return
    assert ep.compared_steps == 60 and ep.weights_equal, detail
    if kind in ("enospc", "disk-full"):  # training went on: no relaunch
        assert ep.exit_codes == [0], detail
    else:  # the job ended, one relaunch continued it from the newest complete checkpoint
        assert len(ep.exit_codes) == 2 and ep.exit_codes[0] != 0 and ep.exit_codes[1] == 0, detail
        # at most the steps since the newest complete checkpoint; a kill mid-save loses the interval it was saving
        assert ep.steps_lost <= 20 if kind == "kill-save" else ep.steps_lost < 20, detail


@pytest.fixture(scope="module")
def fsdp2_reference(debug_args, tmp_path_factory):
    """The uninterrupted debug run under the FSDP2 engine, resharding (zero_stage 3)."""
    out = tmp_path_factory.mktemp("fsdp2") / "reference"
    launch(debug_args + ["--model", "vit-debug", "--engine", "fsdp2", "--zero_stage", 3, "--output_dir", out])
    return str(out)


# the FSDP2 engine's own paths: its DCP save killed half-way and failing on one rank in the default run; the rest
# under -m slow (`python -m benchmarks.fault_injection --engine fsdp2` runs every kind)
FSDP2_CASES = [("kill-save", "fork"), ("enospc", "fork"),
               *(pytest.param(kind, launcher, marks=pytest.mark.slow) for kind, launcher in
                 [("kill-rank", "torchrun"), ("sigterm", "torchrun"), ("nan", "fork"), ("shard-truncate", "fork")])]


@pytest.mark.parametrize("kind,launcher", FSDP2_CASES)
def test_fault_is_survived_under_fsdp2(fsdp2_reference, digits, tmp_path, monkeypatch, kind, launcher):
    """The same faults in FSDP2 jobs: a kill mid-save leaves the previous DCP checkpoint to resume bitwise; a
    rank's failed DCP write (ENOSPC) is one warning on every rank and training goes on; a kill, SIGTERM, a NaN
    step and a truncated shard are met as under DeepSpeed."""
    monkeypatch.setattr(fault_injection, "start", fork_start(fault_injection.start))
    base = DEBUG_ARGS + ["--model", "vit-debug", "--save_every", 20, "--engine", "fsdp2"]
    ep = Episode(kind=kind, stage=3, launcher=launcher, aim="")
    run_all([ep], 0, base, digits, {3: fsdp2_reference}, str(tmp_path), log=lambda s: None)
    detail = f"{ep}\n{open(tmp_path / f'000-{kind}' / 'log.txt').read()[-3000:]}"
    assert ep.hit and ep.finished and not ep.lost and ep.losses_equal, detail
    if kind in ("nan", "shard-truncate"):
        assert ep.compared_steps > 0 and ep.counted, detail
        return
    assert ep.compared_steps == 60 and ep.weights_equal, detail
    assert ep.exit_codes == [0] if kind == "enospc" else ep.exit_codes[-1] == 0 and len(ep.exit_codes) == 2, detail


def test_episodes_are_drawn_from_the_seed():
    from benchmarks.fault_injection import KINDS, draw

    n = 2 * len(KINDS)
    a, b = draw(n, list(KINDS), seed=3), draw(n, list(KINDS), seed=3)
    assert [(e.kind, e.stage, e.launcher) for e in a] == [(e.kind, e.stage, e.launcher) for e in b]
    assert {e.kind for e in a} == set(KINDS)  # twice as many faults as kinds: every kind exactly twice
    assert {sum(e.kind == k for e in a) for k in KINDS} == {2}
