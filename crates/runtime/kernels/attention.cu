// RoPE + KV-cache write, and attention over the paged KV cache; CPU twins in src/ops/attention.rs
// (kv_write, paged_attention), src/ops/rope.rs and src/ops/norm.rs (head_rms_norm).
//
// Cache layout (as on the CPU): per layer [num_pages, page_size, kv_heads, head_dim] f32; a token's slot is
// page * page_size + offset. Everything a step reads that changes between steps (positions, slots, key
// counts, tiles, block tables) is in device memory, so a step can be captured into a CUDA graph once and
// replayed with new inputs.

// One row of a fused q|k|v projection [rows, qkv_ld]: optional per-head RMSNorm of the q and k heads
// (Qwen3), RoPE of q (into q_out [rows, num_heads * head_dim]) and k, and the k and v heads written to
// their cache slot. Bit-identical to the CPU's head_rms_norm + rope + kv_write except for the order of the
// norm's sum of squares. A position >= max_pos turns the rotated dims into NaN (as the rope kernel); a slot
// >= num_slots is not written (the CPU op rejects it; a kernel cannot).
// Grid: (rows, head groups of ROPE_KV_WARPS), one warp per head. head_dim <= ROPE_KV_MAX_DIM.
#define ROPE_KV_WARPS 8
#define ROPE_KV_MAX_DIM 256

// One head of a q|k|v row by a whole warp: the head's D values from `src`, RMS-normalised with `norm` when it
// is not null, then rotated at `pos`, into `dst`. `buf` (D floats of the warp's shared memory) holds the
// normalised values; it may be `dst` (each lane reads and writes the same pairs, no other lane's).
__device__ __forceinline__ void rope_head(const float* __restrict__ src, float* buf, float* dst,
                                          const float* __restrict__ norm, float eps, u32 D, u32 pos,
                                          const float* __restrict__ cos_tab, const float* __restrict__ sin_tab,
                                          u32 half, u32 max_pos, u32 interleaved) {
    const u32 lane = threadIdx.x & 31u;
    float ss = 0.0f;
#pragma unroll 4
    for (u32 d = lane; d < D; d += 32) {
        const float v = src[d];
        buf[d] = v;
        ss = fmaf(v, v, ss);
    }
    if (norm != nullptr) {
        const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)D + eps);
        for (u32 d = lane; d < D; d += 32) buf[d] = __fmul_rn(__fmul_rn(buf[d], inv), norm[d]);
    }
    __syncwarp();
    for (u32 p = lane; p < half; p += 32) {
        const u32 a = interleaved ? 2 * p : p;
        const u32 b = a + (interleaved ? 1 : half);
        if (pos >= max_pos) {
            dst[a] = DF_NAN;
            dst[b] = DF_NAN;
            continue;
        }
        const float c = cos_tab[(u64)pos * half + p];
        const float s = sin_tab[(u64)pos * half + p];
        const float x1 = buf[a], x2 = buf[b];
        dst[a] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
        dst[b] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
    }
    for (u32 d = 2 * half + lane; d < D; d += 32) dst[d] = buf[d];
    __syncwarp();
}

extern "C" __global__ void __launch_bounds__(ROPE_KV_WARPS * 32)
    rope_kv_write(const float* __restrict__ qkv, u32 qkv_ld, float* __restrict__ q_out, float* __restrict__ k_cache,
                  float* __restrict__ v_cache, const u32* __restrict__ positions, const u32* __restrict__ slots,
                  const float* __restrict__ cos_tab, const float* __restrict__ sin_tab, u32 half, u32 max_pos,
                  u32 interleaved, const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                  u32 num_heads, u32 kv_heads, u32 head_dim, u32 num_slots) {
    DF_GRID_DEPENDENCY();
    __shared__ float heads[ROPE_KV_WARPS][ROPE_KV_MAX_DIM];
    const u64 row = blockIdx.x;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 pos = positions[row];
    const u64 slot = slots[row];
    const u32 D = head_dim;
    const float* src_row = qkv + row * qkv_ld;
    const u32 heads_total = slot < num_slots ? num_heads + 2 * kv_heads : num_heads;
    for (u32 h = blockIdx.y * ROPE_KV_WARPS + warp; h < heads_total; h += gridDim.y * ROPE_KV_WARPS) {
        const float* src = src_row + (u64)h * D;
        if (h >= num_heads + kv_heads) {
            float* dst = v_cache + (slot * kv_heads + (h - num_heads - kv_heads)) * D;
#pragma unroll 4
            for (u32 d = lane; d < D; d += 32) dst[d] = src[d];
            continue;
        }
        const bool is_q = h < num_heads;
        float* dst = is_q ? q_out + row * num_heads * D + (u64)h * D : k_cache + (slot * kv_heads + (h - num_heads)) * D;
        rope_head(src, heads[warp], dst, is_q ? q_norm : k_norm, eps, D, pos, cos_tab, sin_tab, half, max_pos,
                  interleaved);
    }
}

