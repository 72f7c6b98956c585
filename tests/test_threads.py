"""detsum leaves torch's thread settings as it found them and follows them.

Seen before: the first detsum call after a torch op turned torch.get_num_threads() from 1 into
2 (Numba's OpenMP layer shares torch's OpenMP runtime and set its thread count), and a call
under torch.set_num_threads(1) ran on every core (RunningSum.add of 8192x64: 0.6-1.05 s on a
loaded 2-core machine, against 11-16 ms on one thread).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

import detsum
from conftest import detsum_threads
from detsum.kernels import numba as numba_kernels
from detsum.kernels.numba import segment, small
from detsum.kernels.numba.instances import Blocks
from kernel_instances import every_kernel


@pytest.fixture
def threads_used(monkeypatch):
    """The threads each fp32 kernel launch could run on: Numba's count for a launch of
    several blocks, one for a launch of one block (run on the calling thread, ``Blocks``).
    Small calls too take the segment kernel, not their one serial call (``small``)."""
    monkeypatch.setattr(small, "MAX_ELEMENTS", -1)
    seen = []
    kernel_for = segment.kernel_for

    def recording_kernel_for(dtype, variant):
        kernel = kernel_for(dtype, variant)
        if dtype != torch.float32:
            return kernel

        def recording_kernel(n_blocks, args):
            seen.append(numba.get_num_threads() if n_blocks > 1 else 1)
            return kernel(n_blocks, args)

        return recording_kernel

    monkeypatch.setattr(segment, "kernel_for", recording_kernel_for)
    return seen


@pytest.fixture
def torch_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def test_a_call_under_one_torch_thread_runs_on_one_and_leaves_torch_at_one(threads_used,
                                                                             torch_threads):
    torch.set_num_threads(1)
    running = detsum.RunningSum((64,))
    running.add(torch.randn(600, 64))
    detsum.index_add(torch.zeros(4, 8), 0, torch.tensor([0, 3, 3]), torch.ones(3, 8))
    assert threads_used and set(threads_used) == {1}
    assert torch.get_num_threads() == 1


def test_numba_set_to_fewer_threads_than_torch_is_honoured(threads_used, torch_threads):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two cores")
    torch.set_num_threads(2)
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        detsum.segment_sum(torch.ones(10, 3), torch.tensor([0, 4, 10]))
        assert numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(previous)
    assert threads_used == [1]
    assert torch.get_num_threads() == 2


_FIRST_CALL_AFTER_A_TORCH_OP = """
import torch
torch.set_num_threads(1)
torch.ones(1000, 1000).sum()
import numba, detsum
detsum.RunningSum((64,)).add(torch.randn(600, 64))
print(torch.get_num_threads(), numba.threading_layer())
"""


def test_the_first_call_leaves_torch_threads_and_shares_its_openmp_runtime():
    """In a fresh process, as reported: torch at 1 thread, a torch op, then detsum."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_THREADING_LAYER")}
    run = subprocess.run([sys.executable, "-c", _FIRST_CALL_AFTER_A_TORCH_OP], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    torch_count, layer = run.stdout.split()
    assert torch_count == "1"
    assert layer == "omp"


def test_results_do_not_depend_on_the_thread_count(torch_threads):
    rows = torch.randn(5000, 16, dtype=torch.float64).float()
    index = torch.randint(0, 37, (5000,), generator=torch.Generator().manual_seed(0))
    results = []
    for n in (1, 2):
        torch.set_num_threads(n)
        results.append(detsum.index_add(torch.zeros(37, 16), 0, index, rows, mode="kahan"))
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    assert np.isfinite(results[0].numpy()).all()


# ---- forked children: DataLoader workers, multiprocessing pools ---------------------------------

def _dispatchers(value, found):
    """The Numba dispatchers in ``value`` (a dispatcher, a parallel kernel, a kernel launched
    over thread blocks, or a dict, tuple or list of them) and in their closures, added to
    ``found``."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, Blocks):
        value = [value.driver, value.block_kernel]
    if isinstance(value, (tuple, list)):
        for item in value:
            _dispatchers(item, found)
        return found
    if isinstance(value, numba_kernels._ParallelKernel):
        value = value.serial()
    if isinstance(value, numba.core.registry.CPUDispatcher) and value not in found:
        found.add(value)
        fn = value.py_func
        # The functions a kernel instance binds (instances.instance), and its closure's.
        module_globals = vars(sys.modules[fn.__module__])
        bound = [v for k, v in fn.__globals__.items() if module_globals.get(k) is not v]
        for inner in bound + [cell.cell_contents for cell in fn.__closure__ or ()]:
            _dispatchers(inner, found)
    return found


def test_no_kernel_enters_the_pool_in_a_forked_process():
    """A kernel compiled with parallel=True and called as it is enters Numba's OpenMP pool,
    which kills a forked child: every such kernel must be a parallel_njit one, whose serial
    twin runs there. Walks every kernel of every format and mode, every kernel module's
    names, their tables and the functions they bind or close over."""
    found = set()
    _dispatchers(list(every_kernel()), found)
    for info in pkgutil.iter_modules(numba_kernels.__path__):
        module = importlib.import_module(f"{numba_kernels.__name__}.{info.name}")
        for value in vars(module).values():
            _dispatchers(value, found)
    assert len(found) > 20
    parallel = sorted(d.py_func.__qualname__ for d in found if d.targetoptions.get("parallel"))
    assert not parallel, f"kernels that enter the pool in a forked child: {parallel}"


def test_serial_twins_give_the_parallel_kernels_bits(monkeypatch):
    """The kernels that the forked-children test below does not launch (products, the MoE
    weighted sums, the wire format's), each on its parallel path, then through its serial
    twin as in a forked child."""
    from detsum.kernels import KAHAN, WIDE
    from detsum.kernels.numba import outer, weighted

    g = torch.Generator().manual_seed(5)
    left, right = torch.randn(40, 300, generator=g), torch.randn(40, 64, generator=g)
    y = torch.randn(900, 64, generator=g)
    positions = torch.randint(0, 900, (1200,), generator=g)
    weights = torch.rand(1200, generator=g)
    grad = torch.randn(600, 64, generator=g)
    tokens = torch.randint(0, 600, (900,), generator=g)

    def launches():
        results = []
        for rule in (WIDE, KAHAN):
            total = torch.randn(300 * 64, generator=torch.Generator().manual_seed(6))
            comp = torch.zeros(300 * 64) if rule == KAHAN else None
            outer.resume_products(total, comp, left, right, rule)
            results += [total] if comp is None else [total, comp]
            results.append(weighted.gather_scale_sum(y, positions, weights, 2, rule))
            results.append(weighted.row_dots(grad, tokens, y, rule))
        return [r.view(torch.int32) for r in results]

    with detsum_threads(2):
        parallel = launches()
    monkeypatch.setattr(numba_kernels, "_forked", True)
    serial = launches()
    for got, want in zip(serial, parallel):
        assert torch.equal(got, want)
    launched = [kernel for table in (outer._KERNELS, weighted._KERNELS)
                for key, kernel in table.items() if torch.float32 in key]
    assert len(launched) == 6
    assert all(kernel.serial().signatures for kernel in launched)


_CALLS_IN_FORKED_CHILDREN = """
import multiprocessing, os, signal, sys
import torch, detsum

g = torch.Generator().manual_seed(0)
# Made here, before any fork: the children compute on the parent's very tensors.
rows = torch.randn(20000, 64, generator=g)
index = torch.randint(0, 500, (20000,), generator=g)
offsets = torch.tensor([0, 700, 700, 3000])
products = torch.randn(300, 64, generator=g).double()


def call(k):
    # One launch of a CPU kernel per call (k), each a different parallel kernel.
    if k == 0:  # the segment kernel, several blocks: a parallel launch in the parent
        return detsum.index_add(torch.zeros(500, 64), 0, index, rows, alpha=0.3)
    if k == 1:  # the small index_add path, a serial kernel
        return detsum.index_add(torch.zeros(8, 4), 0, index[:30] % 8, rows[:30, :4])
    if k == 2:  # the exact kernel
        return detsum.segment_sum(rows[:3000], offsets, mode="exact")
    running = detsum.RunningSum((64,), dtype=torch.float64, mode="exact")
    running.add(products)  # the exact state's adder, then its rounding
    return running.sum()


def bits(results):
    return [r.view(torch.int64 if r.dtype == torch.float64 else torch.int32) for r in results]


class Calls(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, k):
        return call(k)


want = bits([call(k) for k in range(4)])  # in the parent: its layer starts, its pool runs


def same(results):
    return all(torch.equal(a, b) for a, b in zip(bits(results), want))


# A plain fork, and a fork of that fork (which would wait for the pool's threads forever: an
# alarm ends it). The first failure ends the run.
for depth in (1, 2):
    pid = os.fork()
    if pid == 0:
        signal.alarm(300)
        if depth == 2 and os.fork() != 0:
            os._exit(os.waitstatus_to_exitcode(os.wait()[1]) & 0xFF)
        os._exit(0 if same([call(k) for k in range(4)]) else 1)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(f"fork depth {depth}: exit code {code}", flush=True)
    if code:
        sys.exit(1)

loader = torch.utils.data.DataLoader(Calls(), batch_size=None, num_workers=2,
                                     multiprocessing_context="fork", timeout=300)
print("DataLoader workers: same bits", same(list(loader)), flush=True)



def call_bytes(k):
    # torch's own pickling of a tensor waits forever in a forked worker once the parent's
    # OpenMP pool has run (torch alone does that): the bits travel as bytes.
    return call(k).numpy().tobytes()


with multiprocessing.get_context("fork").Pool(2) as pool:
    # A pool replaces a killed worker and waits for the lost task forever: hence the timeout.
    got = pool.map_async(call_bytes, range(4)).get(timeout=300)
    print("Pool workers: same bits", got == [w.numpy().tobytes() for w in want], flush=True)
"""


def test_forked_children_compute_the_parents_bits():
    """As reported: a large index_add, then the same call in a forked child, which Numba's
    OpenMP layer killed ("fork() called from a process already using GNU OpenMP, this is
    unsafe"). In a fresh process (this one's layer and compiled kernels must not mask it): the
    parent calls each kind of kernel, then forked children (a plain fork, a fork of a fork,
    DataLoader workers, a multiprocessing pool) make the same calls on the same tensors."""
    run = subprocess.run([sys.executable, "-c", _CALLS_IN_FORKED_CHILDREN],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.splitlines() == ["fork depth 1: exit code 0", "fork depth 2: exit code 0",
                                       "DataLoader workers: same bits True",
                                       "Pool workers: same bits True"], run.stderr[-3000:]
