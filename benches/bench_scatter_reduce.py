"""scatter_reduce (sum, mean, amax) of graph edges into nodes, against torch.scatter_reduce.

A GNN message-aggregation step: on CUDA 1M edges into 100k nodes with H=128 features (the GPU
issue's shape), on the 2-core CPU 200k edges into 20k nodes, H=64; bf16, fp32 and fp64 (whose
"exact" mean divides a TwoSum pair, ``pair_quotient``). detsum takes the 1-D index (whole
rows); torch needs it expanded to the source's shape, as users write it.
``test_scatter_reduce_torch_form`` gives both the same index of the source's shape (torch's
own form: expanded, materialised, or one destination per element), 1M edges into 100k nodes,
H=64, every reduction and mode.
"""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import DEVICES, DTYPE_IDS, nbytes, run_case, skip_unsupported, sync
from detsum import measure

# (edges, nodes, features) per device type.
GRAPH = {"cpu": (200_000, 20_000, 64), "cuda": (1_000_000, 100_000, 128)}
SAMPLE_ROWS = 32
DTYPES = [torch.bfloat16, torch.float32, torch.float64]
CASES = [  # (reduce, impl): the mode is irrelevant for amax (exact in every mode)
    ("sum", "detsum-fp32"), ("sum", "detsum-kahan"), ("sum", "detsum-autograd"),
    ("sum", "detsum-exact"), ("sum", "torch"),
    ("mean", "detsum-fp32"), ("mean", "detsum-kahan"), ("mean", "detsum-autograd"),
    ("mean", "detsum-exact"), ("mean", "torch"),
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
            "sum": measure.exact_rows(src, index, rows, init, reduce="sum"),
            "mean": measure.exact_rows(src, index, rows, init, reduce="mean"),
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
            "max_ulps": measure.max_ulps(out, d["rows"], d["exact"][reduce]),
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


# ---- torch's own index form: an index of src's shape, as torch and PyG users call it ----------

FORM_GRAPH = (1_000_000, 100_000, 64)  # edges, nodes, features (CPU and GPU alike)
FORM_ROUNDS = {"cpu": 7, "cuda": 100}
#: "expanded": the row index broadcast by a stride-0 view, ``index.view(-1, 1).expand_as(src)``;
#: "materialised": the same values in memory (``.contiguous()``); both take detsum's row path.
#: "elementwise": every element its own destination (one random index per element), for the
#: plan-free elementwise kernel.
FORM_CASES = [(form, dtype, reduce, impl)
              for form in ("expanded", "materialised")
              for dtype in (torch.float32, torch.bfloat16)
              for reduce in ("sum", "mean", "prod", "amax", "amin")
              for impl in ("detsum-fp32", "detsum-kahan", "detsum-autograd", "detsum-exact",
                           "torch")
              if (reduce, impl) != ("prod", "detsum-exact")]
FORM_CASES += [("elementwise", torch.float32, reduce, impl)
               for reduce in ("sum", "mean", "prod", "amax", "amin")
               for impl in ("detsum-fp32", "torch")]
FORM_CASES += [("elementwise", torch.float32, "sum", impl)
               for impl in ("detsum-kahan", "detsum-autograd", "detsum-exact")]
_form_data: dict = {}


def form_graph(device: str, dtype: torch.dtype) -> dict:
    key = (device, dtype)
    if key not in _form_data:
        _form_data.clear()  # one dtype's tensors at a time: the materialised index is 512 MB
        gen = torch.Generator().manual_seed(3)
        edges, nodes, features = FORM_GRAPH
        rows = torch.randint(0, nodes, (edges,), generator=gen)
        src = torch.randn(edges, features, generator=gen)
        init = torch.randn(nodes, features, generator=gen)
        elementwise = (torch.randint(0, nodes, (edges, features), generator=gen)
                       if dtype == torch.float32 else None)
        # prod: factors near one, so that products of about ten stay normal numbers (a
        # subnormal costs the CPU a hundred cycles, which would time the data, not the op).
        near_one = 1 + src / 64
        expanded = rows.view(-1, 1).expand(-1, features)
        _form_data[key] = {
            "rows": rows.to(device),
            "expanded": expanded.to(device),
            "materialised": expanded.contiguous().to(device),
            "elementwise": None if elementwise is None else elementwise.to(device),
            "src": src.to(dtype).to(device), "near_one": near_one.to(dtype).to(device),
            "init": init.to(dtype).to(device),
            "init_near_one": (1 + init / 64).to(dtype).to(device)}
    return _form_data[key]


def _form_op(form: str, reduce: str, impl: str, d: dict):
    src = d["near_one"] if reduce == "prod" else d["src"]
    init = d["init_near_one"] if reduce == "prod" else d["init"]
    index = d[form]
    if impl == "torch":
        return lambda: torch.scatter_reduce(init, 0, index, src, reduce)
    mode = impl.removeprefix("detsum-")
    return lambda: detsum.scatter_reduce(init, 0, index, src, reduce, mode=mode)


@pytest.mark.parametrize(("form", "dtype", "reduce", "impl"), FORM_CASES,
                         ids=[f"{f}-{DTYPE_IDS[t]}-{r}-{i}" for f, t, r, i in FORM_CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_scatter_reduce_torch_form(benchmark, baselines, device, form, dtype, reduce, impl):
    """detsum.scatter_reduce with the index torch.scatter_reduce takes (src's shape), against
    torch.scatter_reduce with the very same index, 1M edge rows of 64 into 100k rows. torch's
    out-of-place call is scatter_reduce_ on a copy of input: detsum too writes a new tensor.
    A detsum case also checks that its bits equal the 1-D row index's (the row path's)."""
    d = form_graph(device, dtype)
    fn = _form_op(form, reduce, impl, d)
    out = skip_unsupported(fn)
    same_bits = None
    if impl != "torch" and form != "elementwise":
        mode = impl.removeprefix("detsum-")
        src = d["near_one"] if reduce == "prod" else d["src"]
        init = d["init_near_one"] if reduce == "prod" else d["init"]
        by_rows = detsum.scatter_reduce(init, 0, d["rows"], src, reduce, mode=mode)
        same_bits = bool(torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else
                                              torch.int32),
                                     by_rows.view(torch.int16 if dtype == torch.bfloat16 else
                                                  torch.int32)))
        del by_rows
    del out
    sync(device)
    dtype_id = DTYPE_IDS[dtype]
    benchmark.group = f"scatter_reduce torch form {form} {reduce} {device} {dtype_id}"
    case = f"test_scatter_reduce_torch_form[{device}-{form}-{dtype_id}-{reduce}-torch]"
    index_bytes = 0 if form == "expanded" else d[form].numel() * d[form].element_size()
    info = {"primitive": "scatter_reduce torch form", "form": form, "reduce": reduce,
            "case": "gnn E={} N={} H={} index {}".format(*FORM_GRAPH, form), "device": device,
            "dtype": dtype_id, "impl": impl, "max_ulps": None,
            # src + input read, output written, the index as it lies in memory read once
            "bytes": nbytes(d["src"], d["init"], d["init"]) + index_bytes,
            "same_bits_as_row_index": same_bits}
    base_s = baselines.median(case, ("scatter_reduce torch form", form, reduce, device, dtype),
                              _form_op(form, reduce, "torch", d), device,
                              reps=FORM_ROUNDS[device])
    run_case(benchmark, fn, device, rounds=FORM_ROUNDS[device], warmup_rounds=1, info=info,
             baseline=f"torch.scatter_reduce({reduce}) with the same index",
             baseline_case=case, baseline_s=base_s)
