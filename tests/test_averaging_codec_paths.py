"""The fast paths of the codecs and of the all-reduce round, held to their plain definitions.

- The int8 codec (compiled loops) produces exactly the bytes of the plain numpy
  formulation of its documented layout, decodes them to exactly its values, and adds
  them to a sum exactly as documented, whatever the alignment of the buffers.
- `check` + `decode_checked` are `decode` split in two: the same bytes are refused.
- `add_decoded` and `add_plain` (what an owner sums with) add weight * decode(bytes) and
  weight * its own input, deterministically.
- A round whose input is one contiguous float32 tensor decodes the encoded average
  straight into that tensor on commit: bit-identical on every member, identical to the
  round over the same values cut into several tensors, and nothing written on abort.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shoal.averaging.allreduce import AllReduceConfig, AllReduceOutcome, AllReduceService
from shoal.averaging.compression import CodecError, Int8BlockCodec, get_codec
from shoal.averaging.group import Group, Member, make_round_id
from shoal.transport.host import Host

FAST = {"heartbeat_interval": 0.05, "stall_timeout": 1.0, "decision_timeout": 1.0}
F32_MAX = float(np.finfo(np.float32).max)


# --- int8 against its plain definition ----------------------------------------------------------


def reference_int8_encode(x: np.ndarray, bs: int) -> bytes:
    """The documented layout, step by step: per block scale = absmax / 127 (float32,
    capped so that 127 * scale is finite, below FLT_MIN flushed to +0), then
    q = round_half_even(x / scale) (x / 1 for a flushed block); scales first, then q."""
    tiny = np.float32(np.finfo(np.float32).tiny)
    cap = np.float32(F32_MAX) / np.float32(127)
    with np.errstate(over="ignore"):
        while not np.isfinite(cap * np.float32(127)):
            cap = np.nextafter(cap, np.float32(0))
    scales, codes = [], []
    for start in range(0, len(x), bs):
        block = x[start : start + bs].astype(np.float32)
        s = np.float32(np.max(np.abs(block))) / np.float32(127)
        s = min(s, cap)
        s = np.float32(0) if s < tiny else np.float32(s)
        q = np.rint(block / (s if s > 0 else np.float32(1))).astype(np.int8)
        scales.append(s)
        codes.append(q)
    if not scales:
        return b""
    return np.array(scales, dtype="<f4").tobytes() + np.concatenate(codes).tobytes()


def reference_int8_decode(data: bytes, n: int, bs: int) -> np.ndarray:
    nb = -(-n // bs)
    scales = np.frombuffer(data[: 4 * nb], dtype="<f4")
    q = np.frombuffer(data[4 * nb :], dtype=np.int8).astype(np.float32)
    return (q * np.repeat(scales, bs)[:n]).astype(np.float32)


awkward = st.floats(width=32, allow_nan=False, allow_infinity=False) | st.sampled_from(
    [0.0, -0.0, 1e-38, -1e-45, F32_MAX, -F32_MAX, 127.0, -63.5, 0.5]
)


@settings(max_examples=80, deadline=None)
@given(arrays(np.float32, st.integers(0, 1500), elements=awkward), st.sampled_from([16, 64, 256]))
def test_int8_bytes_and_values_are_those_of_the_plain_definition(
    values: np.ndarray, block_size: int
) -> None:
    codec = Int8BlockCodec(block_size)
    x = torch.from_numpy(values.copy())
    data = bytes(codec.encode(x))
    assert data == reference_int8_encode(values, block_size)
    out = torch.empty_like(x)
    codec.decode(data, out)
    ref = reference_int8_decode(data, len(values), block_size)
    assert out.numpy().view(np.uint32).tolist() == ref.view(np.uint32).tolist()


def test_int8_matches_its_definition_on_large_chunked_inputs() -> None:
    """Many blocks, with a short last block."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn((1 << 19) + 77, generator=g) * torch.rand((1 << 19) + 77, generator=g) * 50
    codec = get_codec("int8")
    data = bytes(codec.encode(x))
    assert data == reference_int8_encode(x.numpy(), 256)


