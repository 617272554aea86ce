"""Noise XX (shoal.transport.noise): published vectors, message order, tampering, ciphers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.transport import noise
from shoal.transport.errors import HandshakeError
from shoal.transport.noise import (
    MAX_MESSAGE_LEN,
    MAX_NONCE,
    CipherState,
    NoiseError,
    NoiseHandshakeXX,
)

# The vectors are the Noise_XX_25519_{AESGCM,ChaChaPoly}_SHA256 entries of the
# cacophony test vectors (github.com/haskell-cryptography/cacophony), copied
# verbatim from mcginty/snow tests/vectors/cacophony.txt at commit
# 8ac60f51cfe3e010c84f0a454cc575ad9204fa12.
VECTORS = json.loads((Path(__file__).parent / "vectors" / "noise_xx.json").read_text())["vectors"]
CIPHERS = ["AESGCM", "ChaChaPoly"]


def handshake(cipher: str = "AESGCM", prologue: bytes = b"") -> tuple[NoiseHandshakeXX, ...]:
    i = NoiseHandshakeXX(True, cipher=cipher, prologue=prologue)
    r = NoiseHandshakeXX(False, cipher=cipher, prologue=prologue)
    return i, r


def run(i: NoiseHandshakeXX, r: NoiseHandshakeXX) -> list[bytes]:
    m1 = i.write_message()
    r.read_message(m1)
    m2 = r.write_message(b"from responder")
    assert i.read_message(m2) == b"from responder"
    m3 = i.write_message(b"from initiator")
    assert r.read_message(m3) == b"from initiator"
    return [m1, m2, m3]


# -- published test vectors ------------------------------------------------------------


@pytest.mark.parametrize("vector", VECTORS, ids=[v["protocol_name"] for v in VECTORS])
def test_cacophony_vector(vector: dict) -> None:
    h = bytes.fromhex
    cipher = vector["protocol_name"].split("_")[3]
    initiator = NoiseHandshakeXX(
        True,
        h(vector["init_static"]),
        cipher=cipher,
        prologue=h(vector["init_prologue"]),
        ephemeral_private=h(vector["init_ephemeral"]),
    )
    responder = NoiseHandshakeXX(
        False,
        h(vector["resp_static"]),
        cipher=cipher,
        prologue=h(vector["resp_prologue"]),
        ephemeral_private=h(vector["resp_ephemeral"]),
    )
    assert initiator.protocol_name == vector["protocol_name"]

    # Handshake messages alternate starting with the initiator, byte for byte.
    messages = vector["messages"]
    sides = (initiator, responder)
    for n, msg in enumerate(messages[:3]):
        writer, reader = sides[n % 2], sides[1 - n % 2]
        ciphertext = writer.write_message(h(msg["payload"]))
        assert ciphertext.hex() == msg["ciphertext"], f"handshake message {n + 1}"
        assert reader.read_message(ciphertext) == h(msg["payload"])
    assert initiator.complete and responder.complete
    assert initiator.handshake_hash.hex() == vector["handshake_hash"]
    assert responder.handshake_hash.hex() == vector["handshake_hash"]
    assert initiator.remote_static == responder.local_static_public
    assert responder.remote_static == initiator.local_static_public

    # Transport messages keep the alternation: message 4 is the responder's.
    i_send, i_recv = initiator.split()
    r_send, r_recv = responder.split()
    for n, msg in enumerate(messages[3:]):
        send, recv = (r_send, i_recv) if n % 2 == 0 else (i_send, r_recv)
        ciphertext = send.encrypt(h(msg["payload"]))
        assert ciphertext.hex() == msg["ciphertext"], f"transport message {n + 1}"
        assert recv.decrypt(ciphertext) == h(msg["payload"])


# -- the handshake between two live sides ----------------------------------------------


@pytest.mark.parametrize("cipher", CIPHERS)
def test_handshake_agrees_and_split_is_oriented_per_role(cipher: str) -> None:
    i, r = handshake(cipher, prologue=b"shoal test")
    m1, m2, m3 = run(i, r)
    assert len(m1) == 32  # e only, nothing encrypted yet
    assert len(m2) == 32 + 48 + len(b"from responder") + 16
    assert len(m3) == 48 + len(b"from initiator") + 16
    assert i.protocol_name == f"Noise_XX_25519_{cipher}_SHA256"
    assert i.handshake_hash == r.handshake_hash
    i_send, i_recv = i.split()
    r_send, r_recv = r.split()
    for _ in range(3):
        assert r_recv.decrypt(i_send.encrypt(b"ping")) == b"ping"
        assert i_recv.decrypt(r_send.encrypt(b"pong", b"ad"), b"ad") == b"pong"


def test_prologue_mismatch_fails_at_message_2() -> None:
    i = NoiseHandshakeXX(True, prologue=b"one")
    r = NoiseHandshakeXX(False, prologue=b"two")
    r.read_message(i.write_message())
    with pytest.raises(NoiseError):
        i.read_message(r.write_message())


def test_cipher_mismatch_fails_at_message_2() -> None:
    i = NoiseHandshakeXX(True, cipher="AESGCM")
    r = NoiseHandshakeXX(False, cipher="ChaChaPoly")
    r.read_message(i.write_message())
    with pytest.raises(NoiseError):
        i.read_message(r.write_message())


def test_messages_out_of_turn_are_refused() -> None:
    i, r = handshake()
    with pytest.raises(NoiseError, match="out of turn"):
        r.write_message()
    with pytest.raises(NoiseError, match="out of turn"):
        i.read_message(bytes(32))
    m1 = i.write_message()
    with pytest.raises(NoiseError, match="out of turn"):
        i.write_message()
    r.read_message(m1)
    with pytest.raises(NoiseError, match="out of turn"):
        r.read_message(m1)


def test_after_completion_no_more_messages_and_split_only_once() -> None:
    i, r = handshake()
    with pytest.raises(NoiseError):
        i.split()
    with pytest.raises(NoiseError):
        i.handshake_hash  # noqa: B018
    run(i, r)
    with pytest.raises(NoiseError, match="complete"):
        i.write_message()
    with pytest.raises(NoiseError, match="complete"):
        r.read_message(b"x" * 64)
    i.split()
    # A second pair would reuse (key, nonce) pairs from the first.
    with pytest.raises(NoiseError, match="already"):
        i.split()


def test_a_failed_handshake_stays_failed() -> None:
    i, r = handshake()
    r.read_message(i.write_message())
    m2 = bytearray(r.write_message())
    m2[-1] ^= 1
    with pytest.raises(NoiseError):
        i.read_message(bytes(m2))
    m2[-1] ^= 1
    with pytest.raises(NoiseError, match="failed"):
        i.read_message(bytes(m2))


def test_message_size_limit() -> None:
    i, r = handshake()
    with pytest.raises(NoiseError, match="limit"):
        i.write_message(bytes(MAX_MESSAGE_LEN - 31))
    m1 = i.write_message(bytes(MAX_MESSAGE_LEN - 32))  # exactly the limit is fine
    assert len(m1) == MAX_MESSAGE_LEN
    with pytest.raises(NoiseError, match="over the limit"):
        r.read_message(m1 + b"x")


# Fixed keys make every fresh pair produce the same messages, so a message can be
# replayed, truncated or tampered with against a fresh reader as often as needed.
_K = {k: bytes.fromhex(v) for k, v in VECTORS[0].items() if k.endswith(("static", "ephemeral"))}
P2, P3 = b"payload 2", b"payload 3"


def fixed_pair() -> tuple[NoiseHandshakeXX, NoiseHandshakeXX]:
    i = NoiseHandshakeXX(True, _K["init_static"], ephemeral_private=_K["init_ephemeral"])
    r = NoiseHandshakeXX(False, _K["resp_static"], ephemeral_private=_K["resp_ephemeral"])
    return i, r


def fixed_messages() -> list[bytes]:
    i, r = fixed_pair()
    m1 = i.write_message()
    r.read_message(m1)
    m2 = r.write_message(P2)
    i.read_message(m2)
    m3 = i.write_message(P3)
    r.read_message(m3)
    return [m1, m2, m3]


def reader_of(n: int) -> NoiseHandshakeXX:
    """A fresh fixed-key side, advanced to where it reads handshake message `n` (1-3)."""
    i, r = fixed_pair()
    if n == 1:
        return r
    r.read_message(i.write_message())
    m2 = r.write_message(P2)
    if n == 2:
        return i
    i.read_message(m2)
    i.write_message(P3)
    return r


def test_fixed_keys_replay_identically() -> None:
    assert fixed_messages() == fixed_messages()
    _, m2, m3 = fixed_messages()
    assert reader_of(2).read_message(m2) == P2
    assert reader_of(3).read_message(m3) == P3


def test_every_truncation_is_refused() -> None:
    m1, m2, m3 = fixed_messages()
    for cut in range(32):  # message 1 is a bare ephemeral key: shorter cannot be one
        with pytest.raises(NoiseError, match="shorter"):
            reader_of(1).read_message(m1[:cut])
    for n, message in ((2, m2), (3, m3)):
        for cut in range(len(message)):
            with pytest.raises(NoiseError):
                reader_of(n).read_message(message[:cut])


def test_tampering_any_byte_of_messages_2_and_3_is_detected() -> None:
    _, m2, m3 = fixed_messages()
    for n, message in ((2, m2), (3, m3)):
        for pos in range(len(message)):
            for mask in (0x01, 0x80):
                tampered = bytearray(message)
                tampered[pos] ^= mask
                with pytest.raises(NoiseError):
                    reader_of(n).read_message(bytes(tampered))


def test_tampering_message_1_is_detected_by_the_initiator_at_message_2() -> None:
    m1, _, _ = fixed_messages()
    for pos in range(len(m1)):
        tampered = bytearray(m1)
        tampered[pos] ^= 0x80  # the high bit X25519 ignores: the transcript hash still differs
        i, r = fixed_pair()
        i.write_message()
        r.read_message(bytes(tampered))  # message 1 carries no authentication
        with pytest.raises(NoiseError):
            i.read_message(r.write_message(P2))


@settings(max_examples=300)
@given(garbage=st.binary(max_size=300), stage=st.sampled_from(["m1", "m2", "m3"]))
def test_garbage_only_ever_raises_noise_error(garbage: bytes, stage: str) -> None:
    i, r = handshake()
    if stage == "m1":
        reader = r
    else:
        r.read_message(i.write_message())
        if stage == "m2":
            reader = i
        else:
            i.read_message(r.write_message())
            i.write_message()
            reader = r
    try:
        reader.read_message(garbage)
    except NoiseError:
        return
    # Only message 1 (an ephemeral key and a plaintext payload) is unauthenticated.
    assert stage == "m1" and len(garbage) >= 32


def test_low_order_ephemeral_key_is_refused() -> None:
    r = NoiseHandshakeXX(False)
    r.read_message(bytes(32))  # message 1 is not authenticated; the key is only used below
    with pytest.raises(NoiseError, match="low-order"):
        r.write_message()


def test_read_message_refuses_non_bytes() -> None:
    r = NoiseHandshakeXX(False)
    with pytest.raises(NoiseError):
        r.read_message("not bytes")  # type: ignore[arg-type]


def test_unknown_cipher_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        NoiseHandshakeXX(True, cipher="AES256")
    with pytest.raises(ValueError):
        CipherState(bytes(32), "Salsa")
    with pytest.raises(ValueError):
        CipherState(bytes(16))


# -- CipherState -----------------------------------------------------------------------


def test_nonce_encoding_follows_the_spec() -> None:
    key = bytes(range(32))
    aes = CipherState(key, "AESGCM")
    chacha = CipherState(key, "ChaChaPoly")
    n = 0x0102030405060708
    aes.nonce = chacha.nonce = n
    # AES-GCM: 4 zero bytes + big-endian counter; ChaChaPoly: + little-endian counter.
    assert aes.encrypt(b"m", b"ad") == AESGCM(key).encrypt(
        bytes(4) + n.to_bytes(8, "big"), b"m", b"ad"
    )
    assert chacha.encrypt(b"m", b"ad") == ChaCha20Poly1305(key).encrypt(
        bytes(4) + n.to_bytes(8, "little"), b"m", b"ad"
    )
    assert aes.nonce == chacha.nonce == n + 1


@pytest.mark.parametrize("cipher", CIPHERS)
def test_nonce_exhaustion_is_guarded(cipher: str) -> None:
    send, recv = CipherState(bytes(32), cipher), CipherState(bytes(32), cipher)
    send.nonce = recv.nonce = MAX_NONCE - 1
    assert recv.decrypt(send.encrypt(b"last")) == b"last"
    # 2^64-1 is reserved: no message is ever sealed or opened with it.
    for call in (
        lambda: send.encrypt(b"x"),
        lambda: recv.decrypt(bytes(17)),
        lambda: send.encrypt_into(b"x", bytearray(17)),
        lambda: recv.decrypt_into(bytes(17), bytearray(1)),
    ):
        with pytest.raises(NoiseError, match="exhausted"):
            call()
    assert send.nonce == recv.nonce == MAX_NONCE


@pytest.mark.parametrize("cipher", CIPHERS)
def test_failed_decryption_does_not_advance_the_nonce(cipher: str) -> None:
    send, recv = CipherState(bytes(32), cipher), CipherState(bytes(32), cipher)
    ct = send.encrypt(b"hello")
    with pytest.raises(NoiseError):
        recv.decrypt(ct[:-1] + bytes([ct[-1] ^ 1]))
    with pytest.raises(NoiseError):
        recv.decrypt_into(ct[:-1] + bytes([ct[-1] ^ 1]), bytearray(5))
    with pytest.raises(NoiseError):
        recv.decrypt(ct[:10])  # shorter than the tag
    with pytest.raises(NoiseError):
        recv.decrypt_into(ct[:10], bytearray(16))
    assert recv.nonce == 0
    assert recv.decrypt(ct) == b"hello"


@settings(max_examples=100)
@given(
    cipher=st.sampled_from(CIPHERS),
    messages=st.lists(st.binary(max_size=2000), min_size=1, max_size=5),
    slack=st.integers(0, 8),
    ad=st.binary(max_size=8),
)
def test_into_variants_agree_with_encrypt_and_decrypt(
    cipher: str, messages: list[bytes], slack: int, ad: bytes
) -> None:
    key = bytes(range(32))
    plain_send, into_send = CipherState(key, cipher), CipherState(key, cipher)
    plain_recv, into_recv = CipherState(key, cipher), CipherState(key, cipher)
    for m in messages:
        # Larger output buffers are fine; memoryviews are read and written in place.
        out = bytearray(len(m) + 16 + slack)
        n = into_send.encrypt_into(memoryview(m), memoryview(out), ad)
        expected = plain_send.encrypt(m, ad)
        assert n == len(m) + 16 and bytes(out[:n]) == expected
        back = bytearray(len(m) + slack)
        assert into_recv.decrypt_into(memoryview(out)[:n], back, ad) == len(m)
        assert bytes(back[: len(m)]) == m == plain_recv.decrypt(expected, ad)
    assert into_send.nonce == plain_send.nonce == len(messages)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("cipher", CIPHERS)
def test_a_record_is_sealed_inside_the_buffer_that_holds_its_plaintext(
    cipher: str, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection seals each small record where it assembled it. cryptography
    51 refuses overlapping buffers ("data and buf must not overlap"; before it, a
    buffer sealed into itself): then the plaintext goes through a scratch buffer,
    with the same bits on the wire, whatever the sizes that come one after another."""
    if in_place and not noise._seals_in_place():
        pytest.skip("this cryptography refuses to seal a buffer into itself")
    monkeypatch.setattr(noise, "_SEALS_IN_PLACE", in_place)
    key = bytes(range(32))
    sealer, reference = CipherState(key, cipher), CipherState(key, cipher)
    for size in (1024, 10, 5000, 0, 4096):
        message = os.urandom(size)
        record = bytearray(2 + size + 16)
        view = memoryview(record)
        view[2 : 2 + size] = message
        assert sealer.seal_in_place(view[2:], size) == size + 16
        assert bytes(view[2:]) == reference.encrypt(message)
        assert bytes(view[:2]) == b"\0\0"  # (the length prefix is the caller's)


