"""detsum.pyg: PyG's aggregations on detsum, and make_deterministic on whole layers.

The layers run on a random graph of 10k nodes and 100k edges (64 input features, 32 output):
forward and backward, the same bits over runs and detsum's thread counts, PyG's own bits where
they hold by construction (fp32 data: torch's CPU scatter_add_/index_add_ add each node's terms in
fp32 in order of appearance, as "autograd" mode does, and as "fp32" mode does while no node
receives more than 256 terms; bf16 sums: an fp32 buffer rounded once, "fp32" mode; bf16 in
"autograd" mode: the switch leaves those sums to torch's kernel). What make_deterministic keeps
of the model (its repr, pickling, torch.save, torch.compile with fullgraph=True) runs on a tiny
graph, counting the calls that reached detsum's kernels. The aggregation modules run alone on a
small graph.
"""

from __future__ import annotations

import collections
import copy
import io
import pickle
import re
import subprocess
import sys
import threading

import pytest
import torch
from torch.autograd import gradcheck

torch_geometric = pytest.importorskip("torch_geometric")

import detsum  # noqa: E402
import detsum.pyg  # noqa: E402
from detsum import switch as detsum_switch  # noqa: E402
from conftest import assert_same_bits, detsum_threads  # noqa: E402
from torch_geometric import EdgeIndex  # noqa: E402
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


@pytest.mark.parametrize("mode", ["fp32", "autograd"])
@pytest.mark.parametrize("name", LAYERS)
def test_bf16_layers_have_pygs_own_bits(name, mode, graph):
    """torch's CPU scatter_add_ and index_add_ keep a bf16 sum in an fp32 buffer and round it
    once: "fp32" mode's arithmetic, so the layers match PyG in bf16 too (SAGEConv's mean is
    PyG's: that sum, rounded to bf16, then divided). In "autograd" mode the switch leaves bf16
    sums to torch's kernel (docs/enable.md), which is PyG's."""
    for got, expected in zip(switched_result(name, torch.bfloat16, graph, mode),
                             pyg_result(name, torch.bfloat16, graph)):
        assert_same_bits(got, expected)


def test_bf16_sage_with_detsums_mean_is_no_further_from_fp64_than_pyg(graph):
    """SAGEConv's mean in bf16: PyG rounds the sum to bf16, then divides (two roundings);
    detsum.pyg.MeanAggregation in "fp32" mode divides the fp32 sum and rounds once. Against an
    fp64 run of the same layer (the bf16 parameters and input, widened), the layer built with
    detsum's mean has an output error no larger than PyG's, at its largest and on average; the
    input gradient (a gather's backward, which both sum in fp32) has PyG's bits."""
    layer = make_layer("SAGEConv", torch.bfloat16)
    reference = forward_backward(copy.deepcopy(layer).double(), graph, torch.float64)
    layer.aggr_module = detsum.pyg.MeanAggregation(mode="fp32")
    with detsum.pyg.make_deterministic(layer, mode="fp32"):
        ours = forward_backward(layer, graph, torch.bfloat16)
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


# ---- make_deterministic: what it changes, and undoing it ------------------------------------------

def _originals(layer):
    return {"aggr_module": layer.aggr_module, "fuse": layer.fuse,
            "instance attributes": sorted(vars(layer)),
            "hooks": (dict(layer._forward_pre_hooks), dict(layer._forward_hooks)),
            "gcn_conv.scatter": gcn_conv.scatter, "gat_conv.softmax": gat_conv.softmax}


def test_undo_restores_pygs_originals(graph):
    """The layer keeps PyG's modules and functions while it is switched; undo removes the mark
    and the hooks."""
    layer = make_layer("GATConv", torch.float32)
    before = _originals(layer)
    assert before["gcn_conv.scatter"] is torch_geometric.utils.scatter
    switch = detsum.pyg.make_deterministic(layer, mode="exact")
    assert layer.aggr_module is before["aggr_module"]
    assert type(layer.aggr_module) is pyg_aggr.SumAggregation
    assert switch.aggregations == [] and switch.layers == [""]
    switched = forward_backward(layer, graph, torch.float32)
    switch.undo()
    switch.undo()  # a second undo does nothing
    assert _originals(layer) == before
    unswitched = forward_backward(layer, graph, torch.float32)
    for got, expected in zip(unswitched, pyg_result("GATConv", torch.float32, graph)):
        assert_same_bits(got, expected)
    assert not torch.equal(switched[0], unswitched[0])  # "exact" did run while switched


