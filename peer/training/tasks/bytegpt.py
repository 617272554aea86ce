"""The built-in task `bytegpt`: a small byte-level GPT on text that every peer has.

The model is a causal transformer language model over bytes (vocabulary 256,
so no tokenizer to agree on): token and learned position embeddings, pre-LN
blocks of causal self-attention and an MLP, and an output layer tied to the
token embedding. The defaults (about 0.45 M parameters, batches of 8 windows
of 128 bytes) train a step in a few tens of milliseconds on one CPU core.

The data needs no download: by default the Python sources of the running
interpreter's standard library (`corpus.stdlib_files`, about 8 MB for Python
3.11), the same bytes on every machine with the same Python build; a digest
in the config lets a joiner check that it has them. With ``--data PATH`` the
task reads the user's text file, or the text files of a folder, instead.

Pipelined, each stage is built alone (`make_stage`): the embeddings, each block,
the output layer and each bottleneck pair are drawn from RNG streams of their own,
derived from the seed and what they are, so stage k built by itself is bit for bit
stage k of `make_stages`, and `stage_size` counts a stage's parameters from the
config without building it. Config "bottleneck" R narrows what crosses the network
between stages to R learned coordinates and the byte ids per position: with R 12 of
d_model 128 under bf16, ~21x fewer bytes than float32 hidden states both ways
(`bench/pipeline.py`'s codec comparison).

Config "preset" names a model size (`PRESETS`: "small" ~4.8 M parameters, "base"
12 layers at d_model 512, ~38 M) whose keys the other config keys override; the
experiment's config holds the resulting keys, not the preset's name.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.peer.training.task_error import TaskError
from shoal.peer.training.tasks.corpus import (
    DEFAULT_MAX_BYTES,
    ByteCorpus,
    random_windows,
    spaced_windows,
)

__all__ = ["DEFAULT_CONFIG", "PRESETS", "VOCAB_SIZE", "ByteGPT", "ByteGPTTask", "make_task"]

log = logging.getLogger(__name__)

VOCAB_SIZE = 256

DEFAULT_CONFIG: dict[str, Any] = {
    "d_model": 128,  # width of the residual stream
    "n_layers": 2,  # transformer blocks
    "n_heads": 4,  # attention heads (d_model must be a multiple)
    "context": 128,  # bytes the model sees; a training window is context + 1 bytes
    "batch_size": 8,  # windows per training batch (1024 predicted bytes)
    "data": "stdlib",  # "stdlib": the standard library corpus; "user": each peer's --data
    "data_digest": "",  # sha256 of the corpus; filled in for "stdlib", checked when given
    "max_bytes": DEFAULT_MAX_BYTES,  # read at most this much text
    # Pipelines only: the width of the hidden states between stages (0: d_model, no
    # bottleneck). A stage ends with a learned projection to this many coordinates and
    # the next starts with one back to d_model, so activations and their gradients
    # cross the network this narrow, plus the byte ids (see `make_stages`).
    "bottleneck": 0,
}
DATA_SOURCES = ("stdlib", "user")
# Model sizes by name (`--task-option preset=base`); given keys override them. "base"
# is a real model for pipelines: 12 blocks of d_model 512 (~38 M parameters, ~150 MB in
# float32, ~600 MB with AdamW's state and gradients), about a second a step per stage
# of four on a CPU core at batch 8.
PRESETS: dict[str, dict[str, Any]] = {
    "small": {"d_model": 256, "n_layers": 6, "n_heads": 4, "context": 256},
    "base": {"d_model": 512, "n_layers": 12, "n_heads": 8, "context": 256},
}


def init_parameters(module: nn.Module, n_layers: int) -> None:
    """Initialize a ByteGPT or any of its parts (by parameter name) from the global RNG."""
    # GPT-2's scheme: small normal weights, and the projections that add into
    # the residual stream scaled down by depth so its variance stays put.
    # The token embedding is smaller still: with the output tied to it, a
    # byte's own embedding adds about std * d_model to its logit, and at
    # GPT-2's 0.02 a fresh model would favour repeating its input byte.
    # At 0.5 / d_model its predictions are uniform: a fresh loss of ln(256).
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith(("token_embedding.weight", "head.weight")):
                nn.init.normal_(parameter, std=0.5 / parameter.shape[1])
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif "ln_" in name:
                nn.init.ones_(parameter)
            elif name.endswith(("attention.proj.weight", "mlp.2.weight")):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_layers))
            else:
                nn.init.normal_(parameter, std=0.02)


@contextmanager
def drawn_from(seed: int, part: str) -> Iterator[None]:
    """Draw `part` of the model from an RNG stream of its own, derived from the seed and
    the part's name: any part is built alike alone or among the others. (The CPU
    generator only, forked: the caller's RNG is left alone.)"""
    digest = hashlib.sha256(f"shoal/bytegpt/init\x00{seed}\x00{part}".encode()).digest()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int.from_bytes(digest[:8], "big"))
        yield


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln_attention = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_attention(x))
        return x + self.mlp(self.ln_mlp(x))


