"""LoRA in the runner's step: each step tells the adapters' manager which adapter each
request's rows take, and how the forward may run with them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minivllm.worker.step import CachedRequestState, RunnerStep, StepFeature

if TYPE_CHECKING:
    from minivllm.lora.model_manager import LoRAModelManager


class LoRAStep(StepFeature):
    """CUDA graphs are captured without adapters, and the fast prefill drops rows that the
    adapters' row mapping counts: a step with adapters takes neither. A CPU graph captured
    with one adapter's slot serves the steps whose rows all take that slot (the slot is
    the graph's variant); a step of several adapters runs eagerly."""

    def __init__(self, manager: LoRAModelManager, requests: dict[str, CachedRequestState]):
        self.manager = manager
        self.requests = requests

    def prepare(self, step: RunnerStep) -> None:
        requests = self.requests
        self.manager.set_batch([requests[r].lora_request for r in step.req_ids], step.num_scheduled)
        groups = self.manager.batch.groups
        if not groups:
            return
        if len(groups) > 1 or groups[0][1] is not None:
            step.eager = True
        else:
            step.graph_variant = groups[0][0]
