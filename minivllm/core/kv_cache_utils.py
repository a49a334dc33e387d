"""Block hashing for prefix caching (a chain of hashes where each names a whole prefix), and
the cache's spec: what one block and one state slot cost, and how a budget splits."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from minivllm.core.request import Request

BlockHash = bytes

_encoder = msgspec.msgpack.Encoder()


def sha256_hash(parent: BlockHash | None, token_ids: tuple[int, ...] | list[int], extra) -> bytes:
    """A block's hash: sha256 of (parent hash, its token ids, extra keys).

    A cryptographic hash so that two different prefixes never share KV by collision.
    """
    return hashlib.sha256(_encoder.encode((parent, token_ids, extra))).digest()


def builtin_hash(parent: BlockHash | None, token_ids, extra) -> bytes:
    """A fast non-cryptographic alternative (collisions are possible in theory)."""
    return hash((parent, tuple(token_ids), extra)).to_bytes(8, "little", signed=True)


HASH_FUNCTIONS: dict[str, Callable] = {"sha256": sha256_hash, "builtin": builtin_hash}


def extend_block_hashes(request: Request, block_size: int, hash_fn: Callable) -> None:
    """Hash every newly completed full block of the request's tokens."""
    tokens = request.all_token_ids
    hashes = request.block_hashes
    # An adapter changes every layer's K/V: its id keys the blocks, as the salt does.
    extra = request.cache_salt
    if request.lora_request is not None:
        extra = (request.lora_int_id, extra)
    while (len(hashes) + 1) * block_size <= len(tokens):
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else None
        # The extra keys enter only the first block: later hashes inherit them via the chain.
        hashes.append(
            hash_fn(parent, tokens[start : start + block_size], extra if not hashes else None)
        )


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model's layers cache, in bytes (the worker measures it from the layers):
    paged attention blocks of ``block_size`` tokens, and for a hybrid model one fixed-size
    state per running request (all its state layers' conv and recurrent tensors)."""

    block_size: int
    bytes_per_block: int  # every attention layer's K/V of block_size tokens
    bytes_per_state_slot: int = 0  # every state layer's state of one request

    @property
    def has_state(self) -> bool:
        return self.bytes_per_state_slot > 0

    def request_bytes(self, num_tokens: int) -> int:
        """The cache memory one request of num_tokens tokens holds: its blocks, and its state
        slot, which does not grow with its length."""
        blocks = -(-num_tokens // self.block_size)
        return blocks * self.bytes_per_block + self.bytes_per_state_slot

    def split_budget(
        self, available: int, max_num_seqs: int, max_model_len: int
    ) -> tuple[int, int]:
        """(KV cache blocks, state slots) in ``available`` bytes.

        A state slot is only of use to a running request, so there are at most max_num_seqs
        of them, and they take at most half the budget (a large recurrent state times a
        large max_num_seqs would leave the blocks nothing); fewer still when the budget
        cannot also hold the blocks of one max_model_len request. The scheduler then runs
        no more requests at once than there are slots. The rest is blocks. A
        model without attention layers gets blocks for free (they hold nothing): enough for
        max_num_seqs requests of max_model_len tokens."""
        min_blocks = -(-max_model_len // self.block_size)
        num_slots = 0
        if self.has_state:
            room = available - min_blocks * self.bytes_per_block
            half = max(available // 2, self.bytes_per_state_slot)  # one slot at least
            num_slots = min(max_num_seqs, half // self.bytes_per_state_slot)
            num_slots = max(0, min(num_slots, room // self.bytes_per_state_slot))
            available -= num_slots * self.bytes_per_state_slot
        if self.bytes_per_block == 0:
            return max_num_seqs * min_blocks, num_slots
        return available // self.bytes_per_block, num_slots
