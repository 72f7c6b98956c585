"""The ``check`` levels of the primitives: "host" (default), "device" (no host read), "off".
detsum.moe's levels are in tests/test_moe_check.py.

On the CPU every level checks the primitives' values on every backend, as "host" does. A GPU's
launch path is the one every backend but Numba takes: the plan from torch ops on the index's
device, checked as the level says. Here it runs on the CPU through the triton backend (Triton's
interpreter) with CPU tensors checked as a GPU's (``gpu_path``), and a host read anywhere in
detsum's own code (detsum/ and its kernels/) fails the test: the Python ways of reading a
tensor's values are replaced for the duration.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import detsum
from check_levels import HostRead, gpu_path, no_host_reads
from conftest import TRITON_ON_CPU, assert_same_bits
from detsum import _segments, kernels, reference

pytest.importorskip("triton")


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, 6, (40,), generator=gen)
    src = torch.randn(40, 3, generator=gen)
    init = torch.randn(6, 3, generator=gen)
    offsets = torch.tensor([0, 10, 10, 25, 40])
    perm = torch.randperm(40, generator=gen)
    return init, index, src, offsets, perm


def _calls(check, init, index, src, offsets, perm):
    """name -> a call of each primitive (and layout) with this check level."""
    return {
        "index_add": lambda: detsum.index_add(init, 0, index, src, check=check),
        "index_add-kahan": lambda: detsum.index_add(init, 0, index, src, mode="kahan",
                                                    check=check),
        "scatter_reduce-mean": lambda: detsum.scatter_reduce(init, 0, index, src, "mean",
                                                             check=check),
        "scatter_reduce-amax": lambda: detsum.scatter_reduce(init, 0, index, src, "amax",
                                                             check=check),
        "scatter_reduce-sorted": lambda: detsum.scatter_reduce(
            init, 0, index.sort().values, src, "sum", sorted=True, check=check),
        "scatter_reduce-elementwise": lambda: detsum.scatter_reduce(
            init, 0, index.view(-1, 1).expand(-1, 3), src, "sum", check=check),
        "segment_sum": lambda: detsum.segment_sum(src, offsets, check=check),
        "segment_sum-perm": lambda: detsum.segment_sum(src, offsets, perm=perm, check=check),
    }


CALLS = list(_calls("host", *_inputs()))


@pytest.mark.interpreter
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("check", ["device", "off"])
def test_no_host_read_in_the_gpu_launch_path(check, call, sort_width):
    """Forward and backward, with the plan of a GPU: not one value read into Python."""
    init, index, src, offsets, perm = _inputs()
    src.requires_grad_(True)
    with gpu_path(), no_host_reads():
        out = _calls(check, init, index, src, offsets, perm)[call]()
        out.backward(torch.ones_like(out))
    assert torch.isfinite(src.grad).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("call", CALLS)
def test_the_host_level_reads_values_back(call):
    """The guard sees the reads the default level makes (so the test above can fail)."""
    with gpu_path(), no_host_reads(), pytest.raises(HostRead):
        _calls("host", *_inputs())[call]()


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("backend", ["numba", TRITON_ON_CPU, "reference"])
def test_every_level_gives_the_same_bits(backend, call):
    """Forward and backward, on a GPU's path where the levels differ (triton, reference)."""
    results = {}
    with detsum.backend(backend) if backend == "numba" else gpu_path(backend):
        for check in ("host", "device", "off"):
            init, index, src, offsets, perm = _inputs(1)
            init.requires_grad_(True)
            src.requires_grad_(True)
            out = _calls(check, init, index, src, offsets, perm)[call]()
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
            results[check] = [out, src.grad] + ([] if init.grad is None else [init.grad])
    for check in ("device", "off"):
        for got, expected in zip(results[check], results["host"], strict=True):
            assert_same_bits(got, expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("primitive", ["index_add", "scatter_reduce", "segment_sum"])
def test_device_level_fails_on_a_bad_index_naming_the_argument(primitive):
    """On a GPU the failure comes at the next synchronisation; on the CPU's copy of the GPU's
    path (the triton backend here) at once. Either way in detsum's words."""
    init, index, src, offsets, perm = _inputs()
    bad_index = index.clone()
    bad_index[7] = 6
    bad_perm = perm.clone()
    bad_perm[3] = 40
    call = {
        "index_add": lambda: detsum.index_add(init, 0, bad_index, src, check="device"),
        "scatter_reduce": lambda: detsum.scatter_reduce(init, 0, bad_index, src, "sum",
                                                        check="device"),
        "segment_sum": lambda: detsum.segment_sum(src, offsets, perm=bad_perm, check="device"),
    }[primitive]
    argument = "perm" if primitive == "segment_sum" else "index"
    with gpu_path(), pytest.raises(RuntimeError, match=f"detsum.{primitive}: {argument} has a "
                                                       f"value outside.*check='device'"):
        call()


# ---- the launch's own check of offsets and of a sorted index (the triton backend) -------------

@pytest.fixture
def small_check_blocks(monkeypatch):
    """Checker programs that read 2 bounds at a time: a small launch's check then spreads over
    several programs, and a program checks several blocks when there are more blocks than
    programs."""
    from detsum.kernels.triton import segment

    monkeypatch.setattr(segment, "_CHECK_BLOCK", segment.tl.constexpr(2))


def _checked_in_the_launch(argument, values):
    """(call: check -> result, the message of its failed "device" check) of the call whose
    ``argument`` (offsets of 12 rows into 5 segments, or a sorted index of 12 rows into 5)
    holds ``values``."""
    gen = torch.Generator().manual_seed(21)
    src, init = torch.randn(12, 3, generator=gen), torch.randn(5, 3, generator=gen)
    if argument == "offsets":
        return (lambda check: detsum.segment_sum(src, values, check=check),
                r"detsum.segment_sum: offsets do not run from 0 to src.size\(dim\) = 12 "
                r"without decreasing \(found by check='device'")
    return (lambda check: detsum.scatter_reduce(init, 0, values, src, "sum", sorted=True,
                                                check=check),
            r"detsum.scatter_reduce: index has a value outside \[0, input.size\(0\) = 5\) or "
            r"decreases somewhere \(sorted=True\) \(found by check='device'")


_GOOD_BOUNDS = {"offsets": [0, 3, 3, 7, 9, 12],
                "sorted_index": [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4]}
# Each position made bad in turn: the ends out of place, the others below the bound before.
_BAD_BOUNDS = [
    pytest.param(argument, position, id=f"{argument}-{position}")
    for argument, good in _GOOD_BOUNDS.items() for position in range(len(good))]


def _made_bad(argument, position):
    values = list(_GOOD_BOUNDS[argument])
    if position == 0:
        values[0] = 1 if argument == "offsets" else -1
    elif position == len(values) - 1 and argument == "offsets":
        values[-1] = 11
    else:
        values[position] = values[position - 1] - 1
    return torch.tensor(values)


@pytest.mark.interpreter
@pytest.mark.parametrize("argument,position", _BAD_BOUNDS)
@pytest.mark.parametrize("check", ["host", "device"])
def test_the_launch_finds_a_bad_bound_wherever_it_is(small_check_blocks, check, argument,
                                                     position):
    """The launch checks the offsets, or the sorted index, itself, spread over its programs:
    a bad value in any program's block fails, at "host" with the error of the Numba
    backend's check (a read of the launch's verdict, then the values on the error's path),
    at "device" with one assert of it."""
    call, device_message = _checked_in_the_launch(argument, _made_bad(argument, position))
    with detsum.backend("numba"), pytest.raises((IndexError, ValueError)) as expected:
        call("host")
    if check == "host":
        with gpu_path(), pytest.raises(type(expected.value)) as raised:
            call("host")
        assert str(raised.value) == str(expected.value)
    else:
        with gpu_path(), pytest.raises(RuntimeError, match=device_message):
            call("device")


@pytest.mark.interpreter
@pytest.mark.parametrize("argument", list(_GOOD_BOUNDS))
def test_the_launch_passes_good_bounds_checked_by_several_programs(small_check_blocks,
                                                                   argument):
    call, _ = _checked_in_the_launch(argument, torch.tensor(_GOOD_BOUNDS[argument]))
    with detsum.backend("numba"):
        expected = call("host")
    for check in ("host", "device"):
        with gpu_path():
            assert_same_bits(call(check), expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("check", ["host", "device"])
def test_a_failed_check_leaves_no_ticket_behind(check):
    """Offsets that decrease, with long segments: the chunk programs' searches disagree and
    some segment's tickets are never all taken. The failure's path sets the counters back to
    0, so the next launch folds its chunks when they are all there: the Numba backend's bits."""
    from detsum.kernels.triton import segment

    gen = torch.Generator().manual_seed(22)
    src = torch.randn(1000, 2, generator=gen)
    bad, good = torch.tensor([0, 600, 300, 1000]), torch.tensor([0, 600, 1000])
    with gpu_path(), pytest.raises(ValueError if check == "host" else RuntimeError):
        detsum.segment_sum(src, bad, check=check)
    assert not segment.ticket_counters(torch.device("cpu"), 1).any()
    for mode in ("fp32", "kahan"):
        with detsum.backend("numba"):
            expected = detsum.segment_sum(src, good, mode=mode)
        with gpu_path():
            assert_same_bits(detsum.segment_sum(src, good, mode=mode, check=check), expected)
        assert not segment.ticket_counters(torch.device("cpu"), 1).any()


# ---- bad values: on the CPU every level checks; on a GPU "off" stays inside every tensor -------
# Small sizes: Triton's interpreter runs every program in Python.

_ROWS, _COLUMNS, _SEGMENTS = 12, 3, 5
_HUGE = 2**40


def _bad_value_inputs():
    gen = torch.Generator().manual_seed(7)
    src = torch.randn(_ROWS, _COLUMNS, generator=gen)
    return {
        "init": torch.randn(_SEGMENTS, _COLUMNS, generator=gen),
        "target": torch.randn(_SEGMENTS, _COLUMNS, generator=gen),  # written in place
        "index": torch.randint(0, _SEGMENTS, (_ROWS,), generator=gen),
        "index32": torch.randint(0, _SEGMENTS, (_ROWS,), generator=gen, dtype=torch.int32),
        "sorted_index": torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4, 4]),
        "elementwise_index": torch.randint(0, _SEGMENTS, (_ROWS, _COLUMNS), generator=gen),
        "src": src,
        # prod: factors near 1, a zero among them (the gradient's special case)
        "factors": (1 + src / 8).index_fill(0, torch.tensor([5]), 0.0),
        "offsets": torch.tensor([0, 3, 3, 7, 9, _ROWS]),
        "perm": torch.randperm(_ROWS, generator=gen),
    }


