"""Finding a swarm: an index of live experiments in the DHT, and `shoal experiments`.

Every training peer keeps an entry in the DHT dictionary `shoal/experiments`
under its own owner-signed subkey (so nobody can write or erase another's):
which experiment it trains (`NAME@HOST` and its ID), the round its state is at,
its step and loss. Entries live `INDEX_TTL` seconds and are renewed every
`INDEX_REFRESH`; a peer that leaves drops out with its entry. Listing groups
the entries by experiment and checks each experiment's manifest (signed by its
host) before showing it, so an entry cannot make up a task or a strategy.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from shoal.averaging.registry import is_pipeline
from shoal.dht.node import DHTNode
from shoal.dht.records import owner_of
from shoal.pipeline import options as _pipeline_options  # noqa: F401  (registers the pipeline)

from .experiment import ManifestError, find_manifest, parse_experiment_ref

__all__ = ["INDEX_KEY", "INDEX_REFRESH", "INDEX_TTL", "format_experiments", "list_experiments"]

INDEX_KEY = "shoal/experiments"
INDEX_TTL = 180.0
INDEX_REFRESH = 60.0
MANIFEST_TIMEOUT = 5.0


def index_entry(session: Any, step: int, loss: float | None) -> dict[str, Any]:
    m = session.manifest
    return {
        "ref": str(m.ref),
        "id": m.experiment_id,
        "round": session.strategy.outer_steps,
        "step": step,
        "loss": loss,
        "t": time.time(),
    }


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


async def list_experiments(dht: DHTNode) -> list[dict[str, Any]]:
    """The experiments with live peers in the network, newest activity first."""
    found = await dht.get(INDEX_KEY, latest=True)
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for subkey, (entry, _) in ((found.subkeys or {}) if found else {}).items():
        try:
            peer = owner_of(subkey)
        except Exception:
            continue
        if peer is None or not isinstance(entry, dict) or not isinstance(entry.get("ref"), str):
            continue
        groups.setdefault(entry["ref"], []).append((str(peer), entry))
    rows = await asyncio.gather(*(_row(dht, ref, entries) for ref, entries in groups.items()))
    out = [r for r in rows if r is not None]
    out.sort(key=lambda r: (-r["peers"], r["experiment"]))
    return out


async def _row(
    dht: DHTNode, ref_text: str, entries: list[tuple[str, dict[str, Any]]]
) -> dict[str, Any] | None:
    try:
        ref = parse_experiment_ref(ref_text)
        manifest = await find_manifest(dht, ref, timeout=MANIFEST_TIMEOUT)
    except (ManifestError, ValueError):
        return None  # no valid manifest behind it: not an experiment anyone can join
    mine = [e for _, e in entries if e.get("id") == manifest.experiment_id]
    if not mine:
        return None
    losses = [x for x in (_number(e.get("loss")) for e in mine) if x is not None]
    rounds = [x for x in (_number(e.get("round")) for e in mine) if x is not None]
    steps = [x for x in (_number(e.get("step")) for e in mine) if x is not None]
    return {
        "experiment": str(manifest.ref),
        "name": manifest.name,
        "id": manifest.experiment_id,
        "task": manifest.task,
        "task_config": manifest.task_config,
        "strategy": manifest.strategy,
        "strategy_options": manifest.strategy_options,
        "precision": manifest.hyperparameters.get("precision", "fp32"),
        "verification": manifest.strategy_options.get("verify"),
        "pipeline": manifest.strategy_options.get("stages")
        if is_pipeline(manifest.strategy)
        else None,
        "peers": len({p for p, e in entries if e.get("id") == manifest.experiment_id}),
        "round": int(max(rounds)) if rounds else None,
        "step": int(max(steps)) if steps else None,
        "loss": statistics.median(losses) if losses else None,
        "age_s": round(time.time() - manifest.created, 1),
    }


def _size(config: dict[str, Any]) -> str:
    keys = [k for k in ("d_model", "n_layers", "context") if k in config]
    return " ".join(f"{k}={config[k]}" for k in keys) or "-"


def format_experiments(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no experiments with live peers found\n"
    header = ("EXPERIMENT", "TASK", "SIZE", "STRATEGY", "PEERS", "ROUND", "STEP", "LOSS", "AGE")
    table = [header]
    for r in rows:
        table.append(
            (
                r["experiment"],
                r["task"],
                _size(r["task_config"]),
                r["strategy"],
                str(r["peers"]),
                "-" if r["round"] is None else str(r["round"]),
                "-" if r["step"] is None else str(r["step"]),
                "-" if r["loss"] is None else f"{r['loss']:.3f}",
                _age(r["age_s"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in table
    )


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


async def experiments_command(
    bootstrap: list[Any],
    *,
    json_output: bool,
    access: Any = None,
    identity: Any = None,
) -> tuple[int, str]:
    """`shoal experiments`: join the network as a client for a moment and list.
    Returns (exit status, text to print). `access`: a private swarm's rules
    (transport/access.py); `identity`: who to be (default: a throwaway one)."""
    import json

    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity
    from shoal.transport.multiaddr import Multiaddr

    from .experiment import register_manifest_validator

    if not bootstrap:
        return 1, (
            "shoal: error: no peer to ask: the network's list is empty, nothing is remembered "
            "and no peer answered over mDNS; give --bootstrap ADDR (any peer of the network, "
            "or /dnsaddr/DOMAIN), or run `shoal run` once with this --data-dir so that its "
            "peers are remembered\n"
        )
    # A throwaway identity: listing asks, it does not take part (but an allow-list
    # swarm admits only listed IDs: then the caller passes this peer's).
    host = Host(
        identity or Identity.generate(),
        HostConfig(listen=(Multiaddr("/ip4/127.0.0.1/tcp/0"),)),
        access=access,
    )
    await host.start()
    try:
        from shoal.dht.records import RecordValidator

        validator = RecordValidator()
        register_manifest_validator(validator)
        try:
            dht = await DHTNode.create(
                host, bootstrap=bootstrap, validator=validator, serves=lambda: False
            )
        except Exception as e:
            return 1, f"shoal: error: could not join the network: {e}\n"
        try:
            rows = await list_experiments(dht)
        finally:
            await dht.aclose()
    finally:
        await host.aclose()
    if json_output:
        return 0, json.dumps(rows) + "\n"
    return 0, format_experiments(rows)
