"""The primitives are torch.library custom ops: opcheck passes, and compiled == eager bit for bit."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import MODES, assert_same_bits, make_data


def _index_add_case(dtype=torch.float32, layout="plain", requires_grad=False):
    x = make_data((6, 5), dtype, seed=1)
    src = make_data((9, 5), dtype, seed=2)
    index = torch.tensor([5, 0, 0, 3, 5, 5, 1, 0, 2])
    if layout == "transposed":
        x = make_data((5, 6), dtype, seed=1).t()
        src = make_data((5, 9), dtype, seed=2).t()
    elif layout == "sliced":
        x = make_data((6, 10), dtype, seed=1)[:, ::2]
        src = make_data((9, 10), dtype, seed=2)[:, 1::2]
    elif layout == "empty":
        x, src, index = x[:, :0], src[:0, :0], index[:0]
    return (x.requires_grad_(requires_grad), src.requires_grad_(requires_grad), index)


LAYOUTS = ["plain", "transposed", "sliced", "empty"]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_index_add(layout, requires_grad):
    x, src, index = _index_add_case(torch.float64, layout, requires_grad)
    torch.library.opcheck(torch.ops.detsum.index_add.default, (x, 0, index, src, 1.5, "kahan"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_index_add_inplace(layout):
    x, src, index = _index_add_case(torch.float32, layout)
    torch.library.opcheck(torch.ops.detsum.index_add_.default, (x.clone(), 0, index, src, 1.0, "fp32"))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_segment_sum(layout, requires_grad):
    x, src, _ = _index_add_case(torch.float64, layout, requires_grad)
    n = src.shape[0]
    offsets = torch.tensor([0, n // 3, n // 3, n])
    perm = torch.arange(n).flip(0)
    torch.library.opcheck(torch.ops.detsum.segment_sum.default, (src, offsets, 0, perm, "fp32"))
    torch.library.opcheck(torch.ops.detsum.segment_sum.default, (src, offsets, 0, None, "autograd"))


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "amax", "amin"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_scatter_reduce(layout, requires_grad, reduce):
    x, src, index = _index_add_case(torch.float64, layout, requires_grad)
    torch.library.opcheck(torch.ops.detsum.scatter_reduce.default,
                          (x, 0, index, src, reduce, False, "fp32", False))


def _all_primitives(x, index, src, mode):
    offsets = torch.tensor([0, 2, 2, src.shape[0]])
    return (
        detsum.index_add(x, 0, index, src, alpha=0.5, mode=mode),
        detsum.segment_sum(src, offsets, perm=torch.arange(src.shape[0]).flip(0), mode=mode),
        detsum.scatter_reduce(x, 0, index, src, "mean", include_self=False, mode=mode),
        detsum.scatter_reduce(src.new_zeros(src.shape[0], 3), -1, index.view(-1, 1).expand(-1, 5) % 3,
                              src, "sum", mode=mode),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_fullgraph_gives_eager_bits(dtype, mode):
    torch._dynamo.reset()
    x, src, index = _index_add_case(dtype)
    eager = _all_primitives(x, index, src, mode)
    compiled = torch.compile(_all_primitives, fullgraph=True, backend="aot_eager")(x, index, src, mode)
    for e, c in zip(eager, compiled):
        assert_same_bits(c, e)


def test_compiled_with_inductor_gives_eager_bits():
    """Inductor must keep the op opaque: it would otherwise lower the sum to its own order."""
    torch._dynamo.reset()
    x, src, index = _index_add_case(torch.bfloat16)

    def step(x, src):
        return detsum.index_add(x * 2, 0, index, src, mode="autograd") + 1

    compiled = torch.compile(step, fullgraph=True)
    assert_same_bits(compiled(x, src), step(x, src))


def test_compiled_backward_gives_eager_gradients():
    torch._dynamo.reset()
    x, src, index = _index_add_case(torch.float32, requires_grad=True)

    def loss(x, src):
        return detsum.index_add(x, 0, index, src, alpha=2.0, mode="kahan").square().sum()

    eager = torch.autograd.grad(loss(x, src), (x, src))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(x, src), (x, src))
    for e, c in zip(eager, compiled):
        assert_same_bits(c, e)


# ---- argument errors reach the user in detsum's words under torch.compile -------------------

_X, _INDEX, _SRC = torch.zeros(4, 3), torch.tensor([0, 1, 2]), torch.ones(3, 3)
COMPILE_ERRORS = [
    pytest.param(lambda a: detsum.index_add(a, 5, _INDEX, _SRC), IndexError,
                 "detsum.index_add: dim=5 is out of range", id="dim"),
    pytest.param(lambda a: detsum.index_add(a, 0, _INDEX, _SRC, mode="fast"), ValueError,
                 "detsum.index_add: mode='fast' is not a detsum mode", id="mode"),
    pytest.param(lambda a: detsum.segment_sum(a, torch.tensor([0, 4]), dim=3), IndexError,
                 "detsum.segment_sum: dim=3", id="segment_sum_dim"),
    pytest.param(lambda a: detsum.scatter_reduce(a, 0, _INDEX, _SRC, "sum", include_self=None),
                 TypeError, "detsum.scatter_reduce: include_self=None", id="flag"),
    pytest.param(lambda a: detsum.moe.permute(a, torch.arange(4), 1, mode="exactish"),
                 ValueError, "detsum.moe.permute: mode='exactish'", id="moe_mode"),
]


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph_breaks", "fullgraph"])
@pytest.mark.parametrize("fn,exception,words", COMPILE_ERRORS)
def test_compiled_argument_errors_carry_detsum_words(fn, exception, words, fullgraph):
    """Before: dynamo's "Observed exception" (detsum's words only in a debug context) or, for
    a mode, an InternalTorchDynamoError about the Enum. Now the message is the error's (an
    IndexError, or any error when dynamo may fall back to eager) or, for other kinds under
    fullgraph=True, in the first lines of dynamo's report, which names the kind."""
    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:
        torch.compile(fn, fullgraph=fullgraph)(_X.clone())
    head = "\n".join(str(raised.value).splitlines()[:3])
    assert words in head, head
    if not fullgraph or exception is IndexError:
        assert type(raised.value) is exception, type(raised.value)
    else:
        assert exception.__name__ in head, head
