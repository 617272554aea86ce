"""Text and tokens for the `hf` task: local files and datasets, tokenizers, token corpora.

Documents come from the user's text files (a file, or every text file of a folder,
as `corpus.ByteCorpus` reads them), from Hugging Face `datasets` loaded from local
files (json, jsonl, parquet, arrow, text) with a named text field, or from the
Python standard library. A tokenizer is a local ``tokenizer.json`` (pinned by its
digest), or a byte-level BPE trained at hosting time on the first bytes of the data
and carried in the experiment's manifest in a compact form (`BpeTokenizer`): every
joiner rebuilds the same tokenizer from it, with no hub. `datasets` and `tokenizers`
are imported on use (the `hf` extra).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import math
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.peer.training.task_error import TaskError
from shoal.peer.training.tasks.corpus import (
    HELD_OUT_EVERY,
    HELD_OUT_FRACTION,
    Document,
    _digest,
    read_documents,
    stdlib_files,
    text_files,
)

__all__ = [
    "DATASET_FORMATS",
    "EOS_TOKEN",
    "MAX_TOKENIZER_CHARS",
    "BpeTokenizer",
    "TokenCorpus",
    "dataset_documents",
    "file_tokenizer",
    "load_documents",
    "rebuild_bpe",
    "require",
    "train_bpe",
]

EOS_TOKEN = "<|endoftext|>"  # ends every document; the trained tokenizer's id 0
# What the compact form of a trained tokenizer may take in the manifest (32 KiB in all):
# about a vocabulary of 4096 on source code or English text.
MAX_TOKENIZER_CHARS = 24_000
# Formats `datasets` reads from local files, by name and by file suffix.
DATASET_FORMATS = {"json": "json", "parquet": "parquet", "arrow": "arrow", "text": "text"}
_SUFFIX_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
_EXTRA_HINT = "pip install 'shoal[hf]'"


def require(module: str) -> Any:
    """`module` (transformers, tokenizers, datasets), or a TaskError saying how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TaskError(f"task hf needs {module}, which is not installed: {_EXTRA_HINT}") from None


def load_documents(
    data: Path | None, *, data_format: str, text_field: str, max_bytes: int
) -> tuple[list[Document], str]:
    """The documents of `data` (None: the standard library) and a description for messages.

    data_format: "files" (each text file a document), a `DATASET_FORMATS` name, or
    "auto" (a dataset when `data` is a file, or a folder of files, with a dataset's
    suffix; text files otherwise).
    """
    if data is None:
        root, files = stdlib_files()
        return read_documents(root, files, max_bytes), "the Python standard library"
    files = text_files(data) if data.is_dir() else [data]
    if data_format == "auto":
        formats = {_SUFFIX_FORMATS.get(f.suffix.lower()) for f in files}
        data_format = formats.pop() if len(formats) == 1 and None not in formats else "files"
    if data_format == "files":
        documents = read_documents(data, files, max_bytes)
        if not documents:
            raise TaskError(f"no text files in {data}")
        return documents, str(data)
    return dataset_documents(data, files, data_format, text_field, max_bytes), str(data)


def dataset_documents(
    root: Path, files: Sequence[Path], data_format: str, text_field: str, max_bytes: int
) -> list[Document]:
    """The rows of local dataset files read by `datasets` (each row's `text_field` a
    document, named file#row), until `max_bytes` of text."""
    if data_format not in DATASET_FORMATS:
        known = ", ".join(["auto", "files", *DATASET_FORMATS])
        raise TaskError(f"hf: config 'data_format' must be one of {known}, got {data_format!r}")
    datasets = require("datasets")
    if hasattr(datasets, "disable_progress_bars"):
        datasets.disable_progress_bars()  # (a bar per file in the daemon's log)
    documents: list[Document] = []
    remaining = max_bytes
    with tempfile.TemporaryDirectory(prefix="shoal-datasets-") as cache:
        for path in files:
            try:
                table = datasets.load_dataset(
                    DATASET_FORMATS[data_format], data_files=[str(path)], split="train",
                    cache_dir=cache, keep_in_memory=True,
                )  # fmt: skip
            except Exception as exc:  # the library's many error types: one line for the user
                raise TaskError(f"datasets cannot read {path} as {data_format}: {exc}") from None
            if text_field not in table.column_names:
                raise TaskError(
                    f"{path} has no field {text_field!r} (fields: "
                    f"{', '.join(table.column_names)}): give --task-option text_field=NAME"
                )
            name = path.name if path == root else path.relative_to(root).as_posix()
            for row, text in enumerate(table[text_field]):
                data = str(text or "").encode()[:remaining]
                documents.append(Document(f"{name}#{row}", data))
                remaining -= len(data)
                if remaining <= 0:
                    return documents
    if not documents:
        raise TaskError(f"no rows in {root}")
    return documents


@dataclass(frozen=True, slots=True)
class BpeTokenizer:
    """A trained byte-level BPE in the compact form the manifest carries: its merges,
    one "left right" pair a line, zlib-compressed and base64 (the vocabulary is the
    end-of-text token, the 256 byte symbols, then each merge's result in order)."""

    compact: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.compact.encode()).hexdigest()