class ByteGPT(nn.Module):
    """A GPT over bytes: ``model(inputs)`` maps [batch, length] byte ids to [batch, length, 256]."""

    def __init__(
        self, *, d_model: int, n_layers: int, n_heads: int, context: int, tied: bool = True
    ):
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_final = nn.LayerNorm(d_model)
        # Pipelined, the output layer lives on the last stage, far from the
        # embedding on the first: untied, each with its own weights.
        self.head = None if tied else nn.Linear(d_model, VOCAB_SIZE, bias=False)
        init_parameters(self, n_layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        length = inputs.shape[1]
        if length > self.context:
            raise ValueError(f"{length} bytes of input, more than the context of {self.context}")
        positions = torch.arange(length, device=inputs.device)
        return self.token_embedding(inputs) + self.position_embedding(positions)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_final(x)
        return self.head(x) if self.head is not None else x @ self.token_embedding.weight.T


class Embeddings(nn.Module):
    """The token and learned position embeddings of byte ids (a stage's own copy)."""

    def __init__(self, d_model: int, context: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.context = context


class BottleneckIn(nn.Module):
    """Where a stage after a bottleneck starts: it widens the narrow hidden states back to
    d_model and adds its own token and position embeddings of the byte ids that came
    with them (the last channel), so that which byte is where, which a few coordinates
    could not carry, is never lost on the way (as the token embeddings that Pluralis'
    protocol models recompute at each stage, here learned per stage)."""

    def __init__(self, rank: int, d_model: int, context: int) -> None:
        super().__init__()
        self.up = nn.Linear(rank, d_model, bias=False)
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.context = context

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (whatever a peer sent, an index stays within the table)
        ids = x[..., -1].detach().round().clamp(0, VOCAB_SIZE - 1).long()
        hidden = self.up(x[..., :-1]) + ByteGPT.embed(self, ids)  # type: ignore[arg-type]
        return hidden, ids


class BottleneckOut(nn.Module):
    """Where a stage before a bottleneck ends: d_model -> rank, and the byte ids as one
    more channel (whole numbers, which `pipeline.wire` sends exactly, a byte each)."""

    def __init__(self, d_model: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, rank, bias=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.down(x), ids.to(x.dtype).unsqueeze(-1)], dim=-1)


class ByteGPTStage(nn.Module):
    """Blocks [first, last) of an untied ByteGPT, with the embeddings if it is the first
    stage and the output layer if it is the last: byte ids or hidden states in, hidden
    states or logits out. With a bottleneck, `entry` takes the narrow hidden states (all
    but the first stage) and `outlet` makes them (all but the last)."""

    def __init__(
        self,
        blocks: list[Block],
        *,
        context: int,
        embeddings: Embeddings | None = None,
        output: tuple[nn.LayerNorm, nn.Linear] | None = None,
        entry: BottleneckIn | None = None,
        outlet: BottleneckOut | None = None,
    ) -> None:
        super().__init__()
        self.is_first = embeddings is not None
        self.is_last = output is not None
        self.context = context
        if embeddings is not None:
            self.token_embedding = embeddings.token_embedding
            self.position_embedding = embeddings.position_embedding
        self.entry = entry
        self.blocks = nn.ModuleList(blocks)
        self.outlet = outlet
        if output is not None:
            self.ln_final, self.head = output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x
        if self.is_first:
            x = ByteGPT.embed(self, x)  # type: ignore[arg-type]
        elif self.entry is not None:
            x, ids = self.entry(x)
        for block in self.blocks:
            x = block(x)
        if self.is_last:
            x = ByteGPT.logits(self, x)  # type: ignore[arg-type]
        elif self.outlet is not None:
            x = self.outlet(x, ids)
        return x


def bottleneck_basis(d_model: int, rank: int) -> torch.Tensor:
    """The columns of `up` (and rows of `down`) of a bottleneck: an orthonormal basis of a
    random subspace, so that up(down(x)) starts as x's projection onto it, the residual
    stream's scale kept (drawn first in the pair's stream, which each side draws alike)."""
    basis, _ = torch.linalg.qr(torch.randn(d_model, rank))
    return basis


def split_layers(n_layers: int, count: int) -> list[tuple[int, int]]:
    """[first, last) blocks of each of `count` stages, as even as can be (earlier ones larger)."""
    if not 1 <= count <= n_layers:
        raise ValueError(f"{count} stages for {n_layers} layers: each stage needs a layer")
    base, extra = divmod(n_layers, count)
    bounds, first = [], 0
    for i in range(count):
        last = first + base + (1 if i < extra else 0)
        bounds.append((first, last))
        first = last
    return bounds


class ByteGPTTask:
    """The `Task` of a byte-level GPT on a `ByteCorpus`; batches are uint8 [batch, context + 1]."""

    name = "bytegpt"

    def __init__(self, settings: dict[str, Any], corpus: ByteCorpus):
        self.settings = settings
        self.corpus = corpus

    def config(self) -> dict[str, Any]:
        return dict(self.settings)

    def private_data(self) -> bool:
        """Each peer's own text, unless the config pins its digest (every peer then
        holds the same text, and a referee can regenerate anyone's batches)."""
        return self.settings["data"] == "user" and self.settings["data_digest"] == ""

    def make_model(self, seed: int) -> ByteGPT:
        # Seeded in a forked RNG: deterministic, and the caller's global RNG is left alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed % 2**64)
            return ByteGPT(
                d_model=self.settings["d_model"],
                n_layers=self.settings["n_layers"],
                n_heads=self.settings["n_heads"],
                context=self.settings["context"],
            )

    def batches(self, shard: int, num_shards: int, seed: int) -> Iterator[torch.Tensor]:
        return random_windows(
            self.corpus.shard(shard, num_shards),
            window=self.settings["context"] + 1,
            batch_size=self.settings["batch_size"],
            seed=seed,
        )

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        device = next(model.parameters()).device
        batch = batch.to(device=device, dtype=torch.long, non_blocking=True)
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))

    def make_stages(self, seed: int, count: int) -> list[nn.Module]:
        """The `count` stages of the pipelined model (`make_stage` of each)."""
        return [self.make_stage(seed, count, k) for k in range(count)]

    def make_stage(self, seed: int, count: int, k: int) -> nn.Module:
        """Stage `k` of `count` of the untied model, built without the others: stage 0
        takes byte ids, the last returns logits. Each part is drawn from its own stream
        (`drawn_from`): the stages of any count compose to ``make_stages(seed, 1)``,
        deterministic like make_model.

        With config "bottleneck" r > 0, each boundary between stages gets a learned
        pair of projections, trained with the rest (IOTA's bottleneck layers): the
        stage before it ends with d_model -> r, the one after starts with r -> d_model
        and adds its own embeddings of the byte ids that come along (`BottleneckIn`),
        so the hidden states and the gradients between stages are r + 1 wide. The
        stages then compose to a different model than `make_stages(seed, 1)`, with
        more parameters (the experiment's fingerprints cover them); each pair is drawn
        from the stream of its boundary, the other parameters as without one."""
        d_model, n_layers, rank = (
            self.settings[key] for key in ("d_model", "n_layers", "bottleneck")
        )
        n_heads, context = self.settings["n_heads"], self.settings["context"]
        first, last = split_layers(n_layers, count)[k]
        embeddings = output = entry = outlet = None
        if k == 0:
            with drawn_from(seed, "embeddings"):
                embeddings = Embeddings(d_model, context)
                init_parameters(embeddings, n_layers)
        elif rank:
            with drawn_from(seed, f"bottleneck/{first}"):
                basis = bottleneck_basis(d_model, rank)
                entry = BottleneckIn(rank, d_model, context)
                init_parameters(entry, n_layers)
                with torch.no_grad():
                    entry.up.weight.copy_(basis)
        blocks = []
        for i in range(first, last):
            with drawn_from(seed, f"block/{i}"):
                block = Block(d_model, n_heads)
                init_parameters(block, n_layers)
            blocks.append(block)
        if k == count - 1:
            with drawn_from(seed, "output"):
                output = (nn.LayerNorm(d_model), nn.Linear(d_model, VOCAB_SIZE, bias=False))
                init_parameters(nn.ModuleDict({"ln_final": output[0], "head": output[1]}), n_layers)
        elif rank:
            with drawn_from(seed, f"bottleneck/{last}"):
                basis = bottleneck_basis(d_model, rank)
                outlet = BottleneckOut(d_model, rank)
                with torch.no_grad():
                    outlet.down.weight.copy_(basis.T)
        return ByteGPTStage(
            blocks, context=context, embeddings=embeddings, output=output, entry=entry,
            outlet=outlet,
        )  # fmt: skip

    def stage_size(self, count: int, k: int) -> int:
        """Parameter elements of stage `k` of `count`, from the config (nothing built)."""
        d, n_layers, rank = (self.settings[key] for key in ("d_model", "n_layers", "bottleneck"))
        first, last = split_layers(n_layers, count)[k]
        embeddings = VOCAB_SIZE * d + self.settings["context"] * d
        size = (last - first) * (12 * d * d + 13 * d)  # blocks: weights, biases, norms
        if k == 0:
            size += embeddings
        elif rank:
            size += rank * d + embeddings  # `BottleneckIn`
        if k == count - 1:
            size += 2 * d + VOCAB_SIZE * d  # the final norm and the untied output layer
        elif rank:
            size += d * rank  # `BottleneckOut`
        return size

    def stage_inputs(self, batch: torch.Tensor) -> torch.Tensor:
        """What the first stage takes from a batch: the input bytes."""
        return batch[:, :-1].long()

    def stage_loss(self, outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        """The loss of the last stage's outputs (logits) on a batch's target bytes."""
        targets = batch[:, 1:].to(device=outputs.device, dtype=torch.long)
        return F.cross_entropy(outputs.reshape(-1, VOCAB_SIZE), targets.reshape(-1))

    def flops_per_token(self) -> float:
        """Training FLOPs per predicted byte (forward + backward, 3x the forward).

        The forward counts 2 FLOPs per multiply-add: the weight matrices
        (12 d^2 per block, and the output head's 256 d) plus attention's scores
        and weighted sum (2 * context * d per block, before the causal mask
        halves what is useful, as PaLM's MFU counts it).
        """
        d, layers, context = (self.settings[k] for k in ("d_model", "n_layers", "context"))
        matmul_params = layers * 12 * d * d + VOCAB_SIZE * d
        forward = 2 * matmul_params + layers * 2 * context * d
        return 3.0 * forward

    def batch_tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)  # predicted bytes

    def eval_batches(self, count: int) -> list[torch.Tensor]:
        if count <= 0:
            return []
        batch_size = self.settings["batch_size"]
        windows = spaced_windows(
            self.corpus.val, window=self.settings["context"] + 1, count=count * batch_size
        )
        return list(windows.split(batch_size))


