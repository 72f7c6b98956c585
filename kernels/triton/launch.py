"""Launching detsum's Triton kernels with little host work.

``Kernel(jitted)(grid, args, constexprs, num_warps=...)`` launches the ``@triton.jit``
function ``jitted`` as ``jitted[grid](*args, num_warps=..., enable_fp_fusion=False,
**constexprs)`` does (every detsum kernel runs without FMA contraction: see segment.py).

Why: ``JITFunction.run``, Triton's launch, spends about 25 us of host time on a launch of
``_segment_kernel`` on a 2-core EPYC with triton 3.9 (20 us with 3.6; benches/NOTES.md,
benches/host_launch.py): it binds the arguments, specialises each of them, turns the
specialisation into a string key, re-checks every module-level ``tl.constexpr`` the kernel
reads (6.6 us for the ten that ``_segment_kernel`` reads) and builds the launch metadata. A
call with a plan is one launch, so that is 25 of the about 60 us it costs through
``JITFunction.run``. Here the first launch of each specialisation goes through
``JITFunction.run``, which compiles the kernel (or finds it in its cache), launches it and
returns the ``CompiledKernel``; later launches with the same key call that compiled kernel
as ``JITFunction.run`` does after its own lookup: about 8 us in all, 3.5 of them computing
and looking up the key.

POINTERS. A direct launch hands the compiled kernel's launcher each tensor's data pointer as
an int, read once for the key (whose alignment test needs it anyway), not the tensor. For a
tensor, Triton's C launcher calls ``data_ptr()`` and then asks the CUDA driver whether the
address is device memory (``cuPointerGetAttribute``, a driver call per pointer, ten or more
for a ``_segment_kernel`` launch); an int it takes as the address itself. The question
guards against CPU tensors, which never reach here: every tensor of a detsum launch was made
on, or checked to be on, the launch's device, and a specialisation's first launch, through
``JITFunction.run``, still hands over the tensors (``POINTERS_AS_INTS`` off: tensors on
every launch, to compare the two on a GPU).

THE KEY (``specialisation_key``). Triton compiles one kernel per specialisation of the
arguments, and a launch must run the one compiled for its own arguments: a kernel compiled
for 16-byte aligned pointers, say, reads misaligned ones wrongly on a GPU, silently. The key
is at least as fine as Triton's (tests/test_triton_launch.py checks it against the key
``JITFunction.run`` computes, and the kernel it picks): the current device; ``num_warps``;
the options ``JITFunction.run`` reads from Triton's knobs at each launch (``debug``,
``instrumentation_mode`` and, from 3.9, ``fpsan_homomorphic_casts``); each constexpr's value
and type (``True == 1 == 1.0`` in Python, not to the compiler); each tensor's dtype and
whether its data pointer is a multiple of 16; and for each integer whether it equals 1
(Triton makes a 1 a constant), whether it is a multiple of 16, whether it fits an int32
(Triton passes it as i32, else as i64) and whether it needs a u64.

Left out on purpose: Triton's check, at each launch, that the module-level ``tl.constexpr``
values a kernel reads have not changed since it was compiled. detsum's are constants that
nothing reassigns, so the check would cost every launch those 6.6 us and never fire.
Passing them to the kernels as constexpr parameters instead would spare ``JITFunction.run``
the check too, but it runs only where the direct launch cannot (below), so they stay module
constants.

RECORDED LAUNCHES (``recording``, ``RecordedLaunch``, ``Relaunch``). Inside ``with
recording() as made:`` each launch on this thread is appended to ``made``: a
``RecordedLaunch`` for a direct launch handed data pointers, None for any other. A call
whose one launch was recorded, and whose launcher said what the launch made for itself
(``holds``: a workspace, ticket counters, alpha; None where the launch is not the whole
call), can be made again by a ``Relaunch`` (``RecordedLaunch.with_slots``) with other data
pointers in the slots of the call's own tensors, skipping everything between the call and
the driver: the caller's Python and this module's key. detsum's plans use it
(``detsum.plans.call_with_plan``): a call with a plan repeats its arguments' layout step
after step. A relaunch hands the driver what the direct launch would hand it for the new
pointers, under conditions it checks at each call: each new pointer's 16-byte alignment as
recorded (the same compiled kernel), the same device, launch options and ``SETTINGS``, no
hook installed, and the same stream (what the launch made and the record holds, such as a
workspace, is reused in that stream's order, as the caching allocator would reuse its
memory). tests/launch_check.py compares the two. A record can also be made again whole with
its tensors at other addresses (``RecordedLaunch.launch_at``: each a base tensor's address
plus an offset, the recorded integers), as a call without a plan is made again from the
records of its several launches (``detsum._replay``): straight to the compiled kernel where
``Kernel`` would take it, through ``Kernel`` on tensors made at those addresses otherwise.
Recordings nest, each seeing every launch inside it.

FALLBACK: ``JITFunction.run`` on every launch where the direct call cannot be shown to do
what it would:

- the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: the kernel is an
  ``InterpretedFunction``, launched as before);
- a Triton outside the releases whose launch path this follows (``DIRECT_LAUNCH``);
- a launch hook (a profiler's), a pre-run hook of the kernel or a stage-inspection hook is
  installed: ``JITFunction.run`` hands the first launch metadata and calls the others, which
  the direct call would skip;
- ``JITFunction.run`` returned no ``CompiledKernel`` (an asynchronous compile, or a
  ``jit_cache_hook`` that declined to compile): nothing is kept, the next launch asks again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction

try:
    from triton.knobs import HookChain
except ImportError:  # a Triton outside DIRECT_LAUNCH's releases
    HookChain = None

__all__ = ["DIRECT_LAUNCH", "POINTERS_AS_INTS", "SETTINGS", "Kernel", "RecordedLaunch",
           "Relaunch", "key_for_layout", "launch_settings", "recording", "records_now",
           "specialisation_key"]


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


#: Whether a launch after its specialisation's first calls the compiled kernel directly: in
#: the releases pyproject accepts, whose ``JITFunction.run`` (its key, the knobs it reads,
#: the arguments it hands ``CompiledKernel.run``) this module follows; checked on 3.6, 3.8
#: and 3.9. False: ``JITFunction.run`` launches every time.
DIRECT_LAUNCH = (3, 6) <= _release(triton.__version__) < (3, 10)

#: Whether a direct launch hands the launcher data pointers (ints) rather than tensors (see
#: POINTERS above): the launcher of every release in DIRECT_LAUNCH's range takes an int as the
#: address, with no call to the driver.
POINTERS_AS_INTS = True

#: Whether a launch in Triton's interpreter is recorded (``InterpretedLaunch``), where it
#: would be None: for the tests of a call made again from its record (``detsum._replay``)
#: without a GPU, which then makes its launches again through ``Kernel``, interpreted.
RECORD_INTERPRETED = False

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_UINT64_MIN = 2**63


def _int_class(arg: int) -> int:
    """What Triton specialises an integer argument on, as one negative number (a tensor's
    entry in the key is a pair, so the two never meet): whether it is 1, whether a multiple
    of 16, whether it fits an int32, whether it needs a u64."""
    return -1 - ((arg == 1) | (arg & 15 == 0) << 1 | (_INT32_MIN <= arg <= _INT32_MAX) << 2
                 | (arg >= _UINT64_MIN) << 3)


# The integers of a launch are mostly sizes and strides, small and non-negative: their classes
# looked up, not computed (a third of the key's cost).
_SMALL_INTS = 1 << 14
_SMALL_INT_CLASSES = tuple(map(_int_class, range(_SMALL_INTS)))


def _launch_options() -> tuple:
    """The options ``JITFunction.run`` reads from Triton's knobs at each launch."""
    compilation = knobs.compilation
    return (knobs.runtime.debug, compilation.instrumentation_mode,
            getattr(compilation, "fpsan_homomorphic_casts", None))


