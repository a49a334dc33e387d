"""The persistent prefix cache through the engine on the bundled model: a prompt's full
blocks reach the disk, a restarted engine reads them back (counted as computed tokens)
and gives the same greedy tokens; a corrupt file and another model's file in its place are
skipped and removed, and the output is still the same. (Slow: each engine start takes
seconds; the store's own rules are tested quickly in test_disk_store.py.)"""

from __future__ import annotations

import glob
import os
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.core.kv_cache_utils import sha256_hash
from minivllm.kv_offload.disk_store import DiskStore

PROMPT = "The history of the lighthouse keepers of the northern coast, told in full. " * 20


def _engine(tmp_path, **kwargs) -> LLM:
    return LLM(
        kv_cache_disk=str(tmp_path),
        kv_cache_disk_size=0.5,
        enable_multiprocessing=False,
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
        **kwargs,
    )


def _run(llm: LLM) -> tuple[list[int], object]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    core = llm.llm_engine.engine_core.engine_core
    return list(out.outputs[0].token_ids), core.scheduler.make_stats()


def _files(tmp_path) -> list[str]:
    return sorted(glob.glob(os.path.join(tmp_path, "*", "*.kvb")))


def _wait_for_files(tmp_path, count: int) -> list[str]:
    deadline = time.monotonic() + 30
    while len(_files(tmp_path)) < count and time.monotonic() < deadline:
        time.sleep(0.05)  # the writes are off the step, on a thread
    return _files(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_restarted_engine_reads_the_prompt_back_from_disk(tmp_path, kv_cache_dtype):
    first = _engine(tmp_path, kv_cache_dtype=kv_cache_dtype)
    tokens, stats = _run(first)
    num_prompt = len(first.get_tokenizer().encode(PROMPT))
    full_blocks = num_prompt // 16
    assert stats.external_prefix_cache_hits == 0
    assert stats.kv_disk_blocks_written >= full_blocks
    files = _wait_for_files(tmp_path, full_blocks)
    assert len(files) >= full_blocks
    del first

    second = _engine(tmp_path, kv_cache_dtype=kv_cache_dtype)  # a restart: memory is empty
    again, stats = _run(second)
    assert again == tokens
    # Every full block but the one holding the last prompt token, counted as computed.
    hit_blocks = (num_prompt - 1) // 16
    assert stats.external_prefix_cache_hits == hit_blocks * 16
    assert stats.prefix_cache_hits == hit_blocks * 16
    assert stats.kv_disk_blocks_read == hit_blocks


@pytest.mark.slow
def test_a_corrupt_file_and_another_models_file_are_skipped_and_removed(tmp_path):
    first = _engine(tmp_path)
    tokens, _ = _run(first)
    core = first.llm_engine.engine_core.engine_core
    store = DiskStore(
        str(tmp_path), bytes.fromhex(core.config.cache_config.kv_cache_disk_key), 0, 1 << 30
    )
    ids = first.get_tokenizer().encode(PROMPT)
    chain = []
    for start in range(0, len(ids) - 15, 16):
        chain.append(sha256_hash(chain[-1] if chain else None, ids[start : start + 16], None))
    _wait_for_files(tmp_path, len(chain))
    assert all(os.path.exists(store.path(h)) for h in chain)
    del first

    # The first block's file corrupt: skipped (no disk hit at all) and removed.
    with open(store.path(chain[0]), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    second = _engine(tmp_path)
    again, stats = _run(second)
    assert again == tokens
    assert stats.external_prefix_cache_hits == 0
    assert stats.kv_disk_blocks_read == 0
    _wait_for_files(tmp_path, len(chain))  # computed again, and written again
    del second

    # The second block's file replaced by another model's: the first block is read back,
    # the second skipped and removed, the rest computed.
    foreign = DiskStore(str(tmp_path / "other"), b"x" * 32, 0, 1 << 30)
    foreign.write(chain[1], os.urandom(os.path.getsize(store.path(chain[1])) - 100))
    os.replace(foreign.path(chain[1]), store.path(chain[1]))
    third = _engine(tmp_path)
    again, stats = _run(third)
    assert again == tokens
    assert stats.external_prefix_cache_hits == 16 and stats.kv_disk_blocks_read == 1
    assert stats.prefix_cache_hits == 16


def test_the_identity_key_tells_models_and_cache_layouts_apart(tmp_path):
    from minivllm.kv_offload.identity import identity_key

    a = tmp_path / "a.gguf"
    b = tmp_path / "b.gguf"
    a.write_bytes(b"weights A" * 1000)
    b.write_bytes(b"weights B" * 1000)
    base = identity_key(str(a), "float32", "gguf", "auto", 16, 1)
    assert identity_key(str(a), "float32", "gguf", "auto", 16, 1) == base
    os.rename(a, tmp_path / "moved.gguf")  # the content names it, not the path
    assert identity_key(str(tmp_path / "moved.gguf"), "float32", "gguf", "auto", 16, 1) == base
    for other in (
        identity_key(str(b), "float32", "gguf", "auto", 16, 1),
        identity_key(str(b), "float32", "gguf", "int8", 16, 1),
        identity_key(str(b), "float32", "gguf", "auto", 32, 1),
        identity_key(str(b), "float32", "gguf", "auto", 16, 2),
    ):
        assert other != base
