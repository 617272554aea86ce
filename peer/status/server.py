"""The HTTP status endpoint: what a running peer shows people, scripts and Prometheus.

Default 127.0.0.1:8080 (`--status-addr` to change); read-only, GET only.

    GET /          the status page for people (peer/status/page.py), polling the JSON below
    GET /style.css, /app.js   its stylesheet and script (peer/status/static/)
    GET /status    this peer (schema below)
    GET /peers     the experiment's peers as seen through the DHT (schema below)
    GET /history   recent samples of this peer for the page's curves (schema below)
    GET /swarm     every peer's reported losses over time, for the swarm's curves (below)
    GET /metrics   Prometheus exposition (peer/status/metrics.py; e.g. shoal_loss, and
                   shoal_val_loss: /status's val_loss, left out while it is null)
    GET /healthz   liveness for containers: 200 {"ok": true, "uptime_s": float}, the
                   seconds since this endpoint started (it asks the provider nothing)

The daemon implements `StatusProvider`; this module only serves what it gives.
Every value it does not know yet is null (loss before the first step, last_round
before the first round), never a made-up 0. Non-finite floats (a NaN loss) are
served as null so that every client's JSON parser accepts them.

`/status` (`StatusProvider.status()`), every key always present:

    peer_id         str     "12D3KooW..."
    version         str     shoal's version
    addresses       [str]   multiaddrs other peers can dial, each ending in /p2p/<peer_id>
    reachability    str     "public" | "private" | "unknown" (AutoNAT's verdict)
    access          obj     who may connect (private swarms, transport/access.py):
        mode            str     "open" | "swarm-key" | "allow-peers" | "swarm-key+allow-peers"
        refusals        int     connections this peer refused for them (both directions)
        refusals_by_reason  obj  {"swarm_key": int, "not_allowed": int}
        unanswered_handshakes  int  our dials with a swarm key the remote closed before
                                answering (its key differs, or it has none)
        swarm_key_fingerprint  str|null  16 hex digits naming the key (never the key)
        allowed_peers   int|null  how many peer IDs --allow-peers lists
    connections     [obj]   open connections, one per peer:
        peer_id         str
        kind            str     "direct" | "relayed" | "holepunched"
        bytes_sent      int     on this connection
        bytes_received  int
    dht_peers       int     peers in the DHT routing table
    experiment      str|null  the experiment this peer trains (null: none yet)
    step            int|null  this peer's training step
    loss            float|null  this peer's last (smoothed) training loss
    val_loss        float|null  the mean loss over the task's held-out batches (the same
                                on every peer, so peers compare), scored after a round
                                that changed the model: the swarm's global parameters
                                for DiLoCo, the peer's own for NoLoCo and Streaming
                                DiLoCo, forward through the stages for a pipeline's
                                trainer; at most every 30 s and 5% of the time; null
                                before the first such round, and on a pipeline peer that
                                drives no microbatches (peer/training/validation.py,
                                peer/pipelined/validation.py)
    tokens_per_s    float|null  this peer's training throughput
    last_round      obj|null  the last averaging round this peer took part in:
        group_size      int
        duration_s      float
        outcome         str     "committed" | "aborted" | ... (free text, short)
        fingerprint     str|null  hash of the averaged state (peers that committed agree)
    bytes_sent      int     total over the process's lifetime (closed connections included)
    bytes_received  int
    bytes_sent_by_protocol  obj  {protocol: int}: stream payload sent, by the protocol each
                                stream was opened for ("/shoal/averaging/1.0.0", "/shoal/dht/1.0.0",
                                ...); headers and encryption are in bytes_sent only
    uptime_s        float   seconds since the daemon started

Protocol versions (transport/version.py; docs/reference/protocols.md), on every
daemon since they exist (a client treats a missing key as "none seen"):

    protocol_version          str     this peer's wire protocol, "major.minor", e.g. "1.0"
    version_mismatches        [obj]   incompatible peers seen, most recent first, at most 64:
        peer_id         str
        theirs          str     its protocol version, e.g. "2.0"
        ours            str     ours when it was seen
        software        str     what it runs, e.g. "shoal 0.3.0" (its own words)
        first_seen      float   UNIX time
        last_seen       float   UNIX time
        count           int     connections with it refused
        action          str     what to do: "upgrade this peer: pip install -U shoal", or
                                "the other peer runs an older shoal and must upgrade ..."
    version_mismatches_total  int     connections refused for their version (every peer)
    peers_without_version     int     connected peers that run shoal from before protocol
                                      versions (compatibility unknown: served)

Sizes peers choose (docs/security.md, "Sizes a peer chooses"): what they sent or announced
beyond what this peer expects, refused before it was read or allocated:

    oversized_refused   obj     counts since the daemon started:
        pipeline        int     stage requests our stage refused (more samples, or
                                tensors of more elements, than its bounds), and stage
                                answers our trainer refused; also pipeline.oversized_refused
        reveals         int     reveals of audited work announcing more than our model
                                holds (each a malformed reveal); also
                                verification.oversized_refused
        state           int     state downloads offered in a layout other than ours

Where the shared state comes from (docs/security.md, "State a stranger serves";
averaging/certifier.py), null before the experiment starts and for NoLoCo:

    provenance          obj|null
        verified            bool    we hold the certificate chain of our state's version
        certified_work      int     signers summed over its rounds of two or more
        solo_commits        int     its commits that only one member signed
        certificates        int     certificates this peer keeps (its chain)
        chains_checked      int     other versions' chains fetched that checked
        chains_refused      int     chains that did not (forged, copied, broken)
        chains_served       int     chains this peer served to others
        signatures_received int     round members' signatures of our commits
        fragments           [obj]   Streaming DiLoCo: the above per fragment

Optional keys: `val_loss_at` (float|null: UNIX time `val_loss` was scored),
`config` ({option: value as text}, the effective configuration, secrets never),
`loop_lag_ms` (obj|null: how late a 10 ms ticker on the event loop ran over the
last minute, a stall weighed by its length, peer/status/loop_lag.py: p50_ms, p99_ms,
max_ms, window_s), `verification`
(obj|null, null before the experiment starts:
`banned` [peer IDs this peer refuses], `convictions` [{peer, round, accusers,
at}], `convicted_self` bool, `rejected_evidence` int: forged or altered
bundles seen; peer/verify/ban_watch.py), `pipeline` (obj|null, null unless the
experiment is pipelined: `stage` int|null (the stage this peer serves),
`trainer` bool (it drives microbatches), `stages` [{stage, peers, throughput
(training samples/s, null until measured), peer_ids, version}], `microbatches`
int (driven by a trainer; served backwards for a stage-only peer), `served`
{forward, backward}, `version`, `fingerprint_version` (the version the
top-level `fingerprint` hashes; it lags `version` while a step is applied),
`serving`, `syncs`, `retries`, `replayed`, `recovered` (backwards whose
answer was late but their peer had applied them: taken from there),
`unfenced` (failed backwards sent elsewhere without knowing whether their first
peer applied them: the one way a microbatch may count twice; pipeline/fencing.py);
peer/pipelined/run.py; a trainer's `step` and `loss` are then its optimizer
steps and training loss; for the page's drawing, `stages[].servers` (each
peer of the stage: throughput, queue, version, requests/s between it and this
peer, banned), `flow` (microbatches/s and requests/s per stage over the last
seconds) and `bans` (peers this trainer routes around): peer/status/pipeline_status.py),
and whatever else the daemon finds useful; clients ignore keys they do not know.

`/peers` (`await StatusProvider.peers()`), a list, this peer included:

    peer_id, step (int|null), loss (float|null), val_loss (float|null, as in /status),
    tokens_per_s (float|null), addresses ([str]),
    updated_at (UNIX time of the peer's last DHT report, float),
    self (bool: this peer's own entry)

`/history` (`StatusProvider.history()`), oldest first, bounded (~1000 points):

    t (UNIX time), step (int|null), loss (float|null), val_loss (float|null: the latest
    score at t, repeated until the next), tokens_per_s (float|null),
    bytes_sent (int), bytes_received (int)   (totals: the page derives rates)

`/swarm` (`StatusProvider.swarm()`): what the experiment's peers reported over time,
sampled from their DHT reports every 15 s (peer/status/swarm_history.py), this peer included:

    {"peers": {peer_id: [{t, step, loss, val_loss}, ...]}, "self": peer_id}

Each series is oldest first, t the report's UNIX time (the reporting peer's clock,
never after ours), values as in /peers (null when unknown). Bounded: 64 peers
(a new one replaces the one heard from longest ago), 240 points per peer (older
points thinned out as it fills), 24 h; a peer that left keeps its series until
it ages out.

Errors are JSON `{"error": "..."}` with a 4xx/5xx status; a bug in a provider is
logged here with its traceback and reaches the client as a 500 without one.
Every request is bounded in time: /peers (which may ask the DHT) by
`peers_timeout`, answering 503 when it runs out; any request by
`request_timeout`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from shoal.transport.remote_log import RemoteEvents

from .http import BoundedTCPSite, HttpLimits, http_error_logger
from .page import STATUS_PAGE_ASSETS, STATUS_PAGE_CSP, STATUS_PAGE_HTML
from .provider import StatusProvider

if TYPE_CHECKING:
    from .metrics import Metrics

__all__ = [
    "DEFAULT_STATUS_HOST",
    "DEFAULT_STATUS_PORT",
    "STATUS_KEYS",
    "StatusProvider",
    "StatusServer",
    "parse_status_addr",
]

log = logging.getLogger("shoal.peer.status.server")

DEFAULT_STATUS_HOST = "127.0.0.1"
DEFAULT_STATUS_PORT = 8080
# The keys /status always has (the module docstring gives their types).
STATUS_KEYS = (
    "peer_id",
    "version",
    "addresses",
    "reachability",
    "connections",
    "dht_peers",
    "experiment",
    "step",
    "loss",
    "val_loss",
    "tokens_per_s",
    "last_round",
    "bytes_sent",
    "bytes_received",
    "uptime_s",
)
# /peers may wait on the DHT; the page polls every 2 s and `shoal status` waits 5 s.
DEFAULT_PEERS_TIMEOUT = 3.0
# A backstop for every handler; the synchronous provider calls must be much faster.
DEFAULT_REQUEST_TIMEOUT = 10.0
# On aclose: how long an in-flight request may finish (every handler is bounded anyway).
SHUTDOWN_GRACE = 1.0

PAGE_HEADERS = {
    "Content-Security-Policy": STATUS_PAGE_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
NO_CACHE_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


class StatusServer:
    """The aiohttp server for the endpoints above; owned by the daemon (start, then aclose)."""

    def __init__(
        self,
        provider: StatusProvider,
        metrics: Metrics,
        host: str = DEFAULT_STATUS_HOST,
        port: int = DEFAULT_STATUS_PORT,
        *,
        peers_timeout: float = DEFAULT_PEERS_TIMEOUT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        http_limits: HttpLimits | None = None,
    ) -> None:
        self.provider = provider
        # Timeouts, sizes and connection caps against slow or hostile clients, and
        # the rate-limited log of what they cause (peer/status/http.py).
        self.http_limits = http_limits or HttpLimits()
        self.remote_events = RemoteEvents(log)
        self.metrics = metrics
        self.host = host
        self.port = port
        self.peers_timeout = peers_timeout
        self.request_timeout = request_timeout
        self._started = time.monotonic()
        self._runner: web.AppRunner | None = None
        self._url: str | None = None

    async def start(self) -> None:
        """Listen on host:port. Raises OSError when the address is in use or not ours."""
        if self._runner is not None:
            raise RuntimeError("StatusServer already started")
        app = web.Application(middlewares=[self._bounded_json_errors])
        app.router.add_get("/", self._page)
        for name in STATUS_PAGE_ASSETS:
            app.router.add_get(f"/{name}", self._page_asset)
        app.router.add_get("/status", self._status)
        app.router.add_get("/peers", self._peers)
        app.router.add_get("/history", self._history)
        app.router.add_get("/swarm", self._swarm)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=SHUTDOWN_GRACE,
            logger=http_error_logger(self.remote_events),
            **self.http_limits.handler_args(),
        )
        await runner.setup()
        try:
            site = BoundedTCPSite(
                runner, self.host, self.port, limits=self.http_limits, events=self.remote_events
            )
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self._url = _url_for(self.host, runner.addresses)
        log.info("status endpoint at %s", self._url)

    @property
    def url(self) -> str:
        """The base URL, e.g. "http://127.0.0.1:8080" (the real port when started with port 0)."""
        if self._url is None:
            raise RuntimeError("StatusServer not started")
        return self._url

    async def aclose(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
            self.remote_events.flush()

    async def __aenter__(self) -> StatusServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- handlers ---------------------------------------------------------------------------

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            text=STATUS_PAGE_HTML, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS
        )

    async def _page_asset(self, request: web.Request) -> web.StreamResponse:
        content_type, text = STATUS_PAGE_ASSETS[request.path.lstrip("/")]
        return web.Response(
            text=text, content_type=content_type, charset="utf-8", headers=PAGE_HEADERS
        )

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return _json_response(self.provider.status())

    async def _peers(self, request: web.Request) -> web.StreamResponse:
        try:
            async with asyncio.timeout(self.peers_timeout):
                peers = await self.provider.peers()
        except TimeoutError:
            return _json_error(
                503, f"the peer list did not come within {self.peers_timeout:g} s; try again"
            )
        return _json_response(peers)

    async def _history(self, request: web.Request) -> web.StreamResponse:
        # ~1000 samples take a few ms to encode: in a thread, from a copy taken here
        # (the daemon appends to its history on this loop meanwhile).
        history = list(self.provider.history())
        return _json_text_response(await asyncio.to_thread(_json_text, history))

    async def _swarm(self, request: web.Request) -> web.StreamResponse:
        # Up to 64 x 240 points: encoded in a thread, like /history (snapshot() copies).
        swarm = self.provider.swarm()
        return _json_text_response(await asyncio.to_thread(_json_text, swarm))

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body, content_type = self.metrics.render()
        headers = {**NO_CACHE_HEADERS, "Content-Type": content_type}
        return web.Response(body=body, headers=headers)

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        # Cheap on purpose: answering at all proves the event loop turns.
        return _json_response({"ok": True, "uptime_s": round(time.monotonic() - self._started, 3)})

    @web.middleware
    async def _bounded_json_errors(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Every answer within request_timeout, and every error as JSON without a traceback."""
        try:
            async with asyncio.timeout(self.request_timeout):
                return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return _json_error(e.status, e.reason.lower(), headers)
        except TimeoutError:
            self.remote_events.warning(
                "status request timed out",
                request.remote,
                "status endpoint: %s %s timed out",
                request.method,
                request.path,
            )
            return _json_error(503, f"no answer within {self.request_timeout:g} s; try again")
        except Exception as e:
            self.remote_events.error(
                "status request failed",
                request.remote,
                "status endpoint: %s %s failed",
                request.method,
                request.path,
                exc_info=True,
            )
            return _json_error(500, f"internal error ({type(e).__name__}); see the peer's log")


