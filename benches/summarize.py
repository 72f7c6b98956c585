"""Print a short table from a benchmark JSON written by the detsum benchmarks.

    python benches/summarize.py benches/results/cpu-2026-11-21.json

Columns: case, median ms, GB/s (fewest bytes / median), ratio to the torch baseline of the case
(``torch.Tensor.index_add_`` for the MoE index_add cases; see ``baseline`` in extra_info), max
ulps against the exact sum on sampled rows. Then the targets of the MoE case, from the medians
of the same run.

``benches/host_launch.py`` writes its own form (per-call host microseconds, no
``benchmarks`` list); it is printed as a table of medians and percentiles against the torch
op of the same run, with the 25 µs target for a call with a plan. So does
``benches/first_call.py`` (seconds of a first call with an empty Numba cache and from the
cache, per tree and case), printed with its medians, spreads and targets. So does
``benches/pyg_tests.py`` (PyG's tests without and with the switch: counts per outcome, calls
on detsum, and the tests that pass without it and not with it, whose target is none).
"""

from __future__ import annotations

import argparse
import json
import sys


def _fmt(x, digits=2):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) < 1e6 else f"{x:.2e}"
    return str(x)


def rows(data: dict) -> list[dict]:
    out = []
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        name = b["name"].split("[", 1)[-1].rstrip("]") if "[" in b["name"] else b["name"]
        out.append({
            "case": f"{b['name'].split('[')[0].removeprefix('test_')}[{name}]",
            "group": b.get("group"),
            "impl": e.get("impl"),
            "median_ms": 1e3 * b["stats"]["median"],
            "gbps": e.get("gbps"),
            "ratio": e.get("ratio_to_baseline"),
            "baseline": e.get("baseline"),
            "max_ulps": e.get("max_ulps"),
        })
    return out


# (label, numerator impl, denominator impl, limit) per device type: the CPU ones from the core
# issue, the GPU ones from the GPU issue (H200). "copy" is dst.copy_(source) in the same run;
# "<=" limits are on the time ratio, ">=" on the bandwidth ratio.
TARGETS = {
    "cpu": [("fp32 / torch index_add_", "detsum-fp32", "torch-index_add_", "<=", 1.0),
            ("autograd / torch index_add_", "detsum-autograd", "torch-index_add_", "<=", 1.0),
            ("autograd / index_put_", "detsum-autograd", "torch-index_put_", "<=", 0.2),
            ("kahan / fp32", "detsum-kahan", "detsum-fp32", "<=", 1.5)],
    "cuda": [("fp32 / torch index_add_", "detsum-fp32", "torch-index_add_", "<=", 1.1),
             ("autograd / torch index_add_", "detsum-autograd", "torch-index_add_", "<=", 1.1),
             ("autograd / index_put_", "detsum-autograd", "torch-index_put_", "<=", 0.2),
             ("kahan / fp32", "detsum-kahan", "detsum-fp32", "<=", 1.2),
             ("fp32 GB/s / copy GB/s", "detsum-fp32", "torch-copy_", ">=", 0.8),
             # The same call given a plan: the kernel alone, as detsum.moe's backward runs.
             ("fp32 with a plan GB/s / copy GB/s", "detsum-fp32-plan", "torch-copy_", ">=", 0.8),
             ("autograd GB/s / copy GB/s", "detsum-autograd", "torch-copy_", ">=", 0.8)],
}


#: The batch-loss issue's target: the deterministic reduction is under this share of
#: batch_grad's time (bench_loss.py's reduction-<mode> case over its detsum-<mode> case).
LOSS_REDUCTION_SHARE = 0.10


def loss_targets(data: dict) -> list[str]:
    """bench_loss.py: the reduction's share of batch_grad, and its peak memory, per device."""
    by = {}
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("primitive") == "loss.batch_grad":
            by[(e["device"], e["impl"])] = (b["stats"]["median"], e)
    lines = []
    for device in sorted({d for d, _ in by}):
        for mode in ("fp32", "kahan"):
            whole = by.get((device, f"detsum-{mode}"))
            reduction = by.get((device, f"reduction-{mode}"))
            if whole is None or reduction is None:
                continue
            share = reduction[0] / whole[0]
            verdict = "met" if share <= LOSS_REDUCTION_SHARE else "MISSED"
            lines.append(f"{device} {mode}: reduction / batch_grad: {share:.2f} (target <= "
                         f"{LOSS_REDUCTION_SHARE:g}) {verdict}")
            peaks = whole[1].get("peak_mib")
            if peaks:
                listed = ", ".join(f"chunk {c}: {mib:.0f} MiB" for c, mib in peaks.items())
                lines.append(f"{device} {mode}: batch_grad peak memory {listed} (all per-sample "
                             f"gradients at once: {whole[1]['unchunked_per_sample_mib']:.0f} MiB)")
    return lines


