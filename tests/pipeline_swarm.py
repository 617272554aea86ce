"""An in-process pipelined swarm on loopback for tests: stage peers and trainers."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.pipeline.trainer_loop import TrainerLoop

HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}
TINY = {"d_model": 32, "n_layers": 3, "n_heads": 2, "context": 32, "batch_size": 4}
EXPERIMENT = "pipe-swarm"


@dataclass
class Swarm:
    make_host: Callable[..., Any]
    nodes: list[DHTNode] = field(default_factory=list)
    peers: list[StagePeer] = field(default_factory=list)

    async def node(self) -> DHTNode:
        host = await self.make_host(**HOST_OPTS)
        boot = [str(self.nodes[0].host.addresses()[0])] if self.nodes else []
        made = await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0)
        self.nodes.append(made)
        return made

    async def stage_peer(
        self, stage: int, module: torch.nn.Module, *, global_batch: int, lr: float = 3e-3,
        sync: bool = False,
    ) -> StagePeer:  # fmt: skip
        peer = StagePeer(
            await self.node(), EXPERIMENT, stage, copy.deepcopy(module),
            hyper={"lr": lr}, global_batch=global_batch,
        )  # fmt: skip
        await peer.start(sync=sync)
        self.peers.append(peer)
        return peer

    async def trainer(self, stages: int, **options: Any) -> PipelineTrainer:
        return PipelineTrainer(await self.node(), EXPERIMENT, stages, **options)

    def of_stage(self, stage: int) -> list[StagePeer]:
        return [p for p in self.peers if p.stage == stage]

    async def aclose(self) -> None:
        await asyncio.gather(*(p.aclose() for p in self.peers), return_exceptions=True)
        for n in self.nodes:
            await n.aclose()


def loop_for(trainer: PipelineTrainer, task: Any, *, shard: int, global_batch: int, lag: int,
             seed: int = 0, concurrency: int | None = None) -> TrainerLoop:  # fmt: skip
    return TrainerLoop(
        trainer,
        task.batches(shard, 1, seed),
        inputs_of=task.stage_inputs,
        loss_of=task.stage_loss,
        global_batch=global_batch,
        lag=lag,
        concurrency=concurrency,
    )
