"""The layout's rules, read from the source: imports go one way and nothing edits sys.path.

The library is a stack of rooms, LAYERS, bottom first (docs/architecture.md): a module imports from its own room
and the rooms below it, never from one above, and no two library modules import each other (directly or round a
longer cycle). Entry scripts (`train.py`, `plan.py`, `export.py`, `sweep.py`, the scripts under `data/` and
`launch/`) and `benchmarks/` use the library; the library never imports them, and a benchmark never imports an
entry script. Every import counts, the ones inside functions too. The user's guide names the test behind each
bitwise claim it makes.
"""
import ast
import glob
import os
import re

from conftest import REPO

# the rooms, bottom first: each may import its own and those before it
LAYERS = (
    ("compat", "config"),  # private torch/DeepSpeed/transformers APIs, version-checked; every config key
    ("data",),  # shards, loaders, transforms
    ("models",),  # the registry, blocks, task heads
    ("parallel",),  # how a model splits across ranks (tensor parallelism)
    ("ac",),  # activation checkpointing: profile, policies, budget
    ("loop",),  # the loop's helpers: process group, optimizer, EMA, intervals, preemption, evaluation, timing
    ("runlog",),  # metrics.jsonl, TensorBoard, trackers, figures
    ("engine",),  # the Engine interface, its adapters and the one wrapping function
    ("checkpoints",),  # atomic checkpoints, resume, the Hugging Face export
    ("planner",),  # memory and step time of a configuration on a cluster
    ("launch",),  # one launcher of train.py
)
LIBRARY = tuple(room for layer in LAYERS for room in layer)
SCRIPTS = {"data.make_shards", "launch.cluster_env", "launch.cluster", "launch.schemas.refresh"}  # command-line scripts that live beside library code
ENTRY = {"train", "plan", "export", "sweep"}


def python_files():
    skip = {".venv", ".venv-device", ".git", ".whl", "runs", "__pycache__"}
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(root, name)


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


MODULES = {module_name(p): p for p in python_files()}


