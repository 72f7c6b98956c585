"""detsum.moe's own Triton kernels (kernels/triton/moe.py), on CUDA tensors where a GPU is
present and else in Triton's interpreter on CPU tensors: route's tables, and the weighted
unpermute with its gradients in one launch each, bit for bit against the CPU kernels (Numba)
and torch's own operations. In the interpreter the sweep of the weighted kernels runs a
covering (tests/covering.py): every pair of its parameters meets, not every combination."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import HAS_CUDA, assert_same_bits, dtype_id
from covering import pairwise
from detsum import moe

pytest.importorskip("triton")
from detsum.kernels.triton.segment import interpreted  # noqa: E402

if not (HAS_CUDA or interpreted()):
    pytest.skip("the Triton kernels run on CUDA tensors, or on CPU tensors in Triton's "
                "interpreter", allow_module_level=True)

from launch_counter import gpu_path  # noqa: E402

#: Where the triton backend runs the kernels here.
DEVICE = "cuda" if HAS_CUDA else "cpu"


def _on_triton(*tensors):
    return [t.to(DEVICE) for t in tensors]

E = 5


def _selections():
    g = torch.Generator().manual_seed(7)
    return {
        "top-3, ties within tokens": torch.randint(0, E, (9, 3), generator=g),
        "top-2 int32": torch.randint(0, E, (8, 2), generator=g, dtype=torch.int32),
        "top-1, 1-D": torch.randint(0, E, (6,), generator=g),
        "one expert for all": torch.full((4, 4), 2),
        # More ids than kernels.NARROW_SORT_ABOVE: sorted as int16 at "host" and "device".
        "top-8 of 600 tokens": torch.randint(0, E, (600, 8), generator=g),
    }


@pytest.mark.parametrize("name", list(_selections()))
def test_route_tables_are_what_torch_derives(name, sort_width):
    """route's one launch gives the sort's inverse, the tokens per expert, each row's token,
    each token's rows in increasing position and the token offsets: the values the torch
    operations of the other backends derive, from the ids as they are and narrowed
    (``kernels.sort_by_segment``, which "device" sorts past 4096 ids)."""
    selected = _selections()[name]
    topk = selected.shape[1] if selected.dim() == 2 else 1
    with detsum.backend("numba"):
        expected = moe.route(selected, E)
    with detsum.backend("triton"):
        routing = moe.route(*_on_triton(selected), E, check="device")
    for got, want in zip((*routing, routing.positions), (*expected, expected.positions)):
        assert torch.equal(got.cpu(), want)
    assert expected.token_table is None
    n = selected.numel()
    table = routing.token_table.cpu()
    assert table[0] == 1  # every id in range
    assert torch.equal(table[1:n + 1], expected.gather_indices // topk)
    assert torch.equal(table[n + 1:2 * n + 1],
                       expected.positions.view(-1, topk).sort(dim=1).values.view(-1))
    assert torch.equal(table[2 * n + 1:], torch.arange(selected.shape[0] + 1) * topk)


def test_route_tables_count_unchecked_ids_as_searchsorted_does(sort_width):
    selected = torch.tensor([[0, 7], [-1, 1], [1, 0], [4, 4]])
    with detsum.backend("numba"):
        expected = moe.route(selected, 3, check="off")
    (on_device,) = _on_triton(selected)
    with detsum.backend("triton"):
        routing = moe.route(on_device, 3, check="off")
        for got, want in zip((*routing, routing.positions), (*expected, expected.positions)):
            assert torch.equal(got.cpu(), want)
        with pytest.raises(IndexError, match=r"selected_experts\[0, 1\] = 7 is out of range"):
            moe.route(on_device, 3)
    if not HAS_CUDA:  # on a GPU the assert stops the stream: tests/test_moe_check.py, cuda marks
        with detsum.backend("triton"), pytest.raises(RuntimeError, match="has a value outside"):
            moe.route(selected, 3, check="device")


@pytest.mark.parametrize("check", ["host", "device", "off"])
def test_route_narrows_the_ids_only_where_a_bad_id_fails(check, monkeypatch):
    """Past ``kernels.NARROW_SORT_ABOVE`` ids, route's launch is given them sorted as int16 at
    "host" and "device", where a bad id fails the check; at "off", whose bad ids keep their
    places in ``gather_indices`` (the stable argsort of the ids), as they are. Two bad ids
    on each side, some in one token: at "off" every table is still the torch operations'
    (the numba backend's), and at "device" on the CPU the check fails."""
    from detsum import _kernel_ops

    g = torch.Generator().manual_seed(17)
    selected = torch.randint(0, E, (700, 6), generator=g)
    selected[3, [1, 4]] = torch.tensor([-7, -1])
    selected[9, [0, 2]] = torch.tensor([E + 3, E])
    sorted_as, route_tables = [], _kernel_ops.route_tables

    def recorded(experts, *args):
        sorted_as.append(experts.dtype)
        return route_tables(experts, *args)

    monkeypatch.setattr(_kernel_ops, "route_tables", recorded)
    good = selected.clamp(0, E - 1)
    with detsum.backend("triton"):
        moe.route(*_on_triton(good), E, check=check)
    assert sorted_as == [torch.int64 if check == "off" else torch.int16]
    if check == "off":
        with detsum.backend("numba"):
            expected = moe.route(selected, E, check="off")
        with detsum.backend("triton"):
            routing = moe.route(*_on_triton(selected), E, check="off")
        for got, want in zip((*routing, routing.positions), (*expected, expected.positions)):
            assert torch.equal(got.cpu(), want)
    elif check == "host":
        with detsum.backend("triton"), pytest.raises(IndexError,
                                                     match=r"selected_experts\[3, 1\]"):
            moe.route(*_on_triton(selected), E)
        # What the launch makes of the narrowed sort before the check reads its verdict: each
        # token's rows in increasing position still, bad ids ranked as they were sorted.
        from detsum.kernels import sort_by_segment
        from detsum.kernels.triton.moe import route_tables as launch

        flat = selected.view(-1)
        experts, gather = sort_by_segment(*_on_triton(flat), E)
        positions, _, table = launch(experts, gather, *_on_triton(flat), 6, E)
        n = flat.numel()
        assert table[0] == 0
        assert torch.equal(table[n + 1:2 * n + 1].cpu(),
                           positions.cpu().view(-1, 6).sort(dim=1).values.view(-1))
    elif not HAS_CUDA:  # on a GPU the assert stops the stream
        with detsum.backend("triton"), pytest.raises(RuntimeError, match="has a value outside"):
            moe.route(selected, E, check="device")


# (rows, weights): the pairs whose acc type is the rows' own take the fused kernels; fp32 rows
# with fp64 weights and fp64 rows with fp16 weights the formed products.
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
         (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.float64, torch.float64), (torch.float64, torch.float32),
         (torch.float32, torch.float64), (torch.float64, torch.float16)]


