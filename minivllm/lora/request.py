"""LoRARequest: which adapter a request runs with, as vLLM's."""

from __future__ import annotations

import os

import msgspec

from minivllm.sampling_params import INT64_MAX, is_int


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True, frozen=True):
    """A PEFT adapter folder (adapter_config.json and adapter_model.safetensors), named by a
    positive id unique to it: the id keys the engine's loaded copy and its prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the server's: the model the adapter was made for

    def __post_init__(self) -> None:
        # Typed as the engine core decodes it (a field of another type killed the core).
        if not is_int(self.lora_int_id) or not 1 <= self.lora_int_id <= INT64_MAX:
            raise ValueError(f"lora_int_id must be > 0 (64-bit), got {self.lora_int_id!r}.")
        if not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name must be a string, got {self.lora_name!r}.")
        if isinstance(self.lora_path, os.PathLike):  # a pathlib.Path, as users pass one
            msgspec.structs.force_setattr(self, "lora_path", os.fspath(self.lora_path))
        if not self.lora_path or not isinstance(self.lora_path, str):
            raise ValueError("lora_path must name the adapter's folder.")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string, got {self.base_model_name!r}.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
