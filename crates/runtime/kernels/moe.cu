// Sparse mixture-of-experts (Qwen3-MoE / Qwen3-Next sparse blocks). CPU twin: ops::moe_forward and
// ops::moe_route in src/ops/moe.rs; launcher: src/cuda/ops/moe.rs.
//
// Launches, every grid sized from capacities (never from the routing, which lives on the device), so a step
// is capturable into a CUDA graph:
//   moe_route           warp per row (MOE_ROUTE_WARPS rows per block): softmax over the E expert logits,
//                       top-k, the picks sorted by expert id. One row is its own plan; otherwise the last block
//                       to finish groups the picks: the active experts in ascending id order, for each the rows
//                       routed to it (ascending) in consecutive "slots", each (row, pick)'s slot.
//   moe_gate_up_*       grid (I / MOE_WARPS, min(E, T * top_k)): warp per intermediate column j of one active
//                       expert; reads gate row j and up row j once and dots them with every row routed there
//                       -> act[slot, j] = silu(gate) * up. Blocks past the active count exit at once.
// then, up to MOE_SMALL_ROWS rows (decode, verify):
//   moe_down_combine_*  grid H / MOE_WARPS: warp per output column over every slot, down . act times the
//                       pick's weight added to the row's delta in slot (= expert id) order, + sigmoid(gate) *
//                       shared, residual += delta;
// or beyond:
//   moe_down_*          grid (H / (MOE_WARPS * MOE_DOWN_COLS), min(E, T * top_k)): warp per MOE_DOWN_COLS
//                       output columns -> y[slot, H], unweighted;
//   moe_combine         grid (T, H / 256), thread per output column: the same delta from y, residual += delta.
//
// Batch invariance: every dot product is one lane-strided FMA chain over k and one warp_sum, the same code
// for a row whatever other rows share its expert (the row chunking only changes how many rows one weight
// load serves), and both combines sum a row's picks in id order with the same rounded steps; so a row's bits
// depend neither on the batch nor on the path.
//
// Memory floor (decode, one row, E = 512, top_k = 10, H = 2048, I = 512, bf16): only the 10 routed experts
// are read, 10 x 3 * I * H * 2 B = 63 MB, about 15 us at 4.3 TB/s; logits, x, act and y are a few KB.
// Non-routed experts are never touched.

#define MOE_WARPS 8        // warps per block of the expert GEMVs
#define MOE_DOWN_COLS 4    // output columns (down rows) per warp of moe_down
#define MOE_ROUTE_WARPS 4  // rows (one warp each) per block of moe_route
#define MOE_MAX_TOPK 32    // picks per row (one lane each in the routing warp); the launcher checks it
#define MOE_NO_INDEX 0xffffffffu
#define MOE_INT_MIN (-2147483647 - 1)

// ---------------------------------------------------------------------------------------------------------
// Routing and grouping (one launch)

// Warp-wide max (signed) and min (unsigned) of one value per lane: one redux instruction from sm_80 on.
__device__ __forceinline__ int moe_warp_max_s32(int v) {
#if __CUDA_ARCH__ >= 800
    int r;
    asm volatile("redux.sync.max.s32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
#else
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(DF_FULL_MASK, v, offset));
    return v;
#endif
}

__device__ __forceinline__ u32 moe_warp_min_u32(u32 v) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
#else
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = min(v, __shfl_xor_sync(DF_FULL_MASK, v, offset));
    return v;
#endif
}

