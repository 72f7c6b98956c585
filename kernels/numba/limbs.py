"""The integer state of the EXACT rule on Numba: an integer count of units in int64 limbs
(``detsum.kernels``, EXACT STATE), with the terms deposited into it, its normalisation, and its
correctly rounded value with IEEE's special values. ``exact.py``'s kernels and
``exact_state.py``'s running states both compute with these.

The kernels inline these helpers or link them in when they compile, so Numba's on-disk
cache of a kernel does not see a change here (it checks only the timestamp of the kernel's own
file): after editing this file, delete ``kernels/numba/__pycache__`` to drop stale kernels.
"""

import math

import numpy as np

from .. import LIMB_BITS
from . import njit
from .rounding import f32_as_u32, f64_as_u64

DIGIT_MASK = (1 << LIMB_BITS) - 1



@njit(cache=True, inline="always")
def deposit(limbs, significand, shift, negative):
    """Add (or subtract) ``significand * 2**shift`` units: significand < 2**53, shift >= 0.

    The shifted significand is cut into 32-bit digits at the limb boundaries; each digit added
    is below 2**33 (see MAX_TERMS_PER_STATE). No carry is propagated.
    """
    k = shift >> 5
    r = shift & 31
    low = (significand & DIGIT_MASK) << r
    high = (significand >> 32) << r
    d0 = low & DIGIT_MASK
    d1 = (low >> 32) + (high & DIGIT_MASK)
    d2 = high >> 32
    if negative:
        d0, d1, d2 = -d0, -d1, -d2
    limbs[k] += d0
    if d1 != 0:
        limbs[k + 1] += d1
    if d2 != 0:
        limbs[k + 2] += d2


@njit(cache=True, inline="always")
def normalise_limbs(limbs, n):
    """Carry every limb but the last into [0, 2**32); the value is unchanged."""
    for i in range(n - 1):
        v = limbs[i]
        carry = v >> 32  # arithmetic: floor(v / 2**32)
        limbs[i] = v & DIGIT_MASK
        limbs[i + 1] += carry


@njit(cache=True, inline="always")
def f32_term(limbs, t, flags):
    """Deposit the fp32 value ``t``; record NaN / +inf / -inf / non-(-0.0) in ``flags``."""
    bits = np.int64(f32_as_u32(np.float32(t)))
    exponent = (bits >> 23) & 0xFF
    significand = bits & 0x7FFFFF
    negative = (bits >> 31) != 0
    if exponent == 0xFF:
        if significand != 0:
            flags[0] = 1
        elif negative:
            flags[2] = 1
        else:
            flags[1] = 1
        flags[3] = 1
        return
    if not negative or exponent != 0 or significand != 0:
        flags[3] = 1  # not -0.0
    if exponent == 0:
        deposit(limbs, significand, np.int64(0), negative)
    else:
        deposit(limbs, significand | 0x800000, exponent - 1, negative)


@njit(cache=True, inline="always")
def f64_term(limbs, t, flags):
    """Deposit the fp64 value ``t`` (as ``f32_term``)."""
    bits = f64_as_u64(np.float64(t))
    exponent = np.int64((bits >> np.uint64(52)) & np.uint64(0x7FF))
    significand = np.int64(bits & np.uint64(0xFFFFFFFFFFFFF))
    negative = (bits >> np.uint64(63)) != np.uint64(0)
    if exponent == 0x7FF:
        if significand != 0:
            flags[0] = 1
        elif negative:
            flags[2] = 1
        else:
            flags[1] = 1
        flags[3] = 1
        return
    if not negative or exponent != 0 or significand != 0:
        flags[3] = 1
    if exponent == 0:
        deposit(limbs, significand, np.int64(0), negative)
    else:
        deposit(limbs, significand | (np.int64(1) << 52), exponent - 1, negative)


@njit(cache=True, inline="always")
def f64_in_fp32_units(limbs, s, flags):
    """Deposit the fp64 value ``s``, a finite multiple of 2**-149 below 2**170 in magnitude,
    into limbs of fp32 units (as ``f32_term``)."""
    bits = f64_as_u64(np.float64(s))
    exponent = np.int64((bits >> np.uint64(52)) & np.uint64(0x7FF))
    significand = np.int64(bits & np.uint64(0xFFFFFFFFFFFFF))
    negative = (bits >> np.uint64(63)) != np.uint64(0)
    if not negative or exponent != 0 or significand != 0:
        flags[3] = 1
    if exponent == 0:
        return  # an fp64 subnormal is no multiple of 2**-149 but 0
    # s = significand * 2**(exponent - 1075) = significand * 2**(exponent - 926) units; a
    # negative shift only drops zero bits, since s is a whole number of units.
    shift = exponent - 926
    significand |= np.int64(1) << 52
    if shift < 0:
        significand >>= -shift
        shift = 0
    deposit(limbs, significand, shift, negative)


