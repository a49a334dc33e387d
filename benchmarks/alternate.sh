#!/usr/bin/env bash
# Side-by-side runs for BENCHMARKS.md: each run a fresh process, the two sides alternating
# (A B A B ...) so that a slow spell of the machine falls on both. One JSON per run under
# $OUT (default /tmp/minivllm-alt-HHMM); the medians are read from there.
#
#   benchmarks/alternate.sh trees PAIRS MODEL TREE...
#       `bench throughput` (standard workload: 256 x 128 random tokens in, 128 out) then
#       `bench latency` (batch 1, 128/128) for each source TREE in turn, one virtualenv
#       running them all with PYTHONPATH=TREE: a commit against the one before a change.
#   benchmarks/alternate.sh gguf-latency PAIRS FILE.gguf
#       llama.cpp's `llama-bench -p 128 -n 128 -t 2` against `bench latency --quantization
#       gguf` on the same file (llama.cpp built by benchmarks/gguf_llamacpp.sh build).
#   benchmarks/alternate.sh gguf-prefill PAIRS FILE.gguf [INPUT_LEN [FLAG...]]
#       prompt processing: llama.cpp's `llama-bench -p INPUT_LEN -n 0` (default 128) against
#       minivllm's median time to first token with prefix caching off (tokens/s: INPUT_LEN /
#       TTFT, the first token's sampling included); FLAGs go to minivllm's side (e.g.
#       --kv-sharing-fast-prefill).
#   benchmarks/alternate.sh gguf-throughput PAIRS [FILE.gguf]
#       the standard throughput workload with --quantization gguf against none (float32).
#
# Keep the machine quiet while it runs: nothing else on its cores.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
LLAMACPP=${LLAMACPP:-/work/llamacpp}
OUT=${OUT:-/tmp/minivllm-alt-$(date +%H%M)}
mkdir -p "$OUT"
KV4G=$((4 << 30))

# bench TAG TREE ARGS...: one `minivllm bench` run from TREE, its JSON and log under $OUT.
bench() {
  local tag=$1 tree=$2; shift 2
  (cd /tmp && PYTHONPATH=$tree "$PY" -m minivllm.entrypoints.cli bench "$@" \
    --output-json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1)
  "$PY" - "$OUT/$tag.json" "$tag" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: round(v, 2) for k, v in d.items() if isinstance(v, (int, float))})
EOF
}

throughput_args=(--input-len 128 --output-len 128 --num-prompts 256
  --kv-cache-memory-bytes "$KV4G" --no-enable-prefix-caching)

mode=${1:-}
case "$mode" in
  trees)
    pairs=$2 model=$3; shift 3
    for i in $(seq 1 "$pairs"); do
      for tree in "$@"; do
        bench "tp-$(basename "$tree")-$i" "$tree" throughput --model "$model" --dtype float32 \
          "${throughput_args[@]}"
      done
      for tree in "$@"; do
        bench "lat-$(basename "$tree")-$i" "$tree" latency --model "$model" --dtype float32 \
          --input-len 128 --output-len 128 --batch-size 1 --kv-cache-memory-bytes "$KV4G" \
          --num-iters-warmup 2 --num-iters 5
      done
    done
    ;;
  gguf-latency)
    pairs=$2 model=$3
    for i in $(seq 1 "$pairs"); do
      # tokens/s (and their standard deviation) of pp128, then of tg128.
      echo "llamacpp-$i $("$LLAMACPP"/build/bin/llama-bench -m "$model" -p 128 -n 128 -t 2 -r 3 \
        -o csv 2>/dev/null | tr -d '"' | awk -F, 'NR>1 {printf "%s (sd %s) ", $(NF-1), $NF}')"
      bench "gguf-lat-$i" "$ROOT" latency --model "$model" --quantization gguf \
        --input-len 128 --output-len 128 --batch-size 1 --kv-cache-memory-bytes $((1 << 30)) \
        --max-model-len 4096 --num-iters-warmup 1 --num-iters 3
    done
    ;;
  gguf-prefill)
    pairs=$2 model=$3 len=${4:-128}
    flags=("${@:5}")
    for i in $(seq 1 "$pairs"); do
      echo "llamacpp-$i $("$LLAMACPP"/build/bin/llama-bench -m "$model" -p "$len" -n 0 -t 2 -r 3 \
        -o csv 2>/dev/null | tr -d '"' | awk -F, 'NR>1 {printf "pp%s %s (sd %s)", $(NF-7), $(NF-1), $NF}')"
      bench "gguf-pre-$i" "$ROOT" latency --model "$model" --quantization gguf \
        --input-len "$len" --output-len 2 --batch-size 1 --kv-cache-memory-bytes $((1 << 30)) \
        --max-model-len 4096 --no-enable-prefix-caching --num-iters-warmup 1 --num-iters 5 \
        ${flags[@]+"${flags[@]}"}
    done
    ;;
  gguf-throughput)
    pairs=$2
    model=${3:-$("$PY" -c 'from minivllm.model.loader import default_model_path
print(default_model_path())')}
    for i in $(seq 1 "$pairs"); do
      for q in gguf none; do
        bench "gguf-tp-$q-$i" "$ROOT" throughput --model "$model" --quantization "$q" \
          "${throughput_args[@]}"
      done
    done
    ;;
  *)
    sed -n '2,20p' "$0" >&2
    exit 2
    ;;
esac
echo "OUT=$OUT"