// One row's routing by one warp. l: the row's logits [E]; p: E floats of shared memory. Returns, in lanes
// t < top_k, the t-th pick in ascending expert id: *id, *w (p, or p / the sum of the picked p when
// norm_topk); other lanes get MOE_NO_INDEX.
// The softmax is the CPU's (max-subtracted, a -inf row uniform, scaled by 1 / sum); only expf and the order
// of the sum differ, so p agrees to about an ulp and the picks agree except between probabilities that
// close (exact ties, from equal logits, pick the lower id on both sides).
__device__ __forceinline__ void moe_route_row(const float* __restrict__ l, u32 num_experts, u32 top_k,
                                              u32 norm_topk, float* p, u32* id_out, float* w_out) {
    const u32 lane = threadIdx.x & 31u;
    float mx = DF_NEG_INF;
    for (u32 i = lane; i < num_experts; i += 32) {
        const float v = l[i];
        p[i] = v;
        mx = fmaxf(mx, v);  // NaN ignored, as the CPU's max
    }
    mx = warp_max(mx);
    bool all_nan = false;
    if (mx == DF_NEG_INF) {
        const float uniform = __fdiv_rn(1.0f, (float)num_experts);
        for (u32 i = lane; i < num_experts; i += 32) p[i] = uniform;
    } else {
        float sum = 0.0f;
        for (u32 i = lane; i < num_experts; i += 32) {
            const float e = expf(__fsub_rn(p[i], mx));
            p[i] = e;
            sum = __fadd_rn(sum, e);
        }
        const float inv = __fdiv_rn(1.0f, warp_sum(sum));
        // A NaN or +inf logit makes the sum, and so every p, NaN: then ops::top_k ranks all alike and takes
        // the lowest ids. Otherwise no p is NaN and every p >= +0.
        all_nan = inv != inv;
        for (u32 i = lane; i < num_experts; i += 32) p[i] = __fmul_rn(p[i], inv);
    }
    __syncwarp();
    // Lane t keeps pick t (rank order).
    u32 my_id = MOE_NO_INDEX;
    float my_p = DF_NAN;
    if (all_nan) {
        if (lane < top_k) my_id = lane;
    } else {
        // p >= +0, so its bits as int order like p; a taken expert gets -1.0 (a negative int). Each lane
        // keeps the best of its own experts (larger p, then the lower id, as ops::top_k); a round takes the
        // warp's best with two redux ops and only the lane that owned it rescans. top_k <= E, so an untaken
        // expert always remains.
        int bk = MOE_INT_MIN;
        u32 bi = MOE_NO_INDEX;
        for (u32 i = lane; i < num_experts; i += 32) {
            const int k = __float_as_int(p[i]);
            if (k > bk) {
                bk = k;
                bi = i;
            }
        }
        for (u32 t = 0; t < top_k; ++t) {
            const int m = moe_warp_max_s32(bk);
            const u32 id = moe_warp_min_u32(bk == m ? bi : MOE_NO_INDEX);
            if (lane == t) {
                my_id = id;
                my_p = __int_as_float(m);
            }
            if (bi == id) {
                p[id] = -1.0f;
                bk = MOE_INT_MIN;
                bi = MOE_NO_INDEX;
#pragma unroll 4
                for (u32 i = lane; i < num_experts; i += 32) {
                    const int k = __float_as_int(p[i]);
                    if (k > bk) {
                        bk = k;
                        bi = i;
                    }
                }
            }
        }
    }
    // The CPU sums the picked p in rank order, then divides each by the sum; the picks go out in id order
    // (a pick's position is the number of picks with a lower id).
    float sum = 0.0f;
    u32 pos = 0;
    for (u32 t = 0; t < top_k; ++t) {
        sum = __fadd_rn(sum, __shfl_sync(DF_FULL_MASK, my_p, t));
        pos += __shfl_sync(DF_FULL_MASK, my_id, t) < my_id;
    }
    // Lane pos returns pick `lane`: exchange through shuffles (a permutation of lanes 0..top_k).
    const float w = norm_topk ? __fdiv_rn(my_p, sum) : my_p;
    u32 src = 0;
    for (u32 t = 0; t < top_k; ++t) {
        if (__shfl_sync(DF_FULL_MASK, pos, t) == lane) src = t;
    }
    // Every lane shuffles (a full-mask shuffle some lanes skip would wait for them forever).
    const u32 id = __shfl_sync(DF_FULL_MASK, my_id, src);
    *w_out = __shfl_sync(DF_FULL_MASK, w, src);
    *id_out = lane < top_k ? id : MOE_NO_INDEX;
}

// Exclusive prefix sum of v over the block (in thread order), with the block's total in *total.
// blockDim.x a multiple of 32; scratch is 32 words of shared memory.
__device__ __forceinline__ u32 moe_block_excl_scan(u32 v, u32* scratch, u32* total) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u32 incl = v;
#pragma unroll
    for (u32 off = 1; off < 32; off <<= 1) {
        const u32 t = __shfl_up_sync(DF_FULL_MASK, incl, off);
        if (lane >= off) incl += t;
    }
    __syncthreads();  // a previous scan may still be reading scratch
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        u32 w = lane < warps ? scratch[lane] : 0u;
#pragma unroll
        for (u32 off = 1; off < 32; off <<= 1) {
            const u32 t = __shfl_up_sync(DF_FULL_MASK, w, off);
            if (lane >= off) w += t;
        }
        scratch[lane] = w;
    }
    __syncthreads();
    *total = scratch[warps - 1];
    return incl - v + (warp > 0 ? scratch[warp - 1] : 0u);
}

