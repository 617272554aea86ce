"""The messages a member's commit protocol has for its driver to send (sans-IO)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = ["Outbox", "Send"]


class Send(NamedTuple):
    dest: int
    message: list[Any]
    # "heartbeat" (may be dropped while one is in flight), "vote", "prepare", "accept"
    # (a proposal), "decision" (originated here: the driver waits for its delivery),
    # "relay".
    kind: str


class Outbox:
    """Messages queued in the order the protocol produced them, taken by its driver."""

    def __init__(self) -> None:
        self._out: list[Send] = []

    def send(self, dests: Iterable[int], message: list[Any], kind: str) -> None:
        self._out.extend(Send(j, message, kind) for j in dests)

    def take(self) -> list[Send]:
        out, self._out = self._out, []
        return out
