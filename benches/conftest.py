"""Shared pieces of the benchmarks: devices, timing, bytes and GB/s, errors against the exact sum.

Every benchmark case records in ``benchmark.extra_info``:

- ``bytes``: the fewest bytes the op must move (each input read once, each output written
  once, the index read once), and ``gbps`` = bytes / median time;
- ``baseline`` and ``ratio_to_baseline``: median time over the median time of the matching
  torch op (``torch.Tensor.index_add_`` for the MoE index_add case, ``torch.segment_reduce``
  for segment_sum, ``torch.scatter_reduce`` for scatter_reduce); ``< 1`` means faster than
  torch. The baseline's median comes from its own case in the same run
  (``baseline_case``, filled in by ``pytest_benchmark_update_json``), or, when that case was
  deselected, from a session fixture that times it once with the same method
  (``time.perf_counter`` around synchronized calls); ``ratio_source`` says which;
- ``max_ulps``: the largest error in ulps against the exact result rounded once
  (``detsum.reference.exact_sum_rounded``) on a fixed sample of output rows;
- device, dtype, shape, implementation and mode.

Numba compiles on the first call of each signature: every case runs its op once (for the
error) before timing, and pedantic runs add warmup rounds on top, so compilation is never timed.
On CUDA each timed call ends with ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

import detsum
from detsum import measure
from detsum.kernels import native

# The switch's C++ kernels, built before any case (else the first ``enable`` builds them in a
# thread while cases run on its Python kernels, and the compiler shares the machine).
NATIVE_BUILD = native.build() or "built"

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPE_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
             torch.float64: "fp64"}


def sync(device) -> None:
    measure.sync(device)


def timed(fn: Callable[[], object], device) -> Callable[[], None]:
    """``fn`` followed by a device synchronize, so the host clock sees the finished work."""
    if torch.device(device).type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def skip_unsupported(fn: Callable[[], object]) -> object:
    """Run ``fn`` once; skip the case cleanly where detsum has no kernel for the device yet."""
    try:
        return fn()
    except NotImplementedError as e:
        pytest.skip(f"detsum: {e}")


def index_add_impl(impl: str, work: torch.Tensor, index: torch.Tensor, source: torch.Tensor
                   ) -> Callable[[], object]:
    """One in-place index_add into ``work`` by ``impl``: "detsum-<mode>", "detsum-<mode>-plan"
    (with a ``detsum.plan`` of the index, made here, once: the form of a backward that reuses
    its forward's plan, as ``detsum.moe`` does), "torch-index_add_" (atomics on CUDA) or
    "torch-index_put_" (accumulate=True: autograd's own path)."""
    if impl.endswith("-plan"):
        mode = impl.removeprefix("detsum-").removesuffix("-plan")
        plan = detsum.plan(index, work.shape[0])
        return lambda: detsum.index_add_(work, 0, index, source, mode=mode, plan=plan)
    if impl.startswith("detsum-"):
        mode = impl.removeprefix("detsum-")
        return lambda: detsum.index_add_(work, 0, index, source, mode=mode)
    if impl == "torch-index_add_":
        return lambda: work.index_add_(0, index, source)
    return lambda: work.index_put_((index,), source, accumulate=True)


class Baselines:
    """Median times of torch baselines whose own case is not in this session (see run_case)."""

    def __init__(self, selected: set[str]):
        self._selected = selected
        self._cache: dict[tuple, float] = {}

    def median(self, case: str, key: tuple, fn: Callable[[], object], device, *,
               reps: int) -> float | None:
        """None when ``case`` runs in this session: its own median gives the ratio then."""
        if case in self._selected:
            return None
        if key not in self._cache:
            self._cache[key] = measure.median_seconds(fn, device, reps=reps, warmup=2)
        return self._cache[key]


@pytest.fixture(scope="session")
def baselines(request) -> Baselines:
    return Baselines({item.name for item in request.session.items})


def run_case(benchmark, fn: Callable[[], object], device, *, rounds: int, warmup_rounds: int,
             info: dict, baseline: str | None = None, baseline_case: str | None = None,
             baseline_s: float | None = None, iterations: int = 1) -> None:
    """Time ``fn`` with pytest-benchmark and fill ``extra_info`` (see the module docstring).

    ``baseline`` names the torch op compared with, ``baseline_case`` its benchmark's name;
    ``baseline_s`` is its session-fixture median when that case does not run in this session.
    """
    extra = benchmark.extra_info
    extra.update(info)
    benchmark.pedantic(timed(fn, device), rounds=rounds, warmup_rounds=warmup_rounds,
                       iterations=iterations)
    stats = benchmark.stats.stats if benchmark.stats is not None else None
    median = stats.median if stats is not None and stats.rounds else None
    extra["median_s"] = median
    if median and "bytes" in extra:
        extra["gbps"] = extra["bytes"] / median / 1e9
    if baseline is not None:
        extra["baseline"] = baseline
        extra["baseline_case"] = baseline_case
    if baseline_s is not None and median:
        extra["baseline_median_s"] = baseline_s
        extra["ratio_to_baseline"] = median / baseline_s


def pytest_configure(config):
    # Benchmark files are named bench_*.py so that the test suite never collects them; this
    # conftest loads only when benches/ is on the command line.
    config.addinivalue_line("python_files", "bench_*.py")


def pytest_sessionstart(session):
    _LOAD["start"] = _loadavg()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    # Ratios from the medians of this run: each case against its torch baseline case, timed
    # by pytest-benchmark with the same rounds moments apart (the session fixture's median
    # stays the fallback when the baseline case was deselected).
    medians = {b["name"]: b["stats"]["median"] for b in output_json["benchmarks"]}
    for b in output_json["benchmarks"]:
        extra = b["extra_info"]
        name = extra.get("baseline_case")
        if name in medians:
            extra["baseline_median_s"] = medians[name]
            extra["ratio_to_baseline"] = b["stats"]["median"] / medians[name]
            extra["ratio_source"] = "baseline case, same run"
        elif "ratio_to_baseline" in extra:
            extra["ratio_source"] = "session fixture"
    from summarize import targets

    output_json["detsum_targets"] = targets(output_json)
    # Other processes on the machine move the numbers: keep the load next to them.
    output_json["detsum_load_average"] = {"start": _LOAD.get("start"), "end": _loadavg()}
    output_json["detsum_environment"] = _environment()


_LOAD: dict = {}


def _environment() -> dict:
    """What the numbers were measured with: pytest-benchmark's machine_info names the CPU only."""
    import numba

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
        "numba": numba.__version__, "switch_native_kernels": NATIVE_BUILD,
    }


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None
