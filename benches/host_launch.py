"""Host time of a detsum call on the GPU path: without a GPU, the device work stubbed (or on one).

Issue "One plan, one launch", item 4: a call with a plan is one Triton launch, and on a GPU
what it costs is host time (Python, dispatch, the launch). Here the kernels are compiled for
an H100 (sm_90) and Triton's driver launch is a no-op (tests/triton_stub.py), CPU tensors
stand for CUDA ones (no memory is read: nothing runs), and every call goes through detsum's
public function, its launcher and Triton's launch path up to the driver. Each case is timed
as calls per round, rounds interleaved across the cases; the yardstick is
``torch.Tensor.index_add_`` on CPU tensors of the same size, in the same rounds.

Launch paths: "direct" (``detsum.kernels.triton.launch``: the compiled kernel called
directly after a specialisation's first launch, handed data pointers; a call with a plan
makes an earlier call's launch again, ``detsum.plans.call_with_plan``, and one without a
plan is made again from the record of an earlier one, ``detsum._replay``), "whole path"
(those off: ``plans.LAUNCH_AGAIN``, ``_replay.REPLAY``, every call from its public function
down to the direct launch), "direct, tensors" (``POINTERS_AS_INTS`` off: handed the
tensors, whose pointers Triton's launcher then reads and has the driver check, one call
each; the same here, where the launcher is stubbed) and "JITFunction.run" (``DIRECT_LAUNCH``
off: Triton's launch every time, the path before).
Calls (256 rows of 4 fp32 features into 16 rows; MoE: 64 tokens, top-2 of 4 experts):

- ``index_add`` / ``index_add_`` / ``segment_sum`` / ``scatter_reduce`` with a plan, "fp32"
  and "kahan", and ``index_add`` with a source that requires grad (through torch's
  dispatcher, autograd recording the call);
- ``index_add``, a ``scatter_reduce`` max and a ``segment_sum`` over offsets (16 segments of
  16 rows) without a plan at check="off"; and
  ``index_add``, ``index_add_`` and a ``scatter_reduce`` sum of 5000 rows into 16 (an index
  sorted by counting, as on a GPU) at check="off", made again and on the whole path (at
  "device" a call adds the assert of its launch's flag, which the stub never writes);
- ``moe.permute`` + weighted ``moe.unpermute`` given a ``Routing`` (and with ``x`` and the
  weights requiring grad: autograd recording both calls), and the whole layer with
  ``moe.route`` (forward only);
- one launch of ``_segment_kernel`` alone (detsum's ``Kernel``, or ``JITFunction.run``, and
  ``JITFunction.run`` with its check of module globals emptied: what passing them as
  constexprs would save it), and of a kernel of one argument (the launch's floor: against
  ``_segment_kernel``'s 29 arguments, what the launcher's handling of each costs).

With ``--cuda`` (on a GPU machine) the same cases run on CUDA tensors with the real driver:
each call's host time to issue it, the GPU running behind (its work, a few microseconds a
call, never fills the launch queue), against ``torch.Tensor.index_add_`` on CUDA tensors,
plus ``torch.empty_like`` alone (the allocation a call makes). The difference from the
stubbed run is what the driver's launch and CUDA's allocator cost on that host. ``--profile``
adds the 25 functions that take the most of a call with a plan's own time (cProfile, 5000
calls; it slows every Python call alike, so read it as shares, not microseconds).

    python benches/host_launch.py [--rounds 300] [--calls 20] [--cuda] [--profile]
                                  [--note TEXT] [--json PATH]

Prints a table (median us per call, its 10th-90th percentile over rounds, and the median
of the per-round ratios to ``index_add_``) and writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import pathlib
import platform
import pstats
import random
import statistics
import sys
import time
import unittest.mock

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROWS, SEGMENTS, FEATURES = 256, 16, 4
#: The rows of the calls without a plan whose index is sorted (past NARROW_SORT_ABOVE).
LONG_ROWS = 5000
TOKENS, TOPK, EXPERTS = 64, 2, 4


def _import_compiled() -> None:
    """Import triton, detsum and the stub with the kernels compiled, not interpreted (the stub
    compiles them for sm_90): TRITON_INTERPRET off before triton is first imported. Here, not
    at the top, so that importing this file (pytest's doctest collection) changes nothing."""
    global triton, tl, triton_stub, detsum, kernels, moe, launch, segment
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "tests"))
    import triton
    import triton.language as tl
    import triton_stub

    import detsum
    from detsum import kernels, moe
    from detsum.kernels.triton import launch, segment


