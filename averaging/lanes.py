"""The data plane of one all-reduce round: our side of every lane.

Between every ordered pair of members (i, j) there are ``streams_per_peer``
lanes. On each, member i sends its slice of part j (its *contribution*, in
chunks, encoded with the round's codec) and owner j answers on the same stream
with the reduced chunks as soon as each is final. `DataPlane` runs both sides
for this member: `run` drives our contributions to the other parts and
receives their results; `serve_lane` runs in the RPC handler of another
member's stream into our part. What can be reduced, and in which order, is
`reducer.LaneReducer`; what a failure means is `round_errors.classify`.

Wire of a lane (RPC method ``d``, a bidirectional stream): the request is
``{"r": round_id, "l": lane, "w": weight, "p": plan digest}``; then the
contribution chunks (`rpc` chunks: index and size are the ones the plan says),
then half-close; the owner answers with the result chunks of that lane.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shoal.transport import rpc
from shoal.transport.identity import PeerID
from shoal.transport.rpc import CallContext

from .attestation import COMPACT_HEADERS_PROTOCOL, ReceivedCommitments, RoundAttestation
from .buffers import RoundBuffers, bytes_of
from .compression import Codec, CodecError
from .lane_sums import LaneSums, OwnLane
from .partition import Plan, Span
from .reducer import LaneReducer, Reduction
from .round_errors import Action, Side, Veto, classify, first_of

__all__ = [
    "AllReduceError",
    "BadRequest",
    "DataPlane",
    "NotAMember",
    "RoundOver",
    "RoundSide",
    "let_go",
]

# Bytes of a received chunk above which its commitment check (SHA-256) runs in a thread.
_HASH_IN_THREAD = 1 << 18
# How long a lane waits for the hello of a member whose connection it did not open (it
# comes with the connection: a round trip); without it, the lane's header is whole.
HELLO_WAIT_S = 2.0


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


class RoundSide(Protocol):
    """What the data plane needs from the round that drives it."""

    def fail(self, reason: str, blame: tuple[int, ...] = ()) -> None: ...
    def suspect(self, j: int, reason: str) -> None: ...
    def heard(self, j: int, nbytes: int) -> None: ...
    def over(self) -> bool: ...
    async def connect(self, j: int) -> None: ...
    async def hook(self, point: str) -> None: ...


@dataclass(frozen=True, slots=True)
class RoundInfo:
    """Who is in the round and what it averages (the same on every member)."""

    round_id: bytes
    me: int
    peers: list[PeerID]
    names: list[str]
    plan: Plan
    digest: bytes
    weight: float
    window: int
    protocol: str
    # The reduction is `owner_written`: contributions to other parts are not sent.
    owner_written: bool = False
    max_weight: float = math.inf  # (`AllReduceConfig.max_weight`)
    caps_weights: bool = False  # (the reduction's `caps_weights`)


class DataPlane:
    """Our contributions out, the other members' contributions in, our part reduced."""

    def __init__(
        self,
        host: Any,
        info: RoundInfo,
        codec: Codec,
        reduction: Reduction,
        buffers: RoundBuffers,
        side: RoundSide,
        received: ReceivedCommitments | None = None,
    ) -> None:
        self.host = host
        self.info = info
        self.codec = codec
        self.raw = codec.name == "none"
        self.reduction = reduction
        self.buffers = buffers
        self.side = side
        self.n = len(info.peers)
        self._index = {p: i for i, p in enumerate(info.peers)}
        self.flat = torch.empty(0)  # our input, set by run()
        self.result = torch.empty(0)  # uncompressed: the whole average
        # With a codec: (start, end, bytes) of the encoded average, every element once.
        self.encoded: list[tuple[int, int, memoryview]] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        # Monotonic time the last data came in: the links' rate is measured up to it
        # (an abort's wait for a silent member says nothing of them).
        self.last_received_at = 0.0
        self.complete = asyncio.Event()  # everything we need before READY is here
        # Planned now: streams into our part may come as soon as the round registered.
        # Pending: result lanes to receive + own lanes to reduce; per peer: those that
        # need it.
        self._pending, self._need, reducers = plan_transfers(info)
        self._lanes = {lane: OwnLane(r) for lane, r in reducers.items()}
        chunk_elements = info.plan.chunk_elements
        self._sums = LaneSums(info.me, chunk_elements, codec, reduction, buffers, self.encoded)
        self._attached: set[tuple[int, int]] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._contrib_pending = 0
        self._mid_rs_done = False
        # Verified rounds: our commitment and proofs (set before run), and the owner's
        # check of what arrives.
        self.attestation: RoundAttestation | None = None
        self.received = received

    def needs(self, j: int) -> bool:
        """Do we still wait for data that needs member j?"""
        return self._need[j] > 0 and not self.complete.is_set()

    def _done(self, j: int | None) -> None:
        """One pending item finished (`j`: the peer it needed, None: all of them)."""
        for i in range(self.n) if j is None else (j,):
            if i != self.info.me:
                self._need[i] -= 1
        self._pending -= 1
        if self._pending == 0:
            self.complete.set()

    def close_handlers(self) -> None:
        for task in list(self._handlers):
            task.cancel()

    def _handle(self, j: int, side: Side, e: BaseException) -> None:
        verdict = classify(e, side, self.info.names[j])
        if verdict.action is Action.RAISE:
            raise e
        if verdict.action is Action.SUSPECT:
            self.side.suspect(j, verdict.reason)
        elif verdict.action is Action.VETO or (
            verdict.action is Action.VETO_IF_NEEDED and self.needs(j)
        ):
            blame = (j,) if verdict.blame else getattr(e, "blame", ())
            self.side.fail(verdict.reason, blame)

    def weights(self) -> dict[int, float]:
        """The members' weights as our lanes received them (member index -> weight;
        every sender attaches to every lane, so any complete lane knows them all)."""
        for lane in self._lanes.values():
            if lane.reducer.attached_all:
                return dict(lane.reducer.weights)
        return {}

    def _wire_bytes(self, chunks: list[Span]) -> int:
        return sum(rpc.CHUNK.size + self.codec.encoded_size(b - a) for a, b in chunks)

    # --- our side of the other members' parts -------------------------------------------------

    async def run(self, flat: torch.Tensor, result: torch.Tensor) -> None:
        """Send our contributions, receive the others' results, reduce our part."""
        self.flat, self.result = flat, result
        self._sums.flat, self._sums.result = flat, result
        if self._pending == 0:
            self.complete.set()
        async with asyncio.TaskGroup() as tg:
            for j in range(self.n):
                if j == self.info.me:
                    continue
                for lane, span in enumerate(self.info.plan.lanes(j)):
                    if span[1] > span[0]:
                        self._contrib_pending += 1
                        tg.create_task(self._exchange(j, lane, span))
            for lane in self._lanes.values():
                tg.create_task(self._reduce(lane))

    async def _exchange(self, j: int, lane: int, span: Span) -> None:
        """Send our contribution to lane `lane` of part j; receive that lane's result."""
        info = self.info
        header = {"r": info.round_id, "l": lane, "w": info.weight, "p": info.digest}
        try:
            await self.side.connect(j)
            if self.attestation is not None:
                compact = await self._reads_compact(info.peers[j])
                header.update(self.attestation.header(
                    j, lane, compact=compact, owner_written=info.owner_written
                ))  # fmt: skip
            async with (
                rpc.open_call(
                    self.host, info.peers[j], info.protocol, "d", header, timeout=None
                ) as call,
                asyncio.TaskGroup() as tg,
            ):
                tg.create_task(self._send_contribution(call, span))
                tg.create_task(self._receive_result(j, call, span))
        except BaseExceptionGroup as eg:
            self._handle(j, Side.SEND, first_of(eg))
        except Exception as e:
            self._handle(j, Side.SEND, e)

    async def _reads_compact(self, peer: PeerID) -> bool:
        """Whether `peer` reads protocol 2.11's compact lane headers: its hello says so
        (waited for a moment on a connection it opened, whose hello may still come;
        unknown, it is sent the whole header, which every version reads)."""
        conn = self.host.connection(peer)
        if conn is not None:
            await self.host.versions.checked(conn, HELLO_WAIT_S)
        hello = self.host.versions.peer_version(peer)
        return hello is not None and hello.protocol >= COMPACT_HEADERS_PROTOCOL

    async def _send_contribution(self, call: rpc.MessageStream, span: Span) -> None:
        plan = self.info.plan
        sends = self.info.weight > 0 and not self.info.owner_written
        chunks = plan.chunks(span) if sends else []
        staging = None
        if not self.raw and chunks:
            staging = self.buffers.take_bytes(self.codec.encoded_size(plan.chunk_elements))
        for c, (a, b) in enumerate(chunks):
            if staging is None:
                payload = bytes_of(self.flat[a:b])
            else:
                payload = staging[: self.codec.encoded_size(b - a)]
                try:
                    self.codec.encode(self.flat[a:b], payload)
                except CodecError as e:
                    raise Veto(f"codec error: {e}") from None
            sent = await call.send_chunk(c, payload)  # (not `+= await`: tasks interleave)
            self.bytes_sent += sent
            if not self._mid_rs_done:
                self._mid_rs_done = True
                await self.side.hook("mid_reduce_scatter")
        await call.stream.close()
        if not self._mid_rs_done:  # nothing to send (weight 0, owner-written): all went out
            self._mid_rs_done = True
            await self.side.hook("mid_reduce_scatter")
        self._contrib_pending -= 1
        if self._contrib_pending == 0:
            await self.side.hook("after_reduce_scatter")

    async def _receive_result(self, j: int, call: rpc.MessageStream, span: Span) -> None:
        chunks = self.info.plan.chunks(span)
        encoded = None
        if not self.raw:
            encoded = self.buffers.split_bytes([self.codec.encoded_size(b - a) for a, b in chunks])
        call.stream.reserve(self._wire_bytes(chunks))  # it all has a place to go already
        for c, (a, b) in enumerate(chunks):
            into = bytes_of(self.result[a:b]) if encoded is None else encoded[c]
            nbytes = await call.recv_chunk_into(c, into)
            self.bytes_received += nbytes
            self.last_received_at = time.monotonic()
            self.side.heard(j, nbytes)
            if encoded is not None:
                try:
                    self.codec.check(encoded[c], b - a)  # decoded on commit
                except CodecError as e:
                    raise Veto(
                        f"codec error in part {j} from {self.info.names[j]}: {e}", (j,)
                    ) from None
                self.encoded.append((a, b, encoded[c]))
        self._done(j)

    # --- the owner's side: our part -----------------------------------------------------------

    def _check_request(self, sender: int, header: dict[str, Any]) -> tuple[OwnLane, float]:
        lane_index, weight = header.get("l"), header.get("w")
        again = isinstance(lane_index, int) and (sender, lane_index) in self._attached
        problem = request_problem(self.info, header, set(self._lanes), again)
        if problem is None and self.received is not None:
            assert isinstance(lane_index, int) and isinstance(weight, int | float)
            problem = self.received.attach(sender, lane_index, header, float(weight))
        if problem is None:
            assert isinstance(lane_index, int) and isinstance(weight, int | float)
            problem = self._lanes[lane_index].reducer.attach(sender, float(weight))
        if problem is not None:
            self.side.fail(
                f"member {self.info.names[sender]} sent a bad request: {problem}", (sender,)
            )
            raise BadRequest(problem)
        assert isinstance(lane_index, int) and isinstance(weight, int | float)
        self._attached.add((sender, lane_index))
        return self._lanes[lane_index], float(weight)

    async def serve_lane(self, ctx: CallContext, header: dict[str, Any]) -> None:
        """A member's stream into one lane of our part (runs in the host's handler task)."""
        info = self.info
        sender = self._index.get(ctx.peer)
        if sender is None or sender == info.me:
            raise NotAMember(
                f"{ctx.peer.short()} is not a member of round {info.round_id.hex()[:12]}"
            )
        if self.side.over():
            raise RoundOver(f"round {info.round_id.hex()[:12]} is over here")
        lane, _ = self._check_request(sender, header)
        if lane.reducer.contributes(sender):
            # Uncompressed, a slot is a float32 chunk; with a codec, the encoded bytes
            # (checked on arrival, decoded straight into the sum).
            count = min(lane.reducer.window, len(lane.reducer.chunks))
            chunk_elements = info.plan.chunk_elements
            if self.raw:
                slots: list[Any] = [self.buffers.take(chunk_elements) for _ in range(count)]
            else:
                size = self.codec.encoded_size(chunk_elements)
                slots = [self.buffers.take_bytes(size) for _ in range(count)]
            lane.slots[sender] = slots
            # As many chunks in flight as we have slots for, from the start: the sender
            # need not wait for the flow-control window to grow.
            ctx.stream.reserve(self._wire_bytes(lane.reducer.chunks[:count]))
        lane.changed.set()
        self.side.heard(sender, 0)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._receive_contribution(ctx, sender, lane))
                tg.create_task(self._send_result(ctx, lane))
        except BaseExceptionGroup as eg:
            e = first_of(eg)
            if isinstance(e, asyncio.CancelledError):
                raise e from None
            self._handle(sender, Side.SERVE, e)
            raise AllReduceError(str(e)) from None
        finally:
            self._handlers.discard(task)

    async def _receive_contribution(self, ctx: CallContext, sender: int, lane: OwnLane) -> None:
        slots = lane.slots.get(sender)
        if slots is None:
            return  # weight 0: it contributes nothing
        reducer = lane.reducer
        for c, (a, b) in enumerate(reducer.chunks):
            await lane.reduced.wait(reducer.slot_free_after(c))
            slot = slots[reducer.slot(c)]
            size = b - a if self.raw else self.codec.encoded_size(b - a)
            into = bytes_of(slot[:size]) if self.raw else slot[:size]
            nbytes = await ctx.recv_chunk_into(c, into)
            self.bytes_received += nbytes
            self.last_received_at = time.monotonic()
            self.side.heard(sender, nbytes)
            if not self.raw:
                try:
                    self.codec.check(into, b - a)
                except CodecError as e:
                    name = self.info.names[sender]
                    raise Veto(
                        f"codec error in the contribution of {name}: {e}", (sender,)
                    ) from None
            if self.received is not None:
                await self._check_committed(sender, lane, c, into)
            reducer.arrived(sender, c)
            lane.changed.set()

    async def _check_committed(
        self, sender: int, lane: OwnLane, c: int, payload: memoryview
    ) -> None:
        """Veto a chunk that is not the one its sender committed to."""
        assert self.received is not None
        index = next(i for i, x in self._lanes.items() if x is lane)
        check = self.received.check_chunk
        if len(payload) >= _HASH_IN_THREAD:
            ok = await self.buffers.in_thread(check, sender, index, c, payload)
        else:
            ok = check(sender, index, c, payload)
        if not ok:
            name = self.info.names[sender]
            raise Veto(f"the contribution of {name} does not match its commitment", (sender,))

    async def _send_result(self, ctx: CallContext, lane: OwnLane) -> None:
        for c, (a, b) in enumerate(lane.reducer.chunks):
            await lane.reduced.wait(c + 1)
            payload = bytes_of(self.result[a:b]) if self.raw else lane.encoded[c]
            sent = await ctx.send_chunk(c, payload)
            self.bytes_sent += sent

    async def _reduce(self, lane: OwnLane) -> None:
        try:
            await self._sums.reduce(lane)
        except Veto as e:
            self.side.fail(e.reason, e.blame)
            return
        self._done(None)


