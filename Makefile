# Two commands on a fresh machine with Python 3.10+ (README "Quick start"):
#   make train    create .venv, install torch (the main lane's, README "Support matrix") and this
#                 package, run the main job
#   make test     the same set-up, then the test suite (the README's test command, in .venv)
# and the manual:
#   make docs     the same set-up plus the docs extra, then the site (docs/) into
#                 docs/_build/html (open index.html); any warning fails it. CI runs
#                 `make docs-build PY=...` with its own environment.
# Options: NPROC=4 (ranks), ARGS="--train-iters 100" (more train_gpt.py flags),
# TORCH_INDEX= (empty: PyPI's default torch wheels, e.g. with CUDA; default: CPU-only wheels),
# PYTHON=python3.11, VENV_FLAGS=--system-site-packages (reuse an installed torch).

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
NPROC ?= 2
ARGS ?=
PY := $(VENV)/bin/python
DOCS_OUT ?= docs/_build/html
# -E reads every page each time: an incremental build would not repeat an unchanged page's
# warnings. -W --keep-going: every warning is listed, and any fails the build. -n: every
# cross-reference must resolve (docs/conf.py lists the projects it cannot link to).
SPHINXOPTS ?= -E -W --keep-going -n -q

.PHONY: train test docs docs-build clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)" \
		$(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e ".[test,dev,megatron]"
	touch $@

train: $(VENV)/.installed
	$(PY) scripts/train_gpt.py --nproc-per-node $(NPROC) $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest tests -q

$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(MAKE) docs-build

docs-build:
	$(PY) -m sphinx -b html $(SPHINXOPTS) docs $(DOCS_OUT)
	@echo "docs: $(DOCS_OUT)/index.html"

clean:
	rm -rf $(VENV)
