"""Write the megatron-core 0.16.1 API manifest that tests/test_compat.py checks us against.

The manifest lists, as data, the public surface a megatron-core user touches:

- every public top-level function and class of ``megatron/core/parallel_state.py``;
- every name ``megatron/core/tensor_parallel/__init__.py`` imports, plus a few names users import
  from the submodules (``EXTRA_TENSOR_PARALLEL`` below);
- every field of ``ModelParallelConfig`` with its default, in declaration order.

For a function it records the parameters (name, kind, default as source text); for a class its
``__init__``, ``forward`` and public methods. The wheel is read with :mod:`ast` only: megatron-core
is never imported, so this runs without its dependencies.

Usage::

    pip download --no-deps megatron-core==0.16.1 -d /tmp/mcore
    python scripts/make_megatron_core_manifest.py /tmp/mcore/megatron_core-0.16.1-*.whl \\
        [-o tests/data/megatron_core_0_16_1_api.json]

The path may also be a directory holding an unpacked ``megatron/core`` tree.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "tests/data/megatron_core_0_16_1_api.json"

# Names megatron-core users import from tensor_parallel's submodules (not re-exported by its
# __init__), as "module.Name".
EXTRA_TENSOR_PARALLEL = (
    "cross_entropy.VocabParallelCrossEntropy",
    "layers.LinearWithFrozenWeight",
    "layers.linear_with_frozen_weight",
    "layers.LinearWithGradAccumulationAndAsyncCommunication",
    "mappings.all_to_all_sp2hp",
    "mappings.all_to_all_hp2sp",
    "utils.VocabUtility",
    "random.CudaRNGStatesTracker",
    "random.initialize_rng_tracker",
    "random.get_all_rng_states",
    "random.is_checkpointing",
    "random.CheckpointWithoutOutputFunction",
)

_KINDS = {
    "posonlyargs": "positional_only",
    "args": "positional_or_keyword",
    "kwonlyargs": "keyword_only",
}


class _Source:
    """Reads ``megatron/core/<relpath>`` from a wheel or an unpacked tree."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path) if path.is_file() else None

    def read(self, relpath: str) -> str:
        if self.zip is not None:
            return self.zip.read(f"megatron/core/{relpath}").decode()
        return (self.path / "megatron/core" / relpath).read_text()

    def parse(self, relpath: str) -> ast.Module:
        return ast.parse(self.read(relpath), filename=relpath)


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = <literal>`` assignments, as source text."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                out[target.id] = ast.unparse(node.value)
    return out


def _params(fn: ast.FunctionDef, constants: dict[str, str]) -> list[list]:
    """[[name, kind, default source or None], ...] in declaration order; a default naming a
    module constant is replaced by the constant's value."""

    def text(node):
        if node is None:
            return None
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        return ast.unparse(node)

    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    rows = []
    for arg, default in zip(positional, defaults, strict=True):
        kind = _KINDS["posonlyargs" if arg in a.posonlyargs else "args"]
        rows.append([arg.arg, kind, text(default)])
    if a.vararg is not None:
        rows.append([a.vararg.arg, "var_positional", None])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        rows.append([arg.arg, "keyword_only", text(default)])
    if a.kwarg is not None:
        rows.append([a.kwarg.arg, "var_keyword", None])
    return rows


def _is_static(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def _describe(node: ast.AST, constants: dict[str, str]) -> dict:
    if isinstance(node, ast.FunctionDef):
        return {"kind": "function", "params": _params(node, constants)}
    methods = {}
    for item in node.body:
        if not isinstance(item, ast.FunctionDef):
            continue
        if item.name in ("__init__", "forward") or not item.name.startswith("_"):
            params = _params(item, constants)
            if not _is_static(item) and params and params[0][0] in ("self", "cls"):
                params = params[1:]
            methods[item.name] = params
    return {"kind": "class", "methods": methods}


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    }


def parallel_state(src: _Source) -> dict:
    tree = src.parse("parallel_state.py")
    constants = _constants(tree)
    return {name: _describe(node, constants) for name, node in _top_level(tree).items()}


def tensor_parallel(src: _Source) -> dict:
    init = src.parse("tensor_parallel/__init__.py")
    wanted = []  # (exported name, module)
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            wanted += [(alias.asname or alias.name, node.module) for alias in node.names]
    wanted += [tuple(reversed(item.split("."))) for item in EXTRA_TENSOR_PARALLEL]
    trees: dict[str, ast.Module] = {}
    out = {}
    for name, module in wanted:
        if module not in trees:
            trees[module] = src.parse(f"tensor_parallel/{module}.py")
        node = _top_level(trees[module]).get(name)
        if node is None:
            raise SystemExit(f"{name} not defined at top level of tensor_parallel/{module}.py")
        row = _describe(node, _constants(trees[module]))
        row["module"] = module
        row["in_init"] = (name, module) not in [
            tuple(reversed(item.split("."))) for item in EXTRA_TENSOR_PARALLEL
        ]
        out[name] = row
    return out


def _field_default(value: ast.expr | None) -> str | None:
    """The default as source text; ``field(default=X, ...)`` gives X; no default gives None."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.unparse(kw.value)
        raise SystemExit(f"unsupported field(...) default: {ast.unparse(value)}")
    return ast.unparse(value)


def model_parallel_config(src: _Source) -> list[list]:
    tree = src.parse("model_parallel_config.py")
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelParallelConfig"
    )
    return [
        [item.target.id, _field_default(item.value)]
        for item in cls.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="megatron-core 0.16.1 wheel or unpacked tree")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    src = _Source(args.path)
    manifest = {
        "source": "megatron-core 0.16.1 (" + args.path.name + ")",
        "parallel_state": parallel_state(src),
        "tensor_parallel": tensor_parallel(src),
        "model_parallel_config": model_parallel_config(src),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    counts = {k: len(v) for k, v in manifest.items() if k != "source"}
    print(f"wrote {args.output}: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
