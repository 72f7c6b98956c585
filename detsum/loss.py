"""Deterministic batch-loss and per-sample-gradient reduction (docs/loss.md).

- ``reduce``: a batch's losses summed or averaged in index order;
- ``per_sample_grads``: every sample's gradient, each sample evaluated alone;
- ``GradAccumulator``: per-sample gradients summed over samples in order, in chunks of any size
  (a matrix's may come as the factors of outer products, ``OuterProducts``);
- ``batch_grad``: the reduced loss's gradient as that ordered sum, the same bits for every
  micro-batch split.

With ``group=`` (a ``torch.distributed`` process group) and ``mode="exact"``, ``reduce``,
``GradAccumulator`` and ``batch_grad`` sum over the shards that the ranks of the group hold:
the same bits for every number of ranks and every sharding (docs/distributed.md).

Every sum here goes through detsum's kernels in the canonical order (``segment_sum``, or a
``RunningSum`` that continues it across calls), so the result has one order on every run,
thread count and device; ``torch.sum`` picks its own order (a vectorised cascade on CPU, a
tree on GPU) and so does matmul inside autograd. ``"autograd"`` mode has no meaning here
(autograd's batch reduction order lives inside matmul kernels), and is refused."""

from __future__ import annotations

import torch

from detsum import _kernel_ops, _limbs, _segments, _transforms, _validation, distributed
# JOINT_SAMPLES too: docs/loss.md calls it loss.JOINT_SAMPLES.
from detsum._sample_gradients import (JOINT_SAMPLES, OuterProducts, SampleGradients,
                                      trainable_parameters)
from detsum.backend import current_backend
from detsum.modes import MAX_TERMS_PER_STATE, Mode, acc_dtype, parse_ordered_mode
from detsum.ops.running_sum import RunningSum
from detsum.ops.segment_sum import call_segment_sum

__all__ = ["GradAccumulator", "OuterProducts", "batch_grad", "per_sample_grads", "reduce"]

REDUCTIONS = ("mean", "sum")


def _parse_mode(mode: object, caller: str) -> Mode:
    return parse_ordered_mode(
        mode, caller=caller,
        why_not_autograd="for a batch reduction (autograd's order there lives inside matmul "
                         "kernels, and no detsum primitive can reproduce it)")


