"""The secure channel handshake: Noise XX bound to the peers' Ed25519 identities, sans-IO.

Wire format, as libp2p noise frames it: each handshake message is a 2-byte
big-endian length then the Noise message. Message 1 carries an empty payload;
messages 2 (responder) and 3 (initiator) carry the msgpack map::

    {"v": 1, "key": <32-byte Ed25519 public key>,
     "sig": <Ed25519 signature of b"shoal-noise-static-key:" + Noise static public key>}

The signature ties the identity key to this session's Noise static key, and
Noise proves possession of that static key, so the remote peer ID is
authenticated. The caller moves bytes: `start()` and `receive()` return what to
send, and `leftover` keeps transport bytes the initiator pipelined after
message 3.

Private swarms (transport/access.py): with a swarm key the pattern is
``Noise_XXpsk0`` and message 1 is 48 bytes (32 of ephemeral key, a 16-byte tag);
a message 1 of the other size, or one that fails its tag, is a
`SwarmKeyMismatch`. With an allow list, `authorize(peer)` is asked as soon as
the remote's identity is proven (message 2 for the initiator, 3 for the
responder) and a refusal is a `PeerNotAllowed`: the handshake never completes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from .errors import HandshakeError, PeerIDMismatch, PeerNotAllowed, SwarmKeyMismatch
from .identity import Identity, PeerID
from .noise import DH_LEN, TAG_LEN, CipherState, NoiseError, NoiseHandshakeXX

__all__ = ["MAX_FRAME_LEN", "PAYLOAD_VERSION", "SIGNATURE_PREFIX", "SecureHandshake"]

SIGNATURE_PREFIX = b"shoal-noise-static-key:"
PAYLOAD_VERSION = 1
# Our payload packs to 112 bytes (message 2: 208, message 3: 176). The bound
# leaves room for a later payload version yet refuses to buffer anything large
# from a peer that has not authenticated.
MAX_FRAME_LEN = 1024
_LEN_PREFIX = 2
_MSG1_LEN = DH_LEN  # "-> e" with an empty payload and no key yet
_MSG1_PSK_LEN = DH_LEN + TAG_LEN  # "-> psk, e": the empty payload is sealed under the key
_MSG2_MIN = DH_LEN + (DH_LEN + TAG_LEN) + TAG_LEN
_MSG3_MIN = (DH_LEN + TAG_LEN) + TAG_LEN
_PAYLOAD_KEYS = frozenset({"v", "key", "sig"})


def _frame(message: bytes) -> bytes:
    return len(message).to_bytes(_LEN_PREFIX, "big") + message


def _reject_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # A map with a repeated key means two different things to two decoders.
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key in map")
    return result


def _decode_payload(payload: bytes, which: str) -> tuple[bytes, bytes]:
    """Strictly decode the identity payload; returns (ed25519_key, signature)."""
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            object_pairs_hook=_reject_duplicates,
            max_bin_len=256,
            max_str_len=256,
            max_map_len=8,
            max_array_len=8,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types (ValueError, ExtraData, StackError...)
        raise HandshakeError(f"{which}: identity payload is not valid msgpack ({e})") from None
    if not isinstance(obj, dict):
        raise HandshakeError(f"{which}: identity payload is {type(obj).__name__}, not a map")
    if set(obj) != _PAYLOAD_KEYS:
        # New fields come with a new "v"; anything else is a malformed or hostile peer.
        raise HandshakeError(
            f"{which}: identity payload keys are {sorted(map(str, obj))}, "
            f"expected {sorted(_PAYLOAD_KEYS)}"
        )
    version, key, sig = obj["v"], obj["key"], obj["sig"]
    if type(version) is not int or version != PAYLOAD_VERSION:
        raise HandshakeError(f"{which}: unsupported identity payload version {version!r}")
    if not isinstance(key, bytes) or len(key) != 32:
        raise HandshakeError(f"{which}: identity key must be 32 bytes of bin, got {_describe(key)}")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise HandshakeError(f"{which}: signature must be 64 bytes of bin, got {_describe(sig)}")
    return key, sig


def _describe(value: object) -> str:
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    return type(value).__name__


class SecureHandshake:
    """One side of the authenticated Noise XX handshake, sans-IO.

    Drive it with `start()` then `receive()` for every chunk read off the wire,
    sending whatever they return, until `complete`. Then `send_cipher`,
    `recv_cipher`, `remote_peer` and `leftover` hand over to the transport.
    Errors caused by the remote side are HandshakeError (PeerIDMismatch when
    the authenticated peer is not `expected_peer`); after one, the object is
    dead.
    """

    def __init__(
        self,
        identity: Identity,
        initiator: bool,
        expected_peer: PeerID | None = None,
        *,
        cipher: str = "AESGCM",
        static_private: bytes | None = None,
        psk: bytes | None = None,
        authorize: Callable[[PeerID], str | None] | None = None,
    ) -> None:
        self.identity = identity
        self.initiator = initiator
        self.expected_peer = expected_peer
        self._psk = psk is not None
        self._msg1_len = _MSG1_LEN if psk is None else _MSG1_PSK_LEN
        self._authorize_peer = authorize
        # A fresh X25519 static key per handshake: the long-term identity is the
        # Ed25519 key, and the signature binds the two.
        self._noise = NoiseHandshakeXX(initiator, static_private, cipher=cipher, psk=psk)
        self._payload = msgpack.packb(
            {
                "v": PAYLOAD_VERSION,
                "key": identity.public_key_bytes,
                "sig": identity.sign(SIGNATURE_PREFIX + self._noise.local_static_public),
            }
        )
        self._buf = bytearray()
        self._next_read = 2 if initiator else 1  # number of the handshake message we read next
        self._started = False
        self._failed: HandshakeError | None = None
        self._send: CipherState | None = None
        self._recv: CipherState | None = None
        self.remote_peer: PeerID | None = None
        self.leftover: bytes = b""

    @property
    def complete(self) -> bool:
        return self._send is not None

    @property
    def send_cipher(self) -> CipherState:
        if self._send is None:
            raise RuntimeError("send_cipher before the handshake is complete")
        return self._send

    @property
    def recv_cipher(self) -> CipherState:
        if self._recv is None:
            raise RuntimeError("recv_cipher before the handshake is complete")
        return self._recv

    @property
    def unanswered(self) -> bool:
        """We sent message 1 and the remote said nothing back (yet)."""
        return self.initiator and self._started and self._next_read == 2 and not self._buf

    @property
    def handshake_hash(self) -> bytes:
        """Names this session uniquely on both sides (for channel binding)."""
        return self._noise.handshake_hash

    def start(self) -> bytes:
        """The bytes to send first: message 1 for the initiator, nothing for the responder."""
        if self._started:
            raise RuntimeError("start() called twice")
        self._started = True
        if not self.initiator:
            return b""
        return _frame(self._noise.write_message(b""))

    def receive(self, data: bytes | bytearray | memoryview) -> bytes:
        """Feed bytes read off the wire; returns the bytes to send now (maybe empty)."""
        if self._failed is not None:
            raise HandshakeError(f"handshake already failed: {self._failed}")
        try:
            return self._receive(data)
        except HandshakeError as e:
            self._failed = e
            raise

    def _receive(self, data: bytes | bytearray | memoryview) -> bytes:
        if self.complete:
            raise HandshakeError("received handshake bytes after the handshake completed")
        if self.initiator and not self._started:
            raise HandshakeError("responder spoke before the initiator sent message 1")
        self._buf += data
        out = b""
        while not self.complete:
            if len(self._buf) < _LEN_PREFIX:
                break
            size = int.from_bytes(self._buf[:_LEN_PREFIX], "big")
            # Checked on the prefix alone, before buffering the body.
            self._check_frame_len(size)
            if len(self._buf) < _LEN_PREFIX + size:
                break
            message = bytes(self._buf[_LEN_PREFIX : _LEN_PREFIX + size])
            del self._buf[: _LEN_PREFIX + size]
            out += self._handle(message)
            if not self.complete and self._buf:
                # The peer must wait for our reply before its next message.
                raise HandshakeError(
                    f"peer sent {len(self._buf)} bytes before receiving handshake "
                    f"message {self._next_read - 1}"
                )
        if self.complete:
            if self._buf and self.initiator:
                # The responder cannot have read message 3 yet, so it has nothing to say.
                raise HandshakeError(
                    f"responder sent {len(self._buf)} bytes after handshake message 2"
                )
            self.leftover = bytes(self._buf)
            self._buf.clear()
        return out

    def _check_frame_len(self, size: int) -> None:
        which = self._next_read
        if size == 0:
            raise HandshakeError(f"handshake message {which}: zero-length frame")
        if which == 1:
            if size == self._msg1_len:
                return
            if self._psk and size == _MSG1_LEN:
                raise SwarmKeyMismatch("swarm key mismatch: the peer's handshake has no swarm key")
            hint = ""
            if not self._psk and size == _MSG1_PSK_LEN:
                hint = " (the peer uses a swarm key: private swarm, see --swarm-key)"
            raise HandshakeError(
                f"handshake message 1 must be {self._msg1_len} bytes, frame says {size}{hint}"
            )
        minimum = _MSG2_MIN if which == 2 else _MSG3_MIN
        if size < minimum:
            raise HandshakeError(
                f"handshake message {which}: frame of {size} bytes is shorter than {minimum}"
            )
        if size > MAX_FRAME_LEN:
            raise HandshakeError(
                f"handshake message {which}: frame of {size} bytes exceeds {MAX_FRAME_LEN}"
            )

    def _handle(self, message: bytes) -> bytes:
        which = self._next_read
        try:
            try:
                payload = self._noise.read_message(message)
            except NoiseError:
                if which == 1 and self._psk:
                    # The only secret message 1 depends on is the swarm key.
                    raise SwarmKeyMismatch(
                        "swarm key mismatch: handshake message 1 failed authentication "
                        "under our swarm key"
                    ) from None
                raise
            if which == 1:
                # Exactly 32 bytes were framed, so the payload is empty: nothing to check.
                self._next_read = 3
                return _frame(self._noise.write_message(self._payload))
            self._authenticate(payload, which)
            out = _frame(self._noise.write_message(self._payload)) if which == 2 else b""
            self._send, self._recv = self._noise.split()
        except NoiseError as e:
            raise NoiseError(f"handshake message {which}: {e}") from None
        return out

    def _authenticate(self, payload: bytes, which: int) -> None:
        where = f"handshake message {which}"
        key, sig = _decode_payload(payload, where)
        remote_static = self._noise.remote_static
        assert remote_static is not None  # XX messages 2 and 3 carry "s"
        peer = PeerID.from_public_key(key)
        # Verify first, so that a PeerIDMismatch only ever names a proven identity.
        if not peer.verify(sig, SIGNATURE_PREFIX + remote_static):
            raise HandshakeError(
                f"{where}: bad signature: claimed key {peer} did not sign the Noise static key"
            )
        if self.expected_peer is not None and peer != self.expected_peer:
            raise PeerIDMismatch(f"peer ID mismatch: expected {self.expected_peer}, got {peer}")
        if self._authorize_peer is not None:
            refusal = self._authorize_peer(peer)
            if refusal is not None:
                raise PeerNotAllowed(f"peer not allowed: {refusal}")
        self.remote_peer = peer
