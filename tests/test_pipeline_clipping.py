"""Global gradient clipping across a pipeline's stages: the same update as one process."""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker, owner_of
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.clip_exchange import ClipExchange, StagesSeen, clip_key, read_claims
from shoal.pipeline.clipping import NormClaims, clip_factor, rounded, stage_squared_norm
from shoal.pipeline.options import PipelineOptions
from shoal.pipeline.server import StageServer, stage_key
from shoal.pipeline.stage import StageWorker
from shoal.pipeline.stage_optimizer import StageOptimizer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.transport.identity import Identity, PeerID

from .pipeline_swarm import EXPERIMENT as SWARM_EXPERIMENT
from .pipeline_swarm import TINY as SWARM_TINY
from .pipeline_swarm import Swarm, loop_for
from .waiting import eventually

HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}
TINY = {"d_model": 32, "n_layers": 4, "n_heads": 2, "context": 32, "batch_size": 4}
EXPERIMENT = "clip-test"


def peer() -> PeerID:
    return Identity.generate().peer_id


# ---------------------------------------------------------------- sans-I/O


def test_the_factor_from_stage_norms_is_torchs_over_the_whole_model() -> None:
    torch.manual_seed(0)
    stages = [[torch.randn(5, 3), torch.randn(7)], [torch.randn(4, 4)], [torch.randn(9)]]
    for max_norm in (0.5, 1e3):
        whole = [g.clone().requires_grad_() for s in stages for g in s]
        for w in whole:
            w.grad = w.detach().clone()
        norm = float(torch.nn.utils.clip_grad_norm_(whole, max_norm))
        factor = clip_factor((stage_squared_norm(s) for s in stages), max_norm)
        assert factor == pytest.approx(min(1.0, max_norm / (norm + 1e-6)), rel=1e-6)
        flat = torch.cat([g.reshape(-1) for s in stages for g in s]) * factor
        assert torch.allclose(flat, torch.cat([w.grad.reshape(-1) for w in whole]), rtol=1e-6)
    assert clip_factor([0.25, 0.75], 10.0) == 1.0  # below the threshold: untouched


def test_a_stage_norm_settles_on_what_its_honest_peers_agree_despite_a_liar() -> None:
    a, b, liar = peer(), peer(), peer()
    claims = NormClaims(3)
    assert claims.add(1, liar, 1e30, 2)
    assert claims.settled(1) is None  # a lone claim of a step of two peers: not enough
    assert claims.add(1, a, 4.0, 2)
    assert claims.settled(1) is None  # one against one: a tie settles nothing
    assert claims.add(1, b, 4.0, 2)
    assert claims.settled(1) == 4.0 and claims.disputed(1) == [liar]


def test_a_lone_liar_cannot_make_up_the_norm_of_a_stage_whose_step_had_two_peers() -> None:
    honest, liar = peer(), peer()
    claims = NormClaims(2)
    claims.add(0, liar, 0.0, 2)
    claims.add(0, honest, 9.0, 2)
    assert claims.settled(0) is None
    # The deadline: the disputed stage counts as missing, the step clips by the others'.
    decision = claims.decide(1.0, (1, 16.0), final=True)
    assert decision is not None and decision.fell_back
    assert decision.factor == pytest.approx(1.0 / (4.0 + 1e-6))
    assert claims.decide(1.0, (1, 16.0)) is None  # before the deadline: wait


def test_a_liar_claiming_first_as_a_solo_step_sets_nothing_where_two_peers_serve() -> None:
    honest, liar = peer(), peer()
    claims = NormClaims(2)
    claims.add(0, liar, 1e30, 1)
    assert claims.settled(0, serving=1) == rounded(1e30)  # (a stage only it serves: its own)
    assert claims.settled(0, serving=2) is None  # the records show a second peer
    claims.add(0, honest, 9.0, 1)
    assert claims.settled(0, serving=2) is None  # one against one: the deadline decides
    claims.add(0, peer(), 9.0, 1)
    assert claims.settled(0, serving=3) == 9.0
    decision = claims.decide(1.0, (1, 16.0), [3, 1])
    assert decision is not None and decision.factor == pytest.approx(1 / (5.0 + 1e-6))


