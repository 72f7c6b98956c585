"""The switch's C++ kernels (``kernels/native/switch_kernels.cpp``) against its Python kernels.

The C++ kernels take the small in-place calls a small model's step makes most (``index_add_``,
``scatter_add_``, ``scatter_reduce_`` sum from self / amax / amin, ``index_put_`` with
``accumulate=True``) on float32 and float64 CPU tensors in the "fp32" and "autograd" modes (the
extremes in every mode), and hand everything else to the Python kernels. Each test runs a call
with them installed and again with the Python kernels alone (the ``python_kernels`` fixture),
and asks for the same bits, or the same error; and it asks whether the C++ kernels took the
call (their own counts), so that a case meant for them cannot pass by falling through. Inputs
are generated: shapes, dims, index dtypes and layouts, alphas, special values (NaN, infinities,
zeros of both signs), rows of more terms than a chunk, and the forms they must leave alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import detsum
from conftest import NATIVE_BUILD_ERROR, assert_same_bits
from detsum import switch
from detsum.kernels import CHUNK_TERMS

pytestmark = pytest.mark.skipif(not switch.NATIVE, reason="DETSUM_NATIVE_SWITCH=0")

FLOATS = (torch.float32, torch.float64)


@pytest.fixture(autouse=True)
def native_installed():
    """The C++ kernels built (a failed build fails here, with the compiler's words; a machine
    without a C++ compiler skips) and the switch's kernels removed after each test."""
    if NATIVE_BUILD_ERROR is not None and NATIVE_BUILD_ERROR.startswith("no C++ compiler"):
        pytest.skip(NATIVE_BUILD_ERROR)
    assert NATIVE_BUILD_ERROR is None, NATIVE_BUILD_ERROR
    detsum.disable()
    yield
    detsum.disable()


def native_counts() -> dict:
    """The calls the C++ kernels ran since the last look, by operator and by where: on detsum,
    or handed straight to torch's kernel (not through the Python kernel). Taken out of
    ``switch.counts``'s reach."""
    counted: dict = {}
    switch._take_native_counts(counted)
    return counted


def taken_by_native() -> dict:
    """The calls the C++ kernels took on detsum since the last look, by operator."""
    return {op: n for (op, where), n in native_counts().items() if where == "detsum"}


def zero_ties(mode: str, reduce: str, target, source, include_self: bool) -> bool:
    """Whether an amax or amin compares zeros of both signs in "autograd" mode, which the C++
    kernels leave to the Python ones (torch's kernel breaks such ties its own way)."""
    if mode != "autograd" or reduce not in ("amax", "amin"):
        return False
    compared = [source.reshape(-1)] + ([target.reshape(-1)] if include_self else [])
    values = torch.cat(compared).double()
    zeros = values[values == 0]
    return bool(zeros.signbit().any()) and not bool(zeros.signbit().all())


def both_ways(mode: str, call):
    """``call()`` under the switch in ``mode``, with the C++ kernels and with the Python kernels
    alone: (its result or error with them, which operators they took, its result or error
    without them). ``call`` makes its own inputs, so both runs start from the same ones."""
    outcomes = []
    taken = None
    for native in (True, False):
        switch._use_native(native)
        try:
            with detsum.deterministic(mode):
                if native:
                    assert switch.native_state() == "installed"
                    taken_by_native()
                try:
                    outcome = call()
                except Exception as error:  # the same error both ways is the test
                    outcome = error
                if native:
                    taken = taken_by_native()
        finally:
            switch._use_native(True)
        outcomes.append(outcome)
    return outcomes[0], taken, outcomes[1]


def assert_same_outcome(with_native, without_native) -> None:
    if isinstance(without_native, Exception):
        assert type(with_native) is type(without_native), with_native
        assert str(with_native) == str(without_native)
        return
    assert not isinstance(with_native, Exception), with_native
    assert_same_bits(with_native, without_native)


