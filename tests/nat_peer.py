"""A peer for the NAT lab tests and bench/nat.py, run inside a network namespace.

    ip netns exec NS python tests/nat_peer.py

Reads one JSON command per line on stdin and answers each with one JSON line on
stdout (``{"id": ..., "ok": true, ...}`` or ``{"id": ..., "ok": false, "error": ...}``);
the first line it prints is ``{"event": "ready"}``. A "session" is a host, its
NatManager and optionally a DHT node; `start` makes a new one (fresh identity and
port), so one process can run many trials. Commands run concurrently.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

import uvloop

from shoal.transport import rpc
from shoal.transport.host import Host, HostConfig
from shoal.transport.identity import Identity, PeerID
from shoal.transport.multiaddr import Multiaddr
from shoal.transport.nat import NatConfig, NatManager, Reachability, RelayLimits

SINK = "/shoal/test-sink/1.0.0"
ECHO = "/shoal/test-echo/1.0.0"


class Session:
    def __init__(self, host: Host, nat: NatManager) -> None:
        self.host = host
        self.nat = nat
        self.dht: Any = None
        self.state_server: Any = None
        self.started = time.monotonic()

    async def aclose(self) -> None:
        if self.state_server is not None:
            self.state_server.close()
        if self.dht is not None:
            await self.dht.aclose()
        await self.nat.aclose()
        await self.host.aclose()


async def _sink(stream: Any) -> None:
    buf = memoryview(bytearray(1 << 20))
    total = 0
    while n := await stream.readinto(buf):
        total += n
    await stream.write(total.to_bytes(8, "big"))


class Peer:
    def __init__(self) -> None:
        self.session: Session | None = None
        self.out = sys.stdout

    def emit(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    @property
    def s(self) -> Session:
        if self.session is None:
            raise RuntimeError("no session: send start first")
        return self.session

    # --- commands -------------------------------------------------------------------------------

    async def cmd_start(self, listen: str = "/ip4/0.0.0.0/tcp/0", **cfg: Any) -> dict[str, Any]:
        if self.session is not None:
            await self.session.aclose()
            self.session = None
        limits = RelayLimits(**cfg.pop("relay_limits", {}))
        config = NatConfig(relay_limits=limits, **cfg)
        host = Host(Identity.generate(), HostConfig(listen=(listen,), reuse_port=True))
        await host.start()
        host.set_handler(SINK, _sink)
        svc = rpc.RpcService(host, ECHO)

        @svc.unary("echo")
        async def echo(ctx: Any, payload: Any) -> Any:
            return payload

        nat = NatManager(host, config=config)
        await nat.start()
        self.session = Session(host, nat)
        return {"peer_id": str(host.peer_id), "listen": [str(a) for a in host.listen_addrs]}

    async def cmd_streams(self) -> dict[str, Any]:
        out = []
        for c in self.s.host._all:
            out.append(
                {
                    "peer": str(c.remote_peer),
                    "kind": c.kind,
                    "open": c.is_open,
                    "streams": [repr(st) for st in c.streams.values()],
                }
            )
        return {"conns": out}

    async def cmd_tasks(self) -> dict[str, Any]:
        import io

        out = []
        for t in asyncio.all_tasks():
            buf = io.StringIO()
            t.print_stack(file=buf)
            out.append(buf.getvalue())
        return {"tasks": out}

    async def cmd_stop(self) -> dict[str, Any]:
        if self.session is not None:
            await self.session.aclose()
            self.session = None
        return {}

    async def cmd_status(self) -> dict[str, Any]:
        s = self.s
        st = s.nat.status()
        st["peer_id"] = str(s.host.peer_id)
        st["host"] = s.host.stats()
        return st

    async def cmd_wait(self, what: str, value: Any = None, timeout: float = 10.0) -> dict[str, Any]:
        s = self.s
        t0 = time.monotonic()
        if what == "reachability":
            pred = lambda: s.nat.reachability is Reachability(value)  # noqa: E731
        elif what == "relay_addr":
            pred = lambda: bool(s.nat.relay_addresses())  # noqa: E731
        elif what == "confirmed":
            pred = lambda: bool(s.nat.confirmed_addresses())  # noqa: E731
        elif what == "direct":
            peer = PeerID.from_base58(value)

            def pred() -> bool:
                conn = s.host.connection(peer)
                return conn is not None and conn.kind != "relayed"
        elif what == "no_relayed":
            peer = PeerID.from_base58(value)

            def pred() -> bool:  # only the direct connection left (the relayed one closed)
                conns = [c for c in s.host._all if c.remote_peer == peer and c.is_open]
                return bool(conns) and all(c.kind != "relayed" for c in conns)
        elif what == "no_circuit":  # on a relay: no circuit left between these two peers
            pair = set(value)
            book = s.nat.relay.book

            def pred() -> bool:
                return not any({str(c.src), str(c.dst)} == pair for c in book.circuits.values())
        elif what == "identified_direct":  # identify ran on a direct connection to the peer
            peer = PeerID.from_base58(value)

            def pred() -> bool:
                infos = s.nat.identify.infos
                return any(c.remote_peer == peer and c.kind != "relayed" for c in infos)
        elif what == "punch_done":
            pred = lambda: bool(s.nat.puncher.stats.results)  # noqa: E731
        else:
            raise ValueError(f"unknown wait {what!r}")
        ok = await s.nat.wait_for(pred, timeout)
        return {
            "met": ok,
            "elapsed_s": time.monotonic() - t0,
            "since_start_s": time.monotonic() - s.started,
        }

    async def cmd_connect(self, addr: str, timeout: float = 10.0) -> dict[str, Any]:
        conn = await self.s.host.connect(Multiaddr(addr), timeout=timeout)
        return {"kind": conn.kind, "peer": str(conn.remote_peer)}

    async def cmd_conn(self, peer: str) -> dict[str, Any]:
        conn = self.s.host.connection(PeerID.from_base58(peer))
        return {"stats": conn.stats() if conn is not None else None}

    async def cmd_send(self, peer: str, nbytes: int, timeout: float = 120.0) -> dict[str, Any]:
        """Send `nbytes` on one stream; the far end acknowledges the count."""
        host = self.s.host
        pid = PeerID.from_base58(peer)
        block = os.urandom(1 << 20)
        async with asyncio.timeout(timeout):
            conn = await host.connect(pid)
            kind = conn.kind
            stream = await conn.open_stream(SINK)
            t0 = time.monotonic()
            left = nbytes
            while left:
                n = min(left, len(block))
                await stream.write(memoryview(block)[:n])
                left -= n
            await stream.close()
            got = int.from_bytes(await stream.readexactly(8), "big")
            dt = time.monotonic() - t0
        return {"bytes": got, "seconds": dt, "MBps": got / dt / 1e6, "kind": kind}

    async def cmd_echo(self, peer: str, n: int = 10, timeout: float = 10.0) -> dict[str, Any]:
        pid = PeerID.from_base58(peer)
        kinds = set()
        for i in range(n):
            out = await rpc.call(self.s.host, pid, ECHO, "echo", {"i": i}, timeout=timeout)
            assert out == {"i": i}
            conn = self.s.host.connection(pid)
            kinds.add(conn.kind if conn is not None else None)
        return {"calls": n, "kinds": sorted(map(str, kinds))}

    async def cmd_hold(self, peer: str, timeout: float = 30.0) -> dict[str, Any]:
        """Keep an idle stream open to `peer` until the connection fails; say how."""
        t0 = time.monotonic()
        stream = await self.s.host.open_stream(PeerID.from_base58(peer), SINK)
        try:
            async with asyncio.timeout(timeout):
                await stream.read()
        except TimeoutError:
            return {"error": None, "elapsed_s": time.monotonic() - t0}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}", "elapsed_s": time.monotonic() - t0}
        return {"error": "stream ended", "elapsed_s": time.monotonic() - t0}

    async def cmd_dht_snapshot(self) -> dict[str, Any]:
        return {"snapshot": self.s.dht.snapshot(contacts=True)}

    async def cmd_dht_start(self, bootstrap: list[str] = (), **opts: Any) -> dict[str, Any]:  # type: ignore[assignment]
        from shoal.dht.node import DHTNode
        from shoal.dht.relay_directory import DHTRelayDirectory

        s = self.s
        # A private peer is a DHT client: it reads and writes, but is nobody's hop.
        nat = s.nat
        s.dht = await DHTNode.create(
            s.host, bootstrap=list(bootstrap), serves=lambda: nat.serves_dht, **opts
        )
        s.nat.directory = DHTRelayDirectory(s.dht)
        return {}

    async def cmd_dht_store(self, key: str, value: Any, ttl: float = 600.0) -> dict[str, Any]:
        ok = await self.s.dht.store(key, value, time.time() + ttl)
        return {"stored": bool(ok)}

    async def cmd_dht_get(self, key: str) -> dict[str, Any]:
        found = await self.s.dht.get(key, latest=True)
        return {"value": None if found is None else found.value}

    async def cmd_state_serve(self, key: str, mbytes: float, seed: int = 0) -> dict[str, Any]:
        """Serve (and announce in the DHT) a state of `mbytes` MiB of seeded noise."""
        import torch

        from shoal.averaging.state_sync import StateServer, make_state

        noise = torch.randn(
            int(mbytes * (1 << 20)) // 4, generator=torch.Generator().manual_seed(seed)
        )
        state = make_state([noise], {"step": 1})
        self.s.state_server = StateServer(self.s.dht, key, lambda: state)
        return {"fingerprint": state.fingerprint, "announced": await self.s.state_server.announce()}

    async def cmd_state_load(
        self, key: str, request_timeout: float = 30.0, timeout: float = 120.0
    ) -> dict[str, Any]:
        """Download the newest state of `key` from its holders."""
        from shoal.averaging.state_sync import load_state_from_peers

        t0 = time.monotonic()
        state = await load_state_from_peers(
            self.s.dht, key, timeout=timeout, request_timeout=request_timeout
        )
        nbytes = sum(t.numel() * t.element_size() for t in state.tensors)
        return {"fingerprint": state.fingerprint, "bytes": nbytes, "seconds": time.monotonic() - t0}

    # --- plumbing -------------------------------------------------------------------------------

    async def handle(self, line: str) -> None:
        rid = None
        try:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            rid = msg.pop("id", None)
            result = await getattr(self, f"cmd_{cmd}")(**msg)
            self.emit({"id": rid, "ok": True, **result})
        except Exception as e:
            self.emit(
                {
                    "id": rid,
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-2000:],
                }
            )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        self.emit({"event": "ready", "pid": os.getpid()})
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            if line.strip():
                task = loop.create_task(self.handle(line.decode()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.aclose()


def main() -> None:
    level = os.environ.get("NAT_PEER_LOG", "WARNING")
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(relativeCreated)7.0f %(name)s %(message)s"
    )
    uvloop.run(Peer().run())


if __name__ == "__main__":
    main()
