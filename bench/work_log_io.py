"""What the work log's states cost a verifying peer to write and to read back.

    python bench/work_log_io.py [--task-config '{"d_model": 128}'] [--states 40] [--threads 1]

A verified daemon captures its parameters and inner-optimizer state every
`audit_segment_steps` inner steps (3) and writes the states past the newest two
to `<data dir>/work-log/` (`peer/verify/work_log.py`); a reveal reads them back.
This times, in CPU milliseconds per state of the built-in task at the given
size: the product's writes and reads (`averaging/state_file.py`, through
`SpillDir` and `Spilled.load`, the digest check included) against `torch.save`
and `torch.load(mmap=True, weights_only=True)` of the same state (what the work
log used before), alternating the two `--rounds` times; the capture and the
digest every state costs either way; and one inner step, so that each cost is
also given as a share of the inner steps a state covers.

Prints one JSON object: {"state_bytes", "inner_step_ms", "capture_ms",
"digest_ms", "write_ms": {"state_file", "torch_save", "ratio"}, "read_ms": {...},
"per_segment_share": {"state_file", "torch_save"}: (capture + digest + write) /
(3 inner steps), "settings"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shoal.peer.trainer import DEFAULT_HYPERPARAMETERS
from shoal.peer.training.inner import InnerOptimizer
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.peer.verify.segments import SegmentState, capture
from shoal.peer.verify.spill import SpillDir, Spilled

SEGMENT_STEPS = 3


def cpu_ms(fn: Callable[[], Any], n: int) -> float:
    """CPU milliseconds per call of `fn`, the median of `n` calls."""
    times = []
    for _ in range(n):
        t = time.process_time()
        fn()
        times.append((time.process_time() - t) * 1e3)
    return statistics.median(times)


def torch_save_write(folder: Path, state: SegmentState, i: int) -> Path:
    path = folder / f"s{i}.pt"
    torch.save({"params": state.params, "optimizer": state.optimizer}, path)
    return path


def torch_load_read(path: Path, digest: bytes) -> None:
    raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    assert SegmentState(list(raw["params"]), raw["optimizer"]).digest() == digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task-config", default="{}", help="bytegpt config (JSON)")
    parser.add_argument("--states", type=int, default=40, help="states timed per arm and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two arms")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the daemon's: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = make_task(json.loads(args.task_config))
    model = task.make_model(0)
    inner = InnerOptimizer(model, DEFAULT_HYPERPARAMETERS, device=torch.device("cpu"))
    batches = task.batches(0, 1, 0)
    step = [0]

    def inner_step() -> None:
        batch = next(batches)
        inner.step(lambda: task.loss(model, batch), step[0])
        step[0] += 1

    inner_step()  # (the optimizer's state exists from the first step)
    step_ms = cpu_ms(inner_step, 10)
    state = capture(model, inner)
    digest = state.digest()
    capture_ms = cpu_ms(lambda: capture(model, inner), args.states)
    digest_ms = cpu_ms(state.digest, args.states)
    write: dict[str, list[float]] = {"state_file": [], "torch_save": []}
    read: dict[str, list[float]] = {"state_file": [], "torch_save": []}
    with tempfile.TemporaryDirectory() as tmp:
        disk = SpillDir(Path(tmp) / "state_file")
        plain = Path(tmp) / "torch_save"
        plain.mkdir()
        arms_io: dict[str, tuple[Callable[[int], Any], Callable[[Any], Any]]] = {
            "state_file": (lambda i: disk.write(0, i, state), lambda s: s.load(digest)),
            "torch_save": (
                lambda i: torch_save_write(plain, state, i),
                lambda p: torch_load_read(p, digest),
            ),
        }
        counter = iter(range(1 << 30))
        for _ in range(args.rounds):
            for arm, (write_one, read_one) in arms_io.items():
                files: list[Any] = []
                write[arm].append(cpu_ms(lambda w=write_one, f=files: f.append(w(next(counter))),
                                         args.states))  # fmt: skip
                read[arm].append(cpu_ms(lambda r=read_one, f=files: r(f[0]), args.states))
                for f in files:
                    (f.path if isinstance(f, Spilled) else f).unlink()

    def arms(d: dict[str, list[float]]) -> dict[str, float]:
        new, old = statistics.median(d["state_file"]), statistics.median(d["torch_save"])
        return {
            "state_file": round(new, 2),
            "torch_save": round(old, 2),
            "ratio": round(old / new, 2),
        }

    w = arms(write)
    per_segment = SEGMENT_STEPS * step_ms
    print(json.dumps({
        "state_bytes": sum(t.numel() * t.element_size() for t in state.params) * 3,
        "inner_step_ms": round(step_ms, 2),
        "capture_ms": round(capture_ms, 2),
        "digest_ms": round(digest_ms, 2),
        "write_ms": w,
        "read_ms": arms(read),
        "per_segment_share": {
            arm: round((capture_ms + digest_ms + w[arm]) / per_segment, 4)
            for arm in ("state_file", "torch_save")
        },
        "settings": vars(args),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
