"""Slow, obviously correct loops for every detsum primitive: the oracle the tests compare with.

Everything here is written from the determinism contract (``docs/determinism.md``) and from nothing else.
It shares no code with the kernels on purpose: no counting sort, no integer rounding tricks.

- Rounding is a torch dtype conversion: ``t.to(torch.bfloat16)`` (or float16, float32) rounds to
  nearest, ties to even; that is the contract's ``RN_dtype``.
- Arithmetic is one torch fp32 / fp64 tensor op per step of the contract, so every step rounds exactly once
  (``RN_acc``). Nothing is fused: ``a * b + c`` is written as two ops.
- Each output element is independent of the others, so the loops run on a whole row of columns
  at once, but segments and the terms inside a segment are visited in plain Python, in canonical
  order (order of appearance along ``dim``), so each loop can be read against the contract line by line.

Rules (the contract's arithmetic per segment; ``sum_rule`` picks one per mode, device and segment):

- ``"wide"``: ``acc = acc_type(init); acc = RN_acc(acc + term)``; ``out = RN_dtype(acc)``.
- ``"kahan"``: Neumaier compensation in the acc type, ``out = RN_dtype(s + c)`` (``RN_dtype(s)``
  when ``s`` is not finite or ``c == 0``, so a sum of -0.0 stays -0.0).
- Both split a segment of more than ``CHUNK_TERMS`` terms into chunks folded in order (see
  ``CHUNK_TERMS``); so does the product of the "fp32" and "kahan" modes. The rules below
  reproduce torch and never split.
- ``"round_each"``: ``acc = init; acc = RN_dtype(acc_type(acc) + acc_type(term))``: torch's CPU
  ``index_put_(accumulate=True)`` and CUDA ``indexing_backward_kernel`` (slice size > 32).
- ``"cuda_small_stride"``: ``g = 0; g = RN_acc(g + term)``; ``out = RN_dtype(acc_type(init) + g)``:
  CUDA ``indexing_backward_kernel_small_stride`` (and ``_stride_1`` with fewer than 32 terms).
- ``"cuda_warp_tree"``: 32 lane partial sums, a shuffle-down tree, then a serial tail:
  CUDA ``indexing_backward_kernel_stride_1`` with 32 or more terms.
- ``"exact"`` ("exact" mode, sum and mean): the exact sum of the init (if any) and the terms in
  ``Fraction`` arithmetic, or that sum over the count, rounded once (``exact_sum_rounded``,
  ``round_exact``). No order and no init of +0.0: a sum of -0.0 terms is -0.0.

The acc type is fp64 for fp64 data and fp32 otherwise (PyTorch's ``opmath_type``, which is also
what the CUDA kernels above accumulate in).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch

__all__ = [
    "RULES",
    "WARP_SIZE",
    "acc_dtype",
    "exact_sum_rounded",
    "index_add",
    "resume_sum",
    "round_exact",
    "scatter_reduce",
    "segment_sum",
    "sum_rule",
    "ulp_distance",
]

RULES: tuple[str, ...] = ("wide", "kahan", "round_each", "cuda_small_stride", "cuda_warp_tree",
                          "exact")

#: Lanes per warp of the CUDA (non-ROCm) kernels that "autograd" mode reproduces.
WARP_SIZE = 32

_MODES = ("fp32", "kahan", "autograd", "exact")
_REDUCES = ("sum", "mean", "prod", "amax", "amin")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The acc type: fp64 for fp64 data, fp32 for fp32, fp16 and bf16."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sum_rule(mode: str, dtype: torch.dtype, device_type: str, slice_size: int, n_terms: int) -> str:
    """The arithmetic rule of one segment of a sum, as a name from ``RULES``.

    Args:
        mode: ``"fp32"``, ``"kahan"`` or ``"autograd"``.
        dtype: the data's dtype. No rule depends on it today (the contract's CPU rows for bf16/fp16 and
            for fp32/fp64 are the same rule, ``round_each``, since rounding an fp32 sum to fp32
            is a no-op); it is an argument so that a dtype-specific device path has a place.
        device_type: ``"cpu"`` or ``"cuda"``; only "autograd" mode looks at it.
        slice_size: CUDA ``index_put_``'s ``sliceSize``: the number of elements after the
            indexed dim (product of the trailing sizes, so 1 when indexing the last dim, and
            ``H`` for ``[N, H]`` indexed on dim 0); 1 for an element-wise scatter index,
            which torch's deterministic CUDA scatter flattens to a 1-D ``index_put_``.
        n_terms: the number of terms in this segment (the CUDA stride-1 kernel switches to a
            warp-parallel sum at 32).
    """
    if mode == "fp32":
        return "wide"
    if mode == "kahan":
        return "kahan"
    if mode == "exact":
        return "exact"
    if mode != "autograd":
        raise ValueError(f"sum_rule: mode={mode!r} is not one of {_MODES}")
    if not dtype.is_floating_point:
        raise ValueError(f"sum_rule: dtype={dtype} is not a floating dtype")
    if device_type == "cpu":
        # IndexKernel.cpp: `*(scalar_t*)dst += *(scalar_t*)src`, serially; for bf16/fp16 the
        # operator+ works in fp32 and rounds back, for fp32/fp64 it is a plain serial sum.
        return "round_each"
    if device_type == "cuda":
        if slice_size > WARP_SIZE:
            return "round_each"  # indexing_backward_kernel
        if slice_size > 1 or n_terms < WARP_SIZE:
            return "cuda_small_stride"  # indexing_backward_kernel_small_stride / stride_1 < 32
        return "cuda_warp_tree"  # indexing_backward_kernel_stride_1, >= 32 duplicates
    raise NotImplementedError(f"sum_rule: no 'autograd' arithmetic known for {device_type!r}")


# ---------------------------------------------------------------------------------------------
# The five sum rules. Each takes the segment's init (a dtype tensor of columns) and its terms in
# canonical order, and returns the segment's value. "wide" and "kahan" take and return acc-type
# tensors (mean divides before the one rounding); the other three work on dtype tensors, because
# the torch kernels they copy read and write the dtype.
# ---------------------------------------------------------------------------------------------


#: The chunk length of the "fp32" and "kahan" canonical order (also for prod): a segment of more
#: than CHUNK_TERMS terms is cut into chunks of CHUNK_TERMS consecutive terms; the first chunk
#: starts from the init, each later chunk from its own first term, and the chunk results are
#: folded into the first serially, in order. (The kernels' copy of this number is
#: ``detsum.kernels.CHUNK_TERMS``; a test checks that they agree.)
CHUNK_TERMS = 256


def _chunks(terms: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor]]:
    if len(terms) <= CHUNK_TERMS:
        return [terms]
    return [terms[i:i + CHUNK_TERMS] for i in range(0, len(terms), CHUNK_TERMS)]


def _serial_sum(init: torch.Tensor, terms: Sequence[torch.Tensor]) -> torch.Tensor:
    acc = init.clone()
    for t in terms:
        acc = acc + t  # one RN_acc per term
    return acc


def _wide(init: torch.Tensor, terms: Sequence[torch.Tensor], *, chunked: bool = True
          ) -> torch.Tensor:
    if not chunked:
        return _serial_sum(init, terms)
    first, *later = _chunks(terms)
    acc = _serial_sum(init, first)
    for chunk in later:
        acc = acc + _serial_sum(chunk[0], chunk[1:])
    return acc


def _neumaier(s: torch.Tensor, c: torch.Tensor, terms: Sequence[torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    for t in terms:
        u = s + t
        # Neumaier: the error of u = s + t is recovered exactly from the larger operand. Both
        # branches are computed and one is kept per column; neither has side effects.
        c = c + torch.where(s.abs() >= t.abs(), (s - u) + t, (t - u) + s)
        s = u
    return s, c


def _kahan(init: torch.Tensor, terms: Sequence[torch.Tensor]) -> torch.Tensor:
    first, *later = _chunks(terms)
    s, c = _neumaier(init.clone(), torch.zeros_like(init), first)
    for chunk in later:
        chunk_s, chunk_c = _neumaier(chunk[0].clone(), torch.zeros_like(init), chunk[1:])
        s, c = _neumaier(s, c, [chunk_s])
        c = c + chunk_c
    # Once s is inf or nan, c is nan (inf - inf); adding it would turn an inf result into nan,
    # which torch never does, so a non-finite s is the answer as it is. With c == 0 the answer
    # is s too: s + (+0.0) would turn a -0.0 sum (all terms -0.0) into +0.0, unlike a plain sum.
    return torch.where(torch.isfinite(s) & (c != 0), s + c, s)


def resume_sum(s: torch.Tensor, c: torch.Tensor | None, terms: Sequence[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A running sum continued over ``terms`` in the chunked canonical order, without the
    final step: ``"fp32"`` (``c`` None) returns ``(acc, None)``; ``"kahan"`` starts from the
    compensation ``c`` instead of 0 and returns ``(s, c)`` before ``s + c``. ``s``, ``c`` and
    the terms are acc-type tensors of one shape."""
    first, *later = _chunks(terms)
    if c is None:
        acc = _serial_sum(s, first)
        for chunk in later:
            acc = acc + _serial_sum(chunk[0], chunk[1:])
        return acc, None
    s, c = _neumaier(s.clone(), c.clone(), first)
    for chunk in later:
        chunk_s, chunk_c = _neumaier(chunk[0].clone(), torch.zeros_like(s), chunk[1:])
        s, c = _neumaier(s, c, [chunk_s])
        c = c + chunk_c
    return s, c


