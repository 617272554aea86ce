"""Error feedback of the sparse codecs (averaging/error_feedback.py) and the DiLoCo
options that choose them."""

from __future__ import annotations

import pytest
import torch

from shoal.averaging import dct_basis, sparse_codec
from shoal.averaging.compression import CodecError
from shoal.averaging.diloco_options import MAX_DCT_CHUNK, SPARSE_INNER_STEPS, DiLoCoOptions
from shoal.averaging.error_feedback import ErrorFeedback, residual_digest
from shoal.averaging.options import SPARSE_CODEC_NAMES
from shoal.averaging.sparse_codec import SparseCodec
from shoal.peer.cli import parse_command_line
from shoal.peer.config import DEFAULT_INNER_STEPS
from shoal.peer.session import _new_settings
from shoal.peer.training.task import load_task

pytestmark = pytest.mark.timeout(30)

CODEC = SparseCodec("topk", 16, 2, 2)


def _delta(seed: int, n: int = 64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_compress_sends_the_decoded_message_and_commit_keeps_what_it_left_out() -> None:
    ef = ErrorFeedback(CODEC, 64)
    delta = _delta(1)
    original = delta.clone()
    message = ef.compress(delta)
    assert torch.equal(delta, CODEC.decode(message, 64))
    assert int((delta != 0).sum()) <= CODEC.kept(64)
    assert not ef.residual.any()  # nothing is carried before the round commits
    ef.commit()
    assert torch.equal(ef.residual, original - delta)


def test_the_residual_goes_into_the_next_message() -> None:
    ef = ErrorFeedback(CODEC, 64)
    ef.compress(_delta(1))
    ef.commit()
    carried = ef.residual.clone()
    second = _delta(2)
    message = ef.compress(second.clone())
    assert message == CODEC.encode(carried + second)


def test_over_many_rounds_everything_is_sent_but_the_last_residual() -> None:
    ef = ErrorFeedback(CODEC, 64)
    total_in, total_sent = (
        torch.zeros(64, dtype=torch.float64),
        torch.zeros(64, dtype=torch.float64),
    )
    for seed in range(20):
        delta = _delta(seed)
        total_in += delta.double()
        ef.compress(delta)
        ef.commit()
        total_sent += delta.double()
    assert torch.allclose(total_sent + ef.residual.double(), total_in, atol=1e-4)


def test_an_aborted_round_leaves_the_residual_as_it_was_and_a_resync_zeroes_it() -> None:
    ef = ErrorFeedback(CODEC, 64)
    ef.compress(_delta(1))
    ef.commit()
    before = ef.residual.clone()
    ef.compress(_delta(2))
    assert ef.open
    ef.abort()
    assert not ef.open
    assert torch.equal(ef.residual, before)
    ef.commit()  # nothing open: nothing changes
    assert torch.equal(ef.residual, before)
    ef.reset()
    assert not ef.residual.any()


def test_the_residual_round_trips_a_checkpoint_and_refuses_another_codec_or_shape() -> None:
    ef = ErrorFeedback(CODEC, 64)
    ef.compress(_delta(1))
    ef.commit()
    saved = ef.state_dict()
    restored = ErrorFeedback(CODEC, 64)
    restored.load_state_dict(saved)
    assert torch.equal(restored.residual, ef.residual)
    for bad, other in (
        (saved, ErrorFeedback(SparseCodec("topk", 16, 4, 2), 64)),
        (saved, ErrorFeedback(CODEC, 65)),
        ({**saved, "residual": torch.full((64,), float("nan"))}, ErrorFeedback(CODEC, 64)),
        ("junk", ErrorFeedback(CODEC, 64)),
    ):
        with pytest.raises(ValueError):
            other.load_state_dict(bad)


def test_a_pseudo_gradient_with_nan_cannot_be_compressed_and_nothing_changes() -> None:
    ef = ErrorFeedback(CODEC, 64)
    delta = _delta(1)
    delta[3] = float("nan")
    with pytest.raises(CodecError):
        ef.compress(delta)
    assert not ef.open
    assert not ef.residual.any()


def test_a_decaying_feedback_codes_what_it_keeps_of_the_residual_plus_the_delta() -> None:
    ef = ErrorFeedback(CODEC, 64, decay=0.9)
    ef.compress(_delta(1))
    ef.commit()
    carried = ef.residual.clone()
    second = _delta(2)
    message = ef.compress(second.clone())
    kept = carried * torch.tensor(0.9)  # rounded once, then the sum rounded again
    assert message == CODEC.encode(kept + second)
    ef.commit()
    assert torch.equal(ef.residual, kept + second - CODEC.decode(message, 64))


def test_a_feedback_that_keeps_nothing_sends_each_delta_alone() -> None:
    ef = ErrorFeedback(CODEC, 64, decay=0.0)
    ef.compress(_delta(1))
    ef.commit()
    assert ef.residual.any()  # what the round left out, forgotten by the next one
    second = _delta(2)
    assert ef.compress(second.clone()) == CODEC.encode(second)


@pytest.mark.parametrize("decay", [-0.1, 1.5, float("nan")])
def test_a_decay_outside_0_to_1_is_refused(decay: float) -> None:
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(CODEC, 64, decay=decay)


# ------------------------------------------------------------ options


def test_a_new_sparse_experiment_decays_its_feedback_and_takes_the_senders_mean() -> None:
    new = DiLoCoOptions.parse(DiLoCoOptions.for_new_experiment({"codec": "topk"}))
    assert (new.codec_feedback_decay, new.codec_mean) == (0.9, "senders")
    manifest = new.to_dict()  # what its manifest records, and reads back
    assert (manifest["codec_feedback_decay"], manifest["codec_mean"]) == (0.9, "senders")
    assert DiLoCoOptions.parse(manifest) == new
    # A manifest written before the options keeps the rules it was created with.
    old = DiLoCoOptions.parse({"codec": "topk"})
    assert (old.codec_feedback_decay, old.codec_mean) == (1.0, "members")
    assert "codec_mean" not in old.to_dict()
    # The flags still choose, and a dense experiment's manifest does not change.
    chosen = DiLoCoOptions.for_new_experiment({"codec": "dct", "codec_mean": "members"})
    assert (chosen["codec_mean"], chosen["codec_feedback_decay"]) == ("members", 0.9)
    assert chosen["inner_steps"] == SPARSE_INNER_STEPS
    given = DiLoCoOptions.for_new_experiment({"codec": "topk", "inner_steps": 50})
    assert given["inner_steps"] == 50
    dense = DiLoCoOptions.for_new_experiment({"codec": "int8", "verify": True})
    assert dense == {"codec": "int8", "verify": True}


def test_a_new_unverified_experiment_overlaps_its_rounds_with_the_next_steps() -> None:
    """A sparse round's latency (about a second) is most of what it costs, and a dense
    one's transfer: a new experiment spends them training, up to H - 1 steps; a
    verified one cannot overlap."""
    new = DiLoCoOptions.parse(DiLoCoOptions.for_new_experiment({"codec": "topk"}))
    assert new.overlap_steps == SPARSE_INNER_STEPS - 1
    assert new.to_dict()["overlap_steps"] == SPARSE_INNER_STEPS - 1  # the manifest keeps it
    given = DiLoCoOptions.for_new_experiment({"codec": "topk", "inner_steps": 8})
    assert given["overlap_steps"] == 7
    chosen = DiLoCoOptions.for_new_experiment({"codec": "topk", "overlap_steps": 0})
    assert chosen["overlap_steps"] == 0
    verified = DiLoCoOptions.parse(
        DiLoCoOptions.for_new_experiment({"codec": "topk", "verify": True})
    )
    assert verified.overlap_steps == 0 and "overlap_steps" not in verified.to_dict()
    # Dense rounds overlap alike, at the dense H (50 unless given).
    assert DiLoCoOptions.for_new_experiment({"codec": "int8"})["overlap_steps"] == 49
    assert DiLoCoOptions.for_new_experiment({"verify": False})["overlap_steps"] == 49
    assert DiLoCoOptions.for_new_experiment({"inner_steps": 5})["overlap_steps"] == 4
    dense = DiLoCoOptions.for_new_experiment({"codec": "int8", "verify": True})
    assert "overlap_steps" not in dense
    # A manifest written before the option: no overlap.
    assert DiLoCoOptions.parse({"codec": "topk"}).overlap_steps == 0
    assert DiLoCoOptions.parse({"codec": "int8"}).overlap_steps == 0


def test_a_hosted_sparse_experiment_writes_its_rules_into_the_manifest() -> None:
    task = load_task("bytegpt", {"d_model": 32})
    _, config = parse_command_line(["run", "--strategy-option", "codec=topk"], {})
    _, options, _ = _new_settings(config, task, "sparse")
    assert options["codec_feedback_decay"] == 0.9 and options["codec_mean"] == "senders"
    assert options["overlap_steps"] == SPARSE_INNER_STEPS - 1  # --verify auto: unverified
    _, config = parse_command_line(["run", "--strategy-option", "codec=topk", "--verify", "on"], {})
    _, options, _ = _new_settings(config, task, "sparse")
    assert options["verify"] is True and "overlap_steps" not in options


def test_a_hosted_dense_experiment_overlaps_only_when_unverified() -> None:
    task = load_task("bytegpt", {"d_model": 32})
    _, config = parse_command_line(["run"], {})  # --verify auto: DiLoCo verifies
    _, options, _ = _new_settings(config, task, "dense")
    assert options["verify"] is True and "overlap_steps" not in options
    _, config = parse_command_line(["run", "--verify", "off", "--inner-steps", "30"], {})
    _, options, _ = _new_settings(config, task, "dense")
    assert options["verify"] is False and options["overlap_steps"] == 29


@pytest.mark.parametrize(
    ("args", "inner_steps"),
    [
        (["--strategy-option", "codec=topk"], SPARSE_INNER_STEPS),  # a sparse round is cheap
        (["--strategy-option", "codec=dct"], SPARSE_INNER_STEPS),
        (["--strategy-option", "codec=topk", "--inner-steps", "50"], 50),  # as given
        (["--strategy-option", "codec=int8"], DEFAULT_INNER_STEPS),
        ([], DEFAULT_INNER_STEPS),
        (["--inner-steps", "7"], 7),
    ],
)
def test_a_new_sparse_experiment_averages_every_ten_steps_unless_told(
    args: list[str], inner_steps: int
) -> None:
    task = load_task("bytegpt", {"d_model": 32})
    _, config = parse_command_line(["run", *args], {})
    _, options, _ = _new_settings(config, task, "h")
    assert options["inner_steps"] == inner_steps
    # The manifest records it, so the experiment keeps it whatever the defaults become.
    assert DiLoCoOptions.parse(options).inner_steps == inner_steps


def test_the_torch_free_sparse_names_and_bounds_match_the_codecs() -> None:
    assert SPARSE_CODEC_NAMES == sparse_codec.SPARSE_KINDS
    assert MAX_DCT_CHUNK == dct_basis.MAX_DCT_CHUNK


def test_the_default_codec_is_unchanged_and_the_sparse_options_stay_out_of_its_manifest() -> None:
    options = DiLoCoOptions.parse({})
    assert options.codec == "none" and not options.sparse
    assert not any(key.startswith("codec_") for key in options.to_dict())
    chosen = DiLoCoOptions.parse({"codec": "topk", "codec_density": 0.03125})
    assert chosen.to_dict()["codec_density"] == 0.03125
    assert DiLoCoOptions.parse(chosen.to_dict()) == chosen
    assert chosen.sparse_chunk == 4096
    assert DiLoCoOptions.parse({"codec": "dct"}).sparse_chunk == 256


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"codec": "zip"}, "'codec'"),
        ({"codec": "topk", "codec_density": 0.0}, "'codec_density'"),
        ({"codec": "topk", "codec_density": 0.75}, "'codec_density'"),
        ({"codec": "topk", "codec_bits": 9}, "'codec_bits'"),
        ({"codec": "topk", "codec_bits": 2.0}, "'codec_bits'"),
        ({"codec": "topk", "codec_chunk": 8}, "'codec_chunk'"),
        ({"codec": "dct", "codec_chunk": 4096}, "'codec_chunk'"),
        ({"codec": "topk", "codec_feedback_decay": 1.5}, "'codec_feedback_decay'"),
        ({"codec": "topk", "codec_feedback_decay": -0.5}, "'codec_feedback_decay'"),
        ({"codec": "topk", "codec_mean": "median"}, "'codec_mean'"),
    ],
)
def test_out_of_range_codec_options_are_refused_in_one_line(
    options: dict[str, object], names: str
) -> None:
    with pytest.raises(ValueError) as e:
        DiLoCoOptions.parse(options)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_a_verified_residual_carries_the_commitment_that_left_it_and_is_checkpointed() -> None:
    codec = SparseCodec("topk", 16, 2, 2)
    fb = ErrorFeedback(codec, 64)
    fb.require_chain = True
    delta = torch.randn(64, generator=torch.Generator().manual_seed(1))
    fb.compress(delta.clone())
    start, after = fb.claims()
    assert start == residual_digest(torch.zeros(64)) != after
    fb.propose_chain(b"commitment of round 1")
    fb.commit()
    assert fb.chain == b"commitment of round 1" and residual_digest(fb.residual) == after
    # An aborted round keeps the residual and its chain; its proposal is forgotten.
    fb.compress(delta.clone())
    fb.propose_chain(b"commitment of round 2")
    fb.abort()
    assert fb.chain == b"commitment of round 1" and residual_digest(fb.residual) == after
    restored = ErrorFeedback(codec, 64)
    restored.load_state_dict(fb.state_dict())
    assert restored.chain == fb.chain and torch.equal(restored.residual, fb.residual)
    # A commit without a commitment (a peer alone) cannot vouch for what it left out.
    fb.compress(delta.clone())
    fb.commit()
    assert fb.chain == b"" and not fb.residual.any()