def test_into_variants_refuse_small_buffers() -> None:
    c = CipherState(bytes(32))
    with pytest.raises(ValueError):
        c.encrypt_into(b"abc", bytearray(18))
    ct = CipherState(bytes(32)).encrypt(b"abc")
    with pytest.raises(ValueError):
        c.decrypt_into(ct, bytearray(2))
    assert c.nonce == 0


@pytest.mark.parametrize("cipher", CIPHERS)
def test_rekey_changes_the_key_in_step_on_both_sides(cipher: str) -> None:
    send, recv = CipherState(bytes(32), cipher), CipherState(bytes(32), cipher)
    before = CipherState(bytes(32), cipher).encrypt(b"m")
    send.rekey()
    recv.rekey()
    ct = send.encrypt(b"m")
    assert ct != before
    assert recv.decrypt(ct) == b"m"


def test_noise_error_is_a_handshake_error() -> None:
    assert issubclass(NoiseError, HandshakeError)


# -- the psk modifier (private swarms) ---------------------------------------------------------

# The Noise_XXpsk3_25519_{AESGCM,ChaChaPoly}_SHA256 entries of the cacophony vectors, from
# the same file at the same commit as VECTORS: they check MixKeyAndHash and the extra
# MixKey of "e" under a psk, which psk0 shares.
PSK_VECTORS = json.loads((Path(__file__).parent / "vectors" / "noise_xx_psk.json").read_text())[
    "vectors"
]


