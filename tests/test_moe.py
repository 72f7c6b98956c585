"""detsum.moe: route / permute / unpermute against the naive torch composition, bit for bit in
"autograd" mode, more accurate in "fp32" / "kahan", with clear errors and compile support."""

from __future__ import annotations

import unittest.mock
import weakref

import numpy as np
import pytest
import torch

import detsum
from conftest import (DTYPES, HAS_CUDA, assert_same_bits, backend_device, dtype_id,
                      run_docs_example)
from covering import pairwise
from detsum import _kernel_ops, moe, reference

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
T, H, E = 32, 64, 4  # the user story's setup: seq_len, hidden, num_experts
# Every (rows, weights) dtype pair: the same dtype, weights wider than the rows (bf16 rows with
# fp32 routing probabilities: what DeepSeek-V3's combine multiplies), and weights narrower.
DTYPE_PAIRS = [pytest.param(rows, weights, id=f"{dtype_id(rows)}-w{dtype_id(weights)}")
               for rows in DTYPES for weights in DTYPES]


def setup(dtype, topk, seed=0, tokens=T, hidden=H, weights_dtype=None):
    """The layer's tensors; weights in ``weights_dtype`` (default: ``dtype``) and grad_out in the
    combined rows' dtype, torch's promotion of the two."""
    weights_dtype = weights_dtype or dtype
    g = torch.Generator().manual_seed(seed + 100 * topk)
    selected = torch.randint(0, E, (tokens, topk), generator=g)
    gather_indices, counts = moe.route(selected, E)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    y = torch.randn(tokens * topk, hidden, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(tokens, topk, generator=g), -1).to(weights_dtype)
    grad_y = torch.randn(tokens * topk, hidden, generator=g).to(dtype)
    grad_out = torch.randn(tokens, hidden, generator=g).to(
        torch.promote_types(dtype, weights_dtype))
    return selected, gather_indices, counts, x, y, weights, grad_y, grad_out


def naive_unpermute(y, gather_indices, topk, weights):
    u = torch.empty_like(y).index_copy(0, gather_indices, y)
    return (u.view(-1, topk, y.shape[1]) * weights[..., None]).sum(1)


# ---- route ------------------------------------------------------------------------------------

@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=dtype_id)
def test_route_is_a_stable_argsort_with_counts(index_dtype):
    selected = torch.tensor([[2, 0], [0, 2], [1, 0]], dtype=index_dtype)
    gather_indices, counts = moe.route(selected, 4)
    assert gather_indices.tolist() == [1, 2, 5, 4, 0, 3]  # expert 0, then 1, then 2; stable
    assert counts.tolist() == [3, 1, 2, 0]
    gather_1d, counts_1d = moe.route(selected[:, 0], 4)  # top-1: a 1-D selection
    assert gather_1d.tolist() == [1, 2, 0] and counts_1d.tolist() == [1, 1, 1, 0]


def test_route_rejects_bad_input():
    with pytest.raises(IndexError, match=r"selected_experts\[1, 0\] = 4 is out of range"):
        moe.route(torch.tensor([[0, 1], [4, 0]]), 4)
    with pytest.raises(ValueError, match="num_experts=0"):
        moe.route(torch.tensor([0]), 0)
    with pytest.raises(ValueError, match=r"\[T, topk\] or \[T\]"):
        moe.route(torch.zeros(2, 2, 2, dtype=torch.long), 3)
    with pytest.raises(TypeError, match="selected_experts has dtype torch.float32"):
        moe.route(torch.zeros(4), 3)


@pytest.mark.parametrize("integral", [int, np.int64, np.int32, np.uint8, torch.tensor],
                         ids=["int", "np.int64", "np.int32", "np.uint8", "0-d tensor"])
def test_counts_of_any_integral_type_are_taken(integral):
    """num_experts and topk as NumPy or 0-d tensor ints (operator.index), as dim is taken."""
    selected = torch.tensor([[2, 0], [0, 2], [1, 0]])
    gather_indices, counts = moe.route(selected, integral(3))
    assert gather_indices.tolist() == [1, 2, 5, 4, 0, 3] and counts.tolist() == [3, 1, 2]
    x = torch.arange(3.0).view(3, 1)
    y = moe.permute(x, gather_indices, integral(2))
    assert torch.equal(y, moe.permute(x, gather_indices, 2))
    assert torch.equal(moe.unpermute(y, gather_indices, integral(2)),
                       moe.unpermute(y, gather_indices, 2))


@pytest.mark.parametrize("count", [0, -1, True, 3.0, np.float64(3.0), np.int64(0), "3",
                                   torch.tensor(True), torch.tensor(3.0)],
                         ids=["0", "-1", "True", "3.0", "np.float64", "np.int64(0)", "str",
                              "bool tensor", "float tensor"])
def test_counts_that_are_no_positive_int_are_refused(count):
    gather_indices, _ = moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
    calls = {"num_experts": lambda: moe.route(torch.tensor([[1, 0], [1, 2]]), count),
             "topk": lambda: moe.permute(torch.ones(2, 1), gather_indices, count)}
    for name, call in calls.items():
        with pytest.raises(ValueError) as raised:
            call()
        assert str(raised.value).endswith(f"{name}={count!r}; expected a positive int"), name


