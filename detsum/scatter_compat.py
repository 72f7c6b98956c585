"""torch_scatter's API, deterministic: the same names, arguments, defaults and semantics, built
on detsum's primitives, plus a keyword-only ``mode=`` on every function (default ``"fp32"``).

A program that imports its scatter functions from ``torch_scatter`` switches by importing them
from ``detsum`` instead (docs/switching.md). What carries over unchanged:

- **Index broadcasting**: an ``index`` with fewer dimensions than ``src`` is broadcast as
  torch_scatter does (a 1-D index lines up with ``dim``; any other index gains trailing
  dimensions), then expanded to ``src``'s shape.
- **Output size**: ``dim_size`` when given, else ``index.max() + 1`` (0 for an empty index);
  the ``segment_*`` functions take it from ``indptr`` or from the last index.
- **out=**: the ``scatter_*`` and ``segment_*_coo`` functions reduce into what ``out`` holds
  (its values take part, and it is written in place and returned); ``segment_*_csr`` and the
  gathers overwrite it.
- **Empty segments**: 0 for sum, mean, min and max (without ``out``), 1 for mul; ``arg`` of an
  empty segment is ``src.size(dim)``.
- **min/max**: ``(values, arg)``, ``arg`` the position along ``dim`` of the first source
  element equal to the result; the gradient goes to that element alone.

What differs, by design (every difference is a place where torch_scatter's result depends on
atomics, on the order of threads, or on an accident of its initial values):

- Every float sum and mean is deterministic (atomics give torch_scatter a different last bit
  from run to run on GPUs), and rounded as ``mode`` says: in ``"fp32"`` the sum is kept in
  fp32 (fp64 for float64) and rounded once; a mean without ``out`` divides that sum before
  its one rounding (torch_scatter rounds the sum to the dtype, then divides).
- NaN propagates through min/max and a segment of ``-inf`` gives ``-inf``; torch_scatter's
  min/max skip NaN and, starting from the largest finite value, return 0 for a segment of
  infinities.
- Integer sums, products, minima and maxima are exact integer arithmetic (wrapping on
  overflow, as torch's), computed by torch's own scatter ops: any order gives the same
  integers, so no detsum kernel is needed, and every mode, ``"exact"`` included, gives them.
  Integer means divide with ``floor``, as torch_scatter's.
- **out=** may share memory with ``src``, ``index`` or ``indptr`` (``out=src``, or views that
  overlap): every input is read as it was before ``out`` is written, which gives the bits of
  a separate ``out`` holding the same values (the shared input is copied first, and only
  then). torch_scatter refuses it in ``scatter_sum`` and ``scatter_mean`` and elsewhere gives
  a result that depends on its kernels' order. An ``out`` whose own elements share memory
  (an expanded view) is refused, by every function.
- An index or ``indptr`` value out of range raises :class:`detsum.IndexOutOfRangeError`
  before anything is written, naming the function, the argument, the position, the value and
  the bound: an ``IndexError`` and a ``RuntimeError`` both, so code that catches
  torch_scatter's ``RuntimeError`` keeps working.
- ``reduce="mean"`` in ``mode="exact"`` (a float mean without ``out``) sums at most
  ``2**30 - 1`` terms per output element: a larger ``src.size(dim)`` is refused before any
  work.

Under ``torch.compile(fullgraph=True)``, ``segment_coo`` needs ``dim_size`` (or ``out``) and
``gather_csr`` needs ``out``; without ``dim_size``, the ``scatter_*`` functions and
``gather_coo`` read ``index.max() + 1`` inside the graph when it runs, as in eager. Compiled,
every reduction gives eager's bits; the composites' ``exp``, ``log`` and ``sqrt`` are torch's
elementwise ops, for which inductor writes its own code (its ``exp`` can differ from eager's in
the last bit).

Under ``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``vmap`` every function gives the
gradients (and per-sample results) of eager autograd, bit for bit; forward mode (``jvp``,
``jacfwd``) raises NotImplementedError wherever detsum sums (the gathers pass tangents through
torch's own ``gather``), docs/determinism.md.
"""

from __future__ import annotations

import numbers

import torch

from detsum import _segments, _transforms, _validation
from detsum.backend import current_backend
from detsum.modes import FLOAT_DTYPES, Mode, acc_dtype, parse_mode
from detsum.ops.index_add import index_add, index_add_
from detsum.ops.scatter_reduce import scatter_reduce
from detsum.ops.segment_sum import segment_sum

__all__ = [
    "gather_coo", "gather_csr", "index_select", "scatter", "scatter_add", "scatter_log_softmax",
    "scatter_logsumexp", "scatter_max", "scatter_mean", "scatter_min", "scatter_mul",
    "scatter_softmax", "scatter_std", "scatter_sum", "segment_add_coo", "segment_add_csr",
    "segment_coo", "segment_csr", "segment_max_coo", "segment_max_csr", "segment_mean_coo",
    "segment_mean_csr", "segment_min_coo", "segment_min_csr", "segment_sum_coo",
    "segment_sum_csr",
]

SCATTER_REDUCES = ("sum", "add", "mul", "mean", "min", "max")
SEGMENT_REDUCES = ("sum", "add", "mean", "min", "max")
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


# ---- argument checks ----------------------------------------------------------------------------

def _check_src(caller: str, src: object, *, floats_only: bool = False) -> None:
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{caller}: src must be a torch.Tensor, got {type(src).__name__}")
    allowed = FLOAT_DTYPES if floats_only else FLOAT_DTYPES + INTEGER_DTYPES
    if src.dtype not in allowed:
        raise TypeError(f"{caller}: src has dtype {src.dtype}; expected one of "
                        f"{', '.join(str(d) for d in allowed)}")
    if src.dim() == 0:
        raise ValueError(f"{caller}: src is 0-dimensional; expected at least 1 dimension")


def _check_reduce(caller: str, reduce: object, allowed: tuple[str, ...]) -> str:
    if reduce not in allowed:
        raise ValueError(f"{caller}: reduce={reduce!r} is not supported; expected one of "
                         f"{allowed}")
    return "sum" if reduce == "add" else reduce


def _check_mode(caller: str, mode: object, reduce: str,
                src_dtype: torch.dtype | None = None) -> Mode:
    """``mode`` parsed; ``"exact"`` refused for a product of floats (or of a dtype not yet
    known, ``src_dtype`` None). An integer product is exact in every mode."""
    mode = parse_mode(mode, caller=caller)
    if reduce == "mul" and mode is Mode.EXACT and src_dtype not in INTEGER_DTYPES:
        of_dtype, integers = "", ""
        if src_dtype is not None:
            of_dtype = f" for src of dtype {src_dtype}"
            integers = " (integer products are exact in every mode)"
        raise ValueError(f"{caller}: reduce='mul' has no mode='exact'{of_dtype}: an exact "
                         f"product of floats needs the bits of every factor, so it cannot be "
                         f"kept in a fixed state; expected mode='fp32', 'kahan' or 'autograd' "
                         f"for a product of floats{integers}")
    return mode


def _check_exact_mean(caller: str, src: torch.Tensor, dim: int, reduce: str, mode: Mode,
                      out: torch.Tensor | None) -> None:
    """A float mean without ``out`` is the primitive's mean (``"exact"``: at most 2**30 - 1
    terms per output element, bounded by ``src.size(dim)``); with ``out`` it is a sum and an
    integer count, without that limit."""
    if reduce == "mean" and mode is Mode.EXACT and out is None and src.is_floating_point():
        _validation.check_exact_mean_terms(caller, src.shape[dim],
                                           f"src.size({dim}) = {src.shape[dim]}")


