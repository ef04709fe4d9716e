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

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i], silu(g) = g / (1 + e^-g).
// Grid: x over columns, y over rows (a row loop covers more than 65535 rows).
// Memory floor: read 8 + write 4 bytes per output element.
extern "C" __global__ void swiglu_fused(const float* __restrict__ gate_up, float* __restrict__ out, u32 rows,
                                        u32 inter) {
    DF_GRID_DEPENDENCY();
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const float g = gate_up[r * 2 * inter + i];
        const float u = gate_up[r * 2 * inter + inter + i];
        out[r * inter + i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
    }
}

// out[i] = bf16(x[i]), round to nearest even (the activation operand of the cuBLAS GEMM).
// Memory floor: read 4 + write 2 bytes per element.
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ out, u64 n) {
    DF_GRID_DEPENDENCY();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16(x[i]);
    }
}
