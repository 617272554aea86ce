"""One round of butterfly all-reduce: the driver of one member's side.

The flattened float32 vector is cut into one contiguous part per member, sized
by bandwidth (`partition.Plan`); every member owns one part. The round has
three pieces, each readable alone:

- the data plane (`lanes.DataPlane`): our contribution to every other part
  goes out in chunks, each owner answers with its reduced part chunk by chunk,
  so reduce-scatter and all-gather overlap and the reduction overlaps
  receiving; the chunks travel with `rpc`'s chunk API, straight from and into
  posted buffers;
- the reduction (`reducer`): which chunk of our part is complete, in member
  order, and the pluggable `Reduction` that averages it (a weighted mean, or
  CenteredClip);
- the decision (`commit.CommitProtocol`, sans-I/O): READY votes, heartbeats,
  suspicion and the decider's commit-or-abort. `ButterflyRound` drives it.

Bit-identical results. Owner j alone computes part j, in member order
(uncompressed: float64 rounded once to float32). It encodes the result once
and sends the same bytes to everyone, itself included, who decode them with
the same pure function. The result does not depend on timing at all.

Nothing is written to the caller's tensors before the round commits.
Uncompressed results go to a separate buffer, copied in on commit; encoded
results are checked as they arrive and decoded on commit straight into the
caller's tensor (or, for several tensors, into the buffer then copied out).
A caller that passes one contiguous float32 tensor (`host_state`'s flat buffer
of deltas) is sent from its own storage and written in place: no flattening.

Failures mean one thing wherever they happen (`round_errors.classify`). The
fault hook (tests) is called at the same points of the same code on every
run; without one it returns at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.transport import rpc
from shoal.transport.errors import ClosedAtOnce, RemoteError, TransportError
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.rpc import CallContext
from shoal.transport.version import ProtocolVersion
from shoal.verification.commitment import Commitment

from .attestation import (
    Attestor,
    ReceivedCommitments,
    RoundAttestation,
    chunk_leaves,
    owner_written_problem,
)
from .buffers import BufferPool, RoundBuffers
from .commit import (
    READY,
    CommitProtocol,
    Decision,
    Send,
    Status,
    learned_decision,
    parse_message,
    without_results,
)
from .compression import Codec
from .group import Group
from .lanes import (
    AllReduceError,
    BadRequest,
    DataPlane,
    NotAMember,
    RoundInfo,
    RoundOver,
    UnknownRound,
    let_go,
)
from .partition import Plan
from .reducer import ALL_REDUCTIONS, make_reduction
from .result_digest import result_digests
from .round_errors import Action, Crash, Side, classify, describe

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
    "decider_mid_broadcast",  # as decider: half of the members have the decision
    "before_apply",  # the round committed, our tensors not yet written
)

_SLOT_BUDGET = 64 * 1024 * 1024  # bytes of receive slots per round, at most (window >= 2)
_DIAL_WAIT = 1.0  # the larger peer ID waits this long for the smaller one to dial
_REDIAL_PAUSE = 0.25  # before a second dial of a member that closed the first at once
_IN_THREAD = 1 << 20  # elements above which flattening and writing out run in a thread


@dataclass
class AllReduceConfig:
    """Settings of an `AllReduceService` (members of a group should agree on the
    chunking, codec, reduction and streams: a mismatch fails the round as a plan
    mismatch)."""

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
    # How an owner reduces its part (reducer.REDUCTIONS): "mean" or "centered_clip".
    reduction: str = "mean"
    # The most weight a member may contribute with: a claim of the sender, bounded
    # where its meaning bounds it (a Moshpit grid's masses: `moshpit.MAX_MASS`).
    max_weight: float = math.inf
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
        if not self.max_weight > 0:
            raise ValueError("max_weight must be > 0")
        if self.reduction not in ALL_REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(ALL_REDUCTIONS)}")


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
    # From the start to the last data received: what the links' rate is measured over
    # (not an abort's wait for a member that went silent).
    busy_seconds: float = 0.0
    # After an abort: the other members we had not heard from for a while, `failed` or
    # not (`CommitProtocol.quiet`). A retry with them would likely wait out another stall.
    quiet: tuple[PeerID, ...] = ()
    # After an abort, whom the retry leaves out as this member judges the blame
    # (`votes.Blame`): those certain, and those blamed on one member's word alone
    # (blamed member -> its blamer, if we heard one), for the driver to ask itself.
    left_out: tuple[PeerID, ...] = ()
    contested: dict[PeerID, tuple[PeerID, ...]] = field(default_factory=dict)
    # Not committed here, but others may have committed: this member voted READY and
    # never learned the decision, not even by asking the others after giving up. Its
    # tensors are untouched; its input may be in their result, so it must not offer
    # that input again (nor assume it holds the group's state).
    in_doubt: bool = False
    # With an attestor: the commitments we received with contributions, and ours.
    commitments: dict[PeerID, Commitment] = field(default_factory=dict)
    # After a commit: the weight each member contributed with (as our part received them).
    weights: dict[PeerID, float] = field(default_factory=dict)


# The protocol whose READY statuses carry the parts' result digests (`Status.results`).
RESULTS_PROTOCOL = ProtocolVersion(2, 5)


def for_peer(host: Host, peer: PeerID, message: Any) -> Any:
    """A control message as `peer` can read it: a 2.4 peer refuses a status with the
    result digests (a 10th field), so it gets the 9 it knows (unknown: the same)."""
    hello = host.versions.peer_version(peer)
    return message if hello is not None and hello.protocol >= RESULTS_PROTOCOL else (
        without_results(message)
    )  # fmt: skip


def _round_info(host: Host, cfg: AllReduceConfig, group: Group, n_elements: int, codec: Codec,
                weight: float, attested: bool) -> RoundInfo:  # fmt: skip
    peers = group.peer_ids
    reduction = ALL_REDUCTIONS[cfg.reduction]
    owner_written = reduction.owner_written
    if owner_written and n_elements % group.size:
        raise ValueError(f"{cfg.reduction}: {n_elements} elements are not one part per member")
    plan = Plan.build(
        n_elements,
        # Owner-written rounds: part j is member j's slot, whatever the bandwidths.
        [1.0] * group.size if owner_written else [m.bandwidth for m in group.members],
        streams=cfg.streams_per_peer,
        chunk_elements=max(1, cfg.chunk_bytes // 4),
    )
    extra = b"" if cfg.reduction == "mean" else cfg.reduction.encode()
    if attested:  # members that check commitments never average with ones that do not
        extra += b"/attested"
    digest = plan.digest(group.round_id, [p.to_bytes() for p in peers], codec.code, extra)
    per_slot = plan.chunk_elements * 4 * max(1, (group.size - 1) * cfg.streams_per_peer)
    window = max(2, min(cfg.window_chunks, _SLOT_BUDGET // per_slot))
    return RoundInfo(group.round_id, group.index(host.peer_id), peers,
                     [p.short() for p in peers], plan, digest, weight, window,
                     cfg.protocol, owner_written, cfg.max_weight,
                     reduction.caps_weights)  # fmt: skip


class ButterflyRound:
    """One member's side of one round: drives its data plane and its decision.

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
        attestor: Attestor | None = None,
    ) -> None:
        self.cfg = cfg = config
        self.host = host
        self.group = group
        self.round_id = group.round_id
        self.tensors = tensors
        self.codec = codec
        self.n = group.size
        self.me = group.index(host.peer_id)
        self.peers = group.peer_ids
        self.index = {p: i for i, p in enumerate(self.peers)}
        self.names = [p.short() for p in self.peers]
        n_elements = sum(t.numel() for t in tensors)
        info = _round_info(host, cfg, group, n_elements, codec, weight, attestor is not None)
        self.plan = info.plan
        self.owner_written = info.owner_written
        self.attestor = attestor
        self.weight = weight
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
        self.link = ControlLink(host, cfg, group, self.state, spawn, wait_connection, self.wake)
        self._buffers = RoundBuffers(pool)
        # Planned now: other members may stream into our part as soon as we registered.
        received = (
            None
            if attestor is None
            else ReceivedCommitments(
                attestor, group, self.plan, self.me, owner_written=info.owner_written
            )
        )
        self.data = DataPlane(
            host, info, codec, make_reduction(cfg.reduction), self._buffers, self, received
        )
        self.io = RoundTensors(tensors, self.plan.n_elements, codec, self._buffers)
        self.control_received = 0
        self.data_bytes_in = 0
        self._seen_suspects: set[int] = set()
        self._data_task: asyncio.Task[None] | None = None
        self._vote_task: asyncio.Task[None] | None = None
        self._voting = False  # READY is being delivered: run() lets the vote task finish
        self._crash: BaseException | None = None
        self._closed = False

    # --- life cycle ---------------------------------------------------------------------------

    async def run(self) -> AllReduceOutcome:
        started = time.monotonic()
        try:
            try:
                await self.io.prepare(single=self.n == 1)
                await self._attest()
                if self.n == 1:
                    self.data.complete.set()  # a group of one: the average is our input
                await self.hook("start")
                async with asyncio.TaskGroup() as tg:
                    if self.n > 1:
                        self._data_task = tg.create_task(
                            self.data.run(self.io.flat, self.io.result)
                        )
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
            self._buffers.give_back()
            _let_go(self)

    async def _attest(self) -> None:
        """Sign our commitment to what we send, in a thread: the leaves are hashed there
        and so is the attestor's commitment (a verifier's seals the work log: a copy and
        a hash of the whole model and its optimizer, seconds at real sizes, which on the
        event loop would hold every heartbeat and /status that long). A thread cannot
        be interrupted: a cancelled round still waits for it, so nothing changes the
        model (the trainer's next step, a reset) while the attestor reads it."""
        if self.attestor is None or self.n == 1 or not self.weight > 0:
            return
        job = asyncio.ensure_future(self._buffers.in_thread(self._attestation))
        try:
            self.data.attestation = await asyncio.shield(job)
        except asyncio.CancelledError:
            await asyncio.wait({job})
            raise

    def _attestation(self) -> RoundAttestation:
        assert self.attestor is not None
        leaves = chunk_leaves(self.plan, self.io.flat, self.codec)
        return RoundAttestation.make(self.attestor, self.group, self.plan, leaves, self.weight)

    def _commitments(self) -> dict[PeerID, Commitment]:
        received = self.data.received
        if received is None:
            return {}
        out = dict(received.by_member)
        if self.data.attestation is not None:
            out[self.host.peer_id] = self.data.attestation.commitment
        return out

    async def _conclude(self, started: float) -> AllReduceOutcome:
        decision = self.state.decision
        assert decision is not None
        if decision.in_doubt:
            decision = await self.link.learn(decision)
        log.debug("%s: decided %s", self.names[self.me], decision)
        if decision.commit:
            await self.hook("before_apply")
            if self.n > 1:
                await self.io.apply(self.data.encoded)
        failed = tuple(self.peers[j] for j in sorted(decision.failed) if j != self.me)
        now = time.monotonic()
        quiet_ids = () if decision.commit else self.state.quiet(now)
        quiet = tuple(self.peers[j] for j in quiet_ids)
        left_out: tuple[PeerID, ...] = ()
        contested: dict[PeerID, tuple[PeerID, ...]] = {}
        if not decision.commit:
            ours = set(self.state.suspected) | set(quiet_ids)
            blame = self.state.votes.blame(self.me, ours, decision.failed)
            left_out = tuple(self.peers[j] for j in sorted(blame.certain))
            contested = {
                self.peers[j]: tuple(self.peers[v] for v in sorted(by))
                for j, by in sorted(blame.contested.items())
            }
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
            bytes_sent=self.data.bytes_sent + self.link.control_sent,
            bytes_received=self.data.bytes_received + self.control_received,
            seconds=now - started,
            busy_seconds=max(0.0, self.data.last_received_at - started) or now - started,
            quiet=quiet,
            left_out=left_out,
            contested=contested,
            in_doubt=decision.in_doubt,
            commitments=self._commitments(),
            weights=self._weights() if decision.commit else {},
        )

    def _weights(self) -> dict[PeerID, float]:
        if self.n == 1:
            return {self.host.peer_id: self.weight}
        return {self.peers[j]: w for j, w in self.data.weights().items()}

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
        self.data.close_handlers()

    def abort(self, reason: str) -> None:
        """The service is closing: veto (no-op once READY) and stop."""
        self.state.fail(reason, (), time.monotonic())
        self.wake.set()

    # --- what the data plane reports (lanes.RoundSide) ----------------------------------------

    async def hook(self, point: str) -> None:
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
            raise Crash(point) from e

    def fail(self, reason: str, blame: tuple[int, ...] = ()) -> None:
        now = time.monotonic()
        self.state.fail(reason, blame, now)  # first: the veto carries the reason
        for j in blame:
            self.state.suspect(j, "sent invalid data", now)
        self.wake.set()

    def suspect(self, j: int, reason: str) -> None:
        if j != self.me:
            self.state.suspect(j, reason, time.monotonic())
            self.wake.set()

    def heard(self, j: int, nbytes: int) -> None:
        now = time.monotonic()
        self.state.heard(j, now)
        if nbytes:
            self.data_bytes_in += nbytes
            self.state.set_progress(self.data_bytes_in, now)

    def over(self) -> bool:
        st = self.state
        return self._closed or st.abort_known or st.decision is not None

    async def connect(self, j: int) -> None:
        await self.link.connect(j)

    # --- routed here by the service -----------------------------------------------------------

    async def serve_lane(self, ctx: CallContext, header: dict[str, Any]) -> None:
        await self.data.serve_lane(ctx, header)

    def on_control(self, peer: PeerID, msg: object) -> Any:
        src = self.index.get(peer)
        if src is None or src == self.me:
            raise NotAMember(f"{peer.short()} is not a member of round {self.round_id.hex()[:12]}")
        try:
            kind, body = parse_message(msg, self.n)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        self.control_received += 48 + len(str(msg))
        reply = self.state.on_message(src, kind, body, time.monotonic())
        self.wake.set()
        return reply

    def peer_lost(self, peer: PeerID, reason: str) -> None:
        j = self.index.get(peer)
        if j is not None:
            self.suspect(j, f"failed: {reason}")

    # --- the decision driver ------------------------------------------------------------------

    async def _drive(self) -> None:
        st = self.state
        while True:
            self.wake.clear()
            now = time.monotonic()
            st.tick(now)
            self._react(now)
            if st.decision is not None:
                await self.link.deliver_decision(self.hook)
                return
            self.link.flush()
            delay = st.next_deadline() - time.monotonic()
            try:
                async with asyncio.timeout(max(delay, 0.001)):
                    await self.wake.wait()
            except TimeoutError:
                pass

    def _react(self, now: float) -> None:
        st = self.state
        for j, why in list(st.suspected.items()):
            if j not in self._seen_suspects:
                self._seen_suspects.add(j)
                if self.data.needs(j):
                    st.fail(f"member {self.names[j]} {why}", (j,), now)
        if st.abort_known or st.decision is not None:
            if self._data_task is not None:
                self._data_task.cancel()
            self._close_handlers()

    # --- READY and commit ---------------------------------------------------------------------

    async def _vote_when_complete(self) -> None:
        await self.data.complete.wait()
        log.debug("%s: data phase complete", self.names[self.me])
        if self.state.abort_known or self.state.decision is not None:
            return
        if not await self._owner_parts_attested():
            return
        digests = b""
        if self.cfg.reduction != "mean" or self.data.received is not None:
            # Where the round defends against Byzantine members (a robust reduction,
            # attested contributions): a plain mean lets any member skew it anyway,
            # and hashing the average costs a CPU-bound round on loopback 10-30%.
            digests = await self._buffers.in_thread(
                result_digests, self.plan, self.io.result,
                None if self.data.raw else self.data.encoded,
            )  # fmt: skip
        await self.hook("before_ready")
        self.state.ready(time.monotonic(), digests)
        # Delivered from here, not by the driver, so that "after_ready" means delivered.
        self._voting = True
        sends = self.link.flush()
        self.wake.set()
        if sends:
            await asyncio.wait(sends)
        await self.hook("after_ready")

    async def _owner_parts_attested(self) -> bool:
        """In an attested owner-written round, each member's part (its slot, as it came
        to everyone) must be what it committed to: else we veto, naming it (blocking
        hashes, in a thread). True when there is nothing to check or all checks."""
        received = self.data.received
        if received is None or not self.owner_written or self.n == 1:
            return True
        problem = await self._buffers.in_thread(
            owner_written_problem, self.plan, self.io.result, self.group, self.me, received
        )
        if problem is None:
            return True
        reason, j = problem
        self.fail(f"member {self.names[j]} {reason}", (j,))
        return False


