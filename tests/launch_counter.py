"""What one detsum call costs on a GPU, counted without one.

A CUDA call is slow for what it asks of the GPU: each kernel it launches, each read of a value
back to the host (a synchronisation). Here the call runs on the path CUDA tensors take: CPU
tensors under the triton backend (Triton's interpreter; tests/conftest.py sets
TRITON_INTERPRET=1), their values checked as a GPU's are (``_segments.GPU_CHECKS_ON_CPU``),
and ``count`` records

- ``launches``: each launch of one of detsum's Triton kernels, (kernel name, grid);
- ``ops``: each aten operator that would be a kernel on a GPU, by name;
- ``allocations``: each tensor asked for by a factory (``empty``, ``zeros``, ...);
- ``host_reads``: each read of a tensor's values into Python from detsum's own code
  (``conftest.host_reads``), and each ``aten._local_scalar_dense`` from anywhere else;
- ``operators``: detsum's own operators dispatched (bookkeeping, no device work of their own).

``device_ops`` (aten compute ops plus Triton launches) is what the issue "One plan, one
launch" budgets. ``ROWS`` holds the calls it budgets; benches/count_calls.py prints their counts
and tests/test_launch_budget.py holds them to today's numbers and to the issue's targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import sys
import unittest.mock
from collections import Counter
from collections.abc import Callable

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import detsum
from conftest import _OWN_CODE, host_reads
from detsum import _segments, moe

# Triton is imported here, after conftest has set TRITON_INTERPRET: the kernels are interpreted.
from detsum.kernels.triton import counting_sort as _triton_counting_sort  # noqa: F401
from detsum.kernels.triton import segment as _triton_segment  # noqa: F401
from detsum.kernels.triton import moe as _triton_moe  # noqa: F401
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


@dataclasses.dataclass
class Counts:
    launches: list[tuple[str, tuple]] = dataclasses.field(default_factory=list)
    ops: Counter = dataclasses.field(default_factory=Counter)
    allocations: Counter = dataclasses.field(default_factory=Counter)
    host_reads: list[str] = dataclasses.field(default_factory=list)
    operators: Counter = dataclasses.field(default_factory=Counter)
    #: The dtype of the keys of each sort, in order: on a GPU a radix sort's passes, and so
    #: its launches, grow with their width (``kernels.NARROW_SORT_ABOVE``).
    sort_keys: list[torch.dtype] = dataclasses.field(default_factory=list)
    #: What the call returned.
    result: object = None

    @property
    def device_ops(self) -> int:
        return sum(self.ops.values()) + len(self.launches)

    def summary(self) -> dict[str, int]:
        """The numbers the budgets hold: each is a count that must not grow."""
        return {"device_ops": self.device_ops, "launches": len(self.launches),
                "aten_ops": sum(self.ops.values()), "host_reads": len(self.host_reads),
                "allocations": sum(self.allocations.values()), "sorts": self.ops["sort"]}


# ---- how an aten operator counts -----------------------------------------------------------------

# Factories that only reserve memory: no kernel runs.
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                "new_empty_strided"}
# Factories that write values as well (a fill, an arange): an allocation and a kernel.
_FILLED_ALLOCATIONS = {"zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones",
                       "full", "full_like", "new_full", "scalar_tensor", "arange"}


def _storage(t: torch.Tensor) -> int:
    # The storage's identity: a view shares it, a fresh tensor (even an empty one) has its own.
    return t.untyped_storage()._cdata


def _no_kernel(func, args, kwargs, result) -> bool:
    """Whether ``func`` runs no kernel: it only made views of its inputs (view, permute,
    expand, detach, and ``to``, ``reshape``, ``_unsafe_view``, ``lift_fresh`` when they copy
    nothing), or it touches no tensor at all (``promote_types``). Decided from the tensors,
    not the names: ``to`` and ``reshape`` copy or not by their arguments. An operator that
    writes in place (``copy_``, ``fill_``) runs a kernel though it returns its input, and so
    does one that reads a tensor and returns none (``_assert_async``)."""
    if func._schema.is_mutable:
        return False
    inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    outputs = [_storage(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
    if not outputs:
        return not inputs
    return all(storage in inputs for storage in outputs)


class _Recorder(TorchDispatchMode):
    """Counts every aten operator the call dispatches, by the rules above, and runs detsum's
    operators and torch's composite ones itself so that what they run inside is counted."""

    def __init__(self, counts: Counts, read_code):
        super().__init__()
        self.counts = counts
        self.read_code = read_code
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "detsum":
            # A mode is taken off the stack while it handles an operator, so what the operator
            # runs inside would go unseen: run detsum's implementation here instead, with the
            # mode back on. It is the Python function that torch.library.custom_op registered
            # for every device (torch 2.13 keeps it in CustomOpDef._backend_fns[None]; detsum
            # registers no kernel for one device): the function a direct call runs, so the
            # operator's path counts what the direct path does.
            self.counts.operators[name] += 1
            kernels = _maybe_get_opdef(func)._backend_fns
            assert set(kernels) == {None}, (func, kernels)
            with self:
                return kernels[None](*args, **kwargs)
        # A composite operator (reshape, where with a scalar, &) reaches the mode whole below
        # autograd, inside an operator, but as what it decomposes into above it, in a direct
        # call; both run the decomposition's kernels. Decomposed here, with the mode on, it
        # counts as those kernels on either path.
        with self:
            result = func.decompose(*args, **kwargs)
        if result is not NotImplemented:
            return result
        result = func(*args, **kwargs)
        if name == "_local_scalar_dense":
            # .item(), int(), bool() of a tensor: a copy to the host and a wait on a GPU.
            if not self._counted_already():
                self.counts.host_reads.append(f"_local_scalar_dense in {_first_own_frame()}")
        elif name in _ALLOCATIONS:
            self.counts.allocations[name] += 1
        elif name in _FILLED_ALLOCATIONS:
            self.counts.allocations[name] += 1
            self.counts.ops[name] += 1
        elif not _no_kernel(func, args, kwargs, result):
            self.counts.ops[name] += 1
            if name == "sort":
                self.counts.sort_keys.append(args[0].dtype)
        return result

    def _counted_already(self) -> bool:
        """Whether this read runs inside a read that ``host_reads`` counted: one made from
        detsum's own code through a replaced Python method (``int(t)``, ``t.item()``)."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is self.read_code:
                return frame.f_back.f_code.co_filename.startswith(_OWN_CODE)
            frame = frame.f_back
        return False


def _first_own_frame() -> str:
    """Where in detsum's own code the call stands now (file and line)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OWN_CODE):
            return f"{pathlib.Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "code outside detsum"


