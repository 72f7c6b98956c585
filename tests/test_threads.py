"""detsum leaves torch's thread settings as it found them and follows them.

Seen before: the first detsum call after a torch op turned torch.get_num_threads() from 1 into
2 (Numba's OpenMP layer shares torch's OpenMP runtime and set its thread count), and a call
under torch.set_num_threads(1) ran on every core (RunningSum.add of 8192x64: 0.6-1.05 s on a
loaded 2-core machine, against 11-16 ms on one thread).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

import detsum
from detsum.kernels.numba import segment


@pytest.fixture
def threads_used(monkeypatch):
    """The Numba thread count each fp32 kernel launch ran with."""
    seen = []
    kernel, acc = segment._KERNELS[torch.float32]

    def recording_kernel(*args):
        seen.append(numba.get_num_threads())
        return kernel(*args)

    monkeypatch.setitem(segment._KERNELS, torch.float32, (recording_kernel, acc))
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
