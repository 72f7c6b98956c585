"""index_add / index_add_: torch.index_add semantics with a chosen, deterministic order."""

from __future__ import annotations

import torch

from detsum import _dispatch, _replay, _segments, _transforms, _validation, reference
from detsum.backend import current_backend
from detsum.modes import MODE_BY_NAME, Mode, parse_mode, rule_for
from detsum.plans import (Plan, Planned, aligned, call_with_plan, check_plan, launches_again,
                          operator_arguments, run_checks_with, unpack)

_CALLER = "detsum.index_add"
_IN_PLACE_CALLER = "detsum.index_add_"


# ---- operators: out of place and in place -------------------------------------------------------

def _run(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
         alpha: float, mode: str, *, in_place: bool = False, check: str = "host",
         planned: Planned | None = None, caller: str = _CALLER) -> torch.Tensor:
    """The shared body: validate index values (as ``check`` says), plan, launch. Returns the
    result's rows view (``_segments.rows_view``); ``in_place``: written into ``input``'s own
    rows view, which ``input`` must be contiguous to have. ``planned``: the positions of a
    ``detsum.Plan`` of ``index``, checked when it was made: nothing to check or plan here.
    ``caller``: the function an error names."""
    device_type = input.device.type
    backend_name = current_backend(device_type, caller)
    check = _segments.check_that_runs(check, device_type, backend_name)
    out3 = _segments.rows_view(input, dim) if in_place else None
    if backend_name == "reference":
        return _run_reference(input, dim, index, source, alpha, mode, out3, check, planned,
                              caller)
    # Out of place, every output row is written either way: a scanned index goes straight to
    # its launch. In place, the rows without terms are better left as they are.
    if planned is None and not (out3 is None
                                and _segments.scans_index(backend_name, index, False)):
        sparse = _segments.rows_with_terms(caller, index, input.shape[dim], index_name="index",
                                           size_name=f"input.size({dim})", check=check)
        if sparse is not None:
            return _run_on_rows_with_terms(input, dim, *sparse, source, alpha, mode, out3,
                                           backend_name)
    if backend_name == "numba":
        small = _run_small(input, dim, index, source, alpha, mode, out3, caller)
        if small is not None:
            return small
        if planned is None and alpha == 1:
            streamed = _run_streamed(input, dim, index, source, mode, out3, caller)
            if streamed is not None:
                return streamed
    if planned is None:
        planned = (*_plan(input, dim, index, backend_name, check, caller), None)
    # The index goes along for the chunks of long segments to find their segments by.
    return _launch(backend_name, input, dim, source, alpha, mode, planned, out3, keys=index)


def _plan(input: torch.Tensor, dim: int, index: torch.Tensor, backend_name: str,
          check: str, caller: str) -> tuple:
    """(order, offsets) of ``index``'s rows, after checking its values as ``check`` says
    (``_segments.plan_from_index``: at "host", a bad value raises with ``input`` untouched)."""
    return _segments.plan_from_index(
        caller, index, input.shape[dim], index_name="index", size_name=f"input.size({dim})",
        promised_sorted=False, backend_name=backend_name, check=check, as_keys=True)


def _run_reference(input, dim, index, source, alpha, mode, out3, check, planned, caller):
    """``_run`` on the reference backend, after the same checks of ``index``'s values."""
    if planned is None:
        _plan(input, dim, index, "reference", check, caller)
    result = reference.index_add(input, dim, index, source, alpha=alpha, mode=mode)
    if out3 is None:
        return result
    out3.copy_(_segments.rows_view(result, dim))
    return out3


def _run_on_rows_with_terms(input, dim, targets, positions, source, alpha, mode, out3,
                            backend_name):
    """``_run`` where few of ``input``'s rows receive terms: those rows (``targets``) alone go
    through the kernel, their terms at ``positions`` among them (checked already), and the
    others are copied (``_segments.rows_with_terms``: the same bits)."""
    rows_in = input.index_select(dim, targets)
    # Checked once already (on a GPU, that check is a host read).
    order, offsets = _segments.plan_from_keys(positions, rows_in.shape[dim], backend_name,
                                              as_keys=True)
    rows = _launch(backend_name, rows_in, dim, source, alpha, mode, (order, offsets, None), None)
    if out3 is None:
        input3 = _segments.rows_view(input, dim)
        out3 = _segments.new_output_like(input3)
        out3.copy_(input3)
    out3.index_copy_(1, targets, rows)
    return out3


