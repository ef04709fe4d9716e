// Small kernels of the model forward: the final norm of the rows whose logits are wanted, the hidden-state
// capture copy, and device-side random fills for random-weight models (benchmarks and tests).

// out[j] = rms_norm(x[rows[j]]) * w; CPU twin: gather the rows, then ops::rms_norm. One block per output row;
// a row index >= x_rows gives a row of NaN. Memory floor: read + write hidden * 4 bytes per row.
extern "C" __global__ void gather_rms_norm(const float* __restrict__ x, u32 x_rows, const u32* __restrict__ rows,
                                           const float* __restrict__ w, float* __restrict__ out, u32 hidden,
                                           float eps) {
    DF_GRID_DEPENDENCY();
    __shared__ float scratch[32];
    const u32 src = rows[blockIdx.x];
    float* orow = out + (u64)blockIdx.x * hidden;
    if (src >= x_rows) {
        for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) orow[i] = DF_NAN;
        return;
    }
    const float* xr = x + (u64)src * hidden;
    float sum_sq = 0.0f;
#pragma unroll 4
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) sum_sq = fmaf(xr[i], xr[i], sum_sq);
    const float inv = 1.0f / sqrtf(block_sum(sum_sq, scratch) / (float)hidden + eps);
#pragma unroll 4
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) orow[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
}

// dst[r, col + i] = src[r, i] for src [rows, width] and dst [rows, dst_ld]. Grid-stride.
extern "C" __global__ void copy_columns(const float* __restrict__ src, float* __restrict__ dst, u32 rows, u32 width,
                                        u32 dst_ld, u32 col) {
    DF_GRID_DEPENDENCY();
    const u64 n = (u64)rows * width;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        const u64 r = e / width, i = e - r * width;
        dst[r * dst_ld + col + i] = src[e];
    }
}

// dst[slots[r], :] = src[r, :] for src [rows, width] and dst [dst_rows, width]: a step's captured rows written to
// their positions' cache slots. A slot past dst_rows is skipped. One block per row.
// Memory floor: read and write rows * width * 4 bytes.
extern "C" __global__ void scatter_rows(const float* __restrict__ src, const u32* __restrict__ slots,
                                        float* __restrict__ dst, u32 width, u32 dst_rows) {
    DF_GRID_DEPENDENCY();
    const u64 r = blockIdx.x;
    const u32 slot = slots[r];
    if (slot >= dst_rows) return;
    const float* from = src + r * width;
    float* to = dst + (u64)slot * width;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) to[i] = from[i];
}

// A 64-bit mix (splitmix64's finaliser) of the seed and an element index: a counter-based generator, so
// any element's value is known without running the others.
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float uniform_pm1(u64 seed, u64 i) {
    return (float)(mix64(seed * 0x9E3779B97F4A7C15ull + i) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

// out[i] = bf16(offset + scale * u_i), u uniform in [-1, 1). Grid-stride.
extern "C" __global__ void fill_random_bf16(bf16_t* __restrict__ out, u64 n, u64 seed, float scale, float offset) {
    DF_GRID_DEPENDENCY();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(offset + scale * uniform_pm1(seed, i));
    }
}

// out[i] = offset + scale * u_i. Grid-stride.
extern "C" __global__ void fill_random_f32(float* __restrict__ out, u64 n, u64 seed, float scale, float offset) {
    DF_GRID_DEPENDENCY();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = offset + scale * uniform_pm1(seed, i);
    }
}

// Random bytes (the quants of a random quantized matrix). Grid-stride over 32-bit words.
extern "C" __global__ void fill_random_u32(u32* __restrict__ out, u64 n, u64 seed) {
    DF_GRID_DEPENDENCY();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = (u32)mix64(seed * 0x9E3779B97F4A7C15ull + i);
    }
}

// f16 bits of offset + scale * u_i (block scales of a random quantized matrix). Grid-stride.
extern "C" __global__ void fill_random_f16(unsigned short* __restrict__ out, u64 n, u64 seed, float scale,
                                          float offset) {
    DF_GRID_DEPENDENCY();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        unsigned short h;
        const float f = offset + scale * uniform_pm1(seed, i);
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        out[i] = h;
    }
}