def values(shape, dtype, generator, *, specials: bool) -> torch.Tensor:
    """Random values over several binades, with NaNs, infinities and zeros of both signs."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-20, 21, shape, generator=generator).double())
    if specials:
        picks = torch.randint(0, 40, shape, generator=generator)
        x = torch.where(picks == 0, float("nan"), x)
        x = torch.where(picks == 1, float("inf"), x)
        x = torch.where(picks == 2, -float("inf"), x)
        x = torch.where(picks == 3, 0.0, x)
        x = torch.where(picks == 4, -0.0, x)
    return x.to(dtype)


def a_case(seed: int):
    """A generated target shape, dim, term count and index (int64 or int32) into it."""
    generator = torch.Generator().manual_seed(seed)
    ndim = int(torch.randint(1, 4, (), generator=generator))
    shape = [int(s) for s in torch.randint(1, 7, (ndim,), generator=generator)]
    dim = int(torch.randint(-ndim, ndim, (), generator=generator))
    terms = int(torch.randint(1, 40, (), generator=generator))
    index = torch.randint(0, shape[dim], (terms,), generator=generator)
    if seed % 2:
        index = index.int()
    if seed % 4 == 2:  # every other value of a longer one: a 1-D index of stride 2
        index = torch.stack([index, index.flip(0)], 1).view(-1)[::2]
    return generator, shape, dim, index


@pytest.mark.parametrize("mode", detsum.MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_index_add_(mode, dtype):
    """Generated ``index_add_`` calls, each alpha torch takes: the same bits; the C++ kernels
    take those of the rules they have (not "exact"'s sums; in "autograd" only an alpha of 1
    or -1, as the Python way)."""
    for seed in range(120):
        generator, shape, dim, index = a_case(seed)
        source_shape = list(shape)
        source_shape[dim] = index.shape[0]
        target = values(shape, dtype, generator, specials=seed % 3 == 0)
        source = values(source_shape, dtype, generator, specials=seed % 3 == 0)
        alpha = (1, -1, 0.5, 3, 1e-40, 1.0 / 3)[seed % 6]
        result, taken, expected = both_ways(
            mode, lambda: target.clone().index_add_(dim, index, source, alpha=alpha))
        assert_same_outcome(result, expected)
        takes = mode in ("fp32", "kahan") or (mode == "autograd" and alpha in (1, -1))
        assert taken == ({"index_add_": 1} if takes else {}), (seed, alpha)


def expanded(index: torch.Tensor, shape, dim: int) -> torch.Tensor:
    """``index`` broadcast along every dim of ``shape`` but ``dim`` (stride 0 there), as PyG
    writes a scatter's index."""
    view = [1] * len(shape)
    view[dim] = -1
    return index.view(view).expand(shape)


