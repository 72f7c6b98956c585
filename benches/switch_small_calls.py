"""The switch's cost on the calls a small PyG step makes (800 edges of 16 features into 200
nodes, CPU, one thread), against torch's own op: each call timed with none of detsum's kernels
registered (torch's), with the switch on (detsum's), and registered but off (torch's, through
the switch's kernel); and a ``detsum.deterministic`` block opened and closed. Best of 7
repeats of 3000 calls each, in microseconds.

The calls: GCNConv's degree sum (``scatter_add_`` of one value per edge), the aggregation of
every message-passing layer (``scatter_add_`` with the index expanded over the features),
the backward of its gather (``index_add_``, as ``index_select``'s backward calls it, into new
zeros), and GATConv's softmax maximum (``scatter_reduce_`` amax without the target's values).

    python benches/switch_small_calls.py [--mode fp32] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import timeit

import torch

import detsum

EDGES, NODES, FEATURES = 800, 200, 16


def _calls() -> dict:
    generator = torch.Generator().manual_seed(0)
    messages = torch.randn(EDGES, FEATURES, generator=generator)
    index = torch.randint(0, NODES, (EDGES,), generator=generator)
    expanded = index.view(-1, 1).expand(EDGES, FEATURES)
    weights = torch.randn(EDGES, generator=generator)
    scores = torch.randn(EDGES, 1, generator=generator)
    nodes, degrees, maxima = torch.zeros(NODES, FEATURES), torch.zeros(NODES), torch.zeros(NODES, 1)
    return {
        "scatter_add_ 1-D (degree)": lambda: degrees.scatter_add_(0, index, weights),
        "scatter_add_ expanded (aggregation)": lambda: nodes.scatter_add_(0, expanded, messages),
        "index_add_ into new zeros (gather's backward)":
            lambda: messages.new_zeros(NODES, FEATURES).index_add_(0, index, messages),
        "scatter_reduce_ amax (softmax)": lambda: maxima.scatter_reduce_(
            0, index.view(-1, 1), scores, "amax", include_self=False),
    }


def _best_us(call) -> float:
    for _ in range(200):
        call()
    return min(timeit.repeat(call, number=3000, repeat=7)) / 3000 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="fp32")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calls = _calls()
        detsum.disable()  # torch's own first: nothing registered
        torchs = {name: _best_us(call) for name, call in calls.items()}
        with detsum.deterministic(args.mode):
            switched = {name: _best_us(call) for name, call in calls.items()}
        registered_off = {name: _best_us(call) for name, call in calls.items()}

        def block():
            with detsum.deterministic(args.mode):
                pass

        block_us = _best_us(block)
    finally:
        detsum.disable()
        torch.set_num_threads(threads)
    rows = {}
    for name in calls:
        rows[name] = {"torch_us": torchs[name], "switched_us": switched[name],
                      "registered_off_us": registered_off[name]}
        print(f"{name:46s} torch {torchs[name]:6.2f}  switched {switched[name]:6.2f} "
              f"(+{switched[name] - torchs[name]:5.2f})  registered, off "
              f"{registered_off[name]:6.2f} us")
    print(f"{'a block opened and closed':46s} {block_us:6.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                       "mode": args.mode, "calls": rows, "block_us": block_us}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
