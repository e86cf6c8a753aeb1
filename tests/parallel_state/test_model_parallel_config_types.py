"""ModelParallelConfig's dataclass fields carry real types, as megatron-core's do.

megatron's argparse builder (``megatron/training/argument_utils.py``) reads
``dataclasses.fields(config)[i].type`` of every config class built on ModelParallelConfig (its
TransformerConfig, through the switch); a field whose type is a string (what
``from __future__ import annotations`` makes) cannot be turned into an argument.
"""

import collections.abc
import dataclasses
import json
import os
import subprocess
import sys
import types
import typing

import pytest

from megatron_core import ModelParallelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _normal(annotation):
    """An annotation in one spelling: unions as sets, typing aliases as their runtime origin
    (``typing.Callable`` is ``collections.abc.Callable``, ``typing.ContextManager`` is
    ``contextlib.AbstractContextManager``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return frozenset(_normal(arg) for arg in args)
    if origin is typing.Literal:
        return (typing.Literal, frozenset(args))
    if origin is not None:
        return (origin, tuple(_normal(arg) for arg in args)) if args else origin
    return annotation


def test_every_field_type_is_a_type_not_a_string():
    hints = typing.get_type_hints(ModelParallelConfig)
    for field in dataclasses.fields(ModelParallelConfig):
        assert not isinstance(field.type, str), (field.name, field.type)
        assert field.type == hints[field.name], field.name


def test_optional_fields_unwrap_to_their_value_type():
    # What the argparse builder does with a field: an optional type gives its first member.
    fields = {field.name: field.type for field in dataclasses.fields(ModelParallelConfig)}
    assert typing.get_args(fields["virtual_pipeline_model_parallel_size"]) == (int, type(None))
    assert fields["tensor_model_parallel_size"] is int
    assert fields["sequence_parallel"] is bool
    assert typing.get_origin(fields["timers"]) in (typing.Union, types.UnionType)
    assert typing.get_args(fields["timers"])[0] is collections.abc.Callable


@pytest.mark.requires_megatron_core
def test_field_types_equal_megatron_cores():
    # megatron-core's own module, imported under its own name in a fresh interpreter (importing
    # it here would import megatron-core's parallel_state into the pytest process, where a later
    # install() of the switch is refused).
    code = f"""
import dataclasses, importlib, json, sys
sys.path[:0] = [{ROOT!r}, {HERE!r}]
from megatron_core import ModelParallelConfig
from test_model_parallel_config_types import _normal
theirs = importlib.import_module("megatron.core.model_parallel_config").ModelParallelConfig
their_types = {{f.name: f.type for f in dataclasses.fields(theirs)}}
shared = [f for f in dataclasses.fields(ModelParallelConfig) if f.name in their_types]
differ = [f.name for f in shared if _normal(f.type) != _normal(their_types[f.name])]
print(json.dumps({{"distinct": theirs is not ModelParallelConfig, "shared": len(shared),
                  "differ": differ}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["distinct"]
    assert report["shared"] >= 60  # every 0.16.1 field; 0.19 renamed none of them
    assert report["differ"] == []
