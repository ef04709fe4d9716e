// Hyper-connection residual streams (mHC): the block's collapse, its expansion back into the streams, the head's
// collapse, and the taps drafters read. CPU twin: crates/models/src/streams.rs. Streams are [T, N * H],
// stream-major per row; every kernel works on whole rows with a fixed order of operations, so a row's bits never
// depend on the others (batch invariance) and the kernels capture into graphs (no host reads).

#define STREAMS_MAX 8                                   // N <= 8: the mix weights live in shared memory
#define STREAMS_MAX_MIX ((2 + STREAMS_MAX) * STREAMS_MAX)  // pre, post and comb of one row

__device__ __forceinline__ float streams_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// mix[m] = rms(s) . proj[m] for m < n_mix, rms over the whole flat row of w values (no weight). One warp per
// output in turn; the caller syncs before reading mix.
__device__ __forceinline__ void streams_project(const float* __restrict__ s, const float* __restrict__ proj, u32 w,
                                               u32 n_mix, float norm_eps, float* mix, float* scratch) {
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < w; i += blockDim.x) ss = fmaf(s[i], s[i], ss);
    const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)w + norm_eps);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (u32 m = warp; m < n_mix; m += warps) {
        const float* p = proj + (u64)m * w;
        float acc = 0.0f;
        for (u32 i = lane; i < w; i += 32) acc = fmaf(s[i] * inv, p[i], acc);
        acc = warp_sum(acc);
        if (lane == 0) mix[m] = acc;
    }
}

// out[d] = sum_k pre[k] * s[k * hidden + d] for this row.
__device__ __forceinline__ void streams_weighted_sum(const float* __restrict__ s, const float* pre, u32 n, u32 hidden,
                                                    float* __restrict__ out) {
    for (u32 d = threadIdx.x; d < hidden; d += blockDim.x) {
        float acc = 0.0f;
        for (u32 k = 0; k < n; ++k) acc = fmaf(pre[k], s[(u64)k * hidden + d], acc);
        out[d] = acc;
    }
}

// Softmax of each row of comb [n, n], + eps, then Sinkhorn: columns, then iters - 1 times rows and columns, each
// divided by its sum + eps. One thread (n <= 8: 64 values).
__device__ void streams_sinkhorn(float* comb, u32 n, u32 iters, float eps) {
    for (u32 j = 0; j < n; ++j) {
        float* row = comb + j * n;
        float mx = row[0];
        for (u32 k = 1; k < n; ++k) mx = fmaxf(mx, row[k]);
        float sum = 0.0f;
        for (u32 k = 0; k < n; ++k) {
            row[k] = expf(row[k] - mx);
            sum += row[k];
        }
        for (u32 k = 0; k < n; ++k) row[k] = row[k] / sum + eps;
    }
    for (u32 it = 0; it < iters; ++it) {
        if (it > 0) {
            for (u32 j = 0; j < n; ++j) {
                float sum = 0.0f;
                for (u32 k = 0; k < n; ++k) sum += comb[j * n + k];
                sum += eps;
                for (u32 k = 0; k < n; ++k) comb[j * n + k] /= sum;
            }
        }
        for (u32 k = 0; k < n; ++k) {
            float sum = 0.0f;
            for (u32 j = 0; j < n; ++j) sum += comb[j * n + k];
            sum += eps;
            for (u32 j = 0; j < n; ++j) comb[j * n + k] /= sum;
        }
    }
}

// A block's entry through its hyper-connection, one block per row: from the streams s [T, n * hidden], the
// projection proj [(2 + n) * n, n * hidden], base [(2 + n) * n] and scale [3] (pre, post, comb), writes the block's
// input collapsed [T, hidden] = sum_k pre_k * s_k, and post [T, n], comb [T, n * n] for streams_expand.
// pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb = Sinkhorn(softmax(.) + eps).
extern "C" __global__ void streams_collapse(const float* __restrict__ streams, const float* __restrict__ proj,
                                           const float* __restrict__ base, const float* __restrict__ scale,
                                           float* __restrict__ collapsed, float* __restrict__ post_out,
                                           float* __restrict__ comb_out, u32 n, u32 hidden, u32 iters, float eps,
                                           float norm_eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    __shared__ float mix[STREAMS_MAX_MIX];
    const u32 w = n * hidden, n_mix = (2 + n) * n;
    const float* s = streams + (u64)blockIdx.x * w;
    streams_project(s, proj, w, n_mix, norm_eps, mix, scratch);
    __syncthreads();
    if (threadIdx.x == 0) {
        float* post = post_out + (u64)blockIdx.x * n;
        float* comb = comb_out + (u64)blockIdx.x * n * n;
        for (u32 k = 0; k < n; ++k) {
            post[k] = 2.0f * streams_sigmoid(mix[n + k] * scale[1] + base[n + k]);
            mix[k] = streams_sigmoid(mix[k] * scale[0] + base[k]) + eps;  // pre, in place
        }
        for (u32 c = 0; c < n * n; ++c) comb[c] = mix[2 * n + c] * scale[2] + base[2 * n + c];
        streams_sinkhorn(comb, n, iters, eps);
    }
    __syncthreads();
    streams_weighted_sum(s, mix, n, hidden, collapsed + (u64)blockIdx.x * hidden);
}

// The head's collapse (model.hc_head), one block per row: out [T, hidden] = sum_k pre_k * s_k with
// pre = sigmoid(rms(s) . proj[k] * scale + base[k]) + eps; proj [n, n * hidden], base [n], scale [1].
extern "C" __global__ void streams_head(const float* __restrict__ streams, const float* __restrict__ proj,
                                       const float* __restrict__ base, const float* __restrict__ scale,
                                       float* __restrict__ out, u32 n, u32 hidden, float eps, float norm_eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    __shared__ float mix[STREAMS_MAX];
    const u32 w = n * hidden;
    const float* s = streams + (u64)blockIdx.x * w;
    streams_project(s, proj, w, n, norm_eps, mix, scratch);
    __syncthreads();
    if (threadIdx.x == 0) {
        for (u32 k = 0; k < n; ++k) mix[k] = streams_sigmoid(mix[k] * scale[0] + base[k]) + eps;
    }
    __syncthreads();
    streams_weighted_sum(s, mix, n, hidden, out + (u64)blockIdx.x * hidden);
}

// A block's exit: s'_k = post_k * out + sum_j comb[j, k] * s_j, in place. Grid (T, column blocks); a thread owns
// one column of a row across all n streams.
extern "C" __global__ void streams_expand(float* __restrict__ streams, const float* __restrict__ out,
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
