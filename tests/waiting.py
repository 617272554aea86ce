"""Waiting in tests: for a condition, never for a fixed time followed by an assumption."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

POLL_S = 0.005


async def eventually(condition: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    """Return once `condition()` is true (polled every 5 ms: most of what tests wait for
    has no event of its own); AssertionError naming `what` after `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"not true after {timeout}s: {what}") from None
