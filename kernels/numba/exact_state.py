"""The exact state of a running sum (``detsum._limbs``) on CPU: adding terms and rounding, per
element in one pass, instead of a few dozen torch integer operations over every element.

The state is ``detsum._limbs``'s: ``[L + 4, numel]`` int64, limb-major, the limbs of an
integer count of units (``2**-149`` for fp32 terms, ``2**-1074`` for fp64), then four
counters (NaN terms, +inf terms, -inf terms, terms other than -0.0). Both functions compute
what ``_limbs.add_terms`` and ``_limbs.round_state`` compute: the state after an addition
is an integer state normalised (every limb but the last in ``[0, 2**32)``), which is unique
for its value, so any correct order of the integer adds gives the same bits; the rounding is
the correctly rounded value of that integer (or of its quotient by a count) with IEEE's
special values, from the same helpers as the EXACT kernels (``limbs.finish``).
``tests/test_exact_state.py`` compares both with ``_limbs`` on random and special states.

Why: a small model's exact gradient (a few hundred parameters) paid a few hundred torch calls
per addition and per rounding (about 3 ms a step); a large one paid the passes over every
element (0.5 s each for 1.32M parameters and 4 samples).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from .. import NORMALISE_EVERY
from .rounding import f32_as_u32, f64_as_u64
from . import njit, parallel_njit
from .common import launch_threads, threads
from .instances import instance
from .limbs import DIGIT_MASK, deposit, finish, normalise_limbs

__all__ = ["add_terms", "normalise", "round_state"]

_COUNTERS = 4
#: Elements per launch below which one thread does the work (see common._MIN_BLOCK_ELEMENTS).
_MIN_PARALLEL_ELEMENTS = 16384


@njit(cache=True, inline="always")
def _count_and_deposit(limbs, counters, exponent, significand, negative, top_exponent,
                       implicit):
    """One term's counters, and its value deposited in units (no carry propagated)."""
    if exponent == top_exponent:
        if significand != 0:
            counters[0] += 1
        elif negative:
            counters[2] += 1
        else:
            counters[1] += 1
        counters[3] += 1
        return
    if not negative or exponent != 0 or significand != 0:
        counters[3] += 1
    if exponent == 0:
        deposit(limbs, significand, np.int64(0), negative)
    else:
        deposit(limbs, significand | implicit, exponent - 1, negative)


# Elements are taken in blocks, so that a thread allocates its scratch limbs once per block,
# not per element (an allocation cost as much as an element's rounding).
_BLOCK = 1024


@njit(cache=True, inline="always")
def _f32_fields(t):
    """(biased exponent, stored significand, sign, the exponent of inf/NaN, the implicit bit)
    of the fp32 value ``t``."""
    bits = np.int64(f32_as_u32(np.float32(t)))
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF, (bits >> 31) != 0, 0xFF, np.int64(1) << 23


@njit(cache=True, inline="always")
def _f64_fields(t):
    """As ``_f32_fields``, for the fp64 value ``t``."""
    bits = f64_as_u64(np.float64(t))
    return (np.int64((bits >> np.uint64(52)) & np.uint64(0x7FF)),
            np.int64(bits & np.uint64(0xFFFFFFFFFFFFF)), (bits >> np.uint64(63)) != np.uint64(0),
            0x7FF, np.int64(1) << 52)


