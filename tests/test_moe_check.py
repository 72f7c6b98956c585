"""The ``check`` levels of detsum.moe's route, permute and unpermute: "host" (default),
"device" (no host read), "off"; the primitives' are in tests/test_check.py.

The same levels and the same guard as the primitives' (tests/check_levels.py). The guard runs
the triton backend only: on the CPU the Numba primitives check their arguments on the host at
every level (free there); the bits are compared on both backends.
"""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch

import detsum
from check_levels import HostRead, gpu_path, no_host_reads
from conftest import TRITON_ON_CPU, assert_same_bits
from detsum import moe

pytest.importorskip("triton")


_TOKENS, _TOPK, _EXPERTS, _FEATURES = 6, 3, 4, 5
_SLOTS = _TOKENS * _TOPK


def _moe_inputs(dtype=torch.float32, weights_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    selected = torch.randint(0, _EXPERTS, (_TOKENS, _TOPK), generator=gen)
    # A copy: route's own gather_indices would pass as its Routing, with nothing to check.
    gather_indices = moe.route(selected, _EXPERTS)[0].clone()
    return {
        "selected": selected,
        "gather_indices": gather_indices,
        "x": torch.randn(_TOKENS, _FEATURES, generator=gen).to(dtype),
        "y": torch.randn(_SLOTS, _FEATURES, generator=gen).to(dtype),
        "weights": torch.softmax(torch.randn(_TOKENS, _TOPK, generator=gen), -1).to(
            weights_dtype or dtype),
        "grad_seed": seed + 1,
    }


def _forward_backward(function, inputs, check, differentiable, **kwargs):
    """[out, then the gradient of each differentiable input] of one call, backward from a
    random gradient."""
    leaves = {name: inputs[name].clone().requires_grad_() for name in differentiable}
    arguments = {name: leaves.get(name, inputs[name]) for name in inputs if name != "grad_seed"}
    out = function(arguments, check, **kwargs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(inputs["grad_seed"]))
    out.backward(grad.to(out.dtype))
    return [out] + [leaves[name].grad for name in differentiable]


def _permute(t, check, mode):
    return moe.permute(t["x"], t["gather_indices"], _TOPK, mode=mode, check=check)


def _unpermute(t, check, mode, weighted=False, reduce=True):
    return moe.unpermute(t["y"], t["gather_indices"], _TOPK, mode=mode, check=check,
                         weights=t["weights"] if weighted else None, reduce=reduce)


# name -> (function, differentiable inputs, mode, dtype, weights dtype, keywords). On the CPU
# the weighted unpermute runs by blocks in "fp32", "kahan" and "exact", in one pass in
# "autograd" and on a GPU: both paths are here.
_MOE_CALLS = {
    "permute-fp32-bf16": (_permute, ["x"], "fp32", torch.bfloat16, None, {}),
    "permute-autograd-fp16": (_permute, ["x"], "autograd", torch.float16, None, {}),
    "permute-exact-fp32": (_permute, ["x"], "exact", torch.float32, None, {}),
    "unpermute-kahan-fp32": (_unpermute, ["y"], "kahan", torch.float32, None, {}),
    "unpermute-rows-bf16": (_unpermute, ["y"], "fp32", torch.bfloat16, None,
                            {"reduce": False}),
    "unpermute-weighted-fp32-bf16-wfp32": (_unpermute, ["y", "weights"], "fp32",
                                           torch.bfloat16, torch.float32, {"weighted": True}),
    "unpermute-weighted-kahan-fp16": (_unpermute, ["y", "weights"], "kahan", torch.float16,
                                      None, {"weighted": True}),
    "unpermute-weighted-fp32-one-pass": (_unpermute, ["y", "weights"], "fp32", torch.float32,
                                         None, {"weighted": True}),
    "unpermute-weighted-autograd-bf16-wfp32": (_unpermute, ["y", "weights"], "autograd",
                                               torch.bfloat16, torch.float32,
                                               {"weighted": True}),
    "unpermute-weighted-exact-bf16": (_unpermute, ["y", "weights"], "exact", torch.bfloat16,
                                      None, {"weighted": True}),
}


def _moe_call(name, seed=0):
    """A call of _MOE_CALLS on its inputs, made now: check -> [out, gradients]."""
    function, differentiable, mode, dtype, weights_dtype, keywords = _MOE_CALLS[name]
    inputs = _moe_inputs(dtype, weights_dtype, seed)
    # "one-pass": the weighted rows in one pass, forward and backward, as on a GPU.
    runs_in_token_blocks = ((lambda device, acc_mode: False) if name.endswith("one-pass")
                            else moe._runs_in_token_blocks)

    def run(check):
        with unittest.mock.patch.object(moe, "_runs_in_token_blocks", runs_in_token_blocks):
            return _forward_backward(function, inputs, check, differentiable, mode=mode,
                                     **keywords)
    return run


@pytest.mark.interpreter
@pytest.mark.parametrize("call", list(_MOE_CALLS))
@pytest.mark.parametrize("check", ["device", "off"])
def test_moe_no_host_read_in_the_gpu_launch_path(check, call):
    """Forward and backward of permute and unpermute, with the plan of a GPU: not one value
    read into Python, in moe's own code or in the primitives it calls."""
    run = _moe_call(call)
    with gpu_path(), no_host_reads():
        results = run(check)
    assert all(torch.isfinite(t).all() for t in results)


@pytest.mark.parametrize("check", ["device", "off"])
def test_moe_route_reads_nothing_back(check):
    selected = _moe_inputs()["selected"]
    with no_host_reads():
        gather_indices, tokens_per_expert = moe.route(selected, _EXPERTS, check=check)
    assert torch.equal(gather_indices, torch.sort(selected.view(-1), stable=True).indices)
    assert torch.equal(tokens_per_expert, torch.bincount(selected.view(-1), minlength=_EXPERTS))


@pytest.mark.interpreter
@pytest.mark.parametrize("check", ["device", "off"])
@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_moe_weighted_backward_operator_reads_nothing_back(mode, check):
    """The weighted unpermute's backward by blocks is an operator of its own, which a traced
    backward calls (a plain eager one calls its body, as the test above does)."""
    t = _moe_inputs(torch.bfloat16, torch.float32)
    grad = torch.randn(_TOKENS, _FEATURES)
    tokens = t["gather_indices"] // _TOPK
    position_weights = t["weights"].reshape(-1).index_select(0, t["gather_indices"])
    with gpu_path(), no_host_reads():
        grad_y, dots = torch.ops.detsum.moe_unpermute_weighted_backward(
            grad, t["y"], tokens, position_weights, mode)
    assert torch.isfinite(grad_y).all() and torch.isfinite(dots).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("call", ["route"] + list(_MOE_CALLS))
def test_moe_host_level_reads_values_back(call):
    """The guard sees the reads that moe's default level makes (so the tests above can fail)."""
    selected = _moe_inputs()["selected"]
    run = (lambda check: moe.route(selected, _EXPERTS, check=check)) if call == "route" else (
        _moe_call(call))
    with gpu_path(), no_host_reads(), pytest.raises(HostRead):
        run("host")


@pytest.mark.parametrize("call", list(_MOE_CALLS))
@pytest.mark.parametrize("backend", ["numba", TRITON_ON_CPU])
def test_moe_every_level_gives_the_same_bits(backend, call):
    """Forward and backward; True and False, the flag's old values, included."""
    run = _moe_call(call, seed=1)
    with detsum.backend(backend) if backend == "numba" else gpu_path(backend):
        host = run("host")
        for check in ("device", "off", True, False):
            for got, expected in zip(run(check), host, strict=True):
                assert_same_bits(got, expected)


def test_moe_route_every_level_gives_the_same_result():
    selected = _moe_inputs(seed=1)["selected"]
    host = moe.route(selected, _EXPERTS)
    for check in ("device", "off", True, False):
        for got, expected in zip(moe.route(selected, _EXPERTS, check=check), host, strict=True):
            assert torch.equal(got, expected)


# The mistakes the levels check for: a value out of range, a value twice (so a slot no row
# reaches).
def _bad_gather_indices(mistake):
    gather_indices = _moe_inputs()["gather_indices"].clone()
    if mistake == "out-of-range":
        gather_indices[4] = _SLOTS
    else:
        gather_indices[4] = gather_indices[5]
    return gather_indices


_MOE_FUNCTIONS = {
    "permute": lambda t, g, check: moe.permute(t["x"], g, _TOPK, check=check),
    "unpermute": lambda t, g, check: moe.unpermute(t["y"], g, _TOPK, check=check),
    "unpermute-weighted": lambda t, g, check: moe.unpermute(t["y"], g, _TOPK,
                                                            weights=t["weights"], check=check),
    "unpermute-weighted-autograd": lambda t, g, check: moe.unpermute(
        t["y"], g, _TOPK, weights=t["weights"], mode="autograd", check=check),
    "unpermute-rows": lambda t, g, check: moe.unpermute(t["y"], g, _TOPK, reduce=False,
                                                        check=check),
}


@pytest.mark.parametrize("mistake", ["out-of-range", "repeated"])
@pytest.mark.parametrize("call", list(_MOE_FUNCTIONS))
def test_moe_device_level_fails_naming_the_argument(call, mistake):
    """On the CPU torch._assert_async fails at once (on a GPU, at the next synchronisation),
    in detsum's words, before anything is written; every tensor is left as it was."""
    t = _moe_inputs()
    bad = _bad_gather_indices(mistake)
    before = {name: t[name].clone() for name in ("x", "y", "weights")}
    bad_before = bad.clone()
    what = (rf"has a value outside \[0, T \* topk = {_SLOTS}\)" if mistake == "out-of-range"
            else rf"holds a value more than once; expected a permutation of 0 \.\. "
                 rf"T \* topk - 1 = {_SLOTS - 1}")
    function = call.split("-")[0]
    with gpu_path(), pytest.raises(
            RuntimeError, match=rf"detsum\.moe\.{function}: gather_indices {what} \(found by "
                                rf"check='device'"):
        _MOE_FUNCTIONS[call](t, bad, "device")
    for name, tensor in before.items():
        assert torch.equal(t[name], tensor), name
    assert torch.equal(bad, bad_before)


def test_moe_route_device_level_fails_naming_the_argument():
    selected = _moe_inputs()["selected"].clone()
    selected[2, 1] = _EXPERTS
    with pytest.raises(RuntimeError, match=rf"detsum\.moe\.route: selected_experts has a value "
                                           rf"outside \[0, num_experts = {_EXPERTS}\) \(found "
                                           rf"by check='device'"):
        moe.route(selected, _EXPERTS, check="device")


@pytest.mark.parametrize("mistake", ["out-of-range", "repeated"])
@pytest.mark.parametrize("call", list(_MOE_FUNCTIONS))
def test_moe_host_level_raises_the_errors_naming_the_position(call, mistake):
    """The default level's errors, as before the levels (tests/test_moe.py has True and False)."""
    t = _moe_inputs()
    bad = _bad_gather_indices(mistake)
    error, words = ((IndexError, rf"gather_indices\[4\] = {_SLOTS} is out of range")
                    if mistake == "out-of-range" else
                    (ValueError, rf"gather_indices holds {int(bad[4])} more than once"))
    with pytest.raises(error, match=rf"^detsum\.moe\.{call.split('-')[0]}: {words}"):
        _MOE_FUNCTIONS[call](t, bad, "host")


def _clamped_and_positions(gather_indices):
    """What check="off" computes with, as moe.unpermute's docstring says, in plain loops: each
    value clamped to [0, T * topk), and for each slot the last position naming it, else 0."""
    clamped = [min(max(int(v), 0), _SLOTS - 1) for v in gather_indices]
    positions = [0] * _SLOTS
    for p, slot in enumerate(clamped):
        positions[slot] = p
    return torch.tensor(clamped), torch.tensor(positions)


_OFF_MISTAKES = {
    "too-large": lambda g: g.index_fill(0, torch.tensor([4]), 2**40),
    "negative": lambda g: g.index_fill(0, torch.tensor([2, 9]), -1),
    "repeated": lambda g: g.index_fill(0, torch.tensor([4]), int(g[5])),
}


@pytest.mark.parametrize("mistake", list(_OFF_MISTAKES))
@pytest.mark.parametrize("backend", ["numba", TRITON_ON_CPU])
def test_moe_off_level_keeps_a_broken_promise_in_bounds(backend, mistake):
    """No check and no read back; a bad value reads and writes inside every tensor, and gives
    what the docstrings say: permute gathers the rows of the clamped values (its gradient is
    exactly that gather's); unpermute takes, for each slot, the last row naming it (row 0
    when none does), weighted as that row's slot, by blocks (fp32) as in one pass
    (autograd)."""
    t = _moe_inputs()
    bad = _OFF_MISTAKES[mistake](t["gather_indices"])
    before = {name: t[name].clone() for name in ("x", "y", "weights")}
    bad_before = bad.clone()
    clamped, positions = _clamped_and_positions(bad)
    path = gpu_path() if backend == "triton" else detsum.backend(backend)
    guard = no_host_reads() if backend == "triton" else contextlib.nullcontext()
    with path, guard:
        x = t["x"].clone().requires_grad_()
        gathered = moe.permute(x, bad, _TOPK, mode="autograd", check="off")
        gathered.backward(t["y"])
        rows = moe.unpermute(t["y"], bad, _TOPK, reduce=False, check="off")
        combined = {mode: moe.unpermute(t["y"], bad, _TOPK, weights=t["weights"], mode=mode,
                                        check="off")
                    for mode in ("fp32", "autograd")}
    x_ref = t["x"].clone().requires_grad_()
    x_ref[clamped // _TOPK].backward(t["y"])
    assert_same_bits(gathered, t["x"][clamped // _TOPK])
    assert_same_bits(x.grad, x_ref.grad)
    assert_same_bits(rows, t["y"][positions])
    weighted = t["y"] * t["weights"].view(-1)[clamped].view(-1, 1)
    # fp32 rows and weights: "fp32" is the arithmetic of torch's sum over the slots.
    expected = weighted[positions].view(_TOKENS, _TOPK, _FEATURES).sum(1)
    for mode, got in combined.items():
        assert_same_bits(got, expected)
    for name, tensor in before.items():
        assert torch.equal(t[name], tensor), name
    assert torch.equal(bad, bad_before)


@pytest.mark.interpreter
@pytest.mark.parametrize("mistake", list(_OFF_MISTAKES))
def test_moe_off_level_backward_stays_in_bounds(mistake):
    """Backward of unpermute under "off" with a broken promise: each row p receives the
    gradient of the slot its clamped value names, without a read back or an error, by blocks
    and in one pass alike."""
    t = _moe_inputs()
    bad = _OFF_MISTAKES[mistake](t["gather_indices"])
    clamped, positions = _clamped_and_positions(bad)
    grad = torch.randn(_TOKENS, _FEATURES, generator=torch.Generator().manual_seed(3))
    gradients = {}
    with gpu_path(), no_host_reads():
        for mode in ("fp32", "autograd"):
            y, w = t["y"].clone().requires_grad_(), t["weights"].clone().requires_grad_()
            moe.unpermute(y, bad, _TOPK, weights=w, mode=mode, check="off").backward(grad)
            gradients[mode] = y.grad, w.grad
    tokens = clamped // _TOPK
    expected_y = grad[tokens] * t["weights"].view(-1)[clamped].view(-1, 1)
    expected_w = (grad[tokens] * t["y"]).sum(1)[positions].view(_TOKENS, _TOPK)
    for mode, (grad_y, grad_w) in gradients.items():
        assert_same_bits(grad_y, expected_y)
        # Each dot product sums in the mode's order ("fp32": in order; torch's sum here).
        torch.testing.assert_close(grad_w, expected_w, rtol=1e-6, atol=1e-6)


def test_moe_route_off_level_counts_no_expert_for_a_bad_id():
    selected = _moe_inputs()["selected"].clone()
    selected[1, 2], selected[4, 0] = -1, _EXPERTS
    with no_host_reads():
        gather_indices, tokens_per_expert = moe.route(selected, _EXPERTS, check="off")
    flat = selected.view(-1)
    assert torch.equal(gather_indices, torch.sort(flat, stable=True).indices)
    assert gather_indices[0] == 1 * _TOPK + 2 and gather_indices[-1] == 4 * _TOPK
    good = flat[(flat >= 0) & (flat < _EXPERTS)]
    assert torch.equal(tokens_per_expert, torch.bincount(good, minlength=_EXPERTS))
    assert int(tokens_per_expert.sum()) == _SLOTS - 2


@pytest.mark.parametrize("call", [
    lambda: moe.route(torch.tensor([[0, 1]]), 2, check="never"),
    lambda: moe.permute(torch.ones(2, 3), torch.tensor([1, 0]), 1, check="Host"),
    lambda: moe.unpermute(torch.ones(2, 3), torch.tensor([1, 0]), 1, check="bounds"),
], ids=["route", "permute", "unpermute"])
def test_moe_a_bad_level_is_refused(call):
    with pytest.raises(ValueError, match=r"^detsum\.moe\.\w+: check='\w+'; expected one of "
                                         r"'host', 'device', 'off' \(or True or False"):
        call()


def test_moe_a_level_of_another_type_is_refused():
    with pytest.raises(TypeError, match=r"^detsum\.moe\.permute: check=None; expected one of "
                                        r"'host', 'device', 'off'"):
        moe.permute(torch.ones(2, 3), torch.tensor([1, 0]), 1, check=None)


def test_moe_false_keeps_each_functions_old_meaning():
    """route(check=False): no check ("off"); permute(check=False): the bounds only, read back,
    a repeated value allowed; unpermute(check=False): the whole check ("host")."""
    t = _moe_inputs()
    selected = t["selected"].clone()
    selected[0, 0] = _EXPERTS
    assert int(moe.route(selected, _EXPERTS, check=False)[1].sum()) == _SLOTS - 1
    repeated = _bad_gather_indices("repeated")
    assert_same_bits(moe.permute(t["x"], repeated, _TOPK, check=False),
                     t["x"][repeated // _TOPK])
    with pytest.raises(IndexError, match=r"gather_indices\[4\] = 18 is out of range"):
        moe.permute(t["x"], _bad_gather_indices("out-of-range"), _TOPK, check=False)
    with pytest.raises(ValueError, match="more than once"):
        moe.unpermute(t["y"], repeated, _TOPK, check=False)


@pytest.mark.parametrize("check", ["host", pytest.param("device", marks=pytest.mark.interpreter),
                                   pytest.param("off", marks=pytest.mark.interpreter)])
def test_moe_compiled_fullgraph_gives_eager_bits(check):
    """route, permute and the weighted unpermute in one full graph, forward and backward, at
    every level: "host" too, whose reads run inside the operators. Under "device" and "off" the
    compiled call, run on the GPU's path, reads nothing back either."""
    torch._dynamo.reset()
    t = _moe_inputs(torch.bfloat16, torch.float32)

    def layer(selected, x, weights):
        gather_indices, _ = moe.route(selected, _EXPERTS, check=check)
        y = moe.permute(x, gather_indices, _TOPK, check=check)
        return moe.unpermute(y * 2, gather_indices, _TOPK, weights=weights, check=check)

    def run(function):
        x, w = t["x"].clone().requires_grad_(), t["weights"].clone().requires_grad_()
        out = function(t["selected"], x, w)
        out.backward(torch.ones_like(out))
        return out, x.grad, w.grad

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    expected = run(layer)
    for got, want in zip(run(compiled), expected, strict=True):
        assert_same_bits(got, want)
    if check != "host":
        with gpu_path(), no_host_reads():
            on_the_gpu_path = run(compiled)
        for got, want in zip(on_the_gpu_path, expected, strict=True):
            assert_same_bits(got, want)


def _moe_on_cuda(call):
    """A call of _MOE_CALLS on CUDA inputs at check="device": () -> [out, gradients], with its
    output gradient made on the device beforehand (a copy from the host synchronises)."""
    function, differentiable, mode, dtype, weights_dtype, keywords = _MOE_CALLS[call]
    inputs = {name: value.cuda() if isinstance(value, torch.Tensor) else value
              for name, value in _moe_inputs(dtype, weights_dtype).items()}
    grads = {}

    def run():
        leaves = {name: inputs[name].clone().requires_grad_() for name in differentiable}
        arguments = {name: leaves.get(name, inputs[name]) for name in inputs
                     if name != "grad_seed"}
        with unittest.mock.patch.object(moe, "_runs_in_token_blocks",
                                        lambda device, acc_mode: False) \
                if call.endswith("one-pass") else contextlib.nullcontext():
            out = function(arguments, "device", mode=mode, **keywords)
        if "out" not in grads:
            grads["out"] = torch.randn(out.shape, device=out.device).to(out.dtype)
        out.backward(grads["out"])
        return [out] + [leaves[name].grad for name in differentiable]
    return run


@pytest.mark.cuda
@pytest.mark.parametrize("call", list(_MOE_CALLS))
def test_moe_no_synchronisation_on_cuda(call):
    """torch's own detector of host synchronisations, on permute and unpermute forward and
    backward at check="device"."""
    run = _moe_on_cuda(call)
    expected = run()  # compile the kernels and make the output gradient first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for a, b in zip(got, expected, strict=True):
        assert_same_bits(a, b)


@pytest.mark.cuda
def test_moe_backward_cuda_graph_capture_and_replay():
    """An MoE layer's permute, expert and weighted unpermute, forward and backward at
    check="device", captured once and replayed: the eager bits."""
    t = {name: value.cuda() if isinstance(value, torch.Tensor) else value
         for name, value in _moe_inputs(torch.bfloat16, torch.float32).items()}
    grad_out = torch.randn(_TOKENS, _FEATURES, device="cuda")

    def step(x, weights):
        x_leaf, w_leaf = x.detach().requires_grad_(True), weights.detach().requires_grad_(True)
        rows = moe.permute(x_leaf, t["gather_indices"], _TOPK, check="device")
        out = moe.unpermute(rows * 2, t["gather_indices"], _TOPK, weights=w_leaf,
                            check="device")
        out.backward(grad_out)
        return out, x_leaf.grad, w_leaf.grad

    expected = step(t["x"], t["weights"])
    static_x, static_w = t["x"].clone(), t["weights"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(static_x, static_w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static_x, static_w)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected, strict=True):
        assert_same_bits(got, want)
