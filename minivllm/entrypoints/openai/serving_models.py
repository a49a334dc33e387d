"""The names the server answers to: the model's, and the LoRA adapters served beside it."""

from __future__ import annotations

from collections.abc import Sequence

from minivllm.entrypoints.openai.errors import BadRequestError, NotFoundError
from minivllm.entrypoints.openai.protocol import ModelCard, ModelList
from minivllm.lora.request import LoRARequest


class ServedModels:
    """The names the model is served under; the first is the one responses carry."""

    def __init__(
        self,
        names: Sequence[str],
        model_path: str,
        max_model_len: int,
        lora_requests: Sequence[LoRARequest] = (),
    ) -> None:
        """lora_requests: the adapters served beside the model, each under its lora_name."""
        if not names:
            raise ValueError("at least one served model name is needed")
        self.names = list(names)
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora_requests = {lora.lora_name: lora for lora in lora_requests}
        self.last_lora_id = max((lora.lora_int_id for lora in lora_requests), default=0)
        clash = sorted(self.lora_requests.keys() & set(self.names))
        if clash:
            raise ValueError(f"LoRA module names clash with the served model's: {clash}")

    @property
    def base_name(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to answer with; NotFoundError (404) for a model this server lacks."""
        if requested is None or requested == "":
            return self.base_name
        if requested not in self.names and requested not in self.lora_requests:
            raise NotFoundError(f"The model `{requested}` does not exist.", param="model")
        return requested

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter a resolved model name picks; None: the base model."""
        return self.lora_requests.get(name)

    async def load_lora_adapter(self, engine, name: str, path: str) -> None:
        """Serve another adapter under ``name`` once the engine has read and checked it
        (BadRequestError otherwise). Ids keep growing: an id is never reused for another
        adapter, whose KV blocks and loaded copy it keys."""
        if name in self.lora_requests or name in self.names:
            raise BadRequestError(f"The lora adapter '{name}' has already been loaded.")
        self.last_lora_id += 1
        try:
            lora = LoRARequest(name, self.last_lora_id, path)
            await engine.add_lora(lora)
        except (ValueError, OSError) as exc:  # a path that is no adapter, or unreadable
            raise BadRequestError(str(exc), param="lora_path") from None
        self.lora_requests[name] = lora

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving an adapter (requests already running with it finish with it)."""
        if self.lora_requests.pop(name, None) is None:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")

    def list(self) -> ModelList:
        cards = [
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
            for name in self.names
        ]
        cards += [
            ModelCard(
                id=name,
                root=lora.lora_path,
                parent=lora.base_model_name or self.base_name,
                max_model_len=self.max_model_len,
            )
            for name, lora in self.lora_requests.items()
        ]
        return ModelList(data=cards)
