"""Codecs for all-reduce parts: exactness, error bounds, wire layout, hostile bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shoal.averaging.compression import (
    CODECS,
    BFloat16Codec,
    Codec,
    CodecError,
    Float16Codec,
    Int4BlockCodec,
    Int8BlockCodec,
    NoCodec,
    get_codec,
)

ALL_CODECS = [
    *CODECS.values(),
    Int8BlockCodec(16),
    Int8BlockCodec(64),
    Int8BlockCodec(4096),
    Int4BlockCodec(16),
    Int4BlockCodec(256),
]
FP16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
F32_MAX = float(np.finfo(np.float32).max)


def ids(codec: Codec) -> str:
    return codec.name


def roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    y = torch.full_like(x, 12345.0)
    codec.decode(codec.encode(x), y)
    return y


def int8_bound(codec: Int8BlockCodec, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound absmax/254 of the element's block, plus float32 rounding slack.

    With s = fl(absmax / 127), q = rint(fl(x / s)) and y = fl(q * s), each of the three
    roundings is at most 2^-24 relative, on values up to 127 s, so
    |y - x| <= s/2 + 2 * 127 s * 2^-24 = absmax/254 * (1 + 3.1e-5), and the float32
    subtraction that measures it adds 2^-24 more: 4e-5 covers all of it. (1e-5 did not:
    about 1 input in 700 of the test below came out a few ulps over.)"""
    bs = codec.block_size
    pad = (-x.numel()) % bs
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, bs).amax(dim=1)
    per_element = absmax.repeat_interleave(bs)[: x.numel()]
    return per_element / 254 * (1 + 4e-5) + 1.5e-36


# --- registry -------------------------------------------------------------------------


def test_registry_has_the_five_codecs_with_distinct_codes() -> None:
    assert set(CODECS) == {"none", "fp16", "bf16", "int8", "int4"}
    assert isinstance(CODECS["none"], NoCodec)
    assert isinstance(CODECS["fp16"], Float16Codec)
    assert isinstance(CODECS["bf16"], BFloat16Codec)
    assert type(CODECS["int8"]) is Int8BlockCodec
    assert CODECS["int8"].block_size == 256
    assert isinstance(CODECS["int4"], Int4BlockCodec)
    assert CODECS["int4"].block_size == 64 and CODECS["int4"].code == 0x26
    assert len({c.code for c in CODECS.values()}) == 5
    assert all(0 <= c.code <= 0xFF for c in CODECS.values())


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_get_codec_finds_every_codec_by_name_and_by_wire_code(codec: Codec) -> None:
    assert get_codec(codec.name) == codec
    assert get_codec(codec.code) == codec
    assert get_codec(codec.code).encoded_size(1000) == codec.encoded_size(1000)


def test_int8_block_size_is_part_of_the_wire_code() -> None:
    assert Int8BlockCodec(256).code == 0x18
    assert Int8BlockCodec(64).code == 0x16
    assert get_codec(0x16).block_size == 64
    assert get_codec("int8-256") == get_codec("int8")


@pytest.mark.parametrize(
    "bad", ["", "zstd", "int8-100", "int8-8", "int8-x", 7, 0x10, 0x13, 0x20, -1, 256]
)
def test_unknown_codec_names_and_codes_raise_codec_error(bad: str | int) -> None:
    with pytest.raises(CodecError):
        get_codec(bad)


@pytest.mark.parametrize("block_size", [0, 8, 100, 1 << 16, True, 256.0])
def test_int8_rejects_block_sizes_that_are_not_supported_powers_of_two(block_size: int) -> None:
    with pytest.raises(ValueError):
        Int8BlockCodec(block_size)


# --- sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 255, 256, 257, 1000, 4096, 100_003])
def test_encoded_size_is_exact_for_every_codec(n: int) -> None:
    x = torch.randn(n)
    for codec in ALL_CODECS:
        assert len(codec.encode(x)) == codec.encoded_size(n)


