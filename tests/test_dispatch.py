"""The primitives' direct path (detsum/_dispatch.py): taken only where the registered operator
would add nothing, and equal to it there."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import detsum
from detsum import _dispatch
from detsum.ops import index_add as index_add_module
from detsum.ops import scatter_reduce as scatter_reduce_module
from detsum.ops import segment_sum as segment_sum_module


def _inputs():
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, 5, (12,), generator=gen)
    src = torch.randn(12, 3, generator=gen)
    init = torch.randn(5, 3, generator=gen)
    return init, index, src


class _Subclass(torch.Tensor):
    """A tensor subclass: the dispatcher hands it to its ``__torch_function__``."""


def _refuse(*args, **kwargs):
    raise AssertionError("the registered operator was called")


@pytest.fixture
def operators_refuse(monkeypatch):
    """Every primitive's registered operator raises when called from the public function."""
    monkeypatch.setattr(index_add_module, "call_index_add", _refuse)
    monkeypatch.setattr(index_add_module, "index_add_inplace_op", _refuse)
    monkeypatch.setattr(scatter_reduce_module, "call_scatter_reduce", _refuse)
    monkeypatch.setattr(segment_sum_module, "call_segment_sum", _refuse)


def test_plain_eager_calls_skip_the_operator_and_give_its_bits(operators_refuse):
    init, index, src = _inputs()
    expected = torch.ops.detsum.index_add(init, 0, index, src, 1.0, "kahan")
    assert torch.equal(detsum.index_add(init, 0, index, src, mode="kahan"), expected)
    work = init.clone()
    detsum.index_add_(work, 0, index, src, mode="kahan")
    assert torch.equal(work, expected)
    assert torch.equal(detsum.scatter_reduce(init, 0, index, src, "mean"),
                       torch.ops.detsum.scatter_reduce(init, 0, index, src, "mean", True, "fp32",
                                                       False))
    offsets = torch.tensor([0, 4, 4, 12])
    assert torch.equal(detsum.segment_sum(src, offsets),
                       torch.ops.detsum.segment_sum(src, offsets, 0, None, "fp32"))


def test_autograd_goes_through_the_registered_call(operators_refuse):
    init, index, src = _inputs()
    src.requires_grad_(True)
    with pytest.raises(AssertionError, match="registered operator"):
        detsum.index_add(init, 0, index, src)
    with torch.no_grad():
        detsum.index_add(init, 0, index, src)  # nothing to record: direct


def test_a_dispatch_mode_sees_the_operator():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    init, index, src = _inputs()
    with Record():
        detsum.index_add(init, 0, index, src)
    assert any(name.startswith("detsum.index_add") for name in seen)


def test_wrapped_and_subclassed_tensors_take_the_operator():
    init, index, src = _inputs()
    assert _dispatch.direct_call_ok(init, index, src, None)
    # A Parameter is a plain tensor to the dispatcher (its __torch_function__ is off).
    assert _dispatch.direct_call_ok(torch.nn.Parameter(init, requires_grad=False), index)
    assert not _dispatch.direct_call_ok(_Subclass(init), index)
    assert _dispatch.eager_route((_Subclass(init), src.requires_grad_())) == "operator"
    seen = []
    torch.func.vmap(lambda row: seen.append(_dispatch.direct_call_ok(row)) or row)(init)
    assert seen == [False]


def test_the_direct_in_place_call_marks_input_as_changed():
    """A tensor saved for a backward and then changed in place must make that backward fail,
    as torch's own in-place ops do, instead of giving a wrong gradient."""
    init, index, src = _inputs()
    weight = torch.randn(5, 3, requires_grad=True)
    loss = (weight * init).sum()  # saves init for weight's gradient
    with torch.no_grad():
        detsum.index_add_(init, 0, index, src)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_eager_backward_of_the_weighted_unpermute_skips_its_operator(monkeypatch):
    """The backward calls the operator's body: the same gradients, with the operator refused."""
    from detsum import moe

    gather_indices, _ = moe.route(torch.tensor([[0, 2], [1, 0], [2, 1]]), 3)
    y = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(2))

    def gradients():
        y_leaf, w_leaf = y.clone().requires_grad_(), weights.clone().requires_grad_()
        moe.unpermute(y_leaf, gather_indices, 2, weights=w_leaf).sum().backward()
        return y_leaf.grad, w_leaf.grad

    unpatched = gradients()
    monkeypatch.setattr(moe, "call_weighted_gradients_in_blocks", _refuse)
    for got, expected in zip(gradients(), unpatched):
        assert torch.equal(got, expected)


