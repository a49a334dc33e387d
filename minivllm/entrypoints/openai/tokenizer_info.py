"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's
configuration as its tokenizer_config.json holds it, so that a client with no local copy of
the tokenizer (lm-evaluation-harness's remote tokenizer, serving a GGUF) can read its special
tokens and chat template and tokenize through /tokenize."""

from __future__ import annotations

from typing import Any

# Local file names say nothing to a client, and a GGUF's converted tokenizer has them only in
# the server's cache.
_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")
# The fields clients read (lm-eval needs eos_token to accept the endpoint), taken from the
# tokenizer itself when its init arguments lack them (a GGUF's conversion sets them later).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _json_value(value: Any) -> Any:
    """A tokenizer_config.json value as JSON: an AddedToken as its text, as vLLM answers."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(tokenizer, chat_template: str | None) -> dict[str, Any]:
    """vLLM's answer: the tokenizer's init arguments without file paths, its class name, and
    the chat template the server uses (--chat-template, else the tokenizer's)."""
    config = {
        k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        if k not in _FILE_FIELDS
    }  # fmt: skip
    info = _json_value(config)
    for name in _SPECIAL_TOKENS:
        if info.get(name) is None and getattr(tokenizer, name, None) is not None:
            info[name] = _json_value(getattr(tokenizer, name))
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info