def specialisation_key(device: int, num_warps: int, constexpr_values, args) -> tuple:
    """The key of a launch's compiled kernel (see THE KEY above): equal keys, same kernel.

    ``args`` are tensors and ints (the kernel's other parameters), ``constexpr_values`` the
    constexprs' values in the kernel's order."""
    return key_and_pointers(device, num_warps, constexpr_values, args)[0]


def key_and_pointers(device: int, num_warps: int, constexpr_values, args
                     ) -> tuple[tuple, tuple]:
    """(``specialisation_key``'s key, ``args`` with each tensor's data pointer in its place):
    what a direct launch needs of its arguments, each pointer read once."""
    pointers = tuple(arg if type(arg) is int else arg.data_ptr() for arg in args)
    return (device, num_warps, _launch_options(),
            *constexpr_values, *map(type, constexpr_values),
            *[(arg.dtype, not pointer & 15) if type(arg) is not int
              else _SMALL_INT_CLASSES[arg] if 0 <= arg < _SMALL_INTS else _int_class(arg)
              for arg, pointer in zip(args, pointers)]), pointers


# A small integer's class by a dict lookup: exact for ints (a bool or a float equal to a key
# would find it too, so the key made for a layout looks up only what it checked to be int).
_small_int_class = dict(enumerate(_SMALL_INT_CLASSES)).get


