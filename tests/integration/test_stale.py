"""Stale means stale: every committed report whose measured code changed after it ran (git log of the paths
benchmarks/stale.py names for it) says so in its header, and the check sees a change where there is one."""
import os
import shutil
import subprocess

import pytest

from benchmarks import stale

shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=stale.REPO, capture_output=True,
                         text=True).stdout.strip() != "false"


@pytest.mark.skipif(shallow, reason="a shallow clone has no history to check the reports against")
def test_every_report_whose_measured_code_changed_after_it_ran_says_it_is_stale():
    unmarked = [f"{folder} (ran at {commit[:7]}; {stale.why(folder, commits, dirty)})"
                for folder, commit, commits, dirty, marked in stale.check() if not marked]
    assert not unmarked, ("reports whose measured code changed without a Stale line (rerun them, or "
                          "python -m benchmarks.stale --mark):\n" + "\n".join(unmarked))


@pytest.mark.skipif(shallow, reason="a shallow clone has no history to check the reports against")
def test_the_check_sees_a_committed_change_and_none_where_there_is_none():
    first = stale.git("rev-list", "--max-parents=0", "HEAD").split()[0]
    commits, _ = stale.changed_since(first, ["train.py"])
    assert commits and commits == stale.git("log", "--reverse", "--format=%h", f"{first}..HEAD", "--",
                                            "train.py").split()
    assert stale.changed_since(stale.git("rev-parse", "HEAD"), ["benchmarks/results/"])[0] == []
    # every folder that holds a report is named (a new report must say what it measures)
    assert set(stale.report_folders()) <= set(stale.MEASURED)


def test_a_mark_goes_under_the_title_and_is_read_back(tmp_path, monkeypatch):
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "report.md").write_text("# A suite, 2026-12-01\n\nIt ran.\n\n## Results\n\n**Stale** in a body is not a mark\n")
    monkeypatch.setattr(stale, "RESULTS", str(tmp_path))
    assert not stale.says_stale("suite")
    stale.mark_stale(str(folder), "abc1234", "engine/ changed after this run")
    assert stale.says_stale("suite")
    text = (folder / "report.md").read_text()
    assert text.startswith("# A suite, 2026-12-01\n\n**Stale** since `abc1234`: engine/ changed") and "It ran." in text
    shutil.rmtree(folder)
    assert not os.path.exists(folder)
