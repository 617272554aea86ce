"""Compiled loops for the int4 block codec (`compression.Int4BlockCodec`).

The int8 kernels' design (`int8_kernels`: one fused loop per block, IEEE float32
division and multiply, round half to even, cached on disk), with codes in [-7, 7]
packed two to a byte: element 2j in the low nibble of byte j, element 2j + 1 in the
high one, as 4-bit two's complement (the nibble 0b1000, -8, is never written and is
refused on receipt, so the code range is symmetric like int8's).

Blocks hold an even number of elements (the codec's block sizes are powers of two
of at least 16), so a block's codes start on a byte; only the last block may be odd,
and then the high nibble of its last byte is 0.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from .int8_format import FLT_MIN as _FLT_MIN
from .int8_format import INT4_MAX_SCALE as _MAX_SCALE
from .int8_kernels import _jit

__all__ = ["add_decoded", "decode", "encode"]

_ABS_MASK: Final = np.uint32(0x7FFFFFFF)
_INF_BITS: Final = np.uint32(0x7F800000)
_QMAX: Final = np.float32(7.0)


@_jit("int64(float32[::1], int64, float32[::1], uint8[::1])")
def encode(x: np.ndarray, block_size: int, scales: np.ndarray, packed: np.ndarray) -> int:
    """Quantize `x` block by block into scales and packed codes; -1, or the index of
    the first block holding a NaN or inf."""
    n = x.shape[0]
    bits = x.view(np.uint32)
    cell = np.empty(1, dtype=np.uint32)
    cell_value = cell.view(np.float32)
    for b in range(scales.shape[0]):
        lo = b * block_size
        hi = min(lo + block_size, n)
        block_bits = bits[lo:hi]
        top = np.uint32(0)
        for i in range(block_bits.shape[0]):
            top = max(top, block_bits[i] & _ABS_MASK)
        if top >= _INF_BITS:
            return b
        cell[0] = top
        s = min(cell_value[0] / _QMAX, _MAX_SCALE)
        if s >= _FLT_MIN:
            scales[b] = s
            divisor = s
        else:
            scales[b] = np.float32(0.0)
            divisor = np.float32(1.0)
        xs = x[lo:hi]
        out = packed[lo // 2 : (hi + 1) // 2]
        m = xs.shape[0]
        for j in range(out.shape[0]):
            # x / s is at most 7 up to one rounding of the scale: clamped, never wrapped
            q0 = min(max(np.rint(xs[2 * j] / divisor), -_QMAX), _QMAX)
            q1 = np.float32(0.0)
            if 2 * j + 1 < m:
                q1 = min(max(np.rint(xs[2 * j + 1] / divisor), -_QMAX), _QMAX)
            out[j] = np.uint8((np.int64(q0) & 0xF) | ((np.int64(q1) & 0xF) << 4))
    return -1


@_jit("void(uint8[::1], float32[::1], int64, float32[::1], float32, int64)")
def add_decoded(
    packed: np.ndarray,
    scales: np.ndarray,
    block_size: int,
    out: np.ndarray,
    weight: np.float32,
    mode: int,
) -> None:
    """mode 0: out = q * scale; 1: out = (q * scale) * weight; 2: out += (q * scale) *
    weight. In float32, in that order."""
    n = out.shape[0]
    for b in range(scales.shape[0]):
        lo = b * block_size
        hi = min(lo + block_size, n)
        s = scales[b]
        src = packed[lo // 2 : (hi + 1) // 2]
        ys = out[lo:hi]
        for i in range(ys.shape[0]):
            nibble = (np.int64(src[i >> 1]) >> ((i & 1) * 4)) & 0xF
            value = np.float32(nibble - 16 if nibble >= 8 else nibble) * s
            if mode == 0:
                ys[i] = value
            elif mode == 1:
                ys[i] = value * weight
            else:
                ys[i] += value * weight


def decode(packed: np.ndarray, scales: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """out = q * scale: an exact widening, then one IEEE float32 multiply."""
    add_decoded(packed, scales, block_size, out, np.float32(1.0), 0)
