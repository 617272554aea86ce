"""Sizes in bytes as people write them (512M, 2G) and read them (1.5 GiB); torch-free."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of a human size: 512M, 2G, 1.5GiB, 4096 (binary units: 1K = 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"expected a size such as 512M or 2G, got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"a memory budget must be at least 1 byte, got {text!r}")
    return int(value)


def format_size(n: int) -> str:
    """`n` bytes for a person: 1.5 GiB, 300 MiB."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
