"""segment_sum: reduce contiguous (or permuted) runs of rows given by CSR offsets."""

from __future__ import annotations

import functools

import torch

from detsum import _dispatch, _replay, _segments, _transforms, _validation, kernels, reference
from detsum.backend import current_backend
from detsum.modes import MODE_BY_NAME, Mode, parse_mode, rule_for
from detsum.plans import (Plan, aligned, call_with_plan, check_plan, launches_again,
                          run_checks_with)
from detsum.ops.index_add import call_index_add

_CALLER = "detsum.segment_sum"
# The failures of check="device", by the number of rows.
_OFFSETS_BAD = "offsets do not run from 0 to src.size(dim) = {} without decreasing"
_INNER_OFFSETS_BAD = "offsets decrease, or leave [0, src.size(dim) = {}]"
_PERM_OUT_OF_RANGE = "perm has a value outside [0, src.size(dim) = {})"


# ---- operator ---------------------------------------------------------------------------------

def _check_values(offsets: torch.Tensor, perm: torch.Tensor | None, num_rows: int,
                  check: str) -> None:
    """Check offsets (and perm) as ``check`` says (``_segments.check_that_runs``)."""
    if check == "host":
        (_check_on_cpu if offsets.device.type == "cpu" else _check_on_host)(
            offsets, perm, num_rows)
    elif check == "device":
        _validation.assert_on_device(
            (offsets[0] == 0) & (offsets[-1] == num_rows) & ~_decreasing(offsets), _CALLER,
            _OFFSETS_BAD.format(num_rows))
        if perm is not None and perm.numel():
            _validation.assert_on_device(~_perm_out_of_range(perm, num_rows), _CALLER,
                                         _PERM_OUT_OF_RANGE.format(num_rows))


def _decreasing(offsets: torch.Tensor) -> torch.Tensor:
    return (offsets[1:] < offsets[:-1]).any()


def _perm_out_of_range(perm: torch.Tensor, num_rows: int) -> torch.Tensor:
    return ((perm < 0) | (perm >= num_rows)).any()


def _check_on_host(offsets: torch.Tensor, perm: torch.Tensor | None, num_rows: int) -> None:
    """``_check_values`` under "host" for a GPU's tensors: one fused reduction, one host read."""
    checks = [offsets[0], offsets[-1], _decreasing(offsets).to(offsets.dtype)]
    if perm is not None and perm.numel():
        checks.append(_perm_out_of_range(perm, num_rows).to(offsets.dtype))
    _raise_first_problem(offsets, perm, num_rows, *torch.stack(checks).tolist())


def _check_on_cpu(offsets: torch.Tensor, perm: torch.Tensor | None, num_rows: int) -> None:
    """``_check_values`` under "host" for CPU tensors, in NumPy on their memory: a small
    call's check in about 3 us, where ``_check_on_host``'s torch ops take 12."""
    values = offsets.numpy()
    perm_bad = []
    if perm is not None and perm.numel():
        rows = perm.numpy()
        perm_bad.append(bool(((rows < 0) | (rows >= num_rows)).any()))
    _raise_first_problem(offsets, perm, num_rows, int(values[0]), int(values[-1]),
                         bool((values[1:] < values[:-1]).any()), *perm_bad)


def _raise_first_problem(offsets, perm, num_rows, first, last, decreasing, *perm_bad) -> None:
    """The error for the first failed check of ``_check_values``, if any failed."""
    if first != 0:
        raise ValueError(f"{_CALLER}: offsets[0] = {first}; expected 0")
    if last != num_rows:
        raise ValueError(f"{_CALLER}: offsets[-1] = {last}; expected src.size(dim) = {num_rows}")
    if decreasing:
        s = int((offsets[1:] < offsets[:-1]).nonzero()[0])
        raise ValueError(f"{_CALLER}: offsets decrease at position {s + 1} "
                         f"({int(offsets[s])} then {int(offsets[s + 1])}); expected nondecreasing")
    if perm_bad and perm_bad[0]:
        bad = int(((perm < 0) | (perm >= num_rows)).nonzero()[0])
        _validation.raise_index_out_of_range(_CALLER, "perm", perm, bad, num_rows, "src.size(dim)")


