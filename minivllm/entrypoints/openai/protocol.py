"""The OpenAI API's request and response bodies, with vLLM's extra fields (pydantic).

Unknown request fields are ignored with a warning in the log, as vLLM does (clients send
their own extras); fields that OpenAI or vLLM define but this server cannot honour (the
deprecated `functions`, beam search, ...) are accepted only at their no-op values, so
nothing a known field asks for is silently dropped. Responses carry the fields OpenAI's
and vLLM's clients read.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from minivllm.engine import request_limits
from minivllm.slo_params import SLOParams, parse_bool, slo_params_from_fields

# Bounds on what one request may cost the server (each refused with a 400 naming it). OpenAI
# takes at most 128 tools; the others bound the chat template's work and the sequences one
# request puts in the engine (prompts x n). 128 sequences, as --max-n and OpenAI's n, are
# half the default batch (max_num_seqs 256): with 512, one request filled the batch and
# queued its other sequences ahead of every later request (a 4-token request's first token
# waited 12-15 s instead of 0.04), where now the later ones join the running batch at once.
MAX_TOOLS = 128
MAX_MESSAGES = 2048
MAX_SEQUENCES_PER_REQUEST = 128

_ENTRY_LIMITS = {
    "stop": request_limits.MAX_STOP_STRINGS,
    "bad_words": request_limits.MAX_BAD_WORDS,
    "logit_bias": request_limits.MAX_LOGIT_BIAS_ENTRIES,
    "stop_token_ids": request_limits.MAX_STOP_TOKEN_IDS,
    "tools": MAX_TOOLS,
    "messages": MAX_MESSAGES,
}


def _at_most(value: Any, name: str, most: int) -> Any:
    """value, unless it is a list or an object of more than `most` entries (a ValueError)."""
    if isinstance(value, list | dict) and len(value) > most:
        raise ValueError(f"{name} has {len(value)} entries; at most {most} are allowed.")
    return value


# ---------------------------------------------------------------------------- base models


logger = logging.getLogger(__name__)


class OpenAIRequest(BaseModel):
    # Unknown fields are ignored with a warning, as vLLM does; booleans are strict (JSON
    # booleans: "stream": "yes" is a 400, not true).
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            known.update(f.alias for f in cls.model_fields.values() if f.alias)
            unknown = sorted(str(k) for k in data if k not in known)
            if unknown:
                logger.warning(
                    "The following fields were present in the request but ignored: %s",
                    ", ".join(unknown),
                )
        return data


def _first_non_utf8(value: Any, where: str = "") -> str | None:
    """The place of the first string (or key) in a JSON value that cannot be encoded as
    UTF-8 (a lone surrogate such as "\\ud800" is valid JSON), or None."""
    stack = [(value, where)]
    while stack:
        item, place = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return place
        elif isinstance(item, dict):
            for key, sub in item.items():
                stack.append((key, place))
                stack.append((sub, f"{place}.{key}" if place else str(key)))
        elif isinstance(item, list):
            stack.extend((sub, f"{place}[{i}]") for i, sub in enumerate(item))
    return None


def _all_utf8(value: Any) -> bool:
    """Whether every string in a JSON value encodes as UTF-8, in C: json.dumps keeps a lone
    surrogate as it is (ensure_ascii=False) and encoding it fails. False also where the value
    cannot be dumped (nested past the recursion limit): then _first_non_utf8 decides. The
    walk alone took 30 ms of the event loop for 100,000 stop strings."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        return False
    return True


def check_utf8_body(data: Any) -> Any:
    """Refuse a request body with a string (or key) that is not valid UTF-8, naming its place;
    a model_validator(mode="before") of each API's top-level request. (A string echoed into
    the answer, as the Responses API's metadata, otherwise failed the answer's encoding.)"""
    if _all_utf8(data):
        return data
    place = _first_non_utf8(data)
    if place is not None:
        raise ValueError(
            f"`{place or 'body'}` is not valid UTF-8: it contains a lone surrogate "
            "(such as \\ud800)."
        )
    return data


class OpenAITopLevelRequest(OpenAIRequest):
    """A whole request body: every string in it must be valid UTF-8, checked once here."""

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data):
        return check_utf8_body(data)


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="allow")


