"""Checkpoints on disk: atomic saves, a corrupt file falls back to the previous one, clear errors.

`CheckpointStore` is plain blocking code (the daemon calls it from a thread),
so these tests call it directly on a temporary directory.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.peer.training import checkpoint as checkpoint_module
from shoal.peer.training.checkpoint import CHECKPOINT_FORMAT, CheckpointError, CheckpointStore


def a_state(step: int) -> dict[str, Any]:
    """Something shaped like the trainer's state: tensors inside nested dicts and lists."""
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.float16)},
        "inner_optimizer": {
            "state": {0: {"exp_avg": torch.ones(2)}},
            "param_groups": [{"lr": 1e-3}],
        },
        "strategy": {"outer_steps": step, "momentum": [torch.full((2,), float(step))]},
        "step": step,
        "loss": 2.5,
        "experiment_id": "0123456789abcdef",
    }


def assert_same(a: Any, b: Any) -> None:
    """Equal structure and values, tensors compared exactly (dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def leftovers(directory: Path) -> list[str]:
    """Files other than the two checkpoints (a temporary file left behind, say)."""
    return sorted(p.name for p in directory.iterdir() if p.name not in ("latest.pt", "previous.pt"))


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints" / "0123456789abcdef")


# --- round trip -----------------------------------------------------------------------------


def test_nothing_saved_loads_as_none(store: CheckpointStore) -> None:
    assert not store.exists()
    assert store.load() is None


def test_save_then_load_returns_the_same_tensors_and_nested_dicts(store: CheckpointStore) -> None:
    state = a_state(7)
    path = store.save(state)
    assert path == store.latest and path.exists()
    assert store.exists()
    loaded = store.load()
    assert loaded is not None
    assert loaded.pop("format") == CHECKPOINT_FORMAT
    assert_same(state, loaded)
    assert leftovers(store.directory) == []


def test_the_directory_is_private(store: CheckpointStore) -> None:
    store.save(a_state(1))
    assert store.directory.stat().st_mode & 0o077 == 0


def test_a_second_save_keeps_the_first_as_previous(store: CheckpointStore) -> None:
    store.save(a_state(1))
    store.save(a_state(2))
    assert store.load()["step"] == 2  # type: ignore[index]
    previous = torch.load(store.directory / "previous.pt", weights_only=True)
    assert previous["step"] == 1
    assert leftovers(store.directory) == []


# --- atomicity --------------------------------------------------------------------------------


class CrashMidway(Exception):
    pass


def crashing_save(error: BaseException) -> Any:
    """A torch.save that writes part of the file, then fails (a crash, a full disk)."""

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise error

    return save


@pytest.mark.parametrize(
    "error",
    [CrashMidway("killed"), OSError(errno.ENOSPC, "No space left on device")],
    ids=["crash", "disk-full"],
)
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_and_no_temp_file(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    store.save(a_state(1))
    before = store.latest.read_bytes()
    monkeypatch.setattr(checkpoint_module.torch, "save", crashing_save(error))
    with pytest.raises((CrashMidway, CheckpointError)):
        store.save(a_state(2))
    assert store.latest.read_bytes() == before
    assert not (store.directory / "previous.pt").exists()
    assert leftovers(store.directory) == []
    monkeypatch.undo()
    assert store.load()["step"] == 1  # type: ignore[index]


def test_a_full_disk_is_a_checkpoint_error_saying_what_to_check(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        checkpoint_module.torch, "save", crashing_save(OSError(errno.ENOSPC, "No space left"))
    )
    with pytest.raises(CheckpointError) as caught:
        store.save(a_state(1))
    message = str(caught.value)
    assert "\n" not in message
    assert str(store.directory) in message
    assert "No space left" in message
    assert "--data-dir" in message


def test_a_crash_between_the_two_renames_still_resumes(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """latest.pt already moved to previous.pt, the new one not yet renamed: previous is used."""
    store.save(a_state(1))
    real_replace = os.replace
    calls = 0

    def replace_then_crash(src: Any, dst: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise CrashMidway("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "replace", replace_then_crash)
    with pytest.raises(CrashMidway):
        store.save(a_state(2))
    monkeypatch.undo()
    assert not store.latest.exists()
    assert leftovers(store.directory) == []
    assert store.exists()
    assert store.load()["step"] == 1  # type: ignore[index]


# --- reading damaged files ------------------------------------------------------------------

CORRUPTIONS = {
    "empty": lambda good: b"",
    "text": lambda good: b"garbage\n",
    "truncated": lambda good: good[: len(good) // 2],
    "zeros": lambda good: bytes(len(good)),
    "pickle": lambda good: pickle.dumps({"format": CHECKPOINT_FORMAT}),
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_a_corrupt_latest_falls_back_to_previous_with_a_warning(
    store: CheckpointStore, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    store.save(a_state(1))
    store.save(a_state(2))
    store.latest.write_bytes(CORRUPTIONS[damage](store.latest.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="shoal.checkpoint"):
        loaded = store.load()
    assert loaded is not None and loaded["step"] == 1
    assert_same(a_state(1)["model"], loaded["model"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(store.latest) in warnings[0]


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_both_files_corrupt_is_one_line_naming_the_file_and_what_to_do(
    store: CheckpointStore, damage: str
) -> None:
    store.save(a_state(1))
    store.save(a_state(2))
    for name in ("latest.pt", "previous.pt"):
        path = store.directory / name
        path.write_bytes(CORRUPTIONS[damage](path.read_bytes()))
    with pytest.raises(CheckpointError) as caught:
        store.load()
    message = str(caught.value)
    assert "\n" not in message
    assert len(message) < 2 * len(str(store.latest)) + 250  # the paths, and a short reason
    assert str(store.latest) in message
    assert f"move {store.directory} away" in message
    assert "--data-dir" in message
    # torch's own advice for such files (load with weights_only=False) must not reach users.
    assert "weights_only" not in message


def test_a_checkpoint_without_checksums_falls_back_on_what_its_own_check_finds(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Saved without torch's CRC-32 (a stage's, whose fingerprint is its checksum), a
    flipped byte in a tensor loads: the caller's check finds it, and the previous
    checkpoint is read instead, as for any unreadable one."""
    store.save(a_state(1), crc32=False)
    store.save(a_state(2), crc32=False)
    good = store.latest.read_bytes()
    weights = a_state(2)["model"]["w"].numpy().tobytes()
    at = good.index(weights) + 5
    store.latest.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :])

    def check(state: dict[str, Any]) -> str | None:
        same = torch.equal(state["model"]["w"], a_state(state["step"])["model"]["w"])
        return None if same else "its weights are not what was written"

    assert store.load()["step"] == 2  # (no checksum: the flipped byte goes unseen)
    with caplog.at_level(logging.WARNING, logger="shoal.checkpoint"):
        loaded = store.load(check)
    assert loaded is not None and loaded["step"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "its weights are not what was written" in warnings[0]


def test_only_a_corrupt_previous_is_an_error_too(store: CheckpointStore) -> None:
    store.directory.mkdir(parents=True)
    (store.directory / "previous.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"previous\.pt: empty or truncated"):
        store.load()


@pytest.mark.parametrize(
    "content",
    [{"step": 3}, {"format": CHECKPOINT_FORMAT + 1, "step": 3}, [1, 2, 3], torch.zeros(2)],
    ids=["no-format", "newer-format", "a-list", "a-tensor"],
)
def test_a_torch_file_that_is_not_a_shoal_checkpoint_is_refused(
    store: CheckpointStore, content: Any
) -> None:
    store.directory.mkdir(parents=True)
    torch.save(content, store.latest)
    with pytest.raises(CheckpointError, match="not a shoal checkpoint of format"):
        store.load()


def test_a_checkpoint_holding_code_is_never_executed(store: CheckpointStore) -> None:
    """torch.load(weights_only=True): a pickle that would run a command is refused."""
    store.directory.mkdir(parents=True)
    marker = store.directory / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    torch.save({"format": CHECKPOINT_FORMAT, "x": Evil()}, store.latest)
    with pytest.raises(CheckpointError, match="not a checkpoint written by shoal"):
        store.load()
    assert not marker.exists()


# --- unusable directories --------------------------------------------------------------------


def test_an_unwritable_directory_is_a_checkpoint_error(tmp_path: Path) -> None:
    # Under a regular file: fails for root too, unlike a chmod-ed directory.
    blocker = tmp_path / "checkpoints"
    blocker.write_text("")
    store = CheckpointStore(blocker / "0123456789abcdef")
    for attempt in (store.prepare, lambda: store.save(a_state(1))):
        with pytest.raises(CheckpointError) as caught:
            attempt()
        message = str(caught.value)
        assert "\n" not in message
        assert f"cannot write a checkpoint in {store.directory}" in message
        assert "--data-dir" in message
    assert store.load() is None  # nothing there to resume: not an error when reading


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused_before_training(store: CheckpointStore) -> None:
    store.directory.mkdir(parents=True)
    store.directory.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="Permission denied"):
            store.prepare()
    finally:
        store.directory.chmod(0o700)


def test_prepare_creates_the_directory(store: CheckpointStore) -> None:
    store.prepare()
    assert store.directory.is_dir()
    store.prepare()  # idempotent
    assert store.load() is None


def test_half_written_checkpoints_of_a_killed_save_are_removed_at_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    store.prepare()
    stale = store.directory / ".latest-abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    other = store.directory / "notes.txt"
    other.write_text("keep me")
    store.prepare()
    assert not stale.exists() and other.exists()
