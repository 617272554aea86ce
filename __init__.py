"""shoal: decentralized peer-to-peer training, as a daemon (`shoal run`) or a library.

    import shoal
    peer = await shoal.host("myexp", task="mytask.py:make_task", data_dir="./a")
    outer = await peer.outer(model, optimizer)   # then `await outer.step()` per step

`shoal.sync` is the same for plain scripts (a background event loop), and
`shoal.ShoalCallback` hands a `transformers.Trainer`'s steps to a `shoal.sync` peer. The layers
are the subpackages (`shoal.transport`, `shoal.dht`, ..., `shoal.peer`); this
module imports none of them until a name below is used, so `import shoal` is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LibraryError", "Outer", "Peer", "ShoalCallback", "host", "join", "sync"]

_FROM_LIBRARY = {"LibraryError", "Outer", "Peer", "host", "join"}


def __getattr__(name: str) -> Any:
    if name in _FROM_LIBRARY:
        return getattr(importlib.import_module("shoal.peer.library"), name)
    if name == "ShoalCallback":  # (imports transformers: the hf extra)
        return importlib.import_module("shoal.peer.library.hf").ShoalCallback
    if name == "sync":
        return importlib.import_module("shoal.peer.library.sync")
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
