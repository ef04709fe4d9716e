"""Tiny random HF checkpoints (tiny-llama, tiny-qwen3) and their golden reference outputs.

Each checkpoint is written with save_pretrained and then re-loaded from disk as f32; the reference is computed
from the re-loaded model, so what the golden file describes is exactly what the checkpoint files hold
(for tiny-qwen3: f32 maths on bf16-rounded weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from golden_common import (
    GREEDY_NEW_TOKENS,
    LONG_SEQUENCE,
    OFFSET_START,
    SEQUENCES,
    check_hidden_state_indexing,
    forward_with_layer_taps,
    greedy_continuation,
    randomize_weights,
    reset_dir,
    save_golden,
    top2_gap,
)

# Weight seeds, picked among 1..8 for greedy continuations whose top-2 logit gaps stay well above float noise
# (min gap 0.23 for tiny-llama, 0.07 for tiny-qwen3) and that do not hit the config's EOS id 2.
LLAMA_SEED = 1
QWEN3_SEED = 1
# Layers whose outputs (before the final norm) go into the golden files as hidden.layer{L}.
HIDDEN_LAYERS = (0, 1, 2)


def tiny_llama_config(llama3_rope_scaling: bool = True) -> LlamaConfig:
    """Llama with GQA (4 query heads, 2 kv heads) and tied embeddings.

    With llama3 scaling (factor 8, low 1, high 4, original context 32) the head_dim-16 frequencies fall in all
    three llama3 bands: wavelength 6.3 (< 8: kept), 19.9 (8..32: smoothly blended), the rest (> 32: divided by 8).
    """
    rope_scaling = None
    if llama3_rope_scaling:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_qwen3_config() -> Qwen3Config:
    """Qwen3 with head_dim 32 != hidden/heads (16), untied lm_head and yarn rope scaling.

    rope_theta is 10000 rather than Qwen3's 1e6 so that more head dimensions land inside yarn's blending ramp
    (dims 0..4 of 16 instead of 0..2): the fixture then exercises the ramp, not just the two flat ends.
    """
    return Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def reference_outputs(
    model, with_hidden: bool = True, with_long: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """Runs the golden inputs through `model` (f32, eval) and returns (golden tensors, notes for the summary).

    Tensors: input_ids [2, 12] i32, logits [2, 12, V] f32, hidden.layer{L} [2, 12, H] f32 (if with_hidden),
    logits_offset [1, 12, V] f32 (sequence 0 at positions OFFSET_START..), offset_start [1] i32,
    greedy_tokens [16] i32 (greedy continuation of sequence 0), long_input_ids [1, 80] i32 and
    long_logits [1, 80, V] f32 (relative distances up to 79, past the original rope context).
    """
    model.eval()
    notes: dict[str, object] = {}
    all_logits, hidden = [], {layer: [] for layer in HIDDEN_LAYERS}
    for seq in SEQUENCES:
        logits, layer_outputs, hf_hidden = forward_with_layer_taps(model, seq)
        notes["hidden_state_indexing"] = check_hidden_state_indexing(model, layer_outputs, hf_hidden)
        # The taps must be the pre-norm stream the logits come from: lm_head(norm(last tap)) == logits.
        with torch.no_grad():
            recomputed = model.lm_head(model.model.norm(layer_outputs[-1].unsqueeze(0)))[0]
        torch.testing.assert_close(recomputed, logits, rtol=1e-5, atol=1e-5)
        all_logits.append(logits)
        for layer in HIDDEN_LAYERS:
            hidden[layer].append(layer_outputs[layer])

    offset_logits, _, _ = forward_with_layer_taps(model, SEQUENCES[0], OFFSET_START)
    notes["offset_vs_plain_max_abs_diff"] = check_offset_pass(model, offset_logits, all_logits[0])

    greedy, step_logits = greedy_continuation(model, SEQUENCES[0], GREEDY_NEW_TOKENS)
    notes["greedy_min_top2_gap"] = round(min(top2_gap(l) for l in step_logits), 4)
    notes["greedy_matches_generate"] = check_against_generate(model, greedy)

    tensors = {
        "input_ids": np.array(SEQUENCES, dtype=np.int32),
        "logits": torch.stack(all_logits).numpy().astype(np.float32),
        "logits_offset": offset_logits.unsqueeze(0).numpy().astype(np.float32),
        "offset_start": np.array([OFFSET_START], dtype=np.int32),
        "greedy_tokens": np.array(greedy, dtype=np.int32),
    }
    if with_long:
        long_logits, _, _ = forward_with_layer_taps(model, LONG_SEQUENCE)
        tensors["long_input_ids"] = np.array([LONG_SEQUENCE], dtype=np.int32)
        tensors["long_logits"] = long_logits.unsqueeze(0).numpy().astype(np.float32)
    if with_hidden:
        for layer in HIDDEN_LAYERS:
            tensors[f"hidden.layer{layer}"] = torch.stack(hidden[layer]).numpy().astype(np.float32)
    return tensors, notes


def check_offset_pass(model, offset_logits: torch.Tensor, plain_logits: torch.Tensor) -> float:
    """Sanity check on the explicit-position_ids pass; returns max |offset logits - plain logits|.

    Row 0 must equal a lone token run at position OFFSET_START (so the mask stayed causal over the 12 rows and
    only rope saw the offset). Rope makes q.k depend on relative positions only, so the offset logits equal the
    plain ones up to float rounding: this pass catches absolute-position bugs (cos/sin tables, position
    plumbing), while the long sequence below is what exercises the scaled frequencies at long distances.
    """
    lone, _, _ = forward_with_layer_taps(model, SEQUENCES[0][:1], OFFSET_START)
    torch.testing.assert_close(lone[0], offset_logits[0], rtol=1e-5, atol=1e-5)
    return float((offset_logits - plain_logits).abs().max())


def check_against_generate(model, greedy: list[int]) -> str:
    """Compares our cached greedy loop with model.generate (which may stop early at the config's EOS)."""
    input_ids = torch.tensor([SEQUENCES[0]], dtype=torch.long)
    with torch.no_grad():
        generated = model.generate(
            input_ids, max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False, pad_token_id=0, attention_mask=None
        )
    new = generated[0, len(SEQUENCES[0]):].tolist()
    assert new == greedy[: len(new)], f"generate {new} != greedy loop {greedy}"
    return "all 16" if len(new) == len(greedy) else f"first {len(new)} (generate stopped at EOS)"


def build_tiny_llama(out_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, object], dict[str, torch.Tensor]]:
    """tiny-llama/: f32 weights sharded over two safetensors files plus index; golden.safetensors.

    Returns (golden tensors, notes, the re-loaded f32 state dict that the GGUF fixture is built from).
    """
    reset_dir(out_dir)
    model = LlamaForCausalLM(tiny_llama_config())
    randomize_weights(model, LLAMA_SEED)
    # ~500 KB of f32 weights: a 300 KB shard limit splits them into exactly two files.
    model.save_pretrained(out_dir, max_shard_size="300KB", safe_serialization=True)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2, f"expected 2 shards, got {shards}"

    reloaded = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    assert reloaded.model.rotary_emb.rope_type == "llama3"
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr(), "not tied"
    tensors, notes = reference_outputs(reloaded)
    notes["shards"] = shards
    save_golden(out_dir / "golden.safetensors", tensors, {"model": "tiny-llama", "compute": "f32"})
    state = {name: value.detach().clone() for name, value in reloaded.state_dict().items()}
    return tensors, notes, state


