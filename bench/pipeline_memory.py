"""bench/pipeline.py --memory: the largest model N stage peers with a memory budget can
train, against the largest one peer can train alone with the same budget.

The model family is bytegpt's at --d-model and --context, growing by layers. For N
stages (one peer each: replicas of a stage are copies, they add no room) the
largest model is the most layers whose every stage's estimate
(`StageBudget`, what a peer checks against --max-memory) is within the budget.
One peer alone trains the whole model in one process with AdamW: parameters,
gradients, two moments and one microbatch's activations (the least any trainer
holds); the largest model is the most layers within the budget by that count.

Both are then checked by training them briefly in this process: the pipeline as
the in-process swarm of the throughput windows (N stage peers, a trainer), the
single model by plain forward, backward and AdamW steps; each run's growth of the
process's peak resident memory over its start (Linux: the peak is reset through
/proc/self/clear_refs) must stay within N budgets and one budget.

`--memory-copies disk` (the default, a daemon's: its data directory) counts a
stage state's transient copies (one a download a step overlaps reads, one a
re-sync downloads) as files, `memory` as a library peer's without a folder
holds them (3 parameter sizes more); `ratio_other_copies` gives the other's
ratio from the estimates of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from shoal.dht.node import DHTNode
from shoal.peer.pipelined.budget import StageBudget
from shoal.peer.training.tasks.bytegpt import ByteGPTTask, make_task
from shoal.pipeline.bounds import probe_bounds
from shoal.pipeline.sizes import parse_size
from shoal.pipeline.stage_build import stage_size
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.pipeline.trainer_loop import TrainerLoop

__all__ = ["add_arguments", "memory_check"]

log = logging.getLogger("bench.pipeline")

EXPERIMENT = "bench-mem"
MAX_LAYERS = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", action="store_true",
                   help="also the largest model N peers of --memory-budget train")  # fmt: skip
    p.add_argument("--memory-budget", default="256M", help="each peer's --max-memory")
    p.add_argument("--memory-steps", type=int, default=3, help="steps of each check's run")
    p.add_argument("--memory-copies", choices=("disk", "memory"), default="disk",
                   help="where a stage state's transient copies go: a folder, as a daemon's "
                   "(its data directory), or memory, as a library peer's without one")  # fmt: skip


def _with_layers(base: ByteGPTTask, layers: int) -> ByteGPTTask:
    return ByteGPTTask({**base.settings, "n_layers": layers}, base.corpus)


def _parameters(task: ByteGPTTask) -> int:
    return stage_size(task, 0, 1, 0)


def _budgets(
    task: ByteGPTTask, stages: int, opts: argparse.Namespace, on_disk: bool | None = None
) -> StageBudget:
    """What each stage costs a peer of the budget, served as such a peer serves it
    (`StageBudget.limits`: leanly when it fits only so)."""
    bounds = probe_bounds(task, 0, stages, opts.global_batch)
    on_disk = opts.memory_copies == "disk" if on_disk is None else on_disk
    return StageBudget(task, 0, bounds, budget=parse_size(opts.memory_budget),
                       in_flight=(1 + opts.lag) * opts.global_batch,
                       copies_on_disk=on_disk)  # fmt: skip


def _stage_costs(
    task: ByteGPTTask, stages: int, opts: argparse.Namespace, on_disk: bool | None = None
) -> list[int]:
    return _budgets(task, stages, opts, on_disk).costs()


def _alone_cost(task: ByteGPTTask, microbatch: int) -> int:
    """Parameters, gradients, AdamW's moments and one microbatch's activations."""
    (bounds,) = probe_bounds(task, 0, 1, microbatch)
    per_sample = bounds.activation_bytes + 2 * 4 * bounds.output_elements  # (logits, grads)
    return 16 * _parameters(task) + microbatch * per_sample


def _largest(fits: Any, least: int) -> int | None:
    """The most layers (from `least`) for which `fits(layers)` holds: doubling, then
    bisecting (cost grows with layers)."""
    if not fits(least):
        return None
    low, high = least, least * 2
    while high <= MAX_LAYERS and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_LAYERS + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _reset_peak() -> int:
    """Reset this process's peak resident memory to its current one (bytes)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _train_alone(task: ByteGPTTask, steps: int, warm: bool = True) -> int:
    """Peak memory growth (bytes) of `steps` AdamW steps on the whole model alone
    (`warm`: after one step of a one-layer model, so that what torch sets up once,
    its thread pools and kernels, is not counted)."""
    if warm:
        _train_alone(_with_layers(task, 1), 1, warm=False)
    start = _reset_peak()
    model = task.make_stage(0, 1, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # (the moments from the start, as a stage peer has them)
        opt.state[p]["step"] = torch.zeros(())
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
        opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)
    batches = task.batches(0, 1, 0)
    for _ in range(steps):
        batch = next(batches)
        task.stage_loss(model(task.stage_inputs(batch)), batch).backward()
        opt.step()
        opt.zero_grad()
    grown = _status("VmHWM") - start
    del model, opt
    return grown


