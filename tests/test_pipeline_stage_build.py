"""A stage built alone: bit for bit the stage of the whole pipeline, sized from the config."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shoal.dht.node import DHTNode
from shoal.peer import session
from shoal.peer.config import Config
from shoal.peer.experiment import Manifest, stages_fingerprint
from shoal.peer.pipelined.run import PipelineRun, StageMismatch
from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.device import DeviceInventory
from shoal.peer.training.task_error import TaskError
from shoal.peer.training.tasks.bytegpt import PRESETS, ByteGPTTask, make_task
from shoal.pipeline.bounds import probe_bounds
from shoal.pipeline.stage_build import (
    build_stage,
    builds_stages_alone,
    stage_fingerprint,
    stage_fingerprints,
    stage_size,
)
from shoal.transport.identity import Identity

TINY = {"d_model": 32, "n_layers": 4, "n_heads": 2, "context": 16, "batch_size": 2}

pytestmark = pytest.mark.timeout(60)


def same_parameters(a: nn.Module, b: nn.Module) -> bool:
    named_a, named_b = list(a.named_parameters()), list(b.named_parameters())
    return [n for n, _ in named_a] == [n for n, _ in named_b] and all(
        p.dtype == q.dtype and torch.equal(p, q)
        for (_, p), (_, q) in zip(named_a, named_b, strict=True)
    )


class OnlyWhole:
    """A task that builds its stages only all together (no make_stage)."""

    def __init__(self, task: Any) -> None:
        self.inner = task
        self.builds = 0

    def make_stages(self, seed: int, count: int) -> list[nn.Module]:
        self.builds += 1
        return self.inner.make_stages(seed, count)

    def eval_batches(self, count: int) -> list[torch.Tensor]:
        return self.inner.eval_batches(count)  # type: ignore[no-any-return]

    def stage_inputs(self, batch: torch.Tensor) -> torch.Tensor:
        return self.inner.stage_inputs(batch)  # type: ignore[no-any-return]


@pytest.mark.parametrize("rank", [0, 5])
@pytest.mark.parametrize("count", [1, 3, 4])
def test_a_stage_built_alone_is_bit_for_bit_the_pipelines_stage(rank: int, count: int) -> None:
    task = make_task({**TINY, "bottleneck": rank})
    whole = task.make_stages(11, count)
    for k in reversed(range(count)):  # (in another order, from another global RNG state)
        torch.manual_seed(100 + k)
        alone = build_stage(task, 11, count, k)
        assert same_parameters(alone, whole[k]), f"stage {k} of {count}"


def test_the_global_rng_is_left_alone_and_each_seed_is_its_own_model() -> None:
    task = make_task(TINY)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    one = task.make_stage(11, 4, 2)
    assert torch.equal(torch.rand(4), expected)
    assert not same_parameters(one, task.make_stage(12, 4, 2))


def test_a_bottleneck_pair_shares_its_basis_across_the_boundary() -> None:
    """Built apart, the outlet of stage k and the entry of stage k + 1 start as one
    orthonormal basis and its transpose."""
    task = make_task({**TINY, "bottleneck": 5})
    before, after = task.make_stage(4, 3, 0), task.make_stage(4, 3, 1)
    down, up = before.outlet.down.weight, after.entry.up.weight
    assert torch.equal(down, up.T)
    assert torch.allclose(down @ up, torch.eye(5), atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        {**TINY, "bottleneck": 7},
        {**TINY, "n_layers": 5, "context": 24, "d_model": 48, "n_heads": 4},
        {**TINY, "n_layers": 7, "bottleneck": 1},
    ],
)
def test_stage_size_counts_the_built_stages_parameters(config: dict[str, Any]) -> None:
    task = make_task(config)
    for count in range(1, 5):
        for k in range(count):
            built = sum(p.numel() for p in task.make_stage(0, count, k).parameters())
            assert task.stage_size(count, k) == built == stage_size(task, 0, count, k)


def test_a_task_with_only_make_stages_is_built_once_and_sliced() -> None:
    task = make_task(TINY)
    whole = OnlyWhole(task)
    assert builds_stages_alone(task) and not builds_stages_alone(whole)
    stage = build_stage(whole, 5, 3, 1)
    assert whole.builds == 1
    assert same_parameters(stage, task.make_stage(5, 3, 1))
    assert stage_size(whole, 5, 3, 1) == task.stage_size(3, 1)
    with pytest.raises(ValueError, match="stages are 0 to 2"):
        build_stage(whole, 5, 3, 3)


def test_the_base_preset_is_a_real_model_and_given_keys_override_it() -> None:
    """preset=base: 12 blocks at d_model 512, ~38 M parameters; the experiment's config
    holds the resulting keys (a joiner needs no preset), and the sizes add up without
    building anything."""
    task = make_task({"preset": "base", "batch_size": 4})
    config = task.config()
    assert "preset" not in config
    assert {k: config[k] for k in PRESETS["base"]} == PRESETS["base"]
    assert config["batch_size"] == 4
    total = sum(task.stage_size(4, k) for k in range(4))
    assert 37_000_000 < total < 40_000_000
    assert make_task(config).config() == config
    assert make_task({"preset": "base", "n_layers": 4}).config()["n_layers"] == 4
    with pytest.raises(TaskError, match="preset"):
        make_task({"preset": "huge"})


# --- who builds which stage ------------------------------------------------------------------


@dataclass
class Builds:
    """The stages bytegpt built, counted through the task: for real (k, in order) and on
    the meta device (shapes only, nothing allocated), and how many real ones lived at once."""

    real: list[int] = field(default_factory=list)
    meta: list[int] = field(default_factory=list)
    live: int = 0
    most_live: int = 0

    def built(self, module: nn.Module, k: int) -> None:
        if next(module.parameters()).is_meta:
            self.meta.append(k)
            return
        self.real.append(k)
        self.live += 1
        self.most_live = max(self.most_live, self.live)
        weakref.finalize(module, self.freed)

    def freed(self) -> None:
        self.live -= 1


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> Builds:
    counted = Builds()
    make_stage = ByteGPTTask.make_stage

    def counting(self: ByteGPTTask, seed: int, count: int, k: int) -> nn.Module:
        module = make_stage(self, seed, count, k)
        counted.built(module, k)
        return module

    monkeypatch.setattr(ByteGPTTask, "make_stage", counting)
    return counted


class NotOnMeta(nn.Module):
    """A stage whose layers do not run on the meta device (as some custom layers)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            raise NotImplementedError("no meta kernel")
        return self.inner(x)  # type: ignore[no-any-return]


