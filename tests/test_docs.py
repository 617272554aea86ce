"""The documentation: docs/ builds with no broken link, and the CLI reference matches the parser.

`mkdocs build --strict` fails on a broken internal link or anchor (mkdocs.yml's
`validation`), and docs/reference/cli.md must be exactly what
docs/gen_cli_reference.py renders from `shoal.peer.cli.build_parser()`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from shoal.peer.cli import build_parser
from shoal.peer.config import OPTIONS
from shoal.transport.version import PROTOCOL_VERSION

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
QUICK_START = (
    "pip install torch==2.13.0 . && shoal run",
    'pip install -e ".[test]" && pytest',
)


def load_generator() -> ModuleType:
    path = ROOT / "docs" / "gen_cli_reference.py"
    spec = importlib.util.spec_from_file_location("gen_cli_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section(page: str, command: str) -> str:
    """The part of the reference page about `command`, up to the next command."""
    start = page.index(f"## `{command}`\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else len(page)]


def run_flags() -> list[argparse.Action]:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    run = commands.choices["run"]
    return [a for a in run._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # a banner, not a warning of ours
    # Not --quiet: it hides the warnings that --strict counts, and the build passes.
    command = ["build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *command],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
        check=False,
    )


def test_the_checked_in_cli_reference_is_what_the_parser_renders() -> None:
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert page == load_generator().render(), (
        "docs/reference/cli.md is stale: run python docs/gen_cli_reference.py"
    )


def test_the_cli_reference_lists_every_flag_of_shoal_run_with_its_variable() -> None:
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    run = section(page, "shoal run")
    flags = run_flags()
    assert len(flags) >= len(OPTIONS)  # every option of the table is a flag of `run`
    for action in flags:
        flag = action.option_strings[-1]
        rows = [line for line in run.splitlines() if re.match(rf"\| (`|<code>){flag}[ `<]", line)]
        assert len(rows) == 1, flag
        row = rows[0]
        option = OPTIONS[action.dest]
        assert f"`{option.env}`" in row
        assert option.default_text.replace("|", "&#124;") in row


def test_a_flag_added_to_the_parser_makes_the_checked_in_reference_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generator = load_generator()
    real_build_parser = generator.build_parser

    def with_a_new_flag() -> argparse.ArgumentParser:
        parser = real_build_parser()
        [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        commands.choices["run"].add_argument(
            "--made-up-flag", metavar="N", help="a flag nobody documented by hand"
        )
        return parser

    monkeypatch.setattr(generator, "build_parser", with_a_new_flag)
    rendered = generator.render()
    assert "| `--made-up-flag N` |" in section(rendered, "shoal run")
    assert generator.main(["--check"]) == 1


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_a_broken_link_fails_the_docs_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")  # symlinked images copied as files
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "security.md"
    page.write_text(page.read_text() + "\nSee [nothing](no-such-page.md).\n")
    result = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr


def test_the_readme_is_short_and_keeps_the_quick_start_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for command in QUICK_START:
        assert f"\n{command}\n" in text


def test_every_link_of_the_readme_into_docs_names_a_page_that_exists() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text(encoding="utf-8"))
    assert links, "the README links into docs/"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing


def test_the_protocols_page_names_every_protocol_and_the_current_version() -> None:
    page = (ROOT / "docs" / "reference" / "protocols.md").read_text(encoding="utf-8")
    layers = ("transport", "dht", "verification", "averaging", "pipeline", "peer")
    names = {
        re.sub(r"\{(\w+)\}", r"<\1>", name)
        for layer in layers
        for source in (ROOT / layer).rglob("*.py")
        for name in re.findall(r"f?\"(/shoal/[\w{}<>/.-]+/\d+\.\d+\.\d+)\"", source.read_text())
    }
    assert "/shoal/dht/1.0.0" in names
    missing = sorted(name for name in names if f"`{name}`" not in page)
    assert not missing
    assert f"(today {PROTOCOL_VERSION})" in page
