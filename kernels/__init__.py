"""Device kernels behind detsum's primitives.

Every backend exposes one launcher with the same signature, ``segment_reduce`` (see
``detsum.kernels.numba.segment`` for the contract), that writes a segmented reduction into a
preallocated output. The arithmetic of each rule is defined in the determinism
contract (``docs/determinism.md``) and picked in ``detsum/modes.py``; the integer codes below are the only thing the kernels see of it.
"""

import dataclasses
from collections.abc import Callable

import torch

# Arithmetic rules. A mode resolves to one rule per (reduction, dtype, device, slice size) in
# detsum.modes. WIDE and KAHAN define the "fp32" and "kahan" modes and split long segments into
# chunks (CHUNK_TERMS), as part of their arithmetic. EXACT's result has no order, so a backend
# may split a segment anywhere (the Triton one does, in chunks of its own). The other rules
# reproduce torch and never split.

#: acc = acc_type(init); acc = RN_acc(acc + term) per row; out = RN_dtype(acc).
WIDE = 0
#: Neumaier-compensated sum in the acc type; out = RN_dtype(s + c), or RN_dtype(s) when s is not
#: finite or c == 0 (so a sum of -0.0 stays -0.0).
KAHAN = 1
#: acc = init; acc = RN_dtype(acc + RN_dtype(term)) per row: torch's CPU index_put_ and CUDA
#: indexing_backward_kernel (slice size > 32). For MEAN: the wide sum rounded to the dtype, then
#: divided by the count rounded to the dtype (torch's CPU scatter_reduce mean, which counts in
#: the dtype: 257 terms are 256 in bfloat16). For PROD, AMAX, AMIN: the unsplit serial order.
ROUND_EACH = 2
#: g = 0; g = RN_acc(g + RN_dtype(term)) per row; out = RN_dtype(acc_type(init) + g): torch's CUDA
#: indexing_backward_kernel_small_stride (slice size 2..32). SUM only.
CUDA_SMALL_STRIDE = 3
#: torch's CUDA indexing_backward_kernel_stride_1 (slice size 1): CUDA_SMALL_STRIDE below 32
#: terms; from 32 terms, 32 lane sums, a shuffle-down tree and a serial tail (see
#: detsum/reference.py). SUM only, and only for inner size 1.
CUDA_STRIDE_1 = 4
#: The exact sum of init and terms, rounded once to the dtype (ties to even); MEAN: the exact
#: sum divided by the count, rounded once. No order: any order, split or schedule gives the
#: same bits. SUM and MEAN only (see EXACT STATE below for how kernels compute it).
EXACT = 5

RULE_NAMES = {WIDE: "wide", KAHAN: "kahan", ROUND_EACH: "round_each",
              CUDA_SMALL_STRIDE: "cuda_small_stride", CUDA_STRIDE_1: "cuda_stride_1",
              EXACT: "exact"}

