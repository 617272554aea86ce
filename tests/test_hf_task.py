"""The built-in `hf` task: a transformers causal LM from a config, its tokenizer and data.

A tiny 2-layer Llama config throughout (hidden 32, vocabulary 320): built alike on
every peer from the manifest's seed, a tokenizer trained at hosting that a joiner
rebuilds from the manifest alone, local datasets with a named text field, the data
digest and the transformers version checked, stages that compose to the model.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install shoal[hf])")
pytest.importorskip("tokenizers", reason="the hf extra is not installed (pip install shoal[hf])")

from shoal.peer.training.task import TaskError, load_task
from shoal.peer.training.tasks.hf import HFTask

from .hf_texts import WORDS, write_texts

pytestmark = pytest.mark.timeout(60)

TINY_LLAMA: dict[str, Any] = {
    "family": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 320,
    "context": 32,
    "batch_size": 4,
}


def through_manifest(task: HFTask) -> dict[str, Any]:
    """The task's config as a joiner receives it: msgpacked into the manifest and back."""
    packed = msgpack.packb(task.config())
    return msgpack.unpackb(packed, raw=False)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_texts(tmp_path_factory.mktemp("texts"))


@pytest.fixture(scope="module")
def host(texts: Path) -> HFTask:
    task = load_task("hf", dict(TINY_LLAMA), data=texts)
    assert isinstance(task, HFTask)
    return task


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = zip(a.state_dict().items(), b.state_dict().items(), strict=True)
    return all(ka == kb and torch.equal(va, vb) for (ka, va), (kb, vb) in pairs)


def test_two_builds_from_one_seed_are_bit_identical_and_another_seed_differs(
    host: HFTask, texts: Path
) -> None:
    joiner = load_task("hf", through_manifest(host), data=texts)
    assert same_parameters(host.make_model(7), joiner.make_model(7))
    assert not same_parameters(host.make_model(7), host.make_model(8))
    model = host.make_model(7)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32


def test_the_manifest_pins_the_resolved_config_and_the_transformers_version(
    host: HFTask,
) -> None:
    import transformers

    config = host.config()
    assert config["transformers_version"] == transformers.__version__
    assert config["model_config"]["model_type"] == "llama"
    assert config["model_config"]["vocab_size"] == 320
    assert not any(key in config for key in ("family", "hidden_size", "tokenizer"))
    assert len(msgpack.packb(config)) < 8192  # with the tokenizer: well inside a manifest


def test_a_joiner_rebuilds_the_tokenizer_trained_at_hosting_with_identical_ids(
    host: HFTask, texts: Path, tmp_path: Path
) -> None:
    assert host.config()["tokenizer_bpe"] and host.config()["tokenizer_digest"]
    # The joiner has none of the host's text: the tokenizer comes from the manifest alone.
    other = write_texts(tmp_path / "other", seed=1)
    joiner = load_task("hf", through_manifest(host), data=other)
    sample = (texts / "part0.txt").read_text()[:2000] + " unseen wörds ✓ 123"
    host_ids = host.tokenizer.encode(sample).ids
    assert host_ids == joiner.tokenizer.encode(sample).ids
    assert len(host_ids) < len(sample.encode()) / 2  # it learned merges, not just bytes
    assert host.tokenizer.decode(host_ids) == sample


def test_training_the_tokenizer_twice_on_the_same_text_gives_the_same_one(
    host: HFTask, texts: Path
) -> None:
    again = load_task("hf", dict(TINY_LLAMA), data=texts)
    assert again.config()["tokenizer_bpe"] == host.config()["tokenizer_bpe"]


def test_a_tokenizer_file_is_pinned_by_its_digest_and_a_different_copy_is_refused(
    host: HFTask, texts: Path, tmp_path: Path
) -> None:
    path = tmp_path / "tokenizer.json"
    host.tokenizer.save(str(path))
    task = load_task("hf", {**TINY_LLAMA, "tokenizer": str(path)}, data=texts)
    config = through_manifest(task)
    assert config["tokenizer_file"] == str(path) and config["tokenizer_bpe"] == ""
    sample = "seven lazy peers"
    assert task.tokenizer.encode(sample).ids == host.tokenizer.encode(sample).ids
    assert load_task("hf", config, data=texts).tokenizer.encode(sample).ids == (
        host.tokenizer.encode(sample).ids
    )
    path.write_text(path.read_text().replace('"<|endoftext|>"', '"<|end|>"'))
    with pytest.raises(TaskError, match=r"tokenizer .* differs from the experiment's"):
        load_task("hf", config, data=texts)


def test_a_joiner_with_another_transformers_major_version_refuses_in_one_line(
    host: HFTask, texts: Path
) -> None:
    config = through_manifest(host)
    config["transformers_version"] = "3.5.1"
    with pytest.raises(TaskError, match=r"built with transformers 3\.5\.1") as refused:
        load_task("hf", config, data=texts)
    assert "\n" not in str(refused.value)


def test_a_manifest_tokenizer_that_does_not_match_its_digest_is_refused(
    host: HFTask, texts: Path
) -> None:
    config = through_manifest(host)
    config["tokenizer_digest"] = "0" * 64
    with pytest.raises(TaskError, match="does not match its digest"):
        load_task("hf", config, data=texts)


