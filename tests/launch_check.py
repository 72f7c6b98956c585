"""Check detsum's direct Triton launches (kernels/triton/launch.py) against
``JITFunction.run``, with the kernels compiled for sm_90 and no GPU (tests/triton_stub.py).

Run by tests/test_triton_launch.py in a subprocess without TRITON_INTERPRET (under the
interpreter the kernels are not compiled). Prints one JSON object:

- ``keys``: per kernel, for launches that each change one property of a real launch's
  arguments (a tensor's alignment or dtype, an integer's value, a constexpr's value or
  type, ``num_warps``, a knob of Triton's), the keys that group them differently from the key
  Triton computes for the same arguments (``JITFunction.run``'s cache key, captured):
  ``unsafe`` lists launches with one detsum key and several Triton keys (a kernel compiled for
  other arguments would run), ``split`` the launches that detsum's key keeps apart from
  others of the same Triton key, and the counts of distinct keys each way;
- ``replays``: each launch of a set of detsum calls, replayed twice with the same argument
  objects through Kernels that start with an empty cache: how many times ``JITFunction.run``
  ran (once for a key not seen before, else never), and whether the launch ran the compiled
  kernel that ``JITFunction.run`` picks for those arguments, handing the driver the same
  arguments as it does, each tensor as its data pointer (``pointers_as_ints``);
- ``fallback``: each launch made twice through a Kernel that starts empty, with
  ``DIRECT_LAUNCH`` off and with a launch hook installed: how many times ``JITFunction.run``
  ran and the driver launched, each time, and how many times the hook was called;
- ``order_error``: the message when constexprs come in another order than the kernel's;
- ``tensors_when_pointers_off``: whether, with ``launch.POINTERS_AS_INTS`` off, every direct
  launch hands the driver the tensors themselves, as ``JITFunction.run`` does.
"""

from __future__ import annotations

import contextlib
import json
import sys
import unittest.mock

import torch
import triton
import triton.language as tl
import triton.runtime.jit as triton_jit
from triton import knobs

import triton_stub

import detsum
from detsum import kernels
from detsum.kernels.triton import chunks, launch, segment
from detsum.ops import index_add as index_add_module
from detsum.ops import segment_sum as segment_sum_module

# ---- the launches of some detsum calls ------------------------------------------------------

def _calls() -> list:
    """detsum calls that launch each kernel: with a plan in "fp32", "kahan" and "exact",
    long segments (folded in the launch), a misaligned source, bf16 data with alpha, a mean, CUDA's
    stride-1 rule."""
    gen = torch.Generator().manual_seed(0)
    rows, segments, features = 600, 7, 5
    index = torch.randint(0, segments, (rows,), generator=gen)
    src = torch.randn(rows, features, generator=gen)
    init = torch.randn(segments, features, generator=gen)
    misaligned = torch.randn(rows * features + 1, generator=gen)[1:].view(rows, features)
    plan = detsum.plan(index, segments)
    calls = [lambda mode=mode: detsum.index_add(init, 0, index, src, mode=mode, plan=plan)
             for mode in ("fp32", "kahan", "exact")]
    calls += [
        lambda: detsum.segment_sum(src, plan=plan),
        lambda: detsum.index_add(init, 0, index, misaligned, plan=plan),
        lambda: detsum.index_add(init, 0, index, src),  # chunks found and folded in the launch
        lambda: detsum.index_add(init.bfloat16(), 0, index, src.bfloat16(), alpha=0.5,
                                 plan=plan),
        lambda: detsum.scatter_reduce(init, 0, index, src, "mean", plan=plan),
    ]
    offsets = plan.offsets
    calls.append(lambda: segment.segment_reduce(
        src[:, :1].unsqueeze(0), plan.order, offsets, init[:, :1].unsqueeze(0),
        torch.empty(1, segments, 1), reduce=kernels.SUM, rule=kernels.CUDA_STRIDE_1,
        alpha=1.0, include_base=True))
    return calls


def recorded_launches() -> list[tuple]:
    """(Kernel, grid, args, num_warps, constexprs) of every launch of ``_calls()``."""
    launches = []
    call = launch.Kernel.__call__

    def record(self, grid, args, constexprs, *, num_warps, **options):
        launches.append((self, grid, args, num_warps, constexprs))
        return call(self, grid, args, constexprs, num_warps=num_warps, **options)

    with triton_stub.cpu_tensors_as_cuda(), \
            unittest.mock.patch.object(launch.Kernel, "__call__", record):
        for c in _calls():
            c()
    return launches


