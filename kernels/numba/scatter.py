"""scatter_reduce with an index of the source's shape: each element to its own output element.

``scatter_elements(src, index, base, out, *, reduce, rule, include_base) -> bool``

- ``src``, ``index``: ``[outer, N, inner]`` CPU tensors, any strides; ``src`` float32,
  float64, float16 or bfloat16, ``index`` int32 or int64. Source element ``(o, n, i)`` goes to
  output element ``(o, index[o, n, i], i)``.
- ``base``, ``out``: ``[outer, S, inner]`` of ``src``'s dtype, any non-overlapping strides;
  ``out`` is not ``base``.
- ``reduce``: kernels.SUM, MEAN, PROD, AMAX or AMIN; ``rule``: WIDE, KAHAN or ROUND_EACH.
- Returns False, with every element of ``out`` written, when every index value lies in
  ``[0, S)``; otherwise True (elements with a bad value take part nowhere, ``out`` is
  written all the same; the caller raises).

Each output element is what ``segment.segment_reduce`` computes for it (alpha 1, a base):
the same terms in the same order, increasing ``n`` (the contract's order of appearance along
``dim``), with the same arithmetic, chunks of ``CHUNK_TERMS`` terms under WIDE and KAHAN
included; the module docstring of ``segment`` states it rule by rule. Only the schedule
differs: instead of a plan (a sort of every element by its output element, then a gather of
single elements), one work item streams the source rows of ``outer`` index ``o`` in
increasing ``n`` over a block of columns, and reduces each element where its index sends it,
into a state of the block's ``S x width`` output elements: the accumulator (and Neumaier's
compensation, a later chunk's partial result and its compensation where the rule has them)
and a count of terms so far. The count says when a chunk starts and ends, the mean's
divisor, and whether an element received anything (one that received nothing keeps
``base`` bit for bit without ``include_base``). Items own their output elements outright, so
the thread count never matters. No plan also means no validation pass: the item checks each
index value where it reads it.

Why: a plan over ``outer * N * inner`` elements and ``outer * S * inner`` segments
(1M x 64 into 100k x 64) took seconds to build, where this is one pass over src and index.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import prange

from .. import CHUNK_TERMS, KAHAN, MEAN, ROUND_EACH, SUM, WIDE
from .rounding import (
    bf16_bits_to_f32,
    f16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_f16_bits,
    round_f32_to_bf16,
    round_f32_to_f16,
)
from . import parallel_njit
from .common import (_f32, _f64, _flat, _njit_named_for, block_threads, kahan_result,
                     launch_threads, neumaier)
from .instances import DONE, OTHER_TYPES, Blocks, call_at, instance, types_key_of
from .variants import (OP_ADD, OP_ADD_ROUND, OP_KAHAN, OP_MAX, OP_MIN, OP_MUL, OP_NAMES,
                       variant_for, variant_name)

__all__ = ["scatter_elements"]

#: An item takes as many columns as keep its state (``S x width`` elements) within this many
#: bytes: whole rows (every column of a source row in one stream) where they fit, else the
#: largest power of two that does, so that the state stays in the caches. 1M x 64 random
#: elements into 100k x 64, two threads: "fp32" 0.22-0.25 s at 4 and 8 columns, 0.98 s at 16;
#: "kahan" (a compensation too) 0.32 s at 4 columns, 0.74 s at 8.
_STATE_BYTES = 8 << 20
#: Fewest source elements per thread block (as ``segment._MIN_BLOCK_ELEMENTS``: waking a
#: second thread costs more than a small launch). Only the schedule changes, never a result.
_MIN_BLOCK_ELEMENTS = 65536


@functools.cache  # one set per format and operation: two would share their names
def _make_helpers(fmt, dec, rnd, op):
    """The helpers of ``_scatter_block_kernel`` for one data format (``fmt`` names it) and
    term operation ``op`` (see ``variants.variant_for``): ``every_term``, the pass over the
    rows, and ``fold_partial_sum`` and ``long_segments``, inlined where they are called.

    ``dec`` turns a data element into the acc type and ``rnd`` rounds an acc value to the data
    dtype (see ``segment._make_rows``, and for why each format's and variant's functions
    compile under names of their own)."""
    format_njit = _njit_named_for(f"{fmt}_{OP_NAMES[op]}")

    @format_njit(inline="always")
    def combine(y, x):
        if op == OP_ADD:
            return y + x
        if op == OP_ADD_ROUND:
            return rnd(y + x)
        if op == OP_MUL:
            return y * x
        if op == OP_MAX:
            # NaN propagates; of equal values (+0.0, -0.0) the earlier stays.
            return x if (x != x or x > y) and y == y else y
        return x if (x != x or x < y) and y == y else y

    @format_njit()
    def every_term(src, ss, index, xs, acc, comp, count, o, j0, w, nrows, nseg):
        """The pass over the rows: each term joins its element, unsplit, and is counted;
        returns 1 when an index value lies outside [0, nseg), else 0. A function of its own,
        not inlined: as part of ``_scatter_block_kernel`` the same loop ran 5-8% slower (sum,
        mean; 300k x 64 random elements into 30k x 64, one thread)."""
        bad = 0
        for n in range(nrows):
            r0 = o * ss[0] + n * ss[1] + j0 * ss[2]
            x0 = o * xs[0] + n * xs[1] + j0 * xs[2]
            for j in range(w):
                # Unsigned: Numba adds no negative-index fix-up to these accesses.
                k = index[np.uint64(x0 + j * xs[2])]
                if k < 0 or k >= nseg:
                    bad = 1
                    continue
                e = np.uint64(k * w + j)
                count[e] += 1
                if op == OP_KAHAN:
                    acc[e], comp[e] = neumaier(acc[e], comp[e],
                                               dec(src[np.uint64(r0 + j * ss[2])]))
                else:
                    acc[e] = combine(acc[e], dec(src[np.uint64(r0 + j * ss[2])]))
        return bad

    @format_njit(inline="always")
    def fold_partial_sum(acc, comp, part, pcomp, e):
        """Fold a completed later chunk (part, and pcomp under KAHAN) into element e."""
        if op == OP_KAHAN:
            acc[e], c = neumaier(acc[e], comp[e], part[e])
            comp[e] = c + pcomp[e]
        elif op == OP_MUL:
            acc[e] = acc[e] * part[e]
        else:
            acc[e] = acc[e] + part[e]

    @format_njit(inline="always")
    def long_segments(src, ss, index, xs, base, bs, o, j0, w, nrows, nseg, use_base, ident,
                      acc, comp, part, pcomp, count, seen):
        """The elements of more than CHUNK_TERMS terms (``count``), done again in chunks: the
        first chunk into acc from the start, each later one reduced from its own first term
        and folded in once complete (the last, shorter one by ``_scatter_block_kernel``).
        ``seen`` counts the terms again. The index values were checked by the first pass."""
        for s in range(nseg):
            b0 = o * bs[0] + s * bs[1] + j0 * bs[2]
            for j in range(w):
                e = s * w + j
                seen[e] = 0
                if count[e] > CHUNK_TERMS:
                    acc[e] = dec(base[b0 + j * bs[2]]) if use_base else ident
                    if op == OP_KAHAN:
                        comp[e] = 0.0
        for n in range(nrows):
            r0 = o * ss[0] + n * ss[1] + j0 * ss[2]
            x0 = o * xs[0] + n * xs[1] + j0 * xs[2]
            for j in range(w):
                k = index[np.uint64(x0 + j * xs[2])]
                if k < 0 or k >= nseg:
                    continue
                e = np.uint64(k * w + j)
                if count[e] <= CHUNK_TERMS:
                    continue
                c = seen[e]
                seen[e] = c + 1
                x = dec(src[np.uint64(r0 + j * ss[2])])
                if c < CHUNK_TERMS:
                    if op == OP_KAHAN:
                        acc[e], comp[e] = neumaier(acc[e], comp[e], x)
                    elif op == OP_MUL:
                        acc[e] = acc[e] * x
                    else:
                        acc[e] = acc[e] + x
                    continue
                r = c % CHUNK_TERMS
                if r == 0:
                    part[e] = x
                    if op == OP_KAHAN:
                        pcomp[e] = 0.0
                elif op == OP_KAHAN:
                    part[e], pcomp[e] = neumaier(part[e], pcomp[e], x)
                elif op == OP_MUL:
                    part[e] = part[e] * x
                else:
                    part[e] = part[e] + x
                if r == CHUNK_TERMS - 1:
                    fold_partial_sum(acc, comp, part, pcomp, e)

    return every_term, fold_partial_sum, long_segments


def _scatter_block_kernel(b, src, ss, index, xs, base, bs, out, us, shape, width, use_base,
                          acc_scratch, comp_scratch, part_scratch, pcomp_scratch, count_scratch,
                          seen_scratch, bad):
    """Items [b * n / B, (b + 1) * n / B) of the n items (outer index, block of columns), with
    block b's state; ``bad[b]`` = 1 when an index value lies outside [0, nseg), else 0. The
    template of every format's and variant's kernel: ``instances.instance`` binds the
    format's ``dec``, ``rnd``, ``enc`` and ``cvt``, the variant's ``op``, ``mean``,
    ``mean_round`` and ``split``, and the helpers of :func:`_make_helpers`.

    Item (o, j0): columns j0 .. j0 + w - 1 of outer index o; state element ``s * w + j``.
    The pass over the rows is a load, a count and the combination: a branch on the
    operation, a test of the count, or the chunks' arithmetic beside it (never run) made the
    loop two to three times slower (measured on 1M x 64 random elements into 100k x 64), so
    each variant has the loop of its own operation, unsplit, and the elements of more than
    CHUNK_TERMS terms are done again by ``long_segments``."""
    outer, nrows, nseg, inner = shape
    acc = acc_scratch[b]
    comp = comp_scratch[b]
    part = part_scratch[b]
    pcomp = pcomp_scratch[b]
    count = count_scratch[b]
    seen = seen_scratch[b]
    if op == OP_MUL:
        ident = cvt(1.0)
    elif op == OP_MAX:
        # Below every value: the first term replaces it, as the first term starts a segment
        # without base (a NaN is taken, an equal -inf is the same bits).
        ident = cvt(-np.inf)
    elif op == OP_MIN:
        ident = cvt(np.inf)
    else:
        ident = cvt(0.0)
    zero = cvt(0.0)
    pieces = (inner + width - 1) // width
    n_items = outer * pieces
    n_blocks = bad.shape[0]
    failed = 0
    for it in range(b * n_items // n_blocks, (b + 1) * n_items // n_blocks):
        o = it // pieces
        j0 = (it % pieces) * width
        w = min(width, inner - j0)
        for s in range(nseg):
            b0 = o * bs[0] + s * bs[1] + j0 * bs[2]
            e0 = s * w
            for j in range(w):
                acc[e0 + j] = dec(base[b0 + j * bs[2]]) if use_base else ident
                count[e0 + j] = 0
            if op == OP_KAHAN:
                for j in range(w):
                    comp[e0 + j] = zero

        failed |= every_term(src, ss, index, xs, acc, comp, count, o, j0, w, nrows, nseg)
        if split and nrows > CHUNK_TERMS and count[:nseg * w].max() > CHUNK_TERMS:
            long_segments(src, ss, index, xs, base, bs, o, j0, w, nrows, nseg, use_base, ident,
                          acc, comp, part, pcomp, count, seen)

        for s in range(nseg):
            b0 = o * bs[0] + s * bs[1] + j0 * bs[2]
            u0 = o * us[0] + s * us[1] + j0 * us[2]
            e0 = s * w
            for j in range(w):
                e = e0 + j
                c = count[e]
                if c == 0 and not use_base:
                    # Nothing reached it: the base element unchanged (a bit copy).
                    out[u0 + j * us[2]] = base[b0 + j * bs[2]]
                    continue
                if split and c > CHUNK_TERMS and c % CHUNK_TERMS != 0:
                    fold_partial_sum(acc, comp, part, pcomp, e)  # the last, shorter chunk
                v = acc[e]
                if op == OP_KAHAN:
                    v = kahan_result(v, comp[e])
                if mean:
                    divisor = cvt(c + (1 if use_base else 0))
                    # ROUND_EACH: the total and the count rounded to the dtype (torch's).
                    v = rnd(v) / rnd(divisor) if mean_round else v / divisor
                out[u0 + j * us[2]] = enc(v)
    bad[b] = failed


@parallel_njit(cache=True)
def _run_blocks(address, types_key, failed, src, ss, index, xs, base, bs, out, us, shape,
                width, use_base, acc_scratch, comp_scratch, part_scratch, pcomp_scratch,
                count_scratch, seen_scratch, bad):
    """The driver of every format's and variant's kernel, ``_scatter_block_kernel`` at ``address``
    (``instances.Blocks``). Items own their output elements outright, so which thread runs
    a block never matters."""
    if types_key_of((src, ss, index, xs, base, bs, out, us, shape, width, use_base,
                     acc_scratch, comp_scratch, part_scratch, pcomp_scratch, count_scratch,
                     seen_scratch, bad)) != types_key:
        return OTHER_TYPES
    for b in prange(failed.shape[0]):
        if not call_at(address, np.int64(b), (
                src, ss, index, xs, base, bs, out, us, shape, width, use_base, acc_scratch,
                comp_scratch, part_scratch, pcomp_scratch, count_scratch, seen_scratch, bad)):
            failed[b] = 1
    return DONE


#: Per data format: its name, its conversions (see ``segment._make_rows``) and the acc type.
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
    """The kernel of data type ``dtype`` and ``variant`` (``variants.variant_for``, alpha 1),
    launched over thread blocks (``instances.Blocks``)."""
    kernel = _KERNELS.get((dtype, variant))
    if kernel is None:
        fmt, dec, rnd, enc, cvt, _ = _FORMATS[dtype]
        op, mean, mean_round, split = variant
        every_term, fold_partial_sum, long_segments = _make_helpers(fmt, dec, rnd, op)
        block_kernel = instance(
            _scatter_block_kernel, f"{fmt}_{variant_name(*variant)}", dec=dec, rnd=rnd,
            enc=enc, cvt=cvt, op=op, mean=mean, mean_round=mean_round, split=split,
            every_term=every_term, fold_partial_sum=fold_partial_sum,
            long_segments=long_segments)
        kernel = Blocks(_run_blocks, block_kernel)
        _KERNELS[(dtype, variant)] = kernel
    return kernel


def work_split(outer, inner, nseg, state_bytes, nthreads, elements):
    """(columns per item, thread blocks): as many columns as ``_STATE_BYTES`` allows (at least
    one); narrower items when there are fewer items than threads; one block for a small
    launch."""
    width = inner
    if nseg * inner * state_bytes > _STATE_BYTES:
        width = 1
        while 2 * width * nseg * state_bytes <= _STATE_BYTES:
            width *= 2
    pieces = -(-inner // width)
    while outer * pieces < nthreads and pieces < inner:
        pieces = min(inner, 2 * pieces)
    width = -(-inner // pieces)
    pieces = -(-inner // width)
    n_blocks = min(outer * pieces, nthreads, max(1, elements // _MIN_BLOCK_ELEMENTS))
    return width, n_blocks


def scatter_elements(src, index, base, out, *, reduce, rule, include_base):
    """See the module docstring (the contract)."""
    if src.dtype not in _FORMATS:
        raise TypeError(f"scatter_elements: unsupported dtype {src.dtype}")
    if rule not in (WIDE, KAHAN, ROUND_EACH):
        raise ValueError(f"scatter_elements: rule {rule} is not implemented")
    outer, nrows, inner = src.shape
    nseg = base.shape[1]
    if outer == 0 or inner == 0 or nseg == 0:
        return False
    reduce, rule = int(reduce), int(rule)
    kernel = kernel_for(src.dtype, variant_for(reduce, rule, False))  # no alpha here
    acc_dtype = _FORMATS[src.dtype][5]
    src_np, ss = _flat(src)
    index_np, xs = _flat(index)
    base_np, bs = _flat(base)
    out_np, us = _flat(out)
    kahan = reduce in (SUM, MEAN) and rule == KAHAN
    # Counts of at most nrows: int32 halves the state that every term touches.
    count_dtype = np.int32 if nrows < 2**31 else np.int64
    state_bytes = (np.dtype(acc_dtype).itemsize * (2 if kahan else 1)
                   + np.dtype(count_dtype).itemsize)
    nthreads = launch_threads()
    width, n_blocks = work_split(outer, inner, nseg, state_bytes, nthreads, src.numel())
    state = nseg * width
    # Only the state the rule reads is allocated at full size.
    kahan_state = state if kahan else 1
    chunk_state = state if rule in (WIDE, KAHAN) and nrows > CHUNK_TERMS else 1
    acc = np.empty((n_blocks, state), dtype=acc_dtype)
    comp = np.empty((n_blocks, kahan_state), dtype=acc_dtype)
    part = np.empty((n_blocks, chunk_state), dtype=acc_dtype)
    pcomp = np.empty((n_blocks, min(kahan_state, chunk_state)), dtype=acc_dtype)
    count = np.empty((n_blocks, state), dtype=count_dtype)
    seen = np.empty((n_blocks, chunk_state), dtype=count_dtype)
    bad = np.zeros(n_blocks, dtype=np.int64)
    with block_threads(n_blocks, nthreads):
        kernel(n_blocks, (src_np, ss, index_np, xs, base_np, bs, out_np, us,
                          (outer, nrows, nseg, inner), width, bool(include_base), acc, comp,
                          part, pcomp, count, seen, bad))
    return bool(bad.any())
