"""Identity: Ed25519 keys on disk and libp2p-compatible peer IDs."""

from __future__ import annotations

import base64
import os
import stat

import pytest

from shoal.transport.identity import (
    Identity,
    IdentityFileError,
    PeerID,
    b58decode,
    b58encode,
)

# libp2p peer-ids spec, test vectors: protobuf-encoded Ed25519 private and public keys.
SPEC_PRIVATE = bytes.fromhex(
    "080112407e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d"
    "1ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
SPEC_PUBLIC = bytes.fromhex(
    "080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)

# A key and the ID go-libp2p printed for it (protobuf keys in base64, as go-libp2p shows them).
GO_PRIVATE = base64.b64decode(
    "CAESQKh6mFqQytA2KPTQTs7nHf+AI5b8qYT7slPc0OLqU6etL16KRu1eu18u4JqiyU2RnNvhqTtdg3Pkcz0GV2go5y4="
)
GO_PUBLIC = base64.b64decode("CAESIC9eikbtXrtfLuCaoslNkZzb4ak7XYNz5HM9BldoKOcu")
GO_PEER_ID = "12D3KooWD1GwcSwpN9ErEm3TETTUbzveXaMMy1TNEC7XR6vvFQEZ"


def seed_of(private_protobuf: bytes) -> bytes:
    assert private_protobuf[:4] == bytes([0x08, 0x01, 0x12, 0x40])
    return private_protobuf[4:36]  # libp2p stores seed || public key


def test_the_public_key_encoding_matches_the_libp2p_spec_vector() -> None:
    identity = Identity.from_seed(seed_of(SPEC_PRIVATE))
    # The peer ID is the identity multihash (0x00, length 0x24) of the protobuf key.
    assert identity.peer_id.to_bytes() == bytes([0x00, 0x24]) + SPEC_PUBLIC
    assert identity.public_key_bytes == SPEC_PRIVATE[36:]


def test_the_peer_id_matches_the_one_go_libp2p_derives() -> None:
    identity = Identity.from_seed(seed_of(GO_PRIVATE))
    assert identity.peer_id.to_bytes()[2:] == GO_PUBLIC
    assert str(identity.peer_id) == GO_PEER_ID
    assert PeerID.from_base58(GO_PEER_ID) == identity.peer_id


def test_generated_ids_read_12D3KooW() -> None:
    for _ in range(20):
        assert str(Identity.generate().peer_id).startswith("12D3KooW")


def test_base58_round_trips_and_keeps_leading_zeros() -> None:
    for data in (b"", b"\0", b"\0\0\x01", os.urandom(38), bytes(5) + os.urandom(10)):
        assert b58decode(b58encode(data)) == data
    with pytest.raises(ValueError, match="'0'"):
        b58decode("12D3Koo0")  # 0 is not in the alphabet


def test_a_peer_id_verifies_its_own_signatures_only() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    sig = alice.sign(b"message")
    assert alice.peer_id.verify(sig, b"message")
    assert not alice.peer_id.verify(sig, b"messagE")
    assert not bob.peer_id.verify(sig, b"message")
    assert not alice.peer_id.verify(b"short", b"message")


def test_malformed_peer_ids_are_refused_with_the_bad_text_quoted() -> None:
    with pytest.raises(ValueError, match="'QmNotAnEd25519Key'"):
        PeerID.from_base58("QmNotAnEd25519Key")
    with pytest.raises(ValueError):
        PeerID(b"\x00\x24" + bytes(10))
    with pytest.raises(ValueError, match="not int"):  # (not bytes(n): n bytes allocated)
        PeerID(1 << 40)  # type: ignore[arg-type]


def test_the_key_file_is_created_private_and_reloaded(tmp_path) -> None:
    path = tmp_path / "data" / "identity.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load_or_create(path).peer_id == first.peer_id
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp file left


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_key_file_readable_by_others_is_refused(tmp_path, mode) -> None:
    path = tmp_path / "identity.key"
    Identity.load_or_create(path)
    path.chmod(mode)
    with pytest.raises(IdentityFileError, match="chmod 600"):
        Identity.load_or_create(path)


def test_a_corrupt_key_file_is_refused_with_advice(tmp_path) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(b"not a key")
    path.chmod(0o600)
    with pytest.raises(IdentityFileError, match="not a PEM Ed25519 private key"):
        Identity.load_or_create(path)
