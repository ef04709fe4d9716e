#!/usr/bin/env python3
"""Golden fixtures for hyper-connection (mHC) stream targets: tiny-qwen3-next-hc, tiny-qwen3-hc and their drafters.

Usage (two environments: DeepSeek-V4's hyper-connection modules exist only in transformers 5.x, while the drafters are
written by dflash_fixtures.py's machinery, which needs the reference `dflash` package and transformers 4.57):
    bash tools/golden/setup.sh hc                                       # .venv-hc, pinned in requirements-hc.txt
    .venv-hc/bin/python tools/golden/stream_fixtures.py                 # targets (~10 s on 2 cores)
    .venv/bin/python tools/golden/stream_fixtures.py --part drafters    # drafters (~5 s, after `bash setup.sh`)
The targets part reads tiny-qwen3-next/ and tiny-qwen3/ (their generation_config.json and tokenizer.json are copied,
their tensor names are the layout the new checkpoints are checked against, and their goldens check that transformers
5.25 computes what 4.57 did), so it runs after hybrid_fixtures.py, mtp_fixtures.py and make_fixtures.py.

A stream target keeps its residual as hc_mult = N = 4 streams [T, N, H] (transformers 5.25's DeepSeek-V4
manifold-constrained hyper-connections): the embedding is copied N times; each decoder layer runs
`DeepseekV4DecoderLayer.forward` itself (StreamLayer subclasses it; only its token mixer, MLP and norms are swapped
for the Qwen3-Next / Qwen3 modules of the stock model):
    post, comb, collapsed = attn_hc(streams);  a = mixer(input_layernorm(collapsed))
    streams = post[..., None] * a[..., None, :] + comb^T @ streams
    post, comb, collapsed = ffn_hc(streams);   m = mlp(post_attention_layernorm(collapsed))
    streams = post[..., None] * m[..., None, :] + comb^T @ streams
and the model ends with lm_head(norm(hc_head(streams))) (`DeepseekV4HyperHead`). `DeepseekV4HyperConnection` and
`DeepseekV4HyperHead` are transformers' own classes; everything else is transformers' stock Qwen3NextForCausalLM /
Qwen3ForCausalLM, loaded from the written checkpoint. All maths f32 on one CPU thread; the trunk weights are
bf16-rounded (as stored), the hc weights f32.

* tiny-qwen3-next-hc/: tiny-qwen3-next's architecture and sizes (hybrid_fixtures.py: GDN / gated attention / GDN /
  GDN, hidden 32, vocab 256, MoE with shared expert on layers 0, 1, 3, dense MLP on layer 2), its own seeded weights
  in hybrid_fixtures.py's regime, a random `mtp.*` head (mtp_fixtures.py's names and shapes, no golden), plus
  `"hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-04` in config.json (hc_eps apart from rms_norm_eps 1e-6,
  so a swap of the two fails the parity tests).
* tiny-qwen3-hc/: a Qwen3ForCausalLM (q/k norms) with hidden 32, 3 layers, 4 query / 2 kv heads of 16,
  intermediate 64, vocab 256, untied lm_head, rope_theta 10000 without scaling, the same hc keys.

Both checkpoints are the transformers-4.57 layout our loader reads: config.json in the classic form (`rope_theta`,
`rope_scaling`, the keys 4.57's save_pretrained writes) plus the hc keys, and model.safetensors with exactly the
tensor names of tiny-qwen3-next / tiny-qwen3 (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`, split from
transformers 5.x's fused `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I]), bf16, plus in f32:

| tensor | shape | content |
| --- | --- | --- |
| model.layers.{i}.attn_hc.fn, .ffn_hc.fn | [(2+N)N, N·H] = [24, 128] | projection of the RMS-normed flattened streams to (pre, post, comb) |
| model.layers.{i}.attn_hc.base, .ffn_hc.base | [24] | their biases |
| model.layers.{i}.attn_hc.scale, .ffn_hc.scale | [3] | pre, post, comb scales |
| model.hc_head.hc_fn, .hc_base, .hc_scale | [4, 128], [4], [1] | the final collapse |

Weights: trunk as hybrid_fixtures.py sets them (golden_common.randomize_weights + hybrid_fixtures.override_weights;
tiny-qwen3-hc: randomize_weights only); every hc module its own draws with fn ~ N(0, 0.1), base ~ N(0, 0.5),
scale ~ U(0.5, 1.5), so pre / post / comb are far from uniform and the streams really differ.

golden.safetensors of both (each sequence run alone: batch 1, positions 0..11):

| tensor | shape | content |
| --- | --- | --- |
| input_ids | i32 [2, 12] | golden_common.SEQUENCES |
| logits | f32 [2, 12, 256] | every position, one uncached forward per sequence (HF's chunked delta rule for GDN) |
| streams.layer{L} | f32 [2, 12, 4, 32] | the output streams of decoder layer L, every layer |
| collapsed_final | f32 [2, 12, 32] | hc_head's output, before the final norm |
| decode_tokens | i32 [6] | greedy continuation of sequence 0: token 0 is the prefill's argmax, token i+1 the argmax of decode_logits[i] |
| decode_logits | f32 [6, 256] | logits after feeding decode_tokens[i] at position 12+i, one token at a time through HF's cache (GDN's recurrent rule) |
| long_input_ids, long_logits | i32 [1, 80], f32 [1, 80, 256] | tiny-qwen3-next-hc only: golden_common.LONG_SEQUENCE, two chunks of the chunked rule |

and, in tiny-qwen3-next-hc's golden only, standalone modules (N = 4, H = 32, 20 Sinkhorn iterations, hc_eps 1e-4,
rms_norm_eps 1e-6, the same weight regime, inputs N(0, 1)):

| tensor | shape | content |
| --- | --- | --- |
| hc_module.fn, .base, .scale | [24, 128], [24], [3] | a `DeepseekV4HyperConnection`'s weights |
| hc_module.streams | [5, 4, 32] | its input streams (5 tokens) |
| hc_module.post, .comb, .collapsed | [5, 4], [5, 4, 4], [5, 32] | its outputs |
| hc_module.block_out | [5, 32] | a random block output |
| hc_module.expanded | [5, 4, 32] | post ⊗ block_out + combᵀ · streams, as DeepseekV4DecoderLayer combines them |
| hc_module.head_fn, .head_base, .head_scale | [4, 128], [4], [1] | a `DeepseekV4HyperHead`'s weights |
| hc_module.head_out | [5, 32] | its output on hc_module.streams |

Cross-checks (printed; the run fails on a mismatch): transformers 5.25's stock models reproduce the 4.57 goldens of
tiny-qwen3-next and tiny-qwen3; the composition with the hc modules replaced by a one-stream identity (post = comb = 1,
collapsed = the stream) reproduces the stock model's logits on the same weights; the reloaded checkpoint equals the
weights it was written from; cached prefill equals the uncached forward and the cached decode equals a full recompute;
the 4 streams of layer 0 differ; greedy top-2 gaps and MoE routing are not near-ties.

Drafters (`--part drafters`, no golden): dflash2-next-hc/ and dflash2-next-hc-raw/, random DFlash2 drafters in
dflash_fixtures.py's dflash-v2 layout and config form for tiny-qwen3-next-hc: hidden 32, vocab 256, 2 layers,
intermediate 40, block 8, mask_token_id 255, target_layer_ids [2, 0] (GDN layers), selector rank 16. fc.weight is
[32, 64] (taps × H: a drafter trained on the per-token mean of the streams) in dflash2-next-hc and [32, 256]
(taps × N × H: the raw streams) in dflash2-next-hc-raw; nothing else differs (the config is the same).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

for _name, _value in (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("MKL_CBWR", "AUTO"),
                      ("HF_HUB_OFFLINE", "1")):
    os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file as load_numpy  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_common import (  # noqa: E402
    FIXTURES_DIR,
    LONG_SEQUENCE,
    SEQUENCES,
    describe_dir,
    randomize_weights,
    reset_dir,
    save_golden,
    set_determinism,
    top2_gap,
)
from stream_layout import (  # noqa: E402
    HC,
    HIDDEN,
    check_layout,
    dense_config_json,
    hc_names,
    legacy_layout,
    next_config_json,
    tensor_layout,
)

# Trunk seeds picked among 40..51 for the widest smallest routing gap (tiny-qwen3-next-hc) and greedy / prompt top-2
# gaps (both); see the notes the run prints.
NEXT_SEED = 43
DENSE_SEED = 41
NEXT_MTP_SEED = 47
HC_SEED = {"tiny-qwen3-next-hc": 51, "tiny-qwen3-hc": 53}
MODULE_SEED = 59
DRAFTER_SEED = {"dflash2-next-hc": 61, "dflash2-next-hc-raw": 67}
DECODE_STEPS = 6
MODULE_TOKENS = 5
HC_FN_STD = 0.1
HC_BASE_STD = 0.5
# Sizes per folder, and the whole fixtures folder (make_fixtures.SIZE_BUDGET_BYTES; not imported: it needs gguf).
PART_BUDGET_BYTES = {"tiny-qwen3-next-hc": 480 * 1024, "tiny-qwen3-hc": 300 * 1024, "dflash2-next-hc": 64 * 1024,
                     "dflash2-next-hc-raw": 80 * 1024}
FOLDER_BUDGET_BYTES = 4 * 1024 * 1024
# Bounds of the checks.
PARITY_ATOL = 1e-4  # 5.25 vs 4.57 goldens; cached vs uncached GDN rules
ONE_STREAM_ATOL = 1e-5
MIN_STREAM_SPREAD = 1e-2
MIN_GREEDY_GAP = 1e-2
MIN_ROUTER_GAP = 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# The stream model: transformers' DeepseekV4DecoderLayer.forward around stock Qwen3-Next / Qwen3 modules
# ---------------------------------------------------------------------------------------------------------------------

def hc_modules():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4DecoderLayer,
        DeepseekV4HyperConnection,
        DeepseekV4HyperHead,
    )
    return DeepseekV4Config, DeepseekV4DecoderLayer, DeepseekV4HyperConnection, DeepseekV4HyperHead


def hc_config(hidden: int, rms_norm_eps: float):
    """The DeepseekV4Config the hc modules read: hc_mult, hc_sinkhorn_iters, hc_eps, hidden_size, and rms_norm_eps
    (the eps of the hc modules' unweighted RMSNorm of the flattened streams; not hc_eps)."""
    DeepseekV4Config = hc_modules()[0]
    return DeepseekV4Config(hidden_size=hidden, rms_norm_eps=rms_norm_eps, **HC)


class Mixer(nn.Module):
    """The stock decoder layer's token mixer, called with the arguments the stock layer passes it, returning
    (output, None) as DeepseekV4DecoderLayer expects of `self_attn`."""

    def __init__(self, stock_layer):
        super().__init__()
        gdn = getattr(stock_layer, "block_type", None) == "linear_attention"  # Qwen3-Next's GDN layers
        self.linear_attn = stock_layer.linear_attn if gdn else None
        self.self_attn = None if gdn else stock_layer.self_attn

    def forward(self, hidden_states, position_embeddings, attention_mask, position_ids, cache, use_cache):
        if self.linear_attn is not None:
            out = self.linear_attn(hidden_states=hidden_states, cache=cache, attention_mask=attention_mask,
                                   use_cache=use_cache)
        else:
            out, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                    position_ids=position_ids, cache=cache, use_cache=use_cache,
                                    position_embeddings=position_embeddings)
        return out, None


