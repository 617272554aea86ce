"""Reading a key again, cheaply (dht/replica_reads.py). Delta reads: a node asks each
replica only for what that replica stored since its last answer, and still returns the
whole value (the ``since``/``cursors`` fields of find_value in dht/protocol.py).
Sampled reads: a latest read asks a few replicas drawn among those the key's last full
read found, not all k; one first, then the others with what it sent named rather than
sent again (``known``/``had``), and none of them for contacts."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from shoal.dht.lookup import Candidate
from shoal.dht.node import DHTNode
from shoal.dht.protocol import DHTProtocolError, parse_cursors, parse_tags
from shoal.dht.reads import HEDGE_S
from shoal.dht.records import Record
from shoal.dht.replica_reads import ReplicaReads, ReplicaSets
from shoal.dht.storage import LocalStorage
from shoal.transport.identity import Identity

DHT = "/shoal/dht/1.0.0"
EPOCH = b"e" * 8
REPLICA = Identity.generate().peer_id


def record(subkey: str | None, value: bytes = b"v", expires_in: float = 60.0) -> Record:
    return Record("key", subkey, value, time.time() + expires_in)


# ------------------------------------------------------------------ the reader's side, alone


def test_a_delta_answer_is_merged_into_what_the_replica_gave_before() -> None:
    reads = ReplicaReads()
    now = time.time()
    first = reads.answered("key", REPLICA, None, (EPOCH, 5), [record("a"), record("b")], now)
    assert sorted(r.subkey for r in first) == ["a", "b"]
    assert reads.since("key", REPLICA) == (EPOCH, 5)
    newer_a = record("a", b"a2", expires_in=90)
    second = reads.answered("key", REPLICA, (EPOCH, 5), (EPOCH, 7), [newer_a, record("c")], now)
    assert {r.subkey: r.value for r in second} == {"a": b"a2", "b": b"v", "c": b"v"}
    assert reads.since("key", REPLICA) == (EPOCH, 7)
    # nothing changed: an empty delta still gives the whole set
    third = reads.answered("key", REPLICA, (EPOCH, 7), (EPOCH, 7), [], now)
    assert sorted(r.subkey for r in third) == ["a", "b", "c"]


def test_an_answer_of_another_epoch_or_without_a_cursor_replaces_what_was_kept() -> None:
    reads = ReplicaReads()
    now = time.time()
    reads.answered("key", REPLICA, None, (EPOCH, 5), [record("a"), record("b")], now)
    # the replica restarted: its answer to our cursor is complete, and all there is
    restarted = reads.answered("key", REPLICA, (EPOCH, 5), (b"new epoch", 1), [record("c")], now)
    assert [r.subkey for r in restarted] == ["c"]
    assert reads.since("key", REPLICA) == (b"new epoch", 1)
    # a replica without delta reads: its answer is everything, and nothing is kept
    assert [r.subkey for r in reads.answered("key", REPLICA, None, None, [record("d")], now)] == [
        "d"
    ]
    assert reads.since("key", REPLICA) is None and len(reads) == 0


def test_kept_records_expire_and_are_bounded() -> None:
    reads = ReplicaReads(max_records=5)
    now = time.time()
    short = record("short", expires_in=1.0)
    reads.answered("key", REPLICA, None, (EPOCH, 1), [short, record("long")], now)
    later = reads.answered("key", REPLICA, (EPOCH, 1), (EPOCH, 1), [], now + 2)
    assert [r.subkey for r in later] == ["long"]
    # least recently read first out, past max_records in all
    others = [Identity.generate().peer_id for _ in range(3)]
    for replica in others:
        reads.answered("key", replica, None, (EPOCH, 1), [record("x"), record("y")], now)
    assert len(reads) <= 5
    assert reads.since("key", REPLICA) is None  # the oldest went first
    assert reads.since("key", others[-1]) == (EPOCH, 1)


def test_what_was_kept_of_a_key_read_no_more_goes_once_all_of_it_expired() -> None:
    """A Moshpit peer reads a new cell's key every round and never the old ones again:
    their records, expired, would stay until the bound pushed them out."""
    reads = ReplicaReads()
    now = time.time()
    old_cell = [Record("cell/1", "a", b"v", now + 5), Record("cell/1", "b", b"v", now + 8)]
    reads.answered("cell/1", REPLICA, None, (EPOCH, 1), old_cell, now)
    reads.answered("cell/2", REPLICA, None, (EPOCH, 1), [record("c")], now + 6)
    assert reads.since("cell/1", REPLICA) == (EPOCH, 1) and len(reads) == 3  # "b" lives
    reads.answered("cell/3", REPLICA, None, (EPOCH, 1), [record("d")], now + 9)
    assert reads.since("cell/1", REPLICA) is None and len(reads) == 2  # all of it expired
    assert reads.since("cell/2", REPLICA) == (EPOCH, 1)


def test_a_replica_answering_more_than_a_key_may_hold_is_not_kept() -> None:
    reads = ReplicaReads()
    flood = [record(f"s{i}") for i in range(4097)]
    assert len(reads.answered("key", REPLICA, None, (EPOCH, 1), flood, time.time())) == 4097
    assert reads.since("key", REPLICA) is None and len(reads) == 0


# ------------------------------------------------------------------ the replica's side, alone


def test_storage_reports_what_it_stored_after_a_cursor() -> None:
    storage = LocalStorage()
    now = time.time()
    assert storage.store(record("a"), now) and storage.store(record("b"), now)
    cursor = storage.last_seq
    assert storage.changed_since("key", cursor, now) == []
    replaced = record("a", b"a2", expires_in=120)
    assert storage.store(replaced, now) and storage.store(record("c"), now)
    assert storage.store(Record("other", None, b"o", now + 60), now)
    assert sorted(r.subkey for r in storage.changed_since("key", cursor, now)) == ["a", "c"]
    assert storage.changed_since("missing", 0, now) == []
    assert len(storage.epoch) == 8 and LocalStorage().epoch != storage.epoch


@pytest.mark.parametrize(
    "raw",
    [
        [1, 2],
        {0: [b"e", 1], 1: [b"e", 2], 2: [b"e", 3]},  # more entries than keys
        {5: [b"e", 1]},
        {True: [b"e", 1]},
        {0: [b"e"]},
        {0: ["e", 1]},
        {0: [b"e" * 17, 1]},
        {0: [b"e", -1]},
        {0: [b"e", 1 << 63]},
        {0: [b"e", 1.5]},
    ],
)
def test_malformed_cursors_are_refused(raw: object) -> None:
    with pytest.raises(DHTProtocolError):
        parse_cursors(raw, 2)


@pytest.mark.parametrize(
    "raw",
    [
        [b"t" * 8],
        {0: [b"t" * 8], 1: [b"t" * 8], 2: [b"t" * 8]},  # more entries than keys
        {5: [b"t" * 8]},
        {True: [b"t" * 8]},
        {0: b"t" * 8},
        {0: [b"t" * 7]},
        {0: ["t" * 8]},
        {0: [b"t" * 8] * 4097},
    ],
)
def test_malformed_tags_are_refused(raw: object) -> None:
    with pytest.raises(DHTProtocolError):
        parse_tags(raw, 2, "known")


def test_a_records_tag_names_its_exact_content() -> None:
    a = record("a")
    assert len(a.tag()) == 8 and a.tag() == Record.from_wire(a.to_wire()).tag()
    assert record("a", b"other").tag() != a.tag() and record("b").tag() != a.tag()
    signed = Record("key", None, b"v", a.expiration).sign(Identity.generate())
    assert signed.tag() != Record("key", None, b"v", a.expiration).tag()
    assert parse_tags(None, 3, "had") == {}
    assert parse_tags({1: [a.tag()]}, 3, "had") == {1: {a.tag()}}


def test_absent_cursors_are_none() -> None:
    assert parse_cursors(None, 3) == {}
    assert parse_cursors({1: [b"e", 7]}, 3) == {1: (b"e", 7)}


# ------------------------------------------------------------------ nodes on loopback


def dht_bytes_sent(nodes: list[DHTNode]) -> int:
    return sum(n.host.bytes_sent_by_protocol().get(DHT, 0) for n in nodes)


async def read_costs(reader: DHTNode, others: list[DHTNode], key: str) -> tuple[Any, int]:
    """What `reader` reads of `key` (every replica), and what the others sent meanwhile."""
    before = dht_bytes_sent(others)
    value = await reader.get(key, latest=True)
    return value, dht_bytes_sent(others) - before


@pytest.mark.timeout(60)
async def test_a_second_read_costs_the_replicas_only_what_changed(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(6)
    reader, others = nodes[0], nodes[1:]
    exp = time.time() + 60
    for i in range(40):
        assert await others[i % 5].store("peers", "x" * 200, exp, subkey=f"w{i}")
    first, full_cost = await read_costs(reader, others, "peers")
    assert first is not None and len(first.value) == 40
    again, unchanged_cost = await read_costs(reader, others, "peers")
    assert again.value == first.value
    # 40 records of about 250 bytes from each of 5 replicas, then none
    assert full_cost > 40_000 and unchanged_cost < full_cost / 5
    assert await others[2].store("peers", "changed", exp + 1, subkey="w7")
    assert await others[3].store("peers", "new", exp, subkey="w40")
    changed, changed_cost = await read_costs(reader, others, "peers")
    assert changed.value == {**first.value, "w7": "changed", "w40": "new"}
    assert changed_cost < full_cost / 3
    # and a node with full reads gets the same value
    (plain,) = await dht_swarm(1, delta_reads=False)
    assert (await plain.get("peers", latest=True)).value == changed.value


@pytest.mark.timeout(60)
async def test_a_replica_that_restarted_or_knows_no_cursors_answers_in_full(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(5)
    reader, others = nodes[0], nodes[1:]
    exp = time.time() + 60
    for i in range(6):
        assert await others[i % 4].store("peers", i, exp, subkey=f"w{i}")
    assert len((await reader.get("peers", latest=True)).value) == 6
    # every replica "restarted" (a new numbering) and one of them lost w0 meanwhile
    for node in others:
        node.storage.epoch = os.urandom(8)
    others[0].storage = LocalStorage(validator=others[0].validator)
    others[0]._server.node.storage = others[0].storage
    # an older peer: ignores `since` and sends no cursors
    old = others[1]
    handler = old._server._on_find_value

    async def without_cursors(ctx: Any, payload: Any) -> Any:
        payload.pop("since", None)
        answer = await handler(ctx, payload)
        answer.pop("cursors")
        return answer

    old._server._service.unary("find_value")(old._server._admitted(without_cursors))
    assert await others[2].store("peers", "late", exp, subkey="w6")
    for _ in range(2):
        got = await reader.get("peers", latest=True)
        assert got.value == {**{f"w{i}": i for i in range(6)}, "w6": "late"}
    assert reader._reader.replica_reads.since("peers", old.peer_id) is None


@pytest.mark.timeout(60)
async def test_a_replica_that_hides_changes_behind_its_cursor_hides_nothing_the_others_hold(
    dht_swarm: Callable[..., Any],
) -> None:
    """A replica can always leave records out of an answer; with cursors it can claim
    that nothing changed. The others' answers still carry the change."""
    nodes = await dht_swarm(6)
    reader, liar = nodes[0], nodes[1]
    exp = time.time() + 60
    for i in range(5):
        assert await nodes[1 + i].store("peers", i, exp, subkey=f"w{i}")
    assert len((await reader.get("peers", latest=True)).value) == 5
    handler = liar._server._on_find_value

    async def nothing_changed(ctx: Any, payload: Any) -> Any:
        answer = await handler(ctx, payload)
        if payload.get("since"):
            answer["values"] = {}
        return answer

    liar._server._service.unary("find_value")(liar._server._admitted(nothing_changed))
    assert await nodes[4].store("peers", "changed", exp + 1, subkey="w3")
    got = await reader.get("peers", latest=True)
    assert got.value == {"w0": 0, "w1": 1, "w2": 2, "w3": "changed", "w4": 4}


