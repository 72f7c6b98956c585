"""The Numba CPU kernels (detsum.kernels.numba) against obviously correct torch loops.

Every check is bit equality (NaNs by position): the reference below spells out the
arithmetic of the segment_reduce contract one term at a time with torch ops, each of which
rounds once (torch never fuses the separate ``*`` and ``+`` written here), so a kernel that
contracted ``acc + x * alpha`` into an FMA, reordered a segment or skipped a rounding fails.
Outputs are NaN-poisoned before each call, so an element the kernel forgot to write fails too.
"""

import itertools
import sys

import numba
import pytest
import torch

from detsum import kernels as K
from detsum.kernels.numba.plan import check_sorted_offsets, counting_sort
from detsum.kernels.numba.segment import segment_reduce
from detsum.kernels import numba as numba_kernels
from detsum.kernels.numba import common as numba_common
from detsum.kernels.numba.instances import Blocks
from kernel_instances import every_kernel

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
RULES = (K.WIDE, K.KAHAN, K.ROUND_EACH)
REDUCES = (K.SUM, K.MEAN, K.PROD, K.AMAX, K.AMIN)
RNAME = {v: k for k, v in K.REDUCE_CODES.items()}

# Segment sizes with empty segments first, inside and last.
COUNTS = (0, 3, 0, 4, 1, 5, 0)
# inner: 1 (one column), 7 (shorter than a vector), 40 (vectors + tail),
# 1100 (more than one column chunk of the kernel: items split a row).
INNERS = (1, 7, 40, 1100)


def acc_type(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(src, order, offsets, base, *, reduce, rule, alpha, include_base):
    """The contract, literally: one output row at a time, one term at a time."""
    outer, _, inner = src.shape
    nseg = offsets.numel() - 1
    dt, A = src.dtype, acc_type(src.dtype)
    out = torch.empty(outer, nseg, inner, dtype=dt)
    rows = order if order is not None else torch.arange(src.shape[1])
    use_base = base is not None and include_base
    a = torch.tensor(alpha, dtype=A)
    for o, s in itertools.product(range(outer), range(nseg)):
        terms = [src[o, r] for r in rows[offsets[s]:offsets[s + 1]].tolist()]
        if not terms and not use_base:
            out[o, s] = base[o, s] if base is not None else 0
            continue
        if reduce in (K.AMAX, K.AMIN):
            acc = base[o, s].to(A) if use_base else terms[0].to(A)
            for x in terms if use_base else terms[1:]:
                x = x.to(A)
                better = x > acc if reduce == K.AMAX else x < acc
                acc = torch.where((x.isnan() | better) & ~acc.isnan(), x, acc)
            out[o, s] = acc.to(dt)
            continue
        if reduce == K.PROD:
            acc = base[o, s].to(A) if use_base else torch.ones(inner, dtype=A)
            for x in terms:
                acc = acc * x.to(A)
            out[o, s] = acc.to(dt)
            continue

        def term(x):
            t = x.to(A) if alpha == 1 else x.to(A) * a
            if rule == K.ROUND_EACH and reduce == K.SUM:
                t = t.to(dt).to(A)
            return t

        acc = base[o, s].to(A) if use_base else torch.zeros(inner, dtype=A)
        if rule == K.KAHAN:
            c = torch.zeros(inner, dtype=A)
            for x in terms:
                t = term(x)
                u = acc + t
                c = c + torch.where(acc.abs() >= t.abs(), (acc - u) + t, (t - u) + acc)
                acc = u
            # c == 0 is not added: a sum of -0.0 terms stays -0.0 (as detsum/reference.py).
            acc = torch.where(acc.isfinite() & (c != 0), acc + c, acc)
        elif rule == K.ROUND_EACH and reduce == K.SUM:
            for x in terms:
                acc = (acc + term(x)).to(dt).to(A)
        else:
            for x in terms:
                acc = acc + term(x)
        if reduce == K.MEAN:
            if rule == K.ROUND_EACH:
                acc = acc.to(dt).to(A)  # torch's scatter_reduce mean: total rounded first
            acc = acc / torch.tensor(len(terms) + int(use_base), dtype=A)
        out[o, s] = acc.to(dt)
    return out


def assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), f"NaN positions differ at {(nan_a != nan_e).nonzero()[:5]}"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a = actual.masked_fill(nan_a, 0).contiguous().view(bits)
    e = expected.masked_fill(nan_e, 0).contiguous().view(bits)
    if not torch.equal(a, e):
        where = (a != e).nonzero()
        first = tuple(where[0].tolist())
        raise AssertionError(
            f"{where.shape[0]} of {a.numel()} differ; first at {first}: "
            f"{actual[first].item()!r} vs {expected[first].item()!r}"
        )