// rope_kv_write folded into the split-key attention of decode and verify tiles (paged_attention_rope*): the
// inputs of rope_kv_write that the attention does not take. Laid out as RopeFoldArg in ops/attention.rs.
struct RopeFold {
    const float* qkv;
    const u32* positions;
    const u32* slots;
    const float* cos_tab;
    const float* sin_tab;
    const float* q_norm;  // null: no head norm
    const float* k_norm;
    float* k_out;  // the layer's K and V caches, written (the attention reads them through its own pointers)
    float* v_out;
    u32 qkv_ld, half, max_pos, interleaved, num_slots;
    float eps;
    u32 max_seq_rows;  // the most rows a sequence has in the step (<= ATTN_MAX_SEQ_ROWS; sizes shared memory)
};
static_assert(sizeof(RopeFold) == 104, "RopeFoldArg in ops/attention.rs has this layout");

// Attention of query rows over their sequence's paged K/V, flash style (online softmax, no score matrix).
//
// A work item (block) is one tile of a sequence's consecutive rows x one kv head x one key split. The tile's
// query vectors are its rows x the `group` query heads that share the kv head (GQA; at most ATTN_MAXQ), so
// K and V are read once for all of them. tiles[4 * i .. +4] = (sequence, first batch row, rows, first
// partial row); a tile of 0 rows is unused. Row t attends keys 0 .. row_keys[t] - 1 of its sequence
// (causal: its position + 1; non-causal: the block's end).
//
// Keys go through shared memory in chunks of ATTN_KT: the chunk's slots are looked up once, then every
// thread issues all of its K/V loads before storing any (one memory round trip per chunk). Warp w owns
// query vectors w and w + 8; a lane scores one key of the chunk, and the warp keeps an online softmax
// state per vector. Device data is checked: a page >= num_pages or a key past the block table's row reads
// as NaN; a tile naming a sequence >= num_seqs or rows past num_rows is skipped.
//
// Two modes, so that a row's result depends only on its own keys, never on how rows were batched:
// * split_keys == 0 (prompt rows): one block per (tile, kv head) takes all keys and writes the normalised
//   output to out [T, num_heads * head_dim];
// * split_keys > 0, a multiple of ATTN_KT (decode / verify rows): split s takes keys
//   [s * split_keys, (s + 1) * split_keys) and writes its unnormalised state (acc, max, sum) to
//   part_acc [P, num_heads, gridDim.z, head_dim] and part_ml [P, num_heads, gridDim.z, 2] at partial row
//   (first partial row + r); attn_merge_splits, launched next, merges each row's splits in order
//   (flash-decoding: a decode step has too few (row, kv head) items to fill the GPU without splitting).
//   (It had been done by the last split block of each (tile, kv head), one block looping over 1,024 splits
//   at a 32K context: the H200's 32K decode step took 6.55 ms where the rest of it takes about 2.5.)
//   split_keys == ATTN_SPLIT_SCALED: the split grows with the row's keys (attn_split_keys of the tile's first
//   row: the planner keeps rows of one tile in one size class), C / 2 to C splits a row once its keys pass C
//   chunks, so long contexts neither launch thousands of tiny blocks nor merge thousands of states. A row's
//   cut points still depend only on its own key count (and the model's KV heads).
//
// head_dim: a multiple of 4, at most 32 * DPL, DPL (dims per lane) being the body's template bound, so
// that the accumulators stay in registers: paged_attention (DPL 4) takes head_dim <= 128,
// paged_attention_d256 (DPL 8) head_dim <= 256 (Qwen3-Next); the launcher picks by head_dim. Dynamic
// shared memory (floats): nq * D + ATTN_KT * (D + 4) + ATTN_KT * D: at most 41,472 bytes for head_dim 128,
// 82,432 for 256; with RoPE folded in, 2 * max_seq_rows * D more for the new keys (attention_rope_fits in
// ops/attention.rs keeps the total within the launch's limit).
#define ATTN_WARPS 8
#define ATTN_KT 32
#define ATTN_MAXQ 16
#define ATTN_VPW 2
#define ATTN_NO_SLOT 0xffffffffu
#define ATTN_MAX_SEQ_ROWS 64  // ATTN_ROPE_MAX_SEQ_ROWS in ops/attention.rs
#define ATTN_SPLIT_SCALED 0xffffffffu  // ATTN_SPLIT_SCALED in ops/attention.rs
#define ATTN_SPLIT_MAX 512             // ATTN_SPLIT_MAX_KEYS in ops/attention.rs

// Keys per split of a row of `keys` keys under ATTN_SPLIT_SCALED, for a model of `kv_heads` KV heads: ATTN_KT
// while the row has at most C splits, doubling with every doubling of the keys, at most ATTN_SPLIT_MAX; C = 32
// for 8 or more KV heads, doubled while C * kv_heads < 256 (the row's split blocks fill the GPU). Twin:
// attn_split_keys in ops/attention.rs.
__device__ __forceinline__ u32 attn_split_keys(u32 keys, u32 kv_heads) {
    u32 most = 32u;
    for (u32 k = max(kv_heads, 1u); k < 8u; k *= 2u) most *= 2u;
    u32 split = ATTN_KT;
    while (split < ATTN_SPLIT_MAX && keys > most * split) split *= 2u;
    return split;
}

