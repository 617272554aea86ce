"""Sizes a hostile peer chooses: every RPC that receives tensors bounds them by what the
receiver expects (a stage's samples and activation shape, a reveal's parameters, the
state layout we hold) and refuses more before it allocates or reads anything.

"Nothing allocated" is checked twice: no tensor of a hostile size was made
(`torch.empty` is watched), and the process' resident memory did not grow by
anything like the 4 GiB announced (that is a correctness bound, not a timing)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch

from shoal.averaging.compression import get_codec
from shoal.averaging.state_sync import StateServer, load_state_from_peers, make_state
from shoal.dht.node import DHTNode
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.peer.verify.reveals import PROTOCOL as REVEALS
from shoal.peer.verify.reveals import (
    Reveal,
    RevealTooLarge,
    fetch_reveal,
    fetch_reveal_end,
    send_reveal,
    send_reveal_end,
)
from shoal.peer.verify.segments import SegmentState
from shoal.peer.verify.verifier import parse_reveal_parts, parse_reveal_request
from shoal.pipeline.bounds import StageBounds, probe_bounds
from shoal.pipeline.server import pipeline_protocol
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.wire import recv_tensor, send_tensor
from shoal.transport import rpc
from shoal.transport.errors import RemoteError, StreamReset, TransportError

from .pipeline_swarm import EXPERIMENT, HOST_OPTS, TINY

HUGE = 1 << 30  # elements a hostile header announces (4 GiB of float32)
GROWTH_MB = 64  # what the process may grow by meanwhile (allocating it: 4096)
GLOBAL_BATCH = 8


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture
def big_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Elements of every tensor of 16M elements or more made meanwhile."""
    made: list[int] = []
    real = torch.empty

    def watched(*size: Any, **kwargs: Any) -> torch.Tensor:
        t = real(*size, **kwargs)
        if t.numel() >= 1 << 24:
            made.append(t.numel())
        return t

    monkeypatch.setattr(torch, "empty", watched)
    yield made


def tensor_frame(header: dict[str, Any]) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return rpc.FRAME.pack(len(body), rpc.TENSOR) + body


async def node(make_host: Callable[..., Any], boot: DHTNode | None = None) -> DHTNode:
    host = await make_host(**HOST_OPTS)
    bootstrap = [] if boot is None else [str(boot.host.addresses()[0])]
    return await DHTNode.create(host, bootstrap=bootstrap, hop_timeout=1.0)


class Stage1:
    """Stage 1 of TINY's 3 stages, served with its probed bounds, and a trainer's host."""

    def __init__(self, peer: StagePeer, client: DHTNode, bounds: StageBounds) -> None:
        self.peer, self.client, self.bounds = peer, client, bounds

    @property
    def refused(self) -> int:
        return self.peer.server.oversized_refused

    def open(self, method: str, samples: int, codec: str = "int8", enc: bool = True) -> Any:
        payload = {"stage": 1, "key": "k", "samples": samples, "codec": codec,
                   "enc": [enc, enc]}  # fmt: skip
        server = self.peer.server.dht.peer_id
        protocol = pipeline_protocol(EXPERIMENT)
        return rpc.open_call(self.client.host, server, protocol, method, payload, timeout=10)


@pytest.fixture
async def stage1(make_host: Callable[..., Any]) -> Any:
    task = make_task(TINY)
    bounds = probe_bounds(task, 5, 3, GLOBAL_BATCH)
    module = task.make_stages(5, 3)[1]
    served = await node(make_host)
    peer = StagePeer(served, EXPERIMENT, 1, module, hyper={"lr": 1e-3},
                     global_batch=GLOBAL_BATCH, bounds=bounds[1])  # fmt: skip
    await peer.start(sync=False)
    client = await node(make_host, served)
    try:
        yield Stage1(peer, client, bounds[1])
    finally:
        await peer.aclose()
        await client.aclose()
        await served.aclose()


