"""One round of butterfly all-reduce: its data plane and the driver of its decision.

The flattened float32 vector is cut into one contiguous part per member, sized
by bandwidth (`partition.Plan`). Between every ordered pair (i, j) there are
``streams_per_peer`` streams (lanes); on each, member i sends its slice of
part j (its *contribution*, encoded with the codec, in chunks), and owner j
answers on the same stream with the averaged part, chunk by chunk, as soon as
each chunk is reduced. Reduce-scatter and all-gather therefore overlap, and
the reduction overlaps receiving. A member of weight 0 sends no contribution.

Bit-identical results. Owner j alone computes part j: a weighted sum in member
order (early chunks of later members wait in a small ring of slots, so the
order never depends on arrival; uncompressed, in float64 rounded once to
float32). It encodes the result once and sends the same bytes to everyone,
itself included, who decode them with the same pure function. The result does
not depend on timing at all.

Nothing is written to the caller's tensors before the round commits.
Uncompressed results go to a separate buffer, copied in on commit. Encoded
results are validated as they arrive and kept encoded; on commit they are
decoded straight into the caller's tensor (or, for several tensors, into the
buffer that is then copied out): a quarter of the bytes to keep, and one pass
over the tensors instead of two. The decision itself is
`commit.CommitProtocol`, driven here (`ButterflyRound._drive`).

Wire of a lane (RPC method ``d``, a bidirectional stream): the request is
``{"r": round_id, "l": lane, "w": weight, "p": plan digest}``; then the
contribution chunks, then half-close; the owner answers with the result
chunks of that lane. A chunk is one RPC frame of kind TENSOR whose 8-byte body
is ``chunk index:u32, nbytes:u32``, followed by the encoded bytes. Indices and
sizes must be exactly the ones the plan says; anything else is a protocol
violation blamed on the sender.
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from shoal.transport import rpc
from shoal.transport.connection import Stream
from shoal.transport.errors import (
    ConnectionLost,
    DialError,
    ProtocolNotSupported,
    ProtocolViolation,
    RemoteError,
    StreamReset,
    TransportError,
)
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.rpc import FRAME, MSG, TENSOR, CallContext

from .commit import READY, CommitProtocol, Send, Status, parse_message
from .compression import Codec, CodecError
from .group import Group
from .partition import Plan, Span

__all__ = [
    "FAULT_POINTS",
    "AllReduceConfig",
    "AllReduceError",
    "AllReduceOutcome",
    "BadRequest",
    "BufferPool",
    "ButterflyRound",
    "NotAMember",
    "RoundOver",
    "UnknownRound",
]

log = logging.getLogger("shoal.averaging.allreduce")

FaultHook = Callable[[str], Awaitable[None]]
# Where `AllReduceConfig.fault_hook` is called (tests kill a member there).
FAULT_POINTS = (
    "start",  # the round is registered, no data moved yet
    "mid_reduce_scatter",  # our first contribution chunk went out
    "after_reduce_scatter",  # our last contribution chunk went out
    "before_ready",  # we hold every averaged part, READY not yet sent
    "after_ready",  # READY was delivered to the decider
    "decider_mid_broadcast",  # as decider: the decision reached half of the members
    "before_apply",  # the round committed, our tensors not yet written
)

# A chunk: an RPC frame header (length 8, kind TENSOR), then index and byte count.
_CHUNK = struct.Struct(">IBII")
_MAX_ERROR_FRAME = 64 * 1024
_SLOT_BUDGET = 64 * 1024 * 1024  # bytes of receive slots per round, at most (window >= 2)
_REDUCE_PIECE = 1 << 18  # elements summed at a time in float64 (2 MiB: stays in cache)
_THREAD_WORK = 1 << 23  # element-ops of one chunk's reduction above which it runs in a thread
_DIAL_WAIT = 1.0  # the larger peer ID waits this long for the smaller one to dial


@dataclass
class AllReduceConfig:
    """Settings of an `AllReduceService` (members of a group should agree on the
    chunking, codec and streams: a mismatch fails the round as a plan mismatch)."""

    codec: str = "none"  # compression.get_codec name
    chunk_bytes: int = 1 << 22  # ~ raw float32 bytes per chunk
    streams_per_peer: int = 1  # parallel streams per pair
    heartbeat_interval: float = 1.0
    stall_timeout: float = 10.0  # nothing heard from a member this long -> it is dead
    # A control message unanswered this long -> its target is dead; also how long a
    # member that knows the round must abort waits for the decider's word.
    decision_timeout: float = 10.0
    protocol: str = "/shoal/averaging/1.0.0"
    # Traffic for a round that has not started here yet waits this long for run().
    start_timeout: float = 5.0
    # Chunks of one incoming stream buffered ahead of the (ordered) reduction.
    window_chunks: int = 4
    # Tests: awaited at each of FAULT_POINTS; raising there simulates a crash (the
    # exception propagates out of run()).
    fault_hook: FaultHook | None = None

    def __post_init__(self) -> None:
        if self.chunk_bytes < 64 or self.streams_per_peer < 1 or self.window_chunks < 1:
            raise ValueError("chunk_bytes >= 64, streams_per_peer >= 1 and window_chunks >= 1")
        for name in ("heartbeat_interval", "stall_timeout", "decision_timeout", "start_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.heartbeat_interval * 2 > self.stall_timeout:
            raise ValueError("heartbeat_interval must be at most half of stall_timeout")


@dataclass
class AllReduceOutcome:
    committed: bool
    reason: str  # "" on commit, else why
    group: Group
    # Members the decision names dead, stalled or faulty (never this member itself): the
    # caller retries without them. Every member that took the decider's decision
    # reports the same set.
    failed: tuple[PeerID, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    # Not committed here, but others may have committed: this member voted READY and
    # never learned the decision. Its tensors are untouched; it must not assume it
    # holds the group's state.
    in_doubt: bool = False


class AllReduceError(Exception):
    """A request the all-reduce service refused (crosses the wire as RemoteError.kind)."""


class UnknownRound(AllReduceError):
    """The round did not start here within `start_timeout`."""


class RoundOver(AllReduceError):
    """The round already ended here (aborted or decided)."""


class NotAMember(AllReduceError):
    """The requester is not a member of the round."""


class BadRequest(AllReduceError):
    """A malformed request, or one the plan does not allow."""


class _Veto(Exception):
    """Internal: this member cannot complete its data phase."""

    def __init__(self, reason: str, blame: tuple[int, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.blame = blame


class _Crash(Exception):
    """Internal: the fault hook raised; the original exception leaves run()."""


class _Counter:
    """A monotonic counter tasks can wait on (chunks received, chunks reduced)."""

    __slots__ = ("_waiters", "value")

    def __init__(self) -> None:
        self.value = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def advance(self, value: int) -> None:
        self.value = value
        if self._waiters:
            keep = []
            for target, fut in self._waiters:
                if target <= value:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((target, fut))
            self._waiters = keep

    async def wait(self, target: int) -> None:
        if self.value >= target:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        await fut


class BufferPool:
    """Large buffers kept from one round to the next.

    Fresh memory costs a page fault per 4 KiB page (the kernel zeroes each one):
    for the result vector of a large round that is as much CPU as the reduction
    itself. The buffers of the last finished round are kept for the next one
    (about one more copy of the averaged tensors, for the life of the service).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((dtype, n))
        return free.pop() if free else torch.empty(n, dtype=dtype)

    def keep(self, buffers: list[torch.Tensor]) -> None:
        free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        for t in buffers:
            free.setdefault((t.dtype, t.numel()), []).append(t)
        self._free = free


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


