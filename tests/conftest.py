"""Shared lists and helpers: every test file draws its dtypes, modes and comparisons from here."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys
import warnings
import zlib

import hypothesis
import pytest
import torch

# Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors. The choice is
# read when triton is first imported, which detsum does lazily (on the first Triton launch), so
# setting it here, before any test runs, is early enough.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch's CPU exp, on several threads, can go wrong on its first call in a process: on a 2-core
# Xeon (torch 2.13.0+cpu, MKL 2024.2), after a matrix product and a scatter_reduce_, the first
# exp over 220k elements came out up to 1772 ulps off on the calling thread's half, and every
# later call was right. A test that runs GATConv twice then saw two results. One exp or log call
# before anything else stopped it in every process tried (docs/enable.md, "Not covered yet").
torch.exp(torch.zeros(1 << 18))

import detsum
import detsum.kernels
from detsum import _segments, switch
from detsum.kernels import native as native_kernels
# Re-exported for the tests: torch's CPU fp32/fp64 index_put_ uses atomics from 32768 elements
# with more than one thread; deterministic algorithms make it the serial sum the contract names.
from detsum.measure import torch_deterministic  # noqa: F401

#: The switch's C++ kernels, built before any test runs (seconds, once per machine and
#: torch), so that whether a switched call takes them never depends on when a build thread
#: finishes: None, or why they could not be built (tests/test_switch_native.py then fails).
NATIVE_BUILD_ERROR = None if not switch.NATIVE else native_kernels.build()

#: The benchmarks' folder: its scripts are modules, not a package (``bench_module``).
BENCHES = pathlib.Path(__file__).resolve().parent.parent / "benches"


def bench_module(name: str):
    """The module ``benches/<name>.py``, imported as ``name`` (as its scripts import each
    other), without leaving ``benches`` on ``sys.path``."""
    sys.path.insert(0, str(BENCHES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHES))


DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MODES = detsum.MODES
#: Every (mode, reduction) that scatter_reduce computes: "exact" has no product.
MODE_REDUCTIONS = [(m, r) for m in MODES for r in ("sum", "mean", "prod", "amax", "amin")
                   if (m, r) != ("exact", "prod")]
HAS_CUDA = torch.cuda.is_available()

#: Examples per differential test (``DETSUM_DIFFERENTIAL``): "ci" a fixed (derandomized) draw,
#: "nightly" a fresh draw of many more, for a long run.
DIFFERENTIAL_PROFILES = {"ci": 30, "nightly": 1500}


def differential_settings(profile: str, *, ci_examples: int | None = None
                          ) -> hypothesis.settings:
    """Hypothesis's settings for the differential tests in ``profile`` ("ci" or "nightly");
    ``ci_examples`` replaces the "ci" draw's size for a test whose examples cost more or less."""
    if profile not in DIFFERENTIAL_PROFILES:
        raise ValueError(f"DETSUM_DIFFERENTIAL={profile!r}; "
                         f"expected one of {sorted(DIFFERENTIAL_PROFILES)}")
    examples = DIFFERENTIAL_PROFILES[profile]
    if profile == "ci" and ci_examples is not None:
        examples = ci_examples
    return hypothesis.settings(
        max_examples=examples, deadline=None, derandomize=profile == "ci", database=None,
        suppress_health_check=[hypothesis.HealthCheck.too_slow,
                               hypothesis.HealthCheck.data_too_large])


#: Whether the triton backend runs CPU tensors: only in Triton's interpreter, which is on where
#: there is no GPU. On a GPU machine it is off (the kernels run on the GPU) and the tests marked
#: ``interpreter`` skip: they run the triton backend on CPU tensors as a stand-in for a GPU's
#: path, and their cuda-marked twins, tests/test_triton.py and tests/test_exact_triton.py run
#: the kernels themselves there.
TRITON_RUNS_CPU_TENSORS = os.environ.get("TRITON_INTERPRET") == "1"
if TRITON_RUNS_CPU_TENSORS:
    # The interpreter patches triton.language once per launch, not at every helper's call
    # (the same values, in half the time of a kernel with helpers in its loops).
    import interpreter_patching
    interpreter_patching.install()
#: The triton backend as a parameter of a test that gives it CPU tensors.
TRITON_ON_CPU = pytest.param("triton", marks=pytest.mark.interpreter, id="triton")


