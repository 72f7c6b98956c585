"""Triton kernels of ``detsum.moe``: a routing's tables, and the weighted combination of MoE
rows with its gradients, each in one launch.

- ``route_tables``: from the stable sort of the expert ids (``experts`` ascending, ``gather``
  its indices), everything ``permute`` and ``unpermute`` use, forward and backward: the
  inverse permutation (``positions[gather[p]] = p``), the token of each sorted row
  (``gather[p] // topk``), each token's rows in increasing position (the canonical order of
  permute's backward: a token's slot ``k`` sits before slot ``k'`` when its expert id is
  smaller, or equal with ``k < k'``, as the stable sort placed them), the token offsets
  ``t * topk``, ``tokens_per_expert`` (ids below 0 or from ``E`` up counted by no expert, as
  ``torch.searchsorted`` on the sorted ids counts them) and whether every id lies in
  ``[0, E)``.
- ``gather_scale_sum``: the twin of ``detsum.kernels.numba.weighted.gather_scale_sum``.
- ``weighted_gradients_by_slot``: for each row ``p`` of ``y``, with ``j = slots[p]`` its flat
  slot and ``t = j // topk`` its token: ``grad_y[p] = RN_y(RN_R(grad[t] * w[j]))`` (torch's
  multiply in the output dtype ``R``, then rounded to y's dtype), and the dot product
  ``sum over h of RN_A(grad[t, h] * y[p, h])`` in the contract's chunks, as
  ``detsum.kernels.numba.weighted.row_dots`` sums it, rounded once to the weights' dtype and
  stored at ``j`` (``BY_SLOT``: the slots are a permutation, so each is written once) or at
  ``p``.

The arithmetic is the segment kernel's (``_combine``, ``_fold``, ``_finish`` of ``common.py``):
the same steps, in the same order, with FMA contraction off (``launch.Kernel``), so the bits
are those of the segment kernel summing the formed products.

Work split: route, one lane per sorted row (and per token offset, per expert); the forward,
a program per token and block of features; the backward, a lane per row, the features one
after another (the dot product's order). Every output element is written by one lane, with no
atomics: the same bits for every grid and GPU. The backward's per-row loop reads each row with
a stride of the row length across lanes: its bandwidth is for the kernels' own issue.

Why: formed, the products are written and read again, and every product, gather and sort is a
launch of its own; an MoE layer took about 40 device ops (benches/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import CHUNK_TERMS
from .launch import Kernel
from .common import (
    _DATA_CODES,
    _SUM,
    _as_stored,
    _cdiv,
    _combine,
    _finish,
    _fold,
    _next_power_of_2,
    _round_to_data,
    _tl_acc,
    _to_acc,
    _to_data,
)

__all__ = ["gather_scale_sum", "route_tables", "weighted_gradients_by_slot"]

_BLOCK = 128


# ---- a routing's tables --------------------------------------------------------------------------

@triton.jit
def _ids_below(experts_ptr, n, value, steps, mask):
    """How many of the ascending ``experts[0 .. n)`` are below ``value`` (lane by lane)."""
    lo = tl.zeros_like(value)
    hi = lo + n
    for _ in range(steps):
        active = (lo < hi) & mask
        mid = (lo + hi) // 2
        below = tl.load(experts_ptr + mid, mask=active, other=0).to(tl.int64) < value
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    return lo


@triton.jit
def _route_kernel(experts_ptr, gather_ptr, selected_ptr, positions_ptr, counts_ptr, table_ptr,
                  n, num_tokens, num_experts, topk, steps, CLAMPED: tl.constexpr,
                  TOPK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Lane ``i`` fills entry ``i`` of each table that has one (see ``route_tables``).
    CLAMPED: the sorted ids are the ids clamped into ``[-1, num_experts]``
    (``kernels.sort_by_segment``), and a token's ids are compared with them clamped too."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok_ptr = table_ptr
    tokens_ptr = ok_ptr + 1
    token_rows_ptr = tokens_ptr + n
    offsets_ptr = token_rows_ptr + n

    is_row = i < n
    j = tl.load(gather_ptr + i, mask=is_row, other=0)
    tl.store(positions_ptr + j, i, mask=is_row)
    t = j // topk
    k = j - t * topk
    tl.store(tokens_ptr + i, t, mask=is_row)
    # The rank of this slot among its token's: slots of a smaller id, or of an equal id and
    # a smaller slot number, sit before it in the stable sort.
    e = tl.load(experts_ptr + i, mask=is_row, other=0).to(tl.int64)
    others = tl.arange(0, TOPK_BLOCK).to(tl.int64)
    in_token = is_row[:, None] & (others[None, :] < topk)
    other_e = tl.load(selected_ptr + t[:, None] * topk + others[None, :], mask=in_token,
                      other=0).to(tl.int64)
    if CLAMPED:
        other_e = tl.minimum(tl.maximum(other_e, -1), num_experts)
    before = (other_e < e[:, None]) | ((other_e == e[:, None]) & (others[None, :] < k[:, None]))
    rank = tl.sum((before & in_token).to(tl.int64), axis=1)
    tl.store(token_rows_ptr + t * topk + rank, i, mask=is_row)

    tl.store(offsets_ptr + i, i * topk, mask=i <= num_tokens)

    is_expert = i < num_experts
    counts = (_ids_below(experts_ptr, n, i + 1, steps, is_expert)
              - _ids_below(experts_ptr, n, i, steps, is_expert))
    tl.store(counts_ptr + i, counts, mask=is_expert)

    # The sort put the smallest id first and the largest last.
    has_ids = (i == 0) & (i < n)
    low = tl.load(experts_ptr + i, mask=has_ids, other=0).to(tl.int64)
    high = tl.load(experts_ptr + (n - 1) + i, mask=has_ids, other=0).to(tl.int64)
    ok = (low >= 0) & (high < num_experts)
    tl.store(ok_ptr + i, ok.to(tl.int64), mask=i == 0)


_launch_route = Kernel(_route_kernel)


def route_tables(experts: torch.Tensor, gather: torch.Tensor, selected: torch.Tensor,
                 topk: int, num_experts: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions, tokens_per_expert, table)``, int64, for the ``n = T * topk`` ids
    ``selected`` (contiguous, flat, slot order), sorted stably into ``experts`` with indices
    ``gather``; ``table`` is ``[ok (1) | tokens (n) | token_rows (n) | token_offsets
    (T + 1)]``. ``experts`` of a narrower dtype than ``selected`` are the ids clamped into
    ``[-1, E]`` before their sort (``kernels.sort_by_segment``): a token's slots are then
    ranked by their clamped ids, in the order that sort gave them."""
    n = gather.numel()
    num_tokens = n // topk
    positions = torch.empty(n, dtype=torch.int64, device=gather.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=gather.device)
    table = torch.empty(1 + 2 * n + num_tokens + 1, dtype=torch.int64, device=gather.device)
    lanes = max(n, num_tokens + 1, num_experts, 1)
    _launch_route((_cdiv(lanes, _BLOCK),),
                  (experts, gather, selected, positions, counts, table, n, num_tokens,
                   num_experts, topk, n.bit_length() + 1),
                  {"CLAMPED": experts.dtype != selected.dtype,
                   "TOPK_BLOCK": _next_power_of_2(topk), "BLOCK": _BLOCK}, num_warps=4)
    return positions, counts, table