# ---- calls that autograd records: detsum's Function around the body, or torch's ------------

class _ChangesNothing(TorchFunctionMode):
    """A function mode that only calls each function: with it on, a call that autograd
    records goes through the registered operator (torch's autograd.Function for it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _graph(outputs) -> list:
    """The autograd nodes behind ``outputs``."""
    stack = [t.grad_fn for t in outputs]
    seen, nodes = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def _nodes(outputs) -> list[str]:
    """The type names of the autograd nodes behind ``outputs``."""
    return [type(node).__name__ for node in _graph(outputs)]


def _moe_inputs():
    from detsum import moe

    gen = torch.Generator().manual_seed(3)
    selected = torch.tensor([[0, 2], [1, 0], [2, 1], [2, 0]])
    routing = moe.route(selected, 3)
    return (moe, routing, torch.randn(4, 5, generator=gen),
            torch.rand(4, 2, generator=gen).softmax(-1))


def _index_add(mode):
    init, index, src = _inputs()
    return (lambda a, b: (detsum.index_add(a, 0, index, b, alpha=0.5, mode=mode),)), (init, src)


def _index_add_in_place():
    init, index, src = _inputs()
    return (lambda a, b: (detsum.index_add_(a.clone(), 0, index, b),)), (init, src)


def _segment_sum(mode):
    _, _, src = _inputs()
    offsets = torch.tensor([0, 4, 4, 9, 12])
    return (lambda a: (detsum.segment_sum(a, offsets, mode=mode),)), (src,)


def _segment_sum_planned():
    _, index, src = _inputs()
    plan = detsum.plan(index, 5)
    return (lambda a: (detsum.segment_sum(a, plan=plan),)), (src,)


def _scatter_reduce(reduce, include_self):
    init, index, src = _inputs()
    return (lambda a, b: (detsum.scatter_reduce(a, 0, index, b, reduce,
                                                include_self=include_self),)), (init, src)


def _permute_unpermute(weighted, routed):
    moe, routing, x, weights = _moe_inputs()
    indices = routing if routed else routing.gather_indices

    def call(x, weights=None):
        rows = moe.permute(x, indices, 2)
        return rows, moe.unpermute(rows * 1.5, indices, 2, weights=weights)

    return call, (x, weights) if weighted else (x,)


def _expert_linear():
    hf = pytest.importorskip("detsum.hf")
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(7, 3, generator=gen)
    weight = torch.nn.Parameter(torch.randn(2, 4, 3, generator=gen))
    offsets = torch.tensor([0, 3, 7])
    return (lambda r, w: (hf.call_expert_linear(r, w, offsets, False),)), (rows, weight)


RECORDED_CALLS = {
    **{f"index_add {mode}": lambda mode=mode: _index_add(mode)
       for mode in ("fp32", "kahan", "autograd", "exact")},
    "index_add_": _index_add_in_place,
    **{f"segment_sum {mode}": lambda mode=mode: _segment_sum(mode) for mode in ("fp32", "exact")},
    "segment_sum with a plan": _segment_sum_planned,
    **{f"scatter_reduce {reduce} {include_self}": lambda r=reduce, s=include_self:
       _scatter_reduce(r, s)
       for reduce in ("sum", "mean", "amax", "prod") for include_self in (True, False)},
    **{f"moe permute unpermute weighted={weighted} routed={routed}":
       lambda w=weighted, r=routed: _permute_unpermute(w, r)
       for weighted in (False, True) for routed in (False, True)},
    "hf expert linear": _expert_linear,
}


def _run_recorded(case: str, through_torch: bool):
    """(outputs, gradients of the leaves, autograd node names) of a case's call."""
    call, tensors = RECORDED_CALLS[case]()
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    if through_torch:
        with _ChangesNothing():
            outputs = call(*leaves)
    else:
        outputs = call(*leaves)
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(out.shape, generator=gen) for out in outputs]
    torch.autograd.backward(outputs, grads)
    return outputs, [leaf.grad for leaf in leaves], _nodes(outputs)


