"""Outer optimizers: what a trainer calls between inner optimizer steps.

A trainer runs its inner optimizer (e.g. AdamW) on the model's parameters and,
after every inner step, hands control to an `OuterStrategy`, which now and
then synchronizes with other peers and moves the parameters:

- ``diloco``: every H inner steps, the pseudo-gradient (global - local) is
  averaged by the fault-tolerant all-reduce and an outer Nesterov step moves
  the global parameters (`diloco.DiLoCo`);
- ``streaming``: the same per fragment of the parameters, fragments in turn,
  each round overlapped with the next inner steps (`diloco.StreamingDiLoCo`);
- ``noloco``: every H inner steps, an exchange with one partner, no group and
  no all-reduce over the swarm (`noloco.NoLoCo`).

Options are plain msgpack-able values (they go into the experiment's
manifest); `resolve_options` fills in `DEFAULT_OPTIONS` and rejects unknown
names and bad values with a ValueError that names the option. The strategies
build on `strategy_base.OuterStrategyBase`; `strategies.make_strategy` makes
one by name.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .allreduce import AllReduceConfig
from .compression import CODECS
from .matchmaking import MatchmakingConfig
from .reducer import REDUCTIONS
from .state_sync import DEFAULT_PROTOCOL as STATE_PROTOCOL

__all__ = [
    "DEFAULT_OPTIONS",
    "OuterStrategy",
    "RoundOutcome",
    "RoundReport",
    "nesterov_outer_step",
    "resolve_options",
]


class RoundOutcome(enum.Enum):
    """How a round ended; the value is the word status and metrics show."""

    COMMITTED = "committed"  # the group's result was applied
    ABORTED = "aborted"  # a group formed but the round did not commit
    RESYNCED = "resynced"  # our state was behind: we loaded the swarm's instead
    NO_GROUP = "no group"  # no group formed (alone, or matchmaking failed)


@dataclass(frozen=True, slots=True)
class RoundReport:
    outer_step: int  # outer steps this peer has applied so far (after this round)
    outcome: RoundOutcome
    detail: str  # why, for a round that did not commit ("" otherwise)
    group_size: int
    duration_s: float
    fingerprint: str | None  # shared-state fingerprint after a commit
    bytes_sent: int  # what this host sent while the round ran (its byte counter's delta)
    # The ledger of the round (what a soak checks across peers): the group's round ID
    # (hex) and members, the peers whose input the result holds, the inner steps
    # (after, through] our input covered, and the groups that aborted before it.
    round_id: str | None = None
    members: tuple[str, ...] = ()
    included: tuple[str, ...] = ()
    contribution: tuple[int, int] | None = None
    aborted_rounds: tuple[str, ...] = ()
    # Where the round's time went, a try at a time (`averager.Attempt`, as dicts).
    attempts: tuple[dict[str, Any], ...] = ()

    @property
    def committed(self) -> bool:
        return self.outcome is RoundOutcome.COMMITTED

    def describe(self) -> str:
        """One phrase for logs and status: "aborted: <why>", "committed", ..."""
        return f"{self.outcome.value}: {self.detail}" if self.detail else self.outcome.value


class OuterStrategy(Protocol):
    name: str  # "diloco" | "streaming" | "noloco"
    outer_steps: int
    # Times the parameters were set back to the global state outside a commit (a
    # re-sync, a load at start): work counted from before such a reset is gone.
    resets: int
    # State downloads refused for a layout unlike ours (`state_sync.UnexpectedLayout`).
    oversized_refused: int
    # Our shared state's certified lineage and the certificate traffic (or None).
    provenance: dict[str, Any] | None

    async def start(self, *, join: bool) -> bool:
        """join=True: load the swarm's state if a peer serves it (True if loaded; the
        model's parameters then hold it). join=False: start from the parameters as
        they are (or as `load_state_dict` restored them) and serve them."""
        ...

    async def after_inner_step(self, samples: int) -> list[RoundReport]:
        """Called after every inner step, while no inner step runs (the parameters are
        changed only here). `samples` weighs this peer's contribution. Returns the
        reports of the rounds that finished."""
        ...

    async def finish(self) -> None:
        """No new rounds; a round in flight finishes or aborts within a bounded time."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def fingerprint(self) -> str: ...

    @property
    def committed_fingerprint(self) -> str | None:
        """The last frozen state's fingerprint, computed off the event loop (None before
        any): what status endpoints read, never hashing the model on the loop."""
        ...

    async def aclose(self) -> None: ...


def nesterov_outer_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    *,
    lr: float,
    mu: float,
) -> None:
    """SGD with Nesterov momentum, in place: ``m = mu*m + g; p -= lr*(g + mu*m)``.

    The same operations in the same order on every member, so members that hold
    the same bits before hold the same bits after.
    """
    with torch.no_grad():
        for p, g, m in zip(params, grads, momentum, strict=True):
            m.mul_(mu).add_(g)
            p.sub_(g.to(p.dtype), alpha=lr)
            p.sub_(m.to(p.dtype), alpha=lr * mu)


