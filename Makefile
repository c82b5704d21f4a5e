# Every command a developer or CI needs. `make setup` builds .venv from this repo's files alone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# pytest workers: the suite is CPU-bound and the machine small; override with `make test JOBS=1`.
JOBS   ?= 2

default: help

.PHONY: help docs setup test setup-xla test-xla setup-titan test-titan test-gpu test-slurm demo bench bench-8b bench-405b bench-startup bench-train bench-checked bench-dcp bench-reads lint clean

# this list: every target with the first line of the comment above it
help:
	@awk '/^# /{if (c=="") c=substr($$0,3)} /^[a-z][a-z0-9-]*:/{split($$1,t,":"); if (c!="") printf "  make %-14s %s\n", t[1], c; c=""} !/^# /{if (!/^[a-z][a-z0-9-]*:/) c=""}' $(MAKEFILE_LIST)

# docs/cli.md, the reference of every flag, regenerated from the parsers (a test fails when it is stale)
docs: setup
	$(BIN)/python tools/cli_reference.py

# .venv with torch 2.13.0 (CPU) and the project, editable, with its dev tools and its optional C transpose kernel
# (ckptconv/io/_transpose.c, built in place by the editable install where a C compiler exists)
setup: $(STAMP)

$(STAMP): pyproject.toml setup.py ckptconv/io/_transpose.c Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch pinned first, so that .[dev] keeps it: the CPU wheel where pip is configured with one (this project's
	# machines: a local wheel directory); from PyPI alone the pin is the CUDA build (README: the CPU index).
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# which transpose the install uses (the editable install builds the optional kernel next to its source)
	$(BIN)/python -m ckptconv.io.transpose
	# bytecode written once, as pip writes a regular install's: where PYTHONDONTWRITEBYTECODE is set, an editable
	# install would compile ckptconv's ~80 modules at every start (~0.2 s; Python still recompiles an edited one)
	$(BIN)/python -m compileall -q ckptconv nxdtrain > /dev/null
	touch $(STAMP)

# the main test lane (JOBS=1 for one worker)
test: setup
	$(BIN)/python -m pytest -q -n $(JOBS) --dist loadgroup

# The XLA lane: a second environment with torch-xla (the PyPI wheels need torch 2.9.0 exactly; that torch is a
# CUDA build, ~7 GB installed). The constraints file keeps `.[dev]` from moving torch off 2.9.0.
XLA_VENV  := .venv-xla
XLA_BIN   := $(XLA_VENV)/bin
XLA_STAMP := $(XLA_VENV)/.installed-stamp
XLA_TORCH := 2.9.0

# .venv-xla: torch 2.9.0 + torch-xla 2.9.0 for the XLA lane
setup-xla: $(XLA_STAMP)

$(XLA_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_BIN)/python -m pip install --quiet --upgrade pip
	$(XLA_BIN)/python -m pip install --quiet torch==$(XLA_TORCH) torch-xla==$(XLA_TORCH)
	echo "torch==$(XLA_TORCH)" > $(XLA_VENV)/constraints.txt
	$(XLA_BIN)/python -m pip install --quiet -c $(XLA_VENV)/constraints.txt -e '.[dev]'
	$(XLA_BIN)/python -c "import torch, torch_xla; assert torch.__version__.split('+')[0] == '$(XLA_TORCH)', torch.__version__"
	touch $(XLA_STAMP)

# PJRT_DEVICE=CPU: XLA:CPU, the only XLA device this CI has. The main lane collects test_xla.py and skips it.
XLA_TESTS := tests/nxdtrain/test_xla.py tests/nxdtrain/test_device.py tests/nxdtrain/test_moe_xla.py
# the XLA lane: nxdtrain on XLA:CPU
test-xla: setup-xla
	PJRT_DEVICE=CPU $(XLA_BIN)/python -m pytest -q -n 0 $(XLA_TESTS)

GPU_PYTHON ?= python3
# the GPU lane: nxdtrain on a CUDA device, NCCL, the machine's own torch (GPU_PYTHON); CI has no GPU
# tests/nxdtrain/test_cuda.py, which the main lane skips. The main venv's torch is a CPU build, so this runs the
# machine's CUDA torch with this checkout on PYTHONPATH; tools/device/gpu_lane.sh does the same plus the CLIs end
# to end and the GPU rows of bench-train, on a machine without a package index.
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest -q -n 0 -rs tests/nxdtrain/test_cuda.py tests/nxdtrain/test_device.py

# The TorchTitan lane: torchtitan from PyPI in its own environment, to check our DCP output against the real
# thing, its own trainer (torchtitan.train) included. TorchTitan 0.3.0's trainer calls
# torch.distributed.set_timeout after its first step, which torch 2.13 lacks: the lane runs torch 2.14.1, the
# public index's default build (CUDA libraries; it runs on CPU, as the xla lane's torch does). The constraints
# file keeps torchtitan's and .[dev]'s requirements from moving it; torchtitan imports triton unconditionally.
TITAN_VENV    := .venv-titan
TITAN_BIN     := $(TITAN_VENV)/bin
TITAN_STAMP   := $(TITAN_VENV)/.installed-stamp
TITAN_TORCH   := 2.14.1
TITAN_VERSION := 0.3.0

# .venv-titan: torchtitan 0.3.0 on torch 2.14.1 (the main lane keeps its CPU 2.13.0)
setup-titan: $(TITAN_STAMP)

$(TITAN_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_BIN)/python -m pip install --quiet --upgrade pip
	$(TITAN_BIN)/python -m pip install --quiet torch==$(TITAN_TORCH)
	echo "torch==$(TITAN_TORCH)" > $(TITAN_VENV)/constraints.txt
	$(TITAN_BIN)/python -m pip install --quiet -c $(TITAN_VENV)/constraints.txt torchtitan==$(TITAN_VERSION) triton
	$(TITAN_BIN)/python -m pip install --quiet -c $(TITAN_VENV)/constraints.txt -e '.[dev]'
	$(TITAN_BIN)/python -c "import torch, torchtitan; assert torch.__version__.split('+')[0] == '$(TITAN_TORCH)', torch.__version__"
	touch $(TITAN_STAMP)

# The main lane collects test_titan.py and skips it (no torchtitan there).
TITAN_TESTS := tests/test_titan.py tests/test_titan_config.py tests/test_titan_trainer.py tests/test_titan_moe.py tests/test_titan_moe_trainer.py \
	tests/nxdtrain/test_moe_titan_export.py tests/test_titan_deepseek.py tests/test_titan_deepseek_trainer.py \
	tests/test_titan_gpt_oss.py tests/test_titan_gpt_oss_trainer.py tests/test_titan_config_imports.py tests/test_titan_walk.py
# the TorchTitan lane: TorchTitan's own code loads what to-dcp writes
test-titan: setup-titan
	$(TITAN_BIN)/python -m pytest -q -n 0 $(TITAN_TESTS)

# The Slurm lane: tools/slurm_lane.sh installs Debian's slurm-wlm and munge if absent (root), starts munged,
# slurmctld and two slurmd (two nodes on this host) under a temporary directory, runs tests/slurm through sbatch
# with this venv's python on the jobs' PATH, and stops exactly the daemons it started (docs/slurm.md)

# the Slurm lane: the examples/slurm templates chained, cancelled, requeued and preempted under a real Slurm
test-slurm: setup
	SLURM_LANE_PYTHON=$(CURDIR)/$(BIN)/python tools/slurm_lane.sh

# tiny Llama -> NxD -> HF bit-exact, inspect, 5 training steps, export (into demo-out/)
demo: setup
	$(BIN)/python examples/demo.py demo-out

# conversion throughput against cp, CPU s/GB and peak memory (70B, 8B, Mixtral-8x7B shapes, a 6.85 GB training tag)
bench: setup
	$(BIN)/python benchmarks/run.py

# the 8B rows of `make bench` alone, 3 runs each (~5 minutes)
bench-8b: setup
	$(BIN)/python benchmarks/run.py --only-8b --repeat 3

# one Llama-3.1-405B-shaped layer (14.8 GB) to NxD, back to HF and resharded at --max-memory 1, 2, 4 GiB, 3 runs each
# (~1-1.5 h; needs ~32 GB free; BENCH_ARGS=--before DIR runs an older tree's too, alternated; `make bench` runs each budget once)
bench-405b: setup
	$(BIN)/python benchmarks/run.py --405b --405b-commands to-nxd,to-hf,reshard --repeat 3 $(BENCH_ARGS)

# CLI start-up: --version, --help, usage and config errors, median of 5 (BENCH_ARGS=--before DIR compares a tree)
bench-startup: setup
	$(BIN)/python benchmarks/startup.py $(BENCH_ARGS)

# nxdtrain tokens/s and per-process peak memory against a transformers loop, then the MoE and save tables (~30-40 min)
# (2 cores; BENCH_ARGS=--quick for a smoke run; the MoE table: Mixtral at ep 1 and ep 2, all-to-all bytes per step;
# the save table: how long a save stalls training in each mode against cp -r of the tag, benchmarks/saves.py)
bench-train: setup
	$(BIN)/python benchmarks/train.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/train_moe.py
	$(BIN)/python benchmarks/saves.py

# the cost of checked reads alone (to-hf with and without --no-check, 70B shapes, 5 pairs; ~6 minutes)
bench-checked: setup
	$(BIN)/python benchmarks/run.py --checked-reads --repeat 5

# to-dcp (TorchTitan) of the 70B-shaped 4-layer model against cp -r, and from-dcp back (3 runs each; ~5 minutes)
bench-dcp: setup
	$(BIN)/python benchmarks/run.py --dcp --repeat 3
	$(BIN)/python benchmarks/reshard_optim.py bench-out/dcp-nxd-tag --shape 8b --layers 1 --vocab 16384 --to-dcp --nxd-tag

# files one rank opens (an NxD tag's resume, one --part of reshard --optimizer-format nxd): counts (~1 minute)
# (a 70B-shaped tag with tiny tensors at tp 8 x pp 4 x dp 2; the reshard of NxD's tag and of format 2)
bench-reads: setup
	$(BIN)/python -m benchmarks.reads bench-out/reads $(BENCH_ARGS)

# ruff, the import-circle check and mypy
lint: setup
	$(BIN)/ruff check ckptconv nxdtrain tests benchmarks examples tools
	$(BIN)/python tools/import_cycles.py
	$(BIN)/mypy ckptconv nxdtrain

# remove demo, benchmark and pytest outputs
clean:
	rm -rf demo-out bench-out .pytest_cache
