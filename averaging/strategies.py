"""Outer strategies by name: what a trainer builds from an experiment's manifest."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shoal.dht.node import DHTNode

from .options import StrategyOptions
from .outer import OuterStrategy, resolve_options

__all__ = ["make_strategy", "strategy_class"]


def strategy_class(options: StrategyOptions) -> type[Any]:
    """The implementation its schema names ("module:Class"), imported now."""
    module, _, name = type(options).implementation.partition(":")
    if not (module and name):
        raise ValueError(f"strategy {options.name!r} is not built by make_strategy")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def make_strategy(
    name: str,
    dht: DHTNode,
    key: str,
    params: Sequence[torch.Tensor],
    options: Mapping[str, Any] | None = None,
) -> OuterStrategy:
    """The outer strategy `name` over `params` (the model's parameters, changed in place),
    with `options` (a manifest's map, or its parsed schema) completed from the
    defaults and checked."""
    opts = resolve_options(name, options or {})
    return strategy_class(opts)(dht, key, params, opts)  # type: ignore[no-any-return]
