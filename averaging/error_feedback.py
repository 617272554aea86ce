"""Error feedback for a lossy pseudo-gradient codec: what a round did not send is
carried, in float32 on the host, into the next round's contribution.

Transactional, because a round may abort: `compress` codes residual + delta and
holds what the message leaves out; only `commit` (the round committed with our
message in it) makes that the new residual. After an abort the residual stays as
it was (the next round's delta covers this round's steps again), and after a
re-sync it is zeroed: it pushed directions of a state the peer no longer holds.
The residual is private to the peer: it is checkpointed, never served in state
sync.
"""

from __future__ import annotations

from typing import Any

import torch

from .sparse_codec import SparseCodec

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The residual of one flat float32 vector of `size` elements coded by `codec`."""

    def __init__(self, codec: SparseCodec, size: int, *, pin: bool = False) -> None:
        self.codec = codec
        self.size = size
        self.residual = torch.zeros(size, dtype=torch.float32)
        self._pending = torch.zeros(size, dtype=torch.float32)
        if pin:
            self.residual = self.residual.pin_memory()
            self._pending = self._pending.pin_memory()
        self._open = False

    @property
    def open(self) -> bool:
        """Whether a compressed contribution awaits its round's outcome."""
        return self._open

    def compress(self, delta: torch.Tensor) -> bytes:
        """Code residual + `delta` (flat float32, `size` elements) and replace `delta`
        in place by what the message decodes to; returns the message. The residual it
        would leave is held until `commit` or `abort`. `CodecError` (non-finite
        values) leaves everything as it was."""
        if delta.shape != (self.size,) or delta.dtype != torch.float32:
            raise ValueError(f"delta must be {self.size} float32 values")
        torch.add(self.residual, delta, out=self._pending)
        message = self.codec.encode(self._pending)
        decoded = torch.zeros_like(delta)
        self.codec.add_decoded(self.codec.check(message, self.size), decoded, 1.0)
        delta.copy_(decoded)
        self._pending.sub_(decoded)
        self._open = True
        return message

    def commit(self) -> None:
        """The message was applied: what it left out is the residual from now on."""
        if self._open:
            self.residual, self._pending = self._pending, self.residual
            self._open = False

    def abort(self) -> None:
        """The message was not applied: the residual stays what it was."""
        self._open = False

    def reset(self) -> None:
        """A re-sync or a join: start from no residual."""
        self.residual.zero_()
        self._open = False

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.name, "residual": self.residual.clone()}

    def load_state_dict(self, state: Any) -> None:
        """Restore a checkpoint's residual; one of another codec (the experiment's
        options changed) or of another shape is refused."""
        if not isinstance(state, dict) or state.get("codec") != self.codec.name:
            raise ValueError(f"checkpoint 'error_feedback' is not one of codec {self.codec.name}")
        residual = state.get("residual")
        if (
            not isinstance(residual, torch.Tensor)
            or residual.dtype != torch.float32
            or residual.shape != (self.size,)
            or not bool(torch.isfinite(residual).all())
        ):
            raise ValueError(f"checkpoint 'error_feedback' must hold {self.size} finite float32")
        self.residual.copy_(residual)
        self._open = False
