#!/usr/bin/env python3
"""Golden fixtures for the DFlash v1 and DFlash2 drafters (crates/models/tests/fixtures/dflash-v1, dflash-v2).

Usage (after `bash tools/golden/setup.sh` and `make_fixtures.py --only tiny-qwen3`, whose checkpoint is the target):
    .venv/bin/python tools/golden/dflash_fixtures.py

Two tiny random drafters (hidden 64, 2 layers of which one slides, block 8; DFlash2 adds the two-tap grouped dynamic
convolutions and a top-16, rank-32 candidate selector) are saved in the published checkpoint layout (bf16, selector
codebooks without a `.weight` suffix), loaded back through the reference `dflash` package, and run for three drafting
rounds against the tiny-qwen3 target, all in f32 on one CPU thread:

* round 0: the 12 prompt rows as context, a full block of 8;
* round 1: 3 more context rows (the anchor and two accepted drafts), through the reference's own drafter K/V cache;
* round 2: 1 more context row (nothing accepted) and a shortened block of 5 (the last rounds of a generation).

Each round records the context taps, the projected context, every layer's output (and for DFlash2 the four
convolution outputs), the final hidden rows, the draft logits, and the drafts: greedy, and sampled with fixed
uniforms through an inverse-CDF draw that replaces the reference's multinomial. For DFlash2 also the top-K candidates
(ordered by value descending, then token id ascending), the selector's projected hidden rows, the walk's scores and q.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

for _name, _value in (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("MKL_CBWR", "AUTO")):
    os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import dflash.model as ref  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_common import (  # noqa: E402
    FIXTURES_DIR,
    SEQUENCES,
    describe_dir,
    forward_with_layer_taps,
    reset_dir,
    save_golden,
    set_determinism,
)

TARGET_DIR = FIXTURES_DIR / "tiny-qwen3"
PARTS = ("dflash-v1", "dflash-v2")
# These two folders' share of the fixtures folder (make_fixtures.py checks the 4 MiB budget of the whole folder).
SIZE_BUDGET_BYTES = 512 * 1024
FOLDER_BUDGET_BYTES = 4 * 1024 * 1024
DRAFTER_SEED = {"dflash-v1": 11, "dflash-v2": 12}
UNIFORM_SEED = {"dflash-v1": 21, "dflash-v2": 22}
# (new context rows accepted before the round, verify width) per round; round 0 takes the whole prompt.
ROUNDS = ((None, 8), (3, 8), (1, 5))
# Sampling settings of the sampled drafts: v1 applies the request's filters to the draft, DFlash2 only temperature.
V1_SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
V2_TEMPERATURE = 0.8
# A sampled draw must sit this far from every CDF boundary (and top-p from every cumulative mass), so that f32
# rounding differences between implementations cannot flip it.
MARGIN = 1e-4


def drafter_config(name: str) -> Qwen3Config:
    """The tiny drafter configs. Values the reference reads from `dflash_config` first are also put at the top level
    with different values, so a loader that reads the top level first fails."""
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        # head_dim 8: q is 32 wide, not hidden_size (a loader or forward that assumes H / heads fails).
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        num_target_layers=3,
        block_size=16,
        # transformers keeps `sliding_window` only with use_sliding_window (the MLX reference reads it directly).
        use_sliding_window=True,
    )
    if name == "dflash-v1":
        return Qwen3Config(
            **common,
            architectures=["DFlashDraftModel"],
            rope_theta=1000.0,
            layer_types=["full_attention", "sliding_attention"],
            sliding_window=6,
            dflash_config={"block_size": 8, "target_layer_ids": [1, 0], "mask_token_id": 250},
        )
    return Qwen3Config(
        **common,
        architectures=["DFlash2DraftModel"],
        rope_theta=10000.0,
        # max_position_embeddings / original = factor, so every reading of YaRN's factor agrees.
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=10,
        is_causal=False,
        final_logit_softcapping=30.0,
        dflash_config={
            "block_size": 8,
            "target_layer_ids": [0, 1],
            "mask_token_id": 255,
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 32,
            "selector_top_k": 16,
            "output_multiplier": 1.25,
        },
    )


def randomize_drafter(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights in sorted-name order: norms 1 + N(0, 0.1); matrices N(0, 0.1); codebooks N(0, 0.5) so the
    edge scores move the walk; conv base kernels 1 + N(0, 0.1) on tap 0 and N(0, 0.3) on tap 1 (near the identity
    initialisation, but far enough that a tap error shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("base_kernel"):
                value = 0.3 * noise
                value[:, 0] = 1.0 + 0.1 * noise[:, 0]
            elif param.ndim == 1:
                value = 1.0 + 0.1 * noise
            elif "codebook" in name:
                value = 0.5 * noise
            else:
                value = 0.1 * noise
            param.copy_(value)


def save_checkpoint(model: torch.nn.Module, config: Qwen3Config, out_dir: Path) -> None:
    """config.json plus a bf16 model.safetensors in the published layout (codebooks lose `.weight`)."""
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith("inv_freq"):
            continue
        if key.startswith("candidate_selector.") and key.endswith("_codebook.weight"):
            key = key.removesuffix(".weight")
        state[key] = value.detach().to(torch.bfloat16).contiguous()
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # Only the fields that differ from the defaults (as published drafter configs are written), plus the ones
    # loaders dispatch on.
    payload = config.to_diff_dict()
    payload.update(model_type="qwen3", architectures=config.architectures, dtype="bfloat16")
    payload.pop("transformers_version", None)
    (out_dir / "config.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def load_reference(name: str, out_dir: Path) -> torch.nn.Module:
    """The checkpoint as the reference loads it, in f32, checked against the saved bf16 values."""
    cls = ref.DFlash2DraftModel if name == "dflash-v2" else ref.DFlashDraftModel
    model = cls.from_pretrained(out_dir, dtype=torch.float32)
    model.eval()
    for pname, param in model.named_parameters():
        assert param.dtype == torch.float32, pname
        assert torch.equal(param, param.to(torch.bfloat16).float()), f"{pname} is not bf16-exact"
    assert model.block_size == 8, "block_size must come from dflash_config"
    # The attention pattern the fixture is meant to exercise: v1 full non-causal + sliding causal (window 6 < the
    # 12-row prompt context), DFlash2 sliding non-causal (window 10) + full, both through `is_causal=false`.
    expected = {"dflash-v1": [(False, None), (True, 6)], "dflash-v2": [(False, 10), (False, None)]}[name]
    got = [(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in model.layers]
    assert got == expected, f"attention pattern {got}"
    return model


class FixedUniforms:
    """Replaces the reference's multinomial draw: the i-th draw takes the i-th uniform u and returns the first index
    whose cumulative probability (f64, in index order) exceeds u. Records how close each draw came to a boundary."""

    def __init__(self, uniforms: list[float]):
        self.uniforms = list(uniforms)
        self.used: list[float] = []
        self.min_margin = float("inf")

    def __call__(self, probs: torch.Tensor) -> torch.Tensor:
        rows = probs.reshape(-1, probs.shape[-1]).double()
        picks = []
        for row in rows:
            u = self.uniforms.pop(0)
            self.used.append(u)
            cdf = torch.cumsum(row, 0)
            index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
            if index >= len(row):
                index = int(torch.nonzero(row > 0)[-1])
            self.min_margin = min(self.min_margin, float((cdf - u).abs().min()))
            picks.append(index)
        return torch.tensor(picks, dtype=torch.long).view(probs.shape[:-1])


def stable_topk(original):
    """torch.topk ordered by value descending, then index ascending (the order our selector uses)."""

    def topk(input, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - torch's signature
        assert largest
        values, indices = torch.sort(input, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    topk.original = original
    return topk


@contextlib.contextmanager
def patched(obj, attr: str, value):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


class Recorder:
    """Forward hooks and wrapped conv methods that record a drafter forward's intermediates."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.values: dict[str, torch.Tensor] = {}
        self.handles = []

    def __enter__(self):
        def keep(key):
            def hook(_module, _inputs, output):
                out = output[0] if isinstance(output, tuple) else output
                self.values[key] = out.detach()[0].clone()

            return hook

        self.handles.append(self.model.hidden_norm.register_forward_hook(keep("context")))
        for i, layer in enumerate(self.model.layers):
            self.handles.append(layer.register_forward_hook(keep(f"layer{i}.out")))
            for conv_name in ("attention_conv", "mlp_conv"):
                conv = getattr(layer, conv_name)
                if conv is not None:
                    self._wrap_conv(conv, f"layer{i}.{conv_name.split('_')[0]}")
        return self

    def _wrap_conv(self, conv, key: str) -> None:
        prepare, finish = conv.prepare, conv.finish

        def wrapped_prepare(hidden):
            out, dynamic = prepare(hidden)
            self.values[f"{key}_prepare"] = out.detach()[0].clone()
            return out, dynamic

        def wrapped_finish(hidden, dynamic):
            out = finish(hidden, dynamic)
            self.values[f"{key}_finish"] = out.detach()[0].clone()
            return out

        conv.prepare, conv.finish = wrapped_prepare, wrapped_finish
        self.handles.append(("conv", conv))

    def __exit__(self, *exc):
        for handle in self.handles:
            if isinstance(handle, tuple):
                del handle[1].prepare, handle[1].finish
            else:
                handle.remove()
        return False


