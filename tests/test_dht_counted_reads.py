"""Counted reads (dht/counted_reads.py, ``count`` in find_value of dht/protocol.py):
how many records a key holds, asked of its replicas without the records. A Moshpit
peer counts a dht_swarm's state announcements this way before its first step: read in
full, hundreds of peers' reads of hundreds of announcements filled the replicas'
home uplinks (sim/scenarios/moshpit_256.json)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_dht_delta_reads import dht_bytes_sent

from shoal.dht.node import DHTNode
from shoal.dht.protocol import MAX_RECORDS_PER_KEY, DHTProtocolError, parse_counts


@pytest.mark.parametrize(
    "raw",
    [
        [3],
        {0: 1, 1: 2, 2: 3},  # more entries than keys
        {5: 1},
        {True: 1},
        {0: -1},
        {0: MAX_RECORDS_PER_KEY + 1},
        {0: 1.5},
        {0: True},
    ],
)
def test_malformed_counts_are_refused(raw: object) -> None:
    with pytest.raises(DHTProtocolError):
        parse_counts({"counts": raw}, 2)


def test_absent_counts_are_none() -> None:
    assert parse_counts({}, 2) == {}
    assert parse_counts({"counts": {1: 7}}, 2) == {1: 7}


def answer_find_value_with(node: DHTNode, change: Callable[[Any, Any], Any]) -> None:
    """`node` answers find_value with what `change(payload, its honest answer)` makes."""
    handler = node._server._on_find_value

    async def changed(ctx: Any, payload: Any) -> Any:
        return change(payload, await handler(ctx, payload))

    node._server._service.unary("find_value")(node._server._admitted(changed))


@pytest.mark.timeout(60)
async def test_a_count_is_what_a_full_read_holds_at_a_fraction_of_its_bytes(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(6)
    reader, others = nodes[0], nodes[1:]
    exp = time.time() + 60
    for i in range(40):
        assert await others[i % 5].store("peers", "x" * 200, exp, subkey=f"w{i}")
    before = dht_bytes_sent(others)
    assert await reader.count_records("peers", within=5.0) == 40
    counted = dht_bytes_sent(others) - before
    before = dht_bytes_sent(others)
    assert len((await reader.get("peers", latest=True)).value) == 40
    read = dht_bytes_sent(others) - before
    assert counted < read / 5  # 40 records of about 250 bytes from each replica, or none
    assert await reader.count_records("nobody/wrote/this", within=5.0) == 0
    assert reader.stats()["counted_reads"] == 2


@pytest.mark.timeout(60)
async def test_replicas_that_hide_records_are_outvoted_by_one_that_holds_them(
    dht_swarm: Callable[..., Any],
) -> None:
    """Each count is a replica's claim: the largest wins, so replicas that say a key is
    empty (or hold fewer records, not reached yet by every store) count for nothing
    while one honest replica answers; a replica can only inflate a count, which
    makes a crowd look larger (a Moshpit peer then starts in its cell, where a peer
    alone falls back to the whole key)."""
    nodes = await dht_swarm(6)
    reader, others = nodes[0], nodes[1:]
    exp = time.time() + 60
    for i in range(7):
        assert await others[i % 5].store("peers", i, exp, subkey=f"w{i}")
    for liar in others[:4]:
        answer_find_value_with(liar, lambda _payload, answer: {**answer, "counts": {}})
    assert await reader.count_records("peers", within=5.0) == 7


@pytest.mark.timeout(60)
async def test_a_replica_answering_a_count_out_of_bounds_is_a_garbage_answer(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(6)
    reader, bad = nodes[0], nodes[1]
    exp = time.time() + 60
    for i in range(3):
        assert await nodes[1 + i].store("peers", i, exp, subkey=f"w{i}")
    answer_find_value_with(bad, lambda _payload, answer: {**answer, "counts": {0: 10**9}})
    assert await reader.count_records("peers", within=5.0) == 3
    assert reader.stats()["garbage_answers"] >= 1


@pytest.mark.timeout(60)
async def test_a_replica_from_before_counted_reads_is_counted_from_its_records(
    dht_swarm: Callable[..., Any],
) -> None:
    nodes = await dht_swarm(5)
    reader, others = nodes[0], nodes[1:]
    exp = time.time() + 60
    for i in range(5):
        assert await others[i % 4].store("peers", i, exp, subkey=f"w{i}")

    for old in others:
        handler = old._server._on_find_value

        async def as_before(ctx: Any, payload: Any, handler: Any = handler) -> Any:
            # (an older replica ignores `count`: it answers the records themselves)
            return await handler(ctx, {k: v for k, v in payload.items() if k != "count"})

        old._server._service.unary("find_value")(old._server._admitted(as_before))
    assert await reader.count_records("peers", within=5.0) == 5


@pytest.mark.timeout(60)
async def test_a_count_that_runs_out_of_time_having_heard_nothing_is_unknown(
    dht_swarm: Callable[..., Any],
) -> None:
    others = await dht_swarm(3)
    assert await others[0].store("peers", 1, time.time() + 60, subkey="w0")
    (reader,) = await dht_swarm(1)  # (joined after the store: holds none of it itself)
    for node in others:
        handler = node._server._on_find_value

        async def stalled(ctx: Any, payload: Any, handler: Any = handler) -> Any:
            await asyncio.sleep(3.0)
            return await handler(ctx, payload)

        node._server._service.unary("find_value")(node._server._admitted(stalled))
    assert await reader.count_records("peers", within=0.5) is None