// The whole block groups every row's picks (pick_ids / pick_w [T, top_k], distinct ids per row, read
// through L2: other blocks wrote them). Writes the plan: n_active[0]; active_ids[a] (ascending) and
// active_off[a .. a + 1] (its slot range) for a < n_active, active_off[n_active] = T * top_k; per slot its
// row (ascending within an expert), expert and weight; pick_slot [T, top_k]. Slots in ascending order thus
// visit each row's picks in ascending expert id. smem: 2 * E words (per-expert counts, then slot cursors;
// and a 32-row bitmap per expert). Deterministic: no result depends on the order of the atomics.
__device__ __forceinline__ void moe_group_block(const u32* pick_ids, const float* pick_w, u32 rows, u32 top_k,
                                                u32 num_experts, u32* smem, u32* __restrict__ n_active,
                                                u32* __restrict__ active_ids, u32* __restrict__ active_off,
                                                u32* __restrict__ pick_slot, u32* __restrict__ slot_row,
                                                u32* __restrict__ slot_expert, float* __restrict__ slot_w) {
    __shared__ u32 scan_scratch[32];
    u32* cnt = smem;                 // [E]
    u32* bits = smem + num_experts;  // [E]
    const u32 n = rows * top_k;
    __syncthreads();  // the routing may still be using smem
    for (u32 e = threadIdx.x; e < num_experts; e += blockDim.x) {
        cnt[e] = 0;
        bits[e] = 0;
    }
    __syncthreads();
    for (u32 it = threadIdx.x; it < n; it += blockDim.x) atomicAdd(&cnt[__ldcg(pick_ids + it)], 1u);
    __syncthreads();

    // Each thread takes a contiguous run of experts; scans give its first slot and first active index.
    const u32 per = (num_experts + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(threadIdx.x * per, num_experts), hi = min(lo + per, num_experts);
    u32 slots = 0, actives = 0;
    for (u32 e = lo; e < hi; ++e) {
        slots += cnt[e];
        actives += cnt[e] != 0;
    }
    u32 slot_total, active_total;
    u32 slot = moe_block_excl_scan(slots, scan_scratch, &slot_total);
    u32 a = moe_block_excl_scan(actives, scan_scratch, &active_total);
    for (u32 e = lo; e < hi; ++e) {
        const u32 c = cnt[e];
        if (c != 0) {
            active_ids[a] = e;
            active_off[a] = slot;
            ++a;
        }
        cnt[e] = slot;  // from here on: the next free slot of expert e
        slot += c;
    }
    if (threadIdx.x == 0) {
        n_active[0] = active_total;
        active_off[active_total] = slot_total;
    }
    __syncthreads();

    // Rows in chunks of 32: a pick's rank among the chunk's rows of the same expert is the popcount of the
    // lower bits of that expert's bitmap, so rows stay ascending within every expert.
    for (u32 base = 0; base < rows; base += 32) {
        const u32 items = min(32u, rows - base) * top_k;
        const u64 first = (u64)base * top_k;
        for (u32 it = threadIdx.x; it < items; it += blockDim.x) {
            atomicOr(&bits[__ldcg(pick_ids + first + it)], 1u << (it / top_k));
        }
        __syncthreads();
        for (u32 it = threadIdx.x; it < items; it += blockDim.x) {
            const u32 e = __ldcg(pick_ids + first + it), r = it / top_k;
            const u32 s = cnt[e] + __popc(bits[e] & ((1u << r) - 1u));
            pick_slot[first + it] = s;
            slot_row[s] = base + r;
            slot_expert[s] = e;
            slot_w[s] = __ldcg(pick_w + first + it);
        }
        __syncthreads();
        for (u32 e = threadIdx.x; e < num_experts; e += blockDim.x) {
            cnt[e] += __popc(bits[e]);
            bits[e] = 0;
        }
        __syncthreads();
    }
}

// Warp per row, blockDim / 32 rows per block: each warp routes its row (moe_route_row). One row (decode)
// is its own plan: its picks in id order are the active experts, one slot each. Otherwise the last block
// to finish groups all rows (moe_group_block) and resets `done` to 0 for the next launch (a graph replay
// included). logits: [T, ld], expert logits in columns 0..E; pick_ids / pick_w: [T, top_k]; the plan as
// in moe_group_block. Dynamic shared memory: max(warps * E floats, 2 * E words).
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_WARPS * 32)
    moe_route(const float* __restrict__ logits, u32 rows, u32 ld, u32 num_experts, u32 top_k, u32 norm_topk,
              u32* pick_ids, float* pick_w, u32* done, u32* __restrict__ n_active, u32* __restrict__ active_ids,
              u32* __restrict__ active_off, u32* __restrict__ pick_slot, u32* __restrict__ slot_row,
              u32* __restrict__ slot_expert, float* __restrict__ slot_w) {
    DF_GRID_DEPENDENCY();
    extern __shared__ float4 moe_route_smem[];
    __shared__ bool is_last;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u64 row = (u64)blockIdx.x * (blockDim.x >> 5) + warp;
    if (row < rows) {  // uniform per warp
        float* p = reinterpret_cast<float*>(moe_route_smem) + warp * num_experts;
        u32 id;
        float w;
        moe_route_row(logits + row * ld, num_experts, top_k, norm_topk, p, &id, &w);
        if (lane < top_k) {
            pick_ids[row * top_k + lane] = id;
            pick_w[row * top_k + lane] = w;
        }
        if (rows == 1) {
            if (lane < top_k) {
                active_ids[lane] = id;
                active_off[lane] = lane;
                pick_slot[lane] = lane;
                slot_row[lane] = 0;
                slot_expert[lane] = id;
                slot_w[lane] = w;
            }
            if (lane == 0) {
                n_active[0] = top_k;
                active_off[top_k] = top_k;
            }
        }
    }
    if (rows == 1) return;  // uniform: the whole grid is this block
    // The threadfence-reduction pattern: picks are visible device-wide before this block counts itself.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    moe_group_block(pick_ids, pick_w, rows, top_k, num_experts, reinterpret_cast<u32*>(moe_route_smem), n_active,
                    active_ids, active_off, pick_slot, slot_row, slot_expert, slot_w);
    if (threadIdx.x == 0) *done = 0;
}

