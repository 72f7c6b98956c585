"""The Triton kernel of the EXACT rule: correctly rounded sums and means, in no order at all.

``segment_reduce_exact`` takes the arguments of ``segment.segment_reduce`` (read the contract
there) for ``rule == EXACT`` and ``reduce`` SUM or MEAN, with offsets, and no carry;
``segment.segment_reduce`` hands it such launches. Its results are the ones
``detsum.kernels.numba.exact`` defines, bit for bit.

IMPLEMENTATION NOTES (this backend; ``common.py`` has those every kernel here shares):

- EXACT (``_exact_kernel``): one program per segment and column block (``_exact_segment``).
  The terms first take a fast path: summed in fp64 (fp64 terms by TwoSum, into a rounded sum
  and the sum of its errors) while the largest and smallest nonzero magnitude of each column
  are kept; a column whose spread provably leaves no sum rounded (``_exact_fast_pass``,
  ``_exact_fast_pass_wide``) has its exact sum there, rounded once (through a round-to-odd
  fp32 for bf16 and fp16; by one addition of the pair for fp64). A certified column's mean
  of fp32, bf16 or fp16 data over fewer than ``2**(53 - p)`` terms (p the dtype's precision)
  is the fp64 quotient of that sum, rounded once more to the dtype, as the Numba kernel's
  ``rounded_quotient`` proves it may be; a certified column's mean of fp64 data is the
  Numba kernel's ``pair_quotient``, step for step (``_pair_quotient``: exact products by
  Dekker's method where the Numba kernel fuses a multiply-add). The other columns, and the
  other means (whose fast-path sum is put in the limbs, to be divided there) go through the
  integer state of ``detsum.kernels`` (EXACT STATE), only in blocks that have such columns:
  a [columns, limbs] int64 tensor to which each term adds its digits, carried, divided by
  the count (into one more digit, below the unit, so that a mean whose quantum is one unit,
  an fp32 or fp64 subnormal, is rounded rather than truncated) and rounded from the
  integer. Either way the bits are the correctly rounded result, so which path ran never
  shows.

- Long segments (more than ``_EXACT_CHUNK_TERMS`` terms, where the launch has more positions
  than that) go to chunk programs, as the rules that split spread theirs (``chunks.py``: one
  launch, the fold in it, tickets). A chunk program sums its chunk exactly (the fast path's
  fp64 sum for the columns it certifies over the chunk, put in the limbs; the terms of the
  others) and stores its part: the carried limbs, each a 32-bit digit but the signed top one,
  as int32, and the flags (NaN, +inf, -inf, a term other than -0.0) in the spare lane. The last
  to finish adds the parts as integers (exact, so their order is free), then the base row,
  and rounds or divides once (``_exact_fold``). The chunks' fp64 sums are not added in fp64:
  each is exact over its chunk, but their sum need not be (2**100 in one chunk, 2**-100 in
  another). The segment's value, and so its bits, are those of the unsplit launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import EXACT_TARGETS, NORMALISE_EVERY, has_exact_work
from .common import (
    _DATA_CODES,
    _MAX_GRID_YZ,
    _MEAN,
    _NATIVE,
    _ROW_BYTES,
    _SUM,
    _acc_dtype,
    _as_stored,
    _cdiv,
    _next_power_of_2,
    _tl_acc,
    _to_acc,
    _to_data,
)
from . import chunks as _chunks
from .chunks import (
    _OFFSETS,
    _UNGUIDED,
    _chunk_owned,
    _chunk_slot,
    _last_chunk_done,
    ticket_counters,
)
from .launch import Kernel

__all__ = ["segment_reduce_exact"]


# ---- the EXACT rule ----------------------------------------------------------------------------
# The state is the one detsum.kernels describes (EXACT STATE): per column, an integer count of
# units in int64 limbs of LIMB_BITS = 32 bits. Here the limbs of a column block are one
# [BLOCK, LANES] tensor, lane i holding limb i; a term is added to the lanes it spans by
# one-hot selects, and the carries, the long division and the rounding walk the lanes with
# masked row sums. Shift amounts are clamped below 64 wherever a select discards the result,
# since a shift by 64 or more is undefined on the GPU.

_SIGN_BIT = tl.constexpr(-(2**63))  # the int64 with only the top bit set
_F64_INF_BITS = tl.constexpr(0x7FF0000000000000)
_F64_NAN_BITS = tl.constexpr(0x7FF8000000000000)
_F32_INF_BITS = tl.constexpr(0x7F800000)
_NO_MAGNITUDE = tl.constexpr(0x7FFFFFFF)  # above every finite fp32 magnitude's bits
_NO_MAGNITUDE_64 = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # and fp64's
# fp64 terms' certificate (_exact_fast_pass_wide): no partial sum past this magnitude.
_WIDE_LIMIT = tl.constexpr(2.0**1022)
_TWO_TO_52 = tl.constexpr(2.0**52)
# The biased exponent at which an fp64's last significand bit is worth one fp32 unit, 2**-149.
_F64_EXPONENT_OF_FP32_UNIT = tl.constexpr(1023 + 52 - 149)


@triton.jit
def _float_fields(x, ACC: tl.constexpr):
    """Sign (int1), biased exponent and stored fraction (int64) of the fp32 or fp64 x."""
    if ACC == tl.float64:
        bits = x.to(tl.int64, bitcast=True)
        return bits < 0, (bits >> 52) & 0x7FF, bits & 0xFFFFFFFFFFFFF
    else:
        bits = x.to(tl.int32, bitcast=True)
        return bits < 0, ((bits >> 23) & 0xFF).to(tl.int64), (bits & 0x7FFFFF).to(tl.int64)


@triton.jit
def _lane(limbs, lanes, i):
    """Limb ``i`` (a constant, or one per column as a [BLOCK, 1] tensor) of every column."""
    return tl.sum(tl.where(lanes == i, limbs, 0), axis=1)


@triton.jit
def _deposit(limbs, lanes, significand, shift, negative, WIDE: tl.constexpr):
    """limbs += -+ significand * 2**shift units, cut into digits at the limb boundaries.

    significand < 2**53 (WIDE) or < 2**24, shift >= 0. Each digit is below 2**33, so the state
    takes MAX_TERMS_PER_STATE of these before a limb could overflow; nothing carries here."""
    k = (shift >> 5)[:, None]
    r = shift & 31
    low = (significand & 0xFFFFFFFF) << r
    d0 = low & 0xFFFFFFFF
    d1 = low >> 32
    if WIDE:
        high = (significand >> 32) << r
        d1 = d1 + (high & 0xFFFFFFFF)
        d2 = high >> 32
    d0 = tl.where(negative, -d0, d0)
    d1 = tl.where(negative, -d1, d1)
    limbs = limbs + tl.where(lanes == k, d0[:, None], 0) + tl.where(lanes == k + 1, d1[:, None], 0)
    if WIDE:
        d2 = tl.where(negative, -d2, d2)
        limbs = limbs + tl.where(lanes == k + 2, d2[:, None], 0)
    return limbs


@triton.jit
def _deposit_term(limbs, lanes, t, take, nan, pinf, ninf, not_neg_zero, ACC: tl.constexpr):
    """Add the term ``t`` (the acc type: its units are the acc type's smallest subnormal) to the
    columns in ``take``; record NaN, +inf, -inf and anything but -0.0 in the flags instead."""
    negative, exponent, fraction = _float_fields(t, ACC)
    if ACC == tl.float64:
        special = exponent == 0x7FF
        hidden = fraction | (1 << 52)
    else:
        special = exponent == 0xFF
        hidden = fraction | (1 << 23)
    nan = nan | (take & special & (fraction != 0))
    pinf = pinf | (take & special & (fraction == 0) & (negative == 0))
    ninf = ninf | (take & special & (fraction == 0) & negative)
    not_neg_zero = not_neg_zero | (take & ((negative == 0) | (exponent != 0) | (fraction != 0)))
    # A subnormal counts fraction units; a normal one (fraction + hidden bit) << (exponent - 1).
    significand = tl.where(exponent == 0, fraction, hidden)
    significand = tl.where(take & (special == 0), significand, 0)
    shift = tl.maximum(exponent - 1, 0)
    limbs = _deposit(limbs, lanes, significand, shift, negative, ACC == tl.float64)
    return limbs, nan, pinf, ninf, not_neg_zero


@triton.jit
def _normalise(limbs, lanes, N_LIMBS: tl.constexpr):
    """Carry every limb but the last into [0, 2**32) (the value is unchanged)."""
    # A loop, not tl.static_range: unrolled 66 times (fp64) it takes minutes to compile. The
    # limb is read inline: a call to _lane costs the interpreter more than the work.
    for i in range(N_LIMBS - 1):
        v = tl.sum(tl.where(lanes == i, limbs, 0), axis=1)
        carry = v >> 32  # arithmetic: floor(v / 2**32)
        limbs = tl.where(lanes == i, (v & 0xFFFFFFFF)[:, None],
                         tl.where(lanes == i + 1, limbs + carry[:, None], limbs))
    return limbs


@triton.jit
def _negate(limbs, lanes, N_LIMBS: tl.constexpr):
    """-N for a normalised N, normalised, with no carry chain: complementing the digits gives
    -N - 1 exactly (digit d becomes 2**32 - 1 - d, the top limb t becomes -1 - t), and adding
    1 to that clears its lowest run of all-ones digits and increments the digit above them."""
    low = lanes < N_LIMBS - 1
    complement = tl.where(low, 0xFFFFFFFF - limbs, tl.where(lanes == N_LIMBS - 1, -1 - limbs, 0))
    first = tl.min(tl.where(low & (complement != 0xFFFFFFFF), lanes, N_LIMBS - 1), axis=1)
    return tl.where(lanes < first[:, None], 0,
                    tl.where(lanes == first[:, None], complement + 1, complement))


@triton.jit
def _bits(limbs, lanes, start, count):
    """Bits [start, start + count) of the normalised nonnegative integer (0 <= count <= 62).

    Each limb's share is cut out and moved to where it lands; the shares are disjoint, so
    their sum is the field."""
    offset = lanes * 32 - start[:, None]  # where a limb's bit 0 lands, counted from start
    width = count[:, None]
    below = limbs >> tl.minimum(tl.maximum(-offset, 0), 63)  # a limb that starts under start
    keep = tl.minimum(tl.maximum(width - offset, 0), 62)
    above = (limbs & ((tl.full([], 1, tl.int64) << keep) - 1)) << tl.minimum(
        tl.maximum(offset, 0), 62)
    share = tl.where(offset < 0, below, tl.where(offset < width, above, 0))
    return tl.sum(share, axis=1) & ((tl.full([], 1, tl.int64) << count) - 1)


@triton.jit
def _any_below(limbs, lanes, position):
    """Whether the normalised nonnegative integer has a set bit below ``position`` (>= -1)."""
    width = position[:, None] - lanes * 32  # how many of a limb's bits lie below position
    cut = limbs & ((tl.full([], 1, tl.int64) << tl.minimum(tl.maximum(width, 0), 62)) - 1)
    return tl.max(tl.where(width >= 32, limbs, cut), axis=1) > 0


@triton.jit
def _bit_length(v):
    """The number of bits of 0 <= v < 2**53: the exponent of its (exact) fp64 conversion."""
    exponent = (v.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1022
    return tl.where(v > 0, exponent, 0)


@triton.jit
def _round_units(limbs, lanes, sticky, PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr,
                 UNIT_EXPONENT: tl.constexpr):
    """RN of N * 2**UNIT_EXPONENT to PRECISION bits with a quantum of at least 2**MIN_QUANTUM
    units, as the bits of an fp64 (exact, or inf past fp64's range).

    ``limbs``: N, normalised and nonnegative. ``sticky``: N stands for a value a little above
    it (a division's nonzero remainder), which breaks a tie upward."""
    top = tl.max(tl.where(limbs != 0, lanes, -1), axis=1)
    top_bits = _bit_length(_lane(limbs, lanes, top[:, None]))
    length = tl.where(top >= 0, top * 32 + top_bits, 0)
    quantum = tl.maximum(length - PRECISION, MIN_QUANTUM)
    significand = _bits(limbs, lanes, quantum, tl.maximum(length - quantum, 0))
    half_at = tl.maximum(quantum - 1, 0)
    half = (quantum > 0) & (half_at < length) & (
        _bits(limbs, lanes, half_at, tl.zeros_like(half_at) + 1) != 0)
    odd = (significand & 1) != 0
    significand += (half & (sticky | odd | _any_below(limbs, lanes, quantum - 1))).to(tl.int64)
    # significand * 2**exponent, with 2**exponent built from its bits (normal or subnormal);
    # a product past fp64's range is inf, set here rather than overflowing a multiply.
    exponent = quantum + UNIT_EXPONENT
    overflow = exponent + _bit_length(significand) > 1024
    exponent = tl.where(overflow, 0, tl.minimum(exponent, 1023))
    normal = ((tl.maximum(exponent, -1022) + 1023) << 52).to(tl.float64, bitcast=True)
    subnormal = (tl.full([], 1, tl.int64) << tl.minimum(tl.maximum(exponent + 1074, 0), 51)).to(
        tl.float64, bitcast=True)
    scale = tl.where(exponent >= -1022, normal, subnormal)
    magnitude = significand.to(tl.float64) * scale
    return tl.where(overflow, _F64_INF_BITS, magnitude.to(tl.int64, bitcast=True))


@triton.jit
def _exact_value(limbs, lanes, count, nan, pinf, ninf, not_neg_zero, REDUCE: tl.constexpr,
                 PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr,
                 UNIT_EXPONENT: tl.constexpr, N_LIMBS: tl.constexpr):
    """The rounded sum (or mean over ``count``) of each column's limbs and flags, as fp64."""
    limbs = _normalise(limbs, lanes, N_LIMBS)
    negative = _lane(limbs, lanes, N_LIMBS - 1) < 0
    limbs = tl.where(negative[:, None], _negate(limbs, lanes, N_LIMBS), limbs)
    if REDUCE == _MEAN:
        # Long division by the count, top limb first (remainder < count <= 2**30, so every
        # partial dividend fits in int64). Quotient digit i goes one lane up, to lane i + 1, and
        # one more step divides the remainder into a 32-bit fraction digit in lane 0: the
        # quotient is then counted in units of 2**-32 units, so that its rounding bit exists
        # even where the result's quantum is one unit (fp32 and fp64 subnormals).
        remainder = tl.zeros_like(negative.to(tl.int64))
        for k in range(N_LIMBS):
            i = N_LIMBS - 1 - k
            partial = (remainder << 32) | tl.sum(tl.where(lanes == i, limbs, 0), axis=1)
            digit = partial // count
            remainder = partial - digit * count
            limbs = tl.where(lanes == i + 1, digit[:, None], limbs)
        partial = remainder << 32
        digit = partial // count
        remainder = partial - digit * count
        limbs = tl.where(lanes == 0, digit[:, None], limbs)
        magnitude = _round_units(limbs, lanes, remainder != 0, PRECISION, MIN_QUANTUM + 32,
                                 UNIT_EXPONENT - 32)
    else:
        magnitude = _round_units(limbs, lanes, negative != negative, PRECISION, MIN_QUANTUM,
                                 UNIT_EXPONENT)
    # A nonzero value that rounds to zero keeps its sign; an exact zero is +0.0 unless every
    # term was -0.0.
    bits = magnitude | tl.where(negative, _SIGN_BIT, 0)
    bits = tl.where(not_neg_zero, bits, _SIGN_BIT)
    bits = tl.where(pinf, _F64_INF_BITS, bits)
    bits = tl.where(ninf, _F64_INF_BITS | _SIGN_BIT, bits)
    bits = tl.where(nan | (pinf & ninf), _F64_NAN_BITS, bits)
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def _f32_to_odd(s):
    """RO_fp32 of the fp64 ``s``: RN, then, where that was inexact and landed on an even
    significand, its odd neighbour on the side of ``s``. Rounding the result to nearest at 8 or
    11 bits (bf16, fp16, both with at least two bits fewer than fp32, subnormals included)
    equals rounding ``s`` once."""
    f = s.to(tl.float32)
    bits = f.to(tl.int32, bitcast=True)  # sign and magnitude: +1 steps away from zero
    back = f.to(tl.float64)
    step = tl.where(tl.abs(s) > tl.abs(back), 1, -1)
    fix = (back != s) & ((bits & _F32_INF_BITS) != _F32_INF_BITS) & ((bits & 1) == 0)
    return tl.where(fix, bits + step, bits).to(tl.float32, bitcast=True)


@triton.jit
def _store_rounded(out_at, s, take, DATA: tl.constexpr, out_ty):
    """Store RN_dtype(s) in the columns in ``take``, for an fp64 ``s`` that is exact (a
    certified sum) or a quotient whose rounding is the exact one's: to fp32 directly, to bf16
    and fp16 through round-to-odd fp32 (one rounding in effect)."""
    if DATA == _NATIVE:
        rounded = s.to(tl.float32)
    else:
        rounded = _f32_to_odd(s)
    tl.store(out_at, _to_data(rounded, DATA, out_ty), mask=take)


@triton.jit
def _exact_term(row_base, order_ptr, p, ss1, ss2, cols, mask, alpha, DATA: tl.constexpr,
                ACC: tl.constexpr, HAS_ORDER: tl.constexpr, SCALED: tl.constexpr):
    """The term at position ``p``: RN_acc(A(x) * A(alpha)), or A(x) without a scale."""
    row = p
    if HAS_ORDER:
        row = tl.load(order_ptr + p)
    t = _to_acc(tl.load(row_base + row * ss1 + cols * ss2, mask=mask, other=0), DATA, ACC)
    if SCALED:
        t = t * alpha
    return t


@triton.jit
def _exact_fast_pass(row_base, ss1, ss2, cols, mask, base_at, order_ptr, p0, p1, count, alpha,
                     DATA: tl.constexpr, HAS_ORDER: tl.constexpr, USE_BASE: tl.constexpr,
                     SCALED: tl.constexpr, HEADROOM: tl.constexpr):
    """The fp32 terms (and init) summed in fp64, and per column whether that sum is exact.

    It is when fp64's 53 bits cover the column's spread: every term is a multiple of the ulp of
    the smallest nonzero magnitude, which is at least smallest * 2**-term_bits; every partial
    sum is at most count * largest; fp64 holds every multiple of that ulp up to 2**53 of them,
    and HEADROOM = 2**(52 - term_bits) leaves a factor 2 for the rounding of count * largest.
    Magnitudes compare as their bits (cheaper than floats); an inf or NaN makes the largest
    0x7F800000 or more, which fails the certificate."""
    # -0.0, IEEE's additive identity: a sum of -0.0 stays -0.0.
    total = tl.full(cols.shape, _SIGN_BIT, tl.int64).to(tl.float64, bitcast=True)
    largest = tl.zeros(cols.shape, tl.int32)
    smallest = largest + _NO_MAGNITUDE
    if USE_BASE:
        init = _to_acc(tl.load(base_at, mask=mask, other=0), DATA, tl.float32)
        total = init.to(tl.float64)
        largest = init.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        smallest = tl.where(largest == 0, _NO_MAGNITUDE, largest)
    for p in range(p0, p1):
        t = _exact_term(row_base, order_ptr, p, ss1, ss2, cols, mask, alpha, DATA, tl.float32,
                        HAS_ORDER, SCALED)
        total += t.to(tl.float64)
        magnitude = t.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        largest = tl.maximum(largest, magnitude)
        smallest = tl.minimum(smallest, tl.where(magnitude == 0, _NO_MAGNITUDE, magnitude))
    spread_fits = (count.to(tl.float64) * largest.to(tl.float32, bitcast=True).to(tl.float64)
                   <= smallest.to(tl.float32, bitcast=True).to(tl.float64) * HEADROOM)
    return total, (largest < _F32_INF_BITS) & ((largest == 0) | spread_fits)


@triton.jit
def _exact_fast_pass_wide(row_base, ss1, ss2, cols, mask, base_at, order_ptr, p0, p1, count,
                          alpha, DATA: tl.constexpr, HAS_ORDER: tl.constexpr,
                          USE_BASE: tl.constexpr, SCALED: tl.constexpr):
    """The fp64 terms (and init) summed by TwoSum into (hi, lo), and per column whether
    hi + lo is their exact sum.

    It is when lo never rounded: the terms, hi and each TwoSum error are multiples of the ulp
    of the smallest nonzero magnitude, u >= smallest * 2**-52, so lo + error is exact while
    it stays within 2**53 u; each error is at most 2**-53 |hi| <~ 2**-53 count * largest, so
    ``count**2 * largest <= smallest * 2**52`` keeps lo there with a factor 4 to spare, and
    _WIDE_LIMIT keeps every sum clear of overflow (detsum.kernels.numba.exact says the same
    for its ``tile_certified``). An inf or NaN makes the largest _F64_INF_BITS or more."""
    hi = tl.full(cols.shape, _SIGN_BIT, tl.int64).to(tl.float64, bitcast=True)  # -0.0
    lo = tl.zeros(cols.shape, tl.float64)
    largest = tl.zeros(cols.shape, tl.int64)
    smallest = largest + _NO_MAGNITUDE_64
    if USE_BASE:
        hi = _to_acc(tl.load(base_at, mask=mask, other=0), DATA, tl.float64)
        largest = hi.to(tl.int64, bitcast=True) & _NO_MAGNITUDE_64
        smallest = tl.where(largest == 0, _NO_MAGNITUDE_64, largest)
    for p in range(p0, p1):
        t = _exact_term(row_base, order_ptr, p, ss1, ss2, cols, mask, alpha, DATA, tl.float64,
                        HAS_ORDER, SCALED)
        total = hi + t
        back = total - hi
        lo += (hi - (total - back)) + (t - back)
        hi = total
        magnitude = t.to(tl.int64, bitcast=True) & _NO_MAGNITUDE_64
        largest = tl.maximum(largest, magnitude)
        smallest = tl.minimum(smallest, tl.where(magnitude == 0, _NO_MAGNITUDE_64, magnitude))
    c = count.to(tl.float64)
    top = largest.to(tl.float64, bitcast=True)
    spread_fits = ((c * top <= _WIDE_LIMIT)
                   & (c * c * top <= smallest.to(tl.float64, bitcast=True) * _TWO_TO_52))
    return hi, lo, (largest < _F64_INF_BITS) & ((largest == 0) | spread_fits)


@triton.jit
def _wide_sum(hi, lo):
    """The fp64 value of a certified (hi, lo): one addition rounds it; hi alone when lo is 0,
    which keeps the sign of a sum of -0.0 terms."""
    return tl.where(lo == 0, hi, hi + lo)


# _pair_quotient's range: quotients from here up (clear of the subnormals, as the Numba
# kernel's), sums below _PAIR_SUM_MAX (Veltkamp's split of the quotient, times 2**27 + 1,
# stays finite).
_PAIR_QUOTIENT_MIN = tl.constexpr(2.0**-960)
_PAIR_SUM_MAX = tl.constexpr(2.0**994)


@triton.jit
def _product_error(a, b, product):
    """``a * b - product`` exactly, for ``product = RN(a * b)``: Dekker's product of
    Veltkamp's halves (26 and 27 bits, each partial product exact), with no fused
    multiply-add (the launch allows none), for products far from overflow and from the
    subnormals."""
    ca = 134217729.0 * a  # 2**27 + 1
    a_hi = ca - (ca - a)
    a_lo = a - a_hi
    cb = 134217729.0 * b
    b_hi = cb - (cb - b)
    b_lo = b - b_hi
    return ((a_hi * b_hi - product) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


@triton.jit
def _sign_of(whole, fraction):
    """The sign (-1, 0 or 1) of ``whole + fraction``, an integer and a value in [0, 1)."""
    return tl.where((whole > 0) | ((whole == 0) & (fraction > 0)), 1, tl.where(whole == 0, 0, -1))


@triton.jit
def _pair_quotient(hi, lo, count):
    """(RN_fp64((hi + lo) / count), decided) per column, for a certified TwoSum pair (an
    exact sum at most 2**1022 in magnitude) and a count in [1, 2**30): the Numba kernel's
    ``pair_quotient`` (its docstring proves it), step for step, with its two fused
    multiply-adds made exact products by ``_product_error``. Not decided: a quotient below
    _PAIR_QUOTIENT_MIN, a sum from _PAIR_SUM_MAX up, or a quotient an ulp or more from q; the
    limbs decide those."""
    n = count.to(tl.float64)
    two_sum = lo != 0
    h = tl.where(two_sum, hi + lo, hi)
    back = h - hi
    l = tl.where(two_sum, (hi - (h - back)) + (lo - back), 0.0)
    negative = h < 0
    h = tl.abs(h)
    l = tl.where(negative, -l, l)
    # Sums too large to split are left undecided; a stand-in keeps their steps finite.
    too_large = h >= _PAIR_SUM_MAX
    h = tl.where(too_large, 1.0, h)
    q = h / n
    # h - q n exactly (the remainder of a rounded division is a double): (h - RN(q n)) is
    # exact (Sterbenz), and so is what is left of it.
    product = q * n
    q = q + (((h - product) - _product_error(q, n, product)) + l) / n
    decided = (q >= _PAIR_QUOTIENT_MIN) & (too_large == 0)
    bits = q.to(tl.int64, bitcast=True)
    up = (bits + 1).to(tl.float64, bitcast=True) - q
    down = q - (bits - 1).to(tl.float64, bitcast=True)
    # (A quotient too small to decide has a quantum that may underflow to 0: any other then.)
    quantum = tl.where(decided, 0.25 * up, 1.0)
    decided &= (l == 0) | (tl.abs(l) >= quantum * 2.0**-900)  # l / quantum keeps its bits
    product = q * n
    error = _product_error(q, n, product)
    scaled_l = l / quantum
    whole_l = scaled_l.to(tl.int64)
    whole_l = tl.where(whole_l.to(tl.float64) > scaled_l, whole_l - 1, whole_l)  # the floor
    fraction = scaled_l - whole_l.to(tl.float64)
    d = ((h - product) / quantum).to(tl.int64) - (error / quantum).to(tl.int64) + whole_l
    half_up = 2 * count
    half_down = tl.where(down == up, 2 * count, count)
    above = _sign_of(d - half_up, fraction)  # t against the midpoint above q
    below = _sign_of(d + half_down, fraction)  # and against the one below
    odd = (bits & 1) != 0
    step = tl.where(above > 0, 1, tl.where(above == 0, odd.to(tl.int64),
                    tl.where(below < 0, -1, tl.where(below == 0, -odd.to(tl.int64), 0))))
    decided &= ~((above > 0) & (_sign_of(d - 2 * half_up, fraction) >= 0))
    decided &= ~((above < 0) & (below < 0) & (_sign_of(d + 2 * half_down, fraction) <= 0))
    value = (bits + step).to(tl.float64, bitcast=True)
    value = tl.where(negative, -value, value)
    # A zero sum: the pair's own zero, with its sign, over the count.
    value = tl.where(h == 0, tl.where(two_sum, hi + lo, hi) / n, value)
    return value, decided | (h == 0)


@triton.jit
def _deposit_wide_sum(limbs, lanes, hi, lo, take, nan, pinf, ninf, not_neg_zero):
    """Add a certified (hi, lo), an exact sum of fp64 terms, to the limbs of the columns in
    ``take`` (lo only where it is not 0: a sum of -0.0 terms stays one)."""
    limbs, nan, pinf, ninf, not_neg_zero = _deposit_term(
        limbs, lanes, hi, take, nan, pinf, ninf, not_neg_zero, tl.float64)
    return _deposit_term(limbs, lanes, lo, take & (lo != 0), nan, pinf, ninf, not_neg_zero,
                         tl.float64)


@triton.jit
def _deposit_fp64_sum(limbs, lanes, total, take):
    """Add the fp64 ``total``, an exact sum of fp32 values, to the limbs (fp32 units) of the
    columns in ``take``; returns the limbs and whether the sum is anything but -0.0."""
    negative, exponent, fraction = _float_fields(total, tl.float64)
    # A nonzero sum of fp32 values is a multiple of 2**-149, so its fp64 exponent is large
    # enough that a right shift here only drops zero bits.
    shift = exponent - _F64_EXPONENT_OF_FP32_UNIT
    significand = (fraction | (1 << 52)) >> tl.minimum(tl.maximum(-shift, 0), 63)
    significand = tl.where(take & (exponent != 0), significand, 0)
    limbs = _deposit(limbs, lanes, significand, tl.maximum(shift, 0), negative, True)
    return limbs, take & ((negative == 0) | (exponent != 0) | (fraction != 0))


@triton.jit
def _deposit_terms(limbs, lanes, take, nan, pinf, ninf, not_neg_zero, row_base, ss1, ss2, cols,
                   mask, base_at, order_ptr, p0, p1, alpha, DATA: tl.constexpr,
                   ACC: tl.constexpr, HAS_ORDER: tl.constexpr, USE_BASE: tl.constexpr,
                   SCALED: tl.constexpr, N_LIMBS: tl.constexpr, NORMALISE_EVERY: tl.constexpr):
    """Add the init and every term of the columns in ``take`` to their limbs and flags."""
    if USE_BASE:
        init = _to_acc(tl.load(base_at, mask=mask, other=0), DATA, ACC)
        limbs, nan, pinf, ninf, not_neg_zero = _deposit_term(
            limbs, lanes, init, take, nan, pinf, ninf, not_neg_zero, ACC)
    for start in range(p0, p1, NORMALISE_EVERY):
        for p in range(start, tl.minimum(start + NORMALISE_EVERY, p1)):
            t = _exact_term(row_base, order_ptr, p, ss1, ss2, cols, mask, alpha, DATA, ACC,
                            HAS_ORDER, SCALED)
            limbs, nan, pinf, ninf, not_neg_zero = _deposit_term(
                limbs, lanes, t, take, nan, pinf, ninf, not_neg_zero, ACC)
        if start + NORMALISE_EVERY < p1:  # (the last carry is _exact_value's)
            limbs = _normalise(limbs, lanes, N_LIMBS)
    return limbs, nan, pinf, ninf, not_neg_zero


@triton.jit
def _exact_segment(
    src_ptr, ss0, ss1, ss2, order_ptr, base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2,
    alpha, lanes, outer, inner, seg, p0, p1,
    REDUCE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr, HAS_ORDER: tl.constexpr,
    HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr, SCALED: tl.constexpr,
    HEADROOM: tl.constexpr, PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr,
    UNIT_EXPONENT: tl.constexpr, N_LIMBS: tl.constexpr, LANES: tl.constexpr,
    NORMALISE_EVERY: tl.constexpr, BLOCK: tl.constexpr,
):
    """Segment ``seg`` (positions ``p0 .. p1 - 1``) whole, into its row: for this program's
    column blocks and outer indices."""
    n = p1 - p0
    count = n
    copy_base = n == 0
    if USE_BASE:
        count = n + 1
        copy_base = n < 0  # never: the base row is a term
    n_blocks = tl.cdiv(inner, BLOCK)
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        for cb in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
            cols = cb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = cols < inner
            out_at = out_ptr + o * os0 + seg * os1 + cols * os2
            base_at = base_ptr + o * bs0 + seg * bs1 + cols * bs2
            if copy_base:
                if HAS_BASE:
                    tl.store(out_at, tl.load(base_at, mask=mask), mask=mask)
                else:
                    zero = tl.zeros([BLOCK], ACC)
                    tl.store(out_at, _to_data(zero, DATA, out_ptr.dtype.element_ty), mask=mask)
            else:
                row_base = src_ptr + o * ss0
                need = mask  # the columns whose terms go through the limbs
                seeded = cols < 0  # the columns whose exact sum the fast path has (a mean's)
                if ACC == tl.float32:
                    total, certified = _exact_fast_pass(
                        row_base, ss1, ss2, cols, mask, base_at, order_ptr, p0, p1, count, alpha,
                        DATA, HAS_ORDER, USE_BASE, SCALED, HEADROOM)
                    if REDUCE == _SUM:
                        _store_rounded(out_at, total, mask & certified, DATA,
                                       out_ptr.dtype.element_ty)
                else:
                    hi, lo, certified = _exact_fast_pass_wide(
                        row_base, ss1, ss2, cols, mask, base_at, order_ptr, p0, p1, count, alpha,
                        DATA, HAS_ORDER, USE_BASE, SCALED)
                    if REDUCE == _SUM:
                        tl.store(out_at, _wide_sum(hi, lo), mask=mask & certified)
                if REDUCE == _MEAN:
                    seeded = mask & certified  # divided in the limbs, below
                    if ACC == tl.float64:
                        value, decided = _pair_quotient(hi, lo, count)
                        tl.store(out_at, value, mask=mask & certified & decided)
                        seeded = mask & certified & (decided == 0)
                    else:
                        if count < (1 << (53 - PRECISION)):
                            # RN_fp64(total / count) rounds to the dtype as the exact quotient
                            # does, for a count this small (the Numba kernel's
                            # rounded_quotient says why); fp64's / is IEEE division.
                            _store_rounded(out_at, total / count.to(tl.float64),
                                           mask & certified, DATA, out_ptr.dtype.element_ty)
                            seeded = cols < 0
                need = mask & (certified == 0)
                any_need = tl.max(need.to(tl.int32), axis=0) > 0
                # A block the fast path wrote whole is done; a mean's seeded columns still
                # divide in the limbs.
                finish = any_need | (tl.max(seeded.to(tl.int32), axis=0) > 0)
                if finish:
                    limbs = tl.zeros([BLOCK, LANES], tl.int64)
                    nan = cols < 0  # all false
                    pinf = nan
                    ninf = nan
                    not_neg_zero = nan
                    if REDUCE == _MEAN:
                        if ACC == tl.float32:
                            limbs, not_neg_zero = _deposit_fp64_sum(limbs, lanes, total, seeded)
                        else:
                            limbs, nan, pinf, ninf, not_neg_zero = _deposit_wide_sum(
                                limbs, lanes, hi, lo, seeded, nan, pinf, ninf, not_neg_zero)
                    if any_need:
                        limbs, nan, pinf, ninf, not_neg_zero = _deposit_terms(
                            limbs, lanes, need, nan, pinf, ninf, not_neg_zero, row_base, ss1,
                            ss2, cols, mask, base_at, order_ptr, p0, p1, alpha, DATA, ACC,
                            HAS_ORDER, USE_BASE, SCALED, N_LIMBS, NORMALISE_EVERY)
                    value = _exact_value(limbs, lanes, count, nan, pinf, ninf, not_neg_zero,
                                         REDUCE, PRECISION, MIN_QUANTUM, UNIT_EXPONENT, N_LIMBS)
                    # The value is the dtype's already (or +-inf, or NaN): converting is exact.
                    tl.store(out_at, _to_data(value.to(ACC), DATA, out_ptr.dtype.element_ty),
                             mask=need | seeded)


@triton.jit
def _part_at(work_ptr, work_rows, o, slot, cols, lanes, inner, LANES: tl.constexpr):
    """Where the part in workspace ``slot`` of outer index ``o`` keeps its [columns, lanes]."""
    return work_ptr + ((o * work_rows + slot) * inner + cols)[:, None] * LANES + lanes


@triton.jit
def _exact_chunk(
    src_ptr, ss0, ss1, ss2, order_ptr, work_ptr, work_rows, alpha, lanes, outer, inner,
    p_begin, p_end, slot,
    DATA: tl.constexpr, ACC: tl.constexpr, HAS_ORDER: tl.constexpr, SCALED: tl.constexpr,
    HEADROOM: tl.constexpr, N_LIMBS: tl.constexpr, LANES: tl.constexpr,
    NORMALISE_EVERY: tl.constexpr, BLOCK: tl.constexpr,
):
    """The exact sum of the terms at positions ``p_begin .. p_end - 1`` (a chunk of a long
    segment; never its base row) into workspace ``slot``, as a part (see the notes): for
    fp32 data, the fast path's fp64 sum of each column it certifies (exact, so its units are
    the chunk's), the terms of the others."""
    n_blocks = tl.cdiv(inner, BLOCK)
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        for cb in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
            cols = cb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = cols < inner
            row_base = src_ptr + o * ss0
            limbs = tl.zeros([BLOCK, LANES], tl.int64)
            nan = cols < 0  # all false
            pinf = nan
            ninf = nan
            not_neg_zero = nan
            if ACC == tl.float32:
                total, certified = _exact_fast_pass(
                    row_base, ss1, ss2, cols, mask, row_base, order_ptr, p_begin, p_end,
                    p_end - p_begin, alpha, DATA, HAS_ORDER, False, SCALED, HEADROOM)
                limbs, not_neg_zero = _deposit_fp64_sum(limbs, lanes, total, mask & certified)
            else:
                hi, lo, certified = _exact_fast_pass_wide(
                    row_base, ss1, ss2, cols, mask, row_base, order_ptr, p_begin, p_end,
                    p_end - p_begin, alpha, DATA, HAS_ORDER, False, SCALED)
                limbs, nan, pinf, ninf, not_neg_zero = _deposit_wide_sum(
                    limbs, lanes, hi, lo, mask & certified, nan, pinf, ninf, not_neg_zero)
            need = mask & (certified == 0)
            if tl.max(need.to(tl.int32), axis=0) > 0:
                limbs, nan, pinf, ninf, not_neg_zero = _deposit_terms(
                    limbs, lanes, need, nan, pinf, ninf, not_neg_zero, row_base, ss1, ss2, cols,
                    mask, row_base, order_ptr, p_begin, p_end, alpha, DATA, ACC, HAS_ORDER,
                    False, SCALED, N_LIMBS, NORMALISE_EVERY)
            limbs = _normalise(limbs, lanes, N_LIMBS)
            flags = (nan.to(tl.int64) | (pinf.to(tl.int64) << 1) | (ninf.to(tl.int64) << 2)
                     | (not_neg_zero.to(tl.int64) << 3))
            part = tl.where(lanes == N_LIMBS, flags[:, None], limbs)
            tl.store(_part_at(work_ptr, work_rows, o, slot, cols, lanes, inner, LANES),
                     part.to(tl.int32), mask=mask[:, None] & (lanes <= N_LIMBS))


@triton.jit
def _exact_fold(
    base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2, work_ptr, work_rows, lanes, outer, inner,
    seg, p0, n,
    REDUCE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr, USE_BASE: tl.constexpr,
    PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr, UNIT_EXPONENT: tl.constexpr,
    N_LIMBS: tl.constexpr, LANES: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """The long segment ``seg`` (``n`` terms from position ``p0``): its chunks' parts added
    (integers: in any order), its base row, and the value rounded into its row."""
    n_chunks = (n + CHUNK - 1) // CHUNK
    count = n
    if USE_BASE:
        count = n + 1
    n_blocks = tl.cdiv(inner, BLOCK)
    # Half a column block at a time: the rounding of a whole block's tile, in a program that
    # also holds a chunk program's work, spilled registers on sm_90 (tests/ptx_check.py; so
    # did a loop over the two halves with a constant trip count).
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        for first_half in range(tl.program_id(1).to(tl.int64) * 2, n_blocks * 2,
                                tl.num_programs(1) * 2):
            for half in range(first_half, first_half + 2):
                cols = half * (BLOCK // 2) + tl.arange(0, BLOCK // 2).to(tl.int64)
                mask = cols < inner
                # The parts' limbs added, their flags (in the spare lane) or'ed: one tile.
                state = tl.zeros([BLOCK // 2, LANES], tl.int64)
                for k in range(n_chunks):
                    # Parts that other programs wrote: read from L2 (.cg), never from an L1
                    # line of this SM's that could predate them.
                    at = _part_at(work_ptr, work_rows, o, _chunk_slot(p0, k, CHUNK), cols, lanes,
                                  inner, LANES)
                    part = tl.load(at, mask=mask[:, None] & (lanes <= N_LIMBS), other=0,
                                   cache_modifier=".cg").to(tl.int64)
                    # Digits below the top limb are unsigned 32-bit values; the top is signed.
                    digits = tl.where(lanes < N_LIMBS - 1, part & 0xFFFFFFFF, part)
                    state = tl.where(lanes == N_LIMBS, state | part, state + digits)
                flags = _lane(state, lanes, N_LIMBS)
                limbs = tl.where(lanes < N_LIMBS, state, 0)
                nan = (flags & 1) != 0
                pinf = (flags & 2) != 0
                ninf = (flags & 4) != 0
                not_neg_zero = (flags & 8) != 0
                if USE_BASE:
                    init = _to_acc(tl.load(base_ptr + o * bs0 + seg * bs1 + cols * bs2,
                                           mask=mask, other=0), DATA, ACC)
                    limbs, nan, pinf, ninf, not_neg_zero = _deposit_term(
                        limbs, lanes, init, mask, nan, pinf, ninf, not_neg_zero, ACC)
                value = _exact_value(limbs, lanes, count, nan, pinf, ninf, not_neg_zero,
                                     REDUCE, PRECISION, MIN_QUANTUM, UNIT_EXPONENT, N_LIMBS)
                tl.store(out_ptr + o * os0 + seg * os1 + cols * os2,
                         _to_data(value.to(ACC), DATA, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _exact_kernel(
    src_ptr, ss0, ss1, ss2, order_ptr, offsets_ptr, positions, n_parts, base_ptr, bs0, bs1,
    bs2, out_ptr, os0, os1, os2, alpha_ptr, work_ptr, counters_ptr, outer, nseg, inner,
    REDUCE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr, HAS_ORDER: tl.constexpr,
    HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr, SCALED: tl.constexpr,
    HEADROOM: tl.constexpr, PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr,
    UNIT_EXPONENT: tl.constexpr, N_LIMBS: tl.constexpr, LANES: tl.constexpr,
    NORMALISE_EVERY: tl.constexpr, SPLIT: tl.constexpr, CHUNKS_FIRST: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """EXACT: whole segments (one a program) and, under SPLIT, the chunks of the segments
    longer than CHUNK: ``n_parts`` chunk programs (``chunks._chunk_owned``), after the whole
    segments' or, under CHUNKS_FIRST, before them, the last of a segment's to finish adding
    their parts (a ticket in ``counters_ptr[1 + ...]``)."""
    slot = tl.program_id(0).to(tl.int64)
    alpha = 1.0
    if SCALED:
        alpha = tl.load(alpha_ptr)
    lanes = tl.arange(0, LANES).to(tl.int64)[None, :]
    # This program's whole segment, or its chunk program e: the whole segments' first, or
    # under CHUNKS_FIRST the chunk programs'. (Here the shift compiles best; counted backwards,
    # as segment._segment_kernel counts its slots, ptxas spilled the bf16 mean's registers:
    # tests/ptx_check.py.)
    whole_slot = slot
    e = slot - nseg
    if SPLIT:
        if CHUNKS_FIRST:
            whole_slot = slot - n_parts
            e = slot
    if (whole_slot >= 0) & (whole_slot < nseg):
        p0 = tl.load(offsets_ptr + whole_slot)
        p1 = tl.load(offsets_ptr + whole_slot + 1)
        whole = p1 >= p0  # always, unless the chunk programs own this segment
        if SPLIT:
            whole = p1 - p0 <= CHUNK
        if whole:
            _exact_segment(src_ptr, ss0, ss1, ss2, order_ptr, base_ptr, bs0, bs1, bs2, out_ptr,
                           os0, os1, os2, alpha, lanes, outer, inner, whole_slot, p0, p1,
                           REDUCE, DATA, ACC, HAS_ORDER, HAS_BASE, USE_BASE, SCALED, HEADROOM,
                           PRECISION, MIN_QUANTUM, UNIT_EXPONENT, N_LIMBS, LANES,
                           NORMALISE_EVERY, BLOCK)
    elif SPLIT:
        work_rows = 2 * n_parts
        for side in range(2):
            seg, j, owned, p0, n = _chunk_owned(offsets_ptr, nseg, positions, e, side, CHUNK,
                                                _OFFSETS, offsets_ptr, order_ptr, _UNGUIDED)
            if owned:
                p_begin = p0 + j * CHUNK
                _exact_chunk(src_ptr, ss0, ss1, ss2, order_ptr, work_ptr, work_rows, alpha,
                             lanes, outer, inner, p_begin, tl.minimum(p0 + n, p_begin + CHUNK),
                             e * 2 + side, DATA, ACC, HAS_ORDER, SCALED, HEADROOM, N_LIMBS,
                             LANES, NORMALISE_EVERY, BLOCK)
                if _last_chunk_done(counters_ptr, p0, n, CHUNK):
                    _exact_fold(base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2, work_ptr,
                                work_rows, lanes, outer, inner, seg, p0, n, REDUCE, DATA, ACC,
                                USE_BASE, PRECISION, MIN_QUANTUM, UNIT_EXPONENT, N_LIMBS, LANES,
                                CHUNK, BLOCK)


# ---- launcher ----------------------------------------------------------------------------------

# Each launch after a specialisation's first calls its compiled kernel directly (see launch.py).
_launch_exact = Kernel(_exact_kernel)

# EXACT's rounding targets: (precision, smallest quantum in units, unit exponent, limbs).
_EXACT_TARGETS = EXACT_TARGETS
# Significant bits of a data element: the terms have that many when alpha == 1 (24 otherwise).
_DATA_BITS = {dtype: precision for dtype, (precision, *_) in EXACT_TARGETS.items()}
# Limbs held per program (columns x lanes): bounds the registers of the limb state.
_EXACT_STATE_LIMBS = 4096
# Terms between two carries of the limbs (a parameter so that a test can make it small).
_NORMALISE_EVERY = NORMALISE_EVERY
# The chunk of a long segment (terms): a power of two, at least kernels.CHUNK_TERMS (so that a
# plan that found no segment longer than that has none longer than this), and long enough
# that the parts (2 slots of LANES int32 per column and chunk program) stay within 1/8 of the
# data they sum (fp64: 2 * 128 * 4 bytes per 1024 * 8). A parameter so that a test can make
# it small.
_EXACT_CHUNK_TERMS = 1024


def segment_reduce_exact(src, order, offsets, base, out, *, reduce, alpha, include_base,
                         chunks=None):
    """``segment.segment_reduce`` for ``rule == EXACT`` (see the module's notes); ``chunks``
    as there: a plan's count of the chunks of CHUNK_TERMS terms, 0 where no segment is longer
    than that, which spares the launch its chunk programs."""
    if not has_exact_work(src, order, offsets, reduce, _DATA_CODES,
                          include_base and base is not None):
        return
    outer, _, inner = src.shape
    nseg = offsets.shape[0] - 1
    has_order = order is not None
    precision, min_quantum, unit_exponent, n_limbs = _EXACT_TARGETS[src.dtype]
    # One lane more than the limbs: the mean's quotient moves up a lane (see _exact_value).
    lanes = _next_power_of_2(n_limbs + 1)
    acc_dtype = _acc_dtype(src.dtype)
    offsets = offsets.contiguous()
    order = order.contiguous() if has_order else offsets  # never read without HAS_ORDER
    has_base = base is not None
    scaled = float(alpha) != 1.0
    alpha_t = torch.full((1,), float(alpha), dtype=acc_dtype, device=src.device) if scaled else out
    src_s, out_s = _as_stored(src), _as_stored(out)
    base_s = _as_stored(base) if has_base else out_s  # never read without HAS_BASE
    term_bits = 24 if scaled else _DATA_BITS[src.dtype]
    block = min(max(_next_power_of_2(inner), 16), _ROW_BYTES // src.element_size(),
                max(_EXACT_STATE_LIMBS // lanes, 16))
    num_warps = max(1, min(8, block * lanes // 512))
    grid_yz = (min(_cdiv(inner, block), _MAX_GRID_YZ), min(outer, _MAX_GRID_YZ))
    # Chunk programs (one per _EXACT_CHUNK_TERMS positions) where some segment can be longer
    # than a chunk; their parts, 2 slots per chunk program, and tickets (chunks.py).
    positions = order.shape[0] if has_order else src.shape[1]
    split = (positions > _EXACT_CHUNK_TERMS
             and not (chunks is not None and chunks[1] == 0))
    n_parts = _cdiv(positions, _EXACT_CHUNK_TERMS) if split else 0
    work, counters = offsets, offsets  # never touched without SPLIT
    if split:
        work = torch.empty(outer * 2 * n_parts * inner * lanes, dtype=torch.int32,
                           device=src.device)
        counters = ticket_counters(src.device, 1 + 2 * n_parts * grid_yz[0] * grid_yz[1])
    _launch_exact(
        (nseg + n_parts, *grid_yz),
        (src_s, *src_s.stride(), order, offsets, positions, n_parts, base_s, *base_s.stride(),
         out_s, *out_s.stride(), alpha_t, work, counters, outer, nseg, inner),
        {"REDUCE": int(reduce), "DATA": _DATA_CODES[src.dtype], "ACC": _tl_acc(src.dtype),
         "HAS_ORDER": has_order, "HAS_BASE": has_base,
         "USE_BASE": has_base and bool(include_base), "SCALED": scaled,
         "HEADROOM": 2.0 ** (52 - term_bits), "PRECISION": precision,
         "MIN_QUANTUM": min_quantum, "UNIT_EXPONENT": unit_exponent, "N_LIMBS": n_limbs,
         "LANES": lanes, "NORMALISE_EVERY": _NORMALISE_EVERY, "SPLIT": split,
         "CHUNKS_FIRST": split and _chunks.CHUNKS_FIRST, "CHUNK": _EXACT_CHUNK_TERMS,
         "BLOCK": block},
        num_warps=num_warps,
    )
