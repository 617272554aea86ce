"""A peer's log of its own work and the audit of one segment of it.

The trainer's steps are logged into checkpoints that a commitment carries; a
reveal built from the log matches the commitment; an audit of an honest reveal
passes, and every way a reveal can lie is named: altered states, a
pseudo-gradient that is not the run's, a start that is not the global state.
A log kept under a small memory budget re-runs the states it dropped and gets
them bit for bit. A log that spills its states to disk reveals the same ones,
never one whose file was altered, and leaves no file behind a round it let go;
a daemon's log holds at most `--work-log-max` of states, RAM and disk together."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from verification_round import audited_round

from shoal.peer.cli import parse_command_line
from shoal.peer.config import ConfigError
from shoal.peer.session import work_log_for
from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.task import load_task, shard_of
from shoal.peer.verify import work_log as work_log_module
from shoal.peer.verify.audit_round import (
    AuditRound,
    EndNeeded,
    check_against_end,
    check_segment,
    check_segment_exact,
)
from shoal.peer.verify.reveals import Replay, Reveal, reveal_of
from shoal.peer.verify.segments import (
    SegmentRunner,
    SegmentState,
    flat_difference,
    optimizer_hash,
    params_hash,
    round_batch_seed,
)
from shoal.peer.verify.spill import Spilled
from shoal.peer.verify.work_log import DEFAULT_SPILL_BYTES, WorkLog, state_bytes
from shoal.transport.identity import Identity
from shoal.verification.audit import AuditPolicy
from shoal.verification.commitment import Commitment, state_digest
from shoal.verification.evidence import Result

pytestmark = pytest.mark.timeout(120)

NS = "shoal/x/test"
ROUND = 3
SHARDS = 8
EVERY = 3
STEPS = 8  # two full segments and a sealed tail of 2


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return load_task("bytegpt", {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16,
                                 "batch_size": 2})  # fmt: skip


def train(task, me: Identity, log: WorkLog, hyper):  # type: ignore[no-untyped-def]
    """What the trainer does in one verified round: its round's batches, logged steps."""
    runner = SegmentRunner(task, hyper)
    model, inner = runner.model, runner.inner
    log.begin(ROUND, 40, model, inner)
    batches = task.batches(shard_of(me.peer_id.to_bytes(), SHARDS), SHARDS,
                           round_batch_seed(NS, me.peer_id, ROUND))  # fmt: skip
    for i in range(STEPS):
        batch = next(batches)
        inner.step(lambda b=batch: task.loss(model, b), 40 + i)
        log.after_step(model, inner, int(task.batch_tokens(batch)))
    work = log.seal(model, inner)
    log.begin(ROUND + 1, 40 + STEPS, model, inner)  # the next round (writes what is past RAM)
    return work, model


def setup(task, retain_bytes: int = 1 << 30, **log_options):  # type: ignore[no-untyped-def]
    hyper = check_hyperparameters({"warmup_steps": 0})
    me = Identity.from_seed(hashlib.sha256(b"prover").digest())
    log = WorkLog(EVERY, retain_bytes=retain_bytes, **log_options)
    work, model = train(task, me, log, hyper)
    c, verified, rnd = audited_round(log, work, me, list(model.parameters()), namespace=NS,
                                     shards=SHARDS)  # fmt: skip
    return hyper, work, verified, c, rnd


def reveal(task, hyper, work, verified, c: Commitment, segment: int, final: bool = False) -> Reveal:  # type: ignore[no-untyped-def]
    """The prover's reveal of `segment`; with the run's `final` state as for a 2.0 referee."""
    replay = Replay(SegmentRunner(task, hyper), task, verified, SHARDS)
    first, end = c.segment_bounds(segment)
    last = replay.state_after(work, work.steps) if final else None
    return reveal_of(replay.state_after(work, first), replay.state_after(work, end), last)