// ---------------------------------------------------------------------------------------------------------
// The expert GEMVs: weights bf16 or f32 through one template (moe_load8 / moe_load1 overloads).

// Weights 8 * j .. 8 * j + 8 of a row, widened to f32 (16-byte loads; the row must be 16-byte aligned).
__device__ __forceinline__ void moe_load8(const bf16_t* __restrict__ w, u32 j, float* v) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(w) + j);
    v[0] = __uint_as_float(q.x << 16);
    v[1] = __uint_as_float(q.x & 0xffff0000u);
    v[2] = __uint_as_float(q.y << 16);
    v[3] = __uint_as_float(q.y & 0xffff0000u);
    v[4] = __uint_as_float(q.z << 16);
    v[5] = __uint_as_float(q.z & 0xffff0000u);
    v[6] = __uint_as_float(q.w << 16);
    v[7] = __uint_as_float(q.w & 0xffff0000u);
}

__device__ __forceinline__ void moe_load8(const float* __restrict__ w, u32 j, float* v) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(w) + 2 * j);
    const float4 b = __ldg(reinterpret_cast<const float4*>(w) + 2 * j + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ float moe_load1(const bf16_t* __restrict__ w, u32 i) { return bf16_to_f32(w[i]); }
__device__ __forceinline__ float moe_load1(const float* __restrict__ w, u32 i) { return __ldg(w + i); }

// s += w[0..8] . x[8 * j .. 8 * j + 8], FMAs in element order.
__device__ __forceinline__ float moe_fma8(const float* w, const float4 a, const float4 b, float s) {
    s = fmaf(w[0], a.x, s);
    s = fmaf(w[1], a.y, s);
    s = fmaf(w[2], a.z, s);
    s = fmaf(w[3], a.w, s);
    s = fmaf(w[4], b.x, s);
    s = fmaf(w[5], b.y, s);
    s = fmaf(w[6], b.z, s);
    s = fmaf(w[7], b.w, s);
    return s;
}

// R slots s .. s + R of one expert through gate row gw and up row uw (k = h each): act[slot, j].
// The inputs are x rows slot_row[slot]. vec: h % 8 == 0 and 16-byte aligned rows (else scalar loads).
template <typename W, int R>
__device__ __forceinline__ void moe_gate_up_chunk(const W* __restrict__ gw, const W* __restrict__ uw,
                                                  const float* __restrict__ x, const u32* __restrict__ slot_row,
                                                  u32 s, float* __restrict__ act, u32 j, u32 h, u32 inter,
                                                  bool vec) {
    const u32 lane = threadIdx.x & 31u;
    const float* xr[R];
    float g[R], u[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        xr[r] = x + (u64)slot_row[s + r] * h;
        g[r] = 0.0f;
        u[r] = 0.0f;
    }
    if (vec) {
        // More loads in flight where few rows leave registers free (decode: one row, 16 loads per lane).
#pragma unroll(R == 1 ? 4 : (R == 2 ? 2 : 1))
        for (u32 c = lane; c < (h >> 3); c += 32) {
            float wg[8], wu[8];
            moe_load8(gw, c, wg);
            moe_load8(uw, c, wu);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4* x4 = reinterpret_cast<const float4*>(xr[r]) + 2 * c;
                const float4 a = __ldg(x4), b = __ldg(x4 + 1);
                g[r] = moe_fma8(wg, a, b, g[r]);
                u[r] = moe_fma8(wu, a, b, u[r]);
            }
        }
    } else {
        for (u32 i = lane; i < h; i += 32) {
            const float wg = moe_load1(gw, i), wu = moe_load1(uw, i);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float xv = __ldg(xr[r] + i);
                g[r] = fmaf(wg, xv, g[r]);
                u[r] = fmaf(wu, xv, u[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float gs = warp_sum(g[r]), us = warp_sum(u[r]);
        if (lane == 0) act[(u64)(s + r) * inter + j] = swiglu_value(gs, us);
    }
}

// R slots s .. s + R through the C = MOE_DOWN_COLS down rows c0 .. c0 + C (k = inter): y[slot, c]; the
// inputs are act rows s .. s + R. Columns past h repeat the last row and are not stored (h need not be a
// multiple of C). Four rows per warp keep 4 * inter / 256 16-byte loads per lane in flight (a row is only
// inter * 2 bytes).
template <typename W, int R>
__device__ __forceinline__ void moe_down_chunk(const W* __restrict__ dw, const float* __restrict__ act, u32 s,
                                               float* __restrict__ y, u32 c0, u32 h, u32 inter, bool vec) {
    constexpr int C = MOE_DOWN_COLS;
    const u32 lane = threadIdx.x & 31u;
    const W* w[C];
    float acc[R][C];
#pragma unroll
    for (int q = 0; q < C; ++q) w[q] = dw + (u64)min(c0 + q, h - 1) * inter;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int q = 0; q < C; ++q) acc[r][q] = 0.0f;
    }
    const float* ar = act + (u64)s * inter;
    if (vec) {
#pragma unroll(R == 1 ? 2 : 1)
        for (u32 j = lane; j < (inter >> 3); j += 32) {
            float wv[C][8];
#pragma unroll
            for (int q = 0; q < C; ++q) moe_load8(w[q], j, wv[q]);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4* a4 = reinterpret_cast<const float4*>(ar + (u64)r * inter) + 2 * j;
                const float4 a = __ldg(a4), b = __ldg(a4 + 1);
#pragma unroll
                for (int q = 0; q < C; ++q) acc[r][q] = moe_fma8(wv[q], a, b, acc[r][q]);
            }
        }
    } else {
        for (u32 i = lane; i < inter; i += 32) {
            float wv[C];
#pragma unroll
            for (int q = 0; q < C; ++q) wv[q] = moe_load1(w[q], i);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float av = __ldg(ar + (u64)r * inter + i);
#pragma unroll
                for (int q = 0; q < C; ++q) acc[r][q] = fmaf(wv[q], av, acc[r][q]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int q = 0; q < C; ++q) {
            const float v = warp_sum(acc[r][q]);
            if (lane == 0 && c0 + q < h) y[(u64)(s + r) * h + c0 + q] = v;
        }
    }
}

// The slots s .. end of one expert in chunks of MAX rows, then 4, 2, 1 (one weight load serves a chunk).
#define MOE_CHUNKED(MAX, CALL)                 \
    while (end - s >= MAX) {                   \
        CALL(MAX);                             \
        s += MAX;                              \
    }                                          \
    if constexpr (MAX > 4) {                   \
        if (end - s >= 4) {                    \
            CALL(4);                           \
            s += 4;                            \
        }                                      \
    }                                          \
    if constexpr (MAX > 2) {                   \
        if (end - s >= 2) {                    \
            CALL(2);                           \
            s += 2;                            \
        }                                      \
    }                                          \
    if constexpr (MAX > 1) {                   \
        if (end - s >= 1) CALL(1);             \
    }

// gate_up: [E, 2I, H] (gate rows 0..I, up rows I..2I of each expert); x: [T, H]; act: [T * top_k, I].
// Grid (ceil(I / MOE_WARPS), capacity of active experts); block MOE_WARPS warps. Up to MAXR rows per weight
// load.
template <typename W, int MAXR>
__device__ __forceinline__ void moe_gate_up(const W* __restrict__ gate_up, const float* __restrict__ x,
                                            const u32* __restrict__ n_active, const u32* __restrict__ active_ids,
                                            const u32* __restrict__ active_off, const u32* __restrict__ slot_row,
                                            float* __restrict__ act, u32 h, u32 inter, u32 vec) {
    const u32 a = blockIdx.y;
    if (a >= n_active[0]) return;  // uniform per block: fewer experts are active than the grid allows
    const u32 j = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    if (j >= inter) return;  // uniform per warp
    const u64 e = active_ids[a];
    const W* gw = gate_up + (e * 2 * inter + j) * (u64)h;
    const W* uw = gw + (u64)inter * h;
    u32 s = active_off[a];
    const u32 end = active_off[a + 1];
#define MOE_GU(R) moe_gate_up_chunk<W, R>(gw, uw, x, slot_row, s, act, j, h, inter, vec != 0)
    MOE_CHUNKED(MAXR, MOE_GU)
#undef MOE_GU
}

// down: [E, H, I]; act: [T * top_k, I]; y: [T * top_k, H]. Grid (ceil(H / (MOE_WARPS * MOE_DOWN_COLS)),
// capacity of active experts); block MOE_WARPS warps of MOE_DOWN_COLS output columns each. Up to MAXR rows
// per weight load.
template <typename W, int MAXR>
__device__ __forceinline__ void moe_down(const W* __restrict__ down, const float* __restrict__ act,
                                         const u32* __restrict__ n_active, const u32* __restrict__ active_ids,
                                         const u32* __restrict__ active_off, float* __restrict__ y, u32 h,
                                         u32 inter, u32 vec) {
    const u32 a = blockIdx.y;
    if (a >= n_active[0]) return;
    const u32 c0 = (blockIdx.x * MOE_WARPS + (threadIdx.x >> 5)) * MOE_DOWN_COLS;
    if (c0 >= h) return;  // uniform per warp
    const W* dw = down + (u64)active_ids[a] * h * inter;
    u32 s = active_off[a];
    const u32 end = active_off[a + 1];
#define MOE_DN(R) moe_down_chunk<W, R>(dw, act, s, y, c0, h, inter, vec != 0)
    MOE_CHUNKED(MAXR, MOE_DN)
#undef MOE_DN
}

// gate_up in two variants: up to 8 rows per weight load for batches, and one row at a time for decode and
// small verify batches (an expert's second row re-reads its weights from L1/L2), whose few registers let
// more blocks stay resident. A row's arithmetic is the same in both, bit for bit.
#define MOE_GATE_UP_KERNEL(SUFFIX, W, MAXR, MIN_BLOCKS)                                                     \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MIN_BLOCKS)                                \
        moe_gate_up_##SUFFIX(const W* __restrict__ gate_up, const float* __restrict__ x,                    \
                             const u32* __restrict__ n_active, const u32* __restrict__ active_ids,          \
                             const u32* __restrict__ active_off, const u32* __restrict__ slot_row,          \
                             float* __restrict__ act, u32 h, u32 inter, u32 vec) {                          \
        DF_GRID_DEPENDENCY();                                                                               \
        moe_gate_up<W, MAXR>(gate_up, x, n_active, active_ids, active_off, slot_row, act, h, inter, vec);   \
    }

