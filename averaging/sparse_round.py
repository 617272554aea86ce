"""DiLoCo's side of a sparse round: code the pseudo-gradient with error feedback,
lay out the round's slots, decode the committed mean, settle the residual.

Sans-I/O: the strategy calls it around `Averager.step` (`compress` before, the
slots from `Averager`'s round_tensors hook, `mean_on_commit` from the commit hook,
`settle` after), and the averager moves the bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from shoal.transport.identity import PeerID

from .compression import CodecError
from .diloco_options import DiLoCoOptions
from .error_feedback import ErrorFeedback
from .group import Group
from .sparse_codec import SparseCodec
from .sparse_gather import SparseGather
from .step_result import StepResult

__all__ = [
    "SPARSE_SHAPE",
    "SparseContribution",
    "parse_sparse_shape",
    "sparse_shape",
    "union_reduction",
]

# How an audit shape names a sparse round's codec (`DiLoCo.audit_shape`): "sparse:",
# the codec's name and, when the error feedback decays, "@" and the decay.
SPARSE_SHAPE = "sparse:"
CHUNKS_SUFFIX = "/chunks"  # a shape's rounds audited by chunks (`codec_audit`)


def sparse_shape(codec: SparseCodec, decay: float, chunks: bool = False) -> str:
    """The audit shape of rounds of `codec` whose error feedback keeps `decay`, audited
    by `chunks` (`codec_audit`) or whole."""
    return (SPARSE_SHAPE + codec.name + ("" if decay == 1.0 else f"@{decay!r}")
            + (CHUNKS_SUFFIX if chunks else ""))  # fmt: skip


def union_reduction(*, clip: bool, senders: bool) -> str:
    """The name a sparse round's plan gives its reduction (`reducer.ALL_REDUCTIONS`):
    the bitwise union of the slots, named after how the members decode them, so that
    members that decode them otherwise never average together."""
    return ("union_clip_capped" if clip else "union") + ("_senders" if senders else "")


def parse_sparse_shape(shape: str) -> tuple[SparseCodec, float, bool]:
    """(codec, decay, audited by chunks) of a `sparse_shape` (ValueError unless it is one)."""
    if not shape.startswith(SPARSE_SHAPE):
        raise ValueError(f"not a sparse round's shape: {shape!r}")
    chunks = shape.endswith(CHUNKS_SUFFIX)
    name, _, decay = shape.removeprefix(SPARSE_SHAPE).removesuffix(CHUNKS_SUFFIX).partition("@")
    return SparseCodec.parse(name), float(decay) if decay else 1.0, chunks


log = logging.getLogger("shoal.averaging.sparse")


class SparseContribution:
    """One peer's sparse contributions to the rounds of `delta` (its flat buffer of
    pseudo-gradients, which the strategy's outer step reads)."""

    def __init__(
        self,
        codec: SparseCodec,
        delta: torch.Tensor,
        *,
        clip: bool = False,
        decay: float = 1.0,
        senders: bool = False,
        chunks: bool = False,
    ) -> None:
        """`chunks`: a verified round's residual is hashed by the codec's chunks
        (`codec_audit`), else whole."""
        self.delta = delta
        self.clip = clip  # the robust mean: each message clipped to the median norm
        self.senders = senders  # the senders' mean, per coordinate (`SparseGather.mean_into`)
        self.feedback = ErrorFeedback(
            codec, delta.numel(), pin=delta.is_pinned(), decay=decay,
            leaf=codec.chunk if chunks else 0,
        )  # fmt: skip
        self.gather = SparseGather(codec, delta.numel())
        self._message: bytes | None = None  # this round's, once coded
        self._slots = torch.empty(0)
        self._round = b""  # the round the slots were laid out for, and its members
        self._members: tuple[PeerID, ...] = ()

    @classmethod
    def of(
        cls, options: DiLoCoOptions, delta: torch.Tensor, *, clip: bool = False
    ) -> SparseContribution | None:
        """The contribution of a sparse codec's options; None for a dense codec."""
        if not options.sparse:
            return None
        codec = SparseCodec.from_density(
            options.codec, options.sparse_chunk, options.codec_density, options.codec_bits
        )
        return cls(
            codec,
            delta,
            clip=clip,
            decay=options.codec_feedback_decay,
            senders=options.codec_mean == "senders",
            chunks=options.codec_audit == "chunks",
        )

    def compress(self) -> None:
        """Code the pseudo-gradient plus the residual; `delta` then holds what the
        message decodes to (what a lone commit applies). Non-finite values: nothing
        is sent (an empty slot) and the residual stays."""
        self._message = None
        try:
            self._message = self.feedback.compress(self.delta)
        except CodecError as e:
            log.warning("the pseudo-gradient cannot be coded: %s", e)

    def slots_for(
        self, group: Group, me: PeerID, weight: float, sign: Callable[[bytes], bytes]
    ) -> list[torch.Tensor]:
        """The vector a round with `group` averages: a slot per member, ours filled."""
        words = self.gather.words(group.size)
        if self._slots.numel() != words:
            self._slots = torch.zeros(words, dtype=torch.float32)
        slot = group.index(me)
        self.gather.fill(self._slots, group.round_id, slot, weight, self._message, sign)
        self._round, self._members = group.round_id, group.peer_ids
        return [self._slots]

    def own_slot(self, round_id: bytes, me: PeerID) -> tuple[int, int, bytes] | None:
        """(our slot's index, the round's members, our slot's bytes) as laid out for
        round `round_id`; None for another round (what a verified member keeps to
        reveal what it sent)."""
        if round_id != self._round or me not in self._members:
            return None
        index, words = self._members.index(me), self.gather.slot_words
        raw = self._slots.view(torch.uint8)[index * words * 4 : (index + 1) * words * 4]
        return index, len(self._members), raw.numpy().tobytes()

    def mean_on_commit(self, round_id: bytes) -> None:
        """Round `round_id` committed: `delta` becomes the mean of its slots (a lone
        commit, whose slots were never laid out, keeps our own decoded message)."""
        if round_id != self._round:
            return
        skipped = self.gather.mean_into(
            self._slots, self.delta, self._round, self._members, clip=self.clip,
            senders=self.senders,
        )  # fmt: skip
        if skipped:
            log.warning("malformed or forged contributions skipped: slots %s", skipped)

    def settle(self, result: StepResult) -> None:
        """The residual after the round: our message was applied only on a commit; a
        re-sync drops it with the work it came from; otherwise (aborted, no group, in
        doubt) it stays, since the next delta covers these steps again."""
        if result.committed:
            self.feedback.commit()
        elif result.resynced:
            self.feedback.reset()
        else:
            self.feedback.abort()

    def reset(self) -> None:
        """A join: the residual pushed a state this peer no longer holds."""
        self.feedback.reset()

    def state_dict(self) -> dict[str, Any]:
        return self.feedback.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.feedback.load_state_dict(state)
