"""The strategies by name: each name's option schema, read by the CLI, the manifest,
the session and the status surfaces (torch-free).

A strategy is one line here (or one `register` call from the layer that defines
it: the pipeline registers itself in `shoal.pipeline.options`, which the peer
imports). Its implementation is imported only when one is built
(`strategies.make_strategy`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any, TypeVar

from .diloco_options import DiLoCoOptions, StreamingOptions
from .moshpit_options import MoshpitOptions
from .noloco_options import NoLoCoOptions
from .options import OuterOptions, StrategyOptions, VerifyingOptions

__all__ = [
    "can_verify",
    "describe_strategies",
    "is_pipeline",
    "outer_strategy_names",
    "parse_options",
    "register",
    "schema_of",
    "strategy_names",
    "unregister",
]

_SCHEMAS: dict[str, type[StrategyOptions]] = {}
S = TypeVar("S", bound=type[StrategyOptions])


def register(schema: S) -> S:
    """Make the strategy `schema.name` known (also as a class decorator)."""
    known = _SCHEMAS.get(schema.name)
    if known is not None and known is not schema:
        raise ValueError(f"strategy {schema.name!r} is already registered ({known.__qualname__})")
    if issubclass(schema, OuterOptions) and schema.can_verify != issubclass(
        schema, VerifyingOptions
    ):
        raise ValueError(f"{schema.__qualname__}: an outer strategy verifies by VerifyingOptions")
    if schema.implementation and ":" not in schema.implementation:
        raise ValueError(f"{schema.__qualname__}.implementation must read 'module:Class'")
    _SCHEMAS[schema.name] = schema
    return schema


def unregister(name: str) -> None:
    """Forget a registered strategy (a test's own)."""
    _SCHEMAS.pop(name, None)


# The built-in outer strategies, in the order --help lists them.
register(DiLoCoOptions)
register(StreamingOptions)
register(NoLoCoOptions)
register(MoshpitOptions)


def strategy_names() -> tuple[str, ...]:
    return tuple(_SCHEMAS)


def outer_strategy_names() -> tuple[str, ...]:
    """What --strategy chooses from (a pipeline is chosen with --pipeline-stages)."""
    return tuple(n for n, s in _SCHEMAS.items() if not s.is_pipeline)


def schema_of(name: str, *, outer: bool = False) -> type[StrategyOptions]:
    """The schema of strategy `name` (`outer`: of an outer strategy); ValueError if unknown."""
    schema = _SCHEMAS.get(name)
    if schema is None or (outer and schema.is_pipeline):
        kind = "outer strategy" if outer else "strategy"
        known = outer_strategy_names() if outer else strategy_names()
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(known)}")
    return schema


def parse_options(name: str, options: Mapping[str, Any]) -> StrategyOptions:
    """`options` (a manifest's, or the flags') read by strategy `name`'s schema."""
    return schema_of(name).parse(options)


def is_pipeline(name: str) -> bool:
    """Whether strategy `name` runs as a pipeline (False for a name unknown here: a
    manifest's claim, which building its strategy then refuses)."""
    schema = _SCHEMAS.get(name)
    return schema is not None and schema.is_pipeline


def can_verify(name: str) -> bool:
    schema = _SCHEMAS.get(name)
    return schema is not None and schema.can_verify


def describe_strategies(width: int = 88) -> str:
    """Every strategy and its options with their defaults, for --help and the docs:
    the options all outer strategies share (same default) first, then each one's own."""
    outer = [_SCHEMAS[n] for n in outer_strategy_names()]
    shared = set.intersection(*(set(s.help_lines()) for s in outer)) if outer else set()
    out: list[str] = []
    if shared:
        out.append(f"Every outer strategy ({', '.join(s.name for s in outer)}):")
        out += [_wrap(line, width) for line in outer[0].help_lines() if line in shared]
    for schema in _SCHEMAS.values():
        how = "--pipeline-stages N" if schema.is_pipeline else f"--strategy {schema.name}"
        out.append(textwrap.fill(f"{schema.name} ({how}): {schema.description}", width))
        own = [line for line in schema.help_lines() if schema.is_pipeline or line not in shared]
        out += [_wrap(line, width) for line in own]
    return "\n".join(out) + "\n"


def _wrap(line: str, width: int) -> str:
    return textwrap.fill(line, width, initial_indent="  ", subsequent_indent="      ")
