"""The inner optimizer as the experiment's choice: AdamW by default, SGD, Adafactor and a few
more by name (peer/training/optimizers.py). Each survives a checkpoint and an audit's
re-execution bit for bit; its state on the wire is what it keeps and nothing else; a
manifest naming an optimizer off the allowlist, or an argument out of bounds, is
refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.peer.cli import parse_command_line
from shoal.peer.experiment import Manifest
from shoal.peer.session import SessionError, _new_settings
from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.checkpoint import CheckpointStore
from shoal.peer.training.inner import InnerOptimizer
from shoal.peer.training.optimizers import make_inner_optimizer, state_layout
from shoal.peer.training.tasks.bytegpt import ByteGPTTask, make_task
from shoal.peer.verify.reveals import PROTOCOL as REVEALS
from shoal.peer.verify.reveals import (
    RevealError,
    RevealTooLarge,
    fetch_reveal,
    reveal_of,
    send_reveal,
)
from shoal.peer.verify.segments import (
    SegmentRunner,
    SegmentState,
    optimizer_hash,
    params_hash,
    segment_batches,
)
from shoal.transport import rpc
from shoal.transport.identity import Identity

pytestmark = pytest.mark.timeout(60)

TASK = {"d_model": 16, "n_layers": 1, "n_heads": 2, "context": 16, "batch_size": 4}
SHARDS = 8

CHOICES = {
    "AdamW": {"name": "AdamW"},
    "SGD": {"name": "SGD", "momentum": 0.9, "nesterov": True},
    "Adafactor": {"name": "Adafactor"},
}
# Every allowed optimizer, with the arguments that change what state it keeps.
LAYOUT_CHOICES = [
    *CHOICES.values(),
    {"name": "AdamW", "amsgrad": True},
    {"name": "Adam"},
    {"name": "SGD"},
    {"name": "RMSprop", "momentum": 0.5, "centered": True},
    {"name": "RMSprop"},
]


@pytest.fixture(scope="module")
def task() -> ByteGPTTask:
    return make_task(TASK)


def hyper_of(choice: dict[str, Any]) -> dict[str, Any]:
    return check_hyperparameters({"inner_lr": 3e-3, "warmup_steps": 2, "inner_optimizer": choice})


def batches(task: ByteGPTTask, count: int, *, first: int = 0) -> list[Any]:
    return segment_batches(task, 1, SHARDS, seed=7, first=first, count=count)


def warmed(task: ByteGPTTask, hyper: dict[str, Any]) -> tuple[SegmentRunner, SegmentState]:
    """A runner and its state after 4 steps (the optimizer's state is not empty)."""
    runner = SegmentRunner(task, hyper)
    return runner, runner.run(runner.capture(), batches(task, 4), first_step=0)


@pytest.mark.parametrize("choice", LAYOUT_CHOICES, ids=lambda c: "-".join(map(str, c.values())))
def test_the_state_layout_is_what_the_torch_optimizer_keeps(choice: dict[str, Any]) -> None:
    hyper = check_hyperparameters({"inner_optimizer": choice})
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3,), (4, 5), (2, 3, 4), ()]]
    optimizer = make_inner_optimizer(params, hyper)
    assert type(optimizer).__name__ == choice["name"]
    for p in params:
        p.grad = torch.randn_like(p)
        assert not optimizer.state[p]  # (none before the first step)
    optimizer.step()
    for p in params:
        kept = {name: tuple(t.shape) for name, t in optimizer.state[p].items()}
        assert kept == state_layout(choice, p.shape), choice


def test_adamw_without_the_key_is_the_optimizer_experiments_always_had() -> None:
    hyper = check_hyperparameters({"adam_beta2": 0.97, "weight_decay": 0.05})
    optimizer = make_inner_optimizer([torch.nn.Parameter(torch.zeros(2))], hyper)
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.97), 0.05)
    assert (group["eps"], group["amsgrad"]) == (1e-8, False)


def test_the_arguments_reach_the_optimizer_and_the_lr_stays_the_experiments() -> None:
    hyper = hyper_of({"name": "SGD", "momentum": 0.9, "nesterov": True})
    optimizer = make_inner_optimizer([torch.nn.Parameter(torch.zeros(2))], hyper)
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["lr"]) == (0.9, True, 3e-3)
    assert group["weight_decay"] == hyper["weight_decay"]