def key_for_layout(args: tuple) -> Callable[[int, int, object, tuple], tuple[tuple, tuple]]:
    """``key_and_pointers`` made for launches whose arguments have the layout of ``args``: the
    same number of them, an ``int`` where ``args`` has one, a tensor elsewhere. It returns what
    ``key_and_pointers`` returns, for any arguments (others than that layout take
    ``key_and_pointers`` itself), in straight-line code: the generic loop over the 28
    arguments of a ``_segment_kernel`` launch costs it half a microsecond more."""
    names = [f"arg{i}" for i in range(len(args))]
    ints = [name for name, arg in zip(names, args) if type(arg) is int]
    pointers = {name: f"p{name[3:]}" for name, arg in zip(names, args) if type(arg) is not int}
    entries = [f"_small_int_class({name}) or _int_class({name})" if name not in pointers
               else f"({name}.dtype, not {pointers[name]} & 15)" for name in names]
    all_ints = " is ".join([f"type({name})" for name in ints] + ["int"])
    source = (
        "def key(device, num_warps, constexpr_values, args):\n"
        "    try:\n"
        f"        ({''.join(name + ', ' for name in names)}) = args\n"
        f"        if {all_ints}:\n"
        + "".join(f"            {pointer} = {name}.data_ptr()\n"
                  for name, pointer in pointers.items()) +
        "            return ((device, num_warps, _launch_options(), *constexpr_values,\n"
        "                     *map(type, constexpr_values),\n"
        f"                     {''.join(entry + ', ' for entry in entries)}),\n"
        f"                    ({''.join(pointers.get(name, name) + ', ' for name in names)}))\n"
        # Another number of arguments, or no tensor where the layout has one.
        "    except (ValueError, AttributeError):\n"
        "        pass\n"
        "    return key_and_pointers(device, num_warps, constexpr_values, args)\n")
    namespace = {"_small_int_class": _small_int_class, "_int_class": _int_class,
                 "_launch_options": _launch_options, "key_and_pointers": key_and_pointers}
    exec(compile(source, f"<key for a launch of {len(args)} arguments>", "exec"), namespace)
    return namespace["key"]


def _hooks_installed(jitted: JITFunction) -> bool:
    """Whether ``JITFunction.run`` would call a hook at this launch (an empty HookChain, the
    knobs' default, calls nothing)."""
    return bool(jitted.pre_run_hooks) or _global_hooks_installed()


def _global_hooks_installed() -> bool:
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool((enter is not None and (type(enter) is not HookChain or enter.calls))
                or (leave is not None and (type(leave) is not HookChain or leave.calls))
                or getattr(runtime, "add_stages_inspection_hook", None) is not None)


def records_now() -> bool:
    """Whether a launch now would be direct and handed data pointers, as a record needs (see
    RECORDED LAUNCHES): else a call need not be made under ``recording``."""
    return DIRECT_LAUNCH and POINTERS_AS_INTS and not _global_hooks_installed()


