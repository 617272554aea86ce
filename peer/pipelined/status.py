"""What /status shows of a peer's part in a pipeline (`PipelineRun.status`)."""

from __future__ import annotations

from typing import Any

from shoal.pipeline.clip_exchange import ClipExchange

__all__ = ["oversized_refused", "run_status"]

STEPS_SHOWN = 256


def _last(steps: dict[int, int]) -> dict[str, int]:
    versions = sorted(steps)[-STEPS_SHOWN:]
    return {str(v): steps[v] for v in versions}


def run_status(run: Any) -> dict[str, Any]:
    """/status's `pipeline` object of `run` (a `run.PipelineRun`: typed loosely, since
    it imports this module)."""
    peer, loop = run.stage_peer, run.loop
    stages = []
    for s, records in enumerate(run.directory):
        speeds = [r.samples_per_s for r in records if r.samples_per_s]
        stages.append({
            "stage": s,
            "peers": len(records),
            "throughput": sum(speeds) if speeds else None,
            "peer_ids": [str(r.peer) for r in records],
            "version": max((r.version for r in records), default=None),
            **run.losses.status(s),  # (`lost`, `restored`: pipeline/stage_losses.py)
            # What serving the stage would cost us, by the estimate (bytes).
            "memory_bytes": None if run.budget is None else run.budget.cost(s).total,
        })  # fmt: skip
    served = dict(peer.server.served) if peer is not None else {"forward": 0, "backward": 0}
    driven = loop.trainer.counters.microbatches if loop is not None else 0
    budget = run.budget
    out = {
        "stage": None if peer is None else peer.stage,
        # What --max-memory allows (or the memory free when we started), and what
        # our stage costs by the estimate (pipeline/memory.py): bytes.
        "memory_budget_bytes": None if budget is None else budget.budget,
        "stage_memory_bytes": None
        if budget is None or peer is None
        else budget.cost(peer.stage).total,
        # How our stage is served to stay within the budget (`memory.fit_stage`): the
        # samples a pass takes (null: a computation in one pass), the answers kept, and
        # whether backwards are computed while a step averages.
        "stage_limits": None if peer is None else peer.limits.as_dict(),
        "trainer": loop is not None,
        "role": run.role,
        "stages": stages,
        "microbatches": driven if loop is not None else served["backward"],
        "served": served,
        "version": None if peer is None else peer.version,
        # The version the top-level `fingerprint` hashes (it lags `version` while a
        # step is applied): compare fingerprints of peers at one fingerprint_version.
        "fingerprint_version": None
        if peer is None
        else peer.optimizer.averager.last_fingerprint_commits,
        "serving": None if peer is None else peer.server.serving,
        "audits": _audits(run),
        # Moves to the stage that limited the pipeline: [from, to, UNIX time].
        "moves": None if run.mover is None else [list(m) for m in run.mover.moves],
        # Moves given up because another peer decided one at the same moment.
        "moves_given_way": None if run.mover is None else run.mover.moves_given_way,
        # Moves that failed (making or starting the new stage's peer): we then served
        # our stage again.
        "moves_failed": None if run.mover is None else run.mover.failed_moves,
        "syncs": None if peer is None else peer.syncs,
        # Global gradient clipping (manifest option max_grad_norm): the last step's
        # factor, steps clipped without some stage's norm, peers whose claim differed.
        "clipping": _clipping(run),
        # A trainer's held-out scorings: how many gave a loss, failed (and why the last
        # did), and how long the last few took.
        "validation": None if run.validation is None else run.validation.status(),
        "retries": None if loop is None else loop.trainer.counters.retries,
        "replayed": None if loop is None else sum(loop.trainer.ledger.replayed),
        "recovered": None if loop is None else loop.trainer.counters.recovered,
        "unfenced": None if loop is None else loop.trainer.counters.unfenced,
        # Requests (served stage) and answers (trainer) refused unread for holding
        # more than the stage's bounds: pipeline/bounds.py.
        "oversized_refused": oversized_refused(run),
        # Exactly-once accounting, for whoever checks it: samples this trainer
        # completed; a stage peer's step sizes (version -> samples, the last
        # STEPS_SHOWN) and the samples it holds for steps not taken yet.
        "samples": None if loop is None else loop.trainer.counters.samples,
        "step_samples": None if peer is None else _last(peer.optimizer.step_samples),
        "pending_samples": None
        if peer is None
        else peer.worker.samples_for(peer.version) + peer.worker.samples_for(peer.version + 1),
    }
    return run._view.extend(
        out,
        self_id=run.dht.peer_id,
        directory=run.directory,
        trainer=None if loop is None else loop.trainer,
        server=None if peer is None else peer.server,
    )


def _clipping(run: Any) -> dict[str, Any] | None:
    peer = run.stage_peer
    clip = None if peer is None else peer.optimizer.clip
    exchange = getattr(clip, "__self__", None)
    return exchange.status() if isinstance(exchange, ClipExchange) else None


def oversized_refused(run: Any) -> int:
    """Requests our stage refused, and answers our trainer refused, unread for
    holding more than the stage's bounds."""
    peer, loop = run.stage_peer, run.loop
    served = 0
    if peer is not None:
        audits = peer.server.audits.counts["oversized_refused"]
        served = peer.server.oversized_refused + audits
    return served + (0 if loop is None else loop.trainer.counters.oversized_refused)


def _audits(run: Any) -> dict[str, Any] | None:
    """What this trainer's audits of stage answers found (None: it audits none)."""
    auditor = None if run.loop is None else run.loop.trainer.auditor
    if auditor is None:
        return None
    return {
        "outcomes": dict(auditor.outcomes),  # audited answers by outcome, unsealed ones
        "convicted": sorted(str(p) for p in auditor.bans.bans.banned),
        "distrusted": sorted(str(p) for p in auditor.distrusted),
        "bytes": auditor.bytes_sent + auditor.commitment_bytes,
    }
