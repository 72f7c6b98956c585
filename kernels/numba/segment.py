"""Numba CPU kernels for detsum's segmented reductions.

CONTRACT (shared by every backend; the Triton launcher will have the same signature):

    segment_reduce(src, order, offsets, base, out, *, reduce, rule, alpha, include_base,
                   carry=None, chunks=None) -> None

- ``src``: CPU tensor ``[outer, N, inner]`` of float32, float64, float16 or bfloat16, any strides.
- ``order``: int64 ``[M]`` or None. Segment ``s`` reduces the rows ``order[offsets[s]] ..
  order[offsets[s+1]-1]`` of ``src`` (along the middle dim) in that order; with None the rows
  ``offsets[s] .. offsets[s+1]-1`` themselves. Values are already validated to lie in [0, N).
- ``offsets``: int64 ``[S+1]``, already validated (starts at 0, nondecreasing, ends at M or N).
- ``base``: tensor ``[outer, S, inner]`` of src's dtype, or None (only with reduce == SUM).
- ``out``: tensor ``[outer, S, inner]`` of src's dtype, any non-overlapping strides (a
  permuted view when ``_segments.launch`` turns one-element rows into columns); may be the
  very same tensor as ``base`` (in-place index_add_): every element is read from base before
  it is written.
- ``reduce``: one of kernels.SUM, MEAN, PROD, AMAX, AMIN.
- ``rule``: kernels.WIDE, KAHAN or ROUND_EACH (see below); the Triton launcher also takes
  CUDA_SMALL_STRIDE and CUDA_STRIDE_1 (torch's CUDA arithmetic, SUM only).
- Chunks: under WIDE and KAHAN a segment of more than ``kernels.CHUNK_TERMS`` terms is reduced
  in chunks of that many terms (``detsum/kernels/__init__.py`` defines the order); every
  backend computes the same chunks, so the split is part of the result, not of the schedule.
- ``alpha``: Python float, only != 1 with SUM.
- ``carry``: None, or (only with rule KAHAN, reduce SUM, a base and include_base, and data of
  the acc type, fp32 or fp64) a tensor ``[outer, S, inner]`` of src's dtype holding the
  Kahan compensation of a running sum: the base row is its ``s`` and ``carry`` its ``c``. The
  sum resumes from ``(s, c)`` (instead of ``c = 0``) and stops before the final ``s + c``:
  ``out`` receives ``s`` and ``carry`` the new ``c`` (in place). Consecutive launches then
  compute what one launch over all their terms would, up to that final step.
- ``chunks``: None, or ``(kernels.chunk_ends(offsets), slots)`` made beforehand (a
  ``detsum.Plan`` holds them), ``slots`` at least the number of chunks of the long segments;
  or ``kernels.NO_CHUNKS``, ``(None, 0)``: no segment is longer than CHUNK_TERMS. They change
  no result: a launcher that spreads chunks over programs launches none when ``slots`` is 0
  (the Triton one finds the chunks itself otherwise); this backend, which chunks inside each
  segment's loop, ignores them.
- ``include_base``: True: base row is the initial value of the segment (and counts for MEAN).
  False: an empty segment writes the base row unchanged (0 when base is None); a nonempty one
  starts from the reduction's identity (+0.0 for SUM/MEAN, 1 for PROD, the first term for
  AMAX/AMIN).

IMPLEMENTATION NOTES (this backend):

- Arithmetic per output element, in the canonical order of its segment (``A`` = acc type,
  fp64 for fp64 data and fp32 otherwise; ``RN_A`` / ``RN_D`` round to nearest even to ``A`` /
  to the data dtype): ``term(x) = A(x)`` if alpha == 1 else ``RN_A(A(x) * A(alpha))``, and
  under ROUND_EACH additionally ``RN_D(term)``.

  - SUM, WIDE: ``acc = A(base)`` or +0.0; ``acc = RN_A(acc + term)``; ``out = RN_D(acc)``.
  - SUM, KAHAN (Neumaier): ``s = A(base)`` or +0.0, ``c = 0``; per term ``u = s + t``,
    ``c += (s - u) + t`` if ``|s| >= |t|`` else ``(t - u) + s``, ``s = u``;
    ``out = RN_D(s)`` if s is not finite or ``c == 0`` (so a sum of -0.0 stays -0.0, as in
    detsum/reference.py), else ``RN_D(RN_A(s + c))``. With a carry, ``c`` starts from it and
    ``out = s``, ``carry = c``.
  - SUM, ROUND_EACH: ``acc = base`` or +0.0; ``acc = RN_D(A(acc) + term)``; ``out = acc``
    (identical to WIDE for fp32/fp64 data).
  - MEAN: ``count`` = number of terms (+1 with the base row); the sum as SUM/WIDE or
    SUM/KAHAN gives ``v`` in A (KAHAN: ``s`` if not finite or ``c == 0``, else
    ``RN_A(s + c)``); ``out = RN_D(RN_A(v / A(count)))``. ROUND_EACH sums WIDE too but
    rounds the total and the count first, ``out = RN_D(RN_A(A(RN_D(v)) / A(RN_D(count))))``:
    what torch's CPU ``scatter_reduce(..., "mean")`` computes (it counts in the dtype: 257
    terms are 256 in bfloat16; the same as WIDE for fp32/fp64 data).
  - PROD (rule ignored): ``acc = A(base)`` or 1; ``acc = RN_A(acc * A(x))``; ``out = RN_D(acc)``.
  - AMAX / AMIN (rule ignored, exact): ``acc`` = base row or first term; then
    ``acc = x if (isnan(x) or x > acc [amin: x < acc]) and not isnan(acc) else acc``: the
    earlier of +0.0 / -0.0 stays, NaN propagates (what torch's CPU scatter_reduce does).
  - Chunks (WIDE and KAHAN, SUM / MEAN / PROD; AMAX / AMIN give the same bits either
    way and are not split): the first chunk is reduced as above into ``acc``; each later one
    into ``part`` starting from its first term (KAHAN: ``pc = 0``), then folded:
    ``acc = RN_A(acc + part)``, KAHAN ``(s, c) = neumaier(s, c, part); c = RN_A(c + pc)``,
    PROD ``acc = RN_A(acc * part)``. The final steps (KAHAN's ``s + c``, MEAN's division)
    follow the fold.
  - base None means there is no base row: include_base is then ignored (treated as False),
    and an empty segment writes 0.

- Determinism: the work is split into items (outer index, segment, chunk of columns) and only
  items are distributed over threads (``prange`` over blocks of consecutive items); each
  output element is produced by one item, serially over its terms in the order above. The
  result is therefore independent of the thread count, the chunk width and the schedule
  (tests/test_kernels_numba.py compares 1 and 2 threads).

- No fused multiply-add: Numba compiles without fastmath, so LLVM never gets the ``contract``
  flag and cannot fuse ``acc + x * alpha`` (tests/test_kernels_numba.py checks alpha=0.3
  against torch ops done one by one). With alpha == 1 the multiply is exact, so the same
  loops serve both.

- No copies: every tensor reaches the kernel as a flat 1-D NumPy view starting at its first
  element plus its strides, so one compiled specialisation serves every layout
  (transposed, sliced, expanded). Rows with unit column stride are read in place; others are
  gathered into a scratch row first. bf16 and fp16 travel as uint16 bit patterns (torch
  ``view(int16)``) and are converted by ``detsum.kernels.numba.rounding``.

- Speed: the terms of a segment are rows scattered over ``src`` (``order`` is a permutation),
  so the kernel prefetches the start of the rows it will read a few rows ahead; the loops
  are vectorised, with the rule and dtype branches resolved when the kernel compiles.

- Compilation: one kernel per dtype and variant (``variants.variant_for``: the reduction and rule,
  roughly the mode), compiled on the first launch that needs it (1-2 s) and cached on disk on
  its own (``instances.instance``), plus one small driver per dtype that runs the kernel's
  thread blocks (``instances.Blocks``). Numba checks only this file's timestamp: after
  editing ``rounding.py``, ``common.py``, ``instances.py`` or ``variants.py``, delete
  ``kernels/numba/__pycache__`` to drop stale kernels.
"""

