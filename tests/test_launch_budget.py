"""What each call asks of a GPU, held to a budget (issue "One plan, one launch").

Counted on the GPU's path without a GPU (tests/launch_counter.py): device ops (aten compute
ops + Triton launches), host reads, allocations, and sorts of an index. Two kinds of tests:

- ``test_no_count_grows``: no count may grow past what was measured (``MEASURED``, the numbers
  of benches/count_calls.py recorded in benches/NOTES.md). A change that lowers a count
  lowers its number here too.
- ``test_target``: the issue's budgets. Those not met yet are strict xfails, so the first
  change that meets one turns it red: then its marker goes.
"""

from __future__ import annotations

import functools

import pytest
import torch

import detsum
from conftest import assert_same_bits
from detsum import _dispatch, moe
from detsum.ops.index_add import _index_add
from detsum.ops.scatter_reduce import _run as _scatter_reduce
from detsum.ops.segment_sum import _segment_sum

pytest.importorskip("triton")
from detsum.kernels.triton.segment import interpreted  # noqa: E402
from launch_counter import CHECKS, ROWS, count, count_row, gpu_path, inputs  # noqa: E402

if not interpreted():
    pytest.skip("the counts are taken on CPU tensors in Triton's interpreter, which "
                "conftest.py turns on only where no GPU is present", allow_module_level=True)


@functools.cache
def _counted(row: str):
    return count_row(row).summary()


# ---- the harness counts by its rules --------------------------------------------------------------

def test_views_are_free_factories_allocate_everything_else_is_a_kernel():
    x, spare = torch.randn(4, 3), torch.empty(12)

    def call():
        x.t().unsqueeze(0).expand(2, 3, 4)  # views
        x.reshape(12)  # a view
        x.t().reshape(12)  # a copy (clone), then a view of it (_unsafe_view)
        x.to(torch.float32)  # nothing to convert: x itself
        x.to(torch.float16)  # a conversion
        torch.empty(5)  # memory, no kernel
        torch.zeros(5).copy_(spare[:5])  # memory and a fill; a copy
        torch.promote_types(torch.float16, torch.float32)  # no tensor at all
        return x

    counts = count(call)
    assert counts.ops == {"clone": 1, "_to_copy": 1, "zeros": 1, "copy_": 1}
    assert counts.allocations == {"empty": 1, "zeros": 1}
    assert counts.device_ops == 4 and counts.host_reads == [] and counts.launches == []


def test_each_host_read_counts_once_wherever_it_comes_from():
    """A read from detsum's own code counts once (not again as the _local_scalar_dense
    beneath it); a _local_scalar_dense from elsewhere (indexing by a 0-d tensor) counts too."""
    t = inputs()
    reads = count(lambda: detsum.scatter(t["src"], t["index"], 0)).host_reads
    assert [read.split(":")[0] for read in reads] == ["tolist in scatter_compat.py"]
    position = torch.tensor(1)
    assert count(lambda: torch.arange(3)[position]).host_reads == [
        "_local_scalar_dense in code outside detsum"]


def test_launches_are_counted_with_their_grids_and_nothing_of_the_interpreter():
    """16 segments of 512 narrow rows in "fp32": one program for the 16 whole segments (a
    tile of them: ``segment._reduce_segments``) and two (a chunk program's two sides) per
    256 positions, which fold the chunks too; the interpreter's copies of the arguments are
    no aten ops of the call."""
    t = inputs()
    counts = count(lambda: detsum.segment_sum(t["src"], t["offsets"], check="off"))
    assert counts.launches == [("_segment_kernel", (1 + 4, 1, 1))]
    assert not {"copy_", "set_", "new_empty"} & (set(counts.ops) | set(counts.allocations))


def test_what_an_operator_runs_inside_is_counted():
    t = inputs()
    counts = count(lambda: detsum.index_add(t["init"], 0, t["index"], t["src"], check="off"))
    assert counts.operators == {"index_add": 1}
    assert counts.ops["sort"] == 1


# The body each public function's direct path calls, with the public call.
_DIRECT = {
    "segment_sum": (lambda t: _segment_sum(t["src"], t["offsets"], 0, None, "fp32", "device"),
                    lambda t: detsum.segment_sum(t["src"], t["offsets"], check="device")),
    "index_add": (lambda t: _index_add(t["init"], 0, t["index"], t["src"], 1.0, "kahan", "off"),
                  lambda t: detsum.index_add(t["init"], 0, t["index"], t["src"], mode="kahan",
                                             check="off")),
    "scatter_reduce": (lambda t: _scatter_reduce(t["init"], 0, t["index"], t["src"], "sum",
                                                 True, "fp32", False, check="host"),
                       lambda t: detsum.scatter_reduce(t["init"], 0, t["index"], t["src"],
                                                       "sum")),
    "moe.route": (lambda t: moe._route(t["selected"], 4, "device")[0],
                  lambda t: moe.route(t["selected"], 4, check="device")[0]),
}