#: The exact-mode issue's targets (bench_exact.py): "exact" / "fp32" per dtype on CPU, and
#: "exact" / torch's atomic index_add_ on a GPU.
EXACT_TARGETS = {"cpu": {"bf16": 1.5, "fp16": 1.5, "fp32": 2.0, "fp64": 2.0}, "cuda": 1.3}


def exact_targets(data: dict) -> list[str]:
    """bench_exact.py: "exact" against "fp32" (CPU) or index_add_ (GPU), per shape and dtype."""
    by = {}
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("case", "").startswith("exact-"):
            by[(e["device"], e["case"], e["dtype"], e["impl"])] = b["stats"]["median"]
    lines = []
    for device, case, dtype in sorted({k[:3] for k in by}):
        m = {impl: t for (d, c, t_, impl), t in by.items() if (d, c, t_) == (device, case, dtype)}
        kind = device.split(":")[0]
        if kind == "cpu":
            den, limit = "detsum-fp32", EXACT_TARGETS["cpu"].get(dtype)
        else:
            den, limit = "torch-index_add_", EXACT_TARGETS["cuda"]
        if limit is None or "detsum-exact" not in m or den not in m:
            continue
        r = m["detsum-exact"] / m[den]
        lines.append(f"{device} {case.split()[0]} {dtype}: exact / {den.removeprefix('detsum-')}: "
                     f"{r:.2f} (target <= {limit:g}) {'met' if r <= limit else 'MISSED'}")
    return lines


def scatter_compat_targets(data: dict) -> list[str]:
    """bench_scatter_compat.py: detsum.scatter against the faster of PyG's torch composition and
    scatter_reduce_, per device, reduction and H (target: no slower)."""
    by = {}
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("primitive", "").startswith("scatter ") and e.get("case", "").startswith("gnn"):
            by[(e["device"], e["primitive"], e["case"], e["impl"])] = b["stats"]["median"]
    lines = []
    for device, primitive, case in sorted({k[:3] for k in by}):
        m = {impl: t for (d, p, c, impl), t in by.items() if (d, p, c) == (device, primitive, case)}
        others = [t for impl, t in m.items() if impl != "detsum"]
        if "detsum" not in m or not others:
            continue
        r = m["detsum"] / min(others)
        lines.append(f"{device} {primitive} {case.split()[-1]}: detsum / fastest torch path: "
                     f"{r:.2f} (target <= 1) {'met' if r <= 1 else 'MISSED'}")
    return lines


def pyg_targets(data: dict) -> list[str]:
    """bench_pyg.py: a PyG layer's forward and backward under make_deterministic("fp32")
    against PyG's default, per device, layer and graph (target: no slower)."""
    by = {}
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("primitive") == "pyg layer":
            by[(e["device"], e["case"], e["impl"])] = b["stats"]["median"]
    lines = []
    for device, case in sorted({k[:2] for k in by}):
        m = {impl: t for (d, c, impl), t in by.items() if (d, c) == (device, case)}
        if "pyg" not in m or "detsum-fp32" not in m:
            continue
        r = m["detsum-fp32"] / m["pyg"]
        lines.append(f"{device} PyG {case}: detsum fp32 / PyG: {r:.2f} (target <= 1) "
                     f"{'met' if r <= 1 else 'MISSED'}")
    return lines


#: The transformers adapter's target (bench_hf.py): detsum's experts implementation in its
#: default mode no slower than transformers' default ("grouped_mm") on CPU, forward + backward
#: of the MoE block.
HF_TARGET = ("detsum-fp32", "transformers-grouped_mm", 1.0)


def hf_targets(data: dict) -> list[str]:
    """bench_hf.py: detsum's default mode against transformers' default, per dtype and thread
    count."""
    by = {}
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("primitive") == "hf experts":
            by[(e["device"], e["dtype"], e["threads"], e["impl"])] = b["stats"]["median"]
    numerator, denominator, limit = HF_TARGET
    lines = []
    for device, dtype, threads in sorted({k[:3] for k in by}):
        m = {impl: t for (d, t_, n, impl), t in by.items() if (d, t_, n) == (device, dtype,
                                                                              threads)}
        if numerator not in m or denominator not in m:
            continue
        r = m[numerator] / m[denominator]
        lines.append(f"{device} {dtype} {threads} threads: hf {numerator} / {denominator}: "
                     f"{r:.2f} (target <= {limit:g}) {'met' if r <= limit else 'MISSED'}")
    return lines