@pytest.mark.parametrize("mode", detsum.MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("reduce", ["add", "sum", "amax", "amin", "mean", "prod"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter(mode, dtype, reduce, include_self):
    """Generated ``scatter_add_`` / ``scatter_reduce_`` calls with an expanded index, and with
    an index of the same values written out (a layout the C++ kernels leave to the Python
    ones): the same bits; they take a sum from self (not in "exact" mode), amax and amin."""
    if reduce == "add" and not include_self:
        pytest.skip("scatter_add_ always sums from self")
    for seed in range(60):
        generator, shape, dim, rows = a_case(seed)
        source_shape = list(shape)
        source_shape[dim] = rows.shape[0]
        index = expanded(rows, source_shape, dim)
        if seed % 5 == 4:
            index = index.contiguous()
        target = values(shape, dtype, generator, specials=seed % 3 == 0)
        source = values(source_shape, dtype, generator, specials=seed % 3 == 0)

        def call():
            if reduce == "add":
                return target.clone().scatter_add_(dim, index, source)
            return target.clone().scatter_reduce_(dim, index, source, reduce,
                                                  include_self=include_self)

        result, taken, expected = both_ways(mode, call)
        assert_same_outcome(result, expected)
        # The row form: stride 0 or size 1 along every dim but dim (written out, only where
        # those are all of size 1).
        layout_taken = all(index.stride(d) == 0 or index.shape[d] == 1
                           for d in range(index.dim()) if d != dim % index.dim())
        sums = reduce in ("add", "sum") and include_self and mode != "exact"
        takes = layout_taken and (sums or reduce in ("amax", "amin") and not zero_ties(
            mode, reduce, target, source, include_self))
        name = "scatter_add_" if reduce == "add" else "scatter_reduce_.two"
        assert taken == ({name: 1} if takes else {}), seed


@pytest.mark.parametrize("mode", detsum.MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_index_put_accumulate(mode, dtype):
    """``index_put_(..., accumulate=True)`` with one 1-D index (the backward of ``x[idx]``),
    values of the indexed shape, and of a broadcast shape (left to the Python kernels)."""
    for seed in range(80):
        generator, shape, _, _ = a_case(seed)
        index = torch.randint(0, shape[0], (int(seed % 30) + 1,), generator=generator)
        if seed % 2:
            index = index.int()
        target = values(shape, dtype, generator, specials=seed % 3 == 0)
        values_shape = [index.shape[0], *shape[1:]]
        broadcast = seed % 7 == 6
        source = values([1, *shape[1:]] if broadcast else values_shape, dtype, generator,
                        specials=seed % 3 == 0)
        result, taken, expected = both_ways(
            mode, lambda: target.clone().index_put_((index,), source, accumulate=True))
        assert_same_outcome(result, expected)
        takes = mode != "exact" and (not broadcast or index.shape[0] == 1)
        assert taken == ({"_index_put_impl_": 1} if takes else {}), seed


@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd"])
def test_rows_of_more_terms_than_a_chunk(mode):
    """A row of more than CHUNK_TERMS terms: "fp32" and "kahan" sum it in chunks (another
    arithmetic), which the C++ kernels leave to the Python ones; "autograd" never splits, and
    they take it. Exactly CHUNK_TERMS terms they take in all three."""
    for terms in (CHUNK_TERMS, CHUNK_TERMS + 1, 3 * CHUNK_TERMS):
        generator = torch.Generator().manual_seed(terms)
        index = torch.zeros(terms, dtype=torch.int64)
        index[::2] = 1
        index[0] = 0
        index = index.sort().values  # row 0 gets terms - terms // 2 of them
        target = values((3, 4), torch.float32, generator, specials=False)
        source = values((terms, 4), torch.float32, generator, specials=False)
        result, taken, expected = both_ways(
            mode, lambda: target.clone().index_add_(0, index, source))
        assert_same_outcome(result, expected)
        over = terms - terms // 2 > CHUNK_TERMS
        splits = over and mode != "autograd"
        assert taken == ({} if splits else {"index_add_": 1}), terms
        if over and mode == "fp32":  # the chunks' arithmetic is not the serial one here
            serial = target.clone()
            for i, row in enumerate(index.tolist()):
                serial[row] = serial[row] + source[i]
            assert not torch.equal(result, serial)


@pytest.mark.parametrize("mode", detsum.MODES)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_one_column_of_rows_of_any_length(mode, dtype):
    """One column (a 1-D target, or one row of a 2-D one along its last dim), which the C++
    kernels take in one pass whatever the rows' lengths: rows of one term, of none, of
    exactly CHUNK_TERMS, of CHUNK_TERMS + 1, of two chunks and of many chunks and a shorter
    last one; each op with every alpha, an int32 index, an index of stride 2, NaN, infinities
    and both zeros: the bits of the Python kernels, and taken as the other forms are (not
    "exact"'s sums). A value out of range, last or negative (but index_put_'s, from the
    end): left to the Python kernels, nothing written, their error."""
    counts = [1, 0, CHUNK_TERMS, CHUNK_TERMS + 1, 2 * CHUNK_TERMS, 7 * CHUNK_TERMS + 19, 5, 30]
    for seed in range(8):
        generator = torch.Generator().manual_seed(80 + seed)
        index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        index = index[torch.randperm(index.numel(), generator=generator)]
        if seed % 2:
            index = index.int()
        if seed % 4 == 2:
            index = torch.stack([index, index.flip(0)], 1).view(-1)[::2]
        if seed >= 6:
            index = index.clone()
            index[-1 if seed == 6 else 100] = len(counts) if seed == 6 else -1
        target = values((len(counts),), dtype, generator, specials=seed % 3 == 0)
        source = values((index.shape[0],), dtype, generator, specials=seed % 3 == 0)
        alpha = (1, -1, 0.5, 1.0 / 3)[seed % 4]
        in_a_row = seed % 2 == 0  # one row of a 2-D target, along its last dim
        dim = 1 if in_a_row else 0

        def shaped(t):
            return t.view(1, -1) if in_a_row else t

        calls = {
            "index_add_": lambda: shaped(target.clone()).index_add_(dim, index, shaped(source),
                                                                     alpha=alpha),
            "scatter_add_": lambda: shaped(target.clone()).scatter_add_(
                dim, shaped(index.long()), shaped(source)),
            "_index_put_impl_": lambda: target.clone().index_put_((index,), source,
                                                                  accumulate=True),
        }
        for reduce in ("amax", "amin"):
            for include_self in (True, False):
                calls[f"{reduce} {include_self}"] = (
                    lambda r=reduce, i=include_self: shaped(target.clone()).scatter_reduce_(
                        dim, shaped(index.long()), shaped(source), r, include_self=i))
        for name, call in calls.items():
            result, taken, expected = both_ways(mode, call)
            assert_same_outcome(result, expected)
            op = name if name in ("index_add_", "scatter_add_", "_index_put_impl_") \
                else "scatter_reduce_.two"
            sums = op != "scatter_reduce_.two"
            reduce, include_self = (None, True) if sums else name.split()
            to_torch = zero_ties(mode, reduce, target, source, include_self == "True")
            takes = seed < 6 and (not sums or mode != "exact") and not (
                name == "index_add_" and mode == "autograd" and alpha not in (1, -1)) and not (
                to_torch)
            assert taken == ({op: 1} if takes else {}), (seed, name)
            # index_put_ counts a negative value from the end, as torch does. A call left to
            # torch's kernel gets its error.
            if seed == 6 or seed == 7 and op != "_index_put_impl_":
                error = RuntimeError if to_torch else IndexError
                assert isinstance(result, error), (seed, name)
        if seed == 6:
            # Nothing written before detsum's error (not for a call left to torch's kernel).
            checked = [lambda t: t.index_add_(dim, index, shaped(source))]
            if not zero_ties(mode, "amax", target, source, True):
                checked.append(lambda t: t.scatter_reduce_(dim, shaped(index.long()),
                                                           shaped(source), "amax"))
            for call in checked:
                work = shaped(target.clone())
                with detsum.deterministic(mode), pytest.raises(IndexError):
                    call(work)
                assert_same_bits(work, shaped(target))


def test_forms_left_to_the_python_kernels():
    """Calls the C++ kernels must not take, each with the same outcome as without them:
    16-bit floats, integers, a transposed target or source, memory shared, a launch past the
    small limit, an index value out of range or negative, an index of another dtype, an
    inference tensor outside inference mode, a target needing broadcasting."""
    x = torch.randn(6, 4)
    index = torch.tensor([0, 5, 5, 2])
    source = torch.randn(4, 4)
    big = torch.zeros(20000, 4)
    with torch.inference_mode():
        frozen = torch.zeros(6, 4)
    cases = {
        "bfloat16": lambda: x.bfloat16().index_add_(0, index, source.bfloat16()),
        "float16": lambda: x.half().index_add_(0, index, source.half()),
        "int64": lambda: x.long().index_add_(0, index, source.long()),
        "transposed target": lambda: x.clone().t().contiguous().t().index_add_(0, index, source),
        "transposed source": lambda: x.clone().index_add_(0, index, source.t()),
        "source inside the target": lambda: _overlapping(),
        "past the small limit": lambda: big.clone().index_add_(0, index, source),
        "out of range": lambda: x.clone().index_add_(0, torch.tensor([0, 6, 1, 1]), source),
        "negative": lambda: x.clone().index_add_(0, torch.tensor([0, -1, 1, 1]), source),
        "index_put_ negative": lambda: x.clone().index_put_((torch.tensor([0, -1, 1, 1]),),
                                                            source, accumulate=True),
        "int16 index": lambda: x.clone().index_add_(0, index.short(), source),
        "inference target": lambda: frozen.index_add_(0, index, source),
        "scatter out of range": lambda: x.clone().scatter_add_(
            0, expanded(torch.tensor([0, 9, 1, 1]), (4, 4), 0), source),
        "index_put_ assigning": lambda: x.clone().index_put_((index,), source),
        "complex alpha": lambda: x.clone().index_add_(0, index, source, alpha=1j),
        "bool alpha": lambda: x.clone().index_add_(0, index, source, alpha=True),
    }
    for name, call in cases.items():
        result, taken, expected = both_ways("fp32", call)
        if isinstance(expected, Exception) or expected.dtype.is_floating_point:
            assert_same_outcome(result, expected)
        else:
            assert torch.equal(result, expected), name
        assert taken == {}, name


def _overlapping() -> torch.Tensor:
    """An ``index_add_`` whose source shares rows with its target."""
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    return target[:4].index_add_(0, torch.tensor([0, 1, 1, 3]), target[2:6])


def test_in_place_semantics_and_autograd():
    """A call the C++ kernels take returns its target itself, bumps its version (autograd's
    in-place checks), and in a backward (``x[idx]`` times a weight) gives the same gradient."""
    target = torch.zeros(5, 3)
    version = target._version
    with detsum.deterministic("fp32"):
        taken_by_native()
        returned = target.index_add_(0, torch.tensor([1, 1]), torch.ones(2, 3))
        assert taken_by_native() == {"index_add_": 1}
    assert returned is target and target._version > version

    generator = torch.Generator().manual_seed(3)
    weights = values((300, 8), torch.float32, generator, specials=False)
    index = torch.randint(0, 40, (300,), generator=generator)

    def gradient():
        x = values((40, 8), torch.float32, torch.Generator().manual_seed(4),
                   specials=False).requires_grad_()
        (x[index] * weights).sum().backward()
        return x.grad

    result, taken, expected = both_ways("fp32", gradient)
    assert_same_outcome(result, expected)
    assert taken == {"_index_put_impl_": 1}


def test_a_forced_backend_and_detsums_own_calls_go_to_the_python_kernels():
    """Inside ``detsum.backend("reference")`` (in any thread) the forced backend runs the call,
    and while a switched call runs detsum's code (the flag the Python kernel sets) the C++
    kernels take nothing; the same bits either way."""
    x, index, source = torch.zeros(4, 2), torch.tensor([0, 3, 3]), torch.randn(3, 2)
    with detsum.deterministic("fp32"):
        taken_by_native()
        expected = x.clone().index_add_(0, index, source)
        assert taken_by_native() == {"index_add_": 1}
        with detsum.backend("reference"):
            assert_same_bits(x.clone().index_add_(0, index, source), expected)
        assert taken_by_native() == {}
        opened, close = threading.Event(), threading.Event()

        def forcing():
            with detsum.backend("triton"):
                opened.set()
                close.wait()

        thread = threading.Thread(target=forcing)
        thread.start()
        opened.wait()
        assert_same_bits(x.clone().index_add_(0, index, source), expected)
        assert taken_by_native() == {}
        close.set()
        thread.join()
        x.clone().index_add_(0, index, source)
        assert taken_by_native() == {"index_add_": 1}
        switch._native_loaded.detsum_native_set_inside(1)
        try:
            x.clone().index_add_(0, index, source)
        finally:
            switch._native_loaded.detsum_native_set_inside(0)
        assert taken_by_native() == {}


def test_counts_threads_and_removal():
    """``switch.counts`` counts the C++ kernels' calls as detsum's; calls from several threads
    give the same bits; a block's end leaves every call to torch's kernel, which the C++
    kernels call themselves (counted as torch's); ``disable`` gives torch its kernels back."""
    index, source = torch.tensor([2, 0, 2]), torch.randn(3, 5)
    before = switch.counts.copy()
    with detsum.deterministic("fp32"):
        expected = torch.zeros(3, 5).index_add_(0, index, source)
        results = []

        def add():
            for _ in range(50):
                results.append(torch.zeros(3, 5).index_add_(0, index, source))

        threads = [threading.Thread(target=add) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert (switch.counts - before)[("index_add_", "detsum")] == 101
    for result in results:
        assert_same_bits(result, expected)
    # Registered and off: torch's kernel, called by the C++ kernel itself (torch's CPU
    # index_add_ calls scatter_add_ through the dispatcher: that one's too).
    native_counts()
    off = torch.zeros(3, 5).index_add_(0, index, source)
    handed = {("index_add_", "torch"): 1, ("scatter_add_", "torch"): 1}
    assert native_counts() == handed
    before = switch.counts.copy()
    torch.zeros(3, 5).index_add_(0, index, source)
    assert switch.counts - before == handed
    detsum.disable()
    assert torch.equal(off, torch.zeros(3, 5).index_add_(0, index, source))
    table = torch._C._dispatch_dump_table("aten::index_add_")
    assert "switch_kernels.cpp" not in table and "switch.py" not in table


def test_the_environment_turns_them_off():
    """``DETSUM_NATIVE_SWITCH=0``: the Python kernels alone, and ``native_state`` says so."""
    program = ("import torch, detsum\nfrom detsum import switch\ndetsum.enable()\n"
               "print(switch.native_state())\n"
               "print('switch_kernels.cpp' in torch._C._dispatch_dump_table('aten::index_add_'))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env={**os.environ, "DETSUM_NATIVE_SWITCH": "0"},
                          check=True)
    assert done.stdout.split("\n")[:2] == ["off: DETSUM_NATIVE_SWITCH=0", "False"]


def test_the_first_enable_installs_them_without_importing_numba():
    """The C++ kernels, built, are installed by the first ``enable`` without Numba imported
    (0.2-0.4 s of that call): their small-call limit is ``detsum.kernels``'s, the Numba small
    kernels' own, not read from the Numba module. A small call they take needs none either."""
    program = ("import sys, torch, detsum\nfrom detsum import switch\ndetsum.enable()\n"
               "print(switch.native_state(), 'numba' in sys.modules)\n"
               "torch.zeros(2, 3).index_add_(0, torch.tensor([1, 1]), torch.ones(2, 3))\n"
               "print('numba' in sys.modules)\n"
               "from detsum.kernels import SMALL_CALL_ELEMENTS\n"
               "from detsum.kernels.numba import small\n"
               "print(small.MAX_ELEMENTS == SMALL_CALL_ELEMENTS)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split("\n")[:3] == ["installed False", "False", "True"], done.stdout


def test_detsums_own_calls_inside_a_switched_call_go_to_torch(monkeypatch):
    """A switched call that runs detsum's code (a body) sets the flag that sends that
    thread's own calls of these ops to the Python kernels, which hand them to torch: an amax
    inside the body, which the C++ kernels would take outside it, is not theirs."""
    inner = []

    def body(mode, self, dim, index, source, *, alpha=1):
        def run():
            scratch = torch.zeros(3)
            taken_by_native()
            scratch.scatter_reduce_(0, torch.tensor([0, 2, 2]), torch.tensor([1.0, 5.0, 4.0]),
                                    "amax")
            inner.append((taken_by_native(), scratch))
            return self.clone()
        return run

    monkeypatch.setitem(switch._BODIES, "index_add", body)
    with detsum.deterministic("exact"):  # no short way for an exact sum: the body runs
        torch.zeros(2).index_add(0, torch.tensor([1]), torch.ones(1))
        outside = torch.zeros(3).scatter_reduce_(0, torch.tensor([0, 2, 2]),
                                                 torch.tensor([1.0, 5.0, 4.0]), "amax")
        assert taken_by_native() == {"scatter_reduce_.two": 1}
    assert len(inner) == 1
    assert inner[0][0] == {}
    assert torch.equal(inner[0][1], outside)


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_extremes_of_equal_values_and_nans(reduce, include_self, dtype):
    """Ties and NaNs, where amax and amin may give other bits: zeros of both signs against
    each other (the earlier stays), equal values, a NaN in the target or among the terms
    (it stays, whatever comes after: NaNs of both signs tell which one stayed, and here the
    bits of NaNs are compared too)."""
    specials = [0.0, -0.0, 1.5, -1.5, float("nan"), -float("nan"), float("inf"),
                -float("inf")]
    target = torch.tensor(specials, dtype=dtype).repeat(len(specials)).view(-1, 1).repeat(1, 3)
    terms = torch.tensor(specials, dtype=dtype).repeat_interleave(len(specials))
    source = torch.stack([terms, terms.flip(0), terms], 1)
    rows = torch.arange(len(specials) ** 2)
    index = expanded(torch.cat([rows, rows.flip(0)]), (2 * len(rows), 3), 0)
    source = torch.cat([source, -source])
    result, taken, expected = both_ways("fp32", lambda: target.clone().scatter_reduce_(
        0, index, source, reduce, include_self=include_self))
    assert_same_outcome(result, expected)
    assert taken == {"scatter_reduce_.two": 1}
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(result.view(bits), expected.view(bits))


def test_without_a_compiler_the_python_kernels_take_every_call(tmp_path):
    """No compiler (``CXX`` naming none) and nothing built: the build thread says why, and the
    Python kernels give the same bits as with the C++ kernels."""
    program = (
        "import time, torch, detsum\nfrom detsum import switch\n"
        "x, index, source = torch.zeros(4, 2), torch.tensor([0, 3, 3]), torch.ones(3, 2)\n"
        "detsum.enable()\n"
        "while switch.native_state() == 'building':\n    time.sleep(0.05)\n"
        "print(switch.native_state())\n"
        "print(x.index_add_(0, index, source).tolist())\n")
    environment = {**os.environ, "CXX": str(tmp_path / "no-compiler"),
                   "DETSUM_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=environment, check=True)
    state, result = done.stdout.splitlines()[:2]
    assert state.startswith("not built: no C++ compiler"), state
    assert result == str([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [2.0, 2.0]])


def test_the_build_command_builds_now_or_says_why_not(tmp_path):
    """``python -m detsum.kernels.native`` (the README's way to build before the first
    ``detsum.enable``): where the kernels build, it prints the library's path and exits 0;
    where they cannot (here: ``CXX`` naming no compiler, an empty cache folder), it prints why
    and exits 1."""
    from detsum.kernels import native

    command = [sys.executable, "-m", "detsum.kernels.native"]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    reason = native.build()  # the same cache folder: the library the command built, if any
    if reason is None:
        assert (done.returncode, done.stdout) == (0, f"built: {native.library_path()}\n")
    else:
        assert (done.returncode, done.stdout) == (1, f"{reason}\n")
    environment = {**os.environ, "CXX": str(tmp_path / "no-compiler"),
                   "DETSUM_CACHE_DIR": str(tmp_path / "cache")}
    refused = subprocess.run(command, capture_output=True, text=True, env=environment)
    assert refused.returncode == 1 and refused.stdout.startswith("no C++ compiler ("), (
        refused.stdout, refused.stderr)


@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_sums_of_zeros_keep_their_sign(mode, dtype):
    """A row of -0.0 with -0.0 terms sums to -0.0 in every mode (the "kahan" rule adds no zero
    compensation, which would make it +0.0); with a +0.0 among them, to +0.0; the C++ kernels
    take these and give the Python kernels' bits."""
    target = torch.tensor([[-0.0, -0.0], [-0.0, 0.0]], dtype=dtype)
    source = torch.tensor([[-0.0, -0.0], [-0.0, 0.0], [-0.0, -0.0]], dtype=dtype)
    index = torch.tensor([0, 1, 0])
    result, taken, expected = both_ways(mode, lambda: target.clone().index_add_(0, index, source))
    assert_same_outcome(result, expected)
    assert taken == {"index_add_": 1}
    assert torch.signbit(result).tolist() == [[True, True], [True, False]]