@pytest.mark.parametrize("function", list(_DIRECT))
def test_the_operator_path_counts_what_the_direct_path_runs(function):
    """Under the counter a public function calls its operator (a dispatch mode is active),
    whose implementation runs as the body the direct path calls: the same counts and bits
    as that body, and the bits of the call outside the counter, which takes the direct
    path."""
    body, public = _DIRECT[function]
    t = inputs()
    assert count(lambda: _dispatch.direct_call_ok(t["src"])).result is False
    through_operator, direct = count(lambda: public(t)), count(lambda: body(t))
    assert sum(through_operator.operators.values()) == 1 and not direct.operators
    assert through_operator.summary() == direct.summary()
    assert through_operator.ops == direct.ops
    assert through_operator.launches == direct.launches
    assert _dispatch.direct_call_ok(t["src"])
    with gpu_path():
        outside = public(t)
    for got in (through_operator.result, direct.result):
        assert_same_bits(got, outside)


# ---- no count grows ----------------------------------------------------------------------------------

_FIELDS = ("device_ops", "host_reads", "allocations", "sorts")
#: Each row's (device_ops, host_reads, allocations, sorts), measured by benches/count_calls.py
#: (benches/NOTES.md). Lower a number when a change lowers the count.
MEASURED = {
    "segment_sum fp32 host": (1, 1, 2, 0),
    "segment_sum fp32 device": (2, 0, 2, 0),
    "segment_sum fp32 off": (2, 0, 2, 0),
    "segment_sum kahan host": (1, 1, 2, 0),
    "segment_sum kahan device": (2, 0, 2, 0),
    "segment_sum kahan off": (2, 0, 2, 0),
    "index_add fp32 host": (4, 1, 3, 1),
    "index_add fp32 device": (4, 0, 3, 1),
    "index_add fp32 off": (3, 0, 3, 1),
    "index_add kahan host": (4, 1, 3, 1),
    "index_add kahan device": (4, 0, 3, 1),
    "index_add kahan off": (3, 0, 3, 1),
    "scatter_reduce fp32 host": (4, 1, 3, 1),
    "scatter_reduce fp32 device": (4, 0, 3, 1),
    "scatter_reduce fp32 off": (3, 0, 3, 1),
    "scatter_reduce kahan host": (4, 1, 3, 1),
    "scatter_reduce kahan device": (4, 0, 3, 1),
    "scatter_reduce kahan off": (3, 0, 3, 1),
    "index_add fp32 host small": (1, 1, 2, 0),
    "index_add fp32 device small": (2, 0, 2, 0),
    "index_add fp32 off small": (1, 0, 1, 0),
    # In place too, "host" reads the launch's verdict after it (a launch that finds a bad
    # value writes nothing): its flag is the allocation.
    "index_add_ fp32 host small": (1, 1, 1, 0),
    "index_add_ fp32 device small": (2, 0, 1, 0),
    "index_add_ fp32 off small": (1, 0, 0, 0),
    "scatter_reduce fp32 host small": (1, 1, 2, 0),
    "scatter_reduce fp32 device small": (2, 0, 2, 0),
    "scatter_reduce fp32 off small": (1, 0, 1, 0),
    # Past kernels.NARROW_SORT_ABOVE rows: the index sorted by counting
    # (kernels/triton/counting_sort.py: four launches, no torch op), no torch sort, and the
    # offsets made along (no search launch). Torch's sort counts one op here where on a GPU
    # it is CUB's radix sort, 8 launches and a fill for the int16 keys that a clamp and a
    # cast made (two ops more), 20 for int64 keys: these rows' GPU kernels went from 13-14
    # to 6-7, their allocations from 3 to 7 (the table, the ranks, the sort's outputs and
    # offsets; torch's sort allocates its own unseen). The table's fill and running sum
    # (torch's `zeros` and `cumsum`, 1-2 CUB launches) became two launches of the sort's own.
    "index_add fp32 host long": (6, 1, 7, 0),
    "index_add fp32 device long": (6, 0, 7, 0),
    "index_add fp32 off long": (5, 0, 7, 0),
    "scatter_reduce fp32 host long": (6, 1, 7, 0),
    "scatter_reduce fp32 device long": (6, 0, 7, 0),
    "scatter_reduce fp32 off long": (5, 0, 7, 0),
    "scatter_reduce sorted fp32 host": (1, 1, 2, 0),
    "scatter_reduce sorted fp32 device": (2, 0, 2, 0),
    "scatter_reduce sorted fp32 off": (1, 0, 2, 0),
    "segment_sum fp32 host +backward": (6, 1, 3, 0),
    "segment_sum fp32 device +backward": (15, 0, 3, 0),
    "segment_sum fp32 off +backward": (17, 0, 3, 0),
    "index_add fp32 host +backward": (5, 1, 3, 1),
    "index_add fp32 device +backward": (9, 0, 3, 1),
    "index_add fp32 off +backward": (10, 0, 3, 1),
    "scatter_reduce fp32 host +backward": (5, 1, 3, 1),
    "scatter_reduce fp32 device +backward": (9, 0, 3, 1),
    "scatter_reduce fp32 off +backward": (10, 0, 3, 1),
    "moe layer fp32 host +backward": (6, 1, 7, 1),
    "moe layer fp32 device +backward": (7, 0, 7, 1),
    "moe layer fp32 off +backward": (6, 0, 7, 1),
    "moe layer fp32 host routed +backward": (6, 1, 7, 1),
    "moe layer fp32 device routed +backward": (7, 0, 7, 1),
    "moe layer fp32 off routed +backward": (6, 0, 7, 1),
    "moe layer fp32 host caller's index +backward": (39, 3, 14, 2),
    "moe layer fp32 device caller's index +backward": (46, 0, 14, 2),
    "moe layer fp32 off caller's index +backward": (26, 0, 12, 2),
    "segment_sum fp32 plan": (1, 0, 1, 0),
    "segment_sum kahan plan": (1, 0, 1, 0),
    "segment_sum autograd plan": (1, 0, 1, 0),
    "segment_sum exact plan": (1, 0, 1, 0),
    "segment_sum fp32 plan +backward": (2, 0, 1, 0),
    "index_add fp32 plan": (1, 0, 1, 0),
    "index_add kahan plan": (1, 0, 1, 0),
    "index_add autograd plan": (1, 0, 1, 0),
    "index_add exact plan": (1, 0, 1, 0),
    "index_add fp32 plan +backward": (2, 0, 1, 0),
    "scatter_reduce fp32 plan": (1, 0, 1, 0),
    "scatter_reduce kahan plan": (1, 0, 1, 0),
    "scatter_reduce autograd plan": (1, 0, 1, 0),
    "scatter_reduce exact plan": (1, 0, 1, 0),
    "scatter_reduce fp32 plan +backward": (2, 0, 1, 0),
    "scatter sum": (6, 1, 4, 1),
    # The check of an index whose output size is given runs on the device: 3 ops for 3 reads.
    "scatter sum dim_size": (9, 0, 4, 1),
}


