"""The manifests of the experiments this peer joined, kept in its data directory.

A peer that restarts while the network cannot show it its experiment's record
(a partition, the host down, its own DHT table still filling) goes on with the
manifest it saved when it joined, instead of exiting: the host signed it, so
a saved copy proves what the DHT's would. The peers it then meets in rounds
are the ones training that very experiment (the averaging key carries its id).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from .experiment import ExperimentRef, Manifest, ManifestError

__all__ = ["joined_path", "load_joined", "save_joined"]

log = logging.getLogger("shoal.session")


def joined_path(directory: Path, ref: ExperimentRef) -> Path:
    """Where the manifest that `--join <ref>` found is kept."""
    digest = hashlib.sha256(str(ref).encode()).hexdigest()[:12]
    return directory / f"{ref.name}-{digest}.manifest"


def save_joined(path: Path, manifest: Manifest) -> None:
    """Keep `manifest` (atomically); a disk that refuses costs only this fallback."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(manifest.to_bytes())
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot keep the manifest of %s in %s: %s", manifest.describe(),
                    path.parent, e.strerror or e)  # fmt: skip


def load_joined(path: Path, ref: ExperimentRef) -> Manifest | None:
    """The manifest kept for `ref`, if any and valid (signed, of that name and host)."""
    try:
        manifest = Manifest.from_bytes(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ManifestError) as e:
        log.info("ignoring the kept manifest %s: %s", path, e)
        return None
    if manifest.name != ref.name or (ref.host is not None and manifest.host != ref.host):
        return None
    return manifest