@pytest.mark.timeout(60)
async def test_a_replica_answering_malformed_cursors_is_a_garbage_answer(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(6)
    reader, bad = nodes[0], nodes[1]
    exp = time.time() + 60
    for i in range(5):
        assert await nodes[1 + i].store("peers", i, exp, subkey=f"w{i}")
    handler = bad._server._on_find_value

    async def bad_cursors(ctx: Any, payload: Any) -> Any:
        answer = await handler(ctx, payload)
        answer["cursors"] = {0: [b"x" * 1000, -5]}
        return answer

    bad._server._service.unary("find_value")(bad._server._admitted(bad_cursors))
    got = await reader.get("peers", latest=True)
    assert got.value == {f"w{i}": i for i in range(5)}
    assert reader.stats()["garbage_answers"] >= 1
    assert reader._reader.replica_reads.since("peers", bad.peer_id) is None


# ------------------------------------------------------------------ sampled latest reads


def candidates(n: int) -> list[Candidate]:
    return [Candidate(Identity.generate().peer_id, i, (), 0) for i in range(n)]


def test_a_sampled_read_draws_among_the_replicas_the_last_full_read_found() -> None:
    sets = ReplicaSets(ttl=30.0, rng=random.Random(1))
    replicas = candidates(10)
    never = lambda peer: False  # noqa: E731
    assert sets.draw("key", 3, 0.0, never) is None  # no full read yet
    sets.found("key", replicas, 0.0)
    drawn = sets.draw("key", 3, 1.0, never)
    assert drawn is not None and len({c.peer_id for c in drawn}) == 3
    assert {c.peer_id for c in drawn} <= {c.peer_id for c in replicas}
    # over many draws every replica is asked: a record one lacks is in another draw
    seen = set()
    for _ in range(50):
        seen |= {c.peer_id for c in sets.draw("key", 3, 1.0, never) or []}
    assert seen == {c.peer_id for c in replicas}
    assert sets.draw("key", 3, 30.0, never) is None  # too old: a full read is due


def test_failed_and_blocked_replicas_are_not_drawn_and_an_empty_set_means_a_full_read() -> None:
    sets = ReplicaSets()
    replicas = candidates(4)
    sets.found("key", replicas, 0.0)
    blocked = {replicas[0].peer_id}
    sets.failed("key", replicas[1].peer_id)
    drawn = sets.draw("key", 3, 1.0, lambda peer: peer in blocked)
    assert drawn is not None and {c.peer_id for c in drawn} == {c.peer_id for c in replicas[2:]}
    for c in replicas:
        sets.failed("key", c.peer_id)
    assert sets.draw("key", 3, 1.0, lambda peer: False) is None


def find_values_sent(node: DHTNode) -> Callable[[], int]:
    """A counter of the find_value requests `node` sends from now on."""
    count = 0
    request = node._requester.request

    async def counting(peer: Any, addrs: Any, method: str, payload: Any) -> Any:
        nonlocal count
        count += method == "find_value"
        return await request(peer, addrs, method, payload)

    node._requester.request = counting  # type: ignore[method-assign]
    return lambda: count


@pytest.mark.timeout(60)
async def test_a_sampled_read_asks_three_replicas_and_reads_what_a_full_read_does(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(12)
    reader = nodes[0]
    exp = time.time() + 60
    for i, node in enumerate(nodes[1:]):
        assert await node.store("peers", i, exp, subkey=f"w{i}")
    sent = find_values_sent(reader)
    full = await reader.get("peers", latest=True, sample=3)  # no replica set yet: full
    assert full is not None and len(full.value) == 11
    after_full = sent()
    assert after_full > 3
    assert await nodes[5].store("peers", "changed", exp + 1, subkey="w4")
    for _ in range(5):
        got = await reader.get("peers", latest=True, sample=3)
        assert got is not None and got.value == {**full.value, "w4": "changed"}
    assert sent() - after_full == 5 * 3
    assert reader.stats()["sampled_reads"] == 5


def test_a_store_s_replicas_serve_sampled_reads_unless_a_full_read_found_fresher_ones() -> None:
    sets = ReplicaSets(ttl=30.0)
    stored, read = candidates(3), candidates(5)
    never = lambda peer: False  # noqa: E731
    sets.stored("key", stored, 0.0)
    assert {c.peer_id for c in sets.draw("key", 5, 1.0, never) or []} == {c.peer_id for c in stored}
    sets.found("key", read, 2.0)  # a full read's set wins, and a store keeps it
    sets.stored("key", stored, 3.0)
    assert len(sets.draw("key", 5, 4.0, never) or []) == 5
    assert sets.draw("key", 5, 32.0, never) is None  # too old: a full read is due


@pytest.mark.timeout(60)
async def test_a_read_after_a_store_that_remembers_its_replicas_is_sampled_at_once(
    dht_swarm: Callable[..., Any],
) -> None:
    """A verified round's records (`peer/verify/audit_round.gather`): each member stores
    its record, then reads everyone's; its first read asks 2 of the replicas its store
    reached, not all k, and still reads every record stored there."""
    nodes = await dht_swarm(12)
    exp = time.time() + 60
    for i, node in enumerate(nodes[1:]):
        assert await node.store("round", i, exp, subkey=f"w{i}")
    reader = nodes[0]
    assert await reader.store("round", "mine", exp, subkey="me", remember_replicas=True)
    sent = find_values_sent(reader)
    got = await reader.get("round", latest=True, sample=2)
    assert got is not None and len(got.value) == 12
    assert sent() == 2 and reader.stats()["sampled_reads"] == 1
    other = nodes[1]  # (a plain store remembers nothing: its first read is a full one)
    assert await other.store("round", "again", exp + 1, subkey="w0")
    sent = find_values_sent(other)
    await other.get("round", latest=True, sample=2)
    assert sent() > 2 and other.stats()["sampled_reads"] == 0


@pytest.mark.timeout(60)
async def test_a_sampled_read_survives_dead_and_lying_replicas(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(8)
    reader = nodes[0]
    exp = time.time() + 60
    for i, node in enumerate(nodes[1:]):
        assert await node.store("peers", i, exp, subkey=f"w{i}")
    expected = {f"w{i}": i for i in range(7)}
    assert (await reader.get("peers", latest=True, sample=3)).value == expected
    # one replica answers that it holds nothing; two others are gone
    liar = nodes[1]
    handler = liar._server._on_find_value

    async def holds_nothing(ctx: Any, payload: Any) -> Any:
        answer = await handler(ctx, payload)
        answer["values"] = {}
        return answer

    liar._server._service.unary("find_value")(liar._server._admitted(holds_nothing))
    for dead in nodes[2:4]:
        await dead.aclose()
        await dead.host.aclose()
    # a replica that lost a record is healed by another's answer, draw after draw
    for _ in range(10):
        got = await reader.get("peers", latest=True, sample=3, within=5.0)
        assert got is not None and got.value == expected
    # every replica drawn gone: the read falls back to a full one
    reader._reader.replica_sets.found("peers", [], 0.0)
    assert (await reader.get("peers", latest=True, sample=3)).value == expected


def requests_sent(node: DHTNode) -> Counter[str]:
    """The DHT requests `node` sends from now on, by method."""
    sent: Counter[str] = Counter()
    request = node._requester.request

    async def counting(peer: Any, addrs: Any, method: str, payload: Any) -> Any:
        sent[method] += 1
        return await request(peer, addrs, method, payload)

    node._requester.request = counting  # type: ignore[method-assign]
    return sent


@pytest.mark.timeout(60)
async def test_a_store_to_a_key_whose_replicas_a_read_found_needs_no_lookup(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(12)
    writer, reader = nodes[0], nodes[11]
    exp = time.time() + 60
    sent = requests_sent(writer)
    assert await writer.store("peers", "first", exp, subkey="w")
    assert sent["find_node"] > 0  # nothing known of the key: a lookup
    await writer.get("peers", latest=True, sample=3)  # a full read: the replicas
    sent.clear()
    assert await writer.store("peers", "second", exp + 1, subkey="w")
    assert sent["find_node"] == 0 and sent["store"] >= 10
    assert writer.stats()["stores_to_known_replicas"] == 1
    got = await reader.get("peers", latest=True)
    assert got is not None and got.value == {"w": "second"}
    # another key still has its lookup
    assert await writer.store("other", 1, exp)
    assert sent["find_node"] > 0


def find_value_requests(node: DHTNode) -> list[tuple[Any, dict[str, Any]]]:
    """The find_value requests `node` sends from now on: (peer, payload)."""
    sent: list[tuple[Any, dict[str, Any]]] = []
    request = node._requester.request

    async def recording(peer: Any, addrs: Any, method: str, payload: Any) -> Any:
        if method == "find_value":
            sent.append((peer, payload))
        return await request(peer, addrs, method, payload)

    node._requester.request = recording  # type: ignore[method-assign]
    return sent


def read_only_from(reader: DHTNode, key: str, replicas: list[DHTNode]) -> None:
    """The replica set `reader`'s next sampled reads of `key` draw from."""
    now = asyncio.get_running_loop().time()
    found = [
        Candidate(n.peer_id, reader.routing_table.local_id, tuple(n.host.addresses()), 0)
        for n in replicas
    ]
    reader._reader.replica_sets.found(key, found, now)


async def sampled_read_costs(reader: DHTNode, others: list[DHTNode], key: str) -> tuple[Any, int]:
    before = dht_bytes_sent(others)
    value = await reader.get(key, latest=True, sample=3)
    return (None if value is None else value.value), dht_bytes_sent(others) - before


async def each_stores_one(
    dht_swarm: Callable[..., Any], n: int
) -> tuple[DHTNode, list[DHTNode], dict[str, int], float]:
    """`n` nodes: a reader, and the others each storing subkey w<i> = i of "peers",
    which a first sampled (so full) read returns: (reader, others, value, expiration)."""
    nodes = await dht_swarm(n)
    reader, others = nodes[0], nodes[1:]
    exp = time.time() + 60
    for i, node in enumerate(others):
        assert await node.store("peers", i, exp, subkey=f"w{i}")
    expected = {f"w{i}": i for i in range(n - 1)}
    assert (await reader.get("peers", latest=True, sample=3)).value == expected
    return reader, others, expected, exp


@pytest.mark.timeout(60)
async def test_a_sampled_read_gets_each_change_once_not_from_every_replica(
    dht_swarm: Callable[..., Any],
) -> None:
    reader, others, expected, exp = await each_stores_one(dht_swarm, 8)
    requests = find_value_requests(reader)
    # a 20 KB change: sent by the first replica asked, named by the two others
    big = "x" * 20_000
    assert await others[0].store("peers", big, exp + 1, subkey="w0")
    value, cost = await sampled_read_costs(reader, others, "peers")
    assert value == {**expected, "w0": big}
    assert 20_000 < cost < 2 * 20_000
    assert len(requests) == 3 and sum("known" in p for _, p in requests) == 2
    assert all(p.get("contacts") is False for _, p in requests)  # no contacts wanted
    # what a replica named is kept as part of what it holds: read from it alone
    # (a delta read: nothing changed), the value is still whole
    by_id = {n.peer_id: n for n in others}
    for peer, payload in requests:
        if "known" in payload:
            read_only_from(reader, "peers", [by_id[peer]])
            got = await reader.get("peers", latest=True, sample=3)
            assert got is not None and got.value == {**expected, "w0": big}


@pytest.mark.timeout(60)
async def test_replicas_that_ignore_known_or_lie_about_what_they_had_change_nothing(
    dht_swarm: Callable[..., Any],
) -> None:
    """An older replica sends what we named (it ignores ``known``); one that claims to
    have had records it was never named, or names garbage, adds nothing to the read."""
    reader, others, expected, exp = await each_stores_one(dht_swarm, 6)
    older, liar, garbage = others[:3]

    def serve(node: DHTNode, change: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
        handler = node._server._on_find_value

        async def changed(ctx: Any, payload: Any) -> Any:
            change(payload, {})
            answer = await handler(ctx, payload)
            change({}, answer)
            return answer

        node._server._service.unary("find_value")(node._server._admitted(changed))

    serve(older, lambda request, answer: request.pop("known", None))
    serve(liar, lambda request, answer: answer.update(had={0: [b"f" * 8, b"g" * 8]}))
    serve(garbage, lambda request, answer: answer.update(had={0: b"not a list"}))
    assert await others[3].store("peers", "changed", exp + 1, subkey="w3")
    for _ in range(5):
        read_only_from(reader, "peers", [older, liar, garbage])
        got = await reader.get("peers", latest=True, sample=3)
        assert got is not None and got.value == {**expected, "w3": "changed"}
    assert reader.stats()["garbage_answers"] >= 1


@pytest.mark.timeout(60)
async def test_a_slow_first_replica_does_not_hold_back_the_others(
    dht_swarm: Callable[..., Any],
) -> None:
    """The others are asked once the first replica's hedge (a few of its RTTs, at most
    HEDGE_S) has passed, not once it answers; the read is whole all the same."""
    reader, others, expected, _ = await each_stores_one(dht_swarm, 5)
    slow = others[0]
    handler = slow._server._on_find_value

    async def stalled(ctx: Any, payload: Any) -> Any:
        await asyncio.sleep(1.5)  # (past the request's own deadline here: it fails)
        return await handler(ctx, payload)

    slow._server._service.unary("find_value")(slow._server._admitted(stalled))
    asked: list[float] = []
    request = reader._requester.request

    async def timed(peer: Any, addrs: Any, method: str, payload: Any) -> Any:
        asked.append(asyncio.get_running_loop().time())
        return await request(peer, addrs, method, payload)

    reader._requester.request = timed  # type: ignore[method-assign]
    read_only_from(reader, "peers", others[:3])  # drawn in this order: the slow one first
    got = await reader.get("peers", latest=True, sample=3, within=5.0)
    assert got is not None and got.value == expected
    assert len(asked) == 3 and asked[1] - asked[0] <= HEDGE_S + 0.25