def _run_small(input, dim, index, source, alpha, mode, out3, caller):
    """``_run`` as one Numba call without a plan (``_segments.small_index_add``), or None where
    that call does not fit."""
    # In place, out3 is input's own view: one view fewer, and the kernel reads it once.
    input3 = _segments.rows_view(input, dim) if out3 is None else out3
    return _segments.small_index_add(
        caller, _segments.rows_view(source, dim), index, input3, out3, alpha,
        rule_for(MODE_BY_NAME[mode], "sum", "cpu", input3.shape[2]), f"input.size({dim})")


def _run_streamed(input, dim, index, source, mode, out3, caller):
    """``_run`` as one pass without a plan (``_segments.streamed_scatter``), or None where
    that pass is not taken."""
    input3 = _segments.rows_view(input, dim) if out3 is None else out3
    return _segments.streamed_scatter(
        caller, _segments.rows_view(source, dim), index, input3, out3, "sum", True,
        rule_for(MODE_BY_NAME[mode], "sum", "cpu", input3.shape[2]), f"input.size({dim})")


def _launch(backend_name, input, dim, source, alpha, mode, planned, out3, keys=None):
    """``input`` plus ``alpha * source``'s rows in ``planned``'s order, by ``backend_name``'s
    kernel, into ``out3`` (a new output when None). ``keys``: the index ``planned`` was made
    from (``_segments.launch``)."""
    order, offsets, chunks = planned
    input3 = _segments.rows_view(input, dim)
    if out3 is None:
        out3 = _segments.new_output_like(input3)
    _segments.launch(backend_name, _segments.rows_view(source, dim), order, offsets, input3, out3,
                     reduce="sum",
                     rule=rule_for(MODE_BY_NAME[mode], "sum", input.device.type, input3.shape[2]),
                     alpha=alpha, include_base=True, chunks=chunks, keys=keys)
    return out3


def _index_add(input, dim, index, source, alpha, acc_mode, check="host", order=None,
               offsets=None, chunk_ends=None, chunk_slots=-1):
    """The out-of-place operator's body (also called directly, see ``_dispatch``). With a
    plan, a call of an earlier call's signature makes that call's launch again
    (``plans.call_with_plan``); without one, it is made again from a record of the earlier
    call's device work (``_replay.call``)."""
    def whole_path():
        # view(*sizes): torch parses sizes one by one in half the time it takes a torch.Size.
        return _run(input, dim, index, source, alpha, acc_mode, check=check,
                    planned=unpack(order, offsets, chunk_ends, chunk_slots)).view(*input.shape)

    if offsets is None:
        if _replay.replays(input, check):
            return _replay.call(_CALLER, _unplanned_signature(input, dim, index, source, alpha,
                                                              acc_mode, check),
                                (input, index, source), whole_path)
        return whole_path()
    if not launches_again(input, offsets):
        return whole_path()
    return call_with_plan(_CALLER, offsets, (order, index, chunk_ends),
                          _signature(input, dim, source, alpha, acc_mode, check, chunk_slots),
                          (source, input), lambda: _segments.new_output_like(input),
                          whole_path)


def _signature(input, dim, source, alpha, acc_mode, check, chunk_slots) -> tuple:
    """What decides a call's launch besides its plan (``plans.call_with_plan``)."""
    return (input.dtype, input.shape, input.stride(), input.device, source.dtype,
            source.shape, source.stride(), source.device, dim, alpha, acc_mode, check,
            chunk_slots, aligned(input), aligned(source), _segments.launch_settings())


def _unplanned_signature(input, dim, index, source, alpha, acc_mode, check) -> tuple:
    """What decides a call's path without a plan besides its tensors' values
    (``_replay.call``)."""
    return (*_signature(input, dim, source, alpha, acc_mode, check, -1), index.dtype,
            index.shape, index.stride(), aligned(index), source is input,
            *_replay.path_settings())


@torch.library.custom_op("detsum::index_add", mutates_args=())
def index_add_op(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
                 alpha: float, acc_mode: str, check: str = "host",
                 order: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 chunk_ends: torch.Tensor | None = None, chunk_slots: int = -1
                 ) -> torch.Tensor:
    return _index_add(input, dim, index, source, alpha, acc_mode, check, order, offsets,
                      chunk_ends, chunk_slots)


@index_add_op.register_fake
def _(input, dim, index, source, alpha, acc_mode, check="host", order=None, offsets=None,
      chunk_ends=None, chunk_slots=-1):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _index_add_inplace(input, dim, index, source, alpha, acc_mode, check="host", order=None,
                       offsets=None, chunk_ends=None, chunk_slots=-1):
    """The in-place operator's body (also called directly, see ``_dispatch``), made again
    as the out-of-place one is."""
    # Here, not only in the public function: a compiled graph calls this operator directly.
    _validation.check_inplace_target(_IN_PLACE_CALLER, "input", input, index=index,
                                     source=source)
    add_into_checked_target(input, dim, index, source, alpha, acc_mode, check, order, offsets,
                            chunk_ends, chunk_slots)