MOE_GATE_UP_KERNEL(bf16, bf16_t, 8, 2)
MOE_GATE_UP_KERNEL(f32, float, 8, 2)
MOE_GATE_UP_KERNEL(bf16_r1, bf16_t, 1, 3)
MOE_GATE_UP_KERNEL(f32_r1, float, 1, 3)

#define MOE_DOWN_KERNEL(SUFFIX, W)                                                                          \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, 2)                                         \
        moe_down_##SUFFIX(const W* __restrict__ down, const float* __restrict__ act,                        \
                          const u32* __restrict__ n_active, const u32* __restrict__ active_ids,             \
                          const u32* __restrict__ active_off, float* __restrict__ y, u32 h, u32 inter,      \
                          u32 vec) {                                                                        \
        DF_GRID_DEPENDENCY();                                                                               \
        moe_down<W, 4>(down, act, n_active, active_ids, active_off, y, h, inter, vec);                      \
    }

MOE_DOWN_KERNEL(bf16, bf16_t)
MOE_DOWN_KERNEL(f32, float)

// ---------------------------------------------------------------------------------------------------------
// Small batches (T <= MOE_SMALL_ROWS): down and combine in one kernel, a warp per output column c walking
// every slot in ascending order (so each row's picks in ascending expert id), 4 slots per weight load round.
// y = down[expert(slot)][c] . act[slot] is the same lane-strided FMA chain and warp_sum as moe_down_chunk's,
// and each row's delta takes the same rounded steps as moe_combine's, so the bits equal the batch path's.

