"""Drop-in compatibility with megatron-core, checked against manifests checked in as data.

tests/data/megatron_core_<version>_api.json is written by
scripts/tools/make_megatron_core_manifest.py from megatron-core's wheel (read with ast, never
imported), so this test needs no megatron-core.
Each manifest lists the public surface of every megatron-core module this package claims; one
test per (release, module, name):

- 0.16.1, exactly: the name exists at megatron-core's import path, and every parameter
  megatron-core has is here with the same kind, in the same positional order, with the same
  default (for a class: its ``__init__``, ``forward`` and public methods; its properties, fields
  and enum members); a default here where megatron-core has none is allowed (every call written
  for megatron-core passes that argument). Extra parameters are keyword-only with defaults
  (DESIGN.md: "Extensions are keyword arguments with defaults"), except a trailing one that
  0.19.2 adds at that very position (0.19 code may pass it positionally).
- 0.19.2, by keyword: the name exists, every parameter 0.19.2 has is accepted under its name
  with the same default (the position may differ where 0.19 inserted a parameter before one
  0.16.1 has; docs/guides/newer-megatron-core.md lists each case).

Modules outside this package's scope are left out of the manifests by the script and listed
in ``OUT_OF_SCOPE``; single names of claimed modules in ``OUT_OF_SCOPE_NAMES`` (both in
docs/guides/porting-from-megatron-core.md). ``python tests/test_compat.py`` prints how many
names each manifest covers and what is missing.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).parent / "data"
MANIFESTS = {
    version: json.loads((DATA / f"megatron_core_{version.replace('.', '_')}_api.json").read_text())
    for version in ("0.16.1", "0.19.2")
}
EXACT, NEWEST = "0.16.1", "0.19.2"

# megatron-core modules deliberately not provided (docs/guides/porting-from-megatron-core.md).
OUT_OF_SCOPE = {
    "pipeline_parallel.fine_grained_activation_offload",
    "pipeline_parallel.combined_1f1b",
    "pipeline_parallel.bridge_communicator",
    "pipeline_parallel.multimodule_communicator",
    "pipeline_parallel.hybrid_cp_schedule",
    "tensor_parallel.generalized_tensor_parallelism",
    "tensor_parallel.gtp_api",
}

# Names of claimed modules deliberately not provided, with the reason (the porting guide).
OUT_OF_SCOPE_NAMES = {
    **dict.fromkeys(
        [
            "pipeline_parallel.utils.ScheduleNode",
            "pipeline_parallel.utils.set_streams",
            "pipeline_parallel.utils.get_comp_stream",
            "pipeline_parallel.utils.get_comm_stream",
            "pipeline_parallel.utils.stream_acquire_context",
            "pipeline_parallel.utils.StageDispatchBwdGrad",
        ],
        "CUDA-stream helpers of the combined-1F1B machinery (out of scope, as combined_1f1b)",
    ),
    "pipeline_parallel.utils.set_ideal_affinity_for_current_gpu": "NVML CPU affinity (CUDA only)",
}

# Packages whose names are checked in ``__all__`` too (the __init__ is the family's public face).
PACKAGES = {"tensor_parallel", "pipeline_parallel"}

_KIND = {
    "positional_only": inspect.Parameter.POSITIONAL_ONLY,
    "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "var_positional": inspect.Parameter.VAR_POSITIONAL,
    "keyword_only": inspect.Parameter.KEYWORD_ONLY,
    "var_keyword": inspect.Parameter.VAR_KEYWORD,
}
_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _expected_default(source: str):
    """megatron-core's default, evaluated from its source text (literals and torch.* only)."""
    return eval(source, {"__builtins__": {}, "torch": torch})  # manifest is our own data


def _same_default(ours, source: str) -> bool:
    try:
        expected = _expected_default(source)
    except Exception:  # a default naming something of megatron-core's (an enum member, ...)
        return getattr(ours, "name", repr(ours)) == source.rsplit(".", 1)[-1]
    return type(ours) is type(expected) and ours == expected


def _parameters(obj, params: list[list]):
    ours = list(inspect.signature(obj).parameters.values())
    if ours and ours[0].name in ("self", "cls") and (not params or params[0][0] != ours[0].name):
        ours = ours[1:]
    return ours


