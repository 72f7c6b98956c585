"""What the Numba kernels share: conversions to the acc type, Neumaier's step and the KAHAN
rule's final step, a prefetch hint, the naming of a kernel per data format, flat NumPy views of
tensors, and the threads of a launch (how many, how the work splits over them, and the
settings put back afterwards).

Kernels inline the ``@njit`` helpers here, so Numba's on-disk cache of a kernel does not see a
change to them (it checks only the timestamp of the kernel's own file): after editing this
file, delete ``kernels/numba/__pycache__`` to drop stale kernels.
"""

import contextlib

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import forked, njit, parallel_njit

# Columns per work item. Chunking columns changes nothing in any element's order; it bounds
# the scratch rows (kept in L1) and gives every thread items when there are few output rows.
_CHUNK = 1024
_MIN_CHUNK = 64
# Prefetch: the first _PF_LINES cache lines (enough to start the hardware prefetcher on the
# rest) of the term row about _PF_AHEAD bytes of rows ahead of the one being combined, i.e.
# 3 rows of 1024 fp32 or 6 of 1024 bf16 (at most _PF_MAX_DIST rows). Chosen by timing the
# benchmark shape; they only affect speed.
_PF_LINES = 8
_PF_AHEAD = 12288
_PF_MAX_DIST = 64


@intrinsic
def fused_multiply_add(typingctx, a, b, c):
    """``a * b + c`` rounded once (LLVM's ``fma``: the hardware's instruction, or a correctly
    rounded software one): for error-free products (``a * b - RN(a * b)`` exactly), never in
    a sum's own arithmetic."""
    if not all(t == types.float64 for t in (a, b, c)):
        return None
    sig = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        double = ir.DoubleType()
        fnty = ir.FunctionType(double, [double, double, double])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.fma.f64")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def _prefetch(typingctx, arr, i):
    """Hint the cache to fetch the line holding arr[i] (1-D array); never changes a result."""
    if not isinstance(arr, types.Array) or arr.ndim != 1 or not isinstance(i, types.Integer):
        return None
    sig = types.void(arr, i)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [idx], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # (address, read, keep in all cache levels, data cache)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _f32(x):
    return np.float32(x)


@njit(inline="always")
def _f64(x):
    return np.float64(x)


@njit(cache=True, inline="always")
def neumaier(s, c, t):
    """Neumaier's step: ``s + t`` and the compensation ``c`` plus that addition's exact error
    (the contract's KAHAN rule; every kernel that sums under it takes this one)."""
    u = s + t
    # Both sides are computed and one selected: the column loop stays branch-free.
    d = (s - u) + t if abs(s) >= abs(t) else (t - u) + s
    return u, c + d


@njit(cache=True, inline="always")
def kahan_result(s, c):
    """The KAHAN rule's final step: ``s + c``, or ``s`` when ``s`` is not finite or ``c == 0``
    (every kernel that finishes a sum under it takes this one).

    A non-finite ``s`` is the answer as it is: its ``c`` is then NaN (inf - inf), which would
    turn an inf sum into NaN, as a plain sum never does. A zero ``c`` is not added either:
    ``-0.0 + (+0.0)`` would turn a sum of -0.0 terms into +0.0, unlike a plain sum."""
    return s + c if np.isfinite(s) and c != 0 else s


def _njit_named_for(fmt):
    """``njit`` for the closures of a kernel factory (``segment._make_rows`` and the like),
    under a qualname that names ``fmt``.

    Why: Numba names a compiled function by its module, qualname and argument types plus a
    counter that is per process. The bf16 and fp16 closures have the same argument types
    (uint16 bit patterns), so under one qualname they differ only by that counter, and a kernel
    loaded from an on-disk cache written by another process can be linked to the other
    format's code. Seen: every bf16 sum wrong after a process compiled fp16 first and loaded
    bf16 from the cache (tests/test_kernels_numba.py::test_cached_kernels_keep_their_format).
    ``parallel=True`` gives a :func:`parallel_njit` kernel.
    """

    def options(parallel=False, **njit_options):
        def decorate(fn):
            fn.__qualname__ = f"{fn.__qualname__}_{fmt}"
            return (parallel_njit if parallel else njit)(**njit_options)(fn)

        return decorate

    return options


def _flat(t):
    """(1-D NumPy view from t's first element over all of t, t's strides): no copy.

    torch strides are never negative, so the first element has the lowest address and the
    view spans 1 + sum((size - 1) * stride) elements. 16-bit floats come as uint16 bits.
    """
    t = t.detach()
    if t.is_contiguous():
        # The common case, without the span's arithmetic (a small call's cost is in such steps).
        flat = t.view(-1)
    else:
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        flat = torch.as_strided(t, (span,), (1,), t.storage_offset())
    if t.dtype in (torch.bfloat16, torch.float16):
        return flat.view(torch.int16).numpy().view(np.uint16), t.stride()
    return flat.numpy(), t.stride()


def launch_threads():
    """No more threads than torch is set to use (torch.set_num_threads(1) means one), nor than
    Numba is set to use; one in a forked process, whose launches run serially (see
    ``detsum.kernels.numba``)."""
    if forked():
        return 1
    return max(1, min(torch.get_num_threads(), numba.get_num_threads()))


#: Fewest term elements per thread block. Waking a second thread costs about 30 us on the
#: project's VM, the time to combine some 100k elements: a smaller launch runs as one block on
#: the calling thread. (Only the schedule changes, never a result.)
_MIN_BLOCK_ELEMENTS = 65536


def work_split(rows, inner, nthreads, terms):
    """(column chunk, thread blocks) for ``rows`` output rows of ``inner`` columns reducing
    ``terms`` term rows in all: equal column chunks of at most _CHUNK, in
    whole 64-byte lines where possible; with few output rows, narrower ones (down to
    _MIN_CHUNK), so that every thread gets items; one block for a small launch."""
    target = _CHUNK
    while target > _MIN_CHUNK and rows * -(-inner // target) < 4 * nthreads:
        target //= 2
    pieces = -(-inner // target)
    chunk = min(inner, (-(-inner // pieces) + 15) // 16 * 16)
    n_items = rows * -(-inner // chunk)
    n_blocks = min(n_items, 64 * nthreads, max(1, (terms + rows) * inner // _MIN_BLOCK_ELEMENTS))
    return chunk, n_blocks


def block_threads(n_blocks, nthreads):
    """The context a launch of ``n_blocks`` :class:`~.instances.Blocks` runs in: ``threads``
    for several blocks; for one, which ``Blocks`` runs on the calling thread outside any
    parallel region, none (setting and restoring the counts would cost a small call 4 us)."""
    return threads(nthreads) if n_blocks > 1 else contextlib.nullcontext()


@contextlib.contextmanager
def threads(nthreads):
    """Run the block's launch on ``nthreads`` Numba threads, then put Numba's and torch's
    settings back (Numba's OpenMP layer sets the count of the runtime it shares with torch)."""
    torch_threads = torch.get_num_threads()
    numba_threads = numba.get_num_threads()
    numba.set_num_threads(nthreads)
    try:
        yield
    finally:
        numba.set_num_threads(numba_threads)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