def test_encoded_sizes_follow_the_documented_layouts() -> None:
    assert get_codec("none").encoded_size(1000) == 4000
    assert get_codec("fp16").encoded_size(1000) == 2000
    assert get_codec("bf16").encoded_size(1000) == 2000
    assert get_codec("int8").encoded_size(1000) == 4 * 4 + 1000
    assert get_codec("int8").encoded_size(0) == 0
    assert Int8BlockCodec(64).encoded_size(64) == 4 + 64


def test_int8_puts_at_most_0_3_times_the_float32_bytes_on_the_wire() -> None:
    n = 10_000_000
    assert get_codec("int8").encoded_size(n) / get_codec("none").encoded_size(n) < 0.26
    assert Int8BlockCodec(32).encoded_size(n) / (4 * n) <= 0.3


def test_encoded_size_rejects_negative_counts() -> None:
    with pytest.raises(ValueError):
        get_codec("int8").encoded_size(-1)


# --- round trips ---------------------------------------------------------------------


def test_none_round_trip_is_exact_including_nan_inf_and_signed_zero() -> None:
    x = torch.tensor([1.5, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, F32_MAX])
    y = roundtrip(get_codec("none"), x)
    assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def test_none_encode_without_out_is_a_view_of_the_tensor_storage() -> None:
    x = torch.zeros(4)
    view = get_codec("none").encode(x)
    x[1] = 2.0
    assert bytes(view[4:8]) == struct.pack("<f", 2.0)


def test_fp16_relative_error_is_within_half_an_ulp() -> None:
    x = torch.randn(10_000) * torch.logspace(-6, 4, 10_000)
    err = (roundtrip(get_codec("fp16"), x) - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2**-11, torch.tensor(2**-25))).all())


def test_bf16_relative_error_is_within_half_an_ulp() -> None:
    x = torch.randn(10_000) * torch.logspace(-30, 30, 10_000)
    err = (roundtrip(get_codec("bf16"), x) - x).abs()
    assert bool((err <= x.abs() * 2**-8).all())


def test_fp16_clamps_finite_values_beyond_its_range_and_keeps_nan_and_inf() -> None:
    x = torch.tensor([1e6, -1e6, 65519.0, 70000.0, float("inf"), -float("inf"), float("nan"), 3.0])
    y = roundtrip(get_codec("fp16"), x)
    assert y[:4].tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX, FP16_MAX]
    assert y[4] == float("inf") and y[5] == -float("inf")
    assert torch.isnan(y[6]) and y[7] == 3.0


def test_fp16_clamps_even_when_the_same_slice_holds_a_nan() -> None:
    y = roundtrip(get_codec("fp16"), torch.tensor([float("nan"), 1e9]))
    assert torch.isnan(y[0]) and y[1] == FP16_MAX


def test_bf16_clamps_values_that_would_round_up_to_inf() -> None:
    y = roundtrip(get_codec("bf16"), torch.tensor([F32_MAX, -F32_MAX, 1.0]))
    assert y.tolist() == [BF16_MAX, -BF16_MAX, 1.0]


@pytest.mark.parametrize("block_size", [16, 64, 256, 1024])
def test_int8_error_is_at_most_a_254th_of_the_block_absmax(block_size: int) -> None:
    codec = Int8BlockCodec(block_size)
    g = torch.Generator().manual_seed(block_size)
    x = torch.randn(50_000, generator=g) * torch.logspace(-3, 3, 50_000)
    err = (roundtrip(codec, x) - x).abs()
    assert bool((err <= int8_bound(codec, x)).all())


def numpy_blocks(x: np.ndarray, block_size: int, qmax: int) -> tuple[bytes, np.ndarray]:
    """The scales (bytes) and codes of a block codec with codes in [-qmax, qmax],
    computed the plain way, block by block, in numpy float32."""
    tiny, top = np.finfo(np.float32).tiny, np.float32(qmax)
    max_scale = np.float32(F32_MAX) / top
    with np.errstate(over="ignore"):
        while not np.isfinite(max_scale * top):
            max_scale = np.nextafter(max_scale, np.float32(0))
    scales, codes = [], []
    for start in range(0, len(x), block_size):
        block = x[start : start + block_size]
        s = min(np.float32(np.abs(block).max()) / top, max_scale)
        s = s if s >= tiny else np.float32(0)
        scales.append(s)
        q = np.clip(np.rint(block / (s if s else np.float32(1))), -qmax, qmax)
        codes.append(q.astype(np.int8))
    return np.array(scales, "<f4").tobytes(), np.concatenate(codes)


