"""Deterministic batch-loss and per-sample-gradient reduction (docs/loss.md).

- ``reduce``: a batch's losses summed or averaged in index order;
- ``per_sample_grads``: every sample's gradient, by ``torch.func``;
- ``GradAccumulator``: per-sample gradients summed over samples in order, in chunks of any size;
- ``batch_grad``: the reduced loss's gradient as that ordered sum, the same bits for every
  micro-batch split.

Every sum here goes through detsum's kernels in the canonical order (``segment_sum``, or a
``RunningSum`` that continues it across calls), so the result has one order on every run,
thread count and device; ``torch.sum`` picks its own order (a vectorised cascade on CPU, a
tree on GPU) and so does matmul inside autograd. ``"autograd"`` mode has no meaning here
(autograd's batch reduction order lives inside matmul kernels), and is refused."""

from __future__ import annotations

import torch

from detsum import _segments, _validation
from detsum.modes import Mode, acc_dtype, parse_ordered_mode
from detsum.ops.running_sum import RunningSum

__all__ = ["GradAccumulator", "batch_grad", "per_sample_grads", "reduce"]

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
    return torch.ops.detsum.segment_sum(values, offsets, 0, None, mode.value).view(())


def reduce(losses: torch.Tensor, reduction: str = "mean", *, weight: torch.Tensor | None = None,
           mode: str | Mode = "fp32") -> torch.Tensor:
    """Sum or average per-sample losses in a fixed order: the same bits on every run and device.

    Args:
        losses: per-sample (or per-element) losses, any shape, float32/float16/bfloat16/float64,
            at least one element.
        reduction: ``"mean"`` (default) or ``"sum"``.
        weight: optional weights of ``losses``' shape: the weighted mean
            ``sum(weight * losses) / sum(weight)`` (``"sum"``: ``sum(weight * losses)``).
        mode: ``"fp32"`` (default) or ``"kahan"``; ``"autograd"`` is refused (see the module).

    Returns:
        A 0-dim tensor of ``losses``' dtype.

    Order and rounding: the elements in index order (``losses.reshape(-1)``), converted
    exactly to the acc type (fp32; fp64 for float64), weighted products rounded once to the acc
    type, summed as ``detsum.segment_sum`` does in ``mode`` (``"kahan"``: within 1 ulp of the
    exact sum), divided in the acc type, rounded once to the dtype.

    Gradient: ``1 / n`` (``"mean"``), ``1`` (``"sum"``) or ``weight / sum(weight)`` for each
    element, computed in the acc type and rounded once.

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> loss.reduce(torch.tensor([1.0, 2.0, 4.0]), "mean")
        tensor(2.3333)
    """
    caller = "detsum.loss.reduce"
    mode = _parse_mode(mode, caller)
    _check_float_tensor(caller, "losses", losses)
    if losses.numel() == 0:
        raise ValueError(f"{caller}: losses is empty; expected at least one loss (an empty "
                         f"batch has no mean)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{caller}: reduction={reduction!r}; expected one of {REDUCTIONS}")
    acc = acc_dtype(losses.dtype)
    values = losses.reshape(-1).to(acc)
    if weight is not None:
        _check_float_tensor(caller, "weight", weight)
        if weight.shape != losses.shape:
            raise ValueError(f"{caller}: weight has shape {tuple(weight.shape)}; expected "
                             f"losses' shape {tuple(losses.shape)}")
        _validation.check_same_device(caller, losses=losses, weight=weight)
        weights = weight.reshape(-1).to(acc)
        total = _ordered_sum(values * weights, mode)
        if reduction == "mean":
            total = total / _ordered_sum(weights, mode)
    else:
        total = _ordered_sum(values, mode)
        if reduction == "mean":
            total = total / values.shape[0]
    return total.to(losses.dtype)


# ---- per-sample gradients and their reduction -------------------------------------------------

