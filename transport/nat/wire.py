"""Small msgpack control messages of the NAT protocols: framing, limits and checks.

Every NAT protocol message is one RPC-style frame (``length:u32 kind:u8`` +
msgpack map) of at most `MAX_MESSAGE` bytes, read under a deadline. Fields are
checked here so that a peer sending garbage costs its own stream only.
"""

from __future__ import annotations

import math
from typing import Any

from ..connection import Stream
from ..errors import ProtocolViolation
from ..identity import PeerID
from ..multiaddr import Multiaddr, MultiaddrError
from ..rpc import MessageStream, RpcLimits

MAX_MESSAGE = 8192
MAX_ADDRS = 16
MAX_PROTOCOLS = 64
_LIMITS = RpcLimits(max_message=MAX_MESSAGE)


def messages(stream: Stream) -> MessageStream:
    return MessageStream(stream, _LIMITS)


async def recv_map(ms: MessageStream, what: str) -> dict[str, Any]:
    """The next message, which must be a map; ProtocolViolation otherwise (EOFError at end)."""
    msg = await ms.recv()
    if not isinstance(msg, dict):
        raise ProtocolViolation(f"{what}: expected a map, got {type(msg).__name__}")
    return msg


def get_str(msg: dict[str, Any], key: str, max_len: int = 256, default: str | None = None) -> str:
    value = msg.get(key, default)
    if not isinstance(value, str) or len(value) > max_len:
        raise ProtocolViolation(f"field {key!r} must be a string of at most {max_len} characters")
    return value


def get_bytes(msg: dict[str, Any], key: str, max_len: int = 256) -> bytes:
    value = msg.get(key)
    if not isinstance(value, bytes) or len(value) > max_len:
        raise ProtocolViolation(f"field {key!r} must be at most {max_len} bytes")
    return value


def get_number(msg: dict[str, Any], key: str, default: float | None = None) -> float:
    value = msg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ProtocolViolation(f"field {key!r} must be a number")
    return float(value)


def get_peer(msg: dict[str, Any], key: str) -> PeerID:
    try:
        return PeerID(get_bytes(msg, key, 64))
    except ValueError as e:
        raise ProtocolViolation(f"field {key!r} is not a peer ID: {e}") from None


def get_addrs(msg: dict[str, Any], key: str, max_addrs: int = MAX_ADDRS) -> list[Multiaddr]:
    """Parse a list of address strings; malformed entries are skipped, not fatal."""
    raw = msg.get(key, [])
    if not isinstance(raw, list) or len(raw) > max_addrs:
        raise ProtocolViolation(f"field {key!r} must be a list of at most {max_addrs} addresses")
    out = []
    for item in raw:
        if isinstance(item, str):
            try:
                out.append(Multiaddr(item))
            except MultiaddrError:
                continue
    return out


def get_str_list(msg: dict[str, Any], key: str, max_items: int, max_len: int = 256) -> list[str]:
    raw = msg.get(key, [])
    if not isinstance(raw, list) or len(raw) > max_items:
        raise ProtocolViolation(f"field {key!r} must be a list of at most {max_items} strings")
    return [x for x in raw if isinstance(x, str) and len(x) <= max_len]
