"""The orthonormal DCT-II basis of a chunk size, the same bits on every machine.

A library cosine (libm, numpy, torch) may differ by an ulp between machines, so
the basis is built from IEEE double additions, multiplications, divisions and
square roots only (each correctly rounded everywhere): the cosines of the 4m
angles the basis needs come from Taylor series on [0, pi/2], the rest from the
quadrant identities on exact integers. The transforms themselves avoid matrix
products (a BLAS may sum in any order): they accumulate one rank-one term at a
time with separate elementwise multiplies and adds (never fused), so a forward
or inverse transform is a pure function of its input, CPU or GPU alike.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

__all__ = ["MAX_DCT_CHUNK", "dct_basis", "dct_forward", "dct_inverse_sparse"]

MAX_DCT_CHUNK = 1024  # a basis is m*m float32: 4 MiB at 1024
_TAYLOR_TERMS = 30  # the terms of a series on [0, pi/2] are below 1e-40 by then


def _cos_sin(a: float) -> tuple[float, float]:
    """cos(a) and sin(a) for a in [0, pi/2], by their Taylor series in a fixed order."""
    a2 = a * a
    cos_term, sin_term = 1.0, a
    cos_sum, sin_sum = 1.0, a
    for i in range(1, _TAYLOR_TERMS):
        cos_term = -cos_term * a2 / ((2 * i - 1) * (2 * i))
        sin_term = -sin_term * a2 / ((2 * i) * (2 * i + 1))
        cos_sum += cos_term
        sin_sum += sin_term
    return cos_sum, sin_sum


def _cosines(m: int) -> np.ndarray:
    """cos(t*pi/(2m)) for t in 0..4m-1 (float64)."""
    out = np.empty(4 * m, dtype=np.float64)
    for t in range(4 * m):
        quadrant, r = divmod(t, m)
        c, s = _cos_sin(r * math.pi / (2 * m))
        out[t] = (c, -s, -c, s)[quadrant]
    return out


@functools.cache
def dct_basis(m: int) -> torch.Tensor:
    """The m x m orthonormal DCT-II matrix D (float32; row i is the i-th basis vector,
    so coefficients are D @ x and x = D.T @ coefficients)."""
    if not isinstance(m, int) or not 1 <= m <= MAX_DCT_CHUNK:
        raise ValueError(f"DCT size must be an int in 1..{MAX_DCT_CHUNK}, got {m!r}")
    i = np.arange(m, dtype=np.int64)[:, None]
    n = np.arange(m, dtype=np.int64)[None, :]
    angles = (i * (2 * n + 1)) % (4 * m)  # exact integers: cos(i*(2n+1)*pi/(2m))
    scale = np.full((m, 1), math.sqrt(2.0 / m))
    scale[0, 0] = math.sqrt(1.0 / m)
    basis = torch.from_numpy((_cosines(m)[angles] * scale).astype(np.float32))
    basis.requires_grad_(False)
    return basis


def dct_forward(x: torch.Tensor) -> torch.Tensor:
    """The DCT-II coefficients of each row of `x` (rows of m float32 values)."""
    m = x.shape[1]
    basis = dct_basis(m)
    out = torch.zeros_like(x)
    term = torch.empty_like(x)
    for j in range(m):  # out[:, i] += x[:, j] * D[i, j], one j at a time
        torch.mul(x[:, j : j + 1], basis[:, j][None, :], out=term)
        out.add_(term)
    return out


def dct_inverse_sparse(idx: torch.Tensor, values: torch.Tensor, m: int) -> torch.Tensor:
    """Rows of m values from k (index, coefficient) pairs per row: sum over the pairs,
    in their order, of coefficient * D[index] (idx int64 and values float32, both
    rows x k)."""
    basis = dct_basis(m)
    out = torch.zeros((idx.shape[0], m), dtype=torch.float32)
    term = torch.empty_like(out)
    for s in range(idx.shape[1]):
        torch.mul(values[:, s : s + 1], basis[idx[:, s]], out=term)
        out.add_(term)
    return out