def audit(task, hyper, rnd, c, segment, r: Reveal):  # type: ignore[no-untyped-def]
    return check_segment(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment, r,
                         b"seed", AuditPolicy())  # fmt: skip


def test_the_log_holds_a_checkpoint_every_k_steps_and_a_sealed_end(task) -> None:  # type: ignore[no-untyped-def]
    _, work, _, c, _ = setup(task)
    assert c.segments == 3 and c.segment_bounds(2) == (6, 8)
    assert len(work.checkpoints) == 2 and work.sealed is not None and work.sealed[0] == 8
    assert work.digest_at(0) == c.segment_start(0)
    assert [work.digest_at(s) for s in (3, 6, 8)] == list(c.checkpoints)


@pytest.mark.parametrize("final", [False, True], ids=["today", "with-final"])
@pytest.mark.parametrize("segment", [0, 1, 2])
def test_an_honest_reveal_matches_the_commitment_and_passes_its_audit(  # type: ignore[no-untyped-def]
    task, segment: int, final: bool
) -> None:
    hyper, work, verified, c, rnd = setup(task)
    r = reveal(task, hyper, work, verified, c, segment, final)
    assert (r.final_params is not None) == final
    assert r.problem(c, segment) is None
    finding = audit(task, hyper, rnd, c, segment, r)
    assert finding.result is Result.PASS and finding.flips == 0, finding


def test_every_lie_in_a_reveal_is_named(task) -> None:  # type: ignore[no-untyped-def]
    hyper, work, verified, c, rnd = setup(task)
    honest = reveal(task, hyper, work, verified, c, 1, final=True)

    def altered(**kw) -> Reveal:  # type: ignore[no-untyped-def]
        fields = dict(honest.__dict__)
        fields.update(kw)
        return Reveal(**fields)

    bumped = [p.clone() for p in honest.end_params]
    bumped[0][0] += 1e-3
    assert "end state" in (altered(end_params=bumped).problem(c, 1) or "")
    assert "final state" in (altered(final_optimizer=b"\0" * 32).problem(c, 1) or "")
    start = type(honest.start)([p.clone() for p in honest.start.params], honest.start.optimizer)
    start.params[1][0] += 1e-3
    assert "start state" in (altered(start=start).problem(c, 1) or "")
    assert audit(task, hyper, rnd, c, 1, altered(end_params=bumped)).result is Result.BAD_REVEAL
    # A commitment whose pseudo-gradient root is not the run's (honest states, other bytes
    # sent), against the final state a 2.0 prover reveals.
    other = Commitment(**{**c.__dict__, "delta_root": hashlib.sha256(b"x").digest(),
                          "signature": b""})  # fmt: skip
    finding = audit(task, hyper, rnd, other, 1, honest)
    assert finding.result is Result.FAIL and "pseudo-gradient" in finding.why
    # Work that did not start from the round's global state.
    wrong_start = [p + 1 for p in verified.log.state_at(work, 0).params]
    stale = AuditRound(**{**rnd.__dict__, "start_params": wrong_start})
    finding = audit(task, hyper, stale, c, 1, honest)
    assert finding.result is Result.FAIL and "global state" in finding.why


def test_what_was_sent_is_checked_against_the_run_s_end_when_the_last_segment_is_audited(  # type: ignore[no-untyped-def]
    task,
) -> None:
    """A prover that sends other bytes than its run's end gives (start minus end) is
    caught by the audit of its last segment, whose end is the run's: without the final
    state revealed (a fifth model size). Another segment's audit cannot catch it, with
    or without that state: the prover could have committed a last checkpoint that
    matches what it sent, and only re-running the last segment checks that one."""
    hyper, work, verified, c, rnd = setup(task)
    other = Commitment(**{**c.__dict__, "delta_root": hashlib.sha256(b"x").digest(),
                          "signature": b""})  # fmt: skip
    last = c.segments - 1
    finding = audit(task, hyper, rnd, other, last, reveal(task, hyper, work, verified, c, last))
    assert finding.result is Result.FAIL and "pseudo-gradient" in finding.why
    for segment in range(last):  # (the honest run is re-run alike: nothing else to see)
        r = reveal(task, hyper, work, verified, c, segment)
        assert audit(task, hyper, rnd, other, segment, r).result is Result.PASS


