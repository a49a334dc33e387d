"""The state cache's slots: one fixed-size state (conv + recurrent) per running request.

A hybrid model's state layers (LFM2's short convolutions, Mamba-2, Gated DeltaNet) keep a
state whose size does not grow with the request: the cache holds ``num_slots`` of them,
one per request while it runs. A slot is taken when a request is first scheduled (or
scheduled again after preemption: its state was lost and is recomputed from position 0,
as its KV blocks are) and given back when it finishes or is preempted.
"""

from __future__ import annotations


class StatePool:
    """Free slots and who holds which; taking and giving back are O(1)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Popped from the end: the slot freed last is reused first (its memory is warm).
        self._free = list(range(num_slots - 1, -1, -1))
        self.req_to_slot: dict[str, int] = {}

    def get_num_free_slots(self) -> int:
        return len(self._free)

    def get_slot(self, request_id: str) -> int | None:
        return self.req_to_slot.get(request_id)

    def can_allocate(self, request_id: str) -> bool:
        """Whether the request holds a slot or one is free for it."""
        return request_id in self.req_to_slot or bool(self._free)

    def allocate(self, request_id: str) -> int:
        """The request's slot, taken now if it holds none (check ``can_allocate`` first)."""
        slot = self.req_to_slot.get(request_id)
        if slot is None:
            slot = self._free.pop()
            self.req_to_slot[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_invariants(self) -> None:
        held = list(self.req_to_slot.values())
        assert len(set(held)) == len(held), "two requests hold one state slot"
        assert not set(held) & set(self._free), "a held state slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "held + free != slots"
