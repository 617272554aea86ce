"""A strategy is its options schema, its implementation and one registry line.

The toy outer strategy below lives only in this module: its schema (`ToyOptions`)
and its class (`ToyStrategy`), registered by one line (the `toy` fixture). The CLI,
the manifest, the session and /status then know it with nothing else touched.
The built-in schemas keep the manifests' contents as they were, and the CLI
reads every schema without importing torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from shoal.averaging.compression import CODECS
from shoal.averaging.fingerprint import state_fingerprint
from shoal.averaging.options import (
    CODEC_NAMES,
    REDUCTION_NAMES,
    Opt,
    OuterOptions,
    StrategyOptions,
    integer,
)
from shoal.averaging.outer import DEFAULT_OPTIONS, RoundOutcome, RoundReport, VerifyingStrategy
from shoal.averaging.reducer import REDUCTIONS
from shoal.averaging.registry import (
    can_verify,
    is_pipeline,
    outer_strategy_names,
    register,
    schema_of,
    strategy_names,
    unregister,
)
from shoal.averaging.strategies import make_strategy
from shoal.averaging.strategy_base import OuterStrategyBase, RoundClock
from shoal.dht.node import DHTNode
from shoal.peer.cli import build_parser, parse_command_line
from shoal.peer.config import Config, ConfigError
from shoal.peer.experiment import Manifest
from shoal.peer.node import PeerNode
from shoal.peer.session import SessionError, _new_settings, open_session
from shoal.peer.status.metrics import Metrics
from shoal.peer.status.server import StatusServer
from shoal.pipeline.options import PipelineOptions
from shoal.transport.identity import Identity
from shoal.transport.nat import NatConfig, NatManager

pytestmark = pytest.mark.timeout(60)

TINY_TASK = (("d_model", 32), ("n_layers", 1), ("n_heads", 2), ("context", 32), ("batch_size", 4))


# ------------------------------------------------------------------ the toy strategy


@dataclass(frozen=True, kw_only=True)
class ToyOptions(OuterOptions):
    """Its options: the shared outer ones and a knob of its own."""

    name = "toy"
    description = "alone, every H inner steps the parameters move back toward the last round's"
    implementation = f"{__name__}:ToyStrategy"

    toy_knob: int = Opt(
        integer(1, 9), "an int in 1..9", "tenths of the way back to the last round's parameters"
    )(2)


class ToyStrategy(OuterStrategyBase):
    """Every `inner_steps` inner steps, the parameters move `toy_knob` tenths of the way
    back to where the previous round left them (an outer step of one peer)."""

    name = "toy"
    options: ToyOptions

    def __init__(
        self, dht: DHTNode, key: str, params: Sequence[torch.Tensor], options: ToyOptions
    ) -> None:
        super().__init__(dht, key, params, options)
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer_steps = 0
        self._fingerprint: str | None = None

    async def start(self, *, join: bool) -> bool:
        self._fingerprint = self.fingerprint()
        return False  # nobody serves a toy's state

    async def _round(self) -> RoundReport:
        clock = RoundClock(self.dht)
        pull = self.options.toy_knob / 10
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.sub_(pull * (p - a))
                a.copy_(p)
        self.outer_steps += 1
        self._fingerprint = self.fingerprint()
        return self._report(
            RoundOutcome.NO_GROUP,
            "alone",
            group_size=1,
            fingerprint=self._fingerprint,
            duration_s=clock.seconds,
            bytes_sent=clock.bytes_sent,
        )

    def fingerprint(self) -> str:
        return state_fingerprint(self.anchor, {})

    @property
    def committed_fingerprint(self) -> str | None:
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.name, "outer_steps": self.outer_steps, "anchor": self.anchor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_checkpoint(state)
        self.outer_steps = int(state["outer_steps"])
        self.anchor = [a.clone() for a in state["anchor"]]


@pytest.fixture
def toy() -> Iterator[type[ToyOptions]]:
    register(ToyOptions)  # the one registry line
    yield ToyOptions
    unregister(ToyOptions.name)


# ------------------------------------------------------------------ the CLI


def run_config(*argv: str) -> Config:
    _, config = parse_command_line(["run", *argv], {})
    return config


def test_the_cli_takes_a_registered_strategy_and_its_options(toy: type[ToyOptions]) -> None:
    config = run_config("--strategy", "toy", "--strategy-option", "toy_knob=3")
    assert config.strategy == "toy"
    strategy, options, _ = _new_settings(config, task=None)  # type: ignore[arg-type]
    assert strategy == "toy"
    assert options == {**toy.defaults(), "toy_knob": 3, "inner_steps": 50}
    assert toy.parse(options) == toy(toy_knob=3)


def test_the_cli_refuses_an_out_of_range_option_in_one_line(toy: type[ToyOptions]) -> None:
    config = run_config("--strategy", "toy", "--strategy-option", "toy_knob=10")
    with pytest.raises(SessionError) as caught:
        _new_settings(config, task=None)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message
    assert message == "--strategy-option: option 'toy_knob' of toy must be an int in 1..9, got 10"


def test_the_cli_refuses_a_strategy_nobody_registered() -> None:
    with pytest.raises(ConfigError, match="unknown strategy 'toy'; choose one of diloco"):
        run_config("--strategy", "toy")
    assert "toy" not in strategy_names()


def test_run_help_lists_every_strategy_and_its_settings(
    toy: type[ToyOptions], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = capsys.readouterr().out
    for name in ("diloco", "streaming", "noloco", "toy"):
        assert f"{name} (--strategy {name})" in text
    assert "pipeline (--pipeline-stages N)" in text
    assert "toy_knob=2: tenths of the way back" in text
    assert "audit_rate=0.05" in text and "fragments=4" in text and "lag=1" in text


def test_the_cli_reads_every_schema_without_torch() -> None:
    code = (
        "import sys\n"
        "from shoal.peer.cli import build_parser\n"
        "from shoal.averaging.registry import strategy_names\n"
        "build_parser().format_help()\n"
        "names = strategy_names()\n"
        "assert names == ('diloco', 'streaming', 'noloco', 'moshpit', 'pipeline'), names\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------------ schemas


def test_the_torch_free_names_match_the_codecs_and_reductions() -> None:
    assert tuple(CODECS) == CODEC_NAMES
    assert set(REDUCTIONS) == set(REDUCTION_NAMES)


# What the manifests of the built-in strategies held before the schemas: a new
# experiment's options (and so its ID) must not change.
LEGACY_DEFAULTS: dict[str, dict[str, Any]] = {
    "diloco": {
        "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "codec": "none",
        "min_group_size": 2, "target_group_size": 64, "matchmaking_time": 5.0,
        "round_timeout": 30.0, "stall_timeout": 5.0, "state_timeout": 120.0,
        "deadlines": "adaptive", "verify": False, "audit_rate": 0.05,
        "audit_probation_rate": 0.5, "audit_segment_steps": 3,
        "audit_threshold_angle": 3.2e-3, "reduction": "auto",
    },
    "streaming": {
        "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "codec": "int8",
        "min_group_size": 2, "target_group_size": 64, "matchmaking_time": 5.0,
        "round_timeout": 30.0, "stall_timeout": 5.0, "state_timeout": 120.0,
        "deadlines": "adaptive", "verify": False, "fragments": 4, "overlap_steps": 5,
        "mixing": 0.5,
    },
    "noloco": {
        "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "param_mixing": 1.0,
        "codec": "none", "round_timeout": 30.0, "stall_timeout": 5.0,
        "state_timeout": 120.0, "deadlines": "adaptive", "verify": False,
    },
    "moshpit": {
        "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.9, "codec": "none",
        "min_group_size": 2, "target_group_size": 64, "matchmaking_time": 5.0,
        "round_timeout": 30.0, "stall_timeout": 5.0, "state_timeout": 120.0,
        "deadlines": "adaptive", "verify": False, "param_mixing": 1.0, "grid_dims": 2,
        "grid_side": 0,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LEGACY_DEFAULTS))
def test_the_built_in_schemas_write_the_manifests_they_wrote_before(name: str) -> None:
    assert DEFAULT_OPTIONS[name] == LEGACY_DEFAULTS[name]
    assert schema_of(name).parse({}).to_dict() == LEGACY_DEFAULTS[name]
    # A value keeps its type: an int stays an int in the manifest's bytes.
    assert type(schema_of(name).parse({"outer_lr": 1}).to_dict()["outer_lr"]) is int


def test_a_manifest_without_a_newer_option_reads_as_its_default() -> None:
    old = {k: v for k, v in LEGACY_DEFAULTS["diloco"].items() if not k.startswith("audit")}
    del old["verify"], old["reduction"], old["deadlines"]
    parsed = schema_of("diloco").parse(old)
    assert parsed.verify is False and parsed.deadlines == "adaptive"  # type: ignore[attr-defined]


def test_the_schemas_say_what_each_strategy_can_do(toy: type[ToyOptions]) -> None:
    assert outer_strategy_names() == ("diloco", "streaming", "noloco", "moshpit", "toy")
    assert [n for n in strategy_names() if can_verify(n)] == ["diloco", "pipeline"]
    assert [n for n in strategy_names() if is_pipeline(n)] == ["pipeline"]
    assert schema_of("pipeline") is PipelineOptions
    with pytest.raises(ValueError, match="unknown outer strategy 'pipeline'"):
        schema_of("pipeline", outer=True)


def test_a_strategy_that_cannot_verify_refuses_verify(toy: type[ToyOptions]) -> None:
    with pytest.raises(ValueError, match="verification needs the diloco strategy"):
        toy.parse({"verify": True})


def test_a_name_is_registered_once_and_an_outer_verifier_carries_the_audit_policy(
    toy: type[ToyOptions],
) -> None:
    @dataclass(frozen=True, kw_only=True)
    class Impostor(OuterOptions):
        name = "toy"
        description = "another toy"

    with pytest.raises(ValueError, match="already registered"):
        register(Impostor)

    @dataclass(frozen=True, kw_only=True)
    class Unaudited(OuterOptions):
        name = "unaudited"
        description = "says it verifies, has no audit settings"
        can_verify = True

    with pytest.raises(ValueError, match="VerifyingOptions"):
        register(Unaudited)
    assert schema_of("toy") is toy and "unaudited" not in strategy_names()


def test_a_schema_field_without_an_opt_is_refused() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Loose(StrategyOptions):
        name = "loose"
        description = "a field without bounds"
        knob: int = 3

    with pytest.raises(TypeError, match="knob"):
        Loose.parse({})


# ------------------------------------------------------------------ manifest, session, /status


def test_a_manifest_of_the_toy_strategy_round_trips(toy: type[ToyOptions]) -> None:
    options = toy.parse({"toy_knob": 3, "inner_steps": 4})
    manifest = Manifest.create(
        Identity.generate(),
        name="toy-experiment",
        task="bytegpt",
        task_config={"d_model": 32},
        strategy="toy",
        strategy_options=options.to_dict(),
        hyperparameters={},
        seed=7,
        initial_fingerprint="0" * 64,
        created=1.0,
    )
    back = Manifest.from_bytes(manifest.to_bytes())
    assert back == manifest and back.experiment_id == manifest.experiment_id
    assert toy.parse(back.strategy_options) == options


async def test_a_manifest_that_lies_about_a_toy_option_builds_nothing(
    toy: type[ToyOptions], make_host: Callable[..., Any]
) -> None:
    """A joined manifest's options are a claim: out of bounds, or unknown, they are
    refused before a strategy exists."""
    dht = await DHTNode.create(await make_host(), bootstrap=[])
    try:
        params = [torch.zeros(3)]
        for claim, named in (({"toy_knob": 10**9}, "toy_knob"), ({"toy_knobs": 1}, "toy_knobs")):
            with pytest.raises(ValueError, match=named):
                make_strategy("toy", dht, "x/params", params, claim)
        with pytest.raises(ValueError, match="unknown outer strategy 'toy2'"):
            make_strategy("toy2", dht, "x/params", params, {})
        assert not is_pipeline("toy2") and not can_verify("toy2")
    finally:
        await dht.aclose()


@pytest.fixture
async def hosted_toy(
    toy: type[ToyOptions], make_host: Callable[..., Any], tmp_path: Path
) -> AsyncIterator[PeerNode]:
    """A peer hosting a toy experiment: its session from the flags, as the daemon's."""
    text = tmp_path / "text.txt"
    text.write_bytes(b"to be or not to be, that is the question. " * 400)
    config = run_config(
        "--data-dir", str(tmp_path / "data"), "--host-experiment", "toys",
        "--strategy", "toy", "--strategy-option", "toy_knob=3", "--inner-steps", "2",
        "--task-option", ",".join(f"{k}={v}" for k, v in TINY_TASK), "--data", str(text),
    )  # fmt: skip
    host = await make_host()
    dht = await DHTNode.create(host, bootstrap=[])
    session = await open_session(config, host.identity, dht)
    node = PeerNode(config, host.identity, host, NatManager(host, config=NatConfig()), dht)
    node.attach(session)
    try:
        yield node
    finally:
        await node.aclose()
        await dht.aclose()


