"""Where a soak witness' memory goes, for the peers bench/soak.py starts with it.

`bench/soak.py --profile-memory` puts this directory on the PYTHONPATH of its
witnesses (the peers it never kills) with SHOAL_SOAK_MEMORY_DIR set. Python imports
it at start-up, before shoal: tracemalloc starts, and every
SHOAL_SOAK_MEMORY_EVERY_S seconds (600) a thread writes a tracemalloc snapshot and
a line of `memory.jsonl` that splits the resident set three ways: what Python
allocated (tracemalloc), what glibc's malloc holds in use and free (mallinfo2:
torch's CPU tensors and every C library come from there), and the rest. A growing
RSS with a flat Python part is native memory or fragmentation, not a Python leak.
`python bench/soak_memory/report.py DIR` compares the snapshots.
"""

import ctypes
import gc
import json
import os
import threading
import time
import tracemalloc
from collections import Counter

_dir = os.environ.get("SHOAL_SOAK_MEMORY_DIR")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _malloc() -> dict[str, float]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    mb = 1 << 20
    return {
        "malloc_in_use_MB": (info.uordblks + info.hblkhd) / mb,
        "malloc_free_MB": info.fordblks / mb,
        "malloc_mmapped_MB": info.hblkhd / mb,
    }


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _write(directory: str, n: int) -> None:
    tracemalloc.take_snapshot().dump(os.path.join(directory, f"snapshot-{n:03d}.tracemalloc"))
    traced, peak = tracemalloc.get_traced_memory()
    types = Counter(type(o).__name__ for o in gc.get_objects())
    line = {
        "time": time.time(), "n": n, "rss_MB": _rss_mb(), "python_MB": traced / (1 << 20),
        "python_peak_MB": peak / (1 << 20), **_malloc(), "threads": threading.active_count(),
        "gc_objects": sum(types.values()), "top_types": types.most_common(15),
    }  # fmt: skip
    with open(os.path.join(directory, "memory.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def _every(directory: str, every_s: float) -> None:
    n = 0
    while True:
        time.sleep(every_s)
        n += 1
        try:
            _write(directory, n)
        except Exception as exc:  # a full disk must not end the peer being measured
            with open(os.path.join(directory, "errors.txt"), "a") as out:
                out.write(f"{time.time()} {exc!r}\n")


if _dir:
    os.makedirs(_dir, exist_ok=True)
    tracemalloc.start(int(os.environ.get("SHOAL_SOAK_MEMORY_FRAMES", "8")))
    _every_s = float(os.environ.get("SHOAL_SOAK_MEMORY_EVERY_S", "600"))
    threading.Thread(target=_every, args=(_dir, _every_s), name="soak-memory", daemon=True).start()