# ---- the Routing -----------------------------------------------------------------------------

def test_route_returns_a_routing_that_unpacks_as_before():
    routing = moe.route(torch.tensor([[2, 0], [0, 2], [1, 0]]), 4)
    gather_indices, counts = routing
    assert isinstance(routing, moe.Routing) and isinstance(routing, tuple) and len(routing) == 2
    assert routing.gather_indices is gather_indices and routing.tokens_per_expert is counts
    assert routing.positions.tolist() == [4, 0, 1, 5, 3, 2]  # gather_indices [1, 2, 5, 4, 0, 3]
    assert repr(routing) == repr((gather_indices, counts))


def _routing_cases(backend):
    """Every combination of dtypes and mode; on Triton's interpreter, where a case costs
    seconds, each mode and each pair of dtypes once (a covering, tests/covering.py): the
    Routing and its gather_indices name the same positions whatever the mode and dtypes."""
    interpreted = backend == "triton" and not HAS_CUDA

    def allowed(backend, dtype, weights_dtype, mode):
        # exact fp16 on the interpreter: tests/test_exact_triton.py covers it.
        return not (interpreted and mode == "exact" and dtype == torch.float16)

    dtypes = [pytest.param(a, b, id=f"{dtype_id(a)}-{dtype_id(b)}") for a, b in
              [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
               (torch.float16, torch.float16)]]
    return pairwise([[backend], dtypes, list(detsum.MODES)], allowed=allowed,
                    pairs=[] if interpreted else None, everything=not interpreted)


@pytest.mark.parametrize(("backend", "dtype", "weights_dtype", "mode"),
                         [p for b in ("numba", "reference", "triton") for p in _routing_cases(b)])
def test_the_routing_gives_the_bits_of_its_gather_indices(backend, dtype, weights_dtype, mode):
    """permute and unpermute (weighted, unweighted, reduce=False) given route's Routing: the
    bits of the same calls given its gather_indices, forward and every gradient, at every
    level of the gather_indices' check (the Routing needs none). A copy of them: route's own
    would pass as the Routing."""
    selected, _, _, x, _, weights, _, grad_out = (
        t.to(backend_device(backend)) for t in setup(dtype, 4, weights_dtype=weights_dtype))
    with detsum.backend(backend):
        routing = moe.route(selected, E)
        results = []
        for given, check in ((routing[0].clone(), "host"), (routing, "off")):
            x_leaf, w_leaf = x.clone().requires_grad_(), weights.clone().requires_grad_()
            y = moe.permute(x_leaf, given, 4, mode=mode, check=check)
            out = moe.unpermute(y * 3, given, 4, weights=w_leaf, mode=mode, check=check)
            plain = moe.unpermute(y, given, 4, mode=mode, check=check)
            back = moe.unpermute(y, given, 4, reduce=False, mode=mode, check=check)
            loss = (out.float() * grad_out.float()).sum() + plain.float().sum() + \
                back.float().square().sum()
            results.append((y, out, plain, back, *torch.autograd.grad(loss, (x_leaf, w_leaf))))
    for got, expected in zip(results[1], results[0]):
        assert_same_bits(got, expected)


def test_a_routing_of_unchecked_ids_is_still_a_permutation():
    """Under check="off" an id out of range is counted by no expert, but the Routing is a
    sort's indices all the same: permute and unpermute take it as a permutation."""
    selected = torch.tensor([[0, 7], [-1, 1], [1, 0]])
    routing = moe.route(selected, 2, check="off")
    assert sorted(routing.gather_indices.tolist()) == list(range(6))
    x = torch.randn(3, 5)
    y = moe.permute(x, routing, 2)
    assert_same_bits(moe.unpermute(y, routing, 2, reduce=False),
                     x.repeat_interleave(2, dim=0))


# ---- route's gather_indices, given bare -------------------------------------------------------

def _bare_layer(given, x, weights, grad_out, mode, check):
    """permute, a change of the rows, the weighted and the plain unpermute and the rows
    unpermuted, given ``given``: the outputs, then the gradients of x and weights."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = moe.permute(x, given, 4, mode=mode, check=check)
    rows = y * torch.linspace(-2.0, 3.0, y.shape[0], dtype=y.dtype, device=y.device)[:, None]
    out = moe.unpermute(rows, given, 4, weights=weights, mode=mode, check=check)
    plain = moe.unpermute(rows, given, 4, mode=mode, check=check)
    back = moe.unpermute(rows, given, 4, reduce=False, mode=mode, check=check)
    loss = (out * grad_out).sum() + plain.sum() + back.square().sum()
    return (y, out, plain, back, *torch.autograd.grad(loss, (x, weights)))


@pytest.mark.parametrize("check", ["host", "device", "off", True, False])
@pytest.mark.parametrize("mode", ["fp32", "autograd"])
@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_routes_gather_indices_given_bare_give_the_routings_bits(backend, mode, check):
    """Forward and every gradient, at every level: route's gather_indices, given bare, the
    bits of its Routing and of a copy of them (an index route never returned, checked and
    inverted by each call)."""
    selected, _, _, x, _, weights, _, grad_out = (
        t.to(backend_device(backend)) for t in setup(torch.float32, 4, tokens=8, hidden=6))
    with detsum.backend(backend):
        routing = moe.route(selected, E)
        expected = _bare_layer(routing, x, weights, grad_out, mode, check)
        for given in (routing[0], routing[0].clone()):
            for got, want in zip(_bare_layer(given, x, weights, grad_out, mode, check),
                                 expected, strict=True):
                assert_same_bits(got, want)


@pytest.mark.parametrize("check", ["host", "device", "off", True, False])
@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_routes_gather_indices_given_bare_are_neither_checked_nor_inverted(backend, check):
    """As its Routing: a sort's indices are a permutation, and route has inverted them."""
    selected, _, _, x, _, weights, _, grad_out = (
        t.to(backend_device(backend)) for t in setup(torch.float32, 4, tokens=8, hidden=6))
    again = AssertionError("route's gather_indices checked or inverted again")
    with detsum.backend(backend):
        gather_indices, _ = moe.route(selected, E)
        with unittest.mock.patch.object(moe, "_check_permutation", side_effect=again), \
                unittest.mock.patch.object(moe, "_check_bounds", side_effect=again), \
                unittest.mock.patch.object(moe, "_slot_positions", side_effect=again):
            _bare_layer(gather_indices, x, weights, grad_out, "fp32", check)


