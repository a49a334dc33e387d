"""Block hashing for prefix caching: a chain of hashes where each names a whole prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
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