# ---------------------------------------------------------------------- options

_Check = Callable[[Any], bool]


def _number(lo: float, hi: float = float("inf"), *, lo_open: bool = False) -> _Check:
    def check(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        return (v > lo if lo_open else v >= lo) and v <= hi

    return check


def _integer(lo: int, hi: int = 1 << 62) -> _Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _codec(v: Any) -> bool:
    return isinstance(v, str) and v in CODECS


# name -> (check, what a good value is)
_SHARED_CHECKS: dict[str, tuple[_Check, str]] = {
    "inner_steps": (_integer(1), "an int >= 1"),
    "outer_lr": (_number(0, lo_open=True), "a number > 0"),
    "outer_momentum": (_number(0, 1), "a number in [0, 1)"),
    "codec": (_codec, f"one of {sorted(CODECS)}"),
    "round_timeout": (_number(0, lo_open=True), "a number of seconds > 0"),
    "stall_timeout": (_number(0, lo_open=True), "a number of seconds > 0"),
    "state_timeout": (_number(0, lo_open=True), "a number of seconds > 0"),
    "deadlines": (lambda v: v in ("adaptive", "fixed"), "adaptive or fixed"),
}
_GROUP_CHECKS: dict[str, tuple[_Check, str]] = {
    "min_group_size": (_integer(1, 1024), "an int in 1..1024"),
    "target_group_size": (_integer(1, 1024), "an int in 1..1024"),
    "matchmaking_time": (_number(0, lo_open=True), "a number of seconds > 0"),
}


def _reduction(v: Any) -> bool:
    return v == "auto" or v in REDUCTIONS


# Verification (`shoal.verification`, run by the peer): off unless a manifest says so,
# so that experiments created before it keep running as they were.
_VERIFY_DEFAULTS: dict[str, Any] = {
    "verify": False,
    "audit_rate": 0.05,  # audit probability per contribution
    "audit_probation_rate": 0.5,  # for peers new in our sight
    "audit_segment_steps": 3,  # inner steps per checkpoint: what one audit re-runs
    "audit_threshold_angle": 3.2e-3,  # 4x the calibrated fp32 honest floor
    # How owners reduce their part: auto is CenteredClip when verifying, else the mean.
    "reduction": "auto",
}
_VERIFY_CHECKS: dict[str, tuple[_Check, str]] = {
    "verify": (lambda v: isinstance(v, bool), "true or false"),
    "audit_rate": (_number(0, 1), "a number in [0, 1]"),
    "audit_probation_rate": (_number(0, 1), "a number in [0, 1]"),
    "audit_segment_steps": (_integer(1, 4096), "an int in 1..4096"),
    "audit_threshold_angle": (_number(0, 3.2, lo_open=True), "an angle in (0, 3.2] radians"),
    "reduction": (_reduction, f"auto or one of {sorted(REDUCTIONS)}"),
}
# Strategies that cannot verify accept only verify = false.
_NO_VERIFY: dict[str, tuple[_Check, str]] = {
    "verify": (lambda v: v is False, "false (verification needs the diloco strategy)"),
}

_DILOCO_DEFAULTS: dict[str, Any] = {
    "inner_steps": 50,
    "outer_lr": 0.7,  # DiLoCo paper
    "outer_momentum": 0.9,  # DiLoCo paper (Nesterov)
    "codec": "none",
    "min_group_size": 2,
    # DiLoCo's global parameters are one state: the whole swarm should fit in one
    # group. A larger swarm splits, and each group's globals then go their own way
    # (a peer that lands in another group later re-syncs when its version is behind).
    "target_group_size": 64,
    # How long a leader waits for peers it expects (members of the previous round,
    # peers that declared themselves at start): the spread of arrival times of
    # peers of slightly different speeds. Every round closes at once when all expected
    # peers have joined, so this costs time only when a peer is missing.
    "matchmaking_time": 5.0,
    "round_timeout": 30.0,
    "stall_timeout": 5.0,
    "state_timeout": 120.0,
    # adaptive: the timeouts above are floors, raised by what the links measured
    # (averaging/deadlines.py); fixed: they are used as they are.
    "deadlines": "adaptive",
    **_VERIFY_DEFAULTS,
}

DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "diloco": _DILOCO_DEFAULTS,
    "streaming": {
        **{k: v for k, v in _DILOCO_DEFAULTS.items() if k not in _VERIFY_DEFAULTS},
        "verify": False,
        "fragments": 4,
        "overlap_steps": 5,
        "mixing": 0.5,  # local = mixing*local + (1-mixing)*global at the merge (paper: 0.5)
        "codec": "int8",  # the paper quantized outer gradients to 4 bits
    },
    "noloco": {
        "inner_steps": 50,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "param_mixing": 1.0,  # how far the outer params move toward the pair's mean
        "codec": "none",
        "round_timeout": 30.0,
        "stall_timeout": 5.0,
        "state_timeout": 120.0,
        "deadlines": "adaptive",
        "verify": False,
    },
}

