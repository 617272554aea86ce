"""Activations between stages: the wire's exact id channel, and bytegpt's bottleneck."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.averaging.compression import CodecError, get_codec
from shoal.peer.training.task_error import TaskError
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.wire import (
    MAX_ELEMENTS,
    HeaderError,
    decode_tensor,
    encode_tensor,
    exact_tail,
    parse_header,
    recv_tensor,
)

from .pipeline_swarm import Swarm

TINY = {"d_model": 32, "n_layers": 3, "n_heads": 2, "context": 32, "batch_size": 4}
INT8 = get_codec("int8")


def roundtrip(t: torch.Tensor, codec: Any = INT8) -> tuple[torch.Tensor, int]:
    head, payload = encode_tensor(t, codec)
    assert len(payload) == head.payload_size(codec)
    return decode_tensor(parse_header(head.header()), payload, codec), len(payload)


def test_a_last_channel_of_byte_values_travels_exactly_and_a_byte_each() -> None:
    hidden = torch.randn(2, 5, 8) * 30
    ids = torch.randint(0, 256, (2, 5)).float()
    t = torch.cat([hidden, ids.unsqueeze(-1)], dim=-1)
    assert exact_tail(t) == "ids"
    out, size = roundtrip(t)
    assert torch.equal(out[..., -1], ids)
    assert torch.allclose(out[..., :-1], hidden, atol=hidden.abs().max().item() / 127)
    assert size == INT8.encoded_size(2 * 5 * 8) + 2 * 5
    # int8 alone would have rounded the ids off: a block's steps are max / 127
    alone = torch.empty(t.numel())
    INT8.decode_checked(INT8.encode(t.reshape(-1)), alone)
    assert not torch.equal(alone.view_as(t)[..., -1], ids)


def test_an_all_zero_last_channel_costs_no_bytes_and_others_take_the_codec_alone() -> None:
    grad = torch.cat([torch.randn(3, 4, 6), torch.zeros(3, 4, 1)], dim=-1)
    out, size = roundtrip(grad)
    assert exact_tail(grad) == "zeros" and size == INT8.encoded_size(3 * 4 * 6)
    assert torch.equal(out[..., -1], torch.zeros(3, 4))
    for plain in (torch.randn(3, 4, 7), torch.full((3, 4, 2), 0.5), torch.randn(12)):
        assert exact_tail(plain) is None
        out, size = roundtrip(plain)
        assert size == INT8.encoded_size(plain.numel()) and out.shape == plain.shape
    assert exact_tail(torch.tensor([[1.0, 2.0**24 + 2], [2.0, 4.0]])) is None  # past float32's
    assert exact_tail(torch.tensor([[1.0, 2.5], [2.0, 4.0]])) is None
    assert exact_tail(torch.tensor([[1.0, -1.0]])) is None


@pytest.mark.parametrize(
    "header",
    [
        {"shape": [4], "dtype": "torch.float32", "tail": "ids"},  # no other channel
        {"shape": [4, 1], "dtype": "torch.float32", "tail": "zeros"},
        {"shape": [4, 3], "dtype": "torch.float32", "tail": "bits"},
        {"shape": [4, 3], "dtype": "torch.float32", "tail": 1},
        {"shape": [MAX_ELEMENTS, 2], "dtype": "torch.float32", "tail": "ids"},
        {"shape": [-1, 3], "dtype": "torch.float32"},
        {"shape": [4, 3], "dtype": "torch.int64"},
    ],
)
def test_a_bad_header_is_refused_before_anything_is_allocated(header: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        parse_header(header)


async def test_a_tensor_whose_rows_are_not_the_requests_samples_is_refused_unread() -> None:
    class Stream:  # a stage request's stream: a header claiming 2^30 elements
        async def recv(self) -> dict[str, Any]:
            return {"shape": [1 << 20, 1 << 10], "dtype": "torch.float32"}

        async def recv_chunk_into(self, index: int, into: memoryview) -> int:
            raise AssertionError("the tensor's bytes were read (and memory taken)")

    with pytest.raises(HeaderError, match="4 rows"):
        await recv_tensor(Stream(), get_codec("int8"), True, rows=4)  # type: ignore[arg-type]


def test_bytes_of_the_wrong_length_are_refused() -> None:
    head, payload = encode_tensor(torch.cat([torch.randn(2, 3), torch.ones(2, 1)], -1), INT8)
    with pytest.raises(CodecError):
        decode_tensor(head, bytes(payload)[:-1], INT8)


def test_the_bottleneck_narrows_both_directions_and_keeps_the_ids() -> None:
    """Stage boundaries carry rank + 1 channels (the last the byte ids) forward, and the
    gradient back has the same width with an all-zero id channel."""
    task = make_task({**TINY, "bottleneck": 4})
    stages = task.make_stages(5, 3)
    batch = next(task.batches(0, 1, 0))
    ids = task.stage_inputs(batch)
    h1 = stages[0](ids)
    assert h1.shape == (4, 32, 5) and torch.equal(h1[..., -1], ids.float())
    x = h1.detach().requires_grad_(True)
    h2 = stages[1](x)
    assert h2.shape == (4, 32, 5) and torch.equal(h2[..., -1], ids.float())
    logits = stages[2](h2)
    task.stage_loss(logits, batch).backward()
    assert x.grad is not None and exact_tail(x.grad) == "zeros"
    assert x.grad[..., :-1].abs().sum() > 0
    # a peer sending garbage in the id channel gets an answer, not an index error
    bad = h1.detach().clone()
    bad[..., -1] = torch.linspace(-1e6, 1e6, bad[..., -1].numel()).view(4, 32)
    assert torch.isfinite(stages[1](bad)).all()


def test_the_bottleneck_is_part_of_the_model_the_fingerprint_covers() -> None:
    """A bottleneck adds parameters (so the experiment's fingerprint changes with it) and
    leaves those of the model without one as they were."""
    plain = make_task(TINY).make_stages(5, 3)
    narrow = make_task({**TINY, "bottleneck": 4}).make_stages(5, 3)
    again = make_task({**TINY, "bottleneck": 4}).make_stages(5, 3)
    for a, b in zip(narrow, again, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    plain_params = {n: p for s, m in enumerate(plain) for n, p in m.named_parameters(f"{s}")}
    narrow_params = {n: p for s, m in enumerate(narrow) for n, p in m.named_parameters(f"{s}")}
    assert set(plain_params) < set(narrow_params)
    assert all(torch.equal(p, narrow_params[n]) for n, p in plain_params.items())
    one = make_task({**TINY, "bottleneck": 4}).make_stages(5, 1)
    assert sum(p.numel() for p in one[0].parameters()) == sum(
        p.numel() for p in plain_params.values()
    )


@pytest.mark.parametrize("rank", [-1, 32, 40])
def test_a_bottleneck_must_be_narrower_than_the_model(rank: int) -> None:
    with pytest.raises(TaskError, match="bottleneck"):
        make_task({**TINY, "bottleneck": rank})


@pytest.mark.timeout(60)
async def test_a_bottlenecked_microbatch_through_the_wire(make_host: Callable[..., Any]) -> None:
    """Two stages on stage peers. Uncompressed, the loss and the first stage's parameter
    gradients are local autograd's; under int8 the hidden states cross the wire
    rank + 1 wide, the ids a byte each, their zero gradient in no bytes at all."""
    task = make_task({**TINY, "n_layers": 2, "bottleneck": 4})
    stages = task.make_stages(9, 2)
    batch = next(task.batches(0, 1, 0))
    local = copy.deepcopy(stages)
    loss = task.stage_loss(local[1](local[0](task.stage_inputs(batch))), batch)
    loss.backward()
    loss = float(loss.detach())
    swarm = Swarm(make_host)
    try:
        peers = [await swarm.stage_peer(s, m, global_batch=64) for s, m in enumerate(stages)]
        exact = await swarm.trainer(2, codec="none")
        await exact.refresh()
        got = await exact.run(0, task.stage_inputs(batch), lambda y: task.stage_loss(y, batch))
        assert got == pytest.approx(loss, rel=1e-5)
        sums = peers[0].worker.take_gradients()
        for acc, p in zip(sums.sums, local[0].parameters(), strict=True):
            assert p.grad is not None and p.grad.norm() > 0
            assert torch.allclose(acc / sums.samples, p.grad, rtol=1e-4, atol=1e-7)

        trainer = await swarm.trainer(2, codec="int8")
        await trainer.refresh()
        got = await trainer.run(1, task.stage_inputs(batch), lambda y: task.stage_loss(y, batch))
        assert got == pytest.approx(loss, rel=1e-2)
        tokens = 4 * 32
        hidden = INT8.encoded_size(tokens * 4)
        logits = INT8.encoded_size(tokens * 256)
        # forward: the ids (int64) to stage 0, its hidden states (with the ids) to
        # stage 1; backward: those again and the logits' gradient to stage 1, the ids
        # and the hidden states' gradient (an all-zero id channel) to stage 0
        expected = 2 * tokens * 8 + 2 * (hidden + tokens) + logits + hidden
        assert trainer.counters.bytes_sent == expected
    finally:
        await swarm.aclose()
