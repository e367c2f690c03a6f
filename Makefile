# Every command a reader is told to run. `make help` lists them.
# PYTHON=python3 runs the targets without a venv (e.g. an offline GPU machine fed by `make wheelhouse`).
PYTHON ?= .venv/bin/python
VENV := .venv
# A machine without a GPU gets the CPU build of torch and a triton/numpy pair whose interpreter works.
CPU_PINS := torch==2.13.0 triton==3.9.0 "numpy>=2.4,<2.5"
NB ?=
ARGS ?=  # e.g. ARGS="--deadline 540": a hard time limit for `make reproduce`; "--budget-scale 4": larger budgets
PYTEST := $(PYTHON) -m pytest
NBVAL := --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg
# "yes" on a machine with an NVIDIA GPU, else empty (expanded only by the targets that ask)
HAS_GPU = $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
# Without a GPU the tests spread over the CPU's cores (pytest-xdist, one test file or notebook per
# worker at a time, so a notebook's cells run in order in one kernel); with one they run in one process.
XDIST = $(if $(HAS_GPU),,$(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo "-n auto --dist loadfile"))

.PHONY: help setup peers test unit nbval bench reproduce lab wheelhouse clean

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 12

setup:  ## create .venv with the package, test and notebook dependencies (CPU torch without a GPU)
	python3 -m venv $(VENV)
	@if [ -n "$(HAS_GPU)" ]; then \
		$(VENV)/bin/pip install -q -e ".[dev]"; \
	else \
		$(VENV)/bin/pip install -q $(CPU_PINS) && $(VENV)/bin/pip install -q -e ".[dev]"; \
	fi
	$(VENV)/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	@PYTHON=$(VENV)/bin/python bash tools/peers.sh .peers
	@echo "setup done: $$($(VENV)/bin/python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"

peers:  ## unpack the measured competitors into .peers/<name>, one folder each (WHEELS=.whl: offline)
	@PYTHON=$(PYTHON) bash tools/peers.sh .peers

test:  ## unit + interpreter-kernel tests, the bench smoke run, and nbval over the notebooks
	$(PYTEST) $(XDIST) tests notebooks $(NBVAL)

unit:  ## only tests/ (no notebooks)
	$(PYTEST) $(XDIST) tests

nbval:  ## only the notebooks, re-executed on this machine and compared (lax)
	$(PYTEST) $(XDIST) notebooks $(NBVAL)

bench:  ## on a GPU: regenerate every results/*.json, *.md and figure (no notebooks)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m mingru.bench all

reproduce:  ## on a GPU: every harness once + every notebook in place, one commit (NB=04: one chapter); CPU: smoke run
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(PYTHON) -m mingru.reproduce $(NB) $(ARGS)

lab:  ## open JupyterLab on notebooks/ with the project's kernel
	$(PYTHON) -m jupyter lab notebooks

wheelhouse:  ## on a connected machine: fill .whl/ with what an offline GPU machine needs (tools/wheelhouse.txt)
	bash tools/wheelhouse.sh .whl

clean:  ## remove caches and scratch output (keeps .venv and results/)
	rm -rf scratch_out .pytest_cache build *.egg-info
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +
