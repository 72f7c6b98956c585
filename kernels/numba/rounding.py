"""Bit-exact conversions between fp32 and the 16-bit float formats, done with integer ops.

Why integer ops: NumPy has no bfloat16 and Numba cannot compute in float16 on the CPU, so
bf16 and fp16 tensors reach the Numba kernels as ``uint16`` bit patterns. This module is the
one place that turns those patterns into fp32 values and rounds fp32 values back. Working on
the fp32 bit pattern with integer adds, shifts and masks

- is exact by construction: every conversion is round-to-nearest-even, as torch's own
  ``.to(torch.bfloat16)`` / ``.to(torch.float16)`` on the CPU (tests/test_rounding.py checks
  all 65536 patterns one way and millions of fp32 patterns the other);
- does not depend on the floating-point environment: a flush-to-zero or denormals-are-zero
  mode switched on elsewhere in the process (``torch.set_flush_denormal``) cannot change how a
  subnormal converts;
- compiles to a few branch-free vector instructions (fp16 -> fp32 to one, F16C's, where the
  CPU has it), so the kernels' column loops that call these helpers still vectorise. For
  that the conversions are emitted as LLVM IR on i32 (numba intrinsics), float <-> int
  reinterpretation included (an LLVM ``bitcast``, where a ``view`` through memory would block
  the vectoriser): Numba's own integer arithmetic widens everything to 64 bits, which halves
  the vector width or, for the fp16 path's variable shifts and compares, stops vectorisation
  altogether.

NaN: bf16 results are the quiet NaN ``0x7FC0`` (as torch's scalar conversion), fp16 results
keep the sign with payload ``0x7E00``. NaN payload bits differ between torch paths anyway, so
tests compare NaN positions only (docs/determinism.md).
"""

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import njit

__all__ = [
    "f32_as_u32",
    "u32_as_f32",
    "f64_as_u64",
    "u64_as_f64",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "f16_bits_to_f32",
    "f32_to_f16_bits",
    "round_f32_to_bf16",
    "round_f32_to_f16",
]


def _bitcast(src_type, dst_type):
    """An intrinsic reinterpreting a ``src_type`` scalar as ``dst_type`` (same width)."""

    @intrinsic
    def cast(typingctx, x):
        if x != src_type:
            return None
        sig = dst_type(src_type)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(dst_type))

        return sig, codegen

    return cast


f32_as_u32 = _bitcast(types.float32, types.uint32)
u32_as_f32 = _bitcast(types.uint32, types.float32)
f64_as_u64 = _bitcast(types.float64, types.uint64)
u64_as_f64 = _bitcast(types.uint64, types.float64)

# ---------------------------------------------------------------------------------------
# The conversions, as LLVM IR on i32 (see the module docstring for why not Python ints).


class _I32:
    """Just enough of an i32 instruction set over an llvmlite IR builder."""

    def __init__(self, builder):
        self.b = builder
        self.t = ir.IntType(32)

    def c(self, v):
        return ir.Constant(self.t, v)

    def _v(self, x):
        return self.c(x) if isinstance(x, int) else x

    def add(self, x, y):
        return self.b.add(self._v(x), self._v(y))

    def sub(self, x, y):
        return self.b.sub(self._v(x), self._v(y))

    def and_(self, x, y):
        return self.b.and_(self._v(x), self._v(y))

    def or_(self, x, y):
        return self.b.or_(self._v(x), self._v(y))

    def shl(self, x, y):
        return self.b.shl(self._v(x), self._v(y))

    def lshr(self, x, y):
        return self.b.lshr(self._v(x), self._v(y))

    def cmp(self, op, x, y):
        return self.b.icmp_unsigned(op, self._v(x), self._v(y))

    def select(self, cond, x, y):
        return self.b.select(cond, self._v(x), self._v(y))

    def umin(self, x, y):
        return self.select(self.cmp("<", x, y), x, y)

    def umax(self, x, y):
        return self.select(self.cmp(">", x, y), x, y)


def _ir_function(argty, retty, body):
    """A numba intrinsic ``retty(argty)`` whose code is ``body(i32_ops, builder, arg)``."""

    @intrinsic
    def fn(typingctx, x):
        if x != argty:
            return None

        def codegen(context, builder, signature, args):
            return body(_I32(builder), builder, args[0])

        return retty(argty), codegen

    return fn


_F32 = ir.FloatType()
_I16 = ir.IntType(16)


def _ir_bf16_to_f32(i, b, h):
    # The bf16 pattern is the top half of the fp32 pattern.
    return b.bitcast(i.shl(b.zext(h, i.t), 16), _F32)


def _ir_round_bits_bf16(i, u):
    # Adding 0x7FFF plus the lowest kept bit rounds the dropped 16 bits to nearest, ties to
    # even; a carry out of the mantissa bumps the exponent, which is right (max finite fp32
    # becomes inf). No non-NaN pattern overflows.
    return i.add(i.add(u, 0x7FFF), i.and_(i.lshr(u, 16), 1))


def _ir_f32_to_bf16(i, b, x):
    u = b.bitcast(x, i.t)
    r = b.trunc(i.lshr(_ir_round_bits_bf16(i, u), 16), _I16)
    nan = b.fcmp_unordered("uno", x, x)
    return b.select(nan, ir.Constant(_I16, 0x7FC0), r)


def _ir_round_f32_bf16(i, b, x):
    u = b.bitcast(x, i.t)
    r = b.bitcast(i.and_(_ir_round_bits_bf16(i, u), 0xFFFF0000), _F32)
    return b.select(b.fcmp_unordered("uno", x, x), x, r)


