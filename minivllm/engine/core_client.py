"""How the frontend reaches the engine core; the transport is chosen here, not in the core."""

from __future__ import annotations

from minivllm.config import VllmConfig
from minivllm.engine.core import EngineCore
from minivllm.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class EngineCoreClient:
    """The interface every transport implements."""

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The core in this process: get_output() runs one step."""

    def __init__(self, config: VllmConfig) -> None:
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.scheduler.make_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
