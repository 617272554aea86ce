"""State sync: a new or returning peer downloads the current state from peers that hold it.

Holders announce ``{fingerprint, step}`` in the DHT under ``<key>/state`` (one
owner-signed subkey each, so nobody can announce for someone else), with the
addresses they are reached at: a loader is often connected to none of them (a
peer that just joined, or one back from a partition), and a peer ID alone
cannot be dialed. Those addresses are claims like the rest: a handshake checks
that whoever answers at them holds the holder's key, and a wrong one costs a
failed dial. A loader
picks the newest state (highest step, then the fingerprint most holders
agree on), asks a holder for its layout and its state now (at least as new
as the announced one: announcements lag a swarm that keeps stepping), and
downloads the raw bytes in chunks straight into preallocated tensors. When
its source dies midway it resumes at the same offset from another holder of
the same fingerprint. The result is accepted only if its bytes match the
fingerprint its source named, so a lying or corrupt source costs a retry,
never a bad state.

A server hands out a *snapshot*: a copy of the state taken when the first
client asks for it, kept while downloads of it may still run, so the swarm
can go on averaging (and the live tensors on changing) meanwhile. A *live*
server (`live=True`) copies nothing while its owner's tensors stay unchanged:
it serves them in place, chunk by chunk (through the host for device tensors),
and its owner calls `before_change` before it changes them; a snapshot read
lately is then copied once (at most one such copy at a time), any other is
dropped. A model's state then costs its copy only while a download overlaps a
change, not for the whole run. With a folder for copies (`copies_dir`) that copy
goes to a file (`paged.file_tensors`: mapped, unlinked at once) and the download
reads it from there, each page given back once read: the state then costs no
memory of its own, at the price of writing its bytes to disk (for a pipeline
stage, 3 of the 9 parameter sizes a stage peer holds otherwise: parameters and
both moments).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from shoal.dht.node import DHTNode, DHTValue
from shoal.dht.records import RecordError, owner_marker, owner_of
from shoal.dht.routing import dialable_addrs
from shoal.transport import rpc
from shoal.transport.errors import RemoteError, TransportError
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr

from .deadline import Deadline
from .fingerprint import state_fingerprint
from .lineage import declared_work
from .paged import file_tensors, release, release_range
from .request_sizing import RequestSizer

log = logging.getLogger("shoal.averaging.state")

# 1.1.0: the bytes of a fetch travel as rpc chunks (1.0.0 framed each piece as a tensor).
DEFAULT_PROTOCOL = "/shoal/state/1.1.0"
CHUNK_BYTES = 4 * 1024 * 1024
MAX_ANNOUNCED_ADDRS = 16  # (as many as a matchmaking declaration carries)
MAX_TENSORS = 65536
MAX_TOTAL_BYTES = 1 << 40
MAX_DIMS = 16
# After a pass in which every holder held another state than wanted (one kept
# stepping and dropped the snapshot we were fetching): pause before looking again.
STALE_PAUSE_S = 0.2
MAX_STALE_PAUSE_S = 5.0
# A live snapshot read within this long before its tensors change is copied for its
# downloaders (a download fetches its ranges one request after another).
KEEP_READ_S = 10.0
_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip


class StateSyncError(Exception):
    """No holder could provide a verified state in time."""


class LayoutError(ValueError):
    """A holder's tensor layout that is malformed, too large, or cannot be allocated."""


class UnexpectedLayout(LayoutError):
    """A holder's layout other than the one the downloader holds (and expects):
    refused before anything is allocated for it."""


class NoHolders(StateSyncError):
    """Nobody announces a state for the key: a peer alone (the first one, or a
    restart of a swarm of one), not a failure."""


class MovedOn(StateSyncError):
    """No holder gave a version, and one at least had moved on from it (or was between
    two commits of a live state): no fault of theirs, and a newer version is worth
    looking up (a stage that steps several times a second moves on between the
    lookup of its version and the first request for it)."""