def test_a_read_that_misses_the_honest_records_does_not_let_a_liar_settle_the_stage() -> None:
    """A read of the stage records can miss some (replicas that did not answer in time):
    one that found only the liar's record of a stage would let its lone claim settle it,
    and drop the honest peers' claims as strangers'. Any earlier read of the step, or
    of the step before, still counts."""
    a, b, liar = peer(), peer(), peer()
    full, partial = StagesSeen(), StagesSeen()
    full.add({owner_marker(p): ({"version": 3}, 0.0) for p in (a, b, liar)}, 3)
    partial.add({owner_marker(liar): ({"version": 3}, 0.0)}, 3)
    claims = NormClaims(1)
    read = {owner_marker(p): ({"stage": 0, "sq": sq, "group": g}, 0.0)
            for p, sq, g in ((a, 4.0, 2), (b, 4.0, 2), (liar, 1e30, 1))}  # fmt: skip
    alone = NormClaims(1)
    read_claims(read, alone, partial.members)
    assert alone.settled(0, partial.serving[0]) == rounded(1e30)  # the partial read, alone
    seen = partial.merged(full)
    assert seen.members == full.members and seen.serving == [3] and seen.newest == [3]
    read_claims({owner_marker(liar): read[owner_marker(liar)]}, claims, seen.members)
    assert claims.settled(0, seen.serving[0]) is None  # the liar alone: not settled
    read_claims(read, claims, seen.members)
    assert claims.settled(0, seen.serving[0]) == 4.0
    # A peer that a later read shows leaving (its record no longer ready) is not
    # counted from the earlier read: the stage then needs its remaining peers only.
    left = StagesSeen()
    left.add({owner_marker(a): ({"version": 3}, 0.0),
              owner_marker(b): ({"version": 3, "ready": False}, 0.0)}, 3)  # fmt: skip
    assert left.merged(full).ready == [{a, liar}]
    assert left.merged(full).merged(partial).ready == [{a, liar}]


def test_a_peer_whose_record_is_past_the_step_without_a_claim_is_not_waited_for() -> None:
    """A round can commit for one peer of a stage while another's aborts (it missed the
    decision): the latter takes no step, claims nothing, and re-syncs past it. Its own
    record then says so, and its partner's claim, of a group of two, settles alone."""
    a, b = peer(), peer()
    claims = NormClaims(1)
    claims.add(0, a, 4.0, 2)
    for b_version, settled in ((7, None), (6, None), (8, 4.0), (9, 4.0)):
        seen = StagesSeen()
        seen.add({owner_marker(a): ({"version": 8}, 0.0),
                  owner_marker(b): ({"version": b_version}, 0.0)}, 7)  # fmt: skip
        serving, skipped = seen.counts(claims)
        assert claims.settled(0, serving[0], skipped[0]) == settled, b_version
    # Past the step with a claim: counted as ever (here a second honest one).
    claims.add(0, b, 4.0, 2)
    assert seen.counts(claims) == ([2], [0]) and claims.settled(0, 2) == 4.0
    # Being past the last step says nothing of this one.
    earlier = StagesSeen()
    earlier.add({owner_marker(b): ({"version": 8}, 0.0)}, 7)
    now = StagesSeen()
    now.add({owner_marker(b): ({"version": 8}, 0.0)}, 8)
    assert now.merged(earlier, versions=False).past == [set()]
    assert now.merged(earlier).past == [{b}]  # (two reads of one step: it stays past)


def test_only_a_peers_own_record_makes_it_skip_a_step_so_a_liar_still_settles_nothing() -> None:
    """A liar's lone claim, as a solo step, where an honest peer serves the stage: while
    the honest peer's record is at the step it is waited for (its claim may come), and a
    liar whose own record is past the step skips only itself."""
    honest, liar = peer(), peer()
    claims = NormClaims(1)
    claims.add(0, liar, 1e30, 1)
    seen = StagesSeen()
    seen.add({owner_marker(honest): ({"version": 7}, 0.0),
              owner_marker(liar): ({"version": 9}, 0.0)}, 7)  # fmt: skip
    serving, skipped = seen.counts(claims)
    assert (serving, skipped) == ([2], [0])  # (the liar claimed: it did not skip)
    assert claims.settled(0, serving[0], skipped[0]) is None
    claims.add(0, honest, 9.0, 2)
    assert claims.settled(0, *[c[0] for c in seen.counts(claims)]) is None  # a tie


