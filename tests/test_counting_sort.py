"""The counting sort of a long index (kernels/triton/counting_sort.py): torch's stable sort of
the clamped keys, bit for bit (values and order), and the offsets a search of the values
finds, on every block layout, key range and key dtype; whole calls that sort by it give the
bits of the same calls sorting with torch.

Runs the Triton kernels on a GPU, or in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set by conftest where no GPU is present)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import detsum
from conftest import HAS_CUDA, assert_same_bits, seed_of
from detsum import _segments, kernels

try:
    from detsum.kernels.triton import counting_sort
except ImportError:
    counting_sort = None

pytestmark = pytest.mark.skipif(
    counting_sort is None or not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton, and a GPU or TRITON_INTERPRET=1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _poison(patch):
    """Every ``torch.empty`` of the sort filled with -7 (no value, rank, count, start or
    position it writes), so that an element no launch wrote fails the comparison."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(-7)

    patch.setattr(counting_sort.torch, "empty", poisoned)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    _poison(monkeypatch)


def _torch_sort(keys: torch.Tensor, num_segments: int, values_dtype: torch.dtype):
    return torch.sort(keys.clamp(-1, num_segments).to(values_dtype), stable=True)


def _assert_sorts_as_torch(keys, num_segments, values_dtype):
    values, order, offsets = counting_sort.sort_by_segment(keys.to(DEVICE), num_segments,
                                                           values_dtype)
    expected = _torch_sort(keys, num_segments, values_dtype)
    assert values.dtype == values_dtype and order.dtype == offsets.dtype == torch.int64
    assert_same_bits(values.cpu(), expected.values)
    assert_same_bits(order.cpu(), expected.indices)
    boundaries = torch.arange(num_segments + 1, dtype=values_dtype)
    assert_same_bits(offsets.cpu(), torch.searchsorted(expected.values, boundaries))


@contextlib.contextmanager
def _on_a_gpus_path():
    """The triton backend, a GPU's check levels and its sort (CPU keys sorted by counting as
    CUDA ones); yields the list of the counting sorts made, by their number of segments."""
    counted = []
    sort = counting_sort.sort_by_segment

    def recorded(*args):
        counted.append(args[1])
        return sort(*args)

    with pytest.MonkeyPatch.context() as patch, detsum.backend("triton"):
        patch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
        patch.setattr(kernels, "COUNTING_SORT_ON_CPU", True)
        patch.setattr(counting_sort, "sort_by_segment", recorded)
        yield counted


