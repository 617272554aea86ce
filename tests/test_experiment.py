"""Experiment manifests: signed, strictly decoded, and guarded by every DHT node.

The first half checks `Manifest` and `parse_experiment_ref` alone; the second
runs a small DHT swarm on loopback where every node registers the manifest
validator, as the daemon does, and an attacker sends forged records with raw
store requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.dht.node import DHTNode
from shoal.dht.records import Record, owner_marker
from shoal.peer import session
from shoal.peer.experiment import (
    EXPERIMENT_PREFIX,
    MANIFEST_FORMAT,
    MAX_MANIFEST_BYTES,
    ExperimentRef,
    Manifest,
    ManifestError,
    find_manifest,
    manifest_key,
    parse_experiment_ref,
    publish_manifest,
    register_manifest_validator,
    stages_fingerprint,
)
from shoal.transport import rpc
from shoal.transport.identity import Identity, PeerID

# Many peers on one IP: lift the per-IP connection limit meant for the internet.
HOST_OPTS = {"max_connections_per_ip": 1000, "max_connections": 1000, "close_grace": 0.1}


def make_manifest(identity: Identity, name: str = "shakespeare", **changes: Any) -> Manifest:
    fields: dict[str, Any] = {
        "name": name,
        "task": "bytegpt",
        "task_config": {"d_model": 32, "n_layers": 1, "data": "stdlib"},
        "strategy": "diloco",
        "strategy_options": {"inner_steps": 10, "outer_lr": 0.7, "codec": "bf16"},
        "hyperparameters": {"inner_lr": 0.001, "num_shards": 64},
        "seed": 1234,
        "initial_fingerprint": "ab" * 16,
        "created": 1_700_000_000.5,
    }
    fields.update(changes)
    return Manifest.create(identity, **fields)


def unpacked(manifest: Manifest) -> dict[str, Any]:
    """The wire form as a dict, to alter and re-encode."""
    return msgpack.unpackb(manifest.to_bytes(), raw=False)  # type: ignore[no-any-return]


def repacked(outer: dict[str, Any]) -> bytes:
    return msgpack.packb(outer, use_bin_type=True)  # type: ignore[no-any-return]


def forged_for(victim: PeerID, signer: Identity, name: str = "shakespeare") -> Manifest:
    """A manifest that names `victim` as its host but carries `signer`'s signature."""
    claimed = dataclasses.replace(make_manifest(signer, name), host=victim)
    return dataclasses.replace(claimed, signature=signer.sign(claimed._signing_payload()))


@pytest.fixture(scope="module")
def host_identity() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def manifest(host_identity: Identity) -> Manifest:
    return make_manifest(host_identity)


# --- the manifest on its own ---------------------------------------------------------------


def test_create_signs_and_the_bytes_round_trip(host_identity: Identity, manifest: Manifest) -> None:
    assert manifest.host == host_identity.peer_id
    assert manifest.format == 1  # a built-in task: the format every shoal reads
    data = manifest.to_bytes()
    again = Manifest.from_bytes(data)
    assert again == manifest
    assert again.signature == manifest.signature
    assert again.to_bytes() == data
    assert again.experiment_id == manifest.experiment_id
    assert len(manifest.experiment_id) == 16
    assert manifest.ref == ExperimentRef("shakespeare", host_identity.peer_id)
    assert str(manifest.ref) == f"shakespeare@{host_identity.peer_id}"
    assert manifest.experiment_id in manifest.describe()


def test_the_signed_bytes_do_not_depend_on_dict_order(host_identity: Identity) -> None:
    a = make_manifest(host_identity, task_config={"a": 1, "b": {"y": 2, "x": 3}})
    b = make_manifest(host_identity, task_config={"b": {"x": 3, "y": 2}, "a": 1})
    assert a.to_bytes() == b.to_bytes()
    assert a.experiment_id == b.experiment_id


def test_two_experiments_with_the_same_name_have_different_ids(host_identity: Identity) -> None:
    other_host = make_manifest(Identity.generate())
    later = make_manifest(host_identity, created=1_800_000_000.0)
    ids = {m.experiment_id for m in (make_manifest(host_identity), other_host, later)}
    assert len(ids) == 3


def test_an_invalid_name_is_refused_at_creation(host_identity: Identity) -> None:
    for bad in ("", "-starts-with-dash", "has space", "a/b", "x" * 65, "naïve", "a@b"):
        with pytest.raises(ManifestError, match="invalid experiment name"):
            make_manifest(host_identity, name=bad)