@pytest.fixture(scope="module")
def tiny_graph():
    """120 edges among 30 nodes, 8 features: enough for every node to sum several terms."""
    g = torch.Generator().manual_seed(41)
    return (torch.randint(0, 30, (2, 120), generator=g), torch.randn(30, 8, generator=g),
            torch.randn(30, 8, generator=g))


TINY_LAYERS = {
    "GCNConv": lambda: GCNConv(8, 8),
    "SAGEConv": lambda: SAGEConv(8, 8),
    "GATConv": lambda: GATConv(8, 4, heads=2),
}


def _tiny_layer(name):
    torch.manual_seed(5)
    return TINY_LAYERS[name]()


def _run_counted(module, graph):
    """forward_backward, outside any ``detsum.deterministic`` block, and the calls that
    reached detsum's kernels meanwhile, per op (an op's in-place and functional forms
    together: compiled code runs the functional one)."""
    before = detsum_switch.counts.copy()
    results = forward_backward(module, graph, torch.float32)
    calls = collections.Counter()
    for (op, where), count in (detsum_switch.counts - before).items():
        if where == "detsum":
            calls[op.split(".")[0].rstrip("_")] += count
    assert detsum_switch.current_mode() is None  # off again after the forward and backward
    return results, calls


def _eager_reference(module, graph, mode):
    """What the unmarked ``module`` computes with its forward and backward inside
    ``detsum.deterministic(mode)``, and the calls that reached detsum."""
    with detsum.deterministic(mode):
        before = detsum_switch.counts.copy()
        results = forward_backward(module, graph, torch.float32)
    calls = collections.Counter()
    for (op, where), count in (detsum_switch.counts - before).items():
        if where == "detsum":
            calls[op.split(".")[0].rstrip("_")] += count
    return results, calls


@pytest.mark.parametrize("name", TINY_LAYERS)
def test_forward_and_backward_run_on_detsum_outside_any_block(name, tiny_graph):
    """A marked layer's forward, and its backward called after the forward returned, run on
    detsum's kernels in the layer's mode: the bits and the calls of the same layer run with
    both inside ``detsum.deterministic``; "exact" differs from PyG's own bits."""
    layer = _tiny_layer(name)
    expected, expected_calls = _eager_reference(copy.deepcopy(layer), tiny_graph, "exact")
    pygs = forward_backward(copy.deepcopy(layer), tiny_graph, torch.float32)
    detsum.pyg.make_deterministic(layer, mode="exact")
    got, calls = _run_counted(layer, tiny_graph)
    assert calls == expected_calls and calls["index_add"] > 0  # the gather's backward
    for a, b in zip(got, expected):
        assert_same_bits(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(got, pygs))


class _HalvesAndInput(torch.nn.Module):
    """A GCNConv whose output comes back as two halves, views made by one autograd node, and
    the model's input passed through untouched."""

    def __init__(self):
        super().__init__()
        self.layer = _tiny_layer("GCNConv")

    def forward(self, x, edge_index):
        return (*self.layer(x, edge_index).chunk(2, dim=1), x)


def test_outputs_of_one_node_and_an_input_passed_through(tiny_graph, monkeypatch):
    """The backward hook sits on each autograd node among a marked model's outputs, once per
    node (the two halves of one split share theirs); an input passed through has no node and
    gets none. A backward through both halves runs on detsum, with the bits of the same
    model run inside ``detsum.deterministic``."""
    edge_index, x, upstream = tiny_graph
    model = _HalvesAndInput()
    reference = copy.deepcopy(model)
    reached = []
    switch_on = detsum.pyg._switch_on_in_backward

    def recording_switch_on(mode, grads):
        reached.append(mode)
        switch_on(mode, grads)  # (a pre-hook returning a value would replace the gradients)

    monkeypatch.setattr(detsum.pyg, "_switch_on_in_backward", recording_switch_on)
    detsum.pyg.make_deterministic(model, mode="exact")

    def step(module):
        leaf = x.clone().requires_grad_()
        first, second, passed = module(leaf, edge_index)
        assert passed is leaf
        (first * upstream[:, :4]).sum().add((second * upstream[:, 4:]).sum()).backward()
        return leaf.grad

    before = detsum_switch.counts.copy()
    got = step(model)
    assert reached == ["exact"]
    assert (detsum_switch.counts - before)[("index_add_", "detsum")] > 0  # the gather's backward
    assert detsum_switch.current_mode() is None
    with detsum.deterministic("exact"):
        expected = step(reference)
    assert_same_bits(got, expected)


