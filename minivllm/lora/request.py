"""LoRARequest: which adapter a request runs with, as vLLM's."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True, frozen=True):
    """A PEFT adapter folder (adapter_config.json and adapter_model.safetensors), named by a
    positive id unique to it: the id keys the engine's loaded copy and its prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the server's: the model the adapter was made for

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id!r}.")
        if not self.lora_path:
            raise ValueError("lora_path must name the adapter's folder.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
