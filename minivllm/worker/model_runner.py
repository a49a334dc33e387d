"""The one bridge between scheduler bookkeeping and tensors: batch in, sampled ids out."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.attention.backend import AttentionMetadata, PrefillSpan
from minivllm.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from minivllm.sample.sampler import Sampler, SamplingMetadata
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


class ModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, vocab_size: int) -> None:
        self.model = model
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
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])
        input_ids, positions, meta, logits_rows, sampling_states = self._prepare_inputs(so)
        hidden = self.model(input_ids, positions, meta)
        sampled: dict[str, int] = {}
        if sampling_states:
            logits = self.model.compute_logits(hidden[logits_rows])
            token_ids = self.sampler(logits, self._sampling_metadata(sampling_states)).tolist()
            for state, token_id in zip(sampling_states, token_ids):
                state.token_ids.append(token_id)
                state.output_ids.append(token_id)
                sampled[state.req_id] = token_id
        for req_id, n in so.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
        )

    def _prepare_inputs(self, so: SchedulerOutput):
        bs = self.block_size
        ids_parts, pos_parts, slot_parts = [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        logits_rows, sampling_states = [], []
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
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(state.block_ids[: -(-end // bs)])
                decode_lens.append(end)
            else:
                prefills.append(
                    PrefillSpan(row, row + n, end, torch.from_numpy(table[: -(-end // bs)]))
                )
            if end == len(state.token_ids):  # reached the end: this request samples
                logits_rows.append(row + n - 1)
                sampling_states.append(state)
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
        input_ids = torch.tensor([t for part in ids_parts for t in part], dtype=torch.long)
        positions = torch.from_numpy(np.concatenate(pos_parts))
        return (
            input_ids,
            positions,
            meta,
            torch.tensor(logits_rows, dtype=torch.long),
            sampling_states,
        )

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        use_top_k = any(p.top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        use_penalties = any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        )
        meta = SamplingMetadata(
            temperature=temperature,
            all_greedy=all(p.sampling_type_greedy for p in params),
            top_k=torch.tensor([p.top_k for p in params]) if use_top_k else None,
            top_p=torch.tensor([p.top_p for p in params]) if use_top_p else None,
            min_p=torch.tensor([p.min_p for p in params]) if use_min_p else None,
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        )
        if use_penalties:
            self._add_penalties(meta, states)
        bans = []
        for i, s in enumerate(states):
            if len(s.output_ids) < s.sampling_params.min_tokens:
                stop_ids = list(s.sampling_params.stop_token_ids)
                if s.eos_token_id is not None and not s.sampling_params.ignore_eos:
                    stop_ids.append(s.eos_token_id)
                if stop_ids:
                    bans.append((i, stop_ids))
        meta.min_tokens_ban = bans or None
        return meta

    def _add_penalties(self, meta: SamplingMetadata, states: list[CachedRequestState]) -> None:
        batch, vocab = len(states), self.vocab_size
        counts = torch.zeros(batch, vocab, dtype=torch.float32)
        prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool)
        for i, s in enumerate(states):
            if s.output_ids:
                counts[i].index_add_(0, torch.tensor(s.output_ids), torch.ones(len(s.output_ids)))
            prompt_mask[i, torch.tensor(s.token_ids[: s.num_prompt_tokens])] = True
        params = [s.sampling_params for s in states]
        meta.output_token_counts = counts
        meta.prompt_token_mask = prompt_mask
        meta.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
        meta.presence_penalty = torch.tensor([p.presence_penalty for p in params])
        meta.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
