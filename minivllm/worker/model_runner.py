"""The one bridge between scheduler bookkeeping and tensors: batch in, sampled ids out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.attention.backend import AttentionMetadata, PrefillSpan
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
    attn_metadata: AttentionMetadata
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
    ) -> None:
        self.model = model
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
        bs = self.block_size
        ids_parts, pos_parts, slot_parts = [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        logits_rows, sampling_states, prompt_logprob_rows = [], [], []
        row = 0
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + n
            pos = np.arange(start, end)
            table = np.asarray(state.block_ids, dtype=np.int64)
            ids_parts.append(state.token_ids[start:end])
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            num_blocks = -(-end // bs)
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(state.block_ids[:num_blocks])
                decode_lens.append(end)
            else:
                prefills.append(
                    PrefillSpan(row, row + n, end, torch.from_numpy(table[:num_blocks]))
                )
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

        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = np.zeros((len(decode_tables), max_blocks), dtype=np.int64)
        for i, t in enumerate(decode_tables):
            padded[i, : len(t)] = t
        meta = AttentionMetadata(
            num_tokens=row,
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)),
            decode_indices=torch.tensor(decode_rows, dtype=torch.long),
            decode_block_table=torch.from_numpy(padded),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long),
            prefills=prefills,
        )
        return StepInputs(
            input_ids=torch.tensor([t for part in ids_parts for t in part], dtype=torch.long),
            positions=torch.from_numpy(np.concatenate(pos_parts)),
            attn_metadata=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            sampling_states=sampling_states,
            prompt_logprob_rows=prompt_logprob_rows,
        )
