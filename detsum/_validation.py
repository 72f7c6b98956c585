"""Argument checks shared by the primitives.

Metadata checks (types, shapes, devices) run in the public functions, before any operator is
called, so they also run at trace time under torch.compile. Checks that read index values run
inside the operators, fused with the pass that builds the segments, before anything is written.
Every message names the function, the argument, what came and what was expected.
"""

from __future__ import annotations

import numbers
import operator

import torch

from detsum.modes import FLOAT_DTYPES, INDEX_DTYPES, MAX_TERMS_PER_STATE


class IndexOutOfRangeError(IndexError, RuntimeError):
    """An index value outside the range its argument allows, found before anything is written.

    Both an ``IndexError`` (as Python's own lookups raise) and a ``RuntimeError`` (as torch's
    ``scatter_add_`` and torch_scatter's kernels raise for a bad index), so code written for
    either, ``except IndexError`` or ``except RuntimeError``, catches it."""

    def named_for(self, caller: str) -> "IndexOutOfRangeError":
        """This error as ``caller``'s (the function the user called), where another function
        of detsum's that ``caller`` ran raised it under its own name."""
        _, _, detail = str(self).partition(": ")
        return IndexOutOfRangeError(f"{caller}: {detail}")


# ---- errors under torch.compile ----------------------------------------------------------------

_CHECK_ERRORS = (TypeError, ValueError, IndexOutOfRangeError, IndexError, RuntimeError,
                 NotImplementedError)
_ERROR_BY_NAME = {error.__name__: error for error in _CHECK_ERRORS}


def _raise_named(kind: str, message: str) -> None:
    raise _ERROR_BY_NAME[kind](message)


def _raise_while_tracing(kind: str, message: str) -> None:
    # What dynamo does with an operator's error while it traces: an IndexError reaches the
    # user as it is; a NotImplementedError is a graph break, after which dynamo runs the call
    # eagerly (the exact detsum error) or, with fullgraph=True, reports it with the message;
    # anything else would become a TorchRuntimeError around it.
    if issubclass(_ERROR_BY_NAME[kind], IndexError):
        raise _ERROR_BY_NAME[kind](message)
    raise NotImplementedError(f"{kind}: {message}")


# An operator whose only work is to raise. Without it, an exception raised in the Python that
# dynamo traces becomes its own "Observed exception", with detsum's message hidden in a debug
# context under fullgraph=True.
raise_argument_error = torch.library.custom_op(
    "detsum::raise_argument_error", _raise_named, mutates_args=())
raise_argument_error.register_fake(_raise_while_tracing)


def run_check(check, *args, **kwargs):
    """``check(*args, **kwargs)``, whose error reaches the user in detsum's words under
    ``torch.compile`` too (``fullgraph=True`` included)."""
    if not torch.compiler.is_compiling():
        return check(*args, **kwargs)
    try:
        return check(*args, **kwargs)
    except _CHECK_ERRORS as error:
        raise_argument_error(type(error).__name__, str(error))
        raise


# ---- arguments ----------------------------------------------------------------------------------