def test_pygs_functions_stay_pygs_and_the_switch_is_on_during_the_forward(tiny_graph):
    """Nothing of PyG is replaced: during the layer's forward gcn_norm's scatter is PyG's own,
    and the switch is on in the layer's mode, process-wide (another thread's index_add runs on
    detsum too); before and after, the switch is off."""
    edge_index, x, _ = tiny_graph
    layer = _tiny_layer("GCNConv")
    seen = {}

    def look(module, inputs, output):
        seen["scatter"] = gcn_conv.scatter
        seen["mode"] = detsum_switch.current_mode()
        terms = torch.tensor([1e8, 1.0, -1e8])
        other = threading.Thread(target=lambda: seen.setdefault(
            "other thread", torch.zeros(1).index_add(0, torch.tensor([0, 0, 0]), terms)))
        other.start()
        other.join()

    layer.register_message_forward_hook(look)
    with detsum.pyg.make_deterministic(layer, mode="exact"):
        assert detsum_switch.current_mode() is None
        layer(x, edge_index)
        assert detsum_switch.current_mode() is None
    assert seen["scatter"] is torch_geometric.utils.scatter
    assert seen["mode"] == "exact"
    assert seen["other thread"].item() == 1.0  # the exact sum; torch's gives 0.0


def test_a_forward_that_raises_turns_the_switch_off(tiny_graph):
    edge_index, x, _ = tiny_graph
    layer = _tiny_layer("GCNConv")
    with detsum.pyg.make_deterministic(layer):
        with pytest.raises(RuntimeError):
            layer(x[:, :3], edge_index)  # 3 features, not 8
        assert detsum_switch.current_mode() is None
        assert not getattr(detsum.pyg._open, "blocks", [])


class IndexAddPool(torch.nn.Module):
    def forward(self, x, index):
        return x.new_zeros(3, x.shape[1]).index_add_(0, index, x)


def test_a_switched_calls_error_in_a_marked_module_names_make_deterministic():
    """A bad index in a marked module's own accumulation: the error names the function that
    switched the call, ``make_deterministic``, not ``enable``, which the caller never called."""
    pool = IndexAddPool()
    detsum.pyg.make_deterministic(pool)
    with pytest.raises(IndexError, match=re.escape(
            "index_add_ (run by detsum.pyg.make_deterministic): index[2] = 5 is out of range")):
        pool(torch.ones(4, 3), torch.tensor([0, 1, 5, 1]))
    assert detsum_switch.current_mode() is None


class FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no gradient here")


def test_a_backward_that_raises_is_switched_off_at_the_next_forward(tiny_graph):
    """A backward that raises never reaches autograd's final callback, which turns the switch
    off: the thread's next call of a marked model does."""
    edge_index, x, _ = tiny_graph
    layer = _tiny_layer("GCNConv")
    detsum.pyg.make_deterministic(layer, mode="exact")
    out = layer(FailsInBackward.apply(x.clone().requires_grad_()), edge_index)
    with pytest.raises(RuntimeError, match="no gradient here"):
        out.sum().backward()
    assert detsum_switch.current_mode() == "exact"
    with torch.no_grad():
        layer(x, edge_index)
    assert detsum_switch.current_mode() is None
    _run_counted(layer, tiny_graph)  # and the next backward turns it off itself


def test_a_marked_layer_inside_a_block_runs_in_its_own_mode(tiny_graph):
    """Blocks nest: the layer's mode holds during its forward and backward, the block's
    outside them."""
    layer = _tiny_layer("GCNConv")
    expected, _ = _eager_reference(copy.deepcopy(layer), tiny_graph, "exact")
    detsum.pyg.make_deterministic(layer, mode="exact")
    with detsum.deterministic("fp32"):
        got = forward_backward(layer, tiny_graph, torch.float32)
        assert detsum_switch.current_mode() == "fp32"
    for a, b in zip(got, expected):
        assert_same_bits(a, b)


class Several(torch.nn.Module):
    """Layers of several kinds; ``model(x, edge_index, name)`` runs the one named."""

    def __init__(self, **layers):
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)

    def forward(self, x, edge_index, name):
        return getattr(self, name)(x, edge_index)


