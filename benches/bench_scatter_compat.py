"""detsum.scatter sum and mean (torch_scatter's API) against what GNN users run today.

The GNN shape: 1M edge rows into 100k node rows, H in {16, 64, 128}, uniformly random
destinations, fp32. Side by side in one run:

- ``detsum``: ``detsum.scatter(src, index, 0, dim_size=nodes, reduce=...)`` with the 1-D index;
- ``pyg``: what ``torch_geometric.utils.scatter`` runs on torch >= 1.12 (the index broadcast to
  ``src``'s shape, then ``scatter_add_`` for a sum and ``scatter_reduce_(..., "mean",
  include_self=False)`` for a mean, into zeros);
- ``torch-scatter_reduce_``: ``torch.Tensor.scatter_reduce_(..., include_self=False)`` into
  zeros with the broadcast index.

Target (``summarize.py``, never asserted): detsum no slower than the faster of the two.
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DEVICES, nbytes, run_case, sync

EDGES, NODES = 1_000_000, 100_000
HIDDEN = [16, 64, 128]
IMPLS = ["detsum", "pyg", "torch-scatter_reduce_"]
ROUNDS = {"cpu": 7, "cuda": 100}
WARMUP = 2

_data: dict[tuple, dict] = {}


def graph(device: str, hidden: int) -> dict:
    key = (device, hidden)
    if key not in _data:
        _data.clear()  # one shape at a time: the H=128 source alone is 512 MB
        gen = torch.Generator().manual_seed(3)
        index = torch.randint(0, NODES, (EDGES,), generator=gen)
        src = torch.randn(EDGES, hidden, generator=gen)
        _data[key] = {"index": index.to(device), "src": src.to(device),
                      "broadcast": index.view(-1, 1).expand(-1, hidden).to(device)}
    return _data[key]


def _op(impl: str, reduce: str, d: dict):
    src, index, broadcast = d["src"], d["index"], d["broadcast"]
    size = (NODES, src.shape[1])
    if impl == "detsum":
        return lambda: detsum.scatter(src, index, 0, dim_size=NODES, reduce=reduce)
    if impl == "pyg" and reduce == "sum":
        return lambda: src.new_zeros(size).scatter_add_(0, broadcast, src)
    return lambda: src.new_zeros(size).scatter_reduce_(0, broadcast, src, reduce,
                                                       include_self=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("device", DEVICES)
def test_scatter_compat_graph(benchmark, device, hidden, reduce, impl):
    benchmark.group = f"scatter {reduce} {device} H={hidden}"
    d = graph(device, hidden)
    fn = _op(impl, reduce, d)
    fn()
    sync(device)
    out = torch.empty(NODES, hidden, device=device)
    info = {"primitive": f"scatter {reduce}", "case": f"gnn E={EDGES} N={NODES} H={hidden}",
            "device": device, "dtype": "fp32", "impl": impl,
            "bytes": nbytes(d["src"], out, d["index"])}
    run_case(benchmark, fn, device, rounds=ROUNDS[device], warmup_rounds=WARMUP, info=info)
