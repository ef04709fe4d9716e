// Kernels only block drafters use: DFlash2's grouped dynamic convolution, and the summary of a pass's draft logits
// that replaces reading every logit back (src/cuda/ops/drafter.rs).

// One row's convolution at column c, in dflash_conv's order.
__device__ __forceinline__ float dflash_conv_at(const float* __restrict__ x, const float* __restrict__ coef,
                                                const float* __restrict__ base, u32 row, u32 reach, u32 c,
                                                u32 hidden, u32 taps, u32 groups) {
    const u32 group = c / (hidden / groups);
    float acc = 0.0f;
    for (u32 t = 0; t < taps && t < reach; ++t) {
        const float xv = x[(u64)(row - t) * hidden + c];
        acc = __fadd_rn(acc, __fmul_rn(base[(u64)t * hidden + c], xv));
        acc = __fadd_rn(acc, __fmul_rn(coef[t * groups + group], xv));
    }
    return acc;
}

// DFlash2's grouped dynamic depthwise convolution of one side (prepare or finish) over the rows of drafter blocks;
// CPU twin: DynamicConv::convolve in the models crate.
//   out[i, c] = sum_t base[t, c] * x[i - t, c] + dyn[i, t * groups + c / group_size] * x[i - t, c]
// for t < min(taps, i - block_start[i] + 1): taps never reach into an earlier block. The two products are added
// one at a time, tap by tap, rounded as the CPU rounds them. x, out: [rows, hidden]; dyn: [rows, dyn_ld] with this
// side's taps x groups coefficients at column dyn_col; base: [taps, hidden] (this side's). Grid (hidden / 256,
// rows).
extern "C" __global__ void dflash_conv(const float* __restrict__ x, const float* __restrict__ dyn, u32 dyn_ld,
                                       u32 dyn_col, const float* __restrict__ base,
                                       const u32* __restrict__ block_start, float* __restrict__ out, u32 hidden,
                                       u32 taps, u32 groups) {
    DF_GRID_DEPENDENCY();
    const u32 row = blockIdx.y;
    const u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    const u32 reach = row - min(block_start[row], row) + 1;  // a start past the row reads the row alone
    const float* coef = dyn + (u64)row * dyn_ld + dyn_col;
    out[(u64)row * hidden + c] = dflash_conv_at(x, coef, base, row, reach, c, hidden, taps, groups);
}

// The finish side of a sublayer in one launch: residual += dflash_conv(x), then out = rms_norm(residual) * w, each
// value rounded as dflash_conv then add_rms_norm round it (the same threads take the same columns, so the norm's
// sum is added in the same order: bit for bit the two launches' results). x is the sublayer's output, read at this
// row and the block's rows before it; nothing here writes it. Grid: one block of 256 threads a row.
extern "C" __global__ void dflash_conv_add_rms_norm(float* __restrict__ residual, const float* __restrict__ x,
                                                    const float* __restrict__ dyn, u32 dyn_ld, u32 dyn_col,
                                                    const float* __restrict__ base,
                                                    const u32* __restrict__ block_start,
                                                    const float* __restrict__ w, float* __restrict__ out,
                                                    u32 hidden, u32 taps, u32 groups, float eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    const u32 row = blockIdx.x;
    const u32 reach = row - min(block_start[row], row) + 1;
    const float* coef = dyn + (u64)row * dyn_ld + dyn_col;
    float* rr = residual + (u64)row * hidden;
    float sum_sq = 0.0f;
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) {
        const float v = __fadd_rn(rr[c], dflash_conv_at(x, coef, base, row, reach, c, hidden, taps, groups));
        rr[c] = v;
        sum_sq = fmaf(v, v, sum_sq);
    }
    const float mean = block_sum(sum_sq, scratch) / (float)hidden;
    const float inv = 1.0f / sqrtf(mean + eps);
    float* orow = out + (u64)row * hidden;
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) orow[c] = __fmul_rn(__fmul_rn(rr[c], inv), w[c]);
}