@pytest.mark.parametrize("vector", PSK_VECTORS, ids=[v["protocol_name"] for v in PSK_VECTORS])
def test_cacophony_psk3_vector(vector: dict) -> None:
    h = bytes.fromhex
    cipher = vector["protocol_name"].split("_")[3]
    sides = [
        NoiseHandshakeXX(
            role == "init",
            h(vector[f"{role}_static"]),
            cipher=cipher,
            prologue=h(vector[f"{role}_prologue"]),
            ephemeral_private=h(vector[f"{role}_ephemeral"]),
            psk=h(vector[f"{role}_psks"][0]),
            psk_position=3,
        )
        for role in ("init", "resp")
    ]
    assert sides[0].protocol_name == vector["protocol_name"]
    for n, msg in enumerate(vector["messages"][:3]):
        writer, reader = sides[n % 2], sides[1 - n % 2]
        ciphertext = writer.write_message(h(msg["payload"]))
        assert ciphertext.hex() == msg["ciphertext"], f"handshake message {n + 1}"
        assert reader.read_message(ciphertext) == h(msg["payload"])
    assert (
        sides[0].handshake_hash.hex() == sides[1].handshake_hash.hex() == vector["handshake_hash"]
    )


def test_xxpsk0_matches_snow() -> None:
    # snow's tests/general.rs test_XXpsk0_expected_value (mcginty/snow at commit
    # 8ac60f51cfe3e010c84f0a454cc575ad9204fa12): keys 0..31, 1..32 (statics), 32..63 and
    # 33..64 (ephemerals), psk 4..35, prologue 01 02 03; message 3 byte for byte.
    def inc(start: int) -> bytes:
        return bytes(range(start, start + 32))

    common = {"cipher": "ChaChaPoly", "prologue": b"\x01\x02\x03", "psk": inc(4)}
    i = NoiseHandshakeXX(True, inc(0), ephemeral_private=inc(32), **common)
    r = NoiseHandshakeXX(False, inc(1), ephemeral_private=inc(33), **common)
    assert i.protocol_name == "Noise_XXpsk0_25519_ChaChaPoly_SHA256"
    m1 = i.write_message(b"abc")
    assert len(m1) == 51 and r.read_message(m1) == b"abc"
    m2 = r.write_message(b"defg")
    assert len(m2) == 100 and i.read_message(m2) == b"defg"
    m3 = i.write_message(b"")
    assert r.read_message(m3) == b""
    assert m3.hex() == (
        "072b7bbd237ac602c4aa938db36998f31ca4750752d1758d59850c627d0bdbc5"
        "1205592c3baa101b4a31f062695b7c1dbee99d5123fbd2ad03052078c570e028"
    )


@pytest.mark.parametrize("other", [None, bytes(32)], ids=["no-psk", "another-psk"])
def test_a_psk_handshake_fails_at_message_1_against_any_other_key(other: bytes | None) -> None:
    key = bytes(range(32))
    i = NoiseHandshakeXX(True, psk=other)
    r = NoiseHandshakeXX(False, psk=key)
    with pytest.raises(NoiseError):
        r.read_message(i.write_message())
    with pytest.raises(ValueError, match="32 bytes"):
        NoiseHandshakeXX(True, psk=b"short")