# Where each rule is written: once in the oracle (detsum/reference.py, on purpose a copy of its
# own), once per backend, and the tests that hold the bits of each against the oracle.
# - WIDE: reference.py::_wide; numba/segment.py::_make_rows (OP_ADD, with scatter.py and
#   small.py's loops); triton/common.py::_combine. Tests: test_kernels_numba.py::
#   test_against_reference, test_triton.py::test_long_segments.
# - KAHAN: reference.py::_neumaier and _kahan; numba/common.py::neumaier and kahan_result (the
#   final step, for every Numba kernel); triton/common.py::_combine and _finish; a running
#   sum's final step on any device: detsum/_kernel_ops.py::kahan_result. Tests:
#   test_reference.py::test_kahan_non_finite_and_signed_zero, test_kernels_numba.py::
#   test_nonfinite, test_triton.py::test_index_add_inplace_and_special_values,
#   test_running_sum.py::test_special_values.
# - ROUND_EACH: reference.py::_round_each; numba/segment.py::_make_rows (OP_ADD_ROUND,
#   OP_ADD_ROUND_SCALED); triton/common.py::_combine. Tests: test_reference.py::
#   test_torch_index_add_alpha1 (the oracle against torch), test_kernels_numba.py::
#   test_round_each_is_torch_index_put, test_triton.py::test_index_add.
# - CUDA_SMALL_STRIDE: reference.py::_cuda_small_stride; triton/common.py::_combine and
#   _finish (no Numba kernel). Tests: test_reference.py::test_cuda_small_stride_rounds_once,
#   test_triton.py::test_cuda_autograd_rules_match_reference.
# - CUDA_STRIDE_1: reference.py::_cuda_warp_tree; triton/stride1.py::_stride1_kernel (no Numba
#   kernel). Tests: test_reference.py::test_cuda_warp_tree_matches_literal_lane_simulation,
#   test_triton.py::test_cuda_autograd_rules_match_reference.
# - EXACT: reference.py::_exact and round_exact; numba/exact.py::segment_reduce_exact and
#   numba/limbs.py::finish, rounding to EXACT_TARGETS (below), as detsum/_limbs.py::round_state
#   and numba/exact_state.py::round_state do for a state; triton/exact.py::_exact_kernel (with
#   the same EXACT_TARGETS).
#   Tests: test_exact.py::test_segment_sum_is_correctly_rounded, test_exact_state.py::
#   test_roundings_give_the_values_of_the_torch_operations, test_exact_triton.py::
#   test_matches_oracle_and_numba.

#: Rules whose canonical order splits a segment of more than CHUNK_TERMS terms into chunks.
SPLIT_RULES = (WIDE, KAHAN)

#: The chunk length of the canonical order under WIDE and KAHAN. A segment of at most this many
#: terms is reduced serially from its init. A longer one is cut into chunks of CHUNK_TERMS
#: consecutive terms (the last one shorter): the first chunk reduces from the init, every later
#: chunk reduces its own terms starting from its first term, and the chunk results are folded
#: into the first one serially, in order (KAHAN: each chunk's s is added with compensation and
#: its c added to the running c). A GPU then spreads a hot segment over many programs, and
#: every backend computes the same bits. Changing it changes results: it is part of the
#: determinism contract (docs/determinism.md), never a tuning knob.
CHUNK_TERMS = 256

#: The largest CPU call (elements of the source and the output) that the one-call small kernels
#: take (numba/small.py, and the switch's C++ kernels, native/switch_kernels.cpp); a larger one
#: pays for a plan and threads (see numba/common.py's _MIN_BLOCK_ELEMENTS). Here, not in
#: numba/small.py, so that telling the C++ kernels needs no import of Numba.
SMALL_CALL_ELEMENTS = 65536


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator type (docs/determinism.md): fp64 for fp64 data, fp32 for everything narrower."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# EXACT STATE. A term is RN_acc(A(x) * A(alpha)) (A(x) when alpha == 1), a float of the acc
# type, so it is an integer multiple of the acc type's smallest subnormal, the *unit* (2**-149
# for fp32, 2**-1074 for fp64). An exact sum is kept as that integer N in base 2**LIMB_BITS:
# int64 limbs, limb i weighing 2**(LIMB_BITS * i) units, little end first. A term adds its
# (sign-applied) 24- or 53-bit integer significand, shifted by its exponent, into the two or
# three limbs it spans; nothing carries, so adding limbs elementwise adds the sums, in any
# order (integer addition). *Normalising* carries every limb but the last into [0, 2**32); the
# last keeps the sign. A normalised state absorbs MAX_TERMS_PER_STATE more terms (each adds
# less than 2**33 to a limb) or the normalised states of fewer than 2**31 other sums before an
# int64 limb could overflow. EXACT_LIMBS holds every sum of that many terms with the last limb
# within [-2**31, 2**31) once normalised: fp32 units need 277 bits for one term, fp64 units 2098.
LIMB_BITS = 32
EXACT_LIMBS = {"fp32": 10, "fp64": 67}
MAX_TERMS_PER_STATE = 2**30 - 1
#: Kernels normalise a segment's limbs after this many terms, so one segment may be of any length.
NORMALISE_EVERY = 2**20
#: Each data dtype's rounding of an exact sum of N units: ``(precision, smallest quantum,
#: unit exponent, limbs)``. The result keeps ``precision`` significant bits with a quantum of
#: at least ``2**smallest quantum`` units (the dtype's smallest subnormal: 2**-133 is 2**16
#: fp32 units for bf16, 2**-24 is 2**125 for fp16); the unit (``2**unit exponent``) and the
#: limbs are those of the dtype's acc type, so an acc type's own row gives its unit too.
EXACT_TARGETS = {
    torch.float32: (24, 0, -149, EXACT_LIMBS["fp32"]),
    torch.bfloat16: (8, 16, -149, EXACT_LIMBS["fp32"]),
    torch.float16: (11, 125, -149, EXACT_LIMBS["fp32"]),
    torch.float64: (53, 0, -1074, EXACT_LIMBS["fp64"]),
}