def backend_device(backend: str) -> str:
    """Where a test that runs on every backend puts ``backend``'s tensors: the triton backend's
    on the GPU where there is one (else the CPU, in Triton's interpreter), the others' on the
    CPU."""
    return "cuda" if backend == "triton" and HAS_CUDA else "cpu"


N = None  # placeholder for the indexed / segmented / scattered dim in a layout's shape

# Row layouts of index_add and segment_sum: (shape with N at dim, dim). "slice size" is the
# number of elements after dim: the quantity that picks torch's (and detsum's) kernel regime.
LAYOUTS = [
    pytest.param((N,), 0, id="N-dim0"),  # 1-D: slice size 1, no outer dim
    pytest.param((N, 1), 0, id="Nx1-dim0"),  # slice size 1 (CUDA stride-1 regime), 2-D
    pytest.param((N, 8), 0, id="Nx8-dim0"),  # slice size 8 <= 32 (CUDA small-stride regime)
    pytest.param((N, 40), 0, id="Nx40-dim0"),  # slice size 40 > 32 (per-row kernel regime)
    pytest.param((5, N), 1, id="5xN-dim1"),  # last dim of 2-D: slice size 1, 5 outer rows
    pytest.param((3, N, 11), -2, id="3xNx11-dim-2"),  # middle dim, negative: outer 3, slice 11
    pytest.param((3, 4, N), -1, id="3x4xN-dim-1"),  # last dim, negative: slice 1, outer 12
]


@pytest.fixture(autouse=True)
def poison_outputs():
    """NaN-fill every kernel output before it is written: an unwritten element fails equality."""
    _segments.POISON_OUTPUTS = True
    yield
    _segments.POISON_OUTPUTS = False


@pytest.fixture
def python_kernels():
    """The switch's Python kernels alone during the test, its C++ kernels removed: for tests
    that watch the Python kernels' steps (which the C++ kernels skip, with the same bits)."""
    was = switch.NATIVE
    switch._use_native(False)
    yield
    switch._use_native(was)


@pytest.fixture(params=["torch's keys", "narrowed keys"])
def sort_width(request, monkeypatch):
    """Each sort of an index by segment (``kernels.sort_by_segment``) of the keys as they are,
    as torch sorts them, and of keys narrowed to the segments' range (clamped, int16 or
    int32), which a GPU sorts above ``NARROW_SORT_ABOVE`` keys: here at any size, so that the
    tests' small indices take that path too."""
    if request.param == "narrowed keys":
        monkeypatch.setattr(detsum.kernels, "NARROW_SORT_ABOVE", 0)
    return request.param


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_interpreter = pytest.mark.skip(
        reason="runs the triton backend on CPU tensors: needs Triton's interpreter, which is "
               "off on a GPU machine (the CUDA tests run the kernels there)")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if item.get_closest_marker("interpreter") and not TRITON_RUNS_CPU_TENSORS:
            item.add_marker(skip_interpreter)
    # Tests marked ``last`` after the others, each group in its own order (a stable sort).
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


def record_answers(monkeypatch, owner, name: str) -> list:
    """What each later call of ``owner.name`` returns, in turn (the function itself still
    runs and answers its caller)."""
    answers, original = [], getattr(owner, name)

    def answering(*args):
        answers.append(original(*args))
        return answers[-1]

    monkeypatch.setattr(owner, name, answering)
    return answers


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit equality, except that NaNs compare by position (torch paths differ in NaN payloads)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), "NaN positions differ"
    a = actual.masked_fill(nan_a, 0)
    e = expected.masked_fill(nan_e, 0)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a_bits, e_bits = a.contiguous().view(bits), e.contiguous().view(bits)
    if not torch.equal(a_bits, e_bits):
        differ = (a_bits != e_bits).nonzero()
        first = tuple(differ[0].tolist())
        raise AssertionError(
            f"{differ.shape[0]} of {a.numel()} elements differ; first at {first}: "
            f"{a[first].item()!r} vs {e[first].item()!r}")


