"""The built-in task `hf`: a Hugging Face `transformers` causal LM, built from a config.

    shoal run --host-experiment NAME --task hf --data ./texts \\
        --task-option family=llama,hidden_size=256,num_hidden_layers=4

The model is ``AutoModelForCausalLM.from_config`` of a config given inline
(``config={...}``, JSON), as a local file (``config_file=PATH``, a config.json), or
by a family this task knows (``family=llama``, ``mistral`` or ``qwen2``, a small
model whose sizes the keys of `MODEL_KEYS` override), randomly initialized from
the experiment's seed: nothing comes from a hub. The experiment's manifest pins the
resolved config and the `transformers` version; a joiner with another major version
refuses in one line.

The data: the user's text files or local dataset files (`hf_data.load_documents`:
json, jsonl, parquet, arrow, text with a named ``text_field``), or the Python standard
library without ``--data``. The tokenizer: ``tokenizer=PATH`` (a tokenizer.json every
peer has, pinned by its digest), or by default a byte-level BPE of the model's
vocab_size trained at hosting time on the first ``tokenizer_train_bytes`` of the
host's data and carried in the manifest. Shards, the held-out split and the data
digest work as for `bytegpt`. Pipelined, the model is cut at its decoder layers
(`hf_stages`). `transformers`, `tokenizers` and `datasets` are imported on use:
``pip install 'shoal[hf]'``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.peer.training.task_error import TaskError
from shoal.peer.training.tasks.bytegpt import split_layers
from shoal.peer.training.tasks.corpus import DEFAULT_MAX_BYTES, random_windows, spaced_windows
from shoal.peer.training.tasks.hf_data import (
    BpeTokenizer,
    TokenCorpus,
    file_tokenizer,
    load_documents,
    rebuild_bpe,
    require,
    train_bpe,
)
from shoal.peer.training.tasks.hf_stages import split_model

__all__ = ["DEFAULT_CONFIG", "FAMILIES", "MODEL_KEYS", "HFTask", "make_task", "offline_task"]

log = logging.getLogger(__name__)

DEFAULT_CONFIG: dict[str, Any] = {
    "model_config": {},  # the resolved transformers config (filled in at hosting)
    "transformers_version": "",  # the host's (filled in); joiners need the same major
    "context": 128,  # tokens the model sees; a training window is context + 1 tokens
    "batch_size": 8,
    "data": "stdlib",  # "stdlib", or "user": each peer's --data
    "data_format": "auto",  # "auto", "files", or a `datasets` format: json, parquet, arrow, text
    "text_field": "text",  # the field of a dataset's rows that holds the text
    "data_digest": "",  # sha256 of the documents; filled in for "stdlib", checked when given
    "max_bytes": DEFAULT_MAX_BYTES,
    "tokenizer_bpe": "",  # a tokenizer trained at hosting (`hf_data.BpeTokenizer.compact`)
    "tokenizer_file": "",  # or a local tokenizer.json, the same path on every peer
    "tokenizer_digest": "",  # of either
    "tokenizer_train_bytes": 2**20,  # the BPE learns from this much of the host's data
}
# Keys a model config of a family takes from --task-option (given at hosting only).
MODEL_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 1024,
    "vocab_size": 2048,
}
FAMILIES: dict[str, dict[str, Any]] = {name: dict(_SMALL) for name in ("llama", "mistral", "qwen2")}
_HOSTING_KEYS = ("family", "config", "config_file", "tokenizer", *MODEL_KEYS)


class HFTask:
    """The `Task` of a transformers causal LM on a `TokenCorpus`; batches are int32
    token windows [batch, context + 1]."""

    name = "hf"

    def __init__(self, settings: dict[str, Any], corpus: TokenCorpus, tokenizer: Any) -> None:
        self.settings = settings
        self.corpus = corpus
        self.tokenizer = tokenizer
        self._flops: float | None = None

    def config(self) -> dict[str, Any]:
        return dict(self.settings)

    def private_data(self) -> bool:
        return self.settings["data"] == "user" and self.settings["data_digest"] == ""

    def make_model(self, seed: int) -> nn.Module:
        """The model from the config, its random init drawn from `seed` (a forked RNG)."""
        transformers = require("transformers")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed % 2**64)
            model = transformers.AutoModelForCausalLM.from_config(
                _hf_config(self.settings["model_config"]), attn_implementation="sdpa",
                trust_remote_code=False,
            )  # fmt: skip
        return model.float()  # whatever dtype a config names: the trainer's precision rules

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
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        return self.stage_loss(logits, batch)

    def batch_tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def eval_batches(self, count: int) -> list[torch.Tensor]:
        if count <= 0:
            return []
        batch_size = self.settings["batch_size"]
        windows = spaced_windows(
            self.corpus.val, window=self.settings["context"] + 1, count=count * batch_size
        )
        return list(windows.split(batch_size))

    def make_stages(self, seed: int, count: int) -> list[nn.Module]:
        return [self.make_stage(seed, count, k) for k in range(count)]

    def make_stage(self, seed: int, count: int, k: int) -> nn.Module:
        """Stage `k` of `count`: the model of `make_model(seed)` cut at its decoder layers
        (built whole, then cut: each stage equals its part of the one model)."""
        layers = self.settings["model_config"]["num_hidden_layers"]
        bounds = split_layers(layers, count)[k]
        return split_model(self.make_model(seed), bounds, first=k == 0, last=k == count - 1)

    def stage_size(self, count: int, k: int) -> int:
        """Parameter elements of stage `k` of `count` (built on the meta device: no memory)."""
        with torch.device("meta"):
            model = self.make_model(0)
        layers = self.settings["model_config"]["num_hidden_layers"]
        stage = split_model(model, split_layers(layers, count)[k], first=k == 0,
                            last=k == count - 1)  # fmt: skip
        return sum(p.numel() for p in stage.parameters())

    def stage_inputs(self, batch: torch.Tensor) -> torch.Tensor:
        return batch[:, :-1].long()

    def stage_loss(self, outputs: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        targets = batch[:, 1:].to(device=outputs.device, dtype=torch.long)
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 3x the forward's 2 per weight of the matmuls (all but
        the token embedding) plus attention's scores and sum, as bytegpt counts them."""
        if self._flops is None:
            with torch.device("meta"):
                model = self.make_model(0)
            embedding = model.get_input_embeddings().weight.numel()
            matmul = sum(p.numel() for p in model.parameters()) - embedding
            if getattr(model.config, "tie_word_embeddings", False):
                matmul += embedding  # the output layer is the embedding, and it multiplies
            config = self.settings["model_config"]
            attention = config["num_hidden_layers"] * 2 * self.settings["context"]
            self._flops = 3.0 * (2 * matmul + attention * config["hidden_size"])
        return self._flops


