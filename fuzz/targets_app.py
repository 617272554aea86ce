"""Fuzz targets for the application layers' decoders of untrusted input: pipeline
requests, headers and records, stage-audit commitments and evidence, the
verification round's records, and the DHT reports behind /peers and /swarm
(the registry is `targets.TARGETS`)."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace
from typing import Any

import torch
from harness import REMOTE_IDENTITY, Target, expect, message, run_now

from shoal.averaging.compression import CodecError
from shoal.dht.records import owner_marker
from shoal.peer import node
from shoal.peer.experiment import _valid_manifests
from shoal.peer.status.swarm_history import SwarmHistory
from shoal.peer.training import state_codes
from shoal.peer.training.task_error import TaskError
from shoal.peer.training.tasks.hf_data import rebuild_bpe
from shoal.peer.verify import audit_round, reveals, verifier
from shoal.pipeline import wire as pipeline_wire
from shoal.pipeline.audit_service import signature_from_wire
from shoal.pipeline.balancer import StageBalancer
from shoal.pipeline.boundary import LowRankIn
from shoal.pipeline.bounds import StageBounds
from shoal.pipeline.clip_exchange import StagesSeen, read_claims
from shoal.pipeline.clipping import NormClaims
from shoal.pipeline.directory import StageRecord
from shoal.pipeline.fencing import parse_attempt, parse_fence
from shoal.pipeline.ledger import MicrobatchLedger
from shoal.pipeline.progress import StageProgress
from shoal.pipeline.server import StageServer, _audit, _check_batch
from shoal.pipeline.trainer import PipelineTrainer
from shoal.transport.errors import PayloadTooLarge
from shoal.verification import lsh
from shoal.verification.evidence import EvidenceError
from shoal.verification.stage_audit import StageCommitment, StageEvidence

__all__ = ["APP_TARGETS"]

_PEER = REMOTE_IDENTITY.peer_id


def _as_map(obj: object) -> dict[Any, Any]:
    return obj if isinstance(obj, dict) else {"x": obj}


# ---------------------------------------------------------------- pipeline

# A stage server as its request checks see it (serving stage 1, available), and what
# its requests may hold (a tensor past that is refused before its payload is decoded).
_SERVER = SimpleNamespace(stage=1, _refuse_if_unavailable=lambda: None)
_BOUNDS = StageBounds(max_samples=64, input_elements=1 << 10, output_elements=1 << 10)
# The entry of a stage after a boundary of codec WIRE+lowrank4 (`pipeline.boundary`):
# 4 coordinates and the token ids of a 512-token vocabulary, at most 16 positions.
_LOWRANK_IN = LowRankIn(4, 8, 512, 16)


def pipeline_requests(data: bytes) -> None:
    """A stage peer's request checks (stage, samples, key, codec, enc flags, audit nonce,
    backward attempt, a fence's request) and an encoded tensor: its header, then its
    payload decoded under the named codec, then read by a low-rank adapter's entry."""
    payload = _as_map(message(data))
    expect((ValueError,), lambda: parse_attempt(payload))
    expect((ValueError,), lambda: parse_fence(payload, 1))  # (the seeds' stage)
    checked = expect((ValueError,), lambda: StageServer._check(_SERVER, payload))  # type: ignore[arg-type]
    if checked is not None:
        key, samples, codec, _enc = checked
        expect((ValueError,), lambda: _audit(payload, key, codec))
        inputs = torch.zeros(min(samples, 64), 2)
        expect((ValueError,), lambda: _check_batch(inputs, samples))
        expect((PayloadTooLarge,), lambda: _BOUNDS.check_samples(samples))
    head = expect((pipeline_wire.HeaderError,), lambda: pipeline_wire.parse_header(payload))
    if head is not None and head.numel <= _BOUNDS.inputs():
        codec = expect((ValueError,), lambda: pipeline_wire.codec_of(payload.get("codec")))
        body = payload.get("body")
        if codec is not None and isinstance(body, bytes):
            out = expect((CodecError,), lambda: pipeline_wire.decode_tensor(head, body, codec))
            assert out is None or list(out.shape) == head.shape
            if out is not None and out.dim() >= 2:  # what a stage's adapter makes of it
                with torch.no_grad():
                    got = expect((ValueError,), lambda: _LOWRANK_IN(out.float()))
                assert got is None or got[0].shape[-1] == _LOWRANK_IN.up.out_features


class _FoundDHT:
    """A DHT node whose every `get` finds `subkeys` (another peer's records)."""

    def __init__(self, subkeys: dict[Any, Any], peer_id: Any = None) -> None:
        self.found = SimpleNamespace(subkeys=subkeys, value=None)
        self.peer_id = peer_id

    async def get(self, key: str, latest: bool = False) -> Any:
        return self.found