def make_data(shape, dtype, *, seed=0, spread=False):
    """Random data; ``spread`` draws magnitudes over many binades with both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if spread:
        max_exp = {torch.float16: 6, torch.bfloat16: 30, torch.float32: 30, torch.float64: 60}[dtype]
        x = x * torch.exp2(torch.randint(-max_exp, max_exp + 1, shape, generator=g).double())
    return x.to(dtype)


def terms_with_specials(rows: int, numel: int, acc: torch.dtype, seed: int) -> torch.Tensor:
    """``[rows, numel]`` terms of an exact state (``acc`` fp32 or fp64) over the whole exponent
    range, both signs, with zeros of both signs, subnormals, the largest values, infinities and
    NaNs sprinkled in: every counter is nonzero somewhere."""
    terms = make_data((rows, numel), acc, seed=seed, spread=True)
    g = torch.Generator().manual_seed(seed + 1)
    tiny = torch.finfo(acc).smallest_normal
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), tiny / 4,
                             -tiny / 8, torch.finfo(acc).max, -torch.finfo(acc).max], dtype=acc)
    picks = torch.rand((rows, numel), generator=g) < 0.05
    terms[picks] = specials[torch.randint(0, len(specials), (int(picks.sum()),), generator=g)]
    return terms


def midpoint_means(dtype: torch.dtype, *, count: int = 40, seed: int = 13
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index, src ``[rows * 4, 1]``, expected means ``[rows, 1]``) of segments of four terms
    ``lo, lo, 2 hi, c`` (``lo < hi`` neighbours of ``dtype``, ``m`` their midpoint): means
    ``m + c / 4``, a tie of the dtype for ``c = 0`` and just off one for small ``c`` of either
    sign, down to a unit of the sum's last fp64 bit; expected by fractions, rounded once."""
    from fractions import Fraction

    from detsum import reference

    g = torch.Generator().manual_seed(seed)
    p = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}[dtype]
    rows = []
    for _ in range(count):
        lo = Fraction(2**(p - 1) + int(torch.randint(0, 2**(p - 1) - 1, (1,), generator=g)),
                      2**(p - 1))  # in [1, 2), p significant bits
        hi = lo + Fraction(1, 2**(p - 1))
        for exponent in (None, p + 2, p + 20, 50):
            for sign in (1, -1):
                c = Fraction(0) if exponent is None else sign * Fraction(1, 2**exponent)
                as_dtype = torch.tensor(float(c), dtype=torch.float64).to(dtype).double()
                if Fraction(as_dtype.item()) == c:  # c is a value of the dtype
                    rows.append([lo, lo, 2 * hi, c])
    index = torch.arange(len(rows)).repeat_interleave(4)
    src = torch.tensor([float(t) for terms in rows for t in terms],
                       dtype=torch.float64).to(dtype).unsqueeze(1)
    assert torch.equal(src.double().view(-1),
                       torch.tensor([float(t) for terms in rows for t in terms]))
    expected = torch.stack([reference.round_exact(sum(terms, Fraction(0)) / 4, dtype)
                            for terms in rows]).view(-1, 1)
    return index, src, expected


def pair_quotient_cases(count: int = 4000, seed: int = 5):
    """(hi, lo, n, exact sum) cases for an exact fp64 pair's quotient by n: at, beside and
    between the midpoints of fp64 quotients (and q itself, and its neighbours), nudged by far
    less than an ulp, for divisors up to 2**52 - 1, pairs as TwoSum leaves them or not
    normalised (hi off by a few of its ulps), either sign."""
    import math
    import random
    from fractions import Fraction

    rng = random.Random(seed)
    for _ in range(count):
        exponent = rng.choice([0, 1, -1, 7, -300, 300, 900, -900])
        q = math.ldexp(rng.choice([2**52, rng.randint(2**52, 2**53 - 1)]), exponent - 52)
        n = rng.choice([1, 2, 3, 5, 7, 10, 1000, 2**20 + 1, 2**40 + 7, 2**52 - 1])
        up = Fraction(math.ulp(q))
        down = up / 2 if math.frexp(q)[0] == 0.5 else up
        where = rng.choice([up / 2, -down / 2, 0, up / 4, -down / 4, 3 * up / 4, up, -down])
        nudge = rng.choice([0, 1, -1]) * Fraction(q) / 2**rng.randint(60, 200)
        total = (Fraction(q) + where + nudge) * n * rng.choice([1, -1])
        if abs(total) > 2**1022:
            continue
        hi = float(total)
        lo = float(total - Fraction(hi))
        if rng.random() < 0.3:  # not normalised: hi off by a few of its ulps
            hi += rng.choice([1, -2, 5]) * math.ulp(hi)
            lo = float(total - Fraction(hi))
        if Fraction(hi) + Fraction(lo) != total:
            continue
        yield hi, lo, n, total


