"""The sparse pseudo-gradient codecs (averaging/sparse_codec.py): sizes, determinism,
what they keep, and refusal of every malformed message."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from shoal.averaging import sparse_codec
from shoal.averaging.compression import CodecError
from shoal.averaging.dct_basis import dct_basis, dct_forward
from shoal.averaging.sparse_codec import SparseCodec
from shoal.averaging.sparse_gather import SparseGather
from shoal.transport.identity import Identity

pytestmark = pytest.mark.timeout(30)

TOPK = SparseCodec("topk", 64, 4, 2)
DCT = SparseCodec("dct", 64, 4, 2)


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("codec", [TOPK, DCT, SparseCodec("topk", 4096, 64, 2)])
@pytest.mark.parametrize("n", [1, 63, 64, 1000, 64 * 70 + 5])
def test_the_message_has_exactly_the_announced_size(codec: SparseCodec, n: int) -> None:
    data = codec.encode(_vector(n))
    assert len(data) == codec.encoded_size(n)
    assert codec.decode(data, n).shape == (n,)


def test_sixty_four_of_4096_at_two_bits_is_over_200_times_smaller_than_float32() -> None:
    codec = SparseCodec.from_density("topk", 4096, 0.015625, 2)
    n = 1 << 20
    assert codec.k == 64
    # Elias-Fano offsets (6 low bits each, a 128-bit upper bitmap per chunk: 8 bits an
    # offset where fields take 12) and 2-bit codes per kept value, plus a 16-byte table.
    assert codec.encoded_size(n) == 16 + (n // 4096) * 64 * (8 + 2) // 8
    assert 4 * n / codec.encoded_size(n) > 200


def test_topk_keeps_the_largest_values_of_every_chunk_and_zeroes_the_rest() -> None:
    x = torch.zeros(128)
    x[[3, 17, 40, 50]] = torch.tensor([5.0, -6.0, 0.5, 7.0])
    x[[70, 80, 90, 100, 127]] = torch.tensor([-1.0, 2.0, 3.0, -4.0, 0.1])
    message = SparseCodec("topk", 64, 4, 8).check(SparseCodec("topk", 64, 4, 8).encode(x), 128)
    assert message.indices.tolist() == [3, 17, 40, 50, 70, 80, 90, 100]
    # Eight bits and eight values: every value gets a bin of its own, exact.
    assert torch.equal(message.values, x[message.indices])


def test_ties_are_broken_by_the_lower_index_so_a_zero_chunk_keeps_its_first_entries() -> None:
    x = torch.zeros(64)
    x[[10, 20, 30, 40, 50]] = 1.0
    message = TOPK.check(TOPK.encode(x), 64)
    assert message.indices.tolist() == [10, 20, 30, 40]
    zeros = TOPK.check(TOPK.encode(torch.zeros(64)), 64)
    assert zeros.indices.tolist() == [0, 1, 2, 3]
    assert not zeros.values.any()


@pytest.mark.parametrize("codec", [TOPK, DCT])
def test_encoding_and_decoding_are_pure_functions_of_the_input(codec: SparseCodec) -> None:
    x = _vector(5000, seed=3)
    data = codec.encode(x)
    assert codec.encode(x.clone()) == data
    assert torch.equal(codec.decode(data, 5000), codec.decode(bytes(data), 5000))


def test_the_dct_basis_is_orthonormal_and_the_transform_matches_it() -> None:
    basis = dct_basis(64)
    assert torch.allclose(basis @ basis.T, torch.eye(64), atol=1e-6)
    rows = _vector(3 * 64).view(3, 64)
    assert torch.allclose(dct_forward(rows), rows @ basis.T, atol=1e-5)


def test_dct_reconstructs_a_smooth_chunk_from_few_coefficients() -> None:
    t = torch.arange(256, dtype=torch.float32)
    x = torch.cos(t * 3.14159 / 64) + 0.5  # smooth: its energy is in a few coefficients
    topk_error = (
        SparseCodec("topk", 64, 4, 4).decode(SparseCodec("topk", 64, 4, 4).encode(x), 256) - x
    ).norm()
    dct = SparseCodec("dct", 64, 4, 4)
    dct_error = (dct.decode(dct.encode(x), 256) - x).norm()
    assert dct_error < 0.2 * topk_error


def test_the_decoded_message_is_added_with_its_weight() -> None:
    x = _vector(300)
    data = TOPK.encode(x)
    message = TOPK.check(data, 300)
    out = torch.ones(300)
    TOPK.add_decoded(message, out, 0.25)
    assert torch.equal(out, 1.0 + TOPK.decode(data, 300) * torch.tensor(0.25))


@pytest.mark.parametrize(
    ("kind", "chunk", "k", "bits"),
    [("topk", 8, 1, 2), ("topk", 64, 0, 2), ("topk", 64, 33, 2), ("topk", 64, 4, 0),
     ("topk", 64, 4, 9), ("dct", 2048, 4, 2), ("lowrank", 64, 4, 2), ("topk", 64.0, 4, 2)],
)  # fmt: skip
def test_out_of_range_settings_are_refused(kind: str, chunk: int, k: int, bits: int) -> None:
    with pytest.raises(ValueError):
        SparseCodec(kind, chunk, k, bits)


def test_non_finite_or_huge_input_is_refused() -> None:
    for bad in (float("nan"), float("inf"), 2.0**70):
        x = torch.zeros(64)
        x[5] = bad
        with pytest.raises(CodecError):
            TOPK.encode(x)


# ------------------------------------------------------------ malformed messages


def _message(codec: SparseCodec = TOPK, n: int = 128) -> bytearray:
    return bytearray(codec.encode(_vector(n)))


def _refused(data: bytes | bytearray, codec: SparseCodec = TOPK, n: int = 128) -> str:
    with pytest.raises(CodecError) as e:
        codec.check(data, n)
    return str(e.value)


def test_a_message_of_the_wrong_length_is_refused() -> None:
    data = _message()
    assert "expected" in _refused(data[:-1])
    assert "expected" in _refused(data + b"\0")


def test_a_centroid_table_that_is_not_finite_bounded_and_sorted_is_refused() -> None:
    for table in ([0, 1, float("nan"), 2], [0, 1, 2, 2.0**70], [0, 2, 1, 3]):
        data = _message()
        data[:16] = np.array(table, dtype="<f4").tobytes()
        assert "table" in _refused(data)


def _offsets(data: bytearray, codec: SparseCodec = TOPK, n: int = 128) -> np.ndarray:
    width = codec._offset_bits
    count = codec.kept(n)
    raw = np.frombuffer(bytes(data[16 : 16 + -(-count * width // 8)]), dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little")[: count * width].reshape(count, width)
    return (bits.astype(np.int64) << np.arange(width)).sum(axis=1)


def _with_offsets(data: bytearray, offsets: list[int], codec: SparseCodec = TOPK) -> bytearray:
    width = codec._offset_bits
    planes = ((np.array(offsets)[:, None] >> np.arange(width)) & 1).astype(np.uint8)
    packed = np.packbits(planes.ravel(), bitorder="little").tobytes()
    data[16 : 16 + len(packed)] = packed
    return data


def test_indices_that_repeat_descend_or_leave_their_chunk_are_refused() -> None:
    offsets = _offsets(_message()).tolist()
    assert offsets == sorted(offsets[:4]) + sorted(offsets[4:])
    repeated = offsets[:]
    repeated[1] = repeated[0]
    assert "ascending" in _refused(_with_offsets(_message(), repeated))
    descending = [offsets[1], offsets[0], *offsets[2:]]
    assert "ascending" in _refused(_with_offsets(_message(), descending))
    # 6 bits cannot leave a chunk of 64; a tail chunk of 10 can be left.
    tail = _message(n=74)
    out_of_tail = _offsets(tail, n=74).tolist()
    out_of_tail[-1] = 12
    assert "past its chunk" in _refused(_with_offsets(tail, out_of_tail), n=74)


def test_a_bitmap_without_exactly_k_bits_or_with_bits_past_the_chunk_is_refused() -> None:
    codec = SparseCodec("topk", 16, 8, 2)  # 8 offsets of 4 bits > 16 bits: a bitmap
    assert codec._bitmap()
    data = bytearray(codec.encode(_vector(20)))
    one_more = bytearray(data)
    one_more[16] |= 0xFF
    one_more[17] |= 0xFF
    assert "exactly" in _refused(one_more, codec, 20)
    past_end = bytearray(data)
    past_end[18] |= 0x80  # the tail chunk is 4 long: bit 7 of its byte is past it
    assert "past the chunk" in _refused(past_end, codec, 20)


EF = SparseCodec("topk", 256, 8, 2)  # Elias-Fano: 8 x 5 low bits + 16 upper < 8 x 8 bits


def _with_ef_offsets(data: bytearray, blocks: list[tuple[list[list[int]], int]]) -> bytearray:
    """`data` (an EF message) with its offsets replaced: blocks of (rows, chunk length)."""
    coded = sparse_codec._ef_encode([(np.array(rows), length) for rows, length in blocks])
    data[16 : 16 + len(coded)] = coded
    return data


def test_elias_fano_offsets_decode_to_the_kept_entries_and_cost_their_bound() -> None:
    assert EF._scheme == "elias_fano" and TOPK._scheme == "fields"
    n = 256 * 3 + 10
    x = _vector(n, seed=3)
    decoded = EF.decode(EF.encode(x), n)
    kept = decoded != 0
    for a in range(0, n, 256):  # every chunk keeps its largest magnitudes
        b = min(a + 256, n)
        k = int(kept[a:b].sum())
        assert k == (8 if b - a == 256 else 1)
        assert x[a:b].abs()[kept[a:b]].min() >= x[a:b].abs()[~kept[a:b]].max()
    # 3 chunks of 56 bits, a tail of 10 keeping 1 (3 low bits, 3 upper bits): 25 bytes.
    assert EF.encoded_size(n) == 16 + -(-(3 * 56 + 6) // 8) + -(-25 * 2 // 8)


def test_elias_fano_offsets_that_repeat_descend_leave_their_chunk_or_miscount_are_refused() -> None:
    n = 256 * 2 + 10
    data = bytearray(EF.encode(_vector(n)))
    good = [list(range(0, 256, 32)), list(range(3, 256, 32))]
    assert EF.check(bytes(_with_ef_offsets(bytearray(data), [(good, 256), ([[4]], 10)])), n)
    repeated = [[5, 5, *good[0][2:]], good[1]]
    assert "ascending" in _refused(_with_ef_offsets(data, [(repeated, 256), ([[4]], 10)]), EF, n)
    descending = [[6, 5, *good[0][2:]], good[1]]
    assert "ascending" in _refused(
        _with_ef_offsets(bytearray(data), [(descending, 256), ([[4]], 10)]), EF, n
    )
    past = _with_ef_offsets(bytearray(data), [(good, 256), ([[12]], 10)])
    assert "past its chunk" in _refused(past, EF, n)
    # The first chunk's upper bitmap starts after the 2 x 8 x 5 + 3 low bits: one more bit.
    extra = _with_ef_offsets(bytearray(data), [(good, 256), ([[4]], 10)])
    first_upper = 2 * 8 * 5 + 3
    byte, bit = divmod(first_upper + 15, 8)
    assert not extra[16 + byte] >> bit & 1
    extra[16 + byte] |= 1 << bit
    assert "exactly" in _refused(extra, EF, n)


def test_non_zero_padding_bits_are_refused() -> None:
    data = _message(n=100)  # 4 + 3 kept values: 14 bits of codes in 2 bytes
    data[-1] |= 0x80
    assert "padding" in _refused(data, n=100)


# ------------------------------------------------------------ gathered slots


def _gathered(
    weights: list[float],
) -> tuple[SparseGather, list[Identity], torch.Tensor, list[bytes]]:
    """One buffer holding the union of every member's filled slot."""
    gather = SparseGather(TOPK, 200)
    members = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(len(weights))]
    messages = [TOPK.encode(_vector(200, seed=i)) for i in range(len(weights))]
    union = torch.zeros(gather.words(len(weights))).view(torch.int32)
    for slot, (me, w, m) in enumerate(zip(members, weights, messages, strict=True)):
        mine = torch.empty(gather.words(len(weights)))
        gather.fill(mine, b"round", slot, w, m, me.sign)
        union |= mine.view(torch.int32)
    return gather, members, union.view(torch.float32), messages