def _sorted_by_torch(call):
    """``call()`` with no counting sort's table small enough: torch sorts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(counting_sort, "MAX_TABLE_CELLS", 0)
        return call()


BLOCK = counting_sort.BLOCK if counting_sort is not None else 512


@pytest.mark.parametrize("positions", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
@pytest.mark.parametrize("num_segments,values_dtype", [
    (1, torch.int16), (16, torch.int16), (32767, torch.int16), (32768, torch.int32),
    (1000, torch.int64)])
def test_sorts_as_torch_sorts_the_clamped_keys(poisoned_outputs, positions, num_segments,
                                               values_dtype):
    """Keys in range and out of it at both ends, few blocks and several, a last block whole
    and cut short, tables from 3 values to 32770 (129 programs' columns), the values placed
    in each width: torch's stable sort's values and order."""
    gen = torch.Generator().manual_seed(seed_of("counting sort", positions, num_segments))
    keys = torch.randint(-3, num_segments + 3, (positions,), generator=gen)
    _assert_sorts_as_torch(keys, num_segments, values_dtype)


@pytest.mark.parametrize("keys_dtype", [torch.int64, torch.int32, torch.int16])
def test_sorts_every_key_dtype(poisoned_outputs, keys_dtype):
    """int64, int32 and int16 keys, far out of range too (clamped in their own width)."""
    gen = torch.Generator().manual_seed(seed_of("counting sort dtypes", keys_dtype))
    keys = torch.randint(-40, 60, (2 * BLOCK + 3,), generator=gen)
    keys[::97] = torch.iinfo(keys_dtype).max
    keys[::89] = torch.iinfo(keys_dtype).min
    _assert_sorts_as_torch(keys.to(keys_dtype), 50, torch.int16)


@pytest.mark.parametrize("shape", ["one value", "two values by halves", "descending",
                                   "hot value"])
def test_equal_keys_keep_their_positions_order(poisoned_outputs, shape):
    """Runs of equal keys across blocks (one value everywhere, a Zipf-like hot value, keys in
    descending order): each value's positions stay in their order."""
    positions, num_segments = 3 * BLOCK + 7, 40
    gen = torch.Generator().manual_seed(seed_of("counting sort runs", shape))
    keys = {
        "one value": torch.full((positions,), 3),
        "two values by halves": (torch.arange(positions) >= positions // 2).long() * 39,
        "descending": torch.arange(positions).flip(0) // 40,
        "hot value": torch.where(torch.rand(positions, generator=gen) < 0.6, 7,
                                 torch.randint(0, num_segments, (positions,), generator=gen)),
    }[shape]
    _assert_sorts_as_torch(keys, num_segments, torch.int16)


@pytest.mark.parametrize("keys_at", ["everywhere", "low values", "both ends"])
def test_a_wide_row_is_ranked_by_many_programs(poisoned_outputs, monkeypatch, keys_at):
    """Few blocks of a wide table, each row zeroed, ranked and counted by four programs
    (``ROW_VALUES`` cut small): keys spread over every program's values, keys in the first
    program's only (the others write zeros alone), keys only out of range (in the first
    and the last program's): torch's stable sort."""
    monkeypatch.setattr(counting_sort, "ROW_VALUES", 751)
    positions, num_segments = 2 * BLOCK + 9, 3000
    gen = torch.Generator().manual_seed(seed_of("counting sort wide row", keys_at))
    keys = {
        "everywhere": torch.randint(-2, num_segments + 2, (positions,), generator=gen),
        "low values": torch.randint(0, 60, (positions,), generator=gen),
        "both ends": torch.randint(0, 2, (positions,), generator=gen) * (num_segments + 5) - 2,
    }[keys_at]
    _assert_sorts_as_torch(keys, num_segments, torch.int16)


#: Tilings of the launches (VALUES, ROWS, ROWS_PER_PROGRAM, SUMS, ROW_VALUES): narrow and wide
#: column programs, rows read one, two or sixteen at a time, a program's rows split or not,
#: the earlier programs' sums added two at a time or all at once, a block's row ranked by
#: one program or by many (of fewer values than a block has keys, or of more, the last cut
#: short). A few, drawn whole: on a GPU each is compiled.
_TILINGS = [(16, 1, 16, 2, 7), (16, 2, 64, 1024, 100), (256, 16, 16, 2, 1 << 16),
            (256, 16, 64, 1024, 40)]


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(positions=st.integers(1, 700), num_segments=st.integers(1, 300),
       spread=st.integers(0, 5), block=st.sampled_from([16, 32, 64]),
       tiling=st.sampled_from(_TILINGS), data=st.data())
def test_sorts_generated_keys_as_torch(positions, num_segments, spread, block, tiling, data):
    """Generated keys (some out of range by up to ``spread``), on small blocks (many of them:
    the running sum down each column of the table, over several programs' rows) and each
    tiling (narrow column programs, many of them: the running sum across the programs; a
    block's row ranked by many programs), against torch's stable sort."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(-spread, num_segments + spread + 1, (positions,), generator=gen)
    with pytest.MonkeyPatch.context() as patch:
        _poison(patch)
        patch.setattr(counting_sort, "BLOCK", block)
        for name, setting in zip(("VALUES", "ROWS", "ROWS_PER_PROGRAM", "SUMS", "ROW_VALUES"),
                                 tiling, strict=True):
            patch.setattr(counting_sort, name, setting)
        _assert_sorts_as_torch(keys, num_segments, torch.int32)


def test_takes_what_its_table_and_int32_hold():
    """The table's cells within MAX_TABLE_CELLS, every count within int32."""
    cap = counting_sort.MAX_TABLE_CELLS
    assert counting_sort.takes(BLOCK, cap - 2)
    assert not counting_sort.takes(BLOCK, cap - 1)
    assert counting_sort.takes(2 * BLOCK, cap // 2 - 2)
    assert not counting_sort.takes(2 * BLOCK + 1, cap // 2 - 2)
    assert not counting_sort.takes(0, 16)
    assert not counting_sort.takes(2**31, 1)


def test_sort_by_segment_counts_on_a_gpu_past_the_narrow_size():
    """kernels.sort_by_segment sorts by counting past NARROW_SORT_ABOVE keys on a GPU (here
    CPU keys taken as a GPU's), with torch's sort at or below it and where the table would be
    too large: the same values and order in every case, the keys narrowed alike."""
    gen = torch.Generator().manual_seed(seed_of("sort_by_segment counts"))
    for positions, counts in ((kernels.NARROW_SORT_ABOVE, False),
                              (kernels.NARROW_SORT_ABOVE + 1, True)):
        keys = torch.randint(-2, 20, (positions,), generator=gen).to(DEVICE)
        with _on_a_gpus_path() as counted:
            values, order = kernels.sort_by_segment(keys, 18)
            assert counted == ([18] if counts else [])
            expected = _sorted_by_torch(lambda: kernels.sort_by_segment(keys, 18))
        assert_same_bits(values.cpu(), expected[0].cpu())
        assert_same_bits(order.cpu(), expected[1].cpu())


#: NARROW_SORT_ABOVE lowered for the whole calls below: a quarter of the rows for the
#: interpreter to run, on the same path.
LOWERED_NARROW_SORT_ABOVE = 1024


@pytest.mark.parametrize("call", ["index_add host", "index_add_ off", "scatter_reduce mean",
                                  "index_add exact", "moe route"])
def test_calls_sorting_by_counting_give_torch_sorts_bits(monkeypatch, call):
    """Whole calls past NARROW_SORT_ABOVE rows on a GPU's path (the triton backend, a GPU's
    check levels), the index sorted by counting, against the same calls sorting with torch
    (the table too large for counting): the same bits; a bad value still raises. The bound
    is lowered (``LOWERED_NARROW_SORT_ABOVE``)."""
    monkeypatch.setattr(kernels, "NARROW_SORT_ABOVE", LOWERED_NARROW_SORT_ABOVE)
    rows, segments, features = kernels.NARROW_SORT_ABOVE + 37, 23, 3
    gen = torch.Generator().manual_seed(seed_of("counting sort calls", call))
    index = torch.randint(0, segments, (rows,), generator=gen).to(DEVICE)
    src = torch.randn(rows, features, generator=gen).to(DEVICE)
    init = torch.randn(segments, features, generator=gen).to(DEVICE)
    selected = torch.randint(0, 8, (rows // 2, 2), generator=gen).to(DEVICE)
    calls = {
        "index_add host": lambda: detsum.index_add(init, 0, index, src),
        "index_add_ off": lambda: detsum.index_add_(init.clone(), 0, index, src, check="off"),
        "scatter_reduce mean": lambda: detsum.scatter_reduce(
            init, 0, index, src, "mean", include_self=False, mode="kahan"),
        "index_add exact": lambda: detsum.index_add(
            torch.zeros_like(init), 0, index, src, mode="exact"),
        "moe route": lambda: detsum.moe.route(selected, 8).gather_indices,
    }
    with _on_a_gpus_path() as counted:
        got = calls[call]()
        assert counted, "the index was not sorted by counting"
        assert_same_bits(got, _sorted_by_torch(calls[call]))
        if call == "index_add host":
            bad = index.clone()
            bad[rows // 3] = segments
            with pytest.raises(detsum.IndexOutOfRangeError, match=rf"index\[{rows // 3}\]"):
                detsum.index_add(init, 0, bad, src)


@pytest.mark.parametrize("check", ["host", "device", "off"])
@pytest.mark.parametrize("bad_key", [-1, 23, 10**12], ids=["below", "past", "far past"])
def test_a_bad_key_sorted_by_counting_is_caught_by_the_offsets_ends(monkeypatch, check,
                                                                     bad_key):
    """A long index with a key out of range, sorted by counting, its offsets made along: the
    caller's error at "host", the launch's assert of the offsets' two ends at "device", and
    at "off" the position in no segment (the call with that row's source zeroed). The bound
    is lowered (``LOWERED_NARROW_SORT_ABOVE``)."""
    if check == "device" and HAS_CUDA:
        pytest.skip("a failed assert on a GPU ends the process's CUDA context")
    monkeypatch.setattr(kernels, "NARROW_SORT_ABOVE", LOWERED_NARROW_SORT_ABOVE)
    rows, segments = kernels.NARROW_SORT_ABOVE + 9, 23
    gen = torch.Generator().manual_seed(seed_of("counting sort bad key", check, bad_key))
    good = torch.randint(0, segments, (rows,), generator=gen)
    src = torch.randn(rows, 2, generator=gen)
    init = torch.randn(segments, 2, generator=gen)
    bad = good.clone()
    bad[rows // 2] = bad_key
    kept = bad.clamp(0, segments - 1)
    bad, kept, src, init = (t.to(DEVICE) for t in (bad, kept, src, init))
    with _on_a_gpus_path():
        if check == "off":
            out = detsum.index_add(init, 0, bad, src, check=check)
            zeroed = src * (kept == bad).view(-1, 1)
            assert_same_bits(out, detsum.index_add(init, 0, kept, zeroed, check=check))
            return
        error = IndexError if check == "host" else RuntimeError
        with pytest.raises(error, match=rf"index\[{rows // 2}\] = {bad_key} is out of range"
                           if check == "host" else "index has a value outside"):
            detsum.index_add(init, 0, bad, src, check=check)


@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd", "exact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_mode_and_dtype_sorting_by_counting_gives_torch_sorts_bits(monkeypatch, mode,
                                                                          dtype):
    """``index_add`` with alpha past NARROW_SORT_ABOVE rows, a segment long enough for
    chunks, in every mode and a float and a bfloat16 dtype, on a GPU's path: the index sorted
    by counting gives the bits of the same call sorting with torch. The bound is lowered
    (``LOWERED_NARROW_SORT_ABOVE``: 1325 rows for the interpreter to run, not 4397); the hot
    segment keeps about 400 terms, past a chunk."""
    monkeypatch.setattr(kernels, "NARROW_SORT_ABOVE", LOWERED_NARROW_SORT_ABOVE)
    rows, segments, features = kernels.NARROW_SORT_ABOVE + 301, 40, 2
    gen = torch.Generator().manual_seed(seed_of("counting sort modes", mode, dtype))
    index = torch.randint(0, segments, (rows,), generator=gen)
    index[torch.rand(rows, generator=gen) < 0.3] = 11  # a hot segment: chunks
    src = torch.randn(rows, features, generator=gen).to(dtype)
    init = torch.randn(segments, features, generator=gen).to(dtype)
    index, src, init = index.to(DEVICE), src.to(DEVICE), init.to(DEVICE)

    def call():
        return detsum.index_add(init, 0, index, src, alpha=0.75, mode=mode)

    with _on_a_gpus_path() as counted:
        got = call()
        assert counted == [segments]
        assert_same_bits(got, _sorted_by_torch(call))
