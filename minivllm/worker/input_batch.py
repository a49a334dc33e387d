"""The runner's requests as rows of preallocated arrays; each step's inputs as slices of
persistent buffers.

A request takes a row when the scheduler first sends it, and keeps it until it finishes or
is preempted; its token ids, counters, block table and sampling parameters live in arrays
of ``max_num_seqs`` rows, updated from the scheduler's diffs (new blocks, computed
tokens, sampled tokens), never rebuilt. Removing requests leaves holes that ``condense``
fills from the last rows, so the rows in use are always ``[0, num_reqs)``.

``prepare`` turns a step (requests in the scheduler's order, tokens each) into the model's
inputs with vectorized numpy over those arrays, written into buffers allocated once
(``input_ids``, ``positions``, ``slot_mapping`` sized to ``max_num_batched_tokens``;
``query_start_loc``, ``seq_lens``, ``block_table`` sized to ``max_num_seqs``). On a GPU
each has a twin on the device, filled by one non-blocking copy from pinned host memory
per buffer and step; on the CPU the host buffer is the one the model reads.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.platforms import get_platform
from minivllm.sample.metadata import SamplingArrays
from minivllm.sampling_params import SamplingParams
from minivllm.worker.block_table import BlockTable
from minivllm.worker.device_buffers import CpuGpuBuffer, GraphInputs
from minivllm.worker.step_inputs import InFlightTokens, StepInputs


class InputBatch:
    """Per-request state in preallocated arrays, and the step's persistent input buffers.

    Safety rules: a row's arrays are valid up to its counters (``num_tokens`` token ids,
    ``num_blocks`` block ids); rows ``[num_reqs, max_num_seqs)`` hold stale data, never read.
    ``check_invariants`` states the bookkeeping that must hold between steps.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.platform = get_platform(self.device.type)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size

        self.req_ids: list[str | None] = [None] * max_num_seqs
        self.req_id_to_row: dict[str, int] = {}
        self.num_reqs = 0  # rows [0, num_reqs) are in use once condensed
        # Bumped whenever a row changes hands (added, removed, moved): what was derived from
        # the rows' parameters (the sampling metadata of a steady batch) is stale then.
        self.version = 0
        self._holes: list[int] = []  # rows freed since the last condense
        # rows_of's last answer: (version, req_ids, rows).
        self._rows_memo: tuple[int, list[str], np.ndarray] | None = None

        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int32)  # prompt + output
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(max_num_seqs, max_blocks, block_size)
        self.sampling = SamplingArrays.empty(max_num_seqs)

        # The step's inputs: allocated once, written through numpy views.
        def buffer(size: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(size, dtype, self.device)

        self._input_ids = buffer(max_num_batched_tokens, torch.int64)
        self._positions = buffer(max_num_batched_tokens, torch.int64)
        self._slot_mapping = buffer(max_num_batched_tokens, torch.int64)
        self._query_start_loc = buffer(max_num_seqs + 1, torch.int32)
        self._seq_lens = buffer(max_num_seqs, torch.int32)
        # A row per sampling request, or per proposed token too (at most one per token).
        self._logits_indices = buffer(max(max_num_seqs, max_num_batched_tokens), torch.int64)
        self._block_table = buffer(max_num_seqs * max_blocks, torch.int32)
        self._in_flight_dst = buffer(max_num_seqs, torch.int64)
        self._in_flight_src = buffer(max_num_seqs, torch.int64)
        # Recorded after a step's copies to the device: the next step waits for it before
        # it writes the pinned buffers again (a step that samples nothing never syncs).
        self._copied = None  # the platform's event, where it has them
        # 0, 1, 2, ...: offsets of tokens within their request come from slices of it.
        self._arange = np.arange(max(max_num_batched_tokens, max_num_seqs) + 1, dtype=np.int64)

    # ------------------------------------------------------------------ rows

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        block_ids: list[int],
        sampling_params: SamplingParams,
    ) -> int:
        """Give the request a row (a hole first, else the next free one); returns it."""
        if req_id in self.req_id_to_row:
            raise ValueError(f"request {req_id!r} already has row {self.req_id_to_row[req_id]}")
        n = len(token_ids)
        if n > self.max_model_len:
            raise ValueError(
                f"request {req_id!r} has {n} tokens, max_model_len is {self.max_model_len}"
            )
        if self._holes:
            row = self._holes.pop()
        elif self.num_reqs < self.max_num_seqs:
            row = self.num_reqs
            self.num_reqs += 1
        else:
            raise ValueError(f"more than max_num_seqs={self.max_num_seqs} requests")
        self.version += 1
        self.req_ids[row] = req_id
        self.req_id_to_row[req_id] = row
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed_tokens
        self.block_table.add_row(row, block_ids)
        self.sampling.set_row(row, sampling_params)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row (a hole until ``condense``); None if it has none."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        self.req_ids[row] = None
        self._holes.append(row)
        return row

    def condense(self) -> list[tuple[int, int]]:
        """Move the last rows in use into the holes, so rows ``[0, num_reqs)`` are the
        requests; returns the (from, to) moves."""
        holes = sorted(self._holes)
        self._holes = []
        moves = []
        num_reqs = self.num_reqs - len(holes)
        last = self.num_reqs - 1
        for hole in holes:
            if hole >= num_reqs:
                break  # the holes past the end are simply dropped
            while self.req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            moves.append((last, hole))
            last -= 1
        self.num_reqs = num_reqs
        return moves

    def _move_row(self, src: int, dst: int) -> None:
        self.version += 1
        req_id = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_row[req_id] = dst
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            array[dst] = array[src]
        self.block_table.move_row(src, dst)
        self.sampling.move_row(src, dst)

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The requests' rows (read-only). A steady batch asks for the same requests in the
        same order every step, twice (its diffs, its inputs): while no row changed hands,
        the last answer is the answer (a list compare, not a lookup per request), the same
        array, on which the runner keys its states (ModelRunner._states_of)."""
        memo = self._rows_memo
        if memo is not None and memo[0] == self.version and memo[1] == req_ids:
            return memo[2]
        index = self.req_id_to_row
        rows = np.fromiter((index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        rows.flags.writeable = False
        self._rows_memo = (self.version, list(req_ids), rows)
        return rows

    def update_cached(
        self, req_ids: list[str], new_block_ids: list[list[int]], num_computed: list[int]
    ) -> None:
        """The scheduler's diffs for requests that keep their rows."""
        if not req_ids:
            return
        rows = self.rows_of(req_ids)
        self.num_computed_tokens[rows] = num_computed
        if any(new_block_ids):  # most decode steps fill no block
            for row, block_ids in zip(rows.tolist(), new_block_ids):
                if block_ids:
                    self.block_table.append_row(row, block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One sampled token for each row."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def append_token_lists(self, rows: np.ndarray, token_lists: list[list[int]]) -> None:
        """Each row's sampled tokens (speculative decoding keeps one or more a step)."""
        for row, tokens in zip(rows.tolist(), token_lists):
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(tokens)] = tokens
            self.num_tokens[row] = n + len(tokens)

    def set_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Speculative decoding: write each request's proposed tokens after its known ones,
        where ``prepare`` reads this step's inputs (past ``num_tokens``, so not yet its own)."""
        for req_id, tokens in drafts.items():
            row = self.req_id_to_row[req_id]
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(tokens)] = tokens

    def append_placeholders(self, rows: np.ndarray) -> np.ndarray:
        """One sampled token for each row whose id is still on the device (async
        scheduling); returns their positions, for ``set_tokens`` once the ids are here."""
        positions = self.num_tokens[rows].astype(np.int64)
        self.token_ids[rows, positions] = -1  # never read: the next step takes the device's
        self.num_tokens[rows] += 1
        return positions

    def set_tokens(self, req_ids: list[str], positions: np.ndarray, token_ids: list[int]) -> None:
        """The ids of placeholders, once on the host; rows gone since are skipped."""
        for req_id, position, token_id in zip(req_ids, positions.tolist(), token_ids):
            row = self.req_id_to_row.get(req_id)
            if row is not None and position < self.num_tokens[row]:
                self.token_ids[row, position] = token_id

    def advance(self, step: StepInputs) -> None:
        """The step's tokens are in the cache now."""
        self.num_computed_tokens[step.rows] += step.num_scheduled

    # ------------------------------------------------------------------ steps

    def prepare(
        self,
        req_ids: list[str],
        num_scheduled: list[int],
        in_flight: InFlightTokens | None = None,
        num_drafts: np.ndarray | None = None,
        drafts_as_decode_rows: bool = False,
        graph: GraphInputs | None = None,
    ) -> StepInputs:
        """The model's inputs for these requests (in this order) and token counts; with
        ``in_flight``, the inputs among its tokens are taken from the device. With
        ``num_drafts`` (per request, its proposed tokens at the end of its count, written by
        ``set_drafts``), a request samples at each proposal and at its last known token;
        with ``drafts_as_decode_rows`` too, a step of such requests alone (each computing its
        last token and its proposals) goes to attention as one-token rows, a decode step's
        shape (CPU and CUDA graphs replay it): each token attends up to its own position,
        as it would have in a step of its own. With ``graph``, a step of one-token rows
        that a decode graph can run is sent into the graphs' inputs (``graph_size`` set)."""
        rows = self.rows_of(req_ids)
        num_reqs = len(rows)
        counts = np.asarray(num_scheduled, dtype=np.int32)
        # A decode step (one token per request, no proposals) skips the per-token spreading:
        # each request's token is its row, at its computed count. Same values as below.
        one_each = num_drafts is None and all(n == 1 for n in num_scheduled)
        if one_each:
            total = num_reqs
            ends = self._arange[1 : num_reqs + 1]
        else:
            ends = np.cumsum(counts, dtype=np.int64)
            total = int(ends[-1])
        if total > self.max_num_batched_tokens:
            raise ValueError(
                f"{total} tokens in one step, max_num_batched_tokens is "
                f"{self.max_num_batched_tokens}"
            )
        if self._copied is not None:
            self._copied.synchronize()
        qsl = self._query_start_loc.np
        qsl[0] = 0
        qsl[1 : num_reqs + 1] = ends
        computed = self.num_computed_tokens[rows]
        positions = self._positions.np[:total]
        if one_each:
            starts = self._arange[:num_reqs]
            token_rows = rows
            positions[:] = computed
            self._input_ids.np[:total] = self.token_ids[rows, computed]
        else:
            starts = ends - counts
            # Per token: its request's row, and its position (computed tokens + offset).
            token_rows = np.repeat(rows, counts)
            offsets = self._arange[:total] - np.repeat(starts, counts)
            np.add(np.repeat(computed, counts), offsets, out=positions)
            flat = token_rows * self.max_model_len + positions
            self._input_ids.np[:total] = self.token_ids.ravel()[flat]
        self._slot_mapping.np[:total] = self.block_table.slots(token_rows, positions)

        req_seq_lens = computed + counts
        # Attention's rows: the requests, or (proposals as decode rows) each token.
        attn_rows, num_attn = rows, num_reqs
        if (
            drafts_as_decode_rows
            and num_drafts is not None
            and total <= self.max_num_seqs
            and np.array_equal(counts, num_drafts + 1)
            and (computed + 1 == self.num_tokens[rows]).all()
        ):
            attn_rows, num_attn = token_rows, total
            qsl[1 : total + 1] = self._arange[1 : total + 1]
        seq_lens = self._seq_lens.np[:num_attn]
        if num_attn == num_reqs:
            seq_lens[:] = req_seq_lens
        else:
            np.add(positions, 1, out=seq_lens)
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // self.block_size)
        table = self._block_table.np[: num_attn * width].reshape(num_attn, width)
        np.take(self.block_table.table[:, :width], attn_rows, axis=0, out=table)
        # Only the blocks the context fills; the rest of each row is 0.
        needed = (seq_lens + (self.block_size - 1)) // self.block_size
        np.multiply(table, self._arange[:width] < needed[:, None], out=table)

        # A request samples when this step reaches its last known token.
        known = req_seq_lens if num_drafts is None else req_seq_lens - num_drafts
        sampling = np.flatnonzero(known == self.num_tokens[rows])
        num_logits = None
        if num_drafts is None:
            num_sampling = len(sampling)
            self._logits_indices.np[:num_sampling] = ends[sampling] - 1
        else:  # rows ends - 1 - drafts ... ends - 1 of each sampling request
            num_logits = num_drafts[sampling] + 1
            num_sampling = int(num_logits.sum())
            last = np.repeat(ends[sampling] - 1, num_logits)
            back = np.repeat(np.cumsum(num_logits), num_logits) - self._arange[1 : num_sampling + 1]
            self._logits_indices.np[:num_sampling] = last - back
        size = None  # a decode graph's, if one runs this step
        if graph is not None and num_attn == total:
            size = graph.padded_size(num_attn)
        if size is None:
            tensors = dict(
                input_ids=self._input_ids.copy_to_gpu(total),
                positions=self._positions.copy_to_gpu(total),
                slot_mapping=self._slot_mapping.copy_to_gpu(total),
                query_start_loc=self._query_start_loc.copy_to_gpu(num_attn + 1),
                seq_lens=self._seq_lens.copy_to_gpu(num_attn),
                block_table=self._block_table.copy_to_gpu(num_attn * width, (num_attn, width)),
                logits_indices=self._logits_indices.copy_to_gpu(num_sampling),
            )
        else:
            tensors = self._send_to_graph(graph, num_attn, size, width, num_sampling)
        step = StepInputs(
            req_ids=req_ids,
            rows=rows,
            num_scheduled=counts,
            positions_cpu=self._positions.head(total),
            query_start_loc_cpu=self._query_start_loc.head(num_attn + 1),
            seq_lens_cpu=self._seq_lens.head(num_attn),
            max_query_len=1 if num_attn == total else int(counts.max()),
            max_seq_len=max_seq_len,
            sampling=sampling,
            num_logits=num_logits,
            graph_size=size,
            **tensors,
        )
        if in_flight is not None:
            if total == num_reqs and in_flight.req_ids == req_ids:
                # Each request's one input is its token in flight (the usual decode step).
                step.in_flight_all = True
            else:
                step.in_flight_inputs = self._in_flight_inputs(
                    in_flight, req_ids, starts, computed, counts
                )
        self._copied = self.platform.record_event()
        if step.in_flight_all:  # the last step's draws, still on the device
            step.input_ids.copy_(in_flight.sampled)
        elif step.in_flight_inputs is not None:  # some of them
            dst, src = step.in_flight_inputs
            step.input_ids[dst] = in_flight.sampled[src]
        return step

    def _send_to_graph(
        self, graph: GraphInputs, n: int, size: int, width: int, num_sampling: int
    ) -> dict[str, torch.Tensor]:
        """A decode step's inputs (n one-token rows) into the graphs' buffers, padded to
        the graph's size, in one copy; the step's tensors are views of them there."""
        g = graph.np
        for name, buffer in (
            ("input_ids", self._input_ids),
            ("positions", self._positions),
            ("slot_mapping", self._slot_mapping),
            ("seq_lens", self._seq_lens),
        ):
            g[name][:n] = buffer.np[:n]
        g["logits_indices"][:num_sampling] = self._logits_indices.np[:num_sampling]
        g["block_table"][:n, :width] = self._block_table.np[: n * width].reshape(n, width)
        graph.send(n, size)
        dev = graph.dev
        return dict(
            input_ids=dev["input_ids"][:n],
            positions=dev["positions"][:n],
            slot_mapping=dev["slot_mapping"][:n],
            query_start_loc=graph.query_start_loc[: n + 1],
            seq_lens=dev["seq_lens"][:n],
            block_table=dev["block_table"][:n, :width],
            logits_indices=dev["logits_indices"][:num_sampling],
        )

    def _in_flight_inputs(
        self,
        in_flight: InFlightTokens,
        req_ids: list[str],
        starts: np.ndarray,
        computed: np.ndarray,
        counts: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token index in the step, row of in_flight.sampled) of each input in flight."""
        index = in_flight.index
        src = np.fromiter((index.get(r, -1) for r in req_ids), np.int64, len(req_ids))
        steps = np.flatnonzero(src >= 0)
        if not len(steps):
            return None
        src = src[steps]
        offsets = in_flight.positions[src] - computed[steps]
        inside = (offsets >= 0) & (offsets < counts[steps])
        n = int(inside.sum())
        if not n:
            return None
        self._in_flight_dst.np[:n] = starts[steps][inside] + offsets[inside]
        self._in_flight_src.np[:n] = src[inside]
        return self._in_flight_dst.copy_to_gpu(n), self._in_flight_src.copy_to_gpu(n)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Rows in use and the id index agree; counters stay within their arrays."""
        live = [r for r in range(self.num_reqs) if self.req_ids[r] is not None]
        assert {self.req_ids[r]: r for r in live} == self.req_id_to_row
        assert sorted(self._holes) == [r for r in range(self.num_reqs) if r not in live]
        assert all(r is None for r in self.req_ids[self.num_reqs :])
        rows = np.asarray(live, dtype=np.int64)
        assert (self.num_computed_tokens[rows] <= self.num_tokens[rows]).all()
        assert (self.num_prompt_tokens[rows] <= self.num_tokens[rows]).all()
        assert (self.num_tokens[rows] <= self.max_model_len).all()
        assert (
            self.block_table.num_blocks[rows] * self.block_size >= self.num_computed_tokens[rows]
        ).all()
