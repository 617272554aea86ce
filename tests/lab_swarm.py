"""A training swarm through real NAT: one public host and three joiners behind NAT routers.

Used by tests/test_nat_swarm_lab.py (one run) and bench/nat_swarm.py (many runs).
The public host (198.51.100.10) hosts an experiment; joiners behind NAT A
(MASQUERADE), NAT B (--random-fully: symmetric) and NAT C (MASQUERADE) start at
the same moment, optionally while two busy processes load both cores, as on a
small machine where everyone imports torch at once. A run succeeds when the
public host never concluded it was private, A and C hole-punched to each other,
B reached them through the relay, and all four committed the same fingerprint
in a round of four.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from daemon_harness import TINY_TASK, Daemon, cli_env_path
from lab import PUB_IP, Lab

PORT = 4001
EXPERIMENT = "natswarm"
FOUR = re.compile(r"round committed: outer step (\d+), 4 peers, [\d.]+s, fingerprint (\w+)")
SWARM_ENV = {
    "SHOAL_LISTEN": f"/ip4/0.0.0.0/tcp/{PORT}",
    "SHOAL_STATUS_ADDR": "127.0.0.1:8080",
    "SHOAL_INNER_STEPS": "10",
    "SHOAL_TASK_OPTIONS": TINY_TASK,
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=20,stall_timeout=5",
}


def _identity(workdir: Path, name: str) -> str:
    """Create `name`'s identity before it starts, so the joiners know whom to dial."""
    home = workdir / name
    home.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [sys.executable, "-m", "shoal.peer", "id"],
        env=cli_env_path(home),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def _four_peer_rounds(d: Daemon) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in FOUR.finditer(d.log())}


def _kinds(d: Daemon, peers: dict[str, str]) -> dict[str, str]:
    by_id = {v: k for k, v in peers.items()}
    return {
        by_id[c["peer_id"]]: c["kind"]
        for c in d.status().get("connections", [])
        if c.get("peer_id") in by_id
    }


_DROP_DIALBACKS = f"iptables {{op}} OUTPUT -p tcp --syn --dport {PORT} ! --sport {PORT} -j DROP"


def _allow_dialbacks(lab: Lab) -> None:
    for ns in ("a1", "c1"):
        with contextlib.suppress(Exception):
            lab.sh("exec", lab.ns(ns), *_DROP_DIALBACKS.format(op="-D").split())


