"""A first call from Numba's on-disk cache: it loads the compiled kernels without Numba's
registry refresh (``detsum.kernels.numba._LeanLoadingCache``), computes the bits the freshly
compiled kernels computed, and leaves Numba able to compile afterwards. Each check runs in a
fresh process: the refresh happens once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

#: A fresh process on the given cache directory: a small index_add (the one-call path) and a
#: segment_sum of several thread blocks (a kernel called through the parallel driver), their
#: results saved, whether the registry refresh ran for them, then a compilation of a function
#: of the process's own.
CHILD = r"""
import json, sys
import torch
import detsum
from detsum.kernels import numba as numba_kernels

# A module that only the registry refresh imports (Numba's typed lists).
REFRESH_MODULE = "numba.typed.typedlist"
g = torch.Generator().manual_seed(0)
src = torch.randn(256, 64, generator=g)
index = torch.randint(0, 64, (256,), generator=g)
rows = torch.randn(40000, 64, generator=g)
results = [detsum.index_add(torch.zeros(64, 64), 0, index, src),
           detsum.segment_sum(rows, torch.arange(0, 40001, 10))]
torch.save(results, sys.argv[1])
refreshed_for_the_calls = REFRESH_MODULE in sys.modules

import numba
import numpy as np

@numba.njit
def compiled_afterwards(values):
    return np.sum(values[values > 0])

total = compiled_afterwards(np.array([1.0, -2.0, 3.0]))
print(json.dumps({"lean": numba_kernels._LEAN_LOADS, "refreshed": refreshed_for_the_calls,
                  "total": total, "refreshed_after_compile": REFRESH_MODULE in sys.modules}))
"""


def _child(cache_dir, results) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(results)], capture_output=True,
                         text=True, timeout=600, cwd=cache_dir,
                         env={**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_a_first_call_from_the_cache_loads_without_the_registry_refresh(tmp_path):
    # An empty cache: the kernels compile (and the refresh runs).
    compiled = _child(tmp_path, tmp_path / "compiled.pt")
    assert compiled["refreshed"]
    loaded = _child(tmp_path, tmp_path / "loaded.pt")
    assert loaded["lean"], "this Numba's cache lacks what the lean load overrides"
    assert not loaded["refreshed"]
    # The loaded machine code computes what the freshly compiled code did.
    for fresh, from_cache in zip(torch.load(tmp_path / "compiled.pt"),
                                 torch.load(tmp_path / "loaded.pt"), strict=True):
        assert torch.equal(from_cache, fresh)
    # A compilation after a lean load refreshes the registries itself, and works.
    assert loaded["total"] == 4.0 and loaded["refreshed_after_compile"]
