"""The one bridge between scheduler bookkeeping and tensors: batch in, sampled ids out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from minivllm.distributed.parallel_state import TPGroup
from minivllm.engine.profiler import profile_range
from minivllm.sample.metadata import build_sampling_metadata
from minivllm.sample.penalties import SeenTokens
from minivllm.sample.sampler import Sampler, gather_logprobs
from minivllm.sample.structured import grammar_rows
from minivllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner remembers of a request between steps (it sees a request once)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    # (ids, logprobs, ranks) of the prompt tokens so far, when the request asks for them.
    prompt_logprobs: tuple[list, list, list] | None = None
    prompt_logprobs_sent: bool = False
    seen_tokens: SeenTokens | None = None  # for penalties; built when first needed


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: Any  # the attention backend's, built once per step
    logits_rows: torch.Tensor  # rows whose logits are sampled
    sampling_states: list[CachedRequestState]
    # (state, rows, target token ids) for requests collecting prompt logprobs.
    prompt_logprob_rows: list[tuple[CachedRequestState, list[int], list[int]]]


class ModelRunner:
    """With tensor parallelism every rank runs the same steps on the same requests; rank 0
    alone samples, and sends the sampled ids to the others (they feed the next step)."""

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int,
        vocab_size: int,
        tp: TPGroup | None = None,
        *,
        attn_backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.tp = tp if tp is not None else TPGroup()
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # Seeded generators outlive preemption, so a resumed request keeps its random stream.
        self.generators: dict[str, torch.Generator] = {}

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            if req_id not in so.preempted_req_ids:
                self.generators.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new)
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.block_ids.extend(block_ids)
            state.num_computed_tokens = computed

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        seed = new.sampling_params.seed
        if seed is not None and new.req_id not in self.generators:
            self.generators[new.req_id] = torch.Generator().manual_seed(seed)
        return CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            eos_token_id=new.eos_token_id,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=self.generators.get(new.req_id),
            output_ids=list(new.token_ids[new.num_prompt_tokens :]),
            prompt_logprobs=([], [], [])
            if new.sampling_params.prompt_logprobs is not None
            else None,
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])
        with profile_range("prepare_inputs"):
            inputs = self._prepare_inputs(so)
        with profile_range("forward"):
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs)
        sampled: dict[str, int] = {}
        logprobs: dict[str, tuple] = {}
        states = inputs.sampling_states
        if states:
            with profile_range("compute_logits"):
                logits = self.model.compute_logits(hidden[inputs.logits_rows])
            if logits is not None:
                with profile_range("sample"):
                    metadata = build_sampling_metadata(states, self.vocab_size)
                    metadata.grammar = grammar_rows(so, [s.req_id for s in states])
                    out = self.sampler(logits, metadata)
                sampled_ids = out.sampled_token_ids
            else:  # a tensor-parallel rank other than 0: rank 0's draw arrives below
                out, sampled_ids = None, torch.empty(len(states), dtype=torch.long)
            token_ids = self.tp.broadcast_from_first(sampled_ids).tolist()
            if out is not None and out.logprobs is not None:
                lp_ids, lp_values = out.logprob_token_ids.tolist(), out.logprobs.tolist()
                ranks = out.sampled_ranks.tolist()
            for i, (state, token_id) in enumerate(zip(states, token_ids)):
                state.token_ids.append(token_id)
                state.output_ids.append(token_id)
                sampled[state.req_id] = token_id
                k = state.sampling_params.logprobs
                if out is not None and out.logprobs is not None and k is not None:
                    k = self.vocab_size if k == -1 else k
                    logprobs[state.req_id] = (lp_ids[i][: 1 + k], lp_values[i][: 1 + k], ranks[i])
        for req_id, n in so.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
            logprobs=[logprobs.get(r) for r in req_ids] if logprobs else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[str, tuple]:
        """Logprobs of each prompt token given what precedes it, for requests that ask.

        A prompt computed in chunks collects them chunk by chunk; the whole list is sent
        once the prompt is done: (ids [P-1][1+k], logprobs [P-1][1+k], ranks [P-1]).
        """
        finished = {}
        for state, rows, targets in inputs.prompt_logprob_rows:
            k = state.sampling_params.prompt_logprobs
            k = self.vocab_size if k == -1 else k
            if rows:
                logits = self.model.compute_logits(hidden[rows])
                if logits is None:  # not rank 0: only the count matters here
                    state.prompt_logprobs[2].extend([0] * len(rows))
                else:
                    logprobs = torch.log_softmax(logits, dim=-1)
                    ids, values, ranks = gather_logprobs(logprobs, torch.tensor(targets), k)
                    state.prompt_logprobs[0].extend(ids.tolist())
                    state.prompt_logprobs[1].extend(values.tolist())
                    state.prompt_logprobs[2].extend(ranks.tolist())
            if len(state.prompt_logprobs[2]) == state.num_prompt_tokens - 1:
                finished[state.req_id] = tuple(state.prompt_logprobs)
                state.prompt_logprobs_sent = True
        return finished

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        ids_parts, computed, block_ids = [], [], []
        logits_rows, sampling_states, prompt_logprob_rows = [], [], []
        row = 0
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + n
            ids_parts.append(state.token_ids[start:end])
            computed.append(start)
            block_ids.append(state.block_ids)
            if end == len(state.token_ids):  # reached the end: this request samples
                logits_rows.append(row + n - 1)
                sampling_states.append(state)
            if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                # Position p predicts prompt token p + 1.
                last = min(end, state.num_prompt_tokens - 1)
                first = max(start, len(state.prompt_logprobs[2]))
                rows = list(range(row + first - start, row + last - start))
                targets = state.token_ids[first + 1 : last + 1]
                prompt_logprob_rows.append((state, rows, targets))
            row += n

        query_lens = np.fromiter(so.num_scheduled_tokens.values(), np.int32, len(computed))
        positions, common = build_common_metadata(
            np.array(computed, dtype=np.int32), query_lens, block_ids, self.block_size
        )
        return StepInputs(
            input_ids=torch.tensor([t for part in ids_parts for t in part], dtype=torch.long),
            positions=torch.from_numpy(positions),
            attn_metadata=self.attn_backend.build_metadata(common),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            sampling_states=sampling_states,
            prompt_logprob_rows=prompt_logprob_rows,
        )


def build_common_metadata(
    num_computed: np.ndarray, query_lens: np.ndarray, block_ids: list[list[int]], block_size: int
) -> tuple[np.ndarray, CommonAttentionMetadata]:
    """Each token's position, and the step's flat attention metadata: request i's
    query_lens[i] tokens follow its num_computed[i] tokens already in the cache."""
    bs = block_size
    num_reqs = len(query_lens)
    seq_lens = num_computed + query_lens
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    # Token t of request i sits at num_computed[i] + (t - query_start_loc[i]).
    offsets = np.repeat(query_start_loc[:-1] - num_computed, query_lens)
    positions = np.arange(num_tokens, dtype=np.int64) - offsets
    max_seq_len = int(seq_lens.max())
    num_blocks = -(-seq_lens // bs)
    block_table = np.zeros((num_reqs, -(-max_seq_len // bs)), dtype=np.int32)
    for i, (ids, n) in enumerate(zip(block_ids, num_blocks.tolist())):
        block_table[i, :n] = ids[:n]
    token_req = np.repeat(np.arange(num_reqs), query_lens)
    slots = block_table[token_req, positions // bs].astype(np.int64) * bs + positions % bs
    query_start_loc_t = torch.from_numpy(query_start_loc)
    seq_lens_t = torch.from_numpy(seq_lens)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc_t,
        seq_lens=seq_lens_t,
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots),
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=max_seq_len,
        query_start_loc_cpu=query_start_loc_t,
        seq_lens_cpu=seq_lens_t,
    )
    return positions, common
