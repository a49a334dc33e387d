"""Validates and tokenizes user input into EngineCoreRequests."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from minivllm.config import LoRAConfig, ModelConfig
from minivllm.engine.exceptions import VLLMValidationError
from minivllm.engine.messages import EngineCoreRequest
from minivllm.engine.request_limits import check_request_bounds
from minivllm.lora.peft import read_adapter_config
from minivllm.lora.request import LoRARequest
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import (
    SamplingParams,
    check_finite_number,
    check_int,
    check_token_ids,
    check_utf8,
)
from minivllm.tokenizer import end_of_generation_ids

if TYPE_CHECKING:
    from minivllm.core.slo_policy import SLOAdmission

PromptType = str | dict | list[int]

# A pooling request samples nothing; the engine's per-request arrays still want parameters.
_POOLING_PLACEHOLDER = SamplingParams(max_tokens=1, detokenize=False)


class Processor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer,
        scheduling_policy: str = "fcfs",
        lora_config: LoRAConfig | None = None,
    ):
        self.model_config = model_config
        self.scheduling_policy = scheduling_policy
        self.lora_config = lora_config
        self.checked_loras: set[int] = set()  # adapter ids whose config passed (read once)
        # The slo policy's admission check (set by the engine once its core is ready).
        self.slo_admission: SLOAdmission | None = None
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        # The model's other end-of-generation tokens (Llama 3's <|eot_id|>, Gemma's
        # <end_of_turn>, ...): every request stops on them too, unless it ignores eos.
        self.end_of_generation_ids = end_of_generation_ids(
            model_config.model, tokenizer, model_config.vocab_size
        )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) for any accepted prompt form."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list):
                    raise ValueError("prompt_token_ids must be a list of integers.")
                check_token_ids(ids, "prompt_token_ids", self.model_config.vocab_size)
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise ValueError("A prompt dict's 'prompt' must be a string.")
                return text, list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError("A prompt dict needs a 'prompt' string or 'prompt_token_ids' list.")
        raise ValueError(
            f"Unsupported prompt type {type(prompt).__name__}: pass a string or "
            "{'prompt_token_ids': [...]}."
        )

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("This engine has no tokenizer: pass prompt_token_ids.")
        check_utf8(text, "The prompt")
        return self.tokenizer.encode(text)

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        check_request_fields(request_id, priority, arrival_time)
        pooling = self.model_config.runner_type == "pooling"
        expected = PoolingParams if pooling else SamplingParams
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise ValueError(f"Expected {expected.__name__}, got {type(params).__name__}.")
        if not isinstance(params, expected):
            raise ValueError(
                "Generation is only supported for generative models: this one runs for "
                "embeddings (runner='pooling'); use LLM.embed / encode, or pass "
                "runner='generate'."
                if pooling
                else "Embeddings are only supported for pooling models. Try passing "
                "runner='pooling' (--runner pooling) to use the model as a pooling model."
            )
        if priority != 0 and self.scheduling_policy != "priority":
            raise VLLMValidationError(
                f"Got priority {priority} but priority scheduling is not enabled "
                "(scheduling_policy='priority'; the server's --scheduling-policy priority).",
                parameter="priority",
            )
        self.validate_lora(lora_request)
        cache_salt = prompt_cache_salt(prompt)
        prompt_text, prompt_ids = self.tokenize_prompt(prompt)
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            truncate = self.model_config.max_model_len if truncate == -1 else truncate
            prompt_ids = prompt_ids[-truncate:]  # keep the end, as vLLM
        self.validate_prompt_ids(prompt_ids)
        if pooling:
            check_pooling_params(params, self.model_config)
            return prompt_text, EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                sampling_params=_POOLING_PLACEHOLDER,
                eos_token_id=None,
                arrival_time=arrival_time if arrival_time is not None else time.time(),
                priority=priority,
                pooling_params=params,
                lora_request=lora_request,
                cache_salt=cache_salt,
            )
        params = self._resolve_params(params)
        if self.slo_admission is not None:
            self.slo_admission.check(len(prompt_ids), params)
        missing = [t for t in self.end_of_generation_ids if t not in params.stop_token_ids]
        if missing and not params.ignore_eos:
            params = params.clone()  # as vLLM's update_from_generation_config
            params.stop_token_ids = [*params.stop_token_ids, *missing]
        return prompt_text, EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            lora_request=lora_request,
            cache_salt=cache_salt,
        )

    def validate_lora(self, lora_request: LoRARequest | None) -> None:
        """What can be checked here of a request's adapter: LoRA is on, and its folder holds
        an adapter of a rank the engine serves (the engine core checks its matrices against
        the model when the request arrives there, and fails that request alone)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}."
            )
        if self.lora_config is None:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
        if lora_request.lora_int_id not in self.checked_loras:
            read_adapter_config(lora_request.lora_path, self.lora_config.max_lora_rank)
            self.checked_loras.add(lora_request.lora_int_id)

    def validate_prompt_ids(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise VLLMValidationError("The decoder prompt cannot be empty", parameter="prompt")
        max_len = self.model_config.max_model_len
        if len(prompt_ids) > max_len:
            raise VLLMValidationError(
                f"The decoder prompt (length {len(prompt_ids)}) is longer than the maximum "
                f"model length of {max_len}: this model's maximum context length is {max_len} "
                "tokens. Please reduce the length of the prompt.",
                parameter="prompt",
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise VLLMValidationError(
                f"Token id {bad} is out of vocabulary (vocab size {vocab}).", parameter="prompt"
            )

    def _resolve_params(self, params: SamplingParams) -> SamplingParams:
        """Check the parameters that depend on the model (token ids against the vocabulary,
        logprobs, top_k), and tokenize bad words."""
        check_request_bounds(params)
        vocab = self.model_config.vocab_size
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            try:
                check_token_ids(getattr(params, name) or (), name, vocab)
            except ValueError as exc:
                raise VLLMValidationError(str(exc), parameter=name) from None
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise VLLMValidationError(
                    f"Requested {name} of {value}, which is greater than the vocabulary "
                    f"size {vocab}.",
                    parameter=name,
                )
        if params.top_k > vocab:
            # As vLLM: a top_k over the vocabulary keeps the whole vocabulary.
            params = params.clone()
            params.top_k = vocab
        if params.structured_outputs is not None:
            from minivllm.structured_output.grammar import check_grammar

            check_grammar(params.structured_outputs)  # a bad schema fails here, not in the engine
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer.")
        # Each word alone and after a space: both spellings can start a word in the output.
        token_ids = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in token_ids:
                    token_ids.append(ids)
        params = params.clone()
        params.bad_words_token_ids = token_ids
        return params


def prompt_cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's cache_salt (vLLM's): a secret that keys the prefix cache's blocks,
    so that requests without it cannot hit them (nor time the hits) in a shared server."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise VLLMValidationError("cache_salt must be a non-empty string.", "cache_salt")
    check_utf8(salt, "cache_salt")
    return salt


def check_request_fields(request_id, priority, arrival_time) -> None:
    """The request's own fields, typed as the engine core decodes them: one of another type
    failed the core's decoder, which killed the engine for every request."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {type(request_id).__name__}.")
    try:
        check_int(priority, "priority")
    except ValueError as exc:
        raise VLLMValidationError(str(exc), parameter="priority") from None
    if arrival_time is not None:
        check_finite_number(arrival_time, "arrival_time")


def check_pooling_params(
    params: PoolingParams, config: ModelConfig, model_name: str | None = None
) -> None:
    """The checks of a pooling request that depend on the model: ``dimensions`` only on a
    matryoshka model, among its listed sizes, and at most its hidden size (vLLM's).
    model_name: what the message calls the model (the server's served name; its path)."""
    task = params.task or config.pooling_task
    if task not in config.pooling_tasks:
        raise ValueError(
            f"Task {task!r} is not supported by this model: it serves "
            + " and ".join(f"{t!r} (LLM.{t})" for t in config.pooling_tasks)
            + "."
        )
    if task == "score" and config.hf_config.num_labels != 1:
        raise ValueError("Score API is only enabled for num_labels == 1.")
    if params.dimensions is None:
        return
    if not config.is_matryoshka:
        raise ValueError(
            f'Model "{model_name or config.model}" does not support matryoshka representation, '
            "changing output dimensions will lead to poor results."
        )
    allowed = getattr(config.hf_config, "matryoshka_dimensions", None)
    if allowed and params.dimensions not in allowed:
        raise ValueError(f"Dimensions must be in {allowed}, got {params.dimensions}.")
    hidden = config.hf_config.hidden_size
    if params.dimensions > hidden:
        raise ValueError(
            f"dimensions must be at most the model's hidden size {hidden}, got {params.dimensions}."
        )
