"""What a peer commits to with its contribution to a round, before anyone can
check it: a signed `Commitment`, and Merkle trees over the parts it sends.

A commitment binds the prover to its whole inner run: the global state it
started from (`start`), its starting inner-optimizer state (`optimizer`), the
index of its first inner step (`first_step`: the learning-rate warmup depends
on it), a hash of its parameters and optimizer state every `every` inner steps
(`checkpoints`, each a `state_digest`; the last one is after `steps`), the Merkle root of its
pseudo-gradient over the all-reduce's parts (`delta_root`: each part's owner
checks the part it received against it), the previous round's commitment
(`previous`: a chain, so a peer cannot rewrite its history) and the hash of a
secret it reveals after every member committed (`seed_commit`: the round's
shared randomness, `verification.referees`, which nobody can steer). A member
of a sparse round also commits to its error feedback (`residual`: the hashes of
the residual it started the round with and of the one the round leaves it if it
commits), which its previous commitment's must chain to (`residual_chains`).

Everything is encoded canonically (msgpack of a fixed-order list) and signed
with the prover's identity key under a domain tag, so a commitment checks
offline from its own bytes: `Commitment.decode(data)` refuses any commitment
whose signature does not verify.

Since protocol 2.11 a commitment may bind its checkpoints by one hash
(`checkpoint_hash`, `checkpoints_hash` of the list) instead of listing them: the
members of a round need none of them (only its referees do, for the one segment
they audit, and the prover's reveal carries the list: `with_checkpoints`), and
the list was a third of every lane header of a verified sparse round. Such a
commitment travels without its list (`encode`), and one decoded has none until
a reveal supplies it (`checkpoints` is empty). A prover signs this form only
when every member of its round speaks 2.11. `encode_known` leaves out of the
wire what every member of the round knows (experiment, prover, round), which
`decode_known` puts back before it checks the signature.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shoal.transport.identity import Identity, PeerID

__all__ = [
    "HASH_BYTES",
    "Commitment",
    "CommitmentError",
    "MerkleTree",
    "checkpoints_hash",
    "leaf_hash",
    "residual_chains",
    "state_digest",
    "verify_inclusion",
]

HASH_BYTES = 32
MAX_CHECKPOINTS = 4096
MAX_TEXT = 256
_TAG = b"shoal/commitment/1\0"
_STATE_TAG = b"shoal/state/1\0"
_CHECKPOINTS_TAG = b"shoal/checkpoints/1\0"
KNOWN_FIELDS = 3  # experiment, prover, round: what `encode_known` leaves out
_LEAF = b"\x00"
_NODE = b"\x01"


class CommitmentError(ValueError):
    """A commitment (or a proof) that does not decode or does not verify."""


def leaf_hash(data: bytes | memoryview) -> bytes:
    """The hash of one part as a Merkle leaf (domain-separated from inner nodes,
    so that no inner node can pass for a leaf). Hashed where it lies: a copy (bytes(),
    +) of a megabyte chunk holds the interpreter, sha256 over a buffer does not."""
    h = hashlib.sha256(_LEAF)
    h.update(data)
    return h.digest()


def state_digest(params: bytes, optimizer: bytes) -> bytes:
    """The hash of a training state from the hashes of its parameters and of its
    optimizer state: a checkpoint. Two hashes, so a reveal can send the
    parameters alone with the optimizer's hash (what an audit compares)."""
    return hashlib.sha256(_STATE_TAG + params + optimizer).digest()


def checkpoints_hash(checkpoints: Sequence[bytes]) -> bytes:
    """The hash a commitment of protocol 2.11 binds its checkpoints by (in order)."""
    return hashlib.sha256(_CHECKPOINTS_TAG + b"".join(checkpoints)).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


