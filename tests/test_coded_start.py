"""A quantized round's start: the prover's own moments, revealed in 8-bit codes.

With `inner_state` "quantize" a prover rounds its inner optimizer's state to
blockwise float8 codes at each round's start and trains on from what they
decode to. Its referee (2.8) asks for the codes instead of the start (half a
model size instead of three with AdamW), decodes them, checks them against the
commitment's optimizer hash and rebuilds every later segment's start from the
round's global state, bit for bit. A carried state that was never rounded is not
coded: the whole start goes, as before. Codes that were altered, or malformed,
are refused."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import pytest
import torch
from verification_round import proved_round

from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.state_codes import (
    BLOCK,
    SIGNED,
    SQRT,
    CodedTensor,
    code_state,
    coded_bytes,
    decode,
    decode_state,
    encode,
    encode_exact,
    round_trip_,
)
from shoal.peer.training.task import load_task
from shoal.peer.verify.audit_round import check_segment_exact
from shoal.peer.verify.rebuild import EMPTY_OPTIMIZER, rebuild_start
from shoal.peer.verify.reveals import (
    Replay,
    Reveal,
    RevealError,
    RevealTooLarge,
    fetch_reveal,
    reveal_of,
    send_reveal,
)
from shoal.peer.verify.segments import SegmentRunner, SegmentState
from shoal.peer.verify.verifier import parse_reveal_moments
from shoal.transport import rpc
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity
from shoal.verification.evidence import Result

pytestmark = pytest.mark.timeout(120)

NS = "shoal/x/coded"
ROUND = 3
SHARDS = 8
EVERY = 3
STEPS = 8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def awkward_tensors() -> list[torch.Tensor]:
    """Signed and non-negative tensors over many magnitudes, with zeros, subnormals
    and a length that is no whole number of blocks."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for n in (1, 2, BLOCK - 1, BLOCK, 3 * BLOCK + 5, 4000):
        x = torch.randn(n, generator=gen) * torch.exp(4 * torch.randn(n, generator=gen))
        out += [x, x.abs() ** 2, x * 1e-38, torch.where(x > 0, x, 0.0)]
    out.append(torch.zeros(300))
    out.append(torch.tensor([-0.0, 1.0, 2.0]))
    return out


def test_codes_decode_to_values_that_code_to_themselves() -> None:
    """What a prover trains on after rounding is what its codes decode to, and coding
    it again (at the reveal) decodes to the same bits."""
    for x in awkward_tensors():
        coded = encode(x)
        assert coded is not None and coded.codes.dtype == torch.uint8
        assert coded.nbytes == coded_bytes(x.numel())
        y = decode(coded)
        again = encode_exact(y)
        assert again is not None, x
        assert torch.equal(bits(decode(again)), bits(y))


def test_codes_keep_six_percent_of_each_value_and_never_zero_a_second_moment() -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64 * BLOCK, generator=gen)
    v = torch.rand(64 * BLOCK, generator=gen) ** 4
    for t, mode in ((x, SIGNED), (v, SQRT)):
        coded = encode(t)
        assert coded is not None and coded.mode == mode
        y = decode(coded)
        ref = t.abs().sqrt() if mode == SQRT else t.abs()
        got = y.sqrt() if mode == SQRT else y.abs()
        large = ref > ref.reshape(-1, BLOCK).amax(1).repeat_interleave(BLOCK) / 2**13
        assert float(((got - ref).abs() / ref)[large].max()) <= 1 / 16
    y = decode(encode(v))  # type: ignore[arg-type]
    assert bool(((y > 0) == (v > 0)).all()), "a positive second moment never becomes 0"


def test_a_tensor_that_is_not_finite_is_not_coded() -> None:
    assert encode(torch.tensor([1.0, float("inf")])) is None
    assert encode(torch.tensor([float("nan"), 1.0])) is None
    assert encode(torch.arange(4)) is None  # (not floating)
    t = torch.tensor([1.0, float("nan")])
    assert round_trip_(t) is False and math.isnan(float(t[1]))