@dataclass(frozen=True, slots=True)
class State:
    """Tensors plus metadata (msgpack-able; ``step`` orders states)."""

    tensors: tuple[torch.Tensor, ...]
    metadata: Mapping[str, Any]
    fingerprint: str
    # The work of the lineage that made it, as its holder says (matchmaking_rules'
    # `lineage_work`): outside the fingerprint, which members of a round compare,
    # since a peer that restored an older checkpoint cannot know it.
    work: int | None = None

    @property
    def step(self) -> int:
        step = self.metadata.get("step", 0)
        return step if isinstance(step, int) else 0


def make_state(tensors: Sequence[torch.Tensor], metadata: Mapping[str, Any]) -> State:
    return State(tuple(tensors), dict(metadata), state_fingerprint(tensors, metadata))


StateProvider = Callable[[], State | None]


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _pieces(
    starts: Sequence[int], views: Sequence[torch.Tensor], offset: int, end: int
) -> list[tuple[int, int, int]]:
    """Bytes offset..end of the concatenated views as (view, start, length) pieces of at
    most CHUNK_BYTES, never across a view's end: the chunks of one fetch, in order."""
    pieces = []
    i = 0
    while offset < end:
        while starts[i] + views[i].numel() <= offset:
            i += 1
        start = offset - starts[i]
        n = min(end - offset, views[i].numel() - start, CHUNK_BYTES)
        pieces.append((i, start, n))
        offset += n
    return pieces


def _bytes_of(view: torch.Tensor) -> memoryview:
    return memoryview(view.numpy())


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


@dataclass(slots=True)
class _Snapshot:
    state: State
    views: list[torch.Tensor]  # uint8 views, one per tensor
    offsets: list[int]  # start of each tensor in the concatenated bytes
    total: int
    taken: float
    last_used: float = field(default=0.0)
    live: bool = False  # its views are the owner's live tensors (any device)
    fetching: int = 0  # fetches streaming from it now


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], int]:
    """Byte views of `tensors` and where each starts in their concatenation."""
    views = [_byte_view(t) for t in tensors]
    offsets, total = [], 0
    for v in views:
        offsets.append(total)
        total += v.numel()
    return views, offsets, total


def _host_copies(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().to("cpu", copy=True).contiguous() for t in tensors)


