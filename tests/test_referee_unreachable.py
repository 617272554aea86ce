"""A prover that cannot reveal its work (unreachable, or restarted without it) is not
convicted: a referee's word that nothing came is no evidence anyone could check.
It is tried again for a while, then left out of the referee's rounds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import shoal.peer.verify.referee as referee_mod
from shoal.dht.node import DHTNode
from shoal.peer.verify.audit_round import AuditRound, publish_record
from shoal.peer.verify.referee import Referee
from shoal.peer.verify.reveals import PROTOCOL
from shoal.transport import rpc
from shoal.transport.identity import Identity, PeerID
from shoal.verification.evidence import Result, Verdict
from shoal.verification.referees import RoundDraw, new_secret

from .verification_round import Round, commit, h, identities


def recorder(shunned: list[tuple[PeerID, int]]) -> Callable[[PeerID, int], float]:
    """A referee's `shun`: records (prover, round) and says how long."""

    def shun(prover: PeerID, round_index: int) -> float:
        shunned.append((prover, round_index))
        return 30.0

    return shun


def referee(host: Any, shunned: list[tuple[PeerID, int]]) -> Referee:
    me = Identity.generate()
    dht = SimpleNamespace(host=host)
    # Only what an audit touches before any reveal arrives: no segment is re-run here.
    runner = SimpleNamespace(
        inner=SimpleNamespace(state_dict=dict, state_layouts=list), model=torch.nn.Linear(2, 2)
    )
    return Referee(
        dht, me, task=None, num_shards=1, namespace="exp", policy=None, runner=runner,
        pool=None, bans=None, retain_s=3600.0, shun=recorder(shunned),
    )  # type: ignore[arg-type]  # fmt: skip


def audit_round(prover: Identity, sparse: bool = False) -> Any:
    c = commit(prover, b"s" * 32)
    return SimpleNamespace(
        round=c.round, commitments={prover.peer_id: c}, committed_at=time.monotonic(),
        draw=SimpleNamespace(segment=lambda _p, _n: 0), secrets_to_wire=list,
        shape=SimpleNamespace(sparse=sparse),
    )  # fmt: skip