def check_flag(caller: str, name: str, value: object) -> bool:
    """A bool argument: None, 0/1 or a string are refused rather than read as truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{caller}: {name}={value!r}; expected True or False")
    return value


#: How a primitive checks the values of its index (see ``check_level``).
CHECK_LEVELS = ("host", "device", "off")


def check_level(caller: str, check: object) -> str:
    """The ``check`` argument: "host" (the default: values read back and checked before
    anything runs, with an error naming the first bad position), "device" (checked on the
    index's device with no host read: a bad value fails at the next synchronisation, with a
    message naming the argument but not the position), or "off" (not checked).

    The levels differ on a GPU only: on CPU tensors every level checks as "host" does, with
    its errors, on every backend (``_segments.check_that_runs``). On a GPU "off" never reads
    or writes outside a tensor: each primitive's docstring says what it gives for a bad value,
    and a "device" check that fails launches that same work before the failure is reported
    (segment_sum's offsets, which its launch checks itself: inside every tensor, with an
    unspecified result)."""
    if check not in CHECK_LEVELS:
        raise ValueError(f"{caller}: check={check!r}; expected one of "
                         f"{', '.join(map(repr, CHECK_LEVELS))}")
    return check


def assert_on_device(condition: torch.Tensor, caller: str, what: str) -> None:
    """Fail (at the next synchronisation, on a GPU) unless ``condition`` holds: check="device".
    No host read: on a GPU this queues a kernel that stops the stream on failure."""
    torch._assert_async(condition, device_check_message(caller, what))


def device_check_message(caller: str, what: str) -> str:
    """The error of a failed check="device" (``assert_on_device``), for a check that a
    launch makes on the device itself."""
    return (f"{caller}: {what} (found by check='device'; check='host' names the first bad "
            f"position)")


def check_positive_int(caller: str, name: str, value: object) -> int:
    """A count: a positive integer of any integral type (a NumPy int, a 0-d integer tensor:
    what ``operator.index`` takes), returned as an int. A bool is refused, as a float is."""
    if not isinstance(value, bool) and not (isinstance(value, torch.Tensor)
                                            and value.dtype == torch.bool):
        try:
            count = operator.index(value)
        except TypeError:
            pass
        else:
            if count >= 1:
                return count
    raise ValueError(f"{caller}: {name}={value!r}; expected a positive int")


def check_shape(caller: str, name: str, shape: object) -> torch.Size:
    """A shape: a sequence (tuple, list, torch.Size) of non-negative ints."""
    expected = "expected a sequence of non-negative ints such as (4, 3)"
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{caller}: {name}={shape!r}; {expected}")
    sizes = list(shape)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"{caller}: {name}={shape!r} holds {size!r}; {expected}")
        if size < 0:
            raise ValueError(f"{caller}: {name}={shape!r} holds {size}; {expected}")
    return torch.Size(int(size) for size in sizes)


def check_device(caller: str, name: str, device: object) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{caller}: {name}={device!r} is not a device; expected a "
                         f"torch.device or a string such as 'cpu' or 'cuda:0'") from None


def check_dense(caller: str, name: str, t: torch.Tensor) -> None:
    """Refuse a sparse, nested or otherwise unstrided tensor, whose elements no kernel reads.
    (Not while compiling: Dynamo's strict mode for an autograd.Function reads no layout, and
    the tensors it traces are strided.)"""
    if torch.compiler.is_compiling():
        return
    if t.layout is not torch.strided or t.is_nested:
        layout = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        hint = "" if t.is_nested else " (.to_dense(), say)"
        raise TypeError(f"{caller}: {name} is a {layout} tensor; expected a dense (strided) "
                        f"tensor{hint}")


def check_float(caller: str, name: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(caller, name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{caller}: {name} has dtype {t.dtype}; expected one of "
            f"{', '.join(str(d) for d in FLOAT_DTYPES)}"
        )
    if t.dim() == 0:
        raise ValueError(f"{caller}: {name} is 0-dimensional; expected at least 1 dimension")


def check_index(caller: str, name: str, t: object, *, one_d: bool,
                dtype_error: type[Exception] = TypeError) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
    check_dense(caller, name, t)
    if t.dtype not in INDEX_DTYPES:
        raise dtype_error(f"{caller}: {name} has dtype {t.dtype}; expected torch.int32 or torch.int64")
    if one_d and t.dim() != 1:
        raise ValueError(f"{caller}: {name} must be 1-D, got shape {tuple(t.shape)}")


def check_dim(caller: str, dim: object, ndim: int) -> int:
    """Normalise ``dim`` (negative counts from the end) or raise IndexError."""
    if type(dim) is not int and (isinstance(dim, bool) or not isinstance(dim, numbers.Integral)):
        raise TypeError(f"{caller}: dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise IndexError(f"{caller}: dim={dim} is out of range for a {ndim}-D tensor "
                         f"(expected {-ndim} <= dim < {ndim})")
    return int(dim) % ndim


def check_same_device(caller: str, **tensors: torch.Tensor) -> None:
    # A loop, not a comprehension: a small call's checks cost about what its launch does.
    first = None
    for t in tensors.values():
        if t is None:
            continue
        device = t.device
        if first is None:
            first = device
        elif device != first:
            listed = ", ".join(f"{name} on {t.device}" for name, t in tensors.items()
                               if t is not None)
            raise ValueError(f"{caller}: all tensors must be on one device; got {listed}")


def check_same_dtype(caller: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{caller}: {name_b} has dtype {b.dtype} but {name_a} has {a.dtype}; "
                         f"expected the same dtype")


def check_shapes_except_dim(caller: str, name_a: str, a: torch.Tensor, name_b: str,
                            b: torch.Tensor, dim: int) -> None:
    """``a`` and ``b`` must agree in rank and in every size except along ``dim``."""
    shape_a, shape_b = a.shape, b.shape  # each .shape makes a new torch.Size
    if len(shape_a) != len(shape_b) or shape_a[:dim] != shape_b[:dim] or (
            shape_a[dim + 1:] != shape_b[dim + 1:]):
        raise ValueError(
            f"{caller}: {name_b} has shape {tuple(b.shape)} but {name_a} has "
            f"{tuple(a.shape)}; expected the same shape except along dim {dim}"
        )


def check_real(caller: str, name: str, value: object) -> float:
    """``value`` as a float, where it is a real number (not a bool); else a TypeError."""
    # int and float first: the abstract-class test costs more than a small call's arithmetic.
    if type(value) is not float and type(value) is not int and (
            isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{caller}: {name} must be a real number, got {value!r}")
    return float(value)


def raise_index_out_of_range(caller: str, name: str, index: torch.Tensor, position: int,
                             size: int, what: str, *, size_included: bool = False) -> None:
    """Raise IndexOutOfRangeError for ``index``'s value at flat ``position``, outside
    ``[0, size)`` (``[0, size]`` when ``size_included``: a pointer such as ``indptr``);
    ``what`` names the bound as the caller knows it (``"src.size(0)"``)."""
    value = int(index.reshape(-1)[position])
    where = f"{name}[{position}]" if index.dim() == 1 else (
        f"{name}{list(_unravel(position, index.shape))}")
    relation = "<=" if size_included else "<"
    raise IndexOutOfRangeError(f"{caller}: {where} = {value} is out of range for {what} = "
                               f"{size} (expected 0 <= {name} {relation} {size})")


def raise_first_out_of_range(caller: str, name: str, index: torch.Tensor, size: int,
                             what: str, *, size_included: bool = False) -> None:
    """Locate the first value of ``index`` (any shape) outside ``[0, size)`` (``[0, size]``
    when ``size_included``), known to exist, and raise."""
    above = index > size if size_included else index >= size
    position = int(((index < 0) | above).reshape(-1).nonzero()[0])
    raise_index_out_of_range(caller, name, index, position, size, what,
                             size_included=size_included)


def check_exact_mean_terms(caller: str, terms: int, counted: str) -> None:
    """An exact mean sums at most MAX_TERMS_PER_STATE terms per output element (its long
    division keeps the remainder, below the count, shifted by 32 bits in an int64). ``terms``
    bounds the count from shapes alone, so the check costs nothing and runs before any work;
    ``counted`` says where the bound comes from, in the caller's words."""
    if terms > MAX_TERMS_PER_STATE:
        raise ValueError(f"{caller}: reduce='mean' with mode='exact' sums at most "
                         f"{MAX_TERMS_PER_STATE} terms per output element; got up to {terms} "
                         f"({counted}); expected fewer, or mode='fp32' or 'kahan'")


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


