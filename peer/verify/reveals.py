"""What a prover reveals of one segment of its work, on the wire and checked.

A `Reveal` holds the state at the segment's start (parameters and the inner
optimizer's per-parameter state) and the parameters at its end with the hash of
the optimizer state there: four model sizes with AdamW. `problem` checks every
part against the commitment's hashes, so nothing unrevealed or altered reaches
the re-run.

The parameters at the end of the whole run are not revealed (they were, as a
fifth model size, by peers of protocol 2.0). They tied the pseudo-gradient that
was sent (`Commitment.delta_root`) to the run's last checkpoint, but a prover
chooses that checkpoint as freely as the pseudo-gradient: only re-running the
last segment checks it. So the audit of the last segment, whose end is the
run's end, ties the pseudo-gradient to its revealed end, and the audit of any
other segment learns nothing from the final state (`audit_round.check_segment`).

Wire (RPC method ``reveal`` of `PROTOCOL`, a stream): the request is
``{"round", "segment", "secrets", "final"}`` (the round's secrets as the asker
knows them, so both compute the same draw; ``"final": false`` from askers that
do not need the final state, absent from 2.0 askers, who do); the answer is a
header item ``{"params": n, "keys": [[param index, name], ...], "end_opt"}``,
with ``"final_opt"`` when the final state follows, then the tensors (start
parameters, start optimizer state in `keys` order, end parameters, and final
parameters when announced), then ``{"done": true}``. An asker takes both forms.

The end parameters are the one part of a reveal an honest re-run reproduces:
since 2.6 a referee asks with ``"end": false``, re-runs the segment and hashes
the state it ends in (parameters and optimizer state) against the commitment's
checkpoint (`audit_round.check_segment_exact`). Equal, the prover's end is the
re-run's, bit for bit, and never crosses the wire: a reveal is three model sizes
with AdamW, not four. A prover that withholds it says so in its header
(``"end": false``; a 2.5 prover sends it whatever is asked, and the asker reads
it). Only when the hashes differ (another machine's float rounding, or a lie)
does the referee ask for the end alone (``{"round", "segment", "secrets",
"commitment", "only_end": true}``: a header ``{"params": n, "end_opt",
"only_end": true}``, the end parameters, ``{"done": true}``) and compare by LSH
as before.

The start state is the other part an asker may rebuild: a round whose work starts
from a fresh optimizer (`inner_state` "reset": the commitment's optimizer hash is
the empty state's) starts from what every member of the round holds, the global
state. Since 2.7 its referee asks with ``"start": false``, re-runs the round's
steps before the segment itself (`rebuild.rebuild_start`) and checks the state it
reaches against the commitment; the prover's header then says ``"start": false``,
names no optimizer state, and no start tensors follow (a 2.6 prover sends them
anyway, and the asker reads them). Only when the rebuilt state's hash differs does
the referee ask for the whole reveal again. An honest reveal then moves a header.

Since 2.8 a round whose work started from the prover's own optimizer state rounded
to 8-bit codes (`inner_state` "quantize", `state_codes`) is rebuilt as well: its
referee asks with ``"start": false, "moments": true``, and the prover withholds the
start but sends those codes (``"moments"`` in the header: one mode per key of
`keys`, which then name the round's starting state; each coded tensor follows as
uint8 codes and int16 block exponents, a step count as a float32 tensor). The
asker decodes them and checks them against the commitment's optimizer hash
(`rebuild.rebuild_start`). A prover whose state cannot be coded sends the whole
start instead.

Since 2.9 the last segment of a sparse round audited by chunks (`codec_audit`
"chunks") shows the values its message kept and the chunks of its starting
residual the asker drew (request ``"sample"``; header ``"sampled"``: per chunk, in
the order asked, its index and its Merkle proofs under the commitment's two
residual roots; then the kept values and each chunk, float32), not the whole
residual (`SampleAsk`, `sparse_work.check_sampled`).

The asker knows what a reveal holds before it comes: its own model has the same
parameters (`fetch_reveal`'s `shapes`), and the experiment's optimizer keeps
known state tensors of known shapes for each (`layouts`, from
`optimizers.state_layout`: AdamW a step count and two moments of the parameter's
shape, SGD with momentum one buffer, Adafactor a step count and a row and a column
factor). A reveal announcing another parameter count, a state the optimizer does
not keep, or a tensor of another shape, is refused before the tensor is allocated
or read (`RevealTooLarge`: a malformed reveal). Without `layouts`, each state
tensor is bounded by its parameter's elements, at most `MAX_STATES` of them.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.averaging.error_feedback import MAX_CHAIN_BYTES
from shoal.transport import rpc
from shoal.transport.errors import PayloadTooLarge
from shoal.transport.host import Host
from shoal.transport.identity import PeerID
from shoal.verification.commitment import (
    HASH_BYTES,
    MAX_CHECKPOINTS,
    Commitment,
    CommitmentError,
    state_digest,
)
from shoal.verification.receipts import ChainProof, ReceiptError

from ..training.state_codes import (
    BLOCK,
    MAX_EXPONENT,
    PLAIN,
    SIGNED,
    SQRT,
    CodedState,
    CodedTensor,
)
from ..training.task import Task
from .segments import (
    SegmentRunner,
    SegmentState,
    optimizer_hash,
    params_hash,
    round_batch_seed,
    segment_batches,
)
from .sparse_work import SampledChunk
from .work_log import RoundWork, VerifiedWork

__all__ = [
    "PROTOCOL",
    "Replay",
    "Reveal",
    "RevealError",
    "RevealTooLarge",
    "SampleAsk",
    "fetch_reveal",
    "fetch_reveal_end",
    "reveal_bytes",
    "reveal_of",
    "send_reveal",
    "send_reveal_end",
    "with_revealed_checkpoints",
]

PROTOCOL = "/shoal/audit/1.0.0"
MAX_KEYS = 1 << 16
# Optimizer state tensors of one parameter (AdamW has 3; amsgrad 4): a margin.
MAX_STATES = 8


class RevealError(ValueError):
    """A reveal that is malformed (its header, so far)."""


class RevealTooLarge(RevealError):
    """A reveal announcing more than the asker's model can hold: refused unread."""


