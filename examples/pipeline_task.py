"""A custom pipelined shoal task: your own small transformer, split into stages.

The model is a byte-level causal language model built from PyTorch's own layers
(`nn.TransformerEncoderLayer`, pre-norm, with a causal mask), written the way a
user would, with nothing shoal-specific in it: `make_stages` cuts it into
`count` stages, the first taking byte ids and the last returning logits. shoal
trains it in a pipeline (``--pipeline-stages N``) and, with
``--strategy-option codec=int8+lowrank16``, inserts its own learned adapters at the
stage boundaries (`shoal.pipeline.boundary`) so that what crosses the network is
16 coordinates and the byte id per position, without this file knowing.

Host a pipelined experiment with it::

    shoal run --host-experiment tiny-llm --task examples/pipeline_task.py:make_task \\
        --pipeline-stages 3 --strategy-option codec=int8+lowrank16

See `shoal.peer.training.task` for the rules a task keeps, and
examples/custom_task.py for a task that is not pipelined.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.peer.training.task import TaskError
from shoal.peer.training.tasks.corpus import ByteCorpus, random_windows, spaced_windows

DEFAULTS: dict[str, Any] = {
    "width": 128,  # the residual stream
    "layers": 3,  # transformer layers (a stage needs at least one)
    "heads": 4,
    "context": 64,  # bytes per window
    "batch_size": 8,
}
VOCAB = 256


class Embed(nn.Module):
    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[-1]]


class Layer(nn.Module):
    """One pre-norm layer with a causal mask (PyTorch's layer takes the mask as an argument)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.layer(x, src_mask=mask, is_causal=True)


class Head(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class TinyLMTask:
    """Batches are uint8 [batch_size, context + 1]: the inputs, shifted by one the targets."""

    name = "tinylm"

    def __init__(self, settings: dict[str, Any], corpus: ByteCorpus) -> None:
        self.settings = settings
        self.corpus = corpus

    def config(self) -> dict[str, Any]:
        return dict(self.settings)

    def _layers(self, seed: int) -> list[nn.Module]:
        s = self.settings
        torch.manual_seed(seed)  # the same seed, the same parameters on every peer
        return [
            Embed(s["width"], s["context"]),
            *(Layer(s["width"], s["heads"]) for _ in range(s["layers"])),
            Head(s["width"]),
        ]

    def make_model(self, seed: int) -> nn.Module:
        return nn.Sequential(*self._layers(seed))

    def make_stages(self, seed: int, count: int) -> list[nn.Module]:
        """The model cut into `count` stages of whole layers (the first with the
        embedding, the last with the output layer)."""
        layers, n = self._layers(seed), self.settings["layers"]
        if not 1 <= count <= n:
            raise ValueError(f"{count} stages for {n} layers: each stage needs a layer")
        cuts = [1 + n * i // count for i in range(count + 1)]
        cuts[0], cuts[-1] = 0, len(layers)
        return [nn.Sequential(*layers[a:b]) for a, b in itertools.pairwise(cuts)]

    def batches(self, shard: int, num_shards: int, seed: int) -> Iterator[torch.Tensor]:
        return random_windows(
            self.corpus.shard(shard, num_shards),
            window=self.settings["context"] + 1,
            batch_size=self.settings["batch_size"],
            seed=seed,
        )

    def stage_inputs(self, batch: torch.Tensor) -> torch.Tensor:
        return batch[:, :-1].long()

    def stage_loss(self, outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        targets = batch[:, 1:].to(device=outputs.device, dtype=torch.long)
        return F.cross_entropy(outputs.reshape(-1, VOCAB), targets.reshape(-1))

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return self.stage_loss(model(self.stage_inputs(batch)), batch)

    def batch_tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def eval_batches(self, count: int) -> list[torch.Tensor]:
        batch_size = self.settings["batch_size"]
        windows = spaced_windows(
            self.corpus.val, window=self.settings["context"] + 1, count=count * batch_size
        )
        return list(windows.split(batch_size))


def make_task(config: dict[str, Any], data: Path | None = None) -> TinyLMTask:
    """The factory named on the command line: `config` overrides DEFAULTS; `data` is --data."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise TaskError(f"tinylm: unknown config key {unknown[0]!r}")
    settings = {**DEFAULTS, **config}
    window = settings["context"] + 1
    corpus = (
        ByteCorpus.from_path(data, window=window)
        if data is not None
        else ByteCorpus.from_stdlib(window=window)
    )
    return TinyLMTask(settings, corpus)
