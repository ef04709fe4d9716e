// Gated DeltaNet (Qwen3-Next's linear-attention layers): the causal convolution with its window state,
// the rule inputs (L2-normalised q/k, decay, write strength), the gated delta rule in its recurrent form,
// the gated RMSNorm, and the attention output gate. CPU twins: src/ops/gdn.rs, delta_rule.rs, elementwise.rs.
//
// A step's sequences are described by `runs` `[seqs, 4]`: first row, row count, state slot, and whether
// to write the state back. A verify leaves the state alone (write 0) and keeps its rows' inputs in the
// layer's buffers; after acceptance the same kernels replay the kept rows with write 1 over every GDN
// layer in one launch each (grid z = layers x seqs, with per-layer strides), which is how the state after
// a partial accept equals the state of a forward over the kept rows alone. The state is f32 and the
// arithmetic is spelled with __f*_rn in the CPU's order, so the only differences from the CPU are in
// expf/logf/sqrtf (the decay uses double exp, rounded once).

#define GDN_CONV_BLOCK 256
#define GDN_CONV_MAX_TAPS 8
#define GDN_DK_MAX 128

__device__ __forceinline__ float gdn_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

__device__ __forceinline__ float gdn_silu(float x) { return __fmul_rn(x, gdn_sigmoid(x)); }

// torch's softplus: linear above 20.
__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Causal depthwise convolution + SiLU over each run's rows, thread per (channel, run).
// x: [layers][T, x_ld] conv inputs at columns 0..C; w: [C, K]; state: per layer `state_layer` floats
// apart, per slot `slot_stride` apart, [K - 1, C] oldest first; out: [T, C] (null: only the window moves).
extern "C" __global__ void __launch_bounds__(GDN_CONV_BLOCK)
    gdn_conv(const float* __restrict__ x, u32 x_ld, u64 x_layer, const float* __restrict__ w,
             float* __restrict__ state, u64 state_layer, u64 slot_stride, const u32* __restrict__ runs, u32 seqs,
             u32 C, u32 K, float* __restrict__ out) {
    DF_GRID_DEPENDENCY();
    const u32 c = blockIdx.x * GDN_CONV_BLOCK + threadIdx.x;
    const u32 s = blockIdx.y % seqs;
    const u32 layer = blockIdx.y / seqs;
    if (c >= C) return;
    const u32 first = runs[4 * s], rows = runs[4 * s + 1], slot = runs[4 * s + 2], write = runs[4 * s + 3];
    const float* xl = x + layer * x_layer;
    float* st = state + layer * state_layer + (u64)slot * slot_stride;
    float win[GDN_CONV_MAX_TAPS];
#pragma unroll
    for (u32 i = 0; i < GDN_CONV_MAX_TAPS; ++i) win[i] = (i + 1 < K) ? st[(u64)i * C + c] : 0.0f;
    for (u32 t = 0; t < rows; ++t) {
        const float in = xl[(u64)(first + t) * x_ld + c];
        if (out != nullptr) {
            float acc = 0.0f;
#pragma unroll
            for (u32 i = 0; i < GDN_CONV_MAX_TAPS; ++i) {
                if (i + 1 < K) acc = __fadd_rn(acc, __fmul_rn(w[(u64)c * K + i], win[i]));
            }
            acc = __fadd_rn(acc, __fmul_rn(w[(u64)c * K + K - 1], in));
            out[(u64)(first + t) * C + c] = gdn_silu(acc);
        }
        // Shift the window by one input (K - 1 <= 7 registers).
#pragma unroll
        for (u32 i = 0; i + 1 < GDN_CONV_MAX_TAPS; ++i) {
            if (i + 2 < K) win[i] = win[i + 1];
        }
        if (K >= 2) {
#pragma unroll
            for (u32 i = 0; i < GDN_CONV_MAX_TAPS; ++i) {
                if (i + 2 == K) win[i] = in;
            }
        }
    }
    if (write) {
#pragma unroll
        for (u32 i = 0; i < GDN_CONV_MAX_TAPS; ++i) {
            if (i + 1 < K) st[(u64)i * C + c] = win[i];
        }
    }
}

// The rule inputs, in place: block per (row, key head). qkv: [T, C] = [q | k | v] after the convolution;
// q and k heads (dk wide) are L2-normalised (q also scaled by 1/sqrt(dk)) in place. Blocks of key head 0
// also write gb: [T, 2 hv] = [g | beta] from ba: [T, ba_ld] = [b (hv) | a (hv)].
extern "C" __global__ void __launch_bounds__(128)
    gdn_prep(float* __restrict__ qkv, u32 C, u32 kd, u32 dk, const float* __restrict__ ba, u32 ba_ld,
             const float* __restrict__ neg_a, const float* __restrict__ dt_bias, u32 hv, float* __restrict__ gb) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    const u32 t = blockIdx.x, h = blockIdx.y;
    float* q = qkv + (u64)t * C + h * dk;
    float* k = q + kd;
    float sq = 0.0f, sk = 0.0f;
    for (u32 i = threadIdx.x; i < dk; i += blockDim.x) {
        sq += q[i] * q[i];
        sk += k[i] * k[i];
    }
    sq = block_sum(sq, scratch);
    sk = block_sum(sk, scratch);
    // HF l2norm: x / sqrt(sum + 1e-6); the CPU multiplies by the reciprocal.
    const float inv_q = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(sq, 1e-6f)));
    const float inv_k = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(sk, 1e-6f)));
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn((float)dk));
    for (u32 i = threadIdx.x; i < dk; i += blockDim.x) {
        q[i] = __fmul_rn(__fmul_rn(q[i], inv_q), scale);
        k[i] = __fmul_rn(k[i], inv_k);
    }
    if (h == 0) {
        const float* row = ba + (u64)t * ba_ld;
        for (u32 j = threadIdx.x; j < hv; j += blockDim.x) {
            gb[(u64)t * 2 * hv + hv + j] = gdn_sigmoid(row[j]);
            gb[(u64)t * 2 * hv + j] = __fmul_rn(neg_a[j], gdn_softplus(__fadd_rn(row[hv + j], dt_bias[j])));
        }
    }
}