def _serial_prod(init: torch.Tensor, terms: Sequence[torch.Tensor]) -> torch.Tensor:
    acc = init.clone()
    for t in terms:
        acc = acc * t
    return acc


def _prod(init: torch.Tensor, terms: Sequence[torch.Tensor], *, chunked: bool) -> torch.Tensor:
    if not chunked:
        return _serial_prod(init, terms)
    first, *later = _chunks(terms)
    acc = _serial_prod(init, first)
    for chunk in later:
        acc = acc * _serial_prod(chunk[0], chunk[1:])
    return acc


def _round_each(init: torch.Tensor, terms: Sequence[torch.Tensor], dtype: torch.dtype
                 ) -> torch.Tensor:
    acc_t = acc_dtype(dtype)
    acc = init.clone()
    for t in terms:
        acc = (acc.to(acc_t) + t.to(acc_t)).to(dtype)  # RN_dtype after every add
    return acc


def _cuda_small_stride(init: torch.Tensor, terms: Sequence[torch.Tensor], dtype: torch.dtype
                       ) -> torch.Tensor:
    acc_t = acc_dtype(dtype)
    g = torch.zeros(init.shape, dtype=acc_t, device=init.device)
    for t in terms:
        g = g + t.to(acc_t)
    # The kernel adds the destination's old value only at the end.
    return (init.to(acc_t) + g).to(dtype)


