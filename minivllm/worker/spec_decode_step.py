"""Speculative decoding in the runner's step: the scheduler's proposals go into the
step's inputs, the sampled rows verify them, and the next proposals go out with the output.

A proposal is kept when the token sampled at its row is the proposal itself. For a greedy
request that is the argmax; for a random one, each row draws from its own distribution, so
a proposal is kept with exactly its probability and, when it is not, the token drawn there
is distributed as the rest of that distribution: the rejection sampling of speculative
decoding for a proposer that is certain of its proposal (vLLM's, for n-gram drafts).
Outputs follow the model's distribution; a seeded request's, drawing more numbers a step,
differ from its plain ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from minivllm.core.sched_output import ModelRunnerOutput
from minivllm.spec_decode.ngram_proposer import NgramProposer
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.step import RunnerStep, StepFeature

if TYPE_CHECKING:
    from minivllm.config import SpeculativeConfig


class SpecDecode(StepFeature):
    def __init__(
        self,
        config: SpeculativeConfig,
        batch: InputBatch,
        prompt_logprob_reqs: set[str],
        proposes: bool,
    ) -> None:
        """prompt_logprob_reqs: the requests still collecting prompt logprobs (they get no
        proposals); proposes: this rank proposes (tensor-parallel rank 0)."""
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.batch = batch
        self.prompt_logprob_reqs = prompt_logprob_reqs
        self.proposes = proposes

    def prepare(self, step: RunnerStep) -> None:
        """The proposals, written after each request's known tokens; as decode rows unless
        a request's prompt logprobs read its rows."""
        drafts = step.so.scheduled_spec_decode_tokens
        if not drafts:
            return
        self.batch.set_drafts(drafts)
        step.num_drafts = np.fromiter(
            (len(drafts.get(r, ())) for r in step.req_ids), np.int64, len(step.req_ids)
        )
        step.drafts_as_decode_rows = not step.reads_all_rows

    def after_sample(self, step: RunnerStep) -> None:
        """Verification: the tokens each request keeps (its logits rows: its proposals'
        and its last known token's)."""
        num_logits = step.inputs.num_logits
        if num_logits is None:
            return
        drafts = step.so.scheduled_spec_decode_tokens
        step.token_lists, step.last_rows = accept_drafts(
            step.token_ids, num_logits.tolist(), [drafts.get(s.req_id) for s in step.states]
        )

    def after_output(self, step: RunnerStep, output: ModelRunnerOutput) -> None:
        if self.proposes:
            output.spec_token_ids = self._propose(step)

    def _propose(self, step: RunnerStep) -> dict[str, list[int]]:
        """Proposed next tokens of the requests that sampled, where their sampling allows:
        nothing read from their own outputs on the host (penalties would have to count the
        proposals), no logprobs."""
        proposals = {}
        batch = self.batch
        for state in step.states:
            params = state.sampling_params
            if (
                params.reads_own_outputs
                or params.logprobs is not None
                or state.req_id in self.prompt_logprob_reqs
            ):
                continue
            left = (params.max_tokens or 1 << 62) - len(state.output_ids) - 1
            row = batch.req_id_to_row[state.req_id]
            tokens = self.proposer.propose(batch.token_ids[row, : batch.num_tokens[row]], left)
            if tokens:
                proposals[state.req_id] = tokens
        return proposals


def accept_drafts(
    sampled: list[int], counts: list[int], drafts: list[list[int] | None]
) -> tuple[list[list[int]], list[int]]:
    """Verification: each request's sampled ids at its proposals and after them (counts[i]
    of them) keep the proposals up to the first the sampled token differs from, then the
    sampled token there. Returns the kept tokens and each request's row of its last kept
    token."""
    token_lists, last_rows = [], []
    start = 0
    for n, proposed in zip(counts, drafts):
        targets = sampled[start : start + n]
        kept = 0
        while kept < n - 1 and targets[kept] == proposed[kept]:
            kept += 1
        token_lists.append(targets[: kept + 1])
        last_rows.append(start + kept)
        start += n
    return token_lists, last_rows