@pytest.mark.parametrize("segment", [0, 1, 2])
def test_an_audit_that_consumes_its_reveal_finds_what_a_copying_one_finds(  # type: ignore[no-untyped-def]
    task, segment: int
) -> None:
    """A referee re-runs the reveal's own optimizer state in place (`consume`: no copy
    of the moments) and reads only the reveal's end afterwards: the same verdict, the
    same bits compared, and the end it signs is still the one revealed."""
    hyper, work, verified, c, rnd = setup(task)
    copied = audit(task, hyper, rnd, c, segment, reveal(task, hyper, work, verified, c, segment))
    r = copy.deepcopy(reveal(task, hyper, work, verified, c, segment))  # as read from the wire
    end = r.end_digest()
    consumed = check_segment(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment, r,
                             b"seed", AuditPolicy(), consume=True)  # fmt: skip
    assert consumed == copied and consumed.result is Result.PASS
    assert r.start.optimizer == {} and r.end_digest() == end
    # A prover that sent other bytes than its run's is caught alike (the last segment).
    other = Commitment(**{**c.__dict__, "delta_root": hashlib.sha256(b"x").digest(),
                          "signature": b""})  # fmt: skip
    r = copy.deepcopy(reveal(task, hyper, work, verified, c, segment))
    lie = check_segment(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, other, segment, r,
                        b"seed", AuditPolicy(), consume=True)  # fmt: skip
    assert lie.result is (Result.FAIL if segment == c.segments - 1 else Result.PASS)


def withheld(task, hyper, work, verified, c: Commitment, segment: int):  # type: ignore[no-untyped-def]
    """The prover's reveal of `segment` without its end (as a 2.6 referee asks), and
    the end it withheld."""
    replay = Replay(SegmentRunner(task, hyper), task, verified, SHARDS)
    first, end = c.segment_bounds(segment)
    stop = replay.state_after(work, end)
    return reveal_of(replay.state_after(work, first), stop, with_end=False), stop


def exact(task, hyper, rnd, c, segment, r: Reveal):  # type: ignore[no-untyped-def]
    return check_segment_exact(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment,
                               copy.deepcopy(r), consume=True)  # fmt: skip


@pytest.mark.parametrize("segment", [0, 1, 2])
def test_a_re_run_that_ends_in_the_committed_state_passes_without_the_end_revealed(  # type: ignore[no-untyped-def]
    task, segment: int
) -> None:
    """The end is the one part of a reveal an honest re-run reproduces: hashed against
    the commitment's checkpoint, equal bits are a pass, and the reveal is a model size
    smaller. What was sent is still checked against the run's end (the re-run's, in the
    last segment's audit)."""
    hyper, work, verified, c, rnd = setup(task)
    r, _ = withheld(task, hyper, work, verified, c, segment)
    assert r.end_params is None and r.problem(c, segment) is None
    finding = exact(task, hyper, rnd, c, segment, r)
    assert finding.result is Result.PASS and "bit for bit" in finding.why, finding
    other = Commitment(**{**c.__dict__, "delta_root": hashlib.sha256(b"x").digest(),
                          "signature": b""})  # fmt: skip
    lie = exact(task, hyper, rnd, other, segment, r)
    assert lie.result is (Result.FAIL if segment == c.segments - 1 else Result.PASS), lie