# ---- Triton launches -----------------------------------------------------------------------------

def _detsum_kernels() -> list:
    """Every Triton function of detsum's Triton modules (the kernels and the helpers they
    call; only kernels are ever launched)."""
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("detsum.kernels.triton.")]
    return [value for m in modules for value in vars(m).values()
            if isinstance(value, (JITFunction, InterpretedFunction))]


@contextlib.contextmanager
def _launches_counted(counts: Counts, recorder: _Recorder):
    """Record each launch ``kernel[grid](...)``. Triton's ``__getitem__`` hands the grid to
    ``kernel.run``, compiled (JITFunction) and interpreted (InterpretedFunction) alike, and
    nothing else launches a kernel (a helper called inside one is a plain call), so an
    instance's ``run`` is the one narrowest place that sees every launch and only launches.
    While it runs, the recorder pauses: the interpreter copies the arguments with aten
    operators that are no part of a launch on a GPU."""
    def counted(kernel):
        run = kernel.run

        def launch(*args, grid, warmup, **kwargs):
            if warmup:
                return run(*args, grid=grid, warmup=warmup, **kwargs)
            counts.launches.append((kernel.fn.__name__, tuple(grid)))
            recorder.paused = True
            try:
                return run(*args, grid=grid, warmup=warmup, **kwargs)
            finally:
                recorder.paused = False
        return launch

    with contextlib.ExitStack() as stack:
        for kernel in _detsum_kernels():
            stack.enter_context(unittest.mock.patch.object(kernel, "run", counted(kernel)))
        yield


# ---- counting a call -----------------------------------------------------------------------------

@contextlib.contextmanager
def gpu_path():
    """CPU tensors on the path CUDA tensors take: the triton backend, values checked as a
    GPU's, a long index sorted by counting, and the weighted ``moe.unpermute`` in one pass as
    on a GPU (on the CPU it runs by blocks of tokens, for the cache), past a quarter of the
    keys a GPU sorts as they are (``_NARROW_SORT_ABOVE``). The other choices by device
    (``rule_for``) differ only in "autograd" mode, which no row runs."""
    runs_in_token_blocks = moe._runs_in_token_blocks
    with detsum.backend("triton"), \
            unittest.mock.patch.object(_segments, "GPU_CHECKS_ON_CPU", True), \
            unittest.mock.patch.object(detsum.kernels, "COUNTING_SORT_ON_CPU", True), \
            unittest.mock.patch.object(detsum.kernels, "NARROW_SORT_ABOVE", _NARROW_SORT_ABOVE), \
            unittest.mock.patch.object(
                moe, "_runs_in_token_blocks",
                lambda device, acc_mode: runs_in_token_blocks(torch.device("cuda"), acc_mode)):
        yield


