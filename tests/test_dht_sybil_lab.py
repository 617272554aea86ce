"""The issue's Sybil criterion over real sockets, in the lab (needs root).

200 Sybils on one /24 of the lab's internet (198.51.100.50-249, beside the lab's
own hosts), with IDs ground next to the key, answering lookups with each other
and hiding the record, against 50 honest DHT nodes with one /24 each
(198.18.k.2). The extra namespaces hang on the lab's bridge and are made here
with `ip -n` (lab.sh is not changed); `lab.sh down` deletes them with the rest.
The simulation (test_dht_sybil.py) has the statistics and the control; this is
the same attack through real hosts, connections and the observed IPs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lab import Lab, lab_unavailable

pytestmark = [
    pytest.mark.lab,
    pytest.mark.slow,
    pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable())),
]

SCRIPT = Path(__file__).resolve().with_name("dht_sybil_lab_peer.py")
HONEST = 50
SYBILS = 200
SYBIL_IP = "198.51.100.{}"  # .50 to .249
FIRST_SYBIL = 50
HONEST_IP = "198.18.{}.2"
KEY = "honest-record"
LOOKUPS = 300


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=60)


def _ip_batch(ns: str, lines: list[str]) -> None:
    subprocess.run(
        ["ip", "-n", ns, "-batch", "-"],
        input="\n".join(lines) + "\n",
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _attach(lab: Lab, name: str, addrs: list[str], route: str) -> str:
    """A namespace on the lab's internet bridge holding `addrs` (/24 each), with an
    on-link route to `route` (the other side's addresses live on the same bridge)."""
    ns, port = lab.ns(name), f"p-{name}"
    _ip("netns", "add", ns)
    _ip("-n", ns, "link", "set", "lo", "up")
    inet = lab.ns("inet")
    _ip("-n", inet, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _ip("-n", inet, "link", "set", port, "master", "br0", "up")
    _ip_batch(ns, [f"addr add {a}/24 dev eth0" for a in addrs])
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "route", "add", route, "dev", "eth0")
    return ns


class Swarm:
    """One dht_sybil_lab_peer.py process in a namespace."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, ns: str, *args: str) -> tuple[Swarm, list[str]]:
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, sys.executable, str(SCRIPT), *args,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        swarm = cls(proc)
        ready = await swarm._line()
        return swarm, ready["addrs"]

    async def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"lab swarm process exited ({await self.proc.wait()})")
        return json.loads(line)

    async def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        answer = await self._line()
        assert answer.get("ok"), answer
        return answer

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@pytest.mark.timeout(240)
async def test_two_hundred_sybils_on_one_24_of_the_lab_cannot_hide_an_honest_record() -> None:
    swarms: list[Swarm] = []
    async with Lab("sy-") as lab:
        try:
            hon = _attach(
                lab, "hon", [HONEST_IP.format(k) for k in range(HONEST)], "198.51.100.0/24"
            )
            syb = _attach(
                lab,
                "syb",
                [SYBIL_IP.format(FIRST_SYBIL + j) for j in range(SYBILS)],
                "198.18.0.0/16",
            )
            honest, honest_addrs = await Swarm.start(hon, "honest", HONEST_IP, str(HONEST), "0")
            swarms.append(honest)
            await honest.call(cmd="join")
            sybils, _ = await Swarm.start(
                syb, "sybil", SYBIL_IP, str(SYBILS), str(FIRST_SYBIL), KEY, "8"
            )
            swarms.append(sybils)
            await sybils.call(cmd="join", honest=honest_addrs, each=5)
            result = await honest.call(cmd="attack", key=KEY, lookups=LOOKUPS)
        finally:
            await asyncio.gather(*(s.close() for s in swarms), return_exceptions=True)
    print(json.dumps(result))
    assert result["honest_replicas"] >= 10, result
    assert result["found"] >= 0.99 * LOOKUPS, result
