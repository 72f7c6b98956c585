"""Differential test of the switch (``detsum.enable``): torch's own calls, drawn, on every path.

The switch takes a call by one of several paths, picked by its size and form: the C++
kernels (small float32/float64 in-place sums, maxima and minima), the short ways (one Numba
call for a small call), the primitives' general path (a plan; past 256 terms a row, the
chunks), a pass over one column of many terms (32768 or more), and torch's own kernel for
what detsum does not take. Each example draws one of torch's calls that the switch covers,
with sizes on both sides of those lines, an index that is uniform, hot (most terms on one
row, past a chunk) or sorted, the data (plain, spread over many binades, or with NaN, inf
and signed zeros), the dtype and the call's own options, and asserts:

- ``"autograd"``: the bits torch gives under ``torch.use_deterministic_algorithms(True)`` (on
  one thread: docs/enable.md);
- ``"fp32"``, ``"kahan"``, ``"exact"``: the bits of the same call under the switch with every
  primitive forced onto the reference backend (which takes the C++ kernels and the short ways
  out of the way: the contract's loops), on torch's thread count and on one thread;
- where torch refuses a call, torch's error; where torch takes it, a result of torch's shape
  and dtype (but for the few calls torch's own kernels get wrong: ``torchs_outcomes``).

Profiles as in ``test_differential.py``: ``DETSUM_DIFFERENTIAL=ci`` (the default, a fixed
draw) or ``nightly`` (a fresh draw of many more examples).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

import detsum
from check_levels import gpu_path
from conftest import assert_same_bits, differential_settings, make_data, torch_deterministic
from detsum.kernels import CHUNK_TERMS, SMALL_CALL_ELEMENTS

pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta:UserWarning")

PROFILE = os.environ.get("DETSUM_DIFFERENTIAL", "ci")
DIFFERENTIAL = differential_settings(PROFILE, ci_examples=40)
# Triton's interpreter takes seconds where Numba takes milliseconds: fewer, smaller calls.
GPU_PATH = differential_settings(PROFILE, ci_examples=15)
GPU_PATH_MAX_TERMS = 3000

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
OTHER_MODES = ("fp32", "kahan", "exact")

# Terms a call adds, around the lines the switch's paths are picked by: a 256-term chunk
# (a row past it leaves the short ways), 65536 elements (the small calls' limit) and 32768
# terms of one column (the one pass).
TERM_COUNTS = (0, 1, 3, 40, 255, 256, 257, 700, 3000)
ONE_COLUMN_TERMS = (32767, 32768, 40000)

# The call forms: each builds its call from a drawn case (``build``).
FORMS = ("index_add", "index_add_", "index_add_dim1", "index_add out", "scatter_add",
         "scatter_add_", "scatter_add_elements", "scatter_reduce", "scatter_reduce_",
         "scatter_reduce out", "index_reduce", "index_reduce out", "index_put_",
         "x[idx] backward", "x[idx2d] backward", "gather backward", "index_select backward",
         "put_", "bincount", "embedding backward", "embedding_bag backward", "segment_reduce",
         "segment_reduce offsets", "histc", "histc out")
# The forms drawn with an outer dim too: tensors of three dims, reduced along the middle one.
OUTER_FORMS = ("index_add", "index_add_", "index_add out", "scatter_add", "scatter_add_",
               "scatter_reduce", "scatter_reduce_", "scatter_reduce out", "index_reduce",
               "index_reduce out", "index_put_", "x[idx] backward", "gather backward",
               "index_select backward")
# The forms whose index may count from the end (torch reads -1 as the last row).
NEGATIVE_FORMS = ("index_put_", "x[idx] backward", "put_")
# The forms that take one column of many terms.
ONE_COLUMN_FORMS = ("index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
                    "scatter_reduce_", "index_put_", "x[idx] backward", "gather backward",
                    "index_select backward", "put_", "bincount",
                    "embedding backward", "histc")
SCATTER_REDUCTIONS = ("sum", "mean", "prod", "amax", "amin")
INDEX_REDUCTIONS = ("prod", "mean", "amax", "amin")
SEGMENT_REDUCTIONS = ("sum", "mean", "max", "min", "prod")
BAG_MODES = ("sum", "mean", "max")


@st.composite
def switched_calls(draw, max_terms=None):
    """A dict naming one switched call: its form and everything ``build`` needs; at most
    ``max_terms`` terms where given."""
    form = draw(st.sampled_from(FORMS))
    one_column = (form in ONE_COLUMN_FORMS and max_terms is None
                  and draw(st.integers(0, 5)) == 0)
    case = {
        "form": form,
        "dtype": draw(st.sampled_from(DTYPES)),
        "rows": draw(st.sampled_from((1, 2, 7, 40, 300))),
        "width": 1 if one_column else draw(st.sampled_from((1, 2, 5, 33))),
        "terms": draw(st.sampled_from(ONE_COLUMN_TERMS if one_column else tuple(
            n for n in TERM_COUNTS if max_terms is None or n <= max_terms))),
        "index": draw(st.sampled_from(("uniform", "hot", "sorted"))),
        "data": draw(st.sampled_from(("plain", "spread", "special_values"))),
        "int32": draw(st.booleans()),
        "include_self": draw(st.booleans()),
        "noncontiguous": draw(st.booleans()),
        "alpha": draw(st.sampled_from((1, 1, -2, 0.3))),
        "outer": 1 if one_column or form not in OUTER_FORMS else draw(st.sampled_from((1, 1, 3))),
        "negative": form in NEGATIVE_FORMS and draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    if form in ("scatter_reduce", "scatter_reduce_", "scatter_reduce out"):
        case["reduce"] = draw(st.sampled_from(SCATTER_REDUCTIONS))
    elif form in ("index_reduce", "index_reduce out"):
        case["reduce"] = draw(st.sampled_from(INDEX_REDUCTIONS))
    elif form in ("segment_reduce", "segment_reduce offsets"):
        case["reduce"] = draw(st.sampled_from(SEGMENT_REDUCTIONS))
        case["initial"] = draw(st.sampled_from((None, 0.0, 2.0)))
    elif form == "embedding_bag backward":
        case["reduce"] = draw(st.sampled_from(BAG_MODES))
        case["per_sample_weights"] = case["reduce"] == "sum" and draw(st.booleans())
    if form in ("embedding backward", "embedding_bag backward"):
        case["padding_idx"] = draw(st.sampled_from((None, 0)))
    if form == "embedding backward":
        case["scale_grad_by_freq"] = draw(st.booleans())
    return case


# Found by the nightly draw: one bag holding only the padding index, so every bag is empty.
EVERY_BAG_EMPTY = {
    "form": "embedding_bag backward", "dtype": torch.float32, "rows": 1, "width": 1,
    "terms": 1, "index": "uniform", "data": "plain", "int32": False, "include_self": False,
    "noncontiguous": False, "alpha": 1, "outer": 1, "negative": False, "seed": 0,
    "reduce": "max", "per_sample_weights": False, "padding_idx": 0}

# Found by the nightly draw: data (2, 1) with strides (1, 2) along axis 1, which torch misreads.
TRANSPOSED_ROW = {
    "form": "segment_reduce offsets", "dtype": torch.float32, "rows": 1, "width": 2,
    "terms": 1, "index": "uniform", "data": "plain", "int32": False, "include_self": False,
    "noncontiguous": False, "alpha": 1, "outer": 1, "negative": False, "seed": 1,
    "reduce": "sum", "initial": None}

# Found by the nightly draw: an index_reduce amax over rows of 33 float32 elements whose terms
# hold zeros of both signs.
ZERO_TIES = {
    "form": "index_reduce", "dtype": torch.float32, "rows": 40, "width": 33, "terms": 255,
    "index": "uniform", "data": "special_values", "int32": False, "include_self": False,
    "noncontiguous": False, "alpha": 1, "outer": 1, "negative": False, "seed": 0,
    "reduce": "amax"}


def values(rng: random.Random, kind: str, shape, dtype) -> torch.Tensor:
    """Data of ``shape``: plain normal, ``spread`` over many binades, or with specials. (Like
    ``test_differential.draw_values``, but drawn otherwise: the examples pinned above were
    found with this draw, and hold their cases only through it.)"""
    x = make_data(shape, dtype, seed=rng.randrange(2**31), spread=kind == "spread")
    if kind == "special_values" and x.numel():
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0],
                                dtype=dtype)
        picks = torch.rand(shape, generator=g) < 0.05
        x[picks] = specials[torch.randint(0, len(specials), (int(picks.sum()),), generator=g)]
    return x


def index_of(rng: random.Random, kind: str, count: int, rows: int) -> torch.Tensor:
    """``count`` int64 values in ``[0, rows)``: uniform, ``hot`` (seven in ten on one row,
    past a chunk whenever there are 366 terms or more) or ``sorted``."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    index = torch.randint(0, rows, (count,), generator=g)
    if kind == "hot":
        index[torch.rand(count, generator=g) < 0.7] = rng.randrange(rows)
    elif kind == "sorted":
        index = index.sort().values
    return index


