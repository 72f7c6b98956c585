"""detsum.hf: the "detsum" experts implementation in real transformers models, tiny and
randomly initialised: "autograd" mode against the models' own "eager" loop bit for bit, the
other modes deterministic and close to it, torch.compile, and errors in detsum's words."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import assert_same_bits, detsum_threads, dtype_id

transformers = pytest.importorskip("transformers")

import detsum.hf  # noqa: E402
from detsum import reference  # noqa: E402

VOCAB, SEQ = 128, 24
# Small enough for a forward and backward in a fraction of a second; 8 experts with 2 * 24
# tokens leave every expert a few rows. Every weight is the model's own random init (std 0.02).
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
              eos_token_id=1, bos_token_id=1)


def tiny_config(family: str, topk: int):
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=96, num_local_experts=8,
                                          num_experts_per_tok=topk, **COMMON)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48,
                                           num_experts=8, num_experts_per_tok=topk, **COMMON)
    if family == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=48, num_experts=8,
                                        num_experts_per_tok=topk, **COMMON)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=96, num_experts=8,
                                           num_experts_per_tok=topk, **COMMON)
    raise ValueError(family)


def tiny_model(family: str, dtype: torch.dtype, topk: int = 2):
    # dtype at construction, as from_pretrained does (.to(dtype) would also round the rotary
    # frequencies, which the model keeps in fp32).
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family, topk),
                                                         dtype=dtype)


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def logits_and_gradients(model, ids, forward=None) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    output = (model if forward is None else forward)(ids, labels=ids)
    output.loss.backward()
    return output.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                                    if p.grad is not None}


def eager_run(model, ids):
    model.set_experts_implementation("eager")
    return logits_and_gradients(model, ids)


def detsum_run(model, ids, mode):
    detsum.hf.use_detsum_experts(model, mode=mode)
    return logits_and_gradients(model, ids)


def assert_same_run(got, expected, names=None) -> None:
    assert_same_bits(got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name in names or expected[1]:
        try:
            assert_same_bits(got[1][name], expected[1][name])
        except AssertionError as error:
            raise AssertionError(f"gradient of {name}: {error}") from None


@pytest.fixture(autouse=True)
def default_mode_restored():
    """register(mode=...) sets a process-wide default: every test starts from "fp32"."""
    yield
    detsum.hf.register(mode="fp32")


# ---- "autograd": transformers' "eager" loop, bit for bit ----------------------------------------

BITWISE_FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]
# fp16 matrix products take tens of seconds on CPU at the model level: fp16 runs at the block
# level below.
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("family", BITWISE_FAMILIES)
def test_autograd_mode_is_eager_bit_for_bit(family, dtype, topk):
    """Logits and the gradient of every parameter. top-4 is where the order of the sums shows:
    two terms add in either order to the same bits, four do not."""
    model = tiny_model(family, dtype, topk)
    ids = token_ids()
    expected = eager_run(model, ids)
    routing_dtypes = []
    model.model.layers[0].mlp.experts.register_forward_pre_hook(
        lambda module, args: routing_dtypes.append(args[2].dtype))
    assert_same_run(detsum_run(model, ids, "autograd"), expected)
    # The mixed case comes from the model itself: Mixtral's router keeps its weights in fp32
    # whatever the hidden dtype; Qwen3-MoE's and OLMoE's cast them to it.
    assert routing_dtypes == [torch.float32 if family == "mixtral" else dtype]


def test_qwen2_moe_autograd_mode_matches_eager_down_to_the_block():
    """Qwen2-MoE computes its shared expert's gate after the experts, so autograd's engine adds
    that gate's gradient of the block input first and the experts' one by one after it, an
    interleaving that a block returning one gradient for all its experts cannot follow (see
    experts_forward). Claimed and checked: the logits, the experts block's own gradients and
    every gradient from the last MoE block up; below the block, the gradients differ."""
    model = tiny_model("qwen2_moe", torch.float32, topk=4)
    ids = token_ids()
    expected = eager_run(model, ids)
    got = detsum_run(model, ids, "autograd")
    from_last_block_up = [name for name in expected[1] if name.startswith(
        ("model.layers.1.mlp.", "model.norm.", "lm_head."))]
    assert_same_run(got, expected, from_last_block_up)
    below = [name for name in expected[1] if name.startswith("model.layers.0.")]
    assert any(not torch.equal(got[1][name], expected[1][name]) for name in below)

    experts = model.model.layers[1].mlp.experts
    hidden, top_k_index, top_k_weights, grad_out = block_inputs(experts, torch.float32, topk=4,
                                                                balanced=False)
    assert_same_block(run_block(experts, "autograd", hidden, top_k_index, top_k_weights,
                                grad_out),
                      run_block(experts, "eager", hidden, top_k_index, top_k_weights, grad_out))


def test_from_pretrained_with_the_registered_name(tmp_path):
    """The other way in: register() once, then experts_implementation="detsum" at load time;
    the mode is register()'s."""
    model = tiny_model("mixtral", torch.bfloat16)
    ids = token_ids()
    expected = eager_run(model, ids)
    model.save_pretrained(tmp_path)
    detsum.hf.register(mode="autograd")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="detsum", dtype=torch.bfloat16)
    assert loaded.config._experts_implementation == "detsum"
    assert_same_run(logits_and_gradients(loaded, ids), expected)


