"""PyG's own aggregation and convolution tests, without detsum's switch and with it on.

Issue "One line for any PyTorch program": PyG's tests of ``test/nn/aggr`` and
``test/nn/conv`` pass unchanged with ``detsum.enable("autograd")`` turned on for the whole
session. PyG's tests are not installed with the package; give a checkout (or an extracted
``git archive``) of PyG's source whose version matches the installed ``torch_geometric``:

    python benches/pyg_tests.py PATH_TO_PYG_CHECKOUT [--mode autograd] [--no-check-bits]
        [--source LABEL] [--only off|on] [--json OUT.json] [-- extra pytest args]

It runs pytest on ``PATH/test/nn/aggr`` and ``PATH/test/nn/conv`` twice, in fresh processes
with ``PATH`` as the working directory (so PyG's own pytest settings and conftest apply): once
as they are ("off"), once with ``benches/pyg_switch_plugin.py`` passed by ``-p`` and
``--detsum-mode MODE`` ("on"), which switches detsum on before any test module is imported
and counts, per test, the calls that ran on detsum. In ``"autograd"`` mode the plugin also
compares every call that ran on detsum with torch's own kernel under
``torch.use_deterministic_algorithms(True)``, bit for bit (``--detsum-check-bits``; the
contract of that mode; ``--no-check-bits`` leaves it out): PyG's tests compare with
tolerances, which would let other bits pass. Arguments after ``--`` go to both pytest runs
(``-k conv``, ``--deselect ...``). ``--only`` runs one of the two.

It prints and writes (``--json``, default ``results/cpu-pyg-tests-<date>.json``) a summary:
each run's counts of passed, failed, skipped, errors (failed setups), xfailed and xpassed
tests and its wall time; the tests that pass without the switch and not with it, and the
reverse; how many tests ran detsum's code with the switch on (and of those, how many passed),
how many called switched ops only with inputs the switch leaves to torch, the calls per op
each way, and the calls checked against torch's bits with those that differ (op, dtype, test)
and, per test, the calls on detsum left unchecked (tests that compile or trace);
the versions of torch, torch_geometric and Python, the machine, and ``--source`` (say which
PyG commit the tests come from) and each test's outcome in each run with its count of calls
on detsum. Each run's full pytest log goes to the temporary directory
(``<json stem>-off.log``, ``-on.log``; the summary names them).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
TEST_DIRS = ("test/nn/aggr", "test/nn/conv")


def run_pytest(checkout: pathlib.Path, mode: str | None, check_bits: bool, extra: list[str],
               record: pathlib.Path, log: pathlib.Path) -> dict:
    """One pytest process over PyG's tests; its per-test records, read back."""
    command = [sys.executable, "-m", "pytest", *TEST_DIRS, "-p", "pyg_switch_plugin",
               "-p", "no:cacheprovider", "--detsum-report", str(record), *extra]
    if mode is not None:
        command += ["--detsum-mode", mode] + (["--detsum-check-bits"] if check_bits else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    with log.open("w") as out:
        status = subprocess.run(command, cwd=checkout, env=env, stdout=out,
                                stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    if not record.exists():
        sys.exit(f"pyg_tests.py: pytest ended with status {status} before any test ran; "
                 f"see {log}")
    tests = json.loads(record.read_text())["tests"]
    return {"mode": mode, "exit_status": status, "wall_s": round(seconds, 1), "log": str(log),
            "tests": tests}


def counts(tests: dict) -> dict:
    by_outcome = collections.Counter(t["outcome"] for t in tests.values())
    return {"total": len(tests), **{k: by_outcome.get(k, 0) for k in
                                    ("passed", "failed", "skipped", "error", "xfailed",
                                     "xpassed")}}


def summarize(off: dict | None, on: dict | None) -> dict:
    summary = {}
    for name, run in (("off", off), ("on", on)):
        if run is not None:
            summary[name] = {"mode": run["mode"], "exit_status": run["exit_status"],
                             "wall_s": run["wall_s"], "log": run["log"],
                             **counts(run["tests"])}
    if on is not None:
        ran = {k: t for k, t in on["tests"].items() if t.get("detsum_calls", 0) > 0}
        summary["on"]["ran_detsum"] = len(ran)
        summary["on"]["ran_detsum_and_passed"] = sum(t["outcome"] == "passed"
                                                     for t in ran.values())
        summary["on"]["left_to_torch_only"] = sum(
            t.get("detsum_calls", 0) == 0 and t.get("torch_calls", 0) > 0
            for t in on["tests"].values())
        for ran in ("detsum", "torch"):
            ops = collections.Counter()
            for t in on["tests"].values():
                ops.update(t.get(f"{ran}_ops", {}))
            summary["on"][f"{ran}_calls"] = sum(ops.values())
            summary["on"][f"{ran}_calls_by_op"] = dict(sorted(ops.items()))
        if any("bits_checked" in t for t in on["tests"].values()):
            summary["on"]["bits_checked"] = sum(t.get("bits_checked", 0)
                                                for t in on["tests"].values())
            summary["on"]["bits_unchecked"] = {k: t["bits_unchecked"]
                                               for k, t in on["tests"].items()
                                               if t.get("bits_unchecked")}
            summary["on"]["bits_differ"] = {k: t["bits_differ"] for k, t in on["tests"].items()
                                            if t.get("bits_differ")}
    if off is not None and on is not None:
        summary["pass_off_not_on"] = sorted(
            k for k, t in off["tests"].items()
            if t["outcome"] == "passed" and on["tests"].get(k, {}).get("outcome") != "passed")
        summary["pass_on_not_off"] = sorted(
            k for k, t in on["tests"].items()
            if t["outcome"] == "passed" and off["tests"].get(k, {}).get("outcome") != "passed")
    return summary


PER_TEST_COLUMNS = ["outcome off", "outcome on", "detsum calls", "calls left to torch"]


def with_per_test(summary: dict, runs: dict) -> str:
    """The summary as JSON, with ``per_test``: one line per test, ``PER_TEST_COLUMNS``."""
    names = sorted(set().union(*(run["tests"] for run in runs.values())))
    lines = []
    for name in names:
        off = runs["off"]["tests"].get(name, {}) if "off" in runs else {}
        on = runs["on"]["tests"].get(name, {}) if "on" in runs else {}
        row = [off.get("outcome"), on.get("outcome"), on.get("detsum_calls"),
               on.get("torch_calls")]
        lines.append(f" {json.dumps(name)}: {json.dumps(row)}")
    head = json.dumps(summary, indent=1)[:-2]
    return head + ',\n "per_test": {\n' + ",\n".join(lines) + "\n }\n}\n"


def machine() -> dict:
    import torch
    import torch_geometric
    cpu = platform.processor()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"torch": torch.__version__, "torch_geometric": torch_geometric.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=pathlib.Path,
                        help="PyG's source tree (holding test/nn/aggr and test/nn/conv)")
    parser.add_argument("--mode", default="autograd", help="the switch's mode (autograd)")
    parser.add_argument("--no-check-bits", action="store_true",
                        help="in autograd mode, leave out the comparison with torch's bits")
    parser.add_argument("--only", choices=("off", "on"), help="run only one of the two")
    parser.add_argument("--source", default=None,
                        help="what the checkout is (a PyG commit), recorded in the JSON")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    missing = [d for d in TEST_DIRS if not (checkout / d).is_dir()]
    if missing:
        parser.error(f"checkout {str(args.checkout)!r} has no {', '.join(missing)}")
    path = args.json or HERE / "results" / f"cpu-pyg-tests-{datetime.date.today()}.json"
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)

    started = machine()
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, mode in (("off", None), ("on", args.mode)):
            if args.only not in (None, name):
                continue
            log = pathlib.Path(tempfile.gettempdir()) / f"{path.stem}-{name}.log"
            check_bits = mode == "autograd" and not args.no_check_bits
            runs[name] = run_pytest(checkout, mode, check_bits, extra,
                                    pathlib.Path(scratch) / name, log)
            print(f"{name}: {counts(runs[name]['tests'])} in {runs[name]['wall_s']} s",
                  flush=True)
    summary = {"date": str(datetime.date.today()), "tests": list(TEST_DIRS),
               "checkout": str(checkout), "source": args.source, "pytest_args": extra,
               "machine": started, "load_average_end": os.getloadavg(),
               **summarize(runs.get("off"), runs.get("on")),
               "per_test_columns": PER_TEST_COLUMNS}
    path.write_text(with_per_test(summary, runs))
    print(json.dumps(summary, indent=1))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