def test_the_probe_measures_each_stage_from_one_held_out_sample() -> None:
    """TINY: byte ids (context 32) into stage 0, hidden states (32 x d_model 32) between
    stages, logits (32 x 256) out of the last; a request holds a global batch at most."""
    bounds = probe_bounds(make_task(TINY), 5, 3, GLOBAL_BATCH)
    assert [(b.input_elements, b.output_elements) for b in bounds] == [
        (32, 32 * 32), (32 * 32, 32 * 32), (32 * 32, 32 * 256),
    ]  # fmt: skip
    assert {b.max_samples for b in bounds} == {GLOBAL_BATCH}
    assert probe_bounds(make_task(TINY), 5, 3, 2)[0].max_samples == TINY["batch_size"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["int8", "none"])
async def test_a_stage_request_announcing_2_30_elements_is_refused_before_allocation(
    stage1: Stage1, big_allocations: list[int], codec: str
) -> None:
    before = rss_mb()
    with pytest.raises((RemoteError, StreamReset), match="PayloadTooLarge"):
        async with stage1.open("forward", samples=4, codec=codec, enc=codec != "none") as call:
            if codec == "none":  # a plain tensor: its header, 4 GiB of float32 announced
                await call.stream.write(tensor_frame(
                    {"lib": "torch", "dtype": "float32", "shape": [4, HUGE // 4],
                     "nbytes": 4 * HUGE}))  # fmt: skip
            else:  # an encoded one: the shape, then a chunk of its encoded size
                await call.send({"shape": [4, HUGE // 4], "dtype": "torch.float32"})
                await call.stream.write(rpc.CHUNK.pack(8, rpc.TENSOR, 0, HUGE))
            for _ in range(16):  # and bytes, as long as the stream takes them
                await call.stream.write(bytes(1 << 20))
            await call.recv_item()
    assert stage1.refused == 1
    assert big_allocations == [], "a tensor of the announced size was made"
    assert rss_mb() - before < GROWTH_MB
    assert stage1.peer.server.served["forward"] == 0


@pytest.mark.timeout(60)
async def test_a_request_of_more_samples_than_a_global_batch_is_refused_unread(
    stage1: Stage1, big_allocations: list[int]
) -> None:
    """Its tensors would be within the elements per sample: the sample count is the lie."""
    samples = 1 << 20
    with pytest.raises((RemoteError, StreamReset), match="PayloadTooLarge"):
        async with stage1.open("backward", samples=samples) as call:
            await call.recv_item()
    assert stage1.refused == 1 and big_allocations == []


@pytest.mark.timeout(60)
async def test_a_message_announcing_4_gib_is_refused_and_counted(stage1: Stage1) -> None:
    host, server = stage1.client.host, stage1.peer.server
    stream = await host.open_stream(server.dht.peer_id, pipeline_protocol(EXPERIMENT))
    await stream.write(rpc.FRAME.pack(0xFFFFFFF0, rpc.MSG) + bytes(1 << 16))
    with pytest.raises(StreamReset):
        await asyncio.wait_for(stream.read(), 5)
    assert stage1.refused == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["int8", "none"])
async def test_an_honest_request_just_at_the_bound_is_served(stage1: Stage1, codec: str) -> None:
    """A global batch of samples, each as large as the stage's inputs: served, as are its
    forward and backward; one element more per sample is not."""
    bounds, wire = stage1.bounds, get_codec(codec)
    samples = bounds.max_samples
    inputs = torch.randn(samples, 32, 32)
    async with stage1.open("forward", samples, codec, enc=codec != "none") as call:
        await send_tensor(call, inputs, wire)
        meta = await call.recv_item()
        out = await recv_tensor(call, wire, meta["enc"], rows=samples,
                                max_elements=bounds.outputs(samples))  # fmt: skip
    assert out.shape == (samples, 32, 32)
    async with stage1.open("backward", samples, codec, enc=codec != "none") as call:
        await send_tensor(call, inputs, wire)
        await send_tensor(call, torch.randn(samples, 32, 32), wire)
        meta = await call.recv_item()
        grad = await recv_tensor(call, wire, meta["enc"], rows=samples,
                                 max_elements=bounds.inputs(samples))  # fmt: skip
    assert grad.shape == inputs.shape and stage1.refused == 0
    with pytest.raises((RemoteError, StreamReset)):
        async with stage1.open("forward", samples, codec, enc=codec != "none") as call:
            await send_tensor(call, torch.randn(samples, 32, 32 + 1), wire)
            await call.recv_item()
    assert stage1.refused == 1


def hostile_prover(host: Any, tensors: list[dict[str, Any]]) -> rpc.RpcService:
    """A prover whose reveal header is well formed and whose tensors are `tensors`'
    headers, each followed by nothing but the announcement."""
    service = rpc.RpcService(host, REVEALS)

    @service.stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        yield {"params": 2, "keys": [[0, "exp_avg"]], "end_opt": b"e" * 32,
               "final_opt": b"f" * 32}  # fmt: skip
        for header in tensors:
            await ctx.stream.write(tensor_frame(header))
        await ctx.stream.write(bytes(1 << 20))
        await asyncio.Event().wait()  # (the asker hangs up)

    return service


def f32(shape: list[int]) -> dict[str, Any]:
    import math

    return {"lib": "torch", "dtype": "float32", "shape": shape, "nbytes": 4 * math.prod(shape)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "tensors",
    [
        [f32([HUGE])],  # the first parameter, 4 GiB
        [f32([2, 3]), f32([2]), f32([HUGE])],  # its optimizer state, 4 GiB
        [f32([3, 2])],  # the same elements, another shape
    ],
    ids=["parameter", "optimizer-state", "shape"],
)
async def test_a_reveal_announcing_more_than_our_model_is_refused_before_allocation(
    make_host: Callable[..., Any], big_allocations: list[int], tensors: list[dict[str, Any]]
) -> None:
    referee, prover = await make_host(), await make_host()
    hostile_prover(prover, tensors)
    await referee.connect(prover.addresses()[0])
    shapes = [p.shape for p in torch.nn.Linear(3, 2).parameters()]  # [2, 3], [2]
    before = rss_mb()
    with pytest.raises(ValueError) as refused:
        await fetch_reveal(referee, prover.peer_id, 1, 0, {}, shapes, timeout=10)
    assert isinstance(refused.value, RevealTooLarge) == (tensors[-1]["shape"] == [HUGE])
    assert big_allocations == [] and rss_mb() - before < GROWTH_MB


@pytest.mark.timeout(30)
@pytest.mark.parametrize("final", [False, True], ids=["today", "from-a-2.0-prover"])
async def test_an_honest_reveal_of_our_models_layout_is_taken(
    make_host: Callable[..., Any], final: bool
) -> None:
    """Parameters of our shapes and AdamW's state (two moments of a parameter's shape and
    a step count each): exactly what the bounds allow. We ask without the run's final
    state; a prover of protocol 2.0 sends it anyway, and that is read too."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    start = SegmentState(params, {"optimizer": opt.state_dict(), "grad_scaler": None})
    sent = (
        Reveal(start, params, b"e" * 32, params, b"f" * 32)
        if final
        else Reveal(start, params, b"e" * 32)
    )
    referee, prover = await make_host(), await make_host()
    service = rpc.RpcService(prover, REVEALS)
    asked: list[Any] = []

    @service.stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        asked.append(payload)
        await send_reveal(ctx, sent)
        yield {"done": True}

    await referee.connect(prover.addresses()[0])
    template = {"optimizer": opt.state_dict(), "grad_scaler": None}
    shapes = [p.shape for p in model.parameters()]
    got = await fetch_reveal(
        referee, prover.peer_id, 1, 0, template, shapes, timeout=10, commitment=b"c" * 32
    )
    assert asked[0]["commitment"] == b"c" * 32
    assert all(torch.equal(a, b) for a, b in zip(got.start.params, params, strict=True))
    assert len(got.start.optimizer["optimizer"]["state"]) == 2
    assert got.end_optimizer == b"e" * 32
    assert asked[0]["final"] is False
    if final:
        assert got.final_optimizer == b"f" * 32 and got.final_params is not None
        assert all(torch.equal(a, b) for a, b in zip(got.final_params, params, strict=True))
    else:
        assert got.final_params is None and got.final_optimizer is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("prover_withholds", [True, False], ids=["2.6-prover", "2.5-prover"])
async def test_a_reveal_asked_without_its_end_comes_without_it_and_the_end_alone_after(
    make_host: Callable[..., Any], prover_withholds: bool
) -> None:
    """A 2.6 referee asks without the segment's end (it hashes its own re-run's end
    first): a 2.6 prover withholds it and says so, a 2.5 prover sends it anyway and it
    is read. Asked for the end alone, a prover sends its parameters and the hash of
    its optimizer state, checked against our model's shapes."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    start = SegmentState(params, {"optimizer": opt.state_dict(), "grad_scaler": None})
    end = [p + 1 for p in params]
    referee, prover = await make_host(), await make_host()
    service = rpc.RpcService(prover, REVEALS)
    asked: list[Any] = []

    @service.stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        asked.append(payload)
        with_end, only_end, _ = parse_reveal_parts(payload)
        if only_end:
            await send_reveal_end(ctx, SegmentState(end, start.optimizer))
        else:
            withheld = prover_withholds and not with_end
            await send_reveal(ctx, Reveal(start, None if withheld else end, b"e" * 32))
        yield {"done": True}

    await referee.connect(prover.addresses()[0])
    template = {"optimizer": opt.state_dict(), "grad_scaler": None}
    shapes = [p.shape for p in model.parameters()]
    got = await fetch_reveal(referee, prover.peer_id, 1, 0, template, shapes, timeout=10,
                             end=False)  # fmt: skip
    assert asked[0]["end"] is False and got.end_optimizer == b"e" * 32
    if prover_withholds:
        assert got.end_params is None
    else:
        assert got.end_params is not None
        assert all(torch.equal(a, b) for a, b in zip(got.end_params, end, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.start.params, params, strict=True))
    alone, end_opt = await fetch_reveal_end(referee, prover.peer_id, 1, 0, shapes, timeout=10)
    assert asked[1]["only_end"] is True
    assert all(torch.equal(a, b) for a, b in zip(alone, end, strict=True))
    assert len(end_opt) == 32
    with pytest.raises(RevealTooLarge):  # (an end of another model: refused unread)
        await fetch_reveal_end(referee, prover.peer_id, 1, 0, shapes[:1], timeout=10)


def test_a_reveal_request_says_whether_the_end_goes_with_it_or_alone() -> None:
    """Before 2.6 a request says neither: the whole reveal, end included."""
    assert parse_reveal_parts({"round": 3, "segment": 1})[:2] == (True, False)
    assert parse_reveal_parts({"end": False})[:2] == (False, False)
    assert parse_reveal_parts({"only_end": True})[:2] == (True, True)
    for bad in ({"end": 0}, {"only_end": "yes"}):
        with pytest.raises(ValueError):
            parse_reveal_parts(bad)


def test_a_referee_of_protocol_2_0_is_revealed_the_final_state_it_checks() -> None:
    """Its request does not say `final`: it reads the final state after the end, so it
    gets it; today's referees say they do not want it; anything else is refused."""
    assert parse_reveal_request({"round": 3, "segment": 1}) == (3, 1, True, None)
    assert parse_reveal_request({"round": 3, "segment": 1, "final": False}) == (3, 1, False, None)
    with pytest.raises(ValueError):
        parse_reveal_request({"round": 3, "segment": 1, "final": "no"})


def test_a_reveal_request_names_the_commitment_audited_or_is_refused() -> None:
    """Since 2.4 a referee names the digest of the commitment it audits: a prover that
    re-synced and committed the round index again reveals the work of the round that
    commitment is of, never the other round's (which would read as a lie). A digest
    that is not bytes of a digest's size is malformed."""
    request = {"round": 3, "segment": 1, "final": False, "commitment": b"d" * 32}
    assert parse_reveal_request(request) == (3, 1, False, b"d" * 32)
    for bad in ("d" * 32, b"d" * 65, 7):
        with pytest.raises(ValueError):
            parse_reveal_request({**request, "commitment": bad})


@pytest.mark.timeout(30)
async def test_a_reveal_of_another_parameter_count_is_refused_before_any_tensor(
    make_host: Callable[..., Any],
) -> None:
    referee, prover = await make_host(), await make_host()
    hostile_prover(prover, [f32([2, 3])])
    await referee.connect(prover.addresses()[0])
    shapes = [torch.Size([2, 3]), torch.Size([2]), torch.Size([4])]  # three: it says two
    with pytest.raises(RevealTooLarge, match="2 parameters"):
        await fetch_reveal(referee, prover.peer_id, 1, 0, {}, shapes, timeout=10)


@pytest.mark.timeout(60)
async def test_a_state_download_of_another_layout_is_refused_before_allocation(
    make_host: Callable[..., Any], big_allocations: list[int]
) -> None:
    """A holder that describes its state as 4 GiB is refused on its description; one
    whose layout is ours serves the download."""
    a, b = await node(make_host), None
    try:
        b = await node(make_host, a)
        ours = [torch.zeros(4, 3), torch.zeros(5)]
        lying = StateServer(a, "k", lambda: make_state([torch.zeros(4, 3)], {"step": 9}))

        async def info(ctx: rpc.CallContext, payload: Any) -> Any:
            return {"fp": "x" * 64, "metadata": {"step": 9}, "work": None,
                    "tensors": [["float32", [HUGE]]], "total": 4 * HUGE}  # fmt: skip

        lying.service.unary("info")(info)  # (the layout it claims, not the one it has)
        await lying.announce()
        refused: list[Any] = []
        with pytest.raises(Exception, match="other than ours"):
            await load_state_from_peers(b, "k", timeout=5, like=ours, on_refused=refused.append)
        assert refused == [a.peer_id] and big_allocations == []
        lying.close()
        honest = StateServer(a, "k", lambda: make_state([torch.ones(4, 3), torch.ones(5)], {}))
        await honest.announce()
        state = await load_state_from_peers(b, "k", timeout=10, like=ours)
        assert [t.shape for t in state.tensors] == [t.shape for t in ours]
    finally:
        if b is not None:
            await b.aclose()
        await a.aclose()


@pytest.mark.timeout(30)
async def test_an_rpc_tensor_beyond_the_calls_bound_is_refused_and_counted(
    make_host: Callable[..., Any], big_allocations: list[int]
) -> None:
    client, server = await make_host(), await make_host()
    service = rpc.RpcService(server, "/test/bounded/1.0.0")

    @service.stream("take")
    async def take(ctx: rpc.CallContext, most: int) -> Any:
        t = await ctx.recv_tensor(max_elements=most)
        yield t.numel()

    await client.connect(server.addresses()[0])
    async with rpc.open_call(client, server.peer_id, "/test/bounded/1.0.0", "take", 12) as call:
        await call.send_tensor(torch.zeros(3, 4))
        assert await call.recv_item() == 12
    with pytest.raises((RemoteError, TransportError)):
        async with rpc.open_call(client, server.peer_id, "/test/bounded/1.0.0", "take", 12) as c:
            await c.stream.write(tensor_frame(f32([HUGE])))
            await c.recv_item()
    assert service.oversized_refused == 1 and big_allocations == []
