"""A pytest plugin for ``benches/pyg_tests.py``: PyG's tests with detsum's switch on, counted.

Loaded with ``-p pyg_switch_plugin`` (``benches/`` on ``sys.path``). Three options:

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
- ``--detsum-check-bits`` (for ``"autograd"`` mode): every call that runs on detsum also
  runs torch's own kernel on copies of its inputs under
  ``torch.use_deterministic_algorithms(True)``, and the test's record counts the calls whose
  results have the same bits (``bits_checked``) and names the ops of those that do not
  (``bits_differ``: op and dtype). It wraps the switch's private table of kernel bodies
  (``detsum.switch._BODIES``) before enabling: a check of the contract, not a way to run.

Calls made by threads a test starts are counted too, without a lock (``counts`` is exact only
for one thread): a count above zero is what matters here, not the number.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import detsum
from detsum import switch
from detsum.report import same_bits, torch_deterministic


def pytest_addoption(parser):
    group = parser.getgroup("detsum")
    group.addoption("--detsum-mode", default=None,
                    help="run the session under detsum.enable(MODE)")
    group.addoption("--detsum-report", default=None,
                    help="write each test's outcome and detsum call count to this JSON file")
    group.addoption("--detsum-check-bits", action="store_true",
                    help="compare each call on detsum with torch's deterministic kernel")


#: Calls compared with torch's own kernel since the session began, and those that differ.
_bits = {"checked": 0, "differ": []}


def _copies(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copies(v) for v in value)
    return value


def _checking(name: str, body):
    """``body`` (a switch kernel body), whose detsum run is followed by torch's own kernel
    for the same op on copies of the inputs taken before the run, compared bit for bit."""
    overload = getattr(torch.ops.aten, name.split(".")[0])
    overload = getattr(overload, name.split(".")[1] if "." in name else "default")

    def checked_body(mode, *args, **kwargs):
        run = body(mode, *args, **kwargs)
        if run is None:
            return None

        def checked_run():
            args_copy, kwargs_copy = _copies(args), _copies(kwargs)
            result = run()
            # Still inside the switched kernel: the switch sends this call to torch's kernel,
            # and counts it, which the counts put back leave out.
            counts = switch.counts.copy()
            with torch_deterministic():
                expected = overload(*args_copy, **kwargs_copy)
            switch.counts.clear()
            switch.counts.update(counts)
            _bits["checked"] += 1
            if not same_bits(result, expected):
                _bits["differ"].append(f"{name} {result.dtype}")
            return result
        return checked_run
    return checked_body


def _calls_by_op(ran: str) -> dict[str, int]:
    return {op: n for (op, by), n in switch.counts.items() if by == ran}


def _difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}


class _Recorder:
    def __init__(self, mode: str | None, path: str | None, check_bits: bool):
        self.mode = mode
        self.path = path
        self.check_bits = check_bits
        self.tests: dict[str, dict] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = {ran: _calls_by_op(ran) for ran in ("detsum", "torch")}
        checked, differ = _bits["checked"], len(_bits["differ"])
        yield
        record = self.tests.setdefault(item.nodeid, {"outcome": "passed"})
        for ran in ("detsum", "torch"):
            ops = _difference(_calls_by_op(ran), before[ran])
            record[f"{ran}_calls"] = sum(ops.values())
            record[f"{ran}_ops"] = ops
        if self.check_bits:
            record["bits_checked"] = _bits["checked"] - checked
            record["bits_differ"] = _bits["differ"][differ:]

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
        data = {"mode": self.mode, "check_bits": self.check_bits,
                "exitstatus": int(exitstatus), "tests": self.tests}
        pathlib.Path(self.path).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def pytest_configure(config):
    mode = config.getoption("--detsum-mode")
    check_bits = bool(mode) and config.getoption("--detsum-check-bits")
    if check_bits:
        for name, body in list(switch._BODIES.items()):
            switch._BODIES[name] = _checking(name, body)
    if mode:
        detsum.enable(mode)
    config.pluginmanager.register(
        _Recorder(mode, config.getoption("--detsum-report"), check_bits), "detsum_recorder")


def pytest_unconfigure(config):
    if config.getoption("--detsum-mode"):
        detsum.disable()
