"""A state downloads over a slow home link (the NAT lab, ../shared/lab).

Each request of a state download is one RPC that must end within the download's
`request_timeout`. Requests of a fixed 64 MB could never end in 30 s below 17 Mbit/s,
so a 25M-parameter state could not be re-synced at 10 Mbit/s (bench/wan.py): the
requests must follow the rate the link shows.
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


@pytest.mark.timeout(120)
async def test_a_state_larger_than_one_request_can_carry_downloads_over_10_mbit() -> None:
    async with Lab("ss-") as lab:
        # 10 Mbit/s and 25 ms each way on the downloader's uplink (bench/wan.py's setting).
        await asyncio.to_thread(lab.sh, "delay", "natA", "25", "0", "10")
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