#: The speed issue's ratios against torch in the same run (median over median): the small
#: in-place call (bench_dispatch.py), the GNN index_add at each target width
#: (bench_gnn_index_add.py) and scatter_reduce's mean, forward and backward
#: (bench_scatter_reduce.py).
SMALL_CALL_TARGET = 2.0
GNN_INDEX_ADD_TARGET = 1.0
MEAN_FORWARD_BACKWARD_TARGET = 0.5
GNN_TARGET_WIDTHS = (16, 64, 128)


def speed_targets(data: dict) -> list[str]:
    """bench_dispatch.py's small index_add_, bench_gnn_index_add.py's widths and
    bench_scatter_reduce.py's mean forward and backward: detsum over torch, each with the
    spread of the two medians (interquartile range over median)."""
    stats = {b["name"]: b["stats"] for b in data["benchmarks"]}
    lines = []
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("impl") not in ("detsum.index_add_", "detsum-fp32"):
            continue
        if e.get("primitive") == "small index_add_":
            limit = SMALL_CALL_TARGET
        elif e.get("primitive") == "gnn index_add" and e.get("width") in GNN_TARGET_WIDTHS:
            limit = GNN_INDEX_ADD_TARGET
        elif e.get("primitive") == "scatter_reduce mean fwd+bwd":
            limit = MEAN_FORWARD_BACKWARD_TARGET
        else:
            continue
        base = stats.get(e.get("baseline_case"))
        if base is None:
            continue
        r = b["stats"]["median"] / base["median"]
        spread = max(b["stats"]["iqr"] / b["stats"]["median"], base["iqr"] / base["median"])
        lines.append(f"{e['device']} {e['primitive']} {e['case']}: detsum / torch: {r:.2f} "
                     f"(spread {spread:.0%}; target <= {limit:g}) "
                     f"{'met' if r <= limit else 'MISSED'}")
    return lines


#: scatter_reduce with torch's own index form (bench_scatter_reduce.py): detsum over
#: torch.scatter_reduce with the same index, per form (an elementwise index has no target).
TORCH_FORM_TARGETS = {"expanded": 1.0, "materialised": 1.2}


def torch_form_targets(data: dict) -> list[str]:
    """bench_scatter_reduce.py's torch-form cases: each detsum mode over torch with the same
    index, with the spread of the two medians (interquartile range over median)."""
    stats = {b["name"]: b["stats"] for b in data["benchmarks"]}
    lines = []
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("primitive") != "scatter_reduce torch form" or e.get("impl") == "torch":
            continue
        base = stats.get(e.get("baseline_case"))
        if base is None:
            continue
        r = b["stats"]["median"] / base["median"]
        spread = max(b["stats"]["iqr"] / b["stats"]["median"], base["iqr"] / base["median"])
        limit = TORCH_FORM_TARGETS.get(e["form"])
        verdict = "" if limit is None else (f"; target <= {limit:g}) "
                                            f"{'met' if r <= limit else 'MISSED'}")
        lines.append(f"{e['device']} scatter_reduce {e['reduce']} {e['dtype']} index "
                     f"{e['form']}: {e['impl']} / torch: {r:.2f} (spread {spread:.0%}"
                     + (verdict or ")"))
    return lines