async def _train_pipeline(
    task: ByteGPTTask, stages: int, opts: argparse.Namespace, node: Any, copies_dir: Path | None
) -> tuple[int, float]:
    """Peak memory growth (bytes) of a swarm of one peer a stage taking `steps` steps,
    and the trainer's last loss."""
    start = _reset_peak()
    nodes: list[DHTNode] = []
    peers: list[StagePeer] = []
    budgets = _budgets(task, stages, opts)
    try:
        for k in range(stages):
            module = task.make_stage(0, stages, k)
            copies = None if copies_dir is None else copies_dir / str(k)
            peer = StagePeer(await node(nodes), EXPERIMENT, k, module, hyper={"lr": 1e-3},
                             global_batch=opts.global_batch, bounds=budgets.bounds[k],
                             copies_dir=copies, limits=budgets.limits(k))  # fmt: skip
            del module
            await peer.start(sync=False)
            peers.append(peer)
        trainer = PipelineTrainer(await node(nodes), EXPERIMENT, stages, codec=opts.codec)
        loop = TrainerLoop(trainer, task.batches(0, 1, 0), inputs_of=task.stage_inputs,
                           loss_of=task.stage_loss, global_batch=opts.global_batch,
                           lag=opts.lag)  # fmt: skip
        await loop.run(steps=opts.memory_steps)
        await trainer.settled()
        return _status("VmHWM") - start, float(loop.loss or 0.0)
    finally:
        for peer in peers:
            await peer.aclose()
        for n in nodes:
            await n.aclose()
            await n.host.aclose()


async def memory_check(opts: argparse.Namespace, node: Any) -> dict[str, Any]:
    """The `memory` object of bench/pipeline.py's JSON (`node(nodes)`: a loopback DHT node)."""
    budget = parse_size(opts.memory_budget)
    stages = opts.stages
    base = make_task({"d_model": opts.d_model, "n_layers": stages,
                      "n_heads": max(1, opts.d_model // 32), "context": opts.context,
                      "batch_size": opts.microbatch})  # fmt: skip
    many = _largest(
        lambda n: max(_stage_costs(_with_layers(base, n), stages, opts)) <= budget, stages
    )
    alone = _largest(lambda n: _alone_cost(_with_layers(base, n), opts.microbatch) <= budget, 1)
    out: dict[str, Any] = {"peers": stages, "budget_bytes": budget}
    if many is None or alone is None:
        return {**out, "error": "no model of this family fits the budget"}
    big, small = _with_layers(base, many), _with_layers(base, alone)
    largest, single = 4 * _parameters(big), 4 * _parameters(small)
    log.info("memory: %d layers over %d peers, %d alone; training each briefly", many,
             stages, alone)  # fmt: skip
    grown_alone = await asyncio.to_thread(_train_alone, small, opts.memory_steps)
    with tempfile.TemporaryDirectory() as tmp:
        copies = Path(tmp) if opts.memory_copies == "disk" else None
        grown_many, loss = await _train_pipeline(big, stages, opts, node, copies)
    # The same budget with the copies in memory (a library's stage peers without a
    # folder): estimates only.
    other = opts.memory_copies != "disk"
    in_memory = _largest(
        lambda n: max(_stage_costs(_with_layers(base, n), stages, opts, other)) <= budget,
        stages,
    )
    return {
        **out,
        "largest_model_bytes": largest,
        "single_peer_largest_model_bytes": single,
        "ratio": round(largest / single, 3),
        "target_ratio": round(0.8 * stages, 2),
        "copies": opts.memory_copies,
        "ratio_other_copies": None
        if in_memory is None
        else round(4 * _parameters(_with_layers(base, in_memory)) / single, 3),
        "layers": {"pipeline": many, "alone": alone, "d_model": opts.d_model},
        # How each stage peer of the largest model serves its stage within the budget.
        "stage_limits": [_budgets(big, stages, opts).limits(k).as_dict() for k in range(stages)],
        "checked": {
            # The estimates against the growth of this process's peak (the pipeline's:
            # its N stage peers, its trainer and their DHT nodes, all in this process).
            "pipeline_estimate_bytes": sum(_stage_costs(big, stages, opts)),
            "pipeline_peak_growth_bytes": grown_many,
            "pipeline_within_budgets": grown_many <= stages * budget,
            "pipeline_loss": round(loss, 4),
            "alone_estimate_bytes": _alone_cost(small, opts.microbatch),
            "alone_peak_growth_bytes": grown_alone,
            "alone_within_budget": grown_alone <= budget,
        },
    }