def _as_launched(offsets: torch.Tensor, perm: torch.Tensor | None, num_rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unchecked offsets and perm as the launch takes them, inside ``src`` whatever their
    values (the same for valid ones): offsets clamped into ``[0, N]`` and made nondecreasing,
    perm values clamped into ``[0, N)``. Torch ops on the device: no host read."""
    offsets = _segments.unchecked_offsets(offsets, num_rows)
    if perm is not None:
        perm = perm.clamp(0, max(num_rows - 1, 0))
    return offsets, perm


def _segment_sum(src, offsets, dim, perm, acc_mode, check="host", rows=None, chunk_ends=None,
                 chunk_slots=-1, offsets_checked=False, inner_offsets=False):
    """The operator's body (also called directly, see ``_dispatch``). ``rows``: the output
    row of each source row, given with the positions of a ``detsum.Plan`` (checked when it was
    made, and inside every tensor whatever its level): nothing to check here. Nor with
    ``offsets_checked``, which says the caller (in detsum, not an operator's argument) has
    checked what "host" would: ``offsets`` run from 0 to ``src.size(dim)`` without
    decreasing, and ``perm`` is None. ``inner_offsets`` (in detsum too, with no plan and no
    ``perm``): ``offsets`` are the inner bounds of segments that run from 0 to
    ``src.size(dim)``, one segment more than the offsets, and are checked as that padded
    sequence (the Triton launch reads them so, with no padded copy:
    ``kernels.UncheckedOffsets``' ``padded``). ``chunk_ends``
    and ``chunk_slots``: the chunk split of the segments (``kernels.chunk_ends`` and the number
    of chunks), or ``chunk_slots=0`` alone when no segment is longer than
    ``kernels.CHUNK_TERMS``; -1: the launch counts them. With a plan, a call of an earlier
    call's signature makes that call's launch again (``plans.call_with_plan``); without one,
    from a record of an earlier call's device work (``_replay.call``)."""
    if rows is None and chunk_ends is None and _replay.replays(src, check):
        return _replay.call(
            _CALLER,
            (src.dtype, src.shape, src.stride(), src.device, offsets.dtype, offsets.shape,
             offsets.stride(), offsets.device, None if perm is None else
             (perm.dtype, perm.shape, perm.stride(), perm.device, aligned(perm),
              perm is offsets),
             dim, acc_mode, check, chunk_slots, offsets_checked, inner_offsets, aligned(src),
             aligned(offsets), _segments.launch_settings(), *_replay.path_settings()),
            (src, offsets) if perm is None else (src, offsets, perm),
            lambda: _whole_path(src, offsets, dim, perm, acc_mode, check, None, None,
                                chunk_slots, offsets_checked, inner_offsets))
    if rows is None or not launches_again(src, offsets):
        return _whole_path(src, offsets, dim, perm, acc_mode, check, rows, chunk_ends,
                           chunk_slots, offsets_checked, inner_offsets)
    return call_with_plan(
        _CALLER, offsets, (perm, rows, chunk_ends),
        (src.dtype, src.shape, src.stride(), src.device, dim, acc_mode, check, chunk_slots,
         aligned(src), _segments.launch_settings()),
        (src,), lambda: _segments.new_output_shaped(src, _out_shape(src, dim, offsets)),
        lambda: _whole_path(src, offsets, dim, perm, acc_mode, check, rows, chunk_ends,
                            chunk_slots, offsets_checked))


def _whole_path(src, offsets, dim, perm, acc_mode, check, rows, chunk_ends, chunk_slots,
                offsets_checked, inner_offsets=False):
    """``_segment_sum``'s checks, bounds and launch."""
    num_rows = src.shape[dim]
    device_type = src.device.type
    backend_name = current_backend(device_type, _CALLER)
    check = _segments.check_that_runs(check, device_type, backend_name)
    if inner_offsets and not (backend_name == "triton" and check != "host"):
        # Only the Triton launch reads inner offsets, and checks them in its kernel.
        offsets, inner_offsets = kernels.padded_offsets(offsets, num_rows), False
    if backend_name == "numba" and rows is None and perm is None:
        # A small call in one Numba call that checks the offsets too (their check, the views
        # and the general launch cost it three times its arithmetic); bad offsets are named
        # by the general path's check below.
        src3 = _segments.rows_view(src, dim)
        out3 = _segments.small_segment_reduce(
            src3, offsets, "sum",
            rule_for(MODE_BY_NAME[acc_mode], "sum", device_type, src3.shape[2]))
        if out3 is not None:
            return out3.view(*_out_shape(src, dim, out3.shape[1]))
    bounds, perm_in_range = offsets, None
    if rows is not None:
        pass  # a plan's: checked when it was made
    elif offsets_checked:
        bounds = _int64(offsets)
    elif backend_name == "triton" and (check != "host" or perm is None):
        bounds = kernels.UncheckedOffsets(
            offsets, num_rows, _failure(offsets, num_rows, check, inner_offsets),
            padded=inner_offsets)
        if perm is not None:
            # perm's check, asserted after the launch's own (the order of the reports is
            # the order of the checks); the launch reads perm clamped.
            if check == "device":
                perm_in_range = ~((perm < 0) | (perm >= num_rows)).any()
            perm = perm.clamp(0, max(num_rows - 1, 0))
    else:
        _check_values(offsets, perm, num_rows, check)
        if check != "host":
            # Under "device" too: on a GPU the launch runs before a failed check is reported.
            offsets, perm = _as_launched(offsets, perm, num_rows)
        bounds = _int64(offsets)
    if backend_name == "reference":
        return reference.segment_sum(src, offsets, dim=dim, perm=perm, mode=acc_mode)
    segments = offsets.numel() + 1 if inner_offsets else offsets.numel() - 1
    src3 = _segments.rows_view(src, dim)
    out3 = _segments.new_output(src3, segments)
    order = None if perm is None else _int64(perm)
    _segments.launch(backend_name, src3, order, bounds, None, out3,
                     reduce="sum",
                     rule=rule_for(MODE_BY_NAME[acc_mode], "sum", device_type, src3.shape[2]),
                     alpha=1.0, include_base=False,
                     chunks=None if chunk_slots < 0 else (chunk_ends, chunk_slots))
    if perm_in_range is not None:
        _validation.assert_on_device(perm_in_range, _CALLER, _PERM_OUT_OF_RANGE.format(num_rows))
    return out3.view(*_out_shape(src, dim, segments))  # sizes one by one: parsed faster


def _failure(offsets: torch.Tensor, num_rows: int, check: str, inner_offsets: bool = False
             ) -> kernels.Failure | None:
    """How the launch that checks ``offsets`` itself reports bad ones, as ``check`` says: on
    the host with the errors of ``_check_values``, or by an assert on the device."""
    if check == "host":
        return functools.partial(_check_values, offsets, None, num_rows, "host")
    if check == "device":
        return _validation.device_check_message(
            _CALLER, (_INNER_OFFSETS_BAD if inner_offsets else _OFFSETS_BAD).format(num_rows))
    return None


def _int64(t: torch.Tensor) -> torch.Tensor:
    # t.to(torch.int64) returns t itself when it is int64 already, after a microsecond of
    # argument parsing: a plan's positions always are.
    return t if t.dtype == torch.int64 else t.to(torch.int64)


@torch.library.custom_op("detsum::segment_sum", mutates_args=())
def segment_sum_op(src: torch.Tensor, offsets: torch.Tensor, dim: int,
                   perm: torch.Tensor | None, acc_mode: str, check: str = "host",
                   rows: torch.Tensor | None = None, chunk_ends: torch.Tensor | None = None,
                   chunk_slots: int = -1) -> torch.Tensor:
    return _segment_sum(src, offsets, dim, perm, acc_mode, check, rows, chunk_ends, chunk_slots)


def _out_shape(src: torch.Tensor, dim: int, offsets: torch.Tensor | int) -> list[int]:
    """``src``'s shape with ``dim`` the number of segments: of ``offsets``, or given."""
    shape = list(src.shape)
    shape[dim] = offsets if isinstance(offsets, int) else offsets.shape[0] - 1
    return shape


@segment_sum_op.register_fake
def _(src, offsets, dim, perm, acc_mode, check="host", rows=None, chunk_ends=None,
      chunk_slots=-1):
    return src.new_empty(_out_shape(src, dim, offsets))


# ---- autograd: each source row receives its segment's gradient row ---------------------------

def _setup_context(ctx, inputs, output):
    src, offsets, dim, perm, acc_mode, *rest = inputs
    rows = rest[1] if len(rest) > 1 else None
    ctx.save_for_backward(offsets, perm, rows)
    ctx.dim, ctx.acc_mode, ctx.src_shape = dim, acc_mode, src.shape
    ctx.check = rest[0] if rest else "host"


_NO_MORE_GRADIENTS = (None,) * 8


def _backward(ctx, grad):
    offsets, perm, rows = ctx.saved_tensors
    dim, num_rows = ctx.dim, ctx.src_shape[ctx.dim]
    check = _segments.backward_check(ctx.check, grad.device.type)
    if rows is not None:
        grad_src = _backward_planned(ctx, grad, rows, offsets.numel() - 1, check)
        return grad_src, *_NO_MORE_GRADIENTS
    if check != "host":
        return _backward_unchecked(ctx, grad, offsets, perm, check), *_NO_MORE_GRADIENTS
    counts = offsets[1:] - offsets[:-1]
    segment_of_position = torch.repeat_interleave(
        torch.arange(counts.numel(), device=grad.device), counts, output_size=num_rows)
    grad_positions = grad.index_select(dim, segment_of_position)
    if perm is None:
        return grad_positions, *_NO_MORE_GRADIENTS
    # perm may repeat a row; adding (not copying) gives the right gradient then, and for a true
    # permutation each row receives exactly one term, so the sum is exact in every mode. Its
    # values were checked by the forward call (as its check said): none here, no host read.
    grad_src = call_index_add(grad.new_zeros(ctx.src_shape), dim, perm, grad_positions, 1.0,
                              ctx.acc_mode, "off")
    return grad_src, *_NO_MORE_GRADIENTS


def _backward_planned(ctx, grad, rows, num_segments, check):
    """The gradient of a sum by a plan: row ``r`` received its segment's gradient row, the
    segment being ``rows[r]`` (the plan's index), so a gather gives it, with no sort. A plan
    made at "off" left the rows of bad values out: they receive 0."""
    dim = ctx.dim
    if check == "host":
        return grad.index_select(dim, rows)
    if num_segments == 0:  # every value is out of range: every row was left out
        return grad.new_zeros(ctx.src_shape)
    clamped, in_range = _segments.clamped_index(rows, num_segments)
    grad_src = grad.index_select(dim, clamped)
    if check == "off":
        shape = [1] * grad.dim()
        shape[dim] = rows.numel()
        grad_src = grad_src.masked_fill(~in_range.view(shape), 0)
    return grad_src


def _backward_unchecked(ctx, grad, offsets, perm, check):
    """The gradient of what the forward launched on values it did not check (``_as_launched``),
    inside every tensor: each position in a segment passes its segment's gradient row to its
    row, and the rows before the first segment and after the last receive nothing. Under
    "device" a bad value has failed already, so only the bounds matter there: the rows outside
    every segment then receive a gradient row of their own too (no pass to clear them)."""
    dim, num_rows = ctx.dim, ctx.src_shape[ctx.dim]
    num_segments = offsets.numel() - 1
    if num_segments == 0 or num_rows == 0:
        return grad.new_zeros(ctx.src_shape)
    offsets, perm = _as_launched(offsets, perm, num_rows)
    # Counts of the rows before the first segment, of each segment and of the rows after the
    # last: they add up to num_rows exactly, as repeat_interleave's output_size must.
    counts = torch.cat([offsets[:1], offsets[1:] - offsets[:-1], num_rows - offsets[-1:]])
    segment_of_position = torch.repeat_interleave(
        torch.arange(-1, num_segments + 1, device=grad.device), counts, output_size=num_rows)
    in_a_segment = (segment_of_position >= 0) & (segment_of_position < num_segments)
    grad_positions = grad.index_select(dim, segment_of_position.clamp(0, num_segments - 1))
    if perm is None:
        if check == "off":
            shape = [1] * grad.dim()
            shape[dim] = num_rows
            grad_positions = grad_positions.masked_fill(~in_a_segment.view(shape), 0)
        return grad_positions
    # A position outside every segment goes to row num_rows: left out by index_add's "off".
    rows = torch.where(in_a_segment, perm, num_rows)
    return call_index_add(grad.new_zeros(ctx.src_shape), dim, rows, grad_positions, 1.0,
                          ctx.acc_mode, "off")


call_segment_sum = _transforms.register_autograd(segment_sum_op, _backward,
                                                 setup_context=_setup_context, caller=_CALLER)


# ---- public function ---------------------------------------------------------------------------

def segment_sum(src: torch.Tensor, offsets: torch.Tensor | None = None, *, dim: int = 0,
                perm: torch.Tensor | None = None, mode: str | Mode = "fp32",
                check: str = "host", plan: Plan | None = None) -> torch.Tensor:
    r"""Sum runs of rows of ``src`` along ``dim``, segment by segment, deterministically.

    ``offsets`` is a CSR pointer: output row ``s`` (along ``dim``) is

    .. math:: \mathrm{out}_s = \sum_{p=\mathrm{offsets}[s]}^{\mathrm{offsets}[s+1]-1} \mathrm{src}_{r(p)}

    with :math:`r(p) = p`, or :math:`r(p) = \mathrm{perm}[p]` when ``perm`` is given: a fused
    gather that never copies ``src``. Empty segments give 0.

    Args:
        src: ``[..., N, ...]`` float32, float16, bfloat16 or float64, any strides.
        offsets: 1-D int32/int64 ``[S + 1]``, nondecreasing, ``offsets[0] == 0``,
            ``offsets[-1] == N``.
        dim: the dimension of ``src`` that is segmented (negative counts from the end).
        perm: optional 1-D int32/int64 ``[N]`` of row numbers in ``[0, N)``.
        mode: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.
        check: how the values of ``offsets`` and ``perm`` are checked. ``"host"`` (default):
            read back before anything runs, with an error naming the first bad position.
            ``"device"``: on their device, with no host read (no synchronisation, so the call
            can be captured in a CUDA graph); bad values fail at the next synchronisation.
            ``"off"``: not checked. On CPU tensors every level checks as ``"host"`` does, on
            every backend. On a GPU ``"off"`` never reads or writes outside a tensor: it sums
            with ``offsets`` clamped into ``[0, N]`` and made nondecreasing (each the largest
            value up to it; the rows before the first offset and from the last on are then
            left out) and ``perm`` values clamped into ``[0, N)``, and the gradient is that
            of this sum. A ``"device"`` check that fails is reported after a launch that
            stays inside every tensor too, whose result is then unspecified (the offsets
            are checked by the launch itself; a GPU's failed check ends its CUDA context).
        plan: instead of ``offsets`` and ``perm``, a :func:`detsum.plan` of an index of
            length ``N`` into ``S`` rows: output row ``s`` then sums the rows ``k`` with
            ``index[k] == s`` in increasing ``k`` (``offsets=plan.offsets``,
            ``perm=plan.order``), checked when the plan was made, not again (the plan's own
            level stands for ``check``); the gradient is then a gather by the plan's index.

    Returns:
        ``src``'s shape with ``dim`` of size ``S``, contiguous, of ``src``'s dtype.

    Summation order and rounding (each segment sums in the order ``p = offsets[s], ...``):

    - ``"fp32"``: accumulate in fp32 (fp64 for float64), round to the dtype once.
    - ``"kahan"``: Neumaier-compensated sum in the same accumulator, rounded once
      (``RN(s + c)``, or ``s`` itself when ``c == 0`` so that -0.0 stays -0.0); within 1 ulp
      of the exact sum unless the terms cancel heavily: ``|out - S| <=
      ulp(out) + 2 N**2 u**2 sum|x_i|`` for N values (u: 2**-24, or 2**-53 for fp64).
    - ``"autograd"``: what PyTorch's own accumulation gives on the device (on CPU: round to
      the dtype after every add, from 0), i.e. the gradient autograd computes for
      ``src[r(p)]`` rows gathered into these segments.
    - ``"exact"``: the exact sum of the segment's rows, rounded once to the dtype (correctly
      rounded; -0.0 only when every term is -0.0). It does not depend on the order at all:
      any permutation of a segment's rows gives the same bits.

    **This operation is fully deterministic**: the same inputs give the same bits on every
    run, for every thread count and every backend that implements the mode.

    Gradient: each row ``r(p)`` receives its segment's gradient row (exact).
    The same under ``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``vmap``; forward
    mode (``jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) raises NotImplementedError
    (docs/determinism.md).

    Example:
        >>> import torch, detsum
        >>> src = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        >>> detsum.segment_sum(src, torch.tensor([0, 2, 2, 3]))
        tensor([[4., 6.],
                [0., 0.],
                [5., 6.]])
        >>> detsum.segment_sum(src, torch.tensor([0, 1, 3]), perm=torch.tensor([2, 0, 1]))
        tensor([[5., 6.],
                [4., 6.]])
    """
    dim, mode = _checked(src, offsets, dim, perm, mode, check, plan)
    planning = (check,)
    if plan is not None:
        offsets, perm = plan.offsets, plan.order
        planning = (plan.check, plan.index, plan.chunk_ends, plan.chunk_slots)
    if _dispatch.direct_call_ok(src, offsets, perm):
        return _segment_sum(src, offsets, dim, perm, mode.value, *planning)
    return call_segment_sum(src, offsets, dim, perm, mode.value, *planning)


def _checked(src, offsets, dim, perm, mode, check, plan):
    """``_check``'s answer; the one remembered (``plans.run_checks_with``) for a call with
    the arguments of its plan's last call, or without a plan (nor ``perm``) of a recent call
    without one. The offsets' values are checked where they are read, at every call."""
    arguments = None
    if (type(src) is torch.Tensor and type(dim) is int and type(mode) in (str, Mode)
            and type(check) is str and perm is None and not torch.compiler.is_compiling()):
        try:
            if type(plan) is Plan and offsets is None:
                arguments = (src.dtype, src.shape, src.device, src.layout, plan.index.shape,
                             plan.offsets.device, dim, type(mode), mode, check)
            elif plan is None and type(offsets) is torch.Tensor:
                arguments = (src.dtype, src.shape, src.device, src.layout, offsets.dtype,
                             offsets.shape, offsets.device, offsets.layout, dim, type(mode),
                             mode, check)
        except RuntimeError:  # a nested tensor has no shape: the checks refuse it
            arguments = None
    return run_checks_with(plan, _CALLER, arguments, _check, src, offsets, dim, perm, mode,
                           check, plan)


def _check(src, offsets, dim, perm, mode, check, plan):
    mode = parse_mode(mode, caller=_CALLER)
    _validation.check_level(_CALLER, check)
    _validation.check_float(_CALLER, "src", src)
    if plan is not None:
        if offsets is not None or perm is not None:
            raise ValueError(f"{_CALLER}: plan is given with offsets or perm; expected either "
                             f"plan alone (it holds both) or offsets (and perm) without it")
        dim = _validation.check_dim(_CALLER, dim, src.dim())
        check_plan(_CALLER, plan, None, None, "its number of segments", src.shape[dim],
                   f"src.size({dim})")
        _validation.check_same_device(_CALLER, src=src, plan=plan.offsets)
        return dim, mode
    if offsets is None:
        raise TypeError(f"{_CALLER}: offsets is missing; expected the segments' CSR offsets, "
                        f"or plan=")
    # Malformed offsets are a ValueError whatever is wrong with them, their dtype included.
    _validation.check_index(_CALLER, "offsets", offsets, one_d=True, dtype_error=ValueError)
    if offsets.numel() == 0:
        raise ValueError(f"{_CALLER}: offsets is empty; expected at least one entry (offsets[0] == 0)")
    dim = _validation.check_dim(_CALLER, dim, src.dim())
    if perm is not None:
        _validation.check_index(_CALLER, "perm", perm, one_d=True)
        if perm.shape[0] != src.shape[dim]:
            raise ValueError(f"{_CALLER}: perm has length {perm.shape[0]}; expected "
                             f"src.size({dim}) = {src.shape[dim]}")
    _validation.check_same_device(_CALLER, src=src, offsets=offsets, perm=perm)
    return dim, mode
