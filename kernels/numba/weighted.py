"""The weighted combination of MoE rows and its weight gradient, without a buffer of products.

- ``gather_scale_sum``: ``out[t] = sum over j < topk of RN_A(A(y[positions[t * topk + j]]) *
  w[t * topk + j])``, the terms in order of ``j``, as ``segment.segment_reduce`` sums the rows
  of those products (one segment per token, no base: the sum starts from +0.0), under rule
  WIDE or KAHAN (with its final ``s + c``). ``topk <= CHUNK_TERMS``: one chunk per token.
- ``row_dots``: ``dots[p] = sum over h of RN_A(g[tokens[p], h] * A(y[p, h]))``, the features in
  order, cut into the contract's chunks of ``CHUNK_TERMS`` terms (each later chunk summed from
  its own first term, then folded), as ``segment_reduce`` sums the columns of the products'
  transpose.

``A`` is the acc type (fp32 for bf16, fp16 and fp32 rows, fp64 for fp64); ``w`` and ``g``
arrive in it. Each product is one multiplication in ``A``, rounded once, as ``y.to(A) * w``
rounds it. No fused multiply-add: Numba compiles without fastmath.

Why: the products, formed, were written and read again (block by block to stay in cache);
here each row of ``y`` is read once and each product is consumed where it is made.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from .. import CHUNK_TERMS, KAHAN, WIDE
from .rounding import bf16_bits_to_f32, f16_bits_to_f32
from .common import _f32, _f64, _flat, kahan_result, launch_threads, neumaier, threads
from .instances import instance

__all__ = ["gather_scale_sum", "row_dots"]

#: Fewest products per launch for a second thread to pay its wake-up (see
#: common._MIN_BLOCK_ELEMENTS); only the schedule changes, never a result.
_MIN_PARALLEL_PRODUCTS = 65536


def _forward(out, y, positions, weights, tokens, topk, cols):
    """``gather_scale_sum``'s kernel: the template of every format's and rule's
    (``instances.instance`` binds ``kahan`` and the format's ``dec`` and ``cvt``)."""
    # A token's output row is its own: which thread sums it never matters.
    for t in prange(tokens):
        row = out[t * cols:(t + 1) * cols]
        zero = cvt(0.0)
        for h in range(cols):
            row[h] = zero
        if kahan:
            comp = np.zeros(cols, dtype=out.dtype)
            for j in range(topk):
                p = positions[t * topk + j]
                w = weights[t * topk + j]
                src = y[p * cols:(p + 1) * cols]
                for h in range(cols):
                    row[h], comp[h] = neumaier(row[h], comp[h], dec(src[h]) * w)
            for h in range(cols):
                row[h] = kahan_result(row[h], comp[h])
        else:
            for j in range(topk):
                p = positions[t * topk + j]
                w = weights[t * topk + j]
                src = y[p * cols:(p + 1) * cols]
                for h in range(cols):
                    row[h] += dec(src[h]) * w


def _dots(out, grad, tokens, y, rows, cols):
    """``row_dots``' kernel: the template of every format's and rule's (as ``_forward``)."""
    for p in prange(rows):
        g = grad[tokens[p] * cols:(tokens[p] + 1) * cols]
        r = y[p * cols:(p + 1) * cols]
        s = cvt(0.0)
        c = cvt(0.0)
        first_end = min(cols, CHUNK_TERMS)
        if kahan:
            for h in range(first_end):
                s, c = neumaier(s, c, g[h] * dec(r[h]))
        else:
            for h in range(first_end):
                s += g[h] * dec(r[h])
        start = first_end
        while start < cols:
            end = min(cols, start + CHUNK_TERMS)
            part = g[start] * dec(r[start])
            part_comp = cvt(0.0)
            if kahan:
                for h in range(start + 1, end):
                    part, part_comp = neumaier(part, part_comp, g[h] * dec(r[h]))
                s, c = neumaier(s, c, part)
                c = c + part_comp
            else:
                for h in range(start + 1, end):
                    part += g[h] * dec(r[h])
                s = s + part
            start = end
        if kahan:
            s = kahan_result(s, c)
        out[p] = s


#: Per data format: its name and its conversions (see ``segment._make_rows``).
_FORMATS = {
    torch.float32: ("f32", _f32, _f32),
    torch.float64: ("f64", _f64, _f64),
    torch.bfloat16: ("bf16", bf16_bits_to_f32, _f32),
    torch.float16: ("f16", f16_bits_to_f32, _f32),
}

#: (template, dtype, kahan) -> the kernel, made on the first launch that needs it.
_KERNELS = {}


def _kernel_for(template, dtype, kahan):
    kernel = _KERNELS.get((template, dtype, kahan))
    if kernel is None:
        fmt, dec, cvt = _FORMATS[dtype]
        kernel = instance(template, f"{fmt}_{'kahan' if kahan else 'wide'}", parallel=True,
                          kahan=kahan, dec=dec, cvt=cvt)
        _KERNELS[(template, dtype, kahan)] = kernel
    return kernel


def _check_rule(rule: int) -> bool:
    if rule not in (WIDE, KAHAN):
        raise ValueError(f"weighted kernels: rule {rule}; expected WIDE or KAHAN")
    return rule == KAHAN


def _check_rows(name: str, numbers: torch.Tensor, count: int) -> None:
    """The kernels read rows by these numbers without bounds checks: one out of range would
    read outside the tensor, so it is refused here (the callers never pass one)."""
    if numbers.numel():
        low, high = torch.aminmax(numbers)
        if int(low) < 0 or int(high) >= count:
            raise IndexError(f"weighted kernels: {name} holds {int(low)} .. {int(high)}; "
                             f"expected row numbers in [0, {count})")


def gather_scale_sum(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor,
                     topk: int, rule: int) -> torch.Tensor:
    """``out`` ``[T, *y.shape[1:]]`` in the acc type (see the module docstring). ``y``: rows
    of any dtype; ``positions``: ``T * topk`` row numbers (int64); ``weights``: ``T * topk``
    values in the acc type, slot order. ``topk`` at most CHUNK_TERMS."""
    kahan = _check_rule(rule)
    if topk > CHUNK_TERMS:
        raise ValueError(f"gather_scale_sum: topk={topk} exceeds one chunk ({CHUNK_TERMS})")
    tokens = positions.numel() // topk
    cols = y[0].numel() if y.shape[0] else int(np.prod(y.shape[1:]))
    out = torch.empty((tokens,) + tuple(y.shape[1:]), dtype=weights.dtype)
    if tokens == 0 or cols == 0:
        return out.zero_()
    _check_rows("positions", positions, y.shape[0])
    forward = _kernel_for(_forward, y.dtype, kahan)
    parallel = tokens > 1 and tokens * topk * cols >= _MIN_PARALLEL_PRODUCTS
    with threads(launch_threads() if parallel else 1):
        forward(_flat(out)[0], _flat(y.contiguous())[0], _flat(positions.contiguous())[0],
                _flat(weights.contiguous())[0], tokens, topk, cols)
    return out


def row_dots(grad: torch.Tensor, tokens: torch.Tensor, y: torch.Tensor, rule: int
             ) -> torch.Tensor:
    """``dots`` ``[P]`` in the acc type: row ``p`` of ``y`` (``[P, ...]``, any dtype) against
    row ``tokens[p]`` of ``grad`` (``[T, ...]``, the acc type) (see the module docstring)."""
    kahan = _check_rule(rule)
    rows = y.shape[0]
    cols = int(np.prod(y.shape[1:]))
    out = torch.empty(rows, dtype=grad.dtype)
    if rows == 0:
        return out
    if cols == 0:
        return out.zero_()
    _check_rows("tokens", tokens, grad.shape[0])
    dots = _kernel_for(_dots, y.dtype, kahan)
    parallel = rows > 1 and rows * cols >= _MIN_PARALLEL_PRODUCTS
    with threads(launch_threads() if parallel else 1):
        dots(_flat(out)[0], _flat(grad.contiguous())[0], _flat(tokens.contiguous())[0],
             _flat(y.contiguous())[0], rows, cols)
    return out
