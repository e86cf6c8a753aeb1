"""Write a megatron-core API manifest that tests/test_compat.py checks this package against.

A manifest lists, as data, the public surface of every megatron-core module this package claims
(the modules the megatron switch serves from here):

- ``parallel_state``, ``model_parallel_config``, ``process_groups_config``, ``hyper_comm_grid``,
  ``enums`` and ``distributed.finalize_model_grads``: every public top-level function and class;
- ``tensor_parallel`` and ``pipeline_parallel``: every name the package ``__init__`` imports, and
  every public top-level function and class of each submodule (except those in ``EXCLUDED``);
- ``utils``: the helpers ``UTILS_HELPERS`` names (the ones the claimed modules import; the rest
  of megatron-core's ``utils`` stays megatron-core's);
- every field of ``ModelParallelConfig`` with its default, in declaration order.

A function is recorded with its parameters (name, kind, default as source text); a class with
its ``__init__``, ``forward`` and public methods, its properties, its annotated fields (with
defaults) and, for an enum, its members. The wheel is read with :mod:`ast` only: megatron-core is
never imported, so this runs without its dependencies and for any Python version's wheel.

Usage::

    pip download --no-deps --only-binary=:all: -d /tmp/mc016 megatron-core==0.16.1
    python scripts/tools/make_megatron_core_manifest.py /tmp/mc016/megatron_core-0.16.1-*.whl
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d /tmp/mc019 \\
        megatron-core==0.19.2
    python scripts/tools/make_megatron_core_manifest.py /tmp/mc019/megatron_core-0.19.2-*.whl

The output defaults to ``tests/data/megatron_core_<version>_api.json`` (dots as underscores), the
version read from the wheel's ``package_info.py``. The path may also be a directory holding an
unpacked ``megatron/core`` tree.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[2] / "tests/data"

# Modules read in full (public top-level functions and classes), by dotted name under megatron.core.
WHOLE_MODULES = (
    "parallel_state",
    "model_parallel_config",
    "process_groups_config",
    "hyper_comm_grid",
    "enums",
    "distributed.finalize_model_grads",
)

# Packages: the names each __init__ imports, and every submodule read in full.
PACKAGES = ("tensor_parallel", "pipeline_parallel")

# Submodules outside this package's scope, with the reason (also in the README). A release that
# lacks one of them simply lacks it.
EXCLUDED = {
    "pipeline_parallel.fine_grained_activation_offload": "CUDA-stream activation offloading",
    "pipeline_parallel.combined_1f1b": "CUDA-stream overlap of MoE all-to-all with compute",
    "pipeline_parallel.bridge_communicator": "multimodule (heterogeneous-grid) machinery",
    "pipeline_parallel.multimodule_communicator": "multimodule (heterogeneous-grid) machinery",
    "pipeline_parallel.hybrid_cp_schedule": "hybrid context-parallel CUDA scheduling",
    "tensor_parallel.generalized_tensor_parallelism": "generalized TP (gtp_remat_size > 1)",
    "tensor_parallel.gtp_api": "generalized TP (gtp_remat_size > 1)",
}

# The megatron.core.utils helpers the claimed modules import, plus the
# memory buffer parallel_state hands out.
UTILS_HELPERS = (
    "GlobalMemoryBuffer",
    "divide",
    "drain_embedding_wgrad_compute",
    "get_attr_wrapped_model",
    "get_model_config",
    "get_model_type",
    "get_pg_rank",
    "get_pg_size",
    "get_tensor_model_parallel_group_if_none",
    "is_te_min_version",
    "is_torch_min_version",
    "make_tp_sharded_tensor_for_checkpoint",
    "make_viewless_tensor",
    "nvtx_decorator",
    "nvtx_range_pop",
    "nvtx_range_push",
    "prepare_input_tensors_for_wgrad_compute",
    "safely_set_viewless_tensor_data",
)

_KINDS = {"posonlyargs": "positional_only", "args": "positional_or_keyword"}
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class _Source:
    """Reads ``megatron/core/<relpath>`` from a wheel or an unpacked tree."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path) if path.is_file() else None

    def exists(self, relpath: str) -> bool:
        if self.zip is not None:
            return f"megatron/core/{relpath}" in self.zip.namelist()
        return (self.path / "megatron/core" / relpath).is_file()

    def read(self, relpath: str) -> str:
        if self.zip is not None:
            return self.zip.read(f"megatron/core/{relpath}").decode()
        return (self.path / "megatron/core" / relpath).read_text()

    def parse(self, relpath: str) -> ast.Module:
        return ast.parse(self.read(relpath), filename=relpath)

    def submodules(self, package: str) -> list[str]:
        """Dotted names of ``package``'s direct ``.py`` submodules (not ``__init__``)."""
        prefix = "megatron/core/" + package.replace(".", "/") + "/"
        if self.zip is not None:
            names = [n[len(prefix) :] for n in self.zip.namelist() if n.startswith(prefix)]
        else:
            names = [p.name for p in (self.path / prefix).iterdir()]
        return sorted(
            f"{package}.{n[:-3]}"
            for n in names
            if n.endswith(".py") and "/" not in n and n != "__init__.py"
        )

    def version(self) -> str:
        tree = self.parse("package_info.py")
        values = _constants(tree)
        return ".".join(
            str(ast.literal_eval(values[k])) for k in ("MAJOR", "MINOR", "PATCH") if k in values
        )


