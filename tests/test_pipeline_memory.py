"""Memory budgets (`--max-memory`): what a stage costs a peer, estimated before it is built
(`pipeline/memory.py`), and a peer that chooses, and moves into, only stages that fit,
whatever other peers' records claim (`peer/pipelined/budget.py`, `peer/pipelined/run.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from shoal.dht.node import DHTNode
from shoal.dht.records import owner_marker
from shoal.peer.cli import parse_command_line
from shoal.peer.config import Config, ConfigError
from shoal.peer.experiment import Manifest
from shoal.peer.pipelined.budget import (
    NoStageFits,
    StageBudget,
    available_memory,
    cgroup_memory_free,
)
from shoal.peer.pipelined.run import PipelineRun
from shoal.peer.trainer import check_hyperparameters
from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.audit import RETENTION_BYTES
from shoal.pipeline.bounds import StageBounds, probe_bounds, saved_bytes
from shoal.pipeline.directory import StageRecord, least_capacity_stage
from shoal.pipeline.memory import (
    PRIOR_ACTIVATION_FACTOR,
    SERVER_BYTES,
    StageLimits,
    fit_stage,
    stage_memory,
    stages_that_fit,
)
from shoal.pipeline.rebalance import RebalancePolicy, plan_move
from shoal.pipeline.server import RECORD_TTL, stage_key
from shoal.pipeline.sizes import format_size, parse_size
from shoal.pipeline.stage import RETAINED_ANSWER_BYTES, RETAINED_ANSWERS
from shoal.transport.connection import bulk_buffer_bytes
from shoal.transport.identity import Identity
from shoal.transport.mux import DEFAULT_MAX_WINDOW, LEAN_MAX_WINDOW, MuxLimits

from .pipeline_swarm import HOST_OPTS, TINY

pytestmark = pytest.mark.timeout(60)

PEERS = [Identity.generate().peer_id for _ in range(8)]
BOUNDS = StageBounds(max_samples=8, input_elements=1024, output_elements=1024)


def rec(peer: int, speed: float) -> StageRecord:
    return StageRecord(PEERS[peer], 2 * speed, 2 * speed, 0, 0, 0.0)


def test_sizes_read_as_people_write_them() -> None:
    assert parse_size("2G") == 2 << 30
    assert parse_size("512M") == parse_size("512MiB") == parse_size("512mb") == 512 << 20
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("4096") == 4096
    for bad in ("", "-1G", "2X", "G", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(3 << 29) == "1.5 GiB" and format_size(300) == "300 B"


def run_config(argv: list[str], environ: dict[str, str]) -> Config:
    command, config = parse_command_line(["run", *argv], environ)
    assert command == "run"
    return config


def test_the_max_memory_flag_takes_a_size_and_refuses_anything_else() -> None:
    assert run_config(["--max-memory", "512M"], {}).max_memory == 512 << 20
    assert run_config([], {"SHOAL_MAX_MEMORY": "2G"}).max_memory == 2 << 30
    assert run_config([], {}).max_memory is None
    with pytest.raises(ConfigError, match="--max-memory"):
        run_config(["--max-memory", "lots"], {})


def test_a_peer_held_to_a_budget_grants_its_connections_smaller_windows() -> None:
    """What may wait in a stream for a slow reader is a receive window: a peer with
    --max-memory grants 2 MiB (what its stages' estimates count), others 16 MiB."""
    lean = run_config(["--max-memory", "512M"], {}).host_config().connection.mux
    assert lean.max_window == LEAN_MAX_WINDOW
    assert run_config([], {}).host_config().connection.mux.max_window == DEFAULT_MAX_WINDOW


def _cgroup(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text + "\n")


def test_in_a_container_the_default_budget_is_what_is_left_of_its_memory_limit(
    tmp_path: Path,
) -> None:
    """`docker run --memory` shows the host's MemAvailable inside: the cgroup's limit
    (ours or an ancestor's, the least left) is what counts, v2 and v1."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 65536000 kB\nMemAvailable: 32768000 kB\n")
    v2, proc = tmp_path / "v2", tmp_path / "cgroup"
    proc.write_text("0::/docker/abc\n")
    _cgroup(v2, {"memory.max": "max", "memory.current": "1"})
    _cgroup(v2 / "docker", {"memory.max": str(8 << 30), "memory.current": str(1 << 30)})
    _cgroup(v2 / "docker" / "abc", {"memory.max": str(2 << 30), "memory.current": str(512 << 20)})
    cpu = torch.device("cpu")
    assert cgroup_memory_free(proc, v2) == (2 << 30) - (512 << 20)
    assert available_memory(cpu, meminfo, (proc, v2)) == (2 << 30) - (512 << 20)
    proc.write_text("0::/\n")  # (a cgroup namespace: our cgroup is the mount's root)
    _cgroup(v2, {"memory.max": str(1 << 30), "memory.current": str(256 << 20)})
    assert cgroup_memory_free(proc, v2) == 768 << 20

    v1 = tmp_path / "v1"
    proc.write_text("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    _cgroup(v1 / "memory" / "docker" / "abc", {"memory.limit_in_bytes": "9223372036854771712",
                                               "memory.usage_in_bytes": "5"})  # fmt: skip
    assert cgroup_memory_free(proc, v1) is None  # (v1's "no limit")
    assert available_memory(cpu, meminfo, (proc, v1)) == 32768000 * 1024
    _cgroup(v1 / "memory" / "docker", {"memory.limit_in_bytes": str(3 << 30),
                                       "memory.usage_in_bytes": str(1 << 30)})  # fmt: skip
    assert cgroup_memory_free(proc, v1) == 2 << 30
    assert cgroup_memory_free(tmp_path / "missing", v1) is None


def test_a_stage_costs_its_parameters_gradients_moments_averaging_copies_and_activations() -> None:
    p = 1_000_000
    cost = stage_memory(p, BOUNDS, in_flight=16, group_size=2)
    b = 4 * p
    assert cost.parameters == b
    assert cost.optimizer == 2 * b  # AdamW's two moments
    # The bucket backwards fill, and one parameter's gradient or AdamW temporaries at
    # a time (bounds without the largest parameter: as much as all the gradients).
    assert cost.gradients == 2 * b
    largest = replace(BOUNDS, largest_parameter=1000)
    assert stage_memory(p, largest, in_flight=16).gradients == b + 2 * 1000 * 4
    # The step's bucket (sent as it is) and the round's result, one transient copy of
    # the state (parameters and moments: kept for a download a commit overlaps, or
    # downloaded on a re-sync; the committed state is served in place), and the
    # receive slots; parameters on a GPU: the bucket's host copy and the gradients'
    # copy back.
    assert 5 * b < cost.averaging <= 5 * b + 16 * (4 << 20)
    on_device = stage_memory(p, BOUNDS, in_flight=16, group_size=2, on_device=True)
    assert on_device.averaging == cost.averaging + 2 * b
    # A daemon keeps the transient copy and a re-sync's download in a file of its data
    # directory: none of the three parameter sizes in memory.
    on_disk = stage_memory(p, BOUNDS, in_flight=16, group_size=2, copies_on_disk=True)
    assert on_disk.averaging == cost.averaging - 3 * b
    # What waits for its reader on the two streams of the round a connection carries (a
    # receive window each), and the bodies sent: a peer held to a budget grants less.
    lean = stage_memory(p, BOUNDS, in_flight=16, group_size=2, window=LEAN_MAX_WINDOW)
    assert cost.averaging - lean.averaging == 2 * (DEFAULT_MAX_WINDOW - LEAN_MAX_WINDOW)
    fixed = bulk_buffer_bytes(MuxLimits(), streams=2)
    trio = stage_memory(p, BOUNDS, in_flight=16, group_size=3)
    assert trio.averaging - cost.averaging >= fixed  # (and the third member's slots)
    boundary = 2 * 1024 * 4  # (bounds without a probe of the activations: the prior)
    assert cost.activations == 16 * PRIOR_ACTIVATION_FACTOR * boundary + 2 * 16 * boundary
    probed = stage_memory(p, replace(BOUNDS, activation_bytes=1000), in_flight=16)
    assert probed.activations == 16 * 1000 + 2 * 16 * boundary
    # A verified experiment's stage peer keeps its answers for the trainers' audits.
    assert cost.audits == 0
    assert stage_memory(p, BOUNDS, in_flight=16, audits=True).audits == RETENTION_BYTES
    assert cost.total == sum(v for k, v in cost.as_dict().items() if k != "total")
    # The input gradients of the last RETAINED_ANSWERS backwards, kept for retries
    # within RETAINED_ANSWER_BYTES (none for a stage whose inputs are ids), and the
    # server's threads' own.
    one = 8 * 1024 * 4
    assert cost.answers == min(RETAINED_ANSWERS * one, RETAINED_ANSWER_BYTES + one)
    assert stage_memory(p, replace(BOUNDS, input_floating=False), in_flight=16).answers == 0
    assert cost.server == SERVER_BYTES
    # Twice the parameters, about twice their part; more in flight, more activations.
    bigger = stage_memory(2 * p, BOUNDS, in_flight=16)
    held = ("parameters", "gradients", "optimizer", "averaging")
    assert sum(bigger.as_dict()[k] for k in held) - fixed > 1.8 * (
        sum(cost.as_dict()[k] for k in held) - fixed
    )
    assert stage_memory(p, BOUNDS, in_flight=64).activations > 3 * cost.activations


def test_the_probe_on_the_meta_device_covers_what_autograd_keeps_in_each_stage() -> None:
    """The bounds' probe (shapes only, nothing allocated) against one real sample
    through the built stages: never less, at most a third more."""
    task = make_task(TINY)
    bounds = probe_bounds(task, 0, 3, 8)
    x = task.stage_inputs(task.eval_batches(1)[0])[:1]
    for module, b in zip(task.make_stages(0, 3), bounds, strict=True):
        kept, out = saved_bytes(module, x)
        assert 0 < kept <= b.activation_bytes <= 4 * kept / 3, (kept, b.activation_bytes)
        assert b.largest_parameter == max(p.numel() for p in module.parameters())
        x = out.detach()


def test_a_stage_that_does_not_fit_is_never_chosen_whatever_the_records_claim() -> None:
    # Stage 0 has no peer (a joiner's first pick), stage 2 the least capacity; a liar
    # claims a huge capacity on stage 1. Only stages 1 and 3 fit our memory.
    stages = [[], [rec(0, 1e9)], [rec(1, 0.5)], [rec(2, 5.0)]]
    assert least_capacity_stage(stages) == 0
    assert least_capacity_stage(stages, allowed=[1, 3]) == 3
    assert least_capacity_stage(stages, allowed=[1]) == 1
    with pytest.raises(ValueError):
        least_capacity_stage(stages, allowed=[])
    assert stages_that_fit([300, 100, 200], 200) == [1, 2]


def test_a_peer_never_moves_into_a_stage_that_does_not_fit() -> None:
    stages = [[rec(0, 1.0), rec(1, 1.0), rec(2, 1.0)], [rec(3, 1.0)], [rec(4, 1.0)]]
    policy = RebalancePolicy(period_s=10.0)
    assert plan_move(stages, stages[0][0], 0, policy) in (1, 2)
    assert plan_move(stages, stages[0][0], 0, policy, allowed=[2]) == 2
    assert plan_move(stages, stages[0][0], 0, policy, allowed=[0]) is None
    assert plan_move(stages, stages[0][0], 0, policy, allowed=[]) is None


def test_a_lean_stage_keeps_fewer_answers_then_holds_backwards_then_passes_fewer() -> None:
    """What a stage costs with its defaults (every request the queue joins in one
    pass, 64 MiB of answers, backwards computed while a step averages) when they fit;
    else the answers kept go first (a retry whose answer was dropped is only
    recomputed), then the next step's bucket (backwards wait while a step averages),
    then the samples a pass takes, never past the budget while one sample a pass and
    one answer fit."""
    p = 1_000_000
    b = 4 * p
    bounds = replace(BOUNDS, activation_bytes=200_000)
    opts: dict[str, Any] = {"in_flight": 16, "group_size": 2}
    default = stage_memory(p, bounds, **opts)
    assert fit_stage(p, bounds, budget=None, **opts) == (default, StageLimits())
    assert fit_stage(p, bounds, budget=default.total, **opts) == (default, StageLimits())
    one_answer = 8 * 1024 * 4
    # A little short: fewer answers kept, every pass whole.
    cost, limits = fit_stage(p, bounds, budget=default.total - (1 << 20), **opts)
    assert limits == StageLimits(None, RETAINED_ANSWER_BYTES - (1 << 20))
    assert cost.total == default.total - (1 << 20) and cost.activations == default.activations
    # Shorter than all the answers: backwards wait while a step averages (one bucket
    # less), and the answers get what is left.
    cost, limits = fit_stage(p, bounds, budget=default.total - RETAINED_ANSWER_BYTES - 1, **opts)
    assert limits == StageLimits(None, b - 1, backwards_while_averaging=False)
    assert cost.averaging == default.averaging - b and cost.activations == default.activations
    # Shorter than that too: passes of fewer samples, one answer kept.
    lean = default.total - RETAINED_ANSWER_BYTES - b - 5 * 200_000
    cost, limits = fit_stage(p, bounds, budget=lean, **opts)
    assert limits == StageLimits(11, 0, False) and cost.answers == one_answer
    assert cost.activations == default.activations - 5 * 200_000 and cost.total <= lean
    # What is left after the passes goes back to the answers.
    cost, limits = fit_stage(p, bounds, budget=lean + 150_000, **opts)
    assert limits == StageLimits(11, 150_000, False) and cost.total == lean + 150_000
    # One sample a pass is the least: below it the stage does not fit (its cost says
    # by how much).
    least = stage_memory(p, bounds, limits=StageLimits(1, 0, False), **opts)
    assert fit_stage(p, bounds, budget=least.total, **opts) == (least, StageLimits(1, 0, False))
    cost, limits = fit_stage(p, bounds, budget=least.total - 1, **opts)
    assert cost == least and cost.total > least.total - 1
    assert least.activations == 200_000 + 2 * 16 * (2 * 1024 * 4)


def test_a_peer_with_a_data_directory_puts_the_moments_in_a_file_before_passing_fewer() -> None:
    """With a folder for them (a daemon's data directory) and the parameters on the CPU,
    AdamW's moments go to a file once backwards already wait: two parameter sizes less
    (the largest parameter's moments are held while it steps), every pass still whole;
    shorter still, passes of fewer samples with the moments in the file. On a device
    they stay where they are."""
    p = 1_000_000
    b = 4 * p
    bounds = replace(BOUNDS, activation_bytes=200_000, largest_parameter=p // 4)
    opts: dict[str, Any] = {"in_flight": 16, "group_size": 2, "copies_on_disk": True}
    waiting = stage_memory(p, bounds, limits=StageLimits(None, 0, False), **opts)
    cost, limits = fit_stage(p, bounds, budget=waiting.total - 1, **opts)
    assert limits.moments_on_disk and limits.pass_samples is None
    assert not limits.backwards_while_averaging
    assert cost.optimizer == 2 * (p // 4) * 4 and cost.total <= waiting.total - 1
    assert cost.total == waiting.total - 1  # (the answers take what the moments left)
    assert waiting.optimizer - cost.optimizer == 2 * b - 2 * (p // 4) * 4
    on_disk = stage_memory(p, bounds, limits=StageLimits(None, 0, False, True), **opts)
    cost, limits = fit_stage(p, bounds, budget=on_disk.total - 5 * 200_000, **opts)
    assert limits == StageLimits(11, 0, False, True)
    assert fit_stage(p, bounds, budget=None, **opts)[1] == StageLimits()
    for elsewhere in ({"copies_on_disk": False}, {"on_device": True}):
        _, limits = fit_stage(p, bounds, budget=waiting.total - 1, **{**opts, **elsewhere})
        assert not limits.moments_on_disk and limits.pass_samples is not None
    assert StageLimits(moments_on_disk=True).as_dict()["moments_on_disk"] is True


def test_a_budget_fits_the_stages_within_it_less_what_our_own_trainer_keeps() -> None:
    task = make_task(TINY)
    bounds = probe_bounds(task, 0, 2, 8)
    free = StageBudget(task, 0, bounds, budget=None, in_flight=16)
    assert free.fitting() == [0, 1] and free.limits(0) == StageLimits()
    costs = StageBudget(task, 0, bounds, budget=1, in_flight=16).costs()  # (the leanest)
    small, large = sorted(range(2), key=lambda k: costs[k])
    assert costs[small] < costs[large] < free.costs()[large]
    between = StageBudget(task, 0, bounds, budget=(costs[0] + costs[1]) // 2, in_flight=16)
    assert between.fitting() == [small]
    # Our own trainer's microbatches (role auto) come off the budget.
    reserved = StageBudget(task, 0, bounds, budget=None, in_flight=16, trainer=True).reserved
    both = StageBudget(task, 0, bounds, budget=costs[small] + reserved, in_flight=16, trainer=True)
    assert reserved > 0 and both.fitting() == [small]
    short = StageBudget(task, 0, bounds, budget=costs[small] + reserved - 1, in_flight=16,
                        trainer=True)  # fmt: skip
    assert short.fitting() == [] and "for our trainer" in short.refusal()
    # A stage that fits only leanly is served leanly: the peer gets the limits.
    assert both.limits(small) == StageLimits(1, 0, backwards_while_averaging=False)
    assert both.cost(small).total == costs[small]
    none = StageBudget(task, 0, bounds, budget=costs[small] - 1, in_flight=16)
    assert none.fitting() == []
    line = none.refusal()
    assert "\n" not in line and "no stage fits --max-memory" in line and f"stage {small}" in line
    with pytest.raises(NoStageFits, match="trainer"):
        StageBudget(task, 0, bounds, budget=1000, in_flight=16).check_trainer()


def _manifest(identity: Identity, stages: int) -> Manifest:
    return Manifest.create(
        identity, name="mem", task="bytegpt", task_config=TINY, strategy="pipeline",
        strategy_options={"stages": stages, "global_batch": 8, "lag": 1, "codec": "none"},
        hyperparameters=check_hyperparameters({}), seed=5, initial_fingerprint="",
    )  # fmt: skip


async def _run(dht: DHTNode, manifest: Manifest, max_memory: int | None) -> PipelineRun:
    identity = Identity.generate()
    return PipelineRun(dht, identity, manifest, make_task(TINY), check_hyperparameters({}),
                       role="stage", stage=None, device=torch.device("cpu"),
                       max_memory=max_memory)  # fmt: skip


async def test_a_peer_serves_the_stage_that_fits_though_a_liar_makes_another_look_emptier(
    make_host: Callable[..., Any],
) -> None:
    """One stage fits our budget, the other does not. A liar's record on the one that
    fits claims a huge capacity (without a budget, we would serve the emptier one):
    we serve the one that fits, and /status.pipeline says what our budget is and
    what each stage costs."""
    manifest = _manifest(Identity.generate(), 2)
    task = make_task(TINY)
    bounds = probe_bounds(task, manifest.seed, 2, 8)
    # (each stage at its leanest: one sample a pass, one answer kept)
    costs = StageBudget(task, manifest.seed, bounds, budget=1, in_flight=16).costs()
    fits = min(range(2), key=lambda k: costs[k])
    budget = (costs[0] + costs[1]) // 2
    boot = await DHTNode.create(await make_host(**HOST_OPTS))
    nodes = [boot]
    for _ in range(2):
        nodes.append(await DHTNode.create(await make_host(**HOST_OPTS),
                                          bootstrap=[str(boot.host.addresses()[0])]))  # fmt: skip
    liar, dht = nodes[1:]
    now = time.time()
    claim = {"fwd": 1e12, "bwd": 1e12, "queue": 0, "version": 0, "t": now}
    assert await liar.store(stage_key(manifest.experiment_id, fits), claim, now + RECORD_TTL,
                            subkey=owner_marker(liar.peer_id))  # fmt: skip
    run = await _run(dht, manifest, budget)
    try:
        await run.refresh_directory()
        assert [len(records) for records in run.directory] == [1 - fits, fits]
        await run.start()
        assert run.stage_peer is not None and run.stage_peer.stage == fits
        status = run.status()
        assert status["memory_budget_bytes"] == budget
        assert costs[fits] <= status["stage_memory_bytes"] <= budget
        limits = run.stage_peer.limits
        assert status["stage_limits"] == limits.as_dict() and limits != StageLimits()
        assert run.stage_peer.worker.pass_samples == limits.pass_samples
        assert [s["memory_bytes"] <= budget for s in status["stages"]] == [fits == 0, fits == 1]
    finally:
        await run.aclose()
        for node in reversed(nodes):
            await node.aclose()


async def test_a_peer_that_no_stage_fits_refuses_in_one_line(
    make_host: Callable[..., Any],
) -> None:
    dht = await DHTNode.create(await make_host(**HOST_OPTS))
    run = await _run(dht, _manifest(Identity.generate(), 2), 1 << 20)
    try:
        with pytest.raises(NoStageFits) as refused:
            await run.start()
        message = str(refused.value)
        assert "\n" not in message and message.startswith("no stage fits --max-memory 1.0 MiB")
        assert run.stage_peer is None
    finally:
        await run.aclose()
        await dht.aclose()