def test_claims_that_are_no_squared_norm_are_refused() -> None:
    claims = NormClaims(2)
    for bad in (-1.0, math.nan, math.inf, 1e300, "1.0", True, None):
        assert not claims.add(0, peer(), bad, 1)
    assert not claims.add(2, peer(), 1.0, 1)  # no such stage
    assert not claims.add(0, peer(), 1.0, 0) and not claims.add(0, peer(), 1.0, 1 << 20)
    assert claims.settled(0) is None


def test_a_solo_stage_settles_on_its_one_claim_and_claims_are_rounded_alike() -> None:
    claims = NormClaims(2)
    claims.add(0, peer(), 2.0000000001, 1)
    assert claims.settled(0) == rounded(2.0000000001) == 2.0
    decision = claims.decide(1.0, (1, 2.0))
    assert decision is not None and not decision.fell_back
    assert decision.factor == pytest.approx(1.0 / (2.0 + 1e-6))


def test_max_grad_norm_is_off_by_default_and_refused_out_of_range() -> None:
    assert PipelineOptions.parse({}).max_grad_norm is None
    assert PipelineOptions.parse({"max_grad_norm": 1.0}).max_grad_norm == 1.0
    for bad in (0, -1.0, 1e7, math.inf, math.nan, "1", True):
        with pytest.raises(ValueError, match="max_grad_norm"):
            PipelineOptions.parse({"max_grad_norm": bad})


# ---------------------------------------------------------------- over the DHT


async def _dht(make_host: Callable[..., Any], nodes: list[DHTNode]) -> DHTNode:
    host = await make_host(**HOST_OPTS)
    boot = [str(nodes[0].host.addresses()[0])] if nodes else []
    node = await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0)
    nodes.append(node)
    return node


@pytest.mark.timeout(60)
async def test_a_stage_whose_norm_never_comes_counts_as_missing_after_the_deadline(
    make_host: Callable[..., Any],
) -> None:
    """Stage 1's peer is at our version but does not claim: missing after the deadline
    (and said so when its claim comes late). Once nobody serves stage 1, it is missing
    after a short wait (no claim can come)."""
    nodes: list[DHTNode] = []
    servers: list[StageServer] = []
    try:
        for s in (0, 1):
            server = StageServer(await _dht(make_host, nodes), EXPERIMENT, s,
                                 StageWorker(torch.nn.Linear(2, 2)))  # fmt: skip
            server.set_version(7)
            await server.start()
            servers.append(server)
        exchange = ClipExchange(nodes[0], EXPERIMENT, 0, 2, 1.0, deadline_s=1.0)
        started = time.monotonic()
        factor = await exchange.factor(7, 16.0, 1)
        assert time.monotonic() - started >= 1.0
        assert factor == pytest.approx(1.0 / (4.0 + 1e-6)) and exchange.fallbacks == 1
        assert exchange.status()["factor_version"] == 7
        # Stage 1's norm of step 7 comes late, and its norm of step 8 in time: step 8
        # waits for nobody, and says that step 7's factor would have been another.
        claim = {"stage": 1, "sq": 9.0, "group": 1}
        for v in (7, 8):
            await nodes[1].store(clip_key(EXPERIMENT, v), claim, time.time() + 60,
                                 subkey=owner_marker(nodes[1].peer_id))  # fmt: skip
        assert await exchange.factor(8, 16.0, 1) == pytest.approx(1.0 / (5.0 + 1e-6))
        assert exchange.fallbacks == 1 and exchange.status()["late_norms"] == 1
        await servers.pop().aclose()  # (its record: None, nobody serves stage 1 now)
        exchange.deadline_s = 30.0
        started = time.monotonic()
        assert await exchange.factor(9, 16.0, 1) == pytest.approx(1.0 / (4.0 + 1e-6))
        assert time.monotonic() - started < 15.0 and exchange.fallbacks == 2
    finally:
        for server in servers:
            await server.aclose()
        for n in nodes:
            await n.aclose()


