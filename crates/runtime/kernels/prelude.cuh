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
