"""torch's own accumulating ops under ``detsum.enable``, against the same call through detsum's
primitive and against torch's own kernel (the switch off).

The issue's target: an op under the switch costs at most 1.2x the detsum primitive that it
runs (``ratio_to_baseline`` of each "switch" case), whatever torch's own kernel costs (the
"torch" cases, for the picture). What the switch adds: torch's dispatcher reaching a Python
kernel, the checks that decide whether detsum takes the call, and the primitive's operator
body called directly (no second dispatch). Two sizes: a small call, where that overhead is
most of the time, and a GNN-sized one (100k rows of 64 into 10k), where the kernel is.

Each op's primitive is what the switch calls (``detsum/switch.py``): ``index_add_`` and
``index_put_(accumulate=True)`` run ``detsum.index_add_``; ``scatter_add_`` and
``scatter_reduce_`` run ``detsum.scatter_reduce`` copied into ``self`` (on a CPU a small sum,
amax or amin from a row index goes the shorter way of one Numba call into ``self``, below the
primitive's cost); the dense backward of
``embedding`` and ``bincount`` with weights run ``detsum.index_add`` from zeros;
``segment_reduce`` sums and means from 0 run ``detsum.segment_sum`` over the CSR offsets of
its segments (given as lengths, the switch makes the offsets: the primitive's call here is
given them, the call a user would write).

``test_enable_few_into_large`` times in-place calls of a few terms into a large table (10
rows of 4 into a million) under the switch against torch's kernel: what the switch costs
where torch's kernel touches a few elements alone.

On a GPU, ``test_enable_cuda_calls`` times the same calls on CUDA tensors (the switch against
the primitive, 1.2x), and ``test_enable_cuda`` the issue's GPU target: torch's ``index_add_``
and the backward of ``x[idx]`` (``index_put_`` with ``accumulate=True``) on a Zipf-skewed index
(``bench_skew.py``'s, 50k rows of 256 features into a 32k-row table), under the switch in
"fp32" mode against torch's default (atomics) and against torch under
``use_deterministic_algorithms(True)`` (a sort); target: at most 1.2x the first, at least
3x faster than the second.

    pytest benches/bench_enable.py --benchmark-json=benches/results/cpu-enable-<date>.json
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import detsum
from bench_skew import ZIPF_EXPONENT, zipf_index
from conftest import run_case

MODE = "fp32"
#: (rows of terms, output rows, features), rounds, calls per round.
SIZES = {"small": ((256, 64, 64), 200, 10), "gnn": ((100_000, 10_000, 64), 15, 1)}


def _inputs(size: str, device: str = "cpu") -> dict:
    (n_src, n_out, h), _, _ = SIZES[size]
    gen = torch.Generator().manual_seed(7)
    index = torch.randint(0, n_out, (n_src,), generator=gen).to(device)
    lengths = torch.bincount(index, minlength=n_out)
    return {
        "index": index,
        "expanded": index.view(-1, 1).expand(-1, h),
        "src": torch.randn(n_src, h, generator=gen).to(device),
        "weights": torch.randn(n_src, generator=gen).to(device),
        # Added into over and over: the values grow, the cost does not.
        "work": torch.randn(n_out, h, generator=gen).to(device),
        "zeros": torch.zeros(n_out, h, device=device),
        "lengths": lengths, "offsets": torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]),
        "n_out": n_out,
    }


def _calls(t: dict) -> dict:
    """op -> (torch's call, the detsum primitive's call)."""
    index, src, work, n_out = t["index"], t["src"], t["work"], t["n_out"]
    expanded, weights = t["expanded"], t["weights"]
    return {
        "index_add_": (lambda: work.index_add_(0, index, src),
                       lambda: detsum.index_add_(work, 0, index, src, mode=MODE)),
        "index_put_ accumulate": (
            lambda: work.index_put_((index,), src, accumulate=True),
            lambda: detsum.index_add_(work, 0, index, src, mode=MODE)),
        "scatter_add_": (lambda: work.scatter_add_(0, expanded, src),
                         lambda: work.copy_(detsum.scatter_reduce(work, 0, expanded, src, "sum",
                                                                  mode=MODE))),
        "scatter_reduce_ mean": (
            lambda: work.scatter_reduce_(0, expanded, src, "mean"),
            lambda: work.copy_(detsum.scatter_reduce(work, 0, expanded, src, "mean",
                                                     mode=MODE))),
        "scatter_reduce_ amax": (
            lambda: work.scatter_reduce_(0, expanded, src, "amax"),
            lambda: work.copy_(detsum.scatter_reduce(work, 0, expanded, src, "amax",
                                                     mode=MODE))),
        "embedding_dense_backward": (
            lambda: torch.ops.aten.embedding_dense_backward(src, index, n_out, -1, False),
            lambda: detsum.index_add(t["zeros"], 0, index, src, mode=MODE)),
        "bincount weights": (
            lambda: torch.bincount(index, weights, minlength=n_out),
            lambda: detsum.index_add(weights.new_zeros(n_out), 0, index, weights, mode=MODE)),
        "segment_reduce sum": (
            lambda: torch.segment_reduce(src, "sum", lengths=t["lengths"]),
            lambda: detsum.segment_sum(src, t["offsets"], mode=MODE)),
        # PyG's form (its segment over a CSR pointer): the same offsets in both calls.
        "segment_reduce offsets sum": (
            lambda: torch.segment_reduce(src, "sum", offsets=t["offsets"]),
            lambda: detsum.segment_sum(src, t["offsets"], mode=MODE)),
    }


OPS = list(_calls(_inputs("small")))


def _time_switched(benchmark, test: str, device: str, size: str, op: str, impl: str) -> None:
    """One case of ``test``: ``op``'s torch call under the switch ("switch"), the detsum
    primitive the switch runs for it ("primitive"), or torch's call with the switch off
    ("torch"), each switch case against its primitive and each primitive against torch."""
    torchs, primitive = _calls(_inputs(size, device))[op]
    (n_src, n_out, h), rounds, iterations = SIZES[size]
    benchmark.group = f"enable {'' if device == 'cpu' else device + ' '}{op} {size}"
    info = {"primitive": "enable", "op": op, "case": f"{n_src}x{h} -> {n_out}x{h} fp32",
            "device": device, "dtype": "fp32", "impl": impl, "mode": MODE, "max_ulps": None}
    baseline = {"switch": f"{test}[{size}-{op}-primitive]",
                "primitive": f"{test}[{size}-{op}-torch]"}.get(impl)
    if impl != "switch":
        # An earlier case's block left the switch's kernels registered, handing each call to
        # torch's kernel for a few microseconds more: removed, torch's kernel is timed alone.
        detsum.disable()
    before = detsum.switch.counts.copy()
    with detsum.deterministic(MODE) if impl == "switch" else contextlib.nullcontext():
        run_case(benchmark, primitive if impl == "primitive" else torchs, device,
                 rounds=rounds, warmup_rounds=3, info=info, iterations=iterations,
                 baseline=baseline, baseline_case=baseline)
    calls = detsum.switch.counts - before
    # A call the switch left to torch would time torch's kernel under this case's name.
    assert (impl == "switch") == bool(calls) and all(how == "detsum" for _, how in calls), (
        dict(calls))


@pytest.mark.parametrize("impl", ["switch", "primitive", "torch"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("size", list(SIZES))
def test_enable(benchmark, size, op, impl):
    _time_switched(benchmark, "test_enable", "cpu", size, op, impl)


@pytest.mark.parametrize("impl", ["switch", "primitive", "torch"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("size", list(SIZES))
def test_enable_cuda_calls(benchmark, size, op, impl):
    """``test_enable`` on CUDA tensors: the switch against the primitive it runs (the issue's
    1.2x), torch's own kernel (its default, atomics) for the picture."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _time_switched(benchmark, "test_enable_cuda_calls", "cuda", size, op, impl)


