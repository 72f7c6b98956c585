"""The switch: torch's own accumulating ops, run on detsum's primitives while it is on.

``detsum.enable(mode)``, ``detsum.disable()`` and ``with detsum.deterministic(mode):`` make
torch's ``index_add``, ``scatter_add``, ``scatter_reduce``, ``index_reduce``, ``index_put``
and ``put_`` with ``accumulate=True`` (the backward of ``x[idx]``), ``bincount`` with
weights, the dense backward of ``embedding`` and of ``embedding_bag``, ``segment_reduce`` and
``histc`` run on detsum's ``index_add`` and ``scatter_reduce`` in the chosen mode, for code
that calls torch directly and has never heard of detsum.

How. While the switch is on, one ``torch.library.Library("aten", "IMPL")`` holds a Python
kernel for each of those operators at the CPU dispatch key (and at the CUDA key where CUDA is
available; tests/test_enable_cuda.py on a GPU). The kernel sits below autograd, so it is what
autograd's own backward formulas reach too (``x[idx]`` -> ``_index_put_impl_``, ``gather`` ->
``scatter_add``, ``index_select`` -> ``index_add_``, ``embedding`` ->
``embedding_dense_backward``), from any thread. Each kernel keeps the kernel torch had
registered (``torch.library.get_kernel``, taken just before registering) and calls it for
every input detsum does not take: integer or complex dtypes, an ``out=`` that torch would
resize, memory that overlaps, an index form detsum has no primitive for, and so on; those
give torch's own result, or torch's own error. Importing detsum registers nothing.

Off. When the last ``deterministic`` block closes (and ``enable`` holds no mode), the kernels
stay registered and hand every call to torch's kernel, unchanged: torch's result, for a few
microseconds more a call (about 5 us on a small CPU ``index_add_``; the ops with C++ kernels,
below, call torch's kernel from C++). Only ``disable`` removes
them (destroying the library puts torch's kernels back in the dispatcher's table: then no
detsum code runs at all). Two reasons. Registering and removing cost 0.34 ms a toggle, which
blocks opened and closed around every layer of every step (``detsum.pyg.make_deterministic``)
paid each time. And removing a kernel while another thread dispatches that operator is
unsafe: torch's dispatcher reads its table without a lock, and a thread that has just read
the kernel being removed may call it after it is freed. Two threads toggling blocks did call
a freed kernel (its memory by then another switched operator's: a ``TypeError``, once in a
run of the test suite). So toggling never removes, and what ``disable`` removes is kept
alive until the next removal (``_removed``): a thread caught in the middle still calls a
live kernel, which hands the call to torch.

Under ``torch.compile``, detsum/_switch_compile.py keeps Inductor from compiling these ops
into code of its own while the switch is on (the first ``enable`` imports it, and Dynamo).

Why not a ``TorchDispatchMode``: a mode is per thread, so a second thread (a data loader, a
serving pool) would escape it, and it intercepts *every* operator in Python: a plain 100-
element ``a + a`` went from 1.2 us to 156 us under an empty mode, while here only the
switched operators pay for a Python kernel (a small ``index_add`` that goes on to torch's
kernel: 21 us against 4 us; one that runs on detsum: 21 us, 1.1x ``detsum.index_add_``
itself; all on a 2-core AMD EPYC). The dispatcher table is process-wide, like
``torch.use_deterministic_algorithms``, and costs nothing for every other operator.

State. The switch is process-wide (every thread sees the same kernels). ``enable`` and
``disable`` set the mode that holds outside every ``deterministic`` block; a block sets its
own mode while it is open, the most recently opened open block winning, and on exit removes
exactly its own layer, so blocks nested in one thread restore what was there before, and
blocks opened and closed by several threads in any interleaving leave the state that the
remaining ones define. One lock guards the state and the registration.

Native kernels. The dispatcher's way into a Python kernel costs more than a small call's
work: with nothing done there but a pass back to torch, it made a 200-node PyG training step
1.10-1.15x PyG's own (benches/NOTES.md). So the calls such a step makes most, small in-place
sums, maxima and minima on float32 and float64 CPU tensors (``index_add_``, ``scatter_add_``,
``scatter_reduce_`` summing from self or taking amax or amin, ``index_put_`` with
``accumulate=True``), have C++ kernels too (kernels/native/switch_kernels.cpp), installed at
the CPU key over the Python ones. Each computes what the Python kernel's short way computes
for its one form, the Numba small kernel's arithmetic in the same order: the same bits by
construction (tests/test_switch_native.py holds them to it on generated inputs). Any other
call it hands, untouched, to the Python kernel below it. They are compiled once per machine
and torch by the system's C++ compiler: at the first ``enable`` in a thread of its own,
while the Python kernels take every call (or beforehand, ``python -m
detsum.kernels.native``); without a compiler the Python kernels stay, and
``native_state()`` says why. ``DETSUM_NATIVE_SWITCH=0`` keeps them out.

Recursion. detsum's primitives call torch operators themselves (``index_select``, integer
``index_add_`` for counts, and the reference backend's loops). While a switched kernel runs
detsum, a thread-local flag sends every switched operator that thread calls back to torch's
kernel, so detsum never re-enters itself.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import math
import os
import sys
import threading
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from detsum import _kernel_ops, _segments, _validation
from detsum._validation import IndexOutOfRangeError
from detsum.backend import current_backend, forcing_other_than_numba, on_forcing_change
from detsum.modes import (CHUNK_TERMS, FLOAT_DTYPES, INDEX_DTYPES, MAX_TERMS_PER_STATE,
                          MODE_BY_NAME, Mode, parse_mode, rule_for)
from detsum.modes import acc_dtype
from detsum.ops import index_add as _index_add_op
from detsum.ops import scatter_reduce as _scatter_reduce_op
from detsum.ops import segment_sum as _segment_sum_op

_HALF_DTYPES = (torch.float16, torch.bfloat16)

_lock = threading.RLock()
_base_mode: str | None = None
#: The open blocks, innermost last: (layer, mode, the function that opened it).
_blocks: list[tuple[object, str, str]] = []
_mode: str | None = None
_library: torch.library.Library | None = None
#: The kernels of the library that ``disable`` last removed, kept alive (each a copy of the
#: dispatcher's entry, ``torch.library.get_kernel``, holding the kernel): see "Off" above.
_removed: list = []
_inside = threading.local()

#: Whether the switch's C++ kernels take the small calls they cover (see "Native kernels"
#: above); ``DETSUM_NATIVE_SWITCH=0`` in the environment keeps every call on the Python kernels.
NATIVE = os.environ.get("DETSUM_NATIVE_SWITCH", "1") != "0"
#: The C++ kernels' library while they are installed (over the Python kernels); the library
#: once loaded, installed or not (its counts); what became of them (``native_state``).
_native = None
_native_loaded = None
_native_state = "not tried: the switch has not been on"
_native_building = False


class _Counts(collections.Counter):
    """``counts``, with the calls the C++ kernels took added in whenever it is read."""


def _reading(name: str):
    """Counter's method ``name``, the C++ kernels' calls taken in first."""
    method = getattr(collections.Counter, name)

    def read(self, *args, **kwargs):
        _take_native_counts(self)
        return method(self, *args, **kwargs)

    read.__name__ = name
    return read


for _name in ("__getitem__", "__iter__", "__len__", "__contains__", "__repr__", "__eq__",
              "__ne__", "__le__", "__lt__", "__ge__", "__gt__", "__sub__", "__add__", "__or__",
              "__and__", "__pos__", "__neg__", "__reduce__", "get", "items", "keys", "values",
              "most_common", "elements", "total", "subtract", "update", "clear"):
    setattr(_Counts, _name, _reading(_name))
_Counts.copy = lambda self: collections.Counter(dict(self.items()))

_count_get, _count_set = dict.get, dict.__setitem__


def _count(key: tuple[str, str]) -> None:
    """One call more under ``key`` (the dict's own methods: no C++ counts taken in)."""
    _count_set(counts, key, _count_get(counts, key, 0) + 1)


def _take_native_counts(into: dict) -> None:
    """The calls the C++ kernels took since the last take, added into ``into``."""
    lib = _native_loaded
    if lib is None:
        return
    ops = lib.detsum_native_op_count()
    taken = (ctypes.c_int64 * (2 * ops))()
    lib.detsum_native_take_counts(taken)
    for i, n in enumerate(taken):
        if n:
            key = (lib.detsum_native_op_name(i % ops).decode(), "torch" if i >= ops else "detsum")
            _count_set(into, key, _count_get(into, key, 0) + n)


#: How many calls each switched operator sent to detsum and how many to torch's own kernel,
#: since the process started: ``counts[("index_add_", "detsum")]``. For seeing what the
#: switch covers in a program; updated without a lock, so exact only for one thread.
counts: collections.Counter = _Counts()


# ---- the public switch ------------------------------------------------------------------------

def enable(mode: str | Mode = "fp32") -> None:
    """Run torch's accumulating ops on detsum's primitives in ``mode``, in every thread,
    until :func:`disable` (outside any open :func:`deterministic` block, which keeps its own
    mode while it is open).

    Covered so far, eager mode, ``torch.compile`` and TorchScript, CPU tensors of dtype
    float32, float64, float16 and bfloat16:
    ``index_add`` / ``index_add_`` / ``index_add(out=)``, ``scatter_add`` / ``scatter_add_`` /
    ``out=``, ``scatter_reduce`` / ``scatter_reduce_`` / ``out=`` (sum, mean, prod, amax,
    amin, ``include_self`` both ways), ``index_reduce`` / ``index_reduce_`` / ``out=``,
    ``index_put`` / ``index_put_`` with ``accumulate=True`` (one index tensor; the backward of
    ``x[idx]``), ``put_`` with ``accumulate=True``, ``bincount`` with weights, the dense
    backward of ``embedding`` and of ``embedding_bag`` (sum, mean, max), ``segment_reduce``
    (sum, mean, amax / max, amin / min, prod; lengths or offsets) and ``histc`` / ``out=``;
    so also the backward of ``gather`` and ``index_select``. Every other input of these ops,
    and every other op, runs torch's own kernel (docs/enable.md lists which).

    Args:
        mode: ``"fp32"`` (default), ``"kahan"``, ``"exact"`` or ``"autograd"`` (torch's own
            bits, as under ``torch.use_deterministic_algorithms(True)``), as for the
            primitives (docs/determinism.md).

    Example:
        >>> import torch, detsum
        >>> detsum.enable("exact")
        >>> torch.zeros(1).index_add(0, torch.tensor([0, 0, 0]), torch.tensor([1e8, 1.0, -1e8]))
        tensor([1.])
        >>> detsum.disable()
    """
    _refuse_tracing("detsum.enable")
    mode = parse_mode(mode, caller="detsum.enable")
    global _base_mode
    with _lock:
        _base_mode = mode.value
        _apply_untraced()


def disable() -> None:
    """Give torch's accumulating ops back their own kernels (outside any open
    :func:`deterministic` block): the switch goes off, and its kernels are removed from
    torch's dispatcher, which a block's end does not do (it leaves them handing every call to
    torch). Does nothing more when the switch is off and removed already."""
    _refuse_tracing("detsum.disable")
    global _base_mode
    with _lock:
        _base_mode = None
        _apply_untraced(remove=True)


class deterministic(contextlib.ContextDecorator):  # noqa: N801 (a function's name to users)
    """Inside the block, torch's accumulating ops run on detsum's primitives in ``mode``
    (as :func:`enable` says), in every thread; on exit, what held before comes back.

    Blocks nest: the innermost open one wins. The switch is process-wide, so a block opened
    in one thread also switches the ops other threads run while it is open. One object may
    open blocks again and again, nested, and in several threads at once (like
    ``torch.no_grad()``), and decorates a function as a block around each call.

    Example:
        >>> import torch, detsum
        >>> x = torch.ones(3, requires_grad=True)
        >>> with detsum.deterministic("kahan"):
        ...     x[torch.tensor([0, 0, 2])].sum().backward()
        >>> x.grad
        tensor([2., 0., 1.])
    """

    def __init__(self, mode: str | Mode = "fp32"):
        _refuse_tracing("detsum.deterministic")  # and at each block's start
        self.mode = parse_mode(mode, caller="detsum.deterministic")
        # The blocks this object has open, innermost last, per thread.
        self._open = threading.local()

    def __enter__(self) -> None:
        _refuse_tracing("detsum.deterministic")
        layer = _open_block(self.mode.value, "detsum.deterministic")
        self._open.__dict__.setdefault("layers", []).append(layer)

    def __exit__(self, *exception) -> None:
        layers = getattr(self._open, "layers", None)
        if not layers:
            raise RuntimeError(f"{self!r}: __exit__ without a block of this object open in "
                               f"this thread; expected it after __enter__ (a with statement "
                               f"pairs them)")
        _close_block(layers.pop())

    def __repr__(self) -> str:
        return f"detsum.deterministic({self.mode.value!r})"


def _open_block(mode: str, opener: str) -> object:
    """Open a :func:`deterministic` block in ``mode`` (a mode's name, parsed by the caller)
    until ``_close_block`` of the layer returned. ``opener`` is the public function that
    opened it (``detsum.deterministic``, or ``detsum.pyg``'s hooks, which open and close two
    blocks a training step): the switched calls' errors name it (``_switched_by``). The state
    is applied only where the mode in force changes (``_change_mode``): applying it costs a
    small PyG step more than its few microseconds of Python (benches/NOTES.md, the
    twenty-first session)."""
    layer = object()
    with _lock:
        _blocks.append((layer, mode, opener))
        if mode != _mode or _library is None:
            _change_mode(mode)
    return layer


def _close_block(layer: object) -> None:
    """Close the block ``_open_block`` returned ``layer`` for, the innermost or not."""
    with _lock:
        if _blocks and _blocks[-1][0] is layer:
            _blocks.pop()
        else:
            _blocks[:] = [block for block in _blocks if block[0] is not layer]
        wanted = _wanted_mode()
        if wanted != _mode:
            _change_mode(wanted)


def _change_mode(wanted: str | None) -> None:
    """(Lock held, the blocks changed.) Put ``wanted``, the mode the state now defines, in
    force. With the kernels registered, and no compiled code running, that is all ``_apply``
    does then, the short way: the mode, and those who follow it told (``_tell_followers``);
    a marked PyG step, which changes the mode four times, runs 0.05 faster so
    (benches/NOTES.md). Else ``_apply_untraced``."""
    global _mode
    if _library is None or _frame_hook_set():
        _apply_untraced()
        return
    _mode = wanted
    _tell_followers(wanted)


def _switched_by() -> str:
    """The public function whose switch runs the calls now, for their errors: the innermost
    block's opener, else ``detsum.enable``. Without the lock: a slice of a list is one step
    under the GIL, and these names are read on the switched calls' own paths."""
    innermost = _blocks[-1:]
    return innermost[0][2] if innermost else "detsum.enable"


def _wanted_mode() -> str | None:
    """(Lock held.) The mode the state defines: the innermost block's, else ``enable``'s."""
    return _blocks[-1][1] if _blocks else _base_mode


def _refuse_tracing(caller: str) -> None:
    """Raise, in ``caller``'s words, inside a function that ``torch.compile`` traces: the
    switch is the process's state, set when it runs, which a graph cannot hold. (Dynamo
    reports the error with ``fullgraph=True``; otherwise it breaks the graph there and the
    call runs as plain Python, which works.) Without this, Dynamo's own error named the
    switch's lock."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{caller}: called inside a function that torch.compile traces; expected it "
            f"outside: switch on before calling the compiled function (compiled code then "
            f"runs the switched ops on detsum), or compile without fullgraph=True")


def current_mode() -> str | None:
    """The mode the switched ops run in now (``"fp32"``, ...), or None when the switch is off."""
    return _mode


def _apply_untraced(remove: bool = False) -> None:
    """``_apply``, out of Dynamo's sight where its frame hook is set: a switch call in a
    function compiled without ``fullgraph`` runs as plain Python after its graph break
    (``_refuse_tracing``), with the hook still set, and Dynamo would compile the frames it
    calls (the C++ kernels' loading among them, which it cannot trace)."""
    if _frame_hook_set():
        _apply_without_dynamo()(remove)
        return
    _apply(remove)


def _frame_hook_set() -> bool:
    """Whether Dynamo's frame hook is set (compiled code is running, or being traced)."""
    if "torch._dynamo" not in sys.modules:
        return False
    lookup = _frame_hook_lookup()
    return lookup is not None and lookup[0]() is not None


@functools.cache
def _apply_without_dynamo():
    return torch.compiler.disable(_apply)


def _apply(remove: bool = False) -> None:
    """Set the mode the state defines, registering the kernels if it is on; ``remove`` (from
    ``disable``): remove them too if it is off (lock held)."""
    global _mode, _library, _removed
    wanted = _wanted_mode()
    if wanted is not None and _library is None:
        _library = _register()
        _install_native()
    _mode = wanted
    if wanted is None and remove and _library is not None:
        _uninstall_native()
        removed = [torch.library.get_kernel(f"aten::{name}", key)
                   for name in _BODIES for key in _dispatch_keys()]
        _library._destroy()
        _library = None
        _removed = removed  # the ones removed before are freed now
    _tell_followers(wanted)


def _tell_followers(wanted: str | None) -> None:
    """(Lock held, ``wanted`` just put in force.) Tell the C++ kernels, and compiled code
    (``_switch_compile``, imported at the first on: it imports Dynamo and Inductor)."""
    _configure_native()
    switch_compile = sys.modules.get("detsum._switch_compile")
    if switch_compile is None and wanted is not None:
        from detsum import _switch_compile as switch_compile
    if switch_compile is not None:
        switch_compile.follow(wanted is not None)


def _dispatch_keys() -> tuple[str, ...]:
    """The dispatch keys the switch registers its kernels at."""
    return ("CPU", "CUDA") if torch.cuda.is_available() else ("CPU",)


def _register() -> torch.library.Library:
    if NATIVE:
        # torch's kernels, for the C++ kernels to call directly while the switch is off.
        lib = _kernel_ops.switch_native_library()
        if lib is not None:
            lib.detsum_native_capture_torch()
    keys = _dispatch_keys()
    library = torch.library.Library("aten", "IMPL")
    # torch warns, once per process, that a kernel is overridden: that is the point here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name, body in _BODIES.items():
            for key in keys:
                # Taken here, while no detsum kernel is registered: torch's own.
                original = torch.library.get_kernel(f"aten::{name}", key)
                library.impl(name, _switched(name, body, original, key), key)
    return library


def native_state() -> str:
    """What became of the switch's C++ kernels in this process: ``"installed"`` (they take
    the small calls they cover), ``"building"`` (compiling in a thread; the Python kernels
    take every call meanwhile), ``"off"`` (``DETSUM_NATIVE_SWITCH=0``), ``"not tried"`` (the
    switch has not been on), or why they are not there (``"not built: ..."``, no compiler,
    say). Either way every call gives the same bits (docs/enable.md, "Native kernels")."""
    if not NATIVE:
        return "off: DETSUM_NATIVE_SWITCH=0"
    return _native_state


def _install_native() -> None:
    """(Lock held, the Python kernels just registered.) Install the C++ kernels over them
    where they are built; else build them in a thread, which installs them when done if the
    Python kernels are still registered then."""
    global _native, _native_loaded, _native_state, _native_building
    if not NATIVE or _native is not None:
        return
    lib = _kernel_ops.switch_native_library()
    if lib is None:
        if not _native_building:
            _native_building = True
            _native_state = "building"
            threading.Thread(target=_build_native, name="detsum-native-build",
                             daemon=True).start()
        return
    _native_loaded = lib
    if lib.detsum_native_install() != 0:
        _native_state = f"not installed: {lib.detsum_native_error().decode()}"
        return
    _native = lib
    _native_state = "installed"


def _uninstall_native() -> None:
    """(Lock held.) Remove the C++ kernels, where installed: the Python kernels below them
    take every call again."""
    global _native
    if _native is not None:
        _native.detsum_native_uninstall()
        _native = None


def _use_native(on: bool) -> None:
    """Set ``NATIVE`` and act on it now: install the C++ kernels (where built) or remove
    them, leaving the Python kernels registered (tests and benchmarks, which compare them)."""
    global NATIVE
    with _lock:
        NATIVE = on
        if on and _library is not None:
            _install_native()
        elif not on:
            _uninstall_native()
        _configure_native()


def _build_native() -> None:
    """The build thread: compile the C++ kernels, then install them if the switch's Python
    kernels are registered."""
    global _native_state, _native_building
    reason = _kernel_ops.build_switch_native()
    with _lock:
        _native_building = False
        if reason is not None:
            _native_state = f"not built: {reason}"
            return
        _native_state = "built"
        if _library is not None:
            _install_native()
            _configure_native()


def _configure_native() -> None:
    """(Lock held.) Tell the C++ kernels the switch's state: whether they take calls (the
    switch on, and Numba the CPU backend everywhere: no ``detsum.backend`` block forcing
    another), the sums' rule, "autograd" mode, and the small calls' limits."""
    lib = _native
    if lib is None:
        return
    mode = _mode
    active = (mode is not None and forcing_other_than_numba() == 0
              and _segments.numba_runs_cpu_tensors())
    if not active:
        lib.detsum_native_configure(int(mode is not None), 0, 0, 0, 0, 0)
        return
    sum_rule = _kernel_ops.switch_native_sum_rule(_cpu_rule(mode, "sum"))
    # The small kernels' limit from detsum.kernels, not from their Numba module, whose import
    # would cost the first enable() 0.2-0.4 s.
    lib.detsum_native_configure(1, 1, sum_rule, int(mode == "autograd"),
                                _kernel_ops.SMALL_CALL_ELEMENTS, CHUNK_TERMS)


def _reconfigure_native() -> None:
    with _lock:
        _configure_native()


on_forcing_change(_reconfigure_native)


@functools.cache
def _frame_hook_lookup():
    """Called at the first registration (it imports Dynamo, as torch.compiler.disable does):
    a function returning Dynamo's frame hook (None while no compiled code runs), with the
    kernel's code marked for Dynamo to run without looking into (``_switched``); None where
    this torch has neither (then every call goes through ``torch.compiler.disable``)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return None
    return get_eval_frame_callback, skip_code


def _switched(name, body, original, key):
    """The kernel registered for operator ``name``: ``body(mode, *args, **kwargs)`` returns a
    function that computes the result on detsum, or None to leave the call to torch; that
    function may still leave it to torch, by raising ``_LeaveToTorch`` before it writes
    anything; an operator with a short way (``_SHORT_WAYS``) tries that first. A call left
    to torch whose terms torch may add in an order of its own (``_torch_orders_terms``) runs
    under torch's deterministic mode (``_torch_deterministic``): torch's default on CUDA is
    atomics, and "autograd" mode gives the deterministic mode's bits. Not, but in "autograd"
    mode, a plain assignment (``x[idx] = v``: nothing added, and torch's deterministic path
    sorts the index), nor detsum's own calls of switched ops inside a run."""
    short_way = _SHORT_WAYS.get(name)
    # torch's kernel at a backend key (CPU, CUDA) reads no key set: each is handed a fixed
    # one of its own key, and the dispatcher makes none for this kernel (a Python object a
    # call).
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def call(*args, **kwargs):
        mode = _mode
        if mode is not None and not getattr(_inside, "running", False):
            if short_way is not None:
                result = short_way(mode, *args, **kwargs)
                if result is not None:
                    _count((name, "detsum"))
                    return result
            run = body(mode, *args, **kwargs)
            if run is not None:
                _inside.running = True
                native = _native_loaded
                if native is not None:
                    native.detsum_native_set_inside(1)
                try:
                    result = run()
                except _LeaveToTorch:
                    pass
                except IndexOutOfRangeError as error:
                    # detsum names its own function; the caller called torch's.
                    raise error.named_for(f"{_called_as(name)} (run by {_switched_by()})") \
                        from None
                else:
                    _count((name, "detsum"))
                    return result
                finally:
                    _inside.running = False
                    if native is not None:
                        native.detsum_native_set_inside(0)
            if _torch_orders_terms(args, kwargs) and (
                    mode == "autograd" or _accumulates(name, args, kwargs)):
                _count((name, "torch"))
                with _torch_deterministic():
                    return original.call_boxed(keyset, *args, **kwargs)
        _count((name, "torch"))
        return original.call_boxed(keyset, *args, **kwargs)

    # Where a compiled function breaks its graph at a switched op (bincount's shape depends
    # on its data), the op runs with Dynamo's frame hook still set: like
    # torch.library.register_kernel's kernels, these then run as plain Python, through
    # torch.compiler.disable. Its wrapper costs a small PyG step (200 nodes, four switched
    # calls) about 4% in eager code, where no hook is set: there the kernel runs directly.
    in_compiled_code = torch.compiler.disable(call)
    hook = _frame_hook_lookup()
    if hook is None:
        kernel = in_compiled_code
    else:
        frame_hook = hook[0]

        def kernel(*args, **kwargs):
            if frame_hook() is None:
                return call(*args, **kwargs)
            return in_compiled_code(*args, **kwargs)

        # Dynamo, its hook set, runs this frame without tracing it; the frames this one
        # calls it would trace, hence the wrapper for that case.
        hook[1](kernel.__code__)
    kernel.__name__ = f"detsum_switched_{name.replace('.', '_')}"
    return kernel


#: The switched operators that assign unless asked to accumulate (their fourth argument).
_ASSIGNING = ("_index_put_impl_", "put_")


def _accumulates(name, args, kwargs) -> bool:
    """Whether a call of the switched operator ``name`` adds into its target."""
    if name not in _ASSIGNING:
        return True
    return bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))


