"""The exact state of a running sum, in torch integer ops (any device): add terms, normalise,
round. On CPU, under the numba backend, kernels compute the same integers per element in one
pass (``kernels/numba/exact_state.py``); ``detsum._kernel_ops`` picks which runs, and the
consumers call it, not these functions, for those three steps.

Layout and limits are those of ``detsum.kernels`` (EXACT STATE): a sum is an integer ``N`` of
units (``2**-149`` for fp32 terms, ``2**-1074`` for fp64 terms) in int64 limbs of ``LIMB_BITS``
bits, little end first. Next to the limbs each element keeps four counters, because IEEE's
special values are not numbers of units: how many terms were NaN, +inf, -inf, and how many
were anything but -0.0. Everything is a count or a sum of integers, so the state of a sum over
two sets of rows is the elementwise integer sum of their states, in any order.

A state is ``[limbs + COUNTERS, numel]`` int64: row ``i < L`` holds limb ``i`` of every
element, then the rows ``nan, +inf, -inf, not -0.0``. Limb-major, because every step here
(carrying, rounding, a window of limbs sent to other ranks) works on one limb of every element
at a time: a contiguous row. ``RunningSum.state()`` lists it element by element. The kernels
compute the same values from the same integers (``detsum/kernels/numba/limbs.py``, for
``exact.py`` and ``exact_state.py``); tests check that both round every state alike.
"""

from __future__ import annotations

import torch

from detsum.modes import EXACT_LIMBS, EXACT_TARGETS, LIMB_BITS, MAX_TERMS_PER_STATE

COUNTERS = 4
NAN, POS_INF, NEG_INF, NOT_NEG_ZERO = range(COUNTERS)
_DIGIT = (1 << LIMB_BITS) - 1

#: Terms decomposed per step: bounds the int64 temporaries (about 8 of this many elements).
_STEP_ELEMENTS = 1 << 22


def limb_count(acc_dtype: torch.dtype) -> int:
    return EXACT_LIMBS["fp64" if acc_dtype == torch.float64 else "fp32"]


