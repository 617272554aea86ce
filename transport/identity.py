"""Peer identity: an Ed25519 key pair on disk and the libp2p-style peer ID derived from it.

A peer ID is the identity multihash of the protobuf-encoded public key, written
in base58btc, exactly as libp2p derives IDs for Ed25519 keys (so they read
``12D3KooW...``): ``0x00 0x24 | 0x08 0x01 0x12 0x20 | <32-byte key>``.
"""

from __future__ import annotations

import os
import secrets
import stat
from functools import total_ordering
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

# base58btc (Bitcoin alphabet). Twenty lines of our own rather than a dependency:
# peer IDs are short and this is the only base58 user.
_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}

# protobuf PublicKey { KeyType Type = 1 (Ed25519 = 1); bytes Data = 2 (32 bytes) }
_ED25519_PUBKEY_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_IDENTITY_MULTIHASH = 0x00
_PEER_ID_LEN = 2 + len(_ED25519_PUBKEY_PREFIX) + 32  # 38 bytes


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    zeros = len(data) - len(data.lstrip(b"\0"))
    return "1" * zeros + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        try:
            n = n * 58 + _B58_INDEX[ch]
        except KeyError:
            raise ValueError(f"invalid base58 character {ch!r} in {text!r}") from None
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * zeros + body


@total_ordering
class PeerID:
    """An immutable, hashable, totally ordered peer identifier (Ed25519 keys only)."""

    __slots__ = ("_b58", "_bytes", "_hash", "_key")

    def __init__(self, multihash: bytes) -> None:
        if not isinstance(multihash, bytes | bytearray | memoryview):
            # (bytes(n) of an integer n a peer sent would allocate n bytes)
            raise ValueError(f"a peer ID is bytes, not {type(multihash).__name__}")
        multihash = bytes(multihash)
        if (
            len(multihash) != _PEER_ID_LEN
            or multihash[0] != _IDENTITY_MULTIHASH
            or multihash[1] != _PEER_ID_LEN - 2
            or multihash[2:6] != _ED25519_PUBKEY_PREFIX
        ):
            raise ValueError(
                f"not an Ed25519 identity-multihash peer ID: {multihash[:8].hex()}... "
                f"({len(multihash)} bytes)"
            )
        self._bytes = multihash
        # Cached: peer IDs key every table and set in the DHT and the host.
        self._hash = hash(multihash)
        self._b58: str | None = None
        self._key: Ed25519PublicKey | None = None

    @classmethod
    def from_public_key(cls, key: Ed25519PublicKey | bytes) -> PeerID:
        raw = key if isinstance(key, bytes | bytearray | memoryview) else _raw_public(key)
        raw = bytes(raw)
        if len(raw) != 32:
            raise ValueError(f"Ed25519 public key must be 32 bytes, got {len(raw)}")
        body = _ED25519_PUBKEY_PREFIX + raw
        return cls(bytes([_IDENTITY_MULTIHASH, len(body)]) + body)

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        try:
            return cls(b58decode(text))
        except ValueError as e:
            raise ValueError(f"invalid peer ID {text!r}: {e}") from None

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        if self._b58 is None:
            self._b58 = b58encode(self._bytes)
        return self._b58

    def public_key_bytes(self) -> bytes:
        return self._bytes[6:]

    def public_key(self) -> Ed25519PublicKey:
        if self._key is None:
            self._key = Ed25519PublicKey.from_public_bytes(self.public_key_bytes())
        return self._key

    def verify(self, signature: bytes, data: bytes) -> bool:
        """True when `signature` is this peer's Ed25519 signature of `data`."""
        try:
            self.public_key().verify(bytes(signature), bytes(data))
        except (InvalidSignature, ValueError):
            return False
        return True

    def short(self) -> str:
        """A log-friendly abbreviation; the tail is where IDs differ."""
        return "…" + self.to_base58()[-8:]

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerID) and self._bytes == other._bytes

    def __lt__(self, other: PeerID) -> bool:
        return self._bytes < other._bytes

    def __hash__(self) -> int:
        return self._hash


class IdentityFileError(Exception):
    """The identity key file is unusable; the message says what to do."""


class Identity:
    """An Ed25519 key pair and its peer ID."""

    __slots__ = ("peer_id", "private_key", "public_key", "public_key_bytes")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self.private_key = private_key
        self.public_key = private_key.public_key()
        self.public_key_bytes = _raw_public(self.public_key)
        self.peer_id = PeerID.from_public_key(self.public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(bytes(data))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at `path`, creating it (mode 0600) when it does not exist.

        Refuses a file that group or others can read: a leaked identity key lets
        anyone impersonate this peer and sign records in its name.
        """
        path = Path(path)
        if not path.exists():
            return cls._create(path)
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityFileError(
                f"identity key {path} is accessible by group or others "
                f"(mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}` and start again"
            )
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise IdentityFileError(
                f"identity key {path} is not a PEM Ed25519 private key ({e}); "
                "move it away to create a new identity"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityFileError(f"identity key {path} is not an Ed25519 key")
        return cls(key)

    @classmethod
    def _create(cls, path: Path) -> Identity:
        identity = cls.generate()
        pem = identity.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # A private temporary name, then link(): two processes racing to create the
        # key cannot both win, and neither can truncate the other's file.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process created it first
        except FileExistsError:
            os.unlink(tmp)
            return cls.load_or_create(path)
        os.unlink(tmp)
        return identity


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
