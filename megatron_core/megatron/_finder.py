"""The import hook behind the switch: serve claimed ``megatron.*`` names from this package.

# NOTE [ Serving megatron-core's modules ]
1. A claimed name (``SERVED``, e.g. ``megatron.core.parallel_state``) resolves to this package's
   module object itself (``megatron_core.parallel_state``): the same object under both names, so
   there is one global state, and ``isinstance`` agrees whichever path a class came from.
2. A name below a served module that is not claimed resolves to megatron-core's own file if
   megatron-core has one (``megatron.core.pipeline_parallel.combined_1f1b`` is megatron-core's
   code, importing our parallel_state through rule 1), and otherwise is not found: this package's
   private modules (``megatron.core.tensor_parallel._collectives``) are never served by accident.
3. Every other name is left to the ordinary import system: installed megatron-core.
4. The hook sits first on ``sys.meta_path``; it never imports megatron-core itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

__all__ = ["MegatronSwitchFinder", "PostImportFinder"]


class _ServedLoader(importlib.abc.Loader):
    """Loads a claimed name as this package's module object (NOTE rule 1)."""

    def __init__(self, target: str):
        self.target = target
        self._own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the megatron spec on the module; give it its own back so
        # that reload(), pickling by module name and tracebacks keep naming this package's file.
        if self._own_spec is not None:
            module.__spec__ = self._own_spec


class MegatronSwitchFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that applies NOTE [ Serving megatron-core's modules ].

    Args:
        served: megatron module name -> this package's module name.
    """

    def __init__(self, served: dict[str, str]):
        self.served = dict(served)

    def _served_parent(self, fullname: str) -> str | None:
        """The longest claimed name that ``fullname`` is strictly below, if any."""
        parts = fullname.split(".")
        for end in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.served:
                return prefix
        return None

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.served:
            loader = _ServedLoader(self.served[fullname])
            return importlib.machinery.ModuleSpec(fullname, loader)
        parent = self._served_parent(fullname)
        if parent is None:
            return None  # rule 3
        spec = _megatron_own_spec(fullname)
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: it is below {parent!r}, which the megatron switch "
                f"serves from {self.served[parent]!r}, and megatron-core has no such module "
                f"(see megatron_core.megatron.SERVED)",
                name=fullname,
            )
        return spec


def _megatron_own_spec(fullname: str):
    """megatron-core's own file for ``fullname`` (NOTE rule 2), or None.

    It is looked up below the nearest enclosing package that is megatron-core's own and already
    imported (``megatron.core`` for ``megatron.core.tensor_parallel.x``): the import system
    imported it before asking for any name below it, so its ``__path__`` is where the installed
    megatron-core lives.
    """
    parts = fullname.split(".")
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        package = sys.modules.get(name)
        if package is None or getattr(package, "__name__", None) != name:
            continue  # not imported, or one of this package's modules served under the name
        for root in getattr(package, "__path__", None) or []:
            found = _spec_below(fullname, root, parts[end:])
            if found is not None:
                return found
        return None
    return None


def _spec_below(fullname: str, root: str, rest: list[str]):
    """The spec of module ``rest`` (a dotted path split in parts) under directory ``root``."""
    base = os.path.join(root, *rest)
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(base, "__init__.py"), submodule_search_locations=[base]
        )
    if os.path.isfile(base + ".py"):
        return importlib.util.spec_from_file_location(fullname, base + ".py")
    return None


class _PostImportLoader(importlib.abc.Loader):
    """Runs another loader, then calls ``after(module)`` on the module it made."""

    def __init__(self, loader, after):
        self.loader, self.after = loader, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.after(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the wrapped loader
        return getattr(self.loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds the modules ``wanted(name)`` accepts through the rest of ``sys.meta_path`` and
    calls ``after(module)`` once each has run, before anything else imports from it (the CPU
    mode's completions and adaptations, NOTE [ CUDA on the CPU ] rules 8-9; the fixes of NOTE
    [ Without Transformer Engine ])."""

    def __init__(self, wanted, after):
        self.wanted, self.after = wanted, after

    def find_spec(self, fullname, path=None, target=None):
        if not self.wanted(fullname):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PostImportLoader(spec.loader, self.after)
                return spec
        return None