def _add(state, terms, n_limbs):
    """``add_terms``' kernel: the template of both term formats' (``instances.instance``
    binds ``fields``, ``_f32_fields`` or ``_f64_fields``)."""
    rows, numel = terms.shape
    for b in prange((numel + _BLOCK - 1) // _BLOCK):
        # The highest term's digits reach limb 8 of 10 (fp32 units) or 65 of 67 (fp64).
        limbs = np.empty(n_limbs, dtype=np.int64)
        counters = np.empty(_COUNTERS, dtype=np.int64)
        for e in range(b * _BLOCK, min(numel, (b + 1) * _BLOCK)):
            for i in range(n_limbs):
                limbs[i] = state[i, e]
            counters[:] = 0
            for r in range(rows):
                exponent, significand, negative, top_exponent, implicit = fields(terms[r, e])
                _count_and_deposit(limbs, counters, exponent, significand, negative,
                                   top_exponent, implicit)
                if (r + 1) % NORMALISE_EVERY == 0:
                    normalise_limbs(limbs, n_limbs)
            normalise_limbs(limbs, n_limbs)
            for i in range(n_limbs):
                state[i, e] = limbs[i]
            for c in range(_COUNTERS):
                state[n_limbs + c, e] += counters[c]


_add_f32 = instance(_add, "f32", parallel=True, fields=_f32_fields)
_add_f64 = instance(_add, "f64", parallel=True, fields=_f64_fields)


@parallel_njit(cache=True)
def _round(out, state, n_limbs, count, is_mean, precision, min_quantum, unit_exponent):
    numel = state.shape[1]
    for b in prange((numel + _BLOCK - 1) // _BLOCK):
        limbs = np.empty(n_limbs, dtype=np.int64)
        flags = np.empty(_COUNTERS, dtype=np.int64)
        for e in range(b * _BLOCK, min(numel, (b + 1) * _BLOCK)):
            for i in range(n_limbs):
                limbs[i] = state[i, e]
            for c in range(_COUNTERS):
                flags[c] = state[n_limbs + c, e]
            out[e] = finish(limbs, n_limbs, flags, count, is_mean, precision, min_quantum,
                             unit_exponent)


@njit(cache=True)
def _normalise_rows(limbs):
    # Row by row, so that the inner loop runs along a contiguous row and vectorises.
    for i in range(limbs.shape[0] - 1):
        for e in range(limbs.shape[1]):
            value = limbs[i, e]
            limbs[i, e] = value & DIGIT_MASK
            limbs[i + 1, e] += value >> 32  # arithmetic: floor(value / 2**32)


def _launch_threads(numel: int) -> int:
    return launch_threads() if numel >= _MIN_PARALLEL_ELEMENTS else 1


def add_terms(state: torch.Tensor, terms: torch.Tensor) -> None:
    """``_limbs.add_terms`` on CPU: ``terms`` ``[k, numel]`` (fp32 or fp64) into ``state``
    (``[L + 4, numel]``, normalised; a slice of columns of a larger state is fine), in place,
    normalised."""
    n_limbs = state.shape[0] - _COUNTERS
    if terms.shape[0] == 0 or state.shape[1] == 0:
        return
    state_np, terms_np = state.numpy(), terms.numpy()
    with threads(_launch_threads(state.shape[1])):
        if terms.dtype == torch.float64:
            _add_f64(state_np, terms_np, n_limbs)
        else:
            _add_f32(state_np, terms_np, n_limbs)


def normalise(limbs: torch.Tensor) -> None:
    """``_limbs.normalise`` on CPU: every row (limb) of ``limbs`` ``[L, numel]`` but the last
    carried into ``[0, 2**32)``, in place, in one pass (the torch operations take three per
    row: 0.1 ms for the distributed example's 484 parameters)."""
    if limbs.numel():
        _normalise_rows(limbs.numpy())


def round_state(state: torch.Tensor, precision: int, min_quantum: int, unit_exponent: int,
                count: int | None) -> torch.Tensor:
    """``_limbs.round_state`` on CPU, as fp64 values (exact: each is the dtype's already, or
    +-inf or NaN); the state is not changed."""
    n_limbs = state.shape[0] - _COUNTERS
    out = torch.empty(state.shape[1], dtype=torch.float64)
    if state.shape[1] == 0:
        return out
    with threads(_launch_threads(state.shape[1])):
        _round(out.numpy(), state.numpy(), n_limbs, count or 1, count is not None, precision,
               min_quantum, unit_exponent)
    return out
