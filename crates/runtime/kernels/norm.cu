// RMSNorm; CPU twins in src/ops/norm.rs. mean(x^2) in f32, inv = 1 / sqrt(mean + eps) (IEEE division
// and square root: NVRTC's defaults), out = (x * inv) * w with no contraction, as on the CPU. Only the
// order of the sum of squares differs from the CPU.
//
// Grid: one block per row (blockDim a multiple of 32).

// Memory floor: read + write hidden * 4 bytes per row (w is shared by all rows and stays in cache).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, u32 hidden, float eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    const u64 row = blockIdx.x;
    const float* xr = x + row * hidden;
    float* orow = out + row * hidden;
    float sum_sq = 0.0f;
#pragma unroll 4
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = xr[i];
        sum_sq = fmaf(v, v, sum_sq);
    }
    const float mean = block_sum(sum_sq, scratch) / (float)hidden;
    const float inv = 1.0f / sqrtf(mean + eps);
#pragma unroll 4
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        orow[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
    }
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
