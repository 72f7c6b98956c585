"""``python -m detsum report``: accuracy, agreement, determinism and speed on the present device.

For every primitive (``segment_sum``, ``index_add``, ``scatter_reduce`` with ``"sum"``), every
mode and every float dtype, one row:

- **autograd**: in the ``"autograd"`` column only, whether detsum is bit-identical to what
  PyTorch computes for the gradient: ``x.grad`` of ``x[index]`` for ``index_add`` (from zeros,
  as in the README) and ``segment_sum`` (``index`` = segment of each row), and
  ``input.index_put((index,), src, accumulate=True)`` for ``scatter_reduce``. torch runs with
  ``torch.use_deterministic_algorithms(True)`` there: its default CPU fp32 ``index_put_`` uses
  atomics from 32768 elements with more than one thread and has no fixed answer to agree with.
- **ulps**: the largest error, in ulps of the dtype, against the exact sum rounded once
  (``detsum.reference.exact_sum_rounded``) over a sample of output rows, on two data sets:
  ``well`` (positive terms, condition number 1) and ``cancel`` (cancellation-heavy: terms come
  in pairs ``+b, -RN(b (1 - 2^-j))`` whose exact sum is ``~b 2^-j``; see ``make_source``), for
  detsum and for the matching torch op on the same inputs.
- **det**: three runs give the same bits (detsum: Numba thread counts N, 1, N on CPU; torch:
  its default settings, three times).
- **time**: median wall time of detsum and of the torch op, their calls taking turns
  (``interleaved_runs``); ratio = detsum / torch. Each side's **spread** is the interquartile
  range of its runs over their median, the ratio's is the sum of the two, and a row is
  **noisy** when the ratio moved by that spread either way reaches 1, or when the spread
  exceeds ``NOISY_SPREAD`` (``compare_times``, ``is_noisy``): its runs cannot say which side
  is faster. A row that is noisy or whose spread exceeds ``RETIME_SPREAD`` is timed again, up
  to ``RETIMES`` more times, and keeps its steadiest timing (``timed_comparison``).

A row's spread cannot see a machine that is busy through all of its runs. So the report also
watches the machine (``MachineWatch``): the 1-minute load average less this process's own
share, against the machine's cores, and a fixed calibration call timed after the warm-up,
after every primitive and dtype, and at the end. When other processes kept more than
``BUSY_LOAD_PER_CORE`` of the cores busy, or the calibration call's time moved by more than
``CALIBRATION_DRIFT`` during the run, the run is **disturbed** (``disturbance``): the table and
the verdicts say why and rank no times (the ratio column shows ``?``; the JSON keeps every
measurement).

The torch op is the one a user would otherwise call: ``torch.segment_reduce(src, "sum",
offsets=...)``, ``torch.index_add``, ``torch.scatter_reduce(..., "sum")`` for the "fp32",
"kahan" and "exact" rows, and ``index_put(..., accumulate=True)`` (autograd's own path) for the
"autograd" rows.

What the user sees: before the table, each dtype's kernels prepared and timed (``warm_up``),
so the rows never compile silently. "compiling" is said only when Numba compiles: Numba raises
its ``numba:compile`` event only after its disk cache has no entry for the kernel and its
signature, so the report announces a compilation when the first such event starts and says
"loaded from the disk cache" when none came. On a cold cache and two cores or more, a second
process compiles two of the dtypes meanwhile (``SECOND_PROCESS_DTYPES``), which halves the
wait; the watch counts that process's CPU time as the run's own. The table fits 120 columns
(``NARROW_COLUMNS``, one block per primitive); ``--wide`` prints every column (``COLUMNS``).
Right under the table, notes on what could read as a contradiction (``notes``), then what
every column means (``legend``: the same explanations as above, in the user's words) and one
verdict per mode derived from the rows (``verdict``). The JSON carries all of it: the rows with their spreads,
the warm-up steps, the machine's load and calibration times, and the verdicts.

The data sets, exact references, ulps and timed runs come from ``detsum.measure``, which the
figures, the benchmarks and the tests use too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence

import torch

import detsum
from detsum import _kernel_ops
from detsum.measure import (
    DATASETS,
    default_device,
    exact_rows,
    interleaved_runs,
    make_init,
    make_source,
    max_ulps,
    numba_threads,
    same_bits,
    sample_rows,
    skewed_index,
    spread,
    sync,
    torch_deterministic,
)

PRIMITIVES: tuple[str, ...] = ("segment_sum", "index_add", "scatter_reduce")
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One report's shapes: ``n_src`` source rows of ``h`` columns into ``n_out`` output rows."""

    n_src: int
    n_out: int
    h: int
    sample_rows: int  # output rows compared with the exact sum (Python fractions: slow)
    reps: int  # timed runs per op; the median is reported


# 16384 x 64 source elements (1M): past torch's 32768-element threshold for its parallel CPU
# fp32 index_put_, so the torch "det" column shows what users get by default.
FULL = Sizes(n_src=16384, n_out=2048, h=64, sample_rows=16, reps=7)
QUICK = Sizes(n_src=384, n_out=24, h=8, sample_rows=6, reps=3)


# ---- which side is faster -----------------------------------------------------------------------

# Past this spread (the middle half of one side's runs spread over half its median) a ratio
# says little, on whichever side of 1 it falls.
NOISY_SPREAD = 0.5
# A row whose ratio is noisy or whose spread exceeds RETIME_SPREAD is timed again, up to
# RETIMES more times: a burst of other work seldom lasts through three timings.
RETIME_SPREAD = 0.25
RETIMES = 2


def is_noisy(ratio: float, ratio_spread: float) -> bool:
    """Whether a time ratio's runs varied too much to say which side is faster: the ratio,
    moved by its spread either way, reaches 1 (``ratio / (1 + ratio_spread) <= 1 <= ratio *
    (1 + ratio_spread)``), or the spread exceeds ``NOISY_SPREAD``.
    """
    if ratio_spread > NOISY_SPREAD:
        return True
    return ratio / (1 + ratio_spread) <= 1 <= ratio * (1 + ratio_spread)


