"""Ollama's API (/api/chat, /api/generate, /api/embed, ...): translators over the OpenAI path."""
