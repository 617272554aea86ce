"""The live progress line: step, loss, tokens/s, peers and the last sync.

In a terminal, one line redrawn in place (tqdm, on stderr, beside the log);
elsewhere (a container, a pipe, a file) a plain log line every
`LOG_INTERVAL_S`, because carriage returns make logs unreadable.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "describe_progress"]

log = logging.getLogger("shoal.progress")

LOG_INTERVAL_S = 30.0


def describe_progress(status: dict[str, Any]) -> str:
    """One line from a /status document."""
    parts = [f"step {status.get('step') or 0}"]
    loss = status.get("loss")
    parts.append(f"loss {loss:.3f}" if isinstance(loss, int | float) else "loss -")
    rate = status.get("tokens_per_s")
    parts.append(f"{rate:,.0f} tok/s" if isinstance(rate, int | float) else "- tok/s")
    parts.append(_peers(status.get("experiment_peers") or 0))
    outer = status.get("outer_step")
    if isinstance(outer, int):
        # The swarm's progress: the round its shared state is at, and when it moved.
        committed = status.get("last_commit_at")
        ago = (
            f", committed {max(0.0, time.time() - committed):.0f}s ago"
            if isinstance(committed, int | float)
            else ""
        )
        parts.append(f"round {outer}{ago}")
    last = status.get("last_round")
    if isinstance(last, dict):
        ago = last.get("ago_s")
        when = f" {ago:.0f}s ago" if isinstance(ago, int | float) else ""
        size = last.get("group_size")
        group = _peers(size) if isinstance(size, int) else "? peers"
        parts.append(f"last sync: {last.get('outcome')}{when} ({group})")
    else:
        parts.append("last sync: none yet")
    return " | ".join(parts)


class Progress:
    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._bar: Any = None
        self._last_log = 0.0

    def update(self, status: dict[str, Any]) -> None:
        line = describe_progress(status)
        if self.live:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(file=self.stream, bar_format="{desc}", leave=False)
            self._bar.set_description_str(line)
            return
        now = time.monotonic()
        if now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            log.info("%s", line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _peers(n: int) -> str:
    return f"{n} peer" if n == 1 else f"{n} peers"