def _check_dim_size(caller: str, dim_size: object) -> None:
    if dim_size is None:
        return
    if isinstance(dim_size, bool) or not isinstance(dim_size, numbers.Integral):
        raise TypeError(f"{caller}: dim_size={dim_size!r} is a {type(dim_size).__name__}; "
                        f"expected None or an int >= 0")
    if dim_size < 0:
        raise ValueError(f"{caller}: dim_size={dim_size!r}; expected None or an int >= 0")


def _check_out(caller: str, out: torch.Tensor | None, src: torch.Tensor, dim: int) -> None:
    """``out`` of ``src``'s dtype, device and shape except along ``dim``, with distinct elements
    (an expanded view cannot hold one result per position). It may share memory with ``src``
    or the index: see ``_apart_from``."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{caller}: out must be a torch.Tensor or None, got {type(out).__name__}")
    _validation.check_changeable(caller, "out", out)
    _validation.check_inplace_autograd(caller, "out", out)
    _validation.check_same_dtype(caller, "src", src, "out", out)
    _validation.check_same_device(caller, src=src, out=out)
    _validation.check_shapes_except_dim(caller, "src", src, "out", out, dim)
    if not torch.compiler.is_compiling():
        _validation.check_inplace_target(caller, "out", out)


def _apart_from(out: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it shares memory with ``out``: every input is read as it
    was before ``out`` is written, so ``out=src`` gives the bits of a separate ``out`` holding
    the same values. (Under torch.compile, functionalization gives inputs the same meaning.)
    A tensor of a torch.func transform has no memory to compare: it is copied."""
    if out is None or torch.compiler.is_compiling():
        return t
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if not (wrapped(out) or wrapped(t)) and not _validation.shares_memory(out, t):
        return t
    return t.clone()


def _broadcast_index(caller: str, index: object, src: torch.Tensor, dim: int) -> torch.Tensor:
    """``index`` expanded to ``src``'s shape as torch_scatter broadcasts it (a view)."""
    _validation.check_index(caller, "index", index, one_d=False)
    lined_up = index
    if index.dim() == 1:
        lined_up = index.view([1] * dim + [-1])
    if lined_up.dim() > src.dim():
        raise ValueError(f"{caller}: index has {index.dim()} dimensions, more than src's "
                         f"{src.dim()}")
    lined_up = lined_up.view(tuple(lined_up.shape) + (1,) * (src.dim() - lined_up.dim()))
    for d, (have, want) in enumerate(zip(lined_up.shape, src.shape)):
        if have not in (1, want):
            raise ValueError(
                f"{caller}: index of shape {tuple(index.shape)} does not broadcast to src's "
                f"shape {tuple(src.shape)} along dim={dim} (size {have} against {want} in "
                f"dimension {d}); expected a 1-D index of length src.size(dim) or an index "
                f"whose sizes are 1 or src's")
    return lined_up.expand(src.shape)


def _rows_index(index_b: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The 1-D index when every slice across ``dim`` shares one (the primitives' fast, whole-row
    layout), else None. Read from the strides of the broadcast view: no pass over the data."""
    if any(index_b.stride(d) != 0 and index_b.shape[d] != 1
           for d in range(index_b.dim()) if d != dim):
        return None
    rows = index_b
    for d in reversed(range(index_b.dim())):
        if d != dim:
            rows = rows.select(d, 0)
    return rows


def _check_index_values(caller: str, index: torch.Tensor, size: int | None, what: str) -> int:
    """Check every index value to lie in ``[0, size)``, ``size`` being the output's size along
    the dim, or ``index.max() + 1`` when None; return that size. One host read of the smallest
    and largest value, or none on a GPU when the size is given: there the check runs on the
    device (a bad value fails at the next synchronisation). Skipped while torch.compile
    traces: the primitives then check inside their operators (``_INNER_CHECK``)."""
    if torch.compiler.is_compiling() or index.numel() == 0:
        return _output_size(index, size)
    on_gpu = _segments.check_that_runs("device", index.device.type,
                                       current_backend(index.device.type, caller)) != "host"
    if size is not None and on_gpu:
        _validation.assert_on_device(((index >= 0) & (index < size)).all(), caller,
                                     f"index has a value outside [0, {what} = {size})")
        return size
    low, high = torch.stack(list(torch.aminmax(index))).tolist()
    if size is None:
        size = high + 1
    if low < 0 or high >= size:
        _validation.raise_first_out_of_range(caller, "index", index, size, what)
    return size


def _inner_check() -> str:
    """The check level of the primitives that scatter's functions call on an index that they
    checked themselves (``_check_index_values``): none more, except while torch.compile traces,
    where that check is skipped and the primitives' own runs inside their operators. (On CPU
    tensors the primitives check at every level, for free.)"""
    return "host" if torch.compiler.is_compiling() else "off"


def _size_name(out: torch.Tensor | None, dim_size: int | None, dim: int) -> str:
    """How the caller gave the output's size along ``dim``, for a message."""
    if out is not None:
        return f"out.size({dim})"
    return "dim_size" if dim_size is not None else "index.max() + 1"


def _output_size(index: torch.Tensor, dim_size: int | None) -> int:
    if dim_size is not None:
        return int(dim_size)
    if not index.numel():
        return 0
    top = index.max()
    if torch.compiler.is_compiling():
        # Each read a node of its own: AOTAutograd's common-subexpression pass (torch 2.13)
        # merges two equal reads of index.max() (two scatter_* calls on one index, or
        # scatter_softmax's own two) but leaves the second's size on the tensors made from
        # it, a size no node of the graph defines any more, and Inductor fails ("For u1 + 1,
        # expected [u1] to have been codegen-ed"). It never merges an aten.empty; the sum of
        # no elements is 0: the same size, read once, as in eager code.
        top = top + index.new_empty(0).sum()
    return int(top) + 1


def _sized_like(src: torch.Tensor, dim: int, size: int, fill: float) -> torch.Tensor:
    shape = list(src.shape)
    shape[dim] = size
    return torch.full(shape, fill, dtype=src.dtype, device=src.device)


# ---- the reductions, shared by scatter_* and segment_* ------------------------------------------

def _reduce_into(src: torch.Tensor, index_b: torch.Tensor, dim: int, base: torch.Tensor,
                 reduce: str, base_counts: bool, mode: Mode) -> torch.Tensor:
    """A new tensor: ``base`` reduced with the source elements that ``index_b`` sends to each
    of its elements (``base`` taking part as the first term when ``base_counts``)."""
    rows = _rows_index(index_b, dim)
    if src.is_floating_point():
        primitive = {"sum": "sum", "mean": "mean", "mul": "prod", "min": "amin", "max": "amax"}
        return scatter_reduce(base, dim, index_b if rows is None else rows, src,
                              primitive[reduce], include_self=base_counts, mode=mode,
                              check=_inner_check())
    index64 = index_b.to(torch.int64)
    if reduce == "sum":
        return (base if base_counts else torch.zeros_like(base)).scatter_add(dim, index64, src)
    primitive = {"mul": "prod", "min": "amin", "max": "amax"}[reduce]
    return base.scatter_reduce(dim, index64, src, primitive, include_self=base_counts)