def _torch_orders_terms(args, kwargs) -> bool:
    """Whether torch's kernel may add a call's terms in an order of its own, one order giving
    other bits than another: a tensor of the call (in lists too) is floating-point or
    complex, and one holds more than one element. Integers add exactly in any order, and one
    term has no order (torch's deterministic CUDA path refuses some 0-dim tensors, too)."""
    tensors = [t for a in (*args, *kwargs.values())
               for t in (a if isinstance(a, (list, tuple)) else (a,))
               if isinstance(t, torch.Tensor)]
    return (any(t.is_floating_point() or t.is_complex() for t in tensors)
            and any(t.numel() > 1 for t in tensors))


_deterministic_lock = threading.Lock()
_deterministic_blocks = 0
_setting_before: tuple[bool, bool] = (False, False)


@contextlib.contextmanager
def _torch_deterministic() -> Iterator[None]:
    """torch's deterministic mode for a block, then the caller's setting back. Where torch has
    no deterministic kernel it warns and runs its default one (``warn_only``), unless the
    caller had set the mode without ``warn_only``: then it refuses, as it would without the
    switch. The setting is process-wide, as torch keeps it: another thread's torch ops in the
    block run under it too. Blocks open in several threads at once share it: the first one
    opened sets it, the last one closed puts back what was there before the first."""
    global _deterministic_blocks, _setting_before
    with _deterministic_lock:
        if _deterministic_blocks == 0:
            enabled = torch.are_deterministic_algorithms_enabled()
            warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
            _setting_before = (enabled, warn_only)
            torch.use_deterministic_algorithms(True, warn_only=warn_only or not enabled)
        _deterministic_blocks += 1
    try:
        yield
    finally:
        with _deterministic_lock:
            _deterministic_blocks -= 1
            if _deterministic_blocks == 0:
                enabled, warn_only = _setting_before
                torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


