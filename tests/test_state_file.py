"""The work log's state files (averaging/state_file.py): what is written reads back bit
for bit and in the same shapes and types; a damaged file reads back as an error, never
as something else; a read-back tensor changed in place leaves its file as it was."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.averaging.state_file import StateFileError, read_tree, write_tree
from shoal.peer.trainer import DEFAULT_HYPERPARAMETERS
from shoal.peer.training.inner import InnerOptimizer
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.peer.verify.segments import capture

pytestmark = pytest.mark.timeout(60)


def trained_state() -> dict[str, Any]:
    """Parameters and AdamW state of a small model after two inner steps."""
    task = make_task({"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 16})
    model = task.make_model(0)
    inner = InnerOptimizer(model, DEFAULT_HYPERPARAMETERS, device=torch.device("cpu"))
    batches = task.batches(0, 1, 0)
    for step in range(2):
        batch = next(batches)
        inner.step(lambda b=batch: task.loss(model, b), step)
    state = capture(model, inner)
    return {"params": state.params, "optimizer": state.optimizer}


def same(a: Any, b: Any) -> bool:
    """Equal trees: the same container types, keys and values; tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_an_optimizer_state_reads_back_bit_for_bit_with_its_tuples_and_integer_keys(
    tmp_path: Path,
) -> None:
    state = trained_state()
    assert isinstance(state["optimizer"]["optimizer"]["param_groups"][0]["betas"], tuple)
    path = tmp_path / "s"
    write_tree(path, state)
    back = read_tree(path)
    assert same(state, back)
    assert sorted(back["optimizer"]["optimizer"]["state"]) == list(range(len(state["params"])))


def test_every_dtype_and_shape_it_allows_reads_back(tmp_path: Path) -> None:
    tree = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i64": torch.arange(9).reshape(3, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),  # (written contiguous)
        "plain": [None, 1, -2.5, "x", b"raw", (1, (2, 3))],
    }
    path = tmp_path / "s"
    write_tree(path, tree)
    back = read_tree(path)
    assert same({k: v for k, v in tree.items() if k != "strided"},
                {k: v for k, v in back.items() if k != "strided"})  # fmt: skip
    assert torch.equal(back["strided"], tree["strided"])


def test_what_it_cannot_write_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        write_tree(tmp_path / "a", {"s": {1, 2}})
    with pytest.raises(TypeError):
        write_tree(tmp_path / "b", torch.zeros(2, dtype=torch.complex64))


def test_a_tensor_changed_in_place_after_reading_leaves_its_file_as_it_was(
    tmp_path: Path,
) -> None:
    """An audit steps a revealed state's moments in place (`SegmentRunner.ran(adopt=True)`):
    the file, mapped copy-on-write, must not change under it."""
    path = tmp_path / "s"
    write_tree(path, {"m": torch.ones(1000)})
    on_disk = path.read_bytes()
    back = read_tree(path)
    back["m"].mul_(3.0)
    assert path.read_bytes() == on_disk
    assert torch.equal(read_tree(path)["m"], torch.ones(1000))


def test_every_truncation_is_an_error_or_the_same_state(tmp_path: Path) -> None:
    """A file cut anywhere never reads back as another state: it fails, or (cut in the
    padding after the last tensor) reads back whole."""
    tree = {"a": torch.arange(20.0), "b": [torch.ones(3, dtype=torch.int64), (0.5, None)]}
    path = tmp_path / "s"
    write_tree(path, tree)
    whole = path.read_bytes()
    cut = tmp_path / "cut"
    for n in range(len(whole)):
        cut.write_bytes(whole[:n])
        try:
            back = read_tree(cut)
        except StateFileError:
            continue
        assert same(back, tree), n


def test_damaged_bytes_are_an_error_or_a_tree_never_a_crash(tmp_path: Path) -> None:
    """Flipped bytes anywhere: a StateFileError or a tree of readable tensors (a flip in
    the data changes values: the work log then finds the digest wrong)."""
    path = tmp_path / "s"
    write_tree(path, trained_state())
    whole = path.read_bytes()
    rng = random.Random(5)
    header_end = 12 + int.from_bytes(whole[8:12], "big")
    for i in range(400):
        damaged = bytearray(whole)
        # Mostly in the header, where the structure is.
        at = rng.randrange(header_end) if i % 4 else rng.randrange(len(whole))
        damaged[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            back = read_tree(path)
        except StateFileError:
            continue
        stack = [back]
        while stack:
            node = stack.pop()
            if isinstance(node, torch.Tensor):
                node.float().sum()
            elif isinstance(node, dict):
                stack.extend(node.values())
            elif isinstance(node, list | tuple):
                stack.extend(node)


def test_a_file_of_another_format_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "s"
    torch.save({"params": [torch.zeros(3)]}, path)
    with pytest.raises(StateFileError):
        read_tree(path)
    path.write_bytes(b"")
    with pytest.raises(StateFileError):
        read_tree(path)
