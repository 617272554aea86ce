"""DiLoCo and Streaming DiLoCo outer optimizers over the fault-tolerant `Averager`.

DiLoCo (Douillard et al. 2023). Every peer keeps a copy of the *global*
parameters and the outer momentum, identical on every peer. It trains its own
(local) parameters for H inner steps, then the pseudo-gradient ``global -
local`` is averaged over the group, weighted by the samples behind it, and
every member applies the same outer step, SGD with Nesterov momentum (the
paper's lr 0.7, momentum 0.9), to the global parameters, which then replace
the local ones. The average, the outer step and the state a joiner downloads
(global parameters and momentum) all change on a commit only, identically on
every member; the `Averager` runs the outer step in its commit hook, so the
state it freezes and serves is the post-step one.

When a round aborts (or no group formed by `round_timeout`) nothing changes
and training goes on; the next attempt is at the next H boundary, with the
pseudo-gradient then covering 2H steps and weighted by their samples. Not a
retry a few steps later: `Averager.step` has already retried at once among
the survivors, so an abort that reaches us means no quorum was there within
the deadline, and trying again right away would mostly stall training for
another deadline; waiting for the boundary keeps every peer's rounds on the
same schedule. A peer whose state is behind (it missed a commit) is told to
re-sync: it downloads the global parameters and momentum and its local
parameters restart from them (its last H steps are dropped: they were
computed from stale globals).

Matchmaking: a leader waits up to `matchmaking_time` for the peers it expects:
peers declared busy, which every peer is from `start` on (re-declared between
rounds before the declaration expires), so peers of slightly different speeds
still meet in one group, and a round with everyone present closes at once
(after the matchmaker's short minimum). A stalled peer costs the others at most
that wait per round, and `round_timeout` bounds the whole matchmaking. Rounds
come every H steps of each peer's own count; a peer out of phase with the
others (a joiner) waits at its boundary, up to `round_timeout`, for them to
arrive, and is in phase from the round they share (or, when they moved on
meanwhile, it re-syncs and joins their round with weight 0, see `_catch_up`).

With `overlap_steps` K > 0 a round runs in the background while the next inner
steps do, and is merged once it is done (at the latest K steps after it began)
with the steps taken meanwhile kept (`overlap.OverlappingRounds`): a round's
latency, about a second whatever it carries, is spent training.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication"). The parameter tensors are split into F fragments balanced by
size, each averaged under its own key with its own global copy, momentum and
state version. Fragment i is synchronized every H steps, offset by i*H/F, so
the traffic is spread over the H steps instead of bursting once. Its round runs
in the background while the next `overlap_steps` inner steps run; then the
outer step's result is merged into the local fragment, ``local = a*local +
(1-a)*global`` (`mixing` a, the paper's 0.5), keeping part of the progress made
meanwhile. The pseudo-gradients go through the all-reduce quantized, int8 with
one scale per block of 256 by default (the paper used 4-bit floats; the codecs
here go down to 8 bits).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.transport.identity import PeerID

from .allreduce import AllReduceService
from .attestation import Attestor
from .averager import Averager, AveragerConfig, StepResult, restored_version
from .diloco_options import DiLoCoOptions, StreamingOptions
from .error_feedback import ErrorFeedback
from .fragments import Fragment, FragmentOutcome, committed
from .group import Group
from .host_state import (
    copy_into,
    delta_into,
    host_clone,
    host_flat_zeros,
    numel,
    off_loop,
    shift_into,
)
from .lineage import declared_work
from .options import GroupOptions
from .outer import (
    RoundOutcome,
    RoundReport,
    allreduce_config,
    check_like,
    matchmaking_config,
    nesterov_outer_step,
    state_protocol,
)
from .overlap import OverlappingRounds
from .sparse_round import SparseContribution, sparse_shape, union_reduction
from .strategy_base import OuterStrategyBase, RoundClock, checked_counters, round_bound

log = logging.getLogger("shoal.averaging.diloco")

__all__ = ["DiLoCo", "StreamingDiLoCo", "split_fragments"]

# A catch-up round after a re-sync is tried only with this much of the round's time left.
CATCH_UP_MIN_TIME = 1.0


def _outcome(result: StepResult) -> tuple[RoundOutcome, str]:
    """The round's outcome and why, from the averager's step."""
    if result.committed:
        return RoundOutcome.COMMITTED, ""
    if result.resynced:
        return RoundOutcome.RESYNCED, ""
    if result.reason.startswith("no group"):
        return RoundOutcome.NO_GROUP, result.reason.removeprefix("no group: ")
    return RoundOutcome.ABORTED, result.reason


async def _catch_up(
    averager: Averager, deltas: Sequence[torch.Tensor], timeout: float
) -> StepResult | None:
    """Right after a re-sync, join the round the swarm is forming, with weight 0.

    The peer was told to re-sync because others were looking for a group with a
    newer state; their leader holds the group open a little for a peer that
    declared it is loading the state. Its pseudo-gradient from the downloaded
    globals is zero, so it contributes nothing, takes the group's mean and
    applies the same outer step: it ends this round in step with the swarm,
    instead of finding it one version ahead again at its next round.
    """
    if timeout < CATCH_UP_MIN_TIME:
        return None
    for d in deltas:
        d.zero_()
    return await averager.step(weight=0.0, timeout=timeout)


async def _one_round(
    dht: DHTNode,
    averager: Averager,
    deltas: Sequence[torch.Tensor],
    weight: int,
    timeout: float,
    settle: Callable[[StepResult], None] | None = None,
) -> FragmentOutcome:
    """The averager's step on `deltas` (then `settle(result)`, a sparse codec's error
    feedback) and, right after a re-sync, the catch-up round."""
    clock = RoundClock(dht)
    result = await averager.step(weight=float(weight), timeout=timeout)
    if settle is not None:
        settle(result)
    resynced = result.resynced
    if resynced:
        again = await _catch_up(averager, deltas, timeout - result.seconds)
        if again is not None and again.committed:
            result = again
    return FragmentOutcome(result, resynced, clock.bytes_sent, clock.seconds)


def _averager_config(key: str, opts: GroupOptions) -> AveragerConfig:
    return AveragerConfig(
        matchmaking=matchmaking_config(opts),
        allreduce=allreduce_config(opts),
        codec=opts.codec,
        state_protocol=state_protocol(key),
        state_timeout=opts.state_timeout,
        adaptive_deadlines=opts.deadlines == "adaptive",
        # The global parameters are one state for the whole swarm: a peer alone
        # takes its outer steps by itself (DiLoCo with one replica) and a joiner
        # downloads its progress.
        shared_state=True,
    )


class DiLoCo(OverlappingRounds):
    """DiLoCo over `params` (the model's parameters, changed in place)."""

    name = "diloco"
    options: DiLoCoOptions

    def __init__(
        self, dht: DHTNode, key: str, params: Sequence[torch.Tensor], options: DiLoCoOptions
    ) -> None:
        super().__init__(dht, key, params, options)
        with torch.no_grad():
            self.globals = [host_clone(p) for p in self.params]
        self.momentum = [torch.zeros_like(g) for g in self.globals]
        # The pseudo-gradients in one buffer, averaged in place (views for the math).
        self._delta_buffer, self.deltas = host_flat_zeros(self.params)
        config = _averager_config(key, self.options)
        # A sparse codec: the messages themselves travel, in slots the owners unite;
        # the robust reduction clips each message's norm when every member decodes them.
        clip = config.allreduce.reduction == "centered_clip"
        self.sparse = SparseContribution.of(self.options, self._delta_buffer, clip=clip)
        if self.sparse is not None:
            union = union_reduction(clip=clip, senders=self.sparse.senders)
            allreduce = dataclasses.replace(config.allreduce, reduction=union)
            config = dataclasses.replace(config, codec="none", allreduce=allreduce)
        self.averager = Averager(
            dht,
            key,
            [self._delta_buffer],
            config=config,
            metadata=self._metadata,
            state=[*self.globals, *self.momentum],
            on_commit=self._outer_step,
            round_tensors=None if self.sparse is None else self._slots_for,
        )
        self._init_overlap(int(self.options.overlap_steps))

    @property
    def feedback(self) -> ErrorFeedback | None:
        """The error feedback of a sparse codec (None with a dense one)."""
        return None if self.sparse is None else self.sparse.feedback

    @property
    def outer_steps(self) -> int:
        """Outer steps applied to the global state this peer holds (its commit count)."""
        return self.averager.commits

    # `outer.VerifyingStrategy`: its all-reduce is what a verifier audits.

    def audit_shape(self) -> tuple[int, int, str]:
        allreduce = self.averager.config.allreduce
        # (A sparse round sends slots of messages, not a coded pseudo-gradient: what an
        # auditor can re-derive of it is named apart, `audit_round.RoundShape.sparse`.)
        if self.sparse is None:
            codec = self.averager.config.codec
        else:
            feedback = self.sparse.feedback
            codec = sparse_shape(self.sparse.gather.codec, feedback.decay, feedback.leaf > 0)
        return (allreduce.streams_per_peer, allreduce.chunk_bytes, codec)

    def shun(self, peer: PeerID, seconds: float) -> None:
        self.averager.shun(peer, seconds)

    def attach_attestor(self, attestor: Attestor) -> None:
        self.averager.attestor = attestor
        # A verifier of sparse rounds also commits to our error feedback and keeps what
        # we sent, to reveal it (`peer.verify.verifier.Verifier.attach_sparse`).
        attach = getattr(attestor, "attach_sparse", None)
        if self.sparse is not None and attach is not None:
            attach(self.sparse)

    @property
    def oversized_refused(self) -> int:
        return self.averager.oversized_refused

    @property
    def provenance(self) -> dict[str, Any] | None:
        return self.averager.provenance_status()

    def _metadata(self) -> dict[str, Any]:
        return {"strategy": self.name, "step": self.averager.commits}

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, join: bool) -> bool:
        loaded = False
        if join:
            loaded = await self.averager.load_state_from_peers(timeout=self.averager.state_timeout)
            if loaded:
                copy_into(self.params, self.globals)
                self._synced_now()
                if self.sparse is not None:
                    self.sparse.reset()
        if not loaded:
            if not self._restored:
                copy_into(self.globals, self.params)
            elif self._params_behind:
                log.info("%s: the checkpoint was taken between a commit and its merge: the "
                         "parameters restart from its globals", self.key)  # fmt: skip
                copy_into(self.params, self.globals)
                self._synced_now()
            elif self.averager.attestor is not None and self.samples_since_sync:
                # A verified round's work starts from the global state and is in this
                # process's work log. The steps taken before the restart since the last
                # sync are in neither: every member would refuse our input ("work
                # started from another global state", "more weight than its steps").
                log.info("%s: restarted in the middle of a round: its %d samples of work "
                         "since the last sync are dropped (a verified round must hold "
                         "only work this process can show)", self.key,
                         self.samples_since_sync)  # fmt: skip
                copy_into(self.params, self.globals)
                self._synced_now()
            await self.averager.publish_state()
        await self.averager.announce_presence()
        return loaded

    async def _between_rounds(self) -> None:
        # Leaders wait for peers declared busy: stay declared between rounds.
        await self.averager.refresh_presence()

    async def _close_parts(self) -> None:
        await self._drop_pending()
        await self.averager.aclose()

    # ------------------------------------------------------------------ the round

    async def _round(self) -> RoundReport:
        started_at, synced_at = self.inner_steps, self.synced_at_step
        weight = await self._prepare()
        done = await self._run_round(weight)
        return await self._settle(done, weight, started_at, synced_at, overlapped=False)

    async def _prepare(self) -> int:
        """The pseudo-gradient (and a sparse codec's message) of the steps since the
        last sync; the samples behind them, which the round takes from the count."""
        size = numel(self.params)
        await off_loop(lambda: delta_into(self.deltas, self.globals, self.params), size)
        if self.sparse is not None:
            await off_loop(self.sparse.compress, size)
        weight, self.samples_since_sync = self.samples_since_sync, 0
        return weight

    async def _run_round(self, weight: int) -> FragmentOutcome:
        settle = None if self.sparse is None else self.sparse.settle
        timeout = float(self.options.round_timeout)
        return await _one_round(self.dht, self.averager, self.deltas, weight, timeout, settle)

    async def _settle(
        self, done: FragmentOutcome, weight: int, started_at: int, synced_at: int, *,
        overlapped: bool,
    ) -> RoundReport:  # fmt: skip
        """The round's outcome applied to the local parameters and the counters."""
        result, size = done.result, numel(self.params)
        contribution = (synced_at, started_at)
        if done.resynced or result.discarded:
            # Our work was dropped: the swarm's state replaced it, or it may be counted
            # already (a round we were in doubt of); our parameters go back to the globals.
            contribution = (self.inner_steps, self.inner_steps)
            self._synced_now()
            await off_loop(lambda: copy_into(self.params, self.globals), size)
        elif result.committed:
            # (Without overlap the outer step already set the parameters to the globals.)
            if overlapped:
                await off_loop(lambda: shift_into(self.params, self.globals, self._anchor), size)
            self.synced_at_step = started_at
        else:
            self.samples_since_sync += weight  # the next round's pseudo-gradient covers them
        return self._report(
            *_outcome(result),
            group_size=result.group_size,
            fingerprint=result.fingerprint,
            duration_s=done.seconds,
            bytes_sent=done.bytes_sent,
            result=result,
            contribution=contribution,
        )

    def _slots_for(self, group: Group, weight: float) -> list[torch.Tensor]:
        assert self.sparse is not None
        host = self.dht.host
        return self.sparse.slots_for(group, host.peer_id, weight, host.identity.sign)

    def _outer_step(self) -> None:
        """The commit hook: `deltas` hold the group's weighted mean pseudo-gradient
        (a sparse round's: decoded from the slots every member now holds alike)."""
        if self.sparse is not None:
            self.sparse.mean_on_commit(self.averager.committing_round)
        nesterov_outer_step(
            self.globals,
            self.deltas,
            self.momentum,
            lr=self.options.outer_lr,
            mu=self.options.outer_momentum,
        )
        if not self.overlap_steps:
            copy_into(self.params, self.globals)
        # (Overlapped, an inner step may be running on the parameters right now: the
        # merge moves them, `_settle`.)

    # ------------------------------------------------------------------ state

    def fingerprint(self) -> str:
        return self.averager.fingerprint()

    @property
    def committed_fingerprint(self) -> str | None:
        """The fingerprint of the last committed (or loaded) state, hashed off the event
        loop when it was frozen: what status endpoints show, at no cost."""
        return self.averager.last_fingerprint

    def state_dict(self) -> dict[str, Any]:
        """Global parameters, momentum and counters (the local parameters are the model's)."""
        return {
            "strategy": self.name,
            "globals": [g.detach().clone() for g in self.globals],
            "momentum": [m.detach().clone() for m in self.momentum],
            "commits": self.averager.commits,
            "version": self.averager.state_version.hex(),
            "work": self.averager.work,
            "certificates": self.averager.saved_certificates(),
            "inner_steps": self.inner_steps,
            **self._unsynced(),
            # Private to this peer (never in the state it serves), so only here.
            "error_feedback": None if self.sparse is None else self.sparse.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_checkpoint(state)
        globals_ = check_like("globals", state.get("globals"), self.globals)
        momentum = check_like("momentum", state.get("momentum"), self.momentum)
        inner, samples = checked_counters(state, ("inner_steps", "samples_since_sync"))
        saved_feedback = state.get("error_feedback")
        if self.sparse is not None and saved_feedback is not None:
            self.sparse.load_state_dict(saved_feedback)  # (a checkpoint without one: zero)
        self.averager.restore(
            state.get("commits"),  # type: ignore[arg-type]
            state.get("version"),
            state.get("work"),
            state.get("certificates"),
        )
        copy_into(self.globals, globals_)
        copy_into(self.momentum, momentum)
        self.inner_steps = inner
        self.samples_since_sync = samples
        self.synced_at_step = inner  # (this process's ledger counts from here)
        self._params_behind = state.get("params_behind") is True
        self._restored = True


# ---------------------------------------------------------------------- streaming


def split_fragments(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Tensor indices in `count` fragments of about equal total size (largest tensors
    first, each to the lightest fragment); indices ascending within a fragment,
    fragments ordered by their first index."""
    if not 1 <= count <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} tensors into {count} fragments")
    buckets: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(count), key=lambda b: (totals[b], b))
        buckets[lightest].append(i)
        totals[lightest] += sizes[i]
    return sorted((sorted(b) for b in buckets), key=lambda b: b[0])


class StreamingDiLoCo(OuterStrategyBase):
    """Streaming DiLoCo over `params`: fragments synchronized in turn, in the background.

    Its schedule is its own (a fragment's round starts at its offset and is merged
    `overlap_steps` later); samples are counted per fragment."""

    name = "streaming"
    options: StreamingOptions

    def __init__(
        self, dht: DHTNode, key: str, params: Sequence[torch.Tensor], options: StreamingOptions
    ) -> None:
        super().__init__(dht, key, params, options)
        h = self.inner_steps_per_round
        count = int(self.options.fragments)
        if count > len(self.params):
            raise ValueError(
                f"option 'fragments' ({count}) exceeds the number of parameter tensors "
                f"({len(self.params)})"
            )
        self.overlap_steps = int(self.options.overlap_steps)
        self.mixing = float(self.options.mixing)
        self._service = AllReduceService(dht.host, allreduce_config(self.options))
        self.fragments: list[Fragment] = []
        for i, indices in enumerate(split_fragments([p.numel() for p in self.params], count)):
            local = [self.params[j] for j in indices]
            with torch.no_grad():
                globals_ = [host_clone(p) for p in local]
            frag = Fragment(
                index=i,
                offset=i * h // count,
                params=local,
                globals=globals_,
                momentum=[torch.zeros_like(g) for g in globals_],
                deltas=[],
            )
            delta_buffer, frag.deltas = host_flat_zeros(local)
            fkey = f"{key}/fragment{i}"
            frag.averager = Averager(
                dht,
                fkey,
                [delta_buffer],
                config=_averager_config(fkey, self.options),
                metadata=self._metadata_of(frag),
                state=[*frag.globals, *frag.momentum],
                on_commit=self._outer_step_of(frag),
                service=self._service,
            )
            self.fragments.append(frag)
        # Inner steps that completed while a fragment's round was in flight.
        self.overlapped_steps = 0

    @property
    def outer_steps(self) -> int:
        """Fragment outer steps applied to the global state (each covers 1/F of it)."""
        return sum(f.avg.commits for f in self.fragments)

    @property
    def oversized_refused(self) -> int:
        return sum(f.avg.oversized_refused for f in self.fragments)

    @property
    def provenance(self) -> dict[str, Any] | None:
        """The fragments' counters summed; `fragments`: each one's own."""
        parts = [f.avg.provenance_status() for f in self.fragments]
        known = [p for p in parts if p is not None]
        if not known:
            return None
        out: dict[str, Any] = {
            k: sum(p[k] for p in known) for k in known[0] if isinstance(known[0][k], int)
        }
        out["verified"] = all(p["verified"] for p in known)
        out["fragments"] = known
        return out

    def _metadata_of(self, frag: Fragment) -> Any:
        def metadata() -> dict[str, Any]:
            return {"strategy": self.name, "fragment": frag.index, "step": frag.avg.commits}

        return metadata

    def _outer_step_of(self, frag: Fragment) -> Any:
        def outer_step() -> None:
            # Only the fragment's globals and momentum: an inner step may be
            # running on the local parameters right now (they merge later).
            nesterov_outer_step(
                frag.globals,
                frag.deltas,
                frag.momentum,
                lr=self.options.outer_lr,
                mu=self.options.outer_momentum,
            )

        return outer_step

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, join: bool) -> bool:
        if join:
            results = await asyncio.gather(
                *(f.avg.load_state_from_peers(timeout=f.avg.state_timeout) for f in self.fragments)
            )
            for f, ok in zip(self.fragments, results, strict=True):
                f.loaded = ok
                if ok:
                    copy_into(f.params, f.globals)
                    f.samples = 0  # (the checkpoint's count covered work now replaced)
        for f in self.fragments:
            if not f.loaded:
                if not self._restored:
                    copy_into(f.globals, f.params)
                await f.avg.publish_state()
        await asyncio.gather(*(f.avg.announce_presence() for f in self.fragments))
        return all(f.loaded for f in self.fragments)

    async def after_inner_step(self, samples: int) -> list[RoundReport]:
        self.inner_steps += 1
        if any(f.task is not None and f.started_at < self.inner_steps for f in self.fragments):
            self.overlapped_steps += 1
        reports = []
        with self._gate:
            for f in self.fragments:
                f.samples += samples
                if not self._gate.closing and f.task is None and self._due(f):
                    await self._start_round(f)
            for f in self.fragments:
                if f.task is not None and self.inner_steps >= f.started_at + self.overlap_steps:
                    reports.append(await self._merge(f))
            for f in self.fragments:
                if f.task is None and not self._gate.closing:
                    await f.avg.refresh_presence()
        return reports

    async def finish(self) -> None:
        """No new rounds; the rounds in flight end (bounded) and are merged."""
        await super().finish()
        for f in self.fragments:
            if f.task is None:
                continue
            done, _ = await asyncio.wait([f.task], timeout=round_bound(self.options))
            if done:
                await self._merge(f)
            else:
                await f.cancel()

    async def _close_parts(self) -> None:
        for f in self.fragments:
            await f.cancel()
            await f.avg.aclose()
        await self._service.aclose()

    # ------------------------------------------------------------------ rounds

    def _due(self, frag: Fragment) -> bool:
        return self.inner_steps % self.inner_steps_per_round == frag.offset

    async def _start_round(self, frag: Fragment) -> None:
        run = functools.partial(self._run_round, frag)
        await frag.begin(lambda: self.inner_steps, run, f"{self.key}/fragment{frag.index}")

    async def _run_round(self, frag: Fragment, weight: int) -> FragmentOutcome:
        timeout = float(self.options.round_timeout)
        return await _one_round(self.dht, frag.avg, frag.deltas, weight, timeout)

    async def _merge(self, frag: Fragment) -> RoundReport:
        """Wait for the fragment's round (bounded by its own deadlines) and merge it."""
        assert frag.task is not None
        try:
            done = await frag.task
        finally:
            frag.task = None
        result = done.result
        if done.resynced or result.discarded:
            # The local fragment was trained from stale globals, or its input may be counted
            # already (a round we were in doubt of): it restarts from the globals.
            await off_loop(lambda: copy_into(frag.params, frag.globals), numel(frag.params))
            self.resets += 1
        elif result.committed:
            a = self.mixing

            def mix() -> None:
                # The globals live on the host; the model may train on a GPU.
                for p, g in zip(frag.params, frag.globals, strict=True):
                    p.mul_(a).add_(g.to(p.device, p.dtype), alpha=1 - a)

            await off_loop(mix, numel(frag.params))
        else:
            frag.samples += frag.weight  # the next round's pseudo-gradient covers them too
        return self._report(
            *_outcome(result),
            group_size=result.group_size,
            fingerprint=result.fingerprint,
            duration_s=done.seconds,
            bytes_sent=done.bytes_sent,
            result=result,
        )

    # ------------------------------------------------------------------ state

    def fingerprint(self) -> str:
        h = hashlib.sha256(b"shoal/streaming-diloco\x00")
        for f in self.fragments:
            h.update(f.avg.fingerprint().encode())
        return h.hexdigest()

    @property
    def committed_fingerprint(self) -> str | None:
        """The fragments' last frozen fingerprints combined (see DiLoCo's)."""
        prints = [f.avg.last_fingerprint for f in self.fragments]
        if any(p is None for p in prints):
            return None
        h = hashlib.sha256(b"shoal/streaming-diloco/committed\x00")
        for p in prints:
            h.update(p.encode())  # type: ignore[union-attr]
        return h.hexdigest()

    def state_dict(self) -> dict[str, Any]:
        """Per fragment: globals, momentum, commits, samples. A round still in flight
        is not saved: its samples count as not yet synchronized."""
        frags = []
        for f in self.fragments:
            samples = f.samples
            if f.task is not None and not committed(f.task):
                samples += f.weight
            frags.append(
                {
                    "globals": [g.detach().clone() for g in f.globals],
                    "momentum": [m.detach().clone() for m in f.momentum],
                    "commits": f.avg.commits,
                    "version": f.avg.state_version.hex(),
                    "work": f.avg.work,
                    "certificates": f.avg.saved_certificates(),
                    "samples": samples,
                }
            )
        return {
            "strategy": self.name,
            "inner_steps": self.inner_steps,
            "overlapped_steps": self.overlapped_steps,
            "fragments": frags,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_checkpoint(state)
        frags = state.get("fragments")
        if not isinstance(frags, list) or len(frags) != len(self.fragments):
            raise ValueError(f"checkpoint must hold {len(self.fragments)} fragments")
        inner = state.get("inner_steps")
        if not isinstance(inner, int) or inner < 0:
            raise ValueError("checkpoint 'inner_steps' must be an int >= 0")
        checked = []
        for f, saved in zip(self.fragments, frags, strict=True):
            if not isinstance(saved, dict) or not isinstance(saved.get("samples"), int):
                raise ValueError(f"checkpoint fragment {f.index} is malformed")
            checked.append(
                (
                    check_like("globals", saved.get("globals"), f.globals),
                    check_like("momentum", saved.get("momentum"), f.momentum),
                    saved.get("commits"),
                    saved.get("version"),
                    saved.get("work"),
                    saved["samples"],
                    saved.get("certificates"),
                )
            )
        for _, _, commits, version, work, _, _ in checked:
            restored_version(commits, version)  # all or nothing: check every one first
            if work is not None and declared_work(work) is None:
                raise ValueError(f"checkpoint 'work' must be an int >= 0, got {work!r}")
        for f, (globals_, momentum, commits, version, work, samples, certs) in zip(
            self.fragments, checked, strict=True
        ):
            f.avg.restore(commits, version, work, certs)
            copy_into(f.globals, globals_)
            copy_into(f.momentum, momentum)
            f.samples = samples
        self.inner_steps = inner
        overlapped = state.get("overlapped_steps", 0)
        self.overlapped_steps = overlapped if isinstance(overlapped, int) else 0
        self._restored = True