def test_a_re_run_that_ends_elsewhere_is_judged_against_the_end_the_prover_then_reveals(  # type: ignore[no-untyped-def]
    task,
) -> None:
    """Another machine's rounding makes an honest re-run end in other bits: the referee
    then asks for the end and compares it by LSH, as a whole reveal was. A prover that
    committed an end its steps do not give (the update reversed here) reaches the same
    comparison and fails it; an end that is not the committed one is a malformed reveal."""
    hyper, work, verified, c, rnd = setup(task)
    r, stop = withheld(task, hyper, work, verified, c, 1)
    # The honest end compared with a re-run's (as when its bits differ): a pass.
    honest = copy.deepcopy(r)
    honest.end_params = stop.params
    rerun = EndNeeded(flat_difference(r.start.params, stop.params))
    finding = check_against_end(rnd, c, 1, honest, rerun, b"seed", AuditPolicy())
    assert finding.result is Result.PASS and finding.flips == 0, finding
    # A commitment to a reversed update: the re-run's end is not it, the end is asked for.
    reversed_end = [2 * s - e for s, e in zip(r.start.params, stop.params, strict=True)]
    checkpoints = list(c.checkpoints)
    checkpoints[1] = state_digest(params_hash(reversed_end), optimizer_hash(stop.optimizer))
    lied = Commitment(**{**c.__dict__, "checkpoints": tuple(checkpoints), "signature": b""})
    needed = exact(task, hyper, rnd, lied, 1, r)
    assert isinstance(needed, EndNeeded)
    assert torch.equal(needed.rerun, rerun.rerun)  # (the re-run is the honest one)
    cheat = copy.deepcopy(r)
    cheat.end_params = reversed_end
    finding = check_against_end(rnd, lied, 1, cheat, needed, b"seed", AuditPolicy())
    assert finding.result is Result.FAIL and finding.flips > 0, finding
    # An end that is not the committed one.
    finding = check_against_end(rnd, lied, 1, honest, needed, b"seed", AuditPolicy())
    assert finding.result is Result.BAD_REVEAL and "end state" in finding.why


def test_a_flat_difference_is_the_difference_of_the_concatenations() -> None:
    g = torch.Generator().manual_seed(1)
    a = [
        torch.randn(3, 4, generator=g),
        torch.randn(5, generator=g),
        torch.randn(1, 1, generator=g),
    ]
    b = [torch.randn_like(t) for t in a]
    expected = torch.cat([t.reshape(-1) for t in a]) - torch.cat([t.reshape(-1) for t in b])
    assert torch.equal(flat_difference(a, b), expected)
    with pytest.raises(ValueError, match="shapes"):
        flat_difference(a, [b[0], b[1].reshape(5, 1), b[2]])


def test_states_dropped_under_a_small_budget_are_re_run_bit_for_bit(task) -> None:  # type: ignore[no-untyped-def]
    hyper, work, verified, c, rnd = setup(task, retain_bytes=1)
    assert sorted(work.snapshots) == [0]  # only the start is always kept
    for segment in range(c.segments):
        r = reveal(task, hyper, work, verified, c, segment)
        assert r.problem(c, segment) is None
        assert audit(task, hyper, rnd, c, segment, r).result is Result.PASS


def test_a_round_is_kept_for_the_retention_window(task) -> None:  # type: ignore[no-untyped-def]
    hyper = check_hyperparameters({})
    runner = SegmentRunner(task, hyper)
    log = WorkLog(EVERY, keep_rounds=1, retain_s=3600)
    for r in range(4):
        log.begin(r, 0, runner.model, runner.inner)
    assert all(log.get(r) is not None for r in range(4))  # none ended an hour ago
    log = WorkLog(EVERY, keep_rounds=2, retain_s=0)
    for r in range(4):
        log.begin(r, 0, runner.model, runner.inner)
    assert [r for r in range(4) if log.get(r) is not None] == [2, 3]