def compare_times(detsum_s: Sequence[float], torch_s: Sequence[float]) -> dict:
    """The report's timing fields from detsum's and torch's timed runs (seconds)."""
    ms, torch_ms = 1e3 * statistics.median(detsum_s), 1e3 * statistics.median(torch_s)
    d_spread, t_spread = spread(detsum_s), spread(torch_s)
    ratio = ms / torch_ms
    # To first order, a quotient's relative spread is the sum of its parts'.
    ratio_spread = d_spread + t_spread
    return {"ms": ms, "torch_ms": torch_ms, "spread": d_spread, "torch_spread": t_spread,
            "ratio": ratio, "ratio_spread": ratio_spread,
            "noisy": is_noisy(ratio, ratio_spread)}


def timed_comparison(detsum_call: Callable[[], object], torch_call: Callable[[], object],
                     device: torch.device | str, *, reps: int,
                     runs: Callable[..., list[list[float]]] = interleaved_runs) -> dict:
    """``compare_times`` of the two calls timed in turns; timed again, up to ``RETIMES`` more
    times, while the steadiest timing so far is noisy or spread over ``RETIME_SPREAD``. Returns
    the steadiest (smallest ``ratio_spread``), with ``timings``: how many were taken.

    ``runs`` times the calls (``interleaved_runs``' signature); tests pass made-up runs.
    """
    best = None
    for timings in range(1, RETIMES + 2):
        detsum_s, torch_s = runs([detsum_call, torch_call], device, reps=reps)
        timing = compare_times(detsum_s, torch_s)
        if best is None or timing["ratio_spread"] < best["ratio_spread"]:
            best = timing
        if not best["noisy"] and best["ratio_spread"] <= RETIME_SPREAD:
            break
    return {**best, "timings": timings}


# ---- a disturbed run ----------------------------------------------------------------------------

# Other processes' part of the 1-minute load average, per core, above which the machine is
# called busy: detsum's kernels and torch's ops both run on every core.
BUSY_LOAD_PER_CORE = 0.5
# The calibration call's slowest time over its fastest, each the fastest of a sample's runs,
# above which the machine's speed changed during the run. The fastest of a sample and not its
# median: a hiccup of a few milliseconds (3 of 5 runs, 2.5 ms for 1.3, once in each of two
# cold reports on a quiet 2-core EPYC) made a quiet run "busy"; a machine kept busy slows
# every run.
CALIBRATION_DRIFT = 1.5
# The calibration call is a square float32 matrix product of this size per device type: about
# a millisecond on two CPU cores or on an H100, long enough that a thread's wake-up or a
# kernel launch is lost in it, short enough to repeat after every primitive and dtype.
CALIBRATION_SIZE = {"cpu": 512, "cuda": 4096}


def calibration_name(device: torch.device | str) -> str:
    n = CALIBRATION_SIZE.get(torch.device(device).type, CALIBRATION_SIZE["cpu"])
    return f"a {n} x {n} float32 matrix product"
# The kernel's 1-minute load average forgets as e^(-t / 60 s).
_LOAD_MEMORY_S = 60.0


def machine_cores() -> int:
    """The machine's cores: what its load average counts against (in a container, the load
    average and this count are both the host's)."""
    return os.cpu_count() or 1


def _usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else machine_cores()


def load_average() -> float | None:
    """The 1-minute load average; None where the system has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that ended (the warm-up's second
    process): the run's own share of the load average."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def own_load(cpu_use: Sequence[tuple[float, float, float]], now: float) -> float:
    """This process's part of a 1-minute load average read at ``now``.

    ``cpu_use`` lists intervals ``(start, end, cpu_seconds)`` in wall-clock seconds; each
    counts as ``cpu_seconds / (end - start)`` busy threads over it, forgotten as the load
    average forgets (``e^(-t / 60 s)``).

    >>> round(own_load([(0.0, 60.0, 120.0)], now=60.0), 3)  # two busy threads for a minute
    1.264
    """
    total = 0.0
    for start, end, cpu in cpu_use:
        if end > start:
            busy = cpu / (end - start)
            total += busy * (math.exp(-(now - end) / _LOAD_MEMORY_S)
                             - math.exp(-(now - start) / _LOAD_MEMORY_S))
    return total


def disturbance(cores: int, others_load: Sequence[float | None],
                calibration_ms: Sequence[float], calibration: str = "") -> list[str]:
    """Why the run's times cannot be ranked, in the user's words; empty for a quiet run.

    ``others_load``: other processes' part of the 1-minute load average at each sample (None
    where unknown); ``calibration_ms``: the calibration call's fastest time at each sample;
    ``calibration``: what that call is, for the message (``calibration_name``).
    """
    reasons = []
    known = [x for x in others_load if x is not None]
    if known and max(known) > BUSY_LOAD_PER_CORE * cores:
        reasons.append(f"other processes kept the machine busy: a 1-minute load average of "
                       f"about {max(known):.1f} besides this run's own, on {cores} cores")
    if len(calibration_ms) >= 2:
        fastest, slowest = min(calibration_ms), max(calibration_ms)
        if slowest > CALIBRATION_DRIFT * fastest:
            what = f" ({calibration})" if calibration else ""
            reasons.append(f"a fixed calibration call{what} took {fastest:.2f} to "
                           f"{slowest:.2f} ms during the run, {slowest / fastest:.1f}x apart")
    return reasons


class MachineWatch:
    """Samples the machine through a report: other processes' load and a calibration call.

    Created before the warm-up, it reads the load at once (what the machine was doing before
    the report started); ``sample`` reads it again and times the calibration call; ``summary``
    is the JSON's ``machine`` entry, with ``disturbed``: the reasons from ``disturbance``,
    computed from the samples taken during the run.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cores = machine_cores()
        gen = torch.Generator().manual_seed(0)
        n = CALIBRATION_SIZE.get(device.type, CALIBRATION_SIZE["cpu"])
        self._matrix = torch.randn(n, n, generator=gen).to(device)
        self._cpu_use: list[tuple[float, float, float]] = []
        now, cpu = time.perf_counter(), _cpu_seconds()
        # Before the first sample, this process imported its modules: about one busy thread
        # for as long as its CPU time.
        self._cpu_use.append((now - cpu, now, cpu))
        self._last = (now, cpu)
        self.before = self._sample("before the warm-up", calibrate=False)
        self.samples: list[dict] = []

    def _sample(self, label: str, *, calibrate: bool) -> dict:
        calibration_ms = None
        if calibrate:
            product = lambda: self._matrix @ self._matrix  # noqa: E731
            calibration_ms = 1e3 * min(interleaved_runs([product], self.device, reps=5)[0])
        now, cpu = time.perf_counter(), _cpu_seconds()
        self._cpu_use.append((self._last[0], now, cpu - self._last[1]))
        self._last = (now, cpu)
        load = load_average()
        others = None if load is None else max(0.0, load - own_load(self._cpu_use, now))
        return {"at": label, "load": load, "others_load": others,
                "calibration_ms": calibration_ms}

    def sample(self, label: str) -> dict:
        """Read the load and time the calibration call; ``label`` says when, for the JSON."""
        entry = self._sample(label, calibrate=True)
        self.samples.append(entry)
        return entry

    def busy_now(self) -> bool:
        """Whether other processes were keeping the machine busy when the report started."""
        return bool(self.before["others_load"] is not None
                    and self.before["others_load"] > BUSY_LOAD_PER_CORE * self.cores)

    def summary(self) -> dict:
        return {
            "cores": self.cores,
            "before": self.before,
            "samples": self.samples,
            "calibration": calibration_name(self.device),
            "disturbed": disturbance(self.cores, [s["others_load"] for s in self.samples],
                                     [s["calibration_ms"] for s in self.samples],
                                     calibration_name(self.device)),
        }


