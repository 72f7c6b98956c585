"""One exact state on the wire of a sum over ranks (``detsum.distributed``), in torch integer
ops (any device): its part of the header, its part of the payload, and a summed part read back
into a state. On CPU, under the numba backend, kernels compute the same integers in one pass
over the state each (``kernels/numba/wire.py``); ``detsum._kernel_ops`` picks which runs.

A rank sends each element's value ``v`` as the limbs of ``sign(v) * |v|``, its *digits*, in a
window of limb rows ``[bottom, bottom + rows)`` that the ranks agree on (``distributed._Wire``
fixes it from the header's sums; docs/distributed.md proves the sum exact). A state's part of
the payload is its count, its digits in the window row by row, then each counter of ``kinds``
(counter numbers, ``detsum._limbs``) in ``-(-numel // fields)`` lanes, ``fields`` to an int64 of
``bits`` bits each.

Why sign-magnitude: a negative value's normalised limbs are its two's complement, all ones
above its magnitude; its magnitude's limbs are zero there, as a positive value's are, so a
gradient's limbs in use are a few rows (two or three for fp32 gradients). Every digit is below
``2**32`` in magnitude, so a sum of fewer than ``2**31`` of them stays within int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detsum import _limbs
from detsum.modes import LIMB_BITS

_ALL_ONES = (1 << LIMB_BITS) - 1


def _lowest_row_in_use(limbs: torch.Tensor) -> int:
    """The lowest limb (row) nonzero in any element; the limb count when there is none."""
    for i in range(limbs.shape[0]):
        if int(torch.count_nonzero(limbs[i])):  # several times faster than any() on CPU
            return i
    return limbs.shape[0]


def _highest_row_beyond_sign(limbs: torch.Tensor, negative: torch.Tensor, bottom: int) -> int:
    """The highest limb (row) where some element differs from what its sign alone puts there
    (0 above a nonnegative value; all ones, and -1 in the last limb, above a negative one);
    ``bottom - 1`` when none does."""
    last = limbs.shape[0] - 1
    fill = negative.long() * _ALL_ONES
    for i in range(last, bottom - 1, -1):
        if not torch.equal(limbs[i], -negative.long() if i == last else fill):
            return i
    return bottom - 1


def _split(part: torch.Tensor, rows: int, kinds: Sequence[int], fields: int, numel: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A state's ``part`` of the payload as its window ``[rows, numel]`` and its counters
    ``[len(kinds), lanes]`` (views)."""
    return (part[1:1 + rows * numel].view(rows, numel),
            part[1 + rows * numel:].view(len(kinds), -(-numel // fields)))


def _pack(values: torch.Tensor, fields: int, bits: int) -> torch.Tensor:
    """Nonnegative ``values`` (1-D), ``fields`` to an int64 of ``bits`` bits each."""
    lanes = -(-values.numel() // fields)
    padded = torch.zeros(lanes * fields, dtype=torch.int64, device=values.device)
    padded[:values.numel()] = values
    shifts = torch.arange(fields, device=values.device) * bits
    # The fields' bits are disjoint: the sum is an OR, exact.
    return (padded.view(lanes, fields) << shifts).sum(1)


def _unpack(lanes: torch.Tensor, fields: int, bits: int, numel: int) -> torch.Tensor:
    shifts = torch.arange(fields, device=lanes.device) * bits
    return ((lanes.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel]


def _carry_out(limbs: torch.Tensor, above: int) -> None:
    """Normalise ``limbs`` whose rows below ``above`` are normalised but for the last of them,
    which holds the rest of the value (any int64), and whose rows from ``above`` up hold
    anything: they are overwritten with that rest's carry, in normalised form."""
    last = limbs.shape[0] - 1
    if above > last:
        return
    rest = limbs[above - 1] >> LIMB_BITS  # below 2**31 in magnitude: an int64 shifted by 32
    limbs[above - 1] &= _ALL_ONES
    if above == last:
        limbs[last] = rest
        return
    sign = rest >> LIMB_BITS  # -1 or 0
    limbs[above] = rest & _ALL_ONES
    limbs[above + 1:last] = (sign & _ALL_ONES).unsqueeze(0)
    limbs[last] = sign


class Outgoing:
    """One exact state (``[L + COUNTERS, numel]`` int64, normalised) of ``count`` rows as this
    rank sends it: the digits of its value in the rows ``[first, first + len(digits))`` that
    hold any, and its counters, found once and kept for ``header`` and ``write``."""

    #: Whether kernels do the work (``detsum._kernel_ops`` has the kernels' twin of this class).
    kernels = False

    def __init__(self, state: torch.Tensor, count: int):
        self.state, self.count = state, count
        n_limbs = state.shape[0] - _limbs.COUNTERS
        self.n_limbs = n_limbs
        limbs = state[:n_limbs]
        bottom = _lowest_row_in_use(limbs)
        self.first, self.digits = bottom, limbs[:0]
        if bottom < n_limbs:
            negative = limbs[-1] < 0
            # A multiply by the sign: torch.where with a broadcast condition is several times
            # slower on CPU.
            sign = 1 - 2 * negative.long()
            last = min(_highest_row_beyond_sign(limbs, negative, bottom) + 1, n_limbs - 1)
            # The limbs above `last` hold the sign alone: worth -2**(32 * (last + 1)) for a
            # negative value, nothing for the others. One more row stands for them.
            extra = 1 if last < n_limbs - 1 else 0
            magnitude = torch.empty((last + 1 - bottom + extra, state.shape[1]),
                                    dtype=torch.int64, device=state.device)
            torch.mul(limbs[bottom:last + 1], sign, out=magnitude[:last + 1 - bottom])
            if extra:
                magnitude[-1] = negative
            _limbs.normalise(magnitude)
            used = torch.count_nonzero(magnitude, dim=1).nonzero().flatten().tolist()
            self.first = bottom + used[0]
            self.digits = magnitude[used[0]:used[-1] + 1] * sign
        # -0.0 terms are rare, so the count of terms other than -0.0 goes as its complement,
        # zero where every term was something else: when it is zero on every rank, and no
        # rank saw NaN or an infinity, no counter goes on the wire.
        self.complement = count - state[n_limbs + _limbs.NOT_NEG_ZERO]

    def counter(self, k: int) -> torch.Tensor:
        """Counter ``k`` as it goes on the wire."""
        return self.complement if k == _limbs.NOT_NEG_ZERO else self.state[self.n_limbs + k]

    def header(self) -> list[int]:
        """This state's part of the header: the highest limb row holding a digit, minus the
        lowest (-1 and ``-L`` for a zero state), then per counter its largest value and the
        largest of its negation, as it goes on the wire."""
        values = [self.first + self.digits.shape[0] - 1 if self.digits.shape[0] else -1,
                  -(self.first if self.digits.shape[0] else self.n_limbs)]
        for k in range(_limbs.COUNTERS):
            row = self.counter(k)
            if row.numel() and int(torch.count_nonzero(row)):  # mostly zero: one fast pass
                smallest, largest = torch.aminmax(row)
                values += [int(largest), -int(smallest)]
            else:
                values += [0, 0]
        return values

    def write(self, part: torch.Tensor, bottom: int, rows: int, kinds: Sequence[int],
              fields: int, bits: int) -> None:
        """This state's part of the payload (``part``, 1-D int64): its count, its digits in the
        limb rows ``[bottom, bottom + rows)`` (every digit lies there), the counters of
        ``kinds``."""
        part[0] = self.count
        window, counters = _split(part, rows, kinds, fields, self.state.shape[1])
        start = self.first - bottom
        stop = start + self.digits.shape[0]
        window[:start].zero_()
        window[start:stop] = self.digits
        window[stop:].zero_()
        for q, k in enumerate(kinds):
            counters[q] = (self.counter(k) if fields == 1
                           else _pack(self.counter(k), fields, bits))


def decode(part: torch.Tensor, bottom: int, rows: int, kinds: Sequence[int], fields: int,
           bits: int, total: int, summed: torch.Tensor) -> None:
    """A state's ``part`` of the summed payload (every rank's ``Outgoing.write`` of the same
    layout, added), of ``total`` rows in all, into ``summed`` (the state's shape), normalised:
    zero below the window, the digit sums carried and their carry above it; the counters
    unpacked, the complement turned back."""
    n_limbs, numel = summed.shape[0] - _limbs.COUNTERS, summed.shape[1]
    window, counters = _split(part, rows, kinds, fields, numel)
    if rows:
        # Below the window every rank's limbs are zero; above it, the carries of the sum.
        summed[:bottom] = 0
        limbs = summed[bottom:bottom + rows]
        limbs.copy_(window)
        _limbs.normalise(limbs)
        _carry_out(summed[:n_limbs], bottom + rows)
    else:
        summed[:n_limbs] = 0  # no rank has a digit in this state's limbs
    summed[n_limbs:] = 0
    for q, k in enumerate(kinds):
        summed[n_limbs + k] = (counters[q] if fields == 1
                               else _unpack(counters[q], fields, bits, numel))
    # What went on the wire was the complement (or nothing, where it was zero everywhere).
    not_neg_zero = summed[n_limbs + _limbs.NOT_NEG_ZERO]
    not_neg_zero.copy_(total - not_neg_zero)
