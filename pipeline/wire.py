"""Tensors between stages on the wire: activations and gradients compressed with the
all-reduce's codecs (`averaging.compression`: blockwise int8 by default for
pipelines, fp16, bf16, or none), everything else sent as it is.

A float tensor under a codec other than `none` travels as a small message
``{"shape", "dtype"}`` followed by one RPC chunk of the encoded bytes, whose size
the receiver knows from the shape (so it reads them straight into place and a
peer cannot make it allocate more); an integer tensor (byte IDs into stage 0)
or any tensor under `none` travels as a plain RPC tensor. Both sides agree on
the codec from the request's header (``"codec"``); the request also says which
of its tensors are encoded (``"enc"``), and the answer's header whether its
result is.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.averaging.compression import CODECS, Codec, get_codec
from shoal.transport.rpc import MessageStream

__all__ = ["MAX_ELEMENTS", "codec_of", "encodes", "recv_tensor", "send_tensor"]

MAX_ELEMENTS = 1 << 30
_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def codec_of(name: object) -> Codec:
    """The codec a request names (ValueError for an unknown one)."""
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"unknown codec {name!r}")
    return get_codec(name)


def encodes(codec: Codec, t: torch.Tensor) -> bool:
    """Whether `t` travels encoded under `codec`."""
    return codec.name != "none" and t.is_floating_point()


async def send_tensor(stream: MessageStream, t: torch.Tensor, codec: Codec) -> int:
    """Send `t` (encoded when `encodes(codec, t)`); the payload bytes."""
    t = t.detach()
    if not encodes(codec, t):
        t = t.contiguous()
        await stream.send_tensor(t)
        return t.numel() * t.element_size()
    await stream.send({"shape": list(t.shape), "dtype": str(t.dtype)})
    flat = t.to("cpu", torch.float32).contiguous().view(-1)
    payload = codec.encode(flat)
    await stream.send_chunk(0, payload)
    return len(payload)


async def recv_tensor(stream: MessageStream, codec: Codec, encoded: bool) -> torch.Tensor:
    """The next tensor (`encoded`: as `send_tensor` sends a float under `codec`)."""
    if not encoded:
        return await stream.recv_tensor()
    head = await stream.recv()
    shape, dtype = _header(head)
    n = 1
    for d in shape:
        n *= d
    if n > MAX_ELEMENTS:
        raise ValueError("tensor too large")
    data = bytearray(codec.encoded_size(n))
    await stream.recv_chunk_into(0, memoryview(data))
    out = torch.empty(n, dtype=torch.float32)
    codec.decode_checked(memoryview(data), out)
    return out.view(shape).to(dtype)


def _header(head: Any) -> tuple[list[int], torch.dtype]:
    if not isinstance(head, dict):
        raise ValueError("an encoded tensor starts with its shape")
    shape, dtype = head.get("shape"), head.get("dtype")
    if not isinstance(shape, list) or len(shape) > 8:
        raise ValueError("bad tensor shape")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError("bad tensor shape")
    if dtype not in _DTYPES:
        raise ValueError(f"bad tensor dtype {dtype!r}")
    return shape, _DTYPES[dtype]
