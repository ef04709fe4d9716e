"""Held-out evaluation: per-slot accuracy and the exact greedy acceptance of both drafters.

For a greedy sample, the response *is* the target's greedy continuation, so a teacher-forced pass gives, for
every possible round start n (the last committed token x_n), exactly what the drafter would propose in that
round at inference: DFlash anchors its block at n with context rows < n; the MTP chain starts at entry n-1
(target hidden at n-1, token x_n). The leading-correct count is that round's greedy acceptance, and walking the
rounds (n -> n + accepted + 1) from the first response token reproduces the decode loop's acceptance per round.

The walks run twice: over whole responses, and over their first `first_tokens` (128) tokens, which is what the
engine's `bench lanes --max-tokens 128` decodes. The two differ a lot: a long greedy response of this target often
ends in a repetition loop, which any drafter predicts, so whole responses overstate acceptance in chat use.
"""

from __future__ import annotations

import numpy as np
import torch

import distill
import drafter as dfl
import mtp as mtp_mod
from train_data import Samples, device_batch


def simulate_rounds(accept: np.ndarray, start: int, end: int, cap: int) -> list[tuple[int, int]]:
    """(accepted drafts, tokens committed) per round of a greedy decode from committed token `start` to the end.

    A round commits its accepted drafts and the bonus token; near the end it drafts only what is left to decode
    (the engine's draft cap), so nothing past the sequence end is counted.
    """
    n, rounds = start, []
    while n < end - 1:
        # The engine drafts no further than the tokens left to decode, the last of them being the round's bonus.
        a = min(int(accept[n]), cap, end - 2 - n)
        rounds.append((a, a + 1))
        n += a + 1
    return rounds


def summarise_rounds(rounds: list[tuple[int, int]], cap: int) -> dict:
    if not rounds:
        return {"rounds": 0}
    accepted = np.array([a for a, _ in rounds])
    committed = np.array([c for _, c in rounds])
    return {
        "rounds": len(rounds),
        "tokens_per_round": round(float(committed.mean()), 4),
        "per_position": [round(float((accepted >= k).mean()), 4) for k in range(1, cap + 1)],
    }


class SlotCounter:
    def __init__(self, slots: int):
        self.hits = np.zeros(slots)
        self.total = np.zeros(slots)

    def add(self, slot: torch.Tensor, correct: torch.Tensor) -> None:
        n = len(self.total)
        self.total += torch.bincount(slot, minlength=n).cpu().numpy()[:n]
        self.hits += torch.bincount(slot[correct], minlength=n).cpu().numpy()[:n]

    def rates(self, first: int = 0) -> list[float]:
        pairs = zip(self.hits[first:], self.total[first:], strict=True)
        return [round(float(h / t), 4) if t else 0.0 for h, t in pairs]


