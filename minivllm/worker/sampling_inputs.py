"""The step's sampling metadata on the device: the sampling rows' parameters, the
structured outputs' grammar bitmask rows, and the reuse of a steady batch's metadata."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.core.sched_output import SchedulerOutput
from minivllm.sample.metadata import build_sampling_metadata
from minivllm.sample.sampler import SamplingMetadata
from minivllm.sample.structured import grammar_rows
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.step import CachedRequestState


class SamplingInputs:
    """A steady decode batch (the same rows sample, none with state that changes per step:
    penalties, bans, a grammar) takes the last step's metadata again: no per-row gathers,
    no host-to-device copies."""

    def __init__(self, batch: InputBatch, vocab_size: int, device: torch.device) -> None:
        self.batch = batch
        self.vocab_size = vocab_size
        self.device = device
        # ((batch version, sampling rows), metadata on the device) of a steady batch.
        self.steady: tuple[tuple, SamplingMetadata] | None = None

    def metadata(
        self, so: SchedulerOutput, states: list[CachedRequestState], rows: np.ndarray
    ) -> SamplingMetadata:
        """The metadata of the logits rows: ``states[i]`` samples at ``rows[i]`` (a batch
        row), the constrained ones under their grammar's bitmask row."""
        key = (self.batch.version, rows.tobytes())
        if self.steady is not None and self.steady[0] == key:
            return self.steady[1]
        arrays = self.batch.sampling.gather(rows)
        metadata = build_sampling_metadata(states, self.vocab_size, arrays)
        metadata.grammar = grammar_rows(so, [s.req_id for s in states])
        metadata = metadata.to(self.device)
        steady = metadata.grammar is None and not (
            arrays.uses_penalties.any() or arrays.has_bans_or_biases.any()
        )
        self.steady = (key, metadata) if steady else None
        return metadata
