"""How a sparse codec's outer round should combine the peers' messages, without a network.

    python bench/sparse_outer.py [DATA] [--peers 4] [--inner-steps 50] [--rounds 20]
        [--variants int8,sparse,...] [--data-seed 0] [--task-config JSON]

Simulates DiLoCo's outer rounds in one process, step for step what bench/wan.py's
peers do (the built-in bytegpt task, each peer on its own shard, AdamW with
warmup, cosine decay and clipping, the same inner lr), but with every round
committing at once and no link in between: so the arms differ only in how a
round turns the peers' pseudo-gradients into the outer step. The codecs are the
product's own (`Int8BlockCodec`, `SparseCodec` through `ErrorFeedback`).

Variants (comma-separated, each `name` or `name:key=value/key=value`):

- ``int8``: the dense baseline (each pseudo-gradient coded in int8, averaged, the
  mean coded again as the butterfly's owners do), outer Nesterov 0.9, lr 0.7;
- ``sparse``: a sparse codec with error feedback, the product's options written
  `sparse:key=value/key=value`: `kind` (topk, dct), `density`, `bits`, `chunk`,
  `decay` (`codec_feedback_decay`, 1: none), `mean` (`codec_mean`: ``members``, the
  members' weighted mean, or ``senders``, per coordinate the mean over the members
  that sent it, SparseLoCo's `scatter_reduce(mean)`), `lr` (outer lr, 1) and
  `momentum` (0);
- either, with ``overlap=K``: a round's result arrives K inner steps after the
  round began, and the steps taken meanwhile stay, moved onto the new global
  parameters (DiLoCo's ``overlap_steps``).

Prints one JSON object: each variant's validation loss after every round and at
the end, the ratio of its final loss to the first variant's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import ARM_TUNING, DEFAULT_DATA, MODEL_SEED, forward_backward

from shoal.averaging.compression import get_codec
from shoal.averaging.diloco_options import DEFAULT_CHUNKS
from shoal.averaging.error_feedback import ErrorFeedback
from shoal.averaging.sparse_codec import SparseCodec
from shoal.peer.training.task import load_task


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = text.partition(":")
    opts: dict[str, Any] = {}
    for item in filter(None, rest.split("/")):
        key, _, value = item.partition("=")
        opts[key] = value if key in ("mean", "kind") else float(value)
    return name, opts


class SimPeer:
    """One peer's model, inner optimizer and data shard."""

    def __init__(self, task: Any, rank: int, peers: int, args: argparse.Namespace) -> None:
        self.task = task
        self.model = task.make_model(MODEL_SEED)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(
            self.params, lr=args.inner_lr, weight_decay=0.1, betas=(0.9, 0.95)
        )
        self.batches = task.batches(rank, peers, seed=rank + 1000 * args.data_seed)
        self.losses: list[float] = []

    def inner_steps(self, count: int, lrs: list[float]) -> None:
        for lr in lrs[:count]:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            forward_backward(self.task, self.model, self.optimizer, self.batches, self.losses)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def load(self, flat: torch.Tensor) -> None:
        flat_into(self.model, flat)


def schedule(total: int, peak: float, warmup_frac: float = 0.1, floor: float = 0.1) -> list[float]:
    out = []
    for i in range(total):
        frac = i / total
        if frac < warmup_frac:
            out.append(peak * max(frac / warmup_frac, 1e-3))
        else:
            done = (frac - warmup_frac) / (1 - warmup_frac)
            out.append(peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))))
    return out


def int8_round(deltas: list[torch.Tensor]) -> torch.Tensor:
    codec = get_codec("int8")
    coded = []
    for d in deltas:
        out = torch.empty_like(d)
        codec.decode(codec.encode(d), out)
        coded.append(out)
    mean = torch.stack(coded).mean(0)
    out = torch.empty_like(mean)
    codec.decode(codec.encode(mean), out)
    return out