# The mistakes, by argument: position -> value (or the whole tensor, for offsets).
_INDEX_MISTAKES = {
    "negative": {4: -1},
    "size": {4: _SEGMENTS},
    "huge": {4: _HUGE},
    "huge-negative": {4: -_HUGE},
    "several": {2: _SEGMENTS, 5: -1, 9: _HUGE},
}
_MISTAKES = {
    "index": _INDEX_MISTAKES,
    "index32": {"negative": {4: -1}, "size": {4: _SEGMENTS}, "largest": {9: 2**31 - 1}},
    "sorted_index": {"negative-first": {0: -1}, "size-last": {11: _SEGMENTS},
                     "huge-last": {10: _HUGE, 11: _HUGE}, "decreasing": {6: 0},
                     "decreasing-and-size": {6: 0, 11: _SEGMENTS}},
    "elementwise_index": {"negative": {(4, 1): -1}, "size": {(0, 2): _SEGMENTS},
                          "several": {(3, 0): _HUGE, (7, 2): -_HUGE, (11, 1): _SEGMENTS}},
    "offsets": {
        "first-not-0": [2, 3, 3, 7, 9, _ROWS],
        "first-negative": [-4, 3, 3, 7, 9, _ROWS],
        "last-short": [0, 3, 3, 7, 9, 10],
        "last-huge": [0, 3, 3, 7, 9, _HUGE],
        "decreasing": [0, 3, 8, 7, 9, _ROWS],
        "beyond-rows-inside": [0, 3, 30, 7, 9, _ROWS],
        "negative-inside": [0, 3, -2, 7, 9, _ROWS],
        "everything": [5, 20, -1, 3, 2, 7],
    },
    "perm": {"negative": {3: -1}, "size": {3: _ROWS}, "huge": {3: _HUGE},
             "several": {0: -_HUGE, 3: _ROWS, 11: -1}},
}