def _not_supported(name: str, hint: str = "") -> ValueError:
    return ValueError(f"`{name}` is not supported by this server.{' ' + hint if hint else ''}")


# ---------------------------------------------------------------------------- shared pieces


class StreamOptions(OpenAIRequest):
    include_usage: StrictBool | None = False
    # vLLM's extra: a usage object on every chunk, not only on the last one.
    continuous_usage_stats: StrictBool | None = False


class UsageInfo(OpenAIResponse):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class ModelPermission(OpenAIResponse):
    id: str = "modelperm-minivllm"
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIResponse):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIResponse):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class SamplingFields(OpenAITopLevelRequest):
    """The sampling fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # accepted; an end-user id for abuse tracking, not used here
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    priority: int = 0
    request_id: str | None = None
    # vLLM's: a secret that keys this request's prefix-cache blocks (a shared server's
    # tenants cannot hit, nor time, each other's); refused empty by the engine.
    cache_salt: str | None = None
    return_tokens_as_token_ids: StrictBool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = Field(None, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's structured outputs (json, regex, choice, grammar, json_object) and the older
    # guided_* fields that mean the same.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop", "bad_words", "logit_bias", "stop_token_ids", mode="before")
    @classmethod
    def _counted_before_their_entries(cls, value: Any, info) -> Any:
        """Too many entries are refused before each is validated (request_limits' bounds;
        the Processor checks them again for LLM): validating 100,000 stop strings took 60 ms
        of the event loop for a request refused anyway."""
        return _at_most(value, info.field_name, _ENTRY_LIMITS[info.field_name])

    # minivllm's SLO fields (seed 003's names): see minivllm/slo_params.py.
    is_latency_sensitive: bool | None = None  # None: latency-sensitive when a target is set
    slo: float | None = None  # TPOT target, seconds per output token
    slo_ttft: float | None = None  # TTFT target, seconds
    # vLLM's fields this server cannot honour: accepted only at their no-op values.
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0  # beam search's; without it (always here) it changes nothing

    @field_validator("is_latency_sensitive", mode="before")
    @classmethod
    def _bool_or_its_string(cls, value):
        return None if value is None else parse_bool(value, "is_latency_sensitive")

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value):
        if value:
            raise _not_supported("use_beam_search")
        return value

    @model_validator(mode="after")
    def _check_stream_fields(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` can only be set when `stream` is true.")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("`prompt_logprobs` are not available when `stream` is true.")
        return self

    @model_validator(mode="after")
    def _check_slo(self):
        self.slo_params()  # a 400 here, not when the engine's input is made
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def structured_outputs_fields(self) -> dict[str, Any] | None:
        """The request's constraint as StructuredOutputsParams keyword arguments, or None."""
        fields = dict(self.structured_outputs or {})
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                fields[name] = value
        return fields or None

    def slo_params(self) -> SLOParams | None:
        return slo_params_from_fields(self.is_latency_sensitive, self.slo, self.slo_ttft)

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments every request type sets the same way."""
        kwargs: dict[str, Any] = dict(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=self.logit_bias or None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            slo_params=self.slo_params(),
        )
        optional = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs


# ---------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: StrictBool = False
    logprobs: int | None = Field(None, ge=0)
    # 0 only with echo: the prompt scored, nothing generated (vLLM's, GPT-3's scoring).
    max_tokens: int | None = Field(16, ge=0)
    suffix: str | None = None  # fill in the middle, on a model trained for it
    add_special_tokens: StrictBool = True

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt and its logprobs alone."""
        return self.echo and self.max_tokens == 0

    @model_validator(mode="after")
    def _no_empty_completion_without_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1, got 0 (0 only with echo).")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("`prompt` cannot be an empty list.")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("`best_of` different from `n` is not supported by this server.")
        return self

    @model_validator(mode="after")
    def _bounded_sequences(self):
        prompt = self.prompt
        many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        num_prompts = len(prompt) if many else 1
        # One prompt's n is the server's --max-n to bound.
        if num_prompts > 1 and num_prompts * self.n > MAX_SEQUENCES_PER_REQUEST:
            raise ValueError(
                f"{num_prompts} prompts with n={self.n} make {num_prompts * self.n} sequences; "
                f"one request may make at most {MAX_SEQUENCES_PER_REQUEST}."
            )
        return self


