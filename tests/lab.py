"""Helpers for tests (and bench/nat.py) that run peers in the NAT lab (../shared/lab/lab.sh).

`Lab` builds one lab under its own LAB_PREFIX and always tears it down
(`async with Lab("t1-") as lab:`); `lab.spawn("a1")` starts tests/nat_peer.py in
that namespace and returns a `LabPeer` that sends it JSON commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _find_lab_sh() -> Path:
    """SHOAL_LAB_SH, else shared/lab/lab.sh beside this checkout or any folder above
    it (a clone elsewhere, e.g. in /tmp, names the lab with SHOAL_LAB_SH)."""
    if os.environ.get("SHOAL_LAB_SH"):
        return Path(os.environ["SHOAL_LAB_SH"])
    candidates = [d / "shared" / "lab" / "lab.sh" for d in REPO.parents]
    return next((c for c in candidates if c.exists()), candidates[0])


LAB_SH = _find_lab_sh()
PEER_SCRIPT = Path(__file__).resolve().with_name("nat_peer.py")

# Public addresses of the lab (lab.sh: PUB_NET 198.51.100.0/24).
PUB_IP = "198.51.100.10"
NAT_IP = {"A": "198.51.100.11", "B": "198.51.100.12", "C": "198.51.100.13"}


def lab_unavailable() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "NAT lab tests need root (network namespaces and iptables)"
    if not LAB_SH.exists():
        return f"NAT lab script not found at {LAB_SH} (set SHOAL_LAB_SH)"
    if shutil.which("ip") is None:
        return "NAT lab tests need iproute2 (the ip command)"
    return None


class LabError(Exception):
    pass


class LabPeer:
    """A nat_peer.py process in one namespace; `call` sends a command, awaits its answer."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self._ids = 0
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reader = asyncio.get_running_loop().create_task(self._read())
        self.stderr_tail: list[str] = []
        self._err_reader = asyncio.get_running_loop().create_task(self._read_err())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg.get("event") == "ready" and not self._ready.done():
                    self._ready.set_result(None)
                fut = self._pending.pop(msg.get("id"), None) if "id" in msg else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        finally:
            err = LabError(f"peer {self.name} exited: {''.join(self.stderr_tail)[-3000:]}")
            for fut in [self._ready, *self._pending.values()]:
                if not fut.done():
                    fut.set_exception(err)
                    fut.exception()

    async def _read_err(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.stderr_tail.append(line.decode(errors="replace"))
            del self.stderr_tail[:-200]

    async def ready(self, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            await asyncio.shield(self._ready)

    async def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        """Run one command; raises LabError when it fails (or takes 15 s longer than the
        command's own `timeout`, 30 s without one)."""
        timeout = float(args.get("timeout") or 15.0) + 15.0
        self._ids += 1
        rid = self._ids
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, "id": rid, **args}) + "\n").encode())
        await self.proc.stdin.drain()
        try:
            async with asyncio.timeout(timeout):
                reply = await asyncio.shield(fut)
        except TimeoutError:
            raise LabError(f"{self.name}: {cmd} timed out after {timeout}s") from None
        finally:
            self._pending.pop(rid, None)
        if not reply.get("ok"):
            raise LabError(f"{self.name}: {cmd} failed: {reply.get('error')}\n{reply.get('trace')}")
        return reply

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        for task in (self._reader, self._err_reader):
            task.cancel()
        await asyncio.gather(self._reader, self._err_reader, return_exceptions=True)