@pytest.mark.parametrize("name", ["int8", "fp16", "bf16", "none"])
def test_add_plain_adds_the_weighted_own_input_like_float32_arithmetic(name: str) -> None:
    # The summing member's own input is added as is (it was never encoded).
    codec = get_codec(name)
    g = torch.Generator().manual_seed(7)
    x, base = torch.randn(3001, generator=g) * 5, torch.randn(3001, generator=g)
    out = base.clone()
    codec.add_plain(x, out, 0.3)
    again = base.clone()
    codec.add_plain(x, again, 0.3)
    assert torch.equal(out, again)  # the same bits every time
    if name == "int8":  # the compiled loop: out + x * w, each step rounded to float32
        expected = base.numpy() + x.numpy() * np.float32(0.3)
        assert out.numpy().view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    assert torch.allclose(out.double(), base.double() + 0.3 * x.double(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="elements"):
        codec.add_plain(x[:10], out, 1.0)
    # The first term of a sum overwrites whatever the buffer held.
    first = torch.full((3001,), float("nan"))
    codec.add_plain(x, first, 0.3, overwrite=True)
    assert torch.allclose(first.double(), 0.3 * x.double(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [1, 256, 1000, (1 << 18) + 3])
def test_int8_add_decoded_is_out_plus_decoded_times_weight_in_float32(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    codec = get_codec("int8")
    data = bytes(codec.encode(torch.randn(n, generator=g) * 40))
    base = torch.randn(n, generator=g)
    out = base.clone()
    codec.add_decoded(bytearray(data), out, 0.3)
    decoded = reference_int8_decode(data, n, 256)
    expected = base.numpy() + decoded * np.float32(0.3)  # float32 throughout
    assert out.numpy().view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    first = torch.full((n,), float("nan"))  # the first term overwrites what was there
    codec.add_decoded(bytearray(data), first, 0.3, overwrite=True)
    expected = decoded * np.float32(0.3)
    assert first.numpy().view(np.uint32).tolist() == expected.view(np.uint32).tolist()


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_int8_codes_to_and_from_buffers_that_do_not_start_on_a_float(offset: int) -> None:
    # Receive slots and staging buffers are slices: their scales may be unaligned.
    codec = get_codec("int8-16")
    x = torch.randn(1000) * 9
    expected = bytes(codec.encode(x))
    backing = bytearray(len(expected) + offset)
    view = memoryview(backing)[offset:]
    codec.encode(x, view)
    assert bytes(view) == expected
    out, ref = torch.empty(1000), torch.empty(1000)
    codec.decode(expected, ref)
    codec.decode(view, out)
    assert torch.equal(out, ref)
    summed = torch.ones(1000)
    codec.add_decoded(view, summed, 1.0)
    assert torch.equal(summed, torch.ones(1000) + ref)


LOAD_WITHOUT_STALLING = """
import asyncio, json, sys, time
import uvloop
from shoal.averaging.allreduce import AllReduceService
from shoal.averaging.compression import get_codec
from shoal.transport.host import Host
from shoal.transport.identity import Identity

async def main():
    host = Host(Identity.generate())
    service = AllReduceService(host)
    lags, stop = [], False
    async def tick():
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            lags.append(time.perf_counter() - t - 0.002)
    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    assert not get_codec("int8").prepared
    start = time.perf_counter()
    await service.prepare("int8")
    took = time.perf_counter() - start
    stop = True
    await ticker
    print(json.dumps({"took": took, "lag": max(lags), "prepared": get_codec("int8").prepared}))

uvloop.run(main())
"""


def test_the_int8_codec_loads_its_compiled_loops_without_stalling_the_event_loop() -> None:
    # A fresh interpreter: the loops are not loaded yet. Loading them inline would stall
    # the loop for the whole load (heartbeats and deadlines of a round with it).
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_STALLING],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["prepared"]
    assert report["lag"] < 0.5 * report["took"], report


# --- check + decode_checked = decode -----------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(["int8", "int8-16", "fp16", "bf16", "none"]), st.integers(0, 300))
def test_check_refuses_exactly_what_decode_refuses_and_decode_checked_agrees(
    draw: st.DataObject, name: str, n: int
) -> None:
    codec = get_codec(name)
    size = codec.encoded_size(n)
    valid = bytes(codec.encode(torch.randn(n)))
    data = draw.draw(st.sampled_from([valid]) | st.binary(min_size=size, max_size=size))
    try:
        expected = torch.empty(n)
        codec.decode(data, expected)
    except CodecError:
        with pytest.raises(CodecError):
            codec.check(data, n)
        return
    codec.check(data, n)
    got = torch.full((n,), 7.0)
    codec.decode_checked(bytearray(data), got)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_check_names_the_bad_block_and_refuses_a_wrong_length() -> None:
    codec = Int8BlockCodec(16)
    data = bytearray(codec.encode(torch.randn(40)))
    data[8:12] = struct.pack("<f", float("nan"))
    with pytest.raises(CodecError, match="block 2"):
        codec.check(data, 40)
    with pytest.raises(CodecError, match="expected"):
        codec.check(data[:-1], 40)


@pytest.mark.parametrize("name", ["int8", "int8-16", "fp16", "bf16", "none"])
@pytest.mark.parametrize("n", [0, 1, 255, 257, (1 << 18) + 3])
def test_add_decoded_adds_the_weighted_decoded_values_deterministically(name: str, n: int) -> None:
    codec = get_codec(name)
    g = torch.Generator().manual_seed(n)
    data = bytes(codec.encode(torch.randn(n, generator=g) * 3))
    base = torch.randn(n, generator=g)
    decoded = torch.empty(n)
    codec.decode(data, decoded)
    outs = []
    for buffer in (bytearray(data), bytearray(data)):
        out = base.clone()
        codec.add_decoded(buffer, out, 0.3)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])  # the same bits every time
    expected = base.double() + 0.3 * decoded.double()
    assert torch.allclose(outs[0].double(), expected, rtol=1e-6, atol=1e-6)


