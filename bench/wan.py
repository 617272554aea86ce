"""Time to loss over shaped internet links: data parallel against low-communication training.

    sudo python bench/wan.py [DATA] [--rate-mbit 50] [--delay-ms 25] [--budget-s 180]
        [--arms gloo,shoal_dp,diloco,streaming,noloco] [--peers 4] [--plot bench/wan.png]

Four peers, each in its own network namespace behind a shaped access link (bench/
wan_lab.py: `--rate-mbit` up and down per peer, `--delay-ms` one way between any two
peers), train the convergence benchmark's model on its data (bench/convergence.py:
bytegpt at d_model 32, 32 windows of 128 bytes per step and peer, each peer its own
shard, AdamW, clipping) for the same wall-clock budget per arm:

- ``gloo``: synchronous data parallel with torch.distributed's gloo all-reduce, what
  a user would otherwise pick;
- ``shoal_dp``: the same through shoal's fault-tolerant all-reduce;
- ``diloco``, ``streaming``, ``noloco``: the outer strategies with the daemon's
  default options (H = `--inner-steps`);
- ``diloco_third``: DiLoCo given a third of the budget (its lr schedule annealed
  within it), which says whether DiLoCo reaches the target in a third of the time;
- ``diloco_int8``, ``diloco_sparse``, ``diloco_dct``: DiLoCo with the pseudo-gradients
  coded int8, or sparse with error feedback (codec topk or dct, the default density
  and bits), its messages gathered (averaging/sparse_gather.py).
- ``streaming_int4``: Streaming DiLoCo with its fragments' outer gradients in 4 bits
  (the paper's setting; ``streaming`` is int8).

The outer arms take the options a daemon records for a new experiment under `--verify
auto` (the peers themselves do not audit): a dense DiLoCo arm the verified defaults (no
overlapped rounds), a sparse one the unverified defaults (`overlap_steps` H - 1);
``--options 'diloco_int8={"verify": false}'`` gives a dense arm the unverified ones.

``ARM:LABEL`` in `--arms` runs a variant of ARM with its own `--options` (for two
settings of one arm side by side in one run: ``--arms diloco_sparse,diloco_sparse:h10
--options 'diloco_sparse:h10={"inner_steps": 10}'``). One key of `--options` is the
inner loop's, not the strategy's: ``"inner_state": "reset"`` starts the inner AdamW
afresh at each new global state, as the daemon's hyperparameter of that name does.

Every arm's JSON says its `codec` and `bytes_per_round`: the bytes one peer's link
sent per round (outer round; a step for data parallel; a fragment's round for
Streaming DiLoCo), from the links' counters, averaged over the peers; the outer
strategies' arms add `bytes_per_round_by_protocol` (the hosts' tallies of stream
payload by protocol: what a round's bytes are for).

Every `--snapshot-s` each peer keeps a copy of the model its arm would ship (the
global parameters for DiLoCo and Streaming DiLoCo, every replica for NoLoCo, the
replica for data parallel) with the bytes its link carried. After the runs, the
snapshots' validation loss (the task's held-out batches, as in bench/convergence.py)
gives the curves. The target is gloo data parallel's final validation loss.

Prints one JSON object on stdout (progress goes to stderr):

    {"target_val_loss": ..., "arms": {ARM: {"final_val_loss", "tail_val_loss" (the mean
     over the last 30 s), "time_to_target_s", "bytes", "steps",
     "curve": [{"t", "val_loss", "bytes"}, ...], ...}},
     "diloco_time_to_target_fraction": ..., "diloco_third_budget_val_loss": ...,
     "diloco_reaches_target_in_a_third": ..., "diloco_ends_lower": ...,
     "diloco_meets_targets": ..., "settings": {...}}

and then writes a PNG (`--plot`) of validation loss against wall-clock time and against
bytes sent (with the optional `bench` extra, matplotlib; without it `"plot"` is null).
`bytes` are what the peers' links sent (IP packets, every protocol). Each peer's log is
the run directory's `log-RANK.txt` (kept with `--keep`; `SHOAL_WAN_LOG=INFO` logs each
round and re-sync there).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import ARM_TUNING, DEFAULT_DATA, MODEL_SEED, TASK_CONFIG
from wan_lab import WanLab

from shoal.averaging.options import SPARSE_CODEC_NAMES
from shoal.averaging.outer import DEFAULT_OPTIONS
from shoal.averaging.registry import can_verify, schema_of
from shoal.peer.training.task import load_task

ARMS = (
    "gloo",
    "shoal_dp",
    "diloco",
    "streaming",
    "noloco",
    "diloco_third",
    "diloco_int8",
    "diloco_sparse",
    "diloco_dct",
    "streaming_int4",
)
# Arms of a strategy with another codec than its default one: arm -> (strategy, codec).
CODEC_ARMS = {
    "diloco_int8": ("diloco", "int8"),
    "diloco_sparse": ("diloco", "topk"),
    "diloco_dct": ("diloco", "dct"),
    "streaming_int4": ("streaming", "int4"),
}
# `diloco_third`: DiLoCo given a third of the budget, its schedule annealed within it:
# the other reading of "reaches the loss in a third of the time" (the full-budget
# curve at a third has its lr still high). Either reading meets the target.
SHORT_ARMS = {"diloco_third": ("diloco", 3.0)}  # arm -> (strategy, budget divisor)
WORKER = Path(__file__).resolve().with_name("wan_worker.py")
# Each arm's peak inner lr as tuned by bench/convergence.py (data parallel: its baseline).
PEAK_LR = {
    "gloo": ARM_TUNING["baseline"].inner_lr,
    "shoal_dp": ARM_TUNING["baseline"].inner_lr,
    "diloco": ARM_TUNING["diloco"].inner_lr,
    "streaming": ARM_TUNING["streaming"].inner_lr,
    "noloco": ARM_TUNING["noloco"].inner_lr,
    "diloco_third": ARM_TUNING["diloco"].inner_lr,
    **{arm: ARM_TUNING[strategy].inner_lr for arm, (strategy, _) in CODEC_ARMS.items()},
}


def progress(message: str, *args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] " + message % args, file=sys.stderr, flush=True)


def base_arm(arm: str) -> str:
    """`diloco_sparse:h10` is a variant of `diloco_sparse` (its own `--options`), so
    that two settings of one arm run side by side in one run."""
    return arm.partition(":")[0]


def new_experiment_options(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a daemon records for a new experiment of `strategy` with `options`
    under `--verify auto`: a dense experiment of a strategy that can verify is verified
    there, so it takes the verified defaults (no overlapped rounds); a sparse one is
    not. The arm's own peers do not audit (verification's cost is
    bench/verification_swarm.py's), so `verify` is not passed on to them."""
    schema = schema_of(strategy, outer=True)
    verified = (
        "verify" not in options
        and options.get("codec") not in SPARSE_CODEC_NAMES
        and can_verify(strategy)
    )
    new = schema.for_new_experiment({**options, "verify": True} if verified else options)
    if verified:
        del new["verify"]
    return new


