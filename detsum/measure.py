"""What the report, the figures, the benchmarks and the tests measure with.

- The device: ``default_device``, ``sync`` (wait for queued kernels before reading a clock),
  ``torch_deterministic`` (torch's deterministic algorithms for a block), ``same_bits`` and
  ``numba_threads`` (the CPU kernels on a given number of threads).
- Time: ``interleaved_runs`` (calls timed in turns), their medians, and ``spread`` (how much
  the runs varied).
- Data: ``skewed_index`` (uneven segments), ``make_source`` for each of ``DATASETS``
  (``well``: nothing cancels; ``cancel``: cancellation-heavy), ``make_init``, and
  ``sample_rows`` to check.
- The yardstick: ``exact_rows`` (the exact sum, or mean, rounded once) and ``max_ulps`` against it.

Importing detsum does not import this module; it imports detsum's primitives, and loads the CPU
kernels only when ``numba_threads`` is used.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch

from detsum import _kernel_ops, reference

DATASETS: tuple[str, ...] = ("well", "cancel")


# Significand bits (with the implicit one) per dtype: how far a cancelling pair may be from
# exact negation and still leave a difference that the dtype holds exactly.
_PRECISION = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


# ---- device helpers -----------------------------------------------------------------------------

def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: torch.device | str) -> None:
    """Wait for queued device work; device kernels run asynchronously."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def torch_deterministic():
    """torch with ``use_deterministic_algorithms(True)``: the arithmetic "autograd" mode copies."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality; NaNs compare by position (torch paths differ in NaN payloads)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a = a.masked_fill(nan_a, 0).contiguous().view(bits)
    b = b.masked_fill(nan_b, 0).contiguous().view(bits)
    return torch.equal(a, b)


@contextlib.contextmanager
def numba_threads(n: int | None):
    """Run the block's CPU kernels on ``n`` Numba threads (None: leave the count as it is),
    then put Numba's and torch's thread counts back: Numba's OpenMP layer shares its runtime
    with torch, so setting one can move the other."""
    if n is None:
        yield
        return
    with _kernel_ops.cpu_threads(n):
        yield


# ---- timing -------------------------------------------------------------------------------------

def median_seconds(fn: Callable[[], object], device: torch.device | str, *, reps: int,
                   warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones."""
    return interleaved_medians([fn], device, reps=reps, warmup=warmup)[0]


def interleaved_medians(fns: Sequence[Callable[[], object]], device: torch.device | str, *,
                        reps: int, warmup: int = 1) -> list[float]:
    """Median wall time of each function, timed in turns (see ``interleaved_runs``)."""
    return [statistics.median(ts) for ts in interleaved_runs(fns, device, reps=reps,
                                                              warmup=warmup)]