@pytest.mark.timeout(30)
async def test_an_unreachable_prover_is_retried_then_left_out_not_convicted(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(referee_mod, "REVEAL_TIMEOUT", 1.0)
    monkeypatch.setattr(referee_mod, "REVEAL_RETRY_S", 0.2)
    tries = []
    real_fetch = referee_mod.fetch_reveal

    async def counted(*args: Any, **kwargs: Any) -> Any:
        tries.append(time.monotonic())
        return await real_fetch(*args, **kwargs)

    monkeypatch.setattr(referee_mod, "fetch_reveal", counted)
    shunned: list[tuple[PeerID, int]] = []
    ref = referee(await make_host(), shunned)
    (gone,) = identities(1, "gone")  # no address known: every dial fails at once
    rnd = audit_round(gone)
    assert await ref.audit(rnd, gone.peer_id) is None
    assert len(tries) >= 3, "gave up without trying again"
    assert shunned == [(gone.peer_id, rnd.round)]
    assert ref.counts["reveals_missing"] == 1
    assert ref.counts["audits_failed"] == 0 and ref.counts["audits_done"] == 0


@pytest.mark.timeout(30)
async def test_a_prover_that_lost_its_work_in_a_restart_is_left_out_not_convicted(
    make_host: Callable[..., Any],
) -> None:
    prover_host = await make_host()
    service = rpc.RpcService(prover_host, PROTOCOL)

    @service.stream("reveal")
    async def no_work(ctx: Any, payload: Any) -> Any:
        raise LookupError("no work of round 7 here")
        yield  # (stream handlers are async generators)

    shunned: list[tuple[PeerID, int]] = []
    host = await make_host()
    await host.connect(prover_host.addresses()[0])
    ref = referee(host, shunned)
    prover = SimpleNamespace(peer_id=prover_host.peer_id)
    rnd = audit_round(identities(1, "p")[0])
    rnd.commitments = {prover_host.peer_id: next(iter(rnd.commitments.values()))}
    assert await ref.audit(rnd, prover.peer_id) is None
    assert shunned == [(prover_host.peer_id, rnd.round)]
    assert ref.counts["audits_failed"] == 0


def moving_draw(r: Round) -> tuple[PeerID, PeerID, RoundDraw]:
    """(prover, its auditor in `r.draw`, a draw of the same round, made without one
    member's secret, in which someone else audits it): what a late DHT read gives."""
    prover = r.ids[0].peer_id
    auditor = r.draw.referees(prover)[0]
    for missing in r.secrets:
        partial = {p: s for p, s in r.secrets.items() if p != missing}
        other = RoundDraw.from_reveals(r.commitments, partial)
        if other.referees(prover)[0] != auditor:
            return prover, auditor, other
    raise AssertionError("no secret moves the auditor")


@pytest.mark.timeout(30)
async def test_an_audit_whose_draw_moved_is_dropped_without_an_error(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Secrets learned from another member (one that read the DHT later) change the
    draw: an auditor that is no longer one neither starts nor judges the audit (the
    soak: 'the auditor speaks first', an exception nobody retrieved)."""
    r = Round(6, salt="moving")
    prover, auditor, moved = moving_draw(r)
    runner = SimpleNamespace(
        inner=SimpleNamespace(state_dict=dict, state_layouts=list), model=torch.nn.Linear(2, 2)
    )
    ref = Referee(
        SimpleNamespace(host=await make_host()), r.by_peer[auditor], task=None, num_shards=1,
        namespace="exp", policy=None, runner=runner, pool=None, bans=None, retain_s=3600.0,
    )  # type: ignore[arg-type]  # fmt: skip
    rnd = SimpleNamespace(
        round=7, commitments={prover: r.of(prover)}, draw=r.draw, secrets_to_wire=list
    )
    audited: list[PeerID] = []

    async def audit_while_the_draw_moves(rnd: Any, p: PeerID) -> Verdict:
        audited.append(p)
        verdict = r.verdict(auditor, r.of(p), Result.FAIL)
        rnd.draw = moved  # (a reveal request taught us a secret meanwhile)
        return verdict

    async def unreachable_referee(*args: Any) -> None:
        return None

    monkeypatch.setattr(ref, "audit", audit_while_the_draw_moves)
    monkeypatch.setattr(ref, "ask_referee", unreachable_referee)
    await ref.audit_as_auditor(rnd, prover)  # type: ignore[arg-type]
    assert audited == [prover] and sum(ref.disputes.values()) == 0
    await ref.audit_as_auditor(rnd, prover)  # type: ignore[arg-type]  # moved before it began
    assert audited == [prover] and sum(ref.disputes.values()) == 0


async def late_secret_round(
    make_host: Callable[..., Any], *, auditor_stays_referee: bool
) -> tuple[AuditRound, Referee, PeerID, list[str], list[tuple[PeerID, int]], list[DHTNode]]:
    """A round whose member `late` published its secret after the auditor's read of
    the DHT: the auditor's draw lacks it, the prover's has it, and the prover refuses
    the auditor (its draw names other referees). Returns (round, referee, prover's
    id, the prover's answers so far, who the referee shunned)."""
    nodes = []
    for _ in range(3):  # the auditor, the prover, the late member
        host = await make_host()
        boot = [str(nodes[0].host.addresses()[0])] if nodes else []
        nodes.append(await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0))
    auditor, prover, late = nodes
    others = identities(2, "quiet")  # members whose secrets the auditor has
    ids = [auditor.host.identity, prover.host.identity, late.host.identity, *others]
    for _ in range(1000):  # secrets until the late one moves the auditor as wanted
        secrets = {i.peer_id: new_secret() for i in ids}
        commitments = {i.peer_id: commit(i, secrets[i.peer_id]) for i in ids}
        known = {p: s for p, s in secrets.items() if p != late.peer_id}
        partial = RoundDraw.from_reveals(list(commitments.values()), known)
        full = RoundDraw.from_reveals(list(commitments.values()), secrets)
        stays = auditor.peer_id in full.referees(prover.peer_id)
        if auditor.peer_id in partial.referees(prover.peer_id) and stays == auditor_stays_referee:
            break
    assert await publish_record(late, "exp", commitments[late.peer_id], secrets[late.peer_id])
    answers: list[str] = []
    service = rpc.RpcService(prover.host, PROTOCOL)

    @service.stream("reveal")
    async def refuse(ctx: Any, payload: Any) -> Any:
        answers.append("refused")
        raise PermissionError("only this round's referees of our work may ask")
        yield  # (stream handlers are async generators)

    shunned: list[tuple[PeerID, int]] = []
    runner = SimpleNamespace(
        inner=SimpleNamespace(state_dict=dict, state_layouts=list), model=torch.nn.Linear(2, 2)
    )
    ref = Referee(
        auditor, auditor.host.identity, task=None, num_shards=1, namespace="exp",
        policy=None, runner=runner, pool=None, bans=None, retain_s=3600.0,
        shun=recorder(shunned),
    )  # type: ignore[arg-type]  # fmt: skip
    dense = SimpleNamespace(sparse=False)
    rnd = AuditRound(7, dense, commitments, known, partial, [], time.monotonic(), h("global"))  # type: ignore[arg-type]
    return rnd, ref, prover.peer_id, answers, shunned, nodes


@pytest.mark.timeout(60)
async def test_a_prover_whose_draw_has_a_secret_ours_lacked_is_not_left_out(
    make_host: Callable[..., Any],
) -> None:
    """The prover refuses us as a referee because its draw holds a secret our read of
    the DHT missed: we read the round's secrets again, and once the draws agree that
    we are none of its referees, we drop the audit; no withholding, nobody shunned."""
    rnd, ref, prover, answers, shunned, nodes = await late_secret_round(
        make_host, auditor_stays_referee=False
    )
    try:
        assert await ref.audit(rnd, prover) is None
        assert answers == ["refused"] and shunned == []
        assert len(rnd.secrets) == 5 and not rnd.draw.withheld  # the late secret, learned
        assert ref.counts["reveals_missing"] == 0 and ref.counts["audits_done"] == 0
    finally:
        await asyncio.gather(*(n.aclose() for n in nodes))


@pytest.mark.timeout(60)
async def test_a_prover_that_refuses_a_referee_of_the_shared_draw_is_left_out(
    make_host: Callable[..., Any],
) -> None:
    """Once we hold every secret the prover could have, its draw is ours: a prover
    that refuses a referee of that draw again withholds its work."""
    rnd, ref, prover, answers, shunned, nodes = await late_secret_round(
        make_host, auditor_stays_referee=True
    )
    try:
        assert await ref.audit(rnd, prover) is None
        assert answers == ["refused", "refused"]  # asked again with the shared draw
        assert shunned == [(prover, 7)] and ref.counts["reveals_missing"] == 1
    finally:
        await asyncio.gather(*(n.aclose() for n in nodes))


def slow_prover(prover_host: Any, pause: float, *, stall_after: int | None = None) -> None:
    """A prover whose reveal (of `referee`'s Linear(2, 2)) trickles in: a tensor every
    `pause` seconds; with `stall_after`, it stops sending after that many tensors."""
    service = rpc.RpcService(prover_host, PROTOCOL)

    @service.stream("reveal")
    async def trickle(ctx: Any, payload: Any) -> Any:
        await ctx.send_item({"params": 2, "keys": [], "end_opt": b"o" * 32})
        tensors = [torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 2), torch.ones(2)]
        for sent, t in enumerate(tensors):
            if sent == stall_after:
                await asyncio.Event().wait()  # connected, and silent
            await asyncio.sleep(pause)
            await ctx.send_tensor(t)
        yield {"done": True}


@pytest.mark.timeout(30)
async def test_a_reveal_gets_the_time_its_size_needs_beyond_reaching_the_prover(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large model's reveal over a home uplink takes far longer than reaching its
    prover does (4.8 GB at 300M parameters): the deadline counts its bytes at a
    modest link rate. Here reaching gets 0.5 s and the 48-byte reveal 12 bytes a
    second (4 s): a reveal arriving over 2 s is taken, one that stalls is not."""
    monkeypatch.setattr(referee_mod, "REVEAL_TIMEOUT", 0.5)
    monkeypatch.setattr(referee_mod, "REVEAL_RATE", 12.0)
    prover_host, host = await make_host(), await make_host()
    slow_prover(prover_host, 0.5)
    await host.connect(prover_host.addresses()[0])
    ref = referee(host, [])
    ref.template = {"optimizer": {"param_groups": []}, "grad_scaler": None}
    assert ref.reveal_bytes == 4 * (2 * 6)  # start and end of 6 parameters, no state
    rnd = audit_round(identities(1, "p")[0])
    # A sparse round's reveal brings the error feedback's residual too: 6 more floats.
    assert ref.transfer_s(rnd) == 4.0
    assert ref.transfer_s(audit_round(identities(1, "p")[0], sparse=True)) == 6.0
    started = time.monotonic()
    reveal = await ref._fetch(rnd, prover_host.peer_id, 0)
    assert time.monotonic() - started >= 2.0
    assert [t.tolist() for t in reveal.end_params] == [[[1.0, 1.0]] * 2, [1.0, 1.0]]

    stalling_host = await make_host()
    slow_prover(stalling_host, 0.1, stall_after=2)
    await host.connect(stalling_host.addresses()[0])
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await ref._fetch(rnd, stalling_host.peer_id, 0)
    assert 4.0 <= time.monotonic() - started < 10.0