def test_a_round_index_done_twice_from_two_states_keeps_both(task) -> None:  # type: ignore[no-untyped-def]
    """A peer that re-synced onto a lineage at a lower commit count does an index's work
    again from another global state: each round's work stays, found by its start (a
    referee of the first round was answered from the second's work, or not at all);
    a re-run from the same state (a reset mid-round) replaces the round's work."""
    hyper = check_hyperparameters({})
    runner = SegmentRunner(task, hyper)
    log = WorkLog(EVERY, keep_rounds=4, retain_s=3600)
    first = log.begin(7, 0, runner.model, runner.inner)
    with torch.no_grad():
        for p in runner.model.parameters():
            p.add_(1.0)  # (the state of the lineage re-synced onto)
    second = log.begin(7, 0, runner.model, runner.inner)
    assert first.start_params != second.start_params
    assert log.get(7, first.start_params) is first and log.get(7, second.start_params) is second
    assert log.get(7) is second  # (no start named: the last begun, as a 2.3 referee asks)
    again = log.begin(7, 0, runner.model, runner.inner, resets=1)
    assert log.get(7, second.start_params) is again and log.get(7, first.start_params) is first
    assert log.start_params(7, first.start_params)[0].shape == first.snapshots[0].params[0].shape


def test_states_spilled_to_disk_reveal_what_states_kept_in_ram_reveal(task, tmp_path) -> None:  # type: ignore[no-untyped-def]
    hyper, work, verified, c, _ = setup(task)
    _, spilled, on_disk, _, disk_rnd = setup(task, spill_dir=tmp_path / "wl", memory_states=0)
    assert all(isinstance(k, Spilled) for _, k in spilled.kept())  # nothing left in RAM
    assert len(on_disk.log.spilled_files()) == len(spilled.kept()) + 1 == 5  # 0, 3, 6, 8; next
    for step in (0, 3, 6, 8):
        back = on_disk.log.state_at(spilled, step)
        assert back is not None and back.digest() == work.digest_at(step)
    for segment in range(c.segments):
        kept = reveal(task, hyper, work, verified, c, segment, final=True)
        read_back = reveal(task, hyper, spilled, on_disk, c, segment, final=True)
        assert read_back.start.digest() == kept.start.digest()
        pairs = zip(read_back.final_params + read_back.end_params,
                    kept.final_params + kept.end_params, strict=True)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in pairs)
        assert read_back.problem(c, segment) is None
        assert audit(task, hyper, disk_rnd, c, segment, read_back).result is Result.PASS


