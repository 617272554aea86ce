"""SecureHandshake (shoal.transport.secure): Noise XX bound to peer identities, sans-IO."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.transport.errors import HandshakeError, PeerIDMismatch
from shoal.transport.identity import Identity, PeerID
from shoal.transport.noise import NoiseHandshakeXX
from shoal.transport.secure import MAX_FRAME_LEN, SIGNATURE_PREFIX, SecureHandshake

ALICE = Identity.from_seed(bytes([1]) * 32)  # dials
BOB = Identity.from_seed(bytes([2]) * 32)  # listens
CAROL = Identity.from_seed(bytes([3]) * 32)  # someone else

# Fixed X25519 statics; the ephemerals stay random, so each handshake differs.
I_STATIC = bytes([11]) * 32
R_STATIC = bytes([12]) * 32


def pair(
    expected: PeerID | None = None, cipher: str = "AESGCM"
) -> tuple[SecureHandshake, SecureHandshake]:
    i = SecureHandshake(ALICE, initiator=True, expected_peer=expected, cipher=cipher)
    r = SecureHandshake(BOB, initiator=False, cipher=cipher)
    return i, r


def run(i: SecureHandshake, r: SecureHandshake) -> tuple[bytes, bytes, bytes]:
    """Whole messages, one per receive(); returns the three frames as sent."""
    m1 = i.start()
    assert r.start() == b""
    m2 = r.receive(m1)
    m3 = i.receive(m2)
    assert r.receive(m3) == b""
    return m1, m2, m3


def frame(message: bytes) -> bytes:
    return len(message).to_bytes(2, "big") + message


def rejects(side: SecureHandshake, data: bytes) -> None:
    """`data` must fail the handshake: at once, or once a stalled frame is filled in."""
    with pytest.raises(HandshakeError):
        side.receive(data)
        assert not side.complete
        side.receive(bytes(MAX_FRAME_LEN + 2))


# -- the happy path --------------------------------------------------------------------


@pytest.mark.parametrize("cipher", ["AESGCM", "ChaChaPoly"])
def test_handshake_authenticates_both_peers(cipher: str) -> None:
    i, r = pair(expected=BOB.peer_id, cipher=cipher)
    m1, m2, m3 = run(i, r)
    # Wire sizes: 2-byte length prefix + Noise message (payload packs to 112 bytes).
    assert [len(m) for m in (m1, m2, m3)] == [2 + 32, 2 + 208, 2 + 176]
    assert i.complete and r.complete
    assert i.remote_peer == BOB.peer_id
    assert r.remote_peer == ALICE.peer_id
    assert i.handshake_hash == r.handshake_hash
    assert i.leftover == r.leftover == b""


def test_transport_messages_round_trip_both_ways() -> None:
    i, r = pair()
    run(i, r)
    for n in range(5):
        assert r.recv_cipher.decrypt(i.send_cipher.encrypt(b"a->b %d" % n)) == b"a->b %d" % n
        assert i.recv_cipher.decrypt(r.send_cipher.encrypt(b"b->a %d" % n)) == b"b->a %d" % n
    # The hot path uses the same ciphers in place.
    payload = bytes(range(256)) * 100
    out = bytearray(len(payload) + 16)
    i.send_cipher.encrypt_into(payload, out)
    back = bytearray(len(payload))
    r.recv_cipher.decrypt_into(memoryview(out), back)
    assert back == payload


def test_ciphers_are_unavailable_before_completion() -> None:
    i, _ = pair()
    with pytest.raises(RuntimeError):
        i.send_cipher  # noqa: B018
    with pytest.raises(RuntimeError):
        i.recv_cipher  # noqa: B018


def test_initiator_may_pipeline_transport_data_after_message_3() -> None:
    i, r = pair()
    m2 = r.receive(i.start())
    m3 = i.receive(m2)
    early = i.send_cipher.encrypt(b"first request")
    # Message 3 and the first transport bytes arrive in one read.
    assert r.receive(m3 + early) == b""
    assert r.complete
    assert r.leftover == early
    assert r.recv_cipher.decrypt(r.leftover) == b"first request"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_handshake_survives_any_split_of_the_byte_streams(data: st.DataObject) -> None:
    i, r = pair(expected=BOB.peer_id)
    to_r, to_i = bytearray(i.start()), bytearray(r.start())
    pipelined = b""
    transport_to_r = bytearray()  # bytes the responder's transport gets, in order
    while not (i.complete and r.complete):
        ready = [q for q, side in ((to_r, r), (to_i, i)) if q and not side.complete]
        assert ready, "deadlock: both sides wait with nothing in flight"
        queue = data.draw(st.sampled_from(ready))
        # Written as "all but k" so that the simplest example delivers whole buffers.
        size = len(queue) - data.draw(st.integers(0, len(queue) - 1))
        chunk = bytes(queue[:size])
        del queue[:size]
        if queue is to_r:
            to_i += r.receive(chunk)
        else:
            to_r += i.receive(chunk)
            if i.complete and not pipelined:
                pipelined = i.send_cipher.encrypt(b"pipelined")
                to_r += pipelined
        if r.complete and not transport_to_r:
            # From here on the transport owns the stream: leftover first, then the rest.
            transport_to_r += r.leftover + to_r
            to_r.clear()
    transport_to_r += to_r
    assert r.recv_cipher.decrypt(bytes(transport_to_r)) == b"pipelined"
    assert i.remote_peer == BOB.peer_id and r.remote_peer == ALICE.peer_id


# -- identity binding ------------------------------------------------------------------


def test_wrong_expected_peer_is_a_peer_id_mismatch_on_the_initiator() -> None:
    i, r = pair(expected=CAROL.peer_id)
    m2 = r.receive(i.start())
    with pytest.raises(PeerIDMismatch) as info:
        i.receive(m2)
    assert str(info.value) == (f"peer ID mismatch: expected {CAROL.peer_id}, got {BOB.peer_id}")
    assert not i.complete  # and message 3 (our identity) was never produced


def test_responder_can_also_insist_on_a_peer() -> None:
    i = SecureHandshake(ALICE, initiator=True)
    r = SecureHandshake(BOB, initiator=False, expected_peer=CAROL.peer_id)
    m3 = i.receive(r.receive(i.start()))
    with pytest.raises(PeerIDMismatch, match="expected"):
        r.receive(m3)


def identity_payload(**fields: Any) -> bytes:
    return msgpack.packb(fields)


class EvilResponder:
    """A responder that speaks raw Noise, so it can put anything in message 2."""

    def __init__(self, m1_frame: bytes) -> None:
        self.noise = NoiseHandshakeXX(False, R_STATIC)
        self.noise.read_message(m1_frame[2:])
        self.static = self.noise.local_static_public

    def message_2(self, payload: bytes) -> bytes:
        return frame(self.noise.write_message(payload))


class EvilInitiator:
    """An initiator that speaks raw Noise, so it can put anything in message 3."""

    def __init__(self) -> None:
        self.noise = NoiseHandshakeXX(True, I_STATIC)
        self.static = self.noise.local_static_public

    def message_1(self) -> bytes:
        return frame(self.noise.write_message())

    def message_3(self, m2_frame: bytes, payload: bytes) -> bytes:
        self.noise.read_message(m2_frame[2:])
        return frame(self.noise.write_message(payload))


def signed(identity: Identity, static: bytes) -> bytes:
    return identity.sign(SIGNATURE_PREFIX + static)


def test_evil_responder_helper_is_faithful() -> None:
    i, _ = pair()
    evil = EvilResponder(i.start())
    payload = identity_payload(v=1, key=BOB.public_key_bytes, sig=signed(BOB, evil.static))
    i.receive(evil.message_2(payload))
    assert i.complete and i.remote_peer == BOB.peer_id


def _bad_payloads(static: bytes) -> dict[str, bytes]:
    good_sig = signed(BOB, static)
    key = BOB.public_key_bytes
    return {
        # Claims Bob's key but Carol signed: the claim is unproven.
        "signed by another identity": identity_payload(v=1, key=key, sig=signed(CAROL, static)),
        # Bob's signature over some other session's static key cannot be replayed.
        "signature over another static key": identity_payload(
            v=1, key=key, sig=signed(BOB, bytes(32))
        ),
        "signature without the domain prefix": identity_payload(v=1, key=key, sig=BOB.sign(static)),
        "key of 31 bytes": identity_payload(v=1, key=key[:31], sig=good_sig),
        "key of 33 bytes": identity_payload(v=1, key=key + b"\0", sig=good_sig),
        "key as str": identity_payload(v=1, key="k" * 32, sig=good_sig),
        "signature of 63 bytes": identity_payload(v=1, key=key, sig=good_sig[:63]),
        "version 2": identity_payload(v=2, key=key, sig=good_sig),
        "version True": identity_payload(v=True, key=key, sig=good_sig),
        "version missing": identity_payload(key=key, sig=good_sig),
        "unknown field": identity_payload(v=1, key=key, sig=good_sig, extra=1),
        "not a map": msgpack.packb([1, key, good_sig]),
        "empty": b"",
        "trailing bytes": identity_payload(v=1, key=key, sig=good_sig) + b"\0",
        "not msgpack": b"\xc1" * 20,
        "oversized bin": msgpack.packb({"v": 1, "key": bytes(300), "sig": good_sig}),
        # fixmap of 4 entries where "v" appears twice: two decoders, two meanings.
        "duplicate key": b"\x84\xa1v\x01\xa1v\x02"
        + msgpack.packb({"key": key, "sig": good_sig})[1:],
    }


@pytest.mark.parametrize("case", list(_bad_payloads(bytes(32))))
def test_bad_identity_payload_in_message_2_is_refused(case: str) -> None:
    i, _ = pair()
    evil = EvilResponder(i.start())
    with pytest.raises(HandshakeError, match="handshake message 2"):
        i.receive(evil.message_2(_bad_payloads(evil.static)[case]))
    assert not i.complete and i.remote_peer is None


def test_signature_by_a_different_identity_key_is_refused_by_the_responder() -> None:
    evil = EvilInitiator()
    r = SecureHandshake(BOB, initiator=False)
    m2 = r.receive(evil.message_1())
    # Claims to be Alice; Carol signed.
    payload = identity_payload(v=1, key=ALICE.public_key_bytes, sig=signed(CAROL, evil.static))
    with pytest.raises(HandshakeError, match="signature"):
        r.receive(evil.message_3(m2, payload))
    assert not r.complete and r.remote_peer is None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(max_size=400))
def test_any_payload_bytes_in_message_2_only_raise_handshake_error(payload: bytes) -> None:
    i, _ = pair()
    evil = EvilResponder(i.start())
    with pytest.raises(HandshakeError):
        i.receive(evil.message_2(payload))


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(value=_msgpack_values)
def test_any_msgpack_value_in_message_2_only_raises_handshake_error(value: Any) -> None:
    i, _ = pair()
    evil = EvilResponder(i.start())
    payload = msgpack.packb(value)
    if len(payload) > 900:
        return
    with pytest.raises(HandshakeError):
        i.receive(evil.message_2(payload))


# -- framing, order and tampering ------------------------------------------------------


def fresh(which: int) -> tuple[SecureHandshake, bytes]:
    """A new pair run up to handshake message `which` (2 or 3): (its reader, the frame)."""
    i, r = pair()
    m2 = r.receive(i.start())
    if which == 2:
        return i, m2
    return r, i.receive(m2)


def test_tampering_any_byte_of_message_2_or_3_fails_the_handshake() -> None:
    for which in (2, 3):
        _, message = fresh(which)
        for pos in range(len(message)):  # length prefix included
            target, message = fresh(which)
            tampered = bytearray(message)
            tampered[pos] ^= 0x01
            rejects(target, bytes(tampered))


def test_tampering_any_byte_of_message_1_fails_the_handshake() -> None:
    for pos in range(2 + 32):
        i, r = pair()
        m1 = bytearray(i.start())
        m1[pos] ^= 0x80 if pos >= 2 else 0x01
        with pytest.raises(HandshakeError):
            # Message 1 is unauthenticated; the initiator notices at message 2.
            i.receive(r.receive(bytes(m1)))


@settings(max_examples=100, deadline=None)
@given(which=st.sampled_from([2, 3]), pos=st.integers(0, 1000), mask=st.integers(1, 255))
def test_tampering_with_any_mask_fails_the_handshake(which: int, pos: int, mask: int) -> None:
    target, message = fresh(which)
    tampered = bytearray(message)
    tampered[pos % len(tampered)] ^= mask
    rejects(target, bytes(tampered))


def test_partial_frames_wait_for_more_bytes() -> None:
    i, r = pair()
    m1 = i.start()
    assert r.receive(m1[:1]) == b""  # half a length prefix
    assert r.receive(m1[1:10]) == b""
    m2 = r.receive(m1[10:])
    assert m2
    for byte in m2[:-1]:
        assert i.receive(bytes([byte])) == b""
    assert i.receive(m2[-1:])


def test_truncated_messages_are_refused() -> None:
    for which in (2, 3):
        _, message = fresh(which)
        for cut in range(1, len(message) - 2):
            target, message = fresh(which)
            # A length prefix that matches a truncated body: too short, or fails authentication.
            with pytest.raises(HandshakeError):
                target.receive(frame(message[2 : 2 + cut]))


def test_zero_length_frame_is_refused() -> None:
    _, r = pair()
    with pytest.raises(HandshakeError, match="zero-length"):
        r.receive(b"\x00\x00")


def test_message_1_must_be_exactly_one_ephemeral_key() -> None:
    for size in (31, 33, 1000):
        _, r = pair()
        # Refused on the length prefix alone, before any body is buffered.
        with pytest.raises(HandshakeError, match="must be 32 bytes"):
            r.receive(size.to_bytes(2, "big"))


@pytest.mark.parametrize(("which", "minimum"), [(2, 96), (3, 64)])
def test_frame_length_bounds_are_checked_on_the_prefix_alone(which: int, minimum: int) -> None:
    target, _ = fresh(which)
    with pytest.raises(HandshakeError, match="exceeds"):
        target.receive((MAX_FRAME_LEN + 1).to_bytes(2, "big"))
    target, _ = fresh(which)
    with pytest.raises(HandshakeError, match="shorter"):
        target.receive((minimum - 1).to_bytes(2, "big"))
    target, _ = fresh(which)
    with pytest.raises(HandshakeError, match="exceeds"):
        target.receive(b"\xff\xff")


def test_bytes_out_of_turn_are_refused() -> None:
    # The responder never speaks first.
    i, _ = pair()
    with pytest.raises(HandshakeError, match="before the initiator"):
        i.receive(b"\x00")
    # The initiator cannot send anything between message 1 and message 3.
    i, r = pair()
    with pytest.raises(HandshakeError, match="before receiving handshake message 2"):
        r.receive(i.start() + b"\x00\x10")
    # The responder has nothing to say after message 2 until it has read message 3.
    i, r = pair()
    with pytest.raises(HandshakeError, match="after handshake message 2"):
        i.receive(r.receive(i.start()) + b"x")


def test_receive_after_completion_or_failure_raises() -> None:
    i, r = pair()
    run(i, r)
    with pytest.raises(HandshakeError, match="completed"):
        r.receive(b"late")
    i, r = pair()
    with pytest.raises(HandshakeError):
        r.receive(b"\x00\x00")
    with pytest.raises(HandshakeError, match="already failed"):
        r.receive(pair()[0].start())


def test_start_twice_is_a_programming_error() -> None:
    i, _ = pair()
    i.start()
    with pytest.raises(RuntimeError):
        i.start()


def test_cipher_mismatch_fails_the_handshake() -> None:
    i = SecureHandshake(ALICE, initiator=True, cipher="AESGCM")
    r = SecureHandshake(BOB, initiator=False, cipher="ChaChaPoly")
    with pytest.raises(HandshakeError):
        i.receive(r.receive(i.start()))


@settings(max_examples=300, deadline=None)
@given(
    stage=st.sampled_from(["responder: message 1", "initiator: message 2", "responder: message 3"]),
    garbage=st.binary(max_size=1100),
    framed=st.booleans(),
)
def test_random_garbage_only_ever_raises_handshake_error(
    stage: str, garbage: bytes, framed: bool
) -> None:
    i, r = pair()
    m1 = i.start()
    if stage == "responder: message 1":
        target = r
    elif stage == "initiator: message 2":
        r.receive(m1)
        target = i
    else:
        i.receive(r.receive(m1))
        target = r
    data = frame(garbage) if framed else garbage
    try:
        target.receive(data)
    except HandshakeError:
        return
    # Garbage never completes a handshake; at most it looks like a bare ephemeral key.
    assert not target.complete


def test_low_order_ephemeral_key_in_message_1_is_refused() -> None:
    _, r = pair()
    with pytest.raises(HandshakeError, match="handshake message 1: remote key is a low-order"):
        r.receive(frame(bytes(32)))