@pytest.mark.parametrize("name", TINY_LAYERS)
def test_repr_is_pygs(name):
    """A marked model prints as PyG's: its layers, their aggregation modules (a
    MultiAggregation's too) and an aggregation module of the model's own."""
    torch.manual_seed(5)
    model = Several(conv=TINY_LAYERS[name](), multi=SAGEConv(8, 8, aggr=["mean", "max"]),
                    pool=pyg_aggr.SumAggregation())
    before = (repr(model), repr(model.multi.aggr_module))
    with detsum.pyg.make_deterministic(model, mode="kahan"):
        assert (repr(model), repr(model.multi.aggr_module)) == before


class TwoLayers(torch.nn.Module):
    """Two layers and a sum over all nodes (a global_add_pool: torch's scatter_add_). Of two
    kinds: two GCN layers on one graph compute the same degrees, which a compiled graph would
    compute once."""

    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(8, 8)
        self.conv2 = SAGEConv(8, 8)
        self.pool = pyg_aggr.SumAggregation()

    def forward(self, x, edge_index):
        h = self.conv2(self.conv1(x, edge_index).relu(), edge_index)
        return h + self.pool(h, torch.zeros(h.shape[0], dtype=torch.long), dim_size=1)


def _two_layers():
    torch.manual_seed(9)
    return TwoLayers()


def test_pickle_and_torch_save_keep_the_mark_and_the_bits(tiny_graph):
    """pickle, copy.deepcopy and torch.save/torch.load of the whole model give a marked model
    (forward and backward on detsum, in the mode: the original's bits and calls); a
    state_dict holds only PyG's tensors, and loads into a model marked anew."""
    model = _two_layers()
    detsum.pyg.make_deterministic(model, mode="exact")
    pickled = pickle.dumps(model)
    saved, saved_state = io.BytesIO(), io.BytesIO()
    torch.save(model, saved)
    torch.save(model.state_dict(), saved_state)
    saved.seek(0)
    saved_state.seek(0)
    assert list(model.state_dict()) == list(_two_layers().state_dict())
    fresh = TwoLayers()
    fresh.load_state_dict(torch.load(saved_state))
    detsum.pyg.make_deterministic(fresh, mode="exact")
    expected, expected_calls = _run_counted(model, tiny_graph)
    assert expected_calls["scatter_add"] >= 3 and expected_calls["index_add"] > 0
    for copied in (pickle.loads(pickled), copy.deepcopy(model),
                   torch.load(saved, weights_only=False), fresh):
        got, calls = _run_counted(copied, tiny_graph)
        assert calls == expected_calls
        for a, b in zip(got, expected):
            assert_same_bits(a, b)


def test_a_deep_copy_runs_its_own_parameters(tiny_graph):
    edge_index, x, _ = tiny_graph
    layer = _tiny_layer("GCNConv")
    with detsum.pyg.make_deterministic(layer):
        copied = copy.deepcopy(layer)
        with torch.no_grad():
            copied.lin.weight.zero_()
        assert torch.equal(copied(x, edge_index), copied.bias.expand(30, -1))
    assert vars(copied)[detsum.pyg.MODE_ATTRIBUTE] == "fp32"  # undo changes the original only


# Importing Inductor (torch.utils.mkldnn) defines TorchScript methods, which torch deprecates.
@pytest.mark.filterwarnings("ignore:.torch.jit.script_method. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", TINY_LAYERS)
def test_compiled_with_fullgraph_runs_on_detsum(name, tiny_graph):
    """torch.compile(model, fullgraph=True): Dynamo traces the forward whole, the hooks run
    around it. Under AOTAutograd without Inductor the compiled forward and backward have the
    eager bits and calls; with Inductor the same calls reach detsum, and the bits repeat (its
    own arithmetic around them, which it fuses, rounds otherwise than eager code in places)."""
    layer = _tiny_layer(name)
    detsum.pyg.make_deterministic(layer, mode="exact")
    expected, expected_calls = _run_counted(layer, tiny_graph)
    torch._dynamo.reset()
    try:
        got, calls = _run_counted(torch.compile(layer, fullgraph=True, backend="aot_eager"),
                                  tiny_graph)
        assert calls == expected_calls
        for a, b in zip(got, expected):
            assert_same_bits(a, b)
        compiled = torch.compile(layer, fullgraph=True)
        first, calls = _run_counted(compiled, tiny_graph)
        assert calls == expected_calls
        second, _ = _run_counted(compiled, tiny_graph)
        for a, b in zip(first, second):
            assert_same_bits(a, b)
    finally:
        torch._dynamo.reset()