# ---- one report row ---------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """Inputs of one (primitive, dtype, dataset) on the device, plus their exact sample rows."""

    src: torch.Tensor
    index: torch.Tensor  # destination row of each source row (sorted for segment_sum)
    init: torch.Tensor | None  # None for segment_sum (segments start from 0)
    offsets: torch.Tensor | None  # CSR offsets (segment_sum)
    index2: torch.Tensor | None  # index expanded to src's shape (torch.scatter_reduce)
    rows: torch.Tensor
    exact: torch.Tensor


def make_case(primitive: str, dtype: torch.dtype, dataset: str, sizes: Sizes,
              device: torch.device, seed: int, *, with_exact: bool = True) -> Case:
    """The inputs of one row on ``device``; ``with_exact=False`` leaves the exact sample rows
    out (empty), for calls whose results nobody checks (the kernel warm-up)."""
    gen = torch.Generator().manual_seed(seed)
    index = skewed_index(sizes.n_src, sizes.n_out, gen)
    if primitive == "segment_sum":
        index = index.sort().values
    src = make_source(index, sizes.n_out, sizes.h, dtype, dataset, gen)
    init = None
    if primitive != "segment_sum":
        init = make_init(sizes.n_out, sizes.h, dtype, dataset, gen)
    if with_exact:
        rows = sample_rows(index, sizes.n_out, sizes.sample_rows, gen)
        exact = exact_rows(src, index, rows, init)
    else:
        rows, exact = torch.zeros(0, dtype=torch.int64), src.new_zeros((0, sizes.h))
    offsets = None
    if primitive == "segment_sum":
        counts = torch.bincount(index, minlength=sizes.n_out)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    index2 = index.view(-1, 1).expand(-1, sizes.h) if primitive == "scatter_reduce" else None
    return Case(src=to(src), index=to(index), init=to(init), offsets=to(offsets),
                index2=to(index2), rows=rows, exact=exact)


def detsum_fn(primitive: str, case: Case, mode: str) -> Callable[[], torch.Tensor]:
    if primitive == "segment_sum":
        return lambda: detsum.segment_sum(case.src, case.offsets, mode=mode)
    if primitive == "index_add":
        return lambda: detsum.index_add(case.init, 0, case.index, case.src, mode=mode)
    return lambda: detsum.scatter_reduce(case.init, 0, case.index, case.src, "sum", mode=mode)


def torch_fn(primitive: str, case: Case, mode: str) -> tuple[str, Callable[[], torch.Tensor]]:
    """The torch op a user would call instead, with its name."""
    if mode == "autograd":
        base = case.init
        if base is None:
            n_out = case.offsets.numel() - 1
            base = case.src.new_zeros((n_out,) + tuple(case.src.shape[1:]))
        return "index_put(acc)", lambda: base.index_put((case.index,), case.src, accumulate=True)
    if primitive == "segment_sum":
        return "segment_reduce", lambda: torch.segment_reduce(case.src, "sum", offsets=case.offsets)
    if primitive == "index_add":
        return "index_add", lambda: torch.index_add(case.init, 0, case.index, case.src)
    return "scatter_reduce", lambda: torch.scatter_reduce(case.init, 0, case.index2, case.src,
                                                          "sum")