def _with_mistake(t, argument, mistake):
    """A copy of the inputs whose ``argument`` holds ``mistake``."""
    t = {name: value.clone() for name, value in t.items()}
    change = _MISTAKES[argument][mistake]
    if argument == "offsets":
        t["offsets"] = torch.tensor(change)
    else:
        for position, value in change.items():
            t[argument][position] = value
    return t


# name -> (the argument that goes wrong, the call: (inputs, check) -> result).
_BAD_VALUE_CALLS = {
    "index_add": ("index", lambda t, check: detsum.index_add(
        t["init"], 0, t["index"], t["src"], check=check)),
    "index_add-kahan-alpha": ("index", lambda t, check: detsum.index_add(
        t["init"], 0, t["index"], t["src"], alpha=-2.0, mode="kahan", check=check)),
    "index_add-int32": ("index32", lambda t, check: detsum.index_add(
        t["init"], 0, t["index32"], t["src"], check=check)),
    "index_add_": ("index", lambda t, check: detsum.index_add_(
        t["target"], 0, t["index"], t["src"], check=check)),
    # the in-place call that autograd records: the out-of-place operator, its result copied in
    "index_add_-recorded": ("index", lambda t, check: detsum.index_add_(
        t["target"], 0, t["index"], t["src"].detach().requires_grad_(), check=check)),
    "scatter_reduce-sum": ("index", lambda t, check: detsum.scatter_reduce(
        t["init"], 0, t["index"], t["src"], "sum", check=check)),
    "scatter_reduce-mean-without-self": ("index", lambda t, check: detsum.scatter_reduce(
        t["init"], 0, t["index"], t["src"], "mean", include_self=False, check=check)),
    "scatter_reduce-amax": ("index", lambda t, check: detsum.scatter_reduce(
        t["init"], 0, t["index"], t["src"], "amax", check=check)),
    "scatter_reduce-prod": ("index", lambda t, check: detsum.scatter_reduce(
        t["init"], 0, t["index"], t["factors"], "prod", check=check)),
    "scatter_reduce-sorted": ("sorted_index", lambda t, check: detsum.scatter_reduce(
        t["init"], 0, t["sorted_index"], t["src"], "sum", sorted=True, check=check)),
    "scatter_reduce-elementwise": ("elementwise_index", lambda t, check: detsum.scatter_reduce(
        t["init"], 0, t["elementwise_index"], t["src"], "sum", check=check)),
    # dim 1: several outer rows, whose keys a bad value would reach into
    "scatter_reduce-elementwise-dim1": ("elementwise_index", lambda t, check: (
        detsum.scatter_reduce(t["init"].t(), 1, t["elementwise_index"].t(), t["src"].t(), "sum",
                              check=check))),
    "segment_sum": ("offsets", lambda t, check: detsum.segment_sum(
        t["src"], t["offsets"], check=check)),
    "segment_sum-perm-offsets": ("offsets", lambda t, check: detsum.segment_sum(
        t["src"], t["offsets"], perm=t["perm"], check=check)),
    "segment_sum-exact": ("offsets", lambda t, check: detsum.segment_sum(
        t["src"], t["offsets"], mode="exact", check=check)),
    "segment_sum-perm": ("perm", lambda t, check: detsum.segment_sum(
        t["src"], t["offsets"], perm=t["perm"], mode="kahan", check=check)),
}

