"""The inner optimizer's state in 8 bits: blockwise float8 codes that decode exactly.

A verified round's audit re-runs a segment from the state at its start, and the
referee can rebuild the parameters there from the round's global state (which it
holds) but not the optimizer's moments, which the prover carried over from every
round before: as float32 they are two model sizes of a reveal. With the
experiment's `inner_state` "quantize", the prover rounds its moments to these
codes at each round's start and trains on from the decoded values, so the state
it commits to is exactly what the codes decode to, and a reveal carries the
codes: about half a model size instead of two (8-bit optimizers keep their
moments so at every step; here they are rounded once a round).

Each floating state tensor is cut into blocks of `BLOCK` elements. A block keeps
a power-of-two scale (its exponent, int16) and one float8 e4m3 code per element,
the element divided by the scale, the scale chosen so the block's largest
magnitude lands in (128, 256] (e4m3 holds up to 448 with a 4-bit significand, so
every element keeps about 6% relative precision down to 2^-17 of its block's
largest). Multiplying by a power of two is exact, and so is widening a float8:
the decoded values are the same bits on every machine, a CPU referee's and a GPU
prover's (`encode` never needs to match across machines; only `decode` does).

A tensor with no negative element (Adam's second moment) is coded by its square
root (`SQRT`): the denominator of Adam's step, `sqrt(v)`, then keeps 6% relative
precision where the square would keep 12%. Codes round to the nearest (unbiased:
rounded up, the moments would grow a little every round, and with AdamW's
default beta2 of 0.999 faster than they decay over a round of 50 steps), except
that a positive root never rounds to 0 (it takes the smallest code): a coordinate
whose second moment vanished would take a step of `m / eps`. The square of a
decoded root is exact in float32 (its significand has 4 bits).

Coding is idempotent on decoded values: `encode(decode(encode(x)))` decodes to
the same bits as `encode(x)` (the scale of a block of decoded values is the one
it was coded with, or half of it, at which every code doubles exactly). So a
prover need not keep the codes: it encodes the float32 state it kept, and checks
that they decode to it (`encode_exact`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK",
    "MAX_EXPONENT",
    "PLAIN",
    "SIGNED",
    "SQRT",
    "CodedState",
    "CodedTensor",
    "code_state",
    "coded_bytes",
    "decode",
    "decode_state",
    "encode",
    "encode_exact",
    "round_trip_",
]

BLOCK = 128
FLOAT8 = torch.float8_e4m3fn
TOP = 8  # a block's largest magnitude, scaled, is at most 2**TOP
# A block's scale exponent is that of a float32 (at most 2**128) less TOP, or of a
# subnormal (down to 2**-149): a coded tensor claiming another is malformed.
MAX_EXPONENT = 160

PLAIN, SIGNED, SQRT = 0, 1, 2  # how a state tensor is coded (a reveal header names it)


@dataclass
class CodedTensor:
    """A float32 tensor as float8 codes (as uint8) and per-block scale exponents."""

    mode: int  # SIGNED or SQRT
    shape: tuple[int, ...]
    codes: torch.Tensor  # uint8, one per element, flat
    exponents: torch.Tensor  # int16, one per BLOCK elements

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.exponents.numel()


def coded_bytes(elements: int) -> int:
    """The bytes of a coded tensor of `elements` elements (codes and exponents)."""
    return elements + 2 * math.ceil(elements / BLOCK)


def _pow2(exponents: torch.Tensor) -> torch.Tensor:
    """2**e as float64, exactly, built from its bits (exp2 need not be exact)."""
    bits = (exponents.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64)


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """`flat` padded with zeros to whole blocks, one block a row."""
    pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def _scale_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """Per block, e with its largest magnitude / 2**e in (128, 256] (0: an all-zero block)."""
    largest = blocks.abs().amax(dim=1)
    significand, exponent = torch.frexp(largest)  # largest = significand * 2**exponent
    # ceil(log2(largest)): the exponent, or one less when largest is a power of two.
    ceil_log2 = exponent - (significand == 0.5).to(exponent.dtype)
    return torch.where(largest > 0, ceil_log2 - TOP, torch.zeros_like(ceil_log2))


def encode(tensor: torch.Tensor) -> CodedTensor | None:
    """`tensor` (floating, finite) coded; None when it is not finite or not floating."""
    if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
        return None
    x = tensor.detach().to(torch.float32).reshape(-1)
    # (By sign bit, not value: a -0.0 stays one through a round trip, so the mode does.)
    mode = SIGNED if bool(torch.signbit(x).any()) else SQRT
    if mode == SQRT:
        x = x.sqrt()
    blocks = _blocks(x)
    exponents = _scale_exponents(blocks)
    # Exact: a float32 times a power of two, in float64, is a float32 again (|.| <= 256).
    scaled = (blocks.to(torch.float64) * _pow2(-exponents).unsqueeze(1)).to(torch.float32)
    codes = scaled.to(FLOAT8)
    if mode == SQRT:  # (never to 0 from above: 1 is the smallest positive code)
        lost = (codes.view(torch.uint8) == 0) & (scaled > 0)
        codes = torch.where(lost, torch.ones_like(codes.view(torch.uint8)),
                            codes.view(torch.uint8)).view(FLOAT8)  # fmt: skip
    flat_codes = codes.view(torch.uint8).reshape(-1)[: x.numel()]
    return CodedTensor(mode, tuple(tensor.shape), flat_codes, exponents.to(torch.int16))


def decode(coded: CodedTensor) -> torch.Tensor:
    """The float32 tensor `coded` stands for (the same bits on any machine)."""
    elements = math.prod(coded.shape)
    codes = _blocks(coded.codes.reshape(-1).view(FLOAT8).to(torch.float32))
    scale = _pow2(coded.exponents.to(torch.int64)).unsqueeze(1)
    values = (codes.to(torch.float64) * scale).to(torch.float32).reshape(-1)[:elements]
    if coded.mode == SQRT:
        values = values * values
    return values.reshape(coded.shape)


def encode_exact(tensor: torch.Tensor) -> CodedTensor | None:
    """`tensor` coded, when its codes decode to it bit for bit (a state that was
    rounded by `round_trip_`); None otherwise."""
    coded = encode(tensor)
    if coded is None:
        return None
    same = torch.equal(decode(coded).view(torch.int32), tensor.detach().cpu().view(torch.int32))
    return coded if same else None


def round_trip_(tensor: torch.Tensor) -> bool:
    """Replace `tensor` (on any device) by what its codes decode to; False (unchanged)
    when it cannot be coded."""
    coded = encode(tensor.detach())
    if coded is None:
        return False
    decoded = decode(CodedTensor(coded.mode, coded.shape, coded.codes.cpu(),
                                 coded.exponents.cpu()))  # fmt: skip
    tensor.detach().copy_(decoded.to(tensor.device))
    return True


# A coded optimizer state: per (parameter index, state name), a coded tensor or, for a
# step count or another tensor of one element, the tensor itself.
CodedState = list[tuple[tuple[int, str], CodedTensor | torch.Tensor]]


def code_state(per_param: dict[int, dict[str, object]]) -> CodedState | None:
    """An optimizer's per-parameter state (`optimizer.state_dict()["state"]`) coded, when
    every tensor of more than one element decodes to itself bit for bit (a state
    `round_trip_` left); None otherwise (send it whole)."""
    out: CodedState = []
    for index in sorted(per_param):
        for name in sorted(per_param[index]):
            value = per_param[index][name]
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            if tensor.numel() <= 1:
                out.append(((index, name), tensor.detach().cpu()))
                continue
            coded = encode_exact(tensor)
            if coded is None:
                return None
            out.append(((index, name), coded))
    return out


def decode_state(coded: CodedState) -> dict[int, dict[str, torch.Tensor]]:
    """The per-parameter state `coded` stands for."""
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for (index, name), value in coded:
        tensor = decode(value) if isinstance(value, CodedTensor) else value
        per_param.setdefault(index, {})[name] = tensor
    return per_param
