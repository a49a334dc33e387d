"""The disk cache's file store: round trips, corrupt / truncated / foreign files skipped and
removed, least-recently-used eviction within the bound, and a full disk that stops writes."""

from __future__ import annotations

import os

from minivllm.kv_offload.disk_store import DiskStore

KEY, OTHER = b"k" * 32, b"o" * 32


def test_a_block_round_trips_and_another_model_does_not_see_it(tmp_path):
    store = DiskStore(str(tmp_path), KEY, 0, 1 << 20)
    assert store.read(b"h1") is None
    assert store.write(b"h1", b"payload bytes")
    assert store.read(b"h1") == b"payload bytes"
    assert DiskStore(str(tmp_path), KEY, 1, 1 << 20).read(b"h1") is None  # rank 1's file
    assert DiskStore(str(tmp_path), OTHER, 0, 1 << 20).read(b"h1") is None


def test_corrupt_truncated_and_foreign_files_are_skipped_and_removed(tmp_path):
    store = DiskStore(str(tmp_path), KEY, 0, 1 << 20)
    for h in (b"a", b"b", b"c", b"d"):
        store.write(h, bytes(range(200)))
    with open(store.path(b"a"), "r+b") as f:  # a flipped byte in the payload
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff")
    with open(store.path(b"b"), "r+b") as f:  # cut short
        f.truncate(100)
    foreign = DiskStore(str(tmp_path), OTHER, 0, 1 << 20)
    foreign.write(b"c", bytes(200))
    os.replace(foreign.path(b"c"), store.path(b"c"))  # another model's file in our place
    os.replace(store.path(b"d"), store.path(b"e"))  # a file named by another block hash
    for h in (b"a", b"b", b"c", b"e"):
        assert store.read(h) is None
        assert not os.path.exists(store.path(h))


def test_least_recently_used_blocks_are_evicted_within_the_bound(tmp_path):
    store = DiskStore(str(tmp_path), KEY, 0, 3500)
    for i in range(3):
        store.write(b"%d" % i, bytes(1000))
        os.utime(store.path(b"%d" % i), ns=(i * 10**9, i * 10**9))
    store.read(b"0")  # used: now the most recent
    store.write(b"3", bytes(1000))
    assert store.read(b"1") is None  # the least recently used went
    assert store.read(b"0") is not None and store.read(b"3") is not None


def test_a_full_disk_stops_writing_with_one_warning(tmp_path, caplog, monkeypatch):
    store = DiskStore(str(tmp_path), KEY, 0, 1 << 20)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkstemp", no_space)
    assert not store.write(b"a", b"x")
    assert not store.write(b"b", b"y")
    assert store.writes_stopped
    assert sum("cannot write" in r.message for r in caplog.records) == 1