// The most candidates per row draft_top_k keeps; the logits one partial block sorts (at most; a power of two);
// the candidates the merge sorts (a power of two), which bounds partial blocks x k; threads per block.
#define DRAFT_TOP_K_MAX 32
#define DRAFT_TOP_K_CHUNK_MAX 4096
#define DRAFT_TOP_K_MERGE 2048
#define DRAFT_TOP_K_THREADS 256
#define DRAFT_NO_COLUMN 0xffffffffu

// Is (v_b, i_b) ranked before (v_a, i_a)? Numbers before NaN, larger values first, then lower columns: the order of
// ops::top_k (src/ops/reduce.rs). DRAFT_NO_COLUMN marks no candidate, ranked after everything.
__device__ __forceinline__ bool draft_ranks_before(float v_b, u32 i_b, float v_a, u32 i_a) {
    if (i_b == DRAFT_NO_COLUMN) return false;
    if (i_a == DRAFT_NO_COLUMN) return true;
    const bool nan_b = v_b != v_b, nan_a = v_a != v_a;
    if (nan_b != nan_a) return nan_a;
    if (nan_b) return i_b < i_a;
    return v_b > v_a || (v_b == v_a && i_b < i_a);
}

// Merges two partial softmax sums: (m, s) holds s = sum exp(x - m) over the values seen, m their maximum.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
    const float top = fmaxf(m, m2);
    if (top == DF_NEG_INF) return;  // nothing but -inf on either side
    s = s * expf(m - top) + s2 * expf(m2 - top);
    m = top;
}

// Sorts n pairs (a power of two) in shared memory, best first in draft_ranks_before's order (a bitonic network:
// columns are unique, so the order is total and the result does not depend on the network).
__device__ void draft_sort(float* v, u32* idx, u32 n) {
    for (u32 size = 2; size <= n; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 t = threadIdx.x; t < n / 2; t += blockDim.x) {
                const u32 a = 2 * t - (t & (stride - 1)), b = a + stride;
                const bool best_first = (a & size) == 0;
                if (draft_ranks_before(v[b], idx[b], v[a], idx[a]) == best_first) {
                    const float tv = v[a];
                    const u32 ti = idx[a];
                    v[a] = v[b];
                    idx[a] = idx[b];
                    v[b] = tv;
                    idx[b] = ti;
                }
            }
            __syncthreads();
        }
    }
}

// (m, s) of the block's threads merged; thread 0 returns it. `scratch`: 2 * warps floats.
__device__ __forceinline__ void block_softmax_merge(float& m, float& s, float* scratch) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        softmax_merge(m, s, __shfl_xor_sync(DF_FULL_MASK, m, offset), __shfl_xor_sync(DF_FULL_MASK, s, offset));
    }
    if (lane == 0) {
        scratch[warp] = m;
        scratch[warps + warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 w = 1; w < warps; ++w) softmax_merge(m, s, scratch[w], scratch[warps + w]);
    }
}

// Block (p, r)'s chunk of row r (logits p * chunk .., [rows, row_len]) scaled as the drafter's head scales them into
// sv / si [chunk] (NaN and DRAFT_NO_COLUMN past the row), and the chunk's softmax partial (m, s) for thread 0. The
// whole block calls it; it ends with a barrier.
__device__ void draft_scaled_chunk(const float* __restrict__ logits, u32 row_len, u32 chunk, float multiplier,
                                   float softcap, float* sv, u32* si, float& m, float& s, float* scratch) {
    const u32 first = blockIdx.x * chunk;
    const float* row = logits + (u64)blockIdx.y * row_len;
    m = DF_NEG_INF;
    s = 0.0f;
    for (u32 j = threadIdx.x; j < chunk; j += blockDim.x) {
        const u32 c = first + j;
        float v = DF_NAN;
        if (c < row_len) {
            v = row[c] * multiplier;
            if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
            if (v > m) {  // false for NaN and -inf, which add nothing
                s = s * expf(m - v) + 1.0f;
                m = v;
            } else if (v == v && v != DF_NEG_INF) {
                s += expf(v - m);
            }
        }
        sv[j] = v;
        si[j] = c < row_len ? c : DRAFT_NO_COLUMN;
    }
    block_softmax_merge(m, s, scratch);
    __syncthreads();
}

