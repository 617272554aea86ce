"""RPC: unary and streaming calls, deadlines, cancellation, typed errors, tensors."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
from waiting import eventually

from shoal.transport import rpc
from shoal.transport.errors import (
    ConnectionLost,
    ProtocolNotSupported,
    ProtocolViolation,
    RemoteError,
    RpcTimeout,
    StreamReset,
    UnknownMethod,
)
from shoal.transport.rpc import FRAME, MSG, RpcService

PROTO = "/shoal/test-rpc/1.0.0"


@pytest.fixture
async def served(pair):
    """(client host, server host, service) with a few methods registered."""
    client, server = pair
    svc = RpcService(server, PROTO)
    svc.state = {"cancelled": asyncio.Event(), "started": asyncio.Event()}

    @svc.unary("echo")
    async def echo(ctx, payload):
        return payload

    @svc.unary("whoami")
    async def whoami(ctx, payload):
        return {"peer": str(ctx.peer), "timeout": ctx.timeout}

    @svc.unary("fail")
    async def fail(ctx, payload):
        raise ValueError(f"bad value {payload}")

    @svc.unary("sleep")
    async def sleep(ctx, seconds):
        svc.state["started"].set()
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            svc.state["cancelled"].set()
            raise
        return "slept"

    @svc.stream("count")
    async def count(ctx, n):
        for i in range(n):
            yield i

    @svc.stream("sum_tensors")
    async def sum_tensors(ctx, n):
        # Bidirectional: read n tensors from the caller, answer with their sum.
        total = None
        for _ in range(n):
            t = await ctx.recv_tensor()
            total = t.clone() if total is None else total + t
        await ctx.send_tensor(total)
        yield "done"

    @svc.stream("chunks")
    async def chunks(ctx, sizes):
        # Echo: read one chunk per size into a posted buffer, answer with the same chunks.
        bufs = [bytearray(n) for n in sizes]
        for i, buf in enumerate(bufs):
            await ctx.recv_chunk_into(i, memoryview(buf))
        for i, buf in enumerate(bufs):
            await ctx.send_chunk(i, memoryview(buf))
        yield "done"

    @svc.stream("refuse_chunks")
    async def refuse_chunks(ctx, _):
        raise LookupError("no such part")
        yield  # a streaming handler

    await client.connect(server.addresses()[0])
    return client, server, svc


async def test_a_unary_call_returns_the_result(served) -> None:
    client, server, _ = served
    payload = {"a": [1, 2.5, "x", b"\x00\xff", None, True], "nested": {"k": {"v": 1}}}
    assert await rpc.call(client, server.peer_id, PROTO, "echo", payload) == payload


async def test_a_message_larger_than_the_flow_control_window_goes_through(served) -> None:
    """A message is read whole before it is decoded; the stream's window starts at 256
    KiB and the sender sends no more until the reader reads, so a reader that waited
    for the whole message to be buffered first waited forever."""
    client, server, _ = served
    payload = {"blob": os.urandom(3 * 256 * 1024 + 1), "n": 1}
    got = await rpc.call(client, server.peer_id, PROTO, "echo", payload, timeout=10)
    assert got == payload


async def test_the_handler_sees_the_caller_and_its_deadline(served) -> None:
    client, server, _ = served
    got = await rpc.call(client, server.peer_id, PROTO, "whoami", None, timeout=7)
    assert got == {"peer": str(client.peer_id), "timeout": 7.0}


async def test_a_handler_error_arrives_as_a_typed_remote_error(served) -> None:
    client, server, _ = served
    with pytest.raises(RemoteError) as info:
        await rpc.call(client, server.peer_id, PROTO, "fail", 42)
    assert info.value.kind == "ValueError"
    assert info.value.message == "bad value 42"


async def test_an_unknown_method_is_a_typed_error(served) -> None:
    client, server, _ = served
    with pytest.raises(UnknownMethod):
        await rpc.call(client, server.peer_id, PROTO, "no_such_method")


async def test_an_unknown_service_is_refused(served) -> None:
    client, server, _ = served
    with pytest.raises(ProtocolNotSupported):
        await rpc.call(client, server.peer_id, "/shoal/absent/1.0.0", "echo")


async def test_a_deadline_times_out_the_call_and_cancels_the_handler(served) -> None:
    client, server, svc = served
    with pytest.raises(RpcTimeout):
        await rpc.call(client, server.peer_id, PROTO, "sleep", 10, timeout=0.2)
    await asyncio.wait_for(svc.state["cancelled"].wait(), 2)


async def test_the_server_enforces_the_deadline_the_caller_sent(served) -> None:
    client, server, svc = served
    # Ask with a short deadline but wait on the client side longer than that.
    call = rpc.open_call(client, server.peer_id, PROTO, "sleep", 10, timeout=0.2)
    with pytest.raises((RemoteError, RpcTimeout)):
        async with call as c:
            await c.close_send()
            await c.recv_item()
    await asyncio.wait_for(svc.state["cancelled"].wait(), 2)


async def test_cancelling_the_caller_cancels_the_remote_handler(served) -> None:
    client, server, svc = served
    task = asyncio.create_task(rpc.call(client, server.peer_id, PROTO, "sleep", 10))
    await asyncio.wait_for(svc.state["started"].wait(), 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(svc.state["cancelled"].wait(), 2)


async def test_a_lost_connection_is_a_typed_error(served) -> None:
    client, server, svc = served
    task = asyncio.create_task(rpc.call(client, server.peer_id, PROTO, "sleep", 10))
    await asyncio.wait_for(svc.state["started"].wait(), 2)
    server.connections[client.peer_id].abort("test kills the connection")
    with pytest.raises(ConnectionLost):
        await task


async def test_a_streaming_call_yields_every_item(served) -> None:
    client, server, _ = served
    items = [i async for i in rpc.stream_call(client, server.peer_id, PROTO, "count", 500)]
    assert items == list(range(500))


async def test_tensors_travel_raw_and_land_in_a_preallocated_buffer(served) -> None:
    torch = pytest.importorskip("torch")
    client, server, _ = served
    tensors = [torch.randn(256, 1000) for _ in range(3)]
    async with rpc.open_call(client, server.peer_id, PROTO, "sum_tensors", 3) as call:
        for t in tensors:
            await call.send_tensor(t)
        out = torch.empty(256, 1000)
        received = await call.recv_tensor(out=out)
        assert received is out
        assert await call.recv_item() == "done"
    assert torch.equal(out, tensors[0] + tensors[1] + tensors[2])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "bool", "float64"])
async def test_every_dtype_round_trips(served, dtype) -> None:
    torch = pytest.importorskip("torch")
    client, server, svc = served

    @svc.stream("mirror")
    async def mirror(ctx, _):
        await ctx.send_tensor(await ctx.recv_tensor())
        yield None

    src = (torch.randn(3, 5, 7) * 10).to(getattr(torch, dtype))
    async with rpc.open_call(client, server.peer_id, PROTO, "mirror") as call:
        await call.send_tensor(src)
        back = await call.recv_tensor()
        await call.recv_item()
    assert back.dtype == src.dtype and back.shape == src.shape
    assert torch.equal(back, src)


async def test_numpy_arrays_travel_too(served) -> None:
    client, server, svc = served

    @svc.stream("mirror_np")
    async def mirror(ctx, _):
        await ctx.send_tensor(await ctx.recv_tensor())
        yield None

    src = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    async with rpc.open_call(client, server.peer_id, PROTO, "mirror_np") as call:
        await call.send_tensor(src)
        back = await call.recv_tensor()
        await call.recv_item()
    assert isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back, src)


async def test_a_tensor_that_does_not_fit_the_buffer_is_refused(served) -> None:
    torch = pytest.importorskip("torch")
    client, server, svc = served

    @svc.stream("mirror_t")
    async def mirror(ctx, _):
        await ctx.send_tensor(await ctx.recv_tensor())
        yield None

    async with rpc.open_call(client, server.peer_id, PROTO, "mirror_t") as call:
        await call.send_tensor(torch.zeros(4, 4))
        with pytest.raises(ProtocolViolation, match="does not fit"):
            await call.recv_tensor(out=torch.empty(2, 2))


async def test_a_four_gib_length_prefix_is_refused_before_allocation(served) -> None:
    client, server, svc = served
    seen: list[BaseException] = []

    @svc.unary("never")
    async def never(ctx, payload):  # pragma: no cover - the request never decodes
        return None

    stream = await client.open_stream(server.peer_id, PROTO)
    await stream.write(FRAME.pack(0xFFFFFFFF, MSG) + b"\x00" * 64)
    with pytest.raises(StreamReset):
        await asyncio.wait_for(stream.read(), 2)
    # Only that stream paid: the connection carries on.
    assert await rpc.call(client, server.peer_id, PROTO, "echo", "still here") == "still here"
    assert not seen


async def test_a_garbage_request_resets_only_its_stream(served) -> None:
    client, server, _ = served
    stream = await client.open_stream(server.peer_id, PROTO)
    body = b"\xc1" * 10  # 0xc1 is never valid msgpack
    await stream.write(FRAME.pack(len(body), MSG) + body)
    with pytest.raises(StreamReset):
        await asyncio.wait_for(stream.read(), 2)
    assert await rpc.call(client, server.peer_id, PROTO, "echo", 1) == 1


async def test_a_request_that_arrives_in_pieces_is_served(pair) -> None:
    """Most requests are whole when their handler starts (read at once, no deadline to
    arm); one that is not is waited for."""
    client, server = pair
    svc = RpcService(server, PROTO, rpc.RpcLimits(first_message_timeout=10.0))

    @svc.unary("echo")
    async def echo(ctx, payload):
        return payload

    await client.connect(server.addresses()[0])
    stream = await client.open_stream(server.peer_id, PROTO)
    message = rpc.pack_message(["echo", 5.0, "in pieces"])
    await stream.write(message[:3])  # not even the whole frame header
    await eventually(lambda: svc.in_flight(client.peer_id), "the handler waits for the rest")
    await stream.write(message[3:9])
    await stream.write(message[9:])
    await stream.close()
    reply = await rpc.MessageStream(stream).recv()
    assert reply == [rpc.OK, "in pieces"]


@pytest.mark.parametrize("cut", [3, 8], ids=["inside-the-header", "inside-the-body"])
async def test_a_request_cut_short_is_reset_at_its_deadline(pair, cut: int) -> None:
    client, server = pair
    svc = RpcService(server, PROTO, rpc.RpcLimits(first_message_timeout=0.3))
    await client.connect(server.addresses()[0])
    stream = await client.open_stream(server.peer_id, PROTO)
    await stream.write(rpc.pack_message(["echo", 5.0, "never finished"])[:cut])
    with pytest.raises(StreamReset):
        await asyncio.wait_for(stream.read(), 5)
    assert svc.silent_streams == 1


async def test_many_concurrent_calls_on_one_connection(served) -> None:
    client, server, _ = served
    results = await asyncio.gather(
        *(rpc.call(client, server.peer_id, PROTO, "echo", i) for i in range(2000))
    )
    assert results == list(range(2000))
    assert len(client.connections) == 1


async def test_a_call_can_dial_by_address(pair) -> None:
    client, server = pair
    svc = RpcService(server, PROTO)

    @svc.unary("echo")
    async def echo(ctx, payload):
        return payload

    assert await rpc.call(client, server.addresses()[0], PROTO, "echo", "hi") == "hi"


async def test_chunks_land_in_the_buffers_posted_for_them(served) -> None:
    client, server, _ = served
    payloads = [bytes(range(256)) * 7, b"", b"x" * 70001]
    async with rpc.open_call(
        client, server.peer_id, PROTO, "chunks", [len(p) for p in payloads]
    ) as call:
        for i, p in enumerate(payloads):
            assert await call.send_chunk(i, memoryview(p)) == rpc.CHUNK.size + len(p)
        await call.close_send()
        echoed = [bytearray(len(p)) for p in payloads]
        for i, buf in enumerate(echoed):
            await call.recv_chunk_into(i, memoryview(buf))
        assert await call.recv_item() == "done"
    assert [bytes(b) for b in echoed] == payloads


async def test_a_chunk_out_of_order_or_of_another_size_is_a_protocol_violation(served) -> None:
    client, server, _ = served
    for index, size in ((1, 4), (0, 5)):
        with pytest.raises(ProtocolViolation):
            async with rpc.open_call(client, server.peer_id, PROTO, "chunks", [4]) as call:
                await call.send_chunk(0, memoryview(b"abcd"))
                await call.close_send()
                await call.recv_chunk_into(index, memoryview(bytearray(size)))


async def test_an_error_where_a_chunk_was_due_is_the_handlers_typed_error(served) -> None:
    client, server, _ = served
    async with rpc.open_call(client, server.peer_id, PROTO, "refuse_chunks", None) as call:
        await call.close_send()
        with pytest.raises(RemoteError) as err:
            await call.recv_chunk_into(0, memoryview(bytearray(8)))
    assert err.value.kind == "LookupError" and "no such part" in err.value.message


def test_importing_the_transport_does_not_import_torch() -> None:
    code = (
        "import sys; import shoal.transport.rpc, shoal.transport.host, shoal.transport.tensors;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