def test_every_row_has_its_measured_counts():
    assert MEASURED.keys() == ROWS.keys()


@pytest.mark.parametrize("row", list(ROWS))
def test_no_count_grows(row):
    got = _counted(row)
    grown = {field: f"{got[field]} > {limit}"
             for field, limit in zip(_FIELDS, MEASURED[row], strict=True) if got[field] > limit}
    assert not grown, f"{row}: {grown}"


@pytest.mark.parametrize("row,keys", [
    ("index_add fp32 off", torch.int64), ("index_add fp32 off long", torch.int16),
    ("scatter_reduce fp32 host long", torch.int16), ("index_add fp32 device long", torch.int16)])
def test_a_long_index_sorts_the_keys_its_segments_need(monkeypatch, row, keys):
    """An index of at most kernels.NARROW_SORT_ABOVE values is sorted as it is (int64: torch
    sorts that many in one kernel of its own, whatever their width); a longer one, where the
    counting sort's table would be too large, as the int16 keys that its 16 segments need
    (kernels.sort_by_segment), one sort either way."""
    from detsum.kernels.triton import counting_sort

    monkeypatch.setattr(counting_sort, "MAX_TABLE_CELLS", 0)
    assert count_row(row).sort_keys == [keys]


@pytest.mark.parametrize("row", ["index_add fp32 off long", "scatter_reduce fp32 host long",
                                 "index_add fp32 device long"])
def test_a_long_index_is_sorted_by_counting_on_a_gpu(row):
    """Past kernels.NARROW_SORT_ABOVE values, on a GPU's path, the index is sorted by counting
    (four launches, no torch op: no sort, fill or running sum) where its table is small, its
    offsets made along (no search launch), and the call gives the bits of the same call
    sorting with torch."""
    from detsum.kernels.triton import counting_sort

    counted = count_row(row)
    assert counted.sort_keys == []
    assert [name for name, _ in counted.launches] == [
        "_rank_kernel", "_totals_kernel", "_starts_kernel", "_place_kernel", "_segment_kernel"]
    # Beside the launches, only the check's op: the read of its flag at "host", the assert
    # of it at "device".
    assert counted.ops == {"index_add fp32 off long": {},
                           "scatter_reduce fp32 host long": {"index": 1},
                           "index_add fp32 device long": {"_assert_async": 1}}[row]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(counting_sort, "MAX_TABLE_CELLS", 0)
        sorted_by_torch = count_row(row)
    assert sorted_by_torch.sort_keys == [torch.int16]
    assert_same_bits(counted.result, sorted_by_torch.result)