def imported(path: str) -> set:
    """The repository's modules a file imports, anywhere in it; `from pkg import name` names pkg.name when that
    is a module, else pkg."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                         for a in node.names)
    return {m for m in found if m in MODULES}


def kind(module: str) -> str:
    if module in SCRIPTS or module in ENTRY:
        return "entry"
    top = module.split(".")[0]
    return "library" if top in LIBRARY else top


GRAPH = {m: imported(p) for m, p in MODULES.items()}


def test_the_rules_see_the_repository():
    """The test reads what it means to: the library's modules, the entry scripts and the benchmarks are all found,
    and the edges it checks exist (the trainer imports the library)."""
    assert {"config", "engine.build", "models.registry", "data.loader", "train", "plan",
            "benchmarks.train_bench"} <= set(MODULES)
    assert {"config", "engine.build", "data.loader"} <= GRAPH["train"]


def test_the_library_never_imports_entry_scripts_benchmarks_or_tests():
    wrong = [f"{m} imports {d}" for m, deps in GRAPH.items() if kind(m) == "library"
             for d in sorted(deps) if kind(d) != "library"]
    assert not wrong, "\n".join(wrong)


def test_benchmarks_never_import_an_entry_script():
    wrong = [f"{m} imports {d}" for m, deps in GRAPH.items() if kind(m) == "benchmarks"
             for d in sorted(deps) if kind(d) in ("entry", "tests")]
    assert not wrong, "\n".join(wrong)


def library_cycles() -> list:
    """Every cycle among the library's modules, each as the path round it (Tarjan's strongly connected
    components: a component of more than one module, or a module importing itself, is a cycle)."""
    graph = {m: {d for d in deps if kind(d) == "library"} for m, deps in GRAPH.items() if kind(m) == "library"}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if module.split(".")[0] in rooms)


def upward_imports(graph: dict) -> list[str]:
    """Every import by a library module of a module in a room above its own."""
    return [f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})" for m, deps in sorted(graph.items())
            if kind(m) == "library" for d in sorted(deps) if kind(d) == "library" and layer(d) > layer(m)]


def test_imports_only_point_down_the_layers():
    assert not upward_imports(GRAPH), "\n".join(upward_imports(GRAPH))


def test_an_upward_import_is_found():
    """The layer check is not vacuous: a planted import of the engines by the models is reported."""
    planted = {**GRAPH, "models.registry": GRAPH["models.registry"] | {"engine.parallelize"}}
    assert upward_imports(planted) == ["models.registry (models) imports engine.parallelize (engine)"]


def test_every_library_room_is_in_a_layer():
    rooms = {m.split(".")[0] for m in MODULES if "." in m and kind(m) not in ("entry", "tests", "benchmarks")}
    rooms -= {"tests", "benchmarks", "docs", "configs"}
    assert rooms <= set(LIBRARY), rooms - set(LIBRARY)


def test_no_library_modules_import_each_other():
    assert not library_cycles(), library_cycles()


def test_the_cycle_finder_finds_a_cycle():
    """The checker above is not vacuous: a planted edge that closes a loop is found."""
    planted = next(d for d in sorted(GRAPH["engine.parallelize"]) if kind(d) == "library")
    GRAPH[planted].add("engine.parallelize")
    try:
        assert any({"engine.parallelize", planted} <= set(c) for c in library_cycles())
    finally:
        GRAPH[planted] = imported(MODULES[planted])


def test_one_free_port_and_one_launcher_of_train_py():
    """Every launch of train.py (benchmarks, sweep.py, the GPU check, the tests) builds its command line through
    launch/job.py, and one function finds a free port."""
    sources = {m: open(p).read() for m, p in MODULES.items()}
    assert [m for m, text in sources.items() if re.search(r"^def free_port\(", text, re.M)] == ["loop.distributed"]
    launcher_flags = r'"--nproc_per_node"|"--num_gpus"|"--main_process_port"|"torch\.distributed\.run"'
    assert [m for m, text in sources.items() if re.search(launcher_flags, text)
            and m != "tests.unit.test_structure"] == ["launch.job"]


def test_no_engine_is_named_outside_the_engines_room():
    """Which engine runs is asked of the engine (engine/base.py's interface), never by comparing its name or
    class outside engine/: no `cfg.engine == "fsdp2"`, no isinstance of an engine class. The benchmarks compare
    labels of what they ran through benchmarks/suites.py's constants, which come from the engine classes."""
    engine_name = r'["\'](deepspeed|fsdp2|ddp)["\']'
    tests = [rf"[=!]=\s*{engine_name}", rf"{engine_name}\s*[=!]=", rf"in \({engine_name}", r"isinstance\([^)]*Engine\b"]
    found = [f"{m}: {line.strip()}" for m, p in MODULES.items() if not m.startswith(("engine.", "tests"))
             for line in open(p) if any(re.search(t, line) for t in tests) and "launcher" not in line]
    assert not found, "\n".join(found)


def test_nothing_edits_sys_path():
    """Scripts run from the repository root (`python -m benchmarks.train_bench`) and pytest sets its own path
    (pytest.ini), so no file uses sys.path."""
    wrong = []
    for module, path in sorted(MODULES.items()):
        with open(path) as f:
            tree = ast.parse(f.read())
        wrong += [f"{module}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                  and isinstance(n.value, ast.Name) and n.value.id == "sys"]
    assert not wrong, wrong


# a claim of exactness: "bitwise", "bit for bit", "exact(ly)", "equal(s)" (not "equal policy" or "equal
# micro-batch", the benchmarks' names for a comparison's conditions)
CLAIMS = r"bitwise|bit for bit|\bexact(ly)?\b|\bequals?\b(?! (policy|micro-batch))"
# a claim of coverage: "under every ZeRO stage", "on each engine", "any number of ranks" (what was run), not a
# description ("every stage of Swin", "for each ZeRO stage the probe ...")
COVERAGE = (r"\b(under|at|on|across|in) (every|any|each|all) (`?ac`? )?(polic(y|ies)|ZeRO stages?|launchers?|tasks?|"
            r"engines?|precisions?|stages? and)\b|\b(any|every) number of ranks\b")
# a stated bound of this project's behaviour: "within 5%", "within 6 s", "within seconds"
BOUNDS = r"\bwithin (about )?[\d.,]+ ?(%|s\b|ms\b|seconds?\b|minutes?\b)|\bwithin (seconds|a second)\b"


def claims_in(prose: str) -> bool:
    """Whether a paragraph claims exactness, coverage or a bound. A sentence that states a target ("Target: within
    5%") defines a verdict, whose computation tests/unit/test_verdicts.py tests; it claims nothing."""
    sentences = [s for s in re.split(r"(?<=\.)\s+", prose) if not re.search(r"\btargets?\b", s, re.I)]
    return bool(re.search(CLAIMS, prose, re.I)) or any(re.search(f"{COVERAGE}|{BOUNDS}", s, re.I) for s in sentences)


def test_every_claim_in_the_docs_names_its_test():
    """Each paragraph of README.md and docs/ that claims exactness ("bitwise", "bit for bit", "exact", "equal"),
    coverage ("under every ZeRO stage", "any number of ranks") or a bound ("within 5%") names a test file under
    tests/ or a test function, and each one it names exists. Figure blocks (measurements, rendered from reports)
    and code blocks (commands, their output) are not prose."""
    names = set()
    for path in glob.glob(os.path.join(REPO, "tests", "**", "*.py"), recursive=True):
        names |= set(re.findall(r"^def (test_\w+)", open(path).read(), re.M))
    claims = 0
    for path in [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]:
        prose = re.sub(r"<!-- figures: [\w-]+ -->\n.*?<!-- /figures -->", "", open(path).read(), flags=re.S)
        prose = re.sub(r"^```.*?^```", "", prose, flags=re.S | re.M)
        for paragraph in re.split(r"\n\s*\n", prose):
            if not claims_in(paragraph):
                continue
            claims += 1
            files = re.findall(r"tests/([\w/]+\.py)", paragraph)
            tests = re.findall(r"\b(test_\w+)\b(?!\.py)", paragraph)
            where = f"{os.path.relpath(path, REPO)}: {paragraph[:120]!r}"
            assert files or tests, f"names no test: {where}"
            assert all(os.path.exists(os.path.join(REPO, "tests", f)) for f in files), where
            assert all(t in names for t in tests), where
    assert claims >= 10


def test_the_claims_rule_reads_coverage_and_bounds_and_not_targets_or_descriptions():
    assert claims_in("DeepSpeed skips such a step under every ZeRO stage and precision.")
    assert claims_in("A checkpoint resumes on any number of ranks.")
    assert claims_in("An exception ends the job within seconds.") and claims_in("It agrees within 5% of the run.")
    assert not claims_in("Target: within 5% either way.") and not claims_in("Swin needs every stage a window wide.")
    assert not claims_in("For each ZeRO stage the probe fits a line.")


def test_a_unit_test_cannot_start_a_process():
    """tests/conftest.py's guard over tests/unit/: a subprocess or a fork here fails, so this folder stays in-process."""
    import subprocess

    import pytest

    with pytest.raises(AssertionError, match="belongs in tests/integration"):
        subprocess.run(["true"])
    with pytest.raises(AssertionError, match="belongs in tests/integration"):
        os.fork()
