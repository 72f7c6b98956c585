"""detsum.enable on whole PyG models: a 2-layer GCN and a 2-layer GAT, as PyG's users write
them, trained 5 Adam steps under ``detsum.deterministic("fp32")``.

- The parameters after 5 steps are the same bits on 1 and 2 threads and in a second process,
  and on 2 threads detsum's kernels did run on 2.
- Every accumulating op the training calls (PyG's ``scatter_add_`` aggregations and degree
  sums, the ``index_add_`` of ``index_select``'s backward, GAT's ``scatter_reduce`` max) runs
  on detsum: ``detsum.switch.counts`` says so, and none is left to torch's kernel.
- The trained model pickles, and saves and loads with ``torch.save`` (its state and the whole
  module), and gives the same output and gradient bits afterwards.
- ``torch.compile(model, fullgraph=True)`` under the switch gives the eager switched bits:
  with the ``"aot_eager"`` backend (the graph Dynamo and AOTAutograd capture, forward and
  backward, run op by op) for both models as they are; with Inductor for the GCN with its
  normalisation computed beforehand and no bias. Inductor computes the rest in arithmetic of
  its own (docs/enable.md, "Under torch.compile"): its ``pow(-0.5)`` of the degree (GCN's
  normalisation) and its ``exp`` (GAT's softmax) give other bits than eager code, with or
  without the switch, and it sums a bias's gradient over the nodes in its own order.

The graph is small (200 nodes, 10000 random edges plus self-loops, 8 features, hidden 16, 3
classes), yet large enough that the hidden layer's sums are split into two thread blocks
(kernels/numba/common.py's ``work_split``: at least 64k term elements each); no node receives
256 terms, so "fp32" mode gives torch's own bits here: what the tests show is that the switch
runs the training on detsum without changing what it computes, whatever the thread count.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import io
import json
import pickle
import pkgutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

torch_geometric = pytest.importorskip("torch_geometric")

import detsum  # noqa: E402
from detsum import switch  # noqa: E402
from torch_geometric.nn import GATConv, GCNConv  # noqa: E402
from torch_geometric.nn.conv.gcn_conv import gcn_norm  # noqa: E402

NODES, EDGES, FEATURES, HIDDEN, CLASSES = 200, 10_000, 8, 16, 3
STEPS = 5
MODE = "fp32"


class GCN(torch.nn.Module):
    def __init__(self, normalize: bool = True, bias: bool = True):
        super().__init__()
        self.conv1 = GCNConv(FEATURES, HIDDEN, normalize=normalize, bias=bias)
        self.conv2 = GCNConv(HIDDEN, CLASSES, normalize=normalize, bias=bias)

    def forward(self, x, edge_index, edge_weight=None):
        hidden = self.conv1(x, edge_index, edge_weight).relu()
        return self.conv2(hidden, edge_index, edge_weight)


class GAT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GATConv(FEATURES, HIDDEN, heads=2)
        self.conv2 = GATConv(2 * HIDDEN, CLASSES, heads=1)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


MODELS = {"GCN": GCN, "GAT": GAT}
#: The switched ops each model's training step runs on detsum (the in-place forms eager code
#: calls): aggregations and GCN's degree sum, index_select's backward, GAT's softmax max.
EXPECTED_OPS = {"GCN": {"scatter_add_", "index_add_"},
                "GAT": {"scatter_add_", "index_add_", "scatter_reduce_.two"}}


@pytest.fixture(autouse=True)
def switch_off_and_threads_restored_after():
    threads = torch.get_num_threads()
    yield
    switch._blocks.clear()
    detsum.disable()
    torch.set_num_threads(threads)


def graph():
    generator = torch.Generator().manual_seed(2026)
    edge_index = torch.randint(0, NODES, (2, EDGES), generator=generator)
    x = torch.randn(NODES, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (NODES,), generator=generator)
    return x, edge_index, labels


def new_model(name: str, **options) -> torch.nn.Module:
    torch.manual_seed(7)
    return MODELS[name](**options)


def train(model, inputs, labels, steps: int = STEPS, run=None):
    """``steps`` Adam steps of cross-entropy on every node; ``run`` (default: the model
    itself) computes the output. Returns the calls of switched ops during the training, as
    ``switch.counts`` keys them."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    run = model if run is None else run
    before = switch.counts.copy()
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(run(*inputs), labels).backward()
        optimizer.step()
    return switch.counts - before


def parameters_bits(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_parameters(a: dict, b: dict, what):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (what, name)


def output_and_grads(model, inputs):
    """The output for ``inputs`` and every parameter's gradient of its sum of squares."""
    model.zero_grad()
    out = model(*inputs)
    out.square().sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def fingerprints() -> dict[str, str]:
    """For each model and each thread count, 1 and 2: the SHA-256 of its parameters' bytes
    after the switched training, and the ops that ran on detsum and on torch."""
    x, edge_index, labels = graph()
    result = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name in MODELS:
            model = new_model(name)
            with detsum.deterministic(MODE):
                calls = train(model, (x, edge_index), labels)
            digest = hashlib.sha256()
            for p in model.parameters():
                digest.update(p.detach().numpy().tobytes())
            result[f"{name} on {threads} thread(s)"] = {
                "parameters": digest.hexdigest(),
                "detsum": sorted(op for op, ran in calls if ran == "detsum"),
                "torch": sorted(op for op, ran in calls if ran == "torch")}
    return result


# ---- the same bits across threads and runs --------------------------------------------------

@pytest.fixture
def launch_threads_seen(monkeypatch):
    """(torch's thread count, the thread count of the launch) for each detsum kernel launch
    on Numba's thread pool."""
    from detsum.kernels import numba as numba_kernels

    seen = []
    for info in pkgutil.iter_modules(numba_kernels.__path__):
        module = importlib.import_module(f"{numba_kernels.__name__}.{info.name}")
        threads = getattr(module, "threads", None)
        if threads is None or not callable(threads):
            continue

        def recording(count, threads=threads):
            seen.append((torch.get_num_threads(), count))
            return threads(count)

        monkeypatch.setattr(module, "threads", recording)
    return seen


def test_training_gives_the_same_bits_on_1_and_2_threads_and_in_another_process(
        launch_threads_seen):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba runs on one thread here: detsum's kernels cannot use two")
    here = fingerprints()
    assert {count for torch_threads, count in launch_threads_seen if torch_threads == 1} == {1}
    assert 2 in {count for torch_threads, count in launch_threads_seen if torch_threads == 2}
    for name in MODELS:
        one, two = here[f"{name} on 1 thread(s)"], here[f"{name} on 2 thread(s)"]
        assert one["parameters"] == two["parameters"], name
        for record in (one, two):
            assert set(record["detsum"]) == EXPECTED_OPS[name], (name, record)
            assert record["torch"] == [], (name, record)
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                           check=True, timeout=600)
    assert json.loads(child.stdout.splitlines()[-1]) == here


