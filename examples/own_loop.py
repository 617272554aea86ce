"""Train your own torch.nn.Module in your own loop, averaged with other peers by shoal.

The model (a small MLP that learns y = sum(x) for vectors x of 8 numbers) and its
data are yours; shoal only needs to know the model, so that a `shoal run` peer can
build the same one: that is the `make_task` below (see `shoal.peer.training.task`
for the rules of a task). Run, from the repository root::

    python examples/own_loop.py --data-dir /tmp/own-a

It prints the experiment's join command; a second peer joins from the CLI (it trains
the same model on the task's batches, with shoal's own inner optimizer)::

    shoal run --join own-loop@PEERID --task examples/own_loop.py:make_task \\
        --bootstrap /ip4/127.0.0.1/tcp/PORT/p2p/PEERID --data-dir "$(mktemp -d)" \\
        --listen /ip4/127.0.0.1/tcp/0 --status-addr 127.0.0.1:0

or another script joins (``--join own-loop@PEERID --bootstrap ADDR``; ``--sync``
runs the synchronous variant of the API). Every 20 steps the peers average (DiLoCo);
each committed round prints the fingerprint of the state, the same on every peer.
Ctrl+C (or ``--steps``) ends the round in flight and shuts the peer down.

The batches come from this loop, which another peer cannot re-execute: the
experiment is hosted unverified (its manifest says ``verify: false``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

WIDTH = 8
BATCH = 32


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 64), nn.GELU(), nn.Linear(64, 1))


def my_batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Your data: here, endless random vectors and their sums."""
    generator = torch.Generator().manual_seed(seed % 2**63)
    while True:
        x = torch.randn(BATCH, WIDTH, generator=generator)
        yield x, x.sum(dim=1, keepdim=True)


class OwnLoopTask:
    """What a `shoal run --task examples/own_loop.py:make_task` peer trains: the same model,
    on batches of the same kind."""

    name = "own-loop"

    def config(self) -> dict[str, Any]:
        return {}

    def make_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return make_model()

    def batches(self, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
        return my_batches(seed * num_shards + shard)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def batch_tokens(self, batch: Any) -> int:
        return len(batch[0])

    def eval_batches(self, count: int) -> list[Any]:
        batches = my_batches(2**31)
        return [next(batches) for _ in range(count)]

    def private_data(self) -> bool:
        return False  # (the CLI peer's batches: anyone can draw them again)


def make_task(config: dict[str, Any], data: Path | None = None) -> OwnLoopTask:
    return OwnLoopTask()


def task_spec() -> str:
    """This file as a --task spec, relative to the working directory when it is below it
    (the joiner names the same text, from its own checkout)."""
    path = os.path.relpath(Path(__file__).resolve())
    return f"{path if not path.startswith('..') else Path(__file__).resolve()}:make_task"


def peer_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"data_dir": args.data_dir, "listen": args.listen}
    if args.join:
        return {**options, "ref": args.join, "bootstrap": args.bootstrap, "task": task_spec()}
    return {**options, "name": "own-loop", "task": task_spec(), "inner_steps": 20}


def said(reports: list[Any], step: int, loss: torch.Tensor) -> None:
    for report in reports:
        if report.committed:
            print(
                f"step {step}: loss {loss.item():.4f}, outer step {report.outer_step} with "
                f"{report.group_size} peer(s), fingerprint {report.fingerprint[:16]}",
                flush=True,
            )


async def train_async(args: argparse.Namespace) -> None:
    import shoal

    options = peer_options(args)
    peer = await (shoal.join if args.join else shoal.host)(**options)
    async with peer:  # on the way out: the round in flight ends, then the peer
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        outer = await peer.outer(model, optimizer)  # the model takes the experiment's weights
        print(f"peer {peer.peer_id}; join with:\n  {peer.join_command}", flush=True)
        for step, (x, y) in enumerate(my_batches(time.time_ns()), 1):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            said(await outer.step(tokens=len(x), loss=loss), step, loss)
            await asyncio.sleep(0.005)  # (a toy model: leave the CPU to the other peer)
            if step == args.steps:
                break


def train_sync(args: argparse.Namespace) -> None:
    import shoal

    options = peer_options(args)
    with (shoal.sync.join if args.join else shoal.sync.host)(**options) as peer:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        outer = peer.outer(model, optimizer)
        print(f"peer {peer.peer_id}; join with:\n  {peer.join_command}", flush=True)
        for step, (x, y) in enumerate(my_batches(time.time_ns()), 1):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            said(outer.step(tokens=len(x), loss=loss), step, loss)
            time.sleep(0.005)
            if step == args.steps:
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="this peer's identity and state")
    parser.add_argument("--join", help="NAME@PEERID: join instead of hosting")
    parser.add_argument("--bootstrap", action="append", default=[], help="a peer's address")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--steps", type=int, help="stop after this many steps")
    parser.add_argument("--sync", action="store_true", help="the synchronous API")
    args = parser.parse_args()
    try:
        if args.sync:
            train_sync(args)
        else:
            asyncio.run(train_async(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