@pytest.mark.parametrize("name", list(CHOICES))
def test_a_checkpoint_round_trip_is_bit_exact_and_the_next_step_identical(
    task: ByteGPTTask, tmp_path: Path, name: str
) -> None:
    hyper = hyper_of(CHOICES[name])
    runner, state = warmed(task, hyper)
    runner.load(state)  # (a run lets go of its optimizer state: a trainer's holds it)
    store = CheckpointStore(tmp_path / "ckpt")
    # The trainer's layout of a checkpoint (peer/trainer.py, `state_dict`).
    inner = runner.inner
    store.save({
        "model": runner.model.state_dict(),
        "inner_optimizer": inner.optimizer.state_dict(),
        "grad_scaler": inner.scaler.state_dict(),
    })  # fmt: skip
    loaded = store.load()
    assert loaded is not None

    model = task.make_model(1)  # other initial weights: all of them are loaded
    model.load_state_dict(loaded["model"])
    resumed = InnerOptimizer(model, hyper, device=torch.device("cpu"))
    resumed.load_state_dict(
        {"optimizer": loaded["inner_optimizer"], "grad_scaler": loaded["grad_scaler"]}
    )
    assert params_hash(model.parameters()) == params_hash(state.params)
    assert optimizer_hash(resumed.state_dict()) == optimizer_hash(state.optimizer)

    (batch,) = batches(task, 1, first=4)
    inner.step(lambda: task.loss(runner.model, batch), 4)
    resumed.step(lambda: task.loss(model, batch), 4)
    assert params_hash(model.parameters()) == params_hash(runner.model.parameters())
    assert optimizer_hash(resumed.state_dict()) == optimizer_hash(inner.state_dict())


@pytest.mark.parametrize("name", list(CHOICES))
async def test_an_audit_re_executes_a_revealed_segment_bit_for_bit(
    task: ByteGPTTask, make_host: Callable[..., Any], name: str
) -> None:
    """The prover's segment, revealed over the wire, re-run by a referee with its own
    runner: the same parameters and optimizer state, bit for bit."""
    hyper = hyper_of(CHOICES[name])
    prover_runner, start = warmed(task, hyper)
    segment = batches(task, 3, first=4)
    end = prover_runner.run(start, segment, first_step=4)
    sent = reveal_of(start, end, end)

    referee, prover = await make_host(), await make_host()
    service = rpc.RpcService(prover, REVEALS)

    @service.stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        await send_reveal(ctx, sent)
        yield {"done": True}

    await referee.connect(prover.addresses()[0])
    auditor = SegmentRunner(task, hyper, model_seed=3)
    shapes = [p.shape for p in auditor.model.parameters()]
    got = await fetch_reveal(
        referee, prover.peer_id, 1, 0, auditor.inner.state_dict(), shapes, timeout=10,
        layouts=auditor.inner.state_layouts(),
    )  # fmt: skip
    assert got.start.digest() == start.digest()
    again = auditor.run(got.start, segment, first_step=4)
    assert again.digest() == end.digest() == got.end_digest()
    assert torch.equal(again.flat(), end.flat())


def lying_reveal(start: SegmentState, change: Callable[[dict[int, Any]], None]) -> Any:
    optimizer = {
        "optimizer": {
            "state": {i: dict(s) for i, s in start.optimizer["optimizer"]["state"].items()},
            "param_groups": start.optimizer["optimizer"]["param_groups"],
        },
        "grad_scaler": None,
    }
    change(optimizer["optimizer"]["state"])
    forged = SegmentState(start.params, optimizer)
    return reveal_of(forged, forged, forged)


