// Prompt attention on the tensor cores (flash-attention 2 style): q, k and v rounded to bf16, scores and
// outputs accumulated in f32 by mma.m16n8k16, online softmax in f32. For the prompt rows of models whose weights
// are bf16 or quantized: at an 8K prompt the f32 kernel (attention.cu) spends ~93% of the 8B shape's prefill on
// attention, 4 query rows per block on the CUDA cores. f32 models keep the exact kernel (their parity tests ask
// for 5e-6), and decode / verify rows always take it (split keys, batch invariant).
//
// Two launches. kv_to_bf16 writes the bf16 copy of the keys the prompt tiles attend (the cache stays f32) into a
// scratch laid out like one layer of the cache, once per layer instead of once per (tile, head) block. Then the
// attention: one block of TC_ATT_WARPS warps per (tile, head), warp w owning the tile's rows 32 w .. 32 w + 31
// as two 16-row mma tiles (up to TC_ATT_ROWS rows per tile, the tile format of paged_attention: sequence, first
// row, rows, first key to convert). Row t attends keys 0 .. row_keys[t] - 1 of its sequence. Keys go through
// shared memory in blocks of TC_ATT_KB: the block's bf16 K and V rows are copied (cp.async) straight into the
// layout `ldmatrix` reads while the block before it is computed on. Each K or V fragment a warp loads serves
// both of its row tiles: the shared-memory reads per mma are what bound the kernel (PERFORMANCE.md entry 52).
// Per block: S = Q K^T (Q fragments reloaded from shared memory by ldmatrix, 8 key columns per mma), mask,
// rescale the running output, add P V (B fragments through `ldmatrix.trans` from the row-major V). A page past
// the cache or past the block table reads as NaN, as in paged_attention.
//
// Fragments (PTX mma.m16n8k16 .row.col, g = lane / 4, t = lane % 4): A regs (row g, cols 2t..2t+1),
// (row g + 8, same), (row g, cols 8 + 2t..), (row g + 8, cols 8 + 2t..); B regs (k 2t..2t+1, col g),
// (k 8 + 2t.., col g); C (row g, cols 2t, 2t + 1), (row g + 8, same). The score C fragments of two
// adjacent 8-key tiles are exactly the A fragment of P for one 16-key step.
#define TC_ATT_WARPS 4
#define TC_ATT_MT 2  // 16-row mma tiles per warp
#define TC_ATT_ROWS (16 * TC_ATT_MT * TC_ATT_WARPS)
#define TC_ATT_KB 64
#define TC_ATT_KPAD 8  // bf16 padding per shared row: 16-byte shift between rows spreads the banks
#define TC_KV_THREADS 256

// One layer's K and V for the keys the prompt tiles attend, f32 -> bf16 (round to nearest even) into k_bf / v_bf
// at the same slots. Grid (tiles, y): block (i, y) converts every y-th 4-float group of keys tile[3] .. the
// tile's largest key count; the tiles of one sequence, in order, start where the one before ended (the plan sets
// tile[3]), so together they cover every key the attention reads. Keys on pages past the cache are left alone
// (the attention reads them as NaN).
extern "C" __global__ void __launch_bounds__(TC_KV_THREADS)
    kv_to_bf16(const float* __restrict__ k_cache, const float* __restrict__ v_cache, const u32* __restrict__ row_keys,
               const u32* __restrict__ tiles, const u32* __restrict__ tables, bf16_t* __restrict__ k_bf,
               bf16_t* __restrict__ v_bf, u32 kv_heads, u32 head_dim, u32 page_size, u32 table_stride,
               u32 num_pages, u32 num_seqs, u32 num_rows) {
    const u32* tile = tiles + 4 * blockIdx.x;  // step inputs: read before the wait
    const u32 seq = tile[0], row0 = tile[1], nrows = tile[2], key_lo = tile[3];
    const bool skip = nrows == 0 || seq >= num_seqs || row0 >= num_rows || nrows > num_rows - row0;
    u32 kmax = 0;
    for (u32 r = 0; !skip && r < nrows; ++r) kmax = max(kmax, row_keys[row0 + r]);
    DF_GRID_DEPENDENCY();  // the cache's new rows come from the kernel before (rope_kv_write)
    if (skip || key_lo >= kmax) return;
    const u32 per_key = kv_heads * head_dim / 4;  // float4 groups per slot
    const u32* table = tables + (u64)seq * table_stride;
    const u64 n = (u64)(kmax - key_lo) * per_key;
    for (u64 e = (u64)blockIdx.y * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.y * blockDim.x) {
        const u32 key = key_lo + (u32)(e / per_key), i = (u32)(e % per_key);
        const u32 page = key / page_size < table_stride ? table[key / page_size] : num_pages;
        if (page >= num_pages) continue;
        const u64 off = ((u64)page * page_size + key % page_size) * per_key * 4 + 4 * i;
        const float4 k = *reinterpret_cast<const float4*>(k_cache + off);
        const float4 v = *reinterpret_cast<const float4*>(v_cache + off);
        *reinterpret_cast<uint2*>(k_bf + off) = make_uint2(bf16x2_rn(k.x, k.y), bf16x2_rn(k.z, k.w));
        *reinterpret_cast<uint2*>(v_bf + off) = make_uint2(bf16x2_rn(v.x, v.y), bf16x2_rn(v.z, v.w));
    }
}

