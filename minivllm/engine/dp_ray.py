"""Data-parallel engine cores as Ray actors, spread over the nodes of a Ray cluster.

With ``--data-parallel-size N --distributed-executor-backend ray`` the frontend joins the
cluster ``RAY_ADDRESS`` names (or starts a local one, as the Ray executor does) and
reserves one placement-group bundle per replica, spread: Ray puts the bundles on
different nodes where it can. Each replica is an ``EngineCoreActor`` in its bundle running
the same ``EngineCoreProc`` as a local core process, connected over TCP to the sockets its
supervisor bound on this node's address (on the loopback address when every replica is
on this node). A replica's tensor-parallel or pipeline ranks are processes on its own node
(the mp executor inside the actor), so a bundle holds all of them.

``RayEngineCoreSupervisor`` is ``EngineCoreSupervisor`` with the actor in place of the
process: the actor's ``run`` ending (it returned, the actor died, or its node was lost) is
the core's death, and so is its connection dropping (ZeroMQ heartbeats on it notice a node
that vanished, long before Ray's health checks). Shutdown asks, waits, then kills the
actor. Actors belong to the frontend's process, so Ray also ends them when it dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from minivllm.config import VllmConfig
from minivllm.engine.core_proc import EXIT_CODE_REPORTED, EngineCoreProc
from minivllm.engine.core_supervisor import EngineCoreSupervisor, OutputSink
from minivllm.executor.ray_executor import connect_ray
from minivllm.platforms import get_platform
from minivllm.utils.process import set_cpu_threads

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0
_SHUTDOWN_GRACE_S = 5.0
_STARTUP_TIMEOUT_S = 120.0
# How a supervisor describes an actor that died (the run call raised, no exit code).
_ACTOR_DIED = -1
# ZeroMQ's own heartbeat on each connection from a replica: a peer whose IO thread has not
# answered for this long (its machine gone, the network cut, the process stopped) is
# disconnected, which the supervisor takes for the replica's death. Ray tells of a lost
# node only after its health checks (seconds to tens of seconds); this is within 2 s.
_HEARTBEAT_IVL_MS = 250
_HEARTBEAT_TIMEOUT_MS = 1000
_MONITOR_POLL_MS = 50
_REPORT_READ_S = 0.2


class EngineCoreActor:
    """The body of a replica's actor (made a Ray actor class at run time: Ray is optional)."""

    def node_info(self) -> tuple[str, str, int]:
        """Its node's id and address, and its process id."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def import_engine(self) -> None:
        """What building the core imports, while the frontend builds the config."""
        import minivllm.engine.core  # noqa: F401
        import minivllm.worker.worker  # noqa: F401

    def run(self, vllm_config: VllmConfig, input_address: str, output_address: str) -> int:
        """Build the core and serve until told to stop; the core's exit code."""
        parallel = vllm_config.parallel_config
        # Ray sets OMP_NUM_THREADS to the actor's reserved CPUs (unless it was set), which
        # would keep the model (here, or in its rank processes) to that many threads; the
        # node's cores are shared among the replicas on it, as on one machine.
        if os.environ.get("OMP_NUM_THREADS") == str(parallel.world_size):
            del os.environ["OMP_NUM_THREADS"]
        if parallel.world_size == 1:
            set_cpu_threads(parallel.data_parallel_rank, parallel.data_parallel_size)
        proc = EngineCoreProc(input_address, output_address, parent_pid=None, ipc_dir=None)
        return proc.run(vllm_config)


def ray_replica_config(config: VllmConfig, node_rank: int, on_node: int) -> VllmConfig:
    """A replica's config inside its actor: its model in the actor (one rank) or its ranks
    as processes of the actor's node (the mp executor), never actors of their own; its
    data-parallel rank and size those of its node (``node_rank`` of the ``on_node``
    replicas there), which split that node's cores."""
    parallel = config.parallel_config
    parallel = dataclasses.replace(
        parallel,
        distributed_executor_backend="uni" if parallel.world_size == 1 else "mp",
        data_parallel_rank=node_rank,
        data_parallel_size=on_node,
    )
    return dataclasses.replace(config, parallel_config=parallel)


class RayReplicaGroup:
    """The replicas' actors, one per bundle of one placement group (SPREAD over nodes)."""

    def __init__(self, num_replicas: int, world_size: int, device: str) -> None:
        self.ray, self._owns_ray = connect_ray(num_cpus=num_replicas * world_size)
        self.actors: list = []
        self.group = None
        self._closed = False
        try:
            self._place(num_replicas, world_size, device)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, num_replicas: int, world_size: int, device: str) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        resource = get_platform(device).ray_device_key
        available = ray.cluster_resources().get(resource, 0)
        if available < num_replicas * world_size:
            raise ValueError(
                f"The Ray cluster has {available:g} {resource}s; {num_replicas} engine cores "
                f"of {world_size} worker(s) need one each."
            )
        self.group = ray.util.placement_group(
            [{resource: world_size}] * num_replicas, strategy="SPREAD"
        )
        if not self.group.wait(_PLACEMENT_TIMEOUT_S):
            raise TimeoutError(
                f"Ray could not place {num_replicas} engine cores of {world_size} {resource}(s) "
                f"each in {_PLACEMENT_TIMEOUT_S:.0f} s (resources taken by others?)."
            )
        actor_cls = ray.remote(**{f"num_{resource.lower()}s": world_size})(EngineCoreActor)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=index
                )
            ).remote()
            for index in range(num_replicas)
        ]
        infos = ray.get([a.node_info.remote() for a in self.actors], timeout=_STARTUP_TIMEOUT_S)
        self.node_ids = [node for node, _, _ in infos]
        self.pids = [pid for _, _, pid in infos]
        here = ray.get_runtime_context().get_node_id()
        # The address the replicas connect to: this node's, unless they all share it.
        one_node = all(node == here for node in self.node_ids)
        self.host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        for actor in self.actors:
            actor.import_engine.remote()  # runs before `run`: an actor's calls are in order

    def place_on_node(self, index: int) -> tuple[int, int]:
        """Replica ``index``'s rank among the replicas on its node, and how many there are."""
        node = self.node_ids[index]
        return self.node_ids[:index].count(node), self.node_ids.count(node)

    def shutdown(self) -> None:
        """Kill the actors, free their bundles, and stop Ray if this group started it."""
        if self._closed:
            return
        self._closed = True
        ray = self.ray
        if not ray.is_initialized():
            return
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                logger.debug("ray.kill failed", exc_info=True)
        self.actors = []
        if self.group is not None:
            try:
                ray.util.remove_placement_group(self.group)
            except Exception:
                logger.debug("remove_placement_group failed", exc_info=True)
            self.group = None
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()