#define MOE_SMALL_ROWS 8

// S slots s .. s + S through down row c of each slot's expert; each y * w is added to its row's delta.
template <typename W, int S>
__device__ __forceinline__ void moe_down_slots(const W* __restrict__ down, const float* __restrict__ act,
                                               const u32* __restrict__ slot_expert, const u32* __restrict__ slot_row,
                                               const float* __restrict__ slot_w, u32 s, u32 c, u32 h, u32 inter,
                                               bool vec, float* delta) {
    const u32 lane = threadIdx.x & 31u;
    const W* wr[S];
    const float* ar[S];
    float d[S];
#pragma unroll
    for (int q = 0; q < S; ++q) {
        wr[q] = down + ((u64)slot_expert[s + q] * h + c) * inter;
        ar[q] = act + (u64)(s + q) * inter;
        d[q] = 0.0f;
    }
    if (vec) {
#pragma unroll 2
        for (u32 j = lane; j < (inter >> 3); j += 32) {
            float wv[S][8];
#pragma unroll
            for (int q = 0; q < S; ++q) moe_load8(wr[q], j, wv[q]);
#pragma unroll
            for (int q = 0; q < S; ++q) {
                const float4* a4 = reinterpret_cast<const float4*>(ar[q]) + 2 * j;
                d[q] = moe_fma8(wv[q], __ldg(a4), __ldg(a4 + 1), d[q]);
            }
        }
    } else {
        for (u32 i = lane; i < inter; i += 32) {
#pragma unroll
            for (int q = 0; q < S; ++q) d[q] = fmaf(moe_load1(wr[q], i), __ldg(ar[q] + i), d[q]);
        }
    }
#pragma unroll
    for (int q = 0; q < S; ++q) {
        const float term = __fmul_rn(warp_sum(d[q]), slot_w[s + q]);
        const u32 row = slot_row[s + q];
#pragma unroll
        for (int r = 0; r < MOE_SMALL_ROWS; ++r) {
            if (r == row) delta[r] = __fadd_rn(delta[r], term);
        }
    }
}

