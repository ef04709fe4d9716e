"""Checks an export against the reference `dflash` package and measures greedy acceptance.

1. The drafter folder loads with `dflash.model.DFlash2DraftModel.from_pretrained` (the published loader, which
   remaps the codebook names), and every loaded tensor equals the exported one.
2. The training forward (drafter.packed_forward, several blocks in one pass) gives the same hidden states as the
   reference forward run once per block.
3. The reference decode loop (`dflash_generate`, greedy) drafts with the target on the held-out prompts; its
   output must equal plain greedy decoding, and its acceptance per round is recorded. One seeded T=0.7 run
   exercises the sampled path (selector walk + rejection sampling).
4. The MTP folder loads back into the training module, tensors equal; the greedy acceptance of both drafters is
   also computed by teacher forcing over the greedy continuation (train_eval); for the drafter it must agree
   with (3) within 10 % (it walks the same rounds; only near-tie argmaxes can differ).

Two shims adapt the reference to transformers 4.x (it targets 5.x): `DynamicCache.activate_past_recording`
(absent in 4.x) becomes a no-op, and its cache crop skips a zero-length crop, which 4.x would read as "crop to
length 0". Without CUDA, its timer uses perf_counter instead of synchronising the GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import distill
import drafter as dfl
import mtp as mtp_mod
from target import REPO_ROOT, LlamaTarget, build_tokenizer, read_gguf, render_chat, to_hf_llama
from train_data import Samples
from train_eval import evaluate

PARITY_TOLERANCE = 2e-4
AGREEMENT_TOLERANCE = 0.1


def log(msg: str) -> None:
    print(f"[check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def install_reference_shims() -> None:
    import dflash.model as ref
    from transformers.cache_utils import DynamicCache

    if not hasattr(DynamicCache, "activate_past_recording"):
        DynamicCache.activate_past_recording = lambda self: None

        def crop_to(cache, length):
            if cache.get_seq_length() > length:
                cache.crop(length)

        ref._crop_to = crop_to
    if not torch.cuda.is_available():
        ref._cuda_time = time.perf_counter


def load_reference_drafter(folder: Path, device):
    from dflash.model import DFlash2DraftModel

    try:
        model = DFlash2DraftModel.from_pretrained(str(folder), dtype=torch.float32)
    except TypeError:
        model = DFlash2DraftModel.from_pretrained(str(folder), torch_dtype=torch.float32)
    return model.to(device).eval()


def tensor_mismatches(model, folder: Path, prefix: str = "") -> list[str]:
    exported = load_file(str(folder / "model.safetensors"))
    own = model.state_dict()
    problems = []
    for name, value in exported.items():
        key = name.removeprefix(prefix)
        key = key if key in own else key + ".weight"
        if key not in own:
            problems.append(f"{name}: not in the loaded model")
        elif not torch.equal(own[key].float().cpu(), value.float()):
            problems.append(f"{name}: differs after loading")
    problems += [f"{k}: missing from the file" for k in own if not any(
        k in (n.removeprefix(prefix), n.removeprefix(prefix) + ".weight") for n in exported)]
    return problems


def forward_parity(model, target: LlamaTarget, seq: list[int], prompt_len: int) -> float:
    """Max abs difference between packed blocks (ours) and per-block reference forwards."""
    cfg = model.config.dflash_config
    block, taps_ids = int(cfg["block_size"]), list(cfg["target_layer_ids"])
    device = target.embed_tokens.weight.device
    ids = torch.tensor([seq], device=device)
    _, taps = target.capture(ids, taps_ids)
    taps = torch.cat(taps, -1)
    anchors = [a for a in (prompt_len, prompt_len + 1, prompt_len + 5) if a < len(seq) - 1]
    anchor_t = torch.tensor([anchors], device=device)
    lengths = torch.tensor([len(seq)], device=device)
    layout = dfl.block_layout(ids, lengths, anchor_t, block, int(cfg["mask_token_id"]))
    block_ids = layout.ids
    mask = dfl.attention_mask(anchor_t, lengths, len(seq), block)
    with torch.no_grad():
        ours = dfl.packed_forward(model, taps, target.embed_tokens(block_ids), layout.pos, mask, block)
        worst = 0.0
        for i, a in enumerate(anchors):
            rows = slice(i * block, (i + 1) * block)
            ref = model(position_ids=torch.arange(a + block, device=device)[None],
                        noise_embedding=target.embed_tokens(block_ids[:, rows]), target_hidden=taps[:, :a])
            worst = max(worst, float((ours[:, rows] - ref).abs().max()))
    return worst


def greedy_gap(target: LlamaTarget, seq: list[int], index: int) -> float:
    """Top-1 minus top-2 target logit where token `index` of seq was chosen (how close the tie was)."""
    with torch.no_grad():
        final, _ = target.capture(torch.tensor([seq[:index]], device=target.embed_tokens.weight.device), [])
        top = target.logits(final[0, -1]).topk(2).values
    return float(top[0] - top[1])


def run_prompt(model, hf_target, target, prompt_ids, max_new, eos, temperature=0.0, seed=0) -> dict:
    from dflash.model import dflash_generate

    device = target.embed_tokens.weight.device
    torch.manual_seed(seed)
    stats = dflash_generate(model, hf_target, torch.tensor([prompt_ids], device=device), max_new, [eos],
                            temperature=temperature, return_stats=True)
    drafted = stats.output_ids[0, len(prompt_ids):].tolist()
    return {"tokens": drafted, "acceptance_lengths": [int(a) for a in stats.acceptance_lengths]}


def run(export_dir: Path, gguf: Path, prompts_path: Path | None, max_new: int, device, smoke: bool) -> dict:
    install_reference_shims()
    started = time.time()
    if smoke:
        torch.set_num_threads(1)
        max_new = min(max_new, 12)
    cfg, state, meta = read_gguf(gguf)
    tokenizer = build_tokenizer(meta)
    target = LlamaTarget.from_state(cfg, state).to(device)
    hf_target = to_hf_llama(cfg, state).to(device)
    model = load_reference_drafter(export_dir / "drafter", device)
    failures = tensor_mismatches(model, export_dir / "drafter")
    log(f"reference loader: {len(failures)} tensor mismatches")
    prompts = json.loads((prompts_path or REPO_ROOT / "bench" / "prompts" / "heldout-small.json").read_text())
    if smoke:
        prompts = sorted(prompts, key=lambda e: len(e["prompt"]))[:2]
    results, sequences = [], []
    for entry in prompts:
        prompt_ids = tokenizer.encode(render_chat(cfg.chat_template, entry["prompt"]), add_special_tokens=False).ids
        plain = target.generate([prompt_ids], max_new, 0.0)[0]
        drafted = run_prompt(model, hf_target, target, prompt_ids, max_new, cfg.eos_id)
        same = drafted["tokens"] == plain
        result = {"group": entry["group"], "prompt_tokens": len(prompt_ids), "new_tokens": len(plain),
                  "lossless": same, "acceptance_lengths": drafted["acceptance_lengths"],
                  "tokens_per_round": round(float(np.mean(drafted["acceptance_lengths"])), 3)}
        if not same:
            first = next((i for i, (a, b) in enumerate(zip(drafted["tokens"], plain, strict=False)) if a != b),
                         min(len(plain), len(drafted["tokens"])))
            result["first_difference"] = first
            result["greedy_gap_there"] = greedy_gap(target, prompt_ids + plain, len(prompt_ids) + first)
            if result["greedy_gap_there"] > 1e-3:
                failures.append(f"{entry['group']}: drafted output differs from plain greedy at token {first}")
        results.append(result)
        sequences.append((prompt_ids, plain))
        log(f"{entry['group']}: {len(prompt_ids)} prompt tokens, {len(plain)} new, lossless {same}, "
            f"{result['tokens_per_round']} tokens/round")
    parity = forward_parity(model, target, sequences[0][0] + sequences[0][1], len(sequences[0][0]))
    if parity > PARITY_TOLERANCE:
        failures.append(f"training forward differs from the reference forward by {parity:.3g}")
    sampled = run_prompt(model, hf_target, target, sequences[0][0], max_new, cfg.eos_id, temperature=0.7, seed=1)
    if not sampled["tokens"]:
        failures.append("sampled drafting produced no tokens")
    head = load_mtp(export_dir / "mtp", cfg, device)
    depth = 1
    if head is not None:
        failures += tensor_mismatches(head, export_dir / "mtp", prefix="mtp.")
        mtp_cfg = json.loads((export_dir / "mtp" / "config.json").read_text(encoding="utf-8"))
        depth = int(mtp_cfg["mtp_config"]["trained_depths"])
    teacher = teacher_forced(model, head, target, sequences, cfg, device, depth)
    reference_tpr = float(np.mean([a for r in results for a in r["acceptance_lengths"]]))
    teacher_tpr = teacher["dflash_greedy_walk"].get("tokens_per_round", 1.0)
    # Both walk the same greedy rounds; only near-tie argmaxes (bf16 weights, batched verify) may differ.
    if abs(reference_tpr - teacher_tpr) > AGREEMENT_TOLERANCE * reference_tpr:
        failures.append(f"reference loop {reference_tpr:.3f} tokens/round vs teacher-forced {teacher_tpr:.3f}")
    log(f"reference loop {reference_tpr:.3f} tokens/round; teacher-forced walk {teacher_tpr}; "
        f"MTP {teacher.get('mtp_greedy')}; "
        f"parity {parity:.2e}; {len(failures)} failures; {time.time() - started:.0f} s")
    return {
        "prompts": results,
        "reference_tokens_per_round": round(reference_tpr, 4),
        "teacher_forced": teacher,
        "forward_parity_max_abs": parity,
        "sampled_t07": {"new_tokens": len(sampled["tokens"]), "acceptance_lengths": sampled["acceptance_lengths"]},
        "failures": failures,
        "device": str(device),
    }


def load_mtp(folder: Path, cfg, device):
    if not (folder / "model.safetensors").exists():
        return None
    head = mtp_mod.MtpHead(cfg)
    weights = {k.removeprefix("mtp."): v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    head.load_state_dict(weights)
    return head.to(device).eval()


def teacher_forced(model, head, target, sequences, cfg, device, depth: int) -> dict:
    """train_eval's exact greedy acceptance over the plain greedy continuations."""
    kept = [(p, c) for p, c in sequences if len(c) > 1]
    seqs = [np.array(p + c, dtype=np.int64) for p, c in kept]
    prompt_len = np.array([len(p) for p, _ in kept])
    samples = Samples(seqs, prompt_len, prompt_len.copy(), np.zeros(len(seqs), dtype=np.int64), {})
    d = model.config.dflash_config
    opts = {"block_size": int(d["block_size"]), "target_layer_ids": list(d["target_layer_ids"]),
            "mask_token_id": int(d["mask_token_id"]), "selector_top_k": int(d["selector_top_k"]), "loss_gamma": 4.0,
            "mtp_weights": [1.0] * depth, "pad_id": cfg.eos_id, "eval_batch": 1, "eval_anchor_chunk": 64,
            "loss": distill.LossConfig(mode="ce")}
    return evaluate(target, model, head, samples, list(range(len(seqs))), opts, device)
