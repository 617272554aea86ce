"""The options of DiLoCo and Streaming DiLoCo (`diloco.py`), torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from .options import (
    CODEC,
    CODEC_NAMES,
    PROBABILITY,
    REDUCTION_NAMES,
    SPARSE_CODEC_NAMES,
    GroupOptions,
    Opt,
    VerifyingOptions,
    integer,
    number,
    one_of,
)

__all__ = ["DiLoCoOptions", "StreamingOptions"]


def _reduction(v: object) -> bool:
    return v == "auto" or v in REDUCTION_NAMES


_DILOCO_CODECS = (*CODEC_NAMES, *SPARSE_CODEC_NAMES)
# A DCT basis is chunk x chunk floats, and its transforms cost chunk passes.
MAX_DCT_CHUNK = 1024
# SparseLoCo's 4096 (64 kept at the default density); a DCT chunk of 256 keeps 4
# coefficients and costs 256 multiply-adds per element to transform.
DEFAULT_CHUNKS = {"topk": 4096, "dct": 256}
# A sparse codec's outer step when none is given: SparseLoCo's (the error feedback
# already carries what a round did not send, as momentum would; Nesterov 0.9 on top
# of it diverged). bench/wan.py, 4 peers, 50 Mbit/s, the daemon's model, 180 s an
# arm, same run: int8 2.405; topk with Nesterov 0.9 / lr 0.7 4.877 (best 3.50);
# topk with momentum 0 / lr 1 2.539 (H = 50) and 2.508 (H = 10).
SPARSE_OUTER = {"outer_momentum": 0.0, "outer_lr": 1.0}
# How a new experiment's sparse rounds carry and combine what they send (SparseLoCo's
# error feedback decay and per-coordinate mean over the members that sent it); a
# manifest without these keys means the legacy values (no decay, the members' mean).
# bench/sparse_outer.py, 4 peers, the daemon's model, 1,000 inner steps each (final
# validation loss; int8 DiLoCo 2.498 at H = 50, 2.388 at H = 10): legacy 2.646 (H =
# 50); decay 0.9 alone 2.559; the senders' mean with decay 0.95 2.597, 0.9 2.516, 0.8
# 2.466; at H = 10, decay 0.9 and the senders' mean 2.262.
SPARSE_NEW = {"codec_feedback_decay": 0.9, "codec_mean": "senders"}
# A new sparse experiment's H when none is given: a sparse round is cheap enough to
# be frequent, and the more often a residual is sent the less of it waits. topk with
# the rules above, H = 10 against H = 50: bench/sparse_outer.py 2.262 against 2.516;
# bench/wan.py at 50 Mbit/s, same 180 s, 2.466 against 2.638 (and 2.508 against 2.539
# with the legacy rules), and H = 10 ended 0.6% and 0.9% below int8 at H = 50; at
# 10 Mbit/s and 50 ms, 600 s, 2.129 against 2.166 (int8 at H = 50: 2.243). But a round
# costs about a second of latency whatever it carries (matchmaking's half-second
# minimum, the DHT's and the all-gather's round trips: 1.03 s at 25 ms one way), which
# at the default model's 0.1 s a step was half of the time at H = 10: on a faster day
# (2026-12-04, every arm 30-40% more steps) H = 20 ended at 2.282 and 2.310, H = 10 at
# 2.417, 2.461 and 2.428 (2.428 against 2.310 in one run; int8 2.253 to 2.352).
SPARSE_INNER_STEPS = 20
SPARSE_MEANS = ("members", "senders")
# How an audit checks a verified sparse round's message (`codec_audit`): "whole" (the
# legacy: the residual is hashed whole and revealed whole, a model size of float32 per
# audit of a last segment) or "chunks" (hashed as a Merkle tree over the codec's
# chunks; an audit reveals the values the message kept and a few whole chunks:
# `peer.verify.sparse_work.check_sampled`). New verified sparse experiments: chunks.
SPARSE_AUDITS = ("whole", "chunks")


@dataclass(frozen=True, kw_only=True)
class DiLoCoOptions(GroupOptions, VerifyingOptions):
    """DiLoCo: every H inner steps, the group averages its pseudo-gradients."""

    name = "diloco"
    description = (
        "every H inner steps the swarm averages its pseudo-gradients in one group "
        "(fault-tolerant all-reduce) and takes an outer Nesterov step; can verify"
    )
    implementation = "shoal.averaging.diloco:DiLoCo"
    # How owners reduce their part: auto is CenteredClip when verifying, else the mean.
    reduction: str = Opt(
        _reduction,
        f"auto or one of {sorted(REDUCTION_NAMES)}",
        "how part owners reduce: auto (centered_clip when verifying, else mean), "
        + ", ".join(REDUCTION_NAMES)
        + " (with a sparse codec, centered_clip clips each message to the median norm)",
    )("auto")
    codec: str = Opt(
        one_of(*_DILOCO_CODECS),
        f"one of {sorted(_DILOCO_CODECS)}",
        "how the pseudo-gradients travel: " + ", ".join(CODEC_NAMES) + " (dense), or "
        "topk / dct (sparse, with error feedback: codec_density, codec_bits, codec_chunk; "
        "their outer step defaults to outer_momentum 0 and outer_lr 1)",
    )("none")
    codec_density: float = Opt(
        number(0, 0.5, lo_open=True),
        "a number in (0, 0.5]",
        "sparse codecs: the share of every chunk sent (at least one entry per chunk)",
        added=True,
    )(0.015625)  # SparseLoCo / Covenant-72B: 64 of 4096
    codec_bits: int = Opt(
        integer(1, 8), "an int in 1..8", "sparse codecs: bits per sent value", added=True
    )(2)
    codec_feedback_decay: float = Opt(
        number(0, 1),
        "a number in [0, 1]",
        "sparse codecs: what the error feedback keeps of the residual each round "
        "(1: all of it; new experiments: 0.9)",
        added=True,
    )(1.0)
    codec_mean: str = Opt(
        one_of(*SPARSE_MEANS),
        f"one of {list(SPARSE_MEANS)}",
        "sparse codecs: members (each value divided by all the members' weight) or "
        "senders (by the weight of the members that sent that coordinate; new "
        "experiments)",
        added=True,
    )("members")
    codec_audit: str = Opt(
        one_of(*SPARSE_AUDITS),
        f"one of {list(SPARSE_AUDITS)}",
        "verified sparse codecs: what an audit reveals of the error feedback: whole (a "
        "model size) or chunks (the kept values and a few whole chunks, against a Merkle "
        "root; new verified experiments)",
        added=True,
    )("whole")
    codec_chunk: int = Opt(
        lambda v: v == 0 or integer(16, 65536)(v),
        "0 or an int in 16..65536",
        "sparse codecs: elements per chunk; 0: the codec's own (topk 4096, dct 256; "
        "dct at most 1024)",
        added=True,
    )(0)

    overlap_steps: int = Opt(
        integer(0),
        "an int >= 0",
        "the most inner steps a round overlaps: training goes on while it averages, and "
        "its outer step lands after the first step that ends with it done, at the latest "
        "that many steps after it began, the steps taken meanwhile kept (0: training "
        "waits for the round; below inner_steps; not with verify)",
        added=True,
    )(0)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> Self:
        """As any strategy's, except that a sparse codec's outer step defaults to
        `SPARSE_OUTER` (a manifest records both values, so this decides only for new
        experiments and for options that leave them out)."""
        if options.get("codec") in SPARSE_CODEC_NAMES:
            options = {**SPARSE_OUTER, **options}
        return super().parse(options)

    @classmethod
    def for_new_experiment(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """A new unverified experiment overlaps each round with up to H - 1 inner steps
        (`overlap_steps`; a verified one cannot); a new sparse one also decays its error
        feedback, takes the senders' mean (`SPARSE_NEW`) and averages every
        `SPARSE_INNER_STEPS` inner steps, and a verified one is audited by chunks
        (`codec_audit`); the options given win over all of these."""
        new = dict(options)
        if options.get("codec") in SPARSE_CODEC_NAMES:
            new = {**SPARSE_NEW, "inner_steps": SPARSE_INNER_STEPS, **options}
            if new.get("verify"):
                new = {"codec_audit": "chunks", **new}
        # bench/wan.py, 4 peers at 50 Mbit/s and 25 ms, 180 s an arm, three runs: int8
        # at H = 50 overlapped by up to 49 steps ran 18-20% more inner steps than
        # without in the same run and ended 7.2%, 4.2% and 1.4% lower (docs/benchmarks.md).
        h = new.get("inner_steps", cls.__dataclass_fields__["inner_steps"].default)
        if not new.get("verify") and isinstance(h, int) and not isinstance(h, bool) and h > 0:
            new.setdefault("overlap_steps", h - 1)
        return new

    @property
    def sparse(self) -> bool:
        """Whether the pseudo-gradients go through a sparse codec with error feedback."""
        return self.codec in SPARSE_CODEC_NAMES

    @property
    def sparse_chunk(self) -> int:
        """The chunk size of the sparse codec (`codec_chunk`, or the codec's own)."""
        return self.codec_chunk or DEFAULT_CHUNKS.get(self.codec, 0)

    def check_together(self) -> None:
        super().check_together()
        if self.codec == "dct" and self.sparse_chunk > MAX_DCT_CHUNK:
            raise ValueError(f"option 'codec_chunk' must be at most {MAX_DCT_CHUNK} with codec dct")
        if self.overlap_steps >= self.inner_steps:
            raise ValueError("option 'overlap_steps' must be below 'inner_steps'")
        if self.overlap_steps and self.verify:
            # An audit re-runs a segment from where the work log says it started; a
            # merge moves the parameters mid-segment by what the round committed.
            raise ValueError("option 'overlap_steps' must be 0 when verifying")


@dataclass(frozen=True, kw_only=True)
class StreamingOptions(GroupOptions):
    """Streaming DiLoCo: DiLoCo per fragment of the parameters, overlapped with training."""

    name = "streaming"
    description = (
        "DiLoCo per fragment of the parameters, fragments in turn, each round overlapped "
        "with the next inner steps"
    )
    implementation = "shoal.averaging.diloco:StreamingDiLoCo"

    codec: str = CODEC("int8")  # the paper quantized outer gradients to 4 bits
    fragments: int = Opt(
        integer(1, 1024), "an int in 1..1024", "fragments the parameters are split into"
    )(4)
    overlap_steps: int = Opt(
        integer(0), "an int >= 0", "inner steps a fragment's round overlaps (below inner_steps)"
    )(5)
    # local = mixing*local + (1-mixing)*global at the merge (paper: 0.5)
    mixing: float = Opt(
        number(0, 1), PROBABILITY, "the local share kept when a fragment's result is merged"
    )(0.5)

    def check_together(self) -> None:
        super().check_together()
        if self.overlap_steps >= self.inner_steps:
            raise ValueError("option 'overlap_steps' must be below 'inner_steps'")
