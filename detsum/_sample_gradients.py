"""The per-sample gradient engine of ``detsum.loss``: each sample's gradient evaluated alone,
the same bits whatever batch, position, micro-batch or chunk it arrives in
(:class:`SampleGradients`), and a weight's gradient kept as the factors of an outer product
where a layer allows (:class:`OuterProducts`). docs/loss.md says why each step is there."""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import NamedTuple

import torch


class OuterProducts(NamedTuple):
    """Per-sample gradients of a matrix given by their factors: row ``i`` is the outer product
    ``left[i] (x) right[i]``, the ``[O, K]`` matrix of ``left[i, o] * right[i, k]``, each
    product rounded once to the dtype (one IEEE multiplication).

    That is an ``nn.Linear`` weight's gradient for one sample evaluated alone: the gradient of
    the layer's output (``left[i]``, ``[O]``) times its input (``right[i]``, ``[K]``), a matrix
    product of inner dimension 1. :class:`GradAccumulator` sums such rows with the bits of the
    materialised rows, without forming them: ``k`` rows of ``O + K`` numbers instead of ``k x
    O x K``, and on CPU a kernel whose cost is the sum's own arithmetic.

    Args:
        left: ``[k, O]``, the parameter's dtype and device.
        right: ``[k, K]``, the same dtype and device.

    Example:
        >>> import torch
        >>> from detsum import loss
        >>> left, right = torch.randn(5, 2), torch.randn(5, 3)
        >>> factored = loss.GradAccumulator([("w", torch.zeros(2, 3, requires_grad=True))])
        >>> factored.add({"w": loss.OuterProducts(left, right)})
        >>> formed = loss.GradAccumulator([("w", torch.zeros(2, 3, requires_grad=True))])
        >>> formed.add({"w": left[:, :, None] * right[:, None, :]})
        >>> torch.equal(factored.result()["w"], formed.result()["w"])
        True
    """

    left: torch.Tensor
    right: torch.Tensor

    def materialise(self) -> torch.Tensor:
        """The rows themselves, ``[k, O, K]``."""
        return self.left.unsqueeze(2) * self.right.unsqueeze(1)


def trainable_parameters(named_parameters, caller: str) -> dict[str, torch.Tensor]:
    """The parameters with ``requires_grad``, by name, from ``(name, tensor)`` pairs (a
    TypeError naming ``caller`` for anything else)."""
    trainable = {}
    if isinstance(named_parameters, torch.Tensor) or not hasattr(named_parameters, "__iter__"):
        raise TypeError(f"{caller}: named_parameters={named_parameters!r:.60}; expected "
                        f"(name, tensor) pairs, as model.named_parameters() gives")
    for pair in named_parameters:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            got = (f"a tensor of shape {tuple(pair.shape)}" if isinstance(pair, torch.Tensor)
                   else f"{type(pair).__name__} {pair!r}"[:80])
            raise TypeError(f"{caller}: named_parameters gave {got}; expected (name, tensor) "
                            f"pairs, as model.named_parameters() gives (not "
                            f"model.parameters())")
        if pair[1].requires_grad:
            trainable[pair[0]] = pair[1]
    return trainable


def _sample_as_own_batch(batch: torch.Tensor, i: int) -> torch.Tensor:
    """Sample ``i`` as a batch of one, in contiguous storage of its own.

    The copy is part of the invariance: a view ``batch[i:i + 1]`` starts ``i`` rows into the
    batch's storage, so its address modulo the vector width follows ``i``, and BLAS kernels
    choose their arithmetic by alignment (on the CPU we measured, a row of ``x @ W.t()`` gets
    one of three results by its start address modulo 16 bytes). A fresh allocation starts at
    the allocator's alignment (64 bytes on CPU, 512 on CUDA), whichever sample it holds."""
    return batch[i:i + 1].clone(memory_format=torch.contiguous_format)


