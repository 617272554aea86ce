"""Pinning a custom task's code: a digest of its source, computed without importing it.

A manifest that names a custom task (``module:factory`` or
``path/to/file.py:factory``) carries `task_digest(spec)` of the host's copy.
A joiner imports nothing the manifest names unless it named the same spec
itself (`check_consent`: ``--task`` equal to the manifest's, or
``--allow-task``), and then only when its own copy has the same digest
(`check_digest`). Both run before any import: naming a standard-library
function in a manifest, or shipping a one-byte change, ends in one line.

What is hashed (`source_files`):

- ``path/to/file.py:factory``: that file alone (it is loaded on its own, not
  as part of a package; a relative path is resolved against the working
  directory, as `load_task` does);
- ``package.module:factory``: every ``.py`` file of the *top-level* package
  (``package``), since a module imports its siblings; a top-level module
  (``mytask:factory``) is its one file. The package is located with
  `importlib.util.find_spec` on the top-level name, which runs none of its
  code (finding ``package.module`` would import ``package``).

The digest covers each file's path relative to the package root and its
bytes, in sorted order, so it does not depend on the order the file system
lists them, nor on where the package is installed. Compiled extensions and
data files are not covered: pin those by a version in the task's config.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .task_error import TaskError

__all__ = [
    "TaskCode",
    "check_consent",
    "check_digest",
    "is_builtin_spec",
    "is_file_target",
    "source_files",
    "task_digest",
]

_DIGEST_TAG = b"shoal/task-code/1\0"


def is_builtin_spec(spec: str) -> bool:
    """Whether `spec` has the form of a built-in task's name (no ``module:`` part)."""
    return ":" not in spec


def is_file_target(target: str) -> bool:
    """Whether the part of a spec before ``:`` names a file rather than a module."""
    return target.endswith(".py") or "/" in target or "\\" in target


@dataclass(frozen=True, slots=True)
class TaskCode:
    """The source files of a custom task, as hashed: where they are and which."""

    root: Path  # the file, or the top-level package's folder
    files: tuple[tuple[str, Path], ...]  # (path relative to the root, file), sorted

    def digest(self) -> str:
        """sha256 (hex) over the relative paths and the bytes of the files."""
        hasher = hashlib.sha256(_DIGEST_TAG)
        for relative, path in self.files:
            name = relative.encode()
            data = path.read_bytes()
            hasher.update(len(name).to_bytes(4, "big") + name)
            hasher.update(len(data).to_bytes(8, "big") + data)
        return hasher.hexdigest()

    def describe(self) -> str:
        if len(self.files) == 1 and self.files[0][1] == self.root:
            return str(self.root)
        return f"{self.root} ({len(self.files)} .py files)"


def source_files(spec: str) -> TaskCode:
    """The files `task_digest` hashes for `spec`, found without importing anything."""
    target, colon, _ = spec.rpartition(":")
    if not colon or not target:
        raise TaskError(f"task {spec!r} is not module:factory or path/to/file.py:factory")
    if is_file_target(target):
        path = Path(target).resolve()
        if not path.is_file():
            raise TaskError(f"task {spec!r}: no such file {Path(target)}")
        return TaskCode(path, ((path.name, path),))
    top = target.split(".", 1)[0]
    try:
        found = importlib.util.find_spec(top)  # a top-level name: no parent is imported
    except (ImportError, ValueError) as exc:
        raise TaskError(f"task {spec!r}: cannot locate module {top!r}: {exc}") from None
    if found is None:
        raise TaskError(
            f"task {spec!r}: no module named {top!r} here (install it or add it to PYTHONPATH)"
        )
    if found.submodule_search_locations is not None:
        return _package_files(spec, top, list(found.submodule_search_locations))
    origin = found.origin
    if not origin or not found.has_location or not origin.endswith(".py"):
        raise TaskError(
            f"task {spec!r}: module {top!r} is not Python source ({origin or 'no file'}), "
            "so its code cannot be pinned"
        )
    path = Path(origin).resolve()
    return TaskCode(path, ((path.name, path),))


def _package_files(spec: str, top: str, locations: list[str]) -> TaskCode:
    files: dict[str, Path] = {}
    roots = [Path(location).resolve() for location in locations]
    for index, root in enumerate(roots):
        # A namespace package may have several folders: each its own prefix.
        prefix = f"{index}/" if len(roots) > 1 else ""
        for path in root.rglob("*.py"):
            relative = path.relative_to(root)
            if any(part == "__pycache__" or part.startswith(".") for part in relative.parts):
                continue
            files[prefix + relative.as_posix()] = path
    if not files:
        raise TaskError(f"task {spec!r}: package {top!r} has no .py files to pin")
    return TaskCode(roots[0], tuple(sorted(files.items())))


def task_digest(spec: str) -> str:
    """The digest of the code a custom task `spec` names here; raises TaskError."""
    return _digest(spec, source_files(spec))


def _digest(spec: str, code: TaskCode) -> str:
    try:
        return code.digest()
    except OSError as exc:
        raise TaskError(f"task {spec!r}: cannot read {code.root}: {exc.strerror or exc}") from None


def check_consent(spec: str, named: tuple[str, ...]) -> None:
    """Refuse a custom task `spec` (from a manifest) that this peer did not name itself.

    `named`: the specs this peer gave (``--task`` when given, ``--allow-task``).
    """
    if is_builtin_spec(spec) or spec in named:
        return
    mine = f" (you named {', '.join(repr(n) for n in named)})" if named else ""
    raise TaskError(
        f"the experiment runs custom task {spec!r}, whose code would be imported and run "
        f"here{mine}; shoal runs only task code you name: add --allow-task {spec} "
        "if you have that code and trust it"
    )


def check_digest(spec: str, pinned: str) -> None:
    """Refuse to run custom task `spec` unless the local copy has the digest `pinned`."""
    if is_builtin_spec(spec):
        return
    if not pinned:
        raise TaskError(
            f"the experiment's manifest pins no digest of task {spec!r}'s code (its host runs "
            "an older shoal), so shoal will not run it; ask the host to upgrade and host it anew"
        )
    code = source_files(spec)
    local = _digest(spec, code)
    if local != pinned:
        raise TaskError(
            f"task {spec!r}: your copy of its code differs from the experiment's: "
            f"{code.describe()} has digest {local}, the manifest pins {pinned}; "
            "install the host's version of the code"
        )