import functools

import numpy as np
import torch
from numba import prange

from .. import CHUNK_TERMS, EXACT, KAHAN, ROUND_EACH, WIDE, has_work
from .rounding import (
    bf16_bits_to_f32,
    f16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_f16_bits,
    round_f32_to_bf16,
    round_f32_to_f16,
)
from . import parallel_njit
from .common import (
    _PF_AHEAD,
    _PF_LINES,
    _PF_MAX_DIST,
    _f32,
    _f64,
    _flat,
    _njit_named_for,
    _prefetch,
    block_threads,
    kahan_result,
    launch_threads,
    neumaier,
    work_split,
)
from .exact import segment_reduce_exact
from .instances import DONE, OTHER_TYPES, Blocks, call_at, instance, types_key_of
from .variants import (OP_ADD, OP_ADD_ROUND, OP_ADD_ROUND_SCALED, OP_KAHAN, OP_MAX, OP_MIN,
                       OP_MUL, OP_NAMES, variant_for, variant_name)

__all__ = ["segment_reduce"]

@functools.cache  # one set per format and operation: two would share their names
def _make_rows(fmt, dec, rnd, op):
    """The row helpers of ``_segment_block_kernel`` for one data format (``fmt`` names it)
    and one term operation ``op`` (see ``variants.variant_for``), inlined where they are
    called.

    ``dec`` turns a data element into the acc type and ``rnd`` rounds an acc value to the data
    dtype (staying in the acc type); with ``enc``, which turns an acc value into a data
    element, and ``cvt``, which converts a number to the acc type, they and the variant are
    compile-time constants of the kernel (as arguments the functions would become runtime
    pointers, and stop on-disk caching), so each format and variant compiles only its own
    code, every column loop is a straight, vectorisable loop, and the other modes' branches
    are pruned before any code is generated.

    Arrays arrive flat (1-D, contiguous, starting at the tensor's first element) with their
    element strides beside them: one compiled specialisation serves every layout. Rows with
    unit column stride are read in place; others are first gathered into a scratch row.
    Per term row there is no function call, no array slice and no division: at about 8 rows
    per segment that overhead was a fifth of the running time.
    """
    format_njit = _njit_named_for(f"{fmt}_{OP_NAMES[op]}")

    @format_njit(inline="always")
    def load(acc, a, start, step, w):
        """acc = A(a[start + j * step]), j < w."""
        if step == 1:
            u = np.uint64(start)
            for j in range(w):
                acc[j] = dec(a[u + np.uint64(j)])
        else:
            for j in range(w):
                acc[j] = dec(a[start + j * step])

    @format_njit(inline="always")
    def combine_term_rows(acc, comp, src, ss, order, ost, tmp, rstart, p, end, pf_end,
                          pf_dist, pf_lines, w, alpha):
        """Combine the term rows at positions p .. end - 1 into acc (and comp), in order.

        Rows of a segment lie anywhere in src: while a row is combined, the start of the row
        pf_dist positions ahead (up to pf_end, the end of the caller's run of segments) is
        requested, hiding the latency of a random gather that the hardware cannot predict.
        Without an order the rows are consecutive and pf_end is 0: the hardware prefetcher
        predicts them by itself.

        Per term row there is no call to another function with array arguments: inlining
        copies each array argument into a new, reference-counted variable, and an inlined
        call that returned at once still cost about 10 ns a row (measured), more than the
        arithmetic of a narrow row.

        Indices are unsigned so that Numba adds no negative-index fix-up and the loops
        vectorise. term(x) = RN_A(A(x) * A(alpha)) is a multiply of its own, never fused with
        the add that follows (no fastmath, so LLVM may not contract); with alpha == 1 it is
        exactly A(x), so one loop serves both.
        """
        line = 64 // src.itemsize
        strided = ss[2] != 1
        # Rows with unit column stride are read in place, others gathered into tmp first.
        a = tmp if strided else src
        while p < end:
            q = p + pf_dist
            if q < pf_end:
                ahead = rstart + order[q * ost] * ss[1]
                for k in range(pf_lines):
                    _prefetch(src, ahead + k * line)
            start = rstart + (order[p * ost] if ost >= 0 else p) * ss[1]
            if strided:
                for j in range(w):
                    tmp[j] = src[start + j * ss[2]]
                start = 0
            u = np.uint64(start)
            if op == OP_ADD:
                for j in range(w):
                    acc[j] = acc[j] + dec(a[u + np.uint64(j)]) * alpha
            elif op == OP_ADD_ROUND:
                # alpha == 1: A(x) is a data-dtype value already.
                for j in range(w):
                    acc[j] = rnd(acc[j] + dec(a[u + np.uint64(j)]))
            elif op == OP_ADD_ROUND_SCALED:
                # torch rounds source * alpha to the dtype before adding.
                for j in range(w):
                    acc[j] = rnd(acc[j] + rnd(dec(a[u + np.uint64(j)]) * alpha))
            elif op == OP_KAHAN:
                for j in range(w):
                    acc[j], comp[j] = neumaier(acc[j], comp[j], dec(a[u + np.uint64(j)]) * alpha)
            elif op == OP_MUL:
                for j in range(w):
                    acc[j] = acc[j] * dec(a[u + np.uint64(j)])
            elif op == OP_MAX:
                for j in range(w):
                    x = dec(a[u + np.uint64(j)])
                    y = acc[j]
                    acc[j] = x if (x != x or x > y) and y == y else y
            else:
                for j in range(w):
                    x = dec(a[u + np.uint64(j)])
                    y = acc[j]
                    acc[j] = x if (x != x or x < y) and y == y else y
            p += 1

    @format_njit(inline="always")
    def fold_partial_sum(acc, comp, part, pcomp, w):
        """Fold a later chunk's result (part, and pcomp under KAHAN) into acc (and comp)."""
        if op == OP_KAHAN:
            for j in range(w):
                acc[j], c = neumaier(acc[j], comp[j], part[j])
                comp[j] = c + pcomp[j]
        elif op == OP_MUL:
            for j in range(w):
                acc[j] = acc[j] * part[j]
        else:
            for j in range(w):
                acc[j] = acc[j] + part[j]

    return load, combine_term_rows, fold_partial_sum


