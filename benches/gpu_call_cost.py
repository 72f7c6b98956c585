"""What one call costs on a GPU, by how it is called: without a plan (at each check level), with
a plan, and torch's op beside it, at a tiny size (all overhead), a mid size, a GNN's (1M rows
of 64 into 100k, with a plan) and, for ``index_add``, the MoE backward's (131072 rows of 4096
into 16384: the kernel's bandwidth with and without the plan's sort in the call).

Two times per row, both medians over rounds of back-to-back calls on one stream (the rows of
a size, both dtypes, take turns round by round in a shuffled order; the JSON holds each
time's p10-p90 spread too):

- ``latency``: a call and a ``torch.cuda.synchronize()``, timed on the host clock: what a
  caller waiting for the result sees, host reads included;
- ``issue``: the host time to issue ``CALLS`` calls without synchronising (the GPU runs behind):
  what a training step pays per call while the GPU is kept busy; a host read inside the call
  makes it a latency again.

``kernels`` is the number of GPU kernels one call launches (torch's profiler, one call after the
warm-up), ``syncs`` whether the call synchronises with the GPU (``torch.cuda`` sync debug mode).
``device`` is the GPU's own time per call, no host work in it: calls captured in one CUDA graph
and replayed, timed by CUDA events (a node of a graph adds about a microsecond); none for a call
that synchronises, which no graph can hold. Latency minus device time is what the host adds: the
part a plan, fewer checks or a leaner launch path can remove, as against the kernels' own.

The row "index_add off, torch's keys" is the call without a plan with its index sorted as it
is (int64), as before ``kernels.sort_by_segment`` narrowed the keys of a sort past 4096 of
them, and "index_add off, torch's sort" with torch's sort of the narrowed keys, as before the
counting sort (``triton.counting_sort``): at ``mid`` the kernels and time each saves. The
row "index_add plan, whole path" is the call with a plan with ``plans.LAUNCH_AGAIN`` off:
every call from its public function down to its launch, where "index_add plan" makes its
last launch again. The "exact" rows are ``mode="exact"`` beside the "fp32" ones: in the
report's form (``segment_sum exact``: default check, no plan) and with a plan, whose device
time is the exact kernel's alone.

``--tile-bytes 0`` launches narrow rows one segment a program (the layout before the tiles of
segments, ``detsum.kernels.triton.segment.TILE_BYTES``), to compare the two; ``--sizes``
narrows the run (``mid`` and ``gnn`` hold the narrow rows: at ``mid`` the kernel with a plan
sits at the launch's floor, about 5 us, either way).

    python benches/gpu_call_cost.py [--json PATH] [--sizes tiny mid gnn moe] [--tile-bytes N]
                                    [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

import detsum
from gpu_moe_profile import narrowed_torch_sort, torch_keys, whole_path

CALLS = 50
ROUNDS = 15
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SIZES = {"tiny": (16, 8, 4), "mid": (16384, 64, 2048), "gnn": (1_000_000, 64, 100_000),
         "moe": (131072, 4096, 16384)}
#: The calls timed at the large sizes, by size (the others at every size): at the MoE size
#: each moves 1-2 GB; at the GNN size, 100k segments of 10 rows of 128-256 bytes, the narrow
#: rows that the tiles of segments are for.
LARGE_CALLS = {
    "moe": ("torch.index_add", "index_add", "index_add device", "index_add plan"),
    "gnn": ("torch.index_add", "index_add plan", "torch.scatter_reduce", "scatter_reduce plan",
            "torch.segment_reduce", "segment_sum plan", "segment_sum exact plan"),
}


def _cases(rows: int, width: int, out_rows: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(5)
    index = torch.randint(0, out_rows, (rows,), generator=gen).cuda()
    src = torch.randn(rows, width, generator=gen).to("cuda", dtype)
    init = torch.randn(out_rows, width, generator=gen).to("cuda", dtype)
    sorted_index = index.sort().values
    offsets = torch.searchsorted(sorted_index, torch.arange(out_rows + 1, device="cuda"))
    plan = detsum.plan(index, num_rows=out_rows)
    expanded = index.view(-1, 1).expand(-1, width)
    return {
        "torch.index_add": lambda: torch.index_add(init, 0, index, src),
        "index_add": lambda: detsum.index_add(init, 0, index, src),
        "index_add device": lambda: detsum.index_add(init, 0, index, src, check="device"),
        "index_add off": lambda: detsum.index_add(init, 0, index, src, check="off"),
        # The index sorted by torch's sort of narrow keys, as before the counting sort.
        "index_add off, torch's sort": narrowed_torch_sort(
            lambda: detsum.index_add(init, 0, index, src, check="off")),
        # The index sorted as it is, as before the narrow keys (kernels.sort_by_segment).
        "index_add off, torch's keys": torch_keys(
            lambda: detsum.index_add(init, 0, index, src, check="off")),
        "index_add plan": lambda: detsum.index_add(init, 0, index, src, plan=plan),
        # The call with a plan on its whole path, not its last launch made again.
        "index_add plan, whole path": whole_path(
            lambda: detsum.index_add(init, 0, index, src, plan=plan)),
        "torch.scatter_reduce": lambda: torch.scatter_reduce(init, 0, expanded, src, "sum"),
        "scatter_reduce torch form": lambda: detsum.scatter_reduce(init, 0, expanded, src,
                                                                   "sum"),
        "scatter_reduce plan": lambda: detsum.scatter_reduce(init, 0, index, src, "sum",
                                                             plan=plan),
        "torch.segment_reduce": lambda: torch.segment_reduce(src, "sum", offsets=offsets),
        "segment_sum": lambda: detsum.segment_sum(src, offsets),
        "segment_sum device": lambda: detsum.segment_sum(src, offsets, check="device"),
        "segment_sum plan": lambda: detsum.segment_sum(src, plan=plan),
        # "exact" against "fp32" (the rows above): the report's form (default check, no plan),
        # and with a plan, where the device time is the exact kernel's alone.
        "segment_sum exact": lambda: detsum.segment_sum(src, offsets, mode="exact"),
        "segment_sum exact plan": lambda: detsum.segment_sum(src, plan=plan, mode="exact"),
        "index_add exact plan": lambda: detsum.index_add(init, 0, index, src, plan=plan,
                                                         mode="exact"),
    }


def _us_per_call(fn, *, sync_each: bool) -> float:
    """One round: ``CALLS`` calls of ``fn`` from an idle GPU, host time per call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
        if sync_each:
            torch.cuda.synchronize()
    spent = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return spent