class Mlp(nn.Module):
    """The stock layer's MLP / sparse MoE block with DeepseekV4DecoderLayer's call signature."""

    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, hidden_states, input_ids=None):
        out = self.inner(hidden_states)
        return out[0] if isinstance(out, tuple) else out


class OneStream(nn.Module):
    """A trivial hyper-connection for the one-stream cross-check: post = 1, comb = [[1]], collapsed = the stream."""

    def forward(self, streams):
        assert streams.shape[2] == 1
        ones = torch.ones(streams.shape[:3], dtype=streams.dtype)
        return ones, ones.unsqueeze(-1), streams[:, :, 0]


def stream_layer_class():
    DeepseekV4DecoderLayer = hc_modules()[1]

    class StreamLayer(DeepseekV4DecoderLayer):
        """DeepseekV4DecoderLayer with its forward untouched: only its six submodules are ours."""

        def __init__(self, stock_layer, layer_idx: int, attn_hc: nn.Module, ffn_hc: nn.Module):
            nn.Module.__init__(self)
            self.layer_idx = layer_idx
            self.self_attn = Mixer(stock_layer)
            self.mlp = Mlp(stock_layer.mlp)
            self.input_layernorm = stock_layer.input_layernorm
            self.post_attention_layernorm = stock_layer.post_attention_layernorm
            self.attn_hc = attn_hc
            self.ffn_hc = ffn_hc

    return StreamLayer


