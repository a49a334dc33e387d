"""Ollama's request bodies: the fields the translator reads, typed, so that a body of the
wrong shape is Ollama's 400 {"error": message} before any of it is read (unknown fields,
and Ollama's runtime options such as num_ctx or keep_alive, are accepted and ignored)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Ollama's own bound on a body's lists is the request size; this keeps one body's work
# within the chat API's (which the translation hands it to).
MAX_MESSAGES = 4096


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ToolCallFunction(OllamaModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(OllamaModel):
    function: ToolCallFunction


class Message(OllamaModel):
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class Options(OllamaModel):
    """The sampling options read (translate.OPTIONS); the others are the runtime's."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_predict: int | None = None


# "json", or a JSON schema; "" is no format, as Ollama reads it.
Format = Literal["json", ""] | dict[str, Any] | None


class Generation(OllamaModel):
    model: str = Field(min_length=1)
    format: Format = None
    options: Options | None = None
    stream: bool = True
    think: bool | Literal["low", "medium", "high"] | None = None
    tools: list[dict[str, Any]] | None = None


class ChatRequest(Generation):
    messages: list[Message] = Field(default_factory=list, max_length=MAX_MESSAGES)


class GenerateRequest(Generation):
    prompt: str = ""
    suffix: str = ""  # fill in the middle, between prompt and suffix (code completion)
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedRequest(OllamaModel):
    model: str = Field(min_length=1)
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)


class LegacyEmbeddingRequest(OllamaModel):
    """/api/embeddings (superseded by /api/embed, still what `ollama.embeddings()` sends)."""

    model: str = Field(min_length=1)
    prompt: str = ""


class ShowRequest(OllamaModel):
    model: str = Field(min_length=1)
