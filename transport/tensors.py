"""Tensors on the wire: a small header (dtype, shape, byte count) plus the raw bytes.

Bytes are sent from a memoryview of the tensor's own storage and received into a
preallocated buffer. torch is imported only when a torch tensor is involved, so
importing the transport stays light.
"""

from __future__ import annotations

import math
import sys
from typing import Any

TensorHeader = dict[str, Any]

_TORCH_DTYPES = (
    "float64", "float32", "float16", "bfloat16",
    "int64", "int32", "int16", "int8", "uint8", "bool",
)  # fmt: skip
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip
MAX_DIMS = 16


class TensorHeaderError(ValueError):
    """A tensor frame's header that is malformed, or asks for more than the limit."""


class TensorTooLarge(TensorHeaderError):
    """A well-formed tensor header announcing more than the receiver's limit."""


def _is_torch(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and "torch" in sys.modules


def describe(obj: Any) -> tuple[TensorHeader, memoryview]:
    """Header and a zero-copy byte view of a CPU torch tensor or numpy array."""
    if _is_torch(obj):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _ITEMSIZE:
            raise TypeError(f"unsupported tensor dtype {t.dtype}")
        import torch

        flat = t.reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        view = memoryview(raw.numpy())
        header = {"lib": "torch", "dtype": dtype, "shape": list(t.shape), "nbytes": len(view)}
        return header, view
    # numpy arrays (and anything exposing the buffer protocol with a dtype/shape)
    dtype = str(getattr(obj, "dtype", "uint8"))
    if dtype not in _ITEMSIZE:
        raise TypeError(f"unsupported array dtype {dtype}")
    if hasattr(obj, "flags") and not obj.flags["C_CONTIGUOUS"]:
        raise ValueError("array must be C-contiguous to be sent without a copy")
    view = memoryview(obj).cast("B")
    shape = list(getattr(obj, "shape", (len(view),)))
    return {"lib": "numpy", "dtype": dtype, "shape": shape, "nbytes": len(view)}, view


def validate(header: object, max_bytes: int, max_elements: int | None = None) -> TensorHeader:
    """Check an untrusted header before anything is allocated for it (TensorHeaderError;
    TensorTooLarge past `max_bytes` or `max_elements`)."""
    if not isinstance(header, dict):
        raise TensorHeaderError("tensor header is not a map")
    dtype = header.get("dtype")
    shape = header.get("shape")
    nbytes = header.get("nbytes")
    lib = header.get("lib", "torch")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:  # (a list is unhashable)
        raise TensorHeaderError(f"unsupported tensor dtype {dtype!r}"[:200])
    if lib not in ("torch", "numpy"):
        raise TensorHeaderError(f"unknown tensor library {lib!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and 0 <= d < 1 << 48 for d in shape)
    ):
        raise TensorHeaderError(f"bad tensor shape {shape!r}"[:200])
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if nbytes != expected:
        raise TensorHeaderError(
            f"tensor byte count {nbytes!r} does not match shape {shape} {dtype}"
        )
    if expected > max_bytes:
        raise TensorTooLarge(f"tensor of {expected} bytes exceeds the limit of {max_bytes}")
    if max_elements is not None and math.prod(shape) > max_elements:
        raise TensorTooLarge(
            f"tensor of {math.prod(shape)} elements exceeds the limit of {max_elements}"
        )
    return header


def allocate(header: TensorHeader, out: Any = None) -> tuple[Any, memoryview]:
    """A tensor to receive into (`out` if given and matching), and its byte view."""
    if out is not None:
        got, view = describe(out)
        if got["dtype"] != header["dtype"] or list(got["shape"]) != list(header["shape"]):
            raise ValueError(
                f"incoming tensor {header['dtype']}{header['shape']} does not fit "
                f"the buffer {got['dtype']}{got['shape']}"
            )
        if _is_torch(out) and not out.is_contiguous():
            raise ValueError("receive buffer must be contiguous")
        return out, view
    if header.get("lib", "torch") == "torch":
        import torch

        t = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))
        return t, describe(t)[1]
    import numpy as np

    dtype = header["dtype"]
    if dtype == "bfloat16":
        raise ValueError("numpy has no bfloat16: receive into a torch tensor")
    arr = np.empty(header["shape"], dtype=dtype)
    return arr, memoryview(arr).cast("B") if arr.size else memoryview(b"")