async def _write_chunk(stream: Stream, index: int, payload: memoryview) -> int:
    await stream.write(_CHUNK.pack(8, TENSOR, index, len(payload)))
    await stream.write(payload)
    return _CHUNK.size + len(payload)


async def _read_chunk(stream: Stream, index: int, into: memoryview) -> int:
    """Read chunk `index` of exactly len(into) bytes into `into`."""
    head = await stream.readexactly(_CHUNK.size)
    length, kind, got_index, nbytes = _CHUNK.unpack(head)
    if kind == MSG and length >= 8:  # the other side's RPC layer reporting an error
        if length > _MAX_ERROR_FRAME:
            raise ProtocolViolation(f"message of {length} bytes in a data stream")
        body = head[FRAME.size :] + await stream.readexactly(length - 8)
        try:
            msg = msgpack.unpackb(body, raw=False)
        except Exception:
            raise ProtocolViolation("undecodable message in a data stream") from None
        if isinstance(msg, list) and len(msg) == 2 and msg[0] == rpc.ERR:
            err = msg[1] if isinstance(msg[1], list) and len(msg[1]) == 2 else ["?", msg[1]]
            raise RemoteError(str(err[0])[:100], str(err[1])[:1000])
        raise ProtocolViolation("unexpected message in a data stream")
    if kind != TENSOR or length != 8:
        raise ProtocolViolation(f"bad chunk frame (kind {kind}, length {length})")
    if got_index != index:
        raise ProtocolViolation(f"chunk {got_index} where chunk {index} was due")
    if nbytes != len(into):
        raise ProtocolViolation(f"chunk {index} has {nbytes} bytes, the plan says {len(into)}")
    await stream.readexactly_into(into)
    return _CHUNK.size + nbytes


class _Lane:
    """Owner side of one lane (sub-span) of our part: receive slots and the reduction."""

    def __init__(self, rnd: ButterflyRound, lane: int, span: Span, senders: list[int]) -> None:
        self.lane = lane
        self.chunks = rnd.plan.chunks(span)
        self.senders = senders
        self.window = rnd.window
        self.weights: dict[int, float] = {}
        self.slots: dict[int, list[torch.Tensor]] = {}
        self.received: dict[int, _Counter] = {i: _Counter() for i in senders}
        self.attached = _Counter()  # senders whose stream header arrived
        self.reduced = _Counter()  # chunks whose result is final
        # The encoded result (one buffer for the lane): the bytes every member gets.
        self.encoded: list[memoryview] = []


