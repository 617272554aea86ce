"""Sweep the inner optimizer's hyperparameters on a simulator of the default experiment.

    python bench/tune_defaults.py [DATA] [--steps 2500] [--replicas 4] [--inner-steps 50]
        [--lr 1e-3,4e-3,...] [--warmup 50,400] [--schedule constant,cosine,wsd,inverse_sqrt]
        [--total-steps N,...] [--floor 0.1] [--config JSON]... [--eval-every 500]
        [--task-config JSON] [--num-shards N] [--outer-lr 0.7] [--outer-momentum 0.9]
        [--inner-state reset,quantize]

DATA defaults to ../shared/data/tinyshakespeare.txt (from the repository root,
as bench/convergence.py finds it, or from a directory above it). Prints one JSON
object on stdout (progress goes to stderr):

    {"baseline": {config}, "defaults": {config}, "configs": [{config}, ...],
     "best": {config}, "settings": {...}, "wall_s": ...}

where a config is ``{"name", "hyperparameters", "val_loss", "curve": {step: val_loss},
"train_loss", "wall_s"}``: ``val_loss`` the mean cross-entropy (nats per byte) of
the global parameters over the task's held-out batches (`task.eval_batches`)
after the last step, ``curve`` the same every ``--eval-every`` steps (to see
whether a ranking is stable), ``train_loss`` the replicas' mean loss over the
last H steps. ``baseline`` is the experiment as it was before this tuning
(inner lr 1e-3, 50 warmup steps, constant lr), ``defaults`` the hyperparameters
a new experiment gets now (`DEFAULT_HYPERPARAMETERS`); both are measured in the
same run, on the same seeds, as the swept configurations.

The simulator is the default experiment in one process: `--replicas` copies of
the task's model (the built-in ``bytegpt`` at its default size unless
`--task-config` says otherwise), all from the same initial parameters, each on
its own shard of the data (shard r of `--num-shards`, default one per replica)
with its own batch seed, each trained by the daemon's own `InnerOptimizer`
(AdamW, the schedule of `learning_rate_scale`, clipping) at the step index the
trainer passes (the peer's inner step count). Every H = `--inner-steps` steps
the DiLoCo round runs as `shoal.averaging.diloco.DiLoCo` does on a commit: each
replica's pseudo-gradient ``global - local`` (`delta_into`), their mean
weighted by the samples behind them (the all-reduce's result; here a plain sum
in one process, so it differs from the network's only in floating-point
summation order), the outer step (`nesterov_outer_step`, the strategy's own
function, outer lr 0.7 and Nesterov momentum 0.9 by default as in the
strategy's defaults), and the global parameters copied into every replica
(`copy_into`). The AdamW state of each replica carries over rounds, as in the
trainer. No network, matchmaking or failures: every round commits with every
replica, which is the default experiment on a healthy swarm. With `--inner-state`,
the defaults run again with each `inner_state` given (reset or quantize the inner
optimizer's state after each round, as the trainer does), on the same seeds.

Configurations: the product of the `--lr`, `--warmup`, `--schedule`,
`--total-steps` (default: `--steps`) and `--floor` lists, plus any `--config`
(a JSON object of hyperparameters, over the legacy ones, e.g.
``{"inner_lr": 8e-3, "lr_schedule": "cosine", "total_steps": 5000}``).
Run with ``nice``: it uses one thread (`--threads`), one configuration at a time.

Result (docs/guide/strategies.md, "Hyperparameters", has the table): at the default size, 4
replicas and H = 50, validation loss after 2,000 inner steps per replica, about
7 minutes of one core per configuration: the former defaults (1e-3, 50 warmup
steps, constant) 2.401; with 400 warmup steps and a cosine decay to 10% at step
2,000, inner lr 8e-3 2.144, 1.6e-2 2.000 (the new defaults), 3.2e-2 2.003 (a tie: the
default takes the lower)
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shoal.averaging.host_state import copy_into, delta_into
from shoal.averaging.outer import nesterov_outer_step, resolve_options
from shoal.peer.trainer import DEFAULT_HYPERPARAMETERS, check_hyperparameters
from shoal.peer.training.inner import InnerOptimizer
from shoal.peer.training.task import Task, load_task

log = logging.getLogger("bench.tune_defaults")

_SHARED_DATA = Path("shared") / "data" / "tinyshakespeare.txt"
# ../shared/data/tinyshakespeare.txt from the repository root (as bench/convergence.py
# has it), or from a directory above it (a git worktree elsewhere).
DEFAULT_DATA = next(
    (d / _SHARED_DATA for d in Path(__file__).resolve().parents[2:] if (d / _SHARED_DATA).exists()),
    Path(__file__).resolve().parents[2] / _SHARED_DATA,
)
MODEL_SEED = 1234


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _strings(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def evaluate(task: Task, model: torch.nn.Module, batches: list[Any]) -> float:
    model.eval()
    with torch.no_grad():
        return sum(float(task.loss(model, b)) for b in batches) / len(batches)


class DiLoCoSimulator:
    """`replicas` peers of one DiLoCo experiment, trained in turn in this thread."""

    def __init__(self, task: Task, hyper: dict[str, Any], args: argparse.Namespace) -> None:
        self.task = task
        self.hyper = hyper
        self.inner_steps = args.inner_steps
        self.outer_lr = args.outer_lr
        self.outer_momentum = args.outer_momentum
        cpu = torch.device("cpu")
        self.models = [task.make_model(MODEL_SEED) for _ in range(args.replicas)]
        self.inners = [InnerOptimizer(m, hyper, device=cpu) for m in self.models]
        num_shards = args.num_shards or args.replicas
        self.batches = [task.batches(r, num_shards, seed=r) for r in range(args.replicas)]
        self.params = [list(m.parameters()) for m in self.models]
        with torch.no_grad():
            self.globals = [p.detach().clone() for p in self.params[0]]
        self.momentum = [torch.zeros_like(g) for g in self.globals]
        self.deltas = [[torch.zeros_like(g) for g in self.globals] for _ in self.models]
        self.samples = [0] * len(self.models)  # behind each replica's pseudo-gradient
        self.steps = 0

    def inner_step(self) -> float:
        """One inner step of every replica (at the same step index); their mean loss."""
        losses = []
        for r, (model, inner) in enumerate(zip(self.models, self.inners, strict=True)):
            batch = next(self.batches[r])
            losses.append(inner.step(lambda m=model, b=batch: self.task.loss(m, b), self.steps))
            self.samples[r] += int(self.task.batch_tokens(batch))
        self.steps += 1
        if self.steps % self.inner_steps == 0:
            self.outer_step()
        return sum(losses) / len(losses)

    def outer_step(self) -> None:
        """The round every replica commits: DiLoCo's `_round` and `_outer_step`."""
        for delta, params in zip(self.deltas, self.params, strict=True):
            delta_into(delta, self.globals, params)
        total = float(sum(self.samples))
        with torch.no_grad():
            mean = [torch.zeros_like(g) for g in self.globals]
            for delta, weight in zip(self.deltas, self.samples, strict=True):
                for m, d in zip(mean, delta, strict=True):
                    m.add_(d, alpha=weight / total)
        nesterov_outer_step(
            self.globals, mean, self.momentum, lr=self.outer_lr, mu=self.outer_momentum
        )
        for params in self.params:
            copy_into(params, self.globals)
        for inner in self.inners:  # (what the trainer does at a new global state)
            if self.hyper["inner_state"] == "reset":
                inner.reset()
            elif self.hyper["inner_state"] == "quantize":
                inner.quantize_state()
        self.samples = [0] * len(self.models)

    def global_model(self) -> torch.nn.Module:
        """A model holding the global parameters (replica 0 right after a round)."""
        model = self.task.make_model(MODEL_SEED)
        copy_into(list(model.parameters()), self.globals)
        return model


