"""Drop-in compatibility with megatron-core 0.16.1, checked against a manifest checked in as data.

tests/data/megatron_core_0_16_1_api.json is written by scripts/make_megatron_core_manifest.py from
the megatron-core 0.16.1 wheel (read with ast, never imported), so this test needs no
megatron-core. One test per manifest row: the name exists at megatron-core's import path, and
every parameter megatron-core has is here with the same kind, in the same positional order, with
the same default (for a class: of its ``__init__``, ``forward`` and public methods). Extra
parameters are allowed only as keyword-only ones after megatron-core's (DESIGN.md: "Extensions
are keyword arguments with defaults").
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from pathlib import Path

import pytest
import torch

MANIFEST = json.loads(
    (Path(__file__).parent / "data" / "megatron_core_0_16_1_api.json").read_text()
)

# Methods megatron-core's classes have that this package deliberately lacks, with the reason
# (also listed in the README's "Porting from megatron-core" section). Nothing else may be missing.
DELIBERATELY_ABSENT_METHODS = {
    # torch.distributed.checkpoint replaces megatron-core's dist_checkpointing (ShardedTensor).
    ("ColumnParallelLinear", "sharded_state_dict"): "no dist_checkpointing",
    ("RowParallelLinear", "sharded_state_dict"): "no dist_checkpointing",
    ("VocabParallelEmbedding", "sharded_state_dict"): "no dist_checkpointing",
}

_KIND = {
    "positional_only": inspect.Parameter.POSITIONAL_ONLY,
    "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "var_positional": inspect.Parameter.VAR_POSITIONAL,
    "keyword_only": inspect.Parameter.KEYWORD_ONLY,
    "var_keyword": inspect.Parameter.VAR_KEYWORD,
}


def _expected_default(source: str):
    """megatron-core's default, evaluated from its source text (literals and torch.* only)."""
    return eval(source, {"__builtins__": {}, "torch": torch})  # manifest is our own data


def _same_default(ours, source: str) -> bool:
    expected = _expected_default(source)
    return type(ours) is type(expected) and ours == expected


def signature_problems(obj, params: list[list]) -> list[str]:
    """What differs between ``obj``'s signature and megatron-core's ``params`` (empty if none)."""
    try:
        ours = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError) as exc:
        return [f"no signature: {exc}"]
    if ours and ours[0].name in ("self", "cls") and (not params or params[0][0] != ours[0].name):
        ours = ours[1:]
    problems = []
    for i, (name, kind, default) in enumerate(params):
        if i >= len(ours):
            problems.append(f"missing parameter {name!r} (position {i})")
            continue
        p = ours[i]
        if p.name != name:
            problems.append(f"parameter {i} is {p.name!r}, megatron-core has {name!r}")
            continue
        if p.kind != _KIND[kind]:
            problems.append(f"{name!r} is {p.kind.name}, megatron-core has {kind}")
        if default is None and p.default is not inspect.Parameter.empty:
            if kind not in ("var_positional", "var_keyword"):
                problems.append(f"{name!r} has default {p.default!r}, megatron-core has none")
        elif default is not None and (
            p.default is inspect.Parameter.empty or not _same_default(p.default, default)
        ):
            problems.append(f"{name!r} default is {p.default!r}, megatron-core has {default}")
    for p in ours[len(params) :]:
        extra_ok = (
            p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
        )
        extra_ok = extra_ok or p.kind is inspect.Parameter.VAR_KEYWORD
        if not extra_ok:
            problems.append(f"extra parameter {p.name!r} ({p.kind.name}) is not keyword-only")
    return problems


def member_problems(obj, row: dict, qualname: str) -> list[str]:
    if row["kind"] == "function":
        if not callable(obj) or inspect.isclass(obj):
            return [f"{qualname} is not a function"]
        return [f"{qualname}: {p}" for p in signature_problems(obj, row["params"])]
    if not inspect.isclass(obj):
        return [f"{qualname} is not a class"]
    problems = []
    for method, params in row["methods"].items():
        if (obj.__name__, method) in DELIBERATELY_ABSENT_METHODS:
            continue
        fn = inspect.getattr_static(obj, method, None)
        if fn is None:
            problems.append(f"{qualname}.{method} is missing")
            continue
        if isinstance(fn, staticmethod | classmethod):
            fn = fn.__func__
        problems += [f"{qualname}.{method}: {p}" for p in signature_problems(fn, params)]
    return problems


def _rows(section: str) -> list[tuple[str, dict]]:
    rows = list(MANIFEST[section].items())
    assert rows, f"manifest section {section} is empty"
    return rows


def tensor_parallel_problems(name: str, row: dict) -> list[str]:
    if row["in_init"]:
        import megatron_core.tensor_parallel as tp

        if name not in tp.__all__:
            return [f"tensor_parallel.__all__ lacks {name}"]
        obj, qualname = getattr(tp, name, None), f"tensor_parallel.{name}"
    else:
        module = importlib.import_module(f"megatron_core.tensor_parallel.{row['module']}")
        obj, qualname = getattr(module, name, None), f"tensor_parallel.{row['module']}.{name}"
    if obj is None:
        return [f"{qualname} is missing"]
    return member_problems(obj, row, qualname)


@pytest.mark.parametrize(
    "name,row", _rows("tensor_parallel"), ids=lambda v: v if isinstance(v, str) else ""
)
def test_tensor_parallel_name(name, row):
    problems = tensor_parallel_problems(name, row)
    assert not problems, "\n".join(problems)


def parallel_state_problems(name: str, row: dict) -> list[str]:
    from megatron_core import parallel_state

    obj = getattr(parallel_state, name, None)
    if obj is None:
        return [f"parallel_state.{name} is missing"]
    return member_problems(obj, row, f"parallel_state.{name}")


@pytest.mark.parametrize(
    "name,row", _rows("parallel_state"), ids=lambda v: v if isinstance(v, str) else ""
)
def test_parallel_state_name(name, row):
    problems = parallel_state_problems(name, row)
    assert not problems, "\n".join(problems)


def test_model_parallel_config_fields():
    from megatron_core import ModelParallelConfig
    from megatron_core.model_parallel_config import ModelParallelConfig as at_module_path

    assert ModelParallelConfig is at_module_path
    expected = MANIFEST["model_parallel_config"]
    assert len(expected) == 67, "manifest should hold megatron-core 0.16.1's 67 fields"
    ours = [f for f in dataclasses.fields(ModelParallelConfig)]
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
    order = [f.name for f in ours if f.name in dict(expected)]
    if not problems and order != [name for name, _ in expected]:
        problems.append("fields are not in megatron-core's declaration order")
    assert not problems, "\n".join(problems)


def test_checker_catches_differences():
    """The comparison itself: a renamed, reordered, re-defaulted or extra-positional signature
    is reported, an identical one is not."""
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

    assert signature_problems(same, params) == []
    assert signature_problems(renamed, params)
    assert signature_problems(other_default, params)
    assert signature_problems(extra_positional, params)
    assert signature_problems(keyword_only, params)
    assert _same_default(torch.float32, "torch.float32")
    assert not _same_default(0, "False")  # bool vs int differ
