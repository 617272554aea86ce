"""shoal as a library: `host`/`join` start a peer in-process, `Peer.outer` averages your model.

`api` is the asynchronous API (inside your own event loop), `sync` the same for plain
scripts (a background event loop); `import shoal` exposes both (`shoal.host`,
`shoal.sync.host`).
"""

from .api import LibraryError, Outer, Peer, TaskTrainer, host, join

__all__ = ["LibraryError", "Outer", "Peer", "TaskTrainer", "host", "join"]
