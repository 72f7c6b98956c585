"""The primitives' direct path (detsum/_dispatch.py): taken only where the registered operator
would add nothing, and equal to it there."""

from __future__ import annotations

import pytest
import torch
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


def test_autograd_goes_through_the_operator(operators_refuse):
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
    assert not _dispatch.direct_call_ok(torch.nn.Parameter(init, requires_grad=False), index)
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
