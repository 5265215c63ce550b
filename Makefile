# Two commands on a fresh machine: `make demo` and `make test`. Both build the environment first.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.trillora-installed
DEMO := runs/demo

.PHONY: setup demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, so pip takes the CPU build on disk rather than a multi-GB CUDA download
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/trillora info kimi-k2
	$(BIN)/python -m trillora.tiny $(DEMO)/tiny-random
	$(BIN)/trillora info $(DEMO)/tiny-random
	$(BIN)/trillora generate $(DEMO)/tiny-random --prompt "12+34=" --max-new-tokens 8

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
