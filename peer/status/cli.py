"""`shoal status [URL]`: a running peer's status in the terminal.

A one-shot command: it fetches URL/status and URL/peers (urllib, short
timeouts, no event loop) and prints aligned `key  value` lines, then the
connections and the swarm's peers as small tables. `--json` prints /status as
served. The URL defaults to SHOAL_STATUS_ADDR (host:port, as `shoal run` takes
it) when set, else http://127.0.0.1:8080; a peer listening on every interface
(0.0.0.0 or [::]) is asked on loopback.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from .server import DEFAULT_STATUS_HOST, DEFAULT_STATUS_PORT, parse_status_addr

__all__ = ["STATUS_ADDR_ENV", "default_status_url", "status_command"]

STATUS_ADDR_ENV = "SHOAL_STATUS_ADDR"
# The server bounds /peers at 3 s; /status is in-memory and answers at once.
STATUS_TIMEOUT = 3.0
PEERS_TIMEOUT = 5.0
MAX_RESPONSE_BYTES = 16 << 20  # a peer list of a big swarm is far smaller
EXIT_OK = 0
EXIT_RUNTIME = 1
# Answers that cannot be read are not worth a proxy detour: a status endpoint is local.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StatusFetchError(Exception):
    """The peer could not be asked, or its answer could not be read; one line."""


def default_status_url(environ: Mapping[str, str] | None = None) -> str:
    """http://HOST:PORT from SHOAL_STATUS_ADDR, else the daemon's default address.

    Raises ValueError when the variable is set but malformed.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(STATUS_ADDR_ENV, "").strip()
    if text.lower() in ("off", "none", "no"):
        raise ValueError(f"{text}: the status endpoint is off, there is nothing to ask; give a URL")
    host, port = parse_status_addr(text) if text else (DEFAULT_STATUS_HOST, DEFAULT_STATUS_PORT)
    return _url(host, port)


