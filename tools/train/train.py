#!/usr/bin/env python3
"""Trains the DFlash2 drafter and the MTP head for SmolLM2-135M-Instruct on the regenerated samples.

One loop trains both: every step runs the frozen target over a batch of sequences (teacher forcing, no grad) to
get the tap-layer outputs and the final-normed hidden states, then
  * DFlash2: up to --anchors-per-seq random anchors per sequence (response positions), packed blocks, the decayed
    per-slot cross-entropy (gamma 4 for block 8) plus the candidate selector's loss, ramped in after warm-up;
  * MTP: the chained loss over depths 1..D (weights --mtp-weights) with the head's exact cache structure.
bf16 autocast on GPU, AdamW, warm-up then cosine; the schedule follows wall-clock progress through
--time-budget-s (or --max-steps), so the run ends on time whatever the GPU's speed. A held-out split (by prompt)
gives per-slot accuracies and the exact greedy acceptance per round of both drafters (train_eval.py).

    python tools/train/train.py --data OUT/samples.npz --out OUT/ckpt --time-budget-s 300     # GPU
    python tools/train/train.py --smoke --data /tmp/smoke/samples.npz --out /tmp/smoke/ckpt   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

import drafter as dfl
import mtp as mtp_mod
from target import DEFAULT_GGUF, configure_torch, load_target
from train_data import device_batch, load_samples, make_batches, split_by_prompt
from train_eval import evaluate

MASK_TOKEN = "<empty_output>"  # a control token that chat never produces; its embedding row fills masked slots


def log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="samples .npz from generate.py")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    p.add_argument("--out", type=Path, required=True, help="directory for train_state.pt and metrics.json")
    p.add_argument("--layers", type=int, default=2, help="drafter layers (taps follow the default rule)")
    p.add_argument("--intermediate", type=int, default=1024, help="drafter MLP width")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--conv-kernel", type=int, default=2)
    p.add_argument("--conv-group", type=int, default=16)
    p.add_argument("--selector-rank", type=int, default=32)
    p.add_argument("--selector-top-k", type=int, default=16)
    p.add_argument("--selector-alpha", type=float, default=0.5, help="selector loss weight after its ramp")
    p.add_argument("--loss-gamma", type=float, default=4.0, help="slot weight exp(-(k-1)/gamma)")
    p.add_argument("--mtp-weights", default="1.0,0.5", help="MTP loss weight per chained depth")
    p.add_argument("--mtp-loss-weight", type=float, default=1.0)
    p.add_argument("--no-mtp", action="store_true")
    p.add_argument("--anchors-per-seq", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=16384, help="padded sequence tokens per step")
    p.add_argument("--batch-anchors", type=int, default=4096, help="anchored blocks per step")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=float, default=0.04, help="fraction of the run")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--time-budget-s", type=float, default=float("inf"), help="whole script, loading included")
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--max-epochs", type=int, default=100)
    p.add_argument("--eval-frac", type=float, default=0.03)
    p.add_argument("--eval-max", type=int, default=192, help="held-out samples evaluated at most")
    p.add_argument("--eval-reserve-s", type=float, default=45.0, help="budget kept for the final evaluation")
    p.add_argument("--eval-on-train", action="store_true", help="diagnostic: evaluate on training samples")
    p.add_argument("--eval-every-s", type=float, default=90.0, help="quick held-out evaluation this often")
    p.add_argument("--eval-quick", type=int, default=32, help="held-out samples in a quick evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny drafter, a few steps, CPU")
    args = p.parse_args()
    if args.smoke:
        args.device, args.layers, args.intermediate = "cpu", 1, 64
        args.selector_rank, args.selector_top_k, args.anchors_per_seq = 8, 4, 8
        args.batch_tokens, args.batch_anchors, args.max_steps = 512, 32, 3
        args.eval_max, args.eval_reserve_s, args.eval_every_s = 2, 0.0, 0.0
    return args


def eval_options(args, draft_cfg: dict, pad_id: int, smoke: bool) -> dict:
    d = draft_cfg["dflash_config"]
    return {
        "block_size": d["block_size"],
        "target_layer_ids": d["target_layer_ids"],
        "mask_token_id": d["mask_token_id"],
        "selector_top_k": d["selector_top_k"],
        "loss_gamma": args.loss_gamma,
        "mtp_weights": [float(w) for w in args.mtp_weights.split(",")],
        "pad_id": pad_id,
        "eval_batch": 2 if smoke else 8,
        "eval_anchor_chunk": 16 if smoke else 128,
    }


def make_optimizer(modules, args, device):
    decay, plain = [], []
    for module in modules:
        for p in module.parameters():
            (decay if p.dim() >= 2 else plain).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def selector_weight(progress: float, alpha: float) -> float:
    """0 until 10% of the run, then a linear ramp to alpha at 30% (the backbone's logits settle first)."""
    return alpha * min(1.0, max(0.0, (progress - 0.1) / 0.2))


def train_step(batch, target, drafter, head, opts, args, progress, generator, autocast):
    """One optimisation step's forward; returns (loss, stats)."""
    final, taps = target.capture(batch["ids"], opts["target_layer_ids"])
    anchors = dfl.sample_anchors(batch["loss_mask"], batch["lengths"], args.anchors_per_seq, generator)
    block_ids, block_pos, labels = dfl.block_layout(batch["ids"], batch["lengths"], anchors, opts["block_size"],
                                                    opts["mask_token_id"])
    mask = dfl.attention_mask(anchors, batch["lengths"], batch["ids"].shape[1], opts["block_size"])
    embed = target.embed_tokens.weight
    with autocast:
        hidden = dfl.packed_forward(drafter, torch.cat(taps, -1), target.embed_tokens(block_ids), block_pos, mask,
                                    opts["block_size"])
        d = dfl.drafter_losses(drafter, hidden, labels, block_ids, embed, args.loss_gamma, opts["selector_top_k"])
        loss = d["token_loss"] + selector_weight(progress, args.selector_alpha) * d["selector_loss"]
        stats = {"dflash": d["token_loss"].item(), "selector": d["selector_loss"].item(),
                 "acc1": d["unary_correct"][d["slot"] == 1].float().mean().item(),
                 "acc_all": d["unary_correct"].float().mean().item(), "rows": int(d["slot"].numel())}
        if head is not None:
            m = mtp_mod.mtp_losses(head, embed, batch["ids"], final, batch["loss_mask"], batch["lengths"],
                                   opts["mtp_weights"])
            loss = loss + args.mtp_loss_weight * m["loss"]
            hit, valid = m["correct"][0]
            stats.update(mtp=m["loss"].item(), mtp_acc1=hit[valid].float().mean().item())
    return loss, stats


def setup(args, device):
    """Samples, target, fresh drafter and MTP head, evaluation options and the train / eval split."""
    samples = load_samples(args.data)
    cfg, target, tokenizer = load_target(args.gguf, device)
    mask_id = tokenizer.token_to_id(MASK_TOKEN)
    draft_cfg = dfl.draft_config(cfg, layers=args.layers, intermediate_size=args.intermediate,
                                 block_size=args.block_size, mask_token_id=mask_id,
                                 conv_kernel_size=args.conv_kernel, conv_group_size=args.conv_group,
                                 selector_rank=args.selector_rank, selector_top_k=args.selector_top_k)
    drafter = dfl.make_drafter(draft_cfg, args.seed).to(device)
    head = None
    if not args.no_mtp:
        head = mtp_mod.MtpHead(cfg).to(device)
        mtp_mod.init_from_target(head, target, args.seed)
    opts = eval_options(args, draft_cfg, cfg.eos_id, args.smoke)
    train_idx, eval_idx = split_by_prompt(samples, args.eval_frac, min_eval=2 if args.smoke else 16)
    if args.eval_on_train:
        train_idx, eval_idx = train_idx + eval_idx, train_idx + eval_idx
    eval_idx = sorted(eval_idx, key=lambda i: (samples.temperature[i] != 0, i))[: args.eval_max]
    return samples, cfg, target, draft_cfg, drafter, head, opts, train_idx, eval_idx


def quick_eval_line(metrics: dict) -> str:
    walk, mtp = metrics["dflash_greedy_walk"], metrics["mtp_greedy"] or {}
    return (f"held-out: dflash2 {walk.get('tokens_per_round')} tokens/round, slot accuracy "
            f"{metrics['dflash_slot_accuracy_walk']}; mtp {mtp.get('tokens_per_round')} tokens/round, depth accuracy "
            f"{metrics['mtp_depth_accuracy']}")


def train_loop(args, samples, train_idx, eval_idx, target, drafter, head, opts, pad_id, device, loop_budget):
    """Steps until the budget (or --max-steps / --max-epochs) is used; returns (steps, epochs, log history)."""
    modules = [drafter] + ([head] if head is not None else [])
    params = [p for m in modules for p in m.parameters()]
    optimizer = make_optimizer(modules, args, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    rng = random.Random(args.seed)
    history, step, epoch, start, last_log, progress = [], 0, 0, time.time(), 0.0, 0.0
    last_eval = start
    while progress < 1.0 and epoch < args.max_epochs:
        for batch_idx in make_batches(samples, train_idx, args.batch_tokens, args.batch_anchors,
                                      args.anchors_per_seq, rng):
            progress = max((time.time() - start) / loop_budget if math.isfinite(loop_budget) else 0.0,
                           step / args.max_steps if args.max_steps else 0.0)
            if progress >= 1.0:
                break
            lr = dfl.cosine_lr(progress, args.lr, args.warmup, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = device_batch(samples, batch_idx, pad_id, device)
            loss, stats = train_step(batch, target, drafter, head, opts, args, progress, generator, autocast)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if time.time() - last_log > (0 if args.smoke else 15) or step == 1:
                last_log = time.time()
                stats.update(step=step, epoch=epoch, progress=round(progress, 3), lr=lr,
                             grad_norm=float(grad_norm), seconds=round(time.time() - start, 1))
                history.append(stats)
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
            if time.time() - last_eval > args.eval_every_s:
                last_eval = time.time()
                log(quick_eval_line(evaluate(target, drafter, head, samples, eval_idx[: args.eval_quick], opts,
                                             device)))
        epoch += 1
    return step, epoch, history


def run(args) -> dict:
    started = time.time()
    device = torch.device(args.device)
    configure_torch(device, args.smoke)
    torch.manual_seed(args.seed)
    samples, cfg, target, draft_cfg, drafter, head, opts, train_idx, eval_idx = setup(args, device)
    log(f"{len(samples)} samples: {len(train_idx)} train, {len(eval_idx)} eval; drafter "
        f"{dfl.param_count(drafter) / 1e6:.2f} M params, taps {opts['target_layer_ids']}, mask token "
        f"{opts['mask_token_id']}; MTP {0 if head is None else dfl.param_count(head) / 1e6:.2f} M params; "
        f"setup {time.time() - started:.1f} s")
    loop_start = time.time()
    loop_budget = args.time_budget_s - (loop_start - started) - args.eval_reserve_s
    steps, epochs, history = train_loop(args, samples, train_idx, eval_idx, target, drafter, head, opts, cfg.eos_id,
                                        device, loop_budget)
    log(f"trained {steps} steps, {epochs} epochs in {time.time() - loop_start:.0f} s; evaluating")
    metrics = evaluate(target, drafter, head, samples, eval_idx, opts, device)
    metrics.update(steps=steps, epochs=epochs, train_seconds=round(time.time() - loop_start, 1))
    log("eval " + json.dumps(metrics))
    save(args, draft_cfg, drafter, head, cfg, metrics, history, samples.info)
    log(f"done in {time.time() - started:.0f} s")
    return metrics


def save(args, draft_cfg, drafter, head, cfg, metrics, history, data_info) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    state = {
        "drafter_config": draft_cfg,
        "drafter_state": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
        "mtp_state": None if head is None else {k: v.detach().cpu() for k, v in head.state_dict().items()},
        "mtp_depth_weights": [float(w) for w in args.mtp_weights.split(",")],
        "target": {"gguf": args.gguf.name, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size},
        "target_config": cfg.__dict__,
        "metrics": metrics,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "data": {k: data_info.get(k) for k in ("samples", "prompts_sha256_jsonl", "gguf_sha256", "temperatures",
                                                "max_new_tokens", "response_tokens", "groups")},
    }
    torch.save(state, args.out / "train_state.pt")
    report = {"metrics": metrics, "history": history, "args": state["args"], "data": state["data"]}
    (args.out / "metrics.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    run(parse_args())


if __name__ == "__main__":
    main()