@dataclass
class Reveal:
    # The state at the segment's start; None: withheld (the asker rebuilds it,
    # `rebuild.rebuild_start`, and sets it here before anything reads it).
    start: SegmentState | None
    # The parameters at the segment's end; None: withheld (the asker re-runs and
    # compares hashes first, `audit_round.check_segment_exact`).
    end_params: list[torch.Tensor] | None
    end_optimizer: bytes  # optimizer_hash at the segment's end
    # The run's final state, from a 2.0 prover (or for a 2.0 asker); None otherwise.
    final_params: list[torch.Tensor] | None = None
    final_optimizer: bytes | None = None
    # A sparse round's (`sparse_work`): the previous commitment, encoded (b"": none), and
    # with the last segment, our slot (index, members, bytes) and the starting residual.
    chain: bytes | None = None
    slot: tuple[int, int, bytes] | None = None
    residual: torch.Tensor | None = None
    proof: ChainProof | None = None  # the receipts of the previous commitment's round
    parameters: int = 0  # how many (what the header says when `start` is withheld)
    # With `start` withheld: the inner optimizer's state at the round's start, coded
    # (`state_codes`; a round of `inner_state` "quantize"), from which the asker
    # rebuilds it; None: the round started from an empty one.
    moments: CodedState | None = None
    # A sparse round audited by chunks (`codec_audit`), its last segment: in place of
    # `residual`, the values the message kept and the chunks the asker drew.
    kept: torch.Tensor | None = None
    samples: list[SampledChunk] | None = None
    # Of a commitment that binds its checkpoints by a hash (protocol 2.11): the list,
    # which the asker checks against it (`Commitment.with_checkpoints`).
    checkpoints: tuple[bytes, ...] | None = None

    def end_digest(self) -> bytes:
        assert self.end_params is not None, "the end was withheld"
        return state_digest(params_hash(self.end_params), self.end_optimizer)

    def problem(self, commitment: Commitment, segment: int) -> str | None:
        """Why this is not what `commitment` committed to for `segment`, or None (of
        a reveal that withholds its end: its start and final state)."""
        assert self.start is not None, "a withheld start is rebuilt before it is checked"
        if self.start.digest() != commitment.segment_start(segment):
            return "the revealed start state does not match the commitment"
        return self.end_problem(commitment, segment)

    def end_problem(self, commitment: Commitment, segment: int) -> str | None:
        """`problem`'s checks of the end and final states (those revealed)."""
        revealed = []
        if self.end_params is not None:
            if self.end_digest() != commitment.checkpoints[segment]:
                return "the revealed end state does not match the commitment"
            revealed.append(self.end_params)
        if self.final_params is not None:
            assert self.final_optimizer is not None
            final = state_digest(params_hash(self.final_params), self.final_optimizer)
            if final != commitment.checkpoints[-1]:
                return "the revealed final state does not match the commitment"
            revealed.append(self.final_params)
        assert self.start is not None
        shapes = [p.shape for p in self.start.params]
        if any([p.shape for p in ps] != shapes for ps in revealed):
            return "revealed parameters of different shapes"
        return None