def run_arm(arm: str, lab: WanLab, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    """Start the arm's peers in their namespaces, start them together, collect results."""
    run_dir.mkdir(parents=True)
    variant, arm = arm, base_arm(arm)
    strategy, divisor = SHORT_ARMS.get(arm, (arm, 1.0))
    options: dict[str, Any] = {}
    if arm in CODEC_ARMS:
        strategy, codec = CODEC_ARMS[arm]
        options = {"codec": codec}
    options.update(args.options.get(variant, {}))
    # (The trainer's, not the strategy's: `"inner_state": "reset"` starts Adam afresh
    # at each new global state, as the daemon's hyperparameter does.)
    inner_state = options.pop("inner_state", "carry")
    if strategy not in {"gloo", "shoal_dp"}:  # (as a daemon hosts a new experiment)
        options = new_experiment_options(strategy, options)
    budget = args.budget_s / divisor
    procs = []
    for rank in range(args.peers):
        spec = {
            "arm": strategy,
            "rank": rank,
            "peers": args.peers,
            "addresses": [lab.address(k) for k in range(args.peers)],
            "run_dir": str(run_dir),
            "budget_s": budget,
            "snapshot_s": args.snapshot_s,
            "inner_steps": args.inner_steps,
            "options": options,
            "inner_state": inner_state,
            "data": str(args.data.resolve()),
            "task_config": json.loads(args.task_config),
            "tuning": {"inner_lr": args.lr[arm], "warmup_frac": args.warmup_frac},
            "min_lr": args.min_lr,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
        }
        path = run_dir / f"spec-{rank}.json"
        path.write_text(json.dumps(spec))
        log = open(run_dir / f"log-{rank}.txt", "wb")  # noqa: SIM115 (closed with the process)
        cmd = ["ip", "netns", "exec", lab.ns(rank), sys.executable, str(WORKER), str(path)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=log), log))
    try:
        wait_ready(run_dir, args.peers, procs)
        (run_dir / "go").write_text(repr(time.monotonic() + 0.5))
        for proc, _ in procs:
            # A data-parallel step may end well past the budget (a 25M model's at 10
            # Mbit/s takes about 2 minutes).
            proc.wait(timeout=budget * 1.5 + 180)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    failed = [k for k, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = (run_dir / f"log-{failed[0]}.txt").read_text()[-3000:]
        raise RuntimeError(f"{arm}: peers {failed} failed:\n{tail}")
    results = [torch.load(run_dir / f"result-{k}.pt") for k in range(args.peers)]
    if base_arm(arm) != "noloco":
        # Only rank 0's snapshots are evaluated (`curve`): the others' parameters would
        # hold every arm's models in memory until the end (a 25M model's 900 s at 60-s
        # snapshots is 6.4 GB an arm; three such arms ran this machine out of memory).
        for r in results[1:]:
            for snapshot in r["snapshots"]:
                snapshot.pop("params", None)
    return results


def wait_ready(run_dir: Path, peers: int, procs: list[Any], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((run_dir / f"ready-{k}").exists() for k in range(peers)):
        for k, (proc, _) in enumerate(procs):
            if proc.poll() is not None:
                tail = (run_dir / f"log-{k}.txt").read_text()[-3000:]
                raise RuntimeError(f"peer {k} exited during setup:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError("peers did not get ready")
        time.sleep(0.1)


# ---------------------------------------------------------------------- evaluation


def curve(task: Any, results: list[dict], evals: list[Any], per_replica: bool) -> list[dict]:
    """Validation loss and bytes sent (all peers) at each snapshot index every peer has."""
    model = task.make_model(MODEL_SEED)
    model.eval()

    def loss_of(tensors: list[torch.Tensor]) -> float:
        with torch.no_grad():
            for p, t in zip(model.parameters(), tensors, strict=True):
                p.copy_(t)
            return sum(float(task.loss(model, b)) for b in evals) / len(evals)

    count = min(len(r["snapshots"]) for r in results)
    points = []
    for i in range(count):
        snaps = [r["snapshots"][i] for r in results]
        replicas = snaps if per_replica else snaps[:1]
        val = sum(loss_of(s["params"]) for s in replicas) / len(replicas)
        points.append({
            "t": round(max(s["t"] for s in snaps), 2),
            "val_loss": val,
            "bytes": sum(
                s["sent"] - r["snapshots"][0]["sent"] for s, r in zip(snaps, results, strict=True)
            ),
            "steps": snaps[0]["steps"],
        })  # fmt: skip
    return points


# `tail_val_loss`: the mean over the budget's last this many seconds. A DiLoCo arm's
# globals jump at each commit, so the final snapshot depends on where the last commit
# fell (int8 at H = 50 commits every 6-7 s; a sparse arm every 2); the tail's mean
# compares arms at the same phase of their curves.
TAIL_S = 30.0


def tail_mean(points: list[dict], seconds: float) -> float:
    """The mean validation loss of the snapshots in the curve's last `seconds`."""
    end = points[-1]["t"]
    tail = [p["val_loss"] for p in points if p["t"] >= end - seconds]
    return sum(tail) / len(tail)


def time_to(points: list[dict], target: float) -> float | None:
    """When the curve first reached `target` (linear between snapshots), or None."""
    for a, b in itertools.pairwise(points):
        if b["val_loss"] <= target:
            if a["val_loss"] <= target:
                return a["t"]
            frac = (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            return round(a["t"] + frac * (b["t"] - a["t"]), 2)
    return None


def codec_of(arm: str) -> str:
    """How the arm's peers code what they exchange."""
    arm = base_arm(arm)
    if arm in CODEC_ARMS:
        return CODEC_ARMS[arm][1]
    strategy = SHORT_ARMS.get(arm, (arm, 1.0))[0]
    if strategy in ("gloo", "shoal_dp"):
        return "none"
    return str(DEFAULT_OPTIONS[strategy]["codec"])


def bytes_per_round(results: list[dict]) -> float | None:
    """Bytes one peer's link sent per round (outer round, or data-parallel step),
    averaged over the peers."""
    per_peer = []
    for r in results:
        rounds = sum(r["rounds"].values()) if "rounds" in r else r["steps"]
        sent = r["snapshots"][-1]["sent"] - r["snapshots"][0]["sent"]
        if rounds:
            per_peer.append(sent / rounds)
    return sum(per_peer) / len(per_peer) if per_peer else None


def bytes_per_round_by_protocol(results: list[dict]) -> dict[str, float] | None:
    """`bytes_per_round` split by the protocol of the streams that carried it (the
    hosts' own tallies of stream payload: without headers, encryption and handshakes,
    so the parts sum to a little less than the links' counters)."""
    per_peer = []
    for r in results:
        rounds = sum(r.get("rounds", {}).values())
        if rounds and r.get("sent_by_protocol"):
            per_peer.append({p: sent / rounds for p, sent in r["sent_by_protocol"].items()})
    if not per_peer:
        return None
    protocols = sorted({p for tally in per_peer for p in tally})
    return {p: round(sum(t.get(p, 0) for t in per_peer) / len(per_peer)) for p in protocols}


def summarize(task: Any, raw: dict[str, list[dict]], args: argparse.Namespace) -> dict[str, Any]:
    evals = task.eval_batches(args.eval_batches)
    arms: dict[str, dict[str, Any]] = {}
    for arm, results in raw.items():
        points = curve(task, results, evals, per_replica=base_arm(arm) == "noloco")
        # (not "steps": rank 0's count would replace every peer's)
        skip = ("snapshots", "rank", "steps", "sent_by_protocol")
        extra = {k: v for k, v in results[0].items() if k not in skip}
        arms[arm] = {
            "final_val_loss": points[-1]["val_loss"],
            "tail_val_loss": tail_mean(points, TAIL_S),
            "bytes": points[-1]["bytes"],
            "codec": codec_of(arm),
            "bytes_per_round": bytes_per_round(results),
            "bytes_per_round_by_protocol": bytes_per_round_by_protocol(results),
            "steps": [r["steps"] for r in results],
            **extra,
            "curve": points,
        }
    target = arms["gloo"]["final_val_loss"] if "gloo" in arms else None
    out: dict[str, Any] = {"target_val_loss": target}
    for a in arms.values():
        a["time_to_target_s"] = None if target is None else time_to(a["curve"], target)
    if target is not None and "diloco" in arms:
        reach = arms["diloco"]["time_to_target_s"]
        out["diloco_time_to_target_fraction"] = None if reach is None else reach / args.budget_s
        out["diloco_ends_lower"] = arms["diloco"]["final_val_loss"] < target
        in_a_third = reach is not None and reach <= args.budget_s / 3
        if "diloco_third" in arms:
            third = arms["diloco_third"]["final_val_loss"]
            out["diloco_third_budget_val_loss"] = third
            in_a_third = in_a_third or third <= target
        out["diloco_reaches_target_in_a_third"] = in_a_third
        out["diloco_meets_targets"] = bool(in_a_third and out["diloco_ends_lower"])
    out["arms"] = arms
    return out


NO_PLOT = "matplotlib is missing (pip install -e '.[bench]'): the JSON only, no plot"


def can_plot() -> bool:
    """Whether the optional `bench` extra (matplotlib) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def model_label(result: dict[str, Any], args: argparse.Namespace) -> str:
    """The model in the plot's title: its width, and its depth and size when known
    (runs at several sizes share the width)."""
    model = result.get("settings", {}).get("model") or json.loads(args.task_config)
    label = f"d_model {model.get('d_model', '?')}"
    if "n_layers" in model:
        label += f" x {model['n_layers']} layers"
    if "parameters" in model:
        label += f" ({model['parameters'] / 1e6:.2g}M params)"
    return label


def plot(result: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    if not can_plot():
        raise SystemExit(NO_PLOT)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, a in result["arms"].items():
        xs = [p["t"] for p in a["curve"]]
        ys = [p["val_loss"] for p in a["curve"]]
        by_time.plot(xs, ys, label=arm)
        by_bytes.plot([p["bytes"] / 1e6 for p in a["curve"]], ys, label=arm)
    if result["target_val_loss"] is not None:
        for ax in (by_time, by_bytes):
            ax.axhline(result["target_val_loss"], color="grey", ls=":", lw=1, label="target")
    by_time.set(xlabel="wall-clock (s)", ylabel="validation loss (nats/byte)")
    by_bytes.set(xlabel="MB sent by all peers (log above 0.1 MB)")
    by_bytes.set_xscale("symlog", linthresh=0.1)
    by_bytes.set_xlim(left=0)
    link = f"{args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one way"
    by_time.set_title(f"{args.peers} peers, {link}, {model_label(result, args)}")
    by_bytes.set_title("validation loss against bytes sent")
    for ax in (by_time, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA)
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"comma-separated subset of {ARMS}; ARM:LABEL runs a variant of "
                        "ARM with its own --options (e.g. diloco_sparse:h10)")  # fmt: skip
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=50.0, help="each peer's link, each way")
    p.add_argument("--delay-ms", type=float, default=25.0, help="one way, between two peers")
    p.add_argument("--budget-s", type=float, default=180.0, help="wall-clock per arm")
    p.add_argument("--snapshot-s", type=float, default=6.0)
    p.add_argument("--inner-steps", type=int, default=50, help="H of the outer strategies")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="of the budget")
    p.add_argument("--min-lr", type=float, default=0.1, help="cosine floor, fraction of peak")
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--task-config", default=json.dumps(TASK_CONFIG))
    p.add_argument("--plot", type=Path, default=Path(__file__).resolve().with_name("wan.png"))
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="only draw --plot from a result this benchmark printed")  # fmt: skip
    for arm in ARMS:
        p.add_argument(f"--{arm.replace('_', '-')}-lr", type=float, default=PEAK_LR[arm])
    p.add_argument(
        "--options",
        action="append",
        default=[],
        metavar="ARM=JSON",
        help='an arm\'s strategy options, e.g. diloco_sparse={"outer_momentum": 0}',
    )
    args = p.parse_args(argv)
    options: dict[str, dict[str, Any]] = {}
    for item in args.options:
        arm, _, text = item.partition("=")
        if base_arm(arm) not in ARMS or not isinstance(value := json.loads(text or "null"), dict):
            p.error(f"--options takes ARM=JSON object, got {item!r}")
        options[arm] = value
    args.options = options
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := {base_arm(a) for a in args.arms} - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}")
    if len(set(args.arms)) != len(args.arms):
        p.error("an arm named twice (ARM:LABEL names a variant)")
    args.lr = {arm: getattr(args, f"{base_arm(arm)}_lr") for arm in [*ARMS, *args.arms]}
    return args


def main(args: argparse.Namespace) -> dict[str, Any]:
    began = time.monotonic()
    torch.set_num_threads(1)  # (2 threads beside busy processes run 10x slower here)
    task = load_task("bytegpt", json.loads(args.task_config), data=args.data.resolve())
    n_params = sum(p.numel() for p in task.make_model(MODEL_SEED).parameters())
    run_root = Path(tempfile.mkdtemp(prefix="shoal-wan-"))
    raw: dict[str, list[dict]] = {}
    with WanLab(args.peers, rate_mbit=args.rate_mbit, delay_ms=args.delay_ms) as lab:
        lab.wait_reachable()
        for arm in args.arms:
            budget = args.budget_s / SHORT_ARMS.get(base_arm(arm), (arm, 1.0))[1]
            progress("arm %s: %d peers, %.0f s", arm, args.peers, budget)
            raw[arm] = run_arm(arm, lab, args, run_root / arm)
            progress("arm %s: steps %s", arm, [r["steps"] for r in raw[arm]])
    progress("evaluating the snapshots")
    result = summarize(task, raw, args)
    if not args.keep:
        subprocess.run(["rm", "-rf", str(run_root)], check=False)
    result["plot"] = str(args.plot) if can_plot() else None
    result["settings"] = {
        "model": task.config() | {"parameters": n_params},
        "data": str(args.data),
        **{k: v for k, v in vars(args).items() if k not in ("data", "plot", "arms")},
        "arms": args.arms,
        "cpus": os.cpu_count(),
    }
    result["wall_s"] = round(time.monotonic() - began, 1)
    return result


if __name__ == "__main__":
    parsed = parse()
    if parsed.replot is not None:
        saved = json.loads(parsed.replot.read_text())
        plot(saved, parsed.plot, argparse.Namespace(**{**vars(parsed), **saved["settings"]}))
    else:
        if not can_plot():
            progress("%s", NO_PLOT)
        finished = main(parsed)
        # The JSON first: a finished run outlives any failure of the optional plot.
        print(json.dumps(finished), flush=True)
        if finished["plot"] is not None:
            plot(finished, parsed.plot, parsed)
