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

A round of `inner_state` "quantize" starts from the global state and the
prover's own optimizer state, rounded to 8-bit codes (`state_codes`) at the
round's start. Its referee (2.8) asks for those codes instead of the start
(`reveals.fetch_reveal`'s `moments`): half a model size with AdamW, where the
start is three. It decodes them (the same bits on any machine), checks them
against the commitment's optimizer hash, and rebuilds from them as above.

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

from ..training.state_codes import CodedState, decode_state
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


def fresh_start(
    params: list[torch.Tensor],
    template: dict[str, Any],
    state: dict[int, dict[str, torch.Tensor]] | None = None,
) -> SegmentState:
    """The state a reset round starts from: `params` and an optimizer with the param
    groups of `template` (an `InnerOptimizer.state_dict()`) and no state (or
    `state`, per parameter: a quantized round's, decoded)."""
    optimizer = {
        "optimizer": {
            "state": state or {},
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
    moments: CodedState | None = None,
) -> SegmentState | None:
    """The state at the start of `segment` of `commitment`'s work, re-run here from the
    round's global state and a fresh optimizer, or the one `moments` codes (blocking:
    up to a round's inner steps); None when the work did not start from those, or the
    state reached does not hash to the committed one (ask the prover for it)."""
    state = None if moments is None else decode_state(moments)
    if optimizer_hash({"optimizer": {"state": state or {}}}) != commitment.optimizer:
        return None
    start_params = rnd.start_params if isinstance(rnd.start_params, list) else rnd.start_params()
    if params_hash(start_params) != commitment.start:
        return None
    start = fresh_start(start_params, template, state)
    first, _ = commitment.segment_bounds(segment)
    if first > 0:
        batches = prover_batches(task, num_shards, namespace, commitment, 0, first)
        start = runner.run(start, batches, commitment.first_step)
    return start if start.digest() == commitment.segment_start(segment) else None