def _optimizer_tensors(state: SegmentState) -> tuple[list[list[Any]], list[torch.Tensor]]:
    per_param = state.optimizer["optimizer"]["state"]
    keys = [[i, name] for i in sorted(per_param) for name in sorted(per_param[i])]
    return keys, [torch.as_tensor(per_param[i][name]) for i, name in keys]


def _coded_tensors(moments: CodedState) -> tuple[list[list[Any]], list[int], list[torch.Tensor]]:
    """(keys, their modes, the tensors in wire order) of a coded optimizer state."""
    keys, modes, tensors = [], [], []
    for (index, name), value in moments:
        keys.append([index, name])
        if isinstance(value, CodedTensor):
            modes.append(value.mode)
            tensors += [value.codes, value.exponents]
        else:
            modes.append(PLAIN)
            tensors.append(value)
    return keys, modes, tensors


async def send_reveal(ctx: rpc.CallContext, reveal: Reveal) -> None:
    """Answer a reveal request (the handler yields `{"done": True}` after this)."""
    start = reveal.start
    modes = None
    if start is not None:
        keys, opt = _optimizer_tensors(start)
    elif reveal.moments is not None:
        keys, modes, opt = _coded_tensors(reveal.moments)
    else:
        keys, opt = [], []
    head: dict[str, Any] = {
        "params": reveal.parameters if start is None else len(start.params),
        "keys": keys,
        "end_opt": reveal.end_optimizer,
    }
    if start is None:
        head["start"] = False
    if modes is not None:
        head["moments"] = modes
    end = reveal.end_params
    if end is None:
        head["end"] = False
    final = reveal.final_params or []
    if reveal.final_params is not None:
        head["final_opt"] = reveal.final_optimizer
    if reveal.chain is not None:
        head["chain"] = reveal.chain
    if reveal.proof is not None:
        head["receipts"] = reveal.proof.to_wire()
    if reveal.checkpoints is not None:
        head["checkpoints"] = list(reveal.checkpoints)
    residual = []
    if reveal.slot is not None and reveal.samples is not None and reveal.kept is not None:
        head["slot"] = list(reveal.slot)
        head["sampled"] = [[c.index, c.start_proof, c.end_proof] for c in reveal.samples]
        residual = [reveal.kept, *(c.residual for c in reveal.samples)]
    elif reveal.slot is not None and reveal.residual is not None:
        head["slot"] = list(reveal.slot)
        residual = [reveal.residual]
    await ctx.send_item(head)
    for t in [*(start.params if start is not None else []), *opt, *(end or []), *final,
              *residual]:  # fmt: skip
        await ctx.send_tensor(t.detach().contiguous())