class SparseRound:
    """A sparse round as the product's members compute it (`ErrorFeedback`, then
    `SparseGather.mean_into`'s arithmetic), every member of equal weight."""

    def __init__(self, peers: int, n: int, opts: dict[str, Any]) -> None:
        self.codec = SparseCodec.from_density(
            kind := str(opts.get("kind", "topk")), int(opts.get("chunk", DEFAULT_CHUNKS[kind])),
            float(opts.get("density", 0.015625)), int(opts.get("bits", 2)),
        )  # fmt: skip
        decay = float(opts.get("decay", 1.0))
        self.feedback = [ErrorFeedback(self.codec, n, decay=decay) for _ in range(peers)]
        self.mean = str(opts.get("mean", "members"))
        self.n = n

    def __call__(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        messages = []
        for fb, d in zip(self.feedback, deltas, strict=True):
            messages.append(self.codec.check(fb.compress(d.clone()), self.n))
            fb.commit()
        share = 1.0 / len(messages)
        out = torch.zeros(self.n)
        if self.mean == "senders":
            sums, sent = torch.zeros(self.n), torch.zeros(self.n)
            for m in messages:
                self.codec.add_sent(m, sums, sent, share, share)
            self.codec.senders_mean_into(sums, sent, out)
        else:
            for m in messages:
                self.codec.add_decoded(m, out, share)
        return out


def run_variant(task: Any, name: str, opts: dict[str, Any], args: argparse.Namespace) -> dict:
    peers = [SimPeer(task, r, args.peers, args) for r in range(args.peers)]
    total = args.inner_steps * args.rounds
    lrs = schedule(total, args.inner_lr)
    global_params = peers[0].flat().clone()
    momentum = torch.zeros_like(global_params)
    if name == "int8":
        combine: Any = int8_round
        outer_lr, mu = opts.get("lr", 0.7), opts.get("momentum", 0.9)
    elif name == "sparse":
        combine = SparseRound(args.peers, global_params.numel(), opts)
        outer_lr, mu = opts.get("lr", 1.0), opts.get("momentum", 0.0)
    else:
        raise SystemExit(f"unknown variant {name!r}: int8 or sparse")
    evals = task.eval_batches(args.eval_batches)
    judge = task.make_model(MODEL_SEED)  # the global parameters, evaluated
    overlap = int(opts.get("overlap", 0))
    h = args.inner_steps
    if not 0 <= overlap < h:
        raise SystemExit(f"overlap must be in 0..{h - 1}")
    anchors: list[torch.Tensor] | None = None  # each peer's parameters when it sent
    curve = []
    for r in range(args.rounds):
        deltas = []
        for i, peer in enumerate(peers):
            lrs_now = lrs[r * h :]
            if anchors is None:
                peer.inner_steps(h, lrs_now)
            else:
                # The last round's result arrives `overlap` steps late: the steps taken
                # meanwhile stay, moved onto the new global parameters (DiLoCo's
                # overlap_steps).
                peer.inner_steps(overlap, lrs_now)
                peer.load(peer.flat() + (global_params - anchors[i]))
                peer.inner_steps(h - overlap, lrs_now[overlap:])
            deltas.append(global_params - peer.flat())
        if overlap:
            anchors = [peer.flat() for peer in peers]
        step = combine(deltas)
        # Nesterov as the product's nesterov_outer_step (momentum 0: plain SGD).
        momentum.mul_(mu).add_(step)
        global_params -= outer_lr * (step + mu * momentum if mu else step)
        if not overlap:
            for peer in peers:
                peer.load(global_params)
        flat_into(judge, global_params)
        curve.append(val_loss(task, judge, evals))
        print(f"{name} {opts} round {r + 1}: {curve[-1]:.4f}", file=sys.stderr)
    return {"options": opts, "curve": curve, "final_val_loss": curve[-1]}


def flat_into(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def val_loss(task: Any, model: torch.nn.Module, evals: list[Any]) -> float:
    model.eval()
    with torch.no_grad():
        value = sum(float(task.loss(model, b)) for b in evals) / len(evals)
    model.train()
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-lr", type=float, default=ARM_TUNING["diloco"].inner_lr)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--data-seed", type=int, default=0, help="another order of each shard")
    p.add_argument(
        "--variants",
        default="int8,sparse,sparse:decay=0.9/mean=senders,sparse:kind=dct/decay=0.9/mean=senders",
    )
    p.add_argument("--task-config", default='{"d_model": 128, "batch_size": 8}')
    args = p.parse_args()
    torch.set_num_threads(1)
    task = load_task("bytegpt", json.loads(args.task_config), data=args.data)
    t0 = time.monotonic()
    arms: dict[str, Any] = {}
    for text in args.variants.split(","):
        name, opts = parse_variant(text)
        arms[text] = run_variant(task, name, opts, args)
    first = next(iter(arms.values()))["final_val_loss"]
    for arm in arms.values():
        arm["ratio_to_first"] = arm["final_val_loss"] / first
    print(json.dumps({"arms": arms, "wall_s": time.monotonic() - t0, "settings": vars(args)},
                     default=str))  # fmt: skip


if __name__ == "__main__":
    main()