BAD_VALUE_CASES = [pytest.param(call, mistake, id=f"{call}-{mistake}")
                   for call, (argument, _) in _BAD_VALUE_CALLS.items()
                   for mistake in _MISTAKES[argument]]


@pytest.mark.parametrize("call,mistake", BAD_VALUE_CASES)
# The Numba backend sorts on the CPU by counting: no sort of keys to narrow.
@pytest.mark.parametrize("backend,sort_width", [
    pytest.param("numba", "torch's keys", id="numba"),
    *(pytest.param(backend, width, id=f"{backend}-{width}",
                   marks=pytest.mark.interpreter if backend == "triton" else ())
      for backend in ("reference", "triton") for width in ("torch's keys", "narrowed keys"))],
    indirect=["sort_width"])
def test_cpu_checks_every_level_on_every_backend(backend, call, mistake, sort_width):
    """On CPU tensors every level checks, on every backend: the error of the default level
    (its type and words, naming the first bad position), before anything is written."""
    argument, run = _BAD_VALUE_CALLS[call]
    t = _with_mistake(_bad_value_inputs(), argument, mistake)
    before = {name: value.clone() for name, value in t.items()}
    with detsum.backend("numba"), pytest.raises((IndexError, ValueError)) as expected:
        run(t, "host")
    # The function the test called (the name before the first "-"), not one it calls.
    assert str(expected.value).startswith(f"detsum.{call.split('-')[0]}: ")
    for check in ("host", "device", "off"):
        with detsum.backend(backend), pytest.raises(type(expected.value)) as raised:
            run(t, check)
        assert str(raised.value) == str(expected.value), check
        for name, value in before.items():
            assert torch.equal(t[name], value), (check, name)