def targets(data: dict) -> list[str]:
    """The MoE, exact-mode and batch-loss targets, one line each, from the medians of one run."""
    if is_host_time(data):
        return host_time_targets(data)
    if is_first_call(data):
        return first_call_targets(data)
    if is_pyg_tests(data):
        return pyg_tests_targets(data)
    if is_pyg_interleaved(data):
        return pyg_interleaved_targets(data)
    if is_switch_small_calls(data):
        return []
    by = {}
    for b in data["benchmarks"]:
        e = b.get("extra_info", {})
        if e.get("primitive") in ("index_add", "copy") and e.get("case", "").startswith(
                ("moe", "copy")):
            by[(e["device"], e["dtype"], e["impl"])] = (b["stats"]["median"], e.get("gbps"))
    lines = []
    for device, dtype in sorted({(d, t) for d, t, _ in by}):
        m = {impl: v for (d, t, impl), v in by.items() if (d, t) == (device, dtype)}
        for label, num, den, sense, limit in TARGETS.get(device.split(":")[0], []):
            if num not in m or den not in m:
                continue
            if sense == "<=":
                r = m[num][0] / m[den][0]
                ok = r <= limit
            else:
                if not m[num][1] or not m[den][1]:
                    continue
                r = m[num][1] / m[den][1]
                ok = r >= limit
            lines.append(f"{device} {dtype}: {label}: {r:.2f} (target {sense} {limit:g}) "
                         f"{'met' if ok else 'MISSED'}")
    return (lines + exact_targets(data) + loss_targets(data) + scatter_compat_targets(data)
            + pyg_targets(data) + hf_targets(data) + speed_targets(data)
            + torch_form_targets(data))


HOST_TIME_TARGET_US = 25.0


def is_host_time(data: dict) -> bool:
    """Whether ``data`` is a ``benches/host_launch.py`` report rather than pytest-benchmark's."""
    return "benchmarks" not in data and "times_us" in data


def host_time_targets(data: dict) -> list[str]:
    """One line per call with a plan on the direct launch path: its median against 25 µs."""
    return [f"{name}: {r['median_us']:.1f} us (p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f}; "
            f"target <= {HOST_TIME_TARGET_US:g}) "
            f"{'met' if r['median_us'] <= HOST_TIME_TARGET_US else 'MISSED'}"
            for name, r in data["results"].items() if " plan | direct" in name]


def host_time_table(data: dict) -> str:
    env = data.get("environment", {})
    out = [f"{data.get('date', '?')}  {env.get('cpu', '?')}  {env.get('cores', '?')} cores  "
           f"torch {env.get('torch', '?')}  triton {env.get('triton', '?')}",
           f"host time per call, device work stubbed; ratio = median / median of "
           f"{data.get('baseline', 'the baseline')}", ""]
    width = max(map(len, data["results"]), default=4)
    out.append(f"{'case'.ljust(width)}  {'median us':>9}  {'p10':>7}  {'p90':>7}  {'ratio':>6}")
    for name, r in data["results"].items():
        out.append(f"{name.ljust(width)}  {r['median_us']:9.1f}  {r['p10_us']:7.1f}  "
                   f"{r['p90_us']:7.1f}  {r.get('ratio_to_index_add_', float('nan')):6.2f}")
    t = host_time_targets(data)
    if t:
        out += ["", "Targets:"] + ["  " + x for x in t]
    return "\n".join(out)


def is_first_call(data: dict) -> bool:
    """Whether ``data`` is a ``benches/first_call.py`` report."""
    return "benchmarks" not in data and "targets" in data and "cold_s" in data["targets"]


def first_call_targets(data: dict) -> list[str]:
    """Per tree and case, the median first call with an empty cache against 3 s and from the
    cache against 0.3 s; the report with an empty cache against 45 s."""
    goal = data["targets"]
    lines = []
    for name, r in data["results"].items():
        checks = ([("with an empty cache", r["cold_s"], goal["report_cold_s"])]
                  if name.endswith("python -m detsum report") else
                  [("with an empty cache", r["cold_s"], goal["cold_s"]),
                   ("from the cache", r["warm_s"], goal["warm_s"])])
        for what, t, limit in checks:
            lines.append(f"{name} {what}: {t['median']:.2f} s (spread {t['spread']:.0%}; "
                         f"target <= {limit:g}) {'met' if t['median'] <= limit else 'MISSED'}")
    return lines