@pytest.mark.timeout(60)
async def test_a_claim_no_replica_took_is_stored_again_while_its_stage_waits(
    make_host: Callable[..., Any],
) -> None:
    """A store that reached no replica (a loaded machine's lookup timed out) would leave
    every other stage without our norm until its deadline, the DHT's republishing being
    minutes away: the exchange stores it again while it waits. (A CI run of the
    four-stage test fell back after 20 s on one stage's norm, seen by nobody.)"""
    nodes: list[DHTNode] = []
    servers: list[StageServer] = []
    try:
        for s in (0, 1):
            server = StageServer(await _dht(make_host, nodes), EXPERIMENT, s,
                                 StageWorker(torch.nn.Linear(2, 2)))  # fmt: skip
            server.set_version(7)
            await server.start()
            servers.append(server)
        real_store, failed = nodes[1].store, []

        async def first_store_fails(key: str, *args: Any, **kwargs: Any) -> bool:
            if key == clip_key(EXPERIMENT, 7) and not failed:
                failed.append(key)
                return False  # (stored nowhere)
            return await real_store(key, *args, **kwargs)

        nodes[1].store = first_store_fails  # type: ignore[method-assign]
        exchanges = [ClipExchange(nodes[s], EXPERIMENT, s, 2, 1.0, deadline_s=20.0)
                     for s in (0, 1)]  # fmt: skip
        factors = await asyncio.gather(exchanges[0].factor(7, 16.0, 1),
                                       exchanges[1].factor(7, 9.0, 1))  # fmt: skip
        assert failed and factors[0] == factors[1] == pytest.approx(1.0 / (5.0 + 1e-6))
        assert exchanges[0].fallbacks == exchanges[1].fallbacks == 0
    finally:
        for server in servers:
            await server.aclose()
        for n in nodes:
            await n.aclose()


@pytest.mark.timeout(60)
async def test_a_stage_peer_that_re_synced_past_a_step_is_not_waited_for(
    make_host: Callable[..., Any],
) -> None:
    """Stage 1 has two peers at version 7. One commits the step from 7 and claims it for
    a group of two; the other's round aborted. While the latter's record names version 7
    its claim may still come: the step waits, up to the deadline. Once it re-synced past
    the step (its record names 9), nobody waits for it."""
    nodes: list[DHTNode] = []
    servers: list[StageServer] = []
    try:
        for s in (0, 1, 1):
            server = StageServer(await _dht(make_host, nodes), EXPERIMENT, s,
                                 StageWorker(torch.nn.Linear(2, 2)))  # fmt: skip
            server.set_version(7)
            await server.start()
            servers.append(server)
        committed, aborted = nodes[1], servers[2]
        claim = {"stage": 1, "sq": 9.0, "group": 2}
        for v in (7, 8):
            await committed.store(clip_key(EXPERIMENT, v), claim, time.time() + 60,
                                  subkey=owner_marker(committed.peer_id))  # fmt: skip
        exchange = ClipExchange(nodes[0], EXPERIMENT, 0, 2, 1.0, deadline_s=1.0)
        assert await exchange.factor(7, 16.0, 1) == pytest.approx(1.0 / (4.0 + 1e-6))
        assert exchange.fallbacks == 1  # (the lone claim of a group of two: not enough)
        aborted.set_version(9)
        await aborted.announce()
        exchange.deadline_s = 30.0
        started = time.monotonic()
        assert await exchange.factor(8, 16.0, 1) == pytest.approx(1.0 / (5.0 + 1e-6))
        assert time.monotonic() - started < 15.0 and exchange.fallbacks == 1
        assert not exchange.disputed
    finally:
        for server in servers:
            await server.aclose()
        for n in nodes:
            await n.aclose()


def _reference_step(
    stages: list[torch.nn.Module], opts: list[torch.optim.Optimizer], total: int, max_norm: float
) -> float:
    """One process: the mean gradient over the step's samples, clipped over the whole model."""
    params = [p for m in stages for p in m.parameters()]
    for p in params:
        p.grad /= total
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return norm


