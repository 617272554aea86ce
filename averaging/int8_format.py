"""The numbers that define the int8 and int4 block codecs' scales, shared by the codecs
(compression.py) and their compiled kernels (int8_kernels.py, int4_kernels.py)."""

from __future__ import annotations

from typing import Final

import numpy as np

__all__ = [
    "FLT_MIN",
    "FLT_MIN_BITS",
    "INT4_MAX_SCALE",
    "INT4_MAX_SCALE_BITS",
    "INT4_QMAX",
    "MAX_SCALE",
    "MAX_SCALE_BITS",
    "QMAX",
]

# Smallest normal float32: scales below it are flushed to zero so that decoding
# never multiplies by a subnormal (flush-to-zero peers would disagree).
FLT_MIN: Final = np.float32(np.finfo(np.float32).tiny)
FLT_MIN_BITS: Final = int(FLT_MIN.view(np.uint32))
QMAX: Final = 127  # codes are in [-127, 127]
INT4_QMAX: Final = 7  # int4 codes are in [-7, 7]


def _largest_safe_scale(qmax: int) -> np.float32:
    """Largest float32 s with qmax * s finite, so a decoded value is never inf."""
    s = np.float32(np.finfo(np.float32).max) / np.float32(qmax)
    with np.errstate(over="ignore"):
        while not np.isfinite(s * np.float32(qmax)):
            s = np.nextafter(s, np.float32(0))
    return s


MAX_SCALE: Final = _largest_safe_scale(QMAX)
MAX_SCALE_BITS: Final = int(MAX_SCALE.view(np.uint32))
INT4_MAX_SCALE: Final = _largest_safe_scale(INT4_QMAX)
INT4_MAX_SCALE_BITS: Final = int(INT4_MAX_SCALE.view(np.uint32))
