"""detsum.plan: one plan of an index, reused by every primitive, forward and backward.

A plan is the canonical order found once; it must give the bits of the call without it, in
every mode, on every backend, in every layout, with its gradients, under torch.compile; it
must spare the calls that take it every sort, check and host read; and a plan that does not
belong to the call is refused in detsum's words.

On the numba and reference backends the sweeps take every combination of their parameters; on
Triton's interpreter (no GPU) a covering of them (tests/covering.py), each sweep's comment
says what it meets; on a GPU every combination again.
"""

from __future__ import annotations

import contextlib
import re
import unittest.mock

import pytest
import torch

import detsum
from conftest import (DTYPES, HAS_CUDA, assert_same_bits, backend_device, dtype_id, host_reads,
                      make_data)
from covering import pairwise
from detsum import _segments

BACKENDS = ("numba", "reference", "triton")

# (src shape with N at dim, dim): whole rows, rows of one element (the last dim), a middle dim.
LAYOUTS = [pytest.param((None, 6), 0, id="Nx6-dim0"),
           pytest.param((3, None), 1, id="3xN-dim1"),
           pytest.param((2, None, 5), 1, id="2xNx5-dim1")]
NUM_ROWS = 9


def _shape(template, n):
    return tuple(n if s is None else s for s in template)


def _index(n, num_rows, seed, *, sorted_=False):
    """Duplicates, rows without terms, and one row with more than CHUNK_TERMS terms when ``n``
    is large: every regime of the canonical order."""
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, num_rows, (n,), generator=g)
    if n > 300:
        index[:280] = 1  # a segment longer than CHUNK_TERMS = 256
    index[index == num_rows - 1] = 0  # the last row receives nothing
    return index.sort().values if sorted_ else index


@contextlib.contextmanager
def sorts_counted():
    """Count the index sorts (torch's and the Numba counting sort) made while the block runs."""
    from detsum.kernels.numba import plan as numba_plan

    calls = []
    torch_sort, counting_sort = torch.sort, numba_plan.counting_sort

    def counted_torch_sort(*args, **kwargs):
        calls.append("torch.sort")
        return torch_sort(*args, **kwargs)

    def counted_counting_sort(*args, **kwargs):
        calls.append("counting_sort")
        return counting_sort(*args, **kwargs)

    with unittest.mock.patch.object(torch, "sort", counted_torch_sort), \
            unittest.mock.patch.object(numba_plan, "counting_sort", counted_counting_sort):
        yield calls


# ---- the same bits with and without a plan ------------------------------------------------------

def _index_add_sweep_allowed(n, template, dim, dtype, mode, backend):
    # fp32 and bf16 stand for the dtypes off the default backend (a plan is positions: the
    # dtype only picks the kernel's arithmetic).
    if backend != "numba" and dtype in (torch.float16, torch.float64):
        return False
    # Long segments on Triton: fp32 stands for the dtypes (and "exact", whose chunks are of its
    # own length, is covered by the short ones here and in tests/test_exact_triton.py).
    return not (backend == "triton" and n > 300 and (dtype != torch.float32 or mode == "exact"))


def _index_add_sweep(backend):
    """On the interpreter: every pair of size (short segments, or one over CHUNK_TERMS),
    layout, dtype and mode that runs (each size with every layout and mode, each mode with
    every layout and dtype), the long segments and "exact" (the costly cases) as few times as
    that allows."""
    def cost(n, template, dim, dtype, mode, backend):
        return n // 20 * (3 if mode == "exact" else 1)

    axes = [[20, 400], LAYOUTS, list(DTYPES), list(detsum.MODES), [backend]]
    return pairwise(axes, allowed=_index_add_sweep_allowed, cost=cost,
                    everything=backend != "triton" or HAS_CUDA)


@pytest.mark.parametrize("n,template,dim,dtype,mode,backend",
                         [p for backend in BACKENDS for p in _index_add_sweep(backend)])
def test_index_add_and_segment_sum_with_a_plan_give_the_bits_without(n, template, dim, dtype,
                                                                     mode, backend):
    device = backend_device(backend)
    index = _index(n, NUM_ROWS, seed=n).to(device)
    source = make_data(_shape(template, n), dtype, seed=1, spread=True).to(device)
    base = make_data(_shape(template, NUM_ROWS), dtype, seed=2).to(device)
    with detsum.backend(backend):
        plan = detsum.plan(index, NUM_ROWS)
        expected = detsum.index_add(base, dim, index, source, alpha=0.75, mode=mode)
        assert_same_bits(detsum.index_add(base, dim, index, source, alpha=0.75, mode=mode,
                                          plan=plan), expected)
        in_place = base.clone()
        detsum.index_add_(in_place, dim, index, source, alpha=0.75, mode=mode, plan=plan)
        assert_same_bits(in_place, expected)
        zeros = torch.zeros_like(base)
        assert_same_bits(detsum.segment_sum(source, dim=dim, mode=mode, plan=plan),
                         detsum.index_add(zeros, dim, index, source, mode=mode))