# ---- what "off" gives for a bad value, as the docstrings say, written out here in plain loops ----

def _kept_rows(index, size):
    """The positions whose value lies in [0, size): the rows "off" reduces."""
    return [p for p, value in enumerate(index.tolist()) if 0 <= value < size]


def _planned_targets(sorted_index, size):
    """Each position's output row under a sorted=True plan of an unchecked index (-1: none):
    segment s holds positions searchsorted(index, s) .. searchsorted(index, s + 1) - 1."""
    offsets = torch.searchsorted(sorted_index, torch.arange(size + 1, dtype=sorted_index.dtype,
                                                            device=sorted_index.device)).tolist()
    targets = [-1] * sorted_index.numel()
    for s in range(size):
        for p in range(offsets[s], offsets[s + 1]):
            targets[p] = s
    return torch.tensor(targets, device=sorted_index.device)


def _launched_offsets(offsets, rows):
    """Offsets clamped into [0, rows], then each the largest value up to it."""
    launched, highest = [], 0
    for value in offsets.tolist():
        highest = max(highest, min(max(value, 0), rows))
        launched.append(highest)
    return torch.tensor(launched, device=offsets.device)


def _clamped_perm(perm, rows):
    return torch.tensor([min(max(value, 0), rows - 1) for value in perm.tolist()],
                        device=perm.device)


def _index_and_kept_rows(t, index_name, size):
    keep = torch.tensor(_kept_rows(t[index_name], size), dtype=torch.int64,
                        device=t[index_name].device)
    return t[index_name][keep], keep


def _off_expected(call, t):
    """What the docstrings say check="off" gives on a GPU, from the reference loops on the
    rows a bad value leaves in."""
    init, src = t["init"], t["src"]
    if call.startswith("index_add"):
        name = "index32" if call == "index_add-int32" else "index"
        index, keep = _index_and_kept_rows(t, name, _SEGMENTS)
        alpha, mode = (-2.0, "kahan") if call == "index_add-kahan-alpha" else (1, "fp32")
        base = t["target"] if call.startswith("index_add_") else init
        return reference.index_add(base, 0, index, src[keep], alpha=alpha, mode=mode)
    if call == "scatter_reduce-elementwise-dim1":
        return _off_expected("scatter_reduce-elementwise", t).t()
    if call == "scatter_reduce-elementwise":
        index = t["elementwise_index"]
        columns = []
        for c in range(_COLUMNS):
            keep = torch.tensor(_kept_rows(index[:, c], _SEGMENTS), dtype=torch.int64,
                                device=index.device)
            columns.append(reference.scatter_reduce(init[:, c], 0, index[keep, c],
                                                    src[keep, c], "sum"))
        return torch.stack(columns, 1)
    if call == "scatter_reduce-sorted":
        t = dict(t, planned=_planned_targets(t["sorted_index"], _SEGMENTS))
        index, keep = _index_and_kept_rows(t, "planned", _SEGMENTS)
        return reference.scatter_reduce(init, 0, index, src[keep], "sum")
    if call.startswith("scatter_reduce"):
        reduce = call.split("-")[1]
        index, keep = _index_and_kept_rows(t, "index", _SEGMENTS)
        values = t["factors"] if reduce == "prod" else src
        return reference.scatter_reduce(init, 0, index, values[keep], reduce,
                                        include_self="without-self" not in call)
    perm = _clamped_perm(t["perm"], _ROWS) if "perm" in call else None
    mode = {"segment_sum-perm": "kahan", "segment_sum-exact": "exact"}.get(call, "fp32")
    return reference.segment_sum(src, _launched_offsets(t["offsets"], _ROWS), perm=perm,
                                 mode=mode)


