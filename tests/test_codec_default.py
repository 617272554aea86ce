"""Which codec a new DiLoCo experiment gets when its flags name none: sparse for an
unverified experiment of a model of at least a million parameters, dense otherwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shoal.averaging.diloco_options import SPARSE_INNER_STEPS
from shoal.peer.cli import parse_command_line
from shoal.peer.codec_default import SPARSE_MIN_PARAMETERS, model_parameters, with_default_codec
from shoal.peer.session import _new_settings
from shoal.peer.training.task import load_task

SMALL = {"d_model": 128}  # the daemon's model: 445,952 parameters
LARGE = {"d_model": 256}  # 1,678,336


def hosted(task_config: dict[str, Any], *flags: str) -> dict[str, Any]:
    """The strategy options a new experiment's manifest records for these flags."""
    _, config = parse_command_line(["run", *flags], {})
    _, options, _ = _new_settings(config, load_task("bytegpt", task_config), "x")
    return options


def test_the_parameters_are_counted_on_the_meta_device_as_built() -> None:
    task = load_task("bytegpt", LARGE)
    assert model_parameters(task) == sum(p.numel() for p in task.make_model(0).parameters())
    assert model_parameters(load_task("bytegpt", SMALL)) < SPARSE_MIN_PARAMETERS
    assert model_parameters(load_task("bytegpt", LARGE)) >= SPARSE_MIN_PARAMETERS


def test_an_unverified_experiment_of_a_large_model_goes_sparse_with_the_sparse_defaults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="shoal.session")
    options = hosted(LARGE, "--verify", "off")
    assert options["codec"] == "topk" and options["verify"] is False
    assert options["inner_steps"] == SPARSE_INNER_STEPS
    assert options["overlap_steps"] == SPARSE_INNER_STEPS - 1
    assert (options["codec_feedback_decay"], options["codec_mean"]) == (0.9, "senders")
    assert any("codec=none keeps them dense" in r.getMessage() for r in caplog.records)


def test_a_small_model_a_verified_experiment_or_a_named_codec_stays_as_it_was() -> None:
    small = hosted(SMALL, "--verify", "off")
    assert small["codec"] == "none" and small["overlap_steps"] == 49  # dense, overlapped
    default = hosted(LARGE)  # --verify auto verifies a dense DiLoCo experiment
    assert default["verify"] is True and default["codec"] == "none"
    assert "overlap_steps" not in default
    assert hosted(LARGE, "--verify", "on")["codec"] == "none"
    named = hosted(LARGE, "--verify", "off", "--strategy-option", "codec=int8")
    assert named["codec"] == "int8" and named["inner_steps"] == 50
    assert hosted(LARGE, "--verify", "off", "--strategy-option", "codec=none")["codec"] == "none"
    streaming = hosted(LARGE, "--verify", "off", "--strategy", "streaming")
    assert streaming["codec"] == "int8"  # Streaming DiLoCo's own default


def test_a_task_that_cannot_build_on_the_meta_device_stays_dense() -> None:
    class OnlyOnTheCpu:
        """A user's task that builds its model from real tensors whatever the device."""

        name = "cpu-only"

        def make_model(self, seed: int) -> torch.nn.Module:
            weights = torch.randn(2_000, 1_000, generator=torch.Generator().manual_seed(seed))
            if weights.is_meta:
                raise RuntimeError("no meta tensors here")
            return torch.nn.Linear(1_000, 2_000)

    task = OnlyOnTheCpu()
    assert model_parameters(task) is None  # type: ignore[arg-type]
    unverified = {"verify": False}
    assert with_default_codec("diloco", unverified, task) == unverified  # type: ignore[arg-type]
