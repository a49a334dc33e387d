"""The state cache beside the paged KV cache: layers that keep a fixed-size state per
request (a causal convolution's last inputs, a recurrent/SSM state) instead of K/V.

How a layer declares and uses its state (LFM2's short convolution, Mamba-2, Gated DeltaNet):

1. Subclass ``StateLayer`` and return from ``state_shapes()`` one ``StateShape`` per tensor
   of one request's state, e.g. a conv state ``StateShape((conv_dim, kernel - 1), dtype)``
   and an SSM state ``StateShape((heads, head_dim, state_size), torch.float32)``; shapes are
   this rank's (after tensor-parallel splitting). The model lists these layers in
   ``state_layers()`` (as it lists its ``Attention`` layers in ``attention_layers()``).
2. The worker sizes the cache from one budget with the KV blocks (``KVCacheSpec`` in
   core/kv_cache_utils.py: at most max_num_seqs slots, the rest blocks), then binds a
   ``StateCache``: ``layer.states[i]`` is a tensor ``[num_slots + 1, *shapes[i].shape]``.
   The last slot is a scratch slot for padded rows (CUDA graphs): never a request's.
3. Each step, before the forward, the runner calls ``StateCache.begin_step`` with each
   request's slot (the scheduler's KV cache manager hands one to a request while it runs)
   and whether it starts from position 0; those slots are zeroed then, so a layer never
   needs to ask whether a state is new: it always reads the state, and writes it back
   in place.
4. In its forward a layer reads ``self.step`` (a ``StateStep``): request i's tokens are
   rows ``[query_start_loc[i], query_start_loc[i + 1])`` of the flat batch (as for
   attention) and its state is ``states[j][slots[i]]``. A chunk of a prompt starts from
   the state its previous chunk left, so chunked prefill is exact. In a decode step
   (``max_query_len == 1``) row i is request i; ``decode_slots(num_rows)`` gives the slots
   of that many rows, padded rows pointing at the scratch slot. It is a view of a buffer
   that every step rewrites in place, so a captured step (CPU or CUDA graph) that passed
   its address reads each later step's slots: kernels must take slots by pointer, and
   update the state in place.

Preemption frees the slot: the request is recomputed from position 0, its state zeroed
again. Prefix caching is off for a model with state layers (its state at the end of a
cached prefix is not kept); speculative decoding too (a rejected proposal's tokens would
already be in the state).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from minivllm.platforms import get_platform


@dataclass(frozen=True)
class StateShape:
    """One tensor of a request's state: its shape (one slot's) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class StateStep:
    """The step's state metadata, the same object for every state layer."""

    slots: torch.Tensor  # [B] int64 on the model's device: each request's slot, batch order
    query_start_loc: torch.Tensor  # [B + 1] int32 on the device
    query_start_loc_cpu: torch.Tensor  # its host copy
    max_query_len: int

    @property
    def num_reqs(self) -> int:
        return self.slots.shape[0]


class StateLayer(nn.Module):
    """A layer that keeps a fixed-size state per request (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[torch.Tensor] = []  # bound by the worker after sizing
        self._cache: tuple[StateCache, ...] = ()  # a tuple: not a child module

    def state_shapes(self) -> list[StateShape]:
        raise NotImplementedError

    @property
    def binding(self) -> tuple[list[torch.Tensor], tuple[StateCache, ...]]:
        """The state tensors and cache the layer is bound to: what ``bind`` takes back."""
        return self.states, self._cache

    def bind(self, states: list[torch.Tensor], cache: tuple[StateCache, ...]) -> None:
        self.states, self._cache = states, cache

    @property
    def step(self) -> StateStep:
        return self._cache[0].step

    def decode_slots(self, num_rows: int) -> torch.Tensor:
        """[num_rows] int64: the slots of a decode step's rows (padding: the scratch slot)."""
        return self._cache[0].slot_buffer[:num_rows]


def state_bytes_per_slot(layers: list[StateLayer]) -> int:
    """The bytes one request's state takes in all these layers."""
    return sum(s.nbytes for layer in layers for s in layer.state_shapes())


class StateCache:
    """Every state layer's tensors of num_slots slots (and the scratch slot), and the step's
    metadata the layers read."""

    def __init__(self, layers: list[StateLayer], num_slots: int, max_num_reqs: int, device) -> None:
        self.layers = layers
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.device = torch.device(device)
        platform = get_platform(self.device.type)
        for layer in layers:
            # Huge pages on the host: a decode step streams each running request's state.
            states = [
                platform.zeros((num_slots + 1, *s.shape), s.dtype, huge_pages=True)
                for s in layer.state_shapes()
            ]
            layer.bind(states, (self,))
        # Rewritten in place each step (see decode_slots); rows past the batch: scratch.
        self.slot_buffer = torch.full(
            (max(max_num_reqs, 1),), self.scratch_slot, dtype=torch.int64, device=self.device
        )
        self._host_slots = np.full(self.slot_buffer.shape[0], self.scratch_slot, np.int64)
        # Until the first step: a decode step of every row (what a CUDA graph's capture sees).
        rows = torch.arange(self.slot_buffer.shape[0] + 1, dtype=torch.int32)
        self.step = StateStep(self.slot_buffer, rows.to(self.device), rows, 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.states)

    def begin_step(
        self,
        slots: list[int],
        starts_new: np.ndarray,
        query_start_loc: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        max_query_len: int,
    ) -> None:
        """Set the step's metadata: slots[i] is the i-th request's slot, starts_new[i]
        whether it starts at position 0 this step (its state is zeroed now)."""
        n = len(slots)
        host = self._host_slots
        host[:n] = slots
        host[n:] = self.scratch_slot
        self.slot_buffer.copy_(torch.from_numpy(host))
        new = host[:n][np.asarray(starts_new, dtype=bool)]
        if new.size:
            index = torch.from_numpy(new).to(self.device)
            for layer in self.layers:
                for state in layer.states:
                    state.index_fill_(0, index, 0)
        self.step = StateStep(
            slots=self.slot_buffer[:n],
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc_cpu,
            max_query_len=max_query_len,
        )

    def checkpoint(self):
        """A copy of this step's requests' states; returns the function that puts it back
        (a step run twice: a CPU graph's capture, then its checking replay)."""
        index = self.step.slots.clone()
        saved = [(state, state[index]) for layer in self.layers for state in layer.states]

        def restore() -> None:
            for state, copy in saved:
                state.index_copy_(0, index, copy)

        return restore

    def begin_runner_step(self, slots: list[int], step) -> None:
        """begin_step from the runner's StepInputs (one row per request)."""
        starts = step.query_start_loc_cpu[:-1].numpy()
        first_positions = step.positions_cpu.numpy()[starts] if len(starts) else starts
        self.begin_step(
            slots,
            first_positions == 0,
            step.query_start_loc,
            step.query_start_loc_cpu,
            step.max_query_len,
        )