#: A few terms into a large table (a memory bank's or a statistics table's update): rows of
#: terms, the table's rows, features.
FEW_INTO_LARGE = (10, 1_000_000, 4)


def _few_into_large_calls() -> dict:
    """op -> torch's in-place call of a few terms into a large table, run as it is (with the
    switch on or off)."""
    n_src, n_out, h = FEW_INTO_LARGE
    gen = torch.Generator().manual_seed(11)
    table, src = torch.zeros(n_out, h), torch.randn(n_src, h, generator=gen)
    index = torch.randint(0, n_out, (n_src,), generator=gen)
    expanded = index.view(-1, 1).expand(-1, h)
    elementwise = torch.randint(0, n_out, (n_src, h), generator=gen)
    return {
        "scatter_add_ expanded": lambda: table.scatter_add_(0, expanded, src),
        "scatter_add_ elementwise": lambda: table.scatter_add_(0, elementwise, src),
        "scatter_reduce_ amax": lambda: table.scatter_reduce_(0, expanded, src, "amax"),
        "index_reduce_ amax": lambda: table.index_reduce_(0, index, src, "amax"),
        "index_add_": lambda: table.index_add_(0, index, src),
        "index_put_ accumulate": lambda: table.index_put_((index,), src, accumulate=True),
    }


