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
- ``int4``  (code ``0x20 | log2(block_size)``, 0x26 for the default 64): the same
  scales, then the codes in [-7, 7] two to a byte (element 2j in the low nibble of
  byte j, 4-bit two's complement; -8 is refused, and an odd count's last high
  nibble is 0).

Each codec knows `encoded_size(n)` exactly, so a receiver checks the length of
untrusted bytes before decoding and preallocates its buffers. Anything wrong with
the bytes (length, invalid scale, out-of-range code) raises `CodecError`.
"""

from __future__ import annotations

import functools
import re
import sys
from abc import ABC, abstractmethod
from types import ModuleType
from typing import ClassVar, Final

import numpy as np
import torch

from .int8_format import FLT_MIN_BITS, INT4_MAX_SCALE_BITS, MAX_SCALE_BITS, QMAX

if sys.byteorder != "little":  # the wire format is little-endian; views are native-order
    raise ImportError("shoal.averaging.compression supports little-endian hosts only")

__all__ = [
    "CODECS",
    "BFloat16Codec",
    "Codec",
    "CodecError",
    "Float16Codec",
    "Int4BlockCodec",
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

    @property
    def prepared(self) -> bool:
        """Whether coding can start at once (see `prepare`)."""
        return True

    def prepare(self) -> None:  # noqa: B027 (optional hook)
        """Load what coding needs, if anything: it may take a second the first time in
        a process, so an event loop calls this in a thread before its first round."""

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

    def add_decoded(
        self, data: BytesLike, out: torch.Tensor, weight: float, *, overwrite: bool = False
    ) -> None:
        """``out += weight * decode(data)`` (with `overwrite`: ``out = ...``, whatever
        `out` held), for bytes that `check` accepted for `out.numel()` elements.
        Deterministic, but not rounded like a decode followed by an add: for a sum
        that one party computes (and then encodes)."""
        y = _check_out(out)
        mv = _src_view(data, self.name)
        if len(mv) != self.encoded_size(y.numel()):
            raise CodecError(f"{self.name}: {len(mv)} bytes do not encode {y.numel()} elements")
        if len(mv):
            self._add_decoded(mv, y, weight, overwrite)

    def add_plain(
        self, src: torch.Tensor, out: torch.Tensor, weight: float, *, overwrite: bool = False
    ) -> None:
        """``out += weight * src`` (with `overwrite`: ``out = ...``) for float32 values
        that were never encoded (the summing member's own input), in the same kind of
        arithmetic as `add_decoded`."""
        x, y = _check_src(src), _check_out(out)
        if x.numel() != y.numel():
            raise ValueError(f"src has {x.numel()} elements, out {y.numel()}")
        self._add_plain(x, y, weight, overwrite)

    def _add_plain(
        self, src: torch.Tensor, out: torch.Tensor, weight: float, overwrite: bool
    ) -> None:
        if overwrite:
            torch.mul(src, weight, out=out)
        else:
            out.add_(src, alpha=weight)

    def _add_decoded(
        self, data: memoryview, out: torch.Tensor, weight: float, overwrite: bool
    ) -> None:
        if overwrite:
            self._decode_from(data, out)
            out.mul_(weight)
            return
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

    @property
    def prepared(self) -> bool:
        return _int8_kernels.cache_info().currsize > 0

    def prepare(self) -> None:
        _int8_kernels()

    def n_blocks(self, n_elements: int) -> int:
        return -(-_check_count(n_elements) // self.block_size)

    def encoded_size(self, n_elements: int) -> int:
        return 4 * self.n_blocks(n_elements) + n_elements

    # The loops are compiled (int8_kernels, with numba: loaded by `prepare` or on first
    # use, so that a process that never codes int8 does not load it), and compute
    # exactly the formulation above, element for element.

    def _encode_into(self, src: torch.Tensor, dst: memoryview) -> None:
        kernels = _int8_kernels()
        nb = self.n_blocks(src.numel())
        scales, q = _int8_layout(np.frombuffer(dst, dtype=np.uint8), nb)
        bad = kernels.encode(src.numpy(), self.block_size, scales, q)
        if bad >= 0:
            raise CodecError(f"{self.name}: NaN or inf in input block {bad}")
        if scales.base is None:  # an unaligned buffer: the scales went to a copy
            dst[: 4 * nb] = scales.view(np.uint8)

    def _check(self, data: memoryview, n_elements: int) -> None:
        nb = self.n_blocks(n_elements)
        raw = np.frombuffer(data, dtype=np.uint8)  # numpy: cheap, and fine with read-only
        _check_scales(self.name, raw[: 4 * nb], MAX_SCALE_BITS)
        if raw[4 * nb :].view(np.int8).min() < -QMAX:
            raise CodecError(f"{self.name}: quantized value -128 is outside the symmetric range")

    def _add_decoded(
        self, data: memoryview, out: torch.Tensor, weight: float, overwrite: bool
    ) -> None:
        kernels = _int8_kernels()
        scales, q = self._layout(data, out.numel())
        y, w = out.numpy(), np.float32(weight)
        kernels.add_decoded(q, scales, self.block_size, y, w, not overwrite)

    def _add_plain(
        self, src: torch.Tensor, out: torch.Tensor, weight: float, overwrite: bool
    ) -> None:
        _int8_kernels().add_scaled(src.numpy(), out.numpy(), np.float32(weight), not overwrite)

    def _decode_from(self, data: memoryview, out: torch.Tensor) -> None:
        kernels = _int8_kernels()
        scales, q = self._layout(data, out.numel())
        kernels.decode(q, scales, self.block_size, out.numpy())

    def _layout(self, data: memoryview, n_elements: int) -> tuple[np.ndarray, np.ndarray]:
        raw = np.frombuffer(_writable(data), dtype=np.uint8)  # numba wants writable arrays
        return _int8_layout(raw, self.n_blocks(n_elements))


class Int4BlockCodec(Int8BlockCodec):
    """Symmetric 4-bit quantization with one float32 absmax scale per block: the int8
    codec's formulation with scale = absmax / 7 and codes in [-7, 7], two to a byte
    (`int4_kernels`). The error is at most absmax / 14 per element, hence the smaller
    default block (64: 0.5625 bytes an element, 7.1x less than float32, where int8's
    256 is 3.9x). Streaming DiLoCo's paper sends its outer gradients in 4 bits.
    """

    DEFAULT_BLOCK_SIZE: ClassVar[int] = 64

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(block_size)
        self.code = 0x20 | (block_size.bit_length() - 1)
        self.name = "int4" if block_size == self.DEFAULT_BLOCK_SIZE else f"int4-{block_size}"

    @property
    def prepared(self) -> bool:
        return _int4_kernels.cache_info().currsize > 0

    def prepare(self) -> None:
        _int4_kernels()

    def encoded_size(self, n_elements: int) -> int:
        return 4 * self.n_blocks(n_elements) + (n_elements + 1) // 2

    def _encode_into(self, src: torch.Tensor, dst: memoryview) -> None:
        nb = self.n_blocks(src.numel())
        scales, packed = _int8_layout(np.frombuffer(dst, dtype=np.uint8), nb)
        bad = _int4_kernels().encode(src.numpy(), self.block_size, scales, packed.view(np.uint8))
        if bad >= 0:
            raise CodecError(f"{self.name}: NaN or inf in input block {bad}")
        if scales.base is None:  # an unaligned buffer: the scales went to a copy
            dst[: 4 * nb] = scales.view(np.uint8)

    def _check(self, data: memoryview, n_elements: int) -> None:
        nb = self.n_blocks(n_elements)
        raw = np.frombuffer(data, dtype=np.uint8)
        _check_scales(self.name, raw[: 4 * nb], INT4_MAX_SCALE_BITS)
        packed = raw[4 * nb :]
        if ((packed & 0x0F) == 0x08).any() or ((packed & 0xF0) == 0x80).any():
            raise CodecError(f"{self.name}: quantized value -8 is outside the symmetric range")
        if n_elements % 2 and packed[-1] & 0xF0:
            raise CodecError(f"{self.name}: the unused last nibble is not zero")

    def _add_decoded(
        self, data: memoryview, out: torch.Tensor, weight: float, overwrite: bool
    ) -> None:
        scales, packed = self._layout(data, out.numel())
        mode = 1 if overwrite else 2
        _int4_kernels().add_decoded(
            packed.view(np.uint8), scales, self.block_size, out.numpy(), np.float32(weight), mode
        )

    def _decode_from(self, data: memoryview, out: torch.Tensor) -> None:
        scales, packed = self._layout(data, out.numel())
        _int4_kernels().decode(packed.view(np.uint8), scales, self.block_size, out.numpy())


def _check_scales(name: str, head: np.ndarray, max_bits: int) -> None:
    """Raise `CodecError` unless every float32 scale in `head` (bytes) is +0.0 or in
    [FLT_MIN, the codec's largest]. As unsigned integers, non-negative floats sort like
    their values, and NaN, inf and anything with the sign bit sort above the largest
    scale's bits; subtracting 1 wraps +0.0 to the top, so the subnormals are exactly
    what falls below FLT_MIN_BITS - 1."""
    bits = head.view("<u4")
    if bits.max() > max_bits or (bits - np.uint32(1) < FLT_MIN_BITS - 1).any():
        valid = (bits == 0) | ((bits >= FLT_MIN_BITS) & (bits <= max_bits))
        bad = int(np.argmin(valid))
        scale = float(bits[bad : bad + 1].view("<f4")[0])
        raise CodecError(f"{name}: invalid scale {scale!r} for block {bad}")


@functools.cache
def _int4_kernels() -> ModuleType:
    from . import int4_kernels

    return int4_kernels


@functools.cache
def _int8_kernels() -> ModuleType:
    from . import int8_kernels  # the import lock makes concurrent first uses safe

    return int8_kernels


def _int8_layout(raw: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """The scales and the codes of an int8 encoding, as views of its bytes (the scales
    as an aligned copy if the bytes do not start at a multiple of 4)."""
    head = raw[: 4 * n_blocks]
    if head.ctypes.data % 4:
        scales = np.empty(n_blocks, dtype=np.float32)
        scales.view(np.uint8)[:] = head
    else:
        scales = head.view(np.float32)
    return scales, raw[4 * n_blocks :].view(np.int8)


CODECS: Final[dict[str, Codec]] = {
    c.name: c
    for c in (NoCodec(), Float16Codec(), BFloat16Codec(), Int8BlockCodec(), Int4BlockCodec())
}
_BY_CODE: Final[dict[int, Codec]] = {c.code: c for c in CODECS.values()}
_BLOCK_NAME = re.compile(r"(int8|int4)-([0-9]{1,5})")
_BLOCK_CODECS: Final[dict[int, type[Int8BlockCodec]]] = {0x10: Int8BlockCodec, 0x20: Int4BlockCodec}


def get_codec(name_or_code: str | int) -> Codec:
    """The codec for a name ("none", "fp16", "bf16", "int8", "int8-64", "int4", ...) or
    wire code.

    Unknown names or codes (which may come off the network) raise `CodecError`.
    """
    if isinstance(name_or_code, str):
        codec = CODECS.get(name_or_code)
        if codec is not None:
            return codec
        m = _BLOCK_NAME.fullmatch(name_or_code)
        if m is not None:
            kind = 0x10 if m.group(1) == "int8" else 0x20
            return _block_codec(kind, int(m.group(2)), name_or_code)
    elif isinstance(name_or_code, int) and not isinstance(name_or_code, bool):
        codec = _BY_CODE.get(name_or_code)
        if codec is not None:
            return codec
        if name_or_code & ~0x0F in _BLOCK_CODECS:
            return _block_codec(name_or_code & ~0x0F, 1 << (name_or_code & 0x0F), name_or_code)
    raise CodecError(f"unknown codec {name_or_code!r}"[:100])


def _block_codec(kind: int, block_size: int, what: str | int) -> Codec:
    try:
        return _BLOCK_CODECS[kind](block_size)
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
