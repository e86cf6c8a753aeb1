"""The API reference's pages, written from the package itself when a build starts.

One page per public module of ``megatron_core`` (no part of its dotted name starts with ``_``),
nested as the package is: a family's face lists the public modules beneath it. A page holds the
module's docstring and the names of its ``__all__`` (a module without ``__all__``: the public
functions and classes it defines).

Each class and function is described once, on the page of the shallowest public module that
exports it (``megatron_core.tensor_parallel.ColumnParallelLinear``, the path users import, not the
file that defines it); every other module that exports it lists it in a table that links there.
A cross-reference that the Python domain does not find is looked up in the package
(``on_missing_reference``): another path of a described object leads to its description, a name
that exists but is described nowhere is shown as code, and a name that does not exist stays a
warning, which ``-W`` makes an error.

Also here:

* a public class or function without a docstring is a warning (STYLE.md 9);
* a ``# NOTE [ Title ]`` line in a docstring becomes a rubric of that title; rules written under
  it as comment lines (``# 1. ...``) become a literal block, their layout kept;
* a dataclass's ``default_factory`` field shows its factory's call in the signature.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)

PACKAGE = "megatron_core"
# Generated pages: api/megatron_core*.rst (git ignores them; stale ones are removed).
PAGE_GLOB = PACKAGE + "*.rst"

# id(class or function) -> the dotted name of its one description.
_CANONICAL: dict[int, str] = {}


def _is_public(modname: str) -> bool:
    return not any(part.startswith("_") for part in modname.split("."))


def _public_modules() -> list[str]:
    """Every public module of the package, imported (one that fails to import fails the build)."""

    def fail(name: str) -> None:
        raise RuntimeError(f"API reference: importing {name} failed")

    package = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + ".", onerror=fail):
        if _is_public(info.name):
            importlib.import_module(info.name)
            names.append(info.name)
    return sorted(names)


def _exported(modname: str) -> list[str]:
    """The names a module exports: its ``__all__``, else the public classes and functions it
    defines."""
    module = importlib.import_module(modname)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and obj.__module__ == modname
    ]


def _kind(obj) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isroutine(obj):
        return "function"
    return "data"


def _has_identity(obj) -> bool:
    """Classes and functions are one object wherever exported; data is described per module."""
    return _kind(obj) in ("class", "exception", "function")


def _depth(modname: str) -> int:
    return modname.count(".")


def _homes(modules: list[str]) -> dict[int, str]:
    """id(object) -> the dotted name of its one description: the shallowest public module that
    exports it; of equal depth, the one on the path to the file defining it, then by name."""
    exporters: dict[int, list[tuple[str, str]]] = {}  # id -> [(module, name there)]
    defining: dict[int, str] = {}  # id -> the module that defines the object
    for modname in modules:
        module = importlib.import_module(modname)
        for name in _exported(modname):
            obj = getattr(module, name)
            # A face's function named as its module (distributed.finalize_model_grads) cannot
            # be described there: the module's page owns that dotted name.
            if _has_identity(obj) and f"{modname}.{name}" not in modules:
                exporters.setdefault(id(obj), []).append((modname, name))
                defining[id(obj)] = getattr(obj, "__module__", None) or ""

    homes = {}
    for key, places in exporters.items():

        def rank(place: tuple[str, str], defined_in: str = defining[key]) -> tuple:
            modname = place[0]
            return (_depth(modname), not defined_in.startswith(modname + "."), modname)

        modname, name = min(places, key=rank)
        homes[key] = f"{modname}.{name}"
    return homes


def _title(text: str, underline: str = "=") -> list[str]:
    return [text, underline * len(text), ""]


def _page(modname: str, children: list[str], homes: dict[int, str]) -> str:
    module = importlib.import_module(modname)
    lines = _title(modname)
    lines += [f".. automodule:: {modname}", "", f".. currentmodule:: {modname}", ""]
    if children:
        # The sidebar names a child by its last part under its parent (the page title is whole);
        # the page itself lists the children with their summaries.
        lines += [".. toctree::", "   :hidden:", ""]
        lines += [f"   {c.rpartition('.')[2]} <{c}>" for c in children]
        lines += ["", ".. rubric:: Modules", "", ".. autosummary::", ""]
        lines += [f"   ~{c.removeprefix(modname + '.')}" for c in children]
        lines.append("")
    described, elsewhere, submodules = [], [], []
    for name in _exported(modname):
        obj = getattr(module, name)
        kind = _kind(obj)
        if kind == "module":
            submodules.append(obj.__name__)
        elif _has_identity(obj) and homes.get(id(obj), f"{modname}.{name}") != f"{modname}.{name}":
            elsewhere.append(homes[id(obj)])
        else:
            described.append((name, kind))
    if described and (children or module.__doc__):
        lines += [".. rubric:: Names", ""]
    for name, kind in described:
        lines += _description(modname, name, kind, getattr(module, name))
    if elsewhere:
        lines += [".. rubric:: Also exported here", ""]
        lines += [".. autosummary::", "   :nosignatures:", ""]
        # Relative below this module: autosummary refuses a full name under it (a face listing
        # its own submodule's function, distributed.finalize_model_grads).
        lines += [f"   ~{target.removeprefix(modname + '.')}" for target in elsewhere]
        lines.append("")
    if submodules:
        lines += [".. rubric:: Modules exported here", ""]
        lines += [f"* :py:mod:`{target}`" for target in submodules]
        lines.append("")
    return "\n".join(lines)


def _description(modname: str, name: str, kind: str, obj) -> list[str]:
    if kind != "data" and not (getattr(obj, "__module__", None) or "").startswith(PACKAGE):
        # Another project's object under this package's name (compat.py binds torch's own).
        origin = f"{obj.__module__}.{obj.__qualname__}"
        return [f".. py:data:: {modname}.{name}", "", f"   This torch's ``{origin}``.", ""]
    lines = [f".. auto{kind}:: {modname}.{name}"]
    if kind in ("class", "exception"):
        lines.append("   :members:")
        if obj.__bases__ != (object,):
            lines.append("   :show-inheritance:")
        if issubclass(obj, enum.Enum):
            lines.append("   :undoc-members:")
    elif kind == "data" and len(repr(obj)) > 80:
        lines.append("   :no-value:")
    return [*lines, ""]


def write_pages(app) -> None:
    """builder-inited: (re)write api/megatron_core*.rst, touching only pages that changed."""
    outdir = Path(app.srcdir) / "api"
    modules = _public_modules()
    homes = _homes(modules)
    _CANONICAL.clear()
    _CANONICAL.update(homes)
    children: dict[str, list[str]] = {m: [] for m in modules}
    for modname in modules:
        parent = modname.rpartition(".")[0]
        if parent in children:
            children[parent].append(modname)
    wanted = set()
    for modname in modules:
        # The face's children: sub-packages (families) first, then plain modules.
        kids = sorted(children[modname], key=lambda m: (not children[m] and not _is_pkg(m), m))
        path = outdir / f"{modname}.rst"
        wanted.add(path)
        text = _page(modname, kids, homes)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    for stale in outdir.glob(PAGE_GLOB):
        if stale not in wanted:
            stale.unlink()


def _is_pkg(modname: str) -> bool:
    return hasattr(importlib.import_module(modname), "__path__")


def on_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    """autodoc-process-docstring: a public class or function must say something; data shows
    its own docstring only (not its type's, e.g. dict's); NOTE blocks get their rubric."""
    type_doc = getattr(type(obj), "__doc__", None)
    if what in ("data", "attribute") and lines and isinstance(type_doc, str):
        if "\n".join(lines).strip() == inspect.cleandoc(type_doc):
            lines.clear()
    if what in ("class", "exception", "function", "method") and not any(s.strip() for s in lines):
        if not name.rpartition(".")[2].startswith("_"):
            logger.warning("API reference: %s %s has no docstring", what, name)
    _note_blocks(lines)


def on_signature(app, what, name, obj, options, signature, return_annotation):
    """autodoc-process-signature: a dataclass field's ``default_factory`` shows as its call
    (``= dict()``), not as ``= <factory>``, which the signature parser cannot read."""
    if signature and "= <factory>" in signature and dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            if field.init and field.default_factory is not dataclasses.MISSING:
                call = getattr(field.default_factory, "__name__", "")
                call = f"{call}()" if call.isidentifier() else "..."
                signature = signature.replace("= <factory>", f"= {call}", 1)
    return signature, return_annotation


_NOTE = re.compile(r"^(# )?NOTE \[ (?P<title>.+?) \]\s*$")
_ITEM = re.compile(r"^\d+\. \S")


def _note_blocks(lines: list[str]) -> None:
    """A NOTE block as the house writes it, in place: the ``NOTE [ Title ]`` line (``#`` or not)
    becomes a rubric of that title. Rules written under it as comment lines (``# 1. ...``) become
    a literal block, their layout kept; rules written as plain lines keep their markup, with the
    blank lines reStructuredText wants around a numbered list that the house's NOTE style leaves
    out (a lead-in line right above rule 1, a line right below the last rule)."""
    i = 0
    while i < len(lines):
        match = _NOTE.match(lines[i])
        if not match:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].startswith("#"):
            end += 1
        body = [line[2:] if line.startswith("# ") else line[1:] for line in lines[i + 1 : end]]
        while body and not body[0].strip():
            body.pop(0)
        block = [f".. rubric:: NOTE [ {match['title']} ]", ""]
        if body:
            # Plain text (not highlighted as Python), wrapped by docs/_static/custom.css.
            block += [".. code-block:: text", "   :class: note-rules", ""]
            block += [*(f"   {line}".rstrip() for line in body), ""]
        if i > 0 and lines[i - 1].strip():
            block.insert(0, "")
        lines[i:end] = block
        i += len(block)
        if not body:
            _space_list(lines, i)


def _space_list(lines: list[str], start: int) -> None:
    """Blank lines, from ``start`` on, between a numbered list and plain text touching it."""
    in_list = False
    i = start
    while i < len(lines):
        line = lines[i]
        prev = lines[i - 1] if i > start else ""
        if not line.strip():
            in_list = False
        elif _ITEM.match(line):
            if not in_list and prev.strip():
                lines.insert(i, "")
                i += 1
            in_list = True
        elif in_list and not line.startswith(" "):
            lines.insert(i, "")
            i += 1
            in_list = False
        i += 1


def on_missing_reference(app, env, node, contnode):
    """A reference the Python domain did not find, to a name of this package:

    * another path of a described class or function (a type hint names the file that defines it;
      a docstring names it relative to its own module) resolves to its one description;
    * a name that no module of the reference's page binds but that one description alone ends
      with (``SavedInputs``, ``MemoryTimeline``) resolves to it;
    * a name that exists but is described nowhere (a private helper, a method without a
      docstring, a dataclass field, an attribute ``__init__`` sets) is shown as code, without
      a link.

    A name that does not exist, or that several descriptions end with, stays unresolved: a
    warning, an error under ``-W``.
    """
    if node.get("refdomain") != "py" or node.get("reftype") == "mod":
        return None
    target = node.get("reftarget", "").lstrip(".~")
    domain = env.get_domain("py")

    def resolve(path: str):
        return domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], path, node, contnode
        )

    obj, path = _find(target, node.get("py:module"), node.get("py:class"))
    if path is not None:
        home = _CANONICAL.get(id(obj)) if _has_identity(obj) else None
        found = resolve(home) if home is not None and home != target else None
        return found if found is not None else contnode
    if target.startswith(PACKAGE + ".") or not target:
        return None
    ends = {
        name
        for name, entry in domain.objects.items()
        if name.endswith("." + target) and not entry.aliased  # an alias: autodoc's :canonical:
    }
    if len(ends) == 1:
        return resolve(ends.pop())
    return None


_MISSING = object()
_FIELD = object()  # an instance attribute (field, slot, self.x = ...): exists, no object here


def _find(target: str, modname: str | None, classname: str | None):
    """(object, dotted path) of a reference target of this package: absolute, or relative to the
    class and module the reference sits in; (None, None) when it names nothing there."""
    if target.startswith(PACKAGE + "."):
        tries = [target]
    elif modname and modname.startswith(PACKAGE):
        tries = [f"{modname}.{target}"]
        if classname:
            tries.insert(0, f"{modname}.{classname}.{target}")
    else:
        return None, None
    for dotted in tries:
        obj = _lookup(dotted)
        if obj is not _MISSING:
            return obj, dotted
    return None, None


def _lookup(dotted: str):
    """The object a dotted name of this package names, ``_FIELD``, or ``_MISSING``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            parent, obj = obj, getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                last = i == len(parts) - 1
                return _FIELD if last and _has_field(parent, attr) else _MISSING
        return obj
    return _MISSING


def _has_field(cls, name: str) -> bool:
    """Whether instances of ``cls`` have attribute ``name``: annotated, a slot, or assigned as
    ``self.name = ...`` in a method of the class or a base of this package."""
    if not inspect.isclass(cls):
        return False
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]")
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__slots__", ()):
            return True
        if klass.__module__.startswith(PACKAGE):
            try:
                if assigned.search(inspect.getsource(klass)):
                    return True
            except (OSError, TypeError):
                pass
    return False


def setup(app):
    app.connect("builder-inited", write_pages)
    app.connect("autodoc-process-docstring", on_docstring)
    app.connect("autodoc-process-signature", on_signature)
    app.connect("missing-reference", on_missing_reference)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