// The top probability of a row from its parts' softmax partials (`src`: the row's parts, `stride` u32s each, (m, s)
// after the 2k candidates): 1 / the merged sum, or 1 / row_len where every value was -inf (the CPU's uniform row).
__device__ float draft_top_probability(const u32* src, u32 parts, u32 stride, u32 k, u32 row_len) {
    float m = DF_NEG_INF, s = 0.0f;
    for (u32 p = 0; p < parts; ++p) {
        softmax_merge(m, s, __uint_as_float(src[p * stride + 2u * k]), __uint_as_float(src[p * stride + 2u * k + 1u]));
    }
    return m == DF_NEG_INF ? 1.0f / (float)row_len : 1.0f / s;
}

// The draft logits' summary, in two launches. draft_top_k_part, grid (parts, rows), DRAFT_TOP_K_THREADS threads:
// block (p, r) scales logits p * chunk .. (p + 1) * chunk of row r as the drafter's head scales them (times
// `multiplier`, then tanh(v / softcap) * softcap when softcap > 0), sorts them in shared memory and writes its best
// k and its softmax partial (m, s) to part[r, p] = [k columns, k value bits, m bits, s bits] (u32 [rows, parts,
// 2k + 2]). draft_top_k_merge, grid rows: sorts the parts' candidates of a row and writes out[row] = [k columns, k
// value bits, top probability bits] (u32 [rows, 2k + 1]): the k best columns in ops::top_k's order
// (DRAFT_NO_COLUMN and NaN past a row of fewer than k) and the softmax probability of the best one (NaNs skipped;
// 1 / row_len when every value is -inf, as the CPU's softmax makes such a row uniform). CPU twin: scale, then
// ops::top_k and ops::softmax_in_place. One block per row took 122 us for 8 rows of 8,192 on an H100 (its loads
// one at a time per thread, PERFORMANCE.md entry 86); the parts spread a row over the GPU.
extern "C" __global__ void __launch_bounds__(DRAFT_TOP_K_THREADS)
    draft_top_k_part(const float* __restrict__ logits, u32 row_len, u32 chunk, u32 k, float multiplier,
                     float softcap, u32* __restrict__ part) {
    DF_GRID_DEPENDENCY();
    __shared__ float sv[DRAFT_TOP_K_CHUNK_MAX];
    __shared__ u32 si[DRAFT_TOP_K_CHUNK_MAX];
    __shared__ float scratch[2 * DRAFT_TOP_K_THREADS / 32];
    float m, s;
    draft_scaled_chunk(logits, row_len, chunk, multiplier, softcap, sv, si, m, s, scratch);
    draft_sort(sv, si, chunk);
    u32* dst = part + ((u64)blockIdx.y * gridDim.x + blockIdx.x) * (2u * k + 2u);
    for (u32 r = threadIdx.x; r < k; r += blockDim.x) {
        dst[r] = si[r];
        dst[k + r] = __float_as_uint(sv[r]);
    }
    if (threadIdx.x == 0) {
        dst[2u * k] = __float_as_uint(m);
        dst[2u * k + 1u] = __float_as_uint(s);
    }
}

