"""Private swarms: who may connect at all (a pre-shared swarm key, an allow list of peer IDs).

Two independent gates, both at the secure handshake (transport/secure.py), so
nothing past it (streams, DHT, hello) ever reaches a peer that fails them:

- **Swarm key** (``--swarm-key FILE``): 32 secret bytes every peer of the swarm
  shares. They are Noise's pre-shared key (``Noise_XXpsk0``, transport/noise.py):
  mixed into the handshake's keys before its first message, so a peer without
  the key, or with another, fails the first message's AEAD tag. The responder
  refuses it before sending a byte, and a keyless responder refuses a keyed
  initiator's first message by its length; either way the other side learns
  nothing but "refused" (not our peer ID, not our static key). We chose this over
  libp2p's pnet (XSalsa20 over the whole connection under the secure channel):
  the key authenticates the handshake rather than only hiding it, a wrong key
  fails at once with a clear error instead of as garbled frames, and the data
  path costs nothing extra. The file is libp2p's ``swarm.key`` format, so
  libp2p tooling can make one::

      /key/swarm/psk/1.0.0/
      /base16/
      <64 hex digits>

  (``/base64/`` and ``/bin/`` encodings are read too, as go-libp2p reads them.)

- **Allow list** (``--allow-peers FILE``): peer IDs, one per line, ``#`` comments.
  A remote whose authenticated peer ID is not listed is refused at the end of
  the handshake: a dialer checks the responder's ID before sending the last
  message, a responder checks the initiator's before completing. The rule is
  strict: bootstrap peers and relays must be listed too. The responder's
  identity is the one thing an unlisted dialer can learn (XX reveals it in
  message 2); with a swarm key as well, it learns nothing.

AutoNAT dial-backs come from a throwaway identity derived from the request's
nonce (transport/nat/autonat.py), which the asking peer admits for the length
of its request only: nobody else knows the nonce.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from .identity import PeerID
from .noise import PSK_LEN

__all__ = [
    "SWARM_KEY_HEADER",
    "AccessControl",
    "AccessFileError",
    "format_swarm_key",
    "parse_allow_list",
    "parse_swarm_key",
    "read_allow_list",
    "read_swarm_key",
    "swarm_key_fingerprint",
    "write_new_swarm_key",
]

SWARM_KEY_HEADER = "/key/swarm/psk/1.0.0/"
_ENCODINGS = ("/base16/", "/base64/", "/bin/")
MAX_FILE_BYTES = 1 << 20  # an allow list of ~19,000 peer IDs; a key file is ~100 bytes
MODES = ("open", "swarm-key", "allow-peers", "swarm-key+allow-peers")


class AccessFileError(ValueError):
    """A swarm key or allow-list file is unusable; the message names the file and the fix."""


# --- the swarm key file ------------------------------------------------------------------------


def parse_swarm_key(data: bytes) -> bytes:
    """The 32-byte key of a libp2p ``swarm.key`` file's contents. Raises ValueError."""
    header, _, rest = data.partition(b"\n")
    if header.strip().decode("ascii", "replace") != SWARM_KEY_HEADER:
        raise ValueError(f"first line must be {SWARM_KEY_HEADER} (a libp2p swarm.key file)")
    encoding_line, _, body = rest.partition(b"\n")
    encoding = encoding_line.strip().decode("ascii", "replace")
    if encoding not in _ENCODINGS:
        raise ValueError(f"second line must be one of {', '.join(_ENCODINGS)}, got {encoding!r}")
    if encoding == "/bin/":
        key = body
    else:
        text = body.strip()
        try:
            if encoding == "/base16/":
                key = binascii.unhexlify(text)
            else:
                key = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"third line is not {encoding.strip('/')}") from None
    if len(key) != PSK_LEN:
        raise ValueError(
            f"the key must be {PSK_LEN} bytes ({2 * PSK_LEN} hex digits), got {len(key)}"
        )
    return bytes(key)


def format_swarm_key(key: bytes) -> str:
    """`key` as a libp2p ``swarm.key`` file (base16)."""
    if len(key) != PSK_LEN:
        raise ValueError(f"a swarm key is {PSK_LEN} bytes, got {len(key)}")
    return f"{SWARM_KEY_HEADER}\n/base16/\n{key.hex()}\n"


def swarm_key_fingerprint(key: bytes) -> str:
    """A short public name of the key, to compare between peers (never the key itself)."""
    return hashlib.sha256(b"shoal-swarm-key-fingerprint:" + key).hexdigest()[:16]


def _read_small(path: Path, what: str) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise AccessFileError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise AccessFileError(f"{what} {path} is larger than {MAX_FILE_BYTES} bytes")
    return data