# ---- the experts block alone: routing chosen by the test ----------------------------------------

def experts_module(family: str, dtype: torch.dtype, topk: int = 2):
    return tiny_model(family, dtype, topk).model.layers[0].mlp.experts


def block_inputs(experts, dtype, topk=2, tokens=48, *, balanced=True, weights_dtype=None):
    """hidden [T, H], top_k_index [T, topk], top_k_weights [T, topk], grad_out [T, H].

    ``balanced``: 4 experts, top-2, each expert receiving 24 rows (every ordered pair of
    distinct experts 4 times over 48 tokens); expert 4 and above receive none. Otherwise
    random distinct experts per token."""
    gen = torch.Generator().manual_seed(5)
    hidden_size = experts.gate_up_proj.shape[2]
    if balanced:
        assert topk == 2 and tokens == 48
        pairs = torch.tensor([[a, b] for a in range(4) for b in range(4) if a != b] * 4)
        top_k_index = pairs[torch.randperm(tokens, generator=gen)]
    else:
        top_k_index = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:topk]
                                   for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen), -1)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    grad_out = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    return hidden, top_k_index, weights.to(weights_dtype or torch.float32), grad_out


def select(experts, implementation: str) -> None:
    """Point the experts module at transformers' "eager" loop or at detsum in a mode."""
    if implementation == "eager":
        experts.config._experts_implementation = "eager"
    else:
        detsum.hf.register()
        experts.config._experts_implementation = "detsum"
        experts.detsum_mode = implementation


def run_block(experts, implementation, hidden, top_k_index, top_k_weights, grad_out,
              forward=None):
    """Output and the gradients of the hidden rows, routing weights and expert weights:
    ``implementation`` is "eager" or a detsum mode."""
    select(experts, implementation)
    experts.zero_grad(set_to_none=True)
    hidden = hidden.clone().requires_grad_()
    top_k_weights = top_k_weights.clone().requires_grad_()
    out = (experts if forward is None else forward)(hidden, top_k_index, top_k_weights)
    out.backward(grad_out)
    return [out.detach(), hidden.grad, top_k_weights.grad, experts.gate_up_proj.grad,
            experts.down_proj.grad]


def run_block_forward(experts, implementation, hidden, top_k_index, top_k_weights):
    select(experts, implementation)
    return experts(hidden, top_k_index, top_k_weights)


def assert_same_block(got, expected):
    names = ["output", "hidden grad", "routing weights grad", "gate_up_proj grad",
             "down_proj grad"]
    for name, g, e in zip(names, got, expected):
        try:
            assert_same_bits(g, e)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


@pytest.mark.parametrize("mode", ["autograd", "fp32", "exact", "eager"])
def test_torch_func_vjp_gives_eager_gradients(mode):
    """torch.func.vjp through the block, for the hidden rows, the routing weights and the
    expert weights (by functional_call): the eager gradients bit for bit. Before: torch refused
    the expert products' operator ("must override the setup_context staticmethod").

    The gate is a ReLU: torch 2.13's own SiLU backward under torch.func differs from eager's in
    the last bit (the model's "eager" loop too, in bf16, fp32 and fp64), where ReLU's is exact
    both ways, so the comparison sees detsum's part alone."""
    experts = experts_module("mixtral", torch.bfloat16)
    experts.act_fn = torch.nn.ReLU()
    hidden, top_k_index, weights, grad_out = block_inputs(experts, torch.bfloat16)
    expected = run_block(experts, mode, hidden, top_k_index, weights, grad_out)
    params = {name: p.detach() for name, p in experts.named_parameters()}

    def block(hidden, weights, params):
        return torch.func.functional_call(experts, params, (hidden, top_k_index, weights))

    out, pullback = torch.func.vjp(block, hidden, weights, params)
    grad_hidden, grad_weights, grad_params = pullback(grad_out)
    assert_same_block([out, grad_hidden, grad_weights, grad_params["gate_up_proj"],
                       grad_params["down_proj"]], expected)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_autograd_mode_with_experts_that_receive_no_rows(weights_dtype):
    """Experts 4 to 7 receive no token: the loop skips them, and their weight gradient is
    zeros; top-2 in bf16 rows with fp32 or bf16 routing weights."""
    experts = experts_module("mixtral", torch.bfloat16)
    inputs = block_inputs(experts, torch.bfloat16, weights_dtype=weights_dtype)
    got = run_block(experts, "autograd", *inputs)
    assert_same_block(got, run_block(experts, "eager", *inputs))
    assert not got[3][4:].any() and not got[4][4:].any()