def _scatter_reduce_sweep(backend):
    """On the interpreter: every (mode, reduction) that scatter_reduce computes, and every pair
    of mode, reduction, include_self and sortedness."""
    axes = [["sum", "mean", "prod", "amax", "amin"], list(detsum.MODES), [True, False],
            [pytest.param(False, id="unsorted"), pytest.param(True, id="sorted")], [backend]]
    return pairwise(axes, allowed=lambda reduce, mode, *_: (mode, reduce) != ("exact", "prod"),
                    everything=backend != "triton" or HAS_CUDA)


@pytest.mark.parametrize("reduce,mode,include_self,sorted_,backend",
                         [p for backend in BACKENDS for p in _scatter_reduce_sweep(backend)])
def test_scatter_reduce_with_a_plan_gives_the_bits_and_gradients_without(sorted_, include_self,
                                                                         reduce, mode, backend):
    dtype = torch.bfloat16 if backend != "triton" or mode != "exact" else torch.float32
    device = backend_device(backend)
    index = _index(40, NUM_ROWS, seed=3, sorted_=sorted_).to(device)
    # Small integers: ties for amax / amin, zeros for prod, in every dtype.
    g = torch.Generator().manual_seed(4)
    src = torch.randint(-3, 4, (40, 5), generator=g).to(device, dtype).requires_grad_()
    base = torch.randint(-3, 4, (NUM_ROWS, 5), generator=g).to(device, dtype).requires_grad_()
    grad = make_data((NUM_ROWS, 5), dtype, seed=5).to(device)
    with detsum.backend(backend):
        plan = detsum.plan(index, NUM_ROWS, sorted=sorted_)
        results = []
        for given in (None, plan):
            out = detsum.scatter_reduce(base, 0, index, src, reduce, include_self=include_self,
                                        mode=mode, sorted=sorted_, plan=given)
            results.append((out, *torch.autograd.grad(out, (base, src), grad)))
    for got, expected in zip(results[1], results[0]):
        assert_same_bits(got, expected)


def test_a_plan_serves_every_layer_and_step_of_a_graph():
    """A GNN's edges planned once: two layers and two steps, forward and backward, the bits of
    plan-free calls."""
    g = torch.Generator().manual_seed(6)
    nodes, edges = 12, 50
    senders = torch.randint(0, nodes, (edges,), generator=g)
    receivers = torch.randint(0, nodes, (edges,), generator=g)
    weight = torch.randn(8, 8, generator=g, requires_grad=True)
    features = torch.randn(nodes, 8, generator=g)

    def step(plan):
        h = features
        for _ in range(2):
            messages = (h @ weight).index_select(0, senders)
            h = detsum.index_add(torch.zeros_like(h), 0, receivers, messages, plan=plan).tanh()
        loss = h.square().sum()
        return loss, torch.autograd.grad(loss, weight)[0]

    plan = detsum.plan(receivers, nodes)
    for _ in range(2):
        with_plan, without = step(plan), step(None)
        assert_same_bits(with_plan[0], without[0])
        assert_same_bits(with_plan[1], without[1])


# ---- what a plan spares --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_with_a_plan_sort_nothing_forward_and_backward(backend):
    device = backend_device(backend)
    index = _index(60, NUM_ROWS, seed=7).to(device)
    src = make_data((60, 4), torch.float32, seed=8).to(device).requires_grad_()
    base = make_data((NUM_ROWS, 4), torch.float32, seed=9).to(device).requires_grad_()
    with detsum.backend(backend):
        plan = detsum.plan(index, NUM_ROWS)
        with sorts_counted() as sorts:
            outs = [detsum.index_add(base, 0, index, src, plan=plan),
                    detsum.segment_sum(src, plan=plan),
                    *(detsum.scatter_reduce(base, 0, index, src, reduce, plan=plan)
                      for reduce in ("sum", "mean", "prod", "amax", "amin"))]
            torch.autograd.grad(sum(out.sum() for out in outs), (base, src))
    assert sorts == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "amax", "amin"])
