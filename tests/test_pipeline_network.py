"""Stage servers and a trainer on loopback: the pipeline over real hosts, DHT and RPC."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.dht.node import DHTNode
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.progress import STALE_S, Report, StageProgress, peers_at, samples_at
from shoal.pipeline.server import StageServer
from shoal.pipeline.stage import StageWorker
from shoal.pipeline.stage_optimizer import StageOptimizer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.transport.identity import Identity

HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}
TINY = {"d_model": 32, "n_layers": 3, "n_heads": 2, "context": 32, "batch_size": 4}
EXPERIMENT = "pipe-test"


async def make_swarm(
    make_host: Callable[..., Any],
    stages: list[torch.nn.Module],
    per_stage: int,
    devices: tuple[str, ...] = ("cpu",),
):
    """A trainer's node and `per_stage` servers of each stage, the i-th of a stage
    computing on `devices[i % len(devices)]`."""
    nodes: list[DHTNode] = []

    async def node() -> DHTNode:
        host = await make_host(**HOST_OPTS)
        boot = [str(nodes[0].host.addresses()[0])] if nodes else []
        made = await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0)
        nodes.append(made)
        return made

    trainer_dht = await node()
    servers = []
    for s, module in enumerate(stages):
        for i in range(per_stage):
            device = torch.device(devices[i % len(devices)])
            worker = StageWorker(copy.deepcopy(module).to(device), device=device)
            server = StageServer(await node(), EXPERIMENT, s, worker)
            await server.start()
            servers.append(server)
    return trainer_dht, servers, nodes


async def close_swarm(servers: list[StageServer], nodes: list[DHTNode]) -> None:
    for server in servers:
        await server.aclose()
    for n in nodes:
        await n.aclose()


@pytest.mark.timeout(90)
async def test_microbatches_through_served_stages_count_once_and_survive_a_dead_peer(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    stages = task.make_stages(5, 3)
    trainer_dht, servers, nodes = await make_swarm(make_host, stages, per_stage=2)
    try:
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 3, deadline=10.0, codec="none")
        assert await trainer.refresh() == [2, 2, 2]
        batches = task.batches(0, 1, 0)
        local = [copy.deepcopy(m) for m in stages]
        local_sums = [[torch.zeros_like(p) for p in m.parameters()] for m in local]
        for mb in range(8):
            batch = next(batches)
            loss = await trainer.run(
                mb, task.stage_inputs(batch), lambda y, b=batch: task.stage_loss(y, b)
            )
            # the same microbatch through local autograd, gradients weighted by samples
            y = task.stage_inputs(batch)
            for m in local:
                y = m(y)
            reference = task.stage_loss(y, batch)
            reference.backward()
            assert loss == pytest.approx(float(reference.detach()), rel=1e-5)
            for m, sums in zip(local, local_sums, strict=True):
                for acc, p in zip(sums, m.parameters(), strict=True):
                    acc.add_(p.grad, alpha=len(batch))
                    p.grad = None
        for s in range(3):
            taken = [srv.worker.take_gradients() for srv in servers if srv.stage == s]
            assert sum(t.samples for t in taken) == 8 * 4  # every microbatch once
            for i, ref in enumerate(local_sums[s]):
                got = sum(t.sums[i] for t in taken)
                assert torch.allclose(got, ref, rtol=1e-4, atol=1e-6)

        # A peer of stage 1 dies: its requests fail, others serve them.
        victim = next(srv for srv in servers if srv.stage == 1)
        await victim.aclose()
        await victim.dht.aclose()
        await victim.dht.host.aclose()
        for mb in range(8, 16):
            batch = next(batches)
            await trainer.run(
                mb, task.stage_inputs(batch), lambda y, b=batch: task.stage_loss(y, b)
            )
        survivor = next(srv for srv in servers if srv.stage == 1 and srv is not victim)
        assert survivor.worker.take_gradients().samples == 8 * 4
        assert trainer.counters.microbatches == 16
        late = {f"{trainer._name}/{mb}/1" for mb in range(8, 16)}
        assert {e.peer for e in trainer.ledger.open(1) if e.key in late} == {survivor.dht.peer_id}
    finally:
        await close_swarm(servers, nodes)


@pytest.mark.timeout(90)
async def test_int8_activations_and_gradients_are_4x_smaller_and_train_the_same(
    make_host: Callable[..., Any],
) -> None:
    """The same microbatches through the same stages with activations and gradients in
    blockwise int8 and in float32: the bytes between stages shrink by more than 3.5x,
    the losses agree to the quantization's precision, and the stages' gradients point
    the same way (cosine > 0.99)."""
    task = make_task(TINY)
    stages = task.make_stages(5, 3)
    trainer_dht, servers, nodes = await make_swarm(make_host, stages, per_stage=1)
    try:
        results = {}
        for run, codec in enumerate(("none", "int8")):
            trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 3, deadline=10.0, codec=codec)
            await trainer.refresh()
            sent_before = sum(srv.bytes_sent for srv in servers)
            batches = task.batches(0, 1, 0)
            losses = []
            for mb in range(4):  # new microbatch IDs: a key is applied once, ever
                batch = next(batches)
                loss = await trainer.run(
                    100 * run + mb,
                    task.stage_inputs(batch),
                    lambda y, b=batch: task.stage_loss(y, b),
                )
                losses.append(loss)
            grads = [srv.worker.take_gradients() for srv in servers]
            flat = torch.cat([torch.cat([g.reshape(-1) for g in t.sums]) for t in grads])
            wire = trainer.counters.bytes_sent + sum(srv.bytes_sent for srv in servers)
            results[codec] = (losses, flat, wire - sent_before)
        (exact, g32, b32), (approx, g8, b8) = results["none"], results["int8"]
        assert b32 / b8 > 3.5, (b32, b8)
        assert approx == pytest.approx(exact, rel=1e-2)
        assert float(torch.nn.functional.cosine_similarity(g32, g8, dim=0)) > 0.99
    finally:
        await close_swarm(servers, nodes)


@pytest.mark.timeout(120)
async def test_a_stage_step_leaves_every_peer_of_a_stage_with_the_same_parameters(
    make_host: Callable[..., Any],
) -> None:
    """Two stages of two peers each: microbatches land on either peer of a stage; the
    stage's step averages the gradients (weighted by samples) and applies AdamW on every
    peer: the peers of a stage end with equal fingerprints, and their parameters are
    the ones one process gets from the same microbatches and optimizer (but for the
    rare element whose ~0 gradient another summation order flips)."""
    task = make_task(TINY)
    stages = task.make_stages(5, 2)
    trainer_dht, servers, nodes = await make_swarm(make_host, stages, per_stage=2)
    hyper = {"lr": 1e-2, "weight_decay": 0.1}
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    optimizers = [
        StageOptimizer(srv.dht, EXPERIMENT, srv.stage, srv.worker, hyper=hyper, matchmaking=mm)
        for srv in servers
    ]
    try:
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 2, deadline=10.0, codec="none")
        await trainer.refresh()
        local = [copy.deepcopy(m) for m in stages]
        reference = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in local]
        batches = task.batches(0, 1, 0)
        for step in range(2):
            total = 0
            for mb in range(6):
                batch = next(batches)
                await trainer.run(
                    step * 6 + mb,
                    task.stage_inputs(batch),
                    lambda y, b=batch: task.stage_loss(y, b),
                )
                y = task.stage_inputs(batch)
                for m in local:
                    y = m(y)
                (task.stage_loss(y, batch) * len(batch)).backward()  # summed over samples
                total += len(batch)
            for m, opt in zip(local, reference, strict=True):
                for p in m.parameters():
                    p.grad /= total
                opt.step()
                opt.zero_grad()
            results = await asyncio.gather(*(o.step(timeout=30.0) for o in optimizers))
            assert all(r.committed and r.group_size == 2 for r in results), results
        for s in range(2):
            mine = [o for o, srv in zip(optimizers, servers, strict=True) if srv.stage == s]
            assert mine[0].fingerprint() == mine[1].fingerprint() and mine[0].version == 2
            # One process sums the gradients in another order; where a gradient is ~0,
            # Adam's normalized step can flip its sign (a full lr step): a few elements.
            got = torch.cat([p.detach().reshape(-1) for p in mine[0].params])
            want = torch.cat([p.detach().reshape(-1) for p in local[s].parameters()])
            apart = int(((got - want).abs() > 1e-4).sum())
            assert apart <= got.numel() // 500, (apart, got.numel())
        # A peer that joins stage 1 takes its state before it serves: the same bits.
        joiner = StageOptimizer(nodes[1], EXPERIMENT, 1, StageWorker(copy.deepcopy(stages[1])),
                                hyper=hyper, matchmaking=mm)  # fmt: skip
        optimizers.append(joiner)
        assert await joiner.sync(timeout=20.0)
        assert joiner.version == 2 and joiner.fingerprint() == optimizers[-2].fingerprint()
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        await close_swarm(servers, nodes)


@pytest.mark.gpu
@pytest.mark.timeout(120)
async def test_a_stage_served_from_a_gpu_and_from_the_cpu_steps_to_one_state(
    make_host: Callable[..., Any],
) -> None:
    """One peer of each stage computes on a CUDA GPU, the other on the CPU: the
    trainer's microbatches land on either, the stage's step averages their gradients
    and steps on the host, and both peers of a stage end with the same state, bit for
    bit (a GPU's own AdamW would round otherwise)."""
    task = make_task(TINY)
    stages = task.make_stages(5, 2)
    trainer_dht, servers, nodes = await make_swarm(
        make_host, stages, per_stage=2, devices=("cuda", "cpu")
    )
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    optimizers = [
        StageOptimizer(
            srv.dht, EXPERIMENT, srv.stage, srv.worker, hyper={"lr": 1e-2}, matchmaking=mm
        )
        for srv in servers
    ]
    try:
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 2, deadline=10.0, codec="none")
        await trainer.refresh()
        batches = task.batches(0, 1, 0)
        for step in range(2):
            for mb in range(6):
                batch = next(batches)
                await trainer.run(step * 6 + mb, task.stage_inputs(batch),
                                  lambda y, b=batch: task.stage_loss(y, b))  # fmt: skip
            results = await asyncio.gather(*(o.step(timeout=30.0) for o in optimizers))
            assert all(r.committed and r.group_size == 2 for r in results), results
        for s in range(2):
            gpu, cpu = (o for o, srv in zip(optimizers, servers, strict=True) if srv.stage == s)
            assert {p.device.type for p in gpu.worker.params} == {"cuda"}
            assert gpu.version == cpu.version == 2
            assert gpu.fingerprint() == cpu.fingerprint()
            for a, b in zip(gpu.worker.params, cpu.worker.params, strict=True):
                assert torch.equal(a.cpu(), b)
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        await close_swarm(servers, nodes)