async def send_reveal_end(ctx: rpc.CallContext, end: SegmentState) -> None:
    """Answer a request for a segment's end alone (the handler yields `{"done": True}`
    after this): its parameters and the hash of its optimizer state."""
    head = {"params": len(end.params), "end_opt": optimizer_hash(end.optimizer), "only_end": True}
    await ctx.send_item(head)
    for t in end.params:
        await ctx.send_tensor(t.detach().contiguous())


async def fetch_reveal_end(
    host: Host,
    prover: PeerID,
    round_index: int,
    segment: int,
    shapes: Sequence[torch.Size],
    *,
    timeout: float,
    secrets: list[list[bytes]] | None = None,
    commitment: bytes | None = None,
) -> tuple[list[torch.Tensor], bytes]:
    """The end of `segment` (its parameters, of our model's `shapes`, and the hash of
    the optimizer state there) that `prover` withheld from its reveal: asked when our
    re-run did not end in the committed state. Raises as `fetch_reveal`."""
    request = _request(round_index, segment, secrets, commitment, only_end=True)
    async with rpc.open_call(host, prover, PROTOCOL, "reveal", request, timeout=timeout) as call:
        await call.close_send()
        head = await call.recv_item()
        if not isinstance(head, dict) or head.get("only_end") is not True:
            raise RevealError("an end's reveal starts with its header")
        n, end_opt = head.get("params"), head.get("end_opt")
        if not isinstance(n, int) or not _is_hash(end_opt):
            raise RevealError("bad end header")
        assert isinstance(end_opt, bytes)
        _check_layout(n, [], shapes)
        end = [await _recv(call, shape) for shape in shapes]
        done = await call.recv_item()
        if not isinstance(done, dict) or done.get("done") is not True:
            raise ValueError("the reveal ended out of step")
    if any(t.dtype != torch.float32 for t in end):
        raise ValueError("revealed parameters must be float32")
    return end, end_opt


