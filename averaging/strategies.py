"""Outer strategies by name: what a trainer builds from an experiment's manifest."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shoal.dht.node import DHTNode

from .diloco import DiLoCo, StreamingDiLoCo
from .noloco import NoLoCo
from .outer import OuterStrategy, resolve_options
from .strategy_base import OuterStrategyBase

__all__ = ["STRATEGIES", "make_strategy"]

STRATEGIES: dict[str, type[OuterStrategyBase]] = {
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "noloco": NoLoCo,
}


def make_strategy(
    name: str,
    dht: DHTNode,
    key: str,
    params: Sequence[torch.Tensor],
    options: Mapping[str, Any] | None = None,
) -> OuterStrategy:
    """The outer strategy `name` over `params` (the model's parameters, changed in place),
    its options completed from the defaults and checked."""
    opts = resolve_options(name, options or {})
    return STRATEGIES[name](dht, key, params, opts)  # type: ignore[return-value]
