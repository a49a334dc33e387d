"""The flat attention metadata the runner builds each step, checked token by token."""

from __future__ import annotations

import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.model_runner import common_metadata


def test_positions_slots_and_tables_of_a_mixed_step():
    # A decode, a prompt's second chunk, a fresh prompt, a one-token chunk after a prefix hit.
    num_computed = [9, 4, 0, 8]
    query_lens = [1, 5, 3, 1]
    # More blocks than the context fills: the table keeps only those it does.
    block_ids = [[7, 2, 9, 30], [5, 6, 8], [1], [3, 4, 10]]
    batch = InputBatch(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32, block_size=4)
    req_ids = ["decode", "chunk", "fresh", "hit"]
    for i, req_id in enumerate(req_ids):
        num_tokens = num_computed[i] + query_lens[i]
        token_ids = [100 * i + t for t in range(num_tokens)]
        batch.add_request(
            req_id, token_ids, num_tokens, num_computed[i], block_ids[i], SamplingParams()
        )
    step = batch.prepare(req_ids, query_lens)
    common = common_metadata(step)

    assert step.positions.tolist() == [9, 4, 5, 6, 7, 8, 0, 1, 2, 8]
    assert step.input_ids.tolist() == [9, 104, 105, 106, 107, 108, 200, 201, 202, 308]
    assert common.query_start_loc.tolist() == [0, 1, 6, 9, 10]
    assert common.seq_lens.tolist() == [10, 9, 3, 9]
    assert common.block_table.tolist() == [[7, 2, 9], [5, 6, 8], [1, 0, 0], [3, 4, 10]]
    expected_slots = [
        block_ids[i][p // 4] * 4 + p % 4
        for i, (start, n) in enumerate(zip(num_computed, query_lens))
        for p in range(start, start + n)
    ]
    assert common.slot_mapping.tolist() == expected_slots
    assert (common.num_actual_tokens, common.max_query_len, common.max_seq_len) == (10, 5, 10)
    assert common.query_start_loc.dtype == common.seq_lens.dtype == torch.int32
    assert common.block_table.dtype == torch.int32 and common.slot_mapping.dtype == torch.long
    assert torch.equal(common.query_start_loc_cpu, common.query_start_loc)
    assert torch.equal(common.seq_lens_cpu, common.seq_lens)


def test_cpu_token_rows_of_a_decode_step_equal_those_of_a_mixed_step():
    """The CPU backend's decode shortcut (one row per request) gives each request the row
    the general path gives its last token: the same length and blocks."""
    from minivllm.attention.cpu import CPUAttentionBackend

    backend = CPUAttentionBackend(block_size=4)
    if backend.kernels is None:
        return  # no C kernel: the spans path, no token rows
    batch = InputBatch(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32, block_size=4)
    lens = {"a": 10, "b": 3, "c": 17}
    blocks = {"a": [7, 2, 9], "b": [5], "c": [1, 3, 4, 6, 8]}
    for req_id, n in lens.items():
        batch.add_request(req_id, list(range(n)), n, n - 2, blocks[req_id], SamplingParams())
    order = ["c", "a", "b"]
    mixed = backend.build_metadata(common_metadata(batch.prepare(order, [2, 2, 2])))
    decode = backend.build_metadata(
        common_metadata(batch.prepare(order, [1, 1, 1], num_drafts=None))
    )
    # (the decode step computes the second-last token: one position less than the mixed
    # step's last rows)
    last = [1, 3, 5]
    assert decode.num_singles == 3 and decode.spans == [] and decode.tiles is None
    assert decode.single_rows.tolist() == [0, 1, 2]
    assert decode.single_seq_lens.tolist() == [lens[r] - 1 for r in order]
    assert decode.single_seq_lens.tolist() == (mixed.single_seq_lens[last] - 1).tolist()
    assert decode.single_block_table.dtype == mixed.single_block_table.dtype == torch.int64
    width = decode.single_block_table.shape[1]
    assert width == -(-16 // 4)
    for i, req_id in enumerate(order):
        used = -(-(lens[req_id] - 1) // 4)
        assert decode.single_block_table[i].tolist() == blocks[req_id][:used] + [0] * (width - used)