def run_config(
    task: Task, name: str, hyper: dict[str, Any], args: argparse.Namespace, evals: list[Any]
) -> dict[str, Any]:
    start = time.monotonic()
    sim = DiLoCoSimulator(task, hyper, args)
    curve: dict[str, float | None] = {}
    recent: list[float] = []
    for step in range(1, args.steps + 1):
        loss = sim.inner_step()
        recent = [*recent, loss][-args.inner_steps :]
        if not math.isfinite(loss):
            log.info("%s diverged at step %d", name, step)
            break
        if step % args.eval_every == 0 or step == args.steps:
            val = evaluate(task, sim.global_model(), evals)
            curve[str(step)] = val
            log.info("%s step %d: val %.4f train %.4f (%.0fs)", name, step, val,
                     sum(recent) / len(recent), time.monotonic() - start)  # fmt: skip
    diverged = len(curve) == 0 or str(args.steps) not in curve
    val_loss = None if diverged else curve[str(args.steps)]
    train = sum(recent) / len(recent) if recent and not diverged else None
    return {
        "name": name,
        "hyperparameters": {k: hyper[k] for k in _SHOWN if k in hyper},
        "val_loss": val_loss if val_loss is None or math.isfinite(val_loss) else None,
        "curve": curve,
        "train_loss": train,
        "wall_s": round(time.monotonic() - start, 1),
    }


