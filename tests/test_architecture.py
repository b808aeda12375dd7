"""Rules of the package's shape, read from the source with `ast` (except the last, which imports):
one name per concept (no top-level class name defined in two modules), no import cycle
among the modules' module-level imports, and none among the subpackages (the layers), counting
the imports inside functions too (a lazy import hides a cycle between layers, it does not remove it).
The modules docs/ARCHITECTURE.md calls pure are imported, each in a fresh interpreter, and must load
nothing heavy (no SQLAlchemy, torch, vLLM, HTTP server...)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tiderl"
ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"
# What a pure module must not load: the database, the accelerators' stacks, HTTP, array and weight files, Slurm.
HEAVY = ("sqlalchemy", "psycopg", "torch", "vllm", "transformers", "aiohttp", "numpy", "safetensors", "submitit")
# Pure modules the code map names outside the diagram's `pure` line: Slurm as text, and the observability
# package's face (its entry points load their modules only when named).
MORE_PURE = ("tiderl.slurm.sbatch", "tiderl.slurm.submit", "tiderl.slurm.states", "tiderl.observe")


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a package is its `__init__.py`)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def duplicated_class_names(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Top-level class names defined in more than one module -> those modules."""
    defined: dict[str, list[str]] = {}
    for name, path in modules.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(name)
    return {cls: where for cls, where in sorted(defined.items()) if len(where) > 1}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: top level, in `if`/`try` blocks, not under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level_imports(block)


def _all_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import of the module, inside functions too, but not under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _all_imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, ()):
                    if isinstance(child, ast.ExceptHandler):
                        yield from _all_imports(child.body)
                    elif isinstance(child, ast.stmt):
                        yield from _all_imports([child])


def import_graph(modules: dict[str, Path], *, inside_functions: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (with `inside_functions`, anywhere). `from a.b import c` is the module
    `a.b.c` when that is a module, else `a.b`; relative imports are resolved against the importer.
    Importing `a.b.c` also runs the packages `a.b` and `a` first: those count too, except the
    importer's own packages (a package's `__init__` importing its submodules is no cycle)."""
    root = next(iter(modules)).split(".")[0]
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        body = ast.parse(path.read_text(), str(path)).body
        for node in (_all_imports(body) if inside_functions else _module_level_imports(body)):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
        parents = {".".join(t.split(".")[:i]) for t in targets for i in range(1, t.count(".") + 1)}
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {t for t in targets | (parents - own)
                       if t in modules and t != name and t.split(".")[0] == root}
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto the root's direct children (`a.b.c` -> `a.b`): which layer uses which."""
    def layer(module: str) -> str:
        return ".".join(module.split(".")[:2])
    folded: dict[str, set[str]] = {}
    for name, targets in graph.items():
        folded.setdefault(layer(name), set()).update(layer(t) for t in targets if layer(t) != layer(name))
    return folded


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None if it has none (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)):
            return cycle
    return None


def test_no_class_name_is_defined_in_two_modules():
    duplicates = duplicated_class_names(module_files())
    assert not duplicates, "one name per concept; rename or merge: " + "; ".join(
        f"{cls} in {', '.join(where)}" for cls, where in duplicates.items())


