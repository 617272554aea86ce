"""Error feedback for a lossy pseudo-gradient codec: what a round did not send is
carried, in float32 on the host, into the next round's contribution.

With `decay` below 1 (SparseLoCo's beta; the option `codec_feedback_decay`), each
round keeps only that share of the residual: what went unsent for many rounds
fades rather than arriving late and all at once.

Transactional, because a round may abort: `compress` codes decay * residual +
delta and holds what the message leaves out; only `commit` (the round committed with our
message in it) makes that the new residual. After an abort the residual stays as
it was (the next round's delta covers this round's steps again), and after a
re-sync it is zeroed: it pushed directions of a state the peer no longer holds.
The residual is private to the peer: it is checkpointed, never served in state
sync.

In a verified experiment the residual is committed to (`claims`: its hash at the
round's start and the hash of what a commit leaves), and each residual carries the
commitment that left it (`chain`, the encoded commitment, checkpointed with it), so
that an audit can check that a round started from what the previous one left
(`verification.commitment.residual_chains`), and the proof of that commitment (the
receipts of its round, `verification.receipts`: opaque bytes here, from
`chain_proof()`) is checkpointed with them, so that a restarted peer still proves
its chain (`restored_proof`).

The hash is of one of two kinds, the experiment's `codec_audit`: ``whole`` (legacy,
`leaf` 0), SHA-256 over the residual's bytes, which an audit checks against the
whole residual; ``chunks`` (`leaf` the codec's chunk), the root of a Merkle tree
whose leaves are the codec's chunks of the residual, so that an audit can check a
few chunks of it against the commitment (`peer.verify.sparse_work.check_sampled`)
rather than a model size of float32.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from shoal.verification.commitment import MerkleTree, leaf_hash

from .buffers import bytes_of
from .sparse_codec import SparseCodec

__all__ = [
    "MAX_CHAIN_BYTES",
    "ErrorFeedback",
    "residual_digest",
    "residual_leaves",
    "zero_digest",
]

MAX_CHAIN_BYTES = 1 << 20  # an encoded commitment (4,096 checkpoints at most)
MAX_PROOF_BYTES = 1 << 16  # the receipts of a round of 256 members at most


def residual_digest(t: torch.Tensor, leaf: int = 0) -> bytes:
    """The hash a commitment carries of a residual (blocking): of its float32 bytes
    (`leaf` 0), or the Merkle root over its chunks of `leaf` elements."""
    if not leaf:
        return hashlib.sha256(bytes_of(t.contiguous())).digest()
    return MerkleTree(residual_leaves(t, leaf)).root


def residual_leaves(t: torch.Tensor, leaf: int) -> list[bytes]:
    """The leaf hashes of a residual's chunks of `leaf` elements (the last may be
    shorter; an empty residual has one empty leaf), in order (blocking)."""
    flat = t.contiguous().view(-1)
    n = flat.numel()
    return [leaf_hash(bytes_of(flat[a : a + leaf])) for a in range(0, n, leaf)] or [leaf_hash(b"")]


def zero_digest(elements: int, leaf: int = 0) -> bytes:
    """`residual_digest` of `elements` zeros (blocking)."""
    if not leaf:
        return residual_digest(torch.zeros(elements))
    full, tail = divmod(elements, leaf)
    leaves = [leaf_hash(bytes(4 * leaf))] * full + ([leaf_hash(bytes(4 * tail))] if tail else [])
    return MerkleTree(leaves or [leaf_hash(b"")]).root


class ErrorFeedback:
    """The residual of one flat float32 vector of `size` elements coded by `codec`."""

    def __init__(
        self,
        codec: SparseCodec,
        size: int,
        *,
        pin: bool = False,
        decay: float = 1.0,
        leaf: int = 0,
    ) -> None:
        """`leaf`: the residual's hash (`residual_digest`): 0 over its bytes, else a
        Merkle root over chunks of `leaf` elements (the codec's chunk)."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay!r}")
        self.codec = codec
        self.size = size
        # What a round keeps of the residual before it adds the new delta (SparseLoCo's
        # beta): a float32 scalar, multiplied and added in two roundings, so that an
        # auditor re-derives the same bits on any machine (no fused multiply-add).
        self.decay = decay
        self._decay = torch.tensor(decay, dtype=torch.float32)
        self.residual = torch.zeros(size, dtype=torch.float32)
        self._pending = torch.zeros(size, dtype=torch.float32)
        if pin:
            self.residual = self.residual.pin_memory()
            self._pending = self._pending.pin_memory()
        self._open = False
        self.leaf = leaf
        # Of the open message, with `leaf`: the values it kept before quantizing, and
        # the leaf hashes of the residuals `claims` hashed (what a sampled reveal shows).
        self.kept: torch.Tensor | None = None
        self.claimed_leaves: tuple[list[bytes], list[bytes]] | None = None
        self.chain = b""  # the encoded commitment whose commit left this residual
        self._pending_chain = b""
        # Verified: a residual must come from a committed commitment (a lone commit has
        # none), or it is dropped on the commit; what it held cannot be vouched for.
        self.require_chain = False
        # Verified: the proof of `chain`, as bytes to checkpoint (None: none to keep),
        # and the one a checkpoint restored (b"": none).
        self.chain_proof: Callable[[], bytes | None] | None = None
        self.restored_proof = b""
        # Verified: whether other members vouch for `chain` now. A residual nobody
        # vouches for is dropped before it is coded (`unvouched_dropped` counts it):
        # a referee would leave us out of its rounds for an unproven chain.
        self.chain_vouched: Callable[[], bool] | None = None
        self.unvouched_dropped = 0

    @property
    def open(self) -> bool:
        """Whether a compressed contribution awaits its round's outcome."""
        return self._open

    def compress(self, delta: torch.Tensor) -> bytes:
        """Code decay * residual + `delta` (flat float32, `size` elements) and replace `delta`
        in place by what the message decodes to; returns the message. The residual it
        would leave is held until `commit` or `abort`. `CodecError` (non-finite
        values) leaves everything as it was."""
        if delta.shape != (self.size,) or delta.dtype != torch.float32:
            raise ValueError(f"delta must be {self.size} float32 values")
        if self.chain and self.chain_vouched is not None and not self.chain_vouched():
            self.residual.zero_()
            self.chain, self.restored_proof = b"", b""
            self.unvouched_dropped += 1
        if self.decay == 1.0:
            torch.add(self.residual, delta, out=self._pending)
        else:
            torch.mul(self.residual, self._decay, out=self._pending)
            self._pending.add_(delta)
        message, kept = self.codec.encode_kept(self._pending)
        self.kept = kept if self.leaf else None
        decoded = torch.zeros_like(delta)
        self.codec.add_decoded(self.codec.check(message, self.size), decoded, 1.0)
        delta.copy_(decoded)
        self._pending.sub_(decoded)
        self._open = True
        return message

    def claims(self) -> tuple[bytes, bytes]:
        """(hash of the residual now, hash of the one a commit of the open message
        leaves): what a verified member commits to (blocking: hashes two vectors)."""
        after = self._pending if self._open else self.residual
        if not self.leaf:
            return residual_digest(self.residual), residual_digest(after)
        leaves = residual_leaves(self.residual, self.leaf), residual_leaves(after, self.leaf)
        self.claimed_leaves = leaves
        return MerkleTree(leaves[0]).root, MerkleTree(leaves[1]).root

    def propose_chain(self, encoded_commitment: bytes) -> None:
        """The commitment made for the open message: it becomes `chain` on a commit."""
        self._pending_chain = encoded_commitment

    def commit(self) -> None:
        """The message was applied: what it left out is the residual from now on."""
        if self._open:
            self.residual, self._pending = self._pending, self.residual
            self.chain, self._pending_chain = self._pending_chain, b""
            self.restored_proof = b""  # (of the chain before)
            if self.require_chain and not self.chain:
                self.residual.zero_()
            self._open = False

    def abort(self) -> None:
        """The message was not applied: the residual stays what it was."""
        self._open = False
        self._pending_chain = b""

    def reset(self) -> None:
        """A re-sync or a join: start from no residual."""
        self.residual.zero_()
        self._open = False

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        state = {"codec": self.codec.name, "residual": self.residual.clone(), "chain": self.chain}
        proof = None if self.chain_proof is None or not self.chain else self.chain_proof()
        if proof:
            state["chain_proof"] = proof
        return state

    def load_state_dict(self, state: Any) -> None:
        """Restore a checkpoint's residual; one of another codec (the experiment's
        options changed) or of another shape is refused."""
        if not isinstance(state, dict) or state.get("codec") != self.codec.name:
            raise ValueError(f"checkpoint 'error_feedback' is not one of codec {self.codec.name}")
        residual = state.get("residual")
        if (
            not isinstance(residual, torch.Tensor)
            or residual.dtype != torch.float32
            or residual.shape != (self.size,)
            or not bool(torch.isfinite(residual).all())
        ):
            raise ValueError(f"checkpoint 'error_feedback' must hold {self.size} finite float32")
        self.residual.copy_(residual)
        chain = state.get("chain", b"")  # (a checkpoint from before verified sparse rounds)
        self.chain = chain if isinstance(chain, bytes) and len(chain) <= MAX_CHAIN_BYTES else b""
        proof = state.get("chain_proof", b"")
        ok = isinstance(proof, bytes) and len(proof) <= MAX_PROOF_BYTES and bool(self.chain)
        self.restored_proof = proof if ok else b""  # (checked by whoever reads it)
        self._open = False
