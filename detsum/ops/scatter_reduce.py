"""scatter_reduce: torch.scatter_reduce semantics (sum, mean, prod, amax, amin), deterministic.

Two index layouts: a 1-D index of length ``src.size(dim)`` sends whole rows (the fast path,
one segment per output row); an index of ``src``'s full shape sends single elements (torch's
own semantics). One of those that broadcasts a row index over the other dims (the way torch
and PyG users write a row index) is run as that row index (``_as_rows``). Any other runs on
the Numba backend without a plan (``_stream_elements``), and elsewhere as a 1-D segmented
reduction over the flattened tensors with keys ``(outer, index, inner)``. Every layout gives
each output element the same terms in the same order, so the same bits.
"""

from __future__ import annotations

import math

import torch

from detsum import _dispatch, _replay, _segments, _transforms, _validation, kernels, reference
from detsum.backend import current_backend
from detsum.modes import MODE_BY_NAME, Mode, acc_dtype, parse_mode, rule_for
from detsum.plans import (Plan, aligned, call_with_plan, check_plan, launches_again,
                          operator_arguments, plan_for_call, run_checks_with, unpack)

_CALLER = "detsum.scatter_reduce"
REDUCTIONS = ("sum", "mean", "prod", "amax", "amin")


# ---- operator ---------------------------------------------------------------------------------

def _elementwise_plan(input3: torch.Tensor, index: torch.Tensor, dim: int, backend_name: str,
                      check: str = "host") -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets) over flattened elements, output element (o, index, i) per source (o, n, i),
    after checking ``index``'s values as ``check`` says (``_segments.check_that_runs``).
    Unchecked, an element whose value lies outside ``[0, input.size(dim))`` is in no segment
    (its key sorts before every other), never in another element's."""
    outer, num_segments, inner = input3.shape
    index3 = _segments.rows_view(index, dim).to(torch.int64)
    if check == "host":
        low, high = torch.stack(torch.aminmax(index)).tolist() if index.numel() else (0, 0)
        if low < 0 or high >= num_segments:
            bad = int(((index < 0) | (index >= num_segments)).reshape(-1).nonzero()[0])
            _validation.raise_index_out_of_range(_CALLER, "index", index, bad, num_segments,
                                                 f"input.size({dim})")
    else:
        in_range = (index3 >= 0) & (index3 < num_segments)
        if check == "device" and index.numel():
            _validation.assert_on_device(in_range.all(), _CALLER,
                                         f"index has a value outside [0, input.size({dim}) = "
                                         f"{num_segments})")
        # A key below every valid one: sorted before the first segment.
        index3 = torch.where(in_range, index3, -outer * num_segments)
    outer_ids = torch.arange(outer, device=index.device).view(-1, 1, 1)
    inner_ids = torch.arange(inner, device=index.device).view(1, 1, -1)
    keys = ((outer_ids * num_segments + index3) * inner + inner_ids).reshape(-1)
    return _segments.plan_from_keys(keys, outer * num_segments * inner, backend_name)


def _first_slice(index: torch.Tensor, dim: int) -> torch.Tensor:
    """``index``'s elements at position 0 of every dim but ``dim``: 1-D, a view."""
    rows = index
    for d in reversed(range(index.dim())):
        if d != dim:
            rows = rows.select(d, 0)
    return rows


