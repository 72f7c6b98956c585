"""detsum.enable under torch.compile (Inductor, CPU, fullgraph=True) and TorchScript: compiled
code reaches the switch's kernels, with the bits eager code gets under the switch.

Inductor's own code for these ops (atomic adds spread over threads) gives bits that vary from
run to run, so what shows that compiled code ran on detsum is ``switch.counts``, and the
"exact" mode, whose bits torch's kernels never give on these inputs.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import detsum
from detsum import switch

# torch's own index_reduce says it is in beta, every time torch's kernel runs it.
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta:UserWarning")


@pytest.fixture(autouse=True)
def fresh_compiler_and_switch_off_after():
    torch._dynamo.reset()
    yield
    switch._blocks.clear()
    detsum.disable()
    torch._dynamo.reset()


def terms_case(rows: int = 4, n: int = 400, width: int = 3):
    """A duplicate-heavy index and terms over six decades: every row's float32 sum in index
    order (torch's) loses bits that the exact sum keeps."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator)
    terms = torch.randn(n, width, generator=generator) * torch.logspace(-3, 3, n).view(-1, 1)
    index = torch.randint(0, rows, (n,), generator=generator)
    return x, index, index.view(-1, 1).expand(n, width).contiguous(), terms


def families(leaves, index, rows_index, terms):
    """Each switched op family on its own leaf, so that no gradient of one family is added to
    another's (that sum would be Inductor's or autograd's, not the switch's)."""
    (index_add, scatter_add, scatter_sum, scatter_amax, index_mean, index_put, take, gather,
     embedding, put) = leaves
    return (
        index_add.index_add(0, index, terms),
        scatter_add.scatter_add(0, rows_index, terms),
        scatter_sum.scatter_reduce(0, rows_index, terms, "sum"),
        scatter_amax.scatter_reduce(0, rows_index, terms, "amax"),
        index_mean.index_reduce(0, index, terms, "mean"),
        index_put.index_put((index,), terms, accumulate=True),
        take[index] * terms,                           # backward: index_put, accumulate=True
        torch.gather(gather, 0, rows_index) * terms,   # backward: scatter_add
        F.embedding(index, embedding) * terms,         # backward: embedding_dense_backward
        put.clone().put_(index, terms[:, 0].contiguous(), accumulate=True),
    )


NAMES = ("index_add", "scatter_add", "scatter_reduce sum", "scatter_reduce amax",
         "index_reduce mean", "index_put", "x[idx]", "gather", "embedding", "put_")
# The outputs and gradients that are sums of the terms (amax's are not).
SUMS_FORWARD = ("index_add", "scatter_add", "scatter_reduce sum", "index_reduce mean",
                "index_put", "put_")
SUMS_BACKWARD = ("x[idx]", "gather", "embedding")


def outputs_and_grads(function, case):
    """The outputs of ``families`` and each leaf's gradient for all-ones output gradients,
    with the calls each switched op (in-place and functional forms together) sent to detsum
    while they ran."""
    x, index, rows_index, terms = case
    leaves = [x.clone().requires_grad_() for _ in NAMES]
    before = switch.counts.copy()
    outputs = function(leaves, index, rows_index, terms)
    grads = torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs],
                                allow_unused=True)
    ran = collections.Counter()
    for (name, where), n in (switch.counts - before).items():
        if where == "detsum":  # compiled code calls the functional form of an in-place op
            ran[name.split(".")[0].rstrip("_")] += n
    return [o.detach() for o in outputs], list(grads), ran


def assert_equal_bits(compiled, eager, what):
    for name, c, e in zip(NAMES, compiled, eager):
        if e is None:
            assert c is None, (what, name)
            continue
        assert torch.equal(c, e), (what, name, (c - e).abs().max().item())


