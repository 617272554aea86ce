"""DHT records and local storage, as a specification.

Signed records, ownership by name, replay protection, expiration rules (capping,
clock skew), replica merging, storage bounds and hostile wire input.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.dht.records import (
    DEFAULT_MAX_TTL,
    MAX_NAME_BYTES,
    Record,
    RecordError,
    RecordValidator,
    VerifiedSignatures,
    key_id,
    owner_marker,
    owner_of,
)
from shoal.dht.storage import RECORD_OVERHEAD_BYTES, LocalStorage, StoredValue, merge
from shoal.transport.identity import Identity, PeerID

NOW = 1_700_000_000.0
TTL = 60.0


def ident(n: int) -> Identity:
    return Identity.from_seed(n.to_bytes(32, "big"))


ALICE, BOB, MALLORY = ident(1), ident(2), ident(3)


def val(obj: object) -> bytes:
    return msgpack.packb(obj)


def owned_key(owner: Identity, name: str = "profile") -> str:
    return f"{name}{owner_marker(owner.peer_id)}"


# ---------------------------------------------------------------- names and owners


def test_owner_marker_round_trip() -> None:
    key = owned_key(ALICE)
    assert key == f"profile[owner:{ALICE.peer_id}]"
    assert str(ALICE.peer_id).startswith("12D3KooW")
    assert owner_of(key) == ALICE.peer_id
    assert owner_of("plain-key") is None


@pytest.mark.parametrize(
    "name",
    [
        "x[owner:notbase58!]",
        "x[owner:12D3KooW",  # unterminated
        "x[owner:]",
        "x[owner:QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N]",  # not an Ed25519 ID
    ],
)
def test_malformed_owner_marker_is_invalid(name: str) -> None:
    with pytest.raises(RecordError):
        owner_of(name)


def test_two_owner_markers_are_invalid() -> None:
    name = owner_marker(ALICE.peer_id) + owner_marker(BOB.peer_id)
    with pytest.raises(RecordError, match="more than one"):
        owner_of(name)
    record = Record(name, None, val(1), NOW + TTL).sign(ALICE)
    with pytest.raises(RecordError):
        RecordValidator().validate(record, NOW)


def test_key_id_is_sha256_of_key() -> None:
    record = Record("k", None, val(1), NOW + TTL)
    assert record.key_id == key_id("k")
    assert 0 <= record.key_id < 2**256
    assert key_id("k") != key_id("K")


# ---------------------------------------------------------------- signatures


def test_sign_verify_round_trip_survives_the_wire() -> None:
    record = Record(owned_key(ALICE), None, val({"a": 1}), NOW + TTL).sign(ALICE)
    assert record.signature is not None and len(record.signature) == 64
    wire = msgpack.unpackb(msgpack.packb(record.to_wire()))
    decoded = Record.from_wire(wire)
    assert decoded == record
    RecordValidator().validate(decoded, NOW)


def test_integer_expiration_signs_the_same_as_float() -> None:
    # Normalized at construction, so a signer and a verifier agree on the payload.
    a = Record("k", None, val(1), int(NOW) + 60)
    b = Record("k", None, val(1), float(int(NOW) + 60))
    assert a.signing_payload() == b.signing_payload()


@pytest.mark.parametrize(
    "change",
    [
        {"value": val({"a": 2})},
        {"expiration": NOW + TTL + 1},
        {"key": owned_key(ALICE, "other")},
        {"subkey": "other-subkey"},
    ],
    ids=["value", "expiration", "key", "subkey"],
)
def test_altered_signed_record_is_rejected(change: dict[str, object]) -> None:
    fields = {"key": owned_key(ALICE), "subkey": "s", "value": val({"a": 1})}
    fields["expiration"] = NOW + TTL
    signed = Record(**fields).sign(ALICE)  # type: ignore[arg-type]
    RecordValidator().validate(signed, NOW)
    altered = Record(**{**fields, **change, "signature": signed.signature})  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="bad signature"):
        RecordValidator().validate(altered, NOW)


def test_a_record_seen_again_is_not_verified_again_and_the_memory_binds_every_signed_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A matchmaking peer reads the same declarations at every wake, from several
    replicas each: a signature once found valid is remembered (a bounded number), for
    exactly that signer, signature and signed content."""
    verified = []
    real_verify = PeerID.verify
    monkeypatch.setattr(
        PeerID, "verify", lambda self, sig, data: verified.append(1) or real_verify(self, sig, data)
    )
    validator = RecordValidator()
    fields = {"key": owned_key(ALICE), "subkey": "s", "value": val({"a": 1})}
    signed = Record(**fields, expiration=NOW + TTL).sign(ALICE)  # type: ignore[arg-type]
    for _ in range(3):
        validator.validate(Record.from_wire(signed.to_wire()), NOW)
    assert len(verified) == 1
    for change in ({"value": val({"a": 2})}, {"expiration": NOW + TTL + 1}, {"subkey": "t"}):
        altered = replace(signed, **change)  # type: ignore[arg-type]
        with pytest.raises(RecordError, match="bad signature"):
            validator.validate(altered, NOW)
    # Another signer's marker on the same content and signature: checked, and refused.
    moved = replace(signed, key=owned_key(BOB))
    with pytest.raises(RecordError, match="bad signature"):
        validator.validate(moved, NOW)
    # Bounded: the oldest is forgotten (then verified again).
    memory = VerifiedSignatures(capacity=2)
    records = [Record(owned_key(ALICE), str(i), val(i), NOW + TTL).sign(ALICE) for i in range(3)]
    for r in records:
        assert memory.check(ALICE.peer_id, r.signature or b"", r.signing_payload())
    before = len(verified)
    assert memory.check(ALICE.peer_id, records[0].signature or b"", records[0].signing_payload())
    assert len(verified) == before + 1 and memory.hits == 0


