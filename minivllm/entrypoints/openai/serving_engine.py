"""What the completion, chat, embedding and tokenization handlers share: model names, prompt
checks, sampling parameters, and one engine stream per prompt with its statistics recorded."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from minivllm.engine.exceptions import EngineDeadError
from minivllm.entrypoints.openai.errors import (
    BadRequestError,
    EngineUnavailableError,
    InternalServerError,
)
from minivllm.entrypoints.openai.protocol import (
    ChatMessageParam,
    PoolingFields,
    SamplingFields,
)
from minivllm.entrypoints.openai.server_lifecycle import ServerLifecycle
from minivllm.entrypoints.openai.serving_models import ServedModels
from minivllm.lora.request import LoRARequest
from minivllm.metrics.loggers import StatLoggerManager
from minivllm.metrics.stats import FinishedRequestStats, IterationStats, RequestStateStats
from minivllm.outputs import PoolingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    check_utf8,
)
from minivllm.slo_params import SLOParams
from minivllm.structured_output.grammar import check_grammar

T = TypeVar("T")

# Tokenization and chat templating run here, off the event loop, so that a big prompt never
# stalls other requests or /health. One thread: a fast tokenizer must not be used by two
# threads at once (transformers sets its truncation state on every call).
_TOKENIZER_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-tokenize")


async def in_tokenizer_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_TOKENIZER_POOL, functools.partial(fn, *args, **kwargs))


@functools.lru_cache(maxsize=8)
def max_chars_per_token(tokenizer) -> int | None:
    """The most characters one token can stand for, when the tokenizer makes that a bound.

    With a byte-level tokenizer and no normalizer, every character of a text is at least one
    byte of some token's string, so a text of C characters has at least C / this many
    tokens: a prompt far longer than the context is refused before it is tokenized. None
    (no bound) for tokenizers whose normalizer may shrink a text (e.g. collapse spaces).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=None)


# Keys of chat_template_kwargs that the server sets itself.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
    }
)