def negative_zeros(t: torch.Tensor) -> int:
    return int(((t == 0) & torch.signbit(t)).sum())


def test_autograd_mode_has_the_loops_signed_zeros():
    """fp16, with an output gradient small enough for the weight gradients to round to zero in
    places: where mm returns -0.0 the loop has +0.0 (autograd adds each expert's weight
    gradient to the zeros of the other experts' gradients), and so does "autograd" mode."""
    experts = experts_module("mixtral", torch.float16)
    hidden, top_k_index, top_k_weights, grad_out = block_inputs(experts, torch.float16)
    inputs = (hidden, top_k_index, top_k_weights, (grad_out.float() * 1e-4).half())
    expected = run_block(experts, "eager", *inputs)
    assert_same_block(run_block(experts, "autograd", *inputs), expected)
    # The case is there: the same products hold -0.0 in "fp32" mode, which keeps mm's zeros.
    fp32_mode = run_block(experts, "fp32", *inputs)
    assert all(negative_zeros(g) > 0 for g in fp32_mode[3:])
    assert all(negative_zeros(g) == 0 for g in expected[3:])


@pytest.mark.parametrize("mode", ["autograd", "fp32", "exact"])
def test_no_tokens(mode):
    """The loop returns zeros outside the graph (no expert is hit); detsum returns the same
    empty rows inside it, and its backward runs."""
    experts = experts_module("mixtral", torch.float32)
    hidden = torch.zeros(0, 64, requires_grad=True)
    top_k_weights = torch.zeros(0, 2, requires_grad=True)
    top_k_index = torch.zeros(0, 2, dtype=torch.int64)
    eager = run_block_forward(experts, "eager", hidden, top_k_index, top_k_weights)
    out = run_block_forward(experts, mode, hidden, top_k_index, top_k_weights)
    assert_same_bits(out, eager)
    out.sum().backward()
    assert hidden.grad.shape == hidden.shape and top_k_weights.grad.shape == (0, 2)