def _disk_copies(folder: Path, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Copies of `tensors` in a file of `folder` (`paged.file_tensors`: mapped, already
    unlinked: the kernel holds their pages as it holds any file's and drops them under
    pressure; the file's space goes with the last tensor). One tensor at a time, the
    copy's pages and its source's are given back once copied (a budget's moments in a
    file are such a source: all of them came into the process before, 2B), and a
    download served from the copies gives theirs back as it goes (`release`). (A
    device tensor passes through the host one tensor at a time.)"""
    copies = file_tensors(folder, [(t.shape, t.dtype) for t in tensors], suffix=".state")
    with torch.no_grad():
        for copy, t in zip(copies, tensors, strict=True):
            copy.copy_(t.detach())
            release(copy)
            release(t)
    return tuple(copies)


class StateServer:
    """Serves snapshots of `provider()` and announces them in the DHT."""

    def __init__(
        self,
        dht: DHTNode,
        key: str,
        provider: StateProvider,
        *,
        protocol: str = DEFAULT_PROTOCOL,
        announce_ttl: float = 60.0,
        keep_snapshots: int = 2,
        copy: bool = True,
        live: bool = False,
        copies_dir: Path | None = None,
    ) -> None:
        """`copy=False`: the provider's tensors never change once handed out (it
        gives frozen copies), so snapshots need not copy them again. `live=True`:
        they are the owner's live tensors, served in place; the owner awaits
        `before_change` before it changes them. `copies_dir`: where a live state's
        copy for a download that a change overlaps goes (None: host memory)."""
        self.dht = dht
        self.key = key
        self.provider = provider
        self.announce_ttl = announce_ttl
        self.keep_snapshots = keep_snapshots
        self.copy = copy and not live
        self.live = live
        self.copies_dir = copies_dir
        self._snapshots: dict[str, _Snapshot] = {}
        self.service = rpc.RpcService(dht.host, protocol)
        self.service.unary("info")(self._on_info)
        self.service.stream("fetch")(self._on_fetch)
        self._announced: tuple[str, list[str], float] | None = None
        self.served_bytes = 0

    async def announce(self) -> bool:
        """Tell the DHT which state we hold (call after each commit; cheap when unchanged)."""
        state = self.provider()
        if state is None:
            return False
        now = time.time()
        addrs = [str(a) for a in list(self.dht.host.addresses())[:MAX_ANNOUNCED_ADDRS]]
        if (
            self._announced is not None
            and self._announced[:2] == (state.fingerprint, addrs)
            and self._announced[2] - now > self.announce_ttl / 2
        ):
            return True
        expiration = now + self.announce_ttl
        record: dict[str, Any] = {"fp": state.fingerprint, "step": state.step, "addrs": addrs}
        if state.work is not None:
            record["work"] = state.work  # the best lineage first (`find_holders`)
        version = state.metadata.get("version")
        if isinstance(version, str):
            record["version"] = version  # so that a re-sync finds the version it wants
        ok = await self.dht.store(
            f"{self.key}/state",
            record,
            expiration,
            subkey=owner_marker(self.dht.peer_id),
        )
        if ok:
            self._announced = (state.fingerprint, addrs, expiration)
        return ok

    def close(self) -> None:
        self.service.close()
        self._snapshots.clear()

    def drop_copies(self) -> None:
        """Drop the copies `before_change` kept (a peer about to download a newer
        state: those downloads move on to it, and their memory makes room for ours)."""
        for fp in [f for f, s in self._snapshots.items() if not s.live]:
            del self._snapshots[fp]

    async def before_change(self, *, keep: bool = True) -> State | None:
        """The owner's live tensors are about to change: a live snapshot read within
        KEEP_READ_S (or being read) is copied to the host for its downloaders, when
        `keep`, and replaces any copy kept before (one at a time); any other live one
        is dropped. Returns the state kept (None: none)."""
        now = time.monotonic()
        kept: State | None = None
        for fp, snap in list(self._snapshots.items()):
            if not snap.live:
                continue
            del self._snapshots[fp]
            if not (keep and (snap.fetching or now - snap.last_used < KEEP_READ_S)):
                continue
            self.drop_copies()  # (one copy at a time: their downloads move on)
            copies = await asyncio.to_thread(self._copies, snap.state.tensors)
            # In place: fetches streaming from `snap` read the copies from here on.
            snap.state = replace(snap.state, tensors=copies)
            snap.views, snap.offsets, snap.total = _layout(copies)
            snap.live = False
            self._snapshots[fp] = kept_snap = snap
            kept = kept_snap.state
        return kept

    def _copies(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """A live state's copy for its downloads: in the copies folder, else (none, or
        a disk that fails: full, read-only) in host memory."""
        if self.copies_dir is not None:
            try:
                return _disk_copies(self.copies_dir, tensors)
            except (OSError, TypeError) as e:
                log.warning("copying the served state to %s failed (%r): copied in memory",
                            self.copies_dir, e)  # fmt: skip
        return _host_copies(tensors)

    def _snapshot(self, fingerprint: str | None) -> _Snapshot:
        now = time.monotonic()
        if fingerprint is not None and fingerprint in self._snapshots:
            snap = self._snapshots[fingerprint]
            snap.last_used = now
            return snap
        state = self.provider()
        if state is None:
            raise LookupError("this peer holds no state yet")
        if fingerprint is not None and state.fingerprint != fingerprint:
            raise LookupError(f"state {fingerprint[:12]} is gone; now at {state.fingerprint[:12]}")
        snap = self._snapshots.get(state.fingerprint)
        if snap is None:
            # A copy: the live tensors change with the next commit, a download must not
            # (a live server's owner tells us first: `before_change`).
            if self.copy:
                tensors = _host_copies(state.tensors)
            elif self.live:
                tensors = tuple(t.detach() for t in state.tensors)  # (the same storage)
            else:
                tensors = tuple(t.contiguous() for t in state.tensors)
            if self.live and not all(t.is_contiguous() for t in tensors):
                raise LookupError("a live state must be contiguous tensors")
            views, offsets, total = _layout(tensors)
            snap = _Snapshot(
                State(tensors, state.metadata, state.fingerprint, state.work),
                views,
                offsets,
                total,
                now,
                live=self.live,
            )
            self._snapshots[state.fingerprint] = snap
            while len(self._snapshots) > self.keep_snapshots:
                oldest = min(self._snapshots.values(), key=lambda s: max(s.taken, s.last_used))
                del self._snapshots[oldest.state.fingerprint]
        snap.last_used = now
        return snap

    async def _on_info(self, ctx: rpc.CallContext, payload: Any) -> Any:
        snap = self._snapshot(None)
        info = {
            "fp": snap.state.fingerprint,
            "metadata": dict(snap.state.metadata),
            "tensors": [[_dtype_name(t), list(t.shape)] for t in snap.state.tensors],
            "total": snap.total,
        }
        if snap.state.work is not None:
            info["work"] = snap.state.work
        return info

    async def _on_fetch(self, ctx: rpc.CallContext, payload: Any) -> Any:
        if not isinstance(payload, dict):
            raise ValueError("fetch wants a map")
        fp, offset, length = payload.get("fp"), payload.get("offset"), payload.get("length")
        if not isinstance(fp, str) or not isinstance(offset, int) or not isinstance(length, int):
            raise ValueError("fetch wants fp (str), offset and length (int)")
        snap = self._snapshot(fp)
        if not 0 <= offset <= offset + length <= snap.total:
            raise ValueError(f"range {offset}+{length} outside 0..{snap.total}")
        end = offset + length
        snap.fetching += 1
        try:
            pieces = _pieces(snap.offsets, snap.views, offset, end)
            for index, (i, start, n) in enumerate(pieces):
                piece = snap.views[i][start : start + n]
                if snap.live:
                    # A chunk's copy (through the host for a device): the live tensor may
                    # change while the chunk is written, the copy does not.
                    piece = piece.to("cpu", copy=True)
                # Else straight from the snapshot's storage: no copy.
                await ctx.send_chunk(index, _bytes_of(piece))
                release(snap.views[i])  # (a file-mapped tensor's pages, once sent)
                self.served_bytes += n
                snap.last_used = time.monotonic()
        finally:
            snap.fetching -= 1
        yield {"done": end}


@dataclass(frozen=True, slots=True)
class Holder:
    peer_id: PeerID
    fingerprint: str
    step: int
    version: str | None = None  # the state's version (hex), when its holder says
    work: int | None = None  # its lineage's (see `State.work`), when its holder says
    addrs: tuple[Multiaddr, ...] = ()  # where it says it is reached (dialable ones only)

    @property
    def rank(self) -> int:
        """Its lineage's work as this holder says it, never below the step (each
        commit has a member at least)."""
        return max(self.work or 0, self.step)


async def find_holders(dht: DHTNode, key: str) -> list[Holder]:
    """Who announced a state for `key`: the states of the most work first (see
    `Holder.rank`), then the newest, then the most announced."""
    found = await dht.get(f"{key}/state", latest=True)
    return [] if found is None else _holders_in(dht, found)


async def count_holders(dht: DHTNode, key: str, *, within: float) -> int | None:
    """How many peers (us included, once we announced) announced a state of `key`,
    from a counted read of the replicas that answer `within` seconds (all k: a
    sample of 3 undercounts announcements that have not reached every replica
    yet); None when none answered in time: unknown. Counted, not read: hundreds of
    peers reading hundreds of announcements each at once filled the replicas'
    uplinks (`dht.counted_reads`)."""
    found = await dht.count_records(f"{key}/state", within=within)
    return None if found is None else max(1, found)


def _holders_in(dht: DHTNode, found: DHTValue) -> list[Holder]:
    if found.subkeys is None:
        return []
    holders = []
    for subkey, (value, _) in found.subkeys.items():
        try:
            peer = owner_of(subkey)
        except RecordError:
            continue
        if peer is None or peer == dht.peer_id or not isinstance(value, dict):
            continue
        fp, step, version = value.get("fp"), value.get("step", 0), value.get("version")
        if isinstance(fp, str) and isinstance(step, int):
            version = version if isinstance(version, str) else None
            work = declared_work(value.get("work"))
            holders.append(Holder(peer, fp, step, version, work, _announced_addrs(peer, value)))
    votes: dict[tuple[int, str], int] = {}
    for h in holders:
        votes[(h.step, h.fingerprint)] = votes.get((h.step, h.fingerprint), 0) + 1
    holders.sort(key=lambda h: (-h.rank, -h.step, -votes[(h.step, h.fingerprint)], h.fingerprint))
    return holders


def _announced_addrs(peer: PeerID, value: Mapping[str, Any]) -> tuple[Multiaddr, ...]:
    """The dialable addresses a holder announced (none: an older peer's record, or junk)."""
    raw = value.get("addrs")
    if not isinstance(raw, list):
        return ()
    strings = [a for a in raw[:MAX_ANNOUNCED_ADDRS] if isinstance(a, str) and len(a) <= 256]
    return dialable_addrs(peer, strings, MAX_ANNOUNCED_ADDRS)


async def reach(host: Any, peer: PeerID, addrs: Sequence[Multiaddr], timeout: float) -> None:
    """Dial `peer` at `addrs` unless we are connected to it (an RPC to a peer ID alone
    reaches only a peer we are connected to)."""
    if addrs and host.connection(peer) is None:
        await host.connect(peer, addrs, timeout=timeout)


def _allocate(layout: object, like: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Empty tensors for a holder's layout ([[dtype name, shape], ...]); LayoutError
    (a ValueError) when it is malformed, too large, or cannot be allocated here;
    UnexpectedLayout when it is not that of the tensors `like` (ours)."""
    if like is not None:
        ours = [[_dtype_name(t), list(t.shape)] for t in like]
        if layout != ours:
            raise UnexpectedLayout(
                f"a layout of {len(layout) if isinstance(layout, list) else '?'} tensors "
                f"other than ours ({len(ours)} tensors)"
            )
    if not isinstance(layout, list) or len(layout) > MAX_TENSORS:
        raise LayoutError("bad tensor layout")
    shapes, total = [], 0
    for item in layout:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise LayoutError("bad tensor layout entry")
        dtype, shape = _DTYPES.get(item[0]), item[1]
        if dtype is None:
            raise LayoutError(f"unknown dtype {item[0][:32]!r}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS):
            raise LayoutError("bad tensor shape")
        if not all(type(d) is int and 0 <= d <= MAX_TOTAL_BYTES for d in shape):
            raise LayoutError("bad tensor shape")
        total += math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if total > MAX_TOTAL_BYTES:
            raise LayoutError("state too large")
        shapes.append((shape, dtype))
    folder = _download_folder.get()
    if folder is not None:
        try:
            return file_tensors(folder, shapes, suffix=".download")
        except OSError as e:  # (a full or read-only disk: in memory, as without a folder)
            log.warning("cannot hold a download in %s (%r): in memory", folder, e)
    try:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
    except RuntimeError as e:  # more than this machine can hold
        raise LayoutError(f"cannot allocate the state: {e}") from None


# Where downloads of the current task keep their tensors (None: in memory). A context
# variable rather than an argument: the folder is the downloading peer's, and the
# loaders between it and `_allocate` (certified, by version, newest) are five layers.
_download_folder: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "shoal_download_folder", default=None
)


@contextlib.contextmanager
def downloads_in(folder: Path | None) -> Iterator[None]:
    """State downloads started inside the block keep their tensors in a file of
    `folder` (shared-mapped: the kernel writes their pages back and can drop them, as
    any file's) until they are copied into the owner's tensors; None: in memory."""
    token = _download_folder.set(folder)
    try:
        yield
    finally:
        _download_folder.reset(token)


async def load_state_from_peers(
    dht: DHTNode,
    key: str,
    *,
    protocol: str = DEFAULT_PROTOCOL,
    timeout: float = 300.0,
    deadline: Deadline | None = None,
    request_timeout: float = 30.0,
    chunk_bytes: int = 64 * 1024 * 1024,
    like: Sequence[torch.Tensor] | None = None,
    on_refused: Callable[[PeerID], None] | None = None,
) -> State:
    """Download and verify the newest state of `key` from its holders.

    Resumes from another holder of the same fingerprint when a source fails;
    raises NoHolders when nobody announces a state, StateSyncError when no
    holder gives a verified state before the `deadline` (default: `timeout`
    seconds from now). `like`: the tensors we hold; a holder whose layout is
    another is refused before anything is allocated (`on_refused(holder)`).
    """
    failed: set[PeerID] = set()
    # Holders found behind what they announce (a re-sync took one back): the
    # announced fingerprint, and the step its holder was at when asked.
    behind: dict[PeerID, tuple[str, int]] = {}
    errors: list[str] = []
    pause = STALE_PAUSE_S
    async with (deadline or Deadline.after(timeout)).scope():
        while True:
            found = [h for h in await find_holders(dht, key) if h.peer_id not in failed]
            holders = _as_last_seen(found, behind)
            if not holders and not errors:
                raise NoHolders(f"no peer could provide the state of {key!r}: nobody announced one")
            if not holders:
                detail = "; ".join(errors[-3:])
                raise StateSyncError(f"no peer could provide the state of {key!r}: {detail}")
            download = _Download(
                dht.host, protocol, request_timeout, chunk_bytes, at_least_step=holders[0].step,
                like=like, on_refused=on_refused,
            )  # fmt: skip
            stale = False
            for source in holders:  # newest first; the first that serves picks the state
                try:
                    await reach(dht.host, source.peer_id, source.addrs, request_timeout)
                    await download.from_source(source.peer_id)
                    break
                except (TransportError, TimeoutError, OSError, ValueError, LookupError) as e:
                    log.info("state download from %s stopped: %r", source.peer_id.short(), e)
                    errors.append(f"{source.peer_id.short()}: {e}")
                    if isinstance(e, _Behind):
                        behind[source.peer_id] = (source.fingerprint, e.step)
                    if _is_stale(e):
                        stale = True  # it holds another state than this download's: no fault
                    else:
                        failed.add(source.peer_id)
            if not download.complete:
                if stale:  # look again, without hammering holders that are all elsewhere
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, MAX_STALE_PAUSE_S)
                continue
            state = await download.verified()
            if state is None:
                errors.append(f"bytes do not match fingerprint {str(download.fingerprint)[:12]}")
                failed.update(download.contributors)
                continue
            return state


async def load_version_from_peers(
    dht: DHTNode,
    key: str,
    version: str,
    *,
    sources: Sequence[tuple[PeerID, Sequence[Multiaddr]]] = (),
    protocol: str = DEFAULT_PROTOCOL,
    deadline: Deadline,
    request_timeout: float = 30.0,
    chunk_bytes: int = 64 * 1024 * 1024,
    fingerprint: str | None = None,
    like: Sequence[torch.Tensor] | None = None,
    on_refused: Callable[[PeerID], None] | None = None,
) -> State:
    """Download and verify the state of one `version` (hex) of `key`.

    What a re-sync needs: matchmaking named the version the swarm holds, and
    the newest state in the DHT may be another (two groups that committed the
    same step: the one most holders announce can be our own). `sources` are
    tried first (peers known to hold it, e.g. the ones matchmaking just
    confirmed, with their addresses), then the DHT's holders that announce it.
    Raises StateSyncError when no reachable peer serves it by the `deadline`.
    `like`, `on_refused`: as for `load_state_from_peers`.
    """
    tried: set[PeerID] = {dht.peer_id}
    errors: list[str] = []
    stale = 0  # sources that held another version (no fault)
    queue = list(sources)
    looked_up = False

    def fresh() -> _Download:
        return _Download(
            dht.host, protocol, request_timeout, chunk_bytes, version=version,
            fingerprint=fingerprint, like=like, on_refused=on_refused,
        )  # fmt: skip

    download = fresh()
    async with deadline.scope():
        while queue or not looked_up:
            if not queue:
                looked_up = True
                holders = await find_holders(dht, key)
                queue = [(h.peer_id, h.addrs) for h in holders if h.version == version]
                continue
            peer, addrs = queue.pop(0)
            if peer in tried:
                continue
            tried.add(peer)
            try:
                await reach(dht.host, peer, addrs, request_timeout)
                await download.from_source(peer)
            except (TransportError, TimeoutError, OSError, ValueError, LookupError) as e:
                log.info("state download from %s stopped: %r", peer.short(), e)
                errors.append(f"{peer.short()}: {e}")
                stale += _is_stale(e)
                continue
            state = await download.verified()
            if state is not None:
                return state
            errors.append(f"{peer.short()}: bytes do not match fingerprint")
            download = fresh()
    detail = "; ".join(errors[-3:]) or "nobody announces it"
    # (One that moved on holds a newer state, worth looking up, whatever the others did:
    # holders behind NATs we could not dial, say.)
    error = MovedOn if stale else StateSyncError
    raise error(f"no reachable peer serves version {version[:12]} of {key!r}: {detail}")


class _Stale(LookupError):
    """A source holds another state than the one a download wants: it moved on,
    or it is behind. Not a fault of the source."""


class _Behind(_Stale):
    def __init__(self, step: int, wanted: int) -> None:
        super().__init__(f"it is behind: step {step} < {wanted}")
        self.step = step


def _as_last_seen(holders: list[Holder], behind: Mapping[PeerID, tuple[str, int]]) -> list[Holder]:
    """`holders` (newest first) with the step a holder was seen at when it was
    found behind its announcement, until it announces another state."""
    seen = [
        # (The work it announced is that of the state it left: unknown now.)
        replace(h, step=behind[h.peer_id][1], work=None)
        if behind.get(h.peer_id, ("", 0))[0] == h.fingerprint
        else h
        for h in holders
    ]
    return sorted(seen, key=lambda h: (-h.rank, -h.step))  # stable: then most-held first


def _is_stale(error: BaseException) -> bool:
    # The server's own LookupError (a snapshot no longer kept, no state yet) too.
    return isinstance(error, _Stale) or (
        isinstance(error, RemoteError) and error.kind == "LookupError"
    )


class _Download:
    """One state (one fingerprint) downloaded from its holders in turn: a source
    that fails is replaced by the next, which resumes where it stopped.

    The first source names the fingerprint: the state it holds when asked,
    which its server keeps as a snapshot while the download runs. With
    `version`, that state must be of that version; otherwise at least
    `at_least_step` (the newest announced) so that a holder that stepped since
    it announced is a source, not a failure."""

    def __init__(
        self,
        host: Any,
        protocol: str,
        request_timeout: float,
        chunk_bytes: int,
        *,
        version: str | None = None,
        at_least_step: int = 0,
        fingerprint: str | None = None,
        like: Sequence[torch.Tensor] | None = None,
        on_refused: Callable[[PeerID], None] | None = None,
    ) -> None:
        self.host = host
        self.expected = fingerprint  # what the version's certificate names
        self.like = like  # the tensors we hold: a source's layout must be theirs
        self.on_refused = on_refused
        self.protocol = protocol
        self.fingerprint: str | None = None
        self.version = version
        self.at_least_step = at_least_step
        self.request_timeout = request_timeout
        self.chunk_bytes = chunk_bytes
        self.tensors: list[torch.Tensor] | None = None
        self.views: list[torch.Tensor] = []
        self.info: dict[str, Any] = {}
        self.progress = [0]  # bytes verified-in-order so far; a new source resumes there
        self.contributors: list[PeerID] = []

    @property
    def complete(self) -> bool:
        return self.tensors is not None and self.progress[0] == sum(v.numel() for v in self.views)

    async def from_source(self, peer: PeerID) -> None:
        """Download the rest from `peer` (its layout first, from the first source)."""
        self.contributors.append(peer)
        if self.tensors is None:
            info = await rpc.call(
                self.host, peer, self.protocol, "info", None, timeout=self.request_timeout
            )
            if not isinstance(info, dict):
                raise ValueError("info is not a map")
            self.fingerprint = self._pick(info)
            try:
                tensors = _allocate(info.get("tensors"), self.like)
            except UnexpectedLayout:
                if self.on_refused is not None:
                    self.on_refused(peer)
                raise
            views = [_byte_view(t) for t in tensors]
            if sum(v.numel() for v in views) != info.get("total"):
                raise ValueError("layout and total disagree")
            self.tensors, self.views, self.info = tensors, views, info
        assert self.fingerprint is not None
        await _fetch(
            self.host, peer, self.protocol, self.fingerprint, self.views, self.progress,
            self.chunk_bytes, self.request_timeout,
        )  # fmt: skip

    def _pick(self, info: dict[str, Any]) -> str:
        """The fingerprint of the state a source's `info` describes, if it is one
        this download wants."""
        metadata = info.get("metadata")
        metadata = metadata if isinstance(metadata, dict) else {}
        fp = info.get("fp")
        if not isinstance(fp, str):
            raise ValueError("info names no fingerprint")
        if self.version is not None:
            held = metadata.get("version")
            if held != self.version:
                raise _Stale(f"it holds another version now: {str(held)[:12]}")
            if self.expected is not None and fp != self.expected:
                raise ValueError(f"it serves {fp[:12]}, not the certified {self.expected[:12]}")
            return fp
        step = metadata.get("step", 0)
        if not isinstance(step, int):
            raise ValueError("info names no step")
        if step < self.at_least_step:
            raise _Behind(step, self.at_least_step)
        return fp

    async def verified(self) -> State | None:
        """The downloaded state, or None when its bytes do not match the fingerprint."""
        assert self.tensors is not None
        metadata = self.info.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {}
        got = await asyncio.to_thread(state_fingerprint, self.tensors, metadata)
        if got != self.fingerprint:
            return None
        return State(tuple(self.tensors), metadata, got, declared_work(self.info.get("work")))


async def _fetch(
    host: Any,
    peer: PeerID,
    protocol: str,
    fingerprint: str,
    views: list[torch.Tensor],
    progress: list[int],
    chunk_bytes: int,
    request_timeout: float,
) -> None:
    """Download from `progress[0]` to the end in requests sized to the link
    (`RequestSizer`: each must end within `request_timeout`, at most `chunk_bytes`),
    advancing `progress[0]` after each piece received, so that after a failure
    another source resumes there (the fingerprint checks every byte at the end)."""
    total = sum(v.numel() for v in views)
    offset = progress[0]
    starts = []
    acc = 0
    for v in views:
        starts.append(acc)
        acc += v.numel()
    sizer = RequestSizer(request_timeout, chunk_bytes)
    while offset < total:
        length = min(sizer.next_bytes, total - offset)
        end = offset + length
        opened = time.monotonic()
        async with rpc.open_call(
            host, peer, protocol, "fetch",
            {"fp": fingerprint, "offset": offset, "length": length},
            timeout=request_timeout,
        ) as call:  # fmt: skip
            await call.close_send()
            for index, (i, start, n) in enumerate(_pieces(starts, views, offset, end)):
                piece = views[i][start : start + n]
                await call.recv_chunk_into(index, _bytes_of(piece))
                # (A download into a file's mapping, `downloads_in`: its pages, once
                # written, go to the page cache, not the process's resident set.)
                release_range(piece.data_ptr(), n)
                progress[0] = starts[i] + start + n
            done = await call.recv_item()
            if not isinstance(done, dict) or done.get("done") != end:
                raise ValueError("fetch ended out of step")
        sizer.observe(length, time.monotonic() - opened)
        offset = progress[0] = end


__all__ = [
    "DEFAULT_PROTOCOL",
    "Holder",
    "LayoutError",
    "MovedOn",
    "NoHolders",
    "State",
    "StateProvider",
    "StateServer",
    "StateSyncError",
    "UnexpectedLayout",
    "find_holders",
    "load_state_from_peers",
    "load_version_from_peers",
    "make_state",
]