def test_an_unencodable_configuration_is_refused_at_creation(host_identity: Identity) -> None:
    with pytest.raises(ManifestError, match="cannot be encoded"):
        make_manifest(host_identity, task_config={"when": object()})


def test_an_oversized_configuration_is_refused_at_creation(host_identity: Identity) -> None:
    with pytest.raises(ManifestError, match=f"limit {MAX_MANIFEST_BYTES}"):
        make_manifest(host_identity, task_config={"blob": "x" * MAX_MANIFEST_BYTES})


# --- from_bytes refuses what is not a genuine manifest ---------------------------------------


def test_an_altered_body_is_a_forgery(manifest: Manifest) -> None:
    outer = unpacked(manifest)
    outer["body"]["strategy_options"]["outer_lr"] = 7.0
    with pytest.raises(ManifestError, match="forged manifest for experiment 'shakespeare'"):
        Manifest.from_bytes(repacked(outer))


def test_a_signature_by_another_key_is_a_forgery(manifest: Manifest) -> None:
    forged = forged_for(manifest.host, Identity.generate())
    with pytest.raises(ManifestError, match=f"not {manifest.host.short()}'s"):
        Manifest.from_bytes(forged.to_bytes())


def test_a_damaged_signature_is_a_forgery(manifest: Manifest) -> None:
    outer = unpacked(manifest)
    outer["signature"] = bytes([outer["signature"][0] ^ 1]) + outer["signature"][1:]
    with pytest.raises(ManifestError, match="forged"):
        Manifest.from_bytes(repacked(outer))
    outer["signature"] = b"short"
    with pytest.raises(ManifestError, match="forged"):
        Manifest.from_bytes(repacked(outer))


@pytest.mark.parametrize("version", [0, MANIFEST_FORMAT + 1, 99, "1", None, True])
def test_another_format_version_is_refused_with_advice(manifest: Manifest, version: Any) -> None:
    outer = unpacked(manifest)
    outer["body"]["format"] = version
    with pytest.raises(ManifestError, match=f"format {version!r} is not supported.*upgrade"):
        Manifest.from_bytes(repacked(outer))


# --- the digest of a custom task's code (format 2) ------------------------------------------

DIGEST = "0123456789abcdef" * 4


def test_a_custom_task_is_written_in_format_2_with_its_code_digest(
    host_identity: Identity,
) -> None:
    custom = make_manifest(host_identity, task="mytask:make_task", task_digest=DIGEST)
    assert custom.format == 2
    assert unpacked(custom)["body"]["task_digest"] == DIGEST
    again = Manifest.from_bytes(custom.to_bytes())
    assert again == custom
    assert again.task_digest == DIGEST


def test_the_code_digest_is_signed(host_identity: Identity) -> None:
    outer = unpacked(make_manifest(host_identity, task="mytask:make_task", task_digest=DIGEST))
    outer["body"]["task_digest"] = "f" * 64
    with pytest.raises(ManifestError, match="forged"):
        Manifest.from_bytes(repacked(outer))


def test_a_format_1_manifest_of_a_custom_task_stays_readable_without_a_digest(
    host_identity: Identity,
) -> None:
    # (an older shoal's: the joiner then refuses to run it, see test_task_code)
    old = make_manifest(host_identity, task="mytask:make_task")
    assert old.format == 1
    assert "task_digest" not in unpacked(old)["body"]
    assert Manifest.from_bytes(old.to_bytes()).task_digest == ""


@pytest.mark.parametrize(
    ("task", "digest", "problem"),
    [
        ("bytegpt", DIGEST, "built-in task 'bytegpt' with a code digest"),
        ("mytask:make_task", "", "has no valid code digest"),
        ("mytask:make_task", "ABC", "has no valid code digest"),
        ("mytask:make_task", DIGEST.upper(), "has no valid code digest"),
    ],
)
def test_a_format_2_body_with_a_bad_code_digest_is_refused(
    host_identity: Identity, task: str, digest: str, problem: str
) -> None:
    outer = unpacked(make_manifest(host_identity, task="mytask:make_task", task_digest=DIGEST))
    outer["body"]["task"], outer["body"]["task_digest"] = task, digest
    with pytest.raises(ManifestError, match=problem):
        Manifest.from_bytes(repacked(outer))
    with pytest.raises(ManifestError, match=problem):
        make_manifest(host_identity, task=task, task_digest=digest or "x")


