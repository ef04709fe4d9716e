// Prompt attention on the tensor cores (flash-attention 2 style): q, k and v rounded to bf16, scores and
// outputs accumulated in f32 by mma.m16n8k16, online softmax in f32. For the prompt rows of models whose weights
// are bf16 or quantized: at an 8K prompt the f32 kernel (attention.cu) spends ~93% of the 8B shape's prefill on
// attention, 4 query rows per block on the CUDA cores. f32 models keep the exact kernel (their parity tests ask
// for 5e-6), and decode / verify rows always take it (split keys, batch invariant).
//
// Grid: (tiles, heads); TC_ATT_WARPS warps, warp w owning the tile's rows 16 w .. 16 w + 15 (up to
// TC_ATT_ROWS rows per tile, the tile format of paged_attention: sequence, first row, rows, unused). Row t
// attends keys 0 .. row_keys[t] - 1 of its sequence. Keys go through shared memory in blocks of TC_ATT_KB:
// the block's slots are looked up and its K and V rows copied (cp.async, f32) while the block before it is
// computed on, then converted to bf16, both as [key][dim] rows; each warp runs S = Q K^T (8 key columns per
// mma), masks, rescales its running output, and adds P V, whose B fragments (two consecutive keys of one dim)
// `ldmatrix.trans` reads from the row-major V (a transposing scatter of V cost more than the mma).
// A page past the cache or past the block table reads as NaN, as in paged_attention.
//
// Fragments (PTX mma.m16n8k16 .row.col, g = lane / 4, t = lane % 4): A regs (row g, cols 2t..2t+1),
// (row g + 8, same), (row g, cols 8 + 2t..), (row g + 8, cols 8 + 2t..); B regs (k 2t..2t+1, col g),
// (k 8 + 2t.., col g); C (row g, cols 2t, 2t + 1), (row g + 8, same). The score C fragments of two
// adjacent 8-key tiles are exactly the A fragment of P for one 16-key step.
#define TC_ATT_WARPS 8
#define TC_ATT_ROWS (16 * TC_ATT_WARPS)
#define TC_ATT_KB 64
#define TC_ATT_KPAD 8  // bf16 padding per shared row: 16-byte shift between rows spreads the banks

// Four 8x8 bf16 matrices from shared memory, transposed: lanes 8j..8j+7 give the row addresses of matrix j,
// and each lane gets, per matrix, the two elements (rows 2t, 2t + 1; column g) of it.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const bf16_t* row) {
    const u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 2^x on the special-function unit (2 ulp; the probabilities are rounded to bf16 right after). 2^-inf = 0.
__device__ __forceinline__ float tc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// cp.async of 16 bytes, global to shared, through L2 only.
__device__ __forceinline__ void tc_cp_async16(float* smem, const float* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}

