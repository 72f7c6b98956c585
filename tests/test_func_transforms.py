"""torch.func through detsum: grad, vjp and jacrev give eager autograd's bits through every
primitive and consumer, vmap runs them per sample, and what cannot work is refused in detsum's
words: forward mode (jvp, jacfwd, torch.autograd.forward_ad), state kept across calls
(RunningSum, GradAccumulator), functions that run autograd themselves (per_sample_grads,
batch_grad), and explain under vmap.

Before: torch 2.13 refused grad, vjp and jacrev through any detsum operator ("must override the
setup_context staticmethod", naming neither detsum nor the operator), and jacfwd and forward_ad
silently gave a zero (or no) tangent."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap

import detsum
from conftest import MODE_REDUCTIONS, MODES, assert_same_bits, make_data
from detsum import loss, moe

# bf16: every sum in a backward rounds, so a gradient summed in another order or mode than
# eager autograd's would show in the bits.
DTYPE = torch.bfloat16
MOE_MODES = ("fp32", "kahan", "autograd")
ORDERED_MODES = ("fp32", "kahan", "exact")

_X = make_data((4, 3), DTYPE, seed=1)
_SRC = make_data((6, 3), DTYPE, seed=2)
_INDEX = torch.tensor([3, 0, 0, 2, 3, 3])
_ELEMENT_INDEX = torch.tensor([[3, 0, 1], [0, 0, 2], [1, 3, 3], [2, 2, 0], [3, 1, 1], [0, 3, 2]])
_OFFSETS = torch.tensor([0, 2, 2, 6])
_PERM = torch.tensor([5, 1, 0, 3, 2, 4])
_GATHER, _ = moe.route(torch.tensor([[1, 0], [1, 2], [0, 2]]), 3)
_WEIGHTS = make_data((3, 2), torch.float32, seed=4).abs()


def _primitive_cases():
    """(id, function of the differentiable tensors, those tensors, the mode it takes)."""
    cases = []
    for mode in MODES:
        cases += [
            (f"index_add-{mode}",
             lambda x, s, m=mode: detsum.index_add(x, 0, _INDEX, s, alpha=0.5, mode=m),
             (_X, _SRC)),
            (f"index_add_-{mode}",
             lambda x, s, m=mode: detsum.index_add_(x * 1, 0, _INDEX, s, mode=m), (_X, _SRC)),
            (f"segment_sum-{mode}",
             lambda s, m=mode: detsum.segment_sum(s, _OFFSETS, mode=m), (_SRC,)),
            # perm: the backward runs detsum.index_add, which must reach the transform too.
            (f"segment_sum_perm-{mode}",
             lambda s, m=mode: detsum.segment_sum(s, _OFFSETS, perm=_PERM, mode=m), (_SRC,)),
        ]
    for mode, reduce in MODE_REDUCTIONS:
        for include_self in (True, False):
            cases.append((
                f"scatter_reduce-{reduce}-{mode}-self{int(include_self)}",
                lambda x, s, r=reduce, m=mode, i=include_self: detsum.scatter_reduce(
                    x, 0, _INDEX, s, r, include_self=i, mode=m), (_X, _SRC)))
        cases.append((
            f"scatter_reduce-element-{reduce}-{mode}",
            lambda x, s, r=reduce, m=mode: detsum.scatter_reduce(x, 0, _ELEMENT_INDEX, s, r,
                                                                 mode=m), (_X, _SRC)))
    return cases


def _consumer_cases():
    cases = []
    for mode in MOE_MODES:
        cases += [
            (f"moe.permute-{mode}", lambda x, m=mode: moe.permute(x, _GATHER, 2, mode=m),
             (_X[:3],)),
            (f"moe.unpermute-{mode}",
             lambda y, m=mode: moe.unpermute(y, _GATHER, 2, mode=m), (_SRC,)),
            (f"moe.unpermute_unreduced-{mode}",
             lambda y, m=mode: moe.unpermute(y, _GATHER, 2, reduce=False, mode=m), (_SRC,)),
            # bf16 rows, fp32 weights: the fp32/kahan backward runs its blocked operator.
            (f"moe.unpermute_weighted-{mode}",
             lambda y, w, m=mode: moe.unpermute(y, _GATHER, 2, weights=w, mode=m),
             (_SRC, _WEIGHTS)),
        ]
    for mode in ORDERED_MODES:
        cases += [
            (f"loss.reduce_mean-{mode}", lambda v, m=mode: loss.reduce(v, mode=m), (_SRC,)),
            (f"loss.reduce_sum_weighted-{mode}",
             lambda v, w, m=mode: loss.reduce(v, "sum", weight=w, mode=m),
             (_SRC, _SRC.abs())),
            (f"loss.reduce_mean_weighted-{mode}",
             lambda v, w, m=mode: loss.reduce(v, weight=w, mode=m), (_SRC, _SRC.abs())),
        ]
    for mode in MODES:
        for reduce in ("sum", "mean", "mul", "min", "max"):
            if (mode, reduce) == ("exact", "mul"):
                continue
            cases.append((f"scatter-{reduce}-{mode}",
                          lambda s, r=reduce, m=mode: detsum.scatter(s, _INDEX, 0, reduce=r,
                                                                     mode=m), (_SRC,)))
        cases += [
            (f"scatter_max_out-{mode}",
             lambda s, out, m=mode: detsum.scatter_max(s, _INDEX, 0, out * 1, mode=m)[0],
             (_SRC, _X)),
            (f"segment_csr-{mode}",
             lambda s, m=mode: detsum.segment_csr(s, _OFFSETS, mode=m), (_SRC,)),
            (f"segment_coo_max-{mode}",
             lambda s, m=mode: detsum.segment_coo(s, _INDEX.sort().values, reduce="max",
                                                  mode=m), (_SRC,)),
            (f"gather_csr-{mode}",
             lambda s, m=mode: detsum.gather_csr(s, _OFFSETS, mode=m), (_X[:3],)),
            (f"index_select-{mode}",
             lambda s, m=mode: detsum.index_select(s, 0, _INDEX, mode=m), (_X,)),
            (f"scatter_softmax-{mode}",
             lambda s, m=mode: detsum.scatter_softmax(s, _INDEX, 0, mode=m), (_SRC,)),
            (f"scatter_logsumexp-{mode}",
             lambda s, m=mode: detsum.scatter_logsumexp(s, _INDEX, 0, mode=m), (_SRC,)),
            (f"scatter_std-{mode}",
             lambda s, m=mode: detsum.scatter_std(s, _INDEX, 0, mode=m), (_SRC,)),
        ]
    return cases


CASES = [pytest.param(fn, args, id=name)
         for name, fn, args in _primitive_cases() + _consumer_cases()]


def _leaves(args):
    return [a.detach().clone().requires_grad_() for a in args]


def _argnums(args):
    return tuple(range(len(args)))


def _cotangent(fn, args):
    out = fn(*args)
    return make_data(out.shape, out.dtype, seed=7)


@pytest.mark.parametrize("fn,args", CASES)
def test_vjp_gives_eager_autograd_bits(fn, args):
    cotangent = _cotangent(fn, args)
    leaves = _leaves(args)
    eager_out = fn(*leaves)
    eager = torch.autograd.grad(eager_out, leaves, cotangent)
    out, pullback = vjp(fn, *args)
    assert_same_bits(out, eager_out.detach())
    for transformed, expected in zip(pullback(cotangent), eager):
        assert_same_bits(transformed, expected)


@pytest.mark.parametrize("fn,args", CASES)
def test_grad_gives_eager_autograd_bits(fn, args):
    cotangent = _cotangent(fn, args)

    def scalar(*a):
        return (fn(*a) * cotangent).sum()

    leaves = _leaves(args)
    eager = torch.autograd.grad(scalar(*leaves), leaves)
    for transformed, expected in zip(grad(scalar, argnums=_argnums(args))(*args), eager):
        assert_same_bits(transformed, expected)


@pytest.mark.parametrize("fn,args", CASES)
def test_jacrev_gives_eager_autograd_bits(fn, args):
    """Row by row, the Jacobian of eager autograd: one backward per output element."""
    leaves = _leaves(args)
    out = fn(*leaves)
    rows = [torch.autograd.grad(out, leaves, basis.view_as(out), retain_graph=True,
                                materialize_grads=True)
            for basis in torch.eye(out.numel(), dtype=out.dtype)]
    jacobian = jacrev(fn, argnums=_argnums(args))(*args)
    for i, leaf in enumerate(leaves):
        expected = torch.stack([row[i] for row in rows]).view(out.shape + leaf.shape)
        assert_same_bits(jacobian[i], expected)


@pytest.mark.parametrize("fn,args", CASES)
def test_vmap_of_grad_gives_each_samples_gradient(fn, args):
    """Per-sample gradients: vmap over grad gives each sample's eager gradient, bit for bit."""
    batch = [torch.stack([a, make_data(a.shape, a.dtype, seed=11)]) for a in args]
    cotangent = _cotangent(fn, args)

    def scalar(*a):
        return (fn(*a) * cotangent).sum()

    per_sample = vmap(grad(scalar, argnums=_argnums(args)))(*batch)
    for b in range(2):
        leaves = _leaves([a[b] for a in batch])
        for transformed, expected in zip(per_sample,
                                         torch.autograd.grad(scalar(*leaves), leaves)):
            assert_same_bits(transformed[b], expected)


