"""A PyG layer's training step marked by ``detsum.pyg.make_deterministic``, run with the
switch on (``detsum.enable``), and run with the switch's kernels registered but off, against
PyG's own, taking turns round by round: for a layer whose step times scatter widely from one
step to the next (GATConv on a 2-core VM: the ratio of two neighbouring steps' times ranged
from about 0.5 to 1.5), where ``bench_pyg.py``'s blocks of 15 rounds a case gave ratios from
0.70 to 1.35 over three runs of one tree.

The graphs, layers and step are ``bench_pyg.py``'s (a layer of 64 features in and out on 10k
nodes and 100k random edges; ``layer(x, edge_index)``, then ``backward`` of a fixed
gradient). Each round runs each of the five in turn, in an order that rotates, on one
thread, timed as the process's CPU time (what a core spent on it, not the wall clock that
another process's work stretches). Before each one's turn, untimed, the switch's kernels are
put in place or removed so that its steps run as its user would have them:

- "pyg": PyG's own step with none of detsum's kernels registered;
- "marked": the marked layer's, the kernels registered, its hooks opening and closing the
  switch's blocks inside the timed step;
- "enabled": PyG's step with the switch on under ``detsum.enable`` (a program that turns it
  on once);
- "enabled_python_kernels": the same with the switch's C++ kernels removed
  (``detsum.switch._use_native(False)``): every switched call through its Python kernels;
- "registered_off": PyG's step with the kernels registered and the switch off, every
  switched call handed to torch's kernel by the switch's kernels (the C++ ones, where built,
  pass it to the Python ones, which pass it to torch).

Then ``--settle`` steps run untimed: the first steps after the kernels are registered or
removed run slower, whichever the setting (on a graph of 200 nodes: the first 1.1-1.4x a
settled one, the second 1.02-1.1x), and a program that turns the switch on once runs
settled steps. Of the ``--timed`` steps that follow, the round keeps the median. Reported:
each one's median over the rounds, and for the other three the ratio of the medians to
PyG's and the median of the per-round ratios with its 10th-90th percentile.

    python benches/pyg_step_interleaved.py [--rounds 200] [--layers GATConv ...]
                                           [--mode fp32] [--graph NODES EDGES FEATURES]
                                           [--settle 3] [--timed 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch

import detsum
import detsum.pyg
import detsum.switch
from detsum.kernels import native

NODES, EDGES, FEATURES = 10_000, 100_000, 64


def _step_times(layer_name: str, mode: str, rounds: int, graph: tuple[int, int, int],
                settle: int, timed: int) -> dict[str, list[float]]:
    from torch_geometric import nn

    nodes, edges, features = graph
    gen = torch.Generator().manual_seed(5)
    edge_index = torch.randint(0, nodes, (2, edges), generator=gen)
    x0 = torch.randn(nodes, features, generator=gen)
    upstream = torch.randn(nodes, features, generator=gen)
    torch.manual_seed(0)
    pyg_layer = getattr(nn, layer_name)(features, features)
    marked_layer = getattr(nn, layer_name)(features, features)
    marked_layer.load_state_dict(pyg_layer.state_dict())
    switch = detsum.pyg.make_deterministic(marked_layer, mode=mode)

    def step(layer):
        x = x0.detach().requires_grad_()
        layer(x, edge_index).backward(upstream)

    def pyg_step():
        step(pyg_layer)

    def marked_step():
        step(marked_layer)

    # Each step's setting, made before its timing starts; the enabled step's undone after.
    def nothing_registered():
        detsum.disable()

    def registered_off():
        with detsum.deterministic(mode):
            pass

    def switched_on():
        detsum.enable(mode)

    def python_kernels_on():
        detsum.switch._use_native(False)
        detsum.enable(mode)

    def python_kernels_off():
        detsum.disable()
        detsum.switch._use_native(True)

    steps = {"pyg": (nothing_registered, pyg_step, None),
             "marked": (registered_off, marked_step, None),
             "enabled": (switched_on, pyg_step, detsum.disable),
             "enabled_python_kernels": (python_kernels_on, pyg_step, python_kernels_off),
             "registered_off": (registered_off, pyg_step, None)}
    names = list(steps)
    times = {name: [] for name in steps}
    try:
        for _ in range(3):  # warm-up: Numba's kernels loaded, the allocator's pools filled
            for before, run, after in steps.values():
                before()
                run()
                if after is not None:
                    after()
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                before, run, after = steps[name]
                before()
                for _ in range(settle):
                    run()
                round_times = []
                for _ in range(timed):
                    start = time.process_time()
                    run()
                    round_times.append((time.process_time() - start) * 1e3)
                times[name].append(statistics.median(round_times))
                if after is not None:
                    after()
    finally:
        switch.undo()
        detsum.disable()
        detsum.switch._use_native(True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--layers", nargs="+", default=["GCNConv", "SAGEConv", "GATConv"])
    parser.add_argument("--mode", default="fp32")
    parser.add_argument("--graph", nargs=3, type=int, default=[NODES, EDGES, FEATURES],
                        metavar=("NODES", "EDGES", "FEATURES"),
                        help="a random graph of this size (default: bench_pyg.py's)")
    parser.add_argument("--settle", type=int, default=3,
                        help="untimed steps after each change of setting")
    parser.add_argument("--timed", type=int, default=3,
                        help="timed steps a round, of which it keeps the median")
    parser.add_argument("--json", help="write the figures and each round's times here")
    args = parser.parse_args()
    # Built now, not in the switch's build thread while the first rounds run.
    reason = native.build()
    print(f"the switch's C++ kernels: {reason or 'built'}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    found = {}
    try:
        for layer_name in args.layers:
            times = _step_times(layer_name, args.mode, args.rounds, tuple(args.graph),
                                args.settle, args.timed)
            pyg = statistics.median(times["pyg"])
            found[layer_name] = {"pyg_ms": pyg, "times": times}
            print(f"{layer_name:9s} pyg {pyg:6.2f} ms")
            for form in ("marked", "enabled", "enabled_python_kernels", "registered_off"):
                ratios = [s / p for p, s in zip(times["pyg"], times[form], strict=True)]
                deciles = statistics.quantiles(ratios, n=10)
                median = statistics.median(times[form])
                found[layer_name][form] = {
                    "ms": median, "ratio_of_medians": median / pyg,
                    "round_ratio_median": statistics.median(ratios),
                    "round_ratio_p10": deciles[0], "round_ratio_p90": deciles[-1]}
                print(f"          {form} ({args.mode}) {median:6.2f} ms"
                      f"  ratio of medians {median / pyg:.2f}"
                      f"  per round {statistics.median(ratios):.2f}"
                      f" (p10 {deciles[0]:.2f}, p90 {deciles[-1]:.2f})")
    finally:
        torch.set_num_threads(threads)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                       "native_build": reason or "built", "rounds": args.rounds,
                       "mode": args.mode, "settle": args.settle,
                       "timed": args.timed,
                       "graph": dict(zip(("nodes", "edges", "features"), args.graph)),
                       "layers": found}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