def _default_problem(p: inspect.Parameter, name: str, kind: str, default) -> str | None:
    """A default megatron-core has must be the same here. Where megatron-core has none, one here
    is allowed: every call written for megatron-core passes the argument anyway (e.g. the
    pipeline's ``backward_step(..., model_type=None, config=None)`` that also takes 0.19's
    call without ``model_type``)."""
    if default is None:
        return None
    if p.default is inspect.Parameter.empty or not _same_default(p.default, default):
        return f"{name!r} default is {p.default!r}, megatron-core has {default}"
    return None


def signature_problems(obj, params: list[list], newer: list[list] | None = None) -> list[str]:
    """What differs between ``obj``'s signature and megatron-core's ``params`` (empty if none).

    Positional parameters must match one by one (name, kind, default); keyword-only ones by
    name, in any order (a caller cannot tell the order); ``*args`` / ``**kwargs`` where
    megatron-core has them. ``newer`` is the same callable's parameters in the newest release:
    a trailing extra parameter may be positional when it sits at the same position there.
    """
    try:
        ours = _parameters(obj, params)
    except (TypeError, ValueError) as exc:
        return [f"no signature: {exc}"]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    our_pos = [p for p in ours if p.kind in positional]
    our_kw = {p.name: p for p in ours if p.kind is inspect.Parameter.KEYWORD_ONLY}
    our_var = {p.kind for p in ours if p.kind in _VAR}
    problems = []
    their_pos = [row for row in params if _KIND[row[1]] in positional]
    for i, (name, kind, default) in enumerate(their_pos):
        p = our_pos[i] if i < len(our_pos) else None
        if p is None or p.name != name:
            got = "nothing" if p is None else repr(p.name)
            problems.append(f"positional parameter {i} is {got}, megatron-core has {name!r}")
            continue
        if p.kind != _KIND[kind]:
            problems.append(f"{name!r} is {p.kind.name}, megatron-core has {kind}")
        problems += [x for x in [_default_problem(p, name, kind, default)] if x]
    for name, kind, default in params:
        if _KIND[kind] in _VAR and _KIND[kind] not in our_var:
            problems.append(f"takes no {kind} parameter (megatron-core's {name!r})")
        elif _KIND[kind] is inspect.Parameter.KEYWORD_ONLY:
            p = our_kw.pop(name, None)
            if p is None:
                problems.append(f"missing keyword-only parameter {name!r}")
            else:
                problems += [x for x in [_default_problem(p, name, kind, default)] if x]
    newer_names = [row[0] for row in newer or [] if _KIND[row[1]] in positional]
    for i, p in enumerate(our_pos[len(their_pos) :], start=len(their_pos)):
        has_default = p.default is not inspect.Parameter.empty
        if not (has_default and i < len(newer_names) and newer_names[i] == p.name):
            problems.append(f"extra parameter {p.name!r} ({p.kind.name}) is not keyword-only")
    problems += [f"extra keyword-only {n!r} has no default" for n, p in our_kw.items()
                 if p.default is inspect.Parameter.empty]  # fmt: skip
    return problems


def keyword_problems(obj, params: list[list], newer: list[list] | None = None) -> list[str]:
    """What a caller of megatron-core's ``params`` passing each argument by name (positionally
    only where megatron-core forces it) would find different here (empty if nothing)."""
    try:
        ours = {p.name: p for p in _parameters(obj, params)}
    except (TypeError, ValueError) as exc:
        return [f"no signature: {exc}"]
    kinds = {p.kind for p in ours.values()}
    problems = []
    for i, (name, kind, default) in enumerate(params):
        if _KIND[kind] in _VAR:
            if _KIND[kind] not in kinds:
                problems.append(f"takes no {kind} (*{name} / **{name})")
            continue
        p = ours.get(name)
        if p is None:
            if inspect.Parameter.VAR_KEYWORD not in kinds:
                problems.append(f"missing parameter {name!r}")
            continue
        if p.kind in _VAR or (p.kind is inspect.Parameter.POSITIONAL_ONLY) != (
            kind == "positional_only"
        ):
            problems.append(f"{name!r} is {p.kind.name}, megatron-core has {kind}")
        if kind == "positional_only" and list(ours).index(name) != i:
            problems.append(f"positional-only {name!r} is not at position {i}")
        problem = _default_problem(p, name, kind, default)
        if problem:
            problems.append(problem)
    return problems