def _layer(selected, x, weights, grad_out, topk, mode, given, check):
    """permute, a change of the rows (so that y is no copy of x), the weighted unpermute;
    the output and the gradients of x and weights."""
    routing = moe.route(selected, E)
    # A copy of the gather_indices: route's own would pass as its Routing, unchecked.
    gather_indices = routing if given == "routing" else routing[0].clone()
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = moe.permute(x, gather_indices, topk, mode=mode, check=check)
    rows = y * torch.linspace(-2.0, 3.0, y.shape[0], dtype=y.dtype, device=y.device)[:, None]
    out = moe.unpermute(rows, gather_indices, topk, weights=weights, mode=mode, check=check)
    return (out, *torch.autograd.grad(out, (x, weights), grad_out))


# Every pair of (rows, weights) dtypes, mode and (gathering, check): each dtype pair with both
# modes and with every gathering and check, each mode with every gathering and check (on a
# GPU, every combination).
@pytest.mark.parametrize(("dtype", "weights_dtype", "mode", "given", "check"), pairwise(
    [[pytest.param(a, b, id=f"{dtype_id(a)}-w{dtype_id(b)}") for a, b in PAIRS],
     ["fp32", "kahan"],
     [pytest.param(*p, id="-".join(p)) for p in [("routing", "off"), ("gather_indices", "host"),
                                                  ("gather_indices", "off")]]],
    everything=HAS_CUDA))