def test_a_format_2_body_without_the_digest_field_is_refused(host_identity: Identity) -> None:
    outer = unpacked(make_manifest(host_identity, task="mytask:make_task", task_digest=DIGEST))
    del outer["body"]["task_digest"]
    with pytest.raises(ManifestError, match=r"fields \['task_digest'\] differ"):
        Manifest.from_bytes(repacked(outer))


# --- a pipeline's stage fingerprints (format 3) ---------------------------------------------

STAGES = ["0a" * 32, "1b" * 32, "2c" * 32]


def pipeline_manifest(identity: Identity, **changes: Any) -> Manifest:
    fields: dict[str, Any] = {
        "strategy": "pipeline",
        "strategy_options": {"stages": 3},
        "initial_fingerprint": stages_fingerprint(STAGES),
        "stage_fingerprints": STAGES,
    }
    return make_manifest(identity, **{**fields, **changes})


def test_a_pipeline_is_written_in_format_3_with_one_fingerprint_per_stage(
    host_identity: Identity,
) -> None:
    """Its initial fingerprint derives from its stages' (in order); an older shoal, which
    would build the stages otherwise, refuses format 3."""
    piped = pipeline_manifest(host_identity)
    assert piped.format == MANIFEST_FORMAT == 3
    assert unpacked(piped)["body"]["stage_fingerprints"] == STAGES
    again = Manifest.from_bytes(piped.to_bytes())
    assert again == piped and again.stage_fingerprints == tuple(STAGES)
    assert stages_fingerprint(STAGES) != stages_fingerprint(STAGES[::-1])
    assert make_manifest(host_identity).format == 1  # (other experiments as before)


@pytest.mark.parametrize(
    ("stages", "problem"),
    [
        (STAGES[:1], "must be 2 to 64 fingerprints"),
        (STAGES * 22, "must be 2 to 64 fingerprints"),
        ([*STAGES[:2], "XY" * 32], "must be 2 to 64 fingerprints"),
        ([*STAGES[:2], 7], "must be 2 to 64 fingerprints"),
        (STAGES[::-1], "initial_fingerprint is not its stage_fingerprints'"),
    ],
)
def test_stage_fingerprints_that_do_not_make_the_initial_one_are_refused(
    host_identity: Identity, stages: list[Any], problem: str
) -> None:
    outer = unpacked(pipeline_manifest(host_identity))
    outer["body"]["stage_fingerprints"] = stages
    with pytest.raises(ManifestError, match=problem):
        Manifest.from_bytes(repacked(outer))
    with pytest.raises(ManifestError, match=problem):
        pipeline_manifest(host_identity, stage_fingerprints=stages)


def test_a_format_3_body_without_stage_fingerprints_is_refused(host_identity: Identity) -> None:
    outer = unpacked(pipeline_manifest(host_identity))
    del outer["body"]["stage_fingerprints"]
    with pytest.raises(ManifestError, match=r"fields \['stage_fingerprints'\] differ"):
        Manifest.from_bytes(repacked(outer))
    outer = unpacked(pipeline_manifest(host_identity))
    outer["body"]["stage_fingerprints"] = "0a" * 32
    with pytest.raises(ManifestError, match="stage_fingerprints is not a list"):
        Manifest.from_bytes(repacked(outer))


def test_a_missing_field_is_refused(manifest: Manifest) -> None:
    outer = unpacked(manifest)
    del outer["body"]["seed"]
    with pytest.raises(ManifestError, match=r"fields \['seed'\] differ"):
        Manifest.from_bytes(repacked(outer))


def test_an_extra_field_is_refused(manifest: Manifest) -> None:
    outer = unpacked(manifest)
    outer["body"]["admin"] = True
    with pytest.raises(ManifestError, match=r"fields \['admin'\] differ"):
        Manifest.from_bytes(repacked(outer))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", "1234"),
        ("seed", True),
        ("seed", 12.5),
        ("name", 5),
        ("task", None),
        ("task_config", [1, 2]),
        ("strategy_options", "outer_lr=1"),
        ("hyperparameters", None),
        ("initial_fingerprint", b"ab"),
        ("host", 7),
        ("created", "yesterday"),
        ("created", False),
    ],
)
def test_a_field_of_the_wrong_type_is_refused(manifest: Manifest, field: str, value: Any) -> None:
    outer = unpacked(manifest)
    outer["body"][field] = value
    with pytest.raises(ManifestError, match=f"malformed manifest: {field} is not a"):
        Manifest.from_bytes(repacked(outer))


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("created", float("nan"), "created is not finite"),
        ("created", float("inf"), "created is not finite"),
        ("host", "12D3KooWnotapeerid", "host is not a peer ID"),
        ("name", "bad name", "invalid experiment name"),
    ],
)
def test_a_field_with_an_impossible_value_is_refused(
    manifest: Manifest, field: str, value: Any, problem: str
) -> None:
    outer = unpacked(manifest)
    outer["body"][field] = value
    with pytest.raises(ManifestError, match=problem):
        Manifest.from_bytes(repacked(outer))


