"""The target model, SmolLM2-135M-Instruct, read from the GGUF file that the server serves.

Weights are dequantized with the `gguf` package (so the drafter learns the quantized model we serve, not the
original checkpoint), the q/k rows are un-permuted from llama.cpp's interleaved-rope order, and a small Llama
forward runs them: a full causal pass that captures decoder-layer outputs (teacher forcing for training) and a
batched left-padded pass with a static KV cache (generation). Neither needs transformers; `to_hf_llama` builds a
transformers LlamaForCausalLM from the same tensors for the reference `dflash` check.

Tokenizer: the GGUF vocabulary and merges through the `tokenizers` pipeline that tools/golden/tokenizer_ids.py
established as SmolLM2's (transformers' own GGUF tokenizer conversion differs from it). Chat prompts are rendered
with the GGUF's chat template through jinja2; SmolLM2 adds no BOS.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GGUF = Path.home() / ".cache" / "dflash" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name part -> HF Llama name part (per decoder layer).
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True)
class TargetConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    bos_id: int
    eos_id: int
    chat_template: str


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def unpermute_rope_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved rope pairs -> HF's half-split layout)."""
    rows = weights.shape[0]
    return weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def read_gguf(path: Path) -> tuple[TargetConfig, dict[str, torch.Tensor], dict]:
    """(config, HF-named f32 state dict, tokenizer metadata) of a llama-architecture GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, expected llama")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    cfg = TargetConfig(
        hidden_size=hidden,
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=hidden // heads,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        vocab_size=len(tokens),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        # GGUF stores f32; print it back as the decimal it was written from (1e-05, not 9.9999997e-06).
        rms_norm_eps=float(f'{_field(reader, "llama.attention.layer_norm_rms_epsilon"):.7g}'),
        context_length=int(_field(reader, "llama.context_length")),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
    state = {}
    for tensor in reader.tensors:
        # ggml lists dimensions innermost first; numpy wants them outermost first.
        shape = [int(d) for d in reversed(tensor.shape.tolist())]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        base = tensor.name.removesuffix(".weight")
        if base == "token_embd":
            state["model.embed_tokens.weight"] = torch.from_numpy(np.ascontiguousarray(values))
        elif base == "output_norm":
            state["model.norm.weight"] = torch.from_numpy(np.ascontiguousarray(values))
        elif base == "output":
            state["lm_head.weight"] = torch.from_numpy(np.ascontiguousarray(values))
        else:
            _, layer, part = base.split(".")
            if part == "attn_q":
                values = unpermute_rope_rows(values, cfg.num_heads)
            elif part == "attn_k":
                values = unpermute_rope_rows(values, cfg.num_kv_heads)
            state[f"model.layers.{layer}.{LAYER_TENSORS[part]}.weight"] = torch.from_numpy(np.ascontiguousarray(values))
    meta = {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_types": _field(reader, "tokenizer.ggml.token_type"),
        "merges": _field(reader, "tokenizer.ggml.merges"),
        "bos_id": cfg.bos_id,
        "eos_id": cfg.eos_id,
    }
    return cfg, state, meta


def build_tokenizer(meta: dict):
    """SmolLM2's tokenizer over the GGUF vocabulary (the pipeline tools/golden/tokenizer_ids.py documents)."""
    sys.path.insert(0, str(REPO_ROOT / "tools" / "golden"))
    try:
        from tokenizer_ids import build_reference
    finally:
        sys.path.pop(0)
    return build_reference(meta)


@functools.lru_cache(maxsize=4)
def _compiled_template(template: str):
    import jinja2

    return jinja2.Environment(keep_trailing_newline=True).from_string(template)


def render_chat(template: str, user_text: str) -> str:
    """The chat-templated prompt for one user message, ready for the assistant's reply."""
    return render_messages(template, [{"role": "user", "content": user_text}])


def render_messages(template: str, messages: list[dict]) -> str:
    """The chat-templated conversation (user and assistant turns), ready for the assistant's next reply."""
    return _compiled_template(template).render(messages=messages, add_generation_prompt=True)


class RmsNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm: normalise in f32, cast back, then scale (F.rms_norm's
        # weight would be applied before the cast). On CUDA F.rms_norm is one fused kernel instead of five.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [*positions.shape, head_dim] for neox-style (rotate-half) rope."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, hd]; cos/sin [b, s, hd]: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].

    The rotated half-products are added into x * cos in place (three kernels; no rotated copy of x)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


class DecoderLayer(nn.Module):
    """One Llama decoder layer with HF parameter names (self_attn.*, mlp.*, *_layernorm)."""

    def __init__(self, cfg: TargetConfig, intermediate_size: int | None = None):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        inter = intermediate_size or cfg.intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, inter, bias=False)
        self.mlp.up_proj = nn.Linear(h, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, h, bias=False)
        self.input_layernorm = RmsNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RmsNorm(h, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [b, s, H] (already normed) -> q [b, nh, s, hd], k/v [b, nkv, s, hd], rope applied to q and k."""
        b, s, _ = x.shape
        q = self.self_attn.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.self_attn.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.self_attn.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, mask=None, is_causal=False) -> torch.Tensor:
        """SDPA with grouped kv heads: q [b, nh, s, hd], k/v [b, nkv, t, hd]; returns [b, s, nh*hd].

        With a mask, the query heads that share a kv head are folded into the query rows ([b, nkv, g*s, hd]), so
        the masked kernels run without a GQA path and the K/V cache is never copied per query head.
        """
        b, nh, s, hd = q.shape
        nkv = k.shape[1]
        groups = nh // nkv
        if mask is None or groups == 1:
            if groups > 1 and q.dtype == torch.float32:
                # f32 has no flash kernel, and the memory-efficient one takes no GQA: without this copy of K/V per
                # query head, SDPA falls back to its math path, which materialises every score (10% of a training
                # step on an H100).
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
            return out.transpose(1, 2).reshape(b, s, -1)
        # mask [s, t] or [b|1, 1, s, t] -> [b|1, 1, g*s, t]; query head h = kv head (h // g), as in repeat_kv.
        mask = mask.reshape(-1, 1, s, mask.shape[-1])
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(mask.shape[0], 1, groups * s, -1)
        folded = q.reshape(b, nkv, groups * s, hd)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(b, nh, s, hd)
        return out.transpose(1, 2).reshape(b, s, -1)

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(F.silu(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual add and the MLP half of the layer."""
        h = residual + self.self_attn.o_proj(attn)
        return h + self.mlp_forward(self.post_attention_layernorm(h))


class LlamaTarget(nn.Module):
    """The target's forward: teacher-forced capture and batched generation with a static KV cache."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RmsNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @classmethod
    def from_state(cls, cfg: TargetConfig, state: dict[str, torch.Tensor]) -> LlamaTarget:
        model = cls(cfg)
        own = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
        missing, unexpected = model.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise ValueError(f"target weights: missing {missing}, unexpected {unexpected}")
        if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise ValueError("untied lm_head: this trainer assumes tied embeddings (the default model has them)")
        model.requires_grad_(False)
        return model.eval()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied LM head: final-normed hidden [..., H] -> logits [..., V]."""
        return hidden @ self.embed_tokens.weight.t()

    @torch.no_grad()
    def capture(self, ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Causal pass over right-padded ids [b, s] at positions 0..s-1.

        Returns (final-normed hidden [b, s, H], [output of decoder layer i, [b, s, H], for i in layer_ids]).
        Right padding never changes earlier rows, so padded rows are simply ignored by the caller.
        """
        b, s = ids.shape
        positions = torch.arange(s, device=ids.device).expand(b, s)
        x = self.embed_tokens(ids)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        taps = {}
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.input_layernorm(x), cos, sin)
            x = layer.finish(x, layer.attend(q, k, v, is_causal=True))
            if i in layer_ids:
                taps[i] = x
        return self.norm(x), [taps[i] for i in layer_ids]

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> list[list[int]]:
        """Batched generation; each prompt's new tokens, ending with EOS when one came.

        Prompts are left-padded so every row writes the same cache slot per step; a row's positions start at 0
        at its first real token, and its padding slots are masked out of attention. temperature 0 is greedy,
        otherwise plain temperature sampling (no top-k / top-p).
        """
        device = self.embed_tokens.weight.device
        dtype = kv_dtype or self.embed_tokens.weight.dtype
        b, p = len(prompts), max(len(x) for x in prompts)
        pad = torch.tensor([p - len(x) for x in prompts], device=device)
        ids = torch.zeros(b, p, dtype=torch.long, device=device)
        for row, x in enumerate(prompts):
            ids[row, p - len(x):] = torch.tensor(x, device=device)
        total = p + max_new_tokens
        cache = KvCache(len(self.layers), b, self.cfg.num_kv_heads, total, self.cfg.head_dim, dtype, device)
        slots = torch.arange(total, device=device)
        valid_key = slots[None, :] >= pad[:, None]  # [b, total]
        positions = (slots[None, :p] - pad[:, None]).clamp_min(0)
        causal = slots[:p, None] >= slots[None, :p]
        mask = (causal[None] & valid_key[:, None, :p]) | torch.eye(p, dtype=torch.bool, device=device)[None]
        logits = self._step(ids, positions, cache, 0, mask[:, None])
        out = torch.empty(b, max_new_tokens, dtype=torch.long, device=device)
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        steps = 0
        for step in range(max_new_tokens):
            token = pick_tokens(logits, temperature, generator)
            token = torch.where(finished, torch.full_like(token, self.cfg.eos_id), token)
            out[:, step] = token
            steps = step + 1
            finished |= token == self.cfg.eos_id
            if step + 1 == max_new_tokens or bool(finished.all()):
                break
            slot = p + step
            pos = (slot - pad)[:, None]
            logits = self._step(token[:, None], pos, cache, slot, valid_key[:, None, None, : slot + 1])
        result = []
        for row in out[:, :steps].tolist():
            end = row.index(self.cfg.eos_id) + 1 if self.cfg.eos_id in row else len(row)
            result.append(row[:end])
        return result

    def _step(self, ids, positions, cache: KvCache, start: int, mask) -> torch.Tensor:
        """Runs ids [b, s] into cache slots start..start+s-1; returns the last row's logits [b, V] in f32."""
        x = self.embed_tokens(ids)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        end = start + ids.shape[1]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(layer.input_layernorm(x), cos, sin)
            keys, values = cache.write(i, start, k, v)
            attn = layer.attend(q, keys[:, :, :end].to(q.dtype), values[:, :, :end].to(q.dtype), mask=mask)
            x = layer.finish(x, attn)
        return self.logits(self.norm(x[:, -1])).float()


class KvCache:
    """Static per-layer K/V buffers [layers][b, nkv, slots, hd]."""

    def __init__(self, layers: int, b: int, nkv: int, slots: int, hd: int, dtype, device):
        self.k = torch.zeros(layers, b, nkv, slots, hd, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer], self.v[layer]


def pick_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits [b, V] f32 -> token ids [b]: argmax, or a sample of softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def configure_torch(device: torch.device, smoke: bool, tf32: bool = True) -> None:
    """TF32 matmuls on GPU unless tf32 is False (training's labels are f32); one CPU thread for smoke runs (on a
    small shared machine, small matmuls spend more time in thread hand-off than in arithmetic)."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if smoke and device.type == "cpu":
        torch.set_num_threads(1)


def load_target(gguf_path: Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """(config, LlamaTarget on device, tokenizer) from the GGUF file."""
    cfg, state, meta = read_gguf(gguf_path)
    model = LlamaTarget.from_state(cfg, state).to(device=device, dtype=dtype)
    return cfg, model, build_tokenizer(meta)


def to_hf_llama(cfg: TargetConfig, state: dict[str, torch.Tensor]):
    """A transformers LlamaForCausalLM (f32, eval) holding the same dequantized weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
    )
    model = LlamaForCausalLM(hf_cfg)
    weights = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"HF llama: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float().eval()