def test_forward_and_backward_without_a_plan_sort_the_index_once(backend, reduce):
    device = backend_device(backend)
    index = _index(60, NUM_ROWS, seed=10).to(device)
    src = make_data((60, 4), torch.float32, seed=11).to(device).requires_grad_()
    base = make_data((NUM_ROWS, 4), torch.float32, seed=12).to(device).requires_grad_()
    with detsum.backend(backend), sorts_counted() as sorts:
        out = detsum.scatter_reduce(base, 0, index, src, reduce)
        torch.autograd.grad(out.sum(), (base, src))
    # The reference backend computes without a plan; the others plan once.
    assert len(sorts) <= 1, sorts


@pytest.mark.interpreter
@pytest.mark.parametrize("check", ["host", "device", "off"])
def test_calls_with_a_plan_read_nothing_back_on_the_gpu_path(check):
    """On the GPU's path (the Triton backend with the GPU's checks, in the interpreter): the
    plan made at "host" reads its index once; the calls that take it read nothing back, also
    at "host", forward and backward."""
    index = _index(60, NUM_ROWS, seed=13)
    src = make_data((60, 4), torch.float32, seed=14).requires_grad_()
    base = make_data((NUM_ROWS, 4), torch.float32, seed=15).requires_grad_()
    with detsum.backend("triton"), unittest.mock.patch.object(_segments, "GPU_CHECKS_ON_CPU",
                                                              True):
        made = []
        with host_reads(lambda name, where: made.append(name)):
            plan = detsum.plan(index, NUM_ROWS, check=check)
        assert len(made) == (2 if check == "host" else 0), made  # the check, the chunks
        reads = []
        with host_reads(lambda name, where: reads.append((name, where))):
            outs = [detsum.index_add(base, 0, index, src, plan=plan),
                    detsum.segment_sum(src, plan=plan),
                    detsum.scatter_reduce(base, 0, index, src, "mean", plan=plan),
                    detsum.scatter_reduce(base, 0, index, src, "amax", plan=plan)]
            torch.autograd.grad(sum(out.sum() for out in outs), (base, src))
        assert reads == []


@pytest.mark.interpreter
def test_an_unchecked_plan_gives_what_off_gives():
    """On the GPU's path a plan made at "off" leaves a bad value's row out, as the call with
    check="off" does, forward and backward."""
    index = torch.tensor([0, 2, -1, 2, 7, 1])
    src = make_data((6, 3), torch.float32, seed=16).requires_grad_()
    base = make_data((3, 3), torch.float32, seed=17).requires_grad_()
    grad = make_data((3, 3), torch.float32, seed=18)
    for backend in ("triton", "reference"):
        with detsum.backend(backend), unittest.mock.patch.object(
                _segments, "GPU_CHECKS_ON_CPU", True):
            plan = detsum.plan(index, 3, check="off")
            results = []
            for given, check in ((plan, "host"), (None, "off")):
                out = detsum.index_add(base, 0, index, src, check=check, plan=given)
                results.append((out, *torch.autograd.grad(out, (base, src), grad)))
            segment = detsum.segment_sum(src, plan=plan)
            (grad_src,) = torch.autograd.grad(segment, src, grad)
            zeros = torch.zeros_like(base)
            assert_same_bits(segment, detsum.index_add(zeros, 0, index, src, check="off"))
        for got, expected in zip(results[0], results[1]):
            assert_same_bits(got, expected)
        assert grad_src[[2, 4]].eq(0).all()  # the rows left out


# ---- under torch.compile -------------------------------------------------------------------------

def test_a_plan_made_and_used_in_a_compiled_function_gives_eager_bits():
    index = _index(50, NUM_ROWS, seed=19)
    src = make_data((50, 4), torch.bfloat16, seed=20)
    base = make_data((NUM_ROWS, 4), torch.bfloat16, seed=21)

    def layer(base, index, src):
        plan = detsum.plan(index, base.shape[0])
        return (detsum.index_add(base, 0, index, src, plan=plan),
                detsum.segment_sum(src, plan=plan, mode="kahan"),
                detsum.scatter_reduce(base, 0, index, src, "mean", plan=plan))

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    for got, expected in zip(compiled(base, index, src), layer(base, index, src)):
        assert_same_bits(got, expected)


def test_a_plan_made_outside_a_compiled_function_serves_it():
    index = _index(50, NUM_ROWS, seed=22)
    src = make_data((50, 4), torch.float32, seed=23)
    base = make_data((NUM_ROWS, 4), torch.float32, seed=24)
    plan = detsum.plan(index, NUM_ROWS)
    torch._dynamo.reset()
    compiled = torch.compile(lambda b, s: detsum.index_add(b, 0, plan.index, s, plan=plan),
                             fullgraph=True)
    assert_same_bits(compiled(base, src), detsum.index_add(base, 0, index, src))


