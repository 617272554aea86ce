"""The Noise Protocol Framework (revision 34), pattern XX only, sans-IO.

Suites: ``Noise_XX_25519_AESGCM_SHA256`` (the default: AES-GCM measured ~2.7x
faster than ChaChaPoly on our hardware) and ``Noise_XX_25519_ChaChaPoly_SHA256``
(kept so both sets of published test vectors can be checked).

XX::

    -> e
    <- e, ee, s, es
    -> s, se

With a pre-shared key (private swarms, transport/access.py) the pattern takes
the spec's ``psk0`` modifier, ``Noise_XXpsk0_...``: the key is mixed into the
chaining key before the first message, whose (empty) payload then carries an
AEAD tag, so the responder refuses a peer without the key at message 1, before
it has sent a byte (section 9; ``psk_position`` other than 0 exists only so
the published XXpsk3 vectors can be checked too).

Everything here is pure computation on bytes; the framing and the identity
binding live in :mod:`shoal.transport.secure`.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from .errors import HandshakeError

__all__ = [
    "CIPHERS",
    "MAX_MESSAGE_LEN",
    "MAX_NONCE",
    "PSK_LEN",
    "TAG_LEN",
    "CipherState",
    "NoiseError",
    "NoiseHandshakeXX",
]

MAX_MESSAGE_LEN = 65535
TAG_LEN = 16
DH_LEN = 32
HASH_LEN = 32
# 2^64-1 is reserved by the spec (it is the rekey nonce), so it never encrypts a message.
MAX_NONCE = 2**64 - 1

# The spec fixes the nonce encodings: 32 zero bits then the 64-bit counter,
# big-endian for AES-GCM and little-endian for ChaChaPoly.
_NONCE_STRUCTS = {"AESGCM": struct.Struct(">4xQ"), "ChaChaPoly": struct.Struct("<4xQ")}
_AEADS: dict[str, type[AESGCM | ChaCha20Poly1305]] = {
    "AESGCM": AESGCM,
    "ChaChaPoly": ChaCha20Poly1305,
}
CIPHERS = tuple(_AEADS)

_RAW = serialization.Encoding.Raw
_RAW_PUB = serialization.PublicFormat.Raw
_RAW_PRIV = serialization.PrivateFormat.Raw
_NO_ENC = serialization.NoEncryption()


class NoiseError(HandshakeError):
    """A Noise message was malformed, out of turn, or failed authentication."""


def _check_cipher(cipher: str) -> None:
    if cipher not in _AEADS:
        raise ValueError(f"unsupported Noise cipher {cipher!r}; expected one of {CIPHERS}")


class CipherState:
    """An AEAD key and its message counter (Noise section 5.1), always keyed.

    `nonce` counts the messages processed so far. A failed decryption does not
    advance it, as the spec requires.
    """

    __slots__ = ("_aead", "_cipher", "_pack", "_scratch", "nonce")

    def __init__(self, key: bytes, cipher: str = "AESGCM") -> None:
        _check_cipher(cipher)
        if len(key) != 32:
            raise ValueError(f"Noise cipher key must be 32 bytes, got {len(key)}")
        self._cipher = cipher
        # Built once: constructing the AEAD object costs more than sealing a small message.
        self._aead = _AEADS[cipher](bytes(key))
        self._pack = _NONCE_STRUCTS[cipher].pack
        self._scratch: bytearray | None = None  # (`seal_in_place` where it cannot)
        self.nonce = 0

    @property
    def cipher(self) -> str:
        return self._cipher

    # The four methods below are the per-message hot path: they inline the nonce
    # check instead of sharing a helper, since a Python call costs ~10% of sealing a
    # small message.

    def encrypt(self, plaintext: bytes, ad: bytes = b"") -> bytes:
        """Seal `plaintext`; the result is len(plaintext) + 16 bytes."""
        n = self.nonce
        if n >= MAX_NONCE:
            raise _exhausted()
        ct = self._aead.encrypt(self._pack(n), plaintext, ad)
        self.nonce = n + 1
        return ct

    def decrypt(self, ciphertext: bytes, ad: bytes = b"") -> bytes:
        """Open `ciphertext`; raises NoiseError when it does not authenticate."""
        n = self.nonce
        if n >= MAX_NONCE:
            raise _exhausted()
        try:
            pt = self._aead.decrypt(self._pack(n), ciphertext, ad)
        except InvalidTag:
            raise NoiseError("message failed authentication") from None
        self.nonce = n + 1
        return pt

    def encrypt_into(
        self,
        plaintext: bytes | bytearray | memoryview,
        out: bytearray | memoryview,
        ad: bytes = b"",
    ) -> int:
        """Seal `plaintext` into the front of `out`; returns the bytes written (len + 16).

        Both are byte buffers (memoryviews of format "B"); `out` may be larger than
        needed. Nothing is copied.
        """
        n = self.nonce
        if n >= MAX_NONCE:
            raise _exhausted()
        size = len(plaintext) + TAG_LEN
        if len(out) != size:
            out = _fit(out, size)
        written = self._aead.encrypt_into(self._pack(n), plaintext, ad, out)
        self.nonce = n + 1
        return written

    def seal_in_place(self, buf: memoryview, n: int) -> int:
        """Seal the first `n` bytes of `buf` into its first n + 16 bytes; returns n + 16.

        Without a copy where the installed cryptography seals a buffer into itself
        (before 51.0: `encrypt_into` with the same buffer); from 51.0, which refuses any
        overlap, the plaintext goes through a scratch buffer of this cipher's first."""
        if _SEALS_IN_PLACE:
            return self.encrypt_into(buf[:n], buf[: n + TAG_LEN])
        scratch = self._scratch
        if scratch is None or len(scratch) < n:
            scratch = self._scratch = bytearray(max(n, 2 * len(scratch or b"")))
        view = memoryview(scratch)[:n]
        view[:] = buf[:n]
        return self.encrypt_into(view, buf[: n + TAG_LEN])

    def decrypt_into(
        self,
        ciphertext: bytes | bytearray | memoryview,
        out: bytearray | memoryview,
        ad: bytes = b"",
    ) -> int:
        """Open `ciphertext` into the front of `out`; returns the bytes written (len - 16)."""
        n = self.nonce
        if n >= MAX_NONCE:
            raise _exhausted()
        size = len(ciphertext) - TAG_LEN
        if size < 0:
            raise NoiseError(f"ciphertext of {len(ciphertext)} bytes is shorter than the tag")
        if len(out) != size:
            out = _fit(out, size)
        try:
            written = self._aead.decrypt_into(self._pack(n), ciphertext, ad, out)
        except InvalidTag:
            raise NoiseError("message failed authentication") from None
        self.nonce = n + 1
        return written

    def rekey(self) -> None:
        """Replace the key with a one-way function of itself (Noise section 4.2)."""
        new_key = self._aead.encrypt(self._pack(MAX_NONCE), bytes(32), b"")[:32]
        self._aead = _AEADS[self._cipher](new_key)


