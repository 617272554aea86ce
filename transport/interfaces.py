"""The IP addresses of this machine's interfaces, to expand 0.0.0.0 / :: listen addresses.

Read from the kernel directly (ioctl for IPv4, /proc for IPv6) rather than by
adding a dependency such as netifaces/psutil for two small functions; on
platforms without them we fall back to loopback plus the resolver's view.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915


def _ipv4_addresses() -> list[str]:
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue  # interface without an IPv4 address
            out.append(socket.inet_ntoa(res[20:24]))
    return out


def _ipv6_addresses() -> list[str]:
    out = []
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr = line.split()[0]
                ip = ipaddress.IPv6Address(bytes.fromhex(hexaddr))
                if not ip.is_link_local:  # needs a zone to be dialable
                    out.append(str(ip))
    except OSError:
        pass
    return out


def local_addresses(family: str) -> list[str]:
    """Interface addresses for "ip4" or "ip6", loopback first."""
    try:
        addrs = _ipv4_addresses() if family == "ip4" else _ipv6_addresses()
    except OSError:
        addrs = []
    if not addrs:
        addrs = ["127.0.0.1"] if family == "ip4" else []
        with contextlib.suppress(OSError):
            fam = socket.AF_INET if family == "ip4" else socket.AF_INET6
            for info in socket.getaddrinfo(socket.gethostname(), None, fam):
                addrs.append(str(info[4][0]))
    addrs = list(dict.fromkeys(addrs))
    return sorted(addrs, key=lambda a: not ipaddress.ip_address(a).is_loopback)
