"""segment_sum: reduce contiguous (or permuted) runs of rows given by CSR offsets."""

from __future__ import annotations

import torch

from detsum import _dispatch, _segments, _transforms, _validation, reference
from detsum.backend import current_backend
from detsum.modes import Mode, parse_mode, rule_for
from detsum.ops.index_add import call_index_add

_CALLER = "detsum.segment_sum"


# ---- operator ---------------------------------------------------------------------------------

def _check_values(offsets: torch.Tensor, perm: torch.Tensor | None, num_rows: int,
                  check: str, backend_name: str) -> None:
    """Check offsets (and perm) with one fused reduction and one host read, or as ``check``
    says; always on the Numba backend (there a host read costs no synchronisation, and the
    kernel must never read outside src)."""
    if backend_name != "numba" and check == "off":
        return
    decreasing = (offsets[1:] < offsets[:-1]).any()
    perm_bad = (((perm < 0) | (perm >= num_rows)).any() if perm is not None and perm.numel()
                else None)
    if backend_name != "numba" and check == "device":
        _validation.assert_on_device((offsets[0] == 0) & (offsets[-1] == num_rows)
                                     & ~decreasing, _CALLER,
                                     f"offsets do not run from 0 to src.size(dim) = "
                                     f"{num_rows} without decreasing")
        if perm_bad is not None:
            _validation.assert_on_device(~perm_bad, _CALLER,
                                         f"perm has a value outside [0, src.size(dim) = "
                                         f"{num_rows})")
        return
    checks = [offsets[0], offsets[-1], decreasing.to(offsets.dtype)]
    if perm_bad is not None:
        checks.append(perm_bad.to(offsets.dtype))
    first, last, decreasing, *perm_bad = torch.stack(checks).tolist()
    if first != 0:
        raise ValueError(f"{_CALLER}: offsets[0] = {first}; expected 0")
    if last != num_rows:
        raise ValueError(f"{_CALLER}: offsets[-1] = {last}; expected src.size(dim) = {num_rows}")
    if decreasing:
        s = int((offsets[1:] < offsets[:-1]).nonzero()[0])
        raise ValueError(f"{_CALLER}: offsets decrease at position {s + 1} "
                         f"({int(offsets[s])} then {int(offsets[s + 1])}); expected nondecreasing")
    if perm_bad and perm_bad[0]:
        bad = int(((perm < 0) | (perm >= num_rows)).nonzero()[0])
        _validation.raise_index_out_of_range(_CALLER, "perm", perm, bad, num_rows, "src.size(dim)")


def _segment_sum(src, offsets, dim, perm, acc_mode, check="host"):
    """The operator's body (also called directly, see ``_dispatch``)."""
    num_rows = src.shape[dim]
    backend_name = current_backend(src.device.type, _CALLER)
    _check_values(offsets, perm, num_rows, check, backend_name)
    if backend_name == "reference":
        return reference.segment_sum(src, offsets, dim=dim, perm=perm, mode=acc_mode)
    src3 = _segments.rows_view(src, dim)
    out3 = _segments.new_output(src3, offsets.numel() - 1)
    order = None if perm is None else perm.to(torch.int64)
    _segments.launch(backend_name, src3, order, offsets.to(torch.int64), None, out3,
                     reduce="sum",
                     rule=rule_for(Mode(acc_mode), "sum", src.device.type, src3.shape[2]),
                     alpha=1.0, include_base=False)
    return out3.view(_out_shape(src, dim, offsets))


@torch.library.custom_op("detsum::segment_sum", mutates_args=())
def segment_sum_op(src: torch.Tensor, offsets: torch.Tensor, dim: int,
                   perm: torch.Tensor | None, acc_mode: str, check: str = "host"
                   ) -> torch.Tensor:
    return _segment_sum(src, offsets, dim, perm, acc_mode, check)


def _out_shape(src: torch.Tensor, dim: int, offsets: torch.Tensor) -> list[int]:
    shape = list(src.shape)
    shape[dim] = offsets.shape[0] - 1
    return shape


@segment_sum_op.register_fake
def _(src, offsets, dim, perm, acc_mode, check="host"):
    return src.new_empty(_out_shape(src, dim, offsets))


# ---- autograd: each source row receives its segment's gradient row ---------------------------

def _setup_context(ctx, inputs, output):
    src, offsets, dim, perm, acc_mode, *_ = inputs
    ctx.save_for_backward(offsets, perm)
    ctx.dim, ctx.acc_mode, ctx.src_shape = dim, acc_mode, src.shape


def _backward(ctx, grad):
    offsets, perm = ctx.saved_tensors
    dim, num_rows = ctx.dim, ctx.src_shape[ctx.dim]
    counts = offsets[1:] - offsets[:-1]
    segment_of_position = torch.repeat_interleave(
        torch.arange(counts.numel(), device=grad.device), counts, output_size=num_rows)
    grad_positions = grad.index_select(dim, segment_of_position)
    if perm is None:
        return grad_positions, None, None, None, None, None
    # perm may repeat a row; adding (not copying) gives the right gradient then, and for a true
    # permutation each row receives exactly one term, so the sum is exact in every mode. Its
    # values were checked by the forward call (as its check said): none here, no host read.
    grad_src = call_index_add(grad.new_zeros(ctx.src_shape), dim, perm, grad_positions, 1.0,
                              ctx.acc_mode, "off")
    return grad_src, None, None, None, None, None


