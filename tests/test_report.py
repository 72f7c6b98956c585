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
from detsum import report


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
        before = lines.index(f"compiling the {library} kernels for {name} (first run only: "
                             f"later runs load them from the disk cache) ...")
        after = next(i for i, line in enumerate(lines)
                     if line.startswith(f"... {name} kernels ready in "))
        assert before < after < first_row, name
        assert re.fullmatch(rf"\.\.\. {name} kernels ready in \d+\.\d+ s \(.+\)", lines[after])
    steps = [s for s in data["warmup"] if s["dtype"] is not None]
    assert [s["dtype"] for s in steps] == list(report.DTYPES)
    for step in data["warmup"]:
        assert isinstance(step["seconds"], float) and step["seconds"] > 0, step
    if library == "Numba":
        # Whether Numba compiled or loaded from its cache is known, not guessed.
        assert all(isinstance(s["compiled"], bool) for s in steps)
    assert "kernels, before the table: " in proc.stdout


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
    assert re.search(r"\d\.\d\d +±\d+%", proc.stdout), "no 'ratio ±spread' in the table"


def test_spread_of_runs():
    assert report.spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    # One run held up by the scheduler moves neither the median nor the middle half.
    assert report.spread([1.0] * 6 + [100.0]) == 0.0
    with pytest.raises(ValueError, match="at least 2 timed runs"):
        report.spread([1.0])


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
    # The rule's edge, both sides of 1 (exact in binary).
    assert report.is_noisy(0.5, 1.0) and not report.is_noisy(0.5, 0.99)
    assert report.is_noisy(2.0, 1.0) and not report.is_noisy(2.0, 0.99)


# ---- what the output explains -------------------------------------------------------------------

def test_legend_names_every_column(quick_report):
    proc, _ = quick_report
    lines = proc.stdout.splitlines()
    start = lines.index("columns:")
    explained = {}
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        if not line.startswith("   "):  # an entry, not a continuation line
            header, _, meaning = line.strip().partition("  ")
            explained[header] = meaning.strip()
    headers = [c.header for c in report.COLUMNS]
    assert list(explained) == headers
    assert all(explained.values()), explained
    # The table's own header row has the same columns.
    assert all(h in lines[3] for h in headers)
    assert "+b, -RN(b(1-2^-j))" in proc.stdout


def test_one_verdict_per_mode(quick_report):
    proc, data = quick_report
    lines = proc.stdout.splitlines()
    start = lines.index("verdict per mode, from the rows above:")
    verdicts = lines[start + 1:]
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
