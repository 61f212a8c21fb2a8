"""Imports follow the stage order (CONTRIBUTING.md): a module imports only modules of its own stage
or earlier ones, and the imports have no cycle.

Read from the source with ``ast``, so an import inside a function counts too (it hides a
dependency, it does not remove it); imports under ``if TYPE_CHECKING:`` (annotations only) do not.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: earliest first; a module may import from its own stage and the ones before it
STAGES: list[tuple[str, set[str]]] = [
    ("base", {"errors", "bytesize", "units", "_torch_compat", "_torch_compat.distributed", "_torch_compat.profiler", "progress", "debug", "models", "models.inputs", "models.vision",
              "models.video", "models.gpt", "types"}),
    ("capture", {"capture", "state", "recompute", "opkind", "memory"}),
    ("graph", {"graph", "tangents"}),
    ("costs", {"hardware", "costmodel", "profile", "scratch", "timing", "calibrate", "limits"}),
    ("schedule", {"segments", "schedule", "footprint", "simulator"}),
    ("planners", {"planners", "planners.registry", "planners.common", "planners.prefetch", "planners.sharing", "planners.lp", "planners.lpmodel", "planners.probing", "planners.floor", "planners.chains", "planners.issue_order", "planners.milp", "planners.baselines",
                  "planners.bounds", "planners.cutbound", "planners.fixed", "planners.branch", "planners.pooch", "planners.moves",
                  "planners.split", "planners.groups", "planners.search"}),
    ("plan", {"plan"}),
    ("inspect", {"whatif", "report", "explain", "svg", "trace"}),
    ("passes", {"passes", "passes.meta", "passes.offload", "passes.swapin", "passes.rewrite", "passes.slots"}),
    ("runtime", {"hostpool", "runtime", "codegen"}),
    ("api", {"options", "pipeline", "distributed", "fsdp", "planned", "peakcheck", "api", "torch_backend"}),
    ("entry points", {"demo", "__main__", "__init__"}),
]

#: imports against the order, each with its reason; keep this list short and shrinking
EXCEPTIONS: dict[tuple[str, str], str] = {
    # Plan's conveniences (print(plan), plan.table, plan.explain, plan.what_ifs) call the modules that
    # read a plan; the imports sit inside those methods.
    ("plan", "whatif"): "Plan.what_ifs",
    ("plan", "report"): "Plan.table / __str__",
    ("plan", "explain"): "Plan.explain",
}

STAGE_OF = {m: i for i, (_, mods) in enumerate(STAGES) for m in mods}


def _files() -> dict[str, Path]:
    """Module key -> source file: ``graph``, ``planners.pooch``, ``passes.swapin``, ``__init__`` (the package)."""
    out = {}
    for path in [*sorted((ROOT / "fxpooch").rglob("*.py")), *sorted((ROOT / "passes").glob("*.py"))]:
        dotted = _dotted(path)
        out[_key(dotted)] = path
    return out


def _dotted(path: Path) -> str:
    """The importable name of a source file (``passes/`` ships as ``fxpooch.passes``)."""
    if path.parent == ROOT / "passes":
        parts = ("fxpooch", "passes", path.stem)
    else:
        parts = ("fxpooch", *path.relative_to(ROOT / "fxpooch").with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _key(dotted: str) -> str:
    return "__init__" if dotted == "fxpooch" else dotted.removeprefix("fxpooch.")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(dotted: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``node`` (in module ``dotted``) imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            package = dotted.split(".") if is_package else dotted.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        # ``from . import runtime`` imports the module fxpooch.runtime; ``from . import register``, the
        # package (its __init__) that defines the name
        names = [f"{base}.{a.name}" if _key(f"{base}.{a.name}") in known else base for a in node.names]
    return {_key(n) for n in names if n == "fxpooch" or n.startswith("fxpooch.")} & known


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    dotted, is_package = _dotted(path), path.stem == "__init__"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(_resolve(dotted, is_package, node, known) - {module})
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    files = _files()
    return {m: _imports(m, p, set(files)) for m, p in files.items()}


def test_every_module_has_a_stage():
    missing = sorted(set(_files()) - set(STAGE_OF))
    assert not missing, f"add these modules to a stage in STAGES (and CONTRIBUTING.md's layout): {missing}"


def test_imports_follow_the_stage_order():
    graph = _graph()
    against = sorted(f"{m} ({STAGES[STAGE_OF[m]][0]}) imports {d} ({STAGES[STAGE_OF[d]][0]})"
                     for m, deps in graph.items() for d in deps
                     if STAGE_OF[d] > STAGE_OF[m] and (m, d) not in EXCEPTIONS)
    assert not against, "imports against the stage order:\n" + "\n".join(against)


def test_no_import_cycle():
    graph = {m: {d for d in deps if (m, d) not in EXCEPTIONS} for m, deps in _graph().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(d):] + [m, d]))
            if d not in state:
                walk(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m, [])


#: the leaves: what they may import of fxpooch (errors and units no longer import each other)
LEAVES = {"bytesize": set(), "types": set(), "errors": {"bytesize"}, "units": {"bytesize", "errors"},
          "_torch_compat": {"_torch_compat.distributed", "_torch_compat.profiler"},
          "_torch_compat.distributed": set(), "_torch_compat.profiler": set(), "opkind": {"_torch_compat"}}


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_modules_import_only_leaves(leaf):
    assert _graph()[leaf] <= LEAVES[leaf]