template <u32 D>
__device__ __forceinline__ void tc_attention_body(const float* __restrict__ q, const float* __restrict__ k_cache,
                                                  const float* __restrict__ v_cache,
                                                  const u32* __restrict__ row_keys, const u32* __restrict__ tiles,
                                                  const u32* __restrict__ tables, float* __restrict__ out,
                                                  u32 num_heads, u32 kv_heads, u32 page_size, u32 table_stride,
                                                  float scale, u32 num_pages, u32 num_seqs, u32 num_rows) {
    constexpr u32 KSTEPS = D / 16;  // 16-dim steps of Q K^T
    constexpr u32 DTILES = D / 8;   // 8-dim output tiles of P V
    constexpr u32 KS_LD = D + TC_ATT_KPAD;  // 16-byte aligned rows, 16 bytes apart in the banks (ldmatrix)
    // Dynamic shared memory: the f32 staging of the next block's K and V (cp.async), then the bf16 K and V the
    // mma reads, both [key][KS_LD].
    extern __shared__ float4 tc_smem[];
    float* stage_k = reinterpret_cast<float*>(tc_smem);
    float* stage_v = stage_k + TC_ATT_KB * D;
    bf16_t* ks = reinterpret_cast<bf16_t*>(stage_v + TC_ATT_KB * D);
    bf16_t* vs = ks + TC_ATT_KB * KS_LD;
    __shared__ u32 slots[2][TC_ATT_KB];
    const u32* tile = tiles + 4 * blockIdx.x;
    const u32 seq = tile[0], row0 = tile[1], nrows = tile[2];
    if (nrows == 0 || seq >= num_seqs || row0 >= num_rows || nrows > num_rows - row0) return;
    const u32 head = blockIdx.y, kvh = head / (num_heads / kv_heads);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3u;
    const u64 q_ld = (u64)num_heads * D;
    const u32 rows = min(nrows, (u32)TC_ATT_ROWS);
    // This lane's two rows (g and g + 8 of the warp's 16) and their key limits (0 past the tile).
    const u32 ra = warp * 16 + g, rb = ra + 8;
    const u32 lim_a = ra < rows ? row_keys[row0 + ra] : 0, lim_b = rb < rows ? row_keys[row0 + rb] : 0;
    u32 kmax = 0;
    for (u32 r = 0; r < rows; ++r) kmax = max(kmax, row_keys[row0 + r]);
    // Keys past every row of the warp are skipped (the shuffles below need the whole warp).
    const u32 warp_lim = __reduce_max_sync(DF_FULL_MASK, max(lim_a, lim_b));

    // Q as A fragments, bf16 (rows past the tile are zeros).
    u32 qa[KSTEPS][4];
    {
        const float* qa_row = q + (u64)(row0 + min(ra, rows - 1)) * q_ld + (u64)head * D;
        const float* qb_row = q + (u64)(row0 + min(rb, rows - 1)) * q_ld + (u64)head * D;
        const bool ha = ra < rows, hb = rb < rows;
#pragma unroll
        for (u32 s = 0; s < KSTEPS; ++s) {
            const u32 c0 = 16 * s + 2 * t, c1 = c0 + 8;
            qa[s][0] = ha ? bf16x2_rn(qa_row[c0], qa_row[c0 + 1]) : 0u;
            qa[s][1] = hb ? bf16x2_rn(qb_row[c0], qb_row[c0 + 1]) : 0u;
            qa[s][2] = ha ? bf16x2_rn(qa_row[c1], qa_row[c1 + 1]) : 0u;
            qa[s][3] = hb ? bf16x2_rn(qb_row[c1], qb_row[c1 + 1]) : 0u;
        }
    }
    float o[DTILES][4];
#pragma unroll
    for (u32 n = 0; n < DTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = DF_NEG_INF, m_b = DF_NEG_INF, l_a = 0.0f, l_b = 0.0f;
    const u32* table = tables + (u64)seq * table_stride;

    // The slots of key block `blk` into slots[blk & 1] (threads 0 .. 63).
    auto lookup = [&](u32 blk) {
        if (threadIdx.x < TC_ATT_KB) {
            const u32 key = blk * TC_ATT_KB + threadIdx.x;
            u32 slot = ATTN_NO_SLOT;
            if (key < kmax) {
                const u32 page = key / page_size < table_stride ? table[key / page_size] : num_pages;
                slot = page < num_pages ? page * page_size + key % page_size : ATTN_NO_SLOT - 1;
            }
            slots[blk & 1u][threadIdx.x] = slot;
        }
    };
    // Queues the copies of key block `blk`'s K and V rows into the staging (slots already looked up).
    auto fetch = [&](u32 blk) {
        for (u32 e = threadIdx.x; e < TC_ATT_KB * (D / 4); e += blockDim.x) {
            const u32 c = e / (D / 4), d = 4 * (e - c * (D / 4));
            const u32 slot = slots[blk & 1u][c];
            if (slot < ATTN_NO_SLOT - 1) {
                const u64 off = ((u64)slot * kv_heads + kvh) * D + d;
                tc_cp_async16(stage_k + c * D + d, k_cache + off);
                tc_cp_async16(stage_v + c * D + d, v_cache + off);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    // Scores in the log2 domain: 2^(s log2(e) scale - m) is the softmax's e^(s scale - m'), one SFU op each.
    const float scale2 = scale * 1.4426950408889634f;
    const u32 blocks = (kmax + TC_ATT_KB - 1) / TC_ATT_KB;
    if (blocks > 0) {
        lookup(0);
        __syncthreads();
        fetch(0);
    }
    for (u32 blk = 0; blk < blocks; ++blk) {
        const u32 base = blk * TC_ATT_KB;
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();  // block blk is staged; every warp is done with the previous K and V
        if (blk + 1 < blocks) lookup(blk + 1);
        for (u32 e = threadIdx.x; e < TC_ATT_KB * (D / 4); e += blockDim.x) {
            const u32 c = e / (D / 4), d = 4 * (e - c * (D / 4));
            const u32 slot = slots[blk & 1u][c];
            float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kv;
            if (slot < ATTN_NO_SLOT - 1) {
                kv = *reinterpret_cast<const float4*>(stage_k + c * D + d);
                vv = *reinterpret_cast<const float4*>(stage_v + c * D + d);
            } else if (slot == ATTN_NO_SLOT - 1) {
                kv = make_float4(DF_NAN, DF_NAN, DF_NAN, DF_NAN);
                vv = kv;
            }
            *reinterpret_cast<uint2*>(ks + c * KS_LD + d) = make_uint2(bf16x2_rn(kv.x, kv.y), bf16x2_rn(kv.z, kv.w));
            *reinterpret_cast<uint2*>(vs + c * KS_LD + d) = make_uint2(bf16x2_rn(vv.x, vv.y), bf16x2_rn(vv.z, vv.w));
        }
        __syncthreads();  // K and V are ready, the staging is free and the next slots are in
        if (blk + 1 < blocks) fetch(blk + 1);  // lands while the mma below run
        if (base >= warp_lim) continue;
        // The warp's 16 x 64 scores.
        float s[TC_ATT_KB / 8][4];
#pragma unroll
        for (u32 n = 0; n < TC_ATT_KB / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const bf16_t* krow = ks + (n * 8 + g) * KS_LD;
#pragma unroll
            for (u32 st = 0; st < KSTEPS; ++st) {
                const u32 b0 = *reinterpret_cast<const u32*>(krow + 16 * st + 2 * t);
                const u32 b1 = *reinterpret_cast<const u32*>(krow + 16 * st + 8 + 2 * t);
                mma_bf16_16816(s[n], qa[st][0], qa[st][1], qa[st][2], qa[st][3], b0, b1);
            }
        }
        // Mask, scale, new running maxima.
        float mx_a = m_a, mx_b = m_b;
#pragma unroll
        for (u32 n = 0; n < TC_ATT_KB / 8; ++n) {
            const u32 key = base + n * 8 + 2 * t;
#pragma unroll
            for (u32 j = 0; j < 2; ++j) {
                s[n][j] = key + j < lim_a ? s[n][j] * scale2 : DF_NEG_INF;
                s[n][2 + j] = key + j < lim_b ? s[n][2 + j] * scale2 : DF_NEG_INF;
                mx_a = fmaxf(mx_a, s[n][j]);
                mx_b = fmaxf(mx_b, s[n][2 + j]);
            }
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(DF_FULL_MASK, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(DF_FULL_MASK, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(DF_FULL_MASK, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(DF_FULL_MASK, mx_b, 2));
        const float alpha_a = mx_a == DF_NEG_INF ? 1.0f : tc_exp2(m_a - mx_a);
        const float alpha_b = mx_b == DF_NEG_INF ? 1.0f : tc_exp2(m_b - mx_b);
        m_a = mx_a;
        m_b = mx_b;
        // P (bf16, as A fragments of 16-key steps) and the rows' partial sums.
        u32 pa[TC_ATT_KB / 16][4];
        float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
        for (u32 n = 0; n < TC_ATT_KB / 8; ++n) {
            const float p0 = mx_a == DF_NEG_INF ? 0.0f : tc_exp2(s[n][0] - mx_a);
            const float p1 = mx_a == DF_NEG_INF ? 0.0f : tc_exp2(s[n][1] - mx_a);
            const float p2 = mx_b == DF_NEG_INF ? 0.0f : tc_exp2(s[n][2] - mx_b);
            const float p3 = mx_b == DF_NEG_INF ? 0.0f : tc_exp2(s[n][3] - mx_b);
            sum_a += p0 + p1;
            sum_b += p2 + p3;
            pa[n / 2][(n & 1) * 2 + 0] = bf16x2_rn(p0, p1);
            pa[n / 2][(n & 1) * 2 + 1] = bf16x2_rn(p2, p3);
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
#pragma unroll
        for (u32 n = 0; n < DTILES; ++n) {
            o[n][0] *= alpha_a;
            o[n][1] *= alpha_a;
            o[n][2] *= alpha_b;
            o[n][3] *= alpha_b;
        }
        // O += P V. Per 16-key step and pair of 8-dim tiles, one ldmatrix.trans: matrices (keys 0-7, tile n),
        // (keys 8-15, tile n), (keys 0-7, tile n + 1), (keys 8-15, tile n + 1) give b0 / b1 of both tiles.
#pragma unroll
        for (u32 kk = 0; kk < TC_ATT_KB / 16; ++kk) {
            const bf16_t* vrow = vs + (16 * kk + 8 * ((lane >> 3) & 1u) + (lane & 7u)) * KS_LD + 8 * (lane >> 4);
#pragma unroll
            for (u32 n = 0; n < DTILES; n += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, vrow + 8 * n);
                mma_bf16_16816(o[n], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[0], b[1]);
                mma_bf16_16816(o[n + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[2], b[3]);
            }
        }
    }
    // Each row's sum over the 4 lanes that share it, then the normalised output.
    l_a += __shfl_xor_sync(DF_FULL_MASK, l_a, 1);
    l_a += __shfl_xor_sync(DF_FULL_MASK, l_a, 2);
    l_b += __shfl_xor_sync(DF_FULL_MASK, l_b, 1);
    l_b += __shfl_xor_sync(DF_FULL_MASK, l_b, 2);
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
    float* out_a = out + (u64)(row0 + ra) * q_ld + (u64)head * D;
    float* out_b = out + (u64)(row0 + rb) * q_ld + (u64)head * D;
#pragma unroll
    for (u32 n = 0; n < DTILES; ++n) {
        const u32 d = n * 8 + 2 * t;
        if (ra < rows) *reinterpret_cast<float2*>(out_a + d) = make_float2(o[n][0] * inv_a, o[n][1] * inv_a);
        if (rb < rows) *reinterpret_cast<float2*>(out_b + d) = make_float2(o[n][2] * inv_b, o[n][3] * inv_b);
    }
}

#define TC_ATTENTION_KERNEL(NAME, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_ATT_WARPS * 32)                                              \
        NAME(const float* __restrict__ q, const float* __restrict__ k_cache, const float* __restrict__ v_cache,   \
             const u32* __restrict__ row_keys, const u32* __restrict__ tiles, const u32* __restrict__ tables,    \
             float* __restrict__ out, u32 num_heads, u32 kv_heads, u32 page_size, u32 table_stride, float scale, \
             u32 num_pages, u32 num_seqs, u32 num_rows) {                                                        \
        DF_GRID_DEPENDENCY();                                                                                    \
        tc_attention_body<D>(q, k_cache, v_cache, row_keys, tiles, tables, out, num_heads, kv_heads, page_size,  \
                             table_stride, scale, num_pages, num_seqs, num_rows);                                \
    }

TC_ATTENTION_KERNEL(prompt_attention_tc_d64, 64)
TC_ATTENTION_KERNEL(prompt_attention_tc_d128, 128)
