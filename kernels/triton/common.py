"""What detsum's Triton kernels share (``segment.py``, ``stride1.py``, ``exact.py``, ``moe.py``):
the codes of the reductions, rules and data formats as the kernels read them, the conversions
between a data element and the acc type, one step of each reduction (``_combine``, ``_fold``,
``_finish``: the segment kernel's arithmetic, which ``moe.py`` repeats bit for bit), and the
launchers' host arithmetic.

- bf16 travels as int16 bits and is converted with integer operations (why: the Triton
  interpreter's ``.to(tl.bfloat16)`` truncates, and it has no bf16 arithmetic). fp16 uses
  ``.to``, which rounds to nearest even on the GPU and in the interpreter.

- 64-bit: program ids, positions, rows and strides are int64 before any multiply, so tensors
  of more than 2**31 elements are addressed correctly. Grid dimensions 1 and 2 are capped at
  65535 (CUDA's limit) and the programs loop over the rest.

- Launch: through ``launch.Kernel``, which calls a specialisation's compiled kernel directly
  after its first launch, for about 10 us of host time where Triton's ``JITFunction.run``
  takes 20-25 us (see launch.py); in Triton's interpreter, as ``kernel[grid](...)``. The
  launchers' host arithmetic is plain Python for the same reason.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import AMAX, AMIN, CUDA_SMALL_STRIDE, KAHAN, MEAN, PROD, ROUND_EACH, SUM, acc_dtype

# Triton kernels may only read module globals that are constexpr.
_SUM = tl.constexpr(SUM)
_MEAN = tl.constexpr(MEAN)
_PROD = tl.constexpr(PROD)
_AMAX = tl.constexpr(AMAX)
_AMIN = tl.constexpr(AMIN)
_KAHAN = tl.constexpr(KAHAN)
_ROUND_EACH = tl.constexpr(ROUND_EACH)
_SMALL_STRIDE = tl.constexpr(CUDA_SMALL_STRIDE)

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
        divisor = tl.zeros_like(acc) + count.to(ACC)
        if RULE == _ROUND_EACH:
            # torch's scatter_reduce mean rounds the sum to the dtype first, and counts in the
            # dtype (the count rounded once: 257 is 256 in bfloat16).
            acc = _round_to_data(acc, DATA)
            divisor = _round_to_data(divisor, DATA)
        if ACC == tl.float64:
            acc = acc / divisor
        else:
            acc = tl.math.div_rn(acc, divisor)
    return acc


# ---- the launchers' host arithmetic ------------------------------------------------------------

_DATA_CODES = {torch.float32: 0, torch.float64: 0, torch.bfloat16: 1, torch.float16: 2}


# triton.cdiv and triton.next_power_of_2 are constexpr functions in recent Triton releases: a
# few microseconds per call on the host, for an integer division.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


_acc_dtype = acc_dtype


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the kernels load and store it: bf16 as its int16 bits (a view)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# Each data dtype's accumulator, as torch and as Triton name it.
_ACC_TYPES = {dtype: (_acc_dtype(dtype), _tl_acc(dtype)) for dtype in _DATA_CODES}
