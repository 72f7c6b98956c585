"""A transformers Mixtral (tiny config, random init) under ``detsum.deterministic`` alone, no
adapter: what it runs on detsum, training bits across thread counts and runs, pickling and
torch.save, torch.compile.

What Mixtral's forward and backward send through the switch (transformers 5.24, CPU), by
experts implementation (``config._experts_implementation``):

- every one: the token embedding's backward (``embedding_dense_backward``);
- "batched_mm": the backward of ``gate_up_proj[expert_ids]`` and ``down_proj[expert_ids]``
  (``index_put`` with ``accumulate=True``): a whole expert matrix per routed token, so from
  32768 elements on more than one thread torch's own kernel adds them atomically and its bits
  vary from run to run;
- "grouped_mm" (the default): ``histc`` (the tokens per expert) and the backward of three
  ``x[idx]`` (the tokens sorted by expert, their routing weights, and back);
- "eager" (the model's own loop): ``index_add_`` (each expert's rows into the output) and
  the backward of ``hidden_states[token_idx]``.

Training bits are checked with "batched_mm": the other two run torch's CPU matmuls, whose
bits follow the thread count (``_grouped_mm``; ``mm`` on some shapes, as in the loop), which
the switch does not cover. In "fp32" mode a sum of at most 256 float32 terms is torch's serial
CPU sum, so where torch's kernel is serial the switch gives its bits: what shows that detsum
ran is ``switch.counts``, and a token seen more than 256 times, whose embedding gradient
"fp32" sums in chunks (docs/determinism.md) where torch sums serially.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import detsum
from detsum import switch

transformers = pytest.importorskip("transformers")

VOCAB = 64
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=512)
STEPS = 5


@pytest.fixture(autouse=True)
def torch_threads_compiler_and_switch_restored():
    threads = torch.get_num_threads()
    torch._dynamo.reset()
    yield
    switch._blocks.clear()
    detsum.disable()
    torch.set_num_threads(threads)
    torch._dynamo.reset()


def tiny_mixtral(experts: str = "batched_mm"):
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG))
    model.set_experts_implementation(experts)
    return model


def token_ids(batches: int = 1, seed: int = 1) -> torch.Tensor:
    """``batches`` batches of 2 sequences of 16 tokens."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batches, 2, 16), generator=generator)


