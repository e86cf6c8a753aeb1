"""Pickling of the harness's arguments and results, whatever other libraries do to torch's own.

torch pickles a storage as a call of ``torch.storage._load_from_bytes``, looked up when the
pickle is made; megatron-core 0.19 replaces that function with one of its own when
``megatron.core`` is imported, so every tensor pickled afterwards imports megatron where it is
unpickled (before the rank body can install the switch). The harness therefore pickles storages
as a call of :func:`storage_from_bytes` here: the same bytes (``torch.save``'s format), loaded by
this module, importing nothing else.
"""

from __future__ import annotations

import io
import pickle
import sys

__all__ = ["dumps", "storage_from_bytes"]

PROTOCOL = pickle.HIGHEST_PROTOCOL


def storage_from_bytes(data: bytes):
    """The storage ``torch.save`` wrote into ``data`` (the inverse of the storage reducer)."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
            return NotImplemented
        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=False)
        return storage_from_bytes, (buffer.getvalue(),)


def dumps(obj) -> bytes:
    """``pickle.dumps(obj)`` with tensors' storages pickled by this module (see the module doc)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=PROTOCOL).dump(obj)
    return buffer.getvalue()
