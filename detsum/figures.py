"""``python -m detsum figures``: the accuracy and speed pictures of the documentation.

Two PNG files, drawn with matplotlib:

- ``accuracy.png``: the error, in ulps of the dtype, of one segment's sum against its exact sum
  rounded once (``detsum.reference.exact_sum_rounded``), as the segment grows from 1 to
  2**16 terms, for detsum's three modes and for the torch ops that sum the same terms on the
  CPU. One panel per dtype (bf16, fp16, fp32) and data set (well-conditioned,
  cancellation-heavy). It answers "why do my bf16 gradients differ": torch's CPU gradient of
  ``x[index]`` (``index_put_(accumulate=True)``) rounds to bf16 after every add, so a long
  segment of positive terms stops growing once half the sum's ulp exceeds the terms.
- ``speed.png``: achieved GB/s of every benchmark case in committed pytest-benchmark JSON
  (``benches/results``), detsum's modes next to the torch ops, with the machine's copy
  bandwidth (``torch-copy_``, same device and dtype) as the line to compare against; one
  panel per machine, titled with its name.

matplotlib is imported only inside the ``plot_*`` functions: the data functions, and importing
this module (the test suite collects every module for doctests), work without it.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import detsum
from detsum import measure, reference

SEED = 2026

ACCURACY_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
DATASETS: dict[str, str] = {
    "well-conditioned": "uniform in [0.5, 1)",
    "cancellation-heavy": "randn minus its mean, plus 1/128 (condition number about 100)",
}
# The cancellation data set adds CANCEL_OFFSET to mean-free randn values, so its exact sum is
# about CANCEL_OFFSET per term and the condition number sum|x| / |sum x| is about
# E|z| / CANCEL_OFFSET = sqrt(2 / pi) * 128, near 100 (7 bits lost). Without the offset the exact
# sum is only what rounding the terms left: every fp32 sum of fp32 data save a compensated one
# then gets even its sign wrong, and ulps across zero (10**9 in fp32) measure little else.
CANCEL_OFFSET = 2.0**-7
#: The sums compared in the accuracy picture: key -> legend label.
METHODS: dict[str, str] = {
    "fp32": "detsum fp32",
    "kahan": "detsum kahan",
    "exact": "detsum exact",
    "autograd": "detsum autograd",
    "index_put_": "torch index_put_(accumulate=True) = autograd's CPU gradient",
    "index_add_": "torch index_add_",
    "sum": "torch.sum(dim=0)",
}

MAX_COLUMNS = 64
# The exact reference sums with Python fractions, about 3-4 us per term: at most 2**19 terms
# per length (64 columns up to 2**13 terms, 8 columns at 2**16) keeps the full picture under
# 1.5 minutes on 2 CPU cores. Stagnation is alike in every column, so 8 columns show it fully;
# cancellation errors vary more between columns, and their max over fewer columns comes out a
# little lower (the curves' last points understate the worst case somewhat).
TERMS_PER_LENGTH = 2**19
FULL_MAX_EXPONENT = 16
QUICK_MAX_EXPONENT = 10

DEFAULT_OUT = "docs/_static"
DEFAULT_RESULTS = "benches/results/*.json"

# One colour per sum, shared by both pictures.
_COLORS = {
    "fp32": "tab:blue",
    "kahan": "tab:green",
    "exact": "black",
    "autograd": "tab:purple",
    "index_put_": "tab:red",
    "index_add_": "tab:orange",
    "sum": "tab:gray",
}
_OTHER_TORCH_COLORS = ("tab:brown", "tab:olive", "tab:pink", "tab:cyan", "dimgray")


# ---- accuracy: data ---------------------------------------------------------------------------

def segment_lengths(quick: bool = False) -> list[int]:
    """Segment lengths of the accuracy picture: 1, 2, 4, ..., 2**16 (2**10 when ``quick``).

    >>> segment_lengths(quick=True)[-3:]
    [256, 512, 1024]
    """
    top = QUICK_MAX_EXPONENT if quick else FULL_MAX_EXPONENT
    return [2**k for k in range(top + 1)]


def columns_for(length: int) -> int:
    """Independent columns summed at one segment length (fewer for long segments, whose exact
    sums are slow).

    >>> [columns_for(n) for n in (1, 2**13, 2**14, 2**16)]
    [64, 64, 32, 8]
    """
    return max(1, min(MAX_COLUMNS, TERMS_PER_LENGTH // length))


def make_terms(dataset: str, length: int, columns: int, dtype: torch.dtype,
               seed: int = SEED) -> torch.Tensor:
    """``[length, columns]`` terms of ``dtype`` for one of ``DATASETS``.

    The draws depend on (seed, dataset, length) only, so every dtype rounds the same fp64
    values. ``"cancellation-heavy"`` removes each column's mean and adds ``CANCEL_OFFSET``, in
    fp64, before rounding: the terms have both signs, and their exact sum, about
    ``CANCEL_OFFSET * length``, is about 100 times smaller than the sum of their magnitudes.

    >>> t = make_terms("well-conditioned", 4, 3, torch.bfloat16)
    >>> t.shape, t.dtype, bool(((t >= 0.5) & (t <= 1)).all())
    (torch.Size([4, 3]), torch.bfloat16, True)
    >>> make_terms("cancellation-heavy", 1, 3, torch.float32).tolist() == [[2.0**-7] * 3]
    True
    """
    names = list(DATASETS)
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {names}")
    gen = torch.Generator().manual_seed(seed * 1000 + 100 * names.index(dataset)
                                        + length.bit_length())
    if dataset == "well-conditioned":
        values = 0.5 + 0.5 * torch.rand(length, columns, generator=gen, dtype=torch.float64)
    else:
        values = torch.randn(length, columns, generator=gen, dtype=torch.float64)
        values = values - values.mean(dim=0, keepdim=True) + CANCEL_OFFSET
    return values.to(dtype)


def method_sums(terms: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sum over dim 0 of ``terms`` ``[L, C]`` by every key of ``METHODS``, each ``[C]``."""
    length, columns = terms.shape
    offsets = torch.tensor([0, length])
    sums = {mode: detsum.segment_sum(terms, offsets, mode=mode)[0]
            for mode in ("fp32", "kahan", "exact", "autograd")}
    index = torch.zeros(length, dtype=torch.int64)
    # Past 32768 elements and with more than one thread, torch's CPU index_put_ adds with
    # atomics, in no fixed order; deterministic algorithms give its serial sum in order of
    # appearance, the arithmetic that "autograd" mode reproduces.
    with measure.torch_deterministic():
        sums["index_put_"] = terms.new_zeros(1, columns).index_put_(
            (index,), terms, accumulate=True)[0]
    sums["index_add_"] = terms.new_zeros(1, columns).index_add_(0, index, terms)[0]
    sums["sum"] = terms.sum(dim=0)
    return sums