def _check_float_tensor(caller: str, name: str, t: object) -> None:
    """A tensor of a supported float dtype, of any shape (0-dim included)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
    _validation.check_float(caller, name, t.reshape(-1))


def _ordered_sum(values: torch.Tensor, mode: Mode) -> torch.Tensor:
    """0-dim sum of a 1-D acc-type tensor, in index order, in ``mode`` (no final rounding
    beyond the acc type)."""
    offsets = _segments.one_segment(values.shape[0], values.device)
    return call_segment_sum(values, offsets, 0, None, mode.value, "host",
                            caller="detsum.loss.reduce").view(())


class _ExactSum(torch.autograd.Function):
    """``(sum, count)``: the exact sum of ``rows`` ``[n, k]`` (acc type), rounded once to
    ``dtype``: ``[k]``, with ``mean``, divided by the row count first (exactly); ``count`` is
    that row count (an int). With a ``group``, the sum and the count are over every rank of it
    (``caller`` and ``fields`` name the call for the ranks' check). Its gradient is the
    incoming one (divided by the count in the acc type) for every row, as the other modes'
    ``sum`` (and ``/ n``) give: with a group, the gradient of the global loss with respect to
    this rank's losses. Under ``vmap`` the samples' columns are summed side by side, each its
    own exact sum (the bits of one call per sample); forward mode is refused."""

    @staticmethod
    def forward(rows, dtype, mean, caller, group, fields):
        state = _limbs.new_state(rows.shape[1], rows.dtype, rows.device)
        _kernel_ops.add_exact_terms(state, rows)
        total = rows.shape[0]
        if group is not None:
            [(state, total)] = distributed.sum_over_ranks(caller, group, [(state, total)],
                                                          fields)
            if total == 0:
                raise ValueError(f"{caller}: every rank's losses are empty; expected at least "
                                 f"one loss over the group (an empty batch has no mean)")
            if mean and total > MAX_TERMS_PER_STATE:
                raise ValueError(f"{caller}: an exact mean of {total} losses over the group; "
                                 f"mode='exact' divides by at most {MAX_TERMS_PER_STATE} "
                                 f"(reduce the sum, or average partial means)")
        return (_kernel_ops.round_exact_state(state, rows.dtype, dtype, total if mean else None),
                total)

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, _, mean, *_ = inputs
        ctx.count, ctx.shape = (output[1] if mean else None), rows.shape

    @staticmethod
    def backward(ctx, grad, _):
        wide = grad.to(acc_dtype(grad.dtype))
        if ctx.count is not None:
            wide = wide / ctx.count
        return wide.expand(ctx.shape), None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, rows, dtype, mean, caller, group, fields):
        side_by_side = rows.movedim(in_dims[0], 1)
        n, samples, k = side_by_side.shape
        total, count = _transforms.apply(_ExactSum, caller or "detsum.loss.reduce",
                                         side_by_side.reshape(n, samples * k), dtype, mean,
                                         caller, group, fields)
        return (total.view(samples, k), count), (0, None)


def _exact_sum(rows: torch.Tensor, dtype: torch.dtype, mean: bool) -> torch.Tensor:
    """:class:`_ExactSum` of one process's 1-D acc-type ``rows``: a 0-dim tensor."""
    return _transforms.apply(_ExactSum, "detsum.loss.reduce", rows.unsqueeze(1), dtype, mean,
                             None, None, None)[0].view(())


def reduce(losses: torch.Tensor, reduction: str = "mean", *, weight: torch.Tensor | None = None,
           mode: str | Mode = "fp32", group=None) -> torch.Tensor:
    """Sum or average per-sample losses in a fixed order: the same bits on every run and device.

    Args:
        losses: per-sample (or per-element) losses, any shape, float32/float16/bfloat16/float64,
            at least one element.
        reduction: ``"mean"`` (default) or ``"sum"``.
        weight: optional weights of ``losses``' shape: the weighted mean
            ``sum(weight * losses) / sum(weight)`` (``"sum"``: ``sum(weight * losses)``).
        mode: ``"fp32"`` (default), ``"kahan"`` or ``"exact"`` (the correctly rounded sum,
            whatever the order); ``"autograd"`` is refused (see the module).
        group: a ``torch.distributed`` process group whose ranks each pass their own shard of
            the losses (and weights); None (default): this process alone. With a group the
            result is the reduction over every rank's losses, the same bits on every rank and
            for every number of ranks and sharding, equal to the one-process result over all
            of them; it needs ``mode="exact"``. A shard may be empty, the group's losses not.
            A collective: every rank of the group calls it.

    Returns:
        A 0-dim tensor of ``losses``' dtype.

    Order and rounding: the elements in index order (``losses.reshape(-1)``), converted
    exactly to the acc type (fp32; fp64 for float64), weighted products rounded once to the acc
    type, summed as ``detsum.segment_sum`` does in ``mode`` (``"kahan"``: within ``Mode.KAHAN``'s
    bound of the exact sum), divided in the acc type, rounded once to the dtype. ``"exact"``: the sum (and
    the unweighted mean) of those terms is rounded once, straight to the dtype, so it is the
    correctly rounded sum (mean) for every dtype; a weighted mean divides the two correctly
    rounded acc-type sums and rounds the quotient to the dtype. Every ``"exact"`` result is
    independent of the order of the elements.

    Gradient: ``1 / n`` (``"mean"``), ``1`` (``"sum"``) or ``weight / sum(weight)`` for each
    element, computed in the acc type and rounded once. With a group, ``n`` and ``sum(weight)``
    are over the group, and each rank gets the gradient of its own losses. The same under
    ``torch.func``'s ``grad``, ``vjp``, ``jacrev`` and ``vmap``; forward mode (``jvp``,
    ``jacfwd``, ``torch.autograd.forward_ad``) raises NotImplementedError
    (docs/determinism.md).

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> loss.reduce(torch.tensor([1.0, 2.0, 4.0]), "mean")
        tensor(2.3333)
    """
    caller = "detsum.loss.reduce"
    if group is not None:
        return _reduce_over_ranks(caller, losses, reduction, weight, mode, group)
    mode, values = _reduce_arguments(caller, losses, reduction, weight, mode)
    if losses.numel() == 0:
        raise ValueError(f"{caller}: losses is empty; expected at least one loss (an empty "
                         f"batch has no mean)")
    acc = values.dtype
    if weight is not None:
        weights = weight.reshape(-1).to(acc)
        if mode == Mode.EXACT and reduction == "sum":
            return _exact_sum(values * weights, losses.dtype, False)
        total = _ordered_sum(values * weights, mode)
        if reduction == "mean":
            total = total / _ordered_sum(weights, mode)
    elif mode == Mode.EXACT:
        if reduction == "mean" and values.shape[0] > MAX_TERMS_PER_STATE:
            raise ValueError(f"{caller}: an exact mean of {values.shape[0]} losses; mode='exact' "
                             f"divides by at most {MAX_TERMS_PER_STATE} (reduce the sum, or "
                             f"average partial means)")
        return _exact_sum(values, losses.dtype, reduction == "mean")
    else:
        total = _ordered_sum(values, mode)
        if reduction == "mean":
            total = total / values.shape[0]
    return total.to(losses.dtype)


def _mode_name(mode: object) -> str:
    """How the ranks compare their ``mode`` arguments: "exact" and Mode.EXACT alike."""
    if isinstance(mode, Mode):
        return mode.value
    return mode if isinstance(mode, str) else repr(mode)


def _reduce_arguments(caller: str, losses: object, reduction: object, weight: object,
                      mode: object) -> tuple[Mode, torch.Tensor]:
    """The checks every ``reduce`` makes; returns the mode and the losses as a 1-D tensor of
    the acc type (an exact conversion)."""
    mode = _parse_mode(mode, caller)
    _check_float_tensor(caller, "losses", losses)
    current_backend(losses.device.type, caller)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{caller}: reduction={reduction!r}; expected one of {REDUCTIONS}")
    if weight is not None:
        _check_float_tensor(caller, "weight", weight)
        if weight.shape != losses.shape:
            raise ValueError(f"{caller}: weight has shape {tuple(weight.shape)}; expected "
                             f"losses' shape {tuple(losses.shape)}")
        _validation.check_same_device(caller, losses=losses, weight=weight)
    return mode, losses.reshape(-1).to(acc_dtype(losses.dtype))


def _exact_over_ranks(caller: str, mode: Mode) -> None:
    if mode is not Mode.EXACT:
        raise ValueError(f"{caller}: mode={mode.value!r} with a group; expected mode='exact': "
                         f"{distributed.EXACT_ONLY}")


def _reduce_over_ranks(caller, losses, reduction, weight, mode, group) -> torch.Tensor:
    distributed.check_group(caller, group, none_means="this process alone")
    fields = {"mode": _mode_name(mode), "reduction": reduction,
              "dtype of losses": getattr(losses, "dtype", None),
              "weight": "given" if weight is not None else None}
    try:
        mode, values = _reduce_arguments(caller, losses, reduction, weight, mode)
        acc = values.dtype
        _exact_over_ranks(caller, mode)
    except (TypeError, ValueError) as error:
        distributed.fail_together(
            caller, group, {**fields, "arguments": distributed.describe_error(error)}, error)
    fields["arguments"] = "valid"
    if weight is None:
        total, _ = _transforms.apply(_ExactSum, caller, values.unsqueeze(1), losses.dtype,
                                     reduction == "mean", caller, group, fields)
        return total.view(())
    weighted = values * weight.reshape(-1).to(acc)
    if reduction == "sum":
        return _transforms.apply(_ExactSum, caller, weighted.unsqueeze(1), losses.dtype, False,
                                 caller, group, fields)[0].view(())
    # As the one-process weighted mean: two sums correctly rounded to the acc type, divided.
    sums, _ = _transforms.apply(_ExactSum, caller,
                                torch.stack([weighted, weight.reshape(-1).to(acc)], 1), acc,
                                False, caller, group, fields)
    return (sums[0] / sums[1]).to(losses.dtype)


# ---- per-sample gradients and their reduction -------------------------------------------------

def _check_batch(caller: str, model: object, inputs: object, targets: object, *,
                 allow_empty: bool = False) -> int:
    """The batch size, after checking the arguments every gradient function shares (an empty
    batch only with ``allow_empty``: a rank's shard may be)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}")
    for name, t in (("inputs", inputs), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{caller}: {name} is 0-dim; expected a batch dimension first")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(f"{caller}: inputs has {inputs.shape[0]} samples but targets has "
                         f"{targets.shape[0]}; expected the same batch size")
    if inputs.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{caller}: the batch is empty (inputs has shape "
                         f"{tuple(inputs.shape)}); expected at least one sample")
    return inputs.shape[0]


def _check_positive(caller: str, name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{caller}: {name}={value!r}; expected a positive int or None")
    return value



#: Why per_sample_grads and batch_grad refuse to run inside a torch.func transform.
_OWN_AUTOGRAD = ("it runs torch.autograd on the model itself, which a transform refuses inside "
                 "it: call it outside the transform (its gradients are per sample already)")



def per_sample_grads(model: torch.nn.Module, loss_fn, inputs: torch.Tensor,
                     targets: torch.Tensor, *, chunk_size: int | None = None
                     ) -> dict[str, torch.Tensor]:
    """The gradient of every sample's own loss, for every trainable parameter.

    Args:
        model: any module whose forward takes a batch ``inputs[i:j]``; its trainable
            parameters (``requires_grad``) get gradients, its buffers are used as they are.
            Its forward must be a deterministic function of the sample: ``model.eval()`` for
            dropout and batch-norm statistics (a forward that draws random numbers is refused,
            and so is one that mutates its buffers), no state changed between calls.
        loss_fn: ``loss_fn(outputs, targets)`` returning one loss per sample, shape ``[batch]``
            (e.g. ``nn.CrossEntropyLoss(reduction="none")``).
        inputs, targets: tensors whose first dimension is the batch.
        chunk_size: accepted for calls written for earlier versions (where it set how many
            samples were evaluated together); a positive int or None, and it changes nothing.

    Returns:
        ``{name: [batch, *param.shape]}`` in ``model.named_parameters()`` order, in each
        parameter's dtype; the output itself is batch x parameters.

    Split invariance: every sample is evaluated alone, as a batch of one copied into fresh
    storage, through the model's forward and ``torch.autograd.grad`` of its loss. A sample's
    gradient therefore has the same bits in any batch, at any position, for any split, on
    the same device, torch build and thread count; evaluated inside a batch, matmul kernels
    would choose its arithmetic by the number of rows and by where its row sits in memory
    (docs/loss.md). The intermediates held at once are one sample's.

    ``nn.Linear`` weights: for a layer the sample's forward uses once on its one row, autograd
    is asked for the gradient of the layer's output, and the weight's row is formed from it
    as the outer product ``output_grad (x) input``, each element one IEEE product: the values
    of autograd's own matrix product of inner dimension 1, with a product's zero sign (torch's
    bf16 and fp16 matrix products give +0.0 for ``0 * -1``). ``batch_grad`` never forms these
    rows at all (:class:`OuterProducts`).

    Raises:
        ValueError: the forward draws random numbers from torch's generator (checked on every
            call), or, checked on a model's first call, sample 0 evaluated twice gives two
            gradients: its per-sample gradients would depend on the batch split.
        RuntimeError: called inside a ``torch.func`` transform or a forward-mode level: it runs
            ``torch.autograd`` itself, which a transform refuses inside it.

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> model = torch.nn.Linear(3, 2)
        >>> grads = loss.per_sample_grads(model, torch.nn.CrossEntropyLoss(reduction="none"),
        ...                               torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1]))
        >>> {name: tuple(g.shape) for name, g in grads.items()}
        {'weight': (5, 2, 3), 'bias': (5, 2)}
    """
    caller = "detsum.loss.per_sample_grads"
    _transforms.refuse_inside(caller, _OWN_AUTOGRAD)
    batch = _check_batch(caller, model, inputs, targets)
    _check_positive(caller, "chunk_size", chunk_size)
    gradients = SampleGradients(caller, model, loss_fn)
    grads = {}
    for i, gradient in enumerate(gradients.each(inputs, targets, 0, batch)):
        for name, g in gradient.items():
            if i == 0:
                p = gradients.trainable[name]
                grads[name] = torch.empty((batch, *p.shape), dtype=p.dtype, device=p.device)
            if isinstance(g, OuterProducts):
                torch.mul(g.left.unsqueeze(1), g.right, out=grads[name][i])
            else:
                grads[name][i].copy_(g)
    return grads



class _ExactColumns:
    """The ``"exact"`` states of every parameter of one dtype and device, side by side as the
    columns of one state: adding a chunk is one step per parameter, but rounding and a sum
    over ranks are one for all of them, whatever their number (a model of many small
    parameters would otherwise pay a rounding's hundred-odd torch calls for each)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device, self.acc = dtype, device, acc_dtype(dtype)
        #: name -> (first column, last column + 1, the parameter's shape)
        self.columns: dict[str, tuple[int, int, torch.Size]] = {}
        self.numel = 0
        self.state: torch.Tensor | None = None

    def place(self, name: str, shape: torch.Size) -> None:
        self.columns[name] = (self.numel, self.numel + shape.numel(), shape)
        self.numel += shape.numel()

    def allocate(self) -> None:
        self.state = _limbs.new_state(self.numel, self.acc, self.device)

    def add(self, name: str, rows: torch.Tensor | OuterProducts) -> None:
        start, stop, _ = self.columns[name]
        if isinstance(rows, OuterProducts):
            _kernel_ops.add_exact_outer_products(self.state[:, start:stop], rows.left,
                                                 rows.right, self.acc)
        else:
            _kernel_ops.add_exact_terms(self.state[:, start:stop],
                                        rows.reshape(rows.shape[0], stop - start).to(self.acc))

    def split(self, state: torch.Tensor, count: int | None) -> dict[str, torch.Tensor]:
        """``state`` (this block's, or its sum over ranks) rounded once to the dtype (divided
        by ``count`` first, exactly, where given), one view per parameter."""
        values = _kernel_ops.round_exact_state(state, self.acc, self.dtype, count)
        return {name: values[start:stop].view(shape)
                for name, (start, stop, shape) in self.columns.items()}


def _sample_count(g: object) -> int | None:
    """How many samples a value of ``GradAccumulator.add`` holds, or None if it is none of
    the forms accepted."""
    if isinstance(g, OuterProducts):
        left, right = g
        if (isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)
                and left.dim() == right.dim() == 2 and left.shape[0] == right.shape[0]):
            return left.shape[0]
        return None
    return g.shape[0] if isinstance(g, torch.Tensor) and g.dim() else None


