"""The Numba CPU kernels.

Threading: the kernels run on Numba's OpenMP layer where it is available (unless the user
chose a layer with ``NUMBA_THREADING_LAYER`` or ``NUMBA_THREADING_LAYER_PRIORITY``). On Linux,
torch's wheels load ``libgomp.so.1`` first, and Numba's OpenMP layer then uses that same
runtime: one pool of threads for torch and the kernels, instead of two pools spinning against
each other on a loaded machine (Numba's default prefers TBB when it is installed). Each launch
runs on no more threads than torch is set to use, and leaves torch's setting as it found it
(``segment.segment_reduce``); so does starting the layer, below.

Forked children: GNU OpenMP's pool does not survive ``fork``. Numba's OpenMP layer kills a
child of the process that started it as soon as the child enters a parallel region ("fork()
called from a process already using GNU OpenMP, this is unsafe"), and a grandchild would wait
forever for the pool's threads, which ``fork`` did not copy. So in a process forked from one
that had loaded these kernels (a ``torch.utils.data.DataLoader`` worker, a
``multiprocessing`` pool on Linux), every launch runs on the calling thread, through a serial
twin of its kernel (see :func:`parallel_njit`): the same code compiled without
``parallel=True``. Results never depend on the thread count, so the child computes the
parent's bits.
"""

import contextlib
import os
import types

import numba
import torch
from numba.core.caching import FunctionCache
from numba.core.runtime import rtsys

try:
    import fcntl
except ImportError:  # not POSIX: saves as Numba's own (see _KernelCache)
    fcntl = None

if not {"NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"} & os.environ.keys():
    # Read by Numba when its threading layer starts, just below.
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]

# Starting Numba's threading layer (its first parallel launch, or any numba.get_num_threads())
# sets the OpenMP runtime's thread count to Numba's pool size, and torch reads that count as
# its own: start it here, once, and put torch's setting back. (Numba code the user ran before
# importing detsum has started the layer already; that is outside detsum's reach.)
_torch_threads = torch.get_num_threads()
numba.get_num_threads()
if torch.get_num_threads() != _torch_threads:
    torch.set_num_threads(_torch_threads)


class _KernelCache(FunctionCache):
    """The on-disk cache of a detsum kernel, which loads compiled code without refreshing
    Numba's typing and lowering registries first, and saves it under a lock.

    Numba's ``load_overload`` refreshes them before every load: the first time, that imports
    the implementations of every NumPy and Python feature it compiles (typed lists and dicts,
    linear algebra, random generators ...), about 0.2 s of a first call's 0.45 s on the
    project's 2-core VM. Loaded machine code needs none of them: only the runtime (NRT) that
    compiled code allocates through, set up here as the refresh would. A compilation refreshes
    them itself (``numba.core.compiler.CompilerBase``), so a cache miss compiles as before.
    ``tests/test_kernels_numba.py`` holds both: a later process's calls load every kind of
    kernel without the refresh and compute the compiled kernels' bits, and a compilation
    afterwards works.

    Numba's save reads the kernel's index, picks the first data file number the index does not
    name, and writes both, with no lock: two processes saving different signatures of one
    kernel at once (the ranks of a job on its first run, test workers) can pick the same
    number, and the index then names one's machine code for the other's signature. Here a
    save holds an exclusive lock on a file in the cache's folder (``_SAVE_LOCK``), so that it
    reads the index the last save wrote. A load needs no lock: a data file only ever holds
    the code of the signature its index entry names. (``tests/test_kernels_numba.py`` makes
    two processes save at once.)
    """

    def load_overload(self, sig, target_context):
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)

    def save_overload(self, sig, data):
        with self._guard_against_spurious_io_errors(), self._saving():
            self._save_overload(sig, data)

    @contextlib.contextmanager
    def _saving(self):
        if fcntl is None:
            yield
            return
        self._impl.locator.ensure_cache_path()
        with open(os.path.join(self._cache_path, _SAVE_LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


#: The file in a cache folder whose lock a save holds (one for all the folder's kernels:
#: saves are rare and short).
_SAVE_LOCK = "detsum-save.lock"


#: Whether this Numba's cache has the parts ``_KernelCache`` overrides; otherwise each kernel
#: keeps Numba's own (its loads then refresh the registries, and its saves take no lock).
_LEAN_LOADS = all(hasattr(FunctionCache, name) for name in
                  ("load_overload", "_load_overload", "save_overload", "_save_overload",
                   "_guard_against_spurious_io_errors"))


def lean_loads(dispatcher):
    """``dispatcher``, a ``cache=True`` kernel, with loads that skip the registry refresh and
    saves under a lock (:class:`_KernelCache`); any other dispatcher as it is."""
    cache = getattr(dispatcher, "_cache", None)
    if _LEAN_LOADS and type(cache) is FunctionCache:
        cache.__class__ = _KernelCache
    return dispatcher


def njit(*args, **options):
    """``numba.njit`` for detsum's kernels: the same compiled function, whose on-disk cache
    loads without the registry refresh (:func:`lean_loads`). ``@njit`` or ``@njit(...)``."""
    if args and callable(args[0]):
        return lean_loads(numba.njit(*args, **options))
    return lambda py_func: lean_loads(numba.njit(*args, **options)(py_func))


_forked = False


def _after_fork_in_child():
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):  # POSIX only; the child's own children inherit it
    os.register_at_fork(after_in_child=_after_fork_in_child)


def forked() -> bool:
    """Whether this process was forked (at any depth) from one that had loaded the kernels:
    then no launch may enter the threading layer's pool."""
    return _forked


class _ParallelKernel:
    """A ``parallel=True`` kernel that, in a forked process (:func:`forked`), runs its serial
    twin instead, compiled on first use there (and cached on disk like the kernel itself)."""

    def __init__(self, py_func, options):
        self.py_func = py_func
        self._options = options
        self._parallel = njit(parallel=True, **options)(py_func)
        self._serial = None

    def __call__(self, *args):
        if _forked:
            return self.serial()(*args)
        return self._parallel(*args)

    def serial(self):
        """The same function compiled without ``parallel=True`` (``prange`` is then ``range``):
        each item's arithmetic is the kernel's, only the schedule differs."""
        if self._serial is None:
            f = self.py_func
            twin = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__,
                                      f.__closure__)
            # Numba's on-disk cache files a kernel under its module and qualname and keys it by
            # argument types, not by the parallel option: under the kernel's own qualname the
            # twin would load the parallel code, or overwrite it.
            twin.__qualname__ = f"{f.__qualname__}_serial"
            twin.__module__ = f.__module__
            self._serial = njit(**self._options)(twin)
        return self._serial


def parallel_njit(**options):
    """``numba.njit(parallel=True, **options)`` for a kernel launched from Python, made safe in
    forked processes (:class:`_ParallelKernel`). A kernel called from other compiled code
    would enter the pool there: only launchers call these."""
    def decorate(py_func):
        return _ParallelKernel(py_func, options)

    return decorate