# ---- higher order, modules ---------------------------------------------------------------------

SECOND_ORDER = [
    pytest.param(lambda s: detsum.segment_sum(s.square(), _OFFSETS, perm=_PERM, mode="kahan"),
                 id="segment_sum_perm"),
    pytest.param(lambda s: detsum.scatter_reduce(_X.double(), 0, _INDEX, s, "prod", mode="fp32"),
                 id="scatter_reduce_prod"),
    pytest.param(lambda s: detsum.index_add(_X.double(), 0, _INDEX, s.exp(), mode="autograd"),
                 id="index_add"),
    pytest.param(lambda s: detsum.scatter_max(s.square(), _INDEX, 0)[0], id="scatter_max"),
]


@pytest.mark.parametrize("fn", SECOND_ORDER)
def test_second_derivatives_give_eager_double_backward_bits(fn):
    """A Hessian-vector product by vjp over grad: eager's double backward (create_graph)."""
    src = _SRC.double()
    cotangent = make_data(fn(src).shape, torch.float64, seed=5)
    direction = make_data(src.shape, torch.float64, seed=6)

    def scalar(s):
        return (fn(s) * cotangent).sum()

    leaf = src.clone().requires_grad_()
    (first,) = torch.autograd.grad(scalar(leaf), leaf, create_graph=True)
    (expected,) = torch.autograd.grad(first, leaf, direction)
    _, pullback = vjp(grad(scalar), src)
    assert_same_bits(pullback(direction)[0], expected)


