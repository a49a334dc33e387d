"""Block files under a folder: one file per (block hash, tensor-parallel rank), named by the
model identity's key, checked by a checksum, evicted least recently used within a size
bound. Pure Python (no torch): the core reads headers, the worker payloads.

A file is a header, then the block's bytes (every layer's K and V of the block, as that
rank's cache holds them):

    magic (8) | version (4) | payload length (8) | crc32 of the rest (4) | identity key (32) |
    block hash length (2) | block hash | payload

A file whose magic, version, length, checksum, identity or block hash is not the one
expected (corrupt, truncated, or another model's) is skipped and removed, never loaded.
Writes go to a temporary file and are renamed into place, so a reader sees all or nothing,
and every process of the same model on the machine shares the files.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import zlib

logger = logging.getLogger(__name__)

MAGIC = b"MVLLMKV\x00"
VERSION = 1
_HEAD = struct.Struct("<8sIQI32sH")  # magic, version, payload length, crc32, key, hash length
SUFFIX = ".kvb"


class DiskStore:
    """The block files of one model identity (``key``, 32 bytes) and rank under ``root``;
    ``max_bytes`` bounds the whole folder (every model's files)."""

    def __init__(self, root: str, key: bytes, rank: int, max_bytes: int) -> None:
        self.root = root
        self.key = key
        self.rank = rank
        self.max_bytes = max_bytes
        self.folder = os.path.join(root, key.hex()[:32])
        os.makedirs(self.folder, exist_ok=True)
        self.writes_stopped = False  # the disk was full: no more writes, one warning
        self._approx_bytes: int | None = None  # the folder's size, kept after one scan

    def path(self, block_hash: bytes) -> str:
        return os.path.join(self.folder, f"{block_hash.hex()}.r{self.rank}{SUFFIX}")

    # ------------------------------------------------------------------ reading
    def read(self, block_hash: bytes, payload: bool = True) -> bytes | None:
        """The block's payload (b"" with payload=False, once the file is checked whole), or
        None when there is no good file; a bad one is removed. A read marks the file
        recently used."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("KV disk cache: cannot read %s (%s); skipped.", path, exc)
            return None
        body = self._check(data, block_hash)
        if body is None:
            logger.warning("KV disk cache: %s is corrupt, truncated or foreign; removed.", path)
            self._remove(path)
            return None
        try:
            os.utime(path)  # LRU: eviction takes the least recently used files first
        except OSError:
            pass
        return body if payload else b""

    def _check(self, data: bytes, block_hash: bytes) -> bytes | None:
        if len(data) < _HEAD.size:
            return None
        magic, version, length, crc, key, hash_len = _HEAD.unpack_from(data)
        body_start = _HEAD.size + hash_len
        if magic != MAGIC or version != VERSION or key != self.key:
            return None
        if len(data) != body_start + length:
            return None
        if data[_HEAD.size : body_start] != block_hash:
            return None
        if zlib.crc32(memoryview(data)[_HEAD.size - 34 :]) != crc:  # key, hash, payload
            return None
        return data[body_start:]

    # ------------------------------------------------------------------ writing
    def write(self, block_hash: bytes, payload: bytes) -> bool:
        """Store a block (a no-op when its file exists); False when nothing was written
        (the disk is full: then writes stop for good, with one warning)."""
        if self.writes_stopped:
            return False
        path = self.path(block_hash)
        if os.path.exists(path):
            return True
        tail = struct.pack("<32sH", self.key, len(block_hash)) + block_hash
        crc = zlib.crc32(payload, zlib.crc32(tail))
        head = struct.pack("<8sIQI", MAGIC, VERSION, len(payload), crc)
        size = len(head) + len(tail) + len(payload)
        self._make_room(size)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(tail)
                f.write(payload)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            self.writes_stopped = True
            logger.warning(
                "KV disk cache: cannot write under %s (%s); no more blocks are written to "
                "disk (requests are not affected).",
                self.root,
                exc,
            )
            return False
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        if self._approx_bytes is not None:
            self._approx_bytes += size
        return True

    def _make_room(self, size: int) -> None:
        """Evict the least recently used files of the whole folder until ``size`` more bytes
        fit in the bound (to 90% of it, so that a scan is not needed for every write)."""
        if self._approx_bytes is not None and self._approx_bytes + size <= self.max_bytes:
            return
        files = []
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                if not name.endswith(SUFFIX):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                files.append((st.st_mtime_ns, st.st_size, path))
        total = sum(f[1] for f in files)
        target = min(self.max_bytes - size, int(self.max_bytes * 0.9))
        for _, file_size, path in sorted(files):
            if total <= target:
                break
            if self._remove(path):
                total -= file_size
        self._approx_bytes = total

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except OSError:
            return False
