"""Numba CPU kernels for detsum's segmented reductions.

CONTRACT (shared by every backend; the Triton launcher will have the same signature):

    segment_reduce(src, order, offsets, base, out, *, reduce, rule, alpha, include_base) -> None

- ``src``: CPU tensor ``[outer, N, inner]`` of float32, float64, float16 or bfloat16, any strides.
- ``order``: int64 ``[M]`` or None. Segment ``s`` reduces the rows ``order[offsets[s]] ..
  order[offsets[s+1]-1]`` of ``src`` (along the middle dim) in that order; with None the rows
  ``offsets[s] .. offsets[s+1]-1`` themselves. Values are already validated to lie in [0, N).
- ``offsets``: int64 ``[S+1]``, already validated (starts at 0, nondecreasing, ends at M or N).
- ``base``: tensor ``[outer, S, inner]`` of src's dtype, or None (only with reduce == SUM).
- ``out``: tensor ``[outer, S, inner]`` of src's dtype, contiguous; may be the very same tensor
  as ``base`` (in-place index_add_): every element is read from base before it is written.
- ``reduce``: one of kernels.SUM, MEAN, PROD, AMAX, AMIN.
- ``rule``: kernels.WIDE, KAHAN or ROUND_EACH (see below).
- ``alpha``: Python float, only != 1 with SUM.
- ``include_base``: True: base row is the initial value of the segment (and counts for MEAN).
  False: an empty segment writes the base row unchanged (0 when base is None); a nonempty one
  starts from the reduction's identity (+0.0 for SUM/MEAN, 1 for PROD, the first term for
  AMAX/AMIN).
"""