_GPU_PATHS = [
    pytest.param("cpu", "triton", id="cpu-triton", marks=pytest.mark.interpreter),
    pytest.param("cpu", "reference", id="cpu-reference"),
    pytest.param("cuda", "triton", id="cuda-triton", marks=pytest.mark.cuda),
    pytest.param("cuda", "reference", id="cuda-reference", marks=pytest.mark.cuda),
]


def _on(device, t):
    return {name: value.to(device) for name, value in t.items()}


@pytest.mark.parametrize("call,mistake", BAD_VALUE_CASES)
@pytest.mark.parametrize("device,backend", _GPU_PATHS)
def test_off_level_gives_what_the_docstrings_say(device, backend, call, mistake, sort_width):
    """A GPU's "off" reads and writes inside every tensor, whatever the values: an index value
    outside [0, size) leaves its row (element) out, a broken sorted=True promise splits the
    rows by a binary search, offsets are clamped into [0, N] and made nondecreasing, perm
    values clamped into [0, N). The same bits on both backends, and no host read on triton's."""
    argument, run = _BAD_VALUE_CALLS[call]
    t = _on(device, _with_mistake(_bad_value_inputs(), argument, mistake))
    expected = _off_expected(call, t)
    guard = no_host_reads() if backend == "triton" else contextlib.nullcontext()
    with gpu_path(backend), guard:
        got = run(t, "off")
    assert_same_bits(got, expected)
    if call.startswith("index_add_"):
        assert got is t["target"]


@pytest.mark.interpreter
@pytest.mark.parametrize("promised_sorted", [False, True], ids=["unsorted", "broken-sorted"])
def test_off_level_chunks_long_segments_of_bad_values(promised_sorted, sort_width):
    """More than CHUNK_TERMS positions: the chunk programs find the segments of unchecked
    values themselves (in the sorted keys, no offsets), values out of range in no segment and
    a broken sorted=True promise split as torch.searchsorted splits it, also where the key at
    a chunk program's first or last position names another segment. The bits of the
    reference backend, whose order is the contract's."""
    chunk, rows, segments = kernels.CHUNK_TERMS, 1060, 3
    gen = torch.Generator().manual_seed(11)
    if promised_sorted:
        # Rows 1 .. 659 and 660 .. 1058 in two long segments; the keys at the first and last
        # position of chunk program 2, inside them, name the segment before.
        index = torch.repeat_interleave(torch.arange(segments), torch.tensor([60, 600, 400]))
        index[[2 * chunk, 3 * chunk - 1]] = torch.tensor([0, 1])
        index[[0, -1]] = torch.tensor([-1, segments])
    else:
        index = torch.randint(0, segments, (rows,), generator=gen)
        index[[5, chunk, 600]] = torch.tensor([-1, segments, _HUGE])
    src = torch.randn(rows, _COLUMNS, generator=gen)
    init = torch.randn(segments, _COLUMNS, generator=gen)
    planned = _segments.index_as_planned(index, segments) if promised_sorted else index
    assert torch.bincount(planned.clamp(-1, segments) + 1).max() > chunk  # chunks are there
    results = {}
    for backend in ("triton", "reference"):
        with gpu_path(backend), (no_host_reads() if backend == "triton"
                                 else contextlib.nullcontext()):
            results[backend] = [
                detsum.scatter_reduce(init, 0, index, src, "sum", sorted=promised_sorted,
                                      mode=mode, check="off") for mode in ("fp32", "kahan")]
    for got, expected in zip(results["triton"], results["reference"], strict=True):
        assert_same_bits(got, expected)


@pytest.mark.parametrize("call,mistake", [
    case for case in BAD_VALUE_CASES if case.values[1] in ("several", "everything", "decreasing")])