def fp64_midpoint_means(scale: float, sizes=(2, 3, 4, 7, 8, 100, 1001)
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index, src ``[rows, 2]``, expected means ``[segments, 2]``) of fp64 means of n terms
    (n in ``sizes``) of one binade times ``scale`` (the fast path certifies them): half of them q and half
    q's upper neighbour, a tie at the midpoint; one term moved by an ulp, a mean an ulp over
    n beside it; q at a power of two, where its neighbours' gaps differ. A second column is
    inf in every other segment, whose tiles then fail the whole-tile certificate (the
    first column certified column by column)."""
    import math
    import random
    from fractions import Fraction

    rng = random.Random(9)
    rows = []
    for n in sizes:
        for _ in range(6):
            q = math.ldexp(rng.choice([2**52, 2**53 - 1, rng.randint(2**52, 2**53 - 2)]),
                           -52) * scale
            above = math.nextafter(q, math.inf)
            below = math.nextafter(q, -math.inf)
            for moved in (None, above, below, math.nextafter(above, math.inf)):
                for sign in (1.0, -1.0):
                    terms = [q] * (n // 2) + [above] * (n - n // 2)
                    if moved is not None:
                        terms[0] = moved
                    rows.append([sign * t for t in terms])
    index = torch.cat([torch.full((len(terms),), i) for i, terms in enumerate(rows)])
    means = [float(sum(map(Fraction, terms)) / len(terms)) for terms in rows]
    spoilt = [[math.inf] + terms[1:] if i % 2 == 0 else terms for i, terms in enumerate(rows)]
    src = torch.tensor([[t, u] for terms, other in zip(rows, spoilt)
                        for t, u in zip(terms, other)], dtype=torch.float64)
    expected = torch.tensor([[m, math.inf if i % 2 == 0 else m] for i, m in enumerate(means)],
                            dtype=torch.float64)
    return index, src, expected


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def with_rows(template, rows: int, *, zero_columns: bool = False) -> tuple[int, ...]:
    """``template`` with ``rows`` at the N dim; with ``zero_columns`` the last other dim is 0,
    so every row is empty."""
    shape = [rows if s is None else s for s in template]
    if zero_columns:
        last_other = max(d for d, s in enumerate(template) if s is not None)
        shape[last_other] = 0
    return tuple(shape)


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """Same values as ``t`` (not contiguous when it has >1 element): dims stored in reverse order,
    every other element of a NaN-filled buffer in every dim, so a kernel that ignores strides
    reads NaN."""
    rev = list(range(t.dim()))[::-1]
    stored = t.permute(rev)
    fill = float("nan") if t.is_floating_point() else -1
    buf = torch.full([2 * s for s in stored.shape], fill, dtype=t.dtype)
    view = buf[(slice(None, None, 2),) * t.dim()]
    view.copy_(stored)
    return view.permute(rev)


def case_params(layouts, cases):
    """Every (layout, case) pair as a pytest.param, but "zero_columns" only where a layout has
    another dim to empty."""
    for layout in layouts:
        for case in cases:
            if case == "zero_columns" and len(layout.values[0]) == 1:
                continue  # a 1-D tensor has no other dim to empty
            yield pytest.param(*layout.values, case, id=f"{layout.id}-{case}")


def run_docs_example(name: str):
    """Import ``docs/<name>.py`` (a worked example shipped with the docs) and return its
    ``main()``'s result; what it prints goes to the test's captured stdout."""
    path = pathlib.Path(__file__).parents[1] / "docs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main()


# ---- host reads ---------------------------------------------------------------------------------

_OWN_CODE = (str(pathlib.Path(detsum.__file__).parent),
             str(pathlib.Path(detsum.kernels.__file__).parent))
_TENSOR_READS = ("tolist", "item", "numpy", "cpu", "nonzero", "__bool__", "__int__",
                 "__index__", "__float__")
_FUNCTION_READS = ("unique", "nonzero", "bincount")

#: The operators through which torch's own C++ reads a CPU tensor's values into the host, where
#: no Python method above sees it: indexing by a boolean mask (and ``torch.where`` of a
#: condition alone) counts its True values by ``nonzero``; ``item``, ``int()`` and the like,
#: called inside an operator (``repeat_interleave`` without ``output_size``, say), end in
#: ``_local_scalar_dense``.
_DISPATCHER_READS = ("nonzero", "_local_scalar_dense")
#: The asserts whose CPU kernel reads its flag (``_local_scalar_dense``), where a GPU's asserts
#: on the device: not a read.
_DEVICE_ASSERTS = ("_assert_async", "_assert_async.msg")
_TORCH_CODE = str(pathlib.Path(torch.__file__).parent)


def _first_caller_outside_torch() -> str:
    """The file of the innermost Python frame, above this function's caller, that is not
    torch's own: the code whose operation reached the operator."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_CODE):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


