"""A small index_add, or a small scatter of amax or amin, in one serial call: the index
checked, then every term combined into its output row in order of appearance, without a plan.

``index_add_small(src, index, base, out, alpha, rule)`` computes what
``segment.segment_reduce`` computes for ``index_add`` (reduce SUM, the base included, one
segment per output row, the segments' rows in order of appearance) when no segment is cut into
chunks: under the rules that split (WIDE, KAHAN), no output row has more than ``CHUNK_TERMS``
terms (past ``CHUNK_TERMS`` terms in all the kernel counts each row's, and answers
``TOO_MANY_TERMS``, having written nothing, for a row of more). Walking the terms in their own
order visits each output row's terms in the canonical order, so no order and no offsets are
needed. The arithmetic is the segment kernel's, element by element, for rules WIDE, KAHAN and
ROUND_EACH (see its module docstring): ``acc = A(base)``; per term ``t = A(x) * A(alpha)``
(ROUND_EACH: ``RN_D`` of it unless ``alpha == 1``) added as the rule says; KAHAN's final
``s + c``; then rounded to the dtype. Every output row is written, those without terms too
(their base through the acc type, as the segment kernel writes them).

``index_add_one_column(src, index, base, out, rule, alpha)`` computes the same for one column
(1-D ``src`` and ``base``) with rows of any length, in one pass over the terms: under WIDE
and KAHAN a row of more than ``CHUNK_TERMS`` terms is cut into chunks as the segment kernel
cuts it (each row keeps its count and its later chunk's partial sum beside its sum). A 1-D
sum of many terms takes it at any size (``detsum._segments.streamed_scatter``).
``extreme_one_column`` (a max or min), ``reduce_one_column`` (the elementwise scatter's sum,
mean and product, ``scatter.py``'s variants) and ``histogram`` (torch's CPU ``histc``'s
counts) are one column's too: one pass that checks each index value as it reads it, each
row's state kept apart from the output, written after it.

``extreme_small_in_place`` does the same for the segment kernel's AMAX and AMIN, which no
rule splits into chunks, into its target itself (the switch's in-place ``scatter_reduce_``):
each row the first of its values (its base row, or else its first term) compared with every
later term in turn. ``mean_small_in_place`` does it for the segment kernel's MEAN: each row's
sum, from its base row or from +0.0, divided by its count (``_mean_at``), under the rules
above, split as the sums are. ``segment_reduce_small`` does it for the segment kernel's SUM,
MEAN, AMAX and AMIN over CSR offsets or lengths with no order and no base (``segment_sum``,
and the switch's ``segment_reduce``), each segment's rows in order, the bounds checked first.

Why: a call of a few hundred rows cost about 55 µs in the general path (plan, views, launch,
the thread setting) against a few µs of arithmetic; ``tests/test_small_index_add.py`` and
``tests/test_small_segments.py`` check the bits against the general path. The tensors reach
the kernel as addresses and sizes, not as NumPy arrays, which cost more to make than the
arithmetic (benches/NOTES.md).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from .. import (AMAX, AMIN, CHUNK_TERMS, KAHAN, MEAN, REDUCE_CODES, ROUND_EACH, RULE_NAMES,
                SMALL_CALL_ELEMENTS, SUM, WIDE)
from .rounding import (
    bf16_bits_to_f32,
    f16_bits_to_f32,
    f32_to_bf16_bits,
    f32_to_f16_bits,
    round_f32_to_bf16,
    round_f32_to_f16,
)
from . import njit
from .common import _f32, _f64, kahan_result, neumaier
from .instances import instance
from .variants import OP_ADD_ROUND, OP_KAHAN, OP_MUL, variant_for, variant_name

__all__ = ["index_add_small", "index_add_one_column", "index_add_small_in_place",
           "extreme_small_in_place", "extreme_one_column", "reduce_one_column", "histogram",
           "mean_small_in_place", "segment_reduce_small", "fits", "TOO_MANY_TERMS",
           "BAD_OFFSETS"]

#: ``index_add_small``'s answer for an output row of more than CHUNK_TERMS terms, which the
#: general path cuts into chunks (another arithmetic): nothing written, the general path's call.
TOO_MANY_TERMS = -2

#: ``segment_reduce_small``'s answer for offsets that are not CSR offsets of the source's rows (a
#: first offset other than 0, a last other than the rows' count, a decrease): nothing written,
#: the general path's call, whose check names the problem.
BAD_OFFSETS = -3

#: The rules computed here: those of index_add's sum but EXACT.
RULES = (WIDE, KAHAN, ROUND_EACH)

#: Largest launch (elements of the source and the output) taken here; larger ones pay for a
#: plan and threads (see common._MIN_BLOCK_ELEMENTS).
MAX_ELEMENTS = SMALL_CALL_ELEMENTS


@intrinsic
def _at(typingctx, address):
    """The int ``address`` (a tensor's ``data_ptr()``) as a pointer, for ``numba.carray``."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@njit(inline="always")
def _counted(index, n, rows, counts, limit):
    """Each of the ``n`` values of ``index`` checked against ``[0, rows)`` and counted into
    its row's ``counts``, in order: the first position of a bad value, or TOO_MANY_TERMS at
    the first row past ``limit`` terms (the values after it unchecked), or -1."""
    for i in range(n):
        v = index[i]
        if v < 0 or v >= rows:
            return i
        counts[v] += 1
        if counts[v] > limit:
            return TOO_MANY_TERMS
    return -1


@njit(inline="always")
def _picked(x, y, maximum):
    """Whether term ``x`` replaces the pick ``y`` of the segment kernel's AMAX (``maximum``)
    or AMIN: NaN propagates; of equal values (+0.0, -0.0) the earlier stays."""
    return (x != x or (x > y if maximum else x < y)) and y == y


def _index_add_at(src_at, index_at, base_at, out_at, outer, n, inner, rows, alpha, in_place):
    """Returns -1 having written ``out`` (``[outer, rows, inner]``; it may be ``base`` itself),
    or, having written nothing, TOO_MANY_TERMS where an output row has more than CHUNK_TERMS
    terms under a rule that splits, or the first position of ``index`` outside ``[0, rows)``
    (before the row's CHUNK_TERMS + 1st term, if any).

    The template of every format's and rule's kernel: ``instances.instance`` binds ``rule``,
    the format's ``dec``, ``rnd``, ``enc`` and ``cvt`` (see ``segment._make_rows``), its
    ``data_dtype`` (uint16 for the 16-bit formats, their bits) and ``acc_dtype``, and
    ``acc_is_data``. The tensors arrive as the addresses of their contiguous storage and their
    sizes: three tensors turned into NumPy arrays for the call cost more (about 0.6 µs each)
    than the arithmetic of a small call."""
    src = carray(_at(src_at), (outer, n, inner), data_dtype)
    index = carray(_at(index_at), (n,), np.int64)
    base = carray(_at(base_at), (outer, rows, inner), data_dtype)
    out = carray(_at(out_at), (outer, rows, inner), data_dtype)
    # Every index value is checked before anything is written (out may be base itself). The
    # rules that split (SPLIT_RULES: WIDE and KAHAN) cut a row of more than CHUNK_TERMS terms
    # into chunks: past CHUNK_TERMS terms, each row's are counted in the same pass, which
    # stops at the first row of too many (the general path then checks the rest itself).
    # ROUND_EACH adds every term in turn, whatever their number.
    if rule != ROUND_EACH and n > CHUNK_TERMS:
        answer = _counted(index, n, rows, np.zeros(rows, dtype=np.int64), CHUNK_TERMS)
        if answer != -1:
            return answer
    else:
        for i in range(n):
            if index[i] < 0 or index[i] >= rows:
                return i
    a = cvt(alpha)
    if rule != KAHAN and acc_is_data:
        # fp32 and fp64 data outside KAHAN: the acc type is the data type and every rounding
        # to it is the identity, so the rows are summed where they lie.
        if not in_place:
            # Element by element: a slice assignment of an array would compile Numba's
            # broadcasting checks, seconds of compile for a shape error that cannot occur.
            for o in range(outer):
                for s in range(rows):
                    for j in range(inner):
                        out[o, s, j] = base[o, s, j]
        for o in range(outer):
            for i in range(n):
                v = index[i]
                for j in range(inner):
                    out[o, v, j] = out[o, v, j] + src[o, i, j] * a
        return -1
    acc = np.empty((rows, inner), dtype=acc_dtype)
    comp = np.zeros((rows, inner), dtype=acc_dtype)
    for o in range(outer):
        for s in range(rows):
            for j in range(inner):
                acc[s, j] = dec(base[o, s, j])
        if rule == KAHAN:
            comp[:, :] = 0
            for i in range(n):
                v = index[i]
                for j in range(inner):
                    acc[v, j], comp[v, j] = neumaier(acc[v, j], comp[v, j], dec(src[o, i, j]) * a)
            for s in range(rows):
                for j in range(inner):
                    out[o, s, j] = enc(kahan_result(acc[s, j], comp[s, j]))
            continue
        if rule == ROUND_EACH and alpha == 1.0:
            for i in range(n):
                v = index[i]
                for j in range(inner):
                    acc[v, j] = rnd(acc[v, j] + dec(src[o, i, j]))
        elif rule == ROUND_EACH:
            # torch rounds source * alpha to the dtype before adding.
            for i in range(n):
                v = index[i]
                for j in range(inner):
                    acc[v, j] = rnd(acc[v, j] + rnd(dec(src[o, i, j]) * a))
        else:
            for i in range(n):
                v = index[i]
                for j in range(inner):
                    acc[v, j] = acc[v, j] + dec(src[o, i, j]) * a
        for s in range(rows):
            for j in range(inner):
                out[o, s, j] = enc(acc[s, j])
    return -1


def _one_column_sum_at(src_at, index_at, base_at, out_at, n, rows, alpha):
    """Returns -1 having written ``out`` (``rows`` elements; it may be ``base`` itself): each
    element its ``base`` value with the ``n`` terms of ``src`` at ``index`` added under
    ``rule``, each scaled by ``alpha``, or, having written nothing, the first position of
    ``index`` outside ``[0, rows)``. One column: ``index_add_small``'s sum of ``[1, n, 1]``
    by ``[1, rows, 1]`` (its terms ``A(x) * A(alpha)``, under ROUND_EACH rounded to the dtype
    unless ``alpha == 1``), for rows of any length.

    One pass over the terms checks each index value as it reads it and keeps each row's
    state apart from ``out``, which is written after it. Under WIDE and KAHAN a row's terms
    are cut into chunks as the segment kernel cuts them (its module docstring;
    ``scatter.long_segments`` streams them the same way): the first CHUNK_TERMS are added to
    the row's base in the acc type, each later chunk is summed from its own first term and
    added to that once complete (the last, shorter one at the end); under KAHAN each sum is
    Neumaier's, a chunk's compensation added to the row's as the chunk is. ROUND_EACH adds
    every term in turn, ``RN_D`` after each add.

    A row's count of terms shares its cache line with its sum (``state``'s first column,
    the sum's bits read as an integer of its width): a million terms into 100k rows took 1.6
    ms so, 3.1 ms with the counts an array of their own (benches/NOTES.md). The count stops
    at ``2 * CHUNK_TERMS - 1``: past the first chunk it only places a term in its chunk, so a
    completed later chunk sets it back to CHUNK_TERMS.

    The template of every format's and rule's kernel, bound as ``_index_add_at`` is, and with
    ``count_dtype``, the signed integer of the acc type's width."""
    src = carray(_at(src_at), (n,), data_dtype)
    index = carray(_at(index_at), (n,), np.int64)
    base = carray(_at(base_at), (rows,), data_dtype)
    out = carray(_at(out_at), (rows,), data_dtype)
    a = cvt(alpha)
    if rule == ROUND_EACH:
        acc = np.empty(rows, dtype=acc_dtype)
        for s in range(rows):
            acc[s] = dec(base[s])
        for i in range(n):
            v = index[i]
            if v < 0 or v >= rows:
                return i
            # torch rounds source * alpha to the dtype before adding.
            x = dec(src[i]) if alpha == 1.0 else rnd(dec(src[i]) * a)
            acc[v] = rnd(acc[v] + x)
        for s in range(rows):
            out[s] = enc(acc[s])
        return -1
    # Per row: its count, its sum and (KAHAN) its compensation; its later chunk's partial
    # sum and (KAHAN) compensation, set at the chunk's first term.
    state = np.empty((rows, 3 if rule == KAHAN else 2), dtype=acc_dtype)
    count = state.view(count_dtype)
    chunk = np.empty((rows, 2 if rule == KAHAN else 1), dtype=acc_dtype)
    for s in range(rows):
        count[s, 0] = 0
        state[s, 1] = dec(base[s])
        if rule == KAHAN:
            state[s, 2] = 0.0
    for i in range(n):
        v = index[i]
        if v < 0 or v >= rows:
            return i
        c = count[v, 0]
        x = dec(src[i]) * a
        if c < CHUNK_TERMS:
            count[v, 0] = c + 1
            if rule == KAHAN:
                state[v, 1], state[v, 2] = neumaier(state[v, 1], state[v, 2], x)
            else:
                state[v, 1] = state[v, 1] + x
            continue
        place = c - CHUNK_TERMS
        if place == 0:
            chunk[v, 0] = x
            if rule == KAHAN:
                chunk[v, 1] = 0.0
        elif rule == KAHAN:
            chunk[v, 0], chunk[v, 1] = neumaier(chunk[v, 0], chunk[v, 1], x)
        else:
            chunk[v, 0] = chunk[v, 0] + x
        if place == CHUNK_TERMS - 1:
            _fold_later_chunk(state, chunk, v, rule == KAHAN, False)
            count[v, 0] = CHUNK_TERMS
        else:
            count[v, 0] = c + 1
    for s in range(rows):
        if count[s, 0] > CHUNK_TERMS:
            _fold_later_chunk(state, chunk, s, rule == KAHAN, False)  # the last, shorter
        total = state[s, 1]
        if rule == KAHAN:
            total = kahan_result(total, state[s, 2])
        out[s] = enc(total)
    return -1


def _one_column_reduce_at(src_at, index_at, base_at, out_at, n, rows, include_base):
    """Returns -1 having written ``out`` (``rows`` elements; it may be ``base`` itself), or,
    having written nothing, the first position of ``index`` outside ``[0, rows)``: one
    column of the elementwise scatter's sum, mean or product (``scatter.py``'s
    ``_scatter_block_kernel`` for ``[1, n, 1]`` into ``[1, rows, 1]``, the same variant,
    the same bits) in one pass that checks each index value as it reads it, each row's state
    kept apart from ``out``, which is written after it. A row starts from its ``base`` value
    under ``include_base``, else from the operation's identity; every term is combined by
    ``op`` in order; under ``split`` a row of more than CHUNK_TERMS terms is cut into chunks
    as ``segment``'s kernel cuts it (a later chunk reduced from its first term, folded in
    once complete); a mean divides by its count (and the base), rounding the total to the
    dtype first under ``mean_round``; a row without terms and without ``include_base`` keeps
    ``base``'s bits. A row's count lies beside its state, and counts every term (a mean's
    divisor): the wrapper keeps ``n`` within ``count_dtype``.

    The template of every format's and variant's kernel: ``instances.instance`` binds the
    variant's ``op``, ``mean``, ``mean_round`` and ``split`` (``variants.variant_for``, alpha
    1) and the format's ``dec``, ``rnd``, ``enc``, ``cvt``, ``data_dtype``, ``acc_dtype``
    and ``count_dtype``."""
    src = carray(_at(src_at), (n,), data_dtype)
    index = carray(_at(index_at), (n,), np.int64)
    base = carray(_at(base_at), (rows,), data_dtype)
    out = carray(_at(out_at), (rows,), data_dtype)
    kahan = op == OP_KAHAN
    identity = cvt(1.0) if op == OP_MUL else cvt(0.0)
    # Per row: its count, its value and (KAHAN) its compensation; its later chunk's value
    # and (KAHAN) compensation, set at the chunk's first term.
    state = np.empty((rows, 3 if kahan else 2), dtype=acc_dtype)
    count = state.view(count_dtype)
    chunk = np.empty((rows, 2 if kahan else 1), dtype=acc_dtype)
    for s in range(rows):
        count[s, 0] = 0
        state[s, 1] = dec(base[s]) if include_base else identity
        if kahan:
            state[s, 2] = 0.0
    for i in range(n):
        v = index[i]
        if v < 0 or v >= rows:
            return i
        c = count[v, 0]
        count[v, 0] = c + 1
        x = dec(src[i])
        # (The operations written out here, not in helpers: a helper would not see the
        # instance's bound op and rnd.)
        if not split or c < CHUNK_TERMS:
            if kahan:
                state[v, 1], state[v, 2] = neumaier(state[v, 1], state[v, 2], x)
            elif op == OP_ADD_ROUND:
                state[v, 1] = rnd(state[v, 1] + x)
            elif op == OP_MUL:
                state[v, 1] = state[v, 1] * x
            else:
                state[v, 1] = state[v, 1] + x
            continue
        place = c % CHUNK_TERMS
        if place == 0:
            chunk[v, 0] = x
            if kahan:
                chunk[v, 1] = 0.0
        elif kahan:
            chunk[v, 0], chunk[v, 1] = neumaier(chunk[v, 0], chunk[v, 1], x)
        elif op == OP_MUL:
            chunk[v, 0] = chunk[v, 0] * x
        else:
            chunk[v, 0] = chunk[v, 0] + x
        if place == CHUNK_TERMS - 1:
            _fold_later_chunk(state, chunk, v, kahan, op == OP_MUL)
    for s in range(rows):
        c = count[s, 0]
        if c == 0 and not include_base:
            out[s] = base[s]  # nothing reached it: its bits
            continue
        if split and c > CHUNK_TERMS and c % CHUNK_TERMS != 0:
            _fold_later_chunk(state, chunk, s, kahan, op == OP_MUL)  # the last, shorter
        total = state[s, 1]
        if kahan:
            total = kahan_result(total, state[s, 2])
        if mean:
            divisor = cvt(c + (1 if include_base else 0))
            # ROUND_EACH: the total and the count rounded to the dtype (torch's).
            total = rnd(total) / rnd(divisor) if mean_round else total / divisor
        out[s] = enc(total)
    return -1


@njit(inline="always")
def _fold_later_chunk(state, chunk, s, kahan, product):
    """Row ``s``'s completed later chunk (its value, and its compensation under KAHAN) folded
    into the row's, as the segment kernel and the scatter fold it (the one-column kernels'
    ``state`` and ``chunk``)."""
    if kahan:
        state[s, 1], c = neumaier(state[s, 1], state[s, 2], chunk[s, 0])
        state[s, 2] = c + chunk[s, 1]
    elif product:
        state[s, 1] = state[s, 1] * chunk[s, 0]
    else:
        state[s, 1] = state[s, 1] + chunk[s, 0]


def _one_column_extreme_at(src_at, index_at, base_at, out_at, n, rows, include_base):
    """Returns -1 having written ``out`` (``rows`` elements; it may be ``base`` itself), or,
    having written nothing, the first position of ``index`` outside ``[0, rows)``: one
    column's ``_extreme_at`` (``[1, n, 1]`` by ``[1, rows, 1]``) into ``out``, a row without
    terms ``base``'s own value there (``enc`` of it, under ``include_base``, as
    ``_extreme_at`` writes it), in one pass over the terms that checks each index value as it
    reads it, the picks kept apart from ``out``, which is written after it. A row's flag
    (whether it has its first value) shares its cache line with its pick, as
    ``_one_column_sum_at``'s count does with its sum.

    The template of every format's and reduction's kernel, bound as ``_extreme_at`` is, and
    with ``count_dtype`` (``_one_column_sum_at``)."""
    src = carray(_at(src_at), (n,), data_dtype)
    index = carray(_at(index_at), (n,), np.int64)
    base = carray(_at(base_at), (rows,), data_dtype)
    out = carray(_at(out_at), (rows,), data_dtype)
    state = np.empty((rows, 2), dtype=acc_dtype)
    started = state.view(count_dtype)
    for s in range(rows):
        started[s, 0] = include_base
        state[s, 1] = dec(base[s])
    for i in range(n):
        v = index[i]
        if v < 0 or v >= rows:
            return i
        x = dec(src[i])
        if started[v, 0] == 0:
            started[v, 0] = 1
            state[v, 1] = x
        elif _picked(x, state[v, 1], maximum):
            state[v, 1] = x
    for s in range(rows):
        out[s] = enc(state[s, 1]) if started[s, 0] != 0 else base[s]
    return -1


def _histogram_at(values_at, n, left, right, width, scale, bins, counts_at):
    """``counts`` (``bins`` int64) set to the number of the ``n`` values ``left <= x <=
    right`` in each bin ``(x - left) * scale / width``, each step rounded to the data's
    dtype (``rnd``, in the acc type), truncated toward zero, a bin past the last counted in
    the last one; NaN and values outside the edges are not counted. The four numbers are
    values of the dtype (exact in the acc type), ``width > 0`` and ``scale`` finite, such
    that ``right``'s bin, the largest, is below ``bins + 1`` (``detsum.switch._histc_edges``
    makes sure of it). One pass over the values.

    The template of every format's kernel, bound with the format's ``dec``, ``rnd``, ``cvt``
    and ``data_dtype``."""
    values = carray(_at(values_at), (n,), data_dtype)
    counts = carray(_at(counts_at), (bins,), np.int64)
    low, high, w, sc = cvt(left), cvt(right), cvt(width), cvt(scale)
    last = bins - 1
    for k in range(bins):
        counts[k] = 0
    for i in range(n):
        x = dec(values[i])
        if x >= low and x <= high:
            position = np.int64(rnd(rnd(rnd(x - low) * sc) / w))
            counts[min(position, last)] += 1
    return 0


def _extreme_at(src_at, index_at, target_at, outer, n, inner, rows, include_base):
    """Returns -1 having written ``target`` (``[outer, rows, inner]``) in place, or, having
    written nothing, the first position of ``index`` outside ``[0, rows)``.

    Each target row becomes the largest (``maximum``) or smallest of its terms, and of its own
    values first under ``include_base``, picked as the segment kernel's AMAX and AMIN pick,
    term by term in order of appearance (its canonical order): NaN propagates, the earlier of
    +0.0 and -0.0 stays; the pick, in the acc type, is written through ``enc``. A row without
    terms: ``enc`` of its own values under ``include_base`` (as the segment kernel writes
    it), else untouched. Never split into chunks, as there: the pick is the same either way.

    The template of every format's and reduction's kernel: ``instances.instance`` binds
    ``maximum`` and the format's ``dec``, ``enc``, ``data_dtype`` and ``acc_dtype`` (see
    ``_index_add_at``)."""
    src = carray(_at(src_at), (outer, n, inner), data_dtype)
    index = carray(_at(index_at), (n,), np.int64)
    target = carray(_at(target_at), (outer, rows, inner), data_dtype)
    for i in range(n):
        if index[i] < 0 or index[i] >= rows:
            return i
    acc = np.empty((rows, inner), dtype=acc_dtype)
    # Whether a row has its first value in acc: its own, or its first term.
    started = np.zeros(rows, dtype=np.bool_)
    for o in range(outer):
        for s in range(rows):
            started[s] = include_base
            if include_base:
                for j in range(inner):
                    acc[s, j] = dec(target[o, s, j])
        for i in range(n):
            v = index[i]
            if not started[v]:
                started[v] = True
                for j in range(inner):
                    acc[v, j] = dec(src[o, i, j])
            else:
                for j in range(inner):
                    x = dec(src[o, i, j])
                    if _picked(x, acc[v, j], maximum):
                        acc[v, j] = x
        for s in range(rows):
            if started[s]:
                for j in range(inner):
                    target[o, s, j] = enc(acc[s, j])
    return -1


def _mean_at(src_at, index_at, target_at, outer, n, inner, rows, include_base):
    """Returns -1 having written ``target`` (``[outer, rows, inner]``) in place, or, having
    written nothing, TOO_MANY_TERMS where a row has more than CHUNK_TERMS terms under a rule
    that splits (WIDE, KAHAN), or the first position of ``index`` outside ``[0, rows)``
    (before such a row's CHUNK_TERMS + 1st term, if any).

    Each target row becomes the mean of its terms, the rows of ``src`` at ``index``, and of
    its own values first under ``include_base``, computed as the segment kernel's MEAN: the
    sum in the acc type from the row's own values (under ``include_base``) or from +0.0, the
    terms added in order of appearance (its canonical order), WIDE or KAHAN (Neumaier, then
    ``s + c``); ROUND_EACH sums WIDE and rounds the total to the dtype (torch's CPU
    ``scatter_reduce`` mean); then divided by the count (the terms, and the row itself under
    ``include_base``; under ROUND_EACH rounded to the dtype, as torch counts in it) in the acc
    type, and written through ``enc``. A row without terms: ``enc`` of its own values under
    ``include_base`` (its mean of one), else untouched.

    The template of every format's and rule's kernel: ``instances.instance`` binds ``rule``
    and the format's ``dec``, ``rnd``, ``enc``, ``cvt``, ``data_dtype`` and ``acc_dtype``
    (see ``_index_add_at``)."""
    src = carray(_at(src_at), (outer, n, inner), data_dtype)
    index = carray(_at(index_at), (n,), np.int64)
    target = carray(_at(target_at), (outer, rows, inner), data_dtype)
    counts = np.zeros(rows, dtype=np.int64)
    answer = _counted(index, n, rows, counts, CHUNK_TERMS if rule != ROUND_EACH else n)
    if answer != -1:
        return answer
    acc = np.empty((rows, inner), dtype=acc_dtype)
    comp = np.zeros((rows, inner), dtype=acc_dtype)
    zero = cvt(0.0)
    for o in range(outer):
        for s in range(rows):
            for j in range(inner):
                acc[s, j] = dec(target[o, s, j]) if include_base else zero
                comp[s, j] = zero
        for i in range(n):
            v = index[i]
            for j in range(inner):
                if rule == KAHAN:
                    acc[v, j], comp[v, j] = neumaier(acc[v, j], comp[v, j], dec(src[o, i, j]))
                else:
                    acc[v, j] = acc[v, j] + dec(src[o, i, j])
        for s in range(rows):
            if counts[s] == 0 and not include_base:
                continue
            count = cvt(counts[s] + (1 if include_base else 0))
            if rule == ROUND_EACH:
                count = rnd(count)  # torch counts in the dtype: 257 is 256 in bfloat16
            for j in range(inner):
                total = acc[s, j]
                if rule == KAHAN:
                    total = kahan_result(total, comp[s, j])
                elif rule == ROUND_EACH:
                    total = rnd(total)
                target[o, s, j] = enc(total / count)
    return -1


def _segment_at(src_at, bounds_at, out_at, outer, n, inner, segments, lengths, empty_nan):
    """Returns -1 having written ``out`` (``[outer, segments, inner]``), or, having written
    nothing, BAD_OFFSETS where the bounds do not tile the ``n`` rows, or TOO_MANY_TERMS where a
    segment has more than CHUNK_TERMS rows under a rule that splits (WIDE, KAHAN) a sum or a
    mean. The bounds (int64) are ``segments + 1`` offsets that run from 0 to ``n`` without
    decreasing, or with ``lengths`` the ``segments`` lengths (none negative, summing to ``n``)
    whose running sum from 0 are those offsets.

    Segment ``s`` of each outer index reduces the rows ``offsets[s]`` to ``offsets[s + 1] - 1``
    of ``src`` (``[outer, n, inner]``) in order, as the segment kernel does without a base:
    ``reduce`` SUM from +0.0 in the acc type, WIDE, KAHAN (Neumaier, then ``s + c``) or
    ROUND_EACH (rounded to the dtype after every term), written through ``enc``, an empty
    segment 0; MEAN that sum divided by the segment's length in the acc type, an empty
    segment NaN with ``empty_nan``, else 0 (under WIDE and KAHAN the segment kernel's MEAN;
    under ROUND_EACH torch's CPU ``segment_reduce`` mean: the sum rounded after every term
    divided by the length rounded to the dtype, as torch divides in the dtype, where the
    segment kernel's ROUND_EACH mean is ``scatter_reduce``'s); AMAX and AMIN the segment
    kernel's pick (NaN propagates, the earlier of +0.0 and -0.0 stays) from -inf and +inf,
    an empty segment those.

    The template of every format's, reduction's and rule's kernel: ``instances.instance``
    binds ``reduce``, ``rule`` and the format's ``dec``, ``rnd``, ``enc``, ``cvt``,
    ``data_dtype`` and ``acc_dtype`` (see ``_index_add_at``)."""
    src = carray(_at(src_at), (outer, n, inner), data_dtype)
    bounds = carray(_at(bounds_at), (segments if lengths else segments + 1,), np.int64)
    out = carray(_at(out_at), (outer, segments, inner), data_dtype)
    start = 0 if lengths else bounds[0]
    if start != 0:
        return BAD_OFFSETS
    splits = rule != ROUND_EACH and (reduce == SUM or reduce == MEAN)
    for s in range(segments):
        length = bounds[s] if lengths else bounds[s + 1] - bounds[s]
        if length < 0:
            return BAD_OFFSETS
        if splits and length > CHUNK_TERMS:
            return TOO_MANY_TERMS
        start += length
    if start != n:
        return BAD_OFFSETS
    acc = np.empty(inner, dtype=acc_dtype)
    comp = np.empty(inner, dtype=acc_dtype)
    zero = cvt(0.0)
    if reduce == AMAX:
        first = cvt(-np.inf)
    elif reduce == AMIN:
        first = cvt(np.inf)
    else:
        first = zero
    for o in range(outer):
        end = 0
        for s in range(segments):
            start = end
            end = start + bounds[s] if lengths else bounds[s + 1]
            for j in range(inner):
                acc[j] = first
                comp[j] = zero
            for p in range(start, end):
                for j in range(inner):
                    x = dec(src[o, p, j])
                    if reduce == AMAX or reduce == AMIN:
                        if _picked(x, acc[j], reduce == AMAX):
                            acc[j] = x
                    elif rule == KAHAN:
                        acc[j], comp[j] = neumaier(acc[j], comp[j], x)
                    elif rule == ROUND_EACH:
                        acc[j] = rnd(acc[j] + x)
                    else:
                        acc[j] = acc[j] + x
            count = end - start
            for j in range(inner):
                total = kahan_result(acc[j], comp[j]) if rule == KAHAN else acc[j]
                if reduce == MEAN:
                    if count == 0:
                        total = cvt(np.nan) if empty_nan else total
                    elif rule == ROUND_EACH:
                        total = total / rnd(cvt(count))
                    else:
                        total = total / cvt(count)
                out[o, s, j] = enc(total)
    return -1


#: Per data format: its name, its conversions, its data and acc dtypes, and whether they are one.
_FORMATS = {
    torch.float32: ("f32", _f32, _f32, _f32, _f32, np.float32, np.float32, True),
    torch.float64: ("f64", _f64, _f64, _f64, _f64, np.float64, np.float64, True),
    # 16-bit floats as their uint16 bits.
    torch.bfloat16: ("bf16", bf16_bits_to_f32, round_f32_to_bf16, f32_to_bf16_bits, _f32,
                     np.uint16, np.float32, False),
    torch.float16: ("f16", f16_bits_to_f32, round_f32_to_f16, f32_to_f16_bits, _f32, np.uint16,
                    np.float32, False),
}

#: (template, dtype, rule) -> the kernel, made on the first call that needs it.
_KERNELS = {}


def _kernel_for(dtype, rule, template=_index_add_at):
    """The sum's (``_index_add_at``) or the mean's (``_mean_at``) kernel of ``dtype`` under
    ``rule``."""
    kernel = _KERNELS.get((template, dtype, rule))
    if kernel is None:
        fmt, dec, rnd, enc, cvt, data_dtype, acc_dtype, acc_is_data = _FORMATS[dtype]
        kernel = instance(template, f"{fmt}_{RULE_NAMES[rule]}", rule=rule, dec=dec,
                          rnd=rnd, enc=enc, cvt=cvt, data_dtype=data_dtype, acc_dtype=acc_dtype,
                          acc_is_data=acc_is_data)
        _KERNELS[(template, dtype, rule)] = kernel
    return kernel


#: (dtype, reduction, rule) -> ``_segment_at``'s kernel, made on the first call that needs it.
_SEGMENT_KERNELS = {}

#: The reductions ``_segment_at`` computes.
SEGMENT_REDUCTIONS = (SUM, MEAN, AMAX, AMIN)
_REDUCE_NAMES = {code: name for name, code in REDUCE_CODES.items()}


def _segment_kernel_for(dtype, reduce, rule):
    """``_segment_at``'s kernel of ``dtype`` for ``reduce`` under ``rule`` (WIDE for AMAX and
    AMIN, whose pick no rule changes: one kernel for them all)."""
    if reduce in (AMAX, AMIN):
        rule = WIDE
    kernel = _SEGMENT_KERNELS.get((dtype, reduce, rule))
    if kernel is None:
        fmt, dec, rnd, enc, cvt, data_dtype, acc_dtype, _ = _FORMATS[dtype]
        kernel = instance(_segment_at, f"{fmt}_{_REDUCE_NAMES[reduce]}_{RULE_NAMES[rule]}",
                          reduce=reduce, rule=rule, dec=dec, rnd=rnd, enc=enc, cvt=cvt,
                          data_dtype=data_dtype, acc_dtype=acc_dtype)
        _SEGMENT_KERNELS[(dtype, reduce, rule)] = kernel
    return kernel


#: (dtype, maximum) -> the amax (True) or amin kernel, made on the first call that needs it.
_EXTREME_KERNELS = {}


def _extreme_kernel_for(dtype, maximum):
    kernel = _EXTREME_KERNELS.get((dtype, maximum))
    if kernel is None:
        fmt, dec, _, enc, _, data_dtype, acc_dtype, _ = _FORMATS[dtype]
        kernel = instance(_extreme_at, f"{fmt}_{'amax' if maximum else 'amin'}",
                          maximum=maximum, dec=dec, enc=enc, data_dtype=data_dtype,
                          acc_dtype=acc_dtype)
        _EXTREME_KERNELS[(dtype, maximum)] = kernel
    return kernel


def extreme_one_column(src: torch.Tensor, index: torch.Tensor, base: torch.Tensor,
                       out: torch.Tensor, maximum: bool, include_base: bool) -> int:
    """``out`` (``base``'s size; it may be ``base`` itself) holding each element of ``base``
    replaced by the largest (``maximum``) or smallest of the terms of ``src`` at ``index``
    and, under ``include_base``, of its own value (``_one_column_extreme_at``: the segment
    kernel's AMAX and AMIN, the same bits), an element without terms ``base``'s: returns -1
    having written ``out``, or, having written nothing, the first position of ``index``
    outside ``[0, base.numel())``. ``src`` and ``index`` of one size, ``src``, ``base`` and
    ``out`` contiguous, of one dtype."""
    index = _int64_elements(index)
    kernel = _ONE_COLUMN_KERNELS.get((_one_column_extreme_at, src.dtype, maximum))
    if kernel is None:
        fmt, dec, _, enc, _, data_dtype, acc_dtype, _ = _FORMATS[src.dtype]
        kernel = instance(_one_column_extreme_at, f"{fmt}_{'amax' if maximum else 'amin'}",
                          maximum=maximum, dec=dec, enc=enc, data_dtype=data_dtype,
                          acc_dtype=acc_dtype, count_dtype=_count_dtype(acc_dtype))
        _ONE_COLUMN_KERNELS[(_one_column_extreme_at, src.dtype, maximum)] = kernel
    return kernel(src.data_ptr(), index.data_ptr(), base.data_ptr(), out.data_ptr(),
                  index.shape[0], out.numel(), include_base)


def histogram(values: torch.Tensor, left: float, right: float, width: float, scale: float,
              bins: int) -> torch.Tensor:
    """The ``bins`` int64 counts of ``values`` (contiguous, a float dtype) that torch's CPU
    ``histc`` makes from these edges, in one pass (``_histogram_at``); the four numbers as
    ``_histogram_at`` takes them."""
    counts = torch.empty(bins, dtype=torch.int64)
    kernel = _ONE_COLUMN_KERNELS.get((_histogram_at, values.dtype))
    if kernel is None:
        fmt, dec, rnd, _, cvt, data_dtype, _, _ = _FORMATS[values.dtype]
        kernel = instance(_histogram_at, fmt, dec=dec, rnd=rnd, cvt=cvt, data_dtype=data_dtype)
        _ONE_COLUMN_KERNELS[(_histogram_at, values.dtype)] = kernel
    kernel(values.data_ptr(), values.numel(), left, right, width, scale, bins,
           counts.data_ptr())
    return counts


def reduce_one_column(src: torch.Tensor, index: torch.Tensor, base: torch.Tensor,
                      out: torch.Tensor, reduce: int, rule: int, include_base: bool) -> int:
    """``out`` (``base``'s size; it may be ``base`` itself) holding ``base``'s elements
    reduced (SUM, MEAN or PROD under ``rule``, one of ``RULES``) with the terms of ``src`` at
    ``index``, from their own values under ``include_base``, as the elementwise scatter of
    one column computes it, in one pass (``_one_column_reduce_at``): returns -1 having written
    ``out``, or, having written nothing, the first position of ``index`` outside ``[0,
    base.numel())``, or TOO_MANY_TERMS for more terms than a row's count holds. ``src`` and
    ``index`` of one size, ``src``, ``base`` and ``out`` contiguous, of one dtype."""
    index = _int64_elements(index)
    variant = variant_for(reduce, rule, False)
    fmt, dec, rnd, enc, cvt, data_dtype, acc_dtype, _ = _FORMATS[src.dtype]
    count_dtype = _count_dtype(acc_dtype)
    if index.shape[0] > np.iinfo(count_dtype).max:
        return TOO_MANY_TERMS
    kernel = _ONE_COLUMN_KERNELS.get((_one_column_reduce_at, src.dtype, variant))
    if kernel is None:
        op, mean, mean_round, split = variant
        kernel = instance(_one_column_reduce_at, f"{fmt}_{variant_name(*variant)}", op=op,
                          mean=mean, mean_round=mean_round, split=split, dec=dec, rnd=rnd,
                          enc=enc, cvt=cvt, data_dtype=data_dtype, acc_dtype=acc_dtype,
                          count_dtype=count_dtype)
        _ONE_COLUMN_KERNELS[(_one_column_reduce_at, src.dtype, variant)] = kernel
    return kernel(src.data_ptr(), index.data_ptr(), base.data_ptr(), out.data_ptr(),
                  index.shape[0], out.numel(), include_base)


def _count_dtype(acc_dtype):
    """The signed integer of ``acc_dtype``'s width, as which the one-column kernels read a
    row's count or flag beside its sum or pick."""
    return np.int32 if acc_dtype is np.float32 else np.int64


def _int64_elements(index: torch.Tensor) -> torch.Tensor:
    """``index`` as the kernels read it: int64 elements one after another from its address.
    (``to`` with a memory format returns a strided 1-D tensor unchanged: ``contiguous``
    copies it.) The test first: the common index needs neither, and the two calls cost a
    small launch about a microsecond."""
    if index.dtype is torch.int64 and index.is_contiguous():
        return index
    return index.to(torch.int64).contiguous()


def fits(src3: torch.Tensor, base3: torch.Tensor, out3: torch.Tensor, rule: int) -> bool:
    """Whether ``index_add_small`` may compute this launch: a small launch, a rule it has,
    contiguous rows (the kernel itself finds a row of too many terms). (Contiguous only: each
    layout is a compiled specialisation of its own, compiled on first use, and a small call
    of an unusual layout is better served by the general kernel than by a compile.)"""
    return (rule in RULES and src3.numel() + out3.numel() <= MAX_ELEMENTS
            and src3.is_contiguous() and base3.is_contiguous() and out3.is_contiguous())


def index_add_small(src3: torch.Tensor, index: torch.Tensor, base3: torch.Tensor,
                    out3: torch.Tensor, alpha: float, rule: int) -> int:
    """Write ``out3`` (``[outer, S, inner]``; it may be ``base3`` itself) and return -1, or,
    having written nothing, return TOO_MANY_TERMS where an output row has more than
    CHUNK_TERMS terms under a rule that splits (WIDE, KAHAN), or the first position of
    ``index`` outside ``[0, S)`` (found before such a row's CHUNK_TERMS + 1st term). The three
    tensors must be contiguous (:func:`fits`)."""
    index = _int64_elements(index)
    outer, n, inner = src3.shape
    kernel = _kernel_for(src3.dtype, rule)
    return kernel(src3.data_ptr(), index.data_ptr(), base3.data_ptr(), out3.data_ptr(), outer, n,
                  inner, out3.shape[1], float(alpha), out3 is base3)


def index_add_one_column(src: torch.Tensor, index: torch.Tensor, base: torch.Tensor,
                         out: torch.Tensor, rule: int, alpha: float = 1.0) -> int:
    """``out`` (``base``'s size; it may be ``base`` itself) holding ``base`` with the terms of
    ``src`` scaled by ``alpha`` added at ``index`` under ``rule`` (one of ``RULES``), rows of
    any length in one pass (``_one_column_sum_at``: ``index_add_small``'s bits): returns -1
    having written ``out``, or, having written nothing, the first position of ``index``
    outside ``[0, base.numel())``. ``src`` and ``index`` of one size, ``src``, ``base`` and
    ``out`` contiguous, of one dtype (any shape: their elements are read in order)."""
    if rule not in RULES:
        raise ValueError(f"index_add_one_column: rule {RULE_NAMES.get(rule, rule)} is not a "
                         f"rule of the serial sums {[RULE_NAMES[r] for r in RULES]}")
    index = _int64_elements(index)
    kernel = _ONE_COLUMN_KERNELS.get((_one_column_sum_at, src.dtype, rule))
    if kernel is None:
        fmt, dec, rnd, enc, cvt, data_dtype, acc_dtype, acc_is_data = _FORMATS[src.dtype]
        kernel = instance(_one_column_sum_at, f"{fmt}_{RULE_NAMES[rule]}", rule=rule, dec=dec,
                          rnd=rnd, enc=enc, cvt=cvt, data_dtype=data_dtype, acc_dtype=acc_dtype,
                          count_dtype=_count_dtype(acc_dtype))
        _ONE_COLUMN_KERNELS[(_one_column_sum_at, src.dtype, rule)] = kernel
    return kernel(src.data_ptr(), index.data_ptr(), base.data_ptr(), out.data_ptr(),
                  index.shape[0], out.numel(), float(alpha))


#: (template, dtype, rule) -> ``_one_column_sum_at``'s kernel, (template, dtype, maximum) ->
#: ``_one_column_extreme_at``'s, (template, dtype, variant) -> ``_one_column_reduce_at``'s,
#: (template, dtype) -> ``_histogram_at``'s, each made on the first call that needs it.
_ONE_COLUMN_KERNELS = {}


def index_add_small_in_place(src: torch.Tensor, index: torch.Tensor, target: torch.Tensor,
                             outer: int, inner: int, alpha: float, rule: int) -> int:
    """``index_add_small`` into ``target`` itself, for ``src`` and ``target`` read as
    ``[outer, len(index), inner]`` and ``[outer, S, inner]`` without views of that shape (a
    view costs about as much as the kernel's own call on a small launch): the same answer.
    Both must be contiguous, nonempty, and within :func:`fits`'s size limit; ``rule`` one
    that ``fits`` takes."""
    index = _int64_elements(index)
    n = index.shape[0]
    kernel = _kernel_for(src.dtype, rule)
    return kernel(src.data_ptr(), index.data_ptr(), target.data_ptr(), target.data_ptr(), outer,
                  n, inner, target.numel() // (outer * inner), float(alpha), True)


def extreme_small_in_place(src: torch.Tensor, index: torch.Tensor, target: torch.Tensor,
                           outer: int, inner: int, maximum: bool, include_base: bool) -> int:
    """Into ``target`` itself, each of its rows along the middle of ``[outer, S, inner]`` the
    largest (``maximum``) or smallest of its terms, the rows of ``src`` (``[outer, len(index),
    inner]``) at ``index``, and of itself first under ``include_base`` (``_extreme_at``: the
    segment kernel's AMAX and AMIN in the canonical order, the same bits). Returns -1 having
    written ``target``, or, having written nothing, the first position of ``index`` outside
    ``[0, S)``. Both tensors contiguous, nonempty, within :func:`fits`'s size limit; no views
    of them made (as ``index_add_small_in_place``)."""
    return _into_target(_extreme_kernel_for(src.dtype, maximum), src, index, target, outer,
                        inner, include_base)


def mean_small_in_place(src: torch.Tensor, index: torch.Tensor, target: torch.Tensor,
                        outer: int, inner: int, include_base: bool, rule: int) -> int:
    """Into ``target`` itself, each of its rows along the middle of ``[outer, S, inner]`` the
    mean of its terms, the rows of ``src`` (``[outer, len(index), inner]``) at ``index``, and
    of itself first under ``include_base`` (``_mean_at``: the segment kernel's MEAN under
    ``rule``, one of ``RULES``, the same bits). Returns -1 having written ``target``, or,
    having written nothing, TOO_MANY_TERMS or the first position of ``index`` outside
    ``[0, S)``. Both tensors contiguous, nonempty, within :func:`fits`'s size limit; no views
    of them made (as ``index_add_small_in_place``)."""
    return _into_target(_kernel_for(src.dtype, rule, _mean_at), src, index, target, outer,
                        inner, include_base)


def _into_target(kernel, src, index, target, outer, inner, include_base) -> int:
    """``kernel`` (an ``_extreme_at`` or ``_mean_at`` instance) called on the tensors'
    addresses and sizes."""
    index = _int64_elements(index)
    return kernel(src.data_ptr(), index.data_ptr(), target.data_ptr(), outer, index.shape[0],
                  inner, target.numel() // (outer * inner), include_base)


def segment_reduce_small(src3: torch.Tensor, bounds: torch.Tensor, out3: torch.Tensor,
                         reduce: int, rule: int, lengths: bool = False,
                         empty_nan: bool = False) -> int:
    """Write ``out3`` (``[outer, S, inner]``) with ``src3``'s segments of rows (``[outer, N,
    inner]``) between consecutive offsets reduced, and return -1, or, having written
    nothing, return BAD_OFFSETS where the bounds do not tile the N rows, or TOO_MANY_TERMS
    where a sum's or a mean's segment has more than CHUNK_TERMS rows under a rule that splits
    (``_segment_at``: the segment kernel's SUM, MEAN, AMAX or AMIN without an order or a
    base, the same bits, but a mean under ROUND_EACH, which is torch's ``segment_reduce``
    mean). ``bounds`` (any integer dtype and strides): the ``S + 1`` offsets,
    from 0 to N without decreasing, or with ``lengths`` the ``S`` lengths of the segments,
    none negative, summing to N. ``empty_nan``: an empty segment's mean is NaN, not 0. Both
    tensors contiguous, nonempty, within :func:`fits`'s size limit; ``rule`` one of
    ``RULES`` (any for AMAX and AMIN, whose pick no rule changes)."""
    bounds = _int64_elements(bounds)
    outer, n, inner = src3.shape
    kernel = _segment_kernel_for(src3.dtype, reduce, rule)
    return kernel(src3.data_ptr(), bounds.data_ptr(), out3.data_ptr(), outer, n, inner,
                  out3.shape[1], lengths, empty_nan)
