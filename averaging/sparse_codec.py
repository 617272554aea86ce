"""Sparse pseudo-gradient codecs: chunked top-k (SparseLoCo) or chunked DCT top-k
(DeMo), with the kept values quantized to a few bits against a centroid table.

One message codes a whole flat float32 vector of n elements, cut into chunks of
`chunk` elements (the last may be shorter). Of every chunk, `k` entries are kept
(the tail chunk keeps ceil(len * k / chunk), at least 1): for ``topk`` the
largest values themselves, for ``dct`` the largest coefficients of the chunk's
orthonormal DCT-II (`dct_basis`). Ties are broken by the lower index (all
entries above the k-th largest magnitude, then the lowest-indexed ones equal to
it), so the choice is a pure function of the input.

The kept values share one table of 2**bits float32 centroids: codes come from a
uniform quantizer over 6 standard deviations of the kept values around their
mean (statistics summed in float64, sequentially), and each code's centroid is
the mean of the values that got it. Decoding is a table lookup, exact on every
machine; the DCT's inverse is the fixed-order sum of `dct_inverse_sparse`.

Layout (little-endian), its size a function of (n, codec) alone:

- table: 2**bits float32, finite, non-decreasing, each within +-MAX_MAGNITUDE;
- indices, full chunks first, then the tail, each chunk's k offsets (ascending)
  in the smallest of three fixed-size forms, chosen from (chunk, k) alone:
  * fields: one stream of ceil(log2(chunk))-bit fields for every chunk's
    offsets (12 bits for 4096);
  * Elias-Fano: with b = floor(log2(len / k)), first every offset's low b bits
    as one stream of b-bit fields, then per chunk an upper bitmap of
    k + ((len - 1) >> b) + 1 bits where offset i sets bit (offset >> b) + i,
    one stream for all chunks (k (b + 2) bits per chunk and change: 8 bits an
    offset at 64 of 4096, where fields take 12); exactly k bits set per chunk;
  * bitmap, when denser: one per chunk (ceil(len / 8) bytes, bit i of byte j is
    offset 8j + i) with exactly k bits set and none past the chunk's end;
- codes: k per chunk in the same order, `bits` bits each.

Bit streams are packed from the low bit of each byte up, and the padding bits
of their last byte are zero.

Bytes from a peer are checked whole (`check`) before anything is decoded, and
anything else raises `CodecError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

import numpy as np
import torch

from .compression import BytesLike, CodecError, _check_out, _check_src, _src_view
from .dct_basis import MAX_DCT_CHUNK, dct_forward, dct_inverse_sparse

__all__ = [
    "MAX_MAGNITUDE",
    "SPARSE_KINDS",
    "SparseCodec",
    "SparseMessage",
]

SPARSE_KINDS: Final = ("topk", "dct")
MIN_CHUNK, MAX_CHUNK = 16, 65536
MIN_BITS, MAX_BITS = 1, 8
# Centroids (and the values coded) stay within this, so that a sum over a group of any
# size, weighted by shares <= 1, stays finite in float32.
MAX_MAGNITUDE: Final = 2.0**64
_STD_RANGE = 6.0  # the quantizer spans 6 standard deviations (SparseLoCo's setting)


@dataclass(frozen=True)
class SparseMessage:
    """A checked message: global indices (int64, ascending within a chunk, chunk by
    chunk), their decoded float32 values, and the chunk geometry they belong to.
    `norm`: the L2 norm of the values, exactly rounded from the centroid table and how
    often each centroid is used, so that every machine computes the same float (for
    dct it is the norm of the decoded vector too: the transform is orthonormal)."""

    indices: torch.Tensor
    values: torch.Tensor
    norm: float = 0.0


@dataclass(frozen=True)
class SparseCodec:
    """A sparse codec: `kind` (topk or dct), `chunk` size, `k` kept per chunk, `bits`
    per kept value. Immutable, and its functions are pure: safe to share."""

    kind: str
    chunk: int
    k: int
    bits: int

    def __post_init__(self) -> None:
        if self.kind not in SPARSE_KINDS:
            raise ValueError(f"sparse codec kind must be one of {SPARSE_KINDS}, got {self.kind!r}")
        hi = MAX_DCT_CHUNK if self.kind == "dct" else MAX_CHUNK
        for name, value, lo, top in (
            ("chunk", self.chunk, MIN_CHUNK, hi),
            ("k", self.k, 1, self.chunk // 2 if _is_int(self.chunk) else 0),
            ("bits", self.bits, MIN_BITS, MAX_BITS),
        ):
            if not _is_int(value) or not lo <= value <= top:
                raise ValueError(f"{self.kind} codec: {name} must be an int in {lo}..{top}")

    @classmethod
    def from_density(cls, kind: str, chunk: int, density: float, bits: int) -> SparseCodec:
        """The codec keeping about `density` of every chunk (at least one entry)."""
        k = max(1, round(density * chunk)) if _is_int(chunk) else 0
        return cls(kind, chunk, k, bits)

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.chunk}-{self.k}-{self.bits}"

    @classmethod
    def parse(cls, name: str) -> SparseCodec:
        """The codec `name` names (ValueError unless it is one)."""
        parts = name.split("-")
        if len(parts) != 4 or not all(p.isdigit() and len(p) <= 6 for p in parts[1:]):
            raise ValueError(f"not a sparse codec name: {name!r}")
        return cls(parts[0], int(parts[1]), int(parts[2]), int(parts[3]))

    # ------------------------------------------------------------ geometry

    def _tail(self, n: int) -> tuple[int, int, int]:
        """(full chunks, tail length, tail k)."""
        if not _is_int(n) or n < 0:
            raise ValueError(f"element count must be an int >= 0, got {n!r}")
        full, tail = divmod(n, self.chunk)
        tail_k = min(tail, max(1, -(-tail * self.k // self.chunk))) if tail else 0
        return full, tail, tail_k

    @property
    def _offset_bits(self) -> int:
        return max(1, (self.chunk - 1).bit_length())

    @property
    def _scheme(self) -> str:
        """How offsets are coded: the smallest for a full chunk (fields on a tie)."""
        sizes = {
            "fields": self.k * self._offset_bits,
            "elias_fano": _ef_bits(self.chunk, self.k),
            "bitmap": -(-self.chunk // 8) * 8,
        }
        return min(sizes, key=lambda s: sizes[s])  # dict order: fields, then the others

    def _bitmap(self) -> bool:
        return self._scheme == "bitmap"

    def _index_bytes(self, n: int) -> int:
        full, tail, tail_k = self._tail(n)
        scheme = self._scheme
        if scheme == "bitmap":
            return full * -(-self.chunk // 8) + -(-tail // 8)
        if scheme == "elias_fano":
            return -(-(full * _ef_bits(self.chunk, self.k) + _ef_bits(tail, tail_k)) // 8)
        return -(-(full * self.k + tail_k) * self._offset_bits // 8)

    def kept(self, n: int) -> int:
        """How many values a message of n elements carries."""
        full, _, tail_k = self._tail(n)
        return full * self.k + tail_k

    def encoded_size(self, n: int) -> int:
        """The exact length of the message of n elements."""
        if not n:
            return 0
        return 4 * (1 << self.bits) + self._index_bytes(n) + -(-self.kept(n) * self.bits // 8)

    # ------------------------------------------------------------ encode

    def encode(self, src: torch.Tensor) -> bytes:
        """The message of `src` (1-D contiguous float32 on the CPU, finite, every value
        within MAX_MAGNITUDE)."""
        return self.encode_kept(src)[0]

    def encode_kept(self, src: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """(`encode(src)`, the float32 values it kept before they were quantized: the
        entries, or DCT coefficients, at the message's indices, in their order)."""
        x = _check_src(src)
        n = x.numel()
        if not n:
            return b"", torch.empty(0)
        _check_magnitude(x, self.name, "input")
        full, tail, tail_k = self._tail(n)
        parts = [(x[: full * self.chunk].view(full, self.chunk), self.k)] if full else []
        if tail:
            parts.append((x[full * self.chunk :].view(1, tail), tail_k))
        picked = [self._pick(rows, k) for rows, k in parts]
        values = np.concatenate([v.numpy().astype(np.float64).ravel() for _, v in picked])
        table, codes = _quantize(values, self.bits)
        if self._bitmap():
            index_bytes = b"".join(
                _bitmap_of(i.numpy(), rows.shape[1])
                for (i, _), (rows, _) in zip(picked, parts, strict=True)
            )
        elif self._scheme == "elias_fano":
            index_bytes = _ef_encode([(i.numpy(), rows.shape[1]) for (i, _), (rows, _) in
                                      zip(picked, parts, strict=True)])  # fmt: skip
        else:
            offsets = np.concatenate([i.numpy().ravel() for i, _ in picked])
            index_bytes = _pack_bits(offsets, self._offset_bits)
        packed = _pack_bits(codes, self.bits)
        kept = torch.cat([v.reshape(-1) for _, v in picked])
        return table.astype("<f4").tobytes() + index_bytes + packed, kept

    def chunk_span(self, index: int, n: int) -> tuple[int, int, int]:
        """(first element, length, entries kept) of chunk `index` of n elements."""
        full, tail, tail_k = self._tail(n)
        if not 0 <= index < full + (1 if tail else 0):
            raise IndexError(index)
        if index < full:
            return index * self.chunk, self.chunk, self.k
        return index * self.chunk, tail, tail_k

    def chunks(self, n: int) -> int:
        """How many chunks n elements make."""
        full, tail, _ = self._tail(n)
        return full + (1 if tail else 0)

    def pick_chunk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, values) that `encode` keeps of one chunk `x` of which it keeps `k`:
        the same bits as of that chunk within a whole vector (row by row, elementwise).
        `CodecError` where `encode` would raise it."""
        _check_magnitude(x, self.name, "input")
        idx, values = self._pick(x.view(1, -1), k)
        return idx.view(-1), values.view(-1)

    def recode(self, message: BytesLike, kept: torch.Tensor, n: int) -> bytes:
        """The message that keeps the float32 values `kept` at the indices of `message`
        (of n elements, checked): the one `encode` sent, when those are the values it
        kept. `kept` must be finite, of `kept(n)` elements."""
        mv = _src_view(message, self.name)
        head = 4 * (1 << self.bits)
        table, codes = _quantize(kept.numpy().astype(np.float64), self.bits)
        index = bytes(mv[head : head + self._index_bytes(n)])
        return table.astype("<f4").tobytes() + index + _pack_bits(codes, self.bits)

    def _pick(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the offsets (ascending) and values of the k largest magnitudes of
        the row (topk) or of its DCT coefficients (dct)."""
        coef = dct_forward(rows) if self.kind == "dct" else rows
        if self.kind == "dct":
            _check_magnitude(coef, self.name, "DCT coefficient")
        magnitude = coef.abs()
        # The k-th largest magnitude is the same whichever way topk orders ties; then
        # everything above it, and of the entries equal to it the lowest indices.
        threshold = torch.topk(magnitude, k, dim=1, sorted=False).values.amin(1, keepdim=True)
        keep = magnitude >= threshold
        surplus = (keep.sum(dim=1) > k).nonzero().view(-1)  # rows with ties at the threshold
        if surplus.numel():
            rows, cut = magnitude[surplus], threshold[surplus]
            at = rows == cut
            room = k - (rows > cut).sum(dim=1, keepdim=True)
            keep[surplus] = (rows > cut) | (at & (torch.cumsum(at, dim=1) <= room))
        idx = keep.nonzero()[:, 1].view(-1, k)  # row by row, ascending
        return idx, torch.gather(coef, 1, idx)

    # ------------------------------------------------------------ decode

    def check(self, data: BytesLike, n: int) -> SparseMessage:
        """The message in `data` for n elements, every field checked; `CodecError`
        says what is wrong."""
        mv = _src_view(data, self.name)
        expected = self.encoded_size(n)
        if len(mv) != expected:
            raise CodecError(
                f"{self.name}: expected {expected} bytes for {n} elements, got {len(mv)}"
            )
        if not n:
            return SparseMessage(torch.empty(0, dtype=torch.int64), torch.empty(0))
        raw = np.frombuffer(mv, dtype=np.uint8)
        levels = 1 << self.bits
        table = raw[: 4 * levels].view("<f4").astype(np.float32)
        if not np.isfinite(table).all() or np.abs(table).max() > MAX_MAGNITUDE:
            raise CodecError(f"{self.name}: centroid table has a non-finite or huge entry")
        if (np.diff(table) < 0).any():
            raise CodecError(f"{self.name}: centroid table is not non-decreasing")
        full, tail, tail_k = self._tail(n)
        pos = 4 * levels
        end = pos + self._index_bytes(n)
        offsets = self._read_indices(raw[pos:end], full, tail, tail_k)
        codes = _unpack_bits(raw[end:], self.kept(n), self.bits, self.name)
        starts = np.concatenate(
            [np.repeat(np.arange(full, dtype=np.int64) * self.chunk, self.k),
             np.full(tail_k, full * self.chunk, dtype=np.int64)]
        )  # fmt: skip
        return SparseMessage(
            torch.from_numpy(offsets + starts),
            torch.from_numpy(table[codes]),
            _exact_norm(table, np.bincount(codes, minlength=levels)),
        )

    def _read_indices(self, raw: np.ndarray, full: int, tail: int, tail_k: int) -> np.ndarray:
        """The offsets of every chunk, chunk by chunk, checked: exactly k per chunk,
        distinct, ascending, within the chunk."""
        if self._bitmap():
            head = -(-self.chunk // 8) * full
            blocks = [(raw[:head], full, self.chunk, self.k), (raw[head:], 1, tail, tail_k)]
            return np.concatenate(
                [
                    _read_bitmap(b, rows, length, k, self.name)
                    for b, rows, length, k in blocks
                    if rows and length
                ]
            )
        if self._scheme == "elias_fano":
            blocks = [(full, self.chunk, self.k), (1 if tail else 0, tail, tail_k)]
            return _ef_decode(raw, [b for b in blocks if b[0]], self.name)
        flat = _unpack_bits(raw, full * self.k + tail_k, self._offset_bits, self.name)
        for rows, length, k, part in (
            (full, self.chunk, self.k, flat[: full * self.k]),
            (1 if tail else 0, tail, tail_k, flat[full * self.k :]),
        ):
            if not rows:
                continue
            idx = part.reshape(rows, k)
            if (idx[:, -1] >= length).any():
                raise CodecError(f"{self.name}: an index is past its chunk's end ({length})")
            if k > 1 and (np.diff(idx, axis=1) <= 0).any():
                raise CodecError(f"{self.name}: a chunk's indices are not strictly ascending")
        return flat

    def add_decoded(self, message: SparseMessage, out: torch.Tensor, weight: float) -> None:
        """``out += weight * decode(message)``: for topk an elementwise add at the
        message's (distinct) indices, for dct a dense add of the inverse transform.
        The same bits wherever it runs."""
        y = _check_out(out)
        w = torch.tensor(weight, dtype=torch.float32)
        if self.kind == "topk":
            idx = message.indices
            y[idx] = y[idx] + message.values * w
            return
        n = y.numel()
        full, tail, tail_k = self._tail(n)
        split = full * self.k
        if full:
            rows = dct_inverse_sparse(
                (message.indices[:split].view(full, self.k) % self.chunk),
                message.values[:split].view(full, self.k),
                self.chunk,
            )
            y[: full * self.chunk] += rows.view(-1) * w
        if tail:
            rows = dct_inverse_sparse(
                message.indices[split:].view(1, tail_k) - full * self.chunk,
                message.values[split:].view(1, tail_k),
                tail,
            )
            y[full * self.chunk :] += rows.view(-1) * w

    def add_sent(
        self,
        message: SparseMessage,
        total: torch.Tensor,
        weights: torch.Tensor,
        value_weight: float,
        share: float,
    ) -> None:
        """For the senders' mean, in the codec's own coordinates (topk: the values; dct:
        the coefficients) at the message's indices: ``total += value_weight * values``
        and ``weights += share`` (a clipped message's values weigh its share times its
        clip scale; its share alone divides)."""
        idx = message.indices
        w = torch.tensor(value_weight, dtype=torch.float32)
        total[idx] = total[idx] + message.values * w
        weights[idx] = weights[idx] + torch.tensor(share, dtype=torch.float32)

    def senders_mean_into(
        self, total: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out`` = the decoded senders' mean: each coordinate of `total` divided by its
        `weights` where a member sent it (zero elsewhere), then (dct) transformed back.
        The same bits wherever it runs."""
        y = _check_out(out)
        sent = weights > 0
        mean = torch.where(sent, total / torch.where(sent, weights, 1.0), 0.0)
        if self.kind == "topk":
            y.copy_(mean)
            return
        n = y.numel()
        full, tail, _ = self._tail(n)
        y.zero_()
        parts = ((0, full, self.chunk), (full * self.chunk, 1 if tail else 0, tail))
        for start, rows, width in parts:
            if not rows:
                continue
            end = start + rows * width
            mask = sent[start:end].view(rows, width)
            kept = int(mask.sum(dim=1).max())
            if not kept:
                continue
            # Each row's sent coefficients first, in ascending order (stable), padded
            # with unsent ones, whose coefficient is zero and adds nothing.
            order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :kept]
            coefficients = mean[start:end].view(rows, width).gather(1, order)
            y[start:end] = dct_inverse_sparse(order, coefficients, width).view(-1)

    def decode(self, data: BytesLike, n: int) -> torch.Tensor:
        """The n float32 values `data` codes (checked first)."""
        out = torch.zeros(n, dtype=torch.float32)
        self.add_decoded(self.check(data, n), out, 1.0)
        return out


# ------------------------------------------------------------------ helpers


def _exact_norm(table: np.ndarray, counts: np.ndarray) -> float:
    """sqrt(sum_c counts[c] * table[c]**2), the sum exact (rationals) and rounded once:
    no summation order to differ between machines. 2**bits terms at most."""
    total = sum(
        (Fraction(int(n)) * Fraction(float(t)) ** 2 for n, t in zip(counts, table, strict=True)),
        Fraction(0),
    )
    return math.sqrt(float(total))


def _check_magnitude(x: torch.Tensor, name: str, what: str) -> None:
    """CodecError unless every value is finite and within MAX_MAGNITUDE (one pass:
    a NaN makes both bounds NaN, which fails the comparison)."""
    lo, hi = torch.aminmax(x)
    if not (float(lo) >= -MAX_MAGNITUDE and float(hi) <= MAX_MAGNITUDE):
        bad = ~torch.isfinite(x) | (x.abs() > MAX_MAGNITUDE)
        where = int(bad.reshape(-1).nonzero()[0])
        raise CodecError(f"{name}: NaN, inf or magnitude above 2**64 in {what} {where}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _seq_sum(a: np.ndarray) -> float:
    """A float64 sum in index order (bincount adds sequentially): the same on every
    machine, unlike a vectorized or pairwise sum."""
    return float(np.bincount(np.zeros(a.size, dtype=np.intp), weights=a, minlength=1)[0])


def _quantize(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroid table as float32, uint8 codes) of float64 `values`."""
    levels = 1 << bits
    count = values.size
    shift = _seq_sum(values) / count
    sigma = math.sqrt(_seq_sum((values - shift) ** 2) / max(count - 1, 1))
    scale = _STD_RANGE * sigma / levels
    if scale > 0 and math.isfinite(scale):
        z = (values - shift) / scale + (levels - 1) / 2
        codes = np.clip(np.rint(z), 0, levels - 1).astype(np.uint8)
    else:  # all kept values equal
        codes = np.zeros(count, dtype=np.uint8)
        scale = 0.0
    sums = np.bincount(codes, weights=values, minlength=levels)
    counts = np.bincount(codes, minlength=levels)
    empty = shift + (np.arange(levels) - (levels - 1) / 2) * scale
    centroids = np.where(counts > 0, sums / np.maximum(counts, 1), empty)
    table = np.maximum.accumulate(np.clip(centroids, -MAX_MAGNITUDE, MAX_MAGNITUDE))
    return table.astype(np.float32), codes


def _bitmap_of(idx: np.ndarray, length: int) -> bytes:
    bitmap = np.zeros((idx.shape[0], length), dtype=np.uint8)
    np.put_along_axis(bitmap, idx, 1, axis=1)
    return np.packbits(bitmap, axis=1, bitorder="little").tobytes()


def _read_bitmap(raw: np.ndarray, rows: int, length: int, k: int, name: str) -> np.ndarray:
    bits = np.unpackbits(raw.reshape(rows, -1), axis=1, bitorder="little")
    if bits[:, length:].any():
        raise CodecError(f"{name}: index bitmap has bits past the chunk's end")
    if (bits.sum(axis=1) != k).any():
        raise CodecError(f"{name}: a chunk's bitmap does not have exactly {k} bits")
    return np.nonzero(bits)[1]


def _ef_params(length: int, k: int) -> tuple[int, int]:
    """Elias-Fano of k distinct offsets below `length`: (low bits, upper bitmap bits)."""
    low = max(0, (length // k).bit_length() - 1)
    return low, k + ((length - 1) >> low) + 1


def _ef_bits(length: int, k: int) -> int:
    """Bits of one chunk's Elias-Fano code (0 for no chunk)."""
    if not length or not k:
        return 0
    low, upper = _ef_params(length, k)
    return k * low + upper


def _ef_encode(blocks: list[tuple[np.ndarray, int]]) -> bytes:
    """Elias-Fano of every chunk's ascending offsets (blocks of rows of k offsets, all
    rows of a block of one length): the low bits of all chunks, then their upper
    bitmaps, as one bit stream."""
    lows, uppers = [], []
    for offsets, length in blocks:
        rows, k = offsets.shape
        low, upper = _ef_params(length, k)
        idx = offsets.astype(np.int64)
        if low:
            lows.append(_bits_of(idx.ravel() & ((1 << low) - 1), low))
        bitmap = np.zeros((rows, upper), dtype=np.uint8)
        np.put_along_axis(bitmap, (idx >> low) + np.arange(k), 1, axis=1)
        uppers.append(bitmap.ravel())
    return np.packbits(np.concatenate(lows + uppers), bitorder="little").tobytes()


def _ef_decode(raw: np.ndarray, blocks: list[tuple[int, int, int]], name: str) -> np.ndarray:
    """The offsets `_ef_encode` wrote for blocks of (rows, length, k), checked: exactly
    k upper bits per chunk, strictly ascending, within the chunk, zero padding."""
    flat = np.unpackbits(raw, bitorder="little")
    params = [(rows, length, k, *_ef_params(length, k)) for rows, length, k in blocks]
    pos, lows = 0, []
    for rows, _, k, low, _ in params:
        count = rows * k * low
        lows.append(_fields_of(flat[pos : pos + count], rows * k, low).reshape(rows, k))
        pos += count
    out = []
    for (rows, length, k, low, upper), low_part in zip(params, lows, strict=True):
        bitmap = flat[pos : pos + rows * upper].reshape(rows, upper)
        pos += rows * upper
        if (bitmap.sum(axis=1, dtype=np.int64) != k).any():
            raise CodecError(f"{name}: an Elias-Fano chunk does not have exactly {k} bits")
        high = np.nonzero(bitmap)[1].reshape(rows, k) - np.arange(k)
        idx = (high << low) | low_part
        if (idx[:, -1] >= length).any():
            raise CodecError(f"{name}: an index is past its chunk's end ({length})")
        if k > 1 and (np.diff(idx, axis=1) <= 0).any():
            raise CodecError(f"{name}: a chunk's indices are not strictly ascending")
        out.append(idx.ravel())
    if flat[pos:].any():
        raise CodecError(f"{name}: padding bits after the last field are not zero")
    return np.concatenate(out)


def _bits_of(values: np.ndarray, width: int) -> np.ndarray:
    """`values` (< 2**width each) as `width` bits each, low bit first (uint8 0/1)."""
    v = values.astype(np.uint32)
    return ((v[:, None] >> np.arange(width, dtype=np.uint32)) & 1).astype(np.uint8).ravel()


def _fields_of(bits: np.ndarray, count: int, width: int) -> np.ndarray:
    """`count` fields of `width` bits (int64) from a 0/1 array, low bit first."""
    if not width:
        return np.zeros(count, dtype=np.int64)
    planes = bits[: count * width].reshape(count, width).astype(np.int64)
    return (planes << np.arange(width, dtype=np.int64)).sum(axis=1)


def _pack_bits(values: np.ndarray, width: int) -> bytes:
    """`values` (< 2**width each) as one stream of `width`-bit fields, low bit first."""
    v = values.astype(np.uint32)
    planes = ((v[:, None] >> np.arange(width, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.ravel(), bitorder="little").tobytes()


def _unpack_bits(raw: np.ndarray, count: int, width: int, name: str) -> np.ndarray:
    """`count` fields of `width` bits (int64); the padding bits must be zero."""
    flat = np.unpackbits(raw, bitorder="little")
    if flat[count * width :].any():
        raise CodecError(f"{name}: padding bits after the last field are not zero")
    planes = flat[: count * width].reshape(count, width).astype(np.int64)
    return (planes << np.arange(width, dtype=np.int64)).sum(axis=1)
