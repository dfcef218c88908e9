# Two entry points (see README): `make workbook` and `make test`. Both create .venv and install what they
# need. torch, when .venv has none yet: with an NVIDIA driver (nvidia-smi answers), PyPI's default CUDA
# build; otherwise the CPU build from PyTorch's CPU index (PyPI as a fallback). Without a GPU, Triton runs
# every kernel in its interpreter.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# Where `make workbook` serves JupyterLab: 0.0.0.0 to reach it from other machines (or use an SSH tunnel).
WORKBOOK_IP ?= 127.0.0.1
WORKBOOK_PORT ?= 8888

.PHONY: torch test lint chapters workbook

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

torch: $(BIN)/python
	@$(BIN)/python -c "import torch" 2>/dev/null \
		|| { nvidia-smi >/dev/null 2>&1 && $(BIN)/pip install torch; } \
		|| $(BIN)/pip install torch --index-url $(TORCH_CPU_INDEX) \
		|| $(BIN)/pip install torch

test: torch
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/ruff check .
	$(BIN)/ruff format --check liger_lab tests benchmarks
	$(BIN)/python -m liger_lab.workbook.chapters --check
	$(BIN)/pytest -q -n 2 --dist loadscope tests solutions --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg $(PYTEST_ARGS)

lint: torch
	$(BIN)/ruff check .
	$(BIN)/ruff format --check liger_lab tests benchmarks

chapters:
	$(BIN)/python -m liger_lab.workbook.chapters

workbook: torch
	$(BIN)/pip install -q -e ".[notebooks]"
	$(BIN)/liger-lab workbook --ip $(WORKBOOK_IP) --port $(WORKBOOK_PORT)