extern "C" __global__ void __launch_bounds__(DRAFT_TOP_K_THREADS)
    draft_top_k_merge(const u32* __restrict__ part, u32 parts, u32 row_len, u32 k, u32* __restrict__ out) {
    DF_GRID_DEPENDENCY();
    __shared__ float sv[DRAFT_TOP_K_MERGE];
    __shared__ u32 si[DRAFT_TOP_K_MERGE];
    const u32 stride = 2u * k + 2u, count = parts * k;
    const u32* src = part + (u64)blockIdx.x * parts * stride;
    u32 n = 1;
    while (n < count) n <<= 1;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        const u32 p = j / k, r = j - p * k;
        sv[j] = j < count ? __uint_as_float(src[p * stride + k + r]) : DF_NAN;
        si[j] = j < count ? src[p * stride + r] : DRAFT_NO_COLUMN;
    }
    __syncthreads();
    draft_sort(sv, si, n);
    u32* dst = out + (u64)blockIdx.x * (2u * k + 1u);
    for (u32 r = threadIdx.x; r < k; r += blockDim.x) {
        dst[r] = si[r];
        dst[k + r] = __float_as_uint(sv[r]);
    }
    if (threadIdx.x == 0) dst[2u * k] = __float_as_uint(draft_top_probability(src, parts, stride, k, row_len));
}

// The summary by selection rather than sorting (draft_top_k_part_select / draft_top_k_merge_select: the same
// arguments and outputs as draft_top_k_part / draft_top_k_merge, bit for bit). A block wants k <= 32 of up to 4,096
// values, where the sorts' bitonic networks (66 barrier-separated stages for 2,048) took 0.17 ms over a step of 16
// rows of 151,936 (PERFORMANCE.md entry 116). Here each warp takes its slice's best k in k rounds of a warp-wide
// best, with no barrier, and one warp merges the warps' lists the same way.

// The best head of this lane's runs (j = lane, lane + 32, ... < runs; run j: v / idx [j * run_len, +run_len), best
// first, its next entry at pos[j]; runs of at most DRAFT_TOP_K_MAX) into (bv, bi, brun); DRAFT_NO_COLUMN and NaN
// when its runs are spent.
__device__ __forceinline__ void lane_best_head(const float* v, const u32* idx, u32 runs, u32 run_len,
                                               const unsigned char* pos, float& bv, u32& bi, u32& brun) {
    bv = DF_NAN;
    bi = DRAFT_NO_COLUMN;
    for (u32 j = threadIdx.x & 31u; j < runs; j += 32) {
        const u32 p = pos[j];
        if (p >= run_len) continue;
        const float cv = v[j * run_len + p];
        const u32 ci = idx[j * run_len + p];
        if (draft_ranks_before(cv, ci, bv, bi)) {
            bv = cv;
            bi = ci;
            brun = j;
        }
    }
}

// The best `k` of `runs` sorted runs by one warp, best first in draft_ranks_before's order, into out_v / out_i [k]:
// each round the warp's best head (a butterfly over the lanes' best heads; columns are unique, so every lane finds
// the same one) is written and its run advances. `pos` [runs]: zeroed by the caller; lane l reads and writes only
// its runs' entries. Past the candidates: DRAFT_NO_COLUMN and NaN.
__device__ void warp_best_of_runs(const float* v, const u32* idx, u32 runs, u32 run_len, unsigned char* pos, u32 k,
                                  float* out_v, u32* out_i) {
    float bv;
    u32 bi, brun = 0;
    lane_best_head(v, idx, runs, run_len, pos, bv, bi, brun);
    for (u32 r = 0; r < k; ++r) {
        float wv = bv;
        u32 wi = bi;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(DF_FULL_MASK, wv, offset);
            const u32 oi = __shfl_xor_sync(DF_FULL_MASK, wi, offset);
            if (draft_ranks_before(ov, oi, wv, wi)) {
                wv = ov;
                wi = oi;
            }
        }
        if ((threadIdx.x & 31u) == 0) {
            out_v[r] = wv;
            out_i[r] = wi;
        }
        if (wi != DRAFT_NO_COLUMN && bi == wi) {
            pos[brun] += 1;
            lane_best_head(v, idx, runs, run_len, pos, bv, bi, brun);
        }
    }
}

