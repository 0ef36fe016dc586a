# Two commands: `make demo` (set up, train the example with telemetry, analyze it) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch goes in first: pip would otherwise resolve `torch>=2.4` to a multi-GB CUDA build. A torch that is
# already importable (system site-packages) is kept.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	@$(BIN)/python -c "import torch; print('torch', torch.__version__)"
	touch $(STAMP)

demo: setup
	$(BIN)/python example_train.py --scenario healthy --out runs/healthy
	$(BIN)/python example_train.py --scenario overfit --out runs/overfit
	@if [ -f analyze_telemetry.py ]; then \
		$(BIN)/python analyze_telemetry.py runs/healthy; \
		$(BIN)/python analyze_telemetry.py runs/overfit; \
	fi

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/collection_cost.py

clean:
	rm -rf $(VENV) runs
