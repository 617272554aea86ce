"""A trainer's backwards in doubt (`ledger.Doubt`) and whose keys a step log tells: how the
ledger settles a doubt, and that a trainer claiming another's keys touches nothing of
the other's (keys live in the name space of the peer that sends them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.dht.node import DHTNode
from shoal.pipeline.ledger import DOUBT_STEPS, GIVE_UP_VERSIONS, Applied, Doubt, MicrobatchLedger
from shoal.pipeline.server import LOGGED_KEYS, StageServer, _keys_of
from shoal.pipeline.stage_optimizer import StepRecord
from shoal.pipeline.trainer import _keys
from shoal.transport.identity import Identity

from .test_pipeline_accounting import stage_and_requests

PEERS = [Identity.generate().peer_id for _ in range(3)]


def doubt(key: str, peer: int, since: int, samples: int = 4) -> Doubt:
    return Doubt(0, key, PEERS[peer], since, b"attempt!", torch.zeros(1), torch.zeros(1), samples)


def test_a_doubt_counts_when_its_peer_s_own_log_lists_its_key_and_no_one_else_s() -> None:
    ledger = MicrobatchLedger(1)
    ledger.doubted(doubt("a", 0, since=3))
    members = frozenset({PEERS[0], PEERS[1]})
    # Another peer's log that claims the key settles nothing: only the peer knows its part.
    assert ledger.resolve(0, [(3, members, frozenset({"a"}))], 4, source=PEERS[1]) == []
    assert ledger.doubts(0) and ledger.open_samples(0) == 4
    # Its own log without the key: it may still hold it for a later step.
    assert ledger.resolve(0, [(3, members, frozenset())], 4, source=PEERS[0]) == []
    assert ledger.doubts(0)
    assert ledger.resolve(0, [(4, members, frozenset({"a"}))], 5, source=PEERS[0]) == []
    assert not ledger.doubts(0) and ledger.counted[0] == 4 and ledger.open_samples(0) == 0


def test_a_doubt_is_replayed_once_the_steps_it_could_be_in_went_without_its_peer() -> None:
    ledger = MicrobatchLedger(1)
    ledger.doubted(doubt("a", 0, since=3))
    others = frozenset({PEERS[1], PEERS[2]})
    steps = [(v, others) for v in range(3, 3 + DOUBT_STEPS - 1)]
    assert ledger.resolve(0, steps, 3 + DOUBT_STEPS - 1) == []  # one step short
    (replay,) = ledger.resolve(0, [(3 + DOUBT_STEPS - 1, others)], 3 + DOUBT_STEPS)
    assert replay.key == "a" and ledger.replayed[0] == 4 and not ledger.doubts(0)


def test_a_doubt_whose_peer_stepped_but_never_told_is_assumed_counted_in_the_end() -> None:
    ledger = MicrobatchLedger(1)
    ledger.doubted(doubt("a", 0, since=3))
    assert ledger.resolve(0, [(3, frozenset({PEERS[0], PEERS[1]}))], 4) == []
    assert ledger.settle_doubts(0, 3 + GIVE_UP_VERSIONS) == [] and ledger.doubts(0)
    assert ledger.settle_doubts(0, 4 + GIVE_UP_VERSIONS) == []
    assert not ledger.doubts(0) and ledger.assumed[0] == 4


def test_a_fence_that_reaches_the_peer_at_last_settles_a_doubt() -> None:
    ledger = MicrobatchLedger(1)
    applied, never = doubt("a", 0, since=3), doubt("b", 0, since=3)
    ledger.doubted(applied)
    ledger.doubted(never)
    assert ledger.fenced(applied, 4) is None  # applied at 4: open there
    assert [e.epoch for e in ledger.open(0)] == [4]
    entry = ledger.fenced(never, None)  # never applied, never will be: replay it
    assert isinstance(entry, Applied) and entry.key == "b" and ledger.replayed[0] == 4
    assert ledger.fenced(never, None) is None  # (settled once)


def test_the_keys_of_a_peer_s_own_log_decide_over_its_membership() -> None:
    ledger = MicrobatchLedger(1)
    x = torch.zeros(1)
    ledger.applied(Applied(0, "in", PEERS[0], 3, x, x, 4))
    ledger.applied(Applied(0, "out", PEERS[0], 3, x, x, 4))
    log = [(3, frozenset({PEERS[0]}), frozenset({"in"}))]
    (replay,) = ledger.resolve(0, log, 4, source=PEERS[0])
    assert replay.key == "out" and ledger.counted[0] == 4 and ledger.replayed[0] == 4


def test_a_step_log_s_keys_are_taken_only_as_a_bounded_list_of_short_strings() -> None:
    assert _keys(["a", "b"]) == frozenset({"a", "b"})
    for bad in ("a", [b"a"], ["x" * 201], [1], ["k"] * (LOGGED_KEYS + 1), None):
        assert _keys(bad) is None


@pytest.mark.timeout(30)
async def test_a_trainer_that_claims_another_s_key_touches_nothing_of_the_other_s(
    make_host: Callable[..., Any],
) -> None:
    """A liar sends a backward under the key the honest trainer will use: the honest one's
    backward is still applied (not answered with the liar's), and each step log lists
    each trainer's own keys only."""
    host = await make_host()
    dht = await DHTNode.create(host, bootstrap=[], hop_timeout=1.0)
    worker, requests = stage_and_requests(2)
    server = StageServer(dht, "exp", 0, worker)
    liar, honest = PEERS[1], PEERS[2]
    await server.start()
    try:
        key, x, g, n = requests[0]
        await server.compute_backward(key, x, g, n, caller=liar)
        _, y, h, m = requests[1]
        answer, _ = await server.compute_backward(key, y, h, m, caller=honest)
        assert worker.samples_for(0) == n + m and answer.shape == y.shape
        taken = worker.take_gradients(0)
        record = StepRecord(0, (dht.peer_id,), n + m, taken.keys)
        assert _keys_of(record, honest) == [key] and _keys_of(record, liar) == [key]
        assert _keys_of(record, PEERS[0]) == []
        flood = frozenset((liar.to_bytes(), str(i)) for i in range(LOGGED_KEYS + 1))
        many = StepRecord(0, (dht.peer_id,), 0, flood)
        assert _keys_of(many, liar) is None and _keys_of(many, honest) == []
    finally:
        await server.aclose()
        await dht.aclose()


def test_a_restore_replays_the_doubts_it_lost_and_forgets_the_dead_peers_steps() -> None:
    """Every peer of the stage died with a backward in doubt (its answer lost in the
    kill, sent at version 12) and one restored the stage at 7 from its checkpoint:
    whatever the doubt's peer applied was at 12 or 13, and is gone. The steps 7 to 14
    the dead peers logged are history: new steps at those versions settle things,
    not them (with them, the doubt's peer was a member at 12: assumed counted, and
    its samples lost: what a CI run of the stage-recovery test saw, 4 samples short)."""
    ledger = MicrobatchLedger(1)
    dead = frozenset({PEERS[0], PEERS[1]})
    ledger.resolve(0, [(v, dead) for v in range(5, 15)], version=15)
    ledger.doubted(doubt("lost", 1, since=12))
    ledger.doubted(doubt("before", 0, since=5))  # (in the checkpoint, or not: its log says)
    replay = ledger.lost(0, restored=7)
    assert [e.key for e in replay] == ["lost"] and ledger.restored == [4]
    assert [d.key for d in ledger.doubts(0)] == ["before"]
    # The restored peer's steps from 7 on do not have PEERS[1]: nothing of the old ones
    # makes the remaining doubt's peer a member of them.
    ledger.resolve(0, [(v, frozenset({PEERS[0]})) for v in range(7, 10)], version=10)
    assert ledger.replayed == [4] and ledger.assumed == [0]


def test_a_dead_peers_doubt_is_settled_by_the_keys_its_steps_held_before_it_died() -> None:
    """Backwards to PEERS[1] whose answers were lost while the trainer saw the stage at
    5 (the deadline passed while the peer computed; it cannot be asked: it died with
    the whole stage). Its answers to others told its steps 5 and 6, and which of our
    keys they held: "in" was in step 5, "out" in neither (applied at 7 or later, if at
    all). The stage comes back from a checkpoint at 7: "in" is in it (counted), "out"
    is lost or never was (replayed), not assumed counted because PEERS[1] was a member
    of steps 5 and 6 (a CI run of the stage-recovery test: 8 samples short). A live
    peer's log without the key settles nothing: it may hold the key for a later step."""
    ledger = MicrobatchLedger(1)
    dead = frozenset({PEERS[0], PEERS[1]})
    ledger.doubted(doubt("in", 1, since=5))
    ledger.doubted(doubt("out", 1, since=5))
    log = [(5, dead, frozenset({"in", "other"})), (6, dead, frozenset({"other"}))]
    assert ledger.resolve(0, log, version=7, source=PEERS[1]) == []
    assert ledger.counted == [4] and [d.key for d in ledger.doubts(0)] == ["out"]
    (replay,) = ledger.lost(0, restored=7)
    assert replay.key == "out" and ledger.replayed == [4] and ledger.restored == [4]
    assert ledger.assumed == [0] and not ledger.doubts(0)


def test_a_dead_peers_doubt_its_steps_never_told_of_is_still_the_one_case_assumed() -> None:
    """The same, with no word from PEERS[1] on its steps' keys (its logs reached us only
    through others' membership): counted once GIVE_UP_VERSIONS pass, as before."""
    ledger = MicrobatchLedger(1)
    dead = frozenset({PEERS[0], PEERS[1]})
    ledger.doubted(doubt("unknown", 1, since=5))
    ledger.resolve(0, [(5, dead), (6, dead)], version=7)
    assert ledger.lost(0, restored=7) == []
    assert ledger.resolve(0, [(v, frozenset({PEERS[0]})) for v in (7, 8)], version=9) == []
    assert ledger.settle_doubts(0, 6 + GIVE_UP_VERSIONS) == [] and ledger.assumed == [4]


def test_a_doubt_whose_version_was_read_before_a_restore_is_settled_as_the_restore_settled() -> (
    None
):
    """A backward to PEERS[1] failed while the trainer saw the stage at 19; its fence
    found no one, and the dry backward elsewhere answered only after the trainer had
    learned that the stage was restored at 5 (every peer died). Its version counts
    in the lost steps' numbering: gone, replayed at once, not left waiting for the
    restored stage to log steps 19 to 21 (a CI run: 8 samples unsettled at its end).
    One at the restoring peer's own ID waits for its fence, as `lost` leaves it."""
    ledger = MicrobatchLedger(1)
    ledger.resolve(0, [(v, frozenset(PEERS[:2])) for v in range(0, 19)], version=19)
    survivor = (PEERS[0], 20.0)
    assert ledger.lost(0, restored=5, survivor=survivor) == []
    entry = ledger.doubted_before(doubt("late", 1, since=19), 5, survivor)
    assert entry is not None and entry.key == "late" and not ledger.doubts(0)
    assert ledger.restored == [4] and ledger.replayed == [4]
    assert ledger.doubted_before(doubt("at_survivor", 0, since=19), 5, survivor) is None
    assert [d.key for d in ledger.doubts(0)] == ["at_survivor"]
