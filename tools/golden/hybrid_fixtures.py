#!/usr/bin/env python3
"""Golden fixtures for the hybrid and sparse targets (crates/models/tests/fixtures/tiny-qwen3-next, tiny-qwen3-moe).

Usage (after `bash tools/golden/setup.sh`):
    .venv/bin/python tools/golden/hybrid_fixtures.py

Two tiny random checkpoints, saved bf16 and re-loaded as f32 (the reference is f32 maths on bf16-rounded weights),
run on one CPU thread with transformers' torch fallbacks (no flash-linear-attention, no causal-conv1d):

* tiny-qwen3-next (Qwen3NextForCausalLM): 4 layers [GDN, gated attention, GDN, GDN], hidden 32, vocab 256 (untied);
  GDN with 2 key heads / 4 value heads of 8 (so each key head serves two value heads), conv kernel 4; attention with
  4 query heads / 2 kv heads of 16, output gate, partial rotary 0.25 (4 of 16 dims); sparse MoE on layers 0, 1, 3
  (8 experts, top-2, normalised top-k, shared expert of 16 with its sigmoid gate), a dense MLP on layer 2
  (`mlp_only_layers`).
* tiny-qwen3-moe (Qwen3MoeForCausalLM): 3 attention layers, hidden 32, tied embeddings; MoE on layers 0 and 2
  (8 experts, top-2, un-normalised top-k), a dense MLP on layer 1.

golden.safetensors of tiny-qwen3-next:

| tensor | shape | content |
| --- | --- | --- |
| input_ids | i32 [2, 12] | the shared sequences (golden_common.SEQUENCES) |
| logits | f32 [2, 12, 256] | every position, one uncached forward per sequence (HF's chunked delta rule) |
| hidden.layer{L} | f32 [2, 12, 32] | output of decoder layer L (before the final norm), L = 0..3 |
| conv.layer{L}, ssm.layer{L} | f32 [2, 3, 64], [2, 4, 8, 8] | GDN state after the prefill of each sequence |
| decode_tokens | i32 [6] | greedy continuation of sequence 0 |
| decode_logits | f32 [6, 256] | logits of each decode step (token i fed one at a time through HF's cache: the recurrent rule) |
| decode_conv.layer{L}, decode_ssm.layer{L} | f32 [3, 64], [4, 8, 8] | GDN state after the 6 decode steps |
| long_input_ids, long_logits | i32 [1, 80], f32 [1, 80, 256] | 80 tokens: two chunks of the chunked rule |
| long_conv.layer{L}, long_ssm.layer{L} | as above | GDN state after the 80 tokens |

The conv state is the last `kernel - 1` inputs of the causal convolution, time-major: row r is input t - 3 + r
(HF keeps `kernel` columns channel-major; its oldest column never reaches an output again and is dropped here).
The ssm state is HF's recurrent state, [value heads, key dim, value dim]. L ranges over the GDN layers (0, 2, 3).

golden.safetensors of tiny-qwen3-moe: input_ids, logits and hidden.layer{0,1,2}, as above.

Weights: golden_common.randomize_weights, then overrides that keep the models in a useful regime: zero-centred
norms (Qwen3-Next's `1 + w`) get w ~ N(0, 0.1); A_log = log U(0.02, 0.5) and dt_bias ~ N(0, 0.5) so the per-step
decay exp(g) lies around 0.7..0.99 and states remember across both chunks; conv weights N(0, 0.5); routers
N(0, 0.5) so top-k choices are not near-ties (the smallest gap between the k-th and (k+1)-th routing
probability is printed and checked).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

for _name, _value in (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("MKL_CBWR", "AUTO")):
    os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_common import (  # noqa: E402
    FIXTURES_DIR,
    LONG_SEQUENCE,
    NORM_JITTER,
    SEQUENCES,
    describe_dir,
    forward_with_layer_taps,
    randomize_weights,
    reset_dir,
    save_golden,
    set_determinism,
)

NEXT_SEED = 3
MOE_SEED = 5
DECODE_STEPS = 6
# Each part must stay small enough to commit next to the other fixtures.
PART_BUDGET_BYTES = 400 * 1024
ROUTER_STD = 0.5
CONV_STD = 0.5


def tiny_qwen3_next_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=16,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_qwen3_moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )


def override_weights(model, seed: int, zero_centred_norms: bool) -> None:
    """The regime overrides described in the module docstring, in sorted-name order from a seeded generator."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                uniform = torch.rand(param.shape, generator=gen, dtype=torch.float32)
                param.copy_(torch.log(0.02 + 0.48 * uniform))
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * noise)
            elif name.endswith("conv1d.weight"):
                param.copy_(CONV_STD * noise)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(ROUTER_STD * noise)
            elif zero_centred_norms and param.ndim == 1 and "norm" in name and "linear_attn.norm" not in name:
                param.copy_(NORM_JITTER * noise)