@pytest.mark.parametrize("mode", ["fp32", "kahan", "exact", "autograd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_same_bits_on_every_run_and_thread_count(dtype, mode):
    """Two runs on two of detsum's threads, one on one. Only detsum's thread count changes
    (Numba's, which detsum's kernels take up to torch's): the matrix products are torch's,
    and torch's fp32 mm (MKL) gives other bits on one thread than on two for some row counts
    (5 to 11 rows on an AMD EPYC, in torch 2.13; other shapes on other CPUs)."""
    experts = experts_module("mixtral", dtype)
    inputs = block_inputs(experts, dtype)
    runs = []
    for count in (1, 2, 2):
        with detsum_threads(count):
            runs.append(run_block(experts, mode, *inputs))
    for other in runs[1:]:
        assert_same_block(other, runs[0])


# ---- "fp32" and "exact": close to eager, closer to the exact combination ------------------------

@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_fp32_and_exact_combine_closer_to_exact_than_eager(weights_dtype):
    """bf16 rows, top-4: the block output against the exact weighted sum of the same expert
    rows (each expert's rows taken slot by slot, then token by token, as the block and the loop
    take them, so the products are the block's), rounded once to bf16. With bf16 weights
    "exact" is that value (bf16 products are exact in fp32); with fp32 weights it is within
    1 ulp (each product is rounded to fp32, and the fp32 sum again to bf16). "fp32" and
    "exact" are closer on average than eager, which rounds every product and every partial
    sum to bf16."""
    experts = experts_module("mixtral", torch.bfloat16, topk=4)
    tokens = 64
    hidden, top_k_index, top_k_weights, _ = block_inputs(
        experts, torch.bfloat16, topk=4, tokens=tokens, balanced=False,
        weights_dtype=weights_dtype)
    products = torch.empty(tokens, 4, hidden.shape[1], dtype=torch.float64)
    linear = torch.nn.functional.linear
    with torch.no_grad():
        for expert in range(experts.num_experts):
            slots, rows = torch.where(top_k_index.t() == expert)
            expert_rows = linear(experts._apply_gate(linear(hidden[rows],
                                                            experts.gate_up_proj[expert])),
                                 experts.down_proj[expert])
            products[rows, slots] = (expert_rows.double()
                                     * top_k_weights[rows, slots, None].double())
        exact = reference.exact_sum_rounded(products, torch.bfloat16, dim=1)
        errors = {}
        for implementation in ("eager", "fp32", "exact"):
            out = run_block_forward(experts, implementation, hidden, top_k_index, top_k_weights)
            errors[implementation] = reference.ulp_distance(out, exact).view(-1)
    assert errors["exact"].max() <= (1 if weights_dtype == torch.float32 else 0)
    assert errors["fp32"].mean() < errors["eager"].mean()
    assert errors["exact"].mean() < errors["eager"].mean()


# ---- torch.compile -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["autograd", "fp32", "exact"])
def test_compiled_block_gives_eager_bits(mode):
    """The experts block, forward and backward, in one graph (bf16 rows, fp32 routing weights):
    aot_eager keeps every op as eager runs it, so the bits are the uncompiled call's (and, in
    "autograd" mode, the loop's). The routing check and the row counts are read inside
    detsum's operators, not in the graph."""
    torch._dynamo.reset()
    experts = experts_module("mixtral", torch.bfloat16)
    inputs = block_inputs(experts, torch.bfloat16, balanced=False)
    compiled = torch.compile(lambda *args: experts(*args), fullgraph=True, backend="aot_eager")
    got = run_block(experts, mode, *inputs, forward=compiled)
    assert_same_block(got, run_block(experts, mode, *inputs))
    if mode == "autograd":
        assert_same_block(got, run_block(experts, "eager", *inputs))


def test_compiled_tiny_model_gives_eager_bits():
    """The whole model in one graph (transformers' own "eager" loop cannot be: its nonzero has
    a data-dependent size): the logits and gradients of the uncompiled eager loop."""
    torch._dynamo.reset()
    model = tiny_model("mixtral", torch.bfloat16, topk=4)
    ids = token_ids()
    expected = eager_run(model, ids)
    detsum.hf.use_detsum_experts(model, mode="autograd")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_same_run(logits_and_gradients(model, ids, forward=compiled), expected)


def test_inductor_compiles_the_block_in_one_graph():
    """Inductor keeps detsum's operators opaque but lowers the model's own elementwise code (the
    gate's activation, in fp32 where eager rounds to bf16), so its bits are its own, not
    eager's: compiled, and the same bits on every call."""
    torch._dynamo.reset()
    experts = experts_module("mixtral", torch.bfloat16)
    inputs = block_inputs(experts, torch.bfloat16, balanced=False)
    compiled = torch.compile(lambda *args: experts(*args), fullgraph=True)
    first = run_block(experts, "fp32", *inputs, forward=compiled)
    assert_same_block(run_block(experts, "fp32", *inputs, forward=compiled), first)


# ---- the operators ------------------------------------------------------------------------------

@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "requires_grad"])
def test_opcheck_expert_linear(requires_grad):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 5, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)
    weight = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64
                         ).requires_grad_(requires_grad)
    for boundaries in ([0, 3, 3, 7], [0, 0, 0, 0]):  # an expert without rows; no rows at all
        used = rows[:boundaries[-1]]
        for loop_zeros in (False, True):
            torch.library.opcheck(torch.ops.detsum.hf_expert_linear,
                                  (used, weight, torch.tensor(boundaries), loop_zeros))


# ---- registration and errors --------------------------------------------------------------------

def test_register_is_idempotent_and_sets_the_default_mode():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    detsum.hf.register()
    detsum.hf.register()
    assert ALL_EXPERTS_FUNCTIONS["detsum"] is detsum.hf.experts_forward
    experts = experts_module("mixtral", torch.float32)
    inputs = block_inputs(experts, torch.float32)
    detsum.hf.register(mode="autograd")
    experts.config._experts_implementation = "detsum"
    with torch.no_grad():
        assert_same_bits(experts(*inputs[:3]), run_block_forward(experts, "eager", *inputs[:3]))


def test_mode_is_per_model():
    one, other = tiny_model("mixtral", torch.bfloat16), tiny_model("mixtral", torch.bfloat16)
    detsum.hf.use_detsum_experts(one, mode="exact")
    detsum.hf.use_detsum_experts(other, mode="autograd")
    assert {m.detsum_mode for m in one.modules() if hasattr(m, "detsum_mode")} == {"exact"}
    assert {m.detsum_mode for m in other.modules() if hasattr(m, "detsum_mode")} == {"autograd"}


