"""``python -m detsum report --quick``: runs end to end and reports what the contract promises."""

from __future__ import annotations

import dataclasses
import json
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
           "torch_ms": 1.0, "error": "not implemented yet", "autograd_match": None,
           "ulps_well": None, "ulps_cancel": None, "deterministic": None, "ms": None,
           "ratio": None}
    data = {"environment": report.environment(torch.device("cpu")),
            "sizes": dataclasses.asdict(report.QUICK), "elapsed_s": 0.0, "rows": [row]}
    text = report.format_table(data)
    assert "n/a: not implemented yet" in text
    assert text.count("n/a") >= 5


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
