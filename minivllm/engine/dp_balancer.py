"""Which engine core (data-parallel replica) serves a request: the one whose prefix cache
most likely holds the longest chain of the prompt's blocks, unless it is overloaded, else
the least loaded (MINIVLLM_DP_LOAD_BALANCING picks the policy).

The balancer keeps, per replica, the block hashes (the scheduler's chain: each names its
whole prefix, the first keyed by the cache salt and adapter) of the prompts it sent there,
as many as the replica's KV cache has blocks, least recently sent dropped first: what the
replica's prefix cache holds, as far as the frontend can tell without asking. Load is the
requests sent and not yet finished, then the KV cache use the replica last reported.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable

from minivllm.core.kv_cache_utils import BlockHash
from minivllm.engine.messages import EngineCoreRequest, SchedulerStats

POLICIES = ("prefix", "least_loaded", "round_robin")


class PrefixIndex:
    """The block hashes sent to one replica, bounded, least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def match(self, hashes: list[BlockHash]) -> int:
        """How many of the chain's first blocks are here."""
        n = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


class Replica:
    """What the balancer knows of one engine core."""

    def __init__(self, index: int, capacity_blocks: int) -> None:
        self.index = index
        self.alive = True
        self.requests: set[str] = set()  # sent, not finished
        self.kv_cache_usage = 0.0
        self.prefixes = PrefixIndex(capacity_blocks)

    @property
    def load(self) -> tuple[int, float]:
        return len(self.requests), self.kv_cache_usage


class DPBalancer:
    """Not thread-safe: the client calls it under its lock."""

    def __init__(
        self,
        capacities: list[int],
        block_size: int,
        hash_fn: Callable,
        policy: str = "prefix",
    ) -> None:
        """capacities: each replica's KV cache blocks; hash_fn: the prefix cache's."""
        if policy not in POLICIES:
            raise ValueError(f"data-parallel load balancing must be one of {POLICIES}")
        self.replicas = [Replica(i, blocks) for i, blocks in enumerate(capacities)]
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.policy = policy
        self._turn = itertools.count()
        # Prefix-cache affinity stands aside when the replica it names has more than this
        # many requests beyond the least loaded one's (and at least twice as many).
        self.overload_margin = 4

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def pick(self, request: EngineCoreRequest) -> int:
        """The replica for a request; it is counted there until ``finished``."""
        replicas = self.alive()
        if not replicas:
            raise RuntimeError("no engine core is alive")
        turn = next(self._turn)
        if self.policy == "round_robin":
            chosen = replicas[turn % len(replicas)]
        else:  # ties taken in turn
            n = len(self.replicas)
            least = min(replicas, key=lambda r: (r.load, (r.index - turn) % n))
            chosen = least
            if self.policy == "prefix":
                hashes = self.block_hashes(request)
                best, matched = max(
                    ((r, r.prefixes.match(hashes)) for r in replicas), key=lambda rm: rm[1]
                )
                if matched and not self._overloaded(best, least):
                    chosen = best
                chosen.prefixes.add(hashes)
        chosen.requests.add(request.request_id)
        return chosen.index

    def _overloaded(self, replica: Replica, least: Replica) -> bool:
        mine, fewest = len(replica.requests), len(least.requests)
        return mine - fewest > self.overload_margin and mine >= 2 * fewest

    def block_hashes(self, request: EngineCoreRequest) -> list[BlockHash]:
        """The chain of the prompt's full blocks, as the scheduler hashes them."""
        tokens = request.prompt_token_ids
        extra = request.cache_salt
        if request.lora_request is not None:
            extra = (request.lora_request.lora_int_id, extra)
        hashes: list[BlockHash] = []
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            parent = hashes[-1] if hashes else None
            block = tokens[start : start + size]
            hashes.append(self.hash_fn(parent, block, extra if not hashes else None))
        return hashes

    def finished(self, index: int, request_id: str) -> None:
        self.replicas[index].requests.discard(request_id)

    def observe(self, index: int, stats: SchedulerStats | None) -> None:
        if stats is not None:
            self.replicas[index].kv_cache_usage = stats.kv_cache_usage

    def fail(self, index: int) -> set[str]:
        """A replica died: it takes no more requests; returns those it held."""
        replica = self.replicas[index]
        replica.alive = False
        requests, replica.requests = replica.requests, set()
        return requests