class MerkleTree:
    """A Merkle tree over the hashes of parts (`leaf_hash`), in part order.

    A level with an odd count carries its last node up unchanged (no
    duplication, so no two leaf lists share a root).
    """

    def __init__(self, leaves: Sequence[bytes]) -> None:
        if not leaves:
            raise ValueError("a Merkle tree needs at least one leaf")
        self.levels: list[list[bytes]] = [list(leaves)]
        while len(self.levels[-1]) > 1:
            below = self.levels[-1]
            above = [_node(below[i], below[i + 1]) for i in range(0, len(below) - 1, 2)]
            if len(below) % 2:
                above.append(below[-1])
            self.levels.append(above)

    @property
    def root(self) -> bytes:
        return self.levels[-1][0]

    def proof(self, index: int) -> list[bytes]:
        """The sibling hashes from leaf `index` up (levels where it has none are skipped)."""
        if not 0 <= index < len(self.levels[0]):
            raise IndexError(index)
        path = []
        for level in self.levels[:-1]:
            sibling = index ^ 1
            if sibling < len(level):
                path.append(level[sibling])
            index //= 2
        return path


def verify_inclusion(
    root: bytes, leaf: bytes, index: int, count: int, proof: Sequence[bytes]
) -> bool:
    """Whether `leaf` is leaf `index` of the `count` leaves under `root`."""
    if not 0 <= index < count:
        return False
    node, width, used = leaf, count, 0
    while width > 1:
        sibling = index ^ 1
        if sibling < width:
            if used >= len(proof):
                return False
            other = proof[used]
            used += 1
            node = _node(other, node) if index % 2 else _node(node, other)
        index //= 2
        width = (width + 1) // 2
    return used == len(proof) and node == root