def save_and_reload(model, cls, out_dir: Path):
    """bf16 on disk, f32 back: the reference sees exactly the stored weights."""
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    assert (out_dir / "model.safetensors").exists(), "expected a single model.safetensors"
    reloaded = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    reloaded.eval()
    for name, param in reloaded.named_parameters():
        assert param.dtype == torch.float32, name
        assert torch.equal(param, param.to(torch.bfloat16).float()), f"{name} is not bf16-exact"
    return reloaded


def router_min_gap(model, sequences: list[list[int]]) -> float:
    """Smallest gap between the k-th and (k+1)-th routing probability over every token and MoE layer."""
    gaps: list[float] = []
    handles = []
    top_k = model.config.num_experts_per_tok
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue

        def hook(_module, _inputs, output):
            probs = torch.softmax(output.float(), dim=-1)
            top = torch.topk(probs, top_k + 1, dim=-1).values
            gaps.append(float((top[:, top_k - 1] - top[:, top_k]).min()))

        handles.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for seq in sequences:
                model(input_ids=torch.tensor([seq]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return min(gaps)


def gdn_layers(model) -> list[int]:
    return [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]


def gdn_states(cache, layers: list[int]) -> dict[str, np.ndarray]:
    """conv (last kernel-1 inputs, time-major) and ssm state of every GDN layer of a batch-1 cache."""
    out: dict[str, np.ndarray] = {}
    for layer in layers:
        conv = cache.conv_states[layer][0]  # [conv_dim, kernel]
        out[f"conv.layer{layer}"] = conv[:, 1:].transpose(0, 1).contiguous().numpy().astype(np.float32)
        out[f"ssm.layer{layer}"] = cache.recurrent_states[layer][0].numpy().astype(np.float32)
    return out


def prefill_states(model, ids: list[int]):
    """Cached prefill: (logits [T, V], cache)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    return out.logits[0].float(), out.past_key_values


def decode_through_cache(model, ids: list[int], steps: int):
    """Greedy decode of `steps` tokens, one at a time through HF's cache (its recurrent delta rule).

    Returns (tokens, logits of each step's forward [steps, V], cache after the last step).
    """
    logits, cache = prefill_states(model, ids)
    next_id = int(torch.argmax(logits[-1]))
    tokens, step_logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(next_id)
            out = model(input_ids=torch.tensor([[next_id]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            row = out.logits[0, -1].float()
            step_logits.append(row)
            next_id = int(torch.argmax(row))
    return tokens, torch.stack(step_logits), cache


def build_qwen3_next(out_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    reset_dir(out_dir)
    model = Qwen3NextForCausalLM(tiny_qwen3_next_config())
    randomize_weights(model, NEXT_SEED)
    override_weights(model, NEXT_SEED, zero_centred_norms=True)
    model = save_and_reload(model, Qwen3NextForCausalLM, out_dir)
    layers = gdn_layers(model)
    n_layers = model.config.num_hidden_layers
    notes: dict[str, object] = {"gdn_layers": layers}

    tensors: dict[str, np.ndarray] = {"input_ids": np.array(SEQUENCES, dtype=np.int32)}
    logits, hidden, states = [], {i: [] for i in range(n_layers)}, []
    for seq in SEQUENCES:
        seq_logits, taps, _ = forward_with_layer_taps(model, seq)
        cached_logits, cache = prefill_states(model, seq)
        torch.testing.assert_close(cached_logits, seq_logits, rtol=0, atol=0)
        logits.append(seq_logits)
        for i in range(n_layers):
            hidden[i].append(taps[i])
        states.append(gdn_states(cache, layers))
    tensors["logits"] = torch.stack(logits).numpy().astype(np.float32)
    for i in range(n_layers):
        tensors[f"hidden.layer{i}"] = torch.stack(hidden[i]).numpy().astype(np.float32)
    for key in states[0]:
        tensors[key] = np.stack([s[key] for s in states])

    tokens, decode_logits, cache = decode_through_cache(model, SEQUENCES[0], DECODE_STEPS)
    tensors["decode_tokens"] = np.array(tokens, dtype=np.int32)
    tensors["decode_logits"] = decode_logits.numpy().astype(np.float32)
    for key, value in gdn_states(cache, layers).items():
        tensors[f"decode_{key}"] = value
    # HF's two delta-rule forms must agree: the uncached chunked forward over prompt + decoded tokens.
    full, _, _ = forward_with_layer_taps(model, SEQUENCES[0] + tokens)
    notes["chunked_vs_recurrent_max_abs_diff"] = float((full[len(SEQUENCES[0]):] - decode_logits).abs().max())
    assert notes["chunked_vs_recurrent_max_abs_diff"] < 1e-4

    long_logits, cache = prefill_states(model, LONG_SEQUENCE)
    tensors["long_input_ids"] = np.array([LONG_SEQUENCE], dtype=np.int32)
    tensors["long_logits"] = long_logits.unsqueeze(0).numpy().astype(np.float32)
    for key, value in gdn_states(cache, layers).items():
        tensors[f"long_{key}"] = value

    notes["router_min_topk_gap"] = round(router_min_gap(model, SEQUENCES + [LONG_SEQUENCE]), 6)
    assert notes["router_min_topk_gap"] > 1e-4, "near-tie in routing: pick another seed"
    with torch.no_grad():
        decays = [float(torch.exp(-layer.linear_attn.A_log.exp()).min()) for layer in model.model.layers
                  if hasattr(layer, "linear_attn")]
    notes["min_decay_at_unit_softplus"] = round(min(decays), 4)
    save_golden(out_dir / "golden.safetensors", tensors,
                {"model": "tiny-qwen3-next", "compute": "f32 on bf16-rounded weights"})
    return tensors, notes


def build_qwen3_moe(out_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    reset_dir(out_dir)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config())
    randomize_weights(model, MOE_SEED)
    override_weights(model, MOE_SEED, zero_centred_norms=False)
    model = save_and_reload(model, Qwen3MoeForCausalLM, out_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "not tied"
    tensors: dict[str, np.ndarray] = {"input_ids": np.array(SEQUENCES, dtype=np.int32)}
    logits, hidden = [], {i: [] for i in range(model.config.num_hidden_layers)}
    for seq in SEQUENCES:
        seq_logits, taps, _ = forward_with_layer_taps(model, seq)
        logits.append(seq_logits)
        for i in hidden:
            hidden[i].append(taps[i])
    tensors["logits"] = torch.stack(logits).numpy().astype(np.float32)
    for i in hidden:
        tensors[f"hidden.layer{i}"] = torch.stack(hidden[i]).numpy().astype(np.float32)
    notes = {"router_min_topk_gap": round(router_min_gap(model, SEQUENCES), 6)}
    assert notes["router_min_topk_gap"] > 1e-4, "near-tie in routing: pick another seed"
    save_golden(out_dir / "golden.safetensors", tensors,
                {"model": "tiny-qwen3-moe", "compute": "f32 on bf16-rounded weights"})
    return tensors, notes


def main() -> int:
    set_determinism()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    status = 0
    for name, build in (("tiny-qwen3-next", build_qwen3_next), ("tiny-qwen3-moe", build_qwen3_moe)):
        out_dir = FIXTURES_DIR / name
        tensors, notes = build(out_dir)
        print(f"== {name}")
        for key in sorted(tensors):
            print(f"   {key}: {tensors[key].dtype} {list(tensors[key].shape)}")
        for key, value in notes.items():
            print(f"   note {key}: {json.dumps(value)}")
        print("\n".join(f"   {line}" for line in describe_dir(out_dir)))
        size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
        if size > PART_BUDGET_BYTES:
            print(f"error: {name} is {size} B, over its {PART_BUDGET_BYTES} B budget", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