def autograd_truth(primitive: str, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch's bits, detsum's "autograd" bits) for the agreement column."""
    with torch_deterministic():
        if primitive == "scatter_reduce":
            expected = case.init.index_put((case.index,), case.src, accumulate=True)
        else:
            n_out = case.init.shape[0] if case.init is not None else case.offsets.numel() - 1
            x = torch.zeros((n_out,) + tuple(case.src.shape[1:]), dtype=case.src.dtype,
                            device=case.src.device, requires_grad=True)
            x[case.index].backward(case.src)
            expected = x.grad
    if primitive == "index_add":
        got = detsum.index_add(torch.zeros_like(expected), 0, case.index, case.src, mode="autograd")
    else:
        got = detsum_fn(primitive, case, "autograd")()
    return expected, got


def three_runs_equal(fn: Callable[[], torch.Tensor], thread_counts: Sequence[int | None]) -> bool:
    outs = []
    for n in thread_counts:
        with numba_threads(n):
            outs.append(fn())
    return all(same_bits(outs[0], o) for o in outs[1:])


def report_row(primitive: str, mode: str, dtype_name: str, cases: dict[str, Case],
               sizes: Sizes, device: torch.device) -> dict:
    """Measure one (primitive, mode, dtype) on prepared cases (one per dataset)."""
    row: dict = {"primitive": primitive, "mode": mode, "dtype": dtype_name}
    well = cases["well"]
    torch_name, _ = torch_fn(primitive, well, mode)
    row["torch_op"] = torch_name

    # torch's side: errors and determinism under its default settings (what users get).
    for dataset, case in cases.items():
        row[f"torch_ulps_{dataset}"] = max_ulps(torch_fn(primitive, case, mode)[1](), case.rows,
                                                case.exact)
    tfn = torch_fn(primitive, well, mode)[1]
    row["torch_deterministic"] = three_runs_equal(tfn, (None, None, None))

    dfn = detsum_fn(primitive, well, mode)
    try:
        dfn()  # warm_up compiled the kernels already; this only checks that one exists
    except NotImplementedError as e:
        row["error"] = str(e)
        for key in ("autograd_match", "ulps_well", "ulps_cancel", "deterministic", "ms",
                    "spread", "ratio", "ratio_spread", "noisy", "timings"):
            row[key] = None
        (t_runs,) = interleaved_runs([tfn], device, reps=sizes.reps)
        row["torch_ms"], row["torch_spread"] = 1e3 * statistics.median(t_runs), spread(t_runs)
        return row
    if mode == "autograd":
        row["autograd_match"] = all(same_bits(*autograd_truth(primitive, c))
                                    for c in cases.values())
    else:
        row["autograd_match"] = None
    for dataset, case in cases.items():
        row[f"ulps_{dataset}"] = max_ulps(detsum_fn(primitive, case, mode)(), case.rows, case.exact)
    if device.type == "cpu":
        import numba

        _kernel_ops.load_cpu_kernels()

        n = numba.get_num_threads()
        row["deterministic"] = three_runs_equal(dfn, (n, 1, n))
    else:
        row["deterministic"] = three_runs_equal(dfn, (None, None, None))
    row.update(timed_comparison(dfn, tfn, device, reps=sizes.reps))
    return row


# ---- kernel warm-up ---------------------------------------------------------------------------

_KERNEL_LIBRARY = {"cpu": "Numba", "cuda": "Triton"}


@contextlib.contextmanager
def _announced_compilations(device: torch.device, announce: Callable[[], None]):
    """Call ``announce`` once, when Numba starts compiling in the block; yield a list that
    holds one entry per compilation once the block ends (None off the CPU).

    Numba raises its ``numba:compile`` event only after its disk cache has no entry for the
    kernel and signature (``Dispatcher.compile``): a kernel loaded from the cache raises none,
    so the announcement comes exactly when a compilation starts, and an empty list after the
    block means everything was loaded.
    """
    if device.type != "cpu":
        yield None
        return
    from numba.core import event

    class Announcer(event.Listener):
        def __init__(self):
            self.compilations: list[object] = []

        def on_start(self, started):
            if not self.compilations:
                announce()
            self.compilations.append(started.data["dispatcher"])

        def on_end(self, ended):
            pass

    announcer = Announcer()
    with event.install_listener("numba:compile", announcer):
        yield announcer.compilations


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x < 10 else f"{x:.1f} s"


#: On a cold disk cache, the dtypes whose CPU kernels a second process compiles while this
#: one compiles the others (``warm_up``'s ``second_process``; ``run`` asks for it where the
#: process may use two cores or more). Each dtype's kernels take 7-8 s to compile on a 2-core
#: EPYC, all four 30 s: two processes take about half of that.
SECOND_PROCESS_DTYPES: tuple[str, ...] = ("bf16", "fp64")
#: How long ``warm_up`` waits for the second process before compiling its dtypes itself.
SECOND_PROCESS_TIMEOUT_S = 300.0


def _warm_up_cases(dtype_name: str, sizes: Sizes, device: torch.device
                   ) -> list[tuple[str, Case]]:
    """(primitive, case) for each primitive and data set, of the report's shapes, in
    ``dtype_name``. Both data sets: "exact" takes another kernel where the terms cancel (its
    fast path's certificate fails), which compiled silently in the first row when the warm-up
    had "well" alone (2.9 s for fp32)."""
    d_i = list(DTYPES).index(dtype_name)
    return [(primitive, make_case(primitive, DTYPES[dtype_name], dataset, sizes, device,
                                  seed=100 * d_i + 10 * k + p_i, with_exact=False))
            for k, dataset in enumerate(DATASETS) for p_i, primitive in enumerate(PRIMITIVES)]


def _call_every_kernel(cases: list[tuple[str, Case]]) -> None:
    """One call per case and mode: every kernel the table's rows of these cases use."""
    for primitive, case in cases:
        for mode in detsum.MODES:
            try:
                detsum_fn(primitive, case, mode)()
            except NotImplementedError:
                pass  # the row says so, as "n/a"


def warm_dtypes(dtype_names: Sequence[str], sizes: Sizes) -> None:
    """Compile (or load) the CPU kernels of ``dtype_names`` into Numba's disk cache, without a
    word: the second process's work (``_SecondProcess``)."""
    device = torch.device("cpu")
    for name in dtype_names:
        _call_every_kernel(_warm_up_cases(name, sizes, device))


class _SecondProcess:
    """A second Python process running ``warm_dtypes``, started at once. Its saves to Numba's
    disk cache are safe beside this process's (``detsum.kernels.numba``'s save lock), and it
    imports detsum from this process's ``sys.path``."""

    def __init__(self, dtype_names: Sequence[str], sizes: Sizes):
        self.dtype_names = tuple(dtype_names)
        self.seconds: float | None = None  # how long it took, once it finished its work
        self.failure: str | None = None
        self._started = time.perf_counter()
        code = (f"import sys; sys.path[:0] = {sys.path!r}; "
                "from detsum.report import Sizes, warm_dtypes; "
                f"warm_dtypes({list(self.dtype_names)!r}, Sizes(**{dataclasses.asdict(sizes)!r}))")
        self._process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         text=True)

    def wait(self) -> bool:
        """Wait for it to end; True when it did its work (``failure`` says why not)."""
        if self.seconds is None and self.failure is None:
            try:
                _, errors = self._process.communicate(timeout=SECOND_PROCESS_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.communicate()
                self.failure = f"no end after {SECOND_PROCESS_TIMEOUT_S:.0f} s"
            else:
                if self._process.returncode == 0:
                    self.seconds = time.perf_counter() - self._started
                else:
                    last = (errors.strip().splitlines() or ["no message"])[-1]
                    self.failure = f"exit status {self._process.returncode}: {last}"
        return self.failure is None


def warm_up(sizes: Sizes, device: torch.device, *,
            progress: Callable[[str], None] | None = None,
            second_process: Sequence[str] = ()) -> list[dict]:
    """Compile (or load from the disk cache) every kernel the table uses, one dtype at a time,
    saying which and how long it took: one call per primitive and mode on inputs of the
    report's shapes.

    Without it the first row of each dtype compiled silently for tens of seconds. The shapes
    are the report's own because Triton specializes a kernel on its arguments (a size of 1,
    one divisible by 16): a toy shape could compile a variant the table never runs. On the CPU,
    "compiling" is printed when Numba starts compiling (``_announced_compilations``), never
    for a load from its disk cache. Returns one entry per step, for the JSON: ``seconds``, and
    ``compiled`` (True / False on the CPU, None where it cannot be told).

    ``second_process`` (CPU only): dtypes whose kernels a second process compiles
    (``_SecondProcess``), started when the first compilation here starts, the sign of a cold
    disk cache. This process compiles the other dtypes meanwhile; at the first of those it
    waits for the second process and then loads their kernels from the disk cache (their
    steps carry ``second_process_s``, how long that process took), or compiles them itself
    if it failed. With a warm cache no second process starts.
    """
    say = progress or (lambda line: None)
    steps = []
    handed = [name for name in second_process if name in DTYPES] if device.type == "cpu" else []
    helper: _SecondProcess | None = None

    def start_second_process():
        nonlocal helper
        if handed and helper is None:
            helper = _SecondProcess(handed, sizes)
            say(f"compiling the {' and '.join(handed)} kernels in a second process meanwhile ...")

    library = _KERNEL_LIBRARY.get(device.type, device.type)
    for dtype_name in DTYPES:
        if device.type == "cpu":
            say(f"preparing the Numba kernels for {dtype_name} ...")
        else:
            say(f"preparing the {library} kernels for {dtype_name} (compiled on first use, or "
                f"loaded from {library}'s cache) ...")
        start = time.perf_counter()
        from_helper = helper is not None and dtype_name in handed
        if from_helper and helper.seconds is None and helper.failure is None:
            say("waiting for the second process ...")
        if from_helper and not helper.wait():
            say(f"the second process failed ({helper.failure}): compiling the {dtype_name} "
                f"kernels here")
            from_helper = False
        cases = _warm_up_cases(dtype_name, sizes, device)

        announcement = (f"compiling the Numba kernels for {dtype_name}: not in the disk cache "
                        f"yet (later runs load them from there) ...")

        def announce(announcement=announcement):
            say(announcement)
            start_second_process()

        with _announced_compilations(device, announce) as compilations:
            _call_every_kernel(cases)
            sync(device)
        seconds = time.perf_counter() - start
        compiled = None if compilations is None else bool(compilations)
        step = {"step": f"{library.lower()} kernels", "dtype": dtype_name, "seconds": seconds,
                "compiled": compiled}
        if compiled is None:
            say(f"... {dtype_name} kernels ready in {_seconds(seconds)} (compiled or loaded "
                f"from {library}'s cache)")
        elif compiled:
            say(f"... {dtype_name} kernels compiled in {_seconds(seconds)}, and saved to the "
                f"disk cache")
        elif from_helper:
            say(f"... {dtype_name} kernels loaded from the disk cache in {_seconds(seconds)}, "
                f"waiting included (the second process compiled {' and '.join(handed)} in "
                f"{_seconds(helper.seconds)})")
            step["second_process_s"] = helper.seconds
        else:
            say(f"... {dtype_name} kernels loaded from the disk cache in {_seconds(seconds)}")
        steps.append(step)
    if helper is not None:
        helper.wait()  # none left running, whatever this run asked of it
    return steps


# ---- the whole report ---------------------------------------------------------------------------

def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(device: torch.device) -> dict:
    import numba

    _kernel_ops.load_cpu_kernels()

    env = {
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "detsum": _version("detsum"),
        "numba": numba.__version__,
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.get_num_threads(),
        "python": sys.version.split()[0],
    }
    return env


def run(sizes: Sizes = FULL, device: torch.device | None = None, *,
        progress: Callable[[str], None] | None = None) -> dict:
    """Every row of the report, with the environment, the kernel warm-up, the machine's load
    and calibration times (``MachineWatch``) and a verdict per mode; ``progress`` gets the
    warm-up's lines, then one line per row."""
    say = progress or (lambda line: None)
    device = device or default_device()
    started = time.perf_counter()
    watch = MachineWatch(device)
    if watch.busy_now():
        say(f"the machine is busy (other processes: load about {watch.before['others_load']:.1f} "
            f"on {watch.cores} cores); if that lasts, times will be shown but not ranked")
    # A second process halves a cold warm-up where it has a core of its own.
    second = SECOND_PROCESS_DTYPES if _usable_cores() >= 2 else ()
    warmup = warm_up(sizes, device, progress=progress, second_process=second)
    watch.sample("after the warm-up")
    rows = []
    for p_i, primitive in enumerate(PRIMITIVES):
        for d_i, (dtype_name, dtype) in enumerate(DTYPES.items()):
            seed = 1000 * p_i + 10 * d_i
            cases = {ds: make_case(primitive, dtype, ds, sizes, device, seed + k)
                     for k, ds in enumerate(DATASETS)}
            for mode in detsum.MODES:
                row = report_row(primitive, mode, dtype_name, cases, sizes, device)
                rows.append(row)
                say(f"[{time.perf_counter() - started:6.1f}s] {primitive} {mode} "
                    f"{dtype_name}: {_summary(row)}")
            watch.sample(f"after {primitive} {dtype_name}")
    machine = watch.summary()
    return {
        "environment": environment(device),
        "sizes": dataclasses.asdict(sizes),
        "elapsed_s": time.perf_counter() - started,
        "warmup": warmup,
        "machine": machine,
        "rows": rows,
        "verdicts": {mode: verdict(mode, rows, disturbed=machine["disturbed"])
                     for mode in detsum.MODES},
    }


def _summary(row: dict) -> str:
    if row.get("error"):
        return f"detsum: {row['error']}"
    return (f"ulps {_num(row['ulps_well'])}/{_num(row['ulps_cancel'])}, "
            f"{_num(row['ms'], 3)} ms vs {row['torch_op']} {_num(row['torch_ms'], 3)} ms")


def _num(x, digits: int | None = None) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if digits is None:
        if math.isinf(x):
            return "inf"
        return f"{x:.0f}" if x < 1e6 else f"{x:.1e}"
    return f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    """Milliseconds with about four significant digits, at most six characters below 1e6."""
    if x is None:
        return "n/a"
    for below, digits in ((10, 3), (100, 2), (1000, 1)):
        if x < below:
            return f"{x:.{digits}f}"
    return f"{x:.0f}"


def _ratio(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _percent(x: float | None) -> str:
    if x is None:
        return "n/a"
    # The JSON keeps the value; past 100% its digits only distract from "these runs varied".
    return f"±{100 * x:.0f}%" if x <= 1 else ">±100%"


WIDTH = 120  # the default table and every line of text around it fit a terminal this wide


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[dict], str]
    # What the column means, printed under the table; {sample_rows} and {reps} are filled in.
    meaning: str


def _autograd_cell(row: dict) -> str:
    if row["mode"] != "autograd":
        return "-"
    return "n/a" if row["autograd_match"] is None else _num(row["autograd_match"])


def _ratio_cell(row: dict) -> str:
    # format_table marks the rows of a disturbed run: their ratios are not ranked.
    return "?" if row.get("withheld") and row.get("ratio") is not None else _ratio(row["ratio"])


def _noisy_cell(row: dict) -> str:
    if row.get("noisy") is None:
        return "n/a"
    return "yes" if row["noisy"] else ""


def _pair(a: float | None, b: float | None) -> str:
    return "n/a" if a is None and b is None else f"{_num(a)}/{_num(b)}"


_ULPS_MEANING = ("detsum's largest error against the exact sum rounded once, in ulps (units in "
                 "the last place of the dtype; 0 = correctly rounded), over {sample_rows} "
                 "sampled output rows")
_WELL_MEANING = "well-conditioned data: positive terms, nothing cancels"
_CANCEL_MEANING = ("cancellation-heavy data: terms come in pairs +b, -RN(b(1-2^-j)), j = 2..12, "
                   "whose exact sum is about b*2^-j, so running sums are up to 4096x the "
                   "result and their rounding errors are many ulps of it; large values here are "
                   "expected of any method that rounds as it goes")
_AUTOGRAD_MEANING = ("'autograd' rows only: yes if detsum gives the very bits of torch's own "
                     "gradient (x.grad of x[index]; index_put(accumulate=True) for "
                     "scatter_reduce) computed with torch.use_deterministic_algorithms(True), "
                     "on both data sets; '-' in the other modes")
_TORCH_DET_MEANING = ("'det' of the torch op with its default settings (what users get; "
                      "deterministic algorithms off)")
_RATIO_MEANING = ("ms / t.ms (< 1: detsum is faster); the detsum and torch calls take turns, so "
                  "both see the same changes in machine load; '?' when the machine was busy "
                  "(said under the table)")
_SPREAD_MEANING = ("how much the timed runs varied: for each side the interquartile range of "
                   "its runs over their median; the two added (JSON: spread, torch_spread, "
                   "ratio_spread)")
_NOISY_MEANING = (f"yes when ratio / (1 + spread) <= 1 <= ratio * (1 + spread), or the spread "
                  f"is over {100 * NOISY_SPREAD:.0f}%: the runs varied too much to tell which "
                  f"side is faster (rows over {100 * RETIME_SPREAD:.0f}% are timed again, up "
                  f"to {RETIMES} times, and keep their steadiest timing)")

#: Every column, for ``--wide``.
COLUMNS: tuple[Column, ...] = (
    Column("primitive", lambda r: r["primitive"],
           "the detsum function measured: segment_sum (rows summed by CSR offsets), index_add, "
           "scatter_reduce(..., 'sum')"),
    Column("mode", lambda r: r["mode"],
           "detsum's accumulation mode (docs/modes.md): autograd = torch's own arithmetic, "
           "fp32 = fp32 accumulator (fp64 for fp64 data) in a fixed order, kahan = compensated, "
           "within 1 ulp unless the terms cancel heavily, exact = correctly rounded"),
    Column("dtype", lambda r: r["dtype"],
           "the data type: float32, float16, bfloat16, float64"),
    Column("autograd", _autograd_cell, _AUTOGRAD_MEANING),
    Column("ulps well", lambda r: _num(r["ulps_well"]), f"{_ULPS_MEANING} of {_WELL_MEANING}"),
    Column("ulps cancel", lambda r: _num(r["ulps_cancel"]), f"the same on {_CANCEL_MEANING}"),
    Column("det", lambda r: _num(r["deterministic"]),
           "yes if three runs give the same bits (CPU: Numba on N threads, then 1, then N)"),
    Column("ms", lambda r: _ms(r["ms"]),
           "detsum's median wall time over {reps} runs, in milliseconds"),
    Column("torch op", lambda r: r["torch_op"],
           "the torch call a user would make instead, on the same inputs; index_put(acc) is "
           "index_put(..., accumulate=True), autograd's own path"),
    Column("t.ulps well", lambda r: _num(r["torch_ulps_well"]), "'ulps well' of the torch op"),
    Column("t.ulps cancel", lambda r: _num(r["torch_ulps_cancel"]),
           "'ulps cancel' of the torch op"),
    Column("t.det", lambda r: _num(r["torch_deterministic"]), _TORCH_DET_MEANING),
    Column("t.ms", lambda r: _ms(r["torch_ms"]), "'ms' of the torch op"),
    Column("ratio", _ratio_cell, _RATIO_MEANING),
    Column("spread", lambda r: _percent(r.get("ratio_spread")), _SPREAD_MEANING),
    Column("noisy", _noisy_cell, _NOISY_MEANING),
)

_BY_HEADER = {column.header: column for column in COLUMNS}

#: The default table, within ``WIDTH`` columns: one block per primitive (its torch op named
#: above it), each data set's ulps in one cell.
NARROW_COLUMNS: tuple[Column, ...] = (
    _BY_HEADER["mode"],
    _BY_HEADER["dtype"],
    _BY_HEADER["autograd"],
    Column("ulps well/cancel", lambda r: _pair(r["ulps_well"], r["ulps_cancel"]),
           f"{_ULPS_MEANING}; before the slash on {_WELL_MEANING}; after it on "
           f"{_CANCEL_MEANING}"),
    _BY_HEADER["det"],
    _BY_HEADER["ms"],
    Column("t.ulps well/cancel", lambda r: _pair(r["torch_ulps_well"], r["torch_ulps_cancel"]),
           "'ulps well/cancel' of the torch op named above the block (index_put(acc) in "
           "'autograd' rows)"),
    _BY_HEADER["t.det"],
    _BY_HEADER["t.ms"],
    _BY_HEADER["ratio"],
    _BY_HEADER["spread"],
    _BY_HEADER["noisy"],
)

# Left-aligned columns: the names; the rest are numbers.
_LEFT = {"primitive", "mode", "dtype", "torch op"}


def _wrap(text: str, indent: str = "    ") -> list[str]:
    return textwrap.wrap(text, width=WIDTH, subsequent_indent=indent,
                         break_on_hyphens=False) or [""]


def legend(sizes: dict, columns: Sequence[Column] = COLUMNS) -> list[str]:
    """One entry per column of the table: what it shows, in the user's words."""
    width = max(len(c.header) for c in columns)
    lines = ["columns:"]
    for column in columns:
        text = column.meaning.format(**sizes)
        lines += textwrap.wrap(text, width=100, initial_indent=f"  {column.header:<{width}}  ",
                               subsequent_indent=" " * (width + 4), break_on_hyphens=False)
    return lines


def notes(report: dict) -> list[str]:
    """What the table could be misread as saying, cleared up right under it: a disturbed
    run's unranked ratios, rows timed more than once, and an "autograd" row that agrees with
    torch while the torch op is not deterministic."""
    rows = report["rows"]
    lines = []
    disturbed = report.get("machine", {}).get("disturbed", [])
    if disturbed:
        lines += _wrap("ratio ?: the machine was busy during the run, so no time is ranked: "
                       + "; ".join(disturbed) + ". The ms columns are what was measured, under "
                       "that load; rerun on a quiet machine to compare speeds (the JSON keeps "
                       "every ratio).")
    retimed = [r for r in rows if (r.get("timings") or 1) > 1]
    if retimed:
        lines += _wrap(f"{len(retimed)} of {len(rows)} rows were timed more than once (their "
                       f"runs varied by over {100 * RETIME_SPREAD:.0f}%); each shows its "
                       f"steadiest timing.")
    if any(r["mode"] == "autograd" and r.get("autograd_match") is True
           and r.get("torch_deterministic") is False for r in rows):
        lines += _wrap("autograd yes with t.det no: no contradiction. 'autograd' compares "
                       "detsum with torch's gradient computed under "
                       "torch.use_deterministic_algorithms(True); t.det runs the torch op with "
                       "its default settings, where index_put(acc) on several CPU threads adds "
                       "with atomics from 32768 elements on, so its bits change from run to "
                       "run. detsum gives the deterministic bits every time.")
    return lines


_NAMES_ONLY = 4  # failing rows named in a verdict before "and N more"


def _row_list(rows: Sequence[dict], detail: Callable[[dict], str] | None = None) -> str:
    names = [f"{r['primitive']} {r['dtype']}" + (f" ({detail(r)})" if detail else "")
             for r in rows]
    if len(names) > _NAMES_ONLY:
        names = names[:_NAMES_ONLY] + [f"and {len(names) - _NAMES_ONLY} more"]
    return ", ".join(names)


def _times(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio < 10 else f"{ratio:.0f}"


def _worst_ulps(row: dict) -> float:
    return max(row["ulps_well"], row["ulps_cancel"])


def verdict(mode: str, rows: Sequence[dict], *, disturbed: Sequence[str] = ()) -> str:
    """One line on ``mode``'s rows: each promise of the mode, kept in how many rows, with the
    rows that break it named; then the error (fp32) and the time against torch, unless
    ``disturbed`` gives reasons why the run's times cannot be ranked (``disturbance``)."""
    mine = [r for r in rows if r["mode"] == mode]
    ran = [r for r in mine if not r.get("error")]
    parts = []

    def check(kept: Callable[[dict], bool], promise: str, broken: str,
              detail: Callable[[dict], str] | None = None) -> None:
        failed = [r for r in ran if not kept(r)]
        if failed:
            parts.append(f"{broken} in {len(failed)} of {len(ran)} rows: "
                         f"{_row_list(failed, detail)}")
        else:
            parts.append(f"{promise} in {len(ran)}/{len(ran)} rows")

    if mine and not ran:
        return f"{mode}: not run in any row: {mine[0]['error']}"
    if mode == "autograd":
        check(lambda r: r["autograd_match"] is True, "bit-identical to torch's autograd",
              "NOT bit-identical to torch's autograd")
    elif mode == "kahan":
        check(lambda r: _worst_ulps(r) <= 1, "within 1 ulp of the exact sum",
              "MORE than 1 ulp from the exact sum", lambda r: f"{_num(_worst_ulps(r))} ulps")
    elif mode == "exact":
        check(lambda r: _worst_ulps(r) == 0, "0 ulps (correctly rounded)",
              "NOT correctly rounded", lambda r: f"{_num(_worst_ulps(r))} ulps")
    check(lambda r: r["deterministic"] is True, "deterministic", "NOT deterministic")
    if mode == "fp32" and ran:
        worst = {k: max(r[k] for r in ran) for k in ("ulps_well", "ulps_cancel",
                                                     "torch_ulps_well", "torch_ulps_cancel")}
        parts.append(f"at most {_num(worst['ulps_well'])} / {_num(worst['ulps_cancel'])} ulps "
                     f"(well / cancel; the torch ops: {_num(worst['torch_ulps_well'])} / "
                     f"{_num(worst['torch_ulps_cancel'])})")
    timed = [r for r in ran if r.get("ratio") is not None]
    if timed and disturbed:
        parts.append("times not ranked: the machine was busy (said under the table)")
    elif timed:
        ratios = sorted(r["ratio"] for r in timed)
        noisy = sum(bool(r["noisy"]) for r in timed)
        parts.append(f"{_times(ratios[0])}-{_times(ratios[-1])}x the torch op's time (median "
                     f"{_times(statistics.median(ratios))}x; {noisy} of {len(timed)} ratios "
                     f"noisy)")
    if len(ran) < len(mine):
        skipped = [r for r in mine if r.get("error")]
        parts.append(f"not run in {len(skipped)} rows: {_row_list(skipped, lambda r: r['error'])}")
    return f"{mode}: " + "; ".join(parts)


def _table(rows: Sequence[dict], columns: Sequence[Column], *, blocks: bool) -> list[str]:
    """The rows under a header line, aligned; a blank line between primitives, and with
    ``blocks`` a line above each naming the primitive and its torch op."""
    headers = [column.header for column in columns]
    cells = [[column.cell(row) for column in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]

    def fmt_line(values):
        return "  ".join(v.ljust(w) if h in _LEFT else v.rjust(w)
                         for v, w, h in zip(values, widths, headers)).rstrip()

    lines = [fmt_line(headers), fmt_line(["-" * w for w in widths])]
    previous = None
    for row, line in zip(rows, cells):
        if row["primitive"] != previous:
            if previous is not None:
                lines.append("")
            if blocks:
                ops = [r["torch_op"] for r in rows
                       if r["primitive"] == row["primitive"] and r["mode"] != "autograd"]
                against = f"torch's {ops[0]}" if ops else "torch"
                lines.append(f"{row['primitive']}, against {against} (the t. columns; in "
                             f"'autograd' rows index_put(acc), autograd's own path):")
        previous = row["primitive"]
        lines.append(fmt_line(line))
    return lines


def format_table(report: dict, *, wide: bool = False) -> str:
    """The report as text: a header, the table, notes, the legend and the verdicts.

    Every line fits ``WIDTH`` columns unless ``wide``, which prints every column of
    ``COLUMNS`` in one flat table (about 180 columns).
    """
    env, sizes = report["environment"], report["sizes"]
    machine = report.get("machine", {})
    disturbed = machine.get("disturbed", [])
    lines = [
        *_wrap(f"detsum report: device {env['device']} ({env['device_name']}), torch "
               f"{env['torch']}, detsum {env['detsum']}, numba {env['numba']}, python "
               f"{env['python']}, threads torch {env['torch_threads']} / numba "
               f"{env['numba_threads']}"),
        *_wrap(f"shapes: {sizes['n_src']} source rows x {sizes['h']} -> {sizes['n_out']} output "
               f"rows (uneven segments); ulps = max error vs the exact sum on "
               f"{sizes['sample_rows']} sampled output rows; times: median of {sizes['reps']}, "
               f"detsum and torch taking turns"),
        "",
    ]
    rows = [{**row, "withheld": bool(disturbed)} for row in report["rows"]]
    columns = COLUMNS if wide else NARROW_COLUMNS
    lines += _table(rows, columns, blocks=not wide)
    under = notes(report)
    if under:
        lines += ["", *under]
    lines += ["", *legend(sizes, columns), ""]
    errors = sorted({row["error"] for row in report["rows"] if row.get("error")})
    for error in errors:
        lines += _wrap(f"n/a: {error}")
    warmup = report.get("warmup", [])
    kernels = [s for s in warmup if s["dtype"] is not None]
    if kernels:
        def how(step):
            if "second_process_s" in step:
                return "compiled by a second process"
            return {True: "compiled", False: "loaded from the disk cache",
                    None: "compiled or loaded from disk"}[step["compiled"]]
        if len({how(s) for s in kernels}) == 1:
            lines += _wrap("kernels, before the table: " + ", ".join(
                f"{s['dtype']} {_seconds(s['seconds'])}" for s in kernels)
                + f" (all {how(kernels[0])})")
        else:
            lines += _wrap("kernels, before the table: " + ", ".join(
                f"{s['dtype']} {_seconds(s['seconds'])} ({how(s)})" for s in kernels))
    calibrations = [s["calibration_ms"] for s in machine.get("samples", [])
                    if s.get("calibration_ms") is not None]
    if calibrations:
        lines += _wrap(f"machine: {machine['cores']} cores; the calibration call "
                       f"({machine.get('calibration', 'a matrix product')}) took "
                       f"{min(calibrations):.2f} to {max(calibrations):.2f} ms over the run; "
                       + ("busy, times not ranked" if disturbed else "quiet"))
    lines.append(f"total {report['elapsed_s']:.1f} s")
    lines += ["", "verdict per mode, from the rows above:"]
    for mode in detsum.MODES:
        lines += _wrap(verdict(mode, report["rows"], disturbed=disturbed))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Draw the report as a PNG: per primitive, the error of each mode and of the torch op
    (max ulps, well-conditioned and cancelling data) and detsum's time over torch's.

    matplotlib is imported here, not with the module: the report itself does not need it.
    """
    from detsum.figures import pyplot_agg

    plt = pyplot_agg()

    rows = [r for r in report["rows"] if not r.get("error")]
    primitives = list(dict.fromkeys(r["primitive"] for r in rows))
    fig, axes = plt.subplots(2, len(primitives), figsize=(5 * len(primitives), 7.5),
                             squeeze=False)
    for column, primitive in enumerate(primitives):
        mine = [r for r in rows if r["primitive"] == primitive]
        labels = [f"{r['mode']} {r['dtype']}" for r in mine]
        x = range(len(mine))
        errors = axes[0][column]
        width = 0.2
        for offset, (key, name) in enumerate((("ulps_well", "detsum, well-conditioned"),
                                              ("ulps_cancel", "detsum, cancelling"),
                                              ("torch_ulps_well", "torch, well-conditioned"),
                                              ("torch_ulps_cancel", "torch, cancelling"))):
            # ulps + 1 on a log axis: 0 ulps (exact) stays visible at the bottom.
            values = [(r[key] if r[key] is not None else float("nan")) + 1 for r in mine]
            errors.bar([i + (offset - 1.5) * width for i in x], values, width, label=name)
        errors.set_yscale("log")
        errors.set_title(f"{primitive}: max error (vs {mine[0]['torch_op']})")
        errors.set_ylabel("max ulps + 1 (1 = exact)")
        errors.set_xticks(list(x), labels, fontsize=7, rotation=60)
        times = axes[1][column]
        times.bar(list(x), [r["ratio"] if r["ratio"] is not None else float("nan")
                            for r in mine], color="tab:gray")
        times.axhline(1.0, color="black", linewidth=0.8)
        title = f"{primitive}: detsum time / torch time (< 1: faster)"
        if report.get("machine", {}).get("disturbed"):
            title += "\nthe machine was busy: not to be ranked"
        times.set_title(title)
        times.set_xticks(list(x), labels, fontsize=7, rotation=60)
    axes[0][0].legend(fontsize=7)
    env = report["environment"]
    fig.suptitle(f"detsum report: {env['device']} ({env['device_name']}), torch {env['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` subcommand's options (``python -m detsum report``, see __main__)."""
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--plot", metavar="PATH",
                        help="also draw the report as a PNG at PATH (needs matplotlib)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes (a few seconds once Numba's cache is warm)")
    parser.add_argument("--wide", action="store_true",
                        help="every column in one flat table (about 180 columns wide); by "
                             "default the table fits 120")


def run_command(args: argparse.Namespace) -> int:
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = run(QUICK if args.quick else FULL, progress=progress)
    print(format_table(report, wide=args.wide))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(report, args.plot)
    return 0