def test_an_oversized_manifest_is_refused_before_decoding() -> None:
    with pytest.raises(ManifestError, match="too large"):
        Manifest.from_bytes(b"\x80" * (MAX_MANIFEST_BYTES + 1))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"body": {}}),
        msgpack.packb({"body": [], "signature": b"x" * 64}),
        msgpack.packb({"body": {}, "signature": "not bytes"}),
        msgpack.packb({1: 2}),
        "a str, not bytes",
    ],
    ids=["empty", "garbage", "list", "no-signature", "body-list", "str-sig", "int-keys", "str"],
)
def test_what_is_not_a_manifest_is_refused(data: Any) -> None:
    with pytest.raises(ManifestError, match="manifest"):
        Manifest.from_bytes(data)


def test_a_configuration_nested_too_deeply_is_refused(manifest: Manifest) -> None:
    outer = unpacked(manifest)
    body = msgpack.packb({**outer["body"], "task_config": {"k": 0}}, use_bin_type=True)
    deep = b"\x81\xa1k" + b"\x91" * 600 + b"\x00"  # {"k": [[[...[0]...]]]}, 600 deep
    body = body.replace(msgpack.packb({"k": 0}), deep)
    data = b"\x82\xa4body" + body + b"\xa9signature" + msgpack.packb(outer["signature"])
    with pytest.raises(ManifestError):
        Manifest.from_bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_manifest_is_refused_or_means_exactly_the_same(
    manifest: Manifest, data: st.DataObject
) -> None:
    wire = bytearray(manifest.to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] = data.draw(st.integers(0, 255))
    try:
        decoded = Manifest.from_bytes(bytes(wire))
    except ManifestError:
        return
    assert decoded == manifest and decoded.signature == manifest.signature


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=2048))
def test_random_bytes_only_ever_raise_manifest_error(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_bytes(data)


# --- NAME and NAME@PEERID --------------------------------------------------------------------


def test_a_bare_name_is_a_ref_without_host() -> None:
    assert parse_experiment_ref("shakespeare") == ExperimentRef("shakespeare")
    assert parse_experiment_ref("  v1.2_run-3 ") == ExperimentRef("v1.2_run-3")
    assert str(ExperimentRef("x")) == "x"


def test_name_at_peer_id_names_the_host() -> None:
    peer = Identity.generate().peer_id
    ref = parse_experiment_ref(f"shakespeare@{peer}")
    assert ref == ExperimentRef("shakespeare", peer)
    assert str(ref) == f"shakespeare@{peer}"
    assert parse_experiment_ref(str(ref)) == ref


@pytest.mark.parametrize("text", ["", "@x", "-x", "two words", "a/b", "x" * 65, "naïve"])
def test_a_bad_name_is_refused(text: str) -> None:
    with pytest.raises(ManifestError, match="invalid experiment name"):
        parse_experiment_ref(text)


@pytest.mark.parametrize(
    "host", ["", "12D3KooW", "notbase58!", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "a@b"]
)
def test_a_bad_host_id_is_refused(host: str) -> None:
    with pytest.raises(ManifestError, match="invalid host peer ID"):
        parse_experiment_ref(f"shakespeare@{host}")


def test_manifest_key_checks_the_name() -> None:
    assert manifest_key("shakespeare") == EXPERIMENT_PREFIX + "shakespeare"
    with pytest.raises(ManifestError):
        manifest_key("../other")


# --- over a DHT swarm on loopback ----------------------------------------------------------


@pytest.fixture
async def swarm(
    make_host: Callable[..., Any],
) -> AsyncIterator[Callable[..., Any]]:
    """Factory of DHT nodes that validate manifests like the daemon: swarm(n) -> new nodes,
    each joined through the first node of the swarm."""
    nodes: list[DHTNode] = []

    async def make(n: int) -> list[DHTNode]:
        out = []
        for _ in range(n):
            host = await make_host(**HOST_OPTS)
            boot = [str(nodes[0].host.addresses()[0])] if nodes else []
            node = await DHTNode.create(host, bootstrap=boot, hop_timeout=0.5)
            register_manifest_validator(node.validator)
            nodes.append(node)
            out.append(node)
        return out

    yield make
    await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)


