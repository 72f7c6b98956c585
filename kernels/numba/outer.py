"""A running sum over rows that are outer products, without forming the rows.

Row ``i`` is ``left[i] (x) right[i]``: the ``[O, K]`` matrix of ``RN_D(left[i, o] *
right[i, k])``, each product rounded once to the data dtype ``D`` (what autograd gives an
``nn.Linear`` weight for one sample: its output gradient times its input, a matrix product
of inner dimension 1). ``resume_products`` continues a running sum ``total`` (and under
KAHAN its compensation ``comp``) over rows ``0 .. n - 1`` in order, exactly as
``segment.segment_reduce`` would with those rows materialised as the terms of one segment,
``total`` as its base and ``comp`` as its carry (rules WIDE and KAHAN, no chunk split: the
caller, ``detsum.RunningSum``, cuts its pieces at the chunk boundaries of the contract).

The arithmetic per element (acc type ``A``): ``t = A(RN_D(left * right))``; WIDE ``s =
RN_A(s + t)``; KAHAN Neumaier's step (``common.neumaier``, the segment kernel's). For bf16
and fp16 data the product is formed in ``A`` (exact there, 8 + 8 and 11 + 11 significant
bits, unless it leaves fp32's range) and rounded to ``D``, as torch's elementwise product of
two such tensors does; for fp32 and fp64 it is one IEEE multiplication. No fused
multiply-add: Numba compiles without fastmath, so LLVM never contracts the product into the
sum.

Why a kernel: materialised, the rows of a batch of 32 samples of a 2048 x 2048 layer are
512 MiB written and read again; here each output row stays in L1 while the samples' rows of
``right`` stream past it from L2, and the work is the sum's own arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from .. import KAHAN, WIDE
from .rounding import bf16_bits_to_f32, f16_bits_to_f32, round_f32_to_bf16, round_f32_to_f16
from .common import _f32, _f64, _flat, launch_threads, neumaier, threads
from .instances import instance

__all__ = ["resume_products"]

#: Fewest products per launch for a second thread to pay its wake-up (see
#: common._MIN_BLOCK_ELEMENTS); only the schedule changes, never a result.
_MIN_PARALLEL_PRODUCTS = 65536


# One output row per iteration of the parallel loop: it owns its elements outright and
# sums each of them over the samples in order, so which thread runs it never matters.
# Four samples per pass over the row: its elements are loaded and stored once per four
# terms, still added one term at a time in order (1.3x faster on the project's VM). One
# kernel per rule, each loop written out: a first version with the rule as a flag tested
# in one kernel (and flat indexing) ran at a quarter of this speed. Each is the template of
# every format's kernel (``instances.instance`` binds ``dec`` and ``rnd``, see _FORMATS).


def _wide(total, left, right, n, rows, cols):
    for o in prange(rows):
        out = total[o * cols:(o + 1) * cols]
        i = 0
        while i + 4 <= n:
            a0 = dec(left[i * rows + o])
            a1 = dec(left[(i + 1) * rows + o])
            a2 = dec(left[(i + 2) * rows + o])
            a3 = dec(left[(i + 3) * rows + o])
            r0 = right[i * cols:(i + 1) * cols]
            r1 = right[(i + 1) * cols:(i + 2) * cols]
            r2 = right[(i + 2) * cols:(i + 3) * cols]
            r3 = right[(i + 3) * cols:(i + 4) * cols]
            for k in range(cols):
                out[k] = (((out[k] + rnd(a0 * dec(r0[k]))) + rnd(a1 * dec(r1[k])))
                          + rnd(a2 * dec(r2[k]))) + rnd(a3 * dec(r3[k]))
            i += 4
        while i < n:
            a = dec(left[i * rows + o])
            r = right[i * cols:(i + 1) * cols]
            for k in range(cols):
                out[k] += rnd(a * dec(r[k]))
            i += 1


def _kahan(total, comp, left, right, n, rows, cols):
    for o in prange(rows):
        out = total[o * cols:(o + 1) * cols]
        out_comp = comp[o * cols:(o + 1) * cols]
        i = 0
        while i + 4 <= n:
            a0 = dec(left[i * rows + o])
            a1 = dec(left[(i + 1) * rows + o])
            a2 = dec(left[(i + 2) * rows + o])
            a3 = dec(left[(i + 3) * rows + o])
            r0 = right[i * cols:(i + 1) * cols]
            r1 = right[(i + 1) * cols:(i + 2) * cols]
            r2 = right[(i + 2) * cols:(i + 3) * cols]
            r3 = right[(i + 3) * cols:(i + 4) * cols]
            for k in range(cols):
                s, c = neumaier(out[k], out_comp[k], rnd(a0 * dec(r0[k])))
                s, c = neumaier(s, c, rnd(a1 * dec(r1[k])))
                s, c = neumaier(s, c, rnd(a2 * dec(r2[k])))
                out[k], out_comp[k] = neumaier(s, c, rnd(a3 * dec(r3[k])))
            i += 4
        while i < n:
            a = dec(left[i * rows + o])
            r = right[i * cols:(i + 1) * cols]
            for k in range(cols):
                out[k], out_comp[k] = neumaier(out[k], out_comp[k], rnd(a * dec(r[k])))
            i += 1


#: Per data format: its name, ``dec`` (a data element to the acc type) and ``rnd`` (an acc
#: value rounded to the data dtype, staying in the acc type), which ``instances.instance``
#: binds in the templates above.
_FORMATS = {
    torch.float32: ("f32", _f32, _f32),
    torch.float64: ("f64", _f64, _f64),
    torch.bfloat16: ("bf16", bf16_bits_to_f32, round_f32_to_bf16),
    torch.float16: ("f16", f16_bits_to_f32, round_f32_to_f16),
}

#: (template, dtype) -> the kernel, made on the first launch that needs it.
_KERNELS = {}


def _kernel_for(template, dtype):
    kernel = _KERNELS.get((template, dtype))
    if kernel is None:
        fmt, dec, rnd = _FORMATS[dtype]
        kernel = instance(template, fmt, parallel=True, dec=dec, rnd=rnd)
        _KERNELS[(template, dtype)] = kernel
    return kernel


def resume_products(total: torch.Tensor, comp: torch.Tensor | None, left: torch.Tensor,
                    right: torch.Tensor, rule: int) -> None:
    """Continue ``total`` (contiguous, ``O * K`` acc-type elements; ``comp`` its KAHAN
    compensation, or None under WIDE) over the rows ``left[i] (x) right[i]``, ``i < n``, in
    order, in place. ``left`` ``[n, O]`` and ``right`` ``[n, K]``: one data dtype, any
    layout (copied to contiguous storage if needed)."""
    if rule not in (WIDE, KAHAN) or (comp is None) != (rule == WIDE):
        raise ValueError(f"resume_products: rule {rule} with comp "
                         f"{'absent' if comp is None else 'given'}; "
                         f"expected WIDE without comp or KAHAN with comp")
    n, rows = left.shape
    cols = right.shape[1]
    if n == 0 or rows == 0 or cols == 0:
        return
    total_np, _ = _flat(total)
    left_np, _ = _flat(left.contiguous())
    right_np, _ = _flat(right.contiguous())
    parallel = rows > 1 and n * rows * cols >= _MIN_PARALLEL_PRODUCTS
    with threads(launch_threads() if parallel else 1):
        if rule == KAHAN:
            _kernel_for(_kahan, left.dtype)(total_np, _flat(comp)[0], left_np, right_np, n, rows,
                                            cols)
        else:
            _kernel_for(_wide, left.dtype)(total_np, left_np, right_np, n, rows, cols)
