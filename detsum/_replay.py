"""A call without a plan, made again: its device work replayed from a record of an earlier call
of the same signature, without the Python that decided it.

On a GPU a call without a plan is host-bound: its Python (checks, the sort's set-up, the
launch's arguments, three launches' keys) takes several times its kernels' time. Yet for a
given signature (each tensor argument's dtype, shape, strides, device and alignment, the other
arguments, the settings that choose the path) that Python decides the same device work every
time, so long as it reads no value back: a fixed sequence of torch ops (allocations, views, the
counting sort's running sum, a check's assert) and Triton launches. ``call`` runs a call's
whole path and, from the second call of a signature, records that sequence (a ``Tape``); from
the third it replays the tape on the call's own tensors: each op run again on the tensors the
replay made or was given, each launch made again with their addresses
(``RecordedLaunch.launch_again``). A replay gives the whole path's bits: the same kernels on
the same arguments, and the same torch ops on the same values.

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
                self.seen.append(o)
                self.storages.add(o.untyped_storage().data_ptr())
                out_slots.append(self.slot_count)
                self.slot_count += 1
            else:
                out_slots.append(None)
        self.ops.append((len(self.made), func, args, kwargs, tuple(out_slots)))
        return True

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
        steps = []
        for i in range(len(launches) + 1):
            steps.extend(_op_step(*op[1:]) for op in self.ops if op[0] == i)
            if i < len(launches):
                steps.append(_launch_step(*launches[i]))
        from detsum.kernels.triton import chunks

        return Tape(tuple(steps), self.slot_count, result_slot,
                    tuple(step[1] for step in steps if step[0] is _LAUNCH),
                    tuple(c for c in self.constants if chunks.are_ticket_counters(c)))


# ---- the steps of a tape ------------------------------------------------------------------------
# An op: (_OP, function, arguments, keyword arguments, fills, output slot or slots), where
# fills lists (position, slot) of the arguments to fill (None: some slot is nested, or a
# keyword argument: filled by ``_filled``), and an output that is one tensor has one slot.
# A launch: (_LAUNCH, recorded launch, arguments, fills, the positions of its tensors).
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
    _aten.copy_.default: torch.Tensor.copy_,
}
#: Factories replayed through torch's, for a strided, unpinned, contiguous tensor.
_FACTORIES = {_aten.empty.memory_format: torch.empty, _aten.zeros.default: torch.zeros,
              _aten.full.default: torch.full}


def _op_step(func, args, kwargs, out_slots) -> tuple:
    fills = [(i, a.i) for i, a in enumerate(args) if type(a) is _Slot]
    nested = any(_has_slot(a) for a in args if type(a) is not _Slot) or _has_slot(kwargs)
    function = _FUNCTIONS.get(func)
    factory = _FACTORIES.get(func)
    if (factory is not None and kwargs.get("layout") in (None, torch.strided)
            and not kwargs.get("pin_memory")
            and kwargs.get("memory_format") in (None, torch.contiguous_format)):
        function = factory
        kwargs = {name: kwargs[name] for name in ("dtype", "device") if name in kwargs}
    out = (out_slots[0] if len(out_slots) == 1 and out_slots[0] is not None
           else out_slots if any(slot is not None for slot in out_slots) else ())
    return (_OP, function or func, args, kwargs, None if nested else tuple(fills), out)


def _launch_step(made_launch, args) -> tuple:
    fills = tuple((i, a.i) for i, a in enumerate(args) if type(a) is _Slot)
    tensors = tuple(i for i, a in enumerate(made_launch.args) if type(a) is not int)
    # The record's own tensors are dropped: the tape holds slots, and constants.
    return (_LAUNCH, dataclasses.replace(made_launch, args=(), holds=None), list(args), fills,
            tensors)


def _has_slot(value) -> bool:
    if type(value) is _Slot:
        return True
    if type(value) is dict:
        return any(map(_has_slot, value.values()))
    return isinstance(value, (list, tuple)) and any(map(_has_slot, value))


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
    arguments whose tensors are slots) and launches (``RecordedLaunch.launch_again``);
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
                _, function, args, kwargs, fills, out_slot = step
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
                    for slot, o in zip(out_slot, tree_flatten(out)[0]):
                        if slot is not None:
                            slots[slot] = o
            else:
                _, made_launch, args, fills, tensors_at = step
                args = list(args)
                for i, slot in fills:
                    args[i] = slots[slot]
                made_launch.launch_again(args, tensors_at, checked=True)