def _inputs(device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, SEGMENTS, (ROWS,), generator=gen)
    t = {
        "index": index,
        "src": torch.randn(ROWS, FEATURES, generator=gen),
        "init": torch.randn(SEGMENTS, FEATURES, generator=gen),
        "work": torch.randn(SEGMENTS, FEATURES, generator=gen),
        "selected": torch.randint(0, EXPERTS, (TOKENS, TOPK), generator=gen),
        "x": torch.randn(TOKENS, FEATURES, generator=gen),
        "weights": torch.softmax(torch.randn(TOKENS, TOPK, generator=gen), -1),
        "long_index": torch.randint(0, SEGMENTS, (LONG_ROWS,), generator=gen),
        "long_src": torch.randn(LONG_ROWS, FEATURES, generator=gen),
        # Segments of 16 rows each (ROWS is SEGMENTS * 16).
        "offsets": torch.arange(0, ROWS + 1, ROWS // SEGMENTS),
    }
    t = {name: tensor.to(device) for name, tensor in t.items()}
    for name in ("src", "x", "weights"):
        t[f"{name}_requiring_grad"] = t[name].clone().requires_grad_()
    with _as_cuda(device):
        t["plan"] = detsum.plan(t["index"], SEGMENTS)
        t["routing"] = moe.route(t["selected"], EXPERTS)
    return t


@contextlib.contextmanager
def _as_cuda(device: str):
    """CPU tensors on the path CUDA tensors take (the stub; their index of more than
    NARROW_SORT_ABOVE values sorted by counting), or nothing to do (``--cuda``)."""
    if device != "cpu":
        yield
        return
    with triton_stub.cpu_tensors_as_cuda(), unittest.mock.patch.object(
            kernels, "COUNTING_SORT_ON_CPU", True):
        yield


def _detsum_calls(t: dict) -> dict:
    calls = {}
    for mode in ("fp32", "kahan"):
        calls[f"index_add {mode} plan"] = lambda mode=mode: detsum.index_add(
            t["init"], 0, t["index"], t["src"], mode=mode, plan=t["plan"])
        calls[f"index_add_ {mode} plan"] = lambda mode=mode: detsum.index_add_(
            t["work"], 0, t["index"], t["src"], mode=mode, plan=t["plan"])
        calls[f"segment_sum {mode} plan"] = lambda mode=mode: detsum.segment_sum(
            t["src"], mode=mode, plan=t["plan"])
        calls[f"scatter_reduce {mode} plan"] = lambda mode=mode: detsum.scatter_reduce(
            t["init"], 0, t["index"], t["src"], "sum", mode=mode, plan=t["plan"])
    # Through torch's dispatcher, autograd recording the call (as in a training step).
    calls["index_add fp32 plan, source requiring grad"] = lambda: detsum.index_add(
        t["init"], 0, t["index"], t["src_requiring_grad"], plan=t["plan"])

    # Without a plan, check="off" (the others read or assert a flag that the stubbed launch
    # never writes): an unsorted index of at most CHUNK_TERMS values, scanned by the launch.
    calls["index_add fp32 no plan, off"] = lambda: detsum.index_add(
        t["init"], 0, t["index"], t["src"], check="off")
    calls["scatter_reduce amax no plan, off"] = lambda: detsum.scatter_reduce(
        t["init"], 0, t["index"], t["src"], "amax", check="off")
    calls["segment_sum fp32 no plan, off"] = lambda: detsum.segment_sum(
        t["src"], t["offsets"], check="off")
    # An index of more than NARROW_SORT_ABOVE values, sorted by counting as a GPU sorts it
    # (its table's fill and running sum run on the host's tensors here, a few microseconds).
    calls[f"index_add fp32 no plan, off, {LONG_ROWS} rows"] = lambda: detsum.index_add(
        t["init"], 0, t["long_index"], t["long_src"], check="off")
    calls[f"index_add_ fp32 no plan, off, {LONG_ROWS} rows"] = lambda: detsum.index_add_(
        t["work"], 0, t["long_index"], t["long_src"], check="off")
    calls[f"scatter_reduce sum no plan, off, {LONG_ROWS} rows"] = lambda: detsum.scatter_reduce(
        t["init"], 0, t["long_index"], t["long_src"], "sum", check="off")

    def permute_unpermute():
        rows = moe.permute(t["x"], t["routing"], TOPK)
        return moe.unpermute(rows, t["routing"], TOPK, weights=t["weights"])

    def moe_layer():
        routing = moe.route(t["selected"], EXPERTS)
        rows = moe.permute(t["x"], routing, TOPK)
        return moe.unpermute(rows, routing, TOPK, weights=t["weights"])

    def permute_unpermute_recorded():
        rows = moe.permute(t["x_requiring_grad"], t["routing"], TOPK)
        return moe.unpermute(rows, t["routing"], TOPK, weights=t["weights_requiring_grad"])

    calls["moe permute + unpermute, Routing given"] = permute_unpermute
    calls["moe permute + unpermute, x and weights requiring grad"] = permute_unpermute_recorded
    calls["moe layer: route + permute + unpermute"] = moe_layer
    return calls


def _launch_alone(t: dict) -> dict:
    """One launch of _segment_kernel with index_add's arguments (fp32 mode, a plan)."""
    src = t["src"].unsqueeze(0)
    out = src.new_empty(1, SEGMENTS, FEATURES)
    base = t["init"].unsqueeze(0)
    order = t["plan"].order
    offsets = t["plan"].offsets
    args = (src, *src.stride(), order, offsets, offsets, order.shape[0], 0, base,
            *base.stride(), out, *out.stride(), out, *out.stride(), out, out, out, out, 1, 1,
            SEGMENTS, FEATURES)
    constexprs = dict(REDUCE=kernels.SUM, RULE=kernels.WIDE, DATA=0, ACC=segment.tl.float32,
                      HAS_ORDER=True, HAS_BASE=True, USE_BASE=True, HAS_CARRY=False,
                      SCALED=False, SPLIT=False, CHUNKS_FIRST=False, FIRST_TERM_START=False,
                      NCOMP=1, CHUNK=kernels.CHUNK_TERMS, BOUNDS=segment._OFFSETS.value,
                      GUIDED=0, CHECK=segment._CHECK_NOTHING.value, BLOCK=16, SEGS=1)
    grid = (SEGMENTS, 1, 1)
    jitted = segment._segment_kernel
    kernel = launch.Kernel(jitted)

    def jitfunction_run():
        jitted[grid](*args, num_warps=1, enable_fp_fusion=False, **constexprs)

    def jitfunction_run_no_global_check():
        used_globals = jitted.used_global_vals
        jitted.used_global_vals = {}
        try:
            jitfunction_run()
        finally:
            jitted.used_global_vals = used_globals

    @triton.jit
    def write_one(out_ptr):
        tl.store(out_ptr, 1.0)

    # The launch's floor: a kernel of one argument, launched the same way (what the 29
    # arguments of _segment_kernel's launch add to it, on a GPU, is the launcher's work).
    one_argument = launch.Kernel(write_one)
    return {"kernel": lambda: kernel(grid, args, constexprs, num_warps=1),
            "one argument": lambda: one_argument((1,), (out,), {}, num_warps=1),
            "jitfunction_run": jitfunction_run,
            "jitfunction_run_no_global_check": jitfunction_run_no_global_check}


def _time_rounds(cases: dict, rounds: int, calls: int, synchronize) -> dict[str, list[float]]:
    """us per call of each case (name -> (call, launch path or None)) in each round; the
    cases take turns within a round, in an order shuffled each round (a case timed right
    after another runs a few microseconds slower or faster, whatever it is). ``synchronize``
    runs after each case's calls, untimed: a GPU's queue starts each case empty."""
    times = {name: [] for name in cases}
    direct_launch, pointers_as_ints = launch.DIRECT_LAUNCH, launch.POINTERS_AS_INTS
    launch_again, replay = detsum.plans.LAUNCH_AGAIN, detsum._replay.REPLAY
    order = list(cases)
    shuffle = random.Random(0).shuffle
    try:
        for _ in range(rounds + 1):  # the first round untimed: compiles, fills the caches
            shuffle(order)
            for name in order:
                fn, path = cases[name]
                launch.DIRECT_LAUNCH = path != "JITFunction.run"
                launch.POINTERS_AS_INTS = path != "direct, tensors"
                detsum.plans.LAUNCH_AGAIN = detsum._replay.REPLAY = path != "whole path"
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - start) / calls * 1e6)
                synchronize()
    finally:
        launch.DIRECT_LAUNCH, launch.POINTERS_AS_INTS = direct_launch, pointers_as_ints
        detsum.plans.LAUNCH_AGAIN, detsum._replay.REPLAY = launch_again, replay
    return {name: spent[1:] for name, spent in times.items()}


