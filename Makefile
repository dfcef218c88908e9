# A CPU build of torch unless one is installed already (GPU users: install CUDA torch first, or use
# environment.yml); triton runs kernels in its interpreter when there is no GPU.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: dev test lint notebooks chapters workbook

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

dev: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch --index-url $(TORCH_CPU_INDEX) || $(BIN)/pip install -q torch
	$(BIN)/pip install -q -e ".[dev,notebooks]"

lint:
	$(BIN)/ruff check liger_lab tests benchmarks solutions
	$(BIN)/ruff format --check liger_lab tests benchmarks

test: dev lint
	$(BIN)/python -m liger_lab.chapters --check
	$(BIN)/pytest -q tests solutions --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider

chapters:
	$(BIN)/python -m liger_lab.chapters

workbook: dev
	$(BIN)/jupyter lab chapters/
