"""vLLM's `vllm.engine.arg_utils` path: the engine arguments, defined in minivllm.config."""

from minivllm.config import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