def test_unsigned_record_under_owned_key_is_rejected() -> None:
    for subkey in (None, "s"):
        record = Record(owned_key(ALICE), subkey, val(1), NOW + TTL)
        with pytest.raises(RecordError, match="unsigned"):
            RecordValidator().validate(record, NOW)


def test_record_signed_by_non_owner_is_rejected() -> None:
    forged_key = Record(owned_key(ALICE), None, val(1), NOW + TTL).sign(MALLORY)
    forged_subkey = Record("peers", owner_marker(ALICE.peer_id), val(1), NOW + TTL).sign(MALLORY)
    for record in (forged_key, forged_subkey):
        with pytest.raises(RecordError, match="bad signature"):
            RecordValidator().validate(record, NOW)


def test_owned_key_binds_every_subkey_to_the_key_owner() -> None:
    validator = RecordValidator()
    validator.validate(Record(owned_key(ALICE), "any", val(1), NOW + TTL).sign(ALICE), NOW)
    with pytest.raises(RecordError):
        validator.validate(Record(owned_key(ALICE), "any", val(1), NOW + TTL).sign(BOB), NOW)
    # Key owned by Alice, subkey by Bob: nobody can satisfy both.
    both = Record(owned_key(ALICE), owner_marker(BOB.peer_id), val(1), NOW + TTL)
    for signer in (ALICE, BOB):
        with pytest.raises(RecordError, match="no signature can satisfy both"):
            validator.validate(both.sign(signer), NOW)


def test_signature_on_unowned_record_is_rejected() -> None:
    record = Record("free", None, val(1), NOW + TTL).sign(ALICE)
    with pytest.raises(RecordError, match="no owner"):
        RecordValidator().validate(record, NOW)


# ---------------------------------------------------------------- expiration


def test_value_size_limit() -> None:
    validator = RecordValidator()
    validator.validate(Record("k", None, b"x" * 64 * 1024, NOW + TTL), NOW)
    with pytest.raises(RecordError, match="limit 65536"):
        validator.validate(Record("k", None, b"x" * (64 * 1024 + 1), NOW + TTL), NOW)
    small = RecordValidator(max_value_bytes=10)
    with pytest.raises(RecordError):
        LocalStorage(validator=small).store(Record("k", None, b"x" * 11, NOW + TTL), NOW)


def test_already_expired_is_rejected() -> None:
    storage = LocalStorage()
    for expiration in (NOW, NOW - 1, 0.0, -1e300):
        with pytest.raises(RecordError, match="expired"):
            storage.store(Record("k", None, val(1), expiration), NOW)
    assert len(storage) == 0


def test_absurd_expiration_is_capped_not_rejected() -> None:
    validator = RecordValidator()
    storage = LocalStorage(validator=validator)
    record = Record(owned_key(ALICE), None, val(1), 1e300).sign(ALICE)
    assert validator.is_capped(record, NOW)
    assert storage.store(record, NOW)
    # The signed expiration is kept (the signature covers it) ...
    stored = storage.get(record.key, NOW + 1)
    assert stored is not None and stored.plain == record
    # ... but the record stops being served after max_ttl (+ skew).
    cap = NOW + DEFAULT_MAX_TTL + validator.clock_skew
    assert validator.effective_expiration(record, NOW) == cap
    assert storage.get(record.key, cap - 1) is not None
    assert storage.get(record.key, cap) is None
    assert len(storage) == 0


