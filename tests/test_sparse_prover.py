"""What a verified sparse member keeps to reveal (`SparseProver`): each round's starting
residual, a model size. The newest stays in RAM, older ones go to a folder and come
back checked against the committed hash, and a byte budget bounds them all, as the
work log's states are bounded."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shoal.averaging.error_feedback import ErrorFeedback, residual_digest
from shoal.averaging.sparse_codec import SparseCodec
from shoal.peer.verify.sparse_work import SparseProver

pytestmark = pytest.mark.timeout(30)

CODEC = SparseCodec.from_density("topk", 64, 0.0625, 2)
N = 1024
ME = SimpleNamespace(short=lambda: "me")


def prover(**kwargs: object) -> tuple[SparseProver, ErrorFeedback]:
    feedback = ErrorFeedback(CODEC, N)
    source = SimpleNamespace(
        feedback=feedback, gather=None, own_slot=lambda _round_id, _me: (0, 2, b"slot")
    )
    return SparseProver(source, keep=2, retain_s=300.0, **kwargs), feedback  # type: ignore[arg-type]


def commit_round(p: SparseProver, feedback: ErrorFeedback, index: int) -> torch.Tensor:
    """Round `index` starts from a residual of its own and commits to it."""
    feedback.residual.fill_(float(index))
    residual = feedback.residual.clone()
    commitment = SimpleNamespace(
        residual=(residual_digest(residual), b""), encode=f"c{index}".encode, start=b"global"
    )
    p.committed(index, SimpleNamespace(round_id=b"r"), ME, commitment)  # type: ignore[arg-type]
    return residual


def test_older_residuals_are_spilled_read_back_and_bounded_by_the_budget(tmp_path: Path) -> None:
    folder = tmp_path / "residuals"
    p, feedback = prover(spill_dir=folder, retain_bytes=3 * N * 4)  # three residuals
    residuals = {i: commit_round(p, feedback, i) for i in range(1, 6)}
    # Rounds 1 and 2 went (past the budget, beyond the last 2), inside the audit window.
    assert p.kept(1) is None and p.kept(2) is None
    # Round 5, the newest, is in RAM; rounds 3 and 4 are on disk and come back whole.
    assert len(p.spilled_files()) == 2
    for i in (3, 4, 5):
        work = p.kept(i)
        assert work is not None and torch.equal(work.residual, residuals[i])
        assert work.slot == (0, 2, b"slot")


def test_a_spilled_residual_altered_on_disk_is_not_revealed(tmp_path: Path) -> None:
    p, feedback = prover(spill_dir=tmp_path / "residuals")
    commit_round(p, feedback, 1)
    commit_round(p, feedback, 2)
    (spilled,) = p.spilled_files()
    torch.save(torch.full((N,), 9.0), spilled)  # another residual than the committed one
    assert p.kept(1) is None
    spilled.unlink()
    assert p.kept(1) is None
    assert p.kept(2) is not None


def test_without_a_folder_residuals_stay_in_ram_within_the_budget() -> None:
    p, feedback = prover(retain_bytes=2 * N * 4)
    for i in range(1, 5):
        commit_round(p, feedback, i)
    assert p.spilled_files() == []
    assert [i for i in range(1, 5) if p.kept(i) is not None] == [3, 4]


def test_a_past_run_s_files_are_cleared(tmp_path: Path) -> None:
    folder = tmp_path / "residuals"
    folder.mkdir()
    (folder / "residual-0.pt").write_bytes(b"stale")
    p, _ = prover(spill_dir=folder)
    assert p.spilled_files() == []