class GradAccumulator:
    """The deterministic sum of per-sample gradients that arrive in chunks.

    Each parameter's gradients are summed over samples in the order added (sample 0, 1, ...),
    in ``mode``, by a :class:`detsum.RunningSum`: the result has the bits of one
    ``detsum.segment_sum`` over all the samples at once, however the samples were split into
    chunks (1, 3 or all at a time give the same bits).

    Args:
        named_parameters: ``model.named_parameters()`` (or any ``(name, tensor)`` pairs);
            those with ``requires_grad=False`` are skipped, as in :func:`per_sample_grads`.
        mode: ``"fp32"`` (default), ``"kahan"`` or ``"exact"``; ``"autograd"`` is refused.
        group: a ``torch.distributed`` process group whose ranks each add their own shard of
            the samples; None (default): this process alone. With a group, ``result()`` is
            the sum (mean) over every rank's samples, with their total count: the same bits
            on every rank, for every number of ranks and sharding, equal to one accumulator
            fed every sample; it needs ``mode="exact"``. Creating the accumulator and
            ``result()`` are collectives (every rank of the group calls them); the first checks
            that the ranks agree on the mode and the parameters' names, shapes and dtypes, once.
            ``add`` and ``count`` stay local.

    Memory: two (``"fp32"``) or four (``"kahan"``) acc-type copies of the parameters;
    ``"exact"``: 112 bytes per fp32 parameter (:class:`detsum.RunningSum`).

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> model = torch.nn.Linear(3, 2)
        >>> lossf = torch.nn.CrossEntropyLoss(reduction="none")
        >>> x, y = torch.randn(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
        >>> accumulator = loss.GradAccumulator(model.named_parameters())
        >>> for start in range(0, 6, 4):
        ...     accumulator.add(loss.per_sample_grads(model, lossf, x[start:start + 4],
        ...                                           y[start:start + 4]))
        >>> mean = accumulator.result("mean")
        >>> at_once = loss.batch_grad(model, lossf, x, y)
        >>> torch.equal(mean["weight"], at_once["weight"])
        True
    """

    def __init__(self, named_parameters, *, mode: str | Mode = "fp32", group=None,
                 _caller: str = "detsum.loss.GradAccumulator"):
        # _caller: the function an error names (batch_grad makes one of these).
        caller = _caller
        if group is not None:
            distributed.check_group(caller, group, none_means="this process alone")
        self.mode = _parse_mode(mode, caller)
        params = trainable_parameters(named_parameters, caller)
        if not params:
            what = ("model has no parameter" if caller != "detsum.loss.GradAccumulator"
                    else "named_parameters holds no tensor")
            raise ValueError(f"{caller}: {what} with requires_grad=True")
        #: name -> (shape, dtype, device) of every parameter.
        self._params = {name: (p.shape, p.dtype, p.device) for name, p in params.items()}
        self._sums: dict[str, RunningSum] = {}
        self._blocks: dict[tuple, _ExactColumns] = {}
        if self.mode is Mode.EXACT:
            for name, p in params.items():
                key = (p.dtype, p.device)
                self._blocks.setdefault(key, _ExactColumns(p.dtype, p.device)).place(name,
                                                                                     p.shape)
            for block in self._blocks.values():
                block.allocate()
        else:
            self._sums = {name: RunningSum(p.shape, dtype=p.dtype, device=p.device,
                                           mode=self.mode) for name, p in params.items()}
        #: Samples added so far (on this rank).
        self.count = 0
        #: The process group ``result()`` sums over (None: this process alone).
        self.group = None
        self._summed: list[torch.Tensor] | None = None  # where result() puts the sum over ranks
        if group is not None:
            self._join(caller, group, {}, check_now=True)

    def _join(self, caller: str, group, fields: dict, *, check_now: bool) -> None:
        """Sum over the ranks of ``group`` from now on. Every ``result()`` checks that the
        ranks agree on the parameters' names, shapes and dtypes, the mode and ``fields``;
        ``check_now`` checks it at once too, in a collective of its own."""
        self._fields = {**fields, "mode": self.mode.value,
                        "parameter names": tuple(self._params)}
        for name, (shape, dtype, _) in self._params.items():
            self._fields[f"shape and dtype of {name!r}"] = (tuple(shape), dtype)
        if check_now:
            distributed.agree(caller, group, self._fields)
        _exact_over_ranks(caller, self.mode)
        self.group = group

    def add(self, per_sample_grads: dict[str, torch.Tensor | OuterProducts]) -> None:
        """Add the next samples' gradients: ``{name: [k, *param.shape]}`` for every parameter,
        where a matrix's may also be its factors, an :class:`OuterProducts` of ``[k, O]``
        and ``[k, K]`` for a parameter of shape ``[O, K]`` (the same sum, bit for bit).
        A tensor of a ``torch.func`` transform, or one that carries a forward-mode tangent,
        raises RuntimeError: the sums outlive the transform and have no gradient."""
        caller = "detsum.loss.GradAccumulator.add"
        if not isinstance(per_sample_grads, dict):
            raise TypeError(f"{caller}: per_sample_grads must be a dict of tensors by parameter "
                            f"name, got {type(per_sample_grads).__name__}")
        if per_sample_grads.keys() != self._params.keys():
            missing = sorted(self._params.keys() - per_sample_grads.keys())
            extra = sorted(per_sample_grads.keys() - self._params.keys())
            raise ValueError(f"{caller}: per_sample_grads has other parameters than the "
                             f"accumulator: missing {missing}, unexpected {extra}")
        for name, g in per_sample_grads.items():
            if not isinstance(g, (torch.Tensor, OuterProducts)):
                raise TypeError(f"{caller}: per_sample_grads[{name!r}] is a "
                                f"{type(g).__name__}; expected a tensor [k, *param.shape] or "
                                f"OuterProducts of [k, O] and [k, K]")
        counts = {name: _sample_count(g) for name, g in per_sample_grads.items()}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise ValueError(f"{caller}: every gradient needs the same number of samples "
                             f"first; got {counts}")
        # Checked for every parameter before any is added: a bad chunk changes nothing.
        for name, g in per_sample_grads.items():
            shape, dtype, device = self._params[name]
            # The device as tensors report it ("cuda" -> "cuda:0"), as RunningSum keeps it.
            device = torch.empty(0, device=device).device
            if isinstance(g, OuterProducts):
                factors = [(g.left.dtype, g.left.device), (g.right.dtype, g.right.device)]
                if (len(shape) != 2 or factors != [(dtype, device)] * 2
                        or (g.left.shape[1], g.right.shape[1]) != tuple(shape)):
                    raise ValueError(
                        f"{caller}: per_sample_grads[{name!r}] is OuterProducts of "
                        f"{g.left.dtype} {tuple(g.left.shape)} on {g.left.device} and "
                        f"{g.right.dtype} {tuple(g.right.shape)} on {g.right.device}; expected "
                        f"{dtype} [k, O] and [k, K] on {device} for a parameter of shape "
                        f"{tuple(shape)} = [O, K]")
            elif g.dtype != dtype or g.shape[1:] != shape or g.device != device:
                raise ValueError(
                    f"{caller}: per_sample_grads[{name!r}] is {g.dtype} "
                    f"{tuple(g.shape)} on {g.device}; expected {dtype} "
                    f"[k, {', '.join(map(str, shape))}] on {device}")
            factors = [("left", g.left), ("right", g.right)] if isinstance(g, OuterProducts) \
                else [("", g)]
            for part, t in factors:
                _transforms.refuse_transformed(
                    caller, f"per_sample_grads[{name!r}]" + (f".{part}" if part else ""), t,
                    "a GradAccumulator keeps its sums between calls, outside every transform, "
                    "and has no gradient: add gradients computed outside the transform (those "
                    "that torch.func.vmap(torch.func.grad(...)) returns are)")
        if self.mode is Mode.EXACT:
            for block in self._blocks.values():
                _validation.check_changeable(
                    caller, "the accumulator's state", block.state,
                    remedy="make the accumulator outside torch.inference_mode()")
        else:
            for running in self._sums.values():
                running._check_changeable(caller, "accumulator")
        k = next(iter(counts.values()))
        for name, g in per_sample_grads.items():
            if self.mode is Mode.EXACT:
                shape, dtype, device = self._params[name]
                self._blocks[(dtype, device)].add(name, g)
            elif isinstance(g, OuterProducts):
                self._sums[name]._add_products(g.left, g.right)
            else:
                self._sums[name].add(g)
        self.count += k

    def result(self, reduction: str = "mean") -> dict[str, torch.Tensor]:
        """``{name: gradient}``: the sum over every sample added, or that sum divided by their
        count in the acc type (``"mean"``), rounded once to the parameter's dtype."""
        caller = "detsum.loss.GradAccumulator.result"
        if reduction not in REDUCTIONS:
            raise ValueError(f"{caller}: reduction={reduction!r}; expected one of {REDUCTIONS}")
        if self.group is not None:
            return self._result_over_ranks(caller, reduction)
        if self.count == 0:
            raise ValueError(f"{caller}: no samples were added; an empty batch has no gradient")
        if self.mode is Mode.EXACT:
            return self._rounded([block.state for block in self._blocks.values()],
                                 self.count, reduction, caller, "samples were added")
        return {name: running.mean() if reduction == "mean" else running.sum()
                for name, running in self._sums.items()}

    def _rounded(self, states: list[torch.Tensor], count: int, reduction: str, caller: str,
                 counted: str) -> dict[str, torch.Tensor]:
        """The exact blocks' ``states`` (of ``count`` samples) rounded once, by parameter in
        ``named_parameters`` order."""
        if reduction == "mean" and count > MAX_TERMS_PER_STATE:
            raise ValueError(f"{caller}: {count} {counted}; an exact mean divides by at most "
                             f"{MAX_TERMS_PER_STATE} (use reduction='sum')")
        rounded = {}
        for block, state in zip(self._blocks.values(), states):
            rounded.update(block.split(state, count if reduction == "mean" else None))
        return {name: rounded[name] for name in self._params}

    def _result_over_ranks(self, caller: str, reduction: str,
                           failure: Exception | None = None, *, last: bool = False
                           ) -> dict[str, torch.Tensor]:
        """``result()`` over the group; a rank whose own work raised ``failure`` still sends
        its header, so that every rank raises instead of waiting for it. ``last``: nothing
        will be added or asked of this accumulator again, so the sum may overwrite its state
        (a fresh state of a large model costs a page fault per 4 KiB on first touch)."""
        fields = {**self._fields, "per-sample gradients": "computed" if failure is None else
                  "failed with " + distributed.describe_error(failure)}
        states = [(block.state, self.count) for block in self._blocks.values()]
        if last:
            out = [state for state, _ in states]
        else:
            if self._summed is None:
                self._summed = [torch.empty_like(state) for state, _ in states]
            out = self._summed
        summed = distributed.sum_over_ranks(caller, self.group, states, fields, out=out,
                                            local_error=failure)
        total = summed[0][1]
        if total == 0:
            raise ValueError(f"{caller}: no rank of the group added a sample; an empty batch "
                             f"has no gradient")
        return self._rounded([state for state, _ in summed], total, reduction, caller,
                             "samples over the group")


