"""Mixture-of-experts token permutation with a backward that is deterministic and, on request,
bit-identical to autograd.

A top-k MoE layer sends each of ``T`` tokens to ``topk`` experts. ``route`` sorts the ``T * topk``
(token, slot) pairs by expert; ``permute`` gathers the token rows in that order (each token
``topk`` times); ``unpermute`` brings expert outputs back to (token, slot) order and, by
default, combines each token's ``topk`` rows, weighted by the routing probabilities.

Flat slot ``j = t * topk + k`` is slot ``k`` of token ``t``; ``gather_indices[p]`` is the flat slot
at permuted position ``p``, so ``gather_indices // topk`` are the token ids of the permuted rows.

This module owns no kernel: every sum is a ``detsum.segment_sum`` over the ``topk`` rows of a
token, fetched through its ``perm`` argument (a gather inside the kernel, no copy of the rows).
The modes mean what they mean for the primitives:

- ``"autograd"``: bit-identical to autograd of the naive torch composition on the same device
  (``x[gather_indices // topk]`` for ``permute``; ``index_copy`` then
  ``(u.view(T, topk, H) * weights[..., None]).sum(1)`` for ``unpermute``);
- ``"fp32"`` / ``"kahan"``: products and sums in fp32 (compensated for ``"kahan"``), one
  rounding to the dtype: closer to the exact result than autograd.

The combined rows of ``unpermute`` have torch's promoted dtype of the rows and the weights in
every mode (bf16 rows with fp32 routing weights give fp32, as the naive composition does), and
fp32 weights are never rounded to the rows' dtype, forward or backward.
"""

from __future__ import annotations

import math

import torch

from detsum import _dispatch, _segments, _validation
from detsum.modes import Mode, acc_dtype, parse_mode

__all__ = ["permute", "route", "unpermute"]


# ---- routing ------------------------------------------------------------------------------------

