"""A/B against an older commit in the same run: its code from a git worktree, figures side by side.

On a shared machine a figure measured an hour ago says little: the load of
other processes moves throughput and calls/s by tens of percent. So the
benchmarks that compare with an older commit (``--baseline REF``) run both
codes in one run, alternating (current, baseline; then baseline, current; ...),
and report each side's median and range with the ratio of the medians.

The baseline's code comes from a detached ``git worktree`` of REF (removed
afterwards) whose packages are put first on the path of the processes that
run it (``.overlay/shoal/<package>`` links, ``PYTHONPATH``), so ``import
shoal.transport`` there imports REF's. REF may also name an existing checkout
(a directory), used as it is.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("transport", "dht", "averaging", "verification", "pipeline", "peer")


def _overlay(tree: Path) -> Path:
    """`tree`'s packages as the `shoal` namespace, to put first on PYTHONPATH."""
    overlay = tree / ".overlay"
    (overlay / "shoal").mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = overlay / "shoal" / name
        if (tree / name).is_dir() and not link.exists():
            link.symlink_to(Path("..") / ".." / name)
    return overlay


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """A checkout of `ref` (a commit, or an existing directory) with its overlay."""
    if Path(ref).is_dir():
        tree = Path(ref).resolve()
        _overlay(tree)
        yield tree
        return
    with tempfile.TemporaryDirectory(prefix="shoal-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        git = ["git", "-C", str(REPO)]
        subprocess.run(
            [*git, "worktree", "add", "--detach", str(tree), ref],
            check=True,
            capture_output=True,
        )
        try:
            _overlay(tree)
            yield tree
        finally:
            subprocess.run(
                [*git, "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )


def env_for(tree: Path | None) -> dict[str, str]:
    """The environment of a process that runs `tree`'s code (None: the current code)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(_overlay(tree)), *filter(None, [env.get("PYTHONPATH")])]
        )
        # Its tree is a worktree in a temporary folder, where the lab beside this
        # checkout (shared/lab/lab.sh) is not found: bench/nat.py's A/B stopped there.
        lab = next(
            (c for d in Path(__file__).resolve().parents
             if (c := d / "shared" / "lab" / "lab.sh").exists()),
            None,
        )  # fmt: skip
        if lab is not None:
            env.setdefault("SHOAL_LAB_SH", str(lab))
    return env


def order(round_index: int) -> tuple[str, str]:
    """Which side goes first in this round: alternated, so drift hits both alike."""
    return ("current", "baseline") if round_index % 2 == 0 else ("baseline", "current")


def compare(runs: dict[str, list[dict[str, Any]]], keys: Sequence[str], ref: str) -> dict[str, Any]:
    """Median, range and all values of `keys` per side, and current/baseline medians."""
    out: dict[str, Any] = {"baseline_ref": ref, "rounds": len(runs["current"])}
    for key in keys:
        sides = {}
        for side in ("current", "baseline"):
            values = [r[key] for r in runs[side] if isinstance(r.get(key), int | float)]
            sides[side] = values
            if values:
                out[f"{key}_{side}"] = round(statistics.median(values), 3)
                out[f"{key}_{side}_range"] = [round(min(values), 3), round(max(values), 3)]
        if sides["current"] and sides["baseline"] and out[f"{key}_baseline"]:
            out[f"{key}_ratio"] = round(out[f"{key}_current"] / out[f"{key}_baseline"], 3)
    return out