# ---- in-place targets ---------------------------------------------------------------------------
# These read storage pointers, so they run on real tensors: inside the in-place operator (eager
# or compiled) and on the eager autograd path, always before anything is written.

def _element_byte_starts(t: torch.Tensor) -> torch.Tensor:
    """The byte offset into t's storage of each of t's elements (1-D, int64)."""
    starts = torch.full((), t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        starts = (starts.unsqueeze(-1) + torch.arange(size) * stride).reshape(-1)
    return starts.reshape(-1) * t.element_size()


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (t nonempty, strides nonnegative)."""
    if t.is_contiguous():
        return t.nbytes
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that t's elements can touch in its storage."""
    first = t.storage_offset() * t.element_size()
    last = first + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    return first, last


def _is_dense(t: torch.Tensor) -> bool:
    """True when t's elements are distinct by its strides alone (a permuted dense layout)."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    expected = 1
    for stride, size in dims:
        if stride < expected:
            return False
        expected = stride * size
    return True


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Some two elements of ``t`` share memory (an expanded stride-0 view, or an as_strided
    overlap)."""
    if t.numel() <= 1 or t.is_contiguous() or _is_dense(t):
        return False
    starts = _element_byte_starts(t)
    return starts.unique().numel() < starts.numel()


def address_ranges_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The bytes from ``a``'s first element to its last and ``b``'s overlap (both nonempty):
    without it they share no memory; with it they may (``shares_memory`` decides)."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + _extent_bytes(b) and b_start < a_start + _extent_bytes(a)


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Some element of ``a`` and some element of ``b`` overlap in memory (exact: interleaved
    views such as ``x[::2]`` and ``x[1::2]`` do not)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    # Address ranges first: apart, they share nothing (the common case, decided without the
    # device and storage objects, which cost more than the rest of a small call's checks).
    if not address_ranges_meet(a, b):
        return False
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.device.type == "meta":
        return False  # no memory: every meta tensor's address is 0
    (a_first, a_last), (b_first, b_last) = _byte_span(a), _byte_span(b)
    if a_last <= b_first or b_last <= a_first:
        return False
    # The byte ranges meet: compare element by element (rare, so its cost is acceptable).
    a_starts = _element_byte_starts(a).sort().values
    b_starts = _element_byte_starts(b)
    # a's element at p overlaps b's at q when p < q + b_size and q < p + a_size.
    nearest = torch.searchsorted(a_starts, b_starts - a.element_size(), side="right")
    in_range = nearest < a_starts.numel()
    candidates = a_starts[nearest.clamp_max(a_starts.numel() - 1)]
    return bool((in_range & (candidates < b_starts + b.element_size())).any())


def check_changeable(caller: str, name: str, t: torch.Tensor, *,
                     remedy: str | None = None) -> None:
    """``t`` may be changed in place: not an inference tensor (one made under
    ``torch.inference_mode()``) outside inference mode. torch refuses that change with a
    RuntimeError, but only after its kernel has written; detsum refuses it before anything is
    written, with the same type. ``remedy`` replaces the advice to pass a clone. Not checked
    while dynamo traces (it cannot trace ``is_inference``); the in-place operators check when
    they run (:func:`check_inplace_target`)."""
    if torch.compiler.is_compiling():
        return
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{caller}: {name} is an inference tensor (made under torch.inference_mode()), "
            f"which cannot be changed in place outside inference mode; expected a normal "
            f"tensor: {remedy or f'pass {name}.clone()'}, or call {caller} under "
            f"torch.inference_mode()")