def _misroute(view, mistake):
    """Break the permutation at position 2 of ``view``, in place."""
    view[2] = view.numel() * 8 if mistake == "out-of-range" else view[3]


@pytest.mark.parametrize("how", ["in place", "through a view", "after a call"])
@pytest.mark.parametrize("mistake", ["out-of-range", "repeated"])
@pytest.mark.parametrize("call", ["permute", "unpermute"])
def test_routes_gather_indices_changed_in_place_are_checked_as_any_index(call, mistake, how):
    """An index changed since route returned it is an index like any other: each level raises
    what it raises for a new tensor of the same values, with the same words ("device": from
    torch._assert_async, at once on the CPU)."""
    selected, _, _, x, y, weights, _, _ = setup(torch.float32, 4, tokens=8, hidden=6)
    gather_indices, _ = moe.route(selected, E)
    run = {"permute": lambda g, check: moe.permute(x, g, 4, check=check),
           "unpermute": lambda g, check: moe.unpermute(y, g, 4, weights=weights,
                                                       check=check)}[call]
    if how == "after a call":
        run(gather_indices, "host")  # taken as its Routing, before the change
    _misroute(gather_indices[2:] if how == "through a view" else gather_indices, mistake)
    errors = {"host": IndexError if mistake == "out-of-range" else ValueError,
              "device": RuntimeError}
    for check, error in errors.items():
        with pytest.raises(error) as expected:
            run(gather_indices.clone(), check)
        with pytest.raises(error) as got:
            run(gather_indices, check)
        assert str(got.value) == str(expected.value)
        assert str(got.value).startswith(f"detsum.moe.{call}: gather_indices")


def test_routes_gather_indices_keep_their_tables_no_longer_than_themselves():
    """What route computed for its gather_indices goes when they go (no reference cycle: without
    a collection), and a tensor made later, perhaps in the same memory, is no routing's."""
    routing = moe.route(torch.tensor([[1, 0], [1, 2]]), 3)
    positions = weakref.ref(routing.positions)
    del routing
    assert positions() is None
    with pytest.raises(ValueError, match="holds 1 more than once"):
        moe.permute(torch.ones(2, 3), torch.tensor([1, 0, 1, 3]), 2)


def test_routes_gather_indices_made_in_inference_mode_are_checked():
    """Inference tensors keep no version counter: route's are then indices like any other,
    with the same bits."""
    selected, _, _, x, y, weights, _, _ = setup(torch.float32, 4, tokens=8, hidden=6)
    routing = moe.route(selected, E)
    with torch.inference_mode():
        gather_indices, _ = moe.route(selected, E)
        assert moe._as_routing(gather_indices) is gather_indices
        got = moe.unpermute(moe.permute(x, gather_indices, 4) * 2, gather_indices, 4,
                            weights=weights)
    assert_same_bits(got, moe.unpermute(moe.permute(x, routing, 4) * 2, routing, 4,
                                        weights=weights))


def test_a_routing_compiles_in_one_graph():
    selected, _, _, x, _, weights, _, grad_out = setup(torch.bfloat16, 2)

    def layer(selected, x, w):
        routing = moe.route(selected, E)
        y = moe.permute(x, routing, 2)
        return moe.unpermute(y * 2, routing, 2, weights=w)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for fn in (compiled, layer):
        x_leaf, w_leaf = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(selected, x_leaf, w_leaf)
        out.backward(grad_out)
        if fn is compiled:
            expected = (out, x_leaf.grad, w_leaf.grad)
    for got, want in zip((out, x_leaf.grad, w_leaf.grad), expected):
        assert_same_bits(got, want)


# ---- permute ------------------------------------------------------------------------------------