def _counts(index_b: torch.Tensor, dim: int, shape: torch.Size) -> torch.Tensor:
    """How many source elements land on each output element (int64, broadcastable to
    ``shape``). Integer counts are exact in any order, so torch's own ops count them."""
    rows = _rows_index(index_b, dim)
    if rows is not None:
        counts = torch.bincount(rows.to(torch.int64), minlength=shape[dim])
        view = [1] * len(shape)
        view[dim] = -1
        return counts.view(view)
    one = torch.ones((), dtype=torch.int64, device=index_b.device).expand(index_b.shape)
    zeros = torch.zeros(shape, dtype=torch.int64, device=index_b.device)
    return zeros.scatter_add_(dim, index_b.to(torch.int64), one)


def _mean_into(src: torch.Tensor, index_b: torch.Tensor, dim: int, out: torch.Tensor | None,
               size: int, mode: Mode) -> torch.Tensor:
    if out is None and src.is_floating_point():
        # One rounding: the primitive divides the accumulated sum by the count.
        return _reduce_into(src, index_b, dim, _sized_like(src, dim, size, 0), "mean", False,
                            mode)
    base = out if out is not None else _sized_like(src, dim, size, 0)
    total = _reduce_into(src, index_b, dim, base, "sum", True, mode)
    count = _counts(index_b, dim, total.shape).clamp_min(1)
    if total.is_floating_point():
        # out's own value is summed but not counted (torch_scatter's definition): the sum is
        # rounded to the dtype, then divided in the acc type and rounded again.
        acc = acc_dtype(total.dtype)
        return (total.to(acc) / count.to(acc)).to(total.dtype)
    return total.div(count.to(total.dtype), rounding_mode="floor")


def _first_positions(src: torch.Tensor, index_b: torch.Tensor, dim: int, result: torch.Tensor,
                     base_kept: torch.Tensor | None) -> torch.Tensor:
    """``arg`` of min/max: for each output element, the position along ``dim`` of the first
    source element that lands on it and equals ``result`` there (NaN matching NaN), or
    ``src.size(dim)`` where none does or where ``base_kept`` says the start value stayed.

    The first match is a minimum of positions, taken by detsum's own kernel on positions held
    as floats (float32 below 2**24 positions, float64 below 2**53: exact either way): an
    integer minimum, the same in any order."""
    positions_total = src.shape[dim]
    rows = _rows_index(index_b, dim)
    with torch.no_grad():
        source = src.detach()
        target = (result.index_select(dim, rows.to(torch.int64)) if rows is not None
                  else result.gather(dim, index_b.to(torch.int64)))
        hit = source == target
        if source.is_floating_point():
            hit |= source.isnan() & target.isnan()
        along = [1] * src.dim()
        along[dim] = -1
        exact_type = torch.float32 if positions_total < 2**24 else torch.float64
        positions = torch.arange(positions_total, dtype=exact_type,
                                 device=src.device).view(along)
        candidates = torch.where(hit, positions, float(positions_total))
        none_yet = torch.full(result.shape, float(positions_total), dtype=exact_type,
                              device=src.device)
        first = scatter_reduce(none_yet, dim, index_b if rows is None else rows, candidates,
                               "amin", check=_inner_check())
        arg = first.to(torch.int64)
        if base_kept is not None:
            arg = arg.masked_fill(base_kept, positions_total)
    return arg


class _Extreme(torch.autograd.Function):
    """min/max values by detsum's amin/amax (exact in every mode), with torch_scatter's
    gradient: all of it to the element at ``arg``, none to equal ones after it. ``arg`` is
    found in the forward when the caller asks for it, else only if a backward needs it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(src, base, index_b, dim, reduce, base_counts, mode, want_arg):
        result = _reduce_into(src, index_b, dim, base, reduce, base_counts, mode)
        if not want_arg:
            return result, torch.empty(0, dtype=torch.int64, device=src.device)
        return result, _first_positions(src, index_b, dim, result,
                                        _base_kept_mask(result, base, base_counts))

    @staticmethod
    def setup_context(ctx, inputs, output):
        src, base, index_b, dim, _, base_counts, _, want_arg = inputs
        result, arg = output
        # ``kept`` rather than ``base``: base may be the caller's out, overwritten next.
        # (``arg`` is an integer tensor: autograd never differentiates it.)
        ctx.save_for_backward(src, index_b, result, _base_kept_mask(result, base, base_counts),
                              arg if want_arg else None)
        ctx.dim = dim

    @staticmethod
    def backward(ctx, grad, _):
        src, index_b, result, kept, arg = ctx.saved_tensors
        dim = ctx.dim
        if arg is None:
            arg = _first_positions(src, index_b, dim, result, kept)
        positions_total = src.shape[dim]
        landed = arg < positions_total
        # One slot past the end takes the outputs whose arg is no source position. (Out of
        # place: under vmap the zeros are one tensor and the gradients a batch.)
        shape = list(src.shape)
        shape[dim] += 1
        spread = grad.new_zeros(shape).scatter(dim, arg, grad)
        grad_src = spread.narrow(dim, 0, positions_total)
        grad_base = grad.masked_fill(landed, 0) if kept is not None else None
        return grad_src, grad_base, None, None, None, None, None, None


def _base_kept_mask(result: torch.Tensor, base: torch.Tensor, base_counts: bool
                    ) -> torch.Tensor | None:
    """Where the start value (``out``) is the result: no source element beat it."""
    if not base_counts:
        return None
    kept = result == base
    if result.is_floating_point():
        kept |= result.isnan() & base.isnan()
    return kept


def _extreme(caller: str, src: torch.Tensor, index_b: torch.Tensor, dim: int,
             out: torch.Tensor | None, size: int, reduce: str, mode: Mode, want_arg: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, arg) of min/max (``arg`` None unless ``want_arg``): see ``_Extreme``."""
    base = out if out is not None else _sized_like(src, dim, size, 0)
    if src.shape[dim] == 0:
        arg = torch.full(base.shape, 0, dtype=torch.int64, device=src.device)
        return (base.clone() if out is None else base), (arg if want_arg else None)
    if not src.is_floating_point():
        result = _reduce_into(src, index_b, dim, base, reduce, out is not None, mode)
        arg = (_first_positions(src, index_b, dim, result,
                                _base_kept_mask(result, base, out is not None))
               if want_arg else None)
        return result, arg
    values, arg = _transforms.apply(_Extreme, caller, src, base, index_b, dim, reduce,
                                    out is not None, mode, want_arg)
    return values, (arg if want_arg else None)