def route(selected_experts: torch.Tensor, num_experts: int, *, check: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert: the permutation ``permute`` and ``unpermute`` use.

    Args:
        selected_experts: ``[T, topk]`` (or ``[T]`` for top-1) int32/int64 expert ids.
        num_experts: the number of experts ``E``.
        check: verify that every id lies in ``[0, E)`` (one host read of two numbers).

    Returns:
        ``(gather_indices, tokens_per_expert)``: ``gather_indices`` [T * topk] int64 is the
        stable argsort of ``selected_experts.view(-1)`` (expert by expert; within an expert,
        tokens in order), ``tokens_per_expert`` [E] int64 the rows each expert receives.
        Computed on the tensor's device with no host synchronisation besides the check.

    Example:
        >>> import torch
        >>> from detsum import moe
        >>> moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
        (tensor([1, 0, 2, 3]), tensor([1, 2, 1]))
    """
    caller = "detsum.moe.route"
    _validation.check_index(caller, "selected_experts", selected_experts, one_d=False)
    _validation.check_flag(caller, "check", check)
    if selected_experts.dim() > 2:
        raise ValueError(f"{caller}: selected_experts must be [T, topk] or [T], got shape "
                         f"{tuple(selected_experts.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{caller}: num_experts={num_experts!r}; expected a positive int")
    flat = selected_experts.reshape(-1)
    experts, gather_indices = torch.sort(flat, stable=True)
    if check and flat.numel():
        low, high = experts[[0, -1]].tolist()
        if low < 0 or high >= num_experts:
            _validation.raise_first_out_of_range(caller, "selected_experts", selected_experts,
                                                 num_experts, "num_experts")
    boundaries = torch.arange(num_experts + 1, dtype=flat.dtype, device=flat.device)
    starts = torch.searchsorted(experts, boundaries)
    return gather_indices, starts[1:] - starts[:-1]


# ---- shared index plumbing ----------------------------------------------------------------------

def _slot_positions(gather_indices: torch.Tensor) -> torch.Tensor:
    """positions[j] = p with gather_indices[p] == j: where each (token, slot) row sits. Only for
    a gather_indices already verified to be a permutation."""
    n = gather_indices.numel()
    positions = torch.empty(n, dtype=torch.int64, device=gather_indices.device)
    return positions.scatter_(0, gather_indices.to(torch.int64),
                              torch.arange(n, device=gather_indices.device))


def _token_offsets(num_tokens: int, topk: int, device) -> torch.Tensor:
    return torch.arange(num_tokens + 1, device=device) * topk


def _check_bounds(caller: str, gather_indices: torch.Tensor) -> None:
    """0 <= gather_indices < T * topk: one fused min/max pass and one host read, no sort."""
    n = gather_indices.numel()
    if n == 0:
        return
    low, high = torch.stack(list(torch.aminmax(gather_indices))).tolist()
    if low < 0 or high >= n:
        _validation.raise_first_out_of_range(caller, "gather_indices", gather_indices, n,
                                             "T * topk")


def _check_permutation(caller: str, gather_indices: torch.Tensor) -> torch.Tensor:
    """Verify that gather_indices holds each of 0 .. n-1 once and return its inverse (as
    ``_slot_positions``): one O(n) scatter and one host read, no sort.

    n values that all lie in [0, n) and together reach all n slots are a permutation, so the
    bounds and the coverage of the inverse are the whole check. An out-of-range value writes to
    a spare slot n, never outside the buffer, so the check itself cannot fail in torch's words.
    """
    n = gather_indices.numel()
    device = gather_indices.device
    in_range = (gather_indices >= 0) & (gather_indices < n)
    slots = torch.where(in_range, gather_indices, n).to(torch.int64)
    positions = torch.full((n + 1,), -1, dtype=torch.int64, device=device)
    positions = positions.scatter_(0, slots, torch.arange(n, device=device))[:n]
    out_of_range, slot_without_row = torch.stack(
        [~in_range.all(), (positions < 0).any()]).tolist()
    if out_of_range:
        _validation.raise_first_out_of_range(caller, "gather_indices", gather_indices, n,
                                             "T * topk")
    if slot_without_row:
        values = torch.sort(gather_indices).values
        repeated = int(values[1:][values[1:] == values[:-1]][0])
        raise ValueError(f"{caller}: gather_indices holds {repeated} more than once; expected a "
                         f"permutation of 0 .. T * topk - 1 = {n - 1} (as route() returns)")
    return positions


def _check_topk(caller: str, topk: object) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"{caller}: topk={topk!r}; expected a positive int")


def _check_common(caller, rows_name, rows, gather_indices, mode, n_expected):
    """Mode, and gather_indices' dtype, shape and device (its values are checked in the ops)."""
    mode = parse_mode(mode, caller=caller)
    _validation.check_index(caller, "gather_indices", gather_indices, one_d=True)
    if gather_indices.shape[0] != n_expected:
        raise ValueError(f"{caller}: gather_indices has length {gather_indices.shape[0]}; "
                         f"expected T * topk = {n_expected}")
    _validation.check_same_device(caller, **{rows_name: rows, "gather_indices": gather_indices})
    return mode


# ---- permute ------------------------------------------------------------------------------------

@torch.library.custom_op("detsum::moe_permute", mutates_args=())
def permute_op(x: torch.Tensor, gather_indices: torch.Tensor, topk: int, acc_mode: str,
               check: bool) -> torch.Tensor:
    # The index checks read values back, so they run here, inside the operator: under
    # torch.compile they run with it instead of breaking the graph.
    if check:
        _check_permutation("detsum.moe.permute", gather_indices)
    else:
        _check_bounds("detsum.moe.permute", gather_indices)
    return x.index_select(0, gather_indices // topk)


@permute_op.register_fake
def _(x, gather_indices, topk, acc_mode, check):
    return x.new_empty((gather_indices.shape[0],) + tuple(x.shape[1:]))


def _permute_setup(ctx, inputs, output):
    x, gather_indices, topk, acc_mode, check = inputs
    ctx.save_for_backward(gather_indices)
    ctx.num_tokens, ctx.topk, ctx.acc_mode = x.shape[0], topk, acc_mode


def _permute_backward(ctx, grad):
    (gather_indices,) = ctx.saved_tensors
    # Each token's rows in increasing permuted position: the order in which autograd's
    # index_put_ meets them, and so the canonical order of every mode. A stable sort by token
    # finds them without assuming a permutation: under check=False a repeated value is allowed,
    # and its token then has more rows (and another fewer), each summed all the same.
    tokens = gather_indices // ctx.topk
    sorted_tokens, token_rows = torch.sort(tokens, stable=True)
    boundaries = torch.arange(ctx.num_tokens + 1, dtype=tokens.dtype, device=tokens.device)
    # Offsets and rows built here, right by construction: nothing to check, nothing read back.
    grad_x = torch.ops.detsum.segment_sum(
        grad, torch.searchsorted(sorted_tokens, boundaries), 0, token_rows, ctx.acc_mode, "off")
    return grad_x, None, None, None, None


permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


def permute(x: torch.Tensor, gather_indices: torch.Tensor, topk: int, *,
            mode: str | Mode = "fp32", check: bool = True) -> torch.Tensor:
    """Gather token rows into expert order: ``y[p] = x[gather_indices[p] // topk]``.

    Args:
        x: ``[T, ...]`` token rows, float32/float16/bfloat16/float64.
        gather_indices: ``[T * topk]``, a permutation of ``0 .. T * topk - 1`` (from ``route``).
        topk: slots per token.
        mode: how backward sums each token's ``topk`` gradient rows: ``"fp32"`` (default),
            ``"kahan"`` or ``"autograd"``.
        check: True: verify that ``gather_indices`` is a permutation (one O(T * topk) scatter
            and one host read). False, for a hot loop once the routing is known to be right:
            verify only ``0 <= gather_indices < T * topk`` (one min/max pass and one host
            read, as every detsum primitive reads its index bounds back), and allow a value
            to repeat (see below).

    Returns:
        ``[T * topk, ...]``. Forward is an exact gather in every mode.

    Raises:
        IndexError: a value of ``gather_indices`` outside ``[0, T * topk)``, named with its
            position, whatever ``check`` is; before anything is computed.
        ValueError: with ``check=True``, a repeated value; before anything is computed.

    The bounds are checked even with ``check=False`` because an out-of-range value is the one
    mistake that would otherwise surface in torch's words (CPU) or as a device-side assert
    (CUDA); the permutation check proper is what the flag skips. Without it, a repeated value
    is no hazard: ``permute`` is a gather, defined for any index in range, and its backward
    sums each token's gradient rows whatever their number (it never inverts the
    permutation), so the result and the gradient are exactly those of
    ``x[gather_indices // topk]``.

    Backward: ``grad_x[t]`` sums the ``topk`` rows ``grad_y[p]`` with
    ``gather_indices[p] // topk == t`` in increasing ``p`` (the order autograd meets them),
    starting from 0: ``"autograd"`` rounds to the dtype after every add as torch's
    ``index_put_`` does (on CUDA: torch's CUDA arithmetic, see the determinism contract), so
    it is bit-identical to the gradient of ``x[gather_indices // topk]``; ``"fp32"``
    accumulates in fp32 and rounds once; ``"kahan"`` compensates as well. Deterministic in
    every mode.

    Example:
        >>> import torch
        >>> from detsum import moe
        >>> gather_indices, _ = moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
        >>> moe.permute(torch.tensor([[1.0], [2.0]]), gather_indices, 2)
        tensor([[1.],
                [1.],
                [2.],
                [2.]])
    """
    mode = _validation.run_check(_check_permute, x, gather_indices, topk, mode, check)
    return permute_op(x, gather_indices, topk, mode.value, check)


def _check_permute(x, gather_indices, topk, mode, check):
    caller = "detsum.moe.permute"
    _check_topk(caller, topk)
    _validation.check_float(caller, "x", x)
    _validation.check_flag(caller, "check", check)
    return _check_common(caller, "x", x, gather_indices, mode, x.shape[0] * topk)


# ---- unpermute ----------------------------------------------------------------------------------

def _combined_dtype(y: torch.Tensor, weights: torch.Tensor | None) -> torch.dtype:
    """The dtype of the combined rows: torch's promotion of ``y * weights``, the dtype the naive
    composition returns (bf16 rows and fp32 weights give fp32)."""
    return y.dtype if weights is None else torch.promote_types(y.dtype, weights.dtype)


def _sum_mode(acc_mode: str) -> str:
    # The naive composition sums the topk rows with torch's sum(dim=1): an fp32 accumulator,
    # slot by slot, one rounding. That is the arithmetic of detsum's "fp32" mode.
    return "fp32" if acc_mode == Mode.AUTOGRAD.value else acc_mode


def _weighted_rows(y: torch.Tensor, position_weights: torch.Tensor, out_dtype: torch.dtype,
                   acc_mode: str) -> torch.Tensor:
    """y[p] * w[p]: as torch multiplies for "autograd" (in the promoted dtype, so fp32 weights
    are never rounded to y's dtype), else in the accumulator type."""
    shape = (-1,) + (1,) * (y.dim() - 1)
    if acc_mode == Mode.AUTOGRAD.value:
        return y * position_weights.view(shape)
    # Both factors convert to the accumulator exactly (it is at least as wide as either), and
    # the multiply promotes y on the fly: one pass, one rounding per product.
    return y * position_weights.to(acc_dtype(out_dtype)).view(shape)


#: The weighted unpermute's products, per block of tokens, on CPU (about 2 MB: they stay in
#: the cache between the multiply and the sum). One buffer of all products was a pass through
#: memory each way (512 MB at T=16384, top-8, H=1024) and made the forward 1.6x and the
#: backward 3.8x the naive composition.
_PRODUCT_BLOCK_BYTES = 1 << 21


def _blocked(device: torch.device, acc_mode: str) -> bool:
    """Whether the weighted unpermute runs by blocks of tokens: on CPU, where the cache is what
    a pass through memory costs, and for "fp32"/"kahan" ("autograd" is torch's own
    composition). Each token's sum and each row's dot product involve its own rows only, so
    the blocks give the same bits as one pass."""
    return device.type == "cpu" and acc_mode != Mode.AUTOGRAD.value


def _rows_per_block(features: int, acc: torch.dtype) -> int:
    return max(1, _PRODUCT_BLOCK_BYTES // (max(1, features) * acc.itemsize))


def _segment_sum_body(rows: torch.Tensor, offsets: torch.Tensor, dim: int,
                      acc_mode: str) -> torch.Tensor:
    # The operator's body, called within this operator's own body: the dispatcher has done its
    # work once already, and a block costs about what a dispatch does. The offsets are built
    # here, right by construction: nothing to check, nothing read back.
    from detsum.ops.segment_sum import _segment_sum

    return _segment_sum(rows, offsets, dim, None, acc_mode, "off")


def _weighted_sum_by_blocks(y: torch.Tensor, positions: torch.Tensor,
                            slot_weights: torch.Tensor, topk: int, out_dtype: torch.dtype,
                            acc_mode: str) -> torch.Tensor:
    """out[t] = the sum over k of RN_acc(acc(y[positions[t * topk + k]]) * acc(w[t, k])), in
    order of k, per block of tokens: the products of ``_weighted_rows`` and the sum of
    ``segment_sum``, block by block."""
    acc = acc_dtype(out_dtype)
    num_tokens = positions.numel() // topk
    features = math.prod(y.shape[1:])
    tokens_per_block = max(1, _rows_per_block(features, acc) // topk)
    weights_acc = slot_weights.to(acc).view((-1,) + (1,) * (y.dim() - 1))
    offsets = _token_offsets(min(tokens_per_block, num_tokens), topk, y.device)
    out = torch.empty((num_tokens,) + tuple(y.shape[1:]), dtype=acc, device=y.device)
    for t0 in range(0, num_tokens, tokens_per_block):
        t1 = min(num_tokens, t0 + tokens_per_block)
        slots = slice(t0 * topk, t1 * topk)
        # Converting first is exact; the multiply then rounds once in acc, as y * w_acc does.
        products = y.index_select(0, positions[slots]).to(acc).mul_(weights_acc[slots])
        out[t0:t1] = _segment_sum_body(products, offsets[:t1 - t0 + 1], 0, acc_mode)
    return out


@torch.library.custom_op("detsum::moe_unpermute", mutates_args=())
def unpermute_op(y: torch.Tensor, gather_indices: torch.Tensor, topk: int,
                 weights: torch.Tensor | None, reduce: bool, acc_mode: str) -> torch.Tensor:
    # Checked inside the operator (it reads values back), and in every case: see unpermute.
    positions = _check_permutation("detsum.moe.unpermute", gather_indices)
    if not reduce:
        return y.index_select(0, positions)
    num_tokens = y.shape[0] // topk
    out_dtype = _combined_dtype(y, weights)
    if weights is not None and _blocked(y.device, acc_mode):
        return _weighted_sum_by_blocks(y, positions, weights.reshape(-1), topk, out_dtype,
                                       acc_mode).to(out_dtype)
    rows = y
    if weights is not None:
        rows = _weighted_rows(y, weights.reshape(-1).index_select(0, gather_indices), out_dtype,
                              acc_mode)
    # The offsets are built here and the positions are checked: nothing to check again,
    # nothing read back.
    out = torch.ops.detsum.segment_sum(rows, _token_offsets(num_tokens, topk, y.device), 0,
                                       positions, _sum_mode(acc_mode), "off")
    return out.to(out_dtype)


@unpermute_op.register_fake
def _(y, gather_indices, topk, weights, reduce, acc_mode):
    if not reduce:
        return y.new_empty(y.shape)
    return y.new_empty((y.shape[0] // topk,) + tuple(y.shape[1:]),
                       dtype=_combined_dtype(y, weights))


def _unpermute_setup(ctx, inputs, output):
    y, gather_indices, topk, weights, reduce, acc_mode = inputs
    ctx.save_for_backward(y, gather_indices, weights)
    ctx.topk, ctx.reduce, ctx.acc_mode = topk, reduce, acc_mode


def _unpermute_backward(ctx, grad):
    y, gather_indices, weights = ctx.saved_tensors
    if not ctx.reduce:
        return grad.index_select(0, gather_indices), None, None, None, None, None
    # Every permuted row p received its token's gradient row (times its weight). grad has the
    # output's dtype: the promoted one when weights are wider than y.
    tokens = gather_indices // ctx.topk
    if weights is None:
        return grad.index_select(0, tokens), None, None, None, None, None
    position_weights = weights.reshape(-1).index_select(0, gather_indices)
    if _blocked(y.device, ctx.acc_mode):
        # A plain eager backward calls the operator's body itself (see detsum/_dispatch.py).
        gradients = (_weighted_gradients_by_blocks
                     if _dispatch.direct_call_ok(grad, y, tokens, position_weights)
                     else _weighted_backward_by_blocks)
        grad_y, dots = gradients(grad, y, tokens, position_weights, ctx.acc_mode)
        grad_weights = dots.index_select(0, _slot_positions(gather_indices))
        return (grad_y, None, None, grad_weights.view(weights.shape).to(weights.dtype), None,
                None)
    grad_rows = grad.index_select(0, tokens)
    # torch's multiply backward: g * w in the promoted dtype (the exact product rounded once),
    # then rounded to y's dtype, a second rounding only when that is narrower (bf16 rows, fp32
    # weights). The same bits in every mode; the weights themselves are never rounded.
    grad_y = (grad_rows * position_weights.view((-1,) + (1,) * (grad.dim() - 1))).to(y.dtype)
    # d out[t] / d w[t, k] = <grad[t], y[p]>: a dot product over the features. (Their count
    # is spelled out: a reshape to -1 is ambiguous when there are no rows.)
    features = math.prod(y.shape[1:])
    if ctx.acc_mode == Mode.AUTOGRAD.value:
        # torch leaves the order of this sum open (on CPU it follows the vector width), so only
        # its own reduction, the one autograd runs to fold the broadcast weights' gradient,
        # gives autograd's bits: products rounded to grad's dtype, torch's sum over features.
        dots = (grad_rows * y).reshape(y.shape[0], features).sum(1)
    else:
        # In order, in the accumulator ("kahan": compensated), rounded once.
        products = grad_rows.to(acc_dtype(grad.dtype)).mul_(y)  # exact for half grad and y
        products = products.reshape(y.shape[0], features)
        dots = torch.ops.detsum.segment_sum(
            products, _segments.one_segment(products.shape[1], y.device), 1, None,
            ctx.acc_mode, "off").view(-1)
    grad_weights = dots.index_select(0, _slot_positions(gather_indices))
    return grad_y, None, None, grad_weights.view(weights.shape).to(weights.dtype), None, None


def _weighted_gradients_by_blocks(grad: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor,
                                  position_weights: torch.Tensor, acc_mode: str
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_y, dots) of ``_unpermute_backward``, per block of permuted rows: the same
    elementwise products and per-row sums, never more than a block of them in memory. The
    body of ``_weighted_backward_by_blocks``."""
    acc = acc_dtype(grad.dtype)
    features = math.prod(y.shape[1:])
    rows_per_block = _rows_per_block(features, acc)
    scale_shape = (-1,) + (1,) * (grad.dim() - 1)
    grad_y = torch.empty_like(y, memory_format=torch.contiguous_format)
    dots = torch.empty(y.shape[0], dtype=acc, device=y.device)
    one_segment = _segments.one_segment(features, y.device)
    for p0 in range(0, y.shape[0], rows_per_block):
        block = slice(p0, min(y.shape[0], p0 + rows_per_block))
        grad_rows = grad.index_select(0, tokens[block])
        # The product in grad's dtype, then (the copy) rounded to y's, as in one pass.
        grad_y[block] = grad_rows * position_weights[block].view(scale_shape)
        # (The row count spelled out: a reshape to -1 is ambiguous when there are no features.)
        products = grad_rows.to(acc).mul_(y[block]).reshape(grad_rows.shape[0], features)
        # Feature-major, each row's sum over its features is a sum of contiguous rows, which
        # the kernel reads in place: 0.8 ns a product with the transposing copy, against 1.6
        # for the kernel's strided read of row-major products (one element per cache line).
        dots[block] = _segment_sum_body(products.T.contiguous(), one_segment, 0,
                                        acc_mode).view(-1)
    return grad_y, dots


@torch.library.custom_op("detsum::moe_unpermute_weighted_backward", mutates_args=())
def _weighted_backward_by_blocks(grad: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor,
                                 position_weights: torch.Tensor, acc_mode: str
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """An operator of its own, so that a compiled backward sees one call, not a loop of
    blocks."""
    return _weighted_gradients_by_blocks(grad, y, tokens, position_weights, acc_mode)


@_weighted_backward_by_blocks.register_fake
def _(grad, y, tokens, position_weights, acc_mode):
    return (torch.empty_like(y, memory_format=torch.contiguous_format),
            y.new_empty(y.shape[0], dtype=acc_dtype(grad.dtype)))


unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def unpermute(y: torch.Tensor, gather_indices: torch.Tensor, topk: int, *,
              weights: torch.Tensor | None = None, reduce: bool = True,
              mode: str | Mode = "fp32", check: bool = True) -> torch.Tensor:
    """Bring expert-ordered rows back to their tokens, and combine each token's ``topk`` rows.

    Args:
        y: ``[T * topk, ...]`` rows in expert order (as ``permute`` made them).
        gather_indices: ``[T * topk]``, a permutation of ``0 .. T * topk - 1`` (from ``route``).
        topk: slots per token.
        weights: ``[T, topk]`` routing probabilities (any float dtype, not necessarily ``y``'s),
            or None for plain sums. Only with ``reduce=True``.
        reduce: True: ``[T, ...]``, ``out[t] = sum_k weights[t, k] * y[position of (t, k)]``.
            False: ``[T * topk, ...]`` in (token, slot) order, ``out[gather_indices[p]] = y[p]``
            (exact).
        mode: ``"fp32"`` (default), ``"kahan"`` or ``"autograd"``.
        check: kept for symmetry with ``permute``; ``unpermute`` verifies ``gather_indices``
            either way. It inverts the permutation anyway, and verifying the inverse costs one
            host read on top of it (no sort); a slot that no row reaches would leave its
            output undefined, so that check is never skipped.

    Returns:
        ``reduce=True`` with weights: dtype ``torch.promote_types(y.dtype, weights.dtype)``,
        torch's type promotion and so the dtype of the naive composition below (bf16 rows and
        fp32 weights give fp32), in every mode, so that a change of mode never changes a dtype
        downstream. Otherwise ``y``'s dtype.

    Raises:
        IndexError: a value of ``gather_indices`` outside ``[0, T * topk)``, named with its
            position; before anything is computed.
        ValueError: a repeated value (whatever ``check`` is); before anything is computed.

    Order and rounding of ``reduce=True`` (slots ``k = 0 .. topk - 1`` in order, from 0), with
    ``R`` the output dtype and ``acc`` its accumulator (fp32; fp64 when ``R`` is float64).
    Weights are never rounded to ``y``'s dtype: fp32 weights stay fp32, forward and backward.

    - ``"autograd"``: what the naive composition computes,
      ``u = torch.empty_like(y).index_copy(0, gather_indices, y)`` then
      ``(u.view(T, topk, H) * weights[..., None]).sum(1)``: each product as torch's multiply
      computes it (in ``R``, one rounding), the products summed in ``acc``, one rounding to
      ``R`` (checked bit for bit on CPU, for every pair of dtypes). torch 2.13's CPU sum over
      the slots of fp32/fp64 products is serial only up to 17 slots; from ``topk = 18`` it
      adds them in blocks of 16, which this mode does not reproduce.
    - ``"fp32"``: products and sum in ``acc``, one rounding to ``R``.
    - ``"kahan"``: products in ``acc``, Neumaier-compensated sum, one rounding: within 1 ulp
      of the exact sum of those products.

    A product in ``acc`` is exact when ``y`` and the weights are both half precision
    (fp16/bf16); bf16 rows times fp32 weights, or fp32 times fp32, round it once to fp32.
    When ``R`` is fp32 or fp64, ``"fp32"`` is the same arithmetic as ``"autograd"``.

    Gradients: ``grad_y[p] = grad[t] * weights[t, k]`` as torch's multiply computes it (in
    ``R``, one rounding), then rounded to ``y``'s dtype (a second rounding only when ``R`` is
    wider, as autograd does): bit-identical to autograd's in every mode.
    ``grad_weights[t, k] = <grad[t], y[p]>``, the dot product over the features: in
    ``"fp32"``/``"kahan"`` summed in order in ``acc`` (``"kahan"``: compensated) and rounded
    once to the weights' dtype, from products in ``acc`` (exact when ``grad`` and ``y`` are
    both half precision). In ``"autograd"`` each product is rounded to ``R``, as torch's
    broadcast multiply does, and summed by torch's own ``sum`` over the features, the reduction
    autograd runs there, then rounded to the weights' dtype: autograd's bits. torch leaves that
    sum's order unspecified (on CPU it follows the vector width of the machine), so this one
    sum is torch's rather than detsum's; it is still the same on every run and thread count
    (``tests/test_moe.py`` checks 1 and 2 threads).

    **Deterministic in every mode.**

    Example:
        >>> import torch
        >>> from detsum import moe
        >>> gather_indices, _ = moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
        >>> y = torch.tensor([[10.0], [20.0], [30.0], [40.0]])
        >>> moe.unpermute(y, gather_indices, 2, weights=torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
        tensor([[15.],
                [30.]])

        bf16 rows with fp32 weights give fp32, from the weights' fp32 values (rounded to bf16
        first, 1/3 and 2/3 would make the first row 13.375):

        >>> w = torch.tensor([[1 / 3, 2 / 3], [1.0, 0.0]])
        >>> moe.unpermute(y.bfloat16(), gather_indices, 2, weights=w)
        tensor([[13.3333],
                [30.0000]])
    """
    mode = _validation.run_check(_check_unpermute, y, gather_indices, topk, weights, reduce,
                                 mode, check)
    return unpermute_op(y, gather_indices, topk, weights, reduce, mode.value)


def _check_unpermute(y, gather_indices, topk, weights, reduce, mode, check):
    caller = "detsum.moe.unpermute"
    _check_topk(caller, topk)
    _validation.check_float(caller, "y", y)
    _validation.check_flag(caller, "reduce", reduce)
    _validation.check_flag(caller, "check", check)
    if y.shape[0] % topk:
        raise ValueError(f"{caller}: y has {y.shape[0]} rows; expected a multiple of "
                         f"topk = {topk} (T * topk rows)")
    mode = _check_common(caller, "y", y, gather_indices, mode, y.shape[0])
    if weights is not None:
        if not reduce:
            raise ValueError(f"{caller}: weights apply to the combined rows; pass reduce=True "
                             f"or weights=None")
        _validation.check_float(caller, "weights", weights)
        expected = (y.shape[0] // topk, topk)
        if tuple(weights.shape) != expected and not (topk == 1 and weights.dim() == 1
                                                     and weights.shape[0] == expected[0]):
            raise ValueError(f"{caller}: weights has shape {tuple(weights.shape)}; expected "
                             f"[T, topk] = {list(expected)}")
        _validation.check_same_device(caller, y=y, weights=weights)
    return mode