def numpy_int8(x: np.ndarray, block_size: int) -> bytes:
    """The int8 layout computed the plain way."""
    scales, codes = numpy_blocks(x, block_size, 127)
    return scales + codes.tobytes()


@pytest.mark.parametrize("block_size", [16, 256, 4096])
def test_int8_encoding_equals_the_plain_numpy_formulation_bit_for_bit(block_size: int) -> None:
    # Many blocks, a short last block, zero and flushed blocks, the largest float.
    n = 3 * (1 << 18) + block_size // 2 + 3
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    x *= torch.logspace(-30, 30, n)
    x[block_size : 2 * block_size] = 0.0
    x[5 * block_size : 6 * block_size] *= 1e-40  # flushed to zero
    x[-1] = F32_MAX
    assert bytes(Int8BlockCodec(block_size).encode(x)) == numpy_int8(x.numpy(), block_size)


def test_int8_handles_a_length_that_is_not_a_multiple_of_the_block() -> None:
    codec = Int8BlockCodec(64)
    x = torch.randn(64 * 3 + 5)
    x[-5:] *= 1000  # the short last block has its own scale
    y = roundtrip(codec, x)
    assert bool(((y - x).abs() <= int8_bound(codec, x)).all())


def test_int8_zero_blocks_decode_to_exact_zeros() -> None:
    x = torch.zeros(600)
    x[300] = 5.0
    y = roundtrip(get_codec("int8"), x)
    assert torch.equal(y[:256], torch.zeros(256)) and torch.equal(y[512:], torch.zeros(88))
    assert y[300] == 5.0


def test_int8_keeps_the_block_absmax_and_rounds_half_to_even() -> None:
    x = torch.tensor([127.0, -63.5, 1.0, 0.5, -0.5])
    y = roundtrip(Int8BlockCodec(16), x)
    assert y.tolist() == [127.0, -64.0, 1.0, 0.0, -0.0]  # round half to even


def test_int8_extreme_magnitudes_decode_finite_and_never_subnormal() -> None:
    x = torch.tensor([F32_MAX, -F32_MAX, 1.0] + [0.0] * 13 + [1e-37, -1e-38] + [0.0] * 14)
    y = roundtrip(Int8BlockCodec(16), x)
    assert bool(torch.isfinite(y).all())
    assert y[0] > 0.999 * F32_MAX and y[1] < -0.999 * F32_MAX
    assert torch.equal(y[16:], torch.zeros(16))  # absmax below 127 * FLT_MIN: flushed to zero
    tiny = y[y != 0].abs()
    assert bool((tiny >= torch.finfo(torch.float32).tiny).all())


def test_int8_wire_layout_is_float32_scales_then_int8_codes() -> None:
    data = Int8BlockCodec(16).encode(torch.tensor([1.0, -0.5, 0.25, -127.0]))
    assert bytes(data) == struct.pack("<f", 1.0) + bytes([1, 0, 0, 0x81])


# --- int4 ---------------------------------------------------------------------------------


def numpy_int4(x: np.ndarray, block_size: int) -> bytes:
    """The int4 layout computed the plain way: int8's formulation with 7 levels a side,
    then the codes packed two to a byte, low nibble first."""
    scales, codes = numpy_blocks(x, block_size, 7)
    nibbles = codes.astype(np.uint8) & 0x0F
    if len(nibbles) % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return scales + packed.astype(np.uint8).tobytes()


