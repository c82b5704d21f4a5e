# Every command a developer or CI needs. `make setup` builds .venv from this repo's files alone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# pytest workers: the suite is CPU-bound and the machine small; override with `make test JOBS=1`.
JOBS   ?= 2

.PHONY: setup test demo bench bench-train bench-checked lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch pinned first: a CPU wheel; an unpinned torch would pull several GB of CUDA packages.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup

demo: setup
	$(BIN)/python examples/demo.py demo-out

bench: setup
	$(BIN)/python benchmarks/run.py

# nxdtrain tokens/s and per-process peak memory against a transformers loop (~20-30 min on 2 cores;
# BENCH_ARGS=--quick for a smoke run).
bench-train: setup
	$(BIN)/python benchmarks/train.py $(BENCH_ARGS)

# The cost of checked reads alone (to-hf with and without --no-check, 70B shapes, 5 pairs; ~6 minutes)
bench-checked: setup
	$(BIN)/python benchmarks/run.py --checked-reads --repeat 5

lint: setup
	$(BIN)/ruff check ckptconv nxdtrain tests benchmarks examples
	$(BIN)/mypy ckptconv

clean:
	rm -rf demo-out bench-out .pytest_cache
