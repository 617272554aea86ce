"""What a 10 Mbit/s home uplink must not break (the NAT lab, ../shared/lab).

bench/wan.py's setting: each peer behind 10 Mbit/s with 25 ms each way. Over it the
peers of a 25M-parameter DiLoCo swarm that fell behind could never download the state
again: each request of a fixed 64 MB had to end within 30 s.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lab import Lab, lab_unavailable
from test_nat_lab import start_private, start_pub

_UNAVAILABLE = lab_unavailable()
pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or ""),
]

KEY = "lab/slow-state"


async def slow_lab(lab: Lab) -> None:
    """10 Mbit/s and 25 ms each way on natA's uplink (a1's)."""
    await asyncio.to_thread(lab.sh, "delay", "natA", "25", "0", "10")


@pytest.mark.timeout(120)
async def test_a_state_larger_than_one_request_can_carry_downloads_over_10_mbit() -> None:
    async with Lab("su1-") as lab:
        await slow_lab(lab)
        pub, pub_addr = await start_pub(lab)
        await pub.call("dht_start")
        a = await lab.spawn("a1")
        await start_private(a, pub_addr)
        await a.call("dht_start", bootstrap=[pub_addr])
        served = await pub.call("state_serve", key=KEY, mbytes=10)
        assert served["announced"]

        # 10 MiB at 10 Mbit/s take over 8 s: no single request could end within 3 s.
        got = await a.call("state_load", key=KEY, request_timeout=3.0, timeout=90.0)

        assert got["fingerprint"] == served["fingerprint"]
        assert got["bytes"] == 10 << 20
        assert got["seconds"] > 3.0  # (the link was as slow as it is meant to be)