def test_weighted_unpermute_refuses_second_derivatives_in_detsum_words():
    """The blocked weighted backward (CPU, fp32) has no derivative of its own: refused, eagerly
    and under torch.func, naming the function (before: torch's words about its operator)."""
    def scalar(w):
        return moe.unpermute(_SRC, _GATHER, 2, weights=w).square().sum()

    words = "detsum.moe.unpermute: a second derivative"
    leaf = _WEIGHTS.clone().requires_grad_()
    (first,) = torch.autograd.grad(scalar(leaf), leaf, create_graph=True)
    with pytest.raises(NotImplementedError, match=words):
        torch.autograd.grad(first.sum(), leaf)
    with pytest.raises(NotImplementedError, match=words):
        vjp(grad(scalar), _WEIGHTS)[1](torch.ones_like(_WEIGHTS))


class _MessagePassing(torch.nn.Module):
    """A linear layer, then each node sums its incoming edges' messages with detsum."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3, dtype=DTYPE)

    def forward(self, x):
        messages = self.linear(x).index_select(0, _INDEX)
        return detsum.index_add(torch.zeros_like(x), 0, torch.tensor([0, 1, 2, 3, 0, 1]),
                                messages, mode="kahan")


def test_functional_call_grad_gives_eager_parameter_gradients():
    torch.manual_seed(0)
    model = _MessagePassing()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of(p):
        return functional_call(model, p, (_X,)).square().sum()

    eager = torch.autograd.grad(model(_X).square().sum(), list(model.parameters()))
    transformed = grad(loss_of)(params)
    for (name, _), expected in zip(model.named_parameters(), eager):
        assert_same_bits(transformed[name], expected)


# ---- vmap ----------------------------------------------------------------------------------------

VMAPPED = [
    pytest.param(lambda x, s: detsum.index_add_(x * 1, 0, _INDEX, s), id="index_add_"),
    pytest.param(lambda x, s: detsum.scatter_logsumexp(s, _INDEX, 0), id="scatter_logsumexp"),
    pytest.param(lambda x, s: detsum.scatter_max(s, _INDEX, 0)[0], id="scatter_max"),
    pytest.param(lambda x, s: loss.reduce(s, mode="exact"), id="loss.reduce_exact"),
    pytest.param(lambda x, s: moe.unpermute(s, _GATHER, 2, weights=_WEIGHTS), id="unpermute"),
]


@pytest.mark.parametrize("fn", VMAPPED)
def test_vmap_gives_each_samples_bits(fn):
    """Before: the in-place index_add_ had no batching rule, and scatter_logsumexp wrote into a
    buffer of its own, scatter_max and the exact loss reduction were refused."""
    xs = torch.stack([_X, make_data(_X.shape, DTYPE, seed=12)])
    srcs = torch.stack([_SRC, make_data(_SRC.shape, DTYPE, seed=13)])
    batched = vmap(fn)(xs, srcs)
    for b in range(2):
        assert_same_bits(batched[b], fn(xs[b], srcs[b]))


# ---- refusals ------------------------------------------------------------------------------------

FORWARD_MODE = [
    pytest.param(lambda s: detsum.index_add(_X, 0, _INDEX, s), "detsum.index_add", id="index_add"),
    pytest.param(lambda s: detsum.index_add_(_X * 1, 0, _INDEX, s), "detsum.index_add_",
                 id="index_add_"),
    pytest.param(lambda s: detsum.segment_sum(s, _OFFSETS), "detsum.segment_sum",
                 id="segment_sum"),
    pytest.param(lambda s: detsum.scatter_reduce(_X, 0, _INDEX, s, "amax"),
                 "detsum.scatter_reduce", id="scatter_reduce"),
    pytest.param(lambda s: moe.unpermute(s, _GATHER, 2), "detsum.moe.unpermute", id="unpermute"),
    pytest.param(lambda s: moe.permute(s[:3], _GATHER, 2), "detsum.moe.permute", id="permute"),
    pytest.param(lambda s: loss.reduce(s, mode="exact"), "detsum.loss.reduce",
                 id="loss.reduce_exact"),
    pytest.param(lambda s: loss.reduce(s, mode="kahan"), "detsum.loss.reduce", id="loss.reduce"),
    pytest.param(lambda s: detsum.scatter_max(s, _INDEX, 0)[0], "detsum.scatter_max",
                 id="scatter_max"),
]


@pytest.mark.parametrize("fn,caller", FORWARD_MODE)
@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "forward_ad"])
def test_forward_mode_is_refused_in_detsum_words(fn, caller, transform):
    """Before: torch.func.jvp and jacfwd gave a zero tangent, forward_ad none, without a word."""
    words = f"{caller}: forward-mode differentiation"
    with pytest.raises(NotImplementedError, match=words):
        if transform == "jvp":
            jvp(fn, (_SRC,), (torch.ones_like(_SRC),))
        elif transform == "jacfwd":
            jacfwd(fn)(_SRC)
        else:
            with fwAD.dual_level():
                fn(fwAD.make_dual(_SRC, torch.ones_like(_SRC)))


def test_forward_mode_leaves_the_in_place_target_untouched():
    target = _X.clone()
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="detsum.index_add_"):
        detsum.index_add_(target, 0, _INDEX, fwAD.make_dual(_SRC, torch.ones_like(_SRC)))
    assert_same_bits(target, _X)


def test_forward_mode_without_tangents_computes_as_eager():
    """An open forward-mode level alone refuses nothing: only a tangent that reaches detsum."""
    with fwAD.dual_level():
        out = detsum.index_add(_X, 0, _INDEX, _SRC, mode="kahan")
    assert_same_bits(out, detsum.index_add(_X, 0, _INDEX, _SRC, mode="kahan"))


def _running_sum(rows):
    running = detsum.RunningSum((3,), dtype=DTYPE)
    running.add(rows)
    return running.sum()


def _accumulated(rows):
    accumulator = loss.GradAccumulator([("w", torch.zeros(3, dtype=DTYPE, requires_grad=True))])
    accumulator.add({"w": rows})
    return accumulator.result()["w"]


_MODEL = torch.nn.Linear(3, 2, dtype=DTYPE)
_TARGETS = torch.tensor([0, 1, 1, 0, 1, 0])
_LOSS = torch.nn.CrossEntropyLoss(reduction="none")

STATEFUL = [
    pytest.param(_running_sum, "detsum.RunningSum.add: rows is a tensor of a torch.func",
                 id="RunningSum.add"),
    pytest.param(_accumulated, r"detsum.loss.GradAccumulator.add: per_sample_grads\['w'\] is a "
                 "tensor of a torch.func", id="GradAccumulator.add"),
    pytest.param(lambda x: loss.per_sample_grads(_MODEL, _LOSS, x, _TARGETS)["weight"],
                 "detsum.loss.per_sample_grads: called inside a torch.func transform",
                 id="per_sample_grads"),
    pytest.param(lambda x: loss.batch_grad(_MODEL, _LOSS, x, _TARGETS)["weight"],
                 "detsum.loss.batch_grad: called inside a torch.func transform",
                 id="batch_grad"),
]


@pytest.mark.parametrize("fn,words", STATEFUL)
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap", "forward_ad"])
def test_state_and_own_autograd_are_refused_in_detsum_words(fn, words, transform):
    """Before: torch's "Cannot access data pointer" or its requires_grad_() refusal."""
    with pytest.raises(RuntimeError, match=words):
        if transform == "grad":
            grad(lambda r: fn(r).float().sum())(_SRC)
        elif transform == "jacrev":
            jacrev(fn)(_SRC)
        elif transform == "vmap":
            vmap(fn)(torch.stack([_SRC, _SRC]))
        else:
            with fwAD.dual_level():
                fn(fwAD.make_dual(_SRC, torch.ones_like(_SRC)))


