"""The flat attention metadata the runner builds each step, checked token by token."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.worker.model_runner import build_common_metadata


def test_positions_slots_and_tables_of_a_mixed_step():
    # A decode, a prompt's second chunk, a fresh prompt, a one-token chunk after a prefix hit.
    num_computed = np.array([9, 4, 0, 8], dtype=np.int32)
    query_lens = np.array([1, 5, 3, 1], dtype=np.int32)
    # More blocks than the context fills: the table keeps only those it does.
    block_ids = [[7, 2, 9, 30], [5, 6, 8], [1], [3, 4, 10]]
    positions, common = build_common_metadata(num_computed, query_lens, block_ids, 4)

    assert positions.tolist() == [9, 4, 5, 6, 7, 8, 0, 1, 2, 8]
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
