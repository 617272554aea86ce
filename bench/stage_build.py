"""One stage of a pipelined bytegpt, built alone: its size, build time and training step.

    python bench/stage_build.py [--preset base] [--stages 4] [--batch 4] [--threads 1]

Prints one JSON object on stdout:

    {"config": the task's config, "parameters": all stages together,
     "stages": [{"stage": k, "stage_size": from the config (nothing built),
                 "parameters": of the stage built alone, "build_s": building it,
                 "fingerprint_s": hashing it, "step_s": the median of 3 training steps
                 (forward, backward from a random output gradient or the loss, AdamW),
                 "step_cpu_s": their CPU time (what a loaded machine does not inflate),
                 "peak_rss_mib": this process's peak RSS after it}, ...]}

Each stage is built, measured and freed before the next (as a stage peer holds only its
own), so the peak RSS stays near one stage's parameters, gradients and AdamW state.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import time
from typing import Any

import torch

from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.stage_build import build_stage, stage_fingerprint


def step_time(
    task: Any, module: torch.nn.Module, k: int, stages: int, batch: torch.Tensor
) -> float:
    """Median seconds of 3 training steps of stage `k` (after one to warm up)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    ids = task.stage_inputs(batch)
    d_model = task.config()["d_model"]
    times, cpu = [], []
    for _ in range(4):
        start, start_cpu = time.perf_counter(), time.process_time()
        x = ids if k == 0 else torch.randn(*ids.shape, d_model, requires_grad=True)
        y = module(x)
        if k == stages - 1:
            task.stage_loss(y, batch).backward()
        else:
            y.backward(torch.randn_like(y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(times[1:]), statistics.median(cpu[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    task = make_task({"preset": opts.preset, "batch_size": opts.batch})
    batch = next(task.batches(0, 1, 0))
    rows = []
    for k in range(opts.stages):
        start = time.perf_counter()
        module = build_stage(task, 0, opts.stages, k)
        built = time.perf_counter() - start
        start = time.perf_counter()
        stage_fingerprint(module)
        hashed = time.perf_counter() - start
        wall, cpu = step_time(task, module, k, opts.stages, batch)
        rows.append({
            "stage": k,
            "stage_size": task.stage_size(opts.stages, k),
            "parameters": sum(p.numel() for p in module.parameters()),
            "build_s": round(built, 3),
            "fingerprint_s": round(hashed, 3),
            "step_s": round(wall, 3),
            "step_cpu_s": round(cpu, 3),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        })  # fmt: skip
        del module
        gc.collect()
    total = sum(r["parameters"] for r in rows)
    print(json.dumps({"config": task.config(), "parameters": total, "stages": rows}, indent=1))


if __name__ == "__main__":
    main()
