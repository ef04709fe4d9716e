"""The checkpoint layout of stream_fixtures.py's targets: config.json in the classic transformers-4.57 form with the
hyper-connection keys, transformers 5.x's fused experts written back under the per-expert 4.57 names our loader
reads, and the check that a written checkpoint holds exactly a reference checkpoint's tensors plus the hc ones.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors import safe_open

HC = {"hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-04}
HIDDEN = 32


def next_config_json() -> dict:
    """tiny-qwen3-next's config.json (as 4.57's save_pretrained writes it for hybrid_fixtures.py's config) + hc keys."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 32,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 8,
        "max_position_embeddings": 256,
        "mlp_only_layers": [2],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 8,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 16,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "vocab_size": 256,
        **HC,
    }


def dense_config_json() -> dict:
    """tiny-qwen3's config.json keys (4.57's Qwen3Config), at hidden 32, without rope scaling, plus hc keys."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "layer_types": ["full_attention"] * 3,
        "max_position_embeddings": 256,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 256,
        **HC,
    }


def legacy_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5.x's fused experts back to the per-expert 4.57 names.

    `X.experts.gate_up_proj` [E, 2I, H] holds gate rows then up rows (the experts forward chunks the projection in
    two, gate first); `X.experts.down_proj` is [E, H, I]. Reloading the result through 5.25's own checkpoint
    conversion (which fuses per-expert tensors) must give the same weights back: build_target checks it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = value[e, inter:].clone()
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e].clone()
        else:
            out[name] = value
    return out


def tensor_layout(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(path), framework="pt") as f:
        layout = {}
        for key in f.keys():
            sl = f.get_slice(key)
            layout[key] = (sl.get_dtype(), tuple(sl.get_shape()))
    return layout


def hc_names(n_layers: int) -> list[str]:
    names = [f"model.layers.{i}.{m}.{p}" for i in range(n_layers) for m in ("attn_hc", "ffn_hc")
             for p in ("fn", "base", "scale")]
    return names + [f"model.hc_head.{p}" for p in ("hc_fn", "hc_base", "hc_scale")]


def check_layout(written: Path, reference: Path, n_layers: int, same_shapes: bool) -> str:
    """Every tensor of `reference` appears in `written` with its dtype (and, for same-sized models, its shape); the only
    extra tensors are the hc ones, in f32."""
    ours, theirs = tensor_layout(written), tensor_layout(reference)
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"{written} lacks {missing[:5]}"
    for key, (dtype, shape) in theirs.items():
        assert ours[key][0] == dtype, f"{key}: {ours[key][0]} vs {dtype}"
        if same_shapes:
            assert ours[key][1] == shape, f"{key}: {ours[key][1]} vs {shape}"
    extra = sorted(set(ours) - set(theirs))
    assert extra == sorted(hc_names(n_layers)), f"unexpected extra tensors {extra}"
    assert all(ours[k][0] == "F32" for k in extra)
    return (f"{len(theirs)} tensors of {reference.parent.name} present ({'same shapes' if same_shapes else 'names'}, "
            f"dtypes), plus {len(extra)} f32 hc tensors")
