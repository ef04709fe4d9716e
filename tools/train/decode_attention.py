"""Decode attention over the pool's static cache that reads each row's own keys only, and its reference.

A decode step attends one query per row to the slots that row holds. SDPA's masked kernel reads every row's keys
up to the longest row's bucket and runs 64 x 64 tiles for that one query: on an H100 it was 82% of a step's kernel
time (704 us a layer at ~970 rows; tools/train/README.md). Here one Triton program per (row, kv head) walks the
row's own keys, BLOCK_N at a time, with the query heads that share the kv head together (an online softmax in
f32), so a step reads each row's K and V once and no further than its length.

The kernel is built on first use, so `TRITON_INTERPRET=1` set before that runs it on the CPU (the unit test).
"""

from __future__ import annotations

import functools

import torch

BLOCK_N = 64  # keys per iteration
BLOCK_G = 16  # query heads of a kv head, padded to the smallest tile tl.dot takes


def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [R, nh, hd], k/v [R, nkv, S, hd], lengths [R] (keys 0..length-1 of each row) -> [R, nh, hd], in f32."""
    r, nh, hd = q.shape
    nkv, slots = k.shape[1], k.shape[2]
    scores = torch.einsum("rkgd,rksd->rkgs", q.reshape(r, nkv, nh // nkv, hd).float(), k.float()) * scale
    past = torch.arange(slots, device=q.device)[None, :] >= lengths[:, None]
    probs = torch.softmax(scores.masked_fill(past[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("rkgs,rksd->rkgd", probs, v.float()).reshape(r, nh, hd).to(q.dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_ptr, stride_qr, stride_qh, stride_kr, stride_kh,
                                stride_ks, stride_or, stride_oh, scale, GROUP: tl.constexpr,
                                BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row offsets pass 2^31 elements in large caches
        kv_head = tl.program_id(1).to(tl.int64)
        length = tl.load(len_ptr + row)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        live = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=live[:, None], other=0.0)
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        base = row * stride_kr + kv_head * stride_kh
        for start in range(0, length, BLOCK_N):
            keys = start + n
            inside = keys < length
            offsets = base + keys[:, None] * stride_ks + d[None, :]
            k = tl.load(k_ptr + offsets, mask=inside[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            scores = tl.where(inside[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            rescale = tl.exp(best - new_best)
            p = tl.exp(scores - new_best[:, None])
            total = total * rescale + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets, mask=inside[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            best = new_best
        out = acc / total[:, None]
        tl.store(o_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])

    return decode_attention_kernel


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The Triton kernel: q [R, nh, hd], k/v [R, nkv, S, hd] with equal strides (head dim contiguous), lengths [R]
    >= 1 -> [R, nh, hd] in q's dtype.

    Raises ValueError for shapes it does not take."""
    r, nh, hd = q.shape
    nkv = k.shape[1]
    q = q if q.stride(2) == 1 else q.contiguous()
    if nh % nkv or nh // nkv > BLOCK_G or hd & (hd - 1) or k.stride() != v.stride() or k.stride(3) != 1:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, k {tuple(k.shape)} strides {k.stride()}")
    out = torch.empty(r, nh, hd, dtype=q.dtype, device=q.device)
    _kernel()[(r, nkv)](q, k, v, lengths, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                        out.stride(0), out.stride(1), scale, GROUP=nh // nkv, BLOCK_G=BLOCK_G, HEAD_DIM=hd,
                        BLOCK_N=BLOCK_N)
    return out
