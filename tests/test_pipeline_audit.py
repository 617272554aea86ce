"""Stage audits (sans network): every cheat the issue names is caught by one audit,
honest answers computed in batches pass against a lone recomputation, commitments
and evidence check offline, disputes convict or acquit by majority."""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Iterator

import pytest
import torch

from shoal.averaging.compression import get_codec
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.audit import AuditRequest, OutputStore, recompute, seal, wire_roundtrip
from shoal.pipeline.stage import StageWorker
from shoal.transport.identity import Identity
from shoal.verification.evidence import EvidenceError, Result
from shoal.verification.stage_audit import (
    StageAuditPolicy,
    StageCommitment,
    StageDispute,
    StageEvidence,
    StageOutcome,
    draw_referees,
    judge_tokens,
    nonce_commit,
    verdict_for,
)

# 6 layers in 3 stages: the middle stage has two blocks (one can be skipped).
SIX = {"d_model": 32, "n_layers": 6, "n_heads": 2, "context": 32, "batch_size": 4}
INT8 = get_codec("int8")
POLICY = StageAuditPolicy()
TRIALS = 100


@pytest.fixture(scope="module")
def setup() -> Iterator[dict]:
    # One thread: tiny matmuls across two threads of a loaded machine wait on each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _setup()
    finally:
        torch.set_num_threads(threads)