class Kernel:
    """A ``@triton.jit`` kernel, launched by ``self(grid, args, constexprs, num_warps=...)``.

    ``args`` holds the values of the kernel's parameters that are not constexpr (tensors and
    ints), in order; ``constexprs`` (a dict) the others by name, in the kernel's order: their
    values go to the compiled kernel by position, so a launch that names them in another
    order raises. A dict rather than keyword arguments: unpacking 17 of them into a call and
    packing them again costs a small launch half a microsecond.
    """

    def __init__(self, jitted):
        self.jitted = jitted
        self._compiled: dict[tuple, tuple] = {}  # key -> (launcher, function, metadata, kernel)
        self._key = None  # key_for_layout of the first direct launch's arguments
        self._jit = isinstance(jitted, JITFunction)
        if self._jit:
            names = [p.name for p in jitted.params]
            self._constexpr_names = tuple(p.name for p in jitted.params if p.is_constexpr)
            if names[len(names) - len(self._constexpr_names):] != list(self._constexpr_names):
                raise AssertionError(f"{jitted.fn.__name__}: the constexpr parameters must "
                                     f"come after all the others")

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict, *,
                 num_warps: int, holds: tuple | None = None):
        """Launch; ``holds``: for a launch that ``recording`` may record, the tensors among
        ``args`` that the caller made for this launch alone and that a relaunch may use
        again (a workspace, a constant), or None where the call does more than this launch
        (a check read back after it, say), so that repeating the launch alone would not
        repeat the call."""
        jitted = self.jitted
        if not (self._jit and DIRECT_LAUNCH) or _hooks_installed(jitted):
            if not _RECORDING.open:
                jitted[grid](*args, num_warps=num_warps, enable_fp_fusion=False, **constexprs)
                return
            # The torch ops that Triton's interpreter runs are the launch's, no op of the call.
            _RECORDING.launching += 1
            try:
                jitted[grid](*args, num_warps=num_warps, enable_fp_fusion=False, **constexprs)
            finally:
                _RECORDING.launching -= 1
            _record(InterpretedLaunch(self, grid, dict(constexprs), num_warps,
                                      launch_settings(), args)
                    if RECORD_INTERPRETED and not self._jit else None)
            return
        if tuple(constexprs) != self._constexpr_names:
            raise TypeError(f"{jitted.fn.__name__}: constexprs {tuple(constexprs)}; expected "
                            f"{self._constexpr_names}, in that order")
        active = driver.active
        device = active.get_current_device()
        values = constexprs.values()
        key_of = self._key
        if key_of is None:
            key_of = self._key = key_for_layout(args)
        key, pointers = key_of(device, num_warps, values, args)
        found = self._compiled.get(key)
        if found is None:
            compiled = jitted.run(*args, grid=grid, warmup=False, num_warps=num_warps,
                                  enable_fp_fusion=False, **constexprs)
            if isinstance(compiled, CompiledKernel):
                # The launcher first: reading it loads the kernel, which sets its function.
                # The kernel is kept too: its module is unloaded when it is collected.
                self._compiled[key] = (compiled.run, compiled.function,
                                       compiled.packed_metadata, compiled)
            _record(None)
            return
        run, function, packed_metadata, _ = found
        grid_x, grid_y, grid_z = grid if len(grid) == 3 else (*grid, 1, 1)[:3]
        # What JITFunction.run hands the compiled kernel after its own lookup: every
        # parameter's value (the launcher skips the constexprs; a tensor as its address, see
        # POINTERS), and no launch metadata or hooks, since none would run.
        stream = active.get_current_stream(device)
        run(grid_x, grid_y, grid_z, stream, function, packed_metadata, None, None, None,
            *(pointers if POINTERS_AS_INTS else args), *values)
        if _RECORDING.open:
            _record(None if not POINTERS_AS_INTS else RecordedLaunch(
                self, run, function, packed_metadata, (grid_x, grid_y, grid_z), device, stream,
                key[2], launch_settings(), pointers, tuple(values), holds, num_warps,
                args=args))


class _Recording(threading.local):
    #: The lists of the blocks open on this thread (``recording``), outermost first.
    open: tuple[list, ...] = ()
    #: How many launches through ``JITFunction.run`` are under way inside them.
    launching: int = 0


_RECORDING = _Recording()


def _record(launch: RecordedLaunch | None) -> None:
    for made in _RECORDING.open:
        made.append(launch)