def test_the_gathered_mean_weighs_each_valid_slot_and_skips_the_others() -> None:
    gather, members, buffer, messages = _gathered([1.0, 3.0, 0.0])
    ids = [m.peer_id for m in members]
    mean = torch.empty(200)
    assert gather.mean_into(buffer, mean, b"round", ids) == []
    expected = TOPK.decode(messages[0], 200) * torch.tensor(0.25)
    expected = expected + TOPK.decode(messages[1], 200) * torch.tensor(0.75)
    assert torch.equal(mean, expected)
    # Another round's slots, or slots attributed to other members, are not theirs.
    assert gather.mean_into(buffer, mean, b"other", ids) == [0, 1]
    assert not mean.any()
    assert gather.mean_into(buffer, mean, b"round", [ids[1], ids[0], ids[2]]) == [0, 1]
    with pytest.raises(ValueError):
        gather.mean_into(buffer, mean, b"round", ids[:2])


def test_a_slot_claiming_an_impossible_weight_is_skipped() -> None:
    gather, members, buffer, _ = _gathered([1.0, 2.0])
    raw = buffer.view(torch.uint8)
    raw[:8] = torch.frombuffer(bytearray(struct.pack("<d", float("nan"))), dtype=torch.uint8)
    mean = torch.empty(200)
    assert gather.mean_into(buffer, mean, b"round", [m.peer_id for m in members]) == [0]
    with pytest.raises(ValueError):
        gather.fill(torch.empty(gather.words(2)), b"round", 0, 2.0**60, bytes(10), members[0].sign)


