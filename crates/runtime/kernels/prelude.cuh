// Shared helpers for the dflash kernels (see src/cuda/kernels.rs for how the sources are put together).
//
// NVRTC compiles these without any CUDA headers: bf16 values are handled as their raw 16 bits, and the
// few constants the headers would give are spelled out here.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define DF_NAN __int_as_float(0x7fc00000)
#define DF_NEG_INF __int_as_float(0xff800000)
#define DF_FULL_MASK 0xffffffffu

// Programmatic dependent launch (src/cuda/launch.rs): on sm_90 and up a kernel may be launched while the one
// before it on the stream is still running. DF_GRID_DEPENDENCY waits until that kernel has completed and its
// writes are visible, then lets the next kernel launch (its blocks park at this same wait). Most kernels make it
// their first statement. Before it a kernel may read only what the kernel right before it does not write: weights
// (gemv.cu prefetches them), the step's inputs the host uploaded, and what kernels before that one wrote (they
// completed before it passed its own wait); attention.cu reads its tiles and cached keys there. Every block must
// pass the wait before it exits, or the launch could complete before the kernel it depends on. Launched without
// PDL, both instructions return at once.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DF_GRID_DEPENDENCY()                                          \
    do {                                                              \
        asm volatile("griddepcontrol.wait;" ::: "memory");            \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
    } while (0)
#else
#define DF_GRID_DEPENDENCY() \
    do {                     \
    } while (0)
#endif

// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
__device__ __forceinline__ float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }

// Round to nearest, ties to even; NaN stays a quiet NaN. Bit-identical to half::bf16::from_f32.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// A result stored as f32, or rounded to bf16.
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ bf16_t from_f32<bf16_t>(float v) {
    return f32_to_bf16(v);
}

// Four consecutive results at `p` (16-byte aligned for f32, 8-byte for bf16).
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}
__device__ __forceinline__ void store4(bf16_t* p, float a, float b, float c, float d) {
    const u32 lo = (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
    const u32 hi = (u32)f32_to_bf16(c) | ((u32)f32_to_bf16(d) << 16);
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}

// Whether `p` may be read or written as 16 bytes at once.
__device__ __forceinline__ bool aligned16(const void* p) { return ((u64)p & 15u) == 0; }

// Whether store4 may write at `p` (four elements' bytes aligned).
template <typename T>
__device__ __forceinline__ bool store4_aligned(const T* p) {
    return ((u64)p & (4 * sizeof(T) - 1)) == 0;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(DF_FULL_MASK, v, offset);
    }
    return v;
}

// Sum of `v` over the whole block, returned to every thread. blockDim.x must be a multiple of 32;
// `scratch` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    const u32 warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous block_sum may still be reading scratch
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(DF_FULL_MASK, v, offset));
    }
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(DF_FULL_MASK, v, offset);
    }
    return v;
}

// IEEE half (raw 16 bits) -> f32, exact (the GGUF block scales).
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Four signed 8-bit products summed into c (dp4a; no header declares __dp4a under NVRTC without headers).
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// silu(g) * u, rounded step by step as the CPU's swiglu.
__device__ __forceinline__ float swiglu_value(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// Where a matmul's result goes (the `epi` argument of the fused matmul kernels).
#define EPI_STORE 0u   // y[r, col] = acc
#define EPI_ADD 1u     // y[r, col] += acc (the residual stream)
#define EPI_SWIGLU 2u  // y[r, col] = silu(acc of weight row col) * (acc of weight row col + n_out)
