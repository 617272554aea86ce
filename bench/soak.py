"""Soak: ten peers train through churn, partitions, loss and wrong clocks, and nothing
they agreed on is lost (root only: network namespaces).

    sudo python bench/soak.py --minutes 60 [--seed 1] [--tiny] [--workdir DIR]
                              [--profile-memory]

Ten `shoal run` processes in the NAT lab (bench/soak_lab.py: three public, seven
behind three NAT routers, one of them symmetric) train the default experiment
(`--tiny`: a small model and short deadlines, for CI) while a seeded chaos
schedule acts every 0.5-5 s:

- kill -9 a peer, restarted 2-15 s later with the same data directory;
- SIGSTOP a peer for 1-20 s, then SIGCONT;
- restart a peer gracefully (SIGTERM, start again);
- partition two namespaces for 5-30 s (every packet between them dropped);
- drop 1-20% of what a namespace receives for 10-60 s;
- restart a peer with its wall clock 2-10 minutes off, for 30-90 s.

At most two peers are down (killed, stopped or restarting) at once, and one
starts at a time (importing torch takes seconds of both cores). `--witnesses`
peers (default 2: p1-pub and p3-a1) are never killed, stopped or restarted,
only cut off and flooded with loss like the rest: their one long life is what
says whether memory and descriptors grow.

Checked throughout and at the end:

- every round that committed has one fingerprint among its members, and no
  input is counted in two committed rounds (the peers' round ledgers,
  `<data dir>/rounds.jsonl`, read together: peer/status/round_ledger.py);
- every checkpoint on disk loads (every 20 s, each file on its own);
- the gap between commits of two or more peers stays bounded: `max_commit_gap_s`
  over the whole run, and `max_calm_commit_gap_s` over the time the swarm was
  calm (at most two peers down and at most one partition up; `calm_share` of
  the run was): two partitions at once cut off most of the swarm, and those
  storms are where every gap over 60 s so far was;
- RSS and open descriptors do not grow: `rss_growth_MB_per_hour` and
  `fd_growth_per_hour` are the largest least-squares slope over the second half
  of a witness' life (steady state, after its warm-up) when a witness lived 10
  minutes or more; in shorter runs, the median slope over process lifetimes of
  2 minutes or more, after their first minute (`..._lifetimes`: that median in
  every run). `--profile-memory` says where a witness' memory goes: tracemalloc
  and glibc's heap statistics in it every 10 minutes (bench/soak_memory; the
  witnesses run slower), `python bench/soak_memory/report.py DIR` to read them.

Prints one JSON object: `minutes`, `kills`, `stops`, `restarts`, `partitions`,
`losses`, `clock_offsets`, `commits`, `fingerprint_mismatches`,
`double_counted`, `corrupt_checkpoints`, `max_commit_gap_s`,
`max_calm_commit_gap_s`, `calm_share`, `rss_growth_MB_per_hour`,
`fd_growth_per_hour` (as above; `witnesses` has each witness' curve of RSS
and descriptors), `longest_gaps` (the three longest taken apart: the weather in
each and every peer's rounds and their tries, as `longest_gaps` says),
`unexpected_exits` (peers that
exited by themselves; each is started again), `false_convictions` (peers
convicted of cheating: none cheats here), `log_errors` (ERROR lines in the
peers' logs), `shuns` and `shun_seconds` (peers left out of another's rounds
for a withheld secret or a missing reveal, and for how long in all; none
cheats here), `secrets_found_late` (missing secrets found on the second look,
so nobody was shunned), and details. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_lab import PeerProcess, SoakLab, wait_until

from shoal.peer.daemon import KNOWN_PEERS_FILE
from shoal.peer.session import JOINED_DIR, MANIFESTS_DIR
from shoal.peer.status.round_ledger import LEDGER_FILE, audit_rounds, read_ledger

EXPERIMENT = "soak"
LAYOUT = [("pub", 4001), ("pub", 4002), ("pub", 4003), ("a1", 4001), ("a1", 4002),
          ("a1", 4003), ("b1", 4001), ("b1", 4002), ("c1", 4001), ("c1", 4002)]  # fmt: skip
TINY = {
    "SHOAL_TASK_OPTIONS": "d_model=32,n_layers=1,n_heads=2,context=32,batch_size=4",
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=15,stall_timeout=3",
}
MAX_DOWN = 2
CALM_PARTITIONS = 1  # a storm: two partitions at once (of four networks), see calm_gap
START_SPACING_S = 8.0  # one torch import at a time
SAMPLE_EVERY_S = 5.0
CHECKPOINT_EVERY_S = 20.0
WARMUP_S = 60.0
MIN_SPAN_S = 120.0
WITNESS_MIN_LIFE_S = 600.0  # a witness' slope counts from this long a life on
WITNESSES = [1, 3]  # p1-pub and p3-a1: a public peer and a NATed one
MEMORY_SHIM = Path(__file__).resolve().with_name("soak_memory")  # --profile-memory
CONVICTED = re.compile(r"(\S+) convicted of cheating in round")
SHUNNED = re.compile(r"left out of our rounds for (\d+) s")
FOUND_LATE = re.compile(r"found the secret of (.+) late: not shunned")
ACTIONS = {"kill": 3, "stop": 3, "restart": 2, "partition": 2, "loss": 2, "clock": 1}


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _identity(home: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "shoal.peer", "id"],
        env={"HOME": str(home), "SHOAL_DATA_DIR": str(home / ".shoal"), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def make_peers(lab: SoakLab, workdir: Path, n: int, env: dict[str, str]) -> list[PeerProcess]:
    layout = LAYOUT[:n]
    homes = [workdir / f"p{i}-{ns}" for i, (ns, _) in enumerate(layout)]
    with ThreadPoolExecutor(len(homes)) as pool:
        ids = list(pool.map(_identity, homes))
    public = [i for i, (ns, _) in enumerate(layout) if ns == "pub"]
    boot = [f"/ip4/198.51.100.10/tcp/{layout[i][1]}/p2p/{ids[i]}" for i in public]
    peers = []
    for i, ((ns, port), home) in enumerate(zip(layout, homes, strict=True)):
        if i == 0:
            args = ["--host-experiment", EXPERIMENT]
        else:
            args = ["--join", f"{EXPERIMENT}@{ids[0]}", "--bootstrap", *boot]
        peers.append(PeerProcess(f"p{i}-{ns}", ns, lab.ns(ns), port, 8100 + i, home, args, env))
    return peers


def _joined(peer: PeerProcess) -> bool:
    """Whether `peer` met the network and holds the experiment (hosts it, or kept the
    manifest its `--join` found)."""
    if not (peer.data_dir / KNOWN_PEERS_FILE).exists():
        return False
    hosts = "--host-experiment" in peer.args
    return hosts or any((peer.data_dir / MANIFESTS_DIR / JOINED_DIR).glob("*.manifest"))


class Chaos:
    """The seeded schedule of faults, and what undoes each one in time."""

    def __init__(
        self,
        lab: SoakLab,
        peers: list[PeerProcess],
        rng: random.Random,
        witnesses: frozenset[str] = frozenset(),
    ) -> None:
        self.lab = lab
        self.peers = peers
        self.rng = rng
        self.witnesses = witnesses  # never killed, stopped or restarted
        self.counts = dict.fromkeys(["kills", "stops", "restarts", "partitions", "losses",
                                     "clock_offsets"], 0)  # fmt: skip
        self._due: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.down: set[str] = set()  # killed, stopped or waiting to start
        self._last_start = -float("inf")
        self._faults: dict[str, Callable[[], None]] = {}  # active network faults -> undo
        self.exits: dict[str, int] = {}  # peers that exited by themselves -> how often
        self.events: list[tuple[float, str]] = []
        self.weather: list[tuple[float, int, int]] = []  # (time, peers down, partitions up)

    def observe(self) -> None:
        """Note how many peers are down and partitions up, when that changed."""
        now = (len(self.down), sum(k.startswith("partition") for k in self._faults))
        if not self.weather or self.weather[-1][1:] != now:
            self.weather.append((time.time(), *now))

    def later(self, delay: float, what: str, action: Callable[[], None]) -> None:
        heapq.heappush(self._due, (time.monotonic() + delay, next(self._seq), what, action))

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))
        log(what)

    def run_due(self) -> None:
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            _, _, _what, action = heapq.heappop(self._due)
            action()

    def revive(self) -> None:
        """A peer that exited by itself (no fault of ours) is a finding: counted, its
        exit code noted, and started again as a supervisor would."""
        for peer in self.peers:
            if peer.proc is None or peer.alive or peer.name in self.down:
                continue
            self.exits[peer.name] = self.exits.get(peer.name, 0) + 1
            self.down.add(peer.name)
            self.note(f"{peer.name} exited by itself (exit code {peer.proc.returncode})")
            self._start(peer)

    def act(self) -> None:
        kinds, weights = zip(*ACTIONS.items(), strict=True)
        kind = self.rng.choices(kinds, weights)[0]
        up = [
            p
            for p in self.peers
            if p.name not in self.down and p.alive and p.name not in self.witnesses
        ]
        if self._never_joined({"a1", "b1", "c1"}):
            # The public peers are everyone's bootstrap peers and the host: a first start
            # with none of them up fails fast by design (`_partition`). Until every peer
            # met the swarm, faults spare them.
            up = [p for p in up if p.ns != "pub"]
        if kind in ("kill", "stop", "restart", "clock") and (len(self.down) >= MAX_DOWN or not up):
            kind = self.rng.choice(["partition", "loss"])
        getattr(self, f"_{kind}")(up)

    def _start(self, peer: PeerProcess, clock: float = 0.0) -> None:
        """Start `peer` once no other start is under way (one torch import at a time)."""
        if time.monotonic() - self._last_start < START_SPACING_S:
            self.later(2.0, f"start {peer.name}", lambda: self._start(peer, clock))
            return
        self._last_start = time.monotonic()
        peer.start(clock_offset_s=clock)
        self.down.discard(peer.name)
        self.note(f"started {peer.name}" + (f" with its clock {clock:+.0f} s off" if clock else ""))

    def _kill(self, up: list[PeerProcess]) -> None:
        peer = self.rng.choice(up)
        peer.kill()
        self.down.add(peer.name)
        self.counts["kills"] += 1
        self.note(f"kill -9 {peer.name}")
        self.later(self.rng.uniform(2, 15), "restart", lambda: self._start(peer))

    def _stop(self, up: list[PeerProcess]) -> None:
        peer = self.rng.choice(up)
        peer.signal(signal.SIGSTOP)
        peer.stopped = True
        self.down.add(peer.name)
        self.counts["stops"] += 1
        seconds = self.rng.uniform(1, 20)
        self.note(f"SIGSTOP {peer.name} for {seconds:.1f} s")

        def cont() -> None:
            peer.signal(signal.SIGCONT)
            peer.stopped = False
            self.down.discard(peer.name)

        self.later(seconds, "cont", cont)

    def _restart(self, up: list[PeerProcess], clock: float = 0.0) -> None:
        peer = self.rng.choice(up)
        self.down.add(peer.name)
        code = peer.terminate()
        self.counts["restarts"] += 1
        self.note(f"restart {peer.name} (exit code {code})")
        self._start(peer, clock)

    def _clock(self, up: list[PeerProcess]) -> None:
        offset = self.rng.choice([-1, 1]) * self.rng.uniform(120, 600)
        peer = self.rng.choice(up)
        self.down.add(peer.name)
        code = peer.terminate()
        self.counts["clock_offsets"] += 1
        self.note(f"restart {peer.name} (exit code {code}) with a wrong clock")
        self._start(peer, offset)

        def fix() -> None:
            if peer.alive and peer.clock_offset_s and peer.name not in self.down:
                self.down.add(peer.name)
                code = peer.terminate()
                self.note(f"restart {peer.name} (exit code {code}) with its clock right")
                self._start(peer)
            elif peer.clock_offset_s:
                self.later(5.0, "fix clock", fix)

        self.later(self.rng.uniform(30, 90), "fix clock", fix)

    def _network_fault(self, key: str, undo: Callable[[], None], seconds: float) -> None:
        self._faults[key] = undo

        def end() -> None:
            if self._faults.pop(key, None) is not None:
                undo()
                self.note(f"ended {key}")

        self.later(seconds, key, end)

    def _partition(self, _: list[PeerProcess]) -> None:
        a, b = sorted(self.rng.sample(["pub", "a1", "b1", "c1"], 2))
        key = f"partition {a}|{b}"
        if key in self._faults or sum(k.startswith("partition") for k in self._faults) >= 2:
            return
        if "pub" in (a, b) and self._never_joined({a, b} - {"pub"}):
            # A peer's first start with every bootstrap peer cut off fails fast by design
            # (most likely a wrong address: `shoal run` says so and exits); the soak is
            # about a swarm that met. After its first join a peer starts anyway.
            return
        seconds = self.rng.uniform(5, 30)
        self._network_fault(key, self.lab.partition(a, b), seconds)
        self.counts["partitions"] += 1
        self.note(f"{key} for {seconds:.1f} s")

    def _never_joined(self, namespaces: set[str]) -> bool:
        """Whether a peer in `namespaces` has not joined the network yet (it saves the
        peers it knows once it has: `peer.daemon.save_known_peers`), or has met the
        network but not found the experiment yet (it keeps its manifest once it has:
        `peer.joined`). A first join cut off from the host for longer than the
        joiner looks for the manifest ends with "unknown experiment" by design."""
        return any(p.ns in namespaces and not _joined(p) for p in self.peers)

    def _loss(self, _: list[PeerProcess]) -> None:
        ns = self.rng.choice(["pub", "a1", "b1", "c1"])
        key = f"loss {ns}"
        if key in self._faults:
            return
        p, seconds = self.rng.uniform(0.01, 0.2), self.rng.uniform(10, 60)
        self._network_fault(key, self.lab.loss(ns, p), seconds)
        self.counts["losses"] += 1
        self.note(f"{key}: {p:.0%} for {seconds:.1f} s")

    def calm(self) -> None:
        """End every fault now: network faults undone, stopped peers continued, peers
        that are down started (a wrong clock stays until its own restart)."""
        for key, undo in list(self._faults.items()):
            undo()
            del self._faults[key]
        for p in self.peers:
            if p.stopped:
                p.signal(signal.SIGCONT)
                p.stopped = False
        self._due.clear()
        for p in self.peers:
            if not p.alive:
                p.start()
        self.down.clear()


class Checks:
    """The invariants measured while the soak runs (from another thread)."""

    def __init__(self, peers: list[PeerProcess]) -> None:
        self.peers = peers
        self.corrupt: dict[str, str] = {}  # file@mtime -> why
        self.checkpoint_loads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        next_checkpoints = time.monotonic() + CHECKPOINT_EVERY_S
        while not self._stop.wait(SAMPLE_EVERY_S):
            now = time.monotonic()
            for p in self.peers:
                p.sample(now)
            if now >= next_checkpoints:
                self.check_checkpoints()
                next_checkpoints = now + CHECKPOINT_EVERY_S

    def check_checkpoints(self) -> None:
        for p in self.peers:
            for path in sorted((p.data_dir / "checkpoints").rglob("*.pt")):
                try:
                    mtime = path.stat().st_mtime
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        state = torch.load(path, map_location="cpu", weights_only=True)
                except FileNotFoundError:
                    continue  # replaced between the listing and the read
                except Exception as e:
                    self.corrupt[f"{path}@{mtime}"] = f"{type(e).__name__}: {e}"[:200]
                    continue
                if not isinstance(state, dict) or "format" not in state:
                    self.corrupt[f"{path}@{mtime}"] = "not a shoal checkpoint"
                self.checkpoint_loads += 1


def slope_per_hour(series: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) in units of y per hour."""
    n = len(series)
    mt = sum(t for t, _ in series) / n
    my = sum(y for _, y in series) / n
    var = sum((t - mt) ** 2 for t, _ in series)
    return 0.0 if var == 0 else 3600 * sum((t - mt) * (y - my) for t, y in series) / var