# x86's F16C converts fp16 to fp32 exactly in one vector instruction (vcvtph2ps), ignoring
# the denormals-are-zero mode, which LLVM emits for an ``fpext`` from ``half``. Without F16C
# LLVM would call a runtime routine that Numba's JIT may not link, so the integer form below
# stays for such CPUs; the two agree on every pattern but a signalling NaN, which F16C quiets
# (NaN payloads are outside the contract). About 2.5x faster per term in the kernels' loops.
def _host_has_f16c():
    try:
        return "+f16c" in llvm_binding.get_host_cpu_features().flatten().split(",")
    except RuntimeError:  # llvmlite cannot read the features on this host
        return False


HAS_F16C = _host_has_f16c()


def _ir_f16_to_f32_f16c(i, b, h):
    return b.fpext(b.bitcast(h, ir.HalfType()), _F32)


def _ir_f16_to_f32_integer(i, b, h):
    # Normals rebias the exponent (15 -> 127); inf/NaN keep their mantissa bits; subnormals
    # m * 2**-24 are an fp32 product, exact (m < 1024, and the result is an fp32 normal, so
    # no FTZ/DAZ mode can touch it).
    hu = b.zext(h, i.t)
    sign = i.shl(i.and_(hu, 0x8000), 16)
    e = i.and_(i.lshr(hu, 10), 0x1F)
    m = i.and_(hu, 0x3FF)
    m13 = i.shl(m, 13)
    normal = i.or_(sign, i.or_(i.shl(i.add(e, 112), 23), m13))
    special = i.or_(sign, i.or_(0x7F800000, m13))
    subf = b.fmul(b.sitofp(m, _F32), ir.Constant(_F32, 2.0**-24))
    sub = i.or_(sign, b.bitcast(subf, i.t))
    bits = i.select(i.cmp("==", e, 31), special, i.select(i.cmp("==", e, 0), sub, normal))
    return b.bitcast(bits, _F32)


def _ir_f32_to_f16(i, b, x):
    # |x| >= 65520 (the tie between fp16's max 65504 and 65536, which goes to the even side)
    # -> inf; NaN -> sign | 0x7E00. Normal results (|x| >= 2**-14) round away 13 mantissa
    # bits as in the bf16 case and rebias the exponent by 127 - 15; a carry is right. Below,
    # the result is q = RNE(|x| * 2**24) in fp16 subnormal units (0x400 is the smallest normal,
    # again right): |x| = m * 2**(e - 150) with the implicit bit, so q = m >> (126 - e), with
    # the shift clamped to [14, 25] (25 gives 0 for every 24-bit m, which is the right answer
    # for all smaller |x|, fp32 subnormals included).
    u = b.bitcast(x, i.t)
    sign = i.and_(i.lshr(u, 16), 0x8000)
    a = i.and_(u, 0x7FFFFFFF)
    normal = i.sub(i.lshr(i.add(i.add(a, 0xFFF), i.and_(i.lshr(a, 13), 1)), 13), 112 << 10)
    e = i.lshr(a, 23)
    m = i.or_(i.and_(a, 0x7FFFFF), 0x800000)
    shift = i.sub(126, i.umin(i.umax(e, 101), 112))
    q = i.lshr(m, shift)
    rem = i.and_(m, i.sub(i.shl(1, shift), 1))
    half = i.shl(1, i.sub(shift, 1))
    odd = i.cmp("!=", i.and_(q, 1), 0)
    up = b.or_(i.cmp(">", rem, half), b.and_(i.cmp("==", rem, half), odd))
    q = i.add(q, b.zext(up, i.t))
    mag = i.select(
        i.cmp(">", a, 0x7F800000), 0x7E00,
        i.select(i.cmp(">=", a, 0x477FF000), 0x7C00,
                 i.select(i.cmp(">=", a, 0x38800000), normal, q)),
    )
    return b.trunc(i.or_(sign, mag), _I16)


_bf16_to_f32 = _ir_function(types.uint16, types.float32, _ir_bf16_to_f32)
_f32_to_bf16 = _ir_function(types.float32, types.uint16, _ir_f32_to_bf16)
_round_f32_bf16 = _ir_function(types.float32, types.float32, _ir_round_f32_bf16)
_f16_to_f32_integer = _ir_function(types.uint16, types.float32, _ir_f16_to_f32_integer)
_f16_to_f32 = (_ir_function(types.uint16, types.float32, _ir_f16_to_f32_f16c) if HAS_F16C
               else _f16_to_f32_integer)
_f32_to_f16 = _ir_function(types.float32, types.uint16, _ir_f32_to_f16)


@njit(cache=True, inline="always")
def bf16_bits_to_f32(h):
    """bf16 bit pattern (uint16) -> its exact fp32 value."""
    return _bf16_to_f32(np.uint16(h))


@njit(cache=True, inline="always")
def f32_to_bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint16), round to nearest even; NaN -> 0x7FC0."""
    return _f32_to_bf16(np.float32(x))


@njit(cache=True, inline="always")
def round_f32_to_bf16(x):
    """RN_bf16(x) kept in fp32: the value of f32_to_bf16_bits(x), without leaving fp32."""
    return _round_f32_bf16(np.float32(x))


@njit(cache=True, inline="always")
def f16_bits_to_f32(h):
    """fp16 bit pattern (uint16) -> its exact fp32 value."""
    return _f16_to_f32(np.uint16(h))


@njit(cache=True, inline="always")
def f32_to_f16_bits(x):
    """fp32 -> fp16 bit pattern (uint16), round to nearest even; NaN -> sign | 0x7E00."""
    return _f32_to_f16(np.float32(x))


@njit(cache=True, inline="always")
def round_f32_to_f16(x):
    """RN_fp16(x) kept in fp32 (the value, as an fp32, of the nearest fp16)."""
    return _f16_to_f32(_f32_to_f16(np.float32(x)))