// The merge of split-key attention (a launch after paged_attention's split mode): block (tile, head, z) merges
// rows z, z + gridDim.z, ... of the tile (the host launches a z per row of its largest tile, so a verify's rows
// merge side by side), each over that head's splits in order: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M)
// l_s, M the largest m_s. Thread d owns output dim d; the splits' weights go through shared memory in chunks
// of the block's width. A row's result depends only on its own splits, in split order. Memory: the partial
// states once (splits x head_dim x 4 bytes per row and head), spread over tiles x heads blocks.
#define MERGE_THREADS 256
#define MERGE_PRELOAD 16 // partial accumulators of the first splits loaded beside the maxima (one round trip)
extern "C" __global__ void __launch_bounds__(MERGE_THREADS)
    attn_merge_splits(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                      const u32* __restrict__ row_keys, const u32* __restrict__ tiles, float* __restrict__ out,
                      u32 num_heads, u32 kv_heads, u32 head_dim, u32 split_keys, u32 max_splits, u32 num_seqs,
                      u32 num_rows) {
    __shared__ float w_s[MERGE_THREADS], l_s[MERGE_THREADS], scratch[32];
    const u32* tile = tiles + 4 * blockIdx.x;  // the step's inputs: read while the attention finishes
    const u32 seq = tile[0], row0 = tile[1], nrows = tile[2], part0 = tile[3];
    // Tiles paged_attention skips are skipped; the first row's key count is a step input too.
    const bool skip = nrows == 0 || seq >= num_seqs || row0 >= num_rows || nrows > num_rows - row0;
    const u32 z = blockIdx.z;
    const u32 first_keys = skip || z >= nrows ? 0u : row_keys[row0];
    const u32 z_keys = skip || z >= nrows ? 0u : row_keys[row0 + z];
    const u32 sk = split_keys == ATTN_SPLIT_SCALED ? attn_split_keys(first_keys, kv_heads) : split_keys;
    DF_GRID_DEPENDENCY();
    if (skip) return;
    const u32 head = blockIdx.y, D = head_dim, t = threadIdx.x;
    for (u32 r = z; r < nrows; r += gridDim.z) {
        const u64 item0 = ((u64)(part0 + r) * num_heads + head) * max_splits;
        const u32 splits = min(max_splits, ((r == z ? z_keys : row_keys[row0 + r]) + sk - 1) / sk);
        // One round trip for what the first chunk needs: thread t's split state (m, l) and, for its dim, the first
        // splits' accumulators; the rest of a long row's states are read as before.
        float2 ml = make_float2(DF_NEG_INF, 0.0f);
        if (t < splits) ml = *reinterpret_cast<const float2*>(part_ml + 2 * (item0 + t));
        const u32 n0 = min(MERGE_THREADS, splits);
        float a_pre[MERGE_PRELOAD];
#pragma unroll
        for (u32 j = 0; j < MERGE_PRELOAD; ++j) a_pre[j] = t < D && j < n0 ? part_acc[(item0 + j) * D + t] : 0.0f;
        float mx = ml.x;
        for (u32 s = t + MERGE_THREADS; s < splits; s += MERGE_THREADS) mx = fmaxf(mx, part_ml[2 * (item0 + s)]);
        // Block max (exact in any order); scratch is reused by the next row only after the chunk barriers.
        mx = warp_max(mx);
        if ((t & 31u) == 0) scratch[t >> 5] = mx;
        __syncthreads();
        mx = DF_NEG_INF;
        for (u32 i = 0; i < MERGE_THREADS / 32; ++i) mx = fmaxf(mx, scratch[i]);
        float sum = 0.0f, acc = 0.0f;
        for (u32 c = 0; c < splits; c += MERGE_THREADS) {
            __syncthreads();  // the previous chunk's weights (and the max's scratch) are read
            const u32 s = c + t;
            float w = 0.0f, l = 0.0f;
            if (s < splits) {
                const float2 v = c == 0 ? ml : *reinterpret_cast<const float2*>(part_ml + 2 * (item0 + s));
                w = (v.x == DF_NEG_INF || mx == DF_NEG_INF) ? 0.0f : expf(v.x - mx);
                l = v.y;
            }
            w_s[t] = w;
            l_s[t] = l;
            __syncthreads();
            const u32 n = min(MERGE_THREADS, splits - c);
            if (t < D) {
                u32 j = 0;
                if (c == 0) {
#pragma unroll
                    for (u32 q = 0; q < MERGE_PRELOAD; ++q) {
                        if (q < n) {
                            sum = fmaf(w_s[q], l_s[q], sum);
                            acc = fmaf(w_s[q], a_pre[q], acc);
                        }
                    }
                    j = min(n, (u32)MERGE_PRELOAD);
                }
                const float* a = part_acc + (item0 + c) * D + t;
#pragma unroll 8
                for (; j < n; ++j) {
                    sum = fmaf(w_s[j], l_s[j], sum);
                    acc = fmaf(w_s[j], a[(u64)j * D], acc);
                }
            }
        }
        if (t < D) out[(u64)(row0 + r) * num_heads * D + (u64)head * D + t] = sum > 0.0f ? acc / sum : 0.0f;
        __syncthreads();  // scratch and the weights are free for the block's next row
    }
}