def test_layers_compiled_one_by_one_and_module_compile(tiny_graph):
    """A marked model whose layers are compiled one by one (``layer.compile(fullgraph=True)``)
    or which is compiled as a whole with ``model.compile(fullgraph=True)``: the eager bits and
    calls (AOTAutograd without Inductor, as above)."""
    model = _two_layers()
    detsum.pyg.make_deterministic(model, mode="exact")
    expected, expected_calls = _run_counted(model, tiny_graph)
    whole = copy.deepcopy(model)
    torch._dynamo.reset()
    try:
        for layer in (model.conv1, model.conv2):
            layer.compile(fullgraph=True, backend="aot_eager")
        whole.compile(fullgraph=True, backend="aot_eager")
        for compiled in (model, whole):
            got, calls = _run_counted(compiled, tiny_graph)
            assert calls == expected_calls
            for a, b in zip(got, expected):
                assert_same_bits(a, b)
    finally:
        torch._dynamo.reset()


def test_a_function_calling_a_marked_model_compiles_without_fullgraph(tiny_graph):
    """Dynamo does not trace the hooks: with fullgraph=True it refuses them, naming detsum;
    without, it runs them between the graphs it compiles, and the function has the eager bits
    and calls."""
    edge_index, x, _ = tiny_graph
    model = _two_layers()
    detsum.pyg.make_deterministic(model, mode="exact")
    expected, expected_calls = _run_counted(model, tiny_graph)
    torch._dynamo.reset()
    try:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="detsum.pyg"):
            torch.compile(lambda a, b: model(a, b), fullgraph=True, backend="aot_eager")(
                x, edge_index)
        torch._dynamo.reset()
        caller = Calls(torch.compile(lambda a, b: model(a, b), backend="aot_eager"), model)
        got, calls = _run_counted(caller, tiny_graph)
        assert calls == expected_calls
        for a, b in zip(got, expected):
            assert_same_bits(a, b)
    finally:
        torch._dynamo.reset()


class Calls(torch.nn.Module):
    """``function(x, edge_index)``, with ``model``'s parameters as its own."""

    def __init__(self, function, model):
        super().__init__()
        self.function, self.model = function, model

    def forward(self, x, edge_index):
        return self.function(x, edge_index)


@pytest.mark.filterwarnings("ignore:.torch.jit.script(_method)?. is deprecated:DeprecationWarning")
def test_a_scripted_model_runs_on_detsum_inside_a_block(tiny_graph):
    """TorchScript refuses the hooks of a marked model; the unmarked model, scripted, run
    inside ``detsum.deterministic`` has the marked model's bits and calls."""
    layer = _tiny_layer("GCNConv")
    scripted = torch.jit.script(copy.deepcopy(layer))
    switch = detsum.pyg.make_deterministic(layer, mode="exact")
    expected, expected_calls = _run_counted(layer, tiny_graph)
    with pytest.raises(RuntimeError, match="detsum_switch_off"):
        torch.jit.script(layer)
    switch.undo()
    got, calls = _eager_reference(scripted, tiny_graph, "exact")
    assert calls == expected_calls
    for a, b in zip(got, expected):
        assert_same_bits(a, b)


def test_multi_aggregation_keeps_pygs_fused_path_on_detsum(graph):
    """PyG's MultiAggregation and its fused aggregation stay as they are and run on detsum:
    in "fp32" mode, with PyG's bits (no node receives more than 256 messages here)."""
    edge_index, x, _ = graph
    torch.manual_seed(3)
    layer = SAGEConv(IN_FEATURES, OUT_FEATURES, aggr=["mean", "max", "sum"])
    expected = layer(x, edge_index)
    multi = layer.aggr_module
    fused = multi.fused_aggr
    assert fused is not None
    with detsum.pyg.make_deterministic(layer, mode="fp32"):
        before = detsum_switch.counts.copy()
        assert_same_bits(layer(x, edge_index), expected)
        calls = detsum_switch.counts - before
        assert multi.fused_aggr is fused
        assert [type(a).__module__ for a in multi.aggrs] == ["torch_geometric.nn.aggr.basic"] * 3
    assert calls[("scatter_add_", "detsum")] > 0 and calls[("scatter_reduce_.two", "detsum")] > 0


