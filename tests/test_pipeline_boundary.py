"""shoal's adapters at the stage boundaries of a model it did not write (codec WIRE+lowrankR)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shoal.averaging.compression import CodecError, get_codec
from shoal.averaging.fingerprint import state_fingerprint
from shoal.peer.pipelined.run import PipelineRun, pipeline_fingerprint
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.boundary import boundary_task, probe_boundaries
from shoal.pipeline.bounds import probe_bounds
from shoal.pipeline.options import CodecSpec, PipelineOptions, parse_codec
from shoal.pipeline.stage_build import build_stage, builds_stages_alone, stage_size
from shoal.pipeline.wire import decode_tensor, encode_tensor, exact_tail, parse_header, recv_tensor
from shoal.transport.errors import PayloadTooLarge
from shoal.transport.identity import Identity

from .pipeline_swarm import Swarm, loop_for
from .waiting import eventually

TINY = {"d_model": 32, "n_layers": 3, "n_heads": 2, "context": 32, "batch_size": 4}
INT8 = get_codec("int8")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The machine is shared: tests train on one core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def example_task(**config: Any) -> Any:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from pipeline_task import make_task as make_example
    finally:
        sys.path.remove(str(EXAMPLES))
    return make_example({"width": 32, "layers": 3, "heads": 2, "context": 16, **config})


def roundtrip(t: torch.Tensor, codec: Any = INT8) -> tuple[torch.Tensor, int]:
    head, payload = encode_tensor(t, codec)
    return decode_tensor(parse_header(head.header()), payload, codec), len(payload)


def params(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p.detach() for m in modules for p in m.parameters()]


@pytest.mark.parametrize(
    ("value", "spec"),
    [("int8", CodecSpec("int8")), ("int8+lowrank16", CodecSpec("int8", 16)),
     ("none+lowrank1", CodecSpec("none", 1)), ("bf16+lowrank128", CodecSpec("bf16", 128))],
)  # fmt: skip
def test_a_codec_is_a_wire_codec_optionally_with_lowrank_adapters(value: str, spec: Any) -> None:
    assert parse_codec(value) == spec
    assert PipelineOptions.parse({"codec": value}).codec == value


@pytest.mark.parametrize(
    "value", ["int3", "int8+lowrank", "int8+lowrank0", "int8+lowrank016", "int8+topk8",
              "lowrank16", "int8+lowrank16+x", 16, None, "int8+lowrank99999999"],
)  # fmt: skip
def test_the_manifest_refuses_an_unknown_codec_in_one_line(value: Any) -> None:
    with pytest.raises(ValueError) as refused:
        PipelineOptions.parse({"codec": value})
    message = str(refused.value)
    assert "codec" in message and "lowrank" in message and "\n" not in message


def test_token_ids_wider_than_a_byte_travel_exactly_in_two_or_four_bytes() -> None:
    hidden = torch.randn(2, 5, 8)
    for top, tail, size in ((300, "ids16", 2), (2**24, "ids32", 4)):
        ids = torch.randint(0, top, (2, 5)).float()
        ids[0, 0] = top
        t = torch.cat([hidden, ids.unsqueeze(-1)], dim=-1)
        assert exact_tail(t) == tail
        out, n = roundtrip(t)
        assert torch.equal(out[..., -1], ids)
        assert n == INT8.encoded_size(2 * 5 * 8) + 2 * 5 * size
    # a forged id past what float32 holds exactly is refused
    head, payload = encode_tensor(torch.cat([hidden, torch.ones(2, 5, 1) * 2**20], -1), INT8)
    forged = bytearray(payload)
    forged[-4:] = (2**24 + 1).to_bytes(4, "little")
    with pytest.raises(CodecError):
        decode_tensor(head, forged, INT8)


@pytest.mark.parametrize("which", ["bytegpt", "example"])
def test_the_adapters_narrow_both_directions_to_rank_plus_the_ids(which: str) -> None:
    """Every boundary carries rank + 1 channels (the last the token ids, exactly) forward,
    and the gradient back has the same width with an all-zero id channel: what travels
    under int8 is rank + 1 bytes a position (and the blocks' scales)."""
    task = make_task(TINY) if which == "bytegpt" else example_task()
    wrapped = boundary_task(task, "int8+lowrank4")
    stages = wrapped.make_stages(5, 3)
    batch = next(task.batches(0, 1, 0))
    ids = task.stage_inputs(batch)
    h1 = stages[0](ids)
    assert h1.shape[-1] == 5 and torch.equal(h1[..., -1], ids.float())
    x = h1.detach().requires_grad_(True)
    h2 = stages[1](x)
    assert h2.shape == h1.shape and torch.equal(h2[..., -1], ids.float())
    task.stage_loss(stages[2](h2), batch).backward()
    assert x.grad is not None and exact_tail(x.grad) == "zeros"
    assert x.grad[..., :-1].abs().sum() > 0
    positions = ids.numel()
    assert roundtrip(h1)[1] == INT8.encoded_size(positions * 4) + positions
    assert roundtrip(x.grad)[1] == INT8.encoded_size(positions * 4)


def test_a_model_without_token_ids_gets_the_projections_alone() -> None:
    class Floats:
        def stage_inputs(self, batch: torch.Tensor) -> torch.Tensor:
            return batch

        def eval_batches(self, count: int) -> list[torch.Tensor]:
            return [torch.randn(4, 24)] * count

        def make_stages(self, seed: int, count: int) -> list[torch.nn.Module]:
            torch.manual_seed(seed)
            return [torch.nn.Linear(24, 24) for _ in range(count)]

    assert probe_boundaries(Floats(), 0, 3).vocab == 0
    stages = boundary_task(Floats(), "int8+lowrank3").make_stages(0, 3)
    y = torch.randn(4, 24)
    for k, stage in enumerate(stages):
        y = stage(y)
        assert y.shape == ((4, 3) if k < 2 else (4, 24))


def test_every_peer_builds_the_same_adapters_into_the_fingerprint() -> None:
    """The adapters are drawn from the experiment's seed on the CPU, whatever the global
    RNG: peers of a stage hold the same bytes, and the fingerprint covers them (it
    differs from the model without them, and with another rank)."""
    task = make_task(TINY)
    torch.manual_seed(1)
    a = boundary_task(task, "int8+lowrank4").make_stages(5, 3)
    torch.manual_seed(2)
    b = boundary_task(task, "int8+lowrank4").make_stages(5, 3)
    assert state_fingerprint(params(a), {}) == state_fingerprint(params(b), {})
    prints = {
        pipeline_fingerprint(boundary_task(task, codec), 5, 3)
        for codec in ("int8", "int8+lowrank4", "int8+lowrank8", "bf16+lowrank4")
    }
    assert len(prints) == 3  # (the wire codec alone changes no parameter)
    assert len(params(a)) > len(params(task.make_stages(5, 3)))
    with pytest.raises(ValueError, match="rank"):
        boundary_task(task, "int8+lowrank32").make_stages(5, 3)  # not narrower than d_model


def test_the_wrapped_stages_compose_to_a_model_that_trains() -> None:
    """Chained in one process, each boundary crossed as the wire delivers it under int8
    both ways, the loss falls."""
    task = example_task()
    wrapped = boundary_task(task, "int8+lowrank4")
    stages = wrapped.make_stages(0, 3)
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=3e-3)

    class Wire(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return roundtrip(t)[0]

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return roundtrip(g)[0]

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        y = task.stage_inputs(batch)
        for k, stage in enumerate(stages):
            y = stage(y)
            y = Wire.apply(y) if k < 2 else y
        return task.stage_loss(y, batch)

    held_out = task.eval_batches(2)
    with torch.no_grad():
        before = sum(float(loss_of(b)) for b in held_out)
    for _, batch in zip(range(40), task.batches(0, 1, 0), strict=False):
        opt.zero_grad()
        loss_of(batch).backward()
        opt.step()
    with torch.no_grad():
        after = sum(float(loss_of(b)) for b in held_out)
    assert after < before - 0.5


async def test_a_compressed_tensor_wider_than_the_boundary_is_refused_unread() -> None:
    """The bounds of a wrapped task are the narrow boundary's: a peer that sends the
    hidden states uncompressed (or any tensor larger) is refused before anything is
    read or allocated for it; one of the right size but the wrong width is refused by
    the stage, and ids out of the table's range stay within it."""
    task = make_task(TINY)
    wrapped = boundary_task(task, "int8+lowrank4")
    bounds = probe_bounds(wrapped, 5, 3, 8)
    assert bounds[1].input_elements == 32 * 5 and bounds[0].output_elements == 32 * 5

    class Stream:  # a stage request's stream: the full hidden states, 32 wide
        async def recv(self) -> dict[str, Any]:
            return {"shape": [8, 32, 33], "dtype": "torch.float32", "tail": "ids"}

        async def recv_chunk_into(self, index: int, into: memoryview) -> int:
            raise AssertionError("the tensor's bytes were read (and memory taken)")

    with pytest.raises(PayloadTooLarge):
        await recv_tensor(Stream(), INT8, True, rows=8, max_elements=bounds[1].inputs(8))  # type: ignore[arg-type]
    stage = wrapped.make_stages(5, 3)[1]
    with pytest.raises(ValueError, match="channels"):
        stage(torch.randn(4, 40, 4))  # as many elements, the wrong width
    with pytest.raises(ValueError, match="positions"):
        stage(torch.randn(2, 64, 5))  # more positions than the model has
    bad = torch.randn(4, 32, 5)
    bad[..., -1] = torch.linspace(-1e6, 1e6, 4 * 32).view(4, 32)
    assert torch.isfinite(stage(bad)).all()


@pytest.mark.timeout(240)
async def test_peers_of_a_stage_keep_equal_fingerprints_with_the_adapters(
    make_host: Callable[..., Any],
) -> None:
    """2 stages x 2 peers under int8+lowrank4: after a few steps, every stage's peers
    hold the same parameters, adapters included, and the stages have moved from the
    initial ones."""
    task = boundary_task(make_task({**TINY, "n_layers": 2}), "int8+lowrank4")
    stages = task.make_stages(7, 2)
    initial = [state_fingerprint(params([m]), {}) for m in stages]
    swarm = Swarm(make_host)
    steps = 3
    try:
        for s, module in enumerate(stages):
            for _ in range(2):
                await swarm.stage_peer(s, copy.deepcopy(module), global_batch=8)
        trainer = await swarm.trainer(2, codec="int8+lowrank4")
        assert trainer.codec.name == "int8"
        loop = loop_for(trainer, task, shard=0, global_batch=8, lag=0)
        await loop.run(steps=steps)

        def applied() -> bool:
            return all(p.optimizer.averager.last_fingerprint_commits == steps for p in swarm.peers)

        await eventually(applied, f"every stage peer applied step {steps}", 30.0)
        for s in range(2):
            peers = swarm.of_stage(s)
            assert len({p.optimizer.fingerprint() for p in peers}) == 1
            held = {state_fingerprint(params([p.worker.module]), {}) for p in peers}
            assert len(held) == 1 and held != {initial[s]}
            names = [n for n, _ in peers[0].worker.module.named_parameters()]
            assert any(n.startswith(("entry.", "outlet.")) for n in names)
    finally:
        await swarm.aclose()


def test_a_stage_built_alone_comes_wrapped_and_counts_its_adapters_in_its_size() -> None:
    """A task that builds one stage alone (and sizes it) keeps doing so through the
    codec; one that cannot, still cannot (`stage_build` falls back to slicing)."""
    base = make_task(TINY)

    class Alone:
        def __getattr__(self, name: str) -> Any:
            return getattr(base, name)

        def make_stage(self, seed: int, count: int, k: int) -> torch.nn.Module:
            return base.make_stages(seed, count)[k]

        def stage_size(self, count: int, k: int) -> int:
            return sum(p.numel() for p in self.make_stage(0, count, k).parameters())

    wrapped = boundary_task(Alone(), "int8+lowrank4")
    whole = boundary_task(base, "int8+lowrank4").make_stages(5, 3)
    for k in range(3):
        stage = build_stage(wrapped, 5, 3, k)
        assert stage_size(wrapped, 5, 3, k) == sum(p.numel() for p in stage.parameters())
        assert all(torch.equal(p, q) for p, q in
                   zip(stage.parameters(), whole[k].parameters(), strict=True))  # fmt: skip
    assert builds_stages_alone(boundary_task(base, "int8+lowrank4"))  # (bytegpt can)

    class OnlyWhole:
        def __getattr__(self, name: str) -> Any:
            if name in ("make_stage", "stage_size"):
                raise AttributeError(name)
            return getattr(base, name)

    assert not builds_stages_alone(boundary_task(OnlyWhole(), "int8+lowrank4"))


def pipeline_run(codec: str) -> PipelineRun:
    """A stage peer's run of an experiment hosted with `codec` (not started)."""
    options = {"stages": 3, "codec": codec, "global_batch": 8, "lag": 0}
    manifest = SimpleNamespace(strategy_options=options, seed=5, experiment_id="e")
    return PipelineRun(
        None,  # type: ignore[arg-type]
        Identity.generate(),
        manifest,  # type: ignore[arg-type]
        make_task(TINY),
        {"num_shards": 1},
        role="stage",
        stage=None,
        device=torch.device("cpu"),
    )


def test_a_pipeline_run_builds_its_stages_as_the_manifests_codec_says() -> None:
    """A peer of an experiment hosted with codec int8+lowrank4 serves, probes and drives
    the wrapped stages; one hosted with int8 the task's own."""
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert pipeline_run("int8+lowrank4").task.make_stages(5, 3)[0](ids).shape[-1] == 5
    assert pipeline_run("int8").task.make_stages(5, 3)[0](ids).shape[-1] == 32
