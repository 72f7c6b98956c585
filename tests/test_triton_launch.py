"""The direct launch of detsum's Triton kernels (kernels/triton/launch.py): after a
specialisation's first launch, its compiled kernel is called without ``JITFunction.run``.

What can go wrong is silent on a GPU: a launch running a kernel compiled for other arguments
(other alignment, say). Without a GPU, tests/launch_check.py compiles the kernels for sm_90
and stubs the driver's launch (tests/triton_stub.py), and checks the key and the launches
against what ``JITFunction.run`` computes and does; the tests below read its findings. On a
GPU, the last test compares the bits of both launch paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest.mock

import pytest
import torch

import detsum
from conftest import assert_same_bits

triton = pytest.importorskip("triton")

from detsum.kernels.triton import launch, segment  # noqa: E402


# ---- the key, on its own -----------------------------------------------------------------------

def _key(*args, num_warps=4, **constexprs):
    return launch.specialisation_key(0, num_warps, constexprs.values(), args)


def test_key_keeps_apart_what_triton_compiles_apart():
    """Each property Triton specialises on changes the key."""
    buffer = torch.zeros(64)
    aligned, misaligned = buffer[:16], buffer[1:17]
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    assert _key(aligned) != _key(misaligned)
    assert _key(aligned) != _key(aligned.double())
    for a, b in [(1, 2), (16, 17), (0, 1), (2**31 - 16, 2**31), (-(2**31), -(2**31) - 16),
                 (2**63 - 16, 2**63)]:
        # a 1 becomes a constant; a multiple of 16 is marked; i32, i64 and u64 differ
        assert _key(a) != _key(b), (a, b)
    # equal in Python, not to Triton
    assert len({_key(BLOCK=True), _key(BLOCK=1), _key(BLOCK=1.0)}) == 3
    assert _key(BLOCK=16) != _key(BLOCK=32)
    assert _key(aligned, num_warps=4) != _key(aligned, num_warps=8)


def test_key_is_shared_by_what_triton_compiles_alike():
    """Integers of one class and tensors of one dtype and alignment share the key: a new
    size or a new tensor finds the kernel compiled for the old ones."""
    assert _key(torch.zeros(16), 2, 16, 2**31 + 1) == _key(torch.ones(64), 3, 48, 2**40 + 7)
    assert _key(2**31 - 1) == _key(-1)


def test_key_for_a_layout_is_the_key():
    """The straight-line key a Kernel makes for its first launch's layout gives
    ``specialisation_key``'s answer, and the arguments with each tensor's data pointer in its
    place, for launches of that layout and of any other (which it hands to
    ``key_and_pointers``): a tensor or a bool where the layout has an int, an int where it has
    a tensor, more or fewer arguments."""
    buffer = torch.zeros(64)
    aligned, misaligned = buffer[:16], buffer[1:17]
    layout = (aligned, 2, 16, torch.zeros(4, dtype=torch.int64), 2**40)
    layout_key = launch.key_for_layout(layout)
    others = [
        layout,
        (misaligned, 1, 17, aligned.double(), -1),
        (aligned, -(2**31) - 16, 2**63, aligned, 0),
        (aligned, aligned, 16, aligned, 2),  # a tensor where the layout has an int
        (3, 2, 16, aligned, 2),  # an int where the layout has a tensor
        (aligned, 2, 16, aligned),
        (aligned, 2, 16, aligned, 2, 5),
        (),
    ]
    for args in others:
        for constexprs in [(), (True,), (1,), (1.0, triton.language.float32)]:
            key, pointers = layout_key(0, 4, constexprs, args)
            assert (key, pointers) == launch.key_and_pointers(0, 4, constexprs, args)
            assert key == launch.specialisation_key(0, 4, constexprs, args), (args, constexprs)
            # What the launcher is handed: each tensor's address, each int itself.
            assert pointers == tuple(arg if type(arg) is int else arg.data_ptr()
                                     for arg in args)
            assert all(type(pointer) is int for pointer in pointers)
    assert layout_key(0, 4, (), layout) != layout_key(0, 4, (), (misaligned, *layout[1:]))
    # a bool or a float equal to an int the layout has there: not that int's class
    for odd in (True, 1.0):
        with pytest.raises(AttributeError):
            launch.specialisation_key(0, 4, (), (aligned, odd, 16, aligned, 2))
        with pytest.raises(AttributeError):
            layout_key(0, 4, (), (aligned, odd, 16, aligned, 2))


def test_key_follows_triton_debug_knob():
    """Triton puts its ``debug`` knob in a launch's options: set, it is another kernel."""
    from triton import knobs

    before = _key(3)
    with unittest.mock.patch.object(knobs.runtime, "debug", True):
        assert _key(3) != before