def test_learnable_softmax_temperature_stays_the_same_parameter():
    layer = GCNConv(8, 8, aggr=pyg_aggr.SoftmaxAggregation(learn=True))
    t = layer.aggr_module.t
    with detsum.pyg.make_deterministic(layer, mode="kahan"):
        assert layer.aggr_module.t is t
        assert [p for p in layer.parameters() if p is t]


def test_refusals_name_the_input_or_module_and_change_nothing(graph):
    """Refused before anything changes: an exact product (strict), a model marked already, a
    bad mode; refused at a layer's call, before it computes: a sparse adjacency and an
    EdgeIndex. PyG's other aggregation modules (std here) run their torch ops on the switch."""
    edge_index, x, _ = graph
    x, edge_index = x[:50, :8], edge_index[:, :20] % 50
    layer = Several(conv=SAGEConv(8, 8, aggr="std"), ok=GCNConv(8, 8),
                    product=GCNConv(8, 8, aggr="mul"))
    before = _originals(layer.ok)
    with pytest.raises(ValueError, match=r"product.aggr_module \(MulAggregation\) multiplies, "
                                         r"and detsum's reduce='mul' has no mode='exact'"):
        detsum.pyg.make_deterministic(layer, mode="exact")
    assert _originals(layer.ok) == before and detsum.pyg.MODE_ATTRIBUTE not in vars(layer)
    with detsum.pyg.make_deterministic(layer, mode="exact", strict=False) as switch:
        assert switch.layers == ["conv", "ok", "product"]
        with pytest.raises(ValueError, match="switched already"):
            detsum.pyg.make_deterministic(layer)
        counts = detsum_switch.counts.copy()
        layer(x, edge_index, "conv")
        assert (detsum_switch.counts - counts)[("scatter_add_", "detsum")] > 0
        adjacency = torch.sparse_coo_tensor(edge_index, torch.ones(20), (50, 50),
                                            check_invariants=True)
        with pytest.raises(ValueError, match=r"GCNConv, a layer of a model made "
                                             r"deterministic, was called with a sparse tensor"):
            layer(x, adjacency, "ok")
        with pytest.raises(ValueError, match=r"was called with an EdgeIndex"):
            layer(x, EdgeIndex(edge_index), "ok")
        assert detsum_switch.current_mode() is None
    assert _originals(layer.ok) == before and detsum.pyg.MODE_ATTRIBUTE not in vars(layer)
    with pytest.raises(ValueError, match="mode='fast' is not a detsum mode"):
        detsum.pyg.make_deterministic(layer, mode="fast")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        detsum.pyg.make_deterministic(forward_backward)
    with pytest.raises(TypeError, match="model is a ModuleDict, which has no forward"):
        detsum.pyg.make_deterministic(torch.nn.ModuleDict({"ok": GCNConv(8, 8)}))


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


@pytest.mark.filterwarnings("ignore:.torch.jit.script_method. is deprecated:DeprecationWarning")
def test_softmax_without_num_nodes_compiles_with_fullgraph(small_graph):
    """``softmax(src, index)`` without ``num_nodes`` reads the node count once (the maximum's
    scatter), and the sum takes it from that result's size: ``torch.compile(fullgraph=True)``
    traces it (a second read was a data-dependent guard). Under AOTAutograd without
    Inductor, the eager bits forward and backward; with Inductor, which fuses the exp and
    the division around detsum's calls, the same bits twice. An empty index gives no nodes."""
    x, index, _ = small_graph
    x = x.detach().requires_grad_()
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))

    def run(softmax):
        out = softmax(x, index)
        return out, torch.autograd.grad(out, x, grad_out)[0]

    expected = run(detsum.pyg.softmax)
    assert expected[0].shape == x.shape
    torch._dynamo.reset()
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            got = run(torch.compile(detsum.pyg.softmax, fullgraph=True, backend="aot_eager"))
            for a, e in zip(got, expected):
                assert_same_bits(a, e)
            compiled = torch.compile(detsum.pyg.softmax, fullgraph=True)
            first, second = run(compiled), run(compiled)
            for a, e in zip(first, second):
                assert_same_bits(a, e)
    finally:
        torch._dynamo.reset()
    empty = detsum.pyg.softmax(x[:0], index[:0])
    assert empty.shape == (0, x.shape[1])


