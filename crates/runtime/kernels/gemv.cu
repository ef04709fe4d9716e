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