class OpenAIServing:
    def __init__(
        self,
        engine,
        tokenizer,
        models: ServedModels,
        stat_loggers: StatLoggerManager | None = None,
        *,
        scheduling_policy: str = "fcfs",
        vocab_size: int | None = None,
        max_logprobs: int = 20,
        chat_template: str | None = None,
        max_n: int | None = None,
        lifecycle: ServerLifecycle | None = None,
        default_sampling_params: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.models = models
        self.stat_loggers = stat_loggers
        self.max_model_len = models.max_model_len
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
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

    # ------------------------------------------------------------------ prompts

    def encode(self, text: str, add_special_tokens: bool, truncate: int | None = None) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.truncate(ids, truncate)

    def check_text(self, text: str, param: str, check_length: bool = True) -> None:
        """Refuse, before tokenizing, a text that is not UTF-8 or cannot fit the context."""
        try:
            check_utf8(text, f"`{param}`")
        except ValueError as exc:
            raise BadRequestError(str(exc), param=param) from None
        if check_length:
            self.check_num_chars(len(text), param)

    def check_num_chars(self, num_chars: int, param: str) -> None:
        chars_per_token = max_chars_per_token(self.tokenizer)
        if chars_per_token and num_chars > chars_per_token * self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_chars} characters, more than {self.max_model_len} tokens "
                "can hold. Please reduce the length of the prompt.",
                param=param,
            )

    async def encode_async(
        self,
        text: str,
        add_special_tokens: bool,
        truncate: int | None = None,
        param: str = "prompt",
        check_length: bool = True,
    ) -> list[int]:
        """encode() off the event loop, after check_text() (no length check when truncating)."""
        self.check_text(text, param, check_length and truncate is None)
        return await in_tokenizer_thread(self.encode, text, add_special_tokens, truncate)

    async def apply_chat_template_async(
        self, messages: list[ChatMessageParam], *args, check_length: bool = True
    ) -> str:
        """apply_chat_template() off the event loop, after check_text() on every message."""
        contents = [m.to_template_dict()["content"] for m in messages]
        for content in contents:
            self.check_text(content, "messages", check_length=False)
        if check_length:
            self.check_num_chars(sum(len(c) for c in contents), "messages")
        return await in_tokenizer_thread(self.apply_chat_template, messages, *args)

    @staticmethod
    def truncate(ids: list[int], truncate: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last `truncate` tokens."""
        return ids[-truncate:] if truncate is not None and len(ids) > truncate else ids

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise BadRequestError("The prompt is empty.", param=param)
        if self.vocab_size is not None:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise BadRequestError(
                    f"Token id {bad} is out of vocabulary (vocabulary size {self.vocab_size}).",
                    param=param,
                )

    def apply_chat_template(
        self,
        messages: list[ChatMessageParam],
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> str:
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise BadRequestError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}.",
                param="chat_template_kwargs",
            )
        if continue_final_message and messages[-1].role != "assistant":
            raise BadRequestError(
                "continue_final_message needs the last message to be the assistant's.",
                param="messages",
            )
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise BadRequestError(
                "This model has no chat template: start the server with --chat-template, "
                "or use /v1/completions.",
                param="messages",
            )
        try:
            return self.tokenizer.apply_chat_template(
                [m.to_template_dict() for m in messages],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        except Exception as exc:  # jinja2 errors raised by the template itself, mostly
            raise BadRequestError(
                f"Could not apply the chat template: {exc}", param="messages"
            ) from exc

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
        """The request's SamplingParams; prompt_logprobs: at least this many (echo);
        structured_outputs: a constraint the server adds (tool calls), else the request's."""
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
        if self.vocab_size is not None:  # here, so that a stream fails before it starts
            for name, ids in (
                ("logit_bias", (kwargs["logit_bias"] or {}).keys()),
                ("allowed_token_ids", kwargs["allowed_token_ids"] or ()),
            ):
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise BadRequestError(
                        f"{name} has token id {bad}, out of the vocabulary "
                        f"(size {self.vocab_size}).",
                        param=name,
                    )
        self.check_priority(request.priority)
        try:
            # The engine always streams deltas to the server; the handlers accumulate them
            # for non-streaming responses, so that every request's timing is measured.
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

    def slo_targets(self, params: SamplingParams) -> SLOParams | None:
        """The request's SLO targets, the engine's defaults filled in (for the SLO metrics)."""
        if params.slo_params is None:
            return None
        config = getattr(self.engine, "vllm_config", None)
        if config is None:
            return params.slo_params
        sched = config.scheduler_config
        return params.slo_params.with_defaults(sched.default_slo_tpot, sched.default_slo_ttft)

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.scheduling_policy != "priority":
            raise BadRequestError(
                f"Got priority {priority}, but priority scheduling is not enabled "
                "(start the server with --scheduling-policy priority).",
                param="priority",
            )

    def structured_outputs_params(
        self, fields: dict[str, Any] | None
    ) -> StructuredOutputsParams | None:
        """Checked here, so that a schema that cannot compile is a 400 before any stream."""
        if not fields:
            return None
        if self.reasoning_end is not None:
            fields = {**fields, "reasoning_end": self.reasoning_end}
        params = StructuredOutputsParams(**fields)
        check_grammar(params)
        return params

    @staticmethod
    def request_id(prefix: str, request: SamplingFields | PoolingFields, raw_request) -> str:
        """vLLM's: the body's request_id, else the X-Request-Id header, else a random one."""
        base = request.request_id
        if base is None and raw_request is not None:
            base = raw_request.headers.get("x-request-id")
        return f"{prefix}-{base or uuid.uuid4().hex}"

    # ------------------------------------------------------------------ the engine

    @contextlib.asynccontextmanager
    async def _engine_stream(
        self, start, prompt_ids: list[int], prompt_text: str | None, request_id: str, *args
    ):
        """The engine's stream for one prompt: ``start(prompt, *args, engine_request_id)``
        (AsyncLLM.generate or encode), tracked while open (the shutdown drain cancels what
        is left), closed on exit (closing it early aborts the request in the engine), its
        engine errors turned into OpenAIServingErrors."""
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if prompt_text is not None:
            prompt["prompt"] = prompt_text
        # A unique id for the engine: the response id may come from the client.
        engine_request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        stream = start(prompt, *args, engine_request_id)
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
        self,
        prompt_ids: list[int],
        prompt_text: str | None,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's delta outputs for one prompt, with their statistics recorded.

        Closing this generator early (a client went away) aborts the request in the engine.
        Engine errors come out as OpenAIServingErrors.
        """
        stats = RequestStateStats(
            len(prompt_ids), params.n, params.max_tokens, slo=self.slo_targets(params)
        )
        start = functools.partial(
            self.engine.generate, priority=priority, lora_request=lora_request
        )
        async with self._engine_stream(
            start, prompt_ids, prompt_text, request_id, params
        ) as stream:
            try:
                async for output in stream:
                    if self.lifecycle.cancelling and output.finished:
                        raise self._cancelled()
                    if self.stat_loggers is not None:
                        iteration = IterationStats()
                        stats.update(output, iteration)
                        self.stat_loggers.record(iteration=iteration)
                    if any(c.finish_reason == "error" for c in output.outputs):
                        raise self._failed(request_id)
                    yield output
            except (GeneratorExit, asyncio.CancelledError):
                # Closed early (the client went away): /metrics counts it as aborted.
                if self.stat_loggers is not None:
                    iteration = IterationStats()
                    stats.abort_unfinished(iteration)
                    self.stat_loggers.record(iteration=iteration)
                raise

    async def pool(
        self,
        prompt_ids: list[int],
        prompt_text: str | None,
        params: PoolingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's one output for one prompt (its embedding), with its statistics
        recorded: generate()'s counterpart, for the pooling runner.

        Closing this generator early (a client went away) aborts the request in the engine.
        Engine errors, and an output that is not an embedding, come out as
        OpenAIServingErrors.
        """
        arrival = time.monotonic()
        start = functools.partial(self.engine.encode, priority=priority, lora_request=lora_request)
        ended = False
        async with self._engine_stream(
            start, prompt_ids, prompt_text, request_id, params
        ) as stream:
            try:
                async for output in stream:
                    ended = True
                    self._record_pooled(len(prompt_ids), output.finish_reason, arrival)
                    if self.lifecycle.cancelling:
                        raise self._cancelled()
                    if output.finish_reason == "error":
                        raise self._failed(request_id)
                    if output.finish_reason != "stop":
                        raise InternalServerError(
                            f"Internal server error: request {request_id} ended with "
                            f"{output.finish_reason!r} in the engine."
                        )
                    yield output
            except (GeneratorExit, asyncio.CancelledError):
                # Closed early (the client went away): /metrics counts it as aborted.
                if not ended:
                    self._record_pooled(len(prompt_ids), "abort", arrival)
                raise

    def _record_pooled(self, num_prompt_tokens: int, finish_reason: str, arrival: float) -> None:
        """A pooling request's end in the statistics: its prompt tokens, once pooled."""
        if self.stat_loggers is None:
            return
        iteration = IterationStats()
        if finish_reason == "stop":
            iteration.num_prompt_tokens = num_prompt_tokens
        iteration.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=time.monotonic() - arrival,
                num_prompt_tokens=num_prompt_tokens,
                num_generation_tokens=0,
            )
        )
        self.stat_loggers.record(iteration=iteration)
