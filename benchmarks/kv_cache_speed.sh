#!/usr/bin/env bash
# One stream decoding at an 8k-token context with the 8-bit KV cache against float32 (issue
# #53, acceptance 3), alternating pairs (A B A B A B; report medians), on the bundled model,
# and llama.cpp with -ctk q8_0 -ctv q8_0 on the same file at the same depth. Not run in the
# session that wrote it: run it on a quiet machine.
#
#   benchmarks/kv_cache_speed.sh            # minivllm pairs, then llama.cpp (built by
#                                           # benchmarks/gguf_llamacpp.sh build)
#   DTYPES="auto int8 int8k_int8v" benchmarks/kv_cache_speed.sh   # more cache dtypes
#
# What to read: minivllm's median_tpot_ms at --input-len 8064 (+128 = the model's 8192) (int8 should be <= 1/1.2 of
# auto's), the short-context throughput within 5% (bench throughput), and llama-bench's
# tg128 @ d8192 with q8_0 K/V against 1000 / minivllm's int8 TPOT (>= 1.0x).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LLAMACPP=${LLAMACPP:-/work/llamacpp}
PAIRS=${PAIRS:-3}
# int8 is fp16k_int8v (float16 keys, int8 values); the first dtype is the baseline.
DTYPES=${DTYPES:-auto int8}
OUT=${OUT:-/tmp/kv-cache-speed}
MODEL=$("$PY" -c 'from minivllm.model.loader import default_model_path; print(default_model_path())')
mkdir -p "$OUT"
for i in $(seq "$PAIRS"); do
  for dtype in $DTYPES; do
    "$PY" -m minivllm.entrypoints.cli bench latency --input-len 8064 --output-len 128 \
      --max-model-len 8192 --kv-cache-dtype "$dtype" --num-iters 3 \
      --output-json "$OUT/long-$dtype-$i.json"
    "$PY" -m minivllm.entrypoints.cli bench throughput --kv-cache-dtype "$dtype" \
      --output-json "$OUT/short-$dtype-$i.json"
  done
done
"$PY" - "$OUT" $DTYPES <<'PYEOF'
import glob, json, statistics, sys
out = sys.argv[1]
for dtype in sys.argv[2:]:
    tpot = [json.load(open(p))["median_tpot_ms"] for p in glob.glob(f"{out}/long-{dtype}-*.json")]
    thr = [json.load(open(p)).get("tokens_per_second") for p in glob.glob(f"{out}/short-{dtype}-*.json")]
    print(dtype, "8k-context TPOT ms (median):", statistics.median(tpot),
          "short-context tokens/s (median):", statistics.median(t for t in thr if t))
PYEOF
if [ -x "$LLAMACPP/build/bin/llama-bench" ]; then
  # -d: the context depth the 128 generated tokens start at.
  "$LLAMACPP"/build/bin/llama-bench -m "$MODEL" -p 0 -n 128 -d 8064 -t 2 -ctk q8_0 -ctv q8_0
  "$LLAMACPP"/build/bin/llama-bench -m "$MODEL" -p 0 -n 128 -d 8064 -t 2
fi
