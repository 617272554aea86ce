"""What verification costs a real swarm: `shoal run` daemons on loopback, verification
on and then off (same experiment settings, one arm after the other on the same
machine), training throughput and bytes sent per committed round compared.

Used by `bench/verification.py --overhead-seconds S`; runnable alone:

    python bench/verification_swarm.py [--seconds 180] [--peers 4] [--codec int8]
        [--inner-state reset|quantize] [--codec-audit chunks|whole]

`--inner-state reset` starts each round's inner optimizer afresh (both arms, so that
they train alike): a referee then rebuilds the segment's start from the round's
global state and the prover sends a header instead of three model sizes
(`peer/verify/rebuild.py`); `starts_rebuilt` and `starts_fetched` count those audits.
`--inner-state quantize` carries the moments on, rounded to 8-bit codes at each
round's start: the prover sends the codes (half a model size) and the referee
rebuilds from them (`starts_from_codes`).

A sparse codec's verified rounds are audited by chunks (`--codec-audit chunks`, the
default of a new verified sparse experiment): the last segment's audit takes the
values the message kept and a few drawn chunks of the residual
(`residuals_sampled`), not the whole residual (`--codec-audit whole`).

Every daemon trains the built-in task at its default size with one CPU thread. The
audit rate is the default one and new peers are not put on probation (the
probation rate is set to the default rate), so the figure is the steady state.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

START_TIMEOUT = 120.0
# Segments of a sparse round at the daemon's defaults (inner_steps 20, audit_segment_steps
# 3): one in that many audits is of the last segment, which reveals the residual too.
SPARSE_SEGMENTS = 7
SPARSE_CODECS = ("topk", "dct")


class Daemon:
    def __init__(self, name: str, home: Path, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        home.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        full_env.update(
            HOME=str(home),
            SHOAL_LISTEN="/ip4/127.0.0.1/tcp/0",
            SHOAL_STATUS_ADDR="127.0.0.1:0",
            SHOAL_THREADS="1",
            OMP_NUM_THREADS="1",
            **env,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.log = (home / "stderr.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.peer", "run", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=full_env,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if line.startswith("Status: "):
                self.ready.set()
        self.ready.set()

    def line(self, pattern: str) -> str:
        for line in self.lines:
            m = re.search(pattern, line)
            if m:
                return m.group(1)
        raise RuntimeError(f"{self.name} printed no {pattern!r}")

    def status(self) -> dict[str, Any]:
        url = self.line(r"^Status: (\S+)").rstrip("/") + "/status"
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def _wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"timed out waiting for {what}")


def run_arm(
    verify: bool,
    peers: int,
    seconds: float,
    workdir: Path,
    codec: str = "none",
    inner_state: str = "carry",
    codec_audit: str = "chunks",
    task: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Tokens/s of the swarm and bytes sent per committed round, over `seconds`
    (`task`: the built-in task's options, the daemon's defaults when None)."""
    arm = "on" if verify else "off"
    sparse = verify and codec in SPARSE_CODECS
    # (Both arms without overlapped rounds: a new unverified experiment overlaps them by
    # default, which a verified one cannot, and the arms must train alike. With it, the
    # off arm trained more steps a second and, at 3.26M parameters, re-synced peers.)
    given = ("audit_probation_rate=0.05" if verify else "", f"codec={codec}",
             f"inner_state={inner_state}", "overlap_steps=0",
             f"codec_audit={codec_audit}" if sparse else "")  # fmt: skip
    options = ",".join(o for o in given if o)
    env = {"SHOAL_STRATEGY_OPTIONS": options}
    if task:
        env["SHOAL_TASK_OPTIONS"] = ",".join(f"{k}={v}" for k, v in task.items())
    host = Daemon("host", workdir / arm / "host", ["--host-experiment", f"bench-{arm}",
                                                   "--verify", arm], env)  # fmt: skip
    daemons = [host]
    try:
        host.ready.wait(START_TIMEOUT)
        join = ["--join", host.line(r"--join (\S+)"), "--bootstrap",
                host.line(r"^\s*(/ip4/127\.0\.0\.1/\S+)")]  # fmt: skip
        daemons += [Daemon(f"peer{i}", workdir / arm / f"peer{i}", join, {})
                    for i in range(1, peers)]  # fmt: skip
        for d in daemons:
            d.ready.wait(START_TIMEOUT)
        # Measured from the first round every peer took part in (joins and loads done).
        _wait(lambda: all((d.status().get("outer_step") or 0) >= 2 for d in daemons),
              START_TIMEOUT * 2, "every peer past its second round")  # fmt: skip
        before = [d.status() for d in daemons]
        t0 = time.monotonic()
        time.sleep(seconds)
        after = [d.status() for d in daemons]
        elapsed = time.monotonic() - t0
    finally:
        for d in daemons:
            d.stop()
    tokens = sum(a["tokens"] - b["tokens"] for a, b in zip(after, before, strict=True))
    sent = sum(a["bytes_sent"] - b["bytes_sent"] for a, b in zip(after, before, strict=True))
    rounds = max(a["outer_step"] for a in after) - min(b["outer_step"] for b in before)

    # (`audits_done` counts since the daemon started: the window's are after - before.)
    def window(key: str) -> int:
        def total(states: list[dict[str, Any]]) -> int:
            return sum(((s.get("verification") or {}).get(key) or 0) for s in states)

        return total(after) - total(before)

    audits = window("audits_done")
    by_protocol: dict[str, float] = {}
    for a, b in zip(after, before, strict=True):
        was = b.get("bytes_sent_by_protocol") or {}
        for protocol, total in (a.get("bytes_sent_by_protocol") or {}).items():
            by_protocol[protocol] = by_protocol.get(protocol, 0) + total - was.get(protocol, 0)
    return {
        # Stream payload sent per committed round, by protocol (the swarm's, summed).
        "bytes_per_round_by_protocol": {
            p: round(v / max(1, rounds)) for p, v in sorted(by_protocol.items())
        },
        # Audits whose re-run ended in the committed state (no end sent), and ends asked.
        "audits_bit_exact": window("audits_bit_exact"),
        "reveal_ends_fetched": window("reveal_ends_fetched"),
        # Audits whose start was rebuilt here (a header crossed the wire), and fetched.
        "starts_rebuilt": window("starts_rebuilt"),
        "starts_fetched": window("starts_fetched"),
        "starts_from_codes": window("starts_from_codes"),
        "residuals_sampled": window("residuals_sampled"),
        "tokens_per_s": tokens / elapsed,
        "bytes_sent": sent,
        "rounds": rounds,
        "bytes_per_round": sent / max(1, rounds),
        "audits": audits,
        "seconds": elapsed,
    }