def count(call: Callable[[], torch.Tensor], *, backward: bool = False) -> Counts:
    """Run ``call()`` (then, with ``backward``, the backward of its output from a gradient of
    ones) on the GPU's path and count what it does.

    Under the recorder (a dispatch mode) a public function never takes its direct-call fast
    path (``_dispatch.direct_call_ok`` refuses while a mode is active): it calls its operator,
    whose implementation the recorder runs, and that is the function the direct path calls.
    """
    counts = Counts()

    def on_read(name, caller):
        counts.host_reads.append(f"{name} in {_first_own_frame()}")

    # The launches' ticket counters are made (zeroed) once per device and stream and kept: a
    # cost of the first launch there, not of a call.
    _triton_segment.ticket_counters(torch.device("cpu"), 1)
    # Without the NaN fill of every output that the tests' fixture turns on: no part of a call.
    with gpu_path(), host_reads(on_read), \
            unittest.mock.patch.object(_segments, "POISON_OUTPUTS", False):
        # Every replaced read is one function of conftest's, whose code tells the recorder
        # that a _local_scalar_dense beneath it is counted already.
        recorder = _Recorder(counts, torch.Tensor.item.__code__)
        with _launches_counted(counts, recorder), recorder:
            counts.result = out = call()
            if backward:
                # The output's gradient is the caller's, not the call's work.
                recorder.paused = True
                grad = torch.ones_like(out)
                recorder.paused = False
                out.backward(grad)
    return counts


# ---- the calls the issue budgets ---------------------------------------------------------------

CHECKS = ("host", "device", "off")
# 512 source rows: more than CHUNK_TERMS make the Kahan and fp32 launches split long segments
# into chunks and fold them, as any real size does (kernels/triton/segment.py, "Work split").
_ROWS, _SEGMENTS, _FEATURES = 512, 16, 4
#: The small calls' source rows: at most kernels.CHUNK_TERMS, so the launch scans the
#: unsorted index itself (kernels.UnsortedKeys), with no sort.
_SMALL_ROWS = 200
#: ``kernels.NARROW_SORT_ABOVE`` on the counted calls' path (``gpu_path``): a quarter of it,
#: so that a long call runs the same path in about a quarter of the interpreter's time (the
#: other calls have fewer rows than either).
_NARROW_SORT_ABOVE = detsum.kernels.NARROW_SORT_ABOVE // 4
#: The long calls' source rows: more than that, so the index is sorted as the int16 keys its
#: segments need (two ops more, on a GPU a shorter radix sort).
_LONG_ROWS = _NARROW_SORT_ABOVE + 1
_TOKENS, _TOPK, _EXPERTS = 64, 2, 4


