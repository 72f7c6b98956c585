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
  positions: program ``e`` owns the chunk starts of the long segments that fall in positions
  ``[e C, (e + 1) C)``, at most two (``_chunk_owned``), found by binary searches of the
  segments' bounds, and writes each chunk's acc (and Kahan compensation) to its workspace slot,
  then takes a ticket of its segment (an atomic add on a counter). The program that takes
  the segment's last ticket folds its chunks in order, finding chunk ``k``'s slot from the
  segment's start alone (``_chunk_slot``), writes its row and sets the counter back to 0.
  Nothing is counted before the launch, and the fold is part of it: one launch, no other
  device op, no host read. Which program folds changes from run to run; what it folds, and
  in which order, never does: each output element is written once, from the same values in
  the same order, so the result is the same on every run, for every grid, block width and
  number of SMs. Only the column block width and the warp count are tuned, and neither takes
  part in any element's arithmetic.

- Tickets: a chunk program's stores of its part, by all its threads, come before its ticket
  (``tl.debug_barrier``, then the atomic with release semantics at GPU scope, ``acq_rel``),
  and the folder's loads come after its own ticket (acquire) and bypass L1 (``.cg``); the
  sm_90 PTX is checked for both (tests/ptx_check.py). The counters live in a workspace kept
  per device and stream (``ticket_counters``), zeroed once when it is made; a launch leaves
  every counter it used at 0, so no op resets them between launches. That holds when the
  bounds are consistent (offsets that never decrease; sorted keys, whose searches never
  decrease): offsets that a launch checks and finds bad can leave a counter off 0, so the
  paths that report that and go on (a host read of the verdict, an assert on CPU tensors)
  set the counters back; on a GPU a failed ``torch._assert_async`` ends the CUDA context.

- Bounds (BOUNDS): offsets, or (``kernels.SortedKeys``, a launch without a plan) the sorted
  index itself, in which each program finds its segment's start and end by
  torch.searchsorted's binary search (``_segment_start``): no offsets are computed before
  the launch. Offsets not known to be valid (``kernels.UncheckedOffsets``) are clamped into
  ``[0, M]`` as each is read, and a segment whose end is below its start is empty: every read
  and write stays inside the tensors whatever they hold. Unchecked ("off"), they are first
  made nondecreasing (their running maximum: one op), for consistent bounds.

- Checks (CHECK), of bounds that the caller has not checked: under CHECK_ENDS (a sort's
  values) the first program writes whether the first and last key lie in range; under
  CHECK_EVERY (offsets: from 0 to M without decreasing; a promised-sorted index:
  nondecreasing, in range) the first ``checkers`` programs each check blocks of
  ``_CHECK_BLOCK`` bounds and take a ticket that carries what they found, and the last to
  take one writes the verdict (``_check_every_bound``). The verdict is a flag at the end of
  the launch's workspace, which no op initialises: one program writes it, in every checked
  launch. The launcher asserts it on the device (check="device": one op, no read) or reads
  it back once (check="host"); only then, on the failure's path, are the values looked at
  again, to raise the caller's error naming the first bad position.

- Carry (a running Kahan sum, see the contract): the program of a segment's first chunk starts
  ``c`` from ``carry``; the program that writes the segment's row (its whole-segment slot, or
  the fold) writes ``s`` to ``out`` and ``c`` back to ``carry`` instead of the final ``s + c``.

