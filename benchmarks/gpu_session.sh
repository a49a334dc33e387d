#!/usr/bin/env bash
# One stage of the GPU acceptance run (benchmarks/GPU.md), on the device machine, from the
# repository root, with .whl carried:
#
#   bash benchmarks/gpu_session.sh kernels         # Triton kernels against float64 on CUDA
#   bash benchmarks/gpu_session.sh bench [flags]   # the figures (gpu_bench.py's flags)
#   bash benchmarks/gpu_session.sh parity qwen3    # the parity matrix (pytest -k), or llama
#   bash benchmarks/gpu_session.sh loader          # GGUF dequantizers, weights onto the GPU
#   bash benchmarks/gpu_session.sh profile         # where one stream's decode step goes
#   bash benchmarks/gpu_session.sh cli             # `minivllm bench` as users run it
#   bash benchmarks/gpu_session.sh compare DIR [flags]  # the figures of the engine in DIR
#                                                  # (a package copy, e.g. .gpubase), then ours
#   bash benchmarks/gpu_session.sh ab VAR [flags]  # the figures with VAR=0, then VAR=1 (an
#                                                  # opt-in kernel: MINIVLLM_TRITON_SMALL_M_LINEAR)
#   bash benchmarks/gpu_session.sh host DIR [flags]  # the host's time a decode step by phase
#                                                  # (host_step.py), the engine in DIR, then ours
#
# Each stage is whole by itself (a later call may get a fresh machine): it installs the
# carried wheels, writes the checkpoints it needs, and keeps one log in $OUT (which
# returns at most 8 files). It first kills any Python an earlier stage cut off by
# `timeout` left behind: an orphaned engine core holds 90% of the card.
set -uo pipefail
stage=${1:?stage: kernels, bench, compare, ab, host, parity, loader, profile or cli}
shift
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
pkill -9 -f 'python3 (-m pytest|benchmarks/gpu_bench|-c from multiprocessing)' && sleep 2

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export MINIVLLM_GPU_CHECKPOINTS=/tmp/minivllm-gpu-checkpoints

pytest_gpu() {  # log name, then pytest arguments
    local name=$1
    shift
    python3 -m pytest -m gpu -p no:cacheprovider -rfE --durations=12 "$@" 2>&1 |
        tee -a "$out/$name.log"
}

case $stage in
kernels)
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm \
        --format=csv 2>&1 | tee "$out/kernels.log"
    # Does choosing dtype "auto" (torch.cuda.is_bf16_supported) open a CUDA context in the
    # frontend (~0.5 GiB the engine then counts as non-torch memory)? vLLM asks NVML.
    python3 - <<'EOF' 2>&1 | tee -a "$out/kernels.log"
import os, subprocess
import torch, triton, transformers
print(torch.__version__, triton.__version__, transformers.__version__)  # no CUDA call yet
from minivllm.platforms.cuda import CudaPlatform
print("auto dtype:", CudaPlatform().auto_dtype("bfloat16"), "frontend pid:", os.getpid())
print(subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                     capture_output=True, text=True).stdout)
try:
    import pynvml  # noqa: F401
    print("pynvml: importable")
except ImportError as exc:
    print("pynvml:", exc)
EOF
    pytest_gpu kernels tests/kernels/test_triton_attention.py tests/kernels/test_triton_layers.py \
        tests/kernels/test_triton_linear.py tests/attention/test_triton_backend.py
    ;;
parity)
    # The engine core in this process: twenty engines start, and a spawned process's
    # imports and CUDA context would cost each a few seconds. The bench runs the
    # engine in its own process, as users do.
    # The log's name in letters, digits and dashes: $OUT returns no other (`parity "llama and
    # async"` runs a -k expression).
    log=$(printf %s "parity-${1:-all}" | tr -c 'A-Za-z0-9._-' -)
    MINIVLLM_ENABLE_MULTIPROCESSING=0 pytest_gpu "$log" \
        tests/worker/test_gpu_parity.py ${1:+-k "$1"}
    ;;
loader)
    # The GGUF dequantizers on CUDA against the CPU (the bundled model does not travel),
    # weights read onto the GPU, and the profiling pass that sizes the KV cache.
    pytest_gpu loader tests/model/loader/test_gguf_dequant.py -k "not bundled"
    pytest_gpu loader tests/model/test_loader.py tests/worker/test_profile_run.py
    ;;
profile)
    python3 benchmarks/gpu_profile.py "$@" 2>&1 | tee "$out/profile.log"
    ;;
cli)
    # The CLI unchanged on the GPU: device "auto" takes CUDA, the banner names the card.
    model=$(python3 benchmarks/gpu_checkpoints.py qwen3-0.6b --dtype bfloat16 | cut -d' ' -f1)
    python3 -m minivllm.entrypoints.cli bench latency --model "$model" --input-len 128 \
        --output-len 64 --num-iters 3 --max-model-len 4096 2>&1 | tee "$out/cli.log"
    ;;
bench)
    python3 benchmarks/gpu_bench.py decode standard nano --out "$out" "$@" 2>&1 |
        tee "$out/bench.log"
    ;;
ab)
    # One engine switch off, then on, on the same card in one call.
    var=${1:?ab VAR: an environment variable that switches something on (1) or off (0)}
    shift
    for value in 0 1; do
        mkdir -p "$out/ab-$value"
        env "$var=$value" python3 benchmarks/gpu_bench.py decode standard nano \
            --out "$out/ab-$value" "$@" 2>&1 | tee "$out/ab-$value.log"
    done
    ;;
compare)
    # The same figures for an earlier engine (a copy of its minivllm/ in DIR, carried) and
    # for this tree, one after the other on the same card: today's ratio to that commit.
    base=${1:?compare DIR: a folder holding an earlier minivllm/}
    shift
    for side in base new; do
        mkdir -p "$out/$side"
        path=$PWD
        [ "$side" = base ] && path=$PWD/$base
        PYTHONPATH=/tmp/site:$path python3 benchmarks/gpu_bench.py decode standard nano \
            --out "$out/$side" "$@" 2>&1 | tee "$out/compare-$side.log"
    done
    ;;
host)
    # Where a step's host time goes at 64 and 256 rows (benchmarks/host_step.py: a tiny
    # model, so the card's share is small), for an earlier engine (DIR, carried) and this
    # tree, one after the other on this machine's CPU.
    base=${1:?host DIR: a folder holding an earlier minivllm/}
    shift
    for side in base new; do
        path=$PWD
        [ "$side" = base ] && path=$PWD/$base
        PYTHONPATH=/tmp/site:$path python3 benchmarks/host_step.py --json "$out/host-$side.json" \
            "$@" 2>&1 | tee "$out/host-$side.log"
    done
    ;;
*)
    echo "unknown stage: $stage" >&2
    exit 2
    ;;
esac