def identity_of(node: DHTNode) -> Identity:
    return node.host.identity


async def raw_store(sender: DHTNode, target: DHTNode, records: list[Record]) -> list[bool]:
    """A store request sent as-is, bypassing the sender's own validation (an attacker)."""
    await sender.host.connect(target.peer_id, target.host.addresses(), timeout=5)
    reply = await rpc.call(
        sender.host,
        target.peer_id,
        sender.protocol,
        "store",
        {
            "from": [str(a) for a in sender.host.addresses()],
            "records": [r.to_wire() for r in records],
        },
        timeout=5,
    )
    return reply["stored"]  # type: ignore[no-any-return]


def manifest_record(manifest: Manifest, subkey: str | None, *, key: str | None = None) -> Record:
    key = key if key is not None else manifest_key(manifest.name)
    value = msgpack.packb(manifest.to_bytes(), use_bin_type=True)
    return Record(key, subkey, value, time.time() + 600)


async def test_a_published_manifest_is_found_from_another_node(swarm: Callable[..., Any]) -> None:
    nodes = await swarm(5)
    host = nodes[1]
    manifest = make_manifest(identity_of(host))
    assert await publish_manifest(host, manifest)
    for reader in (nodes[0], nodes[4]):
        found = await find_manifest(reader, ExperimentRef("shakespeare"), timeout=5)
        assert found == manifest and found.experiment_id == manifest.experiment_id
        by_host = await find_manifest(reader, manifest.ref, timeout=5)
        assert by_host == manifest


async def test_forged_records_are_refused_by_every_node_and_never_found(
    swarm: Callable[..., Any],
) -> None:
    nodes = await swarm(5)
    (attacker,) = await swarm(1)  # a member of the network, but not among the honest five
    host = nodes[1]
    genuine = make_manifest(identity_of(host))
    victim = host.peer_id.to_base58()
    altered = unpacked(genuine)
    altered["body"]["task"] = "evil:factory"
    other_experiment = make_manifest(identity_of(host), name="other")
    attackers_own = make_manifest(identity_of(attacker))
    garbage = Record(manifest_key("shakespeare"), victim, b"\xc1 not msgpack", time.time() + 600)
    owned = manifest_record(attackers_own, owner_marker(attacker.peer_id))
    forged = {
        "signed by another key": manifest_record(
            forged_for(host.peer_id, identity_of(attacker)), victim
        ),
        "host's manifest under the attacker's subkey": manifest_record(
            genuine, attacker.peer_id.to_base58()
        ),
        "altered body": Record(
            manifest_key("shakespeare"),
            victim,
            msgpack.packb(repacked(altered)),
            time.time() + 600,
        ),
        "garbage": garbage,
        "manifest of another experiment": manifest_record(
            other_experiment, victim, key=manifest_key("shakespeare")
        ),
        "no subkey": manifest_record(genuine, None),
        "owner-marked subkey": owned.sign(identity_of(attacker)),
        "subkey not a peer ID": manifest_record(genuine, "host"),
    }
    records = list(forged.values())
    for target in nodes:
        stored = await raw_store(attacker, target, records)
        refused = [name for name, ok in zip(forged, stored, strict=True) if not ok]
        assert refused == list(forged), f"{target.peer_id.short()} stored some forgeries"

    # Nothing genuine published yet: the name is unknown everywhere.
    for reader in nodes:
        with pytest.raises(ManifestError, match="unknown experiment 'shakespeare'"):
            await find_manifest(reader, ExperimentRef("shakespeare"), timeout=0.3)

    # Once the host publishes, every node finds exactly its manifest, forged again or not.
    assert await publish_manifest(host, genuine)
    for target in nodes:
        assert await raw_store(attacker, target, records) == [False] * len(records)
    for reader in nodes:
        found = await find_manifest(reader, ExperimentRef("shakespeare"), timeout=5)
        assert found == genuine and found.signature == genuine.signature
        raw = await reader.get(manifest_key("shakespeare"), latest=True)
        assert raw is not None and list(raw.value) == [victim]


