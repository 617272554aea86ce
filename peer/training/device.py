"""Where a peer computes: the device choice, precision checks, and what is reported about it.

The choice is a pure function (`choose_device`) of what torch reports
(`DeviceInventory`, read once by `probe_inventory`), so that every branch is
tested on a machine without an accelerator. Everything that must agree
across peers (fingerprints, commits, verification) is computed on the host in
float32 by the averaging layer; the device only changes where the inner steps
run and how fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DeviceError",
    "DeviceInfo",
    "DeviceInventory",
    "GpuInfo",
    "autocast",
    "check_precision",
    "choose_device",
    "cpu_fp16_slowdown",
    "describe",
    "mfu",
    "peak_flops",
    "probe_inventory",
]

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


class DeviceError(ValueError):
    """The requested device or precision cannot be used here; one line for the user."""


@dataclass(frozen=True)
class GpuInfo:
    name: str
    memory_total_bytes: int
    capability: tuple[int, int]  # CUDA compute capability (major, minor)


@dataclass(frozen=True)
class DeviceInventory:
    """What torch sees on this machine."""

    cuda: tuple[GpuInfo, ...] = ()
    mps: bool = False
    # How many times slower the CPU runs fp16 autocast than fp32 (`cpu_fp16_slowdown`);
    # None: not measured yet, measured when asked (tests give it).
    cpu_fp16_slowdown: float | None = None


def probe_inventory() -> DeviceInventory:
    gpus: list[GpuInfo] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(GpuInfo(props.name, int(props.total_memory), (props.major, props.minor)))
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return DeviceInventory(tuple(gpus), mps)


_CUDA_INDEX = re.compile(r"cuda:(\d+)")


def choose_device(request: str, inventory: DeviceInventory) -> torch.device:
    """The device for `request` (auto, cpu, cuda, cuda:N, mps); DeviceError if it is absent.

    `auto` takes the first CUDA device, else MPS, else the CPU. (With several GPUs,
    one daemon per GPU with `--device cuda:N` uses them all; one peer does not
    split its model across GPUs.)
    """
    request = request.strip().lower()
    if request == "auto":
        if inventory.cuda:
            return torch.device("cuda", 0)
        return torch.device("mps") if inventory.mps else torch.device("cpu")
    if request == "cpu":
        return torch.device("cpu")
    if request == "mps":
        if not inventory.mps:
            raise DeviceError("--device mps: torch sees no Apple GPU (MPS) on this machine")
        return torch.device("mps")
    if request == "cuda" or _CUDA_INDEX.fullmatch(request):
        index = int(request.partition(":")[2] or 0)
        if not inventory.cuda:
            raise DeviceError(
                f"--device {request}: torch sees no CUDA GPU here (torch {torch.__version__}"
                f"{'' if torch.version.cuda else ', a CPU-only build'}); use --device cpu "
                "or auto, or install a CUDA build of torch"
            )
        if index >= len(inventory.cuda):
            raise DeviceError(
                f"--device {request}: this machine has {len(inventory.cuda)} CUDA GPU(s), "
                f"numbered 0 to {len(inventory.cuda) - 1}"
            )
        return torch.device("cuda", index)
    raise DeviceError(f"--device {request!r}: expected {DEVICE_CHOICES}")


def check_precision(precision: str, device: torch.device, inventory: DeviceInventory) -> None:
    """DeviceError when `precision` cannot run (or runs absurdly slowly) on `device`."""
    if precision == "fp32":
        return
    if precision not in ("bf16", "fp16"):
        raise DeviceError(f"precision {precision!r}: expected fp32, bf16 or fp16")
    if device.type == "cuda":
        major = inventory.cuda[device.index or 0].capability[0]
        if precision == "bf16" and major < 8:
            raise DeviceError(
                f"this experiment trains in bf16, which needs a GPU of compute capability 8.0 "
                f"or newer (Ampere); {inventory.cuda[device.index or 0].name} is "
                f"{major}.x: join an fp32 or fp16 experiment instead"
            )
        return
    if device.type == "cpu" and precision == "fp16":
        # CPUs differ: a 2-core EPYC trained fp16 17x slower than fp32 (bench/train_step.py,
        # torch 2.13), an H200 machine's Xeon at 0.89x its fp32 (fp16 arithmetic). So this
        # CPU is measured, not assumed.
        slowdown = inventory.cpu_fp16_slowdown
        if slowdown is None:
            slowdown = cpu_fp16_slowdown()
        if slowdown > MAX_CPU_FP16_SLOWDOWN:
            raise DeviceError(
                f"this experiment trains in fp16, which this CPU runs {slowdown:.0f}x slower "
                "than fp32 (measured now); join it from a GPU (--device cuda)"
            )


# A CPU peer takes an fp16 experiment only if its fp16 is at most this many times slower
# than its fp32 (where it is 17x slower, a peer would hold its group back for nothing).
MAX_CPU_FP16_SLOWDOWN = 3.0
_PROBE_SIZE, _PROBE_REPEATS = 256, 3


@functools.cache
def cpu_fp16_slowdown() -> float:
    """How many times slower this CPU multiplies matrices under fp16 autocast than in
    float32: the best of 3 products of 256 x 256 each way, after one of each (about
    0.1 s where fp16 is 20x slower; once per process). A proxy for a training step,
    which is mostly such products."""

    def best(dtype: torch.dtype | None) -> float:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=generator)
        b = torch.randn(_PROBE_SIZE, _PROBE_SIZE, generator=generator)
        timings = []
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            for _ in range(_PROBE_REPEATS + 1):
                start = time.perf_counter()
                a @ b
                timings.append(time.perf_counter() - start)
        return max(min(timings[1:]), 1e-9)

    return best(torch.float16) / best(None)


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Forward passes under `precision` (parameters and optimizer state stay float32)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # cpu, cuda, mps
    name: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_total_bytes": self.memory_total_bytes,
        }

    def summary(self) -> str:
        if self.memory_total_bytes:
            return f"{self.kind} ({self.name}, {self.memory_total_bytes / 2**30:.1f} GiB)"
        return f"{self.kind} ({self.name})"


def describe(device: torch.device, inventory: DeviceInventory) -> DeviceInfo:
    """The device's name and memory now (memory used: what torch holds on it)."""
    if device.type == "cuda":
        gpu = inventory.cuda[device.index or 0]
        used = int(torch.cuda.memory_reserved(device))
        return DeviceInfo("cuda", gpu.name, used, gpu.memory_total_bytes)
    if device.type == "mps":
        used = int(torch.mps.current_allocated_memory()) if hasattr(torch, "mps") else None
        return DeviceInfo("mps", "Apple GPU", used, None)
    return DeviceInfo("cpu", _cpu_name(), _rss_bytes(), _ram_bytes())


