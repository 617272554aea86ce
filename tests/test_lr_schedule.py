"""The inner lr schedule: a pure function of the step and the manifest's hyperparameters.

A manifest without the schedule keys trains as it did before they existed
(linear warmup, then constant, at its lr); a new experiment gets the tuned
defaults written out in full.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from shoal.peer.config import Config
from shoal.peer.session import SessionError, _new_settings
from shoal.peer.trainer import (
    DEFAULT_HYPERPARAMETERS,
    LEGACY_HYPERPARAMETERS,
    VERIFIED_INNER_STATE,
    check_hyperparameters,
)
from shoal.peer.training.inner import LR_SCHEDULES, InnerOptimizer, learning_rate_scale
from shoal.peer.training.tasks.bytegpt import make_task

pytestmark = pytest.mark.timeout(30)


def scales(hyper: dict, steps: range) -> list[float]:
    return [learning_rate_scale(hyper, i) for i in steps]


def test_a_manifest_without_schedule_keys_keeps_the_old_warmup_then_constant() -> None:
    for old in ({}, {"inner_lr": 1e-3, "warmup_steps": 50, "num_shards": 64}):
        hyper = check_hyperparameters(old)
        assert hyper["lr_schedule"] == "constant"
        assert hyper["inner_lr"] == 1e-3 and hyper["warmup_steps"] == 50
        # The formula InnerOptimizer used before schedules existed.
        before = [min(1.0, (i + 1) / 50) for i in range(5000)]
        assert scales(hyper, range(5000)) == before
    # Without warmup: the peak from the first step.
    assert scales(check_hyperparameters({"warmup_steps": 0}), range(3)) == [1.0] * 3


@pytest.mark.parametrize("schedule", LR_SCHEDULES)
def test_every_schedule_warms_up_linearly_to_the_peak(schedule: str) -> None:
    hyper = check_hyperparameters(
        {"lr_schedule": schedule, "warmup_steps": 100, "total_steps": 1000, "lr_floor": 0.1}
    )
    assert scales(hyper, range(100)) == pytest.approx([(i + 1) / 100 for i in range(100)])
    assert learning_rate_scale(hyper, 99) == 1.0  # the warmup's last step is at the peak


def test_cosine_decays_as_half_a_cosine_to_the_floor_then_stays_there() -> None:
    hyper = check_hyperparameters(
        {"lr_schedule": "cosine", "warmup_steps": 100, "total_steps": 1100, "lr_floor": 0.1}
    )
    # Step index i is the (i+1)-th step: the decay runs from step 100 to step 1100.
    assert learning_rate_scale(hyper, 599) == pytest.approx(0.55)  # half way: (1 + floor) / 2
    quarter = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))
    assert learning_rate_scale(hyper, 349) == pytest.approx(quarter)
    assert learning_rate_scale(hyper, 1099) == pytest.approx(0.1)
    # An open-ended swarm goes on past the planned length: flat at the floor.
    assert scales(hyper, range(1099, 20000, 100)) == pytest.approx([0.1] * 190)
    decay = scales(hyper, range(99, 1100))
    assert all(a >= b for a, b in itertools.pairwise(decay))


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly_in_the_last_fifth() -> None:
    hyper = check_hyperparameters(
        {"lr_schedule": "wsd", "warmup_steps": 100, "total_steps": 1100, "lr_floor": 0.0}
    )
    # Decay over the last 20 % of the 1000 steps after warmup: steps 900..1100.
    assert scales(hyper, range(99, 900)) == [1.0] * 801
    assert learning_rate_scale(hyper, 999) == pytest.approx(0.5)
    assert learning_rate_scale(hyper, 1099) == 0.0
    assert learning_rate_scale(hyper, 5000) == 0.0


def test_inverse_sqrt_decays_with_the_step_and_stops_at_the_floor() -> None:
    hyper = check_hyperparameters(
        {"lr_schedule": "inverse_sqrt", "warmup_steps": 100, "lr_floor": 0.1}
    )
    assert learning_rate_scale(hyper, 399) == pytest.approx(0.5)  # sqrt(100 / 400)
    assert learning_rate_scale(hyper, 9999) == pytest.approx(0.1)
    assert learning_rate_scale(hyper, 10**7) == pytest.approx(0.1)


def test_the_optimizer_steps_at_the_scheduled_rate() -> None:
    model = torch.nn.Linear(4, 1)
    hyper = check_hyperparameters(
        {"inner_lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 10, "total_steps": 30}
    )
    inner = InnerOptimizer(model, hyper, device=torch.device("cpu"))
    x = torch.randn(8, 4)
    for step in (0, 9, 20, 29, 500):
        inner.step(lambda: model(x).pow(2).mean(), step)
        rate = inner.optimizer.param_groups[0]["lr"]
        assert rate == pytest.approx(1e-2 * learning_rate_scale(hyper, step))


def test_the_defaults_pass_their_own_check_and_decay() -> None:
    assert check_hyperparameters(DEFAULT_HYPERPARAMETERS) == DEFAULT_HYPERPARAMETERS
    assert DEFAULT_HYPERPARAMETERS["lr_schedule"] != "constant"
    assert set(LEGACY_HYPERPARAMETERS) == set(DEFAULT_HYPERPARAMETERS)


@pytest.mark.parametrize(
    ("given", "complaint"),
    [
        ({"lr_schedule": "linear"}, "lr_schedule must be one of"),
        ({"lr_schedule": 1}, "lr_schedule must be one of"),
        ({"lr_floor": 1.5}, "lr_floor is a fraction"),
        ({"lr_floor": -0.1}, "must be positive"),
        ({"lr_floor": float("nan")}, "must be a number"),
        ({"total_steps": 0}, "must be positive"),
        ({"total_steps": 2500.0}, "whole number"),
        ({"lr_schedule": "cosine", "warmup_steps": 400, "total_steps": 400}, "must exceed"),
        ({"lr_schedule": "wsd", "warmup_steps": 50, "total_steps": 10}, "must exceed"),
        ({"lr_decay": "cosine"}, "unknown hyperparameter"),
    ],
)
def test_bad_schedule_values_are_refused(given: dict, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        check_hyperparameters(given)


def test_a_new_experiment_writes_the_tuned_defaults_and_flags_override_them() -> None:
    _, options, hyper = _new_settings(Config(), task=None)  # type: ignore[arg-type]
    # (a manifest without precision reads as fp32, without inner_optimizer as AdamW;
    # a verified one, as the default experiment is, quantizes its inner state)
    assert options["verify"] is True
    unwritten = ("precision", "inner_optimizer", "inner_state")
    expected = {k: v for k, v in DEFAULT_HYPERPARAMETERS.items() if k not in unwritten}
    assert hyper == {**expected, "inner_state": VERIFIED_INNER_STATE}
    # Read back by a peer, the manifest means the same.
    assert check_hyperparameters(hyper) == {**DEFAULT_HYPERPARAMETERS,
                                            "inner_state": VERIFIED_INNER_STATE}  # fmt: skip
    # An unverified one carries it (and does not write it: older peers join).
    unverified = Config(strategy_option=(("verify", False),))
    assert "inner_state" not in _new_settings(unverified, task=None)[2]  # type: ignore[arg-type]
    carry = Config(strategy_option=(("inner_state", "carry"),))
    assert "inner_state" not in _new_settings(carry, task=None)[2]  # type: ignore[arg-type]
    flags = Config(strategy_option=(("inner_lr", 3e-3), ("lr_schedule", "constant")))
    _, _, hyper = _new_settings(flags, task=None)  # type: ignore[arg-type]
    assert hyper["inner_lr"] == 3e-3 and hyper["lr_schedule"] == "constant"
    assert hyper["warmup_steps"] == DEFAULT_HYPERPARAMETERS["warmup_steps"]
    reset = Config(strategy_option=(("inner_state", "reset"),))
    assert _new_settings(reset, task=None)[2]["inner_state"] == "reset"  # type: ignore[arg-type]


def test_a_new_pipeline_experiment_keeps_the_legacy_stage_optimizer_rates(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_bytes(b"to be or not to be, that is the question. " * 400)
    task = make_task({"n_layers": 2}, data=text)
    _, _, hyper = _new_settings(Config(pipeline_stages=2), task)
    assert hyper["inner_lr"] == LEGACY_HYPERPARAMETERS["inner_lr"]
    assert hyper["warmup_steps"] == LEGACY_HYPERPARAMETERS["warmup_steps"]
    with pytest.raises(SessionError, match="no lr_schedule"):
        _new_settings(Config(pipeline_stages=2, strategy_option=(("lr_schedule", "wsd"),)), task)