async def test_the_same_name_from_two_hosts_needs_name_at_peer_id(
    swarm: Callable[..., Any],
) -> None:
    nodes = await swarm(5)
    first, second = nodes[1], nodes[2]
    a = make_manifest(identity_of(first), "dup")
    b = make_manifest(identity_of(second), "dup", task_config={"d_model": 64})
    assert await publish_manifest(first, a)
    assert await publish_manifest(second, b)
    reader = nodes[4]
    with pytest.raises(ManifestError) as caught:
        await find_manifest(reader, ExperimentRef("dup"), timeout=5)
    message = str(caught.value)
    assert "several peers host an experiment named 'dup'" in message
    assert f"dup@{first.peer_id}" in message and f"dup@{second.peer_id}" in message
    assert "--join NAME@PEERID" in message
    assert await find_manifest(reader, parse_experiment_ref(f"dup@{first.peer_id}")) == a
    assert await find_manifest(reader, parse_experiment_ref(f"dup@{second.peer_id}")) == b


async def test_an_unknown_experiment_fails_quickly_with_advice(swarm: Callable[..., Any]) -> None:
    nodes = await swarm(5)
    nobody = Identity.generate().peer_id
    started = time.monotonic()
    with pytest.raises(ManifestError) as caught:
        await find_manifest(nodes[2], ExperimentRef("nope"), timeout=0.5, retry_every=0.1)
    assert time.monotonic() - started < 3
    message = str(caught.value)
    assert "unknown experiment 'nope'" in message
    assert "--bootstrap" in message and "--host-experiment nope" in message
    with pytest.raises(ManifestError, match=f"hosted by {nobody.short()}"):
        await find_manifest(nodes[2], ExperimentRef("nope", nobody), timeout=0.2)


async def test_a_known_name_with_another_host_is_unknown(swarm: Callable[..., Any]) -> None:
    nodes = await swarm(3)
    assert await publish_manifest(nodes[1], make_manifest(identity_of(nodes[1])))
    elsewhere = ExperimentRef("shakespeare", nodes[2].peer_id)
    with pytest.raises(ManifestError, match="unknown experiment"):
        await find_manifest(nodes[0], elsewhere, timeout=0.3)


async def test_a_participant_keeps_the_manifest_alive_after_the_host_left(
    swarm: Callable[..., Any],
) -> None:
    nodes = await swarm(5)
    host, participant, reader = nodes[1], nodes[2], nodes[4]
    manifest = make_manifest(identity_of(host))
    assert await publish_manifest(host, manifest)
    first = await reader.get(manifest_key("shakespeare"), latest=True)
    assert first is not None and first.subkeys is not None
    first_expiration = first.subkeys[host.peer_id.to_base58()][1]

    await host.aclose()
    await host.host.aclose()
    await asyncio.sleep(0.01)  # the wall clock moves on: a refresh expires later
    assert await publish_manifest(participant, manifest)  # not the host: still accepted

    refreshed = await reader.get(manifest_key("shakespeare"), latest=True)
    assert refreshed is not None and refreshed.subkeys is not None
    assert refreshed.subkeys[host.peer_id.to_base58()][1] > first_expiration
    found = await find_manifest(reader, ExperimentRef("shakespeare"), timeout=5)
    assert found == manifest and found.signature == manifest.signature
    assert found.host == host.peer_id  # still the host's, though the host is gone


async def test_a_peer_that_joined_before_goes_on_with_the_kept_manifest(
    swarm: Callable[..., Any], make_host: Callable[..., Any], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`--join` keeps the manifest it found; restarted where no peer publishes it (the
    host down, a partition), the peer goes on with it instead of exiting. A name it
    never joined is still unknown, and a kept manifest is never taken for another host."""
    nodes = await swarm(3)
    genuine = make_manifest(identity_of(nodes[1]), "kept")
    assert await publish_manifest(nodes[1], genuine)
    config = SimpleNamespace(data_dir=tmp_path)
    assert await session._find(config, nodes[2], f"kept@{nodes[1].peer_id}") == genuine  # type: ignore[arg-type]
    monkeypatch.setattr(session, "FIND_MANIFEST_TIMEOUT", 0.3)
    alone = await DHTNode.create(await make_host(**HOST_OPTS), hop_timeout=0.5)
    try:
        assert await session._find(config, alone, f"kept@{nodes[1].peer_id}") == genuine  # type: ignore[arg-type]
        with pytest.raises(session.SessionError, match="unknown experiment 'kept'"):
            await session._find(config, alone, "kept")  # type: ignore[arg-type]
        other = Identity.generate().peer_id
        with pytest.raises(session.SessionError, match="unknown experiment"):
            await session._find(config, alone, f"kept@{other}")  # type: ignore[arg-type]
    finally:
        await alone.aclose()
