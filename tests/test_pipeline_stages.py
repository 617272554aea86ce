"""Stages of a task and the stage worker: the split is the model, backward can move peers."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from shoal.peer.training.tasks.bytegpt import make_task, split_layers
from shoal.pipeline.answers import GONE, AnswerStore
from shoal.pipeline.fencing import fence_answer
from shoal.pipeline.stage import StageWorker

TINY = {"d_model": 32, "n_layers": 3, "n_heads": 2, "context": 32, "batch_size": 8}


def test_layers_are_split_evenly_and_every_stage_has_one() -> None:
    assert split_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 1) == [(0, 4)]
    with pytest.raises(ValueError, match="each stage needs a layer"):
        split_layers(2, 3)


def test_stages_compose_to_the_untied_model_and_are_deterministic() -> None:
    task = make_task(TINY)
    whole = task.make_stages(7, 1)[0]
    parts = task.make_stages(7, 3)
    batch = next(task.batches(0, 1, 0))
    x = task.stage_inputs(batch)
    y = x
    for stage in parts:
        y = stage(y)
    assert torch.equal(y, whole(x))
    again = task.make_stages(7, 3)
    for a, b in zip(parts, again, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert sum(p.numel() for s in parts for p in s.parameters()) == sum(
        p.numel() for p in whole.parameters()
    )
    assert task.stage_loss(y, batch) > 0


def test_a_backward_served_by_another_peer_matches_local_autograd() -> None:
    task = make_task(TINY)
    stages = task.make_stages(3, 3)
    batch = next(task.batches(0, 1, 0))
    x0 = task.stage_inputs(batch)
    # local autograd through the three stages
    h1 = stages[0](x0)
    h1.retain_grad()
    h2 = stages[1](h1)
    h2.retain_grad()
    loss = task.stage_loss(stages[2](h2), batch)
    loss.backward()
    # the middle stage: forward on peer A, backward on peer B (its own copy)
    peer_a = StageWorker(copy.deepcopy(stages[1]))
    peer_b = StageWorker(copy.deepcopy(stages[1]))
    out = peer_a.forward(h1.detach())
    assert torch.allclose(out, h2.detach(), rtol=1e-6, atol=1e-7)
    grad_in = peer_b.backward("mb0", h1.detach(), h2.grad, samples=len(batch))
    assert torch.allclose(grad_in, h1.grad, rtol=1e-5, atol=1e-8)
    grads = peer_b.take_gradients()
    for acc, p in zip(grads.sums, stages[1].parameters(), strict=True):
        assert torch.allclose(acc / grads.samples, p.grad, rtol=1e-5, atol=1e-8)


def test_a_retried_backward_counts_once() -> None:
    task = make_task(TINY)
    stage = task.make_stages(1, 3)[1]
    worker = StageWorker(stage)
    h = torch.randn(4, 8, 32)
    g = torch.randn(4, 8, 32)
    first = worker.backward(("trainer", 5), h, g, samples=4)
    again = worker.backward(("trainer", 5), h, g, samples=4)
    assert again is first and worker.samples == 4
    sums = worker.take_gradients()
    assert sums.samples == 4 and sums.keys == {("trainer", 5)}
    assert worker.samples == 0


def test_a_retry_whose_answer_was_dropped_for_room_counts_once_and_gets_it_recomputed() -> None:
    """The worker keeps every applied key, but input gradients only within a byte
    bound: a retry of an older one is recomputed dry (counted once), and a fence
    of it reports the backward in doubt (the step log settles it)."""
    task = make_task(TINY)
    stage = task.make_stages(1, 3)[1]
    worker = StageWorker(stage)
    h, g = torch.randn(2, 4, 8, 32), torch.randn(2, 4, 8, 32)
    one = h[0].numel() * 4
    worker._answers.tensor_bytes = one  # (room for one answer)
    first = worker.backward(("trainer", 1), h[0], g[0], samples=4)
    worker.backward(("trainer", 2), h[1], g[1], samples=4)
    assert worker._answers.dropped == 1 and worker._answers.bytes == one
    again = worker.backward(("trainer", 1), h[0], g[0], samples=4)
    assert again is not first and torch.allclose(again, first)
    assert worker.samples == 8  # (the retry counted nothing)
    assert asyncio.run(fence_answer(worker, ("trainer", 1), b"attempt1")) == (None, False)
    applied, settled = asyncio.run(fence_answer(worker, ("trainer", 2), b"attempt2"))
    assert settled and applied is not None and applied[1] == 0


def test_a_computation_in_passes_of_fewer_samples_gives_the_same_answers_and_gradients() -> None:
    """Within a memory budget a worker computes in passes of at most `pass_samples`
    (`memory.fit_stage`): the outputs, input gradients and the bucket's sums are
    those of one pass (to float tolerance), and the samples count once."""
    task = make_task(TINY)
    stage = task.make_stages(1, 3)[1]
    whole, sliced = StageWorker(copy.deepcopy(stage)), StageWorker(stage, pass_samples=3)
    h, g = torch.randn(2, 4, 8, 32), torch.randn(2, 4, 8, 32)
    requests = [(("t", i), h[i], g[i], 4) for i in range(2)]  # 8 samples: passes of 3, 3, 2
    for got, want in zip(sliced.forward_many(list(h)), whole.forward_many(list(h)), strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    answers = zip(sliced.backward_many(requests), whole.backward_many(requests), strict=True)
    for got, want in answers:
        assert got is not None and want is not None and got[1] == want[1] == 0
        assert torch.allclose(got[0], want[0], rtol=1e-4, atol=1e-7)
    ours, theirs = sliced.take_gradients(), whole.take_gradients()
    assert ours.samples == theirs.samples == 8 and ours.keys == theirs.keys
    for a, b in zip(ours.sums, theirs.sums, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError):
        StageWorker(stage, pass_samples=0)


def test_a_pass_of_fewer_samples_keeps_that_much_less_for_its_backward() -> None:
    """What autograd keeps for a backward (the tensors a pass's forward saves, all held
    until its backward) is one pass's: a quarter with passes of 2 of 8 samples."""
    stage = make_task(TINY).make_stages(1, 3)[1]
    h, g = torch.randn(8, 8, 32), torch.randn(8, 8, 32)

    def most_kept(worker: StageWorker) -> int:
        kept: list[int] = []  # per pass
        params = {p.untyped_storage().data_ptr() for p in worker.params}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:  # (weights, views of them)
                kept[-1] += t.numel() * t.element_size()
            return t

        hook = worker.module.register_forward_pre_hook(lambda *_: kept.append(0))
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                worker.backward("k", h, g, samples=8)
        finally:
            hook.remove()
        return max(kept)

    one_pass = most_kept(StageWorker(copy.deepcopy(stage)))
    assert one_pass > 0
    assert most_kept(StageWorker(stage, pass_samples=2)) * 4 == one_pass


