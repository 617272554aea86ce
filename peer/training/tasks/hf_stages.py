"""Pipeline stages of a Hugging Face decoder-only model, cut at its decoder layers.

Works for the Llama-shaped models of `transformers` (Llama, Mistral, Qwen2 and the
like: ``model.model`` with ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``,
and ``model.lm_head``). Stage 0 embeds token ids, the last applies the final norm
and the output layer; between them travel hidden states [batch, length, hidden].
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["HFStage", "split_model"]


class HFStage(nn.Module):
    """Decoder layers [first, last) of a causal LM, with the token embedding on the first
    stage and the final norm and output layer on the last."""

    def __init__(
        self,
        layers: list[nn.Module],
        rotary: nn.Module,
        *,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        head: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.rotary_emb = rotary  # no parameters: the rotary tables, a buffer
        self.norm = norm
        self.lm_head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x.long()) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            # No mask: the SDPA attention is causal by itself when given none.
            out = layer(hidden, attention_mask=None, position_ids=positions,
                        position_embeddings=rotary)  # fmt: skip
            hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            assert self.norm is not None
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def split_model(model: Any, bounds: tuple[int, int], *, first: bool, last: bool) -> HFStage:
    """The stage of `model` with layers [bounds): ValueError for a model of another shape.
    The output layer is the stage's own copy (untied: it lives far from the embedding)."""
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{type(model).__name__} is not a Llama-shaped decoder (model.embed_tokens, "
            "layers, norm, rotary_emb, lm_head): it cannot be cut into pipeline stages"
        )
    # A copy of its own, tied or not (a tied weight would otherwise count on two stages).
    head = copy.deepcopy(model.lm_head) if last else None
    return HFStage(
        list(inner.layers[bounds[0] : bounds[1]]),
        inner.rotary_emb,
        embed=inner.embed_tokens if first else None,
        norm=inner.norm if last else None,
        head=head,
    )