def _cuda_warp_tree(init: torch.Tensor, terms: Sequence[torch.Tensor], dtype: torch.dtype
                    ) -> torch.Tensor:
    acc_t = acc_dtype(dtype)
    n = len(terms)
    passes = n // WARP_SIZE
    zero = torch.zeros(init.shape, dtype=acc_t, device=init.device)
    # Lane l sums terms l, 32 + l, 64 + l, ... of the first 32 * passes terms, serially from 0.
    lanes = [zero.clone() for _ in range(WARP_SIZE)]
    for i in range(passes):
        for lane in range(WARP_SIZE):
            lanes[lane] = lanes[lane] + terms[WARP_SIZE * i + lane].to(acc_t)
    # Shuffle-down tree: g_l = g_l + g_{l+off}, every lane reading values from before the step.
    # Only lanes l < off can still reach lane 0, so those are the ones kept.
    off = WARP_SIZE // 2
    while off > 0:
        lanes = [lanes[lane] + lanes[lane + off] for lane in range(off)]
        off //= 2
    g = lanes[0]
    # Lane 0 adds the remaining n - 32 * passes terms serially.
    for i in range(passes * WARP_SIZE, n):
        g = g + terms[i].to(acc_t)
    return (init.to(acc_t) + g).to(dtype)