def _json_response(value: object, status: int = 200) -> web.Response:
    return _json_text_response(_json_text(value), status)


def _json_text_response(text: str, status: int = 200) -> web.Response:
    return web.Response(
        text=text, status=status, content_type="application/json", headers=NO_CACHE_HEADERS
    )


def _json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    response = _json_response({"error": message}, status)
    if headers:
        response.headers.update(headers)
    return response


def _json_text(value: object) -> str:
    # default=str: PeerID, Multiaddr and Path print as their canonical text.
    try:
        return json.dumps(value, default=str, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a NaN or an infinity somewhere: rare, so only then the slow walk
        return json.dumps(_finite(value), default=str, allow_nan=False, separators=(",", ":"))


def _finite(value: object) -> object:
    """`value` with NaN and infinities replaced by None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _url_for(host: str, bound: list[Any]) -> str:
    port = bound[0][1] if bound else 0
    return f"http://{_bracketed(host)}:{port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_status_addr(text: str) -> tuple[str, int]:
    """`--status-addr` as (host, port): "127.0.0.1:8080", "0.0.0.0:8080", "[::1]:8080",
    "localhost:8080"; ":8080" (or "8080") changes only the port and keeps 127.0.0.1.

    Raises ValueError with a message saying what a valid address looks like.
    """
    raw = text.strip()
    example = "give HOST:PORT, e.g. 127.0.0.1:8080, 0.0.0.0:8080 (every interface) or [::1]:8080"
    if not raw:
        raise ValueError(f"empty status address; {example}")
    if "/" in raw:
        raise ValueError(f"bad status address {text!r}: not a URL or path; {example}")
    if raw.startswith("["):
        host, sep, port_text = raw[1:].partition("]:")
        if not sep:
            raise ValueError(f"bad status address {text!r}: {example}")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bad status address {text!r}: {host!r} is no IPv6 address") from None
    elif raw.count(":") > 1:
        raise ValueError(
            f"bad status address {text!r}: put an IPv6 address in brackets, e.g. [::1]:8080"
        )
    elif ":" in raw:
        host, _, port_text = raw.partition(":")
        host = host or DEFAULT_STATUS_HOST
    else:
        host, port_text = DEFAULT_STATUS_HOST, raw
    if not (port_text.isascii() and port_text.isdigit()) or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bad status address {text!r}: the port must be 0-65535; {example}")
    if any(c.isspace() or c in "/[]@" for c in host):
        raise ValueError(f"bad status address {text!r}: {host!r} is no host name; {example}")
    return host, int(port_text)