class ButterflyRound:
    """One member's side of one round: its data plane and the driver of its decision.

    Owned by the service, which routes incoming streams (`serve_lane`) and control
    messages (`on_control`) to it and keeps its `state` once it ended.
    """

    def __init__(
        self,
        host: Host,
        config: AllReduceConfig,
        pool: BufferPool,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        wait_connection: Callable[[PeerID, float], Awaitable[None]],
        group: Group,
        tensors: list[torch.Tensor],
        weight: float,
        codec: Codec,
        early: int,
    ) -> None:
        cfg = config
        self.cfg = cfg
        self.host = host
        self._pool = pool
        self._spawn = spawn
        self._wait_connection = wait_connection
        self.group = group
        self.round_id = group.round_id
        self.tensors = tensors
        self.weight = weight
        self.codec = codec
        self.raw = codec.name == "none"
        self.n = group.size
        self.me = group.index(self.host.peer_id)
        self.peers = group.peer_ids
        self.index = {p: i for i, p in enumerate(self.peers)}
        self.names = [p.short() for p in self.peers]
        n_elements = sum(t.numel() for t in tensors)
        self.plan = Plan.build(
            n_elements,
            [m.bandwidth for m in group.members],
            streams=cfg.streams_per_peer,
            chunk_elements=max(1, cfg.chunk_bytes // 4),
        )
        self.digest = self.plan.digest(
            self.round_id, [p.to_bytes() for p in self.peers], codec.code
        )
        per_slot = self.plan.chunk_elements * 4 * max(1, (self.n - 1) * cfg.streams_per_peer)
        self.window = max(2, min(cfg.window_chunks, _SLOT_BUDGET // per_slot))
        self.state = CommitProtocol(
            self.n,
            self.me,
            time.monotonic(),
            names=self.names,
            heartbeat_interval=cfg.heartbeat_interval,
            stall_timeout=cfg.stall_timeout,
            decision_timeout=cfg.decision_timeout,
            promised=early,
        )
        self.wake = asyncio.Event()
        self.flat = torch.empty(0)
        self._flat_is_input = False  # flat is a view of the caller's (single) tensor
        self.result = torch.empty(0)
        # With a codec: (start, end, bytes) of the encoded average, every element once.
        self._encoded: list[tuple[int, int, memoryview]] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.data_bytes_in = 0
        self._handlers: set[asyncio.Task[Any]] = set()
        self._attached: set[tuple[int, int]] = set()
        self._lanes: dict[int, _Lane] = {}
        self._pending = 0  # result lanes to receive + own lanes to reduce, before READY
        self._need: Counter[int] = Counter()  # per peer: pending items that need it
        self._complete = asyncio.Event()
        self._seen_suspects: set[int] = set()
        self._hb_inflight: set[int] = set()
        self._connected: set[int] = set()  # peers we have had a connection to
        self._data_task: asyncio.Task[None] | None = None
        self._vote_task: asyncio.Task[None] | None = None
        self._voting = False  # READY is being sent: the vote task runs to its end
        self._decision_sends: list[Send] = []
        self._crash: BaseException | None = None
        self._mid_rs_done = False
        self._contrib_pending = 0
        self._closed = False
        self._buffers: list[torch.Tensor] = []  # taken from the service's pool
        self._threads = 0  # reductions running in threads (they still use buffers)

    # --- life cycle ---------------------------------------------------------------------------

    async def run(self) -> AllReduceOutcome:
        started = time.monotonic()
        try:
            try:
                await self._prepare()
                await self._hook("start")
                async with asyncio.TaskGroup() as tg:
                    if self.n > 1:
                        self._data_task = tg.create_task(self._data_phase())
                    self._vote_task = tg.create_task(self._vote_when_complete())
                    await self._drive()
                    if self._data_task is not None:
                        self._data_task.cancel()
                    if not self._voting:
                        self._vote_task.cancel()
            except BaseException as e:
                self._abandon()
                if self._crash is None and isinstance(e, BaseExceptionGroup):
                    inner = [x for x in e.exceptions if not isinstance(x, asyncio.CancelledError)]
                    if inner:
                        raise inner[0] from None
                raise
            finally:
                self._close_handlers()
            return await self._conclude(started)
        except BaseException:
            if self._crash is not None:
                raise self._crash from None  # what the fault hook raised, as it raised it
            raise
        finally:
            if self._threads == 0:
                self._pool.keep(self._buffers)

    def _take(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self._pool.take(n, dtype)
        self._buffers.append(t)
        return t

    def _take_bytes(self, n: int) -> memoryview:
        return memoryview(self._take(n, torch.uint8).numpy())

    async def _conclude(self, started: float) -> AllReduceOutcome:
        decision = self.state.decision
        assert decision is not None
        log.debug("%s: decided %s", self.names[self.me], decision)
        if decision.commit:
            await self._hook("before_apply")
            await self._apply()
        failed = tuple(self.peers[j] for j in sorted(decision.failed) if j != self.me)
        if not decision.commit:
            log.info(
                "all-reduce %s aborted on %s: %s",
                self.round_id.hex()[:12],
                self.host.peer_id.short(),
                decision.reason,
            )
        return AllReduceOutcome(
            committed=decision.commit,
            reason=decision.reason,
            group=self.group,
            failed=failed,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            seconds=time.monotonic() - started,
            in_doubt=decision.in_doubt,
        )

    async def _prepare(self) -> None:
        # The lanes first: other members may stream into our part as soon as the round
        # is registered, and flattening a large input below awaits a thread.
        if self.n > 1:
            self._plan_transfers()
        ts = self.tensors
        n_elements = self.plan.n_elements
        if len(ts) == 1 and ts[0].dtype == torch.float32 and ts[0].is_contiguous():
            # Sent straight from the caller's storage, which must not change meanwhile.
            self.flat = ts[0].detach().view(-1)
            self._flat_is_input = True
        else:
            self.flat = self._take(n_elements)
            if n_elements > 1 << 20:
                self._threads += 1
                try:
                    await asyncio.to_thread(_flatten, ts, self.flat)
                finally:
                    self._threads -= 1
            else:
                _flatten(ts, self.flat)
        if self.n == 1:
            self.result = self.flat  # the average of one input
            self._complete.set()
            return
        if self.raw or not self._flat_is_input:
            self.result = self._take(n_elements)
        if self._pending == 0:
            self._complete.set()

    def _plan_transfers(self) -> None:
        """What we must receive before READY: every lane of every other part's result,
        and every lane of our own part reduced (which needs everyone's contribution)."""
        for j in range(self.n):
            if j == self.me:
                continue
            for span in self.plan.lanes(j):
                if span[1] > span[0]:
                    self._pending += 1
                    self._need[j] += 1
        senders = [i for i in range(self.n) if i != self.me]
        for lane, span in enumerate(self.plan.lanes(self.me)):
            if span[1] > span[0]:
                self._lanes[lane] = _Lane(self, lane, span, senders)
                self._pending += 1
                for i in senders:
                    self._need[i] += 1

    def _abandon(self) -> None:
        """run() ends without a decision (cancelled, crashed): say so to whoever asks."""
        self._closed = True
        for task in (self._data_task, self._vote_task):
            if task is not None:
                task.cancel()
        st = self.state
        if st.decision is None and st.vote != READY:
            st.fail(f"member {self.names[self.me]} left the round", (), time.monotonic())

    def _close_handlers(self) -> None:
        self._closed = True
        for task in list(self._handlers):
            task.cancel()

    def abort(self, reason: str) -> None:
        """The service is closing: veto (no-op once READY) and stop."""
        self.state.fail(reason, (), time.monotonic())
        self.wake.set()

    async def _hook(self, point: str) -> None:
        hook = self.cfg.fault_hook
        if hook is None:
            return
        try:
            await hook(point)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if self._crash is None:
                self._crash = e
            raise _Crash(point) from e

    # --- the decision driver ------------------------------------------------------------------

    async def _drive(self) -> None:
        st = self.state
        while True:
            self.wake.clear()
            now = time.monotonic()
            st.tick(now)
            self._react(now)
            if st.decision is not None:
                await self._finish_broadcast()
                return
            self._flush()
            delay = st.next_deadline() - time.monotonic()
            try:
                async with asyncio.timeout(max(delay, 0.001)):
                    await self.wake.wait()
            except TimeoutError:
                pass

    def _react(self, now: float) -> None:
        st = self.state
        for j, why in list(st.suspected.items()):
            if j in self._seen_suspects:
                continue
            self._seen_suspects.add(j)
            if not self._complete.is_set() and self._need[j] > 0:
                st.fail(f"member {self.names[j]} {why}", (j,), now)
        if st.abort_known or st.decision is not None:
            if self._data_task is not None:
                self._data_task.cancel()
            self._close_handlers()

    def _flush(self) -> list[asyncio.Task[None]]:
        """Send what the state machine queued; returns the sends worth waiting for."""
        waited = []
        for s in self.state.take_messages():
            if s.kind == "decision":
                self._decision_sends.append(s)  # the driver delivers these itself
                continue
            if s.kind == "heartbeat":
                if s.dest in self._hb_inflight:
                    continue
                self._hb_inflight.add(s.dest)
            task = self._spawn(self._send(s))
            if s.kind == "vote":
                waited.append(task)
        return waited

    async def _finish_broadcast(self) -> None:
        self._flush()
        decision, self._decision_sends = self._decision_sends, []
        if not decision:
            return
        # The decider waits until its decision is delivered (or the target found dead):
        # a decider that returned and exited at once could leave everyone in doubt.
        if self.cfg.fault_hook is None or len(decision) < 2:
            await asyncio.wait([self._spawn(self._send(s)) for s in decision])
            return
        half = len(decision) // 2
        await asyncio.wait([self._spawn(self._send(s)) for s in decision[:half]])
        await self._hook("decider_mid_broadcast")
        await asyncio.wait([self._spawn(self._send(s)) for s in decision[half:]])

    async def _send(self, s: Send) -> None:
        peer = self.peers[s.dest]
        payload = [self.round_id, s.message]
        reply: Any = None
        try:
            if s.kind in ("decision", "relay") and self.state.knows_decided(s.dest):
                return  # it told us it has decided (relays cross on the wire)
            async with asyncio.timeout(self.cfg.decision_timeout):
                await self._connect(s.dest)
                reply = await rpc.call(
                    self.host, peer, self.cfg.protocol, "m", payload, timeout=None
                )
        except TimeoutError:
            why = f"stalled (no answer within {self.cfg.decision_timeout:.1f}s)"
            self.state.suspect(s.dest, why, time.monotonic())
            return
        except RemoteError as e:
            log.debug("%s refused a control message: %s", peer.short(), e)
            return
        except (TransportError, OSError) as e:
            self.state.suspect(s.dest, f"failed: {_describe(e)}", time.monotonic())
            return
        finally:
            if s.kind == "heartbeat":
                self._hb_inflight.discard(s.dest)
            self.wake.set()
        self.bytes_sent += 48 + len(str(s.message))
        status: Status | None = None
        if reply is not None:
            try:
                kind, status = parse_message(reply, self.n)
            except ValueError as e:
                log.debug("bad control reply from %s: %s", peer.short(), e)
                return
            if kind != "S":
                return
        self.state.on_reply(s.dest, status, time.monotonic(), s.kind)

    def on_control(self, peer: PeerID, msg: object) -> Any:
        src = self.index.get(peer)
        if src is None or src == self.me:
            raise NotAMember(f"{peer.short()} is not a member of round {self.round_id.hex()[:12]}")
        try:
            kind, body = parse_message(msg, self.n)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        self.bytes_received += 48 + len(str(msg))
        reply = self.state.on_message(src, kind, body, time.monotonic())
        self.wake.set()
        return reply

    def peer_lost(self, peer: PeerID, reason: str) -> None:
        j = self.index.get(peer)
        if j is not None and j != self.me:
            self.state.suspect(j, f"failed: {reason}", time.monotonic())
            self.wake.set()

    async def _connect(self, j: int) -> None:
        peer = self.peers[j]
        if self.host.connection(peer) is None:
            # Both sides of a pair reach for a connection at the start of a round. The
            # host keeps the connection dialed by the smaller peer ID and closes the
            # other once its streams end (or after its close grace, killing them), so
            # the larger ID first gives the smaller one a moment to dial. Not later: a
            # connection that went away means the peer left, and a dial says so fast.
            if j not in self._connected and self.host.peer_id > peer:
                await self._wait_connection(peer, _DIAL_WAIT)
            if self.host.connection(peer) is None:
                addrs = self.group.members[j].addrs
                await self.host.connect(peer, addrs, timeout=self.cfg.stall_timeout)
        self._connected.add(j)

    # --- data phase: our side of each lane ----------------------------------------------------

    async def _data_phase(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for j in range(self.n):
                if j == self.me:
                    continue
                for lane, span in enumerate(self.plan.lanes(j)):
                    if span[1] > span[0]:
                        self._contrib_pending += 1
                        tg.create_task(self._exchange(j, lane, span))
            for lane in self._lanes.values():
                tg.create_task(self._reduce(lane))

    def _done(self, j: int | None) -> None:
        """One pending item finished (`j`: the peer it needed, None: all of them)."""
        if j is None:
            for i in range(self.n):
                if i != self.me:
                    self._need[i] -= 1
        else:
            self._need[j] -= 1
        self._pending -= 1
        if self._pending == 0:
            self._complete.set()

    def _fail(self, reason: str, blame: tuple[int, ...] = ()) -> None:
        now = time.monotonic()
        self.state.fail(reason, blame, now)  # first: the veto carries the reason
        for j in blame:
            self.state.suspect(j, "sent invalid data", now)
        self.wake.set()

    def _progress(self, src: int, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.data_bytes_in += nbytes
        now = time.monotonic()
        self.state.heard(src, now)
        self.state.set_progress(self.data_bytes_in, now)

    async def _exchange(self, j: int, lane: int, span: Span) -> None:
        """Send our contribution to lane `lane` of part j; receive that lane's result."""
        header = {"r": self.round_id, "l": lane, "w": self.weight, "p": self.digest}
        try:
            await self._connect(j)
            async with (
                rpc.open_call(
                    self.host, self.peers[j], self.cfg.protocol, "d", header, timeout=None
                ) as call,
                asyncio.TaskGroup() as tg,
            ):
                tg.create_task(self._send_contribution(call.stream, span))
                tg.create_task(self._receive_result(j, call.stream, span))
        except BaseExceptionGroup as eg:
            self._data_error(j, _first(eg))
        except (TransportError, OSError, CodecError, _Veto) as e:
            self._data_error(j, e)

    async def _send_contribution(self, stream: Stream, span: Span) -> None:
        chunks = self.plan.chunks(span) if self.weight > 0 else []
        staging = None
        if not self.raw and chunks:
            staging = self._take_bytes(self.codec.encoded_size(self.plan.chunk_elements))
        for c, (a, b) in enumerate(chunks):
            if staging is None:
                payload = _bytes_of(self.flat[a:b])
            else:
                payload = staging[: self.codec.encoded_size(b - a)]
                try:
                    self.codec.encode(self.flat[a:b], payload)
                except CodecError as e:
                    raise _Veto(f"codec error: {e}") from None
            sent = await _write_chunk(stream, c, payload)
            self.bytes_sent += sent
            if not self._mid_rs_done:
                self._mid_rs_done = True
                await self._hook("mid_reduce_scatter")
        await stream.close()
        self._contrib_pending -= 1
        if self._contrib_pending == 0:
            await self._hook("after_reduce_scatter")

    async def _receive_result(self, j: int, stream: Stream, span: Span) -> None:
        chunks = self.plan.chunks(span)
        encoded = None if self.raw else self._encoded_buffers(chunks)
        stream.reserve(self._wire_bytes(chunks))  # it all has a place to go already
        for c, (a, b) in enumerate(chunks):
            if encoded is None:
                self._progress(j, await _read_chunk(stream, c, _bytes_of(self.result[a:b])))
                continue
            self._progress(j, await _read_chunk(stream, c, encoded[c]))
            try:
                self.codec.check(encoded[c], b - a)  # decoded on commit
            except CodecError as e:
                raise _Veto(f"codec error in part {j} from {self.names[j]}: {e}", (j,)) from None
            self._encoded.append((a, b, encoded[c]))
        self._done(j)

    def _wire_bytes(self, chunks: list[Span]) -> int:
        return sum(_CHUNK.size + self.codec.encoded_size(b - a) for a, b in chunks)

    def _encoded_buffers(self, chunks: list[Span]) -> list[memoryview]:
        """One buffer for the encoded chunks of a lane, cut into one view per chunk."""
        sizes = [self.codec.encoded_size(b - a) for a, b in chunks]
        buf = self._take_bytes(sum(sizes))
        views = []
        offset = 0
        for size in sizes:
            views.append(buf[offset : offset + size])
            offset += size
        return views

    def _data_error(self, j: int, e: BaseException) -> None:
        """Turn a failed transfer with member j into suspicion and/or a veto."""
        name = self.names[j]
        if isinstance(e, _Crash | asyncio.CancelledError):
            raise e
        if isinstance(e, _Veto):
            self._fail(e.reason, e.blame)
        elif isinstance(e, ProtocolNotSupported):
            self._fail(f"member {name} does not serve all-reduce", (j,))
        elif isinstance(e, StreamReset):
            self._fail(f"member {name} stopped the transfer ({e.reason})")
        elif isinstance(e, ConnectionLost | DialError | OSError):
            self.peer_lost(self.peers[j], _describe(e))
        elif isinstance(e, RemoteError):
            if e.kind == "UnknownRound":
                self._fail(f"member {name} did not start the round", (j,))
            elif e.kind == "RoundOver":
                self._fail(f"member {name} already left the round")
            else:
                self._fail(f"member {name} refused our data: {e.message}")
        elif isinstance(e, ProtocolViolation | CodecError):
            self._fail(f"member {name} sent invalid data: {e}", (j,))
        elif isinstance(e, TransportError):
            self.peer_lost(self.peers[j], _describe(e))
        else:
            raise e

    # --- data phase: owner side ---------------------------------------------------------------

    async def serve_lane(self, ctx: CallContext, header: dict[str, Any]) -> None:
        """A member's stream into one lane of our part (runs in the host's handler task)."""
        sender = self.index.get(ctx.peer)
        if sender is None or sender == self.me:
            raise NotAMember(
                f"{ctx.peer.short()} is not a member of round {self.round_id.hex()[:12]}"
            )
        name = self.names[sender]
        if self._closed or self.state.abort_known or self.state.decision is not None:
            raise RoundOver(f"round {self.round_id.hex()[:12]} is over here")
        lane_index, weight, digest = header.get("l"), header.get("w"), header.get("p")
        problem = None
        if digest != self.digest:
            problem = "plan mismatch (different tensor sizes, bandwidths, codec or chunking)"
        elif isinstance(weight, bool) or not isinstance(weight, int | float):
            problem = f"weight {weight!r} is not a number"
        elif not math.isfinite(weight) or weight < 0:
            problem = f"weight {weight!r} is not a finite number >= 0"
        elif (
            isinstance(lane_index, bool)
            or not isinstance(lane_index, int)
            or lane_index not in self._lanes
        ):
            problem = f"lane {lane_index!r} does not exist"
        elif (sender, lane_index) in self._attached:
            problem = f"second stream for lane {lane_index}"
        if problem is not None:
            self._fail(f"member {name} sent a bad request: {problem}", (sender,))
            raise BadRequest(problem)
        assert isinstance(lane_index, int) and isinstance(weight, int | float)
        lane = self._lanes[lane_index]
        self._attached.add((sender, lane_index))
        known = lane.weights.setdefault(sender, float(weight))
        if known != float(weight):
            self._fail(f"member {name} sent two different weights", (sender,))
            raise BadRequest("inconsistent weight")
        if weight > 0:
            # Uncompressed, a slot is a float32 chunk; with a codec, the encoded bytes
            # (checked on arrival, decoded straight into the sum).
            count = min(self.window, len(lane.chunks))
            if self.raw:
                slots: list[Any] = [self._take(self.plan.chunk_elements) for _ in range(count)]
            else:
                size = self.codec.encoded_size(self.plan.chunk_elements)
                slots = [self._take_bytes(size) for _ in range(count)]
            lane.slots[sender] = slots
            # As many chunks in flight as we have slots for, from the start: the sender
            # need not wait for the flow-control window to grow.
            ctx.stream.reserve(self._wire_bytes(lane.chunks[: len(slots)]))
        lane.attached.advance(lane.attached.value + 1)
        self.state.heard(sender, time.monotonic())
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._receive_contribution(ctx.stream, sender, lane))
                tg.create_task(self._send_result(ctx.stream, sender, lane))
        except BaseExceptionGroup as eg:
            e = _first(eg)
            if isinstance(e, asyncio.CancelledError):
                raise e from None
            self._owner_error(sender, e)
            raise AllReduceError(str(e)) from None
        finally:
            self._handlers.discard(task)

    def _owner_error(self, sender: int, e: BaseException) -> None:
        name = self.names[sender]
        if isinstance(e, _Veto):
            self._fail(e.reason, e.blame)
        elif isinstance(e, StreamReset):
            # The sender gave up (its own veto tells why); a reset of our result stream
            # by a receiver that gave up concerns only the receiver.
            if self._need[sender] > 0 and not self._complete.is_set():
                self._fail(f"member {name} stopped the transfer ({e.reason})")
        elif isinstance(e, ConnectionLost):
            self.peer_lost(self.peers[sender], _describe(e))
        elif isinstance(e, ProtocolViolation | CodecError | RemoteError):
            self._fail(f"member {name} sent invalid data: {e}", (sender,))
        elif isinstance(e, TransportError):
            self.peer_lost(self.peers[sender], _describe(e))
        else:
            raise e

    async def _receive_contribution(self, stream: Stream, sender: int, lane: _Lane) -> None:
        slots = lane.slots.get(sender)
        counter = lane.received[sender]
        if slots is not None:
            window = len(slots)
            for c, (a, b) in enumerate(lane.chunks):
                await lane.reduced.wait(c - window + 1)  # its slot is free again
                if self.raw:
                    into = _bytes_of(slots[c % window][: b - a])
                    self._progress(sender, await _read_chunk(stream, c, into))
                else:
                    into = slots[c % window][: self.codec.encoded_size(b - a)]
                    self._progress(sender, await _read_chunk(stream, c, into))
                    try:
                        self.codec.check(into, b - a)
                    except CodecError as e:
                        raise _Veto(
                            f"codec error in the contribution of {self.names[sender]}: {e}",
                            (sender,),
                        ) from None
                counter.advance(c + 1)
        counter.advance(len(lane.chunks))

    async def _send_result(self, stream: Stream, receiver: int, lane: _Lane) -> None:
        for c, (a, b) in enumerate(lane.chunks):
            await lane.reduced.wait(c + 1)
            payload = _bytes_of(self.result[a:b]) if self.raw else lane.encoded[c]
            sent = await _write_chunk(stream, c, payload)
            self.bytes_sent += sent

    async def _reduce(self, lane: _Lane) -> None:
        try:
            await self._reduce_lane(lane)
        except _Veto as e:
            self._fail(e.reason, e.blame)
            return
        self._done(None)

    async def _reduce_lane(self, lane: _Lane) -> None:
        await lane.attached.wait(len(lane.senders))
        weights = {**lane.weights, self.me: float(self.weight)}
        total = math.fsum(weights[i] for i in range(self.n))
        if total <= 0:
            raise _Veto("the total weight of the group is zero")
        order = [(i, weights[i] / total) for i in range(self.n) if weights[i] > 0]
        if self.raw:
            acc_full = self._take(min(self.plan.chunk_elements, _REDUCE_PIECE), torch.float64)
        else:
            lane.encoded = self._encoded_buffers(lane.chunks)
            scratch = self._take(self.plan.chunk_elements)  # the sum, before encoding
        for c, (a, b) in enumerate(lane.chunks):
            for i, _ in order:
                if i != self.me:
                    await lane.received[i].wait(c + 1)
            inputs = [(self._input(lane, i, c, a, b), w) for i, w in order]
            if self.raw:
                args = (inputs, acc_full, self.result[a:b], None)
            else:
                args = (inputs, None, scratch[: b - a], lane.encoded[c])
            if len(order) * (b - a) >= _THREAD_WORK:
                self._threads += 1
                try:
                    await asyncio.to_thread(self._reduce_chunk, *args)
                finally:
                    self._threads -= 1
            else:
                self._reduce_chunk(*args)
            if not self.raw:
                self._encoded.append((a, b, lane.encoded[c]))
            lane.reduced.advance(c + 1)
            await asyncio.sleep(0)  # let the streams move between chunks

    def _input(self, lane: _Lane, i: int, c: int, a: int, b: int) -> torch.Tensor | memoryview:
        """Member i's contribution to chunk c of a lane: our own input, or its slot."""
        if i == self.me:
            return self.flat[a:b]
        slots = lane.slots[i]
        slot = slots[c % len(slots)]
        return slot[: b - a] if self.raw else slot[: self.codec.encoded_size(b - a)]

    def _reduce_chunk(
        self,
        inputs: list[tuple[torch.Tensor | memoryview, float]],
        acc: torch.Tensor | None,
        out: torch.Tensor,
        encoded: memoryview | None,
    ) -> None:
        # Member order, always. Uncompressed: float64 accumulation and one rounding to
        # float32 (the error stays near half an ulp of the mean). A lossy codec's error
        # dwarfs float32 rounding, so there the sum is built in `out` directly (cheaper)
        # and encoded; like everyone else, we decode those bytes on commit. Only we
        # compute this sum, so how it rounds needs only to be deterministic.
        first, w = inputs[0]
        if acc is not None:
            # A piece at a time: float64 temporaries the size of a whole chunk would not
            # stay in cache (and the casts allocate them).
            step = len(acc)
            for start in range(0, len(out), step):
                stop = min(start + step, len(out))
                part = acc[: stop - start]
                part.copy_(first[start:stop])
                if w != 1.0:
                    part.mul_(w)
                for x, wx in inputs[1:]:
                    part.add_(x[start:stop], alpha=wx)
                out[start:stop].copy_(part)
            return
        # With a codec: other members' inputs are checked encoded bytes, decoded
        # straight into the sum (one pass each; the codec's own loops where it has them).
        for k, (x, wx) in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                self.codec.add_plain(x, out, wx, overwrite=k == 0)
            else:
                self.codec.add_decoded(x, out, wx, overwrite=k == 0)
        assert encoded is not None
        try:
            self.codec.encode(out, encoded)
        except CodecError as e:
            raise _Veto(f"codec error: {e}") from None

    # --- READY and commit ---------------------------------------------------------------------

    async def _vote_when_complete(self) -> None:
        await self._complete.wait()
        log.debug("%s: data phase complete", self.names[self.me])
        if self.state.abort_known or self.state.decision is not None:
            return
        await self._hook("before_ready")
        self.state.ready(time.monotonic())
        self.wake.set()
        if self.cfg.fault_hook is not None:
            # Tests: "after_ready" means the READY vote was delivered; run() lets this
            # task finish even when the decision comes first.
            self._voting = True
            sends = self._flush()
            if sends:
                await asyncio.wait(sends)
            await self._hook("after_ready")

    async def _apply(self) -> None:
        if self.n == 1:
            return  # a group of one: the average is our own input
        if self.plan.n_elements <= 1 << 20:
            self._write_out()
            return
        # A thread cannot be interrupted: if we are cancelled meanwhile, the copy still
        # finishes before the cancellation goes on, so the tensors are never half-written.
        job = asyncio.ensure_future(asyncio.to_thread(self._write_out))
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            await job
            raise

    def _write_out(self) -> None:
        """Put the committed average into the caller's tensors."""
        with torch.no_grad():
            if not self.raw:
                # Checked on arrival (or made here), so decoding cannot fail now.
                into = self.flat if self._flat_is_input else self.result
                for a, b, data in self._encoded:
                    self.codec.decode_checked(data, into[a:b])
                if self._flat_is_input:
                    return
            _copy_out(self.result, self.tensors)


def _flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n


def _copy_out(result: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(result[offset : offset + n].view(t.shape))
            offset += n


def _first(eg: BaseExceptionGroup) -> BaseException:
    """The most telling exception of a group: a crash, else not a cancellation."""
    flat: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            flat.append(e)

    walk(eg)
    preference = (
        (_Crash,),
        (_Veto, RemoteError, ProtocolViolation, CodecError),
        (ConnectionLost,),
        (Exception,),
    )
    for kinds in preference:
        for e in flat:
            if isinstance(e, kinds):
                return e
    return flat[0]


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "…"
