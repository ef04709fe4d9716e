// Hyper-connection residual streams (mHC): the block's collapse, its expansion back into the streams, the head's
// collapse, and the taps drafters read. CPU twin: crates/models/src/streams.rs. Streams are [T, N * H],
// stream-major per row; every kernel works on whole rows with a fixed order of operations, so a row's bits never
// depend on the others (batch invariance) and the kernels capture into graphs (no host reads).

#define STREAMS_MAX 8                                   // N <= 8: the mix weights live in shared memory
#define STREAMS_MAX_MIX ((2 + STREAMS_MAX) * STREAMS_MAX)  // pre, post and comb of one row

__device__ __forceinline__ float streams_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// A pre gate (the weight of a stream in a collapse) from its projection: sigmoid(mix * scale + base) + eps.
__device__ __forceinline__ float streams_pre(float mix, float scale, float base, float eps) {
    return streams_sigmoid(mix * scale + base) + eps;
}

// out[d] = sum_k pre[k] * s[k * hidden + d] for this row.
__device__ __forceinline__ void streams_weighted_sum(const float* s, const float* pre, u32 n, u32 hidden,
                                                    float* __restrict__ out) {
    for (u32 d = threadIdx.x; d < hidden; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 k = 0; k < n; ++k) acc = fmaf(pre[k], s[(u64)k * hidden + d], acc);
        out[d] = acc;
    }
}

// Softmax of each row of comb [n, n], + eps, then Sinkhorn: columns, then iters - 1 times rows and columns, each
// divided by its sum + eps. Lane t < n * n of warp 0 owns comb[t] (row t / n, column t % n) in a register and
// gathers its row or column with shuffles, summing in ascending order as the CPU twin does, so every owner of a
// row or column gets the same sum; the iterations need no block barrier (40 of them were the collapse's longest
// chain, PERFORMANCE.md entry 124). n * n <= 32 (n <= 5) takes this path; wider mixes go through shared memory
// (streams_sinkhorn_block, the same arithmetic). The whole block must call it; comb is final when it returns.
__device__ void streams_sinkhorn_warp(float* comb, u32 n, u32 iters, float eps) {
    const u32 t = threadIdx.x;
    if (t < 32) {
        const bool owns = t < n * n;
        const u32 j = owns ? t / n : 0, k = owns ? t % n : 0;
        const float x = owns ? comb[t] : 0.0f;
        float mx = __shfl_sync(DF_FULL_MASK, x, j * n);
        for (u32 i = 1; i < n; ++i) mx = fmaxf(mx, __shfl_sync(DF_FULL_MASK, x, j * n + i));
        float sum = 0.0f;
        for (u32 i = 0; i < n; ++i) sum += expf(__shfl_sync(DF_FULL_MASK, x, j * n + i) - mx);
        float v = expf(x - mx) / sum + eps;
        for (u32 it = 0; it < iters; ++it) {
            if (it > 0) {
                float row = 0.0f;
                for (u32 i = 0; i < n; ++i) row += __shfl_sync(DF_FULL_MASK, v, j * n + i);
                v = v / (row + eps);
            }
            float col = 0.0f;
            for (u32 i = 0; i < n; ++i) col += __shfl_sync(DF_FULL_MASK, v, i * n + k);
            v = v / (col + eps);
        }
        if (owns) comb[t] = v;
    }
    __syncthreads();
}

// streams_sinkhorn_warp's arithmetic for n * n > 32: thread t < n * n owns comb[t] and reads its row or column
// from shared memory between block barriers.
__device__ void streams_sinkhorn_block(float* comb, u32 n, u32 iters, float eps) {
    const u32 t = threadIdx.x;
    const bool owns = t < n * n;
    const u32 j = owns ? t / n : 0, k = owns ? t % n : 0;
    float v = 0.0f;
    if (owns) {
        const float* row = comb + j * n;
        float mx = row[0];
        for (u32 i = 1; i < n; ++i) mx = fmaxf(mx, row[i]);
        float sum = 0.0f;
        for (u32 i = 0; i < n; ++i) sum += expf(row[i] - mx);
        v = expf(row[k] - mx) / sum + eps;
    }
    __syncthreads();
    if (owns) comb[t] = v;
    __syncthreads();
    for (u32 it = 0; it < iters; ++it) {
        if (it > 0) {
            if (owns) {
                float sum = 0.0f;
                for (u32 i = 0; i < n; ++i) sum += comb[j * n + i];
                v = comb[t] / (sum + eps);
            }
            __syncthreads();
            if (owns) comb[t] = v;
            __syncthreads();
        }
        if (owns) {
            float sum = 0.0f;
            for (u32 i = 0; i < n; ++i) sum += comb[i * n + k];
            v = comb[t] / (sum + eps);
        }
        __syncthreads();
        if (owns) comb[t] = v;
        __syncthreads();
    }
}