# ------------------------------------------------------------ the robust mean


@pytest.mark.parametrize("codec", [TOPK, DCT, SparseCodec("dct", 64, 4, 8)])
@pytest.mark.parametrize("n", [1, 64, 64 * 70 + 5])
def test_a_message_norm_is_exact_and_is_the_decoded_vectors(codec: SparseCodec, n: int) -> None:
    message = codec.check(codec.encode(_vector(n, seed=n) * 1e3), n)
    squares = message.values.double().square().tolist()  # float32 squared: exact in float64
    assert message.norm == math.sqrt(math.fsum(squares))  # correctly rounded, like fsum
    decoded = codec.decode(codec.encode(_vector(n, seed=n) * 1e3), n)
    assert message.norm == pytest.approx(float(decoded.double().norm()), rel=1e-5)


def _slots_of(
    vectors: list[torch.Tensor], n: int = 200
) -> tuple[SparseGather, list[Identity], torch.Tensor]:
    gather = SparseGather(TOPK, n)
    members = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(len(vectors))]
    union = torch.zeros(gather.words(len(vectors))).view(torch.int32)
    for slot, (me, v) in enumerate(zip(members, vectors, strict=True)):
        mine = torch.empty(gather.words(len(vectors)))
        gather.fill(mine, b"round", slot, 1.0, TOPK.encode(v), me.sign)
        union |= mine.view(torch.int32)
    return gather, members, union.view(torch.float32)