def launching() -> bool:
    """Whether a launch is under way on this thread inside a ``recording`` block: the torch
    ops run now (Triton's interpreter's) are the launch's."""
    return _RECORDING.launching > 0


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """The launches made on this thread inside the block, in order (see RECORDED LAUNCHES):
    a ``RecordedLaunch`` for each direct launch handed data pointers, None for every other
    launch. Blocks nest; each sees every launch made inside it, its inner blocks' too: a
    ``Relaunch`` as None, and ``RecordedLaunch.launch_at`` through ``Kernel``."""
    outer = _RECORDING.open
    made: list = []
    _RECORDING.open = (*outer, made)
    try:
        yield made
    finally:
        _RECORDING.open = outer


#: What else decides the launch a call makes, read by a relaunch at each call: functions of
#: no arguments that return the current value of a module setting (``segment.TILE_BYTES``,
#: say); the modules that hold such settings add theirs when imported.
SETTINGS: list[Callable[[], object]] = []


def launch_settings() -> tuple:
    """The current values of ``SETTINGS``, with this module's own."""
    return (DIRECT_LAUNCH, POINTERS_AS_INTS, *[setting() for setting in SETTINGS])


@dataclasses.dataclass(frozen=True, eq=False)
class _Launch:
    """What a direct launch hands the driver, and what decided it."""

    kernel: Kernel
    run: Callable
    function: object
    packed_metadata: object
    grid: tuple[int, int, int]
    device: int
    stream: int
    options: tuple
    settings: tuple
    #: Each argument's value as handed over (a tensor's data pointer); the constexprs' values.
    pointers: tuple
    values: tuple
    #: The tensors the caller made for the launch alone, or None where the launch is not
    #: the whole of its call (``Kernel``'s ``holds``).
    holds: tuple | None
    num_warps: int


@dataclasses.dataclass(frozen=True, eq=False)
class RecordedLaunch(_Launch):
    """One direct launch, as ``Kernel`` handed it to the driver (see RECORDED LAUNCHES)."""

    #: The launch's arguments themselves (tensors and ints).
    args: tuple = ()

    def with_slots(self, tensors: tuple, kept: tuple) -> Relaunch | None:
        """This launch, to be made again with other tensors in the place of ``tensors`` (the
        call's own: its inputs and output): the positions of the arguments that are each
        (its data pointer), without the record's references to them. None where that would
        not repeat the call: two of ``tensors`` share a pointer, one is no argument, or an
        argument is none of them, nor one of ``kept`` (tensors that outlive the relaunch
        unchanged, a plan's), nor one the launch's caller let it hold (``holds``)."""
        pointers = [t.data_ptr() for t in tensors]
        if self.holds is None or len(set(pointers)) < len(pointers):
            return None
        kept_pointers = {t.data_ptr() for t in kept}
        held = {id(t) for t in self.holds}
        for arg, pointer in zip(self.args, self.pointers):
            if (type(arg) is not int and pointer not in pointers
                    and pointer not in kept_pointers and id(arg) not in held):
                return None
        slots = tuple(tuple(i for i, arg in enumerate(self.args)
                            if type(arg) is not int and self.pointers[i] == pointer)
                      for pointer in pointers)
        if not all(slots):
            return None
        launch = {field.name: getattr(self, field.name)
                  for field in dataclasses.fields(_Launch)}
        return Relaunch(**launch, slots=slots,
                        aligned=tuple(not pointer & 15 for pointer in pointers))

    def launch_at(self, args: list, bases: list, places: tuple, checked: bool = False
                  ) -> None:
        """This launch made with its tensor arguments at other addresses: at each of
        ``places``, ``(position, base, offset, aligned, dtype, shape, strides)``, the memory
        ``offset`` bytes past ``bases[base]``'s data pointer, as a tensor of that dtype, shape
        and strides (``aligned``: whether the recorded one was 16-byte aligned); the recorded
        arguments elsewhere (``args``, whose entries at ``places`` are not read). Straight to
        the recorded compiled kernel, with no tensor made, where ``Kernel`` would launch that
        one with these arguments (each pointer aligned as recorded; ``launches_as_recorded``,
        unless the caller has ``checked`` it for this launch; no recording open, which would
        miss it); through ``Kernel``, on tensors made at those addresses (``tensors_at``),
        otherwise: it compiles or falls back as it does for any launch."""
        if not _RECORDING.open and (checked or launches_as_recorded((self,))):
            pointers = list(self.pointers)
            for position, base, offset, aligned, _, _, _ in places:
                pointer = pointers[position] = bases[base].data_ptr() + offset
                if (not pointer & 15) != aligned:
                    break
            else:
                grid_x, grid_y, grid_z = self.grid
                self.run(grid_x, grid_y, grid_z, self.stream, self.function,
                         self.packed_metadata, None, None, None, *pointers, *self.values)
                return
        self.kernel(self.grid, tensors_at(args, bases, places),
                    dict(zip(self.kernel._constexpr_names, self.values)),
                    num_warps=self.num_warps)