def test_load_state_refuses_a_batched_state_and_keeps_its_own():
    running = detsum.RunningSum((3,), mode="exact")
    running.add(_SRC.float())
    before = running.state()
    states = torch.stack([before, before])
    with pytest.raises(RuntimeError, match="detsum.RunningSum.load_state: state is a tensor"):
        vmap(lambda state: running.load_state(state) or state)(states)
    assert torch.equal(running.state(), before)


def test_explain_refuses_vmap_in_detsum_words():
    """Before: torch's "Batching rule not implemented for aten::equal". Under grad it still
    compares the values."""
    with pytest.raises(RuntimeError, match="detsum.explain: a is a tensor of torch.func.vmap"):
        vmap(lambda a: torch.tensor(detsum.explain(a, a).max_abs))(torch.stack([_SRC, _SRC]))
    seen = []
    grad(lambda s: seen.append(detsum.explain(s, s).verdict) or s.float().sum())(_SRC)
    assert seen == ["identical"]


# ---- torch.compile -------------------------------------------------------------------------------

def test_compile_runs_a_transform_eagerly_or_refuses_it_under_fullgraph():
    """torch 2.13 cannot trace detsum's operators under torch.func inside torch.compile: with
    graph breaks allowed, dynamo runs the transform eagerly (eager's bits); with
    fullgraph=True the refusal names the function."""
    def step(s):
        return grad(lambda t: detsum.index_add(_X, 0, _INDEX, t, mode="kahan").square().sum()
                    .float())(s)

    torch._dynamo.reset()
    assert_same_bits(torch.compile(step, backend="aot_eager")(_SRC), step(_SRC))
    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:
        torch.compile(step, backend="aot_eager", fullgraph=True)(_SRC)
    assert "detsum.index_add: a torch.func transform inside torch.compile" in str(raised.value)


# ---- a process group ----------------------------------------------------------------------------

def test_reduce_over_a_group_gives_eager_gradients_and_per_sample_sums():
    """loss.reduce(group=...) runs its collective inside the transform: one rank of gloo here
    (tests/test_distributed.py checks the sums over several ranks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        for fn, args in [
            (lambda v: loss.reduce(v, mode="exact", group=group), (_SRC,)),
            (lambda v, w: loss.reduce(v, weight=w, mode="exact", group=group),
             (_SRC, _SRC.abs())),
        ]:
            cotangent = _cotangent(fn, args)
            leaves = _leaves(args)
            eager = torch.autograd.grad(fn(*leaves), leaves, cotangent)
            for transformed, expected in zip(vjp(fn, *args)[1](cotangent), eager):
                assert_same_bits(transformed, expected)
        samples = torch.stack([_SRC, make_data(_SRC.shape, DTYPE, seed=14)])
        batched = vmap(lambda v: loss.reduce(v, mode="exact", group=group))(samples)
        for b in range(2):
            assert_same_bits(batched[b], loss.reduce(samples[b], mode="exact", group=group))
    finally:
        dist.destroy_process_group()