# ---------------------------------------------------------------------------------------------
# One segment of each reduction.
# ---------------------------------------------------------------------------------------------


def _scaled_term(x: torch.Tensor, alpha, acc_t: torch.dtype) -> torch.Tensor:
    """The contract's term(x): acc_type(x), or RN_acc(acc_type(x) * alpha) as its own op when alpha != 1."""
    if alpha == 1:
        return x.to(acc_t)
    return x.to(acc_t) * torch.tensor(alpha, dtype=acc_t, device=x.device)


def _segment_sum_value(init, rows, rule, dtype, alpha):
    """The sum of one segment, rounded to dtype. ``init`` is a dtype tensor."""
    acc_t = acc_dtype(dtype)
    if rule == "wide":
        return _wide(init.to(acc_t), [_scaled_term(x, alpha, acc_t) for x in rows]).to(dtype)
    if rule == "kahan":
        return _kahan(init.to(acc_t), [_scaled_term(x, alpha, acc_t) for x in rows]).to(dtype)
    # "autograd" rules: torch multiplies source by alpha in the dtype before accumulating.
    terms = [_scaled_term(x, alpha, acc_t).to(dtype) for x in rows]
    if not terms:
        return init.clone()  # torch's kernels never visit a destination without terms
    if rule == "round_each":
        return _round_each(init, terms, dtype)
    if rule == "cuda_small_stride":
        return _cuda_small_stride(init, terms, dtype)
    if rule == "cuda_warp_tree":
        return _cuda_warp_tree(init, terms, dtype)
    raise ValueError(f"unknown rule {rule!r}")


def _exact(values: Sequence[torch.Tensor], dtype: torch.dtype, *, mean: bool) -> torch.Tensor:
    """The "exact" rule: the exact sum of ``values`` (acc-type rows), or that sum divided by
    ``len(values)``, rounded once to ``dtype``, by Fraction arithmetic column by column."""
    stacked = torch.stack(list(values))
    total = exact_sum_rounded(stacked, dtype)  # IEEE specials and the sign of zero included
    if not mean:
        return total
    out = total.clone()
    for c in range(stacked.shape[1]):
        column = stacked[:, c].tolist()
        if not all(math.isfinite(v) for v in column):
            continue  # inf or NaN: the mean is what the sum is
        exact = sum((Fraction(v) for v in column), Fraction(0))
        if exact != 0:
            out[c] = round_exact(exact / len(column), dtype)
    return out


