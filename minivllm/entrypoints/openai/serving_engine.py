"""What the completion, chat, embedding and tokenization handlers share: the engine's checks
of a request run off the event loop (the engine's Processor, as for LLM), sampling
parameters, and one engine stream per prompt."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from minivllm.engine.exceptions import EngineDeadError, VLLMValidationError
from minivllm.engine.messages import EngineCoreRequest
from minivllm.entrypoints.openai.errors import (
    BadRequestError,
    EngineUnavailableError,
    InternalServerError,
)
from minivllm.entrypoints.openai.logprobs import TokenNames
from minivllm.entrypoints.openai.prompt_tokenization import (
    PromptTokenization,
    in_tokenizer_thread,
)
from minivllm.entrypoints.openai.protocol import PoolingFields, SamplingFields
from minivllm.entrypoints.openai.server_lifecycle import ServerLifecycle
from minivllm.entrypoints.openai.serving_models import ServedModels
from minivllm.lora.request import LoRARequest
from minivllm.outputs import PoolingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class OpenAIServing(PromptTokenization):
    def __init__(
        self,
        engine,
        tokenizer,
        models: ServedModels,
        *,
        max_logprobs: int = 20,
        chat_template: str | None = None,
        max_n: int | None = None,
        lifecycle: ServerLifecycle | None = None,
        default_sampling_params: dict[str, Any] | None = None,
        content_as_text: bool = False,
        default_chat_template_kwargs: dict[str, Any] | None = None,
        force_include_usage: bool = False,
        return_tokens_as_token_ids: bool = False,
    ) -> None:
        """content_as_text: tokenize chat messages' content without special tokens
        (--tokenize-content-as-text); default_chat_template_kwargs: under each request's;
        force_include_usage, return_tokens_as_token_ids: vLLM's flags, for every request."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.models = models
        self.max_model_len = models.max_model_len
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
        self.content_as_text = content_as_text
        self.default_chat_template_kwargs = default_chat_template_kwargs
        self.force_include_usage = force_include_usage
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.max_n = max_n
        self.lifecycle = lifecycle or ServerLifecycle()
        # The model's generation_config.json recommendations (ModelConfig.
        # get_diff_sampling_param): they fill what a request leaves unset, as in vLLM.
        self.default_sampling_params = dict(default_sampling_params or {})
        # The text that ends a reasoning model's thinking (the chat server's reasoning
        # parser sets it): structured outputs constrain only what follows it.
        self.reasoning_end: str | None = None

    def check_engine(self) -> None:
        """A dead engine (or a server shutting down) fails a request with a 503 before any
        stream starts."""
        if self.engine.errored:
            raise EngineUnavailableError(f"The engine is dead: {self.engine.dead_error}")
        if self.lifecycle.draining:
            raise EngineUnavailableError("The server is shutting down.")

    # ------------------------------------------------------------------ the engine's checks

    def includes_usage(self, request) -> bool:
        """Whether a stream ends with a usage chunk (stream_options, or the server's flag)."""
        return request.include_usage or self.force_include_usage

    def token_names(self, request) -> TokenNames:
        """How the answer's logprobs name tokens: their text, or "token_id:N"."""
        as_ids = request.return_tokens_as_token_ids or self.return_tokens_as_token_ids
        return TokenNames(self.tokenizer, as_ids)

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        """The engine's check of a prompt's ids (not empty, within the context and the
        vocabulary), before the server decodes them (an echo) or counts them."""
        with _as_bad_request(param):
            self.engine.processor.validate_prompt_ids(ids)

    async def process(
        self,
        request_id: str,
        prompt_ids: list[int],
        prompt_text: str | None,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        param: str = "prompt",
        cache_salt: str | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """The engine's Processor over one prompt (every check LLM makes, in its words), off
        the event loop: its grammar compile check and bad words' tokenization can be long.
        param: what the request calls the prompt (an error about it names that)."""
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if prompt_text is not None:
            prompt["prompt"] = prompt_text
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        with _as_bad_request(param):
            return await in_tokenizer_thread(
                self.engine.processor.process_inputs,
                request_id,
                prompt,
                params,
                priority=priority,
                lora_request=lora_request,
            )

    # ------------------------------------------------------------------ sampling parameters

    def max_tokens_for(
        self, requested: int | None, num_prompt_tokens: int, param: str, prompt_param: str
    ) -> int:
        """max_tokens for one prompt: the request's, or all the room the context leaves (at
        most the model's generation_config.json max_new_tokens)."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt_tokens} tokens, which leaves no room for the "
                "completion. Please reduce the length of the prompt.",
                param=prompt_param,
            )
        if requested is None:
            return min(room, self.default_sampling_params.get("max_tokens", room))
        if requested > room:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in "
                f"the prompt, {requested} in the completion). Please reduce the length of the "
                "prompt or of the completion.",
                param=param,
            )
        return requested

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams, within the server's own limits (--max-n,
        --max-logprobs); prompt_logprobs: at least this many (echo); structured_outputs: a
        constraint the server adds (tool calls), else the request's. The model's checks
        (vocabulary, grammar, priority) are the engine's, in process()."""
        kwargs = request.sampling_kwargs()
        for name, value in self.default_sampling_params.items():
            if name != "max_tokens":
                kwargs.setdefault(name, value)
        if self.max_n is not None and kwargs["n"] > self.max_n:
            raise BadRequestError(
                f"n must be at most {self.max_n} (the server's --max-n), got {kwargs['n']}.",
                param="n",
            )
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = max(prompt_logprobs, kwargs["prompt_logprobs"] or 0)
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", kwargs["prompt_logprobs"])):
            if value is not None and value > self.max_logprobs:
                raise BadRequestError(
                    f"Requested {value} {name} per token; the maximum is {self.max_logprobs}.",
                    param=name,
                )
        try:
            # The engine always streams deltas to the server; the handlers accumulate them
            # for non-streaming responses.
            constraint = self.structured_outputs_params(
                structured_outputs or request.structured_outputs_fields()
            )
            return SamplingParams(
                **kwargs,
                max_tokens=max_tokens,
                logprobs=logprobs,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=constraint,
            )
        except (ValueError, TypeError) as exc:
            # SamplingParams' messages start with the parameter's name.
            name = str(exc).split(" ", 1)[0]
            raise BadRequestError(
                str(exc), param=name if name in type(request).model_fields else None
            ) from exc

    def structured_outputs_params(
        self, fields: dict[str, Any] | None
    ) -> StructuredOutputsParams | None:
        """The request's constraint (after a reasoning model's thinking, when it has one)."""
        if not fields:
            return None
        if self.reasoning_end is not None:
            fields = {**fields, "reasoning_end": self.reasoning_end}
        return StructuredOutputsParams(**fields)

    @staticmethod
    def request_id(prefix: str, request: SamplingFields | PoolingFields, raw_request) -> str:
        """vLLM's: the body's request_id, else the X-Request-Id header, else a random one."""
        base = request.request_id
        if base is None and raw_request is not None:
            base = raw_request.headers.get("x-request-id")
        return f"{prefix}-{base or uuid.uuid4().hex}"

    @staticmethod
    def engine_request_id(request_id: str) -> str:
        """A unique id for the engine: the response id may come from the client."""
        return f"{request_id}-{uuid.uuid4().hex[:8]}"

    # ------------------------------------------------------------------ the engine

    @contextlib.asynccontextmanager
    async def _engine_stream(self, stream, engine_request_id: str):
        """The engine's stream for one processed request, tracked while open (the shutdown
        drain cancels what is left), closed on exit (closing it early aborts the request in
        the engine), its engine errors turned into OpenAIServingErrors."""
        self.lifecycle.active.add(engine_request_id)
        async with contextlib.aclosing(stream):
            try:
                yield stream
            except EngineDeadError as exc:
                raise EngineUnavailableError(f"The engine is dead: {exc}") from exc
            except ValueError as exc:  # the engine's own input checks
                raise BadRequestError(str(exc)) from exc
            finally:
                self.lifecycle.active.discard(engine_request_id)

    @staticmethod
    def _cancelled() -> EngineUnavailableError:
        return EngineUnavailableError("The server is shutting down: the request was cancelled.")

    @staticmethod
    def _failed(request_id: str) -> InternalServerError:
        """It failed alone in the engine (logged there); the other requests go on."""
        return InternalServerError(
            f"Internal server error: request {request_id} failed in the engine; see the server log."
        )

    async def generate(
        self, processed: tuple[str | None, EngineCoreRequest]
    ) -> AsyncIterator[RequestOutput]:
        """The engine's delta outputs for one processed prompt (process()'s answer).

        Closing this generator early (a client went away) aborts the request in the engine
        (which counts it as aborted). Engine errors come out as OpenAIServingErrors.
        """
        prompt_text, request = processed
        stream = self.engine.generate(
            request, request.sampling_params, request.request_id, prompt_text=prompt_text
        )
        async with self._engine_stream(stream, request.request_id):
            async for output in stream:
                if self.lifecycle.cancelling and output.finished:
                    raise self._cancelled()
                if any(c.finish_reason == "error" for c in output.outputs):
                    raise self._failed(request.request_id)
                yield output

    async def pool(
        self, processed: tuple[str | None, EngineCoreRequest]
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's one output for one processed prompt (its embedding):
        generate()'s counterpart, for the pooling runner. An output that is not an
        embedding comes out as an OpenAIServingError."""
        prompt_text, request = processed
        stream = self.engine.encode(
            request, request.pooling_params, request.request_id, prompt_text=prompt_text
        )
        async with self._engine_stream(stream, request.request_id):
            async for output in stream:
                if self.lifecycle.cancelling:
                    raise self._cancelled()
                if output.finish_reason == "error":
                    raise self._failed(request.request_id)
                if output.finish_reason != "stop":
                    raise InternalServerError(
                        f"Internal server error: request {request.request_id} ended with "
                        f"{output.finish_reason!r} in the engine."
                    )
                yield output


@contextlib.contextmanager
def _as_bad_request(prompt_param: str):
    """The engine's ValueErrors as 400s; one about the prompt names the request's own field
    for it (prompt, messages, input, ...)."""
    try:
        yield
    except VLLMValidationError as exc:
        param = prompt_param if exc.parameter == "prompt" else exc.parameter
        raise BadRequestError(str(exc), param=param) from exc
    except (ValueError, TypeError) as exc:
        raise BadRequestError(str(exc)) from exc