def test_import_detsum_needs_no_transformers():
    code = "import sys, detsum, detsum.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_mode_is_named():
    model = tiny_model("mixtral", torch.float32)
    expected = r"mode='fast' is not a detsum mode; expected one of \('autograd', 'kahan', "
    with pytest.raises(ValueError, match=r"^detsum\.hf\.use_detsum_experts: " + expected):
        detsum.hf.use_detsum_experts(model, mode="fast")
    with pytest.raises(ValueError, match=r"^detsum\.hf\.register: " + expected):
        detsum.hf.register(mode="fast")
    experts = model.model.layers[0].mlp.experts
    detsum.hf.use_detsum_experts(model)
    experts.detsum_mode = "fast"
    with pytest.raises(ValueError, match=r"^detsum\.hf\.experts_forward: " + expected):
        experts(*block_inputs(experts, torch.float32)[:3])


def test_a_model_that_is_not_a_module_is_refused():
    with pytest.raises(TypeError, match=r"^detsum\.hf\.use_detsum_experts: model must be a "
                                        r"torch\.nn\.Module \(a transformers model\), got int"):
        detsum.hf.use_detsum_experts(3)


def test_model_without_experts_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"^detsum\.hf\.use_detsum_experts: model "
                                         r"\(LlamaForCausalLM\) has no experts module"):
        detsum.hf.use_detsum_experts(model)


def test_experts_layout_detsum_does_not_compute_is_refused_and_nothing_changes():
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"]))
    before = model.config._experts_implementation
    with pytest.raises(ValueError, match=r"^detsum\.hf\.use_detsum_experts: GptOssExperts has "
                                         r"is_transposed=True, has_bias=True; .* \(expected "
                                         r"is_transposed=False, has_bias=False\)$"):
        detsum.hf.use_detsum_experts(model)
    assert model.config._experts_implementation == before
    assert not any(hasattr(m, "detsum_mode") for m in model.modules())


def test_mismatched_dtypes_are_named():
    experts = experts_module("mixtral", torch.float32)
    hidden, top_k_index, top_k_weights, _ = block_inputs(experts, torch.float32)
    detsum.hf.register()
    experts.config._experts_implementation = "detsum"
    with pytest.raises(ValueError, match=r"^detsum\.hf\.experts_forward: MixtralExperts\."
                                         r"gate_up_proj has dtype torch\.float32 but "
                                         r"hidden_states has torch\.bfloat16"):
        experts(hidden.bfloat16(), top_k_index, top_k_weights)


def test_inputs_of_the_wrong_kind_or_shape_are_named():
    experts = experts_module("mixtral", torch.float32)
    hidden, top_k_index, top_k_weights, _ = block_inputs(experts, torch.float32)
    detsum.hf.register()
    experts.config._experts_implementation = "detsum"
    cases = [
        ((hidden.tolist(), top_k_index, top_k_weights), TypeError,
         r"hidden_states must be a torch\.Tensor, got list"),
        ((hidden, top_k_index.float(), top_k_weights), TypeError,
         r"top_k_index has dtype torch\.float32; expected torch\.int32 or torch\.int64"),
        ((hidden, top_k_index, top_k_weights.long()), TypeError,
         r"top_k_weights has dtype torch\.int64; expected a floating-point dtype"),
        ((hidden, top_k_index[:40], top_k_weights[:40]), ValueError,
         r"top_k_index has 40 rows but hidden_states has 48; expected one row"),
        ((hidden[:, :32], top_k_index, top_k_weights), ValueError,
         r"hidden_states has 32 features but MixtralExperts\.gate_up_proj takes 64"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=r"^detsum\.hf\.experts_forward: " + message):
            experts(*args)


@pytest.mark.parametrize("bad_id", [8, -1])
def test_expert_id_out_of_range_is_named(bad_id):
    """route() runs with check=False: the ids are checked once, where the row counts are read,
    inside the operator, before any product."""
    experts = experts_module("mixtral", torch.float32)
    hidden, top_k_index, top_k_weights, _ = block_inputs(experts, torch.float32)
    top_k_index[3, 1] = bad_id
    detsum.hf.register()
    experts.config._experts_implementation = "detsum"
    with pytest.raises(IndexError, match=r"^detsum\.hf\.experts_forward: 1 of the 96 \(token, "
                                         r"slot\) pairs of top_k_index name an expert outside "
                                         r"\[0, 8\)"):
        experts(hidden, top_k_index, top_k_weights)
