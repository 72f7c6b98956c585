"""The Triton kernel of the ``CUDA_STRIDE_1`` rule: torch's CUDA ``index_put_`` arithmetic for a
slice size of 1 (``indexing_backward_kernel_stride_1``), SUM only, inner size 1.

``segment_reduce_stride1`` takes the arguments of ``segment.segment_reduce`` (read the contract
there) for ``rule == CUDA_STRIDE_1``, with offsets; ``segment.segment_reduce`` hands it such
launches.

IMPLEMENTATION NOTES (this backend; ``common.py`` has those every kernel here shares):

- torch's CUDA stride-1 kernel (slice size 1, 32 or more terms) sums 32 interleaved lanes and
  then a shuffle-down tree; ``_stride1_kernel`` runs it on a 32-wide vector, and the tree as
  five explicit halvings (``reshape`` + ``split``), each a single add per lane, so the pairing
  is exactly torch's. One program per segment: the segments are never split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import SUM, has_work
from .common import (
    _ACC_TYPES,
    _DATA_CODES,
    _MAX_GRID_YZ,
    _as_stored,
    _round_to_data,
    _to_acc,
    _to_data,
)
from .launch import Kernel

__all__ = ["segment_reduce_stride1"]

_WARP = tl.constexpr(32)


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

# Each launch after a specialisation's first calls its compiled kernel directly (see launch.py).
_launch_stride1 = Kernel(_stride1_kernel)


def segment_reduce_stride1(src, order, offsets, base, out, *, reduce, alpha, include_base):
    """``segment.segment_reduce`` for ``rule == CUDA_STRIDE_1`` (see the module's notes)."""
    if not has_work(src, order, offsets, _DATA_CODES):
        return
    outer, _, inner = src.shape
    if inner != 1 or reduce != SUM:
        raise ValueError("segment_reduce: CUDA_STRIDE_1 needs reduce SUM and inner size 1")
    nseg = offsets.shape[0] - 1
    bounds = offsets.contiguous()
    acc_dtype, acc_tl = _ACC_TYPES[src.dtype]
    has_order = order is not None
    order = order.contiguous() if has_order else bounds  # never read without HAS_ORDER
    has_base = base is not None
    scaled = float(alpha) != 1.0
    # torch.full rounds alpha to the acc type on the device: no host-to-device copy.
    alpha_t = torch.full((1,), float(alpha), dtype=acc_dtype, device=src.device) if scaled else out
    src_s, out_s = _as_stored(src), _as_stored(out)
    base_s = _as_stored(base) if has_base else out_s  # never read without HAS_BASE
    _launch_stride1(
        (nseg, min(outer, _MAX_GRID_YZ)),
        (src_s, src_s.stride(0), src_s.stride(1), order, bounds, base_s, base_s.stride(0),
         base_s.stride(1), out_s, out_s.stride(0), out_s.stride(1), alpha_t, outer),
        {"DATA": _DATA_CODES[src.dtype], "ACC": acc_tl, "HAS_ORDER": has_order,
         "HAS_BASE": has_base, "USE_BASE": has_base and bool(include_base), "SCALED": scaled},
        num_warps=1,
    )