def make_src(shape, dtype, reduce, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if reduce == K.PROD:
        # Products of many randn values vanish; keep factors near 1 so rounding matters.
        x = 1 + x / 8
    else:
        # Many binades and both signs: cancellation, rounding and compensation all show.
        x = x * torch.exp2(torch.randint(-6, 7, shape, generator=g).double())
    return x.to(dtype)


def run(src, order, offsets, base, out=None, **kw):
    if out is None:
        out = torch.empty(src.shape[0], offsets.numel() - 1, src.shape[2], dtype=src.dtype)
    out.fill_(float("nan"))
    segment_reduce(src, order, offsets, base, out, **kw)
    return out


def offsets_of(counts):
    return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: K.RULE_NAMES[r])
@pytest.mark.parametrize("reduce", REDUCES, ids=RNAME.get)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_against_reference(dtype, reduce, rule):
    offsets = offsets_of(COUNTS)
    n = int(offsets[-1])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for k, (inner, order, include_base, alpha, base_none) in enumerate(
        itertools.product(INNERS, (None, perm), (True, False), (1.0, 0.3), (False, True))
    ):
        # The contract: alpha != 1 and base None only come with SUM.
        if reduce != K.SUM and (alpha != 1.0 or base_none):
            continue
        src = make_src((2, n, inner), dtype, reduce, seed=k)
        nseg = offsets.numel() - 1
        base = None if base_none else make_src((2, nseg, inner), dtype, reduce, k + 99)
        kw = dict(reduce=reduce, rule=rule, alpha=alpha, include_base=include_base)
        expected = reference(src, order, offsets, base, **kw)
        actual = run(src, order, offsets, base, **kw)
        try:
            assert_same_bits(actual, expected)
        except AssertionError as e:
            raise AssertionError(
                f"inner={inner} order={'perm' if order is not None else None} "
                f"include_base={include_base} alpha={alpha} "
                f"base={'None' if base_none else 'given'}: {e}"
            ) from None


