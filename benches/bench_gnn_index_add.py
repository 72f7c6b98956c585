"""GNN aggregation as ``index_add``, across row widths: 1M edge rows into 100k node rows.

The speed issue's target: detsum's "fp32" ``index_add`` no slower than torch's
``index_add`` at every H in {16, 64, 128} (on CPU torch's own loop; on a GPU its atomics).
H = 1 and 4 (one number per edge: a degree sum, a few attention heads) are timed beside them:
there a fixed cost per term row, not the bandwidth, decides the speed. Both sides run out of
place on the same tensors (a new output each call, as in a forward pass), fp32, uniformly
random destinations (about 10 rows per node).
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DEVICES, nbytes, run_case

EDGES, NODES = 1_000_000, 100_000
# The widths with a target are summarize.py's GNN_TARGET_WIDTHS.
WIDTHS = [1, 4, 16, 64, 128]
IMPLS = ["detsum-fp32", "torch-index_add"]
ROUNDS = {"cpu": 9, "cuda": 50}

_data: dict[tuple, tuple] = {}


def gnn_data(device: str, width: int) -> tuple:
    if (device, width) not in _data:
        gen = torch.Generator().manual_seed(5)
        index = torch.randint(0, NODES, (EDGES,), generator=gen)
        source = torch.randn(EDGES, width, generator=gen)
        init = torch.randn(NODES, width, generator=gen)
        _data.clear()  # one width's tensors at a time (128 holds 0.6 GB)
        _data[(device, width)] = (init.to(device), index.to(device), source.to(device))
    return _data[(device, width)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("device", DEVICES)
def test_gnn_index_add(benchmark, device, width, impl):
    init, index, source = gnn_data(device, width)
    if impl == "detsum-fp32":
        def fn():
            return detsum.index_add(init, 0, index, source, mode="fp32")
    else:
        def fn():
            return torch.index_add(init, 0, index, source)
    benchmark.group = f"gnn index_add {device} H={width}"
    case = f"gnn-index_add H={width}"
    info = {"primitive": "gnn index_add", "case": case, "device": device, "dtype": "fp32",
            "impl": impl, "width": width, "bytes": nbytes(init, index, source, init),
            "max_ulps": None}
    baseline_case = f"test_gnn_index_add[{device}-{width}-torch-index_add]"
    run_case(benchmark, fn, device, rounds=ROUNDS[device.split(":")[0]], warmup_rounds=1,
             info=info, baseline="torch.index_add", baseline_case=baseline_case)