class _LeaveToTorch(Exception):
    """Raised by a switched call's run, before it writes anything, where detsum's own checks
    show that torch's kernel gives the meaning (a test that would cost every call a read of
    the index, made only when detsum's check fails)."""


#: The check level the switch asks of the primitives. They check CPU tensors on the host
#: whatever they are asked (``_segments.check_that_runs``); a GPU's on the device, as torch's
#: own CUDA kernels do: a value out of range stops the stream at the next synchronisation, and
#: a switched call never waits for the GPU (nor breaks a CUDA graph's capture).
_CHECK = "device"


def _checked_on_device(t: torch.Tensor) -> bool:
    """Whether a primitive checks ``t``'s index values on the device (no error before its
    call returns), as ``_CHECK`` asks; else on the host, before anything is written."""
    if t.is_cpu and not _segments.GPU_CHECKS_ON_CPU:
        return False
    backend_name = current_backend(t.device.type, _switched_by())
    return _segments.check_that_runs(_CHECK, t.device.type, backend_name) == "device"


# ---- what detsum takes ------------------------------------------------------------------------
# Each test below accepts only inputs that torch accepts too and that detsum's primitive
# computes with torch's meaning; anything else goes to torch, which gives its own result or
# its own error.

def _plain(*tensors: torch.Tensor) -> bool:
    """Strided tensors on one CPU or CUDA device, without a lazy negation bit."""
    # t.is_cpu reads a flag where t.device builds an object: the test in half the time.
    if tensors[0].is_cpu:
        on_device = _on_cpu
    elif tensors[0].is_cuda:
        index = tensors[0].get_device()
        on_device = lambda t: t.is_cuda and t.get_device() == index  # noqa: E731
    else:
        return False
    for t in tensors:
        if not on_device(t) or t.layout != torch.strided or t.is_neg():
            return False
    return True


def _on_cpu(t: torch.Tensor) -> bool:
    return t.is_cpu


def _values(self: torch.Tensor, other: torch.Tensor) -> bool:
    """Two non-empty tensors of one float dtype that detsum sums."""
    return (self.dtype in FLOAT_DTYPES and other.dtype == self.dtype and self.dim() >= 1
            and self.numel() > 0 and other.numel() > 0)


def _dim(dim: int, ndim: int) -> int | None:
    return dim % ndim if -ndim <= dim < ndim else None


def _writable(target: torch.Tensor, *read: torch.Tensor) -> bool:
    """``target`` may be written in place while ``read`` are read: distinct elements, no
    memory shared (torch refuses both, and its error is the one to give)."""
    if _validation.has_internal_overlap(target):
        return False
    for t in read:  # a loop: a generator's setup is a third of a small call's checks
        if _validation.shares_memory(target, t):
            return False
    return True


def _small_in_place(mode: str, target: torch.Tensor, dim: int, index: torch.Tensor,
                    source: torch.Tensor, reduce: str, include_self: bool = True,
                    alpha: float = 1.0) -> bool:
    """Whether an in-place reduction into ``target`` from a 1-D row ``index`` ran, in ``mode``,
    as the one Numba call the primitive's path would give it (``_segments.small_reduce_in_place``:
    the same bits, the layers between skipped). False, nothing written, for a call that path
    does not take."""
    return target.is_cpu and _segments.small_reduce_in_place(
        target, dim, index, source, reduce, include_self, alpha, _cpu_rule(mode, reduce))


@functools.cache
def _cpu_rule(mode: str, reduce: str) -> int:
    """The kernel rule of ``mode`` for ``reduce`` on the CPU (``rule_for``), looked up once."""
    return rule_for(MODE_BY_NAME[mode], reduce, "cpu", 1)


# The short way ---------------------------------------------------------------------------------
# The calls a small model's step makes most (PyG's aggregations, its degree sums and softmax
# maxima, index_select's backward) are in-place sums, maxima and minima of a few hundred rows
# on the CPU (and a scatter's mean, for code that asks torch for one). Through the bodies
# below, each paid about 9 us of checks and layers in Python before its Numba call of 2-3 us
# in a loop, and several times that inside a step (benches/NOTES.md). A short way makes, for
# the one form it takes, every check the body and the primitive's path would make before that
# call, in one function tried before the body: CPU tensors, strided, no lazy negation, one
# float dtype, an int32 or int64 index of the row form (1-D; for a scatter, a stride-0
# broadcast of one) and shapes torch accepts with detsum's meaning, a mode with a rule the
# call has, a target that may be changed. Then ``_segments.small_reduce_in_place`` (the
# backend, the size, contiguity, memory shared, the index's values), and the call's result:
# the target (or, for the dense backward of ``embedding`` and the out-of-place forms, the new
# tensor that the one call wrote). None, nothing written, for anything else: the body then
# runs as before, and gives torch's meaning, torch's error or detsum's.

_STRIDED = torch.strided