@pytest.mark.parametrize("rule", RULES, ids=lambda r: K.RULE_NAMES[r])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite(dtype, rule):
    """inf and nan propagate as in a plain sum (Kahan never makes inf - inf = nan), sums of
    -0.0 stay -0.0 under every rule; amax/amin propagate nan and keep the earlier of +0.0 and
    -0.0."""
    offsets = offsets_of((2, 2, 2, 2, 4, 3))
    inf, nan = float("inf"), float("nan")
    src = torch.tensor(
        [[1, 2, 3, 4, 5, 6],  # seg 0: finite
         [inf, 1, -1, 0.0, -0.0, 2],
         [inf, inf, 1, -0.0, 0.0, 3],  # seg 1: inf + inf; +0 / -0 ties
         [1, -inf, 1, 0.0, -0.0, nan],
         [inf, nan, 2, 0.0, 0.0, 1],  # seg 2: inf - inf = nan; nan first
         [-inf, 1, nan, -0.0, -0.0, 1],
         [1e30, 1, 1, 5, 5, 5],  # seg 3: overflow in fp16/bf16 only on the way out
         [1e30, 1, 1, 5, 5, 5],
         [nan, 1, 1, 1, 1, 1],  # seg 4: nan at every position
         [1, nan, 1, 1, 1, 1],
         [1, 1, nan, 1, 1, 1],
         [1, 1, 1, 1, 1, nan],
         [0.0, -0.0, 1, 2, 3, 4],  # seg 5: signed zeros
         [-0.0, -0.0, 1, 2, 3, 4],  # column 1: all -0.0
         [-0.0, -0.0, 1, 2, 3, 4]],
        dtype=torch.float64,
    ).to(dtype)[None]
    base = torch.tensor([[-0.0] * 6] * 6, dtype=torch.float64).to(dtype)[None]
    # Also each segment reversed: the given order is followed, not assumed.
    reverse = torch.cat([torch.arange(offsets[s + 1] - 1, offsets[s] - 1, -1) for s in range(6)])
    for reduce, include_base, order in itertools.product(REDUCES, (True, False), (None, reverse)):
        kw = dict(reduce=reduce, rule=rule, alpha=1.0, include_base=include_base)
        assert_same_bits(run(src, order, offsets, base, **kw),
                         reference(src, order, offsets, base, **kw))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_and_noncontiguous(dtype):
    """out may be base itself (index_add_); src, base and order may be strided views."""
    offsets = offsets_of(COUNTS)
    n, nseg = int(offsets[-1]), offsets.numel() - 1
    for rule, reduce in itertools.product(RULES, (K.SUM, K.MEAN, K.AMAX)):
        alpha = 0.3 if reduce == K.SUM else 1.0
        kw = dict(reduce=reduce, rule=rule, alpha=alpha, include_base=True)
        # In place.
        src = make_src((2, n, 40), dtype, reduce, seed=5)
        base = make_src((2, nseg, 40), dtype, reduce, seed=6)
        expected = reference(src, None, offsets, base.clone(), **kw)
        segment_reduce(src, None, offsets, base, base, **kw)
        assert_same_bits(base, expected)
        # Strided everything: src transposed and sliced, base transposed, order every other.
        big = make_src((40 * 2, 2 * n, 3), dtype, reduce, seed=7)
        src = big.permute(2, 1, 0)[:2, ::2, ::2]  # [2, n, 40], no unit stride anywhere
        base = make_src((40, nseg, 2), dtype, reduce, seed=8).permute(2, 1, 0)
        order = torch.randperm(2 * n, generator=torch.Generator().manual_seed(2))
        order = order[order < n]
        order = torch.stack([order, order]).t().reshape(-1)[::2]  # stride 2
        assert not src.is_contiguous() and not base.is_contiguous() and order.stride(0) == 2
        expected = reference(src, order, offsets, base, **kw)
        assert_same_bits(run(src, order, offsets, base, **kw), expected)


def test_expanded_order_and_src():
    """Zero strides (expanded tensors) are read as they are: one row counted many times."""
    src = torch.randn(1, 1, 8).expand(2, 5, 8)
    order = torch.tensor([0]).expand(5)
    offsets = torch.tensor([0, 2, 5])
    for rule in RULES:
        kw = dict(reduce=K.SUM, rule=rule, alpha=0.3, include_base=False)
        assert_same_bits(run(src, order, offsets, None, **kw),
                         reference(src, order, offsets, None, **kw))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_few_rows_many_columns(dtype):
    """One output row: the kernel narrows its column chunks to feed every thread."""
    src = make_src((1, 9, 1100), dtype, K.SUM, seed=3)
    offsets = torch.tensor([0, 9])
    base = make_src((1, 1, 1100), dtype, K.SUM, seed=4)
    for rule in RULES:
        kw = dict(reduce=K.SUM, rule=rule, alpha=0.3, include_base=True)
        assert_same_bits(run(src, None, offsets, base, **kw),
                         reference(src, None, offsets, base, **kw))


