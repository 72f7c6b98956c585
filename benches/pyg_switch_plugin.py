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
- ``--detsum-check-bits`` (for ``"autograd"`` mode): every call of an accumulating op that
  runs on detsum, whichever of the switch's ways took it (its C++ kernels, a short way, a
  kernel body), also runs torch's own kernel on copies of its inputs under
  ``torch.use_deterministic_algorithms(True)``, and the test's record counts the calls whose
  results have the same bits (``bits_checked``) and names the ops of those that do not
  (``bits_differ``: op and dtype). A ``TorchDispatchMode`` sees each op as the caller's code
  (or autograd's backward) dispatches it, and tells a call that ran on detsum by the
  switch's counts; for torch's kernel it marks the thread as inside a switched call, as the
  switch does for its own calls of the ops (the switch's private ``_inside`` flag and the C++
  kernels' twin): a check of the contract, not a way to run. Tests that compile or trace
  run unchecked (``bits_unchecked``: their calls on detsum).

Calls made by threads a test starts are counted too, without a lock (``counts`` is exact only
for one thread): a count above zero is what matters here, not the number.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


#: Substrings of the names of the ops a switched call can be reached through as they are
#: dispatched (``index_put_`` reaches ``_index_put_impl_``, the backward of ``gather``
#: ``scatter_add``): the ops whose calls are checked.
_CHECKED_NAMES = ("index_add", "scatter_add", "scatter_reduce", "index_reduce", "index_put",
                  "put_", "bincount", "embedding", "segment_reduce", "histc")


def _detsum_calls() -> int:
    return sum(n for (_, ran), n in switch.counts.items() if ran == "detsum")


@contextlib.contextmanager
def _inside_switched_call():
    """The switch hands this thread's calls of its ops to torch's kernel meanwhile."""
    native = switch._native_loaded
    switch._inside.running = True
    if native is not None:
        native.detsum_native_set_inside(1)
    try:
        yield
    finally:
        switch._inside.running = False
        if native is not None:
            native.detsum_native_set_inside(0)


def _compiles_or_traces(item) -> bool:
    """Whether the test's name says it compiles or traces (``torch.compile``, TorchScript,
    ``torch.fx``): a dispatch mode changes what those see (a graph break where the test
    counts none, a traced int where a tensor was), so those tests run unchecked and their
    calls on detsum are reported as such."""
    name = item.name.lower()
    return any(word in name for word in ("compile", "jit", "trace", "script", "fx"))


class _CheckingBits(TorchDispatchMode):
    """Each call of an op named in ``_CHECKED_NAMES`` that ran on detsum, run again by
    torch's own kernel on copies of its inputs taken before it, compared bit for bit."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if not any(part in name for part in _CHECKED_NAMES):
            return func(*args, **kwargs)
        args_copy, kwargs_copy = _copies(args), _copies(kwargs)
        before = _detsum_calls()
        result = func(*args, **kwargs)
        if _detsum_calls() == before:
            return result  # torch's kernel ran it
        # torch's run is counted as the switch's call left to torch: the counts put back.
        counts = switch.counts.copy()
        with _inside_switched_call(), torch_deterministic():
            expected = func(*args_copy, **kwargs_copy)
        switch.counts.clear()
        switch.counts.update(counts)
        _bits["checked"] += 1
        results = result if isinstance(result, (tuple, list)) else (result,)
        expecteds = expected if isinstance(expected, (tuple, list)) else (expected,)
        if len(results) != len(expecteds) or not all(
                same_bits(r, e) for r, e in zip(results, expecteds)
                if isinstance(r, torch.Tensor)):
            dtype = next((r.dtype for r in results if isinstance(r, torch.Tensor)), None)
            _bits["differ"].append(f"{name} {dtype}")
        return result


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
        checking = self.check_bits and not _compiles_or_traces(item)
        with _CheckingBits() if checking else contextlib.nullcontext():
            yield
        record = self.tests.setdefault(item.nodeid, {"outcome": "passed"})
        for ran in ("detsum", "torch"):
            ops = _difference(_calls_by_op(ran), before[ran])
            record[f"{ran}_calls"] = sum(ops.values())
            record[f"{ran}_ops"] = ops
        if self.check_bits:
            record["bits_checked"] = _bits["checked"] - checked
            record["bits_unchecked"] = record["detsum_calls"] - record["bits_checked"]
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
    if mode:
        detsum.enable(mode)
    config.pluginmanager.register(
        _Recorder(mode, config.getoption("--detsum-report"), check_bits), "detsum_recorder")


def pytest_unconfigure(config):
    if config.getoption("--detsum-mode"):
        detsum.disable()
