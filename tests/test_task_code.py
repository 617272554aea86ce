"""Task code a joiner consents to, and experiments on data only each peer has.

A custom task's code is pinned by a digest computed without importing it; a
joiner imports what a manifest names only when it named that task itself and
its copy has the digest. An experiment whose peers train on their own data
cannot be verified (a referee regenerates a prover's batches from its own
data), so it is hosted unverified, says so, and refuses `--verify on`.
"""

from __future__ import annotations

import logging
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shoal.peer import session
from shoal.peer.cli import parse_command_line
from shoal.peer.config import Config, ConfigError
from shoal.peer.experiment import Manifest
from shoal.peer.session import SessionError, verification_options
from shoal.peer.training.task import load_task, trains_on_private_data
from shoal.peer.training.task_code import check_consent, source_files, task_digest
from shoal.peer.training.task_error import TaskError
from shoal.transport.identity import Identity

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task.py"
SMALL_MLP = {"context": 4, "embedding": 4, "hidden": 8, "batch_size": 4, "data": "user"}

pytestmark = pytest.mark.timeout(60)


def run_config(*argv: str, **environ: str) -> Config:
    command, config = parse_command_line(["run", *argv], environ)
    assert command == "run"
    return config


def trap_package(root: Path, marker: Path) -> str:
    """A package on sys.path whose every module records that it was imported, and fails."""
    name = f"shoal_trap_{uuid.uuid4().hex[:8]}"
    trap = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nraise RuntimeError('imported')\n"
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(trap)
    (root / name / "tasks.py").write_text(trap + "def make_task(config, data=None): ...\n")
    return name


def edit(spec: str, change: Callable[[bytes], bytes]) -> Path:
    """Change the file of a `path/to/file.py:factory` spec; its path."""
    path = Path(spec.rpartition(":")[0])
    path.write_bytes(change(path.read_bytes()))
    return path


def manifest_of(spec: str, digest: str = "", *, verify: bool = False, **config: Any) -> Manifest:
    return Manifest.create(
        Identity.generate(),
        name="strangers",
        task=spec,
        task_config=config,
        strategy="diloco",
        strategy_options={"inner_steps": 5, "verify": verify},
        hyperparameters={},
        seed=7,
        initial_fingerprint="00" * 32,
        task_digest=digest,
    )


@pytest.fixture
def example(tmp_path: Path) -> str:
    """The example custom task, copied: the spec a host names."""
    path = tmp_path / "code" / "custom_task.py"
    path.parent.mkdir()
    shutil.copy(EXAMPLE, path)
    return f"{path}:make_task"


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "mine.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return path


# --- the digest ---------------------------------------------------------------------------------


def test_a_one_byte_change_to_a_task_file_changes_its_digest(example: str) -> None:
    before = task_digest(example)
    assert len(before) == 64 and before == task_digest(example)
    path = Path(example.rpartition(":")[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert task_digest(example) != before


def test_a_package_digest_covers_every_source_file_not_only_the_named_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"shoal_pkg_{uuid.uuid4().hex[:8]}"
    package = tmp_path / name
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "task.py").write_text("from .models.net import Net\n")
    (package / "models" / "net.py").write_text("class Net: width = 8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = f"{name}.task:make_task"
    before = task_digest(spec)
    assert [relative for relative, _ in source_files(spec).files] == [
        "__init__.py",
        "models/net.py",
        "task.py",
    ]
    (package / "models" / "net.py").write_text("class Net: width = 9\n")  # a sibling changed
    assert task_digest(spec) != before
    (package / "models" / "net.py").write_text("class Net: width = 8\n")
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "stale.py").write_text("junk")
    (package / "notes.txt").write_text("not code")
    assert task_digest(spec) == before  # caches and non-Python files are not code


def test_the_digest_depends_on_contents_not_on_creation_order_or_install_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {"__init__.py": "", "a.py": "A = 1\n", "sub/__init__.py": "", "sub/b.py": "B = 2\n"}
    name = f"shoal_pkg_{uuid.uuid4().hex[:8]}"
    digests = []
    for place, order in (("one", sorted(files)), ("two", sorted(files, reverse=True))):
        for relative in order:
            path = tmp_path / place / name / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[relative])
        with monkeypatch.context() as m:
            m.syspath_prepend(str(tmp_path / place))
            sys.path_importer_cache.clear()
            digests.append(task_digest(f"{name}.a:make_task"))
    assert digests[0] == digests[1]


