"""Data parallelism's client: one engine core process per replica (each with its own
scheduler and KV cache; on Ray an actor, possibly on another node: dp_ray.py) behind the
one interface the frontends use.

Each replica is an ``MPClient`` whose outputs pass through a ``_ReplicaSink`` into the one
sink LLMEngine or AsyncLLM reads. On the way a batch is tagged with its replica
(``EngineCoreOutputs.engine_index``, for the metrics' ``engine`` label) and tells the
balancer which requests finished and the replica's KV cache use. A request goes where
``DPBalancer.pick`` says and stays there (its aborts follow it). A replica that dies fails
its own requests at once (an "error" finish each) and takes no more; the others go on,
and the client is dead only when every replica is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

from minivllm import envs
from minivllm.config import VllmConfig
from minivllm.core.kv_cache_utils import HASH_FUNCTIONS
from minivllm.engine.core_client import (
    EngineCoreClient,
    MPClient,
    _as_value_error,
    _AsyncioSink,
    _QueueSink,
)
from minivllm.engine.dp_balancer import DPBalancer
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from minivllm.metrics.stats import merge_scheduler_stats

logger = logging.getLogger(__name__)


def replica_config(config: VllmConfig, index: int) -> VllmConfig:
    """The config of replica ``index`` (it places its CPU threads by it)."""
    parallel = dataclasses.replace(config.parallel_config, data_parallel_rank=index)
    return dataclasses.replace(config, parallel_config=parallel)


class _ReplicaSink:
    """Where one replica's supervisor puts its outputs (and the error that ends them)."""

    def __init__(self, client: DPClient, index: int) -> None:
        self.client = client
        self.index = index

    def put(self, item: EngineCoreOutputs | BaseException) -> None:
        self.client._on_replica_item(self.index, item)


