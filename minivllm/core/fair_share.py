"""Fair shares of a step between request groups, so that one request cannot fill the steps.

A group is what one request of the user became in the engine core: the n sequences of
parallel sampling (the frontend sends them as "{index}_{parent id}", vLLM V1's names) are
one group; any other request is a group of its own. While two groups or more have work,
each step's token budget (max_num_batched_tokens) and its running sequences
(max_num_seqs) are split between them max-min fairly (water-filling): a group that needs
less than an equal share gets what it needs, and the others share the rest equally. A
group of several sequences then takes no more than its share, so the n=128 children of
one request cannot take a whole step's prompt tokens, or all the free sequence slots,
while a newcomer waits: the newcomer starts in the next step. Nothing is capped where the
demand fits (a lone request still fills the step, as in vLLM), and a single request is
never capped: separate requests keep vLLM's first-come-first-served order (sharing a
burst of long prompts instead would put every one of its first tokens at the burst's end).

MINIVLLM_FAIR_SHARE=0 turns the rule off.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from minivllm import envs
from minivllm.core.request import Request, RequestStatus

_CHILD_ID = re.compile(r"\d+_(.+)", re.DOTALL)


def group_of(request_id: str) -> str:
    """The parent request's id for a sequence of parallel sampling ("{index}_{parent}", as
    engine/parallel_sampling.py names them), else the request's own id."""
    match = _CHILD_ID.fullmatch(request_id)
    return match.group(1) if match else request_id


def max_min_shares(demands: dict[str, int], capacity: int) -> dict[str, int]:
    """Water-filling: each key gets min(its demand, the level), the level chosen so that
    the shares add up to at most capacity; in whole tokens, the larger demands' shares
    differ by at most one."""
    shares: dict[str, int] = {}
    left, count = capacity, len(demands)
    for key, demand in sorted(demands.items(), key=lambda item: item[1]):
        level = left // count
        shares[key] = min(demand, level)
        left -= shares[key]
        count -= 1
    return shares


class FairShare:
    """Per step: the tokens and new running sequences each capped group may still take."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enabled = envs.MINIVLLM_FAIR_SHARE
        # Live requests of each group of parallel sampling (only those are capped): a step
        # without any looks no further.
        self._children: dict[str, int] = {}
        self._tokens_left: dict[str, int] = {}  # capped group -> tokens left this step
        self._slots_left: dict[str, int] = {}  # capped group -> sequences it may start

    def request_added(self, request: Request) -> None:
        group = group_of(request.request_id)
        if group != request.request_id:
            self._children[group] = self._children.get(group, 0) + 1

    def request_freed(self, request: Request) -> None:
        group = group_of(request.request_id)
        if group in self._children:
            self._children[group] -= 1
            if not self._children[group]:
                del self._children[group]

    def begin_step(self, running: list[Request], waiting: Iterable[Request]) -> None:
        """Size this step's shares from what each group has to compute."""
        self._tokens_left.clear()
        self._slots_left.clear()
        if not self.enabled or not self._children:
            return
        tokens: dict[str, int] = {}  # group -> tokens it could compute this step
        seqs: dict[str, int] = {}  # group -> sequences running or ready to start
        running_seqs: dict[str, int] = {}
        for request in running:
            group = group_of(request.request_id)
            known = request.num_tokens + request.num_output_placeholders
            tokens[group] = tokens.get(group, 0) + max(known - request.num_computed_tokens, 0)
            seqs[group] = seqs.get(group, 0) + 1
            running_seqs[group] = running_seqs.get(group, 0) + 1
        for request in waiting:
            if request.status == RequestStatus.WAITING_FOR_FSM:
                continue  # its grammar compiles: it cannot start this step
            group = group_of(request.request_id)
            tokens[group] = tokens.get(group, 0) + request.num_tokens
            seqs[group] = seqs.get(group, 0) + 1
        working = {group for group, n in tokens.items() if n > 0}
        if len(working) < 2:
            return  # a lone group takes what the budget gives it
        token_shares = max_min_shares({g: tokens[g] for g in working}, self.max_num_batched_tokens)
        seq_shares = max_min_shares({g: seqs[g] for g in working}, self.max_num_seqs)
        for group in working & self._children.keys():
            if token_shares[group] >= tokens[group] and seq_shares[group] >= seqs[group]:
                continue  # its share holds all it has to do: nothing to cap
            self._tokens_left[group] = max(token_shares[group], 1)
            self._slots_left[group] = max(seq_shares[group], 1) - running_seqs.get(group, 0)

    def caps_any(self) -> bool:
        """Whether some group is capped this step (else fit and commit do nothing)."""
        return bool(self._tokens_left)

    def defers(self, request: Request, chunked_prefill: bool) -> bool:
        """Whether a waiting request's group has used its share of the step (it keeps its
        place; requests behind it may start)."""
        if not self._tokens_left:
            return False  # nothing is capped this step (the common case: no regex per request)
        group = group_of(request.request_id)
        if group not in self._tokens_left:
            return False
        tokens_left = self._tokens_left[group]
        if not chunked_prefill and tokens_left < request.num_tokens:
            return True  # its prompt goes whole or not at all
        return tokens_left <= 0 or self._slots_left[group] <= 0

    def fit(self, request: Request, num_new: int) -> int:
        """num_new, cut to what the request's group has left of its share."""
        if not self._tokens_left:
            return num_new
        tokens_left = self._tokens_left.get(group_of(request.request_id))
        return num_new if tokens_left is None else max(min(num_new, tokens_left), 0)

    def commit(self, request: Request, num_new: int) -> None:
        if not self._tokens_left:
            return
        group = group_of(request.request_id)
        if group in self._tokens_left:
            self._tokens_left[group] -= num_new
            if request.status != RequestStatus.RUNNING:  # it starts this step
                self._slots_left[group] -= 1

    def release(self, request: Request, num_new: int) -> None:
        if not self._tokens_left:
            return
        group = group_of(request.request_id)
        if group in self._tokens_left:
            self._tokens_left[group] += num_new