def test_computing_a_digest_imports_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    monkeypatch.syspath_prepend(str(tmp_path))
    name = trap_package(tmp_path, marker)
    task_digest(f"{name}.tasks:make_task")
    task_digest(f"{tmp_path / name / 'tasks.py'}:make_task")
    assert not marker.exists()
    assert not any(m.startswith(name) for m in sys.modules)


def test_a_task_whose_code_cannot_be_found_or_read_has_no_digest(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no module named 'no_such_pkg_xyz'"):
        task_digest("no_such_pkg_xyz.tasks:make_task")
    with pytest.raises(TaskError, match="no such file"):
        task_digest(f"{tmp_path}/nope.py:make_task")
    with pytest.raises(TaskError, match="not Python source"):
        task_digest("sys:exit")  # built into the interpreter: no source to pin


# --- the joiner's consent -----------------------------------------------------------------------


def test_a_builtin_task_needs_no_consent_and_a_custom_one_must_be_named() -> None:
    check_consent("bytegpt", ())
    check_consent("mytask:make_task", ("mytask:make_task",))
    with pytest.raises(TaskError, match="--allow-task mytask:make_task"):
        check_consent("mytask:make_task", ())
    with pytest.raises(TaskError, match="you named 'mytask:other'"):
        check_consent("mytask:make_task", ("mytask:other",))


def test_the_allow_task_flag_takes_specs_and_only_an_explicit_task_counts_as_named() -> None:
    assert run_config().named_tasks == ()  # the default --task names nothing
    assert run_config("--task", "m:f").named_tasks == ("m:f",)
    assert run_config(SHOAL_TASK="m:f").named_tasks == ("m:f",)
    config = run_config("--allow-task", "a.b:f", "--allow-task", "x.py:g", "--task", "a.b:f")
    assert config.named_tasks == ("a.b:f", "x.py:g")
    assert run_config(SHOAL_ALLOW_TASK="a:f,b:g").allow_task == ("a:f", "b:g")
    for bad in ("bytegpt", "module:", ":factory"):
        with pytest.raises(ConfigError, match="expected MODULE:FACTORY"):
            run_config("--allow-task", bad)


async def test_a_manifest_naming_a_standard_library_function_is_refused() -> None:
    for named in ((), ("mytask:make_task",)):
        config = run_config("--join", "strangers", *(f"--task={n}" for n in named))
        with pytest.raises(SessionError, match="custom task 'os:system'") as caught:
            await session._joined_task(config, manifest_of("os:system", "ab" * 32))
        assert "\n" not in str(caught.value)


async def test_a_joiner_that_did_not_name_the_task_imports_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    monkeypatch.syspath_prepend(str(tmp_path))
    name = trap_package(tmp_path, marker)
    spec = f"{name}.tasks:make_task"
    manifest = manifest_of(spec, task_digest(spec))
    with pytest.raises(SessionError, match=f"--allow-task {spec}"):
        await session._joined_task(run_config("--join", "strangers"), manifest)
    # Named, but pinning other code than the joiner's: refused before the import too.
    other = manifest_of(spec, "ab" * 32)
    with pytest.raises(SessionError, match="differs"):
        await session._joined_task(run_config("--allow-task", spec), other)
    assert not marker.exists()
    assert not any(m.startswith(name) for m in sys.modules)


async def test_a_joiner_that_allows_the_task_runs_it_when_its_copy_matches(
    example: str, text: Path
) -> None:
    manifest = manifest_of(example, task_digest(example), **SMALL_MLP)
    for flag in ("--allow-task", "--task"):
        config = run_config("--join", "strangers", flag, example, "--data", str(text))
        task = await session._joined_task(config, manifest)
        assert task.name == "bytemlp" and task.config() == SMALL_MLP


async def test_a_joiner_whose_task_file_differs_by_one_byte_is_refused_with_the_digests(
    example: str, text: Path
) -> None:
    pinned = task_digest(example)
    path = edit(example, lambda code: code + b" ")
    config = run_config("--allow-task", example, "--data", str(text))
    with pytest.raises(SessionError) as caught:
        await session._joined_task(config, manifest_of(example, pinned, **SMALL_MLP))
    message = str(caught.value)
    assert f"the manifest pins {pinned}" in message
    assert f"has digest {task_digest(example)}" in message and str(path) in message
    assert "\n" not in message


async def test_a_custom_task_from_a_manifest_without_a_digest_is_refused(example: str) -> None:
    old = manifest_of(example, **SMALL_MLP)  # format 1: an older shoal's host
    assert old.format == 1
    with pytest.raises(SessionError, match="pins no digest"):
        await session._joined_task(run_config("--allow-task", example), old)


async def test_a_host_whose_task_code_changed_since_it_created_the_experiment_stops(
    example: str, text: Path
) -> None:
    manifest = manifest_of(example, task_digest(example), **SMALL_MLP)
    config = run_config("--data", str(text))
    assert (await session._hosted_task(config, manifest)).name == "bytemlp"
    edit(example, lambda code: code.replace(b"hidden", b"hiddeN", 1))
    with pytest.raises(SessionError, match=r"differs.*host a new experiment name"):
        await session._hosted_task(config, manifest)


# --- private data -------------------------------------------------------------------------------


def test_bytegpt_on_each_peers_own_text_is_private_unless_its_digest_is_pinned(
    text: Path,
) -> None:
    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 8, "batch_size": 2}
    own = load_task("bytegpt", tiny, data=text)
    assert trains_on_private_data(own, text)
    pinned = load_task("bytegpt", {**tiny, "data_digest": own.corpus.digest}, data=text)  # type: ignore[attr-defined]
    assert not trains_on_private_data(pinned, text)
    stdlib = load_task("bytegpt", {**tiny, "max_bytes": 50_000})
    assert not trains_on_private_data(stdlib, None)


