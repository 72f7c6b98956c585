"""Triton kernels for detsum's segmented reductions: the GPU backend.

CONTRACT: the one of ``detsum.kernels.numba.segment`` (read it there), with two more rules,
``CUDA_SMALL_STRIDE`` and ``CUDA_STRIDE_1`` (torch's CUDA ``index_put_`` arithmetic; SUM only,
``CUDA_STRIDE_1`` only with inner size 1), and ``EXACT`` as ``detsum.kernels.numba.exact``
defines it (the exact sum or mean rounded once; SUM and MEAN only, no carry). ``order`` and
``offsets`` are int64 tensors on the data's device, and nothing here reads them on the host: a
launch never synchronises. Offsets need not start at 0 nor end at ``M`` here: nondecreasing
values in ``[0, M]`` with ``order`` values in ``[0, N)`` keep every read and write inside the
tensors (the positions outside every segment are never read), which is how detsum launches
values it did not check (``check="off"`` on a GPU); ``kernels.UncheckedOffsets`` are made
safe by the launch itself (see Bounds).

IMPLEMENTATION NOTES (this backend):

- Arithmetic: per output element exactly the steps the Numba contract lists, in the same
  order, including the chunks of ``CHUNK_TERMS`` terms under WIDE and KAHAN. AMAX / AMIN are
  chunked here too (it spreads a hot segment over programs and gives the same bits as the
  serial order: each chunk keeps its earliest NaN or earliest of equal values, and so does the
  fold). No multiply is fused with an add: the launch passes ``enable_fp_fusion=False`` (the
  Triton default fuses ``x * alpha + acc`` into one FMA), and MEAN divides with ``div_rn`` in
  fp32 (Triton's ``/`` on fp32 is an approximate division on NVIDIA GPUs). The term loop
  is software-pipelined (``_combine_rows``): the loads of later rows move earlier, not the
  arithmetic.

- Work split: program ``(slot, column block, outer)``. Slots ``0 .. S-1`` each own a whole
  segment (of at most CHUNK_TERMS terms, or any length under the rules that never split) and
  write its output row. Under WIDE and KAHAN, when some segment can be longer (more than
  CHUNK_TERMS positions in all), the slots after them are chunk programs, one per CHUNK_TERMS
  positions, which write each chunk's acc (and Kahan compensation) to a workspace slot; the
  last of a segment's to finish folds its chunks in order and writes its row, in the same
  launch (``chunks.py`` says how, and how the tickets order the memory). Which program folds
  changes from run to run; what it folds, and in which order, never does: each output element
  is written once, from the same values in the same order, so the result is the same on every
  run, for every grid, block width and number of SMs. Only the column block width and the
  warp count are tuned, and neither takes part in any element's arithmetic.

- Narrow rows (a program's row under 512 bytes, ``_NARROW_ROW_BYTES``): with no carry and
  offsets for bounds, a program takes SEGS consecutive segments as one tile of SEGS rows by
  BLOCK columns, about ``TILE_BYTES`` (2 KiB: four warps, 16-byte loads) in place of one
  segment on one warp (``_reduce_segments``). Each segment's terms are combined in its own
  row of the tile, in position order, by the same steps: the same bits. The term loop runs
  to the tile's longest segment, the others' rows masked past their own: a tile of very
  unequal segments waits on its longest. A segment longer than CHUNK_TERMS stays the chunk
  programs' (under SPLIT they come after the tiles' programs).

- Tickets (``chunks.py``): offsets that a launch checks and finds bad can leave a counter off
  0, so the paths that report that and go on (a host read of the verdict, an assert on CPU
  tensors) set the counters back; on a GPU a failed ``torch._assert_async`` ends the CUDA
  context.

- Bounds (BOUNDS): offsets, or a promised-sorted index itself (``kernels.SortedKeys`` with
  ``every_key``), in which each program finds its segment's start and end by
  torch.searchsorted's binary search (``_segment_start``). A sort's values (a launch without a
  plan) become offsets first, by one small launch (``chunks.sort_offsets``): searched in every
  program, they cost the kernel registers (see the launcher). The chunk programs still take
  the values (GUIDED): the key at a position names its segment, where a search of the
  offsets takes a dependent load for each halving; with a plan, its index does (``keys``:
  the key of the position's row). Offsets not known to be valid
  (``kernels.UncheckedOffsets``) are clamped into ``[0, M]`` as each is read, and a segment
  whose end is below its start is empty: every read and write stays inside the tensors
  whatever they hold. Unchecked ("off"), they are first made nondecreasing (their running
  maximum: one op), for consistent bounds. An unsorted index of at most CHUNK_TERMS values
  (``kernels.UnsortedKeys``, no order) is not sorted at all: each program loads every key as
  one vector, counts its segment's terms and finds the first, and its term loop takes the
  positions whose key is its segment, in position order (the order a stable sort gives, so the
  sorted launch's bits); with so few positions nothing is chunked.

- Checks (CHECK), of bounds that the caller has not checked: under CHECK_ENDS the first
  program writes whether a sort's offsets run from 0 to M (its keys then all lie in range), or
  whether every unsorted key lies in range (under CHECK_BEFORE_WRITING, at "host", every
  program checks them too and none writes if one does not); under CHECK_EVERY (offsets: from 0
  to M without decreasing; a promised-sorted index: nondecreasing, in range) the first
  ``checkers`` programs each check blocks of ``_CHECK_BLOCK`` bounds and take a ticket that
  carries what they found, and the last to take one writes the verdict
  (``_check_every_bound``). The verdict is a flag at the end of the launch's workspace, which
  no op initialises: one program writes it, in every checked launch. The launcher asserts it
  on the device (check="device": one op, no read) or reads it back once (check="host"); only
  then, on the failure's path, are the values looked at again, to raise the caller's error
  naming the first bad position.

- Carry (a running Kahan sum, see the contract): the program of a segment's first chunk starts
  ``c`` from ``carry``; the program that writes the segment's row (its whole-segment slot, or
  the fold) writes ``s`` to ``out`` and ``c`` back to ``carry`` instead of the final ``s + c``.

- bf16, 64-bit addressing and the launch: as ``common.py`` says, for every kernel here.

- The rules with kernels of their own, whose launches ``segment_reduce`` hands on:
  ``EXACT`` (``exact.py``) and ``CUDA_STRIDE_1`` (``stride1.py``).
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import (
    AMAX,
    AMIN,
    CHUNK_TERMS,
    CUDA_SMALL_STRIDE,
    CUDA_STRIDE_1,
    EXACT,
    KAHAN,
    SPLIT_RULES,
    SUM,
    SortedKeys,
    UncheckedOffsets,
    UnsortedKeys,
    has_work,
)
from .common import (
    _ACC_TYPES,
    _DATA_CODES,
    _MAX_GRID_YZ,
    _PROD,
    _ROW_BYTES,
    _SMALL_STRIDE,
    _as_stored,
    _cdiv,
    _combine,
    _finish,
    _fold,
    _next_power_of_2,
    _to_acc,
    _to_data,
)
from . import chunks as _chunks
from . import launch
from .chunks import (
    _ANY_OFFSETS,
    _KEY_A_POSITION,
    _KEY_A_ROW,
    _KEYS,
    _OFFSETS,
    _PADDED_OFFSETS,
    _UNGUIDED,
    _UNSORTED_KEYS,
    _chunk_owned,
    _chunk_slot,
    _last_chunk_done,
    _segment_start,
    sort_offsets,
    ticket_counters,
)
from .exact import segment_reduce_exact
from .launch import Kernel
from .stride1 import segment_reduce_stride1

__all__ = ["interpreted", "segment_reduce", "ticket_counters"]

# What a launch checks of its bounds (CHECK), writing its flag: nothing, the keys' range (one
# program: scanned keys, a sort's offsets), every bound (spread over programs,
# _check_every_bound); CHECK_BEFORE_WRITING, scanned keys at "host": their range, and where
# a key is out of it no program writes anything (the caller's error then raises with an
# in-place call's tensor untouched; at "device" the launch writes what "off" writes).
_CHECK_NOTHING = tl.constexpr(0)
_CHECK_ENDS = tl.constexpr(1)
_CHECK_EVERY = tl.constexpr(2)
_CHECK_BEFORE_WRITING = tl.constexpr(3)
# Bounds that one checker program reads at a time.
_CHECK_BLOCK = tl.constexpr(1024)
# Stages of the term loop's software pipeline (_combine_rows): the rows of the next
# _TERM_STAGES - 1 positions are in flight while one is combined. Order-neutral.
_TERM_STAGES = tl.constexpr(5)


# ---- a program's terms ------------------------------------------------------------------------

@triton.jit
def _combine_rows(acc, comp, row_base, ss1, ss2, cols, mask, order_ptr, p_begin, p_end, alpha,
                  seg, REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr,
                  ACC: tl.constexpr, HAS_ORDER: tl.constexpr, SCALED: tl.constexpr,
                  SCAN: tl.constexpr):
    """Combine the term rows at positions p_begin .. p_end - 1, in order; under SCAN
    (``order_ptr`` holding the unsorted keys, and no order) only those whose key is ``seg``.

    The loop is software-pipelined (``_TERM_STAGES``; on the GPU, asynchronous copies to
    shared memory): the rows of the next positions, and their entries of ``order``, are on
    their way while the current one is combined, so that a program has several row loads in
    flight, where one at a time, each behind its load of ``order``, leaves it waiting on the
    memory's latency once per term. Only the loads move: the rows are combined one after
    another in position order."""
    for p in tl.range(p_begin, p_end, num_stages=_TERM_STAGES):
        if SCAN:
            if tl.load(order_ptr + p) == seg:
                x = _to_acc(tl.load(row_base + p * ss1 + cols * ss2, mask=mask, other=0),
                            DATA, ACC)
                acc, comp = _combine(acc, comp, x, alpha, REDUCE, RULE, DATA, SCALED)
        else:
            if HAS_ORDER:
                row = tl.load(order_ptr + p)
            else:
                row = p
            x = _to_acc(tl.load(row_base + row * ss1 + cols * ss2, mask=mask, other=0), DATA,
                        ACC)
            acc, comp = _combine(acc, comp, x, alpha, REDUCE, RULE, DATA, SCALED)
    return acc, comp


@triton.jit
def _start(init, REDUCE: tl.constexpr, RULE: tl.constexpr, USE_BASE: tl.constexpr):
    """The accumulator before the first term, where it does not start from that term: 0
    under SMALL_STRIDE (torch sums the terms from 0 and adds ``init`` last), else ``init``
    (USE_BASE), 1 for a product, 0. Any shape: ``init``'s."""
    acc = tl.zeros_like(init)
    if RULE != _SMALL_STRIDE:
        if USE_BASE:
            acc = init
        elif REDUCE == _PROD:
            acc = acc + 1.0
    return acc


