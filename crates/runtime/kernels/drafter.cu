// Kernels only block drafters use: DFlash2's grouped dynamic convolution, and the summary of a pass's draft logits
// that replaces reading every logit back (src/cuda/ops/drafter.rs).

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
    const u32 group = c / (hidden / groups);
    const u32 reach = row - min(block_start[row], row) + 1;  // a start past the row reads the row alone
    const float* coef = dyn + (u64)row * dyn_ld + dyn_col;
    float acc = 0.0f;
    for (u32 t = 0; t < taps && t < reach; ++t) {
        const float xv = x[(u64)(row - t) * hidden + c];
        acc = __fadd_rn(acc, __fmul_rn(base[(u64)t * hidden + c], xv));
        acc = __fadd_rn(acc, __fmul_rn(coef[t * groups + group], xv));
    }
    out[(u64)row * hidden + c] = acc;
}

// The most candidates per row draft_top_k keeps, and its threads per block (one block per row).
#define DRAFT_TOP_K_MAX 32
#define DRAFT_TOP_K_THREADS 128
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

// The draft logits' summary, one block of DRAFT_TOP_K_THREADS per row: every value scaled as the drafter's head
// scales it (times `multiplier`, then tanh(v / softcap) * softcap when softcap > 0), then out[row] =
// [k columns, k value bits, top probability bits] (u32 [rows, 2k + 1]): the k best columns in ops::top_k's order
// (DRAFT_NO_COLUMN and NaN past a row of fewer than k) and the softmax probability of the best one (NaNs skipped;
// 1 / row_len when every value is -inf, as the CPU's softmax makes such a row uniform). CPU twin: scale, then
// ops::top_k and ops::softmax_in_place.
//
// Each thread keeps the best k of its strided share in shared memory (most values fail one comparison against
// its worst), then k rounds of a block-wide pick merge the threads' lists. Memory floor: one read of the row.
extern "C" __global__ void __launch_bounds__(DRAFT_TOP_K_THREADS)
    draft_top_k(const float* __restrict__ logits, u32 row_len, u32 k, float multiplier, float softcap,
                u32* __restrict__ out) {
    DF_GRID_DEPENDENCY();
    __shared__ float kept_v[DRAFT_TOP_K_MAX][DRAFT_TOP_K_THREADS];
    __shared__ u32 kept_i[DRAFT_TOP_K_MAX][DRAFT_TOP_K_THREADS];
    __shared__ float warp_v[DRAFT_TOP_K_THREADS / 32], warp_m[DRAFT_TOP_K_THREADS / 32];
    __shared__ u32 warp_i[DRAFT_TOP_K_THREADS / 32];
    const u32 t = threadIdx.x, lane = t & 31u, warp = t >> 5;
    const float* row = logits + (u64)blockIdx.x * row_len;
    u32* dst = out + (u64)blockIdx.x * (2u * k + 1u);

    u32 count = 0;
    float worst_v = DF_NAN, m = DF_NEG_INF, s = 0.0f;
    u32 worst_i = DRAFT_NO_COLUMN;
    for (u32 i = t; i < row_len; i += DRAFT_TOP_K_THREADS) {
        float v = row[i] * multiplier;
        if (softcap > 0.0f) v = tanhf(v / softcap) * softcap;
        if (v > m) {  // false for NaN and -inf, which add nothing
            s = s * expf(m - v) + 1.0f;
            m = v;
        } else if (v == v && v != DF_NEG_INF) {
            s += expf(v - m);
        }
        if (count == k && !draft_ranks_before(v, i, worst_v, worst_i)) continue;
        u32 p = count < k ? count : k - 1;
        while (p > 0 && draft_ranks_before(v, i, kept_v[p - 1][t], kept_i[p - 1][t])) {
            kept_v[p][t] = kept_v[p - 1][t];
            kept_i[p][t] = kept_i[p - 1][t];
            --p;
        }
        kept_v[p][t] = v;
        kept_i[p][t] = i;
        if (count < k) ++count;
        worst_v = kept_v[count - 1][t];
        worst_i = kept_i[count - 1][t];
    }

    // The row's softmax denominator: the threads' partial sums merged over the block.
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        softmax_merge(m, s, __shfl_xor_sync(DF_FULL_MASK, m, offset), __shfl_xor_sync(DF_FULL_MASK, s, offset));
    }
    if (lane == 0) {
        warp_m[warp] = m;
        warp_v[warp] = s;
    }
    __syncthreads();
    if (t == 0) {
        for (u32 w = 1; w < DRAFT_TOP_K_THREADS / 32; ++w) softmax_merge(m, s, warp_m[w], warp_v[w]);
        const float top = m == DF_NEG_INF ? 1.0f / (float)row_len : 1.0f / s;
        dst[2u * k] = __float_as_uint(top);
    }
    __syncthreads();

    // k rounds: each thread offers the head of its list, the best offer is the round's pick and leaves its list.
    u32 head = 0;
    for (u32 r = 0; r < k; ++r) {
        float v = head < count ? kept_v[head][t] : DF_NAN;
        u32 i = head < count ? kept_i[head][t] : DRAFT_NO_COLUMN;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(DF_FULL_MASK, v, offset);
            const u32 oi = __shfl_xor_sync(DF_FULL_MASK, i, offset);
            if (draft_ranks_before(ov, oi, v, i)) {
                v = ov;
                i = oi;
            }
        }
        if (lane == 0) {
            warp_v[warp] = v;
            warp_i[warp] = i;
        }
        __syncthreads();
        v = warp_v[0];
        i = warp_i[0];
        for (u32 w = 1; w < DRAFT_TOP_K_THREADS / 32; ++w) {
            if (draft_ranks_before(warp_v[w], warp_i[w], v, i)) {
                v = warp_v[w];
                i = warp_i[w];
            }
        }
        if (head < count && kept_i[head][t] == i) ++head;  // columns are unique: one thread owns the pick
        if (t == 0) {
            dst[r] = i;
            dst[k + r] = __float_as_uint(v);
        }
        __syncthreads();  // every thread read the picks before the next round writes them
    }
}
