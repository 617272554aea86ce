"""A custom shoal task: a next-byte MLP on your own text.

The model reads the last `context` bytes (16 by default), embeds each, and
predicts the next byte with a two-layer MLP: a tiny character-level language
model in the style of Bengio et al. (2003). The data is your text, given with
``--data`` (a file, or a folder of text files), read and split with shoal's
`ByteCorpus`; without ``--data`` it trains on the Python standard library.

Host an experiment with it (every peer that joins needs this file too)::

    shoal run --host-experiment mlp-demo --task examples/custom_task.py:make_task --data notes/

and join it, from a folder holding the same file at the same relative path (a
joiner runs a custom task only when it names it, and only when its copy has the
digest the host's manifest pins)::

    shoal run --join mlp-demo@PEERID --task examples/custom_task.py:make_task --data my-notes/

With ``--data`` every peer trains on its own text, which other peers cannot
re-execute: the experiment is hosted unverified (the host says so).

See `shoal.peer.training.task` for the rules a task keeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.peer.training.task import TaskError
from shoal.peer.training.tasks.corpus import ByteCorpus, random_windows, spaced_windows

DEFAULTS: dict[str, Any] = {
    "context": 16,  # bytes of input per prediction
    "embedding": 16,  # width of a byte's embedding
    "hidden": 256,  # width of the MLP's hidden layer
    "batch_size": 256,  # predictions per batch
    "data": "stdlib",  # "stdlib" or "user" (each peer's own --data)
}


class ByteMLPTask:
    """Batches are uint8 [batch_size, context + 1]: `context` input bytes, then the target."""

    name = "bytemlp"

    def __init__(self, settings: dict[str, Any], corpus: ByteCorpus):
        self.settings = settings
        self.corpus = corpus

    def config(self) -> dict[str, Any]:
        # Everything a joiner needs to rebuild the same model and batches; it goes
        # into the experiment's manifest and comes back to `make_task` on joiners.
        return dict(self.settings)

    def make_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)  # same seed, same initial parameters on every peer
        context, embedding = self.settings["context"], self.settings["embedding"]
        return nn.Sequential(
            nn.Embedding(256, embedding),
            nn.Flatten(),  # [batch, context, embedding] -> [batch, context * embedding]
            nn.Linear(context * embedding, self.settings["hidden"]),
            nn.GELU(),
            nn.Linear(self.settings["hidden"], 256),
        )

    def batches(self, shard: int, num_shards: int, seed: int) -> Iterator[torch.Tensor]:
        return random_windows(
            self.corpus.shard(shard, num_shards),
            window=self.settings["context"] + 1,
            batch_size=self.settings["batch_size"],
            seed=seed,
        )

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.long()
        return F.cross_entropy(model(batch[:, :-1]), batch[:, -1])

    def batch_tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0]  # one predicted byte per window

    def eval_batches(self, count: int) -> list[torch.Tensor]:
        batch_size = self.settings["batch_size"]
        windows = spaced_windows(
            self.corpus.val, window=self.settings["context"] + 1, count=count * batch_size
        )
        return list(windows.split(batch_size))


def make_task(config: dict[str, Any], data: Path | None = None) -> ByteMLPTask:
    """The factory named on the command line: `config` overrides DEFAULTS; `data` is --data."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise TaskError(f"bytemlp: unknown config key {unknown[0]!r}")
    settings = {**DEFAULTS, **config}
    if "data" not in config and data is not None:
        settings["data"] = "user"
    window = settings["context"] + 1
    if settings["data"] == "user":
        if data is None:
            raise TaskError("this bytemlp experiment trains on your own text: give --data PATH")
        corpus = ByteCorpus.from_path(data, window=window)
    else:
        corpus = ByteCorpus.from_stdlib(window=window)
    return ByteMLPTask(settings, corpus)


if __name__ == "__main__":  # a quick check on one machine: python examples/custom_task.py [PATH]
    import sys

    task = make_task({}, Path(sys.argv[1]) if len(sys.argv) > 1 else None)
    model = task.make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, batch in zip(range(201), task.batches(shard=0, num_shards=1, seed=0), strict=False):
        loss = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            with torch.no_grad():
                val = sum(task.loss(model, b).item() for b in task.eval_batches(4)) / 4
            print(f"step {step}: train loss {loss.item():.3f}, validation loss {val:.3f}")
