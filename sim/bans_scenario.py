"""The bans workload: verification's reach at scale, with the real ban code.

Every peer runs the daemon's `BanWatcher` (it reads its experiment's convictions from
the DHT every `refresh_s`, checks each offline and blocks the convicted peer on its
host), newcomers from their first moment. After `warmup_s`, a referee of a round
publishes a real conviction of one live peer (four members' signed commitments and
revealed secrets, two referees' signed FAIL verdicts: what `Dispute.evidence` makes),
exactly as `peer/verify/referee.py` does. Peers churn throughout (the scenario's
sessions, each leaver replaced by a newcomer).

Figures:
- `ban_coverage`: of the peers live `periods` refresh periods after the conviction was
  published (the cheater aside) that had been live for a refresh period by then, the
  fraction that ban it by then; also after one period, and when 95% and 100% of them
  did. Newcomers younger than a period are counted apart (`too_new`: how many, and
  how many of them banned already): one that joined a second before the deadline has
  had no time to read, and with 2-minute sessions there are one or two of them in a
  40-peer run, a 5% swing in a figure whose bar is 95%;
- `audit_fraction`: the rounds' real draws (`RoundDraw`, members' identities and
  secrets) over `audit_rounds` rounds of the live peers in groups of `group_size`:
  the fraction of contributions drawn for an audit at `audit_rate` (and the binomial
  standard error it should be within);
- the DHT's cost of watching: requests per peer per minute, and the most requests one
  peer served per second (the convictions key's replicas carry every peer's reads).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
from typing import Any

from dht_scenario import DHTRun, SimPeer, percentile

from shoal.peer.verify.ban_watch import BAN_REFRESH_S, BanWatcher
from shoal.transport.identity import Identity, PeerID
from shoal.verification.bans import READ_REPLICAS, publish
from shoal.verification.commitment import Commitment
from shoal.verification.disputes import Dispute, Outcome
from shoal.verification.evidence import Evidence, Result, Verdict
from shoal.verification.referees import RoundDraw, seed_commit

log = logging.getLogger("sim.bans")

EXPERIMENT = "sim/bans"


async def run_bans(scenario: Any, net: Any, rng: random.Random) -> dict[str, Any]:
    w = scenario.workload
    loop = asyncio.get_running_loop()
    refresh = float(w.get("refresh_s", BAN_REFRESH_S))
    periods = float(w.get("periods", 2))
    logging.getLogger("shoal.verification.bans").setLevel(logging.ERROR)  # (a line per peer)
    # `read_replicas` null: every replica, each read (as before sampled reads).
    watch = Watch(refresh, w.get("read_replicas", READ_REPLICAS))
    run = DHTRun(scenario, net, rng, on_join=watch.start, on_leave=watch.stop)
    await run.join_all(scenario.peers, float(w.get("join_window_s", 60.0)))
    await asyncio.sleep(float(w.get("settle_s", 30.0)))
    log.warning("joined: virtual %.1f s, %d live peers", loop.time(), len(run.live()))
    churn = loop.create_task(run.churn(float(w.get("warmup_s", 30.0)) + periods * refresh + 30))
    await asyncio.sleep(float(w.get("warmup_s", 30.0)))
    requests0, served0, t0 = run.requests_sent(), served(run), loop.time()

    members = rng.sample([p for p in run.live() if p.index != 0], 4)
    cheater, referee = members[0], members[1]
    evidence = conviction(members)
    published = await run.on(referee, publish(referee.node, evidence))  # type: ignore[arg-type]
    at = loop.time()
    log.warning("conviction published (%s) at virtual %.1f s", published, at)
    await asyncio.sleep(periods * refresh)
    deadline = loop.time()
    live = [p for p in run.live() if p is not cheater]
    judges = [p for p in live if watch.started_at[p.index] <= deadline - refresh]
    too_new = [p for p in live if p not in judges]
    delays = [watch.banned_at[p.index] - at for p in judges if p.index in watch.banned_at]
    within_one = sum(1 for d in delays if d <= refresh)
    busiest = max((n - served0.get(i, 0) for i, n in served(run).items()), default=0)
    elapsed = loop.time() - t0
    churn.cancel()
    await asyncio.gather(churn, return_exceptions=True)
    result = {
        "peers": scenario.peers,
        "peers_live_at_deadline": len(live) + (1 if cheater.live else 0),
        "departures": run.departures,
        "arrivals": run.arrivals,
        "refresh_s": refresh,
        "published": published,
        "ban_coverage": round(len(delays) / len(judges), 4),
        "ban_coverage_after_one_period": round(within_one / len(judges), 4),
        "too_new": {
            "peers": len(too_new),
            "banned": sum(1 for p in too_new if p.index in watch.banned_at),
        },
        "ban_s_p95": _time_to(delays, len(judges), 0.95),
        "ban_s_all": _time_to(delays, len(judges), 1.0),
        "ban_s_p50": None if not delays else round(percentile(delays, 0.5) or 0, 2),
        "cheater_knows": watch.convicted_self(cheater),
        "dht_requests_per_peer_per_min": round(
            (run.requests_sent() - requests0) / len(run.live()) / (elapsed / 60), 1
        ),
        "busiest_peer_requests_per_s": round(busiest / elapsed, 1),
        "audit_fraction": audit_fraction(run.live(), w, rng),
        "deadline_virtual_s": round(deadline, 2),
    }
    watch.stop_all()
    await run.close()
    result["virtual_s"] = round(loop.time(), 3)
    return result


class Watch:
    """A `BanWatcher` per live peer, and when each first banned someone."""

    def __init__(self, refresh: float, read_replicas: int | None) -> None:
        self.refresh = refresh
        self.read_replicas = read_replicas
        self.watchers: dict[int, BanWatcher] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.banned_at: dict[int, float] = {}
        self.started_at: dict[int, float] = {}  # (when each peer's watcher began)

    def start(self, peer: SimPeer) -> None:
        assert peer.node is not None
        self.started_at[peer.index] = asyncio.get_running_loop().time()
        watcher = BanWatcher(
            peer.node, EXPERIMENT, interval=self.refresh, read_replicas=self.read_replicas
        )
        enforce = watcher.enforce

        def timed(evidence: Evidence) -> PeerID | None:  # when it took effect here
            banned = enforce(evidence)
            if banned is not None and peer.index not in self.banned_at:
                self.banned_at[peer.index] = asyncio.get_running_loop().time()
            return banned

        watcher.enforce = timed  # type: ignore[method-assign]
        self.watchers[peer.index] = watcher
        self.tasks[peer.index] = DHTRun.on(peer, watcher.run())

    def stop(self, peer: SimPeer) -> None:
        task = self.tasks.pop(peer.index, None)
        if task is not None:
            task.cancel()

    def stop_all(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    def convicted_self(self, peer: SimPeer) -> bool:
        watcher = self.watchers.get(peer.index)
        return watcher is not None and watcher.convicted_self


def served(run: DHTRun) -> dict[int, int]:
    return {p.index: p.node.count("requests_served", 0) for p in run.peers if p.node}


def conviction(members: list[SimPeer]) -> Evidence:
    """A conviction of `members[0]` in a round of `members`, by two of its referees: the
    bundle a referee publishes (`Dispute.evidence`), signed by the peers' own keys."""
    ids: list[Identity] = [p.host.identity for p in members]  # type: ignore[union-attr]
    secrets = {i.peer_id: hashlib.sha256(b"secret" + i.peer_id.to_bytes()).digest() for i in ids}
    digest = hashlib.sha256(b"sim").digest()

    def commit(me: Identity) -> Commitment:
        c = Commitment(EXPERIMENT, me.peer_id, 3, digest, digest, 0, 4, 2, (digest, digest),
                       digest, 1, b"", seed_commit(secrets[me.peer_id]))  # fmt: skip
        return c.signed(me)

    commitments = [commit(i) for i in ids]
    dispute = Dispute(commitments[0], RoundDraw.from_reveals(commitments, secrets))
    by_peer = {i.peer_id: i for i in ids}
    for referee in dispute.referees[:2]:
        verdict = Verdict(referee, dispute.digest, dispute.segment, digest, Result.FAIL, 9, 64)
        dispute.add(verdict.signed(by_peer[referee]))
    assert dispute.outcome is Outcome.CONVICTED
    return dispute.evidence(commitments, secrets)


