"""A ``"detsum"`` experts implementation for Hugging Face transformers' mixture-of-experts models.

transformers 5 computes the experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and every other
model whose experts class carries ``@use_experts_implementation`` with the function registered
in ``transformers.integrations.moe.ExpertsInterface`` under ``config._experts_implementation``,
called with the experts module, ``hidden_states [T, H]``, ``top_k_index [T, topk]`` and
``top_k_weights [T, topk]``. This module registers ``"detsum"`` there::

    import detsum.hf

    detsum.hf.use_detsum_experts(model, mode="exact")   # this model, this mode

    detsum.hf.register(mode="fp32")                     # or: the name, for from_pretrained
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="detsum")

transformers is imported only by ``register`` and ``use_detsum_experts``: ``import detsum`` and
``import detsum.hf`` never need it.

Against transformers' ``"eager"`` implementation (the model's own loop), on CPU:
``"autograd"`` gives the same bits, logits and every gradient (Qwen2-MoE: not the gradients
below the experts block); ``"fp32"`` (default), ``"kahan"`` and ``"exact"`` sum each token's
weighted expert rows in that mode and round once: the same bits on every run and thread
count, close to eager rather than equal (docs/switching.md).
"""

from __future__ import annotations

import torch

import detsum
from detsum import _dispatch, _transforms, _validation, moe
from detsum.modes import Mode, parse_mode

__all__ = ["IMPLEMENTATION", "experts_forward", "register", "use_detsum_experts"]

#: The name under which ``register`` puts ``experts_forward`` in transformers' registry.
IMPLEMENTATION = "detsum"

#: The mode of an experts module that ``use_detsum_experts`` did not give one.
_default_mode = Mode.FP32

# What the decorator @use_experts_implementation sets on every experts module, and the values
# of the layout that experts_forward computes: gate_up_proj [E, 2I, H] and down_proj [E, H, I]
# in nn.Linear's layout, no bias, no norm after the experts, all experts on this rank.
_SUPPORTED_LAYOUT = {"has_gate": True, "is_transposed": False, "has_bias": False,
                     "has_post_expert_norm": False, "_is_expert_parallel": False}


# ---- expert matrix products ---------------------------------------------------------------------
# One custom operator for the forward products and one for their gradients: the loop over
# experts reads the row counts back, which torch.compile cannot trace, and inside an operator it
# needs no tracing. Each product is the mm that nn.functional.linear(rows, weight[e]) runs, and
# each gradient the mm that autograd runs for it, so the bits are the model's own loop's.

@torch.library.custom_op("detsum::hf_expert_linear", mutates_args=())
def expert_linear_op(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                     loop_zeros: bool) -> torch.Tensor:
    """``out[p] = rows[p] @ weight[e].T`` for the rows ``offsets[e] <= p < offsets[e + 1]``.
    ``loop_zeros``: the weight gradient's signed zeros as the model's loop has them (see
    ``expert_linear_backward_op``)."""
    out = rows.new_empty((rows.shape[0], weight.shape[1]))
    bounds = offsets.tolist()
    if bounds[-1] != rows.shape[0]:
        # route() counts the pairs of experts 0 .. E - 1 only: the others would leave rows
        # that no product writes.
        raise IndexError(
            f"detsum.hf.experts_forward: {rows.shape[0] - bounds[-1]} of the {rows.shape[0]} "
            f"(token, slot) pairs of top_k_index name an expert outside [0, {weight.shape[0]}) "
            f"(expected 0 <= top_k_index < num_experts = {weight.shape[0]})")
    # One split per tensor instead of a slice per expert: at a few dozen rows per expert the
    # Python around the products is what a step can spend beyond the model's own loop.
    counts = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    for expert, (expert_rows, expert_out) in enumerate(zip(rows.split(counts),
                                                           out.split(counts))):
        if expert_rows.shape[0]:
            torch.mm(expert_rows, weight[expert].t(), out=expert_out)
    return out


@expert_linear_op.register_fake
def _(rows, weight, offsets, loop_zeros):
    return rows.new_empty((rows.shape[0], weight.shape[1]))


