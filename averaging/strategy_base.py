"""What every outer strategy shares: lifecycle, the round gate, the shutdown bound,
checkpoint checks and round reports.

A strategy subclasses `OuterStrategyBase` and supplies its round (`_round`),
what it does between rounds (`_between_rounds`), how it closes its parts
(`_close_parts`) and its state. The base runs the common schedule: a round
every `inner_steps` inner steps, none once `finish` has begun, and `finish`
waiting for a round in flight no longer than the round's own deadlines allow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from shoal.dht.node import DHTNode

from .averager import Attempt, StepResult
from .host_state import check_params
from .options import OuterOptions
from .outer import RoundGate, RoundOutcome, RoundReport

log = logging.getLogger("shoal.averaging")

__all__ = [
    "FINISH_MARGIN",
    "OuterStrategyBase",
    "RoundClock",
    "checked_counters",
    "round_bound",
]

# finish() waits for a round in flight this much beyond its own deadlines.
FINISH_MARGIN = 5.0


def round_bound(opts: OuterOptions) -> float:
    """How long a round may take at most: matchmaking, then an all-reduce whose
    members are dropped after `stall_timeout` of silence (and a decision after that)."""
    return float(opts.round_timeout) + 4 * float(opts.stall_timeout) + FINISH_MARGIN


class RoundClock:
    """Time and bytes a round took: started when made, read by `report`."""

    def __init__(self, dht: DHTNode) -> None:
        self._host = dht.host
        self._sent = self._host.bytes_sent
        self._started = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._started

    @property
    def bytes_sent(self) -> int:
        return self._host.bytes_sent - self._sent


class OuterStrategyBase:
    """The shared part of `outer.OuterStrategy` implementations."""

    name: ClassVar[str]
    options: OuterOptions

    def __init__(
        self, dht: DHTNode, key: str, params: Sequence[torch.Tensor], options: OuterOptions
    ) -> None:
        """`options`: its schema, parsed (`outer.resolve_options`); or use
        `strategies.make_strategy`."""
        if options.name != self.name:
            raise ValueError(f"{type(self).__name__} takes {self.name} options, not {options.name}")
        self.dht = dht
        self.key = key
        self.options = options
        self.params = check_params(params)
        self.inner_steps_per_round = int(options.inner_steps)
        self.inner_steps = 0  # inner steps taken (since start or as restored)
        self.samples_since_sync = 0  # samples behind the state last synchronized
        self.synced_at_step = 0  # `inner_steps` then: our input covers the steps after
        self._restored = False  # load_state_dict ran: start from the checkpoint
        self.resets = 0  # `OuterStrategy.resets`
        self._gate = RoundGate()
        self._closed = False

    @property
    def provenance(self) -> dict[str, Any] | None:
        """Where our shared state comes from (`Averager.provenance_status`); None for a
        strategy without one."""
        return None

    @property
    def oversized_refused(self) -> int:
        """State downloads refused for a layout unlike ours, before allocating it
        (`state_sync.UnexpectedLayout`)."""
        return 0

    def _synced_now(self) -> None:
        """Our parameters are the global state now (loaded from the swarm, or set back
        to it): the samples our next input carries count from here. (A checkpoint's
        count covers steps whose work the parameters no longer hold.)"""
        self.samples_since_sync = 0
        self.synced_at_step = self.inner_steps
        self.resets += 1

    # ------------------------------------------------------------------ schedule

    async def after_inner_step(self, samples: int) -> list[RoundReport]:
        """A round every `inner_steps` inner steps (none once `finish` began)."""
        self.inner_steps += 1
        self.samples_since_sync += samples
        if self._gate.closing:
            return []
        with self._gate:
            if self.inner_steps % self.inner_steps_per_round:
                await self._between_rounds()
                return []
            return [await self._round()]

    async def _round(self) -> RoundReport:
        raise NotImplementedError

    async def _between_rounds(self) -> None:
        """Called at inner steps without a round (e.g. to stay announced)."""

    # ------------------------------------------------------------------ lifecycle

    async def finish(self) -> None:
        """No new rounds; a round in flight finishes or aborts within a bounded time."""
        if not await self._gate.close(round_bound(self.options)):
            log.warning("%s: a round was still running at shutdown", self.key)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.finish()
        await self._close_parts()

    async def _close_parts(self) -> None:
        """Close what the strategy owns (averagers, servers), after `finish`."""

    # ------------------------------------------------------------------ helpers

    def _check_checkpoint(self, state: Mapping[str, Any]) -> None:
        if state.get("strategy") != self.name:
            raise ValueError(f"not a {self.name} checkpoint: {state.get('strategy')!r}")

    def _report(
        self,
        outcome: RoundOutcome,
        detail: str,
        *,
        group_size: int,
        fingerprint: str | None,
        duration_s: float,
        bytes_sent: int,
        result: StepResult | None = None,
        contribution: tuple[int, int] | None = None,
    ) -> RoundReport:
        """`result`: the averager's step the round was (its ledger goes in the report);
        `contribution`: the inner steps (after, through] our input covered."""
        ledger: dict[str, Any] = {}
        if result is not None:
            ledger = {
                "round_id": None if result.round_id is None else result.round_id.hex(),
                "members": tuple(str(p) for p in result.members),
                "included": tuple(sorted(str(p) for p, w in result.weights.items() if w > 0)),
                "aborted_rounds": tuple(r.hex() for r in result.aborted_rounds),
                "attempts": tuple(_attempt_entry(a) for a in result.attempt_log),
            }
        return RoundReport(
            outer_step=self.outer_steps,  # type: ignore[attr-defined]  # each strategy's
            outcome=outcome,
            detail=detail,
            group_size=group_size,
            duration_s=duration_s,
            fingerprint=fingerprint,
            bytes_sent=bytes_sent,
            contribution=contribution,
            **ledger,
        )


def _attempt_entry(attempt: Attempt) -> dict[str, Any]:
    return {
        "matchmaking_s": round(attempt.matchmaking_s, 3),
        "averaging_s": round(attempt.averaging_s, 3),
        "group_size": attempt.group_size,
        "outcome": attempt.outcome,
        "excluded": list(attempt.excluded),
    }


def checked_counters(state: Mapping[str, Any], names: Sequence[str]) -> list[int]:
    """The checkpoint's counters `names`, each an int >= 0, else ValueError."""
    values = [state.get(k) for k in names]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"checkpoint counters {', '.join(names)} must be ints >= 0")
    return values  # type: ignore[return-value]
