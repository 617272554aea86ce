"""Commitments, the round's draws, disputes and convictions: what a peer signs,
who audits it, how three referees decide, and evidence anyone checks offline."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest
from verification_round import EXPERIMENT, Round, commit, conviction, h, identities

from shoal.dht.node import DHTNode
from shoal.verification.bans import BanList, fetch, publish
from shoal.verification.commitment import (
    Commitment,
    CommitmentError,
    MerkleTree,
    leaf_hash,
    verify_inclusion,
)
from shoal.verification.disputes import Dispute, Ledger, Outcome
from shoal.verification.evidence import Evidence, EvidenceError, Result
from shoal.verification.referees import RoundDraw, new_secret

pytestmark = pytest.mark.timeout(60)

# ---------------------------------------------------------------------- Merkle


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 17])
def test_every_part_proves_its_place_under_the_root_and_nothing_else_does(n: int) -> None:
    leaves = [leaf_hash(f"part {i}".encode()) for i in range(n)]
    tree = MerkleTree(leaves)
    for i, leaf in enumerate(leaves):
        proof = tree.proof(i)
        assert verify_inclusion(tree.root, leaf, i, n, proof)
        assert not verify_inclusion(tree.root, leaf_hash(b"forged"), i, n, proof)
        if n > 1:
            assert not verify_inclusion(tree.root, leaf, (i + 1) % n, n, proof)
            assert not verify_inclusion(tree.root, leaf, i, n, proof[:-1])


def test_an_inner_node_cannot_pass_for_a_part() -> None:
    # The commitment fixes the number of parts: a tree over inner nodes has the
    # same root but fewer leaves, and an inner node proves no place among 4.
    leaves = [leaf_hash(bytes([i])) for i in range(4)]
    tree = MerkleTree(leaves)
    inner = tree.levels[1][0]
    assert not verify_inclusion(tree.root, inner, 0, 4, [tree.levels[1][1]])
    for i in range(4):
        assert not verify_inclusion(tree.root, inner, i, 4, tree.proof(i))


# ---------------------------------------------------------------------- commitments


def test_a_commitment_round_trips_and_checks_from_its_own_bytes() -> None:
    (me,) = identities(1)
    c = commit(me, new_secret())
    back = Commitment.decode(c.encode())
    assert back == c and back.digest() == c.digest() and back.verifies()
    assert c.segments == 3
    assert [c.segment_bounds(i) for i in range(3)] == [(0, 2), (2, 4), (4, 6)]
    assert c.segment_start(1) == c.checkpoints[0]


def test_any_change_to_a_signed_commitment_is_refused() -> None:
    me, other = identities(2)
    c = commit(me, new_secret())
    data = bytearray(c.encode())
    for i in range(0, len(data), 7):
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        with pytest.raises(CommitmentError):
            Commitment.decode(bytes(tampered))
    with pytest.raises(CommitmentError):
        c.signed(other)  # nobody signs for the prover
    forged = replace(c, steps=5, checkpoints=c.checkpoints).signed(me)
    assert forged.digest() != c.digest()


def test_a_commitment_must_account_for_every_segment() -> None:
    (me,) = identities(1)
    c = commit(me, new_secret())
    with pytest.raises(CommitmentError, match="checkpoints"):
        replace(c, checkpoints=c.checkpoints[:-1])
    with pytest.raises(CommitmentError):
        replace(c, start=b"short")


# ---------------------------------------------------------------------- draws


def test_every_member_draws_the_same_auditor_segment_and_referees() -> None:
    r = Round(6)
    again = RoundDraw.from_reveals(list(reversed(r.commitments)), dict(r.secrets))
    assert again == r.draw
    for c in r.commitments:
        referees = r.draw.referees(c.prover)
        assert len(referees) == 3 == len(set(referees)) and c.prover not in referees
        assert set(referees) <= set(r.draw.members)


def test_one_new_secret_changes_every_draw() -> None:
    r = Round(6)
    secrets = dict(r.secrets)
    first = r.ids[0].peer_id
    secrets[first] = new_secret()
    # (its commitment no longer matches: it is left out of the seed, and audited)
    other = RoundDraw.from_reveals(r.commitments, secrets)
    assert other.seed != r.draw.seed
    assert other.withheld == {first}
    assert other.audited(first, rate=0.0)


def test_audits_happen_at_the_configured_rate() -> None:
    audited = 0
    trials = 4000
    for t in range(trials // 4):
        r = Round(4, rnd=t)
        audited += sum(r.draw.audited(p, rate=0.1) for p in r.draw.members)
    assert abs(audited / trials - 0.1) < 4 * (0.1 * 0.9 / trials) ** 0.5


def test_the_lsh_seed_exists_only_after_the_reveal() -> None:
    r = Round(4)
    prover, verifier = r.draw.members[0], r.draw.members[1]
    a = r.draw.lsh_seed(prover, h("revealed"), verifier)
    assert a == r.draw.lsh_seed(prover, h("revealed"), verifier)
    assert a != r.draw.lsh_seed(prover, h("revealed otherwise"), verifier)
    assert a != r.draw.lsh_seed(prover, h("revealed"), r.draw.members[2])


# ---------------------------------------------------------------------- disputes


def test_a_pass_by_the_auditor_ends_the_audit() -> None:
    r = Round(5)
    d = r.dispute(r.ids[0].peer_id, [Result.PASS])
    assert d.outcome is Outcome.PASSED and d.waiting_for() == ()


def test_an_accusation_asks_two_more_referees_and_a_majority_convicts() -> None:
    r = Round(5)
    prover = r.ids[0].peer_id
    c = r.of(prover)
    d = Dispute(c, r.draw)
    assert d.waiting_for() == (d.referees[0],)
    assert d.add(r.verdict(d.referees[0], c, Result.FAIL)) is Outcome.OPEN
    assert d.waiting_for() == d.referees[1:]
    assert d.add(r.verdict(d.referees[1], c, Result.BAD_REVEAL)) is Outcome.CONVICTED
    evidence = d.evidence(r.commitments, r.secrets)
    # Checks offline, from the bytes alone, on any peer.
    assert Evidence.decode(evidence.encode()).check() == prover


def test_an_overruled_accuser_gets_a_strike_and_the_prover_a_pass() -> None:
    r = Round(5)
    prover = r.ids[0].peer_id
    d = r.dispute(prover, [Result.FAIL, Result.PASS, Result.PASS])
    assert d.outcome is Outcome.ACQUITTED
    assert d.overruled() == [d.referees[0]]
    ledger = Ledger()
    ledger.record(d)
    assert ledger.strikes[d.referees[0]] == 1 and ledger.passes[prover] == 1
    with pytest.raises(EvidenceError):
        d.evidence(r.commitments, r.secrets)


def test_the_auditor_speaks_first_and_only_referees_speak() -> None:
    r = Round(6)
    prover = r.ids[0].peer_id
    c = r.of(prover)
    d = Dispute(c, r.draw)
    outsider = next(p for p in r.draw.members if p not in d.referees and p != prover)
    with pytest.raises(EvidenceError, match="not a referee"):
        d.add(r.verdict(outsider, c, Result.FAIL))
    with pytest.raises(EvidenceError, match="auditor"):
        d.add(r.verdict(d.referees[1], c, Result.FAIL))
    forged = replace(r.verdict(d.referees[0], c, Result.PASS), result=Result.FAIL)
    with pytest.raises(EvidenceError, match="signature"):
        d.add(forged)


def test_a_round_of_two_never_convicts_on_one_word() -> None:
    r = Round(2)
    d = r.dispute(r.ids[0].peer_id, [Result.FAIL])
    assert d.outcome is Outcome.UNRESOLVED and d.overruled() == []


def test_a_verifier_that_fails_everyone_convicts_nobody_and_loses_its_refereeing() -> None:
    rng = random.Random(5)
    ledger = Ledger()
    liar_identity = identities(1, "liar")[0]
    liar = liar_identity.peer_id
    convictions = disputes = 0
    strikes_after_three = None
    for t in range(4000):
        r = Round(3, rnd=t, salt=f"r{t % 50}-", also=(liar_identity,))
        honest = [p for p in r.draw.members if p != liar]
        prover = rng.choice(honest)
        c = r.of(prover)
        d = Dispute(c, r.draw)
        if d.auditor != liar:
            continue
        disputes += 1
        for referee in d.referees:
            if d.outcome is not Outcome.OPEN:
                break
            d.add(r.verdict(referee, c, Result.FAIL if referee == liar else Result.PASS))
        ledger.record(d)
        convictions += d.outcome is Outcome.CONVICTED
        if disputes == 3:
            strikes_after_three = ledger.strikes[liar]
        if disputes == 1000:
            break
    assert disputes == 1000
    assert convictions == 0
    assert strikes_after_three == 3
    assert not ledger.may_referee(liar) and ledger.on_probation(liar)


@pytest.mark.parametrize("liar_seat", [0, 1, 2])
def test_one_lying_referee_of_three_never_convicts_an_honest_prover(liar_seat: int) -> None:
    for t in range(300):
        r = Round(5, rnd=t)
        prover = r.ids[t % 5].peer_id
        c = r.of(prover)
        d = Dispute(c, r.draw)
        for seat, referee in enumerate(d.referees):
            if d.outcome is not Outcome.OPEN:
                break
            result = Result.FAIL if seat == liar_seat else Result.PASS
            d.add(r.verdict(referee, c, result))
        assert d.outcome is not Outcome.CONVICTED


# ---------------------------------------------------------------------- evidence


def test_a_forged_or_altered_bundle_is_rejected() -> None:
    r = Round(5)
    good = conviction(r)
    prover = good.prover
    a, b = good.verdicts
    outsider = next(p for p in r.draw.members if p not in r.draw.referees(prover) and p != prover)
    forgeries = {
        "one accuser": replace(good, verdicts=(a,)),
        "an accuser twice": replace(good, verdicts=(a, a)),
        "a non-referee": replace(
            good, verdicts=(a, r.verdict(outsider, good.commitment, Result.FAIL))
        ),
        "a changed result": replace(good, verdicts=(a, replace(b, result=Result.BAD_REVEAL))),
        "other secrets": replace(good, secrets=tuple((p, new_secret()) for p, _ in good.secrets)),
        # Leaving one secret out would pick another seed (and other referees).
        "a secret left out": replace(good, secrets=good.secrets[1:]),
        "a missing member": replace(good, round_commitments=good.round_commitments[1:]),
        "another commitment": replace(good, commitment=r.commitments[1]),
    }
    for name, forged in forgeries.items():
        with pytest.raises(EvidenceError):
            forged.check()
            pytest.fail(f"{name} passed")
    data = bytearray(good.encode())
    rejected = 0
    for i in range(0, len(data), 11):
        tampered = bytearray(data)
        tampered[i] ^= 0x40
        try:
            Evidence.decode(bytes(tampered)).check()
        except EvidenceError:
            rejected += 1
            continue
        raise AssertionError(f"byte {i} changed and the bundle still convicts")
    assert rejected > 0


def test_the_ban_list_takes_checked_convictions_of_its_experiment_only() -> None:
    r = Round(5)
    good = conviction(r)
    bans = BanList(EXPERIMENT)
    assert bans.consider(good) == good.prover and good.prover in bans
    assert bans.consider(replace(good, verdicts=good.verdicts[:1])) is None
    assert bans.rejected == 1 and len(bans) == 1
    other = BanList("another experiment")
    assert other.consider(good) is None and len(other) == 0
    (status,) = [c.to_status() for c in bans.convictions()]
    assert status["peer"] == str(good.prover) and len(status["accusers"]) == 2


@pytest.fixture
async def dhts(make_host: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    nodes: list[DHTNode] = []

    async def make(n: int) -> list[DHTNode]:
        for _ in range(n):
            host = await make_host()
            boot = [str(nodes[0].host.addresses()[0])] if nodes else []
            nodes.append(await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0))
        return nodes[-n:]

    yield make
    await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)


async def test_a_published_conviction_bans_the_peer_everywhere(dhts: Callable[..., Any]) -> None:
    a, b, c = await dhts(3)
    r = Round(5)
    good = conviction(r)
    assert await publish(a, good)
    # A forged copy under another publisher's subkey is dropped; the real one stays.
    assert await publish(b, replace(good, verdicts=good.verdicts[:1]))
    found = await fetch(c, EXPERIMENT)
    assert len(found) == 2
    bans = BanList(EXPERIMENT)
    assert {bans.consider(e) for e in found} == {good.prover, None}
    assert bans.banned == {good.prover}
