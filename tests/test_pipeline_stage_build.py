"""A stage built alone: bit for bit the stage of the whole pipeline, sized from the config."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shoal.peer.training.task_error import TaskError
from shoal.peer.training.tasks.bytegpt import PRESETS, make_task
from shoal.pipeline.stage_build import build_stage, builds_stages_alone, stage_size

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
