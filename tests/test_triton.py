"""The Triton backend: bit for bit the Numba backend (and the reference), on every primitive.

Without a GPU these run Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1
before triton is imported), on small shapes: the interpreter runs each program in Python, so
a term row costs about a millisecond. There each sweep runs a covering of its parameters
(tests/covering.py) instead of every combination: every value of every parameter, and every
pair of values of the parameters its comment names, meet in some case. On a GPU the sweeps
take every combination, and the same tests run the compiled kernels on CUDA tensors and
compare them with Numba on CPU copies; "autograd" mode there follows torch's CUDA
arithmetic, which the reference computes with ``device_type="cuda"``.
"""

from __future__ import annotations

import os
import unittest.mock

import pytest
import torch

import detsum
from conftest import (
    DTYPES, HAS_CUDA, LAYOUTS, MODE_REDUCTIONS, MODES, N, assert_same_bits, dtype_id,
    make_data, seed_of, strided_copy, with_rows)
from covering import pairwise
from detsum import kernels, reference

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
if HAS_TRITON:
    from detsum.kernels.triton.segment import _TERM_STAGES
    TERM_STAGES = _TERM_STAGES.value
else:
    TERM_STAGES = 5

pytestmark = pytest.mark.skipif(
    not HAS_TRITON or not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton, and a GPU or TRITON_INTERPRET=1")

DEVICE = "cuda" if HAS_CUDA else "cpu"
N_OUT = 5
CHUNK = kernels.CHUNK_TERMS


def on_device(t):
    return None if t is None else t.to(DEVICE)


def triton_and_expected(fn, mode, *tensors):
    """``fn(*tensors)`` on the triton backend (tensors on DEVICE) and the result it must equal:
    the Numba backend on CPU, or, for "autograd" on CUDA, the reference's CUDA arithmetic."""
    with detsum.backend("triton"):
        got = fn(*[on_device(t) for t in tensors]).cpu()
    if mode == "autograd" and DEVICE == "cuda":
        return got, None
    with detsum.backend("numba"):
        expected = fn(*tensors)
    return got, expected


# ---- index_add: every layout, case, dtype and mode ---------------------------------------------

CASES = [
    "uniform",  # 13 source rows over 5 outputs
    "empty_segments",  # only odd outputs receive rows
    "zero_rows",  # an empty index
    "zero_columns",  # every row has 0 elements
    "noncontiguous",  # strided views with dims stored in reverse
    "alpha",  # alpha = 0.3: the scaled term rounds on its own (no FMA)
]


def make_index_add_case(template, dim, dtype, case):
    rows = 0 if case == "zero_rows" else 13
    zero_columns = case == "zero_columns"
    seed = seed_of("triton", template, dim, dtype, case)
    input = make_data(with_rows(template, N_OUT, zero_columns=zero_columns), dtype, seed=seed,
                      spread=True)
    source = make_data(with_rows(template, rows, zero_columns=zero_columns), dtype,
                       seed=seed + 1, spread=True)
    g = torch.Generator().manual_seed(seed + 2)
    index = torch.randint(0, N_OUT, (rows,), generator=g)
    if case == "empty_segments":
        index = 2 * torch.randint(0, N_OUT // 2, (rows,), generator=g) + 1
    if case == "noncontiguous":
        input, source, index = strided_copy(input), strided_copy(source), strided_copy(index)
    return input, index, source, 0.3 if case == "alpha" else 1


def index_add_allowed(mode, dtype, template, dim, case):
    # A 1-D tensor has no other dim to empty.
    return not (case == "zero_columns" and len(template) == 1)


# Every pair of mode, dtype, layout and case: each layout with every case, each mode with
# every dtype and every case, each dtype with every case and layout.
@pytest.mark.parametrize("mode,dtype,template,dim,case", pairwise(
    [MODES, DTYPES, LAYOUTS, CASES], allowed=index_add_allowed, everything=HAS_CUDA))
def test_index_add(mode, dtype, template, dim, case):
    input, index, source, alpha = make_index_add_case(template, dim, dtype, case)
    got, expected = triton_and_expected(
        lambda i, x, s: detsum.index_add(i, dim, x, s, alpha=alpha, mode=mode),
        mode, input, index, source)
    if expected is None:
        expected = reference.index_add(input, dim, index, source, alpha=alpha, mode=mode,
                                       device_type="cuda")
    assert_same_bits(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_index_add_inplace_and_special_values(dtype):
    """NaN, +-inf and signed zeros, in place: outputs without terms keep their exact bits."""
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 3.5])
    g = torch.Generator().manual_seed(7)
    input = pool[torch.randint(0, len(pool), (7, 6), generator=g)].to(dtype)
    source = pool[torch.randint(0, len(pool), (20, 6), generator=g)].to(dtype)
    index = torch.randint(0, 5, (20,), generator=g)
    for mode in MODES:
        got, expected = triton_and_expected(
            lambda i, x, s: detsum.index_add_(i.clone(), 0, x, s, mode=mode), mode,
            input, index, source)
        if expected is None:
            expected = reference.index_add(input, 0, index, source, mode=mode,
                                           device_type="cuda")
        assert_same_bits(got, expected)
        assert_same_bits(got[5:], input[5:])


# ---- segment_sum and scatter_reduce ------------------------------------------------------------

# Every pair of mode, dtype, layout and rows given by offsets alone or through a permutation.
@pytest.mark.parametrize("mode,dtype,with_perm,template,dim", pairwise(
    [MODES, DTYPES, [pytest.param(False, id="offsets"), pytest.param(True, id="perm")],
     LAYOUTS],
    everything=HAS_CUDA))
def test_segment_sum(mode, dtype, with_perm, template, dim):
    seed = seed_of("triton-segment", template, dim, dtype, with_perm)
    src = make_data(with_rows(template, 12), dtype, seed=seed, spread=True)
    offsets = torch.tensor([0, 0, 5, 6, 6, 12])  # empty first, inner and last-but-one segments
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(seed)) if with_perm else None
    got, expected = triton_and_expected(
        lambda s, o, p: detsum.segment_sum(s, o, dim=dim, perm=p, mode=mode), mode,
        src, offsets, perm)
    if expected is None:
        expected = reference.segment_sum(src, offsets, dim=dim, perm=perm, mode=mode,
                                         device_type="cuda")
    assert_same_bits(got, expected)


SCATTER_LAYOUTS = [
    pytest.param((N, 3), 0, "rows", id="Nx3-dim0-rows"),  # 1-D index: whole rows
    pytest.param((2, N, 3), 1, "elements", id="2xNx3-dim1-elements"),  # torch's own layout
    pytest.param((N, 4), 0, "sorted", id="Nx4-dim0-sorted"),  # sorted=True: no order at all
]


# Every pair of mode, reduction, dtype and layout, each case with and without include_self:
# every (mode, reduction) that scatter_reduce computes; each mode, reduction and dtype with
# every layout and with each other.
@pytest.mark.parametrize("mode,reduce,dtype,template,dim,kind", pairwise(
    [MODES, ["sum", "mean", "prod", "amax", "amin"], DTYPES, SCATTER_LAYOUTS],
    allowed=lambda mode, reduce, dtype, *_: (mode, reduce) in MODE_REDUCTIONS,
    everything=HAS_CUDA))
def test_scatter_reduce(mode, dtype, reduce, template, dim, kind):
    seed = seed_of("triton-scatter", template, dim, kind, dtype, reduce)
    g = torch.Generator().manual_seed(seed)
    src_shape = with_rows(template, 10)
    src = make_data(src_shape, dtype, seed=seed, spread=reduce != "prod")
    if reduce == "prod":
        src = (1 + src.double() / 8).to(dtype)
    input = make_data(with_rows(template, N_OUT), dtype, seed=seed + 1)
    if kind == "elements":
        index = torch.randint(0, N_OUT, src_shape, generator=g)
    else:
        index = torch.randint(0, N_OUT - 1, (10,), generator=g)  # the last output gets nothing
        if kind == "sorted":
            index = index.sort().values
    for include_self in (True, False):
        got, expected = triton_and_expected(
            lambda i, x, s: detsum.scatter_reduce(i, dim, x, s, reduce,
                                                  include_self=include_self, mode=mode,
                                                  sorted=kind == "sorted"),
            mode, input, index, src)
        if expected is None:
            expected = reference.scatter_reduce(input, dim, index, src, reduce,
                                                include_self=include_self, mode=mode,
                                                device_type="cuda")
        assert_same_bits(got, expected)


# ---- long segments: the chunked canonical order --------------------------------------------------

