"""Which committed reports are stale: the code a report measures changed after it ran, by `git log`.

    .venv/bin/python -m benchmarks.stale            # list the reports whose measured code changed; exit 1 if one
                                                    # of them does not say so in its header
    .venv/bin/python -m benchmarks.stale --mark     # write the **Stale** line into each of those headers
    .venv/bin/python -m benchmarks.stale --checked WHY   # or: reviewed, they leave the figures as they were

MEASURED names, for every report folder under benchmarks/results/, the paths whose change can move its figures
(or why none are checked). A report ran at the commit its environment.json (`git_commit`) or its header
(`commit <hash>`) names, else at the last commit that changed its data files (any but .md and .png); a
`**Checked** at <commit>: <why>` line in its header moves that to a later commit whose changes were reviewed and
leave its figures as they are (the reason stays in the header for a reader to judge). It is stale when `git log` shows a
commit touching a measured path after that one, or the working tree changes one. tests/integration/test_stale.py runs
the check: a change to measured code fails the suite until its reports are rerun or marked.
"""
import argparse
import json
import os
import re
import subprocess
import sys

from benchmarks.docs import REPO, STALE, mark_stale

RESULTS = os.path.join(REPO, "benchmarks", "results")

# what train.py runs, what the benchmark worker runs, and the planner
TRAINER = ("train.py", "config.py", "compat.py", "engine/", "loop/", "data/", "models/", "ac/", "parallel/",
           "checkpoints/", "launch/")
WORKER = ("benchmarks/bench_worker.py", "benchmarks/train_bench.py", "benchmarks/measure.py", "engine/", "ac/",
          "models/", "parallel/", "compat.py", "config.py")
PLANNER = ("plan.py", "planner/")

MEASURED = {
    "async-save": TRAINER + ("benchmarks/async_save.py",),
    "build-memory": ("benchmarks/build_memory.py", "engine/", "models/", "parallel/", "compat.py", "config.py"),
    "convergence": TRAINER + ("benchmarks/convergence.py", "configs/digits-vit.yaml"),
    "cpu": WORKER + PLANNER + ("benchmarks/suites.py", "benchmarks/report.py"),
    "data": ("data/", "benchmarks/data_bench.py"),
    "digits-tasks": TRAINER + ("benchmarks/digits_tasks.py", "configs/"),
    "ds-tuning-host": WORKER + ("benchmarks/ds_tuning.py",),
    "ds-tuning-vit-s": WORKER + ("benchmarks/ds_tuning.py",),
    "ds-tuning-persistence/host": WORKER + ("benchmarks/ds_tuning.py",),
    "ds-tuning-persistence/vit-s": WORKER + ("benchmarks/ds_tuning.py",),
    "faults": TRAINER + ("benchmarks/fault_injection.py", "benchmarks/inject/"),
    "faults-fsdp2": TRAINER + ("benchmarks/fault_injection.py", "benchmarks/inject/"),
    "gpu-check": TRAINER + WORKER + ("benchmarks/gpu_check.py", "benchmarks/gpu_check.sh"),
    "gpu-check/2026-12-04-v2": TRAINER + WORKER + ("benchmarks/gpu_check.py", "benchmarks/gpu_check.sh"),
    "host": WORKER + PLANNER + ("benchmarks/suites.py", "benchmarks/report.py"),
    "host-compiled": WORKER + PLANNER + ("benchmarks/suites.py", "benchmarks/report.py"),
    "host-light": WORKER + ("benchmarks/suites.py", "benchmarks/report.py"),
    "pipeline/digits": TRAINER + ("configs/digits-vit.yaml",),
    "race": WORKER + TRAINER + PLANNER + ("benchmarks/race.py", "benchmarks/suites.py", "benchmarks/report.py"),
    "scaling": TRAINER + PLANNER + ("benchmarks/scaling.py", "configs/digits-vit.yaml"),
    "sequence": WORKER + PLANNER + ("benchmarks/sequence_bench.py",),
    "sequence/digits": TRAINER + ("configs/digits-vit.yaml",),
    "sequence/deepspeed-ulysses": ("benchmarks/ulysses_check.py", "parallel/sequence.py", "compat.py", "models/"),
    "sweep-digits": TRAINER + PLANNER + ("sweep.py", "configs/sweeps/digits.yaml", "configs/digits-vit.yaml"),
    "task-memory": TRAINER + PLANNER + ("benchmarks/task_memory.py",),
    "trainer": TRAINER + WORKER + ("benchmarks/trainer_check.py",),
    "trainer-fsdp2": TRAINER + WORKER + ("benchmarks/trainer_check.py",),
    "trainer/zero3-selective": TRAINER + WORKER + ("benchmarks/trainer_check.py",),
    # not a measurement of one commit's code
    "clean-clone": None,  # one row per clean clone, each with its own commit
    "slow-tests": None,  # a record of the last `make test-slow`, its commit in it
    "planner-analysis": None,  # a dated analysis of the runs it names
    "gpu-check/2026-12-04-parts-1-4": None,  # the first version's raw parts, superseded (gpu-check/report.md)
    "gpu-check/2026-12-04-parts-1-6": None,
}

REPORT_FILES = ("report.md", "results.md", "README.md")
COMMIT = re.compile(r"\bcommit\W{1,3}([0-9a-f]{7,40})\b", re.I)
CHECKED = re.compile(r"^\*\*Checked\*\* at `?([0-9a-f]{7,40})`?: (.+)$", re.M)


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def report_file(folder: str) -> str | None:
    for name in REPORT_FILES:
        path = os.path.join(RESULTS, folder, name)
        if os.path.exists(path):
            return path
    return None


