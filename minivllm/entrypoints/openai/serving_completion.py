"""POST /v1/completions: one or several prompts, streamed (SSE) or not."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from minivllm.entrypoints.openai.errors import BadRequestError
from minivllm.entrypoints.openai.fill_in_middle import FillInMiddle
from minivllm.entrypoints.openai.logprobs import (
    completion_logprobs,
    prompt_logprobs_json,
)
from minivllm.entrypoints.openai.output_streams import (
    SequenceText,
    has_news,
    merge_async_iterators,
    usage,
)
from minivllm.entrypoints.openai.prompt_tokenization import in_tokenizer_thread
from minivllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from minivllm.entrypoints.openai.serving_engine import OpenAIServing
from minivllm.entrypoints.openai.sse import (
    SSEResponse,
    chunk_event,
    chunk_maker,
    error_event,
    sse_event,
)


@dataclass
class Prompt:
    text: str | None  # None for a prompt given as token ids
    token_ids: list[int]
    echo: str = ""  # what an echoing response starts with


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw_request=None
    ) -> JSONResponse | SSEResponse:
        model_name = self.models.resolve(request.model)
        self.check_engine()
        prompts = await self._prompts(request)
        # Echoed logprobs start with the prompt's: ask the engine for them.
        echo_logprobs = request.logprobs if request.echo else None
        request_id = self.request_id("cmpl", request, raw_request)
        lora = self.models.lora_request(model_name)
        processed = []  # every prompt checked before any reaches the engine
        # echo with max_tokens 0 scores the prompt: the engine computes its logprobs with
        # one sampled token (vLLM's way), which the answer leaves out.
        requested = 1 if request.echo_only else request.max_tokens
        for i, prompt in enumerate(prompts):
            max_tokens = self.max_tokens_for(
                requested, len(prompt.token_ids), "max_tokens", "prompt"
            )
            params = self.sampling_params(request, max_tokens, request.logprobs, echo_logprobs)
            if request.suffix and not params.ignore_eos:  # where the model ends a middle
                params.stop_token_ids = [*params.stop_token_ids, *self.fill_in_middle.end_ids]
            engine_request_id = self.engine_request_id(f"{request_id}-{i}")
            processed.append(
                await self.process(
                    engine_request_id,
                    prompt.token_ids,
                    prompt.text,
                    params,
                    request.priority,
                    lora,
                    cache_salt=request.cache_salt,
                )
            )
        streams = [self.generate(p) for p in processed]
        if request.stream:
            return SSEResponse(self._stream(request, request_id, model_name, prompts, streams))
        response = await self._collect(request, request_id, model_name, prompts, streams)
        return JSONResponse(response.model_dump())

    @functools.cached_property
    def fill_in_middle(self) -> FillInMiddle | None:
        return FillInMiddle.of(self.tokenizer) if self.tokenizer is not None else None

    def _check_fill_in_middle(self, request: CompletionRequest) -> FillInMiddle:
        fim = self.fill_in_middle
        if fim is None:
            raise BadRequestError(
                "`suffix` needs a model trained to fill in the middle: this model's tokenizer "
                "has no FIM tokens (such as <|fim_prefix|>).",
                param="suffix",
            )
        if request.echo or request.truncate_prompt_tokens is not None:
            other = "echo" if request.echo else "truncate_prompt_tokens"
            raise BadRequestError(f"`suffix` cannot be combined with `{other}`.", "suffix")
        return fim

    async def _fill_in_middle_prompt(self, fim: FillInMiddle, prefix, suffix: str) -> Prompt:
        if not isinstance(prefix, str):
            raise BadRequestError("`suffix` needs a text prompt.", param="suffix")
        for text, param in ((prefix, "prompt"), (suffix, "suffix")):
            self.check_text(text, param, check_length=False)
        self.check_num_chars(len(prefix) + len(suffix), "prompt")
        ids = await in_tokenizer_thread(fim.prompt_ids, self.tokenizer, prefix, suffix)
        self.check_token_ids(ids)
        return Prompt(None, ids)

    async def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        prompt = request.prompt
        truncate = request.truncate_prompt_tokens
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        fim = self._check_fill_in_middle(request) if request.suffix else None
        prompts = []
        for item in prompt:
            if fim is not None:  # the prompt is the prefix
                prompts.append(await self._fill_in_middle_prompt(fim, item, request.suffix))
                continue
            if isinstance(item, str):
                ids = await self.encode_async(item, request.add_special_tokens, truncate)
                text = item if truncate is None else self.tokenizer.decode(ids)
            else:
                ids, text = self.truncate(list(item), truncate), None
                self.check_token_ids(ids)  # before decoding them for an echo
            echo = ""
            if request.echo:
                echo = text if text is not None else self.tokenizer.decode(ids)
            prompts.append(Prompt(text, ids, echo))
        return prompts

    def _logprobs(self, request, prompt: Prompt, token_ids, steps, prompt_steps, text_offset=0):
        """The choice's logprobs (from the echoed prompt's, if echoing), and the next offset."""
        if request.logprobs is None or steps is None:
            return None, text_offset
        if request.echo_only:  # the sampled token is not part of the answer
            token_ids, steps = [], []
        if request.echo and prompt_steps is not None:
            token_ids = prompt.token_ids + token_ids
            steps = prompt_steps + steps
        names = self.token_names(request)
        return completion_logprobs(token_ids, steps, request.logprobs, names, text_offset)

    async def _collect(
        self, request, request_id, model_name, prompts: list[Prompt], streams
    ) -> CompletionResponse:
        n = request.n
        sequences: dict[int, SequenceText] = {}
        prompt_steps: dict[int, list | None] = {}
        async with contextlib.aclosing(merge_async_iterators(*streams)) as merged:
            async for prompt_index, output in merged:
                if output.prompt_logprobs is not None:
                    prompt_steps.setdefault(prompt_index, output.prompt_logprobs)
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    if index not in sequences:
                        sequences[index] = SequenceText(prompts[prompt_index].echo)
                    sequences[index].add(completion)
        choices = []
        for index in sorted(sequences):
            seq, prompt_index = sequences[index], index // n
            if request.echo_only:
                seq.drop_generated(prompts[prompt_index].echo)
            logprobs, _ = self._logprobs(
                request,
                prompts[prompt_index],
                seq.token_ids,
                seq.logprobs,
                prompt_steps.get(prompt_index),
            )
            choice = CompletionResponseChoice(
                index=index,
                text=seq.text,
                logprobs=logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            if request.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_json(prompt_steps.get(prompt_index))
            choices.append(choice)
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        num_completion_tokens = sum(len(s.token_ids) for s in sequences.values())
        return CompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=usage(num_prompt_tokens, num_completion_tokens),
        )

    async def _stream(
        self, request, request_id, model_name, prompts: list[Prompt], streams
    ) -> AsyncIterator[str]:
        n = request.n
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        num_completion_tokens = 0
        text_offsets: dict[int, int] = {}  # per choice, for the logprobs' text_offset

        make_chunk = chunk_maker(
            CompletionStreamResponse, request_id, model_name, num_prompt_tokens
        )

        try:
            async with contextlib.aclosing(merge_async_iterators(*streams)) as merged:
                async for prompt_index, output in merged:
                    prompt = prompts[prompt_index]
                    for completion in output.outputs:
                        index = prompt_index * n + completion.index
                        first = index not in text_offsets
                        text = prompt.echo + completion.text if first else completion.text
                        if not (text or has_news(completion)):
                            continue
                        if request.echo_only:
                            text = prompt.echo if first else ""
                        else:
                            num_completion_tokens += len(completion.token_ids)
                        logprobs, text_offsets[index] = self._logprobs(
                            request,
                            prompt,
                            completion.token_ids,
                            completion.logprobs,
                            output.prompt_logprobs if first else None,
                            text_offsets.get(index, 0),
                        )
                        choice = CompletionResponseChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                        )
                        running = num_completion_tokens if request.continuous_usage else None
                        yield chunk_event(make_chunk([choice], running))
            if self.includes_usage(request):
                yield chunk_event(make_chunk([], num_completion_tokens))
        except Exception as exc:
            yield error_event(exc)
        yield sse_event("[DONE]")
