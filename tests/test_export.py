"""Checkpoints others can load: `shoal export` writes the swarm's global parameters of a
real checkpoint (a short in-process run of a hosted experiment) as `save_pretrained`
output or safetensors, and `shoal run --init-from` hosts a new experiment from them.

Logits and losses are compared bit for bit (`torch.equal`): the exported weights are
the very float32 tensors of the strategy's global copy, and the model that loads them
runs the same code on the same CPU, so any difference would be a wrong weight, not
rounding.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install shoal[hf])")
pytest.importorskip("safetensors", reason="the hf extra is not installed (pip install shoal[hf])")

import safetensors.torch
import tokenizers
import transformers

from shoal.averaging.fingerprint import state_fingerprint
from shoal.dht.node import DHTNode
from shoal.peer.cli import main, parse_command_line
from shoal.peer.config import ConfigError
from shoal.peer.daemon import load_identity
from shoal.peer.export import (
    EXPERIMENT_FILE,
    WEIGHTS_FILE,
    ExportError,
    export_checkpoint,
    load_initial_weights,
)
from shoal.peer.session import Session, SessionError, open_session
from shoal.peer.training.task import load_task
from shoal.transport.host import Host, HostConfig

from .waiting import eventually

pytestmark = pytest.mark.timeout(90)

TINY_LLAMA = (
    "family=llama,hidden_size=32,num_hidden_layers=2,num_attention_heads=2,"
    "num_key_value_heads=2,intermediate_size=64,vocab_size=320,context=32,batch_size=4"
)
TINY_BYTEGPT = "d_model=32,n_layers=1,n_heads=2,context=32,batch_size=4"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "seven", "peers"]


def write_texts(folder: Path) -> Path:
    rng = random.Random(0)
    folder.mkdir()
    for i in range(3):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(120))
        (folder / f"part{i}.txt").write_text(".\n".join(lines))
    return folder


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    return write_texts(tmp_path / "texts")


def run_args(data_dir: Path, texts: Path, task: str, options: str, *extra: str) -> list[str]:
    return [
        "run", "--data-dir", str(data_dir), "--host-experiment", "ft", "--task", task,
        "--data", str(texts), "--task-option", options, "--inner-steps", "2", *extra,
    ]  # fmt: skip


@asynccontextmanager
async def hosted(args: list[str], bootstrap: list[str] | None = None) -> AsyncIterator[Session]:
    """An experiment hosted (or joined) in this process, closed afterwards; without
    `bootstrap` in a DHT of its own."""
    _, config = parse_command_line(args, {})
    # The data directory's identity, as the daemon's: a host restarted is the same peer.
    host = Host(load_identity(config), HostConfig(listen=("/ip4/127.0.0.1/tcp/0",)))
    await host.start()
    try:
        dht = await DHTNode.create(host, bootstrap=bootstrap or [])
        try:
            session = await open_session(config, host.identity, dht)
            try:
                yield session
            finally:
                await session.strategy.aclose()
                session.trainer.close()
        finally:
            await dht.aclose()
    finally:
        await host.aclose()


async def train_past_a_commit(session: Session) -> None:
    """Train until the peer, alone, committed an outer step; then a checkpoint whose
    inner parameters are a step past the globals."""
    stop = asyncio.Event()
    running = asyncio.create_task(session.trainer.run(stop))
    try:
        await eventually(
            lambda: session.strategy.outer_steps >= 1 and session.trainer.stats.step >= 3,
            "an outer step and a step after it",
            timeout=40,
        )
    finally:
        stop.set()
        await running
    # Mid-round, as a checkpoint of a running daemon usually is: the inner parameters
    # moved on from the globals (one inner step more), which the export must not take.
    trainer, batch = session.trainer, first_batch(session)
    trainer.inner.step(lambda: session.task.loss(trainer.model, batch), trainer.stats.step)
    await trainer.save_checkpoint()
    inner = [p.detach() for p in trainer.model.parameters()]
    assert not any(torch.equal(p, g) for p, g in zip(inner, global_params(session), strict=True))


def global_params(session: Session) -> list[torch.Tensor]:
    """The strategy's global copy, in the model's parameter order (read from the
    strategy's live objects, not its checkpoint form)."""
    strategy: Any = session.strategy
    if hasattr(strategy, "fragments"):  # Streaming DiLoCo: each fragment's own params
        of = {id(p): g for f in strategy.fragments for p, g in zip(f.params, f.globals,
                                                                   strict=True)}  # fmt: skip
        return [of[id(p)].detach().clone() for p in session.trainer.model.parameters()]
    copies = strategy.outer if hasattr(strategy, "outer") else strategy.globals  # NoLoCo's
    return [g.detach().clone() for g in copies]


def first_batch(session: Session) -> torch.Tensor:
    """The batch the hosted (unverified) experiment's first inner step trains on."""
    trainer = session.trainer
    return next(session.task.batches(trainer.shard, trainer.hyper["num_shards"], trainer.seed))


async def test_an_hf_export_loads_with_from_pretrained_and_init_from_it_starts_at_its_loss(
    texts: Path, tmp_path: Path
) -> None:
    """The export of a real checkpoint is the swarm's global parameters (not the
    initial ones, not the inner ones): from_pretrained gives their logits bit for bit,
    tokenizer.json tokenizes as the experiment does; an experiment hosted with
    --init-from it (its model config and tokenizer taken from there) pins their
    fingerprint and its first loss is the exported model's."""
    args = run_args(tmp_path / "a", texts, "hf", TINY_LLAMA, *QUICK)
    async with hosted(args) as session:
        initial = [p.detach().clone() for p in session.trainer.model.parameters()]
        await train_past_a_commit(session)
        swarm = global_params(session)
        task, seed = session.task, session.manifest.seed
    out = tmp_path / "export"
    assert main(["export", "--data-dir", str(tmp_path / "a"), "--format", "hf", str(out)]) == 0
    assert {"config.json", WEIGHTS_FILE, "tokenizer.json", EXPERIMENT_FILE} <= {
        p.name for p in out.iterdir()
    }

    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = task.make_model(seed).eval()
    with torch.no_grad():
        for p, g in zip(reference.parameters(), swarm, strict=True):
            p.copy_(g)
    assert not all(torch.equal(p, q) for p, q in zip(swarm, initial, strict=True))
    batch = task.eval_batches(1)[0][:, :-1].long()
    with torch.no_grad():
        assert torch.equal(exported(input_ids=batch).logits, reference(input_ids=batch).logits)
    text = "seven peers train one model over a lazy dog"
    saved_tokenizer = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert saved_tokenizer.encode(text).ids == task.tokenizer.encode(text).ids

    fingerprint = state_fingerprint(swarm, {})
    about = json.loads((out / EXPERIMENT_FILE).read_text())
    assert about["fingerprint"] == fingerprint and about["task"] == "hf"
    # The model config and the tokenizer come from the export (config.json, tokenizer.json).
    args = run_args(tmp_path / "b", texts, "hf", "context=32,batch_size=4", "--init-from", str(out))
    async with hosted(args) as tuned:
        assert tuned.manifest.initial_fingerprint == fingerprint
        assert tuned.task.tokenizer.encode(text).ids == task.tokenizer.encode(text).ids
        batch = first_batch(tuned)
        with torch.no_grad():
            expected = tuned.task.loss(exported, batch)
        model = tuned.trainer.model
        first = tuned.trainer.inner.step(lambda: tuned.task.loss(model, batch), 0)
    assert first == expected.item()


# Alone, a DiLoCo round commits after the matchmaking wait for others: kept short.
QUICK = ["--strategy-option", "matchmaking_time=0.5"]
STREAMING = ["--strategy", "streaming", *QUICK, "--strategy-option", "fragments=2,overlap_steps=1"]


@pytest.mark.parametrize(
    "strategy",
    [QUICK, STREAMING, ["--strategy", "noloco"], ["--strategy", "moshpit", *QUICK]],
    ids=["diloco", "streaming", "noloco", "moshpit"],
)
async def test_a_safetensors_export_of_any_task_holds_the_global_parameters(
    texts: Path, tmp_path: Path, strategy: list[str]
) -> None:
    """bytegpt, --format safetensors (the default): model.safetensors holds the global
    parameters by name, whichever strategy keeps them; --format hf refuses a task that
    is not hf, in one line."""
    data_dir = tmp_path / "a"
    args = run_args(data_dir, texts, "bytegpt", TINY_BYTEGPT, *strategy)
    async with hosted(args) as session:
        await train_past_a_commit(session)
        swarm = global_params(session)
        names = [n for n, _ in session.trainer.model.named_parameters()]
    out = tmp_path / "export"
    saved = export_checkpoint(data_dir, out, data=texts)
    assert saved.manifest.task == "bytegpt"
    weights = safetensors.torch.load_file(str(out / WEIGHTS_FILE))
    for name, g in zip(names, swarm, strict=True):
        assert torch.equal(weights[name], g), name
    with pytest.raises(ExportError, match="use --format safetensors"):
        export_checkpoint(data_dir, tmp_path / "hf", format="hf", data=texts)

    args = run_args(tmp_path / "b", texts, "bytegpt", TINY_BYTEGPT, "--init-from", str(out))
    async with hosted(args) as tuned:
        assert tuned.manifest.initial_fingerprint == state_fingerprint(swarm, {})


def test_init_from_weights_of_another_model_is_refused_in_one_line(
    texts: Path, tmp_path: Path
) -> None:
    task = load_task("bytegpt", {"d_model": 32, "n_layers": 1, "n_heads": 2}, data=texts)
    model = task.make_model(1)
    safetensors.torch.save_model(model, str(tmp_path / WEIGHTS_FILE))
    bigger = load_task("bytegpt", {"d_model": 64, "n_layers": 1, "n_heads": 2}, data=texts)
    with pytest.raises(ExportError, match="the task's model wants") as refused:
        load_initial_weights(bigger.make_model(1), tmp_path)
    assert "\n" not in str(refused.value)
    deeper = load_task("bytegpt", {"d_model": 32, "n_layers": 2, "n_heads": 2}, data=texts)
    with pytest.raises(ExportError, match="lacks"):
        load_initial_weights(deeper.make_model(1), tmp_path)
    same = task.make_model(2)
    load_initial_weights(same, tmp_path)
    pairs = zip(same.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


async def test_hosting_from_weights_that_do_not_fit_is_a_one_line_session_error(
    texts: Path, tmp_path: Path
) -> None:
    task = load_task("bytegpt", {"d_model": 64, "n_layers": 1, "n_heads": 2}, data=texts)
    safetensors.torch.save_model(task.make_model(1), str(tmp_path / WEIGHTS_FILE))
    args = run_args(tmp_path / "a", texts, "bytegpt", TINY_BYTEGPT, "--init-from", str(tmp_path))
    with pytest.raises(SessionError, match=r"^--init-from: .*wants"):
        async with hosted(args):
            pass


async def test_a_restarted_host_keeps_its_init_from_weights_and_refuses_others(
    texts: Path, tmp_path: Path
) -> None:
    """Hosting the saved experiment again with the same --init-from starts it alike;
    with other weights it is refused in one line (they would be another experiment)."""
    sizes = {k: int(v) for k, v in (pair.split("=") for pair in TINY_BYTEGPT.split(","))}
    task = load_task("bytegpt", sizes, data=texts)
    for seed, folder in ((1, tmp_path / "w1"), (2, tmp_path / "w2")):
        folder.mkdir()
        safetensors.torch.save_model(task.make_model(seed), str(folder / WEIGHTS_FILE))
    args = run_args(tmp_path / "a", texts, "bytegpt", TINY_BYTEGPT, "--init-from")
    async with hosted([*args, str(tmp_path / "w1")]) as first:
        manifest = first.manifest
    async with hosted([*args, str(tmp_path / "w1")]) as again:
        assert again.manifest == manifest
    with pytest.raises(SessionError, match=r"^--init-from: experiment 'ft' .* other weights"):
        async with hosted([*args, str(tmp_path / "w2")]):
            pass


def test_init_from_a_folder_without_weights_and_export_without_a_checkpoint_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"holds no model\.safetensors"):
        parse_command_line(["run", "--init-from", str(tmp_path)], {})
    assert main(["export", "--data-dir", str(tmp_path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shoal: error: no checkpoint of any experiment") and err.count("\n") == 1


def test_the_export_command_line_takes_out_format_and_experiment() -> None:
    command, _ = parse_command_line(["export", "--format", "hf", "OUT", "--experiment", "x"], {})
    assert command == "export"
    with pytest.raises(ConfigError, match="invalid choice"):
        parse_command_line(["export", "--format", "pt", "OUT"], {})


async def test_a_joiner_of_an_experiment_hosted_from_weights_starts_from_the_same_weights(
    texts: Path, tmp_path: Path
) -> None:
    """Joiners start from the host's loaded weights, pinned by the manifest's initial
    fingerprint: with --init-from the same folder they build them (and pass the
    fingerprint check); without it their seed-built model differs, and they take the
    state the host serves (before its first round too), as after any round."""
    sizes = {k: int(v) for k, v in (pair.split("=") for pair in TINY_BYTEGPT.split(","))}
    task = load_task("bytegpt", sizes, data=texts)
    weights = task.make_model(7)
    safetensors.torch.save_model(weights, str(tmp_path / WEIGHTS_FILE))
    wanted = [p.detach() for p in weights.parameters()]
    args = run_args(tmp_path / "host", texts, "bytegpt", TINY_BYTEGPT, "--init-from", str(tmp_path))
    async with hosted(args) as host:
        assert host.manifest.initial_fingerprint == state_fingerprint(wanted, {})
        dht = host.strategy.averager.dht  # type: ignore[attr-defined]
        address = str(dht.host.addresses()[0])
        for extra in (["--init-from", str(tmp_path)], []):
            join = ["run", "--data-dir", str(tmp_path / f"joiner{len(extra)}"), "--join",
                    f"ft@{host.manifest.host}", "--data", str(texts), *extra]  # fmt: skip
            async with hosted(join, bootstrap=[address]) as joiner:
                assert joiner.manifest == host.manifest and not joiner.hosting
                params = [p.detach() for p in joiner.trainer.model.parameters()]
                assert all(torch.equal(p, w) for p, w in zip(params, wanted, strict=True))
                assert joiner.loaded_from_swarm or extra  # (the host serves its state)


async def test_a_joiner_refuses_a_round_zero_state_that_is_not_the_initial_model(
    texts: Path, tmp_path: Path
) -> None:
    """The lying peer: before the first round, the state served (here by the host
    itself, changed after it signed the manifest) is not the model whose fingerprint
    the manifest pins; a joiner refuses it in one line, with --init-from or without."""
    args = run_args(tmp_path / "host", texts, "bytegpt", TINY_BYTEGPT)
    async with hosted(args) as host:
        strategy: Any = host.strategy
        with torch.no_grad():
            for g in strategy.globals:
                g.add_(0.01)
        await strategy.averager.publish_state()  # (served as round 0's state from now on)
        address = str(strategy.averager.dht.host.addresses()[0])
        join = ["run", "--data-dir", str(tmp_path / "joiner"), "--join",
                f"ft@{host.manifest.host}", "--data", str(texts)]  # fmt: skip
        with pytest.raises(SessionError, match="not the experiment's initial model") as refused:
            async with hosted(join, bootstrap=[address]):
                pass
        assert "\n" not in str(refused.value)


async def test_a_joiner_of_a_pipelined_experiment_refuses_init_from_in_one_line(
    texts: Path, tmp_path: Path
) -> None:
    """A pipeline's stages start from the host's seed (or the swarm's state): weights
    given to a joiner would be ignored, so they are refused instead."""
    safetensors.torch.save_model(
        load_task("bytegpt", {"d_model": 32, "n_layers": 2, "n_heads": 2}).make_model(1),
        str(tmp_path / WEIGHTS_FILE),
    )
    args = run_args(tmp_path / "host", texts, "bytegpt", "d_model=32,n_layers=2,n_heads=2",
                    "--pipeline-stages", "2", "--role", "stage")  # fmt: skip
    async with hosted(args) as host:
        address = str(host.pipeline.dht.host.addresses()[0])  # type: ignore[union-attr]
        join = ["run", "--data-dir", str(tmp_path / "joiner"), "--join",
                f"ft@{host.manifest.host}", "--data", str(texts),
                "--init-from", str(tmp_path)]  # fmt: skip
        with pytest.raises(SessionError, match=r"^--init-from: .* is pipelined") as refused:
            async with hosted(join, bootstrap=[address]):
                pass
        assert "\n" not in str(refused.value)