def check_inplace_target(caller: str, target_name: str, target: torch.Tensor,
                         **read: torch.Tensor | None) -> None:
    """The tensor written in place may be changed (:func:`check_changeable`), has distinct
    elements and shares no memory with the tensors ``read`` (their results would depend on
    the order of the writes)."""
    check_changeable(caller, target_name, target)
    if has_internal_overlap(target):
        raise ValueError(
            f"{caller}: {target_name} has elements that share memory (shape "
            f"{tuple(target.shape)}, strides {tuple(target.stride())}, an expanded view?); "
            f"expected a tensor with distinct elements to write in place: pass "
            f"{target_name}.clone()")
    for name, t in read.items():
        if t is not None and shares_memory(target, t):
            raise ValueError(
                f"{caller}: {name} shares memory with {target_name}, the tensor written in "
                f"place, so the result would depend on the order of the writes; expected "
                f"separate memory: pass {name}.clone()")


def check_inplace_autograd(caller: str, target_name: str, target: torch.Tensor) -> None:
    """A leaf that requires grad cannot be changed in place while autograd records."""
    if torch.is_grad_enabled() and target.requires_grad and target.is_leaf:
        raise RuntimeError(
            f"{caller}: {target_name} is a leaf tensor that requires grad, which autograd "
            f"cannot record an in-place change to; expected a non-leaf tensor: use the "
            f"out-of-place function, or call this one under torch.no_grad()")
