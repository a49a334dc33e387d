"""The adapters of a running model: their LoRA slots on every linear layer, which adapter
each slot holds, and which rows of a step each one adapts.

``add_adapter`` reads and checks an adapter when a request first names it (a bad one fails
that request alone) and keeps it on the host, up to max_cpu_loras of them (least recently
used out first). ``set_batch`` makes the step's adapters resident, max_loras slots at most
(the scheduler never mixes more in one step), filling a free or least recently used slot
for each one missing, then tells the layers which rows each slot adapts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from minivllm.config import LoRAConfig
from minivllm.lora.layers import LinearLoRA, LoRABatch
from minivllm.lora.peft import read_adapter_config, read_adapter_weights
from minivllm.lora.request import LoRARequest
from minivllm.model.layers.linear import LinearBase

logger = logging.getLogger(__name__)


class LoRAModelManager:
    def __init__(
        self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device
    ) -> None:
        self.config = config
        self.batch = LoRABatch()
        self.device = torch.device(device)
        # checkpoint projection name -> (fused module, shard id), as the model loads them
        self.packed = dict(getattr(model, "packed_modules_mapping", {}))
        self.layers: dict[str, LinearLoRA] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                module.lora = LinearLoRA(
                    module, config.max_loras, config.max_lora_rank, self.batch, dtype, device
                )
                self.layers[name] = module.lora
        # lora_int_id -> (scaling, {(layer, shard id): (A, B)}), least recently used first
        self.adapters: OrderedDict[int, tuple] = OrderedDict()
        self.slots: list[int | None] = [None] * config.max_loras  # the adapter id in each
        self.slot_order: list[int] = list(range(config.max_loras))  # least recently used first

    def add_adapter(self, request: LoRARequest) -> None:
        """Read and check the adapter unless it is loaded; a ValueError says what is wrong."""
        if request.lora_int_id in self.adapters:
            self.adapters.move_to_end(request.lora_int_id)
            return
        config = read_adapter_config(request.lora_path, self.config.max_lora_rank)
        modules = {}
        for name, (a, b) in read_adapter_weights(config).items():
            prefix, _, leaf = name.rpartition(".")
            layer_name, shard_id = name, None
            if leaf in self.packed:
                fused, shard_id = self.packed[leaf]
                layer_name = f"{prefix}.{fused}" if prefix else fused
            layer = self.layers.get(layer_name)
            if layer is None:
                raise ValueError(
                    f"The adapter's module {name!r} is not a linear layer of this model "
                    "(an adapter of another model?)."
                )
            layer.check(shard_id, a, b, name)
            modules[(layer_name, shard_id)] = (a.to(self.device), b.to(self.device))
        self.adapters[request.lora_int_id] = (config.scaling, modules)
        while len(self.adapters) > self.config.max_cpu_loras:
            evicted, _ = self.adapters.popitem(last=False)
            logger.info("LoRA adapter %d left the host's cache (max_cpu_loras).", evicted)
        logger.info("LoRA adapter %r (id %d) loaded.", request.lora_name, request.lora_int_id)

    def set_batch(self, loras: list[LoRARequest | None], counts: list[int]) -> None:
        """The step's requests' adapters (None: the base model) and their token counts, in
        the batch's order."""
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not needed:
            self.batch.groups = []
            return
        if len(needed) > len(self.slots):
            raise RuntimeError(
                f"{len(needed)} adapters in one step; max_loras is {len(self.slots)}"
            )
        for adapter_id, lora in needed.items():
            self._make_resident(adapter_id, lora, needed)
        slot_of = {adapter_id: self.slots.index(adapter_id) for adapter_id in needed}
        per_request = np.array(
            [-1 if lora is None else slot_of[lora.lora_int_id] for lora in loras], dtype=np.int64
        )
        if (per_request == per_request[0]).all():
            self.batch.groups = [(int(per_request[0]), None)]  # every row, one adapter
            return
        per_token = np.repeat(per_request, counts)
        groups = []
        for slot in slot_of.values():
            rows = np.flatnonzero(per_token == slot)
            groups.append((slot, torch.from_numpy(rows).to(self.device)))
        self.batch.groups = groups

    def _make_resident(self, adapter_id: int, lora: LoRARequest, needed: dict) -> None:
        if adapter_id in self.slots:
            slot = self.slots.index(adapter_id)
        else:
            # The least recently used slot whose adapter this step does not need.
            slot = next(s for s in self.slot_order if self.slots[s] not in needed)
            if adapter_id not in self.adapters:  # left the host's cache since its request came
                self.add_adapter(lora)
            scaling, modules = self.adapters[adapter_id]
            for layer in self.layers.values():
                layer.clear(slot)
            for (layer_name, shard_id), (a, b) in modules.items():
                self.layers[layer_name].fill(slot, shard_id, a, b, scaling)
            self.slots[slot] = adapter_id
        self.slot_order.remove(slot)
        self.slot_order.append(slot)
