"""Tensors between stages on the wire: activations and gradients compressed with the
all-reduce's codecs (`averaging.compression`: blockwise int8 by default for
pipelines, fp16, bf16, or none), everything else sent as it is.

A float tensor under a codec other than `none` travels as a small message
``{"shape", "dtype", "tail"}`` followed by one RPC chunk of the encoded bytes, whose
size the receiver knows from the shape (so it reads them straight into place and a
peer cannot make it allocate more); an integer tensor (byte IDs into stage 0)
or any tensor under `none` travels as a plain RPC tensor. Both sides agree on
the codec from the request's header (``"codec"``); the request also says which
of its tensors are encoded (``"enc"``), and the answer's header whether its
result is.

A tensor whose last channel holds only whole numbers from 0 to 255 sends that
channel exactly, one byte per value, after the codec's bytes of the other
channels (``"tail": "ids"``; up to 65535 two bytes, ``"ids16"``; up to 2^24, the
largest whole numbers float32 holds exactly, four, ``"ids32"``), and one whose
last channel is all zeros sends no bytes for it (``"zeros"``): the token IDs a
stage with a bottleneck passes on with its narrow hidden states
(`shoal.peer.training.tasks.bytegpt`, `boundary`: a byte vocabulary or a
tokenizer's), which blockwise int8 would round off (a block's scale makes steps
of about max/127), and the zero gradient that comes back for them. Any tensor may
take these paths: they are lossless for that channel, so whether one applies is
decided by the values alone.

A receiver says how many elements it expects at most (`recv_tensor`'s
`max_elements`: a stage's `bounds`, never more than MAX_ELEMENTS); a header
announcing more raises PayloadTooLarge before any buffer is allocated for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.averaging.compression import CODECS, Codec, CodecError, get_codec
from shoal.transport.errors import PayloadTooLarge
from shoal.transport.rpc import MessageStream

__all__ = [
    "MAX_ELEMENTS",
    "Encoded",
    "HeaderError",
    "codec_of",
    "decode_tensor",
    "encode_tensor",
    "encodes",
    "exact_tail",
    "parse_header",
    "recv_tensor",
    "send_tensor",
]

MAX_ELEMENTS = 1 << 30  # whatever the receiver expects, never more than this
_MAX_ITEMSIZE = 8  # (a plain tensor's bytes: float64 and int64 ids are the widest)
MAX_ID = 255  # the exact channel's values fit a byte ("ids")
# An exact channel's widths: the largest value each holds, its bytes and numpy type.
_ID_TAILS = {"ids": (MAX_ID, "<u1"), "ids16": ((1 << 16) - 1, "<u2"), "ids32": (1 << 24, "<u4")}
_TAILS = (None, "zeros", *_ID_TAILS)
_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class HeaderError(ValueError):
    """An encoded tensor's header that is malformed or too large."""


def codec_of(name: object) -> Codec:
    """The codec a request names (ValueError for an unknown one)."""
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"unknown codec {name!r}")
    return get_codec(name)


def encodes(codec: Codec, t: torch.Tensor) -> bool:
    """Whether `t` travels encoded under `codec`."""
    return codec.name != "none" and t.is_floating_point()