class OneStageNotOnMeta:
    def __init__(self, task: Any, k: int) -> None:
        self.inner, self.k = task, k

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def make_stage(self, seed: int, count: int, k: int) -> nn.Module:
        module = self.inner.make_stage(seed, count, k)
        return NotOnMeta(module) if k == self.k else module


def test_the_bounds_probe_builds_each_stage_alone_on_the_meta_device(builds: Builds) -> None:
    """Stage by stage, each freed before the next; a stage that does not run there is
    probed on the CPU, it alone. The sizes are those of the whole model's probe."""
    task = make_task(TINY)
    whole = probe_bounds(OnlyWhole(task), 5, 4, 8)
    builds.real.clear(), builds.meta.clear()
    assert probe_bounds(task, 5, 4, 8) == whole
    assert builds.meta == [0, 1, 2, 3] and builds.real == []
    builds.meta.clear()
    # (The CPU's attention kernel saves other tensors for its backward than the meta
    # device's: the activations probed differ, the sizes on the wire do not.)
    on_cpu = probe_bounds(OneStageNotOnMeta(task, 2), 5, 4, 8)
    assert [replace(b, activation_bytes=0) for b in on_cpu] == [
        replace(b, activation_bytes=0) for b in whole
    ]
    assert on_cpu[2].activation_bytes > 0
    assert builds.meta == [0, 1, 2, 3] and builds.real == [2]


