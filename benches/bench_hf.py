"""detsum's transformers experts implementation against transformers' own, forward + backward.

The MoE block of a Mixtral layer (``MixtralSparseMoeBlock``: router and experts) at a small
realistic shape: hidden 512, intermediate 1792 (Mixtral's 3.5x), 8 experts, top-2, one
sequence of 512 tokens; bf16 and fp32, on CPU. One call is the block's forward and the
backward of its input and parameters (the gradients of the previous call are dropped first).

Implementations: ``transformers-grouped_mm`` (the model's default, the baseline of every
ratio), ``transformers-eager`` (the model's own loop, the bits ``"autograd"`` reproduces),
``detsum-fp32`` (the default mode), ``detsum-autograd`` and ``detsum-exact``.

Each case runs on torch's default thread count (2 on the CPU where NOTES.md's numbers come
from) and on one thread: on a machine shared with other work, one thread is the steadier
comparison.

``extra_info`` adds, against ``transformers-eager`` on the same input: ``same_bits_as_eager``
(output, input gradient and every parameter gradient) and ``max_abs_diff_to_eager`` (the
largest difference of the output and of the input gradient). Skipped without transformers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import DTYPE_IDS, run_case

transformers = pytest.importorskip("transformers")

import detsum.hf  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402

TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 512, 512, 1792, 8, 2
IMPLS = ["transformers-grouped_mm", "transformers-eager", "detsum-fp32", "detsum-autograd",
         "detsum-exact"]
DTYPES = [torch.bfloat16, torch.float32]
THREADS = {"threads-default": None, "threads-1": 1}
ROUNDS = 7
WARMUP = 2

_blocks: dict[torch.dtype, tuple] = {}


def block_and_data(dtype: torch.dtype):
    if dtype not in _blocks:
        config = transformers.MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
            num_experts_per_tok=TOPK)
        torch.manual_seed(0)
        block = MixtralSparseMoeBlock(config)
        with torch.no_grad():
            for parameter in block.parameters():
                parameter.normal_(0, config.initializer_range)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, TOKENS, HIDDEN, generator=gen).to(dtype)
        grad_out = torch.randn(1, TOKENS, HIDDEN, generator=gen).to(dtype)
        _blocks[dtype] = (block.to(dtype), config, x, grad_out)
    return _blocks[dtype]


def select(impl: str, block, config) -> None:
    """Point the block's experts at ``impl``: the config's name, and the module's mode."""
    detsum.hf.register()
    source, _, name = impl.partition("-")
    if source == "detsum":
        block.experts.detsum_mode = name
        name = detsum.hf.IMPLEMENTATION
    config._experts_implementation = name


def step_fn(block, x, grad_out):
    def step():
        block.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_()
        block(x_leaf).backward(grad_out)
        return x_leaf.grad
    return step


def results(impl: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients of one call."""
    block, config, x, grad_out = block_and_data(dtype)
    select(impl, block, config)
    block.zero_grad(set_to_none=True)
    x_leaf = x.clone().requires_grad_()
    out = block(x_leaf)
    out.backward(grad_out)
    return [out.detach(), x_leaf.grad] + [p.grad.clone() for p in block.parameters()]


@contextlib.contextmanager
def threads_set_to(count: int | None):
    """torch.set_num_threads(count) for the block (detsum's kernels follow it), then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(count or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("threads", list(THREADS))
def test_mixtral_block(benchmark, threads, dtype, impl):
    dtype_id = DTYPE_IDS[dtype]
    benchmark.group = f"hf mixtral block cpu {dtype_id} {threads}"
    with threads_set_to(THREADS[threads]) as count:
        info = {"primitive": "hf experts", "device": "cpu", "dtype": dtype_id, "impl": impl,
                "threads": count, "transformers": transformers.__version__,
                "case": f"MixtralSparseMoeBlock T={TOKENS} H={HIDDEN} I={INTERMEDIATE} "
                        f"E={EXPERTS} top-{TOPK}, forward+backward"}
        if impl != "transformers-eager":
            got, eager = results(impl, dtype), results("transformers-eager", dtype)
            info["same_bits_as_eager"] = all(torch.equal(g, e) for g, e in zip(got, eager))
            info["max_abs_diff_to_eager"] = {
                name: (g.double() - e.double()).abs().max().item()
                for name, g, e in zip(("output", "input_grad"), got, eager)}
        block, config, x, grad_out = block_and_data(dtype)
        select(impl, block, config)
        run_case(benchmark, step_fn(block, x, grad_out), "cpu", rounds=ROUNDS,
                 warmup_rounds=WARMUP, info=info, baseline="transformers grouped_mm (default)",
                 baseline_case=f"test_mixtral_block[{threads}-{dtype_id}-"
                               f"transformers-grouped_mm]")