def _short_plain(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> bool:
    """``_plain`` and ``_values`` for three CPU tensors, with an index of ``INDEX_DTYPES``."""
    dtype = target.dtype
    return (target.is_cpu and index.is_cpu and source.is_cpu and source.dtype is dtype
            and dtype in FLOAT_DTYPES and index.dtype in INDEX_DTYPES
            and target.layout is _STRIDED and index.layout is _STRIDED
            and source.layout is _STRIDED and not (
                target.is_neg() or index.is_neg() or source.is_neg()))


def _changeable(target: torch.Tensor) -> bool:
    """What ``_check_changeable`` refuses, as a test."""
    return not target.is_inference() or torch.is_inference_mode_enabled()


def _index_add_short(mode, self, dim, index, source, *, alpha=1) -> torch.Tensor | None:
    """``self.index_add_(dim, index, source, alpha=alpha)`` the short way: the checks of
    ``_index_add_inplace``, then ``_small_in_place``."""
    if not _short_plain(self, index, source) or index.dim() != 1 or (
            type(alpha) is not int and type(alpha) is not float):
        return None
    if mode == "autograd" and (alpha not in (1, -1) or self.dtype in _HALF_DTYPES):
        return None
    shape, source_shape = self.shape, source.shape
    ndim = len(shape)
    if len(source_shape) != ndim or not -ndim <= dim < ndim:
        return None
    dim %= ndim
    if source_shape[dim] != index.shape[0] or self.numel() == 0 or source.numel() == 0 or (
            source_shape[:dim] != shape[:dim] or source_shape[dim + 1:] != shape[dim + 1:]):
        return None
    return self if _changeable(self) and _small_in_place(mode, self, dim, index, source, "sum",
                                                         alpha=float(alpha)) else None


def _index_add_out_short(mode, self, dim, index, source, *, alpha=1, out
                         ) -> torch.Tensor | None:
    """``torch.index_add(self, ..., out=self)``: ``self.index_add_`` (``_into_out``'s in-place
    call, for the same tensor object)."""
    return (_index_add_short(mode, self, dim, index, source, alpha=alpha) if out is self
            else None)


def _scatter_short(mode, self, dim, index, src, reduce="sum", include_self=True
                   ) -> torch.Tensor | None:
    """``self.scatter_reduce_(dim, index, src, reduce, include_self=include_self)`` (and
    ``scatter_add_``, a sum from self) the short way, for a sum from self, a mean, amax or
    amin: the checks of ``_scatter_inplace`` for an index of ``src``'s shape, then
    ``_small_in_place`` on its row index."""
    if not _short_plain(self, index, src):
        return None
    if reduce == "sum" and not include_self:
        return None
    if reduce == "sum" or reduce == "mean":
        if mode == "autograd" and self.dtype in _HALF_DTYPES:
            return None
    elif reduce != "amax" and reduce != "amin":
        return None
    shape, index_shape = self.shape, index.shape
    ndim = len(shape)
    if ndim == 0 or index_shape != src.shape or len(index_shape) != ndim or not (
            -ndim <= dim < ndim):
        return None
    dim %= ndim
    if index.numel() == 0 or self.numel() == 0 or (index_shape != shape and (
            index_shape[:dim] != shape[:dim] or index_shape[dim + 1:] != shape[dim + 1:])):
        return None
    rows = _scatter_reduce_op.stride_zero_rows(index, dim)
    if rows is None or not _changeable(self):
        return None
    # A call past the one small call's size goes to the body, which looks for zero ties
    # itself: looked for here too, they would cost such a call a second pass over src.
    if reduce in ("amax", "amin") and (
            self.numel() + src.numel() > _small_elements()
            or _torch_breaks_zero_ties(mode, self, src, reduce, include_self)):
        return None
    return self if _small_in_place(mode, self, dim, rows, src, reduce, include_self) else None


def _scatter_add_short(mode, self, dim, index, src) -> torch.Tensor | None:
    return _scatter_short(mode, self, dim, index, src)


def _index_put_short(mode, self, indices, values, accumulate=False, unsafe=False
                     ) -> torch.Tensor | None:
    """``self.index_put_((index,), values, accumulate=True)`` the short way, for the backward
    of ``x[index]`` (one 1-D index along the first dim, values of the indexed shape): the
    checks of ``_index_put``, then ``_small_in_place`` (a negative value, which Python's
    meaning counts from the end, makes it write nothing: the body then takes the call). Not
    in "exact" mode, whose sums have no small call: the body's path, tried once."""
    if not accumulate or len(indices) != 1 or mode == "exact":
        return None
    index = indices[0]
    if index is None or not _short_plain(self, index, values) or index.dim() != 1:
        return None
    shape, values_shape = self.shape, values.shape
    if (len(shape) == 0 or len(values_shape) != len(shape) or values_shape[0] != index.shape[0]
            or values_shape[1:] != shape[1:] or self.numel() == 0 or values.numel() == 0):
        return None
    return self if _changeable(self) and _small_in_place(mode, self, 0, index, values,
                                                         "sum") else None


def _out_of_place_short(in_place_short, sums_only: bool):
    """The short way of an out-of-place form (``index_add``, ``scatter_add``,
    ``scatter_reduce``) from its in-place form's: that one into a contiguous copy of
    ``self``, as torch computes it (the primitive's result is contiguous too). Tried on a
    small call of CPU tensors alone, so that a copy the in-place form then refuses is
    small; not for a sum or a mean in "exact" mode (``sums_only``: the form has no other
    reduction), which the in-place form never takes."""
    def short_way(mode, self, dim, index, source, *args, **kwargs):
        if mode == "exact" and (sums_only or (args[0] if args else kwargs.get("reduce"))
                                in ("sum", "mean")):
            return None
        if not (_short_plain(self, index, source) and _segments.numba_runs_cpu_tensors()
                and self.numel() + source.numel() <= _small_elements()):
            return None
        return in_place_short(mode, self.clone(memory_format=torch.contiguous_format), dim,
                              index, source, *args, **kwargs)
    return short_way


@functools.cache
def _small_elements() -> int:
    """The most elements (source and target) of a call that the one small call takes."""
    return _segments._small_kernels().MAX_ELEMENTS


def _embedding_backward_short(mode, grad_output, indices, num_weights, padding_idx,
                              scale_grad_by_freq) -> torch.Tensor | None:
    """``embedding_dense_backward`` the short way, without ``padding_idx``: the checks of
    ``_embedding_backward``, then ``_small_in_place`` into new zeros (an index value outside
    the table makes it write nothing: the body then gives torch's answer). Not in "exact"
    mode, whose sums have no small call."""
    if (mode == "exact" or padding_idx >= 0 or scale_grad_by_freq or num_weights <= 0
            or not _short_plain(grad_output, indices, grad_output) or grad_output.dim() == 0
            or not _segments.numba_runs_cpu_tensors()):
        return None
    width = grad_output.shape[-1]
    if width == 0 or indices.numel() == 0 or grad_output.numel() != indices.numel() * width:
        return None
    sums = grad_output.new_zeros(num_weights, width)
    rows = indices if indices.dim() == 1 else indices.reshape(-1)
    grad = grad_output if grad_output.dim() == 2 else grad_output.reshape(-1, width)
    return sums if _small_in_place(mode, sums, 0, rows, grad, "sum") else None


def _embedding_bag_backward_short(mode, grad, indices, offset2bag, bag_size, maximum_indices,
                                  num_weights, scale_grad_by_freq, bag_mode,
                                  per_sample_weights=None, padding_idx=-1
                                  ) -> torch.Tensor | None:
    """The dense backward of ``embedding_bag`` the short way, for its sum (with
    ``per_sample_weights`` too) and mean without ``padding_idx``, on CPU, but in "exact" and
    "autograd" modes: the checks of ``_embedding_bag_backward``, torch's terms (each bag's
    gradient times its scale, rounded to the dtype: per bag here, per term there, the same
    products), then ``_small_in_place`` into new zeros. An index or a bag out of range makes
    it write nothing: the body then names it."""
    weights = per_sample_weights
    if (mode == "exact" or mode == "autograd" or bag_mode not in (_BAG_SUM, _BAG_MEAN)
            or scale_grad_by_freq or padding_idx >= 0 or num_weights <= 0 or grad.dim() != 2
            or not _short_plain(grad, indices, grad) or not _short_plain(grad, offset2bag, grad)
            or indices.dim() != 1 or offset2bag.shape != indices.shape
            or bag_size.shape != grad.shape[:1] or not bag_size.is_cpu
            or bag_size.layout is not _STRIDED or grad.numel() == 0 or indices.numel() == 0
            or (indices.numel() + num_weights) * grad.shape[1] > _small_elements()
            or not _segments.numba_runs_cpu_tensors()):
        return None
    if weights is not None and (bag_mode != _BAG_SUM or not _short_plain(grad, indices, weights)
                                or weights.shape != indices.shape):
        return None
    bag_grad = grad
    if bag_mode == _BAG_MEAN:
        scale = torch.where(bag_size != 0, 1.0 / bag_size.double(), 1.0).to(grad.dtype)
        bag_grad = grad * scale.view(-1, 1)
    try:
        terms = bag_grad.index_select(0, offset2bag)
    except (IndexError, RuntimeError):
        return None  # a bag outside grad: the body's check names it
    if weights is not None:
        terms = terms * weights.view(-1, 1)
    sums = grad.new_zeros(num_weights, grad.shape[1])
    return sums if _small_in_place(mode, sums, 0, indices, terms, "sum") else None


def _bincount_short(mode, self, weights=None, minlength=0) -> torch.Tensor | None:
    """``bincount`` with weights the short way, on CPU, but in "exact" mode: the checks of
    ``_bincount``, the bins as it makes them (one read, the largest value), then
    ``_small_in_place`` into them (a negative value makes it write nothing: the body then
    leaves the call to torch, which refuses it)."""
    if (mode == "exact" or weights is None or not _short_plain(weights, self, weights)
            or self.dim() != 1 or weights.dim() != 1 or weights.shape[0] != self.shape[0]
            or self.numel() == 0 or type(minlength) is not int or minlength < 0
            # Where the one call cannot run, no read for it: at least one bin, whatever the
            # values.
            or not _segments.numba_runs_cpu_tensors() or _checked_on_device(self)
            or self.numel() + max(minlength, 1) > _small_elements()):
        return None
    bins = max(int(self.max()) + 1, minlength)
    if bins + self.numel() > _small_elements():
        return None
    dtype = torch.float32 if weights.dtype == torch.float32 else torch.float64
    sums = torch.zeros(bins, dtype=dtype)
    terms = weights if weights.dtype == dtype else weights.to(dtype)
    return sums if _small_in_place(mode, sums, 0, self, terms, "sum") else None


def _check_changeable(name: str, target: torch.Tensor) -> None:
    _validation.check_changeable(f"{_called_as(name)} (run by {_switched_by()})", "self",
                                 target)


def _called_as(name: str) -> str:
    """What a caller called, for the switched operator ``name`` (an error names it): the
    operator without its overload (``scatter_reduce_.two``: ``scatter_reduce_``; an ``out=``
    overload: the function), ``index_put_`` for the one it runs (``_index_put_impl_``).
    The backward operators keep their names: their errors name their own arguments."""
    return "index_put_" if name == "_index_put_impl_" else name.partition(".")[0]


def _into_out(out: torch.Tensor, self: torch.Tensor, *read: torch.Tensor) -> bool | None:
    """For an ``out=`` call: True when ``out`` is ``self`` itself (an in-place call), False
    when it is separate memory of ``self``'s shape, dtype and device, None otherwise (torch
    resizes, or refuses)."""
    if (out.shape != self.shape or out.dtype != self.dtype or out.device != self.device
            or out.layout != torch.strided or _validation.has_internal_overlap(out)
            or any(_validation.shares_memory(out, t) for t in read)):
        return None
    if not _validation.shares_memory(out, self):
        return False
    same = (out.data_ptr() == self.data_ptr() and out.stride() == self.stride())
    return True if same else None


# index_add --------------------------------------------------------------------------------------

def _rows_dim(self, dim, index, source) -> int | None:
    """The dim for a 1-D index of ``source``'s rows into ``self``'s (index_add's and
    index_reduce's form), or None."""
    if not (_values(self, source) and index.dtype in INDEX_DTYPES and index.dim() == 1
            and source.dim() == self.dim() and _plain(self, index, source)):
        return None
    dim = _dim(dim, self.dim())
    if dim is None or index.shape[0] != source.shape[dim] or any(
            source.shape[d] != self.shape[d] for d in range(self.dim()) if d != dim):
        return None
    return dim


def _index_add_dim(mode, self, dim, index, source, alpha) -> int | None:
    dim = _rows_dim(self, dim, index, source)
    if dim is None or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        return None
    # torch's CPU kernel may fuse alpha into its add (one rounding), which index_put_ (the
    # "autograd" rule) does not: the same bits only where source * alpha is exact, alpha = +-1.
    # For float16/bfloat16 it picks by layout between rounding after every add and an fp32
    # buffer. torch's kernel is the one source of those bits.
    if mode == "autograd" and (alpha not in (1, -1) or self.dtype in _HALF_DTYPES):
        return None
    return dim


def _index_add(mode, self, dim, index, source, *, alpha=1):
    dim = _index_add_dim(mode, self, dim, index, source, alpha)
    if dim is None:
        return None
    return lambda: _index_add_op._index_add(self, dim, index, source, float(alpha), mode,
                                            _CHECK)


def _index_add_inplace(mode, self, dim, index, source, *, alpha=1):
    dim = _index_add_dim(mode, self, dim, index, source, alpha)
    if dim is None or not _writable(self, index, source):
        return None

    def run():
        _check_changeable("index_add_", self)
        # _writable and _check_changeable checked what the primitive's in-place body would.
        _index_add_op.add_into_checked_target(self, dim, index, source, float(alpha), mode,
                                              _CHECK)
        return self
    return run


def _index_add_out(mode, self, dim, index, source, *, alpha=1, out):
    dim = _index_add_dim(mode, self, dim, index, source, alpha)
    in_place = None if dim is None else _into_out(out, self, index, source)
    if in_place is None:
        return None
    if in_place:
        return _index_add_inplace(mode, out, dim, index, source, alpha=alpha)

    def run():
        _check_changeable("index_add.out", out)
        return out.copy_(_index_add_op._index_add(self, dim, index, source, float(alpha), mode,
                                                  _CHECK))
    return run


# scatter_add, scatter_reduce --------------------------------------------------------------------

def _torch_breaks_zero_ties(mode, self, src, reduce, include_self) -> bool:
    """Whether an "autograd" amax or amin of CPU tensors is left to torch's kernel: where
    zeros of both signs meet (in ``src``, or in ``self`` too with ``include_self``). torch's
    CPU kernels keep the earlier of a +0.0/-0.0 tie in their scalar loops and the later in
    their vector loops: ``index_reduce`` over rows as wide as the CPU's vector or wider (16
    float32 elements on AVX-512, 8 on AVX2, the rest of a row in the scalar loop),
    ``scatter_reduce``'s dim-0 path for an index expanded over 16 elements or more. So only
    its own kernel gives its bits there, on every machine. detsum's amax and amin keep the
    earlier everywhere; without zeros of both signs no tie has two answers. Not for CPU
    tensors standing in for a GPU's (``_segments.GPU_CHECKS_ON_CPU``, in tests): a GPU's path
    reads no value back."""
    if (mode != "autograd" or (reduce != "amax" and reduce != "amin") or not self.is_cpu
            or _segments.GPU_CHECKS_ON_CPU):
        return False
    signs = _zero_signs(src)
    if include_self and signs != {True, False}:
        signs |= _zero_signs(self)
    return signs == {True, False}


def _zero_signs(values: torch.Tensor) -> set[bool]:
    """The signs (``signbit``) of the zeros among ``values``."""
    zeros = values == 0
    if not bool(zeros.any()):
        return set()
    negative = torch.signbit(values) & zeros
    signs = set()
    if bool(negative.any()):
        signs.add(True)
    if not torch.equal(negative, zeros):
        signs.add(False)
    return signs


def _scatter_terms(mode, self, dim, index, src, reduce, include_self):
    """(dim, src cut to index's shape) for the calls detsum takes, else None. torch's index
    may be smaller than src in any dim and than self in every dim but ``dim``; detsum takes
    an index that covers self in every dim but ``dim`` (the other shapes go to torch)."""
    if not (_values(self, src) and index.dtype in INDEX_DTYPES and index.numel() > 0
            and index.dim() == self.dim() == src.dim() and _plain(self, index, src)):
        return None
    if reduce not in _scatter_reduce_op.REDUCTIONS or (reduce == "prod" and mode == "exact"):
        return None
    if _torch_breaks_zero_ties(mode, self, src, reduce, include_self):
        return None
    # torch's CPU scatter sums float16/bfloat16 in an fp32 buffer on some layouts, not on
    # others (as index_add above): torch's kernel is the one source of those bits, its mean's
    # among them.
    if mode == "autograd" and reduce in ("sum", "mean") and self.dtype in _HALF_DTYPES:
        return None
    dim = _dim(dim, self.dim())
    if dim is None:
        return None
    # The shapes one by one only where they differ: a list comparison costs a small call's
    # microsecond (the common call has src of index's shape, and self's but along dim).
    index_shape, src_shape, self_shape = index.shape, src.shape, self.shape
    if index_shape != src_shape and any(
            n > m for n, m in zip(index_shape, src_shape)):
        return None
    if index_shape != self_shape and any(
            index_shape[d] != self_shape[d] for d in range(len(self_shape)) if d != dim):
        return None
    if reduce == "mean" and mode == "exact" and (
            index.shape[dim] + bool(include_self) > MAX_TERMS_PER_STATE):
        return None
    if src_shape != index_shape:
        src = src[tuple(slice(0, n) for n in index_shape)]
    return dim, src


def _scatter_run(self, dim, index, src, reduce, include_self, mode):
    return _scatter_reduce_op._run(self, dim, index, src, reduce, bool(include_self), mode,
                                   False, check=_CHECK)


def _scatter_functional(name, mode, self, dim, index, src, reduce, include_self):
    terms = _scatter_terms(mode, self, dim, index, src, reduce, include_self)
    if terms is None:
        return None
    dim, src = terms
    return lambda: _scatter_run(self, dim, index, src, reduce, include_self, mode)


def _scatter_inplace(name, mode, self, dim, index, src, reduce, include_self):
    terms = _scatter_terms(mode, self, dim, index, src, reduce, include_self)
    if terms is None or not _writable(self, index, src):
        return None
    dim, src = terms

    def run():
        _check_changeable(name, self)
        if _scatter_touched_only(self, dim, index, src, reduce, include_self, mode):
            return self
        return self.copy_(_scatter_run(self, dim, index, src, reduce, include_self, mode))
    return run


def _scatter_touched_only(self, dim, index, src, reduce, include_self, mode) -> bool:
    """A scatter into a contiguous CPU ``self`` of many more elements than it has terms,
    applied in place to the elements that receive terms alone (O(terms), where the whole
    path costs O(self) twice: a new result, then its copy into ``self``); False, nothing
    written, where it does not fit or ``index`` holds a value out of range (the whole path
    raises its error). ``index``: ``src``'s shape (an element each), or 1-D along ``dim``
    (a row each). Each element's terms keep their order along ``dim``, so its reduction has
    the bits of the whole path's, whose CPU rules do not depend on the row's width."""
    if not (self.is_cpu and self.is_contiguous()
            and self.numel() > _segments.SPARSE_ROWS_PER_SOURCE_ROW * src.numel() > 0):
        return False
    # In NumPy: a microsecond or two a step where a torch op on a small tensor takes three
    # to five.
    values = index.numpy()
    if values.min() < 0 or values.max() >= self.shape[dim]:
        return False
    # Each term's element of self, as its offset in self's storage: the index along dim,
    # the term's own place along the other dims.
    at = values.astype(np.int64) * self.stride(dim)
    if index.dim() == 1:
        shape = [1] * self.dim()
        shape[dim] = -1
        at = at.reshape(shape)
    for d in range(self.dim()):
        if d != dim:
            shape = [1] * self.dim()
            shape[d] = -1
            at = at + (np.arange(src.shape[d]) * self.stride(d)).reshape(shape)
    # Flattened in C order, an element's terms stay in their order along dim.
    elements, positions = np.unique(np.broadcast_to(at, src.shape).reshape(-1),
                                    return_inverse=True)
    elements, positions = torch.from_numpy(elements), torch.from_numpy(positions)
    flat = self.view(-1)
    touched, terms = flat.index_select(0, elements), src.reshape(-1)
    if not _small_in_place(mode, touched, 0, positions, terms, reduce, include_self):
        touched = _scatter_run(touched, 0, positions, terms, reduce, include_self, mode)
    flat.index_copy_(0, elements, touched)
    return True


#: The reductions ``_small_in_place`` may take from an index_reduce.
_SMALL_IN_PLACE = ("mean", "amax", "amin")


def _scatter_out(name, mode, self, dim, index, src, reduce, include_self, out):
    terms = _scatter_terms(mode, self, dim, index, src, reduce, include_self)
    in_place = None if terms is None else _into_out(out, self, index, src)
    if in_place is None:
        return None
    dim, src = terms

    def run():
        _check_changeable(name, out)
        return out.copy_(_scatter_run(self, dim, index, src, reduce, include_self, mode))
    return run


def _scatter_add(mode, self, dim, index, src):
    return _scatter_functional("scatter_add", mode, self, dim, index, src, "sum", True)


def _scatter_add_inplace(mode, self, dim, index, src):
    return _scatter_inplace("scatter_add_", mode, self, dim, index, src, "sum", True)


def _scatter_add_out(mode, self, dim, index, src, *, out):
    return _scatter_out("scatter_add.out", mode, self, dim, index, src, "sum", True, out)


def _scatter_reduce(mode, self, dim, index, src, reduce, *, include_self=True):
    return _scatter_functional("scatter_reduce", mode, self, dim, index, src, reduce,
                               include_self)


def _scatter_reduce_inplace(mode, self, dim, index, src, reduce, *, include_self=True):
    return _scatter_inplace("scatter_reduce_", mode, self, dim, index, src, reduce,
                            include_self)


def _scatter_reduce_out(mode, self, dim, index, src, reduce, *, include_self=True, out):
    return _scatter_out("scatter_reduce.two_out", mode, self, dim, index, src, reduce,
                        include_self, out)


# index_reduce -----------------------------------------------------------------------------------

_INDEX_REDUCTIONS = ("prod", "mean", "amax", "amin")


def _index_reduce_dim(mode, self, dim, index, source, reduce, include_self) -> int | None:
    """``index_reduce`` is ``scatter_reduce`` with a 1-D row index: detsum's row form."""
    if reduce not in _INDEX_REDUCTIONS or (reduce == "prod" and mode == "exact"):
        return None
    if _torch_breaks_zero_ties(mode, self, source, reduce, include_self):
        return None
    # torch's CPU kernel rounds float16/bfloat16 products and means its own way here: it is the
    # one source of those bits. Its CUDA kernel (atomics) is refused in deterministic mode:
    # there detsum's own "autograd" rule runs.
    if (mode == "autograd" and reduce in ("prod", "mean") and self.dtype in _HALF_DTYPES
            and not self.is_cuda):
        return None
    dim = _rows_dim(self, dim, index, source)
    if dim is None or (reduce == "mean" and mode == "exact"
                       and index.shape[0] + bool(include_self) > MAX_TERMS_PER_STATE):
        return None
    return dim


def _index_reduce(mode, self, dim, index, source, reduce, *, include_self=True):
    dim = _index_reduce_dim(mode, self, dim, index, source, reduce, include_self)
    if dim is None:
        return None
    return lambda: _scatter_run(self, dim, index, source, reduce, include_self, mode)


def _index_reduce_inplace(mode, self, dim, index, source, reduce, *, include_self=True):
    dim = _index_reduce_dim(mode, self, dim, index, source, reduce, include_self)
    if dim is None or not _writable(self, index, source):
        return None

    def run():
        _check_changeable("index_reduce_", self)
        if reduce in _SMALL_IN_PLACE and _small_in_place(mode, self, dim, index, source, reduce,
                                                         include_self):
            return self
        if _scatter_touched_only(self, dim, index, source, reduce, include_self, mode):
            return self
        return self.copy_(_scatter_run(self, dim, index, source, reduce, include_self, mode))
    return run


def _index_reduce_out(mode, self, dim, index, source, reduce, *, include_self=True, out):
    dim = _index_reduce_dim(mode, self, dim, index, source, reduce, include_self)
    if dim is None or _into_out(out, self, index, source) is None:
        return None

    def run():
        _check_changeable("index_reduce.out", out)
        return out.copy_(_scatter_run(self, dim, index, source, reduce, include_self, mode))
    return run


# index_put with accumulate=True -----------------------------------------------------------------

def _index_put(mode, self, indices, values, accumulate=False, unsafe=False):
    """``self[..., index, ...] += values`` for one integer index tensor after ``d`` full
    slices (``x[idx]``, ``x[:, idx]``, an index of any shape), as ``index_add_`` along ``d``
    of the flattened index; torch takes every other form (masks, several index tensors)."""
    if not accumulate:
        return None
    given = [(d, t) for d, t in enumerate(indices) if t is not None]
    if len(given) != 1 or len(indices) > self.dim():
        return None
    d, index = given[0]
    if not (index.dtype in INDEX_DTYPES and index.numel() > 0 and index.dim() >= 1
            and _values(self, values) and _plain(self, index, values)
            and _writable(self, index, values)):
        return None
    shape = (*self.shape[:d], *index.shape, *self.shape[d + 1:])
    same_shape = values.shape == shape  # x[idx]'s backward; half a microsecond less than:
    if not (same_shape or _broadcasts_to(values.shape, shape)):
        return None

    def run():
        _check_changeable("index_put_", self)
        if index.dim() == 1:  # x[idx]'s backward: the index and values as they are
            flat = index
            terms = values if same_shape else values.expand(shape)
        else:
            flat = index.reshape(-1)
            terms = values.expand(shape).reshape(*self.shape[:d], flat.shape[0],
                                                 *self.shape[d + 1:])
        _add_at_python_indices(self, d, flat, terms, mode, lambda bad: (
            f"index_put_ (run by {_switched_by()}): index {bad} is out of bounds for dimension "
            f"{d} with size {self.shape[d]} (expected {-self.shape[d]} <= index < "
            f"{self.shape[d]})"))
        return self
    return run


def _add_at_python_indices(target, dim, index, terms, mode, out_of_range) -> None:
    """``index_add_`` of ``terms`` into ``target`` along ``dim`` at the 1-D ``index``, whose
    values have Python's meaning (torch's indexing and ``put_`` give it): a negative value
    counts from the end. Checked on the host: detsum's own check finds any value outside
    ``[0, size)`` before anything is written; only then is the index read back (its least and
    largest value) and its negative values turned into positions, so that a call with every
    value in range reads nothing more; a value outside ``[-size, size)`` raises, worded by
    ``out_of_range(value)``. Checked on the device: the negative values are turned into
    positions first (a value still outside ``[0, size)`` fails the device's check)."""
    size = target.shape[dim]
    if _checked_on_device(target):
        _index_add_op._index_add_inplace(target, dim, _negatives_from_the_end(index, size),
                                         terms, 1.0, mode, _CHECK)
        return
    # A negative value makes the one small call write nothing: the paths below take it.
    if _small_in_place(mode, target, dim, index, terms, "sum"):
        return
    try:
        _index_add_op._index_add_inplace(target, dim, index, terms, 1.0, mode)
        return
    except IndexOutOfRangeError:
        pass
    low, high = (int(v) for v in torch.aminmax(index))
    if low < -size or high >= size:
        raise IndexOutOfRangeError(out_of_range(low if low < -size else high))
    _index_add_op._index_add_inplace(target, dim, _negatives_from_the_end(index, size), terms,
                                     1.0, mode)


def _negatives_from_the_end(index: torch.Tensor, size: int) -> torch.Tensor:
    """``index`` with each negative value counted from the end (``+ size``), in two
    elementwise ops (on a GPU, two kernels), where a compare, an add and a select take three:
    the sign bit, -1 or 0, times ``-size``, added. A value outside ``[-size, size)`` stays
    outside ``[0, size)``."""
    sign = index >> (8 * index.element_size() - 1)
    return torch.add(index, sign, alpha=-size)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` expands to ``target`` (torch's broadcasting, one way).
    Here, not ``torch.broadcast_shapes``: that costs a small call a third of its time."""
    return len(shape) <= len(target) and all(
        size == 1 or size == wanted for size, wanted in zip(reversed(shape), reversed(target)))


# put_ with accumulate=True ----------------------------------------------------------------------

def _put(mode, self, index, source, accumulate=False):
    """``self.view(-1)[index[k]] += source[k]`` over the flattened tensors, as ``index_add_``
    along the one dim of ``self``'s flattened copy (its own memory when contiguous)."""
    if not (accumulate and self.dtype in FLOAT_DTYPES and source.dtype == self.dtype
            and index.dtype == torch.int64 and index.numel() == source.numel() > 0
            and self.numel() > 0 and _plain(self, index, source)
            and _writable(self, index, source)):
        return None

    def run():
        _check_changeable("put_", self)
        flat = self.view(-1) if self.is_contiguous() else self.reshape(-1)
        _add_at_python_indices(flat, 0, index.reshape(-1), source.reshape(-1), mode, lambda bad: (
            f"put_ (run by {_switched_by()}): out of range: tried to access index {bad} on a "
            f"tensor of {self.numel()} elements (expected {-self.numel()} <= index < "
            f"{self.numel()})"))
        return self if self.is_contiguous() else self.copy_(flat.view(self.shape))
    return run


# bincount with weights --------------------------------------------------------------------------

def _bincount(mode, self, weights=None, minlength=0):
    """``out[self[k]] += weights[k]`` from zeros, ``max(self) + 1`` (at least ``minlength``)
    bins: ``index_add`` into a new tensor. The bins are float32 for float32 weights and
    float64 for every other float dtype, as torch makes them (float16/bfloat16 weights are
    widened to float64 first, exactly)."""
    if (weights is None or weights.dtype not in FLOAT_DTYPES or self.dtype not in INDEX_DTYPES
            or self.dim() != 1 or weights.dim() != 1 or weights.shape[0] != self.shape[0]
            or self.numel() == 0 or minlength < 0 or not _plain(self, weights)):
        return None
    bins = torch.float32 if weights.dtype == torch.float32 else torch.float64

    def run():
        terms = weights if weights.dtype == bins else weights.to(bins)
        if _checked_on_device(self):
            # The one read of the call, as torch's: the number of bins, and a negative value
            # (torch refuses it, in its words).
            low, high = torch.stack(torch.aminmax(self)).tolist()
            if low < 0:
                raise _LeaveToTorch
            zeros = torch.zeros(max(high + 1, minlength), dtype=bins, device=weights.device)
            return _index_add_op._index_add(zeros, 0, self, terms, 1.0, mode, _CHECK)
        zeros = torch.zeros(max(int(self.max()) + 1, minlength), dtype=bins,
                            device=weights.device)
        try:
            # Into the new zeros themselves: a new output would be one more pass.
            _index_add_op._index_add_inplace(zeros, 0, self, terms, 1.0, mode)
        except IndexOutOfRangeError:
            raise _LeaveToTorch from None  # a negative value: torch refuses it, in its words
        return zeros
    return run


# embedding's dense backward ---------------------------------------------------------------------

def _embedding_backward(mode, grad_output, indices, num_weights, padding_idx,
                        scale_grad_by_freq):
    """``grad_weight[indices[k]] += grad_output[k]`` over the rows with ``indices[k] !=
    padding_idx``, from zeros. ``scale_grad_by_freq=True`` goes to torch (its scale is a
    per-row division that the primitives do not take), and so does "autograd" mode on CUDA:
    torch's CUDA kernels for it hold no atomics (with or without deterministic algorithms)
    and their order is neither ``index_put_``'s nor serial (up to 3072 indices, sums of each
    row's terms in windows of 32 positions, added window by window; past that, sums of 10
    sorted terms, then of those sums), so torch's kernel is the one source of its bits."""
    if mode == "autograd" and grad_output.device.type == "cuda":
        return None
    if (scale_grad_by_freq or grad_output.dtype not in FLOAT_DTYPES
            or indices.dtype not in INDEX_DTYPES or indices.numel() == 0 or num_weights <= 0
            or grad_output.dim() < 1 or not _plain(grad_output, indices)
            or grad_output.numel() != indices.numel() * grad_output.shape[-1]):
        return None

    def run():
        width = grad_output.shape[-1]
        if width == 0:
            return grad_output.new_zeros(num_weights, 0)
        rows = indices if indices.dim() == 1 else indices.reshape(-1)
        grad = grad_output if grad_output.dim() == 2 else grad_output.reshape(-1, width)
        if _checked_on_device(grad):
            # No read of the index: the padding rows' terms go to a spare row past the table,
            # and a row outside it fails the device's check (torch's forward, an index_select,
            # refuses such rows on the device already).
            if padding_idx >= 0:
                rows = torch.where(rows == padding_idx, num_weights, rows)
            spare = int(padding_idx >= 0)
            sums = _index_add_op._index_add(grad.new_zeros(num_weights + spare, width), 0, rows,
                                            grad, 1.0, mode, _CHECK)
            return sums[:num_weights] if spare else sums
        keep_rows, keep_grad = rows, grad
        if padding_idx >= 0:
            keep = rows != padding_idx
            keep_rows, keep_grad = rows[keep], grad[keep]
        zeros = grad.new_zeros(num_weights, width)
        if keep_rows.numel() == 0:
            return zeros
        try:
            # Into the new zeros themselves: a new output would be one more pass.
            _index_add_op._index_add_inplace(zeros, 0, keep_rows, keep_grad, 1.0, mode)
        except IndexOutOfRangeError:
            raise _LeaveToTorch from None  # torch leaves out rows outside [0, num_weights)
        return zeros
    return run


# embedding_bag's dense backward -----------------------------------------------------------------

_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


def _embedding_bag_backward(mode, grad, indices, offset2bag, bag_size, maximum_indices,
                            num_weights, scale_grad_by_freq, bag_mode, per_sample_weights=None,
                            padding_idx=-1):
    """The weight gradient of a dense ``embedding_bag`` (``_embedding_bag_backward`` calls
    this for ``sparse=False``), from zeros. sum and mean: ``grad_weight[indices[k]] +=
    grad[offset2bag[k]] * scale[k]`` over the ``k`` with ``indices[k] != padding_idx``, with
    torch's terms: ``scale[k]`` is 1, ``per_sample_weights[k]`` (sum) or ``1 / bag_size`` of
    the bag, rounded to the dtype (mean), and each product is rounded to the dtype. max:
    ``grad_weight[maximum_indices[b, j], j] += grad[b, j]`` over the bags ``b`` that hold an
    index, a scatter_add along the bags. "autograd" mode: on CPU tensors in torch's CPU
    order; on CUDA, sum and mean go to torch's kernel (no atomics, an order of its own, as
    embedding's backward), and max, which torch refuses in deterministic mode, is the
    scatter_add of those terms in its "autograd" bits."""
    if (scale_grad_by_freq or bag_mode not in (_BAG_SUM, _BAG_MEAN, _BAG_MAX)
            or grad.dtype not in FLOAT_DTYPES or grad.dim() != 2 or grad.numel() == 0
            or num_weights <= 0 or indices.dtype not in INDEX_DTYPES or indices.dim() != 1
            or indices.numel() == 0 or bag_size.shape != grad.shape[:1]
            or not _plain(grad, indices, offset2bag, bag_size)):
        return None
    if bag_mode == _BAG_MAX:
        if (maximum_indices.dtype not in INDEX_DTYPES or maximum_indices.shape != grad.shape
                or not _plain(grad, maximum_indices)):
            return None
        # torch adds each column with index_add_, whose float16/bfloat16 arithmetic depends
        # on the layout (see index_add above): its kernel is the one source of those bits
        # (on CUDA, scatter_add's "autograd" bits are torch's kernel's for those dtypes too).
        if mode == "autograd" and grad.dtype in _HALF_DTYPES:
            if not grad.is_cuda:
                return None
            return lambda: _embedding_bag_max_backward_by_torch(grad, bag_size, maximum_indices,
                                                                num_weights)
        return lambda: _embedding_bag_max_backward(mode, grad, bag_size, maximum_indices,
                                                   num_weights)
    if mode == "autograd" and grad.is_cuda:
        return None
    weights = per_sample_weights
    if (offset2bag.dtype not in INDEX_DTYPES or offset2bag.shape != indices.shape
            or weights is not None and (bag_mode != _BAG_SUM or weights.dtype != grad.dtype
                                        or weights.shape != indices.shape
                                        or not _plain(grad, weights))):
        return None
    # torch scales through BLAS's axpy, which may fuse the product into the add for float32
    # and float64 (one rounding): its kernel is the one source of those bits. Its float16/
    # bfloat16 axpy rounds the product and the sum, as the terms below.
    if mode == "autograd" and (weights is not None or bag_mode == _BAG_MEAN) and (
            grad.dtype not in _HALF_DTYPES):
        return None

    def run():
        on_device = _checked_on_device(grad)
        if not on_device:
            caller = f"_embedding_bag_dense_backward (run by {_switched_by()})"
            _check_in_range(caller, "indices", indices, num_weights, "num_weights")
            _check_in_range(caller, "offset2bag", offset2bag, grad.shape[0], "grad.size(0)")
        rows, bags, scale = indices, offset2bag, weights
        if mode == "autograd":
            # torch sums each row's terms in the order of its (unstable) sort of the indices.
            rows, order = indices.sort()
            bags = offset2bag.index_select(0, order)
            scale = None if weights is None else weights.index_select(0, order)
        terms = grad.index_select(0, bags)
        if bag_mode == _BAG_MEAN:
            sizes = bag_size.index_select(0, bags).double()
            scale = torch.where(sizes != 0, 1.0 / sizes, 1.0).to(grad.dtype)
        if scale is not None:
            terms = terms * scale.view(-1, 1)
        if on_device:
            # No value read back: the padding rows' terms go to a spare row past the table,
            # which the result leaves out (as embedding's backward); an index outside the
            # table fails the device's check, a bag outside grad torch's own index_select's.
            spare = int(padding_idx >= 0)
            if spare:
                rows = torch.where(rows == padding_idx, num_weights, rows)
            sums = _index_add_op._index_add(grad.new_zeros(num_weights + spare, grad.shape[1]),
                                            0, rows, terms, 1.0, mode, _CHECK)
            return sums[:num_weights] if spare else sums
        keep = rows != padding_idx
        zeros = grad.new_zeros(num_weights, grad.shape[1])
        if not bool(keep.all()):
            rows, terms = rows[keep], terms[keep]
        if rows.numel() == 0:
            return zeros
        _index_add_op._index_add_inplace(zeros, 0, rows, terms, 1.0, mode)
        return zeros
    return run


def _embedding_bag_max_backward(mode, grad, bag_size, maximum_indices, num_weights):
    if _checked_on_device(grad):
        # No value read back: an empty bag's terms go to a spare row past the table, which
        # the result leaves out; the other bags' in their order, as below.
        rows = torch.where((bag_size != 0).view(-1, 1), maximum_indices, num_weights)
        sums = _scatter_run(grad.new_zeros(num_weights + 1, grad.shape[1]), 0, rows, grad,
                            "sum", True, mode)
        return sums[:num_weights]
    zeros = grad.new_zeros(num_weights, grad.shape[1])
    caller = f"_embedding_bag_dense_backward (run by {_switched_by()})"
    nonempty = (bag_size != 0).nonzero().view(-1)
    rows = maximum_indices.index_select(0, nonempty)
    _check_in_range(caller, "maximum_indices", rows, num_weights, "num_weights",
                    positions=nonempty)
    if rows.numel() == 0:
        return zeros
    return _scatter_run(zeros, 0, rows, grad.index_select(0, nonempty), "sum", True, mode)


def _embedding_bag_max_backward_by_torch(grad, bag_size, maximum_indices, num_weights):
    """The max backward as torch's deterministic ``scatter_add`` of the terms along the bags
    (an empty bag's at a spare row past the table, which the result leaves out): the one
    source of its float16/bfloat16 bits on CUDA in "autograd" mode, where torch's own max
    backward adds with atomics (float16) or has no kernel (bfloat16). No value read back."""
    rows = torch.where((bag_size != 0).view(-1, 1), maximum_indices, num_weights)
    with _torch_deterministic():
        sums = grad.new_zeros(num_weights + 1, grad.shape[1]).scatter_add_(0, rows, grad)
    return sums[:num_weights]


def _check_in_range(caller, name, index, size, what, *, positions=None):
    """Raise IndexOutOfRangeError for the first value of ``index`` outside ``[0, size)``;
    ``positions``: the rows of the caller's tensor that ``index``'s rows are. An empty
    ``index`` (every bag of a max backward empty, say) holds no value to check."""
    if index.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(index))
    if low >= 0 and high < size:
        return
    if positions is not None:
        bad = ((index < 0) | (index >= size)).nonzero()[0].tolist()
        value = int(index[tuple(bad)])
        where = [int(positions[bad[0]]), *bad[1:]]
        raise IndexOutOfRangeError(f"{caller}: {name}{where} = {value} is out of range for "
                                   f"{what} = {size} (expected 0 <= {name} < {size})")
    _validation.raise_first_out_of_range(caller, name, index, size, what)


# segment_reduce (torch.segment_reduce) ----------------------------------------------------------

# torch's own names are "amax" and "amin" (PyG calls those); "max" and "min" are its aliases.
_SEGMENT_REDUCTIONS = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin",
                       "amax": "amax", "amin": "amin", "prod": "prod"}
_SEGMENT_EMPTY = {"sum": 0.0, "mean": 0.0, "max": -math.inf, "min": math.inf,
                  "amax": -math.inf, "amin": math.inf, "prod": 1.0}


def _segment_reduce(mode, data, reduce, *, lengths=None, indices=None, offsets=None, axis=0,
                    unsafe=False, initial=None):
    """Each segment of consecutive rows along ``axis`` (given by ``lengths`` or by
    ``offsets``, per batch of the dims before ``axis``) reduced from ``initial`` (or the
    reduction's identity) in row order: ``scatter_reduce`` with a row index, ``index_add``
    for sum and mean (from +0.0 the same bits as a ``segment_sum`` of the rows). A mean
    divides the sum by the length (an empty segment keeps ``initial``, or is NaN): in torch's
    arithmetic in "autograd" mode, in the accumulator type otherwise. "autograd" mode
    reproduces torch's CPU arithmetic; on CUDA it goes to torch's kernel (no atomics, an
    order of its own). The lengths or offsets are read back once (on a GPU a
    synchronisation; torch's own reads lengths twice when ``unsafe=False``), but on a GPU's
    path a sum's or mean's from +0.0 over 1-D bounds (``_segment_sum_unread_bounds``), and on
    the CPU a small one's over 1-D bounds that tile the rows, which one Numba call reads and
    checks (``_small_segment_reduce``)."""
    bounds = offsets if offsets is not None else lengths
    if (indices is not None or reduce not in _SEGMENT_REDUCTIONS or bounds is None
            or data.dtype not in FLOAT_DTYPES or data.numel() == 0 or data.dim() == 0
            or bounds.dtype not in INDEX_DTYPES or not _plain(data, bounds)
            or mode == "autograd" and data.is_cuda):
        return None
    axis = _dim(axis, data.dim())
    if (axis is None or bounds.dim() != axis + 1 or bounds.shape[:-1] != data.shape[:axis]
            or bounds.shape[-1] < (2 if offsets is not None else 1)):
        return None
    if initial is not None and (isinstance(initial, bool) or not isinstance(initial, (int, float))
                                or not abs(initial) <= torch.finfo(data.dtype).max):
        return None
    # detsum has no exact product; torch rounds float16/bfloat16 products to the dtype after
    # every factor, where detsum's product rounds once.
    if reduce == "prod" and (mode == "exact" or mode == "autograd"
                             and data.dtype in _HALF_DTYPES):
        return None
    size = data.shape[axis]
    reduced = _small_segment_reduce(mode, data, reduce, bounds, offsets is None, axis, initial)
    if reduced is not None:
        return lambda: reduced
    if (bounds.dim() == 1 and axis == 0 and data.dim() == 2 and _from_zero(reduce, initial)
            and _checked_on_device(data)):
        return lambda: _segment_sum_unread_bounds(mode, data, reduce, offsets, lengths, unsafe,
                                                  initial)
    caller = f"segment_reduce (run by {_switched_by()})"
    # The values are read in NumPy, a microsecond or two a step where a torch op on a small
    # tensor takes three to five.
    values = bounds.numpy() if bounds.is_cpu else bounds.cpu().numpy()
    if values.ndim == 1:  # the common form, with fewer NumPy steps than the general one below
        if offsets is not None:
            if (int(values[0]) == 0 and int(values[-1]) == size
                    and not (values[1:] < values[:-1]).any()):
                return lambda: _segment_run(mode, data, reduce, axis, offsets, None, initial)
        elif values.min() >= 0:
            flat = np.zeros(values.size + 1, dtype=np.int64)
            np.cumsum(values, out=flat[1:])
            if int(flat[-1]) == size:
                return lambda: _segment_run(mode, data, reduce, axis, _on_device_of(data, flat),
                                            None, initial)
    if offsets is not None:
        decreasing = bool((values[..., 1:] < values[..., :-1]).any())
        # Nondecreasing offsets lie in [0, size] when each batch's first and last do.
        firsts, lasts = values[..., 0], values[..., -1]
        low, high = (values.min(), values.max()) if decreasing else (firsts.min(), lasts.max())
        if low < 0 or high > size:  # torch would read outside data
            return lambda: _validation.raise_first_out_of_range(
                caller, "offsets", offsets, size, f"data.size({axis})", size_included=True)
        if decreasing:  # torch refuses it: its error
            return None
        tiled = bool((firsts == 0).all() and (lasts == size).all())
        if tiled and values.ndim == 1:
            # The caller's offsets are the CSR offsets of data's rows already.
            return lambda: _segment_run(mode, data, reduce, axis, offsets, None, initial)
        starts, lengths = values[..., :-1], np.diff(values, axis=-1)
    else:
        if values.min() < 0:  # torch refuses a negative length: its error
            return None
        lengths = values
        ends = lengths.cumsum(-1)
        # (One batch's total as a Python int: a NumPy comparison and all() cost 2 us.)
        tiled = int(ends[-1]) == size if ends.ndim == 1 else bool((ends[..., -1] == size).all())
        if not (tiled or unsafe):  # torch's error
            return None
        if unsafe and ends[..., -1].max() > size:  # torch would read outside data
            return lambda: _raise_lengths_past(caller, torch.from_numpy(ends[..., -1]), size,
                                               axis)
        starts = ends - lengths
    # The CSR offsets of all batches' segments one after the other.
    flat = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=flat[1:])
    if tiled:  # each batch's segments tile its rows: they are offsets into data's rows
        return lambda: _segment_run(mode, data, reduce, axis, _on_device_of(data, flat), None,
                                    initial)
    # Segments that leave rows out: each one's rows, in order (its start in its batch, plus
    # the place in the segment), picked out of data's.
    batches = starts[..., 0].size
    firsts = (starts + size * np.arange(batches).reshape(*starts.shape[:-1], 1)).reshape(-1)
    picked = np.repeat(firsts - flat[:-1], lengths.reshape(-1)) + np.arange(flat[-1])
    return lambda: _segment_run(mode, data, reduce, axis, _on_device_of(data, flat),
                                _on_device_of(data, picked), initial)


def _small_segment_reduce(mode, data, reduce, bounds, lengths, axis, initial):
    """A small ``segment_reduce`` of 2-D CPU ``data`` over 1-D ``bounds`` (``lengths``, or
    offsets) that tile its rows, in one Numba call that reads and checks them too
    (``_segments.small_segment_reduce``, the primitive's small call for a sum): a sum or mean
    from +0.0, or a max or min with no ``initial``; the bits of the paths after it. None,
    nothing written, for a call it does not take, or bounds it refuses."""
    reduce = _SEGMENT_REDUCTIONS[reduce]
    if not (axis == 0 and bounds.dim() == 1 and data.dim() == 2 and data.is_cpu
            and (_from_zero(reduce, initial) if reduce in ("sum", "mean")
                 else initial is None and reduce != "prod")
            and _segments.numba_runs_cpu_tensors()):
        return None
    reduced = _segments.small_segment_reduce(data[None], bounds, reduce, _cpu_rule(mode, reduce),
                                             lengths=lengths, empty_nan=initial is None)
    return None if reduced is None else reduced[0]


def _on_device_of(data: torch.Tensor, values: np.ndarray) -> torch.Tensor:
    """``values``, made on the host, as a tensor on ``data``'s device."""
    made = torch.from_numpy(values)
    return made if data.is_cpu else made.to(data.device)


def _raise_lengths_past(caller, totals, size, axis):
    first = (totals > size).nonzero()[0].tolist()
    where = f"lengths{first}" if first else "lengths"
    raise IndexOutOfRangeError(
        f"{caller}: {where} sum to {int(totals[tuple(first)])}, past data.size({axis}) = "
        f"{size} (expected a sum <= {size} with unsafe=True)")


def _segment_run(mode, data, reduce, axis, offsets, picked, initial):
    """The segments' reduction: segment ``s`` (of all batches' segments, one after the other)
    is rows ``offsets[s]`` to ``offsets[s + 1]`` of ``data``'s rows (of the dims up to
    ``axis``, flattened), or of ``data``'s rows at ``picked`` where that is given."""
    fill = _SEGMENT_EMPTY[reduce] if initial is None else initial
    from_zero = _from_zero(reduce, initial)
    if from_zero and picked is None and data.dim() == 2 and axis == 0:
        # data's own rows (PyG's form): the result has segment_reduce's shape as it comes.
        return _segment_sum_from_zero(mode, data, reduce, offsets, initial, data.dtype)
    batches, count = math.prod(data.shape[:axis]), offsets.shape[0] - 1
    rows = data if data.dim() == 2 and axis == 0 else data.reshape(batches * data.shape[axis], -1)
    if picked is not None:
        rows = rows.index_select(0, picked)
    shape = (*data.shape[:axis], count // batches, *data.shape[axis + 1:])
    if from_zero:
        return _segment_sum_from_zero(mode, rows, reduce, offsets, initial, data.dtype
                                      ).view(*shape)  # sizes one by one: parsed faster
    base = torch.full((count, rows.shape[1]), fill, dtype=data.dtype, device=data.device)
    if reduce != "mean":
        return _reduce_from_base(mode, rows, offsets, base, _SEGMENT_REDUCTIONS[reduce]
                                 ).view(shape)
    # The mean: the sum, then the division by the length. In "autograd" mode torch's: the
    # length rounded to the dtype (as c10's Half / int64 does), one division in the dtype.
    # Otherwise in the accumulator type, from its sum (float32 for float16/bfloat16 data),
    # rounded once to the dtype.
    work = data.dtype if mode == "autograd" else acc_dtype(data.dtype)
    total = _reduce_from_base(mode, rows.to(work), offsets, base.to(work), "sum")
    return _segment_mean(total, offsets.diff(), initial, data.dtype).view(shape)


def _reduce_from_base(mode, rows, offsets, base, reduce):
    """``base``'s rows, each reduced (``reduce``: "sum", "amax", "amin" or "prod", in
    ``mode``) with its segment of ``rows`` between the CSR ``offsets`` (made on the host from
    checked bounds), the base first, then the rows in order: what ``index_add`` (a sum) or
    ``scatter_reduce`` with ``include_self`` makes of the segments' row index, whose stable
    order is the rows' own. On a kernel backend that is one launch over the offsets as they
    are (no index, no plan: the same launch the plan of that index would make); on the
    reference backend, and for a sum, max or min small enough for the Numba backend's one
    small call (which the primitive makes, in about 0.8x the launch's time), that call."""
    if rows.shape[0] == 0:
        return base
    backend_name = current_backend(rows.device.type, _switched_by())
    if backend_name == "reference" or (backend_name == "numba" and reduce != "prod"
                                       and rows.numel() + base.numel() <= _small_elements()):
        # (The size given: on a GPU, repeat_interleave would read it back.)
        segments = torch.repeat_interleave(offsets.diff(), output_size=rows.shape[0])
        if reduce == "sum":
            return _index_add_op._index_add(base, 0, segments, rows, 1.0, mode, _CHECK)
        return _scatter_run(base, 0, segments, rows, reduce, True, mode)
    base3 = base[None]
    out3 = _segments.new_output_like(base3)
    _segments.launch(backend_name, rows[None], None, offsets.to(torch.int64), base3, out3,
                     reduce=reduce,
                     rule=rule_for(MODE_BY_NAME[mode], reduce, rows.device.type, rows.shape[1]),
                     alpha=1.0, include_base=True)
    return out3[0]


def _from_zero(reduce, initial) -> bool:
    """Whether a segment_reduce is a sum or mean started from +0.0."""
    fill = _SEGMENT_EMPTY[reduce] if initial is None else initial
    return reduce in ("sum", "mean") and fill == 0 and math.copysign(1.0, fill) > 0


def _segment_sum_unread_bounds(mode, data, reduce, offsets, lengths, unsafe, initial):
    """A sum or mean from +0.0 over 1-D ``offsets`` or ``lengths`` of ``data``'s rows on a
    GPU's path, nothing read back; the launch checks the segments on the device. Lengths
    (``unsafe=False``) must tile the rows, as torch checks (it reads them): their running sum
    from 0 are the offsets. Offsets, and lengths with ``unsafe=True``, may leave rows out at
    either end (torch reads nothing of them): the segments run between two more, of the rows
    before the first offset and from the last one on, which tile the rows wherever torch takes
    the bounds (nondecreasing, inside ``[0, data.size(0)]``), and the result leaves the two
    out. The launch takes those bounds as the caller's between a 0 and ``data.size(0)``
    (``segment_sum``'s inner offsets), with no padded copy. Each segment sums its own rows:
    the host path's bits, which reads the bounds and leaves the rows outside out."""
    if offsets is None and not unsafe:
        # 0, then the lengths' running sum written after it (two ops; a pad of the sum, three).
        offsets = lengths.new_zeros(lengths.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return _segment_sum_from_zero(mode, data, reduce, offsets, initial, data.dtype,
                                      check=_CHECK)
    if offsets is None:
        # From 0 to the running sum of the lengths: the rows past it are the last segment.
        return _segment_sum_from_zero(mode, data, reduce, lengths.cumsum(0), initial,
                                      data.dtype, check=_CHECK,
                                      inner=(slice(None, -1), lambda: lengths))
    return _segment_sum_from_zero(mode, data, reduce, offsets, initial, data.dtype,
                                  check=_CHECK, inner=(slice(1, -1), offsets.diff))


def _segment_sum_from_zero(mode, rows, reduce, offsets, initial, dtype, check=None,
                           inner=None):
    """A sum or mean of segments started from +0.0, as ``segment_sum`` over the CSR
    ``offsets``: no sort, the rows added in order, the bits of ``index_add`` into zeros in
    every mode. In "exact" mode a segment whose terms sum to -0.0 (all of them -0.0) gives
    +0.0 there, as +0.0 + -0.0 does: adding +0.0 turns -0.0 into +0.0 and leaves every other
    value as it is. ``check``: the primitive's check level for offsets not yet checked.
    ``inner``: ``offsets`` are the inner bounds of segments from 0 to the rows' end
    (``segment_sum``'s inner offsets), of whose results those at ``inner[0]`` are kept, their
    lengths ``inner[1]()`` (for a mean)."""
    work = dtype if reduce == "sum" or mode == "autograd" else acc_dtype(dtype)
    # Else _segment_reduce has checked the offsets (or made them): the primitive need not.
    checked = {"offsets_checked": True} if check is None else {"check": check}
    total = _segment_sum_op._segment_sum(rows if work == dtype else rows.to(work), offsets, 0,
                                         None, mode, **checked, inner_offsets=inner is not None)
    lengths_of_kept = offsets.diff
    if inner is not None:
        total, lengths_of_kept = total[inner[0]], inner[1]
    if mode == "exact":
        total = total + 0.0
    return total if reduce == "sum" else _segment_mean(total, lengths_of_kept(), initial, dtype)


def _segment_mean(total, lengths, initial, dtype):
    """The segments' means from their sums ``total`` (in the mean's working type): an empty
    segment keeps ``initial``, or is NaN."""
    divisor = lengths.to(total.dtype).view(-1, 1)
    mean = torch.where(divisor != 0, total / divisor, total).to(dtype)
    if initial is None:
        mean = mean.masked_fill((lengths == 0).view(-1, 1), math.nan)
    return mean


# histc ------------------------------------------------------------------------------------------

def _histc_edges(self, bins, min, max):
    """torch's CPU histc's ``(left, right, width, scale)``, as Python floats (values of the
    dtype), or None where torch refuses (its error). The edges are ``min`` and ``max``, else
    the data's range (torch reads it back too), else that value -1 and +1, as the first and
    last of ``linspace(min, max, bins + 1)`` in the dtype; ``width = right - left``;
    ``scale`` is ``bins`` in the dtype (c10's float16/bfloat16 operators round it so). None
    too where torch's bin arithmetic (``_histc_positions``) can leave its bins: its bin for
    ``right``, the largest any element gets, past ``bins`` (a float16 product past its
    range, inf, or ``bins`` rounded up): torch would write outside its histogram. Every value
    is made on the host from the call's numbers, but the data's range where ``min == max``
    (torch's own histc reads it too)."""
    if (self.dtype not in FLOAT_DTYPES or self.numel() == 0 or isinstance(bins, bool)
            or not isinstance(bins, int) or bins <= 0 or not _plain(self)
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in (min, max))):
        return None
    low, high = float(min), float(max)
    if low == high:
        low, high = (float(v) for v in torch.aminmax(self))
    if low == high:
        low, high = low - 1, high + 1
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        return None
    return _histc_edges_in(self.dtype, bins, low, high)


@functools.lru_cache(maxsize=64)
def _histc_edges_in(dtype, bins, low, high):
    """``_histc_edges`` of a range: torch's ops on the host, once per dtype, bins and range
    (a histogram logged every step asks for the same edges; they took a 10k-element
    ``histc`` 46 us of its 88)."""
    edges = torch.linspace(low, high, bins + 1, dtype=dtype)
    left, right = edges[0], edges[-1]
    width, scale = right - left, torch.tensor(bins, dtype=dtype)
    if not (bool(torch.isfinite(width)) and bool(width > 0) and bool(torch.isfinite(scale))):
        return None
    # Each step of the bin arithmetic is nondecreasing in x: right's bin is the largest. (In
    # Python: compared in the dtype, bins + 1 could round.)
    if not float((right - left) * scale / width) < bins + 1:  # NaN and inf fail too
        return None
    return float(left), float(right), float(width), float(scale)


def _histc_positions(self, bins, edges):
    """The bin of each element that torch's CPU histc counts, from ``_histc_edges``'s
    ``edges``. An element ``left <= x <= right`` goes to bin ``(x - left) * scale / width``,
    each step rounded to the dtype as torch's kernel computes it, truncated toward zero; a
    bin ``bins`` (``x == right``, or a product rounded up to it) is the last one. Every
    element keeps its place: one outside the bins, or NaN, goes to a spare bin ``bins``,
    which the counts leave out (no value of the data is read back for it, nor the elements
    inside picked out: on the CPU that pass cost more than the arithmetic)."""
    # The edges as 0-dim tensors of the dtype on the data's device: made by fills, not
    # copies (a copy from the host synchronises), and a divisor there is divided by (CUDA
    # multiplies by the reciprocal of a CPU scalar divisor).
    left, right, width, scale = (torch.full((), edge, dtype=self.dtype, device=self.device)
                                 for edge in edges)
    values = self.reshape(-1)
    inside = (values >= left) & (values <= right)
    position = ((torch.where(inside, values, left) - left) * scale / width).to(torch.int64)
    return torch.where(inside, position.clamp_max(bins - 1), bins)


def _histc_counts(mode, self, bins, edges):
    """The histogram of ``self`` over ``_histc_edges``'s ``edges``: ``out[position[k]] +=
    1`` from zeros, in the dtype, for the positions ``_histc_positions`` gives below
    ``bins``, as an ``index_add`` of ones into ``bins + 1`` zeros, the spare last one left
    out. On the CPU the bins are counted as integers first, in one pass
    (``_segments.histogram``, the same positions): where no count passes
    ``_exact_count_limit``, that sum of ones is the count in every order and split, rounded
    once to the dtype, and the result is that rounding."""
    if not _checked_on_device(self):
        counts = _segments.histogram(self, *edges, bins)
        if int(counts.max()) <= _exact_count_limit(mode, self.dtype):
            # int64 to float64 is exact below 2**53; float64 to the dtype rounds once.
            return counts.to(torch.float64).to(self.dtype)
    if mode in ("exact", "kahan") and self.numel() <= _exact_count_limit("fp32", self.dtype):
        # No count can pass the limit: "fp32" sums the ones exactly and rounds once, the
        # bits of "exact" and of "kahan" (whose compensation stays zero), with the lighter
        # kernel.
        mode = "fp32"
    position = _histc_positions(self, bins, edges)
    zeros = torch.zeros(bins + 1, dtype=self.dtype, device=self.device)
    ones = torch.ones(position.shape, dtype=self.dtype, device=self.device)
    return _index_add_op._index_add(zeros, 0, position, ones, 1.0, mode, _CHECK)[:bins]


def _exact_count_limit(mode, dtype) -> float:
    """The largest count whose sum of ones the index_add of ``mode`` into ``dtype`` computes
    exactly, whatever its order and chunks: every partial sum is then an integer of at most
    that count, which the type it is summed in holds. That type is the dtype in "autograd"
    mode (rounded after every add) and the accumulator type in "fp32" and "kahan"; it holds
    every integer up to ``2 / eps``. "exact" rounds the count once, at any count."""
    if mode == "exact":
        return math.inf
    return 2 / torch.finfo(dtype if mode == "autograd" else acc_dtype(dtype)).eps


def _histc(mode, self, bins=100, min=0, max=0):
    edges = _histc_edges(self, bins, min, max)
    if edges is None:
        return None
    return lambda: _histc_counts(mode, self, bins, edges)


def _histc_out(mode, self, bins=100, min=0, max=0, *, out):
    if (out.shape != (bins,) or out.dtype != self.dtype or out.device != self.device
            or out.layout != torch.strided or _validation.has_internal_overlap(out)
            or _validation.shares_memory(out, self)):
        return None
    edges = _histc_edges(self, bins, min, max)
    if edges is None:
        return None

    def run():
        _check_changeable("histc.out", out)
        return out.copy_(_histc_counts(mode, self, bins, edges))
    return run


#: The switched operators with a short way (returning the call's result having run it, None
#: having written nothing), tried before their body.
_SHORT_WAYS = {
    "index_add_": _index_add_short,
    "index_add.out": _index_add_out_short,
    "scatter_add_": _scatter_add_short,
    "scatter_reduce_.two": _scatter_short,
    "_index_put_impl_": _index_put_short,
    "embedding_dense_backward": _embedding_backward_short,
    "_embedding_bag_dense_backward": _embedding_bag_backward_short,
    "bincount": _bincount_short,
    "index_add": _out_of_place_short(_index_add_short, sums_only=True),
    "scatter_add": _out_of_place_short(_scatter_add_short, sums_only=True),
    "scatter_reduce.two": _out_of_place_short(_scatter_short, sums_only=False),
}

_BODIES = {
    "index_add": _index_add,
    "index_add_": _index_add_inplace,
    "index_add.out": _index_add_out,
    "scatter_add": _scatter_add,
    "scatter_add_": _scatter_add_inplace,
    "scatter_add.out": _scatter_add_out,
    "scatter_reduce.two": _scatter_reduce,
    "scatter_reduce_.two": _scatter_reduce_inplace,
    "scatter_reduce.two_out": _scatter_reduce_out,
    "index_reduce": _index_reduce,
    "index_reduce_": _index_reduce_inplace,
    "index_reduce.out": _index_reduce_out,
    "_index_put_impl_": _index_put,
    "put_": _put,
    "bincount": _bincount,
    "embedding_dense_backward": _embedding_backward,
    "_embedding_bag_dense_backward": _embedding_bag_backward,
    "segment_reduce": _segment_reduce,
    "histc": _histc,
    "histc.out": _histc_out,
}
