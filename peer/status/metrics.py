"""Prometheus metrics of one peer, served at GET /metrics.

Two kinds of series:

- Gauges and totals read from `StatusProvider.status()` at scrape time (a
  custom collector), so they never drift from /status and cost nothing between
  scrapes: shoal_step, shoal_loss, shoal_val_loss, shoal_tokens_per_second,
  shoal_bytes_sent_total, shoal_bytes_received_total,
  shoal_protocol_bytes_sent_total{protocol}, shoal_connections{kind},
  shoal_connections_trimmed_total (idle connections closed past the host's
  trim policy; /status's connections_trimmed),
  shoal_dht_peers, shoal_uptime_seconds, shoal_mfu,
  shoal_event_loop_lag_p99_seconds, shoal_event_loop_lag_max_seconds,
  shoal_device_memory_used_bytes, shoal_device_memory_total_bytes,
  shoal_version_mismatches_total (connections refused because the peer's
  protocol version is incompatible; /status's version_mismatches_total),
  shoal_access_refusals_total{reason} (connections refused by --swarm-key or
  --allow-peers; /status access.refusals_by_reason),
  shoal_oversized_refused_total{kind} (/status's oversized_refused: what peers
  sent beyond what this peer expects, refused unread) and
  shoal_info{peer_id,version,experiment,reachability} and
  shoal_device_info{kind,name} (always 1). A value the
  peer does not know yet (loss before the first step) is left out rather than
  exported as 0.
- A pipelined experiment's stages: shoal_pipeline_stage_peers{stage},
  shoal_pipeline_stage_throughput{stage}, shoal_pipeline_stage_server{stage,
  peer_id} (1 per serving peer), shoal_pipeline_serving_stage and
  shoal_pipeline_microbatches_total.
- Events the daemon reports: `observe_round()` feeds shoal_rounds_total{outcome},
  shoal_round_duration_seconds and shoal_round_group_size (histograms).

Plus the usual process_* and python_* series. Each `Metrics` has its own
CollectorRegistry, never prometheus_client's global one: several peers may live
in one process (tests), and each must export only its own numbers.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .provider import StatusProvider

__all__ = ["CONNECTION_KINDS", "Metrics"]

# Counters and histograms would each export a `*_created` series: a UNIX timestamp
# under the help text of a count, which dashboards plot as a huge number. Prometheus
# does not need it (it detects counter resets itself).
disable_created_metrics()

# Always exported, 0 when there is none, so that a dashboard's series do not vanish.
CONNECTION_KINDS = ("direct", "relayed", "holepunched")
ROUND_OUTCOMES = ("committed", "aborted")
OVERSIZED_KINDS = ("pipeline", "reveals", "state")
# Averaging rounds take from a fraction of a second (small models, LAN) to minutes.
ROUND_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
GROUP_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


class Metrics:
    """The /metrics registry of one peer."""

    def __init__(self, provider: StatusProvider) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StatusCollector(provider))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._rounds = Counter(
            "shoal_rounds",
            "Averaging rounds this peer took part in, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ROUND_OUTCOMES:  # exported as 0 before the first round
            self._rounds.labels(outcome=outcome)
        self._round_duration = Histogram(
            "shoal_round_duration_seconds",
            "Duration of averaging rounds (matchmaking done to outcome known).",
            buckets=ROUND_DURATION_BUCKETS,
            registry=self.registry,
        )
        self._round_group_size = Histogram(
            "shoal_round_group_size",
            "Number of peers in each averaging round, this one included.",
            buckets=GROUP_SIZE_BUCKETS,
            registry=self.registry,
        )

    def observe_round(self, outcome: str, duration_s: float, group_size: int) -> None:
        """Count one averaging round. `outcome` is a short fixed word ("committed", "aborted",
        ...), never free text: each distinct value is a new time series."""
        self._rounds.labels(outcome=outcome).inc()
        self._round_duration.observe(duration_s)
        self._round_group_size.observe(group_size)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StatusCollector(Collector):
    """Turns one `provider.status()` call per scrape into metric families."""

    def __init__(self, provider: StatusProvider) -> None:
        self.provider = provider

    def describe(self) -> list[Metric]:
        # Nothing to check at registration: status() may not be ready before the daemon is.
        return []

    def collect(self) -> Iterator[Metric]:
        status = self.provider.status()
        yield from _peer_metrics(status)
        yield from _device_metrics(status.get("device") or {})
        yield from _runtime_metrics(status)
        yield from _refusal_metrics(status)
        yield from _verification_metrics(status)
        pipeline = status.get("pipeline")
        if isinstance(pipeline, dict):
            yield from _pipeline_metrics(pipeline)
        yield from _connection_metrics(status)


def _peer_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """Who this peer is and how its training goes."""
    info = InfoMetricFamily("shoal", "This peer: identity, version, experiment, reachability.")
    info.add_metric(
        [],
        {
            "peer_id": str(status.get("peer_id") or ""),
            "version": str(status.get("version") or ""),
            "experiment": str(status.get("experiment") or ""),
            "reachability": str(status.get("reachability") or "unknown"),
        },
    )
    yield info
    yield from _gauge("shoal_step", "Training step of this peer.", status.get("step"))
    yield from _gauge("shoal_loss", "Last training loss of this peer.", status.get("loss"))
    yield from _gauge(
        "shoal_val_loss",
        "Mean loss of the model after the last round on the task's held-out batches "
        "(the same on every peer).",
        status.get("val_loss"),
    )
    yield from _gauge(
        "shoal_clock_skew_seconds",
        "This peer's clock minus the median of connected peers' clocks (rounds and DHT "
        "records need it within 30 s).",
        status.get("clock_skew_s"),
    )
    yield from _gauge(
        "shoal_tokens_per_second",
        "Training throughput of this peer.",
        status.get("tokens_per_s"),
    )
    yield from _gauge(
        "shoal_mfu",
        "Model FLOPs utilization of the training device (0-1; absent when its peak is unknown).",
        status.get("mfu"),
    )


def _device_metrics(device: dict[str, Any]) -> Iterator[Metric]:
    """Where this peer trains and the memory it holds there."""
    if device:
        device_info = InfoMetricFamily("shoal_device", "Where this peer trains.")
        device_info.add_metric(
            [], {"kind": str(device.get("kind")), "name": str(device.get("name"))}
        )
        yield device_info
    yield from _gauge(
        "shoal_device_memory_used_bytes",
        "Memory the training holds on its device (the process' RSS on the CPU).",
        device.get("memory_used_bytes"),
    )
    yield from _gauge(
        "shoal_device_memory_total_bytes",
        "Memory of the training device.",
        device.get("memory_total_bytes"),
    )


def _runtime_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """The daemon itself: DHT, uptime, event-loop lag, bytes over the wire."""
    yield from _gauge("shoal_dht_peers", "Peers in the DHT routing table.", status.get("dht_peers"))
    yield from _gauge(
        "shoal_uptime_seconds", "Seconds since the daemon started.", status.get("uptime_s")
    )
    lag = status.get("loop_lag_ms") or {}
    for stat in ("p99", "max"):
        value = lag.get(f"{stat}_ms")
        yield from _gauge(
            f"shoal_event_loop_lag_{stat}_seconds",
            f"How late a 10 ms ticker on the event loop ran over the last minute ({stat}).",
            None if value is None else value / 1000,
        )
    for direction in ("sent", "received"):
        value = status.get(f"bytes_{direction}")
        if _is_number(value):
            yield CounterMetricFamily(
                f"shoal_bytes_{direction}",
                f"Bytes {direction} over every connection since the daemon started.",
                value=value,
            )
    trimmed = status.get("connections_trimmed")
    if _is_number(trimmed):
        yield CounterMetricFamily(
            "shoal_connections_trimmed",
            "Idle connections closed because the host held more than its trim policy's "
            "high water (the ones idle longest first).",
            value=trimmed,
        )
    by_protocol = status.get("bytes_sent_by_protocol")
    if isinstance(by_protocol, dict) and by_protocol:
        family = CounterMetricFamily(
            "shoal_protocol_bytes_sent",
            "Stream payload sent since the daemon started, by the protocol each stream "
            "was opened for (what the uplink carries for what).",
            labels=["protocol"],
        )
        for protocol, sent in sorted(by_protocol.items()):
            if _is_number(sent):
                family.add_metric([str(protocol)], sent)
        yield family


def _refusal_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """What this peer refused: incompatible versions, private-swarm rules, oversized input."""
    mismatches = status.get("version_mismatches_total")
    if _is_number(mismatches):
        yield CounterMetricFamily(
            "shoal_version_mismatches",
            "Connections refused because the peer speaks an incompatible protocol version "
            "(see /status version_mismatches: which peers, and who must upgrade).",
            value=mismatches,
        )
    access = status.get("access")
    if isinstance(access, dict):
        refusals = CounterMetricFamily(
            "shoal_access_refusals",
            "Connections refused by this peer's private-swarm rules, by reason: swarm_key "
            "(the peer lacks our --swarm-key) or not_allowed (not in --allow-peers).",
            labels=["reason"],
        )
        by_reason = access.get("refusals_by_reason") or {}
        for reason in ("swarm_key", "not_allowed"):
            count = by_reason.get(reason, 0)
            refusals.add_metric([reason], count if _is_number(count) else 0)
        yield refusals
    oversized = status.get("oversized_refused")
    if isinstance(oversized, dict):
        refused = CounterMetricFamily(
            "shoal_oversized_refused",
            "What peers sent beyond what this peer expects (a stage request or answer, "
            "a reveal, a state's layout), refused before it was read or allocated.",
            labels=["kind"],
        )
        for kind in OVERSIZED_KINDS:
            count = oversized.get(kind, 0)
            refused.add_metric([kind], count if _is_number(count) else 0)
        yield refused


def _verification_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """Bans, convictions, audits and shuns of a verified experiment."""
    verification = status.get("verification")
    if not isinstance(verification, dict):
        return
    yield GaugeMetricFamily(
        "shoal_banned_peers",
        "Peers this peer refuses: convicted of cheating by evidence it checked.",
        value=len(verification.get("banned") or ()),
    )
    yield CounterMetricFamily(
        "shoal_convictions",
        "Convictions of this experiment that this peer checked and enforces.",
        value=len(verification.get("convictions") or ()),
    )
    audits = CounterMetricFamily(
        "shoal_audits",
        "Audits this peer ran as a referee of others' work, by result.",
        labels=["result"],
    )
    for result in ("passed", "failed"):
        count = verification.get(f"audits_{result}", 0)
        audits.add_metric([result], count if _is_number(count) else 0)
    yield audits
    shuns = verification.get("shuns", 0)
    yield CounterMetricFamily(
        "shoal_shuns",
        "Times this peer left a member out of its rounds for a while: it withheld "
        "its round secret or did not reveal its work (no evidence: no ban).",
        value=shuns if _is_number(shuns) else 0,
    )


def _connection_metrics(status: dict[str, Any]) -> Iterator[Metric]:
    """Open connections, by kind (every known kind, 0 when none)."""
    kinds = Tally(str(c.get("kind")) for c in status.get("connections") or ())
    connections = GaugeMetricFamily(
        "shoal_connections", "Open connections to other peers, by kind.", labels=["kind"]
    )
    for kind in dict.fromkeys((*CONNECTION_KINDS, *kinds)):
        connections.add_metric([kind], kinds[kind])
    yield connections


def _pipeline_metrics(pipeline: dict[str, object]) -> Iterator[Metric]:
    """A pipelined experiment: the stages, who serves them, what this peer did."""
    stages = [s for s in pipeline.get("stages") or () if isinstance(s, dict)]  # type: ignore[attr-defined]
    peers = GaugeMetricFamily(
        "shoal_pipeline_stage_peers", "Peers serving each stage of the pipeline.", labels=["stage"]
    )
    speed = GaugeMetricFamily(
        "shoal_pipeline_stage_throughput",
        "Training samples per second each stage's peers can take together (as they measure).",
        labels=["stage"],
    )
    servers = GaugeMetricFamily(
        "shoal_pipeline_stage_server",
        "1 for each peer serving a stage.",
        labels=["stage", "peer_id"],
    )
    for stage in stages:
        label = str(stage.get("stage"))
        peers.add_metric([label], len(stage.get("peer_ids") or ()))
        if _is_number(stage.get("throughput")):
            speed.add_metric([label], stage["throughput"])
        for peer in stage.get("peer_ids") or ():
            servers.add_metric([label, str(peer)], 1)
    yield from (peers, speed, servers)
    yield from _gauge(
        "shoal_pipeline_serving_stage", "The stage this peer serves.", pipeline.get("stage")
    )
    count = pipeline.get("microbatches")
    if _is_number(count):
        yield CounterMetricFamily(
            "shoal_pipeline_microbatches",
            "Microbatches this peer drove through the pipeline (a trainer) or served.",
            value=count,  # type: ignore[arg-type]
        )


def _gauge(name: str, documentation: str, value: object) -> Iterator[Metric]:
    if _is_number(value):
        yield GaugeMetricFamily(name, documentation, value=value)  # type: ignore[arg-type]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