@pytest.mark.timeout(120)
async def test_clipping_across_stages_gives_one_process_clip_grad_norm_update(
    make_host: Callable[..., Any],
) -> None:
    """Four stages (the second served by two peers), a trainer, two steps: the first
    with the whole model's gradient norm below `max_grad_norm`, the second above it.
    Every stage scales by torch's factor over the whole model, and the parameters are
    one process's that clips with `clip_grad_norm_` (and visibly not unclipped ones).
    Lies change nothing: a stranger's claim of an enormous norm for stage 0, nor one
    from a peer announced in stage 1 (whose two honest peers outvote it)."""
    task = make_task(TINY)
    modules = task.make_stages(5, 4)
    layout = [0, 1, 1, 2, 3]  # the stage of each peer
    nodes: list[DHTNode] = []
    servers: list[StageServer] = []
    optimizers: list[StageOptimizer] = []
    hyper = {"lr": 1e-2, "weight_decay": 0.1}
    try:
        trainer_dht = await _dht(make_host, nodes)
        exchanges = []
        for s in layout:
            dht = await _dht(make_host, nodes)
            server = StageServer(dht, EXPERIMENT, s, StageWorker(copy.deepcopy(modules[s])))
            await server.start()
            servers.append(server)
            size = layout.count(s)
            mm = MatchmakingConfig(min_group_size=size, target_group_size=size,
                                   matchmaking_time=1.0, min_matchmaking_time=0.05)  # fmt: skip
            opt = StageOptimizer(dht, EXPERIMENT, s, server.worker, hyper=hyper, matchmaking=mm)
            exchange = ClipExchange(dht, EXPERIMENT, s, 4, 1e3, deadline_s=20.0)
            opt.clip = exchange.factor
            optimizers.append(opt)
            exchanges.append(exchange)
        stranger, liar = await _dht(make_host, nodes), await _dht(make_host, nodes)
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 4, deadline=10.0, codec="none")
        assert await trainer.refresh() == [1, 2, 1, 1]
        # The liar announces itself in stage 1 (after the trainer read the records: it
        # serves nothing), at the stage's version.
        await liar.store(stage_key(EXPERIMENT, 1), {"version": 1, "ready": True},
                         time.time() + 60, subkey=owner_marker(liar.peer_id))  # fmt: skip
        clipped = [copy.deepcopy(m) for m in modules]
        unclipped = [copy.deepcopy(m) for m in modules]
        refs = {
            id(ms): [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in ms]
            for ms in (clipped, unclipped)
        }
        batches = task.batches(0, 1, 0)
        for step, max_norm in enumerate((1e3, 0.05)):
            total = 0
            for mb in range(4):
                batch = next(batches)
                await trainer.run(step * 4 + mb, task.stage_inputs(batch),
                                  lambda y, b=batch: task.stage_loss(y, b))  # fmt: skip
                for ms in (clipped, unclipped):
                    y = task.stage_inputs(batch)
                    for m in ms:
                        y = m(y)
                    (task.stage_loss(y, batch) * len(batch)).backward()
                total += len(batch)
            norm = _reference_step(clipped, refs[id(clipped)], total, max_norm)
            _reference_step(unclipped, refs[id(unclipped)], total, 1e9)
            for who, stage in ((stranger, 0), (liar, 1)):
                lie = {"stage": stage, "sq": 1e30, "group": 1}
                await who.store(clip_key(EXPERIMENT, step), lie, time.time() + 60,
                                subkey=owner_marker(who.peer_id))  # fmt: skip
            for exchange in exchanges:
                exchange.max_norm = max_norm
            results = await asyncio.gather(*(o.step(timeout=30.0) for o in optimizers))
            assert all(r.committed for r in results), results
            want = min(1.0, max_norm / (norm + 1e-6))
            assert (want == 1.0) == (step == 0)  # below the threshold, then above it
            for exchange in exchanges:
                last = exchange.decided[-1]
                if last.decision.fell_back:  # (what the DHT holds now, for the failure's reader)
                    held = await _clip_records(exchange.dht, step)
                    raise AssertionError(f"stage {exchange.stage} fell back: {last}; {held}")
                assert last.version == step
                assert last.decision.factor == pytest.approx(want, rel=1e-5)
                assert exchange.disputed <= {liar.peer_id}  # (seen by who read it in time)
        assert any(liar.peer_id in e.disputed for e in exchanges)
        assert optimizers[1].fingerprint() == optimizers[2].fingerprint()
        for opt, s in zip(optimizers, layout, strict=True):
            got = torch.cat([p.detach().reshape(-1) for p in opt.params])
            want_clipped = torch.cat([p.detach().reshape(-1) for p in clipped[s].parameters()])
            plain = torch.cat([p.detach().reshape(-1) for p in unclipped[s].parameters()])
            # One process sums the gradients in another order; where a gradient is ~0,
            # Adam's normalized step can flip its sign: a few elements at most.
            apart = int(((got - want_clipped).abs() > 1e-5).sum())
            assert apart <= got.numel() // 500, (s, apart, got.numel())
            assert int(((got - plain).abs() > 1e-5).sum()) > got.numel() // 10  # it clipped
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        for server in servers:
            await server.aclose()
        for n in nodes:
            await n.aclose()


