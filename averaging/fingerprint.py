"""Fingerprints of training state, to check that members hold bit-identical state.

After an averaging round every member should hold exactly the same tensors
(the owners forward identical encoded bytes); members exchange these digests
and `compare_fingerprints` names the ones that diverged.

The digest is SHA-256 over an injective framing: a version tag, the tensor
count, then for each tensor a length-prefixed msgpack header (dtype, shape,
byte count) followed by its raw bytes, and finally canonical msgpack of the
metadata. Two states with different dtypes, shapes, tensor boundaries or
metadata never produce the same byte stream, so they collide only if SHA-256
does. Raw bytes are little-endian whatever the host, and tensors on a device
are hashed from a host copy, so the same values give the same digest on any
machine and device (the strategies hash their float32 host state).
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgpack
import torch

from .paged import release

__all__ = ["FingerprintReport", "compare_fingerprints", "state_fingerprint"]

_DOMAIN = b"shoal/state-fingerprint/v1\x00"

P = TypeVar("P", bound=Hashable)
_SCALARS = (str, bytes, bool, int, float)


def state_fingerprint(
    tensors: Sequence[torch.Tensor], metadata: Mapping[Any, Any] | None = None
) -> str:
    """Hex SHA-256 of `tensors` (in order, any dtype and layout) and `metadata`.

    Contiguous CPU tensors are hashed from a view of their storage without a
    copy; other tensors are made contiguous / moved to the CPU first. `metadata`
    (msgpack-serializable: str, bytes, int, float, bool, None, lists, maps) is
    hashed in canonical form, so map order does not matter; None is the same as
    an empty map. Hashing runs at SHA-256 speed (~1-2 GB/s), so callers with
    large states should run it in `asyncio.to_thread` (hashlib releases the GIL).
    """
    h = hashlib.sha256(_DOMAIN)
    h.update(_frame(msgpack.packb(len(tensors))))
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        raw = _raw_bytes(t)
        header = [str(t.dtype).removeprefix("torch."), list(t.shape), len(raw)]
        h.update(_frame(msgpack.packb(header)))
        h.update(raw)
        release(t)  # (a file-mapped tensor's pages: given back once hashed)
    h.update(_frame(_canonical_msgpack(dict(metadata or {}))))
    return h.hexdigest()


@dataclass(frozen=True)
class FingerprintReport(Generic[P]):
    """Outcome of comparing the members' fingerprints.

    `majority` is the fingerprint held by more than half of the peers, or None
    when no fingerprint has a strict majority (then nobody can be trusted as the
    reference and every peer is listed in `divergent`). `divergent` keeps the
    order of the input mapping.
    """

    agreed: bool
    majority: str | None
    divergent: list[P] = field(default_factory=list)


def compare_fingerprints(fingerprints: Mapping[P, str]) -> FingerprintReport[P]:
    """Find the peers whose fingerprint differs from the strict majority's."""
    counts = Counter(fingerprints.values())
    if not counts:
        return FingerprintReport(agreed=True, majority=None, divergent=[])
    top, top_count = counts.most_common(1)[0]
    if 2 * top_count <= len(fingerprints):
        return FingerprintReport(agreed=False, majority=None, divergent=list(fingerprints))
    divergent = [peer for peer, fp in fingerprints.items() if fp != top]
    return FingerprintReport(agreed=not divergent, majority=top, divergent=divergent)


def _frame(chunk: bytes) -> bytes:
    return len(chunk).to_bytes(8, "little") + chunk


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's elements as bytes, without copying a contiguous CPU tensor."""
    if t.layout != torch.strided:
        raise TypeError(f"cannot fingerprint a {t.layout} tensor; convert it to dense first")
    if t.is_quantized:
        raise TypeError("cannot fingerprint a quantized tensor; use its int_repr()")
    # Conjugate/negative views keep the un-applied values in storage.
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    # uint8 covers every dtype numpy lacks (bfloat16, float8, ...) and bool.
    if t.element_size() > 1 and sys.byteorder != "little":
        # Canonical order: the bytes a little-endian host would hash.
        return memoryview(_little_endian_bytes(t))
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _little_endian_bytes(t: torch.Tensor) -> bytes:
    width = t.element_size()
    raw = t.contiguous().reshape(-1).view(torch.uint8).reshape(-1, width)
    return raw.flip(1).contiguous().numpy().tobytes()


def _canonical_msgpack(obj: Any) -> bytes:
    return msgpack.packb(_canonical(obj), use_bin_type=True, strict_types=False)


def _canonical(obj: Any) -> Any:
    """Maps with keys sorted by their own canonical encoding; tuples as lists."""
    if isinstance(obj, Mapping):
        for k in obj:
            if not (k is None or isinstance(k, _SCALARS)):
                raise TypeError(f"metadata key of type {type(k).__name__} is not a scalar")
        # Sort by the keys' encoded bytes: a total order even across key types.
        items = sorted(
            ((msgpack.packb(k, use_bin_type=True), k, v) for k, v in obj.items()),
            key=lambda item: item[0],
        )
        return {k: _canonical(v) for _, k, v in items}
    if isinstance(obj, list | tuple):
        return [_canonical(v) for v in obj]
    if obj is None or isinstance(obj, _SCALARS):
        return obj
    raise TypeError(f"metadata value of type {type(obj).__name__} has no canonical msgpack form")