class Lab:
    """One NAT lab (namespaces prefixed `prefix`), torn down on exit whatever happens."""

    def __init__(
        self,
        prefix: str,
        *,
        mode_a: str = "masq",
        mode_b: str = "random-fully",
        mode_c: str = "masq",
        inbound: str = "drop",
    ) -> None:
        self.prefix = prefix
        self.env = {
            **os.environ,
            "LAB_PREFIX": prefix,
            "MODE_A": mode_a,
            "MODE_B": mode_b,
            "MODE_C": mode_c,
            "INBOUND": inbound,
        }
        self.peers: list[LabPeer] = []

    def sh(self, *args: str, timeout: float = 120.0) -> str:
        res = subprocess.run(
            [str(LAB_SH), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if res.returncode != 0:
            raise LabError(f"lab.sh {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def ns(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def add_lan_host(self, router: str, host: str, ip: str) -> None:
        """A second host `host` (namespace, e.g. "a2") at `ip` on the LAN of `router`
        (e.g. "natA"), beside its first host: the router's LAN port becomes a bridge
        (lab.sh gives each router one host on a veth), so the two hosts share one link,
        its multicast included, and one public IP. `lab.sh down` deletes it with the rest."""
        r, h = self.ns(router), self.ns(host)
        gateway = subprocess.run(
            ["ip", "-n", r, "-4", "-o", "addr", "show", "dev", "lan0"],
            capture_output=True, text=True, check=True,
        ).stdout.split()[3]  # fmt: skip
        steps = [
            ["ip", "netns", "add", h],
            ["ip", "-n", h, "link", "set", "lo", "up"],
            ["ip", "netns", "exec", h, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1"],
            ["ip", "-n", r, "link", "add", "brlan", "type", "bridge"],
            ["ip", "-n", r, "addr", "del", gateway, "dev", "lan0"],
            ["ip", "-n", r, "link", "set", "lan0", "master", "brlan"],
            ["ip", "-n", r, "addr", "add", gateway, "dev", "brlan"],
            ["ip", "-n", r, "link", "set", "brlan", "up"],
            ["ip", "-n", r, "link", "add", "lan1", "type", "veth", "peer", "name", "eth0",
             "netns", h],
            ["ip", "-n", r, "link", "set", "lan1", "master", "brlan", "up"],
            ["ip", "-n", h, "addr", "add", f"{ip}/{gateway.split('/')[1]}", "dev", "eth0"],
            ["ip", "-n", h, "link", "set", "eth0", "up"],
            ["ip", "-n", h, "route", "add", "default", "via", gateway.split("/")[0]],
            # The router's rules name lan0; routed traffic now comes in on the bridge.
            ["ip", "netns", "exec", r, "iptables", "-I", "FORWARD", "-i", "brlan", "-o", "wan0",
             "-j", "ACCEPT"],
            ["ip", "netns", "exec", r, "iptables", "-I", "FORWARD", "-i", "wan0", "-o", "brlan",
             "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["ip", "netns", "exec", r, "iptables", "-I", "INPUT", "-i", "brlan", "-j", "ACCEPT"],
        ]  # fmt: skip
        for step in steps:
            res = subprocess.run(step, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise LabError(f"{' '.join(step)} failed: {res.stderr.strip()}")
        # A switch, not a firewall, between the two hosts (where br_netfilter is loaded,
        # bridged frames would meet the router's FORWARD policy, DROP).
        subprocess.run(
            ["ip", "netns", "exec", r, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"],
            capture_output=True, check=False,
        )  # fmt: skip

    def cut_uplink(self, router: str) -> None:
        """Take `router`'s WAN port down: its LAN reaches nothing public."""
        cmd = ["ip", "-n", self.ns(router), "link", "set", "wan0", "down"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise LabError(f"{' '.join(cmd)} failed: {res.stderr.strip()}")

    async def __aenter__(self) -> Lab:
        try:
            await asyncio.to_thread(self.sh, "up")
        except BaseException:
            await asyncio.to_thread(self.sh, "down")
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(p.close() for p in self.peers), return_exceptions=True)
        await asyncio.to_thread(self.sh, "down")

    async def spawn(self, ns: str, log_level: str = "WARNING") -> LabPeer:
        """Start a nat_peer.py process in namespace `ns` (e.g. "pub", "a1")."""
        proc = await asyncio.create_subprocess_exec(
            "ip",
            "netns",
            "exec",
            self.ns(ns),
            sys.executable,
            str(PEER_SCRIPT),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "NAT_PEER_LOG": log_level},
        )
        peer = LabPeer(ns, proc)
        self.peers.append(peer)
        await peer.ready()
        return peer
