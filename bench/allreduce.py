"""All-reduce benchmark: shoal's butterfly all-reduce against torch.distributed gloo (and hivemind).

    python bench/allreduce.py [--peers 4] [--sizes 10M,50M] [--rounds 5] [--codecs none,int8,topk]

Prints one JSON object on stdout (logs go to stderr):

    {"peers": 4,
     "sizes": {"10M": {"gloo_s": ..., "hivemind_s": ... | null,
                       "shoal_s": {"none": ..., "fp16": ..., "int8": ...},
                       "shoal_wire_bytes": {"none": ..., "int8": ...}}, ...},
     "kill_to_commit_s": ...,
     "loop_lag_p99_ms": ..., "loop_lag_baseline_p99_ms": ..., ...,
     "status_p50_ms": ..., "status_p99_ms": ..., "status_max_ms": ..., "status_unanswered": ...,
     "rss_max_mb": ..., "work_log_disk_max_mb": ...}

hivemind (1.1.12's DecentralizedAverager, `pip install hivemind==1.1.12`) is
measured in the same run when it is installed: the group formed first, then
timed from allow_allreduce() to the result, as hivemind's optimizer schedules
rounds (`hivemind_s`, `shoal_none_over_hivemind`). `loop_lag_p99_ms` comes from
`--peers` real daemons training a `--loop-lag-size` model while /status is
polled 10 times a second (see bench_loop_lag); the baseline is the same ticker
in an idle process during the same minute. `status_*_ms` are how long those polls
took to answer, `status_unanswered` those that failed or took past 5 s;
`rss_max_mb` is the largest peak resident memory (VmHWM) of a daemon, and
`work_log_disk_max_mb` the most one daemon's work log held on disk.
`--sizes ""` skips the all-reduce phase, `--kill-trials 0` the kill trials, so
that the loop-lag phase runs alone:

    python bench/allreduce.py --sizes "" --kill-trials 0 --no-gloo --peers 4 \
        --loop-lag-size 50M --loop-lag-seconds 60

Every system runs as `--peers` separate processes on 127.0.0.1, each
averaging its own float32 vector of the given size. Times are medians over
`--rounds` rounds (after one warm-up round) of the slowest peer's time for
the round, each round started by the orchestrator at once on every peer.
The systems take turns round by round (a gloo round, then a shoal round), so
that a machine shared with other work loads them alike; beside each ratio of
medians, `*_paired` is the median of the round-by-round ratios, `cpu_s` the
median CPU seconds of all peers together per round, and `load_average` the
machine's load at the end. `shoal_wire_bytes` is what all peers together put
on the wire in one round (after compression, before encryption overhead). `kill_to_commit_s` (from
`--kill-trials` trials with the full Averager: matchmaking, all-reduce, retry):
time from a kill -9 of one peer in the middle of a round to the next round
the survivors commit.

Sparse codecs (`topk`, `dct` in `--codecs`, density `--sparse-density`, values of
`--sparse-bits` bits, the chunk DiLoCo uses by default) are measured the way
DiLoCo runs them: each peer codes its vector, the peers gather their messages in
signed slots over the butterfly's owner-written union (`averaging/sparse_gather.py`:
each slot sent only by its owner, to the others), and each decodes the weighted
mean. Their `seconds` cover coding, the round and decoding; `shoal_wire_bytes` is
from the links as for the others (`wire_bytes_per_peer`: divided by `--peers`),
`sparse_message_bytes` is one peer's message, and `none_over_topk_wire` (etc.)
the dense codecs' bytes over the sparse one's.

Workers talk to the orchestrator in JSON lines (commands on stdin, results on
stdout) and exit when their stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.allreduce")
SCRIPT = os.path.abspath(__file__)
CODECS = ("none", "fp16", "int8")
SPARSE = ("topk", "dct")
STATUS_TIMEOUT_S = 5.0  # the loop-lag phase: a /status slower than this is unanswered


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vector(rank: int, size: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(size, generator=g)


# ---------------------------------------------------------------------- workers


async def _lines() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=16 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def _cpu_now() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all threads, microsecond resolution
    return usage.ru_utime, usage.ru_stime


def _cpu_since(start: tuple[float, float]) -> dict[str, float]:
    """CPU seconds of this process (all threads) since `start`: total and in the kernel."""
    user, system = _cpu_now()
    return {"cpu": user - start[0] + system - start[1], "sys": system - start[1]}


def _say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def worker_gloo(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    reader = await _lines()
    _say({"ready": True})
    cmd = json.loads(await reader.readline())
    await asyncio.to_thread(
        dist.init_process_group,
        "gloo",
        init_method=f"tcp://127.0.0.1:{cmd['port']}",
        rank=args.rank,
        world_size=cmd["peers"],
    )
    _say({"joined": True})
    vectors: dict[int, torch.Tensor] = {}
    while line := await reader.readline():
        cmd = json.loads(line)
        size = cmd["size"]
        if size not in vectors:
            vectors = {size: _vector(args.rank, size)}
            t = torch.empty(size)
        t.copy_(vectors[size])  # a fresh input, in memory that is already mapped
        c0, t0 = _cpu_now(), time.perf_counter()
        await asyncio.to_thread(dist.all_reduce, t)
        _say({"seconds": time.perf_counter() - t0, **_cpu_since(c0)})
    dist.destroy_process_group()


async def worker_shoal(args: argparse.Namespace) -> None:
    import torch

    from shoal.averaging.allreduce import AllReduceConfig, AllReduceService
    from shoal.averaging.group import Group, Member, make_round_id
    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity, PeerID
    from shoal.transport.multiaddr import Multiaddr

    reader = await _lines()
    host = Host(Identity.generate(), HostConfig(listen=("/ip4/127.0.0.1/tcp/0",)))
    await host.start()
    overrides: dict[str, Any] = {}
    if args.chunk_bytes:
        overrides["chunk_bytes"] = args.chunk_bytes
    if args.streams:
        overrides["streams_per_peer"] = args.streams
    if args.role == "shoal_sparse":
        overrides["reduction"] = "union"
    service = AllReduceService(host, AllReduceConfig(**overrides))
    _say({"peer": host.peer_id.to_base58(), "addrs": [str(a) for a in host.addresses()]})
    cmd = json.loads(await reader.readline())
    members = tuple(
        Member(PeerID.from_base58(p), tuple(Multiaddr(a) for a in addrs))
        for p, addrs in cmd["members"]
    )
    for m in members:
        if m.peer_id != host.peer_id and m.peer_id > host.peer_id:
            await host.connect(m.peer_id, m.addrs)
    _say({"connected": True})
    vectors: dict[int, torch.Tensor] = {}
    profiler = None
    if args.profile_dir:
        import cProfile

        # The event loop's thread only, on its own CPU clock (preemption by other
        # processes is not charged); reductions sent to threads are not in it.
        profiler = cProfile.Profile(time.thread_time)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            size = cmd["size"]
            if size not in vectors:
                vectors = {size: _vector(args.rank, size)}
                t = torch.empty(size)
            t.copy_(vectors[size])  # a fresh input, in memory that is already mapped
            ids = [m.peer_id for m in members]
            group = Group("bench", make_round_id("bench", ids, cmd["round"].encode()), members)
            c0, t0 = _cpu_now(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            extra: dict[str, Any] = {}
            if cmd["codec"] in SPARSE:
                outcome, extra = await _sparse_round(args, service, host, group, t, cmd)
            else:
                outcome = await service.run(group, [t], weight=1.0, codec=cmd["codec"])
            if profiler is not None:
                profiler.disable()
            _say(
                {
                    "seconds": time.perf_counter() - t0,
                    **_cpu_since(c0),
                    "committed": outcome.committed,
                    "reason": outcome.reason,
                    "bytes_sent": outcome.bytes_sent,
                    **extra,
                }
            )
    finally:
        service.close()
        await host.aclose()
        if profiler is not None:
            profiler.dump_stats(os.path.join(args.profile_dir, f"shoal-{args.rank}.prof"))


async def _sparse_round(
    args: argparse.Namespace, service: Any, host: Any, group: Any, t: Any, cmd: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """One DiLoCo-style sparse round: code `t`, gather the messages, decode the mean
    into `t` (timed parts in the reply)."""
    import torch

    from shoal.averaging.diloco_options import DiLoCoOptions
    from shoal.averaging.sparse_codec import SparseCodec
    from shoal.averaging.sparse_gather import SparseGather

    options = DiLoCoOptions.parse(
        {
            "codec": cmd["codec"],
            "codec_density": args.sparse_density,
            "codec_bits": args.sparse_bits,
        }
    )
    codec = SparseCodec.from_density(
        options.codec, options.sparse_chunk, options.codec_density, options.codec_bits
    )
    gather = SparseGather(codec, t.numel())
    t0 = time.perf_counter()
    message = await asyncio.to_thread(codec.encode, t)
    t1 = time.perf_counter()
    slots = torch.empty(gather.words(group.size))
    me = group.index(host.peer_id)
    gather.fill(slots, group.round_id, me, 1.0, message, host.identity.sign)
    outcome = await service.run(group, [slots], weight=1.0, codec="none")
    t2 = time.perf_counter()
    if outcome.committed:
        await asyncio.to_thread(gather.mean_into, slots, t, group.round_id, group.peer_ids)
    t3 = time.perf_counter()
    return outcome, {
        "encode_s": t1 - t0,
        "decode_s": t3 - t2,
        "message_bytes": len(message),
    }


async def worker_hivemind(args: argparse.Namespace) -> None:
    """hivemind 1.1.12's DecentralizedAverager, measured as hivemind's own optimizer
    uses it with pre-scheduled rounds: the group is formed first (step with
    require_trigger), then the clock runs from allow_allreduce() to the result."""
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage

    reader = await _lines()
    cmd = json.loads(await reader.readline())
    dht = await asyncio.to_thread(
        hivemind.DHT,
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=cmd["initial_peers"],
    )
    _say({"maddrs": [str(a) for a in dht.get_visible_maddrs()]})
    averager: Any = None
    vector: torch.Tensor | None = None
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            size = cmd["size"]
            if vector is None or vector.numel() != size:
                if averager is not None:
                    await asyncio.to_thread(averager.shutdown)
                vector = _vector(args.rank, size)
                # In the main thread: hivemind installs signal handlers there.
                averager = hivemind.averaging.DecentralizedAverager(
                    [torch.zeros(size)],
                    dht,
                    start=True,
                    prefix=f"bench{size}",
                    target_group_size=cmd["peers"],
                    min_group_size=cmd["peers"],
                    min_matchmaking_time=1.0,
                )
            with averager.get_tensors() as tensors:
                tensors[0].copy_(vector)  # a fresh input, as the other systems get
            control = averager.step(wait=False, require_trigger=True, timeout=300)
            # hivemind offers no event for this stage: poll it.
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            _say({"grouped": not control.done()})
            await reader.readline()  # "go", sent once every peer has its group
            t0 = time.perf_counter()
            control.allow_allreduce()
            gathered = await asyncio.to_thread(control.result)
            _say(
                {
                    "seconds": time.perf_counter() - t0,
                    # The averaging runs in hivemind's own processes (the averager
                    # and p2pd): this process's CPU clock does not see it.
                    "cpu": None,
                    "sys": None,
                    "committed": gathered is not None,
                    "reason": "" if gathered is not None else "hivemind step failed",
                }
            )
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


# ---------------------------------------------------------------------- orchestrator


class Proc:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, role: str, rank: int, *extra: str, ready: bool = True) -> tuple[Proc, Any]:
        """`ready`: the worker says hello first (else it waits for a command)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, SCRIPT, "--role", role, "--rank", str(rank), *extra,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        self = cls(proc)
        return self, (await self.reply() if ready else None)

    async def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        await self.proc.stdin.drain()

    async def reply(self, timeout: float = 300) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError("worker exited")
        return json.loads(line)

    async def call(self, obj: dict[str, Any]) -> dict[str, Any]:
        await self.send(obj)
        return await self.reply()

    async def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _round(procs: list[Proc], cmd: dict[str, Any]) -> dict[str, Any]:
    """One round on every peer at once: the slowest peer's reply, with totals over peers."""
    replies = await asyncio.gather(*(p.call(cmd) for p in procs))
    return _slowest(replies)


