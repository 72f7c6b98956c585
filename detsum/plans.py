"""Plans: the canonical order of an index, built once and reused by every primitive.

Every detsum primitive is a segmented reduction: output row ``s`` reduces the source rows ``k``
with ``index[k] == s`` in increasing ``k``. Finding those rows (a stable sort of the index, or
a counting sort on the CPU) and checking the index's values is the *plan*; without one, every
call makes its own, forward and backward. ``detsum.plan`` makes it once, so that a GNN's
layers, an MoE layer's forward and backward, or the steps of a training loop over a fixed
graph share it, and a call with a plan launches its reduction and nothing else: no sort, no
check, no host read.

A plan says nothing about the data: the same plan gives the same bits in every mode and on
every backend as the call without it (the order *is* the canonical order, whoever finds it).
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from detsum import _dispatch, _segments, _transforms, _validation, kernels
from detsum.backend import current_backend

__all__ = ["Plan", "plan"]

_CALLER = "detsum.plan"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Plan:
    """The canonical order of a 1-D index into ``num_rows`` output rows (see :func:`plan`).

    Pass it as ``plan=`` to :func:`detsum.index_add`, :func:`detsum.index_add_`,
    :func:`detsum.scatter_reduce` (a 1-D index) and :func:`detsum.segment_sum`, with the index
    it was made from. Its tensors live on the index's device; it holds no data, only positions.
    """

    #: The index the plan was made from (1-D, int32 or int64).
    index: torch.Tensor
    #: How many output rows: the size along ``dim`` of the tensor the index points into.
    num_rows: int
    #: Positions ``0 .. len(index) - 1`` in canonical order (int64), or None for a plan made
    #: with ``sorted=True``, whose order is the positions themselves.
    order: torch.Tensor | None
    #: ``offsets[s] .. offsets[s + 1] - 1`` are the positions in ``order`` of output row
    #: ``s``'s source rows (int64, ``num_rows + 1`` entries).
    offsets: torch.Tensor
    #: The level at which the index's values were checked ("host", "device" or "off"; CPU
    #: tensors are checked as "host" at every level): the calls that use the plan give what
    #: that level gives.
    check: str
    #: Whether the plan was made with ``sorted=True``.
    sorted: bool
    #: ``index._version`` when the plan was made: an index changed in place since then no
    #: longer matches its plan, and calls refuse the pair. None for an index that keeps no
    #: version counter (an inference tensor, made under ``torch.inference_mode``): a change
    #: in place to one of those cannot be seen.
    index_version: int | None
    #: For the modes that split long segments into chunks ("fp32", "kahan"; see
    #: ``detsum.kernels.CHUNK_TERMS``): the running count of each segment's chunks
    #: (``detsum.kernels.chunk_ends``), on the index's device.
    chunk_ends: torch.Tensor
    #: How many chunks the long segments have in all: exact for a plan made at "host", which
    #: reads it back with its check; else an upper bound from the index's length.
    chunk_slots: int
    #: Each primitive's last call with the plan whose arguments passed its checks: (what
    #: those checks read of them, what they returned). See :func:`run_checks_with`.
    _checked: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                       compare=False)

    def __repr__(self) -> str:
        return (f"detsum.Plan(num_rows={self.num_rows}, length={self.index.shape[0]}, "
                f"sorted={self.sorted}, check={self.check!r}, device={self.index.device})")


#: A plan as the primitives' bodies take it: (order, or None for a sorted plan; offsets; the
#: chunk split, or None to count it in the launch).
Planned = tuple[torch.Tensor | None, torch.Tensor, tuple[torch.Tensor, int] | None]


def operator_arguments(plan: Plan | None, check: str) -> tuple:
    """What the primitives' operators take of ``plan`` (their last five arguments): the plan's
    level, order, offsets and chunk split; without a plan, ``check`` and nothing else."""
    if plan is None:
        return check, None, None, None, -1
    return plan.check, plan.order, plan.offsets, plan.chunk_ends, plan.chunk_slots


def run_checks_with(plan: object, caller: str, arguments: tuple | None, check, *args) -> tuple:
    """``_validation.run_check(check, *args)``, or, when ``arguments`` are those of
    ``caller``'s last call with ``plan`` whose checks passed (without a plan: of one of
    ``caller``'s recent calls without one, ``_CHECKED_KEPT`` of them), what they returned
    then.

    ``arguments`` is everything the checks read (each tensor's dtype, shape, device and layout,
    the other arguments' types and values), or None where the caller cannot say it cheaply, or
    the checks read more (tensor values, a module setting): the checks are a function of it, so
    equal arguments pass them again with the same answer. A plan serves the same call step after
    step, and its checks would cost a small call's launch again; so does a training loop without
    one (on a small CPU ``index_add_`` the checks took 3.2 us of 16, a lookup 0.7). What can
    change between two calls with a plan, its index changed in place, is checked every time (it
    then takes the checks' path, which refuses it). Eager calls only: a traced call passes None,
    and checks every time. A check that raises is made again at every call, and raises again."""
    if arguments is None:
        return _validation.run_check(check, *args)
    if type(plan) is Plan:
        last = plan._checked.get(caller)
        if (last is not None and last[0] == arguments
                and _eager_version(plan.index) == plan.index_version):
            return last[1]
        answer = _validation.run_check(check, *args)
        plan._checked[caller] = (arguments, answer)
        return answer
    if plan is not None:
        return _validation.run_check(check, *args)
    key = (caller, arguments)
    answer = _CHECKED.get(key)
    if answer is None:
        answer = _validation.run_check(check, *args)
        _CHECKED[key] = answer
        while len(_CHECKED) > _CHECKED_KEPT:
            try:
                del _CHECKED[next(iter(_CHECKED))]
            except (KeyError, RuntimeError, StopIteration):
                break  # another thread's call changed them in between: its own turn evicts
    return answer


#: The answers of the checks of calls without a plan whose checks passed, by caller and
#: arguments (``run_checks_with``), the oldest first out.
_CHECKED: dict[tuple, tuple] = {}
_CHECKED_KEPT = 64


#: Whether a call with a plan makes an earlier call's launch again where its signature is
#: that call's (``call_with_plan``). False: every call takes the whole path (to compare).
LAUNCH_AGAIN = True

#: A signature whose call's launch cannot be made again (more than one launch, an op after
#: it): ``call_with_plan`` takes the whole path for it without trying to record it again.
_NOT_AGAIN = object()

#: The launches of calls with each plan, by the plan's offsets tensor (which no call but the
#: plan's passes, and which a primitive's body receives even through torch's dispatcher,
#: where autograd records the call and no Plan object reaches the body): ``id(offsets)`` ->
#: (a weak reference to it, {(caller, signature): its Relaunch, or _NOT_AGAIN}).
_LAUNCHES: dict[int, tuple[weakref.ref, dict]] = {}

#: How many signatures' launches a plan keeps (all primitives together): one per layer that
#: shares it with a width of its own, and per primitive that calls with it.
_LAUNCHES_KEPT = 16


def launches_again(t: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether a primitive's body, called with ``t`` as its data and ``offsets`` as its
    segments' bounds, may make an earlier call's launch again (``call_with_plan``): the
    offsets of a :class:`Plan` (not those a consumer builds for one call, an MoE backward's
    say), on the triton backend, eager, on plain tensors (no fake or traced tensor, no
    dispatch mode in force)."""
    return (LAUNCH_AGAIN and _launches_of(offsets) is not None and type(t) is torch.Tensor
            and _segments.launches_on_triton(t.device.type)
            and not torch._C._len_torch_dispatch_stack()
            and not torch.compiler.is_compiling())


def aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data pointer is 16-byte aligned, as a compiled kernel may assume: in a
    call's signature (``call_with_plan``), so that calls aligned otherwise in turn each keep
    a launch of their own rather than record again at every call."""
    return not t.data_ptr() & 15


def call_with_plan(caller: str, offsets: torch.Tensor, kept: tuple, signature: tuple,
                   inputs: tuple, new_output, call):
    """``call()``, the whole path of a primitive's body with a plan (``launches_again``), or
    the same call made as an earlier call's launch again: the call's one launch is recorded
    under ``signature`` (what decides the launch besides the plan: each data tensor's dtype,
    shape, strides, device and ``aligned``, the other arguments,
    ``_segments.launch_settings()``), and a
    later call with that signature hands the driver the same launch with its own tensors'
    addresses in their places (``detsum.kernels.triton.launch``, RECORDED LAUNCHES, says what
    the relaunch checks first). ``offsets``: the plan's, by which it keeps its launches;
    ``kept``: its other tensors (order, index, chunk split; None where it has none), which
    outlive the records unchanged; ``inputs``: the call's data tensors; ``new_output``: a
    function that makes an output as the whole path would (a new contiguous tensor of the
    result's shape, poisoned under ``_segments.POISON_OUTPUTS``), or None for a call in place
    into the last of ``inputs``. Returns what ``call`` returns (None in place).

    A call with a plan on the triton backend checks nothing; where it is one launch and no
    torch op but allocations and views (``record_launch``), launched again it gives the bits
    of its whole path: the same compiled kernel, with the same arguments but for the new
    tensors' data pointers. A small call's host time falls to about a third
    (benches/host_launch.py)."""
    again = _launches_of(offsets).get((caller, signature))
    if again is _NOT_AGAIN:
        return call()
    if again is not None:
        if new_output is None:
            if again(tuple(t.data_ptr() for t in inputs)):
                return None
        else:
            out = new_output()
            if again((*[t.data_ptr() for t in inputs], out.data_ptr())):
                return out
    return record_launch(caller, offsets, kept, signature, inputs, new_output is not None,
                         call)


def _launches_of(offsets: torch.Tensor, make: bool = False) -> dict | None:
    """The launches kept for the plan whose offsets are ``offsets``: None for offsets that
    are no plan's (``make``: a plan's, new; ``plan`` registers its own so). An entry goes
    when its offsets are collected, before their id can be another tensor's."""
    key = id(offsets)
    entry = _LAUNCHES.get(key)
    if entry is not None and entry[0]() is offsets:
        return entry[1]
    if not make:
        return None
    launches: dict = {}
    _LAUNCHES[key] = (weakref.ref(offsets, lambda _, key=key: _LAUNCHES.pop(key, None)),
                      launches)
    return launches


def record_launch(caller: str, offsets: torch.Tensor, kept: tuple, signature: tuple,
                  inputs: tuple, new_output: bool, call):
    """``call()``'s result, ``call`` being the whole path of a call with the plan of
    ``offsets`` (``call_with_plan``), whose launch is recorded under ``signature``: ``inputs``
    and, when ``new_output``, the result are the tensors a later call replaces, in that
    order. A call that is more than one launch, or runs a torch op other than allocations and
    views (whose values its launch alone would not make again), is remembered as such
    (``_NOT_AGAIN``) and not recorded again; a launch that went through Triton's own path (a
    kernel's first launch) leaves nothing: the next call tries again. Nothing is recorded
    while a launch could not be direct (a hook installed), nor while a CUDA graph is
    captured (a launch there may hold memory of the graph's own pool, which the graph, not
    the eager stream, sets up)."""
    if offsets.is_cuda and torch.cuda.is_current_stream_capturing():
        return call()
    from detsum.kernels.triton import launch

    if not launch.records_now():
        return call()
    with launch.recording() as made, _AtenOpsOfACall() as ops:
        result = call()
    if made == [None]:
        return result
    again = _NOT_AGAIN
    if len(made) == 1 and ops.only_allocations_and_views(result if new_output else None):
        tensors = (*inputs, result) if new_output else inputs
        again = made[0].with_slots(tensors, tuple(t for t in (offsets, *kept)
                                                  if t is not None)) or _NOT_AGAIN
    launches = _launches_of(offsets)
    launches.pop((caller, signature), None)  # kept last: the first out is the oldest
    launches[caller, signature] = again
    while len(launches) > _LAUNCHES_KEPT:
        try:
            del launches[next(iter(launches))]
        except (KeyError, RuntimeError, StopIteration):
            break  # another thread's call changed them in between: its own turn evicts
    return result


class _AtenOpsOfACall(TorchDispatchMode):
    """The aten ops that a call runs while on (besides its Triton launches, which torch does
    not see), for ``record_launch``: a launch made again repeats the call only where they
    make no values that the launch reads, which holds for allocations and views alone (and
    the NaN poison of a new output, ``_segments.POISON_OUTPUTS``, which a relaunched call's
    own output gets too). Anything else (a copy, a division, a search) and the call is more
    than its launch."""

    def __init__(self):
        super().__init__()
        self.others: list[str] = []
        self.filled: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.fill_:
            self.filled.append(args[0].data_ptr())
        elif not func.is_view and func.overloadpacket not in _ALLOCATIONS:
            self.others.append(str(func))
        return func(*args, **(kwargs or {}))

    def only_allocations_and_views(self, output: torch.Tensor | None) -> bool:
        """Whether the call ran no op but allocations, views and the poison of ``output``."""
        poisoned = [] if output is None or not _segments.POISON_OUTPUTS else [output.data_ptr()]
        return not self.others and self.filled == poisoned


_ALLOCATIONS = frozenset({torch.ops.aten.empty, torch.ops.aten.empty_like,
                          torch.ops.aten.empty_strided, torch.ops.aten.full,
                          torch.ops.aten.zeros})


def unpack(order: torch.Tensor | None, offsets: torch.Tensor | None,
           chunk_ends: torch.Tensor | None = None, chunk_slots: int = -1) -> Planned | None:
    """An operator's plan arguments as its body takes them: None without a plan. A sorted
    plan's order may come as an empty tensor (the plan operator returns tensors only)."""
    if offsets is None:
        return None
    order = order if order is not None and order.numel() else None
    return order, offsets, (chunk_ends, chunk_slots) if chunk_slots >= 0 else None


def _build(index: torch.Tensor, num_rows: int, promised_sorted: bool, check: str,
           caller: str = _CALLER, size_name: str = "num_rows"
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, offsets, chunk ends): the operator's body, also called directly in eager code,
    its errors in ``caller``'s words (``num_rows`` named ``size_name``). A sorted plan's order
    is an empty tensor (an operator returns tensors only)."""
    backend_name = current_backend(index.device.type, caller)
    check = _segments.check_that_runs(check, index.device.type, backend_name)
    # The reference backend plans as every backend but Numba's does: by torch operations.
    order, offsets = _segments.plan_from_index(
        caller, index, num_rows, index_name="index", size_name=size_name,
        promised_sorted=promised_sorted, backend_name=backend_name, check=check)
    if order is None:
        order = torch.empty(0, dtype=torch.int64, device=index.device)
    return order, offsets, kernels.chunk_ends(offsets)


@torch.library.custom_op("detsum::plan", mutates_args=())
def plan_op(index: torch.Tensor, num_rows: int, promised_sorted: bool, check: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _build(index, num_rows, promised_sorted, check)


@plan_op.register_fake
def _(index, num_rows, promised_sorted, check):
    length = 0 if promised_sorted else index.shape[0]
    return (index.new_empty(length, dtype=torch.int64),
            index.new_empty(num_rows + 1, dtype=torch.int64),
            index.new_empty(num_rows, dtype=torch.int64))


def plan(index: torch.Tensor, num_rows: int, *, sorted: bool = False,
         check: str = "host") -> Plan:
    """Make the plan of a 1-D ``index`` into ``num_rows`` output rows: check its values once
    and find, for each output row, its source rows in canonical order (order of appearance).

    Args:
        index: 1-D int32/int64, values in ``[0, num_rows)``.
        num_rows: the number of output rows (``input.size(dim)`` of the calls that will use
            the plan): a non-negative int.
        sorted: promise that ``index`` is nondecreasing (checked as ``check`` says): the plan
            then holds no order at all.
        check: how ``index``'s values are checked, once, here: ``"host"`` (default), read back
            and any bad value named with its position (with the number of chunks that long
            segments split into, a second read); ``"device"``, on the index's device
            with no host read (a bad value fails at the next synchronisation); ``"off"``, not
            checked on a GPU (a value outside ``[0, num_rows)`` leaves its row out of every
            call that uses the plan). On CPU tensors every level checks as ``"host"``.

    Returns:
        A :class:`Plan`. Calls that take it (``plan=``) check neither the index nor the plan's
        positions again, sort nothing and read nothing back: on a GPU each is its reduction's
        launch alone, which a CUDA graph can capture. Their backward passes reuse it too.

    The plan gives the same bits as a call without it, in every mode and on every backend. It
    stays valid as long as its index is not changed in place (a call with a changed index is
    refused; torch keeps no version counter for an index made under ``torch.inference_mode``,
    so a change to one of those goes unseen); it may be used on any backend and by every primitive whose index it describes
    (``index_add``, ``index_add_``, ``scatter_reduce`` with that 1-D index, ``segment_sum``).

    Example:
        >>> import torch, detsum
        >>> edges = torch.tensor([2, 0, 2, 1])
        >>> p = detsum.plan(edges, 3)
        >>> x = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
        >>> detsum.index_add(torch.zeros(3, 1), 0, edges, x, plan=p)
        tensor([[2.],
                [4.],
                [4.]])
        >>> detsum.segment_sum(x, plan=p)  # the same sums, without the zeros
        tensor([[2.],
                [4.],
                [4.]])
    """
    _validation.run_check(_check, index, num_rows, sorted, check)
    return plan_for_call(_CALLER, "num_rows", index, int(num_rows), sorted, check)


def plan_for_call(caller: str, size_name: str, index: torch.Tensor, num_rows: int,
                  sorted: bool, check: str) -> Plan:
    """:func:`plan` for a call of ``caller`` that checked its arguments and makes a plan of its
    own: the index's values are checked in ``caller``'s words, ``num_rows`` named
    ``size_name`` (where something traces the call, in :func:`plan`'s)."""
    if _can_call_directly(index):
        order, offsets, chunk_ends = _build(index, num_rows, sorted, check, caller, size_name)
    else:
        order, offsets, chunk_ends = plan_op(index, num_rows, sorted, check)
    if check == "host" and _can_call_directly(index):
        # The split is known once here: a launch then runs no program and no fold for chunks
        # that do not exist (an upper bound would launch both whenever the index is long).
        chunk_slots = int(chunk_ends[-1]) if num_rows else 0
    else:
        chunk_slots = kernels.chunk_slots_bound(index.shape[0])
    if _can_call_directly(index):
        _launches_of(offsets, make=True)  # its calls' launches are kept (call_with_plan)
    return Plan(index=index, num_rows=num_rows, order=None if sorted else order,
                offsets=offsets, check=check, sorted=sorted, index_version=_version(index),
                chunk_ends=chunk_ends, chunk_slots=chunk_slots)


def _can_call_directly(index: torch.Tensor) -> bool:
    # The operator is needed only where something traces or transforms the call (a plan has
    # no gradient, but a transform's index has no memory of its own to plan).
    return _dispatch.direct_call_ok(index) and not _transforms.active()


def _version(index: torch.Tensor) -> int | None:
    # A traced tensor has no version counter worth keeping: nothing changes it in place there.
    if torch.compiler.is_compiling():
        return 0
    return _eager_version(index)


def _eager_version(index: torch.Tensor) -> int | None:
    # torch keeps no counter for an inference tensor (reading it raises).
    return None if index.is_inference() else index._version


def _check(index, num_rows, sorted, check):
    _validation.check_index(_CALLER, "index", index, one_d=True)
    if isinstance(num_rows, bool) or not isinstance(num_rows, numbers.Integral):
        raise TypeError(f"{_CALLER}: num_rows={num_rows!r} is a {type(num_rows).__name__}; "
                        f"expected a non-negative int (index.max() + 1 as int(...), say)")
    if num_rows < 0:
        raise ValueError(f"{_CALLER}: num_rows={num_rows!r}; expected a non-negative int")
    _validation.check_flag(_CALLER, "sorted", sorted)
    _validation.check_level(_CALLER, check)


def check_plan(caller: str, plan: object, index: torch.Tensor | None, num_rows: int | None,
               num_rows_name: str, length: int, length_name: str) -> Plan:
    """``plan`` as a call takes it: a :class:`Plan` of ``index`` (the same tensor, unchanged
    since) into ``num_rows`` rows (None: any) with ``length`` positions, refused in
    ``caller``'s words."""
    if not isinstance(plan, Plan):
        raise TypeError(f"{caller}: plan must be a detsum.Plan (from detsum.plan(index, "
                        f"num_rows)), got {type(plan).__name__}")
    if num_rows is not None and plan.num_rows != num_rows:
        raise ValueError(f"{caller}: plan has num_rows = {plan.num_rows}; expected "
                         f"{num_rows_name} = {num_rows}")
    if plan.index.shape[0] != length:
        raise ValueError(f"{caller}: plan was made from an index of length "
                         f"{plan.index.shape[0]}; expected {length_name} = {length}")
    if torch.compiler.is_compiling():
        return plan  # a traced tensor has neither memory nor a version counter to compare
    if index is not None and index is not plan.index:
        same = (index.device == plan.index.device and index.dtype == plan.index.dtype
                and index.shape == plan.index.shape and index.stride() == plan.index.stride()
                and index.data_ptr() == plan.index.data_ptr())
        if not same:
            raise ValueError(f"{caller}: index is not the tensor plan was made from; expected "
                             f"plan.index (or a view of the same memory), or a plan made from "
                             f"this index")
    if _version(plan.index) != plan.index_version:
        raise ValueError(f"{caller}: plan's index was changed in place after the plan was "
                         f"made; expected a new plan: detsum.plan(index, {plan.num_rows})")
    return plan