def _module_path(module: str, package: bool = False) -> str:
    return module.replace(".", "/") + ("/__init__.py" if package else ".py")


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


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).split("(")[0] for d in fn.decorator_list}


def _field_default(value: ast.expr | None) -> str | None:
    """The default as source text; ``field(default=X, ...)`` gives X; no default gives None
    (also for ``field(init=False)`` and ``field(default_factory=...)``)."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.unparse(kw.value)
        return None
    return ast.unparse(value)


def _describe_class(node: ast.ClassDef, constants: dict[str, str]) -> dict:
    methods, properties, fields, members = {}, [], [], []
    bases = {ast.unparse(b) for b in node.bases}
    is_enum = any(b.split(".")[-1] in ("Enum", "IntEnum", "StrEnum", "Flag") for b in bases)
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = _decorators(item)
            if item.name.startswith("_") and item.name not in ("__init__", "forward"):
                continue
            if "property" in decorators or any(d.endswith(".setter") for d in decorators):
                if item.name not in properties:
                    properties.append(item.name)
                continue
            params = _params(item, constants)
            if "staticmethod" not in decorators and params and params[0][0] in ("self", "cls"):
                params = params[1:]
            methods[item.name] = params
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if not item.target.id.startswith("_"):
                fields.append([item.target.id, _field_default(item.value)])
        elif is_enum and isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
            members.append([item.targets[0].id, ast.unparse(item.value)])
    row = {"kind": "class", "methods": methods}
    if properties:
        row["properties"] = properties
    if fields:
        row["fields"] = fields
    if is_enum:
        row["members"] = members
    return row


def _describe(node: ast.AST, constants: dict[str, str]) -> dict:
    if isinstance(node, ast.ClassDef):
        return _describe_class(node, constants)
    return {"kind": "function", "params": _params(node, constants)}


def _top_level(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Public functions and classes defined at module level, also inside top-level ``if`` /
    ``try`` blocks (an import fallback); the first definition of a name wins."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, _DEFS) and not node.name.startswith("_"):
            out.setdefault(node.name, node)
        elif isinstance(node, (ast.If, ast.Try)):
            nested = node.body + node.orelse
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            for name, inner in _top_level(nested).items():
                out.setdefault(name, inner)
    return out


def whole_module(src: _Source, module: str) -> dict:
    tree = src.parse(_module_path(module))
    constants = _constants(tree)
    return {name: _describe(node, constants) for name, node in _top_level(tree.body).items()}


def package_init(src: _Source, package: str) -> dict:
    """The names ``package/__init__.py`` imports from its submodules, each described from the
    submodule that defines it (``"module"`` says which)."""
    tree = src.parse(_module_path(package, package=True))
    out = {}
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and node.level == 1 and node.module):
            continue
        module = f"{package}.{node.module}"
        definitions = _top_level(src.parse(_module_path(module)).body)
        constants = _constants(src.parse(_module_path(module)))
        for alias in node.names:
            if alias.name not in definitions:
                raise SystemExit(f"{alias.name} is not defined at top level of {module}")
            row = _describe(definitions[alias.name], constants)
            row["module"] = node.module
            out[alias.asname or alias.name] = row
    return out


def utils_helpers(src: _Source) -> dict:
    tree = src.parse("utils.py")
    constants = _constants(tree)
    definitions = _top_level(tree.body)
    missing = [name for name in UTILS_HELPERS if name not in definitions]
    if missing:
        raise SystemExit(f"utils.py lacks {missing}")
    return {name: _describe(definitions[name], constants) for name in UTILS_HELPERS}


def model_parallel_config(src: _Source) -> list[list]:
    tree = src.parse("model_parallel_config.py")
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelParallelConfig"
    )
    # Every annotated field, private ones included: all are dataclass __init__ parameters.
    return [
        [item.target.id, _field_default(item.value)]
        for item in cls.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


def modules(src: _Source) -> dict[str, dict]:
    """Dotted module name (under megatron.core) -> public name -> description."""
    out = {module: whole_module(src, module) for module in WHOLE_MODULES}
    for package in PACKAGES:
        out[package] = package_init(src, package)
        for module in src.submodules(package):
            if module not in EXCLUDED:
                out[module] = whole_module(src, module)
    out["utils"] = utils_helpers(src)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a megatron-core wheel or unpacked tree")
    parser.add_argument("-o", "--output", type=Path, default=None)
    args = parser.parse_args(argv)
    src = _Source(args.path)
    version = src.version()
    output = args.output or DATA_DIR / f"megatron_core_{version.replace('.', '_')}_api.json"
    manifest = {
        "source": f"megatron-core {version} ({args.path.name})",
        "version": version,
        "excluded": {k: v for k, v in EXCLUDED.items() if src.exists(_module_path(k))},
        "modules": modules(src),
        "model_parallel_config": model_parallel_config(src),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(manifest, indent=1) + "\n")
    counts = {k: len(v) for k, v in manifest["modules"].items()}
    total = sum(counts.values())
    print(f"wrote {output}: {total} names {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