def add_into_checked_target(input, dim, index, source, alpha, acc_mode, check="host",
                            order=None, offsets=None, chunk_ends=None, chunk_slots=-1):
    """``_index_add_inplace`` for a caller that has checked what its
    ``check_inplace_target`` checks (``input`` changeable, with distinct elements, sharing no
    memory with ``index`` and ``source``): the switch, before it takes a call."""
    planned = unpack(order, offsets, chunk_ends, chunk_slots)
    if input.is_contiguous():
        # The kernels read every element of input before the same thread writes it, so the
        # result can go straight into input's storage.
        def whole_path():
            _run(input, dim, index, source, alpha, acc_mode, in_place=True, check=check,
                 planned=planned, caller=_IN_PLACE_CALLER)

        if offsets is None:
            if _replay.replays(input, check):
                _replay.call(_IN_PLACE_CALLER, _unplanned_signature(
                    input, dim, index, source, alpha, acc_mode, check), (input, index, source),
                    whole_path)
            else:
                whole_path()
        elif not launches_again(input, offsets):
            whole_path()
        else:  # an earlier call's launch made again where the signature allows
            call_with_plan(_IN_PLACE_CALLER, offsets, (order, index, chunk_ends),
                           _signature(input, dim, source, alpha, acc_mode, check,
                                      chunk_slots), (source, input), None, whole_path)
    else:
        input.copy_(_run(input, dim, index, source, alpha, acc_mode, check=check,
                         planned=planned, caller=_IN_PLACE_CALLER).view(input.shape))


@torch.library.custom_op("detsum::index_add_", mutates_args=("input",))
def index_add_inplace_op(input: torch.Tensor, dim: int, index: torch.Tensor,
                         source: torch.Tensor, alpha: float, acc_mode: str,
                         check: str = "host", order: torch.Tensor | None = None,
                         offsets: torch.Tensor | None = None,
                         chunk_ends: torch.Tensor | None = None, chunk_slots: int = -1) -> None:
    _index_add_inplace(input, dim, index, source, alpha, acc_mode, check, order, offsets,
                       chunk_ends, chunk_slots)


@index_add_inplace_op.register_fake
def _(input, dim, index, source, alpha, acc_mode, check="host", order=None, offsets=None,
      chunk_ends=None, chunk_slots=-1):
    return None


# ---- autograd: input passes through, source gathers its target rows ---------------------------

def _setup_context(ctx, inputs, output):
    input, dim, index, _, alpha, _, *rest = inputs
    ctx.save_for_backward(index)
    ctx.dim, ctx.alpha, ctx.num_segments = dim, alpha, input.shape[dim]
    ctx.check = rest[0] if rest else "host"


def _backward(ctx, grad):
    (index,) = ctx.saved_tensors
    dim = ctx.dim
    check = _segments.backward_check(ctx.check, grad.device.type)
    if check == "host":
        grad_source = grad.index_select(dim, index)
    elif ctx.num_segments == 0:  # every value is out of range: every row was left out
        shape = list(grad.shape)
        shape[dim] = index.numel()
        return grad, None, None, grad.new_zeros(shape), *_NO_MORE_GRADIENTS
    else:
        # Unchecked values: the gather stays inside grad. Under "off" the rows that the
        # forward left out receive nothing; under "device" a bad value has failed already.
        clamped, in_range = _segments.clamped_index(index, ctx.num_segments)
        grad_source = grad.index_select(dim, clamped)
    if ctx.alpha != 1.0:
        grad_source = grad_source * ctx.alpha
    if check == "off":
        shape = [1] * grad.dim()
        shape[dim] = index.numel()
        grad_source = grad_source.masked_fill(~in_range.view(shape), 0)
    return grad, None, None, grad_source, *_NO_MORE_GRADIENTS


_NO_MORE_GRADIENTS = (None,) * 7

call_index_add = _transforms.register_autograd(index_add_op, _backward,
                                               setup_context=_setup_context, caller=_CALLER)


# ---- public functions ---------------------------------------------------------------------------