def _attached_to_graph_of(src: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result``, made part of ``src``'s autograd graph: a result that no element of an empty
    ``src`` reaches still takes a backward call, as any other result does."""
    if src.requires_grad and torch.is_grad_enabled():
        return result - src.sum() * 0  # x - (+0.0) is x for every x, -0.0 included
    return result


def _finish(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """torch_scatter writes the result into a given ``out`` and returns it."""
    if out is None:
        return result
    if result is not out:
        out.copy_(result)
    return out


# ---- scatter ------------------------------------------------------------------------------------

def _scatter(caller: str, src: torch.Tensor, index: torch.Tensor, dim: int,
             out: torch.Tensor | None, dim_size: int | None, reduce: str, mode: object,
             want_arg: bool = True, size_name: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scatter's body, for every function built on it: ``caller`` names the function called
    and ``size_name`` the output's size along ``dim`` in that function's arguments (default:
    ``out.size(dim)``, ``dim_size`` or ``index.max() + 1``, whichever gave it)."""
    def check():
        _check_src(caller, src)
        d = _validation.check_dim(caller, dim, src.dim())
        r = _check_reduce(caller, reduce, SCATTER_REDUCES)
        m = _check_mode(caller, mode, r, src.dtype)
        _check_dim_size(caller, dim_size)
        _check_out(caller, out, src, d)
        index_b = _broadcast_index(caller, index, src, d)
        _validation.check_same_device(caller, src=src, index=index)
        _check_exact_mean(caller, src, d, r, m, out)
        return d, r, m, index_b

    d, r, m, index_b = _validation.run_check(check)
    size = _check_index_values(
        caller, index, out.shape[d] if out is not None else dim_size,
        size_name if size_name is not None else _size_name(out, dim_size, d))
    src, separate_index = _apart_from(out, src), _apart_from(out, index)
    if separate_index is not index:
        index_b = _broadcast_index(caller, separate_index, src, d)
    if src.numel() == 0:
        result = out if out is not None else _attached_to_graph_of(
            src, _sized_like(src, d, size, 1 if r == "mul" else 0))
        arg = None
        if r in ("min", "max"):
            arg = torch.full(result.shape, src.shape[d], dtype=torch.int64, device=src.device)
        return result, arg
    if r in ("min", "max"):
        values, arg = _extreme(caller, src, index_b, d, out, size, r, m, want_arg)
        return _finish(out, values), arg
    if r == "mean":
        return _finish(out, _mean_into(src, index_b, d, out, size, m)), None
    if (r == "sum" and out is not None and src.is_floating_point()
            and not torch.compiler.is_compiling()):
        # In place, no copy: the same kernel and bits as the path below. Eager only: a
        # compiled graph cannot tell whether out shares memory with src, and inductor runs
        # an in-place operator on the caller's own out.
        rows = _rows_index(index_b, d)
        if rows is not None:
            return index_add_(out, d, rows, src, mode=m, check=_inner_check()), None
    if out is not None:
        return _finish(out, _reduce_into(src, index_b, d, out, r, True, m)), None
    base = _sized_like(src, d, size, 1 if r == "mul" else 0)
    # A sum starts from the terms alone (only "exact" keeps -0.0 for a sum of -0.0); a
    # product starts from 1, as torch_scatter's.
    return _reduce_into(src, index_b, d, base, r, r == "mul", m), None


def scatter(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
            out: torch.Tensor | None = None, dim_size: int | None = None, reduce: str = "sum",
            *, mode: str | Mode = "fp32") -> torch.Tensor:
    r"""Reduce ``src`` into ``out`` at the positions ``index`` gives along ``dim``:
    torch_scatter's ``scatter``, deterministic.

    For each element of ``src``, its output position is its own outside ``dim`` and
    ``index``'s value along ``dim``; ``index`` broadcasts to ``src`` (a 1-D index lines up with
    ``dim``, any other gains trailing dimensions). For a 1-D ``src`` and ``reduce="sum"``:

    .. math:: \mathrm{out}_i = \mathrm{out}_i + \sum_{j:\ \mathrm{index}_j = i} \mathrm{src}_j

    Args:
        src: float32/float16/bfloat16/float64, or an integer dtype (``"sum"``, ``"mul"``,
            ``"min"``, ``"max"``, ``"mean"`` with floor division).
        index: int32/int64, values in ``[0, out.size(dim))``, broadcastable to ``src``.
        dim: the axis along which to index (default -1).
        out: optional destination of ``src``'s shape except along ``dim``: reduced into (its
            values take part), written in place and returned. It may share memory with
            ``src`` or ``index`` (read as they were before ``out`` is written).
        dim_size: the output's size along ``dim`` when ``out`` is not given (default
            ``index.max() + 1``, 0 for an empty index).
        reduce: ``"sum"`` (or ``"add"``), ``"mul"``, ``"mean"``, ``"min"`` or ``"max"``.
        mode: keyword only: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``
            (``"mul"`` of floats refuses ``"exact"``; integers give the same result in every
            mode).

    Returns:
        The reduced tensor (``out`` itself when given). Elements that receive nothing are 0
        (1 for ``"mul"``), or keep ``out``'s value.

    Order and rounding, per element: the source elements in order of their position along
    ``dim`` (after ``out``'s value when ``out`` is given), as ``detsum.scatter_reduce`` sums them
    in ``mode``; a mean divides the accumulated sum before its one rounding (with ``out``
    given: ``(out + sum) / count``, the count not including ``out``, two roundings as in
    torch_scatter); min/max are exact, and NaN propagates.

    **This operation is fully deterministic**: the same inputs give the same bits on every
    run, for every thread count and every backend that implements the mode.

    Example:
        >>> import torch, detsum
        >>> src = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
        >>> index = torch.tensor([0, 1, 0, 1])
        >>> detsum.scatter(src, index, dim=1)
        tensor([[ 4.,  6.],
                [12., 14.]])
        >>> detsum.scatter(src, index, dim=1, reduce="max", dim_size=3)
        tensor([[3., 4., 0.],
                [7., 8., 0.]])
    """
    return _scatter("detsum.scatter", src, index, dim, out, dim_size, reduce, mode,
                    want_arg=False)[0]


def scatter_sum(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                out: torch.Tensor | None = None, dim_size: int | None = None, *,
                mode: str | Mode = "fp32") -> torch.Tensor:
    """``scatter(..., reduce="sum")``."""
    return _scatter("detsum.scatter_sum", src, index, dim, out, dim_size, "sum", mode)[0]


def scatter_add(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                out: torch.Tensor | None = None, dim_size: int | None = None, *,
                mode: str | Mode = "fp32") -> torch.Tensor:
    """``scatter(..., reduce="sum")`` (torch_scatter's other name for it)."""
    return _scatter("detsum.scatter_add", src, index, dim, out, dim_size, "sum", mode)[0]


def scatter_mul(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                out: torch.Tensor | None = None, dim_size: int | None = None, *,
                mode: str | Mode = "fp32") -> torch.Tensor:
    """``scatter(..., reduce="mul")``: the product in order, in the acc type, rounded once;
    1 where nothing lands."""
    return _scatter("detsum.scatter_mul", src, index, dim, out, dim_size, "mul", mode)[0]


def scatter_mean(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                 out: torch.Tensor | None = None, dim_size: int | None = None, *,
                 mode: str | Mode = "fp32") -> torch.Tensor:
    """``scatter(..., reduce="mean")``: the sum over the count, 0 where nothing lands."""
    return _scatter("detsum.scatter_mean", src, index, dim, out, dim_size, "mean", mode)[0]


def scatter_min(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                out: torch.Tensor | None = None, dim_size: int | None = None, *,
                mode: str | Mode = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, arg)``: the minimum per output element and the position along ``dim`` of the
    first source element equal to it (``src.size(dim)`` where nothing lands or ``out``'s value
    stays). The gradient goes to that element alone. Exact in every mode."""
    return _scatter("detsum.scatter_min", src, index, dim, out, dim_size, "min", mode)


def scatter_max(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                out: torch.Tensor | None = None, dim_size: int | None = None, *,
                mode: str | Mode = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, arg)``: the maximum per output element and the position along ``dim`` of the
    first source element equal to it (``src.size(dim)`` where nothing lands or ``out``'s value
    stays). The gradient goes to that element alone. Exact in every mode.

    Example:
        >>> import torch, detsum
        >>> detsum.scatter_max(torch.tensor([2.0, 5.0, 5.0, 1.0]), torch.tensor([0, 0, 0, 2]))
        (tensor([5., 0., 1.]), tensor([1, 4, 3]))
    """
    return _scatter("detsum.scatter_max", src, index, dim, out, dim_size, "max", mode)


# ---- segment_csr / segment_coo ------------------------------------------------------------------

def _check_pointer_like(caller: str, name: str, t: object, src: torch.Tensor) -> int:
    """An int tensor whose leading sizes are 1 or ``src``'s; returns ``dim`` (its last axis)."""
    _validation.check_index(caller, name, t, one_d=False)
    if t.dim() == 0 or t.dim() > src.dim():
        raise ValueError(f"{caller}: {name} has {t.dim()} dimensions; expected 1 to src's "
                         f"{src.dim()}")
    dim = t.dim() - 1
    for d in range(dim):
        if t.shape[d] not in (1, src.shape[d]):
            raise ValueError(f"{caller}: {name} of shape {tuple(t.shape)} does not broadcast "
                             f"to src's shape {tuple(src.shape)} (size {t.shape[d]} against "
                             f"{src.shape[d]} in dimension {d}); expected 1 or src's size")
    _validation.check_same_device(caller, src=src, **{name: t})
    return dim


def _check_indptr_values(caller: str, indptr: torch.Tensor, rows: int, what: str,
                         name: str = "indptr") -> None:
    """Nondecreasing along the last axis, within ``[0, rows]`` (``what`` names ``rows`` and
    ``name`` the pointers in the caller's arguments): one host read (skipped while
    torch.compile traces)."""
    if torch.compiler.is_compiling() or indptr.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(indptr))
    decreasing = bool((indptr[..., 1:] < indptr[..., :-1]).any())
    if low < 0 or high > rows:
        _validation.raise_first_out_of_range(caller, name, indptr, rows, what,
                                             size_included=True)
    if decreasing:
        position = int((indptr[..., 1:] < indptr[..., :-1]).reshape(-1).nonzero()[0])
        row = position // (indptr.shape[-1] - 1)
        at = row * indptr.shape[-1] + position % (indptr.shape[-1] - 1)
        flat = indptr.reshape(-1)
        raise ValueError(f"{caller}: {name} decreases after its flat position {position} "
                         f"({int(flat[at])} then {int(flat[at + 1])}); expected nondecreasing "
                         f"values along its last dimension")


