"""What a stage peer holds through its backwards and steps, in B (its parameters' bytes).

    python bench/stage_step_memory.py [--width 2048] [--layers 4] [--steps 2]

Two stage peers of one stage (a stack of Linear layers: B = layers x (width^2 +
width) x 4 bytes) in this process, on loopback: each takes backwards through
its `StageWorker`, then both take their `StageOptimizer` steps (a committed
two-peer all-reduce and AdamW). For each phase, the growth of the process's peak
resident memory over its start (Linux: the peak is reset through
/proc/self/clear_refs), per peer: what `pipeline/memory.py` counts as gradients,
averaging and the AdamW temporaries, measured. Large blocks are mapped on their own
(as a peer with a budget does: `return_large_blocks_at_once`), so what is freed
leaves the resident memory at once.

Prints one JSON object: {"B_bytes", "built", "backward": [...], "step": [...],
"held_after"} (peaks and holdings in B per peer; "built": parameters, moments and
what the peer keeps from the start, beyond the interpreter's).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import json
from pathlib import Path
from typing import Any

import torch

from pipeline import close_nodes, loopback_node  # (bench/, the script's folder)
from shoal.averaging.matchmaking import MatchmakingConfig
from shoal.peer.training.heap import return_large_blocks_at_once
from shoal.pipeline.stage import StageWorker
from shoal.pipeline.stage_optimizer import StageOptimizer


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> int:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


async def measure(width: int, layers: int, steps: int) -> dict[str, Any]:
    return_large_blocks_at_once()
    b = layers * (width * width + width) * 4
    mm = MatchmakingConfig(min_group_size=2, target_group_size=2, matchmaking_time=2.0)
    nodes: list[Any] = []
    start = _reset_peak()
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    peers = []
    for _ in range(2):
        worker = StageWorker(copy.deepcopy(module))
        node = await loopback_node(nodes)
        peers.append(StageOptimizer(node, "mem", 0, worker, hyper={"lr": 1e-3}, matchmaking=mm))
    del module
    out: dict[str, Any] = {"B_bytes": b, "built": round((_reset_peak() - start) / b / 2, 2)}
    x, g = torch.randn(4, width), torch.randn(4, width)
    backward, step = [], []
    try:
        for k in range(steps):
            for i, o in enumerate(peers):  # (one peer at a time: per peer)
                before = _reset_peak()
                o.worker.backward(("mb", k, i), x, g, 4)
                backward.append(round((_status("VmHWM") - before) / b, 2))
            before = _reset_peak()  # (both step at once: the growth of two peers)
            results = await asyncio.gather(*(o.step(timeout=60.0) for o in peers))
            assert all(r.committed and r.group_size == 2 for r in results), results
            step.append(round((_status("VmHWM") - before) / b / 2, 2))
            assert peers[0].fingerprint() == peers[1].fingerprint()
        out.update(backward=backward, step=step)
        out["held_after"] = round((_reset_peak() - start) / b / 2, 2)
    finally:
        for o in peers:
            await o.aclose()
        await close_nodes(nodes)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    opts = p.parse_args()
    print(json.dumps(asyncio.run(measure(opts.width, opts.layers, opts.steps))))


if __name__ == "__main__":
    main()