__device__ __forceinline__ void streams_sinkhorn(float* comb, u32 n, u32 iters, float eps) {
    if (n * n <= 32) {
        streams_sinkhorn_warp(comb, n, iters, eps);
    } else {
        streams_sinkhorn_block(comb, n, iters, eps);
    }
}

// The connection's projection of the RMS-normalised flat streams, one block per (row, output):
// mixes[r, m] = rms(s_r) . proj[m] for s_r [n * hidden] (no weight; eps norm_eps). Spread over blocks so a decode
// step's projection (n_mix rows of n * hidden f32 weights: 1 MB at n = 4, hidden = 2560) is read by many SMs. Each
// block sums the row's squares itself (the same order in every block) rather than waiting for another.
extern "C" __global__ void streams_project(const float* __restrict__ streams, const float* __restrict__ proj,
                                          float* __restrict__ mixes, u32 width, u32 n_mix, float norm_eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    const u64 r = blockIdx.x;
    const u32 m = blockIdx.y;
    const float* s = streams + r * width;
    const float* p = proj + (u64)m * width;
    float ss = 0.0f, dot = 0.0f;
    // Four values a load where both rows allow it (the same in every block of a launch, so a row's sums keep their
    // order whatever else is in the batch).
    const u64 addresses = reinterpret_cast<u64>(streams) | reinterpret_cast<u64>(proj);
    const bool vec = (width & 3u) == 0 && (addresses & 15u) == 0;
    if (vec) {
        const float4* s4 = reinterpret_cast<const float4*>(s);
        const float4* p4 = reinterpret_cast<const float4*>(p);
        for (u32 i = threadIdx.x; i < width / 4; i += blockDim.x) {
            const float4 a = s4[i], b = p4[i];
            ss = fmaf(a.x, a.x, fmaf(a.y, a.y, fmaf(a.z, a.z, fmaf(a.w, a.w, ss))));
            dot = fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, dot))));
        }
    } else {
        for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
            ss = fmaf(s[i], s[i], ss);
            dot = fmaf(s[i], p[i], dot);
        }
    }
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)width + norm_eps);
    const float total = block_sum(dot, scratch);
    if (threadIdx.x == 0) mixes[r * n_mix + m] = total * inv;
}

// A row's gates from its projection `mix` [(2 + n) * n] in shared memory: post (written to post_out [n]) =
// 2 sigmoid(.), pre (left in mix[0 .. n]) = sigmoid(.) + eps, comb (left in mix[2n ..] and written to comb_out
// [n * n]) = Sinkhorn(softmax(.) + eps); base [(2 + n) * n] and scale [3] (pre, post, comb). The whole block calls it.
__device__ void streams_gates(float* mix, const float* __restrict__ base, const float* __restrict__ scale,
                              float* __restrict__ post_out, float* __restrict__ comb_out, u32 n, u32 iters,
                              float eps) {
    float* comb = mix + 2 * n;
    const u32 t = threadIdx.x;
    float pre = 0.0f, logit = 0.0f;
    if (t < n) {
        post_out[t] = 2.0f * streams_sigmoid(mix[n + t] * scale[1] + base[n + t]);
        pre = streams_pre(mix[t], scale[0], base[t], eps);
    }
    if (t < n * n) logit = comb[t] * scale[2] + base[2 * n + t];
    __syncthreads();
    if (t < n) mix[t] = pre;
    if (t < n * n) comb[t] = logit;
    __syncthreads();
    streams_sinkhorn(comb, n, iters, eps);
    if (t < n * n) comb_out[t] = comb[t];
}

