"""What a failure during an all-reduce round means: one table for every path.

A round meets errors in three places: our transfer to a part's owner
(``SEND``), another member's stream into our part (``SERVE``), and control
messages (``CONTROL``). Each error becomes a `Verdict`: veto the round (and
maybe blame the member, who is then left out of the retry), suspect the member
is gone (the commit protocol decides what that means), ignore it, or let it
propagate (a bug or a cancellation). The table is the single place that says
which, so the three paths cannot drift apart.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from shoal.transport.errors import (
    ConnectionLost,
    DialError,
    ProtocolNotSupported,
    ProtocolViolation,
    RemoteError,
    StreamReset,
    TransportError,
)

from .compression import CodecError

__all__ = ["Action", "Crash", "Side", "Verdict", "Veto", "classify", "describe", "first_of"]


class Veto(Exception):
    """This member cannot complete its data phase (`blame`: member indices at fault)."""

    def __init__(self, reason: str, blame: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.blame = blame


class Crash(Exception):
    """The fault hook raised (tests): the original exception leaves the round."""


class Side(enum.Enum):
    SEND = "send"  # our contribution to member j's part, and its result back
    SERVE = "serve"  # member j's contribution to our part, and our result to it
    CONTROL = "control"  # a control message to member j


class Action(enum.Enum):
    VETO = "veto"
    # Veto only while we still need data from the member: a receiver that gave up on
    # our result stream concerns only itself.
    VETO_IF_NEEDED = "veto if needed"
    SUSPECT = "suspect"  # the member may be gone: suspect it
    IGNORE = "ignore"
    RAISE = "raise"


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    reason: str = ""  # a veto's names the member; a suspicion's does not (the protocol will)
    blame: bool = False  # blame the member (it broke the protocol or cannot take part)


def describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "…"


def _invalid(e: BaseException) -> str:
    return f"sent invalid data: {e}"


def _stopped(e: BaseException) -> str:
    return f"stopped the transfer ({getattr(e, 'reason', e)})"


def _failed(e: BaseException) -> str:
    return f"failed: {describe(e)}"


# (exception type, RemoteError kind or None, {side: (action, reason(e), blame)}), first
# match wins. A veto's reason reads "member <name> <reason>".
_V, _VN, _S, _I = Action.VETO, Action.VETO_IF_NEEDED, Action.SUSPECT, Action.IGNORE
_TABLE: tuple[tuple[type[BaseException], str | None, dict[Side, tuple]], ...] = (
    (ProtocolNotSupported, None, {
        Side.SEND: (_V, lambda e: "does not serve all-reduce", True),
        Side.SERVE: (_VN, _stopped, False),
        Side.CONTROL: (_S, _failed, False),
    }),
    (StreamReset, None, {
        Side.SEND: (_V, _stopped, False),
        Side.SERVE: (_VN, _stopped, False),
        Side.CONTROL: (_S, _failed, False),
    }),
    (RemoteError, "UnknownRound", {
        Side.SEND: (_V, lambda e: "did not start the round", True),
    }),
    (RemoteError, "RoundOver", {
        Side.SEND: (_V, lambda e: "already left the round", False),
    }),
    (RemoteError, None, {
        Side.SEND: (_V, lambda e: f"refused our data: {e.message}", False),
        Side.SERVE: (_V, _invalid, True),
        Side.CONTROL: (_I, lambda e: f"refused a control message: {e}", False),
    }),
    (TimeoutError, None, {
        Side.CONTROL: (_S, lambda e: "stalled (no answer in time)", False),
    }),
    (ProtocolViolation, None, {
        Side.SEND: (_V, _invalid, True),
        Side.SERVE: (_V, _invalid, True),
        Side.CONTROL: (_S, _failed, False),
    }),
    (CodecError, None, {Side.SEND: (_V, _invalid, True), Side.SERVE: (_V, _invalid, True)}),
    (ConnectionLost, None, {side: (_S, _failed, False) for side in Side}),
    (DialError, None, {side: (_S, _failed, False) for side in Side}),
    (TransportError, None, {side: (_S, _failed, False) for side in Side}),
    (OSError, None, {side: (_S, _failed, False) for side in Side}),
)  # fmt: skip


def classify(e: BaseException, side: Side, name: str) -> Verdict:
    """What error `e` from member `name`, met on `side`, means for the round."""
    if isinstance(e, Veto):
        return Verdict(Action.VETO, e.reason)
    if isinstance(e, Crash | asyncio.CancelledError):
        return Verdict(Action.RAISE)
    for kind, remote_kind, rules in _TABLE:
        if not isinstance(e, kind):
            continue
        if remote_kind is not None and getattr(e, "kind", None) != remote_kind:
            continue
        rule = rules.get(side)
        if rule is None:
            continue
        action, reason, blame = rule
        if action in (Action.VETO, Action.VETO_IF_NEEDED):
            return Verdict(action, f"member {name} {reason(e)}", blame)
        return Verdict(action, reason(e), blame)  # a suspicion: the protocol names the member
    return Verdict(Action.RAISE)


def first_of(eg: BaseExceptionGroup) -> BaseException:
    """The most telling exception of a group: a crash, else not a cancellation."""
    flat: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            flat.append(e)

    walk(eg)
    preference = (
        (Crash,),
        (Veto, RemoteError, ProtocolViolation, CodecError),
        (ConnectionLost,),
        (Exception,),
    )
    for kinds in preference:
        for e in flat:
            if isinstance(e, kinds):
                return e
    return flat[0]