// The block's `warps` lists [warps, k] (best first each) merged by warp 0 into the block's best k, written as a
// summary's first 2k u32s at dst (k columns, then k value bits). The whole block calls it.
__device__ void merge_warp_lists(const float* wv, const u32* wi, u32 warps, unsigned char* pos, u32 k, float* fv,
                                 u32* fi, u32* __restrict__ dst) {
    __syncthreads();  // every warp's list written, and its runs' positions no longer read
    if (threadIdx.x < warps) pos[threadIdx.x] = 0;
    __syncthreads();
    if (threadIdx.x < 32) warp_best_of_runs(wv, wi, warps, k, pos, k, fv, fi);
    __syncthreads();
    for (u32 r = threadIdx.x; r < k; r += blockDim.x) {
        dst[r] = fi[r];
        dst[k + r] = __float_as_uint(fv[r]);
    }
}

extern "C" __global__ void __launch_bounds__(DRAFT_TOP_K_THREADS)
    draft_top_k_part_select(const float* __restrict__ logits, u32 row_len, u32 chunk, u32 k, float multiplier,
                            float softcap, u32* __restrict__ part) {
    DF_GRID_DEPENDENCY();
    constexpr u32 WARPS = DRAFT_TOP_K_THREADS / 32;
    __shared__ float sv[DRAFT_TOP_K_CHUNK_MAX];
    __shared__ u32 si[DRAFT_TOP_K_CHUNK_MAX];
    __shared__ unsigned char pos[DRAFT_TOP_K_CHUNK_MAX];
    __shared__ float wv[WARPS * DRAFT_TOP_K_MAX], fv[DRAFT_TOP_K_MAX];
    __shared__ u32 wi[WARPS * DRAFT_TOP_K_MAX], fi[DRAFT_TOP_K_MAX];
    __shared__ float scratch[2 * WARPS];
    for (u32 j = threadIdx.x; j < chunk; j += blockDim.x) pos[j] = 0;
    float m, s;
    draft_scaled_chunk(logits, row_len, chunk, multiplier, softcap, sv, si, m, s, scratch);
    // Warp w takes values [w * slice, +slice) as runs of one.
    const u32 warp = threadIdx.x >> 5, slice = (chunk + WARPS - 1) / WARPS;
    const u32 lo = min(chunk, warp * slice), n = min(chunk, lo + slice) - lo;
    warp_best_of_runs(sv + lo, si + lo, n, 1, pos + lo, k, wv + warp * k, wi + warp * k);
    u32* dst = part + ((u64)blockIdx.y * gridDim.x + blockIdx.x) * (2u * k + 2u);
    merge_warp_lists(wv, wi, WARPS, pos, k, fv, fi, dst);
    if (threadIdx.x == 0) {
        dst[2u * k] = __float_as_uint(m);
        dst[2u * k + 1u] = __float_as_uint(s);
    }
}

extern "C" __global__ void __launch_bounds__(DRAFT_TOP_K_THREADS)
    draft_top_k_merge_select(const u32* __restrict__ part, u32 parts, u32 row_len, u32 k, u32* __restrict__ out) {
    DF_GRID_DEPENDENCY();
    constexpr u32 WARPS = DRAFT_TOP_K_THREADS / 32;
    __shared__ float sv[DRAFT_TOP_K_MERGE];
    __shared__ u32 si[DRAFT_TOP_K_MERGE];
    __shared__ unsigned char pos[DRAFT_TOP_K_MERGE];
    __shared__ float wv[WARPS * DRAFT_TOP_K_MAX], fv[DRAFT_TOP_K_MAX];
    __shared__ u32 wi[WARPS * DRAFT_TOP_K_MAX], fi[DRAFT_TOP_K_MAX];
    const u32 stride = 2u * k + 2u, count = parts * k;
    const u32* src = part + (u64)blockIdx.x * parts * stride;
    for (u32 j = threadIdx.x; j < count; j += blockDim.x) {
        const u32 p = j / k, r = j - p * k;
        sv[j] = __uint_as_float(src[p * stride + k + r]);
        si[j] = src[p * stride + r];
    }
    for (u32 p = threadIdx.x; p < parts; p += blockDim.x) pos[p] = 0;
    __syncthreads();
    // Warp w takes parts [w * per, +per), each part's list a run of k.
    const u32 warp = threadIdx.x >> 5, per = (parts + WARPS - 1) / WARPS;
    const u32 lo = min(parts, warp * per), n = min(parts, lo + per) - lo;
    warp_best_of_runs(sv + lo * k, si + lo * k, n, k, pos + lo, k, wv + warp * k, wi + warp * k);
    u32* dst = out + (u64)blockIdx.x * (2u * k + 1u);
    merge_warp_lists(wv, wi, WARPS, pos, k, fv, fi, dst);
    if (threadIdx.x == 0) dst[2u * k] = __float_as_uint(draft_top_probability(src, parts, stride, k, row_len));
}

