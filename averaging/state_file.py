"""A file format for tensors: raw bytes after a small msgpack header (the work log's
states, a served state's copy while a download overlaps a change).

`torch.save` pickles every tensor and writes a zip archive: for a state of the
daemon's default model (28 parameters and their Adam moments, 5.4 MB) that was
14 ms of CPU a write and 29 ms a read, most of it the interpreter's, and a
verified peer writes one state every few inner steps (`work_log`): about a
seventh of a verifying daemon's CPU. Here a write is the header and one
`write` per tensor, and a read maps the file and views each tensor in place.

Layout: MAGIC, the header's length (4 bytes, big-endian), the header, then each
tensor's bytes at an offset aligned to ALIGN. The header is msgpack: `tensors`,
a list of [dtype name, shape, offset] for every tensor in order, and `tree`, the
structure that holds them (dicts, lists, tuples, numbers, strings, None), where a
tensor is ext TENSOR_EXT holding its index and a tuple is ext TUPLE_EXT holding
its items (msgpack has no tuple: an optimizer's `betas` must come back a tuple).

A read checks what it can without trusting the file: the magic, the header's
bounds, every dtype against a list, every tensor's extent against the file's
size; anything else raises `StateFileError`. A file rewritten with another state
of the right shape reads back as that state: callers compare its digest with the
one they committed to (`spill`). Files are read copy-on-write mapped: their pages
are the file's until written, which the kernel can drop under pressure.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path
from typing import Any

import msgpack
import torch

__all__ = ["StateFileError", "read_tree", "write_tree"]

MAGIC = b"SHOALST1"
ALIGN = 64
TENSOR_EXT = 1
TUPLE_EXT = 2
MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 16

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class StateFileError(ValueError):
    """The file is not a whole state file of this format."""


def write_tree(path: Path, tree: Any) -> None:
    """Write `tree` (tensors inside dicts, lists and tuples of plain values) to `path`.
    Tensors are written as their bytes on the CPU, one at a time (a device tensor or a
    non-contiguous one through a host copy of itself alone)."""
    tensors: list[torch.Tensor] = []

    def encode(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach())
            return msgpack.ExtType(TENSOR_EXT, msgpack.packb(len(tensors) - 1))
        if isinstance(obj, tuple):
            return msgpack.ExtType(TUPLE_EXT, _pack(list(obj), encode))
        raise TypeError(f"cannot write a {type(obj).__name__} to a state file")

    tree_bytes = _pack(tree, encode)
    offset = 0
    table = []
    for t in tensors:
        if str(t.dtype).removeprefix("torch.") not in DTYPES:
            raise TypeError(f"cannot write a {t.dtype} tensor to a state file")
        table.append([str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset = _aligned(offset + t.numel() * t.element_size())
    header = msgpack.packb({"tensors": table, "tree": msgpack.ExtType(0, tree_bytes)})
    start = _aligned(len(MAGIC) + 4 + len(header))
    with open(path, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(4, "big") + header)
        for t, (_, _, at) in zip(tensors, table, strict=True):
            f.seek(start + at)
            if t.numel():  # (a device tensor through the host, one at a time)
                host = t.to("cpu").contiguous()
                f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
        f.truncate(start + offset)


def read_tree(path: Path) -> Any:
    """The tree `write_tree` wrote to `path`, its tensors mapped from the file
    (copy-on-write). StateFileError when the file is not one (see the module doc)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < len(MAGIC) + 4:
            raise StateFileError("shorter than a header")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if buffer[: len(MAGIC)] != MAGIC:
        raise StateFileError("not a state file")
    length = int.from_bytes(buffer[len(MAGIC) : len(MAGIC) + 4], "big")
    if length > min(size - len(MAGIC) - 4, MAX_HEADER_BYTES):
        raise StateFileError("header longer than the file")
    header_at = len(MAGIC) + 4
    try:
        header = msgpack.unpackb(buffer[header_at : header_at + length], strict_map_key=False)
        table, tree_ext = header["tensors"], header["tree"]
        if not isinstance(table, list) or not isinstance(tree_ext, msgpack.ExtType):
            raise StateFileError("malformed header")
        start = _aligned(header_at + length)
        tensors = [_tensor(buffer, entry, start, size) for entry in table]
        return _unpack(tree_ext.data, tensors)
    except StateFileError:
        raise
    except Exception as e:  # msgpack's many errors, a wrong type where a list was due...
        raise StateFileError(f"malformed header: {e!r}") from None


def _tensor(buffer: mmap.mmap, entry: Any, start: int, size: int) -> torch.Tensor:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise StateFileError("malformed tensor entry")
    name, shape, offset = entry
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise StateFileError(f"unknown dtype {name!r}")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS):
        raise StateFileError("malformed shape")
    if not all(isinstance(n, int) and 0 <= n < 1 << 40 for n in shape):
        raise StateFileError("malformed shape")
    if not (isinstance(offset, int) and offset >= 0 and offset % ALIGN == 0):
        raise StateFileError("malformed offset")
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if start + offset + nbytes > size:
        raise StateFileError("a tensor runs past the end of the file")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=start + offset)
    return flat.reshape(shape)


def _pack(obj: Any, default: Any) -> bytes:
    packed = msgpack.packb(obj, default=default, strict_types=True)
    assert packed is not None
    return packed


def _unpack(data: bytes, tensors: list[torch.Tensor]) -> Any:
    def ext_hook(code: int, payload: bytes) -> Any:
        if code == TENSOR_EXT:
            index = msgpack.unpackb(payload)
            if not (isinstance(index, int) and 0 <= index < len(tensors)):
                raise StateFileError("a tensor reference out of range")
            return tensors[index]
        if code == TUPLE_EXT:
            items = _unpack(payload, tensors)
            if not isinstance(items, list):
                raise StateFileError("malformed tuple")
            return tuple(items)
        raise StateFileError(f"unknown ext type {code}")

    return msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