def test_direct_launch_only_in_checked_releases():
    """The releases pyproject accepts launch directly; any other uses JITFunction.run (the
    fallback itself is checked in test_fallback_launches_through_jitfunction_run)."""
    assert launch._release("3.10.0+git1a2b") == (3, 10)
    assert launch._release("3.6.0") == (3, 6)
    assert launch.DIRECT_LAUNCH == ((3, 6) <= launch._release(triton.__version__) < (3, 10))


def test_interpreted_kernels_launch_as_before():
    """Under TRITON_INTERPRET=1 a kernel is an InterpretedFunction, launched through its
    ``run`` every time (which the launch counter of tests/launch_counter.py relies on)."""
    if not segment.interpreted():
        pytest.skip("the kernels are compiled here")
    assert not segment._launch_segment._jit
    runs = []
    run = segment._segment_kernel.run

    def counted(*args, **kwargs):
        runs.append(kwargs["grid"])
        return run(*args, **kwargs)

    index = torch.tensor([0, 1, 1, 0])
    with detsum.backend("triton"), \
            unittest.mock.patch.object(segment._segment_kernel, "run", counted):
        plan = detsum.plan(index, 2)
        for _ in range(2):
            detsum.index_add(torch.zeros(2, 3), 0, index, torch.ones(4, 3), plan=plan)
    assert len(runs) == 2


# ---- against JITFunction.run, compiled for sm_90 without a GPU ---------------------------------

