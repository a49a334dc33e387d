"""A model of a many-model server as its router tracks it: its status, the error a client
should retry, and what is known of it while loaded or not."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math
from types import SimpleNamespace

from minivllm.entrypoints.openai.errors import EngineUnavailableError


class ModelStatus(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    DOZING = "dozing"  # loaded without its KV cache (idle past its keep-alive)
    FAILED = "failed"  # down after too many failed starts; its error says why


class ModelBusyError(EngineUnavailableError):
    """A 503 the client should retry: its model is still loading, or its queue is full."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


@dataclasses.dataclass(eq=False)
class ServedModel:
    """One model of the catalog and, while loaded, its engine and handlers."""

    name: str
    source: str
    status: ModelStatus = ModelStatus.UNLOADED
    state: SimpleNamespace | None = None  # the app state of its handlers, while loaded
    load_task: asyncio.Task | None = None
    in_flight: int = 0  # requests holding it
    waiting: int = 0  # requests waiting for it to load
    last_used: float = 0.0
    memory_bytes: int | None = None  # weights + KV cache, as its engine reported at its load
    kv_bytes: int = 0  # its KV cache's share of memory_bytes
    dozed_at: float = 0.0
    reserved_bytes: int = 0  # what it counts against the budget while loading or loaded
    keep_alive_s: float | None = None  # an Ollama request's keep_alive; None: the server's
    failures: int = 0  # failed starts and crashes since it last served a request
    tokenizer: object = None  # its tokenizer: built at the server's start, or its first load
    model_config: object = None  # its ModelConfig, read for /api/show without a load
    error: str | None = None  # why it last failed

    @property
    def engine(self):
        return self.state.engine if self.state is not None else None

    def is_dead(self) -> bool:
        """Loaded, but its engine core has died (its next request starts it again)."""
        return self.state is not None and self.engine.errored

    def changing(self) -> bool:
        """Whether it is being loaded or woken now."""
        return self.load_task is not None and not self.load_task.done()

    def status_now(self) -> str:
        return ModelStatus.FAILED.value if self.is_dead() else self.status.value
