"""Numba CPU kernels for the EXACT rule: correctly rounded sums and means, in no order at all.

The launcher, ``segment_reduce_exact``, takes the arguments of ``segment.segment_reduce`` (read
the contract there) for ``rule == EXACT`` and ``reduce`` SUM or MEAN. The state it computes in
is the one ``detsum.kernels`` describes (EXACT STATE): an integer count of units in int64
limbs. Every output element's value is

- SUM: ``RN_dtype(init + sum of terms)``, the exact sum rounded once (ties to even);
- MEAN: ``RN_dtype((init + sum of terms) / count)``, the exact quotient rounded once;

with IEEE's special values: any NaN, or +inf with -inf, gives NaN; otherwise an inf wins; an
exact zero is -0.0 only when every term (and the init) is -0.0, and a nonzero value that
rounds to zero keeps its sign.

IMPLEMENTATION NOTES (this backend):

- Fast path (bf16, fp16 and fp32 data): the terms are fp32 values, so their sum is held in
  fp64 exactly as long as the 53 bits cover its spread (they do for any data whose magnitudes
  span less than about 2**29; real gradients nearly always). A tile (one segment, a block of
  columns) adds its terms in fp64 and keeps, by integer min/max of the fp32 bit patterns, the
  largest and the smallest nonzero magnitude; ``count * largest <= smallest * 2**(52 - p)``
  (``p`` bits per term) proves that no partial sum rounded, so each column's fp64 value *is*
  its exact sum, rounded once to the dtype at the end (bf16/fp16 through fp32 made
  round-to-odd: a correctly rounded result from a value with at least two more bits). A tile
  that fails is summed again with the same certificate per column (the sum of magnitudes).
  Non-finite terms fail both. The loops are straight and vectorise; the integer reductions
  cost almost nothing where floating-point ones would not vectorise at all.
- Fast path for fp64 data: the terms summed by TwoSum into a pair (the rounded sum and the
  sum of its rounding errors), with the same largest and smallest magnitudes;
  ``count**2 * largest <= smallest * 2**52`` proves that the errors' sum never rounded, so
  the pair's sum is exact and one fp64 addition rounds it (``tile_certified`` proves it;
  per column ``count * mass``). A span of 2**32 for 1024 terms: most gradients again. A MEAN
  of the pair is rounded by ``pair_quotient`` (integer comparisons with the midpoints around
  the fp64 quotient), or in the limbs where it declines.
- Every other column (both certificates failed) is summed again from its
  terms into limbs, one column at a time, with integer adds only, then rounded from the
  integer (``limbs.round_units``). A MEAN of fp32 terms divides its certified fp64 sum in
  fp64 and rounds that quotient, which rounds as the exact one does for counts below
  2**(53 - p), p the dtype's precision (``rounded_quotient`` proves it); a larger count puts
  the sum into limbs to divide there. Every way gives the exact value, so which one ran
  never shows in the bits.
- Two stages, two compiled kernels per format and reduction (``_exact_block_kernel``): the
  first writes the tiles the whole-tile certificate covers and marks the others; the second,
  compiled on the first launch that marks one, computes the marked tiles by every way above.
- Threads: the work items of ``segment.segment_reduce`` (outer index, segment, column block),
  each output element written by one item. The result would not depend on the split even if
  it did not: that is the point of the rule.
"""

import functools

import numpy as np
import torch
from numba import prange

from .. import EXACT_TARGETS, MEAN, NORMALISE_EVERY, has_exact_work
from .rounding import (
    bf16_bits_to_f32,
    f16_bits_to_f32,
    f32_as_u32,
    f32_to_bf16_bits,
    f32_to_f16_bits,
    f64_as_u64,
    u32_as_f32,
    u64_as_f64,
)
from . import njit, parallel_njit
from .common import _PF_AHEAD, _PF_LINES, _PF_MAX_DIST, _f32, _f64, _flat, _njit_named_for
from .common import _prefetch, block_threads, fused_multiply_add, launch_threads, work_split
from .instances import DONE, OTHER_TYPES, Blocks, call_at, instance, types_key_of
from .limbs import f32_term, f64_in_fp32_units, f64_term, finish, normalise_limbs

# fp64 terms' certificate (see _make_exact_helpers): no partial sum past this magnitude, so
# that no TwoSum overflows.
_WIDE_LIMIT = 2.0**1022