@dataclass(frozen=True)
class Commitment:
    """One peer's signed account of its work for one round (fields: module docstring).

    `round` is the state version the work started from, as a commit count: the
    same number on every member of the round.
    """

    experiment: str
    prover: PeerID
    round: int
    start: bytes
    optimizer: bytes
    first_step: int
    steps: int
    every: int
    checkpoints: tuple[bytes, ...]
    delta_root: bytes
    parts: int
    previous: bytes
    seed_commit: bytes
    signature: bytes = field(default=b"", compare=False)
    # Sparse rounds: (hash of the residual at the start, hash of the one after a commit).
    residual: tuple[bytes, bytes] | None = None
    # Protocol 2.11's form: the checkpoints bound by this hash; `checkpoints` is then
    # either empty (not known here: a commitment as it came over the wire) or the list.
    checkpoint_hash: bytes | None = None

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise CommitmentError(problem)

    def _problem(self) -> str | None:
        if not isinstance(self.experiment, str) or len(self.experiment) > MAX_TEXT:
            return "bad experiment name"
        ints = (self.round, self.first_step, self.steps, self.every, self.parts)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in ints):
            return "counts must be integers"
        if (
            self.round < 0
            or self.first_step < 0
            or self.steps < 1
            or self.every < 1
            or self.parts < 1
        ):
            return "round, first_step >= 0; steps, every and parts >= 1"
        problem = self._checkpoints_problem()
        if problem:
            return problem
        hashes = (self.start, self.optimizer, self.delta_root, self.seed_commit, *self.checkpoints)
        if not all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in hashes):
            return f"hashes must be {HASH_BYTES} bytes"
        if not isinstance(self.previous, bytes) or len(self.previous) not in (0, HASH_BYTES):
            return "previous must be a commitment digest or empty (the first round)"
        if self.residual is not None and not (
            isinstance(self.residual, tuple)
            and len(self.residual) == 2
            and all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in self.residual)
        ):
            return f"residual must be two hashes of {HASH_BYTES} bytes"
        return None

    def _checkpoints_problem(self) -> str | None:
        if self.segments > MAX_CHECKPOINTS:
            return f"more than {MAX_CHECKPOINTS} segments"
        if not isinstance(self.checkpoints, tuple):
            return "checkpoints must be a list"
        if self.checkpoint_hash is None:
            if len(self.checkpoints) != self.segments:
                return f"{self.segments} checkpoints expected, {len(self.checkpoints)} given"
            return None
        if not isinstance(self.checkpoint_hash, bytes) or len(self.checkpoint_hash) != HASH_BYTES:
            return f"the checkpoints' hash must be {HASH_BYTES} bytes"
        if not self.checkpoints:
            return None  # (not known here)
        if len(self.checkpoints) != self.segments or not all(
            isinstance(h, bytes) and len(h) == HASH_BYTES for h in self.checkpoints
        ):
            return f"{self.segments} checkpoints of {HASH_BYTES} bytes expected"
        if checkpoints_hash(self.checkpoints) != self.checkpoint_hash:
            return "the checkpoints are not those committed to"
        return None

    @property
    def segments(self) -> int:
        """Inner-run segments of `every` steps (the last may be shorter)."""
        return -(-self.steps // self.every)

    @property
    def checkpoints_known(self) -> bool:
        """Whether the checkpoints are here (always, but in protocol 2.11's form as it
        came over the wire: a reveal brings them, `with_checkpoints`)."""
        return bool(self.checkpoints)

    def with_checkpoints(self, checkpoints: Sequence[bytes]) -> Commitment:
        """This commitment with its checkpoints (a prover's reveal's list): the same
        commitment (digest, signature) when they are the ones it binds, else
        CommitmentError."""
        if self.checkpoint_hash is None:
            if tuple(checkpoints) != self.checkpoints:
                raise CommitmentError("the checkpoints are not those committed to")
            return self
        return dataclasses.replace(self, checkpoints=tuple(checkpoints))

    def compact(self) -> Commitment:
        """This commitment in protocol 2.11's form (its checkpoints bound by their hash),
        unsigned: the prover signs it (`signed`)."""
        digest = checkpoints_hash(self.checkpoints)
        return dataclasses.replace(self, checkpoint_hash=digest, signature=b"")

    def segment_bounds(self, index: int) -> tuple[int, int]:
        """The inner steps [first, end) of segment `index`, counted within the round."""
        if not 0 <= index < self.segments:
            raise IndexError(index)
        return index * self.every, min(self.steps, (index + 1) * self.every)

    def segment_start(self, index: int) -> bytes:
        """The hash the state at the start of segment `index` must have: the
        global state and starting optimizer for segment 0, else a checkpoint."""
        if index == 0:
            return state_digest(self.start, self.optimizer)
        return self.checkpoints[index - 1]

    # ------------------------------------------------------------------ wire

    def _fields(self) -> list[Any]:
        checkpoints: Any = self.checkpoint_hash
        if checkpoints is None:
            checkpoints = list(self.checkpoints)
        return [
            self.experiment,
            self.prover.to_bytes(),
            self.round,
            self.start,
            self.optimizer,
            self.first_step,
            self.steps,
            self.every,
            checkpoints,  # (a list; since 2.11 maybe their hash: a byte string)
            self.delta_root,
            self.parts,
            self.previous,
            self.seed_commit,
            # (Only in sparse rounds: a dense commitment is what it always was.)
            *([] if self.residual is None else [list(self.residual)]),
        ]

    def body(self) -> bytes:
        """The canonical bytes that are signed (everything but the signature)."""
        return msgpack.packb(self._fields(), use_bin_type=True)

    def digest(self) -> bytes:
        """What names this commitment (the next round's `previous`, verdicts, evidence)."""
        return hashlib.sha256(self.body()).digest()

    def signed(self, identity: Identity) -> Commitment:
        if identity.peer_id != self.prover:
            raise CommitmentError("only the prover signs its commitment")
        return dataclasses.replace(self, signature=identity.sign(_TAG + self.body()))

    def verifies(self) -> bool:
        return self.prover.verify(self.signature, _TAG + self.body())

    def encode(self) -> bytes:
        """The signed commitment (in protocol 2.11's form, without its checkpoints)."""
        return msgpack.packb([self.body(), self.signature], use_bin_type=True)

    def encode_known(self) -> bytes:
        """`encode` less the fields every member of the round knows (experiment,
        prover, round): for a member that speaks 2.11 (`decode_known`)."""
        fields = self._fields()[KNOWN_FIELDS:]
        return msgpack.packb([fields, self.signature], use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Commitment:
        """A commitment from `encode`'s bytes; CommitmentError unless well formed
        and signed by its prover."""
        body, signature = _unpack_pair(data)
        try:
            fields = msgpack.unpackb(body, raw=False, max_array_len=MAX_CHECKPOINTS + 16)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
            raise CommitmentError(f"malformed commitment: {e}") from None
        commitment = cls._from_fields(fields, signature)
        if commitment.body() != body:
            raise CommitmentError("the commitment is not in canonical form")
        return commitment

    @classmethod
    def decode_known(
        cls, data: bytes, experiment: str, prover: PeerID, round_index: int
    ) -> Commitment:
        """A commitment from `encode_known`'s bytes and what the round says the left-out
        fields are; CommitmentError unless well formed and signed by `prover` over
        those (a commitment for another experiment or round does not verify)."""
        fields, signature = _unpack_pair(data)
        if not isinstance(fields, list):
            raise CommitmentError("malformed commitment: its fields are a list")
        known = [experiment, prover.to_bytes(), round_index]
        return cls._from_fields(known + fields, signature)

    @classmethod
    def _from_fields(cls, fields: object, signature: object) -> Commitment:
        try:
            if not isinstance(fields, list) or len(fields) not in (13, 14):
                raise CommitmentError("a commitment has 13 fields, or 14 in a sparse round")
            residual = tuple(fields.pop()) if len(fields) == 14 else None
            (experiment, prover, rnd, start, optimizer, first_step, steps, every,
             checkpoints, delta_root, parts, previous, seed_commit) = fields  # fmt: skip
            listed = not isinstance(checkpoints, bytes)
            commitment = cls(
                experiment, PeerID(prover), rnd, start, optimizer, first_step, steps, every,
                tuple(checkpoints) if listed else (), delta_root, parts, previous, seed_commit,
                signature, residual,  # type: ignore[arg-type]  # (checked in __post_init__)
                None if listed else checkpoints,
            )  # fmt: skip
        except CommitmentError:
            raise
        except (ValueError, TypeError) as e:
            raise CommitmentError(f"malformed commitment: {e}") from None
        if not isinstance(signature, bytes) or not commitment.verifies():
            raise CommitmentError("the commitment's signature does not verify")
        return commitment


def _unpack_pair(data: bytes) -> tuple[Any, Any]:
    try:
        first, signature = msgpack.unpackb(
            data, raw=False, max_bin_len=1 << 20, max_array_len=MAX_CHECKPOINTS + 16
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as e:
        raise CommitmentError(f"malformed commitment: {e}") from None
    return first, signature


def residual_chains(commitment: Commitment, previous: Commitment | None, zero: bytes) -> str | None:
    """Why `commitment`'s starting residual is not one an honest peer could start with,
    or None. `previous`: the commitment its `previous` names (None for an empty one;
    the caller checked that it hashes to it and is the same prover's); `zero`: the hash
    of an all-zero residual (after a join or a re-sync, always allowed). Otherwise it
    is what the previous round left: its residual after the commit (our message was
    applied) or, had that round not applied it, its residual at the start."""
    if commitment.residual is None:
        return "a sparse round's commitment without its residual"
    start = commitment.residual[0]
    if start == zero:
        return None
    if previous is None:
        return "a residual that chains to no previous commitment"
    # (A peer that missed a round the swarm committed is behind: it re-syncs, to zero.)
    if previous.round != commitment.round - 1:
        return "a residual that chains to a commitment of another than the previous round"
    if previous.residual is None or start not in previous.residual:
        return "a residual that is not what the previous round left"
    return None