def build_tiny_qwen3(out_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """tiny-qwen3/: bf16 weights in one model.safetensors; golden.safetensors computed in f32."""
    reset_dir(out_dir)
    model = Qwen3ForCausalLM(tiny_qwen3_config())
    randomize_weights(model, QWEN3_SEED)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    assert (out_dir / "model.safetensors").exists(), "expected a single model.safetensors"

    reloaded = Qwen3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    assert reloaded.model.rotary_emb.rope_type == "yarn"
    for name, param in reloaded.named_parameters():
        assert param.dtype == torch.float32, name
        assert torch.equal(param, param.to(torch.bfloat16).float()), f"{name} is not bf16-exact"
    tensors, notes = reference_outputs(reloaded)
    notes["yarn_attention_factor"] = round(float(reloaded.model.rotary_emb.attention_scaling), 6)
    save_golden(
        out_dir / "golden.safetensors", tensors, {"model": "tiny-qwen3", "compute": "f32 on bf16-rounded weights"}
    )
    write_byte_tokenizer(out_dir)
    return tensors, notes


def gpt2_byte_chars() -> list[str]:
    """GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the rest shift to U+0100+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def write_byte_tokenizer(out_dir: Path) -> None:
    """tokenizer.json for a 256-token vocabulary: id b is byte b, no merges. It makes the tiny target a servable
    model (`dflash serve --model tiny-qwen3`), so end-to-end tests can run it with its tiny drafters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(gpt2_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out_dir / "tokenizer.json"))