#: The smallest quotient ``pair_quotient`` rounds itself: its steps stay clear of subnormals.
_PAIR_QUOTIENT_MIN = 2.0**-960

__all__ = ["segment_reduce_exact"]


@njit(cache=True, inline="always")
def _sign_of(whole, fraction):
    """The sign (-1, 0 or 1) of ``whole + fraction``, an integer and a value in [0, 1)."""
    if whole > 0 or (whole == 0 and fraction > 0.0):
        return 1
    if whole == 0:
        return 0
    return -1


@njit(cache=True, inline="always")
def pair_quotient(hi, lo, divisor):
    """(RN_fp64((hi + lo) / divisor), True) for an exact sum ``hi + lo`` at most 2**1022 in
    magnitude (fp64 terms' certified TwoSum pair) and an integer ``divisor`` in [1, 2**53);
    (0.0, False) where it does not decide, which the limbs then do: a quotient below
    ``_PAIR_QUOTIENT_MIN``, or one an ulp or more from ``q`` below.

    Why it is right. Let S = hi + lo and n the divisor. TwoSum gives h = RN(S) and l = S - h
    exactly (``hi`` and ``lo`` as they are when ``lo`` is 0, so that a sum of -0.0 keeps its
    sign). Work with |S| (rounding is symmetric) and q: RN(h / n), moved by an estimate of
    (h - q n + l) / n, so within about an ulp of the quotient t = S / n. t rounds to q, to
    q's upper neighbour q + u (u = ulp(q)) or to its lower one q - v (v = u, or u / 2 where q
    is a power of two), as t lies around the midpoints q + u/2 and q - v/2, ties to the even
    one; at q + u or past it, or at q - v or below, the limbs decide. Compare
    D = S - q n = n (t - q) with n u / 2 and -n v / 2, exactly:
    D = (h - P) + l - E, with P = RN(q n) and E = q n - P (one fused multiply-add, exact:
    q n is a multiple of u, far above the subnormals). h - P is exact (Sterbenz: q n is h
    within a few of its ulps). Let Q = u / 4. h, P and E are multiples of u (h and P at least
    q in magnitude, E an error of a multiple of u), so (h - P) / Q and E / Q are integers,
    below 16n and 4n; so are n u / 2 / Q = 2n and n v / 2 / Q (2n or n). l / Q is exact (the
    guard keeps it from the subnormals) and below 8n: its floor is an integer, the rest a
    fraction in [0, 1). So D / Q = (an int64 far from overflow) + (a fraction), and each
    comparison is exact in integers (``_sign_of``). tests/test_exact.py holds it to
    fractions at, beside and between the midpoints."""
    if lo == 0.0:
        h, l = hi, 0.0
    else:
        h = hi + lo
        back = h - hi
        l = (hi - (h - back)) + (lo - back)
    if h == 0.0:
        return h / divisor, True  # S = 0, with the sum's sign
    negative = h < 0.0
    if negative:
        h, l = -h, -l
    q = h / divisor
    # Nearer t with l's share (h - q n is exact by the fused multiply-add): then t is almost
    # never an ulp from q, where the limbs would have to decide.
    q = q + (fused_multiply_add(-q, divisor, h) + l) / divisor
    if not q >= _PAIR_QUOTIENT_MIN:
        return 0.0, False
    bits = f64_as_u64(q)
    up = u64_as_f64(np.uint64(bits + np.uint64(1))) - q
    down = q - u64_as_f64(np.uint64(bits - np.uint64(1)))
    quantum = 0.25 * up
    if l != 0.0 and abs(l) < quantum * 2.0**-900:
        return 0.0, False  # l / quantum could lose bits to the subnormals
    product = q * divisor
    error = fused_multiply_add(q, divisor, -product)
    scaled_l = l / quantum
    whole_l = np.floor(scaled_l)
    fraction = scaled_l - whole_l
    d = (np.int64((h - product) / quantum) - np.int64(error / quantum) + np.int64(whole_l))
    n = np.int64(divisor)
    half_up = 2 * n
    half_down = 2 * n if down == up else n
    above = _sign_of(d - half_up, fraction)  # t against the midpoint above q
    below = _sign_of(d + half_down, fraction)  # and against the one below
    even = (bits & np.uint64(1)) == 0
    result = bits
    if above > 0:
        if _sign_of(d - 2 * half_up, fraction) >= 0:
            return 0.0, False
        result = np.uint64(bits + np.uint64(1))
    elif above == 0:
        result = bits if even else np.uint64(bits + np.uint64(1))
    elif below < 0:
        if _sign_of(d + 2 * half_down, fraction) <= 0:
            return 0.0, False
        result = np.uint64(bits - np.uint64(1))
    elif below == 0:
        result = bits if even else np.uint64(bits - np.uint64(1))
    value = u64_as_f64(result)
    return (-value if negative else value), True