LONG_CASES = [
    # (source rows, rows per segment: the segments, in order)
    pytest.param((CHUNK + 1,), id="one-segment-just-over-a-chunk"),
    pytest.param((3, 2 * CHUNK + 5, 0, CHUNK), id="two-long-among-short-and-empty"),
    # A long segment starting on a multiple of CHUNK, then chunk programs that own two chunk
    # starts each: a segment's last chunk and the next long segment's first.
    pytest.param((CHUNK, 2 * CHUNK + 1, CHUNK + 1, 2, 3 * CHUNK),
                 id="aligned-and-two-chunk-starts-per-program"),
]


LONG_REDUCTIONS = [
    # (mode, reduce, dtype, its case of LONG_CASES in the interpreter): every reduction the
    # chunks apply to, in both chunked modes, and "autograd", whose order is never chunked
    # (one program runs the whole segment). In the interpreter each chunked mode and each
    # dtype meets every case; on a GPU every row runs every case.
    ("fp32", "sum", torch.bfloat16, 2),
    ("fp32", "mean", torch.float32, 0),
    ("fp32", "prod", torch.float32, 1),
    ("fp32", "amax", torch.bfloat16, 1),
    ("kahan", "sum", torch.float32, 2),
    ("kahan", "mean", torch.bfloat16, 0),
    ("kahan", "amin", torch.float32, 1),
    ("autograd", "sum", torch.bfloat16, 0),
    ("autograd", "prod", torch.float32, 1),
]
LONG_PARAMS = [
    pytest.param(m, r, d, *sizes.values, id=f"{m}-{r}-{dtype_id(d)}-{sizes.id}")
    for m, r, d, given in LONG_REDUCTIONS
    for sizes in (LONG_CASES if HAS_CUDA else [LONG_CASES[given]])]


@pytest.mark.parametrize("mode,reduce,dtype,sizes", LONG_PARAMS)
def test_long_segments(mode, reduce, dtype, sizes):
    """Segments beyond CHUNK_TERMS terms: chunk programs, the last of a segment's to finish
    folding them, rows shuffled so the chunks read scattered rows; with an outer dim so each
    chunk's workspace row is per outer index."""
    rows = sum(sizes)
    seed = seed_of("triton-long", sizes, dtype, reduce)
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    index = index[torch.randperm(rows, generator=g)]
    src = make_data((2, rows, 2), dtype, seed=seed, spread=reduce != "prod")
    if reduce == "prod":
        src = (1 + src.double() / 256).to(dtype)
    input = make_data((2, len(sizes), 2), dtype, seed=seed + 1)
    got, expected = triton_and_expected(
        lambda i, x, s: detsum.scatter_reduce(i, 1, x, s, reduce, mode=mode), mode,
        input, index, src)
    if expected is None:
        expected = reference.scatter_reduce(input, 1, index, src, reduce, mode=mode,
                                            device_type="cuda")
    assert_same_bits(got, expected)


def test_chunked_order_differs_from_serial():
    """Guard for the tests above: on this data the chunked "fp32" sum is not the serial one,
    so agreeing on it means the chunks are really there."""
    src = torch.cat([torch.tensor([2.0**24]), torch.ones(2 * CHUNK - 1)]).view(-1, 1)
    offsets = torch.tensor([0, src.shape[0]])
    with detsum.backend("triton"):
        got = detsum.segment_sum(on_device(src), on_device(offsets)).cpu()
    # The first chunk absorbs its 255 ones (2**24 + 1 rounds back to 2**24); the second
    # chunk's sum, 256, is exact and survives the fold.
    assert got.item() == 2.0**24 + CHUNK
    serial = torch.tensor(0.0)
    for x in src.view(-1):
        serial = serial + x
    assert serial.item() == 2.0**24


# ---- the pipelined term loop: later rows loaded while one is combined ---------------------------

# Segment lengths around the term loop's pipeline of TERM_STAGES stages (a loop shorter than
# the rows it would have in flight, as long, longer) and around the chunks.
PIPELINE_LENGTHS = (0, 1, TERM_STAGES - 2, TERM_STAGES - 1, TERM_STAGES, TERM_STAGES + 1,
                    2 * TERM_STAGES + 1, 0)
CHUNK_LENGTHS = (CHUNK - 1, 0, CHUNK, CHUNK + 1, 2 * CHUNK + 3)


def term_loop_case(lengths, dtype, reduce, seed, *, sorted_index):
    """(input, index, src) of a scatter along dim 0 whose segments have ``lengths`` rows, in
    three columns: 0, every term and the input -0.0 (a position past the end combined as +0.0,
    or as any neutral term, would show); 1, NaN, +-inf and zeros of both signs sprinkled
    among spread values; 2, spread values (near 1 for a product; of the one sign, under amax
    and amin, that a stray 0.0 would beat)."""
    rows = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if not sorted_index:
        index = index[torch.randperm(rows, generator=g)]
    src = make_data((rows, 3), torch.float64, seed=seed, spread=reduce != "prod")
    input = make_data((len(lengths), 3), torch.float64, seed=seed + 1, spread=True)
    if reduce == "prod":
        src, input = 1 + src / 64, 1 + input / 64
    if reduce in ("amax", "amin"):
        sign = -1 if reduce == "amax" else 1
        src[:, 2], input[:, 2] = sign * src[:, 2].abs(), sign * input[:, 2].abs()
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0],
                            dtype=torch.float64)
    picks = torch.rand(rows, generator=g) < 0.15
    src[picks, 1] = specials[torch.randint(0, 5, (int(picks.sum()),), generator=g)]
    src[:, 0] = -0.0
    input[:, 0] = -0.0
    return input.to(dtype), index, src.to(dtype)


def check_term_loop(mode, reduce, dtype, lengths, sorted_index, include_selfs):
    """scatter_reduce (and for a sum, index_add with alpha) on the triton backend, bit for bit
    Numba's and the reference's."""
    seed = seed_of("triton-term-loop", mode, reduce, dtype, lengths, sorted_index)
    input, index, src = term_loop_case(lengths, dtype, reduce, seed, sorted_index=sorted_index)
    for include_self in include_selfs:
        got, expected = triton_and_expected(
            lambda i, x, s: detsum.scatter_reduce(i, 0, x, s, reduce, include_self=include_self,
                                                  mode=mode, sorted=sorted_index),
            mode, input, index, src)
        oracle = reference.scatter_reduce(input, 0, index, src, reduce,
                                          include_self=include_self, mode=mode,
                                          device_type=DEVICE)
        assert_same_bits(got, oracle)
        if expected is not None:
            assert_same_bits(got, expected)
    if reduce == "sum":
        got, expected = triton_and_expected(
            lambda i, x, s: detsum.index_add(i, 0, x, s, alpha=0.3, mode=mode), mode,
            input, index, src)
        assert_same_bits(got, reference.index_add(input, 0, index, src, alpha=0.3, mode=mode,
                                                  device_type=DEVICE))
        if expected is not None:
            assert_same_bits(got, expected)


# Every pair of mode, reduction, dtype and index (shuffled: rows through ``order``; sorted: the
# positions themselves), each case with and without include_self.
@pytest.mark.parametrize("mode,reduce,dtype,sorted_index", pairwise(
    [[m for m in MODES if m != "exact"], ["sum", "mean", "prod", "amax", "amin"], DTYPES,
     [pytest.param(False, id="shuffled"), pytest.param(True, id="sorted")]],
    everything=HAS_CUDA))
def test_term_loop_every_length_around_its_stages(mode, reduce, dtype, sorted_index):
    """Segments of 0, 1, TERM_STAGES - 2 .. TERM_STAGES + 1 and 2 TERM_STAGES + 1 rows: the
    pipeline's first and last stages combine each row once, in order, and nothing past the
    segment's end, -0.0 included, in every mode, reduction and dtype."""
    check_term_loop(mode, reduce, dtype, PIPELINE_LENGTHS, sorted_index, (True, False))


# The chunked modes with each reduction and dtype, and "autograd" (never chunked), over
# segments around one and two chunks.
CHUNK_TERM_LOOP_CASES = [
    ("fp32", "sum", torch.bfloat16, False, True),
    ("fp32", "prod", torch.float32, True, False),
    ("fp32", "amax", torch.float64, False, False),
    ("kahan", "sum", torch.float32, True, True),
    ("kahan", "mean", torch.float16, False, False),
    ("kahan", "amin", torch.bfloat16, False, True),
    ("autograd", "sum", torch.float16, False, True),
]


@pytest.mark.parametrize("mode,reduce,dtype,sorted_index,include_self", [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{dtype_id(case[2])}") for case in
    CHUNK_TERM_LOOP_CASES])