def status_command(
    url: str | None,
    out: TextIO,
    *,
    json_output: bool = False,
    err: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Print the status of the peer at `url` (None: the default); the exit status.

    Problems are one `shoal: error: ...` line on `err` (stderr) and exit status 1.
    """
    err = sys.stderr if err is None else err
    try:
        base = normalize_url(url) if url else default_status_url(environ)
    except ValueError as e:
        return _fail(err, f"{STATUS_ADDR_ENV}: {e}" if not url else str(e))
    try:
        status = _get_json(base + "/status", STATUS_TIMEOUT)
    except StatusFetchError as e:
        return _fail(
            err,
            f"cannot reach a shoal peer at {base}: {e}; is `shoal run` running? "
            "(its --status-addr)",
        )
    if not isinstance(status, dict):
        return _fail(err, f"{base}/status: not a shoal status (a JSON object was expected)")
    if json_output:
        json.dump(status, out, indent=2)
        out.write("\n")
        out.flush()
        return EXIT_OK
    peers: list[dict[str, Any]] | str
    try:
        answer = _get_json(base + "/peers", PEERS_TIMEOUT)
        peers = [p for p in answer if isinstance(p, dict)] if isinstance(answer, list) else []
    except StatusFetchError as e:
        peers = f"unavailable ({e})"
    out.write(format_status(status, peers, base))
    out.flush()
    return EXIT_OK


def normalize_url(text: str) -> str:
    """ "host:port", "http://host:port/" or "[::1]:8080" as a base URL without a trailing /."""
    text = text.strip()
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"cannot ask {text!r}: give an http:// URL or HOST:PORT")
        return text.rstrip("/")
    host, port = parse_status_addr(text)
    return _url(host, port)


def _url(host: str, port: int) -> str:
    # A peer serving on every interface is asked on loopback, which is one of them.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": DEFAULT_STATUS_HOST}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _get_json(url: str, timeout: float) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            body = response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise StatusFetchError(f"HTTP {e.code}: {_error_text(e)}") from None
    except urllib.error.URLError as e:
        raise StatusFetchError(_reason(e.reason)) from None
    except TimeoutError:
        raise StatusFetchError(f"no answer within {timeout:g} s") from None
    except (OSError, ValueError) as e:  # a reset connection, a malformed URL
        raise StatusFetchError(_reason(e)) from None
    if len(body) > MAX_RESPONSE_BYTES:
        raise StatusFetchError(f"answer larger than {MAX_RESPONSE_BYTES >> 20} MiB")
    try:
        return json.loads(body)
    except ValueError:
        raise StatusFetchError("the answer is not JSON: is this a shoal status endpoint?") from None


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read(64 << 10))["error"])
    except Exception:
        return str(e.reason)


def _reason(reason: object) -> str:
    if isinstance(reason, TimeoutError):
        return "no answer in time"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason)


def _fail(err: TextIO, message: str) -> int:
    print(f"shoal: error: {message}", file=err, flush=True)
    return EXIT_RUNTIME


# --- formatting ---------------------------------------------------------------------------


def format_status(
    status: Mapping[str, Any], peers: Sequence[Mapping[str, Any]] | str, url: str
) -> str:
    """The terminal summary: key/value lines, then connections and peers as tables."""
    lines = [f"shoal peer {status.get('peer_id', '?')}  ({url})"]
    rows: list[tuple[str, str]] = [
        ("version", _text(status.get("version"))),
        ("protocol", _protocol(status)),
        ("experiment", _text(status.get("experiment"), "none yet")),
        ("step", _int(status.get("step"))),
        ("loss", _loss(status.get("loss"))),
        ("val loss", _loss(status.get("val_loss"))),
        ("tokens/s", _float(status.get("tokens_per_s"), 1)),
        ("swarm round", _swarm_round(status)),
        ("reachability", _text(status.get("reachability"), "unknown")),
        ("dht peers", _int(status.get("dht_peers"))),
        ("sent", _bytes(status.get("bytes_sent"))),
        ("received", _bytes(status.get("bytes_received"))),
        ("uptime", _duration(status.get("uptime_s"))),
        ("last round", _round(status.get("last_round"))),
    ]
    addresses = [str(a) for a in _items(status.get("addresses"))]
    rows.append(("addresses", addresses[0] if addresses else "none yet"))
    rows.extend(("", a) for a in addresses[1:])
    width = max(len(k) for k, _ in rows)
    lines.extend(f"  {k:<{width}}  {v}" for k, v in rows)

    lines.extend(_mismatches(status))

    connections = [c for c in _items(status.get("connections")) if isinstance(c, Mapping)]
    lines.append("")
    lines.append(f"connections ({len(connections)})")
    lines.extend(
        _table(
            ("PEER", "KIND", "SENT", "RECEIVED"),
            [
                (
                    _text(c.get("peer_id")),
                    _text(c.get("kind")),
                    _bytes(c.get("bytes_sent")),
                    _bytes(c.get("bytes_received")),
                )
                for c in connections
            ],
            right=(2, 3),
        )
        or ["  none"]
    )

    lines.append("")
    if isinstance(peers, str):
        lines.append(f"peers: {peers}")
    else:
        lines.append(f"peers ({len(peers)})")
        now = time.time()
        ordered = sorted(peers, key=lambda p: (not p.get("self"), -(_num(p.get("step")) or -1)))
        lines.extend(
            _table(
                ("PEER", "STEP", "LOSS", "VAL LOSS", "TOKENS/S", "SEEN", "ADDRESSES"),
                [
                    (
                        _text(p.get("peer_id")) + (" (this peer)" if p.get("self") else ""),
                        _int(p.get("step")),
                        _loss(p.get("loss")),
                        _loss(p.get("val_loss")),
                        _float(p.get("tokens_per_s"), 1),
                        _ago(p.get("updated_at"), now),
                        _addresses(p.get("addresses"), p.get("peer_id")),
                    )
                    for p in ordered
                ],
                right=(1, 2, 3, 4, 5),
            )
            or ["  none known yet"]
        )
    return "\n".join(lines) + "\n"


def _protocol(status: Mapping[str, Any]) -> str:
    """This peer's protocol version, and how many connected peers run older software."""
    text = _text(status.get("protocol_version"))
    older = _num(status.get("peers_without_version"))
    if older:
        text += f" ({int(older)} connected peers run shoal from before protocol versions)"
    return text


def _mismatches(status: Mapping[str, Any]) -> list[str]:
    """The incompatible peers seen: a table, with what to do about each."""
    seen = [m for m in _items(status.get("version_mismatches")) if isinstance(m, Mapping)]
    if not seen:
        return []
    total = _num(status.get("version_mismatches_total"))
    refused = f", {_count(int(total), 'connection')} refused" if total else ""
    now = time.time()
    return [
        "",
        f"INCOMPATIBLE PEERS: protocol version mismatches ({_count(len(seen), 'peer')}{refused})",
        *_table(
            ("PEER", "THEIRS", "SOFTWARE", "OURS", "COUNT", "LAST SEEN", "WHAT TO DO"),
            [
                (
                    _text(m.get("peer_id")),
                    _text(m.get("theirs")),
                    _text(m.get("software")),
                    _text(m.get("ours")),
                    _int(m.get("count")),
                    _ago(m.get("last_seen"), now),
                    _text(m.get("action")),
                )
                for m in seen
            ],
            right=(4, 5),
        ),
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _table(header: Sequence[str], rows: list[tuple[str, ...]], right: Sequence[int]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in [tuple(header), *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return ("  " + "  ".join(parts)).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _swarm_round(status: Mapping[str, Any]) -> str:
    """The outer step the swarm's state is at, and when this peer last committed."""
    outer = status.get("outer_step")
    if isinstance(outer, bool) or not isinstance(outer, int):
        return "-"
    committed = status.get("last_commit_at")
    if isinstance(committed, int | float) and not isinstance(committed, bool):
        return f"{outer} (committed {_ago(committed, time.time())})"
    return str(outer)


def _items(value: object) -> list[Any]:
    """A list from another peer's JSON, or nothing (it may send anything in its place)."""
    return value if isinstance(value, list) else []


def _num(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return value
    return None


def _text(value: object, missing: str = "-") -> str:
    return missing if value is None else str(value)


def _int(value: object) -> str:
    n = _num(value)
    return "-" if n is None else f"{int(n):,}"


def _float(value: object, digits: int) -> str:
    n = _num(value)
    return "-" if n is None else f"{n:,.{digits}f}"


def _loss(value: object) -> str:
    n = _num(value)
    if n is None:
        return "-"
    return f"{n:.3e}" if n != 0 and not 1e-3 <= abs(n) < 1e5 else f"{n:.4f}"


def _bytes(value: object) -> str:
    n = _num(value)
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(value: object) -> str:
    n = _num(value)
    if n is None:
        return "-"
    s = int(max(0.0, n))
    d, h, m, sec = s // 86400, s % 86400 // 3600, s % 3600 // 60, s % 60
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {sec:02d}s"
    return f"{m}m {sec:02d}s" if m else f"{sec}s"


def _ago(value: object, now: float) -> str:
    n = _num(value)
    if n is None:
        return "-"
    return "now" if now - n < 2 else _duration(now - n) + " ago"


def _round(value: object) -> str:
    if not isinstance(value, Mapping):
        return "none yet"
    parts = [
        _text(value.get("outcome"), "?"),
        f"{_int(value.get('group_size'))} peers",
        f"{_float(value.get('duration_s'), 2)} s",
    ]
    if value.get("fingerprint"):
        parts.append(f"fingerprint {value['fingerprint']}")
    return ", ".join(parts)


def _addresses(value: object, peer_id: object) -> str:
    """The first address without its /p2p/<peer_id> ending (the table shows the ID already)."""
    addresses = [str(a) for a in value] if isinstance(value, list) else []
    if not addresses:
        return "-"
    first = addresses[0].removesuffix(f"/p2p/{peer_id}")
    return first + (f" (+{len(addresses) - 1} more)" if len(addresses) > 1 else "")
