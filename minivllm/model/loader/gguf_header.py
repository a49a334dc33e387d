"""The header of a GGUF file: its metadata and tensor table, read without the vocabulary.

A split file (llama.cpp's gguf-split, or a converter's ``--split-max-size``: parts named
``NAME-00001-of-0000N.gguf``) is read as one: the metadata of its first part (the later
parts hold only their ``split.*`` keys), and the tensors of every part, each with the path
of the part that holds it.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# GGUF value type id -> struct format: (u)int8/16/32, float32, bool, then after 8 (string)
# and 9 (array) come (u)int64 and float64.
_GGUF_SCALAR_FORMATS = dict(zip([0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12], "BbHhIif?Qqd", strict=True))
_GGUF_STRING = 8
_GGUF_ARRAY = 9


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata and tensor shapes of a GGUF file.

    ``metadata`` holds scalars, strings and numeric arrays (as numpy arrays). String arrays
    (the tokenizer vocabulary and merges) are left out: they are large and slow to decode.
    ``tensor_shapes`` is in PyTorch order, i.e. ggml's ``ne`` reversed.
    """

    metadata: dict[str, Any]
    tensor_shapes: dict[str, tuple[int, ...]]
    # name -> (ggml type id, absolute byte offset of its data in the file that holds it)
    tensor_data: dict[str, tuple[int, int]] = field(default_factory=dict)
    path: str = ""  # the file read (a split file's first part)
    # A split file's tensors in its later parts: name -> that part's path.
    tensor_paths: dict[str, str] = field(default_factory=dict)

    def file_of(self, name: str) -> str:
        """The path of the file (part) that holds tensor ``name``."""
        return self.tensor_paths.get(name, self.path)


# llama.cpp's name of part k of n (llama_split_path): PREFIX-0000k-of-0000n.gguf
_SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_part_paths(path: str, count: int) -> list[str]:
    """The paths of every part of a split GGUF whose first part is ``path``."""
    m = _SPLIT_NAME.search(path)
    if m is None or int(m.group(1)) != 1 or int(m.group(2)) != count:
        raise ValueError(
            f"{path} is the first of {count} parts of a split GGUF but is not named as one "
            f"(NAME-00001-of-{count:05d}.gguf): its parts are found by their names."
        )
    prefix = path[: m.start()]
    return [f"{prefix}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table without reading any tensor data; of a
    split file (``path`` its first part), every part's tensor table.

    gguf.GGUFReader takes about 2 s on SmolLM2 because it builds numpy views for each of
    the ~100k vocabulary strings; this reader skips those and takes a few tens of ms.
    """
    path = os.fspath(path)
    first = _read_one_file(path)
    count = int(first.metadata.get("split.count", 1))
    if count <= 1:
        return first
    number = int(first.metadata.get("split.no", 0))
    if number != 0:
        raise ValueError(
            f"{path} is part {number + 1} of {count} of a split GGUF: pass its first part "
            f"(the file named ...-00001-of-{count:05d}.gguf)."
        )
    shapes, data, paths = dict(first.tensor_shapes), dict(first.tensor_data), {}
    for k, part in enumerate(split_part_paths(path, count)[1:], start=1):
        if not os.path.isfile(part):
            raise FileNotFoundError(f"split GGUF {path} misses part {k + 1} of {count}: {part}")
        header = _read_one_file(part)
        if int(header.metadata.get("split.no", -1)) != k:
            raise ValueError(f"{part} is not part {k + 1} of {count} of {path}")
        for name in header.tensor_shapes:
            if name in shapes:
                raise ValueError(f"tensor {name} is in two parts of {path}")
            paths[name] = part
        shapes.update(header.tensor_shapes)
        data.update(header.tensor_data)
    expected = first.metadata.get("split.tensors.count")
    if expected is not None and int(expected) != len(shapes):
        raise ValueError(
            f"split GGUF {path}: its parts hold {len(shapes)} tensors, its header {expected}"
        )
    return GGUFHeader(first.metadata, shapes, data, path, paths)


def _read_one_file(path: str) -> GGUFHeader:
    """One file's header (one part of a split file)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"not a GGUF file: {path}")
        order = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # a small version number read with the wrong byte order
            order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported: {path}")
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        pos = 24

        def read_string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from(order + "Q", buf, at)
            at += 8
            return bytes(buf[at : at + length]).decode("utf-8", errors="replace"), at + length

        def read_value(vtype: int, at: int) -> tuple[Any, int]:
            if vtype == _GGUF_STRING:
                return read_string(at)
            if vtype == _GGUF_ARRAY:
                item_type, count = struct.unpack_from(order + "IQ", buf, at)
                at += 12
                if item_type == _GGUF_STRING:
                    for _ in range(count):  # skip without decoding
                        (length,) = struct.unpack_from(order + "Q", buf, at)
                        at += 8 + length
                    return None, at
                if item_type == _GGUF_ARRAY:
                    raise ValueError(f"nested GGUF arrays are not supported: {path}")
                if item_type not in _GGUF_SCALAR_FORMATS:
                    raise ValueError(f"unknown GGUF array type {item_type}: {path}")
                dtype = np.dtype(order + _GGUF_SCALAR_FORMATS[item_type])
                values = np.frombuffer(buf, dtype=dtype, count=count, offset=at).copy()
                return values, at + count * dtype.itemsize
            if vtype not in _GGUF_SCALAR_FORMATS:
                raise ValueError(f"unknown GGUF value type {vtype}: {path}")
            fmt = order + _GGUF_SCALAR_FORMATS[vtype]
            return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = read_string(pos)
            (vtype,) = struct.unpack_from(order + "I", buf, pos)
            value, pos = read_value(vtype, pos + 4)
            if value is not None:
                metadata[key] = value

        shapes: dict[str, tuple[int, ...]] = {}
        relative: dict[str, tuple[int, int]] = {}
        for _ in range(n_tensors):
            name, pos = read_string(pos)
            (n_dims,) = struct.unpack_from(order + "I", buf, pos)
            dims = struct.unpack_from(order + "Q" * n_dims, buf, pos + 4)
            pos += 4 + 8 * n_dims
            relative[name] = struct.unpack_from(order + "IQ", buf, pos)  # type id, offset
            pos += 12
            shapes[name] = tuple(int(d) for d in reversed(dims))
        # Tensor data starts at the next multiple of the alignment after the header.
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        data = {name: (int(t), data_start + int(off)) for name, (t, off) in relative.items()}
    return GGUFHeader(metadata=metadata, tensor_shapes=shapes, tensor_data=data, path=path)