// The gated delta rule, recurrent form, warp per (value head, 32 value columns, layer x run): each lane
// holds one column of the head's [dk, dv] state in registers and steps it through the run's rows:
//   S <- e^g S;  S <- S + k (x) beta (v - S^T k);  o = S^T q
// qkv: per layer `qkv_layer` floats apart, [T, C] = [q (kd) | k (kd) | v (vd)], q/k normalised; gb: per
// layer `gb_layer` apart, [T, 2 hv]; state: per layer `state_layer` apart, per slot `slot_stride`,
// [hv, dk, dv]; out: [T, vd] (null: replay only).
extern "C" __global__ void __launch_bounds__(32)
    gdn_rule(const float* __restrict__ qkv, u32 C, u64 qkv_layer, const float* __restrict__ gb, u64 gb_layer,
             float* __restrict__ state, u64 state_layer, u64 slot_stride, const u32* __restrict__ runs, u32 seqs,
             u32 hk, u32 hv, u32 dk, u32 dv, float* __restrict__ out) {
    DF_GRID_DEPENDENCY();
    __shared__ float ks[GDN_DK_MAX], qs[GDN_DK_MAX];
    const u32 h = blockIdx.x, lane = threadIdx.x;
    const u32 j = blockIdx.y * 32 + lane;
    const u32 s = blockIdx.z % seqs, layer = blockIdx.z / seqs;
    const u32 first = runs[4 * s], rows = runs[4 * s + 1], slot = runs[4 * s + 2], write = runs[4 * s + 3];
    const u32 kd = hk * dk, kh = h / (hv / hk);
    const bool live = j < dv;
    const float* xl = qkv + layer * qkv_layer;
    const float* gbl = gb + layer * gb_layer;
    float* st = state + layer * state_layer + (u64)slot * slot_stride + (u64)h * dk * dv;
    float S[GDN_DK_MAX];
#pragma unroll
    for (u32 i = 0; i < GDN_DK_MAX; ++i) S[i] = (i < dk && live) ? st[(u64)i * dv + j] : 0.0f;
    for (u32 t = 0; t < rows; ++t) {
        const float* row = xl + (u64)(first + t) * C;
        __syncwarp();
        for (u32 i = lane; i < dk; i += 32) {
            qs[i] = row[kh * dk + i];
            ks[i] = row[kd + kh * dk + i];
        }
        __syncwarp();
        const float g = gbl[(u64)(first + t) * 2 * hv + h];
        const float beta = gbl[(u64)(first + t) * 2 * hv + hv + h];
        const float v = live ? row[2 * kd + h * dv + j] : 0.0f;
        const float decay = (float)exp((double)g);
        float mem = 0.0f;
#pragma unroll
        for (u32 i = 0; i < GDN_DK_MAX; ++i) {
            if (i < dk) {
                S[i] = __fmul_rn(S[i], decay);
                mem = __fadd_rn(mem, __fmul_rn(S[i], ks[i]));
            }
        }
        const float d = __fmul_rn(__fsub_rn(v, mem), beta);
        float o = 0.0f;
#pragma unroll
        for (u32 i = 0; i < GDN_DK_MAX; ++i) {
            if (i < dk) {
                S[i] = __fadd_rn(S[i], __fmul_rn(ks[i], d));
                o = __fadd_rn(o, __fmul_rn(S[i], qs[i]));
            }
        }
        if (out != nullptr && live) out[(u64)(first + t) * hv * dv + h * dv + j] = o;
    }
    if (write && live) {
#pragma unroll
        for (u32 i = 0; i < GDN_DK_MAX; ++i) {
            if (i < dk) st[(u64)i * dv + j] = S[i];
        }
    }
}

// core <- w * core / rms(core) * silu(z) per value head (HF Qwen3NextRMSNormGated), block per (row, head).
// core: [T, hv * dv]; z: [T, z_ld] at column 0.
extern "C" __global__ void __launch_bounds__(128)
    gdn_gated_norm(float* __restrict__ core, const float* __restrict__ z, u32 z_ld, const float* __restrict__ w,
                   u32 hv, u32 dv, float eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    const u32 t = blockIdx.x, h = blockIdx.y;
    float* x = core + (u64)t * hv * dv + h * dv;
    const float* zr = z + (u64)t * z_ld + h * dv;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < dv; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, scratch);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)dv), eps)));
    for (u32 i = threadIdx.x; i < dv; i += blockDim.x) {
        x[i] = __fmul_rn(__fmul_rn(w[i], __fmul_rn(x[i], inv)), gdn_silu(zr[i]));
    }
}

// The attention output gate: x[t, i] *= sigmoid(gate[t * gate_ld + i]); x: [T, n].
extern "C" __global__ void sigmoid_gate_mul(float* __restrict__ x, const float* __restrict__ gate, u32 gate_ld,
                                            u32 n, u32 rows) {
    DF_GRID_DEPENDENCY();
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)n * rows) return;
    const u32 t = (u32)(idx / n), i = (u32)(idx % n);
    x[idx] = __fmul_rn(x[idx], gdn_sigmoid(gate[(u64)t * gate_ld + i]));
}
