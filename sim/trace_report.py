"""What split the cells, and whom the retries left out, in a Moshpit trace.

    python sim/run.py sim/scenarios/moshpit_small.json --trace-matchmaking trace.jsonl
    python sim/trace_report.py trace.jsonl [--details]

Prints one JSON object: for each arm of the trace, per round (the k-th step of every
peer), `split_cells` (a cell's peers committed more than one group in one slot: a
cell should form one), `whole_key` (steps alone in their cell that averaged under the
whole key instead), `failed` (steps that committed nothing), `aborted_tries` (tries whose
round aborted) and `live_left_out` (peers alive at the end that an abort's retry left
out, with how many members left them out). With `--details`, each split cell's groups
(leader, size) and, for its peers outside the largest group, their tries: every join
sent and its answer, and how the try ended; and each live peer left out, with what
its step did next; and each live peer whose step committed nothing, with its
reason and tries. The trace says what each peer's own step saw (`Attempt`); a
leader's view is not in it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from typing import Any

Step = dict[str, Any]


def step_kind(step: Step) -> str:
    """How a step ended: in its cell, under the whole key after it was alone in its
    cell (an "alone" try, then more), or with no commit."""
    outcomes = [a["outcome"] for a in step["attempts"]]
    if not step["committed"]:
        return "failed"
    if "alone" in outcomes[:-1]:
        return "whole_key"
    return "cell"


def tries(step: Step) -> list[str]:
    """A step's tries, one line each: its joins (to whom, the answer, seconds), then the
    group it formed (leader, size) and how it ended."""
    lines = []
    for a in step["attempts"]:
        joins = ", ".join(f"{j['leader']} {j['answer']} {j['seconds']:.2f}s" for j in a["joins"])
        group = (
            f"group {a['round_id'][:8]} of {a['group_size']} by {a['leader']}"
            if a["round_id"]
            else "no group"
        )
        left = f"; left out {', '.join(a['left_out'])}" if a["left_out"] else ""
        excluded = f" (excluding {len(a['excluded'])})" if a["excluded"] else ""
        lines.append(
            f"joins [{joins}] -> {group}{excluded} -> {a['outcome'][:100]}"
            f" after {a['matchmaking_s']:.2f}+{a['averaging_s']:.2f}s{left}"
        )
    return lines


def report_arm(arm: dict[str, Any], details: bool) -> dict[str, Any]:
    peers = arm["peers"]
    alive = {p["peer"] for p in peers if not p["crashed"]}
    rounds = max((len(p["steps"]) for p in peers), default=0)
    per_round = []
    found_details: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for k in range(rounds):
        at_k = [(p["peer"], p["steps"][k]) for p in peers if len(p["steps"]) > k]
        kinds = Counter(step_kind(s) for _, s in at_k)
        # The groups each (slot, cell) committed (steps in the cell only).
        cells: dict[tuple[Any, str], dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        for peer, s in at_k:
            if s["cell"] is not None and step_kind(s) == "cell":
                cells[(s["slot"], s["cell"])][s["round_id"]].append(peer)
        split = {key: groups for key, groups in cells.items() if len(groups) > 1}
        # Whom aborts left out, by how many members; counted for the peers alive at the end.
        left_by: Counter[str] = Counter()
        aborts = 0
        for _, s in at_k:
            for a in s["attempts"]:
                if a["round_id"] and a["outcome"] != "committed":
                    aborts += 1
                    left_by.update(a["left_out"])
        live_left = {p: n for p, n in left_by.items() if p in alive}
        per_round.append({
            "round": k + 1, "split_cells": len(split), "whole_key": kinds["whole_key"],
            "failed": kinds["failed"], "aborted_tries": aborts, "live_left_out": len(live_left),
        })  # fmt: skip
        if details:
            more = _details(k + 1, dict(at_k), split, live_left, alive)
            for name, found in more.items():
                found_details[name].extend(found)
    out: dict[str, Any] = {"arm": arm["arm"], "peers": len(peers), "rounds": per_round}
    if details:
        out.update(found_details)
    return out


def _details(
    round_no: int,
    steps: dict[str, Step],
    split: dict[tuple[Any, str], dict[str, list[str]]],
    live_left: dict[str, int],
    alive: set[str],
) -> dict[str, list[dict[str, Any]]]:
    """One round's split cells (groups, and the tries of the peers outside the largest),
    live peers left out (and what their step did next), and live peers whose step
    committed nothing (its reason and tries)."""
    split_details, left_details, failed_details = [], [], []
    for (slot, cell), groups in sorted(split.items(), key=lambda kv: str(kv[0])):
        largest = max(groups.values(), key=len)
        split_details.append({
            "round": round_no, "slot": slot, "cell": cell,
            "groups": [{"round_id": rid[:8], "size": len(m),
                        "leader": steps[m[0]]["attempts"][-1]["leader"]}
                       for rid, m in groups.items()],
            "outside": {p: tries(steps[p]) for m in groups.values() if m is not largest
                        for p in m},
        })  # fmt: skip
    for peer, n in sorted(live_left.items()):
        if peer in steps:
            left_details.append({
                "round": round_no, "peer": peer, "left_out_by": n,
                "then": step_kind(steps[peer]), "tries": tries(steps[peer]),
            })  # fmt: skip
    for peer, step in sorted(steps.items()):
        if peer in alive and not step["committed"]:
            failed_details.append({
                "round": round_no, "peer": peer, "reason": step["reason"][:200],
                "tries": tries(step),
            })  # fmt: skip
    return {
        "split_cells": split_details,
        "live_left_out": left_details,
        "live_failed": failed_details,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="a file of `sim/run.py --trace-matchmaking`")
    parser.add_argument(
        "--details", action="store_true",
        help="each split cell's groups and tries, each live peer left out or failed",
    )  # fmt: skip
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        arms = [json.loads(line) for line in f if line.strip()]
    json.dump({"arms": [report_arm(a, args.details) for a in arms]}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