@pytest.mark.cuda
def test_calls_with_a_plan_are_captured_in_a_cuda_graph():
    index = _index(500, NUM_ROWS, seed=25).cuda()
    src = make_data((500, 64), torch.bfloat16, seed=26).cuda()
    base = torch.zeros(NUM_ROWS, 64, dtype=torch.bfloat16, device="cuda")
    plan = detsum.plan(index, NUM_ROWS)
    expected = detsum.index_add(base, 0, index, src, plan=plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = detsum.index_add(base, 0, index, src, plan=plan)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(out, expected)


# ---- refusals, in detsum's words ----------------------------------------------------------------

def test_plan_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"detsum.plan: num_rows=-1; expected a non-negative"):
        detsum.plan(torch.tensor([0]), -1)
    for not_an_int in (3.0, torch.tensor(3), True):
        with pytest.raises(TypeError, match=rf"^detsum.plan: num_rows={re.escape(repr(not_an_int))}"
                                            rf" is a \w+; expected a non-negative int"):
            detsum.plan(torch.tensor([0]), not_an_int)
    with pytest.raises(ValueError, match=r"detsum.plan: index must be 1-D"):
        detsum.plan(torch.zeros(2, 2, dtype=torch.long), 3)
    with pytest.raises(IndexError, match=r"detsum.plan: index\[1\] = 5 is out of range for "
                                         r"num_rows = 3"):
        detsum.plan(torch.tensor([0, 5]), 3)
    with pytest.raises(ValueError, match="detsum.plan: sorted=True but index decreases"):
        detsum.plan(torch.tensor([2, 1]), 3, sorted=True)
    with pytest.raises(ValueError, match="detsum.plan: check='later'"):
        detsum.plan(torch.tensor([0]), 3, check="later")


def test_calls_refuse_a_plan_that_is_not_theirs():
    index = torch.tensor([0, 2, 1, 2])
    src, base = torch.ones(4, 3), torch.zeros(3, 3)
    plan = detsum.plan(index, 3)
    with pytest.raises(TypeError, match="detsum.index_add: plan must be a detsum.Plan"):
        detsum.index_add(base, 0, index, src, plan=(None, None))
    with pytest.raises(ValueError, match=r"detsum.index_add: plan has num_rows = 3; expected "
                                         r"input.size\(0\) = 4"):
        detsum.index_add(torch.zeros(4, 3), 0, index, src, plan=plan)
    with pytest.raises(ValueError, match="detsum.index_add_: index is not the tensor plan was "
                                         "made from"):
        detsum.index_add_(base, 0, index.clone(), src, plan=plan)
    with pytest.raises(ValueError, match=r"detsum.segment_sum: plan was made from an index of "
                                         r"length 4; expected src.size\(0\) = 5"):
        detsum.segment_sum(torch.ones(5, 3), plan=plan)
    with pytest.raises(ValueError, match="detsum.segment_sum: plan is given with offsets"):
        detsum.segment_sum(src, torch.tensor([0, 4]), plan=plan)
    with pytest.raises(TypeError, match="detsum.segment_sum: offsets is missing"):
        detsum.segment_sum(src)
    with pytest.raises(ValueError, match="detsum.scatter_reduce: plan is given with an index "
                                         "of shape"):
        detsum.scatter_reduce(base, 0, torch.zeros(4, 3, dtype=torch.long), src, "sum",
                              plan=plan)
    # A view of the same memory is the same index; an index changed since is not.
    assert torch.equal(detsum.index_add(base, 0, index[:], src, plan=plan),
                       detsum.index_add(base, 0, index, src))
    index[0] = 1
    with pytest.raises(ValueError, match="detsum.index_add: plan's index was changed in place "
                                         "after the plan was made"):
        detsum.index_add(base, 0, index, src, plan=plan)
    assert torch.equal(base, torch.zeros(3, 3))


# The calls of one primitive with the same plan and arguments of the same kinds (each tensor's
# dtype, shape and device; the other arguments' types and values): the primitives that take a
# plan, each with a call and the same call with one argument changed so that it is refused.
_REMEMBERED_CALLS = {
    "index_add": (lambda b, i, s, p, **kw: detsum.index_add(b, 0, i, s, plan=p, **kw),
                  "detsum.ops.index_add"),
    "index_add_": (lambda b, i, s, p, **kw: detsum.index_add_(b.clone(), 0, i, s, plan=p, **kw),
                   "detsum.ops.index_add"),
    "scatter_reduce": (lambda b, i, s, p, **kw: detsum.scatter_reduce(b, 0, i, s, "sum", plan=p,
                                                                      **kw),
                       "detsum.ops.scatter_reduce"),
    "segment_sum": (lambda b, i, s, p, **kw: detsum.segment_sum(s, plan=p, **kw),
                    "detsum.ops.segment_sum"),
}