@njit(cache=True, inline="always")
def limb_bits(limbs, n, start, count):
    """Bits [start, start + count) of the normalised nonnegative integer, count <= 62."""
    result = np.int64(0)
    got = 0
    while got < count:
        pos = start + got
        i = pos >> 5
        r = pos & 31
        take = min(32 - r, count - got)
        if i < n:
            result |= ((limbs[i] >> r) & ((np.int64(1) << take) - 1)) << got
        got += take
    return result


@njit(cache=True, inline="always")
def any_below(limbs, pos):
    """Whether any bit below ``pos`` of the normalised nonnegative integer is set."""
    i = pos >> 5
    r = pos & 31
    if r != 0 and (limbs[i] & ((np.int64(1) << r) - 1)) != 0:
        return True
    for j in range(i):
        if limbs[j] != 0:
            return True
    return False


@njit(cache=True)
def round_units(limbs, n, precision, min_quantum, unit_exponent, half_below, sticky_below):
    """RN of ``N * 2**unit_exponent`` to ``precision`` bits with quantum >= ``2**min_quantum``
    units, as an fp64 (exact: the rounded value has at most 54 bits; inf beyond fp64's range).

    ``limbs``: N, normalised and nonnegative. ``half_below`` / ``sticky_below``: the value is
    N plus a fraction of a unit (a quotient's), whose top bit and whether any other bit of it
    is set; both False for a sum.
    """
    top = n - 1
    while top >= 0 and limbs[top] == 0:
        top -= 1
    length = 0
    if top >= 0:
        length = LIMB_BITS * top + math.frexp(np.float64(limbs[top]))[1]
    # min_quantum >= 0: no format's quantum is below the unit.
    quantum = max(length - precision, min_quantum)
    if quantum == 0:
        significand = limb_bits(limbs, n, 0, length)
        half = half_below
        sticky = sticky_below
    else:
        significand = limb_bits(limbs, n, quantum, max(length - quantum, 0))
        half = quantum - 1 < length and limb_bits(limbs, n, quantum - 1, 1) != 0
        sticky = half_below or sticky_below or any_below(limbs, quantum - 1)
    if half and (sticky or (significand & 1) != 0):
        significand += 1
    return math.ldexp(np.float64(significand), quantum + unit_exponent)


@njit(cache=True)
def finish(limbs, n, flags, count, is_mean, precision, min_quantum, unit_exponent):
    """The rounded sum (or mean over ``count``) of a column's limbs and flags, as an fp64."""
    if flags[0] != 0 or (flags[1] != 0 and flags[2] != 0):
        return np.nan
    if flags[1] != 0:
        return np.inf
    if flags[2] != 0:
        return -np.inf
    normalise_limbs(limbs, n)
    negative = limbs[n - 1] < 0
    if negative:
        for i in range(n):
            limbs[i] = -limbs[i]
        normalise_limbs(limbs, n)
    half_below = False
    sticky_below = False
    if is_mean:
        # Long division by the count, top limb first: remainder < count <= 2**30, so every
        # partial dividend fits in int64; the digits of the quotient stay below 2**32. One
        # more digit, below the unit, holds the rounding bit when the result's quantum is
        # the unit itself (subnormal results).
        remainder = np.int64(0)
        for i in range(n - 1, -1, -1):
            partial = (remainder << 32) | limbs[i]
            limbs[i] = partial // count
            remainder = partial % count
        fraction = (remainder << 32) // count
        half_below = (fraction >> 31) != 0
        sticky_below = (fraction & 0x7FFFFFFF) != 0 or (remainder << 32) % count != 0
    magnitude = round_units(limbs, n, precision, min_quantum, unit_exponent, half_below,
                             sticky_below)
    if flags[3] == 0:
        return -0.0  # every term was -0.0
    # A nonzero value that rounds to zero keeps its sign; an exact zero is +0.0.
    return -magnitude if negative else magnitude
