"""DHT records: what is stored under a key, who may write it, and when it is valid.

A record is ``(key, subkey, value, expiration, signature)``. ``value`` is already
msgpack-serialized (the API layer packs and unpacks); ``expiration`` is an
absolute UNIX time in seconds. A ``subkey`` of None is a plain value; a string
subkey makes the key a dictionary whose subkeys expire independently.

Ownership is part of the *name*, so it cannot be stripped off a record: a key or
subkey containing ``[owner:<base58 peer ID>]`` (see `owner_marker`) belongs to
that peer. Every record under an owned key, and the record of an owned subkey,
must carry the owner's Ed25519 signature over `Record.signing_payload`. A key
owned by one peer with a subkey owned by another cannot be written by anyone.
Unowned records must not carry a signature, which keeps records canonical.

Time rules (`RecordValidator`), with ``now`` the local clock:

- A record with ``expiration <= now`` is rejected: it is dead for us and for
  any reader whose clock agrees with ours, so storing it only costs memory.
- An expiration beyond ``now + max_ttl + clock_skew`` is *capped*, not rejected:
  the record keeps its signed expiration (the signature covers it, and it is
  what "newer record wins" compares), but storage evicts and stops serving it
  at `RecordValidator.effective_expiration`. Capping keeps any one store bounded
  in time while tolerating writers with generous TTLs or clocks far ahead.
  Caveat for the node layer: a capped record re-stored on another node gets a
  fresh cap there, so replication should only hand off records that are not
  capped (`RecordValidator.is_capped`).
- Clock skew: writers compute ``expiration = their_now + ttl``. A writer whose
  clock is a few seconds behind or ahead of ours produces a record a few
  seconds shorter or longer lived, which is accepted as long as ``ttl`` exceeds
  the skew; ``clock_skew`` (default 30 s) widens the cap so that such a writer
  using the maximal TTL is not capped. Between two writers of the same
  (key, subkey), the later *expiration* wins, whatever the order of arrival:
  updates from different writers are ordered only up to their clock skew, so a
  writer that wants to supersede another must use a later expiration (a single
  owner writing its own record is ordered by its own clock).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from shoal.transport.identity import Identity, PeerID

MAX_NAME_BYTES = 512
SIGNATURE_BYTES = 64
DEFAULT_MAX_VALUE_BYTES = 64 * 1024
DEFAULT_MAX_TTL = 24 * 3600.0
DEFAULT_CLOCK_SKEW = 30.0

_SIGNING_DOMAIN = b"shoal-dht-record:"
_OWNER_OPEN = "[owner:"
_OWNER_CLOSE = "]"
_WIRE_FIELDS = 5
TAG_BYTES = 8  # a record's tag (`Record.tag`)


class RecordError(ValueError):
    """A record is malformed or invalid; the message names the record and the problem."""


def _short(name: object, limit: int = 80) -> str:
    # Untrusted names go into log lines: bound them.
    text = repr(name)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def owner_marker(peer_id: PeerID) -> str:
    """The marker that makes a key or subkey owned by `peer_id` when put in its name."""
    return f"{_OWNER_OPEN}{peer_id.to_base58()}{_OWNER_CLOSE}"


def owner_of(name: str) -> PeerID | None:
    """The owner named by `name`'s marker, None when it has none.

    Raises RecordError for a malformed marker or more than one: an ambiguous
    owner must not quietly become "no owner".
    """
    start = name.find(_OWNER_OPEN)
    if start < 0:
        return None
    if name.find(_OWNER_OPEN, start + 1) >= 0:
        raise RecordError(f"name {_short(name)} has more than one owner marker")
    body_start = start + len(_OWNER_OPEN)
    end = name.find(_OWNER_CLOSE, body_start)
    if end < 0:
        raise RecordError(f"name {_short(name)} has an unterminated owner marker")
    peer, problem = _owner_peer(name[body_start:end])
    if peer is None:
        raise RecordError(f"name {_short(name)} has {problem}")
    return peer


@functools.lru_cache(maxsize=4096)
def _owner_peer(text: str) -> tuple[PeerID | None, str]:
    """The peer an owner marker's `text` names, or None and what is wrong with it.
    Cached: every record stored or read names its owner, the same few peers again and
    again (a base58 decode and encode each time was a tenth of a pipeline swarm's
    DHT time), and one PeerID object keeps its parsed public key for every signature
    it checks."""
    try:
        peer = PeerID.from_base58(text)
    except ValueError:
        return None, "an invalid owner peer ID"
    if peer.to_base58() != text:
        # Two spellings of one owner would make two distinct names for one record.
        return None, "a non-canonical owner peer ID"
    return peer, ""


def _check_name(what: str, name: object) -> None:
    if not isinstance(name, str):
        raise RecordError(f"{what} must be a string, got {type(name).__name__}")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise RecordError(f"{what} {_short(name)} is not valid UTF-8") from None
    if size == 0:
        raise RecordError(f"{what} is empty")
    if size > MAX_NAME_BYTES:
        raise RecordError(f"{what} {_short(name)} is {size} bytes, limit {MAX_NAME_BYTES}")


@dataclass(frozen=True, slots=True)
class Record:
    """One value (or one subkey of a dictionary value) stored in the DHT.

    Construction checks types and shapes (raising RecordError) and normalizes
    `value` to bytes and `expiration` to float, so that the signing payload of a
    record is the same before and after a trip over the wire.
    """

    key: str
    subkey: str | None
    value: bytes
    expiration: float
    signature: bytes | None = None

    def __post_init__(self) -> None:
        _check_name("key", self.key)
        if self.subkey is not None:
            _check_name("subkey", self.subkey)
        if not isinstance(self.value, bytes | bytearray | memoryview):
            raise RecordError(f"value must be bytes, got {type(self.value).__name__}")
        if not isinstance(self.value, bytes):
            object.__setattr__(self, "value", bytes(self.value))
        expiration = self.expiration
        if isinstance(expiration, bool) or not isinstance(expiration, int | float):
            raise RecordError(f"expiration must be a number, got {type(expiration).__name__}")
        try:
            expiration = float(expiration)
        except OverflowError:
            raise RecordError("expiration is out of range") from None
        if not math.isfinite(expiration):
            raise RecordError(f"expiration must be finite, got {expiration}")
        object.__setattr__(self, "expiration", expiration)
        if self.signature is not None:
            if not isinstance(self.signature, bytes | bytearray | memoryview):
                raise RecordError(
                    f"signature must be bytes or None, got {type(self.signature).__name__}"
                )
            signature = bytes(self.signature)
            if len(signature) != SIGNATURE_BYTES:
                raise RecordError(
                    f"signature is {len(signature)} bytes, expected {SIGNATURE_BYTES}"
                )
            object.__setattr__(self, "signature", signature)

    def signing_payload(self) -> bytes:
        """The bytes the owner signs; a domain prefix keeps them from meaning anything else."""
        body: bytes = msgpack.packb(
            [self.key, self.subkey, self.value, self.expiration], use_bin_type=True
        )
        return _SIGNING_DOMAIN + body

    def sign(self, identity: Identity) -> Record:
        """This record signed by `identity` (which must be the owner to be valid)."""
        return replace(self, signature=identity.sign(self.signing_payload()))

    def to_wire(self) -> list[Any]:
        return [self.key, self.subkey, self.value, self.expiration, self.signature]

    def tag(self) -> bytes:
        """TAG_BYTES that name this exact record (a hash of its wire form): what a reader
        that holds it sends a replica instead of having it sent again (find_value's
        ``known``). A collision only ever costs the reader a record it is sent twice
        or, from that one replica, not at all."""
        wire = msgpack.packb(self.to_wire(), use_bin_type=True)
        return hashlib.blake2b(wire, digest_size=TAG_BYTES).digest()

    @classmethod
    def from_wire(cls, obj: object) -> Record:
        """Decode a record from its msgpack-decoded wire form; only RecordError escapes."""
        if not isinstance(obj, list | tuple):
            raise RecordError(f"record must be a list, got {type(obj).__name__}")
        if len(obj) != _WIRE_FIELDS:
            raise RecordError(f"record must have {_WIRE_FIELDS} fields, got {len(obj)}")
        try:
            return cls(*obj)
        except RecordError:
            raise
        except (
            TypeError,
            ValueError,
        ) as e:  # defensive: construction should only raise RecordError
            raise RecordError(f"malformed record: {e}") from None

    @property
    def key_id(self) -> int:
        """The 256-bit DHT identifier of the key (sha256 of its UTF-8 bytes)."""
        return key_id(self.key)

    @property
    def nbytes(self) -> int:
        """Payload bytes, for storage accounting (excluding Python object overhead)."""
        size = len(self.value) + len(self.key.encode("utf-8"))
        if self.subkey is not None:
            size += len(self.subkey.encode("utf-8"))
        if self.signature is not None:
            size += len(self.signature)
        return size

    def describe(self) -> str:
        """A bounded description for error messages and log lines."""
        if self.subkey is None:
            return f"record {_short(self.key)}"
        return f"record {_short(self.key)}/{_short(self.subkey)}"


def key_id(key: str) -> int:
    """The 256-bit DHT identifier of `key`."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest(), "big")