def stride_zero_rows(index: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The 1-D row index that ``index`` broadcasts along every dim but ``dim`` by its layout
    alone (stride 0 or size 1 there: ``index.view(-1, 1).expand_as(src)``, as torch and PyG
    users write it), as a view, no value read; None for any other layout. A 1-D ``index`` is
    its own."""
    for d in range(index.dim()):
        if d != dim and index.stride(d) != 0 and index.shape[d] != 1:
            return None
    return _first_slice(index, dim)


def _broadcast_rows(index: torch.Tensor, dim: int, check: str) -> torch.Tensor | None:
    """The 1-D row index that ``index`` (of ``src``'s shape) broadcasts over every dim but
    ``dim``, or None when it holds other values or the answer would cost a host read.

    A view, found without reading values, for the layouts of :func:`stride_zero_rows`.
    Otherwise, under ``check="host"`` only, and not while compiling, one comparison of
    ``index`` with its first slice across ``dim`` (on a GPU a host read, so never under
    "device" or "off"). Each output element then reduces, in the same order, exactly the
    terms the row path gives its row: same bits."""
    if index.dim() < 2 or index.numel() == 0:
        return None
    rows = stride_zero_rows(index, dim)
    # (A compiled backward's index is a traced tensor: no comparison reads its values.)
    if rows is not None or check != "host" or torch.compiler.is_compiling():
        return rows
    rows = _first_slice(index, dim)
    shape = [1] * index.dim()
    shape[dim] = -1
    return rows if torch.equal(index, rows.view(shape).expand(index.shape)) else None


def _torch_indexes_rows(index: torch.Tensor, dim: int) -> bool:
    """Whether torch's deterministic CUDA scatter (``_scatter_via_index_put``) indexes
    ``index``'s rows, with a slice of every element after ``dim``: for a stride-0 broadcast
    along every other dim (``index.view(-1, 1).expand_as(src)``). Any other index it flattens
    to single elements, a slice size of 1, even where the values repeat a row index or a
    size-1 dim has a nonzero stride. (Measured on torch 2.11: the expanded form runs
    ``indexing_backward_kernel_small_stride`` for 5 columns, the materialised one
    ``indexing_backward_kernel_stride_1``.)"""
    return all(index.stride(d) == 0 for d in range(index.dim()) if d != dim)


def _as_rows(input: torch.Tensor, dim: int, index: torch.Tensor, reduce: str, acc_mode: str,
             check: str, backend_name: str) -> torch.Tensor:
    """``index``, or the 1-D row index it broadcasts (``_broadcast_rows``) where the row path
    computes the same arithmetic. That is everywhere but some "autograd" sums on CUDA, whose
    rule follows the slice size torch's ``index_put_`` sees (``_torch_indexes_rows``). Under
    ``check="host"`` the error must name the position in ``index`` as the caller passed it:
    on the triton backend the row path's own check finds a bad value (``_run`` names it
    again), elsewhere a row index with one is not taken."""
    rows = _broadcast_rows(index, dim, check)
    if rows is None:
        return index
    mode, device_type = Mode(acc_mode), input.device.type
    inner = math.prod(input.shape[dim + 1:])
    if (rule_for(mode, reduce, device_type, 1) != rule_for(mode, reduce, device_type, inner)
            and not _torch_indexes_rows(index, dim)):
        return index
    if check == "host" and backend_name != "triton":
        if rows.device.type == "cpu":
            # NumPy's pass: torch's wakes a second thread for 1M values, a time slice (8 ms,
            # against 0.2 ms) whenever the other core is busy.
            values = rows.numpy()
            low, high = int(values.min()), int(values.max())
        else:
            low, high = torch.stack(torch.aminmax(rows)).tolist()
        if low < 0 or high >= input.shape[dim]:
            return index
    return rows


def _streams(backend_name: str, device_type: str, rule: int) -> bool:
    """Whether an elementwise index runs without a plan (``_stream_elements``): on the Numba
    backend, under every rule but EXACT (whose state per output element, dozens of limbs, is
    too large to keep for every element of a block)."""
    return backend_name == "numba" and device_type == "cpu" and rule != kernels.EXACT


def _stream_elements(input, dim, index, src, reduce, include_self, rule) -> torch.Tensor:
    """The elementwise layout on the Numba backend without a plan: each output element gets
    the terms and arithmetic the plan of ``_elementwise_plan`` would give it (same bits),
    from one pass over ``src`` and ``index`` (``detsum.kernels.numba.scatter``), which checks
    every index value as it reads it; a bad one is reported as the check="host" path does."""
    from detsum.kernels.numba.scatter import scatter_elements

    input3 = _segments.rows_view(input, dim)
    out3 = _segments.new_output_like(input3)
    if scatter_elements(_segments.rows_view(src, dim), _segments.rows_view(index, dim), input3,
                        out3, reduce=kernels.REDUCE_CODES[reduce], rule=rule,
                        include_base=include_self):
        _validation.raise_first_out_of_range(_CALLER, "index", index, input.shape[dim],
                                             f"input.size({dim})")
    return out3.view(input.shape)


@torch.library.custom_op("detsum::scatter_reduce", mutates_args=())
def scatter_reduce_op(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                      reduce: str, include_self: bool, acc_mode: str, sorted: bool,
                      check: str = "host", order: torch.Tensor | None = None,
                      offsets: torch.Tensor | None = None,
                      chunk_ends: torch.Tensor | None = None, chunk_slots: int = -1
                      ) -> torch.Tensor:
    return _run(input, dim, index, src, reduce, include_self, acc_mode, sorted, check=check,
                planned=unpack(order, offsets, chunk_ends, chunk_slots))


def _run(input, dim, index, src, reduce, include_self, acc_mode, sorted, *, check="host",
         planned=None):
    """The operator's body: validate index values (as ``check`` says), plan, launch.
    ``planned``: the positions of a ``detsum.Plan`` of a 1-D ``index``, checked when it was
    made: nothing to check or plan here; a call of an earlier call's signature makes that
    call's launch again (``plans.call_with_plan``). Without a plan, such a call is made again
    from a record of the earlier call's device work (``_replay.call``)."""
    if planned is None and _replay.replays(input, check):
        return _replay.call(
            _CALLER,
            (input.dtype, input.shape, input.stride(), input.device, index.dtype, index.shape,
             index.stride(), src.dtype, src.shape, src.stride(), src.device, dim, reduce,
             include_self, acc_mode, sorted, check, aligned(input), aligned(index),
             aligned(src), src is input, _segments.launch_settings(),
             *_replay.path_settings()),
            (input, index, src),
            lambda: _whole_path(input, dim, index, src, reduce, include_self, acc_mode, sorted,
                                check, None))
    if planned is None or not launches_again(input, planned[1]):
        return _whole_path(input, dim, index, src, reduce, include_self, acc_mode, sorted,
                           check, planned)
    order, offsets, chunks = planned
    chunk_ends, chunk_slots = (None, -1) if chunks is None else chunks
    return call_with_plan(
        _CALLER, offsets, (order, index, chunk_ends),
        (input.dtype, input.shape, input.stride(), input.device, src.dtype, src.shape,
         src.stride(), src.device, dim, reduce, include_self, acc_mode, sorted, check,
         chunk_slots, aligned(input), aligned(src), _segments.launch_settings()),
        (src, input), lambda: _segments.new_output_like(input),
        lambda: _whole_path(input, dim, index, src, reduce, include_self, acc_mode, sorted,
                            check, planned))


def _whole_path(input, dim, index, src, reduce, include_self, acc_mode, sorted, check,
                planned):
    """``_run``'s checks, plan and launch."""
    device_type = input.device.type
    if reduce == "mean" and acc_mode == "autograd" and device_type == "cuda":
        return _torch_cuda_mean(input, dim, index, src, include_self, sorted, check, planned)
    backend_name = current_backend(device_type, _CALLER)
    check = _segments.check_that_runs(check, device_type, backend_name)
    if planned is None:  # a plan's index is a row index already
        given = index
        index = _as_rows(input, dim, index, reduce, acc_mode, check, backend_name)
        if index is not given and check == "host" and backend_name == "triton":
            # The row path checks the rows (on a GPU, with the one read of its verdict, where
            # a check of them before it would cost a second) and writes into a new tensor.
            try:
                return _run_index(backend_name, input, dim, index, src, reduce, include_self,
                                  acc_mode, sorted, check)
            except _validation.IndexOutOfRangeError:
                pass  # its error names a position in the rows; the caller passed ``given``
            _validation.raise_first_out_of_range(_CALLER, "index", given, input.shape[dim],
                                                 f"input.size({dim})")
    if backend_name == "reference":
        return _run_reference(input, dim, index, src, reduce, include_self, acc_mode, sorted,
                              check, planned)
    if planned is not None:
        # The plan's index goes along for the chunks of long segments to find their segments.
        return _launch_rows(backend_name, input, dim, src, reduce, include_self, acc_mode,
                            planned, keys=index).view(*input.shape)
    return _run_index(backend_name, input, dim, index, src, reduce, include_self, acc_mode,
                      sorted, check)


def _run_index(backend_name, input, dim, index, src, reduce, include_self, acc_mode, sorted,
               check):
    """``_run`` on a kernel backend without a plan: the elementwise layout, or the row
    index's rows with terms, its small form, or its plan and launch."""
    if index.dim() != 1:
        return _run_elements(backend_name, input, dim, index, src, reduce, include_self,
                             acc_mode, check)
    # A scanned index goes straight to its launch, which writes every output row anyway.
    sparse = None if _segments.scans_index(backend_name, index, sorted) else \
        _segments.rows_with_terms(_CALLER, index, input.shape[dim], index_name="index",
                                  size_name=f"input.size({dim})", check=check)
    if sparse is not None:
        return _run_on_rows_with_terms(backend_name, input, dim, index, *sparse, src, reduce,
                                       include_self, acc_mode, sorted)
    if backend_name == "numba" and not sorted and (reduce in ("mean", "amax", "amin")
                                                   or reduce == "sum" and include_self):
        small = _run_small(input, dim, index, src, reduce, include_self, acc_mode)
        if small is not None:
            return small
    if backend_name == "numba" and not sorted:
        streamed = _run_streamed(input, dim, index, src, reduce, include_self, acc_mode)
        if streamed is not None:
            return streamed
    planned = (*_plan(input, dim, index, sorted, backend_name, check), None)
    # Sizes one by one: half the parsing of a torch.Size.
    return _launch_rows(backend_name, input, dim, src, reduce, include_self, acc_mode,
                        planned).view(*input.shape)


def _plan(input, dim, index, sorted, backend_name, check):
    """(order, offsets) of a 1-D ``index``'s rows, after checking its values (and a
    ``sorted=True`` promise) as ``check`` says."""
    return _segments.plan_from_index(
        _CALLER, index, input.shape[dim], index_name="index", size_name=f"input.size({dim})",
        promised_sorted=sorted, backend_name=backend_name, check=check, as_keys=True)


def _torch_cuda_mean(input, dim, index, src, include_self, sorted, check, planned):
    """The "autograd" mean on CUDA: torch's under ``use_deterministic_algorithms(True)``,
    which sums with ``index_put_(accumulate=True)`` (the "autograd" sum's kernels, by slice
    size, from the input or, without ``include_self``, from +0.0), counts in the dtype (the
    count rounded to it once) and divides with its own ``div_``: the same division here, so
    the same bits. Elements that receive nothing keep the input (divided by 1)."""
    total = _run(input, dim, index, src, "sum", include_self, "autograd", sorted, check=check,
                 planned=planned)
    counts = _count_every(input, dim, index, src) + int(bool(include_self))
    counts = counts.masked_fill(counts == 0, 1).to(input.dtype)
    return total.div_(counts)


def _run_reference(input, dim, index, src, reduce, include_self, acc_mode, sorted, check,
                   planned):
    """``_run`` on the reference backend, after the same checks of ``index``'s values."""
    rowwise = index.dim() == 1
    if planned is None:
        if rowwise:
            _plan(input, dim, index, sorted, "reference", check)
        else:
            _elementwise_plan(_segments.rows_view(input, dim), index, dim, "reference", check)
    if rowwise and sorted and check != "host":
        # An unchecked promise reduces rows as the other backends' plans do.
        index = _segments.index_as_planned(index, input.shape[dim])
    return reference.scatter_reduce(input, dim, index, src, reduce, include_self=include_self,
                                    mode=acc_mode)


def _run_elements(backend_name, input, dim, index, src, reduce, include_self, acc_mode, check):
    """``_run`` for an index of ``src``'s shape: without a plan where ``_streams`` says so, or
    else as a 1-D segmented reduction over the flattened tensors (``_elementwise_plan``)."""
    rule = rule_for(Mode(acc_mode), reduce, input.device.type, 1)
    if _streams(backend_name, input.device.type, rule):
        return _stream_elements(input, dim, index, src, reduce, include_self, rule)
    input3 = _segments.rows_view(input, dim)
    order, offsets = _elementwise_plan(input3, index, dim, backend_name, check)
    return _launch(backend_name, src.reshape(1, -1, 1), input3.reshape(1, -1, 1), reduce,
                   include_self, acc_mode, (order, offsets, None)).view(*input.shape)


def _run_on_rows_with_terms(backend_name, input, dim, index, targets, positions, src, reduce,
                            include_self, acc_mode, sorted):
    """``_run`` where few of ``input``'s rows receive terms: those rows (``targets``) alone go
    through the kernel, their terms at ``positions`` among them (checked already), and the
    others keep ``input``, include_self or not, as in torch (``_segments.rows_with_terms``:
    the same bits)."""
    rows_in = input.index_select(dim, targets)
    if sorted:
        # A sorted=True promise is still checked, on the caller's index (its values in range
        # already) so that the error quotes them: the positions are sorted exactly when it is.
        _segments.check_sorted(_CALLER, index, input.shape[dim], index_name="index",
                               size_name=f"input.size({dim})")
    # Checked once already (on a GPU, that check is a host read).
    order, offsets = _segments.plan_from_keys(positions, rows_in.shape[dim], backend_name,
                                              as_keys=True)
    rows = _launch_rows(backend_name, rows_in, dim, src, reduce, include_self, acc_mode,
                        (order, offsets, None))
    input3 = _segments.rows_view(input, dim)
    out3 = _segments.new_output_like(input3)
    out3.copy_(input3)
    out3.index_copy_(1, targets, rows)
    return out3.view(*input.shape)


def _run_small(input, dim, index, src, reduce, include_self, acc_mode):
    """``_run`` as one Numba call without a plan, or None where that call does not fit: a sum
    from ``input`` (``_segments.small_index_add``: index_add's arithmetic, rule for rule,
    alpha 1), a mean, a max or a min (``_segments.small_scatter_reduce``)."""
    input3 = _segments.rows_view(input, dim)
    rule = rule_for(MODE_BY_NAME[acc_mode], reduce, "cpu", input3.shape[2])
    src3, size_name = _segments.rows_view(src, dim), f"input.size({dim})"
    if reduce == "sum":
        small = _segments.small_index_add(_CALLER, src3, index, input3, None, 1.0, rule,
                                          size_name)
    else:
        small = _segments.small_scatter_reduce(_CALLER, src3, index, input3, reduce,
                                               include_self, rule, size_name)
    return None if small is None else small.view(*input.shape)


def _run_streamed(input, dim, index, src, reduce, include_self, acc_mode):
    """``_run`` as one pass without a plan (``_segments.streamed_scatter``), or None where
    that pass is not taken. (A ``sorted=True`` promise goes to the plan, which checks it.)"""
    input3 = _segments.rows_view(input, dim)
    streamed = _segments.streamed_scatter(
        _CALLER, _segments.rows_view(src, dim), index, input3, None, reduce, include_self,
        rule_for(MODE_BY_NAME[acc_mode], reduce, "cpu", input3.shape[2]), f"input.size({dim})")
    return None if streamed is None else streamed.view(*input.shape)


def _launch_rows(backend_name, input, dim, src, reduce, include_self, acc_mode, planned,
                 keys=None):
    """``_launch`` of ``src``'s rows into ``input``'s, as rows views (``_segments.rows_view``)."""
    return _launch(backend_name, _segments.rows_view(src, dim), _segments.rows_view(input, dim),
                   reduce, include_self, acc_mode, planned, keys)


def _launch(backend_name, src3, base3, reduce, include_self, acc_mode, planned, keys=None):
    """A new output of ``base3``'s shape: each of its rows reduces ``base3``'s (when
    ``include_self``), then ``src3``'s rows of its segment in ``planned``'s order, by
    ``backend_name``'s kernel. ``keys``: the index ``planned`` was made from
    (``_segments.launch``)."""
    order, offsets, chunks = planned
    out3 = _segments.new_output_like(base3)
    _segments.launch(backend_name, src3, order, offsets, base3, out3, reduce=reduce,
                     rule=rule_for(MODE_BY_NAME[acc_mode], reduce, base3.device.type,
                                   base3.shape[2]),
                     alpha=1.0, include_base=include_self, chunks=chunks, keys=keys)
    return out3


@scatter_reduce_op.register_fake
def _(input, dim, index, src, reduce, include_self, acc_mode, sorted, check="host", order=None,
      offsets=None, chunk_ends=None, chunk_slots=-1):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


# ---- autograd ---------------------------------------------------------------------------------
# Gradients follow torch's definitions: sum and mean pass the (scaled) gradient through,
# amax/amin split it evenly between all members equal to the result, prod gives each member
# the product of the others. Counts are integers, exact in any order; the product of the
# others goes through detsum's own product, with the forward's plan when it had one, so
# backward is as deterministic as forward.

def _setup_context(ctx, inputs, output):
    input, dim, index, src, reduce, include_self, _, sorted, *rest = inputs
    ctx.dim, ctx.reduce, ctx.include_self, ctx.sorted = dim, reduce, include_self, sorted
    ctx.check = rest[0] if rest else "host"
    order, offsets, chunk_ends = rest[1:4] if len(rest) > 3 else (None, None, None)
    ctx.chunk_slots = rest[4] if len(rest) > 4 else -1
    ctx.save_for_backward(input, index, src, output, order, offsets, chunk_ends)


def _take(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """The value of ``t`` at each source position's destination."""
    return t.index_select(dim, index) if index.dim() == 1 else t.gather(dim, index)


def _count(input: torch.Tensor, dim: int, index: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
    """How many source positions where ``src_mask`` holds land on each element of ``input``."""
    counter = acc_dtype(input.dtype)
    if index.dim() == 1:
        # Integers, exact in any order: torch's integer index_add_ needs no plan.
        # (Out of place: under vmap the zeros are one tensor and the mask a batch.)
        zeros = torch.zeros(input.shape, dtype=torch.int64, device=input.device)
        return zeros.index_add(dim, index.to(torch.int64), src_mask.to(torch.int64)).to(counter)
    zeros = torch.zeros(input.shape, dtype=counter, device=input.device)
    # The index was checked by the forward call, as its check said: not again (no host read).
    return call_scatter_reduce(zeros, dim, index, src_mask.to(counter), "sum", True, "fp32",
                               False, "off")


def _count_every(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                 reached: torch.Tensor | None = None) -> torch.Tensor:
    """How many source positions land on each element of ``input`` (every one counts, or those
    where ``reached``, a mask of ``index``'s shape, holds)."""
    if index.dim() == 1:
        # Whole rows: every column of an output row has its row's count, so one count per row
        # (an integer count is exact in any order, so torch's integer index_add_ gives it;
        # bincount's output size would be a host read).
        counts = torch.zeros(input.shape[dim], dtype=torch.int64, device=input.device)
        ones = (torch.ones_like(index, dtype=torch.int64) if reached is None
                else reached.to(torch.int64))
        counts.index_add_(0, index.to(torch.int64), ones)
        shape = [1] * input.dim()
        shape[dim] = -1
        return counts.to(acc_dtype(input.dtype)).view(shape).expand(input.shape)
    every = torch.ones_like(src, dtype=torch.bool)
    return _count(input, dim, index, every if reached is None else reached)


def _backward(ctx, grad):
    input, index, src, result, order, offsets, chunk_ends = ctx.saved_tensors
    dim, reduce, include_self = ctx.dim, ctx.reduce, ctx.include_self
    check = _segments.backward_check(ctx.check, grad.device.type)
    rows = _broadcast_rows(index, dim, check)
    if rows is not None:  # the same gradient, from row gathers and counts per row
        index = rows
    reached = None  # the source positions the forward reduced, when not all of them
    if check != "host":
        # Unchecked values: every gather and count below stays inside its tensor. Under "off"
        # the positions the forward left out take no part and receive nothing; under "device"
        # a bad value has failed already, so only the bounds matter.
        if input.shape[dim] == 0:  # every value is out of range: every position was left out
            grad_self = grad if ctx.needs_input_grad[0] else None
            return grad_self, None, None, torch.zeros_like(src), *_NO_MORE_GRADIENTS
        if ctx.sorted and check == "off":
            index = _segments.index_as_planned(index, input.shape[dim])
        index, in_range = _segments.clamped_index(index, input.shape[dim])
        if check == "off":
            reached = in_range
    members = None
    if reached is not None:
        shape = [1] * src.dim()
        shape[dim] = -1
        members = reached.view(shape) if reached.dim() == 1 else reached

    def among_members(mask: torch.Tensor) -> torch.Tensor:
        return mask if members is None else mask & members

    if reduce in ("sum", "mean"):
        share = grad
        if reduce == "mean":
            count = (_count_every(input, dim, index, src, reached) + int(include_self)
                     ).clamp_min(1)
            share = (grad / count).to(grad.dtype)
        grad_src = _take(share, dim, index)
        grad_self = share if include_self else None
    elif reduce in ("amax", "amin"):
        src_is_result = src == _take(result, dim, index)
        self_is_result = (input == result) if include_self else torch.zeros_like(input, dtype=torch.bool)
        ties = (_count(input, dim, index, among_members(src_is_result)) + self_is_result
                ).clamp_min(1)
        grad_src = (_take(grad / ties, dim, index) * src_is_result).to(grad.dtype)
        grad_self = (grad * self_is_result / ties).to(grad.dtype) if include_self else None
    else:  # prod: d(product)/d(member) = product of the other members
        # torch's formula, operation for operation (so "autograd" mode has its bits), on
        # detsum's products: a member's gradient is grad * product / member, the product with
        # a zero input taken as 1 for that input's own, and a source member that is its
        # element's only zero source gets grad times the product with it taken as 1.
        def product(base: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
            if members is not None:
                factors = factors.masked_fill(~members, 1)
            return call_scatter_reduce(base, dim, index, factors, "prod", include_self, "fp32",
                                       False, "off", order, offsets, chunk_ends,
                                       ctx.chunk_slots)

        grad_self = None
        if ctx.needs_input_grad[0]:
            input_as_factor = input.masked_fill(input == 0, 1)
            grad_self = grad * product(input_as_factor, src) / input_as_factor
            if not include_self:
                # torch's: an element that no source reaches keeps grad * input / input.
                received = _count_every(input, dim, index, src, reached) > 0
                grad_self = grad_self.masked_fill(received, 0)
        zeros_in_src = src == 0
        lone_zero = zeros_in_src & (_take(_count(input, dim, index, among_members(zeros_in_src)),
                                          dim, index) == 1)
        product_without_lone_zero = product(input, src.masked_fill(lone_zero, 1))
        grad_src = torch.where(lone_zero, _take(grad * product_without_lone_zero, dim, index),
                               _take(grad * result, dim, index)
                               / src.masked_fill(zeros_in_src, 1))
    if members is not None:
        grad_src = grad_src.masked_fill(~members, 0)
    if not include_self and reduce != "prod":
        grad_self = None
        if ctx.needs_input_grad[0]:  # most callers scatter into fresh zeros
            received = _count_every(input, dim, index, src, reached) > 0
            grad_self = grad.masked_fill(received, 0)
    return grad_self, None, None, grad_src, *_NO_MORE_GRADIENTS


_NO_MORE_GRADIENTS = (None,) * 9

call_scatter_reduce = _transforms.register_autograd(scatter_reduce_op, _backward,
                                                    setup_context=_setup_context, caller=_CALLER)


# ---- public function ---------------------------------------------------------------------------

def scatter_reduce(input: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                   reduce: str, *, include_self: bool = True, mode: str | Mode = "fp32",
                   sorted: bool = False, check: str = "host",
                   plan: Plan | None = None) -> torch.Tensor:
    """Out-of-place ``torch.scatter_reduce`` with a fixed, deterministic order.

    Each source position ``k`` along ``dim`` goes to output position ``index[k]`` (a 1-D
    index: whole rows, the fast path) or element by element (an index of ``src``'s full
    shape, as in ``torch.scatter_reduce``). Each output element reduces, in this order:
    ``input``'s own value if ``include_self``, then its source values in increasing ``k``
    (order of appearance along ``dim``). Elements that receive nothing keep ``input``.
    An index of ``src``'s shape that repeats one row index along the other dims runs as fast
    as that 1-D index, with the same bits: found from its strides when it is a stride-0 view
    (``index.view(-1, 1).expand_as(src)``), and, under ``check="host"`` only, by one
    comparison pass when its values are materialised (on a GPU that pass is a host read).

    Args:
        input: float32, float16, bfloat16 or float64; ``src``'s shape except along ``dim``.
        dim: the dimension along which to scatter (negative counts from the end).
        index: int32/int64, 1-D of length ``src.size(dim)``, or ``src``'s shape; values in
            ``[0, input.size(dim))``.
        src: ``input``'s dtype.
        reduce: ``"sum"``, ``"mean"``, ``"prod"``, ``"amax"`` or ``"amin"``.
        include_self: whether ``input``'s values take part (and count for ``"mean"``).
        mode: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.
        sorted: promise that a 1-D ``index`` is nondecreasing. detsum checks the promise
            (one pass over the index, as ``check`` says) and skips building an order.
        check: how ``index``'s values are checked. ``"host"`` (default): read back before
            anything runs; a bad value is an ``IndexError`` naming its position. ``"device"``:
            on the index's device, with no host read (no synchronisation, so the call can be
            captured in a CUDA graph); a bad value fails at the next synchronisation, naming
            the argument. ``"off"``: not checked. On CPU tensors every level checks as
            ``"host"`` does, on every backend. On a GPU ``"off"`` never reads or writes
            outside a tensor: a value outside ``[0, input.size(dim))`` leaves its row (or
            element) out; with ``sorted=True``, an index that is not nondecreasing has its
            rows split by binary search: row ``p`` goes to the output row ``s`` with
            ``searchsorted(index, s) <= p < searchsorted(index, s + 1)`` (none if there is no
            such ``s``). The gradient is that of this result (0 for a row left out); a
            ``"device"`` check that fails launches the same before the failure is reported.
        plan: for a 1-D ``index``, a :func:`detsum.plan` of it into ``input.size(dim)`` rows,
            or None. With a plan, ``index`` is not checked again (the plan's own level and
            ``sorted`` stand for ``check`` and ``sorted``) nor planned, forward or backward:
            the same bits, at the cost of the reduction alone. Without one, a ``"prod"`` that
            autograd records makes one itself, for its forward and backward to share.

    Returns:
        A new contiguous tensor of ``input``'s shape and dtype.

    Order and rounding per reduction (acc = fp32, or fp64 for float64 data):

    - ``"sum"``: ``"fp32"``: accumulate in acc, round once. ``"kahan"``: Neumaier-compensated
      in acc, rounded once (within 1 ulp of exact unless the terms cancel heavily; the bound
      is ``Mode.KAHAN``'s). ``"autograd"``: PyTorch's
      ``index_put_(accumulate=True)`` arithmetic on the device (on CPU: round to the dtype
      after every add).
    - ``"mean"``: ``sum / count`` with the sum kept in acc (Neumaier in ``"kahan"``), the
      division in acc, one rounding; count includes ``input`` when ``include_self``.
      ``"autograd"``: what ``torch.scatter_reduce`` computes on CPU in every layout: the fp32
      sum rounded to the dtype, then divided in fp32 by the count rounded to the dtype (torch
      counts in it: 257 terms are 256 in bfloat16, 2049 are 2048 in float16) and rounded
      again (for fp32 and fp64 data the same bits as ``"fp32"``).
    - ``"exact"`` (``"sum"`` and ``"mean"``): the exact sum (divided by the count for
      ``"mean"``) rounded once: correctly rounded, and the same bits in any order. An exact
      ``"mean"`` divides by at most ``2**30 - 1`` terms: a call in which ``src.size(dim)``
      (plus one with ``include_self``), the most any output element can receive, is larger
      is refused with a ``ValueError`` before any work.
    - ``"prod"``: serial product in acc, rounded once (torch's CPU ``scatter_reduce``
      computes the same), in every mode but ``"exact"``, which refuses it.
    - ``"amax"``/``"amin"``: exact in every mode, ``"exact"`` included. NaN propagates;
      between equal values (``+0.0`` and ``-0.0``) the earlier one is kept, as torch does.

    **This operation is fully deterministic**: the same inputs give the same bits on every
    run, for every thread count and every backend that implements the mode.

    Gradient: with respect to ``input`` and ``src``: ``sum``/``mean`` pass the (divided)
    gradient through; ``amax``/``amin`` share it evenly among all members equal to the result;
    ``prod`` gives each member the product of the others, zeros included, in torch's
    arithmetic and so with its bits: ``grad * product / member`` (a zero input counted as 1
    in its own product; a source that is its element's only zero gets ``grad`` times the
    product with it counted as 1), and, with ``include_self=False``, ``grad * input /
    input`` where no source lands. With ``include_self=False`` only the source members share
    an ``amax``/``amin`` gradient (torch 2.13 also counts an excluded input equal to the
    result, so its source gradients add up to less than the incoming gradient).
    The same under ``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``vmap``; forward
    mode (``jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) raises NotImplementedError
    (docs/determinism.md).

    Example:
        >>> import torch, detsum
        >>> src = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> index = torch.tensor([0, 1, 0, 1])
        >>> detsum.scatter_reduce(torch.zeros(2), 0, index, src, "sum")
        tensor([4., 6.])
        >>> detsum.scatter_reduce(torch.zeros(2), 0, index, src, "amax", include_self=False)
        tensor([3., 4.])
    """
    dim, mode = _checked(input, dim, index, src, reduce, include_self, mode, sorted, check, plan)
    if (plan is None and reduce == "prod" and index.dim() == 1 and torch.is_grad_enabled()
            and (input.requires_grad or src.requires_grad)):
        # The product's backward reduces by the index again: one plan for both.
        plan = plan_for_call(_CALLER, f"input.size({dim})", index, input.shape[dim], sorted,
                             check)
    if plan is not None:
        sorted = plan.sorted
    planning = operator_arguments(plan, check)
    if _dispatch.direct_call_ok(input, index, src):
        return _run(input, dim, index, src, reduce, include_self, mode.value, sorted,
                    check=planning[0], planned=unpack(*planning[1:]))
    return call_scatter_reduce(input, dim, index, src, reduce, include_self, mode.value, sorted,
                               *planning)


def _checked(input, dim, index, src, reduce, include_self, mode, sorted, check, plan):
    """``_check``'s answer; the one remembered (``plans.run_checks_with``) for a call with
    the arguments of its plan's last call, or without a plan of a recent call without one.
    Not a mean's: its check in "exact" mode reads a setting
    (``_validation.check_exact_mean_terms``)."""
    arguments = None
    # The plan's own index only: another view of its memory is compared with it every time.
    if ((plan is None and type(index) is torch.Tensor and reduce != "mean"
         or type(plan) is Plan and index is plan.index)
            and type(input) is torch.Tensor and type(src) is torch.Tensor
            and type(dim) is int and type(reduce) is str
            and type(include_self) is bool and type(sorted) is bool
            and type(mode) in (str, Mode) and type(check) is str
            and not torch.compiler.is_compiling()):
        try:
            arguments = (input.dtype, input.shape, input.device, input.layout, index.dtype,
                         index.shape, index.device, index.layout, src.dtype, src.shape,
                         src.device, src.layout, dim, reduce, include_self, sorted,
                         type(mode), mode, check)
        except RuntimeError:  # a nested tensor has no shape: the checks refuse it
            arguments = None
    return run_checks_with(plan, _CALLER, arguments, _check, input, dim, index, src, reduce,
                           include_self, mode, sorted, check, plan)


#: The names torch_scatter, PyG and torch.Tensor.scatter_ give the reductions that
#: torch.scatter_reduce (and detsum) names otherwise: named in the error for them.
_REDUCTIONS_NAMED_ELSEWHERE = {"add": "sum", "max": "amax", "min": "amin", "mul": "prod",
                               "multiply": "prod"}


def _check(input, dim, index, src, reduce, include_self, mode, sorted, check, plan=None):
    mode = parse_mode(mode, caller=_CALLER)
    _validation.check_level(_CALLER, check)
    _validation.check_flag(_CALLER, "include_self", include_self)
    _validation.check_flag(_CALLER, "sorted", sorted)
    if not isinstance(reduce, str):
        raise TypeError(f"{_CALLER}: reduce={reduce!r} is a {type(reduce).__name__}; expected "
                        f"a str, one of {REDUCTIONS}")
    if reduce not in REDUCTIONS:
        named = _REDUCTIONS_NAMED_ELSEWHERE.get(reduce)
        hint = f", torch.scatter_reduce's names ({named!r} for {reduce!r})" if named else ""
        raise ValueError(f"{_CALLER}: reduce={reduce!r} is not supported; expected one of "
                         f"{REDUCTIONS}{hint}")
    if reduce == "prod" and mode is Mode.EXACT:
        raise ValueError(f"{_CALLER}: reduce='prod' has no mode='exact': an exact product needs "
                         f"the bits of every factor (each multiply adds a significand's worth), "
                         f"so it cannot be kept in a fixed state; expected mode='fp32' or "
                         f"'kahan' for a product")
    _validation.check_float(_CALLER, "input", input)
    _validation.check_float(_CALLER, "src", src)
    _validation.check_index(_CALLER, "index", index, one_d=False)
    dim = _validation.check_dim(_CALLER, dim, input.dim())
    _validation.check_same_dtype(_CALLER, "input", input, "src", src)
    _validation.check_shapes_except_dim(_CALLER, "input", input, "src", src, dim)
    rowwise = index.dim() == 1 and index.shape[0] == src.shape[dim]
    if not rowwise and index.shape != src.shape:
        raise ValueError(f"{_CALLER}: index has shape {tuple(index.shape)}; expected "
                         f"({src.shape[dim]},) (whole rows) or src's shape {tuple(src.shape)}")
    if sorted and index.dim() != 1:
        raise ValueError(f"{_CALLER}: sorted=True needs a 1-D index, got shape {tuple(index.shape)}")
    _validation.check_same_device(_CALLER, input=input, index=index, src=src)
    if plan is not None:
        if not rowwise:
            raise ValueError(f"{_CALLER}: plan is given with an index of shape "
                             f"{tuple(index.shape)}; expected a 1-D index (a plan orders whole "
                             f"rows)")
        check_plan(_CALLER, plan, index, input.shape[dim], f"input.size({dim})",
                   index.shape[0], "len(index)")
    if reduce == "mean" and mode is Mode.EXACT:
        _validation.check_exact_mean_terms(
            _CALLER, src.shape[dim] + include_self,
            f"src.size({dim}) = {src.shape[dim]}" + (" and input's own value, include_self=True"
                                                     if include_self else ""))
    return dim, mode