def _segment_of_position(indptr: torch.Tensor, lead: tuple[int, ...], length: int
                         ) -> torch.Tensor:
    """For each of ``length`` positions (and each leading position), the segment ``indptr``
    puts it in, or ``S`` (one past the last) when it lies outside ``[indptr[0], indptr[-1])``:
    an index of shape ``[*lead, length]``."""
    pointers = indptr.expand(lead + (indptr.shape[-1],)).reshape(-1, indptr.shape[-1])
    positions = torch.arange(length, device=indptr.device, dtype=pointers.dtype)
    positions = positions.expand(pointers.shape[0], -1).contiguous()
    segment = torch.searchsorted(pointers.contiguous(), positions, right=True) - 1
    segments = indptr.shape[-1] - 1
    outside = (positions < pointers[:, :1]) | (positions >= pointers[:, -1:])
    return segment.masked_fill(outside, segments).view(lead + (length,))


def _segment_csr(caller: str, src: torch.Tensor, indptr: torch.Tensor,
                 out: torch.Tensor | None, reduce: str, mode: object, want_arg: bool = True,
                 pointer_name: str = "indptr") -> tuple[torch.Tensor, torch.Tensor | None]:
    """segment_csr's body, for every function built on it: ``caller`` names the function
    called and ``pointer_name`` its argument ``indptr``."""
    def check():
        _check_src(caller, src)
        d = _check_pointer_like(caller, pointer_name, indptr, src)
        r = _check_reduce(caller, reduce, SEGMENT_REDUCES)
        m = _check_mode(caller, mode, r, src.dtype)
        if out is not None:
            _check_out(caller, out, src, d)
            if out.shape[d] != max(indptr.shape[-1] - 1, 0):
                raise ValueError(f"{caller}: out has size {out.shape[d]} along dim {d}; "
                                 f"expected max(indptr.size(-1) - 1, 0) = "
                                 f"{max(indptr.shape[-1] - 1, 0)}")
        _check_exact_mean(caller, src, d, r, m, None)
        return d, r, m

    d, r, m = _validation.run_check(check)
    _check_indptr_values(caller, indptr, src.shape[d], f"src.size({d})", pointer_name)
    src, indptr = _apart_from(out, src), _apart_from(out, indptr)
    segments = max(indptr.shape[-1] - 1, 0)
    one_pointer = all(size == 1 for size in indptr.shape[:-1])
    if src.numel() == 0 or segments == 0:
        result = _attached_to_graph_of(src, _sized_like(src, d, segments, 0))
        arg = (torch.full(result.shape, src.shape[d], dtype=torch.int64, device=src.device)
               if r in ("min", "max") else None)
        return _finish(out, result), arg
    if one_pointer and r == "sum" and src.is_floating_point():
        pointer = indptr.reshape(-1).to(torch.int64)
        first, last = (int(v) for v in pointer[[0, -1]]) if not torch.compiler.is_compiling() \
            else (None, None)
        if first is not None:
            part = src.narrow(d, first, last - first)
            return _finish(out, segment_sum(part, pointer - first, dim=d, mode=m)), None
    # Every other case: an index of segments (one past the last for positions outside),
    # reduced with one extra output row that is then dropped.
    segment_index = _segment_of_position(indptr, tuple(src.shape[:d]), src.shape[d])
    index_b = _broadcast_index(caller, segment_index, src, d)
    if r in ("min", "max"):
        values, arg = _extreme(caller, src, index_b, d, None, segments + 1, r, m, want_arg)
        return (_finish(out, values.narrow(d, 0, segments)),
                arg.narrow(d, 0, segments) if want_arg else None)
    if r == "mean":
        result = _mean_into(src, index_b, d, None, segments + 1, m)
    else:
        result = _reduce_into(src, index_b, d, _sized_like(src, d, segments + 1, 0), r, False, m)
    return _finish(out, result.narrow(d, 0, segments)), None


def segment_csr(src: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor | None = None,
                reduce: str = "sum", *, mode: str | Mode = "fp32") -> torch.Tensor:
    r"""Reduce runs of ``src`` along the last axis of ``indptr``: torch_scatter's
    ``segment_csr``, deterministic.

    ``dim = indptr.dim() - 1``; ``indptr`` broadcasts over ``src``'s leading dimensions (each
    of its leading sizes is 1 or ``src``'s: batched pointers). Segment ``i`` of each leading
    position reduces ``src[..., indptr[..., i]:indptr[..., i + 1], ...]``:

    .. math:: \mathrm{out}_i = \sum_{j=\mathrm{indptr}[i]}^{\mathrm{indptr}[i+1]-1}~\mathrm{src}_j

    Args:
        src: float32/float16/bfloat16/float64, or an integer dtype.
        indptr: int32/int64, nondecreasing along its last axis, values in
            ``[0, src.size(dim)]``.
        out: optional destination (``src``'s shape with ``indptr.size(-1) - 1`` along
            ``dim``): overwritten and returned; it may share memory with ``src``.
        reduce: ``"sum"`` (or ``"add"``), ``"mean"``, ``"min"`` or ``"max"``.
        mode: keyword only: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.

    Returns:
        The reduced tensor; empty segments give 0.

    Order and rounding: each segment's rows in increasing position, as
    ``detsum.segment_sum`` sums them in ``mode`` (a mean divides that sum before its one
    rounding); min/max are exact.

    **This operation is fully deterministic**: the same inputs give the same bits on every
    run, for every thread count and every backend that implements the mode.

    Example:
        >>> import torch, detsum
        >>> src = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        >>> detsum.segment_csr(src, torch.tensor([0, 2, 2, 6]))
        tensor([ 3.,  0., 18.])
        >>> detsum.segment_csr(src, torch.tensor([0, 2, 2, 6]), reduce="mean")
        tensor([1.5000, 0.0000, 4.5000])
    """
    caller = "detsum.segment_csr"
    return _segment_csr(caller, src, indptr, out, reduce, mode, want_arg=False)[0]