async def fetch_reveal(
    host: Host,
    prover: PeerID,
    round_index: int,
    segment: int,
    template: dict[str, Any],
    shapes: Sequence[torch.Size],
    *,
    timeout: float,
    secrets: list[list[bytes]] | None = None,
    layouts: Sequence[Mapping[str, tuple[int, ...]]] | None = None,
    commitment: bytes | None = None,
    end: bool = True,
    start: bool = True,
    moments: bool = False,
    sample: SampleAsk | None = None,
) -> Reveal:
    """Ask `prover` to reveal `segment` of its work in `round_index`, the round of the
    commitment whose digest is `commitment` (None: whichever it has); `end`: with the
    segment's end parameters (False: withheld, if the prover is of 2.6); `start`: with
    its start state (False: withheld, if the prover is of 2.7, for the asker to
    rebuild: the reveal's `start` is then None); `moments`, with `start` False: a 2.8
    prover whose round started from an optimizer state it can code (`inner_state`
    "quantize") withholds the start too, and sends that state coded (the reveal's
    `moments`). `template`: an
    `InnerOptimizer.state_dict()` whose param groups the revealed state takes;
    `shapes`: our own model's parameters', which the revealed ones must have;
    `layouts`: per parameter, the state tensors (name -> shape) our optimizer keeps;
    `sample`: of a sparse round audited by chunks, its last segment, the chunks of
    the residual we draw (the prover then sends the kept values and those).
    Raises (transport, remote or ValueError) when nothing well formed came;
    RevealTooLarge for a header or tensor larger than `shapes` allow."""
    parts = {"end": end} if start else {"end": end, "start": False, "moments": moments}
    request = _request(round_index, segment, secrets, commitment, **parts)
    if sample is not None:
        request["sample"] = list(sample.chunks)
    async with rpc.open_call(host, prover, PROTOCOL, "reveal", request, timeout=timeout) as call:
        await call.close_send()
        head = await call.recv_item()
        n, keys, end_opt, final_opt = _header(head)
        # (Withheld only when asked: an end that did not come is not the prover's pick.)
        withheld = not end and isinstance(head, dict) and head.get("end", True) is False
        no_start = not start and isinstance(head, dict) and head.get("start", True) is False
        _check_layout(n, keys, shapes)
        modes = _modes(head, keys) if no_start and moments else None
        if no_start and keys and modes is None:
            raise RevealError("a withheld start with optimizer state")
        if layouts is not None:
            _check_states(keys, layouts)
        params = [] if no_start else [await _recv(call, shape) for shape in shapes]
        coded = None
        if modes is not None:
            coded = await _recv_coded(call, keys, modes, shapes, layouts)
            keys = []  # (they name the round's start, not this segment's)
        if layouts is None:
            opt = [await _recv(call, shapes[i], exact=False) for i, _ in keys]
        else:
            opt = [await _recv(call, torch.Size(layouts[i][name])) for i, name in keys]
        end_params = None if withheld else [await _recv(call, shape) for shape in shapes]
        # (A 2.0 prover sends the final state whatever we ask: read, checked, unused.)
        final = None if final_opt is None else [await _recv(call, s) for s in shapes]
        chain, slot, proof = _sparse_header(head, sum(math.prod(s) for s in shapes))
        residual, kept, samples = None, None, None
        proofs = _sampled_header(head, sample) if slot is not None else None
        if proofs is not None:
            assert sample is not None
            kept = await _recv(call, torch.Size([sample.kept]))
            samples = [SampledChunk(i, await _recv(call, torch.Size([length])), *two)
                       for i, length, two in zip(sample.chunks, sample.lengths, proofs,
                                                 strict=True)]  # fmt: skip
        elif slot is not None:
            residual = await _recv(call, torch.Size([sum(math.prod(s) for s in shapes)]))
        done = await call.recv_item()
        if not isinstance(done, dict) or done.get("done") is not True:
            raise ValueError("the reveal ended out of step")
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for (i, name), t in zip(keys, opt, strict=True):
        per_param.setdefault(i, {})[name] = t
    optimizer = {
        "optimizer": {
            "state": per_param,
            "param_groups": copy.deepcopy(template["optimizer"]["param_groups"]),
        },
        "grad_scaler": copy.deepcopy(template.get("grad_scaler")),
    }
    if any(t.dtype != torch.float32 for t in [*params, *(end_params or []), *(final or [])]):
        raise ValueError("revealed parameters must be float32")
    shown = [kept, *(c.residual for c in samples or [])] if kept is not None else []
    if any(t.dtype != torch.float32 for t in shown):
        raise ValueError("a revealed residual must be float32")
    start_state = None if no_start else SegmentState(params, optimizer)
    return Reveal(
        start_state, end_params, end_opt, final, final_opt, chain, slot, residual, proof,
        moments=coded, kept=kept, samples=samples, checkpoints=_checkpoints(head),
    )  # fmt: skip


def with_revealed_checkpoints(commitment: Commitment, reveal: Reveal) -> Commitment:
    """`commitment` with its checkpoints: as it is when it lists them, else (protocol
    2.11's form, which binds them by a hash) with those `reveal` carries. RevealError
    when they are missing or not the ones it binds: the prover's to answer for."""
    if commitment.checkpoints_known:
        return commitment
    if reveal.checkpoints is None:
        raise RevealError("no checkpoints with a commitment that binds them by a hash")
    try:
        return commitment.with_checkpoints(reveal.checkpoints)
    except CommitmentError as e:
        raise RevealError(f"the revealed checkpoints: {e}") from None


