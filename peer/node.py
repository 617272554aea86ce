"""A running peer as others see it: its status, its reports in the DHT, its history.

`PeerNode` owns the daemon's background chores (the peer report every
`REPORT_INTERVAL_S` in the DHT, the manifest refresh, the history samples, the
swarm's history (peer/status/swarm_history.py, from the reports every
`SWARM_SAMPLE_INTERVAL_S`) and the progress line) and is the `StatusProvider`
of the HTTP endpoint.

Peer reports live under ``shoal/x/<experiment id>/peers``, one owner-signed
subkey per peer (nobody can report for another), with a short TTL so that a
peer that died drops out of /peers within `REPORT_TTL_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker, owner_of
from shoal.transport.host import Host
from shoal.transport.identity import Identity, PeerID
from shoal.transport.nat import NatManager
from shoal.transport.tasks import TaskSet

from . import __version__
from .config import Config
from .discovery import INDEX_KEY, INDEX_REFRESH, INDEX_TTL, index_entry
from .experiment import publish_manifest
from .status.clock_watch import ClockWatch
from .status.loop_lag import LoopLagMonitor
from .status.round_ledger import LEDGER_FILE, RoundLedger
from .status.swarm_history import SwarmHistory
from .verify.ban_watch import BanWatcher

if TYPE_CHECKING:
    from shoal.averaging.outer import RoundReport

    from .session import Session
    from .status.metrics import Metrics
    from .status.progress import Progress

__all__ = ["PeerNode"]

log = logging.getLogger("shoal.peer")

REPORT_INTERVAL_S = 10.0
REPORT_TTL_S = 45.0
# A report older than this is a peer that left (live peers report every
# REPORT_INTERVAL_S; the DHT keeps a record until its TTL, so it cannot say).
STALE_REPORT_S = 2.5 * REPORT_INTERVAL_S
HISTORY_INTERVAL_S = 2.0
# The swarm's history: one read of the peer reports (usually /peers' cache) per period.
SWARM_SAMPLE_INTERVAL_S = 15.0
PROGRESS_INTERVAL_S = 1.0
MANIFEST_REFRESH_S = 1800.0
PEERS_CACHE_S = 2.0

_KINDS = {"direct": "direct", "relayed": "relayed", "hole-punched": "holepunched"}


class PeerNode:
    def __init__(
        self, config: Config, identity: Identity, host: Host, nat: NatManager, dht: DHTNode
    ) -> None:
        self.config = config
        self.identity = identity
        self.host = host
        self.nat = nat
        self.dht = dht
        self.session: Session | None = None
        self.metrics: Metrics | None = None
        self.status_url: str | None = None
        self.join_command: str | None = None  # how another peer joins (the page shows it)
        self.started = time.time()
        self._tasks = TaskSet(log, "peer")
        self._peers_cache: tuple[float, list[dict[str, Any]]] | None = None
        self._peer_count = 0
        self.loop_lag = LoopLagMonitor()
        self.bans: BanWatcher | None = None  # once there is an experiment
        self.swarm_history = SwarmHistory()
        self.ledger: RoundLedger | None = None  # once there is an experiment
        self.clock = ClockWatch(host)

    def attach(self, session: Session) -> None:
        self.session = session
        session.trainer.on_round = self._on_round
        self.ledger = RoundLedger(self.config.data_dir / LEDGER_FILE, str(self.identity.peer_id))

    async def aclose(self) -> None:
        await self._tasks.aclose()
        if self.session is not None:
            if self.session.verifier is not None:
                self.session.verifier.close()
            await self.session.strategy.aclose()
            self.session.trainer.close()

    # ------------------------------------------------------------------ running

    def start_background(self, progress: Progress) -> None:
        self._tasks.spawn(self.loop_lag.run())
        self._tasks.spawn(self.clock.run())
        self._tasks.spawn(self._sample_history())
        self._tasks.spawn(self._show_progress(progress))
        if self.session is not None:
            self._tasks.spawn(self._report_loop())
            self._tasks.spawn(self._sample_swarm())
            self._tasks.spawn(self._refresh_manifest())
            self.bans = self.session.bans
            self._tasks.spawn(self.bans.run())

    async def train(self, stop: asyncio.Event) -> None:
        assert self.session is not None
        await self.session.trainer.run(stop)

    def _on_round(self, report: RoundReport) -> None:
        if self.ledger is not None and (report.round_id is not None or report.aborted_rounds):
            self.ledger.record(report)
        if self.metrics is not None:
            self.metrics.observe_round(report.outcome.value, report.duration_s, report.group_size)

    async def _sample_history(self) -> None:
        while True:
            if self.session is not None:
                s = self.session.trainer.stats
                s.history.append(
                    {
                        "t": time.time(),
                        "step": s.step,
                        "loss": s.loss,
                        "val_loss": s.val_loss,
                        "tokens_per_s": s.tokens_per_s,
                        "bytes_sent": self.host.bytes_sent,
                        "bytes_received": self.host.bytes_received,
                    }
                )
            await asyncio.sleep(HISTORY_INTERVAL_S)

    async def _sample_swarm(self) -> None:
        while True:
            try:
                self.swarm_history.record(await self.peers())
            except Exception as e:  # the next period retries
                log.debug("sampling the swarm's reports failed: %r", e)
            await asyncio.sleep(SWARM_SAMPLE_INTERVAL_S)

    async def _show_progress(self, progress: Progress) -> None:
        if self.session is None:
            return
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            progress.update(self.status())

    async def _report_loop(self) -> None:
        assert self.session is not None
        key = self.session.peers_key
        subkey = owner_marker(self.identity.peer_id)
        next_index = 0.0
        while True:
            s = self.session.trainer.stats
            report = {
                "step": s.step,
                "loss": s.loss,
                "val_loss": s.val_loss,
                "tokens_per_s": s.tokens_per_s,
                "outer_step": self.session.strategy.outer_steps,
                "addresses": [str(a) for a in self._addresses()],
                "t": time.time(),
            }
            try:
                await self.dht.store(key, report, time.time() + REPORT_TTL_S, subkey=subkey)
            except Exception as e:  # the next report retries
                log.debug("peer report failed: %r", e)
            if time.monotonic() >= next_index:
                # The network-wide index `shoal experiments` reads (peer/discovery.py).
                entry = index_entry(self.session, s.step, s.loss)
                try:
                    await self.dht.store(INDEX_KEY, entry, time.time() + INDEX_TTL, subkey=subkey)
                    next_index = time.monotonic() + INDEX_REFRESH
                except Exception as e:
                    log.debug("experiment index entry failed: %r", e)
            try:
                await self.peers()  # keeps the peer count of the progress line fresh
            except Exception as e:
                log.debug("reading peer reports failed: %r", e)
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def _refresh_manifest(self) -> None:
        # Every participant keeps the manifest alive: the host may be gone.
        assert self.session is not None
        while True:
            await asyncio.sleep(MANIFEST_REFRESH_S)
            try:
                await publish_manifest(self.dht, self.session.manifest)
            except Exception as e:
                log.debug("manifest refresh failed: %r", e)

    def _addresses(self) -> list[Any]:
        return self.host.addresses() or self.host.interface_addresses()

    # ------------------------------------------------------------------ StatusProvider

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "peer_id": str(self.identity.peer_id),
            "version": __version__,
            **self.host.versions.status(),  # protocol_version, version_mismatches, ...
            "addresses": [str(a) for a in self._addresses()],
            "reachability": self.nat.reachability.value,
            "access": self.host.access.status(),  # private swarms: mode, refusals
            "reachability_detail": self.nat.reachability_detail(),
            "connections": _connections_status(self.nat),
            # Idle connections closed past the host's trim policy (transport/trimming.py).
            "connections_trimmed": self.host.connections_trimmed,
            "dht_peers": len(self.dht.routing_table),
            "experiment": None,
            "experiment_id": None,
            "experiment_peers": self._peer_count,
            "outer_step": None,
            "last_commit_at": None,
            "join_command": None,
            "step": None,
            "loss": None,
            "val_loss": None,
            "tokens_per_s": None,
            "device": None,
            "mfu": None,
            "last_round": None,
            "bytes_sent": self.host.bytes_sent,
            "bytes_received": self.host.bytes_received,
            "bytes_sent_by_protocol": self.host.bytes_sent_by_protocol(),
            "uptime_s": time.time() - self.started,
            "loop_lag_ms": self.loop_lag.summary(time.monotonic()),
            # Ours minus the median of connected peers' clocks (None: not measured yet).
            "clock_skew_s": None if self.clock.skew_s is None else round(self.clock.skew_s, 1),
            "config": self.config.to_json(),
            "verification": self._verification_status(),
            "pipeline": None,
            "oversized_refused": self._oversized_refused(),
            "provenance": None
            if self.session is None
            else getattr(self.session.strategy, "provenance", None),
        }
        if self.session is not None and self.session.pipeline is not None:
            out["pipeline"] = self.session.pipeline.status()
        if self.session is not None:
            out.update(_session_status(self.session, self.join_command))
        return out

    def _oversized_refused(self) -> dict[str, int]:
        """What peers sent (or announced) beyond what this peer expects, refused before
        it was read or allocated: requests and answers of the pipeline, reveals of
        audited work, state downloads whose layout was not ours."""
        session = self.session
        pipeline = None if session is None else session.pipeline
        # (A pipeline stands as the strategy: its stage's state downloads.)
        state = 0 if session is None else session.strategy.oversized_refused
        verifier = None if session is None else session.verifier
        return {
            "pipeline": 0 if pipeline is None else pipeline.status_oversized_refused(),
            "reveals": 0 if verifier is None else verifier.referee.counts["reveals_oversized"],
            "state": state,
        }

    def _verification_status(self) -> dict[str, Any] | None:
        if self.bans is None:
            return None
        out: dict[str, Any] = {"enabled": False, **self.bans.status()}
        if self.session is not None and self.session.verifier is not None:
            out.update(enabled=True, **self.session.verifier.status())
        return out

    async def peers(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        if self._peers_cache is not None and now - self._peers_cache[0] < PEERS_CACHE_S:
            return self._peers_cache[1]
        out: list[dict[str, Any]] = []
        if self.session is not None:
            found = await self.dht.get(self.session.peers_key, latest=True)
            subkeys = found.subkeys if found is not None and found.subkeys else {}
            wall = time.time()
            for subkey, (report, _expiration) in subkeys.items():
                try:
                    peer = owner_of(subkey)
                except Exception:
                    continue
                if peer is None or not isinstance(report, dict):
                    continue
                if peer == self.identity.peer_id:
                    continue  # our own row comes from the live stats below, not the DHT
                row = peer_row(peer, report, wall)
                if row is not None:
                    out.append(row)
            # Our own row: what the header shows, now (our DHT record lags behind).
            s = self.session.trainer.stats
            out.append(
                {
                    "peer_id": str(self.identity.peer_id),
                    "step": s.step,
                    "loss": s.loss,
                    "val_loss": s.val_loss,
                    "tokens_per_s": s.tokens_per_s,
                    "outer_step": self.session.strategy.outer_steps,
                    "addresses": [str(a) for a in self._addresses()],
                    "updated_at": time.time(),
                    "self": True,
                }
            )
        out.sort(key=lambda p: p["peer_id"])
        self._peer_count = len(out)
        self._peers_cache = (now, out)
        return out

    def history(self) -> list[dict[str, Any]]:
        if self.session is None:
            return []
        return list(self.session.trainer.stats.history)

    def swarm(self) -> dict[str, Any]:
        return {"peers": self.swarm_history.snapshot(), "self": str(self.identity.peer_id)}


def _connections_status(nat: NatManager) -> list[dict[str, Any]]:
    """/status `connections`: one row per peer, its primary connection."""
    return [
        {
            "peer_id": c["peer"],
            "kind": _KINDS.get(str(c["kind"]), str(c["kind"])),
            "bytes_sent": c["bytes_sent"],
            "bytes_received": c["bytes_received"],
            "rtt_ms": c["rtt_ms"],
        }
        for c in nat.connection_kinds()
        if c["primary"]
    ]


def _session_status(session: Session, join_command: str | None) -> dict[str, Any]:
    """The /status keys an experiment fills in (None until this peer joins one)."""
    s = session.trainer.stats
    manifest = session.manifest
    last = s.last_round
    device, mfu = session.device_status(s.tokens_per_s)
    return {
        "device": device,
        "mfu": mfu,
        "experiment": manifest.name,
        "experiment_id": manifest.experiment_id,
        "experiment_host": str(manifest.host),
        "strategy": manifest.strategy,
        "task": manifest.task,
        "step": s.step,
        "tokens": s.tokens,
        "loss": s.loss,
        "val_loss": s.val_loss,
        "val_loss_at": s.val_loss_at,
        "tokens_per_s": s.tokens_per_s,
        "outer_step": session.strategy.outer_steps,
        "last_commit_at": s.last_commit_at,
        "join_command": join_command,
        "rounds": dict(s.rounds),
        # The frozen state's: `fingerprint()` would hash the model on the loop.
        "fingerprint": session.strategy.committed_fingerprint,
        "checkpoint_at": s.checkpoint_at,
        "checkpoint_error": s.checkpoint_error,
        "last_round": None
        if last is None
        else {
            "group_size": last.group_size,
            "duration_s": last.duration_s,
            "outcome": last.outcome.value,
            "detail": last.describe(),
            "fingerprint": last.fingerprint,
            "outer_step": last.outer_step,
            "bytes_sent": last.bytes_sent,
            "at": s.last_round_at,
            "ago_s": None if s.last_round_at is None else time.time() - s.last_round_at,
        },
    }


def peer_row(peer: PeerID, report: dict[str, Any], wall: float) -> dict[str, Any] | None:
    """Another peer's /peers row from its DHT report (untrusted: fields of the wrong type
    read as None), or None when the report is stale (the peer stopped reporting)."""
    updated = _number(report.get("t"))
    if updated is not None and wall - updated > STALE_REPORT_S:
        return None  # it stopped reporting: gone (its record outlives it)
    addresses = report.get("addresses", [])
    return {
        "peer_id": str(peer),
        "step": _number(report.get("step")),
        "loss": _number(report.get("loss")),
        "val_loss": _number(report.get("val_loss")),
        "tokens_per_s": _number(report.get("tokens_per_s")),
        "outer_step": _number(report.get("outer_step")),
        "addresses": [str(a) for a in addresses[:8]] if isinstance(addresses, list) else [],
        "updated_at": updated,
        "self": False,
    }


def _number(value: object) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value
