"""NAT traversal: identify, reachability (AutoNAT), circuit relay, hole punching (DCUtR).

Entry point: `NatManager(host, dht=None, config=NatConfig())`; the host needs
``HostConfig(reuse_port=True)``.
"""

from .autonat import Reachability
from .config import NatConfig, RelayLimits
from .manager import NatManager

__all__ = ["NatConfig", "NatManager", "Reachability", "RelayLimits"]
