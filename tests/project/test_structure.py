"""The package's import structure (docs/architecture.md, "Rules"), read from the source: module-level and
function-level imports (TYPE_CHECKING blocks included) all count.

- no import cycle;
- production code never imports `spindle.testing`, nor a family's conformance spec (`spindle/models/<family>/
  conformance.py`, `spindle/models/shared/conformance.py`: test data the suites find by family name);
- `spindle.contracts` imports nothing of Spindle outside itself (the leaf every layer may import);
- the engines (`infer/`, `train/`, `distributed/`, `serve/`) never import the registry or a family
  module: entry points resolve the family and pass it in;
- the families (`spindle.models`) never import an engine (`train/`, `infer/`, `serve/`): what both use
  (flow-matching math, model_index.json reading) lives below both (`spindle.ops`, `spindle.model_index`);
- `spindle.ops` (numerics that generated modeling code imports) imports nothing above it;
- compose, don't inherit: no class inherits two or more of Spindle's own classes (a family variant holds a
  part its base calls, e.g. Wan2.2's two experts, Kontext's reference tokens).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "spindle"
ENGINES = ("spindle.infer", "spindle.train", "spindle.distributed", "spindle.serve")
# what a family may not import: the engines that run it (distributed/ is the mesh code both sides share)
FAMILY_FORBIDDEN = ("spindle.train", "spindle.infer", "spindle.serve")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def read_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "generated" not in p.parts}


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The Spindle modules `name` imports anywhere in its body (the longest known module a name refers to)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("spindle"):
                out.add(target)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = read_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_import_cycle(graph):
    assert cycles(graph) == []


def test_the_cycle_check_sees_function_level_imports(tmp_path):
    """The checker itself: a cycle closed only by an import inside a function is found."""
    (tmp_path / "a.py").write_text("import spindle.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from spindle import a\n")
    modules = {"spindle.a": tmp_path / "a.py", "spindle.b": tmp_path / "b.py"}
    g = {n: imported(n, p, modules) for n, p in modules.items()}
    assert cycles(g) == [["spindle.a", "spindle.b"]]


def test_production_never_imports_testing(graph):
    offenders = {m: sorted(t for t in ts if inside(t, "spindle.testing")) for m, ts in graph.items()}
    assert {m: t for m, t in offenders.items() if t and not inside(m, "spindle.testing")} == {}


def is_conformance_spec(module: str) -> bool:
    """A family's conformance spec module (or the spec classes and helpers they share): test data under models/."""
    return inside(module, "spindle.models") and module.rpartition(".")[2] == "conformance"


