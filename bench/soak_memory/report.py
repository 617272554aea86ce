"""What grew between two tracemalloc snapshots of a soak witness.

    python bench/soak_memory/report.py DIR [--first N] [--last M] [--top 25]

DIR is a witness' SHOAL_SOAK_MEMORY_DIR (bench/soak.py --profile-memory). Prints the
memory.jsonl series (RSS and its parts), then the allocation sites whose size grew
most between snapshot N (default: the middle one, after warm-up) and M (the last).
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--first", type=int, default=None)
    ap.add_argument("--last", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for line in (args.dir / "memory.jsonl").read_text().splitlines():
        row = json.loads(line)
        parts = " ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_MB"))
        print(f"#{row['n']:3d} {parts} threads {row['threads']} objects {row['gc_objects']}")
    snapshots = sorted(args.dir.glob("snapshot-*.tracemalloc"))
    if len(snapshots) < 2:
        return
    first = snapshots[args.first - 1] if args.first else snapshots[len(snapshots) // 2 - 1]
    last = snapshots[args.last - 1] if args.last else snapshots[-1]
    old, new = (tracemalloc.Snapshot.load(str(p)) for p in (first, last))
    print(f"\ngrowth from {first.name} to {last.name}:")
    for stat in new.compare_to(old, "traceback")[: args.top]:
        print(f"{stat.size_diff / 1024:+10.0f} KiB {stat.count_diff:+8d} blocks")
        for frame in stat.traceback.format()[-8:]:
            print("    " + frame)


if __name__ == "__main__":
    main()