@triton.jit
def _reduce_part(
    src_ptr, ss0, ss1, ss2, order_ptr, base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2,
    carry_ptr, cs0, cs1, cs2, work_ptr, work_rows, alpha, outer, inner,
    seg, j, p_begin, p_end, n, slot, is_chunk,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr,
    HAS_CARRY: tl.constexpr, SCALED: tl.constexpr,
    FIRST_TERM_START: tl.constexpr, NCOMP: tl.constexpr, BLOCK: tl.constexpr,
    SCAN: tl.constexpr,
):
    """Reduce positions ``p_begin .. p_end - 1``: chunk ``j`` of segment ``seg`` (``n``
    terms) into workspace slot ``slot`` (``is_chunk``: a runtime value, or the constant False
    where the launch has no chunks), or the whole segment into its row. Under
    SCAN (unsorted keys at ``order_ptr``, no order), the terms are the positions from
    ``p_begin`` (the first term's) whose key is ``seg``."""
    # A later chunk starts from its first term; so does an amax / amin without a base row.
    from_first = (j > 0) | FIRST_TERM_START
    count = n
    if USE_BASE:
        count = n + 1
    n_blocks = tl.cdiv(inner, BLOCK)
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        for cb in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
            cols = cb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = cols < inner
            out_at = out_ptr + o * os0 + seg * os1 + cols * os2
            if n == 0:
                # torch never visits a row without terms: the base row unchanged (bit copy).
                if HAS_BASE:
                    kept = tl.load(base_ptr + o * bs0 + seg * bs1 + cols * bs2, mask=mask)
                    tl.store(out_at, kept, mask=mask)
                else:
                    zero = tl.zeros([BLOCK], ACC)
                    tl.store(out_at, _to_data(zero, DATA, out_ptr.dtype.element_ty), mask=mask)
            else:
                row_base = src_ptr + o * ss0
                init = tl.zeros([BLOCK], ACC)
                if USE_BASE:
                    init = _to_acc(tl.load(base_ptr + o * bs0 + seg * bs1 + cols * bs2,
                                           mask=mask, other=0), DATA, ACC)
                comp = tl.zeros([BLOCK], ACC)
                carry_at = carry_ptr + o * cs0 + seg * cs1 + cols * cs2
                if HAS_CARRY:
                    if j == 0:
                        # A running compensated sum resumes from (base row, carry).
                        comp = tl.load(carry_at, mask=mask, other=0)
                p = p_begin
                if from_first:
                    first_row = p_begin
                    if HAS_ORDER:
                        first_row = tl.load(order_ptr + p_begin)
                    acc = _to_acc(tl.load(row_base + first_row * ss1 + cols * ss2, mask=mask,
                                          other=0), DATA, ACC)
                    if SCALED:
                        # A later chunk's first term is a term like any other: RN(x * alpha).
                        acc = acc * alpha
                    p = p_begin + 1
                else:
                    acc = _start(init, REDUCE, RULE, USE_BASE)
                acc, comp = _combine_rows(acc, comp, row_base, ss1, ss2, cols, mask, order_ptr,
                                          p, p_end, alpha, seg, REDUCE, RULE, DATA, ACC,
                                          HAS_ORDER, SCALED, SCAN)
                if is_chunk:
                    work_at = work_ptr + ((o * work_rows + slot) * NCOMP) * inner + cols
                    tl.store(work_at, acc, mask=mask)
                    if NCOMP == 2:
                        tl.store(work_at + inner, comp, mask=mask)
                elif HAS_CARRY:
                    tl.store(out_at, acc, mask=mask)  # s, exact: the data is the acc type
                    tl.store(carry_at, comp, mask=mask)
                else:
                    value = _finish(acc, comp, init, count, REDUCE, RULE, DATA, ACC)
                    tl.store(out_at, _to_data(value, DATA, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_segments(
    src_ptr, ss0, ss1, ss2, order_ptr, bounds_ptr, positions, base_ptr, bs0, bs1, bs2,
    out_ptr, os0, os1, os2, alpha, outer, nseg, inner, first_seg,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr,
    SCALED: tl.constexpr, FIRST_TERM_START: tl.constexpr, BOUNDS: tl.constexpr,
    SPLIT: tl.constexpr, CHUNK: tl.constexpr, SEGS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Segments ``first_seg .. first_seg + SEGS - 1`` (those below ``nseg``; under SPLIT those
    of at most CHUNK terms, the longer ones being the chunk programs'), whole, as one tile of
    SEGS rows by BLOCK columns (narrow rows: see the launcher). Row ``i`` of the tile is
    segment ``first_seg + i``: its terms are combined in position order, from the same
    start, by the same steps as ``_reduce_part``'s, so each output element gets the same
    bits; the term loop runs to the longest segment's count, a shorter segment's row left as
    it is past its own (masked loads, and ``where``). Bounds: offsets (OFFSETS, ANY_OFFSETS,
    PADDED_OFFSETS); no carry, no scan."""
    at = tl.arange(0, SEGS).to(tl.int64)
    segs = first_seg + at
    in_range = segs < nseg
    if BOUNDS == _PADDED_OFFSETS:
        p0 = _segment_start(bounds_ptr, segs, nseg, positions, BOUNDS)
        p_end = tl.maximum(_segment_start(bounds_ptr, segs + 1, nseg, positions, BOUNDS), p0)
    else:
        p0 = tl.load(bounds_ptr + segs, mask=in_range, other=0).to(tl.int64)
        p_end = tl.load(bounds_ptr + segs + 1, mask=in_range, other=0).to(tl.int64)
    if BOUNDS == _ANY_OFFSETS:
        p0 = tl.minimum(tl.maximum(p0, 0), positions)
        p_end = tl.maximum(tl.minimum(tl.maximum(p_end, 0), positions), p0)  # decreasing: empty
    real = in_range
    if SPLIT:
        real = in_range & (p_end - p0 <= CHUNK)
    n = tl.where(real, p_end - p0, 0)
    count = n
    if USE_BASE:
        count = n + 1
    longest = tl.max(n, 0)
    has_terms = n > 0
    n_blocks = tl.cdiv(inner, BLOCK)
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        row_base = src_ptr + o * ss0
        for cb in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
            cols = cb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            live = real[:, None] & (cols < inner)[None, :]
            kept = _to_data(tl.zeros([SEGS, BLOCK], ACC), DATA, out_ptr.dtype.element_ty)
            if HAS_BASE:
                kept = tl.load(base_ptr + o * bs0 + segs[:, None] * bs1 + cols[None, :] * bs2,
                               mask=live, other=0)
            init = tl.zeros([SEGS, BLOCK], ACC)
            if USE_BASE:
                init = _to_acc(kept, DATA, ACC)
            comp = tl.zeros([SEGS, BLOCK], ACC)
            k_begin = 0
            if FIRST_TERM_START:
                first_row = p0
                if HAS_ORDER:
                    first_row = tl.load(order_ptr + p0, mask=has_terms, other=0)
                acc = _to_acc(tl.load(row_base + first_row[:, None] * ss1 + cols[None, :] * ss2,
                                      mask=live & has_terms[:, None], other=0), DATA, ACC)
                if SCALED:
                    acc = acc * alpha
                k_begin = 1
            else:
                acc = _start(init, REDUCE, RULE, USE_BASE)
            for k in tl.range(k_begin, longest, num_stages=_TERM_STAGES):
                active = k < n
                p = p0 + k
                row = p
                if HAS_ORDER:
                    row = tl.load(order_ptr + p, mask=active, other=0)
                x = _to_acc(tl.load(row_base + row[:, None] * ss1 + cols[None, :] * ss2,
                                    mask=live & active[:, None], other=0), DATA, ACC)
                combined, combined_comp = _combine(acc, comp, x, alpha, REDUCE, RULE, DATA,
                                                   SCALED)
                acc = tl.where(active[:, None], combined, acc)
                comp = tl.where(active[:, None], combined_comp, comp)
            value = _to_data(_finish(acc, comp, init, count[:, None], REDUCE, RULE, DATA, ACC),
                             DATA, out_ptr.dtype.element_ty)
            # torch never visits a row without terms: the base row unchanged (bit copy).
            tl.store(out_ptr + o * os0 + segs[:, None] * os1 + cols[None, :] * os2,
                     tl.where(has_terms[:, None], value, kept), mask=live)


# ---- checks of the bounds, in the launch -------------------------------------------------------

@triton.jit
def _padded_bound(bounds_ptr, i, nseg, positions, here):
    """Bound ``i`` of the sequence 0, the values at ``bounds_ptr``, ``positions`` (i in
    ``[0, nseg]``) as it is, not clamped: what the check of PADDED_OFFSETS reads."""
    inner = here & (i > 0) & (i < nseg)
    value = tl.load(bounds_ptr + tl.where(inner, i - 1, 0), mask=inner, other=0).to(tl.int64)
    return tl.where(i >= nseg, positions, value)


@triton.jit
def _check_every_bound(bounds_ptr, nseg, positions, checkers, counters_ptr, flag_ptr,
                       BOUNDS: tl.constexpr):
    """Checker ``c = program_id(0) < checkers`` of a launch under CHECK_EVERY: checks the
    bounds ``c * _CHECK_BLOCK ..``, then every ``checkers * _CHECK_BLOCK`` on, and takes a
    ticket; the last checker to take one writes the launch's flag (1: every bound checked
    good, 0: not).

    Offsets: the first is 0, the last ``positions``, none less than the one before (under
    PADDED_OFFSETS those of the padded sequence: the values none less than the one before, the
    first ``>= 0`` and the last ``<= positions``). Keys (a promised-sorted index): none less
    than the one before, the first ``>= 0`` and the last ``< nseg`` (so all of them in
    range).

    The ticket carries what its checker found (a count of checkers in the low 32 bits, of
    those that found a bad bound above them), so the last one knows everything from the
    value its atomic returns: no other memory is shared, and a relaxed atomic suffices. It
    then sets the ticket back to 0 for the next launch, which starts after this one ends."""
    c = tl.program_id(0).to(tl.int64)
    count = nseg + 1
    if BOUNDS == _KEYS:
        count = positions
    bad = tl.zeros([], tl.int64)
    for begin in range(c * _CHECK_BLOCK, count, checkers * _CHECK_BLOCK):
        i = begin + tl.arange(0, _CHECK_BLOCK).to(tl.int64)
        here = i < count
        has_next = i + 1 < count
        if BOUNDS == _PADDED_OFFSETS:
            value = _padded_bound(bounds_ptr, i, nseg, positions, here)
            after = _padded_bound(bounds_ptr, i + 1, nseg, positions, has_next)
        else:
            value = tl.load(bounds_ptr + i, mask=here, other=0).to(tl.int64)
            after = tl.load(bounds_ptr + i + 1, mask=has_next, other=0).to(tl.int64)
        if BOUNDS == _KEYS:
            ends_bad = ((i == 0) & (value < 0)) | ((i == count - 1) & (value >= nseg))
        else:
            ends_bad = ((i == 0) & (value != 0)) | ((i == count - 1) & (value != positions))
        wrong = (here & ends_bad) | (has_next & (after < value))
        bad = bad | tl.max(wrong.to(tl.int64), axis=0)
    taken = tl.atomic_add(counters_ptr, 1 + (bad << 32), sem="relaxed")
    if (taken & 0xFFFFFFFF) == checkers - 1:
        failures = (taken >> 32) + bad
        tl.store(flag_ptr, (failures == 0).to(flag_ptr.dtype.element_ty))
        tl.store(counters_ptr, 0)


# ---- kernels -----------------------------------------------------------------------------------

@triton.jit
def _fold_chunks(
    out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2, work_ptr, work_rows, outer, inner,
    seg, p0, n,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    USE_BASE: tl.constexpr, HAS_CARRY: tl.constexpr, NCOMP: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Fold the chunks of the long segment ``seg`` (``n`` terms from position ``p0``) from
    their workspace slots, in order (the contract's chunk fold), and write its row: for this
    program's column blocks and outer indices, those its chunk programs reduced."""
    n_chunks = (n + CHUNK - 1) // CHUNK
    count = n
    if USE_BASE:
        count = n + 1
    first = _chunk_slot(p0, 0, CHUNK)
    n_blocks = tl.cdiv(inner, BLOCK)
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        for cb in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
            cols = cb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = cols < inner
            work_o = work_ptr + (o * work_rows * NCOMP) * inner + cols
            # Parts that other programs wrote: read from L2 (.cg), never from an L1 line of
            # this SM's that could predate them.
            work_at = work_o + first * NCOMP * inner
            acc = tl.load(work_at, mask=mask, other=0, cache_modifier=".cg")
            comp = tl.zeros([BLOCK], ACC)
            if NCOMP == 2:
                comp = tl.load(work_at + inner, mask=mask, other=0, cache_modifier=".cg")
            for k in range(1, n_chunks):
                part_at = work_o + _chunk_slot(p0, k, CHUNK) * NCOMP * inner
                part = tl.load(part_at, mask=mask, other=0, cache_modifier=".cg")
                part_comp = tl.zeros([BLOCK], ACC)
                if NCOMP == 2:
                    part_comp = tl.load(part_at + inner, mask=mask, other=0,
                                        cache_modifier=".cg")
                acc, comp = _fold(acc, comp, part, part_comp, REDUCE, RULE)
            out_at = out_ptr + o * os0 + seg * os1 + cols * os2
            if HAS_CARRY:
                tl.store(out_at, acc, mask=mask)
                tl.store(carry_ptr + o * cs0 + seg * cs1 + cols * cs2, comp, mask=mask)
            else:
                value = _finish(acc, comp, acc, count, REDUCE, RULE, DATA, ACC)
                tl.store(out_at, _to_data(value, DATA, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scanned_keys(keys_ptr, positions, absent, CHUNK: tl.constexpr):
    """The ``positions <= CHUNK`` unsorted keys as one vector of CHUNK, ``absent`` past
    them."""
    at = tl.arange(0, CHUNK)
    return tl.load(keys_ptr + at, mask=at < positions, other=absent).to(tl.int64)


@triton.jit
def _segment_kernel(
    src_ptr, ss0, ss1, ss2, order_ptr, bounds_ptr, keys_ptr, positions, n_parts,
    base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2,
    work_ptr, alpha_ptr, flag_ptr, counters_ptr, checkers, outer, nseg, inner,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr,
    HAS_CARRY: tl.constexpr, SCALED: tl.constexpr, SPLIT: tl.constexpr,
    CHUNKS_FIRST: tl.constexpr, FIRST_TERM_START: tl.constexpr, NCOMP: tl.constexpr,
    CHUNK: tl.constexpr, BOUNDS: tl.constexpr, GUIDED: tl.constexpr, CHECK: tl.constexpr,
    BLOCK: tl.constexpr, SEGS: tl.constexpr,
):
    """Whole segments (one a program; with SEGS > 1, ``SEGS`` consecutive ones as a tile,
    ``_reduce_segments``, in ``cdiv(nseg, SEGS)`` programs) and, under SPLIT, the chunks of
    the long segments in ``2 * n_parts`` programs, after the whole segments' or, under
    CHUNKS_FIRST, before them: side ``e % 2`` of chunk program ``e // 2`` of ``n_parts``
    (``_chunk_owned``), the last of a segment's to finish folding them (a ticket in
    ``counters_ptr[1 + ...]``). The segments' bounds are at ``bounds_ptr``, as BOUNDS says
    (``_segment_start``); under GUIDED, offsets made from the keys at ``keys_ptr`` (as GUIDED
    says, ``chunks.py``), which name the segment of a chunk program's position
    (``chunks._segment_at``). CHECK_ENDS: the first program writes to ``flag_ptr`` whether
    the keys lie in ``[0, nseg)`` (the scanned keys all; a sort's offsets, whether they run
    from 0 to ``positions``), and under CHECK_BEFORE_WRITING, where one does not, no program
    writes anything; CHECK_EVERY: the first ``checkers`` programs check every bound
    (``_check_every_bound``)."""
    slot = tl.program_id(0).to(tl.int64)
    first_of_slot = (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    if (CHECK == _CHECK_ENDS) | (CHECK == _CHECK_BEFORE_WRITING):
        if (slot == 0) & first_of_slot:
            if BOUNDS == _UNSORTED_KEYS:
                keys = _scanned_keys(bounds_ptr, positions, 0, CHUNK)
                in_range = (tl.min(keys, 0) >= 0) & (tl.max(keys, 0) < nseg)
            else:
                # A sort's offsets (OFFSETS): no key below 0 and none at or past nseg exactly
                # when they run from 0 to every position.
                in_range = ((tl.load(bounds_ptr) == 0)
                            & (tl.load(bounds_ptr + nseg) == positions))
            tl.store(flag_ptr, in_range.to(flag_ptr.dtype.element_ty))
    elif CHECK == _CHECK_EVERY:
        if (slot < checkers) & first_of_slot:
            _check_every_bound(bounds_ptr, nseg, positions, checkers, counters_ptr, flag_ptr,
                               BOUNDS)
    alpha = 1.0
    if SCALED:
        alpha = tl.load(alpha_ptr)
    # ``slot`` counts the whole segments' programs (one a segment, or under SEGS > 1 one a
    # tile of SEGS: narrow rows) first, then, under SPLIT, the chunk programs; ``whole_slot``
    # is a whole program's segment (or tile). Under CHUNKS_FIRST (chunks.py) the grid takes
    # that order backwards, so that the chunk programs are its first, and ``whole_slot``
    # counts the whole segments forwards again after them. (The chunk programs below slot
    # 2 * n_parts and the whole segments shifted, the same work compiles with the branch
    # the other way round, and ptxas gave the MoE backward's launch without a plan 48
    # registers a thread, not 40: tests/ptx_check.py.)
    whole_programs = nseg
    if SEGS > 1:
        whole_programs = (nseg + SEGS - 1) // SEGS
    whole_slot = slot
    if SPLIT:
        if CHUNKS_FIRST:
            slot = tl.num_programs(0).to(tl.int64) - 1 - slot
            whole_slot = whole_programs - 1 - slot
    tiled = False
    if SEGS > 1:
        tiled = True
        if SPLIT:
            tiled = slot < whole_programs
    if tiled:
        _reduce_segments(src_ptr, ss0, ss1, ss2, order_ptr, bounds_ptr, positions, base_ptr,
                         bs0, bs1, bs2, out_ptr, os0, os1, os2, alpha, outer, nseg, inner,
                         whole_slot * SEGS, REDUCE, RULE, DATA, ACC, HAS_ORDER, HAS_BASE,
                         USE_BASE, SCALED, FIRST_TERM_START, BOUNDS, SPLIT, CHUNK, SEGS, BLOCK)
    else:
        # One term loop for whole segments and chunks: a second copy of the loop would hold
        # registers of its own. Without SPLIT, is_chunk is the constant False and the chunks'
        # code is not compiled. Chunk program e's two sides (_chunk_owned) are two programs,
        # slots whole_programs + 2 e + side, whose workspace slots are 2 e + side.
        is_chunk = False
        if SPLIT:
            is_chunk = slot >= whole_programs
        work_slot = slot - whole_programs
        work_rows = 2 * n_parts
        if is_chunk:
            seg, j, owned, p0, n = _chunk_owned(bounds_ptr, nseg, positions, work_slot // 2,
                                                work_slot % 2, CHUNK, BOUNDS, keys_ptr,
                                                order_ptr, GUIDED)
            p_begin = p0 + j * CHUNK
            p_end = tl.minimum(p0 + n, p_begin + CHUNK)
        else:
            if BOUNDS == _UNSORTED_KEYS:
                # Every key at once (at most CHUNK): how many are this segment's, and the first
                # one's position, from which the term loop takes those whose key is the segment.
                at = tl.arange(0, CHUNK)
                keys = _scanned_keys(bounds_ptr, positions, -1, CHUNK)
                hits = keys == whole_slot
                n = tl.sum(hits.to(tl.int64), 0)
                p0 = tl.min(tl.where(hits, at, CHUNK), 0).to(tl.int64)
                p_end = tl.zeros([], tl.int64) + positions
            else:
                p0 = _segment_start(bounds_ptr, whole_slot, nseg, positions, BOUNDS)
                p_end = _segment_start(bounds_ptr, whole_slot + 1, nseg, positions, BOUNDS)
                if (BOUNDS == _ANY_OFFSETS) | (BOUNDS == _PADDED_OFFSETS):
                    p_end = tl.maximum(p_end, p0)  # offsets that decrease: an empty segment
                n = p_end - p0
            seg = whole_slot
            j = tl.zeros([], tl.int64)
            p_begin = p0
            owned = n >= 0  # always, unless the chunk programs own this segment
            if SPLIT:
                owned = n <= CHUNK
            if (BOUNDS == _UNSORTED_KEYS) & (CHECK == _CHECK_BEFORE_WRITING):
                # Keys checked at "host": where one is out of range no program writes anything,
                # so the caller's tensor of an in-place call is as it was when the error raises
                # (after the launch, from one read of the flag).
                in_range = ((tl.min(tl.where(at < positions, keys, 0), 0) >= 0)
                            & (tl.max(keys, 0) < nseg))
                owned = owned & in_range
        if owned:
            _reduce_part(src_ptr, ss0, ss1, ss2, order_ptr, base_ptr, bs0, bs1, bs2, out_ptr, os0,
                         os1, os2, carry_ptr, cs0, cs1, cs2, work_ptr, work_rows, alpha, outer,
                         inner, seg, j, p_begin, p_end, n, work_slot, is_chunk, REDUCE, RULE,
                         DATA, ACC, HAS_ORDER, HAS_BASE, USE_BASE, HAS_CARRY, SCALED,
                         FIRST_TERM_START, NCOMP, BLOCK, BOUNDS == _UNSORTED_KEYS)
            if SPLIT:  # within `if owned`, Triton 3.9 compiled `if is_chunk` even when False
                if is_chunk:
                    # Which program folds varies from run to run; the order of the fold never
                    # does.
                    if _last_chunk_done(counters_ptr, p0, n, CHUNK):
                        _fold_chunks(out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2, work_ptr,
                                     work_rows, outer, inner, seg, p0, n, REDUCE, RULE, DATA, ACC,
                                     USE_BASE, HAS_CARRY, NCOMP, CHUNK, BLOCK)


# ---- launcher ----------------------------------------------------------------------------------

# Each launch after a specialisation's first calls its compiled kernel directly (see launch.py).
_launch_segment = Kernel(_segment_kernel)
# The module settings that shape segment_reduce's launch (read at each call), which a
# relaunch must find as its record did.
launch.SETTINGS.append(lambda: (TILE_BYTES, _chunks.CHUNKS_FIRST, _chunks.GUIDED_CHUNKS,
                                _ROW_BYTES, _MAX_GRID_YZ))


def segment_reduce(src, order, offsets, base, out, *, reduce, rule, alpha, include_base,
                   carry=None, chunks=None, keys=None):
    """See the contract in ``detsum.kernels.numba.segment`` and this module's notes; here
    ``offsets`` may also be ``kernels.SortedKeys``, ``kernels.UncheckedOffsets`` or
    ``kernels.UnsortedKeys``, bounds that the fp32 / Kahan / torch-order kernels read and
    check themselves (the others are given offsets, checked by torch ops). Unsorted keys
    (with no ``order``) are scanned by every program where there are at most CHUNK_TERMS of
    them, and sorted first otherwise. ``keys``: the segment of each row of ``src`` (the index
    that ``order`` and ``offsets`` were planned from: a plan's), by which the chunk programs
    find their segments instead of searching the offsets (GUIDED); it changes no result."""
    if isinstance(offsets, UnsortedKeys):
        if order is not None:
            raise ValueError("segment_reduce: unsorted keys take no order (the rows are the "
                             "positions)")
        if rule in (EXACT, CUDA_STRIDE_1) or offsets.keys.shape[0] > CHUNK_TERMS:
            order, offsets = offsets.sorted()
    given = isinstance(offsets, (SortedKeys, UncheckedOffsets, UnsortedKeys))
    if given and rule in (EXACT, CUDA_STRIDE_1):
        offsets, given = offsets.offsets(), False  # checked there, if still to check
    if rule == EXACT:
        if carry is not None:
            raise ValueError("segment_reduce: the EXACT rule takes no carry")
        segment_reduce_exact(src, order, offsets, base, out, reduce=reduce, alpha=alpha,
                             include_base=include_base, chunks=chunks)
        return
    if rule == CUDA_STRIDE_1:
        segment_reduce_stride1(src, order, offsets, base, out, reduce=reduce, alpha=alpha,
                               include_base=include_base)
        return
    if not has_work(src, order, offsets, _DATA_CODES):
        if given:
            offsets.check()  # no program to make it
        return
    outer, num_rows, inner = src.shape
    failure, check = None, _CHECK_NOTHING.value
    guide, guide_kind = None, _UNGUIDED.value  # the chunk programs' keys (GUIDED)
    if isinstance(offsets, SortedKeys) and offsets.every_key:
        # A promised-sorted index, searched as torch.searchsorted does (its answers on keys
        # that break the promise are the contract's), every key checked.
        bounds_kind, bounds = _KEYS.value, offsets.keys.contiguous()
        nseg, failure, check = offsets.num_segments, offsets.failure, _CHECK_EVERY.value
    elif isinstance(offsets, SortedKeys):
        # A sort's values: their offsets by one small launch (sort_offsets), so that each
        # program loads its two bounds as from a plan. Searched for by the programs
        # themselves, they cost each program dependent loads and the kernel registers: 64 a
        # thread in the MoE backward's launch, where the plan's takes 32 and this one 40 (on
        # the H200, 64 held half the warp slots and 64% of DRAM's bandwidth; the plan's
        # kernel reached 91%). The offsets' two ends are the keys' check (CHECK_ENDS).
        bounds_kind, nseg, failure = _OFFSETS.value, offsets.num_segments, offsets.failure
        guide, guide_kind = offsets.keys.contiguous(), _KEY_A_POSITION.value
        # A counting sort made them along with the values (kernels.sorted_keys).
        bounds = (offsets.known_offsets if offsets.known_offsets is not None
                  else sort_offsets(guide, nseg))
        check = _CHECK_ENDS.value
    elif isinstance(offsets, UnsortedKeys):
        # Checked by the first program, every key (CHECK_ENDS's flag, of all of them here);
        # at "host" (a failure to call) by every program before it writes.
        bounds_kind, bounds = _UNSORTED_KEYS.value, offsets.keys.contiguous()
        nseg, failure = offsets.num_segments, offsets.failure
        check = (_CHECK_BEFORE_WRITING if callable(failure) else _CHECK_ENDS).value
    elif isinstance(offsets, UncheckedOffsets):
        bounds_kind = (_PADDED_OFFSETS if offsets.padded else _ANY_OFFSETS).value
        nseg = offsets.num_segments
        failure, check = offsets.failure, _CHECK_EVERY.value
        # Unchecked, their running maximum: nondecreasing bounds, which the chunk programs'
        # searches and tickets need, and the segments that check="off" promises.
        bounds = (offsets.values.contiguous() if failure is not None
                  else torch.cummax(offsets.values, 0).values)
    else:
        bounds_kind, bounds, nseg = _OFFSETS.value, offsets.contiguous(), offsets.shape[0] - 1
    if failure is None:
        check = _CHECK_NOTHING.value
    if rule == CUDA_SMALL_STRIDE and reduce != SUM:
        raise ValueError("segment_reduce: CUDA_SMALL_STRIDE needs reduce SUM")
    dtype = src.dtype
    data = _DATA_CODES[dtype]
    acc_dtype, acc_tl = _ACC_TYPES[dtype]
    has_order = order is not None
    order = order.contiguous() if has_order else bounds  # never read without HAS_ORDER
    has_base = base is not None
    use_base = has_base and bool(include_base)
    scaled = float(alpha) != 1.0
    # torch.full rounds alpha to the acc type on the device: no host-to-device copy.
    alpha_t = torch.full((1,), float(alpha), dtype=acc_dtype, device=src.device) if scaled else out
    src_s, out_s, base_s = src, out, base
    if dtype == torch.bfloat16:  # base and out hold src's dtype too (the contract)
        src_s, out_s = _as_stored(src), _as_stored(out)
        base_s = _as_stored(base) if has_base else None
    if not has_base:
        base_s = out_s  # never read without HAS_BASE
    has_carry = carry is not None
    carry_s = carry if has_carry else out_s  # never touched without HAS_CARRY

    # Chunks exist only under a split rule, where some segment can be longer than CHUNK_TERMS:
    # not with more positions than that in all, nor where the caller knows that none is (a
    # plan that read its index back). Unsplit, each segment reduces serially from its init,
    # which is what the split order gives a segment of at most CHUNK_TERMS terms.
    positions = order.shape[0] if has_order else num_rows
    split = (rule in SPLIT_RULES and positions > CHUNK_TERMS
             and not (chunks is not None and chunks[1] == 0))
    ncomp = 2 if rule == KAHAN else 1
    # One chunk program per CHUNK_TERMS positions, its two sides (_chunk_owned) launched as
    # two programs, a workspace slot each.
    n_parts = _cdiv(positions, CHUNK_TERMS) if split else 0
    block, num_warps, grid_yz = _blocking(inner, src.element_size(), outer, _ROW_BYTES,
                                          _MAX_GRID_YZ)
    segs = _segments_per_program(block * src.element_size(), nseg, has_carry, bounds_kind)
    if segs > 1:
        num_warps = _tile_warps(segs * block * src.element_size())
    programs = (_cdiv(nseg, segs) if segs > 1 else nseg) + 2 * n_parts
    # The checkers of every bound: one per _CHECK_BLOCK bounds, at most one per program.
    checked_bounds = bounds.shape[0]
    checkers = (min(_cdiv(checked_bounds, _CHECK_BLOCK.value), programs)
                if check == _CHECK_EVERY.value else 1)
    # The workspace: the chunks' parts, then the flag that a checked launch writes.
    parts_size = outer * 2 * n_parts * ncomp * inner
    checked = check != _CHECK_NOTHING.value
    work = (torch.empty(parts_size + checked, dtype=acc_dtype, device=src.device)
            if split or checked else out)  # never touched without SPLIT or a check
    flag = work[parts_size:] if checked else out
    # Counter 0: the checkers' ticket; then the chunk programs' (_segment_kernel).
    counters = (ticket_counters(src.device, 1 + 2 * n_parts * grid_yz[0] * grid_yz[1])
                if split or check == _CHECK_EVERY.value else None)
    # The chunk programs find their segments by the keys where they have them (GUIDED: a load
    # or two and its check, where the search of the bounds takes a load for each halving): a
    # sort's values, or a plan's index (a row's key; a promised-sorted one's rows are the
    # positions; one of other strides searches, rather than be copied on every call).
    if not split or not _chunks.GUIDED_CHUNKS:
        guide, guide_kind = None, _UNGUIDED.value
    elif (guide is None and keys is not None and bounds_kind == _OFFSETS.value
          and keys.is_contiguous()):
        guide = keys
        guide_kind = (_KEY_A_ROW if has_order else _KEY_A_POSITION).value
    _launch_segment(
        (programs, *grid_yz),
        (src_s, *src_s.stride(), order, bounds, bounds if guide is None else guide, positions,
         n_parts, base_s, *base_s.stride(), out_s, *out_s.stride(), carry_s, *carry_s.stride(),
         work, alpha_t, flag, out if counters is None else counters, checkers, outer, nseg,
         inner),
        {"REDUCE": int(reduce), "RULE": int(rule), "DATA": data, "ACC": acc_tl,
         "HAS_ORDER": has_order, "HAS_BASE": has_base, "USE_BASE": use_base,
         "HAS_CARRY": has_carry, "SCALED": scaled, "SPLIT": split,
         "CHUNKS_FIRST": split and _chunks.CHUNKS_FIRST,
         "FIRST_TERM_START": not use_base and reduce in (AMAX, AMIN), "NCOMP": ncomp,
         "CHUNK": CHUNK_TERMS, "BOUNDS": bounds_kind, "GUIDED": guide_kind, "CHECK": check,
         "BLOCK": block, "SEGS": segs},
        num_warps=num_warps, holds=_holds(offsets, failure, split, work, counters, scaled,
                                          alpha_t),
    )
    if checked:
        _report(flag, failure, counters)


def _holds(offsets, failure, split, work, counters, scaled, alpha_t) -> tuple | None:
    """What ``segment_reduce``'s launch may hold for a relaunch (``Kernel``'s ``holds``, see
    launch.py's RECORDED LAUNCHES): the workspace, ticket counters and alpha it made for the
    launch, when the launch is the whole call (offsets as given, so no search or running
    maximum made them; no check, whose flag is read after it) and its workspace is at most
    ``HELD_WORKSPACE_BYTES``; else None."""
    if type(offsets) is not torch.Tensor or failure is not None:
        return None
    if split and work.numel() * work.element_size() > HELD_WORKSPACE_BYTES:
        return None
    made = (work, counters) if split else ()
    return (*made, alpha_t) if scaled else made


#: The largest chunk workspace a relaunch may hold (a record keeps it for as long as its plan
#: lives). A launch with more has long segments of wide rows: it moves hundreds of times
#: more, and its GPU time hides the host time a relaunch would spare.
HELD_WORKSPACE_BYTES = 1 << 20


#: A narrow row: under 512 bytes a program and step (``_blocking`` gives it one warp, and most
#: of its lanes load 4 or 8 bytes). Hopper keeps at most 32 programs on an SM, so one-warp
#: programs fill at most half its 64 warp slots, whatever their registers.
_NARROW_ROW_BYTES = 512
#: The bytes of the tile of segments (``_reduce_segments``) that a program of narrow rows
#: takes instead of one segment: 2 KiB, four warps of 16-byte loads. 0: one segment a
#: program, always (the layout before, kept for comparing the two on a GPU).
TILE_BYTES = 2048


def _segments_per_program(row_bytes: int, nseg: int, has_carry: bool, bounds_kind: int
                          ) -> int:
    """How many whole segments one program of the launch reduces (``SEGS``): several for
    narrow rows with no carry, bounded by offsets (a segment too long for a whole one is the
    chunk programs' all the same); else 1."""
    if (row_bytes >= _NARROW_ROW_BYTES or has_carry or nseg < 2
            or bounds_kind not in (_OFFSETS.value, _ANY_OFFSETS.value, _PADDED_OFFSETS.value)):
        return 1
    return max(1, min(TILE_BYTES // row_bytes, _next_power_of_2(nseg)))


def _tile_warps(tile_bytes: int) -> int:
    """The warps of a program of a tile of segments: one per 512 bytes, 1 to 8."""
    return max(1, min(8, tile_bytes // 512))


def _report(flag: torch.Tensor, failure, counters: torch.Tensor | None) -> None:
    """What a checked launch found: asserted on the device (``failure`` a message), or read
    back once and, when it shows a bad bound, handed to ``failure``, which raises. Where a
    failure is reported and the program goes on, the ticket counters are set back to 0: bounds
    that fail can leave some off it (see the notes)."""
    if callable(failure):
        if flag.item():
            return
        if counters is not None:
            counters.zero_()
        failure()
        raise AssertionError("segment_reduce: the launch found a bad bound that the check on "
                             "the host did not")
    try:
        torch._assert_async(flag, failure)
    except RuntimeError:
        # On CPU tensors the assert is synchronous, and raises here; a GPU's runs later, and
        # a failure ends the CUDA context, counters and all.
        if counters is not None:
            counters.zero_()
        raise



@functools.lru_cache(maxsize=256)
def _blocking(inner: int, itemsize: int, outer: int, row_bytes: int, max_grid_yz: int
              ) -> tuple[int, int, tuple[int, int]]:
    """``segment_reduce``'s BLOCK, num_warps and grid (y, z): a function of the shape alone,
    kept, since a small launch spends a microsecond computing it."""
    block = min(max(_next_power_of_2(inner), 16), row_bytes // itemsize)
    num_warps = max(1, min(8, block * itemsize // 512))
    return block, num_warps, (min(_cdiv(inner, block), max_grid_yz), min(outer, max_grid_yz))


def _made_for_the_interpreter(namespace) -> bool:
    jitted = [value for value in vars(namespace).values()
              if isinstance(value, (JITFunction, InterpretedFunction))]
    return all(isinstance(value, InterpretedFunction) for value in jitted)


# Triton decides at each @triton.jit whether the function is compiled or interpreted, from
# TRITON_INTERPRET as it is then: triton.language's own functions when triton is first
# imported, this module's when it is.
_INTERPRETED = (_made_for_the_interpreter(sys.modules[__name__])
                and _made_for_the_interpreter(tl))


def interpreted() -> bool:
    """Whether these kernels, and the ``triton.language`` functions they call, run in Triton's
    interpreter (on CPU tensors). With TRITON_INTERPRET=1 set after triton was first imported,
    this module's kernels are interpreted but triton's own functions are not, and a launch
    fails inside Triton ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    return _INTERPRETED