# ---- the targets -------------------------------------------------------------------------

_NOT_MET = pytest.mark.xfail(strict=True, reason="issue 'One plan, one launch': not met yet")


def _target(row: str, field: str, limit: int, *, met: bool = False):
    if field == "host_reads" and ROWS[row].check == "host":
        limit += 1  # "host" reads its check back: one host read more
    return pytest.param(row, field, limit, marks=() if met else _NOT_MET,
                        id=f"{row}: {field} <= {limit}")


def _rows(*names: str, modes=("fp32", "kahan"), checks=CHECKS, suffix: str = "") -> list[str]:
    return [f"{name} {mode} {check}{suffix}" for name in names for mode in modes
            for check in checks]


# Calls check "device" or "off"; at "host" at most one host read more (``_target``).
TARGETS = [
    # Any primitive, any mode, with a plan (made at "host"): 1 Triton launch and at most 1
    # other device op, no host read; forward and backward, no sort.
    *(_target(row, "launches", 1, met=True)
      for row in _rows("segment_sum", "index_add", "scatter_reduce",
                       modes=("fp32", "kahan", "autograd", "exact"), checks=("plan",))),
    *(_target(row, "device_ops", 2, met=True)
      for row in _rows("segment_sum", "index_add", "scatter_reduce",
                       modes=("fp32", "kahan", "autograd", "exact"), checks=("plan",))),
    *(_target(row, field, 0, met=True) for field in ("host_reads", "sorts")
      for row in _rows("segment_sum", "index_add", "scatter_reduce", modes=("fp32",),
                       checks=("plan",), suffix=" +backward")),
    # Any primitive with a new unsorted index (no plan): at most 4 device ops, no host read.
    *(_target(row, "device_ops", 4, met=True) for row in _rows("index_add", "scatter_reduce")),
    *(_target(row, "host_reads", 0, met=True) for row in _rows("index_add", "scatter_reduce")),
    # An unsorted index of at most CHUNK_TERMS values (no plan): one launch that scans it, no
    # sort, at most one device op more (the assert of "device").
    *(_target(row, field, limit, met=True)
      for row in _rows("index_add", "index_add_", "scatter_reduce", modes=("fp32",),
                       suffix=" small")
      for field, limit in (("launches", 1), ("sorts", 0), ("host_reads", 0),
                           ("device_ops", 2))),
    # A sorted index or CSR offsets: at most 2 device ops (the launch checks them itself, and
    # folds its chunks), no host read.
    *(_target(row, field, limit, met=True)
      for row in _rows("segment_sum") + _rows("scatter_reduce sorted", modes=("fp32",))
      for field, limit in (("device_ops", 2), ("host_reads", 0))),
    # Forward + backward of any primitive: the index sorted at most once.
    *(_target(row, "sorts", 1, met=True)
      for row in _rows("segment_sum", "index_add", "scatter_reduce", modes=("fp32",),
                       suffix=" +backward")),
    # An MoE layer, forward + backward: at most 8 device ops in all, no host read. Met with
    # the Routing that route returns and with its gather_indices (taken as the Routing); not
    # yet with an index route never returned, which permute and unpermute check, clamp and
    # invert on every call.
    *(_target(row, field, limit, met=True)
      for field, limit in (("device_ops", 8), ("host_reads", 0))
      for suffix in (" +backward", " routed +backward")
      for row in _rows("moe layer", modes=("fp32",), suffix=suffix)),
    *(_target(row, "device_ops", 8)
      for row in _rows("moe layer", modes=("fp32",), suffix=" caller's index +backward")),
    *(_target(row, "host_reads", 0, met=ROWS[row].check != "host")
      for row in _rows("moe layer", modes=("fp32",), suffix=" caller's index +backward")),
    # detsum.scatter and the torch_scatter API: at most 1 host read (none with dim_size), with
    # no check level to add one.
    pytest.param("scatter sum", "host_reads", 1, id="scatter sum: host_reads <= 1"),
    pytest.param("scatter sum dim_size", "host_reads", 0,
                 id="scatter sum dim_size: host_reads <= 0"),
]


@pytest.mark.parametrize("row,field,limit", TARGETS)
def test_target(row, field, limit):
    assert _counted(row)[field] <= limit
