"""The training-task API (`shoal.peer.task`), the built-in `bytegpt` task and the example task."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from itertools import islice, pairwise
from pathlib import Path

import msgpack
import pytest
import torch

from shoal.peer.task import BUILTIN_TASKS, Task, TaskError, load_task, shard_of
from shoal.peer.training.tasks.bytegpt import DEFAULT_CONFIG, ByteGPTTask
from shoal.peer.training.tasks.corpus import HELD_OUT_EVERY, ByteCorpus

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task.py"
WINDOW = DEFAULT_CONFIG["context"] + 1

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The machine is shared: tests train on one core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def task() -> ByteGPTTask:
    """The built-in task on its default data (the standard library), loaded once."""
    loaded = load_task("bytegpt")
    assert isinstance(loaded, ByteGPTTask)
    return loaded


def write_text(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def train_steps(task: Task, model: torch.nn.Module, batches: Iterator[object], steps: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in islice(batches, steps):
        loss = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def mean_loss(task: Task, model: torch.nn.Module, batches: list[object]) -> float:
    with torch.no_grad():
        return sum(task.loss(model, b).item() for b in batches) / len(batches)


# --- the model -------------------------------------------------------------------------------


def test_same_seed_gives_bit_identical_initial_parameters(task: ByteGPTTask) -> None:
    first, second = task.make_model(7).state_dict(), task.make_model(7).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_different_seeds_give_different_parameters(task: ByteGPTTask) -> None:
    first, second = task.make_model(7).state_dict(), task.make_model(8).state_dict()
    assert not torch.equal(
        first["blocks.0.attention.qkv.weight"], second["blocks.0.attention.qkv.weight"]
    )


def test_make_model_leaves_the_global_rng_alone(task: ByteGPTTask) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    task.make_model(5)
    assert torch.equal(torch.rand(3), expected)


def test_output_embedding_is_tied_to_the_input_embedding(task: ByteGPTTask) -> None:
    model = task.make_model(0)
    names = [name for name, _ in model.named_parameters()]
    assert sum("embedding" in n for n in names) == 2  # token and position; no separate output
    logits = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, 256)


def test_fresh_model_loss_is_ln_256(task: ByteGPTTask) -> None:
    """A fresh model predicts bytes uniformly (also catches an unshifted target)."""
    loss = mean_loss(task, task.make_model(0), task.eval_batches(4))
    assert loss == pytest.approx(math.log(256), abs=0.05)


def test_a_few_dozen_adamw_steps_lower_the_training_loss_clearly(task: ByteGPTTask) -> None:
    model = task.make_model(0)
    held_batches = list(islice(task.batches(shard=1, num_shards=4, seed=99), 4))
    before = mean_loss(task, model, held_batches)
    train_steps(task, model, task.batches(shard=1, num_shards=4, seed=0), steps=24)
    after = mean_loss(task, model, held_batches)
    assert before > 5.4
    assert after < before - 1.5  # measured: ~3.1, a drop of ~2.4 nats


# --- batches ---------------------------------------------------------------------------------


def test_batches_are_uint8_windows_of_context_plus_one_bytes(task: ByteGPTTask) -> None:
    batch = next(task.batches(0, 1, 0))
    assert batch.dtype == torch.uint8
    assert batch.shape == (DEFAULT_CONFIG["batch_size"], WINDOW)
    assert task.batch_tokens(batch) == DEFAULT_CONFIG["batch_size"] * DEFAULT_CONFIG["context"]


def test_batches_are_determined_by_shard_num_shards_and_seed(task: ByteGPTTask) -> None:
    def take(shard: int, num_shards: int, seed: int) -> list[torch.Tensor]:
        return list(islice(task.batches(shard, num_shards, seed), 5))

    same = zip(take(2, 5, 11), take(2, 5, 11), strict=True)
    assert all(torch.equal(a, b) for a, b in same)
    assert not torch.equal(take(2, 5, 11)[0], take(2, 5, 12)[0])
    assert not torch.equal(take(2, 5, 11)[0], take(3, 5, 11)[0])


def test_shards_are_contiguous_disjoint_and_cover_the_training_bytes(task: ByteGPTTask) -> None:
    bounds = [task.corpus.shard_bounds(i, 7) for i in range(7)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == len(task.corpus.train)
    assert all(end == start for (_, end), (start, _) in pairwise(bounds))
    with pytest.raises(ValueError):
        task.corpus.shard_bounds(7, 7)


def test_each_shard_reads_only_its_own_bytes(tmp_path: Path) -> None:
    """Shard 0 of 2 is the first half of the training bytes, shard 1 the second; validation last."""
    data = write_text(tmp_path / "abc.txt", "a" * 4900 + "b" * 4900 + "c" * 200)
    task = load_task("bytegpt", data=data)
    for shard, byte in ((0, b"a"), (1, b"b")):
        for batch in islice(task.batches(shard, 2, seed=shard), 20):
            assert set(batch.flatten().tolist()) == {byte[0]}
    assert all(set(b.flatten().tolist()) == {ord("c")} for b in task.eval_batches(3))


def test_eval_batches_are_the_same_on_every_peer_and_call(task: ByteGPTTask) -> None:
    other_peer = load_task("bytegpt")
    first, again, elsewhere = task.eval_batches(3), task.eval_batches(3), other_peer.eval_batches(3)
    assert len(first) == 3
    assert task.eval_batches(0) == []
    assert all(
        torch.equal(a, b) and torch.equal(a, c)
        for a, b, c in zip(first, again, elsewhere, strict=True)
    )


def test_validation_bytes_are_held_out_of_training(task: ByteGPTTask) -> None:
    corpus = task.corpus
    assert len(corpus.val) >= WINDOW
    assert corpus.val.data_ptr() != corpus.train.data_ptr()
    # Roughly every 50th file of ~400: a small slice, not the bulk.
    assert 0.005 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.1


def test_every_50th_file_of_a_folder_is_held_out(tmp_path: Path) -> None:
    texts = [f"file {i:03d} ".encode() * 20 for i in range(2 * HELD_OUT_EVERY)]
    for i, text in enumerate(texts):
        write_text(tmp_path / f"{i:03d}.txt", text)
    corpus = ByteCorpus.from_path(tmp_path, window=WINDOW)
    assert bytes(corpus.val.tolist()) == texts[49] + texts[99]
    assert bytes(corpus.train.tolist()) == b"".join(
        t for i, t in enumerate(texts) if i not in (49, 99)
    )


# --- the standard library corpus -------------------------------------------------------------


def test_stdlib_corpus_is_python_source_without_test_suites(task: ByteGPTTask) -> None:
    from shoal.peer.training.tasks.corpus import stdlib_files

    root, files = stdlib_files()
    names = [f.relative_to(root).as_posix() for f in files]
    assert names == sorted(names)
    assert "os.py" in names and "asyncio/events.py" in names
    assert not any(n.startswith(("test/", "site-packages/", "idlelib/")) for n in names)
    assert not any("/tests/" in n or "/test/" in n for n in names)
    assert 2_000_000 < len(task.corpus.train) < 64 * 2**20


def test_config_records_the_corpus_and_a_joiner_rebuilds_the_same_task(task: ByteGPTTask) -> None:
    config = msgpack.unpackb(msgpack.packb(task.config()))  # as it travels in a manifest
    assert config["data"] == "stdlib"
    assert config["data_digest"] == task.corpus.digest
    joiner = load_task("bytegpt", config)
    assert joiner.config() == task.config()
    assert torch.equal(
        joiner.make_model(3).token_embedding.weight, task.make_model(3).token_embedding.weight
    )


def test_a_joiner_with_a_different_corpus_is_refused(task: ByteGPTTask) -> None:
    config = {**task.config(), "data_digest": "0" * 64}
    with pytest.raises(TaskError, match="differs from the Python"):
        load_task("bytegpt", config)


def test_stdlib_experiment_refuses_data(task: ByteGPTTask, tmp_path: Path) -> None:
    data = write_text(tmp_path / "t.txt", "x" * 1000)
    with pytest.raises(TaskError, match="leave out --data"):
        load_task("bytegpt", task.config(), data=data)


# --- user data -------------------------------------------------------------------------------


def test_data_folder_reads_text_files_sorted_recursively(tmp_path: Path) -> None:
    write_text(tmp_path / "b.txt", "second file\n" * 20)
    write_text(tmp_path / "a" / "z.md", "first file\n" * 20)
    write_text(tmp_path / "c.bin", b"\x00\x01binary" * 50)  # skipped: binary
    write_text(tmp_path / ".git" / "HEAD", "hidden\n" * 50)  # skipped: hidden
    task = load_task("bytegpt", data=tmp_path)
    assert task.config()["data"] == "user"
    assert task.config()["data_digest"] == ""  # each peer brings its own text
    corpus = task.corpus
    everything = bytes(torch.cat([corpus.train, corpus.val]).tolist())
    assert everything == b"first file\n" * 20 + b"second file\n" * 20


def test_data_single_file(tmp_path: Path) -> None:
    data = write_text(tmp_path / "book.txt", "All work and no play. " * 500)
    task = load_task("bytegpt", data=data)
    total = len(task.corpus.train) + len(task.corpus.val)
    assert total == 11_000
    assert len(task.corpus.val) == 220  # the last 2%
    assert next(task.batches(0, 3, 0)).shape == (8, WINDOW)


def test_user_experiment_without_data_is_refused(tmp_path: Path) -> None:
    data = write_text(tmp_path / "t.txt", "hello world " * 100)
    config = load_task("bytegpt", data=data).config()
    with pytest.raises(TaskError, match="give --data PATH"):
        load_task("bytegpt", config)
    assert load_task("bytegpt", config, data=data).config() == config


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "no text"), (b"tiny", "at least 258"), (b"\x00" * 100, "not a text file")],
    ids=["empty", "smaller-than-two-windows", "binary"],
)
def test_too_little_text_is_a_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    data = write_text(tmp_path / "t.txt", content)
    with pytest.raises(TaskError, match=message):
        load_task("bytegpt", data=data)


def test_empty_folder_and_missing_path_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no text files"):
        load_task("bytegpt", data=tmp_path)
    with pytest.raises(TaskError, match="no such file"):
        load_task("bytegpt", data=tmp_path / "nope")


def test_a_shard_smaller_than_a_window_is_a_clear_error(tmp_path: Path) -> None:
    data = write_text(tmp_path / "t.txt", "y" * 1000)
    task = load_task("bytegpt", data=data)
    with pytest.raises(TaskError, match="fewer peers"):
        task.batches(0, 100, 0)  # raised when asked, not at the first batch


def test_max_bytes_caps_what_is_read(tmp_path: Path) -> None:
    data = write_text(tmp_path / "t.txt", "z" * 10_000)
    task = load_task("bytegpt", {"max_bytes": 5000}, data=data)
    assert len(task.corpus.train) + len(task.corpus.val) == 5000


# --- config ----------------------------------------------------------------------------------


def test_unknown_config_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="unknown config key 'd_modle'"):
        load_task("bytegpt", {"d_modle": 64})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"n_heads": 3}, "multiple of"),
        ({"context": 0}, "at least 1"),
        ({"batch_size": "8"}, "must be of type int"),
        ({"batch_size": True}, "must be of type int"),
        ({"data": "web"}, "'stdlib' or 'user'"),
    ],
)
def test_bad_config_values_are_clear_errors(config: dict[str, object], message: str) -> None:
    with pytest.raises(TaskError, match=message):
        load_task("bytegpt", config)


def test_config_overrides_shape_the_model() -> None:
    small = load_task("bytegpt", {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 16})
    model = small.make_model(0)
    assert model.token_embedding.weight.shape == (256, 32)
    assert len(model.blocks) == 1
    assert next(small.batches(0, 1, 0)).shape == (8, 17)


# --- load_task specs -------------------------------------------------------------------------


def test_builtin_tasks_are_listed() -> None:
    assert set(BUILTIN_TASKS) == {"bytegpt", "hf"}


def test_module_function_spec() -> None:
    task = load_task("shoal.peer.tasks.bytegpt:make_task", {"n_layers": 1})
    assert isinstance(task, ByteGPTTask)
    assert task.config()["n_layers"] == 1


def test_the_names_from_before_the_move_give_the_same_objects() -> None:
    """Custom tasks and manifests written against `shoal.peer.task` and
    `shoal.peer.tasks.*` keep working: one module, one set of classes."""
    import shoal.peer.task as public
    import shoal.peer.tasks.bytegpt as old_bytegpt
    import shoal.peer.tasks.corpus as old_corpus
    import shoal.peer.training.task as moved
    from shoal.peer.training.tasks import bytegpt, corpus

    assert all(getattr(public, name) is getattr(moved, name) for name in moved.__all__)
    assert old_bytegpt is bytegpt and old_corpus is corpus
    assert old_bytegpt.ByteGPTTask is ByteGPTTask


def test_unknown_task_name_lists_the_builtin_tasks() -> None:
    with pytest.raises(
        TaskError,
        match=r"unknown task 'gpt5': built-in tasks are bytegpt, hf; or give module:function",
    ):
        load_task("gpt5")


def test_missing_module_is_a_clear_error() -> None:
    with pytest.raises(TaskError, match="no module named 'no_such_module_xyz'"):
        load_task("no_such_module_xyz.tasks:make_task")


def test_missing_factory_is_a_clear_error() -> None:
    with pytest.raises(TaskError, match="has no 'make_it'"):
        load_task("shoal.peer.tasks.bytegpt:make_it")


def test_missing_task_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="no such file"):
        load_task(f"{tmp_path}/nope.py:make_task")


def test_a_task_file_that_fails_to_import_is_a_clear_error(tmp_path: Path) -> None:
    broken = write_text(tmp_path / "broken.py", "import numpyy_missing_dep\n")
    with pytest.raises(TaskError, match=r"running .*broken\.py failed: ModuleNotFoundError"):
        load_task(f"{broken}:make_task")


def test_factory_errors_and_non_tasks_are_clear_errors(tmp_path: Path) -> None:
    source = (
        "def crashes(config):\n    raise ValueError('boom')\n"
        "def not_a_task(config):\n    return object()\n"
        "class Bad:\n    name = 'bad'\n"
        "    def config(self): return {'x': object()}\n"
        "    make_model = batches = loss = batch_tokens = eval_batches = None\n"
        "def unpackable(config):\n    return Bad()\n"
    )
    module = write_text(tmp_path / "factories.py", source)
    with pytest.raises(TaskError, match="failed to build: ValueError: boom"):
        load_task(f"{module}:crashes")
    with pytest.raises(TaskError, match="without name, config, make_model"):
        load_task(f"{module}:not_a_task")
    with pytest.raises(TaskError, match="not msgpack-able"):
        load_task(f"{module}:unpackable")
    with pytest.raises(TaskError, match="does not read --data"):
        load_task(f"{module}:crashes", data=module)


def test_bad_spec_is_a_clear_error() -> None:
    with pytest.raises(TaskError, match="bad task spec"):
        load_task("module:")


def test_importing_the_task_api_does_not_load_torch() -> None:
    code = "import sys, shoal.peer.training.task; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# --- the example custom task -----------------------------------------------------------------


def test_example_custom_task_loads_and_trains(tmp_path: Path) -> None:
    data = write_text(tmp_path / "notes.txt", "the quick brown fox jumps over the lazy dog. " * 200)
    task = load_task(f"{EXAMPLE}:make_task", data=data)
    assert isinstance(task, Task)
    assert task.name == "bytemlp"
    assert task.config()["data"] == "user"
    msgpack.packb(task.config())
    model = task.make_model(0)
    shard_batches = list(islice(task.batches(1, 2, seed=5), 2))
    before = mean_loss(task, model, shard_batches)
    train_steps(task, model, task.batches(1, 2, seed=0), steps=30)
    assert mean_loss(task, model, shard_batches) < before - 1.0
    assert task.batch_tokens(shard_batches[0]) == task.config()["batch_size"]
    assert all(
        torch.equal(a, b) for a, b in zip(task.eval_batches(2), task.eval_batches(2), strict=True)
    )


def test_example_custom_task_joiner_needs_data(tmp_path: Path) -> None:
    data = write_text(tmp_path / "notes.txt", "lorem ipsum dolor sit amet " * 100)
    config = load_task(f"{EXAMPLE}:make_task", data=data).config()
    with pytest.raises(TaskError, match="give --data"):
        load_task(f"{EXAMPLE}:make_task", config)


# --- shards of peers -------------------------------------------------------------------------


def test_shard_of_is_deterministic_in_range_and_spreads_peers() -> None:
    peers = [bytes([i]) * 38 for i in range(200)]
    shards = [shard_of(p, 4) for p in peers]
    assert shards == [shard_of(p, 4) for p in peers]
    assert all(0 <= s < 4 for s in shards)
    assert all(shards.count(s) > 20 for s in range(4))
    assert shard_of(peers[0], 1) == 0
    with pytest.raises(ValueError):
        shard_of(peers[0], 0)
