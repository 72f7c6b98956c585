"""The first call of a primitive on CPU: Numba's compile with an empty disk cache, and its load
from the cache in a later process.

Issue "The first hour", compile time: the first call of one (primitive, mode, dtype) at most
3 s with an empty Numba cache and 0.3 s from the cache; ``python -m detsum report`` at most
45 s with an empty cache, on a quiet 2-core machine. Each measurement is a fresh process:

- ``cold``: a fresh, empty ``NUMBA_CACHE_DIR`` (a temporary directory); the wall time and
  the process's CPU time of the first call, which compiles (and imports Numba: detsum
  imports it on the first CPU call);
- ``warm``: a second process on the same cache directory: the first call loads;
- ``import``: ``import torch`` and then ``import detsum`` in each of those processes (for
  reference: the first call does not include them);
- each child also times a second call (the steady state) and counts the functions Numba
  compiled and loaded (its dispatchers' cache misses and hits).

Cases: ``index_add`` bf16 "fp32" (20000 x 64 rows into 2000: several thread blocks),
``segment_sum`` fp32 "exact" (20000 x 64 rows, segments of 10), ``scatter_reduce`` fp32
"amax" with an elementwise index (20000 x 64 into 2000 x 64), and a small ``index_add`` fp32
"fp32" (256 x 64 rows into 64: the one-call path). ``--report`` adds ``python -m detsum
report`` with an empty cache (the whole run's wall time; minutes).

Other engineers' processes share the machine: every number is repeated (``--repeats``) and
reported as its median and spread (max - min over the median), with the load average
(``os.getloadavg``) before and after each measurement. CPU time moves less with the load
than wall time. Trees are measured in turns, so that each sees the same load:

    python benches/first_call.py [--repeats 3] [--report] [--tree LABEL=DIR ...] [--json PATH]

``--tree LABEL=DIR`` measures the detsum in DIR (put first on ``PYTHONPATH``; the default,
``this=``, is the installed one). To measure another commit without touching the checkout:
``git archive <commit> | tar -x -C DIR && ln -s ../kernels DIR/detsum/kernels``. Writes
``results/cpu-first-call-<date>.json`` (``summarize.py`` prints it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The child: imports, the case's inputs, two calls, and what Numba compiled and loaded.
CHILD = r"""
import json, sys, time
started = time.perf_counter()
import torch
imported_torch = time.perf_counter()
import detsum
imported = time.perf_counter()

case = sys.argv[1]
g = torch.Generator().manual_seed(0)
if case == "index_add bf16 fp32":
    src = torch.randn(20000, 64, generator=g).bfloat16()
    index = torch.randint(0, 2000, (20000,), generator=g)
    def call():
        detsum.index_add(torch.zeros(2000, 64, dtype=torch.bfloat16), 0, index, src)
elif case == "segment_sum fp32 exact":
    src = torch.randn(20000, 64, generator=g)
    offsets = torch.arange(0, 20001, 10)
    def call():
        detsum.segment_sum(src, offsets, mode="exact")
elif case == "scatter_reduce fp32 amax":
    src = torch.randn(20000, 64, generator=g)
    index = torch.randint(0, 2000, (20000, 64), generator=g)
    def call():
        detsum.scatter_reduce(torch.zeros(2000, 64), 0, index, src, "amax")
elif case == "small index_add fp32 fp32":
    src = torch.randn(256, 64, generator=g)
    index = torch.randint(0, 64, (256,), generator=g)
    def call():
        detsum.index_add(torch.zeros(64, 64), 0, index, src)
else:
    raise SystemExit(f"unknown case {case!r}")

cpu = time.process_time()
wall = time.perf_counter()
call()
first_s = time.perf_counter() - wall
first_cpu_s = time.process_time() - cpu
wall = time.perf_counter()
call()
second_s = time.perf_counter() - wall

import gc
import numba
from numba.core.registry import CPUDispatcher
compiled = loaded = 0
for obj in gc.get_objects():
    if isinstance(obj, CPUDispatcher):
        compiled += sum(obj.stats.cache_misses.values())
        loaded += sum(obj.stats.cache_hits.values())
print(json.dumps({"import_torch_s": imported_torch - started,
                  "import_detsum_s": imported - imported_torch, "first_s": first_s,
                  "first_cpu_s": first_cpu_s, "second_ms": 1e3 * second_s,
                  "compiled": compiled, "loaded": loaded, "numba": numba.__version__,
                  "detsum_file": detsum.__file__}))