def _check_batch(caller: str, model: object, inputs: object, targets: object) -> int:
    """The batch size, after checking the arguments every gradient function shares."""
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
    if inputs.shape[0] == 0:
        raise ValueError(f"{caller}: the batch is empty (inputs has shape "
                         f"{tuple(inputs.shape)}); expected at least one sample")
    return inputs.shape[0]


def _check_positive(caller: str, name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{caller}: {name}={value!r}; expected a positive int or None")
    return value


def _trainable(named_parameters) -> dict[str, torch.Tensor]:
    return {name: p for name, p in named_parameters if p.requires_grad}


def _gradient_function(caller: str, model: torch.nn.Module, loss_fn):
    """vmap(grad) of one sample's loss: the parameters' gradients for every sample of a block."""
    from torch.func import functional_call, grad, vmap

    def sample_loss(params, x, y):
        losses = loss_fn(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))
        if not isinstance(losses, torch.Tensor) or losses.shape != (1,):
            got = (f"shape {tuple(losses.shape)}" if isinstance(losses, torch.Tensor)
                   else type(losses).__name__)
            raise ValueError(
                f"{caller}: loss_fn returned {got} for a batch of 1 sample; expected one loss "
                f"per sample, shape [batch] (e.g. nn.CrossEntropyLoss(reduction='none'), not "
                f"a 'mean' or 'sum' reduced scalar)")
        return losses[0]

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))


def _blocks(inputs, targets, width: int | None):
    """(inputs, targets, real samples) in blocks of exactly ``width`` samples (the whole batch
    when None); the last block is padded by repeating its last sample."""
    batch = inputs.shape[0]
    width = batch if width is None else width
    for start in range(0, batch, width):
        x, y = inputs[start:start + width], targets[start:start + width]
        real = x.shape[0]
        if real < width:
            x = torch.cat([x, x[-1:].expand(width - real, *x.shape[1:])])
            y = torch.cat([y, y[-1:].expand(width - real, *y.shape[1:])])
        yield x, y, real


