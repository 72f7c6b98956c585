"""PyG layers, forward and backward, switched by ``detsum.pyg.make_deterministic`` against PyG's
default, in one run.

A GCNConv, a SAGEConv and a GATConv (64 features in, 64 out, one head, fp32) on random graphs
of 10k nodes and 100k edges, and of 100k nodes and 1M edges (uniformly random endpoints, about
10 edges per node).
One timed step is ``layer(x, edge_index)`` with ``x`` requiring grad, then ``backward`` of a
fixed upstream gradient: the gather of messages and its backward, the aggregation and its
backward, GCN's degree normalisation, GAT's attention (a softmax over each node's incoming
edges: a scatter's max and sum), the dense layers.

- ``pyg``: PyG's own layer (its CPU path: ``index_select``, ``scatter_add_`` and, in
  backward, ``gather`` and ``index_add_``);
- ``detsum-fp32``, ``detsum-exact``: the same layer under ``make_deterministic`` in that mode.

Each case runs on one thread and on two (``torch.set_num_threads``): on a shared machine the
one-thread times are the steadier ones (two threads wait for each other whenever another
process takes a core).

Target (``summarize.py``, never asserted): "fp32" no slower than PyG's default on CPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, run_case, sync

pytest.importorskip("torch_geometric")

import detsum.pyg  # noqa: E402
from torch_geometric.nn import GATConv, GCNConv, SAGEConv  # noqa: E402

GRAPHS = {"10k-100k": (10_000, 100_000), "100k-1M": (100_000, 1_000_000)}
LAYERS = {"GCNConv": GCNConv, "SAGEConv": SAGEConv, "GATConv": GATConv}
FEATURES = 64
IMPLS = ["pyg", "detsum-fp32", "detsum-exact"]
ROUNDS = {"cpu": {"10k-100k": 15, "100k-1M": 5}, "cuda": {"10k-100k": 100, "100k-1M": 50}}
THREADS = [1, 2]
WARMUP = 2

_data: dict[tuple, dict] = {}


def graph(device: str, name: str) -> dict:
    key = (device, name)
    if key not in _data:
        _data.clear()
        nodes, edges = GRAPHS[name]
        gen = torch.Generator().manual_seed(5)
        _data[key] = {
            "edge_index": torch.randint(0, nodes, (2, edges), generator=gen).to(device),
            "x": torch.randn(nodes, FEATURES, generator=gen).to(device),
            "upstream": torch.randn(nodes, FEATURES, generator=gen).to(device),
        }
    return _data[key]


@pytest.fixture
def torch_threads(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    yield threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("threads", THREADS, ids=lambda n: f"{n}thread")
@pytest.mark.parametrize("graph_name", list(GRAPHS))
@pytest.mark.parametrize("device", DEVICES)
def test_pyg_layer(benchmark, request, torch_threads, device, graph_name, layer_name, impl):
    benchmark.group = f"pyg {layer_name} {graph_name} {torch_threads} thread(s) {device}"
    d = graph(device, graph_name)
    torch.manual_seed(0)
    layer = LAYERS[layer_name](FEATURES, FEATURES).to(device)
    switch = None
    if impl != "pyg":
        switch = detsum.pyg.make_deterministic(layer, mode=impl.removeprefix("detsum-"))

    def step():
        x = d["x"].detach().requires_grad_()
        layer(x, d["edge_index"]).backward(d["upstream"])

    try:
        step()
        sync(device)
        nodes, edges = GRAPHS[graph_name]
        info = {"primitive": "pyg layer", "case": f"{layer_name} N={nodes} E={edges} "
                f"F={FEATURES} threads={torch_threads}", "device": device, "dtype": "fp32",
                "impl": impl}
        run_case(benchmark, step, device, rounds=ROUNDS[device][graph_name],
                 warmup_rounds=WARMUP, info=info, baseline="pyg",
                 baseline_case=request.node.name.replace(f"-{impl}]", "-pyg]"))
    finally:
        if switch is not None:
            switch.undo()
            # The switch's kernels stay registered after its blocks, handing each call to
            # torch's kernel: removed, so that PyG's own cases time torch's kernels alone.
            detsum.disable()