"""

CASES = ("index_add bf16 fp32", "segment_sum fp32 exact", "scatter_reduce fp32 amax",
         "small index_add fp32 fp32")


def _env(tree: str, cache_dir: str) -> dict:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _child(case: str, tree: str, cache_dir: str) -> dict:
    load = os.getloadavg()[0]
    # Run from the cache directory: with -c the working directory comes first on sys.path.
    run = subprocess.run([sys.executable, "-c", CHILD, case], env=_env(tree, cache_dir),
                         capture_output=True, text=True, timeout=1800, cwd=cache_dir)
    if run.returncode:
        raise RuntimeError(f"{case} ({tree or 'installed'}): {run.stderr[-2000:]}")
    result = json.loads(run.stdout.splitlines()[-1])
    result["load"] = [load, os.getloadavg()[0]]
    return result


def _report(tree: str) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        load = os.getloadavg()[0]
        wall = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "detsum", "report"],
                             env=_env(tree, cache_dir), capture_output=True, text=True,
                             timeout=3600, cwd=cache_dir)
        seconds = time.perf_counter() - wall
    if run.returncode:
        raise RuntimeError(f"report ({tree or 'installed'}): {run.stderr[-2000:]}")
    return {"s": seconds, "load": [load, os.getloadavg()[0]]}


def _summary(values: list[float]) -> dict:
    median = statistics.median(values)
    return {"median": median, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / median if median else 0.0, "runs": values}


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _versions() -> dict:
    import llvmlite
    import numba
    import numpy
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "numba": numba.__version__, "llvmlite": llvmlite.__version__,
            "numpy": numpy.__version__}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--report", action="store_true",
                        help="also python -m detsum report with an empty cache (minutes)")
    parser.add_argument("--tree", action="append", default=[],
                        help="LABEL=DIR: the detsum in DIR (empty: the installed one)")
    parser.add_argument("--note", default="", help="kept in the JSON (what was measured)")
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "benches" / "results" / (
        f"cpu-first-call-{datetime.date.today().isoformat()}.json"))
    args = parser.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": ""}
    cases = [c.strip() for c in args.cases.split(",")]
    runs = {label: {case: [] for case in cases} for label in trees}
    reports = {label: [] for label in trees}
    for repeat in range(args.repeats):
        for case in cases:
            for label, tree in trees.items():
                with tempfile.TemporaryDirectory() as cache_dir:
                    cold = _child(case, tree, cache_dir)
                    warm = _child(case, tree, cache_dir)
                runs[label][case].append({"cold": cold, "warm": warm})
                print(f"[{repeat + 1}/{args.repeats}] {label:8s} {case:28s} cold "
                      f"{cold['first_s']:6.2f} s (cpu {cold['first_cpu_s']:5.2f}, "
                      f"{cold['compiled']} compiled)  warm {warm['first_s']:5.2f} s "
                      f"(cpu {warm['first_cpu_s']:4.2f}, {warm['loaded']} loaded, "
                      f"{warm['compiled']} compiled)  load {cold['load'][0]:.2f}", flush=True)
        if args.report and repeat == 0:
            for label, tree in trees.items():
                reports[label].append(_report(tree))
                print(f"{label:8s} python -m detsum report, empty cache: "
                      f"{reports[label][-1]['s']:.1f} s", flush=True)

    results = {}
    for label in trees:
        for case in cases:
            done = runs[label][case]
            results[f"{label} | {case}"] = {
                "cold_s": _summary([r["cold"]["first_s"] for r in done]),
                "cold_cpu_s": _summary([r["cold"]["first_cpu_s"] for r in done]),
                "warm_s": _summary([r["warm"]["first_s"] for r in done]),
                "warm_cpu_s": _summary([r["warm"]["first_cpu_s"] for r in done]),
                "import_detsum_s": _summary([r[k]["import_detsum_s"] for r in done
                                             for k in ("cold", "warm")]),
                "import_torch_s": _summary([r[k]["import_torch_s"] for r in done
                                            for k in ("cold", "warm")]),
                "second_ms": _summary([r["warm"]["second_ms"] for r in done]),
                "compiled_cold": done[-1]["cold"]["compiled"],
                "loaded_warm": done[-1]["warm"]["loaded"],
                "compiled_warm": done[-1]["warm"]["compiled"],
                "load_average": [r[k]["load"] for r in done for k in ("cold", "warm")],
                "detsum": done[-1]["cold"]["detsum_file"],
            }
        if reports[label]:
            results[f"{label} | python -m detsum report"] = {
                "cold_s": _summary([r["s"] for r in reports[label]]),
                "load_average": [r["load"] for r in reports[label]]}
    report = {
        "what": __doc__.splitlines()[0],
        "targets": {"cold_s": 3.0, "warm_s": 0.3, "report_cold_s": 45.0},
        "note": args.note, "repeats": args.repeats, "trees": trees, "results": results,
        "environment": {"cpu": _cpu_name(), "cores": os.cpu_count(), **_versions()},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    sys.path.insert(0, str(ROOT / "benches"))
    import summarize

    print(summarize.first_call_table(report))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