// Four 8x8 bf16 matrices from shared memory: lanes 8j..8j+7 give the row addresses of matrix j, and each lane
// gets, per matrix, the two elements (row g; columns 2t, 2t + 1) of it.
__device__ __forceinline__ void ldmatrix_x4(u32* r, const bf16_t* row) {
    const u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The same, transposed: each lane gets, per matrix, the two elements (rows 2t, 2t + 1; column g).
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
__device__ __forceinline__ void tc_cp_async16(bf16_t* smem, const bf16_t* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}

template <u32 D>
__device__ __forceinline__ void tc_attention_body(const float* __restrict__ q, const bf16_t* __restrict__ k_bf,
                                                  const bf16_t* __restrict__ v_bf,
                                                  const u32* __restrict__ row_keys, const u32* __restrict__ tiles,
                                                  const u32* __restrict__ tables, float* __restrict__ out,
                                                  u32 num_tiles, u32 num_heads, u32 kv_heads, u32 page_size,
                                                  u32 table_stride, float scale, u32 num_pages, u32 num_seqs,
                                                  u32 num_rows) {
    constexpr u32 KSTEPS = D / 16;   // 16-dim steps of Q K^T
    constexpr u32 DTILES = D / 8;    // 8-dim output tiles of P V
    constexpr u32 LD = D + TC_ATT_KPAD;  // 16-byte aligned rows, 16 bytes apart in the banks (ldmatrix)
    constexpr u32 CHUNKS = D / 8;    // 16-byte pieces of a bf16 row
    constexpr u32 NT = TC_ATT_KB / 8;  // 8-key score tiles per block
    // Dynamic shared memory, all [row][LD] bf16: the tile's Q, then two stages of K and of V.
    extern __shared__ float4 tc_smem[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(tc_smem);
    bf16_t* ks = qs + TC_ATT_ROWS * LD;
    bf16_t* vs = ks + 2 * TC_ATT_KB * LD;
    // Blocks in launch order take the last tiles first (causal: they attend the most keys) and the heads of one
    // tile side by side (the heads sharing a KV head read the same K and V from L2).
    const u32 linear = blockIdx.x, head = linear % num_heads;
    const u32* tile = tiles + 4 * (num_tiles - 1 - linear / num_heads);
    const u32 seq = tile[0], row0 = tile[1], nrows = tile[2];
    if (nrows == 0 || seq >= num_seqs || row0 >= num_rows || nrows > num_rows - row0) return;
    const u32 kvh = head / (num_heads / kv_heads);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3u;
    const u64 q_ld = (u64)num_heads * D;
    const u32 rows = min(nrows, (u32)TC_ATT_ROWS);
    // This lane's rows (g and g + 8 of each of the warp's two row tiles) and their key limits (0 past the tile).
    u32 lim[TC_ATT_MT][2];
    u32 lo = 0xffffffffu, hi = 0;
#pragma unroll
    for (u32 mt = 0; mt < TC_ATT_MT; ++mt) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            const u32 r = warp * 16 * TC_ATT_MT + mt * 16 + g + 8 * h;
            lim[mt][h] = r < rows ? row_keys[row0 + r] : 0;
            hi = max(hi, lim[mt][h]);
            if (r < rows) lo = min(lo, lim[mt][h]);
        }
    }
    // Keys past every row of the warp are skipped (the shuffles below need the whole warp); key blocks below
    // every row's limit need no mask.
    const u32 warp_hi = __reduce_max_sync(DF_FULL_MASK, hi), warp_lo = __reduce_min_sync(DF_FULL_MASK, lo);
    u32 kmax = 0;
    for (u32 r = 0; r < rows; ++r) kmax = max(kmax, row_keys[row0 + r]);
    const u32* table = tables + (u64)seq * table_stride;

    // Where key block `blk`'s rows of this KV head start (elements; the host checks they fit 32 bits) into
    // slots[blk & 1] (threads 0 .. TC_ATT_KB - 1): ATTN_NO_SLOT past the tile's keys, ATTN_NO_SLOT - 1 on a page
    // past the cache or the table. Looked up a block ahead of the copies, so a copy costs no division or table
    // read.
    __shared__ u32 slots[2][TC_ATT_KB];
    auto lookup = [&](u32 blk) {
        const u32 key = blk * TC_ATT_KB + threadIdx.x;
        if (threadIdx.x < TC_ATT_KB) {
            u32 slot = ATTN_NO_SLOT;
            if (key < kmax) {
                const u32 page = key / page_size < table_stride ? table[key / page_size] : num_pages;
                const u32 row = (page * page_size + key % page_size) * kv_heads + kvh;
                slot = page < num_pages ? row * D : ATTN_NO_SLOT - 1;
            }
            slots[blk & 1u][threadIdx.x] = slot;
        }
    };
    // Queues the copies of key block `blk`'s K and V rows into stage `blk & 1`; keys past the tile read as
    // zeros (masked, and 0 · V must stay 0), keys on a page past the cache or the table as NaN.
    auto fetch = [&](u32 blk) {
        bf16_t* kst = ks + (blk & 1u) * TC_ATT_KB * LD;
        bf16_t* vst = vs + (blk & 1u) * TC_ATT_KB * LD;
#pragma unroll
        for (u32 e = threadIdx.x; e < TC_ATT_KB * CHUNKS; e += TC_ATT_WARPS * 32) {
            const u32 c = e / CHUNKS, d = 8 * (e % CHUNKS), slot = slots[blk & 1u][c];
            bf16_t* kd = kst + c * LD + d;
            bf16_t* vd = vst + c * LD + d;
            if (slot < ATTN_NO_SLOT - 1) {
                tc_cp_async16(kd, k_bf + slot + d);
                tc_cp_async16(vd, v_bf + slot + d);
            } else {
                const u32 fill = slot == ATTN_NO_SLOT ? 0u : 0x7fc07fc0u;  // zeros, or bf16 NaNs
                *reinterpret_cast<uint4*>(kd) = make_uint4(fill, fill, fill, fill);
                *reinterpret_cast<uint4*>(vd) = make_uint4(fill, fill, fill, fill);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    const u32 blocks = (kmax + TC_ATT_KB - 1) / TC_ATT_KB;
    lookup(0);
    lookup(1);
    // Q, bf16, into shared memory (rows past the tile are zeros); the barrier below publishes it.
    for (u32 e = threadIdx.x; e < TC_ATT_ROWS * CHUNKS; e += TC_ATT_WARPS * 32) {
        const u32 r = e / CHUNKS, d = 8 * (e % CHUNKS);
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows) {
            const float4* src = reinterpret_cast<const float4*>(q + (u64)(row0 + r) * q_ld + (u64)head * D + d);
            const float4 a = src[0], b = src[1];
            v = make_uint4(bf16x2_rn(a.x, a.y), bf16x2_rn(a.z, a.w), bf16x2_rn(b.x, b.y), bf16x2_rn(b.z, b.w));
        }
        *reinterpret_cast<uint4*>(qs + r * LD + d) = v;
    }
    __syncthreads();  // Q and the first slots are in
    if (blocks > 0) fetch(0);
    float o[TC_ATT_MT][DTILES][4];
#pragma unroll
    for (u32 mt = 0; mt < TC_ATT_MT; ++mt)
#pragma unroll
        for (u32 n = 0; n < DTILES; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
    float m[TC_ATT_MT][2], l[TC_ATT_MT][2];
#pragma unroll
    for (u32 mt = 0; mt < TC_ATT_MT; ++mt) m[mt][0] = m[mt][1] = DF_NEG_INF, l[mt][0] = l[mt][1] = 0.0f;
    // The softmax's e^((s - m) scale) as 2^(s scale log2(e) - m scale log2(e)).
    const float scale2 = scale * 1.4426950408889634f;
    // ldmatrix row addresses: Q rows (lanes 8-15 and 24-31 the lower 8 rows; 16-31 the upper 8 columns); K keys
    // (16-31 the next 8-key tile; 8-15 and 24-31 the upper 8 dims); V keys (8-15 and 24-31 the second 8 keys;
    // 16-31 the next 8-dim tile).
    const bf16_t* q_lane = qs + (warp * 16 * TC_ATT_MT + (lane & 7u) + 8 * ((lane >> 3) & 1u)) * LD + 8 * (lane >> 4);
    const u32 k_lane = ((lane & 7u) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1u);
    const u32 v_lane = ((lane & 7u) + 8 * ((lane >> 3) & 1u)) * LD + 8 * (lane >> 4);
    for (u32 blk = 0; blk < blocks; ++blk) {
        const u32 base = blk * TC_ATT_KB;
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();  // block blk is in; every warp is done with block blk - 1's stage
        if (blk + 1 < blocks) fetch(blk + 1);  // lands while the mma below run
        lookup(blk + 2);  // slots[blk & 1]: fetch(blk) is done with them
        if (base >= warp_hi) continue;
        const bf16_t* kst = ks + (blk & 1u) * TC_ATT_KB * LD;
        const bf16_t* vst = vs + (blk & 1u) * TC_ATT_KB * LD;
        // The warp's 32 x 64 scores.
        float s[TC_ATT_MT][NT][4];
#pragma unroll
        for (u32 mt = 0; mt < TC_ATT_MT; ++mt)
#pragma unroll
            for (u32 n = 0; n < NT; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
        for (u32 st = 0; st < KSTEPS; ++st) {
            u32 qa[TC_ATT_MT][4];
#pragma unroll
            for (u32 mt = 0; mt < TC_ATT_MT; ++mt) ldmatrix_x4(qa[mt], q_lane + mt * 16 * LD + 16 * st);
#pragma unroll
            for (u32 n = 0; n < NT; n += 2) {
                u32 b[4];
                ldmatrix_x4(b, kst + k_lane + n * 8 * LD + 16 * st);
#pragma unroll
                for (u32 mt = 0; mt < TC_ATT_MT; ++mt) {
                    mma_bf16_16816(s[mt][n], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b[0], b[1]);
                    mma_bf16_16816(s[mt][n + 1], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], b[2], b[3]);
                }
            }
        }
        // Mask (blocks reaching past some row's limit), the rows' new running maxima.
        const bool masked = base + TC_ATT_KB > warp_lo;
        u32 pa[TC_ATT_MT][TC_ATT_KB / 16][4];
#pragma unroll
        for (u32 mt = 0; mt < TC_ATT_MT; ++mt) {
            float mx[2] = {m[mt][0], m[mt][1]};
#pragma unroll
            for (u32 n = 0; n < NT; ++n) {
                const u32 key = base + n * 8 + 2 * t;
#pragma unroll
                for (u32 j = 0; j < 4; ++j) {
                    const u32 h = j >> 1;
                    if (masked && key + (j & 1u) >= lim[mt][h]) s[mt][n][j] = DF_NEG_INF;
                    mx[h] = fmaxf(mx[h], s[mt][n][j]);
                }
            }
            // Maxima are kept unscaled; p = 2^(s · scale · log2(e) - m · scale · log2(e)), one FFMA and one SFU op
            // each. A row with no key yet keeps m = -inf and p = 0.
            float alpha[2], m_scaled[2];
#pragma unroll
            for (u32 h = 0; h < 2; ++h) {
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(DF_FULL_MASK, mx[h], 1));
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(DF_FULL_MASK, mx[h], 2));
                m_scaled[h] = mx[h] == DF_NEG_INF ? 0.0f : mx[h] * scale2;
                alpha[h] = tc_exp2(m[mt][h] * scale2 - m_scaled[h]);  // 2^-inf = 0 for the first keys: o, l are 0
                m[mt][h] = mx[h];
            }
            // P (bf16, as A fragments of 16-key steps) and the rows' partial sums.
            float sum[2] = {0.0f, 0.0f};
#pragma unroll
            for (u32 n = 0; n < NT; ++n) {
                float p[4];
#pragma unroll
                for (u32 j = 0; j < 4; ++j) {
                    p[j] = tc_exp2(fmaf(s[mt][n][j], scale2, -m_scaled[j >> 1]));
                    sum[j >> 1] += p[j];
                }
                pa[mt][n / 2][(n & 1) * 2 + 0] = bf16x2_rn(p[0], p[1]);
                pa[mt][n / 2][(n & 1) * 2 + 1] = bf16x2_rn(p[2], p[3]);
            }
#pragma unroll
            for (u32 h = 0; h < 2; ++h) l[mt][h] = l[mt][h] * alpha[h] + sum[h];
#pragma unroll
            for (u32 n = 0; n < DTILES; ++n) {
                o[mt][n][0] *= alpha[0];
                o[mt][n][1] *= alpha[0];
                o[mt][n][2] *= alpha[1];
                o[mt][n][3] *= alpha[1];
            }
        }
        // O += P V. Per 16-key step and pair of 8-dim tiles, one ldmatrix.trans: matrices (keys 0-7, tile n),
        // (keys 8-15, tile n), (keys 0-7, tile n + 1), (keys 8-15, tile n + 1) give b0 / b1 of both tiles.
#pragma unroll
        for (u32 kk = 0; kk < TC_ATT_KB / 16; ++kk) {
#pragma unroll
            for (u32 n = 0; n < DTILES; n += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, vst + v_lane + 16 * kk * LD + 8 * n);
#pragma unroll
                for (u32 mt = 0; mt < TC_ATT_MT; ++mt) {
                    const u32* a = pa[mt][kk];
                    mma_bf16_16816(o[mt][n], a[0], a[1], a[2], a[3], b[0], b[1]);
                    mma_bf16_16816(o[mt][n + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                }
            }
        }
    }
    // Each row's sum over the 4 lanes that share it, then the normalised output.
#pragma unroll
    for (u32 mt = 0; mt < TC_ATT_MT; ++mt) {
#pragma unroll
        for (u32 h = 0; h < 2; ++h) {
            float sum = l[mt][h];
            sum += __shfl_xor_sync(DF_FULL_MASK, sum, 1);
            sum += __shfl_xor_sync(DF_FULL_MASK, sum, 2);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            const u32 r = warp * 16 * TC_ATT_MT + mt * 16 + g + 8 * h;
            if (r >= rows) continue;
            float* dst = out + (u64)(row0 + r) * q_ld + (u64)head * D;
#pragma unroll
            for (u32 n = 0; n < DTILES; ++n) {
                const float2 v = make_float2(o[mt][n][2 * h] * inv, o[mt][n][2 * h + 1] * inv);
                *reinterpret_cast<float2*>(dst + n * 8 + 2 * t) = v;
            }
        }
    }
}

#define TC_ATTENTION_KERNEL(NAME, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(TC_ATT_WARPS * 32, 2)                                           \
        NAME(const float* __restrict__ q, const bf16_t* __restrict__ k_bf, const bf16_t* __restrict__ v_bf,      \
             const u32* __restrict__ row_keys, const u32* __restrict__ tiles, const u32* __restrict__ tables,    \
             float* __restrict__ out, u32 num_tiles, u32 num_heads, u32 kv_heads, u32 page_size,                 \
             u32 table_stride, float scale, u32 num_pages, u32 num_seqs, u32 num_rows) {                         \
        DF_GRID_DEPENDENCY();                                                                                    \
        tc_attention_body<D>(q, k_bf, v_bf, row_keys, tiles, tables, out, num_tiles, num_heads, kv_heads,        \
                             page_size, table_stride, scale, num_pages, num_seqs, num_rows);                     \
    }

TC_ATTENTION_KERNEL(prompt_attention_tc_d64, 64)
TC_ATTENTION_KERNEL(prompt_attention_tc_d128, 128)
