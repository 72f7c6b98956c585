"""A pytest plugin for ``benches/pyg_tests.py``: PyG's tests with detsum's switch on, counted.

Loaded with ``-p pyg_switch_plugin`` (``benches/`` on ``sys.path``). Two options:

- ``--detsum-mode MODE``: ``detsum.enable(MODE)`` when pytest configures itself, before any
  test module is imported, and ``detsum.disable()`` when it finishes; without it the switch
  stays off and the run is torch's own.
- ``--detsum-report PATH``: write one JSON object there: for each test (its node id), its
  outcome (``"passed"``, ``"failed"``, ``"skipped"``, ``"xfailed"``, ``"xpassed"``, or
  ``"error"`` for a failed setup or teardown) and, from ``detsum.switch.counts``, the calls
  of torch's switched ops during its setup, call and teardown that ran on detsum
  (``detsum_calls``: a test with none never reached detsum's code, whatever its outcome) and
  those that the switch left to torch's own kernel (``torch_calls``: inputs detsum does not
  take, docs/enable.md), each also per op (``detsum_ops``, ``torch_ops``).

Calls made by threads a test starts are counted too, without a lock (``counts`` is exact only
for one thread): a count above zero is what matters here, not the number.
"""

from __future__ import annotations

import json
import pathlib

import pytest

import detsum
from detsum import switch


def pytest_addoption(parser):
    group = parser.getgroup("detsum")
    group.addoption("--detsum-mode", default=None,
                    help="run the session under detsum.enable(MODE)")
    group.addoption("--detsum-report", default=None,
                    help="write each test's outcome and detsum call count to this JSON file")


def _calls_by_op(ran: str) -> dict[str, int]:
    return {op: n for (op, by), n in switch.counts.items() if by == ran}


def _difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}


class _Recorder:
    def __init__(self, mode: str | None, path: str | None):
        self.mode = mode
        self.path = path
        self.tests: dict[str, dict] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = {ran: _calls_by_op(ran) for ran in ("detsum", "torch")}
        yield
        record = self.tests.setdefault(item.nodeid, {"outcome": "passed"})
        for ran in ("detsum", "torch"):
            ops = _difference(_calls_by_op(ran), before[ran])
            record[f"{ran}_calls"] = sum(ops.values())
            record[f"{ran}_ops"] = ops

    def pytest_runtest_logreport(self, report):
        record = self.tests.setdefault(report.nodeid, {"outcome": "passed"})
        if report.when == "call":
            if hasattr(report, "wasxfail"):
                record["outcome"] = "xfailed" if report.skipped else "xpassed"
            elif report.outcome != "passed":
                record["outcome"] = report.outcome
        elif report.skipped:  # a skip in setup (a missing package, a marker)
            record["outcome"] = "skipped"
        elif report.failed:
            record["outcome"] = "error"

    def pytest_sessionfinish(self, session, exitstatus):
        if self.path is None:
            return
        data = {"mode": self.mode, "detsum_version": getattr(detsum, "__version__", None),
                "exitstatus": int(exitstatus), "tests": self.tests}
        pathlib.Path(self.path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def pytest_configure(config):
    mode = config.getoption("--detsum-mode")
    if mode:
        detsum.enable(mode)
    config.pluginmanager.register(
        _Recorder(mode, config.getoption("--detsum-report")), "detsum_recorder")


def pytest_unconfigure(config):
    if config.getoption("--detsum-mode"):
        detsum.disable()