def _segment_block_kernel(b, src, ss, order, ost, offsets, fst, base, bs, out, us, carry, cs,
                          shape, alpha, include_base, has_base, has_carry, chunk, acc_scratch,
                          data_scratch, pf_dist):
    """Items [b * n / B, (b + 1) * n / B) of the n items, with block b's scratch rows: the
    template of every format's and variant's kernel (``instances.instance`` binds the
    format's ``enc``, ``cvt`` and ``rnd``, the variant's ``op``, ``mean``, ``mean_round`` and
    ``split``, and ``load``, ``combine_term_rows`` and ``fold_partial_sum`` of
    :func:`_make_rows`)."""
    outer, nseg, inner = shape
    use_base = has_base and include_base
    a = cvt(alpha)
    acc = acc_scratch[b, 0]
    comp = acc_scratch[b, 1]
    part = acc_scratch[b, 2]
    pcomp = acc_scratch[b, 3]
    tmp = data_scratch[b]
    line = 64 // src.itemsize
    nchunks = (inner + chunk - 1) // chunk
    n_items = outer * nseg * nchunks
    n_blocks = acc_scratch.shape[0]
    i_begin = b * n_items // n_blocks
    i_end = (b + 1) * n_items // n_blocks
    # Items are numbered (outer, segment, column chunk), the chunk fastest; the walk counts up
    # from the block's first item instead of dividing every item number.
    c = i_begin % nchunks
    s_first = (i_begin // nchunks) % nseg
    o = i_begin // nchunks // nseg
    it = i_begin
    while it < i_end:
        # Columns j0 .. j1 - 1 of the output rows s_first .. s_stop - 1 of outer index o: with
        # one column chunk per row a run of rows, otherwise one item.
        j0 = c * chunk
        j1 = min(j0 + chunk, inner)
        s_stop = min(nseg, s_first + (i_end - it)) if nchunks == 1 else s_first + 1
        w = j1 - j0
        # The run's term rows are the positions offsets[s_first] .. offsets[s_stop] - 1 (a
        # plan's segments are consecutive): prefetching runs ahead over all of them.
        pf_end = offsets[s_stop * fst] if ost >= 0 else 0
        pf_lines = min(_PF_LINES, (w + line - 1) // line) if ss[2] == 1 else 0
        for s in range(s_first, s_stop):
            p0 = offsets[s * fst]
            p1 = offsets[(s + 1) * fst]
            ostart = o * us[0] + s * us[1] + j0 * us[2]
            if p1 == p0 and not use_base:
                # Empty segment: the base row unchanged (a bit copy), or zero.
                if has_base:
                    bstart = o * bs[0] + s * bs[1] + j0 * bs[2]
                    for j in range(w):
                        out[ostart + j * us[2]] = base[bstart + j * bs[2]]
                else:
                    zero = enc(cvt(0.0))
                    for j in range(w):
                        out[ostart + j * us[2]] = zero
                continue

            rstart = o * ss[0] + j0 * ss[2]
            p = p0
            if use_base:
                load(acc, base, o * bs[0] + s * bs[1] + j0 * bs[2], bs[2], w)
            elif op == OP_MAX or op == OP_MIN:
                # amax/amin start from the first term itself.
                load(acc, src, rstart + (order[p * ost] if ost >= 0 else p) * ss[1], ss[2], w)
                p += 1
            else:
                ident = cvt(1.0) if op == OP_MUL else cvt(0.0)
                for j in range(w):
                    acc[j] = ident
            cstart = o * cs[0] + s * cs[1] + j0 * cs[2]
            if has_carry:
                # A running compensated sum resumes: the base row holds s, carry holds c.
                for j in range(w):
                    comp[j] = carry[cstart + j * cs[2]]
            elif op == OP_KAHAN:
                zero = cvt(0.0)
                for j in range(w):
                    comp[j] = zero

            # The first chunk of terms (the whole segment unless it is split) goes into acc.
            end = min(p1, p0 + CHUNK_TERMS) if split else p1
            combine_term_rows(acc, comp, src, ss, order, ost, tmp, rstart, p, end, pf_end,
                              pf_dist, pf_lines, w, a)
            # Later chunks: each reduces its own terms from its first term, then folds into acc.
            while split and end < p1:
                p = end
                end = min(p1, p + CHUNK_TERMS)
                load(part, src, rstart + (order[p * ost] if ost >= 0 else p) * ss[1], ss[2], w)
                if a != 1:
                    # The chunk's first term is a term like any other: RN_A(A(x) * A(alpha)).
                    for j in range(w):
                        part[j] = part[j] * a
                for j in range(w):
                    pcomp[j] = 0.0
                combine_term_rows(part, pcomp, src, ss, order, ost, tmp, rstart, p + 1, end,
                                  pf_end, pf_dist, pf_lines, w, a)
                fold_partial_sum(acc, comp, part, pcomp, w)

            if has_carry:
                # The sum runs on: s goes to out (exact, the data dtype is the acc type) and c to
                # carry, without the final s + c.
                for j in range(w):
                    carry[cstart + j * cs[2]] = comp[j]
            elif op == OP_KAHAN:
                for j in range(w):
                    acc[j] = kahan_result(acc[j], comp[j])
            if mean:
                count = cvt((p1 - p0) + (1 if use_base else 0))
                if mean_round:
                    # ROUND_EACH: torch's scatter_reduce rounds the total to the dtype first,
                    # and counts in the dtype (the count rounded once: 257 is 256 in bfloat16).
                    count = rnd(count)
                    for j in range(w):
                        acc[j] = rnd(acc[j]) / count
                else:
                    for j in range(w):
                        acc[j] = acc[j] / count
            if us[2] == 1:
                u = np.uint64(ostart)
                for j in range(w):
                    out[u + np.uint64(j)] = enc(acc[j])
            else:
                for j in range(w):
                    out[ostart + j * us[2]] = enc(acc[j])

        if nchunks == 1:
            it += s_stop - s_first
            s_first = s_stop
        else:
            it += 1
            c += 1
            if c == nchunks:
                c = 0
                s_first += 1
        if s_first == nseg:
            s_first = 0
            o += 1


@parallel_njit(cache=True)
def _run_blocks(address, types_key, failed, src, ss, order, ost, offsets, fst, base, bs, out,
                us, carry, cs, shape, alpha, include_base, has_base, has_carry, chunk,
                acc_scratch, data_scratch, pf_dist):
    """The driver of every format's and variant's kernel, ``_segment_block_kernel`` at ``address``
    (``instances.Blocks``).

    Threads take whole blocks of items (a block reuses one set of scratch rows); which thread
    runs a block never matters: an item owns its output elements outright and sums each of
    them serially in the segment's order."""
    if types_key_of((src, ss, order, ost, offsets, fst, base, bs, out, us, carry, cs, shape,
                     alpha, include_base, has_base, has_carry, chunk, acc_scratch,
                     data_scratch, pf_dist)) != types_key:
        return OTHER_TYPES
    for b in prange(failed.shape[0]):
        if not call_at(address, np.int64(b), (
                src, ss, order, ost, offsets, fst, base, bs, out, us, carry, cs, shape, alpha,
                include_base, has_base, has_carry, chunk, acc_scratch, data_scratch, pf_dist)):
            failed[b] = 1
    return DONE


#: Per data format: its name, its conversions (see _make_rows) and the acc type.
_FORMATS = {
    torch.float32: ("f32", _f32, _f32, _f32, _f32, np.float32),
    torch.float64: ("f64", _f64, _f64, _f64, _f64, np.float64),
    torch.bfloat16: ("bf16", bf16_bits_to_f32, round_f32_to_bf16, f32_to_bf16_bits, _f32,
                     np.float32),
    torch.float16: ("f16", f16_bits_to_f32, round_f32_to_f16, f32_to_f16_bits, _f32, np.float32),
}

#: (dtype, variant) -> the kernel, made on the first launch that needs it.
_KERNELS = {}


def kernel_for(dtype, variant):
    """The kernel of data type ``dtype`` and ``variant`` (``variants.variant_for``), launched over
    thread blocks (``instances.Blocks``)."""
    kernel = _KERNELS.get((dtype, variant))
    if kernel is None:
        fmt, dec, rnd, enc, cvt, _ = _FORMATS[dtype]
        op, mean, mean_round, split = variant
        load, combine_term_rows, fold_partial_sum = _make_rows(fmt, dec, rnd, op)
        block_kernel = instance(
            _segment_block_kernel, f"{fmt}_{variant_name(*variant)}", enc=enc, cvt=cvt,
            rnd=rnd, op=op, mean=mean, mean_round=mean_round, split=split, load=load,
            combine_term_rows=combine_term_rows, fold_partial_sum=fold_partial_sum)
        kernel = Blocks(_run_blocks, block_kernel)
        _KERNELS[(dtype, variant)] = kernel
    return kernel


def segment_reduce(src, order, offsets, base, out, *, reduce, rule, alpha, include_base,
                   carry=None, chunks=None):
    """See the module docstring (the contract)."""
    if rule == EXACT:
        if carry is not None:
            raise ValueError("segment_reduce: the EXACT rule takes no carry")
        segment_reduce_exact(src, order, offsets, base, out, reduce=reduce, alpha=alpha,
                             include_base=include_base)
        return
    if not has_work(src, order, offsets, _FORMATS):
        return
    outer, _, inner = src.shape
    nseg = offsets.shape[0] - 1
    if rule not in (WIDE, KAHAN, ROUND_EACH):
        raise ValueError(f"segment_reduce: rule {rule} is not implemented on the numba backend "
                         f"(torch's CUDA rules run on the triton backend)")
    kernel = kernel_for(src.dtype, variant_for(reduce, rule, alpha != 1))
    acc_dtype = _FORMATS[src.dtype][5]
    src_np, ss = _flat(src)
    out_np, us = _flat(out)
    offsets_np, (fst,) = _flat(offsets)
    # An absent array is replaced by a present one of the same type (never read), so None
    # and not-None share one compiled specialisation; order stride -1 means "no order".
    base_np, bs = _flat(base) if base is not None else (out_np, us)
    order_np, (ost,) = _flat(order) if order is not None else (offsets_np, (-1,))
    # Without a carry, a one-element acc-type array stands in (never read).
    carry_np, cs = (_flat(carry) if carry is not None
                    else (np.zeros(1, dtype=acc_dtype), (0, 0, 0)))

    # No more threads than torch is set to use (torch.set_num_threads(1) means one), nor than
    # Numba is set to use.
    nthreads = launch_threads()
    terms = outer * (order.shape[0] if order is not None else src.shape[1])
    chunk, n_blocks = work_split(outer * nseg, inner, nthreads, terms)
    acc_scratch = np.empty((n_blocks, 4, chunk), dtype=acc_dtype)
    data_scratch = np.empty((n_blocks, chunk), dtype=src_np.dtype)
    pf_dist = min(_PF_MAX_DIST, max(1, _PF_AHEAD // (chunk * src.element_size())))
    with block_threads(n_blocks, nthreads):
        kernel(n_blocks, (
            src_np, ss, order_np, ost, offsets_np, fst, base_np, bs, out_np, us, carry_np, cs,
            (outer, nseg, inner), float(alpha), bool(include_base), base is not None,
            carry is not None, chunk, acc_scratch, data_scratch, pf_dist,
        ))
