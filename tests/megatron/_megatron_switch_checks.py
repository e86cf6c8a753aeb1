"""Rank bodies for tests/megatron/test_megatron_switch.py (run where the switch is installed)."""

from __future__ import annotations

import ast
import importlib
import os

from megatron_core import megatron as switch


def _megatron_file(name: str) -> str | None:
    """megatron-core's own file for a module name (the switch serves ours under the name)."""
    spec = switch._finder._megatron_own_spec(name)
    return None if spec is None else spec.origin


def megatron_public_names(name: str) -> set[str]:
    """The public names of megatron-core's own module ``name``, read with ``ast``: ``__all__``
    where it has one, else its top-level functions, classes and assigned names (a package face:
    also what it imports)."""
    path = _megatron_file(name)
    tree = ast.parse(open(path, encoding="utf-8").read())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "__all__":
                    return set(ast.literal_eval(node.value))
                if isinstance(target, ast.Name):
                    names.add(target.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and os.path.basename(path) == "__init__.py":
            names.update(alias.asname or alias.name for alias in node.names)
    return {n for n in names if not n.startswith("_")}


def served_report() -> dict:
    """For each SERVED name: whether it is our module object, and the megatron-core public names
    our module lacks; plus how unclaimed names resolve."""
    switch.install()
    report = {"identity": {}, "missing": {}, "unclaimed": {}}
    for name, target in switch.SERVED.items():
        served = importlib.import_module(name)
        ours = importlib.import_module(target)
        report["identity"][name] = served is ours and served.__name__ == target
        report["missing"][name] = sorted(
            n for n in megatron_public_names(name) if not hasattr(ours, n)
        )
    for name in (
        "megatron.core.utils",
        "megatron.core.pipeline_parallel.combined_1f1b",
        "megatron.core.tensor_parallel.recompute",
        "megatron.core.tensor_parallel._collectives",
        "megatron.core.parallel_state.state",
    ):
        try:
            module = importlib.import_module(name)
            report["unclaimed"][name] = module.__file__
        except ModuleNotFoundError as exc:
            report["unclaimed"][name] = f"ModuleNotFoundError: {exc}"
    return report