def long_sequence() -> torch.Tensor:
    """One sequence of 320 tokens, 300 of them token 7: its embedding row sums 300 terms."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.full((1, 320), 7)
    others = torch.randperm(320, generator=generator)[:20]
    ids[0, others] = torch.randint(8, VOCAB, (20,), generator=generator)
    return ids


def gradients(model, ids, forward=None):
    """The logits and each parameter's gradient of one causal LM loss, and the switched calls
    made meanwhile (operator, "detsum" or "torch")."""
    model.zero_grad(set_to_none=True)
    before = switch.counts.copy()
    output = (model if forward is None else forward)(input_ids=ids, labels=ids)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return output.logits.detach(), grads, switch.counts - before


def assert_same_parameters(got: dict, expected: dict, what) -> None:
    assert got.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differ, (what, differ)


# What one forward and backward of the tiny model sends where, per experts implementation:
# 2 layers, 4 experts, every expert hit by these tokens.
ROUTED = {
    "batched_mm": {("_index_put_impl_", "detsum"): 2 * 2,
                   ("embedding_dense_backward", "detsum"): 1},
    "grouped_mm": {("histc", "detsum"): 2, ("_index_put_impl_", "detsum"): 2 * 3,
                   ("embedding_dense_backward", "detsum"): 1,
                   # inv_perm[perm] = arange(...): an integer write, no accumulation
                   ("_index_put_impl_", "torch"): 2},
    "eager": {("index_add_", "detsum"): 2 * 4, ("_index_put_impl_", "detsum"): 2 * 4,
              ("embedding_dense_backward", "detsum"): 1,
              # top_k_weights[token_idx, top_k_pos]: two index tensors, which the switch
              # leaves to torch; the pairs are distinct, so nothing is summed there
              ("_index_put_impl_", "torch"): 2 * 4},
}


@pytest.mark.parametrize("experts", sorted(ROUTED))
def test_switch_routes_mixtrals_accumulating_ops_to_detsum(experts):
    model = tiny_mixtral(experts)
    ids = token_ids()[0]
    # Switch off: nothing on detsum (its kernels, registered by an earlier block, hand each
    # call to torch's).
    assert not any(ran == "detsum" for _, ran in gradients(model, ids)[2])
    with detsum.deterministic("fp32"):
        assert gradients(model, ids)[2] == ROUTED[experts]


def train(threads: int, switched: bool = True) -> dict:
    """The parameters after ``STEPS`` AdamW steps on ``threads`` torch threads (detsum's
    kernels follow torch's count), each step's switched calls checked on the way."""
    torch.set_num_threads(threads)
    model = tiny_mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = token_ids(STEPS)
    for ids in batches:
        if switched:
            with detsum.deterministic("fp32"):
                _, _, routed = gradients(model, ids)
            assert routed == ROUTED["batched_mm"]
        else:
            gradients(model, ids)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_training_gives_the_same_bits_on_one_and_two_threads_and_every_run():
    """Twice on 1 thread, twice on 2: the same parameters after 5 steps. On 2 threads torch's
    own index_put adds the expert matrices' gradients atomically (26 of 30 such runs differed
    from the 1-thread bits); here every one of those sums ran on detsum (checked each step).
    Where torch is serial (1 thread), "fp32" gives its bits: these sums have at most 256
    float32 terms."""
    one = train(1)
    assert_same_parameters(train(2), one, "2 threads")
    assert_same_parameters(train(1), one, "1 thread, again")
    assert_same_parameters(train(2), one, "2 threads, again")
    assert_same_parameters(train(1, switched=False), one, "torch on 1 thread")


def test_fp32_mode_sums_a_token_seen_more_than_256_times_in_chunks():
    """The embedding gradient of a token seen 300 times: "fp32" sums it in chunks of 256
    (detsum.index_add's bits), torch's kernel serially; every row of at most 256 terms is
    torch's bits."""
    model = tiny_mixtral()
    ids = long_sequence()
    seen = []

    def keep_gradient(module, args, output):
        output.register_hook(seen.append)

    model.model.embed_tokens.register_forward_hook(keep_gradient)
    with detsum.deterministic("fp32"):
        _, grads, _ = gradients(model, ids)
    rows = seen[0].reshape(-1, CONFIG["hidden_size"])
    switched = grads["model.embed_tokens.weight"]
    chunked = detsum.index_add(torch.zeros_like(switched), 0, ids.reshape(-1), rows, mode="fp32")
    torchs = torch.ops.aten.embedding_dense_backward(seen[0], ids, VOCAB, -1, False)
    assert torch.equal(switched, chunked)
    assert not torch.equal(switched[7], torchs[7])
    others = torch.arange(VOCAB) != 7
    assert torch.equal(switched[others], torchs[others])


def test_pickle_and_torch_save_keep_the_switched_model():
    """A model trained under the switch, pickled, saved whole and as a state_dict: each copy
    gives its logits and gradients under the switch."""
    model = tiny_mixtral()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = token_ids(2)
    with detsum.deterministic("fp32"):
        gradients(model, ids[0])
        optimizer.step()
        expected = gradients(model, ids[1])

        whole, weights = io.BytesIO(), io.BytesIO()
        torch.save(model, whole)
        torch.save(model.state_dict(), weights)
        whole.seek(0)
        weights.seek(0)
        from_state = tiny_mixtral()
        from_state.load_state_dict(torch.load(weights))
        copies = {"pickle": pickle.loads(pickle.dumps(model)), "deepcopy": copy.deepcopy(model),
                  "torch.save": torch.load(whole, weights_only=False), "state_dict": from_state}
        for how, copied in copies.items():
            assert copied.config._experts_implementation == "batched_mm", how
            logits, grads, routed = gradients(copied, ids[1])
            assert torch.equal(logits, expected[0]), how
            assert_same_parameters(grads, expected[1], how)
            assert routed == expected[2], how


def test_compiled_model_gives_the_eager_bits_under_the_switch():
    """The whole model in one graph (fullgraph=True), forward and backward, on the sequence
    whose embedding gradient "fp32" gives other bits than torch's: aot_eager runs every op as
    eager code does, so compiled and eager code agree bit for bit, with the same calls to
    detsum. (Inductor compiles this model too, with the same calls to detsum, but its own
    arithmetic elsewhere, with the switch or without: see the MoE block below.)"""
    model = tiny_mixtral()
    ids = long_sequence()
    torchs = gradients(model, ids)[1]["model.embed_tokens.weight"]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with detsum.deterministic("fp32"):
        eager = gradients(model, ids)
        got = gradients(model, ids, forward=compiled)
    assert torch.equal(got[0], eager[0])
    assert_same_parameters(got[1], eager[1], "compiled")
    assert got[2] == eager[2] == ROUTED["batched_mm"]
    assert not torch.equal(eager[1]["model.embed_tokens.weight"], torchs)


def test_inductor_compiled_moe_block_same_bits_on_one_and_two_threads():
    """The sparse MoE block compiled by Inductor in one graph: its expert matrices' gradients
    run on detsum (Inductor's own scatter adds them atomically across threads: without the
    switch the 2-thread bits differed from the 1-thread ones in most runs), so forward and
    backward give the same bits on 1 and 2 threads, on every call."""
    block = tiny_mixtral().model.layers[0].mlp
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 16, CONFIG["hidden_size"], generator=generator)
    upstream = torch.randn(2, 16, CONFIG["hidden_size"], generator=generator)
    compiled = torch.compile(block, fullgraph=True)

    def run(threads):
        torch.set_num_threads(threads)
        x = hidden.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        before = switch.counts.copy()
        output = compiled(x)
        output.backward(upstream)
        assert switch.counts - before == {("_index_put_impl_", "detsum"): 2}
        return [output.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]

    with detsum.deterministic("fp32"):
        first = run(1)
        for threads in (2, 1, 2):
            assert all(torch.equal(a, b) for a, b in zip(run(threads), first)), threads