async def test_the_session_builds_the_toy_and_status_shows_it(
    hosted_toy: PeerNode,
) -> None:
    node = hosted_toy
    session = node.session
    assert session is not None
    strategy = session.strategy
    assert isinstance(strategy, ToyStrategy) and not isinstance(strategy, VerifyingStrategy)
    assert strategy.options == ToyOptions(toy_knob=3, inner_steps=2)
    assert session.manifest.strategy == "toy"
    assert session.manifest.strategy_options == strategy.options.to_dict()
    assert session.verifier is None  # the toy cannot verify
    reports = [r for _ in range(2) for r in await strategy.after_inner_step(4)]
    assert [r.outcome for r in reports] == [RoundOutcome.NO_GROUP]

    server = StatusServer(node, Metrics(node), "127.0.0.1", 0)
    await server.start()
    try:
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(f"{server.url}/status") as response,
        ):
            assert response.status == 200
            status = json.loads(await response.text())
    finally:
        await server.aclose()
    assert status["strategy"] == "toy" and status["experiment"] == "toys"
    assert status["outer_step"] == 1
    assert status["fingerprint"] == strategy.committed_fingerprint
    assert status["config"]["strategy"] == "toy"
    assert status["config"]["strategy-option"] == {"toy_knob": 3}
    assert status["pipeline"] is None
    # What a restart of the host reads back: the same manifest.
    saved = node.config.data_dir / "experiments" / "toys.manifest"
    assert Manifest.from_bytes(saved.read_bytes()) == session.manifest