def test_empty_shapes():
    f32 = torch.float32
    kw = dict(reduce=K.SUM, rule=K.WIDE, alpha=1.0, include_base=True)
    # No segments, no columns, no outer: nothing to do, nothing touched.
    segment_reduce(torch.empty(1, 3, 4), None, torch.zeros(1, dtype=torch.int64), None,
                   torch.empty(1, 0, 4), **kw)
    out = torch.full((1, 2, 0), float("nan"))
    segment_reduce(torch.empty(1, 3, 0), None, torch.tensor([0, 1, 3]), None, out, **kw)
    segment_reduce(torch.empty(0, 3, 4), None, torch.tensor([0, 3]), None,
                   torch.empty(0, 1, 4), **kw)
    # No source rows at all: every segment is empty -> base row, or zero.
    offsets = torch.zeros(4, dtype=torch.int64)
    base = torch.randn(2, 3, 5)
    for reduce in REDUCES:
        for include_base in (True, False):
            k2 = dict(kw, reduce=reduce, include_base=include_base)
            out = run(torch.empty(2, 0, 5), None, offsets, base, **k2)
            assert_same_bits(out, reference(torch.empty(2, 0, 5), None, offsets, base, **k2))
    out = run(torch.empty(2, 0, 5), None, offsets, None, **kw)
    assert torch.equal(out, torch.zeros(2, 3, 5, dtype=f32))