def target_taps(target, tokens: list[int], layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], concatenated taps [T, n·H]) of one batch-1 target forward; the taps are the layer-output hooks,
    checked against the reference's own `extract_context_feature` over `output_hidden_states`."""
    logits, layer_outputs, hf_hidden = forward_with_layer_taps(target, tokens)
    taps = torch.cat([layer_outputs[i] for i in layer_ids], dim=-1)
    reference = ref.extract_context_feature(hf_hidden, layer_ids)[0]
    torch.testing.assert_close(reference, taps, rtol=0, atol=0)
    return logits, taps


def top2_gap(values: torch.Tensor) -> float:
    top = torch.topk(values.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def draft_round(name, model, target, cache, sequence, ctx_rows, width, uniforms, notes) -> dict[str, np.ndarray]:
    """One drafting round at start = len(sequence) - 1 (the last token is the anchor); returns its golden tensors."""
    start = len(sequence) - 1
    anchor = sequence[-1]
    _, taps = target_taps(target, sequence[:start], model.target_layer_ids)
    ctx = taps[start - ctx_rows:start]
    block = torch.tensor([[anchor] + [model.mask_token_id] * (width - 1)], dtype=torch.long)
    scale = float(ref._draft_value(model.config, "input_embedding_scale", 1.0))
    noise = ref._raw_input_embeddings(target, block, scale)
    positions = torch.arange(start - ctx_rows, start + width).unsqueeze(0)
    with Recorder(model) as rec, torch.no_grad():
        hidden = model(
            target_hidden=ctx.unsqueeze(0),
            noise_embedding=noise,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
    cache.crop(start)
    out = {f"{k}": v.numpy() for k, v in rec.values.items()}
    out.update(
        start=np.array([start], dtype=np.int32),
        block_tokens=block[0].numpy().astype(np.int32),
        ctx_taps=ctx.numpy(),
        hidden=hidden[0].numpy(),
    )
    head = ref._output_head(target)
    drafted = hidden[:, 1:]
    with torch.no_grad():
        logits = model.compute_logits(drafted, head)
    out["logits"] = logits[0].numpy()
    if name == "dflash-v1":
        out.update(v1_drafts(logits, uniforms, notes))
    else:
        out.update(v2_drafts(model, drafted, logits, anchor, head, uniforms, notes))
    return out


def v1_drafts(logits, uniforms, notes) -> dict[str, np.ndarray]:
    greedy = torch.argmax(logits, dim=-1)[0]
    notes["greedy_min_top2_gap"] = min(notes.get("greedy_min_top2_gap", 1e9), top2_gap(logits[0]))
    draw = FixedUniforms(uniforms)
    topk = stable_topk(torch.topk)
    with patched(torch, "topk", topk), patched(ref, "_sample_probs", draw):
        probs = ref._sampling_probs(logits, **V1_SAMPLING)
        sampled = ref._sample_probs(probs)[0]
    check_top_p_margin(logits[0])
    notes["sample_min_cdf_margin"] = min(notes.get("sample_min_cdf_margin", 1.0), draw.min_margin)
    assert draw.min_margin > MARGIN, f"a uniform sits {draw.min_margin} from a CDF boundary"
    return {
        "greedy": greedy.numpy().astype(np.int32),
        "uniforms": np.array(draw.used, dtype=np.float32),
        "sampled": sampled.numpy().astype(np.int32),
        "sampled_q": probs[0].numpy(),
    }


def check_top_p_margin(logits: torch.Tensor) -> None:
    """The top-p cut compares the mass before each sorted token with top_p: keep it away from equality."""
    scores = logits.float() / V1_SAMPLING["temperature"]
    values = torch.sort(scores, dim=-1, descending=True, stable=True).values[..., : V1_SAMPLING["top_k"]]
    probs = torch.softmax(values, dim=-1)
    before = probs.cumsum(-1) - probs
    margin = float((before - V1_SAMPLING["top_p"]).abs().min())
    assert margin > MARGIN, f"a top-p boundary is {margin} from a cumulative mass"


def v2_drafts(model, drafted, logits, anchor, head, uniforms, notes) -> dict[str, np.ndarray]:
    selector = model.candidate_selector
    anchor_ids = torch.tensor([anchor], dtype=torch.long)
    out: dict[str, np.ndarray] = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", V2_TEMPERATURE)):
        edges: list[torch.Tensor] = []
        einsum = torch.einsum

        def recording_einsum(*args, **kwargs):
            result = einsum(*args, **kwargs)
            edges.append(result.detach().clone())
            return result

        projected = {}
        handle = selector.hidden_projection.register_forward_hook(
            lambda _m, _i, o: projected.__setitem__("value", o.detach()[0].clone())
        )
        draw = FixedUniforms(uniforms)
        try:
            with patched(torch, "topk", stable_topk(torch.topk)), patched(torch, "einsum", recording_einsum), patched(
                ref, "_sample_probs", draw
            ), torch.no_grad():
                path, candidates, q = model.propose(drafted, anchor_ids, head, temperature)
        finally:
            handle.remove()
        unary = torch.sort(logits, dim=-1, descending=True, stable=True).values[..., : selector.top_k]
        scores = unary[0] + torch.cat(edges, dim=0)
        out[mode] = path[0].numpy().astype(np.int32)
        out[f"{mode}_scores"] = scores.numpy()
        if mode == "greedy":
            out["topk_ids"] = candidates[0].numpy().astype(np.int32)
            out["topk_values"] = unary[0].numpy()
            out["projected"] = projected["value"].numpy()
            notes["walk_min_top2_gap"] = min(notes.get("walk_min_top2_gap", 1e9), top2_gap(scores))
            gap_at_k = float((unary[0, :, -1] - torch.sort(logits[0], -1, True).values[:, selector.top_k]).min())
            assert gap_at_k > MARGIN, f"the K-th and (K+1)-th logits are {gap_at_k} apart"
            notes["topk_min_gap_at_k"] = min(notes.get("topk_min_gap_at_k", 1e9), gap_at_k)
        else:
            out["uniforms"] = np.array(draw.used, dtype=np.float32)
            out["sampled_q"] = q[0].numpy()
            notes["sample_min_cdf_margin"] = min(notes.get("sample_min_cdf_margin", 1.0), draw.min_margin)
            assert draw.min_margin > MARGIN, f"a uniform sits {draw.min_margin} from a CDF boundary"
    return out


def build_drafter(name: str, target) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    out_dir = reset_dir(FIXTURES_DIR / name)
    config = drafter_config(name)
    cls = ref.DFlash2DraftModel if name == "dflash-v2" else ref.DFlashDraftModel
    fresh = cls(config)
    randomize_drafter(fresh, DRAFTER_SEED[name])
    save_checkpoint(fresh, config, out_dir)
    model = load_reference(name, out_dir)

    rng = np.random.default_rng(UNIFORM_SEED[name])
    notes: dict[str, object] = {}
    tensors: dict[str, np.ndarray] = {}
    sequence = list(SEQUENCES[0])
    logits, _ = target_taps(target, sequence, model.target_layer_ids)
    sequence.append(int(torch.argmax(logits[-1])))
    cache = DynamicCache()
    for index, (accepted, width) in enumerate(ROUNDS):
        if accepted is not None:
            # The previous round's anchor and `accepted - 1` of its greedy drafts were committed; the target's
            # prediction after them is the new anchor (the bonus token).
            previous = tensors[f"r{index - 1}.greedy"].tolist()
            sequence.extend(previous[: accepted - 1])
            logits, _ = target_taps(target, sequence, model.target_layer_ids)
            sequence.append(int(torch.argmax(logits[-1])))
        ctx_rows = len(sequence) - 1 - (0 if index == 0 else int(tensors[f"r{index - 1}.start"][0]))
        uniforms = rng.uniform(size=width - 1).tolist()
        golden = draft_round(name, model, target, cache, sequence, ctx_rows, width, uniforms, notes)
        tensors.update({f"r{index}.{k}": v for k, v in golden.items()})
    tensors["sequence"] = np.array(sequence, dtype=np.int32)
    description = {
        "drafter": name,
        "target": "tiny-qwen3",
        "compute": "f32 on bf16-rounded weights",
        "rounds": [{"new_context_rows": a, "width": w} for a, w in ROUNDS],
        "v1_sampling": V1_SAMPLING,
        "v2_temperature": V2_TEMPERATURE,
        "draw": "inverse CDF: first index whose f64 cumulative probability exceeds the uniform",
    }
    save_golden(out_dir / "golden.safetensors", tensors, description)
    return tensors, notes


def main() -> int:
    set_determinism()
    if not (TARGET_DIR / "model.safetensors").exists():
        print(f"error: {TARGET_DIR} is missing; run make_fixtures.py --only tiny-qwen3 first", file=sys.stderr)
        return 1
    target = Qwen3ForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32, attn_implementation="eager")
    target.eval()
    for name in PARTS:
        tensors, notes = build_drafter(name, target)
        print(f"== {name}")
        for key in sorted(tensors):
            print(f"   {key}: {tensors[key].dtype} {list(tensors[key].shape)}")
        for key, value in notes.items():
            print(f"   note {key}: {json.dumps(value)}")
        print("\n".join(f"   {line}" for line in describe_dir(FIXTURES_DIR / name)))
    ours = sum(p.stat().st_size for part in PARTS for p in (FIXTURES_DIR / part).rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in FIXTURES_DIR.rglob("*") if p.is_file())
    print(f"== drafter fixtures {ours} B (budget {SIZE_BUDGET_BYTES} B); whole fixtures folder {total} B")
    if total > FOLDER_BUDGET_BYTES:
        print(f"warning: the fixtures folder exceeds make_fixtures.py's {FOLDER_BUDGET_BYTES} B budget", file=sys.stderr)
    if ours > SIZE_BUDGET_BYTES:
        print("error: the drafter fixtures exceed their size budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