def _stall(pub: Daemon, times: int) -> None:
    """Freeze the public host for 2 s, then let it run 0.5 s, `times` times, from the
    moment it listens: its event loop is mostly stopped while the joiners arrive."""
    deadline = time.monotonic() + 60
    while not any("listening on" in line for line in pub.log().splitlines()):
        if time.monotonic() > deadline or not pub.alive():
            return
        time.sleep(0.05)
    for _ in range(times):
        if not pub.alive():
            return
        os.kill(pub.proc.pid, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(pub.proc.pid, signal.SIGCONT)
        time.sleep(0.5)


def run_swarm(
    prefix: str,
    workdir: Path,
    *,
    load: int = 2,
    timeout: float = 150.0,
    default_task: bool = False,
    stalls: int = 0,
    slow_dialbacks: float = 0.0,
) -> dict:
    """One run; a dict of what happened (`ok` when everything above held).

    `load`: busy processes during start-up (0: none). `default_task`: the default
    experiment's model and steps (what users start; a slower start-up) instead of
    a tiny model. `stalls`: times the public host is frozen for 2 s (SIGSTOP, then
    SIGCONT for 0.5 s) from the moment it listens: what a start-up that holds the
    event loop (importing torch, a GC pass, a swapped-out page) does to the
    dial-backs it asked for, made repeatable. `slow_dialbacks`: for this many
    seconds from the start, the dial-backs of joiners A and C (outbound SYNs to the
    host's port from any port but their listen port) are dropped, so they time
    out: one slow dial-back, on demand."""
    env = dict(SWARM_ENV)
    if default_task:
        del env["SHOAL_TASK_OPTIONS"], env["SHOAL_INNER_STEPS"]
    lab = Lab(prefix)
    lab.sh("up")
    burners: list[subprocess.Popen[bytes]] = []
    daemons: dict[str, Daemon] = {}
    started = time.monotonic()
    try:
        ids = {name: _identity(workdir, name) for name in ("pub", "a1", "b1", "c1")}
        boot = f"/ip4/{PUB_IP}/tcp/{PORT}/p2p/{ids['pub']}"
        if slow_dialbacks:
            for ns in ("a1", "c1"):
                lab.sh("exec", lab.ns(ns), *_DROP_DIALBACKS.format(op="-I").split())
            timer = threading.Timer(slow_dialbacks, _allow_dialbacks, args=(lab,))
            timer.daemon = True
            timer.start()
        burn = "import time\nend = time.time() + 40\nwhile time.time() < end: pass"
        burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(load)]
        daemons["pub"] = Daemon(
            "pub", workdir, ["--host-experiment", EXPERIMENT], env, netns=lab.ns("pub")
        )
        for name in ("a1", "b1", "c1"):
            args = ["--bootstrap", boot, "--join", f"{EXPERIMENT}@{ids['pub']}"]
            daemons[name] = Daemon(name, workdir, args, env, netns=lab.ns(name))
        stall_thread = None
        if stalls:
            stall_thread = threading.Thread(
                target=_stall, args=(daemons["pub"], stalls), daemon=True
            )
            stall_thread.start()
        result: dict[str, Any] = {"ok": False}
        deadline = started + timeout
        agreed = None
        while time.monotonic() < deadline and agreed is None:
            time.sleep(1.0)
            if not all(d.alive() for d in daemons.values()):
                result["error"] = "a daemon exited: " + ", ".join(
                    f"{n} (exit code {d.proc.returncode}): {d.tail(5)}"
                    for n, d in daemons.items()
                    if not d.alive()
                )
                break
            rounds = [_four_peer_rounds(d) for d in daemons.values()]
            common = set(rounds[0]).intersection(*rounds[1:])
            if common:
                step = max(common)
                agreed = {r[step] for r in rounds}
        if stall_thread is not None:
            stall_thread.join(timeout=30)
        pub_log = daemons["pub"].log()
        result["pub_went_private"] = "-> private" in pub_log
        result["seconds"] = round(time.monotonic() - started, 1)
        result["fingerprints_equal"] = agreed is not None and len(agreed) == 1
        if agreed is not None:
            a_kinds = _kinds(daemons["a1"], ids)
            b_kinds = _kinds(daemons["b1"], ids)
            result["a_to_c"] = a_kinds.get("c1")
            result["b_to"] = {k: v for k, v in b_kinds.items() if k in ("a1", "c1")}
            # The host ends public: within 30 s of the round (a wrong belief is corrected
            # within that long), usually long before.
            until = time.monotonic() + 30
            pub_status = daemons["pub"].status()
            while pub_status.get("reachability") != "public" and time.monotonic() < until:
                time.sleep(1.0)
                pub_status = daemons["pub"].status()
            result["pub_reachability"] = pub_status.get("reachability")
            result["pub_reason"] = pub_status.get("reachability_detail", {}).get("reason")
            result["ok"] = (
                not result["pub_went_private"]
                and result["fingerprints_equal"]
                and result["a_to_c"] == "holepunched"
                and set(result["b_to"].values()) == {"relayed"}
                and result["pub_reachability"] == "public"
            )
        if not result["ok"]:
            result["logs"] = "\n".join(d.tail(60) for d in daemons.values())
        return result
    finally:
        for b in burners:
            b.kill()
        for d in daemons.values():
            with contextlib.suppress(Exception):
                d.kill()
        lab.sh("down")