def _exhausted() -> NoiseError:
    # Reusing a nonce would break confidentiality and authenticity outright.
    return NoiseError("cipher nonce exhausted; the connection must be re-established")


def _seals_in_place() -> bool:
    """Whether this cryptography seals a buffer into itself (51.0 refuses: "data and
    buf must not overlap")."""
    buf = memoryview(bytearray(16 + TAG_LEN))
    try:
        AESGCM(bytes(32)).encrypt_into(bytes(12), buf[:16], b"", buf)
    except ValueError:
        return False
    return True


_SEALS_IN_PLACE = _seals_in_place()


def _fit(out: bytearray | memoryview, size: int) -> memoryview:
    """The first `size` bytes of `out`, without copying (the AEADs want exact sizes)."""
    if len(out) < size:
        raise ValueError(f"output buffer too small: {len(out)} < {size}")
    return memoryview(out)[:size]


def _hkdf2(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    """HKDF with two outputs, as Noise section 4.3 defines it over HMAC-SHA256."""
    temp = hmac.digest(chaining_key, ikm, "sha256")
    out1 = hmac.digest(temp, b"\x01", "sha256")
    out2 = hmac.digest(temp, out1 + b"\x02", "sha256")
    return out1, out2


def _hkdf3(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes, bytes]:
    """HKDF with three outputs (Noise section 4.3), for MixKeyAndHash."""
    temp = hmac.digest(chaining_key, ikm, "sha256")
    out1 = hmac.digest(temp, b"\x01", "sha256")
    out2 = hmac.digest(temp, out1 + b"\x02", "sha256")
    out3 = hmac.digest(temp, out2 + b"\x03", "sha256")
    return out1, out2, out3


class _SymmetricState:
    """Chaining key, handshake hash and the (possibly absent) handshake cipher."""

    __slots__ = ("_cipher", "_cipher_name", "ck", "h")

    def __init__(self, protocol_name: bytes, cipher: str) -> None:
        if len(protocol_name) <= HASH_LEN:
            self.h = protocol_name.ljust(HASH_LEN, b"\0")
        else:
            self.h = hashlib.sha256(protocol_name).digest()
        self.ck = self.h
        self._cipher: CipherState | None = None
        self._cipher_name = cipher

    @property
    def has_key(self) -> bool:
        return self._cipher is not None

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = _hkdf2(self.ck, ikm)
        self._cipher = CipherState(temp_k, self._cipher_name)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, temp_k = _hkdf3(self.ck, ikm)
        self.mix_hash(temp_h)
        self._cipher = CipherState(temp_k, self._cipher_name)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ct = plaintext if self._cipher is None else self._cipher.encrypt(plaintext, self.h)
        self.mix_hash(ct)
        return ct

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        pt = ciphertext if self._cipher is None else self._cipher.decrypt(ciphertext, self.h)
        self.mix_hash(ciphertext)
        return pt

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = _hkdf2(self.ck, b"")
        return CipherState(k1, self._cipher_name), CipherState(k2, self._cipher_name)


# The tokens of XX's three messages; the initiator writes messages 1 and 3.
_XX_PATTERN: tuple[tuple[str, ...], ...] = (("e",), ("e", "ee", "s", "es"), ("s", "se"))
PSK_LEN = 32


def _psk_pattern(position: int) -> tuple[tuple[str, ...], ...]:
    """XX with the pskN modifier: psk0 opens message 1, pskN (N >= 1) ends message N."""
    if not 0 <= position <= len(_XX_PATTERN):
        raise ValueError(f"XX has no psk{position} modifier")
    messages = [list(m) for m in _XX_PATTERN]
    if position == 0:
        messages[0].insert(0, "psk")
    else:
        messages[position - 1].append("psk")
    return tuple(tuple(m) for m in messages)


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(_RAW, _RAW_PUB)


class NoiseHandshakeXX:
    """One side of a Noise XX handshake (Noise section 5.3), sans-IO.

    Call `write_message` and `read_message` in turn (the initiator writes
    first); after the third message `complete` is true and `split()` gives the
    transport ciphers. Any failure leaves the object unusable: a handshake
    state that has mixed in a bad message cannot be resumed.
    """

    def __init__(
        self,
        initiator: bool,
        static_private: bytes | None = None,
        *,
        cipher: str = "AESGCM",
        prologue: bytes = b"",
        ephemeral_private: bytes | None = None,
        psk: bytes | None = None,
        psk_position: int = 0,
    ) -> None:
        _check_cipher(cipher)
        self.initiator = initiator
        if psk is None:
            self._pattern = _XX_PATTERN
            self.protocol_name = f"Noise_XX_25519_{cipher}_SHA256"
        else:
            if len(psk) != PSK_LEN:
                raise ValueError(f"a Noise pre-shared key is {PSK_LEN} bytes, got {len(psk)}")
            self._pattern = _psk_pattern(psk_position)
            self.protocol_name = f"Noise_XXpsk{psk_position}_25519_{cipher}_SHA256"
        self._psk = None if psk is None else bytes(psk)
        self._cipher = cipher
        self._s = (
            X25519PrivateKey.generate()
            if static_private is None
            else X25519PrivateKey.from_private_bytes(bytes(static_private))
        )
        self.local_static_public: bytes = _public_bytes(self._s)
        # A fixed ephemeral key exists only so test vectors can be reproduced.
        self._fixed_e = ephemeral_private
        self._e: X25519PrivateKey | None = None
        self._re: X25519PublicKey | None = None
        self._rs: X25519PublicKey | None = None
        self.remote_static: bytes | None = None
        self._ss: _SymmetricState | None = _SymmetricState(self.protocol_name.encode(), cipher)
        self._ss.mix_hash(bytes(prologue))
        self._index = 0  # next message of _XX_PATTERN
        self._failed = False
        self._split_done = False
        self._handshake_hash: bytes | None = None

    @property
    def complete(self) -> bool:
        return self._handshake_hash is not None

    @property
    def handshake_hash(self) -> bytes:
        """h after the last message: a unique name for this session (channel binding)."""
        if self._handshake_hash is None:
            raise NoiseError("handshake hash is only final once the handshake is complete")
        return self._handshake_hash

    def _check_turn(self, writing: bool) -> _SymmetricState:
        if self._failed:
            raise NoiseError("handshake already failed")
        if self._ss is None or self._index >= len(self._pattern):
            raise NoiseError("handshake already complete")
        initiator_turn = self._index % 2 == 0
        if (initiator_turn == self.initiator) != writing:
            verb = "write" if writing else "read"
            raise NoiseError(f"out of turn: cannot {verb} handshake message {self._index + 1} now")
        return self._ss

    def _dh(self, local: X25519PrivateKey | None, remote: X25519PublicKey | None) -> bytes:
        assert local is not None and remote is not None  # guaranteed by the pattern order
        try:
            return local.exchange(remote)
        except ValueError:
            # Low-order points give an all-zero secret; cryptography refuses them.
            raise NoiseError("remote key is a low-order point") from None

    def _mix_dh(self, ss: _SymmetricState, token: str) -> None:
        if token == "ee":
            ss.mix_key(self._dh(self._e, self._re))
        elif token == "es":
            ss.mix_key(
                self._dh(self._e, self._rs) if self.initiator else self._dh(self._s, self._re)
            )
        else:  # "se"
            ss.mix_key(
                self._dh(self._s, self._re) if self.initiator else self._dh(self._e, self._rs)
            )

    def _message_len(self, payload_len: int) -> int:
        # Handshake cipher is keyed from message 2 on in XX; s tokens only occur there.
        # With a psk, "e" mixes the key too, so message 1 is keyed as well.
        keyed = self._index > 0 or self._psk is not None
        size = payload_len + (TAG_LEN if keyed else 0)
        for token in self._pattern[self._index]:
            if token == "e":
                size += DH_LEN
            elif token == "s":
                size += DH_LEN + TAG_LEN
        return size

    def write_message(self, payload: bytes = b"") -> bytes:
        """Produce the next handshake message carrying `payload`."""
        ss = self._check_turn(writing=True)
        payload = bytes(payload)
        if self._message_len(len(payload)) > MAX_MESSAGE_LEN:
            raise NoiseError(f"payload of {len(payload)} bytes exceeds the Noise message limit")
        out = bytearray()
        try:
            for token in self._pattern[self._index]:
                if token == "e":
                    self._e = (
                        X25519PrivateKey.generate()
                        if self._fixed_e is None
                        else X25519PrivateKey.from_private_bytes(bytes(self._fixed_e))
                    )
                    e_pub = _public_bytes(self._e)
                    out += e_pub
                    ss.mix_hash(e_pub)
                    if self._psk is not None:
                        ss.mix_key(e_pub)  # section 9.2: "e" also mixes the key with a psk
                elif token == "psk":
                    assert self._psk is not None
                    ss.mix_key_and_hash(self._psk)
                elif token == "s":
                    out += ss.encrypt_and_hash(self.local_static_public)
                else:
                    self._mix_dh(ss, token)
            out += ss.encrypt_and_hash(payload)
        except BaseException:
            self._failed = True
            raise
        self._advance(ss)
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """Consume the peer's next handshake message and return its payload."""
        ss = self._check_turn(writing=False)
        try:
            message = bytes(message)
        except TypeError:
            raise NoiseError("handshake message is not bytes") from None
        try:
            payload = self._read(ss, message)
        except BaseException:
            self._failed = True
            raise
        self._advance(ss)
        return payload

    def _read(self, ss: _SymmetricState, message: bytes) -> bytes:
        n = self._index + 1
        if len(message) > MAX_MESSAGE_LEN:
            raise NoiseError(f"handshake message {n} is {len(message)} bytes, over the limit")
        minimum = self._message_len(0)
        if len(message) < minimum:
            raise NoiseError(
                f"handshake message {n} is {len(message)} bytes, shorter than {minimum}"
            )
        pos = 0
        for token in self._pattern[self._index]:
            if token == "e":
                re = message[pos : pos + DH_LEN]
                pos += DH_LEN
                self._re = X25519PublicKey.from_public_bytes(re)
                ss.mix_hash(re)
                if self._psk is not None:
                    ss.mix_key(re)
            elif token == "psk":
                assert self._psk is not None
                ss.mix_key_and_hash(self._psk)
            elif token == "s":
                size = DH_LEN + (TAG_LEN if ss.has_key else 0)
                rs = ss.decrypt_and_hash(message[pos : pos + size])
                pos += size
                self._rs = X25519PublicKey.from_public_bytes(rs)
                self.remote_static = rs
            else:
                self._mix_dh(ss, token)
        return ss.decrypt_and_hash(message[pos:])

    def _advance(self, ss: _SymmetricState) -> None:
        self._index += 1
        if self._index == len(self._pattern):
            self._handshake_hash = ss.h
            self._e = None  # forward secrecy: the ephemeral is not needed any more

    def split(self) -> tuple[CipherState, CipherState]:
        """The transport ciphers as (send, recv) for this side; callable once."""
        if not self.complete:
            raise NoiseError("split() before the handshake is complete")
        if self._split_done or self._ss is None:
            # A second pair would start from nonce 0 again under the same keys.
            raise NoiseError("split() already called")
        c1, c2 = self._ss.split()
        self._ss = None  # drop the chaining key
        self._split_done = True
        return (c1, c2) if self.initiator else (c2, c1)
