"""What the tests of the ``check`` levels share (tests/test_check.py for the primitives,
tests/test_moe_check.py for detsum.moe): a GPU's launch path on CPU tensors, and a guard that
fails at any read of a tensor's values into Python from detsum's own code."""

from __future__ import annotations

import contextlib
import unittest.mock

import detsum
from conftest import host_reads
from detsum import _segments


class HostRead(AssertionError):
    pass


def no_host_reads():
    """Every read of a tensor's values into Python from detsum's own code raises HostRead."""
    def refuse(name, caller):
        raise HostRead(f"{name} called from {caller}")
    return host_reads(refuse)


@contextlib.contextmanager
def gpu_path(backend="triton"):
    """CPU tensors on a GPU's path: ``backend``'s launch, with the values checked as on a GPU
    (``_segments.GPU_CHECKS_ON_CPU``): "device" on the device, "off" not at all."""
    with detsum.backend(backend), unittest.mock.patch.object(_segments, "GPU_CHECKS_ON_CPU",
                                                             True):
        yield
