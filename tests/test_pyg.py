"""detsum.pyg: PyG's aggregations on detsum, and make_deterministic on whole layers.

The layers run on a random graph of 10k nodes and 100k edges (64 input features, 32 output):
forward and backward, the same bits over runs and detsum's thread counts, PyG's own bits where
they hold by construction (fp32 data: torch's CPU scatter_add_/index_add_ add each node's terms in
fp32 in order of appearance, as "autograd" mode does, and as "fp32" mode does while no node
receives more than 256 terms; bf16 sums: an fp32 buffer rounded once, "fp32" mode), and in
bf16 an error against an fp64 run of the same layer no larger than PyG's. The aggregation
modules run alone on a small graph.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import threading

import pytest
import torch
from torch.autograd import gradcheck

torch_geometric = pytest.importorskip("torch_geometric")

import detsum  # noqa: E402
import detsum.pyg  # noqa: E402
from conftest import assert_same_bits, detsum_threads  # noqa: E402
from torch_geometric.nn import (  # noqa: E402
    EdgeConv, GATConv, GCNConv, GINConv, SAGEConv, aggr as pyg_aggr,
)
from torch_geometric.nn.conv import gat_conv, gcn_conv  # noqa: E402

NODES, EDGES, IN_FEATURES, OUT_FEATURES = 10_000, 100_000, 64, 32
LAYERS = {
    "GCNConv": lambda: GCNConv(IN_FEATURES, OUT_FEATURES),  # gcn_norm's degree sum, "add"
    "SAGEConv": lambda: SAGEConv(IN_FEATURES, OUT_FEATURES),  # "mean"
    "GATConv": lambda: GATConv(IN_FEATURES, OUT_FEATURES, heads=2),  # softmax, edge_updater
}
AGGREGATIONS = ["SumAggregation", "MeanAggregation", "MinAggregation", "MaxAggregation",
                "MulAggregation", "SoftmaxAggregation"]


@pytest.fixture(scope="module")
def graph():
    g = torch.Generator().manual_seed(2026)
    edge_index = torch.randint(0, NODES, (2, EDGES), generator=g)
    x = torch.randn(NODES, IN_FEATURES, generator=g)
    upstream = torch.randn(NODES, OUT_FEATURES * 2, generator=g)
    # The bits below rest on this: no node receives more than 256 terms (detsum chunks longer
    # sums; torch does not).
    assert torch.bincount(edge_index[1]).max() < 256 and torch.bincount(edge_index[0]).max() < 256
    return edge_index, x, upstream


def make_layer(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(7)
    return LAYERS[name]().to(dtype)


def forward_backward(layer, graph, dtype) -> list[torch.Tensor]:
    """The output, the input's gradient and every parameter's gradient."""
    edge_index, x, upstream = graph
    x = x.detach().to(dtype, copy=True).requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(x, edge_index)
    out.backward(upstream[:, :out.shape[1]].to(dtype))
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


_pyg_results: dict[tuple, list[torch.Tensor]] = {}


def pyg_result(name: str, dtype: torch.dtype, graph) -> list[torch.Tensor]:
    key = (name, dtype)
    if key not in _pyg_results:
        _pyg_results[key] = forward_backward(make_layer(name, dtype), graph, dtype)
    return _pyg_results[key]


def switched_result(name, dtype, graph, mode) -> list[torch.Tensor]:
    layer = make_layer(name, dtype)
    with detsum.pyg.make_deterministic(layer, mode=mode):
        return forward_backward(layer, graph, dtype)


# ---- whole layers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype, mode", [
    pytest.param("GCNConv", torch.float32, "fp32", id="GCNConv-float32-fp32"),
    pytest.param("SAGEConv", torch.float32, "fp32", id="SAGEConv-float32-fp32"),
    pytest.param("GATConv", torch.float32, "fp32", id="GATConv-float32-fp32"),
    pytest.param("GATConv", torch.bfloat16, "exact", id="GATConv-bfloat16-exact"),
])
def test_same_bits_over_runs_and_thread_counts(name, dtype, mode, graph):
    """Two runs, then one on fewer of detsum's threads. Only detsum's thread count changes
    (Numba's, which detsum's kernels take up to torch's): the layer's matrix products are
    torch's, and MKL's fp32 sgemm gives other bits on one thread than on two for these
    shapes on an Intel Xeon (not on the AMD EPYC where this test first ran)."""
    with detsum_threads(2):
        first = switched_result(name, dtype, graph, mode)
        second = switched_result(name, dtype, graph, mode)
    with detsum_threads(1):
        one_thread = switched_result(name, dtype, graph, mode)
    for a, b, c in zip(first, second, one_thread):
        assert_same_bits(b, a)
        assert_same_bits(c, a)


@pytest.mark.parametrize("mode", ["fp32", "autograd"])
@pytest.mark.parametrize("name", LAYERS)
def test_fp32_layers_have_pygs_own_bits(name, mode, graph):
    """fp32 data on a CPU, forward and every gradient: PyG sums with scatter_add_ (a mean
    divides that sum by the count in fp32) and its gather's backward is index_add_, both in
    fp32 in order of appearance, as "fp32" mode; "autograd" (round to the dtype after every
    add) is the same arithmetic when the dtype is fp32."""
    for got, expected in zip(switched_result(name, torch.float32, graph, mode),
                             pyg_result(name, torch.float32, graph)):
        assert_same_bits(got, expected)


def test_fp32_hub_node_autograd_mode_keeps_pygs_bits_fp32_mode_chunks():
    """A node with more than 256 messages: torch sums them serially, which "autograd" mode
    (round to fp32 after every add, never chunked) reproduces; "fp32" mode sums them in
    chunks of 256 (docs/determinism.md), so that node's row differs here, and no other."""
    g = torch.Generator().manual_seed(23)
    edge_index = torch.randint(0, 2000, (2, 20000), generator=g)
    edge_index[1, :700] = 5  # node 5 receives 700 messages and more
    x = torch.randn(2000, IN_FEATURES, generator=g)
    upstream = torch.randn(2000, OUT_FEATURES * 2, generator=g)
    hub_graph = (edge_index, x, upstream)
    theirs = forward_backward(make_layer("GCNConv", torch.float32), hub_graph, torch.float32)
    autograd = switched_result("GCNConv", torch.float32, hub_graph, "autograd")
    for got, expected in zip(autograd, theirs):
        assert_same_bits(got, expected)
    chunked = switched_result("GCNConv", torch.float32, hub_graph, "fp32")[0]
    assert (chunked != theirs[0]).any(dim=1).nonzero().view(-1).tolist() == [5]


@pytest.mark.parametrize("name", ["GCNConv", "GATConv"])
def test_bf16_sum_layers_have_pygs_own_bits_in_fp32_mode(name, graph):
    """torch's CPU scatter_add_ and index_add_ keep a bf16 sum in an fp32 buffer and round it
    once: "fp32" mode's arithmetic, so the sum-based layers match PyG in bf16 too."""
    for got, expected in zip(switched_result(name, torch.bfloat16, graph, "fp32"),
                             pyg_result(name, torch.bfloat16, graph)):
        assert_same_bits(got, expected)


def test_bf16_sage_is_no_further_from_fp64_than_pyg(graph):
    """SAGEConv's mean in bf16: PyG rounds the sum to bf16, then divides (two roundings);
    "fp32" mode divides the fp32 sum and rounds once. Against an fp64 run of the same layer
    (the bf16 parameters and input, widened), detsum's output error is no larger than PyG's,
    at its largest and on average; the input gradient (a gather's backward, which both sum
    in fp32) has PyG's bits."""
    layer = make_layer("SAGEConv", torch.bfloat16)
    reference = forward_backward(copy.deepcopy(layer).double(), graph, torch.float64)
    ours = switched_result("SAGEConv", torch.bfloat16, graph, "fp32")
    theirs = pyg_result("SAGEConv", torch.bfloat16, graph)
    error_ours = (ours[0].double() - reference[0]).abs()
    error_theirs = (theirs[0].double() - reference[0]).abs()
    assert error_ours.max() <= error_theirs.max()
    assert error_ours.mean() < error_theirs.mean()
    assert_same_bits(ours[1], theirs[1])


# ---- max and min: PyG's gradient at tied extremes -------------------------------------------------

TIED_FEATURES, TIED_NODES, LONELY_NODES = 8, 300, 5
MAX_LAYERS = {
    "SAGEConv": lambda: SAGEConv(TIED_FEATURES, TIED_FEATURES, aggr="max"),  # max over x_j
    "GINConv": lambda: GINConv(torch.nn.Sequential(
        torch.nn.Linear(TIED_FEATURES, TIED_FEATURES), torch.nn.ReLU(),
        torch.nn.Linear(TIED_FEATURES, TIED_FEATURES)), aggr="max"),
    # A ReLU last: many messages are 0, the maximum PyG's start value takes part in.
    "EdgeConv": lambda: EdgeConv(torch.nn.Sequential(
        torch.nn.Linear(2 * TIED_FEATURES, TIED_FEATURES), torch.nn.ReLU())),
}


@pytest.fixture(scope="module")
def tied_graph():
    """Every node sends two messages and receives two (two random permutations), and the two
    edges of every third node are the same edge twice; a few more nodes send and receive
    nothing. Features are small integers, so equal maxima abound, 0 among them. No node sums
    more than two terms in a gather's backward, so rounding once (torch's CPU index_add_ in
    bf16) and after every add ("autograd" mode) agree: the bits below depend on the maximum's
    gradient alone."""
    g = torch.Generator().manual_seed(31)
    first = torch.randperm(TIED_NODES, generator=g)
    moved = torch.arange(TIED_NODES)
    moved = moved[moved % 3 != 0]
    shuffle = torch.arange(TIED_NODES)
    shuffle[moved] = moved[torch.randperm(moved.numel(), generator=g)]
    second = first[shuffle]  # a permutation too, equal to first at every third node
    source = torch.arange(TIED_NODES).repeat(2)
    edge_index = torch.stack([source, torch.cat([first, second])])
    x = torch.randint(-2, 3, (TIED_NODES + LONELY_NODES, TIED_FEATURES), generator=g).float()
    upstream = torch.randn(TIED_NODES + LONELY_NODES, TIED_FEATURES, generator=g)
    return edge_index, x, upstream


def _max_layer_result(name, dtype, graph, mode=None) -> list[torch.Tensor]:
    torch.manual_seed(13)
    layer = MAX_LAYERS[name]().to(dtype)
    if mode is None:
        return forward_backward(layer, graph, dtype)
    with detsum.pyg.make_deterministic(layer, mode=mode):
        return forward_backward(layer, graph, dtype)


@pytest.mark.parametrize("dtype, mode", [
    (torch.float32, "autograd"), (torch.bfloat16, "autograd"), (torch.float64, "autograd"),
    (torch.float32, "exact"), (torch.bfloat16, "fp32")])
@pytest.mark.parametrize("name", MAX_LAYERS)
def test_max_layers_have_pygs_gradient_at_ties(name, dtype, mode, tied_graph):
    """PyG's max (torch's scatter_reduce_ "amax" into zeros, include_self=False) shares a
    tied maximum's gradient evenly among the ties, and counts the zero start value among them
    where the maximum is 0; the switched layers do the same in every mode: output, input
    gradient and every parameter's gradient have PyG's bits."""
    for got, expected in zip(_max_layer_result(name, dtype, tied_graph, mode),
                             _max_layer_result(name, dtype, tied_graph)):
        assert_same_bits(got, expected)


@pytest.fixture(scope="module")
def tied_messages():
    """600 messages of small integers into 40 nodes, sorted by target (so ptr describes the
    same groups); node 3 receives 301 messages whose first column is 3 (a count that bf16
    rounds to 300), nodes 30 to 39 receive nothing."""
    g = torch.Generator().manual_seed(17)
    index = torch.cat([torch.randint(0, 30, (299,), generator=g),
                       torch.full((301,), 3)]).sort(stable=True).values
    x = torch.randint(-2, 3, (600, 4), generator=g).float()
    x[index == 3, 0] = 3.0
    ptr = torch.cat([torch.zeros(1, dtype=torch.long),
                     torch.bincount(index, minlength=40).cumsum(0)])
    upstream = torch.randn(40, 4, generator=g)
    return x, index, ptr, upstream


def _gradient(function, x, upstream):
    x = x.detach().clone().requires_grad_()
    out = function(x)
    out.backward(upstream)
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", ["MaxAggregation", "MinAggregation"])
def test_extreme_aggregation_gradient_has_pygs_bits(name, dtype, tied_messages):
    """The aggregation alone, in every mode, with index, with ptr, and with both (what
    MessagePassing passes for a sorted EdgeIndex; PyG takes its index path then): PyG's
    values and gradient, bit for bit. detsum's ptr path gives its index path's bits."""
    x, index, ptr, upstream = (t.to(dtype) if t.is_floating_point() else t
                               for t in tied_messages)
    theirs = _gradient(lambda v: getattr(pyg_aggr, name)()(v, index, dim_size=40), x, upstream)
    both = _gradient(lambda v: getattr(pyg_aggr, name)()(v, index, ptr=ptr), x, upstream)
    for t, e in zip(both, theirs):
        assert_same_bits(t, e)
    for mode in detsum.MODES:
        aggregation = getattr(detsum.pyg, name)(mode=mode)
        for call in (lambda v: aggregation(v, index, dim_size=40),
                     lambda v: aggregation(v, ptr=ptr),
                     lambda v: aggregation(v, index, ptr=ptr)):
            for got, expected in zip(_gradient(call, x, upstream), theirs):
                assert_same_bits(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["MaxAggregation", "MinAggregation"])
def test_extreme_aggregation_gradient_at_signed_zeros_nan_and_infinities(name, dtype):
    """0.0 tied with -0.0 (and the zero start counted), NaN (every member's gradient NaN),
    infinities, a lone -0.0, an empty row, negative gradients (``0 * -g`` is -0.0)."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([0.0, -0.0, -0.0, 0.0, nan, 2.0, 1.0, -inf, -inf, 5.0, inf, -0.0],
                     dtype=dtype).view(-1, 1)
    index = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 6])
    upstream = torch.tensor([1.0, -2.0, 3.0, 0.0, -0.5, 7.0, 1.5], dtype=dtype).view(-1, 1)
    expected = _gradient(lambda v: getattr(pyg_aggr, name)()(v, index, dim_size=7), x, upstream)
    for mode in detsum.MODES:
        got = _gradient(lambda v: getattr(detsum.pyg, name)(mode=mode)(v, index, dim_size=7),
                        x, upstream)
        for a, b in zip(got, expected):
            assert_same_bits(a, b)


@pytest.mark.parametrize("reduce", ["max", "min", "amax", "amin"])
def test_scatter_extreme_gradient_has_pygs_bits(reduce, tied_messages):
    """detsum.pyg.scatter, which the switch routes conv modules' own reductions to."""
    x, index, _, upstream = tied_messages
    x = x.bfloat16()
    upstream = upstream.bfloat16()
    expected = _gradient(lambda v: torch_geometric.utils.scatter(v, index, 0, 40, reduce),
                         x, upstream)
    for mode in detsum.MODES:
        got = _gradient(lambda v: detsum.pyg.scatter(v, index, 0, 40, reduce, mode=mode),
                        x, upstream)
        for a, b in zip(got, expected):
            assert_same_bits(a, b)


# ---- the switch: what it changes, and undoing it ------------------------------------------------

def _originals(layer):
    return {"aggr_module": layer.aggr_module, "fuse": layer.fuse,
            "instance attributes": sorted(vars(layer)),
            "gcn_conv.scatter": gcn_conv.scatter, "gat_conv.softmax": gat_conv.softmax}


def test_undo_restores_pygs_originals(graph):
    layer = make_layer("GATConv", torch.float32)
    before = _originals(layer)
    assert before["gcn_conv.scatter"] is torch_geometric.utils.scatter
    switch = detsum.pyg.make_deterministic(layer, mode="exact")
    assert isinstance(layer.aggr_module, detsum.pyg.SumAggregation)
    assert switch.aggregations == [("aggr_module", "SumAggregation")] and switch.layers == [""]
    # Outside a switched forward, PyG's module-level functions are its own.
    assert gcn_conv.scatter is before["gcn_conv.scatter"]
    switched = forward_backward(layer, graph, torch.float32)
    switch.undo()
    switch.undo()  # a second undo does nothing
    assert _originals(layer) == before
    assert layer.aggr_module is before["aggr_module"]
    unswitched = forward_backward(layer, graph, torch.float32)
    for got, expected in zip(unswitched, pyg_result("GATConv", torch.float32, graph)):
        assert_same_bits(got, expected)
    assert not torch.equal(switched[0], unswitched[0])  # "exact" did run while switched


def test_routes_are_installed_only_while_a_switched_forward_runs(graph):
    """gcn_norm's scatter and GAT's softmax are detsum's inside the layer's forward, in this
    thread; other threads and code outside the forward see PyG's."""
    edge_index, x, _ = graph
    layer = make_layer("GCNConv", torch.float32)
    seen = {}

    def look(module, inputs, output):
        seen["here"] = gcn_conv.scatter.__name__
        other = threading.Thread(target=lambda: seen.setdefault(
            "other thread", gcn_conv.scatter(torch.ones(3), torch.tensor([0, 0, 1]))))
        other.start()
        other.join()

    layer.register_message_forward_hook(look)
    with detsum.pyg.make_deterministic(layer):
        layer(x[:100], edge_index[:, :50] % 100)
        assert gcn_conv.scatter is torch_geometric.utils.scatter
    assert seen["here"] == "_routed_scatter"
    assert torch.equal(seen["other thread"], torch.tensor([2.0, 1.0]))


def test_a_forward_that_raises_still_restores_the_routes(graph):
    edge_index, x, _ = graph
    layer = make_layer("GCNConv", torch.float32)
    with detsum.pyg.make_deterministic(layer):
        with pytest.raises(RuntimeError):
            layer(x[:100, :3], edge_index[:, :50] % 100)  # 3 features, not 64
    assert gcn_conv.scatter is torch_geometric.utils.scatter


def test_a_deep_copy_of_a_switched_layer_runs_its_own_parameters(graph):
    edge_index, x, _ = graph
    layer = make_layer("GCNConv", torch.float32)
    with detsum.pyg.make_deterministic(layer):
        copied = copy.deepcopy(layer)
        assert copied.forward.__self__ is copied and copied._index_select.__self__ is copied
        with torch.no_grad():
            copied.lin.weight.zero_()
        assert torch.equal(copied(x, edge_index), copied.bias.expand(NODES, -1))
        assert_same_bits(layer(x, edge_index), pyg_result("GCNConv", torch.float32, graph)[0])


def test_multi_aggregation_runs_each_aggregation_on_detsum(graph):
    edge_index, x, _ = graph
    torch.manual_seed(3)
    layer = SAGEConv(IN_FEATURES, OUT_FEATURES, aggr=["mean", "max", "sum"])
    expected = layer(x, edge_index)
    multi = layer.aggr_module
    fused = multi.fused_aggr
    assert fused is not None
    with detsum.pyg.make_deterministic(layer, mode="fp32") as switch:
        assert multi.fused_aggr is None
        assert [type(a).__module__ for a in multi.aggrs] == ["detsum.pyg"] * 3
        assert_same_bits(layer(x, edge_index), expected)
    assert [path for path, _ in switch.aggregations] == [
        "aggr_module.aggrs.0", "aggr_module.aggrs.1", "aggr_module.aggrs.2"]
    assert multi.fused_aggr is fused
    assert [type(a).__module__ for a in multi.aggrs] == ["torch_geometric.nn.aggr.basic"] * 3


def test_learnable_softmax_temperature_stays_the_same_parameter():
    layer = GCNConv(8, 8, aggr=pyg_aggr.SoftmaxAggregation(learn=True))
    t = layer.aggr_module.t
    with detsum.pyg.make_deterministic(layer, mode="kahan"):
        assert layer.aggr_module.t is t
        assert [p for p in layer.parameters() if p is t]


def test_refusals_name_the_module_and_change_nothing(graph):
    edge_index, x, _ = graph
    layer = torch.nn.ModuleDict({"conv": SAGEConv(8, 8, aggr="std"), "ok": GCNConv(8, 8)})
    before = (_originals(layer["ok"]), layer["conv"].aggr_module)
    with pytest.raises(ValueError, match=r"no replacement for the aggregation modules "
                                         r"conv.aggr_module \(StdAggregation\)"):
        detsum.pyg.make_deterministic(layer)
    assert (_originals(layer["ok"]), layer["conv"].aggr_module) == before
    with detsum.pyg.make_deterministic(layer, strict=False) as switch:
        assert switch.layers == ["conv", "ok"]
        with pytest.raises(ValueError, match="switched already"):
            detsum.pyg.make_deterministic(layer)
        adjacency = torch.sparse_coo_tensor(edge_index[:, :20] % 50, torch.ones(20), (50, 50),
                                            check_invariants=True)
        with pytest.raises(ValueError, match=r"GCNConv at 'ok' was called with a sparse "
                                             r"tensor"):
            layer["ok"](x[:50, :8], adjacency)
    with pytest.raises(ValueError, match="mode='fast' is not a detsum mode"):
        detsum.pyg.make_deterministic(layer, mode="fast")
    with pytest.raises(ValueError, match="reduce='mul' has no mode='exact'"):
        detsum.pyg.make_deterministic(GCNConv(8, 8, aggr="mul"), mode="exact")


def test_import_detsum_does_not_import_torch_geometric():
    code = ("import sys, detsum, detsum.pyg; assert 'torch_geometric' not in sys.modules; "
            "detsum.pyg.SumAggregation; assert 'torch_geometric' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- the aggregation modules alone ----------------------------------------------------------------

@pytest.fixture(scope="module")
def small_graph():
    """500 messages into 60 nodes, sorted by target (so ptr describes the same groups), the
    last 10 nodes receiving nothing."""
    g = torch.Generator().manual_seed(11)
    index = torch.randint(0, 50, (500,), generator=g).sort().values
    ptr = torch.cat([torch.zeros(1, dtype=torch.long),
                     torch.bincount(index, minlength=60).cumsum(0)])
    x = torch.randn(500, 6, generator=g)
    return x, index, ptr


def _data_for(name, x):
    return 1 + x / 16 if name == "MulAggregation" else x  # a product of moderate factors


@pytest.mark.parametrize("name", AGGREGATIONS)
def test_aggregation_equals_pygs_and_detsums_own(name, small_graph):
    x, index, ptr = small_graph
    x = _data_for(name, x)
    ours, theirs = getattr(detsum.pyg, name)(), getattr(pyg_aggr, name)()
    assert isinstance(ours, type(theirs))
    with_index = ours(x, index, dim_size=60)
    assert with_index.shape == (60, 6) and torch.equal(with_index[50:], torch.full(
        (10, 6), 1.0 if name == "MulAggregation" else 0.0))
    # fp32 data: PyG's values are the same bits (its CPU sums run in fp32 in order).
    assert_same_bits(with_index, theirs(x, index, dim_size=60))
    if name != "MulAggregation":  # PyG's product takes index only
        assert_same_bits(ours(x, ptr=ptr), with_index)
        assert_same_bits(theirs(x, ptr=ptr), with_index)
    reduce = {"SumAggregation": "sum", "MeanAggregation": "mean", "MinAggregation": "min",
              "MaxAggregation": "max", "MulAggregation": "mul"}.get(name)
    for mode in ("kahan", "exact"):
        if reduce is None or (reduce == "mul" and mode == "exact"):
            continue
        assert_same_bits(getattr(detsum.pyg, name)(mode=mode)(x, index, dim_size=60),
                         detsum.scatter(x, index, 0, dim_size=60, reduce=reduce, mode=mode))
    assert type(pickle.loads(pickle.dumps(ours))) is type(ours)


def test_softmax_aggregation_is_the_weighted_scatter_sum(small_graph):
    x, index, ptr = small_graph
    for t, mode in ((1.0, "fp32"), (0.5, "exact")):
        weights = detsum.scatter_softmax(x * t, index, 0, dim_size=60, mode=mode)
        expected = detsum.scatter(x * weights, index, 0, dim_size=60, mode=mode)
        got = detsum.pyg.SoftmaxAggregation(t=t, mode=mode)(x, index, dim_size=60)
        assert_same_bits(got, expected)
        assert_same_bits(detsum.pyg.SoftmaxAggregation(t=t, mode=mode)(x, ptr=ptr), expected)


def test_aggregation_in_a_three_dimensional_input_along_dim_1(small_graph):
    x, index, ptr = small_graph
    batched = torch.stack([x, 2 * x, -x])  # [3, 500, 6], aggregated along dim 1 (PyG's -2)
    for name in ("SumAggregation", "MeanAggregation", "MaxAggregation", "SoftmaxAggregation"):
        theirs = getattr(pyg_aggr, name)()(batched, index, dim_size=60)
        assert_same_bits(getattr(detsum.pyg, name)()(batched, index, dim_size=60), theirs)
        assert_same_bits(getattr(detsum.pyg, name)()(batched, ptr=ptr), theirs)


def test_bf16_mean_is_within_half_an_ulp_where_pyg_is_not(small_graph):
    """A mean per node in bf16 against the exact mean: "exact" is correctly rounded (at most
    half an ulp), "fp32" rounds the fp32 quotient once more (half an ulp plus fp32's own
    rounding); PyG rounds the sum to bf16 before dividing and is further off."""
    x, index, _ = small_graph
    x = (x * 37).bfloat16()
    exact = torch.zeros(60, 6, dtype=torch.float64).index_add_(0, index, x.double())
    exact /= torch.bincount(index, minlength=60).clamp_min(1).double().view(-1, 1)
    spacing = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)

    def ulps(result):
        return ((result.double() - exact) / spacing).abs().max().item()

    assert ulps(detsum.pyg.MeanAggregation(mode="exact")(x, index, dim_size=60)) <= 0.5
    assert ulps(detsum.pyg.MeanAggregation(mode="fp32")(x, index, dim_size=60)) <= 0.5 + 2**-15
    assert ulps(pyg_aggr.MeanAggregation()(x, index, dim_size=60)) > 0.5


def test_softmax_aggregation_gradcheck_in_float64():
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(24, 3, dtype=torch.float64, generator=g).requires_grad_()
    index = torch.randint(0, 6, (24,), generator=g)
    aggregation = detsum.pyg.SoftmaxAggregation(t=0.7, mode="kahan")
    assert gradcheck(lambda v: aggregation(v, index, dim_size=8), (rows,))
    pointer = torch.tensor([0, 5, 5, 20, 24])
    assert gradcheck(lambda v: aggregation(v, ptr=pointer), (rows,))


def test_mean_aggregation_gradient_has_pygs_bits(small_graph):
    x, index, _ = small_graph
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(60, 6, generator=torch.Generator().manual_seed(4))
    detsum.pyg.MeanAggregation()(ours, index, dim_size=60).backward(upstream)
    pyg_aggr.MeanAggregation()(theirs, index, dim_size=60).backward(upstream)
    assert_same_bits(ours.grad, theirs.grad)


# ---- the functions ------------------------------------------------------------------------------

def test_scatter_and_softmax_take_pygs_arguments(small_graph):
    x, index, ptr = small_graph
    for reduce in ("sum", "add", "mean", "min", "max", "amin", "amax", "mul"):
        data = _data_for("MulAggregation", x) if reduce == "mul" else x
        assert_same_bits(detsum.pyg.scatter(data, index, 0, 60, reduce),
                         torch_geometric.utils.scatter(data, index, 0, 60, reduce))
    assert_same_bits(detsum.pyg.softmax(x, index, num_nodes=60),
                     torch_geometric.utils.softmax(x, index, num_nodes=60))
    assert_same_bits(detsum.pyg.softmax(x, ptr=ptr), torch_geometric.utils.softmax(x, ptr=ptr))
    assert_same_bits(detsum.pyg.softmax(x.t(), index, dim=-1),
                     torch_geometric.utils.softmax(x.t(), index, dim=-1))


def test_function_errors_name_the_argument(small_graph):
    x, index, ptr = small_graph
    with pytest.raises(ValueError, match="detsum.pyg.scatter: index has 2 dimensions"):
        detsum.pyg.scatter(x, index.view(1, -1))
    with pytest.raises(ValueError, match=r"reduce='any' is not supported"):
        detsum.pyg.scatter(x, index, reduce="any")
    with pytest.raises(ValueError, match=r"dim=2 is out of range for src with 2 dimensions"):
        detsum.pyg.scatter(x, index, dim=2)
    with pytest.raises(ValueError, match="neither index nor ptr"):
        detsum.pyg.softmax(x)
    with pytest.raises(ValueError, match=r"ptr runs from 0 to 400; expected 0 to "
                                         r"src.size\(0\) = 500"):
        detsum.pyg.softmax(x, ptr=torch.tensor([0, 100, 400]))
    with pytest.raises(ValueError, match="reduce='mul' needs index"):
        detsum.pyg.MulAggregation().forward(x, ptr=ptr)
