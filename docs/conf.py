"""Sphinx configuration of the megatron_core manual (``make docs``).

Pages: markdown through myst-parser (index, guides/, benchmarks/); the API reference (api/) is
written by ``_ext/api_pages.py`` from the package's docstrings (Google style, napoleon) when the
build starts. The build runs with ``-W --keep-going -n`` (Makefile): a docstring that does not
render, a broken cross-reference or a page that names a missing page fails it.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
# The package of this checkout, ahead of any installed copy; and the local extension.
sys.path.insert(0, str(DOCS.parent))
sys.path.insert(0, str(DOCS / "_ext"))

project = "megatron_core"
author = "megatron_core developers"
copyright = "megatron_core developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "api_pages",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# markdown: #-anchors for headings down to ###, as GitHub renders README.md and BENCHMARKS.md.
myst_heading_anchors = 3

# autodoc: members in source order, signatures with their type hints; the API pages decide
# which names are shown (api_pages.py), so no autosummary stubs are generated.
autodoc_member_order = "bysource"
# Each page is one module's: its names are shown without the module's path in front.
add_module_names = False
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# A method without a docstring of its own is left out, not shown with torch's (Module.forward).
autodoc_inherit_docstrings = False
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# An attribute's type comes from autodoc (its annotation, parsed), not from napoleon's text.
napoleon_attr_annotations = False

# Every cross-reference must resolve (make docs: -n), except those into other projects, which
# this site cannot link to offline (no intersphinx: the build reads no network): the standard
# library, torch, megatron-core and the other fact sources, and the words of docstring types.
_EXTERNAL = sorted(
    set(sys.stdlib_module_names)
    | {"torch", "megatron", "transformer_engine", "deepspeed", "apex", "numpy", "np", "pytest"}
)
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"({})(\..*)?".format("|".join(_EXTERNAL))),
    (r"py:.*", r"(optional|callable|iterable|sequence|mapping|tensor|Tensor|module)"),
]

html_theme = "furo"
html_title = "megatron_core"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