async def _round_hivemind(procs: list[Proc], cmd: dict[str, Any]) -> dict[str, Any]:
    """Every peer forms its group, then all start the all-reduce at once."""
    grouped = await asyncio.gather(*(p.call({**cmd, "peers": len(procs)}) for p in procs))
    if not all(g["grouped"] for g in grouped):
        raise RuntimeError("hivemind: no group formed")
    return _slowest(await asyncio.gather(*(p.call({"go": True}) for p in procs)))


def _slowest(replies: list[dict[str, Any]]) -> dict[str, Any]:
    bad = [x for x in replies if x.get("committed") is False]
    if bad:
        raise RuntimeError(f"round aborted: {bad[0]['reason']}")
    slowest = max(replies, key=lambda x: x["seconds"])
    cpu_known = all(x["cpu"] is not None for x in replies)
    return {
        **slowest,
        "bytes_sent": sum(x.get("bytes_sent", 0) for x in replies),
        "cpu": sum(x["cpu"] for x in replies) if cpu_known else None,
        "sys": sum(x["sys"] for x in replies) if cpu_known else None,
    }


async def _spawn_hivemind(opts: argparse.Namespace) -> list[Proc]:
    first, _ = await Proc.spawn("hivemind", 0, ready=False)
    hello = await first.call({"initial_peers": []})
    rest = await asyncio.gather(
        *(Proc.spawn("hivemind", r, ready=False) for r in range(1, opts.peers))
    )
    procs = [first, *(p for p, _ in rest)]
    await asyncio.gather(*(p.call({"initial_peers": hello["maddrs"]}) for p in procs[1:]))
    return procs