def test_a_task_without_a_say_is_private_exactly_when_given_data(example: str, text: Path) -> None:
    task = load_task(example, SMALL_MLP, data=text)
    assert not hasattr(task, "private_data")
    assert trains_on_private_data(task, text) and not trains_on_private_data(task, None)


def test_an_experiment_on_private_data_is_hosted_unverified_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = {"inner_steps": 50}
    with caplog.at_level(logging.WARNING, logger="shoal.session"):
        options = verification_options(run_config(), base, private_data=True, name="mine")
    assert options["verify"] is False
    lines = [r.getMessage() for r in caplog.records if "UNVERIFIED" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "'mine'" in lines[0]
    caplog.clear()
    off = verification_options(run_config("--verify", "off"), base, private_data=True)
    assert off["verify"] is False and not caplog.records  # asked for: nothing to say
    assert verification_options(run_config(), base)["verify"] is True  # shared data


@pytest.mark.parametrize(
    ("argv", "options", "flag"),
    [
        (["--verify", "on"], {}, "--verify on"),
        ([], {"verify": True}, "--strategy-option verify"),
    ],
)
def test_asking_to_verify_an_experiment_on_private_data_is_refused_in_one_line(
    argv: list[str], options: dict[str, Any], flag: str
) -> None:
    with pytest.raises(SessionError) as caught:
        verification_options(run_config(*argv), options, private_data=True, name="mine")
    message = str(caught.value)
    assert message.startswith(f"{flag}: experiment 'mine' trains on each peer's own --data")
    assert "\n" not in message


async def test_a_joiner_refuses_a_verified_experiment_on_its_own_data(
    example: str, text: Path
) -> None:
    """An older host (or a lying one) verifying work on private data: the joiner's
    honest work would be convicted, so it does not take part."""
    verified = manifest_of(example, task_digest(example), verify=True, **SMALL_MLP)
    config = run_config("--allow-task", example, "--data", str(text))
    with pytest.raises(SessionError, match="verifies work on each peer's own --data"):
        await session._joined_task(config, verified)
