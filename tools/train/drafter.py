"""DFlash2 drafter training: the reference package's modules, a packed multi-block forward, and the losses.

The model object is the reference `dflash.model.DFlash2DraftModel` itself (its parameter names and submodules
are therefore exactly what the published format and the reference loader expect); only the forward used for
training is ours. It packs many anchored blocks of one sequence into a single pass (dflash-spec.md §5):

* context rows: `hidden_norm(fc(taps))` for every position of the sequence (teacher forcing);
* block rows: for each anchor `a`, `[x_a, MASK x (B-1)]` at positions `a .. a+B-1`;
* a block query sees context rows at positions strictly below its anchor and the rows of its own block
  (bidirectionally), nothing else; the DFlash2 convolutions run inside each block only (taps zero across the
  block boundary), exactly as the inference forward does for its single block;
* slot k >= 1 predicts the token at `a+k` (same-position prediction); slot 0 carries no loss.

Losses (distill.py): per slot, the KL from the target's own distribution (or, as an option, the cross-entropy
against the greedy token), weighted by `exp(-(k-1)/gamma)`; slots >= 2 only where the block sits on a greedy
chain. The DFlash2 candidate selector's K-way cross-entropy over the top-K candidates of the (detached) unary
logits, with the gold predecessor (teacher forcing), on greedy rows whose gold token is inside the top-K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import distill
from target import TargetConfig


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default taps of the reference (dflash-spec.md §1.4)."""
    from dflash.model import build_target_layer_ids as reference_rule

    return [int(i) for i in reference_rule(num_target_layers, num_draft_layers)]


def draft_config(
    target: TargetConfig,
    *,
    layers: int,
    intermediate_size: int,
    block_size: int,
    mask_token_id: int,
    conv_kernel_size: int,
    conv_group_size: int,
    selector_rank: int,
    selector_top_k: int,
    target_layer_ids: list[int] | None = None,
) -> dict:
    """The drafter's config.json content (Qwen3 fields at the top, DFlash fields in dflash_config)."""
    taps = target_layer_ids or build_target_layer_ids(target.num_layers, layers)
    if target.hidden_size % conv_group_size:
        raise ValueError(f"conv_group_size {conv_group_size} must divide hidden size {target.hidden_size}")
    if not 1 <= conv_kernel_size <= block_size:
        raise ValueError(f"conv_kernel_size {conv_kernel_size} must be in 1..block_size")
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.context_length,
        "rope_theta": target.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * layers,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "num_target_layers": target.num_layers,
        "bos_token_id": target.bos_id,
        "eos_token_id": target.eos_id,
        "dflash_config": {
            "block_size": block_size,
            "target_layer_ids": taps,
            "mask_token_id": mask_token_id,
            "conv_kernel_size": conv_kernel_size,
            "conv_group_size": conv_group_size,
            "selector_rank": selector_rank,
            "selector_top_k": selector_top_k,
        },
    }


def make_drafter(config: dict, seed: int):
    """A freshly initialised reference DFlash2DraftModel (f32, train mode)."""
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    model = DFlash2DraftModel(Qwen3Config(**config))
    init_drafter(model, seed)
    return model.float().train()