class InFloat64(torch.nn.Module):
    """A stage computing in float64 between float32 boundaries: on the CPU, a module
    whose parameters the step cannot take in place (as a GPU's)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.double()).float()


@pytest.mark.timeout(60)
async def test_a_stage_whose_parameters_are_not_host_float32_steps_a_host_copy_alike(
    make_host: Callable[..., Any],
) -> None:
    """The path a stage on a GPU takes, on the CPU: a peer whose module is in float64
    steps a float32 host copy of its parameters with the CPU peer's own AdamW, copies
    it into its module after the step, and after a download: both peers of the stage
    hold one state, and the modules the same values."""
    task = make_task(TINY)
    stage = task.make_stages(5, 2)[1]
    nodes: list[DHTNode] = []
    for _ in range(3):
        boot = [str(nodes[0].host.addresses()[0])] if nodes else []
        nodes.append(await DHTNode.create(await make_host(**HOST_OPTS), bootstrap=boot,
                                          hop_timeout=1.0))  # fmt: skip
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    workers = [StageWorker(copy.deepcopy(stage)), StageWorker(InFloat64(copy.deepcopy(stage)))]
    optimizers = [
        StageOptimizer(node, EXPERIMENT, 1, w, hyper={"lr": 1e-2}, matchmaking=mm)
        for node, w in zip(nodes[:2], workers, strict=True)
    ]
    try:
        torch.manual_seed(0)
        for step in range(2):
            for i, worker in enumerate(workers):
                n = 2 + i + step
                worker.backward(f"k{step}.{i}", torch.randn(n, 32, 32), torch.randn(n, 32, 256), n)
            results = await asyncio.gather(*(o.step(timeout=20.0) for o in optimizers))
            assert all(r.committed and r.group_size == 2 for r in results), results
        plain, wide = optimizers
        assert plain.params is workers[0].params and wide.params is not workers[1].params
        assert plain.fingerprint() == wide.fingerprint() and wide.version == 2
        for a, b in zip(plain.params, workers[1].params, strict=True):
            assert b.dtype == torch.float64 and torch.equal(a.double(), b)
        # A third peer of the stage in float64 downloads the state into its module.
        joiner = StageWorker(InFloat64(copy.deepcopy(stage)))
        optimizers.append(StageOptimizer(nodes[2], EXPERIMENT, 1, joiner, hyper={"lr": 1e-2},
                                         matchmaking=mm))  # fmt: skip
        assert await optimizers[2].sync(timeout=20.0)
        assert optimizers[2].fingerprint() == plain.fingerprint() and joiner.version == 2
        for a, b in zip(plain.params, joiner.params, strict=True):
            assert torch.equal(a.double(), b)
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        await asyncio.gather(*(n.aclose() for n in nodes), return_exceptions=True)


@pytest.mark.timeout(60)
async def test_a_stage_step_that_finds_no_group_gives_the_gradients_back(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    stages = task.make_stages(5, 1)
    trainer_dht, servers, nodes = await make_swarm(make_host, stages, per_stage=1)
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=0.5)
    lonely = StageOptimizer(servers[0].dht, EXPERIMENT, 0, servers[0].worker,
                            hyper={"lr": 1e-2}, matchmaking=mm)  # fmt: skip
    try:
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 1, deadline=10.0, codec="none")
        await trainer.refresh()
        batches = task.batches(0, 1, 0)
        for mb in range(4):
            batch = next(batches)
            await trainer.run(
                mb, task.stage_inputs(batch), lambda y, b=batch: task.stage_loss(y, b)
            )
        before = servers[0].worker.samples
        assert before > 0
        fingerprint = lonely.fingerprint()
        result = await lonely.step(timeout=2.0)  # alone in its stage: no group
        assert not result.committed
        assert servers[0].worker.samples == before and lonely.fingerprint() == fingerprint
    finally:
        await lonely.aclose()
        await close_swarm(servers, nodes)


def test_only_fresh_reports_of_the_same_version_count() -> None:
    peers = [Identity.generate().peer_id for _ in range(3)]
    now = 1000.0
    reports = [
        Report(peers[0], 8, 3, now - 1),
        Report(peers[1], 4, 3, now - 2),
        Report(peers[2], 16, 2, now - 1),  # still at the previous version
        Report(peers[2], 16, 3, now - STALE_S - 1),  # a peer that went silent
    ]
    assert samples_at(reports, 3, now) == 12
    assert samples_at(reports, 2, now) == 16


def test_the_peers_a_step_counts_on_include_those_it_stepped_with_whose_report_lags() -> None:
    """The stage's peers at version 4: those reporting 4, and those who took the step
    from 3 with us while their report still names an older version; not a peer
    behind that was not in that step, nor one reporting 4 that went silent."""
    me, partner, slow, behind, ahead, silent = (Identity.generate().peer_id for _ in range(6))
    now = 1000.0
    reports = [
        Report(partner, 0, 3, now - 1),  # stepped 3 -> 4 with us; its new report is on its way
        Report(slow, 0, 2, now - 1),  # so did this one: its last report we have is older still
        Report(behind, 4, 3, now - 1),  # missed that step: it re-syncs first
        Report(ahead, 0, 4, now - 2),
        Report(silent, 8, 4, now - STALE_S - 1),
    ]
    stepped_with = (me, partner, slow)
    assert peers_at(reports, 4, now, stepped_with=stepped_with) == {partner, slow, ahead}
    assert peers_at(reports, 4, now) == {ahead}


@pytest.mark.timeout(60)
async def test_a_stage_steps_when_its_peers_together_hold_the_global_batch(
    make_host: Callable[..., Any],
) -> None:
    task = make_task(TINY)
    stages = task.make_stages(5, 1)
    trainer_dht, servers, nodes = await make_swarm(make_host, stages, per_stage=2)
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    optimizers = [
        StageOptimizer(srv.dht, EXPERIMENT, 0, srv.worker, hyper={"lr": 1e-2}, matchmaking=mm)
        for srv in servers
    ]
    progress = [StageProgress(srv.dht, EXPERIMENT, 0, global_batch=16) for srv in servers]
    try:
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, 1, deadline=10.0, codec="none")
        await trainer.refresh()
        batches = task.batches(0, 1, 0)

        async def ready() -> list[bool]:
            return list(await asyncio.gather(*(
                p.ready(srv.worker.samples, o.version)
                for p, srv, o in zip(progress, servers, optimizers, strict=True)
            )))  # fmt: skip

        for mb in range(4):  # 4 samples each: the global batch after the fourth
            assert await ready() == [False, False]
            batch = next(batches)
            await trainer.run(
                mb, task.stage_inputs(batch), lambda y, b=batch: task.stage_loss(y, b)
            )
        assert await ready() == [True, True]
        results = await asyncio.gather(*(o.step(timeout=30.0) for o in optimizers))
        assert all(r.committed for r in results)
        assert optimizers[0].fingerprint() == optimizers[1].fingerprint()
        assert await ready() == [False, False]  # the next version starts from nothing
    finally:
        await asyncio.gather(*(o.aclose() for o in optimizers), return_exceptions=True)
        await close_swarm(servers, nodes)