def test_term_loop_across_chunks(mode, reduce, dtype, sorted_index, include_self):
    """Segments of CHUNK - 1, CHUNK, CHUNK + 1 and 2 CHUNK + 3 rows: each chunk's term loop
    (after its first term, which a later chunk starts from) ends where the chunk does, and
    the chunks still fold in order."""
    check_term_loop(mode, reduce, dtype, CHUNK_LENGTHS, sorted_index, (include_self,))


# ---- torch's CUDA "autograd" arithmetic, run through the launcher ------------------------------

# Every pair of slice size (the rows' regimes), number of terms (the warp tree's from 32),
# dtype and alpha: each slice size with every number of terms.
@pytest.mark.parametrize("slice_size,n_terms,dtype,alpha", pairwise(
    [[1, 8, 32, 33], [1, 31, 32, 33, 70], [torch.float32, torch.float16, torch.bfloat16],
     [1.0, 0.3]], everything=HAS_CUDA))
def test_cuda_autograd_rules_match_reference(alpha, dtype, n_terms, slice_size):
    """The contract's three CUDA rows (stride 1 with its warp tree from 32 terms, small stride, one
    rounding per add) against the reference on the same data, with an outer dim of 2 and a
    segment that receives nothing."""
    from detsum.kernels.triton.segment import segment_reduce

    seed = seed_of("cuda-rule", slice_size, n_terms, dtype, alpha)
    g = torch.Generator().manual_seed(seed)
    source = make_data((2, n_terms + 3, slice_size), dtype, seed=seed, spread=True)
    input = make_data((2, 3, slice_size), dtype, seed=seed + 1, spread=True)
    index = torch.cat([torch.zeros(n_terms, dtype=torch.long), torch.ones(3, dtype=torch.long)])
    index = index[torch.randperm(n_terms + 3, generator=g)]
    expected = reference.index_add(input, 1, index, source, alpha=alpha, mode="autograd",
                                   device_type="cuda")
    order = torch.sort(index, stable=True).indices
    offsets = torch.tensor([0, n_terms, n_terms + 3, n_terms + 3])
    rule = detsum.modes.rule_for(detsum.Mode.AUTOGRAD, "sum", "cuda", slice_size)
    out = on_device(torch.full_like(input, float("nan")))
    segment_reduce(on_device(source), on_device(order), on_device(offsets), on_device(input),
                   out, reduce=kernels.SUM, rule=rule, alpha=alpha, include_base=True)
    assert_same_bits(out.cpu(), expected)


# ---- an unsorted index of at most CHUNK_TERMS values: every program scans it, no sort -----------

# Every rule each reduction takes (kernels.EXACT and CUDA_STRIDE_1 sort the keys first).
SCAN_RULES = [(reduce, rule) for reduce, rules in (
    ("sum", ["WIDE", "KAHAN", "ROUND_EACH", "CUDA_SMALL_STRIDE", "CUDA_STRIDE_1", "EXACT"]),
    ("mean", ["WIDE", "KAHAN", "ROUND_EACH", "EXACT"]), ("prod", ["WIDE", "ROUND_EACH"]),
    ("amax", ["WIDE", "ROUND_EACH"]), ("amin", ["WIDE"])) for rule in rules]


def _scan_allowed(reduce_rule, dtype, n_terms, alpha, include_base, keys_dtype):
    reduce, rule = reduce_rule
    return alpha == 1.0 or reduce == "sum"


# Every pair of (reduction, rule), dtype, number of keys, alpha, base and key dtype.
@pytest.mark.parametrize("reduce_rule,dtype,n_terms,alpha,include_base,keys_dtype", pairwise(
    [SCAN_RULES, DTYPES, [1, 37, CHUNK], [1.0, 0.3], [True, False],
     [torch.int64, torch.int32]], allowed=_scan_allowed, everything=HAS_CUDA))
def test_unsorted_keys_give_the_bits_of_the_sorted_keys(reduce_rule, dtype, n_terms, alpha,
                                                        include_base, keys_dtype, sort_width):
    """The launch given ``kernels.UnsortedKeys`` (each program scans every key: no sort)
    against the same keys sorted first (``UnsortedKeys.sorted()``, the launch a longer index
    takes): the same bits for every reduction and rule, with keys outside ``[0, nseg)`` (in
    no segment; unchecked), a segment without terms, NaN, infinities and signed zeros among
    the terms, and an outer dim. Outputs are NaN before the launch."""
    from detsum.kernels.triton.segment import segment_reduce

    reduce, rule = reduce_rule
    seed = seed_of("triton-scan", reduce, rule, dtype, n_terms, alpha, include_base)
    g = torch.Generator().manual_seed(seed)
    nseg, slice_size = 6, 1 if rule == "CUDA_STRIDE_1" else 3
    keys = torch.randint(-1, nseg + 1, (n_terms,), generator=g)
    keys[keys == 4] = 2  # segment 4 receives nothing
    src = make_data((2, n_terms, slice_size), dtype, seed=seed, spread=reduce != "prod")
    if reduce == "prod":
        src = (1 + src.double() / 256).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    picks = torch.rand(src.shape, generator=g) < 0.05
    src[picks] = specials[torch.randint(0, 5, (int(picks.sum()),), generator=g)].to(dtype)
    base = make_data((2, nseg, slice_size), dtype, seed=seed + 1)
    unsorted = kernels.UnsortedKeys(on_device(keys.to(keys_dtype)), nseg)
    outs = []
    for order, bounds in ((None, unsorted), unsorted.sorted()):
        out = on_device(torch.full(base.shape, float("nan"), dtype=dtype))
        segment_reduce(on_device(src), order, bounds, on_device(base), out,
                       reduce=kernels.REDUCE_CODES[reduce], rule=getattr(kernels, rule),
                       alpha=alpha, include_base=include_base)
        outs.append(out.cpu())
    assert_same_bits(*outs)


# ---- narrow rows: several whole segments a program, as a tile ----------------------------------

TILE_RULES = [(reduce, rule) for reduce, rule in SCAN_RULES
              if rule not in ("CUDA_STRIDE_1", "EXACT")]
# How the launch gets its offsets: checked already, unchecked ("off": clamped, their running
# maximum), or checked by the launch itself (every bound, a verdict read back).
TILE_BOUNDS = ["offsets", "unchecked", "checked by the launch"]


# The segments' lengths: a dozen terms at most; more positions than a chunk, which a plan says
# no segment holds (chunks=(.., 0)); and one segment longer than a chunk among short ones,
# which the chunk programs take (under the rules that split).
TILE_LENGTHS = ["short", "no long segment, planned", "one long segment"]


def _tile_allowed(reduce_rule, dtype, width, alpha, include_base, has_order, bounds, lengths):
    return alpha == 1.0 or reduce_rule[0] == "sum"


@pytest.mark.parametrize(
    "reduce_rule,dtype,width,alpha,include_base,has_order,bounds,lengths", pairwise(
        [TILE_RULES, DTYPES, [1, 5, 64], [1.0, 0.3], [True, False, None], [True, False],
         TILE_BOUNDS, TILE_LENGTHS], allowed=_tile_allowed, everything=HAS_CUDA))
