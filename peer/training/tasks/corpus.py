"""Text corpora as bytes in a uint8 tensor: sources, the held-out split, shards and windows.

A corpus is a list of documents (files) read in sorted path order, so that the
same files give the same bytes on every machine. Held out for validation:
every 50th document, or, when that is less than one window (a single file, a
small folder), the last 2% of the bytes. The rest is the training part,
which `ByteCorpus.shard` cuts into contiguous shards, one per peer.

Custom tasks can use `ByteCorpus` for their own text data and
`random_windows` / `spaced_windows` to cut it into batches.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.peer.training.task_error import TaskError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "HELD_OUT_EVERY",
    "HELD_OUT_FRACTION",
    "ByteCorpus",
    "Document",
    "random_windows",
    "read_documents",
    "spaced_windows",
    "stdlib_files",
    "text_files",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 2**20  # reads in well under a second; the stdlib corpus is ~8 MB
HELD_OUT_EVERY = 50
HELD_OUT_FRACTION = 0.02
BINARY_SNIFF_BYTES = 8000  # git's rule: a NUL byte in the first 8000 bytes means binary

# Left out of the standard library corpus: test suites (large, and missing
# from distribution builds that ship them separately), parts that Debian and
# others package separately (tkinter, idlelib, lib2to3, distutils, ensurepip),
# generated tables (encodings, pydoc_data) and build-specific files.
STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "__pycache__",
        "site-packages",
        "dist-packages",
        "lib-dynload",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "distutils",
        "ensurepip",
        "encodings",
        "pydoc_data",
    }
)
STDLIB_EXCLUDED_FILES = frozenset({"turtle.py", "sitecustomize.py", "usercustomize.py"})


@dataclass(frozen=True, slots=True)
class Document:
    name: str  # the path relative to the corpus root, "/"-separated ("" for a single file)
    data: bytes


def stdlib_files(root: Path | None = None) -> tuple[Path, list[Path]]:
    """The root and the sorted `*.py` files of the running interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [
            d
            for d in subdirectories
            if d not in STDLIB_EXCLUDED_DIRS and not d.startswith("config-")
        ]
        files.extend(
            Path(directory, name)
            for name in names
            if name.endswith(".py")
            and name not in STDLIB_EXCLUDED_FILES
            and not name.startswith("_sysconfigdata")
        )
    return root, sorted(files, key=lambda f: f.relative_to(root).as_posix())


def text_files(root: Path) -> list[Path]:
    """The files under `root`, recursively, in sorted relative-path order; hidden ones skipped.

    Whether a file is text is decided when it is read (`read_documents`).
    """
    files: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        files.extend(Path(directory, name) for name in names if not name.startswith("."))
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def read_documents(root: Path, files: Sequence[Path], max_bytes: int) -> list[Document]:
    """The text files among `files`, in order, until `max_bytes` are read.

    Binary files (a NUL byte near the start) are skipped; the file that
    reaches the limit is cut there.
    """
    documents: list[Document] = []
    remaining = max_bytes
    for path in files:
        if remaining <= 0:
            log.warning(
                "read only the first %d bytes of text under %s (max_bytes)", max_bytes, root
            )
            break
        try:
            with path.open("rb") as file:
                data = file.read(min(remaining, BINARY_SNIFF_BYTES))
                if b"\0" in data:
                    continue
                data += file.read(remaining - len(data))
                truncated = bool(file.read(1))
        except OSError as exc:
            raise TaskError(f"cannot read {path}: {exc.strerror or exc}") from None
        if truncated:
            log.warning(
                "read only the first %d bytes of text under %s (max_bytes)", max_bytes, root
            )
            remaining = 0
        else:
            remaining -= len(data)
        name = "" if path == root else path.relative_to(root).as_posix()
        documents.append(Document(name, data))
    return documents


