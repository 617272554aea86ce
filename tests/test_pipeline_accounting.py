"""The pieces that make pipeline training count every microbatch once, without a network:
gradient epochs and batching in the stage worker, the trainer's ledger, the choice of a
stage for a new peer, and the experiment's options."""

from __future__ import annotations

import copy

import pytest
import torch

from shoal.peer.training.tasks.bytegpt import make_task
from shoal.pipeline.directory import StageRecord, least_capacity_stage, stage_capacity
from shoal.pipeline.ledger import GIVE_UP_VERSIONS, Applied, MicrobatchLedger
from shoal.pipeline.options import resolve_pipeline_options
from shoal.pipeline.stage import StageWorker
from shoal.transport.identity import Identity

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "context": 16, "batch_size": 4}
PEERS = [Identity.generate().peer_id for _ in range(4)]


def stage_and_requests(
    count: int,
) -> tuple[StageWorker, list[tuple[str, torch.Tensor, torch.Tensor, int]]]:
    task = make_task(TINY)
    stage = task.make_stages(5, 2)[1]  # floats in, logits out
    torch.manual_seed(0)
    requests = []
    for i in range(count):
        n = 2 + i  # different sizes: the weighting by samples matters
        x = torch.randn(n, 16, 32)
        requests.append((f"k{i}", x, torch.randn(n, 16, 256), n))
    return StageWorker(stage), requests


def test_a_batch_of_backwards_equals_them_one_by_one() -> None:
    batched, requests = stage_and_requests(3)
    single = StageWorker(copy.deepcopy(batched.module))
    answers = batched.backward_many(requests)
    for request, (grad, epoch) in zip(requests, answers, strict=True):
        alone = single.backward(*request)
        assert epoch == 0
        assert float((grad - alone).norm()) <= 1e-5 * float(alone.norm())
    a, b = batched.take_gradients(), single.take_gradients()
    assert a.samples == b.samples == 2 + 3 + 4
    for x, y in zip(a.sums, b.sums, strict=True):  # (another summation order)
        assert float((x - y).norm()) <= 1e-5 * float(y.norm())


def test_backwards_during_a_step_go_to_the_next_epoch_and_a_failed_step_gives_back() -> None:
    worker, requests = stage_and_requests(3)
    worker.backward(*requests[0])
    taken = worker.take_gradients(0)  # the step from version 0 starts
    assert taken.samples == 2 and taken.keys == {"k0"} and worker.epoch == 1
    _, epoch = worker.backward_many([requests[1]])[0]
    assert epoch == 1 and worker.samples_for(1) == 3
    worker.give_back(taken)  # nobody committed: back to version 0's step
    assert worker.epoch == 0 and worker.samples_for(0) == 2 and worker.samples_for(1) == 3
    # A retry of an applied backward counts nothing, whatever the epoch now.
    worker.backward(*requests[0])
    assert worker.samples_for(0) == 2


def test_dropped_gradients_forget_their_keys_so_a_replay_counts_again() -> None:
    worker, requests = stage_and_requests(2)
    worker.backward(*requests[0])
    worker.take_gradients(0)
    worker.backward(*requests[1])  # epoch 1
    assert worker.drop_before(2) == 3  # the stage stepped twice without us
    assert worker.epoch == 2 and worker.samples == 0
    worker.backward(*requests[1])  # replayed here: it counts again
    assert worker.samples_for(2) == 3


def entry(key: str, peer: int, epoch: int, stage: int = 0, samples: int = 4) -> Applied:
    return Applied(stage, key, PEERS[peer], epoch, torch.zeros(1), torch.zeros(1), samples)