class DPClient(EngineCoreClient):
    def __init__(
        self,
        vllm_config: VllmConfig | None,
        world_size: int,
        num_replicas: int,
        asyncio_mode: bool,
        on_ray: bool = False,
        device: str = "auto",
    ) -> None:
        """vllm_config None: the replicas' processes start now and import the engine while
        the caller builds the config; ``configure`` sends it. on_ray: each replica is a
        Ray actor on ``device``, spread over the cluster's nodes (dp_ray.py), not a process
        of this machine."""
        self._sink = _AsyncioSink() if asyncio_mode else _QueueSink()
        self._lock = threading.Lock()
        self.balancer: DPBalancer | None = None  # once the replicas are ready
        self._owner: dict[str, int] = {}  # request id -> its replica
        self._closed = False
        self.replicas: list[MPClient] = []
        self.ray_replicas = None  # the replicas' actors, on_ray
        try:
            if on_ray:
                from minivllm.engine.dp_ray import RayReplicaGroup

                self.ray_replicas = RayReplicaGroup(num_replicas, world_size, device)
            for i in range(num_replicas):
                sink = _ReplicaSink(self, i)
                self.replicas.append(
                    MPClient(None, sink, world_size, self._supervisor(sink, i, world_size))
                )
            if vllm_config is not None:
                self.configure(vllm_config)
        except BaseException:
            self.shutdown()
            raise

    def _supervisor(self, sink: _ReplicaSink, index: int, world_size: int):
        """Replica ``index``'s Ray actor supervisor; None for a local process."""
        if self.ray_replicas is None:
            return None
        from minivllm.engine.dp_ray import RayEngineCoreSupervisor

        return RayEngineCoreSupervisor(sink, world_size, self.ray_replicas, index)

    def configure(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        for i, replica in enumerate(self.replicas):
            replica.configure(replica_config(vllm_config, i))

    def wait_for_ready(self) -> None:
        if self.balancer is not None:
            return
        try:
            for replica in self.replicas:
                replica.wait_for_ready()
        except BaseException:
            self.shutdown()
            raise
        first = self.replicas[0]
        self.num_blocks = first.num_blocks
        self.weight_memory_bytes = first.weight_memory_bytes
        self.step_time_model = first.step_time_model
        cache = self.vllm_config.cache_config
        policy = envs.MINIVLLM_DP_LOAD_BALANCING
        if policy == "prefix" and not cache.enable_prefix_caching:
            policy = "least_loaded"
        self.balancer = DPBalancer(
            [r.num_blocks for r in self.replicas],
            cache.block_size,
            HASH_FUNCTIONS[cache.prefix_caching_hash_algo],
            policy,
        )
        logger.info(
            "%d engine cores (data parallel), %s load balancing", len(self.replicas), policy
        )

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        with self._lock:
            try:
                index = self.balancer.pick(request)
            except RuntimeError:
                raise self.dead_error() from None
            self._owner[request.request_id] = index
        try:
            self.replicas[index].add_request(request)
        except EngineDeadError:
            pass  # the replica died meanwhile: its death fails the request

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                index = self._owner.pop(request_id, None)
                if index is not None:
                    self.balancer.finished(index, request_id)
                    by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].abort_requests(ids)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    # ------------------------------------------------------------------ outputs

    def _on_replica_item(self, index: int, item: EngineCoreOutputs | BaseException) -> None:
        """From replica ``index``'s output thread (or its shutdown)."""
        if isinstance(item, EngineCoreOutputs):
            item.engine_index = index
            with self._lock:
                if self.balancer is not None:
                    self.balancer.observe(index, item.scheduler_stats)
                    for out in item.outputs:
                        if out.finish_reason is not None:
                            self._owner.pop(out.request_id, None)
                            self.balancer.finished(index, out.request_id)
            self._sink.put(item)
            return
        with self._lock:
            failed = None
            if self._closed or self.balancer is None:  # shut down, or died starting
                all_dead = True
            else:
                if self.balancer.replicas[index].alive:
                    failed = self.balancer.fail(index)
                    for request_id in failed:
                        self._owner.pop(request_id, None)
                all_dead = not self.balancer.alive()
        if failed is not None:
            logger.error(
                "Engine core %d died; its %d request(s) fail, %d engine core(s) go on",
                index,
                len(failed),
                len(self.balancer.alive()),
            )
            errors = [
                EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ERROR)
                for r in sorted(failed)
            ]
            self._sink.put(EngineCoreOutputs(outputs=errors, engine_index=index))
        if all_dead:
            self._sink.put(item)

    def get_output(self) -> EngineCoreOutputs:
        self._check_alive()
        item = self._sink.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def get_output_async(self) -> EngineCoreOutputs:
        q = self._sink.get_queue()
        self._check_alive()
        item = await q.get()
        if isinstance(item, BaseException):
            raise item
        return item

    # ------------------------------------------------------------------ state

    def _alive(self) -> list[MPClient]:
        alive = [r for r in self.replicas if not r.is_dead()]
        if self.balancer is None:
            return alive
        return [r for r in alive if self.balancer.replicas[self.replicas.index(r)].alive]

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("The engine was shut down.")
        if self.is_dead():
            raise self.dead_error()

    def is_dead(self) -> bool:
        return not self._alive()

    def is_closed(self) -> bool:
        return self._closed

    def dead_engines(self) -> list[int]:
        """The replicas that died (the others serve on)."""
        if self.balancer is None:
            return []
        return [r.index for r in self.balancer.replicas if not r.alive]

    def dead_error(self) -> EngineDeadError:
        for replica in self.replicas:
            if replica.is_dead():
                return replica.dead_error()
        return EngineDeadError()

    @property
    def engine_pid(self) -> int | None:
        return self.replicas[0].engine_pid

    @property
    def engine_pids(self) -> list[int | None]:
        """Each replica's process id (on its own node)."""
        return [r.engine_pid for r in self.replicas]

    @property
    def engine_nodes(self) -> list[str] | None:
        """The Ray node of each replica; None for local processes."""
        if self.ray_replicas is None:
            return None
        return list(self.ray_replicas.node_ids)

    # ------------------------------------------------------------------ utilities

    def _futures(self, method: str, *args) -> list:
        return [r._start_call(method, *args) for r in self._alive()]

    def call_utility(self, method: str, *args) -> list:
        """The method's result from every live replica."""
        return [f.result() for f in self._futures(method, *args)]

    async def call_utility_async(self, method: str, *args) -> list:
        futures = [asyncio.wrap_future(f) for f in self._futures(method, *args)]
        return list(await asyncio.gather(*futures))

    def get_engine_stats(self) -> list[SchedulerStats | None]:
        """Each replica's statistics (None for one that died)."""
        alive = {id(r) for r in self._alive()}
        futures = {
            i: r._start_call("get_stats") for i, r in enumerate(self.replicas) if id(r) in alive
        }
        return [futures[i].result() if i in futures else None for i in range(len(self.replicas))]

    async def get_engine_stats_async(self) -> list[SchedulerStats | None]:
        alive = {id(r) for r in self._alive()}
        futures = {
            i: asyncio.wrap_future(r._start_call("get_stats"))
            for i, r in enumerate(self.replicas)
            if id(r) in alive
        }
        results = dict(zip(futures, await asyncio.gather(*futures.values())))
        return [results.get(i) for i in range(len(self.replicas))]

    def get_stats(self) -> SchedulerStats:
        return merge_scheduler_stats(self.get_engine_stats())

    async def get_stats_async(self) -> SchedulerStats:
        return merge_scheduler_stats(await self.get_engine_stats_async())

    def reset_prefix_cache(self) -> bool:
        return all(self.call_utility("reset_prefix_cache"))

    async def reset_prefix_cache_async(self) -> bool:
        return all(await self.call_utility_async("reset_prefix_cache"))

    def add_lora(self, lora_request) -> bool:
        return all(r.add_lora(lora_request) for r in self._alive())

    async def add_lora_async(self, lora_request) -> bool:
        try:
            return all(await self.call_utility_async("add_lora", lora_request))
        except RuntimeError as exc:
            raise _as_value_error(exc) from None

    def profile(self, is_start: bool = True) -> None:
        self.call_utility("profile", is_start)

    async def profile_async(self, is_start: bool = True) -> None:
        await self.call_utility_async("profile", is_start)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        for replica in self.replicas:
            replica.shutdown()
        if self.ray_replicas is not None:
            self.ray_replicas.shutdown()  # the placement group, and Ray if it started it