_SHOWN = ("inner_lr", "warmup_steps", "lr_schedule", "total_steps", "lr_floor", "inner_state")


def configurations(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, hyperparameters): baseline, defaults, the grid, then --config."""
    out = [("baseline", check_hyperparameters({})), ("defaults", dict(DEFAULT_HYPERPARAMETERS))]
    grid = itertools.product(
        args.lr, args.warmup, args.schedule, args.total_steps or [args.steps], args.floor
    )
    for lr, warmup, schedule, total, floor in grid:
        given = {"inner_lr": lr, "warmup_steps": warmup, "lr_schedule": schedule}
        if schedule != "constant":
            given["lr_floor"] = floor
        if schedule in ("cosine", "wsd"):
            given["total_steps"] = total
        out.append((_name(given), check_hyperparameters(given)))
    for inner_state in args.inner_state:  # (the defaults, with another inner_state)
        given = {**DEFAULT_HYPERPARAMETERS, "inner_state": inner_state}
        out.append((f"defaults,inner_state={inner_state}", check_hyperparameters(given)))
    for text in args.config:
        given = json.loads(text)
        out.append((_name(given), check_hyperparameters(given)))
    return out


def _name(given: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in given.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA)
    p.add_argument("--steps", type=int, default=2500, help="inner steps per replica")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--inner-steps", type=int, help="H (default: DiLoCo's)")
    p.add_argument("--outer-lr", type=float, help="default: DiLoCo's")
    p.add_argument("--outer-momentum", type=float, help="default: DiLoCo's")
    p.add_argument("--lr", type=_floats, default=[], help="peak inner lrs, comma-separated")
    p.add_argument("--warmup", type=_ints, default=[400], help="warmup steps, comma-separated")
    p.add_argument("--schedule", type=_strings, default=["cosine"], help="lr_schedule values")
    p.add_argument("--total-steps", type=_ints, default=[], help="planned steps (default: --steps)")
    p.add_argument("--floor", type=_floats, default=[0.1], help="lr_floor values")
    p.add_argument("--config", action="append", default=[], help="JSON hyperparameters")
    p.add_argument("--inner-state", type=_strings, default=[],
                   help="run the defaults with these inner_state values too")  # fmt: skip
    p.add_argument("--no-defaults", action="store_true", help="skip the defaults config")
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline config")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--num-shards", type=int, default=0, help="default: one per replica")
    p.add_argument("--task-config", default="{}", help="JSON bytegpt config (default size)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    torch.set_num_threads(args.threads)
    diloco = resolve_options("diloco", {})
    args.inner_steps = args.inner_steps or diloco["inner_steps"]
    args.outer_lr = diloco["outer_lr"] if args.outer_lr is None else args.outer_lr
    if args.outer_momentum is None:
        args.outer_momentum = diloco["outer_momentum"]
    task = load_task("bytegpt", json.loads(args.task_config), data=args.data.resolve())
    evals = task.eval_batches(args.eval_batches)
    configs = configurations(args)
    skipped = {"defaults"} if args.no_defaults else set()
    skipped |= {"baseline"} if args.no_baseline else set()
    configs = [c for c in configs if c[0] not in skipped]
    start = time.monotonic()
    results = []
    for name, hyper in configs:
        results.append(run_config(task, name, hyper, args, evals))
        log.info("result %s", json.dumps(results[-1]))  # a long sweep stopped early keeps these
    by_name = {r["name"]: r for r in results}
    ranked = [r for r in results if r["val_loss"] is not None]
    out = {
        "baseline": by_name.get("baseline"),
        "defaults": by_name.get("defaults"),
        "configs": [r for r in results if r["name"] not in ("baseline", "defaults")],
        "best": min(ranked, key=lambda r: r["val_loss"]) if ranked else None,
        "settings": {
            "data": str(args.data),
            "task_config": task.config(),
            "steps": args.steps,
            "replicas": args.replicas,
            "inner_steps": args.inner_steps,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "num_shards": args.num_shards or args.replicas,
            "eval_batches": args.eval_batches,
            "threads": args.threads,
            "model_seed": MODEL_SEED,
        },
        "wall_s": round(time.monotonic() - start, 1),
    }
    if out["defaults"] and out["baseline"] and out["baseline"]["val_loss"] is not None:
        new, old = out["defaults"]["val_loss"], out["baseline"]["val_loss"]
        out["val_loss_defaults_over_baseline"] = None if new is None else new / old
    print(json.dumps(out))


if __name__ == "__main__":
    main()
