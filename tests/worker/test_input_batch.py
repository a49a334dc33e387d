"""InputBatch: rows kept from the scheduler's diffs, a step's inputs built from them.

The reference for ``prepare`` is the per-request Python the model runner used before
(token slices, positions, slots from the block table); random scenarios of adds, removes,
new blocks and chunked steps must give the same tensors.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from minivllm.sample.metadata import SamplingArrays, build_sampling_metadata
from minivllm.sample.penalties import SeenTokens
from minivllm.sampling_params import SamplingParams
from minivllm.worker.input_batch import InputBatch

BS = 4  # block size


@dataclass
class Req:
    """What a test remembers of a request, the plain way."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


def new_batch(max_num_seqs=8, max_model_len=64, max_tokens=128) -> InputBatch:
    return InputBatch(max_num_seqs, max_model_len, max_tokens, BS)


def add(batch: InputBatch, req: Req) -> int:
    return batch.add_request(
        req.req_id,
        req.token_ids,
        req.num_prompt_tokens,
        req.num_computed,
        req.block_ids,
        req.params,
    )


def reference(reqs: list[Req], counts: list[int]) -> dict[str, list]:
    """The step's inputs built request by request, as the runner did before InputBatch."""
    out = {k: [] for k in ("ids", "pos", "slots", "qsl", "lens", "logits", "sampling")}
    out["qsl"].append(0)
    row = 0
    for i, (req, n) in enumerate(zip(reqs, counts)):
        start, end = req.num_computed, req.num_computed + n
        out["ids"] += req.token_ids[start:end]
        out["pos"] += list(range(start, end))
        out["slots"] += [req.block_ids[p // BS] * BS + p % BS for p in range(start, end)]
        row += n
        out["qsl"].append(row)
        out["lens"].append(end)
        if end == len(req.token_ids):
            out["logits"].append(row - 1)
            out["sampling"].append(i)
    return out


def check_step(batch: InputBatch, reqs: list[Req], counts: list[int]) -> None:
    step = batch.prepare([r.req_id for r in reqs], counts)
    want = reference(reqs, counts)
    assert step.input_ids.tolist() == want["ids"]
    assert step.positions.tolist() == want["pos"]
    assert step.slot_mapping.tolist() == want["slots"]
    assert step.query_start_loc.tolist() == want["qsl"]
    assert step.seq_lens.tolist() == want["lens"]
    assert step.logits_indices.tolist() == want["logits"]
    assert step.sampling.tolist() == want["sampling"]
    assert step.max_query_len == max(counts)
    assert step.max_seq_len == max(want["lens"])
    assert step.input_ids.dtype == step.positions.dtype == step.slot_mapping.dtype == torch.int64
    assert step.query_start_loc.dtype == step.seq_lens.dtype == torch.int32
    assert step.block_table.dtype == torch.int32 and step.block_table.is_contiguous()
    width = -(-max(want["lens"]) // BS)
    assert step.block_table.shape == (len(reqs), width)
    for req, table, length in zip(reqs, step.block_table.tolist(), want["lens"]):
        used = -(-length // BS)
        assert table == req.block_ids[:used] + [0] * (width - used)


def run_step(batch: InputBatch, rng: random.Random, order, reqs: list[Req], counts):
    """Prepare and advance one step, then apply the runner's bookkeeping to both sides: the
    computed tokens, and a random sampled token for each request that reached its end."""
    step = batch.prepare(order, counts)
    batch.advance(step)
    for req, n in zip(reqs, counts):
        req.num_computed += n
    sampled = [rng.randrange(1000) for _ in step.sampling]
    batch.append_tokens(step.rows[step.sampling], np.array(sampled))
    for i, token in zip(step.sampling.tolist(), sampled):
        reqs[i].token_ids.append(token)
    return step


@pytest.mark.parametrize("seed", range(20))
def test_steps_match_the_per_request_reference(seed):
    """Random adds, removes (with condense), new blocks and chunked steps; after each
    step the runner's bookkeeping (computed tokens, sampled tokens) is applied to both."""
    rng = random.Random(seed)
    batch = new_batch()
    live: dict[str, Req] = {}
    next_block = 1
    for step_no in range(30):
        # Finish some requests, start others (at most max_num_seqs).
        for req_id in rng.sample(sorted(live), k=rng.randint(0, min(2, len(live)))):
            batch.remove_request(req_id)
            del live[req_id]
        for _ in range(rng.randint(0, 3)):
            if len(live) == batch.max_num_seqs:
                break
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
            computed = rng.choice([0, 0, BS * (len(prompt) // BS // 2)])
            blocks = list(range(next_block, next_block + -(-len(prompt) // BS)))
            next_block += len(blocks)
            req = Req(f"r{step_no}-{len(live)}", prompt, len(prompt), computed, blocks)
            add(batch, req)
            live[req.req_id] = req
        batch.condense()
        batch.check_invariants()
        if not live:
            continue
        # Schedule a chunk of each request's remaining tokens, in a shuffled order.
        order = rng.sample(sorted(live), k=len(live))
        reqs = [live[r] for r in order]
        counts = [rng.randint(1, len(r.token_ids) - r.num_computed) for r in reqs]
        check_step(batch, reqs, counts)
        step = run_step(batch, rng, order, reqs, counts)
        # Blocks for the next token of the requests that sampled.
        new_blocks = []
        for i in step.sampling.tolist():
            req = reqs[i]
            extra = []
            if len(req.token_ids) > len(req.block_ids) * BS:
                extra = [next_block]
                next_block += 1
                req.block_ids.append(extra[0])
            new_blocks.append(extra)
        sampling_ids = [order[i] for i in step.sampling.tolist()]
        batch.update_cached(sampling_ids, new_blocks, [live[r].num_computed for r in sampling_ids])
        # Requests at max_model_len would finish; drop them here.
        for req_id in sampling_ids:
            if len(live[req_id].token_ids) >= batch.max_model_len:
                batch.remove_request(req_id)
                del live[req_id]
        batch.check_invariants()


def test_condense_moves_the_last_rows_into_the_holes_with_their_state():
    batch = new_batch(max_num_seqs=5)
    reqs = [
        Req(
            f"r{i}",
            [10 * i + j for j in range(i + 2)],
            i + 2,
            0,
            [i + 1, i + 11],
            SamplingParams(temperature=0.5 + i, top_k=i, seed=i if i % 2 else None),
        )
        for i in range(5)
    ]
    assert [add(batch, r) for r in reqs] == [0, 1, 2, 3, 4]
    batch.remove_request("r1")
    batch.remove_request("r3")
    batch.check_invariants()
    assert batch.condense() == [(4, 1)]  # row 3 is past the new end: dropped
    batch.check_invariants()
    assert batch.num_reqs == 3
    assert batch.req_ids[:3] == ["r0", "r4", "r2"]
    assert batch.req_id_to_row == {"r0": 0, "r4": 1, "r2": 2}
    row = batch.req_id_to_row["r4"]
    assert batch.token_ids[row, :6].tolist() == reqs[4].token_ids
    assert batch.num_tokens[row] == 6 and batch.num_prompt_tokens[row] == 6
    assert batch.block_table.table[row, : batch.block_table.num_blocks[row]].tolist() == [5, 15]
    assert batch.sampling.temperature[row] == np.float32(4.5)
    assert batch.sampling.top_k[row] == 4 and not batch.sampling.seeded[row]
    check_step(batch, [reqs[4], reqs[0]], [6, 2])


def test_a_new_request_takes_a_hole_first():
    batch = new_batch(max_num_seqs=3)
    for i in range(3):
        add(batch, Req(f"r{i}", [1, 2], 2, 0, [i]))
    with pytest.raises(ValueError, match="max_num_seqs"):
        add(batch, Req("r3", [1], 1, 0, [3]))
    batch.remove_request("r1")
    assert add(batch, Req("r3", [7, 8, 9], 3, 0, [3])) == 1
    assert batch.condense() == []
    batch.check_invariants()
    with pytest.raises(ValueError, match="already has row"):
        add(batch, Req("r3", [1], 1, 0, [4]))
    assert batch.remove_request("gone") is None


def test_step_inputs_are_views_of_buffers_allocated_once():
    batch = new_batch()
    add(batch, Req("a", list(range(10)), 10, 0, [1, 2, 3]))
    add(batch, Req("b", list(range(5)), 5, 4, [4, 5]))
    first = batch.prepare(["a", "b"], [10, 1])
    second = batch.prepare(["b", "a"], [1, 3])
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
        assert getattr(first, name).data_ptr() == getattr(second, name).data_ptr(), name
    assert first.block_table.data_ptr() == second.block_table.data_ptr()
    # The second step overwrote the first's buffers.
    assert first.input_ids[:4].tolist() == [4, 0, 1, 2]


def test_limits_are_enforced():
    batch = new_batch(max_num_seqs=2, max_model_len=8, max_tokens=6)
    with pytest.raises(ValueError, match="max_model_len"):
        add(batch, Req("long", list(range(9)), 9, 0, [1, 2, 3]))
    add(batch, Req("a", list(range(8)), 8, 0, [1, 2]))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        batch.prepare(["a"], [8])
    with pytest.raises(ValueError, match="blocks"):
        batch.update_cached(["a"], [[3]], [0])


@dataclass
class State:
    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    output_ids: list[int]
    eos_token_id: int | None = 2
    generator: torch.Generator | None = None
    seen_tokens: SeenTokens | None = None


MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
    SamplingParams(temperature=1.3, top_k=5, min_p=0.05, logprobs=2),
    SamplingParams(temperature=0.9, repetition_penalty=1.2, presence_penalty=0.5),
    SamplingParams(temperature=1.0, frequency_penalty=-0.3, min_tokens=4, stop_token_ids=[7]),
    SamplingParams(temperature=0.8, logit_bias={3: 2.5}, allowed_token_ids=[1, 3, 5, 9]),
    SamplingParams(temperature=0.6, bad_words_token_ids=[[4, 6], [8]], logprobs=-1),
    SamplingParams(temperature=0.3, top_p=0.999999999),
]


def _metadata_fields(meta) -> dict:
    out = {}
    for name, value in vars(meta).items():
        if isinstance(value, tuple):
            value = tuple(v.tolist() for v in value)
        elif isinstance(value, torch.Tensor):
            value = (value.dtype, value.tolist())
        elif name == "generators":
            value = {i: id(g) for i, g in value.items()}
        out[name] = value
    return out


@pytest.mark.parametrize("seed", range(10))
def test_sampling_metadata_from_the_batch_arrays_equals_the_one_from_params(seed):
    """Same tensors (values and dtypes) whether built from SamplingParams or gathered from
    the InputBatch's rows, in any row order and after rows moved."""
    rng = random.Random(seed)
    batch = new_batch(max_num_seqs=len(MIXED_PARAMS) + 2)
    add(batch, Req("x", [1], 1, 0, [1]))
    states = {}
    for i, params in enumerate(rng.sample(MIXED_PARAMS, k=len(MIXED_PARAMS))):
        prompt = [rng.randrange(10) for _ in range(4)]
        output = [rng.randrange(10) for _ in range(rng.randint(0, 5))]
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        states[f"r{i}"] = State(params, prompt + output, 4, output, generator=gen)
        add(batch, Req(f"r{i}", prompt + output, 4, 0, [2], params))
    batch.remove_request("x")
    batch.condense()
    order = rng.sample(sorted(states), k=rng.randint(1, len(states)))
    chosen = [states[r] for r in order]
    arrays = batch.sampling.gather(batch.rows_of(order))
    from_params = build_sampling_metadata(chosen, 10)
    for s in chosen:  # penalties' seen tokens are built once and then kept
        s.seen_tokens = None
    from_arrays = build_sampling_metadata(chosen, 10, arrays)
    assert _metadata_fields(from_arrays) == _metadata_fields(from_params)
    assert isinstance(arrays, SamplingArrays)


def test_tokens_in_flight_are_named_for_the_next_step():
    """Async scheduling: a sampled token is a placeholder on the host until its id comes
    back; the next step names where it is an input (or that every input is one)."""
    from minivllm.worker.step_inputs import InFlightTokens

    batch = new_batch()
    for i, req_id in enumerate(["a", "b", "c"]):
        batch.add_request(req_id, [1, 2, 3, 4], 4, 0, [i], SamplingParams())
    batch.advance(batch.prepare(["a", "b", "c"], [4, 4, 3]))  # c's prompt has a chunk left
    rows = batch.rows_of(["a", "b"])
    positions = batch.append_placeholders(rows)
    assert positions.tolist() == [4, 4]
    assert batch.num_tokens[rows].tolist() == [5, 5]
    in_flight = InFlightTokens(["a", "b"], positions, torch.tensor([70, 80]))

    steady = batch.prepare(["a", "b"], [1, 1], in_flight)
    assert steady.in_flight_all and steady.in_flight_inputs is None

    mixed = batch.prepare(["c", "b"], [1, 1], in_flight)  # c's last prompt token, then b's
    assert not mixed.in_flight_all
    dst, src = mixed.in_flight_inputs
    assert (dst.tolist(), src.tolist()) == ([1], [1])
    assert mixed.input_ids[0] == 4  # c's own prompt token, from the host

    batch.set_tokens(["a", "b", "gone"], np.array([4, 4, 9]), [70, 80, 90])
    assert batch.token_ids[rows, 4].tolist() == [70, 80]


def test_proposals_get_logits_rows_and_go_to_attention_as_decode_rows():
    """Speculative decoding: a request's proposals are inputs after its last token; it
    samples at each of them and at that token; with drafts_as_decode_rows a step of such
    requests gives attention one row per token, each seeing up to its own position."""
    batch = new_batch()
    a = Req("a", [1, 2, 3, 4, 5, 6], 5, 5, [0, 1])  # decoding: token 6 not yet computed
    b = Req("b", [7, 8, 9, 10], 3, 3, [2])
    for req in (a, b):
        add(batch, req)
    batch.set_drafts({"a": [20, 21]})
    drafts = np.array([2, 0])
    for as_rows in (False, True):
        step = batch.prepare(["a", "b"], [3, 1], None, drafts, as_rows)
        assert step.input_ids.tolist() == [6, 20, 21, 10]
        assert step.positions.tolist() == [5, 6, 7, 3]
        assert step.sampling.tolist() == [0, 1] and step.num_logits.tolist() == [3, 1]
        assert step.logits_indices.tolist() == [0, 1, 2, 3]
        if as_rows:
            assert step.query_start_loc.tolist() == [0, 1, 2, 3, 4]
            assert step.seq_lens.tolist() == [6, 7, 8, 4]
            assert step.max_query_len == 1 and step.num_attn_rows == 4
            assert step.block_table.tolist() == [[0, 1], [0, 1], [0, 1], [2, 0]]
        else:
            assert step.query_start_loc.tolist() == [0, 3, 4]
            assert step.seq_lens.tolist() == [8, 4]
            assert step.max_query_len == 3 and step.num_attn_rows == 2
    # The kept tokens replace the proposals; a prompt's chunk keeps the step per request.
    batch.append_token_lists(np.array([0, 1]), [[20, 30], [11]])
    assert batch.token_ids[0, :8].tolist() == [1, 2, 3, 4, 5, 6, 20, 30]
    assert batch.num_tokens[:2].tolist() == [8, 5]
    c = Req("c", list(range(40, 50)), 10, 0, [3, 4, 5])
    add(batch, c)
    batch.set_drafts({"a": [31]})
    batch.num_computed_tokens[:2] = [7, 4]
    step = batch.prepare(["a", "b", "c"], [2, 1, 4], None, np.array([1, 0, 0]), True)
    assert step.num_attn_rows == 3 and step.max_query_len == 4
    assert step.sampling.tolist() == [0, 1] and step.logits_indices.tolist() == [0, 1, 2]


def test_decode_steps_equal_the_full_path_through_membership_changes():
    """One token per request takes prepare's decode shortcut; each such step equals the
    reference and the full path's answer (forced by zero proposals, same inputs), while
    requests join (with a prefill chunk: the full path), leave and move rows."""
    rng = random.Random(7)
    batch = new_batch()
    live: dict[str, Req] = {}
    next_block = 1
    for step_no in range(24):
        if step_no % 5 == 0 or not live:  # a newcomer, prefilled in this step
            prompt = [rng.randrange(1000) for _ in range(rng.randint(2, 9))]
            blocks = list(range(next_block, next_block + -(-(len(prompt) + 30) // BS)))
            next_block += len(blocks)
            req = Req(f"r{step_no}", prompt, len(prompt), 0, blocks)
            add(batch, req)
            live[req.req_id] = req
        if step_no % 7 == 3 and len(live) > 1:  # one leaves: the last row moves into its hole
            gone = sorted(live)[0]
            batch.remove_request(gone)
            del live[gone]
            batch.condense()
        order = rng.sample(sorted(live), k=len(live))
        reqs = [live[r] for r in order]
        counts = [len(r.token_ids) - r.num_computed for r in reqs]
        check_step(batch, reqs, counts)
        if all(n == 1 for n in counts):
            fast = batch.prepare(order, counts)
            fast = {k: getattr(fast, k).tolist() for k in _STEP_FIELDS}
            full = batch.prepare(order, counts, num_drafts=np.zeros(len(order), np.int64))
            assert fast == {k: getattr(full, k).tolist() for k in _STEP_FIELDS}
        run_step(batch, rng, order, reqs, counts)
        batch.check_invariants()


_STEP_FIELDS = (
    "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table",
    "logits_indices", "sampling", "rows",
)  # fmt: skip