class StreamModel(nn.Module):
    """A stock CausalLM (weights shared) run with hc_mult streams, as DeepseekV4Model.forward runs its layers."""

    def __init__(self, base, hc_weights: dict[str, torch.Tensor] | None):
        super().__init__()
        _, _, HyperConnection, HyperHead = hc_modules()
        self.base = base
        cfg = base.config
        self.n_streams = cfg.hc_mult if hc_weights is not None else 1
        StreamLayer = stream_layer_class()
        layers = []
        for i, stock in enumerate(base.model.layers):
            if hc_weights is None:
                attn_hc, ffn_hc = OneStream(), OneStream()
            else:
                hcc = hc_config(cfg.hidden_size, cfg.rms_norm_eps)
                attn_hc, ffn_hc = HyperConnection(hcc), HyperConnection(hcc)
                load_params(attn_hc, hc_weights, f"model.layers.{i}.attn_hc.")
                load_params(ffn_hc, hc_weights, f"model.layers.{i}.ffn_hc.")
            layers.append(StreamLayer(stock, i, attn_hc, ffn_hc))
        self.layers = nn.ModuleList(layers)
        if hc_weights is None:
            self.hc_head = None
        else:
            self.hc_head = HyperHead(hc_config(cfg.hidden_size, cfg.rms_norm_eps))
            load_params(self.hc_head, hc_weights, "model.hc_head.")

    def masks(self, embeds, cache, position_ids) -> dict:
        """The per-layer-type masks, built by the functions the stock model's forward uses."""
        module = sys.modules[type(self.base.model).__module__]
        kwargs = {"config": self.base.config, "inputs_embeds": embeds, "attention_mask": None, "cache": cache,
                  "position_ids": position_ids}
        masks = {"full_attention": module.create_causal_mask(**kwargs)}
        if "linear_attention" in self.base.config.layer_types:
            masks["linear_attention"] = module.create_recurrent_attention_mask(**kwargs)
        return masks

    def forward(self, ids: list[int], position_start: int = 0, cache=None):
        """Batch 1: (logits [T, V], per-layer output streams [T, N, H], hc_head output [T, H])."""
        inner = self.base.model
        input_ids = torch.tensor([ids], dtype=torch.long)
        position_ids = torch.arange(position_start, position_start + len(ids), dtype=torch.long).unsqueeze(0)
        embeds = inner.embed_tokens(input_ids)
        masks = self.masks(embeds, cache, position_ids)
        position_embeddings = inner.rotary_emb(embeds, position_ids)
        streams = embeds.unsqueeze(2).expand(-1, -1, self.n_streams, -1).contiguous()
        taps = []
        for i, layer in enumerate(self.layers):
            streams = layer(streams, input_ids=input_ids, position_embeddings=position_embeddings,
                            attention_mask=masks[self.base.config.layer_types[i]], position_ids=position_ids,
                            cache=cache, use_cache=cache is not None)
            taps.append(streams[0].detach().clone())
        collapsed = streams[:, :, 0] if self.hc_head is None else self.hc_head(streams)
        logits = self.base.lm_head(inner.norm(collapsed))
        return logits[0].float(), taps, collapsed[0].detach().clone()


