"""Device kernels behind detsum's primitives.

Every backend exposes one launcher with the same signature, ``segment_reduce`` (see
``detsum.kernels.numba.segment`` for the contract), that writes a segmented reduction into a
preallocated output. The arithmetic of each rule is defined in the determinism
contract (``docs/determinism.md``) and picked in ``detsum/modes.py``; the integer codes below are the only thing the kernels see of it.
"""

import torch

# Arithmetic rules. A mode resolves to one rule per (reduction, dtype, device, slice size) in
# detsum.modes. WIDE and KAHAN define the "fp32" and "kahan" modes and split long segments into
# chunks (CHUNK_TERMS); the other rules reproduce torch and never split.

#: acc = acc_type(init); acc = RN_acc(acc + term) per row; out = RN_dtype(acc).
WIDE = 0
#: Neumaier-compensated sum in the acc type; out = RN_dtype(s + c), or RN_dtype(s) when s is not
#: finite or c == 0 (so a sum of -0.0 stays -0.0).
KAHAN = 1
#: acc = init; acc = RN_dtype(acc + RN_dtype(term)) per row: torch's CPU index_put_ and CUDA
#: indexing_backward_kernel (slice size > 32). For MEAN: the wide sum rounded to the dtype, then
#: divided (torch's CPU scatter_reduce mean). For PROD, AMAX, AMIN: the unsplit serial order.
ROUND_EACH = 2
#: g = 0; g = RN_acc(g + RN_dtype(term)) per row; out = RN_dtype(acc_type(init) + g): torch's CUDA
#: indexing_backward_kernel_small_stride (slice size 2..32). SUM only.
CUDA_SMALL_STRIDE = 3
#: torch's CUDA indexing_backward_kernel_stride_1 (slice size 1): CUDA_SMALL_STRIDE below 32
#: terms; from 32 terms, 32 lane sums, a shuffle-down tree and a serial tail (see
#: detsum/reference.py). SUM only, and only for inner size 1.
CUDA_STRIDE_1 = 4

RULE_NAMES = {WIDE: "wide", KAHAN: "kahan", ROUND_EACH: "round_each",
              CUDA_SMALL_STRIDE: "cuda_small_stride", CUDA_STRIDE_1: "cuda_stride_1"}

#: Rules whose canonical order splits a segment of more than CHUNK_TERMS terms into chunks.
SPLIT_RULES = (WIDE, KAHAN)

#: The chunk length of the canonical order under WIDE and KAHAN. A segment of at most this many
#: terms is reduced serially from its init. A longer one is cut into chunks of CHUNK_TERMS
#: consecutive terms (the last one shorter): the first chunk reduces from the init, every later
#: chunk reduces its own terms starting from its first term, and the chunk results are folded
#: into the first one serially, in order (KAHAN: each chunk's s is added with compensation and
#: its c added to the running c). A GPU then spreads a hot segment over many programs, and
#: every backend computes the same bits. Changing it changes results: it is part of the
#: determinism contract (docs/determinism.md), never a tuning knob.
CHUNK_TERMS = 256

# Reductions.
SUM = 0
MEAN = 1
PROD = 2
AMAX = 3
AMIN = 4

REDUCE_CODES = {"sum": SUM, "mean": MEAN, "prod": PROD, "amax": AMAX, "amin": AMIN}


def has_work(src, order, offsets, supported_dtypes) -> bool:
    """Check a launch's arguments against the contract; False when the output is empty."""
    if src.dtype not in supported_dtypes:
        raise TypeError(f"segment_reduce: unsupported dtype {src.dtype}")
    if offsets.dtype != torch.int64 or (order is not None and order.dtype != torch.int64):
        raise TypeError("segment_reduce: order and offsets must be int64")
    outer, _, inner = src.shape
    return outer > 0 and offsets.shape[0] > 1 and inner > 0
