"""What a stage peer holds while it trains (`pipeline/memory.py` counts it): autograd's
gradients one parameter at a time, one flat bucket per step that the stage's all-reduce
sends as it is, and nothing of it kept once the step is over."""

from __future__ import annotations

import asyncio
import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.averaging import butterfly
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.dht.node import DHTNode
from shoal.pipeline.stage import Gradients, StageWorker
from shoal.pipeline.stage_optimizer import StageOptimizer

from .pipeline_swarm import HOST_OPTS

pytestmark = pytest.mark.timeout(60)

WIDTH = 16


def stage_module() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH)
    )


def request(key: str, samples: int = 3) -> tuple[str, torch.Tensor, torch.Tensor, int]:
    return key, torch.randn(samples, WIDTH), torch.randn(samples, WIDTH), samples


def shares_storage(view: torch.Tensor, flat: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_a_backward_never_holds_two_parameters_gradients_and_sums_them_into_one_flat_bucket() -> (
    None
):
    worker = StageWorker(stage_module())
    holding: list[int] = []  # as each parameter's gradient arrives: parameters holding one
    for p in worker.params:
        p.register_hook(lambda g: holding.append(sum(q.grad is not None for q in worker.params)))
    key, x, g, n = request("a")
    reference = copy.deepcopy(worker.module)
    reference(x).backward(g)
    worker.backward(key, x, g, n)
    assert holding and max(holding) == 0
    assert all(p.grad is None for p in worker.params)
    taken = worker.take_gradients()
    assert taken.flat is not None and taken.flat.numel() == sum(p.numel() for p in worker.params)
    for view, p in zip(taken.sums, reference.parameters(), strict=True):
        assert shares_storage(view, taken.flat)
        assert p.grad is not None
        torch.testing.assert_close(view, n * p.grad)  # (samples x its gradient)


def test_a_backward_through_the_module_that_is_not_the_workers_keeps_its_gradients() -> None:
    worker = StageWorker(stage_module())
    worker.backward(*request("a"))
    worker.module(torch.randn(2, WIDTH)).sum().backward()
    assert all(p.grad is not None for p in worker.params)
    assert worker.samples == 3  # (nothing of it went into the bucket)


async def two_stage_peers(
    make_host: Callable[..., Any], nodes: list[DHTNode], mm: MatchmakingConfig, peers: int
) -> list[StageOptimizer]:
    module = stage_module()
    out = []
    for _ in range(peers):
        boot = [str(nodes[0].host.addresses()[0])] if nodes else []
        node = await DHTNode.create(await make_host(**HOST_OPTS), bootstrap=boot, hop_timeout=1.0)
        nodes.append(node)
        worker = StageWorker(copy.deepcopy(module))
        out.append(StageOptimizer(node, "mem", 0, worker, hyper={"lr": 1e-2}, matchmaking=mm))
    return out


def watch_rounds(optimizer: StageOptimizer) -> tuple[list[Gradients], list[torch.Tensor]]:
    """Spies on what the worker hands the step and what each round averages."""
    taken: list[Gradients] = []
    averaged: list[torch.Tensor] = []
    take, tensors_for = optimizer.worker.take_gradients, optimizer.averager.tensors_for

    def take_gradients(epoch: int | None = None) -> Gradients:
        taken.append(take(epoch))
        return taken[-1]

    def round_tensors(group: Any, weight: float) -> list[torch.Tensor]:
        averaged.extend(tensors_for(group, weight))
        return averaged[-1:]

    optimizer.worker.take_gradients = take_gradients  # type: ignore[method-assign]
    optimizer.averager.tensors_for = round_tensors  # type: ignore[method-assign]
    return taken, averaged


async def test_a_stage_step_averages_the_bucket_itself_and_lets_go_of_it_once_committed(
    make_host: Callable[..., Any],
) -> None:
    nodes: list[DHTNode] = []
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    optimizers = await two_stage_peers(make_host, nodes, mm, 2)
    try:
        for i, o in enumerate(optimizers):
            o.worker.backward(*request(f"k{i}", samples=2 + i))
        taken, averaged = watch_rounds(optimizers[0])
        gc.disable()  # (what the step let go of is freed at once, not by the collector)
        try:
            results = await asyncio.gather(*(o.step(timeout=30.0) for o in optimizers))
            assert all(r.committed and r.group_size == 2 for r in results), results
            (step,) = taken
            assert step.flat is not None and averaged
            assert all(t.data_ptr() == step.flat.data_ptr() for t in averaged)  # no copy
            bucket = weakref.ref(step.flat)
            del step, taken[:], averaged[:]
            assert bucket() is None
        finally:
            gc.enable()
        assert optimizers[0].fingerprint() == optimizers[1].fingerprint()
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        for n in nodes:
            await n.aclose()


async def test_a_finished_round_holds_none_of_the_buffers_it_borrowed(
    make_host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round's objects refer to each other: the collector frees them at its next full
    pass, rounds later. Meanwhile they must not hold the receive slots the pool lends
    the next round (a stage peer so held two or three rounds' slots over its estimate)."""
    rounds: list[Any] = []
    let_go = butterfly._let_go

    def finished(rnd: Any) -> None:
        rounds.append(rnd)
        let_go(rnd)

    monkeypatch.setattr(butterfly, "_let_go", finished)
    nodes: list[DHTNode] = []
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    optimizers = await two_stage_peers(make_host, nodes, mm, 2)
    try:
        for step in range(2):
            for i, o in enumerate(optimizers):
                o.worker.backward(*request(f"k{step}.{i}", samples=2 + i))
            results = await asyncio.gather(*(o.step(timeout=30.0) for o in optimizers))
            assert all(r.committed and r.group_size == 2 for r in results), results
        assert len(rounds) == 4
        for rnd in rounds:
            plane = rnd.data
            assert plane.flat.numel() == plane.result.numel() == 0
            assert not plane.encoded
            assert all(not lane.slots and not lane.encoded for lane in plane._lanes.values())
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        for n in nodes:
            await n.aclose()


async def test_a_step_without_a_group_gives_its_own_bucket_back_with_the_sums_it_held(
    make_host: Callable[..., Any],
) -> None:
    nodes: list[DHTNode] = []
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=0.5)
    (lonely,) = await two_stage_peers(make_host, nodes, mm, 1)
    try:
        lonely.worker.backward(*request("a", samples=3))
        before = lonely.worker.take_gradients(0)
        assert before.flat is not None
        sums = before.flat.clone()
        lonely.worker.give_back(before)
        result = await lonely.step(timeout=2.0)  # alone in its stage: no group
        assert not result.committed and lonely.version == 0
        after = lonely.worker.take_gradients(0)
        assert after.samples == 3 and after.flat is not None
        assert after.flat.data_ptr() == before.flat.data_ptr()  # (no new bucket)
        # (Scaled for the round and back: the sums, to float32's rounding.)
        torch.testing.assert_close(after.flat, sums, rtol=1e-6, atol=0.0)
    finally:
        await lonely.aclose()
        for n in nodes:
            await n.aclose()


def resident_kib(t: torch.Tensor) -> int:
    """KiB of the mapping holding `t` that this process has resident (/proc/self/smaps)."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and all(c in "0123456789abcdef-" for c in first):
                low, high = (int(x, 16) for x in first.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


async def test_moments_in_a_file_step_the_same_bits_and_are_not_held_between_steps(
    make_host: Callable[..., Any], tmp_path: Any
) -> None:
    """A peer within a memory budget keeps AdamW's moments in a file (`moments_dir`) and
    steps a slice at a time: the same bits as its partner's moments in memory, step
    after step, and once a step is over none of their pages is left in the process."""
    nodes: list[DHTNode] = []
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    module = stage_module()
    optimizers = []
    for i in range(2):
        boot = [str(nodes[0].host.addresses()[0])] if nodes else []
        node = await DHTNode.create(await make_host(**HOST_OPTS), bootstrap=boot, hop_timeout=1.0)
        nodes.append(node)
        optimizers.append(StageOptimizer(
            node, "paged", 0, StageWorker(copy.deepcopy(module)),
            hyper={"lr": 1e-2, "weight_decay": 0.1, "warmup_steps": 2}, matchmaking=mm,
            moments_dir=tmp_path if i == 0 else None,
        ))  # fmt: skip
    paged, plain = optimizers
    try:
        assert paged.moments_paged and not plain.moments_paged
        for step in range(3):
            for i, o in enumerate(optimizers):
                o.worker.backward(*request(f"k{step}-{i}", samples=2 + i))
            results = await asyncio.gather(*(o.step(timeout=30.0) for o in optimizers))
            assert all(r.committed for r in results), results
            assert paged.fingerprint() == plain.fingerprint()  # (hashing gives pages back)
        moments = [paged.optimizer.state[p][k] for p in paged.params
                   for k in ("exp_avg", "exp_avg_sq")]  # fmt: skip
        assert all(resident_kib(m) == 0 for m in moments)
        assert all(m.abs().sum() > 0 for m in moments)  # (stepped: read back from the file)
        assert all(resident_kib(m) > 0 for m in moments)  # (and held again once read)
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        for n in nodes:
            await n.aclose()
