"""Triton kernels for detsum's segmented reductions: the GPU backend.

CONTRACT: the one of ``detsum.kernels.numba.segment`` (read it there), with two more rules,
``CUDA_SMALL_STRIDE`` and ``CUDA_STRIDE_1`` (torch's CUDA ``index_put_`` arithmetic; SUM only,
``CUDA_STRIDE_1`` only with inner size 1). ``order`` and ``offsets`` are int64 tensors on the
data's device, and nothing here reads them on the host: a launch never synchronises.

IMPLEMENTATION NOTES (this backend):

- Arithmetic: per output element exactly the steps the Numba contract lists, in the same
  order, including the chunks of ``CHUNK_TERMS`` terms under WIDE and KAHAN. AMAX / AMIN are
  chunked here too (it spreads a hot segment over programs and gives the same bits as the
  serial order: each chunk keeps its earliest NaN or earliest of equal values, and so does the
  fold). No multiply is fused with an add: the launch passes ``enable_fp_fusion=False`` (the
  Triton default fuses ``x * alpha + acc`` into one FMA), and MEAN divides with ``div_rn`` in
  fp32 (Triton's ``/`` on fp32 is an approximate division on NVIDIA GPUs).

- Work split: program ``(slot, column block, outer)``. Slots ``0 .. S-1`` each own a whole
  segment (of at most CHUNK_TERMS terms, or any length under the rules that never split) and
  write its output row. The slots after them own one chunk each of the longer segments and
  write the chunk's acc (and Kahan compensation) to a workspace; a second launch folds each
  long segment's chunks in order and writes its row. Slot -> (segment, chunk) comes from the
  inclusive cumulative count of chunks of long segments (computed on the device) by a binary
  search. Each output element is written by one program, with no atomics, so the result is
  the same on every run, for every grid, block width and number of SMs. Only the column block
  width and the warp count are tuned, and neither takes part in any element's arithmetic.

- Carry (a running Kahan sum, see the contract): the program of a segment's first chunk starts
  ``c`` from ``carry``; the program that writes the segment's row (its whole-segment slot, or
  the fold) writes ``s`` to ``out`` and ``c`` back to ``carry`` instead of the final ``s + c``.

- bf16 travels as int16 bits and is converted with integer operations (why: the Triton
  interpreter's ``.to(tl.bfloat16)`` truncates, and it has no bf16 arithmetic). fp16 uses
  ``.to``, which rounds to nearest even on the GPU and in the interpreter.

- 64-bit: program ids, positions, rows and strides are int64 before any multiply, so tensors
  of more than 2**31 elements are addressed correctly. Grid dimensions 1 and 2 are capped at
  65535 (CUDA's limit) and the programs loop over the rest.

- torch's CUDA stride-1 kernel (slice size 1, 32 or more terms) sums 32 interleaved lanes and
  then a shuffle-down tree; ``_stride1_kernel`` runs it on a 32-wide vector, and the tree as
  five explicit halvings (``reshape`` + ``split``), each a single add per lane, so the pairing
  is exactly torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import (
    AMAX,
    AMIN,
    CHUNK_TERMS,
    CUDA_SMALL_STRIDE,
    CUDA_STRIDE_1,
    KAHAN,
    MEAN,
    PROD,
    ROUND_EACH,
    SPLIT_RULES,
    SUM,
    WIDE,
    has_work,
)

__all__ = ["segment_reduce"]

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
    """Combine the term rows at positions p_begin .. p_end - 1, in order."""
    for p in range(p_begin, p_end):
        if HAS_ORDER:
            row = tl.load(order_ptr + p)
        else:
            row = p
        x = _to_acc(tl.load(row_base + row * ss1 + cols * ss2, mask=mask, other=0), DATA, ACC)
        acc, comp = _combine(acc, comp, x, alpha, REDUCE, RULE, DATA, SCALED)
    return acc, comp


@triton.jit
def _find_segment(parts_cum_ptr, nseg, e):
    """The segment owning chunk slot ``e``: the first s with parts_cum[s] > e."""
    lo = tl.zeros([], tl.int64)
    hi = lo + nseg - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(parts_cum_ptr + mid) > e:
            hi = mid
        else:
            lo = mid + 1
    return lo


# ---- kernels -----------------------------------------------------------------------------------

@triton.jit
def _segment_kernel(
    src_ptr, ss0, ss1, ss2, order_ptr, offsets_ptr, parts_cum_ptr,
    base_ptr, bs0, bs1, bs2, out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2,
    work_ptr, work_rows, alpha_ptr, outer, nseg, inner,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_BASE: tl.constexpr, USE_BASE: tl.constexpr,
    HAS_CARRY: tl.constexpr, SCALED: tl.constexpr, SPLIT: tl.constexpr,
    FIRST_TERM_START: tl.constexpr, NCOMP: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Whole segments (slot < nseg) and chunks of long segments (the slots after)."""
    slot = tl.program_id(0).to(tl.int64)
    total_parts = 0
    if SPLIT:
        total_parts = tl.load(parts_cum_ptr + nseg - 1)
    if slot >= nseg + total_parts:
        return
    is_chunk = slot >= nseg
    e = slot - nseg
    seg = slot
    if is_chunk:
        seg = _find_segment(parts_cum_ptr, nseg, e)
    p0 = tl.load(offsets_ptr + seg)
    p1 = tl.load(offsets_ptr + seg + 1)
    n = p1 - p0
    if SPLIT:
        is_long = n > CHUNK
    else:
        is_long = n < 0  # never: these rules keep every segment whole
    if is_long & (slot < nseg):
        return  # the chunk programs own this segment
    n_chunks = (n + CHUNK - 1) // CHUNK
    j = tl.zeros([], tl.int64)
    if is_chunk:
        j = e - (tl.load(parts_cum_ptr + seg) - n_chunks)
    p_begin = p0 + j * CHUNK
    p_end = p1
    if is_long:
        p_end = tl.minimum(p1, p_begin + CHUNK)
    # A later chunk starts from its first term; so does an amax / amin without a base row.
    from_first = (j > 0) | FIRST_TERM_START
    count = n
    if USE_BASE:
        count = n + 1
    alpha = 1.0
    if SCALED:
        alpha = tl.load(alpha_ptr)
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
                if is_long:
                    work_at = work_ptr + ((o * work_rows + e) * NCOMP) * inner + cols
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
def _fold_kernel(
    offsets_ptr, parts_cum_ptr, out_ptr, os0, os1, os2, carry_ptr, cs0, cs1, cs2,
    work_ptr, work_rows, outer, nseg, inner,
    REDUCE: tl.constexpr, RULE: tl.constexpr, DATA: tl.constexpr, ACC: tl.constexpr,
    USE_BASE: tl.constexpr, HAS_CARRY: tl.constexpr, NCOMP: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Fold the chunks of each long segment, in order; the program of its first chunk does it."""
    e = tl.program_id(0).to(tl.int64)
    if e >= tl.load(parts_cum_ptr + nseg - 1):
        return
    seg = _find_segment(parts_cum_ptr, nseg, e)
    n = tl.load(offsets_ptr + seg + 1) - tl.load(offsets_ptr + seg)
    n_chunks = (n + CHUNK - 1) // CHUNK
    first = tl.load(parts_cum_ptr + seg) - n_chunks
    if e != first:
        return
    count = n
    if USE_BASE:
        count = n + 1
    n_blocks = tl.cdiv(inner, BLOCK)
    for o in range(tl.program_id(2).to(tl.int64), outer, tl.num_programs(2)):
        for cb in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
            cols = cb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            mask = cols < inner
            work_at = work_ptr + ((o * work_rows + first) * NCOMP) * inner + cols
            acc = tl.load(work_at, mask=mask, other=0)
            comp = tl.zeros([BLOCK], ACC)
            if NCOMP == 2:
                comp = tl.load(work_at + inner, mask=mask, other=0)
            for k in range(1, n_chunks):
                part_at = work_at + k * NCOMP * inner
                part = tl.load(part_at, mask=mask, other=0)
                part_comp = tl.zeros([BLOCK], ACC)
                if NCOMP == 2:
                    part_comp = tl.load(part_at + inner, mask=mask, other=0)
                acc, comp = _fold(acc, comp, part, part_comp, REDUCE, RULE)
            out_at = out_ptr + o * os0 + seg * os1 + cols * os2
            if HAS_CARRY:
                tl.store(out_at, acc, mask=mask)
                tl.store(carry_ptr + o * cs0 + seg * cs1 + cols * cs2, comp, mask=mask)
            else:
                value = _finish(acc, comp, acc, count, REDUCE, RULE, DATA, ACC)
                tl.store(out_at, _to_data(value, DATA, out_ptr.dtype.element_ty), mask=mask)


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


# ---- launcher ----------------------------------------------------------------------------------

_DATA_CODES = {torch.float32: 0, torch.float64: 0, torch.bfloat16: 1, torch.float16: 2}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the kernels load and store it: bf16 as its int16 bits (a view)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def segment_reduce(src, order, offsets, base, out, *, reduce, rule, alpha, include_base,
                   carry=None):
    """See the contract in ``detsum.kernels.numba.segment`` and this module's notes."""
    if not has_work(src, order, offsets, _DATA_CODES):
        return
    outer, num_rows, inner = src.shape
    nseg = offsets.shape[0] - 1
    if rule == CUDA_STRIDE_1 and (inner != 1 or reduce != SUM):
        raise ValueError("segment_reduce: CUDA_STRIDE_1 needs reduce SUM and inner size 1")
    if rule == CUDA_SMALL_STRIDE and reduce != SUM:
        raise ValueError("segment_reduce: CUDA_SMALL_STRIDE needs reduce SUM")
    acc_dtype = _acc_dtype(src.dtype)
    data = _DATA_CODES[src.dtype]
    offsets = offsets.contiguous()
    has_order = order is not None
    order = order.contiguous() if has_order else offsets  # never read without HAS_ORDER
    has_base = base is not None
    use_base = has_base and bool(include_base)
    scaled = float(alpha) != 1.0
    # torch.full rounds alpha to the acc type on the device: no host-to-device copy.
    alpha_t = torch.full((1,), float(alpha), dtype=acc_dtype, device=src.device) if scaled else out
    src_s, out_s = _as_stored(src), _as_stored(out)
    base_s = _as_stored(base) if has_base else out_s  # never read without HAS_BASE
    has_carry = carry is not None
    carry_s = carry if has_carry else out_s  # never touched without HAS_CARRY
    acc_tl = _tl_acc(src.dtype)

    if rule == CUDA_STRIDE_1:
        grid = (nseg, min(outer, _MAX_GRID_YZ))
        _stride1_kernel[grid](
            src_s, src_s.stride(0), src_s.stride(1), order, offsets,
            base_s, base_s.stride(0), base_s.stride(1), out_s, out_s.stride(0), out_s.stride(1),
            alpha_t, outer,
            DATA=data, ACC=acc_tl, HAS_ORDER=has_order, HAS_BASE=has_base,
            USE_BASE=use_base, SCALED=scaled, num_warps=1, enable_fp_fusion=False,
        )
        return

    split = rule in SPLIT_RULES
    ncomp = 2 if rule == KAHAN else 1
    if split:
        # Chunks of the segments longer than CHUNK_TERMS, counted on the device. Each such
        # segment of n terms has ceil(n / C) < 2n / C chunks, so 2 M // C slots cover them all.
        positions = order.shape[0] if has_order else num_rows
        work_rows = 2 * positions // CHUNK_TERMS
        counts = offsets[1:] - offsets[:-1]
        parts = torch.where(counts > CHUNK_TERMS, (counts + CHUNK_TERMS - 1) // CHUNK_TERMS, 0)
        parts_cum = torch.cumsum(parts, 0)
        work = torch.empty((outer, max(work_rows, 1), ncomp, inner), dtype=acc_dtype,
                           device=src.device)
    else:
        work_rows = 0
        parts_cum = offsets  # never read without SPLIT
        work = out  # never written without SPLIT
    block = min(max(triton.next_power_of_2(inner), 16), _ROW_BYTES // src.element_size())
    num_warps = max(1, min(8, block * src.element_size() // 512))
    grid_yz = (min(triton.cdiv(inner, block), _MAX_GRID_YZ), min(outer, _MAX_GRID_YZ))
    common = dict(REDUCE=int(reduce), RULE=int(rule), DATA=data, ACC=acc_tl, NCOMP=ncomp,
                  CHUNK=CHUNK_TERMS, BLOCK=block, num_warps=num_warps,
                  enable_fp_fusion=False)
    _segment_kernel[(nseg + work_rows, *grid_yz)](
        src_s, *src_s.stride(), order, offsets, parts_cum,
        base_s, *base_s.stride(), out_s, *out_s.stride(), carry_s, *carry_s.stride(),
        work, work_rows, alpha_t, outer, nseg, inner,
        HAS_ORDER=has_order, HAS_BASE=has_base, USE_BASE=use_base, HAS_CARRY=has_carry,
        SCALED=scaled,
        SPLIT=split, FIRST_TERM_START=not use_base and reduce in (AMAX, AMIN), **common,
    )
    if split and work_rows > 0:
        _fold_kernel[(work_rows, *grid_yz)](
            offsets, parts_cum, out_s, *out_s.stride(), carry_s, *carry_s.stride(), work,
            work_rows, outer, nseg, inner, USE_BASE=use_base, HAS_CARRY=has_carry, **common,
        )