@pytest.mark.parametrize("name", list(_REMEMBERED_CALLS))
def test_a_plan_remembers_the_checks_of_its_last_call(name):
    """A call whose arguments are those of the primitive's last call with the same plan does
    not check them again (they would cost a small GPU call as much as its launch); any call
    whose arguments differ, or whose plan's index changed since, is checked in full."""
    import importlib

    call, module_name = _REMEMBERED_CALLS[name]
    module = importlib.import_module(module_name)
    index = torch.tensor([0, 2, 1, 2])
    src, base = torch.ones(4, 3), torch.zeros(3, 3)
    plan = detsum.plan(index, 3)
    expected = call(base, index, src, plan)
    checks = []
    real_check = module._check
    with unittest.mock.patch.object(module, "_check",
                                    lambda *a, **k: checks.append(1) or real_check(*a, **k)):
        for _ in range(3):
            assert_same_bits(call(base, index, src, plan), expected)
        assert not checks
        # Other arguments: checked, and refused in detsum's words.
        with pytest.raises(ValueError, match=rf"detsum\.{name}: .*5"):
            call(base, index, torch.ones(5, 3), plan)
        with pytest.raises(ValueError, match="mode="):
            call(base, index, src, plan, mode="fast")
        with pytest.raises(ValueError, match="check="):
            call(base, index, src, plan, check="later")
        assert len(checks) == 3
        # The arguments of the last call that passed: remembered again.
        assert_same_bits(call(base, index, src, plan, mode="kahan"), expected)
        assert_same_bits(call(base, index, src, plan, mode="kahan"), expected)
        assert len(checks) == 4
        # The plan's index changed in place: refused, whatever was remembered.
        index[0] = 1
        with pytest.raises(ValueError, match="plan's index was changed in place"):
            call(base, index, src, plan, mode="kahan")


def test_a_remembered_plan_checks_every_other_view_of_its_index():
    """Only the plan's own index tensor is remembered: any other tensor is compared with it
    at every call (a view of the same memory passes, a copy is refused)."""
    index = torch.tensor([0, 2, 1, 2])
    src, base = torch.ones(4, 3), torch.zeros(3, 3)
    plan = detsum.plan(index, 3)
    expected = detsum.index_add(base, 0, index, src)
    assert_same_bits(detsum.index_add(base, 0, index[:], src, plan=plan), expected)
    assert_same_bits(detsum.index_add(base, 0, index[:], src, plan=plan), expected)
    with pytest.raises(ValueError, match="detsum.index_add: index is not the tensor plan was "
                                         "made from"):
        detsum.index_add(base, 0, index.clone(), src, plan=plan)


def test_plans_of_inference_tensors_serve_calls_in_and_out_of_inference_mode():
    """torch keeps no version counter for an inference tensor: a plan of one is made and used
    without reading it, and gives the bits of a call without the plan."""
    src, base = torch.randn(5, 3), torch.zeros(3, 3)
    with torch.inference_mode():
        index = torch.tensor([2, 0, 2, 1, 0])
        plan = detsum.plan(index, 3)
        inside = detsum.index_add(base, 0, index, src, plan=plan)
    outside = detsum.index_add(base, 0, index, src, plan=plan)
    for got in (inside, outside):
        assert_same_bits(got, detsum.index_add(base, 0, index, src))


def test_plan_repr_names_its_shape():
    plan = detsum.plan(torch.tensor([0, 1, 1]), 2)
    assert repr(plan) == ("detsum.Plan(num_rows=2, length=3, sorted=False, check='host', "
                          "device=cpu)")
    assert plan.order.tolist() == [0, 1, 2] and plan.offsets.tolist() == [0, 1, 3]
    assert detsum.plan(torch.tensor([0, 1, 1]), 2, sorted=True).order is None


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.cuda
def test_plans_on_cuda_give_the_cpu_bits():
    index = _index(400, NUM_ROWS, seed=27)
    src = make_data((400, 40), torch.bfloat16, seed=28)
    for mode in detsum.MODES:
        if mode == "autograd":
            continue  # torch's CUDA arithmetic differs from its CPU arithmetic by design
        plan = detsum.plan(index.cuda(), NUM_ROWS)
        assert_same_bits(detsum.segment_sum(src.cuda(), plan=plan, mode=mode).cpu(),
                         detsum.segment_sum(src, plan=detsum.plan(index, NUM_ROWS), mode=mode))