def _trainer(stages: int) -> Any:
    """A pipeline trainer as its step notifications see it: stages, peers, versions."""
    t = SimpleNamespace(
        stage_peers=[[_PEER] for _ in range(stages)], versions=[0] * stages,
        step_sizes=[{} for _ in range(stages)], ledger=MicrobatchLedger(stages), _replays=set(),
        balancers=[StageBalancer() for _ in range(stages)], _changed=None, stages=stages,
        durable=[None] * stages, _restores=set(), _restarted=[None] * stages,
        _last_restore=[None] * stages, calls=SimpleNamespace(told={}, restores=[0] * stages),
    )  # fmt: skip
    t._settle = lambda stage, meta, source=None: PipelineTrainer._settle(t, stage, meta, source)  # type: ignore[arg-type]
    t._restored = lambda *args: PipelineTrainer._restored(t, *args)  # type: ignore[arg-type]
    return t


_LIKE = lsh.sign(torch.linspace(-1, 1, 300), b"s" * 16, lsh.SignatureConfig(block=64))


def pipeline_records(data: bytes) -> None:
    """What pipeline peers read from the DHT and each other: stage records, progress
    reports, global clipping's norm claims, a stage peer's step notification, and an
    auditor's LSH signature."""
    obj = message(data)
    record = StageRecord.parse(_PEER, obj)
    assert record is None or record.version >= 0
    # The DHT layer hands over (value, expiration) per subkey: the values are the peers'.
    # (Subkeys are strings: the DHT's record checks refuse any other.)
    items = obj.items() if isinstance(obj, dict) else ()
    subkeys = {k: (v, 0.0) for k, v in items if isinstance(k, str)}
    progress = StageProgress(_FoundDHT(subkeys), "exp", 0, 8)  # type: ignore[arg-type]
    for report in run_now(progress.reports()):
        assert report.samples >= 0 and report.version >= 0
    claims = NormClaims(2)  # global clipping's norm claims, every claimant a stage peer
    read_claims(subkeys, claims, [{_PEER}, {_PEER}])
    seen = StagesSeen()  # (and the stage records as clipping reads them)
    seen.add(subkeys, 3)
    assert seen.serving[0] <= len(seen.members[0])
    serving, skipped = seen.counts(claims)  # (a peer past the step without a claim skipped it)
    assert serving[0] <= seen.serving[0] and skipped[0] <= len(seen.past[0])
    for s in range(2):
        norm = claims.settled(s, serving[0], skipped[0])
        assert norm is None or (math.isfinite(norm) and norm >= 0)
    ctx = SimpleNamespace(peer=_PEER)
    # A step notification may only settle steps: there are none open here, so no replays.
    assert run_now(_stepped(_trainer(2), ctx, obj)) in (True, False)
    # A stage record's checkpoint claims (`ckpt`, `restored`), as a trainer reads them.
    trainer = _trainer(1)
    PipelineTrainer._read_checkpoints(  # type: ignore[arg-type]
        trainer, 0, SimpleNamespace(subkeys={owner_marker(_PEER): (obj, 0.0)})
    )
    durable = trainer.durable[0]
    assert durable is None or 0 <= durable <= max(0, trainer.versions[0], *_versions(obj))
    sig = signature_from_wire(obj, _LIKE)
    assert sig is None or sig.elements == _LIKE.elements


def _versions(obj: Any) -> list[int]:
    version = obj.get("version") if isinstance(obj, dict) else None
    return [version] if isinstance(version, int) else []


async def _stepped(trainer: Any, ctx: Any, payload: Any) -> bool:
    trainer._changed = asyncio.Event()
    return await PipelineTrainer._stepped(trainer, ctx, payload)


# ---------------------------------------------------------------- verification


def stage_audit(data: bytes) -> None:
    """A stage peer's signed commitment (as an auditor reads it) and a conviction of a
    stage peer from the DHT, then its offline check."""
    c = expect((EvidenceError,), lambda: StageCommitment.decode(data))
    if c is not None:
        assert StageCommitment.decode(c.encode()) == c
    evidence = expect((EvidenceError,), lambda: StageEvidence.decode(data))
    if evidence is not None:
        expect((EvidenceError,), evidence.check)