call_segment_sum = _transforms.register_autograd(segment_sum_op, _backward,
                                                 setup_context=_setup_context, caller=_CALLER)


# ---- public function ---------------------------------------------------------------------------

def segment_sum(src: torch.Tensor, offsets: torch.Tensor, *, dim: int = 0,
                perm: torch.Tensor | None = None, mode: str | Mode = "fp32",
                check: str = "host") -> torch.Tensor:
    r"""Sum runs of rows of ``src`` along ``dim``, segment by segment, deterministically.

    ``offsets`` is a CSR pointer: output row ``s`` (along ``dim``) is

    .. math:: \mathrm{out}_s = \sum_{p=\mathrm{offsets}[s]}^{\mathrm{offsets}[s+1]-1} \mathrm{src}_{r(p)}

    with :math:`r(p) = p`, or :math:`r(p) = \mathrm{perm}[p]` when ``perm`` is given: a fused
    gather that never copies ``src``. Empty segments give 0.

    Args:
        src: ``[..., N, ...]`` float32, float16, bfloat16 or float64, any strides.
        offsets: 1-D int32/int64 ``[S + 1]``, nondecreasing, ``offsets[0] == 0``,
            ``offsets[-1] == N``.
        dim: the dimension of ``src`` that is segmented (negative counts from the end).
        perm: optional 1-D int32/int64 ``[N]`` of row numbers in ``[0, N)``.
        mode: ``"fp32"`` (default), ``"kahan"``, ``"autograd"`` or ``"exact"``.
        check: how the values of ``offsets`` and ``perm`` are checked. ``"host"`` (default):
            read back before anything runs, with an error naming the first bad position.
            ``"device"``: on their device, with no host read (no synchronisation, so the call
            can be captured in a CUDA graph); bad values fail at the next synchronisation.
            ``"off"``: not checked on a GPU, where bad values are the caller's promise broken
            (the kernel may read outside ``src``). On CPU every level checks, for free.

    Returns:
        ``src``'s shape with ``dim`` of size ``S``, contiguous, of ``src``'s dtype.

    Summation order and rounding (each segment sums in the order ``p = offsets[s], ...``):

    - ``"fp32"``: accumulate in fp32 (fp64 for float64), round to the dtype once.
    - ``"kahan"``: Neumaier-compensated sum in the same accumulator, rounded once
      (``RN(s + c)``, or ``s`` itself when ``c == 0`` so that -0.0 stays -0.0); within 1 ulp
      of the exact sum except under extreme cancellation in fp32 data.
    - ``"autograd"``: what PyTorch's own accumulation gives on the device (on CPU: round to
      the dtype after every add, from 0), i.e. the gradient autograd computes for
      ``src[r(p)]`` rows gathered into these segments.
    - ``"exact"``: the exact sum of the segment's rows, rounded once to the dtype (correctly
      rounded; -0.0 only when every term is -0.0). It does not depend on the order at all:
      any permutation of a segment's rows gives the same bits.

    **This operation is fully deterministic**: the same inputs give the same bits on every
    run, for every thread count and every backend that implements the mode.

    Gradient: each row ``r(p)`` receives its segment's gradient row (exact).
    The same under ``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``vmap``; forward
    mode (``jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) raises NotImplementedError
    (docs/determinism.md).

    Example:
        >>> import torch, detsum
        >>> src = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        >>> detsum.segment_sum(src, torch.tensor([0, 2, 2, 3]))
        tensor([[4., 6.],
                [0., 0.],
                [5., 6.]])
        >>> detsum.segment_sum(src, torch.tensor([0, 1, 3]), perm=torch.tensor([2, 0, 1]))
        tensor([[5., 6.],
                [4., 6.]])
    """
    dim, mode = _validation.run_check(_check, src, offsets, dim, perm, mode, check)
    if _dispatch.direct_call_ok(src, offsets, perm):
        return _segment_sum(src, offsets, dim, perm, mode.value, check)
    return call_segment_sum(src, offsets, dim, perm, mode.value, check)


def _check(src, offsets, dim, perm, mode, check):
    mode = parse_mode(mode, caller=_CALLER)
    _validation.check_level(_CALLER, check)
    _validation.check_float(_CALLER, "src", src)
    # Malformed offsets are a ValueError whatever is wrong with them, their dtype included.
    _validation.check_index(_CALLER, "offsets", offsets, one_d=True, dtype_error=ValueError)
    if offsets.numel() == 0:
        raise ValueError(f"{_CALLER}: offsets is empty; expected at least one entry (offsets[0] == 0)")
    dim = _validation.check_dim(_CALLER, dim, src.dim())
    if perm is not None:
        _validation.check_index(_CALLER, "perm", perm, one_d=True)
        if perm.shape[0] != src.shape[dim]:
            raise ValueError(f"{_CALLER}: perm has length {perm.shape[0]}; expected "
                             f"src.size({dim}) = {src.shape[dim]}")
    _validation.check_same_device(_CALLER, src=src, offsets=offsets, perm=perm)
    return dim, mode
