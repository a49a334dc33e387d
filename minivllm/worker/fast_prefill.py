"""vLLM's kv_sharing_fast_prefill: in a prompt step, the layers that read earlier layers'
K/V compute only the rows whose logits are sampled."""

from __future__ import annotations

import torch

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.worker.step_inputs import StepInputs


def fast_prefill_inputs(
    step: StepInputs, attn_backend: AttentionBackend, device: torch.device
) -> tuple[torch.Tensor, object]:
    """(rows, metadata) for the layers that read earlier layers' K/V: the rows whose
    logits are sampled (the last of each request that samples) and the attention
    metadata of those rows alone, a decode step's (one query each, at the end of its
    context); no other row's output is read, and those layers write no K/V of their
    own."""
    count = len(step.sampling)
    if count == 0:
        return step.logits_indices, None
    requests = torch.from_numpy(step.sampling)
    query_start_loc = torch.arange(count + 1, dtype=torch.int32)
    seq_lens_cpu = step.seq_lens_cpu[requests]
    on_device = requests.to(device)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(device),
        seq_lens=step.seq_lens[on_device],
        block_table=step.block_table[on_device],
        slot_mapping=step.slot_mapping[step.logits_indices],
        num_actual_tokens=count,
        max_query_len=1,
        max_seq_len=int(seq_lens_cpu.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_cpu,
    )
    return step.logits_indices, attn_backend.build_metadata(common)