@pytest.mark.parametrize(
    ("name", "lie", "refusal"),
    [
        # SGD keeps one momentum buffer: Adam's moments on top are refused unread.
        ("SGD", lambda s: s[0].update(exp_avg=s[0]["momentum_buffer"]), RevealTooLarge),
        # Adafactor's row factor, announced as large as its matrix.
        ("Adafactor", lambda s: s[0].update(row_var=torch.zeros(256, 16)), RevealTooLarge),
        # ... or of its size but another shape.
        ("Adafactor", lambda s: s[0].update(row_var=torch.zeros(1, 256)), RevealError),
        # AdamW's state without its second moment.
        ("AdamW", lambda s: s[0].pop("exp_avg_sq"), RevealTooLarge),
    ],
    ids=["sgd-extra-state", "adafactor-oversized-factor", "adafactor-reshaped", "adamw-missing"],
)
async def test_a_reveal_of_state_the_experiments_optimizer_does_not_keep_is_refused(
    task: ByteGPTTask,
    make_host: Callable[..., Any],
    name: str,
    lie: Callable[[dict[int, Any]], None],
    refusal: type[Exception],
) -> None:
    hyper = hyper_of(CHOICES[name])
    runner, start = warmed(task, hyper)
    assert next(iter(runner.model.parameters())).shape == (256, 16)  # the embedding
    sent = lying_reveal(start, lie)
    referee, prover = await make_host(), await make_host()
    service = rpc.RpcService(prover, REVEALS)

    @service.stream("reveal")
    async def reveal(ctx: rpc.CallContext, payload: Any) -> Any:
        await send_reveal(ctx, sent)
        yield {"done": True}

    await referee.connect(prover.addresses()[0])
    shapes = [p.shape for p in runner.model.parameters()]
    with pytest.raises(refusal):
        await fetch_reveal(
            referee, prover.peer_id, 1, 0, runner.inner.state_dict(), shapes, timeout=10,
            layouts=runner.inner.state_layouts(),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("claim", "says"),
    [
        ({"name": "os.system"}, "'os.system' is not allowed; allowed: AdamW"),
        ({"name": "torch.optim.SGD"}, "is not allowed"),
        ({"name": "LBFGS"}, "is not allowed"),
        ({"momentum": 0.9}, "None is not allowed"),
        ("SGD:momentum=0.9", None),  # the flag's text form is read too (a valid one)
        ({"name": "SGD", "momentum": 1.5}, "SGD: momentum must be in [0, 1), got 1.5"),
        ({"name": "SGD", "momentum": float("nan")}, "momentum must be a finite number"),
        ({"name": "SGD", "momentum": "0.9"}, "momentum must be a number in [0, 1)"),
        ({"name": "SGD", "nesterov": 1}, "nesterov must be true or false"),
        ({"name": "SGD", "nesterov": True}, "nesterov needs momentum > 0 and dampening 0"),
        ({"name": "SGD", "foreach": True}, "unknown argument 'foreach'; known: momentum"),
        ({"name": "SGD", "lr": 10.0}, "lr is not an argument here; it is the experiment's"),
        ({"name": "AdamW", "weight_decay": 0.0}, "weight_decay hyperparameter"),
        ({"name": "AdamW", "betas": [0.9, 1.0]}, "betas [1] must be in [0, 1), got 1.0"),
        ({"name": "AdamW", "betas": [0.9]}, "betas must be a list of two numbers"),
        ({"name": "Adafactor", "d": 1e9}, "Adafactor: d must be in (0, 1000]"),
        ({"name": "Adafactor", "eps": [None, 0.0]}, "eps [1] must be in (0, 1]"),
        (["SGD"], "inner_optimizer must be"),
    ],
)
def test_a_manifest_naming_an_optimizer_off_the_allowlist_or_out_of_bounds_is_refused(
    claim: Any, says: str | None
) -> None:
    """The host's signature makes it the host's claim, not a safe one: a joiner checks
    the optimizer before building anything."""
    host = Identity.from_seed(b"h" * 32)
    manifest = Manifest.create(
        host, name="opt", task="bytegpt", task_config={}, strategy="diloco",
        strategy_options={}, hyperparameters={"inner_optimizer": claim}, seed=0,
        initial_fingerprint="f" * 64,
    )  # fmt: skip
    received = Manifest.from_bytes(manifest.to_bytes())
    if says is None:
        assert check_hyperparameters(received.hyperparameters)["inner_optimizer"]["name"] == "SGD"
        return
    with pytest.raises(ValueError) as refused:
        check_hyperparameters(received.hyperparameters)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_the_flag_pins_the_optimizer_in_a_hosted_manifest_and_adamw_is_not_written(
    task: ByteGPTTask,
) -> None:
    _, config = parse_command_line(
        ["run", "--inner-optimizer", "SGD:momentum=0.9,nesterov=true"], {}
    )
    _, _, hyper = _new_settings(config, task, "opt")
    assert hyper["inner_optimizer"] == {"name": "SGD", "momentum": 0.9, "nesterov": True}
    _, config = parse_command_line(
        ["run", "--inner-optimizer", '{"name": "AdamW", "betas": [0.9, 0.99]}'], {}
    )
    assert _new_settings(config, task, "opt")[2]["inner_optimizer"]["betas"] == [0.9, 0.99]
    # Plain AdamW stays unwritten: peers of a shoal before the choice still join.
    _, config = parse_command_line(["run", "--inner-optimizer", "AdamW"], {})
    assert "inner_optimizer" not in _new_settings(config, task, "opt")[2]


def test_a_pipeline_experiment_refuses_another_inner_optimizer(task: ByteGPTTask) -> None:
    _, config = parse_command_line(
        ["run", "--pipeline-stages", "2", "--inner-optimizer", "SGD:momentum=0.9"], {}
    )
    with pytest.raises(SessionError, match="stage optimizer is AdamW"):
        _new_settings(config, task, "opt")


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("Rprop", "'Rprop' is not allowed"),
        ("SGD:momentum", "expected key=value"),
        ("SGD:momentum=lots", "is not a number, true or false"),
        ("{not json", "not JSON"),
    ],
)
def test_a_bad_flag_is_refused_in_one_line_naming_the_flag(flag: str, says: str) -> None:
    from shoal.peer.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_command_line(["run", "--inner-optimizer", flag], {})
    text = str(refused.value)
    assert text.startswith("--inner-optimizer: ") and says in text and "\n" not in text
