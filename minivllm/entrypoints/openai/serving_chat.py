"""POST /v1/chat/completions: the model's chat template over the messages, streamed (SSE)
or not."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.errors import error_body
from minivllm.entrypoints.openai.logprobs import TokenNames, chat_logprobs, prompt_logprobs_json
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from minivllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    SequenceText,
    has_news,
    to_error,
    usage,
)
from minivllm.entrypoints.openai.sse import SSEResponse, chunk_event, sse_event


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, response_role: str = "assistant", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.response_role = response_role

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request=None
    ) -> JSONResponse | SSEResponse:
        model_name = self.models.resolve(request.model)
        self.check_engine()
        text = await self.apply_chat_template_async(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            check_length=request.truncate_prompt_tokens is None,
        )
        ids = await self.encode_async(
            text, request.add_special_tokens, request.truncate_prompt_tokens, param="messages"
        )
        self.check_token_ids(ids, param="messages")
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        max_tokens = self.max_tokens_for(request.requested_max_tokens, len(ids), param, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs)
        request_id = self.request_id("chatcmpl", request, raw_request)
        stream = self.generate(ids, text, params, request_id, request.priority)
        echo = self._echo_text(request)
        if request.stream:
            events = self._stream(request, request_id, model_name, stream, echo, len(ids))
            return SSEResponse(events)
        response = await self._collect(request, request_id, model_name, stream, echo, len(ids))
        return JSONResponse(response.model_dump())

    def _echo_text(self, request: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content, when it is the response's role."""
        last = request.messages[-1]
        if not request.echo or last.role != self.response_role:
            return ""
        return last.to_template_dict()["content"]

    def _logprobs(self, request, token_ids, steps):
        if not request.logprobs or steps is None:
            return None
        names = TokenNames(self.tokenizer, request.return_tokens_as_token_ids)
        return chat_logprobs(token_ids, steps, request.top_logprobs or 0, names)

    async def _collect(
        self, request, request_id, model_name, stream, echo, num_prompt_tokens
    ) -> ChatCompletionResponse:
        sequences: dict[int, SequenceText] = {}
        prompt_steps = None
        async with contextlib.aclosing(stream):
            async for output in stream:
                if prompt_steps is None:
                    prompt_steps = output.prompt_logprobs
                for completion in output.outputs:
                    if completion.index not in sequences:
                        sequences[completion.index] = SequenceText(echo)
                    sequences[completion.index].add(completion)
        choices = [
            ChatCompletionResponseChoice(
                index=index,
                message=ChatMessage(role=self.response_role, content=seq.text),
                logprobs=self._logprobs(request, seq.token_ids, seq.logprobs),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for index, seq in sorted(sequences.items())
        ]
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
        self, request, request_id, model_name, stream, echo, num_prompt_tokens
    ) -> AsyncIterator[str]:
        created = int(time.time())
        num_completion_tokens = 0

        def make_chunk(choices, num_completion_tokens=None) -> ChatCompletionStreamResponse:
            chunk = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model_name, choices=choices
            )
            if num_completion_tokens is not None:
                chunk.usage = usage(num_prompt_tokens, num_completion_tokens)
            return chunk

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
                        item = choice(
                            completion.index,
                            DeltaMessage(content=completion.text),
                            self._logprobs(request, completion.token_ids, completion.logprobs),
                            completion.finish_reason,
                            completion.stop_reason,
                        )
                        running = num_completion_tokens if request.continuous_usage else None
                        yield chunk_event(make_chunk([item], running))
            if request.include_usage:
                yield chunk_event(make_chunk([], num_completion_tokens))
        except Exception as exc:
            error = to_error(exc)
            yield sse_event(json.dumps(error_body(error.status, error.message, error.param)))
        yield sse_event("[DONE]")
