"""Distillation from the target: its own next-token distribution as the label of every drafted token.

The teacher. Every training step already runs the frozen target over the batch (teacher forcing) for the taps; its
final-normed hidden state times the tied embedding gives the target's exact logits at every position, so the
soft labels cost one matmul and no storage. Position p's distribution is the target's prediction of token p+1
given the tokens up to p. They are computed in f32 with TF32 off (`exact_matmuls`), so near-ties are not decided
by TF32 rounding.

Which teacher position labels which drafted token:
  * DFlash slot k of the block anchored at a predicts x_{a+k}: teacher position a+k-1;
  * MTP depth d at entry j predicts x_{j+2}: teacher position j+1.

Two forms of the loss (forward KL, teacher || drafter, in f32):
  * top-k (the default): the teacher's k most likely tokens and the log of the mass outside them; the KL is
    taken between the (k+1)-outcome coarse-grainings of both distributions (the drafter's probability of each
    of the teacher's top-k tokens, and of everything else together). Zero when the drafter equals the teacher,
    never more than the full KL, equal to it when k covers the vocabulary.
  * dense (k = 0): the full-vocabulary KL.

Which rows may be trained on which data (`chain_rows`): a drafted token at chain step k >= 2 is only checked by
verification after steps 1..k-1 were accepted, i.e. its context is the target's greedy chain. So a row is
trained only when the tokens between its committed context and its label are greedy; sampled text then only
reaches rows whose label is the teacher's distribution given that very text (DFlash slot 1, MTP depth 1). Hard
labels (the cross-entropy option) additionally need a greedy label token.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Log-probabilities below this are treated as zero mass (exp(-80) ~ 2e-35): keeps 0 * log 0 terms finite.
LOG_FLOOR = -80.0
# Stands in for -inf when masking logits, so a fully masked row still has a finite logsumexp and gradient.
MASKED_LOGIT = -1e30


@dataclass(frozen=True)
class LossConfig:
    """What the drafters are trained against: 'kd' (teacher distribution), 'ce' (hard labels on greedy tokens),
    or 'kd+ce' (both, the CE scaled by ce_weight); kd_top_k = 0 takes the dense KL."""

    mode: str = "kd"
    kd_top_k: int = 32
    ce_weight: float = 0.0

    def __post_init__(self):
        if self.mode not in ("kd", "ce", "kd+ce"):
            raise ValueError(f"loss mode {self.mode!r}: expected kd, ce or kd+ce")

    @property
    def uses_kd(self) -> bool:
        return self.mode != "ce"

    @property
    def uses_ce(self) -> bool:
        return self.mode != "kd"


@contextlib.contextmanager
def exact_matmuls(device_type: str = "cpu", tf32: bool = False):
    """f32 matmuls inside the block (the labels): autocast off and, unless tf32, TF32 off; the previous
    settings come back after."""
    cuda_matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = cuda_matmul, cudnn


@dataclass
class RowTargets:
    """Teacher distributions for R rows: top-k (ids, logp [R, k], rest [R]) or dense (logp [R, V])."""

    logp: torch.Tensor
    ids: torch.Tensor | None = None
    rest: torch.Tensor | None = None


class Teacher:
    """The target's distribution at chosen positions of a batch; `rows(b, p)` gathers it for R rows."""

    def __init__(self, final: torch.Tensor, embed: torch.Tensor, needed: torch.Tensor, top_k: int,
                 chunk_rows: int = 4096):
        """final [b, S, H] the target's final-normed hidden; embed [V, H] its tied LM head; needed [b, S] the
        positions whose distribution some row will ask for."""
        self.top_k = top_k
        self.final, self.embed = final, embed
        if top_k > 0:
            self.ids, self.logp, self.rest = _topk_table(final, embed, needed, top_k, chunk_rows)

    @torch.no_grad()
    def rows(self, batch_index: torch.Tensor, position: torch.Tensor) -> RowTargets:
        if self.top_k > 0:
            return RowTargets(self.logp[batch_index, position], self.ids[batch_index, position],
                              self.rest[batch_index, position])
        with exact_matmuls(self.final.device.type):
            logits = self.final[batch_index, position].float() @ self.embed.float().t()
        return RowTargets(torch.log_softmax(logits, dim=-1))