def first_call_table(data: dict) -> str:
    env = data.get("environment", {})
    out = [f"{data.get('date', '?')}  {env.get('cpu', '?')}  {env.get('cores', '?')} cores  "
           f"torch {env.get('torch', '?')}  numba {env.get('numba', '?')}",
           "first call, s: median (spread = (max - min) / median over "
           f"{data.get('repeats', '?')} fresh processes); cpu: the process's CPU time", ""]
    width = max(map(len, data["results"]), default=4)
    out.append(f"{'tree | case'.ljust(width)}  {'cold':>6}  {'spread':>6}  {'cpu':>5}  "
               f"{'warm':>5}  {'spread':>6}  {'cpu':>5}  {'import':>6}  {'load avg':>9}")
    for name, r in data["results"].items():
        loads = [x for pair in r["load_average"] for x in pair]
        load = f"{min(loads):.1f}-{max(loads):.1f}"
        if "warm_s" not in r:
            out.append(f"{name.ljust(width)}  {r['cold_s']['median']:6.1f}  "
                       f"{r['cold_s']['spread']:6.0%}  {'':>5}  {'':>5}  {'':>6}  {'':>5}  "
                       f"{'':>6}  {load:>9}")
            continue
        out.append(f"{name.ljust(width)}  {r['cold_s']['median']:6.2f}  "
                   f"{r['cold_s']['spread']:6.0%}  {r['cold_cpu_s']['median']:5.2f}  "
                   f"{r['warm_s']['median']:5.2f}  {r['warm_s']['spread']:6.0%}  "
                   f"{r['warm_cpu_s']['median']:5.2f}  {r['import_detsum_s']['median']:6.2f}  "
                   f"{load:>9}")
    out += ["", "Targets:"] + ["  " + x for x in first_call_targets(data)]
    return "\n".join(out)


def is_pyg_tests(data: dict) -> bool:
    """Whether ``data`` is a ``benches/pyg_tests.py`` report."""
    return "benchmarks" not in data and "per_test_columns" in data


def pyg_tests_targets(data: dict) -> list[str]:
    """Every test that passes without the switch passes with it; in "autograd" mode, every
    call that ran on detsum gave torch's bits."""
    lines = []
    if "pass_off_not_on" in data:
        failing = len(data["pass_off_not_on"])
        lines.append(f"tests that pass without the switch and not with it: {failing} "
                     f"(target 0) {'met' if failing == 0 else 'MISSED'}")
    on = data.get("on", {})
    if "bits_checked" in on:
        differ = sum(len(v) for v in on["bits_differ"].values())
        lines.append(f"calls on detsum with other bits than torch's deterministic kernel: "
                     f"{differ} of {on['bits_checked']} (target 0) "
                     f"{'met' if differ == 0 else 'MISSED'}")
    unchecked = on.get("bits_unchecked")
    if unchecked:
        lines.append(f"  left unchecked: {sum(unchecked.values())} calls on detsum in "
                     f"{len(unchecked)} tests that compile or trace")
    return lines


def pyg_tests_table(data: dict) -> str:
    machine = data.get("machine", {})
    out = [f"{data.get('date', '?')}  {machine.get('cpu', '?')}  "
           f"{machine.get('cpu_count', '?')} cores  torch {machine.get('torch', '?')}  "
           f"torch_geometric {machine.get('torch_geometric', '?')}",
           f"PyG's {', '.join(data.get('tests', []))} from {data.get('source') or '?'}", ""]
    outcomes = ("total", "passed", "failed", "skipped", "error", "xfailed", "xpassed")
    out.append(f"{'switch':<16}" + "".join(f"{k:>9}" for k in outcomes) + f"{'wall s':>9}")
    for name in ("off", "on"):
        if name in data:
            run = data[name]
            label = name if run.get("mode") is None else f"on ({run['mode']})"
            out.append(f"{label:<16}" + "".join(f"{run.get(k, 0):>9}" for k in outcomes)
                       + f"{run.get('wall_s', 0):>9.1f}")
    on = data.get("on", {})
    if "ran_detsum" in on:
        out += ["", f"tests that ran detsum's code: {on['ran_detsum']} "
                    f"({on['ran_detsum_and_passed']} passed), {on['detsum_calls']} calls; "
                    f"tests whose switched calls all went to torch: {on['left_to_torch_only']}"]
    t = pyg_tests_targets(data)
    if t:
        out += ["", "Targets:"] + ["  " + x for x in t]
    return "\n".join(out)


#: A PyG training step with the switch on against PyG's own, on CPU (issue "One line for any
#: PyTorch program").
PYG_STEP_TARGET = 1.1


def is_pyg_interleaved(data: dict) -> bool:
    """Whether ``data`` is a ``benches/pyg_step_interleaved.py`` report."""
    return "benchmarks" not in data and "layers" in data and "graph" in data


def pyg_interleaved_targets(data: dict) -> list[str]:
    """Each layer's step, marked and with the switch on (inside ``detsum.deterministic`` in
    reports before 2026-11-27's fifteenth session, under ``detsum.enable`` since): the ratio of
    its median to PyG's (target: at most PYG_STEP_TARGET)."""
    lines = []
    for layer, found in data["layers"].items():
        for form in ("marked", "enabled"):
            if form in found:
                r = found[form]["ratio_of_medians"]
                lines.append(f"cpu PyG {layer} step, {form} ({data.get('mode', '?')}) / PyG: "
                             f"{r:.2f} (target <= {PYG_STEP_TARGET:g}) "
                             f"{'met' if r <= PYG_STEP_TARGET else 'MISSED'}")
    return lines


