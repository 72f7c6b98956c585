"""``python -m detsum report --quick``: runs end to end and reports what the contract promises."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
import torch

import detsum
from detsum import measure, report


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    path, picture = folder / "report.json", folder / "report.png"
    command = [sys.executable, "-m", "detsum", "report", "--quick", "--json", str(path),
               "--plot", str(picture)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert picture.read_bytes().startswith(b"\x89PNG"), "--plot wrote no PNG"
    return proc, json.loads(path.read_text())


def test_every_row_present(quick_report):
    _, data = quick_report
    got = {(r["primitive"], r["mode"], r["dtype"]) for r in data["rows"]}
    expected = {(p, m, d) for p in report.PRIMITIVES for m in detsum.MODES for d in report.DTYPES}
    assert got == expected
    assert len(data["rows"]) == len(expected)


def test_table_and_progress(quick_report):
    proc, data = quick_report
    header = proc.stdout.splitlines()[0]
    env = data["environment"]
    for part in (env["device"], torch.__version__, env["detsum"], env["numba"]):
        assert part in header
    # One progress line per row on stderr, the table on stdout.
    assert sum(" ulps " in line or "detsum:" in line for line in proc.stderr.splitlines()) == len(
        data["rows"])
    assert "autograd" in proc.stdout and "ulps well" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the report runs on CUDA there")
def test_cpu_contract(quick_report):
    _, data = quick_report
    assert data["environment"]["device"] == "cpu"
    for row in data["rows"]:
        where = (row["primitive"], row["mode"], row["dtype"])
        assert not row.get("error"), where
        # Only the autograd column has an agreement value; on CPU it must agree bit for bit.
        assert row["autograd_match"] is (True if row["mode"] == "autograd" else None), where
        assert row["deterministic"] is True, where
        if row["mode"] == "kahan":
            assert row["ulps_well"] <= 1, where
        assert row["ms"] > 0 and row["torch_ms"] > 0, where


def test_table_formats_missing_backend():
    """A device without detsum kernels shows n/a instead of failing the whole report."""
    row = {"primitive": "index_add", "mode": "autograd", "dtype": "bf16", "torch_op": "x",
           "torch_ulps_well": 1.0, "torch_ulps_cancel": 2.0, "torch_deterministic": False,
           "torch_ms": 1.0, "torch_spread": 0.1, "error": "not implemented yet",
           "autograd_match": None, "ulps_well": None, "ulps_cancel": None,
           "deterministic": None, "ms": None, "spread": None, "ratio": None,
           "ratio_spread": None, "noisy": None}
    data = {"environment": report.environment(torch.device("cpu")),
            "sizes": dataclasses.asdict(report.QUICK), "elapsed_s": 0.0, "rows": [row]}
    text = report.format_table(data)
    assert "n/a: not implemented yet" in text
    assert text.count("n/a") >= 5
    assert "autograd: not run in any row: not implemented yet" in text


# ---- kernel warm-up -----------------------------------------------------------------------------

def test_compile_lines_before_the_rows(quick_report):
    """Each dtype's kernels are announced before they compile (or load) and timed after, all
    before the first row; the JSON has the same steps."""
    proc, data = quick_report
    lines = proc.stderr.splitlines()
    library = "Numba" if data["environment"]["device"] == "cpu" else "Triton"
    first_row = next(i for i, line in enumerate(lines) if " ulps " in line or "detsum:" in line)
    for name in report.DTYPES:
        before = next(i for i, line in enumerate(lines)
                      if line.startswith(f"preparing the {library} kernels for {name} "))
        after = next(i for i, line in enumerate(lines) if line.startswith(f"... {name} kernels "))
        assert before < after < first_row, name
        assert re.fullmatch(rf"\.\.\. {name} kernels (compiled in|loaded from the disk cache in"
                            rf"|ready in) \d+\.\d+ s.*", lines[after])
    steps = [s for s in data["warmup"] if s["dtype"] is not None]
    assert [s["dtype"] for s in steps] == list(report.DTYPES)
    for step in data["warmup"]:
        assert isinstance(step["seconds"], float) and step["seconds"] > 0, step
    if library == "Numba":
        # Whether Numba compiled or loaded from its cache is known, not guessed, and
        # "compiling" is said for exactly the dtypes that compiled.
        assert all(isinstance(s["compiled"], bool) for s in steps)
        for step in steps:
            said = any(line.startswith(f"compiling the Numba kernels for {step['dtype']}:")
                       for line in lines)
            assert said is step["compiled"], step
    assert "kernels, before the table: " in proc.stdout


def _fresh_numba_function():
    """A kernel no cache holds: calling it compiles."""
    import numba

    @numba.njit(cache=False)
    def add_one(x):
        return x + 1

    return add_one


def test_compilation_announced_only_when_numba_compiles():
    said = []
    compiled = _fresh_numba_function()
    compiled(1)
    with report._announced_compilations(torch.device("cpu"), lambda: said.append(1)) as events:
        compiled(2)  # already compiled: nothing to announce
    assert said == [] and events == []
    fresh = _fresh_numba_function()
    with report._announced_compilations(torch.device("cpu"), lambda: said.append(1)) as events:
        fresh(1)
        fresh(1.5)  # a second signature: a second compilation, announced once
    assert said == [1] and len(events) == 2


def _warm_up_lines(monkeypatch, kernel_call) -> tuple[list[str], list[dict]]:
    lines: list[str] = []
    monkeypatch.setattr(report, "detsum_fn", lambda primitive, case, mode: kernel_call)
    steps = report.warm_up(report.QUICK, torch.device("cpu"), progress=lines.append)
    return lines, steps


def test_warm_up_says_loaded_not_compiling_when_nothing_compiles(monkeypatch):
    """Kernels that load from Numba's disk cache (here: nothing to compile at all) are never
    announced as compiling."""
    lines, steps = _warm_up_lines(monkeypatch, lambda: None)
    assert not any("compiling" in line for line in lines), lines
    for name in report.DTYPES:
        assert f"preparing the Numba kernels for {name} ..." in lines
        assert any(line.startswith(f"... {name} kernels loaded from the disk cache in ")
                   for line in lines), lines
    assert [s["compiled"] for s in steps] == [False] * len(report.DTYPES)


def test_warm_up_announces_a_compilation_as_it_starts(monkeypatch):
    def compiles():
        _fresh_numba_function()(1)

    lines, steps = _warm_up_lines(monkeypatch, compiles)
    for name in report.DTYPES:
        before = lines.index(f"preparing the Numba kernels for {name} ...")
        announced = lines.index(f"compiling the Numba kernels for {name}: not in the disk cache "
                                f"yet (later runs load them from there) ...")
        after = next(i for i, line in enumerate(lines)
                     if line.startswith(f"... {name} kernels compiled in "))
        assert before < announced < after
    assert [s["compiled"] for s in steps] == [True] * len(report.DTYPES)


class _FakeSecondProcess:
    """Stands in for ``report._SecondProcess``: records what it was handed, ends at once."""

    started: list[tuple[str, ...]] = []
    fails = False

    def __init__(self, dtype_names, sizes):
        type(self).started.append(tuple(dtype_names))
        self.seconds, self.failure = None, None

    def wait(self):
        if self.fails:
            self.failure = "exit status 1: boom"
            return False
        self.seconds = 1.0
        return True


def _warm_up_with_second_process(monkeypatch, compiles_for, fails=False):
    """warm_up with the second process asked for and faked; a kernel call compiles a fresh
    Numba function for the dtypes in ``compiles_for`` and does nothing for the others."""
    monkeypatch.setattr(_FakeSecondProcess, "started", [])
    monkeypatch.setattr(_FakeSecondProcess, "fails", fails)
    monkeypatch.setattr(report, "_SecondProcess", _FakeSecondProcess)
    names = {dtype: name for name, dtype in report.DTYPES.items()}

    def kernel_call(primitive, case, mode):
        if names[case.src.dtype] in compiles_for:
            return lambda: _fresh_numba_function()(1)
        return lambda: None

    monkeypatch.setattr(report, "detsum_fn", kernel_call)
    lines: list[str] = []
    steps = report.warm_up(report.QUICK, torch.device("cpu"), progress=lines.append,
                           second_process=("bf16", "fp64"))
    return lines, steps


def test_a_cold_cache_hands_dtypes_to_a_second_process(monkeypatch):
    """The first compilation starts the second process with its dtypes; this process
    compiles the others, then waits for it and loads its dtypes from the disk cache."""
    lines, steps = _warm_up_with_second_process(monkeypatch, {"fp32", "fp16"})
    assert _FakeSecondProcess.started == [("bf16", "fp64")]
    compiling = lines.index("compiling the Numba kernels for fp32: not in the disk cache yet "
                            "(later runs load them from there) ...")
    assert lines[compiling + 1] == ("compiling the bf16 and fp64 kernels in a second process "
                                    "meanwhile ...")
    bf16 = lines.index("preparing the Numba kernels for bf16 ...")
    assert lines[bf16 + 1] == "waiting for the second process ..."
    assert re.fullmatch(r"\.\.\. bf16 kernels loaded from the disk cache in \d+\.\d+ s, waiting "
                        r"included \(the second process compiled bf16 and fp64 in 1\.00 s\)",
                        lines[bf16 + 2])
    assert not any(line.startswith(("compiling the Numba kernels for bf16",
                                    "compiling the Numba kernels for fp64")) for line in lines)
    assert [(s["dtype"], s["compiled"], s.get("second_process_s")) for s in steps] == [
        ("fp32", True, None), ("fp16", True, None), ("bf16", False, 1.0), ("fp64", False, 1.0)]


def test_a_warm_cache_starts_no_second_process(monkeypatch):
    lines, steps = _warm_up_with_second_process(monkeypatch, set())
    assert _FakeSecondProcess.started == []
    assert not any("second process" in line for line in lines), lines
    assert [s["compiled"] for s in steps] == [False] * len(report.DTYPES)


def test_a_failed_second_process_leaves_its_dtypes_to_this_one(monkeypatch):
    lines, steps = _warm_up_with_second_process(monkeypatch, set(report.DTYPES), fails=True)
    assert ("the second process failed (exit status 1: boom): compiling the bf16 kernels here"
            in lines)
    for name in ("bf16", "fp64"):
        assert any(line.startswith(f"compiling the Numba kernels for {name}: ")
                   for line in lines), lines
    assert [s["compiled"] for s in steps] == [True] * len(report.DTYPES)
    assert not any("second_process_s" in s for s in steps)


def test_the_second_process_warms_the_disk_cache_or_says_why_not():
    """A real second process: it runs the kernels of its dtype and ends; one handed a dtype
    the report has not ends with the error's last line."""
    warm = report._SecondProcess(["fp32"], report.QUICK)
    assert warm.wait() and warm.seconds > 0 and warm.failure is None
    broken = report._SecondProcess(["fp8"], report.QUICK)
    assert not broken.wait() and broken.seconds is None
    assert broken.failure == "exit status 1: ValueError: 'fp8' is not in list"