def _segment_csr_of(reduce: str):
    def reduce_csr(src: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor | None = None,
                   *, mode: str | Mode = "fp32"):
        result = _segment_csr(f"detsum.segment_{reduce}_csr", src, indptr, out, reduce, mode)
        return result if reduce in ("min", "max") else result[0]

    reduce_csr.__name__ = reduce_csr.__qualname__ = f"segment_{reduce}_csr"
    reduce_csr.__doc__ = (f"``segment_csr(..., reduce={reduce!r})``" + (
        ", returning ``(values, arg)``: ``arg`` the position along ``dim`` of the first element "
        "equal to the result (``src.size(dim)`` for an empty segment)."
        if reduce in ("min", "max") else "."))
    return reduce_csr


segment_sum_csr = _segment_csr_of("sum")
segment_add_csr = _segment_csr_of("add")
segment_mean_csr = _segment_csr_of("mean")
segment_min_csr = _segment_csr_of("min")
segment_max_csr = _segment_csr_of("max")


def _check_sorted(caller: str, index: torch.Tensor) -> None:
    if torch.compiler.is_compiling() or index.shape[-1] < 2:
        return
    falls = index[..., 1:] < index[..., :-1]
    if bool(falls.any()):
        position = int(falls.reshape(-1).nonzero()[0])
        row = position // (index.shape[-1] - 1)
        at = row * index.shape[-1] + position % (index.shape[-1] - 1)
        flat = index.reshape(-1)
        raise ValueError(f"{caller}: index decreases after its flat position {position} "
                         f"({int(flat[at])} then {int(flat[at + 1])}); "
                         f"segment_coo needs an index sorted along its last dimension "
                         f"(use detsum.scatter for an unsorted one)")