@pytest.mark.filterwarnings("ignore:index_reduce")  # torch's "in beta" warning
@pytest.mark.parametrize("impl", ["switch", "torch"])
@pytest.mark.parametrize("op", list(_few_into_large_calls()))
def test_enable_few_into_large(benchmark, op, impl):
    """The switch's in-place calls of a few terms into a large table: they touch the elements
    that receive terms alone, as torch's kernels do (a call once copied the whole table
    twice: 2.5-8.5 ms against torch's 1.5 us at these sizes)."""
    n_src, n_out, h = FEW_INTO_LARGE
    _time_switch_or_torch(benchmark, _few_into_large_calls()[op], impl, op,
                          f"enable few into large {op}", f"{n_src}x{h} -> {n_out}x{h} fp32",
                          f"test_enable_few_into_large[{op}-torch]", iterations=20)


def _time_switch_or_torch(benchmark, call, impl: str, op: str, group: str, case: str,
                          torch_case: str, iterations: int = 1) -> None:
    """``call``, a torch call on CPU tensors, timed under the switch ("switch", against
    ``torch_case``) or with it off ("torch"); the switch must run every call on detsum."""
    benchmark.group = group
    info = {"primitive": "enable", "op": op, "case": case, "device": "cpu", "dtype": "fp32",
            "impl": impl, "mode": MODE, "max_ulps": None}
    baseline = torch_case if impl == "switch" else None
    if impl != "switch":
        detsum.disable()  # torch's kernels alone (see _time_switched)
    before = detsum.switch.counts.copy()
    with detsum.deterministic(MODE) if impl == "switch" else contextlib.nullcontext():
        run_case(benchmark, call, "cpu", rounds=30, warmup_rounds=3, info=info,
                 iterations=iterations, baseline=baseline, baseline_case=baseline)
    calls = detsum.switch.counts - before
    assert (impl == "switch") == bool(calls) and all(how == "detsum" for _, how in calls), (
        dict(calls))


#: One column of terms (a GNN's edge weights or degrees, a histogram): terms, output rows.
#: A thousand rows get a thousand terms each, past a chunk (256); 100k rows, ten each; 10k
#: terms into a thousand rows, a small graph's (the switch's C++ kernels' size).
ONE_COLUMN = {"1M into 1000": (1_000_000, 1000), "1M into 100k": (1_000_000, 100_000),
              "10k into 1000": (10_000, 1000)}