def per_sample_grads(model: torch.nn.Module, loss_fn, inputs: torch.Tensor,
                     targets: torch.Tensor, *, chunk_size: int | None = None
                     ) -> dict[str, torch.Tensor]:
    """The gradient of every sample's own loss, for every trainable parameter.

    Args:
        model: any module whose forward takes a batch ``inputs[i:j]``; its trainable
            parameters (``requires_grad``) get gradients, its buffers are used as they are.
            Dropout and batch-norm statistics must be off (``model.eval()``): per-sample
            gradients of a forward that mixes samples or draws random numbers are not defined.
        loss_fn: ``loss_fn(outputs, targets)`` returning one loss per sample, shape ``[batch]``
            (e.g. ``nn.CrossEntropyLoss(reduction="none")``).
        inputs, targets: tensors whose first dimension is the batch.
        chunk_size: samples per evaluation. None (default): the whole batch at once. A number
            bounds memory to that many samples' intermediates, and every evaluation then has
            exactly that many samples (the last block is padded with copies of its last sample,
            whose gradients are dropped), so a sample's gradient has the same bits in any batch
            it arrives in: matmul kernels pick their arithmetic by the number of rows.

    Returns:
        ``{name: [batch, *param.shape]}`` in ``model.named_parameters()`` order, in each
        parameter's dtype; the output itself is batch x parameters.

    Computed with ``torch.func``: ``vmap(grad(loss of one sample))`` over the batch, with the
    parameters passed through ``functional_call``.

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
    _check_batch(caller, model, inputs, targets)
    width = _check_positive(caller, "chunk_size", chunk_size)
    params = {name: p.detach() for name, p in _trainable(model.named_parameters()).items()}
    if not params:
        raise ValueError(f"{caller}: model has no parameter with requires_grad=True")
    gradient = _gradient_function(caller, model, loss_fn)
    # A padded block's rows are copied out, so the padding's memory is not kept alive.
    blocks = [{name: g if real == g.shape[0] else g[:real].clone()
               for name, g in gradient(params, x, y).items()}
              for x, y, real in _blocks(inputs, targets, width)]
    if len(blocks) == 1:
        return blocks[0]
    return {name: torch.cat([block[name] for block in blocks]) for name in params}


class GradAccumulator:
    """The deterministic sum of per-sample gradients that arrive in chunks.

    Each parameter's gradients are summed over samples in the order added (sample 0, 1, ...),
    in ``mode``, by a :class:`detsum.RunningSum`: the result has the bits of one
    ``detsum.segment_sum`` over all the samples at once, however the samples were split into
    chunks (1, 3 or all at a time give the same bits).

    Args:
        named_parameters: ``model.named_parameters()`` (or any ``(name, tensor)`` pairs);
            those with ``requires_grad=False`` are skipped, as in :func:`per_sample_grads`.
        mode: ``"fp32"`` (default) or ``"kahan"``; ``"autograd"`` is refused.

    Memory: two (``"fp32"``) or four (``"kahan"``) acc-type copies of the parameters.

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> model = torch.nn.Linear(3, 2)
        >>> lossf = torch.nn.CrossEntropyLoss(reduction="none")
        >>> x, y = torch.randn(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
        >>> accumulator = loss.GradAccumulator(model.named_parameters())
        >>> for start in range(0, 6, 4):
        ...     accumulator.add(loss.per_sample_grads(model, lossf, x[start:start + 4],
        ...                                           y[start:start + 4], chunk_size=4))
        >>> mean = accumulator.result("mean")
        >>> at_once = loss.batch_grad(model, lossf, x, y, chunk_size=4)
        >>> torch.equal(mean["weight"], at_once["weight"])
        True
    """

    def __init__(self, named_parameters, *, mode: str | Mode = "fp32"):
        caller = "detsum.loss.GradAccumulator"
        self.mode = _parse_mode(mode, caller)
        params = _trainable(named_parameters)
        if not params:
            raise ValueError(f"{caller}: named_parameters holds no tensor with "
                             f"requires_grad=True")
        self._sums = {name: RunningSum(p.shape, dtype=p.dtype, device=p.device, mode=self.mode)
                      for name, p in params.items()}
        #: Samples added so far.
        self.count = 0

    def add(self, per_sample_grads: dict[str, torch.Tensor]) -> None:
        """Add the next samples' gradients: ``{name: [k, *param.shape]}`` for every parameter."""
        caller = "detsum.loss.GradAccumulator.add"
        if not isinstance(per_sample_grads, dict):
            raise TypeError(f"{caller}: per_sample_grads must be a dict of tensors by parameter "
                            f"name, got {type(per_sample_grads).__name__}")
        if per_sample_grads.keys() != self._sums.keys():
            missing = sorted(self._sums.keys() - per_sample_grads.keys())
            extra = sorted(per_sample_grads.keys() - self._sums.keys())
            raise ValueError(f"{caller}: per_sample_grads has other parameters than the "
                             f"accumulator: missing {missing}, unexpected {extra}")
        counts = {name: g.shape[0] if isinstance(g, torch.Tensor) and g.dim() else None
                  for name, g in per_sample_grads.items()}
        if len(set(counts.values())) != 1 or None in counts.values():
            raise ValueError(f"{caller}: every gradient needs the same number of samples "
                             f"first; got {counts}")
        # Checked for every parameter before any is added: a bad chunk changes nothing.
        for name, g in per_sample_grads.items():
            running = self._sums[name]
            if g.dtype != running.dtype or g.shape[1:] != running.shape or (
                    g.device != running.device):
                raise ValueError(
                    f"{caller}: per_sample_grads[{name!r}] is {g.dtype} "
                    f"{tuple(g.shape)} on {g.device}; expected {running.dtype} "
                    f"[k, {', '.join(map(str, running.shape))}] on {running.device}")
        for name, g in per_sample_grads.items():
            self._sums[name].add(g)
        self.count += next(iter(counts.values()))

    def result(self, reduction: str = "mean") -> dict[str, torch.Tensor]:
        """``{name: gradient}``: the sum over every sample added, or that sum divided by their
        count in the acc type (``"mean"``), rounded once to the parameter's dtype."""
        caller = "detsum.loss.GradAccumulator.result"
        if reduction not in REDUCTIONS:
            raise ValueError(f"{caller}: reduction={reduction!r}; expected one of {REDUCTIONS}")
        if self.count == 0:
            raise ValueError(f"{caller}: no samples were added; an empty batch has no gradient")
        return {name: running.mean() if reduction == "mean" else running.sum()
                for name, running in self._sums.items()}


def batch_grad(model: torch.nn.Module, loss_fn, inputs: torch.Tensor, targets: torch.Tensor, *,
               reduction: str = "mean", mode: str | Mode = "fp32",
               microbatch_size: int | None = None, chunk_size: int | None = 32
               ) -> dict[str, torch.Tensor]:
    """The gradient of the batch's reduced loss, the same bits for every micro-batch split.

    The gradient is computed as per-sample gradients (:func:`per_sample_grads`) summed in the
    canonical order, sample 0, 1, ..., by a :class:`GradAccumulator` whose state is carried
    across micro-batches in the acc type, then divided by the batch size (``"mean"``).

    Args:
        model, loss_fn, inputs, targets: as for :func:`per_sample_grads`.
        reduction: ``"mean"`` (default) or ``"sum"``.
        mode: ``"fp32"`` (default) or ``"kahan"``; ``"autograd"`` is refused.
        microbatch_size: samples per micro-batch, as a gradient-accumulation loop would split
            the batch; None: one micro-batch. It never changes the result.
        chunk_size: samples per ``vmap`` evaluation within a micro-batch (default 32): the
            memory bound, about ``chunk_size`` x parameters. Every evaluation has exactly this
            many samples (see :func:`per_sample_grads`), which is what makes the result
            independent of ``microbatch_size``. None evaluates each micro-batch at once, and
            then the matmul shapes, so possibly the per-sample bits, follow the micro-batch.

    Returns:
        ``{name: gradient}`` for every trainable parameter, in its dtype.

    What is and is not invariant: the reduction gives the same bits for any split of the same
    per-sample gradients, on any device and backend. The per-sample gradients themselves come
    from torch's matmuls, so they may differ between ``chunk_size`` values (on the CPU we
    measured, evaluations of 1, 2 or 4 samples differ from 8 and more, which agree) and between
    devices.

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> model = torch.nn.Linear(3, 2)
        >>> lossf = torch.nn.CrossEntropyLoss(reduction="none")
        >>> x, y = torch.randn(7, 3), torch.tensor([0, 1, 1, 0, 1, 0, 0])
        >>> whole = loss.batch_grad(model, lossf, x, y)
        >>> split = loss.batch_grad(model, lossf, x, y, microbatch_size=3)
        >>> all(torch.equal(whole[name], split[name]) for name in whole)
        True
    """
    caller = "detsum.loss.batch_grad"
    batch = _check_batch(caller, model, inputs, targets)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{caller}: reduction={reduction!r}; expected one of {REDUCTIONS}")
    microbatch = _check_positive(caller, "microbatch_size", microbatch_size) or batch
    width = _check_positive(caller, "chunk_size", chunk_size)
    accumulator = GradAccumulator(model.named_parameters(), mode=mode)
    params = {name: p.detach() for name, p in _trainable(model.named_parameters()).items()}
    gradient = _gradient_function(caller, model, loss_fn)
    for start in range(0, batch, microbatch):
        x, y = inputs[start:start + microbatch], targets[start:start + microbatch]
        for block_x, block_y, real in _blocks(x, y, width):
            accumulator.add({name: g[:real] for name, g in
                             gradient(params, block_x, block_y).items()})
    return accumulator.result(reduction)
