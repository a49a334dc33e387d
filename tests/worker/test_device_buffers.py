"""GraphInputs: a decode step's inputs packed for the CUDA graphs, sent in one copy. On
the CPU the tests ask for a device twin apart from the host buffer, as on a GPU, so that
what only the device's copy holds (the tokens in flight) is not also on the host."""

from __future__ import annotations

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.worker.device_buffers import CpuGpuBuffer, GraphInputs
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.step_inputs import InFlightTokens

BS = 4


def batch_with(n: int) -> InputBatch:
    batch = InputBatch(8, 64, 64, BS)
    for i in range(n):
        batch.add_request(f"r{i}", [5 + i, 6, 7], 3, 3, [i], SamplingParams())
    return batch


def test_a_decode_step_lands_in_the_graph_buffers_with_padded_rows():
    graph = GraphInputs([1, 2, 4, 8], 16, torch.device("cpu"), twin=True)
    batch = batch_with(3)
    for i in range(3):  # each request's next token is known: a decode step of 3 rows
        batch.append_tokens(np.array([i]), np.array([40 + i]))
    step = batch.prepare(["r0", "r1", "r2"], [1, 1, 1], graph=graph)
    assert step.graph_size == 4
    dev = graph.dev
    assert step.input_ids.data_ptr() == dev["input_ids"].data_ptr()  # views, no copies
    assert dev["input_ids"][:4].tolist() == [40, 41, 42, 0]
    assert dev["positions"][:3].tolist() == [3, 3, 3]
    assert dev["slot_mapping"][:4].tolist() == [3, BS + 3, 2 * BS + 3, -1]  # the pad: none
    assert dev["seq_lens"][:4].tolist() == [4, 4, 4, 1]
    assert dev["block_table"][:3, 0].tolist() == [0, 1, 2]
    assert step.block_table.shape == (3, 1)


def test_padded_rows_never_carry_an_earlier_steps_placeholder():
    """Tokens in flight are -1 on the host (their ids reach the inputs on the device): a
    later step whose padded rows cover such a row must not send it again (an embedding of
    -1 was a device-side assert on the H200)."""
    graph = GraphInputs([1, 2, 4, 8], 16, torch.device("cpu"), twin=True)
    batch = batch_with(4)
    req_ids = ["r0", "r1", "r2", "r3"]
    positions = batch.append_placeholders(batch.rows_of(req_ids))
    in_flight = InFlightTokens(req_ids, positions, torch.tensor([40, 41, 42, 43]))
    step = batch.prepare(req_ids, [1, 1, 1, 1], in_flight, graph=graph)
    assert step.in_flight_all and step.graph_size == 4
    assert graph.np["input_ids"][:4].tolist() == [-1, -1, -1, -1]  # the host's
    assert graph.dev["input_ids"][:4].tolist() == [40, 41, 42, 43]  # the device's copy
    batch.advance(step)
    batch.set_tokens(req_ids, positions, [40, 41, 42, 43])
    batch.remove_request("r3")
    batch.condense()
    for i in range(3):
        batch.append_tokens(np.array([i]), np.array([50 + i]))
    step = batch.prepare(req_ids[:3], [1, 1, 1], graph=graph)
    assert step.graph_size == 4  # row 3 padded: it held a placeholder on the host
    assert graph.dev["input_ids"][:4].tolist() == [50, 51, 52, 0]
    assert graph.dev["slot_mapping"][3] == -1 and graph.dev["seq_lens"][3] == 1


def test_a_step_of_prompt_chunks_keeps_its_own_buffers():
    graph = GraphInputs([1, 2, 4, 8], 16, torch.device("cpu"), twin=True)
    batch = batch_with(2)
    batch.add_request("p", list(range(10)), 10, 0, [7, 8, 9], SamplingParams())
    step = batch.prepare(["p"], [10], graph=graph)
    assert step.graph_size is None and step.max_query_len == 10
    assert step.input_ids.tolist() == list(range(10))


def test_host_views_are_reused_only_for_the_same_length_and_shape():
    buf = CpuGpuBuffer(12, torch.int32, torch.device("cpu"))
    buf.np[:] = np.arange(12)
    first = buf.copy_to_gpu(3)
    assert buf.copy_to_gpu(3) is first and buf.head(3) is first
    assert first.tolist() == [0, 1, 2]
    buf.np[1] = 7  # a view: the next step's writes show through, as before
    assert first.tolist() == [0, 7, 2]
    assert buf.copy_to_gpu(4).tolist() == [0, 7, 2, 3]
    table = buf.copy_to_gpu(6, (2, 3))
    assert table.shape == (2, 3) and table.tolist() == [[0, 7, 2], [3, 4, 5]]
    assert buf.copy_to_gpu(6, (3, 2)).shape == (3, 2)
    assert buf.copy_to_gpu(6).shape == (6,)