def verification_rounds(data: bytes) -> None:
    """A verification round's records: a peer's published commitment and secret, and
    the header of a segment's reveal."""
    parsed = audit_round._parse(data)
    assert parsed is None or len(parsed[1]) == audit_round.SECRET_BYTES
    secret = audit_round._parse_pushed(data)  # (what a member pushes after a commit)
    assert secret is None or [len(x) for x in secret] == [32, audit_round.SECRET_BYTES]
    head = expect((reveals.RevealError,), lambda: reveals._header(message(data)))
    if head is not None:  # what our model (a Linear(3, 2)) can hold
        expect((reveals.RevealError,), lambda: reveals._check_layout(head[0], head[1], _SHAPES))
        sparse = expect((reveals.RevealError,), lambda: reveals._sparse_header(message(data), 8))
        if sparse is not None and sparse[1] is not None:  # a slot within our vector's bytes
            index, members, raw = sparse[1]
            assert 0 <= index < members and len(raw) <= 4 * 8 + 1024
        if sparse is not None and sparse[2] is not None:  # receipts: only valid signatures
            proof = sparse[2]
            assert all(p in proof.receipt.members for p in proof.signatures)
        # The chunks of a residual shown (`codec_audit` chunks): only those asked.
        ask = reveals.SampleAsk((1, 4), (16, 16), 4)
        proofs = expect((reveals.RevealError,), lambda: reveals._sampled_header(message(data), ask))
        if proofs is not None:
            assert len(proofs) == 2 and all(
                len(p) <= reveals.MAX_PROOF and all(len(h) == 32 for h in p)
                for two in proofs
                for p in two
            )
    request = message(data)
    if isinstance(request, dict):  # a reveal request's drawn chunks
        sample = expect((ValueError,), lambda: verifier.parse_reveal_sample(request))
        assert sample is None or (0 < len(sample) <= reveals.MAX_SAMPLED
                                  and list(sample) == sorted(set(sample)))  # fmt: skip


_SHAPES = [torch.Size([2, 3]), torch.Size([2])]


def coded_moments(data: bytes) -> None:
    """What a 2.8 prover sends for a withheld start: a reveal header's moment modes,
    and any codes with any in-range block exponents, decoded as its referee decodes
    them (a lie fails the optimizer hash afterwards: nothing may crash before). Codes
    as an encoder makes them (none above 256: the scale puts a block's largest there)
    that decode to normal floats code again to the same bits."""
    head = message(data)
    if isinstance(head, dict):
        keys = [(0, "exp_avg"), (0, "exp_avg_sq")]
        expect((reveals.RevealError,), lambda: reveals._modes(head, keys))
    if len(data) < 2:
        return
    mode = state_codes.SQRT if data[0] & 1 else state_codes.SIGNED
    codes = torch.frombuffer(bytearray(data[1:]), dtype=torch.uint8)
    blocks = math.ceil(codes.numel() / state_codes.BLOCK)
    span = 2 * state_codes.MAX_EXPONENT + 1
    exponents = torch.tensor([data[b % len(data)] * 7 % span - state_codes.MAX_EXPONENT
                              for b in range(blocks)], dtype=torch.int16)  # fmt: skip
    coded = state_codes.CodedTensor(mode, (codes.numel(),), codes, exponents)
    values = state_codes.decode(coded)
    assert values.dtype == torch.float32 and values.shape == (codes.numel(),)
    magnitudes = values.abs()
    nonzero = magnitudes[magnitudes > 0]
    as_encoded = bool((codes.view(torch.float8_e4m3fn).float().abs() <= 256).all())
    normal = (
        as_encoded
        and bool(torch.isfinite(values).all())
        and (
            nonzero.numel() == 0
            or (float(nonzero.min()) >= 2**-100 and float(nonzero.max()) <= 2**100)
        )
    )
    again = state_codes.encode(values) if normal else None
    if again is not None and again.mode == mode:
        assert torch.equal(state_codes.decode(again).view(torch.int32), values.view(torch.int32))


# ---------------------------------------------------------------- peer


def dht_reports(data: bytes) -> None:
    """Other peers' DHT reports as /peers shows them and /swarm keeps them, and the
    manifests record of an experiment."""
    obj = message(data)
    reports = obj if isinstance(obj, list) else [obj]
    rows = [node.peer_row(_PEER, r, time.time()) for r in reports if isinstance(r, dict)]
    history = SwarmHistory(clock=lambda: 1000.0)
    history.record([r for r in rows if r is not None])
    history.record([r for r in reports if isinstance(r, dict)])
    history.snapshot()
    _valid_manifests(obj)


def hf_tokenizer(data: bytes) -> None:
    """The tokenizer an hf experiment's manifest carries (its "tokenizer_bpe": merges,
    zlib-compressed, base64), rebuilt as every joiner rebuilds it; without the
    tokenizers package, the one-line TaskError that says how to get it."""
    tokenizer = expect((TaskError,), lambda: rebuild_bpe(data.decode("utf-8", "replace")))
    if tokenizer is not None:
        assert tokenizer.token_to_id("<|endoftext|>") == 0
        tokenizer.encode(data[:64].decode("utf-8", "replace"))


APP_TARGETS = (
    Target("pipeline_requests", pipeline_requests, (), pipeline_requests.__doc__),
    Target("pipeline_records", pipeline_records, (), pipeline_records.__doc__),
    Target("stage_audit", stage_audit, (), stage_audit.__doc__),
    Target("verification_rounds", verification_rounds, (), verification_rounds.__doc__),
    Target("coded_moments", coded_moments, (), coded_moments.__doc__),
    Target("dht_reports", dht_reports, (), dht_reports.__doc__),
    Target("hf_tokenizer", hf_tokenizer, (), hf_tokenizer.__doc__),
)