def make_task(config: dict[str, Any], data: Path | None = None) -> HFTask:
    """The hf task: `config` holds --task-option (hosting) or the manifest's config (joining)."""
    transformers = require("transformers")
    settings = _settings(config, data)
    if settings["model_config"]:
        _check_version(settings["transformers_version"], transformers.__version__)
    else:
        settings["model_config"] = _resolve_model(config, settings["context"])
        settings["transformers_version"] = transformers.__version__
    documents, description = load_documents(
        data, data_format=settings["data_format"], text_field=settings["text_field"],
        max_bytes=settings["max_bytes"],
    )  # fmt: skip
    tokenizer = _tokenizer(settings, config.get("tokenizer"), documents)
    vocab = settings["model_config"].get("vocab_size", 0)
    if tokenizer.get_vocab_size() > vocab:
        raise TaskError(
            f"hf: the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the "
            f"model's vocab_size {vocab}"
        )
    corpus = TokenCorpus.tokenize(
        documents, tokenizer, window=settings["context"] + 1, description=description
    )
    if settings["data"] == "user":
        log.info("training on %s: data_digest %s", description, corpus.digest)
    elif settings["data_digest"] == "":
        settings["data_digest"] = corpus.digest
    if settings["data_digest"] not in ("", corpus.digest):
        raise TaskError(
            f"the experiment's corpus (digest {settings['data_digest'][:12]}) differs from "
            f"{description} here (digest {corpus.digest[:12]}): give --data the host's data"
        )
    return HFTask(settings, corpus, tokenizer)


def offline_task(config: dict[str, Any]) -> HFTask:
    """The task of a manifest's config without its data: the model and the tokenizer, what
    an export needs (`shoal export`); it has no corpus, so no batches."""
    transformers = require("transformers")
    settings = {**DEFAULT_CONFIG, **config}
    if not settings["model_config"] or not (
        settings["tokenizer_bpe"] or settings["tokenizer_file"]
    ):
        raise TaskError("hf: the experiment's config names no model or no tokenizer")
    _check_version(settings["transformers_version"], transformers.__version__)
    tokenizer = _tokenizer(settings, None, [])
    return HFTask(settings, None, tokenizer)  # type: ignore[arg-type]


