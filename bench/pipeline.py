"""Pipeline throughput: a trainer's samples/s through stage peers, against their capacity.

    python bench/pipeline.py [--stages 3] [--peers-per-stage 2] [--speeds 1] [--seconds 20]
        [--warmup 20] [--microbatch 8] [--codec int8] [--global-batch 128] [--lag 1]
        [--concurrency 16] [--seconds-per-sample 0.005] [--profile FILE]
        [--codecs none,int8,bf16,bf16+bottleneck12,int8+lowrank16] [--convergence-steps 200]
        [--convergence-global-batch 128] [--convergence-d-model 128] [--only-codecs]
        [--memory] [--memory-budget 256M] [--memory-steps 3] [--only-memory]
        [--task examples/pipeline_task.py:make_task] [--task-config JSON]
        [--stage-limits JSON] [--only-throughput]

Prints one JSON object on stdout (logs go to stderr):

    {"stages": 3, "peers": 6, "samples_per_s": ..., "capacity_bound_samples_per_s": ...,
     "efficiency": samples_per_s / capacity_bound_samples_per_s,
     "after_kill_efficiency": the same over a window starting --settle seconds after one
         peer of stage --kill-stage was killed, against the survivors' capacity bound,
     "single_process_samples_per_s": the same stages and microbatches in one process,
     "single_process_compute_only_samples_per_s": the same without the artificial delays,
     "cold_start_efficiency": the first --warmup seconds from fresh peers, ...,
     "diagnostics": {...},
     "activation_bytes_per_sample": {CODEC: ..., ..., "ratio": {CODEC: none / CODEC}},
     "wire_bytes_per_sample": {CODEC: ..., ..., "ratio": {...}},
     "loss_after_n_steps": {CODEC: ..., ..., "steps": n, "relative": {CODEC: loss / none - 1}},
     "best_codec": {"name", "ratio", "wire_ratio", "loss_relative"}: the highest ratio
         within 3% of none,
     "codec_runs": {CODEC: {...}},
     "memory": {"peers", "budget_bytes", "largest_model_bytes",
         "single_peer_largest_model_bytes", "ratio", ...} (with --memory: see
         bench/pipeline_memory.py),
     "stage_limits": {"limits", "samples_per_s", "efficiency", "samples_per_s_ratio", ...}
         (with --stage-limits: the throughput windows again, every stage peer served as
         a peer within a memory budget serves a stage that fits only leanly,
         `memory.StageLimits`, e.g. '{"backwards_while_averaging": false}'; the ratio
         is against the windows above, same run)}

Everything runs in this process on loopback, as the tests' in-process swarm does: one
DHT node and host per stage peer (`StagePeer`: the stage server, its optimizer step over
the stage's all-reduce, its progress reports) and one for the trainer (`PipelineTrainer`
driven by a `TrainerLoop`), all on one event loop; each stage server computes in its own
thread. The model is the bytegpt task's (`make_task`, `make_stages`: real layers, so
the activations on the wire are real), `--d-model` wide with one block per stage.

Accelerator compute is modelled by an artificial delay (`Paced`): a stage module
sleeps `samples x --seconds-per-sample / speed` for a forward, 2.5 times that when it
builds a graph (a backward request recomputes the forward and backpropagates: the
balancer's `BACKWARD_COST`), in its server's compute thread, so a peer's speed is
well defined and the peers compute in parallel (the real layers add their own, small,
CPU time). `--speeds` lists the peers' speeds (cycled over the peers, stage by stage).

Capacity bound: a stage's capacity is the sum over its peers of the samples/s each can
take through a forward and a backward request, 1 / (1/fwd + 1/bwd), where fwd and bwd
are the peer's own MEASURED speeds: its server's forward and backward EMAs (samples/s
over the compute time of its requests, what it announces in its DHT record), read at
the end of the window. The pipeline's bound is the slowest stage's capacity: every
sample goes through every stage. With speeds 1 that is peers_per_stage / (3.5 x
--seconds-per-sample) plus the real layers' time. Throughput is the samples of the
microbatches completed (forward through every stage, backward through every stage)
within the window, over its length; the window starts after --warmup seconds.

After the window one peer of `--kill-stage` (its first) is killed as by a crash (its
host closed under its requests and rounds, then its tasks): the trainer bans it and
retries on the stage's other peers, the stage's step goes on without it. The second
window starts --settle seconds later.

The codec comparison (`--codecs`, after the windows; alone with `--only-codecs`): per
codec, a fresh swarm of one peer per stage (no artificial delay) of a
`--convergence-d-model` wide model trains `--convergence-steps` optimizer steps of
`--convergence-global-batch` samples at lag 0 (every step takes the next global batch,
as one process would), from the same initial parameters (seed 0) on the same batches
(seed 0). A codec is a wire codec (`none` is float32, the reference), optionally with
bytegpt's bottleneck between stages: `bf16+bottleneck12` is config "bottleneck" 12
(`make_stages`: the hidden states between stages are 12 coordinates plus the byte ids)
under bf16; `int8+lowrank16` is the experiment codec of that name (`pipeline.boundary`:
shoal's adapters at every boundary, whatever the task, its hidden states 16 coordinates
plus the token ids, under int8), on the task as it is (no bottleneck of its own). `--task
FILE:FACTORY` runs the comparison on a custom task instead of bytegpt (its config
`--task-config`, with "batch_size" the microbatch; --convergence-d-model then unused).
`loss_after_n_steps`: the mean loss on --eval-batches held-out batches
after the steps. `wire_bytes_per_sample`: all tensor payloads on the wire per sample
during the run, both ways (the trainer's requests and the servers' answers, as sent).
`activation_bytes_per_sample`: the part of them that crosses stage boundaries, both
ways: hidden states from a stage through the trainer to the next, again with each
backward (the stage recomputes its forward), and their gradients back; that is the wire
bytes less the token ids into stage 0 (int64, twice) and the logits out of the last
stage and their gradient back (their size under the codec is exact: `encoded_size`),
which the trainer's loss needs whatever the stages send each other.
`single_process_samples_per_s`: the stages chained in one process with one device's
artificial delays at speed 1 (a forward with a graph costs 2.5 units: no recomputation),
forward, backward and an AdamW step every global batch, as many seconds as a window.

`diagnostics`, per window: each peer's share of the window spent computing
(`utilization`), the mean microbatches in flight, `paced_share` (how often the loop
could start no microbatch: it had started `(steps + 1 + lag) x global_batch`), the
steps taken and their samples (`step_samples`), `step_latency` (medians: from a stage's
peers holding the global batch to its commit, and on to the trainer seeing it), the
event loop's lag (a 10 ms ticker's lateness), the trainer's retries; and the
balancers' throughput estimates. `--profile FILE`: cProfile of the event loop's thread
over the first window.

What it showed (this 2-core machine, shared; 3 stages x 2 peers, defaults): efficiency
0.44-0.59, after_kill_efficiency 0.69-0.82, all tensor bytes 75,904 per sample in int8
against 295,936 in float32 (3.9x), single process 21-24 samples/s against a pipeline
bound of ~100. Three causes, each confirmed by patching it out in a scratch copy (0.94
and 0.90 with all three):
- the loop paces by `steps x global_batch`, but a step takes all its peers hold, often
  more than the global batch: the first steps' overshoots (152, 168, 160, ...) eat the
  lag's global batch, then every step takes exactly 128 and `paced_share` is ~0.97: at
  lag 1 the pipeline drains at every step, as at lag 0;
- the balancer prices a fresh stage's first requests at its 1 sample/s prior: a peer
  tried first stays behind by that many seconds of virtual time, and computes next to
  nothing for tens of seconds (`utilization` [0.715, 0.008] from a cold start);
- the event loop waits on the stage worker's lock (held by the compute thread for a
  whole batch): `take_gradients` at each step (up to 614 ms measured) and the commit
  hook (`off_loop` runs it inline below 1M elements), stalling every request in the
  process meanwhile (the ticker's p99 lateness reached 100-200 ms in some windows).

The codec comparison (defaults: d_model 128, 3 stages, 200 steps of 128 samples):
activation bytes per sample 327,680 in float32, 83,200 in int8 (3.94x), 163,840 in bf16
(2x), 15,744 in bf16+bottleneck12 (20.8x); held-out loss after the 200 steps 2.5667,
2.5575, 2.5662, 2.4913 (-2.9%) in one run, 2.5646, 2.5595, 2.5638, 2.5751 (+0.4%) in
another (float32 and bf16 repeat within 0.1%; the bottleneck's run varies more).
Earlier in training the bottleneck lags: +3.5% after 100 steps of 64 samples, +6.3%
after 200 of 64 (when int8 was -5.6% and bf16 +1.6%: in that phase, the loss plateau's
end, one seed's loss after n steps varies by several % between codecs that hardly
differ); an in-process run of 200 steps of 128 had it at -2.7%. Without the per-stage
embeddings of the ids (the plain bottleneck, d_model 64, R 12, int8) it was +8.6% after
200 steps of 128, in process. The wire's bytes are then dominated by the logits (the
trainer computes the loss): all tensor bytes only 5.6x fewer than float32's.

shoal's own adapters (`--codecs int8+lowrank16,none --convergence-steps 100
--convergence-global-batch 64 --only-codecs`, the machine loaded ~15x over its 2 cores, so
not the 200 steps of 128): on bytegpt without its bottleneck 10,784 activation bytes per
sample against 327,680 (30.4x), 45,088 wire bytes against 459,776 (10.2x: the int8
logits are 74% of what is left), held-out loss 2.9036 against 3.0121 (-3.6%; with the
adapters' id embeddings started at zero rather than small and random, 3.2682: +8.5%); on
examples/pipeline_task.py (`--task examples/pipeline_task.py:make_task`, a transformer
from PyTorch's own layers, the same widths) the same bytes, loss 2.5567 against 2.4741
and 2.4670 in two runs of none (+3.3%, +3.6%; +3.4% from zeros). Over the default 200
steps of 128 on bytegpt, though, int8+lowrank16 ended at 3.0133 against 2.5648 (+17.5%):
its loss stopped falling, not explained yet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import cProfile
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from pipeline_memory import add_arguments, memory_check  # (bench/, the script's folder)

from shoal.averaging.compression import CODECS, get_codec
from shoal.dht.node import DHTNode
from shoal.peer.training.task import load_task as load_custom_task
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.balancer import BACKWARD_COST
from shoal.pipeline.boundary import boundary_task
from shoal.pipeline.bounds import probe_bounds
from shoal.pipeline.memory import DEFAULT_LIMITS, StageLimits
from shoal.pipeline.options import parse_codec
from shoal.pipeline.stage_peer import StagePeer
from shoal.pipeline.trainer import PipelineTrainer
from shoal.pipeline.trainer_loop import TrainerLoop
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity

log = logging.getLogger("bench.pipeline")

EXPERIMENT = "bench-pipe"
HOST_OPTS = {"max_connections_per_ip": 100_000, "close_grace": 0.1}
DEFAULT_CODECS = "none,int8,bf16,bf16+bottleneck12,int8+lowrank16"
LOSS_TOLERANCE = 0.03  # a codec converges: its loss after the same steps within 3% of float32
TARGETS = {"activation_ratio": 20.0, "wire_ratio": 10.0, "loss_relative": LOSS_TOLERANCE}


async def loopback_node(nodes: list[DHTNode]) -> DHTNode:
    """A DHT node on a fresh loopback host, bootstrapped from the first of `nodes`
    (appended to them)."""
    host = Host(Identity.generate(), HostConfig(listen=("/ip4/127.0.0.1/tcp/0",), **HOST_OPTS))
    await host.start()
    boot = [str(nodes[0].host.addresses()[0])] if nodes else []
    made = await DHTNode.create(host, bootstrap=boot, hop_timeout=1.0)
    nodes.append(made)
    return made


async def close_nodes(nodes: list[DHTNode]) -> None:
    for n in nodes:
        with contextlib.suppress(Exception):
            await n.aclose()
        with contextlib.suppress(Exception):
            await n.host.aclose()


class Paced(torch.nn.Module):
    """A stage module at an artificial speed (see the module's docstring)."""

    def __init__(self, inner: torch.nn.Module, seconds_per_sample: float, speed: float) -> None:
        super().__init__()
        self.inner = inner
        self.seconds_per_sample = seconds_per_sample
        self.speed = speed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cost = BACKWARD_COST if torch.is_grad_enabled() else 1.0
        if self.seconds_per_sample > 0:
            time.sleep(x.shape[0] * cost * self.seconds_per_sample / self.speed)
        return self.inner(x)


def task_config(opts: argparse.Namespace, bottleneck: int = 0) -> dict[str, Any]:
    return {
        "d_model": opts.d_model,
        "n_layers": opts.stages,
        "n_heads": max(1, opts.d_model // 32),
        "context": opts.context,
        "batch_size": opts.microbatch,
        "bottleneck": bottleneck,
    }


def load_task(opts: argparse.Namespace, bottleneck: int = 0) -> Any:
    """bytegpt (`task_config`), or `--task`'s custom task with `--task-config`."""
    if opts.task == "bytegpt":
        return make_task(task_config(opts, bottleneck))
    if bottleneck:
        raise ValueError("a task's own bottleneck is bytegpt's: use +lowrankR")
    config = {**json.loads(opts.task_config), "batch_size": opts.microbatch}
    return load_custom_task(opts.task, config)


class Bench:
    def __init__(
        self, opts: argparse.Namespace, experiment: str = EXPERIMENT, bottleneck: int = 0,
        codec: str = "none",
    ) -> None:  # fmt: skip
        """`codec`: the experiment's (WIRE+lowrankR wraps the task's stages)."""
        self.opts = opts
        self.experiment = experiment
        self.task = boundary_task(load_task(opts, bottleneck), codec)
        self.modules = self.task.make_stages(0, opts.stages)
        self.nodes: list[DHTNode] = []
        self.peers: list[StagePeer] = []
        self.speeds: dict[int, float] = {}  # id(peer) -> its artificial speed
        self.lags: list[float] = []
        self.step_events: dict[int, dict[int, dict[str, float]]] = {}
        self.limits = DEFAULT_LIMITS  # (how the stage peers serve: `--stage-limits`)

    async def node(self) -> DHTNode:
        return await loopback_node(self.nodes)

    async def start(self) -> None:
        o = self.opts
        speeds = [float(s) for s in o.speeds.split(",")]
        i = 0
        for s, module in enumerate(self.modules):
            for _ in range(o.peers_per_stage):
                speed = speeds[i % len(speeds)]
                i += 1
                paced = Paced(copy.deepcopy(module), o.seconds_per_sample, speed)
                peer = StagePeer(await self.node(), self.experiment, s, paced,
                                 hyper={"lr": 1e-3}, global_batch=o.global_batch,
                                 limits=self.limits)  # fmt: skip
                await peer.start(sync=False)
                self.peers.append(peer)
                self.speeds[id(peer)] = speed

    async def aclose(self) -> None:
        await asyncio.gather(*(p.aclose() for p in self.peers), return_exceptions=True)
        await close_nodes(self.nodes)

    def of_stage(self, stage: int) -> list[StagePeer]:
        return [p for p in self.peers if p.stage == stage]

    # ------------------------------------------------------------------ measuring

    def capacity(self) -> tuple[float, list[float]]:
        """The pipeline's bound and each stage's capacity, from the servers' EMAs."""
        stages = []
        for s in range(self.opts.stages):
            total = 0.0
            for p in self.of_stage(s):
                fwd, bwd = p.server.forward_speed.value, p.server.backward_speed.value
                if fwd and bwd:
                    total += 1.0 / (1.0 / fwd + 1.0 / bwd)
            stages.append(total)
        return min(stages), stages

    async def step_monitor(self, trainer: PipelineTrainer) -> None:
        """Per stage and version: when its peers' gradients first added up to the global
        batch, when the first of them committed the step, when the trainer saw it."""
        while True:
            now = time.monotonic()
            for s in range(self.opts.stages):
                alive = self.of_stage(s)
                if not alive:
                    continue
                low, high = min(p.version for p in alive), max(p.version for p in alive)
                events = self.step_events.setdefault(s, {})
                held = sum(p.worker.samples_for(low) for p in alive)
                if held >= self.opts.global_batch:
                    events.setdefault(low, {}).setdefault("full", now)
                for v in range(low, high):
                    events.setdefault(v, {}).setdefault("committed", now)
                for v in range(trainer.versions[s]):
                    if v in events:
                        events[v].setdefault("seen", now)
            await asyncio.sleep(0.01)

    def step_latency(self, since: float) -> dict[str, Any]:
        """Medians over the steps since `since` (monotonic) of full -> committed -> seen."""
        commit, seen = [], []
        for events in self.step_events.values():
            for e in events.values():
                if e.get("full", -1.0) >= since and "committed" in e:
                    commit.append(e["committed"] - e["full"])
                    if "seen" in e:
                        seen.append(e["seen"] - e["committed"])
        return {
            "full_to_commit_s": round(statistics.median(commit), 3) if commit else None,
            "commit_to_trainer_s": round(statistics.median(seen), 3) if seen else None,
            "steps": len(commit),
        }

    async def ticker(self) -> None:
        """The event loop's lateness on a 10 ms sleep, appended to `lags`."""
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            self.lags.append(time.perf_counter() - before - 0.01)

    async def window(
        self, trainer: PipelineTrainer, loop: TrainerLoop, seconds: float
    ) -> dict[str, Any]:
        """Completed samples/s over `seconds`, against the capacity bound at the end."""
        busy_before = {id(p): self._busy(p) for p in self.peers}
        versions_before = [max((p.version for p in self.of_stage(s)), default=0)
                           for s in range(self.opts.stages)]  # fmt: skip
        self.lags.clear()
        in_flight = []
        samples, started = trainer.counters.samples, time.monotonic()
        retries = trainer.counters.retries
        paced = []
        g = self.opts.global_batch
        while (elapsed := time.monotonic() - started) < seconds:
            in_flight.append(
                (loop.started_samples - trainer.counters.samples) / self.opts.microbatch
            )
            if loop.base is not None:  # the loop may start no microbatch now
                paced.append(loop.started_samples >= (loop.steps + 1 + loop.lag) * g)
            await asyncio.sleep(0.05)
        rate = (trainer.counters.samples - samples) / elapsed
        bound, stages = self.capacity()
        utilization = {}
        for s in range(self.opts.stages):
            utilization[s] = [
                round((self._busy(p) - busy_before.get(id(p), 0.0)) / elapsed, 3)
                for p in self.of_stage(s)
            ]
        lags = sorted(self.lags) or [0.0]
        return {
            "samples_per_s": rate,
            "capacity_bound_samples_per_s": bound,
            "efficiency": rate / bound if bound else None,
            "stage_capacity_samples_per_s": [round(c, 2) for c in stages],
            "utilization": utilization,
            "mean_in_flight": round(statistics.fmean(in_flight), 2) if in_flight else None,
            "paced_share": round(statistics.fmean(paced), 3) if paced else None,
            "steps": [
                max((p.version for p in self.of_stage(s)), default=0) - v
                for s, v in enumerate(versions_before)
            ],
            "step_samples": [self._step_samples(s, v) for s, v in enumerate(versions_before)],
            "retries": trainer.counters.retries - retries,
            "step_latency": self.step_latency(started),
            "loop_lag_ms": {
                "p50": round(1000 * lags[len(lags) // 2], 2),
                "p99": round(1000 * lags[int(len(lags) * 0.99)], 2),
            },
            "seconds": round(elapsed, 2),
        }

    def _step_samples(self, stage: int, since: int) -> list[int]:
        """The samples of each of `stage`'s steps from version `since` on."""
        merged: dict[int, int] = {}
        for p in self.of_stage(stage):
            merged.update(p.optimizer.step_samples)
        return [n for v, n in sorted(merged.items()) if v >= since]

    def _busy(self, p: StagePeer) -> float:
        """Compute seconds `p` spent on the requests it served (at its EMA speeds)."""
        fwd, bwd = p.server.forward_speed.value, p.server.backward_speed.value
        m = self.opts.microbatch
        busy = p.server.served["forward"] * m / fwd if fwd else 0.0
        return busy + (p.server.served["backward"] * m / bwd if bwd else 0.0)

    async def kill(self, stage: int) -> StagePeer:
        """As by a crash: the host closes under its requests and rounds, then its tasks stop."""
        victim = self.of_stage(stage)[0]
        await victim.server.dht.host.aclose()
        await victim.aclose()
        self.peers.remove(victim)
        return victim

    def eval_loss(self, count: int) -> float:
        """The mean loss of the stages' current parameters (one peer of each, chained
        in this process) on `count` held-out batches of the task."""
        modules = [self.of_stage(s)[0].worker for s in range(self.opts.stages)]
        losses = []
        for batch in self.task.eval_batches(count):
            y = self.task.stage_inputs(batch)
            for worker in modules:
                y = worker.forward(y)
            losses.append(float(self.task.stage_loss(y, batch)))
        return statistics.fmean(losses)

    def outside_bytes_per_sample(self, codec: str) -> float:
        """Of the wire's tensor payloads per sample, what is not a stage boundary's: the
        byte ids into stage 0 (int64, sent plain with the forward and again with the
        backward) and the logits out of the last stage and their gradient back (under
        `codec`, whose encoded size is exact)."""
        m = self.opts.microbatch
        sample = self.task.stage_inputs(self.task.eval_batches(1)[0])[:1]
        ids = 2 * sample.numel() * sample.element_size()
        last = probe_bounds(self.task, 0, self.opts.stages, m)[-1].output_elements
        logits = 2 * get_codec(codec).encoded_size(m * last) / m
        return ids + logits


@dataclass(frozen=True)
class CodecSpec:
    """A compression the codec comparison runs: the wire codec of activations and
    gradients, the task's bottleneck between stages (0: none) and the rank of shoal's
    adapters at the boundaries (0: none; `name` is then the experiment's codec)."""

    name: str
    wire: str
    bottleneck: int = 0
    lowrank: int = 0


def parse_codecs(text: str) -> list[CodecSpec]:
    """`--codecs`: comma-separated WIRE, WIRE+bottleneckR (e.g. int8+bottleneck12: the
    task's) or WIRE+lowrankR (e.g. int8+lowrank16: shoal's); the float32 reference
    ("none") is added when missing (last: the runs go in the order given)."""
    specs = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        wire, _, rest = name.partition("+")
        rank = lowrank = 0
        if rest.startswith("lowrank"):
            lowrank = parse_codec(name).rank
        elif rest:
            if not rest.startswith("bottleneck") or not rest[len("bottleneck") :].isdigit():
                raise ValueError(
                    f"bad codec {name!r}: expected WIRE, WIRE+bottleneckR or WIRE+lowrankR"
                )
            rank = int(rest[len("bottleneck") :])
        if wire not in CODECS:
            raise ValueError(f"bad codec {name!r}: the wire codec is one of {', '.join(CODECS)}")
        specs.append(CodecSpec(name, wire, rank, lowrank))
    if not any(s.name == "none" for s in specs):
        specs.append(CodecSpec("none", "none"))
    return specs


async def codec_run(opts: argparse.Namespace, spec: CodecSpec, index: int) -> dict[str, Any]:
    """`--convergence-steps` optimizer steps under `spec` through a fresh swarm (one peer
    per stage, no artificial delay, lag 0: every step takes the next global batch of the
    same data from the same initial parameters, as one process would): the held-out
    loss after them and the tensor bytes on the wire per sample."""
    o = copy.copy(opts)
    o.peers_per_stage, o.seconds_per_sample, o.speeds = 1, 0.0, "1"
    o.global_batch = opts.convergence_global_batch
    o.d_model = opts.convergence_d_model
    bench = Bench(o, f"bench-codec-{index}", spec.bottleneck, spec.name if spec.lowrank else "none")
    try:
        await bench.start()
        trainer = PipelineTrainer(await bench.node(), bench.experiment, o.stages, codec=spec.wire)
        loop = TrainerLoop(
            trainer,
            bench.task.batches(0, 1, 0),
            inputs_of=bench.task.stage_inputs,
            loss_of=bench.task.stage_loss,
            global_batch=o.global_batch,
            lag=0,
            concurrency=opts.concurrency,
        )
        started = time.monotonic()
        await loop.run(steps=opts.convergence_steps)
        await trainer.settled()
        seconds = time.monotonic() - started
        sent = trainer.counters.bytes_sent + sum(p.server.bytes_sent for p in bench.peers)
        wire = sent / trainer.counters.samples
        loss = await asyncio.to_thread(bench.eval_loss, opts.eval_batches)
        versions = [p.version for p in bench.peers]
    finally:
        await bench.aclose()
    return {
        "activation_bytes_per_sample": wire - bench.outside_bytes_per_sample(spec.wire),
        "wire_bytes_per_sample": wire,
        "loss_after_n_steps": loss,
        "train_loss_ema": loop.loss,
        "stage_versions": versions,
        "retries": trainer.counters.retries,
        "seconds": round(seconds, 1),
    }


async def compare_codecs(opts: argparse.Namespace) -> dict[str, Any]:
    """Per codec: activation bytes per sample, and the loss after the same steps."""
    runs = {}
    for i, spec in enumerate(parse_codecs(opts.codecs)):
        log.info("codec %s: %d steps", spec.name, opts.convergence_steps)
        runs[spec.name] = await codec_run(opts, spec, i)
        log.info("codec %s: %s", spec.name, runs[spec.name])
    ref = runs["none"]
    activation = {n: round(r["activation_bytes_per_sample"]) for n, r in runs.items()}
    wire = {n: round(r["wire_bytes_per_sample"]) for n, r in runs.items()}
    loss = {n: round(r["loss_after_n_steps"], 4) for n, r in runs.items()}
    ratio = {n: round(ref["activation_bytes_per_sample"] / r["activation_bytes_per_sample"], 2)
             for n, r in runs.items()}  # fmt: skip
    relative = {n: round(r["loss_after_n_steps"] / ref["loss_after_n_steps"] - 1, 4)
                for n, r in runs.items()}  # fmt: skip
    wire_ratio = {n: round(wire["none"] / w, 2) for n, w in wire.items()}
    converging = [n for n in runs if relative[n] <= LOSS_TOLERANCE]
    best = max(converging, key=lambda n: ratio[n])
    return {
        "activation_bytes_per_sample": {**activation, "ratio": ratio},
        "wire_bytes_per_sample": {**wire, "ratio": wire_ratio},
        "loss_after_n_steps": {**loss, "steps": opts.convergence_steps, "relative": relative},
        "best_codec": {
            "name": best,
            "ratio": ratio[best],
            "wire_ratio": wire_ratio[best],
            "loss_relative": relative[best],
        },
        "codec_runs": runs,
    }


def single_process(task: Any, modules: list[torch.nn.Module], opts: argparse.Namespace,
                   seconds_per_sample: float) -> float:  # fmt: skip
    """Samples/s of the stages chained in one process (one device at speed 1)."""
    stages = [Paced(copy.deepcopy(m), seconds_per_sample, 1.0) for m in modules]
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    batches = task.batches(0, 1, 3)
    per_step = max(1, opts.global_batch // opts.microbatch)
    samples, started, done = 0, 0.0, 0
    while True:
        if done == 2:  # after two microbatches of warm-up
            samples, started = 0, time.perf_counter()
        elif done > 2 and time.perf_counter() - started >= opts.single_seconds:
            return samples / (time.perf_counter() - started)
        batch = next(batches)
        y = task.stage_inputs(batch)
        for s in stages:
            y = s(y)
        (task.stage_loss(y, batch) / per_step).backward()
        samples += len(batch)
        done += 1
        if done % per_step == 0:
            opt.step()
            opt.zero_grad()


async def run(opts: argparse.Namespace, limits: StageLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    bench = Bench(opts)
    bench.limits = limits
    ticker = asyncio.ensure_future(bench.ticker())
    try:
        await bench.start()
        trainer_dht = await bench.node()
        trainer = PipelineTrainer(trainer_dht, EXPERIMENT, opts.stages, codec=opts.codec)
        loop = TrainerLoop(
            trainer,
            bench.task.batches(0, 1, 0),
            inputs_of=bench.task.stage_inputs,
            loss_of=bench.task.stage_loss,
            global_batch=opts.global_batch,
            lag=opts.lag,
            concurrency=opts.concurrency,
        )
        stop = asyncio.Event()
        running = asyncio.ensure_future(loop.run(stop))
        monitor = asyncio.ensure_future(bench.step_monitor(trainer))
        log.info("cold start: %.0f s", opts.warmup)
        cold = await bench.window(trainer, loop, opts.warmup)
        log.info("cold start: %s", cold)
        profiler = cProfile.Profile() if opts.profile else None
        if profiler is not None:
            profiler.enable()
        first = await bench.window(trainer, loop, opts.seconds)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(opts.profile)
        log.info("window: %s", first)
        victim = await bench.kill(opts.kill_stage)
        log.info("killed a peer of stage %d; %.0f s to settle", victim.stage, opts.settle)
        await bench.window(trainer, loop, opts.settle)
        after = await bench.window(trainer, loop, opts.seconds)
        log.info("after the kill: %s", after)
        stop.set()
        await running
        await trainer.settled()
        monitor.cancel()
        balancers = [
            {str(p)[-8:]: round(b.throughput(p) or 0.0, 1) for p in b.peers()}
            for b in trainer.balancers
        ]
    finally:
        ticker.cancel()
        await bench.aclose()
    alone = single_process(bench.task, bench.modules, opts, opts.seconds_per_sample)
    compute_only = single_process(bench.task, bench.modules, opts, 0.0)
    return {
        "stages": opts.stages,
        "peers": opts.stages * opts.peers_per_stage,
        "samples_per_s": round(first["samples_per_s"], 2),
        "capacity_bound_samples_per_s": round(first["capacity_bound_samples_per_s"], 2),
        "efficiency": round(first["efficiency"], 3),
        "after_kill_samples_per_s": round(after["samples_per_s"], 2),
        "after_kill_capacity_bound_samples_per_s": round(after["capacity_bound_samples_per_s"], 2),
        "after_kill_efficiency": round(after["efficiency"], 3),
        "single_process_samples_per_s": round(alone, 2),
        "single_process_compute_only_samples_per_s": round(compute_only, 2),
        "cold_start_efficiency": round(cold["efficiency"], 3),
        "targets": {"efficiency": 0.85, "after_kill_efficiency": 0.8},
        "diagnostics": {
            "cold_start": cold,
            "window": first,
            "after_kill": after,
            "balancer_throughputs": balancers,
        },
        "settings": {k: v for k, v in vars(opts).items() if k != "profile"},
    }


async def main_async(opts: argparse.Namespace) -> dict[str, Any]:
    """The throughput windows (unless --only-codecs), then the codec comparison; with
    --memory, the largest model N peers of a budget train (`pipeline_memory`)."""
    if opts.only_memory:
        return {"memory": await memory_check(opts, loopback_node)}
    out = {} if opts.only_codecs else await run(opts)
    if opts.stage_limits and not opts.only_codecs:
        limits = StageLimits(**json.loads(opts.stage_limits))
        lean = await run(opts, limits)
        out["stage_limits"] = {
            "limits": limits.as_dict(),
            **{k: lean[k] for k in ("samples_per_s", "capacity_bound_samples_per_s",
                                    "efficiency", "after_kill_efficiency")},
            "samples_per_s_ratio": round(lean["samples_per_s"] / out["samples_per_s"], 3),
            "diagnostics": lean["diagnostics"],
        }  # fmt: skip
    if opts.memory:
        out["memory"] = await memory_check(opts, loopback_node)
    if opts.only_throughput:
        return {**out, "settings": {k: v for k, v in vars(opts).items() if k != "profile"}}
    codecs = await compare_codecs(opts)
    out["targets"] = {**out.get("targets", {}), **TARGETS}
    return {**out, **codecs, "settings": {k: v for k, v in vars(opts).items() if k != "profile"}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--peers-per-stage", type=int, default=2)
    p.add_argument("--speeds", default="1", help="the peers' speeds, comma-separated, cycled")
    p.add_argument("--seconds", type=float, default=20.0, help="each measured window")
    p.add_argument("--warmup", type=float, default=20.0, help="from fresh peers to the window")
    p.add_argument("--settle", type=float, default=5.0, help="from the kill to its window")
    p.add_argument("--microbatch", type=int, default=8, help="samples per microbatch")
    p.add_argument("--codec", default="int8", help="activations on the wire (int8, none, ...)")
    p.add_argument("--global-batch", type=int, default=128, help="samples per stage step")
    p.add_argument("--lag", type=int, default=1, help="TrainerLoop lag (global batches)")
    p.add_argument("--concurrency", type=int, default=16, help="microbatches in flight")
    p.add_argument("--seconds-per-sample", type=float, default=0.005,
                   help="artificial forward time of a sample at speed 1")  # fmt: skip
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--kill-stage", type=int, default=1)
    p.add_argument("--single-seconds", type=float, default=10.0)
    p.add_argument("--profile", help="cProfile the event loop's thread over the window")
    p.add_argument("--codecs", default=DEFAULT_CODECS,
                   help="compared: WIRE or WIRE+bottleneckR, comma-separated")  # fmt: skip
    p.add_argument("--convergence-steps", type=int, default=200,
                   help="optimizer steps of each codec's run")  # fmt: skip
    p.add_argument("--convergence-global-batch", type=int, default=128)
    p.add_argument("--convergence-d-model", type=int, default=128,
                   help="the codec comparison model's width")  # fmt: skip
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches of the loss")
    p.add_argument("--only-codecs", action="store_true", help="skip the throughput windows")
    p.add_argument("--only-throughput", action="store_true", help="skip the codec comparison")
    p.add_argument("--stage-limits", default="",
                   help="the throughput windows again with the stage peers served so "
                   "(pipeline.memory.StageLimits' fields as JSON), vs the default")  # fmt: skip
    add_arguments(p)
    p.add_argument("--only-memory", action="store_true", help="--memory alone")
    p.add_argument("--task", default="bytegpt",
                   help="bytegpt, or FILE:FACTORY of a custom pipelined task")  # fmt: skip
    p.add_argument("--task-config", default="{}", help="a custom task's config (JSON)")
    opts = p.parse_args(argv)
    if not 0 <= opts.kill_stage < opts.stages or opts.peers_per_stage < 2:
        p.error("--kill-stage must name a stage, and a stage needs 2 peers to survive a kill")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    logging.getLogger("shoal").setLevel(logging.WARNING)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(json.dumps(runner(main_async(opts))))


if __name__ == "__main__":
    main()