@pytest.mark.parametrize("attack", [1e3, -1e3])
def test_clipping_bounds_what_one_member_moves_the_mean_by(attack: float) -> None:
    honest = [_vector(200, seed=i) for i in range(3)]
    gather, members, buffer = _slots_of([*honest, _vector(200, seed=3) * attack])
    ids = [m.peer_id for m in members]
    clipped, plain = torch.empty(200), torch.empty(200)
    gather.mean_into(buffer, clipped, b"round", ids, clip=True)
    gather.mean_into(buffer, plain, b"round", ids)
    honest_mean = sum(TOPK.decode(TOPK.encode(v), 200) for v in honest) / 4
    one_honest = max(float(TOPK.decode(TOPK.encode(v), 200).norm()) for v in honest)
    # The attacker counts as at most one more honest-sized message (its share, a
    # quarter, of at most the median norm), plus the little clipped off the honest
    # messages longer than the median.
    assert float((clipped - honest_mean).norm()) <= 1.5 * one_honest / 4
    assert float((plain - honest_mean).norm()) > 100 * one_honest / 4  # the control


def test_clipping_changes_nothing_when_no_message_is_longer_than_the_median() -> None:
    same = [_vector(200, seed=5)] * 3  # three equal norms: the median, none above it
    gather, members, buffer = _slots_of([*same, _vector(200, seed=5) * 0.5])
    ids = [m.peer_id for m in members]
    clipped, plain = torch.empty(200), torch.empty(200)
    assert gather.mean_into(buffer, clipped, b"round", ids, clip=True) == []
    gather.mean_into(buffer, plain, b"round", ids)
    assert torch.equal(clipped, plain)


