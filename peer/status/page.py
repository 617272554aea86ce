"""The status page served at GET /: `static/index.html`, its `style.css` and `app.js`.

No external scripts, styles or fonts and no build step, so it works on an
offline machine and the server can forbid every other origin (CSP). It polls
`status`, `peers` and `history` (relative URLs: it also works behind a reverse
proxy under a path prefix) every 2 s, one round at a time, and `swarm` every
10 s (it is sampled every 15 s), and draws on <canvas> this peer's loss curve,
its bandwidth and the swarm's loss curves (every peer's training loss over
time, this peer's line highlighted, the validation loss as dots on a dashed
line; the legend names the 8 peers shown in colour, this one first, and counts
the others, drawn in grey). A failed poll is shown in a banner and
retried; the last data stays on screen, so a daemon restart reads as a short
"reconnecting".

Everything that comes from other peers (IDs, addresses) is untrusted and goes
into the DOM through textContent only, never innerHTML.

Stable hooks for tests and scripts: `#peers tbody tr[data-peer-id]` (one row per
peer), `#loss-curve[data-points]` and `#bandwidth[data-points]` (points drawn),
`#swarm-curve[data-peers][data-points][data-val-points]` (series and points
drawn: training loss, validation loss) with `#swarm-legend li[data-peer-id]`
(one per peer drawn in colour; class `self` for this one, `left` for a peer
whose reports stopped) and `#swarm-legend li.others[data-count]`, `#val-loss`,
`#connections tbody tr`, `#last-round`, `#error` (hidden when all is well),
`body[data-polls]` (successful polls so far), and the summary values `#peer-id`,
`#experiment`, `#swarm-round`, `#step`, `#loss`, `#tokens-per-s`, `#device`,
`#reachability`, `#access` (open swarm, or private: its mode and refusals),
`#uptime`, `#join-command` (the command another peer runs to join),
`#verification` with `#bans tbody tr[data-peer-id]` (one row per banned peer),
`#version-mismatches` (a warning card, hidden unless incompatible peers were
seen) with `#mismatches tbody tr[data-peer-id]` (one row per such peer),
`#attention` (a warning card, hidden unless this peer's clock is off or its
checkpoints fail) with `#attention-list li[data-problem]` (`clock`, `checkpoint`),
`#pipeline` with `#stages tbody tr[data-stage]` (one row per stage of a
pipelined experiment; its `td.stage-state[data-lost]` says the version a stage
lost its state at, `[data-restored]` the version a checkpoint restored it at)
and the drawing `#pipeline-drawing[data-stages][data-peers]`:
`.stage-column[data-stage]` columns of `.peer-box[data-peer-id]` boxes (classes
`self`, `banned`, `convicted`, `stale`; `data-flow`: requests/s), with
`#pipeline-bans li[data-peer-id]` (peers routed around, and convicted ones).
"""

from importlib import resources

__all__ = ["STATUS_PAGE_ASSETS", "STATUS_PAGE_CSP", "STATUS_PAGE_HTML"]


def _read(name: str) -> str:
    return resources.files("shoal.peer.status").joinpath("static", name).read_text("utf-8")


# Served as they are stored, from the package's data files (no build step).
STATUS_PAGE_HTML = _read("index.html")
# URL path (relative to the page, so a reverse proxy may serve it under a prefix) ->
# (content type, text).
STATUS_PAGE_ASSETS: dict[str, tuple[str, str]] = {
    "style.css": ("text/css", _read("style.css")),
    "app.js": ("text/javascript", _read("app.js")),
}

# The Content-Security-Policy the page is served with: nothing from elsewhere, and no
# script but the page's own file (no inline script at all: inline event handlers, e.g.
# in markup a peer smuggled into its report, would not run even if it reached the DOM).
# Inline styles stay allowed: the legends colour their swatches with style attributes.
STATUS_PAGE_CSP = (
    "default-src 'none'; script-src 'self'; "
    "style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
