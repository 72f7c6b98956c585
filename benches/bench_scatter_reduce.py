"""scatter_reduce (sum, mean, amax) of graph edges into nodes, against torch.scatter_reduce.

200k edges into 20k nodes, H=64 features: a GNN message-aggregation step. detsum takes the
1-D index (whole rows); torch needs it expanded to the source's shape, as users write it.
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DEVICES, DTYPE_IDS, nbytes, run_case, skip_unsupported, sync
from detsum import report

EDGES, NODES, H = 200_000, 20_000, 64
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
        index = torch.randint(0, NODES, (EDGES,), generator=gen)
        src = torch.randn(EDGES, H, generator=gen).to(dtype)
        init = torch.randn(NODES, H, generator=gen).to(dtype)
        rows = torch.randperm(NODES, generator=gen)[:SAMPLE_ROWS].sort().values
        exact = {
            "sum": report.exact_rows(src, index, rows, init, reduce="sum"),
            "mean": report.exact_rows(src, index, rows, init, reduce="mean"),
            "amax": torch.stack([torch.cat([init[r : r + 1], src[index == r]]).amax(0)
                                 for r in rows.tolist()]),
        }
        _data[key] = {"index": index.to(device), "src": src.to(device), "init": init.to(device),
                      "index2": index.view(-1, 1).expand(-1, H).to(device), "rows": rows,
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
            "case": f"graph E={EDGES} N={NODES} H={H}", "device": device,
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
