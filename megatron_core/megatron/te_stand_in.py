"""The switch serves this package's Transformer Engine stand-in as ``transformer_engine``.

# NOTE [ Serving the Transformer Engine stand-in ]
1. When. ``install()`` serves it exactly when no real Transformer Engine can be imported: no
   ``transformer_engine`` module is imported yet and the import system finds none
   (``importlib.util.find_spec``, asked before the stand-in's finder is in place); a namespace
   package of that name (a directory without ``__init__.py`` on ``sys.path``) is not one. A real
   install always wins, on any machine, GPU or not; the decision is taken once per process,
   at the first ``install()``, and spawn/forkserver children repeat it.
2. What. ``transformer_engine`` is ``megatron_core.transformer_engine``'s module object, and
   every ``transformer_engine.X`` the stand-in has is ``megatron_core.transformer_engine.X``'s
   (the same objects: one class identity, one state; rule 1 of NOTE [ Serving megatron-core's
   modules ] for megatron names). A name the stand-in does not have is not found (an
   ImportError), so megatron-core's ``try`` imports of optional Transformer Engine modules take
   their fallbacks (NOTE [ Transformer Engine stand-in ], rule 1).
3. megatron-core decides at import time whether Transformer Engine is there (``HAVE_TE`` in its
   extension module, read by a dozen modules, and in ``fp8_utils``, ``mlp``, ...). ``install()``
   runs before anything imports ``megatron`` (it refuses otherwise: a served module imported
   from megatron-core), so every such flag sees the stand-in and is True; with it,
   megatron-core's ``TransformerBlock`` builds its default final norm as ``TENorm``, as it does
   with a real Transformer Engine installed.
4. This package's own ``tensor_parallel.random.HAVE_TE`` (megatron-core's name, which its tests
   import) answers at each read whether ``transformer_engine`` is importable, so it agrees
   with megatron-core's flags while the stand-in is served.
5. ``uninstall()`` stops serving: the finder leaves ``sys.meta_path`` and the stand-in's names
   leave ``sys.modules`` (a later ``import transformer_engine`` fails again). Modules that
   imported it keep the objects they were given, and flags megatron-core already decided stay
   as they are in this process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys

from megatron_core.megatron._finder import _ServedLoader

__all__ = [
    "NAME",
    "importable",
    "TARGET",
    "StandInFinder",
    "real_transformer_engine",
    "serve",
    "unserve",
    "is_served",
]

NAME = "transformer_engine"
TARGET = "megatron_core.transformer_engine"


class StandInFinder(importlib.abc.MetaPathFinder):
    """Finds ``transformer_engine`` and its submodules as the stand-in's (NOTE rule 2)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME and not fullname.startswith(NAME + "."):
            return None
        own = TARGET + fullname[len(NAME) :]
        spec = importlib.util.find_spec(own)
        if spec is None:
            return None  # not in the stand-in: not found (its parent's path holds no such file)
        return importlib.machinery.ModuleSpec(fullname, _ServedLoader(own), origin=spec.origin)


_FINDER: StandInFinder | None = None


def _is_stand_in(module) -> bool:
    return getattr(module, "__name__", "").startswith(TARGET)


def importable(spec) -> bool:
    """Whether ``spec`` is a module that imports as a Transformer Engine: a regular module or
    package, not a namespace package (a directory named ``transformer_engine`` without
    ``__init__.py`` on ``sys.path``, such as a folder of tests named so on pytest's path)."""
    return spec is not None and spec.origin not in (None, "namespace")


def real_transformer_engine() -> bool:
    """Whether a real Transformer Engine is imported or importable (NOTE rule 1)."""
    module = sys.modules.get(NAME)
    if module is not None and getattr(module, "__file__", None) is not None:
        return not _is_stand_in(module)
    if is_served():
        return False
    return importable(importlib.util.find_spec(NAME))


def is_served() -> bool:
    """Whether the stand-in is served as ``transformer_engine`` in this process."""
    return _FINDER is not None and _FINDER in sys.meta_path


def serve() -> bool:
    """Serve the stand-in unless a real Transformer Engine is there (idempotent); returns
    whether it is served."""
    global _FINDER
    if is_served():
        return True
    if real_transformer_engine():
        return False
    # a namespace package of that name imported earlier would shadow the stand-in (rule 1)
    for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
        del sys.modules[name]
    _FINDER = StandInFinder()
    sys.meta_path.insert(0, _FINDER)
    return True


def unserve() -> None:
    """NOTE rule 5: stop serving and forget the stand-in's ``transformer_engine`` names."""
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None
    for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
        if _is_stand_in(sys.modules[name]):
            del sys.modules[name]