def _generator_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *,
                      zero_sign_free: frozenset[str] = frozenset()) -> str | None:
    """Where two gradient dicts differ in their bits (NaN payloads included), or None. In the
    tensors named in ``zero_sign_free``, -0.0 and +0.0 count as the same."""
    for name, x in a.items():
        y = b[name]
        if name in zero_sign_free:
            x, y = x + 0.0, y + 0.0  # -0.0 + 0.0 is +0.0; every other value is unchanged
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        differ = x.contiguous().view(bits) != y.contiguous().view(bits)
        if differ.any():
            first = tuple(differ.nonzero()[0].tolist())
            return (f"{int(differ.sum())} of {x.numel()} elements of {name!r} differ, the first "
                    f"at {first}: {x[first].item()!r} then {y[first].item()!r}")
    return None


def _one_loss(caller: str, losses: object) -> torch.Tensor:
    """The loss of a batch of one sample, from ``loss_fn``'s output (shape ``[1]``)."""
    if not isinstance(losses, torch.Tensor) or losses.shape != (1,):
        got = (f"shape {tuple(losses.shape)}" if isinstance(losses, torch.Tensor)
               else type(losses).__name__)
        raise ValueError(
            f"{caller}: loss_fn returned {got} for a batch of 1 sample; expected one "
            f"loss per sample, shape [batch] (e.g. nn.CrossEntropyLoss(reduction="
            f"'none'), not a 'mean' or 'sum' reduced scalar)")
    return losses[0]


class _Layer(NamedTuple):
    """An ``nn.Linear`` whose weight (and bias) a sample's forward sees as stand-ins of its own
    (:class:`SampleGradients`): the parameters' names, and whether the bias has a stand-in."""

    weight_name: str
    bias_name: str | None


def _factorable_layers(model: torch.nn.Module, trainable: dict[str, torch.Tensor]
                       ) -> dict[torch.nn.Linear, _Layer]:
    """The ``nn.Linear`` layers whose per-sample weight gradient can be taken as factors
    (:class:`OuterProducts`): nn.Linear's own forward (a subclass may compute something else),
    a trainable weight that is a parameter of this module alone (not tied to another, not
    parametrised), and no forward hook or pre-hook that could change what the factors are
    taken from. The bias gets a stand-in too where it is trainable and this module's alone."""
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    found = {}
    for prefix, module in model.named_modules():
        if (not isinstance(module, torch.nn.Linear)
                or type(module).forward is not torch.nn.Linear.forward
                or module._forward_hooks or module._forward_pre_hooks):
            continue
        weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
        weight_name = f"{prefix}.weight" if prefix else "weight"
        bias_name = f"{prefix}.bias" if prefix else "bias"
        if weight is not None and trainable.get(weight_name) is weight and uses[id(weight)] == 1:
            own_bias = (bias is not None and trainable.get(bias_name) is bias
                        and uses[id(bias)] == 1)
            found[module] = _Layer(weight_name, bias_name if own_bias else None)
    return found


#: Samples whose graphs one ``torch.autograd.grad`` call runs (:class:`SampleGradients`):
#: the engine's cost per call is spread over them, while their graphs, held together, stay
#: small (a model that qualifies has only ``nn.Linear`` parameters).
JOINT_SAMPLES = 16

#: Models whose forward has passed the determinism self-check of SampleGradients (weak keys:
#: a model that is freed leaves no entry behind).
_SELF_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _UsedOutsideTheLayer(Exception):
    """A layer's weight or bias was used by the forward outside the layer's own call."""

    def __init__(self, layers: set[torch.nn.Linear]):
        super().__init__()
        self.layers = layers