def test_later_expiration_replaces_and_replay_of_older_is_refused() -> None:
    storage = LocalStorage()
    key = owned_key(ALICE)
    old = Record(key, None, val("v1"), NOW + 60).sign(ALICE)
    new = Record(key, None, val("v2"), NOW + 120).sign(ALICE)
    assert storage.store(old, NOW)
    assert storage.store(new, NOW + 1)
    assert storage.get(key, NOW + 2).plain == new  # type: ignore[union-attr]
    # A replay of the older, validly signed record is refused, and so is a duplicate.
    assert not storage.store(old, NOW + 3)
    assert not storage.store(new, NOW + 3)
    assert storage.get(key, NOW + 3).plain == new  # type: ignore[union-attr]
    # Same for a subkey.
    sub_old = Record("peers", owner_marker(BOB.peer_id), val(1), NOW + 60).sign(BOB)
    sub_new = Record("peers", owner_marker(BOB.peer_id), val(2), NOW + 90).sign(BOB)
    assert storage.store(sub_new, NOW)
    assert not storage.store(sub_old, NOW)
    assert storage.stats()["refused"] == 3


@pytest.mark.parametrize("skew", [-5.0, 5.0])
def test_writers_with_skewed_clocks_work(skew: float) -> None:
    """A writer whose clock is `skew` seconds off ours: expiration = its_now + ttl."""
    validator = RecordValidator()
    storage = LocalStorage(validator=validator)
    writer_now = NOW + skew
    record = Record(owned_key(ALICE), "s", val(1), writer_now + TTL).sign(ALICE)
    assert storage.store(record, NOW)
    assert storage.get(record.key, NOW + TTL + skew - 0.5) is not None
    assert storage.get(record.key, NOW + TTL + skew) is None
    # Even a writer using the maximal TTL with its clock ahead is not capped.
    longest = Record("k", None, val(1), writer_now + DEFAULT_MAX_TTL)
    assert not validator.is_capped(longest, NOW)
    assert validator.effective_expiration(longest, NOW) == longest.expiration


def test_skewed_writers_of_one_key_are_ordered_by_expiration_not_arrival() -> None:
    storage = LocalStorage()
    # Writer A is 5 s behind and writes later in real time; writer B is 5 s ahead
    # and wrote earlier. The later expiration wins, whatever arrives first.
    early_but_ahead = Record("k", None, val("B"), (NOW + 5) + TTL)
    late_but_behind = Record("k", None, val("A"), (NOW + 3 - 5) + TTL)
    assert storage.store(early_but_ahead, NOW)
    assert not storage.store(late_but_behind, NOW + 3)
    assert storage.get("k", NOW + 4).plain == early_but_ahead  # type: ignore[union-attr]


# ---------------------------------------------------------------- plain values and dictionaries


def test_plain_value_cannot_wipe_a_live_dictionary() -> None:
    storage = LocalStorage()
    sub = Record("peers", owner_marker(ALICE.peer_id), val(1), NOW + 60).sign(ALICE)
    assert storage.store(sub, NOW)
    assert not storage.store(Record("peers", None, val("wipe"), NOW + 1000), NOW)
    value = storage.get("peers", NOW)
    assert value is not None and value.is_dictionary and list(value.subkeys) == [sub.subkey]


def test_subkey_replaces_plain_value_only_if_later() -> None:
    storage = LocalStorage()
    plain = Record("k", None, val("plain"), NOW + 60)
    assert storage.store(plain, NOW)
    assert not storage.store(Record("k", "s", val(1), NOW + 30), NOW)
    assert storage.store(Record("k", "s", val(1), NOW + 90), NOW)
    value = storage.get("k", NOW)
    assert value is not None and value.is_dictionary and set(value.subkeys) == {"s"}
    assert len(storage) == 1


def test_dictionary_merge_across_three_replicas() -> None:
    def dict_value(*records: Record) -> StoredValue:
        return StoredValue("k", subkeys={r.subkey: r for r in records})  # type: ignore[misc]

    a1 = Record("k", "a", val("a1"), NOW + 10)
    a2 = Record("k", "a", val("a2"), NOW + 20)
    b = Record("k", "b", val("b"), NOW + 30)
    c_dead = Record("k", "c", val("c"), NOW - 1)  # expired by the time we read
    d = Record("k", "d", val("d"), NOW + 5)
    replicas = [dict_value(a1, b), dict_value(a2, c_dead), dict_value(d, a1), None]
    merged = merge(replicas, NOW)
    assert merged is not None and merged.is_dictionary
    assert dict(merged.subkeys) == {"a": a2, "b": b, "d": d}
    assert merged.expiration == NOW + 30
    # Same answer in any order: ties and orders cannot split readers.
    shuffled = replicas[:]
    random.Random(0).shuffle(shuffled)
    assert merge(shuffled, NOW) == merged
    assert merge([None, None], NOW) is None