def _check(input, dim, index, source, alpha, mode, check, caller, plan=None):
    mode = parse_mode(mode, caller=caller)
    _validation.check_level(caller, check)
    _validation.check_float(caller, "input", input)
    _validation.check_float(caller, "source", source)
    _validation.check_index(caller, "index", index, one_d=True)
    dim = _validation.check_dim(caller, dim, input.dim())
    alpha = _validation.check_real(caller, "alpha", alpha)
    _validation.check_same_dtype(caller, "input", input, "source", source)
    _validation.check_shapes_except_dim(caller, "input", input, "source", source, dim)
    if index.shape[0] != source.shape[dim]:
        raise ValueError(f"{caller}: index has length {index.shape[0]}; expected "
                         f"source.size({dim}) = {source.shape[dim]}")
    _validation.check_same_device(caller, input=input, index=index, source=source)
    if plan is not None:
        plan = check_plan(caller, plan, index, input.shape[dim], f"input.size({dim})",
                          index.shape[0], "len(index)")
    return dim, alpha, mode


# The argument types whose value alone decides the checks (a tensor as alpha, say, does not).
_PLAIN = (int, float, str, Mode)


def _checked(input, dim, index, source, alpha, mode, check, caller, plan):
    """``_check``'s answer; the one remembered (``plans.run_checks_with``) for a call with
    the arguments of its plan's last call, or without a plan of a recent call without one."""
    arguments = None
    # The plan's own index only: another view of its memory is compared with it every time.
    if ((plan is None and type(index) is torch.Tensor
         or type(plan) is Plan and index is plan.index)
            and type(input) is torch.Tensor and type(source) is torch.Tensor
            and type(dim) is int and type(alpha) in _PLAIN
            and type(mode) in _PLAIN and type(check) is str
            and not torch.compiler.is_compiling()):
        try:
            arguments = (input.dtype, input.shape, input.device, input.layout, index.dtype,
                         index.shape, index.device, index.layout, source.dtype, source.shape,
                         source.device, source.layout, dim, type(alpha), alpha, type(mode),
                         mode, check)
        except RuntimeError:  # a nested tensor has no shape: the checks refuse it
            arguments = None
    return run_checks_with(plan, caller, arguments, _check, input, dim, index, source, alpha,
                           mode, check, caller, plan)


_ORDER_DOC = """
    Summation order and rounding. Output row ``i`` starts from ``input[i]`` and adds the rows
    ``source[k]`` with ``index[k] == i`` in increasing ``k`` (order of appearance; the order a
    stable sort of ``index`` gives), each scaled by ``alpha`` first:

    - ``"fp32"`` (default): accumulate in fp32 (fp64 for float64) from ``input[i]``,
      ``term = fp32(source[k]) * alpha`` rounded to fp32 on its own (never fused into the
      add), round to the dtype once at the end.
    - ``"kahan"``: the same terms, Neumaier-compensated sum in the accumulator, rounded once
      (``RN(s + c)``, or ``s`` itself when ``c == 0`` so that -0.0 stays -0.0): within 1 ulp
      of the exact result unless the terms cancel heavily: ``|out - S| <=
      ulp(out) + 2 N**2 u**2 sum|x_i|`` for N values (u: 2**-24, or 2**-53 for fp64).
    - ``"autograd"``: PyTorch's own arithmetic on the device, bit for bit:
      ``input.index_put_(indices, source * alpha, accumulate=True)``, which is what autograd
      computes for the gradient of ``x[index]``. On CPU that rounds ``source * alpha`` to the
      dtype, then rounds to the dtype after every add.
    - ``"exact"``: ``input[i]`` plus the same terms, summed exactly and rounded once to the
      dtype (correctly rounded); no order at all, so any permutation of ``index`` and
      ``source`` rows gives the same bits.

    **This operation is fully deterministic**: the same inputs give the same bits on every
    run, for every thread count and every backend that implements the mode. (PyTorch's own
    ``index_add_`` uses atomics on CUDA and an order-dependent fp32 buffer on CPU.)

    Gradient: ``input`` receives ``grad``; ``source`` receives
    ``grad.index_select(dim, index) * alpha`` (a gather; exact when ``alpha == 1``).
    The same under ``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``vmap``; forward
    mode (``jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) raises NotImplementedError
    (docs/determinism.md).
"""


def index_add(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *,
              alpha: float = 1, mode: str | Mode = "fp32", check: str = "host",
              plan: Plan | None = None) -> torch.Tensor:
    dim, alpha, mode = _checked(input, dim, index, source, alpha, mode, check, _CALLER, plan)
    planning = operator_arguments(plan, check)
    if _dispatch.direct_call_ok(input, index, source):
        return _index_add(input, dim, index, source, alpha, mode.value, *planning)
    return call_index_add(input, dim, index, source, alpha, mode.value, *planning)


