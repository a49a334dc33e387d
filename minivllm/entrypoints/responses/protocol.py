"""The Responses API's request body: the fields the translator reads, typed, so that a body of
the wrong shape is a 400 naming the field before any of it is read. Unknown fields (include,
prompt_cache_key, service_tier, user, ...) are accepted and ignored, as clients such as Codex
send more than a local server reads."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minivllm.entrypoints.openai.protocol import check_utf8_body


class ResponsesModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ContentPart(ResponsesModel):
    type: str
    text: str = ""


class InputItem(ResponsesModel):
    """A message, function_call, function_call_output or reasoning item (the translator
    refuses the other types by name)."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class Tool(ResponsesModel):
    """A function tool, a namespace of them (`tools`), or a hosted tool (left out)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[Tool] | None = None


class ToolChoiceFunction(ResponsesModel):
    type: str
    name: str | None = None


class TextFormat(ResponsesModel):
    type: str = "text"
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextParam(ResponsesModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningParam(ResponsesModel):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(ResponsesModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceFunction | None = None
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data):
        return check_utf8_body(data)  # metadata, tools, ... are echoed in the answer

    def body(self) -> dict[str, Any]:
        """The fields the client set, as JSON (what the translator and the answer read)."""
        return self.model_dump(exclude_unset=True, by_alias=True)
