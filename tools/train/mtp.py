"""The MTP head: one extra decoder layer that drafts the token after next, in Qwen3-Next's `mtp.*` layout.

Layout (tensor names under `mtp.`, as Qwen3-Next checkpoints store them):
    pre_fc_norm_embedding.weight [H]     RMSNorm of the next token's embedding
    pre_fc_norm_hidden.weight    [H]     RMSNorm of the target's hidden state
    fc.weight                    [H, 2H] over concat([embedding, hidden]) (that order), no bias
    layers.0.*                           one decoder layer of the target's kind (here Llama: q/k/v/o, gate/up/down,
                                         input_layernorm, post_attention_layernorm)
    norm.weight                  [H]     final RMSNorm; its output feeds the target's (tied) LM head and is the
                                         hidden state of the next chained step
The embedding table and LM head are the target's. The norms are plain RMSNorm (x * w, weights near 1), the
target's convention; Qwen3-Next's own checkpoints use zero-centred (1 + w) norms instead.

Conventions (written into the exported config's `mtp_config`):
* depth-1 entry j combines the target's final-normed hidden state at position j (the one that feeds the LM head)
  with the embedding of token j+1, sits at rope position j, and predicts token j+2;
* a chained step d >= 2 at entry j takes the previous step's output at entry j-1 instead of the target hidden;
* the head keeps its own KV cache: committed entries are computed from target hidden states; a chained step
  attends to the committed entries before its chain and to the chain's own earlier entries.
Training reproduces that cache structure exactly for depths 1..D with one mask per depth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import distill
from target import DecoderLayer, RmsNorm, TargetConfig, rope_cos_sin


class MtpHead(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.pre_fc_norm_embedding = RmsNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RmsNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RmsNorm(h, cfg.rms_norm_eps)

    def combine(self, next_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc(concat(norm(embedding of token j+1), norm(hidden at j))): [b, s, H]."""
        e = self.pre_fc_norm_embedding(next_embedding)
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward_depths(self, next_embedding: torch.Tensor, hidden: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Teacher-forced chained outputs for depths 1..depth, each [b, S, H] (after mtp.norm).

        next_embedding[:, j] is the embedding of token j+1 (the caller shifts); hidden[:, j] the target's
        final-normed hidden at j. Output d at entry j predicts token j+2 and is meaningful for j >= d-1.
        """
        b, s, _ = hidden.shape
        layer = self.layers[0]
        positions = torch.arange(s, device=hidden.device).expand(b, s)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, hidden.dtype)
        keys, values, outputs = [], [], []
        previous = hidden
        for d in range(1, depth + 1):
            if d > 1:
                # Entry j of depth d continues the chain from entry j-1 of depth d-1.
                previous = torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1)
            x = self.combine(next_embedding, previous)
            q, k, v = layer.qkv(layer.input_layernorm(x), cos.to(x.dtype), sin.to(x.dtype))
            keys.append(k)
            values.append(v)
            mask = depth_mask(s, d, hidden.device)
            attn = layer.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask=mask)
            previous = self.norm(layer.finish(x, attn))
            outputs.append(previous)
        return outputs


def depth_mask(s: int, depth: int, device) -> torch.Tensor:
    """[S, depth*S] boolean: which entries (depth-1 block first) depth `depth`'s query j sees.

    Depth-1 entries k <= j-depth+1 (the committed prefix, which ends with the chain's first step), and the
    depth-e entry at k = j-depth+e for e = 2..depth (the chain so far, itself included, so no row is empty).
    Queries with j < depth-1 have no chain and carry no loss.
    """
    j = torch.arange(s, device=device)[:, None]
    k = torch.arange(s, device=device)[None, :]
    blocks = [k <= j - depth + 1] + [k == j - depth + e for e in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


def chain_greedy(greedy: torch.Tensor, depth: int) -> torch.Tensor:
    """[b, S]: at entry j, the depth-`depth` chain's intermediate tokens x_{j-depth+3} .. x_{j+1} (drafted by the
    earlier depths at inference) were all chosen greedily. Always true at depth 1, which has none."""
    if depth == 1:
        return torch.ones_like(greedy)
    b, s = greedy.shape
    sampled = torch.cat([torch.zeros_like(greedy[:, :1], dtype=torch.int64),
                         (~greedy).to(torch.int64).cumsum(dim=1)], dim=1)  # sampled[p]: non-greedy among < p
    pos = torch.arange(s, device=greedy.device)
    hi = (pos + 2).clamp(max=s)  # one past x_{j+1}
    lo = (pos - depth + 3).clamp(min=0, max=s)
    return (sampled[:, hi] - sampled[:, lo]) == 0


def mtp_losses(head: MtpHead, embed: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
               loss_mask: torch.Tensor, lengths: torch.Tensor, weights: list[float], loss: distill.LossConfig,
               greedy: torch.Tensor | None = None, teacher: distill.Teacher | None = None) -> dict:
    """The configured loss (distill.py) over depths, and per-entry correctness.

    ids [b, S]; hidden [b, S, H] target final-normed hidden; loss_mask [b, S] marks response tokens; greedy
    [b, S] the greedily chosen tokens (None: all). Entry j of depth d predicts token j+2 (teacher position j+1)
    where that token is a response token inside the sequence and the chain's intermediate tokens are greedy; a
    hard label also needs token j+2 greedy. Correctness is against the data token on those hard-label rows.
    """
    b, s = ids.shape
    depth = len(weights)
    greedy = loss_mask.bool() if greedy is None else greedy
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    outputs = head.forward_depths(F.embedding(next_ids, embed), hidden, depth)
    pos = torch.arange(s, device=ids.device)
    label_pos = (pos + 2).clamp_max(s - 1)
    labels = ids[:, label_pos]
    base_valid = (pos[None, :] + 2 < lengths[:, None]) & loss_mask.bool()[:, label_pos]
    label_greedy = greedy[:, label_pos]
    batch_index = torch.arange(b, device=ids.device)[:, None].expand(b, s)
    teacher_pos = (pos + 1).clamp_max(s - 1).expand(b, s)
    total, norm, correct = 0.0, 0.0, []
    for d, (w, out) in enumerate(zip(weights, outputs, strict=True), start=1):
        kd_rows = base_valid & (pos[None, :] >= d - 1) & chain_greedy(greedy, d)
        ce_rows = kd_rows & label_greedy
        rows = kd_rows if loss.uses_kd else ce_rows
        logits = F.linear(out[rows], embed.to(out.dtype)).float()
        targets = teacher.rows(batch_index[rows], teacher_pos[rows]) if loss.uses_kd else None
        count = float(rows.sum().item())
        ones = torch.ones(logits.shape[0], device=ids.device)
        part = distill.token_loss(logits, labels[rows], targets, ones, ce_rows[rows], loss)["loss"]
        total = total + w * part * count
        norm += w * count
        hit = torch.zeros(b, s, dtype=torch.bool, device=ids.device)
        hit[rows] = logits.argmax(-1) == labels[rows]
        correct.append((hit & ce_rows, ce_rows))
    return {"loss": total / max(norm, 1.0), "correct": correct}


def chain_accept(correct: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance per round start: the chain started at entry j drafts depth e at entry j+e-1.

    Returns (accepted [b, S]: leading correct depths of the chain started at entry j, started [b, S]: entries
    with a depth-1 label).
    """
    hit1, valid1 = correct[0]
    run = hit1.clone()
    accepted = run.to(torch.int64)
    for offset, (hit, _) in enumerate(correct[1:], start=1):
        later = torch.zeros_like(hit)
        later[:, :-offset] = hit[:, offset:]
        run &= later
        accepted += run.to(torch.int64)
    return accepted, valid1


def init_from_target(head: MtpHead, target, seed: int) -> None:
    """The decoder layer and final norm start as copies of the target's last layer and final norm; the norms
    of the inputs at 1 and fc at N(0, 0.02), so training starts from a layer that already reads the
    target's residual stream."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.layers[0].load_state_dict(target.layers[-1].state_dict())
        head.norm.weight.copy_(target.norm.weight)
        head.pre_fc_norm_embedding.weight.fill_(1.0)
        head.pre_fc_norm_hidden.weight.fill_(1.0)
        head.fc.weight.copy_(torch.randn(head.fc.weight.shape, generator=gen) * 0.02)
