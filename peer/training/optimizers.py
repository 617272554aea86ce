"""The inner optimizer an experiment names: an allowlist of `torch.optim` classes, their
bounded arguments, and the state each keeps per parameter.

The choice is a manifest hyperparameter, ``inner_optimizer``: ``{"name": "SGD",
"momentum": 0.9, "nesterov": true}``; a manifest without it means AdamW (what every
experiment used before). It comes from a manifest another peer signed, so it is a
claim: only the classes of `INNER_OPTIMIZERS` (never an import path), only their
listed arguments, each within its bounds; anything else is refused in one line
naming the optimizer, the argument and the bound.

Three things stay the experiment's, whatever the optimizer: the learning rate
(`inner_lr` and `lr_schedule` set each group's lr before every step), the weight
decay (the `weight_decay` hyperparameter) and, for Adam and AdamW, beta2 unless
`betas` is given (`adam_beta2`).

`state_layout` says which state tensors, of which shapes, an optimizer keeps for a
parameter once it has stepped: what an auditor expects a reveal to hold. The
parsing and checking here are torch-free (the command line uses them); torch is
imported where an optimizer is built.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_INNER_OPTIMIZER",
    "INNER_OPTIMIZERS",
    "check_inner_optimizer",
    "describe_inner_optimizer",
    "is_default_inner_optimizer",
    "make_inner_optimizer",
    "parse_inner_optimizer",
    "state_layout",
]

DEFAULT_INNER_OPTIMIZER: dict[str, Any] = {"name": "AdamW"}


@dataclass(frozen=True)
class Number:
    """A float argument within [low, high] (`open_low`/`open_high`: the bound excluded)."""

    low: float
    high: float
    open_low: bool = False
    open_high: bool = False

    def problem(self, value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number in {self.describe()}, got {value!r}"
        if not math.isfinite(value):
            return f"must be a finite number in {self.describe()}, got {value!r}"
        too_low = value <= self.low if self.open_low else value < self.low
        too_high = value >= self.high if self.open_high else value > self.high
        if too_low or too_high:
            return f"must be in {self.describe()}, got {value!r}"
        return None

    def describe(self) -> str:
        opening = "(" if self.open_low else "["
        closing = ")" if self.open_high else "]"
        return f"{opening}{self.low:g}, {self.high:g}{closing}"


@dataclass(frozen=True)
class Flag:
    """A boolean argument."""

    def problem(self, value: object) -> str | None:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


@dataclass(frozen=True)
class Pair:
    """Two numbers, [first, second]; `first_may_be_null` (Adafactor's eps1: None means
    torch's own, the dtype's epsilon)."""

    first: Number
    second: Number
    first_may_be_null: bool = False

    def problem(self, value: object) -> str | None:
        if not isinstance(value, list | tuple) or len(value) != 2:
            return f"must be a list of two numbers, got {value!r}"
        if value[0] is None and self.first_may_be_null:
            return self._second(value[1])
        first = self.first.problem(value[0])
        return f"[0] {first}" if first else self._second(value[1])

    def _second(self, value: object) -> str | None:
        second = self.second.problem(value)
        return f"[1] {second}" if second else None


Argument = Number | Flag | Pair

_UNIT = Number(0.0, 1.0, open_high=True)  # a decay rate: 0 <= x < 1
_EPS = Number(0.0, 1.0, open_low=True)

# name -> the arguments the manifest may set. The lr and weight decay are the
# experiment's hyperparameters (`_SET_BY_HYPERPARAMETERS`), never an argument here.
INNER_OPTIMIZERS: dict[str, dict[str, Argument]] = {
    "AdamW": {"betas": Pair(_UNIT, _UNIT), "eps": _EPS, "amsgrad": Flag()},
    "Adam": {"betas": Pair(_UNIT, _UNIT), "eps": _EPS, "amsgrad": Flag()},
    "SGD": {"momentum": _UNIT, "dampening": _UNIT, "nesterov": Flag()},
    "RMSprop": {"alpha": _UNIT, "eps": _EPS, "momentum": _UNIT, "centered": Flag()},
    "Adafactor": {
        "beta2_decay": Number(-1.0, 0.0),
        "eps": Pair(_EPS, _EPS, first_may_be_null=True),
        "d": Number(0.0, 1000.0, open_low=True),
    },
}

_SET_BY_HYPERPARAMETERS = {
    "lr": "the experiment's inner_lr and lr_schedule",
    "weight_decay": "the experiment's weight_decay hyperparameter",
}


def check_inner_optimizer(value: object) -> dict[str, Any]:
    """`value` (a manifest's ``inner_optimizer``, or the text of the flag) as
    ``{"name": ..., arguments...}`` with float arguments as floats; ValueError in one
    line naming what is wrong (an unknown optimizer or argument, a value out of bounds)."""
    if isinstance(value, str):
        return parse_inner_optimizer(value)
    if not isinstance(value, dict):
        raise ValueError(f'inner_optimizer must be {{"name": ..., arguments}}, got {value!r}'[:200])
    name = value.get("name")
    if not isinstance(name, str) or name not in INNER_OPTIMIZERS:
        raise ValueError(
            f"inner_optimizer {name!r} is not allowed; allowed: {', '.join(INNER_OPTIMIZERS)}"[:200]
        )
    allowed = INNER_OPTIMIZERS[name]
    out: dict[str, Any] = {"name": name}
    for arg in sorted((k for k in value if k != "name"), key=repr):
        if arg in _SET_BY_HYPERPARAMETERS:
            raise ValueError(
                f"inner_optimizer {name}: {arg} is not an argument here; it is "
                f"{_SET_BY_HYPERPARAMETERS[arg]}"
            )
        if arg not in allowed:
            known = ", ".join(allowed) or "none"
            raise ValueError(
                f"inner_optimizer {name}: unknown argument {arg!r}; known: {known}"[:200]
            )
        problem = allowed[arg].problem(value[arg])
        if problem:
            raise ValueError(f"inner_optimizer {name}: {arg} {problem}"[:200])
        out[arg] = _normalized(value[arg])
    if (
        name == "SGD"
        and out.get("nesterov")
        and (out.get("momentum", 0.0) == 0 or out.get("dampening", 0.0) != 0)
    ):
        raise ValueError("inner_optimizer SGD: nesterov needs momentum > 0 and dampening 0")
    return out


def _normalized(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    return [_normalized(v) for v in value]


def parse_inner_optimizer(text: str) -> dict[str, Any]:
    """The flag's value: ``NAME[:key=value,...]`` (values in JSON: numbers, true,
    false, null) or a JSON object ``{"name": ..., ...}`` (for list arguments such as
    ``betas``). ValueError in one line."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"inner_optimizer: not JSON ({e})") from None
        return check_inner_optimizer(value)
    name, _, rest = text.partition(":")
    value = {"name": name.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"inner_optimizer: expected key=value, got {item!r}")
        try:
            value[key.strip()] = json.loads(raw.strip())
        except ValueError:
            raise ValueError(
                f"inner_optimizer: {key.strip()}={raw.strip()!r} is not a number, true or "
                "false (list arguments need the JSON form)"
            ) from None
    return check_inner_optimizer(value)