def index_add_(input: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *,
               alpha: float = 1, mode: str | Mode = "fp32", check: str = "host",
               plan: Plan | None = None) -> torch.Tensor:
    caller = _IN_PLACE_CALLER
    dim, alpha, mode = _checked(input, dim, index, source, alpha, mode, check, caller, plan)
    planning = operator_arguments(plan, check)
    _validation.run_check(_validation.check_inplace_autograd, caller, "input", input)
    if _transforms.active() or (torch.is_grad_enabled() and (input.requires_grad
                                                             or source.requires_grad)):
        # The in-place operator has no autograd formula of its own (nor a vmap rule);
        # copying the out-of-place result in keeps the graph correct (copy_ is
        # differentiable, and batches) at the cost of one pass. That path reads storage
        # pointers only in eager mode on plain tensors (a traced or transformed tensor has
        # none); the out-of-place result is right even for shared memory, but torch refuses
        # the call, so eager detsum does too.
        if not torch.compiler.is_compiling() and not any(map(
                torch._C._functorch.is_functorch_wrapped_tensor, (input, index, source))):
            _validation.check_inplace_target(caller, "input", input, index=index, source=source)
        try:
            added = call_index_add(input, dim, index, source, alpha, mode.value, *planning,
                                   caller=caller)
        except _validation.IndexOutOfRangeError as error:
            # The out-of-place operator names its own function; the caller called this one.
            raise error.named_for(caller) from None
        return input.copy_(added)
    if _dispatch.direct_call_ok(input, index, source):
        _index_add_inplace(input, dim, index, source, alpha, mode.value, *planning)
        # What the operator's mutates_args does: a saved copy of input is now stale, and
        # autograd must say so if a backward reads it.
        torch.autograd.graph.increment_version(input)
        return input
    index_add_inplace_op(input, dim, index, source, alpha, mode.value, *planning)
    return input


# The two functions share their account of order and rounding, so their docstrings are built
# from one text.
index_add.__doc__ = """Out-of-place ``torch.index_add``: ``out[..., index[k], ...] += alpha * source[..., k, ...]``.

    Args:
        input: the tensor added to; float32, float16, bfloat16 or float64, any strides.
        dim: the dimension along which to index (negative counts from the end).
        index: 1-D int32/int64 with ``len(index) == source.size(dim)``, values in
            ``[0, input.size(dim))``.
        source: ``input``'s dtype and shape except ``source.size(dim) == len(index)``.
        alpha: scale of ``source``.
        mode: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.
        check: how ``index``'s values are checked. ``"host"`` (default): read back before
            anything runs; a bad value is an ``IndexError`` naming its position. ``"device"``:
            on the index's device, with no host read (no synchronisation, so the call can be
            captured in a CUDA graph); a bad value fails at the next synchronisation, naming
            the argument. ``"off"``: not checked. On CPU tensors every level checks as
            ``"host"`` does, on every backend. On a GPU ``"off"`` never reads or writes
            outside a tensor: a value outside ``[0, input.size(dim))`` leaves its ``source``
            row out (that row's gradient is 0); a ``"device"`` check that fails launches the
            same before the failure is reported.
        plan: a :func:`detsum.plan` of ``index`` into ``input.size(dim)`` rows, or None. With
            a plan, ``index`` is not checked again (the plan's own level stands for ``check``)
            nor planned: the same bits, at the cost of the reduction alone.

    Returns:
        A new contiguous tensor of ``input``'s shape and dtype.
""" + _ORDER_DOC + """
    Example:
        >>> import torch, detsum
        >>> g = torch.tensor([[1.0], [2.0], [4.0]], dtype=torch.bfloat16)
        >>> detsum.index_add(torch.zeros(2, 1, dtype=torch.bfloat16), 0,
        ...                  torch.tensor([1, 0, 1]), g, mode="autograd")
        tensor([[2.],
                [5.]], dtype=torch.bfloat16)
"""

index_add_.__doc__ = """In-place :func:`index_add`: writes into ``input`` and returns it.

    Arguments as :func:`index_add`. Every argument is checked before anything is written, so a
    call that raises leaves ``input`` untouched. Refused, as by torch: an ``input`` whose
    elements share memory (an expanded view), an ``index`` or ``source`` that shares memory
    with ``input`` (the result would depend on the order of the writes), an ``input`` made
    under ``torch.inference_mode()`` outside inference mode (a RuntimeError), and, while
    autograd records, an ``input`` that is a leaf requiring grad.
""" + _ORDER_DOC + """
    Example:
        >>> import torch, detsum
        >>> x = torch.zeros(3)
        >>> detsum.index_add_(x, 0, torch.tensor([2, 2]), torch.tensor([0.5, 0.25]))
        tensor([0.0000, 0.0000, 0.7500])
"""
