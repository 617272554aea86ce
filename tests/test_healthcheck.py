"""The image's healthcheck finds the status endpoint the way the daemon does: flag first."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "docker" / "healthcheck.py"
spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
assert spec and spec.loader
healthcheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(healthcheck)


def test_the_flag_on_the_daemons_command_line_is_found_in_either_form() -> None:
    assert healthcheck.status_addr_flag(["shoal", "run", "--status-addr", "0.0.0.0:9000"]) == (
        "0.0.0.0:9000"
    )
    assert healthcheck.status_addr_flag(["shoal", "run", "--status-addr=[::]:9001"]) == "[::]:9001"
    assert healthcheck.status_addr_flag(["shoal", "run", "--join", "x"]) is None


def test_addresses_become_loopback_urls() -> None:
    assert healthcheck.healthz_url("0.0.0.0:9000") == "http://127.0.0.1:9000/healthz"
    assert healthcheck.healthz_url("[::]:8080") == "http://[::1]:8080/healthz"
    assert healthcheck.healthz_url("off") is None


def test_this_process_command_line_is_readable() -> None:
    import os

    argv = healthcheck.daemon_argv(os.getpid())
    assert argv and "python" in Path(argv[0]).name
