"""Tensors in a file mapping (`averaging/paged.py`): zeroed, each from a page of its own,
keeping what is written when their pages are given back; and every code that reads or
writes a state whole (its fingerprint, a load into it, a checkpoint) gives them back,
so a peer holds none of a budget's moments between uses."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from shoal.averaging.fingerprint import state_fingerprint
from shoal.averaging.paged import PAGE, file_tensors, release, release_range
from shoal.averaging.state_loading import write_state
from shoal.averaging.state_sync import _disk_copies
from shoal.peer.training import checkpoint as checkpoint_module
from shoal.peer.training.checkpoint import CheckpointStore

from .test_pipeline_stage_memory import resident_kib

pytestmark = pytest.mark.timeout(60)

BIG = 1 << 20  # elements: 4 MiB of float32


def test_file_tensors_are_zeroed_page_aligned_and_keep_their_contents_once_released(
    tmp_path: Path,
) -> None:
    a, b, empty = file_tensors(tmp_path, [((BIG,), torch.float32), ((3, 5), torch.int64),
                                          ((0,), torch.float32)])  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # (unlinked at once: its space goes with it)
    assert a.data_ptr() % PAGE == 0 and b.data_ptr() % PAGE == 0
    assert a.abs().sum() == 0 and b.abs().sum() == 0 and empty.numel() == 0
    a.fill_(1.5)
    b.copy_(torch.arange(15).view(3, 5))
    assert resident_kib(a) >= BIG * 4 // 1024
    release(a)
    release(b)
    release(empty)  # (nothing to give back)
    assert resident_kib(a) == 0
    assert torch.equal(a, torch.full((BIG,), 1.5)) and torch.equal(b, torch.arange(15).view(3, 5))


def test_a_range_gives_back_its_whole_pages_only_and_other_tensors_are_left_alone(
    tmp_path: Path,
) -> None:
    (a,) = file_tensors(tmp_path, [((BIG,), torch.float32)])
    a.fill_(2.0)
    start = a.data_ptr() + PAGE // 2  # (the first page is half outside: kept)
    release_range(start, 4 * PAGE)
    resident = resident_kib(a)
    assert BIG * 4 // 1024 - 4 * PAGE // 1024 <= resident < BIG * 4 // 1024
    plain = torch.ones(BIG)
    release(plain)  # (not a file's: a lookup, nothing else)
    release_range(plain.data_ptr(), BIG * 4)
    assert plain.sum() == BIG and torch.equal(a, torch.full((BIG,), 2.0))


def test_a_fingerprint_a_load_and_a_checkpoint_give_the_pages_back(tmp_path: Path) -> None:
    moments = file_tensors(tmp_path / "moments", [((BIG,), torch.float32)] * 2)
    for i, m in enumerate(moments):
        m.fill_(float(i + 1))
    copies = [m.clone() for m in moments]
    assert state_fingerprint(moments, {}) == state_fingerprint(copies, {})
    assert [resident_kib(m) for m in moments] == [0, 0]
    downloaded = file_tensors(tmp_path / "downloads", [((BIG,), torch.float32)] * 2)
    for i, d in enumerate(downloaded):
        d.fill_(float(i + 5))
    asyncio.run(write_state(moments, downloaded, None))
    assert [resident_kib(t) for t in [*moments, *downloaded]] == [0, 0, 0, 0]
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save({"tensors": moments})
    # (torch.save reads a tensor for its checksum, writes it, and then reads a page or
    # so of it again: one tensor's pages at a time, and next to none once saved.)
    assert all(resident_kib(m) <= 256 for m in moments)
    loaded = store.load()
    assert loaded is not None
    assert [t[0].item() for t in loaded["tensors"]] == [5.0, 6.0]
    assert all(torch.equal(t, m) for t, m in zip(loaded["tensors"], moments, strict=True))


def test_a_checkpoint_without_checksums_holds_about_one_tensors_pages_while_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage's checkpoint (`save(crc32=False)`) of moments in a file: while it writes,
    the process holds the pages of about the tensor being written (not of those
    written before, which reading the next maps back: 14 MiB of these twelve held at
    the end before), and none once written."""
    shape = (2304, 576)  # (5 MiB: a 64 M-parameter model's MLP weight)
    moments = file_tensors(tmp_path / "moments", [(shape, torch.float32)] * 12)
    for i, m in enumerate(moments):
        m.fill_(float(i))
        release(m)
    held: list[int] = []
    write = checkpoint_module._Releasing.write

    def counting(self: checkpoint_module._Releasing, data: object) -> int:
        written = write(self, data)
        held.append(resident_kib(moments[0]))  # (one mapping holds all twelve)
        return written

    monkeypatch.setattr(checkpoint_module._Releasing, "write", counting)
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save({"tensors": moments}, crc32=False)
    one = math.prod(shape) * 4 // 1024
    assert max(held) <= one, held
    assert resident_kib(moments[0]) == 0
    loaded = store.load()
    assert loaded is not None
    assert all(torch.equal(t, m) for t, m in zip(loaded["tensors"], moments, strict=True))


def test_a_copy_for_downloads_of_moments_in_a_file_holds_none_of_either_once_made(
    tmp_path: Path,
) -> None:
    """A live state's copy for the downloads a commit overlaps (`state_sync.
    _disk_copies`, a daemon's): of moments in a file, it leaves neither theirs nor its
    own pages in the process (before, writing the copy read every moment's: 2B); and
    it serves, bit for bit, what it copied."""
    moments = file_tensors(tmp_path / "moments", [((BIG,), torch.float32)] * 2)
    for i, m in enumerate(moments):
        m.fill_(float(i + 1))
        release(m)
    copies = _disk_copies(tmp_path / "copies", moments)
    assert [resident_kib(t) for t in [*moments, *copies]] == [0, 0, 0, 0]
    assert all(torch.equal(c, m) for c, m in zip(copies, moments, strict=True))
    for c in copies:  # (a download served from the copy gives its pages back too)
        release(c)
    assert resident_kib(copies[0]) == 0  # (one mapping holds both)
