"""Codecs for tensor slices exchanged during all-reduce.

In butterfly all-reduce the owner of a part quantizes its reduced result once
and forwards the *same bytes* to every member, the owner included. Bit-identical
state across members therefore only needs `decode` to be a pure function of its
input bytes, which holds here: every decode step is exact (a float16/bfloat16 to
float32 widening, an int8 to float32 conversion) or one correctly rounded IEEE
float32 multiply, and the int8 codec never lets a subnormal reach that multiply,
so a peer that flushes denormals (torch.set_flush_denormal) still agrees.
Encoding is deterministic as well (no stochastic rounding, no randomness).

Layouts (all little-endian; the module refuses to load on big-endian hosts
rather than put native-order bytes on the wire):

- ``none``  (code 0x00): float32, 4 bytes per element.
- ``fp16``  (code 0x01): IEEE float16, 2 bytes per element.
- ``bf16``  (code 0x02): bfloat16, 2 bytes per element.
- ``int8``  (code ``0x10 | log2(block_size)``, 0x18 for the default 256): one
  float32 scale per block of ``block_size`` elements (the last block may be
  shorter), all scales first, then one int8 per element.

Each codec knows `encoded_size(n)` exactly, so a receiver checks the length of
untrusted bytes before decoding and preallocates its buffers. Anything wrong with
the bytes (length, invalid scale, out-of-range code) raises `CodecError`.
"""

from __future__ import annotations

import math
import re
import sys
from abc import ABC, abstractmethod
from typing import ClassVar, Final

import numpy as np
import torch

if sys.byteorder != "little":  # the wire format is little-endian; views are native-order
    raise ImportError("shoal.averaging.compression supports little-endian hosts only")

__all__ = [
    "CODECS",
    "BFloat16Codec",
    "Codec",
    "CodecError",
    "Float16Codec",
    "Int8BlockCodec",
    "NoCodec",
    "get_codec",
]


class CodecError(ValueError):
    """Bytes that cannot be (de)coded: wrong length, invalid content, non-finite input."""


BytesLike = bytes | bytearray | memoryview


