#!/usr/bin/env python3
"""Drafters for the hybrid target and MTP heads: a random `mtp.*` head inside tiny-qwen3-next, a Llama-layout head
for tiny-qwen3, and a DFlash drafter for tiny-qwen3-next.

Usage (after `hybrid_fixtures.py` and the `tiny-qwen3` part of `make_fixtures.py`, whose folders it adds to):
    .venv/bin/python tools/golden/mtp_fixtures.py

* tiny-qwen3-next/model.safetensors gains Qwen3-Next's MTP tensors (`mtp.fc`, `mtp.pre_fc_norm_embedding`,
  `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`: a gated full-attention layer with a sparse MoE block, `mtp.norm`;
  bf16, zero-centred norms). transformers ignores them (`_keys_to_ignore_on_load_unexpected = ["^mtp.*"]`), so
  the trunk's golden outputs do not change. The folder also gets the byte-level tokenizer.json of tiny-qwen3
  (id b is byte b), so `dflash run -m tiny-qwen3-next` works.
  Reference: vLLM's `qwen3_next_mtp` maths written with transformers' own modules: the trunk's final hidden state
  `h[j]` (after `model.norm`) and the embedding of token j+1 go through `fc([pre_fc_norm_embedding(e) |
  pre_fc_norm_hidden(h)])`, one `Qwen3NextDecoderLayer` (full attention, causal over the head's entries, rope
  position j), `mtp.norm`, then the trunk's lm_head.
* tiny-qwen3-mtp/: a head in the layout tools/train/export.py writes for the default model (`model_type` llama,
  plain `x * w` norms, a Llama decoder layer without q/k norms), for the tiny-qwen3 target (hidden 64).
  Reference: the trainer's own `MtpHead.forward_depths` (tools/train/mtp.py), teacher-forced.
* dflash-next/: a random DFlash v1 drafter (the reference package's layout, as dflash_fixtures.py writes it) for
  tiny-qwen3-next, reading its layers 2 and 0 (both Gated DeltaNet): hidden 32, 2 layers, block 8. No golden: the
  engine's invariance tests only need drafts, and the drafter forward's parity is dflash_fixtures.py's.

mtp_golden.safetensors (tiny-qwen3-next) and tiny-qwen3-mtp/golden.safetensors:

| tensor | shape | content |
| --- | --- | --- |
| input_ids | i32 [12] | golden_common.SEQUENCES[0] |
| depth1_logits | f32 [11, 256] | entry j = (hidden at j, token j+1) for j = 0..10, all entries attended causally |
| chain_start | i32 [1] | c = 6 |
| chain_logits | f32 [3, 256] | the chain started at entry c: depth 1 (entry c), depth 2 (position c+1: the previous output after mtp.norm and token c+2), depth 3 (position c+2, token c+3) |
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
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Qwen3ForCausalLM, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    Qwen3NextDecoderLayer,
    Qwen3NextRMSNorm,
)

GOLDEN_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(GOLDEN_DIR))
sys.path.insert(0, str(GOLDEN_DIR.parent / "train"))

from golden_common import FIXTURES_DIR, SEQUENCES, randomize_weights, reset_dir, save_golden, set_determinism  # noqa: E402,E501
from hybrid_fixtures import override_weights  # noqa: E402
from mtp import MtpHead  # noqa: E402
from target import TargetConfig  # noqa: E402
from tiny_models import write_byte_tokenizer  # noqa: E402
import dflash_fixtures  # noqa: E402

NEXT_MTP_SEED = 13
LLAMA_MTP_SEED = 17
NEXT_DRAFTER_SEED = 19
CHAIN_START = 6
CHAIN_DEPTH = 3
PART_BUDGET_BYTES = 200 * 1024


class NextMtp(nn.Module):
    """Qwen3-Next's MTP module with the checkpoint's parameter names (under `mtp.`)."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
        # A full-attention layer index; its MLP kind is the one vLLM gives the MTP layer (index 0): sparse here.
        full = config.layer_types.index("full_attention")
        assert full not in config.mlp_only_layers
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, full)])
        self.norm = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)

    def combine(self, embed: nn.Embedding, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e = self.pre_fc_norm_embedding(embed(tokens))
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))

    def run(self, rotary, x: torch.Tensor) -> torch.Tensor:
        """The layer and mtp.norm over entries x [1, n, H] at positions 0..n-1, causally."""
        n = x.shape[1]
        positions = torch.arange(n)[None]
        cos, sin = rotary(x, positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layers[0](x, position_embeddings=(cos, sin), attention_mask=mask)
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out)


def next_reference(model, head: NextMtp, ids: list[int]) -> dict[str, np.ndarray]:
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        hidden = model.model(input_ids=ids_t).last_hidden_state  # after model.norm
        embed, rotary = model.model.embed_tokens, model.model.rotary_emb
        x = head.combine(embed, ids_t[:, 1:], hidden[:, :-1])
        depth1 = model.lm_head(head.run(rotary, x))[0]
        entries, prev = x[:, : CHAIN_START + 1], head.run(rotary, x[:, : CHAIN_START + 1])[:, -1:]
        chain = [model.lm_head(prev)[0, 0]]
        for k in range(2, CHAIN_DEPTH + 1):
            token = ids_t[:, CHAIN_START + k : CHAIN_START + k + 1]
            entries = torch.cat([entries, head.combine(embed, token, prev)], dim=1)
            prev = head.run(rotary, entries)[:, -1:]
            chain.append(model.lm_head(prev)[0, 0])
    return golden_tensors(ids, depth1, torch.stack(chain))