def load_params(module: nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = weights[prefix + name]
            assert value.shape == param.shape and value.dtype == torch.float32, prefix + name
            param.copy_(value)


def draw_hc_weights(gen: torch.Generator, prefix: str, rows: int, head: bool) -> dict[str, torch.Tensor]:
    """fn ~ N(0, 0.1), base ~ N(0, 0.5), scale ~ U(0.5, 1.5), in that order; `rows` = (2 + N) N for a connection
    (three scales), N for the head (one scale)."""
    names = ("hc_fn", "hc_base", "hc_scale") if head else ("fn", "base", "scale")
    return {
        prefix + names[0]: HC_FN_STD * torch.randn(rows, HC["hc_mult"] * HIDDEN, generator=gen),
        prefix + names[1]: HC_BASE_STD * torch.randn(rows, generator=gen),
        prefix + names[2]: 0.5 + torch.rand(1 if head else 3, generator=gen),
    }


def model_hc_weights(n_layers: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = HC["hc_mult"]
    weights: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        for module in ("attn_hc", "ffn_hc"):
            weights.update(draw_hc_weights(gen, f"model.layers.{i}.{module}.", (2 + n) * n, head=False))
    weights.update(draw_hc_weights(gen, "model.hc_head.", n, head=True))
    return weights


# ---------------------------------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------------------------------

def next_mtp_head(config) -> dict[str, torch.Tensor]:
    """A random `mtp.*` head with mtp_fixtures.py's names, shapes and regime (bf16), experts in the 4.57 layout."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    from hybrid_fixtures import override_weights

    class NextMtp(nn.Module):
        def __init__(self):
            super().__init__()
            h = config.hidden_size
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
            self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
            full = config.layer_types.index("full_attention")
            self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, full)])
            self.norm = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)

    head = NextMtp()
    randomize_weights(head, NEXT_MTP_SEED)
    override_weights(head, NEXT_MTP_SEED, zero_centred_norms=True)
    return {f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in legacy_layout(head.state_dict()).items()}


def load_stock(cls, path: Path):
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                experts_implementation="eager")
    return model.eval()


def version_parity(cls, name: str, long: bool) -> float:
    """transformers 5.25's stock model on a 4.57 fixture reproduces that fixture's golden logits."""
    model = load_stock(cls, FIXTURES_DIR / name)
    golden = load_numpy(str(FIXTURES_DIR / name / "golden.safetensors"))
    worst = 0.0
    runs = [(golden["input_ids"], golden["logits"])]
    if long:
        runs.append((golden["long_input_ids"], golden["long_logits"]))
    with torch.no_grad():
        for ids, expected in runs:
            for row, want in zip(ids, expected):
                got = model(input_ids=torch.tensor([row.tolist()]), use_cache=False).logits[0]
                worst = max(worst, float((got - torch.from_numpy(want)).abs().max()))
    assert worst < PARITY_ATOL, f"transformers {transformers.__version__} differs from {name}'s golden by {worst}"
    return worst


def stock_logits(base, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        positions = torch.arange(len(ids)).unsqueeze(0)
        return base(input_ids=torch.tensor([ids]), position_ids=positions, use_cache=False).logits[0].float()


def router_min_gap(model: StreamModel, sequences: list[list[int]]) -> float | None:
    """Smallest gap between the k-th and (k+1)-th routing probability over every token and MoE layer."""
    gaps: list[float] = []
    handles = []
    top_k = getattr(model.base.config, "num_experts_per_tok", None)
    for layer in model.base.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue

        def hook(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            top = torch.topk(torch.softmax(logits.float(), dim=-1), top_k + 1, dim=-1).values
            gaps.append(float((top[:, top_k - 1] - top[:, top_k]).min()))

        handles.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for seq in sequences:
                model(seq)
    finally:
        for handle in handles:
            handle.remove()
    return min(gaps) if gaps else None


def decode_through_cache(model: StreamModel, ids: list[int], steps: int):
    """Cached prefill then `steps` greedy tokens fed one at a time through HF's cache (hybrid_fixtures' convention).

    Returns (prefill logits [T, V], tokens, decode logits [steps, V])."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.base.config)
    with torch.no_grad():
        prefill, _, _ = model(ids, 0, cache)
        next_id = int(torch.argmax(prefill[-1]))
        tokens, rows = [], []
        for step in range(steps):
            tokens.append(next_id)
            logits, _, _ = model([next_id], len(ids) + step, cache)
            rows.append(logits[-1])
            next_id = int(torch.argmax(logits[-1]))
    return prefill, tokens, torch.stack(rows)


def build_target(name: str) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    from transformers import Qwen3ForCausalLM, Qwen3NextForCausalLM

    is_next = name == "tiny-qwen3-next-hc"
    cls = Qwen3NextForCausalLM if is_next else Qwen3ForCausalLM
    plain = FIXTURES_DIR / ("tiny-qwen3-next" if is_next else "tiny-qwen3")
    out_dir = reset_dir(FIXTURES_DIR / name)
    config_json = next_config_json() if is_next else dense_config_json()
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for file in ("generation_config.json", "tokenizer.json"):
        shutil.copyfile(plain / file, out_dir / file)
    notes: dict[str, object] = {}
    keys_457 = set(json.loads((plain / "config.json").read_text()))
    assert set(config_json) == keys_457 | set(HC), f"config keys differ from {plain.name}'s"

    # Trunk: random in the hybrid regime, bf16, in the 4.57 layout, with the f32 hc tensors (and the mtp head).
    config = cls.config_class.from_pretrained(out_dir)
    assert config.hidden_size == HIDDEN and config.hc_mult == HC["hc_mult"]
    model = cls(config)
    randomize_weights(model, NEXT_SEED if is_next else DENSE_SEED)
    if is_next:
        from hybrid_fixtures import override_weights

        override_weights(model, NEXT_SEED, zero_centred_norms=True)
    model = model.to(torch.bfloat16)
    trunk = {k: v.contiguous() for k, v in legacy_layout(model.state_dict()).items()}
    hc_weights = model_hc_weights(config.num_hidden_layers, HC_SEED[name])
    tensors = {**trunk, **hc_weights}
    if is_next:
        tensors.update(next_mtp_head(config))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    notes["layout"] = check_layout(out_dir / "model.safetensors", plain / "model.safetensors",
                                   config.num_hidden_layers, same_shapes=is_next)

    # The reference: the checkpoint as transformers 5.25 loads it (its conversion fuses the per-expert tensors).
    base = load_stock(cls, out_dir)
    written = model.state_dict()
    for key, param in base.state_dict().items():
        assert torch.equal(param, written[key].float()), f"{key} changed through save / load"
    assert base.config.hc_mult == HC["hc_mult"]
    rope = base.config.rope_parameters
    assert rope["rope_type"] == "default" and rope["rope_theta"] == 10000.0, rope
    if is_next:
        assert rope.get("partial_rotary_factor") == 0.25, rope
    if is_next:
        notes["experts_implementation"] = base.config._experts_implementation
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        stored_hc = {k: f.get_tensor(k) for k in hc_names(config.num_hidden_layers)}
    streams_model = StreamModel(base, stored_hc).eval()
    one_stream = StreamModel(base, None).eval()

    sequences = SEQUENCES + ([LONG_SEQUENCE] if is_next else [])
    with torch.no_grad():
        notes["one_stream_vs_stock_max_abs_diff"] = max(
            float((one_stream(seq)[0] - stock_logits(base, seq)).abs().max()) for seq in sequences)
    assert notes["one_stream_vs_stock_max_abs_diff"] <= ONE_STREAM_ATOL, "the composition is not the stock layer"

    golden: dict[str, np.ndarray] = {"input_ids": np.array(SEQUENCES, dtype=np.int32)}
    n_layers = config.num_hidden_layers
    logits, streams, collapsed = [], {i: [] for i in range(n_layers)}, []
    gaps = []
    with torch.no_grad():
        for seq in SEQUENCES:
            seq_logits, taps, final = streams_model(seq)
            logits.append(seq_logits)
            collapsed.append(final)
            for i in range(n_layers):
                streams[i].append(taps[i])
            gaps.append(min(top2_gap(row) for row in seq_logits))
    golden["logits"] = torch.stack(logits).numpy().astype(np.float32)
    for i in range(n_layers):
        golden[f"streams.layer{i}"] = torch.stack(streams[i]).numpy().astype(np.float32)
    golden["collapsed_final"] = torch.stack(collapsed).numpy().astype(np.float32)
    notes["prompt_min_top2_gap"] = round(min(gaps), 5)

    # The 4 streams of layer 0 must differ (per token, the largest difference between two streams).
    layer0 = torch.from_numpy(golden["streams.layer0"])
    spread = (layer0.unsqueeze(2) - layer0.unsqueeze(3)).abs().amax(dim=(2, 3, 4))  # [2, 12]
    notes["layer0_stream_spread_min_max"] = [round(float(spread.min()), 4), round(float(spread.max()), 4)]
    assert float(spread.min()) > MIN_STREAM_SPREAD, "the streams of layer 0 barely differ"
    last = torch.from_numpy(golden[f"streams.layer{n_layers - 1}"])
    notes["last_layer_stream_spread_max"] = round(float((last.unsqueeze(2) - last.unsqueeze(3)).abs().max()), 4)

    prefill, tokens, decode_logits = decode_through_cache(streams_model, SEQUENCES[0], DECODE_STEPS)
    notes["cached_prefill_max_abs_diff"] = float((prefill - logits[0]).abs().max())
    assert notes["cached_prefill_max_abs_diff"] < PARITY_ATOL
    golden["decode_tokens"] = np.array(tokens, dtype=np.int32)
    golden["decode_logits"] = decode_logits.numpy().astype(np.float32)
    with torch.no_grad():
        full, _, _ = streams_model(SEQUENCES[0] + tokens)
    notes["decode_vs_recompute_max_abs_diff"] = float((full[len(SEQUENCES[0]):] - decode_logits).abs().max())
    assert notes["decode_vs_recompute_max_abs_diff"] < PARITY_ATOL
    greedy_gaps = [top2_gap(prefill[-1])] + [top2_gap(row) for row in decode_logits]
    notes["greedy_top2_gaps"] = [round(g, 4) for g in greedy_gaps]
    assert min(greedy_gaps) > MIN_GREEDY_GAP, "a greedy step is a near-tie: pick another seed"
    notes["decode_tokens"] = tokens

    if is_next:
        with torch.no_grad():
            long_logits, _, _ = streams_model(LONG_SEQUENCE)
        golden["long_input_ids"] = np.array([LONG_SEQUENCE], dtype=np.int32)
        golden["long_logits"] = long_logits.unsqueeze(0).numpy().astype(np.float32)
        golden.update(module_goldens(notes))
    gap = router_min_gap(streams_model, sequences)
    if gap is not None:
        notes["router_min_topk_gap"] = round(gap, 6)
        assert gap > MIN_ROUTER_GAP, "near-tie in routing: pick another seed"
    notes["logit_std"] = round(float(golden["logits"].std()), 3)

    description = {
        "model": name,
        "compute": "f32 on bf16-rounded trunk weights and f32 hc weights, one CPU thread",
        "reference": (f"transformers {transformers.__version__}: DeepseekV4HyperConnection / DeepseekV4HyperHead, "
                      f"DeepseekV4DecoderLayer.forward around the stock {cls.__name__} modules"),
        "decode": "one token at a time through HF's cache (GDN: recurrent rule)",
        "hc": HC,
    }
    save_golden(out_dir / "golden.safetensors", golden, description)
    return golden, notes


def module_goldens(notes: dict[str, object]) -> dict[str, np.ndarray]:
    """A standalone DeepseekV4HyperConnection and DeepseekV4HyperHead on random streams (see the docstring)."""
    _, _, HyperConnection, HyperHead = hc_modules()
    cfg = hc_config(HIDDEN, 1e-6)
    n = HC["hc_mult"]
    gen = torch.Generator().manual_seed(MODULE_SEED)
    weights = draw_hc_weights(gen, "", (2 + n) * n, head=False)
    weights.update(draw_hc_weights(gen, "", n, head=True))
    streams = torch.randn(1, MODULE_TOKENS, n, HIDDEN, generator=gen)
    block_out = torch.randn(1, MODULE_TOKENS, HIDDEN, generator=gen)
    conn, head = HyperConnection(cfg).eval(), HyperHead(cfg).eval()
    load_params(conn, weights, "")
    load_params(head, weights, "")
    with torch.no_grad():
        post, comb, collapsed = conn(streams)
        # DeepseekV4DecoderLayer's combination, verbatim (dtype is f32 throughout).
        dtype = streams.dtype
        expanded = post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams)
        head_out = head(streams)
    # comb is consumed transposed: output stream k takes sum_j comb[j, k] * stream j.
    explicit = post[..., None] * block_out[:, :, None] + torch.einsum("tjk,tjd->tkd", comb[0], streams[0])[None]
    torch.testing.assert_close(explicit, expanded, rtol=0, atol=1e-6)
    notes["module_comb_row_col_sum_err"] = [round(float((comb.sum(-1) - 1).abs().max()), 7),
                                            round(float((comb.sum(-2) - 1).abs().max()), 7)]
    notes["module_comb_asymmetry"] = round(float((comb - comb.transpose(-1, -2)).abs().max()), 4)
    notes["module_comb_range"] = [round(float(comb.min()), 4), round(float(comb.max()), 4)]
    notes["module_post_range"] = [round(float(post.min()), 4), round(float(post.max()), 4)]
    notes["module_dtypes"] = {"post": str(post.dtype), "comb": str(comb.dtype), "collapsed": str(collapsed.dtype)}
    out = {
        "hc_module.fn": weights["fn"], "hc_module.base": weights["base"], "hc_module.scale": weights["scale"],
        "hc_module.streams": streams[0], "hc_module.post": post[0], "hc_module.comb": comb[0],
        "hc_module.collapsed": collapsed[0], "hc_module.block_out": block_out[0], "hc_module.expanded": expanded[0],
        "hc_module.head_fn": weights["hc_fn"], "hc_module.head_base": weights["hc_base"],
        "hc_module.head_scale": weights["hc_scale"], "hc_module.head_out": head_out[0],
    }
    return {k: v.detach().numpy().astype(np.float32) for k, v in out.items()}


