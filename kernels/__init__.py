"""Device kernels behind detsum's primitives.

Every backend exposes one launcher with the same signature, ``segment_reduce`` (see
``detsum.kernels.numba.segment``), that writes a segmented reduction into a preallocated
output. The arithmetic of each rule is defined in SPEC terms in ``detsum/modes.py``; the
integer codes below are the only thing the kernels see of it.
"""

# Arithmetic rules. A mode resolves to one rule per (dtype, device) in detsum.modes.

#: acc = acc_type(init); acc = RN_acc(acc + term) per row; out = RN_dtype(acc).
WIDE = 0
#: Neumaier-compensated sum in the acc type; out = RN_dtype(s + c), or RN_dtype(s) when s is not
#: finite or c == 0 (so a sum of -0.0 stays -0.0).
KAHAN = 1
#: acc = init; acc = RN_dtype(acc + RN_dtype(term)) per row: what torch's CPU index_put_ does.
#: For MEAN: the wide sum rounded to the dtype, then divided (torch's CPU scatter_reduce mean).
ROUND_EACH = 2

RULE_NAMES = {WIDE: "wide", KAHAN: "kahan", ROUND_EACH: "round_each"}

# Reductions.
SUM = 0
MEAN = 1
PROD = 2
AMAX = 3
AMIN = 4

REDUCE_CODES = {"sum": SUM, "mean": MEAN, "prod": PROD, "amax": AMAX, "amin": AMIN}