def _reduce_segment(base, rows, reduce, mode, *, alpha, include_self, device_type, slice_size):
    """One output row: ``base`` is the input row (dtype), ``rows`` the terms in canonical order."""
    dtype = base.dtype
    acc_t = acc_dtype(dtype)
    if not include_self and not rows:
        return base.clone()  # a position that receives no term keeps the input
    if mode == "exact" and reduce in ("sum", "mean"):
        # No order, no init of +0.0: only the base row (if included) and the terms.
        scale = alpha if reduce == "sum" else 1
        values = ([base.to(acc_t)] if include_self else []) + [
            _scaled_term(x, scale, acc_t) for x in rows]
        return _exact(values, dtype, mean=reduce == "mean")
    if mode == "exact" and reduce == "prod":
        raise ValueError("mode='exact' has no product")
    if reduce == "sum":
        init = base if include_self else torch.zeros_like(base)
        rule = sum_rule(mode, dtype, device_type, slice_size, len(rows))
        return _segment_sum_value(init, rows, rule, dtype, alpha)
    if reduce == "mean":
        count = len(rows) + int(include_self)
        if count == 0:
            return base.clone()
        init = (base if include_self else torch.zeros_like(base)).to(acc_t)
        terms = [x.to(acc_t) for x in rows]
        # "autograd" reproduces torch's serial order: never chunked.
        total = (_kahan(init, terms) if mode == "kahan"
                 else _wide(init, terms, chunked=mode != "autograd"))
        divisor = torch.tensor(float(count), dtype=acc_t, device=base.device)
        if mode == "autograd":
            # torch's scatter_reduce mean rounds the fp32 sum to the dtype, then divides by
            # the count it keeps in the dtype (rounded once: 257 is 256 in bfloat16).
            total = total.to(dtype).to(acc_t)
            divisor = divisor.to(dtype).to(acc_t)
        return (total / divisor).to(dtype)
    if reduce == "prod":
        init = base.to(acc_t) if include_self else torch.ones_like(base, dtype=acc_t)
        acc = _prod(init, [x.to(acc_t) for x in rows], chunked=mode != "autograd")
        return acc.to(dtype)
    if reduce in ("amax", "amin"):
        values = ([base] if include_self else []) + list(rows)
        acc = values[0].clone()
        for x in values[1:]:
            better = x > acc if reduce == "amax" else x < acc
            # NaN wins over any number and, once in acc, stays; equal values (+0 / -0) keep
            # the earlier one.
            take = (torch.isnan(x) | better) & ~torch.isnan(acc)
            acc = torch.where(take, x, acc)
        return acc
    raise ValueError(f"reduce={reduce!r} is not one of {_REDUCES}")