// The lane of the warp's first best candidate: the lowest lane among the largest scores (NaN and DRAFT_NO_COLUMN
// never win); 32 when no lane has one.
__device__ __forceinline__ u32 walk_best_lane(float score, u32 id) {
    float best = score;
    u32 at = score == score && id != DRAFT_NO_COLUMN ? (threadIdx.x & 31u) : 32u;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float ob = __shfl_xor_sync(DF_FULL_MASK, best, offset);
        const u32 oa = __shfl_xor_sync(DF_FULL_MASK, at, offset);
        if (oa < 32u && (at == 32u || ob > best || (ob == best && oa < at))) {
            best = ob;
            at = oa;
        }
    }
    return at;
}

// DFlash2's greedy candidate walk over a pass's summaries, one warp per drafted block; CPU twin: the greedy
// CandidateSelector::walk in the models crate. Block b's rows are first[b] .. first[b] + width[b] (its anchor, then
// its slots); for each slot row i the candidates are the summary's k columns of row i (`summary` [rows, 2k + 1],
// draft-head columns, mapped to target ids through `token_ids` when it is not null) with their values. The walk
// starts from the anchor's token, and each slot takes the candidate of best score = value + sum_j (pred_code[prev][j]
// * projected[i][j]) * succ_code[cand][j] (the first best on ties, as ops::argmax), writing the target id to path[i]
// (u32 [rows]; DRAFT_NO_COLUMN where no candidate is valid; the anchors' rows untouched). The products and sums are
// rounded one at a time, in the CPU's order. projected: [rows, rank], the hidden states through the selector's
// projection (a matmul before this kernel). Grid: blocks; 32 threads (lane c scores candidate c; k <= 32).
extern "C" __global__ void __launch_bounds__(32)
    dflash2_walk(const u32* __restrict__ summary, u32 k, const u32* __restrict__ token_ids,
                 const float* __restrict__ projected, u32 rank, const float* __restrict__ pred_code,
                 const float* __restrict__ succ_code, u32 codes, const u32* __restrict__ first,
                 const u32* __restrict__ width, const u32* __restrict__ anchor, u32* __restrict__ path) {
    DF_GRID_DEPENDENCY();
    const u32 b = blockIdx.x, row0 = first[b] + 1, slots = width[b] - 1, lane = threadIdx.x;
    u32 prev = anchor[b];
    for (u32 s = 0; s < slots; ++s) {
        const u32* row = summary + (u64)(row0 + s) * (2u * k + 1u);
        float score = DF_NEG_INF;
        u32 id = DRAFT_NO_COLUMN;
        if (lane < k && row[lane] != DRAFT_NO_COLUMN) {
            id = token_ids != nullptr ? token_ids[row[lane]] : row[lane];
            if (id < codes && prev < codes) {
                const float* a = pred_code + (u64)prev * rank;
                const float* bc = succ_code + (u64)id * rank;
                const float* pr = projected + (u64)(row0 + s) * rank;
                float sum = 0.0f;
                for (u32 j = 0; j < rank; ++j) sum = __fadd_rn(sum, __fmul_rn(__fmul_rn(a[j], pr[j]), bc[j]));
                score = __fadd_rn(__uint_as_float(row[k + lane]), sum);
            } else {
                id = DRAFT_NO_COLUMN;
            }
        }
        const u32 at = walk_best_lane(score, id);
        const u32 chosen = __shfl_sync(DF_FULL_MASK, id, at < 32u ? at : 0u);
        prev = at < 32u ? chosen : prev;
        if (lane == 0) path[row0 + s] = at < 32u ? chosen : DRAFT_NO_COLUMN;
    }
}