@pytest.mark.parametrize("min_block_elements", (1, None), ids=("64-blocks-a-thread", "default"))
@pytest.mark.parametrize("rule", RULES, ids=lambda r: K.RULE_NAMES[r])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
def test_thread_count_does_not_matter(dtype, rule, min_block_elements, monkeypatch):
    """Every schedule gives the same bits: one thread or several, few blocks (the default
    for this size) or as many as the kernel ever makes."""
    if min_block_elements is not None:
        monkeypatch.setattr(numba_common, "_MIN_BLOCK_ELEMENTS", min_block_elements)
    g = torch.Generator().manual_seed(11)
    index = torch.randint(0, 300, (5000,), generator=g)
    order, offsets, bad = counting_sort(index, 300)
    assert bad == -1
    src = make_src((1, 5000, 70), dtype, K.SUM, seed=12)
    base = make_src((1, 300, 70), dtype, K.SUM, seed=13)
    kw = dict(reduce=K.SUM, rule=rule, alpha=0.3, include_base=True)
    old = numba.get_num_threads()
    try:
        outs = []
        for threads in sorted({1, 2, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            outs.append(run(src, order, offsets, base, **kw))
    finally:
        numba.set_num_threads(old)
    for other in outs[1:]:
        assert_same_bits(other, outs[0])
    assert_same_bits(outs[0], reference(src, order, offsets, base, **kw))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
def test_round_each_is_torch_index_put(dtype):
    """ROUND_EACH is torch's CPU index_put_(accumulate=True) (what autograd runs)."""
    g = torch.Generator().manual_seed(21)
    index = torch.randint(0, 9, (400,), generator=g)
    src = make_src((400, 33), dtype, K.SUM, seed=22)
    base = make_src((9, 33), dtype, K.SUM, seed=23)
    order, offsets, _ = counting_sort(index, 9)
    out = run(src[None], order, offsets, base[None], reduce=K.SUM, rule=K.ROUND_EACH,
              alpha=1.0, include_base=True)
    assert_same_bits(out[0], base.clone().index_put_((index,), src, accumulate=True))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
def test_torch_scatter_reduce_facts(dtype):
    """What torch's CPU scatter_reduce computes, row-wise: sum = WIDE, mean = ROUND_EACH's
    mean (total rounded to the dtype, then divided), prod/amax/amin as here."""
    g = torch.Generator().manual_seed(41)
    index = torch.randint(0, 7, (200,), generator=g)
    src = make_src((200, 33), dtype, K.SUM, seed=42)
    base = make_src((7, 33), dtype, K.SUM, seed=43)
    order, offsets, _ = counting_sort(index, 7)
    cases = (("sum", K.WIDE), ("mean", K.ROUND_EACH), ("prod", K.WIDE), ("amax", K.WIDE),
             ("amin", K.WIDE))
    for (name, rule), include_self in itertools.product(cases, (True, False)):
        x = src if name != "prod" else make_src((200, 33), dtype, K.PROD, seed=44)
        expected = base.scatter_reduce(0, index[:, None].expand(200, 33), x, name,
                                       include_self=include_self)
        out = run(x[None], order, offsets, base[None], reduce=K.REDUCE_CODES[name], rule=rule,
                  alpha=1.0, include_base=include_self)
        assert_same_bits(out[0], expected)


# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize("idx_dtype", (torch.int32, torch.int64), ids=str)
def test_counting_sort(idx_dtype):
    g = torch.Generator().manual_seed(31)
    for n, nseg in ((0, 0), (0, 5), (1, 1), (1000, 7), (1000, 3000)):
        index = torch.randint(0, max(nseg, 1), (n,), generator=g).to(idx_dtype)
        order, offsets, bad = counting_sort(index, nseg)
        assert bad == -1 and order.dtype == offsets.dtype == torch.int64
        assert torch.equal(order, torch.sort(index, stable=True).indices)
        counts = torch.bincount(index.long(), minlength=nseg)
        zero = torch.zeros(1, dtype=torch.int64)
        assert torch.equal(offsets, torch.cat([zero, counts.cumsum(0)]))
    # Strided index.
    index = torch.tensor([3, 9, 1, 9, 3, 9, 0, 9], dtype=idx_dtype)[::2]
    order, offsets, bad = counting_sort(index, 4)
    assert (order.tolist(), offsets.tolist(), bad) == ([3, 1, 0, 2], [0, 1, 2, 2, 4], -1)
    # Out of range: the first bad position, nothing built.
    for index, first in (([0, 1, 4, -1], 2), ([-1, 0], 0), ([0, 3], 1)):
        order, offsets, bad = counting_sort(torch.tensor(index, dtype=idx_dtype), 3)
        assert bad == first and order.numel() == 0 and offsets.numel() == 0


@pytest.mark.parametrize("idx_dtype", (torch.int32, torch.int64), ids=str)
def test_check_sorted_offsets(idx_dtype):
    def check(index, nseg):
        off, bad, unsorted = check_sorted_offsets(torch.tensor(index, dtype=idx_dtype), nseg)
        return off.tolist(), bad, unsorted

    assert check([0, 0, 2, 2, 2, 4], 5) == ([0, 2, 2, 5, 5, 6], -1, -1)
    assert check([], 2) == ([0, 0, 0], -1, -1)
    assert check([1, 0, 2], 3) == ([], -1, 1)
    assert check([0, 5, 1], 3) == ([], 1, -1)
    assert check([2, 1, 0, 7], 3) == ([], 3, 1)  # range errors are found past unsorted ones
    assert check([-1], 3) == ([], 0, -1)
    strided = torch.tensor([0, 9, 1, 9, 1, 9, 3], dtype=idx_dtype)[::2]
    off, bad, unsorted = check_sorted_offsets(strided, 4)
    assert (off.tolist(), bad, unsorted) == ([0, 1, 3, 3, 4], -1, -1)


# ---- the on-disk cache: a kernel keeps its own format's code ------------------------------------

def _compiled_functions(value, found):
    """Every Numba dispatcher reachable from ``value`` (a kernel, ``instances.Blocks``, or a
    dispatcher) through the functions a kernel instance binds and through closure cells."""
    if isinstance(value, Blocks):
        for part in (value.block_kernel, value.driver):
            _compiled_functions(part, found)
        return found
    if isinstance(value, numba_kernels._ParallelKernel):
        value = value._parallel
    if isinstance(value, numba.core.registry.CPUDispatcher) and value not in found:
        found.add(value)
        fn = value.py_func
        module_globals = vars(sys.modules[fn.__module__])
        bound = [v for k, v in fn.__globals__.items() if module_globals.get(k) is not v]
        for inner in bound + [cell.cell_contents for cell in fn.__closure__ or ()]:
            _compiled_functions(inner, found)
    return found


def test_compiled_functions_have_their_own_names():
    """Numba names a compiled function by module, qualname, argument types and a per-process
    counter; two formats' or modes' functions of one module with one qualname and the same
    argument types (bf16 and fp16 both take uint16 bits) then differ only by that counter,
    which another process numbers differently. So no two distinct compiled functions of a
    module may share a qualname."""
    found = set()
    for kernel in every_kernel():
        _compiled_functions(kernel, found)
    owners = {}
    for dispatcher in found:
        fn = dispatcher.py_func
        owners.setdefault((fn.__module__, fn.__qualname__), set()).add(fn)
    shared = {name: len(funcs) for name, funcs in owners.items() if len(funcs) > 1}
    assert len(owners) > 300
    assert not shared, f"compiled functions share a module and qualname: {shared}"


_SUM_IN_A_FRESH_PROCESS = """
import sys, torch, detsum
for name in sys.argv[1:]:
    src = (torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) * 100).to(
        getattr(torch, name))
    offsets = torch.tensor([0, 20, 64])
    with detsum.backend("numba"):
        got = detsum.segment_sum(src, offsets)
    with detsum.backend("reference"):
        want = detsum.segment_sum(src, offsets)
    print(name, torch.equal(got.view(torch.int16), want.view(torch.int16)))
"""


def test_cached_kernels_keep_their_format(tmp_path):
    """Two processes share one on-disk cache: the first compiles bf16 alone, the second
    compiles fp16 and then loads bf16 from the cache. Before the closures were named per
    format, that bf16 kernel was linked to the fp16 code and every bf16 sum was wrong, in the
    second process and in every later one (first seen on a GPU machine's 12-worker test run)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def sums_in_fresh_process(*dtype_names):
        run = subprocess.run([sys.executable, "-c", _SUM_IN_A_FRESH_PROCESS, *dtype_names],
                             env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        return run.stdout.split()

    assert sums_in_fresh_process("bfloat16") == ["bfloat16", "True"]
    assert sums_in_fresh_process("float16", "bfloat16") == [
        "float16", "True", "bfloat16", "True"]


# ---- the on-disk cache: one kernel per format and mode, loaded by later processes ------------

_CALLS_IN_A_FRESH_PROCESS = """
import json, sys, torch, detsum
from numba.core import event
from detsum.kernels import KAHAN, WIDE
from detsum.kernels.numba import exact_state, outer, weighted
from detsum.kernels.numba import small as one_column

g = torch.Generator().manual_seed(3)
rows = torch.randn(70000, 2, generator=g)  # more than one thread block: the parallel driver
index = torch.randint(0, 500, (70000,), generator=g)
small = torch.randn(30, 4, generator=g)
elementwise = torch.randint(0, 6, (30, 4), generator=g)
y, weights = torch.randn(40, 8, generator=g), torch.rand(60, generator=g)
positions = torch.randint(0, 40, (60,), generator=g)
CALLS = {
    "index_add bf16 fp32": lambda: detsum.index_add(
        torch.zeros(500, 2, dtype=torch.bfloat16), 0, index, rows.bfloat16()),
    "index_add bf16 kahan": lambda: detsum.index_add(
        torch.zeros(500, 2, dtype=torch.bfloat16), 0, index, rows.bfloat16(), mode="kahan"),
    "small index_add fp32": lambda: detsum.index_add(torch.zeros(6, 4), 0, index[:30] % 6, small),
    "segment_sum exact": lambda: detsum.segment_sum(small, torch.tensor([0, 10, 30]),
                                                     mode="exact"),
    "scatter_reduce amax": lambda: detsum.scatter_reduce(torch.zeros(6, 4), 0, elementwise,
                                                         small, "amax"),
    "weighted": lambda: (weighted.gather_scale_sum(y, positions, weights, 2, WIDE),
                         weighted.row_dots(torch.randn(30, 8, generator=g), positions[:40] % 30,
                                           y, KAHAN)),
    "products": lambda: outer.resume_products(torch.zeros(32), None,
                                              torch.randn(3, 4, generator=g),
                                              torch.randn(3, 8, generator=g), WIDE),
    "exact state": lambda: exact_state_calls(),
    "one column": lambda: one_column_calls(),
}


def one_column_calls():
    column, base = rows[:, 0].contiguous(), torch.randn(500, generator=g)
    out = [torch.empty(500) for _ in range(3)]
    assert one_column.index_add_one_column(column, index, base, out[0], WIDE) == -1
    assert one_column.extreme_one_column(column, index, base, out[1], True, False) == -1
    assert one_column.reduce_one_column(column, index, base, out[2], one_column.MEAN, KAHAN,
                                        False) == -1
    return out + [one_column.histogram(column, -1.0, 1.0, 2.0, 7.0, 7)]


def exact_state_calls():
    state = torch.zeros(14, 8, dtype=torch.int64)
    exact_state.add_terms(state, torch.randn(3, 8, generator=g))  # in place
    return state, exact_state.round_state(torch.zeros(14, 8, dtype=torch.int64), 24, 0, -149,
                                          None)


class Compiled(event.Listener):
    def __init__(self):
        self.names = []

    def on_start(self, started):
        self.names.append(started.data["dispatcher"].py_func.__qualname__)

    def on_end(self, ended):
        pass


# A module that only Numba's registry refresh imports (its typed lists): a load from the
# cache skips that refresh (detsum.kernels.numba._KernelCache), a compilation runs it.
REFRESH_MODULE = "numba.typed.typedlist"
compiled, results = {}, {}
for name, call in CALLS.items():
    listener = Compiled()
    with event.install_listener("numba:compile", listener):
        results[name] = call()
    compiled[name] = listener.names
torch.save(results, sys.argv[1])
refreshed = REFRESH_MODULE in sys.modules

import numba
import numpy as np

@numba.njit
def compiled_afterwards(values):
    return np.sum(values[values > 0])

print(json.dumps({"compiled": compiled, "refreshed": refreshed,
                  "lean": detsum.kernels.numba._LEAN_LOADS,
                  "compiled_afterwards": compiled_afterwards(np.array([1.0, -2.0, 3.0])),
                  "refreshed_then": REFRESH_MODULE in sys.modules}))
"""


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """What ``_CALLS_IN_A_FRESH_PROCESS`` found (and its calls' results, under "results"), in
    a process with an empty on-disk cache and then in a second one sharing that cache."""
    import json
    import os
    import subprocess

    folder = tmp_path_factory.mktemp("numba_cache")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(folder)}

    def in_fresh_process(name):
        run = subprocess.run([sys.executable, "-c", _CALLS_IN_A_FRESH_PROCESS,
                              str(folder / name)], env=env, capture_output=True, text=True,
                             timeout=1200)
        assert run.returncode == 0, run.stderr
        found = json.loads(run.stdout.splitlines()[-1])
        found["results"] = torch.load(folder / name, weights_only=False)
        return found

    return in_fresh_process("first.pt"), in_fresh_process("second.pt")


@pytest.fixture(scope="module")
def compiled_by_two_processes(two_processes):
    """What each call of ``_CALLS_IN_A_FRESH_PROCESS`` compiled, in the two processes."""
    return tuple(found["compiled"] for found in two_processes)


def test_every_kernel_loads_from_the_cache_in_a_later_process(compiled_by_two_processes):
    """Every kind of kernel (the one-column passes and the histogram among them) loads from
    the cache. Seen before: the kernels made in a factory (the elementwise scatter_reduce, the
    small index_add, the MoE weighted sums, the products' and the exact state's kernels) were
    closures, which Numba's cache keys by their cells' pickled contents, a compiled function
    among them pickling differently in every process: they compiled again in every process,
    7 s for scatter_reduce's."""
    first, second = compiled_by_two_processes
    assert all(first.values()), f"calls that compiled nothing in a fresh cache: {first}"
    assert not any(second.values()), f"compiled again in a later process: {second}"


def test_a_later_process_loads_without_the_registry_refresh(two_processes):
    """A first call from the cache skips Numba's refresh of its typing and lowering
    registries (0.2 s of 0.45, ``detsum.kernels.numba._KernelCache``); a compilation
    afterwards runs it, and works."""
    first, second = two_processes
    assert second["lean"], "this Numba's cache lacks what the lean load overrides"
    assert first["refreshed"] and not second["refreshed"]
    assert second["compiled_afterwards"] == 4.0 and second["refreshed_then"]


def test_loaded_kernels_compute_the_compiled_kernels_bits(two_processes):
    """The machine code loaded without the refresh (the one-call path, the parallel driver,
    every kind of kernel) computes the bits the freshly compiled code computed."""
    first, second = two_processes

    def tensors(value):
        if value is None:
            return []
        return [value] if isinstance(value, torch.Tensor) else [
            t for part in value for t in tensors(part)]

    for name, fresh in first["results"].items():
        for compiled, loaded in zip(tensors(fresh), tensors(second["results"][name]),
                                    strict=True):
            assert torch.equal(loaded, compiled), name


def test_a_mode_compiles_its_own_kernel_on_its_first_call(compiled_by_two_processes):
    """A first call compiles the kernel of its own format and mode only (seconds), not every
    mode of its dtype at once (15 s for index_add in bf16): the first "kahan" call after an
    "fp32" one of the same dtype compiles a kernel of its own."""
    first, _ = compiled_by_two_processes
    fp32, kahan = first["index_add bf16 fp32"], first["index_add bf16 kahan"]
    assert any("bf16_add_chunked" in name for name in fp32), fp32
    assert not any("kahan" in name for name in fp32), fp32
    assert any("bf16_kahan_chunked" in name for name in kahan), kahan


# ---- the on-disk cache: saves from processes at once ----------------------------------------

_SAVE_AT_ONCE = """
import pathlib, sys, time
from numba.core import caching
from detsum.kernels.numba import njit

@njit(cache=True)
def plus_one(x):
    return x + 1

kind, folder = sys.argv[1], pathlib.Path(sys.argv[2])
if kind == "load":  # a later process: both signatures from the cache
    print(plus_one(2), plus_one(2.5), sum(plus_one.stats.cache_hits.values()))
    sys.exit()

# Numba's save reads the kernel's index, then writes it and the data file. Pauses there (as a
# loaded machine can make) put both processes' reads before either's writes, and the float
# process's data file after the int process's, each under the number its read found free.
pause_index, pause_data = {"int": (1.0, 0.0), "float": (1.0, 2.0)}[kind]
save_index = caching.IndexDataCacheFile._save_index
save_data = caching.IndexDataCacheFile._save_data

def slow_index(self, overloads):
    time.sleep(pause_index)
    save_index(self, overloads)

def slow_data(self, name, data):
    time.sleep(pause_data)
    save_data(self, name, data)

caching.IndexDataCacheFile._save_index = slow_index
caching.IndexDataCacheFile._save_data = slow_data
(folder / kind).touch()
while not all((folder / other).exists() for other in ("int", "float")):  # start together
    time.sleep(0.01)
print(plus_one(2 if kind == "int" else 2.5))
"""


def test_saves_of_two_processes_at_once_keep_each_signature_its_own_code(tmp_path):
    """Two processes compile different signatures (int, float) of one kernel and save them at
    once, each reading the kernel's index before the other writes it (pauses put there). With
    Numba's own save both took data file 1, and the index named the int code for the float
    signature: a later process loaded it for 2.5 + 1. Under the save's lock
    (``detsum.kernels.numba._KernelCache``) the second save reads the first's index, and a
    later process loads each signature's own code."""
    import os
    import subprocess

    if not numba_kernels._LEAN_LOADS:
        pytest.skip("this Numba's cache lacks the parts the lock overrides")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    script = tmp_path / "plus_one.py"  # Numba files a kernel's cache by its source file
    script.write_text(_SAVE_AT_ONCE)
    runs = [subprocess.Popen([sys.executable, str(script), kind, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for kind in ("int", "float")]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err for _, err in outputs]
    assert [out.split() for out, _ in outputs] == [["3"], ["3.5"]]
    run = subprocess.run([sys.executable, str(script), "load", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["3", "3.5", "2"], run.stdout  # both loaded, right code
