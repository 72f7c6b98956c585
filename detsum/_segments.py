"""What the three primitives share: the [outer, rows, inner] view, the segment plan, the launch.

Every primitive is a segmented reduction: output row ``s`` (along ``dim``) reduces an ordered
list of source rows. ``order`` and ``offsets`` describe those lists in CSR form, built by one
stable pass over the index (its order *is* the canonical order of the determinism contract).
"""

from __future__ import annotations

import functools
import math

import torch

from detsum import kernels
from detsum._validation import (address_ranges_meet, assert_on_device, device_check_message,
                                raise_first_out_of_range, raise_index_out_of_range)
from detsum.backend import _DEFAULT_BY_DEVICE, _forced_backend, check_backend_runs

#: Tests set this to True: every output is NaN-filled before a kernel writes it, so an element
#: a kernel forgets to write fails the bitwise comparison instead of passing by luck.
POISON_OUTPUTS = False

#: Tests set this to True: CPU tensors under the triton and reference backends are then checked
#: as a GPU's are (``"device"`` on the device, ``"off"`` not at all, a bad value giving what
#: ``"off"`` promises for it), so that the GPU's path runs on the CPU, in Triton's interpreter.
#: Otherwise every level checks CPU tensors as ``"host"`` does (``check_that_runs``).
GPU_CHECKS_ON_CPU = False


def check_that_runs(check: str, device_type: str, backend_name: str) -> str:
    """The check level a primitive applies: ``check`` on a GPU; ``"host"`` on the CPU whatever
    ``check`` says (a host read costs no synchronisation there, and the Numba kernels must
    never read outside a tensor), except under ``GPU_CHECKS_ON_CPU`` for the backends a GPU
    runs."""
    if device_type == "cpu" and (backend_name == "numba" or not GPU_CHECKS_ON_CPU):
        return "host"
    return check


def launches_on_triton(device_type: str) -> bool:
    """Whether a primitive's call on ``device_type`` tensors runs the triton backend now
    (``detsum.backend.current_backend``'s choice, without its check that the backend runs
    them: the call makes that check itself)."""
    return (_forced_backend.get() or _DEFAULT_BY_DEVICE.get(device_type)) == "triton"


def launch_settings() -> tuple:
    """The settings that choose a primitive's path besides its arguments: the backend in force
    (``detsum.backend``) and ``GPU_CHECKS_ON_CPU``."""
    return _forced_backend.get(), GPU_CHECKS_ON_CPU


def backward_check(check: str, device_type: str) -> str:
    """The check level whose values a backward pass sees: ``check_that_runs`` of its forward,
    independent of the backend (a backward under ``GPU_CHECKS_ON_CPU`` allows for unchecked
    values even where the forward checked them: the checked values give the same result)."""
    if device_type == "cpu" and not GPU_CHECKS_ON_CPU:
        return "host"
    return check


def clamped_index(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``index`` clamped into ``[0, size)``, the mask of its values already there), for a
    backward that gathers with an index its forward did not check: every gather stays inside
    its tensor, and the mask says which positions the forward left out. ``size > 0``."""
    return index.clamp(0, size - 1), (index >= 0) & (index < size)


def unchecked_offsets(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Offsets as a launch on unchecked values takes them: clamped into ``[0, num_rows]`` and
    made nondecreasing (each the largest value up to it). Valid offsets are left as they are;
    any others still make segments that lie inside the rows. Torch ops on the device: no host
    read."""
    return torch.cummax(offsets.to(torch.int64).clamp(0, num_rows), 0).values


