"""The codec of a new unverified DiLoCo experiment whose flags name none: sparse
(`topk`, with its defaults) for a model of at least `SPARSE_MIN_PARAMETERS`, dense
below that.

Measured with bench/wan.py (4 peers, 50 Mbit/s, 25 ms one way, the same run for
every row of a model; docs/benchmarks.md, "Which codec by default"):

- the daemon's model, 0.45M parameters (180 s an arm): int8 at H = 50 overlapped
  ended 7.2% below int8 without, topk at the default density (H = 20, overlapped)
  2.3% below: dense overlapped is the better one there (int8 and float32 DiLoCo end
  within 1.1% of each other);
- 4 times wider, 1.68M parameters (240 s an arm, three runs): topk ended 6.4% and 6.5%
  below int8, and 4.8% below int8 overlapped (run 2), on 22x fewer bytes a round than
  int8; at density 1/256, 2.9% below float32 DiLoCo on 199x fewer bytes (run 3).

A verified experiment stays dense: `--verify auto` leaves sparse experiments
unverified (an audit reveals three model sizes, many times a sparse round), so a
sparse default there would take verification away from experiments that did not
ask for that.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .training.task import Task

__all__ = ["SPARSE_MIN_PARAMETERS", "model_parameters", "with_default_codec"]

log = logging.getLogger("shoal.session")

SPARSE_MIN_PARAMETERS = 1_000_000
SPARSE_CODEC = "topk"


def model_parameters(task: Task) -> int | None:
    """The parameters of the task's model, built on the meta device (no memory, no
    initialization); None when the task cannot build it there."""
    try:
        with torch.device("meta"):
            model = task.make_model(0)
        return sum(p.numel() for p in model.parameters())
    except Exception as e:  # a task of the user's own: any failure means "unknown"
        log.debug("counting the model's parameters on the meta device failed: %r", e)
        return None


def with_default_codec(
    strategy: str, options: dict[str, Any], task: Task, name: str = ""
) -> dict[str, Any]:
    """`options` (after `verification_options`: `verify` decided) with `codec` set to
    `SPARSE_CODEC` when the experiment is DiLoCo, unverified, names no codec, and its
    model holds at least `SPARSE_MIN_PARAMETERS` parameters."""
    if strategy != "diloco" or "codec" in options or options.get("verify") is not False:
        return options
    parameters = model_parameters(task)
    if parameters is None or parameters < SPARSE_MIN_PARAMETERS:
        return options
    log.info(
        "experiment %r: unverified, %.2fM parameters: its pseudo-gradients go sparse "
        "(codec %s, with error feedback; --strategy-option codec=none keeps them dense)",
        name,
        parameters / 1e6,
        SPARSE_CODEC,
    )
    return {**options, "codec": SPARSE_CODEC}