def _setup() -> dict:
    torch.manual_seed(0)
    task = make_task(SIX)
    stages = task.make_stages(7, 3)
    batches = task.batches(0, 1, 0)
    inputs = [
        wire_roundtrip(stages[0](task.stage_inputs(next(batches))).detach(), INT8)
        for _ in range(TRIALS + 1)
    ]
    current = copy.deepcopy(stages[1])
    stale = copy.deepcopy(stages[1])
    # The current weights are 10 AdamW steps (the swarm's lr) past the stale ones.
    whole = torch.nn.Sequential(copy.deepcopy(stages[0]), current, copy.deepcopy(stages[2]))
    opt = torch.optim.AdamW(current.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(10):
        batch = next(batches)
        opt.zero_grad()
        task.stage_loss(whole(task.stage_inputs(batch)), batch).backward()
        opt.step()
    return {"worker": StageWorker(current), "stale": stale, "inputs": inputs}


def _cheats(setup: dict, i: int) -> dict[str, torch.Tensor]:
    worker, x = setup["worker"], setup["inputs"][i]
    module = worker.module
    with torch.no_grad():
        honest = module(x)
        noise = torch.randn_like(honest)
        return {
            "random": torch.randn_like(honest) * honest.std(),
            "zeros": torch.zeros_like(honest),
            "identity": x.clone(),
            "skipped layer": module.blocks[0](x),
            "replayed microbatch": module(setup["inputs"][i + 1]),
            "weights 10 steps old": setup["stale"](x),
            "noise 1e-2": honest + noise * (0.01 * honest.norm() / noise.norm()),
            "scale x1.05": honest * 1.05,
        }


def test_every_cheat_is_caught_by_one_audit_in_100_trials(setup: dict) -> None:
    """Per cheat, 100 audits (other inputs, fresh seeds) of the full-precision answer (the
    prover's signature under the referee's seed, or its revealed result): all fail, so
    the detection of each is >= 0.999 per audit (100/100). The same cheats judged on the
    answer as it reaches the trainer through the int8 wire codec are caught too."""
    caught: dict[str, int] = {}
    on_wire: dict[str, int] = {}
    for i in range(TRIALS):
        x = setup["inputs"][i]
        recomputed = recompute(setup["worker"], 0, "forward", x)
        received = wire_roundtrip(recomputed, INT8)
        for name, claimed in _cheats(setup, i).items():
            j = judge_tokens(claimed, recomputed, f"{name}{i}".encode(), POLICY)
            caught[name] = caught.get(name, 0) + (j.result is Result.FAIL)
            j = judge_tokens(
                wire_roundtrip(claimed, INT8), received, f"w{name}{i}".encode(), POLICY
            )
            on_wire[name] = on_wire.get(name, 0) + (j.result is Result.FAIL)
    assert len(caught) == 8
    assert caught == dict.fromkeys(caught, TRIALS), caught
    assert on_wire == dict.fromkeys(caught, TRIALS), on_wire


def test_cheated_input_gradients_are_caught(setup: dict) -> None:
    """Backward answers: noise 1e-2, a x1.05 scale and stale weights on the input gradient."""
    worker = setup["worker"]
    for i in range(30):
        x = setup["inputs"][i]
        g = wire_roundtrip(torch.randn_like(x), INT8)
        honest = recompute(worker, 0, "backward", x, g)
        xs = x.detach().requires_grad_(True)
        (stale,) = torch.autograd.grad(setup["stale"](xs), [xs], g)
        noise = torch.randn_like(honest)
        for claimed in (
            honest + noise * (0.01 * honest.norm() / noise.norm()),
            honest * 1.05,
            stale,
        ):
            j = judge_tokens(claimed, honest, os.urandom(16), POLICY)
            assert j.result is Result.FAIL


def test_10000_honest_audits_pass(setup: dict) -> None:
    """Honest answers computed in batches of 1..64 requests of mixed sizes (as a stage
    server batches them), forward and backward, judged against a lone recomputation
    under fresh seeds: 10,000 audits, no failure."""
    worker = setup["worker"]
    rng = random.Random(1)
    pairs = []
    for n in (1, 3, 8, 24, 64):
        xs = [wire_roundtrip(torch.randn(rng.choice([1, 3, 4, 5]), 32, 32), INT8) for _ in range(n)]
        outs = worker.forward_many(xs)
        gs = [wire_roundtrip(torch.randn_like(o), INT8) for o in outs]
        grads = worker.backward_many([(f"h{n}.{i}", x, g, len(x)) for i, (x, g) in
                                      enumerate(zip(xs, gs, strict=True))])  # fmt: skip
        for x, out, g, (grad, _) in zip(xs, outs, gs, grads, strict=True):
            pairs.append((out, recompute(worker, 0, "forward", x)))
            pairs.append((grad, recompute(worker, 0, "backward", x, g)))
    pairs = [(wire_roundtrip(a, INT8), wire_roundtrip(b, INT8)) for a, b in pairs]
    failures = 0
    for k in range(10_000):
        claimed, recomputed = pairs[k % len(pairs)]
        seed = k.to_bytes(8, "little") + b"honest"
        failures += judge_tokens(claimed, recomputed, seed, POLICY).result is not Result.PASS
    assert failures == 0


def test_a_referee_at_another_version_cannot_recompute(setup: dict) -> None:
    worker = setup["worker"]
    assert recompute(worker, 1, "forward", setup["inputs"][0]) is None
    worker.version = None  # (a state download under way)
    try:
        assert recompute(worker, 0, "forward", setup["inputs"][0]) is None
    finally:
        worker.version = 0


def _commitment(prover: Identity, nonce: bytes, out: torch.Tensor) -> StageCommitment:
    request = AuditRequest("t/1/1", nonce_commit(nonce), INT8)
    return seal(prover, "x", 1, "forward", 0, request, (torch.ones(2, 3),), out)


def test_commitments_sign_what_the_trainer_decodes_and_outputs_are_kept() -> None:
    prover, nonce = Identity.generate(), os.urandom(16)
    out = torch.randn(2, 4, 32)
    c = _commitment(prover, nonce, out)
    assert StageCommitment.decode(c.encode()) == c
    store = OutputStore(max_bytes=10 * out.numel() * 4)
    store.keep(c.digest(), out, INT8)
    revealed = store.reveal(c.digest())
    assert revealed is not None and torch.equal(revealed, wire_roundtrip(out, INT8))
    from shoal.verification.stage_audit import tensor_hash

    assert tensor_hash(revealed) == c.output and tensor_hash(out) == c.full
    tampered = c.encode().replace(c.output, bytes(32))
    with pytest.raises(EvidenceError):
        StageCommitment.decode(tampered)
    for i in range(20):  # the byte bound forgets the oldest
        store.keep(bytes([i]) * 32, out, INT8)
    assert store.reveal(c.digest()) is None and len(store) == 10


def _dispute(verdicts: list[Result]) -> tuple[StageDispute, list[Identity]]:
    prover, nonce = Identity.generate(), os.urandom(16)
    referees = [Identity.generate() for _ in range(5)]
    c = _commitment(prover, nonce, torch.randn(1, 2, 8))
    dispute = StageDispute(c, nonce, [r.peer_id for r in referees] + [prover.peer_id])
    by_id = {r.peer_id: r for r in referees}
    assert prover.peer_id not in dispute.order and len(dispute.order) == 5
    results = iter(verdicts)
    while (peer := dispute.next_referee()) is not None:
        j = judge_tokens(torch.ones(4, 8), torch.ones(4, 8), dispute.seed_for(peer))
        j = type(j)(next(results), j.comparison, j.flip_limit, j.max_token_norm_gap)
        dispute.add(verdict_for(by_id[peer], c, j))
    return dispute, referees


def test_two_accusers_of_three_convict_with_evidence_anyone_checks() -> None:
    dispute, _ = _dispute([Result.FAIL, Result.PASS, Result.FAIL])
    assert dispute.outcome is StageOutcome.CONVICTED
    evidence = StageEvidence.decode(dispute.evidence().encode())
    assert evidence.check() == dispute.commitment.prover
    # A bundle missing an accuser, or with the nonce changed, proves nothing.
    with pytest.raises(EvidenceError):
        StageEvidence(evidence.commitment, evidence.nonce, evidence.candidates,
                      evidence.verdicts[:2]).check()  # fmt: skip
    with pytest.raises(EvidenceError):
        StageEvidence(evidence.commitment, os.urandom(16), evidence.candidates,
                      evidence.verdicts).check()  # fmt: skip


def test_a_false_accusation_is_overruled_and_struck() -> None:
    dispute, _ = _dispute([Result.FAIL, Result.PASS, Result.PASS])
    assert dispute.outcome is StageOutcome.ACQUITTED
    assert dispute.overruled() == [dispute.order[0]]
    with pytest.raises(EvidenceError):
        dispute.evidence()
    passed, _ = _dispute([Result.PASS])
    assert passed.outcome is StageOutcome.PASSED and len(passed.verdicts) == 1


def test_the_draw_is_fixed_by_the_commitment_and_the_nonce() -> None:
    prover, nonce = Identity.generate(), os.urandom(16)
    peers = [Identity.generate().peer_id for _ in range(6)]
    c = _commitment(prover, nonce, torch.randn(1, 2, 8))
    a = draw_referees(c, nonce, peers)
    assert a == draw_referees(c, nonce, list(reversed(peers)))
    firsts = {draw_referees(c, os.urandom(16), peers)[0] for _ in range(60)}
    assert len(firsts) == 6  # every peer is drawn first for some nonce