def batch_grad(model: torch.nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor, *,
               reduction: str = "mean", mode: str | Mode = "fp32",
               microbatch_size: int | None = None, chunk_size: int | None = 32,
               group=None) -> dict[str, torch.Tensor]:
    """The gradient of the batch's reduced loss, the same bits for every micro-batch split.

    The gradient is computed as per-sample gradients (:func:`per_sample_grads`: each sample
    evaluated alone) summed in the canonical order, sample 0, 1, ..., by a
    :class:`GradAccumulator` whose state is carried across micro-batches in the acc type, then
    divided by the batch size (``"mean"``). An ``nn.Linear`` weight's per-sample gradients
    are summed from their factors, the layer's output gradient and input
    (:class:`OuterProducts`), without being formed: the same bits, at a quarter of the time
    of forming them on the benchmark's MLP.

    Args:
        model, loss_fn, inputs, targets: as for :func:`per_sample_grads`.
        reduction: ``"mean"`` (default) or ``"sum"``.
        mode: ``"fp32"`` (default), ``"kahan"`` or ``"exact"``; ``"autograd"`` is refused.
        microbatch_size: samples per micro-batch, as a gradient-accumulation loop would split
            the batch; None: one micro-batch. It never changes the result.
        chunk_size: per-sample gradients gathered before each addition to the accumulator
            (default 32): the memory bound, about ``chunk_size`` x parameters, and how often
            the reduction reads its running state. None gathers each whole micro-batch. It
            never changes the result.
        group: a ``torch.distributed`` process group whose ranks each pass their own shard of
            the batch (``inputs``, ``targets``: any samples, any number of them, zero
            included); None (default): this process alone. With a group and ``mode="exact"``
            the result is the gradient over every rank's samples (the mean divides by their
            total count): the same bits on every rank, for every number of ranks and every
            sharding, equal to ``batch_grad(mode="exact")`` in one process on all the samples
            (on one machine type, torch build and thread count: the per-sample gradients come
            from torch's kernels). Other modes are refused with a group. A collective, one
            all-reduce for a model whose state fits in its header, two for a larger one
            (docs/distributed.md): every rank of the group calls it, and the first all-reduce
            checks that the ranks agree on the parameters, mode and reduction. An error
            found on one rank (its shard's checks, its per-sample gradients) is raised on
            every rank, naming that rank.

    Returns:
        ``{name: gradient}`` for every trainable parameter, in its dtype.

    Raises:
        ValueError: the model's forward is not a deterministic function of one sample (it draws
            random numbers, or, checked the first time a model is used, evaluating its first
            sample twice gives two results); see :func:`per_sample_grads`.
        RuntimeError: called inside a ``torch.func`` transform or a forward-mode level, as
            :func:`per_sample_grads`.

    What is invariant: each sample's gradient has the same bits whatever batch, position,
    ``microbatch_size`` or ``chunk_size`` it is evaluated with (it is evaluated alone, in
    fresh storage), and the reduction gives the same bits for any split of the same
    per-sample gradients. So the result depends on the model, the samples and their order
    only, on a given device, torch build and thread count. What is not: the per-sample
    gradients come from torch's kernels, so a CPU and a GPU, or two builds of torch, may give
    other bits; and they differ in their last bits from what autograd's batched backward
    computes (docs/loss.md).

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> model = torch.nn.Linear(3, 2)
        >>> lossf = torch.nn.CrossEntropyLoss(reduction="none")
        >>> x, y = torch.randn(7, 3), torch.tensor([0, 1, 1, 0, 1, 0, 0])
        >>> whole = loss.batch_grad(model, lossf, x, y)
        >>> split = loss.batch_grad(model, lossf, x, y, microbatch_size=3, chunk_size=2)
        >>> all(torch.equal(whole[name], split[name]) for name in whole)
        True
    """
    caller = "detsum.loss.batch_grad"
    _transforms.refuse_inside(caller, _OWN_AUTOGRAD)
    if group is not None:
        distributed.check_group(caller, group, none_means="this process alone")
    try:
        batch = _check_batch(caller, model, inputs, targets, allow_empty=group is not None)
        if reduction not in REDUCTIONS:
            raise ValueError(f"{caller}: reduction={reduction!r}; expected one of "
                             f"{REDUCTIONS}")
        microbatch = _check_positive(caller, "microbatch_size", microbatch_size) or batch
        width = min(_check_positive(caller, "chunk_size", chunk_size) or microbatch,
                    microbatch, batch)
        accumulator = GradAccumulator(model.named_parameters(), mode=mode, _caller=caller)
        if group is not None:
            accumulator._join(caller, group, {"arguments": "valid", "reduction": reduction},
                              check_now=False)
    except (TypeError, ValueError) as error:
        if group is None:
            raise
        # A shard that fails its checks on one rank fails the call on every rank, with its
        # reason, instead of leaving the others waiting in the collective.
        distributed.fail_together(caller, group,
                                  {"arguments": distributed.describe_error(error)}, error)
    if group is None:
        _accumulate(caller, model, loss_fn, inputs, targets, accumulator, batch, microbatch,
                    width)
        return accumulator.result(reduction)
    try:
        _accumulate(caller, model, loss_fn, inputs, targets, accumulator, batch, microbatch,
                    width)
    except Exception as error:  # the same reason: every rank is told, none waits
        return accumulator._result_over_ranks(caller, reduction, failure=error)
    return accumulator._result_over_ranks(caller, reduction, last=True)


