# Two commands on a fresh machine with Python 3.10+ (README "Quick start"):
#   make train    create .venv, install torch (the main lane's, README "Support matrix") and this
#                 package, run the main job
#   make test     the same set-up, then the test suite (the README's test command, in .venv)
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

.PHONY: train test clean

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

clean:
	rm -rf $(VENV)