def test_plain_merge_latest_wins_and_dictionary_beats_plain() -> None:
    p1 = StoredValue("k", plain=Record("k", None, val(1), NOW + 10))
    p2 = StoredValue("k", plain=Record("k", None, val(2), NOW + 20))
    assert merge([p1, p2], NOW) == p2
    assert merge([p2, p1], NOW) == p2
    d = StoredValue("k", subkeys={"s": Record("k", "s", val(3), NOW + 5)})
    assert merge([p2, d], NOW) == d
    with pytest.raises(ValueError):
        merge([p1, StoredValue("other", plain=Record("other", None, val(1), NOW + 1))], NOW)


def test_fifty_owners_share_a_key_and_forgeries_are_dropped() -> None:
    validator = RecordValidator()
    owners = [ident(100 + i) for i in range(50)]
    replicas = [LocalStorage(validator=validator) for _ in range(3)]
    for i, owner in enumerate(owners):
        record = Record("swarm", owner_marker(owner.peer_id), val(i), NOW + 60 + i).sign(owner)
        assert replicas[i % 3].store(record, NOW)
    # Mallory writes a subkey in Alice's name; every node refuses it ...
    forged = Record("swarm", owner_marker(ALICE.peer_id), val("evil"), NOW + 99).sign(MALLORY)
    for storage in replicas:
        with pytest.raises(RecordError):
            storage.store(forged, NOW)
    # ... and a malicious replica that serves it anyway is filtered at merge.
    evil_replica = StoredValue("swarm", subkeys={forged.subkey: forged})  # type: ignore[dict-item]
    merged = merge([*(r.get("swarm", NOW) for r in replicas), evil_replica], NOW, validator)
    assert merged is not None
    assert set(merged.subkeys) == {owner_marker(o.peer_id) for o in owners}
    assert owner_marker(ALICE.peer_id) not in merged.subkeys
    for i, owner in enumerate(owners):
        assert msgpack.unpackb(merged.subkeys[owner_marker(owner.peer_id)].value) == i


# ---------------------------------------------------------------- per-prefix validators


def test_per_prefix_validators_run_and_can_reject() -> None:
    validator = RecordValidator()
    seen: list[tuple[str, str]] = []

    def must_be_int(record: Record) -> None:
        seen.append(("int", record.key))
        if not isinstance(msgpack.unpackb(record.value), int):
            raise RecordError("not an int")

    def must_be_dict(record: Record) -> None:
        seen.append(("dict", record.key))
        if record.subkey is None:
            raise RecordError("must be a dictionary")

    def buggy(record: Record) -> None:
        raise KeyError("bug")

    validator.register("count/", must_be_int)
    validator.register("count/peers", must_be_dict)
    validator.register("buggy/", buggy)
    validator.validate(Record("count/x", None, val(3), NOW + 1), NOW)
    with pytest.raises(RecordError, match="not an int"):
        validator.validate(Record("count/x", None, val("three"), NOW + 1), NOW)
    # Every matching prefix runs, shortest first: a narrower one cannot bypass a broader one.
    seen.clear()
    validator.validate(Record("count/peers", "p", val(1), NOW + 1), NOW)
    assert seen == [("int", "count/peers"), ("dict", "count/peers")]
    with pytest.raises(RecordError, match="must be a dictionary"):
        validator.validate(Record("count/peers", None, val(1), NOW + 1), NOW)
    # Unrelated keys are not checked; a crashing validator rejects instead of crashing.
    validator.validate(Record("other", None, val("x"), NOW + 1), NOW)
    with pytest.raises(RecordError, match="KeyError"):
        validator.validate(Record("buggy/x", None, val(1), NOW + 1), NOW)


# ---------------------------------------------------------------- storage bounds