def _host_times(cases: dict) -> dict[str, dict[str, float]]:
    """Each case's median latency and issue time, and their p10-p90 spread, over ``ROUNDS``
    rounds in which the cases take turns in an order shuffled each round, so that a drift of
    the host (its clocks, another process) falls on every case alike rather than on the
    cases timed first."""
    times = {name: {"latency": [], "issue": []} for name in cases}
    order = list(cases)
    shuffle = random.Random(0).shuffle
    for _ in range(ROUNDS):
        shuffle(order)
        for name in order:
            times[name]["latency"].append(_us_per_call(cases[name], sync_each=True))
            times[name]["issue"].append(_us_per_call(cases[name], sync_each=False))
    found = {}
    for name, kinds in times.items():
        found[name] = {}
        for kind, spent in kinds.items():
            deciles = statistics.quantiles(spent, n=10)
            found[name].update({f"{kind}_us": statistics.median(spent),
                                f"{kind}_p10_us": deciles[0], f"{kind}_p90_us": deciles[-1]})
    return found


def _kernels(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _device_us(fn, calls: int) -> float:
    """The GPU's time per call of ``fn``: ``calls`` calls captured in one CUDA graph (warmed up
    on a side stream first, as capture asks), the graph replayed ``ROUNDS`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    torch.cuda.synchronize()
    return statistics.median(times)


def _syncs(fn) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--tile-bytes", type=int, default=None)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    args = parser.parse_args(argv)
    if args.tile_bytes is not None:
        from detsum.kernels.triton import segment

        segment.TILE_BYTES = args.tile_bytes
    rows_out = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"{CALLS} calls x {ROUNDS} rounds")
    print(f"{'size':5} {'dtype':8} {'call':26} {'latency us':>10} {'issue us':>9} "
          f"{'device us':>9} {'kernels':>7} {'syncs':>5}")
    for size in args.sizes:
        rows, width, out_rows = SIZES[size]
        cases = {}
        for dtype_name in args.dtypes:
            for name, fn in _cases(rows, width, out_rows, DTYPES[dtype_name]).items():
                if name in LARGE_CALLS.get(size, (name,)):
                    cases[dtype_name, name] = fn
        for fn in cases.values():
            for _ in range(3):
                fn()  # compile, fill caches
        torch.cuda.synchronize()
        host_times = _host_times(cases)
        for (dtype_name, name), fn in cases.items():
            row = {"size": size, "shape": [rows, width, out_rows],
                   "dtype": str(DTYPES[dtype_name]), "call": name,
                   **host_times[dtype_name, name], "kernels": _kernels(fn), "syncs": _syncs(fn)}
            # A graph holds every call's allocations: few of the large sizes' outputs.
            row["device_us"] = (None if row["syncs"]
                                else _device_us(fn, 5 if size in LARGE_CALLS else CALLS))
            rows_out.append(row)
            device = "-" if row["device_us"] is None else f"{row['device_us']:.1f}"
            print(f"{size:5} {dtype_name:8} {name:26} {row['latency_us']:10.1f} "
                  f"{row['issue_us']:9.1f} {device:>9} {row['kernels']:7d} "
                  f"{str(row['syncs']):>5}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "calls": CALLS, "rounds": ROUNDS, "tile_bytes": args.tile_bytes,
                       "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