# ---------------------------------------------------------------------------------------------
# Layout: every op works on [rows along dim, columns] views.
# ---------------------------------------------------------------------------------------------


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved to the front and the other dims flattened: ``[size(dim), C]``."""
    columns = math.prod(s for d, s in enumerate(t.shape) if d != dim)
    return t.movedim(dim, 0).reshape(t.shape[dim], columns)


def _from_rows(rows: torch.Tensor, like_shape, dim: int) -> torch.Tensor:
    """Inverse of ``_as_rows`` for an output whose shape is ``like_shape``."""
    moved = [like_shape[dim]] + [s for d, s in enumerate(like_shape) if d != dim]
    return rows.reshape(moved).movedim(0, dim).contiguous()


def _trailing_size(shape, dim: int) -> int:
    return math.prod(shape[dim + 1 :])


def _segments_of(index: Sequence[int], n_out: int) -> list[list[int]]:
    """For each output row j, the source rows i with index[i] == j, in increasing i. A value
    outside [0, n_out) sends its row to no output row (what an unchecked bad value gives)."""
    segments: list[list[int]] = [[] for _ in range(n_out)]
    for i, j in enumerate(index):
        if 0 <= j < n_out:
            segments[j].append(i)
    return segments


def _reduce_rows(base2, src2, segments, reduce, mode, *, alpha=1, include_self=True,
                 device_type, slice_size):
    """Every output row j of ``base2`` [M, C] reduced with rows ``segments[j]`` of ``src2``."""
    out = torch.empty_like(base2)
    for j, seg in enumerate(segments):
        rows = [src2[i] for i in seg]
        out[j] = _reduce_segment(
            base2[j], rows, reduce, mode, alpha=alpha, include_self=include_self,
            device_type=device_type, slice_size=slice_size,
        )
    return out


def _device_type(t: torch.Tensor, device_type: str | None) -> str:
    return t.device.type if device_type is None else device_type


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r} is not one of {_MODES}")


# ---------------------------------------------------------------------------------------------
# Public oracles.
# ---------------------------------------------------------------------------------------------


def segment_sum(src: torch.Tensor, offsets: torch.Tensor, *, dim: int = 0, perm=None,
                mode: str = "fp32", device_type: str | None = None) -> torch.Tensor:
    """Sum CSR segments of ``src`` along ``dim``: output row s sums rows offsets[s]..offsets[s+1]-1.

    With ``perm``, the rows are ``perm[offsets[s]] .. perm[offsets[s+1]-1]``, in that order.
    Segments start from +0.0 (there is no init), so an empty segment gives +0.0.
    ``device_type`` (not in the public API) picks whose "autograd" arithmetic to reproduce, so
    CPU tensors can be checked against the CUDA rules; default: ``src``'s device.
    """
    _check_mode(mode)
    dim = dim % max(src.dim(), 1)
    bounds = [int(b) for b in offsets.tolist()]
    order = list(range(src.shape[dim])) if perm is None else [int(p) for p in perm.tolist()]
    segments = [order[bounds[s]:bounds[s + 1]] for s in range(len(bounds) - 1)]
    out_shape = list(src.shape)
    out_shape[dim] = len(segments)
    src2 = _as_rows(src, dim)
    base2 = torch.zeros((len(segments), src2.shape[1]), dtype=src.dtype, device=src.device)
    # No init: an empty segment keeps the +0.0 of base2, the others sum their terms alone
    # (every rule but "exact" starts from +0.0 anyway).
    out2 = _reduce_rows(base2, src2, segments, "sum", mode, include_self=False,
                        device_type=_device_type(src, device_type),
                        slice_size=_trailing_size(src.shape, dim))
    return _from_rows(out2, out_shape, dim)


def index_add(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *,
              alpha=1, mode: str = "fp32", device_type: str | None = None) -> torch.Tensor:
    """``torch.index_add``: output row index[i] (along dim) accumulates alpha * source row i.

    Rows start from the input row (init) and take their terms in increasing i. Terms:
    ``RN_acc(acc(x) * acc(alpha))`` under "fp32"/"kahan", and that rounded to the dtype under
    "autograd" (torch computes ``source * alpha`` in the dtype before ``index_put_``).
    ``device_type``: as in ``segment_sum``.
    """
    _check_mode(mode)
    dim = dim % max(input.dim(), 1)
    base2 = _as_rows(input, dim)
    src2 = _as_rows(source, dim)
    segments = _segments_of([int(i) for i in index.reshape(-1).tolist()], base2.shape[0])
    out2 = _reduce_rows(base2, src2, segments, "sum", mode, alpha=alpha,
                        device_type=_device_type(input, device_type),
                        slice_size=_trailing_size(input.shape, dim))
    return _from_rows(out2, input.shape, dim)


def scatter_reduce(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                   reduce: str, *, include_self: bool = True, mode: str = "fp32",
                   device_type: str | None = None) -> torch.Tensor:
    """Reduce ``src`` into ``input`` along ``dim``: ``sum``, ``mean``, ``prod``, ``amax``, ``amin``.

    ``index`` is either 1-D with ``src.size(dim)`` entries (row-wise: row i of src goes to output
    row index[i]) or has src's full shape (element-wise, as ``torch.scatter_reduce``). Terms
    reach an output element in increasing position along ``dim``.

    include_self=True: the input element is the initial value and counts for mean.
    include_self=False: an element that receives no term keeps the input; the others start
    from +0.0 (sum, mean), 1 (prod) or their first term (amax, amin).

    Arithmetic: sum as ``sum_rule``; mean is ``RN_dtype(RN_acc(total / count))`` with the wide
    total ("fp32"), the Neumaier total ``RN_acc(s + c)`` ("kahan"), or the wide total and the
    count rounded to the dtype first ("autograd": what torch's CPU scatter_reduce mean
    computes, counting in the dtype); prod is a serial product in the acc type, rounded once,
    in every mode; amax/amin are exact.
    ``device_type``: as in ``segment_sum``.

    Not torch's arithmetic everywhere: its dim-0 fast path for an expanded row index over >= 16
    trailing elements lets the later of a +0/-0 tie win in amax/amin (pinned in
    tests/test_reference.py).
    """
    _check_mode(mode)
    if reduce not in _REDUCES:
        raise ValueError(f"reduce={reduce!r} is not one of {_REDUCES}")
    dim = dim % max(input.dim(), 1)
    dev = _device_type(input, device_type)
    base2 = _as_rows(input, dim)
    src2 = _as_rows(src, dim)
    row_wise = index.dim() == 1 and index.shape[0] == src.shape[dim]
    if row_wise:
        segments = _segments_of([int(i) for i in index.tolist()], base2.shape[0])
        out2 = _reduce_rows(base2, src2, segments, reduce, mode, include_self=include_self,
                            device_type=dev, slice_size=_trailing_size(src.shape, dim))
        return _from_rows(out2, input.shape, dim)
    if index.shape != src.shape:
        raise ValueError(f"index of shape {tuple(index.shape)} is neither 1-D of length "
                         f"src.size(dim) nor src's shape {tuple(src.shape)}")
    # Element-wise: every column has its own segments. slice_size 1: torch's deterministic CUDA
    # scatter flattens an element-wise index into a 1-D index_put_.
    index2 = _as_rows(index, dim)
    out2 = torch.empty_like(base2)
    for col in range(base2.shape[1]):
        segments = _segments_of([int(i) for i in index2[:, col].tolist()], base2.shape[0])
        out2[:, col : col + 1] = _reduce_rows(
            base2[:, col : col + 1], src2[:, col : col + 1], segments, reduce, mode,
            include_self=include_self, device_type=dev, slice_size=1,
        )
    return _from_rows(out2, input.shape, dim)


# ---------------------------------------------------------------------------------------------
# Accuracy yardstick.
# ---------------------------------------------------------------------------------------------


def _to_odd(r: torch.Tensor, value: Fraction) -> torch.Tensor:
    """Round-to-odd from RN: if the 0-d float tensor ``r`` (= RN(value)) is inexact and its last
    bit is 0, step one ulp toward ``value``: the odd neighbour on the exact value's side."""
    if not torch.isfinite(r) or Fraction(r.item()) == value:
        return r
    bits = r.view({torch.float32: torch.int32, torch.float64: torch.int64}[r.dtype]).item()
    if bits % 2:
        return r
    toward = math.inf if value > Fraction(r.item()) else -math.inf
    return torch.nextafter(r, torch.tensor(toward, dtype=r.dtype))


