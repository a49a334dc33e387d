"""The step's grammar bitmask, matched to the sampler's rows."""

from __future__ import annotations

import torch

from minivllm.core.sched_output import SchedulerOutput


def grammar_rows(
    so: SchedulerOutput, sampling_req_ids: list[str]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sampler rows, their bitmask rows) for the constrained requests sampling this step.

    Waits for the bitmask when it is still being filled (it was started when the step was
    scheduled, so it ran alongside the forward pass)."""
    bitmask = so.grammar_bitmask
    if bitmask is None:
        return None
    if hasattr(bitmask, "result"):
        bitmask = bitmask.result()
    index = so.structured_output_request_ids
    rows = [i for i, req_id in enumerate(sampling_req_ids) if req_id in index]
    if not rows:
        return None
    mask_rows = [index[sampling_req_ids[i]] for i in rows]
    if mask_rows != list(range(len(bitmask))):  # (usually the same order: no copy then)
        bitmask = bitmask[mask_rows]
    return torch.tensor(rows, dtype=torch.long), bitmask
