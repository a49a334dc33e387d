"""Anthropic's Messages API (/v1/messages): a translator over the chat completions path."""
