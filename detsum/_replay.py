"""A call without a plan, made again: its device work replayed from a record of an earlier call
of the same signature, without the Python that decided it.

On a GPU a call without a plan is host-bound: its Python (checks, the sort's set-up, the
launch's arguments, three launches' keys) takes several times its kernels' time. Yet for a
given signature (each tensor argument's dtype, shape, strides, device and alignment, the other
arguments, the settings that choose the path) that Python decides the same device work every
time, so long as it reads no value back: a fixed sequence of torch ops (allocations, views, a
check's assert) and Triton launches. ``call`` runs a call's whole path and, from the second
call of a signature, records that sequence (a ``Tape``); from the third it replays the tape on
the call's own tensors: each op run again on the tensors the replay made or was given, each
launch made again with their addresses (``RecordedLaunch.launch_at``). A replay gives the whole
path's bits: the same kernels on the same arguments, and the same torch ops on the same values.

A tape runs fewer ops than its whole path. Launches take addresses, not tensors: where only
launches take a tensor (the counting sort's ranks, table, values, order and offsets, a
reduction's workspace), the tape makes no tensor of its own for it. Each such allocation is a
piece of one workspace, allocated once a replay, and each such view (an ``unsqueeze`` for a
launch) the memory of its base at the recorded offset (``_Recorder._workspace``). The launches
get different addresses than the whole path's allocations would have had, and the same memory
otherwise: pieces apart, each as aligned as an allocation. On a GPU each allocation and view is
host time: a 5000-row ``index_add`` sorted by counting runs 1 torch op (the workspace) where
its whole path runs 11.

Taken only where that holds by construction (``replays``): the triton backend, eager, plain
tensors, no dispatch mode and no CUDA graph capture, at check "off" or "device" (no host read:
at "host" the call reads the index's check back, and raises or not by its value). A record is
dropped, the call never made again (``_NOT_AGAIN``), where its whole path

- read a value back (an op tagged as giving data-dependent output or shape, a copy across
  devices), which could have decided what the Python did next;
- used a tensor that is neither one of the call's tensors nor made during the call but shares
  memory with one (made without torch's dispatch: ``torch.from_numpy``, say), which the tape
  could not replace, or returned a tensor that is neither;
- ran one of detsum's operators (whose launches the record would hold twice).

Tensors the whole path took from detsum's caches (the ticket counters of a launch's chunk
programs) are kept by the tape and used again as they are: each such cache keeps its tensors
alive, as a launch leaves them. A launch that could not be made directly (its first, which
compiles; a hook installed) leaves no tape: the next call records again.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from detsum import _segments, kernels

#: Whether calls without a plan are made again from their tapes (tests and benchmarks turn it
#: off to compare with the whole path).
REPLAY = True

#: A signature whose call is never made again (``Tape``'s notes above).
_NOT_AGAIN = object()
#: A signature seen once: recorded at its next call (a call whose signature changes at every
#: call, a batch of another size each time, pays no recording).
_SEEN = object()

#: (caller, signature) -> Tape, _NOT_AGAIN or _SEEN, oldest first.
_TAPES: collections.OrderedDict = collections.OrderedDict()
#: How many signatures are kept (a model's layers and their backward calls, say).
_TAPES_KEPT = 64


def path_settings() -> tuple:
    """The module settings that choose a call's path without a plan besides
    ``_segments.launch_settings()`` (the tests' switches among them): part of a signature.
    Those that shape a launch alone are the launch's to check (``launch.SETTINGS``)."""
    from detsum.kernels.triton import counting_sort

    return (_segments.POISON_OUTPUTS, kernels.COUNTING_SORT_ON_CPU, kernels.NARROW_SORT_ABOVE,
            counting_sort.MAX_TABLE_CELLS)


def replays(t: torch.Tensor, check: str) -> bool:
    """Whether a call without a plan on data ``t`` at ``check`` may be made again from a tape
    (the notes above)."""
    return (REPLAY and type(t) is torch.Tensor and _segments.launches_on_triton(t.device.type)
            and _segments.check_that_runs(check, t.device.type, "triton") != "host"
            and not torch._C._len_torch_dispatch_stack()
            and not torch.compiler.is_compiling()
            and not (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def call(caller: str, signature: tuple, tensors: tuple, whole_path):
    """``whole_path()``, the body of a call without a plan on ``tensors`` (every tensor it is
    given: it reads or writes no other of the caller's), or the same call replayed from the
    tape of an earlier one of the same ``signature`` (what decides the call's path besides
    its tensors' values; ``replays`` must hold). Returns what ``whole_path`` returns."""
    key = (caller, signature)
    tape = _TAPES.get(key)
    if type(tape) is Tape:
        if tape.launches_as_recorded():
            return tape.replay(tensors)
        return whole_path()
    if tape is None:
        _keep(key, _SEEN)
        return whole_path()
    if tape is _NOT_AGAIN:
        return whole_path()
    return _record(key, tensors, whole_path)


def _keep(key: tuple, entry) -> None:
    """Keep ``entry`` for ``key``, newest, and forget the oldest past ``_TAPES_KEPT``."""
    try:
        _TAPES[key] = entry
        _TAPES.move_to_end(key)
        while len(_TAPES) > _TAPES_KEPT:
            _TAPES.popitem(last=False)
    except KeyError:  # another thread's call changed them in between: its turn evicts
        pass


def _record(key: tuple, tensors: tuple, whole_path):
    from detsum.kernels.triton import launch, segment

    if segment.interpreted() and not launch.RECORD_INTERPRETED:
        # Triton's interpreter records no launch, and its torch ops would each go through
        # the recording's dispatch mode.
        _keep(key, _NOT_AGAIN)
        return whole_path()
    if not launch.records_now():
        return whole_path()
    with launch.recording() as made, _Recorder(tensors, made) as recorder:
        result = whole_path()
    if None in made:
        # A launch that was not direct (a first compile, a hook): the next call records again.
        _keep(key, _SEEN)
        return result
    _keep(key, recorder.tape(made, result))
    return result


class _Slot:
    """A tensor of a replay: ``slots[i]``, the call's ``i``-th tensor or one it made."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


class _Recorder(TorchDispatchMode):
    """Records the ops a call runs, each with its arguments as slots (the call's tensors and
    those its ops made) or constants, and where it came among the call's launches."""

    def __init__(self, tensors: tuple, made: list):
        super().__init__()
        from detsum.kernels.triton import launch

        self.launch = launch
        self.made = made  # the call's launches so far
        self.slot_of = {id(t): i for i, t in reversed(list(enumerate(tensors)))}
        self.slot_count = len(tensors)
        self.tensor_of = dict(enumerate(tensors))  # slot -> the recorded call's tensor
        # Every tensor the call saw, alive until the tape is made: no id is used twice.
        self.seen = list(tensors)
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.constants: list[torch.Tensor] = []
        self.ops: list[tuple] = []  # (launches before it, func, args, kwargs, output slots)
        self.again = True

    def as_template(self, value):
        """``value`` with each tensor as its slot, or itself (a constant)."""
        if isinstance(value, torch.Tensor):
            slot = self.slot_of.get(id(value))
            if slot is not None:
                return _Slot(slot)
            self.constants.append(value)
            self.seen.append(value)
            return value
        if isinstance(value, (list, tuple)):
            return type(value)(self.as_template(v) for v in value)
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.again and not self.launch.launching():
            try:
                self.again = self._recorded(func, args, kwargs, out)
            except Exception:  # a tensor without storage, say: not made again
                self.again = False
        return out

    def _recorded(self, func, args, kwargs, out) -> bool:
        """Record ``func``'s call, or say that the call cannot be made again."""
        outs = tree_flatten(out)[0]
        tensors = [t for t in (*tree_flatten((args, kwargs))[0], *outs)
                   if isinstance(t, torch.Tensor)]
        if (torch.Tag.data_dependent_output in func.tags
                or torch.Tag.dynamic_output_shape in func.tags
                or len({t.device for t in tensors}) > 1):
            return False  # a value read back, which may have decided what came next
        if func.namespace == "detsum":
            # One of detsum's operators, whose launches the record holds too.
            return False
        if func is torch.ops.aten.detach.default and id(args[0]) in self.slot_of:
            # An alias with no autograd history: below autograd, the tensor itself.
            self.slot_of[id(out)] = self.slot_of[id(args[0])]
            self.seen.append(out)
            return True
        args, kwargs = self.as_template(args), self.as_template(kwargs)
        out_slots = []
        for o in outs:
            if isinstance(o, torch.Tensor):
                self.slot_of[id(o)] = self.slot_count
                self.tensor_of[self.slot_count] = o
                self.seen.append(o)
                self.storages.add(o.untyped_storage().data_ptr())
                out_slots.append(self.slot_count)
                self.slot_count += 1
            else:
                out_slots.append(None)
        self.ops.append((len(self.made), func, args, kwargs, tuple(out_slots), _form_of(out)))
        return True

    def _workspace(self, result_slot: int | None) -> tuple[set, dict, int, object]:
        """Which ops a replay leaves out, with the memory their launches then take: (the
        indices in ``ops`` of those left out, slot -> (base slot, byte offset): where each of
        their tensors lies, the workspace's size in bytes and its device). Left out: an allocation
        (``empty`` and its kin) or a view whose tensor only launches take (no op kept, nor
        the result): the allocation's memory is a piece of one workspace, allocated once (the
        slot after the others), a view's the memory of its base at the recorded offset.
        Launches take addresses, not tensors, so each is then handed what the whole path
        handed it, with one allocation for several."""
        taken = {result_slot}
        left_out = set()
        carved_devices = set()
        for k in reversed(range(len(self.ops))):
            _, func, args, kwargs, outs, form = self.ops[k]
            if (form is _ONE and outs[0] not in taken
                    and (_allocation(func, kwargs) or _view_of_a_slot(func, args, kwargs))):
                left_out.add(k)
                if not func.is_view:
                    carved_devices.add(self.tensor_of[outs[0]].device)
            else:
                taken.update(_slots_in((args, kwargs)))
        if len(carved_devices) > 1:  # never seen: one call's tensors are on one device
            left_out = {k for k in left_out if self.ops[k][1].is_view}
        where, size, device = {}, 0, None
        for k in sorted(left_out):
            _, func, args, _, (out,), _ = self.ops[k]
            if func.is_view:
                base, offset = where.get(args[0].i, (args[0].i, 0))
                where[out] = (base, offset + self.tensor_of[out].data_ptr()
                              - self.tensor_of[args[0].i].data_ptr())
            else:
                # Pieces of whole 256-byte units: each aligned as an allocation's, and none
                # (not even an empty one) at another's address.
                where[out] = (self.slot_count, size)
                size += max(1, -(-self.tensor_of[out].untyped_storage().nbytes() // 256)) * 256
                device = self.tensor_of[out].device
        return left_out, where, size, device

    def tape(self, made: list, result):
        """The call's ``Tape``, or ``_NOT_AGAIN`` (the notes above)."""
        launches = [(made_launch, self.as_template(made_launch.args)) for made_launch in made]
        result_slot = None
        if result is not None:
            result_slot = (self.slot_of.get(id(result)) if isinstance(result, torch.Tensor)
                           else None)
            if result_slot is None:
                return _NOT_AGAIN
        if not self.again or any(c.untyped_storage().data_ptr() in self.storages
                                 for c in self.constants):
            return _NOT_AGAIN
        left_out, where, size, device = self._workspace(result_slot)
        steps = []
        if size:
            steps.append((_OP, torch.empty, ([size],), {"dtype": torch.uint8, "device": device},
                          (), self.slot_count, _ONE))
        for i in range(len(launches) + 1):
            steps.extend(_op_step(*op[1:]) for k, op in enumerate(self.ops)
                         if op[0] == i and k not in left_out)
            if i < len(launches):
                steps.append(_launch_step(*launches[i], where))
        from detsum.kernels.triton import chunks

        return Tape(tuple(steps), self.slot_count + (size > 0), result_slot,
                    tuple(step[1] for step in steps if step[0] is _LAUNCH),
                    tuple(c for c in self.constants if chunks.are_ticket_counters(c)))


# ---- the steps of a tape ------------------------------------------------------------------------
# An op: (_OP, function, arguments, keyword arguments, fills, output slot or slots, form), where
# fills lists (position, slot) of the arguments to fill (None: some slot is nested, or a
# keyword argument: filled by ``_filled``), and an output that is one tensor has one slot;
# form (``_form_of``) says how the slots match the output.
# A launch: (_LAUNCH, recorded launch, arguments, places): at each place (position, base slot,
# byte offset, ...), the memory it takes (``RecordedLaunch.launch_at``).
_OP, _LAUNCH = object(), object()

_aten = torch.ops.aten
#: Ops replayed through torch's Python functions that run them, which parse their arguments
#: in a third to a quarter of an op overload's time (the same op, the same arguments).
_FUNCTIONS = {
    _aten.unsqueeze.default: torch.Tensor.unsqueeze, _aten.view.default: torch.Tensor.view,
    _aten.view.dtype: torch.Tensor.view, _aten.permute.default: torch.Tensor.permute,
    _aten.select.int: torch.Tensor.select, _aten.expand.default: torch.Tensor.expand,
    _aten.transpose.int: torch.Tensor.transpose, _aten.cumsum.default: torch.cumsum,
    _aten.fill_.Scalar: torch.Tensor.fill_, _aten.zero_.default: torch.Tensor.zero_,
    _aten._assert_async.msg: torch._assert_async, _aten.empty_like.default: torch.empty_like,
    _aten.empty_strided.default: torch.empty_strided, _aten.clone.default: torch.clone,
    _aten.copy_.default: torch.Tensor.copy_, _aten.cummax.default: torch.cummax,
    _aten.clamp.default: torch.clamp,
}
#: Allocations: ops whose tensor a launch may take as a piece of a workspace instead.
_ALLOCATIONS = frozenset({_aten.empty.memory_format, _aten.empty_strided.default,
                          _aten.empty_like.default})
#: Factories replayed through torch's, for a strided, unpinned, contiguous tensor.
_FACTORIES = {_aten.empty.memory_format: torch.empty, _aten.zeros.default: torch.zeros,
              _aten.full.default: torch.full}


_ONE, _FLAT, _NESTED = object(), object(), object()


def _form_of(out) -> object:
    """How an op's output holds its tensors: ``_ONE`` tensor, a ``_FLAT`` tuple or list of
    them (``cummax``'s two), or ``_NESTED`` otherwise (read through ``tree_flatten``, whose
    leaves the slots are)."""
    if isinstance(out, torch.Tensor):
        return _ONE
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return _FLAT
    return _NESTED


def _op_step(func, args, kwargs, out_slots, form) -> tuple:
    fills = [(i, a.i) for i, a in enumerate(args) if type(a) is _Slot]
    nested = any(_has_slot(a) for a in args if type(a) is not _Slot) or _has_slot(kwargs)
    function = _FUNCTIONS.get(func)
    factory = _FACTORIES.get(func)
    if (factory is not None and kwargs.get("layout") in (None, torch.strided)
            and not kwargs.get("pin_memory")
            and kwargs.get("memory_format") in (None, torch.contiguous_format)):
        function = factory
        kwargs = {name: kwargs[name] for name in ("dtype", "device") if name in kwargs}
    if func is _aten.slice.Tensor and not kwargs:
        # Through Python's indexing, which takes a slice in a third of the op's time.
        rows = _basic_index(*args[1:])
        if rows is not None:
            function, args = torch.Tensor.__getitem__, (args[0], rows)
            fills, nested = [(0, args[0].i)] if type(args[0]) is _Slot else [], False
    out = out_slots[0] if form is _ONE else out_slots
    return (_OP, function or func, args, kwargs, None if nested else tuple(fills), out, form)


def _basic_index(dim=0, start=None, end=None, step=1) -> tuple | None:
    """The index ``t[...]`` that makes ``aten.slice.Tensor(t, dim, start, end, step)``, or
    None where Python's slicing would not read the arguments alike."""
    if not (type(dim) is int and dim >= 0 and type(step) is int and step >= 1
            and all(bound is None or type(bound) is int for bound in (start, end))):
        return None
    return (slice(None),) * dim + (slice(start, end, step),)


def _launch_step(made_launch, args, where: dict) -> tuple:
    # Each tensor the call gives or makes, as the memory of its slot (or of the workspace, or
    # a view's base) at an offset; the recorded tensors' places were their addresses.
    places = tuple((i, *where.get(a.i, (a.i, 0)), not t.data_ptr() & 15, t.dtype,
                    tuple(t.shape), t.stride())
                   for i, (a, t) in enumerate(zip(args, made_launch.args)) if type(a) is _Slot)
    # The record's own tensors are dropped: the tape holds slots, and constants.
    return (_LAUNCH, dataclasses.replace(made_launch, args=(), holds=None), list(args), places)


def _allocation(func, kwargs: dict) -> bool:
    """Whether ``func`` makes a new tensor whose values are never read before written
    (an allocation that a workspace's piece can stand for)."""
    return (func in _ALLOCATIONS and kwargs.get("layout") in (None, torch.strided)
            and not kwargs.get("pin_memory"))


def _view_of_a_slot(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` is a view of its first argument, a slot, with no other slot."""
    return (func.is_view and bool(args) and type(args[0]) is _Slot
            and not _has_slot(args[1:]) and not _has_slot(kwargs))


def _slots_in(value) -> list[int]:
    if type(value) is _Slot:
        return [value.i]
    if type(value) is dict:
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [slot for v in value for slot in _slots_in(v)]
    return []


def _has_slot(value) -> bool:
    return bool(_slots_in(value))


def _filled(value, slots: list):
    if type(value) is _Slot:
        return slots[value.i]
    if type(value) is dict:
        return {name: _filled(v, slots) for name, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_filled(v, slots) for v in value)
    return value


class Tape:
    """The device work of one call without a plan, in order: ops (each a function on
    arguments whose tensors are slots) and launches (``RecordedLaunch.launch_at``);
    ``replay`` makes it on another call's tensors."""

    __slots__ = ("steps", "slot_count", "result_slot", "launches", "counters")

    def __init__(self, steps: tuple, slot_count: int, result_slot: int | None,
                 launches: tuple, counters: tuple):
        self.steps = steps
        self.slot_count = slot_count
        self.result_slot = result_slot
        self.launches = launches
        # The ticket counters its launches share with other calls: set back to 0 where a
        # check raises during a replay, as the launch's own report does (a CPU's assert raises
        # at once, after bounds that fail may have left some off 0).
        self.counters = counters

    def launches_as_recorded(self) -> bool:
        """Whether launches now find the device, stream, settings and launch options, and no
        hook, as the recorded call's did (``launch.launches_as_recorded``): what decided them
        besides the signature (the ticket counters a tape holds are its stream's, say)."""
        from detsum.kernels.triton import launch

        return launch.launches_as_recorded(self.launches)

    def replay(self, tensors: tuple):
        """The call on ``tensors`` (of the recorded call's signature), as its whole path would
        make it, where ``launches_as_recorded``; returns what the whole path returns."""
        slots = [*tensors, *[None] * (self.slot_count - len(tensors))]
        try:
            self._run(slots)
        except RuntimeError:
            for counters in self.counters:
                counters.zero_()
            raise
        return None if self.result_slot is None else slots[self.result_slot]

    def _run(self, slots: list) -> None:
        for step in self.steps:
            if step[0] is _OP:
                _, function, args, kwargs, fills, out_slot, form = step
                if fills is None:
                    out = function(*_filled(args, slots), **_filled(kwargs, slots))
                elif fills:
                    args = list(args)
                    for i, slot in fills:
                        args[i] = slots[slot]
                    out = function(*args, **kwargs)
                else:
                    out = function(*args, **kwargs)
                if type(out_slot) is int:
                    slots[out_slot] = out
                else:
                    for slot, o in zip(out_slot, out if form is _FLAT else tree_flatten(out)[0]):
                        if slot is not None:
                            slots[slot] = o
            else:
                _, made_launch, args, places = step
                made_launch.launch_at(args, slots, places, checked=True)