def read_swarm_key(path: str | os.PathLike[str]) -> bytes:
    """The key in the swarm key file at `path`. Raises AccessFileError."""
    path = Path(path)
    try:
        return parse_swarm_key(_read_small(path, "swarm key file"))
    except AccessFileError:
        raise
    except ValueError as e:
        raise AccessFileError(
            f"swarm key file {path} is not valid: {e}; make one with `shoal swarm-key new FILE`"
        ) from None


def write_new_swarm_key(path: str | os.PathLike[str]) -> bytes:
    """Create a swarm key file (mode 0600) with a fresh random key; never overwrites one."""
    path = Path(path)
    key = os.urandom(PSK_LEN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AccessFileError(f"{path} exists; not overwriting a swarm key") from None
    except OSError as e:
        raise AccessFileError(f"cannot create {path}: {e.strerror or e}") from None
    try:
        os.write(fd, format_swarm_key(key).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


# --- the allow list ----------------------------------------------------------------------------


def parse_allow_list(text: str) -> frozenset[PeerID]:
    """Peer IDs, one per line; ``#`` starts a comment; blank lines are skipped. Raises
    ValueError naming the first bad line."""
    peers = set()
    for number, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            peers.add(PeerID.from_base58(entry))
        except ValueError:
            shown = entry if len(entry) <= 60 else entry[:57] + "..."
            raise ValueError(f"line {number}: {shown!r} is not a peer ID (12D3KooW...)") from None
    return frozenset(peers)


def read_allow_list(path: str | os.PathLike[str]) -> frozenset[PeerID]:
    """The peer IDs of the allow-list file at `path`. Raises AccessFileError."""
    path = Path(path)
    data = _read_small(path, "allow-list file")
    try:
        peers = parse_allow_list(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise AccessFileError(f"allow-list file {path} is not UTF-8 text") from None
    except ValueError as e:
        raise AccessFileError(f"allow-list file {path}: {e}") from None
    if not peers:
        raise AccessFileError(
            f"allow-list file {path} lists no peer ID: it would refuse everyone "
            "(one peer ID per line, as `shoal id` prints it)"
        )
    return peers


# --- the gate ----------------------------------------------------------------------------------


class AccessControl:
    """The access rules of one host and what they refused.

    Open (the default) costs nothing: `swarm_key` and `authorize` are None and the
    handshake runs exactly as without this class.
    """

    def __init__(
        self, swarm_key: bytes | None = None, allowed: Iterable[PeerID] | None = None
    ) -> None:
        if swarm_key is not None and len(swarm_key) != PSK_LEN:
            raise ValueError(f"a swarm key is {PSK_LEN} bytes, got {len(swarm_key)}")
        self.swarm_key = swarm_key
        self.allowed: frozenset[PeerID] | None = None if allowed is None else frozenset(allowed)
        # Admitted for a while without being listed (AutoNAT dial-backs): peer -> holders.
        self._admitted: Counter[PeerID] = Counter()
        self.refusals: Counter[str] = Counter()  # reason -> count: "swarm_key", "not_allowed"
        # Handshakes we started with a swarm key that the remote closed before answering:
        # its key differs (or it refused us for another reason). Not our refusal.
        self.unanswered = 0
        self.authorize: Callable[[PeerID], str | None] | None = (
            None if self.allowed is None else self._authorize
        )

    @property
    def mode(self) -> str:
        key, allow = self.swarm_key is not None, self.allowed is not None
        return MODES[key + 2 * allow]

    @property
    def restricts_peers(self) -> bool:
        return self.allowed is not None

    def _authorize(self, peer: PeerID) -> str | None:
        assert self.allowed is not None
        if peer in self.allowed or peer in self._admitted:
            return None
        return f"{peer} is not in the allow list"

    def admit_for_now(self, peer: PeerID) -> Callable[[], None]:
        """Let `peer` through the allow list until the returned function is called."""
        self._admitted[peer] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._admitted[peer] -= 1
                if self._admitted[peer] <= 0:
                    del self._admitted[peer]

        return release

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1

    def status(self) -> dict[str, object]:
        """/status `access` (never the key: its fingerprint)."""
        return {
            "mode": self.mode,
            "refusals": sum(self.refusals.values()),
            "refusals_by_reason": {
                "swarm_key": self.refusals["swarm_key"],
                "not_allowed": self.refusals["not_allowed"],
            },
            "unanswered_handshakes": self.unanswered,
            "swarm_key_fingerprint": (
                None if self.swarm_key is None else swarm_key_fingerprint(self.swarm_key)
            ),
            "allowed_peers": None if self.allowed is None else len(self.allowed),
        }