def test_a_state_that_was_not_rounded_is_not_coded() -> None:
    x = torch.randn(500, generator=torch.Generator().manual_seed(9))
    assert encode_exact(x) is None
    state = {0: {"step": torch.tensor(5.0), "exp_avg": x.clone(), "exp_avg_sq": x.abs()}}
    assert code_state(state) is None
    for value in state[0].values():
        round_trip_(value)
    coded = code_state(state)
    assert coded is not None
    back = decode_state(coded)
    assert set(back[0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(torch.equal(back[0][k], state[0][k]) for k in state[0])


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return load_task("bytegpt", {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16,
                                 "batch_size": 2})  # fmt: skip


def prove(task, *, quantized: bool = True):  # type: ignore[no-untyped-def]
    """A verified round of a prover that carried moments into it (two steps before),
    rounded to codes at the round's start (`quantized`) or not."""
    hyper = check_hyperparameters({"warmup_steps": 0, "inner_state": "quantize"})
    me = Identity.from_seed(hashlib.sha256(b"coded prover").digest())
    work, verified, c, rnd, runner = proved_round(
        task, hyper, me, namespace=NS, shards=SHARDS, every=EVERY, round_index=ROUND,
        steps=STEPS, steps_before=2, quantize=quantized,
    )  # fmt: skip
    replay = Replay(SegmentRunner(task, hyper), task, verified, SHARDS)
    return hyper, work, replay, c, rnd, runner.inner.state_dict()


@pytest.mark.parametrize("segment", [0, 1, 2])
def test_a_quantized_round_s_start_is_rebuilt_from_its_codes_and_audited_bit_for_bit(  # type: ignore[no-untyped-def]
    task, segment: int
) -> None:
    hyper, work, replay, c, rnd, template = prove(task)
    assert c.optimizer != EMPTY_OPTIMIZER, "the moments were carried into the round"
    moments = code_state(replay.state_after(work, 0).optimizer["optimizer"]["state"])
    assert moments is not None and any(isinstance(v, CodedTensor) for _, v in moments)
    start = rebuild_start(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment,
                          template, moments)  # fmt: skip
    assert start is not None and start.digest() == c.segment_start(segment)
    first, end = c.segment_bounds(segment)
    assert start.digest() == replay.state_after(work, first).digest()
    reveal = reveal_of(None, replay.state_after(work, end), with_end=False)
    reveal.start = start
    finding = check_segment_exact(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, segment,
                                  reveal, consume=True)  # fmt: skip
    assert finding.result is Result.PASS and "bit for bit" in finding.why, finding


def test_altered_codes_or_none_rebuild_nothing(task) -> None:  # type: ignore[no-untyped-def]
    """Codes other than the committed state's (one code changed), or none for a round
    whose moments were carried, fail the optimizer hash: the whole start is asked."""
    hyper, work, replay, c, rnd, template = prove(task)
    moments = code_state(replay.state_after(work, 0).optimizer["optimizer"]["state"])
    assert moments is not None
    changed = list(moments)
    first_coded = next(i for i, (_, v) in enumerate(changed) if isinstance(v, CodedTensor))
    key, value = changed[first_coded]
    assert isinstance(value, CodedTensor)
    codes = value.codes.clone()
    codes[0] ^= 1
    changed[first_coded] = (key, CodedTensor(value.mode, value.shape, codes, value.exponents))
    for coded in (changed, None):
        assert rebuild_start(SegmentRunner(task, hyper), task, SHARDS, NS, rnd, c, 1, template,
                             coded) is None  # fmt: skip


def test_a_carried_state_that_was_not_rounded_goes_whole(task) -> None:  # type: ignore[no-untyped-def]
    _, work, replay, _, _, _ = prove(task, quantized=False)
    assert code_state(replay.state_after(work, 0).optimizer["optimizer"]["state"]) is None


def test_a_reveal_request_says_whether_codes_may_stand_for_the_start() -> None:
    assert parse_reveal_moments({"start": False, "moments": True}) is True
    assert parse_reveal_moments({"start": False}) is False
    assert parse_reveal_moments({"moments": True}) is False  # (the start goes whole)
    with pytest.raises(ValueError):
        parse_reveal_moments({"start": False, "moments": 1})


def _rounded_state(model: torch.nn.Module) -> SegmentState:
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    for per_param in opt.state.values():
        for name, value in per_param.items():
            if name != "step":
                round_trip_(value)
    return SegmentState([p.detach().clone() for p in model.parameters()],
                        {"optimizer": opt.state_dict(), "grad_scaler": None})  # fmt: skip


def _layouts(model: torch.nn.Module) -> list[dict[str, tuple[int, ...]]]:
    return [{"step": (), "exp_avg": tuple(p.shape), "exp_avg_sq": tuple(p.shape)}
            for p in model.parameters()]  # fmt: skip


@pytest.mark.asyncio
async def test_codes_cross_the_wire_in_half_a_model_size_and_malformed_ones_are_refused() -> None:
    """A 2.8 prover asked for codes sends them (about a quarter of the float32 moments);
    a 2.7 prover withholds the start and sends none (the asker then has nothing to
    rebuild from but an empty state); codes of the wrong dtype, size, scale or mode
    are refused."""
    model = torch.nn.Linear(64, 32)
    start = _rounded_state(model)
    moments = code_state(start.optimizer["optimizer"]["state"])
    assert moments is not None
    config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))
    referee = Host(Identity.generate(), config)
    prover = Host(Identity.generate(), config)
    mode: list[str] = ["2.8"]
    sent_bytes: list[int] = []

    @rpc.RpcService(prover, "/shoal/audit/1.0.0").stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        coded = moments if mode[0] != "2.7" and parse_reveal_moments(payload) else None
        if mode[0] == "bad-dtype":
            coded = [(k, CodedTensor(v.mode, v.shape, v.codes.to(torch.int16), v.exponents))
                     if isinstance(v, CodedTensor) else (k, v) for k, v in moments]  # fmt: skip
        elif mode[0] == "bad-scale":
            coded = [(k, CodedTensor(v.mode, v.shape, v.codes, v.exponents + 30000))
                     if isinstance(v, CodedTensor) else (k, v) for k, v in moments]  # fmt: skip
        elif mode[0] == "too-many-codes":
            coded = [(k, CodedTensor(v.mode, v.shape, torch.cat([v.codes, v.codes]),
                                     v.exponents))
                     if isinstance(v, CodedTensor) else (k, v) for k, v in moments]  # fmt: skip
        sent = Reveal(None, None, b"e" * 32, parameters=len(start.params), moments=coded)
        if mode[0] == "bad-mode":
            await ctx.send_item({"params": 2, "keys": [[0, "exp_avg"]], "end_opt": b"e" * 32,
                                 "start": False, "end": False, "moments": [7]})  # fmt: skip
        else:
            await send_reveal(ctx, sent)
        sent_bytes.append(sum(v.nbytes if isinstance(v, CodedTensor) else 4 * v.numel()
                              for _, v in coded or []))  # fmt: skip
        yield {"done": True}

    async def ask() -> Reveal:
        return await fetch_reveal(referee, prover.peer_id, 1, 0, template, shapes, timeout=10,
                                  layouts=_layouts(model), end=False, start=False,
                                  moments=True)  # fmt: skip

    try:
        await referee.start()
        await prover.start()
        await referee.connect(prover.addresses()[0])
        template = {"optimizer": start.optimizer["optimizer"], "grad_scaler": None}
        shapes = [p.shape for p in model.parameters()]
        got = await ask()
        assert got.start is None and got.moments is not None
        state = decode_state(got.moments)
        own = start.optimizer["optimizer"]["state"]
        assert all(torch.equal(state[i][k], own[i][k]) for i in own for k in own[i])
        moment_elements = 2 * sum(p.numel() for p in model.parameters())
        assert sent_bytes[0] < 0.26 * 4 * moment_elements, "a quarter of the float32 moments"
        mode[0] = "2.7"
        old = await ask()
        assert old.start is None and old.moments is None
        malformed = {"bad-dtype": RevealError, "bad-scale": RevealError,
                     "too-many-codes": RevealTooLarge, "bad-mode": RevealError}  # fmt: skip
        for bad, error in malformed.items():
            mode[0] = bad
            with pytest.raises(error):
                await ask()
    finally:
        await referee.aclose()
        await prover.aclose()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_rounded_on_a_gpu_decodes_to_the_same_bits_on_the_cpu() -> None:
    """A GPU prover rounds its moments where they live; a CPU referee decodes its
    codes: the bits must agree, or no quantized start would ever be rebuilt."""
    for x in awkward_tensors():
        on_gpu = x.cuda()
        if not round_trip_(on_gpu):
            continue
        coded = encode_exact(on_gpu.cpu())
        assert coded is not None
        assert torch.equal(bits(decode(coded)), bits(on_gpu.cpu()))
