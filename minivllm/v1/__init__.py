"""vLLM's `vllm.v1` module paths, re-exporting minivllm's engine (which is V1 throughout)."""