- bf16 travels as int16 bits and is converted with integer operations (why: the Triton
  interpreter's ``.to(tl.bfloat16)`` truncates, and it has no bf16 arithmetic). fp16 uses
  ``.to``, which rounds to nearest even on the GPU and in the interpreter.

- 64-bit: program ids, positions, rows and strides are int64 before any multiply, so tensors
  of more than 2**31 elements are addressed correctly. Grid dimensions 1 and 2 are capped at
  65535 (CUDA's limit) and the programs loop over the rest.

- EXACT (``_exact_kernel``): one program per segment and column block, as the rules that
  never split. bf16, fp16 and fp32 data first take a fast path: the terms summed in fp64 while
  the largest and smallest nonzero magnitude of each column are kept; a column whose spread
  fp64 provably holds (see ``_exact_fast_pass``) has its exact sum there, rounded once (through
  a round-to-odd fp32 for bf16 and fp16). The other columns, all fp64 data, and every mean
  (whose fast-path sum is put in the limbs, to be divided there) go through the integer state
  of ``detsum.kernels`` (EXACT STATE), only in blocks that have such columns: a [columns,
  limbs] int64 tensor to which each term adds its digits, carried, divided by the count (into
  one more digit, below the unit, so that a mean whose quantum is one unit, an fp32 or fp64
  subnormal, is rounded rather than truncated) and rounded from the integer. Either way the
  bits are the correctly rounded result, so which path ran never shows.

- torch's CUDA stride-1 kernel (slice size 1, 32 or more terms) sums 32 interleaved lanes and
  then a shuffle-down tree; ``_stride1_kernel`` runs it on a 32-wide vector, and the tree as
  five explicit halvings (``reshape`` + ``split``), each a single add per lane, so the pairing
  is exactly torch's.

- Launch: through ``launch.Kernel``, which calls a specialisation's compiled kernel directly
  after its first launch, for about 10 us of host time where Triton's ``JITFunction.run``
  takes 20-25 us (see launch.py); in Triton's interpreter, as ``kernel[grid](...)``. The
  launchers' host arithmetic is plain Python for the same reason.
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import (
    AMAX,
    AMIN,
    CHUNK_TERMS,
    CUDA_SMALL_STRIDE,
    CUDA_STRIDE_1,
    EXACT,
    EXACT_LIMBS,
    KAHAN,
    MEAN,
    NORMALISE_EVERY,
    PROD,
    ROUND_EACH,
    SPLIT_RULES,
    SUM,
    WIDE,
    SortedKeys,
    UncheckedOffsets,
    has_exact_work,
    has_work,
)
from .launch import Kernel

__all__ = ["interpreted", "segment_reduce", "ticket_counters"]

# Triton kernels may only read module globals that are constexpr.
_SUM = tl.constexpr(SUM)
_MEAN = tl.constexpr(MEAN)
_PROD = tl.constexpr(PROD)
_AMAX = tl.constexpr(AMAX)
_AMIN = tl.constexpr(AMIN)
_WIDE = tl.constexpr(WIDE)
_KAHAN = tl.constexpr(KAHAN)
_ROUND_EACH = tl.constexpr(ROUND_EACH)
_SMALL_STRIDE = tl.constexpr(CUDA_SMALL_STRIDE)
_WARP = tl.constexpr(32)

# How data elements travel: as the acc type itself (fp32, fp64), as bf16 bits, or as fp16.
_NATIVE = tl.constexpr(0)
_BF16 = tl.constexpr(1)
_F16 = tl.constexpr(2)

# What ``bounds_ptr`` holds (BOUNDS): offsets known to be valid; offsets of any values, each
# read clamped into [0, positions] (``kernels.UncheckedOffsets``); sorted keys
# (``kernels.SortedKeys``).
_OFFSETS = tl.constexpr(0)
_ANY_OFFSETS = tl.constexpr(1)
_KEYS = tl.constexpr(2)
# What a launch checks of its bounds (CHECK), writing its flag: nothing, the sorted keys' two
# ends (one program), every bound (spread over programs, _check_every_bound).
_CHECK_NOTHING = tl.constexpr(0)
_CHECK_ENDS = tl.constexpr(1)
_CHECK_EVERY = tl.constexpr(2)
# Bounds that one checker program reads at a time.
_CHECK_BLOCK = tl.constexpr(1024)
# Stages of the term loop's software pipeline (_combine_rows): the rows of the next
# _TERM_STAGES - 1 positions are in flight while one is combined. Order-neutral.
_TERM_STAGES = tl.constexpr(5)

_MAX_GRID_YZ = 65535
# Column block: at most 2 KiB of one row per program and step, in whole powers of two.
_ROW_BYTES = 2048


# ---- element conversions ---------------------------------------------------------------------

@triton.jit
def _to_acc(raw, DATA: tl.constexpr, ACC: tl.constexpr):
    """A loaded data element as the acc type (exact)."""
    if DATA == _BF16:
        bits = raw.to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(ACC)


@triton.jit
def _bf16_bits(x):
    """RN_bf16(x) for fp32 x, as uint32 bits in the low half; NaN becomes 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded)


@triton.jit
def _round_to_data(x, DATA: tl.constexpr):
    """RN_dtype(x), kept in the acc type (exact there)."""
    if DATA == _BF16:
        return (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    elif DATA == _F16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _to_data(x, DATA: tl.constexpr, OUT_TY: tl.constexpr):
    """RN_dtype(x) as the element type stored (int16 bits for bf16)."""
    if DATA == _BF16:
        return _bf16_bits(x).to(tl.int16)
    else:
        return x.to(OUT_TY)


# ---- one step of each reduction ----------------------------------------------------------------

@triton.jit
def _combine(acc, comp, x, alpha, REDUCE: tl.constexpr, RULE: tl.constexpr,
             DATA: tl.constexpr, SCALED: tl.constexpr):
    """Add one term row ``x`` (acc type) into ``acc`` (and ``comp``)."""
    if REDUCE == _PROD:
        acc = acc * x
    elif REDUCE == _AMAX:
        acc = tl.where(((x != x) | (x > acc)) & (acc == acc), x, acc)
    elif REDUCE == _AMIN:
        acc = tl.where(((x != x) | (x < acc)) & (acc == acc), x, acc)
    else:
        t = x
        if SCALED:
            t = x * alpha  # its own rounding: the launch disables FMA contraction
        if RULE == _KAHAN:
            u = acc + t
            comp = comp + tl.where(tl.abs(acc) >= tl.abs(t), (acc - u) + t, (t - u) + acc)
            acc = u
        elif RULE == _ROUND_EACH and REDUCE == _SUM:
            if SCALED:
                t = _round_to_data(t, DATA)  # torch rounds source * alpha to the dtype first
            acc = _round_to_data(acc + t, DATA)
        elif RULE == _SMALL_STRIDE:
            if SCALED:
                t = _round_to_data(t, DATA)
            acc = acc + t
        else:  # WIDE, and MEAN under ROUND_EACH (summed wide, rounded in _finish)
            acc = acc + t
    return acc, comp


@triton.jit
def _fold(acc, comp, part, part_comp, REDUCE: tl.constexpr, RULE: tl.constexpr):
    """Fold a later chunk's result into the running one (the contract's chunk fold): the
    chunk's value is combined like one more term, and its Kahan compensation added."""
    acc, comp = _combine(acc, comp, part, 1.0, REDUCE, RULE, _NATIVE, False)
    if RULE == _KAHAN and (REDUCE == _SUM or REDUCE == _MEAN):
        comp = comp + part_comp
    return acc, comp


@triton.jit
def _finish(acc, comp, init, count, REDUCE: tl.constexpr, RULE: tl.constexpr,
            DATA: tl.constexpr, ACC: tl.constexpr):
    """The segment's value in the acc type, before the final rounding to the dtype."""
    if RULE == _KAHAN and (REDUCE == _SUM or REDUCE == _MEAN):
        # s + c only for a finite s (acc - acc == 0 exactly then) and a nonzero c: see the
        # contract (inf stays inf, a sum of -0.0 stays -0.0).
        acc = tl.where(((acc - acc) == 0) & (comp != 0), acc + comp, acc)
    if RULE == _SMALL_STRIDE:
        acc = _round_to_data(init + acc, DATA)  # torch adds the old value once, at the end
    if REDUCE == _MEAN:
        if RULE == _ROUND_EACH:
            acc = _round_to_data(acc, DATA)  # torch's scatter_reduce mean rounds the sum first
        divisor = tl.zeros_like(acc) + count.to(ACC)
        if ACC == tl.float64:
            acc = acc / divisor
        else:
            acc = tl.math.div_rn(acc, divisor)
    return acc


@triton.jit
def _combine_rows(acc, comp, row_base, ss1, ss2, cols, mask, order_ptr, p_begin, p_end, alpha,
                  REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr,
                  ACC: tl.constexpr, HAS_ORDER: tl.constexpr, SCALED: tl.constexpr):
    """Combine the term rows at positions p_begin .. p_end - 1, in order.

    The loop is software-pipelined (``_TERM_STAGES``; on the GPU, asynchronous copies to
    shared memory): the rows of the next positions, and their entries of ``order``, are on
    their way while the current one is combined, so that a program has several row loads in
    flight, where one at a time, each behind its load of ``order``, leaves it waiting on the
    memory's latency once per term. Only the loads move: the rows are combined one after
    another in position order."""
    for p in tl.range(p_begin, p_end, num_stages=_TERM_STAGES):
        if HAS_ORDER:
            row = tl.load(order_ptr + p)
        else:
            row = p
        x = _to_acc(tl.load(row_base + row * ss1 + cols * ss2, mask=mask, other=0), DATA, ACC)
        acc, comp = _combine(acc, comp, x, alpha, REDUCE, RULE, DATA, SCALED)
    return acc, comp


@triton.jit
def _segment_start(bounds_ptr, s, positions, BOUNDS: tl.constexpr):
    """Where segment ``s`` starts (``s`` in ``[0, nseg]``; the start of ``nseg`` is the last
    segment's end): ``offsets[s]`` (under ANY_OFFSETS clamped into ``[0, positions]``), or
    under KEYS the first of the ``positions`` sorted keys that is ``>= s``, found by the steps
    of ``torch.searchsorted`` (so the same answer, also for keys that are not sorted)."""
    if BOUNDS == _KEYS:
        lo = tl.zeros([], tl.int64)
        hi = lo + positions
        while lo < hi:
            mid = lo + (hi - lo) // 2
            if tl.load(bounds_ptr + mid) >= s:
                hi = mid
            else:
                lo = mid + 1
        start = lo
    else:
        start = tl.load(bounds_ptr + s).to(tl.int64)
        if BOUNDS == _ANY_OFFSETS:
            start = tl.minimum(tl.maximum(start, 0), positions)
    return start


@triton.jit
def _segment_at(bounds_ptr, nseg, p, positions, BOUNDS: tl.constexpr):
    """The segment holding position ``p < positions`` (its start ``<= p <`` its end), or -1
    when no segment does."""
    found = tl.zeros([], tl.int64) - 2  # -2: not known yet
    if BOUNDS == _KEYS:
        # Sorted keys name it themselves: the key at p, checked against its bounds (keys that
        # are not sorted may fail the check, and take the search below).
        guess = tl.minimum(tl.maximum(tl.load(bounds_ptr + p).to(tl.int64), -1), nseg)
        start = _segment_start(bounds_ptr, tl.maximum(guess, 0), positions, BOUNDS)
        end = _segment_start(bounds_ptr, tl.minimum(guess + 1, nseg), positions, BOUNDS)
        holds = tl.where(guess < 0, p < start,
                         tl.where(guess >= nseg, p >= start, (start <= p) & (p < end)))
        found = tl.where(holds, tl.where(guess >= nseg, -1, guess), -2)
    if found == -2:
        # The first segment starting after p, by a binary search of the starts.
        lo = tl.zeros([], tl.int64)
        hi = lo + nseg + 1
        while lo < hi:
            mid = lo + (hi - lo) // 2
            if _segment_start(bounds_ptr, mid, positions, BOUNDS) > p:
                hi = mid
            else:
                lo = mid + 1
        # lo == nseg + 1: p is at or after the last segment's end; lo == 0: before the first.
        found = tl.where(lo > nseg, -1, lo - 1)
    return found


@triton.jit
def _chunk_owned(bounds_ptr, nseg, positions, e, side, CHUNK: tl.constexpr,
                 BOUNDS: tl.constexpr):
    """(segment, chunk number, whether there is one) of chunk program ``e``'s ``side``.

    Chunk program ``e`` owns the chunk starts of the long segments (more than CHUNK terms)
    that lie in positions ``[e * CHUNK, (e + 1) * CHUNK)``. A long segment being longer than
    that range, it holds at most two: side 0, one of the segment holding position
    ``e * CHUNK`` (the first of its chunk starts at or after it); side 1, the first chunk of a
    long segment starting after ``e * CHUNK`` inside the range, which then holds the range's
    last position. The fold finds chunk ``k`` of a segment from its start alone
    (``_chunk_slot``), so no running count of chunks is needed."""
    low = e * CHUNK
    first_seg = _segment_at(bounds_ptr, nseg, low, positions, BOUNDS)
    seg = first_seg
    if side == 1:
        seg = _segment_at(bounds_ptr, nseg, tl.minimum(low + CHUNK, positions) - 1, positions,
                          BOUNDS)
    real = seg >= 0
    seg_at = tl.maximum(seg, 0)
    p0 = _segment_start(bounds_ptr, seg_at, positions, BOUNDS)
    n = _segment_start(bounds_ptr, seg_at + 1, positions, BOUNDS) - p0
    j = tl.zeros([], tl.int64)
    if side == 0:
        j = (tl.maximum(low - p0, 0) + CHUNK - 1) // CHUNK
    else:
        real = real & (seg != first_seg)
    owned = real & (n > CHUNK) & (p0 + j * CHUNK < p0 + n)
    return seg_at, j, owned, p0, n


@triton.jit
def _chunk_slot(p0, k, CHUNK: tl.constexpr):
    """The workspace slot of chunk ``k`` of the long segment starting at ``p0``: chunk
    program ``e = (p0 + k * CHUNK) // CHUNK``'s side 0, or its side 1 for a first chunk that
    starts after ``e * CHUNK``."""
    q = p0 + k * CHUNK
    e = q // CHUNK
    side = tl.where((k == 0) & (q != e * CHUNK), 1, 0)
    return e * 2 + side


@triton.jit
def _reduce_part(
    src_ptr, ss0, ss1, ss2, order_ptr, base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2,
    carry_ptr, cs0, cs1, cs2, work_ptr, work_rows, alpha, outer, inner,
    seg, j, p_begin, p_end, n, slot,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr,
    HAS_CARRY: tl.constexpr, SCALED: tl.constexpr, IS_CHUNK: tl.constexpr,
    FIRST_TERM_START: tl.constexpr, NCOMP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Reduce positions ``p_begin .. p_end - 1``: chunk ``j`` of segment ``seg`` (``n``
    terms) into workspace slot ``slot`` (IS_CHUNK), or the whole segment into its row."""
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
                elif RULE == _SMALL_STRIDE:
                    acc = tl.zeros([BLOCK], ACC)  # torch sums the terms from 0 and adds init last
                elif USE_BASE:
                    acc = init
                elif REDUCE == _PROD:
                    acc = tl.zeros([BLOCK], ACC) + 1.0
                else:
                    acc = tl.zeros([BLOCK], ACC)
                acc, comp = _combine_rows(acc, comp, row_base, ss1, ss2, cols, mask, order_ptr,
                                          p, p_end, alpha, REDUCE, RULE, DATA, ACC, HAS_ORDER,
                                          SCALED)
                if IS_CHUNK:
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


# ---- checks of the bounds, in the launch -------------------------------------------------------

@triton.jit
def _check_every_bound(bounds_ptr, nseg, positions, checkers, counters_ptr, flag_ptr,
                       BOUNDS: tl.constexpr):
    """Checker ``c = program_id(0) < checkers`` of a launch under CHECK_EVERY: checks the
    bounds ``c * _CHECK_BLOCK ..``, then every ``checkers * _CHECK_BLOCK`` on, and takes a
    ticket; the last checker to take one writes the launch's flag (1: every bound checked
    good, 0: not).

    Offsets: the first is 0, the last ``positions``, none less than the one before. Keys (a
    promised-sorted index): none less than the one before, the first ``>= 0`` and the last
    ``< nseg`` (so all of them in range).

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
def _segment_kernel(
    src_ptr, ss0, ss1, ss2, order_ptr, bounds_ptr, positions, n_parts,
    base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2,
    work_ptr, alpha_ptr, flag_ptr, counters_ptr, checkers, outer, nseg, inner,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr,
    HAS_CARRY: tl.constexpr, SCALED: tl.constexpr, SPLIT: tl.constexpr,
    FIRST_TERM_START: tl.constexpr, NCOMP: tl.constexpr, CHUNK: tl.constexpr,
    BOUNDS: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Whole segments (slot < nseg) and, under SPLIT, the chunks of the long segments: chunk
    program ``slot - nseg`` of ``n_parts`` (``_chunk_owned``), the last of a segment's to
    finish folding them (a ticket in ``counters_ptr[1 + ...]``). The segments' bounds are at
    ``bounds_ptr``, as BOUNDS says (``_segment_start``). CHECK_ENDS: the first program writes
    to ``flag_ptr`` whether the sorted keys' two ends lie in ``[0, nseg)``; CHECK_EVERY: the
    first ``checkers`` programs check every bound (``_check_every_bound``)."""
    slot = tl.program_id(0).to(tl.int64)
    first_of_slot = (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    if CHECK == _CHECK_ENDS:
        if (slot == 0) & first_of_slot:
            in_range = ((tl.load(bounds_ptr) >= 0)
                        & (tl.load(bounds_ptr + positions - 1) < nseg))
            tl.store(flag_ptr, in_range.to(flag_ptr.dtype.element_ty))
    elif CHECK == _CHECK_EVERY:
        if (slot < checkers) & first_of_slot:
            _check_every_bound(bounds_ptr, nseg, positions, checkers, counters_ptr, flag_ptr,
                               BOUNDS)
    alpha = 1.0
    if SCALED:
        alpha = tl.load(alpha_ptr)
    if slot < nseg:
        p0 = _segment_start(bounds_ptr, slot, positions, BOUNDS)
        p1 = _segment_start(bounds_ptr, slot + 1, positions, BOUNDS)
        if BOUNDS == _ANY_OFFSETS:
            p1 = tl.maximum(p1, p0)  # offsets that decrease: an empty segment
        n = p1 - p0
        whole = n >= 0  # always, unless the chunk programs own this segment
        if SPLIT:
            whole = n <= CHUNK
        if whole:
            _reduce_part(src_ptr, ss0, ss1, ss2, order_ptr, base_ptr, bs0, bs1, bs2, out_ptr,
                         os0, os1, os2, carry_ptr, cs0, cs1, cs2, work_ptr, 0, alpha, outer,
                         inner, slot, 0, p0, p1, n, 0, REDUCE, RULE, DATA, ACC, HAS_ORDER,
                         HAS_BASE, USE_BASE, HAS_CARRY, SCALED, False, FIRST_TERM_START,
                         NCOMP, BLOCK)
    elif SPLIT:
        e = slot - nseg
        work_rows = 2 * n_parts
        for side in range(2):
            seg, j, owned, p0, n = _chunk_owned(bounds_ptr, nseg, positions, e, side, CHUNK,
                                                BOUNDS)
            if owned:
                p_begin = p0 + j * CHUNK
                _reduce_part(src_ptr, ss0, ss1, ss2, order_ptr, base_ptr, bs0, bs1, bs2,
                             out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2, work_ptr,
                             work_rows, alpha, outer, inner, seg, j, p_begin,
                             tl.minimum(p0 + n, p_begin + CHUNK), n, e * 2 + side, REDUCE,
                             RULE, DATA, ACC, HAS_ORDER, HAS_BASE, USE_BASE, HAS_CARRY, SCALED,
                             True, FIRST_TERM_START, NCOMP, BLOCK)
                # A ticket per long segment (and column block and outer index of the grid),
                # taken once this program's stores of its part are done (the barrier orders
                # every thread's before it, the release publishes them): the program that
                # takes the last folds the parts, after its acquire. Which program folds
                # varies from run to run; the order of the fold never does.
                tl.debug_barrier()
                ticket_at = (counters_ptr + 1
                             + (_chunk_slot(p0, 0, CHUNK) * tl.num_programs(1)
                                + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2))
                taken = tl.atomic_add(ticket_at, 1, sem="acq_rel")
                if taken == (n + CHUNK - 1) // CHUNK - 1:
                    tl.store(ticket_at, 0)  # for the next launch, which starts after this one
                    _fold_chunks(out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2, work_ptr,
                                 work_rows, outer, inner, seg, p0, n, REDUCE, RULE, DATA, ACC,
                                 USE_BASE, HAS_CARRY, NCOMP, CHUNK, BLOCK)


@triton.jit
def _stride1_terms(src_ptr, o_off, ss1, order_ptr, p, alpha, DATA: tl.constexpr,
                   ACC: tl.constexpr, HAS_ORDER: tl.constexpr, SCALED: tl.constexpr):
    """The term(s) at position(s) p (a scalar or a vector of lanes), as torch adds them."""
    if HAS_ORDER:
        row = tl.load(order_ptr + p)
    else:
        row = p
    t = _to_acc(tl.load(src_ptr + o_off + row * ss1), DATA, ACC)
    if SCALED:
        t = _round_to_data(t * alpha, DATA)
    return t


@triton.jit
def _halve(lanes, HALF: tl.constexpr):
    """lanes[l] + lanes[l + HALF] for l < HALF: one shuffle-down step, lane by lane."""
    low, high = tl.split(tl.permute(tl.reshape(lanes, (2, HALF)), (1, 0)))
    return low + high


@triton.jit
def _stride1_kernel(
    src_ptr, ss0, ss1, order_ptr, offsets_ptr, base_ptr, bs0, bs1, out_ptr, os0, os1,
    alpha_ptr, outer,
    DATA: tl.constexpr, ACC: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_BASE: tl.constexpr,
    USE_BASE: tl.constexpr, SCALED: tl.constexpr,
):
    """torch's CUDA indexing_backward_kernel_stride_1 arithmetic, one segment per program."""
    seg = tl.program_id(0).to(tl.int64)
    p0 = tl.load(offsets_ptr + seg)
    p1 = tl.load(offsets_ptr + seg + 1)
    n = p1 - p0
    alpha = 1.0
    if SCALED:
        alpha = tl.load(alpha_ptr)
    passes = n // _WARP
    for o in range(tl.program_id(1).to(tl.int64), outer, tl.num_programs(1)):
        out_at = out_ptr + o * os0 + seg * os1
        if n == 0:
            if HAS_BASE:
                tl.store(out_at, tl.load(base_ptr + o * bs0 + seg * bs1))
            else:
                tl.store(out_at, _to_data(tl.zeros([], ACC), DATA, out_ptr.dtype.element_ty))
        else:
            o_off = o * ss0
            g = tl.zeros([], ACC)
            if passes > 0:
                lane_ids = tl.arange(0, _WARP).to(tl.int64)
                lanes = tl.zeros([_WARP], ACC)
                for i in range(passes):
                    lanes = lanes + _stride1_terms(src_ptr, o_off, ss1, order_ptr,
                                                   p0 + i * _WARP + lane_ids, alpha, DATA, ACC,
                                                   HAS_ORDER, SCALED)
                lanes = _halve(lanes, 16)
                lanes = _halve(lanes, 8)
                lanes = _halve(lanes, 4)
                lanes = _halve(lanes, 2)
                lane0, lane1 = tl.split(lanes)
                g = lane0 + lane1
            for p in range(p0 + passes * _WARP, p1):
                g = g + _stride1_terms(src_ptr, o_off, ss1, order_ptr, p, alpha, DATA, ACC,
                                       HAS_ORDER, SCALED)
            init = tl.zeros([], ACC)
            if USE_BASE:
                init = _to_acc(tl.load(base_ptr + o * bs0 + seg * bs1), DATA, ACC)
            value = init + g
            tl.store(out_at, _to_data(value, DATA, out_ptr.dtype.element_ty))


# ---- the EXACT rule ----------------------------------------------------------------------------
# The state is the one detsum.kernels describes (EXACT STATE): per column, an integer count of
# units in int64 limbs of LIMB_BITS = 32 bits. Here the limbs of a column block are one
# [BLOCK, LANES] tensor, lane i holding limb i; a term is added to the lanes it spans by
# one-hot selects, and the carries, the long division and the rounding walk the lanes with
# masked row sums. Shift amounts are clamped below 64 wherever a select discards the result,
# since a shift by 64 or more is undefined on the GPU.

_SIGN_BIT = tl.constexpr(-(2**63))  # the int64 with only the top bit set
_F64_INF_BITS = tl.constexpr(0x7FF0000000000000)
_F64_NAN_BITS = tl.constexpr(0x7FF8000000000000)
_F32_INF_BITS = tl.constexpr(0x7F800000)
_NO_MAGNITUDE = tl.constexpr(0x7FFFFFFF)  # above every finite fp32 magnitude's bits
# The biased exponent at which an fp64's last significand bit is worth one fp32 unit, 2**-149.
_F64_EXPONENT_OF_FP32_UNIT = tl.constexpr(1023 + 52 - 149)


@triton.jit
def _float_fields(x, ACC: tl.constexpr):
    """Sign (int1), biased exponent and stored fraction (int64) of the fp32 or fp64 x."""
    if ACC == tl.float64:
        bits = x.to(tl.int64, bitcast=True)
        return bits < 0, (bits >> 52) & 0x7FF, bits & 0xFFFFFFFFFFFFF
    else:
        bits = x.to(tl.int32, bitcast=True)
        return bits < 0, ((bits >> 23) & 0xFF).to(tl.int64), (bits & 0x7FFFFF).to(tl.int64)


@triton.jit
def _lane(limbs, lanes, i):
    """Limb ``i`` (a constant, or one per column as a [BLOCK, 1] tensor) of every column."""
    return tl.sum(tl.where(lanes == i, limbs, 0), axis=1)


@triton.jit
def _deposit(limbs, lanes, significand, shift, negative, WIDE: tl.constexpr):
    """limbs += -+ significand * 2**shift units, cut into digits at the limb boundaries.

    significand < 2**53 (WIDE) or < 2**24, shift >= 0. Each digit is below 2**33, so the state
    takes MAX_TERMS_PER_STATE of these before a limb could overflow; nothing carries here."""
    k = (shift >> 5)[:, None]
    r = shift & 31
    low = (significand & 0xFFFFFFFF) << r
    d0 = low & 0xFFFFFFFF
    d1 = low >> 32
    if WIDE:
        high = (significand >> 32) << r
        d1 = d1 + (high & 0xFFFFFFFF)
        d2 = high >> 32
    d0 = tl.where(negative, -d0, d0)
    d1 = tl.where(negative, -d1, d1)
    limbs = limbs + tl.where(lanes == k, d0[:, None], 0) + tl.where(lanes == k + 1, d1[:, None], 0)
    if WIDE:
        d2 = tl.where(negative, -d2, d2)
        limbs = limbs + tl.where(lanes == k + 2, d2[:, None], 0)
    return limbs


@triton.jit
def _deposit_term(limbs, lanes, t, take, nan, pinf, ninf, not_neg_zero, ACC: tl.constexpr):
    """Add the term ``t`` (the acc type: its units are the acc type's smallest subnormal) to the
    columns in ``take``; record NaN, +inf, -inf and anything but -0.0 in the flags instead."""
    negative, exponent, fraction = _float_fields(t, ACC)
    if ACC == tl.float64:
        special = exponent == 0x7FF
        hidden = fraction | (1 << 52)
    else:
        special = exponent == 0xFF
        hidden = fraction | (1 << 23)
    nan = nan | (take & special & (fraction != 0))
    pinf = pinf | (take & special & (fraction == 0) & (negative == 0))
    ninf = ninf | (take & special & (fraction == 0) & negative)
    not_neg_zero = not_neg_zero | (take & ((negative == 0) | (exponent != 0) | (fraction != 0)))
    # A subnormal counts fraction units; a normal one (fraction + hidden bit) << (exponent - 1).
    significand = tl.where(exponent == 0, fraction, hidden)
    significand = tl.where(take & (special == 0), significand, 0)
    shift = tl.maximum(exponent - 1, 0)
    limbs = _deposit(limbs, lanes, significand, shift, negative, ACC == tl.float64)
    return limbs, nan, pinf, ninf, not_neg_zero


@triton.jit
def _normalise(limbs, lanes, N_LIMBS: tl.constexpr):
    """Carry every limb but the last into [0, 2**32) (the value is unchanged)."""
    # A loop, not tl.static_range: unrolled 66 times (fp64) it takes minutes to compile. The
    # limb is read inline: a call to _lane costs the interpreter more than the work.
    for i in range(N_LIMBS - 1):
        v = tl.sum(tl.where(lanes == i, limbs, 0), axis=1)
        carry = v >> 32  # arithmetic: floor(v / 2**32)
        limbs = tl.where(lanes == i, (v & 0xFFFFFFFF)[:, None],
                         tl.where(lanes == i + 1, limbs + carry[:, None], limbs))
    return limbs


@triton.jit
def _negate(limbs, lanes, N_LIMBS: tl.constexpr):
    """-N for a normalised N, normalised, with no carry chain: complementing the digits gives
    -N - 1 exactly (digit d becomes 2**32 - 1 - d, the top limb t becomes -1 - t), and adding
    1 to that clears its lowest run of all-ones digits and increments the digit above them."""
    low = lanes < N_LIMBS - 1
    complement = tl.where(low, 0xFFFFFFFF - limbs, tl.where(lanes == N_LIMBS - 1, -1 - limbs, 0))
    first = tl.min(tl.where(low & (complement != 0xFFFFFFFF), lanes, N_LIMBS - 1), axis=1)
    return tl.where(lanes < first[:, None], 0,
                    tl.where(lanes == first[:, None], complement + 1, complement))


@triton.jit
def _bits(limbs, lanes, start, count):
    """Bits [start, start + count) of the normalised nonnegative integer (0 <= count <= 62).

    Each limb's share is cut out and moved to where it lands; the shares are disjoint, so
    their sum is the field."""
    offset = lanes * 32 - start[:, None]  # where a limb's bit 0 lands, counted from start
    width = count[:, None]
    below = limbs >> tl.minimum(tl.maximum(-offset, 0), 63)  # a limb that starts under start
    keep = tl.minimum(tl.maximum(width - offset, 0), 62)
    above = (limbs & ((tl.full([], 1, tl.int64) << keep) - 1)) << tl.minimum(
        tl.maximum(offset, 0), 62)
    share = tl.where(offset < 0, below, tl.where(offset < width, above, 0))
    return tl.sum(share, axis=1) & ((tl.full([], 1, tl.int64) << count) - 1)


@triton.jit
def _any_below(limbs, lanes, position):
    """Whether the normalised nonnegative integer has a set bit below ``position`` (>= -1)."""
    width = position[:, None] - lanes * 32  # how many of a limb's bits lie below position
    cut = limbs & ((tl.full([], 1, tl.int64) << tl.minimum(tl.maximum(width, 0), 62)) - 1)
    return tl.max(tl.where(width >= 32, limbs, cut), axis=1) > 0


@triton.jit
def _bit_length(v):
    """The number of bits of 0 <= v < 2**53: the exponent of its (exact) fp64 conversion."""
    exponent = (v.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1022
    return tl.where(v > 0, exponent, 0)


@triton.jit
def _round_units(limbs, lanes, sticky, PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr,
                 UNIT_EXPONENT: tl.constexpr):
    """RN of N * 2**UNIT_EXPONENT to PRECISION bits with a quantum of at least 2**MIN_QUANTUM
    units, as the bits of an fp64 (exact, or inf past fp64's range).

    ``limbs``: N, normalised and nonnegative. ``sticky``: N stands for a value a little above
    it (a division's nonzero remainder), which breaks a tie upward."""
    top = tl.max(tl.where(limbs != 0, lanes, -1), axis=1)
    top_bits = _bit_length(_lane(limbs, lanes, top[:, None]))
    length = tl.where(top >= 0, top * 32 + top_bits, 0)
    quantum = tl.maximum(length - PRECISION, MIN_QUANTUM)
    significand = _bits(limbs, lanes, quantum, tl.maximum(length - quantum, 0))
    half_at = tl.maximum(quantum - 1, 0)
    half = (quantum > 0) & (half_at < length) & (
        _bits(limbs, lanes, half_at, tl.zeros_like(half_at) + 1) != 0)
    odd = (significand & 1) != 0
    significand += (half & (sticky | odd | _any_below(limbs, lanes, quantum - 1))).to(tl.int64)
    # significand * 2**exponent, with 2**exponent built from its bits (normal or subnormal);
    # a product past fp64's range is inf, set here rather than overflowing a multiply.
    exponent = quantum + UNIT_EXPONENT
    overflow = exponent + _bit_length(significand) > 1024
    exponent = tl.where(overflow, 0, tl.minimum(exponent, 1023))
    normal = ((tl.maximum(exponent, -1022) + 1023) << 52).to(tl.float64, bitcast=True)
    subnormal = (tl.full([], 1, tl.int64) << tl.minimum(tl.maximum(exponent + 1074, 0), 51)).to(
        tl.float64, bitcast=True)
    scale = tl.where(exponent >= -1022, normal, subnormal)
    magnitude = significand.to(tl.float64) * scale
    return tl.where(overflow, _F64_INF_BITS, magnitude.to(tl.int64, bitcast=True))


@triton.jit
def _exact_value(limbs, lanes, count, nan, pinf, ninf, not_neg_zero, REDUCE: tl.constexpr,
                 PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr,
                 UNIT_EXPONENT: tl.constexpr, N_LIMBS: tl.constexpr):
    """The rounded sum (or mean over ``count``) of each column's limbs and flags, as fp64."""
    limbs = _normalise(limbs, lanes, N_LIMBS)
    negative = _lane(limbs, lanes, N_LIMBS - 1) < 0
    limbs = tl.where(negative[:, None], _negate(limbs, lanes, N_LIMBS), limbs)
    if REDUCE == _MEAN:
        # Long division by the count, top limb first (remainder < count <= 2**30, so every
        # partial dividend fits in int64). Quotient digit i goes one lane up, to lane i + 1, and
        # one more step divides the remainder into a 32-bit fraction digit in lane 0: the
        # quotient is then counted in units of 2**-32 units, so that its rounding bit exists
        # even where the result's quantum is one unit (fp32 and fp64 subnormals).
        remainder = tl.zeros_like(negative.to(tl.int64))
        for k in range(N_LIMBS):
            i = N_LIMBS - 1 - k
            partial = (remainder << 32) | tl.sum(tl.where(lanes == i, limbs, 0), axis=1)
            digit = partial // count
            remainder = partial - digit * count
            limbs = tl.where(lanes == i + 1, digit[:, None], limbs)
        partial = remainder << 32
        digit = partial // count
        remainder = partial - digit * count
        limbs = tl.where(lanes == 0, digit[:, None], limbs)
        magnitude = _round_units(limbs, lanes, remainder != 0, PRECISION, MIN_QUANTUM + 32,
                                 UNIT_EXPONENT - 32)
    else:
        magnitude = _round_units(limbs, lanes, negative != negative, PRECISION, MIN_QUANTUM,
                                 UNIT_EXPONENT)
    # A nonzero value that rounds to zero keeps its sign; an exact zero is +0.0 unless every
    # term was -0.0.
    bits = magnitude | tl.where(negative, _SIGN_BIT, 0)
    bits = tl.where(not_neg_zero, bits, _SIGN_BIT)
    bits = tl.where(pinf, _F64_INF_BITS, bits)
    bits = tl.where(ninf, _F64_INF_BITS | _SIGN_BIT, bits)
    bits = tl.where(nan | (pinf & ninf), _F64_NAN_BITS, bits)
    return bits.to(tl.float64, bitcast=True)


@triton.jit
def _f32_to_odd(s):
    """RO_fp32 of the fp64 ``s``: RN, then, where that was inexact and landed on an even
    significand, its odd neighbour on the side of ``s``. Rounding the result to nearest at 8 or
    11 bits (bf16, fp16, both with at least two bits fewer than fp32, subnormals included)
    equals rounding ``s`` once."""
    f = s.to(tl.float32)
    bits = f.to(tl.int32, bitcast=True)  # sign and magnitude: +1 steps away from zero
    back = f.to(tl.float64)
    step = tl.where(tl.abs(s) > tl.abs(back), 1, -1)
    fix = (back != s) & ((bits & _F32_INF_BITS) != _F32_INF_BITS) & ((bits & 1) == 0)
    return tl.where(fix, bits + step, bits).to(tl.float32, bitcast=True)


@triton.jit
def _exact_term(row_base, order_ptr, p, ss1, ss2, cols, mask, alpha, DATA: tl.constexpr,
                ACC: tl.constexpr, HAS_ORDER: tl.constexpr, SCALED: tl.constexpr):
    """The term at position ``p``: RN_acc(A(x) * A(alpha)), or A(x) without a scale."""
    row = p
    if HAS_ORDER:
        row = tl.load(order_ptr + p)
    t = _to_acc(tl.load(row_base + row * ss1 + cols * ss2, mask=mask, other=0), DATA, ACC)
    if SCALED:
        t = t * alpha
    return t


@triton.jit
def _exact_fast_pass(row_base, ss1, ss2, cols, mask, base_at, order_ptr, p0, p1, count, alpha,
                     DATA: tl.constexpr, HAS_ORDER: tl.constexpr, USE_BASE: tl.constexpr,
                     SCALED: tl.constexpr, HEADROOM: tl.constexpr):
    """The fp32 terms (and init) summed in fp64, and per column whether that sum is exact.

    It is when fp64's 53 bits cover the column's spread: every term is a multiple of the ulp of
    the smallest nonzero magnitude, which is at least smallest * 2**-term_bits; every partial
    sum is at most count * largest; fp64 holds every multiple of that ulp up to 2**53 of them,
    and HEADROOM = 2**(52 - term_bits) leaves a factor 2 for the rounding of count * largest.
    Magnitudes compare as their bits (cheaper than floats); an inf or NaN makes the largest
    0x7F800000 or more, which fails the certificate."""
    # -0.0, IEEE's additive identity: a sum of -0.0 stays -0.0.
    total = tl.full(cols.shape, _SIGN_BIT, tl.int64).to(tl.float64, bitcast=True)
    largest = tl.zeros(cols.shape, tl.int32)
    smallest = largest + _NO_MAGNITUDE
    if USE_BASE:
        init = _to_acc(tl.load(base_at, mask=mask, other=0), DATA, tl.float32)
        total = init.to(tl.float64)
        largest = init.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        smallest = tl.where(largest == 0, _NO_MAGNITUDE, largest)
    for p in range(p0, p1):
        t = _exact_term(row_base, order_ptr, p, ss1, ss2, cols, mask, alpha, DATA, tl.float32,
                        HAS_ORDER, SCALED)
        total += t.to(tl.float64)
        magnitude = t.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        largest = tl.maximum(largest, magnitude)
        smallest = tl.minimum(smallest, tl.where(magnitude == 0, _NO_MAGNITUDE, magnitude))
    spread_fits = (count.to(tl.float64) * largest.to(tl.float32, bitcast=True).to(tl.float64)
                   <= smallest.to(tl.float32, bitcast=True).to(tl.float64) * HEADROOM)
    return total, (largest < _F32_INF_BITS) & ((largest == 0) | spread_fits)


@triton.jit
def _deposit_fp64_sum(limbs, lanes, total, take):
    """Add the fp64 ``total``, an exact sum of fp32 values, to the limbs (fp32 units) of the
    columns in ``take``; returns the limbs and whether the sum is anything but -0.0."""
    negative, exponent, fraction = _float_fields(total, tl.float64)
    # A nonzero sum of fp32 values is a multiple of 2**-149, so its fp64 exponent is large
    # enough that a right shift here only drops zero bits.
    shift = exponent - _F64_EXPONENT_OF_FP32_UNIT
    significand = (fraction | (1 << 52)) >> tl.minimum(tl.maximum(-shift, 0), 63)
    significand = tl.where(take & (exponent != 0), significand, 0)
    limbs = _deposit(limbs, lanes, significand, tl.maximum(shift, 0), negative, True)
    return limbs, take & ((negative == 0) | (exponent != 0) | (fraction != 0))


@triton.jit
def _deposit_terms(limbs, lanes, take, nan, pinf, ninf, not_neg_zero, row_base, ss1, ss2, cols,
                   mask, base_at, order_ptr, p0, p1, alpha, DATA: tl.constexpr,
                   ACC: tl.constexpr, HAS_ORDER: tl.constexpr, USE_BASE: tl.constexpr,
                   SCALED: tl.constexpr, N_LIMBS: tl.constexpr, NORMALISE_EVERY: tl.constexpr):
    """Add the init and every term of the columns in ``take`` to their limbs and flags."""
    if USE_BASE:
        init = _to_acc(tl.load(base_at, mask=mask, other=0), DATA, ACC)
        limbs, nan, pinf, ninf, not_neg_zero = _deposit_term(
            limbs, lanes, init, take, nan, pinf, ninf, not_neg_zero, ACC)
    for start in range(p0, p1, NORMALISE_EVERY):
        for p in range(start, tl.minimum(start + NORMALISE_EVERY, p1)):
            t = _exact_term(row_base, order_ptr, p, ss1, ss2, cols, mask, alpha, DATA, ACC,
                            HAS_ORDER, SCALED)
            limbs, nan, pinf, ninf, not_neg_zero = _deposit_term(
                limbs, lanes, t, take, nan, pinf, ninf, not_neg_zero, ACC)
        if start + NORMALISE_EVERY < p1:  # (the last carry is _exact_value's)
            limbs = _normalise(limbs, lanes, N_LIMBS)
    return limbs, nan, pinf, ninf, not_neg_zero


@triton.jit
def _exact_kernel(
    src_ptr, ss0, ss1, ss2, order_ptr, offsets_ptr, base_ptr, bs0, bs1, bs2,
    out_ptr, os0, os1, os2, alpha_ptr, outer, inner,
    REDUCE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr, HAS_ORDER: tl.constexpr,
    HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr, SCALED: tl.constexpr,
    HEADROOM: tl.constexpr, PRECISION: tl.constexpr, MIN_QUANTUM: tl.constexpr,
    UNIT_EXPONENT: tl.constexpr, N_LIMBS: tl.constexpr, LANES: tl.constexpr,
    NORMALISE_EVERY: tl.constexpr, BLOCK: tl.constexpr,
):
    """EXACT: one segment per program (segments are never split), each column block whole."""
    seg = tl.program_id(0).to(tl.int64)
    p0 = tl.load(offsets_ptr + seg)
    p1 = tl.load(offsets_ptr + seg + 1)
    n = p1 - p0
    count = n
    copy_base = n == 0
    if USE_BASE:
        count = n + 1
        copy_base = n < 0  # never: the base row is a term
    alpha = 1.0
    if SCALED:
        alpha = tl.load(alpha_ptr)
    lanes = tl.arange(0, LANES).to(tl.int64)[None, :]
    n_blocks = tl.cdiv(inner, BLOCK)
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        for cb in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
            cols = cb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = cols < inner
            out_at = out_ptr + o * os0 + seg * os1 + cols * os2
            base_at = base_ptr + o * bs0 + seg * bs1 + cols * bs2
            if copy_base:
                if HAS_BASE:
                    tl.store(out_at, tl.load(base_at, mask=mask), mask=mask)
                else:
                    zero = tl.zeros([BLOCK], ACC)
                    tl.store(out_at, _to_data(zero, DATA, out_ptr.dtype.element_ty), mask=mask)
            else:
                row_base = src_ptr + o * ss0
                need = mask  # the columns whose terms go through the limbs
                seeded = cols < 0  # the columns whose exact sum the fast path has (a mean's)
                if ACC == tl.float32:
                    total, certified = _exact_fast_pass(
                        row_base, ss1, ss2, cols, mask, base_at, order_ptr, p0, p1, count, alpha,
                        DATA, HAS_ORDER, USE_BASE, SCALED, HEADROOM)
                    if REDUCE == _SUM:
                        if DATA == _NATIVE:
                            rounded = total.to(tl.float32)
                        else:
                            rounded = _f32_to_odd(total)
                        tl.store(out_at, _to_data(rounded, DATA, out_ptr.dtype.element_ty),
                                 mask=mask & certified)
                    else:
                        seeded = mask & certified
                    need = mask & (certified == 0)
                any_need = tl.max(need.to(tl.int32), axis=0) > 0
                finish = any_need  # a block the fast path wrote whole is done
                if REDUCE == _MEAN:
                    finish = tl.max(mask.to(tl.int32), axis=0) > 0  # every mean divides here
                if finish:
                    limbs = tl.zeros([BLOCK, LANES], tl.int64)
                    nan = cols < 0  # all false
                    pinf = nan
                    ninf = nan
                    not_neg_zero = nan
                    if ACC == tl.float32:
                        if REDUCE == _MEAN:
                            limbs, not_neg_zero = _deposit_fp64_sum(limbs, lanes, total, seeded)
                    if any_need:
                        limbs, nan, pinf, ninf, not_neg_zero = _deposit_terms(
                            limbs, lanes, need, nan, pinf, ninf, not_neg_zero, row_base, ss1,
                            ss2, cols, mask, base_at, order_ptr, p0, p1, alpha, DATA, ACC,
                            HAS_ORDER, USE_BASE, SCALED, N_LIMBS, NORMALISE_EVERY)
                    value = _exact_value(limbs, lanes, count, nan, pinf, ninf, not_neg_zero,
                                         REDUCE, PRECISION, MIN_QUANTUM, UNIT_EXPONENT, N_LIMBS)
                    # The value is the dtype's already (or +-inf, or NaN): converting is exact.
                    tl.store(out_at, _to_data(value.to(ACC), DATA, out_ptr.dtype.element_ty),
                             mask=need | seeded)


# ---- launcher ----------------------------------------------------------------------------------

# Each launch after a specialisation's first calls its compiled kernel directly (see launch.py).
_launch_segment = Kernel(_segment_kernel)
_launch_stride1 = Kernel(_stride1_kernel)
_launch_exact = Kernel(_exact_kernel)

_DATA_CODES = {torch.float32: 0, torch.float64: 0, torch.bfloat16: 1, torch.float16: 2}


# triton.cdiv and triton.next_power_of_2 are constexpr functions in recent Triton releases: a
# few microseconds per call on the host, for an integer division.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the kernels load and store it: bf16 as its int16 bits (a view)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# Each data dtype's accumulator, as torch and as Triton name it.
_ACC_TYPES = {dtype: (_acc_dtype(dtype), _tl_acc(dtype)) for dtype in _DATA_CODES}


# EXACT's rounding targets: (precision, smallest quantum in units, unit exponent, limbs).
_EXACT_TARGETS = {
    torch.float32: (24, 0, -149, EXACT_LIMBS["fp32"]),
    torch.bfloat16: (8, 16, -149, EXACT_LIMBS["fp32"]),
    torch.float16: (11, 125, -149, EXACT_LIMBS["fp32"]),
    torch.float64: (53, 0, -1074, EXACT_LIMBS["fp64"]),
}
# Significant bits of a data element: the terms have that many when alpha == 1 (24 otherwise).
_DATA_BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}
# Limbs held per program (columns x lanes): bounds the registers of the limb state.
_EXACT_STATE_LIMBS = 4096
# Terms between two carries of the limbs (a parameter so that a test can make it small).
_NORMALISE_EVERY = NORMALISE_EVERY


def _segment_reduce_exact(src, order, offsets, base, out, *, reduce, alpha, include_base):
    """``segment_reduce`` for ``rule == EXACT`` (see the module's notes)."""
    if not has_exact_work(src, order, offsets, reduce, _DATA_CODES,
                          include_base and base is not None):
        return
    outer, _, inner = src.shape
    nseg = offsets.shape[0] - 1
    has_order = order is not None
    precision, min_quantum, unit_exponent, n_limbs = _EXACT_TARGETS[src.dtype]
    # One lane more than the limbs: the mean's quotient moves up a lane (see _exact_value).
    lanes = _next_power_of_2(n_limbs + 1)
    acc_dtype = _acc_dtype(src.dtype)
    offsets = offsets.contiguous()
    order = order.contiguous() if has_order else offsets  # never read without HAS_ORDER
    has_base = base is not None
    scaled = float(alpha) != 1.0
    alpha_t = torch.full((1,), float(alpha), dtype=acc_dtype, device=src.device) if scaled else out
    src_s, out_s = _as_stored(src), _as_stored(out)
    base_s = _as_stored(base) if has_base else out_s  # never read without HAS_BASE
    term_bits = 24 if scaled else _DATA_BITS[src.dtype]
    block = min(max(_next_power_of_2(inner), 16), _ROW_BYTES // src.element_size(),
                max(_EXACT_STATE_LIMBS // lanes, 16))
    num_warps = max(1, min(8, block * lanes // 512))
    grid = (nseg, min(_cdiv(inner, block), _MAX_GRID_YZ), min(outer, _MAX_GRID_YZ))
    _launch_exact(
        grid, (src_s, *src_s.stride(), order, offsets, base_s, *base_s.stride(), out_s,
               *out_s.stride(), alpha_t, outer, inner),
        {"REDUCE": int(reduce), "DATA": _DATA_CODES[src.dtype], "ACC": _tl_acc(src.dtype),
         "HAS_ORDER": has_order, "HAS_BASE": has_base,
         "USE_BASE": has_base and bool(include_base), "SCALED": scaled,
         "HEADROOM": 2.0 ** (52 - term_bits), "PRECISION": precision,
         "MIN_QUANTUM": min_quantum, "UNIT_EXPONENT": unit_exponent, "N_LIMBS": n_limbs,
         "LANES": lanes, "NORMALISE_EVERY": _NORMALISE_EVERY, "BLOCK": block},
        num_warps=num_warps,
    )


def segment_reduce(src, order, offsets, base, out, *, reduce, rule, alpha, include_base,
                   carry=None, chunks=None):
    """See the contract in ``detsum.kernels.numba.segment`` and this module's notes; here
    ``offsets`` may also be ``kernels.SortedKeys`` or ``kernels.UncheckedOffsets``, bounds
    that the fp32 / Kahan / torch-order kernels read and check themselves (the others are
    given offsets, checked by torch ops)."""
    given = isinstance(offsets, (SortedKeys, UncheckedOffsets))
    if given and rule in (EXACT, CUDA_STRIDE_1):
        offsets, given = offsets.offsets(), False  # checked there, if still to check
    if rule == EXACT:
        if carry is not None:
            raise ValueError("segment_reduce: the EXACT rule takes no carry")
        _segment_reduce_exact(src, order, offsets, base, out, reduce=reduce, alpha=alpha,
                              include_base=include_base)
        return
    if not has_work(src, order, offsets, _DATA_CODES):
        if given:
            offsets.check()  # no program to make it
        return
    outer, num_rows, inner = src.shape
    failure, check = None, _CHECK_NOTHING.value
    if isinstance(offsets, SortedKeys):
        bounds_kind, bounds, nseg = _KEYS.value, offsets.keys.contiguous(), offsets.num_segments
        failure = offsets.failure
        check = (_CHECK_EVERY if offsets.every_key else _CHECK_ENDS).value
    elif isinstance(offsets, UncheckedOffsets):
        bounds_kind, nseg = _ANY_OFFSETS.value, offsets.values.shape[0] - 1
        failure, check = offsets.failure, _CHECK_EVERY.value
        # Unchecked, their running maximum: nondecreasing bounds, which the chunk programs'
        # searches and tickets need, and the segments that check="off" promises.
        bounds = (offsets.values.contiguous() if failure is not None
                  else torch.cummax(offsets.values, 0).values)
    else:
        bounds_kind, bounds, nseg = _OFFSETS.value, offsets.contiguous(), offsets.shape[0] - 1
    if failure is None:
        check = _CHECK_NOTHING.value
    if rule == CUDA_STRIDE_1 and (inner != 1 or reduce != SUM):
        raise ValueError("segment_reduce: CUDA_STRIDE_1 needs reduce SUM and inner size 1")
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

    if rule == CUDA_STRIDE_1:
        grid = (nseg, min(outer, _MAX_GRID_YZ))
        _launch_stride1(
            grid, (src_s, src_s.stride(0), src_s.stride(1), order, bounds, base_s,
                   base_s.stride(0), base_s.stride(1), out_s, out_s.stride(0), out_s.stride(1),
                   alpha_t, outer),
            {"DATA": data, "ACC": acc_tl, "HAS_ORDER": has_order, "HAS_BASE": has_base,
             "USE_BASE": use_base, "SCALED": scaled},
            num_warps=1,
        )
        return

    # Chunks exist only under a split rule, where some segment can be longer than CHUNK_TERMS:
    # not with more positions than that in all, nor where the caller knows that none is (a
    # plan that read its index back). Unsplit, each segment reduces serially from its init,
    # which is what the split order gives a segment of at most CHUNK_TERMS terms.
    positions = order.shape[0] if has_order else num_rows
    split = (rule in SPLIT_RULES and positions > CHUNK_TERMS
             and not (chunks is not None and chunks[1] == 0))
    ncomp = 2 if rule == KAHAN else 1
    # One chunk program per CHUNK_TERMS positions, two workspace slots each (_chunk_owned).
    n_parts = _cdiv(positions, CHUNK_TERMS) if split else 0
    block, num_warps, grid_yz = _blocking(inner, src.element_size(), outer, _ROW_BYTES,
                                          _MAX_GRID_YZ)
    # The checkers of every bound: one per _CHECK_BLOCK bounds, at most one per slot.
    checked_bounds = bounds.shape[0]
    checkers = (min(_cdiv(checked_bounds, _CHECK_BLOCK.value), nseg + n_parts)
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
    _launch_segment(
        (nseg + n_parts, *grid_yz),
        (src_s, *src_s.stride(), order, bounds, positions, n_parts, base_s, *base_s.stride(),
         out_s, *out_s.stride(), carry_s, *carry_s.stride(), work, alpha_t, flag,
         out if counters is None else counters, checkers, outer, nseg, inner),
        {"REDUCE": int(reduce), "RULE": int(rule), "DATA": data, "ACC": acc_tl,
         "HAS_ORDER": has_order, "HAS_BASE": has_base, "USE_BASE": use_base,
         "HAS_CARRY": has_carry, "SCALED": scaled, "SPLIT": split,
         "FIRST_TERM_START": not use_base and reduce in (AMAX, AMIN), "NCOMP": ncomp,
         "CHUNK": CHUNK_TERMS, "BOUNDS": bounds_kind, "CHECK": check, "BLOCK": block},
        num_warps=num_warps,
    )
    if checked:
        _report(flag, failure, counters)


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


# A launch's tickets (the chunk programs', the checkers'): int64 counters, zero between
# launches, one set per device and stream (launches on one stream run one after the other;
# on two streams they may run at once; a CUDA graph replays its launches with the set of the
# stream it was captured on). Made zero when first needed, and again, larger, when a launch
# needs more: then the old set is kept, since a CUDA graph may have captured a launch that
# uses it.
_TICKET_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []
_MIN_COUNTERS = 4096


def ticket_counters(device: torch.device, size: int) -> torch.Tensor:
    """At least ``size`` ticket counters for a launch on ``device``'s current stream, zero."""
    stream = driver.active.get_current_stream(device.index) if device.type == "cuda" else None
    key = (device, stream)
    counters = _TICKET_COUNTERS.get(key)
    if counters is None or counters.numel() < size:
        held = 0
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
            held = counters.numel()
        counters = torch.zeros(max(size, 2 * held, _MIN_COUNTERS), dtype=torch.int64,
                               device=device)
        _TICKET_COUNTERS[key] = counters
    return counters


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
