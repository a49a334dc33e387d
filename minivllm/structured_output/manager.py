"""The engine core's side of structured outputs.

Compiling a grammar takes milliseconds to seconds, so it runs in a thread: the request
waits in the scheduler (WAITING_FOR_FSM) until its grammar is ready, and the engine keeps
stepping the others. Several compile at once (MINIVLLM_GRAMMAR_COMPILE_THREADS; xgrammar
releases the GIL), so a grammar of thousands of tools does not hold up a yes/no choice
that arrives after it, and a request whose grammar takes longer than
MINIVLLM_GRAMMAR_COMPILE_TIMEOUT seconds fails with that reason. Each step's bitmask is
filled in another thread while the forward pass runs; the sampler waits for it only when
it applies it. The tokenizer is loaded on the first structured request, so an engine that
never sees one pays nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from minivllm import envs
from minivllm.config import ModelConfig, StructuredOutputsConfig
from minivllm.sampling_params import StructuredOutputsParams
from minivllm.structured_output.grammar import grammar_spec
from minivllm.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from minivllm.core.request import Request
    from minivllm.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

# Distinct constraints whose compiled grammars (or compile errors) are kept.
MAX_CACHED_GRAMMARS = 512
# A JSON string with no maxLength may take at most this share (1/N) of a reply's max_tokens.
STRING_SHARE_OF_REPLY = 4


class StructuredOutputManager:
    def __init__(
        self, model_config: ModelConfig, config: StructuredOutputsConfig | None = None
    ) -> None:
        self.model_config = model_config
        self.config = config or StructuredOutputsConfig()
        self._backend = None
        self._backend_lock = threading.Lock()
        self._compile_pool = ThreadPoolExecutor(
            envs.MINIVLLM_GRAMMAR_COMPILE_THREADS, thread_name_prefix="grammar-compile"
        )
        self.compile_timeout = envs.MINIVLLM_GRAMMAR_COMPILE_TIMEOUT
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        # spec -> Future of its CompiledGrammar: one compile per distinct constraint. A failed
        # compile is kept too (its Future holds the error): compiling is deterministic, so
        # every later request with the same spec fails at once with the same reason.
        # The most recently used max_cached_grammars are kept (a request holds its own).
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.max_cached_grammars = MAX_CACHED_GRAMMARS
        # Seconds each distinct spec took to compile (first time), for benchmarks and logs.
        self.compile_seconds: dict[tuple, float] = {}

    @property
    def backend(self):
        with self._backend_lock:
            if self._backend is None:
                import xgrammar as xgr

                from minivllm.structured_output.backend_xgrammar import XgrammarBackend
                from minivllm.tokenizer import end_of_generation_ids, load_tokenizer

                tokenizer = load_tokenizer(self.model_config.tokenizer)
                # A completed grammar ends on any token that ends the model's generations
                # (the Processor stops requests on the same ones), not only on eos.
                vocab = self.model_config.vocab_size
                stops = end_of_generation_ids(self.model_config.model, tokenizer, vocab)
                if tokenizer.eos_token_id is not None:
                    stops = [tokenizer.eos_token_id, *stops]
                self._backend = XgrammarBackend(tokenizer, vocab, stops or None)
                # Fills a step's rows in one call, in the fill thread (its own threads: none).
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
                self._matcher_type = xgr.GrammarMatcher
                self._tokenizer = tokenizer
            return self._backend

    def string_cap(self, max_tokens: int | None) -> int:
        """The characters a JSON string with no maxLength may hold in a reply of max_tokens
        (0: unbounded): the configured cap, or a quarter of the reply where that is less. A
        character can cost a token (digits are one token each in many vocabularies), so
        one string that runs to the cap leaves room for the rest of the object."""
        cap = self.config.json_max_string_length
        if cap <= 0 or max_tokens is None:
            return cap
        return max(1, min(cap, max_tokens // STRING_SHARE_OF_REPLY))

    def new_request(
        self, params: StructuredOutputsParams, max_tokens: int | None = None
    ) -> StructuredOutputRequest:
        """max_tokens: the request's (bounds its free strings; see string_cap)."""
        spec = grammar_spec(params)
        key = (spec, params.disable_any_whitespace, self.string_cap(max_tokens))
        future = self._compiled.get(key)
        if future is None:
            future = self._compile_pool.submit(self._compile, key)
            self._compiled[key] = future
            while len(self._compiled) > self.max_cached_grammars:
                old_key, _ = self._compiled.popitem(last=False)
                self.compile_seconds.pop(old_key, None)
        else:
            self._compiled.move_to_end(key)
        request = StructuredOutputRequest(params, future, self.compile_timeout)
        if params.reasoning_end is not None:
            self.backend  # noqa: B018 (loads the tokenizer)
            request.reasoning_end_ids = self._tokenizer.encode(
                params.reasoning_end, add_special_tokens=False
            )
        return request

    def _compile(self, key: tuple):
        spec, no_whitespace, string_cap = key
        start = time.perf_counter()
        compiled = self.backend.compile(
            spec, any_whitespace=not no_whitespace, max_string_length=string_cap
        )
        seconds = time.perf_counter() - start
        # Not kept if evicted meanwhile. A fast compile can also end before new_request
        # has put its future in the cache: then too it is only logged.
        if key in self._compiled:
            self.compile_seconds[key] = seconds
        logger.debug("Compiled a %s grammar in %.3f s", spec[0], seconds)
        return compiled

    def is_ready(self, request: StructuredOutputRequest) -> bool:
        return request.is_ready(self.backend.matcher)

    def only_stop_allowed(self, request: StructuredOutputRequest) -> bool:
        """Whether the request's grammar is complete and its next token can only be a stop
        token (called between steps, when no bitmask is being filled)."""
        if not request.reasoning_ended or request.matcher is None:
            return False
        return self.backend.only_stop_allowed(request.matcher)

    def add_grammar_bitmask(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Start filling the bitmask rows of a step's constrained requests that sample (their
        computed tokens now reach their last token); the sampler collects it. requests: the
        scheduler's, by id."""
        rows = []
        for req_id in output.num_scheduled_tokens:
            request = requests[req_id]
            so_request = request.structured_output_request
            if (
                so_request is not None
                and so_request.reasoning_ended
                and request.num_computed_tokens == request.num_tokens
            ):
                output.structured_output_request_ids[req_id] = len(rows)
                rows.append(so_request)
        if rows:
            output.grammar_bitmask = self.submit_bitmask(rows)

    def submit_bitmask(self, requests: list[StructuredOutputRequest]) -> Future:
        """Fill one bitmask row per request (in order) in a thread; the Future's result is
        the [len(requests), ceil(V / 32)] int32 bitmask."""
        return self._fill_pool.submit(self._fill, requests)

    def _fill(self, requests: list[StructuredOutputRequest]) -> torch.Tensor:
        # A fresh tensor per step (the previous step's may still be read by the sampler), all
        # ones: a row left alone allows every token. That is the row of a matcher that has
        # terminated (its stop token accepted, and the request goes on under ignore_eos): the
        # rest of its output is free, as in vLLM. Filling it would raise.
        bitmask = self.backend.allocate_bitmask(len(requests))
        rows = [i for i, request in enumerate(requests) if not request.matcher.is_terminated()]
        matchers = [requests[i].matcher for i in rows]
        # One call for the batch (one release of the GIL, no Python between rows) where the
        # matchers are xgrammar's own; row by row otherwise, or to find the row that failed.
        if not rows:
            return bitmask
        if all(type(m) is self._matcher_type for m in matchers):
            try:
                self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
                return bitmask
            except Exception:
                pass
        for row in rows:
            request = requests[row]
            try:
                request.matcher.fill_next_token_bitmask(bitmask, row)
            except Exception as exc:  # this request alone: the scheduler fails it after the step
                request.failure = exc
                bitmask[row] = -1  # meanwhile its row allows every token
        return bitmask

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