# ---- timing: spread and the noisy flag -----------------------------------------------------------

def test_spread_fields(quick_report):
    proc, data = quick_report
    for row in data["rows"]:
        if row.get("error"):
            continue
        where = (row["primitive"], row["mode"], row["dtype"])
        for key in ("spread", "torch_spread", "ratio_spread"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (where, key)
            assert row[key] >= 0, (where, key)
        assert row["ratio_spread"] == row["spread"] + row["torch_spread"], where
        assert row["noisy"] is report.is_noisy(row["ratio"], row["ratio_spread"]), where
        assert isinstance(row["timings"], int) and 1 <= row["timings"] <= 1 + report.RETIMES
    if data["machine"]["disturbed"]:
        assert re.search(r" \? +±\d+%", proc.stdout), "no '? ±spread' in the table"
    else:
        assert re.search(r"\d\.\d\d +±\d+%", proc.stdout), "no 'ratio ±spread' in the table"


def test_spread_of_runs():
    assert measure.spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    # One run held up by the scheduler moves neither the median nor the middle half.
    assert measure.spread([1.0] * 6 + [100.0]) == 0.0
    with pytest.raises(ValueError, match="at least 2 timed runs"):
        measure.spread([1.0])


def test_importing_detsum_loads_neither_the_report_nor_its_measurements():
    """The command line's modules load only when the command runs: importing detsum stays as
    quick as the primitives allow, and nothing of the library depends on them."""
    code = ("import sys, detsum; print(sorted(m for m in sys.modules if m in "
            "('detsum.report', 'detsum.figures', 'detsum.measure')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_figures_need_the_measurements_not_the_report():
    """The report draws with the figures' matplotlib setup; the figures measure with
    detsum.measure alone, so neither module imports the other at load time."""
    code = "import sys, detsum.figures; print('detsum.report' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_numba_threads_puts_numba_and_torch_thread_counts_back():
    import numba

    from detsum import _kernel_ops

    _kernel_ops.load_cpu_kernels()
    torch_before, numba_before = torch.get_num_threads(), numba.get_num_threads()
    try:
        with measure.numba_threads(1):
            assert numba.get_num_threads() == 1
            # Numba's OpenMP layer shares its runtime with torch: a count set inside the
            # block may move torch's, and leaving the block must undo that too.
            torch.set_num_threads(1 if torch_before != 1 else 2)
        assert (numba.get_num_threads(), torch.get_num_threads()) == (numba_before,
                                                                      torch_before)
    finally:
        torch.set_num_threads(torch_before)


def test_noisy_rule_on_made_up_timings():
    steady_fast, steady_slow = [1.0, 1.0, 1.02, 0.98, 1.0], [2.0, 2.04, 1.96, 2.0, 2.0]
    # Twice as fast or twice as slow with steady runs: the ratio's side of 1 is clear.
    faster = report.compare_times(steady_fast, steady_slow)
    assert faster["ratio"] == 0.5 and not faster["noisy"]
    slower = report.compare_times(steady_slow, steady_fast)
    assert slower["ratio"] == 2.0 and not slower["noisy"]
    # 10% faster, 10% slower, but detsum's runs vary by more: either side of 1.
    wobbly = [0.6, 0.7, 0.9, 1.1, 1.3]  # median 0.9, middle half 0.7..1.1: spread 0.44
    a = report.compare_times(wobbly, [1.0] * 5)
    assert a["ratio"] == pytest.approx(0.9) and a["noisy"]
    b = report.compare_times([1.1] * 5, [x + 0.1 for x in wobbly])
    assert b["ratio"] == pytest.approx(1.1) and b["noisy"]
    # The rule's edge, both sides of 1 (0.8 * 1.25 and 1.25 / 1.25 round to 1.0).
    assert report.is_noisy(0.8, 0.25) and not report.is_noisy(0.8, 0.24)
    assert report.is_noisy(1.25, 0.25) and not report.is_noisy(1.25, 0.24)
    # Far from 1, but runs spread over NOISY_SPREAD say little about how far.
    assert report.is_noisy(4.0, 0.51) and not report.is_noisy(4.0, 0.5)


def test_wild_spread_is_noisy():
    """A row once printed as '15.89 ±1376%' without the noisy flag: the ratio moved by its
    spread stayed above 1, yet runs that vary fourteenfold rank nothing."""
    assert report.is_noisy(15.89, 13.76)
    detsum_s = [0.10, 0.11, 0.16, 2.9, 3.0]  # the scheduler held up half the runs
    torch_s = [0.010, 0.010, 0.010, 0.011, 0.010]
    timing = report.compare_times(detsum_s, torch_s)
    assert timing["ratio"] == pytest.approx(16.0) and timing["noisy"]


def _made_up_runs(*timings):
    """A stand-in for interleaved_runs that returns the given (detsum, torch) runs in turn."""
    calls = iter(timings)

    def runs(fns, device, *, reps):
        assert len(fns) == 2
        return [list(side) for side in next(calls)]

    return runs


STEADY = ([1.0, 1.0, 1.01, 0.99, 1.0], [2.0, 2.0, 2.02, 1.98, 2.0])  # ratio 0.5, spread 0
UNSTEADY = ([1.0, 1.5, 2.0, 2.5, 3.0], [2.0, 2.0, 2.02, 1.98, 2.0])  # ratio 1, spread 50%


def test_steady_row_timed_once():
    timing = report.timed_comparison(None, None, "cpu", reps=5, runs=_made_up_runs(STEADY))
    assert timing["timings"] == 1 and timing["ratio"] == 0.5 and not timing["noisy"]


def test_unsteady_row_timed_again_and_keeps_the_steadiest():
    timing = report.timed_comparison(None, None, "cpu", reps=5,
                                     runs=_made_up_runs(UNSTEADY, STEADY))
    assert timing["timings"] == 2 and timing["ratio"] == 0.5 and not timing["noisy"]
    # Never steady: every retime is taken, the smallest spread kept, and the row stays noisy.
    wider = ([1.0, 1.0, 2.0, 3.0, 3.0], [2.0] * 5)  # spread 100%
    timing = report.timed_comparison(None, None, "cpu", reps=5,
                                     runs=_made_up_runs(wider, UNSTEADY, wider))
    assert timing["timings"] == 1 + report.RETIMES
    assert timing["ratio_spread"] == 0.5 and timing["noisy"]


# ---- a disturbed run ----------------------------------------------------------------------------

def test_disturbance_from_made_up_loads_and_calibrations():
    # Quiet: others use under half the cores, the calibration call held steady.
    assert report.disturbance(2, [0.1, 0.4, None], [1.40, 1.45, 1.52]) == []
    assert report.disturbance(2, [1.0], [1.0]) == []  # the edge: half the cores is quiet
    (busy,) = report.disturbance(2, [0.2, 1.3], [1.4, 1.5])
    assert busy == ("other processes kept the machine busy: a 1-minute load average of about "
                    "1.3 besides this run's own, on 2 cores")
    (drift,) = report.disturbance(16, [None, None], [1.4, 2.2, 1.5],
                                  report.calibration_name("cpu"))
    assert drift == ("a fixed calibration call (a 512 x 512 float32 matrix product) took 1.40 "
                     "to 2.20 ms during the run, 1.6x apart")
    assert len(report.disturbance(2, [1.9], [0.17, 18.5])) == 2
    # Unknown load (no load average) and a single calibration decide nothing.
    assert report.disturbance(2, [None], [5.0]) == []


def test_own_share_of_the_load_average():
    # Two busy threads over the last minute: 2 * (1 - 1/e) of the load is this process's.
    assert report.own_load([(0.0, 60.0, 120.0)], now=60.0) == pytest.approx(2 * (1 - math.exp(-1)))
    # Ten minutes ago, forgotten; an idle stretch adds nothing.
    assert report.own_load([(0.0, 10.0, 10.0), (10.0, 610.0, 0.0)], now=610.0) < 1e-4


# ---- what the output explains -------------------------------------------------------------------

def _legend(text: str) -> dict[str, str]:
    lines = text.splitlines()
    start = lines.index("columns:")
    explained = {}
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        if not line.startswith("   "):  # an entry, not a continuation line
            header, _, meaning = line.strip().partition("  ")
            explained[header] = meaning.strip()
    return explained


def test_legend_names_every_column(quick_report):
    proc, data = quick_report
    for text, columns in ((proc.stdout, report.NARROW_COLUMNS),
                          (report.format_table(data, wide=True), report.COLUMNS)):
        explained = _legend(text)
        headers = [c.header for c in columns]
        assert list(explained) == headers
        assert all(explained.values()), explained
        # The table's own header row has the same columns.
        header_row = next(line for line in text.splitlines() if line.startswith(headers[0]))
        assert header_row.split() == " ".join(headers).split()
    assert "+b, -RN(b(1-2^-j))" in " ".join(proc.stdout.split())


def _verdict_lines(text: str) -> list[str]:
    """The verdicts under the table, each joined back from its wrapped lines."""
    lines = text.splitlines()
    verdicts: list[str] = []
    for line in lines[lines.index("verdict per mode, from the rows above:") + 1:]:
        if line.startswith("    "):
            verdicts[-1] += " " + line.strip()
        else:
            verdicts.append(line)
    return verdicts


def test_one_verdict_per_mode(quick_report):
    proc, data = quick_report
    verdicts = _verdict_lines(proc.stdout)
    assert [v.split(":")[0] for v in verdicts] == list(detsum.MODES)
    assert verdicts == [data["verdicts"][m] for m in detsum.MODES]
    n = len(report.PRIMITIVES) * len(report.DTYPES)
    if data["environment"]["device"] == "cpu":
        assert f"autograd: bit-identical to torch's autograd in {n}/{n} rows" in verdicts[0]
        assert f"0 ulps (correctly rounded) in {n}/{n} rows" in verdicts[3]


def _good_row(**changes) -> dict:
    row = {"primitive": "index_add", "mode": "autograd", "dtype": "fp32", "torch_op": "x",
           "torch_ulps_well": 2.0, "torch_ulps_cancel": 9.0, "torch_deterministic": True,
           "torch_ms": 2.0, "torch_spread": 0.1, "autograd_match": True, "ulps_well": 0.0,
           "ulps_cancel": 0.0, "deterministic": True, "ms": 1.0, "spread": 0.1,
           "ratio": 0.5, "ratio_spread": 0.2, "noisy": False}
    row.update(changes)
    return row


def test_verdict_reports_a_failure():
    good = _good_row()
    assert report.verdict("autograd", [good, good]).startswith(
        "autograd: bit-identical to torch's autograd in 2/2 rows; deterministic in 2/2 rows")
    bad = _good_row(dtype="bf16", autograd_match=False)
    line = report.verdict("autograd", [good, bad])
    assert "NOT bit-identical to torch's autograd in 1 of 2 rows: index_add bf16" in line
    assert "deterministic in 2/2 rows" in line
    line = report.verdict("autograd", [good, _good_row(deterministic=False)])
    assert "NOT deterministic in 1 of 2 rows: index_add fp32" in line
    line = report.verdict("exact", [_good_row(mode="exact", ulps_cancel=3.0)])
    assert "NOT correctly rounded in 1 of 1 rows: index_add fp32 (3 ulps)" in line
    line = report.verdict("kahan", [_good_row(mode="kahan", ulps_well=2.0)])
    assert "MORE than 1 ulp from the exact sum in 1 of 1 rows: index_add fp32 (2 ulps)" in line
    line = report.verdict("fp32", [_good_row(mode="fp32", noisy=True)])
    assert "1 of 1 ratios noisy" in line


# ---- the table as printed: width, notes, a disturbed run ----------------------------------------

def _made_up_report(*, disturbed=(), **changes) -> dict:
    """A whole report of made-up rows (every primitive, mode and dtype), no measurement."""
    changes = {"timings": 1, **changes}
    rows = [_good_row(primitive=p, mode=m, dtype=d,
                      torch_op="index_put(acc)" if m == "autograd" else p,
                      autograd_match=True if m == "autograd" else None, **changes)
            for p in report.PRIMITIVES for d in report.DTYPES for m in detsum.MODES]
    return {"environment": {"device": "cpu", "device_name": "cpu", "torch": "2.13.0+cpu",
                            "detsum": "0.1.0", "numba": "0.68.1", "python": "3.11.7",
                            "torch_threads": 2, "numba_threads": 2},
            "sizes": dataclasses.asdict(report.FULL), "elapsed_s": 61.0,
            "warmup": [{"step": "numba kernels", "dtype": d, "seconds": 0.4, "compiled": False}
                       for d in report.DTYPES],
            "machine": {"cores": 2, "before": {}, "disturbed": list(disturbed),
                        "samples": [{"at": "after the warm-up", "load": 0.1,
                                     "others_load": 0.1, "calibration_ms": 1.4}]},
            "rows": rows}


def _table_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("mode ", "primitive ")))
    end = next(i for i in range(start, len(lines)) if lines[i] == "" and lines[i + 1] != ""
               and not lines[i + 1].startswith(tuple(report.PRIMITIVES)))
    return lines[start:end]


