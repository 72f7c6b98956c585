"""benches/summarize.py reads every committed benchmark result: its table and its targets."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCHES = pathlib.Path(__file__).resolve().parent.parent / "benches"
RESULTS = sorted((BENCHES / "results").glob("*.json"))


@pytest.fixture(scope="module")
def summarize():
    sys.path.insert(0, str(BENCHES))
    try:
        import summarize as module
    finally:
        sys.path.remove(str(BENCHES))
    return module


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_committed_result_summarises(summarize, path, capsys):
    data = json.loads(path.read_text())
    lines = summarize.targets(data)
    assert all(isinstance(line, str) for line in lines)
    assert summarize.main([str(path)]) == 0
    assert capsys.readouterr().out.strip()
