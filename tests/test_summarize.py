"""benches/summarize.py reads every committed benchmark result: its table and its targets."""

from __future__ import annotations

import json

import pytest
from conftest import BENCHES, bench_module

RESULTS = sorted((BENCHES / "results").glob("*.json"))


@pytest.fixture(scope="module")
def summarize():
    return bench_module("summarize")


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_committed_result_summarises(summarize, path, capsys):
    data = json.loads(path.read_text())
    lines = summarize.targets(data)
    assert all(isinstance(line, str) for line in lines)
    assert summarize.main([str(path)]) == 0
    assert capsys.readouterr().out.strip()