// The step's rows under ROPE: the tile's q vectors normalised and rotated from the raw q|k|v rows into qs, and
// for every row of the tile's sequence in this step (srows rows from batch row srow0: the sequence may span
// several tiles) whose key lies in this block's split, its rotated K and its V into new_k / new_v ([srows, D]
// of shared memory) and, by the blocks of the row's own tile, into the cache (rf.k_out / rf.v_out). tkey[r]:
// the key of the sequence's row r. rope_head does what rope_kv_write does, so the bits are the same.
__device__ __forceinline__ void attention_rope_rows(const RopeFold& rf, u32 row0, u32 nrows, u32 srow0, u32 srows,
                                                    u32 nq, u32 group, u32 kvh, u32 num_heads, u32 kv_heads, u32 D,
                                                    u32 k_begin, u32 k_end, float* qs, float* new_k, float* new_v,
                                                    const u32* tkey) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (u32 v = warp; v < nq; v += ATTN_WARPS) {
        const u32 r = v / group, head = kvh * group + (v - r * group), row = row0 + r;
        const float* src = rf.qkv + (u64)row * rf.qkv_ld + (u64)head * D;
        rope_head(src, qs + v * D, qs + v * D, rf.q_norm, rf.eps, D, rf.positions[row], rf.cos_tab, rf.sin_tab,
                  rf.half, rf.max_pos, rf.interleaved);
    }
    // New keys from the last warp down, so that a decode tile's q heads (the first warps) and its key are made at
    // once; the V row is loaded beside the K row, not after its rotation.
    for (u32 r = ATTN_WARPS - 1u - warp; r < srows; r += ATTN_WARPS) {
        const u32 row = srow0 + r, key = tkey[r];
        if (key < k_begin || key >= k_end) continue;  // another split's key (uniform per warp)
        const float* src = rf.qkv + (u64)row * rf.qkv_ld + (u64)(num_heads + kvh) * D;
        float *nk = new_k + r * D, *nv = new_v + r * D;
        const float* vsrc = src + (u64)kv_heads * D;
        float vr[ROPE_KV_MAX_DIM / 32];
#pragma unroll
        for (u32 j = 0; j < ROPE_KV_MAX_DIM / 32; ++j) vr[j] = lane + 32u * j < D ? vsrc[lane + 32u * j] : 0.0f;
        rope_head(src, nk, nk, rf.k_norm, rf.eps, D, rf.positions[row], rf.cos_tab, rf.sin_tab, rf.half, rf.max_pos,
                  rf.interleaved);
#pragma unroll
        for (u32 j = 0; j < ROPE_KV_MAX_DIM / 32; ++j) {
            if (lane + 32u * j < D) nv[lane + 32u * j] = vr[j];
        }
        __syncwarp();
        const u64 slot = rf.slots[row];
        // Another tile's row is written by that tile's blocks; past the cache, as rope_kv_write, by none.
        if (row < row0 || row >= row0 + nrows || slot >= rf.num_slots) continue;
        const u64 off = (slot * kv_heads + kvh) * D;
        for (u32 d = lane; d < D; d += 32) {
            rf.k_out[off + d] = nk[d];
            rf.v_out[off + d] = nv[d];
        }
    }
}

// One head in registers, for NeoX RoPE over the whole head (N * 32 dims, N even): lane l holds dims l + 32j in
// x[j], so each rotation pair (p, p + half) is x[j], x[j + N / 2] of one lane. rope_head's operations in its order
// (the same bits): the sum of squares over j, the norm's scale, then the rotation by c, s (the lane's cos / sin at
// dims l + 32j, j < N / 2; `bad`: a position past the table, NaN). The mean's division by the constant 32N may
// become a multiplication fused with the + eps; the scaling by a power of two is exact, so the bits differ from
// rope_head's only for a sum of squares below 2^-119 (a subnormal mean).
template <u32 N>
__device__ __forceinline__ void rope_lanes(float* x, const float* nw, bool norm, float eps, const float* c,
                                           const float* s, bool bad) {
    float ss = 0.0f;
#pragma unroll
    for (u32 j = 0; j < N; ++j) ss = fmaf(x[j], x[j], ss);
    if (norm) {
        const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)(32 * N) + eps);
#pragma unroll
        for (u32 j = 0; j < N; ++j) x[j] = __fmul_rn(__fmul_rn(x[j], inv), nw[j]);
    }
#pragma unroll
    for (u32 j = 0; j < N / 2; ++j) {
        const float x1 = x[j], x2 = x[j + N / 2];
        x[j] = bad ? DF_NAN : __fsub_rn(__fmul_rn(x1, c[j]), __fmul_rn(x2, s[j]));
        x[j + N / 2] = bad ? DF_NAN : __fadd_rn(__fmul_rn(x2, c[j]), __fmul_rn(x1, s[j]));
    }
}

// The cos / sin of the lane's rotation pairs at `pos` (none past the table).
template <u32 N>
__device__ __forceinline__ void rope_lane_table(const RopeFold& rf, u32 pos, float* c, float* s) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 j = 0; j < N / 2; ++j) {
        const u64 at = (u64)pos * rf.half + lane + 32u * j;
        c[j] = pos < rf.max_pos ? rf.cos_tab[at] : 0.0f;
        s[j] = pos < rf.max_pos ? rf.sin_tab[at] : 0.0f;
    }
}

