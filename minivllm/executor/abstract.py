"""The executor runs workers; the engine core talks only to this interface."""

from __future__ import annotations

from minivllm.config import VllmConfig
from minivllm.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor:
    def __init__(self, config: VllmConfig) -> None:
        self.config = config

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        pass
