# Two commands: `make demo` (set up, train the example with telemetry, analyze it) and `make test`.
# `make bench` runs the side-by-side benchmark in venvs of its own under bench/ (see bench/README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The interpreter's own pip installs into the venv (--python, pip >= 22.3): bootstrapping a pip inside the
# venv would take as long as the demo's training. Without such a pip, the venv gets one of its own.
ifeq ($(shell $(PYTHON) -c "import pip, sys; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) < (22, 3))" \
	2>/dev/null && echo yes),yes)
VENV_FLAGS := --without-pip
PIP := $(PYTHON) -m pip --python $(BIN)/python install -q --no-compile
else
PIP := $(BIN)/python -m pip install -q --no-compile
endif
DEMO_READY := $(VENV)/.demo-installed
DEV_READY := $(VENV)/.dev-installed
DEMO_PACKAGES := "pyyaml>=6" "numpy>=1.24" "matplotlib>=3.7"
BENCH_ARGS ?=

# Packages go in without precompiling (compiling all of torch takes longer than the whole demo); a module is
# compiled the first time it is imported instead, so bytecode writing stays on for these commands.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-unsloth bench clean

setup: $(DEMO_READY)

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV_FLAGS) $(VENV)

# The demo needs torch, numpy, matplotlib and pyyaml, the package's dependencies, and nothing else. torch is
# pinned, in the same command: pip would otherwise resolve it to a multi-GB CUDA build. A torch that is
# already importable (system site-packages) is kept.
$(DEMO_READY): pyproject.toml | $(BIN)/python
	if $(BIN)/python -c "import torch" 2>/dev/null; then $(PIP) $(DEMO_PACKAGES); \
	else $(PIP) torch==2.13.0 $(DEMO_PACKAGES); fi
	@$(BIN)/python -c "import torch; print('torch', torch.__version__)"
	touch $@

# The tests also need the integrations (transformers, peft, Lightning, wandb, TensorBoard): the dev extras.
$(DEV_READY): pyproject.toml $(DEMO_READY)
	$(PIP) -e '.[dev]'
	touch $@

# The example's models are tiny: one thread trains them faster than a pool whose threads wait on busy cores.
demo: $(DEMO_READY)
	OMP_NUM_THREADS=1 $(BIN)/python example_train.py --scenario healthy --out runs/healthy
	OMP_NUM_THREADS=1 $(BIN)/python example_train.py --scenario overfit --out runs/overfit
	$(BIN)/python analyze_telemetry.py runs/healthy
	$(BIN)/python analyze_telemetry.py runs/overfit

# Two workers (pytest-xdist): the suite is hundreds of small real loops, most of them on one core at a time.
test: $(DEV_READY)
	$(BIN)/python -m pytest -q -n 2

# unsloth pins the transformers it patches, older than the dev extras' one, so it gets a venv of its own. On a
# machine without a GPU its CPU fallback trains through FastLanguageModel and TRL's SFTTrainer all the same;
# bench/gpu/unsloth_device.sh runs the same check on a GPU.
UNSLOTH_VENV := .venv-unsloth
UNSLOTH_PACKAGES := torch==2.13.0 unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 \
	"pytest>=8" "pyyaml>=6" "numpy>=1.24"
ifeq ($(VENV_FLAGS),--without-pip)
UNSLOTH_PIP := $(PYTHON) -m pip --python $(UNSLOTH_VENV)/bin/python
else
UNSLOTH_PIP := $(UNSLOTH_VENV)/bin/python -m pip
endif

$(UNSLOTH_VENV)/.installed:
	$(PYTHON) -m venv $(VENV_FLAGS) $(UNSLOTH_VENV)
	$(UNSLOTH_PIP) install -q --no-compile $(UNSLOTH_PACKAGES)
	@# unsloth asks for torchvision, and the registry's is built for CUDA torch: its operators fail to register
	@# against the CPU build, and transformers then fails to import its models. Nothing here needs it.
	$(UNSLOTH_VENV)/bin/python -c "import torchvision" 2>/dev/null || $(UNSLOTH_PIP) uninstall -q -y torchvision
	touch $@

test-unsloth: $(UNSLOTH_VENV)/.installed
	HF_HUB_OFFLINE=1 $(UNSLOTH_VENV)/bin/python -m pytest -q tests/test_lora.py -k unsloth

# Full run about an hour on 2 cores; `make bench BENCH_ARGS=--quick` is the smoke run.
bench:
	bench/setup.sh
	BENCH_COCKPIT_PYTHON=$(CURDIR)/bench/.venv-cockpit/bin/python BENCH_ANALYZER_PYTHON=$(CURDIR)/bench/.venv/bin/python \
		bench/.venv/bin/python bench/compare.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(UNSLOTH_VENV) runs