def test_only_the_newest_states_stay_in_ram(task, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, work, verified, _, _ = setup(task, spill_dir=tmp_path / "wl", memory_states=2)
    in_ram = [s for s, k in work.kept() if not isinstance(k, Spilled)]
    assert in_ram == [8]  # and the next round's start
    assert len(verified.log.spilled_files()) == 3


@pytest.mark.parametrize("memory_states", [0, 1, 2])
def test_ram_never_holds_more_than_the_newest_states_not_even_while_one_is_captured(  # type: ignore[no-untyped-def]
    task, tmp_path, monkeypatch, memory_states: int
) -> None:
    """What would be past `memory_states` with a new state is written before that
    state is taken (a state is 3 model sizes with Adam): the peak is the budget."""
    log = WorkLog(EVERY, spill_dir=tmp_path / "wl", memory_states=memory_states)
    held_at_capture: list[int] = []
    real_capture = work_log_module.capture

    def counting_capture(model, inner):  # type: ignore[no-untyped-def]
        held_at_capture.append(sum(
            isinstance(k, SegmentState) for r in range(ROUND + 2)
            if (w := log.get(r)) is not None for _, k in w.kept()
        ))  # fmt: skip
        return real_capture(model, inner)

    monkeypatch.setattr(work_log_module, "capture", counting_capture)
    me = Identity.from_seed(hashlib.sha256(b"prover").digest())
    train(task, me, log, check_hyperparameters({"warmup_steps": 0}))
    # The round's start, 2 checkpoints, the seal (taken while the round waits: it is
    # written at the next begin), and the next round's start.
    begin, checkpoint_3, checkpoint_6, seal, next_begin = held_at_capture
    assert max(begin, checkpoint_3, checkpoint_6, next_begin) <= max(0, memory_states - 1)
    assert seal <= memory_states  # (one more, for a moment: the commitment waits on it)


def test_a_corrupt_spilled_state_is_re_run_or_the_reveal_fails(task, tmp_path) -> None:  # type: ignore[no-untyped-def]
    hyper, work, verified, c, _ = setup(task)
    _, spilled, on_disk, _, _ = setup(task, spill_dir=tmp_path / "wl", memory_states=0)
    honest = reveal(task, hyper, work, verified, c, 1)  # states after 3, 6 and 8 steps
    files = {s: k.path for s, k in spilled.kept() if isinstance(k, Spilled)}
    files[3].write_bytes(files[3].read_bytes()[:-100])  # truncated
    files[6].write_bytes(files[8].read_bytes())  # a whole file, of another state
    assert on_disk.log.state_at(spilled, 3) is None and on_disk.log.state_at(spilled, 6) is None
    r = reveal(task, hyper, spilled, on_disk, c, 1)  # both re-run from the start
    assert r.start.digest() == honest.start.digest() and r.problem(c, 1) is None
    files[0].write_bytes(b"not a state")
    with pytest.raises(RuntimeError, match="no intact state"):
        reveal(task, hyper, spilled, on_disk, c, 1)


def test_spilled_files_go_with_their_round_and_at_start_up(task, tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = SegmentRunner(task, check_hyperparameters({}))
    folder = tmp_path / "wl"
    folder.mkdir()
    (folder / "r7-s0-1.pt").write_bytes(b"a previous run's")
    log = WorkLog(EVERY, keep_rounds=2, retain_s=0, spill_dir=folder, memory_states=0)
    assert log.spilled_files() == []
    for r in range(4):
        log.begin(r, 0, runner.model, runner.inner)
    assert [p.name.split("-")[0] for p in log.spilled_files()] == ["r2", "r3"]
    # Past its byte budget a spilling log lets rounds go inside the window too.
    two = 2 * state_bytes(runner.capture())
    log = WorkLog(EVERY, keep_rounds=2, retain_bytes=two, spill_dir=folder, memory_states=0)
    for r in range(4):
        log.begin(r, 0, runner.model, runner.inner)
    assert [r for r in range(4) if log.get(r) is not None] == [2, 3]
    assert len(log.spilled_files()) == 2


def test_a_daemons_work_log_holds_at_most_work_log_max_of_states(task, tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = SegmentRunner(task, check_hyperparameters({}))
    two = 2 * state_bytes(runner.capture())
    _, config = parse_command_line(
        ["run", "--data-dir", str(tmp_path), "--work-log-max", str(two)], {}
    )
    log = work_log_for(config, "exp1", AuditPolicy(segment_steps=EVERY))
    assert log.retain_bytes == two and log.every == EVERY
    for r in range(4):  # (inside the audit window: only the bound lets rounds go)
        log.begin(r, 0, runner.model, runner.inner)
    assert [r for r in range(4) if log.get(r) is not None] == [2, 3]
    assert {p.parent for p in log.spilled_files()} <= {tmp_path / "work-log" / "exp1"}

    _, config = parse_command_line(
        ["run", "--data-dir", str(tmp_path)], {"SHOAL_WORK_LOG_MAX": "2G"}
    )
    assert work_log_for(config, "exp1", AuditPolicy()).retain_bytes == 2 << 30
    _, config = parse_command_line(["run", "--data-dir", str(tmp_path)], {})
    assert (
        work_log_for(config, "exp1", AuditPolicy()).retain_bytes == DEFAULT_SPILL_BYTES == 8 << 30
    )
    with pytest.raises(ConfigError, match="--work-log-max"):
        parse_command_line(["run", "--work-log-max", "lots"], {})
