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

Each strategy's options are a typed schema (`options.OuterOptions` subclasses,
torch-free, listed in `registry`); the manifest records them as a plain map.
`resolve_options` reads such a map: the defaults filled in, unknown names and
bad values refused with a ValueError that names the option. The strategies
build on `strategy_base.OuterStrategyBase`; `strategies.make_strategy` makes
one by name.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from shoal.transport.identity import PeerID

from .allreduce import AllReduceConfig
from .attestation import Attestor
from .matchmaking import MatchmakingConfig
from .options import GroupOptions, OuterOptions
from .registry import outer_strategy_names, schema_of
from .state_sync import DEFAULT_PROTOCOL as STATE_PROTOCOL

__all__ = [
    "DEFAULT_OPTIONS",
    "OuterStrategy",
    "RoundOutcome",
    "RoundReport",
    "VerifyingStrategy",
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
    """What the trainer, the session and the status surfaces use of a strategy."""

    name: str  # its schema's name: "diloco" | "streaming" | "noloco" | ...
    options: OuterOptions  # its schema, parsed
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


@runtime_checkable
class VerifyingStrategy(OuterStrategy, Protocol):
    """A strategy whose rounds a verifier audits (its schema's `can_verify`): the peer
    layer's verifier is built from `audit_shape` and `shun`, then attached."""

    def audit_shape(self) -> tuple[int, int, str]:
        """What its rounds send, as an auditor re-derives it: the all-reduce's streams
        per peer, chunk bytes and codec name."""
        ...

    def shun(self, peer: PeerID, seconds: float) -> None:
        """Leave `peer` out of our rounds for `seconds`."""
        ...

    def attach_attestor(self, attestor: Attestor) -> None:
        """From now on, commit to our contributions and check the others' with
        `attestor` (before `start`)."""
        ...


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


class _Defaults(Mapping[str, dict[str, Any]]):
    """Each registered outer strategy's default options (read from its schema)."""

    def __getitem__(self, name: str) -> dict[str, Any]:
        try:
            return schema_of(name, outer=True).defaults()
        except ValueError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(outer_strategy_names())

    def __len__(self) -> int:
        return len(outer_strategy_names())


DEFAULT_OPTIONS: Mapping[str, dict[str, Any]] = _Defaults()


def resolve_options(name: str, options: Mapping[str, Any]) -> OuterOptions:
    """The options of outer strategy `name`: its schema's defaults overridden by
    `options`, every value checked (ValueError names the option)."""
    parsed = schema_of(name, outer=True).parse(options)
    assert isinstance(parsed, OuterOptions), f"{name}'s schema is not an OuterOptions"
    return parsed


def allreduce_config(opts: OuterOptions) -> AllReduceConfig:
    """Silence for `stall_timeout` drops a member; the round's other waits follow it."""
    stall = float(opts.stall_timeout)
    reduction = getattr(opts, "reduction", "auto")  # (a strategy without the option: auto)
    if reduction == "auto":
        reduction = "centered_clip" if opts.verify else "mean"
    return AllReduceConfig(
        codec=opts.codec,
        reduction=reduction,
        stall_timeout=stall,
        decision_timeout=stall,
        start_timeout=stall,
        heartbeat_interval=min(1.0, stall / 4),
    )


# How long a leader with nobody else declared waits before it gives the round up.
ALONE_AFTER = 1.0


def matchmaking_config(opts: GroupOptions) -> MatchmakingConfig:
    return MatchmakingConfig(
        min_group_size=opts.min_group_size,
        target_group_size=opts.target_group_size,
        matchmaking_time=float(opts.matchmaking_time),
        # A follower waits this long for its leader's answer; the leader may wait
        # up to matchmaking_time for slower peers first.
        join_timeout=float(opts.matchmaking_time) + 2.0,
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