async def _spawn_gloo(opts: argparse.Namespace) -> list[Proc]:
    spawned = await asyncio.gather(*(Proc.spawn("gloo", r) for r in range(opts.peers)))
    procs = [p for p, _ in spawned]
    port = _free_port()
    await asyncio.gather(*(p.call({"port": port, "peers": opts.peers}) for p in procs))
    return procs


async def _spawn_shoal(opts: argparse.Namespace, role: str = "shoal") -> list[Proc]:
    extra = ["--chunk-bytes", str(opts.chunk_bytes), "--streams", str(opts.streams)]
    extra += ["--sparse-density", str(opts.sparse_density), "--sparse-bits", str(opts.sparse_bits)]
    if opts.profile_dir:
        extra += ["--profile-dir", opts.profile_dir]
    spawned = await asyncio.gather(*(Proc.spawn(role, r, *extra) for r in range(opts.peers)))
    procs = [p for p, _ in spawned]
    members = [[hello["peer"], hello["addrs"]] for _, hello in spawned]
    await asyncio.gather(*(p.call({"members": members}) for p in procs))
    return procs


async def bench_interleaved(opts: argparse.Namespace, sizes: dict[str, int]) -> dict[str, Any]:
    """gloo and shoal take turns, round after round, so that both see the same background
    load: per size and codec, a gloo round then a shoal round, `rounds` times after a
    warm-up turn. (Codecs do not alternate from one shoal round to the next: a peer
    keeps the buffers of its last round for the next one, as in training.)"""
    codecs = opts.codecs.split(",")
    gloo: list[Proc] = []
    shoal: list[Proc] = []
    sparse: list[Proc] = []
    hivemind: list[Proc] = []
    try:
        if opts.gloo:
            gloo = await _spawn_gloo(opts)
        shoal = await _spawn_shoal(opts)
        if any(c in SPARSE for c in codecs):
            sparse = await _spawn_shoal(opts, "shoal_sparse")
        if opts.hivemind and _hivemind_installed():
            hivemind = await _spawn_hivemind(opts)
        result: dict[str, Any] = {}
        for name, size in sizes.items():
            runs: dict[str, list[dict[str, Any]]] = {
                "gloo": [],
                "hivemind": [],
                **{c: [] for c in codecs},
            }
            paired: dict[str, list[float]] = {}
            for codec in codecs:
                for r in range(opts.rounds + 1):
                    g = await _round(gloo, {"size": size}) if gloo else None
                    cmd = {"size": size, "codec": codec, "round": f"{name}-{codec}-{r}"}
                    s = await _round(sparse if codec in SPARSE else shoal, cmd)
                    # hivemind without compression, beside shoal's "none" turns.
                    h = None
                    if hivemind and codec == codecs[0]:
                        h = await _round_hivemind(hivemind, {"size": size})
                    if r:  # the first turn warms up
                        runs[codec].append(s)
                        if h is not None:
                            runs["hivemind"].append(h)
                        if g is not None:
                            runs["gloo"].append(g)
                            paired.setdefault(codec, []).append(s["seconds"] / g["seconds"])
            result[name] = {system: _summary(name, system, rs) for system, rs in runs.items() if rs}
            for codec, ratios in paired.items():
                result[name][codec]["paired"] = statistics.median(ratios)
        return result
    finally:
        await asyncio.gather(*(p.close() for p in gloo + shoal + sparse + hivemind))