def _class_problems(obj, row: dict, qualname: str, check, newer_row: dict | None) -> list[str]:
    problems = []
    newer_methods = (newer_row or {}).get("methods", {})
    for method, params in row["methods"].items():
        fn = inspect.getattr_static(obj, method, None)
        if fn is None:
            problems.append(f"{qualname}.{method} is missing")
            continue
        if isinstance(fn, staticmethod | classmethod):
            fn = fn.__func__
        found = check(fn, params, newer_methods.get(method))
        problems += [f"{qualname}.{method}: {p}" for p in found]
    for prop in row.get("properties", []):
        if inspect.getattr_static(obj, prop, None) is None:
            problems.append(f"{qualname}.{prop} (a property) is missing")
    problems += _field_problems(obj, row.get("fields", []), qualname)
    for member, _ in row.get("members", []):
        if not (issubclass(obj, enum.Enum) and member in obj.__members__):
            problems.append(f"{qualname}.{member} (an enum member) is missing")
    return problems


def _field_problems(obj, fields: list[list], qualname: str) -> list[str]:
    declared = {}
    for klass in reversed(obj.__mro__):
        declared.update(getattr(klass, "__annotations__", {}))
    dc_fields = {}
    if dataclasses.is_dataclass(obj):
        dc_fields = {f.name: f for f in dataclasses.fields(obj)}
    problems = []
    for name, default in fields:
        if name not in declared and name not in dc_fields and not hasattr(obj, name):
            problems.append(f"{qualname}.{name} (a field) is missing")
        elif default is not None and name in dc_fields:
            ours = dc_fields[name].default
            if ours is dataclasses.MISSING or not _same_default(ours, default):
                problems.append(f"{qualname}.{name} default is {ours!r}, megatron-core: {default}")
    return problems


def member_problems(obj, row: dict, qualname: str, exact: bool, newer_row=None) -> list[str]:
    """How ``obj`` differs from a manifest row: exactly (0.16.1) or by keyword (newer)."""
    check = signature_problems if exact else keyword_problems
    if row["kind"] == "function":
        if not callable(obj) or inspect.isclass(obj):
            return [f"{qualname} is not a function"]
        newer = (newer_row or {}).get("params")
        return [f"{qualname}: {p}" for p in check(obj, row["params"], newer)]
    if not inspect.isclass(obj):
        return [f"{qualname} is not a class"]
    return _class_problems(obj, row, qualname, check, newer_row)


def name_problems(version: str, module: str, name: str, row: dict) -> list[str]:
    """Everything that differs for one manifest row (empty if nothing)."""
    try:
        mod = importlib.import_module(f"megatron_core.{module}")
    except ImportError as exc:
        return [f"megatron_core.{module} does not import: {exc}"]
    qualname = f"{module}.{name}"
    if module in PACKAGES and name not in getattr(mod, "__all__", [name]):
        return [f"{module}.__all__ lacks {name}"]
    obj = getattr(mod, name, None)
    if obj is None:
        return [f"{qualname} is missing"]
    newer_row = MANIFESTS[NEWEST]["modules"].get(module, {}).get(name)
    return member_problems(obj, row, qualname, exact=version == EXACT, newer_row=newer_row)


def _rows(version: str):
    rows = [
        pytest.param(version, module, name, row, id=f"{version}:{module}.{name}")
        for module, names in MANIFESTS[version]["modules"].items()
        for name, row in names.items()
        if f"{module}.{name}" not in OUT_OF_SCOPE_NAMES
    ]
    assert len(rows) > 200, f"manifest {version} is too small ({len(rows)} names)"
    return rows


@pytest.mark.parametrize("version,module,name,row", _rows(EXACT) + _rows(NEWEST))
def test_name(version, module, name, row):
    problems = name_problems(version, module, name, row)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("version", [EXACT, NEWEST])
def test_out_of_scope_modules_are_the_listed_ones(version):
    """The script leaves out exactly the modules the porting guide lists as out of scope, and the
    manifest holds nothing from them."""
    excluded = set(MANIFESTS[version]["excluded"])
    assert excluded <= OUT_OF_SCOPE
    assert "pipeline_parallel.combined_1f1b" in excluded  # present in both releases
    assert not excluded & set(MANIFESTS[version]["modules"])


def test_out_of_scope_names_are_in_a_manifest():
    """Every name listed as out of scope is one megatron-core has (the list cannot go stale)."""
    known = {
        f"{module}.{name}"
        for manifest in MANIFESTS.values()
        for module, names in manifest["modules"].items()
        for name in names
    }
    assert set(OUT_OF_SCOPE_NAMES) <= known, set(OUT_OF_SCOPE_NAMES) - known