# Reductions.
SUM = 0
MEAN = 1
PROD = 2
AMAX = 3
AMIN = 4

REDUCE_CODES = {"sum": SUM, "mean": MEAN, "prod": PROD, "amax": AMAX, "amin": AMIN}


#: How a launch that checks its bounds in its own kernel reports what it finds (``failure=``
#: of ``SortedKeys`` and ``UncheckedOffsets``): a str is the message of ``torch._assert_async``
#: on the launch's flag (check="device": no host read); a callable is called when the flag,
#: read back once after the launch, shows a failure (check="host"): it checks the values on
#: the host and raises the caller's error (extra ops and reads, on the failure's path only).
#: A launch whose kernel does not check runs the same check by torch ops (``check()``).
Failure = str | Callable[[], None]


def _check_by_torch_ops(failure: Failure | None, good: Callable[[], torch.Tensor]) -> None:
    """Report ``failure`` as a launch's own check would: nothing to check (None), the host
    check that raises (a callable), or ``good()``, a 0-d bool tensor of torch ops, asserted on
    the device with the message."""
    if failure is None:
        return
    if callable(failure):
        failure()
        return
    torch._assert_async(good(), failure)


#: The most keys that torch sorts in one kernel of its own, a sort in registers whatever the
#: keys' width (``should_use_small_sort`` in torch 2.11 to 2.13). More go to CUB's radix sort,
#: whose launches grow with the width: on sm_90 its onesweep sort makes 4 launches to start and
#: 2 a pass of 8 bits (a memset and the pass), 20 for int64 keys, 12 for int32, 8 for int16
#: (``DispatchRadixSort::InvokeOnesweep``, CUB 2.x), after torch's own fill of the positions.
#: Above this many keys, ``sort_by_segment`` sorts the narrowest keys that keep the order.
NARROW_SORT_ABOVE = 4096

#: Whether ``sort_by_segment`` sorts CPU keys as CUDA ones, by ``triton.counting_sort`` (in
#: Triton's interpreter): the tests' way onto a GPU's path.
COUNTING_SORT_ON_CPU = False