def report_folders() -> list:
    """Every folder under benchmarks/results/ (and one level below) that holds a report."""
    out = []
    for name in sorted(os.listdir(RESULTS)):
        if not os.path.isdir(os.path.join(RESULTS, name)):
            continue
        if report_file(name):
            out.append(name)
        for sub in sorted(os.listdir(os.path.join(RESULTS, name))):
            if os.path.isdir(os.path.join(RESULTS, name, sub)) and report_file(f"{name}/{sub}"):
                out.append(f"{name}/{sub}")
    return out


def ran_at(folder: str) -> str:
    """The commit the report's figures stand at: a `**Checked** at <commit>: <why>` line in its header (a reviewed
    later commit whose changes leave the figures as they are, with the reason), else the commit it ran at."""
    head = open(report_file(folder)).read().split("\n## ", 1)[0]
    if m := CHECKED.search(head):
        return git("rev-parse", m.group(1))
    return ran(folder)


def ran(folder: str) -> str:
    """The commit the report ran at: environment.json's git_commit, its header's `commit <hash>`, or the last commit
    that changed its data files (not its .md, where stale marks go, nor its pictures)."""
    env = os.path.join(RESULTS, folder, "environment.json")
    if os.path.exists(env):
        commit = str(json.load(open(env)).get("git_commit") or "").split(" ")[0]
        if re.fullmatch(r"[0-9a-f]{7,40}", commit):
            return git("rev-parse", commit)
    head = open(report_file(folder)).read().split("\n## ", 1)[0]
    if m := COMMIT.search(CHECKED.sub("", STALE.sub("", head))):
        return git("rev-parse", m.group(1))
    data = [os.path.join("benchmarks", "results", folder, f) for f in sorted(os.listdir(os.path.join(RESULTS, folder)))
            if os.path.isfile(os.path.join(RESULTS, folder, f)) and not f.endswith((".md", ".png"))]
    return git("log", "-1", "--format=%H", "--", *(data or [os.path.join("benchmarks", "results", folder)]))


def changed_since(commit: str, paths) -> tuple[list, list]:
    """(the commits after `commit` that touch `paths`, oldest first; the paths the working tree changes)."""
    paths = [p for p in paths if os.path.exists(os.path.join(REPO, p)) or p.endswith("/")]
    commits = git("log", "--reverse", "--format=%h", f"{commit}..HEAD", "--", *paths).split()
    dirty = git("diff", "--name-only", "HEAD", "--", *paths).split()
    return commits, dirty


def says_stale(folder: str) -> bool:
    return bool(STALE.search(open(report_file(folder)).read().split("\n## ", 1)[0]))


def check() -> list:
    """Every checked report whose measured code changed after it ran: (folder, commit it ran at, the changing
    commits, the changed working-tree paths, whether its header says stale)."""
    out = []
    for folder in report_folders():
        if folder not in MEASURED:
            raise KeyError(f"benchmarks/results/{folder}: not in benchmarks/stale.py's MEASURED (name the paths "
                           f"whose change makes it stale, or None with the reason)")
        if MEASURED[folder] is None:
            continue
        commit = ran_at(folder)
        commits, dirty = changed_since(commit, MEASURED[folder])
        if commits or dirty:
            out.append((folder, commit, commits, dirty, says_stale(folder)))
    return out


def why(folder: str, commits: list, dirty: list) -> str:
    paths = set(dirty)
    for c in commits:
        paths |= set(git("show", "--format=", "--name-only", c, "--", *MEASURED[folder]).split())
    tops = sorted({p.split("/")[0] + ("/" if "/" in p else "") for p in paths})
    count = f"{len(commits)} commit{'s' if len(commits) != 1 else ''}" + (" and uncommitted changes" if dirty else "")
    return f"its measured code changed after this run ({', '.join(tops)}; {count})"


def add_checked(folder: str, commit: str, reason: str):
    """`**Checked** at <commit>: <the reasons so far>; <reason>` in the report's header (after its title)."""
    path = report_file(folder)
    text = open(path).read()
    head, sep, rest = text.partition("\n## ")
    if m := CHECKED.search(head):
        line = f"**Checked** at `{commit}`: {m.group(2).rstrip('.')}; {reason}"
        head = head[:m.start()] + line + head[m.end():]
    else:
        title, _, body = head.partition("\n")
        head = f"{title}\n\n**Checked** at `{commit}`: {reason}\n{body}"
    with open(path, "w") as f:
        f.write(head + sep + rest)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mark", action="store_true", help="write the Stale line into each stale report without one")
    p.add_argument("--checked", metavar="WHY",
                   help="the changes since each unmarked stale report ran were reviewed and leave its figures as they "
                        "are, because WHY: move its Checked line to HEAD (committed), WHY added to its reasons")
    a = p.parse_args(argv)
    if git("rev-parse", "--is-shallow-repository") == "true":
        print("a shallow clone: the history to check against is missing (git fetch --unshallow)", file=sys.stderr)
        return 2
    unmarked = []
    for folder, commit, commits, dirty, marked in check():
        since = commits[0] if commits else git("rev-parse", "--short", "HEAD")
        state = "marked" if marked else "NOT MARKED"
        print(f"{folder}: ran at {commit[:7]}; since then {why(folder, commits, dirty)} [{state}]")
        if not marked:
            if a.checked:
                if dirty:
                    print(f"{folder}: commit the changes first (--checked moves the line to a commit)", file=sys.stderr)
                    return 2
                add_checked(folder, git("rev-parse", "--short", "HEAD"), a.checked)
            elif a.mark:
                mark_stale(os.path.join(RESULTS, folder), since, why(folder, commits, dirty))
            else:
                unmarked.append(folder)
    if unmarked:
        print(f"stale without saying so: {', '.join(unmarked)} (rerun them, or python -m benchmarks.stale --mark)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
