"""An averager's configuration: its matchmaking, all-reduce, codec and retries."""

from __future__ import annotations

from dataclasses import dataclass, field

from .allreduce import AllReduceConfig
from .matchmaking import MatchmakingConfig
from .state_sync import DEFAULT_PROTOCOL as STATE_PROTOCOL


@dataclass
class AveragerConfig:
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    codec: str = "none"
    # Immediate retries among the survivors after an aborted round.
    max_retries: int = 3
    bandwidth: float = 1.0
    state_protocol: str = STATE_PROTOCOL
    # One state shared by the whole swarm (see averager.py's docstring): hash-chained
    # versions, and a peer with nobody else to average with commits alone.
    shared_state: bool = False
    # A commit alone (or in a group of one) leaves its version behind, as a commit with
    # others does (`Matchmaker.supersede`): a peer that comes back at that older version
    # does not pull us back onto it. Off for DiLoCo, whose certified lineages outrank a chain of
    # lone commits (a liar's is free); on for a pipeline stage, whose peers step alone
    # only when no other peer is at their version (`stage_peer`), so the lone chain is
    # the stage's.
    alone_supersedes: bool = False
    # The longest a re-sync may take when the step has no deadline of its own.
    state_timeout: float = 120.0
    # Deadlines from measured link rates and RTTs (`deadlines.AdaptiveDeadlines`), the
    # configured ones (matchmaking, stall, state, the step's timeout) as floors.
    adaptive_deadlines: bool = False