# ------------------------------------------------------------ the senders' mean


def _slots_with(
    codec: SparseCodec, vectors: list[torch.Tensor], weights: list[float], n: int
) -> tuple[SparseGather, list[bytes], torch.Tensor]:
    gather = SparseGather(codec, n)
    members = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(len(vectors))]
    union = torch.zeros(gather.words(len(vectors))).view(torch.int32)
    for slot, (me, v, w) in enumerate(zip(members, vectors, weights, strict=True)):
        mine = torch.empty(gather.words(len(vectors)))
        gather.fill(mine, b"round", slot, w, codec.encode(v), me.sign)
        union |= mine.view(torch.int32)
    return gather, [m.peer_id for m in members], union.view(torch.float32)


@pytest.mark.parametrize("codec", [TOPK, DCT])
@pytest.mark.parametrize("n", [64 * 5, 64 * 5 + 21])
def test_the_senders_mean_divides_each_coordinate_by_the_weight_of_those_that_sent_it(
    codec: SparseCodec, n: int
) -> None:
    vectors, weights = [_vector(n, seed=i) for i in range(3)], [1.0, 2.0, 5.0]
    gather, ids, buffer = _slots_with(codec, vectors, weights, n)
    mean = torch.empty(n)
    assert gather.mean_into(buffer, mean, b"round", ids, senders=True) == []
    # In the codec's own coordinates (dct: the coefficients), in float64.
    sums, sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for v, w in zip(vectors, weights, strict=True):
        message = codec.check(codec.encode(v), n)
        sums[message.indices] += message.values.double() * w
        sent[message.indices] += w
    expected = torch.where(sent > 0, sums / sent.clamp_min(1e-300), 0.0)
    if codec.kind == "dct":  # each chunk (and the tail) transformed back
        rows, chunks = [], [(s, min(s + 64, n)) for s in range(0, n, 64)]
        for start, end in chunks:
            rows.append(expected[start:end] @ dct_basis(end - start).double())
        expected = torch.cat(rows)
    assert torch.allclose(mean.double(), expected, atol=1e-5)
    # A coordinate only one member sent is that member's value, whatever its weight:
    # the members' mean would have divided it by the others' weight too.
    members_mean = torch.empty(n)
    gather.mean_into(buffer, members_mean, b"round", ids)
    assert not torch.allclose(mean, members_mean, atol=1e-3)
    again = torch.empty(n)  # every member decodes the same bits
    gather.mean_into(buffer, again, b"round", ids, senders=True)
    assert torch.equal(mean, again)


def test_a_coordinate_one_member_sent_is_its_value_in_the_senders_mean() -> None:
    n = 128
    alone, quiet = torch.zeros(n), torch.zeros(n)
    alone[[3, 70]] = torch.tensor([2.0, -3.0])  # every kept value in a different chunk
    quiet[[40, 100]] = torch.tensor([1.0, 1.0])
    codec = SparseCodec("topk", 64, 1, 8)
    gather, ids, buffer = _slots_with(codec, [alone, quiet], [1.0, 9.0], n)
    mean = torch.empty(n)
    gather.mean_into(buffer, mean, b"round", ids, senders=True)
    expected = codec.decode(codec.encode(alone), n) + codec.decode(codec.encode(quiet), n)
    assert torch.equal(mean, expected)