def run_targets() -> int:
    if not transformers.__version__.startswith("5."):
        print(f"error: the targets part needs transformers 5.25 (.venv-hc), not {transformers.__version__}",
              file=sys.stderr)
        return 1
    from transformers import Qwen3ForCausalLM, Qwen3NextForCausalLM

    # Quiet the load reports (they list the hc tensors as unexpected: check_layout accounts for every tensor) and the
    # notices that GDN runs transformers' torch fallbacks (the reference, as in hybrid_fixtures.py).
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print("== version parity (5.25 stock models vs the 4.57 goldens)")
    print(f"   tiny-qwen3-next logits + long_logits max abs diff: "
          f"{version_parity(Qwen3NextForCausalLM, 'tiny-qwen3-next', long=True):.3g}")
    print(f"   tiny-qwen3 logits + long_logits max abs diff: "
          f"{version_parity(Qwen3ForCausalLM, 'tiny-qwen3', long=True):.3g}")
    status = 0
    for name in ("tiny-qwen3-next-hc", "tiny-qwen3-hc"):
        golden, notes = build_target(name)
        status |= report(name, golden, notes)
    return status


# ---------------------------------------------------------------------------------------------------------------------
# Drafters (transformers 4.57 + the reference dflash package, through dflash_fixtures.py)
# ---------------------------------------------------------------------------------------------------------------------