class _StandIns:
    """The hooks of one ``SampleGradients._evaluate`` call on ``layers``: while such a layer
    runs, its weight (and its own bias) are stand-ins of the sample's own (``stand_ins``,
    made on its first call), put back when it returns; what each call read and returned is
    recorded (``calls``: ``module -> [(input, input's version, output)]``) for the factors.
    ``parameters``: each layer's own ``(weight, bias)``."""

    def __init__(self, layers: dict[torch.nn.Linear, _Layer]):
        self.layers = layers
        self.parameters = {module: (module._parameters["weight"], module._parameters["bias"])
                           for module in layers}
        self.calls: dict[torch.nn.Module, list] = {}
        self.stand_ins: dict[torch.nn.Module, tuple] = {}

    @contextlib.contextmanager
    def hooked(self):
        """The hooks on every layer, for the ``with`` block."""
        handles = ([module.register_forward_pre_hook(self._stand_in) for module in self.layers]
                   + [module.register_forward_hook(self._capture) for module in self.layers])
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def next_sample(self) -> None:
        """Stand-ins and calls of the next sample's own."""
        self.calls, self.stand_ins = {}, {}

    def put_back(self, module: torch.nn.Linear) -> None:
        weight, bias = self.parameters[module]
        module._parameters["weight"] = weight
        if self.layers[module].bias_name is not None:
            module._parameters["bias"] = bias

    def put_back_all(self) -> None:
        for module in self.layers:
            self.put_back(module)

    def _stand_in(self, module, args):
        if module not in self.stand_ins:
            weight, bias = self.parameters[module]
            self.stand_ins[module] = (weight.detach().requires_grad_(),
                                      bias.detach().requires_grad_()
                                      if self.layers[module].bias_name is not None else None)
        weight, bias = self.stand_ins[module]
        module._parameters["weight"] = weight
        if bias is not None:
            module._parameters["bias"] = bias

    def _capture(self, module, args, output):
        self.put_back(module)
        layer_input = args[0] if args else None
        version = layer_input._version if isinstance(layer_input, torch.Tensor) else None
        self.calls.setdefault(module, []).append((layer_input, version, output))
        # The rest of the forward gets a copy: an in-place operation downstream
        # (ReLU(inplace=True)) would otherwise change the tensor whose gradient is taken.
        return output.clone()