@pytest.mark.parametrize("case", RECORDED_CALLS)
def test_a_recorded_call_gives_the_operators_bits_and_gradients(case):
    """In plain eager code, a call that autograd records runs detsum's Function around the
    operator's body (nodes named after the public function); with a function mode on, the
    operator itself (torch's Function for it). The same outputs and gradients, bit for bit."""
    outputs, grads, nodes = _run_recorded(case, through_torch=False)
    torch_outputs, torch_grads, torch_nodes = _run_recorded(case, through_torch=True)
    assert any(name.startswith("detsum.") for name in nodes), nodes
    assert not any(name.startswith("GeneratedBackwardFor_") for name in nodes), nodes
    assert any(name.startswith("GeneratedBackwardFor_detsum_") for name in torch_nodes)
    assert not any(name.startswith("detsum.") for name in torch_nodes), torch_nodes
    for got, expected in zip([*outputs, *grads], [*torch_outputs, *torch_grads], strict=True):
        assert got is not None and torch.equal(got, expected)


@pytest.mark.parametrize("case", ["index_add fp32", "segment_sum fp32"])
def test_a_recorded_call_has_the_operators_second_derivative(case):
    def second(through_torch):
        call, tensors = RECORDED_CALLS[case]()
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        with _ChangesNothing() if through_torch else contextlib.nullcontext():
            (out,) = call(*leaves)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2),
                             requires_grad=True)
        first = torch.autograd.grad(out, leaves[-1], weight, create_graph=True)[0]
        return torch.autograd.grad((first * first).sum(), weight)[0]

    assert torch.equal(second(False), second(True))


def test_a_recorded_call_refuses_a_changed_index_as_the_operator_does():
    init, index, src = _inputs()
    out = detsum.index_add(init, 0, index, src.requires_grad_())
    index.add_(0)  # a new version of the tensor the backward saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_parameters_take_the_recorded_call():
    init, index, src = _inputs()
    weight = torch.nn.Parameter(src)
    assert _dispatch.eager_route((init, 0, index, weight, 1.0)) == "recorded body"
    assert _dispatch.eager_route((init, 0, index, src.detach(), 1.0)) == "body"
    with torch.no_grad():
        assert _dispatch.eager_route((init, 0, index, weight, 1.0)) == "body"
    assert "detsum.index_addBackward" in _nodes([detsum.index_add(init, 0, index, weight)])


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the checks' Python branches
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("requires_grad", [False, True])
def test_torch_jit_trace_records_the_operator(requires_grad):
    """Under torch.jit.trace no call is direct or recorded by detsum: the trace holds the
    operator, and the traced function gives the eager call's bits and gradient."""
    init, index, src = _inputs()

    def add(source):
        return detsum.index_add(init, 0, index, source, mode="kahan")

    traced = torch.jit.trace(add, (src.clone().requires_grad_(requires_grad),))
    assert "detsum::index_add" in str(traced.graph)
    leaf, traced_leaf = src.clone().requires_grad_(), src.clone().requires_grad_()
    out, traced_out = add(leaf), traced(traced_leaf)
    assert torch.equal(out, traced_out)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(grad)
    traced_out.backward(grad)
    assert torch.equal(leaf.grad, traced_leaf.grad)


