"""
The repository's layout: the files at the top, imports that flow down (lowbit/ imports nothing above
it, no cycle, short chains) and the packaging (`pip install .` installs the papers' files, the model
and the engine, and everything they import).
"""
import ast
import os
import shutil
import subprocess
import sys

from tests.helpers import ROOT

TOP_FILES = {"codebooks.py", "gaussws.py", "adam4bit.py", "model.py", "data.py", "train.py", "bench.py", "test_all.py",
             "conftest.py"}
PACKAGES = ("lowbit", "trainer", "benchmarks", "experiments", "examples")   # folders of importable modules
INSTALLED = {"adam4bit", "gaussws", "codebooks", "model", "lowbit"}


def _modules():
    """{dotted name: path} of the repository's modules: the top-level files (the tests aside) and every
    .py file under the packages (a package's __init__.py by the package's name)."""
    mods = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT)
            if f.endswith(".py") and f not in ("test_all.py", "conftest.py")}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                    mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, f)
    return mods


def _imports(name, path, mods):
    """The repository's modules that module `name` imports anywhere in its file (function-level
    imports too): `from pkg import sub` names the submodule where it is one, else the package."""
    found = set()
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:          # `import a.b.c`: the deepest module of the repository
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph():
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _unit(name):
    """A top-level package's modules are one unit of an import chain, a top-level file its own."""
    return name.split(".")[0]


def test_the_top_level_holds_the_designs_files_only():
    """A reader who opens the repository sees the design's files and folders named for what they hold."""
    top = {f for f in os.listdir(ROOT) if f.endswith(".py")}
    assert top == TOP_FILES, f"unexpected: {sorted(top - TOP_FILES)}, missing: {sorted(TOP_FILES - top)}"
    for pkg in PACKAGES:
        assert os.path.isdir(os.path.join(ROOT, pkg)), pkg


def test_lowbit_imports_nothing_above_it():
    """The engine under both papers' files imports none of the top-level files, nor trainer/,
    benchmarks/, experiments/ or examples/, anywhere in a file: what it needs from above is handed
    down as a tensor, an argument or a subclass."""
    graph = _graph()
    up = sorted((m, d) for m in graph if m.split(".")[0] == "lowbit" for d in graph[m] if _unit(d) != "lowbit")
    assert not up, "lowbit/ imports from above it: " + ", ".join(f"{m} -> {d}" for m, d in up)


def test_no_import_cycle_among_the_repositorys_modules():
    """Every import (at top level or inside a function) between the repository's modules, package
    modules by their dotted names: a cycle is a circle a reader cannot follow from one file to the
    next."""
    graph = _graph()
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def longest_import_chain():
    """The longest chain of imports a -> b -> ... among the repository's modules, as (length, chain),
    a run of modules inside one top-level package counting once (train -> trainer.flags ->
    trainer.util -> lowbit.x: 3)."""
    graph = _graph()
    best = {}

    def longest(m, seen):
        if m in best:
            return best[m]
        length, chain = 1, [m]
        for d in graph[m]:
            if d in seen:                       # a cycle: the test above names it
                continue
            n, c = longest(d, seen | {d})
            n += _unit(d) != _unit(m)
            if n > length:
                length, chain = n, [m] + c
        best[m] = length, chain
        return best[m]
    return max(longest(m, {m}) for m in sorted(graph))


def test_the_longest_import_chain_is_at_most_8():
    """From any module down to the bottom, at most 8 files (or packages) to read."""
    length, chain = longest_import_chain()
    assert length <= 8, f"{length}: " + " -> ".join(chain)


def test_pip_install_gives_the_papers_files_the_model_and_lowbit_and_what_they_import(tmp_path):
    """`pip install .` (into a folder) installs adam4bit, gaussws, codebooks, model and lowbit (with all
    its subpackages) at the top and nothing else; every repository module an installed one imports is
    installed, and each installed module imports from that folder alone."""
    src, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "data", "results", "out", "out-*", "tests",
                                                             "__pycache__", "build", "*.egg-info", "*.pt"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    top = {f[:-3] if f.endswith(".py") else f for f in os.listdir(target)
           if not f.endswith((".dist-info", ".egg-info")) and f not in ("__pycache__", "bin")}
    assert top == INSTALLED, sorted(top)
    installed = {m for m in _modules() if _unit(m) in INSTALLED}
    lowbit = {os.path.relpath(os.path.join(d, f), target) for d, _, fs in os.walk(target / "lowbit")
              for f in fs if f.endswith(".py")}
    assert lowbit == {os.path.relpath(p, ROOT) for m, p in _modules().items() if _unit(m) == "lowbit"}
    graph = _graph()
    missing = sorted((m, d) for m in installed for d in graph[m] if d not in installed)
    assert not missing, f"imported by an installed module but not installed: {missing}"
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in sorted(installed))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(target)))
    assert r.returncode == 0, r.stderr[-3000:]
