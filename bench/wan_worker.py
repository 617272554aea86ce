"""One peer of one arm of bench/wan.py, run inside its network namespace.

    python bench/wan_worker.py SPEC.json

SPEC (written by bench/wan.py): arm, rank, peers, addresses (of every rank), run
directory, budget_s, snapshot_s, the arm's tuning and the task's config. The
worker sets up (model, data, network), writes `ready-RANK`, waits for `go` (the
start instant on the shared monotonic clock), trains for budget_s of wall-clock
time, and writes `result-RANK.pt`: snapshots of the model every snapshot_s
(elapsed time, bytes this namespace's link sent and received, inner steps, the
parameters the arm would ship then) and its counters.

The learning rate follows the wall-clock: linear warmup over the first
`warmup_frac` of the budget, then a cosine decay to `min_lr` of the peak at the
budget's end (an arm cannot know its step count in advance). Data-parallel arms
average the elapsed time with the gradients, so every replica uses the same rate
and all of them stop at the same step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import MODEL_SEED, forward_backward, streaming_globals

from shoal.averaging.allreduce import AllReduceConfig, AllReduceService
from shoal.averaging.group import Group, Member, make_round_id
from shoal.averaging.strategies import make_strategy
from shoal.dht.node import DHTNode
from shoal.peer.training.task import load_task
from shoal.peer.training.validation import changes_the_model
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity, PeerID
from shoal.transport.multiaddr import Multiaddr

KEY = "bench/wan"
GLOO_PORT = 29500


def link_bytes() -> tuple[int, int]:
    """Bytes this namespace's link sent and received (every protocol, headers included)."""
    stats = Path("/sys/class/net/eth0/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def lr_scale(frac: float, warmup_frac: float, min_lr: float) -> float:
    """The schedule at `frac` of the budget: warmup, then cosine to `min_lr`."""
    if frac < warmup_frac:
        return max(frac / warmup_frac, 1e-3)
    done = min(1.0, (frac - warmup_frac) / max(1e-9, 1.0 - warmup_frac))
    return min_lr + (1.0 - min_lr) * 0.5 * (1.0 + math.cos(math.pi * done))


@dataclass
class Worker:
    """The model, optimizer, data and clock of one peer."""

    spec: dict[str, Any]
    task: Any = None
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    t0: float = 0.0
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="inner")
    )

    def __post_init__(self) -> None:
        s = self.spec
        self.rank, self.peers = s["rank"], s["peers"]
        self.run_dir = Path(s["run_dir"])
        self.task = load_task("bytegpt", s["task_config"], data=Path(s["data"]))
        self.model = self.task.make_model(MODEL_SEED)
        self.params = list(self.model.parameters())
        t = s["tuning"]
        self.peak_lr = t["inner_lr"]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.peak_lr, weight_decay=s["weight_decay"], betas=(0.9, 0.95)
        )
        self.batches = self.task.batches(self.rank, self.peers, seed=self.rank)
        self.losses: list[float] = []

    # ------------------------------------------------------------ the clock

    def ready_and_wait(self) -> None:
        (self.run_dir / f"ready-{self.rank}").write_text("ok")
        go = self.run_dir / "go"
        while not go.exists():
            time.sleep(0.02)
        self.t0 = float(go.read_text())
        time.sleep(max(0.0, self.t0 - time.monotonic()))
        self.next_snapshot = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    @property
    def budget(self) -> float:
        return float(self.spec["budget_s"])

    def set_lr(self, elapsed: float) -> None:
        t = self.spec["tuning"]
        scale = lr_scale(elapsed / self.budget, t["warmup_frac"], self.spec["min_lr"])
        for group in self.optimizer.param_groups:
            group["lr"] = self.peak_lr * scale

    def maybe_snapshot(self, tensors: list[torch.Tensor], *, final: bool = False) -> None:
        now = self.elapsed()
        if not final and now < self.next_snapshot:
            return
        sent, received = link_bytes()
        if final:
            # At the budget's end (a last round ends a little past it), but never
            # before a snapshot already taken: a 25M data-parallel step at 10 Mbit/s
            # ends minutes past the budget, and its curve went back in time.
            now = max(min(now, self.budget), max((s["t"] for s in self.snapshots), default=0.0))
        self.snapshots.append({
            "t": now,
            "sent": sent,
            "received": received,
            "steps": self.steps,
            "params": [x.detach().to("cpu", copy=True) for x in tensors],
        })  # fmt: skip
        while self.next_snapshot <= now:
            self.next_snapshot += float(self.spec["snapshot_s"])

    # ------------------------------------------------------------ one step

    def forward_backward(self) -> int:
        return forward_backward(self.task, self.model, self.optimizer, self.batches, self.losses)

    def apply(self, elapsed: float) -> None:
        self.set_lr(elapsed)
        if self.spec["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.spec["grad_clip"])
        self.optimizer.step()
        self.steps += 1

    def flat_grads(self, elapsed: float, over: bool) -> torch.Tensor:
        """The gradient, then the elapsed time and whether this peer's budget is spent."""
        grads = [p.grad.reshape(-1) for p in self.params]
        return torch.cat([*grads, torch.tensor([elapsed, 1.0 if over else 0.0])])

    def load_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n

    async def run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def save(self, extra: dict[str, Any]) -> None:
        tail = self.losses[-50:]
        out = {
            "rank": self.rank,
            "steps": self.steps,
            "snapshots": self.snapshots,
            "train_loss_last50": sum(tail) / len(tail) if tail else None,
            **extra,
        }
        torch.save(out, self.run_dir / f"result-{self.rank}.pt")


# ---------------------------------------------------------------------- arms


def run_gloo(w: Worker) -> dict[str, Any]:
    """Synchronous data parallel through torch.distributed's gloo all-reduce."""
    import torch.distributed as dist

    spec = w.spec
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the shaped link (else the hostname's address)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{spec['addresses'][0]}:{GLOO_PORT}",
        rank=w.rank,
        world_size=w.peers,
        timeout=timedelta(seconds=120),
    )
    w.ready_and_wait()
    while True:
        w.maybe_snapshot(w.params)
        w.forward_backward()
        now = w.elapsed()
        flat = w.flat_grads(now, now >= w.budget)
        dist.all_reduce(flat)
        flat /= w.peers
        w.load_grads(flat[:-2])
        w.apply(float(flat[-2]))
        if flat[-1] > 0:  # somebody's budget is spent: everyone stops at this step
            break
    w.maybe_snapshot(w.params, final=True)
    dist.destroy_process_group()
    return {}


async def start_host(w: Worker) -> Host:
    host = Host(
        Identity.generate(),
        HostConfig(
            listen=(f"/ip4/{w.spec['addresses'][w.rank]}/tcp/4001",), max_connections_per_ip=1000
        ),
    )
    await host.start()
    return host


def wait_file(path: Path, timeout: float = 120.0) -> str:
    """The text of `path` once another process wrote it (before the network is busy)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)
    time.sleep(0.05)  # (written in one call; let it land)
    return path.read_text()


async def run_shoal_dp(w: Worker) -> dict[str, Any]:
    """Synchronous data parallel through shoal's fault-tolerant all-reduce (a fixed group)."""
    host = await start_host(w)
    service = AllReduceService(host, AllReduceConfig())
    me = {"id": host.peer_id.to_base58(), "addrs": [str(a) for a in host.addresses()]}
    (w.run_dir / f"peer-{w.rank}.json").write_text(json.dumps(me))
    others = [
        json.loads(await asyncio.to_thread(wait_file, w.run_dir / f"peer-{k}.json"))
        for k in range(w.peers)
    ]
    members = []
    for k, o in enumerate(others):
        member = Member(PeerID.from_base58(o["id"]), tuple(Multiaddr(a) for a in o["addrs"]))
        members.append(member)
        if k > w.rank:
            await host.connect(member.peer_id, list(member.addrs))
    members.sort(key=lambda m: m.peer_id.to_bytes())
    ids = [m.peer_id for m in members]
    outcomes = {"committed": 0, "aborted": 0}
    await asyncio.to_thread(w.ready_and_wait)
    try:
        while True:
            w.maybe_snapshot(w.params)
            tokens = await w.run(w.forward_backward)
            now = w.elapsed()
            flat = await w.run(w.flat_grads, now, now >= w.budget)
            group = Group(KEY, make_round_id(KEY, ids, w.steps.to_bytes(8, "big")), tuple(members))
            outcome = await service.run(group, [flat], float(tokens))
            outcomes["committed" if outcome.committed else "aborted"] += 1
            await w.run(w.load_grads, flat[:-2])
            await w.run(w.apply, float(flat[-2]))
            if flat[-1] > 0:
                break
        w.maybe_snapshot(w.params, final=True)
    finally:
        await service.aclose()
        await host.aclose()
    return {"allreduce_rounds": outcomes}


async def run_strategy(w: Worker) -> dict[str, Any]:
    """DiLoCo, Streaming DiLoCo or NoLoCo with the daemon's options (H set, and the
    arm's own, e.g. its codec)."""
    arm = w.spec["arm"]
    host = await start_host(w)
    boot_file = w.run_dir / "bootstrap"
    if w.rank == 0:
        boot = []
        boot_file.write_text(str(host.addresses()[0]))
    else:
        boot = [await asyncio.to_thread(wait_file, boot_file)]
    dht = await DHTNode.create(host, bootstrap=boot)
    options = {"inner_steps": w.spec["inner_steps"], **w.spec.get("options", {})}
    strategy = make_strategy(arm, dht, KEY, w.params, options)
    rounds: dict[str, int] = {}
    reset_inner = w.spec.get("inner_state", "carry") == "reset"

    def shipped() -> list[torch.Tensor]:
        if arm == "diloco":
            return list(strategy.globals)  # type: ignore[attr-defined]
        if arm == "streaming":
            return streaming_globals(strategy)
        return w.params

    try:
        await strategy.start(join=False)
        await asyncio.to_thread(w.ready_and_wait)
        tally_at_start = host.bytes_sent_by_protocol()
        while w.elapsed() < w.budget:
            w.maybe_snapshot(shipped())
            tokens = await w.run(w.forward_backward)
            await w.run(w.apply, w.elapsed())
            reports = await strategy.after_inner_step(tokens)
            for report in reports:
                rounds[report.outcome.value] = rounds.get(report.outcome.value, 0) + 1
            if reset_inner and changes_the_model(reports):
                w.optimizer.state.clear()  # (as the daemon's `inner_state` "reset")
        w.maybe_snapshot(shipped(), final=True)
        outer_steps = strategy.outer_steps
        sent_by_protocol = {
            protocol: sent - tally_at_start.get(protocol, 0)
            for protocol, sent in host.bytes_sent_by_protocol().items()
        }
    finally:
        await strategy.aclose()
        await dht.aclose()
        await host.aclose()
    return {"rounds": rounds, "outer_steps": outer_steps, "sent_by_protocol": sent_by_protocol}


def main(spec_path: str) -> None:
    # (SHOAL_WAN_LOG=INFO: each round's and re-sync's story in the run directory's
    # log-RANK.txt, kept with --keep.)
    logging.basicConfig(
        level=os.environ.get("SHOAL_WAN_LOG", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)  # the peers share the machine's cores
    torch.manual_seed(spec["rank"])
    w = Worker(spec)
    if spec["arm"] == "gloo":
        extra = run_gloo(w)
    else:
        import uvloop

        coro = run_shoal_dp(w) if spec["arm"] == "shoal_dp" else run_strategy(w)
        extra = uvloop.run(coro)
    w.save(extra)
    w.executor.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