def train_bpe(documents: Sequence[Document], *, vocab_size: int, train_bytes: int) -> BpeTokenizer:
    """A byte-level BPE of at most `vocab_size` tokens trained on the first `train_bytes`
    bytes of `documents` (deterministic: the same text gives the same merges)."""
    tokenizers = require("tokenizers")
    if vocab_size < 258:
        raise TaskError(f"hf: a trained tokenizer needs vocab_size at least 258, got {vocab_size}")
    texts, remaining = [], train_bytes
    for document in documents:
        if remaining <= 0:
            break
        texts.append(document.data[:remaining].decode(errors="replace"))
        remaining -= len(document.data)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    lines = "\n".join(f"{a} {b}" for a, b in (_pair(m) for m in merges))
    compact = base64.b64encode(zlib.compress(lines.encode(), 9)).decode()
    if len(compact) > MAX_TOKENIZER_CHARS:
        raise TaskError(
            f"hf: the trained tokenizer (vocab_size {vocab_size}) takes {len(compact)} "
            f"characters, more than the manifest holds ({MAX_TOKENIZER_CHARS}): train a "
            "smaller vocab_size, or give tokenizer=PATH (a tokenizer.json every peer has)"
        )
    return BpeTokenizer(compact)


def _pair(merge: Any) -> tuple[str, str]:
    if isinstance(merge, str):
        left, right = merge.split(" ", 1)
        return left, right
    return merge[0], merge[1]


def rebuild_bpe(compact: str) -> Any:
    """The `tokenizers.Tokenizer` of a `BpeTokenizer`'s compact form (from a manifest:
    a claim of the host, bounded by the manifest's size and checked as it is read)."""
    tokenizers = require("tokenizers")
    try:
        lines = zlib.decompressobj().decompress(base64.b64decode(compact, validate=True), 1 << 22)
        merges = [_pair(line) for line in lines.decode().split("\n") if line]
    except (ValueError, zlib.error, UnicodeDecodeError) as exc:
        raise TaskError(f"hf: the experiment's tokenizer is malformed ({exc})") from None
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {EOS_TOKEN: 0}
    for symbol in alphabet:
        vocab.setdefault(symbol, len(vocab))
    for left, right in merges:
        if left not in vocab or right not in vocab:
            raise TaskError("hf: the experiment's tokenizer is malformed (a merge of unknowns)")
        vocab.setdefault(left + right, len(vocab))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN])
    return tokenizer


def file_tokenizer(path: Path, pinned_digest: str = "") -> tuple[Any, str]:
    """The tokenizer of a local tokenizer.json and its digest; refused if the digest
    differs from `pinned_digest` (the experiment's, when joining)."""
    tokenizers = require("tokenizers")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TaskError(f"hf: cannot read the tokenizer {path}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if pinned_digest and digest != pinned_digest:
        raise TaskError(
            f"hf: the tokenizer {path} here (digest {digest[:12]}) differs from the "
            f"experiment's (digest {pinned_digest[:12]}): give the host's tokenizer.json"
        )
    try:
        return tokenizers.Tokenizer.from_str(raw.decode()), digest
    except Exception as exc:  # tokenizers raises its own Exception for a bad file
        raise TaskError(f"hf: {path} is not a tokenizer.json: {exc}") from None


class TokenCorpus:
    """Tokenized documents as two int32 tensors, `train` and `val`, split as `ByteCorpus`
    splits bytes (every 50th document held out, or the last 2% of the tokens)."""

    def __init__(self, train: torch.Tensor, val: torch.Tensor, digest: str, description: str):
        self.train = train
        self.val = val
        self.digest = digest  # of the documents' names and bytes (`corpus._digest`)
        self.description = description

    @classmethod
    def tokenize(
        cls, documents: Sequence[Document], tokenizer: Any, *, window: int, description: str
    ) -> TokenCorpus:
        """Each document's tokens and an end-of-text token after it."""
        eos = tokenizer.token_to_id(EOS_TOKEN)
        encoded = tokenizer.encode_batch([d.data.decode(errors="replace") for d in documents])
        ids = [e.ids + ([eos] if eos is not None else []) for e in encoded]
        total = sum(map(len, ids))
        if total < 2 * window:
            raise TaskError(
                f"{description} has {total} tokens; at least {2 * window} are needed "
                f"(one training and one validation window of {window} tokens)"
            )
        held = [i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(ids))]
        if sum(len(t) for t, h in zip(ids, held, strict=True) if h) >= window:
            train = _flat(t for t, h in zip(ids, held, strict=True) if not h)
            val = _flat(t for t, h in zip(ids, held, strict=True) if h)
        else:
            everything = _flat(ids)
            val_tokens = max(math.ceil(total * HELD_OUT_FRACTION), window)
            train, val = everything[: total - val_tokens], everything[total - val_tokens :]
        if len(train) < window:
            raise TaskError(
                f"{description} has too few tokens to train on: {len(train)} are left after "
                f"the validation part, less than one window of {window}"
            )
        return cls(train, val, _digest(documents), description)

    def shard(self, shard: int, num_shards: int) -> torch.Tensor:
        """Shard `shard` of `num_shards` of the training tokens (contiguous, a view)."""
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"no shard {shard} of {num_shards}")
        size = len(self.train)
        return self.train[shard * size // num_shards : (shard + 1) * size // num_shards]


def _flat(parts: Any) -> torch.Tensor:
    flat = [token for part in parts for token in part]
    return torch.tensor(flat, dtype=torch.int32)