def test_no_module_level_import_cycle():
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_between_subpackages():
    graph = import_graph(module_files(), inside_functions=True)
    cycle = find_cycle(package_graph(graph))
    edges = [f"{a} -> {b}" for a, b in zip(cycle or [], (cycle or [])[1:])]
    culprits = [f"{m} imports {t}" for pair in edges for m, targets in sorted(graph.items()) for t in sorted(targets)
                if f"{'.'.join(m.split('.')[:2])} -> {'.'.join(t.split('.')[:2])}" == pair]
    assert cycle is None, (f"import cycle between subpackages: {' -> '.join(cycle or [])} ({'; '.join(culprits)}); "
                           "move what both need to a module that imports neither")


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_the_checks_see_a_duplicate_and_a_cycle(tmp_path: Path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.sub import b\nclass Thing:\n    pass\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "import typing\nfrom pkg.c import helper\nclass Thing:\n    pass\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                    "def helper():\n    from pkg import a\n",
    })
    modules = module_files(pkg)
    assert duplicated_class_names(modules) == {"Thing": ["pkg.a", "pkg.sub.b"]}
    # Imports under TYPE_CHECKING and inside functions do not count at module level; between layers the
    # ones inside functions do.
    assert find_cycle(import_graph(modules)) is None
    assert find_cycle(package_graph(import_graph(modules, inside_functions=True))) == ["pkg.a", "pkg.sub", "pkg.c",
                                                                                       "pkg.a"]
    (pkg / "c.py").write_text("from .a import Thing\n")  # relative, resolved to pkg.a
    assert find_cycle(import_graph(modules)) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    # No module cycle, but a layer cycle: `import pkg.e.f` runs `pkg/e/__init__.py` first, which
    # imports `pkg.d`, which imports `pkg.sub`.
    (pkg / "c.py").write_text("")
    _write(tmp_path, {"pkg/d.py": "from pkg.sub import b\n", "pkg/sub/x.py": "import pkg.e.f\n",
                      "pkg/e/__init__.py": "from pkg import d\n", "pkg/e/f.py": ""})
    modules = module_files(pkg)
    assert "pkg.e" in import_graph(modules)["pkg.sub.x"]
    assert find_cycle(import_graph(modules)) is None
    assert find_cycle(package_graph(import_graph(modules))) == ["pkg.sub", "pkg.e", "pkg.d", "pkg.sub"]


def test_the_run_package_names_its_types():
    """No `Any` in tiderl/run (issue 17): the rank and control processes pass typed records; the status
    document's formatting lives with it in tiderl/observe/status.py."""
    import re

    found = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in sorted((PACKAGE / "run").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bAny\b", line)]
    assert found == []


def test_a_module_over_450_lines_says_why_at_its_top():
    """Issue 17: no file over 450 lines without a sentence at its top saying why."""
    long = {name: path for name, path in module_files().items() if len(path.read_text().splitlines()) > 450}
    silent = [name for name, path in long.items()
              if "Over 450 lines" not in (ast.get_docstring(ast.parse(path.read_text())) or "")]
    assert silent == []


# ---- pure modules load nothing heavy -------------------------------------------------------------

def documented_pure_modules(doc: Path = ARCHITECTURE) -> list[str]:
    """The modules on the `pure` line (and its continuation lines) of the module diagram in `doc`:
    `policy/ (ctb, ra2p)` is tiderl.policy.ctb and tiderl.policy.ra2p, `run/rollout_tick.py` is
    tiderl.run.rollout_tick."""
    diagram = doc.read_text().split("## Modules, and each role's loop", 1)[1].split("```")[1].splitlines()
    start = next(i for i, line in enumerate(diagram) if line.split()[:1] == ["pure"])
    text = diagram[start].split("pure", 1)[1]
    for line in diagram[start + 1:]:
        if line[:14].strip():  # the next layer's label
            break
        text += " " + line
    modules = []
    for package, names in re.findall(r"([\w/]+)/ \(([^)]*)\)", text):
        modules += [f"tiderl.{package.replace('/', '.')}.{n.strip()}" for n in names.split(",")]
    text = re.sub(r"[\w/]+/ \([^)]*\)", " ", text)
    modules += ["tiderl." + m.removesuffix(".py").replace("/", ".") for m in re.findall(r"[\w/]+\.py", text)]
    return modules


def heavy_modules_loaded(module: str) -> list[str]:
    """The heavy top-level packages that importing `module` loads, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", f"import {module}, sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=PACKAGE.parent, timeout=120)
    return sorted({name.split(".")[0] for name in out.stdout.split()} & set(HEAVY))


PURE_MODULES = documented_pure_modules() + list(MORE_PURE)


def test_the_docs_name_the_pure_modules_and_each_exists():
    assert {"tiderl.policy.ers", "tiderl.run.rollout_tick", "tiderl.systems", "tiderl.store.types"} <= set(PURE_MODULES)
    assert [m for m in PURE_MODULES if m not in module_files()] == []


@pytest.mark.parametrize("module", PURE_MODULES)
def test_a_pure_module_loads_nothing_heavy(module: str):
    assert heavy_modules_loaded(module) == [], f"{module} is documented pure but loads them"


def test_the_pure_check_sees_a_heavy_import():
    assert "sqlalchemy" in heavy_modules_loaded("tiderl.store.runstore")
    assert heavy_modules_loaded("tiderl.store") == []  # the package loads SQLAlchemy only when RunStore is named