RecordCheck = Callable[[Record], None]


class VerifiedSignatures:
    """Signatures already found valid, remembered by a digest of signer, signature and
    signed bytes (the newest `capacity`), so that a record seen again is not verified
    again. A matchmaking peer reads the same declarations at every wake, and a read
    gets each record from several replicas: Ed25519 checks of records already checked
    were a fifth of a simulated 1,000-peer burst's time. Only valid ones are kept; a
    digest binds all three (128 bits: a forged match is a second preimage)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._valid: dict[bytes, None] = {}  # insertion order: the oldest go first
        self.hits = 0

    def check(self, signer: PeerID, signature: bytes, data: bytes) -> bool:
        """Whether `signature` is `signer`'s over `data` (verified unless seen valid)."""
        digest = hashlib.blake2b(digest_size=16)
        for part in (signer.to_bytes(), bytes(signature), bytes(data)):
            digest.update(len(part).to_bytes(4, "big"))
            digest.update(part)
        key = digest.digest()
        if key in self._valid:
            self.hits += 1
            return True
        if not signer.verify(signature, data):
            return False
        if len(self._valid) >= self.capacity:
            del self._valid[next(iter(self._valid))]
        self._valid[key] = None
        return True


class RecordValidator:
    """Checks a record against limits, the time rules, ownership and registered schemas.

    Per-prefix validators: *every* validator whose prefix the key starts with
    runs, shortest prefix first, so that registering a narrower prefix can
    never bypass the rules of a broader one. A validator rejects by raising
    RecordError; any other exception it raises is turned into a RecordError too,
    because validators run on untrusted input and must not crash the caller.
    """

    def __init__(
        self,
        *,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_ttl: float = DEFAULT_MAX_TTL,
        clock_skew: float = DEFAULT_CLOCK_SKEW,
    ) -> None:
        if max_value_bytes <= 0 or max_ttl <= 0 or clock_skew < 0:
            raise ValueError("max_value_bytes and max_ttl must be positive, clock_skew >= 0")
        self.max_value_bytes = max_value_bytes
        self.max_ttl = float(max_ttl)
        self.clock_skew = float(clock_skew)
        self._checks: list[tuple[str, RecordCheck]] = []
        self._verified = VerifiedSignatures()

    def register(self, prefix: str, check: RecordCheck) -> None:
        """Run `check(record)` on every record whose key starts with `prefix`."""
        self._checks.append((prefix, check))
        self._checks.sort(key=lambda item: len(item[0]))  # stable: same length keeps order

    def validate(self, record: Record, now: float) -> None:
        """Raise RecordError naming the problem unless `record` may be stored at `now`."""
        # Cheap checks first; the signature and schemas only for records worth it.
        if len(record.value) > self.max_value_bytes:
            raise RecordError(
                f"{record.describe()}: value is {len(record.value)} bytes, "
                f"limit {self.max_value_bytes}"
            )
        if record.expiration <= now:
            raise RecordError(
                f"{record.describe()}: already expired ({now - record.expiration:.1f} s ago)"
            )
        signer = self.required_signer(record)
        if signer is None:
            if record.signature is not None:
                raise RecordError(f"{record.describe()}: signature on a record with no owner")
        elif record.signature is None:
            raise RecordError(f"{record.describe()}: unsigned, owner is {signer.short()}")
        elif not self._verified.check(signer, record.signature, record.signing_payload()):
            raise RecordError(f"{record.describe()}: bad signature, owner is {signer.short()}")
        for prefix, check in self._checks:
            if not record.key.startswith(prefix):
                continue
            try:
                check(record)
            except RecordError:
                raise
            except Exception as e:
                raise RecordError(
                    f"{record.describe()}: validator for prefix {_short(prefix)} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e

    @staticmethod
    def required_signer(record: Record) -> PeerID | None:
        """Whose signature `record` needs, None if nobody's; RecordError if unsatisfiable."""
        try:
            key_owner = owner_of(record.key)
            subkey_owner = owner_of(record.subkey) if record.subkey is not None else None
        except RecordError as e:
            raise RecordError(f"{record.describe()}: {e}") from None
        if key_owner is not None and subkey_owner is not None and key_owner != subkey_owner:
            raise RecordError(
                f"{record.describe()}: key owned by {key_owner.short()} but subkey by "
                f"{subkey_owner.short()}; no signature can satisfy both"
            )
        return key_owner if key_owner is not None else subkey_owner

    def effective_expiration(self, record: Record, now: float) -> float:
        """When storage stops serving `record`: its expiration, capped at now + max_ttl + skew."""
        return min(record.expiration, now + self.max_ttl + self.clock_skew)

    def is_capped(self, record: Record, now: float) -> bool:
        return record.expiration > now + self.max_ttl + self.clock_skew
