"""The wire format of ``detsum.distributed`` on CPU: the three steps of a sum over ranks that
touch a state, each one pass over it, instead of a few dozen torch integer operations over its
rows.

The state is ``detsum._limbs``'s: ``[L + 4, numel]`` int64, limb-major, the limbs of an integer
count of units, normalised (every limb but the last in ``[0, 2**32)``, the last signed), then
four counters (NaN terms, +inf terms, -inf terms, terms other than -0.0). A rank sends each
element's value ``v`` as the limbs of ``sign(v) * |v|`` (its *digits*) in a window of limb
rows that the ranks agree on; docs/distributed.md proves the sum exact. The three steps
compute what ``detsum.distributed``'s torch operations compute, the same integers
(``tests/test_wire.py`` compares the header values, the payload bytes and the decoded states):

- ``scan``: a state's part of the header: the highest limb row holding a nonzero digit, minus
  the lowest (-1 and ``-L`` for a zero state), then per counter its largest value and its
  largest negated value (the count of terms other than -0.0 as its complement,
  ``count - counter``);
- ``encode``: the state's count, its digits in the rows ``[bottom, bottom + rows)`` and the
  counters that go, ``fields`` to an int64 of ``bits`` bits each, into its part of the payload;
- ``decode``: a summed part back into a normalised state: zero below the window, the digit
  sums carried, their carry above it; the counters unpacked, the complement turned back.

Why: the torch operations asked each of these questions of a state (its lowest limb in use,
its highest beyond the sign, its digits by a multiply and a normalisation, the rows that hold
any, the counters' extremes; after the sum a normalisation and a carry) in a pass over its
rows of its own: 127 ms for a 1.32M-parameter gradient at 2 ranks, where one read of its
state takes 6. Here, on one thread: about 8 ms for the header, 6 for the payload and 16 for
the decoding, which writes every row of the state (docs/distributed.md, Cost).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import prange

from .. import LIMB_BITS
from . import njit, parallel_njit
from .common import launch_threads, threads

__all__ = ["scan", "encode", "decode"]

_COUNTERS = 4
_NOT_NEG_ZERO = 3
#: A state's header values (distributed._LOCAL_VALUES).
_HEADER = 2 + 2 * _COUNTERS
_DIGIT = (1 << LIMB_BITS) - 1
#: Elements per block: a thread's unit of work.
_BLOCK = 1024
#: Elements below which one thread does the work: each pass costs a few ns per element, and
#: waking a second thread about 30 us (see common._MIN_BLOCK_ELEMENTS).
_MIN_PARALLEL_ELEMENTS = 65536


# Each kernel takes the elements in blocks (a thread's unit of work). Where a loop can run
# over a block's elements within one row (a 1-D slice: contiguous, it vectorises), it does,
# and what an element carries from one limb to the next (its sign, its borrow, its carry)
# waits in a scratch row of the block's length; the header's window is found element by
# element instead, because an element's look stops at its first limb that decides.


@njit(cache=True)
def _digit_rows(state, n_limbs, start, stop):
    """(lowest, highest) limb row of a nonzero digit over the elements ``[start, stop)``;
    ``(n_limbs, -1)`` when every value there is zero.

    An element's lowest digit is at its lowest nonzero limb, ``low``: negating keeps the
    lowest nonzero digit where it is. Its highest, for ``v > 0``, is at its highest nonzero
    limb; for ``v < 0``, whose limbs above its magnitude hold the sign alone (all ones; -1 in
    the last limb), at its highest limb above ``low`` that differs from that fill, or at
    ``low`` when none does (``v = -2**(32 low)``: the magnitude's one digit is there)."""
    last = n_limbs - 1
    lowest, highest = n_limbs, -1
    for e in range(start, stop):
        low = 0
        while low < n_limbs and state[low, e] == 0:
            low += 1
        if low == n_limbs:
            continue  # zero: no digit
        sign = state[last, e] >> 63  # -1 or 0
        high = last
        if state[last, e] == sign:
            fill = sign & _DIGIT
            high = last - 1
            while high > low and state[high, e] == fill:
                high -= 1
        lowest = min(lowest, low)
        highest = max(highest, high, low)
    return lowest, highest


@njit(cache=True)
def _extremes(row, count, complement):
    """(largest, smallest) of a counter's nonempty ``row`` as it goes on the wire: the count
    of terms other than -0.0 (``complement``) as the count of the others, ``count - row``,
    because -0.0 terms are rare: zero nearly everywhere."""
    largest = smallest = count - row[0] if complement else row[0]
    if complement:
        for j in range(1, row.shape[0]):
            largest = max(largest, count - row[j])
            smallest = min(smallest, count - row[j])
    else:
        for j in range(1, row.shape[0]):
            largest = max(largest, row[j])
            smallest = min(smallest, row[j])
    return largest, smallest


@parallel_njit(cache=True)
def _scan(state, n_limbs, count, header):
    numel = state.shape[1]
    n_blocks = (numel + _BLOCK - 1) // _BLOCK
    found = np.empty((n_blocks, _HEADER), dtype=np.int64)
    for b in prange(n_blocks):
        start, stop = b * _BLOCK, min(numel, (b + 1) * _BLOCK)
        lowest, highest = _digit_rows(state, n_limbs, start, stop)
        found[b, 0] = highest
        found[b, 1] = -lowest
        for k in range(_COUNTERS):
            largest, smallest = _extremes(state[n_limbs + k, start:stop], count,
                                          k == _NOT_NEG_ZERO)
            found[b, 2 + 2 * k] = largest
            found[b, 3 + 2 * k] = -smallest
    # An empty state: no digit (as a zero state), and no counter value at all.
    header[0] = -1
    header[1] = -n_limbs
    header[2:] = 0
    if n_blocks:
        for j in range(_HEADER):
            header[j] = found[0, j]
            for b in range(1, n_blocks):
                header[j] = max(header[j], found[b, j])


@njit(cache=True)
def _encode_digits(state, n_limbs, bottom, window, start, stop):
    """The digits of the elements ``[start, stop)`` in the window's rows."""
    last = n_limbs - 1
    n = stop - start
    sign = state[last, start:stop] >> 63  # -1 or 0 (a new row)
    borrow = np.zeros(n, dtype=np.int64)
    # |v|'s limbs from `bottom` up, normalised: v's limbs negated (a no-op with a sign of 0,
    # borrowing nothing) and a borrow run up them. Nothing borrows from below `bottom`,
    # where every limb is zero; the last limb keeps the rest, as the state's own. A digit is
    # |v|'s limb with v's sign.
    for r in range(window.shape[0]):
        i = bottom + r
        limbs = state[i, start:stop]
        digits = window[r, start:stop]
        if i < last:
            for j in range(n):
                magnitude = ((limbs[j] ^ sign[j]) - sign[j]) + borrow[j]
                borrow[j] = magnitude >> LIMB_BITS
                digits[j] = ((magnitude & _DIGIT) ^ sign[j]) - sign[j]
        else:
            for j in range(n):
                magnitude = ((limbs[j] ^ sign[j]) - sign[j]) + borrow[j]
                digits[j] = (magnitude ^ sign[j]) - sign[j]


@parallel_njit(cache=True)
def _encode(state, n_limbs, count, bottom, window, counters, kinds, fields, bits):
    numel = state.shape[1]
    for b in prange((numel + _BLOCK - 1) // _BLOCK):
        _encode_digits(state, n_limbs, bottom, window, b * _BLOCK,
                       min(numel, (b + 1) * _BLOCK))
    lanes = counters.shape[1]
    lane_blocks = (lanes + _BLOCK - 1) // _BLOCK
    for t in prange(kinds.shape[0] * lane_blocks):
        q, b = t // lane_blocks, t % lane_blocks
        row = state[n_limbs + kinds[q]]
        complement = kinds[q] == _NOT_NEG_ZERO
        for lane in range(b * _BLOCK, min(lanes, (b + 1) * _BLOCK)):
            # The fields' bits are disjoint (values below 2**bits, or one field of any value):
            # an OR is the torch operations' sum.
            packed = 0
            for j in range(min(fields, numel - lane * fields)):
                value = row[lane * fields + j]
                packed |= (count - value if complement else value) << (j * bits)
            counters[q, lane] = packed


@njit(cache=True)
def _decode_block(window, counters, bottom, kinds, fields, bits, total, out, start, stop):
    """The elements ``[start, stop)`` of ``out``."""
    n_limbs = out.shape[0] - _COUNTERS
    last = n_limbs - 1
    n = stop - start
    # The normalisation of every limb, from digit sums that are zero outside the window:
    # what normalising the window and carrying its last row's rest out
    # (distributed._carry_out) give. Each sum is an exact int64 (fewer than 2**31 ranks of
    # digits below 2**32 in magnitude), and so is each carry.
    carry = np.zeros(n, dtype=np.int64)
    for i in range(n_limbs):
        limbs = out[i, start:stop]
        r = i - bottom
        if r < 0:
            limbs[:] = 0
        elif r < window.shape[0]:
            sums = window[r, start:stop]
            if i < last:
                for j in range(n):
                    value = carry[j] + sums[j]
                    limbs[j] = value & _DIGIT
                    carry[j] = value >> LIMB_BITS
            else:
                for j in range(n):
                    limbs[j] = carry[j] + sums[j]
        elif i < last:
            for j in range(n):
                limbs[j] = carry[j] & _DIGIT
                carry[j] >>= LIMB_BITS
        else:
            for j in range(n):  # not limbs[:] = carry: seconds of compile for a shape check
                limbs[j] = carry[j]
    for k in range(_COUNTERS):
        row = out[n_limbs + k, start:stop]
        # What goes on the wire for the count of terms other than -0.0 is its complement.
        complement = k == _NOT_NEG_ZERO
        q = 0
        while q < kinds.shape[0] and kinds[q] != k:
            q += 1
        if q == kinds.shape[0]:  # zero on every rank: it did not go
            row[:] = total if complement else 0
        elif fields == 1:
            sums = counters[q, start:stop]
            for j in range(n):
                row[j] = total - sums[j] if complement else sums[j]
        else:
            mask = (np.int64(1) << bits) - 1
            for j in range(n):
                e = start + j
                value = (counters[q, e // fields] >> ((e % fields) * bits)) & mask
                row[j] = total - value if complement else value


@parallel_njit(cache=True)
def _decode(window, counters, bottom, kinds, fields, bits, total, out):
    numel = out.shape[1]
    for b in prange((numel + _BLOCK - 1) // _BLOCK):
        _decode_block(window, counters, bottom, kinds, fields, bits, total, out, b * _BLOCK,
                      min(numel, (b + 1) * _BLOCK))


def _launch_threads(numel: int) -> int:
    return launch_threads() if numel >= _MIN_PARALLEL_ELEMENTS else 1


def scan(state: torch.Tensor, count: int) -> list[int]:
    """A state's header values (``_HEADER`` ints, the module docstring's ``scan``) for a
    state ``[L + 4, numel]`` of ``count`` rows."""
    header = np.empty(_HEADER, dtype=np.int64)
    with threads(_launch_threads(state.shape[1])):
        _scan(state.numpy(), state.shape[0] - _COUNTERS, count, header)
    return header.tolist()


def encode(state: torch.Tensor, count: int, part: np.ndarray, bottom: int, rows: int,
           kinds: Sequence[int], fields: int, bits: int) -> None:
    """Write a state's part of the payload, ``part`` (1-D int64): its count, then its digits
    in the limb rows ``[bottom, bottom + rows)`` (every element's nonzero digits lie there),
    row by row, then each counter of ``kinds`` (counter numbers) in ``-(-numel //
    fields)`` lanes, element ``j * fields + i``'s value shifted by ``i * bits`` into lane
    ``j``."""
    numel = state.shape[1]
    part[0] = count
    window = part[1:1 + rows * numel].reshape(rows, numel)
    counters = part[1 + rows * numel:].reshape(len(kinds), -(-numel // fields))
    if numel == 0:
        return
    with threads(_launch_threads(numel)):
        _encode(state.numpy(), state.shape[0] - _COUNTERS, count, bottom, window, counters,
                np.array(kinds, dtype=np.int64), fields, bits)


def decode(part: np.ndarray, bottom: int, rows: int, kinds: Sequence[int], fields: int,
           bits: int, total: int, out: torch.Tensor) -> None:
    """Write into ``out`` (``[L + 4, numel]`` int64) the normalised state whose digit sums and
    packed counter sums ``part`` holds, laid out as ``encode`` writes them, of ``total`` rows
    in all."""
    numel = out.shape[1]
    if numel == 0:
        return
    window = part[1:1 + rows * numel].reshape(rows, numel)
    counters = part[1 + rows * numel:].reshape(len(kinds), -(-numel // fields))
    with threads(_launch_threads(numel)):
        _decode(window, counters, bottom, np.array(kinds, dtype=np.int64), fields, bits, total,
                out.numpy())