// A block's entry through its hyper-connection, one block per row, from streams_project's mixes [T, (2 + n) * n]:
// writes the block's input collapsed [T, hidden] = sum_k pre_k * s_k, and post [T, n], comb [T, n * n] for
// streams_expand (streams_gates).
extern "C" __global__ void streams_collapse(const float* __restrict__ streams, const float* __restrict__ mixes,
                                           const float* __restrict__ base, const float* __restrict__ scale,
                                           float* __restrict__ collapsed, float* __restrict__ post_out,
                                           float* __restrict__ comb_out, u32 n, u32 hidden, u32 iters, float eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float mix[STREAMS_MAX_MIX];
    const u32 n_mix = (2 + n) * n;
    const u64 r = blockIdx.x;
    for (u32 m = threadIdx.x; m < n_mix; m += blockDim.x) mix[m] = mixes[r * n_mix + m];
    __syncthreads();
    streams_gates(mix, base, scale, post_out + r * n, comb_out + r * n * n, n, iters, eps);
    streams_weighted_sum(streams + r * n * hidden, mix, n, hidden, collapsed + r * hidden);
}

// The head's collapse (model.hc_head), one block per row, from streams_project's mixes [T, n]:
// out [T, hidden] = sum_k pre_k * s_k with pre = sigmoid(mixes[k] * scale + base[k]) + eps; base [n], scale [1].
extern "C" __global__ void streams_head(const float* __restrict__ streams, const float* __restrict__ mixes,
                                       const float* __restrict__ base, const float* __restrict__ scale,
                                       float* __restrict__ out, u32 n, u32 hidden, float eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float pre[STREAMS_MAX];
    const u64 r = blockIdx.x;
    const u32 k = threadIdx.x;
    if (k < n) pre[k] = streams_pre(mixes[r * n + k], scale[0], base[k], eps);
    __syncthreads();
    streams_weighted_sum(streams + r * n * hidden, pre, n, hidden, out + r * hidden);
}

// A block's exit: s'_k = post_k * out + sum_j comb[j, k] * s_j, in place, and out zeroed (a next block that
// accumulates, the MoE, starts from zero). Grid (T, column blocks); a thread owns one column of a row across all
// n streams.
extern "C" __global__ void streams_expand(float* __restrict__ streams, float* __restrict__ out,
                                         const float* __restrict__ post, const float* __restrict__ comb, u32 n,
                                         u32 hidden) {
    DF_GRID_DEPENDENCY();
    const u32 d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d >= hidden) return;
    const u64 r = blockIdx.x;
    float* s = streams + r * n * hidden;
    const float* p = post + r * n;
    const float* c = comb + r * n * n;
    float old[STREAMS_MAX];
    for (u32 j = 0; j < n; ++j) old[j] = s[(u64)j * hidden + d];
    const float o = out[r * hidden + d];
    out[r * hidden + d] = 0.0f;
    for (u32 k = 0; k < n; ++k) {
        float v = p[k] * o;
        for (u32 j = 0; j < n; ++j) v = fmaf(c[j * n + k], old[j], v);
        s[(u64)k * hidden + d] = v;
    }
}

// The embedding entering as n copies: streams[r, k * hidden + d] = x[r, d]. Grid-stride over T * hidden.
extern "C" __global__ void streams_broadcast(const float* __restrict__ x, float* __restrict__ streams, u32 rows, u32 n,
                                            u32 hidden) {
    DF_GRID_DEPENDENCY();
    const u64 total = (u64)rows * hidden;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 r = e / hidden, d = e - r * hidden;
        const float v = x[e];
        for (u32 k = 0; k < n; ++k) streams[(r * n + k) * hidden + d] = v;
    }
}

// A tap as the per-token mean of the streams: dst[r, col + d] = (sum_k s[r, k, d]) * (1 / n), summed in stream
// order as the CPU does. Grid-stride over T * hidden; dst rows of dst_ld.
extern "C" __global__ void streams_mean(const float* __restrict__ streams, float* __restrict__ dst, u32 rows, u32 n,
                                       u32 hidden, u32 dst_ld, u32 col) {
    DF_GRID_DEPENDENCY();
    const u64 total = (u64)rows * hidden;
    const float inv = 1.0f / (float)n;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 r = e / hidden, d = e - r * hidden;
        const float* s = streams + r * n * hidden + d;
        float sum = s[0];
        for (u32 k = 1; k < n; ++k) sum += s[(u64)k * hidden];
        dst[r * dst_ld + col + d] = sum * inv;
    }
}