def make_task(config: dict[str, Any], data: Path | None = None) -> ByteGPTTask:
    """The bytegpt task: `config` overrides `DEFAULT_CONFIG`; `data` is the user's --data."""
    settings = _settings(config, data)
    window = settings["context"] + 1
    if settings["data"] == "user":
        assert data is not None  # _settings checked
        corpus = ByteCorpus.from_path(data, window=window, max_bytes=settings["max_bytes"])
        # What pins this text for every peer (--task-option data_digest=...).
        log.info("training on %s: data_digest %s", corpus.description, corpus.digest)
    else:
        corpus = ByteCorpus.from_stdlib(window=window, max_bytes=settings["max_bytes"])
        if settings["data_digest"] == "":
            settings["data_digest"] = corpus.digest
    if settings["data_digest"] not in ("", corpus.digest):
        remedy = (
            "run the Python version and build of the experiment's host"
            if settings["data"] == "stdlib"
            else "give --data the same text as the host"
        )
        raise TaskError(
            f"the experiment's corpus (digest {settings['data_digest'][:12]}) differs from "
            f"{corpus.description} here (digest {corpus.digest[:12]}): {remedy}"
        )
    return ByteGPTTask(settings, corpus)


def _settings(config: dict[str, Any], data: Path | None) -> dict[str, Any]:
    config = dict(config)
    preset = config.pop("preset", None)
    unknown = sorted(set(config) - set(DEFAULT_CONFIG))
    if unknown:
        raise TaskError(
            f"bytegpt: unknown config key {unknown[0]!r} (known: preset, "
            f"{', '.join(DEFAULT_CONFIG)})"
        )
    if preset is not None:
        if preset not in PRESETS:
            raise TaskError(
                f"bytegpt: config 'preset' must be one of {', '.join(PRESETS)}, got {preset!r}"
            )
        # (written out as its keys: a shoal without this preset reads the experiment alike)
        config = {**PRESETS[preset], **config}
    settings = dict(DEFAULT_CONFIG)
    for key, value in config.items():
        default = DEFAULT_CONFIG[key]
        if type(value) is not type(default):  # bool is not int here
            raise TaskError(
                f"bytegpt: config {key!r} must be of type {type(default).__name__}, got {value!r}"
            )
        settings[key] = value
    for key in ("d_model", "n_layers", "n_heads", "context", "batch_size", "max_bytes"):
        if settings[key] < 1:
            raise TaskError(f"bytegpt: config {key!r} must be at least 1, got {settings[key]}")
    if not 0 <= settings["bottleneck"] < settings["d_model"]:
        raise TaskError(
            f"bytegpt: config 'bottleneck' must be 0 (none) or from 1 to d_model - 1 "
            f"({settings['d_model'] - 1}), got {settings['bottleneck']}"
        )
    if settings["d_model"] % settings["n_heads"]:
        raise TaskError(
            f"bytegpt: d_model ({settings['d_model']}) must be a multiple of "
            f"n_heads ({settings['n_heads']})"
        )
    if settings["data"] not in DATA_SOURCES:
        raise TaskError(
            f"bytegpt: config 'data' must be 'stdlib' or 'user', got {settings['data']!r}"
        )
    if "data" not in config and data is not None:
        settings["data"] = "user"  # hosting on the user's text
    if settings["data"] == "user" and data is None:
        raise TaskError(
            "this bytegpt experiment trains on each peer's own text: give --data PATH "
            "(a text file or a folder of text files)"
        )
    if settings["data"] == "stdlib" and data is not None:
        raise TaskError(
            "this bytegpt experiment trains on the Python standard library, not on --data: "
            "leave out --data"
        )
    return settings