@pytest.mark.parametrize("backend", [TRITON_ON_CPU, "reference"])
def test_device_level_launches_what_off_gives(backend, call, mistake, monkeypatch,
                                              sort_width):
    """On a GPU a failed "device" check is reported at the next synchronisation, after the
    launch: that launch is the one of "off", inside every tensor. Here the check never fails
    (as if not reported yet). segment_sum's offsets on the triton backend are the exception:
    the launch checks them itself, reading each segment's bounds clamped on their own
    (``_each_segment_clamped``)."""
    argument, run = _BAD_VALUE_CALLS[call]
    t = _with_mistake(_bad_value_inputs(), argument, mistake)
    checked_in_the_launch = (backend == "triton" and argument == "offsets"
                             and call != "segment_sum-exact")
    with gpu_path(backend):
        off = run(_with_mistake(_bad_value_inputs(), argument, mistake), "off")
        monkeypatch.setattr(torch, "_assert_async", lambda *args: None)
        got = run(t, "device")
    if checked_in_the_launch:
        off = _each_segment_clamped(t, with_perm="perm" in call)
    assert_same_bits(got, off)


def _each_segment_clamped(t, with_perm):
    """What the launch that checks segment_sum's offsets itself sums, without chunks (fp32):
    segment ``s`` from ``c[s]`` to ``max(c[s], c[s + 1])``, ``c`` the offsets clamped into
    [0, N] each on its own, its rows added in order to an fp32 0."""
    clamped = [min(max(value, 0), _ROWS) for value in t["offsets"].tolist()]
    rows = _clamped_perm(t["perm"], _ROWS).tolist() if with_perm else list(range(_ROWS))
    out = torch.zeros(len(clamped) - 1, _COLUMNS)
    for s in range(len(clamped) - 1):
        for p in range(clamped[s], max(clamped[s], clamped[s + 1])):
            out[s] = out[s] + t["src"][rows[p]]
    return out


# name -> (the argument that goes wrong, the call with what is differentiated, the gradient
# "off" gives: (inputs, grad) -> {name: gradient}).
def _gathered(grad, index, size, scale=1.0):
    """grad's row of each position's value, scaled; +0.0 for a value out of range."""
    rows = [grad[v] * scale if 0 <= v < size else torch.zeros_like(grad[0])
            for v in index.tolist()]
    return torch.stack(rows)


def _segment_gradient(t, grad, with_perm):
    """Each position in a segment adds its segment's gradient row to its (clamped) row; the
    rows outside every segment receive nothing. Integer-valued gradients: exact in any order."""
    offsets = _launched_offsets(t["offsets"], _ROWS).tolist()
    rows = _clamped_perm(t["perm"], _ROWS).tolist() if with_perm else list(range(_ROWS))
    out = torch.zeros(_ROWS, _COLUMNS, dtype=torch.float64)
    for s in range(len(offsets) - 1):
        for p in range(offsets[s], offsets[s + 1]):
            out[rows[p]] += grad[s].double().cpu()
    return out.to(grad.dtype).to(grad.device)


def _kept_call_gradient(t, grad, reduce, include_self, planned=False):
    """The gradients of a checked call on the rows that "off" keeps."""
    index = _planned_targets(t["sorted_index"], _SEGMENTS) if planned else t["index"]
    keep = torch.tensor(_kept_rows(index, _SEGMENTS), dtype=torch.int64, device=index.device)
    values = t["factors"] if reduce == "prod" else t["src"]
    init, kept = t["init"].clone().requires_grad_(), values[keep].clone().requires_grad_()
    detsum.scatter_reduce(init, 0, index[keep], kept, reduce,
                          include_self=include_self).backward(grad)
    grad_src = torch.zeros_like(values).index_copy_(0, keep, kept.grad)
    return {"init": init.grad, "src": grad_src}


