"""State versions as peers hold them, and fetching a state an averager can load."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID

from .certifier import Certifier, Lineage
from .deadline import Deadline
from .group import Member
from .paged import release
from .state_sync import (
    NoHolders,
    State,
    StateSyncError,
    load_state_from_peers,
    load_version_from_peers,
)

log = logging.getLogger("shoal.averaging")

GENESIS = b""


def version_of(commits: int) -> bytes:
    """The version of `commits` commits, counted alone (no chain hash)."""
    return commits.to_bytes(8, "big") if commits else GENESIS


def valid_version(version: bytes, commits: int) -> bool:
    """A version as peers hold them: empty at 0 commits, else the count (8 bytes),
    possibly followed by a chain hash (8 bytes)."""
    if commits == 0:
        return version == GENESIS
    return len(version) in (8, 16) and version[:8] == commits.to_bytes(8, "big")


def restored_version(commits: object, version: object = None) -> bytes:
    """The state version a checkpoint's `commits` and `version` (hex, or None for
    the count alone) stand for; ValueError when they are malformed or disagree."""
    if isinstance(commits, bool) or not isinstance(commits, int) or commits < 0:
        raise ValueError(f"commits must be an int >= 0, got {commits!r}")
    if version is None:
        return version_of(commits)
    try:
        held = bytes.fromhex(version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"version must be hex, got {version!r}") from None
    if not valid_version(held, commits):
        raise ValueError(f"version {version!r} does not fit {commits} commits")
    return held


def loaded_version(metadata: dict[str, Any]) -> tuple[int, bytes]:
    """The commit count and version a downloaded state's metadata claim, bounded: a
    malformed count is 0, a version that does not fit the count is the count alone."""
    commits = metadata.get("commits", 0)
    commits = commits if isinstance(commits, int) and commits >= 0 else 0
    version = metadata.get("version")
    if isinstance(version, str):
        try:
            held = bytes.fromhex(version)
        except ValueError:
            held = b""
        if valid_version(held, commits):
            return commits, held  # (a chained version, for a shared state)
    return commits, version_of(commits)


async def fetch_state(
    dht: DHTNode,
    key: str,
    protocol: str,
    certifier: Certifier | None,
    deadline: Deadline,
    *,
    version: bytes | None,
    sources: Sequence[Member],
    ours: bytes,
    like: Sequence[torch.Tensor],
    on_refused: Callable[[PeerID], None],
) -> tuple[State, Lineage | None] | None:
    """The newest verified state of `key` (or the one of `version`, from `sources`
    first), with its certified lineage for a shared state; None (logged) when there is
    none to load, none arrived in time, or it does not fit our tensors (`like`)."""
    lineage: Lineage | None = None
    try:
        if certifier is not None:
            state, lineage = await certifier.load(
                dht, deadline, version, sources, ours=ours, like=like, on_refused=on_refused
            )
        elif version is None:
            state = await load_state_from_peers(
                dht, key, protocol=protocol, deadline=deadline, like=like, on_refused=on_refused
            )
        else:
            state = await load_version_from_peers(
                dht,
                key,
                version.hex(),
                sources=[(m.peer_id, m.addrs) for m in sources],
                protocol=protocol,
                deadline=deadline,
                like=like,
                on_refused=on_refused,
            )
    except NoHolders:
        # A peer alone (a restart, the first peer): normal, and nothing to do.
        log.info("no other peer serves the state of %s yet: keeping ours", key)
        return None
    except (StateSyncError, TimeoutError) as e:
        log.warning("could not load the state of %s: %s", key, e)
        return None
    if len(state.tensors) != len(like) or any(
        a.shape != b.shape or a.dtype != b.dtype for a, b in zip(state.tensors, like, strict=True)
    ):
        log.warning("the swarm's state of %s does not fit our tensors", key)
        return None
    return state, lineage


async def write_state(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], lock: threading.Lock | None
) -> None:
    """Copy a loaded state (`src`) into ours (`dst`), holding `lock` when there is one:
    owners whose other threads read the state (a stage server computing with it)."""

    def copy() -> None:
        with torch.no_grad():
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
                release(d)  # (file-mapped tensors: a download's, a budget's moments)
                release(s)

    if lock is None:
        copy()
        return

    def locked() -> None:
        with lock:
            copy()

    # In a thread: the lock's holder may compute for a while, the loop must not wait.
    await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(locked)))