// Grid ceil(H / MOE_WARPS), warp per output column. down: [E, H, I]; act: [slots, I]; the plan's slot_expert,
// slot_row, slot_w: [slots]; shared: [T, H] or null, gated by sigmoid(logits[row, gate_col]); residual:
// [T, H] += delta. Memory floor: the routed experts' down rows, slots * H * I weights (distinct experts).
template <typename W>
__device__ __forceinline__ void moe_down_combine(const W* __restrict__ down, const float* __restrict__ act,
                                                 const u32* __restrict__ slot_expert,
                                                 const u32* __restrict__ slot_row, const float* __restrict__ slot_w,
                                                 u32 slots, const float* __restrict__ shared,
                                                 const float* __restrict__ logits, u32 ld, u32 gate_col,
                                                 float* __restrict__ residual, u32 rows, u32 h, u32 inter,
                                                 u32 vec) {
    const u32 lane = threadIdx.x & 31u;
    const u32 c = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    if (c >= h) return;  // uniform per warp
    float delta[MOE_SMALL_ROWS];
#pragma unroll
    for (int r = 0; r < MOE_SMALL_ROWS; ++r) delta[r] = 0.0f;
    u32 s = 0;
    for (; s + 4 <= slots; s += 4) {
        moe_down_slots<W, 4>(down, act, slot_expert, slot_row, slot_w, s, c, h, inter, vec != 0, delta);
    }
    for (; s < slots; ++s) {
        moe_down_slots<W, 1>(down, act, slot_expert, slot_row, slot_w, s, c, h, inter, vec != 0, delta);
    }
    // Every lane holds every row's delta; lane r finishes row r.
    float mine = 0.0f;
#pragma unroll
    for (int r = 0; r < MOE_SMALL_ROWS; ++r) {
        if (r == lane) mine = delta[r];
    }
    if (lane < rows) {
        if (shared != nullptr) {
            const float g = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-logits[(u64)lane * ld + gate_col])));
            mine = __fadd_rn(mine, __fmul_rn(g, shared[(u64)lane * h + c]));
        }
        residual[(u64)lane * h + c] = __fadd_rn(residual[(u64)lane * h + c], mine);
    }
}

