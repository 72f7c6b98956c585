"""detsum.kernels.numba.instances: kernels compiled per bound constant, run over thread blocks
through their address."""

from __future__ import annotations

import numpy as np
import pytest
from numba import prange

from detsum.kernels.numba import parallel_njit
from detsum.kernels.numba.instances import (DONE, OTHER_TYPES, Blocks, call_at, instance,
                                            types_key_of)


def _fill(b, out, value):
    """Block b writes ``value * scale * (b + 1)`` into out[b] (``scale`` is bound); a block
    whose element is negative raises."""
    if out[b] < 0:
        raise ValueError("a block that fails")
    out[b] = value * scale * (b + 1)  # noqa: F821


@parallel_njit(cache=True)
def _run(address, types_key, failed, out, value):
    if types_key_of((out, value)) != types_key:
        return OTHER_TYPES
    for b in prange(failed.shape[0]):
        if not call_at(address, np.int64(b), (out, value)):
            failed[b] = 1
    return DONE


@pytest.mark.parametrize("n_blocks", (1, 4))
def test_every_block_runs_with_its_instance_constants(n_blocks):
    twice, thrice = Blocks(_run, instance(_fill, "twice", scale=2.0)), Blocks(
        _run, instance(_fill, "thrice", scale=3.0))
    for kernel, scale in ((twice, 2.0), (thrice, 3.0)):
        out = np.zeros(n_blocks)
        kernel(n_blocks, (out, 1.5))
        assert out.tolist() == [1.5 * scale * (b + 1) for b in range(n_blocks)]
    assert twice.block_kernel.py_func.__qualname__ == "_fill_twice"


def test_a_launch_of_other_argument_types_runs_code_compiled_for_them():
    kernel = Blocks(_run, instance(_fill, "types", scale=2.0))
    wide, narrow = np.zeros(4), np.zeros(4, dtype=np.float32)
    kernel(4, (wide, 0.1))
    kernel(4, (narrow, 0.1))
    kernel(4, (wide, 0.3))
    assert wide.tolist() == [0.3 * 2.0 * (b + 1) for b in range(4)]
    assert narrow.tolist() == [np.float32(0.1 * 2.0 * (b + 1)) for b in range(4)]
    assert len(kernel.block_kernel.signatures) == 2


def test_a_block_that_raises_is_reported():
    kernel = Blocks(_run, instance(_fill, "fails", scale=1.0))
    out = np.zeros(4)
    out[2] = -1.0
    with pytest.raises(RuntimeError, match="_fill_fails: a block failed"):
        kernel(4, (out, 1.0))
    assert out.tolist() == [1.0, 2.0, -1.0, 4.0]