class SampleGradients:
    """``self(inputs, targets, i)``: sample ``i``'s gradient ``{name: param-shaped tensor, or
    OuterProducts of one row}``, evaluated alone; ``self.each(inputs, targets, start, stop)``
    those of samples ``start .. stop - 1`` in order, the same bits.

    Each sample is its own batch of one: ``x = inputs[i:i + 1]`` copied into fresh storage
    (:func:`_sample_as_own_batch`), through the model's forward and ``torch.autograd.grad`` of
    its loss. So every sample goes through the same operations on tensors of the same shapes,
    strides and alignment, whatever batch, position in it, micro-batch or chunk it arrived in,
    and nothing of the other samples enters its computation: its bits are those of a
    deterministic function of the sample, by construction, not by any matmul library's choice
    of kernel by row count or by a row's alignment in the batch (the CPU we measured does both;
    see docs/loss.md).

    The weights of ``nn.Linear`` layers (:func:`_factorable_layers`) that the sample's forward
    uses once, on its one row, get their gradient as factors: ``OuterProducts(output gradient,
    input)``, the gradient being taken with respect to the layer's output instead of its
    weight. Formed, that is the matrix product of inner dimension 1 that autograd computes, up
    to the sign of a zero product (each element is one IEEE product; torch's bf16 and fp16
    matrix products give +0.0 for ``0 * -1``). Left as factors, it is never formed per sample
    (nor, in ``batch_grad``, read again): three quarters of the time on the benchmark's MLP.
    A sample whose forward uses such a layer twice, or on several rows, gets that weight's
    gradient from autograd instead, as any other parameter's.

    Stand-ins: while such a layer runs, its weight (and its own bias) are replaced by tensors
    of the sample's own, sharing the parameters' storage (``detach().requires_grad_()``), and
    put back when it returns. The layer's own uses then reach the stand-ins, any other use in
    the forward (the weight read by another module, tied by hand) reaches the parameter, and
    autograd is asked for both. A gradient that reaches a parameter means the layer's output
    does not carry all of it: that sample is evaluated again with the layer left alone.

    Several samples, one engine call: where every trainable parameter is such a layer's weight
    or bias, every gradient wanted is the gradient of a tensor of one sample (an output, a
    stand-in), so ``JOINT_SAMPLES`` samples are run through their forwards one by one and
    their gradients taken by one ``torch.autograd.grad`` of all their losses. Their graphs are
    disjoint, each loss is seeded with 1 as alone, and the engine runs the ready node with the
    highest sequence number first, so each sample's nodes run in the order they run alone and
    every gradient adds its parts in the same order: the same bits, at a fraction of the
    engine's cost per call (tested against samples evaluated one by one).

    What that construction cannot supply is a forward that is itself a deterministic function of
    the sample. Checks on the first samples of each call (its first group) refuse the ways one
    is not:

    - torch's random generator (CPU, and the device's on CUDA) must not move while a sample is
      evaluated: a forward that draws random numbers (dropout in training mode) has no
      per-sample gradient;
    - the forward must not change the model's buffers (a BatchNorm in training mode updates
      its running statistics): the buffers are put back and the call refused;
    - the first time a model is seen, its first sample is evaluated a second time, alone, and
      both results must have the same bits: this catches state the forward changes between
      calls, random numbers drawn outside torch, and nondeterministic kernels that show on
      that sample.

    Later samples are checked for changed buffers too (a forward that changes them for some
    samples only), but by then the change is made.
    """

    def __init__(self, caller: str, model: torch.nn.Module, loss_fn):
        if not callable(loss_fn):
            raise TypeError(f"{caller}: loss_fn={loss_fn!r:.60} is not callable; expected a "
                            f"function loss_fn(outputs, targets) returning one loss per sample")
        self.caller, self.model, self.loss_fn = caller, model, loss_fn
        self.trainable = trainable_parameters(model.named_parameters(), caller)
        if not self.trainable:
            raise ValueError(f"{caller}: model has no parameter with requires_grad=True")
        self._layers = _factorable_layers(model, self.trainable)
        stood_in = {name for layer in self._layers.values()
                    for name in (layer.weight_name, layer.bias_name) if name is not None}
        self._joint = all(name in stood_in for name in self.trainable)
        self._buffers = [b for _, b in model.named_buffers()]
        self._checked = False

    def each(self, inputs: torch.Tensor, targets: torch.Tensor, start: int, stop: int):
        """The gradients of samples ``start .. stop - 1``, in order (a generator)."""
        group = JOINT_SAMPLES if self._joint else 1
        for first in range(start, stop, group):
            indices = range(first, min(first + group, stop))
            samples = [(_sample_as_own_batch(inputs, i), _sample_as_own_batch(targets, i))
                       for i in indices]
            if self._checked:
                yield from self._evaluate_group(samples)
            else:
                yield from self._checked_group(inputs, targets, indices, samples)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, i: int
                 ) -> dict[str, torch.Tensor | OuterProducts]:
        return next(self.each(inputs, targets, i, i + 1))

    def _evaluate_group(self, samples: list[tuple[torch.Tensor, torch.Tensor]],
                        buffers_before: list[torch.Tensor] | None = None
                        ) -> list[dict[str, torch.Tensor | OuterProducts]]:
        if len(samples) > 1:
            try:
                return self._evaluate(samples, buffers_before=buffers_before)
            except _UsedOutsideTheLayer:
                pass  # each sample alone, then, to find its own way
        return [self._evaluate_one_sample(x, y, buffers_before) for x, y in samples]

    def _checked_group(self, inputs: torch.Tensor, targets: torch.Tensor, indices: range,
                       samples: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> list[dict[str, torch.Tensor | OuterProducts]]:
        """The first group of a call, with the checks of the class docstring."""
        device = samples[0][0].device
        before = _generator_states(device)
        gradients = self._evaluate_group(samples, [b.clone() for b in self._buffers])
        if any(not torch.equal(a, b) for a, b in zip(before, _generator_states(device))):
            which = (f"sample {indices[0]} was" if len(indices) == 1
                     else f"samples {indices[0]} to {indices[-1]} were")
            raise ValueError(
                f"{self.caller}: the model's forward (or loss_fn) drew random numbers from "
                f"torch's generator while {which} evaluated (dropout or another random "
                f"layer in training mode?): its gradient would change with every evaluation. "
                f"Expected a forward that is a deterministic function of the sample: call "
                f"model.eval(), or remove the random operations")
        if self.model not in _SELF_CHECKED:
            # The second evaluation runs alone, while the first one's tensors are alive, so
            # at other addresses: bits that follow the address beyond the allocator's
            # alignment show too, and so would a sample that differs run with others.
            i = indices[0]
            difference = _first_difference(
                _materialised(gradients[0]),
                _materialised(self._evaluate_one_sample(_sample_as_own_batch(inputs, i),
                                                        _sample_as_own_batch(targets, i))))
            if difference is not None:
                raise ValueError(
                    f"{self.caller}: the model's forward is not a deterministic function of "
                    f"one sample: sample {i}, evaluated twice, gave two gradients "
                    f"({difference}), so its per-sample gradients would depend on the batch "
                    f"and its split. Expected the same bits for the same sample: look for "
                    f"state the forward (or loss_fn) changes between calls (a counter, a cache "
                    f"of earlier inputs), random numbers drawn outside torch's generator, or a "
                    f"nondeterministic kernel (torch.use_deterministic_algorithms(True) names "
                    f"it)")
            _SELF_CHECKED[self.model] = True
        self._checked = True
        return gradients

    def _evaluate_one_sample(self, x: torch.Tensor, y: torch.Tensor,
                             buffers_before: list[torch.Tensor] | None = None
                             ) -> dict[str, torch.Tensor | OuterProducts]:
        """One sample's gradient; layers whose parameters its forward uses outside them are
        evaluated again without stand-ins."""
        without_stand_ins: set[torch.nn.Linear] = set()
        while True:
            try:
                [gradient] = self._evaluate([(x, y)], without_stand_ins, buffers_before)
                return gradient
            except _UsedOutsideTheLayer as used:
                without_stand_ins |= used.layers

    def _evaluate(self, samples: list[tuple[torch.Tensor, torch.Tensor]],
                  without_stand_ins: set[torch.nn.Linear] = frozenset(),
                  buffers_before: list[torch.Tensor] | None = None
                  ) -> list[dict[str, torch.Tensor | OuterProducts]]:
        """The gradients of ``samples`` (each ``(x, y)`` a batch of one), by one
        ``torch.autograd.grad`` call; several samples only where every trainable parameter
        has a stand-in. ``buffers_before``: the buffers' values, put back if the forward
        changes them (else the change is only detected). Raises ``_UsedOutsideTheLayer``."""
        hooks = _StandIns({module: layer for module, layer in self._layers.items()
                           if module not in without_stand_ins})
        losses, wanted, not_called = [], [], []
        with hooks.hooked():
            for x, y in samples:
                hooks.next_sample()
                losses.append(self._loss(x, y, hooks, buffers_before))
                asked, zeros = self._wanted(hooks.layers, hooks.calls, hooks.stand_ins)
                wanted.append(asked)
                not_called.append(zeros)
        return self._gradients(losses, wanted, not_called, hooks)

    def _loss(self, x: torch.Tensor, y: torch.Tensor, hooks: _StandIns,
              buffers_before: list[torch.Tensor] | None) -> torch.Tensor:
        """One sample's loss, its forward run with ``hooks``' stand-ins; raises (after putting
        them back) if the forward changed a buffer."""
        versions = [b._version for b in self._buffers]
        try:
            with torch.enable_grad():
                loss = _one_loss(self.caller, self.loss_fn(self.model(x), y))
        except Exception as error:
            # A forward that fails after changing a buffer (BatchNorm in training
            # mode, on one sample) is refused for the change, its first cause.
            self._refuse_changed_buffers(versions, buffers_before, error)
            raise
        finally:
            hooks.put_back_all()
        self._refuse_changed_buffers(versions, buffers_before)
        return loss

    def _gradients(self, losses: list[torch.Tensor], wanted: list[list], not_called: list[dict],
                   hooks: _StandIns) -> list[dict[str, torch.Tensor | OuterProducts]]:
        """Every sample's gradient from one ``torch.autograd.grad`` call of ``losses``: what
        ``_wanted`` asked for each, and the parameters themselves, whose gradient shows a use
        outside their layer (``_UsedOutsideTheLayer``)."""
        requested = [tensor for sample in wanted for _, tensor, _ in sample]
        parameters_used = [(module, p) for module, (weight, bias) in hooks.parameters.items()
                           for p in (weight, bias if hooks.layers[module].bias_name else None)
                           if p is not None]
        grads = torch.autograd.grad(losses, requested + [p for _, p in parameters_used],
                                    allow_unused=True)
        used_outside = {module for (module, _), g in zip(parameters_used, grads[len(requested):])
                        if g is not None}
        if used_outside:
            raise _UsedOutsideTheLayer(used_outside)
        gradients, position = [], 0
        for sample, zeros in zip(wanted, not_called):
            gradient = dict(zeros)
            for (name, tensor, right), g in zip(sample, grads[position:]):
                g = torch.zeros_like(tensor) if g is None else g
                gradient[name] = g if right is None else OuterProducts(g[0], right[0].detach())
            position += len(sample)
            gradients.append({name: gradient[name] for name in self.trainable})
        return gradients

    def _wanted(self, layers: dict[torch.nn.Linear, _Layer], calls: dict, stand_ins: dict
                ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor | None]], dict]:
        """What one sample asks autograd for: ``(parameter name, the tensor whose gradient is
        the parameter's, None)``, or for a weight taken as factors ``(name, the layer's
        output, the layer's input)``; and the zero gradients of the layers it did not call
        (their parameters' own tensors are shared by the samples: a use outside the layer
        shows there)."""
        wanted, not_called, covered = [], {}, set()
        for module, layer in layers.items():
            names = [name for name in (layer.weight_name, layer.bias_name) if name is not None]
            covered.update(names)
            if module not in calls:
                not_called.update((name, torch.zeros_like(self.trainable[name]))
                                  for name in names)
                continue
            weight, bias = stand_ins[module]
            factors = None
            if len(calls[module]) == 1:
                layer_input, version, output = calls[module][0]
                dtype = weight.dtype
                # A factor must be the layer's input as the layer read it: one changed in
                # place since leaves the weight to autograd (which has its gradient, or the
                # error).
                if (isinstance(layer_input, torch.Tensor) and layer_input._version == version
                        and layer_input.shape == (1, module.in_features)
                        and layer_input.dtype == dtype and output.dtype == dtype
                        and output.shape == (1, module.out_features) and output.requires_grad):
                    factors = (layer.weight_name, output, layer_input)
            wanted.append(factors or (layer.weight_name, weight, None))
            if bias is not None:
                wanted.append((layer.bias_name, bias, None))
        wanted += [(name, p, None) for name, p in self.trainable.items() if name not in covered]
        return wanted, not_called

    def _refuse_changed_buffers(self, versions: list[int],
                                buffers_before: list[torch.Tensor] | None,
                                cause: Exception | None = None) -> None:
        """Raise if a buffer changed since ``versions`` were read, after putting the values
        ``buffers_before`` back where given."""
        if [b._version for b in self._buffers] == versions:
            return
        if buffers_before is not None:
            with torch.no_grad():
                for buffer, value in zip(self._buffers, buffers_before):
                    buffer.copy_(value)
        raise ValueError(
            f"{self.caller}: the model's forward changes its buffers in place "
            f"({self._training_modules_with_buffers()}), so a sample's gradient would depend "
            f"on the samples before it. Expected a forward that is a deterministic function of "
            f"the sample: call model.eval() (a BatchNorm in training mode updates its running "
            f"statistics), or make the forward leave its buffers alone") from cause

    def _training_modules_with_buffers(self) -> str:
        names = [f"'{name}' ({type(module).__name__})"
                 for name, module in self.model.named_modules()
                 if module.training and any(True for _ in module.buffers(recurse=False))]
        return ("modules in training mode with buffers: " + ", ".join(names[:5])
                if names else "no module in training mode has buffers")


def _materialised(gradient: dict[str, torch.Tensor | OuterProducts]) -> dict[str, torch.Tensor]:
    """One sample's gradient with every factored weight's outer product formed."""
    return {name: g.left.unsqueeze(1) * g.right if isinstance(g, OuterProducts) else g
            for name, g in gradient.items()}
