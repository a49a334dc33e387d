"""Attention for the CPU: the rows with one query token batched through one paged read (C
kernel or torch), the spans with several query tokens one by one (SDPA, or a masked matmul
after earlier context).

With the C kernel, every query token is a one-token row over the cache, and a prompt's
rows go to the kernel in tiles of ATTENTION_TILE_ROWS that share each block's loads.

Layout of a layer's cache ([2, num_blocks, block_size, Hkv, D] as allocated): a value block
is stored head-major, [Hkv, block_size, D], so a KV head's rows of a block are one run of
memory (a quantized row of D + 4 bytes otherwise straddles two cache lines, each shared
with another head's row); a key block is transposed, [Hkv, D, block_size], so the kernel
computes a block's scores with straight vector loads. ``kv_views`` gives both as views,
the values' indexed [block, offset, head] as before; only this module knows the layout.

A quantized cache (``kv_cache_dtype``, see kv_quant.py) is bytes in the same shape with
each head row widened to ``row_width(D)``: a value row is the D values and int8's scale; a
key block's head is the D x block_size values transposed, then block_size scales. A
block-major cache (float16 keys: fp16k_int8v, fp16k_e4m3v, fp16k_e5m2v) holds each block's
keys, [Hkv, D, block_size] float16, and then its values (int8 or fp8), [Hkv, block_size, D +
4] bytes, together (``kv_views`` gives both as views).
The C kernels write and read it in place; without them, torch gathers and dequantizes the
blocks a step reads (``_QuantizedCache``, ``_Fp16KeysCache``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.attention.backend import AttentionBackend, CommonAttentionMetadata
from minivllm.attention.kv_quant import (
    KVCacheFormat,
    dequantize_rows,
    kv_cache_format,
    quantize_rows,
)
from minivllm.kernels.cpu_kernels import (
    ATTENTION_TILE_ROWS,
    is_cpu_f32,
    load_kernels,
    paged_attention,
)
from minivllm.kernels.cpu_kernels import write_kv as cpu_write_kv


@dataclass
class QuerySpan:
    """One request with several query tokens: rows [start, end) of the batch."""

    start: int
    end: int
    seq_len: int  # tokens of context including this step's
    block_ids: torch.Tensor  # [blocks holding seq_len tokens] long


@dataclass
class CPUAttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] long, flat slot of each token's K/V
    # Requests with a single query token, batched together.
    num_singles: int
    single_rows: torch.Tensor  # [num_singles] long, their rows in the batch
    single_block_table: torch.Tensor  # [num_singles, max_blocks] long
    single_seq_lens: torch.Tensor  # [num_singles] long
    # Requests with several query tokens (a prompt or a chunk of one), one by one.
    spans: list[QuerySpan]
    # With the kernel: bounds of the tiles of one-token rows the kernel attends together
    # (consecutive rows of one request), or None when every row is its own request's.
    tiles: torch.Tensor | None = None
    # Each one-token row's first attended position, by sliding window: made once a step.
    window_starts: dict[int, torch.Tensor] = field(default_factory=dict)

    def starts_for_window(self, window: int) -> torch.Tensor:
        """[num_singles] long: the first position each one-token row attends under a sliding
        window. Made with numpy, not torch ops: a CPU graph's replay makes it again each
        step, and its capture must see no computing op."""
        starts = self.window_starts.get(window)
        if starts is None:
            starts = torch.from_numpy(np.maximum(self.single_seq_lens.numpy() - window, 0))
            self.window_starts[window] = starts
        return starts


_ARANGE = torch.arange(1024)


def _arange(n: int) -> torch.Tensor:
    """0 .. n-1 as int64: a view of one kept tensor for the usual sizes (never written)."""
    return _ARANGE[:n] if n <= _ARANGE.numel() else torch.arange(n)


class CPUAttentionBackend(AttentionBackend):
    def __init__(self, block_size: int, kv_cache_dtype: str = "auto") -> None:
        self.block_size = block_size
        self.kv_format = kv_cache_format(kv_cache_dtype)
        # The C kernel reads KV blocks in place; without it, one-token rows gather them first.
        self.kernels = load_kernels("MINIVLLM_CPU_ATTN_KERNEL")
        self.write_kernel = load_kernels("MINIVLLM_CPU_LAYER_KERNELS")

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, common: CommonAttentionMetadata) -> CPUAttentionMetadata:
        """Split the batch into one-token rows and several-token spans; with the kernel,
        every token is a one-token row."""
        bs = self.block_size
        starts = common.query_start_loc_cpu.numpy()
        seq_lens = common.seq_lens_cpu.numpy()
        table = common.block_table.numpy()
        if self.kernels is not None:
            return self._token_rows(common, starts, seq_lens, table)
        single = (starts[1:] - starts[:-1]) == 1
        rows = np.flatnonzero(single)
        single_lens = seq_lens[rows].astype(np.int64)
        width = -(-int(single_lens.max()) // bs) if rows.size else 0
        spans = [
            QuerySpan(
                int(starts[i]),
                int(starts[i + 1]),
                int(seq_lens[i]),
                torch.from_numpy(table[i, : -(-int(seq_lens[i]) // bs)].astype(np.int64)),
            )
            for i in np.flatnonzero(~single).tolist()
        ]
        return CPUAttentionMetadata(
            num_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping,
            num_singles=int(rows.size),
            single_rows=torch.from_numpy(starts[rows].astype(np.int64)),
            single_block_table=torch.from_numpy(table[rows, :width].astype(np.int64)),
            single_seq_lens=torch.from_numpy(single_lens),
            spans=spans,
        )

    def _token_rows(self, common, starts, seq_lens, table) -> CPUAttentionMetadata:
        """Every query token as its own one-token row over the cache (this step's K/V are
        written first): a token's result then depends only on its query and its context,
        never on how its prompt was chunked, cached or batched. SDPA over a whole prompt
        and a masked product after a cached prefix round differently, and int8 activations
        can turn that into a different greedy token."""
        total = int(starts[-1])
        tiles = None
        if total == seq_lens.size:  # a decode step: each request one row, at its length
            lens = seq_lens.astype(np.int64)
            owner = slice(None)
        else:
            counts = starts[1:] - starts[:-1]
            owner = np.repeat(np.arange(counts.size), counts)
            # Request i's last token sees seq_lens[i] positions, each earlier one a position less.
            lens = np.repeat(seq_lens.astype(np.int64) - starts[1:], counts) + np.arange(
                1, total + 1
            )
            if total > counts.size:  # some request has several rows: tile them
                offset = np.arange(total) - starts[owner]  # each row's index in its request
                bounds = np.flatnonzero(offset % ATTENTION_TILE_ROWS == 0)
                tiles = torch.from_numpy(np.append(bounds, total).astype(np.int64))
        width = -(-int(lens.max()) // self.block_size)
        return CPUAttentionMetadata(
            num_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping,
            num_singles=total,
            single_rows=_arange(total),
            single_block_table=torch.from_numpy(table[owner, :width].astype(np.int64)),
            single_seq_lens=torch.from_numpy(lens),
            spans=[],
            tiles=tiles,
        )

    def forward(
        self,
        q,
        k,
        v,
        kv_cache,
        metadata: CPUAttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = metadata
        num_tokens, num_heads, head_dim = q.shape
        fmt = self.kv_format
        k_cache, v_cache = kv_views(kv_cache, fmt)
        if self.write_kernel is not None and _rows_of_heads(k, v) and is_cpu_f32(k, v):
            if fmt.quantized or is_cpu_f32(kv_cache):
                cpu_write_kv(self.write_kernel, k, v, k_cache, v_cache, meta.slot_mapping, fmt.code)
            else:
                write_kv(kv_cache, k, v.contiguous(), meta.slot_mapping)
        elif fmt.quantized:
            torch_cache(kv_cache, fmt, head_dim).write(k, v, meta.slot_mapping)
        else:
            write_kv(kv_cache, k, v.contiguous(), meta.slot_mapping)
        masks = _Masking(sliding_window, logits_soft_cap, sinks)
        use_kernel = self.kernels is not None and q.dtype == torch.float32

        if use_kernel and meta.num_singles == num_tokens:
            # The kernel's metadata makes every token a one-token row, in order: the kernel
            # reads q in place (rows may be a view of the fused qkv) and its output is the
            # result. (Metadata split into spans is built only without the kernel.)
            out = paged_attention(
                self.kernels,
                q,
                k_cache,
                v_cache,
                meta.single_block_table,
                meta.single_seq_lens,
                scale,
                sliding_window,
                meta.starts_for_window(sliding_window) if sliding_window is not None else None,
                meta.tiles,
                logits_soft_cap,
                sinks,
                fmt.code,
            )
            return out.view(num_tokens, num_heads * head_dim)

        # Without the kernel: blocks gathered (and dequantized) by torch.
        blocks = torch_cache(kv_cache, fmt, head_dim) if fmt.quantized else None
        keys_of = blocks.keys if blocks else k_cache.__getitem__
        values_of = blocks.values if blocks else v_cache.__getitem__
        out = q.new_empty(num_tokens, num_heads, head_dim)
        for span in meta.spans:
            qs = q[span.start : span.end]
            length = span.end - span.start
            # Keys before `first` are outside every query's window: never read them.
            first = masks.first_key(span.seq_len - length)
            if length == span.seq_len and not fmt.quantized:
                # No earlier context: this chunk's K/V are all there is. (A quantized
                # cache's are read back as stored, as the kernel reads them.)
                ks, vs = k[span.start + first : span.end], v[span.start + first : span.end]
            else:
                ks = keys_of(span.block_ids).permute(0, 3, 1, 2).flatten(0, 1)
                vs = values_of(span.block_ids).flatten(0, 1)
                ks, vs = ks[first : span.seq_len].to(q.dtype), vs[first : span.seq_len].to(q.dtype)
            out[span.start : span.end] = _causal_attention(
                qs, ks, vs, span.seq_len, scale, masks, first
            )
        if meta.num_singles:
            out[meta.single_rows] = _paged_single_query(
                q[meta.single_rows], keys_of, values_of, meta, scale, masks
            )
        return out.view(num_tokens, num_heads * head_dim)


class _QuantizedCache:
    """A quantized layer cache as torch reads and writes it (the path without the C
    kernels): rows quantized by ``quantize_rows`` and put where the kernels expect them;
    blocks gathered and dequantized into the float cache's layouts."""

    def __init__(self, kv_cache: torch.Tensor, fmt: KVCacheFormat, head_dim: int) -> None:
        _, self.num_blocks, self.block_size, self.num_kv_heads, self.width = kv_cache.shape
        self.kv_cache, self.fmt, self.head_dim = kv_cache, fmt, head_dim
        self.v_cache = kv_views(kv_cache, fmt)[1]

    def _key_bytes(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """[..., Hkv, width] flat byte indices into the key cache of the rows at (blocks,
        offsets): the D values at stride block_size, then the scale's 4 bytes at offset * 4."""
        bs, d, w = self.block_size, self.head_dim, self.width
        heads = (blocks[..., None] * self.num_kv_heads + torch.arange(self.num_kv_heads)) * w * bs
        col = torch.arange(w)
        within = torch.where(col < d, col * bs, d * bs + (col - d))  # + offset (* 4 for scales)
        step = torch.where(col < d, 1, 4)
        return heads[..., None] + within + offsets[..., None, None] * step

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
        index = self._key_bytes(slots // self.block_size, slots % self.block_size)
        self.kv_cache[0].view(-1)[index] = quantize_rows(k, self.fmt)
        self.v_cache[slots // self.block_size, slots % self.block_size] = quantize_rows(v, self.fmt)

    def keys(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` (any shape) of keys as float32, [*ids.shape, Hkv, D, block_size]."""
        offsets = torch.arange(self.block_size)
        rows = self.kv_cache[0].view(-1)[self._key_bytes(ids[..., None], offsets)]
        return dequantize_rows(rows, self.fmt, self.head_dim).transpose(-3, -2).transpose(-2, -1)

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` of values as float32, [*ids.shape, block_size, Hkv, D]."""
        return dequantize_rows(self.v_cache[ids], self.fmt, self.head_dim)


class _Fp16KeysCache:
    """A block-major float16-key cache as torch reads and writes it (the path without the C
    kernels): float16 keys and 8-bit value rows where the kernels expect them."""

    def __init__(self, kv_cache: torch.Tensor, fmt: KVCacheFormat, head_dim: int) -> None:
        self.k_cache, self.v_cache = kv_views(kv_cache, fmt)
        self.fmt, self.head_dim = fmt, head_dim
        self.block_size = self.v_cache.shape[1]

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
        blocks, offsets = slots // self.block_size, slots % self.block_size
        keys = quantize_rows(k, self.fmt, keys=True).view(torch.float16)
        self.k_cache[blocks, :, :, offsets] = keys
        self.v_cache[blocks, offsets] = quantize_rows(v, self.fmt)

    def keys(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` (any shape) of keys as float32, [*ids.shape, Hkv, D, block_size]."""
        return self.k_cache[ids].float()

    def values(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` of values as float32, [*ids.shape, block_size, Hkv, D]."""
        return dequantize_rows(self.v_cache[ids], self.fmt, self.head_dim)


def torch_cache(kv_cache: torch.Tensor, fmt: KVCacheFormat, head_dim: int):
    """A quantized layer cache as torch writes it and reads its blocks as floats."""
    cls = _Fp16KeysCache if fmt.block_major else _QuantizedCache
    return cls(kv_cache, fmt, head_dim)


def _rows_of_heads(*tensors: torch.Tensor) -> bool:
    """[T, heads, D] with each row's heads contiguous (the row stride may be anything)."""
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)


class _Masking:
    """What a layer adds to plain causal attention: a sliding window, logit soft-capping,
    attention sinks."""

    def __init__(
        self, sliding_window: int | None, soft_cap: float | None, sinks: torch.Tensor | None = None
    ) -> None:
        self.window = sliding_window
        self.soft_cap = soft_cap
        self.sinks = sinks

    @property
    def plain(self) -> bool:
        return self.window is None and not self.soft_cap and self.sinks is None

    def softmax(self, scores: torch.Tensor, head_sinks: torch.Tensor | None) -> torch.Tensor:
        """The softmax over the last axis, with each row's sink (head_sinks: the sinks laid
        out to broadcast against scores[..., :1]) as one more logit, dropped after."""
        if self.sinks is None:
            return torch.softmax(scores, dim=-1)
        sink_column = head_sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]

    def first_key(self, first_query_position: int) -> int:
        """The earliest key position any query from first_query_position on can see."""
        return 0 if self.window is None else max(0, first_query_position - self.window + 1)

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        # As HF's eager attention: divide, tanh, multiply, after the scale.
        if self.soft_cap:
            scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
        return scores

    def hidden(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """True where a query may not see a key (causal, and outside the window)."""
        hide = key_positions > query_positions
        if self.window is not None:
            hide |= key_positions <= query_positions - self.window
        return hide


def kv_views(
    kv_cache: torch.Tensor, fmt: KVCacheFormat | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [num_blocks, Hkv, D, block_size], values [num_blocks, block_size, Hkv, D], the
    values' a transposed view of their head-major blocks, [num_blocks, Hkv, block_size, D]);
    a quantized cache's rows are wider (row_width); a block-major one (fmt.block_major) gives
    float16 keys and values of D + 4 bytes, each block's a stride of the block's bytes apart
    (the cache must be AttentionBackend.new_kv_cache's)."""
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    if fmt is None or not fmt.block_major:
        keys = kv_cache[0].view(num_blocks, num_kv_heads, width, block_size)
        values = kv_cache[1].view(num_blocks, num_kv_heads, block_size, width)
        return keys, values.transpose(1, 2)
    blocks = kv_cache.transpose(0, 1)
    if not blocks.is_contiguous():
        raise ValueError(f"a {fmt.name} cache is allocated block-major (new_kv_cache)")
    blocks = blocks.reshape(num_blocks, -1)
    head_dim = (2 * width - 4) // 3
    key_bytes = num_kv_heads * 2 * head_dim * block_size
    keys = blocks[:, :key_bytes].view(torch.float16)
    values = blocks[:, key_bytes : key_bytes + block_size * num_kv_heads * (head_dim + 4)]
    return (
        keys.view(num_blocks, num_kv_heads, head_dim, block_size),
        values.view(num_blocks, num_kv_heads, block_size, head_dim + 4).transpose(1, 2),
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Store each token's K/V [T, Hkv, D] at its flat slot (block * block_size + offset)."""
    k_cache, v_cache = kv_views(kv_cache)
    block_size = v_cache.shape[1]
    k_cache[slots // block_size, :, :, slots % block_size] = k
    v_cache[slots // block_size, slots % block_size] = v


def _causal_attention(q, k, v, seq_len: int, scale: float, masks: _Masking, first: int = 0):
    """q: [L, H, D] are the last L positions of a sequence of seq_len tokens; k, v:
    [S, Hkv, D] hold its keys and values from position first on (S = seq_len - first)."""
    length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if length == seq_len and masks.plain:
        if group > 1:
            # Expanded K/V take SDPA's fused CPU kernel; enable_gqa would fall back to the
            # unfused math path, several times slower.
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # [1, H, L, D]: the fused (flash) CPU kernel takes 4-D inputs only; 3-D ones go to
        # the unfused math path, which cost ~8% of a 4,096-token prefill step.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
        )
        return out.squeeze(0).transpose(0, 1)
    # A chunk after earlier context, or a layer with a window, a soft cap or sinks: SDPA
    # with a boolean mask is ~30x slower than this. Query heads of one KV head are stacked
    # as rows: [Hkv, G * L, D].
    qg = q.view(length, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qg = qg.reshape(num_kv_heads, group * length, head_dim)
    scores = masks.cap(torch.bmm(qg, k.permute(1, 2, 0)).mul_(scale))  # [Hkv, G * L, S]
    # Query i sits at position seq_len - length + i; key j at first + j.
    positions = torch.arange(seq_len - length, seq_len).repeat(group).unsqueeze(1)
    hide = masks.hidden(torch.arange(first, seq_len).unsqueeze(0), positions)
    scores.masked_fill_(hide, float("-inf"))
    # Row (kv head, g * L + i) is query head kv head * G + g's.
    sinks = None if masks.sinks is None else masks.sinks.view(num_kv_heads, group, 1, 1)
    if sinks is not None:
        sinks = sinks.expand(-1, -1, length, 1).reshape(num_kv_heads, group * length, 1)
    out = torch.bmm(masks.softmax(scores, sinks), v.transpose(0, 1))  # [Hkv, G * L, D]
    return (
        out.view(num_kv_heads, group, length, head_dim)
        .permute(2, 0, 1, 3)
        .reshape(length, num_heads, head_dim)
    )


def _paged_single_query(
    q, keys_of, values_of, meta: CPUAttentionMetadata, scale: float, masks: _Masking
) -> torch.Tensor:
    """One query token per request: gather each request's blocks and attend, all at once.
    keys_of / values_of: blocks of the cache by id, in its float layouts."""
    batch, num_heads, head_dim = q.shape
    table = meta.single_block_table
    # [B, blocks, Hkv, D, block_size] and [B, blocks, block_size, Hkv, D] -> [B, Hkv, S, D]
    keys = keys_of(table).permute(0, 2, 1, 4, 3).flatten(2, 3).to(q.dtype)
    values = values_of(table).flatten(1, 2).transpose(1, 2).to(q.dtype)
    num_kv_heads = values.shape[1]
    group = num_heads // num_kv_heads
    seq = keys.shape[2]
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = masks.cap(torch.matmul(qg, keys.transpose(2, 3)) * scale)  # [B, Hkv, G, S]
    # Each request's one query sits at position seq_len - 1; slots past it are padding.
    hide = masks.hidden(torch.arange(seq).unsqueeze(0), meta.single_seq_lens.unsqueeze(1) - 1)
    scores.masked_fill_(hide[:, None, None, :], float("-inf"))
    sinks = None if masks.sinks is None else masks.sinks.view(num_kv_heads, group, 1)
    probs = masks.softmax(scores, sinks)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)