def lay_out(x: torch.Tensor, noncontiguous: bool) -> torch.Tensor:
    """``x``, or the same values in a buffer of its dims reversed (a tensor of other
    strides)."""
    if not noncontiguous or x.dim() < 2:
        return x
    return x.transpose(0, -1).contiguous().transpose(0, -1)


def backward_of(function, weight, grad):
    """A function of nothing: the gradient of ``function(weight)`` for ``grad``, with
    respect to a fresh copy of ``weight`` (the call whose backward accumulates)."""
    def backward():
        leaf = weight.detach().clone().requires_grad_()
        return torch.autograd.grad(function(leaf), leaf, grad)[0]
    return backward


def build(case: dict, *, torchs_strides: bool = False):
    """The call ``case`` names: a function of nothing that makes fresh tensors (so in-place
    forms start from the same values each time) and returns the call's result.
    ``torchs_strides``: ``segment_reduce``'s data with the strides of a new tensor, which
    torch's kernel needs (``TORCH_MISREADS_STRIDES``)."""
    form, dtype = case["form"], case["dtype"]
    rows, width, terms = case["rows"], case["width"], case["terms"]
    rng = random.Random(case["seed"])
    index = index_of(rng, case["index"], terms, rows)
    if case["negative"]:
        index = index - rows
    if case["int32"] and form not in ("embedding backward", "embedding_bag backward",
                                      "gather backward", "index_select backward"):
        index = index.int()
    # With an outer dim, (outer, rows, width) reduced along dim 1; else (rows, width) along 0.
    outer = (case["outer"],) if case["outer"] > 1 else ()
    dim = len(outer)
    target = lay_out(values(rng, case["data"], (*outer, rows, width), dtype),
                     case["noncontiguous"])
    source = lay_out(values(rng, case["data"], (*outer, terms, width), dtype),
                     case["noncontiguous"])
    include_self = case["include_self"]
    reduce = case.get("reduce")
    if form == "index_add":
        return lambda: target.index_add(dim, index, source, alpha=case["alpha"])
    if form == "index_add_":
        return lambda: target.clone().index_add_(dim, index, source, alpha=case["alpha"])
    if form == "index_add out":
        return lambda: torch.index_add(target, dim, index, source, alpha=case["alpha"],
                                       out=torch.full_like(target, float("nan")))
    if form == "index_select backward":
        return backward_of(lambda weight: weight.index_select(dim, index), target, source)
    if form == "index_add_dim1":
        return lambda: target.t().clone().index_add_(1, index, source.t(), alpha=case["alpha"])
    wide = index.view(*(1 for _ in outer), -1, 1).expand(source.shape)
    if form == "gather backward":
        return backward_of(lambda weight: weight.gather(dim, wide), target, source)
    if form == "scatter_reduce out":
        return lambda: torch.scatter_reduce(target, dim, wide, source, reduce,
                                            include_self=include_self,
                                            out=torch.full_like(target, float("nan")))
    if form in ("scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"):
        if form == "scatter_add":
            return lambda: target.scatter_add(dim, wide, source)
        if form == "scatter_add_":
            return lambda: target.clone().scatter_add_(dim, wide, source)
        if form == "scatter_reduce":
            return lambda: target.scatter_reduce(dim, wide, source, reduce,
                                                 include_self=include_self)
        return lambda: target.clone().scatter_reduce_(dim, wide, source, reduce,
                                                      include_self=include_self)
    if form == "scatter_add_elements":
        # An index of its own for every element, over fewer rows of the source than it has.
        elements = index_of(rng, case["index"], terms * width, rows).view(terms, width)
        elements = elements[: max(terms - 1, 0)]
        return lambda: target.scatter_add(0, elements, source)
    if form == "index_reduce":
        return lambda: target.index_reduce(dim, index, source, reduce,
                                           include_self=include_self)
    if form == "index_reduce out":
        return lambda: torch.index_reduce(target, dim, index, source, reduce,
                                          include_self=include_self,
                                          out=torch.full_like(target, float("nan")))
    # x[idx] or x[:, idx]: the index after full slices.
    at = (slice(None),) * dim + (index,)
    if form == "index_put_":
        return lambda: target.clone().index_put_(at, source, accumulate=True)
    if form == "x[idx] backward":
        return backward_of(lambda weight: weight[at], target, source)
    if form == "x[idx2d] backward":
        # An index of two dims: its terms in row-major order, as torch flattens it.
        halves = (2, terms // 2) if terms % 2 == 0 else (1, terms)
        return backward_of(lambda weight: weight[index.view(halves)], target,
                           source.reshape(*halves, width))
    if form == "put_":
        flat = index_of(rng, case["index"], terms, rows * width)  # put_ takes int64 only
        if case["negative"]:
            flat = flat - rows * width
        return lambda: target.clone().put_(flat, source[:, 0].contiguous(), accumulate=True)
    if form == "bincount":
        return lambda: torch.bincount(index, source[:, 0], minlength=rows)
    if form == "histc":
        # Over [-2, 2], or (0, 0) for the data's own range.
        low, high = (-2, 2) if case["include_self"] else (0, 0)
        return lambda: torch.histc(source[:, 0], bins=rows, min=low, max=high)
    if form == "histc out":
        return lambda: torch.histc(source[:, 0], bins=rows, min=-2, max=2,
                                   out=torch.full((rows,), float("nan"), dtype=dtype))
    if form == "embedding backward":
        return backward_of(lambda weight: torch.nn.functional.embedding(
            index, weight, padding_idx=case["padding_idx"],
            scale_grad_by_freq=case["scale_grad_by_freq"]), target, source)
    if form == "embedding_bag backward":
        bags = sorted(rng.randrange(terms + 1) for _ in range(rng.randrange(1, 6)))
        offsets = torch.tensor([0] + bags[1:], dtype=torch.int64)
        grad = values(rng, case["data"], (len(offsets), width), dtype)
        weights = values(rng, "plain", (terms,), dtype) if case["per_sample_weights"] else None
        return backward_of(lambda weight: torch.nn.functional.embedding_bag(
            index, weight, offsets, mode=reduce, per_sample_weights=weights,
            padding_idx=case["padding_idx"]), target, grad)
    if form == "segment_reduce":
        cuts = sorted(rng.randrange(terms + 1) for _ in range(rows - 1))
        lengths = torch.tensor([b - a for a, b in zip([0] + cuts, cuts + [terms])])
        data = 1 + source / 64 if reduce == "prod" else source
        if torchs_strides:
            data = data.clone(memory_format=torch.contiguous_format)
        return lambda: torch.segment_reduce(data, reduce, lengths=lengths,
                                            initial=case["initial"])
    if form == "segment_reduce offsets":
        # Along axis 1, over offsets that may leave rows out at both ends.
        offsets = torch.tensor(sorted(rng.randrange(terms + 1) for _ in range(rows + 1)))
        data = (1 + source / 64 if reduce == "prod" else source).t()
        if torchs_strides:
            data = data.clone(memory_format=torch.contiguous_format)
        return lambda: torch.segment_reduce(data, reduce, offsets=offsets.expand(width, -1),
                                            axis=1, initial=case["initial"])
    raise AssertionError(f"no call built for {form!r}")


def explain(case: dict) -> None:
    note(", ".join(f"{k}={v}" for k, v in case.items()))


def outcome(call):
    """(the call's result, None), or (None, the exception it raised)."""
    try:
        return call(), None
    except Exception as error:  # noqa: BLE001 - compared with the other side's below
        return None, error


def assert_same_outcome(actual, expected) -> None:
    """The same bits, or the same error (type and message): a call torch refuses is refused
    under the switch in torch's own words."""
    (got, got_error), (want, want_error) = actual, expected
    if want_error is not None or got_error is not None:
        assert type(got_error) is type(want_error), (got_error, want_error)
        assert words(got_error) == words(want_error)
        return
    assert_same_bits(got, want)


def words(error: Exception) -> str:
    """An error's message, a NaN's sign left out: torch's own message for a range of NaN
    (``histc``) names ``-nan`` on one thread and ``nan`` on two."""
    return str(error).replace("-nan", "nan")


def on_one_thread(call):
    """The call's outcome with torch (and detsum, which follows it) on one thread. torch's own
    bits depend on its thread count only where it counts per thread (``histc`` past the
    dtype's integers): the switch's "autograd" mode gives its one-thread bits
    (docs/enable.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return outcome(call)
    finally:
        torch.set_num_threads(threads)


# Where torch 2.13's CPU kernels go wrong (docs/enable.md), and what the switch is held to
# there. Its scatter refuses an int32 index expanded with stride 0 over rows of 16 elements or
# more (its kernel for that form reads int64 only): the switch takes it, with the bits of the
# same index in int64.
TORCH_REFUSES_INT32 = "expected scalar type Long but found Int"
# Its index_reduce fails an internal assert (a bug of its own, it says) on some small
# float16/bfloat16 products: the switch may give an answer there.
TORCH_FAILS_ITS_ASSERT = "INTERNAL ASSERT FAILED"
# Its segment_reduce reads outside ``data`` where a dim of size one has a stride other than a
# new tensor's (a transposed (1, n) tensor; ``data.contiguous()`` keeps such strides): the
# switch is held to torch's bits for the same values with a new tensor's strides.
TORCH_MISREADS_STRIDES = ("segment_reduce", "segment_reduce offsets")


def torchs_outcomes(case: dict, run) -> list:
    """The outcomes the switch may give the call, torch's as ``run(build(case))`` gives it
    (with the strides torch reads right): torch's one; for an int32 index that torch's kernel
    refuses (above), also its outcome for the same index in int64, which the switch gives
    where it takes the call (where it leaves the call to torch, torch's error)."""
    result = run(build(case, torchs_strides=case["form"] in TORCH_MISREADS_STRIDES))
    error = result[1]
    if case["int32"] and isinstance(error, RuntimeError) and str(error) == TORCH_REFUSES_INT32:
        return [result, run(build({**case, "int32": False}))]
    return [result]


def assert_one_of(actual, allowed: list) -> None:
    """``assert_same_outcome(actual, e)`` for some ``e`` in ``allowed``."""
    for expected in allowed[:-1]:
        try:
            assert_same_outcome(actual, expected)
            return
        except AssertionError:
            pass
    assert_same_outcome(actual, allowed[-1])


@DIFFERENTIAL
@given(case=switched_calls())
@example(case=EVERY_BAG_EMPTY).via("an every-bag-empty max backward crashed the switch")
@example(case=TRANSPOSED_ROW).via("torch's segment_reduce misreads a size-one dim's stride")
@example(case=ZERO_TIES).via("torch's vector loops keep the later of a +0.0/-0.0 tie")
def test_autograd_mode_gives_torchs_deterministic_bits(case):
    explain(case)
    with torch_deterministic():
        allowed = torchs_outcomes(case, on_one_thread)
    with detsum.deterministic("autograd"):
        actual = outcome(build(case))
    assert_one_of(actual, allowed)


@DIFFERENTIAL
@given(case=switched_calls(), mode=st.sampled_from(OTHER_MODES))
@example(case=EVERY_BAG_EMPTY, mode="fp32").via("the same, in every mode")
def test_other_modes_give_the_reference_backends_bits(case, mode):
    explain(case)
    note(f"mode={mode}")
    call = build(case)
    torchs = torchs_outcomes(case, outcome)
    with detsum.deterministic(mode):
        with detsum.backend("reference"):
            expected = outcome(call)
        actual = outcome(call)
        on_one = on_one_thread(call)
    assert_same_outcome(actual, expected)
    assert_same_outcome(on_one, actual)  # the same bits on any thread count
    # What torch refuses, the switch refuses in torch's words; what torch takes, it takes,
    # into torch's shape and dtype.
    got, got_error = actual
    if any(TORCH_FAILS_ITS_ASSERT in str(error) for _, error in torchs):
        return
    if got_error is not None:
        assert any(type(error) is type(got_error) and words(error) == words(got_error)
                   for _, error in torchs), (got_error, torchs)
    else:
        taken = [result for result, error in torchs if error is None]
        assert taken, ("taken where torch refuses", torchs)
        assert (got.shape, got.dtype) == (taken[-1].shape, taken[-1].dtype)


@pytest.mark.interpreter
@GPU_PATH
@given(case=switched_calls(max_terms=GPU_PATH_MAX_TERMS), mode=st.sampled_from(detsum.MODES))
def test_a_gpus_path_gives_the_host_paths_bits(case, mode):
    """What a GPU's tensors take under the switch (the triton backend with a GPU's check
    levels: no value read back, padding rows, empty bags and values outside a histogram sent
    to a spare row), run on CPU tensors in Triton's interpreter, gives the bits of the host
    path (the Numba backend, the C++ kernels and the short ways, with a GPU's check levels
    too), or its error. ("autograd" here is detsum's own rule on both paths: on CUDA some
    forms go to torch's CUDA kernels, and no zero tie goes to torch's CPU kernel.)"""
    explain(case)
    note(f"mode={mode}")
    call = build(case)
    with detsum.deterministic(mode), gpu_path("numba"):
        on_host = outcome(call)  # the Numba backend checks on the host whatever it is asked
        with detsum.backend("triton"):
            on_device = outcome(call)
    assert_same_outcome(on_device, on_host)


def test_the_draw_reaches_every_form_on_both_sides_of_each_line():
    """The draw itself: otherwise the tests above could silently stop reaching a path."""
    seen = []

    @differential_settings("ci", ci_examples=1000)
    @given(case=switched_calls())
    def collect(case):
        seen.append(case)

    collect()
    assert {c["form"] for c in seen} == set(FORMS)
    assert {c["form"] for c in seen if c["terms"] in ONE_COLUMN_TERMS} == set(ONE_COLUMN_FORMS)
    for terms in (0, CHUNK_TERMS - 1, CHUNK_TERMS, CHUNK_TERMS + 1, 32767, 32768):
        assert any(c["terms"] == terms for c in seen), terms
    # One row past a chunk (seven in ten terms on it): the short ways' line.
    assert any(c["index"] == "hot" and c["terms"] * 0.7 > 1.2 * CHUNK_TERMS for c in seen)
    # Past the small calls' limit with rows of several elements, not only one column.
    assert any(c["width"] > 1 and (c["rows"] + c["terms"]) * c["width"] > SMALL_CALL_ELEMENTS
               for c in seen)
    assert {c["outer"] for c in seen} == {1, 3}
    for key in ("int32", "include_self", "noncontiguous", "negative"):
        assert {c[key] for c in seen} == {True, False}, key
    assert {c["data"] for c in seen} == {"plain", "spread", "special_values"}
    assert {c["dtype"] for c in seen} == set(DTYPES)