// attention_rope_rows for heads of N * 32 dims under NeoX RoPE over the whole head (rope_lanes): in round i, warp w
// takes q vector w + 8i and the new key of sequence row 7 - w + 8i (as attention_rope_rows does, a decode tile's q
// heads and its key go to different warps), loading both heads' values, the key's V and slot, the norm weights and
// the cos / sin at once: one memory round trip per round where rope_head takes one per head and more. The bits are
// attention_rope_rows'.
template <u32 N>
__device__ __forceinline__ void attention_rope_rows_lanes(const RopeFold& rf, u32 row0, u32 nrows, u32 srow0,
                                                          u32 srows, u32 nq, u32 group, u32 kvh, u32 num_heads,
                                                          u32 kv_heads, u32 k_begin, u32 k_end, float* qs,
                                                          float* new_k, float* new_v, const u32* tkey) {
    constexpr u32 D = 32 * N;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 rounds = max((nq + ATTN_WARPS - 1) / ATTN_WARPS, (srows + ATTN_WARPS - 1) / ATTN_WARPS);
    for (u32 i = 0; i < rounds; ++i) {
        const u32 v = warp + ATTN_WARPS * i, r = ATTN_WARPS - 1u - warp + ATTN_WARPS * i;
        const bool has_q = v < nq;  // both uniform across the warp
        const bool has_k = r < srows && tkey[r] >= k_begin && tkey[r] < k_end;
        float xq[N], xk[N], xv[N], nwq[N], nwk[N], cq[N / 2], sq[N / 2], ck[N / 2], sk[N / 2];
        u32 pos_q = 0, pos_k = 0, krow = 0;
        u64 slot = ~0ull;
        if (has_q) {
            const u32 qr = v / group, head = kvh * group + (v - qr * group);
            const float* src = rf.qkv + (u64)(row0 + qr) * rf.qkv_ld + (u64)head * D;
#pragma unroll
            for (u32 j = 0; j < N; ++j) xq[j] = src[lane + 32u * j];
            pos_q = rf.positions[row0 + qr];
            rope_lane_table<N>(rf, pos_q, cq, sq);
        }
        if (has_k) {
            krow = srow0 + r;
            const float* src = rf.qkv + (u64)krow * rf.qkv_ld + (u64)(num_heads + kvh) * D;
#pragma unroll
            for (u32 j = 0; j < N; ++j) {
                xk[j] = src[lane + 32u * j];
                xv[j] = src[(u64)kv_heads * D + lane + 32u * j];
            }
            pos_k = rf.positions[krow];
            rope_lane_table<N>(rf, pos_k, ck, sk);
            slot = rf.slots[krow];
        }
#pragma unroll
        for (u32 j = 0; j < N; ++j) {
            nwq[j] = rf.q_norm != nullptr ? rf.q_norm[lane + 32u * j] : 1.0f;
            nwk[j] = rf.k_norm != nullptr ? rf.k_norm[lane + 32u * j] : 1.0f;
        }
        if (has_q) {
            rope_lanes<N>(xq, nwq, rf.q_norm != nullptr, rf.eps, cq, sq, pos_q >= rf.max_pos);
#pragma unroll
            for (u32 j = 0; j < N; ++j) qs[v * D + lane + 32u * j] = xq[j];
        }
        if (!has_k) continue;
        rope_lanes<N>(xk, nwk, rf.k_norm != nullptr, rf.eps, ck, sk, pos_k >= rf.max_pos);
#pragma unroll
        for (u32 j = 0; j < N; ++j) {
            new_k[r * D + lane + 32u * j] = xk[j];
            new_v[r * D + lane + 32u * j] = xv[j];
        }
        // Another tile's row is written by that tile's blocks; past the cache, as rope_kv_write, by none.
        if (krow < row0 || krow >= row0 + nrows || slot >= rf.num_slots) continue;
        const u64 off = (slot * kv_heads + kvh) * D;
#pragma unroll
        for (u32 j = 0; j < N; ++j) {
            rf.k_out[off + lane + 32u * j] = xk[j];
            rf.v_out[off + lane + 32u * j] = xv[j];
        }
    }
}

// Under ROPE, before the grid dependency wait: the cos / sin table lines of the sequence's rows in this step (the
// rows' positions are step inputs) toward L1, so rope_head does not wait on them after it.
__device__ __forceinline__ void rope_prefetch_tables(const RopeFold& rf, u32 srow0, u32 srows) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, lines = (rf.half + 31u) / 32u;
    if (lane >= 2u * lines) return;
    const float* table = lane < lines ? rf.cos_tab : rf.sin_tab;
    const u32 line = lane < lines ? lane : lane - lines;
    for (u32 r = warp; r < srows; r += ATTN_WARPS) {
        const u32 pos = rf.positions[srow0 + r];
        if (pos >= rf.max_pos) continue;
        asm volatile("prefetch.global.L1 [%0];" ::"l"(table + (u64)pos * rf.half + 32u * line));
    }
}

// The batch rows of the tile's sequence in this step, under ROPE: [srow0, srow0 + srows) spans every tile of the
// sequence (its rows are consecutive in the batch; tiles that fail the checks the block's own passed are left
// out), and tkey[r] = the key of row srow0 + r (its last: decode and verify rows are causal; 0 keys: none,
// 0xffffffff). Returns false, with no span, when the sequence has more rows than rf.max_seq_rows (the shared
// memory's size): the host plans it exactly, so that is a broken launch, and the caller poisons its rows.
__device__ __forceinline__ bool attention_rope_span(const RopeFold& rf, const u32* __restrict__ tiles,
                                                    const u32* __restrict__ row_keys, u32 seq, u32 row0, u32 nrows,
                                                    u32 num_seqs, u32 num_rows, u32* span, u32* tkey) {
    const u32 lane = threadIdx.x & 31u;
    if (threadIdx.x < 32) {
        u32 lo = row0, hi = row0 + nrows;
        for (u32 t = lane; t < gridDim.x; t += 32) {
            const u32* o = tiles + 4 * t;
            if (o[0] == seq && seq < num_seqs && o[2] > 0 && o[1] < num_rows && o[2] <= num_rows - o[1]) {
                lo = min(lo, o[1]);
                hi = max(hi, o[1] + o[2]);
            }
        }
        lo = __reduce_min_sync(DF_FULL_MASK, lo);
        hi = __reduce_max_sync(DF_FULL_MASK, hi);
        if (lane == 0) {
            span[0] = lo;
            span[1] = hi - lo;
        }
    }
    __syncthreads();
    if (span[1] > rf.max_seq_rows) return false;  // uniform: read after the barrier
    for (u32 r = threadIdx.x; r < span[1]; r += blockDim.x) tkey[r] = row_keys[span[0] + r] - 1;
    return true;
}