@contextlib.contextmanager
def _operator_reads(on_read):
    """``on_read(name, filename)`` at each call of ``_DISPATCHER_READS`` on CPU tensors from
    detsum's own code, but inside ``_DEVICE_ASSERTS``: a kernel of ours in front of torch's,
    at the CPU key, for the duration. Not a ``TorchFunctionMode`` nor a dispatch mode
    (detsum takes another path under either: ``_dispatch.direct_call_ok``), nor a
    ``__getitem__`` set on ``torch.Tensor`` (a Python ``__getitem__`` fills the class's
    sequence slot for good, and a 0-d tensor then passes for a sequence)."""
    library = torch.library.Library("aten", "IMPL")
    asserting = []  # inside a device assert's CPU kernel: its read is the GPU's assert

    def watched(name, original):
        def kernel(keyset, *args, **kwargs):
            caller = _first_caller_outside_torch()
            if caller.startswith(_OWN_CODE) and not asserting:
                on_read(name, caller)
            return original.call_boxed(keyset, *args, **kwargs)
        return kernel

    def an_assert(original):
        def kernel(keyset, *args, **kwargs):
            asserting.append(True)
            try:
                return original.call_boxed(keyset, *args, **kwargs)
            finally:
                asserting.pop()
        return kernel

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "overriding a kernel": the point
            for names, wrap in ((_DISPATCHER_READS, watched),
                                (_DEVICE_ASSERTS, lambda name, original: an_assert(original))):
                for name in names:
                    original = torch.library.get_kernel(f"aten::{name}", "CPU")
                    library.impl(name, wrap(name, original), "CPU", with_keyset=True)
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def host_reads(on_read):
    """Calls ``on_read(name, filename)`` at every read of a tensor's values into Python from
    detsum's own code (detsum/ and its kernels/), before the read: the Python ways of reading
    values are replaced for the duration, and the operators through which torch's C++ reads
    them are watched (``_operator_reads``). On a GPU each of them is a synchronisation."""
    def guarded(name, original):
        def read(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(_OWN_CODE):
                on_read(name, caller)
            return original(*args, **kwargs)
        return read

    saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in _TENSOR_READS]
    saved += [(torch, name, getattr(torch, name)) for name in _FUNCTION_READS]
    try:
        for owner, name, original in saved:
            setattr(owner, name, guarded(name, original))
        with _operator_reads(on_read):
            yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        if "torch._dynamo" in sys.modules:
            # Dynamo looks up torch's functions by object in a table it fills on first use:
            # filled while they were replaced, it would no longer know torch.bincount itself.
            torch._dynamo.trace_rules.clear_lru_cache()


def detsum_threads(count: int):
    """detsum's CPU kernels on at most ``count`` threads (Numba's setting; they take up to
    torch's count), torch's own operations on its threads as before: a test that compares
    thread counts compares detsum's, never torch's BLAS, whose bits follow its thread count
    on some CPUs. Torch needs ``count`` threads for the kernels to get them."""
    import numba
    from detsum.kernels.numba.common import threads

    if torch.get_num_threads() < count:
        pytest.skip(f"torch runs on {torch.get_num_threads()} thread(s); the test needs {count}")
    return threads(min(count, numba.config.NUMBA_NUM_THREADS))
