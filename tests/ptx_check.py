"""Compile detsum's Triton kernels for an H100/H200 (sm_90) without a GPU and count, in the PTX,
the instructions that would break the contract: fused multiply-adds and non-IEEE divisions.

Run by tests/test_triton.py in a subprocess without TRITON_INTERPRET (under the interpreter,
``triton.jit`` gives interpreted functions, which cannot be compiled). Prints one JSON object:
{config name: {"fma": count, "divisions": [kinds]}}.
"""

from __future__ import annotations

import json
import re

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from detsum import kernels
from detsum.kernels.triton import moe, segment

TARGET = GPUTarget("cuda", 90, 32)


def _ptx(fn, types: dict, constexprs: dict, *, fp_fusion: bool) -> str:
    signature = dict(types, **{name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=TARGET,
                              options={"num_warps": 4, "enable_fp_fusion": fp_fusion})
    return compiled.asm["ptx"]


def _segment_types(data: str, acc: str) -> dict:
    ints = {name: "i64" for name in ("ss0", "ss1", "ss2", "bs0", "bs1", "bs2", "os0", "os1",
                                     "os2", "cs0", "cs1", "cs2", "positions", "n_parts",
                                     "checkers", "outer", "nseg", "inner")}
    return dict(ints, src_ptr=f"*{data}", base_ptr=f"*{data}", out_ptr=f"*{data}",
                carry_ptr=f"*{acc}", order_ptr="*i64", bounds_ptr="*i64",
                work_ptr=f"*{acc}", alpha_ptr=f"*{acc}", flag_ptr=f"*{acc}",
                counters_ptr="*i64")


def _segment_config(reduce, rule, data_code, acc, scaled, block, *, carry=False):
    return dict(REDUCE=reduce, RULE=rule, DATA=data_code, ACC=acc, HAS_ORDER=True,
                HAS_BASE=True, USE_BASE=True, HAS_CARRY=carry, SCALED=scaled,
                SPLIT=rule in kernels.SPLIT_RULES,
                FIRST_TERM_START=False, NCOMP=2 if rule == kernels.KAHAN else 1,
                CHUNK=kernels.CHUNK_TERMS, BOUNDS=segment._OFFSETS.value,
                CHECK=segment._CHECK_NOTHING.value, BLOCK=block)


def _exact_types(data: str, acc: str) -> dict:
    ints = {name: "i64" for name in ("ss0", "ss1", "ss2", "bs0", "bs1", "bs2", "os0", "os1",
                                     "os2", "outer", "inner")}
    return dict(ints, src_ptr=f"*{data}", base_ptr=f"*{data}", out_ptr=f"*{data}",
                order_ptr="*i64", offsets_ptr="*i64", alpha_ptr=f"*{acc}")


def _exact_config(reduce, dtype, scaled, block):
    precision, min_quantum, unit_exponent, n_limbs = segment._EXACT_TARGETS[dtype]
    return dict(REDUCE=reduce, DATA=segment._DATA_CODES[dtype], ACC=segment._tl_acc(dtype),
                HAS_ORDER=True, HAS_BASE=True, USE_BASE=True, SCALED=scaled, HEADROOM=2.0**28,
                PRECISION=precision, MIN_QUANTUM=min_quantum, UNIT_EXPONENT=unit_exponent,
                N_LIMBS=n_limbs, LANES=triton.next_power_of_2(n_limbs + 1),
                NORMALISE_EVERY=kernels.NORMALISE_EVERY, BLOCK=block)


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
    # Bounds from int32 sorted keys, their two ends checked on the device (a launch without a
    # plan).
    config = dict(_segment_config(kernels.SUM, kernels.KAHAN, 0, tl.float32, False, 512),
                  BOUNDS=segment._KEYS.value, CHECK=segment._CHECK_ENDS.value)
    found["fp32 sum kahan keyed"] = _count(_ptx(
        segment._segment_kernel, dict(_segment_types("fp32", "fp32"), bounds_ptr="*i32"),
        config, fp_fusion=False))
    # int32 offsets of any values, each checked (check="device" or "host"): the checkers'
    # ticket as well as the chunk programs'.
    config = dict(_segment_config(kernels.SUM, kernels.WIDE, 0, tl.float32, False, 512),
                  BOUNDS=segment._ANY_OFFSETS.value, CHECK=segment._CHECK_EVERY.value)
    found["fp32 sum wide offsets checked"] = _count(_ptx(
        segment._segment_kernel, dict(_segment_types("fp32", "fp32"), bounds_ptr="*i32"),
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
    stride1 = dict(DATA=1, ACC=tl.float32, HAS_ORDER=True, HAS_BASE=True, USE_BASE=True,
                   SCALED=True)
    found["bf16 stride1 alpha"] = _count(_ptx(segment._stride1_kernel, stride1_types, stride1,
                                              fp_fusion=False))
    # EXACT: the fp64 fast path (bf16 data) and the limbs (fp64 data, a mean: integer division).
    found["bf16 sum exact alpha"] = _count(_ptx(
        segment._exact_kernel, _exact_types("i16", "fp32"),
        _exact_config(kernels.SUM, torch.bfloat16, True, 256), fp_fusion=False))
    found["fp64 mean exact"] = _count(_ptx(
        segment._exact_kernel, _exact_types("fp64", "fp64"),
        _exact_config(kernels.MEAN, torch.float64, False, 32), fp_fusion=False))
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
    found["moe route"] = _count(_ptx(
        moe._route_kernel,
        dict(experts_ptr="*i64", gather_ptr="*i64", selected_ptr="*i64", positions_ptr="*i64",
             counts_ptr="*i64", table_ptr="*i64", n="i64", num_tokens="i64",
             num_experts="i64", topk="i64", steps="i64"),
        dict(TOPK_BLOCK=8, BLOCK=128), fp_fusion=False))
    # The control: Triton's default (fusion allowed) does contract the scaled sum, so a count
    # of 0 above is the launch option's doing, not an accident of the code.
    config = _segment_config(kernels.SUM, kernels.WIDE, 1, tl.float32, True, 1024)
    found["control: bf16 sum wide alpha, fusion allowed"] = _count(
        _ptx(segment._segment_kernel, bf16, config, fp_fusion=True))
    return found


if __name__ == "__main__":
    print(json.dumps(main()))