def test_segments_in_tiles_give_the_bits_of_one_segment_a_program(
        monkeypatch, reduce_rule, dtype, width, alpha, include_base, has_order, bounds,
        lengths):
    """Narrow rows (``segment.TILE_BYTES``: several whole segments a program, as one tile)
    against the launch of one segment a program (``TILE_BYTES = 0``): the same bits for every
    reduction and rule, dtype, width (1, 5, 64 columns), alpha, base row (included, left out,
    none), order or none, kind of offsets, and segments of different lengths (empty ones, 11
    segments: not a multiple of the tile), with NaN, infinities and signed zeros among the
    terms and an outer dim; unchecked offsets outside ``[0, positions]`` at both ends;
    ``TILE_LENGTHS``. Outputs are NaN before the launch."""
    from detsum.kernels.triton import segment

    reduce, rule = reduce_rule
    seed = seed_of("triton-tile", reduce, rule, dtype, width, alpha, include_base, has_order,
                   bounds, lengths)
    g = torch.Generator().manual_seed(seed)
    nseg = 11
    long_plan = lengths == "no long segment, planned"
    counts = (torch.randint(30, 60, (nseg,), generator=g) if long_plan
              else torch.randint(0, 12, (nseg,), generator=g))
    counts[[2, 7]] = 0
    if lengths == "one long segment":
        counts[4] = 2 * CHUNK + 5
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    positions = int(offsets[-1])
    src = make_data((2, positions + 3, width), dtype, seed=seed, spread=reduce != "prod")
    if reduce == "prod":
        src = (1 + src.double() / 256).to(dtype)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    picks = torch.rand(src.shape, generator=g) < 0.05
    src[picks] = specials[torch.randint(0, 5, (int(picks.sum()),), generator=g)].to(dtype)
    order = torch.randperm(positions + 3, generator=g)[:positions] if has_order else None
    if not has_order:
        src = src[:, :positions]
    base = None if include_base is None else make_data((2, nseg, width), dtype, seed=seed + 1)
    chunks = (torch.zeros(nseg, dtype=torch.int64), 0) if long_plan else None
    tiled, chosen = [], segment._segments_per_program

    def counted(*args):
        tiled.append(chosen(*args))
        return tiled[-1]

    monkeypatch.setattr(segment, "_segments_per_program", counted)
    outs = []
    if bounds == "unchecked":
        # Values "off" launches as they are: clamped into [0, positions] as they are read.
        offsets = offsets.clone()
        offsets[0], offsets[-1] = -3, positions + 7
    for tile_bytes in (segment.TILE_BYTES, 0):
        monkeypatch.setattr(segment, "TILE_BYTES", tile_bytes)
        values = on_device(offsets)
        given = {"offsets": values,
                 "unchecked": kernels.UncheckedOffsets(values, positions),
                 "checked by the launch": kernels.UncheckedOffsets(values, positions,
                                                                   _no_failure)}[bounds]
        out = on_device(torch.full((2, nseg, width), float("nan"), dtype=dtype))
        segment.segment_reduce(on_device(src), on_device(order), given, on_device(base), out,
                               reduce=kernels.REDUCE_CODES[reduce],
                               rule=getattr(kernels, rule), alpha=alpha,
                               include_base=bool(include_base), chunks=chunks)
        outs.append(out.cpu())
    # Narrow: a row block under 512 bytes (float64 rows of 64 columns are not).
    narrow = max(16, 1 << (width - 1).bit_length()) * src.element_size() < 512
    assert (tiled[0] > 1) == narrow and tiled[1] == 1, tiled
    assert_same_bits(*outs)


CHUNK_ORDER_CASES = [
    # (mode, reduce, dtype, width, bounds): every kernel with chunk programs (fp32's and
    # Kahan's term loop, "exact"'s limbs), narrow rows in tiles (width 4) and wide ones, a sort's
    # offsets, offsets the launch checks itself (its checkers are its first programs, chunk
    # programs among them under CHUNKS_FIRST) and offsets given.
    ("fp32", "sum", torch.float32, 4, "sorted keys"),
    ("fp32", "amax", torch.bfloat16, 33, "offsets"),
    ("kahan", "mean", torch.float16, 4, "checked by the launch"),
    ("kahan", "sum", torch.float32, 33, "sorted keys"),
    ("exact", "sum", torch.bfloat16, 5, "offsets"),
    ("exact", "mean", torch.float32, 33, "offsets"),
]


@pytest.mark.parametrize("mode,reduce,dtype,width,bounds", CHUNK_ORDER_CASES)
def test_chunk_programs_first_or_last_give_the_same_bits(monkeypatch, mode, reduce, dtype,
                                                          width, bounds):
    """A launch's chunk programs in its first slots (``chunks.CHUNKS_FIRST``, the default) or
    after the whole segments': the same bits, which are the Numba backend's, for long
    segments (one of exactly two chunks and a term, one of three chunks, one of a chunk and
    a term, at the start, in the middle and at the end) among short and empty ones, with an
    outer dim and a base row. Outputs are NaN before the launch, so a segment that neither
    order writes fails."""
    from detsum.kernels.numba import exact as numba_exact
    from detsum.kernels.numba import segment as numba_segment
    from detsum.kernels.triton import chunks, exact, segment

    chunk = CHUNK
    if mode == "exact":
        chunk = 8  # exact's chunks are a parameter: small ones keep the limbs' loop short
        monkeypatch.setattr(exact, "_EXACT_CHUNK_TERMS", chunk)
    g = torch.Generator().manual_seed(seed_of("chunk-order", mode, reduce, dtype, width))
    counts = torch.randint(0, 5, (9,), generator=g)
    counts[[0, 4, 8]] = torch.tensor([2 * chunk + 1, 3 * chunk, chunk + 1])
    counts[6] = 0
    nseg = counts.numel()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    positions = int(offsets[-1])
    src = make_data((2, positions, width), dtype, seed=seed_of("chunk-order src", width))
    base = make_data((2, nseg, width), dtype, seed=seed_of("chunk-order base", width))
    order = torch.randperm(positions, generator=g)
    rule = {"fp32": kernels.WIDE, "kahan": kernels.KAHAN, "exact": kernels.EXACT}[mode]
    if rule == kernels.EXACT:
        segment_reduce = exact.segment_reduce_exact
        rule_kwargs = {}
    else:
        segment_reduce = segment.segment_reduce
        rule_kwargs = {"rule": rule}
    outs = []
    for first in (True, False):
        monkeypatch.setattr(chunks, "CHUNKS_FIRST", first)
        values = on_device(offsets)
        given = {"offsets": values,
                 "sorted keys": kernels.SortedKeys(
                     on_device(torch.arange(nseg).repeat_interleave(counts)), nseg),
                 "checked by the launch": kernels.UncheckedOffsets(values, positions,
                                                                   _no_failure)}[bounds]
        out = on_device(torch.full((2, nseg, width), float("nan"), dtype=dtype))
        segment_reduce(on_device(src), on_device(order), given, on_device(base), out,
                       reduce=kernels.REDUCE_CODES[reduce], alpha=1.0, include_base=True,
                       **rule_kwargs)
        outs.append(out.cpu())
    assert_same_bits(*outs)
    expected = torch.full((2, nseg, width), float("nan"), dtype=dtype)
    if rule == kernels.EXACT:
        numba_exact.segment_reduce_exact(src, order, offsets, base, expected,
                                         reduce=kernels.REDUCE_CODES[reduce], alpha=1.0,
                                         include_base=True)
    else:
        numba_segment.segment_reduce(src, order, offsets, base, expected,
                                     reduce=kernels.REDUCE_CODES[reduce], rule=rule,
                                     alpha=1.0, include_base=True)
    assert_same_bits(outs[0], expected)


# Every pair of where the keys come from, the mode and the key dtype.
@pytest.mark.parametrize("given,mode,keys_dtype", pairwise(
    [["a sort's keys", "a plan's index"], ["fp32", "kahan"],
     [torch.int64, torch.int32, torch.int16]], everything=HAS_CUDA))
def test_chunk_programs_guided_by_the_keys(monkeypatch, given, mode, keys_dtype):
    """The chunk programs find each chunk's segment from the key of its position (checked
    against the offsets; ``GUIDED``) instead of a binary search of the offsets: a sort's
    keys (a launch without a plan: the key at a position) or a plan's index (the key of the
    position's row, through the order). The same bits as the launch given the same order and
    offsets alone, for long segments at the start, in the middle and at the end, short and
    empty ones, and keys outside the segments at both ends (an unchecked index: their
    positions lie in no segment). Launched GUIDED, and as which, exactly where it splits and
    has keys, unless ``chunks.GUIDED_CHUNKS`` is off."""
    from detsum.kernels.triton import chunks, segment

    g = torch.Generator().manual_seed(seed_of("guided chunks", mode, keys_dtype))
    nseg = 7
    counts = torch.randint(0, 4, (nseg,), generator=g)
    counts[[0, 3, 6]] = torch.tensor([2 * CHUNK + 1, CHUNK + 3, 3 * CHUNK])
    counts[4] = 0
    keys = torch.cat([torch.full((CHUNK + 9,), -2), torch.arange(nseg).repeat_interleave(counts),
                      torch.full((5,), nseg)]).to(keys_dtype)
    positions = keys.numel()
    offsets = torch.searchsorted(keys, torch.arange(nseg + 1, dtype=keys_dtype))
    src = make_data((2, positions, 6), torch.float32, seed=seed_of("guided chunks src"))
    base = make_data((2, nseg, 6), torch.float32, seed=seed_of("guided chunks base"))
    order = torch.randperm(positions, generator=g)
    rule = {"fp32": kernels.WIDE, "kahan": kernels.KAHAN}[mode]
    guided, launch = [], segment._launch_segment

    def recorded(grid, args, constexprs, **options):
        guided.append(constexprs["GUIDED"])
        return launch(grid, args, constexprs, **options)

    monkeypatch.setattr(segment, "_launch_segment", recorded)
    outs = []
    if given == "a sort's keys":
        launches = [(kernels.SortedKeys(on_device(keys), nseg), None), (on_device(offsets), None)]
        expected = [chunks._KEY_A_POSITION.value, chunks._UNGUIDED.value]
    else:
        # The index a plan sorted: row order[p] holds the key of position p.
        index = torch.empty_like(keys)
        index[order] = keys
        launches = [(on_device(offsets), on_device(index)), (on_device(offsets), None)]
        expected = [chunks._KEY_A_ROW.value, chunks._UNGUIDED.value]
    launches.append(launches[0])  # again with GUIDED_CHUNKS off: searched
    expected.append(chunks._UNGUIDED.value)
    for i, (bounds, index_keys) in enumerate(launches):
        monkeypatch.setattr(chunks, "GUIDED_CHUNKS", i < 2)
        out = on_device(torch.full((2, nseg, 6), float("nan")))
        segment.segment_reduce(on_device(src), on_device(order), bounds, on_device(base), out,
                               reduce=kernels.SUM, rule=rule, alpha=1.0, include_base=True,
                               keys=index_keys)
        outs.append(out.cpu())
    assert guided == expected
    for out in outs[1:]:
        assert_same_bits(out, outs[0])