def reveal_bytes(task: dict[str, Any] | None = None) -> dict[str, int]:
    """What one audit's reveal of the default task moves on the wire, counted by the
    prover's host (framing and encryption included): today's (the segment's start
    parameters and Adam moments, the end withheld: `peer/verify/reveals.py`; a re-run
    that does not end in the committed state bit for bit asks for the end too),
    protocol 2.4's (the end parameters too) and 2.0's (and the run's final parameters)
    in the same run; and one model size of float32."""
    return asyncio.run(_reveal_bytes(task or {}))


async def _reveal_bytes(config: dict[str, Any]) -> dict[str, int]:
    from shoal.peer.trainer import check_hyperparameters
    from shoal.peer.training.state_codes import code_state, round_trip_
    from shoal.peer.training.tasks.bytegpt import make_task
    from shoal.peer.verify.reveals import PROTOCOL, Reveal, fetch_reveal, reveal_of, send_reveal
    from shoal.peer.verify.segments import SegmentRunner, segment_batches
    from shoal.transport import rpc
    from shoal.transport.host import Host, HostConfig
    from shoal.transport.identity import Identity

    task = make_task(config)
    runner = SegmentRunner(task, check_hyperparameters({}))
    # A start past one step (the optimizer holds its moments), then a 3-step segment.
    start = runner.run(runner.capture(), segment_batches(task, 0, 64, 1, first=0, count=1), 0)
    end = runner.run(start, segment_batches(task, 0, 64, 1, first=1, count=3), 1)
    coded = copy.deepcopy(start.optimizer["optimizer"]["state"])
    for per_param in coded.values():
        for name, value in per_param.items():
            if name != "step":
                round_trip_(value)
    with_codes = reveal_of(None, end, with_end=False)
    with_codes.moments = code_state(coded)
    assert with_codes.moments is not None
    reveals = {"reveal_bytes": reveal_of(start, end, with_end=False),
               "reveal_bytes_rebuilt": reveal_of(None, end, with_end=False),
               "reveal_bytes_coded": with_codes,
               "reveal_bytes_protocol_2_4": reveal_of(start, end),
               "reveal_bytes_protocol_2_0": reveal_of(start, end, end)}  # fmt: skip
    config = HostConfig(listen=("/ip4/127.0.0.1/tcp/0",))
    prover, referee = Host(Identity.generate(), config), Host(Identity.generate(), config)
    serving: list[Reveal] = []

    @rpc.RpcService(prover, PROTOCOL).stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        await send_reveal(ctx, serving[-1])
        yield {"done": True}

    out = {"model_bytes": 4 * sum(p.numel() for p in runner.model.parameters())}
    withheld = ("reveal_bytes_rebuilt", "reveal_bytes_coded")
    try:
        await prover.start()
        await referee.start()
        await referee.connect(prover.addresses()[0])
        shapes = [p.shape for p in runner.model.parameters()]
        for name, sent in reveals.items():
            serving.append(sent)
            before = prover.bytes_sent
            await fetch_reveal(referee, prover.peer_id, 1, 0, runner.inner.state_dict(), shapes,
                               timeout=60, layouts=runner.inner.state_layouts(),
                               end=False, start=name not in withheld,
                               moments=name == "reveal_bytes_coded")  # fmt: skip
            out[name] = prover.bytes_sent - before
    finally:
        await asyncio.gather(prover.aclose(), referee.aclose(), return_exceptions=True)
    return out


