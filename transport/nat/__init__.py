"""NAT traversal: identify, reachability (AutoNAT), circuit relay, hole punching (DCUtR).

Entry point: `NatManager(host, directory=None, config=NatConfig())`; the host needs
``HostConfig(reuse_port=True)``.
"""

from .autonat import Reachability
from .config import NatConfig, RelayLimits
from .directory import RelayDirectory
from .manager import NatManager

__all__ = ["NatConfig", "NatManager", "Reachability", "RelayDirectory", "RelayLimits"]
