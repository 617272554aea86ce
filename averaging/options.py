"""Typed, torch-free option schemas of the strategies: defaults, bounds, help, abilities.

Every strategy (the outer optimizers here, the pipeline in `shoal.pipeline`) has
one `StrategyOptions` subclass: a frozen dataclass whose fields are its options,
each declared with an `Opt` (what a good value is, and one line of help). The
schema says what the strategy can do (`can_verify`, `is_pipeline`) and where its
implementation lives (`implementation`, "module:Class", imported only when a
strategy is built, so that the CLI reads the schemas without torch).

An experiment's manifest records the options as a plain map (`to_dict`);
`parse` reads such a map back: it fills in the defaults (a key a manifest lacks
means its default, so manifests written before an option existed still load),
rejects unknown names and bad values with a ValueError that names the option,
and keeps every value as given (an int stays an int, so a manifest's bytes do
not change). The parsed object is also a read-only mapping of the same keys.

`registry` maps names to schemas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

__all__ = [
    "CODEC_NAMES",
    "REDUCTION_NAMES",
    "SPARSE_CODEC_NAMES",
    "GroupOptions",
    "Opt",
    "OuterOptions",
    "StrategyOptions",
    "VerifyingOptions",
    "boolean",
    "integer",
    "number",
    "one_of",
]

# The names of `compression.CODECS` and `reducer.REDUCTIONS`, here without torch
# (tests/test_strategy_registry.py checks that they agree).
CODEC_NAMES = ("none", "fp16", "bf16", "int8", "int4")
# `sparse_codec.SPARSE_KINDS`: codecs of a whole pseudo-gradient, with error feedback.
SPARSE_CODEC_NAMES = ("topk", "dct")
REDUCTION_NAMES = ("mean", "centered_clip")

Check = Callable[[Any], bool]


def number(
    lo: float, hi: float = float("inf"), *, lo_open: bool = False, hi_open: bool = False
) -> Check:
    """A real number (not a bool) within the bounds."""

    def check(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return check


def integer(lo: int, hi: int = 1 << 62) -> Check:
    """A whole number (not a bool) in lo..hi."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def one_of(*choices: Any) -> Check:
    return lambda v: isinstance(v, str) and v in choices


def boolean(v: Any) -> bool:
    return isinstance(v, bool)


@dataclass(frozen=True)
class Opt:
    """How one option is checked and described: `what` completes "must be ...",
    `help` is one line for --help and the docs."""

    check: Check
    what: str
    help: str
    # An option added after experiments were created: a manifest records it only when
    # it differs from its default, so that a new experiment with the defaults writes
    # the manifest (and gets the ID) it did before the option existed.
    added: bool = False

    def __call__(self, default: Any) -> Any:
        """The dataclass field of this option with `default`."""
        return field(default=default, metadata={"opt": self})


def _opt(f: dataclasses.Field[Any]) -> Opt:
    opt = f.metadata.get("opt")
    if not isinstance(opt, Opt):
        raise TypeError(f"field {f.name!r} of a strategy schema must be declared with an Opt")
    return opt


# Strategies that cannot verify accept only verify = false.
NO_VERIFY = "false (verification needs the diloco strategy)"