@torch.no_grad()
def init_drafter(model, seed: int) -> None:
    """Normal(0, 0.02) matrices, unit norms; identity convolutions and a selector that starts equal to the
    unary logits (zero successor codebook), as dflash-spec.md §2.2 / §2.5 describe."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("base_kernel"):
            p.zero_()
            p[:, 0] = 1.0  # [side, tap, H]: tap 0 (the current position) passes through
        elif name.endswith("kernel_projection.weight") or "successor_codebook" in name:
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


@dataclass
class BlockLayout:
    """Anchored blocks over a batch: N anchors per sequence, B slots each.

    ids [b, N*B] block tokens ([x_a, MASK x (B-1)]); pos [b, N*B] their positions (a .. a+B-1); labels
    [b, N, B] the token each slot predicts (x_{a+k}; -100 for slot 0, past the sequence end or an empty anchor);
    kd_rows / ce_rows [b, N, B] the rows that may take the teacher's distribution / a hard label (distill.py:
    slots >= 2 only on greedy chains); teacher_pos [b, N, B] the position whose teacher distribution labels the
    slot (a+k-1).
    """

    ids: torch.Tensor
    pos: torch.Tensor
    labels: torch.Tensor
    kd_rows: torch.Tensor
    ce_rows: torch.Tensor
    teacher_pos: torch.Tensor


def block_layout(ids: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int,
                 greedy: torch.Tensor | None = None) -> BlockLayout:
    """The blocks of anchors [b, N] (-1 = none) over ids [b, S]; greedy [b, S] marks the tokens the target
    chose greedily (None: every token is)."""
    b, n = anchors.shape
    slot = torch.arange(block, device=ids.device)
    pos = anchors.clamp_min(0)[:, :, None] + slot  # [b, N, B]
    inside = (pos < lengths[:, None, None]) & (anchors[:, :, None] >= 0) & (slot > 0)
    flat_pos = pos.clamp_max(ids.shape[1] - 1).view(b, -1)
    gathered = ids.gather(1, flat_pos).view(b, n, block)
    labels = torch.where(inside, gathered, torch.full_like(gathered, -100))
    block_ids = torch.where(slot == 0, gathered, torch.full_like(gathered, mask_id))
    greedy_at = inside if greedy is None else greedy.gather(1, flat_pos).view(b, n, block)
    kd_rows, ce_rows = distill.chain_rows(greedy_at, inside)
    return BlockLayout(block_ids.view(b, -1), pos.view(b, -1), labels, kd_rows, ce_rows, (pos - 1).clamp_min(0))


def attention_mask(anchors: torch.Tensor, lengths: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """Boolean mask [b, 1, N*B, S + N*B]: which keys ([context | blocks]) each block query sees.

    Context row j is visible to the blocks of anchor a iff j < a (and j is inside the sequence); block rows
    are visible within their own block only. Empty anchors see their own block, so no row is fully masked.
    """
    b, n = anchors.shape
    ctx = torch.arange(seq_len, device=anchors.device)
    ctx_visible = (ctx[None, None, :] < anchors[:, :, None]) & (ctx[None, None, :] < lengths[:, None, None])
    ctx_visible = ctx_visible[:, :, None, :].expand(b, n, block, seq_len).reshape(b, n * block, seq_len)
    owner = torch.arange(n, device=anchors.device).repeat_interleave(block)
    blk_visible = (owner[:, None] == owner[None, :]).expand(b, n * block, n * block)
    return torch.cat([ctx_visible, blk_visible], dim=-1)[:, None]


def _conv_prepare(conv, h: torch.Tensor, block: int):
    b, rows, hidden = h.shape
    out, dynamic = conv.prepare(h.reshape(b * rows // block, block, hidden))
    return out.reshape(b, rows, hidden), dynamic


def _conv_finish(conv, h: torch.Tensor, dynamic: torch.Tensor, block: int) -> torch.Tensor:
    b, rows, hidden = h.shape
    return conv.finish(h.reshape(b * rows // block, block, hidden), dynamic).reshape(b, rows, hidden)


def _layer_forward(layer, x, context, position_embeddings, mask, block: int) -> torch.Tensor:
    """One reference decoder layer over packed blocks: x [b, N*B, H], context [b, S, H]."""
    residual = x
    h = layer.input_layernorm(x)
    h, att_kernel = _conv_prepare(layer.attention_conv, h, block)
    h = layer.self_attn(
        hidden_states=h, target_hidden=context, position_embeddings=position_embeddings, attention_mask=mask
    )[0]
    x = residual + _conv_finish(layer.attention_conv, h, att_kernel, block)
    residual = x
    h = layer.post_attention_layernorm(x)
    h, mlp_kernel = _conv_prepare(layer.mlp_conv, h, block)
    return residual + _conv_finish(layer.mlp_conv, layer.mlp(h), mlp_kernel, block)


def packed_forward(model, taps: torch.Tensor, block_emb: torch.Tensor, block_pos: torch.Tensor,
                   mask: torch.Tensor, block: int) -> torch.Tensor:
    """Final-normed drafter hidden [b, N*B, H] for taps [b, S, n*H] and block embeddings [b, N*B, H]."""
    b, s, _ = taps.shape
    context = model.hidden_norm(model.fc(taps))
    ctx_pos = torch.arange(s, device=taps.device).expand(b, s)
    position_embeddings = model.rotary_emb(block_emb, torch.cat([ctx_pos, block_pos], dim=1))
    x = block_emb
    for layer in model.layers:
        x = _layer_forward(layer, x, context, position_embeddings, mask, block)
    return model.norm(x)


def slot_weights(block: int, gamma: float, device) -> torch.Tensor:
    """[B] loss weight per slot: 0 for slot 0, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def selector_scores(selector, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                    predecessor: torch.Tensor) -> torch.Tensor:
    """Edge-augmented scores [R, K]: unary + <A[pred] * P(h), B[cand]> (dflash-spec.md §2.3)."""
    projected = selector.hidden_projection(hidden)  # [R, r]
    left = selector.predecessor_codebook(predecessor) * projected  # [R, r]
    right = selector.successor_codebook(candidates)  # [R, K, r]
    return unary + torch.einsum("nr,nkr->nk", left, right)


