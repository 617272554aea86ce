"""A tiny authoritative DNS server over UDP for tests: TXT records from a dict.

Built on dnspython's message API. `zone` maps a lowercased name (no trailing dot)
to its TXT values; each value is one or more character-strings (bytes, at most
255 each). Unknown names get NXDOMAIN; `silent` names get no answer at all.

Run as a program it serves in another process (the NAT lab's public namespace):
`python dns_server.py IP:PORT NAME=VALUE...` prints `ready IP:PORT` once it listens,
serves until its stdin closes, then prints the names it was asked on stderr.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from dns.rdtypes.ANY.TXT import TXT

TxtValue = bytes | tuple[bytes, ...]


@dataclass
class Zone:
    records: dict[str, list[TxtValue]] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)
    queries: list[str] = field(default_factory=list)

    def answer(self, wire: bytes) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except Exception:
            return None
        if len(query.question) != 1:
            return None
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        self.queries.append(name)
        if name in self.silent:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        values = self.records.get(name)
        if values is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.TXT and values:
            rrset = dns.rrset.RRset(question.name, dns.rdataclass.IN, dns.rdatatype.TXT)
            for value in values:
                strings = (value,) if isinstance(value, bytes) else value
                rrset.add(TXT(dns.rdataclass.IN, dns.rdatatype.TXT, strings), ttl=60)
            response.answer.append(rrset)
        return response.to_wire()


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, zone: Zone) -> None:
        self.zone = zone
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport  # (uvloop's UDPTransport is no asyncio.DatagramTransport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.zone.answer(data)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


@asynccontextmanager
async def dns_server(
    zone: Zone, address: tuple[str, int] = ("127.0.0.1", 0)
) -> AsyncIterator[tuple[str, int]]:
    """Serve `zone` on `address` (default: 127.0.0.1, a free UDP port); yields (IP, port)."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(zone), local_addr=address)
    try:
        yield transport.get_extra_info("sockname")[:2]
    finally:
        transport.close()


async def _serve_until_stdin_closes(address: tuple[str, int], zone: Zone) -> None:
    loop = asyncio.get_running_loop()
    async with dns_server(zone, address) as (ip, port):
        print(f"ready {ip}:{port}", flush=True)
        # Until the parent closes our stdin (or dies): no process outlives its test.
        await loop.run_in_executor(None, sys.stdin.read)
    print(f"queries: {' '.join(zone.queries)}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    ip, _, port = argv[0].rpartition(":")
    zone = Zone()
    for record in argv[1:]:
        name, _, value = record.partition("=")
        zone.records.setdefault(name.lower(), []).append(value.encode())
    asyncio.run(_serve_until_stdin_closes((ip, int(port)), zone))


if __name__ == "__main__":
    main(sys.argv[1:])