def round_exact(value: Fraction | float | int, dtype: torch.dtype) -> torch.Tensor:
    """RN_dtype of an exact rational ``value``, as a 0-d tensor: one rounding, not two.

    ``float(Fraction)`` is correctly rounded to fp64, but rounding that again to a narrower
    dtype can go the wrong way (a value just above a bf16 tie lands on the tie in fp64, and the
    tie then goes to even). Worse, torch converts fp64 to bf16/fp16 *through fp32* (c10's
    BFloat16/Half take a float), another double rounding. So each intermediate is made
    round-to-odd: rounding a round-to-odd value with at least p + 2 bits to nearest at p bits
    equals rounding the exact value (fp64 has 53 bits, fp32 24, fp16 11, bf16 8, and the margins
    also hold in the narrower formats' subnormal ranges). Chain: exact -> RO64 -> (RN32, made
    RO32) -> RN_dtype.
    """
    value = Fraction(value)
    try:
        r64 = torch.tensor(float(value), dtype=torch.float64)
    except OverflowError:
        r64 = torch.tensor(math.inf if value > 0 else -math.inf, dtype=torch.float64)
    if dtype == torch.float64:
        return r64
    r32 = _to_odd(r64, value).to(torch.float32)
    if dtype == torch.float32:
        return r32
    return _to_odd(r32, value).to(dtype)