def audit_fraction(peers: list[SimPeer], w: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The real draw of `audit_rounds` rounds of `peers` in groups of `group_size`: the
    fraction of contributions audited at `audit_rate`, with its binomial standard error."""
    rate, size = float(w.get("audit_rate", 0.1)), int(w.get("group_size", 16))
    rounds = int(w.get("audit_rounds", 10))
    ids = [p.host.identity for p in peers if p.host is not None]
    audited = total = 0
    for r in range(rounds):
        rng.shuffle(ids)
        for g in range(0, len(ids) - 1, size):
            group = ids[g : g + size]
            secrets = {i.peer_id: rng.randbytes(32) for i in group}
            commitments = [_bare_commitment(i.peer_id, r, secrets[i.peer_id]) for i in group]
            draw = RoundDraw.from_reveals(commitments, secrets)
            audited += sum(draw.audited(m, rate) for m in draw.members)
            total += len(group)
    error = math.sqrt(rate * (1 - rate) / total) if total else None
    return {
        "rate": rate,
        "contributions": total,
        "audited": round(audited / total, 4) if total else None,
        "standard_error": None if error is None else round(error, 4),
    }


def _bare_commitment(peer: PeerID, round_index: int, secret: bytes) -> Commitment:
    """A commitment with what a round's draw reads: the member, the round, the seed commit."""
    h = bytes(32)
    return Commitment(EXPERIMENT, peer, round_index, h, h, 0, 1, 1, (h,), h, 1, b"",
                      seed_commit(secret))  # fmt: skip


def _time_to(delays: list[float], of: int, share: float) -> float | None:
    """Seconds after the publication by which `share` of `of` peers banned (None: never)."""
    need = math.ceil(share * of)
    if need == 0 or len(delays) < need:
        return None
    return round(sorted(delays)[need - 1], 2)