def accuracy_data(quick: bool = False, *,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Errors in ulps of every method of ``METHODS`` against the exact sum, per segment length.

    For each dtype of ``ACCURACY_DTYPES``, data set of ``DATASETS`` and length ``L`` of
    ``segment_lengths(quick)``, ``[L, columns_for(L)]`` terms (``make_terms``) are summed over
    dim 0 into one segment, on the CPU, and each column's result is compared with
    ``reference.exact_sum_rounded`` of that column.

    Args:
        quick: lengths up to 2**10 instead of 2**16 (about 5 s instead of 75 s on 2 CPU
            cores).
        progress: called with one line per (dtype, data set).

    Returns:
        A JSON-serialisable dict: ``lengths``, ``columns`` (per length), ``dtypes``,
        ``datasets`` and ``methods`` (name -> description), ``ulps[dtype][dataset][method]``
        = ``{"max": [...], "mean": [...]}`` over the columns, one entry per length, and
        ``autograd_equals_index_put[dtype][dataset]``: whether detsum's "autograd" mode gave
        torch ``index_put_``'s bits at every length.
    """
    started = time.perf_counter()
    lengths = segment_lengths(quick)
    ulps: dict = {}
    autograd_equals: dict = {}
    for dtype_name, dtype in ACCURACY_DTYPES.items():
        ulps[dtype_name], autograd_equals[dtype_name] = {}, {}
        for dataset in DATASETS:
            per_method = {m: {"max": [], "mean": []} for m in METHODS}
            identical = True
            for length in lengths:
                terms = make_terms(dataset, length, columns_for(length), dtype)
                exact = reference.exact_sum_rounded(terms, dim=0)
                sums = method_sums(terms)
                identical &= measure.same_bits(sums["autograd"], sums["index_put_"])
                for method, value in sums.items():
                    distance = reference.ulp_distance(value, exact)
                    per_method[method]["max"].append(float(distance.max()))
                    per_method[method]["mean"].append(float(distance.mean()))
            ulps[dtype_name][dataset] = per_method
            autograd_equals[dtype_name][dataset] = identical
            if progress:
                last = ", ".join(f"{m} {per_method[m]['max'][-1]:.0f}" for m in METHODS)
                progress(f"[{time.perf_counter() - started:5.1f}s] accuracy {dtype_name} "
                         f"{dataset}: max ulps at {lengths[-1]} terms: {last}")
    return {
        "lengths": lengths,
        "columns": [columns_for(n) for n in lengths],
        "seed": SEED,
        "device": "cpu",
        "torch": torch.__version__,
        "dtypes": list(ACCURACY_DTYPES),
        "datasets": dict(DATASETS),
        "methods": dict(METHODS),
        "ulps": ulps,
        "autograd_equals_index_put": autograd_equals,
        "elapsed_s": time.perf_counter() - started,
    }


# ---- accuracy: picture ------------------------------------------------------------------------

def pyplot_agg():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("detsum.figures draws with matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Lines that often coincide (at 0 ulps, or autograd on index_put_) stay visible through
# distinct marker shapes and sizes: the wide ones are drawn first, the narrow ones on top.
_ACCURACY_STYLE = {
    "index_put_": dict(linewidth=6, alpha=0.35, marker=None),
    "autograd": dict(linewidth=1.3, marker="x", markersize=5),
    "sum": dict(linewidth=1.2, marker="s", markersize=10, fillstyle="none"),
    "index_add_": dict(linewidth=1.2, marker="D", markersize=7.5, fillstyle="none"),
    "fp32": dict(linewidth=1.5, marker="o", markersize=5.5, fillstyle="none"),
    "kahan": dict(linewidth=1.5, marker=".", markersize=5),
    "exact": dict(linewidth=1.0, marker="+", markersize=7),
}


def plot_accuracy(data: dict, path: str | Path) -> None:
    """Draw ``accuracy_data``'s result to the PNG file ``path``: a row of dtype panels per
    data set, the max error over the columns against the segment length, one line per method.

    The y axis is symlog (linear up to 1 ulp, logarithmic above), so 0 ulps shows.
    """
    plt = pyplot_agg()
    from matplotlib.ticker import FuncFormatter

    dtypes, datasets, lengths = data["dtypes"], list(data["datasets"]), data["lengths"]
    fig, axes = plt.subplots(len(datasets), len(dtypes), figsize=(4.6 * len(dtypes),
                             3.6 * len(datasets) + 1.6), sharex=True, squeeze=False)
    handles = {}
    for row, dataset in enumerate(datasets):
        for col, dtype_name in enumerate(dtypes):
            ax = axes[row][col]
            per_method = data["ulps"][dtype_name][dataset]
            for method in _ACCURACY_STYLE:
                if method not in per_method:
                    continue
                (line,) = ax.plot(lengths, per_method[method]["max"], color=_COLORS[method],
                                  label=data["methods"][method], **_ACCURACY_STYLE[method])
                handles[method] = line
            ax.set_xscale("log", base=2)
            ax.set_yscale("symlog", linthresh=1, linscale=0.5)
            top = max(max(v["max"]) for v in per_method.values())
            ax.set_ylim(-0.3, max(10.0, top) * 3)
            ax.yaxis.set_major_formatter(FuncFormatter(_ulp_label))
            ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
            ax.set_title(f"{dtype_name}, {dataset}", fontsize=11)
            if col == 0:
                ax.set_ylabel("max error (ulps of the dtype)")
            if row == len(datasets) - 1:
                ax.set_xlabel("terms in the segment")
    columns = data["columns"]
    column_note = (f"{columns[0]} columns" if len(set(columns)) == 1 else
                   f"{columns[0]} columns, {columns[-1]} at {lengths[-1]} terms")
    described = "; ".join(f"{name}: {text}" for name, text in data["datasets"].items())
    fig.suptitle("Error of one segment's sum against the exact sum rounded once "
                 f"(CPU, torch {data['torch']})\n"
                 f"max over {column_note}; {described}", fontsize=11)
    order = [m for m in data["methods"] if m in handles]
    fig.legend([handles[m] for m in order], [data["methods"][m] for m in order],
               loc="lower center", ncol=3, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ulp_label(value: float, _position) -> str:
    """Tick labels of the symlog ulps axis: plain integers, powers of ten from 10**4."""
    if abs(value) < 1e4:
        return f"{value:.0f}"
    return f"$10^{{{round(math.log10(abs(value)))}}}$"


# ---- speed: data ------------------------------------------------------------------------------

def default_result_paths() -> list[str]:
    """Every committed benchmark JSON (``benches/results/*.json`` under the current directory)."""
    return sorted(glob.glob(DEFAULT_RESULTS))


def impl_label(impl: str, primitive: str) -> str:
    """A legend label for a benchmark's ``impl``.

    >>> impl_label("detsum-kahan", "index_add"), impl_label("torch", "scatter_reduce sum")
    ('detsum kahan', 'torch scatter_reduce')
    """
    # bench_scatter_reduce names its baseline plain "torch": say which op it is.
    if impl == "torch":
        return f"torch {primitive.split()[0]}"
    return impl.replace("-", " ", 1)


def speed_data(json_paths: Sequence[str | Path] | None = None) -> dict:
    """Achieved GB/s per benchmark case and implementation, from pytest-benchmark JSON files.

    Args:
        json_paths: files written by ``pytest benches --benchmark-json``; default:
            ``default_result_paths()``.

    Returns:
        A JSON-serialisable dict: ``sources`` (the files read) and ``devices``: one panel per
        machine, keyed by ``"<device type>: <machine>"`` (``"cpu: AMD EPYC"``; the device type
        alone where a file names no machine), each with ``device``, ``machine`` and ``cases``:
        a list of ``{"primitive", "case", "dtype", "copy_gbps", "copy_source", "bars"}``, where
        ``bars`` lists ``{"impl", "label", "gbps", "source"}``, detsum's modes first. A panel
        holds the measurements of one machine only, so every bar is labelled with the machine
        it ran on. ``copy_gbps`` is the ``torch-copy_`` case's GB/s for the same device and
        dtype from the same file, else from another file of the same machine (the last one
        read), else None. Benchmarks without ``gbps`` are skipped; a case and implementation
        seen in several files of one machine keeps the last file's.
    """
    paths = [str(p) for p in (default_result_paths() if json_paths is None else json_paths)]
    copies: dict[tuple[str, str, str], float] = {}
    bars: dict[tuple, dict] = {}  # (device, machine, primitive, case, dtype) -> impl -> bar
    machine_of: dict[tuple[str, str], str] = {}  # (file, device) -> machine
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        cpu_name = results.get("machine_info", {}).get("cpu", {}).get("brand_raw")
        gpu_name = results.get("detsum_environment", {}).get("gpu")
        for bench in results.get("benchmarks", []):
            info = bench.get("extra_info", {})
            gbps = info.get("gbps")
            if not gbps:
                continue
            device = str(info.get("device", "?")).split(":")[0]
            dtype = info.get("dtype", "?")
            machine = {"cpu": cpu_name, "cuda": gpu_name}.get(device) or ""
            machine_of[(path, device)] = machine
            impl = info.get("impl", bench.get("name", "?"))
            if impl == "torch-copy_":
                copies[(path, device, dtype)] = gbps
                continue
            primitive = info.get("primitive", bench.get("group") or "?")
            key = (device, machine, primitive, info.get("case", ""), dtype)
            bars.setdefault(key, {})[impl] = {
                "impl": impl, "label": impl_label(impl, primitive), "gbps": gbps,
                "source": path}

    devices: dict[str, dict] = {}
    for (device, machine, primitive, case, dtype), by_impl in bars.items():
        sources = [b["source"] for b in by_impl.values()]
        copy_source = next((s for s in reversed(sources) if (s, device, dtype) in copies), None)
        if copy_source is None:
            copy_source = next((p for p in reversed(paths) if (p, device, dtype) in copies
                                and machine_of.get((p, device)) == machine), None)
        panel = f"{device}: {machine}" if machine else device
        entry = devices.setdefault(panel, {"device": device, "machine": machine, "cases": []})
        entry["cases"].append({
            "primitive": primitive, "case": case, "dtype": dtype,
            "copy_gbps": copies.get((copy_source, device, dtype)),
            "copy_source": copy_source,
            "bars": sorted(by_impl.values(), key=_bar_order),
        })
    return {"sources": paths, "devices": devices}


def _bar_order(bar: dict) -> tuple[int, int]:
    detsum_modes = [f"detsum-{m}" for m in ("fp32", "kahan", "exact", "autograd")]
    if bar["impl"] in detsum_modes:
        return (0, detsum_modes.index(bar["impl"]))
    return (1, 0)  # torch ops after detsum's, in the order the benchmarks ran (sort is stable)


# ---- speed: picture ---------------------------------------------------------------------------

def _impl_color(impl: str, assigned: dict[str, str]) -> str:
    """The accuracy picture's colour for a sum both pictures show, else the next spare one."""
    owner, _, name = impl.partition("-")
    if owner in ("detsum", "torch") and name in _COLORS:
        return _COLORS[name]
    if impl not in assigned:
        assigned[impl] = _OTHER_TORCH_COLORS[len(assigned) % len(_OTHER_TORCH_COLORS)]
    return assigned[impl]


def plot_speed(data: dict, path: str | Path) -> None:
    """Draw ``speed_data``'s result to the PNG file ``path``: one panel per machine, a group of
    bars (GB/s, log scale) per benchmark case and dtype, and the copy bandwidth of the same
    device and dtype as a line over each group: dashed when the copy ran in the same file as
    the group's bars, dotted when it comes from another file."""
    devices = data["devices"]
    if not devices:
        raise ValueError(f"no benchmark with gbps in {data['sources']}")
    plt = pyplot_agg()

    most_cases = max(len(d["cases"]) for d in devices.values())
    most_bars = max(len(c["bars"]) for d in devices.values() for c in d["cases"])
    height = 4.6 * len(devices) + 1
    fig, axes = plt.subplots(len(devices), 1, squeeze=False,
                             figsize=(max(8.0, 0.85 * most_cases + 1.5), height))
    width = 0.84 / most_bars
    colors: dict[str, str] = {}
    handles: dict[str, object] = {}
    copy_handles: dict[str, object] = {}
    for ax, (panel, entry) in zip(axes[:, 0], devices.items()):
        cases = entry["cases"]
        for x, case in enumerate(cases):
            n = len(case["bars"])
            for k, bar in enumerate(case["bars"]):
                handles[bar["label"]] = ax.bar(
                    x + (k - (n - 1) / 2) * width, bar["gbps"], width * 0.92,
                    color=_impl_color(bar["impl"], colors), label=bar["label"])
            if case["copy_gbps"]:
                # A copy timed in another file (another run) is a weaker yardstick: dotted.
                same_run = all(b["source"] == case["copy_source"] for b in case["bars"])
                label = ("torch copy_, same run" if same_run
                         else "torch copy_, another run on this machine")
                copy_handles[label] = ax.hlines(
                    case["copy_gbps"], x - 0.46, x + 0.46, colors="black",
                    linestyles="--" if same_run else ":", linewidth=1.2)
        ax.set_yscale("log")
        heights = [b["gbps"] for c in cases for b in c["bars"]]
        heights += [c["copy_gbps"] for c in cases if c["copy_gbps"]]
        ax.set_ylim(min(heights) / 1.6, max(heights) * 1.8)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(["\n".join(c["primitive"].split() + [c["dtype"]]) for c in cases],
                           fontsize=8)
        ax.set_xlim(-0.6, len(cases) - 0.4)
        ax.set_ylabel("GB/s (fewest bytes / median time)")
        ax.grid(True, axis="y", which="both", linewidth=0.4, alpha=0.5)
        ax.set_title(panel, fontsize=11)
        ax.set_xlabel(_shapes_note(cases), fontsize=8)
    labels = list(handles)
    legend_handles = [handles[k] for k in labels]
    for label in sorted(copy_handles, key=lambda k: "another" in k):
        labels.append(f"{label} (same dtype)")
        legend_handles.append(copy_handles[label])
    fig.suptitle("Achieved bandwidth per benchmark case (pytest-benchmark medians; "
                 "higher is faster)", fontsize=11)
    legend_rows = -(-len(labels) // 5)
    fig.legend(legend_handles, labels, loc="lower center", ncol=min(5, len(labels)),
               frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, (0.2 + 0.22 * legend_rows) / height, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shapes_note(cases: Sequence[dict]) -> str:
    """One line naming each benchmark shape and the primitives measured on it."""
    shapes: dict[str, dict[str, None]] = {}
    for c in cases:
        shapes.setdefault(c["case"], {})[c["primitive"].split()[0]] = None
    return "shapes: " + "; ".join(f"{' / '.join(prims)}: {shape}"
                                  for shape, prims in shapes.items())


# ---- command line -----------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``figures`` subcommand's options (``python -m detsum figures``, see __main__)."""
    parser.add_argument("--quick", action="store_true",
                        help=f"accuracy up to 2**{QUICK_MAX_EXPONENT} terms (seconds) "
                             f"instead of 2**{FULL_MAX_EXPONENT} (1.5 minutes on 2 cores)")
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"where accuracy.png and speed.png go (default: {DEFAULT_OUT})")
    parser.add_argument("--json", metavar="PATH", help="also write the pictures' data to PATH")
    parser.add_argument("--bench", metavar="PATH", action="append",
                        help="a pytest-benchmark JSON for the speed picture (repeatable; "
                             f"default: every {DEFAULT_RESULTS})")


def run_command(args: argparse.Namespace) -> int:
    """Write accuracy.png and speed.png into ``args.out``; 1 when there was no benchmark data
    for the speed picture, else 0."""
    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    accuracy = accuracy_data(args.quick, progress=progress)
    plot_accuracy(accuracy, out / "accuracy.png")
    print(out / "accuracy.png")

    status = 0
    speed = speed_data(args.bench)
    if speed["devices"]:
        plot_speed(speed, out / "speed.png")
        print(out / "speed.png")
    else:
        progress(f"no benchmark with gbps in {speed['sources'] or DEFAULT_RESULTS}: "
                 "speed.png not written")
        status = 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": accuracy, "speed": speed}, f, indent=1)
            f.write("\n")
    return status
