#!/usr/bin/env python3
"""The image's HEALTHCHECK: exit 0 when the daemon's GET /healthz answers 200.

The status server listens on the daemon's --status-addr if its command line has
one (flags take precedence over variables), else on SHOAL_STATUS_ADDR
(host:port, [v6]:port); inside the container it is 0.0.0.0:8080, reached here
through loopback. The daemon is the container's process 1. Standard
library only: the check must not import torch or shoal (it runs every 30 s).
"""

import os
import sys
import urllib.request

DEFAULT_ADDR = "127.0.0.1:8080"
TIMEOUT = 4.0  # below the HEALTHCHECK --timeout, so a hung server reads as unhealthy, not killed


def healthz_url(status_addr: str) -> str | None:
    """The URL of /healthz for SHOAL_STATUS_ADDR's forms (see `--status-addr`); None: 'off'."""
    text = status_addr.strip()
    if text.lower() == "off":
        return None
    host, _, port = text.rpartition(":") if ":" in text else ("", "", text)
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def status_addr_flag(argv: list[str]) -> str | None:
    """The value of --status-addr in a command line (either form), else None."""
    for i, arg in enumerate(argv):
        if arg == "--status-addr" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--status-addr="):
            return arg.split("=", 1)[1]
    return None


def daemon_argv(pid: int = 1) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def main() -> int:
    addr = status_addr_flag(daemon_argv()) or os.environ.get("SHOAL_STATUS_ADDR")
    url = healthz_url(addr or DEFAULT_ADDR)
    if url is None:
        print("healthy: the status endpoint is off, nothing to check")
        return 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
            ok = response.status == 200
    except OSError as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1
    print(f"{'healthy' if ok else 'unhealthy'}: {url}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
