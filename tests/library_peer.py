"""A script that trains its own loop through shoal's library API (tests/test_library.py).

It is also the experiment's task (`make_task`: a tiny MLP regression), so that a
`shoal run --task tests/library_peer.py:make_task` peer builds the same model.

    python tests/library_peer.py async|sync DATA_DIR --host NAME | --join REF --bootstrap ADDR
        [--rounds N]
    python tests/library_peer.py hf DATA_DIR --host NAME --texts DIR --rounds N
    python tests/library_peer.py task DATA_DIR --join REF --bootstrap ADDR

The `hf` variant hosts a tiny Llama (`--task hf` on the text folder) and trains it
with a `transformers.Trainer` and shoal's callback, stopping after N rounds committed
with another peer. The `task` variant joins and trains the experiment's own steps
(`task_trainer`), as a library peer of a verified experiment does.

It prints ``READY <ref> <address>`` once started, ``COMMIT <outer step> <group size>
<fingerprint>`` after each committed round, and with --rounds stops cleanly after N
commits (``CLOSED``), as the sync variant does on SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

WIDTH = 8
BATCH = 16
FAST_ROUNDS = {"matchmaking_time": 3, "round_timeout": 15, "stall_timeout": 3}
STEP_PAUSE_S = 0.01  # the user's loop does other work too; leaves CPU to the other peers


class RegressionTask:
    """y = sum of x's entries, learned by a two-layer MLP; batches (x, y)."""

    name = "regression"

    def config(self) -> dict[str, Any]:
        return {}

    def make_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 1))

    def batches(self, shard: int, num_shards: int, seed: int) -> Iterator[Any]:
        generator = torch.Generator().manual_seed((seed * 1000 + shard) % 2**63)
        while True:
            x = torch.randn(BATCH, WIDTH, generator=generator)
            yield x, x.sum(dim=1, keepdim=True)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def batch_tokens(self, batch: Any) -> int:
        return len(batch[0])

    def eval_batches(self, count: int) -> list[Any]:
        return list(_take(self.batches(0, 1, 12345), count))

    def private_data(self) -> bool:
        return False


def make_task(config: dict[str, Any], data: Path | None = None) -> RegressionTask:
    return RegressionTask()


def _take(it: Iterator[Any], count: int) -> Iterator[Any]:
    for _ in range(count):
        yield next(it)


def _say(line: str) -> None:
    print(line, flush=True)


def _report(reports: list[Any]) -> int:
    commits = 0
    for r in reports:
        if r.committed:
            commits += 1
            _say(f"COMMIT {r.outer_step} {r.group_size} {r.fingerprint}")
    return commits


def _peer_args(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    task = f"{Path(__file__).resolve()}:make_task"
    common: dict[str, Any] = {"data_dir": args.data_dir, "listen": "/ip4/127.0.0.1/tcp/0"}
    common["mdns"] = "off"
    if args.host:
        return "host", {
            "name": args.host, "task": task, "inner_steps": 10,
            "strategy_options": FAST_ROUNDS, **common,
        }  # fmt: skip
    return "join", {"ref": args.join, "bootstrap": [args.bootstrap], "task": task, **common}


async def run_async(args: argparse.Namespace) -> None:
    import shoal

    how, kwargs = _peer_args(args)
    peer = await (shoal.host if how == "host" else shoal.join)(**kwargs)
    async with peer:
        model = RegressionTask().make_model(0)  # its own weights: replaced by the experiment's
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = await peer.outer(model, optimizer)
        _say(f"READY {peer.ref} {peer.addresses[0]}")
        batches, commits = RegressionTask().batches(int(time.time()) % 1000, 1, 7), 0
        while args.rounds is None or commits < args.rounds:
            x, y = next(batches)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            commits += _report(await outer.step(tokens=len(x), loss=loss))
            await asyncio.sleep(STEP_PAUSE_S)
    _say("CLOSED")


def run_sync(args: argparse.Namespace) -> None:
    import shoal

    how, kwargs = _peer_args(args)
    with (shoal.sync.host if how == "host" else shoal.sync.join)(**kwargs) as peer:
        model = RegressionTask().make_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        outer = peer.outer(model, optimizer)
        _say(f"READY {peer.ref} {peer.addresses[0]}")
        batches, commits = RegressionTask().batches(int(time.time()) % 1000, 1, 7), 0
        try:
            while args.rounds is None or commits < args.rounds:
                x, y = next(batches)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                commits += _report(outer.step(tokens=len(x), loss=loss))
                time.sleep(STEP_PAUSE_S)
        except KeyboardInterrupt:  # Ctrl+C: leave the loop; `with` shuts the peer down
            _say("INTERRUPTED")
    _say("CLOSED")


TINY_LLAMA = {
    "family": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 320, "context": 32,
    "batch_size": 4,
}  # fmt: skip


def run_hf(args: argparse.Namespace) -> None:
    import transformers

    import shoal

    class Windows(torch.utils.data.IterableDataset):
        """The task's training windows as the Trainer's samples (labels: the ids)."""

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            for batch in peer.task.batches(0, 1, int(time.time())):
                for row in batch.long():
                    yield {"input_ids": row, "labels": row}

    class StopAfterRounds(transformers.TrainerCallback):
        def on_step_end(self, _args: Any, _state: Any, control: Any, **_: Any) -> Any:
            _report(callback.last_reports)
            shared = [r for r in callback.last_reports if r.committed and r.group_size > 1]
            self.rounds = getattr(self, "rounds", 0) + len(shared)
            control.should_training_stop = self.rounds >= args.rounds
            return control

    with shoal.sync.host(
        args.host, task="hf", data=args.texts, task_options=TINY_LLAMA, inner_steps=10,
        strategy_options=FAST_ROUNDS, data_dir=args.data_dir, listen="/ip4/127.0.0.1/tcp/0",
        mdns="off",
    ) as peer:  # fmt: skip
        outer = peer.outer(peer.model)  # the Trainer steps its own optimizer
        callback = shoal.ShoalCallback(outer)
        _say(f"READY {peer.ref} {peer.addresses[0]}")
        training = transformers.TrainingArguments(
            output_dir=str(Path(args.data_dir) / "hf-out"), max_steps=100_000,
            per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=5,
            save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=peer.model, args=training, train_dataset=Windows(),
            callbacks=[callback, StopAfterRounds()],
        )  # fmt: skip
        trainer.train()
    _say("CLOSED")


def run_task_trainer(args: argparse.Namespace) -> None:
    """The experiment's own steps (`task_trainer`) in this loop: what a verified one takes."""
    import shoal

    _, kwargs = _peer_args(args)
    with shoal.sync.join(**kwargs) as peer:
        trainer = peer.task_trainer()
        _say(f"READY {peer.ref} {peer.addresses[0]}")
        try:
            while True:
                _report(trainer.step())
                time.sleep(STEP_PAUSE_S)
        except KeyboardInterrupt:
            _say("INTERRUPTED")
    _say("CLOSED")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=["async", "sync", "hf", "task"])
    parser.add_argument("data_dir")
    parser.add_argument("--host")
    parser.add_argument("--join")
    parser.add_argument("--bootstrap")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--texts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Ctrl+C raises KeyboardInterrupt as in a terminal, even when this process was
    # started with SIGINT ignored (inherited from a shell's background job, as CI's
    # run can be): Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.variant == "async":
        asyncio.run(run_async(args))
    elif args.variant == "hf":
        run_hf(args)
    elif args.variant == "task":
        run_task_trainer(args)
    else:
        run_sync(args)


if __name__ == "__main__":
    sys.exit(main())
