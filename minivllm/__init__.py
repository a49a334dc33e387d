"""minivllm: a small LLM inference and serving engine with vLLM's API."""

import importlib

from minivllm import envs as _envs
from minivllm.platforms.cpu_threads import apply_omp_wait_policy as _apply_omp_wait_policy

__version__ = "0.1.0"

# Before torch loads libgomp here or in any process started from here: OpenMP threads that
# sleep instead of spinning when they wait (minivllm/platforms/cpu_threads.py says why).
_apply_omp_wait_policy(_envs.MINIVLLM_CPU_OMP_WAIT_POLICY)

if _envs.MINIVLLM_CONFIGURE_LOGGING:
    from minivllm.logger import configure_logging

    configure_logging(_envs.MINIVLLM_LOGGING_LEVEL)

# Imported on first use, so `import minivllm.core` does not pay for torch and transformers.
_EXPORTS = {
    "LLM": "minivllm.entrypoints.llm",
    "LLMEngine": "minivllm.engine.llm_engine",
    "AsyncLLM": "minivllm.engine.async_llm",
    "EngineArgs": "minivllm.engine.arg_utils",
    "AsyncEngineArgs": "minivllm.engine.arg_utils",
    "SamplingParams": "minivllm.sampling_params",
    "RequestOutputKind": "minivllm.sampling_params",
    "StructuredOutputsParams": "minivllm.sampling_params",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "PoolingParams": "minivllm.pooling_params",
    "PoolingRequestOutput": "minivllm.outputs",
    "EmbeddingRequestOutput": "minivllm.outputs",
    "ScoringRequestOutput": "minivllm.outputs",
    "ClassificationRequestOutput": "minivllm.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
