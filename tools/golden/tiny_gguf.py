"""tiny-llama-gguf/: the tiny-llama weights as a llama.cpp-style GGUF with mixed quantization, plus goldens.

The GGUF is what llama.cpp's convert script would write for this model: llama arch keys, q/k rows permuted for
interleaved ("GPT-J style") rope, tied embeddings (no output.weight). The expected logits come from reading the
written file back, dequantizing every tensor, undoing the q/k permutation and running HF Llama with plain rope
(no llama3 scaling: GGUF llama metadata here carries none).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from golden_common import SEQUENCES, reset_dir, save_golden
from tiny_models import reference_outputs, tiny_llama_config

GGUF_NAME = "tiny.gguf"
# Byte-level BPE: the 256 byte tokens, except ids 0..4 (the bytes 0x00..0x04, which no test text uses) are
# given to an end-of-text control token and to the results of the four merges below.
EOT_TOKEN = "<|endoftext|>"
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
MERGED_TOKENS = ["Ġt", "he", "Ġthe", "in"]
# Expected encodings come from transformers' GGUF tokenizer conversion of this very file.
TOKENIZER_PROBES = ["the thin hen in the tin", "Hello world!"]

# Storage type per tensor (name without the ".weight" suffix). Norms are always F32.
QUANT_PLAN: dict[str, QType] = {
    "token_embd": QType.Q8_0,
    "blk.0.attn_q": QType.Q8_0,
    "blk.0.attn_k": QType.Q8_0,
    "blk.0.attn_v": QType.Q8_0,
    "blk.0.attn_output": QType.Q8_0,
    "blk.0.ffn_gate": QType.Q4_0,
    "blk.0.ffn_up": QType.Q4_1,
    "blk.0.ffn_down": QType.F16,
    "blk.1.attn_q": QType.Q4_0,
    "blk.1.attn_k": QType.Q4_0,
    "blk.1.attn_v": QType.Q4_1,
    "blk.1.attn_output": QType.Q4_1,
    "blk.1.ffn_gate": QType.Q4_1,
    "blk.1.ffn_up": QType.Q8_0,
    "blk.1.ffn_down": QType.Q4_0,
    "blk.2.attn_q": QType.Q4_1,
    "blk.2.attn_k": QType.Q4_1,
    "blk.2.attn_v": QType.Q4_0,
    "blk.2.attn_output": QType.Q8_0,
    "blk.2.ffn_gate": QType.Q8_0,
    "blk.2.ffn_up": QType.Q4_0,
    "blk.2.ffn_down": QType.Q4_1,
}

# HF parameter name pieces -> llama.cpp tensor names.
LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def permute_for_interleaved_rope(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-script permutation of q/k rows: HF's half-split rope -> interleaved pairs.

    Within each head the rows [0..d/2) and [d/2..d) are interleaved as 0, d/2, 1, d/2+1, ...
    For k, n_head is the kv head count.
    """
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def unpermute_from_interleaved_rope(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of permute_for_interleaved_rope (what transformers' GGUF loader does)."""
    rows = weights.shape[0]
    return weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def gguf_tensors_from_hf(state: dict[str, torch.Tensor], n_head: int, n_kv_head: int) -> dict[str, np.ndarray]:
    """Renames the HF state dict to llama.cpp names (f32 numpy), permuting q/k rows."""
    out = {"token_embd": state["model.embed_tokens.weight"].numpy(), "output_norm": state["model.norm.weight"].numpy()}
    n_layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    for layer in range(n_layers):
        for hf_part, gguf_part in LAYER_TENSORS.items():
            weights = state[f"model.layers.{layer}.{hf_part}.weight"].numpy()
            if gguf_part == "attn_q":
                weights = permute_for_interleaved_rope(weights, n_head)
            elif gguf_part == "attn_k":
                weights = permute_for_interleaved_rope(weights, n_kv_head)
            out[f"blk.{layer}.{gguf_part}"] = np.ascontiguousarray(weights, dtype=np.float32)
    return out


def byte_level_vocab() -> list[str]:
    """GPT-2's byte -> printable-character table, as a list indexed by byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def add_metadata(writer: gguf.GGUFWriter, config) -> None:
    """llama arch hyper-parameters and a minimal gpt2 tokenizer block, with llama.cpp's key names."""
    writer.add_name("tiny-llama-gguf")
    writer.add_vocab_size(config.vocab_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)

    tokens = byte_level_vocab()
    tokens[0] = EOT_TOKEN
    tokens[1 : 1 + len(MERGED_TOKENS)] = MERGED_TOKENS
    types = [gguf.TokenType.NORMAL] * len(tokens)
    types[0] = gguf.TokenType.CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)


def write_gguf(path: Path, tensors: dict[str, np.ndarray], config) -> None:
    """Quantizes per QUANT_PLAN (norms F32) and writes the file (token_embd, output_norm, then blk.N.*)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, config)
    for name, weights in tensors.items():
        qtype = QUANT_PLAN.get(name, QType.F32)
        assert weights.ndim == 2 or qtype == QType.F32, f"{name}: 1-D tensors stay F32"
        data = gguf.quants.quantize(weights, qtype)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_back_dequantized(path: Path, n_head: int, n_kv_head: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Reads the written GGUF, dequantizes every tensor and maps it back to HF names/layout.

    Returns (HF state dict in f32, {gguf tensor name: storage type}).
    """
    reader = gguf.GGUFReader(str(path))
    hf_names = {v: k for k, v in LAYER_TENSORS.items()}
    state: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for tensor in reader.tensors:
        types[tensor.name] = tensor.tensor_type.name
        # Logical shape is the reverse of ggml's (ne0 = columns).
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        base = tensor.name.removesuffix(".weight")
        if base == "token_embd":
            state["model.embed_tokens.weight"] = torch.from_numpy(values.copy())
            continue
        if base == "output_norm":
            state["model.norm.weight"] = torch.from_numpy(values.copy())
            continue
        _, layer, part = base.split(".")
        if part == "attn_q":
            values = unpermute_from_interleaved_rope(values, n_head)
        elif part == "attn_k":
            values = unpermute_from_interleaved_rope(values, n_kv_head)
        state[f"model.layers.{layer}.{hf_names[part]}.weight"] = torch.from_numpy(np.ascontiguousarray(values))
    return state, types


def cross_check_with_transformers_loader(out_dir: Path, model, probes: dict[str, list[int]]) -> dict[str, object]:
    """Independent check: transformers' own GGUF loader (its own un-permute) must give the same logits,
    and its GGUF tokenizer conversion supplies the probe encodings."""
    notes: dict[str, object] = {}
    hf_model = AutoModelForCausalLM.from_pretrained(out_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
    hf_model.eval()
    ids = torch.tensor([SEQUENCES[0]], dtype=torch.long)
    with torch.no_grad():
        theirs = hf_model(input_ids=ids).logits
        ours = model(input_ids=ids).logits
    notes["transformers_gguf_loader_max_abs_diff"] = float((theirs - ours).abs().max())
    assert notes["transformers_gguf_loader_max_abs_diff"] < 1e-4

    tokenizer = AutoTokenizer.from_pretrained(out_dir, gguf_file=GGUF_NAME)
    for text in TOKENIZER_PROBES:
        probes[text] = tokenizer.encode(text, add_special_tokens=False)
    assert probes["Hello world!"] == SEQUENCES[0], probes["Hello world!"]
    return notes


def build_tiny_gguf(out_dir: Path, tiny_llama_state: dict[str, torch.Tensor]):
    """tiny-llama-gguf/: tiny.gguf + golden.safetensors (input_ids, logits, logits_offset, offset_start,
    greedy_tokens, tokenizer_probe{0,1})."""
    reset_dir(out_dir)
    config = tiny_llama_config(llama3_rope_scaling=False)
    path = out_dir / GGUF_NAME
    write_gguf(path, gguf_tensors_from_hf(tiny_llama_state, config.num_attention_heads, config.num_key_value_heads),
               config)

    state, types = read_back_dequantized(path, config.num_attention_heads, config.num_key_value_heads)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings: lm_head.weight is the token embedding, so it is the only key the file lacks.
    assert set(missing) == {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    model.to(torch.float32).eval()
    # Plain rope: the long-distance pass adds nothing that the tiny-llama fixture does not already cover.
    tensors, notes = reference_outputs(model, with_hidden=False, with_long=False)

    probes: dict[str, list[int]] = {}
    notes.update(cross_check_with_transformers_loader(out_dir, model, probes))
    for index, text in enumerate(TOKENIZER_PROBES):
        tensors[f"tokenizer_probe{index}"] = np.array(probes[text], dtype=np.int32)
    notes["tensor_types"] = types
    notes["tokenizer_probes"] = probes
    description = {
        "model": "tiny-llama-gguf",
        "compute": "f32 on dequantized weights, plain rope",
        "tokenizer_probe_texts": TOKENIZER_PROBES,
    }
    save_golden(out_dir / "golden.safetensors", tensors, description)
    return tensors, notes