def test_function_errors_name_the_argument(small_graph):
    x, index, ptr = small_graph
    with pytest.raises(ValueError, match="detsum.pyg.scatter: index has 2 dimensions"):
        detsum.pyg.scatter(x, index.view(1, -1))
    with pytest.raises(ValueError, match=r"reduce='any' is not supported"):
        detsum.pyg.scatter(x, index, reduce="any")
    with pytest.raises(ValueError, match=r"dim=2 is out of range for src with 2 dimensions"):
        detsum.pyg.scatter(x, index, dim=2)
    with pytest.raises(TypeError, match=r"detsum.pyg.scatter: reduce=\['sum'\] is a list; "
                                        r"expected a str"):
        detsum.pyg.scatter(x, index, reduce=["sum"])
    with pytest.raises(TypeError, match=r"detsum.pyg.scatter: dim=0.0 is a float; expected "
                                        r"an int in \[-2, 1\]"):
        detsum.pyg.scatter(x, index, dim=0.0)
    with pytest.raises(ValueError, match="neither index nor ptr"):
        detsum.pyg.softmax(x)
    with pytest.raises(ValueError, match=r"detsum.pyg.softmax: num_nodes=-1; expected a "
                                         r"non-negative int"):
        detsum.pyg.softmax(x, index, num_nodes=-1)
    with pytest.raises(TypeError, match="detsum.pyg.softmax: ptr must be a torch.Tensor or "
                                        "None, got list"):
        detsum.pyg.softmax(x, ptr=[0, 100, 500])
    with pytest.raises(ValueError, match=r"ptr runs from 0 to 400; expected 0 to "
                                         r"src.size\(0\) = 500"):
        detsum.pyg.softmax(x, ptr=torch.tensor([0, 100, 400]))
    with pytest.raises(ValueError, match="reduce='mul' needs index"):
        detsum.pyg.MulAggregation().forward(x, ptr=ptr)


def test_errors_found_inside_name_the_function_called_and_its_argument(small_graph):
    """Errors found by the scatter or segment_csr underneath name the function the caller
    called (not ``detsum.scatter``) and the argument as it was given (``num_nodes``, ``ptr``)."""
    x, index, ptr = small_graph
    beyond = index.clone()
    beyond[7] = 60
    with pytest.raises(IndexError, match=r"^detsum.pyg.scatter: index\[7\] = 60 is out of "
                                         r"range for dim_size = 60"):
        detsum.pyg.scatter(x, beyond, dim_size=60)
    with pytest.raises(TypeError, match=r"^detsum.pyg.scatter: index has dtype torch.float32"):
        detsum.pyg.scatter(x, index.float())
    with pytest.raises(TypeError, match=r"^detsum.pyg.scatter: dim_size='3' is a str"):
        detsum.pyg.scatter(x, index, dim_size="3")
    with pytest.raises(IndexError, match=r"^detsum.pyg.softmax: index\[7\] = 60 is out of "
                                         r"range for num_nodes = 60"):
        detsum.pyg.softmax(x, beyond, num_nodes=60)
    with pytest.raises(TypeError, match=r"^detsum.pyg.softmax: num_nodes=60.0 is a float"):
        detsum.pyg.softmax(x, index, num_nodes=60.0)
    backwards = ptr.clone()
    backwards[3] = backwards[2] - 1
    with pytest.raises(ValueError, match=r"^detsum.pyg.softmax: ptr decreases after its flat "
                                         r"position 2"):
        detsum.pyg.softmax(x, ptr=backwards)
    # (Called as modules, PyG's Aggregation.__call__ raises its own ValueError from an
    # IndexError: forward is what detsum defines.)
    with pytest.raises(ValueError, match=r"^detsum.pyg.SumAggregation: ptr decreases after "
                                         r"its flat position 2"):
        detsum.pyg.SumAggregation().forward(x, ptr=backwards)
    with pytest.raises(IndexError, match=r"^detsum.pyg.MaxAggregation: index\[7\] = 60 is "
                                         r"out of range for dim_size = 60"):
        detsum.pyg.MaxAggregation().forward(x, beyond, dim_size=60)
    with pytest.raises(IndexError, match=r"^detsum.pyg.SoftmaxAggregation: index\[7\] = 60 "
                                         r"is out of range for dim_size = 60"):
        detsum.pyg.SoftmaxAggregation().forward(x, beyond, dim_size=60)
