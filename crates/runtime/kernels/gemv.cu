// y = x . W^T for a bf16 weight W [n, k] and R f32 input rows x [R, k] (R = 1..8), y [R, n] f32.
// CPU twin: src/ops/matmul.rs (the dense GEMV path).
//
// One warp per weight row: the row is read once, 16 bytes (8 bf16) per lane per load, and dotted with all
// R input rows (x stays in L1/L2: every warp of the grid reads it). Accumulation in f32 with FMAs, a
// different order from the CPU's, so results agree to f32 rounding, not bit for bit. When k is not a
// multiple of 8 the row start is not 16-byte aligned, and a scalar loop is used instead.
// Memory floor: the weights, n * k * 2 bytes (x and y are small): 8192 x 8192 is 134 MB, 31 us at
// 4.3 TB/s.

#define GEMV_WARPS 8

template <int R>
__device__ __forceinline__ void gemv_bf16_rows(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                               float* __restrict__ y, u32 n, u32 k) {
    const u32 lane = threadIdx.x & 31u;
    const u32 row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= n) return;  // uniform per warp
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    const bf16_t* wr = w + (u64)row * k;
    if ((k & 7u) == 0) {
        const uint4* w8 = reinterpret_cast<const uint4*>(wr);
        const u32 k8 = k >> 3;
#pragma unroll 4
        for (u32 j = lane; j < k8; j += 32) {
            const uint4 q = __ldg(w8 + j);
            const float wf[8] = {
                __uint_as_float(q.x << 16), __uint_as_float(q.x & 0xffff0000u),
                __uint_as_float(q.y << 16), __uint_as_float(q.y & 0xffff0000u),
                __uint_as_float(q.z << 16), __uint_as_float(q.z & 0xffff0000u),
                __uint_as_float(q.w << 16), __uint_as_float(q.w & 0xffff0000u),
            };
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float4* xv = reinterpret_cast<const float4*>(x + (u64)r * k) + 2 * j;
                const float4 a = __ldg(xv);
                const float4 b = __ldg(xv + 1);
                float s = acc[r];
                s = fmaf(wf[0], a.x, s);
                s = fmaf(wf[1], a.y, s);
                s = fmaf(wf[2], a.z, s);
                s = fmaf(wf[3], a.w, s);
                s = fmaf(wf[4], b.x, s);
                s = fmaf(wf[5], b.y, s);
                s = fmaf(wf[6], b.z, s);
                s = fmaf(wf[7], b.w, s);
                acc[r] = s;
            }
        }
    } else {
        for (u32 j = lane; j < k; j += 32) {
            const float wv = bf16_to_f32(wr[j]);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = fmaf(wv, x[(u64)r * k + j], acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = warp_sum(acc[r]);
        if (lane == 0) y[(u64)r * n + row] = s;
    }
}

#define DF_GEMV(R)                                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                          \
        gemv_bf16_r##R(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, u32 n, \
                       u32 k) {                                                                           \
        gemv_bf16_rows<R>(w, x, y, n, k);                                                                 \
    }

DF_GEMV(1)
DF_GEMV(2)
DF_GEMV(3)
DF_GEMV(4)
DF_GEMV(5)
DF_GEMV(6)
DF_GEMV(7)
DF_GEMV(8)

// One weight row of a bf16 matrix [*, k] dotted with one f32 row x [k]: this lane's partial sum (the same
// loop as gemv_bf16_rows<1>).
__device__ __forceinline__ float bf16_row_dot(const bf16_t* __restrict__ wr, const float* __restrict__ x, u32 k) {
    const u32 lane = threadIdx.x & 31u;
    float s = 0.0f;
    if ((k & 7u) == 0) {
        const uint4* w8 = reinterpret_cast<const uint4*>(wr);
        const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll 4
        for (u32 j = lane; j < (k >> 3); j += 32) {
            const uint4 q = __ldg(w8 + j);
            const float4 a = x4[2 * j], b = x4[2 * j + 1];
            s = fmaf(__uint_as_float(q.x << 16), a.x, s);
            s = fmaf(__uint_as_float(q.x & 0xffff0000u), a.y, s);
            s = fmaf(__uint_as_float(q.y << 16), a.z, s);
            s = fmaf(__uint_as_float(q.y & 0xffff0000u), a.w, s);
            s = fmaf(__uint_as_float(q.z << 16), b.x, s);
            s = fmaf(__uint_as_float(q.z & 0xffff0000u), b.y, s);
            s = fmaf(__uint_as_float(q.w << 16), b.z, s);
            s = fmaf(__uint_as_float(q.w & 0xffff0000u), b.w, s);
        }
    } else {
        for (u32 j = lane; j < k; j += 32) s = fmaf(bf16_to_f32(wr[j]), x[j], s);
    }
    return s;
}

// One activation row through a bf16 matrix with a fused prologue and epilogue. With `norm_w`, every block
// first RMS-normalises x into shared memory as the CPU's rms_norm does ((x * inv) * w; dynamic shared
// memory k * 4 bytes), so the layer's pre-norm needs no kernel of its own. Epilogue: EPI_STORE, EPI_ADD
// into the residual, EPI_SWIGLU over the gate row col and the up row col + n_out. x [k]; y: columns
// 0..n_out of one row. Grid: one warp per output column, GEMV_WARPS per block. Memory floor: the weights.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_bf16_ep(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, u32 n_out, u32 k,
                 u32 epi, const float* __restrict__ norm_w, float eps) {
    extern __shared__ float4 gemv_smem[];
    const float* xs = x;
    if (norm_w != nullptr) {
        __shared__ float scratch[32];
        float* xn = reinterpret_cast<float*>(gemv_smem);
        float ss = 0.0f;
        for (u32 i = threadIdx.x; i < k; i += blockDim.x) {
            const float v = x[i];
            xn[i] = v;
            ss = fmaf(v, v, ss);
        }
        const float inv = 1.0f / sqrtf(block_sum(ss, scratch) / (float)k + eps);
        for (u32 i = threadIdx.x; i < k; i += blockDim.x) xn[i] = __fmul_rn(__fmul_rn(xn[i], inv), norm_w[i]);
        __syncthreads();
        xs = xn;
    }
    const u32 col = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (col >= n_out) return;  // uniform per warp, after the block's barriers
    float acc = warp_sum(bf16_row_dot(w + (u64)col * k, xs, k));
    if (epi == EPI_SWIGLU) {
        const float up = warp_sum(bf16_row_dot(w + (u64)(col + n_out) * k, xs, k));
        acc = swiglu_value(acc, up);
    }
    if ((threadIdx.x & 31u) == 0) y[col] = epi == EPI_ADD ? __fadd_rn(y[col], acc) : acc;
}