def plan_transfers(info: RoundInfo) -> tuple[int, Counter[int], dict[int, LaneReducer]]:
    """What a member must have before READY: every lane of every other part's result,
    and every lane of its own part reduced (which needs everyone's contribution).
    Returns the number of such items, per member the items that need it, and the
    reducers of the member's own lanes."""
    plan, n = info.plan, len(info.peers)
    pending, need, reducers = 0, Counter[int](), {}
    if n == 1:
        return pending, need, reducers
    for j in range(n):
        if j != info.me:
            for span in plan.lanes(j):
                if span[1] > span[0]:
                    pending += 1
                    need[j] += 1
    senders = [i for i in range(n) if i != info.me]
    for lane, span in enumerate(plan.lanes(info.me)):
        if span[1] > span[0]:
            reducers[lane] = LaneReducer(info.me, plan.chunks(span), senders, info.window,
                                         info.weight, info.owner_written,
                                         info.caps_weights)  # fmt: skip
            pending += 1
            for i in senders:
                need[i] += 1
    return pending, need, reducers


def request_problem(
    info: RoundInfo, header: dict[str, Any], lanes: set[int], second_stream: bool
) -> str | None:
    """What is wrong with a member's request to stream into one lane of our part."""
    lane_index, weight = header.get("l"), header.get("w")
    if header.get("p") != info.digest:
        return "plan mismatch (different tensor sizes, bandwidths, codec or chunking)"
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        return f"weight {weight!r} is not a number"
    if not math.isfinite(weight) or weight < 0:
        return f"weight {weight!r} is not a finite number >= 0"
    if weight > info.max_weight:
        return f"weight {weight!r} is above this round's bound ({info.max_weight:g})"
    if isinstance(lane_index, bool) or not isinstance(lane_index, int) or lane_index not in lanes:
        return f"lane {lane_index!r} does not exist"
    if second_stream:
        return f"second stream for lane {lane_index}"
    return None


def let_go(plane: DataPlane) -> None:
    """(Its round ended.) Drop the data plane's references to the round's input and
    result, its receive slots and encoded chunks (`butterfly._let_go`): the round's
    objects refer to each other, so the garbage collector frees them only at a full
    pass, which may be rounds later. A stage peer so held the slots of two or three
    earlier rounds beside the pool's (16 to 32 MiB over its estimate at 64 M
    parameters, `tests/test_pipeline_memory_swarm.py`)."""
    plane.flat = plane.result = plane._sums.flat = plane._sums.result = torch.empty(0)
    for lane in plane._lanes.values():
        lane.slots.clear()
        lane.encoded.clear()
    plane.encoded.clear()
