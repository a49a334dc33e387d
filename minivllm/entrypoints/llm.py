"""LLM: the offline entry point, with vLLM's signatures."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from minivllm.beam_search import BeamSearchOutput, run_beam_search
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.core_client import start_engine_core
from minivllm.entrypoints.chat_utils import template_messages
from minivllm.lora.request import LoRARequest
from minivllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    check_utf8,
)

if TYPE_CHECKING:
    from minivllm.engine.processor import PromptType

# This module imports neither torch nor transformers (a test holds it to that): LLM()
# starts the engine core's process first, and the two processes import them side by side.

logger = logging.getLogger(__name__)


class LLM:
    """Generate text for batches of prompts, loading the model once.

    `LLM()` loads the bundled SmolLM2-135M-Instruct; `model` may be a Hugging Face model
    directory or a .gguf file. Other keyword arguments are EngineArgs fields.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        engine_core = start_engine_core(engine_args)
        try:
            from minivllm.engine.llm_engine import LLMEngine
        except BaseException:
            if engine_core is not None:
                engine_core.shutdown()
            raise
        self.llm_engine = LLMEngine.from_engine_args(engine_args, engine_core)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: vLLM's defaults, with
        what the model's generation_config.json sets (unless generation_config="vllm")."""
        return SamplingParams(**self.llm_engine.model_config.get_diff_sampling_param())

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (vLLM's: benchmarks call it between runs)."""
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode at level 1: the KV cache's memory is given back and the weights
        stay, until ``wake_up`` (or the next generate). No request may be running."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    def start_profile(self) -> None:
        """Start a torch.profiler trace of the engine core; needs VLLM_TORCH_PROFILER_DIR
        (or MINIVLLM_TORCH_PROFILER_DIR) set before the engine starts."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        """Stop the trace and write it (a Chrome trace JSON file) into the profiler folder."""
        self.llm_engine.stop_profile()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        **kwargs,
    ) -> list[RequestOutput]:
        """Generate for every prompt and return the finished outputs, in the prompts' order.
        lora_request: one adapter for every prompt, or one per prompt (None: the base
        model); the engine needs enable_lora=True.

        Other keyword arguments (vLLM's others, or a program's own, such as `stream=True` in
        the seeds' notes) are ignored with a warning.
        """
        if kwargs:
            logger.warning("LLM.generate ignores the arguments: %s", ", ".join(sorted(kwargs)))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts, params_list = _per_prompt(prompts, sampling_params, "sampling_params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(
                f"The lengths of prompts ({len(prompts)}) and priority ({len(priority)}) "
                "must be the same."
            )
        return self._run(prompts, params_list, priority, use_tqdm, lora_request)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list, and generate.
        tools: the functions the template offers the model (OpenAI's tool dicts); a message's
        content may be OpenAI's list of text parts (chat_template_content_format, vLLM's)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                template_messages(conversation, chat_template_content_format),
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            # The template already wrote any special tokens it wants.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str = "embed",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **kwargs,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (a pooling model: ``runner="pooling"``); returns vLLM's
        PoolingRequestOutput per prompt, in order (``.outputs.data``: a float32 tensor).
        Raises RuntimeError when a request failed in the engine."""
        if kwargs:
            logger.warning("LLM.encode ignores the arguments: %s", ", ".join(sorted(kwargs)))
        if pooling_params is None:
            pooling_params = PoolingParams()
        prompts, params_list = _per_prompt(prompts, pooling_params, "pooling_params")
        params_list = [_with_task(p, pooling_task, truncate_prompt_tokens) for p in params_list]
        outputs = self._run(prompts, params_list, None, use_tqdm, lora_request)
        for output in outputs:
            if output.finish_reason != "stop":
                raise RuntimeError(
                    f"Request {output.request_id} ended with {output.finish_reason!r} in the "
                    "engine (its log says why)."
                )
        return outputs

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        **kwargs,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``, a list of floats), as vLLM's
        LLM.embed: the model's pooling (LAST, MEAN or CLS), normalized unless the pooler
        config or the params say otherwise."""
        return self._encode_as(
            EmbeddingRequestOutput, "embed", prompts, pooling_params, truncate_prompt_tokens,
            use_tqdm, kwargs,
        )  # fmt: skip

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        **kwargs,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``.outputs.probs``), as vLLM's LLM.classify: a
        sequence classifier's ("...ForSequenceClassification") softmax over its labels, from
        the last token's hidden state."""
        return self._encode_as(
            ClassificationRequestOutput, "classify", prompts, pooling_params,
            truncate_prompt_tokens, use_tqdm, kwargs,
        )  # fmt: skip

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        **kwargs,
    ) -> list[ScoringRequestOutput]:
        """The relevance of text pairs, as vLLM's LLM.score. A cross-encoder (a sequence
        classifier of one label) reads each pair as one prompt, the tokenizer's pair encoding,
        and scores it with its activated logit; an embedding model scores the cosine of the
        pair's two embeddings. ``data_1`` is one text (paired with each of ``data_2``) or as
        many texts as ``data_2`` (paired in order); one output per pair."""
        import torch  # the frontend's imports stay light until a pooling call needs it

        texts_1 = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        texts_2 = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if not texts_1 or not texts_2:
            raise ValueError("At least one text element must be given")
        if len(texts_1) > 1 and len(texts_1) != len(texts_2):
            raise ValueError("Input lengths must be either 1:1, 1:N or N:N")
        if self.llm_engine.model_config.is_cross_encoder:
            if len(texts_1) == 1:
                texts_1 = texts_1 * len(texts_2)
            prompts = [self._pair_prompt(a, b) for a, b in zip(texts_1, texts_2)]
            return self._encode_as(
                ScoringRequestOutput, "score", prompts, pooling_params, truncate_prompt_tokens,
                use_tqdm, kwargs,
            )  # fmt: skip
        outputs = self.encode(
            texts_1 + texts_2,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="embed",
            **kwargs,
        )
        firsts, seconds = outputs[: len(texts_1)], outputs[len(texts_1) :]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        pad_token_id = getattr(self.get_tokenizer(), "pad_token_id", None)
        padding = [] if pad_token_id is None else [pad_token_id]
        scores = []
        for first, second in zip(firsts, seconds):
            score = torch.cosine_similarity(first.outputs.data, second.outputs.data, dim=0)
            scores.append(
                ScoringRequestOutput(
                    request_id=f"{first.request_id}_{second.request_id}",
                    outputs=ScoringOutput(score.item()),
                    prompt_token_ids=first.prompt_token_ids + padding + second.prompt_token_ids,
                    finished=True,
                    finish_reason="stop",
                )
            )
        return scores

    def _encode_as(
        self, output_cls, task: str, prompts, pooling_params, truncate, use_tqdm, kwargs
    ) -> list:
        """encode() for one task, each output as that task's class (its from_base)."""
        outputs = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate,
            use_tqdm=use_tqdm,
            pooling_task=task,
            **kwargs,
        )
        return [output_cls.from_base(output) for output in outputs]

    def _pair_prompt(self, first: PromptType, second: PromptType) -> dict:
        """A cross-encoder's prompt: the tokenizer's encoding of the text pair (a token-id
        prompt is decoded to its text first, as vLLM does)."""
        tokenizer = self.get_tokenizer()
        texts = []
        for prompt in (first, second):
            if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                prompt = tokenizer.decode(self.llm_engine.processor.tokenize_prompt(prompt)[1])
            elif isinstance(prompt, dict):
                prompt = prompt.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError(
                    "A text to score must be a string or a prompt dict with 'prompt' or "
                    f"'prompt_token_ids', got {type(prompt).__name__}."
                )
            check_utf8(prompt, "A text to score")
            texts.append(prompt)
        ids = tokenizer(text=texts[0], text_pair=texts[1])["input_ids"]
        return {"prompt_token_ids": ids}

    def beam_search(self, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search for each prompt (a string, or a dict with "prompt" or
        "prompt_token_ids"); returns vLLM's BeamSearchOutput, best sequence first."""
        processor = self.llm_engine.processor
        prompt_ids = []
        for prompt in prompts:
            _, ids = processor.tokenize_prompt(prompt)
            processor.validate_prompt_ids(ids)
            prompt_ids.append(ids)
        return run_beam_search(self.llm_engine, prompt_ids, params)

    def _run(
        self, prompts, params_list, priority, use_tqdm: bool, lora_request=None
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"The lengths of prompts ({len(prompts)}) and lora_request ({len(loras)}) "
                    "must be the same."
                )
        # Only finished outputs are read here: the output processor builds none before
        # (vLLM's LLM does the same), where a cumulative one per step would copy each
        # request's tokens and text again every step.
        params_list = [final_only(p) for p in params_list]
        # Validate everything first, so a bad prompt leaves no request behind.
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        added = []
        try:
            for i, (request_id, prompt, params) in enumerate(
                zip(request_ids, prompts, params_list)
            ):
                engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                )
                added.append(request_id)
        except Exception:
            engine.abort_request(added)
            raise
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(prompts), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm
        )
        in_tokens = out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        outputs[output.request_id] = output
                        in_tokens += len(output.prompt_token_ids)
                        if isinstance(output, RequestOutput):
                            out_tokens += sum(len(o.token_ids) for o in output.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.postfix = (
                            f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                            f"output: {out_tokens / elapsed:.2f} toks/s"
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in outputs])
            raise
        finally:
            bar.close()
        return [outputs[r] for r in request_ids]


def final_only(params):
    """A copy of sampling params whose request makes one output, when it finishes (the
    caller's object is left as it was)."""
    if not isinstance(params, SamplingParams) or params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def _per_prompt(prompts, params, name: str) -> tuple[list, list]:
    """(prompts, one params per prompt) from one prompt or a list, and one params or a list
    as long."""
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    if isinstance(params, (SamplingParams, PoolingParams)):
        return prompts, [params] * len(prompts)
    params_list = list(params)
    if len(params_list) != len(prompts):
        raise ValueError(
            f"The lengths of prompts ({len(prompts)}) and {name} ({len(params_list)}) "
            "must be the same."
        )
    return prompts, params_list


def _with_task(
    params: PoolingParams, task: str | None, truncate_prompt_tokens: int | None
) -> PoolingParams:
    """The params with the call's task and truncation (the params' own truncation wins)."""
    params = params.clone()
    if task is not None:
        if params.task not in (None, task):
            raise ValueError(
                f"pooling_task {task!r} differs from the params' task {params.task!r}."
            )
        params.task = task
    if params.truncate_prompt_tokens is None:
        params.truncate_prompt_tokens = truncate_prompt_tokens
    PoolingParams.__post_init__(params)  # a bad task or truncation fails here
    return params
