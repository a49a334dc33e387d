"""One worker in this process: a call is a method call, nothing is copied or sent."""

from __future__ import annotations

from minivllm.config import VllmConfig
from minivllm.executor.abstract import Executor
from minivllm.worker.worker import Worker


class UniProcExecutor(Executor):
    passes_futures = True

    def __init__(self, config: VllmConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(
        self, method: str, args: tuple = (), unique_reply_rank: int | None = None
    ) -> list:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.shutdown()