def _config_problems(expected: list[list], exact: bool) -> list[str]:
    from megatron_core import ModelParallelConfig
    from megatron_core.model_parallel_config import ModelParallelConfig as at_module_path

    assert ModelParallelConfig is at_module_path
    ours = list(dataclasses.fields(ModelParallelConfig))
    by_name = {f.name: f for f in ours}
    problems = []
    for name, default in expected:
        field = by_name.get(name)
        if field is None:
            problems.append(f"missing field {name}")
        elif default is None:
            if field.default is not dataclasses.MISSING:
                problems.append(f"{name} has default {field.default!r}, megatron-core has none")
        elif field.default is dataclasses.MISSING or not _same_default(field.default, default):
            problems.append(f"{name} default is {field.default!r}, megatron-core has {default}")
    if exact and not problems:
        names = [name for name, _ in expected]
        if [f.name for f in ours[: len(names)]] != names:
            problems.append("fields do not start with megatron-core's, in its declaration order")
    return problems


def test_model_parallel_config_fields_0_16_1():
    """All 67 fields, in megatron-core 0.16.1's order from the first (they are positional
    dataclass parameters); newer fields only after them."""
    expected = MANIFESTS[EXACT]["model_parallel_config"]
    assert len(expected) == 67, "manifest should hold megatron-core 0.16.1's 67 fields"
    problems = _config_problems(expected, exact=True)
    assert not problems, "\n".join(problems)


def test_model_parallel_config_fields_0_19_2():
    problems = _config_problems(MANIFESTS[NEWEST]["model_parallel_config"], exact=False)
    assert not problems, "\n".join(problems)


def test_checker_catches_differences():
    """The comparison itself: a renamed, reordered, re-defaulted or extra-positional signature
    is reported, an identical one is not; by keyword, only names and defaults matter."""
    params = [["a", "positional_or_keyword", None], ["b", "positional_or_keyword", "None"]]

    def same(a, b=None, *, extra=1):
        pass

    def renamed(a, c=None):
        pass

    def other_default(a, b=0):
        pass

    def extra_positional(a, b=None, c=None):
        pass

    def keyword_only(a, *, b=None):
        pass

    def more_defaults(a=0, b=None):
        pass

    assert signature_problems(same, params) == []
    assert signature_problems(more_defaults, params) == []  # megatron's calls all pass a
    kw = [["a", "positional_or_keyword", None], ["x", "keyword_only", "1"],
          ["y", "keyword_only", "2"], ["kwargs", "var_keyword", None]]  # fmt: skip

    def reordered(a, *, y=2, view=None, x=1, **options):
        pass

    def no_kwargs(a, *, x=1, y=2):
        pass

    assert signature_problems(reordered, kw) == []  # keyword order and **name are invisible
    assert signature_problems(no_kwargs, kw)
    assert signature_problems(renamed, params)
    assert signature_problems(other_default, params)
    assert signature_problems(extra_positional, params)
    assert (
        signature_problems(
            extra_positional, params, newer=params + [["c", "positional_or_keyword", "None"]]
        )
        == []
    )
    assert signature_problems(keyword_only, params)
    assert keyword_problems(keyword_only, params) == []
    assert keyword_problems(renamed, params)
    assert keyword_problems(other_default, params)
    assert _same_default(torch.float32, "torch.float32")
    assert not _same_default(0, "False")  # bool vs int differ


def coverage(version: str) -> tuple[int, int, dict[str, list[str]]]:
    """(names that pass, names in the manifest, {qualname: problems} for the others)."""
    failing = {}
    total = 0
    for module, names in MANIFESTS[version]["modules"].items():
        for name, row in names.items():
            if f"{module}.{name}" in OUT_OF_SCOPE_NAMES:
                continue
            total += 1
            problems = name_problems(version, module, name, row)
            if problems:
                failing[f"{module}.{name}"] = problems
    return total - len(failing), total, failing


if __name__ == "__main__":
    for version in MANIFESTS:
        ok, total, failing = coverage(version)
        print(f"megatron-core {version}: {ok} of {total} names covered")
        for qualname, problems in failing.items():
            print(f"  {qualname}: " + "; ".join(problems))
    sys.exit(0)
