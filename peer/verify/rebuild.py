"""A segment's start state rebuilt by its referee instead of read from its prover.

An audit re-runs one segment of a prover's round from the state at its start:
parameters and the inner optimizer's state, three model sizes with AdamW. When
the round's work started from a fresh optimizer (the experiment's `inner_state`
is "reset": the commitment's optimizer hash is the empty state's,
`EMPTY_OPTIMIZER`), that start is public: the round's global state, which every
member of the round holds, and no optimizer state. The state at any later
segment's start then follows from it by the prover's own batches, which are a
function of (experiment, prover, round). So a referee of such a round re-runs
the steps before the segment itself and checks the state it reaches against the
commitment's checkpoint; equal, it holds the prover's start bit for bit, and the
reveal only had to carry a header (protocol 2.7, `reveals.fetch_reveal`'s
`start`).

Compute is traded for bytes: the referee runs up to a round's steps instead of
one segment's (at the default rate, about half a round's steps for every
twentieth contribution: 2.5% more inner steps over the swarm), and a home link
sends nothing but a header. A rebuilt state whose hash differs (another
machine's rounding, or a prover that lied before the drawn segment) proves
nothing either way: the referee then asks for the whole reveal, as before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from shoal.verification.commitment import Commitment

from ..training.task import Task
from .audit_round import AuditRound, prover_batches
from .segments import SegmentRunner, SegmentState, optimizer_hash, params_hash

__all__ = ["EMPTY_OPTIMIZER", "fresh_start", "rebuild_start", "rebuildable"]

# The hash of an optimizer that has not stepped: what a reset leaves (the hash reads
# the per-parameter state only; the param groups' lr follows the step count).
EMPTY_OPTIMIZER = optimizer_hash({"optimizer": {"state": {}}})


def rebuildable(commitment: Commitment) -> bool:
    """Whether the round's work of `commitment` started from a fresh optimizer (so
    from a state its referees can rebuild)."""
    return commitment.optimizer == EMPTY_OPTIMIZER


def fresh_start(params: list[torch.Tensor], template: dict[str, Any]) -> SegmentState:
    """The state a reset round starts from: `params` and an optimizer with the param
    groups of `template` (an `InnerOptimizer.state_dict()`) and no state."""
    optimizer = {
        "optimizer": {
            "state": {},
            "param_groups": copy.deepcopy(template["optimizer"]["param_groups"]),
        },
        "grad_scaler": copy.deepcopy(template.get("grad_scaler")),
    }
    return SegmentState(params, optimizer)


def rebuild_start(
    runner: SegmentRunner,
    task: Task,
    num_shards: int,
    namespace: str,
    rnd: AuditRound,
    commitment: Commitment,
    segment: int,
    template: dict[str, Any],
) -> SegmentState | None:
    """The state at the start of `segment` of `commitment`'s work, re-run here from the
    round's global state and a fresh optimizer (blocking: up to a round's inner steps);
    None when the work did not start fresh from that global state, or the state
    reached does not hash to the committed one (ask the prover for it)."""
    if not rebuildable(commitment):
        return None
    start_params = rnd.start_params if isinstance(rnd.start_params, list) else rnd.start_params()
    if params_hash(start_params) != commitment.start:
        return None
    start = fresh_start(start_params, template)
    first, _ = commitment.segment_bounds(segment)
    if first > 0:
        batches = prover_batches(task, num_shards, namespace, commitment, 0, first)
        start = runner.run(start, batches, commitment.first_step)
    return start if start.digest() == commitment.segment_start(segment) else None