def interleaved_runs(fns: Sequence[Callable[[], object]], device: torch.device | str, *,
                     reps: int, warmup: int = 1) -> list[list[float]]:
    """Wall times of ``reps`` runs of each function, timed in turns (f0, f1, f0, f1, ...).

    Taking turns exposes every function to the same drift in machine load, so their ratio
    holds up better than that of two medians taken one after the other.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - start)
    return times


def spread(seconds: Sequence[float]) -> float:
    """How much timed runs vary: their interquartile range over their median.

    The quartiles are interpolated between runs (numpy's default), so three runs give half
    their range. Unlike the range itself, the middle half ignores one stray run that the
    scheduler held up, which the median ignores too.
    """
    if len(seconds) < 2:
        raise ValueError(f"spread: needs at least 2 timed runs to say how they vary, got "
                         f"{len(seconds)}")
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    median = statistics.median(seconds)
    return (q3 - q1) / median if median > 0 else 0.0


# ---- data ---------------------------------------------------------------------------------

def skewed_index(n_src: int, n_out: int, gen: torch.Generator) -> torch.Tensor:
    """Random destination rows with uneven segment lengths: index = floor(n_out u^1.5), so
    low rows get the most terms (row 0 about ``n_src / n_out * n_out^(1/3)``, ~100 in the full
    report, against a mean of ``n_src / n_out``): long segments and short ones mix."""
    u = torch.rand(n_src, generator=gen, dtype=torch.float64)
    return (u.pow(1.5) * n_out).long().clamp_(max=n_out - 1)


def make_source(index: torch.Tensor, n_out: int, h: int, dtype: torch.dtype, dataset: str,
                gen: torch.Generator) -> torch.Tensor:
    """Source rows ``[len(index), h]`` of ``dtype`` (on the CPU) for one of ``DATASETS``.

    ``well``: ``exp(0.5 z)``, z standard normal: positive, so the sum has condition number 1.
    ``cancel``: inside each segment (rows with equal index, in order of appearance), the k-th
    row from the front and the k-th from the back form a pair ``+b, -RN(b (1 - 2^-j))`` with
    ``b = z 2^e``, ``e`` in [-4, 4], ``j`` in [2, min(p - 2, 12)] (p = the dtype's precision):
    each pair sums exactly (Sterbenz) to about ``b 2^-j``, while partial sums in between carry
    the full ``b``'s. A segment's middle row (odd lengths) is small, ``z 2^-6``.
    """
    n_src = index.numel()
    if dataset == "well":
        return torch.exp(0.5 * torch.randn(n_src, h, generator=gen, dtype=torch.float64)).to(dtype)
    if dataset != "cancel":
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {DATASETS}")
    order = torch.sort(index, stable=True).indices
    counts = torch.bincount(index, minlength=n_out)
    starts = torch.cumsum(counts, 0) - counts
    seg = index[order]
    rank = torch.arange(n_src) - starts[seg]  # position inside the segment, canonical order
    length = counts[seg]
    mirror = length - 1 - rank
    first = order[rank < mirror]  # source rows opening a pair
    partner = order[(starts[seg] + mirror)[rank < mirror]]  # the rows closing them
    middle = order[rank == mirror]

    out = torch.empty(n_src, h, dtype=torch.float64)
    b = torch.randn(first.numel(), h, generator=gen, dtype=torch.float64)
    b = (b * torch.exp2(torch.randint(-4, 5, (first.numel(), h), generator=gen).double()))
    b = b.to(dtype).double()
    j_max = min(_PRECISION[dtype] - 2, 12)
    j = torch.randint(2, j_max + 1, (first.numel(), h), generator=gen).double()
    out[first] = b
    out[partner] = -(b * (1 - torch.exp2(-j))).to(dtype).double()
    out[middle] = torch.randn(middle.numel(), h, generator=gen, dtype=torch.float64) / 64
    return out.to(dtype)


def make_init(n_out: int, h: int, dtype: torch.dtype, dataset: str,
              gen: torch.Generator) -> torch.Tensor:
    """The rows accumulated into (``input`` of index_add / scatter_reduce)."""
    z = torch.randn(n_out, h, generator=gen, dtype=torch.float64)
    return (torch.exp(0.5 * z) if dataset == "well" else z / 16).to(dtype)


def sample_rows(index: torch.Tensor, n_out: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` output rows to check: the longest segment first, the rest at random."""
    counts = torch.bincount(index, minlength=n_out)
    longest = int(counts.argmax())
    others = torch.randperm(n_out, generator=gen)
    others = others[others != longest][: max(k - 1, 0)]
    return torch.cat([torch.tensor([longest]), others]).sort().values


def exact_rows(src: torch.Tensor, index: torch.Tensor, rows: torch.Tensor,
               init: torch.Tensor | None = None, *, reduce: str = "sum") -> torch.Tensor:
    """The exact ``sum`` (or ``mean``) of each row in ``rows``, rounded once to src's dtype.

    Row ``r`` reduces ``init[r]`` (when given) and every ``src[k]`` with ``index[k] == r``.
    Everything runs on the CPU in exact rational arithmetic.
    """
    src, index = src.cpu(), index.cpu()
    init = None if init is None else init.cpu()
    dtype = src.dtype
    out = []
    for r in rows.tolist():
        terms = src[index == r]
        if init is not None:
            terms = torch.cat([init[r : r + 1], terms])
        if reduce == "sum":
            out.append(reference.exact_sum_rounded(terms, dtype, dim=0))
        elif reduce == "mean":
            count = terms.shape[0]
            columns = terms.double().t().tolist()
            out.append(torch.stack([
                reference.round_exact(sum(map(Fraction, col), Fraction(0)) / max(count, 1), dtype)
                for col in columns]))
        else:
            raise ValueError(f"exact_rows: reduce={reduce!r}; expected 'sum' or 'mean'")
    return torch.stack(out)


def max_ulps(out: torch.Tensor, rows: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest ulp distance between ``out[rows]`` and the exact rows."""
    got = out.index_select(0, rows.to(out.device)).cpu()
    return float(reference.ulp_distance(got, exact).max()) if got.numel() else 0.0