# ---- one format's kernel ---------------------------------------------------------------------


@functools.cache  # one set per format: two would share their names
def _make_exact_helpers(fmt, dec, enc, cvt, wide_data, targets):
    """The helpers of the EXACT ``_exact_block_kernel`` for data format ``fmt`` (see
    ``segment._make_rows`` for ``dec``, ``enc`` and ``cvt``, and for why they are compile-time
    constants), which rounds to ``targets`` (its dtype's ``EXACT_TARGETS``)."""
    precision, min_quantum, unit_exponent, n_limbs = targets
    narrow = fmt in ("bf16", "f16")
    term_into = f64_term if wide_data else f32_term
    format_njit = _njit_named_for(f"exact_{fmt}")
    # Magnitudes compare as the bit patterns of the terms' acc type (those of nonnegative
    # values order as the values): the largest starts at NO_TOP, the smallest nonzero one at
    # NO_BOTTOM (see tile_row); INF_BITS is the first pattern past every finite magnitude.
    bits_type = np.uint64 if wide_data else np.uint32
    magnitude_mask = bits_type(0x7FFFFFFFFFFFFFFF if wide_data else 0x7FFFFFFF)
    inf_bits = bits_type(0x7FF0000000000000 if wide_data else 0x7F800000)
    no_top, no_bottom, one_bit = bits_type(0), ~bits_type(0), bits_type(1)

    @format_njit(inline="always")
    def magnitude_bits(t):
        # (Numba widens integer arithmetic to 64 bits: each result is cast back.)
        if wide_data:
            return bits_type(f64_as_u64(t) & magnitude_mask)
        return bits_type(f32_as_u32(t) & magnitude_mask)

    @format_njit(inline="always")
    def magnitude_value(bits):
        if wide_data:
            return u64_as_f64(bits)
        return np.float64(u32_as_f32(bits))

    @format_njit(inline="always")
    def tile_certified(top, bottom, count, headroom):
        """Whether a tile's fast-path sums are exact, from its largest and smallest nonzero
        magnitudes (``tile_row``'s bits) and its count of terms.

        fp32 terms (bf16, fp16, fp32 data): each is a multiple of ulp(the smallest nonzero
        magnitude) >= smallest * 2**-term_bits, every partial sum is at most count * largest,
        and fp64 holds every multiple of that ulp up to 2**53 of them (a factor 2 to spare
        covers the rounding of count * largest): ``count * largest <= smallest * headroom``.

        fp64 terms: summed with TwoSum into (hi, lo), hi + lo is the exact partial sum as long
        as each lo + e is exact. All of hi, the terms and each error e are multiples of
        u = ulp(smallest) >= smallest * 2**-52 (a rounded multiple of u is one), so lo + e is
        exact while |lo + e| <= 2**53 u. Each |e| <= 2**-53 |hi| <~ 2**-53 count * largest,
        so |lo| <~ count**2 * largest * 2**-53: ``count**2 * largest <= smallest * 2**52``
        holds it there with a factor 4 to spare (for the roundings of the bound itself).
        ``_WIDE_LIMIT`` keeps every partial sum, and so TwoSum, clear of overflow. An inf or
        NaN term makes the largest magnitude's bits INF_BITS or more, and fails both."""
        if top >= inf_bits:
            return False
        if bottom == no_bottom:
            return True  # every term is zero
        largest = magnitude_value(top)
        smallest = magnitude_value(bits_type(bottom + one_bit))
        c = np.float64(count)
        if wide_data:
            return c * largest <= _WIDE_LIMIT and c * c * largest <= smallest * 2.0**52
        return c * largest <= smallest * headroom

    @format_njit(inline="always")
    def column_certified(mass, least, count, headroom):
        """``tile_certified`` for one column, from its sum of magnitudes ``mass`` (which bounds
        every partial sum) and its smallest nonzero magnitude ``least``. mass is inf or NaN
        when a term is: never exact (inf <= inf would hold)."""
        if wide_data:
            return mass <= _WIDE_LIMIT and np.float64(count) * mass <= least * 2.0**52
        return mass <= least * headroom and mass < np.inf

    @format_njit(inline="always")
    def final_rounding(s):
        """RN_dtype of the exact fp64 value ``s`` (a sum of fp32 values), as a data element.

        Branch-free (selects), so that the loop over a row's columns vectorises."""
        f = np.float32(s)
        if narrow:
            # Round to odd: when f is inexact and even, the other (odd) fp32 neighbour of s,
            # one step away from zero or toward it (the bits are sign and magnitude). An
            # overflow to inf stays inf.
            back = np.float64(f)
            bits = np.int64(f32_as_u32(f))
            step = np.int64(1) if abs(s) > abs(back) else np.int64(-1)
            odd_fix = (back != s) & ((bits & 0x7F800000) != 0x7F800000) & ((bits & 1) == 0)
            f = u32_as_f32(np.uint32(bits + step if odd_fix else bits))
        return enc(f)

    @format_njit(inline="always")
    def two_sum(a, b):
        """(RN(a + b), the exact error a + b - RN(a + b)): Knuth's TwoSum, without branches
        (so that a loop over a row's columns vectorises)."""
        total = a + b
        back = total - a
        return total, (a - (total - back)) + (b - back)

    @format_njit(inline="always")
    def rounded_sum(hi, lo):
        """RN_dtype of a certified exact sum, as a data element: the fp64 ``hi`` (fp32 terms),
        or ``hi + lo`` (fp64 terms, TwoSum's pair: one addition rounds it once; ``hi`` alone
        when ``lo`` is 0, which keeps the sign of a sum of -0.0 terms)."""
        if wide_data:
            return hi if lo == 0.0 else hi + lo
        return final_rounding(hi)

    @format_njit(inline="always")
    def tile_row(acc, a, start, w, alpha, top, bottom):
        """acc += the row's terms, the first of a tile (acc is -0.0, so each sum is exact even
        for fp64 terms); returns the largest magnitude's bits and the smallest nonzero
        magnitude's bits minus one, both over the row and the given ones (0 - 1 wraps to the
        top and drops out of the minimum). Integer reductions vectorise; floating-point ones
        would not."""
        u = np.uint64(start)
        for j in range(w):
            t = dec(a[u + np.uint64(j)]) * alpha
            acc[j] += np.float64(t)
            magnitude = magnitude_bits(t)
            top = max(top, magnitude)
            bottom = min(bottom, bits_type(magnitude - one_bit))
        return top, bottom

    @format_njit(inline="always")
    def fast_row(acc, mass, least, a, start, w, alpha):
        u = np.uint64(start)
        for j in range(w):
            t = np.float64(dec(a[u + np.uint64(j)]) * alpha)
            m = abs(t)
            acc[j] += t
            mass[j] += m
            least[j] = min(least[j], m if m != 0.0 else np.inf)

    @format_njit()
    def column(src, ss, order, ost, base, bs, o, s, j, p0, p1, use_base, is_mean, alpha,
               limbs, flags):
        """One output element from its terms, through the limbs."""
        for i in range(n_limbs):
            limbs[i] = 0
        for i in range(4):
            flags[i] = 0
        if use_base:
            term_into(limbs, dec(base[o * bs[0] + s * bs[1] + j * bs[2]]), flags)
        start = o * ss[0] + j * ss[2]
        since_normalised = 0
        for p in range(p0, p1):
            row = order[p * ost] if ost >= 0 else p
            term_into(limbs, dec(src[start + row * ss[1]]) * alpha, flags)
            since_normalised += 1
            if since_normalised == NORMALISE_EVERY:
                normalise_limbs(limbs, n_limbs)
                since_normalised = 0
        count = (p1 - p0) + (1 if use_base else 0)
        return finish(limbs, n_limbs, flags, count, is_mean, precision, min_quantum,
                       unit_exponent)

    @format_njit()
    def exact_value_of_sum(s, lo, count, is_mean, limbs, flags):
        """The rounded mean over ``count`` of the exact sum ``s`` (fp32 terms) or ``s + lo``
        (fp64 terms, TwoSum's pair), as an fp64."""
        for i in range(n_limbs):
            limbs[i] = 0
        for i in range(4):
            flags[i] = 0
        if wide_data:
            f64_term(limbs, s, flags)
            if lo != 0.0:  # (a -0.0 sum stays one)
                f64_term(limbs, lo, flags)
        else:
            f64_in_fp32_units(limbs, s, flags)
        return finish(limbs, n_limbs, flags, count, is_mean, precision, min_quantum,
                       unit_exponent)

    @format_njit(inline="always")
    def rounded_quotient(s, divisor):
        """RN_dtype(s / divisor) for an exact fp64 sum ``s`` (a certified tile's) and an
        integer ``divisor`` below ``2**(53 - p)`` (``quotient_divisors``; p the dtype's
        precision: 2**29 for fp32), as a data element, through the fp64 quotient
        q = RN_fp64(s / divisor). A larger divisor takes the limbs.

        Why q's rounding is the exact quotient t's: rounding to the dtype changes value only
        at its rounding midpoints (and the overflow threshold), each an fp64 number. One
        strictly between q and t would be an fp64 number nearer t than q; so the two round
        apart only where q is a midpoint m and t is not. Then s - divisor * m is not zero and
        is a multiple of the finer of s's fp64 unit (2**(E_s - 52), E_s the exponent of s)
        and m's last bit (2**(E_m - p), p the dtype's precision; a subnormal midpoint's is
        coarser than that), so |t - m| is at least that over the divisor: more
        than half of m's fp64 ulp, 2**(E_m - 53), since 2**(E_s + 1) > s ~ divisor * m >
        divisor * 2**E_m (a midpoint is no power of two), and since divisor < 2**(53 - p).
        But q = m needs |t - m| at most half an ulp. Branch-free, so that a loop over a
        tile's columns vectorises. (tests/test_exact.py tries quotients near midpoints.)"""
        return final_rounding(s / divisor)

    def tile_sums(per_column):
        """The pass over a tile: per_column False gives ``tile_pass``, True ``column_pass``
        (each inlined where it is called: an argument would leave both loops in each copy)."""

        @_njit_named_for(f"exact_{fmt}_{'columns' if per_column else 'tile'}")(inline="always")
        def fast_pass(src, ss, order, ost, base, bs, o, s, j0, w, p0, p1, use_base, alpha, acc,
                      lo, tmp, n_positions, pf_dist, pf_step, mass, least):
            """acc = the fp64 sum of a tile's init and terms (columns j0 .. j0 + w - 1 of one
            segment); for fp64 terms acc + lo, by ``two_sum`` (acc the rounded sums, lo the sum
            of their errors). per_column: also each column's sum of
            magnitudes (mass) and smallest nonzero magnitude (least); otherwise returns the
            tile's (top, bottom) of ``tile_row``."""
            one = cvt(1.0)  # the init row is not scaled
            top = no_top
            bottom = no_bottom
            if wide_data:
                for j in range(w):
                    lo[j] = 0.0
            if use_base:
                # The init row is one more term, starting each column's sum.
                bstart = o * bs[0] + s * bs[1] + j0 * bs[2]
                if bs[2] != 1:
                    for j in range(w):
                        tmp[j] = base[bstart + j * bs[2]]
                for j in range(w):
                    acc[j] = -0.0
                if per_column:
                    for j in range(w):
                        mass[j] = 0.0
                        least[j] = np.inf
                    fast_row(acc, mass, least, base if bs[2] == 1 else tmp,
                             bstart if bs[2] == 1 else 0, w, one)
                else:
                    top, bottom = tile_row(acc, base if bs[2] == 1 else tmp,
                                           bstart if bs[2] == 1 else 0, w, one, top, bottom)
            else:
                for j in range(w):
                    acc[j] = -0.0  # IEEE's additive identity: a sum of -0.0 stays -0.0
            if per_column and not use_base:
                for j in range(w):
                    mass[j] = 0.0
                    least[j] = np.inf
            rstart = o * ss[0] + j0 * ss[2]
            strided = ss[2] != 1
            # Rows with unit column stride are read in place, others gathered into tmp first.
            row = tmp if strided else src
            pf_lines = (min(_PF_LINES, (w + pf_step - 1) // pf_step)
                        if ost >= 0 and not strided else 0)
            # The loop below spells out fast_row and tile_row: an inlined call with array
            # arguments costs about 10 ns a row (see segment.py's combine_term_rows), as much
            # as a narrow row.
            for p in range(p0, p1):
                if p + pf_dist < n_positions and pf_lines:
                    # The rows of a segment lie anywhere in src: ask for the one pf_dist
                    # positions ahead (next segments' rows too) while this one is added.
                    ahead = rstart + order[(p + pf_dist) * ost] * ss[1]
                    for k in range(pf_lines):
                        _prefetch(src, ahead + k * pf_step)
                start = rstart + (order[p * ost] if ost >= 0 else p) * ss[1]
                if strided:
                    for j in range(w):
                        tmp[j] = src[start + j * ss[2]]
                    start = 0
                u = np.uint64(start)
                if per_column:
                    for j in range(w):
                        t = np.float64(dec(row[u + np.uint64(j)]) * alpha)
                        m = abs(t)
                        if wide_data:
                            acc[j], error = two_sum(acc[j], t)
                            lo[j] += error
                        else:
                            acc[j] += t
                        mass[j] += m
                        least[j] = min(least[j], m if m != 0.0 else np.inf)
                else:
                    for j in range(w):
                        t = dec(row[u + np.uint64(j)]) * alpha
                        if wide_data:
                            acc[j], error = two_sum(acc[j], t)
                            lo[j] += error
                        else:
                            acc[j] += np.float64(t)
                        magnitude = magnitude_bits(t)
                        top = max(top, magnitude)
                        bottom = min(bottom, bits_type(magnitude - one_bit))
            return top, bottom

        return fast_pass

    tile_pass = tile_sums(False)
    column_pass = tile_sums(True)

    return (rounded_sum, tile_certified, column_certified, tile_pass, column_pass, column,
            exact_value_of_sum, rounded_quotient)


def _exact_block_kernel(b, src, ss, order, ost, offsets, fst, base, bs, out, us, shape, alpha,
                        include_base, has_base, chunk, acc_scratch, data_scratch, limb_scratch,
                        flag_scratch, n_positions, pf_dist, pending):
    """Items [b * n / B, (b + 1) * n / B) of the n items (outer index, segment, column
    block), with block b's scratch: the template of every format's kernels, for sums and for
    means, in two stages. ``instances.instance`` binds ``is_mean``, ``first_stage``, the
    format's ``enc``, ``cvt``, ``wide_data`` (fp64 terms, summed by TwoSum), ``data_bits``
    (significant bits of a data element) and ``quotient_divisors`` (the counts whose means
    ``rounded_quotient`` takes), and the helpers of :func:`_make_exact_helpers`.

    The first stage writes the items that tier 1 certifies and marks the others in
    ``pending``, writing nothing of them; the second takes the marked items alone, by every
    other way. Why two: the second stage's code
    (the per-column certificate, the limbs of every term) is most of the kernel, and rarely
    needed: it compiles on the first launch that needs it. (A certified tile's mean is
    settled in the first stage, from its fp64 sum: ``rounded_quotient``; fp64 terms' mean
    divides in the limbs, from the two parts of its sum.) An item's elements
    are read (from base) and written by that item alone, so the second stage reads a base
    that the first left untouched, in place too."""
    outer, nseg, inner = shape
    pf_step = 64 // src.itemsize
    headroom = 2.0 ** (52 - (data_bits if alpha == 1.0 else 24))
    use_base = has_base and include_base
    a = cvt(alpha)
    nchunks = (inner + chunk - 1) // chunk
    n_items = outer * nseg * nchunks
    n_blocks = acc_scratch.shape[0]
    acc = acc_scratch[b, 0]
    mass = acc_scratch[b, 1]
    least = acc_scratch[b, 2]
    lo = acc_scratch[b, 3]
    exact_here = flag_scratch[b, 4:]
    tmp = data_scratch[b]
    limbs = limb_scratch[b]
    flags = flag_scratch[b, :4]
    for it in range(b * n_items // n_blocks, (b + 1) * n_items // n_blocks):
        if not first_stage and pending[it] == 0:
            continue
        c = it % nchunks
        s = (it // nchunks) % nseg
        o = it // nchunks // nseg
        j0 = c * chunk
        j1 = min(j0 + chunk, inner)
        w = j1 - j0
        p0 = offsets[s * fst]
        p1 = offsets[(s + 1) * fst]
        ostart = o * us[0] + s * us[1] + j0 * us[2]
        if p1 == p0 and not use_base:
            if has_base:
                bstart = o * bs[0] + s * bs[1] + j0 * bs[2]
                for j in range(w):
                    out[ostart + j * us[2]] = base[bstart + j * bs[2]]
            else:
                zero = enc(cvt(0.0))
                for j in range(w):
                    out[ostart + j * us[2]] = zero
            continue
        count = (p1 - p0) + (1 if use_base else 0)
        if first_stage:
            # Tier 1: one certificate for the whole tile (``tile_certified``).
            top, bottom = tile_pass(src, ss, order, ost, base, bs, o, s, j0, w, p0, p1,
                                    use_base, a, acc, lo, tmp, n_positions, pf_dist, pf_step,
                                    mass, least)
            tile_exact = tile_certified(top, bottom, count, headroom)
            if tile_exact and not is_mean:
                # The common case: one straight loop writes the whole tile.
                if us[2] == 1:
                    u = np.uint64(ostart)
                    for j in range(w):
                        out[u + np.uint64(j)] = rounded_sum(acc[j], lo[j])
                else:
                    for j in range(w):
                        out[ostart + j * us[2]] = rounded_sum(acc[j], lo[j])
                continue
            if is_mean and tile_exact:
                divisor = np.float64(count)
                if wide_data:
                    for j in range(w):
                        value, decided = pair_quotient(acc[j], lo[j], divisor)
                        if not decided:
                            value = exact_value_of_sum(acc[j], lo[j], count, True, limbs,
                                                       flags)
                        out[ostart + j * us[2]] = enc(cvt(value))
                elif divisor >= quotient_divisors:
                    for j in range(w):
                        out[ostart + j * us[2]] = enc(cvt(exact_value_of_sum(
                            acc[j], lo[j], count, True, limbs, flags)))
                elif us[2] == 1:
                    # Unit stride spelled out, so that the loop vectorises.
                    u = np.uint64(ostart)
                    for j in range(w):
                        out[u + np.uint64(j)] = rounded_quotient(acc[j], divisor)
                else:
                    for j in range(w):
                        out[ostart + j * us[2]] = rounded_quotient(acc[j], divisor)
                continue
            pending[it] = 1
            continue
        # Tier 2 (tier 1 failed this tile in the first stage): the same certificate per
        # column, with the sum of magnitudes (``column_certified``).
        column_pass(src, ss, order, ost, base, bs, o, s, j0, w, p0, p1, use_base, a, acc, lo,
                    tmp, n_positions, pf_dist, pf_step, mass, least)
        for j in range(w):
            exact_here[j] = column_certified(mass[j], least[j], count, headroom)
        divisor = np.float64(count)
        for j in range(w):
            if exact_here[j] and not is_mean:
                value = rounded_sum(acc[j], lo[j])
            elif exact_here[j] and not wide_data and divisor < quotient_divisors:
                value = rounded_quotient(acc[j], divisor)
            elif exact_here[j]:
                quotient, decided = (pair_quotient(acc[j], lo[j], divisor) if wide_data
                                     else (0.0, False))
                if not decided:
                    quotient = exact_value_of_sum(acc[j], lo[j], count, True, limbs, flags)
                value = enc(cvt(quotient))
            else:
                exact = column(src, ss, order, ost, base, bs, o, s, j0 + j, p0, p1, use_base,
                               is_mean, a, limbs, flags)
                # The value is the dtype's already (or +-inf, or NaN): converting is exact.
                value = enc(cvt(exact))
            out[ostart + j * us[2]] = value


@parallel_njit(cache=True)
def _run_blocks(address, types_key, failed, src, ss, order, ost, offsets, fst, base, bs, out,
                us, shape, alpha, include_base, has_base, chunk, acc_scratch, data_scratch,
                limb_scratch, flag_scratch, n_positions, pf_dist, pending):
    """The driver of every format's kernel, ``_exact_block_kernel`` at ``address``
    (``instances.Blocks``): each output element is written by one item, and its value
    depends on no order."""
    if types_key_of((src, ss, order, ost, offsets, fst, base, bs, out, us, shape, alpha,
                     include_base, has_base, chunk, acc_scratch, data_scratch, limb_scratch,
                     flag_scratch, n_positions, pf_dist, pending)) != types_key:
        return OTHER_TYPES
    for b in prange(failed.shape[0]):
        if not call_at(address, np.int64(b), (
                src, ss, order, ost, offsets, fst, base, bs, out, us, shape, alpha,
                include_base, has_base, chunk, acc_scratch, data_scratch, limb_scratch,
                flag_scratch, n_positions, pf_dist, pending)):
            failed[b] = 1
    return DONE


#: Per data format: its name and its conversions (see ``segment._make_rows``).
_FORMATS = {
    torch.float32: ("f32", _f32, _f32, _f32),
    torch.float64: ("f64", _f64, _f64, _f64),
    torch.bfloat16: ("bf16", bf16_bits_to_f32, f32_to_bf16_bits, _f32),
    torch.float16: ("f16", f16_bits_to_f32, f32_to_f16_bits, _f32),
}

#: (dtype, is_mean, first_stage) -> the kernel, made on the first launch that needs it.
_KERNELS = {}


def kernel_for(dtype, is_mean, first_stage):
    """The EXACT kernel of data type ``dtype``, for sums or for means, of the first stage or
    the second (see ``_exact_block_kernel``), launched over thread blocks (``instances.Blocks``)."""
    kernel = _KERNELS.get((dtype, is_mean, first_stage))
    if kernel is None:
        fmt, dec, enc, cvt = _FORMATS[dtype]
        precision = EXACT_TARGETS[dtype][0]
        wide_data = fmt == "f64"  # fp64 terms: the fast path sums by TwoSum
        (rounded_sum, tile_certified, column_certified, tile_pass, column_pass, column,
         exact_value_of_sum, rounded_quotient) = _make_exact_helpers(
            fmt, dec, enc, cvt, wide_data, EXACT_TARGETS[dtype])
        block_kernel = instance(
            _exact_block_kernel,
            f"{fmt}_{'mean' if is_mean else 'sum'}_{'first' if first_stage else 'second'}",
            is_mean=is_mean, first_stage=first_stage, enc=enc, cvt=cvt, wide_data=wide_data,
            # Significant bits of a data element: the terms have that many when alpha == 1.
            data_bits=precision,
            # Counts whose means rounded_quotient takes (see there): 2**(53 - precision).
            quotient_divisors=2.0 ** (53 - precision),
            rounded_sum=rounded_sum, tile_certified=tile_certified,
            column_certified=column_certified, tile_pass=tile_pass, column_pass=column_pass,
            column=column,
            exact_value_of_sum=exact_value_of_sum, rounded_quotient=rounded_quotient)
        kernel = Blocks(_run_blocks, block_kernel)
        _KERNELS[(dtype, is_mean, first_stage)] = kernel
    return kernel


def segment_reduce_exact(src, order, offsets, base, out, *, reduce, alpha, include_base):
    """``segment.segment_reduce`` for ``rule == EXACT`` (see the module docstring)."""
    if not has_exact_work(src, order, offsets, reduce, _FORMATS,
                          include_base and base is not None):
        return
    outer, _, inner = src.shape
    nseg = offsets.shape[0] - 1
    positions = order.shape[0] if order is not None else src.shape[1]
    n_limbs = EXACT_TARGETS[src.dtype][3]
    src_np, ss = _flat(src)
    out_np, us = _flat(out)
    offsets_np, (fst,) = _flat(offsets)
    base_np, bs = _flat(base) if base is not None else (out_np, us)
    order_np, (ost,) = _flat(order) if order is not None else (offsets_np, (-1,))

    nthreads = launch_threads()
    chunk, n_blocks = work_split(outer * nseg, inner, nthreads, outer * positions)
    acc_scratch = np.empty((n_blocks, 4, chunk), dtype=np.float64)
    data_scratch = np.empty((n_blocks, chunk), dtype=src_np.dtype)
    limb_scratch = np.empty((n_blocks, n_limbs), dtype=np.int64)
    flag_scratch = np.empty((n_blocks, 4 + chunk), dtype=np.int64)
    pf_dist = min(_PF_MAX_DIST, max(1, _PF_AHEAD // (chunk * src.element_size())))
    n_items = outer * nseg * -(-inner // chunk)
    pending = np.zeros(n_items, dtype=np.uint8)
    args = (src_np, ss, order_np, ost, offsets_np, fst, base_np, bs, out_np, us,
            (outer, nseg, inner), float(alpha), bool(include_base), base is not None, chunk,
            acc_scratch, data_scratch, limb_scratch, flag_scratch, positions, pf_dist, pending)
    with block_threads(n_blocks, nthreads):
        kernel_for(src.dtype, reduce == MEAN, True)(n_blocks, args)
        if pending.any():
            kernel_for(src.dtype, reduce == MEAN, False)(n_blocks, args)