def _settings(config: dict[str, Any], data: Path | None) -> dict[str, Any]:
    unknown = sorted(set(config) - set(DEFAULT_CONFIG) - set(_HOSTING_KEYS))
    if unknown:
        raise TaskError(
            f"hf: unknown config key {unknown[0]!r} (known: "
            f"{', '.join([*_HOSTING_KEYS, *DEFAULT_CONFIG])})"
        )
    if config.get("model_config") and (given := [k for k in _HOSTING_KEYS if k in config]):
        raise TaskError(f"hf: config {given[0]!r} is for hosting, not with a model_config")
    settings = dict(DEFAULT_CONFIG)
    for key, default in DEFAULT_CONFIG.items():
        if key not in config:
            continue
        if type(config[key]) is not type(default):  # bool is not int here
            raise TaskError(
                f"hf: config {key!r} must be of type {type(default).__name__}, got {config[key]!r}"
            )
        settings[key] = config[key]
    for key in ("context", "batch_size", "max_bytes", "tokenizer_train_bytes"):
        if settings[key] < 1:
            raise TaskError(f"hf: config {key!r} must be at least 1, got {settings[key]}")
    if "data" not in config and data is not None:
        settings["data"] = "user"
    if settings["data"] not in ("stdlib", "user"):
        raise TaskError(f"hf: config 'data' must be 'stdlib' or 'user', got {settings['data']!r}")
    if settings["data"] == "user" and data is None:
        raise TaskError("this hf experiment trains on each peer's own text: give --data PATH")
    if settings["data"] == "stdlib" and data is not None:
        raise TaskError(
            "this hf experiment trains on the Python standard library: leave out --data"
        )
    return settings


def _resolve_model(config: dict[str, Any], context: int) -> dict[str, Any]:
    """The transformers config of a new experiment, from the hosting keys."""
    sources = [k for k in ("family", "config", "config_file") if k in config]
    if len(sources) > 1:
        raise TaskError(
            f"hf: give one of family, config and config_file, not {' and '.join(sources)}"
        )
    overrides = {k: config[k] for k in MODEL_KEYS if k in config}
    source = sources[0] if sources else "family"
    if source == "family":
        family = config.get("family", "llama")
        if family not in FAMILIES:
            raise TaskError(f"hf: family must be one of {', '.join(FAMILIES)}, got {family!r}")
        given = {"model_type": family, **FAMILIES[family], "max_position_embeddings": context}
    else:
        given = _config_dict(config[source], source)
    hf_config = _hf_config({**given, **overrides})
    resolved = hf_config.to_diff_dict()
    for key in ("transformers_version", "auto_map", "_name_or_path"):
        resolved.pop(key, None)  # (auto_map names remote code, which shoal never runs)
    resolved["model_type"] = hf_config.model_type
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        resolved[key] = getattr(hf_config, key)
    if getattr(hf_config, "max_position_embeddings", context) < context:
        raise TaskError(
            f"hf: the model's max_position_embeddings ({hf_config.max_position_embeddings}) "
            f"is less than the context ({context})"
        )
    return resolved


def _config_dict(value: Any, source: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return dict(value)
    text = str(value)
    if source == "config_file":
        try:
            text = Path(text).expanduser().read_text()
        except OSError as exc:
            raise TaskError(f"hf: cannot read config_file {value}: {exc.strerror or exc}") from None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskError(f"hf: {source} is not JSON: {exc}") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model_type"), str):
        raise TaskError(f'hf: {source} must be a JSON object with a "model_type"')
    return parsed


def _hf_config(model_config: dict[str, Any]) -> Any:
    transformers = require("transformers")
    values = dict(model_config)
    model_type = values.pop("model_type", None)
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # transformers' ValueError, KeyError, TypeError: one line
        raise TaskError(f"hf: transformers cannot build config {model_type!r}: {exc}") from None


def _check_version(pinned: str, installed: str) -> None:
    major = pinned.split(".", maxsplit=1)[0]
    if major != installed.split(".", maxsplit=1)[0]:
        raise TaskError(
            f"hf: the experiment was built with transformers {pinned}, this peer has "
            f"{installed}: install transformers {major}.x (pip install 'transformers=={pinned}')"
        )


def _tokenizer(settings: dict[str, Any], path: Any, documents: list[Any]) -> Any:
    """The experiment's tokenizer: pinned in the settings (joining), or made now (hosting)."""
    if settings["tokenizer_bpe"]:
        tokenizer_digest = BpeTokenizer(settings["tokenizer_bpe"]).digest
        if settings["tokenizer_digest"] not in ("", tokenizer_digest):
            raise TaskError("hf: the experiment's tokenizer does not match its digest")
        settings["tokenizer_digest"] = tokenizer_digest
        return rebuild_bpe(settings["tokenizer_bpe"])
    if settings["tokenizer_file"]:
        tokenizer, _ = file_tokenizer(
            Path(settings["tokenizer_file"]), settings["tokenizer_digest"]
        )
        return tokenizer
    if path is not None:
        tokenizer, digest = file_tokenizer(Path(str(path)).expanduser())
        settings["tokenizer_file"], settings["tokenizer_digest"] = str(path), digest
        return tokenizer
    trained = train_bpe(
        documents, vocab_size=settings["model_config"]["vocab_size"],
        train_bytes=settings["tokenizer_train_bytes"],
    )  # fmt: skip
    settings["tokenizer_bpe"], settings["tokenizer_digest"] = trained.compact, trained.digest
    return rebuild_bpe(trained.compact)