def _expert_linear_gradients(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                             offsets: torch.Tensor, rows_need_grad: bool,
                             weight_needs_grad: bool, loop_zeros: bool
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``expert_linear_op`` as autograd computes them for ``linear``:
    ``grad @ weight[e]`` and ``grad.T @ rows`` per expert (an expert without rows: zeros).
    A gradient nobody needs comes back empty. The body of ``expert_linear_backward_op``."""
    grad_rows = grad.new_empty(rows.shape if rows_need_grad else (0,))
    grad_weight = weight.new_empty(weight.shape if weight_needs_grad else (0,))
    bounds = offsets.tolist()
    counts = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    experts_with_rows = 0
    grads, expert_rows = grad.split(counts), rows.split(counts)
    grad_rows_by_expert = grad_rows.split(counts) if rows_need_grad else grads
    for expert, count in enumerate(counts):
        if count == 0:
            if weight_needs_grad:
                grad_weight[expert].zero_()
            continue
        experts_with_rows += 1
        if rows_need_grad:
            torch.mm(grads[expert], weight[expert], out=grad_rows_by_expert[expert])
        if weight_needs_grad:
            torch.mm(grads[expert].t(), expert_rows[expert], out=grad_weight[expert])
    if weight_needs_grad and loop_zeros and experts_with_rows > 1:
        # In the loop, autograd sums one weight gradient per expert, each zeros outside its
        # expert: adding those zeros turns a -0.0 (an underflow, or all products -0.0) into
        # +0.0 and leaves every other value as it is. Adding +0.0 once does the same.
        grad_weight.add_(0.0)
    return grad_rows, grad_weight


@torch.library.custom_op("detsum::hf_expert_linear_backward", mutates_args=())
def expert_linear_backward_op(grad: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                              offsets: torch.Tensor, rows_need_grad: bool,
                              weight_needs_grad: bool, loop_zeros: bool
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    return _expert_linear_gradients(grad, rows, weight, offsets, rows_need_grad,
                                    weight_needs_grad, loop_zeros)


@expert_linear_backward_op.register_fake
def _(grad, rows, weight, offsets, rows_need_grad, weight_needs_grad, loop_zeros):
    return (grad.new_empty(rows.shape if rows_need_grad else (0,)),
            weight.new_empty(weight.shape if weight_needs_grad else (0,)))


call_expert_linear_backward = _transforms.register_autograd(
    expert_linear_backward_op,
    _transforms.refuse_second_order("detsum.hf.experts_forward",
                                    "the gradient of the expert products"),
    caller="detsum.hf.experts_forward")


def _expert_linear_setup(ctx, inputs, output):
    rows, weight, offsets, loop_zeros = inputs
    ctx.save_for_backward(rows, weight, offsets)
    ctx.loop_zeros = loop_zeros


def _expert_linear_backward(ctx, grad):
    rows, weight, offsets = ctx.saved_tensors
    rows_need_grad, weight_needs_grad = ctx.needs_input_grad[:2]
    # A plain eager backward calls the operator's body itself (see detsum/_dispatch.py); a
    # traced one (torch.compile) sees the operator.
    gradients = (_expert_linear_gradients if _dispatch.direct_call_ok(grad, rows, weight, offsets)
                 else call_expert_linear_backward)
    grad_rows, grad_weight = gradients(
        grad, rows, weight, offsets, rows_need_grad, weight_needs_grad, ctx.loop_zeros)
    return (grad_rows if rows_need_grad else None,
            grad_weight if weight_needs_grad else None, None, None)


call_expert_linear = _transforms.register_autograd(
    expert_linear_op, _expert_linear_backward, setup_context=_expert_linear_setup,
    caller="detsum.hf.experts_forward")


# ---- routing ------------------------------------------------------------------------------------

def _route_slot_major(top_k_index: torch.Tensor, num_experts: int, *, descending: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gather_indices, boundaries)`` for ``detsum.moe``: the (token, slot) pairs grouped by
    expert, in increasing expert order (``descending``: decreasing) and, within an expert, slot
    by slot, then token by token; ``boundaries`` [E + 1] delimits the groups in that order.

    That order within an expert is the model's own: its loop takes an expert's rows with
    ``torch.where`` over the expert's ``[topk, T]`` mask, and the expert's weight gradient
    sums over those rows in that order (inside mm)."""
    num_tokens, topk = top_k_index.shape
    expert_keys = num_experts - 1 - top_k_index if descending else top_k_index
    # route() orders the pairs of one expert by their flat position in the tensor it is given;
    # in the transpose that position is slot * T + token.
    by_slot, tokens_per_expert = moe.route(expert_keys.t(), num_experts, check=False)
    gather_indices = (by_slot % num_tokens) * topk + by_slot // num_tokens
    boundaries = torch.cat([tokens_per_expert.new_zeros(1), tokens_per_expert.cumsum(0)])
    return gather_indices, boundaries


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(permutation.shape[0], device=permutation.device)
    return torch.empty_like(permutation).scatter_(0, permutation, positions)


# ---- the experts implementation -----------------------------------------------------------------

def experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"detsum"`` experts implementation: what transformers calls in place of the
    experts module's own ``forward``.

    Args:
        experts: the experts module (``MixtralExperts``, ``Qwen2MoeExperts``, ...): its
            ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` and ``_apply_gate`` (by
            default ``act_fn(gate) * up``). Its mode is ``experts.detsum_mode`` (set by
            ``use_detsum_experts``), else the one given to ``register``.
        hidden_states: ``[T, H]`` token rows.
        top_k_index: ``[T, topk]`` expert ids, from the model's router.
        top_k_weights: ``[T, topk]`` routing weights, in the router's dtype (fp32 for
            Mixtral, the hidden dtype for Qwen-MoE and OLMoE).

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype: ``sum_k top_k_weights[t, k] *
        expert_{top_k_index[t, k]}(hidden_states[t])``.

    Raises:
        ValueError: the experts module's layout is not the one computed here (bias,
            transposed weights, no gate, a norm after the experts, expert parallelism), the
            mode is not a detsum mode, or the tensors disagree in shape or dtype.
        IndexError: an expert id outside ``[0, num_experts)`` (found where the row counts
            are read, before any product).

    Each expert's rows are multiplied by its weights with torch's ``mm``, in the model's order
    (slot by slot, then token by token); those products and their gradients are the model's
    own loop's in every mode. The modes differ in the sums:

    - ``"autograd"``: the arithmetic of transformers' ``"eager"`` loop: each product ``y * w``
      as torch's multiply computes it, rounded to the hidden dtype, added in increasing expert
      order with a rounding after every add; backward, each token's gradient rows added last
      expert first, as autograd's engine adds the loop's; the expert weights' gradient with
      the loop's signed zeros. In a model whose other consumers of the block's input run
      before the experts (Mixtral, Qwen3-MoE, OLMoE) every gradient is eager's; in Qwen2-MoE
      the gradients below the block differ in the last bits (docs/switching.md, "Limits").
    - ``"fp32"``, ``"kahan"``, ``"exact"``: ``detsum.moe.permute`` and
      ``detsum.moe.unpermute(weights=top_k_weights)`` in that mode: products in fp32, each
      token's ``topk`` products summed in slot order in that mode, rounded once to the promoted
      dtype of rows and weights, then to the hidden dtype (a second rounding only for
      half-precision rows with fp32 weights). Backward: each token's ``topk`` gradient rows
      summed in that mode, rounded once; each routing weight's gradient a dot product over the
      features in that mode.

    The sums are the same on every run and thread count; the matrix products are only as
    thread-independent as torch's ``mm``. Under ``torch.autocast`` they stay in the weights'
    dtype.

    ``torch.compile(fullgraph=True)`` traces it, forward and backward: every host read runs
    inside detsum's operators (``detsum.moe.route`` is called with ``check=False``, the ids
    checked where the row counts are read). With the ``aot_eager`` backend the bits are the
    uncompiled call's; Inductor keeps detsum's operators as they are but lowers the model's
    own elementwise code (the gate's activation) its own way.
    """
    caller = "detsum.hf.experts_forward"
    mode = parse_mode(getattr(experts, "detsum_mode", _default_mode), caller=caller)
    _check_layout(caller, experts)
    _check_inputs(caller, experts, hidden_states, top_k_index, top_k_weights)
    num_experts, topk = experts.gate_up_proj.shape[0], top_k_index.shape[1]
    gather_indices, boundaries = _route_slot_major(top_k_index, num_experts, descending=False)
    if mode is Mode.AUTOGRAD:
        # autograd's engine adds the loop's per-expert gradients of the block input last expert
        # first (it runs the most recently created node first): permuted by decreasing expert,
        # permute's backward adds each token's rows in that order; the exact gather that
        # follows puts the rows back in the products' order.
        descending, _ = _route_slot_major(top_k_index, num_experts, descending=True)
        rows = moe.permute(hidden_states, descending, topk, mode=mode, check=False)
        rows = rows.index_select(0, _inverse(descending).index_select(0, gather_indices))
    else:
        rows = moe.permute(hidden_states, gather_indices, topk, mode=mode, check=False)
    loop_zeros = mode is Mode.AUTOGRAD
    projected = call_expert_linear(rows, experts.gate_up_proj, boundaries, loop_zeros)
    expert_rows = call_expert_linear(experts._apply_gate(projected), experts.down_proj,
                                     boundaries, loop_zeros)
    if mode is Mode.AUTOGRAD:
        # The loop's combination: index_add_ of each expert's weighted rows, rounded to the
        # hidden dtype, expert by expert into zeros.
        position_weights = top_k_weights.reshape(-1).index_select(0, gather_indices)
        weighted = (expert_rows * position_weights[:, None]).to(hidden_states.dtype)
        return detsum.index_add(torch.zeros_like(hidden_states), 0, gather_indices // topk,
                                weighted, mode=mode)
    combined = moe.unpermute(expert_rows, gather_indices, topk, weights=top_k_weights,
                             mode=mode)
    return combined.to(hidden_states.dtype)


# ---- registration -------------------------------------------------------------------------------

def register(mode: str | Mode = "fp32") -> None:
    """Register ``"detsum"`` in transformers' experts registry; calling it again is harmless.

    Args:
        mode: the mode of every experts module that ``use_detsum_experts`` did not give one of
            its own: ``"fp32"`` (default), ``"kahan"``, ``"exact"`` or ``"autograd"``.

    After it, ``from_pretrained(..., experts_implementation="detsum")`` and
    ``model.set_experts_implementation("detsum")`` select ``experts_forward``.

    Raises:
        ValueError: ``mode`` is not a detsum mode.
        ImportError: transformers is not installed, or has no experts interface (before 5.0).
    """
    global _default_mode
    mode = parse_mode(mode, caller="detsum.hf.register")
    experts_interface = _experts_interface("detsum.hf.register")
    experts_interface.register(IMPLEMENTATION, experts_forward)
    _default_mode = mode


def use_detsum_experts(model: torch.nn.Module, mode: str | Mode = "fp32") -> torch.nn.Module:
    """Compute ``model``'s experts with ``experts_forward`` in ``mode``; returns ``model``.

    Registers ``"detsum"`` (``register``, leaving its default mode as it is), gives each of
    the model's experts modules ``detsum_mode = mode`` and calls
    ``model.set_experts_implementation("detsum")``. Another model keeps its own mode; the
    model's implementation goes back with ``model.set_experts_implementation("eager")`` (or
    ``"grouped_mm"``, transformers' default).

    Args:
        model: a transformers model with a mixture-of-experts block whose experts class
            carries ``@use_experts_implementation`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...).
        mode: ``"fp32"`` (default), ``"kahan"``, ``"exact"`` or ``"autograd"``.

    Raises:
        ValueError: ``mode`` is not a detsum mode; the model has no such experts module; one
            of them has a layout ``experts_forward`` does not compute (nothing is changed then).
        ImportError: transformers is not installed, or has no experts interface.
    """
    caller = "detsum.hf.use_detsum_experts"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module (a transformers model), "
                        f"got {type(model).__name__}")
    mode = parse_mode(mode, caller=caller)
    experts_modules = [m for m in model.modules() if _uses_experts_interface(m)]
    if not experts_modules:
        raise ValueError(
            f"{caller}: model ({type(model).__name__}) has no experts module that dispatches "
            f"through transformers' experts interface; expected a mixture-of-experts model whose "
            f"experts class carries @use_experts_implementation (Mixtral, Qwen2-MoE, Qwen3-MoE, "
            f"OLMoE, ...)")
    for experts in experts_modules:
        _check_layout(caller, experts)
    _experts_interface(caller).register(IMPLEMENTATION, experts_forward)
    for experts in experts_modules:
        experts.detsum_mode = mode.value
    model.set_experts_implementation(IMPLEMENTATION)
    return model


def _experts_interface(caller: str):
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:
        raise ImportError(f"{caller}: needs transformers 5 or later, whose experts interface "
                          f"(transformers.integrations.moe.ExpertsInterface) selects the "
                          f"experts implementation; {error}") from error
    return ExpertsInterface


# ---- checks -------------------------------------------------------------------------------------

def _uses_experts_interface(module: torch.nn.Module) -> bool:
    """What @use_experts_implementation leaves on every module it decorates (the later flags,
    such as has_post_expert_norm, are read with their default where absent)."""
    return all(hasattr(module, name) for name in ("has_gate", "is_transposed", "has_bias",
                                                  "_apply_gate"))


def _check_layout(caller: str, experts: torch.nn.Module) -> None:
    name = type(experts).__name__
    if not _uses_experts_interface(experts):
        raise ValueError(f"{caller}: {name} is not an experts module of transformers' experts "
                         f"interface (no has_gate, is_transposed, ... flags from "
                         f"@use_experts_implementation)")
    flags = {flag: getattr(experts, flag, value) for flag, value in _SUPPORTED_LAYOUT.items()}
    differing = {flag: value for flag, value in flags.items()
                 if value != _SUPPORTED_LAYOUT[flag]}
    if differing:
        got = ", ".join(f"{flag}={value!r}" for flag, value in differing.items())
        expected = ", ".join(f"{flag}={_SUPPORTED_LAYOUT[flag]!r}" for flag in differing)
        raise ValueError(
            f"{caller}: {name} has {got}; detsum's experts implementation computes "
            f"gate_up_proj [E, 2I, H] and down_proj [E, H, I] in nn.Linear's layout, without "
            f"bias, post-expert norm or expert parallelism (expected {expected})")


def _check_inputs(caller, experts, hidden_states, top_k_index, top_k_weights) -> None:
    for name, value in (("hidden_states", hidden_states), ("top_k_weights", top_k_weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{caller}: {name} must be a torch.Tensor, got "
                            f"{type(value).__name__}")
    _validation.check_index(caller, "top_k_index", top_k_index, one_d=False)
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{caller}: top_k_weights has dtype {top_k_weights.dtype}; expected a "
                        f"floating-point dtype")
    if hidden_states.dim() != 2 or top_k_index.dim() != 2:
        raise ValueError(f"{caller}: hidden_states has shape {tuple(hidden_states.shape)} and "
                         f"top_k_index {tuple(top_k_index.shape)}; expected [T, H] and "
                         f"[T, topk]")
    if top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"{caller}: top_k_index has {top_k_index.shape[0]} rows but "
                         f"hidden_states has {hidden_states.shape[0]}; expected one row of "
                         f"expert ids per token")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"{caller}: top_k_weights has shape {tuple(top_k_weights.shape)}; "
                         f"expected top_k_index's, {tuple(top_k_index.shape)}")
    hidden_size = experts.gate_up_proj.shape[2]
    if hidden_states.shape[1] != hidden_size:
        raise ValueError(f"{caller}: hidden_states has {hidden_states.shape[1]} features but "
                         f"{type(experts).__name__}.gate_up_proj takes {hidden_size}; expected "
                         f"[T, {hidden_size}]")
    _validation.check_same_device(caller, hidden_states=hidden_states, top_k_index=top_k_index,
                                  top_k_weights=top_k_weights,
                                  gate_up_proj=experts.gate_up_proj, down_proj=experts.down_proj)
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name)
        if weight.dtype != hidden_states.dtype:
            raise ValueError(f"{caller}: {type(experts).__name__}.{name} has dtype "
                             f"{weight.dtype} but hidden_states has {hidden_states.dtype}; "
                             f"expected the same dtype")