class CompletionLogProbs(OpenAIResponse):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt token (None for the first), token id -> its Logprob.
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionResponseChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIResponse):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat


class ContentPart(OpenAIRequest):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(
                f"Content parts of type {self.type!r} are not supported: this server serves "
                "text-only models."
            )
        if self.text is None:
            raise ValueError("A text content part needs a `text` string.")
        return self


class FunctionCall(OpenAIResponse):
    name: str
    arguments: str  # JSON text


def make_tool_call_id() -> str:
    """vLLM's tool call ids."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCall(OpenAIResponse):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallParam(OpenAIRequest):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageParam(OpenAIRequest):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    reasoning_content: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string; tool call
        arguments as objects (HF templates render them with `tojson`), as vLLM does."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_call_for_template(call) for call in self.tool_calls]
        return message


def _call_for_template(call: ToolCallParam) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments  # as given: the template shows it as text
    item: dict[str, Any] = {
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.id is not None:
        item["id"] = call.id
    return item


class FunctionDefinition(OpenAIRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatCompletionToolsParam(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class JsonSchemaFormat(OpenAIRequest):
    name: str | None = None
    description: str | None = None
    # OpenAI's clients send the schema as "schema"; pydantic keeps it as json_schema.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.json_schema is None
        ):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema.")
        return self

    def structured_outputs_fields(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.json_schema}
        return None


class ChatTemplateFields(BaseModel):
    """What a request that renders `messages` with the chat template takes (chat completions,
    tokenize and embeddings: vLLM's fields): how the prompt ends, special tokens, the
    template's keyword arguments. A template of the request's own is refused."""

    messages: list[ChatMessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, value):
        if value is not None:
            raise _not_supported(
                "chat_template", "Set the server's template with `--chat-template`."
            )
        return value

    @model_validator(mode="after")
    def _check_prompt_flags(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "`add_generation_prompt` and `continue_final_message` cannot both be true."
            )
        return self


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI; still sent by many
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[ChatCompletionToolsParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`: accepted
    prompt_cache_key: str | None = None  # a routing hint; prefix caching is automatic here
    # Passed to the chat template (gpt-oss's and others' read it), as vLLM does.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's chat extras (and the template's: ChatTemplateFields).
    echo: StrictBool = False
    # Set by the translators of APIs whose max_tokens is only a ceiling (Anthropic's,
    # Ollama's): a ceiling past the context is cut to the room the prompt leaves, not
    # refused (Claude Code asks for 32,000 tokens whatever the model's context).
    _max_tokens_is_a_ceiling: bool = PrivateAttr(False)

    def max_tokens_within(self, room: int) -> int | None:
        """The max_tokens to honour when the prompt leaves `room` tokens."""
        requested = self.requested_max_tokens
        if self._max_tokens_is_a_ceiling and requested is not None and room >= 1:
            return min(requested, room)
        return requested

    @field_validator("tools", "messages", mode="before")
    @classmethod
    def _counted_before_their_entries(cls, value: Any, info) -> Any:
        """As SamplingFields': 5,000 tools took 30 ms to validate before Field's bound."""
        return _at_most(value, info.field_name, _ENTRY_LIMITS[info.field_name])

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value):
        if value:
            raise _not_supported("functions", "Use `tools` (functions are deprecated).")
        return value

    @field_validator("function_call")
    @classmethod
    def _function_call_none(cls, value):
        if value not in (None, "none", "auto"):
            raise _not_supported("function_call", "Use `tool_choice`.")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_tool_choice(cls, data):
        """vLLM's (and OpenAI's) defaults: tools without tool_choice mean "auto";
        "required" with an empty tool list means "none"."""
        if not isinstance(data, dict):
            return data
        if "tool_choice" not in data and data.get("tools"):
            data = {**data, "tool_choice": "auto"}
        if data.get("tool_choice") == "required" and data.get("tools") == []:
            data = {k: v for k, v in data.items() if k != "tools"}
            data["tool_choice"] = "none"
        return data

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, choice, info):
        """vLLM's checks, with its messages: tools are needed, a named function must be
        one of them."""
        if choice is None or choice == "none" or "tools" not in info.data:
            return choice  # (tools that did not validate have their own error)
        tools = info.data["tools"]
        if tools is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, dict):
            usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
            function = choice.get("function")
            if not isinstance(function, dict):
                raise ValueError(
                    f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}"
                )
            if "name" not in function:
                raise ValueError(f"Expected field `name` in `function` in `tool_choice`! {usage}")
            name = function["name"]
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}"
                )
            if name not in [tool.function.name for tool in tools]:
                raise ValueError(
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`"
                )
        return choice

    @field_validator("store")
    @classmethod
    def _no_store(cls, value):
        if value:
            raise _not_supported("store", "Completions are not stored.")
        return value

    @field_validator("service_tier")
    @classmethod
    def _default_tier(cls, value):
        if value not in (None, "auto", "default"):
            raise _not_supported(f"service_tier={value!r}")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value is not None and any(m != "text" for m in value):
            raise _not_supported("modalities other than 'text'")
        return value

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs` to be true.")
        return self

    def structured_outputs_fields(self) -> dict[str, Any] | None:
        fields = super().structured_outputs_fields()
        from_format = self.response_format and self.response_format.structured_outputs_fields()
        if fields and from_format:
            raise ValueError(
                "Set either response_format or structured_outputs (guided_*), not both."
            )
        return fields or from_format

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.forced_tool_choice is not None and self.structured_outputs_fields():
            raise ValueError(
                '`tool_choice` "required" or a named function constrains the output itself: '
                "it cannot be combined with response_format or structured_outputs."
            )
        return self

    @property
    def tools_enabled(self) -> bool:
        """Whether the output may hold tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice not in (None, "none")

    @property
    def forced_tool_choice(self) -> str | None:
        """The function name for a named tool_choice, "required", or None."""
        if not self.tools_enabled:
            return None
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return "required" if self.tool_choice == "required" else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatCompletionLogProb(OpenAIResponse):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIResponse):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIResponse):
    role: str
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIResponse):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(OpenAIResponse):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIResponse):
    """A piece of a streamed tool call: the first carries id, type and the function's name
    (arguments ""), the next ones only argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(OpenAIResponse):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        # A delta carries only what changed: no "role": null on every token.
        return {k: v for k, v in handler(self).items() if v is not None and v != []}


class ExtractedToolCallInformation(BaseModel):
    """What a tool parser found in a whole output (vLLM's)."""

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(OpenAITopLevelRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(OpenAITopLevelRequest, ChatTemplateFields):
    model: str | None = None
    return_token_strs: StrictBool = False
    # As vLLM's: the tools the chat template shows, so the ids match a chat request's.
    tools: list[ChatCompletionToolsParam] | None = Field(None, max_length=MAX_TOOLS)


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAITopLevelRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIResponse):
    prompt: str


# ---------------------------------------------------------------------------- embeddings


class PoolingFields(OpenAITopLevelRequest):
    """What every pooling request (embeddings, score, rerank, classify) has, as vLLM's."""

    model: str | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k tokens; -1: max_model_len
    priority: int = 0
    request_id: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_is_positive(cls, value):
        if value is not None and value != -1 and value < 1:
            raise ValueError(
                f"`truncate_prompt_tokens` must be at least 1, or -1 (max_model_len); got {value}."
            )
        return value


class ClassifierFields(PoolingFields):
    """What the requests a classifier answers (classify; score and rerank as a cross-encoder)
    add: vLLM's use_activation."""

    # False: the classifier's raw logits; None or True: its activation (softmax; sigmoid for
    # one label; a cross-encoder's own). Embedding models' scores (cosines) ignore it.
    use_activation: StrictBool | None = None


class EmbeddingFields(PoolingFields):
    """What both forms of an embeddings request share: OpenAI's fields, then vLLM's."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # matryoshka models only
    user: str | None = None  # accepted; an end-user id for abuse tracking, not used here
    # vLLM's extras.
    normalize: StrictBool | None = None  # None: the model's pooler config says
    # The type of a base64 embedding's values (vLLM's; "float" embeddings are float32).
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class PromptInputFields(OpenAIRequest):
    """An `input` of text or token ids, one prompt or a list of them (embeddings, classify)."""

    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    add_special_tokens: StrictBool = True

    @field_validator("input", mode="wrap")
    @classmethod
    def _check_input(cls, value, handler):
        """One message for a wrong type (not one per branch of the union); no empty prompt."""
        try:
            value = handler(value)
        except ValidationError:
            raise ValueError(
                "`input` must be a string, a list of strings, a list of token ids (integers) "
                "or a list of lists of token ids."
            ) from None
        if isinstance(value, str) and not value:
            raise ValueError("`input` cannot be an empty string.")
        if not value:
            raise ValueError("`input` cannot be an empty list.")
        if not isinstance(value, str) and not isinstance(value[0], int):
            if any(len(item) == 0 for item in value):
                raise ValueError("`input` cannot hold an empty string or an empty token list.")
        return value


class EmbeddingCompletionRequest(EmbeddingFields, PromptInputFields):
    """OpenAI's embeddings request: text or token ids, one prompt or a list of them."""


class EmbeddingChatRequest(EmbeddingFields, ChatTemplateFields):
    """vLLM's chat form: one prompt, the chat template over `messages`."""

    add_generation_prompt: StrictBool = False  # vLLM's default for embeddings


EmbeddingRequest = EmbeddingCompletionRequest | EmbeddingChatRequest


class EmbeddingResponseData(OpenAIResponse):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # base64: the values' little-endian bytes


class EmbeddingResponse(OpenAIResponse):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


# ---------------------------------------------------------------------------- score, rerank


def _non_empty_texts(value: str | list[str], name: str) -> str | list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise ValueError(f"`{name}` cannot be an empty list.")
    if any(not text for text in texts):
        raise ValueError(f"`{name}` cannot hold an empty string.")
    return value


class ScoreRequest(ClassifierFields):
    """vLLM's /score: text_1 one text (scored against each of text_2) or as many as text_2
    (paired in order)."""

    text_1: str | list[str]
    text_2: str | list[str]

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts(cls, value, info):
        return _non_empty_texts(value, info.field_name)


class RerankRequest(ClassifierFields):
    """vLLM's /rerank (Jina's and Cohere's API): the documents by relevance to the query."""

    query: str
    documents: list[str]
    top_n: int = Field(0, ge=0)  # 0: all of them
    return_documents: StrictBool = True

    @field_validator("query", "documents")
    @classmethod
    def _texts(cls, value, info):
        return _non_empty_texts(value, info.field_name)


class ScoreResponseData(OpenAIResponse):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(OpenAIResponse):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(OpenAIResponse):
    text: str


class RerankResult(OpenAIResponse):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIResponse):
    total_tokens: int


class RerankResponse(OpenAIResponse):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# ---------------------------------------------------------------------------- classify


class ClassificationRequest(ClassifierFields, PromptInputFields):
    """vLLM's /classify: each prompt's class probabilities (a sequence classifier)."""


class ClassificationData(OpenAIResponse):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIResponse):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


# ---------------------------------------------------------------------------- LoRA


class LoadLoRAAdapterRequest(OpenAITopLevelRequest):
    """vLLM's /v1/load_lora_adapter (with VLLM_ALLOW_RUNTIME_LORA_UPDATING). The name becomes
    a `model` value: printable, no spaces; the path a folder on the server."""

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@+/-]+$")
    lora_path: str = Field(min_length=1, max_length=4096)

    @field_validator("lora_path")
    @classmethod
    def _a_path(cls, value: str) -> str:
        if "\x00" in value or not value.strip():
            raise ValueError("`lora_path` must name the adapter's folder.")
        return value


class UnloadLoRAAdapterRequest(OpenAITopLevelRequest):
    """vLLM's /v1/unload_lora_adapter: by name (lora_int_id is accepted, not needed)."""

    lora_name: str
    lora_int_id: int | None = None
