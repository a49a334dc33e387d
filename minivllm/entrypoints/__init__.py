"""What users call: the LLM class, the `minivllm` CLI, the OpenAI and demo HTTP servers."""