def test_a_recorded_call_runs_the_operators_body_without_the_dispatcher():
    """The recorded call's forward is the body the operator was made from, not the operator:
    torch's profiler sees detsum's Function and no dispatch of ``detsum::index_add``."""
    init, index, src = _inputs()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        detsum.index_add(init, 0, index, src.requires_grad_())
    names = {event.name for event in profile.events()}
    assert "detsum.index_add" in names
    assert not any(name.startswith("detsum::") for name in names), names


def test_an_operator_called_with_nothing_to_record_runs_its_body():
    """moe's permute and unpermute call their operators' ``call`` even without grad: in
    plain eager code that runs the bodies, no dispatch of a ``detsum::`` operator, with the
    operators' bits."""
    moe, routing, x, weights = _moe_inputs()

    def layer():
        rows = moe.permute(x, routing, 2)
        return rows, moe.unpermute(rows * 1.5, routing, 2, weights=weights)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        outputs = layer()
    names = {event.name for event in profile.events()}
    assert not any(name.startswith("detsum::") for name in names), names
    with _ChangesNothing():
        for got, expected in zip(outputs, layer(), strict=True):
            assert torch.equal(got, expected)


# ---- detsum's own autograd Functions, applied in their older form in eager code -----------------

def _function_calls():
    gen = torch.Generator().manual_seed(6)
    src = torch.randn(6, 3, generator=gen)
    index = torch.tensor([0, 2, 2, 5, 1, 2, 0])
    losses = torch.rand(9, generator=gen)
    return {
        "index_select": ((lambda s: (detsum.index_select(s, 0, index),)), (src,)),
        "gather_coo": ((lambda s: (detsum.gather_coo(s, index),)), (src,)),
        "scatter_max": ((lambda s: (detsum.scatter_max(s, index[:6], 0)[0],)), (src,)),
        "loss.reduce exact": ((lambda l: (detsum.loss.reduce(l, mode="exact"),)), (losses,)),
    }


def _function_classes(outputs) -> set:
    """The autograd Functions whose nodes are behind ``outputs``."""
    return {node._forward_cls for node in _graph(outputs) if hasattr(node, "_forward_cls")}


@pytest.mark.parametrize("case", list(_function_calls()))
def test_detsums_functions_give_the_same_bits_in_their_older_form(case):
    """In plain eager code ``_transforms.apply`` applies a Function of detsum's in its older
    form (no argument binding at each call); with a function mode on, as it is. The same
    outputs and gradients, bit for bit."""
    from detsum import _transforms

    def run(through_mode):
        call, tensors = _function_calls()[case]
        leaves = [t.clone().requires_grad_() for t in tensors]
        with _ChangesNothing() if through_mode else contextlib.nullcontext():
            outputs = call(*leaves)
        torch.autograd.backward(outputs, [torch.ones_like(out) * 0.75 for out in outputs])
        forms = _function_classes(outputs)
        return [*outputs, *[leaf.grad for leaf in leaves]], forms

    got, forms = run(False)
    expected, mode_forms = run(True)
    assert forms and forms <= set(_transforms._older_forms.values()), forms
    assert not mode_forms & set(_transforms._older_forms.values()), mode_forms
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recorded_calls_under_activation_checkpointing(use_reentrant):
    """torch.utils.checkpoint runs the forward again in the backward (under saved-tensor hooks
    without reentry): the same loss and gradients, bit for bit, as without it."""
    init, index, src = _inputs()
    weight = torch.randn(3, 3, generator=torch.Generator().manual_seed(8))

    def loss_of(source, w):
        added = detsum.index_add(init, 0, index, source @ w, mode="kahan")
        return detsum.segment_sum(added, torch.tensor([0, 2, 5])).pow(2).sum()

    def run(checkpointed):
        leaves = src.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = (torch.utils.checkpoint.checkpoint(loss_of, *leaves, use_reentrant=use_reentrant)
                if checkpointed else loss_of(*leaves))
        loss.backward()
        return loss, *[leaf.grad for leaf in leaves]

    for got, expected in zip(run(True), run(False), strict=True):
        assert torch.equal(got, expected)