def _no_failure():
    raise AssertionError("valid offsets reported bad")


class _Reported(Exception):
    pass


def _reported():
    raise _Reported


def test_tiles_of_many_segments_checked_by_the_launch(monkeypatch):
    """2100 segments of narrow rows, in tiles, their 2101 offsets checked by the launch itself
    (three checkers, each a block of 1024 bounds, no more checkers than programs): valid
    offsets give the bits of one segment a program, and a decrease anywhere is reported."""
    from detsum.kernels.triton import segment

    g = torch.Generator().manual_seed(21)
    nseg = 2100
    lengths = torch.randint(0, 3, (nseg,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    positions = int(offsets[-1])
    src = on_device(make_data((1, positions, 4), torch.float32, seed=22))
    outs = []
    for tile_bytes in (segment.TILE_BYTES, 0):
        monkeypatch.setattr(segment, "TILE_BYTES", tile_bytes)
        out = on_device(torch.full((1, nseg, 4), float("nan")))
        segment.segment_reduce(src, None, kernels.UncheckedOffsets(
            on_device(offsets), positions, _no_failure), None, out, reduce=kernels.SUM,
            rule=kernels.WIDE, alpha=1.0, include_base=False)
        outs.append(out.cpu())
    assert_same_bits(*outs)
    monkeypatch.setattr(segment, "TILE_BYTES", 2048)
    for at in (5, nseg - 1):
        bad = offsets.clone()
        bad[at] = bad[at + 1] + 1  # one decrease, in the first checker's block, the last's
        with pytest.raises(_Reported):
            segment.segment_reduce(src, None, kernels.UncheckedOffsets(
                on_device(bad), positions, _reported), None,
                on_device(torch.empty(1, nseg, 4)), reduce=kernels.SUM, rule=kernels.WIDE,
                alpha=1.0, include_base=False)


# Every pair of the rule, the data (a dtype and its width) and the check.
@pytest.mark.parametrize("rule,data,check", pairwise(
    [["WIDE", "EXACT"], [(torch.float32, 4), (torch.bfloat16, 33)],
     ["unchecked", "checked by the launch"]], everything=HAS_CUDA))
def test_inner_offsets_give_the_bits_of_their_padded_offsets(monkeypatch, rule, data, check):
    """``UncheckedOffsets`` with ``padded`` (the inner bounds, the launch reading a 0 before
    them and ``positions`` after them) against the same offsets padded by torch ops: the same
    bits, in tiles of narrow rows and one segment a program, with long segments in chunks,
    rows left out at both ends, an order and a base row. Unchecked, values past either end
    and a decrease are clamped and made nondecreasing as the padded sequence's would be.
    Outputs are NaN before the launch, so a segment that no program writes fails. (KAHAN
    reads its bounds as WIDE does; EXACT takes the offsets padded, by ``offsets()``, and has
    no tiles.)"""
    from detsum.kernels.triton import segment

    dtype, width = data
    g = torch.Generator().manual_seed(seed_of("inner offsets", rule, dtype, width, check))
    counts = torch.randint(0, 4, (7,), generator=g)
    counts[[2, 5]] = torch.tensor([2 * CHUNK + 3, CHUNK + 1])  # chunk programs
    counts[4] = 0
    inner = 5 + counts.cumsum(0)[:-1]  # 5 rows before the first bound, counts[-1] after
    positions = int(5 + counts.sum())
    if check == "unchecked":
        inner[0], inner[3], inner[-1] = -4, inner[2] - 2, positions + 6
    nseg = inner.numel() + 1
    src = make_data((2, positions + 3, width), dtype, seed=seed_of("inner offsets src", width))
    base = make_data((2, nseg, width), dtype, seed=seed_of("inner offsets base", width))
    order = torch.randperm(positions + 3, generator=g)[:positions]
    # Checked as on a GPU at check="device": an assert of the launch's flag (here, on CPU
    # tensors, at once), or of torch ops where the launch takes offsets as they are (EXACT).
    failure = None if check == "unchecked" else "inner offsets reported bad"
    padded = torch.nn.functional.pad(inner, (1, 1), value=positions)
    padded[0] = 0
    outs = []
    for tile_bytes in (segment.TILE_BYTES, 0) if rule != "EXACT" else (segment.TILE_BYTES,):
        monkeypatch.setattr(segment, "TILE_BYTES", tile_bytes)
        for given in (kernels.UncheckedOffsets(on_device(inner), positions, failure,
                                               padded=True),
                      kernels.UncheckedOffsets(on_device(padded), positions, failure)):
            out = on_device(torch.full((2, nseg, width), float("nan"), dtype=dtype))
            segment.segment_reduce(on_device(src), on_device(order), given, on_device(base),
                                   out, reduce=kernels.SUM, rule=getattr(kernels, rule),
                                   alpha=1.0, include_base=True)
            outs.append(out.cpu())
    for out in outs[1:]:
        assert_same_bits(out, outs[0])


@pytest.mark.parametrize("rule", ["WIDE", "EXACT"])
@pytest.mark.parametrize("bad", ["first below 0", "a decrease", "last past the positions"])
def test_inner_offsets_that_fail_are_reported(rule, bad):
    """Inner offsets checked (``padded``): the padded sequence 0, the values, ``positions``
    must not decrease, so a first value below 0, a decrease among them or a last value past
    ``positions`` is reported, by the launch (WIDE) or by torch ops before it (EXACT, which
    takes offsets as they are); their edges (a first of 0, a last of ``positions``, equal
    neighbours) are not."""
    from detsum.kernels.triton import segment

    positions = 12
    src = on_device(make_data((1, positions, 3), torch.float32, seed=23))

    def launch(inner):
        segment.segment_reduce(src, None, kernels.UncheckedOffsets(
            on_device(torch.tensor(inner)), positions, "inner offsets reported bad",
            padded=True), None, on_device(torch.empty(1, len(inner) + 1, 3)),
            reduce=kernels.SUM, rule=getattr(kernels, rule), alpha=1.0, include_base=False)

    launch([0, 4, 4, positions])
    inner = {"first below 0": [-1, 4, 9], "a decrease": [2, 7, 6, 9],
             "last past the positions": [2, 7, positions + 1]}[bad]
    with pytest.raises(RuntimeError, match="inner offsets reported bad"):
        launch(inner)


def test_sort_offsets_are_searchsorteds_answers():
    """``chunks.sort_offsets`` (a sort's values to the launch's offsets, one kernel) against
    ``torch.searchsorted`` for every ``s`` in ``[0, nseg]``: even segments, random ones, one
    hot segment among empty ones, every key below or above the segments, one key, and more
    segments than one program searches; int64, int32 and int16 keys (a narrowed sort's:
    ``kernels.sort_by_segment``). The output is NaN-poisoned
    first (as int64: -1), so an offset no program writes fails."""
    from detsum.kernels.triton import chunks

    g = torch.Generator().manual_seed(11)
    cases = {
        "even": (torch.arange(64).repeat_interleave(8), 64),
        "random": (torch.randint(0, 50, (300,), generator=g).sort().values, 50),
        "one hot segment": (torch.cat([torch.zeros(3), torch.full((500,), 37.0),
                                       torch.full((2,), 39.0)]).long(), 40),
        "all below": (torch.full((20,), -1), 6),
        "all above": (torch.full((20,), 9), 6),
        "one key": (torch.tensor([2]), 5),
        "past one program": (torch.randint(0, 2500, (777,), generator=g).sort().values, 2500),
    }
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(-1)

    for name, (keys, nseg) in cases.items():
        for dtype in (torch.int64, torch.int32, torch.int16):
            with unittest.mock.patch.object(chunks.torch, "empty", poisoned):
                got = chunks.sort_offsets(on_device(keys.to(dtype)), nseg)
            expected = torch.searchsorted(keys, torch.arange(nseg + 1))
            assert torch.equal(got.cpu(), expected), (name, dtype)


def _counting_sort_takes(segments, keys_dtype, counting) -> bool:
    """Whether the narrowed-sort case can run: by counting only where its table fits (the
    counting sort's ``takes``, for ``NARROW_SORT_ABOVE + 1`` keys; without triton every case
    is skipped anyway)."""
    if not counting or not HAS_TRITON:
        return True
    from detsum.kernels.triton import counting_sort

    return counting_sort.takes(kernels.NARROW_SORT_ABOVE + 1, segments[0])


# Every pair of the segments' number (with the type it narrows to), the key dtype and the
# sort (False: torch's, True: by counting) that can run.
@pytest.mark.parametrize("segments,keys_dtype,counting", pairwise(
    [[(1, torch.int16), (300, torch.int16), (2**15 - 1, torch.int16), (2**15, torch.int32),
      (2**31 - 1, torch.int32), (2**31, torch.int64)], [torch.int64, torch.int32],
     [False, True]], allowed=_counting_sort_takes, everything=HAS_CUDA))
def test_a_narrowed_sort_orders_every_segment_as_torch_sorts_it(segments, keys_dtype, counting,
                                                                monkeypatch):
    """``kernels.sort_by_segment`` against ``torch.sort(keys, stable=True)``: more than
    ``NARROW_SORT_ABOVE`` keys narrowed to the type the segments need (int64 or int32 keys
    that are no wider kept as they are), sorted by torch or, where its table is small, by
    counting (``triton.counting_sort``, as on a GPU; on a GPU always where it is small), at
    most that many sorted as given; the same offsets
    for every segment boundary a key meets (``searchsorted``), the same order within the
    segments, and the values' first below 0 or last at or past the segments exactly when
    torch's are. Keys out of range both ways, far out (int64 past 2**31) and just out,
    and one hot key among rare ones."""
    from detsum.kernels.triton import counting_sort

    num_segments, narrowed = segments
    if counting:
        monkeypatch.setattr(kernels, "COUNTING_SORT_ON_CPU", True)
    else:
        monkeypatch.setattr(counting_sort, "MAX_TABLE_CELLS", 0)
    g = torch.Generator().manual_seed(seed_of("narrowed sort", num_segments, keys_dtype))
    top = min(num_segments, torch.iinfo(keys_dtype).max)
    for n in (kernels.NARROW_SORT_ABOVE, kernels.NARROW_SORT_ABOVE + 1):
        for out_of_range in ("none", "below", "past", "both"):
            keys = torch.randint(0, top, (n,), generator=g, dtype=torch.int64)
            keys[torch.rand(n, generator=g) < 0.5] = top // 2  # the hot key
            far = [-2**40, 2**40] if keys_dtype == torch.int64 else [-2**31, 2**31 - 1]
            if out_of_range in ("below", "both"):
                keys[[3, 77, n - 1]] = torch.tensor([-1, far[0], -2])
            if out_of_range in ("past", "both") and num_segments <= torch.iinfo(keys_dtype).max:
                keys[[5, 90, n - 2]] = torch.tensor([num_segments, far[1], num_segments + 1]
                                                    ).clamp(max=torch.iinfo(keys_dtype).max)
            keys = on_device(keys.to(keys_dtype))
            values, order = kernels.sort_by_segment(keys, num_segments)
            torch_values, torch_order = torch.sort(keys, stable=True)
            wide = n <= kernels.NARROW_SORT_ABOVE or narrowed.itemsize >= keys.element_size()
            assert values.dtype == (keys_dtype if wide else narrowed)
            bounds = torch.cat([torch.tensor([0, num_segments]),
                                torch.unique(keys.cpu().clamp(0, num_segments - 1)) + 1,
                                torch.unique(keys.cpu().clamp(0, num_segments - 1))])
            bounds = bounds.unique()
            bounds = on_device(bounds[bounds <= torch.iinfo(keys_dtype).max])
            start = torch.searchsorted(values, bounds.to(values.dtype))
            torch_start = torch.searchsorted(torch_values, bounds.to(keys_dtype))
            assert torch.equal(start, torch_start), out_of_range
            first, last = int(start.min()), int(start.max())
            assert torch.equal(order[first:last], torch_order[first:last]), out_of_range
            assert bool(values[0] < 0) == bool(torch_values[0] < 0)
            assert bool(values[-1] >= num_segments) == bool(torch_values[-1] >= num_segments)


@pytest.mark.cuda
@pytest.mark.parametrize("counting", [True, False], ids=["counting", "torch's sort"])
@pytest.mark.parametrize("num_segments", [2048, 100_000], ids=["int16", "int32"])
def test_a_narrowed_sort_launches_fewer_kernels_on_a_gpu(num_segments, counting, monkeypatch):
    """On a GPU, ``kernels.sort_by_segment`` of 16384 int64 keys (a call without a plan at
    ``gpu_call_cost.py``'s mid size) launches fewer kernels than torch's sort of them. By
    counting (``triton.counting_sort``): a fill, two launches and a running sum. By torch's
    sort of narrowed keys (the counting sort's table refused), the clamp and the cast
    counted: CUB's radix sort makes a pass of two launches for each 8 bits of the keys
    (``NARROW_SORT_ABOVE``'s comment), so, read in its code, 12 fewer with int16 keys and 8
    fewer with int32 ones, 2 of each given back to the clamp and the cast. Counted by torch's
    profiler, every kernel and memset on the GPU; held to fewer, not to the count read
    (``gpu_call_cost.py`` records each call's)."""
    from detsum.kernels.triton import counting_sort

    if not counting:
        monkeypatch.setattr(counting_sort, "MAX_TABLE_CELLS", 0)
    keys = torch.randint(0, num_segments, (16384,), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(3))

    def kernels_of(sort) -> int:
        sort()  # CUB's first call sizes its workspace
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sort()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    wide = kernels_of(lambda: torch.sort(keys, stable=True))
    narrow = kernels_of(lambda: kernels.sort_by_segment(keys, num_segments))
    assert narrow < wide, (wide, narrow)


@pytest.mark.parametrize("check", ["host", "device", "off"])
@pytest.mark.parametrize("bad_key", [-1, 7], ids=["below", "past"])
def test_sorted_index_past_a_chunk_checked_by_its_offsets_ends(check, bad_key, monkeypatch):
    """More than CHUNK_TERMS positions: the index is sorted and its values reach the launch as
    the offsets that ``chunks.sort_offsets`` finds for them, whose two ends the launch
    checks (0 and every position exactly when the keys lie in range). A key below 0 or at
    ``size`` and past: the caller's error at "host", the launch's assert at "device", at
    "off" the position in no segment; valid keys at every level: the Numba backend's bits,
    with a segment long enough for chunks."""
    from detsum import _segments

    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
    n, size = CHUNK + 45, 7
    input, source = make_data((size, 3), torch.float32, seed=2), make_data(
        (n, 3), torch.float32, seed=3)
    good = torch.randint(0, size, (n,), generator=torch.Generator().manual_seed(4))
    good[: CHUNK + 9] = 5  # one segment of two chunks
    bad = good.clone()
    bad[n // 2] = bad_key
    with detsum.backend("numba"):
        expected = detsum.index_add(input, 0, good, source)
    with detsum.backend("triton"):
        assert_same_bits(detsum.index_add(input, 0, good, source, check=check), expected)
        if check == "off":
            kept = bad.clamp(0, size - 1)
            out = detsum.index_add(input, 0, bad, source, check=check)
            assert_same_bits(out, detsum.index_add(input, 0, kept, source * (kept == bad)
                                                   .view(-1, 1), check=check))
            return
        error = IndexError if check == "host" else RuntimeError
        with pytest.raises(error, match=rf"index\[{n // 2}\] = {bad_key} is out of range"
                           if check == "host" else "index has a value outside"):
            detsum.index_add(input, 0, bad, source, check=check)


def test_unsorted_keys_are_scanned_up_to_a_chunk_and_sorted_past_it():
    """At most CHUNK_TERMS positions, one launch and no sort (``index_add``, ``index_add_``
    and ``scatter_reduce``); one more, the sort and the launch that finds its offsets; the
    bits the Numba backend gives either way."""
    from launch_counter import count, gpu_path

    for rows, sorts in ((CHUNK, 0), (CHUNK + 1, 1)):
        g = torch.Generator().manual_seed(rows)
        index = torch.randint(0, N_OUT, (rows,), generator=g)
        source = make_data((rows, 3), torch.float32, seed=rows, spread=True)
        input = make_data((N_OUT, 3), torch.float32, seed=rows + 1)
        calls = {
            "index_add": lambda: detsum.index_add(input, 0, index, source, mode="kahan"),
            "index_add_": lambda: detsum.index_add_(input.clone(), 0, index, source),
            "scatter_reduce": lambda: detsum.scatter_reduce(input, 0, index, source, "amax")}
        for name, call in calls.items():
            with gpu_path():
                counted = count(call)
            assert counted.summary()["sorts"] == sorts, (rows, name)
            launched = ["_sort_offsets_kernel"] * sorts + ["_segment_kernel"]
            assert [name for name, _ in counted.launches] == launched, (rows, name)
            with detsum.backend("numba"):
                assert_same_bits(counted.result, call())


@pytest.mark.parametrize("check", ["host", "device", "off"])
def test_unsorted_keys_checked_at_every_level(check, monkeypatch):
    """A key out of range in a scanned index: at "host" the caller's error (in place with the
    caller's tensor untouched: the launch, finding a bad key, writes nothing), at "device"
    the launch's assert, at "off" the position in no segment; a valid index at every level
    gives the Numba backend's bits."""
    from detsum import _segments

    monkeypatch.setattr(_segments, "GPU_CHECKS_ON_CPU", True)
    input, source = torch.zeros(4, 3), make_data((5, 3), torch.float32, seed=1)
    good, bad = torch.tensor([0, 3, 1, 3, 2]), torch.tensor([0, 3, 4, 3, 2])
    with detsum.backend("numba"):
        expected = detsum.index_add(input, 0, good, source)
    with detsum.backend("triton"):
        assert_same_bits(detsum.index_add(input, 0, good, source, check=check), expected)
        if check == "off":
            kept = good.clone()
            kept[2] = 0
            out = detsum.index_add(input, 0, bad, source, check=check)
            assert_same_bits(out, detsum.index_add(input, 0, kept, source * (kept == good)
                                                   .view(-1, 1), check=check))
            return
        error = IndexError if check == "host" else RuntimeError
        with pytest.raises(error, match=r"index\[2\] = 4 is out of range" if check == "host"
                           else "index has a value outside"):
            detsum.index_add(input, 0, bad, source, check=check)
        target = input.clone()
        with pytest.raises(error):
            detsum.index_add_(target, 0, bad, source, check=check)
        if check == "host":
            assert not target.any()


# ---- only order-neutral parameters may change; validation happens before any write ----------

def test_block_width_and_grid_caps_do_not_change_bits(monkeypatch):
    """Narrow column blocks and a grid of one program per axis (the programs then loop over
    every column block and outer index) give the same bits as the default launch."""
    from detsum.kernels.triton import segment

    source = make_data((2, CHUNK + 30, 40), torch.bfloat16, seed=3, spread=True)
    input = make_data((2, 4, 40), torch.bfloat16, seed=4, spread=True)
    index = torch.randint(0, 4, (CHUNK + 30,), generator=torch.Generator().manual_seed(5))
    index[: CHUNK + 9] = 2  # one segment of two chunks

    def run():
        with detsum.backend("triton"):
            return detsum.index_add(on_device(input), 1, on_device(index), on_device(source),
                                    mode="kahan").cpu()

    default = run()
    monkeypatch.setattr(segment, "_ROW_BYTES", 32)
    monkeypatch.setattr(segment, "_MAX_GRID_YZ", 1)
    assert_same_bits(run(), default)
    with detsum.backend("numba"):
        assert_same_bits(detsum.index_add(input, 1, index, source, mode="kahan"), default)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """The triton backend on CPU tensors outside the interpreter says how to get it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with detsum.backend("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        detsum.segment_sum(torch.ones(3, 2), torch.tensor([0, 3]))


_INTERPRETER_ASKED_TOO_LATE = """
import os
import torch, triton  # triton first, TRITON_INTERPRET unset: its own functions are compiled
os.environ["TRITON_INTERPRET"] = "1"
import detsum
with detsum.backend("triton"):
    try:
        detsum.segment_sum(torch.ones(3, 2), torch.tensor([0, 3]))
    except Exception as error:
        print(f"{type(error).__name__}: {error}")
"""


def test_the_interpreter_asked_for_after_triton_was_imported_is_named():
    """TRITON_INTERPRET=1 set after triton was imported: detsum's kernels are made for the
    interpreter but triton.language's functions are not, and the call died inside Triton
    ("Cannot call @triton.jit'd outside of the scope of a kernel"). In a fresh process, as
    this one imported triton under the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _INTERPRETER_ASKED_TOO_LATE], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == (
        "ValueError: detsum.segment_sum: the triton backend runs CPU tensors only in Triton's "
        "interpreter, and TRITON_INTERPRET=1 was set after triton was first imported (or after "
        "detsum's Triton kernels were), so triton made its functions for a GPU; expected "
        "TRITON_INTERPRET=1 set before triton is first imported (by anything), or CUDA "
        "tensors, or another backend"), run.stdout


def test_bad_index_raises_before_writing():
    input = torch.zeros(4, 3, device=DEVICE)
    source = torch.ones(3, 3, device=DEVICE)
    with detsum.backend("triton"):
        with pytest.raises(IndexError, match=r"index\[1\] = 4 is out of range"):
            detsum.index_add_(input, 0, torch.tensor([0, 4, -1], device=DEVICE), source)
        assert not input.any()
        with pytest.raises(ValueError, match="decreases at position 2"):
            detsum.scatter_reduce(input, 0, torch.tensor([0, 2, 1], device=DEVICE), source,
                                  "sum", sorted=True)


# ---- GPU only: torch on CUDA, repeat runs, more than 2**31 elements ---------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("slice_size", [1, 8, 32, 33, 4096])
@pytest.mark.parametrize("n_terms", [1, 31, 32, 33, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
def test_autograd_mode_matches_torch_on_cuda(dtype, n_terms, slice_size):
    """"autograd" mode against index_put_(accumulate=True) run by torch on the GPU itself: the
    check that the contract's CUDA rows (read from torch's source) are what the hardware does."""
    seed = seed_of("cuda-torch", slice_size, n_terms, dtype)
    g = torch.Generator().manual_seed(seed)
    source = make_data((n_terms + 5, slice_size), dtype, seed=seed, spread=True).cuda()
    input = make_data((3, slice_size), dtype, seed=seed + 1, spread=True).cuda()
    index = torch.cat([torch.zeros(n_terms, dtype=torch.long), torch.ones(5, dtype=torch.long)])
    index = index[torch.randperm(n_terms + 5, generator=g)].cuda()
    expected = torch.ops.aten.index_put_(input.clone(), [index], source, True)
    got = detsum.index_add(input, 0, index, source, mode="autograd")
    assert_same_bits(got.cpu(), expected.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_repeated_runs_give_same_bits(mode):
    """100 runs of a large, skewed index_add (a hot row with a third of all rows, the rest
    Zipf-like) give one bit pattern."""
    g = torch.Generator().manual_seed(11)
    rows, table, cols = 200_000, 4096, 256
    weights = 1.0 / torch.arange(1, table + 1, dtype=torch.float64)
    index = torch.multinomial(weights, rows, replacement=True, generator=g)
    index[torch.rand(rows, generator=g) < 0.33] = 17
    source = make_data((rows, cols), torch.bfloat16, seed=12, spread=True).cuda()
    input = make_data((table, cols), torch.bfloat16, seed=13).cuda()
    index = index.cuda()
    first = detsum.index_add(input, 0, index, source, mode=mode)
    for _ in range(99):
        assert_same_bits(detsum.index_add(input, 0, index, source, mode=mode), first)


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_more_than_2_31_elements():
    """A bf16 source of 2**31 + 2**20 elements (about 4 GiB): offsets and addresses past
    2**31 must be 64-bit. Small integers make every sum exact in fp32, so the expected result
    is the fp64 sum rounded once, whatever the order."""
    cols = 4096
    rows = (2**31 + 2**20) // cols
    g = torch.Generator(device="cuda").manual_seed(0)
    source = torch.randint(-2, 3, (rows, cols), device="cuda", generator=g).to(torch.bfloat16)
    index = torch.randint(0, 64, (rows,), device="cuda", generator=g)
    index[-10:] = 63  # the last rows, beyond 2**31 elements, all land in one output
    got = detsum.index_add(torch.zeros(64, cols, dtype=torch.bfloat16, device="cuda"), 0,
                           index, source)
    expected = torch.zeros(64, cols, dtype=torch.float64, device="cuda").index_add_(
        0, index, source.double()).to(torch.bfloat16)
    assert_same_bits(got.cpu(), expected.cpu())
    segments = detsum.segment_sum(source[-1000:], torch.tensor([0, 990, 1000], device="cuda"))
    assert_same_bits(segments.cpu(),
                     torch.stack([source[-1000:-10].double().sum(0),
                                  source[-10:].double().sum(0)]).to(torch.bfloat16).cpu())


# ---- the compiled code: no FMA, IEEE division (no GPU needed to compile) ---------------------

def test_compiled_ptx_has_no_fma_and_rounds_divisions():
    """Compile the kernels for sm_90 (Hopper) and read the PTX: with the launcher's
    ``enable_fp_fusion=False`` no multiply is fused into an add, and every division is
    ``div.rn`` (IEEE). The control compile with fusion allowed does fuse, so the check can fail."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "ptx_check.py")],
                         capture_output=True, text=True, env=env, timeout=600)
    if run.returncode != 0 and "ptxas" in run.stderr:
        pytest.skip(f"no ptxas to compile with: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    control = found.pop("control: bf16 sum wide alpha, fusion allowed")
    moe = found.pop("moe backward bf16 h4096 launched")  # its registers (below)
    assert control["fma"] > 0
    for name, counts in found.items():
        assert counts["fma"] == 0, name
        assert all(d.startswith("div.rn.") for d in counts["divisions"]), (name, counts)
    assert found["bf16 mean kahan"]["divisions"] == ["div.rn.f32"]
    assert found["fp64 mean wide"]["divisions"] == ["div.rn.f64"]
    # The exact mean divides a certified sum by one IEEE fp64 division (fp64 data: then its
    # remainder, exactly, by Dekker's products: still no fma), the others' limbs as integers.
    assert found["fp64 mean exact"]["divisions"] == ["div.rn.f64"]
    assert found["bf16 mean exact"]["divisions"] == ["div.rn.f64"]
    # The chunk programs' tickets (SPLIT): an acq_rel atomic at GPU scope after a barrier that
    # follows the program's stores of its part, and the folder's loads of the parts from L2.
    for name in ("bf16 sum wide alpha", "bf16 sum kahan alpha", "fp16 mean kahan",
                 "fp32 sum kahan carry", "fp32 sum kahan plan's index"):
        assert found[name]["atomics"] == ["atom.global.gpu.acq_rel.add.u64"], name
        assert found[name]["barrier_before_each_atomic"], name
        assert found[name]["cg_loads"] > 0, name
    assert found["bf16 sum round_each alpha"]["atomics"] == []  # never split, never a ticket
    # EXACT's chunk programs take the same tickets and its fold reads their parts from L2;
    # nothing spilled (its fold rounds half a column block at a time: exact._exact_fold).
    for name in ("bf16 sum exact alpha", "fp64 mean exact", "bf16 mean exact"):
        assert found[name]["atomics"] == ["atom.global.gpu.acq_rel.add.u64"], name
        assert found[name]["barrier_before_each_atomic"], name
        assert found[name]["cg_loads"] > 0, name
        if "spill_stores" in found[name]:  # Triton shipped a ptxas for sm_90
            assert found[name]["spill_stores"] == found[name]["spill_loads"] == 0, found[name]
    # The checkers' ticket carries what they found in its value: relaxed is enough.
    for name in ("fp32 sum wide offsets checked", "fp32 sum wide inner offsets checked, tiles"):
        assert found[name]["atomics"] == [
            "atom.global.gpu.acq_rel.add.u64", "atom.global.gpu.relaxed.add.u64"], name
    # A gather of bf16 rows of 4096 as segment_reduce launches it: one term loop, which
    # whole segments and chunks share, pipelined, its rows copied asynchronously, 4 in
    # flight, and nothing spilled.
    gather = found["bf16 sum wide h4096 launched"]
    assert gather["pipelined_term_loops"] == 1, gather
    assert gather["row_copies_per_iteration"] >= 1, gather
    assert gather["rows_in_flight"] >= 4, gather
    if "spill_stores" in gather:  # Triton shipped a ptxas for sm_90
        assert gather["spill_stores"] == gather["spill_loads"] == 0, gather
    # The counting sort of a long index: integer counts alone, no atomic, nothing spilled;
    # the ranking program's zeros of its row of the table land before its counts.
    ranks = found["counting sort ranks"]
    assert ranks["barrier_after_first_stores"], ranks
    for name in ("counting sort ranks", "counting sort totals", "counting sort starts",
                 "counting sort places"):
        assert found[name]["atomics"] == [], found[name]
        if "spill_stores" in found[name]:  # Triton shipped a ptxas for sm_90
            assert found[name]["spill_stores"] == found[name]["spill_loads"] == 0, found[name]
    # The MoE backward's launch: with a plan 32 registers a thread (every warp slot of an
    # SM filled); without one, the sort's offsets and the chunk programs, at most 40 (three
    # quarters of them; 64 and half when each program searched the sort's values itself).
    # fp32 rows (the Zipf benchmark's): at most 40 too (56 with a term loop for chunks of
    # its own).
    if moe["plan"]:  # Triton shipped a ptxas for sm_90
        assert moe["plan"]["registers"] <= 32, moe
        assert moe["sort"]["registers"] <= 40, moe
        assert moe["fp32 sort"]["registers"] <= 40, moe
        for form in moe.values():
            assert form["spill_stores"] == form["spill_loads"] == 0, moe
    # Narrow rows (64 columns) with a plan: several segments a program as one tile of four
    # warps, loaded 16 bytes at a time by asynchronous copies, 4 tiles in flight (each a row
    # of every segment of the tile), nothing spilled.
    for dtype in ("torch.float32", "torch.bfloat16"):
        narrow = found[f"narrow rows {dtype} h64 launched"]
        assert narrow["warps"] == 4, narrow
        assert narrow["loads_16_bytes"], narrow
        assert narrow["pipelined_term_loops"] == 1, narrow
        assert narrow["row_copies_per_iteration"] >= 1, narrow
        assert narrow["rows_in_flight"] >= 4, narrow
        if "spill_stores" in narrow:  # Triton shipped a ptxas for sm_90
            assert narrow["spill_stores"] == narrow["spill_loads"] == 0, narrow


def test_ptx_check_sees_an_atomic_without_a_barrier_before_it():
    """The PTX test's reading of the tickets can fail: a global store between the last
    barrier and an atomic is found."""
    import ptx_check

    fenced = "st.global.b32 [%rd1], %r1;\nbar.sync 0;\natom.global.gpu.acq_rel.add.u64 %rd2;"
    assert ptx_check._tickets(fenced)["barrier_before_each_atomic"]
    unfenced = "bar.sync 0;\nst.global.b32 [%rd1], %r1;\natom.global.gpu.acq_rel.add.u64 %rd2;"
    assert not ptx_check._tickets(unfenced)["barrier_before_each_atomic"]


def test_ptx_check_counts_the_rows_in_flight_of_the_pipelined_loops():
    """The PTX test's reading of the term loop can fail: a loop without asynchronous copies
    has one row in flight; one that waits for all but N of its groups holds N // (groups per
    iteration) + 1, and the fewest of two loops is reported; copies of 8 bytes (row numbers)
    are no row copies; an outer loop's copies are not counted."""
    import ptx_check

    def loops(*bodies):
        inner = "".join(f"$L__BB0_{n}:\n{body}\n @%p1 bra $L__BB0_{n};\n"
                        for n, body in enumerate(bodies, start=2))
        return ("$L__BB0_1:\n cp.async.commit_group;\n cp.async.wait_group 9;\n" + inner
                + " @%p2 bra $L__BB0_1;")

    plain = " ld.global.b64 %rd3, [%rd2];\n ld.global.v4.b32 {%r2}, [%rd3];\n"
    assert ptx_check._term_loop(loops(plain)) == {
        "pipelined_term_loops": 0, "row_copies_per_iteration": 0, "rows_in_flight": 1}
    rows = " cp.async.cg.shared.global [%r1], [%rd3], 0x10;\n cp.async.commit_group;\n"
    numbers = " @%p3 cp.async.ca.shared.global [ %r4 + 0 ], [ %rd5 + 0 ], 0x8, %r6;\n"
    numbers += " cp.async.commit_group;\n"
    waiting = " cp.async.wait_group {};\n ld.shared.v4.b32 {{%r2}}, [%r1];\n"
    assert ptx_check._term_loop(loops(waiting.format(3) + rows)) == {
        "pipelined_term_loops": 1, "row_copies_per_iteration": 1, "rows_in_flight": 4}
    assert ptx_check._term_loop(loops(waiting.format(6) + rows + numbers,
                                      waiting.format(2) + 2 * rows)) == {
        "pipelined_term_loops": 2, "row_copies_per_iteration": 1, "rows_in_flight": 2}
    assert ptx_check._term_loop(loops(waiting.format(3) + numbers)) == {
        "pipelined_term_loops": 1, "row_copies_per_iteration": 0, "rows_in_flight": 4}