def tensors_at(args: list, bases: list, places: tuple) -> tuple:
    """``args`` with, at each of ``places`` (``RecordedLaunch.launch_at``), a tensor of the
    place's dtype, shape and strides on the memory ``offset`` bytes past ``bases[base]``'s data
    pointer, inside that tensor's storage."""
    args = list(args)
    for position, base, offset, _, dtype, shape, strides in places:
        memory = bases[base]
        start = memory.storage_offset() * memory.element_size() + offset
        tensor = torch.empty(0, dtype=dtype, device=memory.device)
        if start % tensor.element_size():
            raise AssertionError(f"a {dtype} argument {start} bytes into its storage")
        args[position] = tensor.set_(memory.untyped_storage(), start // tensor.element_size(),
                                     shape, strides)
    return tuple(args)


@dataclasses.dataclass(frozen=True, eq=False)
class InterpretedLaunch:
    """A launch in Triton's interpreter, as recorded under ``RECORD_INTERPRETED``: made again
    through ``Kernel`` (``launch_at``), never launched again by a plan (``with_slots``)."""

    kernel: Kernel
    grid: tuple
    constexprs: dict
    num_warps: int
    settings: tuple
    args: tuple = ()
    holds: None = None

    def with_slots(self, tensors: tuple, kept: tuple) -> None:
        return None

    def launch_at(self, args: list, bases: list, places: tuple, checked: bool = False
                  ) -> None:
        """``RecordedLaunch.launch_at``, through ``Kernel`` always."""
        self.kernel(self.grid, tensors_at(args, bases, places), self.constexprs,
                    num_warps=self.num_warps)


def launches_as_recorded(made: tuple[_Launch, ...]) -> bool:
    """Whether launches now would find what ``made`` (launches recorded in one call) found,
    their arguments aside: no hook installed for any of their kernels, and the settings,
    device, stream and launch options of the first."""
    if not made:
        return True
    first = made[0]
    if type(first) is InterpretedLaunch:
        return launch_settings() == first.settings
    if (_global_hooks_installed() or any(launch.kernel.jitted.pre_run_hooks for launch in made)
            or launch_settings() != first.settings):
        return False
    active = driver.active
    device = active.get_current_device()
    return (device == first.device and active.get_current_stream(device) == first.stream
            and _launch_options() == first.options)


@dataclasses.dataclass(frozen=True, eq=False)
class Relaunch(_Launch):
    """A ``RecordedLaunch`` to be made again with other tensors in some argument slots
    (``RecordedLaunch.with_slots``). It holds no tensor of the recorded call but those its
    caller let it hold."""

    #: For each slot, the positions of its arguments, and whether its recorded pointer was
    #: 16-byte aligned (the compiled kernel assumes it where it was).
    slots: tuple[tuple[int, ...], ...] = ()
    aligned: tuple[bool, ...] = ()

    def __call__(self, pointers: tuple[int, ...]) -> bool:
        """Launch with ``pointers[k]`` (the data pointer of a tensor of the recorded one's
        dtype, shape and strides) in slot ``k``; False, having launched nothing, where the
        direct launch would not hand the driver this kernel and these arguments: a pointer
        aligned otherwise, another device, stream, launch option or setting, or a hook
        installed. Inside a ``recording`` block it is seen as a launch that is not direct
        (None)."""
        if not launches_as_recorded((self,)):
            return False
        handed = list(self.pointers)
        for positions, aligned, pointer in zip(self.slots, self.aligned, pointers):
            if (not pointer & 15) != aligned:
                return False
            for i in positions:
                handed[i] = pointer
        grid_x, grid_y, grid_z = self.grid
        self.run(grid_x, grid_y, grid_z, self.stream, self.function, self.packed_metadata,
                 None, None, None, *handed, *self.values)
        if _RECORDING.open:
            _record(None)
        return True