def test_entry_bound_evicts_soonest_expiring_first() -> None:
    storage = LocalStorage(max_entries=10)
    expirations = [NOW + 10 + i for i in range(30)]
    random.Random(1).shuffle(expirations)
    for i, expiration in enumerate(expirations):
        storage.store(Record(f"k{i}", None, val(i), expiration), NOW)
        assert len(storage) <= 10
    kept = sorted(
        v.expiration for v in storage.get_many([f"k{i}" for i in range(30)], NOW).values()
    )
    assert kept == [NOW + 10 + i for i in range(20, 30)]
    assert storage.stats()["evicted"] == 20
    # A record that would be the first evicted is not stored at all.
    assert not storage.store(Record("early", None, val(1), NOW + 1), NOW)
    assert storage.get("early", NOW) is None


def test_byte_bound_is_never_exceeded() -> None:
    limit = 20_000
    storage = LocalStorage(max_bytes=limit)
    rng = random.Random(2)
    for i in range(300):
        size = rng.randrange(0, 4000)
        subkey = None if i % 2 else f"s{i}"
        storage.store(Record(f"k{i % 40}", subkey, b"x" * size, NOW + rng.uniform(1, 1000)), NOW)
        stats = storage.stats()
        assert stats["bytes"] <= limit
        assert stats["bytes"] == sum(
            r.nbytes + RECORD_OVERHEAD_BYTES for v in storage.values(NOW) for r in v.records()
        )
    # A record larger than the whole budget is refused without evicting anything.
    before = storage.stats()
    assert not storage.store(Record("big", None, b"x" * limit, NOW + 10_000), NOW)
    after = storage.stats()
    assert (after["entries"], after["evicted"]) == (before["entries"], before["evicted"])


def test_expired_records_are_purged_and_never_returned() -> None:
    storage = LocalStorage()
    storage.store(Record("k", "a", val(1), NOW + 10), NOW)
    storage.store(Record("k", "b", val(2), NOW + 20), NOW)
    value = storage.get("k", NOW + 15)
    assert value is not None and set(value.subkeys) == {"b"}
    assert storage.get_many(["k", "missing"], NOW + 15).keys() == {"k"}
    assert storage.purge(NOW + 25) == 1
    assert len(storage) == 0 and storage.nbytes == 0
    assert storage.stats()["expired"] == 2


def test_heap_stays_bounded_under_repeated_replacement() -> None:
    storage = LocalStorage()
    for i in range(5000):
        assert storage.store(Record("k", None, val(i), NOW + 100 + i), NOW)
    assert len(storage) == 1
    assert len(storage._heap) <= 2 * len(storage) + 1024


# ---------------------------------------------------------------- hostile wire input

_wire_atoms = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=80)
)
_wire_objects = st.recursive(_wire_atoms, lambda inner: st.lists(inner, max_size=6), max_leaves=20)
_record_like = st.tuples(
    st.one_of(st.text(max_size=20), _wire_atoms, st.just("x" * (MAX_NAME_BYTES + 1))),
    st.one_of(st.none(), st.text(max_size=20), _wire_atoms),
    st.one_of(st.binary(max_size=40), _wire_atoms),
    st.one_of(st.floats(), st.integers(), _wire_atoms),
    st.one_of(st.none(), st.binary(min_size=64, max_size=64), _wire_atoms),
).map(list)


@settings(max_examples=300, deadline=None)
@given(obj=st.one_of(_wire_objects, _record_like))
def test_from_wire_raises_only_record_error(obj: object) -> None:
    validator = RecordValidator()
    storage = LocalStorage(max_entries=5)
    try:
        record = Record.from_wire(obj)
    except RecordError:
        return
    assert math.isfinite(record.expiration)
    assert Record.from_wire(record.to_wire()) == record
    try:
        validator.validate(record, NOW)
        storage.store(record, NOW)
    except RecordError:
        pass


@pytest.mark.parametrize(
    "obj",
    [
        None,
        b"bytes",
        [],
        ["k", None, b"", NOW],
        ["k", None, b"", NOW, None, "extra"],
        ["", None, b"", NOW, None],
        ["k", "", b"", NOW, None],
        ["k" * (MAX_NAME_BYTES + 1), None, b"", NOW, None],
        ["k", None, "not bytes", NOW, None],
        ["k", None, b"", "soon", None],
        ["k", None, b"", True, None],
        ["k", None, b"", math.nan, None],
        ["k", None, b"", math.inf, None],
        ["k", None, b"", 10**400, None],
        ["k", None, b"", NOW, b"short"],
        ["k", None, b"", NOW, "sig"],
        ["\ud800", None, b"", NOW, None],
    ],
)
def test_from_wire_rejects_malformed(obj: object) -> None:
    with pytest.raises(RecordError):
        Record.from_wire(obj)
