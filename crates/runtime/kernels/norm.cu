// RMSNorm; CPU twins in src/ops/norm.rs. mean(x^2) in f32, inv = 1 / sqrt(mean + eps) (IEEE division
// and square root: NVRTC's defaults), out = (x * inv) * w with no contraction, as on the CPU. Only the
// order of the sum of squares differs from the CPU.
//
// Grid: one block per row (blockDim a multiple of 32).

// Memory floor: read hidden * 4 + write hidden * sizeof(T) bytes per row (w is shared by all rows and stays in
// cache). T = bf16_t: the rounded f32 result, the operand of a cuBLAS GEMM written without an f32 round trip.
// Rows of a multiple of 4 floats (at 16-byte aligned addresses) move as float4: every thread's share of a
// 4096-wide row is in flight at once, and a prompt's rows fill each SM with several blocks. A row's result
// depends only on the row (and its width), never on how many rows the launch holds.
template <typename T>
__device__ __forceinline__ void rms_norm_body(const float* __restrict__ x, const float* __restrict__ w,
                                              T* __restrict__ out, u32 hidden, float eps) {
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    const float* xr = x + row * hidden;
    T* orow = out + row * hidden;
    const bool vec = hidden % 4 == 0 && aligned16(x) && aligned16(w) && store4_aligned(out);
    float sum_sq = 0.0f;
    if (vec) {
        const float4* xr4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 4
        for (u32 i = threadIdx.x; i < hidden / 4; i += blockDim.x) {
            const float4 v = xr4[i];
            sum_sq = fmaf(v.x, v.x, sum_sq);
            sum_sq = fmaf(v.y, v.y, sum_sq);
            sum_sq = fmaf(v.z, v.z, sum_sq);
            sum_sq = fmaf(v.w, v.w, sum_sq);
        }
    } else {
#pragma unroll 4
        for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) sum_sq = fmaf(xr[i], xr[i], sum_sq);
    }
    const float mean = block_sum(sum_sq, scratch) / (float)hidden;
    const float inv = 1.0f / sqrtf(mean + eps);
    if (vec) {
        const float4* xr4 = reinterpret_cast<const float4*>(xr);
        const float4* w4 = reinterpret_cast<const float4*>(w);
#pragma unroll 4
        for (u32 i = threadIdx.x; i < hidden / 4; i += blockDim.x) {
            const float4 v = xr4[i], g = w4[i];
            store4(orow + 4 * i, __fmul_rn(__fmul_rn(v.x, inv), g.x), __fmul_rn(__fmul_rn(v.y, inv), g.y),
                   __fmul_rn(__fmul_rn(v.z, inv), g.z), __fmul_rn(__fmul_rn(v.w, inv), g.w));
        }
    } else {
#pragma unroll 4
        for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
            orow[i] = from_f32<T>(__fmul_rn(__fmul_rn(xr[i], inv), w[i]));
        }
    }
}

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, u32 hidden, float eps) {
    DF_GRID_DEPENDENCY();
    rms_norm_body<float>(x, w, out, hidden, eps);
}

extern "C" __global__ void rms_norm_bf16(const float* __restrict__ x, const float* __restrict__ w,
                                         bf16_t* __restrict__ out, u32 hidden, float eps) {
    DF_GRID_DEPENDENCY();
    rms_norm_body<bf16_t>(x, w, out, hidden, eps);
}

// residual += delta in place, then out = rms_norm(residual) * w. Each thread reads back only the
// elements it wrote itself, so no barrier is needed between the two passes.
// Memory floor: read residual + delta, write residual + out: 16 bytes per element.
extern "C" __global__ void add_rms_norm(float* __restrict__ residual, const float* __restrict__ delta,
                                        const float* __restrict__ w, float* __restrict__ out, u32 hidden,
                                        float eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    float* rr = residual + row * hidden;
    const float* dr = delta + row * hidden;
    float* orow = out + row * hidden;
    float sum_sq = 0.0f;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = __fadd_rn(rr[i], dr[i]);
        rr[i] = v;
        sum_sq = fmaf(v, v, sum_sq);
    }
    const float mean = block_sum(sum_sq, scratch) / (float)hidden;
    const float inv = 1.0f / sqrtf(mean + eps);
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        orow[i] = __fmul_rn(__fmul_rn(rr[i], inv), w[i]);
    }
}
