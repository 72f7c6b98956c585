"""The variants of the segment and scatter kernels (``segment.py``, ``scatter.py``): which
operation each term goes through, and what a kernel fixes when it compiles. Both kernels take
their variants from here, so that they give the same bits for the same reduction and rule.

Kernels compare their ``op`` with the ``OP_`` numbers here as compile-time constants: after
changing one, delete ``kernels/numba/__pycache__`` to drop stale kernels.
"""

from .. import AMAX, AMIN, KAHAN, MEAN, PROD, ROUND_EACH, SUM, WIDE

# Row operations (see operation_for).
OP_ADD = 0
OP_ADD_ROUND = 1
OP_ADD_ROUND_SCALED = 2
OP_KAHAN = 3
OP_MUL = 4
OP_MAX = 5
OP_MIN = 6
OP_NAMES = {OP_ADD: "add", OP_ADD_ROUND: "add_round", OP_ADD_ROUND_SCALED: "add_round_scaled",
            OP_KAHAN: "kahan", OP_MUL: "mul", OP_MAX: "max", OP_MIN: "min"}


def operation_for(reduce, rule, scaled):
    """The operation each term goes through for ``reduce`` under ``rule`` (``scaled``: alpha
    is not 1): the one table for ``segment.py``'s kernels and ``scatter.py``'s, which give
    the same bits."""
    if reduce == PROD:
        return OP_MUL
    if reduce == AMAX:
        return OP_MAX
    if reduce == AMIN:
        return OP_MIN
    if rule == KAHAN:
        return OP_KAHAN
    if rule == ROUND_EACH and reduce == SUM:
        return OP_ADD_ROUND_SCALED if scaled else OP_ADD_ROUND
    # WIDE, and MEAN under ROUND_EACH (summed wide, rounded before the division by the count
    # rounded to the dtype).
    return OP_ADD


def variant_for(reduce, rule, scaled):
    """What a kernel fixes when it compiles, for ``reduce`` under ``rule`` (``scaled``: alpha
    is not 1): ``(op, mean, mean_round, split)``, the term's operation, whether the sum is
    divided by its count, whether the sum and the count are rounded to the dtype before
    (ROUND_EACH's mean: torch's CPU ``scatter_reduce`` rounds the total first and counts in
    the dtype), and whether long segments are cut into chunks (WIDE and KAHAN; amax / amin
    give the same bits either way and are not).

    Why: each variant compiles alone, in a few seconds, on the first call that needs it
    (every rule and reduction of a dtype in one kernel took 10-20 s), its branches on the
    mode resolved before any code is generated. The arithmetic of each is what it was as a
    branch: without fastmath, LLVM reorders no floating-point operation."""
    op = operation_for(reduce, rule, scaled)
    mean = reduce == MEAN
    return (op, mean, mean and rule == ROUND_EACH,
            rule in (WIDE, KAHAN) and op != OP_MAX and op != OP_MIN)


def variant_name(op, mean, mean_round, split):
    """A variant's name, part of its kernels' names: e.g. ``add_mean_chunked``."""
    return (OP_NAMES[op] + ("_mean" if mean else "") + ("_rounded" if mean_round else "")
            + ("_chunked" if split else ""))