class ControlLink:
    """Control messages of one round: connections to the members, the commit
    protocol's queued messages sent (a heartbeat at a time per member), replies fed
    back to it, and failures turned into suspicion."""

    def __init__(
        self,
        host: Host,
        cfg: AllReduceConfig,
        group: Group,
        state: CommitProtocol,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        wait_connection: Callable[[PeerID, float], Awaitable[None]],
        wake: asyncio.Event,
    ) -> None:
        self.host = host
        self.cfg = cfg
        self.group = group
        self.state = state
        self.round_id = group.round_id
        self.peers = group.peer_ids
        self.names = [p.short() for p in self.peers]
        self.n = group.size
        self._spawn = spawn
        self._wait_connection = wait_connection
        self.wake = wake
        self.control_sent = 0
        self._hb_inflight: set[int] = set()
        self._connected: set[int] = set()  # peers we have had a connection to
        self._decision_sends: list[Send] = []

    async def connect(self, j: int) -> None:
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
                await self._dial(peer, self.group.members[j].addrs)
        self._connected.add(j)

    async def _dial(self, peer: PeerID, addrs: tuple[Multiaddr, ...]) -> None:
        """A connection to `peer`, dialed once more after `_REDIAL_PAUSE` when the first
        closed before the peer spoke (`ClosedAtOnce`: alive, and refusing for now). At
        1,000 simulated peers a member among the DHT replicas of a crowded key had
        its handshake slots full, evicted its round's dials, and the round blamed it."""
        deadline = time.monotonic() + self.cfg.stall_timeout
        try:
            await self.host.connect(peer, addrs, timeout=self.cfg.stall_timeout)
        except ClosedAtOnce as e:
            left = deadline - time.monotonic() - _REDIAL_PAUSE
            if left <= 0:
                raise
            log.debug("dialing %s again: %s", peer.short(), e)
            await asyncio.sleep(_REDIAL_PAUSE)
            if self.host.connection(peer) is None:
                await self.host.connect(peer, addrs, timeout=left)

    def flush(self) -> list[asyncio.Task[None]]:
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

    async def deliver_decision(self, hook: Callable[[str], Awaitable[None]]) -> None:
        """The decider waits until its decision is delivered (or the target found dead):
        a decider that returned and exited at once could leave everyone in doubt."""
        self.flush()
        decision, self._decision_sends = self._decision_sends, []
        sends = [self._spawn(self._send(s)) for s in decision]
        for delivered, send in enumerate(asyncio.as_completed(sends), 1):
            await send
            if delivered == len(sends) // 2:
                await hook("decider_mid_broadcast")

    async def learn(self, doubt: Decision) -> Decision:
        """We gave up in doubt: ask every other member (they remember finished rounds)
        for the decision, within `decision_timeout`; `doubt` when nobody tells. We voted
        READY, so we hold every averaged part: a COMMIT learned is applied as anywhere."""
        learned = learned_decision(await self.ask_all(self.cfg.decision_timeout))
        now_decided = self.state.decision
        if learned is None and now_decided is not None and not now_decided.in_doubt:
            learned = now_decided  # taken from a member's message meanwhile
        if learned is None:
            log.warning(
                "all-reduce %s: %s, and no member told us the decision since: our input is "
                "not offered again", self.round_id.hex()[:12], doubt.reason,
            )  # fmt: skip
            return doubt
        log.info("all-reduce %s: learned the decision after giving up: %s",
                 self.round_id.hex()[:12], "commit" if learned.commit else "abort")  # fmt: skip
        return learned

    async def ask_all(self, timeout: float) -> list[Status]:
        """The statuses of the other members that answer ours within `timeout` (all of
        them, suspected or not); stops early at a member that decided COMMIT."""

        async def ask(j: int) -> Status | None:
            try:
                async with asyncio.timeout(timeout):
                    await self.connect(j)
                    status = for_peer(self.host, self.peers[j], self.state.status())
                    reply = await rpc.call(
                        self.host, self.peers[j], self.cfg.protocol, "m",
                        [self.round_id, status], timeout=None,
                    )  # fmt: skip
                kind, status = parse_message(reply, self.n)
            except (TimeoutError, RemoteError, TransportError, OSError, ValueError) as e:
                log.debug("%s did not tell its decision: %s", self.names[j], describe(e))
                return None
            if kind != "S":
                return None
            # As any reply: we may accept a proposal in it (a decider may need us).
            self.state.on_reply(j, status, time.monotonic(), "heartbeat")
            return status

        asks = [asyncio.ensure_future(ask(j)) for j in range(self.n) if j != self.state.me]
        answers: list[Status] = []
        try:
            for next_answer in asyncio.as_completed(asks):
                status = await next_answer
                if status is not None:
                    answers.append(status)
                    if status.decision is not None and status.decision.commit:
                        break
        finally:
            for task in asks:
                task.cancel()
        return answers

    async def _send(self, s: Send) -> None:
        peer = self.peers[s.dest]
        reply: Any = None
        try:
            if s.kind in ("decision", "relay") and self.state.knows_decided(s.dest):
                return  # it told us it has decided (relays cross on the wire)
            async with asyncio.timeout(self.cfg.decision_timeout):
                await self.connect(s.dest)
                message = for_peer(self.host, peer, s.message)
                reply = await rpc.call(
                    self.host, peer, self.cfg.protocol, "m", [self.round_id, message],
                    timeout=None,
                )  # fmt: skip
        except (TimeoutError, RemoteError, TransportError, OSError) as e:
            verdict = classify(e, Side.CONTROL, self.names[s.dest])
            if verdict.action is Action.SUSPECT:
                self.state.suspect(s.dest, verdict.reason, time.monotonic())
            else:
                log.debug("%s: %s", peer.short(), verdict.reason or describe(e))
            return
        finally:
            if s.kind == "heartbeat":
                self._hb_inflight.discard(s.dest)
            self.wake.set()
        self.control_sent += 48 + len(str(s.message))
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