def test_table_fits_120_columns_even_with_extreme_values():
    """The table once took 180 columns and wrapped in a terminal."""
    extreme = _made_up_report(ulps_well=1.5e7, ulps_cancel=float("inf"), torch_ulps_well=2.5e8,
                              torch_ulps_cancel=9.9e9, ms=98765.4, torch_ms=12345.6,
                              ratio=123.4, ratio_spread=300.3, noisy=True, timings=3)
    extreme["rows"][0].update(error="detsum has no kernels for this device yet", ms=None,
                              ratio=None, ratio_spread=None, noisy=None, ulps_well=None,
                              ulps_cancel=None, deterministic=None, autograd_match=None)
    for data in (extreme, _made_up_report(disturbed=["a reason " * 30])):
        text = report.format_table(data)
        too_wide = [line for line in text.splitlines() if len(line) > 120]
        assert not too_wide, too_wide
    assert ">±100%" in report.format_table(extreme) and "30030%" not in report.format_table(
        extreme)
    # --wide: every column, one flat table.
    wide = report.format_table(extreme, wide=True)
    header = next(line for line in wide.splitlines() if line.startswith("primitive"))
    assert header.split() == " ".join(c.header for c in report.COLUMNS).split()
    assert len(header) > 120


def test_disturbed_run_ranks_no_times():
    reasons = ["other processes kept the machine busy: a 1-minute load average of about 1.9 "
               "besides this run's own, on 2 cores"]
    text = report.format_table(_made_up_report(disturbed=reasons))
    table = _table_lines(text)
    rows = [line for line in table[2:] if line and not line.endswith(":")]  # not block titles
    assert len(rows) == len(report.PRIMITIVES) * len(report.DTYPES) * len(detsum.MODES)
    assert all(re.search(r" \? +±20%", line) for line in rows), rows
    assert "0.50" not in "\n".join(rows)
    under = text.split("\n".join(table), 1)[1]
    assert under.lstrip("\n").startswith("ratio ?: the machine was busy during the run, so no "
                                          "time is ranked: other processes kept the machine busy")
    verdicts = _verdict_lines(text)
    assert all("times not ranked: the machine was busy" in v for v in verdicts), verdicts
    assert not any("the torch op's time" in v for v in verdicts), verdicts
    # The same rows from a quiet run: ratios shown and ranked.
    quiet = report.format_table(_made_up_report())
    assert "ratio ?" not in quiet and re.search(r" 0\.50 +±20%", quiet)
    assert all("0.50-0.50x the torch op's time" in v for v in _verdict_lines(quiet))


def test_autograd_agreement_beside_a_nondeterministic_torch_op_is_explained_under_the_table():
    """'autograd yes ... index_put(acc) ... t.det no' read as a contradiction."""
    data = _made_up_report()
    assert "no contradiction" not in report.format_table(data)
    data["rows"][0]["torch_deterministic"] = False
    text = report.format_table(data)
    under = text.split("\n".join(_table_lines(text)), 1)[1].lstrip("\n")
    assert under.startswith("autograd yes with t.det no: no contradiction. 'autograd' compares "
                            "detsum with torch's gradient computed under")
    assert "torch.use_deterministic_algorithms(True)" in under.split("columns:")[0]


def test_retimed_rows_are_said():
    data = _made_up_report()
    data["rows"][3]["timings"] = 2
    assert (f"1 of {len(data['rows'])} rows were timed more than once"
            in report.format_table(data))
