"""Compile detsum's Triton kernels for an H100/H200 (sm_90) without a GPU and count, in the PTX,
the instructions that would break the contract: fused multiply-adds and non-IEEE divisions;
and, in a launch as ``segment_reduce`` makes it, how many term rows the term loop has in flight.

Run by tests/test_triton.py in a subprocess without TRITON_INTERPRET (under the interpreter,
``triton.jit`` gives interpreted functions, which cannot be compiled). Prints one JSON object:
{config name: {"fma": count, "divisions": [kinds], ...}}.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from detsum import kernels
from detsum.kernels.triton import chunks, common, counting_sort, exact, moe, segment, stride1

TARGET = GPUTarget("cuda", 90, 32)


def _ptx(fn, types: dict, constexprs: dict, *, fp_fusion: bool, num_warps: int = 4) -> str:
    signature = dict(types, **{name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": num_warps, "enable_fp_fusion": fp_fusion})
    return compiled.asm["ptx"]


def _segment_types(data: str, acc: str) -> dict:
    ints = {name: "i64" for name in ("ss0", "ss1", "ss2", "bs0", "bs1", "bs2", "os0", "os1",
                                     "os2", "cs0", "cs1", "cs2", "positions", "n_parts",
                                     "checkers", "outer", "nseg", "inner")}
    return dict(ints, src_ptr=f"*{data}", base_ptr=f"*{data}", out_ptr=f"*{data}",
                carry_ptr=f"*{acc}", order_ptr="*i64", bounds_ptr="*i64", keys_ptr="*i64",
                work_ptr=f"*{acc}", alpha_ptr=f"*{acc}", flag_ptr=f"*{acc}",
                counters_ptr="*i64")


def _segment_config(reduce, rule, data_code, acc, scaled, block, *, carry=False):
    return dict(REDUCE=reduce, RULE=rule, DATA=data_code, ACC=acc, HAS_ORDER=True,
                HAS_BASE=True, USE_BASE=True, HAS_CARRY=carry, SCALED=scaled,
                SPLIT=rule in kernels.SPLIT_RULES,
                CHUNKS_FIRST=rule in kernels.SPLIT_RULES and chunks.CHUNKS_FIRST,
                FIRST_TERM_START=False, NCOMP=2 if rule == kernels.KAHAN else 1,
                CHUNK=kernels.CHUNK_TERMS, BOUNDS=segment._OFFSETS.value,
                GUIDED=chunks._UNGUIDED.value,
                CHECK=segment._CHECK_NOTHING.value, BLOCK=block, SEGS=1)


def _exact_types(data: str, acc: str) -> dict:
    ints = {name: "i64" for name in ("ss0", "ss1", "ss2", "bs0", "bs1", "bs2", "os0", "os1",
                                     "os2", "positions", "n_parts", "outer", "nseg", "inner")}
    return dict(ints, src_ptr=f"*{data}", base_ptr=f"*{data}", out_ptr=f"*{data}",
                order_ptr="*i64", offsets_ptr="*i64", alpha_ptr=f"*{acc}", work_ptr="*i32",
                counters_ptr="*i64")


def _exact_config(reduce, dtype, scaled, block):
    precision, min_quantum, unit_exponent, n_limbs = exact._EXACT_TARGETS[dtype]
    return dict(REDUCE=reduce, DATA=common._DATA_CODES[dtype], ACC=common._tl_acc(dtype),
                HAS_ORDER=True, HAS_BASE=True, USE_BASE=True, SCALED=scaled, HEADROOM=2.0**28,
                PRECISION=precision, MIN_QUANTUM=min_quantum, UNIT_EXPONENT=unit_exponent,
                N_LIMBS=n_limbs, LANES=triton.next_power_of_2(n_limbs + 1),
                NORMALISE_EVERY=kernels.NORMALISE_EVERY, SPLIT=True,
                CHUNKS_FIRST=chunks.CHUNKS_FIRST, CHUNK=exact._EXACT_CHUNK_TERMS, BLOCK=block)


def _count(ptx: str) -> dict:
    return {"fma": len(re.findall(r"\bfma\.", ptx)),
            "divisions": sorted(set(re.findall(r"\bdiv\.[a-z.]*f(?:32|64)", ptx))),
            **_tickets(ptx)}


def _tickets(ptx: str) -> dict:
    """The atomics (the tickets of the chunk programs and of the checkers) by their form, and
    for each, whether a barrier (``bar.sync``) comes after the last global store before it:
    the stores of every thread of the program then precede the ticket."""
    atomics, fenced = [], []
    last_store = last_barrier = -1
    for number, line in enumerate(ptx.splitlines()):
        if re.search(r"\bst\.global\b", line):
            last_store = number
        elif re.search(r"\bbar\.sync\b", line):
            last_barrier = number
        found = re.search(r"\batom\.[a-z0-9_.]+", line)
        if found:
            atomics.append(found.group())
            fenced.append(last_barrier > last_store)
    return {"atomics": sorted(set(atomics)), "barrier_before_each_atomic": all(fenced),
            "cg_loads": len(re.findall(r"\bld\.global\.cg\.", ptx))}


def _barrier_after_first_stores(ptx: str) -> bool:
    """Whether a barrier (``bar.sync``) comes after the first global store and before the
    first global load after it: the stores before it, of every thread of the program, land
    before anything the program stores once it has read (a barrier that only a later
    reduction makes, after the loads, does not count)."""
    lines = ptx.splitlines()
    stores = [number for number, line in enumerate(lines) if re.search(r"\bst\.global\b", line)]
    if not stores:
        return False
    loads = [number for number, line in enumerate(lines)
             if number > stores[0] and re.search(r"\bld\.global\b", line)]
    barriers = [number for number, line in enumerate(lines) if re.search(r"\bbar\.sync\b", line)]
    return any(stores[0] < barrier < (loads[0] if loads else len(lines)) for barrier in barriers)


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_WAIT = re.compile(r"\bcp\.async\.wait_group\s+(\d+)")
_COMMIT = re.compile(r"\bcp\.async\.commit_group\b")
# An asynchronous copy and its size in bytes.
_COPY = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\s+\[[^]]*\],\s*\[[^]]*\],\s*"
                   r"(0x[0-9a-f]+|\d+)")


def _inner_loops(ptx: str) -> list[list[str]]:
    """The body of each innermost loop: the lines from a block's label to the last branch back
    to it, of the loops that hold no other loop."""
    lines = ptx.splitlines()
    labels, spans = {}, {}
    for number, line in enumerate(lines):
        found = _LABEL.match(line)
        if found:
            labels[found.group(1)] = number
        found = _BRANCH.search(line)
        if found and labels.get(found.group(1), number) < number:
            spans[found.group(1)] = (labels[found.group(1)], number)
    inner = [(a, b) for a, b in spans.values()
             if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans.values())]
    return [lines[a:b + 1] for a, b in inner]


def _term_loop(ptx: str) -> dict:
    """The pipelined term loops (the innermost loops that wait for asynchronous copies): how
    many, the fewest copies of row data (more than 8 bytes: not an entry of ``order``) any of
    them issues per iteration, and the fewest rows in flight: a loop that commits C groups of
    copies per iteration and waits until at most N are pending combines one row while the
    copies of N // C later iterations are still on their way. Without such a loop: 0 copies,
    1 row in flight (each row waited for in its own iteration)."""
    in_flight, row_copies = [], []
    for body in _inner_loops(ptx):
        waits = [int(found.group(1)) for line in body for found in [_WAIT.search(line)] if found]
        commits = sum(bool(_COMMIT.search(line)) for line in body)
        if waits and commits:
            in_flight.append(max(waits) // commits + 1)
            sizes = [int(found.group(1), 0) for line in body for found in [_COPY.search(line)]
                     if found]
            row_copies.append(sum(size > 8 for size in sizes))
    return {"pipelined_term_loops": len(in_flight),
            "row_copies_per_iteration": min(row_copies, default=0),
            "rows_in_flight": min(in_flight, default=1)}


def _resources(ptx: str) -> dict:
    """Registers per thread and bytes of spill stores and loads of the kernel, as ptxas reports
    them (``-v``) compiling the PTX with the options Triton gives it for sm_90 without FMA
    contraction; empty when Triton ships no ptxas for sm_90."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(TARGET.arch)
    if ptxas is None or not os.path.exists(ptxas.path):
        return {}
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        report = subprocess.run(
            [ptxas.path, "-lineinfo", "--fmad=false", "-v", "--regAllocOptLevel=2",
             f"--gpu-name=sm_{TARGET.arch}a", source, "-o", os.path.join(folder, "kernel.o")],
            capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    registers = re.search(r"Used (\d+) registers", report)
    return {"registers": int(registers.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}


def _launched_gather() -> dict:
    """``_segment_kernel`` as ``segment_reduce`` launches it for a gather of bf16 rows of 4096
    (its BLOCK, warps and Triton's specialisation of the arguments: contiguous rows, aligned
    pointers), long segments (chunked), through Triton's launch with the driver stubbed
    (tests/triton_stub.py): the PTX's counts and its term loop."""
    import triton_stub

    triton_stub.install(record=False)
    rows, nseg, width = 4 * kernels.CHUNK_TERMS, 2, 4096
    src = torch.zeros(1, rows, width, dtype=torch.bfloat16)
    out = torch.empty(1, nseg, width, dtype=torch.bfloat16)
    segment.segment_reduce(src, torch.arange(rows), torch.tensor([0, rows // 2, rows]), None,
                           out, reduce=kernels.SUM, rule=kernels.WIDE, alpha=1.0,
                           include_base=False)
    (compiled,) = [entry[-1] for entry in segment._launch_segment._compiled.values()]
    ptx = compiled.asm["ptx"]
    return {**_count(ptx), **_term_loop(ptx), **_resources(ptx)}


def _launched_moe_backward() -> dict:
    """The registers of ``_segment_kernel`` as ``index_add_`` launches it for an MoE backward
    (bf16 rows of 4096, 8 rows into each token, sorted by expert), with a plan and without
    one (the sort's offsets, chunk programs included, guided by the sort's int16 values: more
    keys than ``kernels.NARROW_SORT_ABOVE``, as in a real MoE), and for fp32 rows of 256
    without one, through Triton's launch with the driver stubbed."""
    import triton_stub

    import detsum

    triton_stub.install(record=False)
    tokens, topk = 1024, 8
    experts = torch.randint(0, 64, (tokens * topk,), generator=torch.Generator().manual_seed(0))
    index = experts.argsort(stable=True) // topk
    found = {}
    with triton_stub.cpu_tensors_as_cuda():
        plan = detsum.plan(index, tokens)
        for form, kwargs, dtype, width in (("plan", {"plan": plan}, torch.bfloat16, 4096),
                                           ("sort", {}, torch.bfloat16, 4096),
                                           ("fp32 sort", {}, torch.float32, 256)):
            source = torch.zeros(tokens * topk, width, dtype=dtype)
            out = torch.zeros(tokens, width, dtype=dtype)
            before = set(segment._launch_segment._compiled)
            detsum.index_add_(out, 0, index, source, check="off", **kwargs)
            (compiled,) = [entry[-1] for key, entry in segment._launch_segment._compiled.items()
                           if key not in before]
            found[form] = _resources(compiled.asm["ptx"])
    return found


def _launched_narrow() -> dict:
    """``_segment_kernel`` as ``index_add_`` with a plan launches it for narrow rows (64
    columns of fp32 and of bf16): several segments a program as one tile
    (``segment._reduce_segments``). Its PTX's counts, its term loop, whether it loads 16
    bytes at a time (``ld.global.v4``) and its registers."""
    import triton_stub

    import detsum

    triton_stub.install(record=False)
    index = torch.randint(0, 256, (2048,), generator=torch.Generator().manual_seed(1))
    found = {}
    with triton_stub.cpu_tensors_as_cuda():
        plan = detsum.plan(index, 256)
        for dtype in (torch.float32, torch.bfloat16):
            before = set(segment._launch_segment._compiled)
            detsum.index_add_(torch.zeros(256, 64, dtype=dtype), 0, index,
                              torch.zeros(2048, 64, dtype=dtype), check="off", plan=plan)
            (compiled,) = [entry[-1] for key, entry in segment._launch_segment._compiled.items()
                           if key not in before]
            ptx = compiled.asm["ptx"]
            found[str(dtype)] = {**_count(ptx), **_term_loop(ptx), **_resources(ptx),
                                 "loads_16_bytes": "ld.global.v4." in ptx,
                                 "warps": compiled.metadata.num_warps}
    return found


def main() -> dict:
    found = {}
    bf16 = _segment_types("i16", "fp32")
    for name, (reduce, rule, scaled) in {
        "bf16 sum wide alpha": (kernels.SUM, kernels.WIDE, True),
        "bf16 sum kahan alpha": (kernels.SUM, kernels.KAHAN, True),
        "bf16 sum round_each alpha": (kernels.SUM, kernels.ROUND_EACH, True),
        "bf16 sum small_stride alpha": (kernels.SUM, kernels.CUDA_SMALL_STRIDE, True),
        "bf16 mean kahan": (kernels.MEAN, kernels.KAHAN, False),
    }.items():
        config = _segment_config(reduce, rule, 1, tl.float32, scaled, 1024)
        found[name] = _count(_ptx(segment._segment_kernel, bf16, config, fp_fusion=False))
    config = _segment_config(kernels.MEAN, kernels.WIDE, 0, tl.float64, False, 256)
    found["fp64 mean wide"] = _count(_ptx(segment._segment_kernel,
                                          _segment_types("fp64", "fp64"), config,
                                          fp_fusion=False))
    config = _segment_config(kernels.SUM, kernels.KAHAN, 0, tl.float32, False, 512, carry=True)
    found["fp32 sum kahan carry"] = _count(_ptx(segment._segment_kernel,
                                                _segment_types("fp32", "fp32"), config,
                                                fp_fusion=False))
    # Bounds from int32 sorted keys, every key checked on the device (a sorted=True index).
    config = dict(_segment_config(kernels.SUM, kernels.KAHAN, 0, tl.float32, False, 512),
                  BOUNDS=segment._KEYS.value, CHECK=segment._CHECK_EVERY.value)
    found["fp32 sum kahan keyed"] = _count(_ptx(
        segment._segment_kernel, dict(_segment_types("fp32", "fp32"), bounds_ptr="*i32"),
        config, fp_fusion=False))
    # A sort's values as offsets, their two ends checked on the device, the chunk programs
    # guided by the sorted keys (a launch without a plan).
    config = dict(config, BOUNDS=segment._OFFSETS.value, GUIDED=chunks._KEY_A_POSITION.value,
                  CHECK=segment._CHECK_ENDS.value)
    found["fp32 sum kahan sort's offsets"] = _count(_ptx(
        segment._segment_kernel, _segment_types("fp32", "fp32"), config, fp_fusion=False))
    # The same, guided by the values of a narrowed sort (kernels.sort_by_segment: int16).
    found["fp32 sum kahan sort's int16 offsets"] = _count(_ptx(
        segment._segment_kernel, dict(_segment_types("fp32", "fp32"), keys_ptr="*i16"),
        config, fp_fusion=False))
    # A plan's offsets, the chunk programs guided by its index through the order.
    config = dict(config, GUIDED=chunks._KEY_A_ROW.value, CHECK=segment._CHECK_NOTHING.value)
    found["fp32 sum kahan plan's index"] = _count(_ptx(
        segment._segment_kernel, _segment_types("fp32", "fp32"), config, fp_fusion=False))
    # An unsorted index of at most CHUNK_TERMS values, scanned by every program (no order, no
    # chunks), every key checked by the first program: int64 and int32 keys.
    for name, keys, check in (
            ("bf16 sum wide alpha scanned", "*i64", segment._CHECK_ENDS),
            ("bf16 sum kahan alpha scanned int32, checked before writing", "*i32",
             segment._CHECK_BEFORE_WRITING)):
        rule = kernels.KAHAN if "kahan" in name else kernels.WIDE
        config = dict(_segment_config(kernels.SUM, rule, 1, tl.float32, True, 1024),
                      HAS_ORDER=False, SPLIT=False, CHUNKS_FIRST=False,
                      BOUNDS=segment._UNSORTED_KEYS.value,
                      CHECK=check.value)
        found[name] = _count(_ptx(segment._segment_kernel, dict(bf16, bounds_ptr=keys),
                                  config, fp_fusion=False))
    # int32 offsets of any values, each checked (check="device" or "host"): the checkers'
    # ticket as well as the chunk programs'.
    config = dict(_segment_config(kernels.SUM, kernels.WIDE, 0, tl.float32, False, 512),
                  BOUNDS=segment._ANY_OFFSETS.value, CHECK=segment._CHECK_EVERY.value)
    found["fp32 sum wide offsets checked"] = _count(_ptx(
        segment._segment_kernel, dict(_segment_types("fp32", "fp32"), bounds_ptr="*i32"),
        config, fp_fusion=False))
    # The same offsets as the inner bounds, a 0 before them and the positions after them
    # (the switch's segment_reduce: no padded copy), in tiles of narrow rows.
    config = dict(config, BOUNDS=chunks._PADDED_OFFSETS.value, SEGS=4)
    found["fp32 sum wide inner offsets checked, tiles"] = _count(_ptx(
        segment._segment_kernel, dict(_segment_types("fp32", "fp32"), bounds_ptr="*i64"),
        config, fp_fusion=False))
    # fp16 data: the chunks' fold divides the mean (in the launch, by the last chunk program).
    config = _segment_config(kernels.MEAN, kernels.KAHAN, 2, tl.float32, False, 512)
    found["fp16 mean kahan"] = _count(_ptx(segment._segment_kernel,
                                           _segment_types("fp16", "fp32"), config,
                                           fp_fusion=False))
    stride1_types = dict(src_ptr="*i16", base_ptr="*i16", out_ptr="*i16", order_ptr="*i64",
                         offsets_ptr="*i64", alpha_ptr="*fp32",
                         **{n: "i64" for n in ("ss0", "ss1", "bs0", "bs1", "os0", "os1",
                                               "outer")})
    stride1_config = dict(DATA=1, ACC=tl.float32, HAS_ORDER=True, HAS_BASE=True,
                          USE_BASE=True, SCALED=True)
    found["bf16 stride1 alpha"] = _count(_ptx(stride1._stride1_kernel, stride1_types,
                                              stride1_config, fp_fusion=False))
    # EXACT: the fp64 fast path (bf16 data) and the limbs (fp64 data, a mean: integer
    # division), with the chunk programs of long segments (SPLIT); the blocks segment_reduce
    # gives them (16 lanes of 256 columns; 128 lanes of 32).
    for name, dtype, types, reduce, scaled, block in (
            ("bf16 sum exact alpha", torch.bfloat16, _exact_types("i16", "fp32"), kernels.SUM,
             True, 256),
            ("fp64 mean exact", torch.float64, _exact_types("fp64", "fp64"), kernels.MEAN,
             False, 32),
            ("bf16 mean exact", torch.bfloat16, _exact_types("i16", "fp32"), kernels.MEAN,
             False, 256)):
        ptx = _ptx(exact._exact_kernel, types, _exact_config(reduce, dtype, scaled, block),
                   fp_fusion=False, num_warps=8)
        found[name] = {**_count(ptx), **_resources(ptx)}
    # MoE's weighted sum and its gradients: bf16 rows, fp32 weights (and grad), compensated.
    found["moe bf16 weighted sum kahan"] = _count(_ptx(
        moe._weighted_sum_kernel,
        dict(y_ptr="*i16", positions_ptr="*i64", weights_ptr="*fp32", out_ptr="*fp32",
             topk="i64", cols="i64"),
        dict(RULE=kernels.KAHAN, DATA=1, W_DATA=0, ACC=tl.float32, BLOCK=512),
        fp_fusion=False))
    found["moe bf16 weighted gradients kahan"] = _count(_ptx(
        moe._weighted_gradients_kernel,
        dict(grad_ptr="*fp32", y_ptr="*i16", slots_ptr="*i64", weights_ptr="*fp32",
             grad_y_ptr="*i16", dots_ptr="*fp32", rows="i64", topk="i64", cols="i64"),
        dict(RULE=kernels.KAHAN, DATA=1, G_DATA=0, W_DATA=0, ACC=tl.float32, BY_SLOT=True,
             CHUNK=kernels.CHUNK_TERMS, BLOCK=128),
        fp_fusion=False))
    # The route kernel given the ids sorted as they are, and sorted as int16
    # (kernels.sort_by_segment), a token's ids clamped to match.
    for name, experts, clamped in (("moe route", "*i64", False),
                                   ("moe route narrowed ids", "*i16", True)):
        found[name] = _count(_ptx(
            moe._route_kernel,
            dict(experts_ptr=experts, gather_ptr="*i64", selected_ptr="*i64",
                 positions_ptr="*i64", counts_ptr="*i64", table_ptr="*i64", n="i64",
                 num_tokens="i64", num_experts="i64", topk="i64", steps="i64"),
            dict(CLAMPED=clamped, TOPK_BLOCK=8, BLOCK=128), fp_fusion=False))
    # The counting sort of a long index (int64 keys; the values it places as int16), at the
    # block, tiles and warps it launches with.
    sort_types = dict(keys_ptr="*i64", ranks_ptr="*i32", table_ptr="*i32", positions="i64",
                      num_segments="i64", num_values="i64")
    column_types = dict(table_ptr="*i32", partials_ptr="*i32", tile_sums_ptr="*i32",
                        num_values="i64", blocks="i64", row_programs="i64")
    columns = dict(VALUES=counting_sort.VALUES, ROWS=counting_sort.ROWS,
                   ROWS_PER_PROGRAM=counting_sort.ROWS_PER_PROGRAM)
    for name, kernel, types, constexprs in (
            ("ranks", counting_sort._rank_kernel, sort_types,
             dict(BLOCK=counting_sort.BLOCK, CHUNK=counting_sort.CHUNK,
                  ROW_VALUES=counting_sort.ROW_VALUES)),
            ("totals", counting_sort._totals_kernel, column_types, columns),
            ("starts", counting_sort._starts_kernel, dict(column_types, offsets_ptr="*i64"),
             dict(columns, SUMS=counting_sort.SUMS)),
            ("places", counting_sort._place_kernel,
             dict(sort_types, values_ptr="*i16", order_ptr="*i64"),
             dict(BLOCK=counting_sort.BLOCK))):
        ptx = _ptx(kernel, types, constexprs, fp_fusion=False, num_warps=counting_sort.NUM_WARPS)
        found[f"counting sort {name}"] = {
            **_count(ptx), **_resources(ptx),
            "barrier_after_first_stores": _barrier_after_first_stores(ptx)}
    found["bf16 sum wide h4096 launched"] = _launched_gather()
    found["moe backward bf16 h4096 launched"] = _launched_moe_backward()
    for dtype, counts in _launched_narrow().items():
        found[f"narrow rows {dtype} h64 launched"] = counts
    # The control: Triton's default (fusion allowed) does contract the scaled sum, so a count
    # of 0 above is the launch option's doing, not an accident of the code.
    config = _segment_config(kernels.SUM, kernels.WIDE, 1, tl.float32, True, 1024)
    found["control: bf16 sum wide alpha, fusion allowed"] = _count(
        _ptx(segment._segment_kernel, bf16, config, fp_fusion=True))
    return found


if __name__ == "__main__":
    print(json.dumps(main()))