def drafter_losses(model, hidden: torch.Tensor, layout: BlockLayout, embed: torch.Tensor, gamma: float,
                   top_k: int, loss: distill.LossConfig, teacher: distill.Teacher | None = None,
                   stop_gradient: bool = True) -> dict:
    """The token loss over slots (KD and/or CE, decayed by slot), the selector CE, and per-row correctness.

    hidden [b, N*B, H]; embed [V, H] (the target's tied embedding = LM head); teacher is required for KD.
    Rows: layout.kd_rows for KD (a superset of ce_rows), layout.ce_rows for CE only. Correctness is against the
    data token and meaningful on ce_rows (greedy labels); on pure greedy samples both sets are every labelled row.
    """
    b, n, block = layout.labels.shape
    rows = layout.kd_rows if loss.uses_kd else layout.ce_rows
    batch_index = torch.arange(b, device=rows.device)[:, None, None].expand(b, n, block)[rows]
    slot = torch.arange(block, device=rows.device).expand(b, n, block)[rows]
    h = hidden.view(b, n, block, -1)[rows]
    gold = layout.labels[rows]
    ce_rows = layout.ce_rows[rows]
    logits = F.linear(h, embed.to(h.dtype)).float()  # [R, V]
    weights = slot_weights(block, gamma, rows.device)[slot]
    targets = teacher.rows(batch_index, layout.teacher_pos[rows]) if loss.uses_kd else None
    out = distill.token_loss(logits, gold, targets, weights, ce_rows, loss)
    # The selector learns to pick the greedy token among the unary top-K given the gold predecessor: the anchor
    # for slot 1, the previous slot's label otherwise (greedy, since ce rows sit on greedy chains).
    anchor = layout.ids.view(b, n, block)[:, :, :1]
    previous = torch.cat([anchor, anchor, layout.labels[:, :, 1:-1].clamp_min(0)], dim=2)[rows]
    unary, candidates = torch.topk(logits.detach(), top_k, dim=-1)
    hit = candidates == gold[:, None]
    scores = selector_scores(model.candidate_selector, h.detach() if stop_gradient else h,
                             unary.to(h.dtype) if stop_gradient else logits.gather(1, candidates).to(h.dtype),
                             candidates, previous).float()
    sel_ce = F.cross_entropy(scores, hit.float().argmax(-1), reduction="none")
    selector_loss = distill.weighted_mean(sel_ce, weights * (hit.any(-1) & ce_rows))
    return {
        "token_loss": out["loss"],
        "kd": out.get("kd"),
        "ce": out.get("ce"),
        "selector_loss": selector_loss,
        "rows": rows,
        "ce_rows": ce_rows,
        "unary_correct": (logits.argmax(-1) == gold) & ce_rows,
        "walk_correct": (candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0] == gold) & ce_rows,
        "slot": slot,
    }


def leading_correct(rows: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """Per anchor [b, N]: how many slots 1, 2, ... in a row are correct (the greedy acceptance length).

    rows [b, N, B] marks the rows that have a label; correct [R] follows them in order. Slots past the
    sequence end end the run.
    """
    full = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    full[rows] = correct
    run = full[:, :, 1:].to(torch.int64).cumprod(dim=-1)
    return run.sum(-1)


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, per_seq: int, generator=None) -> torch.Tensor:
    """Up to per_seq distinct anchors per sequence [b, N], sorted, -1 padded.

    Valid anchors are response positions with at least one following token (the anchor is a committed response
    token at inference: the first one is the token sampled at prefill).
    """
    b, s = loss_mask.shape
    pos = torch.arange(s, device=loss_mask.device)
    valid = loss_mask.bool() & (pos[None, :] < (lengths[:, None] - 1))
    n = min(per_seq, int(valid.sum(-1).max().item()))
    if n == 0:
        return torch.full((b, 1), -1, dtype=torch.long, device=loss_mask.device)
    scores = torch.rand(b, s, device=loss_mask.device, generator=generator)
    scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    top, idx = torch.topk(scores, n, dim=-1)
    idx = torch.where(top >= 0, idx, torch.full_like(idx, s + 1))
    idx, _ = torch.sort(idx, dim=-1)
    return torch.where(idx > s, torch.full_like(idx, -1), idx)


def all_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Anchors at every valid position in [start, start+count) per sequence ([b, count], -1 where invalid)."""
    b, s = loss_mask.shape
    pos = torch.arange(start, start + count, device=loss_mask.device).clamp_max(s - 1)
    valid = loss_mask.bool().gather(1, pos.expand(b, count)) & (pos[None, :] < (lengths[:, None] - 1))
    valid &= (torch.arange(start, start + count, device=loss_mask.device) < s)[None, :]
    return torch.where(valid, pos.expand(b, count), torch.full_like(pos.expand(b, count), -1))


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())