def new_state(numel: int, acc_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The state of an empty sum: ``[limbs + COUNTERS, numel]`` zeros."""
    return torch.zeros((limb_count(acc_dtype) + COUNTERS, numel), dtype=torch.int64,
                       device=device)


def add_terms(state: torch.Tensor, terms: torch.Tensor) -> None:
    """Add ``terms`` ``[k, numel]`` (fp32 or fp64, the acc type) into ``state``, in place, and
    normalise it. ``k`` may be anything: the terms go in steps of at most
    ``MAX_TERMS_PER_STATE`` rows, each followed by a normalisation. ``state`` may be a slice
    of columns of a larger state (the elements of one parameter among many)."""
    numel = state.shape[1]
    n_limbs = state.shape[0] - COUNTERS
    rows_per_step = max(1, min(MAX_TERMS_PER_STATE, _STEP_ELEMENTS // max(numel, 1)))
    for start in range(0, terms.shape[0], rows_per_step):
        _add_step(state, n_limbs, terms[start:start + rows_per_step])
        normalise(state[:n_limbs])


def _add_step(state: torch.Tensor, n_limbs: int, terms: torch.Tensor) -> None:
    """Add ``terms`` ``[k, numel]`` (k <= MAX_TERMS_PER_STATE) to ``state``, unnormalised."""
    if terms.dtype == torch.float64:
        bits = terms.contiguous().view(torch.int64)
        exponent = (bits >> 52) & 0x7FF
        significand = bits & ((1 << 52) - 1)
        negative = bits < 0
        top_exponent, implicit = 0x7FF, 1 << 52
    else:
        bits = terms.contiguous().view(torch.int32).to(torch.int64)
        exponent = (bits >> 23) & 0xFF
        significand = bits & 0x7FFFFF
        negative = bits < 0
        top_exponent, implicit = 0xFF, 1 << 23
    special = exponent == top_exponent
    counters = state[n_limbs:]
    counters[NAN] += (special & (significand != 0)).sum(0)
    counters[POS_INF] += (special & (significand == 0) & ~negative).sum(0)
    counters[NEG_INF] += (special & (significand == 0) & negative).sum(0)
    counters[NOT_NEG_ZERO] += (~(negative & (exponent == 0) & (significand == 0))).sum(0)
    # Value = significand * 2**shift units (a subnormal has exponent 0 and no implicit bit).
    significand = torch.where(exponent > 0, significand | implicit, significand)
    significand = torch.where(special, 0, significand)
    shift = (exponent - 1).clamp_min(0)
    limb, within = shift >> 5, shift & 31
    low = (significand & _DIGIT) << within
    high = (significand >> 32) << within
    sign = torch.where(negative, -1, 1)
    digits = (sign * (low & _DIGIT), sign * ((low >> 32) + (high & _DIGIT)), sign * (high >> 32))
    element = torch.arange(state.shape[1], device=state.device).expand_as(limb).reshape(-1)
    for offset, digit in enumerate(digits):
        if offset == 2 and terms.dtype != torch.float64:
            break  # a 24-bit significand never reaches a third limb
        # The clamp only keeps a zero digit in bounds: the highest term reaches limb 8 of 10
        # (fp32 units) or 65 of 67 (fp64).
        row = (limb + offset).clamp_max(n_limbs - 1).reshape(-1)
        # Integer sums: exact in any order, so accumulate=True is deterministic by arithmetic.
        state.index_put_((row, element), digit.reshape(-1), accumulate=True)


def normalise(limbs: torch.Tensor) -> None:
    """Carry every limb (row) but the last into [0, 2**LIMB_BITS), in place; the value is
    unchanged."""
    for i in range(limbs.shape[0] - 1):
        carry = limbs[i] >> LIMB_BITS  # arithmetic shift: floor division
        limbs[i] &= _DIGIT
        limbs[i + 1] += carry


def _bits(limbs: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Bits [start, start + count) of each element's (column's) nonnegative normalised integer
    (count <= 54)."""
    n_limbs = limbs.shape[0]
    result = torch.zeros_like(start)
    got = torch.zeros_like(start)
    for _ in range(3):  # 54 bits span at most 3 limbs
        position = start + got
        index = position >> 5
        within = position & 31
        take = torch.minimum(32 - within, (count - got).clamp_min(0))
        limb = limbs.gather(0, index.clamp_max(n_limbs - 1).unsqueeze(0)).squeeze(0)
        limb = torch.where(index < n_limbs, limb, 0)
        piece = (limb >> within) & ((1 << take) - 1)
        result |= piece << got
        got = got + take
    return result


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2.0**exponent for exponents of fp64 normals, built from the bits (exact)."""
    return ((exponent + 1023) << 52).view(torch.float64)


def _scale(significand: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """significand * 2**exponent, exact whenever the result is an fp64 (inf beyond).

    In two steps of normal powers of two, so that neither step underflows (torch.ldexp goes
    through a power of two in the default float dtype, which cannot hold 2**-1074)."""
    first = exponent // 2
    return significand * _power_of_two(first) * _power_of_two(exponent - first)


def round_state(state: torch.Tensor, acc_dtype: torch.dtype, dtype: torch.dtype,
                count: int | None = None) -> torch.Tensor:
    """The sum of each element's state (or, with ``count``, the sum over ``count``) rounded
    once to ``dtype`` (ties to even): a 1-D tensor of ``dtype``. The state is not changed.

    ``count`` must be at most ``MAX_TERMS_PER_STATE`` (the long division keeps its remainder
    times 2**32 in an int64)."""
    n_limbs = state.shape[0] - COUNTERS
    limbs = state[:n_limbs].clone()
    counters = state[n_limbs:]
    normalise(limbs)
    negative = limbs[-1] < 0
    # A multiply by the sign: torch.where with a broadcast condition is several times slower
    # on CPU.
    limbs *= 1 - 2 * negative.long()
    normalise(limbs)
    half_below = torch.zeros_like(negative)
    sticky_below = torch.zeros_like(negative)
    if count is not None:
        # Long division, top limb first: the remainder stays below count <= 2**30. One more
        # digit, below the unit, holds the rounding bit of a result whose quantum is the unit.
        remainder = torch.zeros_like(limbs[0])
        for i in range(n_limbs - 1, -1, -1):
            partial = (remainder << LIMB_BITS) | limbs[i]
            limbs[i] = partial // count
            remainder = partial % count
        fraction = (remainder << LIMB_BITS) // count
        half_below = (fraction >> (LIMB_BITS - 1)) != 0
        sticky_below = (((fraction & ((1 << (LIMB_BITS - 1)) - 1)) != 0)
                        | ((remainder << LIMB_BITS) % count != 0))
    precision, min_quantum, _, _ = EXACT_TARGETS[dtype]
    nonzero = limbs != 0
    positions = torch.arange(n_limbs, device=limbs.device).unsqueeze(1).expand_as(limbs)
    top = torch.where(nonzero, positions, -1).amax(0)
    top_limb = limbs.gather(0, top.clamp_min(0).unsqueeze(0)).squeeze(0)
    length = torch.where(top >= 0, LIMB_BITS * top + torch.frexp(top_limb.double())[1].long(), 0)
    quantum = torch.clamp_min(length - precision, min_quantum)  # >= 0 for every format
    significand = _bits(limbs, quantum, (length - quantum).clamp_min(0))
    half_position = (quantum - 1).clamp_min(0)
    at_unit = quantum == 0
    half = torch.where(at_unit, half_below,
                       _bits(limbs, half_position, torch.ones_like(quantum)) != 0)
    # Any set bit below the half bit: in its own limb, or in any limb under it.
    half_limb = half_position >> 5
    below_mask = (1 << (half_position & 31)) - 1
    own = (limbs.gather(0, half_limb.unsqueeze(0)).squeeze(0) & below_mask) != 0
    under = (nonzero.long().cumsum(0).gather(0, (half_limb - 1).clamp_min(0).unsqueeze(0))
             .squeeze(0) > 0) & (half_limb > 0)
    sticky = torch.where(at_unit, sticky_below, half_below | sticky_below | own | under)
    round_up = half & (sticky | ((significand & 1) != 0))
    significand = significand + round_up.long()
    magnitude = _scale(significand.double(), quantum + EXACT_TARGETS[acc_dtype][2])
    value = torch.where(negative, -magnitude, magnitude)
    value = torch.where(counters[NOT_NEG_ZERO] == 0, -0.0, value)  # every term was -0.0
    value = torch.where(counters[NEG_INF] > 0, -torch.inf, value)
    value = torch.where(counters[POS_INF] > 0, torch.inf, value)
    value = torch.where((counters[NAN] > 0) | ((counters[POS_INF] > 0)
                                               & (counters[NEG_INF] > 0)), torch.nan, value)
    # The value is the dtype's already (rounded above), or +-inf / NaN: converting is exact.
    return value.to(dtype)