def build_drafter(name: str, raw: bool) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    import dflash_fixtures

    out_dir = reset_dir(FIXTURES_DIR / name)
    config = dflash_fixtures.drafter_config("dflash-v2")
    config.hidden_size, config.intermediate_size, config.num_target_layers = HIDDEN, 40, 4
    config.dflash_config = {**config.dflash_config, "block_size": 8, "target_layer_ids": [2, 0],
                            "mask_token_id": 255, "selector_rank": 16}
    model = dflash_fixtures.ref.DFlash2DraftModel(config)
    taps = len(config.dflash_config["target_layer_ids"])
    if raw:
        model.fc = nn.Linear(taps * HC["hc_mult"] * HIDDEN, HIDDEN, bias=False)
    dflash_fixtures.randomize_drafter(model, DRAFTER_SEED[name])
    dflash_fixtures.save_checkpoint(model, config, out_dir)
    layout = tensor_layout(out_dir / "model.safetensors")
    notes: dict[str, object] = {"fc.weight": list(layout["fc.weight"][1]), "tensors": len(layout)}
    assert layout["fc.weight"][1] == (HIDDEN, taps * (HC["hc_mult"] if raw else 1) * HIDDEN)
    if not raw:
        # The reference package loads it back (and dflash_fixtures checks the attention pattern and bf16 values).
        reloaded = dflash_fixtures.load_reference("dflash-v2", out_dir)
        notes["reference_reload"] = f"ok, target_layer_ids {reloaded.target_layer_ids}, block {reloaded.block_size}"
    return {}, notes


