"""benches/pyg_switch_plugin.py's bit check (``--detsum-check-bits``): it compares every call
that ran on detsum with torch's deterministic kernel, whichever of the switch's ways took the
call (the C++ kernels, a short way, a kernel body), and it reports a call whose bits differ."""

from __future__ import annotations

import pytest
import torch

import detsum
from conftest import NATIVE_BUILD_ERROR, bench_module
from detsum import switch


@pytest.fixture(scope="module")
def plugin():
    return bench_module("pyg_switch_plugin")


@pytest.fixture(params=[True, False], ids=["C++ kernels", "Python kernels"])
def native(request):
    """The switch's C++ kernels installed, or its Python kernels alone."""
    if request.param and NATIVE_BUILD_ERROR is not None:
        pytest.skip(NATIVE_BUILD_ERROR)
    was = switch.NATIVE
    switch._use_native(request.param)
    yield request.param
    switch._use_native(was)


def _switched_calls() -> None:
    """Calls a GNN's step makes: small in-place sums and maxima (the C++ kernels' or the
    short ways'), a backward of ``x[idx]`` and of ``gather``, a segment reduction (a kernel
    body's), and a sum scaled by 0.5, which "autograd" mode leaves to torch."""
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 8, (40,), generator=g)
    src = torch.randn(40, 3, generator=g)
    torch.zeros(8, 3).scatter_add_(0, index[:, None].expand(40, 3), src)
    torch.zeros(8, 3).index_add_(0, index, src)
    torch.zeros(8, 3).scatter_reduce_(0, index[:, None].expand(40, 3), src, "amax")
    torch.index_add(torch.zeros(8, 3), 0, index, src, alpha=0.5)
    x = torch.randn(8, 3, generator=g, requires_grad=True)
    (x[index] * src).sum().backward()
    torch.gather(x, 0, index[:, None].expand(40, 3)).mul(src).sum().backward()
    torch.segment_reduce(src, "sum", lengths=torch.tensor([10, 0, 30]))


def _on_detsum(plugin) -> tuple[int, int]:
    """``_switched_calls()`` under the switch in "autograd" mode, without the bit check: how
    many of its calls ran on detsum, and how many of those the C++ kernels took."""
    before = plugin._detsum_calls()  # the C++ kernels' counts so far taken in
    with detsum.deterministic("autograd"):
        _switched_calls()
    by_native: dict = {}
    switch._take_native_counts(by_native)
    in_python = plugin._detsum_calls() - before
    switch.counts.update(by_native)  # the process's counts kept whole
    taken_by_native = sum(n for (_, ran), n in by_native.items() if ran == "detsum")
    return in_python + taken_by_native, taken_by_native


def test_every_call_on_detsum_is_checked_and_agrees_in_autograd_mode(plugin, native):
    calls, taken_by_native = _on_detsum(plugin)
    checked, differ = plugin._bits["checked"], len(plugin._bits["differ"])
    before = plugin._detsum_calls()
    with detsum.deterministic("autograd"), plugin._CheckingBits():
        _switched_calls()
    # The same calls ran on detsum with the check as without it (the C++ kernels took some
    # where installed), and every one was checked: none differs.
    assert plugin._detsum_calls() - before == calls == 6
    assert (taken_by_native > 0) == native
    assert plugin._bits["checked"] - checked == calls
    assert plugin._bits["differ"][differ:] == []


def test_a_call_whose_bits_differ_from_torchs_is_reported(plugin, native):
    """Under "kahan" a sum whose terms cancel keeps what torch's float32 sum rounds away."""
    differ = len(plugin._bits["differ"])
    with detsum.deterministic("kahan"), plugin._CheckingBits():
        target = torch.zeros(2)
        target.index_add_(0, torch.tensor([0, 0, 0]), torch.tensor([1e8, 1.0, -1e8]))
    assert target.tolist() == [1.0, 0.0]  # torch's float32 sum gives 0.0
    assert plugin._bits["differ"][differ:] == ["aten::index_add_ torch.float32"]
