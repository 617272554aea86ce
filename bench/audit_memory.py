"""What one audit holds beyond the reveal it checks, and the work log at its peak, in model sizes.

    python bench/audit_memory.py [--d-model 512] [--layers 4] [--segments 2]

A referee checks a reveal (4 model sizes with AdamW: the segment's start
parameters and moments, and its end parameters) by re-running the segment and
comparing two pseudo-gradients (`audit_round.check_segment`). This measures
the resident memory the check itself adds on top: each audit runs in a fresh
process on the daemon's task (bytegpt, a model of `--d-model` and `--layers`),
after one warm-up audit, with glibc returning large blocks at once (as a
memory-bounded peer does), from VmRSS before to the peak (VmHWM, reset through
/proc/self/clear_refs) during the check. Linux only.

Two ways are measured in the same run: `consume` (what the daemon's referee
does: the re-run steps the reveal's own moments) and `copy` (the re-run steps
copies, as for a reveal that is read again afterwards), for the first segment
of a round (the round's first steps: Adam's moments carried from the previous
round, or created) and the last.

The prover's side, in a fresh process too: a work log spilling to a folder, as
a daemon's (`WorkLog`, its 2 newest states in RAM, a state being the parameters
and Adam's moments: 3 model sizes), over 6 rounds of 5 inner steps with a
checkpoint every 2 (so each round also seals an end of its own); its peak over
what it held before the first round, against the 6 model sizes of its budget
(9 while a round's end is sealed: the commitment waits on that state, so what
is past the budget is written at the next round's begin, not before the seal).

Prints one JSON object:

    {"model_bytes": ..., "reveal_model_sizes": what the reveal held (4.0),
     "audit_peak_model_sizes": {"consume": {"first": x, "last": y}, "copy": {...}},
     "left_after_model_sizes": {...},
     "work_log_peak_model_sizes": ..., "work_log_budget_model_sizes": 6,
     "settings": {...}}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = str(Path(__file__).resolve())
NS, ROUND, SHARDS = "shoal/x/audit-memory", 3, 8


def _memory() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def measure(d_model: int, layers: int, segments: int, segment: int, consume: bool) -> dict:
    """One audit of `segment`, in this process."""
    import gc

    from shoal.peer.trainer import check_hyperparameters
    from shoal.peer.training.heap import release_free_memory, return_large_blocks_at_once
    from shoal.peer.training.task import load_task, shard_of
    from shoal.peer.verify.audit_round import check_segment
    from shoal.peer.verify.reveals import Replay, reveal_of
    from shoal.peer.verify.segments import SegmentRunner, round_batch_seed
    from shoal.peer.verify.work_log import WorkLog
    from shoal.transport.identity import Identity
    from shoal.verification.audit import AuditPolicy

    sys.path.insert(0, str(Path(SCRIPT).parent.parent / "tests"))
    from verification_round import audited_round

    return_large_blocks_at_once()
    task = load_task("bytegpt", {"d_model": d_model, "n_layers": layers, "n_heads": 8,
                                 "context": 16, "batch_size": 1})  # fmt: skip
    hyper = check_hyperparameters({"warmup_steps": 0})
    me = Identity.from_seed(hashlib.sha256(b"prover").digest())
    every = 2
    log = WorkLog(every, retain_bytes=1 << 40)
    prover = SegmentRunner(task, hyper)
    model, inner = prover.model, prover.inner
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = shard_of(me.peer_id.to_bytes(), SHARDS)
    batch = next(task.batches(shard, SHARDS, round_batch_seed(NS, me.peer_id, ROUND - 1)))
    # A step of the round before: Adam's moments are carried into this one, as in a daemon.
    inner.step(lambda m=model, b=batch: task.loss(m, b), 39)
    stream = task.batches(shard, SHARDS, round_batch_seed(NS, me.peer_id, ROUND))
    log.begin(ROUND, 40, model, inner)
    for i in range(segments * every):
        batch = next(stream)
        inner.step(lambda m=model, b=batch: task.loss(m, b), 40 + i)
        log.after_step(model, inner, int(task.batch_tokens(batch)))
    work = log.seal(model, inner)
    c, verified, rnd = audited_round(log, work, me, list(model.parameters()), namespace=NS,
                                     shards=SHARDS)  # fmt: skip
    replay = Replay(SegmentRunner(task, hyper), task, verified, SHARDS)
    first, end = c.segment_bounds(segment)

    def received():  # type: ignore[no-untyped-def]
        """The reveal as a referee holds it: its own copy, as read from the wire."""
        import copy

        return copy.deepcopy(reveal_of(replay.state_after(work, first),
                                       replay.state_after(work, end)))  # fmt: skip

    referee = SegmentRunner(task, hyper)
    policy = AuditPolicy()
    warm = check_segment(referee, task, SHARDS, NS, rnd, c, segment, received(), b"s", policy)
    reveal = received()
    assert reveal.start is not None
    held = sum(t.numel() * t.element_size() for t in [*reveal.start.params, *reveal.end_params])
    for per_param in reveal.start.optimizer["optimizer"]["state"].values():
        held += sum(v.numel() * v.element_size() for v in per_param.values() if v.dim())
    del prover, model, inner, stream, batch
    gc.collect()
    release_free_memory()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before, _ = _memory()
    # (`consume` only when asked: this file then measures code from before it too)
    finding = check_segment(referee, task, SHARDS, NS, rnd, c, segment, reveal, b"s", policy,
                            **({"consume": True} if consume else {}))  # fmt: skip
    after, peak = _memory()
    assert finding.result.value == "pass" and warm.result.value == "pass", finding
    return {
        "model_bytes": size,
        "reveal": held / size,
        "peak": (peak - before) / size,
        "left": (after - before) / size,
    }


def measure_work_log(d_model: int, layers: int, rounds: int = 6) -> dict:
    """A spilling work log's peak over `rounds` rounds, in this process."""
    import tempfile

    from shoal.peer.trainer import check_hyperparameters
    from shoal.peer.training.heap import release_free_memory, return_large_blocks_at_once
    from shoal.peer.training.task import load_task
    from shoal.peer.verify.segments import SegmentRunner
    from shoal.peer.verify.work_log import DEFAULT_MEMORY_STATES, WorkLog

    return_large_blocks_at_once()
    task = load_task("bytegpt", {"d_model": d_model, "n_layers": layers, "n_heads": 8,
                                 "context": 16, "batch_size": 1})  # fmt: skip
    runner = SegmentRunner(task, check_hyperparameters({"warmup_steps": 0}))
    model, inner = runner.model, runner.inner
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    stream = task.batches(0, 1, 1)
    step = 0

    def train_step() -> None:
        nonlocal step
        batch = next(stream)
        inner.step(lambda m=model, b=batch: task.loss(m, b), step)
        step += 1

    train_step()  # Adam's moments exist before the first round, as in a daemon
    with tempfile.TemporaryDirectory() as folder:
        log = WorkLog(2, spill_dir=Path(folder) / "work-log", retain_s=0)
        release_free_memory()
        Path("/proc/self/clear_refs").write_text("5")
        before, _ = _memory()
        for r in range(rounds):
            log.begin(r, step, model, inner)
            for _ in range(5):
                train_step()
                log.after_step(model, inner, 16)
            log.seal(model, inner)
        _, peak = _memory()
    return {"peak": (peak - before) / size, "budget": 3 * DEFAULT_MEMORY_STATES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--segments", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("SEGMENT", "WAY"), help=argparse.SUPPRESS)
    parser.add_argument("--work-log", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.work_log:
        print(json.dumps(measure_work_log(opts.d_model, opts.layers)))
        return
    if opts.one:
        segment, way = int(opts.one[0]), opts.one[1]
        print(json.dumps(measure(opts.d_model, opts.layers, opts.segments, segment,
                                 way == "consume")))  # fmt: skip
        return
    peaks: dict[str, dict[str, float]] = {}
    left: dict[str, dict[str, float]] = {}
    model_bytes, reveal = 0, 0.0
    for way in ("consume", "copy"):
        for name, segment in (("first", 0), ("last", opts.segments - 1)):
            out = subprocess.run(
                [sys.executable, SCRIPT, "--d-model", str(opts.d_model), "--layers",
                 str(opts.layers), "--segments", str(opts.segments), "--one", str(segment), way],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            result: dict[str, Any] = json.loads(out.stdout)
            model_bytes, reveal = result["model_bytes"], result["reveal"]
            peaks.setdefault(way, {})[name] = round(result["peak"], 2)
            left.setdefault(way, {})[name] = round(result["left"], 2)
    out = subprocess.run(
        [sys.executable, SCRIPT, "--d-model", str(opts.d_model), "--layers", str(opts.layers),
         "--work-log"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    work_log = json.loads(out.stdout)
    print(json.dumps({
        "model_bytes": model_bytes,
        "reveal_model_sizes": round(reveal, 3),
        "audit_peak_model_sizes": peaks,
        "left_after_model_sizes": left,
        "work_log_peak_model_sizes": round(work_log["peak"], 2),
        "work_log_budget_model_sizes": work_log["budget"],
        "settings": {"task": "bytegpt", "d_model": opts.d_model, "layers": opts.layers,
                     "segments": opts.segments, "optimizer": "AdamW"},
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
