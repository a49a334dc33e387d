#!/usr/bin/env bash
# One stage of the GPU acceptance run (benchmarks/GPU.md), on the device machine, from the
# repository root, with .whl carried:
#
#   bash benchmarks/gpu_session.sh parity-qwen3   # Triton kernels + Qwen3-shape parity
#   bash benchmarks/gpu_session.sh parity-llama   # Llama-3.2-1B-shape parity, GGUF blocks
#   bash benchmarks/gpu_session.sh bench [gpu_bench.py flags]   # the figures
#
# Each stage is whole by itself (a later call may get a fresh machine): it installs the
# carried wheels, writes the checkpoints it needs, and keeps its logs and results in $OUT.
set -uo pipefail
stage=${1:?stage: parity-qwen3, parity-llama or bench}
shift
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export MINIVLLM_GPU_CHECKPOINTS=/tmp/minivllm-gpu-checkpoints

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__,
transformers.__version__, torch.cuda.get_device_name())"

pytest_gpu() {  # name, then pytest arguments
    local name=$1
    shift
    python3 -m pytest -m gpu -p no:cacheprovider -rfE --durations=15 \
        --junitxml="$out/$name.xml" "$@" 2>&1 | tee "$out/$name.log"
}

case $stage in
parity-qwen3)
    # Does choosing dtype "auto" (torch.cuda.is_bf16_supported) open a CUDA context in the
    # frontend (~0.5 GiB the engine then counts as non-torch memory)? vLLM asks NVML.
    python3 - <<'EOF' 2>&1 | tee "$out/frontend-context.log"
import os, subprocess
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
    pytest_gpu kernels tests/kernels/test_triton_attention.py tests/attention/test_triton_backend.py
    pytest_gpu parity-qwen3 tests/worker/test_gpu_parity.py -k qwen3
    ;;
parity-llama)
    pytest_gpu parity-llama tests/worker/test_gpu_parity.py -k llama
    # The GGUF dequantizers on CUDA against the CPU (the bundled model does not travel).
    pytest_gpu gguf tests/model/loader/test_gguf_dequant.py -k "not bundled"
    # Weights read onto the GPU, and the profiling pass that sizes the KV cache.
    pytest_gpu device tests/model/test_loader.py tests/worker/test_profile_run.py
    ;;
bench)
    python3 benchmarks/gpu_bench.py decode standard nano --out "$out" "$@" 2>&1 |
        tee "$out/bench.log"
    ;;
*)
    echo "unknown stage: $stage" >&2
    exit 2
    ;;
esac