def test_compiled_families_give_the_eager_bits_under_the_switch():
    """Forward and backward of every family, compiled once with fullgraph=True, in "exact"
    and "fp32" mode: the bits of eager code under the switch, from the same calls to detsum.
    "exact" differs from torch's bits on this input, so Inductor's code could not pass; the
    mode is read at run time, so changing it compiles nothing."""
    case = terms_case()
    compiled = torch.compile(families, fullgraph=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch_out, torch_grads, _ = outputs_and_grads(families, case)
    for mode in ("exact", "fp32"):
        with detsum.deterministic(mode):
            eager_out, eager_grads, eager_ran = outputs_and_grads(families, case)
            compiled_out, compiled_grads, compiled_ran = outputs_and_grads(compiled, case)
        assert_equal_bits(compiled_out, eager_out, (mode, "forward"))
        assert_equal_bits(compiled_grads, eager_grads, (mode, "backward"))
        assert compiled_ran == eager_ran
        assert set(compiled_ran) >= {"index_add", "scatter_add", "scatter_reduce",
                                     "index_reduce", "_index_put_impl", "put",
                                     "embedding_dense_backward"}
        if mode == "exact":
            for name in SUMS_FORWARD:
                k = NAMES.index(name)
                assert not torch.equal(compiled_out[k], torch_out[k]), name
            for name in SUMS_BACKWARD:
                k = NAMES.index(name)
                assert not torch.equal(compiled_grads[k], torch_grads[k]), name
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


def scatter_and_take(x, index, rows_index, terms):
    return x.scatter_add(0, rows_index, terms), x[index] * terms


def run_on(function, case):
    """The output and the gradient of ``scatter_and_take``, and whether any call ran on
    detsum."""
    x, index, rows_index, terms = case
    leaf = x.clone().requires_grad_()
    before = switch.counts.copy()
    scattered, taken = function(leaf, index, rows_index, terms)
    (grad,) = torch.autograd.grad(taken, leaf, torch.ones_like(taken))
    ran_on_detsum = any(where == "detsum" for _, where in switch.counts - before)
    return scattered.detach(), grad, ran_on_detsum


def test_compiled_code_follows_the_switch_through_every_cache():
    """Code compiled with the switch off is not run with it on, nor the reverse: Dynamo's
    cache keeps one entry per state (no third compile), and after a reset the caches on disk
    (FX graph, AOTAutograd), which hold both, give each state its own."""
    case = terms_case()
    compiled = torch.compile(scatter_and_take, fullgraph=True)
    with detsum.deterministic("exact"):
        exact = run_on(scatter_and_take, case)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    assert not run_on(compiled, case)[2]
    for _ in range(2):
        with detsum.deterministic("exact"):
            scattered, grad, ran_on_detsum = run_on(compiled, case)
        assert ran_on_detsum and torch.equal(scattered, exact[0]) and torch.equal(grad, exact[1])
        assert not run_on(compiled, case)[2]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2

    torch._dynamo.reset()
    with detsum.deterministic("exact"):
        scattered, grad, ran_on_detsum = run_on(compiled, case)
    assert ran_on_detsum and torch.equal(scattered, exact[0]) and torch.equal(grad, exact[1])
    torch._dynamo.reset()
    assert not run_on(compiled, case)[2]


def test_the_cache_tag_follows_every_on_and_off_once_something_is_compiled():
    """Once something has been compiled (docs/enable.md), every on and off of the switch sets
    the caches' tag: inside a block it ends in the switch's mark, after the block it does
    not; a nested block of another mode keeps it, and so does the end of that block."""
    from detsum import _switch_compile

    compiled = torch.compile(lambda x, i, t: x.index_add(0, i, t), fullgraph=True)
    with detsum.deterministic("fp32"):
        compiled(torch.zeros(2), torch.tensor([0, 1, 0]), torch.ones(3))

    def tagged() -> bool:
        return torch.compiler.config.cache_key_tag.endswith(_switch_compile._CACHE_TAG)

    assert not tagged()
    with detsum.deterministic("exact"):
        assert tagged()
        with detsum.deterministic("fp32"):
            assert tagged()
        assert tagged()
    assert not tagged()


def test_code_compiled_before_the_first_enable_is_compiled_again():
    """Frames that Dynamo compiled before the switch was first used carry no guard on it."""
    code = ("import torch, detsum\n"
            "from detsum import switch\n"
            "compiled = torch.compile(lambda x, i, t: x.index_add(0, i, t), fullgraph=True)\n"
            "x, index, terms = torch.zeros(2), torch.tensor([0, 1, 0]), torch.ones(3)\n"
            "compiled(x, index, terms)\n"
            "with detsum.deterministic('exact'):\n"
            "    compiled(x, index, terms)\n"
            "assert switch.counts[('index_add', 'detsum')] == 1, switch.counts\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def test_a_process_whose_first_compile_is_switched_on_misses_the_caches_of_code_compiled_off(
        tmp_path):
    """The cache tag is set where a frame's compile begins, not at each on and off before the
    first compile: a process that switches on and off, then compiles with the switch on, must
    not be handed the code that another process compiled with it off (the caches on disk,
    shared here, hold it under the same graph)."""
    code = ("import sys, torch, detsum\n"
            "from detsum import switch\n"
            "compiled = torch.compile(lambda x, i, t: x.index_add(0, i, t), fullgraph=True)\n"
            "x, index, terms = torch.zeros(2), torch.tensor([0, 1, 0]), torch.ones(3)\n"
            "if sys.argv[1] == 'on':\n"
            "    with detsum.deterministic('fp32'):\n"
            "        pass\n"
            "    with detsum.deterministic('exact'):\n"
            "        compiled(x, index, terms)\n"
            "    assert switch.counts[('index_add', 'detsum')] == 1, switch.counts\n"
            "else:\n"
            "    compiled(x, index, terms)\n")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for state in ("off", "on"):
        subprocess.run([sys.executable, "-c", code, state], check=True, timeout=600, env=env)


def test_a_graph_break_at_a_switched_op_runs_it_on_detsum():
    """bincount's output shape depends on its data: Dynamo breaks the graph there and runs it
    eagerly, with its frame hook still set; the switch's kernel runs as plain Python, not
    traced by Dynamo."""
    compiled = torch.compile(lambda index, weights: torch.bincount(index, weights))
    index, weights = torch.tensor([0, 0, 0]), torch.tensor([1e8, 1.0, -1e8])
    frames = torch._dynamo.utils.counters["frames"]["total"]
    with detsum.deterministic("exact"):
        assert compiled(index, weights).item() == 1.0
    assert torch._dynamo.utils.counters["frames"]["total"] == frames + 1


@pytest.mark.parametrize("switch_call", ["enable", "deterministic", "disable"])
def test_switching_inside_a_traced_function_is_refused_in_detsums_words(switch_call):
    """``detsum.enable``, ``disable`` or a ``deterministic`` block inside a function compiled
    with ``fullgraph=True``: the error names the call and says where it belongs (Dynamo's
    own named the switch's lock). Without ``fullgraph`` the graph breaks there and the call
    runs as plain Python: switched, the exact sum."""
    def program(x, index, source):
        if switch_call == "enable":
            detsum.enable("exact")
            return x.index_add(0, index, source)
        if switch_call == "disable":
            detsum.disable()
            return x.index_add(0, index, source)
        with detsum.deterministic("exact"):
            return x.index_add(0, index, source)

    x, index, source = torch.zeros(1), torch.tensor([0, 0, 0]), torch.tensor([1e8, 1.0, -1e8])
    try:
        with pytest.raises(Exception) as refused:
            torch.compile(program, fullgraph=True, backend="eager")(x, index, source)
        assert f"detsum.{switch_call}: called inside a function that torch.compile traces" in (
            str(refused.value))
        if switch_call != "disable":
            assert torch.compile(program, backend="eager")(x, index, source).item() == 1.0
    finally:
        detsum.disable()


def test_switched_ops_pass_opcheck():
    """The opaque ops that compiled graphs call in place of torch's: schema, fake tensors and
    AOTAutograd with dynamic shapes agree with the op they call."""
    from detsum import _switch_compile  # noqa: F401 (defines torch.ops.detsum.switched_*)

    ops = torch.ops.detsum
    x, index, rows_index, terms = terms_case(rows=4, n=6)
    cases = [
        (ops.switched_index_add.default, (x, 0, index, terms), {"alpha": 2}),
        (ops.switched_scatter_add.default, (x, 0, rows_index, terms), {}),
        (ops.switched_scatter_reduce_two.default, (x, 0, rows_index, terms, "mean"),
         {"include_self": False}),
        (ops.switched_index_reduce.default, (x, 0, index, terms, "amax"), {}),
        (ops.switched_index_put.default, (x, [index], terms, True), {}),
        (ops.switched_put.default, (x, index, terms[:, 0].contiguous(), True), {}),
        (ops.switched_embedding_dense_backward.default, (terms, index, 5, -1, False), {}),
    ]
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs, test_utils=(
            "test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_torchscript_in_place_and_scatter_reach_the_switch():
    @torch.jit.script
    def scripted(x: torch.Tensor, index: torch.Tensor, rows_index: torch.Tensor,
                 terms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone().index_add_(0, index, terms), x.scatter_add(0, rows_index, terms)

    x, index, rows_index, terms = terms_case()
    with detsum.deterministic("exact"):
        expected = (detsum.index_add(x, 0, index, terms, mode="exact"),
                    detsum.scatter_reduce(x, 0, rows_index, terms, "sum", mode="exact"))
        before = switch.counts.copy()
        got = scripted(x, index, rows_index, terms)
    ran = switch.counts - before
    assert ran[("index_add_", "detsum")] == 1 and ran[("scatter_add", "detsum")] == 1
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_importing_detsum_loads_no_compiler():
    code = ("import sys, detsum\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "assert 'detsum._switch_compile' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("op", ["index_add", "scatter_add"])
def test_inductors_table_follows_the_switch_when_a_graph_is_traced(op):
    """After the switch's first use Inductor's decomposition table holds, for each switched
    op, an entry that reads the switch when a graph is traced: on, the ``switched_`` op; off,
    Inductor's own (``index_add`` decomposes into ``index_put``; ``scatter_add`` has no
    entry of Inductor's and stays), nothing of detsum's. Turning the switch on and off
    changes no table."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    x, index, rows_index, terms = terms_case(n=8)
    call = {"index_add": lambda x, terms: x.index_add(0, index, terms),
            "scatter_add": lambda x, terms: x.scatter_add(0, rows_index, terms)}[op]
    own = {"index_add": "aten.index_put.default", "scatter_add": "aten.scatter_add.default"}[op]

    def traced():
        graph = make_fx(call, decomposition_table=select_decomp_table())(x, terms).graph
        return {str(node.target) for node in graph.nodes if node.op == "call_function"}

    with detsum.deterministic("fp32"):
        table = dict(select_decomp_table())
        assert f"detsum.switched_{op}.default" in traced()
    assert dict(select_decomp_table()) == table
    off = traced()
    assert own in off and not any(target.startswith("detsum.") for target in off), off
