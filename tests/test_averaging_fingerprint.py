"""State fingerprints: equal state hashes equal, any difference changes the hash."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.averaging import fingerprint as fp_module
from shoal.averaging.fingerprint import (
    FingerprintReport,
    compare_fingerprints,
    state_fingerprint,
)


def make_state() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 5, generator=g),
        torch.randint(-100, 100, (7,), generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.tensor(2.5, dtype=torch.float64),
        torch.tensor([True, False]),
    ]


# --- state_fingerprint ------------------------------------------------------------------

# state_fingerprint([arange(6).reshape(2, 3) float32, [1, 2] int64], {"step": 3, "lr": 0.5}),
# checked against a by-hand hashlib/msgpack construction of the documented framing.
PINNED = "31d868d7a57b68390dfab75fcc44f15a52194135e250bf90f156fe6052080e83"


def test_fingerprint_is_a_hex_sha256() -> None:
    fp = state_fingerprint(make_state())
    assert len(fp) == 64 and int(fp, 16) >= 0


def test_fingerprint_format_is_pinned() -> None:
    # Peers on different versions compare these digests: a change here is a wire change.
    state = [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([1, 2], dtype=torch.int64),
    ]
    assert state_fingerprint(state, {"step": 3, "lr": 0.5}) == PINNED


def test_equal_state_gives_equal_fingerprints() -> None:
    meta = {"step": 10, "experiment": "mnist", "codec": ["int8", 256]}
    a = state_fingerprint(make_state(), meta)
    b = state_fingerprint([t.clone() for t in make_state()], dict(reversed(meta.items())))
    assert a == b


def test_fingerprint_depends_on_values_not_memory_layout() -> None:
    t = torch.randn(6, 8)
    assert state_fingerprint([t.t()]) == state_fingerprint([t.t().contiguous()])
    assert state_fingerprint([t[:, ::2]]) == state_fingerprint([t[:, ::2].clone()])


def test_requires_grad_and_conjugate_views_are_hashed_by_value() -> None:
    w = torch.randn(5, requires_grad=True)
    assert state_fingerprint([w]) == state_fingerprint([w.detach().clone()])
    z = torch.randn(4, dtype=torch.complex64)
    assert state_fingerprint([z.conj()]) == state_fingerprint([z.conj().resolve_conj()])
    assert state_fingerprint([z.conj()]) != state_fingerprint([z])


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(make_state()) - 1), st.data())
def test_flipping_any_single_bit_changes_the_fingerprint(index: int, data: st.DataObject) -> None:
    state = make_state()
    before = state_fingerprint(state)
    raw = state[index].reshape(-1).view(torch.uint8)
    bit = data.draw(st.integers(0, raw.numel() * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    assert state_fingerprint(state) != before


def test_same_bytes_with_another_shape_or_dtype_give_another_fingerprint() -> None:
    t = torch.arange(12, dtype=torch.float32)
    variants = [
        [t],
        [t.reshape(3, 4)],
        [t.reshape(4, 3)],
        [t.reshape(1, 12)],
        [t.view(torch.int32)],
        [t.view(torch.uint8)],
        [t.view(torch.bfloat16)],
        [t.view(torch.float16)],
        [t[:6], t[6:]],
        [t[:4], t[4:]],
        [t[6:], t[:6]],
        [t, torch.empty(0)],
        [torch.empty(0), t],
    ]
    fps = {state_fingerprint(v) for v in variants}
    assert len(fps) == len(variants)


def test_empty_and_zero_dim_tensors_are_distinguished() -> None:
    fps = {
        state_fingerprint([]),
        state_fingerprint([torch.empty(0)]),
        state_fingerprint([torch.empty(0, 3)]),
        state_fingerprint([torch.empty(0, dtype=torch.int64)]),
        state_fingerprint([torch.tensor(0.0)]),
        state_fingerprint([torch.zeros(1)]),
    }
    assert len(fps) == 6


@pytest.mark.parametrize(
    "other",
    [
        {"step": 11},
        {"step": 10, "extra": None},
        {"step": 10.0},
        {"step": True},
        {"step": "10"},
        {"Step": 10},
        {"step": [10]},
        {b"step": 10},
        {},
    ],
)
def test_any_metadata_change_changes_the_fingerprint(other: dict[object, object]) -> None:
    state = make_state()
    assert state_fingerprint(state, other) != state_fingerprint(state, {"step": 10})


def test_nested_metadata_is_canonical_regardless_of_key_order() -> None:
    a = {"opt": {"lr": 0.1, "betas": (0.9, 0.99)}, 1: "x", "z": None}
    b = {"z": None, 1: "x", "opt": {"betas": [0.9, 0.99], "lr": 0.1}}
    assert state_fingerprint([], a) == state_fingerprint([], b)


def test_no_metadata_is_the_same_as_empty_metadata() -> None:
    assert state_fingerprint(make_state()) == state_fingerprint(make_state(), {})


@pytest.mark.parametrize("meta", [{"x": {1, 2}}, {("a", "b"): 1}, {"x": object()}])
def test_metadata_without_a_canonical_form_raises_type_error(meta: dict[object, object]) -> None:
    with pytest.raises(TypeError):
        state_fingerprint([], meta)


def test_non_tensors_and_sparse_tensors_raise_type_error() -> None:
    with pytest.raises(TypeError):
        state_fingerprint([np.zeros(3)])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        state_fingerprint([torch.eye(3).to_sparse()])


def test_contiguous_cpu_tensors_are_hashed_in_place_without_a_copy() -> None:
    for t in (
        torch.randn(1000),
        torch.randn(10).to(torch.bfloat16),
        torch.ones(3, dtype=torch.bool),
    ):
        view = fp_module._raw_bytes(t)
        assert np.frombuffer(view, dtype=np.uint8).ctypes.data == t.data_ptr()
        assert len(view) == t.numel() * t.element_size()


def test_large_state_hashes_quickly() -> None:
    state = [torch.zeros(16 * 1024 * 1024)]  # 64 MiB
    assert len(state_fingerprint(state)) == 64


# --- compare_fingerprints -----------------------------------------------------------------


def test_all_equal_fingerprints_agree() -> None:
    report = compare_fingerprints({"a": "f1", "b": "f1", "c": "f1"})
    assert report == FingerprintReport(agreed=True, majority="f1", divergent=[])


def test_peers_outside_the_majority_are_divergent_in_input_order() -> None:
    report = compare_fingerprints({"d": "f2", "a": "f1", "b": "f1", "c": "f3", "e": "f1"})
    assert report == FingerprintReport(agreed=False, majority="f1", divergent=["d", "c"])


def test_without_a_strict_majority_no_reference_exists_and_everyone_diverges() -> None:
    report = compare_fingerprints({1: "f1", 2: "f1", 3: "f2", 4: "f2"})
    assert report == FingerprintReport(agreed=False, majority=None, divergent=[1, 2, 3, 4])
    report = compare_fingerprints({1: "f1", 2: "f2", 3: "f3"})
    assert report.majority is None and report.divergent == [1, 2, 3]


def test_single_peer_and_no_peers() -> None:
    assert compare_fingerprints({"a": "f"}) == FingerprintReport(True, "f", [])
    assert compare_fingerprints({}) == FingerprintReport(True, None, [])


def test_real_fingerprints_catch_one_diverged_member() -> None:
    states = {peer: make_state() for peer in ("p1", "p2", "p3")}
    states["p2"][0][1, 1] += 1e-6
    report = compare_fingerprints({p: state_fingerprint(s) for p, s in states.items()})
    assert not report.agreed and report.divergent == ["p2"]
    assert report.majority == state_fingerprint(make_state())


def test_a_big_endian_host_would_hash_little_endian_bytes() -> None:
    """The swap a big-endian host applies turns native bytes into the opposite order:
    here (little-endian) that gives the big-endian bytes, there the little-endian ones."""
    import sys

    from shoal.averaging.fingerprint import _little_endian_bytes

    t = torch.tensor([1.0, -2.5, 3.25], dtype=torch.float32)
    opposite = ">f4" if sys.byteorder == "little" else "<f4"
    assert _little_endian_bytes(t) == t.numpy().astype(opposite).tobytes()
    assert _little_endian_bytes(torch.tensor([7], dtype=torch.int16)) == (
        b"\x00\x07" if sys.byteorder == "little" else b"\x07\x00"
    )