def _checkpoints(head: dict[str, Any]) -> tuple[bytes, ...] | None:
    """A 2.11 prover's checkpoints (bounded and shaped here; checked against the
    commitment by the asker); None when it sent none."""
    listed = head.get("checkpoints")
    if listed is None:
        return None
    if not (isinstance(listed, list) and len(listed) <= MAX_CHECKPOINTS
            and all(_is_hash(h) for h in listed)):  # fmt: skip
        raise RevealError("bad checkpoints")
    return tuple(listed)


@dataclass(frozen=True)
class SampleAsk:
    """The chunks of a sparse round's residual an asker draws (`codec_audit` chunks):
    their indices, ascending, their lengths, and how many values the message kept."""

    chunks: tuple[int, ...]
    lengths: tuple[int, ...]
    kept: int


MAX_SAMPLED = 64  # chunks one reveal shows
MAX_PROOF = 48  # hashes of a Merkle proof (2^48 chunks)


def _sampled_header(
    head: dict[str, Any], sample: SampleAsk | None
) -> list[tuple[list[bytes], list[bytes]]] | None:
    """The Merkle proofs (under the starting residual's root, under the one after
    the commit) of each chunk drawn, as a sampled reveal's header lists them; None
    when it shows none (a reveal of the whole residual). RevealError when they are
    not the chunks asked, or a proof is malformed."""
    sampled = head.get("sampled")
    if sampled is None:
        if sample is not None:
            raise RevealError("the residual's chunks asked were not shown")
        return None
    if sample is None:
        raise RevealError("residual chunks nobody asked for")
    if not isinstance(sampled, list) or len(sampled) != len(sample.chunks):
        raise RevealError("bad sampled chunks")
    proofs = []
    for entry, asked in zip(sampled, sample.chunks, strict=True):
        if not (isinstance(entry, list) and len(entry) == 3 and entry[0] == asked
                and type(entry[0]) is int):  # fmt: skip
            raise RevealError("a sampled chunk that was not asked")
        two = entry[1], entry[2]
        if not all(isinstance(p, list) and len(p) <= MAX_PROOF and all(_is_hash(h) for h in p)
                   for p in two):  # fmt: skip
            raise RevealError("a malformed Merkle proof of a sampled chunk")
        proofs.append((list(entry[1]), list(entry[2])))
    return proofs


def _modes(head: dict[str, Any], keys: list[tuple[int, str]]) -> list[int] | None:
    """How each of `keys` is coded (`state_codes`), as a header with a withheld start
    says; None when it says nothing (a 2.7 prover); RevealError when malformed."""
    modes = head.get("moments")
    if modes is None:
        return None
    ok = isinstance(modes, list) and len(modes) == len(keys)
    if not ok or not all(m in (PLAIN, SIGNED, SQRT) and type(m) is int for m in modes):
        raise RevealError("bad moment codes")
    return modes


async def _recv_coded(
    call: rpc.Call,
    keys: list[tuple[int, str]],
    modes: list[int],
    shapes: Sequence[torch.Size],
    layouts: Sequence[Mapping[str, tuple[int, ...]]] | None,
) -> CodedState:
    """The coded optimizer state of a withheld start, each tensor of the shape our
    optimizer keeps (without `layouts`: its parameter's), refused when it is not."""
    coded: CodedState = []
    for (index, name), mode in zip(keys, modes, strict=True):
        shape = torch.Size(layouts[index][name]) if layouts is not None else shapes[index]
        if mode == PLAIN:
            coded.append(((index, name), await _recv(call, shape)))
            continue
        elements = math.prod(shape)
        codes = await _recv(call, torch.Size([elements]))
        exponents = await _recv(call, torch.Size([math.ceil(elements / BLOCK)]))
        if codes.dtype != torch.uint8 or exponents.dtype != torch.int16:
            raise RevealError("moment codes must be uint8, their exponents int16")
        if exponents.numel() and int(exponents.abs().max()) > MAX_EXPONENT:
            raise RevealError("a moment's scale out of float32's range")
        coded.append(((index, name), CodedTensor(mode, tuple(shape), codes, exponents)))
    return coded