def index_as_planned(index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The output row each source row is reduced into under a ``sorted=True`` plan that was not
    checked: the plan's offsets are ``torch.searchsorted(index, s)`` for each ``s`` in
    ``0 .. num_segments`` (never read outside the index, and nondecreasing for any index, sorted
    or not: a binary search's answer grows with the value sought), and position ``p`` belongs
    to the segment ``s`` with ``offsets[s] <= p < offsets[s + 1]``. -1 or ``num_segments`` (out
    of range: reduced into no row) for the positions before the first or after the last
    segment. For a sorted index in range, ``index`` itself."""
    boundaries = torch.arange(num_segments + 1, dtype=index.dtype, device=index.device)
    offsets = torch.searchsorted(index.contiguous(), boundaries)
    positions = torch.arange(index.numel(), dtype=torch.int64, device=index.device)
    return torch.searchsorted(offsets, positions, right=True) - 1


def rows_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[outer, t.size(dim), inner]``; a view whenever the strides allow one."""
    if dim == 0 and t.dim() == 2:
        return t[None]  # the same view, for a fraction of reshape's (and unsqueeze's) cost
    outer = math.prod(t.shape[:dim])
    inner = math.prod(t.shape[dim + 1:])
    return t.reshape(outer, t.shape[dim], inner)


def new_output_like(like3: torch.Tensor) -> torch.Tensor:
    """``new_output(like3, like3.shape[1])``, in a third less time on a small call."""
    out = torch.empty_like(like3, memory_format=torch.contiguous_format)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def small_index_add(caller: str, source3: torch.Tensor, index: torch.Tensor,
                    input3: torch.Tensor, out3: torch.Tensor | None, alpha: float, rule: int,
                    size_name: str) -> torch.Tensor | None:
    """``out3`` (a new output when None; it may be ``input3`` itself) holding ``input3`` with
    ``alpha * source3``'s rows added at ``index``, in one Numba call without a plan
    (``kernels/numba/small.py``: the general path's bits), or None, nothing written, where
    that call does not fit (an output row of more than CHUNK_TERMS terms among them). A value
    of ``index`` outside ``input3``'s rows raises in ``caller``'s words, nothing written."""
    small = _small_kernels()
    # A new output is contiguous, of input3's shape: input3 answers for it.
    if not small.fits(source3, input3, input3 if out3 is None else out3, rule):
        return None
    written = new_output_like(input3) if out3 is None else out3
    answer = small.index_add_small(source3, index, input3, written, alpha, rule)
    if answer == small.TOO_MANY_TERMS:
        return None
    if answer >= 0:
        raise_index_out_of_range(caller, "index", index, answer, input3.shape[1], size_name)
    return written


def streamed_scatter(caller: str, source3: torch.Tensor, index: torch.Tensor,
                     input3: torch.Tensor, out3: torch.Tensor | None, reduce: str,
                     include_base: bool, rule: int, size_name: str) -> torch.Tensor | None:
    """``out3`` (a new output when None; it may be ``input3`` itself) holding ``input3``'s
    rows reduced with ``source3``'s rows at the 1-D ``index`` (``reduce`` under ``rule``,
    from each row's own value under ``include_base``), from one pass over ``source3`` and
    ``index`` without a plan, or None, nothing written, where that pass is not the faster:
    rows of one element and one outer index (a 1-D ``index_add``, ``scatter_add``,
    ``bincount``), at most as many output rows as terms, under a rule but EXACT. The pass is
    one of ``kernels.numba.small``'s one-column kernels for a contiguous source, at any size,
    else, from ``_MIN_STREAMED_TERMS`` terms, ``kernels.numba.scatter``'s elementwise scatter
    with ``index`` as each element's output row: each gives each output element the terms,
    order and arithmetic of the plan's launch (the same bits). Against the plan's path (a
    counting sort, then the launch) the scatter's index_add took 0.2-0.6x the time from 50k
    to 3M terms on two threads, as much at 20k; a one-column kernel took a switched 1-D
    product of 10k terms from 192 to 104 us (benches/NOTES.md); with a slice of several
    elements, or several outer indices, the plan's launch is the faster. A value of
    ``index`` outside ``input3``'s rows raises in ``caller``'s words, nothing written."""
    outer, rows, inner = input3.shape
    terms = source3.shape[1]
    if not (outer == 1 and inner == 1 and 0 < rows <= terms and rule in _STREAMED_RULES):
        return None
    if reduce == "sum" and include_base and source3.is_contiguous() and input3.is_contiguous():
        # A sum is one serial pass (``small.index_add_one_column``), 0.2-0.7x the scatter's
        # time (which counts every term and sums the rows of more than a chunk again).
        written = new_output_like(input3) if out3 is None else out3
        small = _small_kernels()
        answer = small.index_add_one_column(source3, index, input3, written, rule)
        if answer >= 0:
            raise_index_out_of_range(caller, "index", index, answer, rows, size_name)
        return written
    if reduce in ("amax", "amin") and source3.is_contiguous() and (
            out3 is None or out3.is_contiguous()):
        # A max or min, which no rule splits: one serial pass (``small.extreme_one_column``).
        written = new_output_like(input3) if out3 is None else out3
        answer = _small_kernels().extreme_one_column(
            source3, index, input3.contiguous(), written, reduce == "amax", include_base)
        if answer >= 0:
            raise_index_out_of_range(caller, "index", index, answer, rows, size_name)
        return written
    if reduce in ("sum", "mean", "prod") and source3.is_contiguous() and (
            out3 is None or out3.is_contiguous()):
        # A sum without the input's values, a mean, a product: one serial pass too
        # (``small.reduce_one_column``), the scatter's variant.
        small = _small_kernels()
        written = new_output_like(input3) if out3 is None else out3
        answer = small.reduce_one_column(source3, index, input3.contiguous(), written,
                                         kernels.REDUCE_CODES[reduce], rule, include_base)
        if answer != small.TOO_MANY_TERMS:
            if answer >= 0:
                raise_index_out_of_range(caller, "index", index, answer, rows, size_name)
            return written
    if terms < _MIN_STREAMED_TERMS:
        return None
    from detsum.kernels.numba.scatter import scatter_elements

    # The scatter writes an output other than its base: in place, a new one copied back.
    written = new_output_like(input3)
    if scatter_elements(source3, index.view(1, terms, 1), input3, written,
                        reduce=kernels.REDUCE_CODES[reduce], rule=rule,
                        include_base=include_base):
        raise_first_out_of_range(caller, "index", index, rows, size_name)
    if out3 is None:
        return written
    return out3.copy_(written)


#: The rules ``streamed_scatter`` takes: every rule of the elementwise scatter.
_STREAMED_RULES = (kernels.WIDE, kernels.KAHAN, kernels.ROUND_EACH)
#: Fewest terms ``streamed_scatter`` hands the elementwise scatter (a strided source): below,
#: the plan's path was as fast or faster.
_MIN_STREAMED_TERMS = 1 << 15


def small_scatter_reduce(caller: str, source3: torch.Tensor, index: torch.Tensor,
                         input3: torch.Tensor, reduce: str, include_base: bool, rule: int,
                         size_name: str) -> torch.Tensor | None:
    """A new output holding ``input3`` with each row that ``index`` names reduced with
    ``source3``'s rows there ("mean" under ``rule``, "amax" or "amin"; from its own values
    first under ``include_base``), the others as they were, in one Numba call
    (``kernels.numba.small``'s ``mean_small_in_place`` and ``extreme_small_in_place`` into a
    copy of ``input3``: the general path's bits), or None where that call does not fit (a
    mean's row of more than CHUNK_TERMS terms under a rule that splits among them). A value
    of ``index`` outside ``input3``'s rows raises in ``caller``'s words."""
    small = _small_kernels()
    if not (small.fits(source3, input3, input3, rule) and source3.numel() > 0
            and input3.numel() > 0):
        return None
    out3 = new_output_like(input3)
    out3.copy_(input3)
    outer, rows, inner = out3.shape
    if reduce == "mean":
        answer = small.mean_small_in_place(source3, index, out3, outer, inner, include_base,
                                           rule)
    else:
        answer = small.extreme_small_in_place(source3, index, out3, outer, inner,
                                              reduce == "amax", include_base)
    if answer == small.TOO_MANY_TERMS:
        return None
    if answer >= 0:
        raise_index_out_of_range(caller, "index", index, answer, rows, size_name)
    return out3


def numba_runs_cpu_tensors() -> bool:
    """Whether the Numba backend runs CPU tensors now (the default, or forced)."""
    return (_forced_backend.get() or _DEFAULT_BY_DEVICE["cpu"]) == "numba"


def small_segment_reduce(source3: torch.Tensor, bounds: torch.Tensor, reduce: str, rule: int,
                         lengths: bool = False, empty_nan: bool = False
                         ) -> torch.Tensor | None:
    """A new ``[outer, S, inner]`` output holding ``source3``'s segments of rows reduced
    (``reduce`` "sum", "mean", "amax" or "amin"; from +0.0, -inf or +inf; an empty segment's
    mean NaN with ``empty_nan``, else 0), in one Numba call
    (``kernels.numba.small.segment_reduce_small``: the segment kernel's bits), or None where
    that call does not fit (a launch too large, a layout or rule it has not, a segment of
    more than CHUNK_TERMS rows where a rule splits it) or the bounds do not tile
    ``source3``'s rows: the caller's general path then names them. ``bounds``: 1-D, the
    ``S + 1`` CSR offsets, or with ``lengths`` the ``S`` lengths of the segments."""
    small = _small_kernels()
    code = kernels.REDUCE_CODES[reduce]
    segments = bounds.shape[0] if lengths else bounds.shape[0] - 1
    outer, _, inner = source3.shape
    if not ((rule in small.RULES or code in (kernels.AMAX, kernels.AMIN))
            and code in small.SEGMENT_REDUCTIONS and source3.is_contiguous()
            and source3.numel() > 0 and segments > 0
            and source3.numel() + outer * segments * inner <= small.MAX_ELEMENTS):
        return None
    out3 = new_output(source3, segments)
    if small.segment_reduce_small(source3, bounds, out3, code, rule, lengths, empty_nan) == -1:
        return out3
    return None


def small_reduce_in_place(target: torch.Tensor, dim: int, index: torch.Tensor,
                          source: torch.Tensor, reduce: str, include_base: bool, alpha: float,
                          rule: int) -> bool:
    """Whether ``target`` (a CPU tensor) was reduced in place with ``source``'s rows along
    ``dim`` at the 1-D ``index`` in one Numba call: ``reduce`` "sum" (from ``target``,
    ``include_base`` True, the terms scaled by ``alpha`` under ``rule``: ``small_index_add``),
    "mean" under ``rule`` (``kernels.numba.small.mean_small_in_place``), "amax" or "amin"
    (``extreme_small_in_place``). That is where the primitives' own paths give the call the
    same bits: the Numba backend runs CPU tensors now, and the call fits (a contiguous target,
    small, and for a sum or a mean no output row of more terms than one chunk under a rule
    that splits, but a sum or mean of one column, whose one pass takes rows of any length).
    A source of other strides (the expanded gradient of a sum, say) is read from a contiguous
    copy; an index that feeds few of the target's rows, which the primitive's path reduces
    on their own (``rows_with_terms``: the same bits), takes the one call too. False,
    nothing written, otherwise, where ``target`` may share memory with ``index`` or
    ``source`` (their address ranges meet), and where a value of ``index`` is out of range:
    the caller's own path then finds it and names it as its caller passed it.

    For callers that have checked everything else already (the switch: the shapes, dtypes and
    devices torch would check, and that ``target`` may be changed), skipping the layers the
    general entry points pass through on every call."""
    small = _small_kernels()
    if not numba_runs_cpu_tensors() or not (
            source.numel() + target.numel() <= small.MAX_ELEMENTS and target.is_contiguous()):
        return False
    # A contiguous target's elements are distinct; the others' may not share its memory.
    if address_ranges_meet(target, source) or address_ranges_meet(target, index):
        return False
    if not source.is_contiguous():
        source = source.contiguous()
    rows = target.shape[dim]
    outer = 1 if dim == 0 else math.prod(target.shape[:dim])
    inner = target.numel() // (outer * rows)
    # -1: written; a bad value's position, or for a sum TOO_MANY_TERMS: nothing written.
    if outer == 1 and inner == 1 and (reduce in ("amax", "amin") or rule in small.RULES and (
            reduce == "mean" or reduce == "sum" and include_base)):
        # One column, rows of any length, in one pass (the same bits).
        if reduce == "sum":
            return small.index_add_one_column(source, index, target, target, rule, alpha) == -1
        if reduce == "mean":
            return small.reduce_one_column(source, index, target, target, small.MEAN, rule,
                                           include_base) == -1
        return small.extreme_one_column(source, index, target, target, reduce == "amax",
                                        include_base) == -1
    if reduce == "sum" and include_base and rule in small.RULES:
        return small.index_add_small_in_place(source, index, target, outer, inner, alpha,
                                              rule) == -1
    if reduce in ("amax", "amin"):
        return small.extreme_small_in_place(source, index, target, outer, inner,
                                            reduce == "amax", include_base) == -1
    if reduce == "mean" and rule in small.RULES:
        return small.mean_small_in_place(source, index, target, outer, inner, include_base,
                                         rule) == -1
    return False


@functools.cache
def _small_kernels():
    """``kernels.numba.small``, imported on the first small call (it imports Numba)."""
    from detsum.kernels.numba import small

    return small


def histogram(values: torch.Tensor, left: float, right: float, width: float, scale: float,
              bins: int) -> torch.Tensor:
    """The ``bins`` int64 counts of CPU tensor ``values``'s elements in torch's CPU
    ``histc`` bins over these edges (``kernels.numba.small.histogram``: each element's bin
    ``(x - left) * scale / width`` in the dtype's arithmetic, NaN and elements outside
    ``[left, right]`` left out), in one pass."""
    return _small_kernels().histogram(values.reshape(-1).contiguous(), left, right, width,
                                      scale, bins)


def new_output_shaped(like: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A new contiguous output of ``shape`` with ``like``'s dtype and device, as
    ``new_output`` makes one (poisoned under ``POISON_OUTPUTS``)."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def new_output(like3: torch.Tensor, num_segments: int) -> torch.Tensor:
    # Sizes one by one: torch parses them faster than a tuple.
    out = torch.empty(like3.shape[0], num_segments, like3.shape[2], dtype=like3.dtype,
                      device=like3.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def one_segment(num_rows: int, device: torch.device) -> torch.Tensor:
    """Offsets ``[0, num_rows]``: every row in one segment. Built on the device by a kernel, not
    copied from the host: a host-to-device copy would wait for the stream on every call."""
    return torch.arange(2, dtype=torch.int64, device=device) * num_rows


def plan_from_index(caller: str, index: torch.Tensor, num_segments: int, *,
                    index_name: str, size_name: str, promised_sorted: bool, backend_name: str,
                    check: str = "host", as_keys: bool = False
                    ) -> tuple[torch.Tensor | None,
                               torch.Tensor | kernels.SortedKeys | kernels.UnsortedKeys]:
    """(order, offsets) of the segments that a 1-D ``index`` defines, after checking its values
    as ``check`` says (``_validation.check_level``).

    The plan is built where the kernels run: the Numba backend takes a stable counting sort
    that validates the index in the same pass (its caller passes ``check_that_runs``, "host"
    on the CPU); every other backend (the GPU first of all) takes torch ops on the index's
    device (``_device_plan``). A promised-sorted index needs no order: its segments are
    contiguous.

    Unchecked values ("device", "off") still give a plan inside every tensor: segments whose
    positions lie in ``[0, len(index))``, nondecreasing offsets. A value outside
    ``[0, num_segments)`` is sorted before the first segment or after the last, so its row is
    in none; a broken ``sorted=True`` promise gives the segments of ``index_as_planned``.

    ``as_keys``: for a launch on the triton backend, which finds the segments' bounds itself
    in the sorted keys (``kernels.SortedKeys``) and checks them ("device"; a promised-sorted
    index at "host" too): no offsets computed here. An unsorted index of at most
    ``kernels.CHUNK_TERMS`` values is not even sorted: it goes to the launch as it is
    (``kernels.UnsortedKeys``, no order), checked there too, at "host" by one read of the
    launch's verdict (a launch that finds a bad key writes nothing, so an in-place call
    raises with the caller's tensor untouched). Other backends are given offsets.
    """
    if backend_name != "numba" or index.device.type != "cpu":
        if as_keys and scans_index(backend_name, index, promised_sorted):
            return None, _small_unsorted_keys(caller, index, num_segments, index_name=index_name,
                                              size_name=size_name, check=check)
        return _device_plan(caller, index, num_segments, index_name=index_name,
                            size_name=size_name, promised_sorted=promised_sorted, check=check,
                            as_keys=as_keys and backend_name == "triton")
    from detsum.kernels.numba import plan

    if promised_sorted:
        offsets, first_bad, first_unsorted = plan.check_sorted_offsets(index, num_segments)
        if first_bad >= 0:
            raise_index_out_of_range(caller, index_name, index, first_bad, num_segments, size_name)
        if first_unsorted >= 0:
            _raise_unsorted(caller, index_name, index, first_unsorted)
        return None, offsets
    order, offsets, first_bad = plan.counting_sort(index, num_segments)
    if first_bad >= 0:
        raise_index_out_of_range(caller, index_name, index, first_bad, num_segments, size_name)
    return order, offsets


#: An output with more than this many rows per source row is planned over the rows that
#: receive terms alone (``rows_with_terms``): the plan and the launch then cost O(N log N) in
#: the N source rows instead of O(S) in the S output rows, and the other rows are a copy.
SPARSE_ROWS_PER_SOURCE_ROW = 8


def rows_with_terms(caller: str, index: torch.Tensor, num_segments: int, *, index_name: str,
                    size_name: str, check: str = "host"
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a 1-D ``index`` that feeds few of ``num_segments`` output rows: (the output rows
    that receive terms, ascending; each source row's position among them), after checking
    ``index``'s values. None when most rows receive terms (plan them all), and whenever
    ``check`` is not "host": the number of rows with terms is a host read.

    Every output row's result depends only on its own base row and terms, in order of
    appearance; the positions keep that order (a stable plan of them is the same order), so
    computing the rows with terms on their own gives the same bits.
    """
    if check != "host" or num_segments <= SPARSE_ROWS_PER_SOURCE_ROW * index.numel():
        return None
    targets, positions = torch.unique(index, sorted=True, return_inverse=True)
    if targets.numel():
        low, high = targets[[0, -1]].tolist()
        if low < 0 or high >= num_segments:
            raise_first_out_of_range(caller, index_name, index, num_segments, size_name)
    return targets.to(torch.int64), positions


def _raise_unsorted(caller: str, index_name: str, index: torch.Tensor, position: int):
    raise ValueError(
        f"{caller}: sorted=True but {index_name} decreases at position {position} "
        f"({int(index[position - 1])} then {int(index[position])}); "
        f"expected a nondecreasing index, or pass sorted=False")


def check_sorted(caller: str, index: torch.Tensor, num_segments: int, *, index_name: str,
                 size_name: str) -> None:
    """Check a promised-sorted index on the host (one read), raising the error of its first
    bad value: out of range first, then decreasing. An empty index is sorted and in range."""
    if not index.numel():
        return
    decreasing = (index[1:] < index[:-1]).any()
    # A nondecreasing index lies in range when its two ends do: one read of the three.
    low, high, bad_order = torch.stack([index[0], index[-1],
                                        decreasing.to(index.dtype)]).tolist()
    if low < 0 or high >= num_segments or (
            bad_order and bool(((index < 0) | (index >= num_segments)).any())):
        raise_first_out_of_range(caller, index_name, index, num_segments, size_name)
    if bad_order:
        first = int((index[1:] < index[:-1]).nonzero()[0]) + 1
        _raise_unsorted(caller, index_name, index, first)


def scans_index(backend_name: str, index: torch.Tensor, promised_sorted: bool) -> bool:
    """Whether the launch takes this 1-D index unsorted, as it is (``plan_from_index``'s
    ``kernels.UnsortedKeys``): on the triton backend, at most CHUNK_TERMS values not promised
    sorted. Every output row is then written by the launch, none left to a copy."""
    return (backend_name == "triton" and not promised_sorted
            and 0 < index.numel() <= kernels.CHUNK_TERMS)


def _small_unsorted_keys(caller: str, index: torch.Tensor, num_segments: int, *,
                         index_name: str, size_name: str, check: str
                         ) -> kernels.UnsortedKeys:
    """``plan_from_index``'s unsorted index of at most CHUNK_TERMS values, with its check."""
    in_range = f"{index_name} has a value outside [0, {size_name} = {num_segments})"

    def host_check() -> None:
        low, high = torch.stack(torch.aminmax(index)).tolist()
        if low < 0 or high >= num_segments:
            raise_first_out_of_range(caller, index_name, index, num_segments, size_name)

    failure = {"off": None, "host": host_check,
               "device": device_check_message(caller, in_range)}[check]
    return kernels.UnsortedKeys(index, num_segments, failure)


def _device_plan(caller: str, index: torch.Tensor, num_segments: int, *, index_name: str,
                 size_name: str, promised_sorted: bool, check: str, as_keys: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor | kernels.SortedKeys]:
    """The plan from torch ops on the index's device, with one host read (the validation) under
    check="host" and none otherwise.

    A stable sort (``kernels.sort_by_segment``: of keys narrowed to the segments' range, as
    torch's sort of the index would order them) gives the canonical order (positions in
    order of appearance within a value), and the sorted values give the offsets by a binary
    search per segment boundary: neither needs the host. The sort already yields the smallest
    and largest value (clamped into ``[-1, num_segments]``: out of range exactly when the
    index's are), so validating costs no extra pass over the index, just the one read of
    those two numbers; a promised-sorted index is checked by one pass for its order and a
    read of that with its two ends, or, given as keys to a launch, by that launch (no op
    here; at "host" a read of its verdict). Bad values are located (a slower, second look)
    only to write the error message.
    """
    if index.numel() == 0:
        return (None if promised_sorted else index.new_empty(0, dtype=torch.int64),
                torch.zeros(num_segments + 1, dtype=torch.int64, device=index.device))
    in_range = f"{index_name} has a value outside [0, {size_name} = {num_segments})"
    if promised_sorted:
        host_check = functools.partial(check_sorted, caller, index, num_segments,
                                       index_name=index_name, size_name=size_name)
        if as_keys:
            # The launch checks every value itself: one assert, or one read of its verdict.
            failure = {"off": None, "host": host_check,
                       "device": device_check_message(
                           caller, f"{in_range} or decreases somewhere (sorted=True)")}[check]
            return None, kernels.SortedKeys(index, num_segments, failure, every_key=True)
        offsets = kernels.SortedKeys(index, num_segments).offsets()
        if check == "device":
            out_of_range = ((index < 0) | (index >= num_segments)).any()
            assert_on_device(~out_of_range, caller, in_range)
            assert_on_device(~(index[1:] < index[:-1]).any(), caller,
                             f"sorted=True but {index_name} decreases somewhere")
        elif check == "host":
            host_check()
        return None, offsets
    values, order, made_offsets = kernels.sort_by_segment_with_offsets(index, num_segments)
    if check == "device" and as_keys:
        # The launch checks the sorted values' two ends itself, on the device.
        return order, kernels.SortedKeys(values, num_segments,
                                         device_check_message(caller, in_range),
                                         known_offsets=made_offsets)
    if check == "device":
        assert_on_device((values[0] >= 0) & (values[-1] < num_segments), caller, in_range)
    elif check == "host":
        low, high = values[[0, -1]].tolist()
        if low < 0 or high >= num_segments:
            raise_first_out_of_range(caller, index_name, index, num_segments, size_name)
    keys = kernels.SortedKeys(values, num_segments, known_offsets=made_offsets)
    return order, keys if as_keys else keys.offsets()


def plan_from_keys(keys: torch.Tensor, num_segments: int, backend_name: str, *,
                   as_keys: bool = False
                   ) -> tuple[torch.Tensor | None,
                              torch.Tensor | kernels.SortedKeys | kernels.UnsortedKeys]:
    """(order, offsets) for 1-D ``keys`` already known to lie in ``[0, num_segments)``;
    ``as_keys``: as ``plan_from_index`` says (at most CHUNK_TERMS keys: unsorted, no order)."""
    if as_keys and scans_index(backend_name, keys, False):
        return None, kernels.UnsortedKeys(keys, num_segments)
    if backend_name != "numba" or keys.device.type != "cpu":
        order, sorted_keys = kernels.sorted_keys(keys, num_segments)
        return order, (sorted_keys if as_keys and backend_name == "triton"
                       else sorted_keys.offsets())
    from detsum.kernels.numba import plan

    order, offsets, _ = plan.counting_sort(keys, num_segments)
    return order, offsets


def launch(backend_name: str, src3: torch.Tensor, order: torch.Tensor | None,
           offsets: torch.Tensor, base3: torch.Tensor | None, out3: torch.Tensor, *,
           reduce: str, rule: int, alpha: float, include_base: bool,
           carry3: torch.Tensor | None = None,
           chunks: tuple[torch.Tensor, int] | None = None,
           keys: torch.Tensor | None = None) -> None:
    """Run the segmented reduction on ``backend_name``'s kernel, writing ``out3`` (and
    ``carry3``, the Kahan compensation of a running sum: see the kernels' contract).
    ``keys``: the index ``order`` and ``offsets`` were planned from (a plan's), which the
    triton backend's long segments find their chunks by; no result depends on it."""
    check_backend_runs(backend_name, src3.device.type, "detsum")
    segment_reduce = _LAUNCHERS.get(backend_name) or _launcher(backend_name)
    if src3.shape[2] == 1 and src3.shape[0] > 1 and rule != kernels.CUDA_STRIDE_1:
        # One element per row (reducing the last dim): the outer index becomes the column index
        # of a [1, rows, outer] view, so a kernel step combines `outer` elements instead of one.
        # Each output element still sums its own terms in the same order: the same bits.
        src3, out3 = src3.permute(2, 1, 0), out3.permute(2, 1, 0)
        base3 = None if base3 is None else base3.permute(2, 1, 0)
        carry3 = None if carry3 is None else carry3.permute(2, 1, 0)
    guide = {} if keys is None or backend_name != "triton" else {"keys": keys}
    segment_reduce(src3, order, offsets, base3, out3, reduce=kernels.REDUCE_CODES[reduce],
                   rule=rule, alpha=alpha, include_base=include_base, carry=carry3,
                   chunks=chunks, **guide)


#: Each backend's ``segment_reduce``, imported at its first launch (an import statement costs
#: a small call's launch about a microsecond even when the module is loaded).
_LAUNCHERS: dict[str, object] = {}


def _launcher(backend_name: str):
    if backend_name == "numba":
        from detsum.kernels.numba.segment import segment_reduce
    elif backend_name == "triton":
        try:
            from detsum.kernels.triton.segment import segment_reduce
        except ImportError as error:
            raise ImportError("the triton backend needs the triton package "
                              "(pip install 'detsum[triton]')") from error
    else:
        raise AssertionError(f"no kernel launcher for backend {backend_name!r}")
    _LAUNCHERS[backend_name] = segment_reduce
    return segment_reduce