// dflash2_walk with each slot's operands staged in shared memory first (the default where it fits; DFLASH_DRAFT_WALK=plain keeps the other): the k candidates'
// successor rows, the slot's projected row and the predecessor row of the token before it, every element copied by
// cp.async with none waited on until all are issued (one memory round trip a slot), so that a lane's sum over the
// rank reads shared memory instead of waiting on its own row's loads (0.14-0.17 ms for a walk of 15 slots at rank
// 256, PERFORMANCE.md entry 116). The same products and sums in the same order: the same path, bit for bit.
// Dynamic shared memory: k (rank | 1) + 2 rank floats (candidate rows at an odd stride, so the lanes' reads of a
// term fall in distinct banks).
__device__ __forceinline__ void walk_cp_async4(float* smem, const float* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem) : "memory");
}

extern "C" __global__ void __launch_bounds__(32)
    dflash2_walk_staged(const u32* __restrict__ summary, u32 k, const u32* __restrict__ token_ids,
                        const float* __restrict__ projected, u32 rank, const float* __restrict__ pred_code,
                        const float* __restrict__ succ_code, u32 codes, const u32* __restrict__ first,
                        const u32* __restrict__ width, const u32* __restrict__ anchor, u32* __restrict__ path) {
    DF_GRID_DEPENDENCY();
    extern __shared__ float walk_smem[];
    const u32 b = blockIdx.x, row0 = first[b] + 1, slots = width[b] - 1, lane = threadIdx.x, stride = rank | 1u;
    float* cand = walk_smem;          // [k, rank | 1]: candidate c's successor row
    float* pred = cand + k * stride;  // [rank]: the previous token's predecessor row
    float* proj = pred + rank;        // [rank]: the slot's projected hidden state
    u32 prev = anchor[b];
    for (u32 s = 0; s < slots; ++s) {
        const u32* row = summary + (u64)(row0 + s) * (2u * k + 1u);
        u32 id = DRAFT_NO_COLUMN;
        if (lane < k && row[lane] != DRAFT_NO_COLUMN) {
            id = token_ids != nullptr ? token_ids[row[lane]] : row[lane];
            if (!(id < codes && prev < codes)) id = DRAFT_NO_COLUMN;
        }
        for (u32 c = 0; c < k; ++c) {
            const u32 cid = __shfl_sync(DF_FULL_MASK, id, c);
            if (cid == DRAFT_NO_COLUMN) continue;  // the same for every lane
            const float* src = succ_code + (u64)cid * rank;
            for (u32 j = lane; j < rank; j += 32) walk_cp_async4(cand + c * stride + j, src + j);
        }
        const float* pr = projected + (u64)(row0 + s) * rank;
        for (u32 j = lane; j < rank; j += 32) {
            walk_cp_async4(proj + j, pr + j);
            if (prev < codes) walk_cp_async4(pred + j, pred_code + (u64)prev * rank + j);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncwarp();  // every lane's copies landed and visible to the warp
        float score = DF_NEG_INF;
        if (id != DRAFT_NO_COLUMN) {
            const float* bc = cand + lane * stride;
            float sum = 0.0f;
            for (u32 j = 0; j < rank; ++j) sum = __fadd_rn(sum, __fmul_rn(__fmul_rn(pred[j], proj[j]), bc[j]));
            score = __fadd_rn(__uint_as_float(row[k + lane]), sum);
        }
        const u32 at = walk_best_lane(score, id);
        const u32 chosen = __shfl_sync(DF_FULL_MASK, id, at < 32u ? at : 0u);
        prev = at < 32u ? chosen : prev;
        if (lane == 0) path[row0 + s] = at < 32u ? chosen : DRAFT_NO_COLUMN;
        __syncwarp();  // every lane's reads done before the next slot's rows overwrite them
    }
}