def describe_inner_optimizer(choice: Mapping[str, Any]) -> str:
    """``SGD (momentum=0.9, nesterov=true)``, for the log."""
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in choice.items() if k != "name")
    return f"{choice['name']} ({args})" if args else str(choice["name"])


def is_default_inner_optimizer(choice: Mapping[str, Any]) -> bool:
    """AdamW without arguments: what a manifest without ``inner_optimizer`` means."""
    return dict(choice) == DEFAULT_INNER_OPTIMIZER


def make_inner_optimizer(params: Iterable[Any], hyper: Mapping[str, Any]) -> Any:
    """The `torch.optim` optimizer of `hyper` (as `check_hyperparameters` returns it)
    over `params`. ValueError when this torch lacks the class (Adafactor before 2.5)."""
    import torch

    choice = hyper.get("inner_optimizer") or DEFAULT_INNER_OPTIMIZER
    name = choice["name"]
    cls = getattr(torch.optim, name, None)
    if name not in INNER_OPTIMIZERS or cls is None:
        raise ValueError(
            f"inner_optimizer {name} is not in this torch ({torch.__version__}); "
            "upgrade torch to join this experiment"
        )
    kwargs: dict[str, Any] = {"lr": hyper["inner_lr"], "weight_decay": hyper["weight_decay"]}
    if name in ("Adam", "AdamW"):
        kwargs["betas"] = (0.9, hyper["adam_beta2"])
    for arg, value in choice.items():
        if arg != "name":
            kwargs[arg] = tuple(value) if isinstance(value, list) else value
    return cls(params, **kwargs)


def _adam(shape: tuple[int, ...], choice: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    out = {"step": (), "exp_avg": shape, "exp_avg_sq": shape}
    if choice.get("amsgrad"):
        out["max_exp_avg_sq"] = shape
    return out


def _sgd(shape: tuple[int, ...], choice: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    # Without momentum SGD keeps nothing.
    return {"momentum_buffer": shape} if choice.get("momentum", 0.0) != 0 else {}


def _rmsprop(shape: tuple[int, ...], choice: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    out = {"step": (), "square_avg": shape}
    if choice.get("momentum", 0.0) > 0:
        out["momentum_buffer"] = shape
    if choice.get("centered"):
        out["grad_avg"] = shape
    return out


def _adafactor(shape: tuple[int, ...], choice: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    # A matrix (or a stack of them) keeps factored second moments: one per row and
    # one per column of its last two dimensions; a vector or scalar keeps a full one.
    if len(shape) >= 2:
        return {
            "step": (),
            "row_var": (*shape[:-1], 1),
            "col_var": (*shape[:-2], 1, shape[-1]),
        }
    return {"step": (), "variance": shape}


_LAYOUTS: dict[str, Callable[[tuple[int, ...], Mapping[str, Any]], dict[str, tuple[int, ...]]]] = {
    "AdamW": _adam,
    "Adam": _adam,
    "SGD": _sgd,
    "RMSprop": _rmsprop,
    "Adafactor": _adafactor,
}


def state_layout(choice: Mapping[str, Any], shape: Iterable[int]) -> dict[str, tuple[int, ...]]:
    """The state tensors (name -> shape) that optimizer `choice` keeps for a parameter
    of `shape` once it has stepped (before its first step: none)."""
    return _LAYOUTS[choice["name"]](tuple(shape), choice)
