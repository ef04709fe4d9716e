// Row gathers and elementwise ops; CPU twins in src/ops/elementwise.rs and src/convert.rs.
//
// Products and sums use the explicit round-to-nearest intrinsics (__fmul_rn, ...) so NVRTC cannot
// contract them into FMAs: the results then round exactly like the CPU code.

// out[t, :] = table[ids[t], :] (f32 table). An id outside the table fills its row with NaN: the CPU op
// returns an error there, and a kernel that cannot return one makes the failure loud instead.
// Grid: one block per id. Memory floor: read + write hidden * 4 bytes per id.
extern "C" __global__ void embedding_f32(const float* __restrict__ table, const u32* __restrict__ ids,
                                         float* __restrict__ out, u32 vocab, u32 hidden) {
    DF_GRID_DEPENDENCY();
    const u64 t = blockIdx.x;
    const u32 id = ids[t];
    float* dst = out + t * hidden;
    if (id >= vocab) {
        for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = DF_NAN;
        return;
    }
    const float* src = table + (u64)id * hidden;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}

// The same gather from a bf16 table, widened to f32 (exact).
// Memory floor: read hidden * 2 + write hidden * 4 bytes per id.
extern "C" __global__ void embedding_bf16(const bf16_t* __restrict__ table, const u32* __restrict__ ids,
                                          float* __restrict__ out, u32 vocab, u32 hidden) {
    DF_GRID_DEPENDENCY();
    const u64 t = blockIdx.x;
    const u32 id = ids[t];
    float* dst = out + t * hidden;
    if (id >= vocab) {
        for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = DF_NAN;
        return;
    }
    const bf16_t* src = table + (u64)id * hidden;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = bf16_to_f32(src[i]);
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i], silu(g) = g / (1 + e^-g); T = bf16_t: rounded, the
// down projection's cuBLAS operand written without an f32 round trip.
// Grid: x over groups of 4 columns (one per thread: float4 when inter is a multiple of 4 and the buffers are
// aligned), y over rows (a row loop covers more than 65535 rows).
// Memory floor: read 8 + write sizeof(T) bytes per output element.
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

template <typename T>
__device__ __forceinline__ void swiglu_body(const float* __restrict__ gate_up, T* __restrict__ out, u32 rows,
                                            u32 inter) {
    const u32 i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= inter) return;
    const bool vec = inter % 4 == 0 && aligned16(gate_up) && store4_aligned(out);
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* gr = gate_up + r * 2 * inter;
        T* orow = out + r * inter;
        if (vec) {
            const float4 g = *reinterpret_cast<const float4*>(gr + i);
            const float4 u = *reinterpret_cast<const float4*>(gr + inter + i);
            store4(orow + i, silu_mul(g.x, u.x), silu_mul(g.y, u.y), silu_mul(g.z, u.z), silu_mul(g.w, u.w));
        } else {
            for (u32 j = i; j < min(i + 4, inter); ++j) orow[j] = from_f32<T>(silu_mul(gr[j], gr[inter + j]));
        }
    }
}

extern "C" __global__ void swiglu_fused(const float* __restrict__ gate_up, float* __restrict__ out, u32 rows,
                                        u32 inter) {
    DF_GRID_DEPENDENCY();
    swiglu_body<float>(gate_up, out, rows, inter);
}

extern "C" __global__ void swiglu_fused_bf16(const float* __restrict__ gate_up, bf16_t* __restrict__ out, u32 rows,
                                             u32 inter) {
    DF_GRID_DEPENDENCY();
    swiglu_body<bf16_t>(gate_up, out, rows, inter);
}

// out[i] = bf16(x[i]), round to nearest even (the activation operand of the cuBLAS GEMM); four elements per
// thread and step (float4 reads when aligned).
// Memory floor: read 4 + write 2 bytes per element.
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ out, u64 n) {
    DF_GRID_DEPENDENCY();
    const bool vec = aligned16(x) && store4_aligned(out);
    for (u64 i = 4 * ((u64)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 4 * (u64)gridDim.x * blockDim.x) {
        if (vec && i + 4 <= n) {
            const float4 v = *reinterpret_cast<const float4*>(x + i);
            store4(out + i, v.x, v.y, v.z, v.w);
        } else {
            for (u64 j = i; j < min(i + 4, n); ++j) out[j] = f32_to_bf16(x[j]);
        }
    }
}