def test_a_config_inline_or_in_a_file_builds_the_same_model_as_its_family(
    host: HFTask, texts: Path, tmp_path: Path
) -> None:
    model_config = host.config()["model_config"]
    sizes = {k: TINY_LLAMA[k] for k in ("context", "batch_size")}
    inline = load_task("hf", {"config": json.dumps(model_config), **sizes}, data=texts)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model_config))
    from_file = load_task("hf", {"config_file": str(path), **sizes}, data=texts)
    for task in (inline, from_file):
        assert same_parameters(task.make_model(3), host.make_model(3))


def test_a_local_jsonl_dataset_trains_on_its_named_text_field(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="the hf extra is not installed")
    rng = random.Random(2)
    rows = [{"id": i, "body": " ".join(rng.choice(WORDS) for _ in range(30))} for i in range(300)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(TaskError, match=r"no field 'text'.*text_field=NAME"):
        load_task("hf", dict(TINY_LLAMA), data=path)
    task = load_task("hf", {**TINY_LLAMA, "text_field": "body"}, data=path)
    assert task.config()["data_format"] == "auto"
    assert len(task.corpus.train) > 1000
    first = task.tokenizer.decode(task.corpus.train[:40].tolist())
    assert first.startswith(rows[0]["body"][:20])


def test_a_parquet_dataset_reads_as_the_same_tokens_as_its_jsonl(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the hf extra is not installed")
    rng = random.Random(3)
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(30))} for _ in range(200)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    tasks = [load_task("hf", dict(TINY_LLAMA), data=tmp_path / name)
             for name in ("a.jsonl", "a.parquet")]  # fmt: skip
    assert torch.equal(tasks[0].corpus.train, tasks[1].corpus.train)
    assert torch.equal(tasks[0].corpus.val, tasks[1].corpus.val)


def test_pinned_data_is_checked_by_its_digest(host: HFTask, texts: Path, tmp_path: Path) -> None:
    assert host.private_data()  # each peer's own text, unless pinned
    pinned = load_task("hf", {**TINY_LLAMA, "data_digest": host.corpus.digest}, data=texts)
    assert not pinned.private_data()
    other = write_texts(tmp_path / "other", seed=5)
    with pytest.raises(TaskError, match=r"differs from .* give --data the host's data"):
        load_task("hf", through_manifest(pinned), data=other)


def test_shards_are_disjoint_and_batches_are_deterministic(host: HFTask) -> None:
    a, b = host.corpus.shard(0, 2), host.corpus.shard(1, 2)
    assert len(a) + len(b) == len(host.corpus.train)
    first, again = host.batches(1, 2, seed=11), host.batches(1, 2, seed=11)
    for _ in range(3):
        assert torch.equal(next(first), next(again))
    assert next(host.batches(1, 2, seed=12)).shape == (4, 33)
    assert all(
        torch.equal(x, y) for x, y in zip(host.eval_batches(2), host.eval_batches(2), strict=True)
    )


def test_a_few_steps_of_adamw_lower_the_loss(host: HFTask) -> None:
    model = host.make_model(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = host.batches(0, 1, seed=1)
    losses = []
    for _ in range(12):
        loss = host.loss(model, next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


def test_pipeline_stages_compose_to_the_whole_model(host: HFTask) -> None:
    batch = next(host.batches(0, 1, seed=2))
    stages, whole = host.make_stages(4, 2), host.make_model(4)
    with torch.no_grad():
        piped = stages[1](stages[0](host.stage_inputs(batch)))
        direct = whole(input_ids=host.stage_inputs(batch)).logits
    assert torch.equal(piped, direct)
    for k in range(2):
        assert host.stage_size(2, k) == sum(p.numel() for p in stages[k].parameters())
        assert same_parameters(host.make_stage(4, 2, k), stages[k])


def test_bad_options_are_refused_in_one_line(texts: Path) -> None:
    cases = [
        ({"family": "llama", "hidden_sise": 32}, "unknown config key 'hidden_sise'"),
        ({"family": "gpt9"}, "family must be one of llama"),
        ({"config": "{not json"}, "config is not JSON"),
        ({"family": "llama", "config": "{}"}, "not family and config"),
        ({**TINY_LLAMA, "context": 128, "max_position_embeddings": 64}, "less than the context"),
    ]
    for options, message in cases:
        with pytest.raises(TaskError, match=message) as refused:
            load_task("hf", options, data=texts)
        assert "\n" not in str(refused.value)


def test_shoal_without_transformers_imports_and_says_how_to_get_the_hf_task() -> None:
    # transformers is blocked in a fresh interpreter: the task registry still imports,
    # and asking for the hf task says what to install, in one line.
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from shoal.peer.training.task import load_task, TaskError\n"
        "assert 'transformers' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
        "try:\n    load_task('hf', {})\nexcept TaskError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "task hf needs transformers, which is not installed: pip install 'shoal[hf]'"
    )


def test_the_example_llama_experiment_builds_from_its_toml_and_json(
    texts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shoal.peer.cli import parse_command_line

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the example's paths are relative to where shoal runs
    argv = ["run", "--config", "examples/hf_llama.toml", "--data", str(texts)]
    command, config = parse_command_line(argv, {})
    assert command == "run" and config.task == "hf"
    task = load_task(config.task, dict(config.task_option), data=config.data)
    model = task.make_model(0)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 3_950_848  # the example says 4.0 M
    assert model.config.num_key_value_heads == 4 and task.config()["context"] == 256