def test_the_fused_weighted_kernels_give_the_cpu_kernels_bits(dtype, weights_dtype, mode,
                                                              given, check):
    """300 features: the weights' gradient sums each dot product in two chunks (256 + 44)."""
    g = torch.Generator().manual_seed(3)
    tokens, topk, hidden = 6, 3, 300
    selected = torch.randint(0, E, (tokens, topk), generator=g)
    x = (torch.randn(tokens, hidden, generator=g) * 4).to(dtype)
    weights = torch.softmax(torch.randn(tokens, topk, generator=g), -1).to(weights_dtype)
    grad_out = torch.randn(tokens, hidden, generator=g).to(
        torch.promote_types(dtype, weights_dtype))
    with detsum.backend("numba"):
        expected = _layer(selected, x, weights, grad_out, topk, mode, given, check)
    with detsum.backend("triton"):
        got = _layer(*_on_triton(selected, x, weights, grad_out), topk, mode, given, check)
    for got_one, want in zip(got, expected):
        assert_same_bits(got_one.cpu(), want)


@pytest.mark.parametrize("mode", ["fp32", "kahan"])
def test_a_broken_permutation_unchecked_gives_the_cpu_kernels_bits(mode):
    """Under check="off" a repeated and an out-of-range value: each row weighted, and its dot
    product read back, as the slot its clamped value names (docs of ``unpermute``)."""
    g = torch.Generator().manual_seed(5)
    tokens, topk, hidden = 4, 2, 7
    gather_indices = torch.tensor([3, 0, 3, 9, 1, 5, -2, 6])
    y = torch.randn(tokens * topk, hidden, generator=g)
    weights = torch.rand(tokens, topk, generator=g)
    grad_out = torch.randn(tokens, hidden, generator=g)
    results = {}
    for backend, device in (("numba", "cpu"), ("triton", DEVICE)):
        with detsum.backend(backend):
            y_leaf, w_leaf = (y.to(device).requires_grad_(),
                              weights.to(device).requires_grad_())
            out = moe.unpermute(y_leaf, gather_indices.to(device), topk, weights=w_leaf,
                                mode=mode, check="off")
            results[backend] = [t.cpu() for t in (out, *torch.autograd.grad(
                out, (y_leaf, w_leaf), grad_out.to(device)))]
    for got, want in zip(results["triton"], results["numba"]):
        assert_same_bits(got, want)


def test_a_second_derivative_takes_the_formed_products():
    """On the GPU's path, with create_graph, the weighted unpermute's backward is torch's
    operations, which have a derivative of their own: the fused kernel runs only where none
    is asked for. (On CPU the blocks refuse it: docs/determinism.md.)"""
    g = torch.Generator().manual_seed(9)
    selected = torch.randint(0, E, (4, 2), generator=g)
    y = torch.randn(8, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    if HAS_CUDA:
        selected, y, weights = (t.detach().cuda().requires_grad_(t.requires_grad)
                                for t in (selected, y, weights))
    with gpu_path():
        routing = moe.route(selected, E)
        out = moe.unpermute(y, routing, 2, weights=weights)
        (grad_w,) = torch.autograd.grad(out.sum(), weights, create_graph=True)
        (second,) = torch.autograd.grad(grad_w.sum(), y)
    # d/dy of the sum over the slots of <1, y[p]>
    assert torch.equal(second.cpu(), torch.ones(8, 3, dtype=torch.float64))