@pytest.mark.parametrize("block_size", [16, 64, 4096])
def test_int4_encoding_equals_the_plain_numpy_formulation_bit_for_bit(block_size: int) -> None:
    n = 3 * (1 << 16) + block_size // 2 + 3  # odd, with a short last block
    x = torch.randn(n, generator=torch.Generator().manual_seed(6))
    x *= torch.logspace(-30, 30, n)
    x[block_size : 2 * block_size] = 0.0
    x[5 * block_size : 6 * block_size] *= 1e-40  # flushed to zero
    x[-1] = F32_MAX
    assert bytes(Int4BlockCodec(block_size).encode(x)) == numpy_int4(x.numpy(), block_size)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_int4_error_is_at_most_a_14th_of_the_block_absmax(block_size: int) -> None:
    codec = Int4BlockCodec(block_size)
    x = torch.randn(20_001, generator=torch.Generator().manual_seed(block_size))
    x *= torch.logspace(-3, 3, 20_001)
    bs = block_size
    pad = (-x.numel()) % bs
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, bs).amax(dim=1)
    bound = absmax.repeat_interleave(bs)[: x.numel()] / 14 * (1 + 4e-5) + 1.5e-36
    assert bool(((roundtrip(codec, x) - x).abs() <= bound).all())


def test_int4_puts_about_a_seventh_of_the_float32_bytes_on_the_wire() -> None:
    n = 1 << 20
    assert get_codec("int4").encoded_size(n) == 4 * n // 64 + n // 2
    assert get_codec("int4").encoded_size(n) / get_codec("none").encoded_size(n) < 0.15
    assert get_codec("int4").encoded_size(3) == 4 + 2


def test_int4_wire_layout_is_float32_scales_then_codes_low_nibble_first() -> None:
    data = Int4BlockCodec(16).encode(torch.tensor([7.0, -1.0, 3.5, -7.0, 1.0]))
    # codes 7, -1, 4 (3.5 rounds half to even), -7, 1; -1 = 0xF, -7 = 0x9; a zero tail nibble
    assert bytes(data) == struct.pack("<f", 1.0) + bytes([0xF7, 0x94, 0x01])


@pytest.mark.parametrize(
    ("offset", "byte", "why"),
    [(4, 0x08, "-8"), (5, 0x80, "-8"), (6, 0x10, "nibble")],
    ids=["minus-8-low", "minus-8-high", "odd-tail"],
)
def test_int4_non_canonical_codes_are_rejected(offset: int, byte: int, why: str) -> None:
    codec = Int4BlockCodec(16)
    data = bytearray(codec.encode(torch.randn(5)))
    data[offset] = byte
    with pytest.raises(CodecError, match=why):
        codec.decode(bytes(data), torch.empty(5))


def test_int4_invalid_scale_raises_codec_error() -> None:
    codec = Int4BlockCodec(16)
    data = bytearray(codec.encode(torch.randn(40)))
    for scale in (float("nan"), -1.0, 1e-40, F32_MAX):
        data[4:8] = struct.pack("<f", scale)
        with pytest.raises(CodecError, match="block 1"):
            codec.decode(bytes(data), torch.empty(40))


@given(
    values=arrays(np.float32, st.integers(0, 300), elements=st.floats(-1e6, 1e6, width=32)),
    block_size=st.sampled_from([16, 64]),
)
@settings(max_examples=60, deadline=None)
def test_int4_property_every_decoding_path_agrees_and_encoding_is_deterministic(
    values: np.ndarray, block_size: int
) -> None:
    codec = Int4BlockCodec(block_size)
    x = torch.from_numpy(values.copy())
    data = bytes(codec.encode(x))
    assert bytes(Int4BlockCodec(block_size).encode(x)) == data
    y = torch.empty(len(values))
    codec.decode(data, y)
    again = torch.empty(len(values))
    codec.add_decoded(data, again, 1.0, overwrite=True)
    assert torch.equal(y, again)
    if len(values):
        assert bool(((y - x).abs() <= x.abs().max() / 14 * (1 + 4e-5) + 1.5e-36).all())


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_empty_tensor_encodes_to_no_bytes_and_decodes(codec: Codec) -> None:
    data = codec.encode(torch.empty(0))
    assert len(data) == 0
    codec.decode(data, torch.empty(0))
    codec.decode(b"", torch.empty(0))