def _summary(name: str, system: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "all_seconds": [round(r["seconds"], 4) for r in runs],
        "wire": int(statistics.median(r["bytes_sent"] for r in runs)),
        "cpu": None,
        "sys": None,
    }
    for key in ("encode_s", "decode_s", "message_bytes"):
        if all(key in r for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    if all(r["cpu"] is not None for r in runs):
        out["cpu"] = statistics.median(r["cpu"] for r in runs)
        out["sys"] = statistics.median(r["sys"] for r in runs)
    log.info(
        "%s %s: %.3f s (cpu of all peers %s s, %s s of it in the kernel), %d bytes",
        *(system, name, out["seconds"], out["cpu"], out["sys"], out["wire"]),
    )
    return out


PEER_SCRIPT = os.path.join(os.path.dirname(SCRIPT), "..", "tests", "averaging_peer.py")


async def bench_kill_to_commit(opts: argparse.Namespace) -> list[float]:
    """Full Averager peers (tests/averaging_peer.py) averaging 10M floats in a loop;
    kill -9 one mid-round, time until the survivors' next commit without it."""
    args = ["--size", str(opts.kill_size), "--min-group", "2", "--target-group", "8",
            "--stall-timeout", "3"]  # fmt: skip
    procs: list[asyncio.subprocess.Process] = []
    hello: list[dict[str, Any]] = []

    async def spawn(boot: list[str]) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, PEER_SCRIPT, *args, *boot,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        hello.append(json.loads(await proc.stdout.readline()))

    async def next_commit(i: int) -> dict[str, Any]:
        stdout = procs[i].stdout
        assert stdout is not None
        while True:
            r = json.loads(await asyncio.wait_for(stdout.readline(), 120))
            if r.get("event") == "step" and r["committed"]:
                return r

    times = []
    try:
        await spawn([])
        for _ in range(opts.peers):
            await spawn(["--bootstrap", hello[0]["addr"]])
        alive = list(range(len(procs)))
        for _ in range(opts.kill_trials):
            first = await next_commit(alive[-1])
            victim = alive.pop(0)
            await asyncio.sleep(first["seconds"] * 0.4)  # inside the next round
            procs[victim].kill()
            killed = time.time()
            dead = hello[victim]["peer"]
            while dead in (r := await next_commit(alive[-1]))["members"]:
                pass
            times.append(r["t"] - killed)
            log.info("kill -9 to next commit: %.2f s", times[-1])
            await spawn(["--bootstrap", hello[alive[-1]]["addr"]])
            alive.append(len(procs) - 1)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    return times


def bench_loop_lag(opts: argparse.Namespace) -> dict[str, Any]:
    """`--peers` real daemons (`shoal run`, tests/daemon_harness.py) training a model of
    about `--loop-lag-size` parameters with DiLoCo, rounds every 2 inner steps, while
    each daemon's /status is polled 10 times a second; after `--loop-lag-seconds` of
    rounds, each daemon's own event-loop ticker (/status loop_lag_ms, over the last
    minute) gives the lag. What is reported is the worst peer's."""
    import tempfile
    import threading

    sys.path.insert(0, os.path.join(os.path.dirname(SCRIPT), "..", "tests"))
    from daemon_harness import Daemon, wait_for

    size = _parse_size(opts.loop_lag_size)
    d_model = 512
    n_layers = max(1, round(size / (12 * d_model * d_model)))
    env = {
        "SHOAL_TASK_OPTIONS": f"d_model={d_model},n_layers={n_layers},n_heads=8,context=16,"
        "batch_size=1",
        "SHOAL_INNER_STEPS": "2",
        "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=60,stall_timeout=10",
        "SHOAL_CHECKPOINT_INTERVAL": "100000",
    }
    stop = threading.Event()
    answers: list[float] = []  # seconds each /status took to answer, every daemon
    unanswered = [0]  # polls that failed or took past STATUS_TIMEOUT_S
    measuring = threading.Event()

    def poll(d: Daemon) -> None:
        while not stop.wait(0.1):
            asked = time.monotonic()
            try:
                d.get("/status", timeout=STATUS_TIMEOUT_S)
            except OSError:
                if measuring.is_set():
                    unanswered[0] += 1
                continue
            if measuring.is_set():
                answers.append(time.monotonic() - asked)

    disk = [0]  # the most bytes of spilled work-log states one daemon held on disk

    def sample_disk(ds: list[Daemon]) -> None:
        while not stop.wait(1.0):
            for d in list(ds):
                held = 0
                for f in (d.data_dir / "work-log").rglob("*"):
                    with contextlib.suppress(OSError):  # let go of while we looked
                        held += f.stat().st_size
                disk[0] = max(disk[0], held)

    keep = opts.loop_lag_keep
    with tempfile.TemporaryDirectory() if keep is None else contextlib.nullcontext(keep) as work:
        host = Daemon("lag-host", Path(work), ["--host-experiment", "lag"], env)
        daemons = [host]
        try:
            host.wait_ready(timeout=300)
            join = ["--join", host.join_ref, "--bootstrap", host.address]
            daemons += [Daemon(f"lag-{i}", Path(work), join, env) for i in range(1, opts.peers)]
            for d in daemons[1:]:
                d.wait_ready(timeout=300)
            pollers = [threading.Thread(target=poll, args=(d,), daemon=True) for d in daemons]
            pollers.append(threading.Thread(target=sample_disk, args=(daemons,), daemon=True))
            for t in pollers:
                t.start()

            def full_rounds() -> int:
                return sum(1 for r in host.committed_rounds().values() if r)

            def full_round_seen() -> bool:
                last = host.status().get("last_round") or {}
                return last.get("group_size") == opts.peers

            wait_for("a round of every peer", full_round_seen, 600, every=1.0)
            first = full_rounds()
            started = time.monotonic()
            measuring.set()
            # The baseline, in the same minute: the same ticker in a process that does
            # nothing else, late only by what the machine's scheduler costs it.
            baseline = subprocess.run(
                [sys.executable, SCRIPT, "--role", "ticker", "--loop-lag-seconds",
                 str(opts.loop_lag_seconds)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rounds = full_rounds() - first
            lags = [d.status()["loop_lag_ms"] for d in daemons]
            peaks = [_peak_rss_mb(d.proc.pid) for d in daemons]
            elapsed = time.monotonic() - started
            measuring.clear()
        finally:
            stop.set()
            for d in daemons:
                d.kill()
    worst = max(lags, key=lambda lag: lag["p99_ms"])
    idle = json.loads(baseline.stdout)
    return {
        "loop_lag_p99_ms": worst["p99_ms"],
        "loop_lag_baseline_p99_ms": idle["p99_ms"],
        "loop_lag_baseline_max_ms": idle["max_ms"],
        "loop_lag_max_ms": max(lag["max_ms"] for lag in lags),
        "loop_lag_p50_ms": worst["p50_ms"],
        "loop_lag_params": 12 * d_model * d_model * n_layers,
        "loop_lag_rounds": rounds,
        "loop_lag_seconds": round(elapsed, 1),
        "loop_lag_status_polls_per_s": round(len(answers) / max(elapsed, 1e-9), 1),
        # How long /status took to answer (each daemon polled 10 times a second while
        # measuring; an unanswered poll is one that failed or waited past 5 s).
        "status_p50_ms": _ms(_nearest_rank(answers, 0.50)),
        "status_p99_ms": _ms(_nearest_rank(answers, 0.99)),
        "status_max_ms": _ms(max(answers, default=None)),
        "status_unanswered": unanswered[0],
        # Each daemon's peak resident memory (VmHWM) and the most its work log held on
        # disk (states past its RAM budget, <data dir>/work-log), the largest of the peers.
        "rss_max_mb": max(peaks),
        "work_log_disk_max_mb": round(disk[0] / 2**20),
    }


def _peak_rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        peak = next(line for line in f if line.startswith("VmHWM:"))
    return int(peak.split()[1]) // 1024


def _nearest_rank(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


async def worker_ticker(args: argparse.Namespace) -> None:
    """The loop-lag baseline: shoal's ticker alone in its process for the given time."""
    from shoal.peer.status.loop_lag import LoopLagMonitor

    monitor = LoopLagMonitor(window_s=args.loop_lag_seconds + 1)
    ticker = asyncio.create_task(monitor.run())
    await asyncio.sleep(args.loop_lag_seconds)
    ticker.cancel()
    _say(monitor.summary(time.monotonic()) or {})


async def orchestrate(opts: argparse.Namespace) -> dict[str, Any]:
    # `--sizes ""` measures no all-reduce (e.g. only the loop-lag phase).
    sizes = {s.strip(): _parse_size(s) for s in opts.sizes.split(",") if s.strip()}
    measured = await bench_interleaved(opts, sizes) if sizes else {}
    out: dict[str, Any] = {"peers": opts.peers, "sizes": {}}
    for name in sizes:
        m = measured[name]
        gloo = m.get("gloo")
        codecs = [c for c in m if c not in ("gloo", "hivemind")]
        entry: dict[str, Any] = {
            "gloo_s": round(gloo["seconds"], 4) if gloo else None,
            "hivemind_s": round(m["hivemind"]["seconds"], 4) if "hivemind" in m else None,
            "shoal_s": {c: round(m[c]["seconds"], 4) for c in codecs},
            "shoal_wire_bytes": {c: m[c]["wire"] for c in ("none", "int8", *SPARSE) if c in m},
        }
        entry["wire_bytes_per_peer"] = {
            c: wire // opts.peers for c, wire in entry["shoal_wire_bytes"].items()
        }
        sparse = [c for c in SPARSE if c in m]
        if sparse:
            entry["sparse_message_bytes"] = {c: m[c]["message_bytes"] for c in sparse}
            entry["sparse_encode_s"] = {c: round(m[c]["encode_s"], 4) for c in sparse}
            entry["sparse_decode_s"] = {c: round(m[c]["decode_s"], 4) for c in sparse}
            for c in sparse:
                for dense in ("none", "int8"):
                    if dense in m:
                        ratio = m[dense]["wire"] / m[c]["wire"]
                        entry[f"{dense}_over_{c}_wire"] = round(ratio, 1)
        for codec in ("none", "int8"):
            if codec in m and gloo:
                entry[f"shoal_{codec}_over_gloo"] = round(m[codec]["seconds"] / gloo["seconds"], 2)
                # The same, round by round (each shoal round ran right after a gloo round).
                entry[f"shoal_{codec}_over_gloo_paired"] = round(m[codec]["paired"], 2)
        for codec in ("none", "int8"):
            if codec in m and "hivemind" in m:
                ratio = m[codec]["seconds"] / m["hivemind"]["seconds"]
                entry[f"shoal_{codec}_over_hivemind"] = round(ratio, 2)
        if "none" in m and "int8" in m:
            entry["int8_wire_ratio"] = round(m["int8"]["wire"] / m["none"]["wire"], 3)
        entry["cpu_s"] = {
            system: None if m[system]["cpu"] is None else round(m[system]["cpu"], 3) for system in m
        }
        entry["rounds_s"] = {system: m[system]["all_seconds"] for system in m}
        out["sizes"][name] = entry
    if opts.loop_lag_seconds > 0:
        out.update(await asyncio.to_thread(bench_loop_lag, opts))
    kills = await bench_kill_to_commit(opts) if opts.kill_trials else []
    out["kill_to_commit_s"] = round(statistics.median(kills), 3) if kills else None
    out["kill_to_commit_max_s"] = round(max(kills), 3) if kills else None
    if not _hivemind_installed():
        out["hivemind"] = "not installed"
    elif not opts.hivemind:
        out["hivemind"] = "not measured (--no-hivemind)"
    else:
        import hivemind

        out["hivemind"] = f"measured: hivemind {hivemind.__version__} DecentralizedAverager"
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def _hivemind_installed() -> bool:
    try:
        import hivemind  # noqa: F401
    except ImportError:
        return False
    return True


ROLES = {
    "gloo": worker_gloo,
    "shoal": worker_shoal,
    "shoal_sparse": worker_shoal,
    "hivemind": worker_hivemind,
    "ticker": worker_ticker,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--sizes", default="10M,50M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--codecs", default=",".join(CODECS), help="shoal codecs to measure")
    p.add_argument("--no-gloo", dest="gloo", action="store_false", help="skip the gloo baseline")
    p.add_argument(
        "--no-hivemind",
        dest="hivemind",
        action="store_false",
        help="skip hivemind (measured when installed: pip install hivemind==1.1.12)",
    )
    p.add_argument("--kill-trials", type=int, default=5)
    p.add_argument(
        "--chunk-bytes", type=int, default=0, help="AllReduceConfig.chunk_bytes (0: default)"
    )
    p.add_argument(
        "--streams", type=int, default=0, help="AllReduceConfig.streams_per_peer (0: default)"
    )
    p.add_argument(
        "--profile-dir",
        help="cProfile the measured shoal rounds of each worker into DIR/shoal-RANK.prof",
    )
    p.add_argument("--kill-size", type=int, default=10_000_000)
    p.add_argument(
        "--sparse-density", type=float, default=0.015625, help="sparse codecs: share sent"
    )
    p.add_argument("--sparse-bits", type=int, default=2, help="sparse codecs: bits per value")
    p.add_argument(
        "--loop-lag-seconds",
        type=float,
        default=60.0,
        help="measure the daemons' event-loop lag over this many seconds of rounds (0: skip)",
    )
    p.add_argument("--loop-lag-size", default="50M", help="parameters of the daemons' model")
    p.add_argument(
        "--loop-lag-keep",
        metavar="DIR",
        help="keep the loop-lag daemons' homes (their logs) in DIR instead of a temporary one",
    )
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    if opts.role:
        logging.getLogger().setLevel(logging.WARNING)
        runner(ROLES[opts.role](opts))
        return
    print(json.dumps(runner(orchestrate(opts)), indent=2))


if __name__ == "__main__":
    main()