#define MOE_DOWN_COMBINE_KERNEL(SUFFIX, W, MIN_BLOCKS)                                                      \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32, MIN_BLOCKS)                                \
        moe_down_combine_##SUFFIX(const W* __restrict__ down, const float* __restrict__ act,                \
                                  const u32* __restrict__ slot_expert, const u32* __restrict__ slot_row,    \
                                  const float* __restrict__ slot_w, u32 slots, const float* __restrict__ shared, \
                                  const float* __restrict__ logits, u32 ld, u32 gate_col,                   \
                                  float* __restrict__ residual, u32 rows, u32 h, u32 inter, u32 vec) {      \
        DF_GRID_DEPENDENCY();                                                                               \
        moe_down_combine<W>(down, act, slot_expert, slot_row, slot_w, slots, shared, logits, ld, gate_col,  \
                            residual, rows, h, inter, vec);                                                 \
    }

MOE_DOWN_COMBINE_KERNEL(bf16, bf16_t, 3)
MOE_DOWN_COMBINE_KERNEL(f32, float, 2)

// ---------------------------------------------------------------------------------------------------------
// Grid (T, ceil(H / blockDim)), thread per output column. y: [T * top_k, H] (unweighted expert outputs by
// slot); pick_slot / pick_w: [T, top_k] in ascending expert id; shared: [T, H] or null, gated by
// sigmoid(logits[row, gate_col]); residual: [T, H]. delta starts at 0 and takes each term rounded as the
// CPU does (y * w, then the add; g * shared), then residual += delta. Memory floor: (top_k + 3) * H * 4
// bytes per row (y stays in L2).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const u32* __restrict__ pick_slot,
                                       const float* __restrict__ pick_w, u32 top_k,
                                       const float* __restrict__ shared, const float* __restrict__ logits, u32 ld,
                                       u32 gate_col, float* __restrict__ residual, u32 h) {
    DF_GRID_DEPENDENCY();
    __shared__ u32 slots[MOE_MAX_TOPK];
    __shared__ float w[MOE_MAX_TOPK];
    const u64 row = blockIdx.x;
    for (u32 t = threadIdx.x; t < top_k; t += blockDim.x) {
        slots[t] = pick_slot[row * top_k + t];
        w[t] = pick_w[row * top_k + t];
    }
    __syncthreads();
    const u32 c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= h) return;
    float acc = 0.0f;
#pragma unroll 8
    for (u32 t = 0; t < top_k; ++t) acc = __fadd_rn(acc, __fmul_rn(y[(u64)slots[t] * h + c], w[t]));
    if (shared != nullptr) {
        const float g = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-logits[row * ld + gate_col])));
        acc = __fadd_rn(acc, __fmul_rn(g, shared[row * h + c]));
    }
    residual[row * h + c] = __fadd_rn(residual[row * h + c], acc);
}
