// Row reductions; CPU twin of argmax in src/ops/reduce.rs.
//
// argmax runs in two passes so that a single row (batch-1 decode over a 150K vocabulary) is spread over
// many SMs: argmax_partial reduces chunks of ARGMAX_CHUNK elements of every row, one block each, and
// argmax_finish reduces each row's partial results. Memory floor: read rows * row_len * 4 bytes (the
// partials are 8 bytes per chunk); one 152K-logit row is 0.6 MB, about 0.14 us at 4.3 TB/s, so a
// single row is bound by the two launches, not by memory.

#define DF_NO_INDEX 0xffffffffu

// Is (v_b, i_b) a better argmax candidate than (v_a, i_a)? Larger value wins, then the lower index;
// DF_NO_INDEX marks "no candidate" (every value seen was NaN).
__device__ __forceinline__ bool argmax_better(float v_b, u32 i_b, float v_a, u32 i_a) {
    if (i_b == DF_NO_INDEX) return false;
    if (i_a == DF_NO_INDEX) return true;
    return v_b > v_a || (v_b == v_a && i_b < i_a);
}

__device__ __forceinline__ void warp_argmax(float& best, u32& idx) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(DF_FULL_MASK, best, offset);
        const u32 j = __shfl_xor_sync(DF_FULL_MASK, idx, offset);
        if (argmax_better(v, j, best, idx)) {
            best = v;
            idx = j;
        }
    }
}

// Reduces every thread's (best, idx) over the block; the result is valid in thread 0.
// blockDim.x must be a multiple of 32.
__device__ __forceinline__ void block_argmax(float& best, u32& idx) {
    __shared__ float best_vals[32];
    __shared__ u32 best_idxs[32];
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    warp_argmax(best, idx);
    if (lane == 0) {
        best_vals[warp] = best;
        best_idxs[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const u32 warps = blockDim.x >> 5;
        best = lane < warps ? best_vals[lane] : DF_NEG_INF;
        idx = lane < warps ? best_idxs[lane] : DF_NO_INDEX;
        warp_argmax(best, idx);
    }
}

// Pass 1. Grid (chunks, rows): block (c, r) reduces logits[r, c * chunk_len .. (c + 1) * chunk_len) and
// writes its (value, index) to part_vals / part_idxs[r * chunks + c] (index DF_NO_INDEX if all NaN).
extern "C" __global__ void argmax_partial(const float* __restrict__ logits, float* __restrict__ part_vals,
                                          u32* __restrict__ part_idxs, u32 row_len, u32 chunk_len) {
    DF_GRID_DEPENDENCY();
    const u64 row = blockIdx.y;
    const u32 begin = blockIdx.x * chunk_len;
    const u32 end = min(begin + chunk_len, row_len);
    const float* r = logits + row * row_len;
    float best = DF_NEG_INF;
    u32 idx = DF_NO_INDEX;
    // Each thread visits increasing indices, so a strict > keeps its lowest index among equals.
    for (u32 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float v = r[i];
        if (v > best || (idx == DF_NO_INDEX && v == v)) {
            best = v;
            idx = i;
        }
    }
    block_argmax(best, idx);
    if (threadIdx.x == 0) {
        part_vals[row * gridDim.x + blockIdx.x] = best;
        part_idxs[row * gridDim.x + blockIdx.x] = idx;
    }
}

// Pass 2. One block per row: out[r] = the best of the row's `chunks` partials, 0 if there is none (an
// empty or all-NaN row).
extern "C" __global__ void argmax_finish(const float* __restrict__ part_vals, const u32* __restrict__ part_idxs,
                                         u32* __restrict__ out, u32 chunks) {
    DF_GRID_DEPENDENCY();
    const u64 base = (u64)blockIdx.x * chunks;
    float best = DF_NEG_INF;
    u32 idx = DF_NO_INDEX;
    for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
        const float v = part_vals[base + c];
        const u32 j = part_idxs[base + c];
        if (argmax_better(v, j, best, idx)) {
            best = v;
            idx = j;
        }
    }
    block_argmax(best, idx);
    if (threadIdx.x == 0) out[blockIdx.x] = idx == DF_NO_INDEX ? 0u : idx;
}

// Masked argmax: one block per masked row. Block m reduces logits row rows[m] (a row of `row_len`) over the ids
// whose bit is set in masks[m] (`words` 32-bit words, bit i % 32 of word i / 32) and writes the winner to
// out[rows[m]], keeping the unmasked argmax there when no allowed value is a number. Largest value wins, then the
// lower id, as in argmax_partial; twin of masked_argmax in src/ops/filter.rs. It runs after the step's argmax
// (graph or eager), so rows without a mask keep theirs.
extern "C" __global__ void argmax_masked(const float* __restrict__ logits, const u32* __restrict__ masks,
                                         const u32* __restrict__ rows, u32* __restrict__ out, u32 row_len,
                                         u32 words) {
    const u32 row = rows[blockIdx.x];
    const float* r = logits + (u64)row * row_len;
    const u32* m = masks + (u64)blockIdx.x * words;
    const u32 end = min(row_len, words * 32u);
    float best = DF_NEG_INF;
    u32 idx = DF_NO_INDEX;
    for (u32 i = threadIdx.x; i < end; i += blockDim.x) {
        if (((m[i >> 5] >> (i & 31u)) & 1u) == 0u) continue;
        const float v = r[i];
        if (v > best || (idx == DF_NO_INDEX && v == v)) {
            best = v;
            idx = i;
        }
    }
    block_argmax(best, idx);
    if (threadIdx.x == 0 && idx != DF_NO_INDEX) out[row] = idx;
}