@dataclass(frozen=True, kw_only=True)
class StrategyOptions(Mapping[str, Any]):
    """One strategy's options; subclasses declare the fields and the class variables."""

    name: ClassVar[str]  # what --strategy and the manifest call it
    description: ClassVar[str]  # one line for --help and the docs
    # "module:Class" of the implementation, built with (dht, key, params, options);
    # "" for a strategy the session runs otherwise (the pipeline).
    implementation: ClassVar[str] = ""
    can_verify: ClassVar[bool] = False  # its work can be audited (`verify`)
    is_pipeline: ClassVar[bool] = False  # runs as a pipeline of stages (`PipelineRun`)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> Self:
        """The options of a manifest or of the flags: defaults filled in, every value
        checked; ValueError names the option."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in options:
            if key not in fields:
                raise ValueError(f"unknown option {key!r} for {cls.name}; known: {sorted(fields)}")
        parsed = cls(**options)
        for key, f in fields.items():
            value, opt = getattr(parsed, key), _opt(f)
            if not opt.check(value):
                raise ValueError(f"option {key!r} of {cls.name} must be {opt.what}, got {value!r}")
            if key == "verify" and value and not cls.can_verify:
                raise ValueError(
                    f"option 'verify' of {cls.name} must be {NO_VERIFY}, got {value!r}"
                )
        parsed.check_together()
        return parsed

    def check_together(self) -> None:
        """What no single option says (one option below another): ValueError."""

    @classmethod
    def for_new_experiment(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options a new experiment records for `options` (the flags): today's
        defaults where they differ from what a manifest without the key means
        (that key's legacy value, kept for the experiments written before)."""
        return dict(options)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """What a manifest records for the defaults (options `added` later left out)."""
        return {f.name: f.default for f in dataclasses.fields(cls) if not _opt(f).added}

    @classmethod
    def help_lines(cls) -> list[str]:
        """`name=default: help` per option, for --help and the docs (values as TOML)."""
        return [f"{f.name}={_toml(f.default)}: {_opt(f).help}" for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        """What the manifest records: every option, as given (an option `added` later
        only when it is not at its default)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not (_opt(f).added and getattr(self, f.name) == f.default)
        }

    # A read-only mapping of the same keys (code written against the manifest's map).

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def __getitem__(self, key: str) -> Any:
        if key not in self.option_names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.option_names())

    def __len__(self) -> int:
        return len(self.option_names())


def _toml(value: Any) -> str:
    """A default as --strategy-option takes it."""
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


# ---------------------------------------------------------------- outer strategies

INNER_STEPS = Opt(integer(1), "an int >= 1", "inner steps between two rounds (DiLoCo's H)")
OUTER_LR = Opt(number(0, lo_open=True), "a number > 0", "the outer optimizer's learning rate")
OUTER_MOMENTUM = Opt(
    number(0, 1, hi_open=True), "a number in [0, 1)", "the outer optimizer's Nesterov momentum"
)
CODEC = Opt(
    one_of(*CODEC_NAMES),
    f"one of {sorted(CODEC_NAMES)}",
    "how the averaged tensors travel: " + ", ".join(CODEC_NAMES),
)
SECONDS = "a number of seconds > 0"
ROUND_TIMEOUT = Opt(number(0, lo_open=True), SECONDS, "how long a round may take (seconds)")
STALL_TIMEOUT = Opt(
    number(0, lo_open=True), SECONDS, "silence after which a round member is dropped (seconds)"
)
STATE_TIMEOUT = Opt(
    number(0, lo_open=True), SECONDS, "how long a download of the swarm's state may take (seconds)"
)
DEADLINES = Opt(
    one_of("adaptive", "fixed"),
    "adaptive or fixed",
    "adaptive: the timeouts are floors, raised by what the links measured; fixed: as given",
)
VERIFY = Opt(
    boolean,
    "true or false",
    "audit the peers' work (--verify sets it; only a strategy that can verify takes true)",
)


@dataclass(frozen=True, kw_only=True)
class OuterOptions(StrategyOptions):
    """What every outer strategy (a round every `inner_steps` inner steps) has."""

    inner_steps: int = INNER_STEPS(50)
    outer_lr: float = OUTER_LR(0.7)  # DiLoCo paper
    outer_momentum: float = OUTER_MOMENTUM(0.9)  # DiLoCo paper (Nesterov)
    codec: str = CODEC("none")
    round_timeout: float = ROUND_TIMEOUT(30.0)
    stall_timeout: float = STALL_TIMEOUT(5.0)
    state_timeout: float = STATE_TIMEOUT(120.0)
    # adaptive: the timeouts above are floors, raised by what the links measured
    # (averaging/deadlines.py); fixed: they are used as they are.
    deadlines: str = DEADLINES("adaptive")
    # Verification (`shoal.verification`, run by the peer): off unless a manifest says
    # so, so that experiments created before it keep running as they were.
    verify: bool = VERIFY(False)


PROBABILITY = "a number in [0, 1]"


@dataclass(frozen=True, kw_only=True)
class VerifyingOptions(OuterOptions):
    """Outer strategies that can verify (`outer.VerifyingStrategy`): the audit policy."""

    can_verify = True

    audit_rate: float = Opt(number(0, 1), PROBABILITY, "audit probability per contribution")(0.05)
    audit_probation_rate: float = Opt(
        number(0, 1), PROBABILITY, "audit probability for peers new in our sight"
    )(0.5)
    audit_segment_steps: int = Opt(
        integer(1, 4096), "an int in 1..4096", "inner steps per checkpoint: what one audit re-runs"
    )(3)
    # 4x the calibrated fp32 honest floor.
    audit_threshold_angle: float = Opt(
        number(0, 3.2, lo_open=True),
        "an angle in (0, 3.2] radians",
        "how far a re-run may point from the claimed update (radians)",
    )(3.2e-3)


@dataclass(frozen=True, kw_only=True)
class GroupOptions(OuterOptions):
    """Outer strategies that average in groups formed by matchmaking."""

    min_group_size: int = Opt(
        integer(1, 1024), "an int in 1..1024", "the smallest group that averages"
    )(2)
    # DiLoCo's global parameters are one state: the whole swarm should fit in one
    # group. A larger swarm splits, and each group's globals then go their own way
    # (a peer that lands in another group later re-syncs when its version is behind).
    target_group_size: int = Opt(
        integer(1, 1024), "an int in 1..1024", "the largest group a round forms"
    )(64)
    # How long a leader waits for peers it expects (members of the previous round,
    # peers that declared themselves at start): the spread of arrival times of
    # peers of slightly different speeds. Every round closes at once when all expected
    # peers have joined, so this costs time only when a peer is missing.
    matchmaking_time: float = Opt(
        number(0, lo_open=True), SECONDS, "how long a leader waits for the peers it expects"
    )(5.0)

    def check_together(self) -> None:
        super().check_together()
        if self.min_group_size > self.target_group_size:
            raise ValueError("option 'min_group_size' must not exceed 'target_group_size'")
