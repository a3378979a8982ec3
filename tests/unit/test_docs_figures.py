"""The figure blocks of README.md and docs/ against the committed reports they are rendered from
(benchmarks/docs.py): they agree; a figure typed over is caught; a report marked stale in its header is shown
stale where its figures appear."""
import os
import re
import shutil

import pytest
from conftest import REPO

from benchmarks import docs


def test_every_figure_block_agrees_with_its_report(capsys):
    assert docs.main(["--check"]) == 0, capsys.readouterr().err
    blocks = {m.group(2) for doc in docs.DOCS for m in docs.BLOCK.finditer(open(os.path.join(REPO, doc)).read())}
    # every renderer is used, no block names an unknown one, and every worked plan with a search is rendered
    assert {b for b in blocks if not b.startswith("plan-")} == set(docs.RENDERERS)
    plans = os.path.join(REPO, "docs", "plans")
    assert {b[len("plan-"):] for b in blocks if b.startswith("plan-")} == \
        {d for d in os.listdir(plans) if os.path.isfile(os.path.join(plans, d, "search.md"))}


def copy_docs(tmp_path):
    for doc in docs.DOCS:
        os.makedirs(tmp_path / os.path.dirname(doc), exist_ok=True)
        shutil.copy(os.path.join(REPO, doc), tmp_path / doc)


def test_a_figure_typed_over_is_caught_and_rewritten(tmp_path, capsys):
    copy_docs(tmp_path)
    page = tmp_path / "docs" / "benchmarks.md"
    text = page.read_text()
    assert "1,044" in text  # the H200 line's FSDP2 + light images/s, from the GPU check's results.json
    page.write_text(text.replace("1,044", "1,444", 1))
    assert docs.main(["--check"], root=str(tmp_path)) == 1
    assert "docs/benchmarks.md: h200-line" in capsys.readouterr().err
    assert docs.main([], root=str(tmp_path)) == 0  # rewritten from the report
    assert page.read_text() == text and docs.main(["--check"], root=str(tmp_path)) == 0


def test_an_unknown_block_is_an_error(tmp_path):
    with pytest.raises(KeyError, match="unknown figure block 'nothing'"):
        docs.render("README.md", "<!-- figures: nothing -->\nx\n<!-- /figures -->\n")


def test_a_report_marked_stale_says_so_in_its_header_and_in_the_docs(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(os.path.join(docs.RESULTS, "async-save"), results / "async-save")
    report = results / "async-save" / "report.md"
    report.write_text(re.sub(r"\n\*\*Stale\*\* since [^\n]*\n", "", report.read_text(), count=1))  # as if fresh
    monkeypatch.setattr(docs, "RESULTS", str(results))
    fresh = docs.async_save("docs/engines.md")
    assert "**stale**" not in fresh
    docs.mark_stale(str(results / "async-save"), "abc1234", "the writer changed")
    header = (results / "async-save" / "report.md").read_text().split("\n## ")[0]
    assert header.splitlines()[2] == "**Stale** since `abc1234`: the writer changed"
    docs.mark_stale(str(results / "async-save"), "def5678", "again")  # replaced, not added
    header = (results / "async-save" / "report.md").read_text()
    assert header.count("**Stale**") == 1 and "since `def5678`: again" in header
    assert ", **stale** since `def5678`" in docs.async_save("docs/engines.md")


def test_the_policy_table_reads_the_suite_as_its_report_does():
    """The rendered step times are the suite's own paired ratios (benchmarks.report.speed_ratio), not medians:
    the cpu report's selective rows give the same interval."""
    from benchmarks.report import speed_ratio

    results = docs.runs(os.path.join(docs.RESULTS, "cpu"))
    vit = next(r["shape"] for r in results if r["shape"].startswith("ViT-S"))
    r = speed_ratio(results, vit, "FSDP2 + none", "FSDP2 + selective")
    table = docs.policy_table("README.md")
    assert f"ViT-S: −44% activations, step time {docs.interval_pct(r)}" in table
