"""End to end: `shoal run --task hf` daemons train a tiny Llama on a local text folder.

The host trains the tokenizer on its data when it creates the experiment and pins the
data by its digest (so the experiment is verified); two joiners rebuild model and
tokenizer from the manifest and read the same folder. Their loss falls, they commit
equal fingerprints, and their audits of each other pass.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install shoal[hf])")
pytest.importorskip("tokenizers", reason="the hf extra is not installed (pip install shoal[hf])")

from shoal.peer.training.task import load_task

from .daemon_harness import ROUND_RE, Daemon, wait_for

pytestmark = pytest.mark.slow  # swarms of daemons

TINY_LLAMA = (
    "family=llama,hidden_size=32,num_hidden_layers=2,num_attention_heads=2,"
    "num_key_value_heads=2,intermediate_size=64,vocab_size=320,context=32,batch_size=4"
)
ROUNDS = {
    "SHOAL_INNER_STEPS": "10",
    # Every contribution audited (0.05 by default): the referees re-execute hf work.
    "SHOAL_STRATEGY_OPTIONS": "matchmaking_time=3,round_timeout=20,stall_timeout=3,audit_rate=1",
}
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "peers",
    "train",
    "one",
    "model",
]


def write_texts(folder: Path) -> Path:
    rng = random.Random(0)
    folder.mkdir()
    for i in range(4):
        lines = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(150))
        (folder / f"part{i}.txt").write_text(".\n".join(lines))
    return folder


def rounds_of_all(d: Daemon, peers: int) -> dict[int, str]:
    """outer step -> fingerprint of the rounds `d` committed in a group of `peers` or more."""
    return {int(m.group(1)): m.group(3) for m in ROUND_RE.finditer(d.log())
            if int(m.group(2)) >= peers}  # fmt: skip


def verification(d: Daemon) -> dict[str, Any]:
    return d.status()["verification"]  # type: ignore[no-any-return]


@pytest.mark.timeout(240)
def test_three_peers_train_a_tiny_llama_on_a_text_folder_with_a_tokenizer_trained_at_hosting(
    tmp_path: Path,
) -> None:
    texts = write_texts(tmp_path / "texts")
    # The host pins the folder by its digest (as with bytegpt): every peer has it, so
    # a referee can re-execute anyone's batches and the experiment is verified.
    options = dict(item.split("=") for item in TINY_LLAMA.split(","))
    task = load_task("hf", {k: int(v) if v.isdigit() else v for k, v in options.items()},
                     data=texts)  # fmt: skip
    digest = task.corpus.digest
    # A fresh model's loss (ln 320 = 5.77: it knows nothing yet), on the held-out batches.
    fresh = sum(task.loss(task.make_model(1), b).item() for b in task.eval_batches(4)) / 4
    task_options = f"{TINY_LLAMA},data_digest={digest}"
    args = ["--host-experiment", "tiny-llama", "--task", "hf", "--data", str(texts)]
    host = Daemon("host", tmp_path, args, {**ROUNDS, "SHOAL_TASK_OPTIONS": task_options})
    peers = [host]
    try:
        host.wait_ready()
        join = ["--join", host.join_ref, "--bootstrap", host.address, "--data", str(texts)]
        peers += [Daemon(name, tmp_path, join, ROUNDS) for name in ("alice", "bob")]
        for d in peers:
            d.wait_ready()
        wait_for("two rounds of the three peers on every peer",
                 lambda: all(len(rounds_of_all(d, 3)) >= 2 for d in peers), 150,
                 debug=lambda: "\n".join(d.tail(20) for d in peers))  # fmt: skip
        rounds = [rounds_of_all(d, 3) for d in peers]
        common = set.intersection(*(set(r) for r in rounds))
        assert common, rounds
        for step in common:
            assert len({r[step] for r in rounds}) == 1, (step, rounds)
        for d in peers:
            # 15 random words soon cost about ln 15 = 2.7 a token.
            status = d.status()
            assert fresh > 5.0 and status["loss"] < fresh - 1.5, (fresh, status["loss"])
            assert 0 < status["val_loss"] < fresh, (fresh, status["val_loss"])
            v = verification(d)
            assert v["enabled"] is True, v
            assert v["banned"] == [] and v["convictions"] == [] and v["audits_failed"] == 0, v
            assert d.alive()
        wait_for("an audit of hf work that passed",
                 lambda: sum(verification(d)["audits_passed"] for d in peers) >= 1, 60)  # fmt: skip
        assert all(verification(d)["audits_failed"] == 0 for d in peers)
    finally:
        for d in peers:
            d.kill()


@pytest.mark.timeout(240)
def test_the_same_experiment_as_a_two_stage_pipeline_trains_with_falling_loss(
    tmp_path: Path,
) -> None:
    """`--pipeline-stages 2`: the tiny Llama cut at its decoder layers, the embedding on
    stage 0 and the norm and output layer on stage 1, one peer each."""
    texts = write_texts(tmp_path / "texts")
    env = {"SHOAL_TASK_OPTIONS": TINY_LLAMA, "SHOAL_STRATEGY_OPTIONS": "inner_lr=3e-3"}
    args = ["--host-experiment", "piped-llama", "--task", "hf", "--data", str(texts)]
    host = Daemon("host", tmp_path, [*args, "--pipeline-stages", "2"], env)
    peers = [host]
    try:
        host.wait_ready()
        join = ["--join", host.join_ref, "--bootstrap", host.address, "--data", str(texts)]
        peers.append(Daemon("alice", tmp_path, join, {}))
        peers[1].wait_ready()
        served = sorted(d.status()["pipeline"]["stage"] for d in peers)
        assert served == [0, 1], served
        first = wait_for("the host's first loss", lambda: host.status()["loss"], 90,
                         debug=lambda: "\n".join(d.tail(20) for d in peers))  # fmt: skip
        wait_for("30 optimizer steps", lambda: host.status()["step"] >= 30, 120,
                 debug=lambda: "\n".join(d.tail(20) for d in peers))  # fmt: skip
        last = host.status()["loss"]
        # ln 320 = 5.77 before it learns; 15 random words cost about ln 15 = 2.7.
        assert first > 4.5 and last < first - 1.0, (first, last)
        assert all(d.alive() for d in peers)
    finally:
        for d in peers:
            d.kill()