def sort_by_segment(keys: torch.Tensor, num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, order) of a stable sort of 1-D integer ``keys`` by the segment each names: for
    every key in ``[0, num_segments)`` the order that ``torch.sort(keys, stable=True)`` gives
    (positions in order of appearance within a key), and the same offsets by any search of the
    values for ``s`` in ``[0, num_segments]``.

    Past ``NARROW_SORT_ABOVE`` keys on a GPU, where its table is small enough
    (``triton.counting_sort.takes``), a counting sort (``triton.counting_sort``: four
    launches and no other op, against CUB's 8 to 20) gives what torch's sort of the
    keys clamped into ``[-1, num_segments]`` gives, in the narrowest type that holds them, or
    the keys' own if narrower. Elsewhere, where more than ``NARROW_SORT_ABOVE`` keys are wider
    than the segments need, two ops (that clamp, a cast) make them int16 (at most 32767
    segments) or int32 before torch's sort: from int64 keys, 10 or 6 launches fewer on a GPU,
    those two counted (see above; from int32 keys to int16, 2 fewer). The values are then
    those clamped keys, in that type. A key below 0 still sorts first and one at or above
    ``num_segments`` last, so the values' two ends show whether every key is in range, and
    the keys out of range, which no segment holds, change places only among themselves."""
    values, order, _ = sort_by_segment_with_offsets(keys, num_segments)
    return values, order


def sort_by_segment_with_offsets(keys: torch.Tensor, num_segments: int
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``sort_by_segment``'s (values, order), and the offsets of the values where the sort
    made them along (a counting sort's: int64, ``num_segments + 1``), else None."""
    narrow = (torch.int16 if num_segments <= torch.iinfo(torch.int16).max
              else torch.int32 if num_segments <= torch.iinfo(torch.int32).max
              else torch.int64)
    positions = keys.shape[0]
    if positions > NARROW_SORT_ABOVE and (keys.is_cuda or COUNTING_SORT_ON_CPU):
        from .triton import counting_sort

        if counting_sort.takes(positions, num_segments):
            values_dtype = narrow if keys.element_size() > narrow.itemsize else keys.dtype
            return counting_sort.sort_by_segment(keys, num_segments, values_dtype)
    if positions > NARROW_SORT_ABOVE and keys.element_size() > narrow.itemsize:
        keys = keys.clamp(-1, num_segments).to(narrow)
    values, order = torch.sort(keys, stable=True)
    return values, order, None


def sorted_keys(keys: torch.Tensor, num_segments: int, failure: Failure | None = None
                ) -> tuple[torch.Tensor, "SortedKeys"]:
    """(order, the sorted keys) of ``sort_by_segment``, with their offsets where the sort
    made them, the keys' check reported by ``failure`` (``SortedKeys``)."""
    values, order, offsets = sort_by_segment_with_offsets(keys, num_segments)
    return order, SortedKeys(values, num_segments, failure, known_offsets=offsets)


@dataclasses.dataclass(frozen=True)
class SortedKeys:
    """Segment bounds given by a sorted index instead of offsets (``offsets=`` of a launch on
    a backend that takes them: the Triton one): segment ``s`` starts at
    ``torch.searchsorted(keys, s)`` (the first key ``>= s``) and ends where ``s + 1`` starts,
    for ``s`` in ``[0, num_segments)``. The launch finds those bounds itself (a promised-sorted
    index by searches in its kernel, a sort's values by a search kernel before it, unless the
    sort made them along: ``known_offsets``), so the caller runs no ``searchsorted``; keys
    that are not sorted give the segments those searches give. A key outside
    ``[0, num_segments)`` is in no segment."""

    #: 1-D on the data's device: a stable sort's values (int16, int32 or int64:
    #: ``sort_by_segment``), or an index promised sorted (int32 or int64).
    keys: torch.Tensor
    num_segments: int
    #: For keys not checked yet: how the launch's check of them, on the device, reports a
    #: failure (``Failure``); None: no check.
    failure: Failure | None = None
    #: What is checked: every key (a promised-sorted index: each in ``[0, num_segments)`` and
    #: none below the one before), or only the two ends (a sort's values, which are sorted:
    #: the launch may then take the offsets the keys stand for, by any search).
    every_key: bool = False
    #: For a sort's values: the offsets they stand for where the sort made them along (a
    #: counting sort's, ``sorted_keys``), taken rather than searched for; None: searched.
    known_offsets: torch.Tensor | None = None

    def check(self) -> None:
        """The check by torch ops, for a launch that does not make it in its kernel."""
        keys, size = self.keys, self.num_segments
        if self.every_key:
            _check_by_torch_ops(self.failure, lambda: ((keys >= 0) & (keys < size)).all()
                                & ~(keys[1:] < keys[:-1]).any())
        else:
            _check_by_torch_ops(self.failure, lambda: (keys[0] >= 0) & (keys[-1] < size))

    def offsets(self) -> torch.Tensor:
        """The offsets these keys stand for (two device ops, none where they are known),
        after the check."""
        self.check()
        if self.known_offsets is not None:
            return self.known_offsets
        boundaries = torch.arange(self.num_segments + 1, dtype=self.keys.dtype,
                                  device=self.keys.device)
        return torch.searchsorted(self.keys.contiguous(), boundaries)


def padded_offsets(inner: torch.Tensor, positions: int) -> torch.Tensor:
    """The offsets of inner bounds: a 0, ``inner``, then ``positions`` (``UncheckedOffsets``'
    ``padded``, made by torch ops for a launch that takes offsets as they are)."""
    padded = torch.nn.functional.pad(inner, (1, 1), value=positions)
    padded[0] = 0
    return padded


@dataclasses.dataclass(frozen=True)
class UncheckedOffsets:
    """CSR offsets not known to be valid (``offsets=`` of a launch on the Triton backend), which
    the launch makes safe itself: it reads each value clamped into ``[0, positions]``.

    Unchecked (no ``failure``: check="off"), it takes their running maximum first (one op), so
    the segments are those of the offsets clamped into ``[0, positions]`` and made
    nondecreasing: what torch ops would launch. Checked (with a ``failure``), it reads them
    as they are and checks in its kernel that they run from 0 to ``positions`` without
    decreasing; a segment whose end is below its start is then empty, so the launch stays
    inside every tensor, but what it writes for offsets that fail is unspecified (a failure
    is reported, and on a GPU a failed assert ends the CUDA context).

    ``padded``: the values are the inner bounds only, the offsets being 0, the values, then
    ``positions`` (torch's ``segment_reduce`` offsets, which may leave rows out at either end:
    the first and last segments hold those rows, and the caller drops their results). The
    launch reads them so, with no padded copy; checked, that padded sequence must not
    decrease: the values none less than the one before, in ``[0, positions]``."""

    #: 1-D int32/int64 on the data's device, ``[num_segments + 1]`` (``padded``:
    #: ``[num_segments - 1]``).
    values: torch.Tensor
    #: The number of positions (source rows, or entries of the order): the last offset.
    positions: int
    #: How the launch's check reports a failure (``Failure``); None: no check.
    failure: Failure | None = None
    #: Whether the values are the inner offsets, between a 0 and ``positions`` (see above).
    padded: bool = False

    @property
    def num_segments(self) -> int:
        return self.values.shape[0] + (1 if self.padded else -1)

    def check(self) -> None:
        """The check by torch ops, for a launch that does not make it in its kernel."""
        values = self.values
        if not self.padded:
            _check_by_torch_ops(self.failure, lambda: (values[0] == 0)
                                & (values[-1] == self.positions)
                                & ~(values[1:] < values[:-1]).any())
        elif values.numel():
            _check_by_torch_ops(self.failure, lambda: (values[0] >= 0)
                                & (values[-1] <= self.positions)
                                & ~(values[1:] < values[:-1]).any())

    def offsets(self) -> torch.Tensor:
        """Int64 offsets for a launch that reads them as they are, after the check (padded
        first where ``padded``): checked on the host, the values themselves; otherwise
        clamped into ``[0, positions]`` and made nondecreasing (the segments of check="off";
        a failed "device" check is reported)."""
        self.check()
        values = self.values.to(torch.int64)
        if self.padded:
            values = padded_offsets(values, self.positions)
        if callable(self.failure):
            return values
        return torch.cummax(values.clamp(0, self.positions), 0).values


@dataclasses.dataclass(frozen=True)
class UnsortedKeys:
    """Segment bounds given by the index itself, as it is (``offsets=`` of a launch on the
    Triton backend, with no ``order``: the source rows are the positions): segment ``s`` holds
    the positions ``p`` with ``keys[p] == s``, in position order, which is the order a stable
    sort gives. A key outside ``[0, num_segments)`` is in no segment. A launch of at most
    ``CHUNK_TERMS`` positions by the kernels that read bounds themselves (fp32, Kahan, torch's
    order) scans the keys in every program, with no sort before it; any other launch sorts
    them first (``sorted``)."""

    #: 1-D int32/int64 on the data's device, one key per source row.
    keys: torch.Tensor
    num_segments: int
    #: How the launch's check that every key lies in ``[0, num_segments)`` reports a failure
    #: (``Failure``); None: no check. With a failure to call (check="host"), a scanning launch
    #: that finds a key out of range writes nothing.
    failure: Failure | None = None

    def check(self) -> None:
        """The check by torch ops, for a launch that does not make it in its kernel."""
        keys, size = self.keys, self.num_segments
        _check_by_torch_ops(self.failure, lambda: ((keys >= 0) & (keys < size)).all())

    def sorted(self) -> tuple[torch.Tensor, SortedKeys]:
        """(order, the sorted keys) of a stable sort, with the check: a sort's values lie in
        range exactly when their two ends do."""
        return sorted_keys(self.keys, self.num_segments, self.failure)


#: ``chunks=`` of a launch whose caller knows that no segment is longer than CHUNK_TERMS.
NO_CHUNKS = (None, 0)


def chunk_ends(offsets: torch.Tensor) -> torch.Tensor:
    """For the split rules (WIDE, KAHAN): the inclusive running count of the chunks of the
    segments longer than CHUNK_TERMS (0 chunks for the others), one entry per segment; its last
    entry is how many chunks there are in all. Torch operations on the offsets' device: no
    host read."""
    counts = offsets[1:] - offsets[:-1]
    parts = torch.where(counts > CHUNK_TERMS, (counts + CHUNK_TERMS - 1) // CHUNK_TERMS, 0)
    return torch.cumsum(parts, 0)


def chunk_slots_bound(positions: int) -> int:
    """At most how many chunks the segments longer than CHUNK_TERMS of ``positions`` terms
    have: a segment of n > C terms has ceil(n / C) < 2n / C chunks."""
    return 2 * positions // CHUNK_TERMS


def has_work(src, order, offsets, supported_dtypes) -> bool:
    """Check a launch's arguments against the contract; False when the output is empty."""
    if src.dtype not in supported_dtypes:
        raise TypeError(f"segment_reduce: unsupported dtype {src.dtype}")
    if isinstance(offsets, (SortedKeys, UnsortedKeys)):
        # int16: a sort's values (sort_by_segment).
        bounds_ok = offsets.keys.dtype in (torch.int16, torch.int32, torch.int64)
        nseg = offsets.num_segments
    elif isinstance(offsets, UncheckedOffsets):
        bounds_ok = offsets.values.dtype in (torch.int32, torch.int64)
        nseg = offsets.num_segments
    else:
        bounds_ok, nseg = offsets.dtype == torch.int64, offsets.shape[0] - 1
    if not bounds_ok or (order is not None and order.dtype != torch.int64):
        raise TypeError("segment_reduce: order and offsets must be int64 (sorted keys: int16, "
                        "int32 or int64; unchecked offsets: int32 or int64)")
    outer, _, inner = src.shape
    return outer > 0 and nseg > 0 and inner > 0


def has_exact_work(src, order, offsets, reduce, supported_dtypes, counts_base) -> bool:
    """``has_work`` for the EXACT rule, which sums (SUM, MEAN) only and divides a mean by at
    most MAX_TERMS_PER_STATE terms (the long division keeps its remainder << 32 in an int64):
    a segment's terms, plus its base row when ``counts_base`` (include_base with a base)."""
    if not has_work(src, order, offsets, supported_dtypes):
        return False
    if reduce not in (SUM, MEAN):
        raise ValueError("segment_reduce: the EXACT rule sums (SUM, MEAN) only")
    positions = order.shape[0] if order is not None else src.shape[1]
    if reduce == MEAN and positions + counts_base > MAX_TERMS_PER_STATE:
        # Only a launch this large pays for reading its longest segment (a host read).
        longest = int((offsets[1:] - offsets[:-1]).max())
        if longest + counts_base > MAX_TERMS_PER_STATE:
            raise ValueError(f"segment_reduce: an exact mean of {longest + counts_base} "
                             f"terms; expected at most {MAX_TERMS_PER_STATE}")
    return True
