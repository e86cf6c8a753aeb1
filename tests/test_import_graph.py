"""The package's import graph, read statically from the source: no cycles, no arrow pointing up.

DESIGN.md orders the families from the bottom up: errors / device <- parallel_state <-
consistency <- tensor_parallel <- pipeline_parallel / distributed <- transformer <- training. A
module may import its own family and the families below it, never one above. Every import
statement counts, also one inside a function: a late import hides a cycle from Python, not from
the reader. Importing ``a.b.c`` also runs the package ``a.b``'s ``__init__``, so that face is an
arrow too (unless it is one of the importer's own packages, which Python has already started).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_core"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# family (the first name under megatron_core) -> its level; higher levels may import lower ones.
LEVELS = {
    "errors": 0,
    "enums": 0,
    "device": 0,
    "compat": 0,
    "flags": 0,
    "model_parallel_config": 1,
    "parallel_state": 1,
    "process_groups_config": 1,
    "hyper_comm_grid": 1,
    "consistency": 2,
    "utils": 2,
    "tensor_parallel": 3,
    "deepspeed_checkpointing": 3,
    "attention": 4,
    "pipeline_parallel": 5,
    "distributed": 5,
    "context_parallel": 5,
    "transformer": 6,
    "transformer_engine": 6,
    "training": 7,
    "megatron": 8,
    "testing": 8,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that importing ``name`` runs directly, from every import statement."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]  # a module, else an attribute
        else:
            continue
        for target in targets:
            while target and target not in modules:  # "a.b.attr" -> "a.b"
                target = target.rpartition(".")[0]
            if not target.startswith(PACKAGE) or target == name:
                continue
            found.add(target)
            parent = target.rpartition(".")[0]  # the package face Python runs first
            while parent.count(".") >= 1 and not (name + ".").startswith(parent + "."):
                found.add(parent)
                parent = parent.rpartition(".")[0]
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def family(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (iterative depth-first search)."""
    colour = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    for start in graph:
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        colour[start] = 1
        while stack:
            node, edges = stack[-1]
            nxt = next(edges, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
            elif colour.get(nxt) == 1:
                path = [n for n, _ in stack]
                return path[path.index(nxt) :] + [nxt]
            elif colour.get(nxt) == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_every_family_has_a_level():
    unknown = sorted({family(n) for n in all_modules()} - set(LEVELS) - {None})
    assert not unknown, f"new families {unknown}: give each a level in LEVELS (DESIGN.md's order)"


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_points_up_the_design_order():
    upward = [
        f"{name} (level {LEVELS[family(name)]}) imports {target} (level {LEVELS[family(target)]})"
        for name, targets in import_graph().items()
        if family(name) is not None
        for target in sorted(targets)
        if family(target) is not None and LEVELS[family(target)] > LEVELS[family(name)]
    ]
    assert not upward, "imports that point up DESIGN.md's order:\n" + "\n".join(upward)


def test_the_package_never_imports_scripts_or_tests():
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("tests", "scripts") for n in names), name


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"a"}}, ["a", "a"]),
    ],
)
def test_the_cycle_finder_itself(graph, cycle):
    assert find_cycle(graph) == cycle


def test_a_late_import_and_a_package_face_are_arrows(tmp_path, monkeypatch):
    """The checker sees an import inside a function and the face that importing a submodule runs."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from megatron_core.sub import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from megatron_core import low\n")
    (pkg / "low.py").write_text("from megatron_core.sub.leaf import f\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph = import_graph()
    assert graph["megatron_core.sub.leaf"] == {"megatron_core.low"}
    assert graph["megatron_core.low"] == {"megatron_core.sub.leaf", "megatron_core.sub"}
    assert find_cycle(graph) is not None
