"""Commit or abort, never half: the decision protocol of one all-reduce round (sans-IO).

`CommitProtocol` is one member's state machine. It takes events in (messages
from other members, "this peer's connection died", "my data is complete", the
current time) and gives messages out; a thin asyncio driver in `allreduce.py`
moves them. Members are group indices; time is whatever monotonic clock the
driver passes in.

Votes. A member whose data phase completed (it holds every averaged part)
votes READY; one that cannot complete (a peer died, a codec error, garbage)
VETOes. Votes are final. A veto is public: the vetoer will never vote READY, so
COMMIT is impossible at every ballot from then on, and anyone who learns of it
may take any ABORT decision (or, if no decider speaks up within
``abort_grace`` (a few heartbeats, at most ``decision_timeout``), abort alone:
nothing else can be decided).

Deciders and ballots. A decision is ``(ballot, commit)``; ballot b belongs to
member ``b % n``. Member 0 decides at ballot 0 and is the only one who may
*originate* COMMIT: it proposes it iff it holds READY from every member. A
member applies (and relays to everyone not named failed) the first decision it
receives whose ballot is not below the highest ballot it promised. Every
message's reply is the receiver's status, decision included, so a decision
also spreads through heartbeats.

Accepting before deciding (Paxos phase 2). A decider that could be contradicted
does not decide at once: it *proposes* (its status carries the proposal,
``accepted``), every member that has promised no higher ballot accepts it (its
status says so, its promise rises to that ballot), and the decider decides once
every member it does not suspect has accepted, and they are at least the accept
quorum (`ballots.quorums`: half the group, rounded up, the decider included).
Without phase 2, member 0 stopped (SIGSTOP) between deciding COMMIT and telling
anyone would wake up committed while the others, finding nothing, aborted and
retried with the same inputs: those inputs would count twice. Now it wakes up with a proposal nobody
accepted, and learns their ABORT. Every COMMIT goes through phase 2, and so
does a takeover's ABORT; an ABORT that nothing can contradict is decided at
once: member 0's at ballot 0 (it proposed no COMMIT there, and COMMIT has no
other origin) and any ABORT once a veto is known.

Takeover. When every member below k is suspected (dead or stalled), member k
leads once it has voted: it picks a ballot b it owns above every ballot it has
seen, sends PREPARE(b) to all non-suspected members and waits for each to
answer (or to become suspected); the answers, its own included, must reach the
prepare quorum (more than half the group), which shares a member with every
accept quorum. A member answers with its status (decision
and accepted proposal) and promises to ignore decisions and proposals of lower
ballots from then on. The leader takes the value with the highest ballot among
the answers and its own accepted proposal: a decision reported is decided at
once, an accepted proposal is proposed again at b; with none it proposes ABORT
(a leader never originates COMMIT). A leader that meets a higher ballot stands
back while that ballot's owner is alive (for at most ``decision_timeout``). A
member that would lead with fewer members than the prepare quorum left (the
others suspected), after voting READY and with no veto known, does not take
over: a decider that suspects it in turn (a partition, a cut link, heartbeats
late under load) may have committed its input with the accept quorum on its
side, and an ABORT would have its caller retry that input (the soak's
`double_counted`). It decides what it accepted if that is known to be accepted
by an accept quorum (itself and the proposer can be one), and is in doubt
otherwise (below), learning the decision if anyone answers. A proposer whose
proposal reached fewer than the accept quorum before every other member was
suspected is in doubt too.

Why everyone agrees. COMMIT exists only if every member voted READY, so a veto
and a COMMIT never coexist. A value decided at ballot b0 was accepted by an
accept quorum, each member of it before promising anything higher; a later
leader heard from a prepare quorum, which holds one of them, so it finds that
value (or a value of a higher ballot, by induction the same) and proposes
nothing else. ABORTs decided without phase 2 contradict nothing: member 0's at
ballot 0 (COMMIT never proposed, so nobody can find it) and any once a veto is
known. This holds whatever the failure detector believes: a member stopped,
killed or cut off at any point (before proposing, after proposing, after
deciding), or two sides of a partition that each suspect the other, never end
with COMMIT on one member and ABORT on another; a member that cannot tell is in
doubt. Before the quorums (decisions by "every member not suspected"), the
side of a partition without member 0 took over and aborted while member 0's
side committed with its inputs, and it retried them: two committed rounds
counted them (CI's soak, stop 48). (Tested on a simulated network:
`tests/test_averaging_allreduce.py`.)

Liveness. Every member heartbeats its status to every other one; nothing
heard from a member for ``stall_timeout`` makes it suspected (a lost
connection does so at once, an unanswered message after ``decision_timeout``).
A member that has not voted and received no data for 1.5 x ``stall_timeout``
vetoes (it is stuck). A member that voted READY and cannot learn the decision
gives up *in doubt* after ``give_up_after`` without any progress at all: it
keeps its tensors and says so, since others may have committed. That is a
last resort, longer than the data watchdog, so a member stuck in its data
phase aborts the round before anyone gives up on it. A member in doubt still
accepts proposals and takes decisions (the others may need its acceptance), it
only stops leading; its driver asks the others once more for their decision
(`learned_decision`, Paxos' learner). Having voted READY it holds every averaged
part, so a COMMIT learned is applied as everywhere; an ABORT makes a retry with
the same input safe; with neither, the input must not be offered again. A
member that resumes after being stopped (a long gap between ticks) gives
everyone a fresh ``stall_timeout`` instead of suspecting the whole group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from .ballots import MAX_BALLOT, Ballots, Decision, quorums
from .liveness import Liveness
from .outbox import Outbox, Send
from .votes import LOCAL, NO_VOTE, READY, VETO, Votes

__all__ = [
    "NO_VOTE",
    "READY",
    "VETO",
    "CommitProtocol",
    "ControlError",
    "Decision",
    "Send",
    "Status",
    "learned_decision",
    "parse_message",
]

MAX_REASON = 1000
# With a veto known, how long a decider's ABORT (and its `failed` list, which the
# retry should share) is waited for at least, before aborting alone: a live decider
# hears the veto when we do and answers within a round trip or a heartbeat.
ABORT_GRACE_MIN_S = 2.0


class Status(NamedTuple):
    """What a member tells others about itself (heartbeats, votes, decisions, promises)."""

    vote: int
    reason: str  # its veto reason, or the veto it knows of
    suspects: tuple[int, ...]  # whom its veto blames
    abort_known: bool  # it knows of a veto: no COMMIT is possible at any ballot
    decision: Decision | None
    promised: int
    progress: int  # data-phase progress counter (bytes received)
    accepted: Decision | None  # the highest-ballot proposal it accepted (not yet decided)
    # With a READY vote (protocol 2.5): a digest of each part's result as it came to
    # the member (`RESULT_DIGEST` bytes per part, in member order). b"": none said.
    results: bytes = b""


# Bytes of a part's result digest in a READY status (`Status.results`).
RESULT_DIGEST = 16  # (8 would let an owner find two results of one digest in 2**32 tries)


class ControlError(ValueError):
    """A control message of the commit protocol that is malformed."""


def _check_int(v: object, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ControlError(f"bad {what}: {v!r}"[:120])
    return v


def _check_str(v: object, what: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_REASON:
        raise ControlError(f"bad {what}")
    return v


def _check_members(v: object, n: int, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > n:
        raise ControlError(f"bad {what}")
    return tuple(sorted({_check_int(i, 0, n - 1, what) for i in v}))


def _wire(d: Decision | None) -> list[Any] | None:
    if d is None or d.ballot < 0:
        return None
    return [d.ballot, d.commit, d.reason, sorted(d.failed)]


def _parse_decision(v: object, n: int) -> Decision | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 4 or not isinstance(v[1], bool):
        raise ControlError("bad decision")
    ballot = _check_int(v[0], 0, MAX_BALLOT, "ballot")
    return Decision(
        ballot, v[1], _check_str(v[2], "reason"), frozenset(_check_members(v[3], n, "failed"))
    )


def parse_message(msg: object, n: int) -> tuple[str, Any]:
    """Validate an untrusted control message: ("S", Status) or ("P", ballot)."""
    if not isinstance(msg, list) or not msg:
        raise ControlError("control message must be a non-empty list")
    if msg[0] == "P" and len(msg) == 2:
        return "P", _check_int(msg[1], 1, MAX_BALLOT, "ballot")
    if msg[0] == "S" and len(msg) in (9, 10):
        _, vote, reason, suspects, ak, decision, promised, progress, accepted = msg[:9]
        results = msg[9] if len(msg) == 10 else b""
        if not isinstance(ak, bool):
            raise ControlError("bad abort flag")
        if not isinstance(results, bytes) or len(results) not in (0, RESULT_DIGEST * n):
            raise ControlError("bad result digests")
        return "S", Status(
            _check_int(vote, 0, 2, "vote"),
            _check_str(reason, "reason"),
            _check_members(suspects, n, "suspects"),
            ak,
            _parse_decision(decision, n),
            _check_int(promised, 0, MAX_BALLOT, "promised ballot"),
            _check_int(progress, 0, (1 << 63) - 1, "progress"),
            _parse_decision(accepted, n),
            results,
        )
    raise ControlError(f"unknown control message {str(msg[0])[:20]!r}")


def without_results(message: object) -> object:
    """`message` as a peer of protocol 2.4 reads it: a status of 9 fields (it refuses a
    10th, the result digests of a READY; 2.5 added them)."""
    if isinstance(message, list) and len(message) == 10 and message[0] == "S":
        return message[:9]
    return message


def learned_decision(answers: Iterable[Status]) -> Decision | None:
    """What a member in doubt learns from the others' statuses (they remember finished
    rounds): COMMIT if any of them decided it (our input is in their result); the
    highest-ballot ABORT if some decided ABORT and none reports COMMIT, decided or
    accepted (nothing counted our input: a retry with it is safe); None otherwise.

    A COMMIT beats an ABORT of a higher ballot: two sides that suspected each other
    may both have decided (see the module docstring), and the side that committed
    holds our input whatever the other did.
    """
    answers = list(answers)
    decisions = [s.decision for s in answers if s.decision is not None]
    commits = [d for d in decisions if d.commit]
    if commits:
        return max(commits, key=lambda d: d.ballot)
    if any(s.accepted is not None and s.accepted.commit for s in answers):
        return None  # a COMMIT proposal may be decided by now, out of our sight
    return max(decisions, key=lambda d: d.ballot, default=None)


class CommitProtocol:
    """One member's view of one round's decision. All methods take the current time."""

    def __init__(
        self,
        n: int,
        me: int,
        now: float,
        *,
        names: list[str] | None = None,
        heartbeat_interval: float = 1.0,
        stall_timeout: float = 10.0,
        decision_timeout: float = 10.0,
        promised: int = 0,
    ) -> None:
        if not 0 <= me < n:
            raise ValueError("member index out of range")
        self.n = n
        self.me = me
        self.names = names or [f"#{i}" for i in range(n)]
        self.heartbeat_interval = heartbeat_interval
        self.stall_timeout = stall_timeout
        self.liveness = Liveness(
            n, me, now, heartbeat_interval=heartbeat_interval, stall_timeout=stall_timeout
        )
        self.decision_timeout = decision_timeout
        # Not the whole decision_timeout (the stall, up to minutes on slow links): the
        # outcome is certain once a veto is known, and a decider that did not speak
        # by then is stopped or cut off; waiting for it only held back the retry
        # (soak 9: 15-19 s more, in a 63 s gap between commits).
        self.abort_grace = min(decision_timeout, max(ABORT_GRACE_MIN_S, 3 * heartbeat_interval))
        self.give_up_after = 2 * stall_timeout + decision_timeout
        self.suspected: dict[int, str] = {}  # member -> why
        self.vote = NO_VOTE
        self.veto: tuple[str, tuple[int, ...]] | None = None
        self.votes = Votes()  # everyone's, as far as we know
        self.results = b""  # our READY's digests of the parts' results
        self.ballots = Ballots(n, me, now, promised)
        self.prepare_quorum, self.accept_quorum = quorums(n)
        self.decision: Decision | None = None
        self.last_progress = now  # anything changed (ours or anyone's state)
        self._outbox = Outbox()

    # --- queries ------------------------------------------------------------------------------

    @property
    def decided(self) -> bool:
        return self.decision is not None

    @property
    def accepted(self) -> Decision | None:
        """The proposal we accepted and have not decided (yet)."""
        return self.ballots.accepted

    @property
    def abort_known(self) -> bool:
        """A veto exists: every decision can only be ABORT."""
        return self.votes.abort_known

    def knows_decided(self, peer: int) -> bool:
        """`peer` told us it has decided (so it needs no decision message)."""
        return self.liveness.reported_decision(peer)

    def leader(self) -> int:
        return next(j for j in range(self.n) if j not in self.suspected)

    def status(self) -> list[Any]:
        reason = self.veto[0] if self.veto else self.votes.abort_reason
        suspects = list(self.veto[1]) if self.veto else []
        ak, promised, progress = self.abort_known, self.ballots.promised, self.liveness.progress
        decision, accepted = _wire(self.decision), _wire(self.ballots.accepted)
        status = ["S", self.vote, reason, suspects, ak, decision, promised, progress, accepted]
        if self.vote == READY and self.results:
            status.append(self.results)  # (a 2.4 peer reads 9: `without_results`)
        return status

    def take_messages(self) -> list[Send]:
        return self._outbox.take()

    def next_deadline(self) -> float:
        """When `tick` has something to do next (inf once decided)."""
        if self.decision is not None:
            return math.inf
        times = [self.last_progress + self.give_up_after]
        stall = self.liveness.first_stall(self.suspected)
        if stall is not None:
            times.append(stall)
        if self.vote == NO_VOTE and not self.abort_known:
            times.append(self.liveness.data_at + self.liveness.watchdog)
        if self.ballots.deferring(self.suspected):
            times.append(self.ballots.promised_at + self.decision_timeout)
        if self.abort_known:
            times.append(self.votes.abort_known_at + self.abort_grace)
        # A deadline the last tick already passed had nothing to do (e.g. the end of a
        # deferral while someone else leads): never ask to be woken for it again. The
        # heartbeat is always due at some point (tick moves it on).
        last_tick = self.liveness.last_tick
        return min([self.liveness.next_heartbeat, *(t for t in times if t > last_tick)])

    # --- events -------------------------------------------------------------------------------

    def on_message(self, src: int, kind: str, body: Any, now: float) -> list[Any]:
        """A parsed control message from member `src`; returns the reply (our status)."""
        self.liveness.heard(src, now)
        if kind == "P":
            self._on_prepare(body, now)
        else:
            self._absorb(src, body, now)
        return self.status()

    def on_reply(self, src: int, status: Status | None, now: float, kind: str) -> None:
        """The answer to a message we sent; None: `src` does not know the round (yet)."""
        if status is not None:
            self.liveness.heard(src, now)
            self._absorb(src, status, now)
        elif self.ballots.not_started(src, kind):
            self._evaluate(now)

    def quiet(self, now: float) -> tuple[int, ...]:
        """The other members silent for a while, suspected or not (`Liveness.quiet`)."""
        return self.liveness.quiet(now)

    def heard(self, src: int, now: float) -> None:
        """Proof of life from data traffic."""
        self.liveness.heard(src, now)

    def set_progress(self, value: int, now: float) -> None:
        if self.liveness.data_progress(value, now):
            self.last_progress = now

    def suspect(self, peer: int, reason: str, now: float) -> None:
        if peer == self.me or peer in self.suspected or self.decision is not None:
            return
        leader = self.leader()
        self.suspected[peer] = reason[:MAX_REASON]
        self.last_progress = now
        if peer == leader and self.leader() != self.me:
            # Our leader is gone: ask the next one at once (its answer carries a decision
            # if it has one, e.g. the old leader's, received before it died).
            self._outbox.send([self.leader()], self.status(), "vote")
        self.ballots.give_up_on(peer)
        self._evaluate(now)

    def ready(self, now: float, results: bytes = b"") -> None:
        """Our data phase completed: vote READY (to the deciders; heartbeats tell the
        rest), with the digests of the parts' results as they came to us (`results`:
        member 0 commits only if every READY member's agree)."""
        if self.vote != NO_VOTE or self.decision is not None:
            return
        self.vote = READY
        self.results = results
        self.last_progress = now
        deciders = [j for j in {0, self.leader()} - {self.me} if j not in self.suspected]
        self._outbox.send(deciders, self.status(), "vote")
        self._evaluate(now)

    def fail(self, reason: str, suspects: tuple[int, ...] | list[int], now: float) -> None:
        """Our data phase cannot complete: veto (no-op once READY; a vote is final)."""
        if self.vote != NO_VOTE or self.decision is not None:
            return
        self.vote = VETO
        self.veto = (reason[:MAX_REASON], tuple(sorted(set(suspects) - {self.me})))
        self.votes.vetoes[self.me] = self.veto
        self.votes.know_abort(self.veto[0], now)
        self.last_progress = now
        self._broadcast("vote")
        self._evaluate(now)

    def tick(self, now: float) -> None:
        if self.decision is not None:
            return
        if self.liveness.resumed(now):  # (the silence was ours: progress restarts too)
            self.last_progress = now
        for j, silent in self.liveness.stalled(now, self.suspected):
            self.suspect(j, f"stalled (nothing heard for {silent:.1f}s)", now)
        if self.decision is not None:
            return
        if self.liveness.heartbeat_due(now):
            self._broadcast("heartbeat")
        # (Deadlines compared as in next_deadline, so that a tick at the deadline acts.)
        if self.vote == NO_VOTE and not self.abort_known and self.liveness.data_stuck(now):
            self.fail(f"no data progress for {now - self.liveness.data_at:.1f}s", (), now)
        if self.decision is None and now >= self.votes.abort_known_at + self.abort_grace:
            # ABORT is certain; we only waited for a decider's `failed` list. Enough.
            self._give_up(now)
        if self.decision is None and now >= self.last_progress + self.give_up_after:
            self._give_up(now)
        self._evaluate(now)

    # --- internals ----------------------------------------------------------------------------

    def _broadcast(self, kind: str) -> None:
        self._outbox.send(self.liveness.others(self.suspected), self.status(), kind)

    def _on_prepare(self, ballot: int, now: float) -> None:
        if self.ballots.promise(ballot, now):
            self.last_progress = now
        self._evaluate(now)

    def _absorb(self, src: int, st: Status, now: float) -> None:
        view = (st.vote, st.progress, st.decision, st.promised, st.abort_known, st.accepted)
        if self.liveness.reported(src, view):
            self.last_progress = now
        self.votes.heard(src, st.vote, st.reason, st.suspects, st.abort_known, now, st.results)
        accepted = st.accepted
        if accepted is not None and self._undecided() and self.ballots.accept(src, accepted, now):
            self.last_progress = now
        self.ballots.heard(src, st.promised, st.decision, accepted)
        if st.decision is not None:
            self._adopt(st.decision, now, src)
        self._evaluate(now)

    def _propose(self, d: Decision, now: float) -> None:
        """Decide `d` only once every member not suspected has accepted it (its owner,
        we accept it first): a decider stopped before then decided nothing, and any
        later leader finds `d` with one of them, itself included."""
        waiting = set(self.liveness.others(self.suspected))
        self.ballots.propose(d, waiting)
        self.last_progress = now
        self._outbox.send(sorted(waiting), self.status(), "accept")

    def _adopt(self, d: Decision, now: float, src: int) -> None:
        # With a veto known, COMMIT exists nowhere: any ABORT is safe to take, whatever
        # its ballot (it brings the decider's `failed`, which the retry should share).
        if self._undecided() and (
            d.ballot >= self.ballots.promised or (self.abort_known and not d.commit)
        ):
            # Straight from its decider, who tells everyone: nothing to relay. Learned
            # second-hand, the decider may have died halfway: pass it on (not after we
            # gave up: our driver has stopped sending).
            relay = src != d.ballot % self.n and self.decision is None
            self._decide(d, now, kind="relay" if relay else None)

    def _undecided(self) -> bool:
        """No decision, or only our give-up in doubt: after it we still accept proposals
        and take decisions (the others may need our acceptance to decide; what we
        learn is what our driver reports), we only stop leading."""
        return self.decision is None or self.decision.in_doubt

    def _decide(self, d: Decision, now: float, *, kind: str | None) -> None:
        """Decide `d`; `kind`: how to spread it ("decision": ours, "relay", None)."""
        self.decision = d
        self.ballots.clear()
        self.last_progress = now
        if d.ballot >= 0 and kind is not None:
            # Not to the failed: a stalled member would hold the sender up, and the
            # survivors do not wait for it.
            others = self.liveness.others(self.suspected)
            dests = [j for j in others if j not in d.failed and not self.knows_decided(j)]
            self._outbox.send(dests, self.status(), kind)

    def _failed(self) -> frozenset[int]:
        return self.votes.failed(self.suspected)

    def _reason(self) -> str:
        return self.votes.reason(self.suspected, self.names)

    def _evaluate(self, now: float) -> None:
        b = self.ballots
        if self.decision is not None:
            return
        if b.proposal is not None:
            chosen = b.chosen()  # accepted by every member not suspected
            if chosen is None:
                return
            d, accepted_by = chosen
            if accepted_by < self.accept_quorum and not self.abort_known:
                return self._decide(self._short_of_quorum("accepted our proposal"), now, kind=None)
            d = Decision(d.ballot, d.commit, d.reason, d.failed | self._failed())
            return self._decide(d, now, kind="decision")
        if self.leader() != self.me:
            return
        if b.deferring(self.suspected) and now < b.promised_at + self.decision_timeout:
            return
        if self.me == 0 and b.promised == 0:
            choice = self.votes.ballot_0(
                self.vote, self.n, self.suspected, self.names, self.results
            )
            self._settle(choice, now)
            return
        if self.vote == NO_VOTE and not self.abort_known:
            return  # still moving data; a member we need that failed will make us veto
        if b.takeover is None:
            waiting = set(self.liveness.others(self.suspected))
            if 1 + len(waiting) < self.prepare_quorum and not self.abort_known:
                return self._without_quorum(now)
            ballot = b.lead(waiting, now)
            if ballot is None:
                return
            self.last_progress = now
            self._outbox.send(sorted(waiting), ["P", ballot], "prepare")
        found = b.takeover_decision(self._reason(), self._failed())
        if found is not None:  # (None: answers missing)
            if b.promises() < self.prepare_quorum and not self.abort_known:
                return self._without_quorum(now)  # (members lost while we asked)
            d, decided = found
            # Decided already (by its owner, after its own phase 2 where one was needed),
            # or an ABORT while a veto rules out COMMIT everywhere: nothing can differ.
            self._settle((d, not (decided or (self.abort_known and not d.commit))), now)

    def _without_quorum(self, now: float) -> None:
        """We would lead a takeover, but fewer members than its quorum are left (every
        other one suspected: dead, stopped, or on the other side of a partition that
        may be deciding without us). We voted READY and know no veto, so COMMIT may
        have been decided out of our sight; an ABORT of ours could contradict it, and
        our caller would retry an input counted already (the soak's
        `double_counted`). What we accepted we decide if enough members accepted it to
        make it the round's (`known_acceptors`); else we are in doubt, still accepting
        proposals and taking decisions (the driver asks the others once more)."""
        b = self.ballots
        a = b.accepted
        if a is not None and b.known_acceptors() >= self.accept_quorum:
            d = Decision(a.ballot, a.commit, a.reason, a.failed | self._failed())
            return self._decide(d, now, kind="relay")
        self._decide(self._short_of_quorum("answer a takeover"), now, kind=None)

    def _short_of_quorum(self, what: str) -> Decision:
        """In doubt: fewer members than a quorum were left to `what`."""
        left = self.n - len(self.suspected)
        why = (f"in doubt: voted READY, then only {left} of {self.n} members were left to "
               f"{what} before a decision")  # fmt: skip
        return Decision(LOCAL, False, why, self._failed(), in_doubt=True)

    def _settle(self, chosen: tuple[Decision, bool] | None, now: float) -> None:
        """Propose (True) or decide at once (False) the decision chosen, if any."""
        if chosen is not None and chosen[1]:
            self._propose(chosen[0], now)
        elif chosen is not None:
            self._decide(chosen[0], now, kind="decision")

    def _give_up(self, now: float) -> None:
        failed = self._failed()
        if self.vote == NO_VOTE:
            self.fail("no decision reached in time", (), now)
            if self.decision is not None:
                return
        d = self.votes.given_up(failed, self.suspected, self.names, self.give_up_after)
        self._decide(d, now, kind=None)
