"""RayExecutor: one Ray actor per rank (tensor-parallel ranks times pipeline stages), on
one machine or several.

Ray is an optional extra (``pip install minivllm[ray]``). The executor joins the cluster
named by ``RAY_ADDRESS`` (what ``ray start --head`` prints; or the one this process
already joined) or, when none is named, starts a local one on the loopback address and
stops it at shutdown. Each actor runs the same worker loop as a worker process and reads
the same ZeroMQ broadcast, over TCP: on the loopback address when every actor shares the
engine's machine, on the engine node's address otherwise. Actors need one CPU each (one
GPU each on CUDA), reserved together in a placement group (one bundle per rank, packed:
a node's resources are filled before the next node's, so a pipeline's stages spread over
nodes when one cannot hold them all); rank r runs in bundle r. A monitor thread waits on
the actors' loops: when one fails (the actor died, or its node was lost), the others are
killed and the engine is told. Actors belong to this driver, so Ray also ends them if the
engine's process dies. Each worker reads the model from the same path or hub name, which
every node must reach.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from minivllm.distributed.parallel_state import get_open_port
from minivllm.executor.abstract import WorkerDiedError
from minivllm.executor.broadcast import STARTUP_TIMEOUT_S, BroadcastExecutor
from minivllm.executor.message_queue import ExecutorChannels
from minivllm.executor.worker_proc import run_worker_loop
from minivllm.platforms import get_platform

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 5.0
_PLACEMENT_TIMEOUT_S = 60.0
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'minivllm[ray]'"
        ) from exc
    return ray


def _import_ray_for_local_cluster():
    """Import Ray so that a cluster it starts stays on the loopback address.

    Ray puts even a one-machine cluster on the machine's network address; with its
    "no multi-node clusters" switch (read once, at import) it uses 127.0.0.1.
    """
    if "ray" in sys.modules:
        return import_ray()
    saved = os.environ.get(_LOOPBACK_SWITCH)
    os.environ[_LOOPBACK_SWITCH] = "0"
    try:
        return import_ray()
    finally:
        if saved is None:
            os.environ.pop(_LOOPBACK_SWITCH, None)
        else:
            os.environ[_LOOPBACK_SWITCH] = saved


def connect_ray(num_cpus: int) -> tuple[Any, bool]:
    """Ray, joined to the cluster RAY_ADDRESS names (or the one this process joined), or
    to a local one started now with at least ``num_cpus`` CPUs; and whether this call
    started it (then the caller shuts Ray down when done)."""
    address = os.environ.get("RAY_ADDRESS")
    ray = import_ray() if address else _import_ray_for_local_cluster()
    if ray.is_initialized():
        return ray, False
    if address:
        ray.init(address=address)
    else:
        ray.init(
            address="local", include_dashboard=False, num_cpus=max(num_cpus, os.cpu_count() or 1)
        )
    return ray, True


class RayWorkerActor:
    """The body of a worker actor (made a Ray actor class at run time: Ray is optional)."""

    def node_info(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        return get_open_port(host)

    def run(self, threads: int, **kwargs) -> None:
        import torch

        torch.set_num_threads(threads)
        run_worker_loop(**kwargs)


class RayExecutor(BroadcastExecutor):
    def _start_workers(self) -> None:
        self._owns_ray = False
        self.actors: list = []
        self._loop_refs: list = []
        self._placement_group = None
        ray, self._owns_ray = connect_ray(self.world_size)
        platform = get_platform(self.config.device)
        resource, need = platform.ray_device_key, platform.ray_actor_options()
        available = ray.cluster_resources().get(resource, 0)
        if available < self.world_size:
            raise ValueError(
                f"The Ray cluster has {available:g} {resource}s; {self.world_size} workers "
                "(tensor_parallel_size x pipeline_parallel_size) need one each."
            )
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        self._placement_group = group
        if not group.wait(_PLACEMENT_TIMEOUT_S):
            raise TimeoutError(
                f"Ray could not place {self.world_size} workers of one {resource} each in "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s (resources taken by others?)."
            )
        actor_cls = ray.remote(**need)(RayWorkerActor)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank
                )
            ).remote()
            for rank in range(self.world_size)
        ]
        infos = ray.get([a.node_info.remote() for a in self.actors], timeout=STARTUP_TIMEOUT_S)
        driver_node = ray.get_runtime_context().get_node_id()
        one_node = all(node == driver_node for node, _ in infos)
        host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        rank0_host = "127.0.0.1" if one_node else infos[0][1]
        port = ray.get(self.actors[0].free_port.remote(rank0_host))
        self.channels = ExecutorChannels(host=host)
        # On the engine's machine the ranks share its cores; elsewhere Ray's one CPU each.
        threads = max(1, len(os.sched_getaffinity(0)) // self.world_size) if one_node else 1
        self._loop_refs = [
            actor.run.remote(
                threads=threads,
                config=self.config,
                rank=rank,
                distributed_init_method=f"tcp://{rank0_host}:{port}",
                broadcast_address=self.channels.broadcast_address,
                reply_address=self.channels.reply_address,
            )
            for rank, actor in enumerate(self.actors)
        ]

    def _workers_alive(self) -> bool:
        ray = import_ray()
        done, _ = ray.wait(self._loop_refs, num_returns=1, timeout=0)
        return not done

    def _start_monitor(self) -> None:
        threading.Thread(target=self._monitor, name="RayWorkerMonitor", daemon=True).start()

    def _monitor(self) -> None:
        ray = import_ray()
        try:
            done, _ = ray.wait(self._loop_refs, num_returns=1)
        except Exception:  # Ray was shut down under us
            return
        if self._closing:
            return
        rank = self._loop_refs.index(done[0])
        try:
            ray.get(done[0])
            cause = "its loop returned"
        except Exception as exc:  # RayActorError: the actor died
            cause = f"{type(exc).__name__}: {exc}"
        pid = self.worker_pids[rank]
        self._on_worker_failure(
            WorkerDiedError(f"Ray worker rank {rank} (pid {pid}) ended: {cause}")
        )

    def _stop_workers(self, graceful: bool) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            return
        if graceful and self._loop_refs:
            ray.wait(self._loop_refs, num_returns=len(self._loop_refs), timeout=_SHUTDOWN_GRACE_S)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.debug("ray.kill failed", exc_info=True)
        if getattr(self, "_placement_group", None) is not None:
            try:
                ray.util.remove_placement_group(self._placement_group)
            except Exception:
                logger.debug("remove_placement_group failed", exc_info=True)
            self._placement_group = None

    def shutdown(self) -> None:
        super().shutdown()
        if getattr(self, "_owns_ray", False):
            self._owns_ray = False
            import_ray().shutdown()
