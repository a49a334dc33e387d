"""Host buffers and their twins on the device: the step's inputs are written on the host
(numpy) and sent in non-blocking copies from pinned memory.

``CpuGpuBuffer`` is one buffer and its twin (a copy per buffer and step). ``GraphInputs`` is
every input of a decode step's CUDA graph packed into one buffer, so that such a step sends
its inputs in one copy and the graph reads them where it was captured: no copy into the
graph's own buffers, no per-buffer launches. On the CPU the host buffer is the one the
model reads, and nothing is copied.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.platforms import get_platform


class CpuGpuBuffer:
    """A persistent buffer on the host (``cpu``, written through ``np``) and its twin on
    the device (``gpu``); one tensor when the device is the CPU."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_host = get_platform(device.type).host_is_device
        # Pinned host memory: the copy to the device runs without blocking the host.
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=not on_host)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if on_host else torch.zeros(size, dtype=dtype, device=device)
        self._head: tuple[int, tuple[int, ...] | None, torch.Tensor] | None = None

    def head(self, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The host buffer's first n values (viewed as ``shape``): the same view while n
        and shape repeat, as a steady decode's do (a slice is ~1 us of torch each)."""
        memo = self._head
        if memo is not None and memo[0] == n and memo[1] == shape:
            return memo[2]
        view = self.cpu[:n] if shape is None else self.cpu[:n].view(shape)
        self._head = (n, shape, view)
        return view

    def copy_to_gpu(self, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The first n values on the device (copied there unless it is the CPU), viewed as
        ``shape`` if given."""
        if self.gpu is self.cpu:
            return self.head(n, shape)
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n] if shape is None else self.gpu[:n].view(shape)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The padded batch sizes of the decode graphs: 1, 2, 4, 8, then every 16, as far as a
    decode step can go (one token per sequence)."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    return [s for s in (1, 2, 4, 8, *range(16, limit + 1, 16)) if s <= limit]


# (name, dtype, values per row): the vectors first, then the block table, whose rows are
# last so that a step of n rows sends one prefix of the buffer.
_VECTORS = (
    ("input_ids", torch.int64),
    ("positions", torch.int64),
    ("slot_mapping", torch.int64),
    ("logits_indices", torch.int64),
    ("seq_lens", torch.int32),
)


class GraphInputs:
    """The decode graphs' static inputs for up to ``sizes[-1]`` rows, as typed views of one
    pinned host buffer (``host``, numpy views in ``np``) and its device twin (``dev``).

    A decode step of n rows runs as the graph of ``padded_size(n)`` rows; ``send`` copies
    the vectors and that many block-table rows. The padded rows write no cache slot (-1)
    and read one key (their block table row holds block ids of some earlier step, or 0);
    their outputs are dropped. The block table keeps max_model_len's width: a step writes
    the columns its contexts fill, and the kernel reads no further."""

    def __init__(
        self, sizes: list[int], max_blocks: int, device: torch.device, twin: bool | None = None
    ) -> None:
        """twin: a device buffer apart from the host's (default: unless the host is the
        device; the tests ask for one on the CPU)."""
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        rows = self.sizes[-1]
        layout, offset = [], 0
        for name, dtype in _VECTORS:
            nbytes = rows * dtype.itemsize
            layout.append((name, dtype, offset, (rows,)))
            offset += -(-nbytes // 8) * 8  # every view 8-byte aligned
        self._table_offset = offset
        layout.append(("block_table", torch.int32, offset, (rows, max_blocks)))
        offset += rows * max_blocks * 4
        on_host = get_platform(device.type).host_is_device
        if twin is None:
            twin = not on_host
        pin = twin and not on_host  # a twin on the CPU itself (the tests') needs no pinning
        self._host_buf = torch.zeros(offset, dtype=torch.uint8, pin_memory=pin)
        self._dev_buf = (
            torch.zeros(offset, dtype=torch.uint8, device=device) if twin else self._host_buf
        )
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, dtype, start, shape in layout:
            count = int(np.prod(shape))
            end = start + count * dtype.itemsize
            self.host[name] = self._host_buf[start:end].view(dtype).view(shape)
            self.dev[name] = self._dev_buf[start:end].view(dtype).view(shape)
        self.np = {name: t.numpy() for name, t in self.host.items()}
        self.np["slot_mapping"][:] = -1
        self.np["seq_lens"][:] = 1
        # One token per row: row i's query is token i, always.
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def padded_size(self, rows: int) -> int | None:
        """The graph size a step of ``rows`` one-token rows runs as; None: none fits."""
        return next((s for s in self.sizes if s >= rows), None)

    def send(self, rows: int, size: int) -> None:
        """Pad rows [rows, size) (token 0 at position 0, no slot, one key) and send the
        inputs of ``size`` rows to the device in one non-blocking copy. The padding is
        written every step: the host's rows may hold an earlier step's placeholders for
        tokens in flight (-1), which only the device's copy had replaced."""
        self.np["input_ids"][rows:size] = 0
        self.np["positions"][rows:size] = 0
        self.np["slot_mapping"][rows:size] = -1
        self.np["seq_lens"][rows:size] = 1
        if self._dev_buf is not self._host_buf:
            n = self._table_offset + size * self.max_blocks * 4
            self._dev_buf[:n].copy_(self._host_buf[:n], non_blocking=True)