# --- determinism and bit-identical decoding ------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_encoding_is_deterministic_across_calls_and_instances(codec: Codec) -> None:
    x = torch.randn(3001) * 100
    first = bytes(codec.encode(x))
    assert bytes(codec.encode(x.clone())) == first
    assert bytes(get_codec(codec.code).encode(x)) == first


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_every_member_decodes_the_same_bytes_to_bit_identical_tensors(codec: Codec) -> None:
    data = bytes(codec.encode(torch.randn(3001) * 10))
    outs = [torch.empty(3001) for _ in range(3)]
    codec.decode(data, outs[0])  # read-only bytes
    codec.decode(bytearray(data), outs[1])  # writable receive buffer (other code path)
    codec.decode(memoryview(data), outs[2])
    for out in outs[1:]:
        assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_encode_into_a_preallocated_buffer_returns_it(codec: Codec) -> None:
    x = torch.randn(1000)
    buf = bytearray(codec.encoded_size(1000))
    out = memoryview(buf)
    assert codec.encode(x, out) is out
    assert bytes(buf) == bytes(codec.encode(x))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_parts_of_a_flat_buffer_encode_and_decode_in_place(codec: Codec) -> None:
    # All-reduce codes slices of one flattened tensor: views with a storage offset.
    flat = torch.randn(1000)
    part = flat[300:700]
    assert bytes(codec.encode(part)) == bytes(codec.encode(part.clone()))
    result = torch.zeros(1000)
    codec.decode(codec.encode(part), result[300:700])
    assert torch.equal(result[300:700], roundtrip(codec, part.clone()))
    assert not result[:300].any() and not result[700:].any()