@pytest.fixture(scope="module")
def launch_check() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__),
                                                       "launch_check.py")],
                         capture_output=True, text=True, env=env, timeout=900,
                         cwd=os.path.dirname(__file__))
    if run.returncode != 0 and "ptxas" in run.stderr:
        pytest.skip(f"no ptxas to compile with: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_key_is_at_least_as_fine_as_triton(launch_check):
    """Over launches each one property away from a real launch of each kernel, no two with
    the same detsum key have different Triton keys. Where detsum's key is finer, it is only
    a constexpr's type (Triton memoises its key on a tuple, in which True == 1 == 1.0)."""
    keys = launch_check["keys"]
    assert keys["kernels"] == ["_exact_kernel", "_segment_kernel", "_sort_offsets_kernel",
                               "_stride1_kernel"]
    for name in keys["kernels"]:
        found = keys[name]
        # Each argument and constexpr varied: 56 launches for the offsets' search (5
        # arguments, BLOCK), over 100 for the others.
        assert found["launches"] > (50 if name == "_sort_offsets_kernel" else 100), name
        assert found["unsafe"] == [], (name, found["unsafe"])
        for group in found["split"]:
            assert all(label.endswith((" as int", " as float")) for label in group), group


def test_direct_launch_runs_what_jitfunction_run_runs(launch_check):
    """Each launch of a set of detsum calls (every kernel, each mode with a plan, a
    misaligned source after an aligned one, bf16 with alpha, long segments), replayed twice
    through launchers that start empty: a key's first launch goes through JITFunction.run,
    every later one does not, and each hands the driver the compiled kernel that
    JITFunction.run picks for its arguments, with the same arguments as JITFunction.run but
    for each tensor's data pointer in its place (launch.POINTERS_AS_INTS), and with the
    tensors themselves when that is off."""
    assert launch_check["direct_launch"]
    replays = launch_check["replays"]
    assert {r["kernel"] for r in replays} == {"_segment_kernel", "_stride1_kernel",
                                              "_exact_kernel", "_sort_offsets_kernel"}
    first = [r for r in replays if r["replay"] == 1]
    assert sum(r["jitfunction_runs"] for r in first) >= 8  # distinct keys, each once
    for replay in replays:
        assert replay["jitfunction_runs"] in ((0, 1) if replay["replay"] == 1 else (0,)), replay
        assert replay["driver_launches"] == [1, 1], replay
        assert replay["same_as_jitfunction_run"], replay
        assert replay["kernel_triton_picks"], replay
    direct = [r for r in replays if r["replay"] == 2]
    assert all(r["pointers_as_ints"] for r in direct)
    assert launch_check["tensors_when_pointers_off"]


def test_fallback_launches_through_jitfunction_run(launch_check):
    """With DIRECT_LAUNCH off, and with a launch hook installed, every launch goes through
    JITFunction.run, and the hook sees each one."""
    fallback = launch_check["fallback"]
    # JITFunction.run's count and the driver's launches, at the first and second launch
    assert fallback["direct_launch_off"] == [[1, 1, 1, 1]] * fallback["launches"]
    assert fallback["launch_hook"] == [[1, 1, 1, 1]] * fallback["launches"]
    assert fallback["hook_calls"] == 2 * fallback["launches"]


def test_a_plan_call_launches_again_what_its_whole_path_launches(launch_check):
    """A call with a plan whose signature is its last call's makes that call's launch again
    (no launch reaches Kernel), and hands the driver what the whole path hands it for the
    same tensors: the same compiled kernel, grid, stream and arguments, the new tensors'
    pointers in their places, and where the whole path makes a workspace, ticket counters or
    alpha, one of the same dtype and shape held since the record (alpha's and the counters'
    values too). Across long segments, alpha, in place, outer rows, one feature, a strided
    source, each mode, a sorted plan, segment_sum, scatter_reduce's sum, mean (without the
    input), maximum and minimum, a source requiring grad (the call through torch's
    dispatcher, recorded by autograd), outputs NaN-filled first (recorded so, and launched
    again into a filled output); "exact" (not one launch), in place into a strided
    input, a call with an op after its launch (a copy, an add: torch ops the launch does
    not repeat), one whose workspace is over HELD_WORKSPACE_BYTES, and one whose offsets a
    consumer built for it (an MoE backward's, no plan's) are never launched again."""
    cases = launch_check["launches_again"]["cases"]
    not_again = {"exact", "in place, strided input", "an op after the launch",
                 "workspace over HELD_WORKSPACE_BYTES", "offsets a consumer built"}
    assert len(cases) == 24
    for name, case in cases.items():
        assert case["launched_again"] == (name not in not_again), name
        assert case["same_output_layout"], name
        if name not in not_again:
            assert case["same_driver_calls"], name
    # The workspace (fp32 for bf16 data) and ticket counters of long segments, alpha.
    assert cases["fp32, long segments"]["held"] == ["torch.float32", "torch.int64"]
    assert cases["kahan bf16, alpha"]["held"] == ["torch.float32", "torch.int64",
                                                  "torch.float32"]
    assert cases["fp32, short segments"]["held"] == []
    # Offsets that are no plan's are not even recorded (an MoE backward's, every step).
    assert not cases["offsets a consumer built"]["tried_to_record"]
    assert cases["in place, strided input"]["tried_to_record"] is False  # its whole path only


def test_a_call_without_a_plan_made_again_hands_the_driver_its_whole_paths_launches(
        launch_check):
    """A call without a plan made again from its tape (``detsum._replay``) launches every
    kernel directly (none through ``Kernel``) and hands the driver what its whole path hands
    it for the same tensors: the same compiled kernels, grids, streams and integers, the
    call's tensors in the same places, and each tensor the call made in the same places as
    one the whole path made. Across the counting sort and torch's, long segments (a
    workspace, ticket counters), an index scanned unsorted, in place, bf16 with alpha, outer
    rows, a misaligned source and an int32 index."""
    cases = launch_check["calls_made_again"]
    assert len(cases) == 8
    for name, case in cases.items():
        assert case["kernel_calls"] == 0, name
        # A scanned index: the reduction alone; torch's sort: its search and the reduction;
        # the counting sort: its four launches and the reduction.
        assert case["launches"] == (1 if name == "fp32, scanned" else
                                    2 if name == "torch's sort" else 5), name
        assert case["same_driver_calls"], name


def test_a_plan_keeps_the_launches_of_several_signatures(launch_check):
    """Two layers sharing a plan with rows of different widths, called in turn: each one's
    first call is recorded (or compiles its kernel, then is recorded at its second), and
    from the third round on every call is launched again."""
    in_turn = launch_check["launches_again"]["widths_in_turn"]
    assert in_turn[:2] == [False, False] and in_turn[4:] == [True] * 4, in_turn


def test_sources_aligned_otherwise_in_turn_each_keep_a_launch(launch_check):
    """A source 16-byte aligned and one misaligned, in turn on one plan (two compiled
    kernels): each keeps a launch of its own (alignment is in the signature), so from the
    third round on every call is launched again and none tries to record."""
    in_turn = launch_check["launches_again"]["alignments_in_turn"]
    assert [call["launched_again"] for call in in_turn[4:]] == [True] * 4, in_turn
    assert not any(call["tried_to_record"] for call in in_turn[4:]), in_turn


def test_a_relaunch_refuses_what_would_launch_otherwise(launch_check):
    """After a record: a source aligned otherwise (another compiled kernel), another stream
    (the held workspace belongs to the record's), a launch hook (to be called), another
    TILE_BYTES or GUIDED_CHUNKS (another launch): the call takes its whole path and launches
    what it does."""
    refused = launch_check["launches_again"]["refused"]
    assert set(refused) == {"source aligned otherwise", "another stream", "a launch hook",
                            "TILE_BYTES 0", "GUIDED_CHUNKS off"}
    for name, case in refused.items():
        assert not case["launched_again"], name
        assert case["same_driver_calls"] and case["same_output_layout"], name


def test_constexprs_out_of_order_are_refused(launch_check):
    assert launch_check["order_error"].startswith("_segment_kernel: constexprs ('SEGS', 'BLOCK',")
    assert "expected ('REDUCE', 'RULE'," in launch_check["order_error"]


# ---- on a GPU: the same bits either way --------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd", "exact"])
def test_direct_launch_gives_jitfunction_run_bits(mode):
    """Every primitive with a plan, an unplanned call with long segments (folded in the launch),
    a misaligned source, bf16 with alpha, one-element rows: launched directly (after a first
    launch) and through JITFunction.run, the same bits."""
    gen = torch.Generator().manual_seed(5)
    rows, segments, features = 3000, 9, 33
    index = torch.randint(0, segments, (rows,), generator=gen).cuda()
    src = torch.randn(rows, features, generator=gen).cuda()
    init = torch.randn(segments, features, generator=gen).cuda()
    misaligned = torch.randn(rows * features + 1, generator=gen).cuda()[1:].view(rows, features)
    plan = detsum.plan(index, segments)
    calls = [
        lambda: detsum.index_add(init, 0, index, src, mode=mode, plan=plan),
        lambda: detsum.index_add(init, 0, index, misaligned, mode=mode, plan=plan),
        lambda: detsum.index_add(init.bfloat16(), 0, index, src.bfloat16(), alpha=0.5,
                                 mode=mode, plan=plan),
        lambda: detsum.segment_sum(src, mode=mode, plan=plan),
        lambda: detsum.scatter_reduce(init, 0, index, src, "sum", mode=mode, plan=plan),
        lambda: detsum.index_add(init, 0, index, src, mode=mode),
        # slice size 1: torch's stride-1 rule in "autograd" mode
        lambda: detsum.index_add(init[:, 0], 0, index, src[:, 0], mode=mode, plan=plan),
    ]
    for call in calls:
        with unittest.mock.patch.object(launch, "DIRECT_LAUNCH", False):
            expected = call()
        for _ in range(2):  # the first launch may compile; the second is direct
            assert_same_bits(call(), expected)


def _assert_whole_paths_bits(calls, call_in_place, in_place, made_again, whole_path):
    """Each of ``calls`` and ``call_in_place()`` (into ``in_place``, the first call's input)
    under ``made_again``, against ``calls`` on their whole path, under ``whole_path``."""
    with made_again:
        outs = [call() for call in calls]
        call_in_place()
    with whole_path:
        expected = [call() for call in calls]
    for out, whole in zip(outs, expected):
        assert_same_bits(out, whole)
    assert_same_bits(in_place, expected[0])


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd"])
def test_a_plan_call_launched_again_gives_its_whole_paths_bits(mode):
    """``index_add`` (also with a source requiring grad), ``index_add_``, ``segment_sum`` and
    ``scatter_reduce`` (a mean without the input) with a plan, on new tensors at each call
    (new pointers; misaligned from the fourth call, which the record's kernel does not
    take): a call that makes its last launch again gives the bits of the same call on its
    whole path (``plans.LAUNCH_AGAIN`` off); long segments (a held workspace) and short
    ones, bf16 with alpha (a held alpha). A misaligned source is another signature: both
    alignments are launched again, and no launch made again is refused."""
    gen = torch.Generator().manual_seed(6)
    segments, features = 9, 33
    relaunched = []
    again = launch.Relaunch.__call__

    def counted(self, pointers):
        launched = again(self, pointers)
        relaunched.append((launched, self.aligned))
        return launched

    for rows, dtype, alpha in ((3000, torch.float32, 1.0), (200, torch.float32, 1.0),
                               (3000, torch.bfloat16, 0.5)):
        index = torch.randint(0, segments, (rows,), generator=gen).cuda()
        plan = detsum.plan(index, segments)
        relaunched.clear()
        for call in range(6):
            src = torch.randn(rows * features + 1, generator=gen).to(dtype).cuda()
            src = src[int(call >= 3):][:rows * features].view(rows, features)
            init = torch.randn(segments, features, generator=gen).to(dtype).cuda()
            in_place = init.clone()
            src_g = src.detach().requires_grad_()  # through torch's dispatcher and autograd
            calls = [
                lambda: detsum.index_add(init, 0, index, src, alpha=alpha, mode=mode, plan=plan),
                lambda: detsum.index_add(init, 0, index, src_g, alpha=alpha, mode=mode,
                                         plan=plan).detach(),
                lambda: detsum.segment_sum(src, mode=mode, plan=plan),
                lambda: detsum.scatter_reduce(init, 0, index, src, "mean", include_self=False,
                                              mode=mode, plan=plan),
            ]
            _assert_whole_paths_bits(
                calls, lambda: detsum.index_add_(in_place, 0, index, src, alpha=alpha,
                                                 mode=mode, plan=plan), in_place,
                unittest.mock.patch.object(launch.Relaunch, "__call__", counted),
                unittest.mock.patch.object(detsum.plans, "LAUNCH_AGAIN", False))
        # Each signature (the call requiring grad shares index_add's) aligned: recorded at
        # its second call, launched again at its third; misaligned from the fourth, another
        # signature: recorded at the fifth, launched again at the sixth (but for a call that
        # is not one launch: the mean in "autograd" on CUDA).
        assert len(relaunched) >= 6, (rows, dtype, relaunched)
        assert all(launched for launched, _ in relaunched), (rows, dtype, relaunched)
        alignments = {aligned for _, aligned in relaunched}
        assert len(alignments) >= 2, (rows, dtype, relaunched)


@pytest.mark.cuda
@pytest.mark.parametrize("check", ["off", "device"])
@pytest.mark.parametrize("mode", ["fp32", "kahan", "autograd"])
def test_a_call_without_a_plan_made_again_gives_its_whole_paths_bits(mode, check):
    """``index_add``, ``index_add_``, ``scatter_reduce`` (a sum in torch's index form, a
    mean without the input) and ``segment_sum`` (with ``perm``, a segment longer than a
    chunk) without a plan, on new tensors at each call: from a signature's
    third call made again from its tape (``detsum._replay``), each with the bits of the same
    call on its whole path (``_replay.REPLAY`` off); an index sorted by counting (past 4096
    values) with a segment longer than a chunk, a short index scanned unsorted, bf16 with
    alpha. Every tape's launches are direct (none through ``Kernel``)."""
    gen = torch.Generator().manual_seed(7)
    segments, features = 300, 33
    replayed, through_kernel = [], []
    replay, kernel = detsum._replay.Tape.replay, launch.Kernel.__call__

    def counted(self, tensors):
        replayed.append(self)
        before = len(through_kernel)
        result = replay(self, tensors)
        assert len(through_kernel) == before
        return result

    def counted_kernel(self, *args, **options):
        through_kernel.append(self)
        return kernel(self, *args, **options)

    for rows, dtype, alpha in ((6000, torch.float32, 1.0), (200, torch.float32, 1.0),
                               (6000, torch.bfloat16, 0.5)):
        replayed.clear()
        for call in range(4):
            index = torch.randint(0, segments, (rows,), generator=gen)
            index[:300] = 5  # longer than a chunk
            index = index.cuda()
            src = torch.randn(rows, features, generator=gen).to(dtype).cuda()
            init = torch.randn(segments, features, generator=gen).to(dtype).cuda()
            in_place = init.clone()
            offsets = torch.tensor([0, 5, 5, rows - 7, rows]).cuda()
            perm = torch.randperm(rows, generator=gen).cuda()
            calls = [
                lambda: detsum.index_add(init, 0, index, src, alpha=alpha, mode=mode,
                                         check=check),
                lambda: detsum.scatter_reduce(init, 0, index[:, None].expand(src.shape), src,
                                              "sum", mode=mode, check=check),
                lambda: detsum.scatter_reduce(init, 0, index, src, "mean",
                                              include_self=False, mode=mode, check=check),
                lambda: detsum.segment_sum(src, offsets, perm=perm, mode=mode, check=check),
            ]
            with unittest.mock.patch.object(launch.Kernel, "__call__", counted_kernel):
                _assert_whole_paths_bits(
                    calls, lambda: detsum.index_add_(in_place, 0, index, src, alpha=alpha,
                                                     mode=mode, check=check), in_place,
                    unittest.mock.patch.object(detsum._replay.Tape, "replay", counted),
                    unittest.mock.patch.object(detsum._replay, "REPLAY", False))
        # Each signature made again at its third and fourth calls (the "autograd" mean on
        # CUDA is torch's own ops, which may read back: never made again; its segment_sum,
        # made again in Triton's interpreter, is not counted on until a GPU has shown it).
        assert len(replayed) >= (6 if mode == "autograd" else 8), (rows, dtype, len(replayed))