@pytest.mark.parametrize("topk", [1, 4, 8])
@pytest.mark.parametrize("dtype", FLOATS, ids=dtype_id)
def test_permute_autograd_mode_is_autograd(dtype, topk):
    _, gather_indices, _, x, _, _, grad_y, _ = setup(dtype, topk)
    x_ref = x.clone().requires_grad_()
    x_ref[gather_indices // topk].backward(grad_y)
    x_moe = x.clone().requires_grad_()
    y = moe.permute(x_moe, gather_indices, topk, mode="autograd")
    assert_same_bits(y, x[gather_indices // topk])
    y.backward(grad_y)
    assert_same_bits(x_moe.grad, x_ref.grad)


def exact_token_sums(rows, gather_indices, topk, dtype):
    """Each token's topk rows summed exactly, rounded once to dtype."""
    tokens = gather_indices // topk
    return torch.stack([reference.exact_sum_rounded(rows[tokens == t].double(), dtype)
                        for t in range(rows.shape[0] // topk)])


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
def test_permute_fp32_and_kahan_beat_autograd_against_exact(dtype):
    """Over all topk in {4, 8}: "kahan" is within 1 ulp of the exact gradient everywhere and
    "fp32" is closer to it than autograd on average."""
    errors = {mode: [] for mode in detsum.MODES}
    for topk in (4, 8):
        for seed in range(3):
            _, gather_indices, _, x, _, _, grad_y, _ = setup(dtype, topk, seed)
            exact = exact_token_sums(grad_y, gather_indices, topk, dtype)
            for mode in detsum.MODES:
                x_moe = x.clone().requires_grad_()
                moe.permute(x_moe, gather_indices, topk, mode=mode).backward(grad_y)
                errors[mode].append(reference.ulp_distance(x_moe.grad, exact).view(-1))
    errors = {mode: torch.cat(e) for mode, e in errors.items()}
    assert errors["kahan"].max() <= 1
    assert errors["fp32"].mean() < errors["autograd"].mean()


# ---- unpermute ----------------------------------------------------------------------------------

def rounding_unit(dtype):
    """u = eps / 2: the largest relative error of one rounding to nearest in ``dtype``."""
    return torch.finfo(dtype).eps / 2


@pytest.mark.parametrize("topk", [1, 4, 8])
@pytest.mark.parametrize(("dtype", "weights_dtype"), DTYPE_PAIRS)
def test_unpermute_autograd_mode_is_the_naive_composition(dtype, weights_dtype, topk):
    """Bits and dtype of the naive composition and of both its gradients for every pair of
    dtypes: with bf16 rows and fp32 weights torch promotes the products, and so the result,
    to fp32, and the weights gradient is an fp32 sum whose every bit shows."""
    _, gather_indices, _, _, y, weights, _, grad_out = setup(dtype, topk,
                                                             weights_dtype=weights_dtype)
    y_ref, w_ref = y.clone().requires_grad_(), weights.clone().requires_grad_()
    expected = naive_unpermute(y_ref, gather_indices, topk, w_ref)
    expected.backward(grad_out)
    y_moe, w_moe = y.clone().requires_grad_(), weights.clone().requires_grad_()
    got = moe.unpermute(y_moe, gather_indices, topk, weights=w_moe, mode="autograd")
    got.backward(grad_out)
    assert_same_bits(got, expected)
    assert_same_bits(y_moe.grad, y_ref.grad)
    assert_same_bits(w_moe.grad, w_ref.grad)
    u = torch.empty_like(y).index_copy(0, gather_indices, y).view(T, topk, H)
    # Without weights, the same composition with a plain sum.
    assert_same_bits(moe.unpermute(y, gather_indices, topk, mode="autograd"), u.sum(1))


# Every hidden size from 1 to 128 and every topk from 1 to 17, plus longer ones: torch's CPU
# sum over the slots changes its order with both (and with the vector width: AVX2 or
# AVX-512), and with small hidden sizes it differs from any serial order.
HIDDEN_SIZES = range(1, 129)
TOPKS = list(range(1, 18)) + [18, 33]


@pytest.mark.parametrize(("dtype", "weights_dtype"),
                         [(torch.float32, torch.float32), (torch.float64, torch.float64),
                          (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
                         ids=lambda d: dtype_id(d))
def test_unpermute_autograd_mode_is_the_naive_composition_for_every_shape(dtype,
                                                                          weights_dtype):
    """Bits of the naive composition and of both its gradients, with and without weights, for
    every hidden size and topk: terms of mixed magnitudes and signs, so that any other order
    of the sum over the slots shows."""
    g = torch.Generator().manual_seed(7)
    tokens = 3
    for topk in TOPKS:
        n = tokens * topk
        gather_indices = torch.randperm(n, generator=g)
        scales = torch.exp2(torch.randint(-12, 12, (n, 1), generator=g).double())
        weights = torch.rand(tokens, topk, generator=g).to(weights_dtype)
        for hidden in HIDDEN_SIZES:
            y = (torch.randn(n, hidden, generator=g, dtype=torch.float64) * scales).to(dtype)
            out_dtype = torch.promote_types(dtype, weights_dtype)
            grad_out = torch.randn(tokens, hidden, generator=g).to(out_dtype)
            y_ref, w_ref = y.clone().requires_grad_(), weights.clone().requires_grad_()
            expected = naive_unpermute(y_ref, gather_indices, topk, w_ref)
            expected.backward(grad_out)
            y_moe, w_moe = y.clone().requires_grad_(), weights.clone().requires_grad_()
            got = moe.unpermute(y_moe, gather_indices, topk, weights=w_moe, mode="autograd")
            got.backward(grad_out)
            assert_same_bits(got, expected)
            assert_same_bits(y_moe.grad, y_ref.grad)
            assert_same_bits(w_moe.grad, w_ref.grad)
            u = torch.empty_like(y).index_copy(0, gather_indices, y).view(tokens, topk, hidden)
            assert_same_bits(moe.unpermute(y, gather_indices, topk, mode="autograd"), u.sum(1))


@pytest.mark.parametrize("mode", detsum.MODES)
@pytest.mark.parametrize(("dtype", "weights_dtype"), DTYPE_PAIRS)
def test_unpermute_dtypes_and_rows_gradient_are_torchs_in_every_mode(dtype, weights_dtype, mode):
    """One promotion rule in every mode (a change of mode never changes a dtype downstream),
    and the rows' gradient has autograd's bits in every mode: g * w in the promoted dtype, then
    rounded to the rows' dtype, never from weights rounded to the rows' dtype."""
    _, gather_indices, _, _, y, weights, _, grad_out = setup(dtype, 4, weights_dtype=weights_dtype)
    y_ref, w_ref = y.clone().requires_grad_(), weights.clone().requires_grad_()
    expected = naive_unpermute(y_ref, gather_indices, 4, w_ref)
    expected.backward(grad_out)
    y_moe, w_moe = y.clone().requires_grad_(), weights.clone().requires_grad_()
    got = moe.unpermute(y_moe, gather_indices, 4, weights=w_moe, mode=mode)
    assert got.dtype == expected.dtype == torch.promote_types(dtype, weights_dtype)
    got.backward(grad_out)
    assert_same_bits(y_moe.grad, y_ref.grad)
    assert w_moe.grad.dtype == weights_dtype
    assert moe.unpermute(y, gather_indices, 4, mode=mode).dtype == dtype
    assert moe.unpermute(y, gather_indices, 4, reduce=False, mode=mode).dtype == dtype


def test_unpermute_autograd_weights_gradient_is_the_same_on_every_thread_count():
    """The "autograd" weights gradient sums over the features with torch's own reduction (its
    order is torch's): that sum must still not depend on the thread count. The layer is large
    enough (65536 products) for torch to run the sum on several threads."""
    _, gather_indices, _, _, y, weights, _, grad_out = setup(
        torch.bfloat16, 4, tokens=64, hidden=256, weights_dtype=torch.float32)
    threads = torch.get_num_threads()
    gradients = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            w_leaf = weights.clone().requires_grad_()
            moe.unpermute(y, gather_indices, 4, weights=w_leaf, mode="autograd").backward(grad_out)
            gradients.append(w_leaf.grad)
    finally:
        torch.set_num_threads(threads)
    assert_same_bits(gradients[0], gradients[1])


# Rows and weights whose products the accumulator (fp32) holds in a wider dtype than the rows.
WIDENING_PAIRS = [pytest.param(rows, weights, id=f"{dtype_id(rows)}-w{dtype_id(weights)}")
                  for rows, weights in [(torch.bfloat16, torch.float32),
                                        (torch.float16, torch.float32),
                                        (torch.bfloat16, torch.float16),
                                        (torch.float16, torch.bfloat16)]]


@pytest.mark.parametrize(("dtype", "weights_dtype"), WIDENING_PAIRS)
def test_unpermute_keeps_wide_weights_wide_and_kahan_within_one_ulp(dtype, weights_dtype):
    """Mixed dtypes in "fp32" and "kahan" mode, forward and weights gradient: "kahan" is within
    1 ulp of the exact sum of the products it forms (one fp32 rounding each), and both modes
    are within a few fp32 roundings of the exact result, which weights rounded to the rows'
    dtype (2**-9 relative for bf16) would miss by orders of magnitude."""
    for topk in (4, 8):
        for seed in range(2):
            _, gather_indices, _, _, y, weights, _, grad_out = setup(
                dtype, topk, seed, weights_dtype=weights_dtype)
            out_dtype = torch.promote_types(dtype, weights_dtype)
            position_weights = weights.reshape(-1)[gather_indices]
            formed = y.float() * position_weights.float()[:, None]  # one fp32 rounding each
            exact_products = y.double() * position_weights.double()[:, None]  # exact in fp64
            magnitudes = exact_token_sums(exact_products.abs(), gather_indices, topk,
                                          torch.float64)
            exact = exact_token_sums(exact_products, gather_indices, topk, torch.float64)
            grad_rows = grad_out[gather_indices // topk]
            formed_dots = reference.exact_sum_rounded(grad_rows.float() * y.float(),
                                                      weights_dtype, dim=1)
            by_mode = {}
            for mode in ("fp32", "kahan"):
                y_leaf, w_leaf = y.clone().requires_grad_(), weights.clone().requires_grad_()
                got = moe.unpermute(y_leaf, gather_indices, topk, weights=w_leaf, mode=mode)
                got.backward(grad_out)
                assert got.dtype == out_dtype
                error = (got.double() - exact).abs()
                assert (error <= (topk + 2) * rounding_unit(torch.float32) * magnitudes).all()
                by_mode[mode] = got
                if mode == "kahan":
                    formed_sums = exact_token_sums(formed, gather_indices, topk, out_dtype)
                    assert reference.ulp_distance(got, formed_sums).max() <= 1
                    grad_weights = w_leaf.grad.reshape(-1)[gather_indices]
                    assert reference.ulp_distance(grad_weights, formed_dots).max() <= 1


@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
def test_unpermute_kahan_within_one_ulp_and_fp32_beats_autograd(dtype):
    errors = {mode: [] for mode in detsum.MODES}
    for topk in (4, 8):
        for seed in range(3):
            _, gather_indices, _, _, y, weights, _, _ = setup(dtype, topk, seed)
            products = y.double() * weights.reshape(-1)[gather_indices].double()[:, None]
            exact = exact_token_sums(products, gather_indices, topk, dtype)
            for mode in detsum.MODES:
                got = moe.unpermute(y, gather_indices, topk, weights=weights, mode=mode)
                errors[mode].append(reference.ulp_distance(got, exact).view(-1))
    errors = {mode: torch.cat(e) for mode, e in errors.items()}
    assert errors["kahan"].max() <= 1
    assert errors["fp32"].mean() < errors["autograd"].mean()


@pytest.mark.parametrize("mode", detsum.MODES)
def test_unpermute_without_reduce_is_the_exact_inverse_of_the_permutation(mode):
    _, gather_indices, _, x, _, _, grad_y, _ = setup(torch.bfloat16, 4)
    y = moe.permute(x, gather_indices, 4, mode=mode)
    rows = moe.unpermute(y.clone().requires_grad_(), gather_indices, 4, reduce=False, mode=mode)
    assert_same_bits(rows, x.repeat_interleave(4, 0))
    y_leaf = y.clone().requires_grad_()
    moe.unpermute(y_leaf, gather_indices, 4, reduce=False, mode=mode).backward(grad_y)
    assert_same_bits(y_leaf.grad, grad_y[gather_indices])


@pytest.mark.parametrize("mode", detsum.MODES)
def test_no_tokens_forward_and_backward(mode):
    """Zero tokens: empty rows out, empty gradients back (the backward once reshaped the
    weights' products with -1, which torch cannot do for zero rows)."""
    x = torch.zeros(0, 8, requires_grad=True)
    weights = torch.zeros(0, 2, requires_grad=True)
    gather_indices, _ = moe.route(torch.zeros(0, 2, dtype=torch.int64), 4)
    y = moe.permute(x, gather_indices, 2, mode=mode)
    out = moe.unpermute(y, gather_indices, 2, weights=weights, mode=mode)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 8) and weights.grad.shape == (0, 2)


def test_gradcheck_float64():
    # gradcheck perturbs every input element: a small layer keeps it quick.
    _, gather_indices, _, x, y, weights, _, _ = setup(torch.float64, 4, tokens=6, hidden=3)
    for mode in detsum.MODES:
        assert torch.autograd.gradcheck(lambda x: moe.permute(x, gather_indices, 4, mode=mode),
                                        (x.clone().requires_grad_(),))
        assert torch.autograd.gradcheck(
            lambda y, w: moe.unpermute(y, gather_indices, 4, weights=w, mode=mode),
            (y.clone().requires_grad_(), weights.clone().requires_grad_()))


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_compiled_gives_eager_bits(mode, weights_dtype, check):
    # The index checks read values back inside the operators, so either check runs in a
    # full graph; fp32 weights make the fake result fp32 like the real one.
    torch._dynamo.reset()  # one code object for every case: start each from a clean cache
    _, gather_indices, _, x, _, weights, _, grad_out = setup(torch.bfloat16, 8,
                                                             weights_dtype=weights_dtype)

    def layer(x, w):
        y = moe.permute(x, gather_indices, 8, mode=mode, check=check)
        return moe.unpermute(y * 2, gather_indices, 8, weights=w, mode=mode, check=check)

    def run(fn):
        x_leaf, w_leaf = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(x_leaf, w_leaf)
        out.backward(grad_out)
        return out, x_leaf.grad, w_leaf.grad

    for got, expected in zip(run(torch.compile(layer, fullgraph=True, backend="aot_eager")),
                             run(layer)):
        assert_same_bits(got, expected)


@pytest.mark.parametrize("check", ["host", "device", "off"])
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_opcheck(weights_dtype, check):
    # Small: opcheck runs each operator several times, backward included.
    selected, gather_indices, _, x, y, weights, _, _ = setup(torch.bfloat16, 2, tokens=4,
                                                             hidden=3, weights_dtype=weights_dtype)
    torch.library.opcheck(torch.ops.detsum.moe_route, (selected, E, check))
    # The other levels run the same arithmetic: two modes (one per weighted path) are enough.
    modes = detsum.MODES if check == "host" else ("fp32", "autograd")
    # permute's own level for check=False: the bounds alone.
    for permute_check in (check, "bounds") if check == "host" else (check,):
        for mode in modes:
            torch.library.opcheck(torch.ops.detsum.moe_permute,
                                  (x.clone().requires_grad_(), gather_indices, 2, mode,
                                   permute_check))
    for mode in modes:
        for w, reduce in ((weights.clone().requires_grad_(), True), (None, True), (None, False)):
            torch.library.opcheck(torch.ops.detsum.moe_unpermute,
                                  (y.clone().requires_grad_(), gather_indices, 2, w, reduce,
                                   mode, check))


def test_autocast_bf16():
    """Under CPU autocast the rows arrive in bf16 from a matmul while the routing weights stay
    fp32: the combined rows are fp32, as the naive composition's are (autocast leaves the
    multiply to torch's promotion), and equal the same call outside autocast on those rows."""
    _, gather_indices, _, x, _, weights, _, _ = setup(torch.float32, 4)
    proj = torch.randn(H, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = x @ proj
        y = moe.permute(rows, gather_indices, 4)
        out = moe.unpermute(y, gather_indices, 4, weights=weights)
        naive = naive_unpermute(y, gather_indices, 4, weights)
    assert rows.dtype == torch.bfloat16 and out.dtype == naive.dtype == torch.float32
    assert_same_bits(out, moe.unpermute(moe.permute(rows, gather_indices, 4), gather_indices, 4,
                                        weights=weights))
    # fp32 products: the default "fp32" mode is the naive composition's arithmetic.
    assert_same_bits(out, naive)


def test_triton_backend_gives_numba_bits():
    pytest.importorskip("triton")
    # Triton's interpreter runs a program per term row in Python: a small layer.
    _, gather_indices, _, x, _, weights, grad_y, grad_out = setup(torch.bfloat16, 4, tokens=8,
                                                                  hidden=5)

    def run(device):
        to = lambda t: t.to(device)  # noqa: E731
        # detach: on another device, .to() of a tensor that requires grad is not a leaf.
        x_leaf = to(x).detach().requires_grad_()
        w_leaf = to(weights).detach().requires_grad_()
        moe.permute(x_leaf, to(gather_indices), 4, mode="kahan").backward(to(grad_y))
        y = to(x.repeat_interleave(4, 0)[gather_indices])
        moe.unpermute(y, to(gather_indices), 4, weights=w_leaf, mode="fp32").backward(
            to(grad_out))
        return x_leaf.grad.cpu(), w_leaf.grad.cpu()

    with detsum.backend("numba"):
        expected = run("cpu")
    with detsum.backend("triton"):
        for got, want in zip(run("cuda" if HAS_CUDA else "cpu"), expected):
            assert_same_bits(got, want)


# ---- errors -------------------------------------------------------------------------------------

def test_bad_arguments_raise_clear_errors():
    _, gather_indices, _, x, y, weights, _, _ = setup(torch.float32, 4)
    n = T * 4
    duplicated = gather_indices.clone()
    duplicated[5] = duplicated[6]
    with pytest.raises(ValueError, match=f"gather_indices holds {int(duplicated[6])} more than "
                                         f"once"):
        moe.permute(x, duplicated, 4)
    out_of_range = gather_indices.clone()
    out_of_range[3] = n
    with pytest.raises(IndexError, match=rf"gather_indices\[3\] = {n} is out of range"):
        moe.unpermute(y, out_of_range, 4)
    with pytest.raises(ValueError, match=rf"gather_indices has length {n}; expected T \* topk"):
        moe.permute(x, gather_indices, 2)
    with pytest.raises(ValueError, match="y has 128 rows; expected a multiple of topk = 3"):
        moe.unpermute(y, gather_indices, 3)
    with pytest.raises(ValueError, match=r"weights has shape \(4, 32\)"):
        moe.unpermute(y, gather_indices, 4, weights=weights.T)
    with pytest.raises(ValueError, match="pass reduce=True or weights=None"):
        moe.unpermute(y, gather_indices, 4, weights=weights, reduce=False)
    with pytest.raises(ValueError, match="topk=0"):
        moe.permute(x, gather_indices, 0)
    with pytest.raises(ValueError, match="mode='fast'"):
        moe.permute(x, gather_indices, 4, mode="fast")
    # check=False skips the permutation check (the caller vouches for it).
    moe.permute(x, duplicated, 4, check=False)


CALLS = {
    "permute": lambda t, g, check: moe.permute(t["x"], g, 4, check=check),
    "unpermute": lambda t, g, check: moe.unpermute(t["y"], g, 4, check=check),
    "unpermute-weighted": lambda t, g, check: moe.unpermute(t["y"], g, 4, weights=t["weights"],
                                                            check=check),
    "unpermute-rows": lambda t, g, check: moe.unpermute(t["y"], g, 4, reduce=False, check=check),
}


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("value", ["T*topk", "huge", "-1", "-T*topk-1"])
@pytest.mark.parametrize("call", list(CALLS))
def test_out_of_range_gather_indices_raise_detsums_error_whatever_check(call, value, check):
    """check=False skips the permutation check, not the bounds: an out-of-range value is
    named in detsum's words before anything runs, never answered in torch's (or, on CUDA, by
    a device-side assert)."""
    _, gather_indices, _, x, y, weights, _, _ = setup(torch.float32, 4)
    n = T * 4
    bad_value = {"T*topk": n, "huge": 2**40, "-1": -1, "-T*topk-1": -n - 1}[value]
    bad = gather_indices.clone()
    bad[5] = bad_value
    tensors = {"x": x, "y": y, "weights": weights, "gather_indices": bad}
    before = {name: t.clone() for name, t in tensors.items()}
    function = call.split("-")[0]
    with pytest.raises(IndexError, match=rf"^detsum\.moe\.{function}: gather_indices\[5\] = "
                                         rf"{bad_value} is out of range for T \* topk = {n} "
                                         rf"\(expected 0 <= gather_indices < {n}\)$"):
        CALLS[call](tensors, bad, check)
    for name, t in tensors.items():
        assert torch.equal(t, before[name]), name


def repeated_gather_indices(gather_indices, topk):
    """gather_indices with token 0's slots all taken by token 1's first slot: token 0 gathers
    no row, token 1 gets topk more. Not a permutation, every value in range."""
    repeated = gather_indices.clone()
    repeated[gather_indices // topk == 0] = topk
    return repeated


@pytest.mark.parametrize("mode", detsum.MODES)
def test_permute_without_check_is_the_gather_of_repeated_values(mode):
    """A repeated value (check=False) is no hazard for permute: forward is the gather, and
    backward sums each token's rows whatever their number (not through an inverse permutation,
    which would hold undefined slots): exactly the gradient of x[gather_indices // topk]."""
    _, gather_indices, _, x, _, _, grad_y, _ = setup(torch.bfloat16, 4)
    repeated = repeated_gather_indices(gather_indices, 4)
    tokens = repeated // 4
    for _ in range(2):  # the same bits twice: nothing read from uninitialised memory
        x_leaf = x.clone().requires_grad_()
        gathered = moe.permute(x_leaf, repeated, 4, mode=mode, check=False)
        assert_same_bits(gathered, x[tokens])
        gathered.backward(grad_y)
        # index_add sums each output row's terms in order of appearance, permute's order.
        assert_same_bits(x_leaf.grad, detsum.index_add(torch.zeros_like(x), 0, tokens, grad_y,
                                                       mode=mode))
        assert not x_leaf.grad[0].any()  # token 0 gathered nothing
    if mode == "autograd":
        x_ref = x.clone().requires_grad_()
        x_ref[tokens].backward(grad_y)
        assert_same_bits(x_leaf.grad, x_ref.grad)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("call", [c for c in CALLS if c != "permute"])
def test_unpermute_rejects_repeated_values_whatever_check(call, check):
    """unpermute inverts the permutation: a slot no row reaches would leave its output
    undefined, so a repeated value is an error even with check=False."""
    _, gather_indices, _, x, y, weights, _, _ = setup(torch.float32, 4)
    repeated = repeated_gather_indices(gather_indices, 4)
    with pytest.raises(ValueError, match=r"^detsum\.moe\.unpermute: gather_indices holds 4 more "
                                         r"than once; expected a permutation of 0 \.\. "
                                         rf"T \* topk - 1 = {T * 4 - 1}"):
        CALLS[call]({"x": x, "y": y, "weights": weights}, repeated, check)


# ---- the worked example ships in docs/ and runs here -----------------------------------------

def test_worked_example(capsys):
    rows = run_docs_example("moe_example")
    out = capsys.readouterr().out
    assert "naive" in out and "autograd" in out
    for row in rows:
        assert row["autograd_mode_vs_autograd"] == 0.0
    # The story: the naive recipe differs from autograd in half precision.
    assert any(r["naive_vs_autograd"] > 0 for r in rows if r["dtype"] == "bfloat16")


# ---- the weighted unpermute by blocks (CPU, "fp32" / "kahan") -----------------------------------

@pytest.mark.parametrize("block_bytes", [64, 1000], ids=["one-token-blocks", "uneven-blocks"])
@pytest.mark.parametrize(("dtype", "weights_dtype"),
                         [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float16), (torch.float32, torch.float32),
                          (torch.float64, torch.float32),
                          # fp64 weights: an acc type wider than the rows' own, which the
                          # fused kernels leave to the blocks of torch products
                          (torch.bfloat16, torch.float64)], ids=dtype_id)
@pytest.mark.parametrize("mode", ["fp32", "kahan"])
@pytest.mark.parametrize("row_shape", [(5,), (3, 4), (0,), (3, 0)],
                         ids=["rows", "3d-rows", "no-features", "3d-no-features"])
def test_weighted_unpermute_by_blocks_gives_the_bits_of_one_pass(
        mode, dtype, weights_dtype, block_bytes, row_shape, monkeypatch):
    """Each token's sum and each row's dot product use its own rows only: blocks of any size
    give the bits of one pass over all rows, forward and backward."""
    topk, tokens = 3, 11
    g = torch.Generator().manual_seed(7)
    gather_indices, _ = moe.route(torch.randint(0, E, (tokens, topk), generator=g), E)
    y = torch.randn((tokens * topk,) + row_shape, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(tokens, topk, generator=g), -1).to(weights_dtype)
    grad_out = torch.randn((tokens,) + row_shape, generator=g).to(
        torch.promote_types(dtype, weights_dtype))

    def run():
        y_leaf, w_leaf = y.clone().requires_grad_(), weights.clone().requires_grad_()
        out = moe.unpermute(y_leaf, gather_indices, topk, weights=w_leaf, mode=mode)
        out.backward(grad_out)
        return out, y_leaf.grad, w_leaf.grad

    with monkeypatch.context() as patch:
        patch.setattr(_kernel_ops, "_PRODUCT_BLOCK_BYTES", block_bytes)
        blocked = run()
    with monkeypatch.context() as patch:
        patch.setattr(moe, "_runs_in_token_blocks", lambda device, acc_mode: False)
        one_pass = run()
    for got, expected in zip(blocked, one_pass):
        assert_same_bits(got, expected)