# --- misuse and hostile bytes ---------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_truncated_or_extended_data_raises_codec_error(codec: Codec) -> None:
    data = bytes(codec.encode(torch.randn(300)))
    for bad in (data[:-1], data + b"\0", b"", data[: len(data) // 2]):
        with pytest.raises(CodecError):
            codec.decode(bad, torch.empty(300))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_data_for_a_different_length_raises_codec_error(codec: Codec) -> None:
    data = codec.encode(torch.randn(300))
    for n in (0, 299, 301, 600):
        if codec.encoded_size(n) != len(data):
            with pytest.raises(CodecError):
                codec.decode(data, torch.empty(n))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=ids)
def test_output_buffer_of_the_wrong_size_raises_codec_error(codec: Codec) -> None:
    with pytest.raises(CodecError):
        codec.encode(torch.randn(10), memoryview(bytearray(codec.encoded_size(10) + 1)))


def test_read_only_output_buffer_is_refused() -> None:
    with pytest.raises(TypeError):
        get_codec("fp16").encode(torch.randn(10), memoryview(bytes(20)))


@pytest.mark.parametrize(
    "tensor",
    [torch.randn(4, dtype=torch.float64), torch.randn(4).half(), [1.0, 2.0]],
    ids=["float64", "float16", "list"],
)
def test_src_of_the_wrong_type_raises_type_error(tensor: object) -> None:
    with pytest.raises(TypeError):
        get_codec("int8").encode(tensor)  # type: ignore[arg-type]


def test_src_that_is_not_flat_and_contiguous_raises_value_error() -> None:
    with pytest.raises(ValueError):
        get_codec("none").encode(torch.randn(2, 3))
    with pytest.raises(ValueError):
        get_codec("none").encode(torch.randn(10)[::2])


@pytest.mark.parametrize(
    "scale",
    [float("nan"), float("inf"), -float("inf"), -1.0, -0.0, 1e-40, F32_MAX, 3e36],
    ids=["nan", "inf", "-inf", "negative", "negative-zero", "subnormal", "max", "overflows"],
)
def test_int8_invalid_scale_raises_codec_error_and_leaves_out_untouched(scale: float) -> None:
    codec = Int8BlockCodec(16)
    data = bytearray(codec.encode(torch.randn(40)))
    data[4:8] = struct.pack("<f", scale)  # second block's scale
    out = torch.full((40,), 7.0)
    with pytest.raises(CodecError, match="block 1"):
        codec.decode(bytes(data), out)
    assert torch.equal(out, torch.full((40,), 7.0))


def test_int8_code_minus_128_is_rejected() -> None:
    codec = Int8BlockCodec(16)
    data = bytearray(codec.encode(torch.randn(16)))
    data[4 + 3] = 0x80
    with pytest.raises(CodecError):
        codec.decode(data, torch.empty(16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int8_encode_of_nan_or_inf_raises_codec_error_naming_the_block(bad: float) -> None:
    x = torch.randn(1000)
    x[600] = bad
    with pytest.raises(CodecError, match="block 2"):
        get_codec("int8").encode(x)


def test_int8_encode_of_nan_in_the_short_last_block_raises() -> None:
    x = torch.randn(300)
    x[-1] = float("nan")
    with pytest.raises(CodecError, match="block 1"):
        get_codec("int8").encode(x)


def test_non_bytes_data_raises_type_error() -> None:
    with pytest.raises(TypeError):
        get_codec("none").decode([0, 0, 0, 0], torch.empty(1))  # type: ignore[arg-type]


# --- properties -------------------------------------------------------------------------

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
vectors = arrays(np.float32, st.integers(0, 2000), elements=finite_f32)
moderate = arrays(
    np.float32,
    st.integers(0, 2000),
    elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False),
)


@settings(max_examples=60, deadline=None)
@given(vectors, st.sampled_from([16, 64, 256]))
def test_int8_property_error_bound_and_determinism(values: np.ndarray, block_size: int) -> None:
    codec = Int8BlockCodec(block_size)
    x = torch.from_numpy(values)
    data = bytes(codec.encode(x))
    assert len(data) == codec.encoded_size(x.numel())
    assert bytes(codec.encode(x)) == data
    y, y2 = torch.empty_like(x), torch.empty_like(x)
    codec.decode(data, y)
    codec.decode(bytearray(data), y2)
    assert torch.equal(y, y2)
    assert bool(torch.isfinite(y).all())
    assert bool(((y.double() - x.double()).abs() <= int8_bound(codec, x).double()).all())


@settings(max_examples=60, deadline=None)
@given(vectors)
def test_none_property_round_trip_is_bit_exact(values: np.ndarray) -> None:
    x = torch.from_numpy(values)
    assert torch.equal(roundtrip(get_codec("none"), x).view(torch.int32), x.view(torch.int32))


@settings(max_examples=60, deadline=None)
@given(moderate, st.sampled_from(["fp16", "bf16"]))
def test_half_codecs_property_bounded_error_and_stable_re_encoding(
    values: np.ndarray, name: str
) -> None:
    codec = get_codec(name)
    x = torch.from_numpy(values)
    data = bytes(codec.encode(x))
    y = torch.empty_like(x)
    codec.decode(data, y)
    rel, floor = (2**-11, 2**-25) if name == "fp16" else (2**-8, 2**-134)
    assert bool(((y - x).abs() <= torch.clamp(x.abs() * rel, min=floor)).all())
    assert bytes(codec.encode(y)) == data  # decoded values are exactly representable


@settings(max_examples=100, deadline=None)
@given(st.data(), st.sampled_from(ALL_CODECS), st.integers(0, 400))
def test_arbitrary_bytes_of_the_right_length_decode_finite_or_raise_codec_error(
    draw: st.DataObject, codec: Codec, n: int
) -> None:
    size = codec.encoded_size(n)
    data = draw.draw(st.binary(min_size=size, max_size=size))
    out = torch.empty(n)
    try:
        codec.decode(data, out)
    except CodecError:
        return
    if isinstance(codec, Int8BlockCodec):
        assert bool(torch.isfinite(out).all())


def test_half_codecs_wire_layout_is_little_endian_ieee() -> None:
    x = torch.tensor([1.0, -2.0])
    assert bytes(get_codec("fp16").encode(x)) == bytes.fromhex("003c00c0")
    assert bytes(get_codec("bf16").encode(x)) == bytes.fromhex("803f00c0")
    assert bytes(get_codec("none").encode(x)) == struct.pack("<2f", 1.0, -2.0)