class Codec(ABC):
    """Encodes a 1-D contiguous float32 CPU tensor to bytes and back.

    Codecs are stateless and immutable, hence safe to share between threads
    (large buffers are meant to be coded in `asyncio.to_thread`).
    """

    name: str
    code: int

    @abstractmethod
    def encoded_size(self, n_elements: int) -> int:
        """Exact number of bytes `encode` produces for `n_elements` float32 values."""

    def encode(self, src: torch.Tensor, out: memoryview | None = None) -> memoryview:
        """Encode `src` into `out` (exactly `encoded_size` writable bytes) or a new buffer.

        Returns a byte memoryview of the encoded data (`out` itself when given).
        On error the content of `out` is unspecified.
        """
        x = _check_src(src)
        size = self.encoded_size(x.numel())
        dst = _dst_view(out, size, self.name)
        if size:
            self._encode_into(x, dst)
        return dst

    def decode(self, data: BytesLike, out: torch.Tensor) -> None:
        """Fill `out` (1-D contiguous float32 CPU tensor) from `data`.

        `data` must be exactly `encoded_size(out.numel())` bytes. `out` is only
        written after the bytes have been validated.
        """
        y = _check_out(out)
        mv = self._checked(data, y.numel())
        if len(mv):
            self._decode_from(mv, y)

    def check(self, data: BytesLike, n_elements: int) -> None:
        """Raise `CodecError` unless `data` is a valid encoding of `n_elements` values.

        With `decode_checked`, this splits `decode` in two: validate bytes as they
        arrive (and fail at once), decode them later, when they are needed.
        """
        self._checked(data, n_elements)

    def decode_checked(self, data: BytesLike, out: torch.Tensor) -> None:
        """`decode` without the validation: only for bytes that `check` accepted for
        `out.numel()` elements (and that did not change since)."""
        y = _check_out(out)
        mv = _src_view(data, self.name)
        if len(mv) != self.encoded_size(y.numel()):
            raise CodecError(f"{self.name}: {len(mv)} bytes do not encode {y.numel()} elements")
        if len(mv):
            self._decode_from(mv, y)

    def add_decoded(self, data: BytesLike, out: torch.Tensor, weight: float) -> None:
        """``out += weight * decode(data)``, for bytes that `check` accepted for
        `out.numel()` elements. Deterministic, but not rounded like a decode followed
        by an add: for a sum that one party computes (and then encodes)."""
        y = _check_out(out)
        mv = _src_view(data, self.name)
        if len(mv) != self.encoded_size(y.numel()):
            raise CodecError(f"{self.name}: {len(mv)} bytes do not encode {y.numel()} elements")
        if len(mv):
            self._add_decoded(mv, y, weight)

    def _add_decoded(self, data: memoryview, out: torch.Tensor, weight: float) -> None:
        decoded = torch.empty_like(out)
        self._decode_from(data, decoded)
        out.add_(decoded, alpha=weight)

    def _checked(self, data: BytesLike, n_elements: int) -> memoryview:
        mv = _src_view(data, self.name)
        expected = self.encoded_size(n_elements)
        if len(mv) != expected:
            raise CodecError(
                f"{self.name}: expected {expected} bytes for {n_elements} elements, got {len(mv)}"
            )
        if expected:
            self._check(mv, n_elements)
        return mv

    def _check(self, data: memoryview, n_elements: int) -> None:  # noqa: B027 (optional hook)
        """Validate the content of `data` (of the right length): every byte string of
        the right length is valid unless a codec says otherwise."""

    @abstractmethod
    def _encode_into(self, src: torch.Tensor, dst: memoryview) -> None: ...

    @abstractmethod
    def _decode_from(self, data: memoryview, out: torch.Tensor) -> None:
        """Decode `data`, which passed `_check`, into `out`."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and other.code == self.code

    def __hash__(self) -> int:
        return hash(self.code)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, code={self.code:#04x})"


class NoCodec(Codec):
    """Raw float32: exact. Without `out`, `encode` returns a view of the tensor's
    own storage (no copy), so the tensor must not change while the bytes are in
    flight."""

    name = "none"
    code = 0x00

    def encoded_size(self, n_elements: int) -> int:
        return 4 * _check_count(n_elements)

    def encode(self, src: torch.Tensor, out: memoryview | None = None) -> memoryview:
        if out is None:
            return _tensor_bytes(_check_src(src))
        return super().encode(src, out)

    def _encode_into(self, src: torch.Tensor, dst: memoryview) -> None:
        dst[:] = _tensor_bytes(src)

    def _decode_from(self, data: memoryview, out: torch.Tensor) -> None:
        _tensor_bytes(out)[:] = data


class _NarrowFloatCodec(Codec):
    """float32 narrowed to a 2-byte float with round-to-nearest-even.

    Finite values beyond the narrow type's range are clamped to its largest
    finite value (instead of becoming inf); NaN and +-inf are carried through
    unchanged, so non-finite state stays visible to the layer that checks it.
    """

    _dtype: ClassVar[torch.dtype]
    _max_finite: ClassVar[float]

    def encoded_size(self, n_elements: int) -> int:
        return 2 * _check_count(n_elements)

    def _encode_into(self, src: torch.Tensor, dst: memoryview) -> None:
        narrow = torch.frombuffer(dst, dtype=self._dtype)
        lo, hi = torch.aminmax(src)
        limit = self._max_finite
        if -limit <= lo.item() and hi.item() <= limit:  # also False when a NaN is present
            narrow.copy_(src)
            return
        # Rare path (out-of-range or NaN values): clamp finite values, keep NaN/inf.
        clamped = torch.clamp(src, -limit, limit)
        narrow.copy_(torch.where(torch.isinf(src), src, clamped))


class Float16Codec(_NarrowFloatCodec):
    """IEEE float16 (about 3 significant digits; |x| > 65504 clamped to +-65504)."""

    name = "fp16"
    code = 0x01
    _dtype: ClassVar[torch.dtype] = torch.float16
    _max_finite: ClassVar[float] = 65504.0

    def _decode_from(self, data: memoryview, out: torch.Tensor) -> None:
        out.copy_(torch.frombuffer(_writable(data), dtype=torch.float16))


class BFloat16Codec(_NarrowFloatCodec):
    """bfloat16 (float32 range, about 2-3 significant digits)."""

    name = "bf16"
    code = 0x02
    _dtype: ClassVar[torch.dtype] = torch.bfloat16
    _max_finite: ClassVar[float] = float(torch.finfo(torch.bfloat16).max)

    def _decode_from(self, data: memoryview, out: torch.Tensor) -> None:
        out.copy_(torch.frombuffer(_writable(data), dtype=torch.bfloat16))


# Smallest normal float32: scales below it are flushed to zero so that decoding
# never multiplies by a subnormal (flush-to-zero peers would disagree).
_FLT_MIN: Final = np.float32(np.finfo(np.float32).tiny)
_FLT_MIN_BITS: Final = int(_FLT_MIN.view(np.uint32))


def _largest_safe_scale() -> np.float32:
    """Largest float32 s with 127 * s finite, so a decoded value is never inf."""
    s = np.float32(np.finfo(np.float32).max) / np.float32(127)
    with np.errstate(over="ignore"):
        while not np.isfinite(s * np.float32(127)):
            s = np.nextafter(s, np.float32(0))
    return s


_MAX_SCALE: Final = _largest_safe_scale()
_MAX_SCALE_BITS: Final = int(_MAX_SCALE.view(np.uint32))
_QMAX: Final = 127
# Elements coded per step: bounds the float32 temporary (1 MiB), and is large enough
# that the fixed cost of each torch call (a few µs) stays small per element.
_CHUNK_ELEMENTS: Final = 1 << 18


class Int8BlockCodec(Codec):
    """Symmetric 8-bit quantization with one float32 absmax scale per block.

    scale = absmax / 127 and q = round_half_even(x / scale), so the error is at
    most scale / 2 = absmax / 254 per element (plus float32 rounding). A scale
    is stored as float32 rather than float16: it costs 4 / block_size bytes per
    element (1.6% at 256) and keeps the full float32 range, where float16 would
    overflow above 65504 and lose tiny gradients. Blocks whose absmax is below
    127 * FLT_MIN (about 1.5e-36) are sent as zeros. NaN or inf input raises
    `CodecError`: one NaN would otherwise wipe out its whole block.
    """

    name: str
    code: int
    MIN_BLOCK_SIZE: ClassVar[int] = 1 << 4
    MAX_BLOCK_SIZE: ClassVar[int] = 1 << 15
    DEFAULT_BLOCK_SIZE: ClassVar[int] = 256

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if (
            not isinstance(block_size, int)
            or isinstance(block_size, bool)
            or not self.MIN_BLOCK_SIZE <= block_size <= self.MAX_BLOCK_SIZE
            or block_size & (block_size - 1)
        ):
            raise ValueError(
                f"int8 block size must be a power of two in "
                f"[{self.MIN_BLOCK_SIZE}, {self.MAX_BLOCK_SIZE}], got {block_size!r}"
            )
        self.block_size = block_size
        # The block size is part of the wire identity: a receiver rebuilds the
        # codec from the code alone.
        self.code = 0x10 | (block_size.bit_length() - 1)
        self.name = "int8" if block_size == self.DEFAULT_BLOCK_SIZE else f"int8-{block_size}"

    def n_blocks(self, n_elements: int) -> int:
        return -(-_check_count(n_elements) // self.block_size)

    def encoded_size(self, n_elements: int) -> int:
        return 4 * self.n_blocks(n_elements) + n_elements

    # Whole-buffer torch ops: the block maxima and minima over the whole input in one
    # call each, numpy for the per-block scales (a small array, where numpy costs
    # less per call), then the division, in-place rounding and the narrowing cast a
    # chunk of rows at a time (a cache-sized temporary). Bit-identical to the plain
    # numpy formulation (IEEE division, round half to even), and faster: the fixed
    # cost of each call (a few µs, slicing included) counts as much as the passes
    # over memory, so the calls per element are kept few.

    def _encode_into(self, src: torch.Tensor, dst: memoryview) -> None:
        n, bs = src.numel(), self.block_size
        nb, n_full = self.n_blocks(n), n // bs
        raw = torch.frombuffer(dst, dtype=torch.uint8)
        divisor = self._scales(src, n_full, raw[: 4 * nb].view(torch.float32).numpy())
        q = raw[4 * nb :].view(torch.int8)
        rows = max(1, _CHUNK_ELEMENTS // bs)
        tmp = torch.empty((min(rows, n_full) or 1) * bs, dtype=torch.float32)
        if n_full:
            x_rows, q_rows = src[: n_full * bs].view(n_full, bs), q[: n_full * bs].view(n_full, bs)
            for start in range(0, n_full, rows):
                stop = min(start + rows, n_full)
                t = tmp[: (stop - start) * bs].view(stop - start, bs)
                torch.div(x_rows[start:stop], divisor[start:stop], out=t)
                t.round_()  # round half to even
                q_rows[start:stop].copy_(t)
        if n_full < nb:  # the shorter last block
            t = tmp[: n - n_full * bs]
            torch.div(src[n_full * bs :], divisor[n_full], out=t)
            t.round_()
            q[n_full * bs :].copy_(t)
        # No clamp needed: s = fl(absmax / 127) gives |x / s| <= 127 * (1 + 2^-24)^2,
        # and a scale lowered to _MAX_SCALE is off by a few ulps at most, so every
        # quotient rounds into [-127, 127]; a block flushed to zero divides by 1
        # values below 127 * FLT_MIN, which round to 0. The narrowing cast is exact.

    def _scales(self, src: torch.Tensor, n_full: int, scales: np.ndarray) -> torch.Tensor:
        """Write every block's scale into `scales`; return the divisors, one per block
        (as a column, to broadcast over the rows)."""
        bs = self.block_size
        absmax = torch.empty(len(scales), dtype=torch.float32)
        if n_full:
            # max(hi, -lo): the absmax without writing |x| anywhere. NaN propagates.
            rows = src[: n_full * bs].view(n_full, bs)
            full = absmax[:n_full]
            torch.amax(rows, dim=1, out=full)
            torch.maximum(full, torch.amin(rows, dim=1).neg_(), out=full)
        if n_full < len(scales):
            tail = src[n_full * bs :]
            torch.maximum(tail.max(), tail.min().neg(), out=absmax[n_full])
        # Non-negative float32 terms cannot cancel or overflow a float64 sum: it is
        # finite exactly when every block's absmax is.
        if not math.isfinite(torch.sum(absmax, dtype=torch.float64).item()):
            bad = int(np.argmin(np.isfinite(absmax.numpy())))
            raise CodecError(f"{self.name}: NaN or inf in input block {bad}")
        s = absmax.numpy() / np.float32(_QMAX)
        np.minimum(s, _MAX_SCALE, out=s)
        normal = s >= _FLT_MIN
        scales[:] = np.where(normal, s, np.float32(0))  # below FLT_MIN: +0.0 (never -0.0)
        # A block flushed to zero (all-zero, or tiny) divides by 1.
        return torch.from_numpy(np.where(normal, s, np.float32(1)).reshape(-1, 1))

    def _check(self, data: memoryview, n_elements: int) -> None:
        nb = self.n_blocks(n_elements)
        raw = np.frombuffer(data, dtype=np.uint8)  # numpy: cheap, and fine with read-only
        # Valid scales are +0.0 or in [FLT_MIN, _MAX_SCALE]. As unsigned integers,
        # non-negative floats sort like their values, and NaN, inf and anything with
        # the sign bit sort above _MAX_SCALE_BITS; subtracting 1 wraps +0.0 to the
        # top, so the subnormals are exactly what falls below FLT_MIN_BITS - 1.
        bits = raw[: 4 * nb].view("<u4")
        if bits.max() > _MAX_SCALE_BITS or (bits - np.uint32(1) < _FLT_MIN_BITS - 1).any():
            valid = (bits == 0) | ((bits >= _FLT_MIN_BITS) & (bits <= _MAX_SCALE_BITS))
            bad = int(np.argmin(valid))
            scale = float(bits[bad : bad + 1].view("<f4")[0])
            raise CodecError(f"{self.name}: invalid scale {scale!r} for block {bad}")
        if raw[4 * nb :].view(np.int8).min() < -_QMAX:
            raise CodecError(f"{self.name}: quantized value -128 is outside the symmetric range")

    def _add_decoded(self, data: memoryview, out: torch.Tensor, weight: float) -> None:
        # One pass per piece instead of decoding to memory and adding it back:
        # out += weight * q * scale (addcmul), with q widened in a cache-sized buffer.
        n, bs = out.numel(), self.block_size
        nb, n_full = self.n_blocks(n), n // bs
        raw = torch.frombuffer(_writable(data), dtype=torch.uint8)
        scales = raw[: 4 * nb].view(torch.float32)
        q = raw[4 * nb :].view(torch.int8)
        rows = max(1, _CHUNK_ELEMENTS // bs)
        tmp = torch.empty((min(rows, n_full) or 1) * bs, dtype=torch.float32)
        for start in range(0, n_full, rows):
            stop = min(start + rows, n_full)
            widened = tmp[: (stop - start) * bs].view(-1, bs)
            widened.copy_(q[start * bs : stop * bs].view(-1, bs))
            y = out[start * bs : stop * bs].view(-1, bs)
            y.addcmul_(widened, scales[start:stop, None], value=weight)
        if n_full < nb:
            widened = tmp[: n - n_full * bs]
            widened.copy_(q[n_full * bs :])
            out[n_full * bs :].addcmul_(widened, scales[n_full:], value=weight)

    def _decode_from(self, data: memoryview, out: torch.Tensor) -> None:
        n, bs = out.numel(), self.block_size
        nb, n_full = self.n_blocks(n), n // bs
        raw = torch.frombuffer(_writable(data), dtype=torch.uint8)
        scales = raw[: 4 * nb].view(torch.float32)
        q = raw[4 * nb :].view(torch.int8)
        # int8 -> float32 is exact, then one correctly rounded float32 multiply per
        # element: a pure function of the bytes on every IEEE machine.
        rows = max(1, _CHUNK_ELEMENTS // bs)
        for start in range(0, n_full, rows):
            stop = min(start + rows, n_full)
            y = out[start * bs : stop * bs].view(-1, bs)
            y.copy_(q[start * bs : stop * bs].view(-1, bs))
            y.mul_(scales[start:stop, None])
        if n_full < nb:
            y = out[n_full * bs :]
            y.copy_(q[n_full * bs :])
            y.mul_(scales[n_full])


CODECS: Final[dict[str, Codec]] = {
    c.name: c for c in (NoCodec(), Float16Codec(), BFloat16Codec(), Int8BlockCodec())
}
_BY_CODE: Final[dict[int, Codec]] = {c.code: c for c in CODECS.values()}
_INT8_NAME = re.compile(r"int8-([0-9]{1,5})")


def get_codec(name_or_code: str | int) -> Codec:
    """The codec for a name ("none", "fp16", "bf16", "int8", "int8-64") or wire code.

    Unknown names or codes (which may come off the network) raise `CodecError`.
    """
    if isinstance(name_or_code, str):
        codec = CODECS.get(name_or_code)
        if codec is not None:
            return codec
        m = _INT8_NAME.fullmatch(name_or_code)
        if m is not None:
            return _int8_codec(int(m.group(1)), name_or_code)
    elif isinstance(name_or_code, int) and not isinstance(name_or_code, bool):
        codec = _BY_CODE.get(name_or_code)
        if codec is not None:
            return codec
        if name_or_code & ~0x0F == 0x10:
            return _int8_codec(1 << (name_or_code & 0x0F), name_or_code)
    raise CodecError(f"unknown codec {name_or_code!r}"[:100])


def _int8_codec(block_size: int, what: str | int) -> Codec:
    try:
        return Int8BlockCodec(block_size)
    except ValueError:
        raise CodecError(f"unknown codec {what!r}") from None


def _check_count(n_elements: int) -> int:
    if not isinstance(n_elements, int) or n_elements < 0:
        raise ValueError(f"element count must be a non-negative int, got {n_elements!r}")
    return n_elements


def _check_flat_float32(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.layout != torch.strided:
        raise TypeError(f"{what} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{what} must be 1-D and contiguous, got shape {tuple(t.shape)}")
    return t.detach()


def _check_src(src: torch.Tensor) -> torch.Tensor:
    return _check_flat_float32(src, "src")


def _check_out(out: torch.Tensor) -> torch.Tensor:
    return _check_flat_float32(out, "out")


def _writable(data: memoryview) -> memoryview:
    """`data`, copied if it is read-only: torch cannot wrap read-only memory without a
    warning. Receive buffers are writable; this is for callers holding bytes. One code
    path for both keeps decoding a pure function of the bytes, NaN payloads included
    (numpy and torch widen float16 NaNs differently)."""
    return memoryview(bytearray(data)) if data.readonly else data


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's storage (no copy)."""
    return memoryview(t.numpy()).cast("B")


def _byte_view(buf: BytesLike, name: str) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not mv.c_contiguous:
        raise CodecError(f"{name}: buffer is not contiguous")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _src_view(data: BytesLike, name: str) -> memoryview:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"{name}: data must be bytes-like, got {type(data).__name__}")
    return _byte_view(data, name)


def _dst_view(out: memoryview | None, size: int, name: str) -> memoryview:
    if out is None:
        # torch.empty skips the zero fill a bytearray would do.
        return memoryview(torch.empty(size, dtype=torch.uint8).numpy())
    mv = _byte_view(out, name)
    if mv.readonly:
        raise TypeError(f"{name}: output buffer is read-only")
    if len(mv) != size:
        raise CodecError(f"{name}: output buffer has {len(mv)} bytes, encoding needs {size}")
    return mv
