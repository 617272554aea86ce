"""LSH signatures: the bit disagreement is the binomial of the angle; thresholds; attacks."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from shoal.verification import lsh
from shoal.verification.lsh import (
    SignatureConfig,
    compare,
    detection_probability,
    flip_threshold,
    sign,
)

CONFIG = SignatureConfig(block=1024, bits_per_block=64)


def pair_at_angle(blocks: int, angle: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat tensors whose every block pair is exactly `angle` apart."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(blocks, CONFIG.block, generator=g, dtype=torch.float64)
    w = torch.randn(blocks, CONFIG.block, generator=g, dtype=torch.float64)
    u /= u.norm(dim=1, keepdim=True)
    w -= (w * u).sum(dim=1, keepdim=True) * u
    w /= w.norm(dim=1, keepdim=True)
    v = math.cos(angle) * u + math.sin(angle) * w
    scale = torch.rand(blocks, 1, generator=g, dtype=torch.float64) * 10 + 0.1
    return (u * scale).reshape(-1).float(), (v * scale).reshape(-1).float()


@pytest.mark.parametrize("angle", [1e-3, 1e-2, 0.1, 1.0])
def test_bit_disagreement_follows_the_binomial_of_the_angle(angle: float) -> None:
    blocks = 1600  # 102,400 bits
    u, v = pair_at_angle(blocks, angle, seed=int(angle * 1e6))
    result = compare(sign(u, b"seed"), sign(v, b"seed"))
    n, p = result.bits, angle / math.pi
    assert n >= 100_000
    mean, sigma = n * p, math.sqrt(n * p * (1 - p))
    assert abs(result.flips - mean) <= 3 * sigma, (result.flips, mean, sigma)
    assert result.mean_log2_norm_gap < 2 / 256  # same norms, up to the quantization


def test_identical_tensors_agree_exactly_and_the_seed_changes_every_bit_pattern() -> None:
    t = torch.randn(5000)
    a, b = sign(t, b"one"), sign(t.clone(), b"one")
    assert compare(a, b).flips == 0 and a.bits == b.bits
    assert sign(t, b"two").bits != a.bits
    assert a.nbits == 5 * 64 and len(a.bits) == a.nbits // 8
    with pytest.raises(ValueError, match="do not compare"):
        compare(a, sign(t, b"two"))


def test_a_signature_is_small_and_independent_of_dtype_and_shape() -> None:
    t = torch.randn(64, 1024)
    sig = sign(t, b"s")
    assert len(sig.bits) + len(sig.log_norms) == 64 * (64 // 8 + 2)  # 10 bytes per 1024 values
    assert sign(t.reshape(-1), b"s") == sig
    assert compare(sign(t.double(), b"s"), sig).flips == 0


def whole_padded_signature_parts(t: torch.Tensor, seed: bytes) -> tuple[bytes, bytes]:
    """The signature as first specified: the whole tensor zero-padded to full blocks,
    each group of blocks projected, each block's norm in float64."""
    from shoal.verification.lsh import GROUP_BLOCKS, _projection

    flat = t.reshape(-1).float()
    blocks = -(-flat.numel() // CONFIG.block)
    rows = torch.zeros(blocks * CONFIG.block)
    rows[: flat.numel()] = flat
    rows = rows.view(blocks, CONFIG.block)
    projected = torch.cat([
        rows[start : start + GROUP_BLOCKS] @ _projection(seed, group, CONFIG)
        for group, start in enumerate(range(0, blocks, GROUP_BLOCKS))
    ])  # fmt: skip
    norms = torch.linalg.vector_norm(rows.double(), dim=1).numpy()
    with np.errstate(divide="ignore"):
        logs = np.round(np.log2(norms) * 256)
    quantized = np.where(norms > 0, np.clip(logs, -(2**15) + 1, 2**15 - 1), -(2**15))
    return np.packbits((projected >= 0).numpy()).tobytes(), quantized.astype("<i2").tobytes()


GROUP = 256 * 1024  # the elements of one group of blocks


@pytest.mark.parametrize("elements", [1, 1023, 1024, GROUP, GROUP + 7, 3 * GROUP - 5])
def test_a_signature_is_the_same_bits_however_it_is_computed_in_memory(elements: int) -> None:
    # Peers compare signatures they computed apart (a stage audit sends its own), so
    # signing a group of blocks at a time must give the whole-tensor definition's bits.
    g = torch.Generator().manual_seed(elements)
    t = torch.randn(elements, generator=g) * 1e-3
    t[: elements // 5] = 0  # all-zero blocks keep their marker
    sig = sign(t, b"k")
    assert (sig.bits, sig.log_norms) == whole_padded_signature_parts(t, b"k")
    assert sig.elements == elements


def test_thresholds_match_the_binomial_table_of_the_design_note() -> None:
    # accept iff flips <= t, at a per-check false-positive rate of 1e-6
    assert flip_threshold(8192, 2e-3, 1e-6) == 19
    assert flip_threshold(32768, 3e-3, 1e-6) == 61
    assert flip_threshold(131072, 5e-3, 1e-6) == 281
    assert detection_probability(32768, 61, 1e-2) > 0.999
    assert detection_probability(32768, 61, 3e-3) < 1e-6 * 10


def exact_tail(t: int, n: int, p: float) -> float:
    """P[Bin(n, p) > t] = 1 - P[Bin(n, p) <= t], in exact rationals, then a float."""
    q = Fraction(p)
    return float(1 - sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(t + 1)))


@pytest.mark.parametrize(
    ("t", "n", "p"),
    [(19, 8192, 2e-3 / math.pi), (5, 8192, 2e-3 / math.pi), (0, 300, 0.01), (40, 300, 0.01),
     (150, 300, 0.01), (299, 300, 0.5), (120, 300, 0.5)],
)  # fmt: skip
def test_the_tail_is_the_binomial_tail_below_the_mode_above_it_and_underflowed(
    t: int, n: int, p: float
) -> None:
    assert lsh._upper_tail(t, n, p) == pytest.approx(exact_tail(t, n, p), rel=1e-9, abs=1e-300)


def test_a_tail_stops_where_its_terms_vanish_not_at_the_last_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Thresholds of a 50M model's signature (3.2M bits) are searched in about 20 tails;
    those far past the mode underflow to 0 at once and must end there. Summing their
    zeros on to k = n took 25 million terms, 15 s of pure Python holding the
    interpreter against the daemon's event loop."""
    terms = []
    real = lsh._log_pmf
    monkeypatch.setattr(lsh, "_log_pmf", lambda k, n, p: terms.append(k) or real(k, n, p))
    bits, angle = 3_161_152, 3.2e-3
    assert lsh._upper_tail(bits // 2, bits, angle / math.pi) == 0.0
    assert len(terms) == 1
    flip_threshold.cache_clear()
    terms.clear()
    assert flip_threshold(bits, angle, 1e-6) == 3493
    assert len(terms) < 10 * math.sqrt(bits)  # tails of a few standard deviations each


def test_the_false_positive_rate_holds_for_honest_pairs_at_the_floor() -> None:
    """2000 pairs exactly at the honest angle: none exceeds a 1e-4 threshold (expected 0.2)."""
    config = SignatureConfig(block=256, bits_per_block=64)
    honest = 3e-3
    t = flip_threshold(64 * 16, honest, 1e-4)
    g = torch.Generator().manual_seed(5)
    failures = 0
    for i in range(2000):
        u = torch.randn(16, 256, generator=g, dtype=torch.float64)
        w = torch.randn(16, 256, generator=g, dtype=torch.float64)
        u /= u.norm(dim=1, keepdim=True)
        w -= (w * u).sum(dim=1, keepdim=True) * u
        w /= w.norm(dim=1, keepdim=True)
        v = math.cos(honest) * u + math.sin(honest) * w
        seed = i.to_bytes(4, "little")
        if compare(sign(u, seed, config), sign(v, seed, config)).flips > t:
            failures += 1
    assert failures <= 2


def test_scaling_passes_the_angle_and_fails_the_norm_test() -> None:
    t = torch.randn(100_000)
    a, b = sign(t, b"s"), sign(t * 1.05, b"s")
    result = compare(a, b)
    assert result.flips == 0
    assert result.mean_log2_norm_gap == pytest.approx(math.log2(1.05), abs=2 / 256)


def test_zero_blocks_compare_as_far_apart_unless_both_are_zero() -> None:
    t = torch.randn(4096)
    zeroed = t.clone()
    zeroed[:1024] = 0
    assert compare(sign(zeroed, b"s"), sign(zeroed.clone(), b"s")).mean_log2_norm_gap == 0
    assert compare(sign(t, b"s"), sign(zeroed, b"s")).mean_log2_norm_gap > 10


def _orthogonal_to_projection(x: torch.Tensor, seed: bytes, relative: float) -> torch.Tensor:
    """x plus noise in the null space of the projection `seed` gives (a known seed)."""
    from shoal.verification.lsh import _projection

    r = _projection(seed, 0, CONFIG).double()
    rows = x.reshape(-1, CONFIG.block).double()
    noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    # remove the component in the span of R's columns: what the known hyperplanes see
    coeffs = torch.linalg.lstsq(r, noise.T).solution
    noise -= (r @ coeffs).T
    noise *= relative * rows.norm() / noise.norm()
    return (rows + noise).reshape(-1).float()


def test_a_perturbation_orthogonal_to_a_known_projection_is_caught_by_a_fresh_seed() -> None:
    x = torch.randn(64 * CONFIG.block)
    forged = _orthogonal_to_projection(x, b"known", relative=0.05)
    threshold = flip_threshold(64 * 64, 3e-3, 1e-6)
    reused = compare(sign(x, b"known"), sign(forged, b"known"))
    fresh = compare(sign(x, b"drawn after the reveal"), sign(forged, b"drawn after the reveal"))
    assert reused.flips <= threshold  # the forger escapes a seed it knew in advance
    assert fresh.flips > threshold  # and is caught by one drawn after it committed
    assert fresh.angle == pytest.approx(0.05, rel=0.35)


def test_the_flip_threshold_is_computed_once_per_signature_size_angle_and_rate() -> None:
    """(Its search is pure Python, seconds for a real model's signature: every audit of
    an experiment asks the same, and must not hold the interpreter each time.)"""
    before = flip_threshold.cache_info()
    first = flip_threshold(8192 + 7, 2e-3, 1e-6)
    assert flip_threshold(8192 + 7, 2e-3, 1e-6) == first
    after = flip_threshold.cache_info()
    assert after.misses == before.misses + 1 and after.hits == before.hits + 1