def sampled_residual_bytes(task: dict[str, Any] | None = None) -> int:
    """What the last segment's reveal of a sparse round audited by chunks adds (the
    default topk codec on the default task): the kept values, the drawn chunks and
    two Merkle proofs each (tensor framing aside)."""
    from shoal.averaging.diloco_options import DiLoCoOptions
    from shoal.averaging.sparse_codec import SparseCodec
    from shoal.peer.training.tasks.bytegpt import make_task
    from shoal.peer.verify.referee import SAMPLED_CHUNKS

    options = DiLoCoOptions.parse({"codec": "topk"})
    codec = SparseCodec.from_density(
        "topk", options.sparse_chunk, options.codec_density, options.codec_bits
    )
    n = sum(p.numel() for p in make_task(task or {}).make_model(0).parameters())
    drawn = min(SAMPLED_CHUNKS, codec.chunks(n))
    proof = 32 * max(1, (codec.chunks(n) - 1).bit_length())
    return 4 * codec.kept(n) + drawn * (4 * codec.chunk + 2 * proof)


def measure(
    seconds: float,
    peers: int,
    rate: float = 0.05,
    codec: str = "none",
    inner_state: str = "carry",
    codec_audit: str = "chunks",
    task: dict[str, Any] | None = None,
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="shoal-verify-bench-"))
    try:
        on = run_arm(True, peers, seconds, workdir, codec, inner_state, codec_audit, task)
        off = run_arm(False, peers, seconds, workdir, codec, inner_state, codec_audit, task)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # How many audits fall in a window is a matter of luck (Poisson, about rate x peers
    # per round): the expectation replaces the audits seen by the audits expected.
    reveal = reveal_bytes(task)
    # (A reset round's start is rebuilt by its referee: a header crosses the wire; a
    # quantized round's from its codes.)
    withheld_by = {"reset": "reveal_bytes_rebuilt", "quantize": "reveal_bytes_coded"}
    per_audit = reveal[withheld_by.get(inner_state, "reveal_bytes")]
    seen = on["audits"] * per_audit  # (the reveals this window's audits took)
    if codec in SPARSE_CODECS:  # (a sparse round's last segment also reveals its residual)
        sampled = sampled_residual_bytes(task)
        residual = reveal["model_bytes"] if codec_audit == "whole" else sampled
        reveal["residual_reveal_bytes"] = residual
        per_audit += residual // SPARSE_SEGMENTS
        # Audits by chunks say how many were of a last segment (`residuals_sampled`):
        # those, not an average share, took the residual's reveal. (Audits of whole
        # residuals do not: an average share, which a window's draws can bias.)
        if codec_audit == "whole":
            seen += on["audits"] * (residual // SPARSE_SEGMENTS)
        else:
            seen += on["residuals_sampled"] * residual
    rest = on["bytes_per_round"] - off["bytes_per_round"] - seen / max(1, on["rounds"])
    expected = rest + rate * peers * per_audit
    return {
        "compute_overhead": 1 - on["tokens_per_s"] / off["tokens_per_s"],
        "bytes_overhead": on["bytes_per_round"] / off["bytes_per_round"] - 1,
        "bytes_overhead_expected": expected / off["bytes_per_round"],
        **reveal,
        "on": on,
        "off": off,
        "peers": peers,
        "codec": codec,
        "inner_state": inner_state,
        **({"codec_audit": codec_audit} if codec in SPARSE_CODECS else {}),
        **({"task": task} if task else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="measured time per arm")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--codec", default="none", help="DiLoCo's codec, e.g. int8 or topk")
    parser.add_argument(
        "--inner-state",
        default="carry",
        choices=("carry", "reset", "quantize"),
        help="the inner optimizer's state at each round: carried, reset or quantized",
    )
    parser.add_argument(
        "--codec-audit",
        default="chunks",
        choices=("chunks", "whole"),
        help="sparse codecs: what an audit reveals of the residual (a new verified "
        "experiment's default: chunks)",
    )
    parser.add_argument(
        "--task-options",
        default="{}",
        help='the built-in task\'s options as JSON, e.g. \'{"d_model": 256, "n_layers": 4}\'',
    )
    args = parser.parse_args()
    result = measure(args.seconds, args.peers, codec=args.codec, inner_state=args.inner_state,
                     codec_audit=args.codec_audit, task=json.loads(args.task_options))  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