_BACKWARD_CASES = {
    "index_add-kahan-alpha": (["init", "src"], lambda t, g: {
        "init": g, "src": _gathered(g, t["index"], _SEGMENTS, -2.0)}),
    "scatter_reduce-sum": (["init", "src"], lambda t, g: _kept_call_gradient(t, g, "sum", True)),
    "scatter_reduce-mean-without-self": (["init", "src"], lambda t, g: _kept_call_gradient(
        t, g, "mean", False)),
    "scatter_reduce-amax": (["init", "src"], lambda t, g: _kept_call_gradient(t, g, "amax",
                                                                              True)),
    "scatter_reduce-prod": (["init", "factors"], lambda t, g: {
        ("factors" if name == "src" else name): value
        for name, value in _kept_call_gradient(t, g, "prod", True).items()}),
    "scatter_reduce-sorted": (["init", "src"], lambda t, g: _kept_call_gradient(
        t, g, "sum", True, planned=True)),
    "scatter_reduce-elementwise": (["src"], lambda t, g: {"src": torch.stack([
        _gathered(g[:, c], t["elementwise_index"][:, c], _SEGMENTS)
        for c in range(_COLUMNS)], 1)}),
    "scatter_reduce-elementwise-dim1": (["src"], lambda t, g: {"src": torch.stack([
        _gathered(g.t()[:, c], t["elementwise_index"][:, c], _SEGMENTS)
        for c in range(_COLUMNS)], 1)}),
    "segment_sum": (["src"], lambda t, g: {"src": _segment_gradient(t, g, False)}),
    "segment_sum-exact": (["src"], lambda t, g: {"src": _segment_gradient(t, g, False)}),
    "segment_sum-perm-offsets": (["src"], lambda t, g: {"src": _segment_gradient(t, g, True)}),
    "segment_sum-perm": (["src"], lambda t, g: {"src": _segment_gradient(t, g, True)}),
}


@pytest.mark.parametrize("call,mistake", [case for case in BAD_VALUE_CASES
                                          if case.values[0] in _BACKWARD_CASES])
@pytest.mark.parametrize("device,backend", _GPU_PATHS)
def test_off_level_backward_is_the_gradient_of_what_it_gives(device, backend, call, mistake):
    """Backward under "off" reads and writes inside every tensor too, and gives the gradient of
    the forward's result: a row (element) left out receives +0.0."""
    argument, run = _BAD_VALUE_CALLS[call]
    differentiable, expected_gradients = _BACKWARD_CASES[call]
    t = _on(device, _with_mistake(_bad_value_inputs(), argument, mistake))
    leaves = {name: t[name].clone().requires_grad_() for name in differentiable}
    guard = no_host_reads() if backend == "triton" else contextlib.nullcontext()
    with gpu_path(backend), guard:
        out = run(dict(t, **leaves), "off")
        grad = torch.randint(-4, 5, out.shape, generator=torch.Generator().manual_seed(11)
                             ).to(out)
        out.backward(grad)
    for name, expected in expected_gradients(t, grad).items():
        assert_same_bits(leaves[name].grad, expected)


@pytest.mark.parametrize("call", [
    lambda: detsum.index_add(torch.zeros(2), 0, torch.tensor([0]), torch.ones(1), check="never"),
    lambda: detsum.index_add_(torch.zeros(2), 0, torch.tensor([0]), torch.ones(1), check=True),
    lambda: detsum.scatter_reduce(torch.zeros(2), 0, torch.tensor([0]), torch.ones(1), "sum",
                                  check="never"),
    lambda: detsum.segment_sum(torch.ones(1), torch.tensor([0, 1]), check="never"),
], ids=["index_add", "index_add_", "scatter_reduce", "segment_sum"])
def test_a_bad_level_is_refused(call):
    with pytest.raises(ValueError, match=r"check=.*expected one of 'host', 'device', 'off'"):
        call()


def test_compiled_device_level_gives_eager_bits():
    init, index, src, offsets, perm = _inputs(2)

    def layer(init, index, src):
        return (detsum.index_add(init, 0, index, src, check="device")
                + detsum.scatter_reduce(init, 0, index, src, "mean", check="off"))

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_same_bits(compiled(init, index, src), layer(init, index, src))


@pytest.mark.cuda
@pytest.mark.parametrize("call", CALLS)
def test_no_synchronisation_on_cuda(call):
    """torch's own detector of host synchronisations, forward and backward."""
    init, index, src, offsets, perm = (t.cuda() for t in _inputs())
    src.requires_grad_(True)
    calls = _calls("device", init, index, src, offsets, perm)
    calls[call]()  # compile the kernels and warm the caches first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = calls[call]()
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    """A forward and backward of index_add with check="device", captured once and replayed,
    gives the eager bits."""
    init, index, src, _, _ = (t.cuda() for t in _inputs())
    grad_out = torch.ones_like(init)

    def step(src):
        leaf = src.detach().requires_grad_(True)
        out = detsum.index_add(init, 0, index, leaf, mode="kahan", check="device")
        out.backward(grad_out)
        return out, leaf.grad

    expected = step(src)
    static_src = src.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(static_src)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static_src)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected):
        assert_same_bits(got, want)
