#!/usr/bin/env bash
# llama.cpp, the peer for GGUF on the CPU (issue #15; ../shared/BENCHMARKING.md): build it
# once from the llama-cpp-python sdist's vendored source into $LLAMACPP (outside the repo),
# then run its single-stream and batched benchmarks on the same file and thread count.
#
#   benchmarks/gguf_llamacpp.sh build            # once, ~10 min on 2 cores (nice -n 19)
#   benchmarks/gguf_llamacpp.sh bench [file.gguf] # llama-bench 128/128 and batched-bench
#
# minivllm's side, alternating with these runs (A B A B A B, medians):
#   minivllm bench latency --input-len 128 --output-len 128 --quantization gguf
#   minivllm bench latency --input-len 128 --output-len 128 --quantization none
#   minivllm bench throughput --quantization gguf     (the standard throughput workload)
#   minivllm bench throughput --quantization none
set -euo pipefail
LLAMACPP=${LLAMACPP:-/work/llamacpp}
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}  # absolute: build cds away
MODEL=${2:-$("$PY" -c 'from minivllm.model.loader import default_model_path; print(default_model_path())')}

case "${1:-}" in
  build)
    mkdir -p "$LLAMACPP" && cd "$LLAMACPP"
    "$PY" -m pip download --no-deps --no-binary :all: llama-cpp-python -d sdist
    tar xzf sdist/llama_cpp_python-*.tar.gz
    src=$(echo "$LLAMACPP"/llama_cpp_python-*/vendor/llama.cpp)
    nice -n 19 cmake -S "$src" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
    nice -n 19 cmake --build build -j 2 --target llama-bench llama-batched-bench llama-server
    ;;
  bench)
    "$LLAMACPP"/build/bin/llama-bench -m "$MODEL" -p 128 -n 128 -t 2
    "$LLAMACPP"/build/bin/llama-batched-bench -m "$MODEL" -c 40000 -npp 128 -ntg 128 \
      -npl 1,16,64,256 -t 2 -tb 2
    ;;
  *)
    echo "usage: $0 build | bench [model.gguf]" >&2
    exit 2
    ;;
esac
