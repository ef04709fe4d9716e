"""The training loop of both drafters, resumable: one step's losses, the optimizer, the step-based schedule, the
data cursor and the checkpoint state (checkpoint.py).

Every step runs the frozen target over a batch of sequences (teacher forcing, no grad) for the tap-layer outputs
and the final-normed hidden states, whose logits are the distillation labels (distill.py); then
  * DFlash2: up to anchors_per_seq random anchors per sequence (response positions), packed blocks, the
    slot-decayed token loss plus the candidate selector's loss, ramped in from 10 % to 30 % of the step budget;
  * MTP: the chained loss over depths with the head's exact cache structure.
bf16 autocast for the drafters on GPU; the target's pass at `target_precision` (f32 with TF32 off by default).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

import checkpoint as ckpt
import distill
import drafter as dfl
import mtp as mtp_mod
from step_profile import StepProfile
from train_data import BatchCursor, Samples, device_batch


@dataclass
class TrainConfig:
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    selector_top_k: int
    pad_id: int
    schedule: dict
    loss: distill.LossConfig = field(default_factory=distill.LossConfig)
    loss_gamma: float = 4.0
    selector_alpha: float = 0.5
    mtp_weights: list[float] = field(default_factory=lambda: [1.0, 0.5])
    mtp_loss_weight: float = 1.0
    anchors_per_seq: int = 256
    batch_tokens: int = 16384
    batch_anchors: int = 4096
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    target_precision: str = "f32"  # f32 (TF32 off), tf32, or bf16 (autocast): the target's pass

    def batch_sizes(self) -> dict:
        return {"batch_tokens": self.batch_tokens, "batch_anchors": self.batch_anchors,
                "anchors_per_seq": self.anchors_per_seq}


def selector_weight(progress: float, alpha: float) -> float:
    """0 until 10 % of the step budget, then a linear ramp to alpha at 30 % (the backbone's logits settle first)."""
    return alpha * min(1.0, max(0.0, (progress - 0.1) / 0.2))


def named_groups(modules: dict[str, torch.nn.Module]) -> tuple[list[str], list[dict]]:
    """(parameter names, AdamW groups): weight decay on matrices only; names in param_groups order."""
    decay, plain = [], []
    for prefix, module in modules.items():
        for name, p in module.named_parameters():
            (decay if p.dim() >= 2 else plain).append((f"{prefix}.{name}", p))
    names = [n for n, _ in decay] + [n for n, _ in plain]
    return names, [{"params": [p for _, p in decay]}, {"params": [p for _, p in plain], "weight_decay": 0.0}]


class Trainer:
    def __init__(self, target, drafter, head, cfg: TrainConfig, samples: Samples, train_idx: list[int], device,
                 resume: dict | None = None):
        self.target, self.drafter, self.head, self.cfg, self.device = target, drafter, head, cfg, device
        modules = {"drafter": drafter} | ({"mtp": head} if head is not None else {})
        self.param_names, groups = named_groups(modules)
        self.params = [p for g in groups for p in g["params"]]
        for g in groups:
            g.setdefault("weight_decay", cfg.weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.schedule["peak_lr"], betas=cfg.betas,
                                           fused=device.type == "cuda")
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)
        self.step = 0
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        self.totals = {"sequences": 0, "response_tokens": 0, "anchors": 0, "dflash_rows": 0, "mtp_rows": 0}
        cursor = None
        if resume is not None:
            ckpt.restore_optimizer(self.optimizer, resume)
            self.step = int(resume["step"])
            ckpt.restore_rng(resume["rng"], self.generator)
            cursor = resume.get("cursor")
        self.cursor = BatchCursor(samples, train_idx, cfg.seed, cfg.batch_sizes(), cursor)
        self.samples = samples

    # -------------------------------------------------------------------------------------------- one step

    def _target_pass(self, ids: torch.Tensor):
        precision = self.cfg.target_precision
        if precision == "bf16" and self.device.type == "cuda":
            context = torch.autocast("cuda", dtype=torch.bfloat16)
        else:
            context = distill.exact_matmuls(self.device.type, tf32=precision == "tf32")
        with context, record_function("target_pass"):
            final, taps = self.target.capture(ids, self.cfg.target_layer_ids)
        return final.float(), [t.float() for t in taps]

    def losses(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """The step's total loss and its parts, for one device batch."""
        cfg, embed = self.cfg, self.target.embed_tokens.weight
        final, taps = self._target_pass(batch["ids"])
        teacher = None
        if cfg.loss.uses_kd:
            with record_function("teacher"):
                teacher = distill.Teacher(final, embed, distill.label_positions(batch["loss_mask"]), cfg.loss.kd_top_k)
        with self.autocast:
            with record_function("dflash_loss"):
                loss, stats = self._dflash_loss(batch, taps, teacher)
            if self.head is not None:
                with record_function("mtp_loss"):
                    mtp_loss, mtp_stats = self._mtp_loss(batch, final, teacher)
                loss = loss + cfg.mtp_loss_weight * mtp_loss
                stats.update(mtp_stats)
        stats["loss"] = loss.item()
        return loss, stats

    def _dflash_loss(self, batch: dict, taps: list[torch.Tensor], teacher) -> tuple[torch.Tensor, dict]:
        cfg, embed = self.cfg, self.target.embed_tokens.weight
        anchors = dfl.sample_anchors(batch["loss_mask"], batch["lengths"], cfg.anchors_per_seq, self.generator)
        layout = dfl.block_layout(batch["ids"], batch["lengths"], anchors, cfg.block_size, cfg.mask_token_id,
                                  batch["greedy"])
        mask = dfl.attention_mask(anchors, batch["lengths"], batch["ids"].shape[1], cfg.block_size)
        hidden = dfl.packed_forward(self.drafter, torch.cat(taps, -1), self.target.embed_tokens(layout.ids),
                                    layout.pos, mask, cfg.block_size)
        d = dfl.drafter_losses(self.drafter, hidden, layout, embed, cfg.loss_gamma, cfg.selector_top_k, cfg.loss,
                               teacher)
        progress = self.step / cfg.schedule["total_steps"]
        loss = d["token_loss"] + selector_weight(progress, cfg.selector_alpha) * d["selector_loss"]
        slot1 = (d["slot"] == 1) & d["ce_rows"]
        stats = {"dflash": d["token_loss"].item(), "selector": d["selector_loss"].item(),
                 "acc1": d["unary_correct"][slot1].float().mean().item() if bool(slot1.any()) else 0.0,
                 "rows": int(d["rows"].sum()), "anchors": int((anchors >= 0).sum())}
        stats.update({part: d[part].item() for part in ("kd", "ce") if d[part] is not None})
        return loss, stats

    def _mtp_loss(self, batch: dict, final: torch.Tensor, teacher) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        m = mtp_mod.mtp_losses(self.head, self.target.embed_tokens.weight, batch["ids"], final, batch["loss_mask"],
                               batch["lengths"], cfg.mtp_weights, cfg.loss, batch["greedy"], teacher)
        hit, valid = m["correct"][0]
        return m["loss"], {"mtp": m["loss"].item(), "mtp_rows": int(valid.sum()),
                           "mtp_acc1": hit[valid].float().mean().item() if bool(valid.any()) else 0.0}

    def train_step(self) -> dict:
        indices = self.cursor.next()
        batch = device_batch(self.samples, indices, self.cfg.pad_id, self.device)
        lr = ckpt.lr_at(self.step, self.cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, stats = self.losses(batch)
        self.optimizer.zero_grad(set_to_none=True)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            self.optimizer.step()
        self.step += 1
        self.totals["sequences"] += len(indices)
        self.totals["response_tokens"] += int(batch["loss_mask"].sum())
        self.totals["anchors"] += stats["anchors"]
        self.totals["dflash_rows"] += stats["rows"]
        self.totals["mtp_rows"] += stats.get("mtp_rows", 0)
        stats.update(step=self.step, lr=lr, grad_norm=float(grad_norm), epoch=round(self.cursor.epochs_done(), 3))
        return stats

    # -------------------------------------------------------------------------------------------- the loop

    def run(self, max_steps: int, deadline: float, curve_every: int, log, hooks=(),
            profile_steps: int = 0) -> list[dict]:
        """Steps until max_steps more are done, the deadline passes or the schedule's budget is spent; returns
        the loss curve (every curve_every-th step). hooks: callables (trainer, now) run after every step;
        profile_steps: steps to profile once warm (a table of where their time went; the steps train as usual)."""
        curve, first = [], self.step
        total = self.cfg.schedule["total_steps"]
        profile = StepProfile(profile_steps, self.device, warm_steps=3, what="train", unit="training steps")
        while self.step - first < max_steps and self.step < total and time.time() < deadline:
            profile.before(self.step - first)
            stats = self.train_step()
            profile.after()
            if self.step % curve_every == 0 or self.step == first + 1:
                curve.append({k: round(v, 5) if isinstance(v, float) else v for k, v in stats.items()})
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
            for hook in hooks:
                hook(self, time.time())
        profile.end()
        if self.step >= total:
            log(f"the step budget of the schedule ({total}) is spent")
        return curve

    def checkpoint_state(self) -> dict:
        """The model-independent part of a checkpoint (the caller adds configs and run summaries)."""
        return {
            "drafter_state": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
            "mtp_state": None if self.head is None else {k: v.detach().cpu().clone()
                                                         for k, v in self.head.state_dict().items()},
            "optimizer": self.optimizer,
            "param_names": self.param_names,
            "step": self.step,
            "schedule": self.cfg.schedule,
            "rng": ckpt.rng_state(self.generator),
            "cursor": self.cursor.state(),
        }