// The body of the paged_attention kernels; DPL: head dims per lane, head_dim <= 32 * DPL; HD: head_dim fixed at compile
// time (0: the argument), so that the chunk's load indices, the dot product's trip count and the lanes' dim checks fold
// to constants (Qwen3's and Llama's 128: a quarter fewer instructions in the kernel). With ROPE (decode and verify
// tiles only, split_keys > 0), `q` is not read: the block rotates its rows' q itself and takes their new keys from
// shared memory (attention_rope_rows). The cache is written in this launch (through rf.k_out / v_out) while k_cache /
// v_cache are read as restrict pointers; that holds because no block reads through them an element any block writes:
// every key a block's rows see that this step writes is a key of its own sequence's rows, all of which
// attention_rope_span puts in shared memory (padded graph sequences included: their keys are all their own rows'), and
// a span that does not fit aborts the block before any read.
//
// The grid dependency wait (prelude.cuh) comes late: the tile, key counts, block table, slots and positions are the
// step's inputs, which the host wrote before the step, so the block reads them, and under ROPE the first chunk's
// cached K/V (written by earlier steps; this step's keys come from shared memory), while the matmul before it is
// still finishing. Only q|k|v (ROPE), or q and the new cache rows (rope_kv_write before it), wait. Every block
// waits before it exits, so the launch never completes before the kernel it depends on.
template <u32 DPL, bool ROPE, u32 HD>
__device__ __forceinline__ void paged_attention_body(
    const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache,
    const u32* __restrict__ row_keys, const u32* __restrict__ tiles, const u32* __restrict__ tables,
    float* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml, u32 num_heads, u32 kv_heads,
    u32 head_dim, u32 page_size, u32 table_stride, float scale, u32 split_keys, u32 num_pages, u32 num_seqs,
    u32 num_rows, const RopeFold& rf) {
    // float4 loads of K (and of V) per thread per chunk: ATTN_KT keys of up to 32 * DPL floats.
    constexpr u32 LOADS = ATTN_KT * 32 * DPL / 4 / (ATTN_WARPS * 32);
    static_assert(LOADS * 4 * ATTN_WARPS * 32 == ATTN_KT * 32 * DPL, "a chunk is whole float4 loads per thread");
    extern __shared__ float4 attn_smem[];
    __shared__ u32 slots[ATTN_KT];
    __shared__ int new_key[ATTN_KT];  // ROPE: the sequence row whose new key chunk key c is, or -1
    __shared__ u32 tkey[ATTN_MAX_SEQ_ROWS], span[2];
    const u32* tile = tiles + 4 * blockIdx.x;
    const u32 seq = tile[0], row0 = tile[1], nrows = tile[2], part0 = tile[3];
    if (nrows == 0 || seq >= num_seqs || row0 >= num_rows || nrows > num_rows - row0) {
        DF_GRID_DEPENDENCY();  // every block waits before it exits (see the wait below)
        return;
    }
    const u32 kvh = blockIdx.y, split = blockIdx.z;
    const u32 D = HD != 0 ? HD : head_dim, D4 = D >> 2;
    const u32 group = num_heads / kv_heads, nq = min(nrows * group, ATTN_MAXQ);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u64 q_ld = (u64)num_heads * D;
    const u32 k_ld = D + 4;  // padded: the score loop's 16-byte reads of 32 key rows hit distinct banks
    float* qs = reinterpret_cast<float*>(attn_smem);
    float* ks = qs + nq * D;
    float* vs = ks + ATTN_KT * k_ld;

    u32 kmax = 0;
    for (u32 r = 0; r < nrows; ++r) kmax = max(kmax, row_keys[row0 + r]);
    // The tile's keys per split (its rows share one size class under ATTN_SPLIT_SCALED).
    const u32 sk = split_keys == ATTN_SPLIT_SCALED ? attn_split_keys(row_keys[row0], kv_heads) : split_keys;
    const u32 k_begin = split_keys == 0 ? 0 : split * sk;
    const u32 k_end = split_keys == 0 ? kmax : min(kmax, k_begin + sk);
    if (split_keys != 0 && k_begin >= kmax) {  // no row of the tile has keys here; the merge skips it
        DF_GRID_DEPENDENCY();
        return;
    }

    // ROPE: the new keys' K and V after the V chunk, one row of each per row of the sequence.
    float* new_k = vs + ATTN_KT * D;
    float* new_v = new_k + rf.max_seq_rows * D;
    if (ROPE) {
        if (!attention_rope_span(rf, tiles, row_keys, seq, row0, nrows, num_seqs, num_rows, span, tkey)) {
            // A sequence longer than the launch planned for: this block's partial states become NaN rather than
            // reading keys another block may be writing. (The merge's maximum skips NaN and its sums then fail the
            // `> 0` test, so these rows come out as zeros, not NaN.)
            DF_GRID_DEPENDENCY();
            for (u32 i = threadIdx.x; i < nq; i += blockDim.x) {
                const u32 r = i / group, head = kvh * group + (i - r * group);
                const u64 item = ((u64)(part0 + r) * num_heads + head) * gridDim.z + split;
                part_ml[2 * item] = part_ml[2 * item + 1] = DF_NAN;
            }
            return;
        }
        rope_prefetch_tables(rf, span[0], span[1]);
    } else {
        DF_GRID_DEPENDENCY();  // q and the cache's new rows come from the kernel before (rope_kv_write)
        for (u32 i = threadIdx.x; i < nq * D; i += blockDim.x) {
            const u32 v = i / D, d = i - v * D;
            const u32 r = v / group, head = kvh * group + (v - r * group);
            qs[i] = q[(row0 + r) * q_ld + (u64)head * D + d];
        }
    }
    float m[ATTN_VPW], l[ATTN_VPW], acc[ATTN_VPW][DPL];
    u32 lim[ATTN_VPW];
#pragma unroll
    for (u32 vi = 0; vi < ATTN_VPW; ++vi) {
        const u32 i = warp + ATTN_WARPS * vi;
        lim[vi] = i < nq ? row_keys[row0 + i / group] : 0;
        m[vi] = DF_NEG_INF;
        l[vi] = 0.0f;
#pragma unroll
        for (u32 j = 0; j < DPL; ++j) acc[vi][j] = 0.0f;
    }
    const u32* table = tables + (u64)seq * table_stride;
    for (u32 base = k_begin; base < k_end; base += ATTN_KT) {
        __syncthreads();  // the previous chunk (and, the first time, q) is done with / written
        if (threadIdx.x < ATTN_KT) {
            const u32 key = base + threadIdx.x;
            u32 slot = ATTN_NO_SLOT;
            if (key < k_end) {
                const u32 page = key / page_size < table_stride ? table[key / page_size] : num_pages;
                slot = page < num_pages ? page * page_size + key % page_size : ATTN_NO_SLOT - 1;
            }
            slots[threadIdx.x] = slot;
            if (ROPE) {
                int r_new = -1;
                for (u32 r = 0; r < span[1]; ++r) r_new = key < k_end && tkey[r] == key ? (int)r : r_new;
                new_key[threadIdx.x] = r_new;
            }
        }
        __syncthreads();
        float4 kv[LOADS], vv[LOADS];
#pragma unroll
        for (u32 it = 0; it < LOADS; ++it) {
            const u32 e = threadIdx.x + it * blockDim.x;
            const u32 c = e / D4, d4 = e - c * D4;
            kv[it] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            vv[it] = kv[it];
            if (c < ATTN_KT) {
                const u32 slot = slots[c];
                if (ROPE && new_key[c] >= 0) {
                    // made below, from shared memory
                } else if (slot < ATTN_NO_SLOT - 1) {
                    const u64 off = ((u64)slot * kv_heads + kvh) * D + 4 * d4;
                    kv[it] = *reinterpret_cast<const float4*>(k_cache + off);
                    vv[it] = *reinterpret_cast<const float4*>(v_cache + off);
                } else if (slot == ATTN_NO_SLOT - 1) {
                    kv[it] = make_float4(DF_NAN, DF_NAN, DF_NAN, DF_NAN);
                    vv[it] = kv[it];
                }
            }
        }
        if (ROPE && base == k_begin) {
            // While the chunk's cached K/V are in flight: wait for the q|k|v rows of the matmul before, then the
            // rows' q and their new keys, into shared memory.
            DF_GRID_DEPENDENCY();
            // The 128-dim build (Qwen3, Llama 3) takes the register form under NeoX RoPE over the whole head. The
            // 256-dim kernel keeps the other (its registers are the hybrid decode's), and so do 64-dim heads: with
            // the register form for them too, the SmolLM2 shape's step took 2.5% longer and the Qwen3-0.6B's 4%.
            if (HD == 128 && rf.interleaved == 0 && 2u * rf.half == D) {
                attention_rope_rows_lanes<4>(rf, row0, nrows, span[0], span[1], nq, group, kvh, num_heads, kv_heads,
                                             k_begin, k_end, qs, new_k, new_v, tkey);
            } else {
                attention_rope_rows(rf, row0, nrows, span[0], span[1], nq, group, kvh, num_heads, kv_heads, D,
                                    k_begin, k_end, qs, new_k, new_v, tkey);
            }
            __syncthreads();
        }
#pragma unroll
        for (u32 it = 0; it < LOADS; ++it) {
            const u32 e = threadIdx.x + it * blockDim.x;
            const u32 c = e / D4, d4 = e - c * D4;
            if (ROPE && c < ATTN_KT && new_key[c] >= 0) {
                kv[it] = *reinterpret_cast<const float4*>(new_k + new_key[c] * D + 4 * d4);
                vv[it] = *reinterpret_cast<const float4*>(new_v + new_key[c] * D + 4 * d4);
            }
            if (c < ATTN_KT) {
                *reinterpret_cast<float4*>(ks + c * k_ld + 4 * d4) = kv[it];
                *reinterpret_cast<float4*>(vs + c * D + 4 * d4) = vv[it];
            }
        }
        __syncthreads();
        const u32 key = base + lane;
#pragma unroll
        for (u32 vi = 0; vi < ATTN_VPW; ++vi) {
            const u32 i = warp + ATTN_WARPS * vi;
            if (i >= nq) break;  // uniform across the warp
            const float4* qv = reinterpret_cast<const float4*>(qs + i * D);
            const float4* kr = reinterpret_cast<const float4*>(ks + lane * k_ld);
            float s = 0.0f;
#pragma unroll 4
            for (u32 d4 = 0; d4 < D4; ++d4) {
                const float4 a = qv[d4], b = kr[d4];
                s = fmaf(a.x, b.x, s);
                s = fmaf(a.y, b.y, s);
                s = fmaf(a.z, b.z, s);
                s = fmaf(a.w, b.w, s);
            }
            const bool valid = key < k_end && key < lim[vi];
            s = valid ? s * scale : DF_NEG_INF;
            const float m_new = fmaxf(m[vi], warp_max(s));
            float p = 0.0f, alpha = 1.0f;
            if (m_new != DF_NEG_INF) {
                p = valid ? expf(s - m_new) : 0.0f;
                alpha = expf(m[vi] - m_new);
            }
            l[vi] = l[vi] * alpha + warp_sum(p);
            m[vi] = m_new;
#pragma unroll
            for (u32 j = 0; j < DPL; ++j) acc[vi][j] *= alpha;
#pragma unroll 8
            for (u32 c = 0; c < ATTN_KT; ++c) {
                const float pc = __shfl_sync(DF_FULL_MASK, p, c);
#pragma unroll
                for (u32 j = 0; j < DPL; ++j) {
                    const u32 d = lane + 32 * j;
                    if (d < D) acc[vi][j] = fmaf(pc, vs[c * D + d], acc[vi][j]);
                }
            }
        }
    }
#pragma unroll
    for (u32 vi = 0; vi < ATTN_VPW; ++vi) {
        const u32 i = warp + ATTN_WARPS * vi;
        if (i >= nq) break;
        const u32 r = i / group, head = kvh * group + (i - r * group);
        if (split_keys == 0) {
            float* dst = out + (row0 + r) * q_ld + (u64)head * D;
#pragma unroll
            for (u32 j = 0; j < DPL; ++j) {
                const u32 d = lane + 32 * j;
                if (d < D) dst[d] = l[vi] > 0.0f ? acc[vi][j] / l[vi] : 0.0f;
            }
        } else {
            const u64 item = ((u64)(part0 + r) * num_heads + head) * gridDim.z + split;
#pragma unroll
            for (u32 j = 0; j < DPL; ++j) {
                const u32 d = lane + 32 * j;
                if (d < D) part_acc[item * D + d] = acc[vi][j];
            }
            if (lane == 0) {
                part_ml[2 * item] = m[vi];
                part_ml[2 * item + 1] = l[vi];
            }
        }
    }
}