@dataclass(frozen=True)
class Encoded:
    """What an encoded tensor's header says, checked: the receiver sizes its buffer by it."""

    shape: list[int]
    dtype: torch.dtype
    tail: str | None  # the last channel: "ids", "ids16", "ids32" (exactly), "zeros" (no bytes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def payload_size(self, codec: Codec) -> int:
        if self.tail is None:
            return codec.encoded_size(self.numel)
        rows = self.numel // self.shape[-1]
        return codec.encoded_size(self.numel - rows) + rows * _tail_itemsize(self.tail)

    def header(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": str(self.dtype), "tail": self.tail}


def encode_tensor(t: torch.Tensor, codec: Codec) -> tuple[Encoded, bytes | memoryview]:
    """A float tensor's header and payload under `codec`."""
    t = t.detach()
    head = Encoded(list(t.shape), t.dtype, exact_tail(t))
    t = t.to("cpu", torch.float32)
    if head.tail is None:
        return head, codec.encode(t.contiguous().view(-1))
    body = codec.encode(t[..., :-1].contiguous().view(-1))
    if head.tail == "zeros":
        return head, body
    tail = t[..., -1].to(torch.int64).contiguous().view(-1).numpy()
    raw = tail.astype(_ID_TAILS[head.tail][1]).tobytes()
    payload = bytearray(len(body) + len(raw))
    payload[: len(body)] = body
    payload[len(body) :] = raw
    return head, payload


def decode_tensor(
    head: Encoded, data: bytes | bytearray | memoryview, codec: Codec
) -> torch.Tensor:
    """The tensor `encode_tensor` encoded (CodecError for bytes that cannot be)."""
    if len(data) != head.payload_size(codec):
        raise CodecError(f"{len(data)} bytes for a tensor of {head.payload_size(codec)}")
    if head.tail is None:
        out = torch.empty(head.numel, dtype=torch.float32)
        codec.decode_checked(data, out)
        return out.view(head.shape).to(head.dtype)
    shape, rows = head.shape, head.numel // head.shape[-1]
    body_size = codec.encoded_size(head.numel - rows)
    body = torch.empty(head.numel - rows, dtype=torch.float32)
    codec.decode_checked(memoryview(data)[:body_size], body)
    out = torch.empty(shape, dtype=torch.float32)
    out[..., :-1] = body.view(*shape[:-1], shape[-1] - 1)
    if head.tail == "zeros":
        out[..., -1] = 0.0
    else:
        raw = np.frombuffer(memoryview(data)[body_size:], dtype=_ID_TAILS[head.tail][1])
        if raw.size and int(raw.max()) > _ID_TAILS[head.tail][0]:
            raise CodecError(f"an id past {_ID_TAILS[head.tail][0]} in an exact channel")
        out[..., -1] = torch.from_numpy(raw.astype(np.float32)).view(shape[:-1])
    return out.to(head.dtype)


def exact_tail(t: torch.Tensor) -> str | None:
    """How `t`'s last channel travels apart from the codec, exactly: "zeros" when it is
    all zeros (no bytes), "ids" when it holds only whole numbers from 0 to MAX_ID (a
    byte each), "ids16" or "ids32" when they need two or four bytes (up to 2^24),
    None otherwise (or when there is no other channel)."""
    if t.dim() < 2 or t.shape[-1] < 2 or t.numel() == 0:
        return None
    tail = t[..., -1]
    if not torch.equal(tail, tail.round()):
        return None
    low, high = tail.aminmax()
    if low == 0 and high == 0:
        return "zeros"
    if low < 0:
        return None
    return next((name for name, (most, _) in _ID_TAILS.items() if high <= most), None)


def _tail_itemsize(tail: str | None) -> int:
    """Bytes per row of an exact channel."""
    return np.dtype(_ID_TAILS[tail][1]).itemsize if tail in _ID_TAILS else 0


async def send_tensor(stream: MessageStream, t: torch.Tensor, codec: Codec) -> int:
    """Send `t` (encoded when `encodes(codec, t)`); the payload bytes."""
    t = t.detach()
    if not encodes(codec, t):
        t = t.contiguous()
        await stream.send_tensor(t)
        return t.numel() * t.element_size()
    head, payload = encode_tensor(t, codec)
    await stream.send(head.header())
    await stream.send_chunk(0, memoryview(payload))
    return len(payload)


async def recv_tensor(
    stream: MessageStream,
    codec: Codec,
    encoded: bool,
    rows: int | None = None,
    max_elements: int = MAX_ELEMENTS,
) -> torch.Tensor:
    """The next tensor (`encoded`: as `send_tensor` sends a float under `codec`);
    `rows`: its first dimension, checked before anything is allocated for it;
    `max_elements`: the most the receiver expects (PayloadTooLarge beyond, before
    anything is allocated or read for it)."""
    max_elements = min(max_elements, MAX_ELEMENTS)
    if not encoded:
        most = max_elements * _MAX_ITEMSIZE
        t = await stream.recv_tensor(max_bytes=most, max_elements=max_elements)
        if rows is not None and (t.dim() < 1 or t.shape[0] != rows):
            raise HeaderError(f"a tensor of {rows} rows expected, got {list(t.shape)}")
        return t
    head = parse_header(await stream.recv())
    if rows is not None and (not head.shape or head.shape[0] != rows):
        raise HeaderError(f"a tensor of {rows} rows expected, its header says {head.shape}")
    if head.numel > max_elements:
        raise PayloadTooLarge(f"a tensor of {head.numel} elements, at most {max_elements} expected")
    # Uninitialised (not a zeroed bytearray): memory is taken as the bytes arrive, so a
    # header that claims a huge tensor costs its sender the bytes, not us the memory.
    data = torch.empty(head.payload_size(codec), dtype=torch.uint8).numpy()
    await stream.recv_chunk_into(0, memoryview(data))
    return decode_tensor(head, memoryview(data), codec)


def parse_header(head: Any) -> Encoded:
    """An encoded tensor's header, checked (HeaderError): at most MAX_ELEMENTS elements."""
    if not isinstance(head, dict):
        raise HeaderError("an encoded tensor starts with its shape")
    shape, dtype = head.get("shape"), head.get("dtype")
    if not isinstance(shape, list) or len(shape) > 8:
        raise HeaderError("bad tensor shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise HeaderError("bad tensor shape")
    if math.prod(shape) > MAX_ELEMENTS:
        raise HeaderError("tensor too large")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise HeaderError(f"bad tensor dtype {dtype!r}")
    tail = head.get("tail")
    if tail not in _TAILS or (tail is not None and (len(shape) < 2 or shape[-1] < 2)):
        raise HeaderError("bad exact tail")
    return Encoded(shape, _DTYPES[dtype], tail)
