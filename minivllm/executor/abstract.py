"""The executor runs workers; the engine core talks only to this interface.

Three implementations, chosen by ``ParallelConfig.distributed_executor_backend``:
``UniProcExecutor`` (one worker in this process), ``MultiprocExecutor`` (one process per
rank: tensor-parallel ranks times pipeline stages) and ``RayExecutor`` (one Ray actor per
rank). With pipeline stages, ``max_concurrent_batches`` steps may be in flight at once
(``execute_model(..., non_block=True)``): the engine core's batch queue keeps every
stage busy.
"""

from __future__ import annotations

from collections.abc import Callable

from minivllm import envs
from minivllm.config import VllmConfig
from minivllm.core.sched_output import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput

FailureCallback = Callable[[BaseException], None]


class WorkerDiedError(RuntimeError):
    """A worker process or actor ended, or failed, while the engine needed it."""


class StepFuture:
    """A step's output to come: ``result()`` waits for it (or raises the step's error)."""

    def __init__(self, wait: Callable[[], ModelRunnerOutput]) -> None:
        self._wait: Callable[[], ModelRunnerOutput] | None = wait
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> StepFuture:
        return cls(lambda: output)

    def result(self) -> ModelRunnerOutput:
        if self._wait is not None:
            wait, self._wait = self._wait, None
            self._output = wait()
        return self._output


class Executor:
    """Safety rules: calls come from one thread (the engine core's); every worker gets
    every call, in the same order; once a worker has failed, every call raises."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self._failure_callbacks: list[FailureCallback] = []

    @staticmethod
    def get_class(config: VllmConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from minivllm.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from minivllm.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from minivllm.executor.ray_executor import RayExecutor

            return RayExecutor
        raise ValueError(f"Unknown distributed_executor_backend {backend!r}.")

    def collective_rpc(
        self, method: str, args: tuple = (), unique_reply_rank: int | None = None
    ) -> list:
        """Call ``method(*args)`` on every worker; the results in rank order (only
        ``unique_reply_rank``'s when given)."""
        raise NotImplementedError

    def determine_available_memory(self) -> list[int]:
        """Bytes each worker can give its KV cache, in rank order."""
        return self.collective_rpc("determine_available_memory")

    def determine_num_blocks(self) -> int:
        """KV cache blocks every worker can hold (each holds its share of the KV heads)."""
        return min(self.collective_rpc("determine_num_blocks"))

    def get_num_state_slots(self) -> int:
        """State cache slots every worker holds (a hybrid model's; after determine_num_blocks)."""
        return min(self.collective_rpc("get_num_state_slots"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    # In-process executors take the grammar bitmask as a Future, so that filling it
    # overlaps the forward pass; the others need the tensor itself to send it.
    passes_futures = False

    @property
    def max_concurrent_batches(self) -> int:
        """Steps that may be in flight at once: one per pipeline stage, and
        MINIVLLM_PP_EXTRA_BATCHES more (one while MINIVLLM_PP_BATCH_QUEUE is off, to measure
        what the queue gains). An extra batch is work for the first stage while the oldest
        batch goes through the later stages and the engine core turns it around; on 2 cores
        it gained nothing (the stages' idle came from uneven steps: README, pipeline
        parallelism)."""
        if not envs.MINIVLLM_PP_BATCH_QUEUE:
            return 1
        pp = self.config.parallel_config.pipeline_parallel_size
        return pp + envs.MINIVLLM_PP_EXTRA_BATCHES if pp > 1 else 1

    @property
    def output_rank(self) -> int:
        """The rank that answers a step: the last stage's first tensor-parallel rank."""
        return self.config.parallel_config.world_size - (
            self.config.parallel_config.tensor_parallel_size
        )

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | StepFuture:
        """The step's output; with async scheduling, a handle whose get_output() waits;
        non_block: a StepFuture at once, the step running meanwhile (the batch queue)."""
        bitmask = scheduler_output.grammar_bitmask
        if not self.passes_futures and bitmask is not None and hasattr(bitmask, "result"):
            scheduler_output.grammar_bitmask = bitmask.result()
        if non_block:
            return self.execute_model_async(scheduler_output)
        rank = self.output_rank
        return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=rank)[0]

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """The step sent to the workers, its output to come (in process: run now)."""
        return StepFuture.done(self.execute_model(scheduler_output))

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """``callback(cause)`` runs (in another thread) when a worker dies between calls."""
        self._failure_callbacks.append(callback)

    def shutdown(self) -> None:
        pass