@functools.cache  # (/status asks 10 times a second; /proc/cpuinfo is long on big hosts)
def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine() or "cpu"


def _rss_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return None


def _ram_bytes() -> int | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


# Dense peak tensor throughput in FLOP/s by precision (vendor data sheets, without
# sparsity), matched by a substring of the name torch reports. fp32 on Ampere and
# newer counts TF32 tensor cores only when torch allows them, which it does not by
# default; the table gives plain fp32 there.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12}),
    ("H100 PCIe", {"fp32": 51e12, "bf16": 756e12, "fp16": 756e12}),
    ("H100", {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12}),
    ("A100", {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12}),
    ("A10G", {"fp32": 31.2e12, "bf16": 70e12, "fp16": 70e12}),
    ("A10", {"fp32": 31.2e12, "bf16": 125e12, "fp16": 125e12}),
    ("L40S", {"fp32": 91.6e12, "bf16": 362e12, "fp16": 362e12}),
    ("L4", {"fp32": 30.3e12, "bf16": 121e12, "fp16": 121e12}),
    ("RTX 5090", {"fp32": 104.8e12, "bf16": 209.5e12, "fp16": 209.5e12}),
    ("RTX 4090", {"fp32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12}),
    ("RTX 3090", {"fp32": 35.6e12, "bf16": 71e12, "fp16": 71e12}),
    ("V100", {"fp32": 15.7e12, "fp16": 125e12}),
    ("T4", {"fp32": 8.1e12, "fp16": 65e12}),
)


def peak_flops(info: DeviceInfo, precision: str) -> float | None:
    """The device's peak FLOP/s at `precision`, when known (GPUs in the table); else None."""
    if info.kind != "cuda":
        return None
    for key, peaks in _PEAKS:
        if key in info.name:
            return peaks.get(precision)
    return None


def mfu(
    flops_per_token: float | None, tokens_per_s: float | None, peak: float | None
) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over the device's peak (0..1)."""
    if not flops_per_token or not tokens_per_s or not peak:
        return None
    return flops_per_token * tokens_per_s / peak
