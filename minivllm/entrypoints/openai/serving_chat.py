"""POST /v1/chat/completions: the model's chat template over the messages (and tools),
streamed (SSE) or not; tool calls and reasoning parsed out of the output, as vLLM does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.chat_output import ChoiceOutput, split_tool_calls
from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from minivllm.entrypoints.openai.output_streams import SequenceText, has_news, usage
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from minivllm.entrypoints.openai.serving_engine import OpenAIServing
from minivllm.entrypoints.openai.sse import (
    SSEResponse,
    chunk_event,
    chunk_maker,
    error_event,
    sse_event,
)
from minivllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from minivllm.entrypoints.openai.tool_parsers.forced_tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    named_tool_schema,
    required_tools_schema,
)
from minivllm.reasoning import ReasoningParserManager


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        *args,
        response_role: str = "assistant",
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser_cls = (
            ToolParserManager.get_tool_parser(tool_parser) if tool_parser else None
        )
        self.reasoning_parser_cls = (
            ReasoningParserManager.get_reasoning_parser(reasoning_parser)
            if reasoning_parser
            else None
        )

    @property
    def parses_tool_calls(self) -> bool:
        """Whether tool calls are parsed from replies under tool_choice "auto"
        (--enable-auto-tool-choice with a --tool-call-parser). The other APIs' translators
        send "none" elsewhere: the template shows the tools and the reply stays text."""
        return self.enable_auto_tools and self.tool_parser_cls is not None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request=None
    ) -> JSONResponse | SSEResponse:
        model_name = self.models.resolve(request.model)
        self.check_engine()
        if request.tools_enabled and request.tool_choice == "auto" and not self.parses_tool_calls:
            raise BadRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        chat = await self.render_chat(request, request.truncate_prompt_tokens is None)
        text = chat.text
        make_parsers = self._output_parsers(request, text)
        ids = await self.encode_chat_async(
            chat, request.add_special_tokens, request.truncate_prompt_tokens
        )
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        requested = request.max_tokens_within(self.max_model_len - len(ids))
        max_tokens = self.max_tokens_for(requested, len(ids), param, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(
            request, max_tokens, logprobs, structured_outputs=self._constraint(request, text)
        )
        request_id = self.request_id("chatcmpl", request, raw_request)
        processed = await self.process(
            self.engine_request_id(request_id),
            ids,
            text,
            params,
            request.priority,
            self.models.lora_request(model_name),
            param="messages",
            cache_salt=request.cache_salt,
        )
        stream = self.generate(processed)
        echo = self._echo_text(request)
        if request.stream:
            events = self._stream(
                request, request_id, model_name, stream, echo, len(ids), make_parsers
            )
            return SSEResponse(events)
        response = await self._collect(
            request, request_id, model_name, stream, echo, len(ids), make_parsers
        )
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------ tools and reasoning

    def _tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        forced = request.forced_tool_choice
        if forced == "required":
            return RequiredToolParser(self.tokenizer)
        if forced is not None:
            return NamedToolParser(self.tokenizer, name=forced)
        if request.tools_enabled and request.tool_choice == "auto":
            return self.tool_parser_cls(self.tokenizer)
        return None

    def _output_parsers(self, request: ChatCompletionRequest, prompt: str):
        """A function making each choice's ChoiceOutput, or None when the text is all
        content. Lets the tool parser adjust the request first (special tokens)."""
        if self.reasoning_parser_cls is None and self._tool_parser(request) is None:
            return None
        auto = self._tool_parser(request)
        if auto is not None:
            auto.adjust_request(request)
        parallel = request.parallel_tool_calls is not False

        def make() -> ChoiceOutput:
            reasoning = self.reasoning_parser_cls and self.reasoning_parser_cls(self.tokenizer)
            return ChoiceOutput(reasoning, self._tool_parser(request), prompt, parallel)

        return make

    def _constraint(self, request: ChatCompletionRequest, prompt: str) -> dict | None:
        """The structured output: a forced tool call's schema, else the request's; with a
        reasoning parser, it starts after the reasoning."""
        forced = request.forced_tool_choice
        if forced == "required":
            try:
                schema = required_tools_schema(
                    request.tools, request.parallel_tool_calls is not False
                )
            except ValueError as exc:
                raise BadRequestError(str(exc), param="tools") from exc
            fields = {"json": schema}
        elif forced is not None:
            fields = {"json": named_tool_schema(request.tools, forced)}
        else:
            try:
                fields = request.structured_outputs_fields()
            except ValueError as exc:  # response_format and structured_outputs both set
                raise BadRequestError(str(exc)) from exc
        if fields and self.reasoning_parser_cls is not None:
            marker = self.reasoning_parser_cls(self.tokenizer).reasoning_end_marker(prompt)
            if marker is not None:
                fields = {**fields, "reasoning_end": marker}
        return fields

    def _echo_text(self, request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, when it is the response's role."""
        last = request.messages[-1]
        if not request.echo or last.role != self.response_role:
            return ""
        return last.to_template_dict()["content"]

    def _logprobs(self, request, token_ids, steps):
        if not request.logprobs or steps is None:
            return None
        names = self.token_names(request)
        return chat_logprobs(token_ids, steps, request.top_logprobs or 0, names)

    async def _collect(
        self, request, request_id, model_name, stream, echo, num_prompt_tokens, make_parsers
    ) -> ChatCompletionResponse:
        sequences: dict[int, SequenceText] = {}
        prompt_steps = None
        async with contextlib.aclosing(stream):
            async for output in stream:
                if prompt_steps is None:
                    prompt_steps = output.prompt_logprobs
                for completion in output.outputs:
                    if completion.index not in sequences:
                        sequences[completion.index] = SequenceText()
                    sequences[completion.index].add(completion)
        choices = []
        for index, seq in sorted(sequences.items()):
            message = ChatMessage(role=self.response_role, content=seq.text)
            finish_reason = seq.finish_reason
            if make_parsers is not None:
                reasoning, content, calls = make_parsers().parse(seq.text)
                message = ChatMessage(
                    role=self.response_role,
                    reasoning_content=reasoning,
                    content=content,
                    tool_calls=calls,
                )
                if calls and finish_reason == "stop" and _calls_finish(request):
                    finish_reason = "tool_calls"
            if echo:
                message.content = echo + (message.content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=index,
                    message=message,
                    logprobs=self._logprobs(request, seq.token_ids, seq.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        num_completion_tokens = sum(len(s.token_ids) for s in sequences.values())
        response = ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=usage(num_prompt_tokens, num_completion_tokens),
        )
        if request.prompt_logprobs is not None:
            response.prompt_logprobs = prompt_logprobs_json(prompt_steps)
        return response

    async def _stream(
        self, request, request_id, model_name, stream, echo, num_prompt_tokens, make_parsers
    ) -> AsyncIterator[str]:
        num_completion_tokens = 0
        parsers: dict[int, ChoiceOutput] = {}

        make_chunk = chunk_maker(
            ChatCompletionStreamResponse, request_id, model_name, num_prompt_tokens
        )

        def choice(index, delta, logprobs=None, finish_reason=None, stop_reason=None):
            return ChatCompletionResponseStreamChoice(
                index=index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )

        running = 0 if request.continuous_usage else None
        try:
            # As OpenAI and vLLM do: first the role, for every choice, before any token.
            for index in range(request.n):
                delta = DeltaMessage(role=self.response_role, content="")
                yield chunk_event(make_chunk([choice(index, delta)], running))
                if echo:
                    yield chunk_event(make_chunk([choice(index, DeltaMessage(content=echo))]))
            async with contextlib.aclosing(stream):
                async for output in stream:
                    for completion in output.outputs:
                        if not has_news(completion):
                            continue
                        num_completion_tokens += len(completion.token_ids)
                        running = num_completion_tokens if request.continuous_usage else None
                        logprobs = self._logprobs(
                            request, completion.token_ids, completion.logprobs
                        )
                        finish_reason = completion.finish_reason
                        if make_parsers is None:
                            deltas = [DeltaMessage(content=completion.text)]
                        else:
                            parser = parsers.get(completion.index)
                            if parser is None:
                                parser = parsers[completion.index] = make_parsers()
                            finished = finish_reason is not None
                            delta = parser.feed(
                                completion.text, completion.token_ids, finished=finished
                            )
                            if delta is None and not finished and logprobs is None:
                                continue  # nothing to say yet (held back)
                            deltas = split_tool_calls(delta or DeltaMessage())
                            called = parser.tools_called and _calls_finish(request)
                            if called and finish_reason == "stop":
                                finish_reason = "tool_calls"
                        last = len(deltas) - 1
                        for k, delta in enumerate(deltas):
                            item = choice(
                                completion.index,
                                delta,
                                logprobs if k == 0 else None,
                                finish_reason if k == last else None,
                                completion.stop_reason if k == last else None,
                            )
                            yield chunk_event(make_chunk([item], running if k == last else None))
            if self.includes_usage(request):
                yield chunk_event(make_chunk([], num_completion_tokens))
        except Exception as exc:
            yield error_event(exc)
        yield sse_event("[DONE]")


def _calls_finish(request: ChatCompletionRequest) -> bool:
    """Whether an answer that calls tools finishes with "tool_calls": the model chose to call
    them (auto) or had to call some (required). A named tool_choice keeps "stop", as in vLLM
    and OpenAI: the caller named the function, so the call is the answer, not a request."""
    forced = request.forced_tool_choice
    return forced is None or forced == "required"