@torch.no_grad()
def evaluate(target, drafter, head, samples: Samples, indices: list[int], opts: dict, device) -> dict:
    """Metrics on held-out samples (pure greedy samples give the acceptance figures; all give accuracies).

    opts: block_size, target_layer_ids, mask_token_id, selector_top_k, loss_gamma, mtp_weights, pad_id,
    eval_batch, eval_anchor_chunk, and optionally loss (distill.LossConfig; the KD loss is then reported too).
    """
    drafter.eval()
    if head is not None:
        head.eval()
    block, depth = opts["block_size"], len(opts["mtp_weights"])
    loss_cfg = opts.get("loss") or distill.LossConfig(mode="ce")
    unary, walk, depth_acc = SlotCounter(block), SlotCounter(block), SlotCounter(depth + 1)
    rounds = {"dflash_walk": [], "dflash_unary": [], "mtp": [], "dflash_walk_first": [], "mtp_first": []}
    first_tokens = opts.get("first_tokens", 128)
    losses: dict[str, list[float]] = {"dflash": [], "mtp": []}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for start in range(0, len(indices), opts["eval_batch"]):
        chunk = indices[start: start + opts["eval_batch"]]
        batch = device_batch(samples, chunk, opts["pad_id"], device)
        final, taps = target.capture(batch["ids"], opts["target_layer_ids"])
        teacher = None
        if loss_cfg.uses_kd:
            teacher = distill.Teacher(final, target.embed_tokens.weight, distill.label_positions(batch["loss_mask"]),
                                      loss_cfg.kd_top_k)
        accept_walk, accept_unary = _dflash_accepts(drafter, target, batch, torch.cat(taps, -1), opts, autocast,
                                                    (unary, walk), losses["dflash"], (loss_cfg, teacher))
        accept_mtp = None
        if head is not None:
            with autocast:
                out = mtp_mod.mtp_losses(head, target.embed_tokens.weight, batch["ids"], final, batch["loss_mask"],
                                         batch["lengths"], opts["mtp_weights"], loss_cfg, batch["greedy"], teacher)
            losses["mtp"].append(float(out["loss"]))
            for d, (hit, valid) in enumerate(out["correct"], start=1):
                depth_acc.add(torch.full((int(valid.sum()),), d, device=device), hit[valid])
            accepted, _ = mtp_mod.chain_accept(out["correct"])
            # A round that commits x_n starts its chain at entry n-1.
            accept_mtp = torch.cat([torch.zeros_like(accepted[:, :1]), accepted[:, :-1]], dim=1).cpu().numpy()
        for row, i in enumerate(chunk):
            if not samples.is_pure_greedy(i):
                continue
            begin, end = int(samples.prompt_len[i]), len(samples.sequences[i])
            head_end = min(end, begin + first_tokens)  # the response's first first_tokens tokens, as a decode of them
            rounds["dflash_walk"] += simulate_rounds(accept_walk[row], begin, end, block - 1)
            rounds["dflash_unary"] += simulate_rounds(accept_unary[row], begin, end, block - 1)
            rounds["dflash_walk_first"] += simulate_rounds(accept_walk[row], begin, head_end, block - 1)
            if accept_mtp is not None:
                rounds["mtp"] += simulate_rounds(accept_mtp[row], begin, end, depth)
                rounds["mtp_first"] += simulate_rounds(accept_mtp[row], begin, head_end, depth)
    drafter.train()
    if head is not None:
        head.train()
    return {
        "eval_samples": len(indices),
        "eval_greedy_samples": int(sum(samples.is_pure_greedy(i) for i in indices)),
        "loss": loss_cfg.mode,
        "token_loss": _mean(losses["dflash"]),
        "mtp_loss": _mean(losses["mtp"]),
        "dflash_slot_accuracy_unary": unary.rates(first=1),
        "dflash_slot_accuracy_walk": walk.rates(first=1),
        "dflash_greedy_walk": summarise_rounds(rounds["dflash_walk"], block - 1),
        "dflash_greedy_unary": summarise_rounds(rounds["dflash_unary"], block - 1),
        "mtp_depth_accuracy": depth_acc.rates(first=1) if head is not None else None,
        "mtp_greedy": summarise_rounds(rounds["mtp"], depth) if head is not None else None,
        "first_tokens": first_tokens,
        "dflash_greedy_walk_first": summarise_rounds(rounds["dflash_walk_first"], block - 1),
        "mtp_greedy_first": summarise_rounds(rounds["mtp_first"], depth) if head is not None else None,
    }


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 4) if values else None


def _dflash_accepts(drafter, target, batch, taps, opts, autocast, counters, losses, loss_and_teacher):
    """Leading-correct counts [b, S] (walk and unary) for an anchor at every response position."""
    ids, lengths, loss_mask = batch["ids"], batch["lengths"], batch["loss_mask"]
    loss_cfg, teacher = loss_and_teacher
    b, s = ids.shape
    block = opts["block_size"]
    accept_walk = np.zeros((b, s), dtype=np.int64)
    accept_unary = np.zeros((b, s), dtype=np.int64)
    first = int(batch["prompt_len"].min())
    for begin in range(first, s, opts["eval_anchor_chunk"]):
        anchors = dfl.all_anchors(loss_mask, lengths, begin, opts["eval_anchor_chunk"])
        if bool((anchors < 0).all()):
            continue
        layout = dfl.block_layout(ids, lengths, anchors, block, opts["mask_token_id"], batch["greedy"])
        mask = dfl.attention_mask(anchors, lengths, s, block)
        with autocast:
            emb = target.embed_tokens(layout.ids)
            hidden = dfl.packed_forward(drafter, taps, emb, layout.pos, mask, block)
            out = dfl.drafter_losses(drafter, hidden, layout, target.embed_tokens.weight, opts["loss_gamma"],
                                     opts["selector_top_k"], loss_cfg, teacher)
        losses.append(float(out["token_loss"]))
        ce = out["ce_rows"]
        counters[0].add(out["slot"][ce], out["unary_correct"][ce])
        counters[1].add(out["slot"][ce], out["walk_correct"][ce])
        lw = dfl.leading_correct(out["rows"], out["walk_correct"]).cpu().numpy()
        lu = dfl.leading_correct(out["rows"], out["unary_correct"]).cpu().numpy()
        a = anchors.cpu().numpy()
        rows, cols = np.nonzero(a >= 0)
        accept_walk[rows, a[rows, cols]] = lw[rows, cols]
        accept_unary[rows, a[rows, cols]] = lu[rows, cols]
    return accept_walk, accept_unary