def test_switched_training_runs_every_accumulation_on_detsum():
    """The counts per op for one step: the aggregations of both layers, forward and
    backward, ran on detsum and nothing was left to torch's kernels."""
    x, edge_index, labels = graph()
    for name in MODELS:
        model = new_model(name)
        # Switch off: no detsum (its kernels, registered by an earlier block, hand each call
        # to torch's).
        off = train(model, (x, edge_index), labels, steps=1)
        assert not any(ran == "detsum" for _, ran in off), off
        with detsum.deterministic(MODE):
            calls = train(model, (x, edge_index), labels, steps=1)
        assert {op for op, ran in calls if ran == "detsum"} == EXPECTED_OPS[name], name
        assert all(ran == "detsum" for _, ran in calls), (name, calls)


# ---- pickling and torch.save ----------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_trained_model_pickles_and_saves_with_the_same_bits(name):
    x, edge_index, labels = graph()
    model = new_model(name)
    with detsum.deterministic(MODE):
        train(model, (x, edge_index), labels)
        expected = output_and_grads(model, (x, edge_index))

        copies = {"pickle": pickle.loads(pickle.dumps(model)), "deepcopy": copy.deepcopy(model)}
        whole, state = io.BytesIO(), io.BytesIO()
        torch.save(model, whole)
        torch.save(model.state_dict(), state)
        whole.seek(0)
        state.seek(0)
        copies["torch.save(model)"] = torch.load(whole, weights_only=False)
        fresh = MODELS[name]()
        fresh.load_state_dict(torch.load(state, weights_only=True))
        copies["torch.save(state_dict)"] = fresh

        for how, copied in copies.items():
            before = switch.counts.copy()
            out, grads = output_and_grads(copied, (x, edge_index))
            calls = switch.counts - before
            assert {op for op, ran in calls if ran == "detsum"} == EXPECTED_OPS[name], how
            assert all(ran == "detsum" for _, ran in calls), (how, calls)
            assert torch.equal(out, expected[0]), (name, how)
            assert_same_parameters(grads, expected[1], (name, how))
            # The copy trains on as the original does.
            twin = copy.deepcopy(model)
            train(twin, (x, edge_index), labels, steps=1)
            train(copied, (x, edge_index), labels, steps=1)
            assert_same_parameters(parameters_bits(copied), parameters_bits(twin), (name, how))


# ---- torch.compile(fullgraph=True) ----------------------------------------------------------

@pytest.fixture
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", MODELS)
def test_compiled_training_gives_the_eager_switched_bits_aot_eager(name, fresh_compiler):
    """The whole model, fullgraph, forward and backward as AOTAutograd captures them: each
    switched op in the graph reaches detsum, with eager code's bits after 5 steps."""
    x, edge_index, labels = graph()
    eager, compiled = new_model(name), new_model(name)
    with detsum.deterministic(MODE):
        train(eager, (x, edge_index), labels)
        run = torch.compile(compiled, fullgraph=True, backend="aot_eager")
        calls = train(compiled, (x, edge_index), labels, run=run)
    assert_same_parameters(parameters_bits(compiled), parameters_bits(eager), name)
    # Compiled graphs call the functional forms of the ops eager code calls in place.
    ran = {op.split(".")[0].rstrip("_") for op, where in calls if where == "detsum"}
    assert ran == {op.split(".")[0].rstrip("_") for op in EXPECTED_OPS[name]}, calls
    assert all(where == "detsum" for _, where in calls), calls


def test_compiled_gcn_gives_the_eager_switched_bits_inductor(fresh_compiler):
    """Inductor, fullgraph, a GCN given its normalised edge weights (``gcn_norm``, eager,
    under the switch): forward and backward compiled, 5 steps, eager code's bits. Without
    bias: its gradient is a sum over the nodes, which Inductor computes in its own order."""
    x, edge_index, labels = graph()
    with detsum.deterministic(MODE):
        edge_index, edge_weight = gcn_norm(edge_index, None, NODES, add_self_loops=True)
        inputs = (x, edge_index, edge_weight)
        eager = new_model("GCN", normalize=False, bias=False)
        compiled = new_model("GCN", normalize=False, bias=False)
        train(eager, inputs, labels)
        calls = train(compiled, inputs, labels, run=torch.compile(compiled, fullgraph=True))
    assert_same_parameters(parameters_bits(compiled), parameters_bits(eager), "GCN")
    assert {op for op, where in calls if where == "detsum"} == {"scatter_add", "index_add"}
    assert all(where == "detsum" for _, where in calls), calls


if __name__ == "__main__":
    print(json.dumps(fingerprints()))