def run_drafters() -> int:
    if not transformers.__version__.startswith("4.57"):
        print(f"error: the drafters part needs transformers 4.57 and dflash (.venv), not {transformers.__version__}",
              file=sys.stderr)
        return 1
    status = 0
    for name, raw in (("dflash2-next-hc", False), ("dflash2-next-hc-raw", True)):
        golden, notes = build_drafter(name, raw)
        status |= report(name, golden, notes)
    mean, raw = (tensor_layout(FIXTURES_DIR / n / "model.safetensors") for n in ("dflash2-next-hc",
                                                                                 "dflash2-next-hc-raw"))
    assert {k: v for k, v in mean.items() if k != "fc.weight"} == {k: v for k, v in raw.items() if k != "fc.weight"}
    assert (FIXTURES_DIR / "dflash2-next-hc" / "config.json").read_bytes() == (
        FIXTURES_DIR / "dflash2-next-hc-raw" / "config.json").read_bytes()
    print("   the two drafters differ only in fc.weight's shape (same config.json)")
    return status


def report(name: str, golden: dict[str, np.ndarray], notes: dict[str, object]) -> int:
    print(f"== {name}")
    for key in sorted(golden):
        print(f"   {key}: {golden[key].dtype} {list(golden[key].shape)}")
    for key, value in notes.items():
        print(f"   note {key}: {json.dumps(value)}")
    out_dir = FIXTURES_DIR / name
    print("\n".join(f"   {line}" for line in describe_dir(out_dir)))
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    if size > PART_BUDGET_BYTES[name]:
        print(f"error: {name} is {size} B, over its {PART_BUDGET_BYTES[name]} B budget", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("targets", "drafters"), default="targets",
                        help="targets: tiny-qwen3-next-hc, tiny-qwen3-hc (.venv-hc); drafters: dflash2-next-hc[-raw] (.venv)")
    args = parser.parse_args()
    set_determinism()
    status = run_targets() if args.part == "targets" else run_drafters()
    ours = sum(p.stat().st_size for n in PART_BUDGET_BYTES for p in (FIXTURES_DIR / n).rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in FIXTURES_DIR.rglob("*") if p.is_file())
    print(f"== stream fixtures {ours} B; whole fixtures folder {total} B (budget {FOLDER_BUDGET_BYTES} B)")
    if total > FOLDER_BUDGET_BYTES:
        print("error: the fixtures folder exceeds make_fixtures.py's budget", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
