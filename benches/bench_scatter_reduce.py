"""scatter_reduce (sum, mean, amax) of graph edges into nodes, against torch.scatter_reduce.

A GNN message-aggregation step: on CUDA 1M edges into 100k nodes with H=128 features (the GPU
issue's shape), on the 2-core CPU 200k edges into 20k nodes, H=64. detsum takes the
1-D index (whole rows); torch needs it expanded to the source's shape, as users write it.
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DEVICES, DTYPE_IDS, nbytes, run_case, skip_unsupported, sync
from detsum import report

# (edges, nodes, features) per device type.
GRAPH = {"cpu": (200_000, 20_000, 64), "cuda": (1_000_000, 100_000, 128)}
SAMPLE_ROWS = 32
DTYPES = [torch.bfloat16, torch.float32]
CASES = [  # (reduce, impl): the mode is irrelevant for amax (exact in every mode)
    ("sum", "detsum-fp32"), ("sum", "detsum-kahan"), ("sum", "detsum-autograd"),
    ("sum", "torch"),
    ("mean", "detsum-fp32"), ("mean", "detsum-kahan"), ("mean", "detsum-autograd"),
    ("mean", "torch"),
    ("amax", "detsum-fp32"), ("amax", "torch"),
]
ROUNDS = {"cpu": 11, "cuda": 200}
WARMUP = 2

_data: dict[tuple[str, torch.dtype], dict] = {}


def graph_data(device: str, dtype: torch.dtype) -> dict:
    key = (device, dtype)
    if key not in _data:
        gen = torch.Generator().manual_seed(1)
        edges, nodes, features = GRAPH[device]
        index = torch.randint(0, nodes, (edges,), generator=gen)
        src = torch.randn(edges, features, generator=gen).to(dtype)
        init = torch.randn(nodes, features, generator=gen).to(dtype)
        rows = torch.randperm(nodes, generator=gen)[:SAMPLE_ROWS].sort().values
        exact = {
            "sum": report.exact_rows(src, index, rows, init, reduce="sum"),
            "mean": report.exact_rows(src, index, rows, init, reduce="mean"),
            "amax": torch.stack([torch.cat([init[r : r + 1], src[index == r]]).amax(0)
                                 for r in rows.tolist()]),
        }
        _data[key] = {"index": index.to(device), "src": src.to(device), "init": init.to(device),
                      "index2": index.view(-1, 1).expand(-1, features).to(device), "rows": rows,
                      "exact": exact}
    return _data[key]


def _op(reduce: str, impl: str, d: dict):
    if impl == "torch":
        return lambda: torch.scatter_reduce(d["init"], 0, d["index2"], d["src"], reduce)
    mode = impl.removeprefix("detsum-")
    return lambda: detsum.scatter_reduce(d["init"], 0, d["index"], d["src"], reduce, mode=mode)


@pytest.mark.parametrize(("reduce", "impl"), CASES, ids=[f"{r}-{i}" for r, i in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("device", DEVICES)
def test_scatter_reduce_graph(benchmark, baselines, device, dtype, reduce, impl):
    benchmark.group = f"scatter_reduce {reduce} {device} {DTYPE_IDS[dtype]}"
    d = graph_data(device, dtype)
    fn = _op(reduce, impl, d)
    out = skip_unsupported(fn)
    sync(device)
    info = {"primitive": f"scatter_reduce {reduce}",
            "case": "graph E={} N={} H={}".format(*GRAPH[device]), "device": device,
            "dtype": DTYPE_IDS[dtype], "impl": impl,
            # src + input read, output written, 1-D index read
            "bytes": nbytes(d["src"], d["init"], d["init"], d["index"]),
            "max_ulps": report.max_ulps(out, d["rows"], d["exact"][reduce]),
            "ulp_rows": SAMPLE_ROWS}
    del out
    case = f"test_scatter_reduce_graph[{device}-{DTYPE_IDS[dtype]}-{reduce}-torch]"
    base_s = baselines.median(case, ("scatter_reduce", reduce, device, dtype),
                              _op(reduce, "torch", d), device, reps=ROUNDS[device])
    run_case(benchmark, fn, device, rounds=ROUNDS[device], warmup_rounds=WARMUP, info=info,
             baseline=f"torch.scatter_reduce({reduce})", baseline_case=case, baseline_s=base_s)


# ---- the speed issue's mean: forward and backward at the GNN shape --------------------------

MEAN_GRAPH = (1_000_000, 100_000, 64)  # edges, nodes, features (CPU and GPU alike)
_mean_data: dict[str, tuple] = {}


def mean_graph(device: str) -> tuple:
    if device not in _mean_data:
        _mean_data.clear()
        gen = torch.Generator().manual_seed(2)
        edges, nodes, features = MEAN_GRAPH
        index = torch.randint(0, nodes, (edges,), generator=gen)
        src = torch.randn(edges, features, generator=gen)
        upstream = torch.randn(nodes, features, generator=gen)
        _mean_data[device] = tuple(t.to(device) for t in (
            index, index.view(-1, 1).expand(-1, features), src,
            torch.zeros(nodes, features), upstream))
    return _mean_data[device]


@pytest.mark.parametrize("include_self", [True, False], ids=["include_self", "exclude_self"])
@pytest.mark.parametrize("impl", ["detsum-fp32", "torch"])
@pytest.mark.parametrize("device", DEVICES)
def test_scatter_reduce_mean_forward_backward(benchmark, device, impl, include_self):
    """scatter_reduce(..., "mean") and the backward of its source, 1M edge rows of 64 fp32
    into 100k node rows (the speed issue's target: detsum at most half torch's time)."""
    index, index2, src, init, upstream = mean_graph(device)

    def step():
        leaf = src.detach().requires_grad_()
        if impl == "torch":
            out = torch.scatter_reduce(init, 0, index2, leaf, "mean", include_self=include_self)
        else:
            out = detsum.scatter_reduce(init, 0, index, leaf, "mean", include_self=include_self)
        out.backward(upstream)
        return leaf.grad

    step()
    sync(device)
    self_id = "include_self" if include_self else "exclude_self"
    benchmark.group = f"scatter_reduce mean fwd+bwd {device}"
    info = {"primitive": "scatter_reduce mean fwd+bwd",
            "case": "gnn E={} N={} H={} {}".format(*MEAN_GRAPH, self_id), "device": device,
            "dtype": "fp32", "impl": impl, "max_ulps": None}
    run_case(benchmark, step, device, rounds=ROUNDS[device], warmup_rounds=1, info=info,
             baseline="torch.scatter_reduce(mean) forward and backward",
             baseline_case=f"test_scatter_reduce_mean_forward_backward[{device}-torch-{self_id}]")