def _request(
    round_index: int,
    segment: int,
    secrets: list[list[bytes]] | None,
    commitment: bytes | None,
    **parts: bool,
) -> dict[str, Any]:
    """A reveal request (the module doc): never for the run's final state."""
    request: dict[str, Any] = {
        "round": round_index, "segment": segment, "secrets": secrets or [], "final": False,
        **parts,
    }  # fmt: skip
    if commitment is not None:
        request["commitment"] = commitment
    return request


def _sparse_header(
    head: dict[str, Any], elements: int
) -> tuple[bytes | None, tuple[int, int, bytes] | None, ChainProof | None]:
    """A sparse round's parts of a reveal header: (previous commitment, slot, the
    receipts of the previous commitment's round), each None when absent; RevealError
    when malformed, larger than our model allows, or with a signature that does not
    verify (an honest prover checked each signature it keeps)."""
    chain, slot, receipts = head.get("chain"), head.get("slot"), head.get("receipts")
    if chain is not None and not (isinstance(chain, bytes) and len(chain) <= MAX_CHAIN_BYTES):
        raise RevealError("bad previous commitment")
    proof = None
    if receipts is not None:
        try:
            proof = ChainProof.from_wire(receipts)
        except ReceiptError as e:
            raise RevealError(f"bad receipts: {e}") from None
    if slot is None:
        return chain, None, proof
    ok = isinstance(slot, list) and len(slot) == 3
    if not (ok and isinstance(slot[0], int) and isinstance(slot[1], int)):
        raise RevealError("bad slot")
    index, members, raw = slot
    # (A slot is at most a whole message: fewer bytes than the float32 vector it codes.)
    if not (isinstance(raw, bytes) and len(raw) <= 4 * elements + 1024):
        raise RevealTooLarge("a slot larger than our model's vector")
    if not 0 <= index < members <= 1 << 16:
        raise RevealError("bad slot index")
    return chain, (index, members, raw), proof


def reveal_bytes(
    shapes: Sequence[torch.Size],
    layouts: Sequence[Mapping[str, tuple[int, ...]]],
    *,
    sparse: bool = False,
) -> int:
    """The bytes of a reveal of a model of parameters `shapes` whose optimizer keeps
    `layouts` (float32 tensors: start and end parameters, the start's optimizer state;
    of a `sparse` round's last segment, the error feedback's starting residual too)."""
    params = sum(math.prod(shape) for shape in shapes)
    states = sum(math.prod(shape) for layout in layouts for shape in layout.values())
    return 4 * ((3 if sparse else 2) * params + states)


def _check_layout(n: int, keys: list[tuple[int, str]], shapes: Sequence[torch.Size]) -> None:
    """A header that announces what our model has: its parameter count, and optimizer
    state of those parameters only, each named once, at most MAX_STATES each."""
    if n != len(shapes):
        raise RevealTooLarge(f"a reveal of {n} parameters, our model has {len(shapes)}")
    per_param: Counter[int] = Counter()
    for i, _ in keys:
        if not 0 <= i < n:
            raise RevealTooLarge(f"optimizer state of parameter {i} of {n}")
        per_param[i] += 1
    if len(set(keys)) != len(keys) or any(c > MAX_STATES for c in per_param.values()):
        raise RevealTooLarge("optimizer state named twice, or too many states of a parameter")