def _exact_sum_rounded_1d(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    values = [float(v) for v in values]
    if any(math.isnan(v) for v in values):
        return torch.tensor(math.nan, dtype=dtype)
    infs = {v for v in values if math.isinf(v)}
    if len(infs) == 2:
        return torch.tensor(math.nan, dtype=dtype)  # inf + -inf
    if infs:
        return torch.tensor(infs.pop(), dtype=dtype)
    if values and all(v == 0.0 and math.copysign(1.0, v) < 0 for v in values):
        return torch.tensor(-0.0, dtype=dtype)  # IEEE: an exact sum of -0's is -0, else +0
    # math.fsum is the correctly rounded fp64 sum; the exact Fraction settles the last bit for
    # the further roundings (see round_exact) and the sums where fsum overflows.
    exact = sum((Fraction(v) for v in values), Fraction(0))
    try:
        total = math.fsum(values)
    except OverflowError:
        return round_exact(exact, dtype)
    if Fraction(total) == exact and dtype == torch.float64:
        return torch.tensor(total, dtype=dtype)
    return round_exact(exact, dtype)


def exact_sum_rounded(terms, dtype: torch.dtype | None = None, *, dim: int = 0) -> torch.Tensor:
    """The exact sum of ``terms``, rounded once to ``dtype`` (the accuracy yardstick).

    Args:
        terms: a tensor (summed along ``dim``; every other position independently) or a
            sequence of Python numbers / 0-d tensors (gives a 0-d tensor).
        dtype: the dtype to round to; default: the tensor's dtype, float64 for a sequence.

    Non-finite terms: any NaN gives NaN, +inf with -inf gives NaN, otherwise an inf wins.
    A sum that is exactly zero is +0.0 unless every term is -0.0 (IEEE's sign of an exact zero
    sum under round to nearest). An exact sum beyond the dtype's range rounds to +-inf.
    """
    if not isinstance(terms, torch.Tensor):
        values = [float(v) for v in terms]
        return _exact_sum_rounded_1d(values, dtype or torch.float64)
    dtype = dtype or terms.dtype
    dim = dim % max(terms.dim(), 1)
    rows = _as_rows(terms.to(torch.float64), dim)  # every float dtype converts exactly to fp64
    columns = [_exact_sum_rounded_1d(rows[:, c].tolist(), dtype) for c in range(rows.shape[1])]
    out = torch.stack(columns) if columns else torch.empty(0, dtype=dtype)
    out_shape = [s for d, s in enumerate(terms.shape) if d != dim]
    return out.reshape(out_shape)


_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
_INT64_MAX = 2**63 - 1


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns to int64 keys that are monotone in the float value.

    A non-negative float's bit pattern, read as a signed integer, grows with the value; a
    negative float's pattern is sign bit + magnitude, so its key is minus the magnitude. Then
    consecutive floats have consecutive keys, and +0 and -0 both map to 0.
    """
    bits = x.contiguous().view(_INT_VIEW[x.dtype]).to(torch.int64)
    sign_bit = {torch.int16: 15, torch.int32: 31, torch.int64: 63}[_INT_VIEW[x.dtype]]
    magnitude = bits & ((1 << sign_bit) - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance between ``a`` and ``b`` in units in the last place of their dtype.

    The number of representable values of the dtype stepped over going from a to b, computed as
    the difference of ordered-integer keys of the bit patterns (see ``_ordered``). So
    ``ulp_distance == 0`` means equal values (+0 and -0 count as equal), 1 means neighbours,
    and the distance across zero counts the subnormals on both sides. The largest finite value
    and inf are neighbours (distance 1), as in the bit patterns.

    Returns float64: exact for distances below 2**53; larger fp64 distances are approximate
    and saturate at 2**63 - 1, far beyond any tolerance. NaN: 0 where both are NaN (whatever
    the payload), +inf where exactly one is NaN, so any ``<= k`` tolerance fails there.
    """
    if a.dtype != b.dtype or a.dtype not in _INT_VIEW:
        raise TypeError(f"ulp_distance needs two tensors of one float dtype, got {a.dtype}, "
                        f"{b.dtype}")
    a, b = torch.broadcast_tensors(a, b)
    ka, kb = _ordered(a), _ordered(b)
    diff = ka - kb
    # int64 wraps only for fp64 keys of opposite signs; saturate there.
    wrapped = ((ka < 0) != (kb < 0)) & ((diff < 0) != (ka < 0)) & (diff != 0)
    dist = torch.where(wrapped, torch.full_like(diff, _INT64_MAX), diff.abs()).to(torch.float64)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    dist = torch.where(nan_a & nan_b, torch.zeros_like(dist), dist)
    return torch.where(nan_a ^ nan_b, torch.full_like(dist, math.inf), dist)
