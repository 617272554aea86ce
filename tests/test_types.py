"""The type checker: mypy finds no error in the scope pyproject.toml's [tool.mypy] names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("transport", "dht", "verification", "averaging", "pipeline", "peer")


@pytest.mark.timeout(600)
def test_mypy_reports_no_error_in_its_configured_scope(tmp_path: Path) -> None:
    # The layers as the installed package lays them out (shoal/<layer>): mypy cannot
    # follow setuptools' editable finder, and `files` are relative to this folder.
    package = tmp_path / "shoal"
    package.mkdir()
    for layer in LAYERS:
        (package / layer).symlink_to(ROOT / layer, target_is_directory=True)
    checked = subprocess.run(
        [
            sys.executable, "-m", "mypy",
            "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(ROOT / ".mypy_cache"),
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Success: no issues found" in checked.stdout
