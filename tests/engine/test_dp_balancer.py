"""The data-parallel balancer without processes: prefix affinity, load, round robin, and
a replica that dies."""

from __future__ import annotations

import random

from minivllm.core.kv_cache_utils import sha256_hash
from minivllm.engine.dp_balancer import DPBalancer, PrefixIndex
from minivllm.engine.messages import EngineCoreRequest, SchedulerStats
from minivllm.sampling_params import SamplingParams

BS = 4


def request(req_id: str, tokens: list[int], cache_salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        req_id, tokens, SamplingParams(max_tokens=1), None, 0.0, cache_salt=cache_salt
    )


def balancer(policy: str = "prefix", replicas: int = 2, capacity: int = 1000) -> DPBalancer:
    return DPBalancer([capacity] * replicas, BS, sha256_hash, policy)


def test_requests_that_share_a_prefix_go_to_the_same_replica():
    lb = balancer()
    system_a, system_b = list(range(1, 13)), list(range(100, 112))
    first_a = lb.pick(request("a0", system_a + [50, 51]))
    first_b = lb.pick(request("b0", system_b + [60]))
    assert first_a != first_b  # no shared blocks: the least loaded
    for i in range(1, 5):
        assert lb.pick(request(f"a{i}", system_a + [70 + i] * 3)) == first_a
        assert lb.pick(request(f"b{i}", system_b + [80 + i])) == first_b
    # A salt keys the chain: the same tokens under another salt share nothing.
    salted = request("s", system_a + [9], cache_salt="other")
    assert lb.replicas[first_a].prefixes.match(lb.block_hashes(salted)) == 0
    assert lb.replicas[first_a].prefixes.match(lb.block_hashes(request("t", system_a))) == 3


def test_an_overloaded_replica_gives_way_to_the_least_loaded():
    lb = balancer()
    prefix = list(range(1, 17))
    picks = [lb.pick(request(f"r{i}", prefix + [i])) for i in range(12)]
    home = picks[0]
    # Affinity holds while the home replica has at most 4 more requests than the other
    # (or fewer than twice as many), then the others go to the least loaded.
    assert picks[:5] == [home] * 5
    assert home != picks[5]
    assert abs(picks.count(0) - picks.count(1)) <= 6


def test_least_loaded_counts_requests_then_kv_use():
    lb = balancer("least_loaded")
    lb.observe(0, SchedulerStats(kv_cache_usage=0.9))
    lb.observe(1, SchedulerStats(kv_cache_usage=0.1))
    assert lb.pick(request("a", [1, 2, 3])) == 1
    assert lb.pick(request("b", [1, 2, 3])) == 0  # 0 requests there against 1
    lb.finished(1, "a")
    assert lb.pick(request("c", [1, 2, 3])) == 1


def test_round_robin_alternates_whatever_the_prompt():
    lb = balancer("round_robin")
    picks = [lb.pick(request(f"r{i}", [1, 2, 3, 4, 5])) for i in range(6)]
    assert picks == [0, 1, 0, 1, 0, 1]


def test_a_dead_replica_returns_its_requests_and_gets_no_more():
    lb = balancer()
    picks = {f"r{i}": lb.pick(request(f"r{i}", [i] * 9)) for i in range(4)}
    lost = lb.fail(1)
    assert lost == {r for r, index in picks.items() if index == 1}
    assert all(lb.pick(request(f"n{i}", [i] * 9)) == 0 for i in range(4))
    assert [r.index for r in lb.alive()] == [0]


def test_prefix_routing_hits_more_than_round_robin_on_a_shared_prefix_workload():
    """Ten system prompts of 8 blocks, twelve users each, in random order, four requests
    in flight at a time; each replica's cache holds 40 blocks (least recently used out),
    half the system prompts: the blocks each request finds in its replica's cache under
    each policy."""
    rng = random.Random(0)
    systems = [[rng.randrange(1000) for _ in range(8 * BS)] for _ in range(10)]
    workload = [(s, [rng.randrange(1000) for _ in range(3)]) for s in range(10) for _ in range(12)]
    rng.shuffle(workload)

    def hit_blocks(policy: str) -> int:
        lb = balancer(policy, capacity=40)
        caches = [PrefixIndex(40), PrefixIndex(40)]
        in_flight: list[tuple[int, str]] = []
        hits = 0
        for i, (system, user) in enumerate(workload):
            req = request(f"r{i}", systems[system] + user)
            index = lb.pick(req)
            hashes = lb.block_hashes(req)
            hits += caches[index].match(hashes)
            caches[index].add(hashes)
            in_flight.append((index, req.request_id))
            if len(in_flight) == 4:
                lb.finished(*in_flight.pop(0))
        return hits

    prefix, round_robin = hit_blocks("prefix"), hit_blocks("round_robin")
    assert prefix >= 1.5 * round_robin, (prefix, round_robin)