def _accumulate(caller, model, loss_fn, inputs, targets, accumulator, batch, microbatch, width):
    """``batch_grad``'s loop: every sample's gradient, alone, into ``accumulator`` in order."""
    if batch == 0:
        return
    gradients = SampleGradients(caller, model, loss_fn)
    # One buffer of `width` rows per parameter (or per factor) for the whole call: a fresh one
    # per chunk would be paged in again every time (on the CPU we measured, as slow as the
    # gradients' writes). A weight's factors and its formed rows are both kept where its
    # samples come both ways (a sample evaluated generically); formed rows then serve the chunk.
    rows: dict[str, torch.Tensor] = {}
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for start in range(0, batch, microbatch):
        stop = min(start + microbatch, batch)
        for first in range(start, stop, width):
            count = min(width, stop - first)
            factored: dict[str, list[bool]] = {}
            for k, gradient in enumerate(gradients.each(inputs, targets, first, first + count)):
                for name, g in gradient.items():
                    if isinstance(g, OuterProducts):
                        if name not in factors:
                            factors[name] = (g.left.new_empty((width, g.left.shape[0])),
                                             g.right.new_empty((width, g.right.shape[0])))
                        factors[name][0][k].copy_(g.left)
                        factors[name][1][k].copy_(g.right)
                    else:
                        if name not in rows:
                            rows[name] = g.new_empty((width, *g.shape))
                        rows[name][k].copy_(g)
                    factored.setdefault(name, []).append(isinstance(g, OuterProducts))
            chunk = {}
            for name, ways in factored.items():
                if all(ways):
                    chunk[name] = OuterProducts(factors[name][0][:count],
                                                factors[name][1][:count])
                    continue
                for k, was_factored in enumerate(ways):
                    if was_factored:
                        torch.mul(factors[name][0][k].unsqueeze(1), factors[name][1][k],
                                  out=rows[name][k])
                chunk[name] = rows[name][:count]
            accumulator.add(chunk)