def _segment_coo(caller: str, src: torch.Tensor, index: torch.Tensor,
                 out: torch.Tensor | None, dim_size: int | None, reduce: str, mode: object,
                 want_arg: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    def check():
        _check_src(caller, src)
        d = _check_pointer_like(caller, "index", index, src)
        if index.shape[d] not in (1, src.shape[d]):
            raise ValueError(f"{caller}: index has size {index.shape[d]} along dim {d}; "
                             f"expected src.size({d}) = {src.shape[d]}")
        r = _check_reduce(caller, reduce, SEGMENT_REDUCES)
        _check_dim_size(caller, dim_size)
        _check_exact_mean(caller, src, d, r, _check_mode(caller, mode, r, src.dtype), out)
        return d

    d = _validation.run_check(check)
    _check_sorted(caller, index)
    size_name = None
    if out is None and dim_size is None:
        last = index.select(d, index.shape[d] - 1) if index.numel() else index
        dim_size = int(last.max()) + 1 if index.numel() else 0
        size_name = "the output's size, index's largest last value + 1"
    return _scatter(caller, src, index.expand(tuple(src.shape[:d + 1])), d, out, dim_size,
                    reduce, mode, want_arg, size_name)


def segment_coo(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None,
                dim_size: int | None = None, reduce: str = "sum", *,
                mode: str | Mode = "fp32") -> torch.Tensor:
    r"""Reduce ``src`` by a sorted ``index``: torch_scatter's ``segment_coo``, deterministic.

    ``dim = index.dim() - 1``; ``index`` broadcasts over ``src``'s leading dimensions, is
    sorted along ``dim`` (checked: an unsorted index is refused), and each element goes to the
    output position its value gives, as in :func:`scatter` (``out`` is reduced into).

    Args:
        src: float32/float16/bfloat16/float64, or an integer dtype.
        index: int32/int64, sorted along its last axis, values in ``[0, out.size(dim))``.
        out: optional destination, reduced into (its values take part), written in place;
            it may share memory with ``src``.
        dim_size: the output's size along ``dim`` without ``out`` (default: the last index
            value plus one).
        reduce: ``"sum"`` (or ``"add"``), ``"mean"``, ``"min"`` or ``"max"``.
        mode: keyword only: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.

    Order and rounding: as :func:`scatter`.

    **This operation is fully deterministic**: the same inputs give the same bits on every
    run, for every thread count and every backend that implements the mode.

    Example:
        >>> import torch, detsum
        >>> src = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        >>> detsum.segment_coo(src, torch.tensor([0, 0, 2, 2, 2, 3]))
        tensor([ 3.,  0., 12.,  6.])
    """
    return _segment_coo("detsum.segment_coo", src, index, out, dim_size, reduce, mode,
                        want_arg=False)[0]


def _segment_coo_of(reduce: str):
    def reduce_coo(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None,
                   dim_size: int | None = None, *, mode: str | Mode = "fp32"):
        result = _segment_coo(f"detsum.segment_{reduce}_coo", src, index, out, dim_size,
                              reduce, mode)
        return result if reduce in ("min", "max") else result[0]

    reduce_coo.__name__ = reduce_coo.__qualname__ = f"segment_{reduce}_coo"
    reduce_coo.__doc__ = (f"``segment_coo(..., reduce={reduce!r})``" + (
        ", returning ``(values, arg)``: ``arg`` the position along ``dim`` of the first element "
        "equal to the result (``src.size(dim)`` where nothing lands)."
        if reduce in ("min", "max") else "."))
    return reduce_coo


segment_sum_coo = _segment_coo_of("sum")
segment_add_coo = _segment_coo_of("add")
segment_mean_coo = _segment_coo_of("mean")
segment_min_coo = _segment_coo_of("min")
segment_max_coo = _segment_coo_of("max")


# ---- gathers ------------------------------------------------------------------------------------

class _Gather(torch.autograd.Function):
    """``src.gather(dim, index_b)`` whose backward is detsum's deterministic scatter-sum (torch's
    own gather backward adds with atomics on a GPU)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(src, index_b, dim, mode):
        return src.gather(dim, index_b.to(torch.int64))

    @staticmethod
    def setup_context(ctx, inputs, output):
        src, index_b, dim, mode = inputs
        ctx.save_for_backward(index_b)
        ctx.dim, ctx.mode, ctx.rows = dim, mode, src.shape[dim]

    @staticmethod
    def backward(ctx, grad):
        (index_b,) = ctx.saved_tensors
        rows = _rows_index(index_b, ctx.dim)
        zeros = _sized_like(grad, ctx.dim, ctx.rows, 0)
        # The index was checked by the forward call: not again.
        return (scatter_reduce(zeros, ctx.dim, index_b if rows is None else rows, grad, "sum",
                               include_self=False, mode=ctx.mode, check=_inner_check()),
                None, None, None)


def _gather(caller: str, src: torch.Tensor, index_b: torch.Tensor, dim: int, mode: Mode
            ) -> torch.Tensor:
    """``src.gather(dim, index_b)``; while autograd records, its gradient is summed by detsum in
    ``mode``. Every gather of a tensor that carries a gradient goes through here."""
    if src.is_floating_point() and torch.is_grad_enabled() and src.requires_grad:
        return _transforms.apply(_Gather, caller, src, index_b, dim, mode)
    return src.gather(dim, index_b.to(torch.int64))


def gather_csr(src: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor | None = None, *,
               mode: str | Mode = "fp32") -> torch.Tensor:
    """Repeat each row of ``src`` along ``dim = indptr.dim() - 1`` over its segment: position
    ``e`` of the output takes row ``i`` where ``indptr[i] <= e < indptr[i + 1]`` (torch_scatter's
    ``gather_csr``); positions outside every segment are 0. The output's size along ``dim`` is
    ``indptr``'s last value; ``out`` is overwritten and returned.

    The forward is a copy (exact); the gradient is ``segment_csr(grad, indptr)``, summed
    deterministically in ``mode``.

    Example:
        >>> import torch, detsum
        >>> detsum.gather_csr(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 2, 2, 5]))
        tensor([1., 1., 3., 3., 3.])
    """
    caller = "detsum.gather_csr"

    def check():
        _check_src(caller, src)
        d = _check_pointer_like(caller, "indptr", indptr, src)
        segments = indptr.shape[-1] - 1
        if src.shape[d] != max(segments, 0) and src.numel() > 0:
            raise ValueError(f"{caller}: src has size {src.shape[d]} along dim {d}; expected "
                             f"max(indptr.size(-1) - 1, 0) = {max(segments, 0)}")
        _check_out(caller, out, src, d)
        return d, parse_mode(mode, caller=caller)

    d, m = _validation.run_check(check)
    if out is not None:
        length, length_name = out.shape[d], f"out.size({d})"
    else:
        length = int(indptr.reshape(-1)[-1]) if src.numel() > 0 and indptr.numel() else 0
        last = "indptr" + (f"[{', '.join(['-1'] * indptr.dim())}]" if indptr.dim() > 1
                           else "[-1]")
        length_name = f"the output's size along dim {d}, {last}"
    _check_indptr_values(caller, indptr, length, length_name)
    src, indptr = _apart_from(out, src), _apart_from(out, indptr)
    shape = list(src.shape)
    shape[d] = length
    if src.numel() == 0 or length == 0:
        return _finish(out, _attached_to_graph_of(src, torch.zeros(shape, dtype=src.dtype,
                                                         device=src.device)))
    # Which segment each output position copies; positions outside every segment copy row 0
    # and are then zeroed.
    like = torch.empty(shape, dtype=src.dtype, device="meta")
    segment = _segment_of_position(indptr, tuple(shape[:d]), length)
    segments = indptr.shape[-1] - 1
    index_b = _broadcast_index(caller, segment.clamp_max(segments - 1), like, d)
    copied = _gather(caller, src, index_b, d, m)
    outside = segment == segments
    outside = outside.view(tuple(outside.shape) + (1,) * (len(shape) - outside.dim()))
    return _finish(out, copied.masked_fill(outside, 0))


def gather_coo(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None, *,
               mode: str | Mode = "fp32") -> torch.Tensor:
    """``src``'s rows at ``index`` along ``dim = index.dim() - 1`` (torch_scatter's
    ``gather_coo``): output position ``e`` takes row ``index[e]``; the output has
    ``index.size(dim)`` rows; ``out`` is overwritten and returned.

    The forward is a copy (exact); the gradient is ``segment_coo(grad, index)``, summed
    deterministically in ``mode``.

    Example:
        >>> import torch, detsum
        >>> detsum.gather_coo(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 2]))
        tensor([1., 1., 3.])
    """
    caller = "detsum.gather_coo"

    def check():
        _check_src(caller, src)
        _validation.check_index(caller, "index", index, one_d=False)
        if index.dim() == 0 or index.dim() > src.dim():
            raise ValueError(f"{caller}: index has {index.dim()} dimensions; expected 1 to "
                             f"src's {src.dim()}")
        d = index.dim() - 1
        for i in range(d):
            if index.shape[i] not in (1, src.shape[i]):
                raise ValueError(f"{caller}: index of shape {tuple(index.shape)} does not "
                                 f"broadcast to src's leading sizes {tuple(src.shape[:d])}")
        _validation.check_same_device(caller, src=src, index=index)
        _check_out(caller, out, src, d)
        if out is not None and out.shape[d] != index.shape[d]:
            raise ValueError(f"{caller}: out has size {out.shape[d]} along dim {d}; expected "
                             f"index.size({d}) = {index.shape[d]}")
        return d, parse_mode(mode, caller=caller)

    d, m = _validation.run_check(check)
    shape = list(src.shape)
    shape[d] = index.shape[d]
    _check_index_values(caller, index, src.shape[d], f"src.size({d})")
    src, index = _apart_from(out, src), _apart_from(out, index)
    if src.numel() == 0 or index.numel() == 0:
        return _finish(out, _attached_to_graph_of(src, torch.zeros(shape, dtype=src.dtype,
                                                         device=src.device)))
    like = torch.empty(shape, dtype=src.dtype, device="meta")
    index_b = _broadcast_index(caller, index.expand(tuple(shape[:d + 1])), like, d)
    return _finish(out, _gather(caller, src, index_b, d, m))


class _IndexSelect(torch.autograd.Function):
    """``src.index_select(dim, index)`` whose backward is detsum's index_add (torch's own
    backward is an ``index_add_``, with atomics on a GPU)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(src, dim, index, mode):
        return src.index_select(dim, index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        src, dim, index, mode = inputs
        ctx.save_for_backward(index)
        ctx.dim, ctx.mode, ctx.shape = dim, mode, src.shape

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        zeros = grad.new_zeros(ctx.shape)
        # The index was checked by the forward call: not again.
        return (index_add(zeros, ctx.dim, index, grad, mode=ctx.mode, check=_inner_check()),
                None, None, None)


def index_select(src: torch.Tensor, dim: int, index: torch.Tensor, *,
                 mode: str | Mode = "fp32") -> torch.Tensor:
    """``torch.index_select(src, dim, index)`` whose gradient is summed deterministically: the
    gather a message-passing layer runs on every edge (``x_j = x.index_select(0, src_nodes)``).

    The forward is a copy (exact). The gradient of ``src`` row ``i`` is the sum of the
    gradient rows ``k`` with ``index[k] == i``, in order of appearance, by
    :func:`detsum.index_add` into zeros in ``mode``: ``"fp32"`` accumulates in fp32 (fp64 for
    float64) and rounds once; ``"autograd"`` gives the bits of the gradient torch computes for
    ``src[index]`` (``index_put_(accumulate=True)``). torch's own ``index_select`` backward is
    ``index_add_``: atomics on a GPU; on a CPU it sums along the first or last dim with
    ``"fp32"`` mode's bits (segments of at most 256 rows; longer ones are chunked by detsum,
    docs/determinism.md).

    Args:
        src: float32/float16/bfloat16/float64, or an integer dtype (no gradient).
        dim: the dimension to index (negative counts from the end).
        index: 1-D int32/int64, values in ``[0, src.size(dim))``.
        mode: keyword only: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.

    **This operation is fully deterministic**, forward and backward: the same bits on every
    run, for every thread count and every backend that implements the mode.

    Example:
        >>> import torch, detsum
        >>> x = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
        >>> rows = detsum.index_select(x, 0, torch.tensor([2, 0, 2]))
        >>> rows.sum().backward()
        >>> x.grad
        tensor([[1.],
                [0.],
                [2.]])
    """
    caller = "detsum.index_select"

    def check():
        _check_src(caller, src)
        d = _validation.check_dim(caller, dim, src.dim())
        _validation.check_index(caller, "index", index, one_d=True)
        _validation.check_same_device(caller, src=src, index=index)
        return d, parse_mode(mode, caller=caller)

    d, m = _validation.run_check(check)
    _check_index_values(caller, index, src.shape[d], f"src.size({d})")
    if src.is_floating_point() and torch.is_grad_enabled() and src.requires_grad:
        return _transforms.apply(_IndexSelect, caller, src, d, index, m)
    return src.index_select(d, index)


# ---- composites ---------------------------------------------------------------------------------

def _check_float_src(caller: str, src: object) -> None:
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{caller}: src must be a torch.Tensor, got {type(src).__name__}")
    if not src.is_floating_point():
        raise ValueError(f"{caller}: src has dtype {src.dtype}; expected a floating-point "
                         f"dtype (float32, float16, bfloat16 or float64)")


def scatter_softmax(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                    dim_size: int | None = None, *, mode: str | Mode = "fp32") -> torch.Tensor:
    """Softmax of ``src`` within each group of elements that ``index`` sends to one output
    position (torch_scatter's ``scatter_softmax``): ``exp(x - max) / sum(exp(x - max))``, the
    maximum and the sum over the group, the sum by :func:`scatter_sum` in ``mode``.

    Example:
        >>> import torch, detsum
        >>> detsum.scatter_softmax(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
        tensor([0.5000, 0.5000, 1.0000])
    """
    caller = "detsum.scatter_softmax"
    _validation.run_check(_check_float_src, caller, src)
    top = _scatter(caller, src, index, dim, None, dim_size, "max", mode, want_arg=False)[0]
    d = _validation.check_dim(caller, dim, src.dim())
    index_b = _broadcast_index(caller, index, src, d)
    m = parse_mode(mode, caller=caller)
    exps = (src - _gather(caller, top, index_b, d, m)).exp()
    totals = _scatter(caller, exps, index, dim, None, dim_size, "sum", mode)[0]
    return exps / _gather(caller, totals, index_b, d, m)


def scatter_log_softmax(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                        eps: float = 1e-12, dim_size: int | None = None, *,
                        mode: str | Mode = "fp32") -> torch.Tensor:
    """Log-softmax within each group (torch_scatter's ``scatter_log_softmax``):
    ``(x - max) - log(sum(exp(x - max)) + eps)``, the sum by :func:`scatter_sum` in ``mode``.

    Example:
        >>> import torch, detsum
        >>> detsum.scatter_log_softmax(torch.tensor([0.0, 0.0]), torch.tensor([0, 0])).exp()
        tensor([0.5000, 0.5000])
    """
    caller = "detsum.scatter_log_softmax"
    _validation.run_check(_check_float_src, caller, src)
    _validation.run_check(_validation.check_real, caller, "eps", eps)
    top = _scatter(caller, src, index, dim, None, dim_size, "max", mode, want_arg=False)[0]
    d = _validation.check_dim(caller, dim, src.dim())
    where = _broadcast_index(caller, index, src, d)
    m = parse_mode(mode, caller=caller)
    shifted = src - _gather(caller, top, where, d, m)
    totals = _scatter(caller, shifted.exp(), index, dim, None, dim_size, "sum", mode)[0]
    return shifted - _gather(caller, (totals + eps).log(), where, d, m)


def scatter_logsumexp(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                      out: torch.Tensor | None = None, dim_size: int | None = None,
                      eps: float = 1e-12, *, mode: str | Mode = "fp32") -> torch.Tensor:
    """``log(sum(exp(x)) + eps)`` per output position, computed as
    ``m + log(sum(exp(x - m)) + eps)`` with ``m`` the group's maximum (torch_scatter's
    ``scatter_logsumexp``, with its conventions: without ``out``, non-finite results go
    through ``nan_to_num(neginf=0)``, so an empty group gives 0; with ``out``, its value joins
    the sum as ``exp(out - m)``, it keeps its value wherever the result is not finite, and it
    is written in place and returned).

    Example:
        >>> import torch, detsum
        >>> detsum.scatter_logsumexp(torch.tensor([0.0, 0.0]), torch.tensor([0, 0]))
        tensor([0.6931])
    """
    caller = "detsum.scatter_logsumexp"
    _validation.run_check(_check_float_src, caller, src)
    _validation.run_check(_validation.check_real, caller, "eps", eps)
    d = _validation.check_dim(caller, dim, src.dim())
    where = _broadcast_index(caller, index, src, d)
    _validation.run_check(_check_out, caller, out, src, d)
    m = _validation.run_check(_check_mode, caller, mode, "max")
    _validation.check_same_device(caller, src=src, index=index)
    if out is not None:
        dim_size, size_name = out.shape[d], f"out.size({d})"
    elif dim_size is None:
        size_name = "index.max() + 1"
    else:
        _validation.run_check(_check_dim_size, caller, dim_size)
        size_name = "dim_size"
    dim_size = _check_index_values(caller, index, dim_size, size_name)
    # The maximum from -inf, kept out of place: under vmap the start is one tensor and the
    # maxima a batch, which no in-place write could hold.
    top = _sized_like(src, d, dim_size, float("-inf"))
    if src.numel():
        top, _ = _extreme(caller, src, where, d, top, dim_size, "max", m, False)
    shifted = src - _gather(caller, top, where, d, m)
    shifted = shifted.masked_fill(shifted.isnan(), float("-inf"))
    start = None if out is None else (out - top).exp()
    totals = _scatter(caller, shifted.exp(), index, d, start, dim_size, "sum", mode,
                      size_name=size_name)[0]
    result = (totals + eps).log() + top
    if out is None:
        return result.nan_to_num(neginf=0.0)
    return _finish(out, torch.where(result.isfinite(), result, out))


def scatter_std(src: torch.Tensor, index: torch.Tensor, dim: int = -1,
                out: torch.Tensor | None = None, dim_size: int | None = None,
                unbiased: bool = True, *, mode: str | Mode = "fp32") -> torch.Tensor:
    """Standard deviation within each group (torch_scatter's ``scatter_std``):
    ``sqrt(sum((x - mean)**2) / (n - 1 + 1e-6))`` (``n`` for ``unbiased=False``; ``n`` and
    ``n - 1`` at least 1), the sums by :func:`scatter_sum` in ``mode``. With ``out``, the
    squared deviations are added into it (as torch_scatter does) and the result is new.

    Example:
        >>> import torch, detsum
        >>> detsum.scatter_std(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]))
        tensor([1.4142, 0.0000])
    """
    caller = "detsum.scatter_std"
    _validation.run_check(_check_float_src, caller, src)
    _validation.run_check(_validation.check_flag, caller, "unbiased", unbiased)
    d = _validation.check_dim(caller, dim, src.dim())
    _validation.run_check(_check_out, caller, out, src, d)
    size_name = _size_name(out, dim_size, d)
    if out is not None:
        dim_size = out.shape[d]
    where = _broadcast_index(caller, index, src, d)
    totals = _scatter(caller, src, index, d, None, dim_size, "sum", mode,
                      size_name=size_name)[0]
    count = _counts(where, d, totals.shape).to(totals.dtype).clamp_min(1)
    mean = totals / count
    deviations = src - _gather(caller, mean, where, d, parse_mode(mode, caller=caller))
    squares = _scatter(caller, deviations * deviations, index, d, out, totals.shape[d], "sum",
                       mode, size_name=size_name)[0]
    if unbiased:
        count = (count - 1).clamp_min(1)
    return (squares / (count + 1e-6)).sqrt()