# ---- the weighted combination ------------------------------------------------------------------

@triton.jit
def _weighted_sum_kernel(y_ptr, positions_ptr, weights_ptr, out_ptr, topk, cols,
                         RULE: tl.constexpr, DATA: tl.constexpr, W_DATA: tl.constexpr,
                         ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Token ``program_id(0)``, a block of its columns: its ``topk`` products in slot order."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = c < cols
    acc = tl.zeros([BLOCK], ACC)
    comp = tl.zeros([BLOCK], ACC)
    for k in range(topk):
        p = tl.load(positions_ptr + t * topk + k)
        w = _to_acc(tl.load(weights_ptr + t * topk + k), W_DATA, ACC)
        x = _to_acc(tl.load(y_ptr + p * cols + c, mask=mask, other=0), DATA, ACC) * w
        acc, comp = _combine(acc, comp, x, 1.0, _SUM, RULE, DATA, False)
    value = _finish(acc, comp, acc, topk, _SUM, RULE, DATA, ACC)
    tl.store(out_ptr + t * cols + c, value, mask=mask)


_launch_weighted_sum = Kernel(_weighted_sum_kernel)


def gather_scale_sum(y: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor,
                     topk: int, rule: int, acc: torch.dtype) -> torch.Tensor:
    """``out`` ``[T, *y.shape[1:]]`` in ``acc`` (see ``detsum.kernels.numba.weighted``):
    ``weights`` in slot order, of any float dtype (converted exactly to ``acc`` in the
    kernel); ``positions`` ``T * topk`` row numbers in range."""
    num_tokens = positions.numel() // topk
    cols = y[0].numel() if y.shape[0] else 1
    out = torch.empty((num_tokens,) + tuple(y.shape[1:]), dtype=acc, device=y.device)
    if num_tokens == 0 or out.numel() == 0:
        return out.zero_()
    block = min(max(_next_power_of_2(cols), 16), 512)
    _launch_weighted_sum((num_tokens, _cdiv(cols, block)),
                         (_as_stored(y.contiguous()), positions.contiguous(),
                          _as_stored(weights.contiguous()), out, topk, cols),
                         {"RULE": rule, "DATA": _DATA_CODES[y.dtype],
                          "W_DATA": _DATA_CODES[weights.dtype], "ACC": _tl_acc(acc),
                          "BLOCK": block},
                         num_warps=4)
    return out


@triton.jit
def _weighted_gradients_kernel(grad_ptr, y_ptr, slots_ptr, weights_ptr, grad_y_ptr, dots_ptr,
                               rows, topk, cols, RULE: tl.constexpr, DATA: tl.constexpr,
                               G_DATA: tl.constexpr, W_DATA: tl.constexpr, ACC: tl.constexpr,
                               BY_SLOT: tl.constexpr, CHUNK: tl.constexpr,
                               BLOCK: tl.constexpr):
    """A block of rows, one per lane; the features one after the other, in order."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = p < rows
    j = tl.load(slots_ptr + p, mask=mask, other=0)
    t = j // topk
    w = _to_acc(tl.load(weights_ptr + j, mask=mask, other=0), W_DATA, ACC)
    s = tl.zeros([BLOCK], ACC)
    c = tl.zeros([BLOCK], ACC)
    part = tl.zeros([BLOCK], ACC)
    part_comp = tl.zeros([BLOCK], ACC)
    for h in range(cols):
        g = _to_acc(tl.load(grad_ptr + t * cols + h, mask=mask, other=0), G_DATA, ACC)
        yh = _to_acc(tl.load(y_ptr + p * cols + h, mask=mask, other=0), DATA, ACC)
        # torch's multiply rounds g * w to the output dtype, the copy then to y's.
        scaled = _round_to_data(g * w, G_DATA)
        tl.store(grad_y_ptr + p * cols + h, _to_data(scaled, DATA, grad_y_ptr.dtype.element_ty),
                 mask=mask)
        product = g * yh
        # The contract's chunks: the first sums from 0, each later one from its first term,
        # and is folded in when it ends.
        if h < CHUNK:
            s, c = _combine(s, c, product, 1.0, _SUM, RULE, DATA, False)
        else:
            if h % CHUNK == 0:
                part = product
                part_comp = tl.zeros([BLOCK], ACC)
            else:
                part, part_comp = _combine(part, part_comp, product, 1.0, _SUM, RULE, DATA,
                                           False)
            if (h % CHUNK == CHUNK - 1) | (h == cols - 1):
                s, c = _fold(s, c, part, part_comp, _SUM, RULE)
    value = _finish(s, c, s, cols, _SUM, RULE, DATA, ACC)
    dot_at = p
    if BY_SLOT:
        dot_at = j
    tl.store(dots_ptr + dot_at, _to_data(value, W_DATA, dots_ptr.dtype.element_ty), mask=mask)


_launch_weighted_gradients = Kernel(_weighted_gradients_kernel)


def weighted_gradients_by_slot(grad: torch.Tensor, y: torch.Tensor, slots: torch.Tensor,
                               weights: torch.Tensor, topk: int, rule: int, by_slot: bool
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_y, dots)``: ``grad_y`` of ``y``'s shape and dtype, ``dots`` of ``weights``'
    dtype, one per slot (``by_slot``: ``slots`` is a permutation) or per row (see the module
    docstring). ``grad`` ``[T, ...]`` in the output dtype, ``weights`` ``T * topk`` in slot
    order, ``slots`` in range."""
    rows = y.shape[0]
    cols = y[0].numel() if rows else 1
    grad_y = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dots = torch.empty(weights.numel() if by_slot else rows, dtype=weights.dtype,
                       device=y.device)
    if rows == 0 or cols == 0:
        return grad_y, dots.zero_()
    acc = _tl_acc(grad.dtype)
    _launch_weighted_gradients((_cdiv(rows, _BLOCK),),
                               (_as_stored(grad.contiguous()), _as_stored(y.contiguous()),
                                slots.contiguous(), _as_stored(weights.contiguous()),
                                _as_stored(grad_y), _as_stored(dots), rows, topk, cols),
                               {"RULE": rule, "DATA": _DATA_CODES[y.dtype],
                                "G_DATA": _DATA_CODES[grad.dtype],
                                "W_DATA": _DATA_CODES[weights.dtype], "ACC": acc,
                                "BY_SLOT": by_slot, "CHUNK": CHUNK_TERMS, "BLOCK": _BLOCK},
                               num_warps=4)
    return grad_y, dots