def test_the_ledger_counts_what_a_step_included_and_replays_what_it_went_without() -> None:
    ledger = MicrobatchLedger(2)
    ledger.applied(entry("a", 0, 3))
    ledger.applied(entry("b", 1, 3))
    ledger.applied(entry("c", 1, 4))
    replay = ledger.resolve(0, [(3, frozenset({PEERS[0], PEERS[2]}))], version=4)
    assert [e.key for e in replay] == ["b"]  # peer 1 was not in the step from 3
    assert ledger.counted[0] == 4 and ledger.replayed[0] == 4
    assert [e.key for e in ledger.open(0)] == ["c"]  # its step is not known yet
    # Steps of other stages settle nothing here.
    assert ledger.resolve(1, [(4, frozenset({PEERS[1]}))], version=5) == []
    assert ledger.open_samples(0) == 4


def test_the_ledger_gives_up_on_steps_it_never_hears_of() -> None:
    ledger = MicrobatchLedger(1)
    ledger.applied(entry("a", 0, 1))
    assert ledger.resolve(0, [], version=1 + GIVE_UP_VERSIONS) == []
    assert ledger.open(0)
    ledger.resolve(0, [], version=2 + GIVE_UP_VERSIONS)
    assert not ledger.open(0) and ledger.assumed[0] == 4


def record(peer: int, fwd: float | None = None, bwd: float | None = None) -> StageRecord:
    return StageRecord(PEERS[peer], fwd, bwd, 0, 0, 0.0)


def test_a_new_peer_serves_the_stage_with_the_least_capacity() -> None:
    assert least_capacity_stage([[], [], []]) == 0
    # Unmeasured peers count as the swarm's typical peer.
    assert least_capacity_stage([[record(0)], [], [record(1)]]) == 1
    fast, slow = record(0, 300.0, 120.0), record(1, 30.0, 12.0)
    assert stage_capacity([fast]) == pytest.approx(1 / (1 / 300 + 1 / 120))
    assert least_capacity_stage([[fast, fast], [slow, slow], [fast, fast]]) == 1
    assert least_capacity_stage([[fast, fast], [fast], [fast, record(2)]]) == 1


def test_a_new_peer_gives_a_stage_its_second_peer_before_it_looks_at_capacity() -> None:
    """A stage with one peer loses its state to one kill: the next joiner goes there,
    even when another stage is slower (the rebalancer evens capacity out later)."""
    fast, slow = record(0, 300.0, 120.0), record(1, 30.0, 12.0)
    assert least_capacity_stage([[fast], [slow, slow], [fast, fast]]) == 0
    # [2, 1, 3], the layout a CI run drew: stage 1 gets the next peer.
    assert least_capacity_stage([[slow, slow], [fast], [slow, slow, slow]]) == 1
    # Of two stages short of a replica, the one with less capacity.
    assert least_capacity_stage([[fast], [slow], [fast, fast]]) == 1
    assert least_capacity_stage([[fast], [slow], [fast, fast]], replicas=1) == 1
    assert least_capacity_stage([[fast], [slow, slow], [fast]], replicas=1) == 1


def test_pipeline_options_are_checked() -> None:
    options = resolve_pipeline_options({"stages": 3}, batch_size=8)
    assert options == {"stages": 3, "global_batch": 64, "lag": 1, "codec": "int8",
                       "rebalance_s": 30.0, "min_stage_peers": 1, "verify": True,
                       "max_grad_norm": None}  # fmt: skip
    for bad, message in [
        ({"stages": 1}, "stages"),
        ({"stages": 3, "global_batch": 4}, "global_batch"),
        ({"stages": 3, "lag": -1}, "lag"),
        ({"stages": 3, "codec": "zip"}, "codec"),
        ({"stages": 3, "colour": 1}, "colour"),
        ({"stages": 3, "rebalance_s": 0.5}, "rebalance_s"),
        ({"stages": 3, "rebalance_s": "often"}, "rebalance_s"),
        ({"stages": 3, "min_stage_peers": 0}, "min_stage_peers"),
        ({"stages": 3, "verify": "yes"}, "verify"),
        ({"stages": 3, "max_grad_norm": 0}, "max_grad_norm"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_pipeline_options(bad, batch_size=8)
