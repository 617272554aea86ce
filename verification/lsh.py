"""Locality-sensitive signatures of tensors: SimHash bits per block plus quantized log-norms.

Two honest re-executions of the same training work differ by float rounding
only (a relative error around 1e-6 in float32 on one CPU, 1e-3 across GPUs in
bf16); a cheat (noise, a sign flip, skipped steps, other data) moves the result
by far more. A signature captures a tensor's direction and size in a few bits
per thousand elements, so an auditor can compare its recomputation with what a
prover revealed without shipping either tensor, and with a tolerance instead
of bitwise equality.

- **Bits**: the flat tensor is cut into blocks of `block` elements; each block
  is projected on `bits_per_block` Gaussian hyperplanes and keeps the signs.
  For two blocks at angle θ, each bit disagrees with probability θ/π
  (Charikar 2002), so the disagreements over B bits follow Bin(B, θ/π).
  Projection matrices are drawn from the seed one group of blocks at a time
  (`GROUP_BLOCKS` blocks share one `block x bits_per_block` matrix): memory is
  one small matrix, never a dense d x B one, and the work runs in torch on
  whole buffers.
- **Norms**: SimHash is blind to scale, so each block also keeps log2 of its
  L2 norm, quantized to 1/256 (int16); the norm test bounds the mean
  difference.
- **The seed is drawn after the prover revealed** (`referees.RoundDraw.lsh_seed`):
  perturbations orthogonal to a known projection pass a fixed seed, never a
  fresh one.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "Comparison",
    "Signature",
    "SignatureConfig",
    "compare",
    "detection_probability",
    "flip_threshold",
    "sign",
]

# Blocks that share one projection matrix (a fresh matrix per group of blocks).
GROUP_BLOCKS = 256
NORM_SCALE = 256  # log2-norm quantization steps per octave
ZERO_NORM = -(2**15)  # the quantized log-norm of an all-zero block


@dataclass(frozen=True)
class SignatureConfig:
    block: int = 1024  # elements per block
    bits_per_block: int = 64

    def __post_init__(self) -> None:
        if self.block < 1 or self.bits_per_block < 1 or self.bits_per_block % 8:
            raise ValueError("block >= 1 and bits_per_block a positive multiple of 8")


@dataclass(frozen=True)
class Signature:
    """What an auditor compares: packed sign bits and quantized log-norms per block."""

    seed: bytes
    config: SignatureConfig
    elements: int
    bits: bytes  # packed, big-endian bit order within a byte (numpy.packbits)
    log_norms: bytes  # int16 little-endian per block

    @property
    def nbits(self) -> int:
        return self.blocks * self.config.bits_per_block

    @property
    def blocks(self) -> int:
        return -(-self.elements // self.config.block)

    def norms(self) -> np.ndarray:
        return np.frombuffer(self.log_norms, dtype="<i2")


def _generator(seed: bytes, group: int) -> torch.Generator:
    digest = hashlib.sha256(b"shoal/lsh/v1\x00" + seed + group.to_bytes(8, "little")).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _projection(seed: bytes, group: int, config: SignatureConfig) -> torch.Tensor:
    return torch.randn(
        config.block, config.bits_per_block, generator=_generator(seed, group), dtype=torch.float32
    )


def sign(tensor: torch.Tensor, seed: bytes, config: SignatureConfig | None = None) -> Signature:
    """The signature of `tensor` (any shape, any float dtype, any device) under `seed`.

    Works a group of blocks at a time: besides `tensor` itself (as float32 on the CPU)
    it holds one group's rows, never a padded or float64 copy of the whole (an audit
    signs two deltas of a whole model)."""
    config = config or SignatureConfig()
    flat = tensor.detach().reshape(-1).to("cpu", torch.float32)
    n = flat.numel()
    blocks = -(-n // config.block)
    bits = np.empty((blocks, config.bits_per_block), dtype=bool)
    norms = np.empty(blocks, dtype=np.float64)
    for group, start in enumerate(range(0, blocks, GROUP_BLOCKS)):
        stop = min(blocks, start + GROUP_BLOCKS)
        rows = _rows(flat, start, stop, config.block)
        projected = rows @ _projection(seed, group, config)
        bits[start:stop] = (projected >= 0).numpy()
        norms[start:stop] = torch.linalg.vector_norm(rows.double(), dim=1).numpy()
    with np.errstate(divide="ignore"):
        logs = np.round(np.log2(norms) * NORM_SCALE)
    quantized = np.where(norms > 0, np.clip(logs, ZERO_NORM + 1, 2**15 - 1), ZERO_NORM)
    return Signature(
        seed=seed,
        config=config,
        elements=n,
        bits=np.packbits(bits).tobytes(),
        log_norms=quantized.astype("<i2").tobytes(),
    )


def _rows(flat: torch.Tensor, start: int, stop: int, block: int) -> torch.Tensor:
    """Blocks `start` to `stop` of `flat` as rows; the last block zero-padded (a copy
    of these rows only where the last block is among them)."""
    end = min(flat.numel(), stop * block)
    if end == stop * block:
        return flat[start * block : end].view(stop - start, block)
    rows = torch.zeros((stop - start) * block, dtype=torch.float32)
    rows[: end - start * block] = flat[start * block : end]
    return rows.view(stop - start, block)


@dataclass(frozen=True)
class Comparison:
    flips: int  # sign bits that disagree
    bits: int
    mean_log2_norm_gap: float  # mean |log2 ||a_i|| - log2 ||b_i|||, over blocks

    @property
    def angle(self) -> float:
        """The angle estimate (radians): pi x the share of disagreeing bits."""
        return math.pi * self.flips / self.bits


def compare(a: Signature, b: Signature) -> Comparison:
    """Compare two signatures of the same shape made with the same seed and config."""
    if a.seed != b.seed or a.config != b.config or a.elements != b.elements:
        raise ValueError("signatures of different seeds, configs or sizes do not compare")
    x = np.frombuffer(a.bits, dtype=np.uint8) ^ np.frombuffer(b.bits, dtype=np.uint8)
    flips = int(np.unpackbits(x).sum())
    na, nb = a.norms().astype(np.int64), b.norms().astype(np.int64)
    zero_a, zero_b = na == ZERO_NORM, nb == ZERO_NORM
    # A block zero on one side only is as far as the quantization allows.
    gaps = np.where(zero_a | zero_b, np.where(zero_a == zero_b, 0, 2**15), np.abs(na - nb))
    return Comparison(flips, a.nbits, float(gaps.mean()) / NORM_SCALE)


def _log_pmf(k: int, n: int, p: float) -> float:
    return (
        math.lgamma(n + 1)
        - math.lgamma(k + 1)
        - math.lgamma(n - k + 1)
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )


def _upper_tail(t: int, n: int, p: float) -> float:
    """P[Bin(n, p) > t], summed in log space from t + 1 until the terms vanish."""
    if t >= n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    start = t + 1
    peak = max(start, math.floor((n + 1) * p))
    total = 0.0
    # Terms rise until the mode, then fall geometrically; stop once negligible. Past
    # the mode a term that is 0.0 (underflowed: the tail is below 1e-308) ends the sum
    # too: every later one is smaller. (With `<` alone a tail of zeros went on to k = n:
    # 25 million terms in pure Python, ~20 s of a core holding the interpreter, for
    # the threshold of a 50M model's 3.2M-bit signature.)
    k = start
    while k <= n:
        term = math.exp(_log_pmf(k, n, p))
        total += term
        if k >= peak and term <= total * 1e-17:
            break
        k += 1
    return min(1.0, total)


@functools.lru_cache(maxsize=64)
def flip_threshold(bits: int, honest_angle: float, false_positive_rate: float) -> int:
    """The largest flip count an honest pair at `honest_angle` exceeds with probability
    at most `false_positive_rate`: pass iff flips <= threshold. About 20 tails of a
    few thousand terms each (a binary search); cached, since every audit of one
    experiment asks the same."""
    p = min(1.0, max(0.0, honest_angle / math.pi))
    lo, hi = 0, bits
    while lo < hi:  # the smallest t with P[Bin(bits, p) > t] <= rate
        mid = (lo + hi) // 2
        if _upper_tail(mid, bits, p) <= false_positive_rate:
            hi = mid
        else:
            lo = mid + 1
    return lo


def detection_probability(bits: int, threshold: int, angle: float) -> float:
    """P[a pair at `angle` fails the test flips <= threshold] = P[Bin(bits, angle/pi) > t]."""
    return _upper_tail(threshold, bits, min(1.0, angle / math.pi))
