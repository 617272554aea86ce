"""The work log's kept states on disk, used only when they still hash as committed.

They are written past the log's RAM budget and read back when a reveal needs them.
A state on disk is one file of `state_file`'s format (parameters and
inner-optimizer state: raw tensor bytes after a msgpack header, no pickle, so no
code runs from the file); it is mapped rather than copied when read back (its
pages are the file's, which the kernel can drop, not the process's). A file that
is gone, truncated or altered reads back as None, never as a wrong state: the
caller compares the digest with the one it committed to before using it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

from shoal.averaging.state_file import read_tree, write_tree

from .segments import SegmentState

__all__ = ["SpillDir", "Spilled", "load_kept", "load_tensor"]

log = logging.getLogger(__name__)

SUFFIX = ".state"


class Spilled:
    """A kept state that lives in a file (the file is written once, never changed)."""

    __slots__ = ("path",)

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, digest: bytes) -> SegmentState | None:
        """The state, when the file still holds the one whose digest is `digest`."""
        try:
            raw = read_tree(self.path)
            state = SegmentState(list(raw["params"]), raw["optimizer"])
            if state.digest() == digest:
                return state
            problem = "digest mismatch"
        except Exception as e:  # gone, truncated, not a state file, wrong layout
            problem = repr(e)
        log.warning("kept state %s is unusable (%s)", self.path.name, problem)
        return None

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def load_kept(kept: SegmentState | Spilled | None, digest: bytes) -> SegmentState | None:
    """A kept state as a state: one in RAM as it is, one on disk read back and checked."""
    if isinstance(kept, Spilled):
        return kept.load(digest)
    return kept


class SpillDir:
    """The folder a work log writes its states to; what a previous run left there is
    stale (a round's work is answerable only by the process that did it) and goes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written = 0  # a re-run of a round gets files of its own
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)

    def write(self, round_index: int, step: int, state: SegmentState) -> Spilled:
        """`state` in a file of its own (blocking: run it where the inner steps run)."""
        self._written += 1
        final = self.path / f"r{round_index}-s{step}-{self._written}{SUFFIX}"
        partial = final.with_suffix(".part")
        write_tree(partial, {"params": state.params, "optimizer": state.optimizer})
        os.replace(partial, final)  # a crash mid-write leaves no file that looks whole
        return Spilled(final)

    def write_tensor(self, name: str, tensor: torch.Tensor) -> Path:
        """One tensor in a file of its own, `name` unique among this folder's tensors
        (blocking). Read it back with `load_tensor`."""
        final = self.path / f"{name}{SUFFIX}"
        partial = final.with_suffix(".part")
        write_tree(partial, tensor)
        os.replace(partial, final)
        return final

    def files(self) -> list[Path]:
        return sorted(self.path.iterdir())


def load_tensor(path: Path) -> torch.Tensor | None:
    """A tensor `write_tensor` wrote, mapped; None when the file is gone or unreadable
    (the caller checks it against what it committed to before using it)."""
    try:
        tensor = read_tree(path)
    except Exception as e:
        log.warning("kept tensor %s is unusable (%r)", path.name, e)
        return None
    return tensor if isinstance(tensor, torch.Tensor) else None