class RayEngineCoreSupervisor(EngineCoreSupervisor):
    """One replica's actor, its two sockets (TCP), and the threads that read and watch."""

    def __init__(
        self, sink: OutputSink, world_size: int, replicas: RayReplicaGroup, index: int
    ) -> None:
        super().__init__(sink, world_size, host=replicas.host)
        self.replicas = replicas
        self.index = index
        self.actor = replicas.actors[index]
        self._run_ref = None
        # Made now, before any thread uses the output socket (sockets are not thread-safe).
        self._connection_events = self.output_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._watching = False  # the connection monitor thread owns (and closes) them

    def _bind(self, sock: zmq.Socket, name: str, host: str | None) -> str:
        # Before binding: a listener keeps the options it was bound with.
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        return super()._bind(sock, name, host)

    def wait_for_ready(self) -> int:
        num_blocks = super().wait_for_ready()
        self._watching = True
        thread = threading.Thread(
            target=self._watch_connection, name="EngineCoreConnectionMonitor", daemon=True
        )
        thread.start()
        self.threads.append(thread)  # joined at shutdown, before the sockets close
        return num_blocks

    def _watch_connection(self) -> None:
        """Connection monitor thread: the replica's output connection dropped (its process
        ended, or its heartbeat stopped: a node lost, a network cut) is its death."""
        events = self._connection_events
        try:
            while not self.closing and self.dead_cause is None:
                if not events.poll(_MONITOR_POLL_MS):
                    continue
                event = recv_monitor_message(events)
                if event["event"] != zmq.EVENT_DISCONNECTED or self.closing:
                    continue
                # A core that failed reported why just before it closed the connection:
                # give the output thread a moment to read that report first.
                deadline = time.monotonic() + _REPORT_READ_S
                while self.dead_cause is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                self.mark_dead(
                    RuntimeError(
                        f"Lost the connection to the engine core {self._describe_end(None)}."
                    )
                )
                self._kill_actor()  # if it still runs somewhere, it serves nobody
                return
        finally:
            events.close(linger=0)

    @property
    def engine_pid(self) -> int | None:
        return self.replicas.pids[self.index]

    @property
    def node_id(self) -> str:
        """The Ray node the replica runs on."""
        return self.replicas.node_ids[self.index]

    def start(self) -> None:
        """The actor is up and importing the engine already (RayReplicaGroup)."""

    def configure(self, vllm_config: VllmConfig) -> None:
        if vllm_config.parallel_config.world_size != self._world_size:
            raise ValueError(
                f"the core was started for {self._world_size} rank(s), the config has "
                f"{vllm_config.parallel_config.world_size}"
            )
        self._run_ref = self.actor.run.remote(
            ray_replica_config(vllm_config, *self.replicas.place_on_node(self.index)),
            self.input_address,
            self.output_address,
        )
        self.configured = True

    def _engine_exitcode(self) -> int | None:
        ray = self.replicas.ray
        done, _ = ray.wait([self._run_ref], timeout=0)
        return self._exitcode_of_done() if done else None

    def _exitcode_of_done(self) -> int:
        try:
            return self.replicas.ray.get(self._run_ref)
        except Exception as exc:  # RayActorError: the actor died, or its node was lost
            self._end_cause = f"{type(exc).__name__}: {exc}"
            return _ACTOR_DIED

    def _describe_end(self, exitcode: int | None) -> str:
        where = f"actor (pid {self.engine_pid}, Ray node {self.node_id[:12]})"
        if exitcode is None:
            return where
        if exitcode == _ACTOR_DIED:
            return f"{where} died: {getattr(self, '_end_cause', 'unknown cause')}"
        if exitcode == EXIT_CODE_REPORTED:
            return f"{where} reported a failure"
        return f"{where} ended with exit code {exitcode}"

    def _wait_for_engine_end(self) -> int | None:
        ray = self.replicas.ray
        try:
            ray.wait([self._run_ref], num_returns=1)
        except Exception:  # Ray was shut down under us
            return _ACTOR_DIED
        return self._exitcode_of_done()

    def _stop_engine(self) -> None:
        if not self._watching:  # else its thread closes it; the context waits for it
            self._connection_events.close(linger=0)
        ray = self.replicas.ray
        if not ray.is_initialized():
            return
        if self._run_ref is not None:
            self.send_shutdown()
            try:
                ray.wait([self._run_ref], timeout=_SHUTDOWN_GRACE_S)
            except Exception:
                pass
        self._kill_actor()

    def _kill_actor(self) -> None:
        try:
            self.replicas.ray.kill(self.actor, no_restart=True)
        except Exception:
            logger.debug("ray.kill failed", exc_info=True)