class RoundTensors:
    """The caller's tensors, as the round sends them and receives their average."""

    def __init__(
        self, tensors: list[torch.Tensor], n_elements: int, codec: Codec, buffers: RoundBuffers
    ) -> None:
        self.tensors = tensors
        self.n_elements = n_elements
        self.codec = codec
        self._buffers = buffers
        self.flat = torch.empty(0)  # what we send
        self.result = torch.empty(0)  # uncompressed: where the average arrives
        self.flat_is_input = False  # flat is a view of the caller's (single) tensor

    async def prepare(self, single: bool) -> None:
        ts = self.tensors
        if len(ts) == 1 and ts[0].dtype == torch.float32 and ts[0].is_contiguous():
            # Sent straight from the caller's storage, which must not change meanwhile.
            self.flat = ts[0].detach().view(-1)
            self.flat_is_input = True
        else:
            self.flat = self._buffers.take(self.n_elements)
            if self.n_elements > _IN_THREAD:
                await self._buffers.in_thread(_flatten, ts, self.flat)
            else:
                _flatten(ts, self.flat)
        self.result = self.flat  # a group of one: the average is our own input
        if not single and (self.codec.name == "none" or not self.flat_is_input):
            self.result = self._buffers.take(self.n_elements)

    async def apply(self, encoded: list[tuple[int, int, memoryview]]) -> None:
        """Write the committed average into the caller's tensors."""
        if self.n_elements <= _IN_THREAD:
            self._write_out(encoded)
            return
        # A thread cannot be interrupted: if we are cancelled meanwhile, the copy still
        # finishes before the cancellation goes on, so the tensors are never half-written.
        job = asyncio.ensure_future(asyncio.to_thread(self._write_out, encoded))
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            await job
            raise

    def _write_out(self, encoded: list[tuple[int, int, memoryview]]) -> None:
        with torch.no_grad():
            if self.codec.name != "none":
                # Checked on arrival (or made here), so decoding cannot fail now.
                into = self.flat if self.flat_is_input else self.result
                for a, b, data in encoded:
                    self.codec.decode_checked(data, into[a:b])
                if self.flat_is_input:
                    return
            _copy_out(self.result, self.tensors)


def _let_go(rnd: ButterflyRound) -> None:
    """(The round ended.) Drop its references to the caller's tensors and its buffers:
    the round and its data plane refer to each other, so they would live until the
    garbage collector's next full pass (a caller that averages a fresh buffer each
    round, `pipeline.stage_optimizer`, would hold two meanwhile). A thread still
    working on them keeps its own references."""
    rnd.tensors = rnd.io.tensors = []
    rnd.io.flat = rnd.io.result = torch.empty(0)
    let_go(rnd.data)


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