_CHECKS: dict[str, dict[str, tuple[_Check, str]]] = {
    "diloco": {**_SHARED_CHECKS, **_GROUP_CHECKS, **_VERIFY_CHECKS},
    "streaming": {
        **_SHARED_CHECKS,
        **_GROUP_CHECKS,
        **_NO_VERIFY,
        "fragments": (_integer(1, 1024), "an int in 1..1024"),
        "overlap_steps": (_integer(0), "an int >= 0"),
        "mixing": (_number(0, 1), "a number in [0, 1]"),
    },
    "noloco": {
        **_SHARED_CHECKS,
        **_NO_VERIFY,
        "param_mixing": (_number(0, 1), "a number in [0, 1]"),
    },
}


def resolve_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """`DEFAULT_OPTIONS[name]` overridden by `options`, every value checked."""
    if name not in DEFAULT_OPTIONS:
        raise ValueError(f"unknown outer strategy {name!r}; known: {sorted(DEFAULT_OPTIONS)}")
    checks = _CHECKS[name]
    for key in options:
        if key not in checks:
            raise ValueError(f"unknown option {key!r} for {name}; known: {sorted(checks)}")
    out = {**DEFAULT_OPTIONS[name], **options}
    for key, (check, what) in checks.items():
        if not check(out[key]):
            raise ValueError(f"option {key!r} of {name} must be {what}, got {out[key]!r}")
    if out["outer_momentum"] >= 1:
        raise ValueError(f"option 'outer_momentum' must be < 1, got {out['outer_momentum']!r}")
    if "min_group_size" in out and out["min_group_size"] > out["target_group_size"]:
        raise ValueError("option 'min_group_size' must not exceed 'target_group_size'")
    if name == "streaming" and out["overlap_steps"] >= out["inner_steps"]:
        raise ValueError("option 'overlap_steps' must be below 'inner_steps'")
    return out


def allreduce_config(opts: Mapping[str, Any]) -> AllReduceConfig:
    """Silence for `stall_timeout` drops a member; the round's other waits follow it."""
    stall = float(opts["stall_timeout"])
    reduction = opts.get("reduction", "auto")
    if reduction == "auto":
        reduction = "centered_clip" if opts.get("verify") else "mean"
    return AllReduceConfig(
        codec=opts["codec"],
        reduction=reduction,
        stall_timeout=stall,
        decision_timeout=stall,
        start_timeout=stall,
        heartbeat_interval=min(1.0, stall / 4),
    )


# How long a leader with nobody else declared waits before it gives the round up.
ALONE_AFTER = 1.0


def matchmaking_config(opts: Mapping[str, Any]) -> MatchmakingConfig:
    return MatchmakingConfig(
        min_group_size=opts["min_group_size"],
        target_group_size=opts["target_group_size"],
        matchmaking_time=float(opts["matchmaking_time"]),
        # A follower waits this long for its leader's answer; the leader may wait
        # up to matchmaking_time for slower peers first.
        join_timeout=float(opts["matchmaking_time"]) + 2.0,
        # A round is optional for an outer optimizer: alone, it trains on instead
        # of stalling for round_timeout at every boundary. Peers that train are
        # declared from `start` on, so this only fires when nobody else is there.
        give_up_alone_after=ALONE_AFTER,
    )


def state_protocol(key: str) -> str:
    """One state server per key on a host: the key is part of the protocol name."""
    return f"{STATE_PROTOCOL}/{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class RoundGate:
    """Tells `finish` when no round is in flight (rounds run inside `after_inner_step`)."""

    def __init__(self) -> None:
        self.closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    def __enter__(self) -> RoundGate:
        self._idle.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        self._idle.set()

    async def close(self, timeout: float) -> bool:
        """No new rounds; wait up to `timeout` for the one in flight. False: it did not end."""
        self.closing = True
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


def check_like(what: str, got: object, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`got` as a list of tensors shaped like `like` (a checkpoint's entry), else ValueError."""
    if not isinstance(got, list | tuple) or len(got) != len(like):
        raise ValueError(f"checkpoint entry {what!r} must list {len(like)} tensors")
    out = []
    for i, (g, t) in enumerate(zip(got, like, strict=True)):
        if not isinstance(g, torch.Tensor) or g.shape != t.shape:
            raise ValueError(f"checkpoint entry {what!r}[{i}] must be a tensor of {tuple(t.shape)}")
        out.append(g)
    return out
