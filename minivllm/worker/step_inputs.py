"""What one step hands the model: ``StepInputs`` (views of the InputBatch's persistent
buffers, written by ``InputBatch.prepare``) and, under async scheduling, ``InFlightTokens``
(the last step's draws, still on the device, that the next step reads as inputs)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class InFlightTokens:
    """The tokens a launched step samples, still on the device (async scheduling): the
    next step reads them as inputs there, before the host has them."""

    req_ids: list[str]  # the requests that sampled, in the step's order
    positions: np.ndarray  # [S] int64, the position of each token in its request
    sampled: torch.Tensor  # [S] int64, on the device
    # Each seeded request's generator state before this step drew its token: a request
    # preempted with the token in flight draws it again, from there (the runner's
    # ``_undo_draw``).
    draw_states: dict[str, torch.Tensor] = field(default_factory=dict)

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """req_id -> its row in sampled."""
        return {req_id: i for i, req_id in enumerate(self.req_ids)}


@dataclass
class StepInputs:
    """One step's model inputs. The tensors are views of the InputBatch's persistent
    buffers: valid until the next ``prepare``."""

    req_ids: list[str]  # in the scheduler's order
    rows: np.ndarray  # [B] int64, each request's row in the InputBatch
    num_scheduled: np.ndarray  # [B] int32, query tokens per request
    # The tensors below are on the model's device; these three are their host copies.
    positions_cpu: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot of each token's K/V
    # Attention's rows, B of them: the requests, or each token when proposals go as decode
    # rows (``prepare``'s drafts_as_decode_rows).
    query_start_loc: torch.Tensor  # [B+1] int32, first token of each row (and T)
    seq_lens: torch.Tensor  # [B] int32, context including this step's tokens
    # [B, blocks of the longest sequence] int32: the blocks each context fills, then 0.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Requests that reach their last known token this step, so sample: their index in the
    # step (into req_ids / rows) and the row of their last token in the batch.
    sampling: np.ndarray  # [S] int64
    logits_indices: torch.Tensor  # [S] int64; with proposals, [sum of num_logits]
    # Speculative decoding: each sampling request's logits rows, its proposals' and its
    # last known token's, in order (None: one each, the step has no proposals).
    num_logits: np.ndarray | None = None
    # Async scheduling: (token index in the step, row of InFlightTokens.sampled) of the
    # inputs still in flight, on the device; None when there are none.
    in_flight_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    # Async scheduling's steady decode: the inputs are exactly InFlightTokens.sampled.
    in_flight_all: bool = False
    # The decode graph's size whose static inputs hold this step's (``prepare``'s graph);
    # None: the step's tensors are its own.
    graph_size: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_attn_rows(self) -> int:
        return self.seq_lens.shape[0]