def inputs(backward: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every row's tensors; with ``backward`` the ones a gradient flows to require it."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, _SEGMENTS, (_ROWS,), generator=gen)
    sorted_index = index.sort().values
    t = {
        "src": torch.randn(_ROWS, _FEATURES, generator=gen),
        "init": torch.randn(_SEGMENTS, _FEATURES, generator=gen),
        "work": torch.randn(_SEGMENTS, _FEATURES, generator=gen),  # index_add_'s target
        "index": index,
        "sorted_index": sorted_index,
        "offsets": torch.searchsorted(sorted_index, torch.arange(_SEGMENTS + 1)),
        "selected": torch.randint(0, _EXPERTS, (_TOKENS, _TOPK), generator=gen),
        "x": torch.randn(_TOKENS, _FEATURES, generator=gen),
        "weights": torch.softmax(torch.randn(_TOKENS, _TOPK, generator=gen), -1),
    }
    # route's permutation found by the caller, outside the counted calls: a tensor route never
    # returned.
    t["gather_indices"] = torch.sort(t["selected"].view(-1), stable=True).indices
    # Made once, outside the counted calls (its positions are the same on every backend).
    t["plan"] = detsum.plan(index, _SEGMENTS)
    t["long_index"] = torch.randint(0, _SEGMENTS, (_LONG_ROWS,), generator=gen)
    t["long_src"] = torch.randn(_LONG_ROWS, _FEATURES, generator=gen)
    if backward:
        for name in ("src", "x", "weights"):
            t[name].requires_grad_(True)
    return t


def _segment_sum(t, mode, check):
    return detsum.segment_sum(t["src"], t["offsets"], mode=mode, check=check)


def _index_add(t, mode, check):
    return detsum.index_add(t["init"], 0, t["index"], t["src"], mode=mode, check=check)


def _scatter_reduce(t, mode, check, sorted=False):
    index = t["sorted_index"] if sorted else t["index"]
    return detsum.scatter_reduce(t["init"], 0, index, t["src"], "sum", mode=mode,
                                 sorted=sorted, check=check)


def _small(t, name, mode, check):
    """A small call without a plan: the first _SMALL_ROWS rows of the index and the source."""
    index, src = t["index"][:_SMALL_ROWS], t["src"][:_SMALL_ROWS]
    if name == "index_add":
        return detsum.index_add(t["init"], 0, index, src, mode=mode, check=check)
    if name == "index_add_":
        return detsum.index_add_(t["work"], 0, index, src, mode=mode, check=check)
    return detsum.scatter_reduce(t["init"], 0, index, src, "sum", mode=mode, check=check)


def _long(t, name, check):
    """A call without a plan of _LONG_ROWS rows."""
    if name == "index_add":
        return detsum.index_add(t["init"], 0, t["long_index"], t["long_src"], check=check)
    return detsum.scatter_reduce(t["init"], 0, t["long_index"], t["long_src"], "sum",
                                 check=check)


def _with_plan(t, name, mode):
    """A primitive with ``inputs()``'s plan: its check is the plan's."""
    if name == "segment_sum":
        return detsum.segment_sum(t["src"], mode=mode, plan=t["plan"])
    if name == "index_add":
        return detsum.index_add(t["init"], 0, t["index"], t["src"], mode=mode, plan=t["plan"])
    return detsum.scatter_reduce(t["init"], 0, t["index"], t["src"], "sum", mode=mode,
                                 plan=t["plan"])


def _moe_layer(t, mode, check, given="gather_indices"):
    """route, permute and the weighted unpermute (no expert between: its work is not
    detsum's). The two take route's gather_indices (the default), its Routing itself
    (``"routing"``), or the caller's own gather_indices (``"callers"``: the same permutation,
    found by the caller's sort before the call, which route never returned: permute and
    unpermute check and invert it)."""
    routing = moe.route(t["selected"], _EXPERTS, check=check)
    gather_indices = (routing if given == "routing" else t["gather_indices"]
                      if given == "callers" else routing[0])
    rows = moe.permute(t["x"], gather_indices, _TOPK, mode=mode, check=check)
    return moe.unpermute(rows, gather_indices, _TOPK, weights=t["weights"], mode=mode,
                         check=check)


def _scatter(t, dim_size=None):
    return detsum.scatter(t["src"], t["index"], 0, dim_size=dim_size)


@dataclasses.dataclass(frozen=True)
class Row:
    call: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    #: The call's check level, or "plan" for a call with a plan (made at "host" beforehand).
    check: str
    backward: bool = False


def _rows() -> dict[str, Row]:
    rows = {}
    for name, call in (("segment_sum", _segment_sum), ("index_add", _index_add),
                       ("scatter_reduce", _scatter_reduce)):
        for mode in ("fp32", "kahan"):
            for check in CHECKS:
                rows[f"{name} {mode} {check}"] = Row(
                    functools.partial(call, mode=mode, check=check), check)
    for name in ("index_add", "index_add_", "scatter_reduce"):
        for check in CHECKS:
            rows[f"{name} fp32 {check} small"] = Row(
                functools.partial(_small, name=name, mode="fp32", check=check), check)
    for name in ("index_add", "scatter_reduce"):
        for check in CHECKS:
            rows[f"{name} fp32 {check} long"] = Row(
                functools.partial(_long, name=name, check=check), check)
    for check in CHECKS:
        rows[f"scatter_reduce sorted fp32 {check}"] = Row(
            functools.partial(_scatter_reduce, mode="fp32", check=check, sorted=True), check)
    for name, call in (("segment_sum", _segment_sum), ("index_add", _index_add),
                       ("scatter_reduce", _scatter_reduce), ("moe layer", _moe_layer)):
        for check in CHECKS:
            rows[f"{name} fp32 {check} +backward"] = Row(
                functools.partial(call, mode="fp32", check=check), check, backward=True)
    for given, suffix in (("routing", "routed"), ("callers", "caller's index")):
        for check in CHECKS:
            rows[f"moe layer fp32 {check} {suffix} +backward"] = Row(
                functools.partial(_moe_layer, mode="fp32", check=check, given=given), check,
                backward=True)
    for name in ("segment_sum", "index_add", "scatter_reduce"):
        for mode in ("fp32", "kahan", "autograd", "exact"):
            rows[f"{name} {mode} plan"] = Row(
                functools.partial(_with_plan, name=name, mode=mode), "plan")
        rows[f"{name} fp32 plan +backward"] = Row(
            functools.partial(_with_plan, name=name, mode="fp32"), "plan", backward=True)
    # torch_scatter's API takes no check: it reads its index back as "host" does.
    rows["scatter sum"] = Row(_scatter, "host")
    rows["scatter sum dim_size"] = Row(functools.partial(_scatter, dim_size=_SEGMENTS), "host")
    return rows


#: name -> the call (of ``inputs()``). A row more is one line more in ``_rows``.
ROWS: dict[str, Row] = _rows()


def count_row(name: str) -> Counts:
    row = ROWS[name]
    t = inputs(row.backward)
    return count(lambda: row.call(t), backward=row.backward)
