// Rotary position embedding in place; CPU twin in src/ops/rope.rs. cos/sin come from a table computed on
// the host exactly as the CPU op computes them (src/cuda/rope_table.rs), and the rotation rounds each
// product separately, so results are bit-identical to the CPU.
//
// x: [rows, heads * head_dim]; positions: [rows]; cos_tab, sin_tab: [max_pos, half] with
// half = rotary_dim / 2. Pairs are (i, i + half) for neox and (2i, 2i + 1) for interleaved; dims past
// rotary_dim are left alone. A position >= max_pos turns the row's rotated dims into NaN.
// Grid: one block per row. Memory floor: read + write rotary dims (8 bytes per rotated element).
extern "C" __global__ void rope(float* __restrict__ x, const u32* __restrict__ positions,
                                const float* __restrict__ cos_tab, const float* __restrict__ sin_tab, u32 row_len,
                                u32 head_dim, u32 half, u32 max_pos, u32 interleaved) {
    DF_GRID_DEPENDENCY();
    const u64 row = blockIdx.x;
    const u32 pos = positions[row];
    float* xr = x + row * row_len;
    const u32 pairs = (row_len / head_dim) * half;
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        const u32 head = i / half;
        const u32 p = i - head * half;
        const u32 a = head * head_dim + (interleaved ? 2 * p : p);
        const u32 b = a + (interleaved ? 1 : half);
        if (pos >= max_pos) {
            xr[a] = DF_NAN;
            xr[b] = DF_NAN;
            continue;
        }
        const float c = cos_tab[(u64)pos * half + p];
        const float s = sin_tab[(u64)pos * half + p];
        const float x1 = xr[a];
        const float x2 = xr[b];
        xr[a] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
        xr[b] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
    }
}