def test_the_answer_store_keeps_every_key_and_the_newest_gradients_within_its_bytes() -> None:
    store = AnswerStore(keys=3, tensor_bytes=100)
    for k in range(4):
        store.put(k, torch.zeros(10), epoch=k)  # 40 bytes each
    assert 0 not in store and len(store) == 3  # (keys: the newest 3)
    assert store.get(1) == (GONE, 1) and store.bytes == 80 and store.dropped == 2
    store.put(4, None, epoch=4)  # (ids in: no gradient)
    assert 1 not in store and store.bytes == 80
    store.put(5, torch.zeros(100), epoch=5)  # larger than the bound: the newest stays
    assert store.get(3) == (GONE, 3) and store.bytes == 400
    assert store.pop(5) is not None and store.bytes == 0


def _single_process(task, stages, streams, steps, microbatches):
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for m in range(microbatches):
            batch = next(streams[m])
            y = task.stage_inputs(batch)
            for s in stages:
                y = s(y)
            loss = task.stage_loss(y, batch) / microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses


def _swarm(task, stages, streams, steps, microbatches):
    """3 stages x 2 peers; forward on one peer, backward on the other; stage averaging."""
    peers = [[StageWorker(copy.deepcopy(s)) for _ in range(2)] for s in stages]
    opts = [[torch.optim.AdamW(w.module.parameters(), lr=3e-3) for w in stage] for stage in peers]
    losses = []
    for step in range(steps):
        total = 0.0
        for m in range(microbatches):
            batch = next(streams[m])
            n = len(batch)
            inputs, y = [], task.stage_inputs(batch)
            for s, stage in enumerate(peers):
                inputs.append(y)
                y = stage[(m + step + s) % 2].forward(y)
            y = y.detach().requires_grad_(True)
            loss = task.stage_loss(y, batch)
            loss.backward()
            total += float(loss.detach()) / microbatches
            grad = y.grad
            for s in reversed(range(len(peers))):
                worker = peers[s][(m + step + s + 1) % 2]  # not the forward's peer
                grad = worker.backward((step, m), inputs[s], grad, samples=n)
        losses.append(total)
        for stage, stage_opts in zip(peers, opts, strict=True):
            # the stage's all-reduce: a mean weighted by samples, the same on both peers
            taken = [w.take_gradients() for w in stage]
            samples = sum(g.samples for g in taken)
            mean = [sum(g.sums[i] for g in taken) / samples for i in range(len(taken[0].sums))]
            for w, opt in zip(stage, stage_opts, strict=True):
                for p, g in zip(w.module.parameters(), mean, strict=True):
                    p.grad = g.clone()
                opt.step()
    for stage in peers:
        for a, b in zip(stage[0].module.parameters(), stage[1].module.parameters(), strict=True):
            assert torch.equal(a, b)  # the peers of a stage hold the same parameters
    return losses


@pytest.mark.timeout(120)
def test_training_through_stages_matches_one_process() -> None:
    task = make_task(TINY)
    steps, microbatches = 60, 4
    reference = _single_process(
        task, task.make_stages(11, 3), [task.batches(m, 4, 5) for m in range(4)], steps, 4
    )
    swarm = _swarm(
        task,
        task.make_stages(11, 3),
        [task.batches(m, 4, 5) for m in range(4)],
        steps,
        microbatches,
    )
    assert reference[-1] < reference[0] - 0.5  # it learns
    tail_ref = sum(reference[-10:]) / 10
    tail_swarm = sum(swarm[-10:]) / 10
    assert tail_swarm == pytest.approx(tail_ref, rel=0.02)