def test_production_never_imports_a_conformance_spec(graph):
    """The records carry no test data: only spindle.testing (which finds a spec by family name) and other spec
    modules (a variant's spec derived from its base's) import them."""
    offenders = {
        m: sorted(t for t in ts if is_conformance_spec(t))
        for m, ts in graph.items()
        if not inside(m, "spindle.testing") and not is_conformance_spec(m)
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_contracts_import_nothing_of_spindle(graph):
    leaks = {m: sorted(t for t in ts if not inside(t, "spindle.contracts")) for m, ts in graph.items()}
    assert {m: t for m, t in leaks.items() if t and inside(m, "spindle.contracts")} == {}


def test_engines_never_import_the_registry_or_a_family(graph):
    def forbidden(target: str) -> bool:
        # a family folder (spindle.models.<family>); spindle.models.shared holds no family's code
        return target == "spindle.registry" or (
            inside(target, "spindle.models") and not inside(target, "spindle.models.shared")
        )

    leaks = {m: sorted(t for t in ts if forbidden(t)) for m, ts in graph.items() if m.startswith(ENGINES)}
    assert {m: t for m, t in leaks.items() if t} == {}


def test_ops_import_nothing_above_them(graph):
    leaks = {
        m: sorted(t for t in ts if not inside(t, "spindle.ops")) for m, ts in graph.items() if inside(m, "spindle.ops")
    }
    assert {m: t for m, t in leaks.items() if t} == {}


def test_production_never_imports_trl():
    """TRL is a test dependency (the post-training parity tests' reference), never one of Spindle's own."""
    offenders = []
    for name, path in read_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{name}: {n}" for n in names if n == "trl" or n.startswith("trl.")]
    assert offenders == []


def test_families_import_no_engine(graph):
    leaks = {
        m: sorted(t for t in ts if any(inside(t, engine) for engine in FAMILY_FORBIDDEN))
        for m, ts in graph.items()
        if inside(m, "spindle.models")
    }
    assert {m: t for m, t in leaks.items() if t} == {}


def test_the_family_check_sees_an_engine_import(tmp_path):
    """The checker itself: a family module importing the training task inside a function is a leak."""
    (tmp_path / "condition.py").write_text("def f():\n    from spindle.train.tasks import flow_matching\n")
    (tmp_path / "flow_matching.py").write_text("")
    modules = {
        "spindle.models.fam.condition": tmp_path / "condition.py",
        "spindle.train.tasks.flow_matching": tmp_path / "flow_matching.py",
    }
    assert imported("spindle.models.fam.condition", modules["spindle.models.fam.condition"], modules) == {
        "spindle.train.tasks.flow_matching"
    }


def spindle_bases(
    name: str, path: Path, modules: dict[str, Path], classes: dict[str, set[str]]
) -> dict[str, list[str]]:
    """Each class `name` defines -> its direct bases that are Spindle classes: defined in the module itself or
    imported (`from spindle.x import C [as D]`, `import spindle.x as m` + `m.C`) from a module defining `C`."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    local: dict[str, str] = {c: f"{name}.{c}" for c in classes.get(name, ())}  # name here -> the class it is
    aliases: dict[str, str] = {}  # module alias -> Spindle module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            for a in node.names:
                if a.name in classes.get(base, ()):
                    local[a.asname or a.name] = f"{base}.{a.name}"
                elif f"{base}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and a.asname:
                    aliases[a.asname] = a.name
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        found = []
        for b in node.bases:
            if isinstance(b, ast.Subscript):  # a generic base (`TrainTask[DiTJobConfig, DiTFamily]`) is its class
                b = b.value
            if isinstance(b, ast.Name) and b.id in local:
                found.append(local[b.id])
            elif isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name):
                module = aliases.get(b.value.id)
                if module is not None and b.attr in classes.get(module, ()):
                    found.append(f"{module}.{b.attr}")
        out[node.name] = found
    return out


def class_bases(modules: dict[str, Path]) -> dict[str, list[str]]:
    """`module.Class` -> its direct Spindle bases, for every class under spindle/ (generated/ excluded)."""
    classes = {
        m: {n.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)}
        for m, p in modules.items()
    }
    return {f"{m}.{c}": bases for m, p in modules.items() for c, bases in spindle_bases(m, p, modules, classes).items()}


def test_no_class_inherits_two_spindle_classes():
    """Compose, don't inherit: a class has at most one Spindle base (a contract base, or the family it varies);
    what a variant adds is a part object its base holds and calls."""
    two = {c: b for c, b in class_bases(read_modules()).items() if len(b) >= 2}
    assert two == {}


def test_the_inheritance_check_sees_imported_and_aliased_bases(tmp_path):
    """The checker itself: Spindle bases imported by name, under another name, through a module alias, or
    parameterised (a generic contract) count; a library base (Protocol, nn.Module) does not."""
    (tmp_path / "base.py").write_text("class A:\n    pass\n\n\nclass B:\n    pass\n")
    (tmp_path / "mixed.py").write_text(
        "import torch\nfrom typing import Protocol\nfrom spindle import base as m\nfrom spindle.base import A as X\n"
        "class C(X, m.B):\n    pass\n\n\nclass D(X, Protocol, torch.nn.Module):\n    pass\n\n\nclass E(X[int], m.B[str]):\n    pass\n"
    )
    modules = {"spindle.base": tmp_path / "base.py", "spindle.mixed": tmp_path / "mixed.py"}
    bases = class_bases(modules)
    assert bases["spindle.mixed.C"] == ["spindle.base.A", "spindle.base.B"]
    assert bases["spindle.mixed.D"] == ["spindle.base.A"]
    assert bases["spindle.mixed.E"] == ["spindle.base.A", "spindle.base.B"]  # generic bases count too