# --- rounds over loopback ------------------------------------------------------------------------


class Killed(Exception):
    pass


async def services(
    make_host: Callable[..., Any], n: int, configs: list[AllReduceConfig] | None = None
) -> tuple[list[Host], list[AllReduceService]]:
    hosts = [await make_host(close_grace=0.5) for _ in range(n)]
    cfgs = configs or [AllReduceConfig(chunk_bytes=4096, **FAST)] * n
    return hosts, [AllReduceService(h, c) for h, c in zip(hosts, cfgs, strict=True)]


def group_of(hosts: list[Host]) -> Group:
    members = tuple(Member(h.peer_id, tuple(h.addresses())) for h in hosts)
    return Group(
        "test", make_round_id("test", [m.peer_id for m in members], os.urandom(16)), members
    )


async def run_round(
    svcs: list[AllReduceService], group: Group, tensors: list[list[torch.Tensor]], codec: str
) -> list[Any]:
    return await asyncio.gather(
        *(s.run(group, ts, 1.0, codec=codec) for s, ts in zip(svcs, tensors, strict=True)),
        return_exceptions=True,
    )


@pytest.mark.parametrize("codec", ["int8", "fp16"])
async def test_one_flat_tensor_gets_the_same_bits_as_the_same_values_in_pieces(
    make_host: Callable[..., Any], codec: str
) -> None:
    hosts, svcs = await services(make_host, 3)
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(10_007, generator=g) * 10 for _ in range(3)]
    flat = [[x.clone()] for x in inputs]  # decoded straight into the caller's tensor
    pieces = [list(x.clone().split([1, 5000, 5006])) for x in inputs]  # via a result buffer
    try:
        for tensors in (flat, pieces):
            outs = await run_round(svcs, group_of(hosts), tensors, codec)
            assert all(isinstance(o, AllReduceOutcome) and o.committed for o in outs), outs
        results = [torch.cat(ts) for ts in flat + pieces]
        for r in results[1:]:
            assert torch.equal(r, results[0])
        mean = torch.stack(inputs).double().mean(0)
        assert float((results[0].double() - mean).abs().max() / mean.abs().max()) < 3e-2
    finally:
        await asyncio.gather(*(s.aclose() for s in svcs))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("point", ["before_ready", "after_reduce_scatter"])
async def test_an_aborted_int8_round_writes_nothing_into_a_flat_tensor(
    make_host: Callable[..., Any], point: str
) -> None:
    box: list[Host] = []

    async def hook(p: str) -> None:
        if p == point:
            host = box[0]  # die like a killed process: every connection cut at once
            host._closing = True
            for conn in list(host._all):
                conn.abort("killed")
            raise Killed(p)

    cfgs = [AllReduceConfig(chunk_bytes=4096, fault_hook=hook, **FAST)] + [
        AllReduceConfig(chunk_bytes=4096, **FAST)
    ] * 2
    hosts, svcs = await services(make_host, 3, cfgs)
    box.append(hosts[0])
    inputs = [torch.randn(20_000) for _ in range(3)]
    tensors = [[x.clone()] for x in inputs]
    try:
        outs = await run_round(svcs, group_of(hosts), tensors, "int8")
        assert isinstance(outs[0], Killed)
        for i in (1, 2):
            assert isinstance(outs[i], AllReduceOutcome) and not outs[i].committed
            assert torch.equal(tensors[i][0], inputs[i])
    finally:
        await asyncio.gather(*(s.aclose() for s in svcs))