def _one_column_calls(size: str) -> dict:
    """op -> torch's call on ``size``'s one-element terms into its rows (or bins), run as it
    is (with the switch on or off)."""
    n_src, n_out = ONE_COLUMN[size]
    gen = torch.Generator().manual_seed(13)
    index = torch.randint(0, n_out, (n_src,), generator=gen)
    terms, work = torch.randn(n_src, generator=gen), torch.zeros(n_out)
    factors = 1 + terms / 1024  # near 1: a product of a thousand stays finite
    return {
        "index_add_": lambda: work.index_add_(0, index, terms),
        "index_add_ last dim": lambda: work.view(1, -1).index_add_(1, index, terms.view(1, -1)),
        "scatter_add_": lambda: work.scatter_add_(0, index, terms),
        "scatter_reduce_ amax": lambda: work.scatter_reduce_(0, index, terms, "amax"),
        "scatter_reduce mean": lambda: work.scatter_reduce(0, index, terms, "mean"),
        "scatter_reduce prod": lambda: work.scatter_reduce(0, index, factors, "prod"),
        "bincount weights": lambda: torch.bincount(index, terms, minlength=n_out),
        "histc": lambda: torch.histc(terms, bins=n_out, min=-3, max=3),
    }


@pytest.mark.parametrize("impl", ["switch", "torch"])
@pytest.mark.parametrize("op", list(_one_column_calls("1M into 1000")))
@pytest.mark.parametrize("size", list(ONE_COLUMN))
def test_enable_one_column(benchmark, size, op, impl):
    """The switch's calls on one column of many terms, where torch's kernels are a serial
    loop and detsum's plan (a sort, then the launch) cost most: the 1-D calls run in one pass
    without a plan (``_segments.streamed_scatter``; at 10k terms the switch's C++ kernels,
    ``add_column`` and ``pick_column``), the histogram counts integers in one pass
    (``switch._histc_counts``)."""
    n_src, n_out = ONE_COLUMN[size]
    _time_switch_or_torch(benchmark, _one_column_calls(size)[op], impl, op,
                          f"enable one column {op} {size}", f"{n_src} -> {n_out} fp32",
                          f"test_enable_one_column[{size}-{op}-torch]",
                          iterations=20 if n_src < 100_000 else 1)


CUDA_ROWS, CUDA_TABLE, CUDA_FEATURES = 50_000, 32_768, 256
CUDA_OPS = ["index_add_", "index_put_ accumulate"]


@pytest.mark.parametrize("impl", ["switch", "torch", "torch deterministic"])
@pytest.mark.parametrize("op", CUDA_OPS)
def test_enable_cuda(benchmark, op, impl):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(2)
    index = zipf_index(CUDA_ROWS, CUDA_TABLE, ZIPF_EXPONENT, gen).cuda()
    src = torch.randn(CUDA_ROWS, CUDA_FEATURES, generator=gen).cuda()
    work = torch.zeros(CUDA_TABLE, CUDA_FEATURES, device="cuda")
    call = {"index_add_": lambda: work.index_add_(0, index, src),
            "index_put_ accumulate": lambda: work.index_put_((index,), src, accumulate=True)}[op]
    benchmark.group = f"enable cuda {op} zipf"
    info = {"primitive": "enable", "op": op, "device": "cuda", "dtype": "fp32", "impl": impl,
            "case": f"zipf {CUDA_ROWS}x{CUDA_FEATURES} -> {CUDA_TABLE}", "mode": MODE,
            "max_ulps": None}
    baseline = f"test_enable_cuda[{op}-torch]" if impl != "torch" else None
    if impl != "switch":
        detsum.disable()  # torch's kernels alone (see _time_switched)
    before = detsum.switch.counts.copy()
    try:
        torch.use_deterministic_algorithms(impl == "torch deterministic")
        with detsum.deterministic(MODE) if impl == "switch" else contextlib.nullcontext():
            run_case(benchmark, call, "cuda", rounds=50, warmup_rounds=3, info=info,
                     baseline=baseline, baseline_case=baseline)
    finally:
        torch.use_deterministic_algorithms(False)
    calls = detsum.switch.counts - before
    assert (impl == "switch") == bool(calls) and all(how == "detsum" for _, how in calls)
