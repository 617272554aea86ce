"""A pipelined experiment's settings, as its manifest records them (strategy "pipeline")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.averaging.compression import CODECS

__all__ = ["PIPELINE_STRATEGY", "ROLES", "resolve_pipeline_options"]

PIPELINE_STRATEGY = "pipeline"
ROLES = ("auto", "trainer", "stage", "monitor")
MAX_STAGES = 64

DEFAULTS: dict[str, Any] = {
    "stages": 3,
    # Samples per optimizer step, over all trainers (None: 8 of the task's batches).
    "global_batch": None,
    # Global batches a trainer may start ahead of the slowest stage's steps (0: every
    # step takes exactly the next global batch, as in one process).
    "lag": 1,
    # Activations and gradients between stages (`wire`). With a task's bottleneck
    # between stages (bytegpt: config "bottleneck"), bf16 on its few coordinates is
    # ~20x fewer bytes than float32 (bench/pipeline.py's codec comparison).
    "codec": "int8",
    # Stage peers look this often for a stage that limits the pipeline more than
    # theirs, and move there (`rebalance`); 0: never (a peer stays where it joined).
    "rebalance_s": 30.0,
    "min_stage_peers": 1,  # a move never leaves a stage with fewer peers
    # Trainers audit stage peers' answers (`pipeline/auditor.py`): a cheater is
    # convicted, banned and its work re-run. Calibrated for float32.
    "verify": True,
}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_pipeline_options(options: Mapping[str, Any], batch_size: int) -> dict[str, Any]:
    """`DEFAULTS` overridden by `options`, checked; ValueError names the bad one."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ValueError(
            f"unknown pipeline option {sorted(unknown)[0]!r}; known: {sorted(DEFAULTS)}"
        )
    out = {**DEFAULTS, **options}
    if out["global_batch"] is None:
        out["global_batch"] = 8 * batch_size
    if not (_int(out["stages"]) and 2 <= out["stages"] <= MAX_STAGES):
        raise ValueError(f"pipeline stages must be a whole number from 2 to {MAX_STAGES}")
    if not (_int(out["global_batch"]) and out["global_batch"] >= batch_size):
        raise ValueError(f"global_batch must be a whole number >= the batch size ({batch_size})")
    if not (_int(out["lag"]) and 0 <= out["lag"] <= 4):
        raise ValueError("lag must be a whole number from 0 to 4")
    rebalance = out["rebalance_s"]
    if isinstance(rebalance, bool) or not isinstance(rebalance, int | float):
        raise ValueError("rebalance_s must be a number of seconds (0: never)")
    if not (rebalance == 0 or 1 <= rebalance <= 86400):
        raise ValueError("rebalance_s must be 0 (never) or from 1 to 86400 seconds")
    if not isinstance(out["verify"], bool):
        raise ValueError("verify must be true or false")
    if not (_int(out["min_stage_peers"]) and out["min_stage_peers"] >= 1):
        raise ValueError("min_stage_peers must be a whole number >= 1")
    if out["codec"] not in CODECS:
        raise ValueError(f"codec must be one of {', '.join(CODECS)}")
    return out
