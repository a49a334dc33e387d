"""The OpenAI-compatible HTTP server (`minivllm serve`) over one AsyncLLM."""