class ByteCorpus:
    """A corpus as two uint8 tensors, `train` and `val`, and a digest of its documents."""

    def __init__(self, train: torch.Tensor, val: torch.Tensor, digest: str, description: str):
        self.train = train
        self.val = val
        self.digest = digest  # sha256 hex over the documents' names and bytes
        self.description = description  # for messages: "the Python 3.11.7 standard library"

    @classmethod
    def from_documents(
        cls, documents: Sequence[Document], *, window: int, description: str
    ) -> ByteCorpus:
        """Split `documents` into a training and a held-out part of at least `window` bytes each."""
        total = sum(len(d.data) for d in documents)
        if total == 0:
            raise TaskError(f"no text in {description}")
        if total < 2 * window:
            raise TaskError(
                f"{description} has {total} bytes of text; at least {2 * window} are needed "
                f"(one training and one validation window of {window} bytes)"
            )
        held_out = [i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(documents))]
        held_out_bytes = sum(len(d.data) for d, h in zip(documents, held_out, strict=True) if h)
        if held_out_bytes >= window:
            train = _concatenate(d.data for d, h in zip(documents, held_out, strict=True) if not h)
            val = _concatenate(d.data for d, h in zip(documents, held_out, strict=True) if h)
        else:
            everything = _concatenate(d.data for d in documents)
            val_bytes = max(math.ceil(total * HELD_OUT_FRACTION), window)
            train, val = everything[: total - val_bytes], everything[total - val_bytes :]
        if len(train) < window:
            raise TaskError(
                f"{description} has {total} bytes of text, too little to train on: "
                f"{len(train)} bytes are left after the validation part, less than one "
                f"window of {window} bytes"
            )
        return cls(train, val, _digest(documents), description)

    @classmethod
    def from_path(
        cls, path: Path, *, window: int, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> ByteCorpus:
        """The user's text: one file, or every text file in a folder (recursively, sorted)."""
        if path.is_dir():
            files = text_files(path)
            documents = read_documents(path, files, max_bytes)
            if not documents:
                skipped = f" ({len(files)} binary files skipped)" if files else ""
                raise TaskError(f"no text files in {path}{skipped}")
        elif path.is_file():
            documents = read_documents(path, [path], max_bytes)
            if not documents:
                raise TaskError(f"{path} is not a text file (it has NUL bytes)")
        else:
            raise TaskError(f"no such file or directory: {path}")
        return cls.from_documents(documents, window=window, description=str(path))

    @classmethod
    def from_stdlib(
        cls, *, window: int, max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None
    ) -> ByteCorpus:
        """The `*.py` sources of this interpreter's standard library (`stdlib_files`)."""
        root, files = stdlib_files(root)
        documents = read_documents(root, files, max_bytes)
        version = ".".join(map(str, sys.version_info[:3]))
        return cls.from_documents(
            documents, window=window, description=f"the Python {version} standard library"
        )

    def shard_bounds(self, shard: int, num_shards: int) -> tuple[int, int]:
        """The [start, end) byte range of shard `shard` of `num_shards` in `train`."""
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"no shard {shard} of {num_shards}")
        size = len(self.train)
        return shard * size // num_shards, (shard + 1) * size // num_shards

    def shard(self, shard: int, num_shards: int) -> torch.Tensor:
        """Shard `shard` of `num_shards` of the training bytes (a view, not a copy)."""
        start, end = self.shard_bounds(shard, num_shards)
        return self.train[start:end]


def random_windows(
    tokens: torch.Tensor, *, window: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless batches, [batch_size, window], of windows of `tokens` at random offsets.

    The offsets come from a torch.Generator seeded with `seed`: the same
    arguments give the same batches. Too few tokens for one window raise
    `TaskError` here, not at the first batch.
    """
    if len(tokens) < window:
        raise TaskError(
            f"{len(tokens)} bytes of training data here, less than one window of {window} bytes "
            "(give more data, or train with fewer peers)"
        )
    return _random_windows(tokens, window, batch_size, seed)


def _random_windows(
    tokens: torch.Tensor, window: int, batch_size: int, seed: int
) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed % 2**64)
    offsets = torch.arange(window)
    while True:
        starts = torch.randint(0, len(tokens) - window + 1, (batch_size, 1), generator=generator)
        yield tokens[starts + offsets]


def spaced_windows(tokens: torch.Tensor, *, window: int, count: int) -> torch.Tensor:
    """`count` windows of `tokens`, [count, window], at evenly spaced offsets (no randomness)."""
    if count <= 0:
        return torch.empty(0, window, dtype=tokens.dtype)
    starts = torch.linspace(0, len(tokens) - window, count, dtype=torch.float64).long()
    return tokens[starts[:, None] + torch.arange(window)]


def _concatenate(parts: Iterator[bytes]) -> torch.Tensor:
    buffer = bytearray()
    for part in parts:
        buffer += part
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)  # shares the bytearray's memory


def _digest(documents: Sequence[Document]) -> str:
    hasher = hashlib.sha256()
    for document in documents:
        name = document.name.encode()
        hasher.update(len(name).to_bytes(8, "big") + name + len(document.data).to_bytes(8, "big"))
        hasher.update(document.data)
    return hasher.hexdigest()