def label_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """[b, S]: the positions whose distribution labels some response token (p such that p+1 is one)."""
    return torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1).bool()


@torch.no_grad()
def _topk_table(final, embed, needed, k, chunk_rows):
    """Per position: the teacher's top-k ids and log-probs and the log of the rest of the mass."""
    b, s, h = final.shape
    flat = final.reshape(-1, h)
    ids = torch.zeros(b * s, k, dtype=torch.long, device=final.device)
    logp = torch.full((b * s, k), LOG_FLOOR, dtype=torch.float32, device=final.device)
    rest = torch.full((b * s,), LOG_FLOOR, dtype=torch.float32, device=final.device)
    weight = embed.float()
    with exact_matmuls(final.device.type):
        for chunk in needed.reshape(-1).nonzero()[:, 0].split(chunk_rows):
            lp = torch.log_softmax(flat[chunk].float() @ weight.t(), dim=-1)
            top, idx = lp.topk(k, dim=-1)
            ids[chunk], logp[chunk] = idx, top
            rest[chunk] = torch.logsumexp(lp.scatter(1, idx, MASKED_LOGIT), dim=-1).clamp_min(LOG_FLOOR)
    return ids.view(b, s, k), logp.view(b, s, k), rest.view(b, s)


def row_kl(student_logits: torch.Tensor, target: RowTargets) -> torch.Tensor:
    """Forward KL(teacher || student) per row [R], in f32; student_logits [R, V]."""
    z = student_logits.float()
    lse = torch.logsumexp(z, dim=-1)
    if target.ids is None:
        p = target.logp.exp()
        return (p * (target.logp - (z - lse[:, None]))).sum(-1)
    s_top = z.gather(1, target.ids) - lse[:, None]
    s_rest = (torch.logsumexp(z.scatter(1, target.ids, MASKED_LOGIT), dim=-1) - lse).clamp_min(LOG_FLOOR)
    top = (target.logp.exp() * (target.logp - s_top)).sum(-1)
    return top + target.rest.exp() * (target.rest - s_rest)


def chain_rows(greedy_at_label: torch.Tensor, inside: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kd rows, ce rows) for chains laid out along the last dim (step 0 = the committed anchor, no label).

    greedy_at_label[..., k]: the token that step k predicts was chosen greedily; inside[..., k]: step k has a
    label. Step k may use the teacher's label when steps 1..k-1 are greedy (its context is a greedy chain); a
    hard label also needs step k itself greedy.
    """
    through = (greedy_at_label[..., 1:] & inside[..., 1:]).to(torch.int64).cumprod(dim=-1)  # steps 1..k+1
    ones = torch.ones_like(through[..., :1])
    before = torch.cat([ones, ones, through[..., :-1]], dim=-1).bool()  # before[k]: steps 1..k-1 greedy
    kd = inside & before
    return kd, kd & greedy_at_label


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights * values).sum() / weights.sum().clamp_min(1e-6)


def token_loss(logits: torch.Tensor, gold: torch.Tensor, targets: RowTargets | None, weights: torch.Tensor,
               ce_rows: torch.Tensor, loss: LossConfig) -> dict:
    """The configured loss over R rows: weighted KD, weighted CE on the rows with a hard label, or both."""
    out = {}
    if loss.uses_kd:
        out["kd"] = weighted_mean(row_kl(logits, targets), weights)
    if loss.uses_ce:
        ce = F.cross_entropy(logits.float(), gold.clamp_min(0), reduction="none")
        out["ce"] = weighted_mean(ce, weights * ce_rows)
    if loss.mode == "kd":
        out["loss"] = out["kd"]
    elif loss.mode == "ce":
        out["loss"] = out["ce"]
    else:
        out["loss"] = out["kd"] + loss.ce_weight * out["ce"]
    return out