def golden_tensors(ids: list[int], depth1: torch.Tensor, chain: torch.Tensor) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.array(ids, dtype=np.int32),
        "depth1_logits": depth1.float().numpy().astype(np.float32),
        "chain_start": np.array([CHAIN_START], dtype=np.int32),
        "chain_logits": chain.float().numpy().astype(np.float32),
    }


def bf16_round(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def add_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    """Rewrites a safetensors file with `extra` added (any earlier `mtp.*` tensors replaced)."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("mtp.")}
        metadata = f.metadata()
    tensors.update(extra)
    save_file(tensors, str(path), metadata=metadata)


def build_next_mtp() -> dict[str, np.ndarray]:
    out_dir = FIXTURES_DIR / "tiny-qwen3-next"
    model = Qwen3NextForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    head = NextMtp(model.config)
    randomize_weights(head, NEXT_MTP_SEED)
    override_weights(head, NEXT_MTP_SEED, zero_centred_norms=True)
    bf16_round(head)
    head.eval()
    add_tensors(out_dir / "model.safetensors",
                {f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()})
    reloaded = Qwen3NextForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"the trunk's {name} changed"
    tensors = next_reference(model, head, SEQUENCES[0])
    save_golden(out_dir / "mtp_golden.safetensors", tensors,
                {"model": "tiny-qwen3-next mtp head", "compute": "f32 on bf16-rounded weights"})
    write_byte_tokenizer(out_dir)
    return tensors


def tiny_llama_head_config(target_cfg) -> TargetConfig:
    return TargetConfig(hidden_size=target_cfg.hidden_size, num_layers=target_cfg.num_hidden_layers, num_heads=4,
                        num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=target_cfg.vocab_size,
                        rope_theta=10000.0, rms_norm_eps=1e-6, context_length=256, bos_id=1, eos_id=2,
                        chat_template="")


def head_config_json(cfg: TargetConfig) -> dict:
    """The exported head's config.json (tools/train/export.py's layout)."""
    return {
        "architectures": ["MtpHead"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context_length, "tie_word_embeddings": True,
        "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "dtype": "bfloat16", "mtp_num_hidden_layers": 1,
        "mtp_config": {"target": "tiny-qwen3", "tensor_prefix": "mtp.",
                       "hidden_input": "target final-norm output (the hidden state that feeds the LM head)",
                       "norm": "rms_norm: x / rms(x) * weight (weights near 1, not zero-centred)"},
    }


def build_llama_mtp() -> dict[str, np.ndarray]:
    out_dir = reset_dir(FIXTURES_DIR / "tiny-qwen3-mtp")
    target = Qwen3ForCausalLM.from_pretrained(FIXTURES_DIR / "tiny-qwen3", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    cfg = tiny_llama_head_config(target.config)
    head = MtpHead(cfg)
    randomize_weights(head, LLAMA_MTP_SEED)
    bf16_round(head)
    head.eval()
    (out_dir / "config.json").write_text(json.dumps(head_config_json(cfg), indent=2) + "\n", encoding="utf-8")
    save_file({f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = SEQUENCES[0]
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        hidden = target.model(input_ids=ids_t).last_hidden_state
        next_ids = torch.cat([ids_t[:, 1:], ids_t[:, -1:]], dim=1)
        outputs = head.forward_depths(target.model.embed_tokens(next_ids), hidden, CHAIN_DEPTH)
        depth1 = target.lm_head(outputs[0][0, : len(ids) - 1])
        chain = torch.stack([target.lm_head(outputs[d][0, CHAIN_START + d]) for d in range(CHAIN_DEPTH)])
    tensors = golden_tensors(ids, depth1, chain)
    save_golden(out_dir / "golden.safetensors", tensors,
                {"model": "tiny-qwen3-mtp", "compute": "f32 on bf16-rounded weights", "reference": "tools/train/mtp.py"})
    return tensors


def build_next_drafter() -> dict[str, np.ndarray]:
    out_dir = reset_dir(FIXTURES_DIR / "dflash-next")
    config = dflash_fixtures.drafter_config("dflash-v1")
    config.hidden_size, config.intermediate_size, config.num_target_layers = 32, 40, 4
    config.dflash_config = {"block_size": 8, "target_layer_ids": [2, 0], "mask_token_id": 250}
    model = dflash_fixtures.ref.DFlashDraftModel(config)
    dflash_fixtures.randomize_drafter(model, NEXT_DRAFTER_SEED)
    dflash_fixtures.save_checkpoint(model, config, out_dir)
    return {}


def main() -> int:
    set_determinism()
    status = 0
    parts = (("tiny-qwen3-next mtp", build_next_mtp), ("tiny-qwen3-mtp", build_llama_mtp),
             ("dflash-next", build_next_drafter))
    for name, build in parts:
        tensors = build()
        print(f"== {name}")
        for key in sorted(tensors):
            print(f"   {key}: {tensors[key].dtype} {list(tensors[key].shape)}")
    for folder in ("tiny-qwen3-mtp", "dflash-next"):
        size = sum(p.stat().st_size for p in (FIXTURES_DIR / folder).rglob("*") if p.is_file())
        print(f"   {folder}: {size} B")
        if size > PART_BUDGET_BYTES:
            print(f"error: {folder} is {size} B, over its {PART_BUDGET_BYTES} B budget", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