#define PAGED_ATTENTION_KERNEL(NAME, DPL)                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                                  \
        NAME(const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache,     \
             const u32* __restrict__ row_keys, const u32* __restrict__ tiles, const u32* __restrict__ tables,      \
             float* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml, u32 num_heads,     \
             u32 kv_heads, u32 head_dim, u32 page_size, u32 table_stride, float scale, u32 split_keys,             \
             u32 num_pages, u32 num_seqs, u32 num_rows) {                                                          \
        const RopeFold none = {};                                                                                  \
        paged_attention_body<DPL, false, 0>(q, k_cache, v_cache, row_keys, tiles, tables, out, part_acc, part_ml,  \
                                            num_heads, kv_heads, head_dim, page_size, table_stride, scale,         \
                                            split_keys, num_pages, num_seqs, num_rows, none);                      \
    }

// paged_attention with rope_kv_write folded in (RopeFold): one launch fewer per layer of a decode or verify step.
#define PAGED_ATTENTION_ROPE_KERNEL(NAME, DPL, HD)                                                                 \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)                                                  \
        NAME(const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache,     \
             const u32* __restrict__ row_keys, const u32* __restrict__ tiles, const u32* __restrict__ tables,      \
             float* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml, u32 num_heads,     \
             u32 kv_heads, u32 head_dim, u32 page_size, u32 table_stride, float scale, u32 split_keys,             \
             u32 num_pages, u32 num_seqs, u32 num_rows, RopeFold rf) {                                             \
        paged_attention_body<DPL, true, HD>(q, k_cache, v_cache, row_keys, tiles, tables, out, part_acc, part_ml,  \
                                            num_heads, kv_heads, head_dim, page_size, table_stride, scale,         \
                                            split_keys, num_pages, num_seqs, num_rows, rf);                        \
    }

PAGED_ATTENTION_ROPE_KERNEL(paged_attention_rope, 4, 0)
PAGED_ATTENTION_ROPE_KERNEL(paged_attention_rope_d256, 8, 0)
PAGED_ATTENTION_ROPE_KERNEL(paged_attention_rope_hd128, 4, 128)  // head_dim == 128
PAGED_ATTENTION_ROPE_KERNEL(paged_attention_rope_hd64, 2, 64)    // head_dim == 64 (SmolLM2)
PAGED_ATTENTION_KERNEL(paged_attention, 4)       // head_dim <= 128
PAGED_ATTENTION_KERNEL(paged_attention_d256, 8)  // 128 < head_dim <= 256
