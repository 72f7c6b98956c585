"""Differential test: every primitive on every backend, where the features meet.

Each example draws a primitive's arguments: shape, dim (negative too), dtype, mode, segment
lengths straddling the 256-term chunk boundary (0, 1, 255, 256, 257, 513 among short ones),
alpha, include_self, sorted, the layout of the tensors (contiguous, transposed, sliced out of a
larger NaN-filled buffer, an expanded stride-0 source) and the data (spread over many binades,
plain, or with NaN, inf and signed zeros). It runs the primitive on the numba, triton (Triton's
interpreter without a GPU) and reference backends and asserts equal bits; in "autograd" mode
it also asserts torch's own bits where torch has the op (the "autograd" definitions of
docs/determinism.md). The alpha bug (the first term of every later chunk added unscaled)
lived where chunking met alpha != 1: this test draws those meetings on purpose.

Profiles (``conftest.differential_settings``): ``DETSUM_DIFFERENTIAL=ci`` (the default: a fixed
draw, about 3 minutes on a loaded 2-core AMD EPYC) or ``DETSUM_DIFFERENTIAL=nightly`` (many
more examples, for a long run: ``DETSUM_DIFFERENTIAL=nightly pytest tests/test_differential.py``).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

import detsum
from conftest import (DIFFERENTIAL_PROFILES, DTYPES, HAS_CUDA, MODE_REDUCTIONS, MODES,
                      assert_same_bits, differential_settings, make_data, torch_deterministic)

try:
    import triton  # noqa: F401
    BACKENDS = ("numba", "triton", "reference")
except ImportError:
    BACKENDS = ("numba", "reference")

DIFFERENTIAL = differential_settings(os.environ.get("DETSUM_DIFFERENTIAL", "ci"))

# Around the chunk boundary (CHUNK_TERMS = 256) and twice over it, among short segments.
SEGMENT_LENGTHS = (0, 1, 2, 3, 7, 255, 256, 257, 513)
LONG = 255
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded")
DATA_KINDS = ("spread", "plain", "special_values")
# The triton backend runs CPU tensors only in the interpreter; with a GPU it runs CUDA tensors.
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@st.composite
def segment_plans(draw):
    """(lengths of the output rows' segments, other dims, dim, interleaved, seed).

    At most two segments over 255 terms, so that an example stays about a second in the
    interpreter; the other dims stay small for the same reason (0 included: empty rows)."""
    n_out = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.sampled_from(SEGMENT_LENGTHS), min_size=n_out, max_size=n_out))
    long_seen = 0
    for i, n in enumerate(lengths):
        if n >= LONG:
            long_seen += 1
            if long_seen > 2:
                lengths[i] = 3
    ndim = draw(st.integers(1, 3))
    others = draw(st.lists(st.sampled_from([1, 2, 3, 0]), min_size=ndim - 1, max_size=ndim - 1))
    dim = draw(st.integers(-ndim, ndim - 1))
    interleaved = draw(st.booleans())
    return lengths, others, dim, interleaved, draw(st.integers(0, 2**31 - 1))


def full_shape(others, dim, size_at_dim):
    d = dim % (len(others) + 1)
    return tuple(others[:d]) + (size_at_dim,) + tuple(others[d:])


def draw_values(rng: random.Random, kind: str, shape, dtype, *, near_one=False):
    seed = rng.randrange(2**31)
    if near_one:
        # Products of hundreds of terms stay finite, and every chunk's rounding still shows.
        return (1 + make_data(shape, torch.float64, seed=seed) / 64).to(dtype)
    x = make_data(shape, dtype, seed=seed, spread=kind == "spread")
    if kind == "special_values":
        g = torch.Generator().manual_seed(seed + 1)
        pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")],
                            dtype=torch.float64).to(dtype)
        picks = pool[torch.randint(0, len(pool), shape, generator=g)]
        x = torch.where(torch.rand(shape, generator=g) < 0.05, picks, x)
    return x


def segment_of_rows(lengths, interleaved, rng: random.Random) -> torch.Tensor:
    """Row r's output row: sorted (contiguous segments) or shuffled (interleaved)."""
    rows = [out for out, n in enumerate(lengths) for _ in range(n)]
    if interleaved:
        rng.shuffle(rows)
    return torch.tensor(rows, dtype=torch.long)


def lay_out(t: torch.Tensor, layout: str, dim: int) -> torch.Tensor:
    """The same values as ``t`` in another memory layout; ``"expanded"`` is applied by the
    caller to the source only (it changes the values)."""
    if layout == "transposed" and t.dim() > 1:
        rev = list(range(t.dim()))[::-1]
        return t.permute(rev).contiguous().permute(rev)
    if layout == "sliced":
        # A view into a NaN-filled buffer one larger in every dim, offset by one: a kernel that
        # ignores the offset or the strides reads NaN.
        fill = float("nan") if t.is_floating_point() else -1
        buf = torch.full([s + 1 for s in t.shape], fill, dtype=t.dtype)
        view = buf[(slice(1, None),) * t.dim()]
        view.copy_(t)
        return view
    return t


def expand_along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t``'s first row along ``dim`` repeated by a stride-0 view (an expanded source)."""
    d = dim % t.dim()
    if t.shape[d] == 0:
        return t
    return t.narrow(d, 0, 1).expand(t.shape)


def on_every_backend(fn, *tensors):
    """``fn(*tensors)`` on each backend (the triton backend on TRITON_DEVICE), on the CPU."""
    results = {}
    for name in BACKENDS:
        device = TRITON_DEVICE if name == "triton" else "cpu"
        with detsum.backend(name):
            results[name] = fn(*[t.to(device) if isinstance(t, torch.Tensor) else t
                                 for t in tensors]).cpu()
    return results


def assert_all_equal(results, torch_bits_on=None):
    """Every backend's result the first's bits, and with ``torch_bits_on`` (device -> torch's
    bits computed there, or None where torch has none) torch's too. A GPU backend's result in
    "autograd" mode is torch's on the GPU instead: that mode's sums are torch's on the device
    (``modes.rule_for``), and a GPU's torch adds some layouts' terms otherwise than the CPU's."""
    first_name = BACKENDS[0]
    for name, got in results.items():
        device = TRITON_DEVICE if name == "triton" else "cpu"
        on_device = None if torch_bits_on is None or device == "cpu" else torch_bits_on(device)
        expected, against = ((results[first_name], first_name) if on_device is None
                             else (on_device.cpu(), f"torch on {device}"))
        try:
            assert_same_bits(got, expected)
        except AssertionError as e:
            raise AssertionError(f"{name} vs {against}: {e}") from e
    torch_bits = None if torch_bits_on is None else torch_bits_on("cpu")
    if torch_bits is not None:
        try:
            assert_same_bits(results[first_name], torch_bits)
        except AssertionError as e:
            raise AssertionError(f"{first_name} vs torch: {e}") from e


def index_put_accumulate(base, dim, index, values):
    """torch's gradient of a gather: "autograd" mode's definition of a sum."""
    d = dim % base.dim()
    with torch_deterministic():
        return torch.ops.aten.index_put_(base.clone(), [None] * d + [index], values, True)


@DIFFERENTIAL
@given(plan=segment_plans(), dtype=st.sampled_from(DTYPES), mode=st.sampled_from(MODES),
       alpha=st.sampled_from([1, 0, -1, 0.3]), layout=st.sampled_from(LAYOUTS),
       data_kind=st.sampled_from(DATA_KINDS), int32=st.booleans())
def test_index_add_on_every_backend(plan, dtype, mode, alpha, layout, data_kind, int32):
    lengths, others, dim, interleaved, seed = plan
    rng = random.Random(seed)
    index = segment_of_rows(lengths, interleaved, rng)
    input = draw_values(rng, data_kind, full_shape(others, dim, len(lengths)), dtype)
    source = draw_values(rng, data_kind, full_shape(others, dim, index.numel()), dtype)
    if layout == "expanded":
        source = expand_along(source, dim)
    else:
        input, source = lay_out(input, layout, dim), lay_out(source, layout, dim)
    if int32:
        index = index.to(torch.int32)
    note(f"lengths={lengths} input {tuple(input.shape)} dim={dim} interleaved={interleaved}")
    results = on_every_backend(
        lambda i, x, s: detsum.index_add(i, dim, x, s, alpha=alpha, mode=mode),
        input, index, source)
    torch_bits_on = None
    if mode == "autograd":
        # torch (and autograd) scale the source in the dtype before accumulating.
        scaled = source * alpha if alpha != 1 else source

        def torch_bits_on(device):
            return index_put_accumulate(input.to(device), dim, index.long().to(device),
                                        scaled.to(device))
    assert_all_equal(results, torch_bits_on)


@DIFFERENTIAL
@given(plan=segment_plans(), dtype=st.sampled_from(DTYPES), mode=st.sampled_from(MODES),
       layout=st.sampled_from(LAYOUTS), data_kind=st.sampled_from(DATA_KINDS),
       use_perm=st.booleans())
def test_segment_sum_on_every_backend(plan, dtype, mode, layout, data_kind, use_perm):
    lengths, others, dim, _, seed = plan
    rng = random.Random(seed)
    offsets = torch.tensor([0] + lengths).cumsum(0)
    rows = int(offsets[-1])
    src = draw_values(rng, data_kind, full_shape(others, dim, rows), dtype)
    src = expand_along(src, dim) if layout == "expanded" else lay_out(src, layout, dim)
    perm = None
    if use_perm and rows:
        perm = torch.tensor(rng.sample(range(rows), rows), dtype=torch.long)
    note(f"lengths={lengths} src {tuple(src.shape)} dim={dim} perm={perm is not None}")
    results = on_every_backend(
        lambda s, o, p: detsum.segment_sum(s, o, dim=dim, perm=p, mode=mode), src, offsets, perm)
    torch_bits_on = None
    if mode == "autograd":
        d = dim % src.dim()
        gathered = src if perm is None else src.index_select(d, perm)
        zeros = torch.zeros(full_shape(others, dim, len(lengths)), dtype=dtype)
        segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

        def torch_bits_on(device):
            return index_put_accumulate(zeros.to(device), dim, segment_ids.to(device),
                                        gathered.to(device))
    assert_all_equal(results, torch_bits_on)


def torch_scatter_reduce_bits(input, dim, index, src, reduce, include_self, elementwise):
    """torch's bits for "autograd" mode, where torch has the op: mean, prod, amax, amin are
    torch's own scatter_reduce (index materialized, off torch's expanded-index fast path); a
    sum with include_self and a row index is index_put_; None elsewhere."""
    d = dim % src.dim()
    if reduce == "sum":
        if include_self and not elementwise:
            return index_put_accumulate(input, dim, index, src)
        return None
    full_index = index
    if not elementwise:
        view = [-1 if k == d else 1 for k in range(src.dim())]
        full_index = index.view(view).expand(src.shape).contiguous()
    return torch.scatter_reduce(input, dim, full_index, src, reduce, include_self=include_self)


@DIFFERENTIAL
@given(plan=segment_plans(), dtype=st.sampled_from(DTYPES),
       mode_reduce=st.sampled_from(MODE_REDUCTIONS),
       include_self=st.booleans(), promise_sorted=st.booleans(), elementwise=st.booleans(),
       layout=st.sampled_from(LAYOUTS), data_kind=st.sampled_from(DATA_KINDS))
# Always run: no terms, promised sorted (an empty index, rare in a draw).
@example(plan=([0], [], 0, False, 0), dtype=torch.float32, mode_reduce=("autograd", "sum"),
         include_self=False, promise_sorted=True, elementwise=False, layout="contiguous",
         data_kind="spread")
def test_scatter_reduce_on_every_backend(plan, dtype, mode_reduce, include_self,
                                         promise_sorted, elementwise, layout, data_kind):
    mode, reduce = mode_reduce
    lengths, others, dim, interleaved, seed = plan
    rng = random.Random(seed)
    row_index = segment_of_rows(lengths, interleaved and not promise_sorted, rng)
    src_shape = full_shape(others, dim, row_index.numel())
    input = draw_values(rng, data_kind, full_shape(others, dim, len(lengths)), dtype,
                        near_one=reduce == "prod")
    src = draw_values(rng, data_kind, src_shape, dtype, near_one=reduce == "prod")
    elementwise = elementwise and not promise_sorted and len(src_shape) > 1
    index = row_index
    if elementwise:
        # Every column gets the same segment lengths in its own shuffled order.
        d = dim % len(src_shape)
        columns = src.movedim(d, -1).shape[:-1].numel()
        shuffled = torch.stack([row_index[torch.randperm(
            row_index.numel(), generator=torch.Generator().manual_seed(seed + c))]
            for c in range(columns)]) if columns else row_index.new_empty(0, row_index.numel())
        index = shuffled.view(*src.movedim(d, -1).shape).movedim(-1, d).contiguous()
    if layout == "expanded":
        src = expand_along(src, dim)
    else:
        input, src = lay_out(input, layout, dim), lay_out(src, layout, dim)
        index = lay_out(index, layout, dim) if elementwise else index
    note(f"lengths={lengths} src {tuple(src.shape)} dim={dim} elementwise={elementwise} "
         f"sorted={promise_sorted}")
    results = on_every_backend(
        lambda i, x, s: detsum.scatter_reduce(i, dim, x, s, reduce, include_self=include_self,
                                              mode=mode, sorted=promise_sorted),
        input, index, src)
    torch_bits_on = None
    if mode == "autograd" or reduce in ("amax", "amin"):
        # Only a sum's rule follows the device; the other reductions' is the CPU's everywhere.
        cpu_bits = torch_scatter_reduce_bits(input, dim, index, src, reduce, include_self,
                                             elementwise)

        def torch_bits_on(device):
            if device == "cpu" or reduce != "sum" or mode != "autograd":
                return cpu_bits
            return torch_scatter_reduce_bits(input.to(device), dim, index.to(device),
                                             src.to(device), reduce, include_self, elementwise)
    assert_all_equal(results, torch_bits_on)


def test_plans_reach_every_chunk_boundary():
    """The draw itself: otherwise the tests above could silently stop straddling chunks."""
    seen = set()

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(plan=segment_plans())
    def collect(plan):
        seen.update(plan[0])

    collect()
    assert {0, 1, 255, 256, 257, 513} <= seen


def test_alpha_scales_the_first_term_of_every_chunk():
    """The bug the differential test was written for, pinned: 257 ones with alpha = -1 gave
    -255 and 1000 ones with alpha = 0 gave 3.0 on the numba and triton backends ("fp32",
    "kahan"): the first term of every later 256-term chunk was added unscaled."""
    for n, alpha, expected in ((257, -1, -257.0), (513, -1, -513.0), (1000, 0, 0.0),
                               (600, 0.5, 300.0)):
        for mode in ("fp32", "kahan"):
            results = on_every_backend(
                lambda i, x, s: detsum.index_add(i, 0, x, s, alpha=alpha, mode=mode),
                torch.zeros(1), torch.zeros(n, dtype=torch.long), torch.ones(n))
            for name, got in results.items():
                assert got.item() == expected, (name, mode, n, alpha, got.item())


def test_profiles():
    assert differential_settings("ci").max_examples == DIFFERENTIAL_PROFILES["ci"]
    assert differential_settings("ci", ci_examples=7).max_examples == 7
    assert differential_settings("nightly").max_examples == DIFFERENTIAL_PROFILES["nightly"]
    assert differential_settings("nightly", ci_examples=7).max_examples == 1500
    assert differential_settings("ci").derandomize
    assert not differential_settings("nightly").derandomize
    with pytest.raises(ValueError, match="DETSUM_DIFFERENTIAL='weekly'"):
        differential_settings("weekly")
