"""detsum.enable / disable / deterministic: torch's own accumulating ops on detsum's primitives.

"autograd" is checked against torch itself (CPU torch is deterministic: its bits are the ones
``torch.use_deterministic_algorithms(True)`` gives), on torch's own OpInfo samples and on
duplicate-heavy indices; the other modes against detsum's primitive called directly, over runs
and thread counts, and "exact" against Fraction sums.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import subprocess
import sys
import threading
from fractions import Fraction

import pytest
import torch

import detsum
from detsum import _segments, measure, switch
from detsum.kernels import CHUNK_TERMS
from detsum.kernels.numba import small as small_kernels
from tests.conftest import assert_same_bits, record_answers

# torch's own index_reduce says it is in beta, every time torch's kernel runs it.
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta:UserWarning")

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SWITCHED = ("index_add", "index_add_", "index_add.out", "scatter_add", "scatter_add_",
            "scatter_add.out", "scatter_reduce.two", "scatter_reduce_.two",
            "scatter_reduce.two_out", "index_reduce", "index_reduce_", "index_reduce.out",
            "_index_put_impl_", "put_", "bincount", "embedding_dense_backward",
            "_embedding_bag_dense_backward", "segment_reduce", "histc", "histc.out")


@pytest.fixture(autouse=True)
def switched_off_after():
    yield
    switch._blocks.clear()
    detsum.disable()
    assert switch.current_mode() is None


def cpu_kernel_file(name: str) -> str:
    """Where the CPU kernel the dispatcher runs for aten::``name`` was registered."""
    table = torch._C._dispatch_dump_table(f"aten::{name}").splitlines()
    return next(line for line in table if line.startswith("CPU:"))


def ran_on_detsum(name: str) -> int:
    return switch.counts[(name, "detsum")]


# ---- torch's own samples ----------------------------------------------------------------------

@functools.cache
def op_infos():
    from torch.testing._internal.common_methods_invocations import op_db

    return {(op.name, op.variant_test_name): op for op in op_db}


def samples(name, variant, dtype, requires_grad=False, device="cpu"):
    op = op_infos()[(name, variant)]
    return op, list(op.sample_inputs(device, dtype, requires_grad=requires_grad))


FORWARD_OPS = [("index_add", ""), ("scatter_add", ""), ("index_put", ""), ("put", "")] + [
    ("scatter_reduce", r) for r in ("sum", "mean", "prod", "amax", "amin")] + [
    ("index_reduce", r) for r in ("prod", "mean", "amax", "amin")]


def call(op, sample, name):
    """The sample's call; index_put and put with accumulate=True (the switched form)."""
    args, kwargs = sample.args, dict(sample.kwargs)
    if name == "put":
        args = (*args[:2], True)
    if name == "index_put":
        kwargs["accumulate"] = True
    return op(sample.input, *args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,variant", FORWARD_OPS)
def test_opinfo_samples_autograd_mode_gives_torchs_bits(name, variant, dtype):
    op, cases = samples(name, variant, dtype)
    before = switch.counts.copy()
    for sample in cases:
        expected = call(op, sample, name)
        with detsum.deterministic("autograd"):
            actual = call(op, sample, name)
        assert_same_bits(actual, expected)
    ran = switch.counts - before
    assert sum(ran.values()) >= len(cases)  # every sample met a switched kernel
    if dtype in (torch.float32, torch.float64):
        assert any(way == "detsum" for _, way in ran), ran


BACKWARD_OPS = [("__getitem__", ""), ("gather", ""), ("index_select", ""),
                ("take_along_dim", ""), ("nn.functional.embedding", "")]


# torch_geometric, once imported (other test files do), replaces torch.index_select with a
# wrapper that refuses the 0-d inputs torch takes: these samples call torch's operator.
ATEN_OPERATORS = {"index_select": torch.ops.aten.index_select}


def gradients(name, op, sample, seed):
    out = ATEN_OPERATORS.get(name, op)(sample.input, *sample.args, **sample.kwargs)
    inputs = [t for t in (sample.input, *sample.args) if isinstance(t, torch.Tensor)
              and t.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(out.shape, generator=generator).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,variant", BACKWARD_OPS)
def test_opinfo_backward_autograd_mode_gives_torchs_bits(name, variant, dtype):
    op, cases = samples(name, variant, dtype, requires_grad=True)
    for seed, sample in enumerate(cases):
        expected = gradients(name, op, sample, seed)
        with detsum.deterministic("autograd"):
            actual = gradients(name, op, sample, seed)
        for a, e in zip(actual, expected):
            assert_same_bits(a, e)


# ---- torch's own samples on CUDA: against torch's deterministic mode ------------------------

def _deterministic_or_refused(compute, sample):
    """``compute()`` under ``use_deterministic_algorithms(True)``, or None where torch refuses
    it there (no deterministic CUDA kernel).

    Torch 2.11's deterministic CUDA path (accumulating ``index_put_``) raises IndexError on a
    0-dim input; such a sample adds one term to its one element, so torch's default kernel has
    no order to choose and its result is the reference."""
    torch.use_deterministic_algorithms(True)
    try:
        return compute()
    except RuntimeError as error:
        if "deterministic" not in str(error):
            raise
        return None
    except IndexError:
        if sample.input.dim() != 0:
            raise
    finally:
        torch.use_deterministic_algorithms(False)
    return compute()


def _switched(compute, mode):
    """(``compute()`` under the switch in ``mode``, whether every switched operator it reached
    ran on detsum): one that went to torch's own kernel has torch's bits, which on CUDA may be
    its atomics'."""
    before = switch.counts.copy()
    with detsum.deterministic(mode):
        result = compute()
    return result, all(how == "detsum" for _, how in switch.counts - before)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,variant", FORWARD_OPS)
def test_opinfo_samples_on_cuda_autograd_mode_gives_torchs_deterministic_bits(name, variant,
                                                                            dtype):
    """Each CUDA sample in "autograd" mode, on detsum or left to torch (which then runs under
    its deterministic mode), against torch under ``use_deterministic_algorithms(True)`` (the
    samples torch refuses there skipped); in every mode, a second run of a sample on detsum
    gives the first's bits."""
    op, cases = samples(name, variant, dtype, device="cuda")
    for sample in cases:
        expected = _deterministic_or_refused(lambda: call(op, sample, name), sample)
        actual, _ = _switched(lambda: call(op, sample, name), "autograd")
        if expected is not None:
            assert_same_bits(actual.cpu(), expected.cpu())
        for mode in detsum.MODES:
            if mode == "exact" and "prod" in (name, variant):
                continue  # "exact" has no product: torch's own kernel runs it
            first, on_detsum = _switched(lambda: call(op, sample, name), mode)
            if on_detsum:
                assert_same_bits(_switched(lambda: call(op, sample, name), mode)[0].cpu(),
                                 first.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,variant", BACKWARD_OPS)
def test_opinfo_backward_on_cuda_autograd_mode_gives_torchs_deterministic_bits(name, variant,
                                                                             dtype):
    op, cases = samples(name, variant, dtype, requires_grad=True, device="cuda")
    for seed, sample in enumerate(cases):
        expected = _deterministic_or_refused(lambda: gradients(name, op, sample, seed), sample)
        actual, _ = _switched(lambda: gradients(name, op, sample, seed), "autograd")
        if expected is not None:
            for a, e in zip(actual, expected):
                assert_same_bits(a.cpu(), e.cpu())


# ---- duplicate-heavy indices, every form ------------------------------------------------------

def data(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def hot_index(n, rows, seed):
    """Most terms on row 0 (more than a 256-term chunk), the rest spread."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (n,), generator=generator)
    index[torch.rand(n, generator=generator) < 0.7] = 0
    return index


def forms(dtype, seed=0):
    """(name, function of nothing) for each call form of the switched ops."""
    x = data((7, 5), dtype, seed)
    src = data((600, 5), dtype, seed + 1)
    index = hot_index(600, 7, seed + 2)
    wide = index.view(-1, 1).expand(600, 5)
    scattered = hot_index(3000, 7, seed + 3).view(600, 5)
    xt = data((5, 7), dtype, seed + 4).t()  # a non-contiguous input
    cases = {
        "index_add": lambda: x.index_add(0, index, src),
        "index_add_dim-1": lambda: x.t().index_add(-1, index, src.t()),
        "index_add_int32": lambda: x.index_add(0, index.int(), src),
        "index_add_alpha": lambda: x.index_add(0, index, src, alpha=0.5),
        "index_add_": lambda: x.clone().index_add_(0, index, src),
        "index_add_noncontiguous": lambda: xt.clone().t().t().index_add_(0, index, src),
        "index_add_out": lambda: torch.index_add(x, 0, index, src, out=torch.empty_like(x)),
        "index_add_out_self": lambda: (lambda y: torch.index_add(y, 0, index, src, out=y))(
            x.clone()),
        "scatter_add": lambda: x.scatter_add(0, wide, src),
        "scatter_add_elements": lambda: x.scatter_add(0, scattered, src),
        "scatter_add_int32": lambda: x.scatter_add(0, scattered.int(), src),
        "scatter_add_": lambda: xt.clone().scatter_add_(0, scattered, src),
        "scatter_add_out": lambda: torch.scatter_add(x, 0, wide, src, out=torch.empty_like(x)),
        "scatter_reduce_out": lambda: torch.scatter_reduce(
            x, 0, scattered, src, "amax", out=torch.empty_like(x)),
        "scatter_add_small_index": lambda: x.scatter_add(0, scattered[:300], src),
        "index_put": lambda: x.index_put((index,), src, accumulate=True),
        "index_put_dim1": lambda: torch.ops.aten.index_put(x.t(), [None, index], src.t(), True),
        "index_put_2d_index": lambda: x.index_put((index.view(20, 30),), src.view(20, 30, 5),
                                                  accumulate=True),
        "index_put_broadcast": lambda: x.index_put((index,), src[0], accumulate=True),
        "index_put_negative": lambda: x.index_put((index - 7,), src, accumulate=True),
        "index_put_": lambda: x.clone().index_put_((index,), src, accumulate=True),
        "bincount": lambda: torch.bincount(index, src[:, 0]),
        "bincount_minlength": lambda: torch.bincount(index.int(), src[:, 1], minlength=9),
        "put_": lambda: x.clone().put_(hot_index(3000, 35, seed + 5), src, accumulate=True),
        "put_negative_noncontiguous": lambda: xt.clone().put_(
            hot_index(3000, 35, seed + 6) - 35, src, accumulate=True),
    }
    for reduce in ("prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            key = f"index_reduce_{reduce}_{include_self}"
            cases[key] = functools.partial(torch.index_reduce, x, 0, index, src, reduce,
                                           include_self=include_self)
            cases[key + "_"] = functools.partial(
                lambda r, s: xt.clone().index_reduce_(0, index, src, r, include_self=s),
                reduce, include_self)
    cases["index_reduce_out"] = lambda: torch.index_reduce(x, 0, index, src, "amin",
                                                           out=torch.empty_like(x))
    # A hot segment of 420 rows (past a 256-term chunk), an empty one, batches along dim 0.
    lengths = torch.tensor([420, 0, 100, 80])
    for reduce in ("sum", "mean", "max", "min", "prod"):
        terms = 1 + src / 64 if reduce == "prod" else src
        cases[f"segment_reduce_{reduce}"] = functools.partial(
            torch.segment_reduce, terms, reduce, lengths=lengths)
        cases[f"segment_reduce_{reduce}_initial"] = functools.partial(
            torch.segment_reduce, terms, reduce, lengths=lengths, initial=2)
    cases["segment_reduce_offsets_axis1"] = lambda: torch.segment_reduce(
        src.t(), "mean", offsets=torch.tensor([[3, 423, 423, 600]]).expand(5, 4), axis=1)
    cases["segment_reduce_unsafe"] = lambda: torch.segment_reduce(
        src, "sum", lengths=torch.tensor([420, 0, 100]), unsafe=True)
    # Bins of at most 256 counts: every dtype holds them exactly (see the histc tests).
    cases["histc"] = lambda: torch.histc(src[:, 0], bins=10)
    cases["histc_range"] = lambda: torch.histc(src[:, 1], bins=7, min=-1.5, max=2)
    cases["histc_out"] = lambda: torch.histc(src[:, 2], bins=5, min=-1, max=1,
                                             out=torch.empty(5, dtype=dtype))
    for reduce in ("sum", "mean", "prod", "amax", "amin"):
        for include_self in (True, False):
            key = f"scatter_reduce_{reduce}_{include_self}"
            cases[key] = functools.partial(torch.scatter_reduce, x, 0, scattered,
                                           src, reduce, include_self=include_self)
            cases[key + "_"] = functools.partial(
                lambda r, s: xt.clone().scatter_reduce_(0, wide, src, r, include_self=s),
                reduce, include_self)
    return cases


def index_backward(dtype, seed=0):
    weight = data((7, 5), dtype, seed).requires_grad_()
    index = hot_index(600, 7, seed + 1)
    grad = data((600, 5), dtype, seed + 2)
    return {
        "x[idx]": lambda: torch.autograd.grad(weight[index], weight, grad)[0],
        "gather": lambda: torch.autograd.grad(
            weight.gather(0, index.view(-1, 1).expand(600, 5)), weight, grad)[0],
        "index_select": lambda: torch.autograd.grad(weight.index_select(0, index), weight,
                                                    grad)[0],
        "embedding": lambda: torch.autograd.grad(
            torch.nn.functional.embedding(index, weight), weight, grad)[0],
        "embedding_padding": lambda: torch.autograd.grad(
            torch.nn.functional.embedding(index, weight, padding_idx=0), weight, grad)[0],
        **{f"embedding_bag_{mode}": functools.partial(embedding_bag_grad, weight, index, mode)
           for mode in ("sum", "mean", "max")},
        "embedding_bag_padding": lambda: embedding_bag_grad(weight, index, "mean",
                                                            padding_idx=0),
        "embedding_bag_per_sample_weights": lambda: embedding_bag_grad(
            weight, index, "sum", per_sample_weights=data(600, dtype, seed + 3)),
    }


BAG_OFFSETS = torch.tensor([0, 5, 5, 300, 310, 598])  # an empty bag, a long one


def embedding_bag_grad(weight, index, mode, **kwargs):
    """The weight's gradient through a dense embedding_bag of ``index`` in six bags."""
    out = torch.nn.functional.embedding_bag(index, weight, BAG_OFFSETS, mode=mode, **kwargs)
    grad = data(out.shape, weight.dtype, 7)
    return torch.autograd.grad(out, weight, grad)[0]


class DeterministicTorch:
    """torch's own deterministic mode, restored after."""

    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.was)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_duplicate_heavy_forms_autograd_mode_give_torchs_bits(dtype):
    cases = {**forms(dtype), **index_backward(dtype)}
    expected = {name: f() for name, f in cases.items()}
    with DeterministicTorch():
        for name, f in cases.items():
            assert_same_bits(f(), expected[name])
    with detsum.deterministic("autograd"):
        for name, f in cases.items():
            assert_same_bits(f(), expected[name])  # NaN too: an empty segment's mean


def test_autograd_mode_runs_detsum_where_it_reproduces_torch():
    """float32 data: every switched op runs on detsum, not torch (and still gives torch's bits,
    above)."""
    cases = {**forms(torch.float32), **index_backward(torch.float32)}
    with detsum.deterministic("autograd"):
        before = switch.counts.copy()
        for f in cases.values():
            f()
        ran = {name: switch.counts[(name, "detsum")] - before[(name, "detsum")]
               for name in SWITCHED}
    assert all(ran.values()), ran


def zero_tie_calls(dtype, width, include_self, signs):
    """(operator, call) for each amax/amin form of scatter_reduce and index_reduce on rows of
    ``width`` elements: 40 terms into 3 rows, zeros of the ``signs`` given (+0.0, -0.0 or
    both) among negative values, so that a zero is each element's maximum and ties."""
    generator = torch.Generator().manual_seed(width)
    zeros = torch.tensor([0.0 if sign > 0 else -0.0 for sign in signs])
    src = -torch.rand(40, width, generator=generator).to(dtype) - 1
    src[::2] = zeros[torch.arange(20) % len(zeros)].view(-1, 1).to(dtype)
    target = -torch.rand(3, width, generator=generator).to(dtype) - 1
    target[0] = zeros[-1]
    index = torch.arange(40) % 3
    wide = index.view(-1, 1).expand(40, width)
    # Each op with its index, and its operators: out of place, in place, out=.
    ops = (("scatter_reduce", wide,
            ("scatter_reduce.two", "scatter_reduce_.two", "scatter_reduce.two_out")),
           ("index_reduce", index, ("index_reduce", "index_reduce_", "index_reduce.out")))
    calls = []
    for reduce in ("amax", "amin"):
        terms = src if reduce == "amax" else -src
        base = target if reduce == "amax" else -target
        for op, rows, operators in ops:
            args = (0, rows, terms, reduce)
            calls += zip(operators, (
                functools.partial(getattr(torch, op), base, *args, include_self=include_self),
                lambda b=base, a=args, op=op: getattr(b.clone(), op + "_")(
                    *a, include_self=include_self),
                lambda b=base, a=args, op=op: getattr(torch, op)(
                    b, *a, include_self=include_self, out=torch.empty_like(b))))
    return calls


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("width", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_amax_and_amin_give_torchs_zero_ties(dtype, width, include_self):
    """torch's CPU kernels keep the earlier of a +0.0/-0.0 tie in their scalar loops and the
    later in their vector loops (index_reduce over rows of a vector's width or more, which
    the machine's vector width sets; scatter_reduce's dim-0 path for an index expanded over 16
    elements or more). "autograd" mode gives torch's bits by leaving a call whose values hold
    zeros of both signs to torch's kernel, and runs the same calls with zeros of one sign on
    detsum (no tie then has two answers)."""
    for signs, on_detsum in (((1, -1), False), ((1,), True), ((-1,), True)):
        for operator, call in zero_tie_calls(dtype, width, include_self, signs):
            expected = call()
            before = switch.counts.copy()
            with detsum.deterministic("autograd"):
                actual = call()
            took = switch.counts - before
            assert_same_bits(actual, expected)
            assert took == {(operator, "detsum" if on_detsum else "torch"): 1}, (
                operator, signs, took)


# ---- the other modes -------------------------------------------------------------------------

def primitive(mode, dtype, seed=0):
    """Each switched form next to the same reduction by detsum's primitive itself."""
    x = data((7, 5), dtype, seed)
    src = data((600, 5), dtype, seed + 1)
    index = hot_index(600, 7, seed + 2)
    scattered = hot_index(3000, 7, seed + 3).view(600, 5)
    weight = data((7, 5), dtype, seed).requires_grad_()
    zeros = torch.zeros(7, 5, dtype=dtype)
    return [
        (lambda: x.index_add(0, index, src, alpha=-2),
         lambda: detsum.index_add(x, 0, index, src, alpha=-2, mode=mode)),
        (lambda: x.clone().index_add_(1, index[:5], src[:7].t().contiguous().t()[:, :5]),
         lambda: detsum.index_add(x, 1, index[:5], src[:7, :5], mode=mode)),
        (lambda: x.scatter_add(0, scattered, src),
         lambda: detsum.scatter_reduce(x, 0, scattered, src, "sum", mode=mode)),
        (lambda: x.scatter_reduce(0, scattered, src, "mean", include_self=False),
         lambda: detsum.scatter_reduce(x, 0, scattered, src, "mean", include_self=False,
                                       mode=mode)),
        (lambda: x.index_reduce(0, index, src, "mean"),
         lambda: detsum.scatter_reduce(x, 0, index, src, "mean", mode=mode)),
        (lambda: torch.bincount(index, src[:, 0]),
         lambda: detsum.index_add(torch.zeros(7, dtype=torch.float32 if dtype == torch.float32
                                              else torch.float64),
                                  0, index, src[:, 0].to(torch.float32 if dtype == torch.float32
                                                         else torch.float64), mode=mode)),
        (lambda: x.clone().put_(index, src[:, 0], accumulate=True),
         lambda: detsum.index_add(x.reshape(-1), 0, index, src[:, 0], mode=mode).view(7, 5)),
        (lambda: torch.autograd.grad(weight[index], weight, src)[0],
         lambda: detsum.index_add(zeros, 0, index, src, mode=mode)),
        (lambda: torch.autograd.grad(torch.nn.functional.embedding(index, weight),
                                     weight, src)[0],
         lambda: detsum.index_add(zeros, 0, index, src, mode=mode)),
        *new_ops_primitive(mode, dtype, seed),
    ]


def new_ops_primitive(mode, dtype, seed=0):
    """embedding_bag's backward, segment_reduce and histc next to detsum's primitive."""
    src = data((600, 5), dtype, seed + 1)
    index = hot_index(600, 7, seed + 2)
    weight = data((7, 5), dtype, seed).requires_grad_()
    zeros = torch.zeros(7, 5, dtype=dtype)
    bag = torch.searchsorted(BAG_OFFSETS, torch.arange(600), right=True) - 1
    bag_grad = data((6, 5), dtype, 7)
    bag_size = torch.bincount(bag, minlength=6)
    scale = torch.where(bag_size != 0, 1.0 / bag_size.double(), 1.0).to(dtype)
    biggest = torch.ops.aten._embedding_bag(weight, index, BAG_OFFSETS, False, 2)[3]
    full = bag_size != 0
    lengths = torch.tensor([420, 0, 100, 80])
    segment = torch.repeat_interleave(torch.arange(4), lengths)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    centres = (torch.arange(3000) % 10 + 0.5).to(dtype)  # one value in the middle of each bin
    return [
        (lambda: embedding_bag_grad(weight, index, "sum"),
         lambda: detsum.index_add(zeros, 0, index, bag_grad[bag], mode=mode)),
        (lambda: embedding_bag_grad(weight, index, "mean"),
         lambda: detsum.index_add(zeros, 0, index, bag_grad[bag] * scale[bag].view(-1, 1),
                                  mode=mode)),
        (lambda: embedding_bag_grad(weight, index, "max"),
         lambda: detsum.scatter_reduce(zeros, 0, biggest[full], bag_grad[full], "sum",
                                       mode=mode)),
        (lambda: torch.segment_reduce(src, "sum", lengths=lengths, initial=2),
         lambda: detsum.index_add(torch.full((4, 5), 2, dtype=dtype), 0, segment, src,
                                  mode=mode)),
        (lambda: torch.segment_reduce(src, "max", lengths=lengths),
         lambda: detsum.scatter_reduce(torch.full((4, 5), -math.inf, dtype=dtype), 0, segment,
                                       src, "amax", mode=mode)),
        (lambda: torch.segment_reduce(src, "mean", lengths=lengths, initial=2),
         lambda: torch.where(lengths.view(-1, 1) == 0, 2.0, detsum.index_add(
             torch.full((4, 5), 2, dtype=acc), 0, segment, src.to(acc), mode=mode)
             / lengths.view(-1, 1)).to(dtype)),
        (lambda: torch.histc(centres, bins=10, min=0, max=10),
         lambda: detsum.index_add(torch.zeros(10, dtype=dtype), 0,
                                  torch.arange(3000) % 10, torch.ones(3000, dtype=dtype),
                                  mode=mode)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_other_modes_give_the_primitives_bits(mode, dtype):
    with detsum.deterministic(mode):
        for switched, direct in primitive(mode, dtype):
            actual = switched()
            assert_same_bits(actual, direct())
            assert_same_bits(switched(), actual)  # and again: the same bits every run


def small_in_place_forms(dtype, mode, index):
    """(name, reduction ("put": index_put_'s and put_'s sums), the switched in-place call on a
    fresh target, the primitive's result for it): the small in-place reductions the switch
    gives one Numba call (``_segments.small_reduce_in_place``), each against detsum's
    primitive called out of place through its general entry. ``index`` holds 600 values in
    [0, 7)."""
    n = index.numel()
    src2, src3 = data((n, 5), dtype, 1), data((2, n, 3), dtype, 2)
    x2, x3 = data((7, 5), dtype, 3), data((2, 7, 3), dtype, 4)
    # For amax and amin: column 0 all zeros, of both signs (the earlier of two stays), in
    # the targets too; NaNs in columns 1 and 2.
    signed = src2.clone()
    signed[::2, 0] = 0.0
    signed[1::2, 0] = -0.0
    signed[[40, 41], [1, 2]] = math.nan
    x2[:4, 0] = -0.0
    x2[4:, 0] = 0.0
    alpha = -1 if mode == "autograd" else 0.3
    rows2 = index.view(-1, 1).expand(n, 5)
    rows3 = index.view(1, -1, 1).expand(2, n, 3)
    ones = torch.ones(n, dtype=dtype)
    chunks = torch.cat([index] * 4) % 3
    long_terms = data((4 * n,), dtype, 5)
    return [
        ("index_add_", "sum", lambda: x2.clone().index_add_(0, index, src2),
         detsum.index_add(x2, 0, index, src2, mode=mode)),
        ("index_add_ alpha", "sum", lambda: x2.clone().index_add_(0, index, src2, alpha=alpha),
         detsum.index_add(x2, 0, index, src2, alpha=alpha, mode=mode)),
        ("index_add_ dim 1", "sum", lambda: x3.clone().index_add_(1, index, src3),
         detsum.index_add(x3, 1, index, src3, mode=mode)),
        ("index_add_ dim -2", "sum", lambda: x3.clone().index_add_(-2, index, src3),
         detsum.index_add(x3, 1, index, src3, mode=mode)),
        ("index_add out=self", "sum",
         lambda: (lambda x: torch.index_add(x, 0, index, src2, out=x))(x2.clone()),
         detsum.index_add(x2, 0, index, src2, mode=mode)),
        ("scatter_add_ 1-D", "sum", lambda: x2[:, 0].contiguous().scatter_add_(0, index, ones),
         detsum.scatter_reduce(x2[:, 0].contiguous(), 0, index, ones, "sum", mode=mode)),
        ("scatter_add_ expanded", "sum", lambda: x2.clone().scatter_add_(0, rows2, src2),
         detsum.scatter_reduce(x2, 0, rows2, src2, "sum", mode=mode)),
        ("scatter_add_ expanded dim 1", "sum", lambda: x3.clone().scatter_add_(1, rows3, src3),
         detsum.scatter_reduce(x3, 1, rows3, src3, "sum", mode=mode)),
        ("scatter_add_ expanded dim -2", "sum",
         lambda: x3.clone().scatter_add_(-2, rows3, src3),
         detsum.scatter_reduce(x3, 1, rows3, src3, "sum", mode=mode)),
        ("scatter_reduce_ sum", "sum",
         lambda: x2.clone().scatter_reduce_(0, rows2, src2, "sum"),
         detsum.scatter_reduce(x2, 0, rows2, src2, "sum", mode=mode)),
    ] + [
        (f"scatter_reduce_ {reduce} include_self={include_self}", reduce,
         lambda reduce=reduce, include_self=include_self: x2.clone().scatter_reduce_(
             0, rows2, signed, reduce, include_self=include_self),
         detsum.scatter_reduce(x2, 0, rows2, signed, reduce, include_self=include_self,
                               mode=mode))
        for reduce in ("amax", "amin") for include_self in (True, False)
    ] + [
        (f"scatter_reduce_ mean include_self={include_self}", "mean",
         lambda include_self=include_self: x2.clone().scatter_reduce_(
             0, rows2, src2, "mean", include_self=include_self),
         detsum.scatter_reduce(x2, 0, rows2, src2, "mean", include_self=include_self,
                               mode=mode))
        for include_self in (True, False)
    ] + [
        ("scatter_reduce_ mean 1-D, some rows without terms", "mean",
         lambda: x2[:, 1].contiguous().scatter_reduce_(0, index % 5, ones, "mean",
                                                        include_self=False),
         detsum.scatter_reduce(x2[:, 1].contiguous(), 0, index % 5, ones, "mean",
                               include_self=False, mode=mode)),
        ("index_reduce_ mean dim 1", "mean",
         lambda: x3.clone().index_reduce_(1, index, src3, "mean"),
         detsum.scatter_reduce(x3, 1, rows3, src3, "mean", mode=mode)),
        ("scatter_reduce_ amax expanded dim 1", "amax", lambda: x3.clone().scatter_reduce_(
            1, rows3, src3, "amax", include_self=False),
         detsum.scatter_reduce(x3, 1, rows3, src3, "amax", include_self=False, mode=mode)),
        ("index_reduce_ amin", "amin", lambda: x3.clone().index_reduce_(1, index, src3, "amin"),
         detsum.scatter_reduce(x3, 1, rows3, src3, "amin", mode=mode)),
        # One column whose rows have many chunks' terms (800 each): one pass of any length.
        ("index_add_ 1-D, rows of chunks", "sum",
         lambda: x2[:3, 2].contiguous().index_add_(0, chunks, long_terms, alpha=alpha),
         detsum.index_add(x2[:3, 2].contiguous(), 0, chunks, long_terms, alpha=alpha,
                          mode=mode)),
        ("scatter_reduce_ amin 1-D, rows of chunks", "amin",
         lambda: x2[:3, 1].contiguous().scatter_reduce_(0, chunks.long(), long_terms, "amin",
                                                        include_self=False),
         detsum.scatter_reduce(x2[:3, 1].contiguous(), 0, chunks, long_terms, "amin",
                               include_self=False, mode=mode)),
        # index_put_ and put_ with accumulate=True: index_add_ along the indexed dim, which
        # "autograd" takes in 16-bit floats too (torch rounds their sums after every add).
        ("index_put_", "put", lambda: x2.clone().index_put_((index,), src2, accumulate=True),
         detsum.index_add(x2, 0, index, src2, mode=mode)),
        ("put_", "put", lambda: x2.clone().put_(index.long() * 5 + 2, ones, accumulate=True),
         detsum.index_add(x2.reshape(-1), 0, index.long() * 5 + 2, ones, mode=mode).view(7, 5)),
    ]


@pytest.fixture
def small_in_place_answers(monkeypatch, python_kernels):
    """The answers of ``_segments.small_reduce_in_place`` in the test, in turn (the C++
    kernels, which take some of these calls before it, removed)."""
    return record_answers(monkeypatch, _segments, "small_reduce_in_place")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_small_in_place_reductions_take_one_call_with_the_primitives_bits(
        small_in_place_answers, mode, dtype):
    """The switch's short way for a small in-place reduction (no plan, no new output, no copy)
    gives the primitive's bits: 600 terms into 7 rows, at most 100 on a row, and 2400 into 3
    of one column (rows of several chunks); indices of every layout it takes (1-D, expanded
    along dim 0 and dim 1 of 3-D tensors), alpha, both index dtypes; amax and amin with and
    without the target's values, over NaNs and zeros of both signs; means with and without
    them, rows without terms among them; index_reduce_'s, index_put_'s and put_'s. It takes
    the sums and means of the rules it has (not "exact"'s); "autograd" gives it only what
    reproduces torch (no 16-bit float sums or means but index_put_'s and put_'s, which torch
    rounds in the dtype after every add; no amax or amin over zeros of both signs, whose
    ties torch breaks its own way)."""
    generator = torch.Generator().manual_seed(8)
    index = torch.randperm(600, generator=generator) % 7
    torchs_sums = mode == "autograd" and dtype in (torch.bfloat16, torch.float16)
    for index_dtype in (torch.int64, torch.int32):
        forms = small_in_place_forms(dtype, mode, index.to(index_dtype))
        for name, reduce, switched, expected in forms:
            small_in_place_answers.clear()
            with detsum.deterministic(mode):
                actual = switched()
            # The amax and amin over ``signed`` (named by include_self) compare zeros of both
            # signs.
            torchs_ties = (mode == "autograd" and reduce in ("amax", "amin")
                           and "include_self=" in name)
            if reduce in ("sum", "mean") and torchs_sums or torchs_ties:
                assert small_in_place_answers == [], name
                assert_same_bits(actual, switched())  # torch's own, the switch off
                continue
            assert_same_bits(actual, expected)
            taken = reduce not in ("sum", "put", "mean") or mode != "exact"
            assert small_in_place_answers == [taken], name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_small_embedding_backward_takes_one_call_with_the_bodys_bits(small_in_place_answers,
                                                                      mode, dtype):
    """The dense backward of ``embedding`` without ``padding_idx`` the short way: one call into
    new zeros (none in "exact" mode, whose sums have no small call) with the body's bits
    (``detsum.index_add`` from zeros), for 2-D and 1-D indices of both dtypes. With
    ``padding_idx`` the body's answer (its rows left out), and with a value outside the
    table torch's (which leaves that term out), the short way writing nothing."""
    indices = torch.randint(0, 9, (6, 50), generator=torch.Generator().manual_seed(11))
    grad = data((6, 50, 5), dtype, 2)
    for index_dtype in (torch.int64, torch.int32):
        for rows, terms in ((indices, grad), (indices.reshape(-1), grad.reshape(-1, 5))):
            rows = rows.to(index_dtype)
            expected = detsum.index_add(torch.zeros(9, 5, dtype=dtype), 0, rows.reshape(-1),
                                        terms.reshape(-1, 5), mode=mode)
            small_in_place_answers.clear()
            with detsum.deterministic(mode):
                actual = torch.ops.aten.embedding_dense_backward(terms, rows, 9, -1, False)
            assert_same_bits(actual, expected)
            assert small_in_place_answers == ([] if mode == "exact" else [True])

            small_in_place_answers.clear()
            with detsum.deterministic(mode):
                padded = torch.ops.aten.embedding_dense_backward(terms, rows, 9, 3, False)
            expected[3] = 0
            assert_same_bits(padded, expected)
            assert small_in_place_answers == []

    outside = indices.reshape(-1).clone()
    outside[7] = 9
    terms = grad.reshape(-1, 5)
    small_in_place_answers.clear()
    with detsum.deterministic(mode):
        actual = torch.ops.aten.embedding_dense_backward(terms, outside, 9, -1, False)
    assert_same_bits(actual, torch.ops.aten.embedding_dense_backward(terms, outside, 9, -1,
                                                                     False))
    assert small_in_place_answers == ([] if mode == "exact" else [False])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_small_out_of_place_reductions_take_one_call_into_a_copy(small_in_place_answers, mode,
                                                                  dtype):
    """``index_add``, ``scatter_add`` and ``scatter_reduce`` out of place, small, on CPU: the
    in-place form's one call into a contiguous copy of ``self`` (left as it was), with the
    primitive's bits, where the in-place form takes it (not "exact"'s sums and means, nor
    "autograd"'s in 16-bit floats), the body's path elsewhere; and a transposed ``self``."""
    index = torch.randperm(600, generator=torch.Generator().manual_seed(9)) % 7
    src2, src3 = data((600, 5), dtype, 1), data((2, 600, 3), dtype, 2)
    x2, x3 = data((7, 5), dtype, 3), data((2, 7, 3), dtype, 4)
    rows2, rows3 = index.view(-1, 1).expand(600, 5), index.view(1, -1, 1).expand(2, 600, 3)
    forms = [
        ("index_add", "sum", lambda: torch.index_add(x2, 0, index, src2),
         detsum.index_add(x2, 0, index, src2, mode=mode)),
        ("index_add dim 1", "sum", lambda: torch.index_add(x3, 1, index, src3),
         detsum.index_add(x3, 1, index, src3, mode=mode)),
        ("index_add of a transposed self", "sum",
         lambda: torch.index_add(x2.t().contiguous().t(), 0, index, src2),
         detsum.index_add(x2, 0, index, src2, mode=mode)),
        ("scatter_add", "sum", lambda: torch.scatter_add(x2, 0, rows2, src2),
         detsum.scatter_reduce(x2, 0, rows2, src2, "sum", mode=mode)),
        ("scatter_add dim 1", "sum", lambda: torch.scatter_add(x3, 1, rows3, src3),
         detsum.scatter_reduce(x3, 1, rows3, src3, "sum", mode=mode)),
        ("scatter_reduce mean", "mean", lambda: torch.scatter_reduce(x2, 0, rows2, src2, "mean"),
         detsum.scatter_reduce(x2, 0, rows2, src2, "mean", mode=mode)),
        ("scatter_reduce amax", "amax", lambda: torch.scatter_reduce(
            x2, 0, rows2, src2, "amax", include_self=False),
         detsum.scatter_reduce(x2, 0, rows2, src2, "amax", include_self=False, mode=mode)),
    ]
    before = x2.clone(), x3.clone()
    half = dtype in (torch.bfloat16, torch.float16)
    for name, reduce, switched, expected in forms:
        small_in_place_answers.clear()
        with detsum.deterministic(mode):
            actual = switched()
        assert_same_bits(x2, before[0])
        assert_same_bits(x3, before[1])
        if reduce in ("sum", "mean") and mode == "autograd" and half:
            assert small_in_place_answers == [], name  # torch's own, as in place
            continue
        assert_same_bits(actual, expected)
        assert actual.is_contiguous(), name
        # "exact" sums and means: no copy made, no call tried.
        taken = [True] if reduce not in ("sum", "mean") or mode != "exact" else []
        assert small_in_place_answers == taken, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_small_embedding_bag_backward_takes_one_call_with_the_primitives_bits(
        small_in_place_answers, mode, dtype):
    """embedding_bag's dense backward, sum (with per-sample weights too) and mean without
    ``padding_idx``, the short way: torch's terms summed by one call into new zeros, the
    primitive's bits (none in "exact" mode, nor in "autograd", whose order is torch's sort of
    the indices); with ``padding_idx`` the body's path; an index outside the table the
    body's error, naming it."""
    index = torch.randperm(600, generator=torch.Generator().manual_seed(12)) % 7
    weight = data((7, 5), dtype, 3).requires_grad_()
    bag = torch.searchsorted(BAG_OFFSETS, torch.arange(600), right=True) - 1
    bag_grad = data((6, 5), dtype, 7)  # embedding_bag_grad's
    bag_size = torch.bincount(bag, minlength=6)
    scale = torch.where(bag_size != 0, 1.0 / bag_size.double(), 1.0).to(dtype)
    per_sample = data((600,), dtype, 8)
    zeros = torch.zeros(7, 5, dtype=dtype)
    forms = [
        ("sum", {}, bag_grad[bag]),
        ("mean", {}, bag_grad[bag] * scale[bag].view(-1, 1)),
        ("sum", {"per_sample_weights": per_sample}, bag_grad[bag] * per_sample.view(-1, 1)),
    ]
    taken = [] if mode in ("exact", "autograd") else [True]
    for bag_mode, kwargs, terms in forms:
        small_in_place_answers.clear()
        with detsum.deterministic(mode):
            actual = embedding_bag_grad(weight, index, bag_mode, **kwargs)
        assert small_in_place_answers == taken, (bag_mode, kwargs)
        if mode != "autograd":
            assert_same_bits(actual, detsum.index_add(zeros, 0, index, terms, mode=mode))
    small_in_place_answers.clear()
    with detsum.deterministic(mode):
        embedding_bag_grad(weight, index, "sum", padding_idx=3)
    assert small_in_place_answers == []
    outside = index.clone()
    outside[9] = 7
    with detsum.deterministic(mode), pytest.raises(IndexError, match=re.escape(
            "_embedding_bag_dense_backward (run by detsum.deterministic): indices[9] = 7")):
        torch.ops.aten._embedding_bag_dense_backward(
            bag_grad, outside, bag, bag_size, bag_size, 7, False, 0, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_small_bincount_takes_one_call_with_the_primitives_bits(small_in_place_answers, mode,
                                                                dtype):
    """``bincount`` with weights the short way: bins of torch's dtype (float32 for float32
    weights, else float64), as many as the largest value or ``minlength`` ask, summed by one
    call (none in "exact" mode), the primitive's bits; a negative value torch's error."""
    values = torch.randperm(600, generator=torch.Generator().manual_seed(13)) % 7
    weights = data((600,), dtype, 5)
    bins = torch.float32 if dtype == torch.float32 else torch.float64
    for index_dtype, minlength in ((torch.int64, 0), (torch.int32, 11)):
        small_in_place_answers.clear()
        with detsum.deterministic(mode):
            actual = torch.bincount(values.to(index_dtype), weights, minlength=minlength)
        assert small_in_place_answers == ([] if mode == "exact" else [True])
        assert_same_bits(actual, detsum.index_add(
            torch.zeros(max(7, minlength), dtype=bins), 0, values, weights.to(bins), mode=mode))
    negative = values.clone()
    negative[5] = -1
    with detsum.deterministic(mode), pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(negative, weights)


@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd"])
def test_small_in_place_sums_the_short_way_leaves_give_the_primitives_bits(small_in_place_answers,
                                                                           mode):
    """Where the one call does not fit, it writes nothing and the primitive's own path runs:
    a row of more than one chunk of terms (261 on row 0: two chunks under the rules that
    split, so the short way's single pass would give other bits; "autograd" adds every term
    in turn and takes it), a target not contiguous, and another backend in force. An index
    that feeds few rows (the primitive's rows-with-terms path) and a source of other strides
    (the expanded gradient of a sum; read from a contiguous copy) take the one call, with
    the primitive's bits."""
    index = torch.arange(600) % 7
    index[:261] = 0  # 261 terms on row 0, the other rows 48 or 49
    x, src = data((7, 5), torch.float32, 3), data((600, 5), torch.float32, 1)
    expected = detsum.index_add(x, 0, index, src, mode=mode)
    with detsum.deterministic(mode):
        actual = x.clone().index_add_(0, index, src)
    assert small_in_place_answers == [mode == "autograd"]
    assert_same_bits(actual, expected)

    columns = data((5, 7), torch.float32, 5)
    small_in_place_answers.clear()
    with detsum.deterministic(mode):
        actual = columns.clone().t().index_add_(0, index % 7, src)  # a transposed target
    assert small_in_place_answers == [False]
    assert_same_bits(actual, detsum.index_add(columns.t(), 0, index % 7, src, mode=mode))

    wide, few = data((1000, 5), torch.float32, 6), torch.tensor([3, 999, 3])
    small_in_place_answers.clear()
    with detsum.deterministic(mode):
        actual = wide.clone().index_add_(0, few, src[:3])
    assert small_in_place_answers == [True]
    assert_same_bits(actual, detsum.index_add(wide, 0, few, src[:3], mode=mode))

    spread = torch.arange(600) % 7  # 85 or 86 terms a row
    for strided in (src[:, :1].expand(600, 5), src.t().contiguous().t()):
        small_in_place_answers.clear()
        with detsum.deterministic(mode):
            actual = x.clone().index_add_(0, spread, strided)
        assert small_in_place_answers == [True]
        assert_same_bits(actual, detsum.index_add(x, 0, spread, strided, mode=mode))

    small_in_place_answers.clear()
    with detsum.backend("reference"), detsum.deterministic(mode):
        actual = x.clone().index_add_(0, index % 7, src)
    assert small_in_place_answers == [False]
    assert_same_bits(actual, detsum.index_add(x, 0, index % 7, src, mode=mode))


@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd"])
def test_small_backward_of_a_sum_and_a_sparse_put_take_one_call(small_in_place_answers, mode):
    """The backward of ``x[idx].sum()`` and of ``x.gather(...).sum()`` hands the switch an
    expanded gradient (stride 0), and ``put_`` into a tensor of many more elements than
    terms feeds few of its rows: each is the one small call, with the primitive's bits."""
    weight = data((9, 4), torch.float32, 3).requires_grad_()
    index = torch.tensor([4, 0, 4, 8, 1, 4])
    with detsum.deterministic(mode):
        (grad,) = torch.autograd.grad(weight[index].sum(), weight)
    assert small_in_place_answers == [True]
    assert_same_bits(grad, detsum.index_add(torch.zeros(9, 4), 0, index, torch.ones(6, 4),
                                            mode=mode))
    small_in_place_answers.clear()
    rows = index.view(-1, 1).expand(6, 4)
    with detsum.deterministic(mode):
        (grad,) = torch.autograd.grad(weight.gather(0, rows).sum(), weight)
    assert small_in_place_answers == [True]
    assert_same_bits(grad, detsum.index_add(torch.zeros(9, 4), 0, index, torch.ones(6, 4),
                                            mode=mode))
    small_in_place_answers.clear()
    flat, places = data((4096,), torch.float32, 5), torch.tensor([7, 4000, 7, 12])
    terms = data((4,), torch.float32, 6)
    with detsum.deterministic(mode):
        actual = flat.clone().put_(places, terms, accumulate=True)
    assert small_in_place_answers == [True]
    assert_same_bits(actual, detsum.index_add(flat, 0, places, terms, mode=mode))


def test_small_in_place_sums_name_a_bad_value_where_the_caller_put_it(small_in_place_answers):
    """A value out of range makes the one call write nothing; the primitive's path then names
    its place in the index the caller passed (an expanded 3-D index here), the target
    untouched."""
    index = torch.arange(40) % 7
    index[13] = 7
    rows = index.view(1, -1, 1).expand(2, 40, 3)
    x = data((2, 7, 3), torch.float32, 4)
    before = x.clone()
    with detsum.deterministic("fp32"):
        with pytest.raises(IndexError, match=re.escape(
                "scatter_add_ (run by detsum.deterministic): index[0, 13, 0] = 7 is out of range")):
            x.scatter_add_(1, rows, data((2, 40, 3), torch.float32, 2))
    assert small_in_place_answers == [False]
    assert_same_bits(x, before)


@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_small_in_place_calls_the_short_way_leaves_give_the_bodys_answer(small_in_place_answers,
                                                                          mode):
    """What the switch's short way must not take, left to the path behind it, which decides
    as it did without one: an inference tensor changed outside inference mode (detsum's
    error, nothing written), a target that is the source (or index_put_'s values) itself,
    and one that shares memory with the index through a view of another dtype (torch's
    error, nothing written: the short way's one call sees address ranges that meet and
    writes nothing)."""
    index = torch.tensor([0, 2, 2, 1])
    with torch.inference_mode():
        frozen = torch.zeros(3, 4)
    with detsum.deterministic(mode):
        with pytest.raises(RuntimeError, match=re.escape(
                "index_add_ (run by detsum.deterministic): self is an inference tensor")):
            frozen.index_add_(0, index, torch.ones(4, 4))
        with pytest.raises(RuntimeError, match=re.escape(
                "scatter_add_ (run by detsum.deterministic): self is an inference tensor")):
            frozen.scatter_add_(0, index.view(-1, 1).expand(4, 4), torch.ones(4, 4))
        with pytest.raises(RuntimeError, match=re.escape(
                "index_put_ (run by detsum.deterministic): self is an inference tensor")):
            frozen.index_put_((index,), torch.ones(4, 4), accumulate=True)
    assert torch.equal(frozen, torch.zeros(3, 4)) and small_in_place_answers == []

    def own_source():
        x = torch.arange(16.0).view(4, 4)
        return x, lambda: x.index_add_(0, torch.tensor([0, 1, 2, 3]), x)

    def own_values():
        x = torch.arange(16.0).view(4, 4)
        return x, lambda: x.index_put_((torch.tensor([0, 1, 2, 3]),), x, accumulate=True)

    def index_in_target():
        storage = torch.zeros(12, dtype=torch.int64)
        x = storage[:8].view(torch.float64)
        return x, lambda: x.scatter_add_(0, storage[4:], torch.ones(8, dtype=torch.float64))

    for form in (own_source, own_values, index_in_target):
        x, call = form()
        before = x.clone()
        with pytest.raises(RuntimeError) as torchs:
            call()
        x, call = form()
        small_in_place_answers.clear()
        with detsum.deterministic(mode), pytest.raises(RuntimeError) as switched:
            call()
        assert str(switched.value) == str(torchs.value), form.__name__
        assert_same_bits(x, before)
        assert small_in_place_answers == [False], form.__name__


@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_small_in_place_calls_of_other_shapes_give_torchs_answer(mode):
    """Small in-place calls whose shapes differ from the row form's: torch's error where it
    refuses them (nothing written), torch's bits where it takes them (a scatter index
    narrower than the target writes only its own columns), never the short way's kernel
    reading the source by the target's shape."""
    rows = torch.tensor([0, 2, 2, 1])

    def expanded(width):
        return rows.view(-1, 1).expand(4, width)

    forms = {
        "index_add_ wider source": lambda x: x.index_add_(0, rows, data((4, 6), x.dtype, 1)),
        "index_add_ narrower source": lambda x: x.index_add_(0, rows, data((4, 4), x.dtype, 1)),
        "index_add_ dim 1, other outer size": lambda x: x.view(1, 3, 5).index_add_(
            1, rows, data((2, 4, 5), x.dtype, 1)),
        "scatter_add_ wider index": lambda x: x.scatter_add_(0, expanded(6),
                                                             data((4, 6), x.dtype, 1)),
        "scatter_add_ narrower index": lambda x: x.scatter_add_(0, expanded(4),
                                                                data((4, 4), x.dtype, 1)),
        "scatter_add_ wider source": lambda x: x.scatter_add_(0, expanded(5),
                                                              data((4, 6), x.dtype, 1)),
        "scatter_reduce_ amax narrower index": lambda x: x.scatter_reduce_(
            0, expanded(4), data((4, 4), x.dtype, 1), "amax", include_self=False),
        "scatter_add_ 1-D index into 2-D": lambda x: x.scatter_add_(0, rows,
                                                                    data((4,), x.dtype, 1)),
        "index_put_ wider values": lambda x: x.index_put_((rows,), data((4, 6), x.dtype, 1),
                                                          accumulate=True),
        "index_put_ narrower values": lambda x: x.index_put_((rows,), data((4, 4), x.dtype, 1),
                                                             accumulate=True),
        "index_put_ more rows of values": lambda x: x.index_put_(
            (rows,), data((5, 5), x.dtype, 1), accumulate=True),
        "index_put_ values of one row, broadcast": lambda x: x.index_put_(
            (rows,), data((5,), x.dtype, 1), accumulate=True),
        "index_put_ 3-D values into 2-D": lambda x: x.index_put_(
            (rows,), data((4, 5, 1), x.dtype, 1), accumulate=True),
    }
    for name, form in forms.items():
        expected, error = data((3, 5), torch.float32, 2), None
        try:
            form(expected)
        except RuntimeError as refused:
            error = str(refused)
        actual = data((3, 5), torch.float32, 2)
        with detsum.deterministic(mode):
            if error is None:
                form(actual)
            else:
                with pytest.raises(RuntimeError) as switched:
                    form(actual)
                assert str(switched.value) == error, name
        assert_same_bits(actual, expected)


@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_other_modes_same_bits_on_one_and_two_torch_threads(mode):
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with detsum.deterministic(mode):
                results.append([f() for f in forms(torch.float32).values()])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert_same_bits(two, one)


def exactly_rounded(terms, dtype):
    total = sum(Fraction(float(t)) for t in terms)
    # float64 holds every sum of these few float32 terms exactly; one rounding to the dtype.
    assert Fraction(float(total)) == total
    return torch.tensor(float(total), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_exact_mode_is_the_correctly_rounded_sum(dtype):
    """Cancellation: 2^10 + 1 + 2^-5 - 2^10 + 3 * 2^-7, whose small terms a float16 or
    bfloat16 running sum loses."""
    terms = torch.tensor([2.0**10, 1.0, 2.0**-5, -(2.0**10), 3 * 2.0**-7]).to(dtype)
    index = torch.zeros(5, dtype=torch.int64)
    with detsum.deterministic("exact"):
        actual = torch.zeros(1, dtype=dtype).index_add(0, index, terms)
        weight = torch.zeros(1, dtype=dtype, requires_grad=True)
        (backward,) = torch.autograd.grad(weight[index], weight, terms)
    expected = exactly_rounded(terms.tolist(), dtype)
    assert_same_bits(actual[0], expected)
    assert_same_bits(backward[0], expected)


def test_switch_runs_detsum_not_torch():
    """fp32 torch loses the 1: the exact switch keeps it, so detsum's code ran."""
    x = torch.zeros(1)
    source = torch.tensor([1e8, 1.0, -1e8])
    index = torch.zeros(3, dtype=torch.int64)
    assert x.index_add(0, index, source).item() == 0.0
    with detsum.deterministic("exact"):
        assert x.index_add(0, index, source).item() == 1.0
        weight = torch.zeros(1, requires_grad=True)
        (grad,) = torch.autograd.grad(weight[index], weight, source)
        assert grad.item() == 1.0
    assert x.index_add(0, index, source).item() == 0.0


# ---- the switch itself -----------------------------------------------------------------------

def test_importing_detsum_registers_nothing():
    code = ("import torch, detsum\n"
            "for name in ('index_add', 'scatter_add', '_index_put_impl_'):\n"
            "    table = torch._C._dispatch_dump_table('aten::' + name)\n"
            "    assert 'switch.py' not in table, table\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_disable_gives_torch_its_kernels_back():
    torch_kernels = {name: cpu_kernel_file(name) for name in SWITCHED}
    assert not any("switch.py" in k for k in torch_kernels.values())
    detsum.enable("fp32")
    # The Python kernels, or for some the C++ kernels over them (tests/test_switch_native.py).
    assert all("switch.py" in cpu_kernel_file(name) or "switch_kernels.cpp" in
               cpu_kernel_file(name) for name in SWITCHED)
    x, index, source = torch.zeros(3), torch.tensor([0, 0]), torch.ones(2)
    before = ran_on_detsum("index_add")
    x.index_add(0, index, source)
    assert ran_on_detsum("index_add") == before + 1
    detsum.disable()
    assert {name: cpu_kernel_file(name) for name in SWITCHED} == torch_kernels
    x.index_add(0, index, source)
    assert ran_on_detsum("index_add") == before + 1
    assert switch.counts[("index_add", "torch")] >= 0
    detsum.disable()  # twice: nothing to do
    assert switch.current_mode() is None


def test_blocks_nest_and_restore():
    assert detsum.current_mode() is None
    detsum.enable("kahan")
    with detsum.deterministic("exact"):
        assert detsum.current_mode() == "exact"
        with detsum.deterministic("autograd"):
            assert detsum.current_mode() == "autograd"
        assert detsum.current_mode() == "exact"
        with pytest.raises(ZeroDivisionError):
            with detsum.deterministic("fp32"):
                1 / 0
        assert detsum.current_mode() == "exact"
    assert detsum.current_mode() == "kahan"
    detsum.disable()
    assert detsum.current_mode() is None
    with detsum.deterministic():
        assert detsum.current_mode() == "fp32"
    assert detsum.current_mode() is None
    # A block's end leaves the kernels registered, handing every call to torch's kernel;
    # disable removes them.
    assert "switch.py" in cpu_kernel_file("index_add")
    x, index, source = torch.zeros(3), torch.tensor([0, 0]), torch.ones(2)
    on_detsum, on_torch = ran_on_detsum("index_add"), switch.counts[("index_add", "torch")]
    assert torch.equal(x.index_add(0, index, source), torch.tensor([2.0, 0.0, 0.0]))
    assert ran_on_detsum("index_add") == on_detsum
    assert switch.counts[("index_add", "torch")] == on_torch + 1
    detsum.disable()
    assert "switch.py" not in cpu_kernel_file("index_add")


def test_one_block_object_opens_blocks_again_nested_and_in_threads():
    """``deterministic(mode)`` is an object to keep, as ``torch.no_grad()`` is: each ``with``
    opens a block of its own (after a block, again, inside itself, in two threads at once),
    and it decorates a function as a block around each call."""
    block = detsum.deterministic("exact")
    assert repr(block) == "detsum.deterministic('exact')"
    for _ in range(2):
        with block:
            assert detsum.current_mode() == "exact"
            with detsum.deterministic("fp32"), block:
                assert detsum.current_mode() == "exact"
            assert detsum.current_mode() == "exact"
        assert detsum.current_mode() is None
    started, inside, release = threading.Barrier(2), threading.Barrier(3), threading.Event()

    def hold():
        started.wait()
        with block:
            inside.wait()
            release.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait()
    assert [mode for _, mode, _ in switch._blocks] == ["exact", "exact"]
    release.set()
    for thread in threads:
        thread.join()
    assert switch._blocks == [] and detsum.current_mode() is None

    @detsum.deterministic("kahan")
    def mode_inside():
        return detsum.current_mode()

    assert mode_inside() == "kahan" and detsum.current_mode() is None
    with pytest.raises(ValueError, match="^detsum.deterministic: mode='fp64' is not a detsum "
                                         "mode"):
        detsum.deterministic("fp64")


def test_disable_keeps_the_removed_kernels_alive():
    """What disable removes stays alive until the next removal: a thread that read the
    dispatcher's entry just before still calls a live kernel (which hands the call to torch).
    The kernels removed before are let go."""
    with detsum.deterministic("fp32"):
        pass
    detsum.disable()
    first = list(switch._removed)
    assert len(first) >= len(SWITCHED)
    with detsum.deterministic("kahan"):
        pass
    detsum.disable()
    assert switch._removed and not any(a is b for a in switch._removed for b in first)
    detsum.disable()  # nothing registered: nothing removed, the last removal's kept
    assert len(switch._removed) == len(first)


def test_an_exit_without_its_enter_is_refused_and_changes_nothing():
    block = detsum.deterministic("fp32")
    with detsum.deterministic("kahan"):
        with pytest.raises(RuntimeError, match=re.escape(
                "detsum.deterministic('fp32'): __exit__ without a block of this object open")):
            block.__exit__(None, None, None)
        assert switch.current_mode() == "kahan"
    with block:
        assert switch.current_mode() == "fp32"
    with pytest.raises(RuntimeError, match="__exit__ without a block"):
        block.__exit__(None, None, None)
    assert switch.current_mode() is None


def test_blocks_closed_out_of_order_remove_their_own_layer():
    """Two threads may close their blocks in the order they opened them: each exit removes
    its own block, and the open one still holds."""
    first, second = detsum.deterministic("fp32"), detsum.deterministic("exact")
    first.__enter__()
    second.__enter__()
    assert switch.current_mode() == "exact"
    first.__exit__(None, None, None)
    assert switch.current_mode() == "exact"
    second.__exit__(None, None, None)
    assert switch.current_mode() is None
    first, second = detsum.deterministic("fp32"), detsum.deterministic("exact")
    first.__enter__()
    second.__enter__()
    second.__exit__(None, None, None)
    assert switch.current_mode() == "fp32"
    first.__exit__(None, None, None)
    assert switch.current_mode() is None


def test_bad_mode_is_refused_in_detsums_words():
    with pytest.raises(ValueError, match=r"detsum.enable: mode='fast'"):
        detsum.enable("fast")
    with pytest.raises(ValueError, match=r"detsum.deterministic: mode='fast'"):
        with detsum.deterministic("fast"):
            pass
    assert switch.current_mode() is None


def test_two_threads_toggling():
    """Blocks opened and closed by two threads in any interleaving: every result is torch's
    (float32 "autograd" gives torch's bits whether the switch is on or off at that moment),
    nothing fails, and the switch is off once both are done."""
    x, source = data((7, 5), torch.float32, 0), data((600, 5), torch.float32, 1)
    index = hot_index(600, 7, 2)
    expected = x.index_add(0, index, source)
    failures = []

    def worker():
        try:
            for _ in range(30):
                with detsum.deterministic("autograd"):
                    if not torch.equal(x.index_add(0, index, source), expected):
                        failures.append("bits")
                if not torch.equal(x.index_add(0, index, source), expected):
                    failures.append("bits after")
        except Exception as error:  # reported below, with the thread's own error
            failures.append(repr(error))

    workers = [threading.Thread(target=worker) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert failures == []
    assert switch.current_mode() is None
    detsum.disable()  # no thread toggles any more: the kernels can go
    assert "switch.py" not in cpu_kernel_file("index_add")


def test_another_thread_sees_the_switch():
    x, index, source = torch.zeros(1), torch.zeros(3, dtype=torch.int64), torch.tensor(
        [1e8, 1.0, -1e8])
    results = []
    with detsum.deterministic("exact"):
        worker = threading.Thread(target=lambda: results.append(x.index_add(0, index, source)))
        worker.start()
        worker.join()
    assert results[0].item() == 1.0


# ---- what goes to torch ------------------------------------------------------------------------

def fallbacks():
    x = torch.zeros(4, 3)
    index = torch.tensor([0, 2, 2])
    return {
        "int64": lambda: torch.zeros(4, dtype=torch.int64).index_add(
            0, index, torch.tensor([1, 2, 3])),
        "complex": lambda: torch.zeros(4, dtype=torch.complex64).index_add(
            0, index, torch.ones(3, dtype=torch.complex64)),
        "0-d": lambda: torch.tensor(1.0).index_add(0, torch.tensor([0]), torch.tensor(2.0)),
        "empty index": lambda: x.index_add(0, index[:0], torch.ones(0, 3)),
        "scatter_add int": lambda: torch.zeros(4, dtype=torch.int32).scatter_add(
            0, index, torch.ones(3, dtype=torch.int32)),
        "index_put mask": lambda: x.index_put((torch.tensor([True, False, True, False]),),
                                              torch.ones(2, 3), accumulate=True),
        "index_put two indices": lambda: x.index_put((index, index), torch.ones(3),
                                                     accumulate=True),
        "bincount without weights": lambda: torch.bincount(index),
        "bincount int8": lambda: torch.bincount(index.to(torch.int8), torch.ones(3)),
        "index_put no accumulate": lambda: x.index_put((index,), torch.ones(3, 3)),
        "scatter narrower index": lambda: x.scatter_add(0, index.view(3, 1), torch.ones(3, 3)),
        "embedding scale_grad_by_freq": lambda: torch.ops.aten.embedding_dense_backward(
            torch.ones(3, 3), index, 4, -1, True),
        # torch leaves the rows outside [0, num_weights) out; detsum's check hands it over.
        "embedding index out of range": lambda: torch.ops.aten.embedding_dense_backward(
            torch.ones(3, 3), torch.tensor([0, 7, -2]), 4, -1, False),
        "embedding_bag scale_grad_by_freq": lambda: torch.ops.aten._embedding_bag_dense_backward(
            torch.ones(2, 3), index, torch.tensor([0, 0, 1]), torch.tensor([2, 1]),
            torch.zeros(2, dtype=torch.int64), 4, True, 0, None),
        "segment_reduce empty": lambda: torch.segment_reduce(
            torch.ones(0, 3), "sum", lengths=torch.tensor([0, 0])),
        "segment_reduce infinite initial": lambda: torch.segment_reduce(
            torch.tensor([1.0, 2.0, 3.0]), "max", lengths=torch.tensor([1, 0, 2]),
            initial=math.inf),
        "histc empty": lambda: torch.histc(torch.ones(0), bins=4),
        "histc out resized": lambda: torch.histc(torch.arange(5.0), bins=4,
                                                 out=torch.empty(0)),
    }


@pytest.mark.parametrize("mode", ["fp32", "exact"])
def test_inputs_detsum_does_not_take_get_torchs_result(mode):
    cases = fallbacks()
    expected = {name: f() for name, f in cases.items()}
    with detsum.deterministic(mode):
        for name, f in cases.items():
            assert torch.equal(f(), expected[name]), name


@pytest.mark.parametrize("mode", ["autograd", "fp32"])
def test_calls_left_to_torch_run_under_its_deterministic_mode(monkeypatch, mode):
    """A call left to torch with floating-point or complex data runs torch's kernel under
    torch's deterministic mode, ``warn_only`` unless the caller had set that mode without it
    (on CUDA torch's default is atomics; "autograd" mode gives that mode's bits; where torch
    has no deterministic kernel, its default one with torch's warning, or its refusal as the
    caller asked): each such fallback above and a bfloat16 index_add ("autograd" mode: torch's
    kernel the one source of its bits; its functional form calls the in-place one, itself
    switched), with torch's deterministic result. Not integer data (exact in any order), nor
    a call of one term at most (0-d, empty: no order), nor but in "autograd" mode a plain
    assignment, nor a call detsum runs; the caller's setting, warn_only too, comes back,
    also after torch's error."""
    entered = []
    deterministic = switch._torch_deterministic

    @contextlib.contextmanager
    def recorded():
        with deterministic():
            entered.append((torch.are_deterministic_algorithms_enabled(),
                            torch.is_deterministic_algorithms_warn_only_enabled()))
            yield

    monkeypatch.setattr(switch, "_torch_deterministic", recorded)
    cases = fallbacks()
    cases["bfloat16 index_add"] = lambda: torch.zeros(4, 3, dtype=torch.bfloat16).index_add(
        0, torch.tensor([0, 2, 2]), torch.full((3, 3), 0.1, dtype=torch.bfloat16))
    with measure.torch_deterministic():
        expected = {name: f() for name, f in cases.items()}
    # Integer data; in "fp32" mode, a plain assignment too (x[idx] = v: nothing added).
    exact = {"int64", "scatter_add int", "bincount without weights",
             *(() if mode == "autograd" else ("index_put no accumulate",))}
    with detsum.deterministic(mode):
        for name, f in cases.items():
            if name == "bfloat16 index_add" and mode != "autograd":
                continue  # on detsum
            entered.clear()
            assert_same_bits(f(), expected[name])
            assert entered == ([] if name in {"0-d", "histc empty", *exact} else [(True, True)]
                               ) or (name == "bfloat16 index_add"
                                     and entered == [(True, True)] * 2), name
        entered.clear()
        torch.zeros(4, 3).index_add(0, torch.tensor([0, 2, 2]), torch.ones(3, 3))
        assert entered == []  # on detsum
        try:
            for warn_only in (True, False):
                torch.use_deterministic_algorithms(True, warn_only=warn_only)
                entered.clear()
                cases["complex"]()
                assert entered == [(True, warn_only)]
                assert torch.are_deterministic_algorithms_enabled()
                assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only
            torch.use_deterministic_algorithms(False)
            with pytest.raises(RuntimeError, match="no larger"):  # torch's own check
                torch.zeros(4, 3).scatter_add_(0, torch.tensor([[0, 1, 2, 3]]), torch.ones(1, 3))
            assert not torch.are_deterministic_algorithms_enabled()
        finally:
            torch.use_deterministic_algorithms(False)


def test_torch_deterministic_blocks_in_two_threads_put_the_setting_back():
    """Two threads' blocks of torch's deterministic mode (the switch's "autograd" fallbacks),
    the first closed while the second is open: the setting holds until the last one closes,
    then is what it was before the first."""
    first_open, second_open, first_closed = (threading.Event() for _ in range(3))
    seen = []

    def second():
        first_open.wait()
        with switch._torch_deterministic():
            second_open.set()
            first_closed.wait()
            seen.append(torch.are_deterministic_algorithms_enabled())
        seen.append(torch.are_deterministic_algorithms_enabled())

    thread = threading.Thread(target=second)
    thread.start()
    with switch._torch_deterministic():
        first_open.set()
        second_open.wait()
    first_closed.set()
    thread.join()
    assert seen == [True, False]


def test_out_that_torch_resizes_goes_to_torch():
    x, index, source = torch.zeros(4, 3), torch.tensor([0, 2, 2]), torch.ones(3, 3)
    with detsum.deterministic("fp32"):
        out = torch.empty(0)
        torch.index_add(x, 0, index, source, out=out)
    assert_same_bits(out, x.index_add(0, index, source))


def test_a_switched_calls_error_names_what_switched_it_on():
    """The switched call's error names the function that put its mode in force: ``enable``,
    or the innermost ``deterministic`` block open over it, and ``enable`` again once that
    block closes."""
    x = torch.zeros(4, 3)

    def bad_call(opener):
        with pytest.raises(IndexError, match=re.escape(f"index_add_ (run by {opener}): "
                                                       "index[1] = 9 is out of range")):
            x.index_add_(0, torch.tensor([0, 9]), torch.ones(2, 3))

    with detsum.deterministic("kahan"):
        bad_call("detsum.deterministic")
    detsum.enable()
    try:
        bad_call("detsum.enable")
        with detsum.deterministic("exact"):
            bad_call("detsum.deterministic")
        bad_call("detsum.enable")
    finally:
        detsum.disable()
    assert torch.equal(x, torch.zeros(4, 3))


@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_bad_inputs_give_torchs_errors_and_write_nothing(mode):
    x = torch.zeros(4, 3)
    with detsum.deterministic(mode):
        with pytest.raises(RuntimeError, match="no larger"):  # torch's own check
            x.scatter_add_(0, torch.tensor([[0, 1, 2, 3]]), torch.ones(1, 3))
        with pytest.raises(RuntimeError):  # torch's: dtypes differ
            x.index_add_(0, torch.tensor([0]), torch.ones(1, 3, dtype=torch.float64))
        with pytest.raises(IndexError, match=r"index_add_ \(run by detsum.deterministic\)"):
            x.index_add_(0, torch.tensor([0, 9]), torch.ones(2, 3))
        with pytest.raises(RuntimeError, match=r"scatter_add_ \(run by detsum.deterministic\)"):
            x.scatter_add_(0, torch.tensor([[0, 1, 2], [3, 4, 0]]), torch.ones(2, 3))
        with pytest.raises(IndexError, match=r"put_ \(run by detsum.deterministic\): out of range"):
            x.put_(torch.tensor([0, 12]), torch.ones(2), accumulate=True)
        with pytest.raises(IndexError, match=r"out of bounds for dimension 0 with size 4"):
            x.index_put_((torch.tensor([0, -5]),), torch.ones(2, 3), accumulate=True)
        with pytest.raises(RuntimeError, match="non-negative"):  # torch's, after detsum's check
            torch.bincount(torch.tensor([0, -1]), torch.ones(2))
    assert torch.equal(x, torch.zeros(4, 3))


def test_a_call_handed_back_after_detsums_check_counts_as_torchs():
    """Where detsum's own check of the values shows that torch's kernel gives the meaning (an
    embedding row out of range, a negative bincount value), the call goes to torch and is
    counted there, and the next call runs on detsum again."""
    grad, index = torch.ones(3, 3), torch.tensor([0, 7, -2])
    before = switch.counts.copy()
    with detsum.deterministic("fp32"):
        torch.ops.aten.embedding_dense_backward(grad, index, 4, -1, False)
        with pytest.raises(RuntimeError):
            torch.bincount(torch.tensor([0, -1]), torch.ones(2))
        torch.ops.aten.embedding_dense_backward(grad, index.clamp(0, 3), 4, -1, False)
    ran = switch.counts - before
    assert ran == {("embedding_dense_backward", "torch"): 1, ("bincount", "torch"): 1,
                   ("embedding_dense_backward", "detsum"): 1}


def test_torch_ops_that_detsum_calls_inside_the_switch_reach_torch(monkeypatch):
    """A primitive that itself calls a switched torch op on float tensors (as a fallback or a
    reference loop might) gets torch's kernel, not the switch again (which would recurse)."""
    from detsum.ops import index_add as primitive

    def through_torch(input, dim, index, source, alpha, mode, *rest):
        return input.index_add(dim, index, source, alpha=alpha)

    monkeypatch.setattr(primitive, "_index_add", through_torch)
    x, index, source = torch.zeros(1), torch.zeros(3, dtype=torch.int64), torch.tensor(
        [1e8, 1.0, -1e8])
    before = switch.counts.copy()
    with detsum.deterministic("exact"):
        assert x.index_add(0, index, source).item() == 0.0  # torch's fp32 sum
    ran = switch.counts - before
    assert ran == {("index_add", "detsum"): 1, ("index_add", "torch"): 1}


def test_torchscript_reaches_the_switch():
    """Scripted code calls the same dispatcher entries as eager code."""
    @torch.jit.script
    def scripted(x: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return x.index_add(0, index, source)

    x, index, source = torch.zeros(1), torch.zeros(3, dtype=torch.int64), torch.tensor(
        [1e8, 1.0, -1e8])
    assert scripted(x, index, source).item() == 0.0
    with detsum.deterministic("exact"):
        assert scripted(x, index, source).item() == 1.0
    assert scripted(x, index, source).item() == 0.0


@pytest.mark.parametrize("mode", ["fp32", "kahan"])
def test_other_modes_within_their_bound_of_the_exact_sum(mode):
    """A hot row of about 420 float32 terms: each output element within its mode's bound of
    the exact sum (Fractions). "fp32": a serial float32 sum of N terms, within
    gamma_N * sum|x| (gamma_N = N u / (1 - N u)). "kahan": ulp(out) + 2 N^2 u^2 sum|x|
    (docs/determinism.md)."""
    x = data((7, 3), torch.float32, 0)
    source = data((600, 3), torch.float32, 1) * torch.logspace(-3, 3, 600).view(-1, 1)
    index = hot_index(600, 7, 2)
    with detsum.deterministic(mode):
        out = x.index_add(0, index, source)
    u = Fraction(1, 2**24)
    for row in range(7):
        for column in range(3):
            terms = [Fraction(float(x[row, column]))] + [
                Fraction(float(source[k, column])) for k in (index == row).nonzero().view(-1)]
            exact, magnitude, n = sum(terms), sum(abs(t) for t in terms), len(terms)
            error = abs(Fraction(float(out[row, column])) - exact)
            if mode == "fp32":
                bound = n * u / (1 - n * u) * magnitude
            else:
                ulp = Fraction(2.0 ** (torch.frexp(out[row, column]).exponent.item() - 24))
                bound = ulp + 2 * n * n * u * u * magnitude
            assert error <= bound, (row, column, float(error), float(bound))


# ---- embedding_bag's backward, segment_reduce, histc ------------------------------------------

NEW_OPS = [("nn.functional.embedding_bag", ""), ("_segment_reduce", "lengths"),
           ("_segment_reduce", "offsets"), ("histc", "")]
# The operator each one's accumulation reaches (embedding_bag's: in its backward).
NEW_OPERATOR = {"nn.functional.embedding_bag": "_embedding_bag_dense_backward",
                "_segment_reduce": "segment_reduce", "histc": "histc"}
HALF = (torch.float16, torch.bfloat16)


def results(op, sample, seed):
    """The sample's output and its gradients (histc has none)."""
    out = op(sample.input, *sample.args, **sample.kwargs)
    inputs = [t for t in (sample.input, *sample.args, *sample.kwargs.values())
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if not inputs:
        return [out]
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(out.shape, generator=generator).to(out.dtype)
    return [out, *torch.autograd.grad(out, inputs, grad)]


def runs_on_detsum(name, sample, dtype, mode) -> bool:
    """Whether the switch takes the sample's accumulation in ``mode``, as docs/enable.md says."""
    if name == "nn.functional.embedding_bag":
        bag_mode = sample.kwargs.get("mode", "mean")
        scaled = bag_mode == "mean" or sample.kwargs.get("per_sample_weights") is not None
        if mode != "autograd":
            return True
        return dtype not in HALF if bag_mode == "max" else dtype in HALF or not scaled
    if name == "_segment_reduce":
        return sample.args[0] != "prod" or not (mode == "exact"
                                                or mode == "autograd" and dtype in HALF)
    return sample.input.numel() > 0


def run_counted(name, mode, f):
    """``f()`` under the switch in ``mode``, and how many calls of the op ran on detsum."""
    operator = NEW_OPERATOR[name]
    before = ran_on_detsum(operator)
    with detsum.deterministic(mode):
        out = f()
    return out, ran_on_detsum(operator) - before


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,variant", NEW_OPS)
def test_new_ops_opinfo_samples_autograd_mode_gives_torchs_bits(name, variant, dtype):
    """Every sample gives the bits of torch's deterministic mode, and exactly the samples the
    docs promise run on detsum (the others on torch's kernel)."""
    op, cases = samples(name, variant, dtype, requires_grad=name != "histc")
    for seed, sample in enumerate(cases):
        with DeterministicTorch():
            expected = results(op, sample, seed)
        actual, ran = run_counted(name, "autograd", lambda: results(op, sample, seed))
        assert ran == runs_on_detsum(name, sample, dtype, "autograd"), (seed, sample.kwargs)
        for a, e in zip(actual, expected):
            assert_same_bits(a, e)


# float32 and bfloat16 each meet two of the three modes ("fp32" both): every mode runs over
# thread counts, and so does every dtype's path, at two thirds of the full product's cost.
_RUN_DTYPES = {"fp32": (torch.float32, torch.bfloat16), "kahan": (torch.bfloat16,),
               "exact": (torch.float32,)}


@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
@pytest.mark.parametrize("name,variant", NEW_OPS)
def test_new_ops_opinfo_samples_same_bits_over_runs_and_threads(name, variant, mode):
    threads = torch.get_num_threads()
    try:
        for dtype in _RUN_DTYPES[mode]:
            op, cases = samples(name, variant, dtype, requires_grad=name != "histc")
            for seed, sample in enumerate(cases):
                runs = []
                for count in (1, 2, 2):
                    torch.set_num_threads(count)
                    out, ran = run_counted(name, mode, lambda: results(op, sample, seed))
                    assert ran == runs_on_detsum(name, sample, dtype, mode), seed
                    runs.append(out)
                for run in runs[1:]:
                    for a, e in zip(run, runs[0]):
                        assert_same_bits(a, e)
    finally:
        torch.set_num_threads(threads)


PRECISION = {torch.float32: 24, torch.float64: 53, torch.float16: 11, torch.bfloat16: 8}


def ulp(value: float, dtype) -> Fraction:
    """The spacing of ``dtype``'s values at ``value`` (its subnormal spacing at 0)."""
    if value == 0:
        return Fraction(torch.finfo(dtype).smallest_normal) * Fraction(torch.finfo(dtype).eps)
    return Fraction(2) ** (math.frexp(value)[1] - PRECISION[dtype])


def assert_within_bound(mode, out: float, terms: list[float], dtype):
    """``out`` against the exact sum of ``terms``, in the mode's bound (docs/determinism.md):
    "exact" correctly rounded (half an ulp); "fp32" the serial bound gamma_n * sum|x| in the
    accumulator (u = 2^-24, 2^-53 for float64), plus the one rounding to a narrower dtype;
    "kahan" ulp(out) + 2 n^2 u^2 sum|x|."""
    exact = sum(map(Fraction, terms), Fraction(0))
    error = abs(Fraction(out) - exact)
    n, magnitude = len(terms), sum(abs(Fraction(t)) for t in terms)
    u = Fraction(1, 2**53) if dtype == torch.float64 else Fraction(1, 2**24)
    if mode == "exact":
        bound = ulp(out, dtype) / 2
    elif mode == "fp32":
        bound = n * u / (1 - n * u) * magnitude + (ulp(out, dtype) / 2 if dtype in HALF else 0)
    else:
        bound = ulp(out, dtype) + 2 * n * n * u * u * magnitude
    assert error <= bound, (mode, out, float(exact), float(error), float(bound))


def segment_terms(data, lengths=None, offsets=None, axis=0, **_):
    """Each output element's segment values, in order, flat in the output's order."""
    if offsets is None:
        ends = lengths.cumsum(-1)
        starts = ends - lengths
    else:
        starts, ends = offsets[..., :-1], offsets[..., 1:]
    count = starts.shape[-1]
    starts, ends = starts.reshape(-1, count).tolist(), ends.reshape(-1, count).tolist()
    values = data.detach().reshape(len(starts), data.shape[axis], -1).tolist()
    return [[row[i] for row in values[b][starts[b][s]:ends[b][s]]]
            for b in range(len(starts)) for s in range(count) for i in range(len(values[0][0]))]


def embedding_bag_terms(weight, indices, grad, offsets=None, include_last_offset=False,
                        padding_idx=None, **_):
    """Each weight gradient element's terms (the bag gradients of its indices), flat."""
    if indices.dim() == 2:
        bags = (torch.arange(indices.numel()) // indices.shape[1]).tolist()
    else:
        bags = (torch.searchsorted(offsets, torch.arange(indices.numel()), right=True)
                - 1).tolist()
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    rows, grad = indices.reshape(-1).tolist(), grad.tolist()
    return [[grad[bag][j] for bag, row in zip(bags, rows) if row == r and row != padding_idx]
            for r in range(weight.shape[0]) for j in range(weight.shape[1])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_new_ops_opinfo_samples_within_the_modes_bound(mode, dtype):
    """Against exact references: segment sums (from ``initial``) and embedding_bag's summed
    gradient within the mode's bound of the exact sum, segment max and min equal to torch's
    (a selection is exact), histc's counts the exact integers torch gives here."""
    for variant in ("lengths", "offsets"):
        op, cases = samples("_segment_reduce", variant, dtype)
        for sample in cases:
            reduce = sample.args[0]
            if reduce not in ("sum", "max", "min"):
                continue
            with detsum.deterministic(mode):
                out = op(sample.input, *sample.args, **sample.kwargs)
            if reduce != "sum":
                assert_same_bits(out, op(sample.input, *sample.args, **sample.kwargs))
                continue
            for value, terms in zip(out.reshape(-1).tolist(),
                                    segment_terms(sample.input, **sample.kwargs)):
                assert_within_bound(mode, value, [sample.kwargs["initial"], *terms], dtype)
    op, cases = samples("nn.functional.embedding_bag", "", dtype, requires_grad=True)
    for seed, sample in enumerate(cases):
        if (sample.kwargs.get("mode") != "sum"
                or sample.kwargs.get("per_sample_weights") is not None):
            continue
        generator = torch.Generator().manual_seed(seed)
        with detsum.deterministic(mode):
            out = op(sample.input, *sample.args, **sample.kwargs)
            grad = torch.randn(out.shape, generator=generator).to(dtype)
            (weight_grad,) = torch.autograd.grad(out, sample.input, grad)
        for value, terms in zip(weight_grad.reshape(-1).tolist(), embedding_bag_terms(
                sample.input, sample.args[0], grad, **sample.kwargs)):
            assert_within_bound(mode, value, terms or [0.0], dtype)
    op, cases = samples("histc", "", dtype)
    for sample in cases:
        with detsum.deterministic(mode):
            counts = op(sample.input, *sample.args, **sample.kwargs)
        assert_same_bits(counts, op(sample.input, *sample.args, **sample.kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact"])
def test_segment_reduce_long_segments_within_the_modes_bound(mode, dtype):
    """A segment of 420 terms over six binades (past a 256-term chunk), from ``initial``:
    sum within the mode's bound of the exact sum. In "exact" mode the mean is the exact sum
    rounded to the accumulator, divided there and rounded to the dtype: within 2 u |mean|
    (u of the accumulator: the two roundings there) plus half an ulp of the exact mean."""
    values = data((600, 2), torch.float32, 0) * torch.logspace(-3, 3, 600).view(-1, 1)
    values = values.to(dtype)
    lengths = torch.tensor([420, 0, 180])
    with detsum.deterministic(mode):
        total = torch.segment_reduce(values, "sum", lengths=lengths, initial=-0.5)
        mean = torch.segment_reduce(values, "mean", lengths=lengths)
    for segment, (start, end) in enumerate([(0, 420), (420, 420), (420, 600)]):
        for column in range(2):
            terms = values[start:end, column].tolist()
            assert_within_bound(mode, float(total[segment, column]), [-0.5, *terms], dtype)
            if mode == "exact" and terms:
                exact = sum(map(Fraction, terms)) / len(terms)
                out = float(mean[segment, column])
                bound = Fraction(2, 2**24) * abs(exact) + ulp(out, dtype) / 2
                assert abs(Fraction(out) - exact) <= bound, (segment, column)
    assert torch.isnan(mean[1]).all()  # an empty segment without initial, as torch


def _segment_reduce_as_index_add(values, reduce, mode, bounds, axis, initial):
    """What the switch's segment_reduce computes, written as its docstring says: each batch's
    segments (``bounds`` are offsets) reduced by ``index_add`` from ``initial`` or +0.0, in row
    order; a mean divides in the accumulator type (the dtype in "autograd" mode)."""
    batch_shape = values.shape[:axis]
    work = values.dtype if reduce == "sum" or mode == "autograd" else (
        torch.float64 if values.dtype == torch.float64 else torch.float32)
    outs = []
    for batch in range(batch_shape.numel()):
        rows = values.reshape(batch_shape.numel(), values.shape[axis], -1)[batch]
        offsets = bounds.reshape(batch_shape.numel(), -1)[batch]
        lengths = offsets.diff()
        segments = torch.repeat_interleave(lengths)
        picked = torch.cat([torch.arange(int(a), int(b)) for a, b in
                            zip(offsets[:-1], offsets[1:])] + [torch.zeros(0, dtype=torch.long)])
        start = torch.full((lengths.numel(), rows.shape[1]), 0.0 if initial is None else initial,
                           dtype=work)
        total = detsum.index_add(start, 0, segments, rows[picked].to(work), mode=mode)
        if reduce == "mean":
            divisor = lengths.to(work).view(-1, 1)
            total = torch.where(divisor != 0, total / divisor, total).to(values.dtype)
            if initial is None:
                total[lengths == 0] = math.nan
        outs.append(total)
    return torch.stack(outs).view(*batch_shape, -1, *values.shape[axis + 1:])


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_segment_reduce_sum_and_mean_are_index_add_from_the_start_value(mode, dtype, reduce):
    """In every mode, a sum and a mean from +0.0 (the CSR path, no sort) give the bits of the
    same segments reduced by index_add from +0.0, as from any other ``initial``: segments that
    tile every batch, offsets that start past the first row, unsafe lengths that stop short,
    a batch dim, chunked segments, empty ones, and terms that are all -0.0 (+0.0 in every
    mode: +0.0 + -0.0)."""
    values = data((2, 600, 3), torch.float32, 1).to(dtype)
    values[:, 300:310] = -0.0
    tiling = torch.tensor([[0, 300, 300, 310, 600], [0, 0, 290, 597, 600]])
    inside = torch.tensor([[5, 300, 300, 310, 580], [7, 7, 290, 597, 598]])
    with detsum.deterministic(mode):
        cases = [
            (tiling, torch.segment_reduce(values, reduce, offsets=tiling, axis=1), None),
            (inside, torch.segment_reduce(values, reduce, offsets=inside, axis=1), None),
            (tiling, torch.segment_reduce(values, reduce, lengths=tiling.diff(), axis=1,
                                          initial=0), 0),
            (tiling, torch.segment_reduce(values, reduce, offsets=tiling, axis=1,
                                          initial=0.25), 0.25),
        ]
        short = torch.segment_reduce(values[0], reduce, lengths=torch.tensor([300, 10, 0, 270]),
                                     unsafe=True)
        # One batch whose int32 offsets tile its rows: the caller's offsets as they are.
        one_batch = torch.segment_reduce(values[1], reduce, offsets=tiling[1].int())
        # 1-D bounds (the switch's shorter checks): offsets that leave out the first rows, or
        # the last; int32 lengths that tile the rows.
        one_dim = [(values[0], offsets, torch.segment_reduce(values[0], reduce, offsets=offsets))
                   for offsets in (torch.tensor([5, 300, 310, 600]), torch.tensor([0, 300, 580]))]
        one_dim.append((values[1], tiling[1], torch.segment_reduce(
            values[1], reduce, lengths=tiling[1].diff().int())))
    for bounds, got, initial in cases:
        assert_same_bits(got, _segment_reduce_as_index_add(values, reduce, mode, bounds, 1,
                                                           initial))
    assert_same_bits(short, _segment_reduce_as_index_add(
        values[0], reduce, mode, torch.tensor([0, 300, 310, 310, 580]), 0, None))
    assert_same_bits(one_batch, _segment_reduce_as_index_add(values[1], reduce, mode,
                                                             tiling[1], 0, None))
    for rows, bounds, got in one_dim:
        assert_same_bits(got, _segment_reduce_as_index_add(rows, reduce, mode, bounds, 0, None))
    negative_zeros = cases[0][1][0, 2]  # batch 0's third segment: rows 300-309, all -0.0
    assert (negative_zeros == 0).all() and not torch.signbit(negative_zeros).any()


@pytest.mark.parametrize("reduce", ["prod", "amax", "min"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_segment_reduce_products_and_extremes_are_scatter_reduce_from_the_start_value(
        mode, dtype, reduce):
    """In every mode, a product, max or min gives the bits of the same segments reduced by
    ``scatter_reduce`` from ``initial`` (or the reduction's identity), in row order: segments
    that tile every batch or leave rows out, from 0.75 and without ``initial``, chunked
    segments, empty ones, NaN among the terms. (Not run on detsum, and so not here: "exact"
    products, and "autograd" 16-bit ones.)"""
    if reduce == "prod" and (mode == "exact" or mode == "autograd" and dtype != torch.float32):
        pytest.skip("left to torch")
    values = data((2, 600, 3), torch.float32, 2)
    if reduce == "prod":
        values = 1 + values / 64
    values = values.to(dtype)
    values[1, 400, 1] = math.nan
    name = {"amax": "amax", "min": "amin", "prod": "prod"}[reduce]
    identity = {"prod": 1.0, "amax": -math.inf, "amin": math.inf}[name]
    for offsets in (torch.tensor([[0, 300, 300, 310, 600], [0, 0, 290, 597, 600]]),
                    torch.tensor([[5, 300, 300, 310, 580], [7, 7, 290, 597, 598]])):
        for initial in (None, 0.75):
            before = ran_on_detsum("segment_reduce")
            with detsum.deterministic(mode):
                got = torch.segment_reduce(values, reduce, offsets=offsets, axis=1,
                                           initial=initial)
            assert ran_on_detsum("segment_reduce") == before + 1
            for batch in range(2):
                bounds = offsets[batch]
                rows = torch.cat([values[batch, int(a):int(b)]
                                  for a, b in zip(bounds[:-1], bounds[1:])])
                segments = torch.repeat_interleave(bounds.diff())
                start = torch.full((4, 3), identity if initial is None else initial,
                                   dtype=dtype)
                expected = detsum.scatter_reduce(start, 0, segments, rows, name, mode=mode)
                assert_same_bits(got[batch], expected)


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "min"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", detsum.MODES)
def test_a_small_segment_reduce_is_one_numba_call(monkeypatch, mode, dtype, reduce):
    """A sum or mean from +0.0, or a max or min with no ``initial``, of 2-D data over 1-D
    lengths or offsets (int64 or int32) that tile its rows goes to one Numba call that checks
    the bounds too, nothing read before it (for a sum, the primitive's small call): the bits
    of the same call with that call off, and, in "autograd" mode, of torch (an empty
    segment's mean NaN, or 0 from ``initial=0``; its max -inf, its min +inf). Calls it
    refuses, nothing written, take the paths after it: offsets that leave rows out, unsafe
    lengths that stop short, a sum's or mean's segment longer than a chunk (but in
    "autograd" mode, whose sum is unsplit); and bad bounds keep torch's errors. "exact" mode
    has no small sum or mean."""
    answers = record_answers(monkeypatch, small_kernels, "segment_reduce_small")
    values = data((40, 5), torch.float32, 3).to(dtype)
    values[7:9] = -0.0
    values[9, 2] = math.nan
    long_values = data((CHUNK_TERMS + 9, 2), torch.float32, 4).to(dtype)
    tiling = torch.tensor([0, 7, 9, 9, 40])
    takes_it = mode != "exact" or reduce in ("amax", "min")
    splits = mode != "autograd" and reduce in ("sum", "mean")
    calls = [(values, "offsets", tiling, {}), (values, "offsets", tiling.int(), {}),
             (values, "lengths", tiling.diff(), {}), (values, "lengths", tiling.diff().int(), {}),
             (values, "offsets", torch.tensor([2, 9, 40]), {}),
             (values, "lengths", torch.tensor([7, 30]), {"unsafe": True}),
             (long_values, "lengths", torch.tensor([CHUNK_TERMS + 1, 8]), {})]
    if reduce == "mean":  # from initial=0: an empty segment's mean 0, not NaN
        calls.append((values, "offsets", tiling, {"initial": 0}))
    for rows, name, bounds, options in calls:
        def call():
            with detsum.deterministic(mode):
                return torch.segment_reduce(rows, reduce, **{name: bounds}, **options)
        answers.clear()
        got = call()
        # (Refused, the call's rows can reach the primitive's own small call after.)
        if bounds.shape[0] > 3 and takes_it:  # the calls of tiling bounds
            assert answers == [-1], (name, bounds)
        elif rows is long_values and takes_it:
            assert answers[0] == (small_kernels.TOO_MANY_TERMS if splits else -1)
        elif takes_it:
            assert answers[0] == small_kernels.BAD_OFFSETS, (name, bounds)
        else:
            assert answers == []
        with monkeypatch.context() as patch:
            patch.setattr(small_kernels, "MAX_ELEMENTS", -1)
            assert_same_bits(got, call())
        if mode == "autograd":
            assert_same_bits(got, torch.segment_reduce(rows, reduce, **{name: bounds},
                                                       **options))
    for name, bounds in (("lengths", torch.tensor([7, -1, 34])),
                         ("lengths", torch.tensor([7, 30])),
                         ("offsets", torch.tensor([0, 9, 7, 40]))):
        with pytest.raises(RuntimeError) as torchs:
            torch.segment_reduce(values, reduce, **{name: bounds})
        with detsum.deterministic(mode), pytest.raises(RuntimeError) as switched:
            torch.segment_reduce(values, reduce, **{name: bounds})
        assert str(switched.value) == str(torchs.value)


@pytest.mark.parametrize("mode", detsum.MODES)
def test_segment_reduce_amax_and_amin_run_on_detsum(mode):
    """torch names segment_reduce's max and min "amax" and "amin" (its own error lists those;
    "max" and "min" are its aliases), and PyG's max and min aggregations over a CSR pointer
    call it so: each spelling runs on detsum, with torch's bits (NaN, an empty segment's
    -inf / inf, ``initial``), as max and min are exact in every mode."""
    values = data((40, 3), torch.float32, 0)
    values[5, 1] = math.nan
    offsets = torch.tensor([0, 17, 17, 40])
    for reduce in ("amax", "max", "amin", "min"):
        for initial in (None, 0.5):
            expected = torch.segment_reduce(values, reduce, offsets=offsets, initial=initial)
            before = ran_on_detsum("segment_reduce")
            with detsum.deterministic(mode):
                actual = torch.segment_reduce(values, reduce, offsets=offsets,
                                              initial=initial)
            assert ran_on_detsum("segment_reduce") == before + 1, (reduce, initial)
            assert_same_bits(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_exact_mode_new_ops_correctly_rounded(dtype):
    """Cancellation that a running sum in the dtype loses (2^10 + 1 + 2^-5 - 2^10 + 3 * 2^-7):
    embedding_bag's backward (one row in five bags) and a segment sum give the correctly
    rounded sum in "exact" mode."""
    terms = torch.tensor([2.0**10, 1.0, 2.0**-5, -(2.0**10), 3 * 2.0**-7]).to(dtype)
    expected = exactly_rounded(terms.tolist(), dtype)
    weight = torch.zeros(2, 1, dtype=dtype, requires_grad=True)
    with detsum.deterministic("exact"):
        bags = torch.nn.functional.embedding_bag(torch.zeros(5, dtype=torch.int64), weight,
                                                 torch.arange(5), mode="sum")
        (grad,) = torch.autograd.grad(bags, weight, terms.view(5, 1))
        total = torch.segment_reduce(terms, "sum", lengths=torch.tensor([5]))
    assert_same_bits(grad[0, 0], expected)
    assert_same_bits(total[0], expected)


@pytest.mark.parametrize("dtype,limit", [(torch.float16, 2048), (torch.bfloat16, 256)],
                         ids=str)
def test_histc_counts_past_the_dtypes_integers(dtype, limit):
    """A bin of 3000 counts, more than the dtype holds exactly from ``limit`` on. torch counts
    in the dtype per thread (so its count there depends on the thread count; on one thread it
    stops at ``limit``): "autograd" gives its one-thread bits on any thread count; the other
    modes count in the accumulator and round the count once to the dtype."""
    values = torch.full((3000,), 0.25, dtype=dtype)
    values[:5] = 0.75
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = torch.histc(values, bins=2, min=0, max=1)
        assert one_thread.tolist() == [limit, 5]
        for count in (1, 2):
            torch.set_num_threads(count)
            counts, ran = run_counted("histc", "autograd",
                                      lambda: torch.histc(values, bins=2, min=0, max=1))
            assert ran == 1
            assert_same_bits(counts, one_thread)
            for mode in ("fp32", "kahan", "exact"):
                with detsum.deterministic(mode):
                    counts = torch.histc(values, bins=2, min=0, max=1)
                assert_same_bits(counts, torch.tensor([2995.0, 5.0]).to(dtype))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", detsum.MODES)
def test_histc_counted_as_integers_gives_the_bits_of_its_sum_of_ones(mode, monkeypatch):
    """On the CPU the switch counts each bin as an integer and rounds the count to the dtype
    where no count passes ``_exact_count_limit``; summing ones by ``index_add`` in the mode
    gives the same bits: bins of 0 to about 3000 counts (past float16's and bfloat16's
    integers), NaN and values outside the range, every dtype, with and without ``out=``."""
    counted = record_answers(monkeypatch, switch, "_exact_count_limit")
    g = torch.Generator().manual_seed(29)
    values = torch.cat([torch.full((3001,), 0.5), torch.full((257,), 1.5),
                        torch.full((2049,), 2.5), torch.rand(500, generator=g) * 8,
                        torch.tensor([math.nan, -1.0, 9.0, 8.0])])
    values = values[torch.randperm(values.numel(), generator=g)]
    for dtype in DTYPES:
        data = values.to(dtype)
        with detsum.deterministic(mode):
            got = torch.histc(data, bins=9, min=0, max=8)
            into = torch.histc(data, bins=9, min=0, max=8, out=torch.full((9,), math.nan,
                                                                          dtype=dtype))
        with monkeypatch.context() as patch, detsum.deterministic(mode):
            patch.setattr(switch, "_exact_count_limit", lambda *args: -1)
            expected = torch.histc(data, bins=9, min=0, max=8)
        assert_same_bits(got, expected)
        assert_same_bits(into, expected)
        assert float(got.sum()) > 0
    # Counted as integers wherever every count lies within the limit: all but the 16-bit
    # dtypes' "autograd" (3001 counts past 2048 and 256).
    assert len(counted) == 2 * len(DTYPES)
    assert counted[::2] == counted[1::2]  # with and without out=
    taken = {dtype: count_limit >= 3001 for dtype, count_limit in zip(DTYPES, counted[::2])}
    assert taken == {dtype: mode != "autograd" or dtype not in (torch.float16, torch.bfloat16)
                     for dtype in DTYPES}


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["exact", "kahan"])
def test_histc_on_a_gpus_path_counts_with_the_fp32_kernel_within_its_integers(monkeypatch,
                                                                                mode):
    """On a GPU's path "exact" and "kahan" count a histogram's ones with "fp32"'s kernel where
    there are no more elements than float32 holds integers: the bits of their own kernels
    (run with that limit cut below the count), bins past bfloat16's integers included."""
    modes = []
    index_add = switch._index_add_op._index_add

    def recorded(*args):
        modes.append(args[5])
        return index_add(*args)

    monkeypatch.setattr(switch._index_add_op, "_index_add", recorded)
    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
    g = torch.Generator().manual_seed(31)
    values = torch.cat([torch.full((301,), 0.5), torch.rand(60, generator=g) * 4,
                        torch.tensor([math.nan, -1.0, 5.0])]).to(torch.bfloat16)
    values[:40] = 2.5
    with detsum.backend("triton"), detsum.deterministic(mode):
        got = torch.histc(values, bins=5, min=0, max=4)
        with monkeypatch.context() as patch:
            patch.setattr(switch, "_exact_count_limit", lambda *args: -1)
            own_kernel = torch.histc(values, bins=5, min=0, max=4)
    assert modes == ["fp32", mode]
    assert_same_bits(got, own_kernel)
    assert float(got[0]) > 256  # past bfloat16's integers: rounded once


HISTC_RANGES = [(-1.3, 2.7, 7), (0, 10, 10), (-1e-3, 5e-3, 100), (0, 0, 3)]


def histc_edge_values(dtype, low, high, bins):
    """Values on and next to every bin edge of ``histc(bins, low, high)``, then NaN and values
    outside the range (but for ``low == high``, the data's range: NaN there is torch's
    error)."""
    edges = torch.linspace(-2.0 if low == high else low, 3.0 if low == high else high,
                           bins + 1, dtype=torch.float64)
    values = torch.cat([edges, edges.nextafter(edges - 1), edges.nextafter(edges + 1),
                        torch.tensor([math.nan, -1e3, 1e3])]).to(dtype)
    return values[:-3] if low == high else values


def test_histc_bins_at_their_edges_as_torch():
    """Values on and next to every bin edge, NaN and values outside the range: the same bins
    as torch's kernel for every dtype (its arithmetic in the dtype, step by step)."""
    for dtype in DTYPES:
        for low, high, bins in HISTC_RANGES:
            values = histc_edge_values(dtype, low, high, bins)
            expected = torch.histc(values, bins, low, high)
            counts, ran = run_counted("histc", "autograd",
                                      lambda: torch.histc(values, bins, low, high))
            assert ran == 1
            assert_same_bits(counts, expected)


def test_histc_counts_in_one_pass_the_positions_a_gpus_path_counts():
    """The CPU's one-pass count (``_segments.histogram``) and a GPU's path's positions
    (``switch._histc_positions``, torch's ops) put every element in the same bin, for every
    dtype, on generated ranges and data with values at and beside the edges, outside them,
    infinite and NaN, a non-contiguous tensor among them."""
    gen = torch.Generator().manual_seed(71)
    for dtype in DTYPES:
        for case in range(12):
            low = float(torch.randn((), generator=gen)) * 10 ** case % 3
            high = low + float(torch.rand((), generator=gen)) * 10 + 2 ** -6
            bins = int(torch.randint(1, 3000, (), generator=gen))
            values = torch.cat([low + (high - low) * torch.rand(5000, generator=gen) * 1.2 - 0.1,
                                torch.tensor([low, high, math.inf, -math.inf, math.nan])])
            values = values.to(dtype)
            if case % 2:
                values = values.repeat(2)[::2]
            edges = switch._histc_edges(values, bins, low, high)
            if edges is None:
                continue  # torch's call (a range past the dtype's)
            position = switch._histc_positions(values, bins, edges)
            expected = torch.bincount(position, minlength=bins + 1)[:bins]
            got = _segments.histogram(values, *edges, bins)
            assert torch.equal(got, expected), (dtype, case, low, high, bins)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["autograd", "fp32"])
def test_histc_bins_at_their_edges_on_cuda_as_torchs_cpu_histc(mode):
    """On CUDA (where torch refuses histc in deterministic mode) the switch's bins are torch's
    CPU bins, at the edges too: a division by a CPU scalar, which CUDA computes as a product
    with its reciprocal, would move values next to an edge to the other bin."""
    for dtype in DTYPES:
        for low, high, bins in HISTC_RANGES:
            values = histc_edge_values(dtype, low, high, bins)
            expected = torch.histc(values, bins, low, high)
            counts, ran = run_counted("histc", mode,
                                      lambda: torch.histc(values.cuda(), bins, low, high))
            assert ran == 1
            assert_same_bits(counts.cpu(), expected)


def test_histc_bins_past_a_half_dtypes_integers_run_on_detsum():
    """2048 and 4096 bins of float16 data over [0, 1]: ``bins + 1`` is no float16 value, and
    the test of the largest bin, made in Python, still takes the call (torch's bits); a
    range whose product passes float16's (bins 100 over 1000) goes to torch."""
    values = torch.rand(5000, generator=torch.Generator().manual_seed(3)).half()
    for bins in (2048, 4096):
        expected = torch.histc(values, bins=bins, min=0, max=1)
        counts, ran = run_counted("histc", "autograd",
                                  lambda: torch.histc(values, bins=bins, min=0, max=1))
        assert ran == 1, bins
        assert_same_bits(counts, expected)
    _, ran = run_counted("histc", "autograd",
                         lambda: torch.histc(values * 1000, bins=100, min=0, max=1000))
    assert ran == 0


def test_embedding_bag_max_backward_by_torch_is_torchs_max_backward():
    """The max backward that float16/bfloat16 "autograd" mode runs on CUDA (torch's
    deterministic scatter_add of the terms along the bags, an empty bag's at a spare row), on
    CPU float32, where torch's own max backward adds the same terms serially in bag order:
    the same bits. Bags share their maximum rows; one bag is empty."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(6, 4, generator=generator)
    index = torch.randint(0, 6, (40,), generator=generator)
    offsets = torch.tensor([0, 7, 7, 19, 33])
    _, offset2bag, bag_size, maximum = torch.ops.aten._embedding_bag(
        weight, index, offsets, False, 2, False, None, False, -1)
    grad = torch.randn(5, 4, generator=generator)
    expected = torch.ops.aten._embedding_bag_backward(
        grad, index, offsets, offset2bag, bag_size, maximum, 6, False, 2, False, None, -1)
    assert int((bag_size == 0).sum()) == 1 and maximum.unique().numel() < maximum.numel()
    assert_same_bits(switch._embedding_bag_max_backward_by_torch(grad, bag_size, maximum, 6),
                     expected)


def test_new_ops_fallbacks_per_mode():
    """The calls docs/enable.md leaves to torch, per mode: each runs torch's kernel (and so
    gives torch's bits)."""
    weight = data((7, 5), torch.float32, 0).requires_grad_()
    index = hot_index(600, 7, 1)
    half = weight.detach().half().requires_grad_()
    terms = 1 + data((600, 5), torch.float32, 2) / 64
    lengths = torch.tensor([420, 0, 100, 80])
    cases = [
        ("autograd", "nn.functional.embedding_bag",  # BLAS's axpy may fuse the scale
         lambda: embedding_bag_grad(weight, index, "mean")),
        ("autograd", "nn.functional.embedding_bag",
         lambda: embedding_bag_grad(weight, index, "sum",
                                    per_sample_weights=data(600, torch.float32, 3))),
        ("autograd", "nn.functional.embedding_bag",  # index_add_ per column, by layout
         lambda: embedding_bag_grad(half, index, "max")),
        ("fp32", "nn.functional.embedding_bag",
         lambda: embedding_bag_grad(weight, index, "sum", scale_grad_by_freq=True)),
        ("autograd", "_segment_reduce",  # torch rounds float16 products per factor
         lambda: torch.segment_reduce(terms.half(), "prod", lengths=lengths)),
        ("exact", "_segment_reduce",  # detsum has no exact product
         lambda: torch.segment_reduce(terms, "prod", lengths=lengths)),
    ]
    for mode, name, f in cases:
        expected = f()
        actual, ran = run_counted(name, mode, f)
        assert ran == 0, (mode, name)
        assert_same_bits(actual, expected)


@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_new_ops_index_out_of_range(mode):
    """An index outside its range raises detsum.IndexOutOfRangeError naming the torch op and
    the argument, before anything is computed (torch's kernels would read or write outside
    their tensors there), leaving every input as it was."""
    grad, indices = torch.ones(2, 3), torch.tensor([0, 9, 1])
    offset2bag, bag_size = torch.tensor([0, 0, 1]), torch.tensor([2, 1])
    maximum = torch.tensor([[0, 1, 2], [1, 7, 0]])
    inputs = [grad, indices, offset2bag, bag_size, maximum]
    kept = [t.clone() for t in inputs]
    with detsum.deterministic(mode):
        with pytest.raises(detsum.IndexOutOfRangeError,
                           match=r"^_embedding_bag_dense_backward \(run by detsum.deterministic\): "
                                 r"indices\[1\] = 9 is out of range for num_weights = 4"):
            torch.ops.aten._embedding_bag_dense_backward(grad, indices, offset2bag, bag_size,
                                                         maximum, 4, False, 0, None)
        with pytest.raises(detsum.IndexOutOfRangeError,
                           match=r"maximum_indices\[1, 1\] = 7 is out of range for "
                                 r"num_weights = 4"):
            torch.ops.aten._embedding_bag_dense_backward(grad, indices, offset2bag, bag_size,
                                                         maximum, 4, False, 2, None)
        with pytest.raises(detsum.IndexOutOfRangeError,
                           match=r"^segment_reduce \(run by detsum.deterministic\): "
                                 r"offsets\[3\] = 6 is out of range for data.size\(0\) = 5"):
            torch.segment_reduce(torch.ones(5), "sum", offsets=torch.tensor([0, 2, 2, 6]))
        with pytest.raises(IndexError, match=r"^segment_reduce \(run by detsum.deterministic\): "
                                             r"lengths\[1\] sum to 7, past data.size\(1\) = 5"):
            torch.segment_reduce(torch.ones(2, 5), "max", lengths=torch.tensor([[1, 2], [3, 4]]),
                                 axis=1, unsafe=True)
    for t, before in zip(inputs, kept):
        assert torch.equal(t, before)


@pytest.mark.parametrize("bounds", [
    {"offsets": [0, 2, 6]}, {"offsets": [0, 3, 2, 5]}, {"offsets": [-1, 2, 5]},
    {"lengths": [2, 2]}, {"lengths": [2, 4]}, {"lengths": [3, -1, 3]},
    {"lengths": [2, 4], "unsafe": True}], ids=str)
def test_segment_reduce_bounds_unread_on_a_gpus_path_checked_on_the_device(monkeypatch,
                                                                           bounds):
    """On a GPU's path a sum's 1-D bounds are not read back: offsets past the data or
    decreasing, lengths that do not sum to its rows (or, with ``unsafe=True``, sum past
    them) or negative, fail the launch's check on the device (here, CPU tensors under a
    GPU's check levels, at once), where torch's kernel would read outside data or its own
    check refuse."""
    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
    data = torch.ones(5, 3)
    given = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in bounds.items()}
    with detsum.deterministic("fp32"), detsum.backend("triton"):
        with pytest.raises(RuntimeError, match=r"detsum.segment_sum: offsets"):
            torch.segment_reduce(data, "sum", **given)
    assert torch.equal(data, torch.ones(5, 3))


@pytest.mark.parametrize("mode", ["fp32", "autograd"])
def test_new_ops_bad_inputs_give_torchs_errors(mode):
    """Inputs torch refuses go to torch, which gives its own error (and writes nothing)."""
    out = torch.full((4,), 7.0)
    with detsum.deterministic(mode):
        with pytest.raises(RuntimeError, match="max must be larger than min"):
            torch.histc(torch.arange(5.0), bins=4, min=3, max=1, out=out)
        with pytest.raises(RuntimeError, match="is not finite"):
            torch.histc(torch.tensor([1.0, math.nan]), bins=4)
        with pytest.raises(RuntimeError, match="to sum to data.size"):
            torch.segment_reduce(torch.ones(5), "sum", lengths=torch.tensor([1, 2]))
        with pytest.raises(RuntimeError, match="negative"):
            torch.segment_reduce(torch.ones(5), "sum", lengths=torch.tensor([6, -1]))
        with pytest.raises(RuntimeError):
            torch.segment_reduce(torch.ones(5), "sum", offsets=torch.tensor([0, 3, 2, 5]))
    assert torch.equal(out, torch.full((4,), 7.0))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_negative_index_values_count_from_the_end(dtype):
    """``switch._negatives_from_the_end`` (two ops, sign bit times ``-size`` added) against
    the compare-add-select it replaces, over every value in ``[-size - 3, size + 3)`` and the
    dtype's extremes: a value outside ``[-size, size)`` stays outside ``[0, size)``."""
    size = 7
    info = torch.iinfo(dtype)
    index = torch.cat([torch.arange(-size - 3, size + 3, dtype=dtype),
                       torch.tensor([info.min, info.min + size, info.max], dtype=dtype)])
    got = switch._negatives_from_the_end(index, size)
    assert got.dtype == dtype
    assert torch.equal(got, torch.where(index < 0, index + size, index))


def test_index_put_takes_the_values_torch_broadcasts():
    """The switch's own test of broadcasting (index_put_'s values against the indexed shape)
    answers as torch.broadcast_shapes, one way, on every pair of small shapes."""
    import itertools

    shapes = [()] + [s for n in (1, 2, 3) for s in itertools.product((1, 2, 3), repeat=n)]
    for shape, target in itertools.product(shapes, repeat=2):
        try:
            expected = torch.broadcast_shapes(shape, target) == torch.Size(target)
        except RuntimeError:
            expected = False
        assert switch._broadcasts_to(shape, target) == expected, (shape, target)


GPU_PATH_MODES = [("fp32", torch.float32), ("exact", torch.bfloat16), ("autograd", torch.float32)]


@pytest.mark.interpreter
@pytest.mark.parametrize("mode,dtype", GPU_PATH_MODES, ids=str)
@pytest.mark.parametrize("name,variant", NEW_OPS)
def test_new_ops_opinfo_samples_on_a_gpus_path_give_the_host_paths_bits(
        monkeypatch, name, variant, mode, dtype):
    """What a GPU's tensors take (the triton backend with a GPU's check levels: no value read
    back, padding rows, empty bags and values outside a histogram sent to a spare row), run
    on CPU tensors in Triton's interpreter: every sample gives the bits of the host path (the
    Numba backend), and runs on detsum where the host path does. ("autograd" here is the
    CPU's: on CUDA, segment_reduce and embedding_bag's sum and mean go to torch's kernel.)"""
    op, cases = samples(name, variant, dtype, requires_grad=name != "histc")
    for seed, sample in enumerate(cases):
        on_host, ran_on_host = run_counted(name, mode, lambda: results(op, sample, seed))
        monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
        with detsum.backend("triton"):
            on_device, ran = run_counted(name, mode, lambda: results(op, sample, seed))
        monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", False)
        assert ran == ran_on_host, (seed, sample.kwargs)
        for a, e in zip(on_device, on_host):
            assert_same_bits(a, e)


def _generated_new_op_calls(seed: int, dtype) -> dict:
    """Calls of embedding_bag's backward, segment_reduce and histc on inputs drawn from
    ``seed``: sizes, empty bags and segments, padding, per-sample weights, the last offset
    included, batches along an axis, an ``initial``, lengths that leave rows out, values
    outside a histogram's range and NaN."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    def randint(high, size=()):
        return torch.randint(0, high, size, generator=gen)

    n, width, table = int(randint(60)) + 1, int(randint(6)) + 1, int(randint(9)) + 1
    index = randint(table, (n,))
    cuts = randint(n + 1, (int(randint(5)),)).sort().values
    bags = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
    weight = draw(table, width)
    bag_mode = int(randint(3))
    padding = int(randint(table)) if bag_mode != 2 and int(randint(2)) else -1
    last = bool(randint(2))
    if last:
        bags = torch.cat([bags, torch.tensor([n])])
    per_sample = draw(n) if bag_mode == 0 and int(randint(2)) else None
    out, offset2bag, bag_size, maximum = torch.ops.aten._embedding_bag(
        weight, index, bags, False, bag_mode, False, per_sample, last, padding)
    grad = draw(*out.shape)
    batches, segments = int(randint(3)) + 1, int(randint(5)) + 1
    values = draw(batches, n, width)
    lengths = torch.stack([torch.bincount(randint(segments, (n,)), minlength=segments)
                           for _ in range(batches)])
    short = lengths // 2
    reduce = ["sum", "mean", "max", "min"][int(randint(4))]
    initial = [None, 0.0, -1.5][int(randint(3))]
    flat = draw(n)
    flat[randint(n, (3,))] = math.nan
    bins, low = int(randint(9)) + 1, float(draw(()))
    high = low + abs(float(draw(()))) + 0.25
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[0].cumsum(0)])
    return {
        "_embedding_bag_dense_backward": lambda: torch.ops.aten._embedding_bag_backward(
            grad, index, bags, offset2bag, bag_size, maximum, table, False, bag_mode, False,
            per_sample, padding),
        "segment_reduce": lambda: torch.segment_reduce(values, reduce, lengths=lengths, axis=1,
                                                       initial=initial),
        "segment_reduce offsets": lambda: torch.segment_reduce(values[0], reduce,
                                                               offsets=offsets, initial=initial),
        "segment_reduce unsafe": lambda: torch.segment_reduce(values, reduce, lengths=short,
                                                              axis=1, unsafe=True),
        "histc": lambda: torch.histc(flat, bins=bins, min=low, max=high),
    }


@pytest.mark.interpreter
@pytest.mark.parametrize("mode,dtype", [("fp32", torch.float32), ("kahan", torch.bfloat16),
                                        ("exact", torch.float16), ("autograd", torch.float64)],
                         ids=str)
def test_new_ops_generated_on_a_gpus_path_give_the_host_paths_bits(monkeypatch, mode, dtype):
    """Generated inputs (``_generated_new_op_calls``), 12 draws: on the GPU's path (the triton
    backend in the interpreter, a GPU's check levels) each call gives the host path's bits,
    and each runs on detsum there exactly where it does on the host path."""
    for seed in range(12):
        for name, call in _generated_new_op_calls(seed, dtype).items():
            operator = name.split()[0]
            before = switch.counts.copy()
            with detsum.deterministic(mode):
                on_host = call()
                monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
                try:
                    with detsum.backend("triton"):
                        on_device = call()
                finally:
                    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", False)
            ran = [how for (op, how), count in (switch.counts - before).items()
                   if op.split(".")[0] == operator for _ in range(count)]
            assert len(ran) == 2 and ran[0] == ran[-1], (seed, name, ran)
            assert_same_bits(on_device, on_host)


# ---- a few terms into a large tensor ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd", "exact"])
def test_in_place_scatters_into_a_large_tensor_touch_its_terms_elements_alone(
        mode, dtype, monkeypatch):
    """A scatter of a few terms into a tensor many times larger reduces the elements that
    receive terms alone, in place (once a copy of the whole tensor, twice, a call): the whole
    path's bits, in every form, reduction and mode, with repeated targets and rows that
    receive nothing; a value out of range is the whole path's error, nothing written."""
    taken = record_answers(monkeypatch, switch, "_scatter_touched_only")
    g = torch.Generator().manual_seed(83)
    rows = torch.tensor([7, 19_998, 7, 3, 19_998, 7, 12_345, 0, 7, 3])  # rows seen 1 to 4 times

    def forms(dim):
        """name -> (the call on a target, its rows along dim), for targets of 20000 rows."""
        shape = (len(rows), 5) if dim == 0 else (5, len(rows))
        terms = torch.randn(shape, generator=g).to(dtype)
        terms.view(-1)[::7] = 0  # zeros for the products
        along = rows.view(-1, 1) if dim == 0 else rows.view(1, -1)
        elementwise = torch.randint(0, 20_000, shape, generator=g)
        elementwise[:4] = elementwise[4:8] if dim == 0 else elementwise[:4]
        out = {}
        for reduce in ("sum", "mean", "amax", "amin", "prod"):
            if mode == "exact" and reduce == "prod":
                continue  # no exact product: left to torch
            for include_self in (True, False):
                key = f"{reduce}, include_self={include_self}"
                out[f"scatter_reduce_ rows {key}"] = lambda x, r=reduce, i=include_self: (
                    x.scatter_reduce_(dim, along.expand(shape), terms, r, include_self=i))
                out[f"scatter_reduce_ elements {key}"] = lambda x, r=reduce, i=include_self: (
                    x.scatter_reduce_(dim, elementwise, terms, r, include_self=i))
                if reduce != "sum":  # index_reduce has no sum
                    out[f"index_reduce_ {key}"] = lambda x, r=reduce, i=include_self: (
                        x.index_reduce_(dim, rows, terms, r, include_self=i))
        out["scatter_add_ rows"] = lambda x: x.scatter_add_(dim, along.expand(shape), terms)
        out["scatter_add_ elements"] = lambda x: x.scatter_add_(dim, elementwise, terms)
        return out

    compared = 0
    for dim in (0, 1):
        base = torch.randn((20_000, 5) if dim == 0 else (5, 20_000), generator=g).to(dtype)
        for name, call in forms(dim).items():
            taken.clear()
            with detsum.deterministic(mode):
                got = call(base.clone())
            if not taken:  # left to torch before the body (an "autograd" 16-bit mean, say)
                continue
            assert taken == [True], (name, dim)
            compared += 1
            with monkeypatch.context() as patch, detsum.deterministic(mode):
                patch.setattr(switch, "_scatter_touched_only", lambda *args: False)
                expected = call(base.clone())
            assert_same_bits(got, expected)
            assert not torch.equal(got, base), (name, dim)
    assert compared >= 20
    # (float32: "autograd" mode leaves a 16-bit scatter_add_ to torch, and its error.)
    target = base.float().clone()
    before = target.clone()
    bad = rows.clone()
    bad[5] = 20_000
    with detsum.deterministic(mode), pytest.raises(IndexError, match=r"^scatter_add_ \(run by "
                                                                      r"detsum.deterministic\)"):
        target.scatter_add_(1, bad.view(1, -1).expand(5, -1), torch.ones(5, 10))
    assert torch.equal(target, before)


@pytest.mark.parametrize("mode", ["fp32", "exact"])
def test_a_switched_calls_error_names_the_function_called_without_its_overload(mode):
    """An out-of-range value's error names the torch function the caller called, not the
    operator overload that runs it (``scatter_reduce_.two``, ``index_add.out``, the internal
    ``_index_put_impl_``), with the values expected; nothing is written."""
    x = torch.zeros(5, 2)
    bad, terms = torch.tensor([0, 9]), torch.ones(2, 2)
    expanded = bad.view(-1, 1).expand(2, 2)
    calls = {
        "scatter_reduce_": lambda: x.scatter_reduce_(0, expanded, terms, "sum"),
        "scatter_reduce": lambda: x.scatter_reduce(0, expanded, terms, "amax"),
        "scatter_add": lambda: torch.scatter_add(x, 0, expanded, terms, out=torch.empty(5, 2)),
        "index_add": lambda: torch.index_add(x, 0, bad, terms, out=torch.empty(5, 2)),
        "index_add_": lambda: x.index_add_(0, bad, terms),
        "index_reduce_": lambda: x.index_reduce_(0, bad, terms, "amax"),
        "index_put_": lambda: x.index_put_((bad,), terms, accumulate=True),
        "put_": lambda: x.put_(torch.tensor([0, -11]), torch.ones(2), accumulate=True),
    }
    expected = {"index_put_": r"index 9 is out of bounds for dimension 0 with size 5 "
                              r"\(expected -5 <= index < 5\)",
                "put_": r"tried to access index -11 on a tensor of 10 elements "
                        r"\(expected -10 <= index < 10\)"}
    for name, call in calls.items():
        detail = expected.get(name, r"index\[1(, 0)?\] = 9 is out of range")
        with detsum.deterministic(mode), pytest.raises(
                IndexError, match=rf"^{name} \(run by detsum.deterministic\): .*{detail}"):
            call()
        assert torch.equal(x, torch.zeros(5, 2)), name
