"""vLLM's `vllm.v1.engine.async_llm` path: AsyncLLM, defined in minivllm.engine.async_llm."""

from minivllm.engine.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