def pipeline_manifest(identity: Identity, task: Any, stages: list[str], seed: int = 9) -> Manifest:
    return Manifest.create(
        identity, name="piped", task="bytegpt", task_config=task.config(),
        strategy="pipeline", strategy_options={"stages": len(stages), "global_batch": 2,
        "codec": "none", "lag": 0, "rebalance_s": 0}, hyperparameters={}, seed=seed,
        initial_fingerprint=stages_fingerprint(stages), stage_fingerprints=stages,
    )  # fmt: skip


async def test_the_host_writing_a_4_stage_manifest_never_holds_two_stages(
    builds: Builds, tmp_path: Path
) -> None:
    """It builds each stage once, hashes it and frees it before the next; the manifest
    holds their fingerprints, from which its initial fingerprint derives."""
    config = Config(data_dir=tmp_path, task_option=tuple(TINY.items()), pipeline_stages=4)
    manifest, task, model = await session._host_manifest(config, Identity.generate(), "piped")
    assert model is None
    assert builds.real == [0, 1, 2, 3] and builds.most_live == 1
    expected = [stage_fingerprint(task.make_stage(manifest.seed, 4, k)) for k in range(4)]
    assert list(manifest.stage_fingerprints) == expected
    assert manifest.initial_fingerprint == stages_fingerprint(expected)
    assert manifest.format == 3


async def test_a_stage_peer_builds_only_its_own_stage_for_real(
    builds: Builds, make_host: Callable[..., Any]
) -> None:
    """Serving stage 2 of 4 (and training): the bounds probe builds every stage on the
    meta device, one at a time; the only stage built for real is its own."""
    task = make_task(TINY)
    identity = Identity.generate()
    manifest = pipeline_manifest(identity, task, stage_fingerprints(task, 9, 4))
    builds.real.clear()
    dht = await DHTNode.create(await make_host(), bootstrap=[], hop_timeout=1.0)
    run = PipelineRun(dht, identity, manifest, task, check_hyperparameters({}), role="auto",
                      stage=2, device=torch.device("cpu"))  # fmt: skip
    try:
        await run.start()
        assert run.stage_peer is not None and run.loop is not None
        assert builds.real == [2]
        assert builds.meta == [0, 1, 2, 3]
        assert run.bounds is not None and run.bounds[2].input_elements == TINY["d_model"] * 16
    finally:
        await run.aclose()
        await dht.aclose()


async def test_a_stage_built_unlike_the_hosts_is_refused_in_one_line(
    make_host: Callable[..., Any],
) -> None:
    """(Here the host's stage 1 of another seed: as a torch that initializes differently.)
    With no peer of the stage to download its state from, the peer does not start it."""
    task = make_task(TINY)
    identity = Identity.generate()
    manifest = pipeline_manifest(identity, task, stage_fingerprints(task, 8, 3), seed=9)
    dht = await DHTNode.create(await make_host(), bootstrap=[], hop_timeout=1.0)
    run = PipelineRun(dht, identity, manifest, task, check_hyperparameters({}), role="stage",
                      stage=1, device=torch.device("cpu"))  # fmt: skip
    try:
        with pytest.raises(StageMismatch, match="builds stage 1 unlike") as refused:
            await run.start()
        assert "\n" not in str(refused.value)
        assert run.stage_peer is None
    finally:
        await run.aclose()
        await dht.aclose()


async def test_a_pipeline_manifest_of_an_older_shoal_is_refused_in_one_line(
    make_host: Callable[..., Any], tmp_path: Path
) -> None:
    """Format 1 (no stage fingerprints): its stages were initialized as one model."""
    task = make_task(TINY)
    identity = Identity.generate()
    old = Manifest.create(
        identity, name="old", task="bytegpt", task_config=task.config(), strategy="pipeline",
        strategy_options={"stages": 2}, hyperparameters={}, seed=1,
        initial_fingerprint="ab" * 32,
    )  # fmt: skip
    assert old.format == 1
    dht = await DHTNode.create(await make_host(), bootstrap=[], hop_timeout=1.0)
    try:
        with pytest.raises(session.SessionError, match="created by an older shoal"):
            await session._pipeline_session(
                Config(data_dir=tmp_path), identity, dht, old, task, torch.device("cpu"),
                DeviceInventory(),
            )  # fmt: skip
    finally:
        await dht.aclose()
