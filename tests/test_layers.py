"""The structure, read from the source: layers import downward only and no module cycles.

Every import counts: at module level, inside functions (the lazy ones that keep torch
out of the transport) and under `TYPE_CHECKING`, relative or absolute (`shoal.*`).
The checks are functions over a module -> imports mapping, so the tests below also
feed them a graph with an upward import and a cycle and see both reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a layer imports only from itself and the layers before it.
LAYERS = ("transport", "dht", "verification", "averaging", "pipeline", "peer")

Graph = Mapping[str, Iterable[str]]


def library_modules(root: Path = ROOT) -> dict[str, Path]:
    """`shoal.<layer>...` module name -> source file, for every module of every layer."""
    modules: dict[str, Path] = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(["shoal", *parts])] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The library modules that `module` (whose source is `path`) imports, anywhere in it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                # `from package import submodule` imports the submodule itself.
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {name for name in found if name in known and name != module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = library_modules(root)
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def layer_of(module: str) -> str:
    return module.split(".")[1]


def upward_imports(graph: Graph, layers: tuple[str, ...] = LAYERS) -> list[tuple[str, str]]:
    """Every (importer, imported) pair where the imported module sits in a higher layer."""
    rank = {layer: i for i, layer in enumerate(layers)}
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if rank[layer_of(target)] > rank[layer_of(module)]
    )


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep import chain cannot exhaust the recursion limit.
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def within(graph: Graph, prefix: str) -> dict[str, set[str]]:
    """The subgraph of the modules under `prefix` (e.g. `shoal.peer`)."""
    inside = {m for m in graph if m == prefix or m.startswith(prefix + ".")}
    return {m: {t for t in graph[m] if t in inside} for m in inside}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


# ------------------------------------------------------------------ the checker itself


def test_an_upward_import_and_a_cycle_are_both_reported() -> None:
    synthetic = {
        "shoal.transport.host": {"shoal.transport.version"},
        "shoal.transport.version": {"shoal.transport.host"},  # a cycle within a layer
        "shoal.dht.node": {"shoal.transport.host", "shoal.averaging.averager"},  # upward
        "shoal.averaging.averager": {"shoal.dht.node"},  # downward, but closes a cycle
    }
    assert upward_imports(synthetic) == [("shoal.dht.node", "shoal.averaging.averager")]
    assert cycles(synthetic) == [
        ["shoal.averaging.averager", "shoal.dht.node"],
        ["shoal.transport.host", "shoal.transport.version"],
    ]


def test_a_downward_acyclic_graph_is_clean() -> None:
    synthetic = {
        "shoal.peer.cli": {"shoal.peer.daemon", "shoal.transport.host"},
        "shoal.peer.daemon": {"shoal.pipeline.server", "shoal.dht.node"},
        "shoal.pipeline.server": {"shoal.dht.node"},
        "shoal.dht.node": {"shoal.transport.host"},
        "shoal.transport.host": set(),
    }
    assert upward_imports(synthetic) == []
    assert cycles(synthetic) == []


def test_imports_are_read_under_type_checking_in_functions_and_relative(tmp_path: Path) -> None:
    (tmp_path / "transport").mkdir()
    (tmp_path / "transport" / "__init__.py").write_text("")
    (tmp_path / "transport" / "host.py").write_text("")
    (tmp_path / "dht").mkdir()
    (tmp_path / "dht" / "__init__.py").write_text("")
    (tmp_path / "dht" / "records.py").write_text("")
    (tmp_path / "dht" / "node.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import records\n"
        "if TYPE_CHECKING:\n"
        "    from shoal.peer.daemon import Daemon\n"
        "def later():\n"
        "    import shoal.pipeline.server\n"
    )
    (tmp_path / "transport" / "version.py").write_text("from ..dht.node import DHTNode\n")
    for layer in ("verification", "averaging"):
        (tmp_path / layer).mkdir()
    for layer, name in (("pipeline", "server"), ("peer", "daemon")):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / f"{name}.py").write_text("")
    found = import_graph(tmp_path)
    assert found["shoal.dht.node"] == {
        "shoal.dht.records",
        "shoal.peer.daemon",
        "shoal.pipeline.server",
    }
    assert upward_imports(found) == [
        ("shoal.dht.node", "shoal.peer.daemon"),
        ("shoal.dht.node", "shoal.pipeline.server"),
        ("shoal.transport.version", "shoal.dht.node"),
    ]


# ------------------------------------------------------------------ the library


def test_every_layer_imports_only_from_the_layers_below_it(graph: dict[str, set[str]]) -> None:
    assert len(graph) > 100  # the whole library was read
    assert upward_imports(graph) == []


def test_no_module_of_the_library_is_in_an_import_cycle(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_modules_inside_peer_import_one_another_without_cycles(
    graph: dict[str, set[str]],
) -> None:
    peer = within(graph, "shoal.peer")
    assert len(peer) > 20
    assert cycles(peer) == []


# ------------------------------------------------------------------ the parts of peer/

# What each part of `peer/` may import from the others: the training core stands alone
# (custom tasks import it), the audit service builds on it, the status surface stands
# alone, and the daemon's shell (the modules at the top of `peer/`) may use all three.
PEER_PARTS: dict[str, frozenset[str]] = {
    "training": frozenset(),
    "status": frozenset(),
    "verify": frozenset({"training"}),
    "": frozenset({"training", "status", "verify"}),
}


def peer_part(module: str) -> str:
    """`training`, `verify` or `status` for a module under them, "" for the shell."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[2] in PEER_PARTS else ""


def peer_parts_out_of_order(graph: Graph) -> list[tuple[str, str]]:
    """Every (importer, imported) pair inside `shoal.peer` that crosses parts in a way
    `PEER_PARTS` does not allow."""
    peer = within(graph, "shoal.peer")
    return sorted(
        (module, target)
        for module, targets in peer.items()
        for target in targets
        if peer_part(target) != peer_part(module)
        and peer_part(target) not in PEER_PARTS[peer_part(module)]
    )


def test_a_training_module_that_imports_the_audit_service_is_reported() -> None:
    synthetic = {
        "shoal.peer.session": {"shoal.peer.verify.verifier", "shoal.peer.status.server"},
        "shoal.peer.verify.verifier": {"shoal.peer.training.inner"},
        "shoal.peer.training.inner": {"shoal.peer.verify.segments"},  # upward
        "shoal.peer.verify.segments": set(),
        "shoal.peer.status.server": {"shoal.peer.config"},  # the shell, from below
        "shoal.peer.config": set(),
    }
    assert peer_parts_out_of_order(synthetic) == [
        ("shoal.peer.status.server", "shoal.peer.config"),
        ("shoal.peer.training.inner", "shoal.peer.verify.segments"),
    ]


def test_the_parts_of_peer_import_one_another_only_in_their_order(
    graph: dict[str, set[str]],
) -> None:
    assert {peer_part(m) for m in within(graph, "shoal.peer")} == set(PEER_PARTS)
    assert peer_parts_out_of_order(graph) == []


def test_peer_keeps_a_small_shell() -> None:
    assert len(list((ROOT / "peer").glob("*.py"))) <= 15


def test_every_package_of_the_tree_is_in_the_wheel() -> None:
    """pyproject lists the packages one by one (no top-level `dht` in site-packages):
    a new folder left out installs a shoal that cannot import itself."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {setuptools["package-dir"][name] for name in setuptools["packages"]}
    on_disk = {
        str(init.parent.relative_to(ROOT))
        for layer in LAYERS
        for init in (ROOT / layer).rglob("__init__.py")
    }
    assert on_disk <= listed, sorted(on_disk - listed)