async def _clip_records(dht: DHTNode, step: int) -> str:
    """Who holds a record of each stage, and who claimed which stage's norm for `step`,
    as `dht` reads them now (peers by the end of their ID)."""
    keys = [stage_key(EXPERIMENT, s) for s in range(4)] + [clip_key(EXPERIMENT, step)]
    fields = ("stage", "sq", "group", "version", "ready")
    found = await dht.get_many(keys, latest=True)
    out = []
    for key in keys:
        value = found.get(key)
        subkeys = (value.subkeys or {}) if value is not None else {}
        shown = {
            owner_of(sub).short(): {k: v for k, v in record.items() if k in fields}
            for sub, (record, _) in subkeys.items()
            if isinstance(record, dict)
        }
        out.append(f"{key}: {shown}")
    return "; ".join(out)


@pytest.mark.timeout(90)
async def test_stage_peers_training_with_clipping_all_scale_each_step_by_one_factor(
    make_host: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Stage peers and a trainer loop as a daemon runs them (stage 1 served by two
    peers, a batch ahead): for every step, every peer of every stage scales by the same
    factor, nobody falls back, and the peers of a stage keep equal states."""
    # Once in a local CI run a stage's norm came 30 s late (its step had waited out
    # most of a step timeout): a failure shows the stage peers' INFO lines (a step
    # that did not commit says why there).
    caplog.set_level(logging.INFO, logger="shoal.pipeline")
    task = make_task(SWARM_TINY)
    swarm = Swarm(make_host)
    try:
        exchanges: list[ClipExchange] = []
        for k, module in enumerate(task.make_stages(5, 3)):
            for _ in range(2 if k == 1 else 1):
                peer = await swarm.stage_peer(k, module, global_batch=8)
                exchange = ClipExchange(peer.server.dht, SWARM_EXPERIMENT, k, 3, 0.5)
                peer.optimizer.clip = exchange.factor
                exchanges.append(exchange)
        trainer = await swarm.trainer(3, codec="none")
        await loop_for(trainer, task, shard=0, global_batch=8, lag=1).run(steps=3)
        for v in range(3):
            factors = {d.decision.factor for e in exchanges for d in e.decided if d.version == v}
            assert len(factors) == 1, (v, factors)
        assert all(e.fallbacks == 0 and not e.disputed for e in exchanges)
        assert all(d.decision.factor < 1.0 for e in exchanges for d in e.decided)  # it clipped
        a, b = swarm.of_stage(1)
        # (The slower peer may still be applying its step: a version counts a step
        # before it is applied, and its state frozen.)
        await eventually(
            lambda: (
                a.version == b.version
                and a.optimizer.averager.last_fingerprint_commits == a.version
                and b.optimizer.averager.last_fingerprint_commits == b.version
            ),
            "stage 1's peers at one version, applied",
            20,
        )
        assert a.optimizer.fingerprint() == b.optimizer.fingerprint()
    finally:
        trainer.close()
        await swarm.aclose()
