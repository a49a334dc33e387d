"""OpenAI's Responses API (/v1/responses): a translator over the chat completions path."""