def _check_states(
    keys: list[tuple[int, str]], layouts: Sequence[Mapping[str, tuple[int, ...]]]
) -> None:
    """Each parameter's state is what our optimizer keeps for it once it has stepped,
    all of it (or none: a parameter that has not stepped yet)."""
    named: dict[int, set[str]] = {}
    for i, name in keys:
        named.setdefault(i, set()).add(name)
    for i, names in named.items():
        if names != set(layouts[i]):
            raise RevealTooLarge(
                f"optimizer state {sorted(names)} of parameter {i}; the experiment's "
                f"optimizer keeps {sorted(layouts[i])}"[:200]
            )


async def _recv(call: rpc.Call, shape: torch.Size, *, exact: bool = True) -> torch.Tensor:
    """The next tensor: of `shape` (`exact`), or at most its elements (optimizer state
    without a layout), refused before it is allocated when it announces more."""
    elements = max(1, math.prod(shape))
    try:
        t = await call.recv_tensor(max_bytes=elements * 8, max_elements=elements)
    except PayloadTooLarge as e:
        raise RevealTooLarge(str(e)) from None
    if exact and t.shape != shape:
        raise RevealError(f"a revealed tensor of shape {list(t.shape)}, ours is {list(shape)}")
    return t


def _header(head: object) -> tuple[int, list[tuple[int, str]], bytes, bytes | None]:
    if not isinstance(head, dict):
        raise RevealError("a reveal starts with its header")
    n, keys = head.get("params"), head.get("keys")
    end_opt, final_opt = head.get("end_opt"), head.get("final_opt")
    if not isinstance(n, int) or not 0 < n <= MAX_KEYS:
        raise RevealError("bad parameter count")
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise RevealError("bad optimizer keys")
    parsed = []
    for k in keys:
        if not (isinstance(k, list) and len(k) == 2 and isinstance(k[0], int)):
            raise RevealError("bad optimizer key")
        if not isinstance(k[1], str):
            raise RevealError("bad optimizer key")
        parsed.append((k[0], k[1]))
    if not _is_hash(end_opt) or not (final_opt is None or _is_hash(final_opt)):
        raise RevealError("bad optimizer hash")  # (no "final_opt": no final state follows)
    assert isinstance(end_opt, bytes) and (final_opt is None or isinstance(final_opt, bytes))
    return n, parsed, end_opt, final_opt


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == HASH_BYTES


def reveal_of(
    start: SegmentState | None,
    end: SegmentState,
    final: SegmentState | None = None,
    *,
    with_end: bool = True,
) -> Reveal:
    """The reveal of a segment from the prover's kept (or re-run) states; with the
    run's `final` state for an asker of protocol 2.0; `with_end`: False withholds the
    end's parameters (sends only the hash of its optimizer state); a `start` of None
    withholds the start (the asker rebuilds it)."""
    end_params = end.params if with_end else None
    if final is None:
        return Reveal(start, end_params, optimizer_hash(end.optimizer),
                      parameters=len(end.params))  # fmt: skip
    return Reveal(
        start,
        end_params,
        optimizer_hash(end.optimizer),
        final.params,
        optimizer_hash(final.optimizer),
        parameters=len(end.params),
    )


@dataclass
class Replay:
    """The prover's own states, kept or re-run from the last kept one (on this machine,
    bit for bit: the result is checked against the committed hash)."""

    runner: SegmentRunner
    task: Task
    work: VerifiedWork
    num_shards: int

    def state_after(self, work: RoundWork, step: int) -> SegmentState:
        """Our state after `step` steps of `work` (blocking)."""
        kept = self.work.log.state_at(work, step)
        if kept is not None:
            return kept
        start, from_state = self.work.log.nearest_before(work, step)
        seed = round_batch_seed(self.work.experiment, self.work.peer, work.round)
        shard, shards = self.work.shard, self.num_shards
        batches = segment_batches(self.task, shard, shards, seed, start, step - start)
        state = self.runner.run(from_state, batches, work.first_step + start)
        if state.digest() != work.digest_at(step):
            raise RuntimeError(f"re-running our own steps {start}..{step} did not reproduce them")
        return state
