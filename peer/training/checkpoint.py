"""Checkpoints: atomic on disk, resumable after a restart.

One file per experiment, ``<data-dir>/checkpoints/<experiment id>/latest.pt``.
A save writes a temporary file in the same directory, flushes it to disk and
renames it over the old one, so a crash (or `docker kill`) at any moment
leaves either the previous checkpoint or the new one, never half of one. The
previous file is kept as ``previous.pt``: a checkpoint that turns out corrupt
(a disk error, a hand edit) still leaves something to resume from.

Loading uses `torch.load(weights_only=True)`: a checkpoint is data, never
code, even if someone else wrote the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.serialization import config as serialization_config

from shoal.averaging.paged import PAGE, release_range

__all__ = ["CHECKPOINT_FORMAT", "CheckpointError", "CheckpointStore"]

CHECKPOINT_FORMAT = 1
LATEST = "latest.pt"
PREVIOUS = "previous.pt"

log = logging.getLogger("shoal.checkpoint")


class CheckpointError(Exception):
    """A checkpoint cannot be written or read; the message says what to do."""


class _Releasing:
    """A file that gives back the pages of file-mapped tensors (`averaging.paged`: a
    stage's moments within a memory budget) once `torch.save` wrote them: it hands
    each tensor's storage to `write` as it is, one after the other. Reading one maps
    pages of its neighbours in the file too (fault-around, large folios of the page
    cache: a 64 M-parameter stage's checkpoint held 39 MiB of its moments at the end):
    the last few storages written are given back again after each write, and all of
    them at the end (`release_all`)."""

    AGAIN = 4  # the storages before the one written whose pages are given back again

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.written: list[tuple[int, int]] = []  # (address, bytes) of each storage

    def write(self, data: Any) -> int:
        written = self.f.write(data)
        view = memoryview(data)
        if view.nbytes >= PAGE:
            self.written.append((np.frombuffer(view, np.uint8).ctypes.data, view.nbytes))
            for address, length in self.written[-1 - self.AGAIN :]:
                release_range(address, length)
        return written

    def flush(self) -> None:
        self.f.flush()

    def release_all(self) -> None:
        for address, length in self.written:
            release_range(address, length)


class CheckpointStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def latest(self) -> Path:
        return self.directory / LATEST

    def exists(self) -> bool:
        return self.latest.exists() or (self.directory / PREVIOUS).exists()

    def prepare(self) -> None:
        """Create the directory now: an unusable data directory fails at start, not at the
        first save hours later. Raises CheckpointError."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            raise CheckpointError(_cannot_write(self.directory, e)) from None
        # Half-written checkpoints of a process killed mid-save (a second Ctrl+C):
        # nobody else writes here (the data directory is locked), so they are stale.
        for stale in self.directory.glob(".latest-*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
                log.info("removed %s, a checkpoint whose writing was interrupted", stale.name)

    def save(self, state: dict[str, Any], *, crc32: bool = True) -> Path:
        """Write `state` atomically (blocking: call it from a thread). `crc32` False:
        the file's records carry no checksum, for a state that carries its own
        (`load`'s `check`): torch reads a record whole for its checksum before it
        writes it, so a tensor in a file mapping (`averaging.paged`) would come into
        the process whole, not a page run at a time as the write reads it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".latest-", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f, _checksums(crc32):
                    writer = _Releasing(f)
                    try:
                        torch.save({"format": CHECKPOINT_FORMAT, **state}, writer)
                    finally:
                        writer.release_all()
                    f.flush()
                    os.fsync(f.fileno())
                if self.latest.exists():
                    os.replace(self.latest, self.directory / PREVIOUS)
                os.replace(tmp, self.latest)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(self.directory)
        except OSError as e:
            raise CheckpointError(_cannot_write(self.directory, e)) from None
        return self.latest

    def load(
        self, check: Callable[[dict[str, Any]], str | None] | None = None
    ) -> dict[str, Any] | None:
        """The newest readable checkpoint, None when there is none. `check`: why a
        state read is damaged (None: it is not): a damaged one counts as unreadable
        (for states saved without checksums, `save(crc32=False)`).

        Raises CheckpointError when checkpoints exist but none can be read.
        """
        errors = []
        for name in (LATEST, PREVIOUS):
            path = self.directory / name
            if not path.exists():
                continue
            try:
                with warnings.catch_warnings():  # torch warns about odd pickles: noise here
                    warnings.simplefilter("ignore")
                    state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # torch raises many kinds for a damaged file
                errors.append(f"{path}: {_load_problem(e)}")
                continue
            if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
                errors.append(f"{path}: not a shoal checkpoint of format {CHECKPOINT_FORMAT}")
                continue
            damage = check(state) if check is not None else None
            if damage is not None:
                errors.append(f"{path}: {damage}")
                continue
            if errors:  # resuming from an older state than expected: say why
                log.warning(
                    "skipping the unreadable checkpoint %s; resuming from %s", errors[0], path
                )
            return state
        if errors:
            raise CheckpointError(
                f"corrupt checkpoint ({errors[0]}); move {self.directory} away to start "
                "this experiment afresh (or use another --data-dir)"
            )
        return None


def _checksums(on: bool) -> contextlib.AbstractContextManager[Any]:
    """torch.save's records with CRC-32 checksums (its default) or without (a process
    setting while the block runs: a stage peer writes one checkpoint at a time)."""
    if on:
        return contextlib.nullcontext()
    return serialization_config.patch({"save.compute_crc32": False})


def _cannot_write(directory: Path, e: OSError) -> str:
    return (
        f"cannot write a checkpoint in {directory}: {e.strerror or e}; "
        "check free space and permissions of the data directory (--data-dir)"
    )


def _load_problem(e: Exception) -> str:
    """Why torch could not read a file, in a few words (its own messages run for lines)."""
    text = str(e).strip()
    if isinstance(e, EOFError) or not text:
        return f"empty or truncated file ({type(e).__name__})"
    if "weights_only" in text:
        # torch suggests weights_only=False here: never for a file that should be ours.
        return f"not a checkpoint written by shoal ({type(e).__name__})"
    return f"{type(e).__name__}: {text.splitlines()[0][:120]}"


def _fsync_dir(directory: Path) -> None:
    # The rename itself must reach the disk, not only the file's bytes.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
