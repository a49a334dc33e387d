"""Forwards the worker runs at start-up on tokens of its own: the memory profile's dummy step
(``Worker.profile_run``) and int8k_int8v's key calibration. Each runs the model over a
temporary KV cache (and state cache) just large enough, bound to the layers meanwhile."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from minivllm.attention.backend import CommonAttentionMetadata
from minivllm.attention.kv_smoothing import CALIBRATION_TOKENS, calibration_ids
from minivllm.model.layers.state_cache import StateCache
from minivllm.model.models.llama import IntermediateTensors

if TYPE_CHECKING:
    from minivllm.worker.worker import Worker

logger = logging.getLogger(__name__)


def dummy_forward(
    worker: Worker, seq_lens: torch.Tensor, input_ids: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A forward of dummy prompts, each from position 0 (seq_lens [R] int32 tokens,
    input_ids their tokens, flat), over a temporary KV cache just large enough (and state
    cache: a slot each), bound meanwhile; the layers get back what they had. Returns the
    hidden states and the temporary caches' tensors (held, they count in a memory peak)."""
    block_size = worker.config.cache_config.block_size
    device = worker.platform.device
    num_reqs, num_tokens = seq_lens.numel(), int(seq_lens.sum())
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = seq_lens.cumsum(0)
    # Each prompt starts at position 0 and owns consecutive blocks from first_block.
    blocks = -(-seq_lens // block_size)
    first_block = blocks.cumsum(0) - blocks
    cols = torch.arange(int(blocks.max()), dtype=torch.int32)
    block_table = torch.where(cols < blocks[:, None], first_block[:, None] + cols, 0)
    owner = torch.repeat_interleave(torch.arange(num_reqs), seq_lens)
    positions = torch.arange(num_tokens) - query_start_loc[owner]
    slot_mapping = first_block[owner].long() * block_size + positions
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens.to(device),
        block_table=block_table.to(torch.int32).to(device),
        slot_mapping=slot_mapping.to(device),
        num_actual_tokens=num_tokens,
        max_query_len=int(seq_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    model = worker.model
    layers = model.attention_layers()
    bound = [attn.kv_cache for attn in layers]
    state_layers = worker.state_layers()
    bound_states = [layer.binding for layer in state_layers]
    try:
        caches = worker.bind_kv_caches(int(blocks.sum()))
        if state_layers:  # a slot each, new
            states = StateCache(state_layers, num_reqs, num_reqs, device)
            states.begin_step(
                list(range(num_reqs)),
                [True] * num_reqs,
                common.query_start_loc,
                query_start_loc,
                common.max_query_len,
            )
            caches += [t for layer in state_layers for t in layer.states]
        stage = {}
        if not worker.pp.is_first:  # a stage measures alone: zeros for the stage before's
            width = worker.model_config.hf_config.hidden_size
            zeros = torch.zeros(num_tokens, width, dtype=worker.dtype, device=device)
            stage = {"intermediate": IntermediateTensors(zeros, zeros.clone())}
        hidden = model(
            input_ids, positions.to(device), worker.attn_backend.build_metadata(common), **stage
        )
    finally:
        for attn, cache in zip(layers, bound):
            attn.kv_cache = cache
        for layer, binding in zip(state_layers, bound_states):
            layer.bind(*binding)
    return hidden, caches


@torch.inference_mode()
def calibrate_key_factors(worker: Worker) -> None:
    """int8k_int8v: each attention layer's per-channel key factors (kv_smoothing.py), from
    one forward of seeded random token ids over a temporary cache. Every tensor-parallel
    rank runs it together (its own KV heads' factors)."""
    layers = worker.model.attention_layers()
    if not worker.attn_backend.kv_format.smooth_keys or not layers:
        return
    device = worker.platform.device
    # The same ids whatever the engine's limits (a step's or a request's): the factors, and
    # so a cache's bytes, depend on the model alone.
    longest = getattr(worker.model_config.hf_config, "max_position_embeddings", None)
    n = min(CALIBRATION_TOKENS, longest or CALIBRATION_TOKENS)
    ids = calibration_ids(worker.model_config.vocab_size, n).to(device)
    for attn in layers:
        attn.begin_key_calibration()
    dummy_forward(worker, torch.tensor([n], dtype=torch.int32), ids)
    for attn in layers:
        attn.end_key_calibration(worker.dtype, device)
    # (cat: layers may differ in heads and head size, Gemma 4's global and local ones)
    factors = torch.cat([attn.key_factors.flatten() for attn in layers])
    logger.info(
        "int8k_int8v: key channels calibrated on %d random tokens: %d of %d divided (by up "
        "to %d) before the int8 rounding, the queries multiplied by the same.",
        n,
        int((factors > 1).sum()),
        factors.numel(),
        int(factors.max()),
    )