@pytest.mark.parametrize("attack", [1e3, -1e3])
def test_with_the_senders_mean_clipping_still_bounds_what_one_member_moves(attack: float) -> None:
    n = 200
    honest = [_vector(n, seed=i) for i in range(3)]
    gather, ids, buffer = _slots_with(TOPK, [*honest, _vector(n, seed=3) * attack], [1.0] * 4, n)
    clipped, plain = torch.empty(n), torch.empty(n)
    gather.mean_into(buffer, clipped, b"round", ids, clip=True, senders=True)
    gather.mean_into(buffer, plain, b"round", ids, senders=True)
    only_honest, honest_ids, honest_buffer = _slots_with(TOPK, honest, [1.0] * 3, n)
    reference = torch.empty(n)
    only_honest.mean_into(honest_buffer, reference, b"round", honest_ids, senders=True)
    one_honest = max(float(TOPK.decode(TOPK.encode(v), n).norm()) for v in honest)
    # Where it alone sent a coordinate, the attacker moves it by its whole (clipped)
    # value: at most about one honest message's norm in all, not a quarter of it.
    assert float((clipped - reference).norm()) <= 1.5 * one_honest
    assert float((plain - reference).norm()) > 100 * one_honest  # the control


def test_members_that_decode_the_slots_otherwise_name_their_round_s_reduction_otherwise() -> None:
    from shoal.averaging.reducer import ALL_REDUCTIONS, BitwiseUnion
    from shoal.averaging.sparse_round import union_reduction

    names = {union_reduction(clip=c, senders=s) for c in (False, True) for s in (False, True)}
    assert len(names) == 4  # (a plan's digest holds the name: they never average together)
    assert union_reduction(clip=False, senders=False) == "union"  # as before the choice
    assert union_reduction(clip=True, senders=False) == "union_clip_capped"
    assert all(ALL_REDUCTIONS[name] is BitwiseUnion for name in names)


@pytest.mark.parametrize("codec", [SparseCodec("topk", 64, 4, 2), SparseCodec("dct", 64, 4, 3)],
                         ids=["topk", "dct"])  # fmt: skip
@pytest.mark.parametrize("n", [64 * 5, 64 * 5 + 17])
def test_a_message_is_re_derived_chunk_by_chunk_from_its_kept_values(codec, n) -> None:  # type: ignore[no-untyped-def]
    """What a chunked audit relies on (`peer/verify/sparse_work.check_sampled`): the kept
    values re-code the whole message, and each chunk alone gives the message's indices,
    kept values and decoded values there, bit for bit, the shorter tail included."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) ** 3
    message, kept = codec.encode_kept(x)
    assert message == codec.encode(x) and kept.shape == (codec.kept(n),)
    assert codec.recode(message, kept, n) == message
    assert codec.recode(message, kept * 2, n) != message  # (a bent table does not pass)
    sent = codec.check(message, n)
    whole = codec.decode(message, n)
    assert codec.chunks(n) == -(-n // codec.chunk)
    at = 0
    for index in range(codec.chunks(n)):
        first, length, k = codec.chunk_span(index, n)
        offsets, values = codec.pick_chunk(x[first : first + length].clone(), k)
        assert torch.equal(sent.indices[at : at + k] - first, offsets)
        assert torch.equal(kept[at : at + k].view(torch.int32), values.view(torch.int32))
        part = sparse_codec.SparseMessage(offsets, sent.values[at : at + k])
        alone = torch.zeros(length)
        codec.add_decoded(part, alone, 1.0)
        assert torch.equal(alone.view(torch.int32), whole[first : first + length].view(torch.int32))
        at += k
    with pytest.raises(IndexError):
        codec.chunk_span(codec.chunks(n), n)
