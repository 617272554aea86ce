"""The shoal daemon: CLI, configuration and lifecycle."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("shoal")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