def pyg_interleaved_table(data: dict) -> str:
    graph = data.get("graph", {})
    load = " ".join(f"{x:.2f}" for x in data.get("load_average", []))
    out = [f"{data.get('date', '?')}  {data.get('machine', '?')}  {data.get('cpus', '?')} cpus  "
           f"torch {data.get('torch', '?')}  load average {load or '?'}",
           f"{graph.get('nodes', '?')} nodes, {graph.get('edges', '?')} edges, "
           f"{graph.get('features', '?')} features; {data.get('rounds', '?')} rounds in turns, "
           "CPU time, one thread", "",
           f"{'layer':<10}{'form':<10}{'median ms':>10}{'ratio':>7}{'per round':>10}"
           f"{'p10':>6}{'p90':>6}"]
    for layer, found in data["layers"].items():
        out.append(f"{layer:<10}{'pyg':<10}{found['pyg_ms']:>10.2f}")
        for form in ("marked", "enabled"):
            if form in found:
                f = found[form]
                out.append(f"{'':<10}{form:<10}{f['ms']:>10.2f}{f['ratio_of_medians']:>7.2f}"
                           f"{f['round_ratio_median']:>10.2f}{f['round_ratio_p10']:>6.2f}"
                           f"{f['round_ratio_p90']:>6.2f}")
    out += ["", "Targets:"] + ["  " + x for x in pyg_interleaved_targets(data)]
    return "\n".join(out)


def is_switch_small_calls(data: dict) -> bool:
    """Whether ``data`` is a ``benches/switch_small_calls.py`` report (no target of its own:
    the PyG step's is the one it explains)."""
    return "benchmarks" not in data and "calls" in data and "block_us" in data


def switch_small_calls_table(data: dict) -> str:
    load = " ".join(f"{x:.2f}" for x in data.get("load_average", []))
    out = [f"{data.get('date', '?')}  {data.get('machine', '?')}  {data.get('cpus', '?')} cpus  "
           f"torch {data.get('torch', '?')}  load average {load or '?'}",
           f"a small PyG step's calls, \"{data.get('mode', '?')}\" mode, one thread, best of "
           "7 x 3000, us", "",
           f"{'call':<46}{'torch':>8}{'switched':>10}{'registered, off':>17}"]
    for name, call in data["calls"].items():
        out.append(f"{name:<46}{call['torch_us']:>8.2f}{call['switched_us']:>10.2f}"
                   f"{call['registered_off_us']:>17.2f}")
    out.append(f"{'a block opened and closed':<46}{data['block_us']:>8.2f}")
    return "\n".join(out)


def table(data: dict) -> str:
    if is_pyg_interleaved(data):
        return pyg_interleaved_table(data)
    if is_switch_small_calls(data):
        return switch_small_calls_table(data)
    if is_host_time(data):
        return host_time_table(data)
    if is_first_call(data):
        return first_call_table(data)
    if is_pyg_tests(data):
        return pyg_tests_table(data)
    rs = rows(data)
    headers = ["case", "median ms", "GB/s", "ratio", "max ulps"]
    cells = [[r["case"], _fmt(r["median_ms"], 2), _fmt(r["gbps"], 2), _fmt(r["ratio"], 2),
              _fmt(r["max_ulps"], 0)] for r in rs]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(headers)]

    def line(values):
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths)))

    machine = data.get("machine_info", {})
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("processor", "?"))
    out = [f"{data.get('datetime', '?')}  {machine.get('node', '?')}  {cpu}  "
           f"python {machine.get('python_version', '?')}",
           "ratio = median / median of the case's torch baseline (MoE: torch index_add_); "
           "< 1 is faster", "", line(headers), line(["-" * w for w in widths])]
    previous = None
    for r, c in zip(rs, cells):
        if previous is not None and r["group"] != previous:
            out.append("")
        previous = r["group"]
        out.append(line(c))
    t = targets(data)
    if t:
        out += ["", "Targets:"] + ["  " + x for x in t]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json_path")
    args = parser.parse_args(argv)
    with open(args.json_path) as f:
        data = json.load(f)
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