def _slopes(life: list[tuple[float, float, int]]) -> tuple[float, float]:
    """(RSS MB/hour, descriptors/hour) of one lifetime's samples."""
    rss = slope_per_hour([(t, m) for t, m, _ in life])
    fds = slope_per_hour([(t, float(f)) for t, _, f in life])
    return rss, fds


def _curve(life: list[tuple[float, float, int]]) -> list[list[float]]:
    """About 20 points of (minutes since the start, RSS MB, descriptors)."""
    step = max(1, len(life) // 20)
    return [[round((t - life[0][0]) / 60, 1), round(mb, 1), f] for t, mb, f in life[::step]]


def growth(peers: list[PeerProcess], witnesses: frozenset[str]) -> dict[str, Any]:
    rss, fds = [], []
    for p in peers:
        for life in p.lifetimes:
            if not life:
                continue
            start = life[0][0]
            measured = [s for s in life if s[0] - start >= WARMUP_S]
            if len(measured) < 3 or measured[-1][0] - measured[0][0] < MIN_SPAN_S:
                continue
            r, f = _slopes(measured)
            rss.append(r)
            fds.append(f)

    def median(xs: list[float]) -> float | None:
        return None if not xs else round(sorted(xs)[len(xs) // 2], 1)

    # The witnesses' one long life each: slopes over its second half (steady state).
    steady: dict[str, dict[str, Any]] = {}
    for p in peers:
        lives = [life for life in p.lifetimes if life]
        if p.name not in witnesses or not lives:
            continue
        life = max(lives, key=len)
        span = life[-1][0] - life[0][0]
        half = [s for s in life if s[0] - life[0][0] >= span / 2]
        r, f = _slopes(half) if len(half) >= 3 else (None, None)
        steady[p.name] = {
            "minutes": round(span / 60, 1),
            "rss_MB_per_hour_second_half": None if r is None else round(r, 1),
            "fd_per_hour_second_half": None if f is None else round(f, 1),
            "curve_min_MB_fds": _curve(life),
        }
    long = [w for w in steady.values() if w["minutes"] * 60 >= WITNESS_MIN_LIFE_S]
    lives = [(p.name, life) for p in peers for life in p.lifetimes if life]
    name, longest = max(lives, key=lambda x: x[1][-1][0] - x[1][0][0], default=("", []))
    return {
        "rss_growth_MB_per_hour": max(w["rss_MB_per_hour_second_half"] for w in long)
        if long
        else median(rss),
        "fd_growth_per_hour": max(w["fd_per_hour_second_half"] for w in long)
        if long
        else median(fds),
        "growth_measured_on": "witnesses, second half" if long else "lifetimes, median",
        "witnesses": steady,
        "rss_growth_MB_per_hour_lifetimes": median(rss),
        "fd_growth_per_hour_lifetimes": median(fds),
        "rss_growth_MB_per_hour_max": None if not rss else round(max(rss), 1),
        "fd_growth_per_hour_max": None if not fds else round(max(fds), 1),
        "lifetimes_measured": len(rss),
        # the longest-lived process' RSS and descriptors (minutes since its start, MB,
        # fds): the shape of the curve says warm-up from leak better than one slope
        "rss_longest_life": {"peer": name, "samples": _curve(longest) if longest else []},
    }


def commit_times(entries: list[dict[str, Any]]) -> list[float]:
    """When each round of 2+ peers committed (its earliest member's entry), in order."""
    times: dict[str, float] = {}
    for e in entries:
        rid, t = e.get("round"), e.get("real_t")
        if e.get("outcome") == "committed" and len(e.get("members") or ()) >= 2 and rid:
            times[rid] = min(times.get(rid, t), t)
    return sorted(times.values())


def commit_gaps(entries: list[dict[str, Any]], end: float) -> tuple[float | None, float | None]:
    """(seconds from the first commit of 2+ peers to ..., the largest gap between two
    such commits or from the last one to `end`)."""
    ordered = commit_times(entries)
    if not ordered:
        return None, None
    gaps = [b - a for a, b in itertools.pairwise(ordered)] + [end - ordered[-1]]
    return ordered[0], round(max(gaps), 1)


def calm_gap(
    times: list[float], weather: list[tuple[float, int, int]], end: float
) -> tuple[float | None, float]:
    """(the longest stretch without a commit of 2+ peers while the swarm was calm, the
    share of the time from the first commit to `end` that was calm). Calm: at most
    MAX_DOWN peers down and at most CALM_PARTITIONS partitions up; `weather` says
    from when on how many were (time, down, partitions), in order."""
    if not times:
        return None, 0.0
    changes = sorted(weather)
    longest, calm_total = 0.0, 0.0
    for a, b in itertools.pairwise([*times, end]):
        run_start: float | None = None
        # The weather in force at `a`, then each change within (a, b).
        state = [w for w in changes if w[0] <= a][-1:] or [(a, 0, 0)]
        marks = [(a, *state[0][1:])] + [w for w in changes if a < w[0] < b] + [(b, 0, 0)]
        for (t0, down, parts), (t1, _, _) in itertools.pairwise(marks):
            if down <= MAX_DOWN and parts <= CALM_PARTITIONS:
                calm_total += t1 - t0
                run_start = t0 if run_start is None else run_start
                longest = max(longest, t1 - run_start)
            else:
                run_start = None
    return round(longest, 1), round(calm_total / max(end - times[0], 1e-9), 2)


def longest_gaps(
    entries: list[dict[str, Any]], weather: list[tuple[float, int, int]], end: float, top: int = 3
) -> list[dict[str, Any]]:
    """The `top` longest gaps between commits of 2+ peers, each taken apart: when it
    began, the worst weather in it (peers down, partitions up), and every round a peer
    ended within it (or ended it with): outcome, group size, seconds, and its tries
    (matchmaking s, averaging s, group size, how it ended, the peers it left out,
    by the last 8 characters of their IDs; `averager.Attempt`)."""
    times = commit_times(entries)
    spans = sorted(itertools.pairwise([*times, end]), key=lambda ab: ab[0] - ab[1])[:top]
    out = []
    for a, b in spans:
        state = [w for w in sorted(weather) if w[0] <= a][-1:]
        inside = state + [w for w in weather if a < w[0] < b]
        rounds = [
            {"t": round(e["real_t"] - a, 1), "peer": e.get("peer", "")[-8:],
             "outcome": e.get("outcome"), "size": len(e.get("members") or ()),
             "seconds": e.get("seconds"),
             "tries": [[t.get("matchmaking_s"), t.get("averaging_s"), t.get("group_size"),
                        t.get("outcome"), [x[-8:] for x in t.get("excluded") or ()]]
                       for t in e.get("attempts") or ()]}
            for e in sorted(entries, key=lambda e: e["real_t"])
            if a < e["real_t"] <= b + 1.0
        ]  # fmt: skip
        out.append({
            "at": time.strftime("%H:%M:%S", time.gmtime(a)), "s": round(b - a, 1),
            "max_down": max((w[1] for w in inside), default=0),
            "max_partitions": max((w[2] for w in inside), default=0), "rounds": rounds,
        })  # fmt: skip
    return out


def real_times(peer: PeerProcess, entries: list[dict[str, Any]]) -> None:
    """A peer with a wrong clock wrote wrong times: each entry gets `real_t`, its time
    less the offset of the process lifetime that wrote it. An entry that fits several
    lifetimes (a clock minutes back lands in an earlier lifetime's window) keeps every
    candidate in `real_t_candidates`, for `settle_times` to pick among."""
    lives = peer.started_at  # (real start, offset), in order
    for e in entries:
        t = float(e.get("t", 0.0))
        candidates = []
        for i, (began, offset) in enumerate(lives):
            ends = lives[i + 1][0] if i + 1 < len(lives) else float("inf")
            if began - 1.0 <= t - offset < ends:
                candidates.append(t - offset)
        e["real_t_candidates"] = candidates or [t]
        e["real_t"] = e["real_t_candidates"][0]


def settle_times(entries: list[dict[str, Any]]) -> None:
    """Pick each ambiguous entry's time: the candidate nearest the time its round's
    unambiguous entries give (the members of a round commit within seconds), else
    the earliest, as before."""
    anchors: dict[str, float] = {}
    for e in entries:
        cands = e.get("real_t_candidates") or [e.get("real_t", 0.0)]
        rid = e.get("round")
        if len(cands) == 1 and isinstance(rid, str):
            anchors[rid] = min(anchors.get(rid, cands[0]), cands[0])
    for e in entries:
        cands = e.get("real_t_candidates") or [e.get("real_t", 0.0)]
        if len(cands) > 1:
            anchor = anchors.get(e.get("round"))  # type: ignore[arg-type]
            if anchor is not None:
                e["real_t"] = min(cands, key=lambda c: abs(c - anchor))


def stop_all(peers: list[PeerProcess], timeout: float = 30.0) -> dict[str, int | None]:
    """SIGTERM to every peer at once (each writes its checkpoint on the way out); the
    exit codes (None: killed after `timeout`)."""
    for p in peers:
        p.signal(signal.SIGCONT)
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes: dict[str, int | None] = {}
    for p in peers:
        if p.proc is None:
            continue
        try:
            codes[p.name] = p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            codes[p.name] = None
    return codes


def log_findings(peers: list[PeerProcess]) -> dict[str, Any]:
    """What the logs say that the ledgers do not: convictions (no peer cheats here, so
    every one is false) and ERROR lines (each a bug or an unhandled remote input)."""
    convicted, errors = set(), Counter()
    shuns: list[int] = []
    found_late = 0
    for p in peers:
        text = p.log_path.read_text(errors="replace")
        convicted.update(CONVICTED.findall(text))
        shuns += [int(s) for s in SHUNNED.findall(text)]
        found_late += sum(len(m.split(", ")) for m in FOUND_LATE.findall(text))
        for line in text.splitlines():
            if " ERROR " in line:
                errors[line.split(" ERROR ", 1)[1][:80]] += 1
    return {
        "false_convictions": len(convicted),
        "log_errors": sum(errors.values()),
        "log_error_kinds": dict(errors.most_common(5)),
        # Verification's shuns of (honest) peers: a withheld secret or a missing reveal.
        "shuns": len(shuns),
        "shun_seconds": sum(shuns),
        "secrets_found_late": found_late,
    }


def run_chaos(chaos: Chaos, rng: random.Random, minutes: float) -> None:
    started = time.monotonic()
    next_action = started
    while time.monotonic() - started < minutes * 60:
        chaos.run_due()
        chaos.revive()
        if time.monotonic() >= next_action:
            chaos.act()
            next_action = time.monotonic() + rng.uniform(0.5, 5.0)
        chaos.observe()
        time.sleep(0.1)


def profile_memory(witnesses: list[PeerProcess], workdir: Path) -> None:
    """Snapshots of where the witnesses' memory goes (bench/soak_memory), every 10 min."""
    for p in witnesses:
        p.env = {  # (a copy: the peers share one environment)
            **p.env, "SHOAL_SOAK_MEMORY_DIR": str(workdir / f"{p.name}-memory"),
            "PYTHONPATH": str(MEMORY_SHIM),
        }  # fmt: skip
        log(f"{p.name}: tracemalloc on, snapshots in {p.env['SHOAL_SOAK_MEMORY_DIR']}")


def soak(args: argparse.Namespace, lab: SoakLab, workdir: Path) -> dict[str, Any]:
    env = {"SHOAL_CHECKPOINT_INTERVAL": "15", "SHOAL_THREADS": "1", "OMP_NUM_THREADS": "1",
           **(TINY if args.tiny else {})}  # fmt: skip
    peers = make_peers(lab, workdir, args.peers, env)
    checks = Checks(peers)
    try:
        rng = random.Random(args.seed)
        witnesses = frozenset(peers[i].name for i in WITNESSES[: args.witnesses])
        if args.profile_memory:
            profile_memory([p for p in peers if p.name in witnesses], workdir)
        chaos = Chaos(lab, peers, rng, witnesses)
        for p in peers:
            p.start()
            time.sleep(1.0 if p is peers[0] else 0.2)
        checks.start()
        log(f"{len(peers)} peers started in {workdir}; waiting for the first round of 2+")
        began = time.time()
        if wait_until(lambda: _ledger_commits(peers) > 0, args.warmup_s):
            log(f"first commit after {time.time() - began:.0f} s")
        log(f"chaos for {args.minutes} min")
        run_chaos(chaos, rng, args.minutes)
        chaos.calm()
        chaos.observe()
        log(f"faults over; {args.settle_s:.0f} s to settle")
        time.sleep(args.settle_s)
        end = time.time()
        codes = stop_all(peers)
        checks.stop()
        checks.check_checkpoints()
    finally:
        checks.stop()
        for p in peers:
            with contextlib.suppress(Exception):
                p.kill()
    entries: list[dict[str, Any]] = []
    for p in peers:
        mine = read_ledger(p.data_dir / LEDGER_FILE)
        real_times(p, mine)
        entries += mine
    settle_times(entries)
    first, max_gap = commit_gaps(entries, end)
    max_calm_gap, calm_share = calm_gap(commit_times(entries), chaos.weather, end)
    return {
        "minutes": args.minutes,
        **chaos.counts,
        **audit_rounds(entries),
        "corrupt_checkpoints": len(checks.corrupt),
        "max_commit_gap_s": max_gap,
        "max_calm_commit_gap_s": max_calm_gap,
        "calm_share": calm_share,
        **growth(peers, chaos.witnesses),
        "longest_gaps": longest_gaps(entries, chaos.weather, end),
        "unexpected_exits": sum(chaos.exits.values()),
        "unexpected_exits_by_peer": chaos.exits,
        **log_findings(peers),
        "checkpoint_loads": checks.checkpoint_loads,
        "ledger_entries": len(entries),
        "first_commit_after_s": None if first is None else round(first - began, 1),
        "exit_codes": codes,
        "corrupt": list(checks.corrupt.items())[:10],
        "seed": args.seed,
        "peers": len(peers),
        "tiny": args.tiny,
        "workdir": str(workdir),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--peers", type=int, default=10, choices=range(4, 11))
    ap.add_argument("--tiny", action="store_true", help="a small model and short deadlines")
    ap.add_argument("--witnesses", type=int, default=2, choices=range(0, 3),
                    help="peers never killed, stopped or restarted (their long life "
                    "measures memory and descriptor growth)")  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--profile-memory", action="store_true",
                    help="tracemalloc and malloc statistics of the witnesses")  # fmt: skip
    ap.add_argument("--settle-s", type=float, default=20.0, help="fault-free time at the end")
    ap.add_argument("--prefix", default="soak-", help="of the lab's namespaces")
    ap.add_argument("--warmup-s", type=float, default=240.0,
                    help="at most this long for the first commit before the chaos starts "
                    "(0: chaos while the peers start)")  # fmt: skip
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shoal-soak-"))
    lab = SoakLab(args.prefix)
    lab.up()
    try:
        result = soak(args, lab, workdir)
    finally:
        lab.down()
    print(json.dumps(result))


def _ledger_commits(peers: list[PeerProcess]) -> int:
    entries = [e for p in peers for e in read_ledger(p.data_dir / LEDGER_FILE)]
    return sum(
        1 for e in entries if e.get("outcome") == "committed" and len(e.get("members") or ()) > 1
    )


if __name__ == "__main__":
    main()