# ---- keys ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def triton_keys(into: list):
    """While on, ``JITFunction.run`` appends its cache key to ``into`` and compiles nothing
    (it returns None where it would compile, before any launch)."""
    compute = triton_jit.compute_cache_key

    def capture(*args, **kwargs):
        key = compute(*args, **kwargs)
        into.append(key)
        return key

    with unittest.mock.patch.object(triton_jit, "compute_cache_key", capture), \
            unittest.mock.patch.object(triton_jit.JITFunction, "_do_compile",
                                       lambda *args, **kwargs: None):
        yield


_INTS = (0, 1, 2, 3, 15, 16, 17, 48, -1, -16, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor whose data pointer is 16-byte aligned plus one element."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype)
    return buffer[1:].view(t.shape).copy_(t)


def _knob_variants():
    """(namespace, name, value) of each knob ``JITFunction.run`` puts in a launch's options,
    set to other than its default."""
    yield knobs.runtime, "debug", True
    yield knobs.compilation, "instrumentation_mode", "a profiler's"
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # from triton 3.9
        yield knobs.compilation, "fpsan_homomorphic_casts", True


def variants(args: tuple, num_warps: int, constexprs: dict):
    """(name, args, num_warps, constexprs, knob) launches, each one property away from the
    given one; ``knob``: None, or (namespace, name, value) to set during the launch."""
    yield "as recorded", args, num_warps, constexprs, None
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            yield f"arg {i} misaligned", args[:i] + (_misaligned(arg),) + args[i + 1:], \
                num_warps, constexprs, None
            other = torch.float64 if arg.dtype != torch.float64 else torch.float32
            yield f"arg {i} {other}", args[:i] + (arg.to(other),) + args[i + 1:], \
                num_warps, constexprs, None
        else:
            for value in _INTS:
                yield f"arg {i} = {value}", args[:i] + (value,) + args[i + 1:], num_warps, \
                    constexprs, None
    for name, value in constexprs.items():
        if isinstance(value, bool):
            # Equal in Python, yet a different specialisation for Triton.
            yield f"{name} as int", args, num_warps, dict(constexprs, **{name: int(value)}), \
                None
            yield f"{name} flipped", args, num_warps, dict(constexprs, **{name: not value}), \
                None
        elif isinstance(value, int):
            yield f"{name} + 1", args, num_warps, dict(constexprs, **{name: value + 1}), None
            yield f"{name} as float", args, num_warps, \
                dict(constexprs, **{name: float(value)}), None
        elif isinstance(value, tl.dtype):
            other = tl.float64 if value != tl.float64 else tl.float32
            yield f"{name} {other}", args, num_warps, dict(constexprs, **{name: other}), None
    yield "num_warps * 2", args, num_warps * 2, constexprs, None
    for knob in _knob_variants():
        yield f"knob {knob[1]}", args, num_warps, constexprs, knob


def check_keys(launches) -> dict:
    found = {}
    seen_kernels = set()
    for kernel, grid, args, num_warps, constexprs in launches:
        name = kernel.jitted.fn.__name__
        if name in seen_kernels:
            continue  # one recorded launch per kernel: its variants cover the properties
        seen_kernels.add(name)
        # The key a Kernel computes: made for the layout of its first launch's arguments.
        layout_key = launch.key_for_layout(args)
        ours_to_triton: dict[tuple, set] = {}
        triton_to_ours: dict[str, set] = {}
        names: dict[tuple, list] = {}
        for label, v_args, v_warps, v_constexprs, knob in variants(args, num_warps,
                                                                   constexprs):
            triton_key = []
            with contextlib.ExitStack() as stack:
                if knob is not None:
                    stack.enter_context(unittest.mock.patch.object(*knob))
                ours, _ = layout_key(0, v_warps, v_constexprs.values(), v_args)
                with triton_keys(triton_key):
                    kernel.jitted.run(*v_args, grid=grid, warmup=True, num_warps=v_warps,
                                      enable_fp_fusion=False, **v_constexprs)
            (triton_key,) = triton_key
            ours_to_triton.setdefault(ours, set()).add(triton_key)
            triton_to_ours.setdefault(triton_key, set()).add(ours)
            names.setdefault(ours, []).append(label)
        # Finer than Triton's is safe (one more compiled kernel looked up): where detsum's key
        # splits one of Triton's, the launches apart from the main group.
        split = [names[ours] for group in triton_to_ours.values() if len(group) > 1
                 for ours in sorted(group, key=lambda k: -len(names[k]))[1:]]
        found[name] = {
            "launches": sum(len(v) for v in names.values()),
            "unsafe": [names[ours] for ours, keys in ours_to_triton.items() if len(keys) > 1],
            "detsum_keys": len(ours_to_triton),
            "triton_keys": len(triton_to_ours),
            "split": split,
        }
    found["kernels"] = sorted(seen_kernels)
    return found


# ---- replays -------------------------------------------------------------------------------------

class _Counted:
    """Counts the calls of one JITFunction's ``run`` (an instance attribute in front of it)."""

    def __init__(self, jitted):
        self.jitted, self.calls = jitted, 0

    def __enter__(self):
        run = self.jitted.run

        def counted(*args, **kwargs):
            self.calls += 1
            return run(*args, **kwargs)

        self.jitted.run = counted
        return self

    def __exit__(self, *exc):
        del self.jitted.run


def _driver_calls(kernel, grid, args, num_warps, constexprs, how) -> tuple[list, int]:
    """The driver's launches, and JITFunction.run's count, of one launch made ``how``."""
    triton_stub.LAUNCHES.clear()
    with _Counted(kernel.jitted) as counted:
        if how == "JITFunction.run":
            kernel.jitted[grid](*args, num_warps=num_warps, enable_fp_fusion=False,
                                **constexprs)
        else:
            kernel(grid, args, constexprs, num_warps=num_warps)
    return list(triton_stub.LAUNCHES), counted.calls


def _idle(hooks_and_metadata: tuple) -> bool:
    """Whether a launch's metadata and hooks do nothing: None (a direct launch), or hooks
    that call nothing (JITFunction.run's, when no hook is installed)."""
    _, *hooks = hooks_and_metadata
    return all(hook is None or not getattr(hook, "calls", True) for hook in hooks)


_HEAD = 6  # a driver call's grid x, y, z, stream, function, packed metadata


def _same_argument(ours, theirs) -> bool:
    """A direct launch's argument against JITFunction.run's: the same object, or, for a
    tensor, its data pointer (``launch.POINTERS_AS_INTS``), which Triton's launcher takes as
    the address it would read from the tensor."""
    if isinstance(theirs, torch.Tensor) and type(ours) is int:
        return ours == theirs.data_ptr()
    return ours is theirs


def _same_driver_call(ours: tuple, triton_call: tuple) -> bool:
    """Same launcher (the same compiled kernel) and the same arguments (``_same_argument``),
    but for the launch metadata and hooks, which only need to do nothing."""
    (our_launcher, our_args), (their_launcher, their_args) = ours, triton_call
    head = _HEAD
    return (our_launcher is their_launcher and len(our_args) == len(their_args)
            and our_args[:head] == their_args[:head]
            and _idle(our_args[head:head + 3]) and _idle(their_args[head:head + 3])
            and all(map(_same_argument, our_args[head + 3:], their_args[head + 3:])))


def _tensors_as_ints(ours: tuple, triton_call: tuple) -> bool:
    """Whether the direct launch handed every tensor of JITFunction.run's as an int."""
    return all(type(a) is int for a, b in zip(ours[1][_HEAD + 3:], triton_call[1][_HEAD + 3:])
               if isinstance(b, torch.Tensor))


def _tensors_as_tensors(ours: tuple, triton_call: tuple) -> bool:
    return all(a is b for a, b in zip(ours[1][_HEAD + 3:], triton_call[1][_HEAD + 3:])
               if isinstance(b, torch.Tensor))


def check_replays(launches) -> list[dict]:
    """Every launch replayed twice in order through Kernels that start empty and are shared
    by all the launches (so a launch can find another's entry), each time beside the same
    launch through JITFunction.run."""
    fresh: dict[str, launch.Kernel] = {}
    results = []
    for replay in (1, 2):
        for kernel, grid, args, num_warps, constexprs in launches:
            name = kernel.jitted.fn.__name__
            ours = fresh.setdefault(name, launch.Kernel(kernel.jitted))
            direct, runs = _driver_calls(ours, grid, args, num_warps, constexprs, "direct")
            triton_call, _ = _driver_calls(kernel, grid, args, num_warps, constexprs,
                                           "JITFunction.run")
            picked = kernel.jitted.run(*args, grid=grid, warmup=True, num_warps=num_warps,
                                       enable_fp_fusion=False, **constexprs)
            results.append({
                "replay": replay, "kernel": name, "jitfunction_runs": runs,
                "driver_launches": [len(direct), len(triton_call)],
                "same_as_jitfunction_run": (len(direct) == len(triton_call) == 1
                                            and _same_driver_call(direct[0], triton_call[0])),
                "kernel_triton_picks": len(direct) == 1 and picked.run is direct[0][0],
                "pointers_as_ints": (len(direct) == len(triton_call) == 1
                                     and _tensors_as_ints(direct[0], triton_call[0])),
            })
    return results


def check_pointers_off(launches) -> bool:
    """With POINTERS_AS_INTS off, every direct launch hands the driver the tensors themselves,
    as JITFunction.run does."""
    same = []
    with unittest.mock.patch.object(launch, "POINTERS_AS_INTS", False):
        for kernel, grid, args, num_warps, constexprs in launches:
            ours = launch.Kernel(kernel.jitted)
            _driver_calls(ours, grid, args, num_warps, constexprs, "direct")  # compiles
            direct, runs = _driver_calls(ours, grid, args, num_warps, constexprs, "direct")
            triton_call, _ = _driver_calls(kernel, grid, args, num_warps, constexprs,
                                           "JITFunction.run")
            same.append(runs == 0 and len(direct) == len(triton_call) == 1
                        and _same_driver_call(direct[0], triton_call[0])
                        and _tensors_as_tensors(direct[0], triton_call[0]))
    return bool(same) and all(same)


def _twice_through_an_empty_kernel(kernel, grid, args, num_warps, constexprs) -> list[int]:
    """JITFunction.run's count and the driver's launches, of the first and second launch."""
    fresh = launch.Kernel(kernel.jitted)
    first, second = (_driver_calls(fresh, grid, args, num_warps, constexprs, "direct")
                     for _ in range(2))
    return [first[1], second[1], len(first[0]), len(second[0])]


def check_fallback(launches) -> dict:
    with unittest.mock.patch.object(launch, "DIRECT_LAUNCH", False):
        off = [_twice_through_an_empty_kernel(*recorded) for recorded in launches]
    calls = []

    def hook(metadata):
        calls.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        hooked = [_twice_through_an_empty_kernel(*recorded) for recorded in launches]
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    return {"direct_launch_off": off, "launch_hook": hooked, "hook_calls": len(calls),
            "launches": len(launches)}


def check_order_error(launches) -> str:
    kernel, grid, args, num_warps, constexprs = launches[0]
    reordered = dict(reversed(list(constexprs.items())))
    try:
        kernel(grid, args, reordered, num_warps=num_warps)
    except TypeError as error:
        return str(error)
    return ""


# ---- a plan's call, launched again ----------------------------------------------------------

def _plan_calls():
    """(name, call, make) of calls with a plan: ``call(tensors)`` makes the call on the
    tensors that ``make(seed)`` returns, new ones of the same layout for each seed. Each
    crosses a feature that shapes the launch: long segments (a workspace and ticket counters
    held), alpha (its tensor held), in place, outer rows, one feature, a strided source, each
    mode, a sorted plan, ``segment_sum`` and ``scatter_reduce`` (a mean, a maximum, a
    minimum, without the input), a source that requires grad (the call through torch's
    dispatcher, autograd recording it), outputs NaN-filled before the launch
    (``_segments.POISON_OUTPUTS``); and calls not to be launched again: "exact", in place
    into a strided input, an op after the launch, a workspace over ``HELD_WORKSPACE_BYTES``,
    offsets a consumer built for one call."""
    segments = 7
    index = torch.randint(0, segments, (600,), generator=torch.Generator().manual_seed(1))
    short = index[:200].clone()
    index[::2] = 0  # segment 0 longer than a chunk: chunk programs, a workspace, counters
    long, short_plan = detsum.plan(index, segments), detsum.plan(short, segments)
    sorted_plan = detsum.plan(short.sort().values, segments, sorted=True)
    # Plans of their own: their calls never find the other cases' records.
    long_apart, short_apart = detsum.plan(index, segments), detsum.plan(short, segments)

    def data(seed, *shapes, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]

    def two(seed):  # input and source of the long index
        return data(seed, (segments, 5), (600, 5))

    def one(seed):  # input and source of the short index
        return data(seed, (segments, 5), (200, 5))

    def index_add(plan, shapes, dim=0, dtype=torch.float32, **options):
        def call(t):
            return detsum.index_add(t[0], dim, plan.index, t[1], plan=plan, **options)
        return call, lambda seed: data(seed, *shapes, dtype=dtype)

    def strided(seed):
        init, src = data(seed, (segments, 5), (200, 10))
        return [init, src[:, ::2]]

    def strided_input(seed):
        init, src = two(seed)
        return [init.t().contiguous().t(), src]

    def requiring_grad(seed):
        init, src = two(seed)
        return [init, src.requires_grad_()]

    def in_place(t):
        return detsum.index_add_(t[0], 0, index, t[1], plan=long)

    def poisoned(call):
        def called(t):
            with unittest.mock.patch.object(detsum._segments, "POISON_OUTPUTS", True):
                return call(t)
        return called

    def an_op_after_the_launch(t):
        body = index_add_module._run

        def body_then_an_op(*args, **options):
            return body(*args, **options).add_(0)

        with unittest.mock.patch.object(index_add_module, "_run", body_then_an_op):
            return detsum.index_add(t[0], 0, short, t[1], plan=short_apart)

    def workspace_over_the_held_bytes(t):
        with unittest.mock.patch.object(segment, "HELD_WORKSPACE_BYTES", 64):
            return detsum.index_add(t[0], 0, index, t[1], plan=long_apart)

    def offsets_a_consumer_built(t):
        # As an MoE backward sums a token's rows: a plan's tensors, but offsets built for the
        # one call (a new tensor each time), which keep no launches.
        offsets = short_plan.offsets.clone()
        return segment_sum_module.call_segment_sum(t[1], offsets, 0, short_plan.order, "fp32",
                                                   "off", short_plan.index, None, 0)

    fp32_short = index_add(short_plan, [(segments, 5), (200, 5)])[0]
    cases = {
        "fp32, long segments": index_add(long, [(segments, 5), (600, 5)]),
        "fp32, short segments": (fp32_short, one),
        "kahan bf16, alpha": index_add(long, [(segments, 5), (600, 5)], dtype=torch.bfloat16,
                                       mode="kahan", alpha=0.5),
        "autograd fp16": index_add(short_plan, [(segments, 5), (200, 5)],
                                   dtype=torch.float16, mode="autograd"),
        "fp32, outer rows (dim=1)": index_add(short_plan, [(3, segments, 4), (3, 200, 4)],
                                              dim=1),
        "fp32, one feature": index_add(short_plan, [(segments, 1), (200, 1)]),
        "fp64, sorted plan": index_add(sorted_plan, [(segments, 5), (200, 5)],
                                       dtype=torch.float64),
        "fp32, strided source": (fp32_short, strided),
        "in place": (in_place, two),
        "fp32, outputs poisoned": (poisoned(fp32_short), one),
        "segment_sum, outputs poisoned": (
            poisoned(lambda t: detsum.segment_sum(t[1], plan=short_plan)), one),
        # Recorded by autograd: through torch's dispatcher to the primitive's body.
        "fp32, source requiring grad": (index_add(long, [])[0], requiring_grad),
        "segment_sum, source requiring grad": (
            lambda t: detsum.segment_sum(t[1], plan=long), requiring_grad),
        "scatter_reduce amin, source requiring grad": (
            lambda t: detsum.scatter_reduce(t[0], 0, index, t[1], "amin", plan=long),
            requiring_grad),
        "segment_sum, long segments": (lambda t: detsum.segment_sum(t[1], plan=long), two),
        "segment_sum kahan, outer rows": (
            lambda t: detsum.segment_sum(t[1], dim=1, mode="kahan", plan=short_plan),
            lambda seed: data(seed, (3, segments, 4), (3, 200, 4))),
        # Not to be launched again.
        "exact": index_add(short_plan, [(segments, 5), (200, 5)], mode="exact"),
        "in place, strided input": (in_place, strided_input),
        "an op after the launch": (an_op_after_the_launch, one),
        "workspace over HELD_WORKSPACE_BYTES": (workspace_over_the_held_bytes, two),
        "offsets a consumer built": (offsets_a_consumer_built, one),
    }
    for reduce, include_self in (("sum", True), ("mean", False), ("amax", True)):
        cases[f"scatter_reduce {reduce}, include_self={include_self}"] = (
            lambda t, reduce=reduce, include_self=include_self: detsum.scatter_reduce(
                t[0], 0, index, t[1], reduce, include_self=include_self, plan=long), two)
    return [(name, call, make) for name, (call, make) in cases.items()]


def _driver_calls_of(call, tensors, recorded_launches: bool = True) -> dict:
    """What ``call(tensors)`` did: the driver's launches, its result (the input of a call in
    place), how many launches reached ``Kernel``, the ``Relaunch`` that launched again (None
    where none did), the record of each direct launch (``launch.recording``; none without
    ``recorded_launches``, in which block a replay's launches would go through ``Kernel``),
    and how many times the call tried to record its launch for later (``plans.record_launch``)."""
    kernel_calls, relaunches, records = [], [], []
    direct, again = launch.Kernel.__call__, launch.Relaunch.__call__
    record = detsum.plans.record_launch

    def recorded(*args):
        records.append(args[0])
        return record(*args)

    def counted(self, *args, **options):
        kernel_calls.append(self)
        return direct(self, *args, **options)

    def relaunched(self, pointers):
        launched = again(self, pointers)
        relaunches.extend([self] if launched else [])
        return launched

    triton_stub.LAUNCHES.clear()
    with unittest.mock.patch.object(launch.Kernel, "__call__", counted), \
            unittest.mock.patch.object(launch.Relaunch, "__call__", relaunched), \
            unittest.mock.patch.object(detsum.plans, "record_launch", recorded), \
            (launch.recording() if recorded_launches else contextlib.nullcontext([])) as made:
        result = call(tensors)
    return {"driver": list(triton_stub.LAUNCHES),
            "output": tensors[0] if result is None else result,
            "kernel_calls": len(kernel_calls), "relaunch": relaunches[0] if relaunches else None,
            "records": made, "recorded": len(records)}


def _as_compared(driver_calls: list, output) -> list:
    """Driver calls as what the kernel receives: the launcher (the compiled kernel), grid,
    stream, function and packed metadata, then each argument, a tensor as its data pointer
    (what the launcher takes of it), the output's named, not given (each call allocates its
    own); not the launch metadata and hooks (JITFunction.run's, on a kernel's first launch
    or with a hook installed, are new objects at each call)."""
    out = output.data_ptr()
    compared = []
    for launcher, args in driver_calls:
        pointers = [arg.data_ptr() if isinstance(arg, torch.Tensor) else arg
                    for arg in args[_HEAD + 3:]]
        compared.append((launcher, args[:_HEAD],
                         tuple("the output" if type(arg) is int and arg == out else arg
                               for arg in pointers)))
    return compared


def _same_but_held(again: dict, whole: dict) -> bool:
    """Whether a relaunch handed the driver what the whole path did for the same tensors,
    but for the tensors it holds where the whole path made new ones: each of the same dtype
    and shape, and the same values but for a workspace (alpha, the ticket counters)."""
    relaunch, (record,) = again["relaunch"], whole["records"]
    (launcher, head, ours), (their_launcher, their_head, theirs) = (
        _as_compared(again["driver"], again["output"])
        + _as_compared(whole["driver"], whole["output"]))
    if (launcher, head, len(ours)) != (their_launcher, their_head, len(theirs)):
        return False
    held = {t.data_ptr(): t for t in relaunch.holds}
    for ours_i, theirs_i, made in zip(ours, theirs, record.args):
        if ours_i == theirs_i:
            continue
        mine = held.get(ours_i)
        if (mine is None or not isinstance(made, torch.Tensor)
                or (mine.dtype, mine.shape) != (made.dtype, made.shape)):
            return False
        workspace = mine.is_floating_point() and mine.numel() > 1
        if not workspace and not torch.equal(mine, made):
            return False
    return True


def _launch_again_and_whole(call, tensors) -> dict:
    """One call launched again where it can be (its record made by the calls before) beside
    the same call on the whole path (``plans.LAUNCH_AGAIN`` off)."""
    again = _driver_calls_of(call, tensors)
    with unittest.mock.patch.object(detsum.plans, "LAUNCH_AGAIN", False):
        whole = _driver_calls_of(call, tensors)
    launched_again = again["kernel_calls"] == 0 and again["relaunch"] is not None
    outputs = again["output"], whole["output"]
    return {"launched_again": launched_again and len(again["driver"]) == 1,
            "same_driver_calls": (_same_but_held(again, whole) if launched_again
                                  else _as_compared(again["driver"], outputs[0])
                                  == _as_compared(whole["driver"], outputs[1])),
            "same_output_layout": len({(t.shape, t.stride(), t.dtype) for t in outputs}) == 1,
            "held": ([str(t.dtype) for t in again["relaunch"].holds] if launched_again
                     else None),
            "tried_to_record": again["recorded"] > 0}


@contextlib.contextmanager
def _stream(number: int):
    with unittest.mock.patch.object(triton_stub.StubDriver, "get_current_stream",
                                    lambda self, device=None: number):
        yield


def check_launches_again() -> dict:
    """Each of ``_plan_calls`` made on new tensors three times (a kernel's first launch goes
    through JITFunction.run, the second is recorded), the third beside the whole path; then,
    after records, the calls that a relaunch must refuse: a source aligned otherwise than
    the record's, another stream, a launch hook, another TILE_BYTES or GUIDED_CHUNKS."""
    cases = {}
    with triton_stub.cpu_tensors_as_cuda():
        for name, call, make in _plan_calls():
            call(make(0))
            call(make(1))
            cases[name] = _launch_again_and_whole(call, make(2))
        name, call, make = _plan_calls()[1]  # fp32, short segments
        call(make(0))
        call(make(1))
        refused = {}
        init, src = make(3)
        refused["source aligned otherwise"] = _launch_again_and_whole(
            call, [init, _misaligned(src)])
        call(make(4))  # recorded again, with an aligned source
        with _stream(7):
            refused["another stream"] = _launch_again_and_whole(call, make(5))
        call(make(6))
        knobs.runtime.launch_enter_hook.add(_no_hook)
        try:
            refused["a launch hook"] = _launch_again_and_whole(call, make(7))
        finally:
            knobs.runtime.launch_enter_hook.remove(_no_hook)
        call(make(8))
        with unittest.mock.patch.object(segment, "TILE_BYTES", 0):
            refused["TILE_BYTES 0"] = _launch_again_and_whole(call, make(9))
        call(make(10))
        with unittest.mock.patch.object(chunks, "GUIDED_CHUNKS", False):
            refused["GUIDED_CHUNKS off"] = _launch_again_and_whole(call, make(11))
        in_turn = _widths_in_turn()
        alignments = _alignments_in_turn()
    return {"cases": cases, "refused": refused, "widths_in_turn": in_turn,
            "alignments_in_turn": alignments}


def _alignments_in_turn() -> list[dict]:
    """Whether each call launched again, and tried to record, of calls on one plan whose
    source is 16-byte aligned and one element off in turn, four rounds."""
    index = torch.randint(0, 7, (200,), generator=torch.Generator().manual_seed(3))
    plan = detsum.plan(index, 7)
    found = []
    for _ in range(4):
        for misaligned in (False, True):
            src, init = torch.randn(200, 5), torch.randn(7, 5)
            call = _driver_calls_of(
                lambda t: detsum.index_add(t[0], 0, index, t[1], plan=plan),
                [init, _misaligned(src) if misaligned else src])
            found.append({"launched_again": call["relaunch"] is not None,
                          "tried_to_record": call["recorded"] > 0})
    return found


def _widths_in_turn() -> list[bool]:
    """Whether each call launched again, of two layers' calls in turn on one plan, rows of 5
    and of 9 features (two signatures), four rounds."""
    index = torch.randint(0, 7, (200,), generator=torch.Generator().manual_seed(2))
    plan = detsum.plan(index, 7)
    launched_again = []
    for _ in range(4):
        for features in (5, 9):
            src, init = torch.randn(200, features), torch.randn(7, features)
            found = _driver_calls_of(
                lambda t: detsum.index_add(t[0], 0, index, t[1], plan=plan), [init, src])
            launched_again.append(found["relaunch"] is not None)
    return launched_again


def _no_hook(metadata):
    pass


# ---- a call without a plan, made again from its tape ----------------------------------------

def _unplanned_calls():
    """(name, call, make) of calls without a plan at check="off" on a GPU's path, as
    ``_plan_calls``: long segments (a workspace, ticket counters), an index scanned unsorted,
    in place, bf16 with alpha (its tensor, bf16 views), outer rows, a misaligned source, an
    int32 index, torch's sort (no counting sort)."""
    segments = 7

    def data(seed, *shapes, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(*shape, generator=gen).to(dtype) for shape in shapes]

    def index_of(rows, dtype=torch.int64, long=True):
        index = torch.randint(0, segments, (rows,), generator=torch.Generator().manual_seed(4))
        if long:
            index[::2] = 0  # segment 0 longer than a chunk
        return index.to(dtype)

    long, short, narrow = index_of(600), index_of(200, long=False), index_of(600, torch.int32)

    def index_add(index, dim=0, **options):
        return lambda t: detsum.index_add(t[0], dim, index, t[1], check="off", **options)

    def misaligned(seed):
        init, src = data(seed, (segments, 5), (600, 5))
        return [init, _misaligned(src)]

    def torch_sort(call):
        def sorted_by_torch(t):
            with unittest.mock.patch.object(kernels, "COUNTING_SORT_ON_CPU", False):
                return call(t)
        return sorted_by_torch

    two = lambda seed: data(seed, (segments, 5), (600, 5))  # noqa: E731
    cases = {
        "fp32, long segment": (index_add(long), two),
        "fp32, scanned": (index_add(short), lambda seed: data(seed, (segments, 5), (200, 5))),
        "in place": (lambda t: detsum.index_add_(t[0], 0, long, t[1], check="off"), two),
        "kahan bf16, alpha": (index_add(long, mode="kahan", alpha=0.5),
                              lambda seed: data(seed, (segments, 5), (600, 5),
                                                dtype=torch.bfloat16)),
        "outer rows": (index_add(long, dim=1),
                       lambda seed: data(seed, (3, segments, 4), (3, 600, 4))),
        "misaligned source": (index_add(long), misaligned),
        "int32 index": (index_add(narrow), two),
        "torch's sort": (torch_sort(index_add(long, mode="kahan")), two),
    }
    return [(name, call, make) for name, (call, make) in cases.items()]


def _as_matched(again: list, whole: list, named: dict) -> bool:
    """Whether two calls' driver calls match: the same kernels, grids and integers, the call's
    own tensors (``named``: pointer -> name, each call's) in the same places, and every other
    tensor (one the call made) in the same places as one other of the other call's, while it
    is in use (from its first launch to its last)."""
    if len(again) != len(whole):
        return False
    # Each pair of made tensors' addresses, with the first and last launch that passes it.
    spans = {}
    for launch_number, ((launcher, args), (their_launcher, their_args)) in enumerate(
            zip(again, whole)):
        if launcher is not their_launcher or args[:_HEAD] != their_args[:_HEAD]:
            return False
        for ours, theirs in zip(args[_HEAD + 3:], their_args[_HEAD + 3:], strict=True):
            ours_name, theirs_name = named[0].get(ours), named[1].get(theirs)
            if ours_name is not None or theirs_name is not None:
                if ours_name != theirs_name:
                    return False
            else:
                spans.setdefault((ours, theirs), [launch_number, launch_number])[1] = \
                    launch_number
    # A tensor the call made again passes (its tape's workspace, one place each) is one of
    # the whole path's. An address of the whole path may stand for two of the call's in turn
    # (its allocator giving a dead temporary's memory to a later one), never at once.
    if len({ours for ours, _ in spans}) != len(spans):
        return False
    by_address = {}
    for (_, theirs), span in spans.items():
        by_address.setdefault(theirs, []).append(span)
    for in_turn in by_address.values():
        in_turn.sort()
        if any(earlier[1] >= later[0] for earlier, later in zip(in_turn, in_turn[1:])):
            return False
    return True


def check_calls_made_again() -> dict:
    """Each of ``_unplanned_calls`` made on new tensors twice (seen, then recorded), then made
    again from its tape beside its whole path (``_replay.REPLAY`` off) on the same tensors, the
    index sorted by counting at any size (as a GPU's above ``NARROW_SORT_ABOVE`` keys):
    whether it was made again, with no launch through ``Kernel``, handing the driver what the
    whole path hands it."""
    cases = {}
    with triton_stub.cpu_tensors_as_cuda(), \
            unittest.mock.patch.object(kernels, "COUNTING_SORT_ON_CPU", True), \
            unittest.mock.patch.object(kernels, "NARROW_SORT_ABOVE", 0):
        for name, call, make in _unplanned_calls():
            call(make(0))
            call(make(1))
            tensors = make(2)
            found = []
            for replay in (True, False):
                with unittest.mock.patch.object(detsum._replay, "REPLAY", replay):
                    found.append(_driver_calls_of(call, tensors, recorded_launches=False))
            again, whole = found
            named = [{t.data_ptr(): f"argument {i}" for i, t in enumerate(tensors)}
                     for _ in range(2)]
            for names, calls in zip(named, found):
                names[calls["output"].data_ptr()] = "the output"
            cases[name] = {"kernel_calls": again["kernel_calls"],
                           "launches": len(again["driver"]),
                           "same_driver_calls": _as_matched(again["driver"], whole["driver"],
                                                            named)}
    return cases


def main() -> dict:
    triton_stub.install()
    launches = recorded_launches()
    return {"triton": triton.__version__, "direct_launch": launch.DIRECT_LAUNCH,
            "keys": check_keys(launches), "replays": check_replays(launches),
            "fallback": check_fallback(launches), "order_error": check_order_error(launches),
            "tensors_when_pointers_off": check_pointers_off(launches),
            "launches_again": check_launches_again(),
            "calls_made_again": check_calls_made_again()}


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.stdout.flush()
