"""Training throughput of the built-in task per device and precision, CPU fp32 as the baseline.

    python bench/train_step.py [--steps 40] [--warmup 5] [--cpu-steps N] [--quick]
        [--task-option KEY=VALUE ...] [--hf] [--hf-option KEY=VALUE ...]

Runs the daemon's own inner step (`shoal.peer.training.inner`: the prefetcher, autocast,
AdamW, the fp16 gradient scaler) on every device torch sees (the CPU always;
each CUDA GPU; an Apple GPU) at every precision, and prints one JSON object:

    {"task": {...}, "parameters": N, "flops_per_token": F,
     "baseline": "cpu fp32",
     "runs": [{"device": "cpu", "name": "...", "precision": "fp32",
               "tokens_per_s": ..., "step_ms_median": ..., "step_ms_p90": ...,
               "peak_flops": null, "mfu": null, "vs_baseline": 1.0}, ...]}

`vs_baseline` is tokens/s over the CPU fp32 run of the same invocation.
With ``--hf`` (needs ``pip install 'shoal[hf]'``) the `hf` task (`HF_BENCH`, a Llama
of about the built-in task's size, on the standard library with a BPE trained there,
overridden by ``--hf-option``) is measured too, under "hf": the same run fields, its
`vs_baseline` against the built-in task's CPU fp32 run, and `bytes_per_token` (a BPE
token is several bytes, a bytegpt token one: bytes/s = tokens/s x bytes_per_token). MFU is
model FLOPs per token x tokens/s over the device's peak at that precision
(`shoal.peer.training.device.peak_flops`), null where the peak is unknown (CPUs, GPUs
not in the table). fp16 on the CPU is measured with a few steps only (`--quick`
skips it): where it is far below fp32, a CPU daemon refuses fp16 experiments (it measures
a proxy at start, `shoal.peer.training.device.cpu_fp16_slowdown`, and refuses above 3x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.device import describe, mfu, peak_flops, probe_inventory
from shoal.peer.training.inner import BatchPrefetcher, InnerOptimizer
from shoal.peer.training.tasks.bytegpt import make_task

PRECISIONS = ("fp32", "bf16", "fp16")
# The hf arm's default: a Llama of about bytegpt's default width and depth.
HF_BENCH: dict[str, Any] = {
    "family": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 2048,
    "context": 128,
    "batch_size": 8,
    "max_bytes": 4 * 2**20,
}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure(task: Any, device: torch.device, precision: str, steps: int, warmup: int) -> dict:
    model = task.make_model(0).to(device)
    inner = InnerOptimizer(model, check_hyperparameters({}), device=device, precision=precision)
    batches = BatchPrefetcher(task.batches(0, 1, 0), device)
    times: list[float] = []
    tokens = 0
    try:
        for i in range(warmup + steps):
            started = time.perf_counter()
            batch = next(batches)
            inner.step(lambda b=batch: task.loss(model, b), i)  # returns the loss: a sync
            _synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - started)
                tokens += task.batch_tokens(batch)
    finally:
        batches.close()
    inventory = probe_inventory()
    info = describe(device, inventory)
    tokens_per_s = tokens / sum(times)
    peak = peak_flops(info, precision)
    times.sort()
    return {
        "device": str(device),
        "name": info.name,
        "precision": precision,
        "steps": steps,
        "tokens_per_s": round(tokens_per_s, 1),
        "step_ms_median": round(1e3 * statistics.median(times), 2),
        "step_ms_p90": round(1e3 * times[int(0.9 * (len(times) - 1))], 2),
        "peak_flops": peak,
        "mfu": mfu(task.flops_per_token(), tokens_per_s, peak),
    }


def devices() -> list[torch.device]:
    found = [torch.device("cpu")]
    inventory = probe_inventory()
    found += [torch.device("cuda", i) for i in range(len(inventory.cuda))]
    if inventory.mps:
        found.append(torch.device("mps"))
    return found


def options(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = value
    return out


def measure_all(task: Any, args: argparse.Namespace) -> list[dict]:
    runs = []
    for device in devices():
        for precision in PRECISIONS:
            steps, warmup = args.steps, args.warmup
            if device.type == "cpu" and args.cpu_steps:
                # A model sized for a GPU runs seconds a step on a CPU: a few steps tell.
                steps, warmup = args.cpu_steps, min(args.warmup, 1)
            if device.type == "cpu" and precision == "fp16":
                if args.quick:
                    continue
                steps = max(2, steps // 10)  # >10x slower: a few steps tell
            if device.type == "cuda" and precision == "bf16":
                major = torch.cuda.get_device_capability(device)[0]
                if major < 8:
                    continue
            runs.append(measure(task, device, precision, steps, warmup))
    return runs


def bytes_per_token(task: Any) -> float:
    ids = task.corpus.train[:20000].tolist()
    return round(len(task.tokenizer.decode(ids).encode()) / len(ids), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--cpu-steps",
        type=int,
        default=0,
        help="steps of the CPU runs, after one warm-up step (default: --steps, --warmup)",
    )
    parser.add_argument("--quick", action="store_true", help="skip fp16 on the CPU")
    parser.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--hf", action="store_true", help="measure the hf task too")
    parser.add_argument("--hf-option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    task = make_task(options(args.task_option))
    runs = measure_all(task, args)
    baseline = next(r for r in runs if r["device"] == "cpu" and r["precision"] == "fp32")
    for r in runs:
        r["vs_baseline"] = round(r["tokens_per_s"] / baseline["tokens_per_s"], 3)
    model = task.make_model(0)
    result = {
        "task": task.config(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "flops_per_token": task.flops_per_token(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "baseline": "cpu fp32",
        "runs": runs,
    }
    if args.hf:
        from shoal.peer.training.tasks.hf import make_task as make_hf_task

        hf = make_hf_task({**HF_BENCH, **options(args.hf_option)})
        hf_runs = measure_all(hf, args)
        for r in hf_runs:
            r["vs_baseline"] = round(r["tokens_per_s"] / baseline["tokens_per_s"], 3)
        config = {k: v for k, v in hf.config().items() if k != "tokenizer_bpe"}
        result["hf"] = {
            "task": config,
            "parameters": sum(p.numel() for p in hf.make_model(0).parameters()),
            "flops_per_token": hf.flops_per_token(),
            "bytes_per_token": bytes_per_token(hf),
            "runs": hf_runs,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