def _profile(call, calls: int = 5000) -> str:
    """cProfile's 25 functions with the most own time over ``calls`` calls of ``call``."""
    for _ in range(100):
        call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _summary(times: list[float], baseline: list[float]) -> dict:
    deciles = statistics.quantiles(times, n=10)
    ratios = [a / b for a, b in zip(times, baseline)]
    ratio_deciles = statistics.quantiles(ratios, n=10)
    return {"median_us": statistics.median(times), "p10_us": deciles[0],
            "p90_us": deciles[-1], "ratio_to_index_add_": statistics.median(ratios),
            "ratio_p10": ratio_deciles[0], "ratio_p90": ratio_deciles[-1]}


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--calls", type=int, default=20, help="calls per case and round")
    parser.add_argument("--note", default="", help="kept in the JSON (what was measured)")
    parser.add_argument("--json", type=pathlib.Path, help="default: benches/results/"
                        "cpu-host-launch-<date>.json (gpu-... with --cuda)")
    parser.add_argument("--cuda", action="store_true",
                        help="CUDA tensors and the real driver (a GPU machine), no stub")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile a call with a plan: its 25 costliest functions")
    args = parser.parse_args()
    _import_compiled()
    device = "cuda" if args.cuda else "cpu"
    if not args.cuda:
        triton_stub.install(record=False)
    t = _inputs(device)
    baseline = "torch.Tensor.index_add_"
    cases = {baseline: (lambda: t["work"].index_add_(0, t["index"], t["src"]), None)}
    if args.cuda:
        cases["torch.empty_like"] = (lambda: torch.empty_like(t["init"]), None)
    with _as_cuda(device):
        for name, fn in _detsum_calls(t).items():
            for path in ("direct", "JITFunction.run"):
                cases[f"{name} | {path}"] = fn, path
        calls = _detsum_calls(t)
        cases["index_add fp32 plan | direct, tensors"] = \
            calls["index_add fp32 plan"], "direct, tensors"
        for name in calls:
            if " plan" in name:
                cases[f"{name} | whole path"] = calls[name], "whole path"
        alone = _launch_alone(t)
        cases["_segment_kernel launch alone | direct"] = alone["kernel"], "direct"
        cases["a kernel of one argument, launch alone | direct"] = \
            alone["one argument"], "direct"
        cases["_segment_kernel launch alone | direct, tensors"] = \
            alone["kernel"], "direct, tensors"
        cases["_segment_kernel launch alone | JITFunction.run"] = \
            alone["jitfunction_run"], "JITFunction.run"
        cases["_segment_kernel launch alone | JITFunction.run, no global check"] = \
            alone["jitfunction_run_no_global_check"], "JITFunction.run"
        load_start = os.getloadavg()
        times = _time_rounds(cases, args.rounds, args.calls,
                             torch.cuda.synchronize if args.cuda else lambda: None)
        load_end = os.getloadavg()
        profile = _profile(_detsum_calls(t)["index_add fp32 plan"]) if args.profile else None

    results = {name: _summary(spent, times[baseline]) for name, spent in times.items()}
    width = max(map(len, results))
    print(f"host time per call, us: median (p10-p90 over {args.rounds} rounds of "
          f"{args.calls} calls); ratio: median (p10-p90) of the per-round ratio to {baseline}")
    for name, r in results.items():
        print(f"{name:{width}s}  {r['median_us']:7.1f} ({r['p10_us']:6.1f}-{r['p90_us']:6.1f})"
              f"  {r['ratio_to_index_add_']:6.2f} ({r['ratio_p10']:.2f}-{r['ratio_p90']:.2f})")
    print(f"load average at start / end: {load_start[0]:.2f} / {load_end[0]:.2f}")
    # Whether the direct launch was in use: a hook that some library installed in Triton's
    # knobs would send every launch through JITFunction.run, "direct" rows and all.
    direct_launch = {"DIRECT_LAUNCH": launch.DIRECT_LAUNCH,
                     "hooks_installed": launch._hooks_installed(segment._segment_kernel),
                     "specialisations_launched_directly": len(segment._launch_segment._compiled)}
    print(f"direct launch: {direct_launch}")
    if profile:
        print(profile)
    report = {
        "what": __doc__.splitlines()[0],
        "inputs": {"rows": ROWS, "segments": SEGMENTS, "features": FEATURES, "dtype": "fp32",
                   "moe_tokens": TOKENS, "moe_topk": TOPK, "moe_experts": EXPERTS},
        "note": args.note, "rounds": args.rounds, "calls_per_round": args.calls,
        "device": torch.cuda.get_device_name() if args.cuda else "stubbed (sm_90 kernels)",
        "baseline": baseline, "direct_launch": direct_launch,
        "profile_of_index_add_with_a_plan": profile,
        "results": results,
        "times_us": {name: [round(us, 2) for us in spent] for name, spent in times.items()},
        "environment": {"cpu": _cpu_name(),
                        "cores": os.cpu_count(), "torch": torch.__version__,
                        "triton": triton.__version__, "python": platform.python_version(),
                        "torch_threads": torch.get_num_threads(),
                        "load_average": {"start": load_start, "end": load_end}},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if args.json is None:
        args.json = ROOT / "benches" / "results" / (
            f"{device.replace('cuda', 'gpu')}-host-launch-{datetime.date.today().isoformat()}"
            ".json")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
