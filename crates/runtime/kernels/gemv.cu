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
        DF_GRID_DEPENDENCY();                                                                             \
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
    DF_GRID_DEPENDENCY();
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

// Four consecutive elements of an f32 row from element i: one 16-byte load where `vec` (k a multiple of 4, the
// row 16-byte aligned), else four loads, zeros past k.
__device__ __forceinline__ float4 f32_rows_load4(const float* __restrict__ p, u32 i, u32 k, bool vec) {
    if (vec) return __ldg(reinterpret_cast<const float4*>(p + i));
    float4 v;
    v.x = i < k ? __ldg(p + i) : 0.0f;
    v.y = i + 1 < k ? __ldg(p + i + 1) : 0.0f;
    v.z = i + 2 < k ? __ldg(p + i + 2) : 0.0f;
    v.w = i + 3 < k ? __ldg(p + i + 3) : 0.0f;
    return v;
}

// acc + w . x, the four products added in order.
__device__ __forceinline__ float f32_rows_dot4(float acc, float4 w, float4 x) {
    acc = fmaf(w.x, x.x, acc);
    acc = fmaf(w.y, x.y, acc);
    acc = fmaf(w.z, x.z, acc);
    return fmaf(w.w, x.w, acc);
}

// The lane's share of the sums of C columns (weight rows w_c = w + c * k, and for SWIGLU the up rows w_c + up) over
// the chunk's rows in gemm_f32_rows: lane-strided groups of four, in order. Rows past `rows` repeat the last row and
// columns past `cols` the last column (their sums are dropped), so the loop has no branch but its bound and its
// loads can be issued ahead; VEC and SWIGLU are fixed per instantiation for the same reason.
template <int R, int C, bool VEC, bool SWIGLU>
__device__ __forceinline__ void gemm_f32_rows_sums(const float* __restrict__ w, u64 up, const float* __restrict__ xs,
                                                   u32 k, u32 rows, u32 cols, float (&acc)[C][R],
                                                   float (&acc_up)[C][R]) {
    const u32 lane = threadIdx.x & 31u, groups = (k + 3u) >> 2;
    // Two groups in flight per lane where the registers allow: the one-row kernel (R * C = 4 sums a lane); the 8-row
    // kernel (16) keeps one, which may cap its stream on large drafters (PERFORMANCE.md entry 106).
    constexpr int UNROLL = R * C <= 8 ? 2 : 1;
#pragma unroll UNROLL
    for (u32 g = lane; g < groups; g += 32) {
        const u32 i = 4u * g;
        float4 wg[C], wu[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const float* wcol = w + (u64)min((u32)c, cols - 1u) * k;
            wg[c] = f32_rows_load4(wcol, i, k, VEC);
            wu[c] = SWIGLU ? f32_rows_load4(wcol + up, i, k, VEC) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float4 xv = f32_rows_load4(xs + (u64)min((u32)r, rows - 1u) * k, i, k, VEC);
#pragma unroll
            for (int c = 0; c < C; ++c) {
                acc[c][r] = f32_rows_dot4(acc[c][r], wg[c], xv);
                if (SWIGLU) acc_up[c][r] = f32_rows_dot4(acc_up[c][r], wu[c], xv);
            }
        }
    }
}

// m activation rows (x [m, k]) through an f32 matrix: each warp takes C consecutive output columns (the last warp
// fewer) and a chunk of up to R rows; each lane reads four weights of each column at a time (lane-strided groups
// of four) and adds them into every row's sums, then the warp sum per row and column. A sum has the same order
// whatever R, C, m, the other rows and the load width (a group's four products are added in order either way; past
// k the scalar path adds zeros), so its bits do not depend on the batch (cuBLAS picks its kernel by shape, which
// made f32 and f16 checkpoints' decode and verify rows differ). The default model's drafter's matrices are small
// (144 to 8,192 columns of 576 to 3,456), so latency bounds them: C columns per warp put C weight loads in flight
// per lane and read each activation load C times from registers rather than from L1; a real-shape drafter's (up to
// a 151,936 x 4,096 LM head) are bound by their bytes.
// The row chunks of one column block are neighbours in the grid (chunks on x), so they run together and all but
// the first read the block's weights from L2: more rows than one chunk cost L2 reads, not DRAM reads (one chunk of
// 32 rows instead held 32 rows' sums per lane and ran at a quarter of 8-row chunks' speed on a drafter's LM head).
// Epilogue as gemv_bf16_ep; y [m, y_ld]. Grid: (ceil(m / R), ceil(n_out / (GEMV_WARPS * C))).
template <int R, int C>
__device__ __forceinline__ void gemm_f32_rows(const float* __restrict__ w, const float* __restrict__ x,
                                              float* __restrict__ y, u32 y_ld, u32 n_out, u32 k, u32 m, u32 epi) {
    const u32 lane = threadIdx.x & 31u, col0 = (blockIdx.y * GEMV_WARPS + (threadIdx.x >> 5)) * C;
    const u32 row0 = blockIdx.x * R, rows = min((u32)R, m - row0);
    if (col0 >= n_out) return;  // uniform per warp
    const u32 cols = min((u32)C, n_out - col0);
    const bool swiglu = epi == EPI_SWIGLU;
    const float* wc = w + (u64)col0 * k;
    const float* xs = x + (u64)row0 * k;
    const u64 up = (u64)n_out * k;
    float acc[C][R], acc_up[C][R];
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[c][r] = acc_up[c][r] = 0.0f;
    }
    const bool vec = (k & 3u) == 0 && aligned16(w) && aligned16(x);
    if (vec && swiglu) {
        gemm_f32_rows_sums<R, C, true, true>(wc, up, xs, k, rows, cols, acc, acc_up);
    } else if (vec) {
        gemm_f32_rows_sums<R, C, true, false>(wc, up, xs, k, rows, cols, acc, acc_up);
    } else if (swiglu) {
        gemm_f32_rows_sums<R, C, false, true>(wc, up, xs, k, rows, cols, acc, acc_up);
    } else {
        gemm_f32_rows_sums<R, C, false, false>(wc, up, xs, k, rows, cols, acc, acc_up);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if ((u32)r >= rows || (u32)c >= cols) continue;
            float v = warp_sum(acc[c][r]);
            if (swiglu) v = swiglu_value(v, warp_sum(acc_up[c][r]));
            if (lane == 0) {
                float* dst = y + (u64)(row0 + r) * y_ld + col0 + c;
                *dst = epi == EPI_ADD ? __fadd_rn(*dst, v) : v;
            }
        }
    }
}

#define DF_GEMM_F32_ROWS(R, C)                                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                \
        gemm_f32_rows_r##R(const float* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,     \
                           u32 y_ld, u32 n_out, u32 k, u32 m, u32 epi) {                                          \
        DF_GRID_DEPENDENCY();                                                                                    \
        gemm_f32_rows<R, C>(w, x, y, y_ld, n_out, k, m, epi);                                                    \
    }
DF_GEMM_F32_ROWS(1, 4)
DF_GEMM_F32_ROWS(8, 2)

// ---------------------------------------------------------------------------------------------------------
// Batch-invariant small-batch bf16 matmul on tensor cores (the decode and verify rows of bf16 targets).
//
// y[m, n_out] (epilogue) = x[m, k] . W[rows, k]^T for m <= 8 * T activation rows, x f32 rounded to bf16 as
// it is loaded, f32 accumulation with mma.m16n8k16. A row's result does not depend on m, on which tile slot
// it takes or on the other rows: every output element sums the same products in the same order (per warp,
// its k-blocks in turn; then the block's 8 warps in order), which no cuBLAS call promises. So a decode row
// and the same row inside a verify of 16 give the same bits, and speculation stays lossless on bf16 weights.
//
// Block: 8 warps on 16 output columns (with SwiGLU, also their 16 up rows at col + n_out). HALF (SwiGLU, one row
// tile, a matrix streamed from DRAM): 8 output columns, their gate rows as the mma's rows 0..7 and their up rows as
// rows 8..15, so a lane holds the gate and up sums of one output: 16 weight rows per block, as without SwiGLU (the
// Qwen3-8B shape's gate/up streamed at 3.4 TB/s in blocks of 32 rows where blocks of 16 reach 3.8-4.3). Each output
// sums the same products in the same k-order through the same mma either way, only its row in the mma differs, and
// the tensor core's sum of an element does not depend on its row: a decode row (HALF) and the same row in a verify
// (two tiles or more: 16 columns, half the blocks, so the activations are read half as often) agree bit for bit
// (the solo-vs-batch test checks it on the device). Warp w takes the
// 64-wide k-blocks w, w + 8, w + 16, ...; lane (g = lane / 4, t = lane % 4) loads weight rows g and g + 8 at
// [kb + 8t, +8) and [kb + 32 + 8t, +8) (two 16-byte loads per row, full 32-byte sectors per instruction), and
// the activation row g of each tile at the same columns. Each mma step s = 0..3 takes words 2s and 2s + 1 of
// those 16 values as its k-pairs (2t, 2t + 1) and (2t + 8, 2t + 9): a fixed permutation of k, the same for
// the weights and the activations. Needs k % 8 == 0 (16-byte aligned rows); columns past k are zero.
// Memory floor: the weights, rows * k * 2 bytes, for any m <= 8 * T.
//
// The layer's pre-norm folds in (NORM, `norm_w` non-null): the activations load as bf16(x * norm_w) and each
// output is scaled by its row's 1 / rms at the end, from the sum of squares the kernel that last wrote the
// residual left in `ss_in` ([m, ceil(k / 16)]: one partial sum per 16 columns, summed here in a fixed order:
// lane-strided, then the warp's butterfly), so no kernel of its own normalises the row and nothing waits on a
// sum before the weights stream. Scaling each output instead of each activation changes only which product
// the bf16 rounding sees (the relative error is the same). With EPI_ADD, `ss_out` non-null takes those partial
// sums of the updated rows: [m, gridDim.x], slot blockIdx.x. Both sums have a fixed order, so rows stay
// batch-invariant.

#define TC_WARPS 8
#define TC_KB 64

__device__ __forceinline__ void mma_bf16_16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two f32 rounded to nearest-even bf16 in one instruction, `lo` in the low half (for finite values the bits of
// f32_to_bf16).
__device__ __forceinline__ u32 bf16x2_rn(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// 16 bytes of a weight row. STREAM (matrices too large to prefetch into L2 whole): read once, so not kept in L1,
// and each L2 miss fetches the whole 256-byte block around it from DRAM (a warp instruction takes 64 bytes of each
// of 8 rows; the next ones take the rest of those rows' blocks, which are then L2 hits): the Qwen3-8B shape's step
// 3% faster. Matrices prefetched into L2 whole load plainly (with the hint the Qwen3-0.6B shape's step took 8%
// longer).
template <bool STREAM>
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
    if (!STREAM) return __ldg(reinterpret_cast<const uint4*>(p));
    uint4 q;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w)
        : "l"(p));
    return q;
}

// The lane's 16 values of weight row `row` (null: a row past the matrix) at k-block kb, as 8 words.
template <bool STREAM>
__device__ __forceinline__ void tc_load_w(const bf16_t* __restrict__ row, u32 k, u32 kb, u32 t, u32* wd) {
    const u32 c[2] = {kb + 8u * t, kb + 32u + 8u * t};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        uint4 q = make_uint4(0u, 0u, 0u, 0u);
        if (row != nullptr && c[h] < k) q = ld_weight16<STREAM>(row + c[h]);
        wd[4 * h] = q.x;
        wd[4 * h + 1] = q.y;
        wd[4 * h + 2] = q.z;
        wd[4 * h + 3] = q.w;
    }
}

// The lane's 8 values at half h (columns kb + 32h + 8t, +8) of an f32 row; `fill` past k or for a null row.
__device__ __forceinline__ void tc_load8(const float* __restrict__ row, u32 k, u32 kb, u32 t, int h, float fill,
                                         float4* v) {
    const u32 c = kb + 32u * h + 8u * t;
    v[0] = v[1] = make_float4(fill, fill, fill, fill);
    if (row != nullptr && c < k) {
        v[0] = __ldg(reinterpret_cast<const float4*>(row + c));
        v[1] = __ldg(reinterpret_cast<const float4*>(row + c) + 1);
    }
}

__device__ __forceinline__ float4 mul4(float4 a, float4 b) {
    return make_float4(__fmul_rn(a.x, b.x), __fmul_rn(a.y, b.y), __fmul_rn(a.z, b.z), __fmul_rn(a.w, b.w));
}

// The same 16 values of each of the T activation rows (null: a padding row), times the norm weight's with
// NORM, rounded to bf16 pairs. Half by half, so only 8 of the norm weight's values are live at a time.
template <int T, bool NORM>
__device__ __forceinline__ void tc_load_x(const float* const* xrows, const float* __restrict__ nw, u32 k, u32 kb,
                                          u32 t, u32 (*xd)[8]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float4 n[2];
        if (NORM) tc_load8(nw, k, kb, t, h, 1.0f, n);
#pragma unroll
        for (int i = 0; i < T; ++i) {
            float4 v[2];
            tc_load8(xrows[i], k, kb, t, h, 0.0f, v);
            if (NORM) {
                v[0] = mul4(v[0], n[0]);
                v[1] = mul4(v[1], n[1]);
            }
            xd[i][4 * h] = bf16x2_rn(v[0].x, v[0].y);
            xd[i][4 * h + 1] = bf16x2_rn(v[0].z, v[0].w);
            xd[i][4 * h + 2] = bf16x2_rn(v[1].x, v[1].y);
            xd[i][4 * h + 3] = bf16x2_rn(v[1].z, v[1].w);
        }
    }
}

// acc[p][tile][4]: p = 0 the weight rows col0.., p = 1 the up rows (SwiGLU only); HALF: p = 0 only, the gate rows
// col0.. and then their up rows.
template <int T, bool SWIGLU, bool NORM, bool STREAM, bool HALF, int BPS>
__device__ __forceinline__ void tc_block_mma(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                             const float* __restrict__ nw, u32 n_out, u32 k, u32 m, u32 col0,
                                             float (*acc)[T][4]) {
    constexpr int P = SWIGLU && !HALF ? 2 : 1;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3u;
    const bf16_t* rows[2][2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 col = HALF ? col0 + g : col0 + g + 8u * h;
            const bool live = col < n_out && p < P;
            rows[p][h] = live ? w + ((u64)col + ((HALF ? h : p) ? n_out : 0u)) * k : nullptr;
        }
    }
    const float* xrows[T];
#pragma unroll
    for (int i = 0; i < T; ++i) xrows[i] = (8u * i + g < m) ? x + (u64)(8u * i + g) * k : nullptr;
    // U of the warp's k-blocks per pass, all loads issued before the first mma (the second may lie past k: its
    // loads are predicated off and its zeros add nothing), so each lane keeps 64 bytes per weight row in flight
    // with U = 2. Two tiles of activations fit the registers beside two passes only without SwiGLU's second
    // weight and the norm's (ptxas spilled otherwise), four tiles never: those take one k-block per pass. The
    // accumulation order is the warp's k-blocks in turn either way: a row's bits do not depend on T or U.
    constexpr int U = BPS == 3 ? 1 : T == 1 || (T == 2 && !SWIGLU && !NORM) ? 2 : 1;
    for (u32 kb = warp * TC_KB; kb < k; kb += U * TC_WARPS * TC_KB) {
        u32 wd[U][2][2][8];
        u32 xd[U][T][8];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 kbu = kb + u * TC_WARPS * TC_KB;
#pragma unroll
            for (int p = 0; p < P; ++p) {
                tc_load_w<STREAM>(rows[p][0], k, kbu, t, wd[u][p][0]);
                tc_load_w<STREAM>(rows[p][1], k, kbu, t, wd[u][p][1]);
            }
            tc_load_x<T, NORM>(xrows, nw, k, kbu, t, xd[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int s = 0; s < 4; ++s) {
#pragma unroll
                for (int p = 0; p < P; ++p) {
#pragma unroll
                    for (int i = 0; i < T; ++i) {
                        mma_bf16_16816(acc[p][i], wd[u][p][0][2 * s], wd[u][p][1][2 * s], wd[u][p][0][2 * s + 1],
                                       wd[u][p][1][2 * s + 1], xd[u][i][2 * s], xd[u][i][2 * s + 1]);
                    }
                }
            }
        }
    }
}

// Row r's 1 / rms from its sum-of-squares slots, into inv[r] (NORM); warp w takes rows w, w + 8, ...
template <int T>
__device__ __forceinline__ void tc_row_inv_rms(const float* __restrict__ ss_in, u32 k, u32 m, float eps,
                                               float* inv) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, slots = (k + 15u) / 16u;
    for (u32 r = warp; r < m && r < 8u * T; r += TC_WARPS) {
        float s = 0.0f;
        for (u32 j = lane; j < slots; j += 32u) s = __fadd_rn(s, ss_in[(u64)r * slots + j]);
        s = warp_sum(s);
        if (lane == 0) inv[r] = 1.0f / sqrtf(s / (float)k + eps);
    }
}

// Warp 0's stores of tile i (accumulator e: output column col0 + g (+ 8 for e >= 2; `half`: none), activation row
// 8i + 2t (+ 1 for odd e)), and with ss_out each row's sum of squares of its 16 new values: the lane's two
// columns, then the 8 lanes of the row in a fixed butterfly.
__device__ __forceinline__ void tc_store_tile(const float* v, u32 i, u32 col0, u32 n_out, u32 m,
                                              float* __restrict__ y, u32 y_ld, u32 epi, float* __restrict__ ss_out,
                                              bool half) {
    const u32 lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    float nv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const u32 col = col0 + g + 8u * (e >> 1);
        const u32 r = 8u * i + 2u * t + (e & 1);
        nv[e] = 0.0f;
        if (col >= n_out || r >= m || (half && e >= 2)) continue;  // HALF: 8 columns, in v[0..1]
        float* dst = y + (u64)r * y_ld + col;
        nv[e] = epi == EPI_ADD ? __fadd_rn(*dst, v[e]) : v[e];
        *dst = nv[e];
    }
    if (ss_out == nullptr) return;  // uniform: a kernel argument
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        float s = __fadd_rn(__fmul_rn(nv[q], nv[q]), __fmul_rn(nv[q + 2], nv[q + 2]));
        s = __fadd_rn(s, __shfl_xor_sync(DF_FULL_MASK, s, 4));
        s = __fadd_rn(s, __shfl_xor_sync(DF_FULL_MASK, s, 8));
        s = __fadd_rn(s, __shfl_xor_sync(DF_FULL_MASK, s, 16));
        const u32 r = 8u * i + 2u * t + q;
        if (g == 0 && r < m) ss_out[(u64)r * gridDim.x + blockIdx.x] = s;
    }
}

// The block's shared memory, one allocation for every variant of a kernel: the warps' partial sums (room for
// SwiGLU's two) and the rows' 1 / rms.
template <int T>
struct TcSmem {
    float part[(TC_WARPS - 1) * 2 * T * 4 * 32];
    float inv[8 * T];
};

template <int T, bool SWIGLU, bool NORM, bool STREAM, bool HALF, int BPS>
__device__ __forceinline__ void gemm_bf16_small(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                                float* __restrict__ y, u32 n_out, u32 k, u32 m, u32 y_ld,
                                                u32 epi, const float* __restrict__ norm_w,
                                                const float* __restrict__ ss_in, float* __restrict__ ss_out,
                                                float eps, TcSmem<T>* smem) {
    constexpr int P = SWIGLU && !HALF ? 2 : 1;
    float(*part)[P * T * 4][32] = reinterpret_cast<float(*)[P * T * 4][32]>(smem->part);
    float* inv = smem->inv;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 col0 = blockIdx.x * (HALF ? 8u : 16u);
    float acc[2][T][4];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int i = 0; i < T; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[p][i][e] = 0.0f;
    tc_block_mma<T, SWIGLU, NORM, STREAM, HALF, BPS>(w, x, norm_w, n_out, k, m, col0, acc);
    if (NORM) tc_row_inv_rms<T>(ss_in, k, m, eps, inv);
    // The warps' partial sums, added in warp order by warp 0.
    if (warp > 0) {
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int i = 0; i < T; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[warp - 1][(p * T + i) * 4 + e][lane] = acc[p][i][e];
    }
    __syncthreads();
    if (warp != 0) return;
    for (int v = 0; v < TC_WARPS - 1; ++v) {
#pragma unroll
        for (int p = 0; p < P; ++p)
#pragma unroll
            for (int i = 0; i < T; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[p][i][e] = __fadd_rn(acc[p][i][e], part[v][(p * T + i) * 4 + e][lane]);
    }
#pragma unroll
    for (int i = 0; i < T; ++i) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 r = 8u * i + 2u * (lane & 3u) + (e & 1);
            const float s = NORM && r < m ? inv[r] : 1.0f;
            v[e] = NORM ? __fmul_rn(acc[0][i][e], s) : acc[0][i][e];
            if (SWIGLU && !HALF) v[e] = swiglu_value(v[e], NORM ? __fmul_rn(acc[1][i][e], s) : acc[1][i][e]);
        }
        if (HALF) {  // the gate sums (mma rows g) with the up sums of the same outputs (rows g + 8)
            v[0] = swiglu_value(v[0], v[2]);
            v[1] = swiglu_value(v[1], v[3]);
        }
        tc_store_tile(v, i, col0, n_out, m, y, y_ld, epi, ss_out, HALF);
    }
}

// Before the grid dependency wait: start pulling the first pf_k columns of this block's 16 weight rows (32 with
// SwiGLU unless `half`) into L2: the host passes its first pass (k-blocks 0..15), or all of k for a matrix whose
// resident blocks fit the L2. No kernel writes weights, so they may be read while the kernel before this one
// (launched with PDL) is still finishing; the loads after the wait then hit L2 instead of waiting on DRAM.
__device__ __forceinline__ void tc_prefetch_weights(const bf16_t* __restrict__ w, u32 n_out, u32 k, u32 epi,
                                                    u32 pf_k, bool half) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const u32 parts = epi == EPI_SWIGLU && !half ? 2u : 1u, cols = half ? 8u : 16u;  // HALF: 8 gate + 8 up rows
    if (threadIdx.x >= parts * 16u) return;
    const u32 p = threadIdx.x / cols, col = blockIdx.x * cols + threadIdx.x % cols;
    if (col >= n_out || pf_k == 0) return;
    const u32 bytes = min(k, pf_k) * 2u;  // k % 8 == 0 and pf_k % 8 == 0: a multiple of 16 bytes
    const bf16_t* row = w + ((u64)col + (p ? n_out : 0u)) * k;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(bytes) : "memory");
#endif
}

// gemm_bf16_small_t{T} and, with the pre-norm folded in, gemm_bf16_small_norm_t{T} (kernels of their own: in one kernel
// the four variants' registers spilled at T = 4); `_stream` for matrices read from DRAM (ld_weight16). BPS blocks per
// SM: 2, or 3 for `_stream3_t{1,2}`, the one- and two-tile streamed kernels with one k-block per pass (80 registers)
// for matrices of two to three waves at two per SM (the Qwen3-8B shape's q/k/v, 384 blocks on 132 SMs, for a decode row
// or a verify of up to 16), which then run in one. The same products in the same order (U only changes which loads are
// in flight), so the bits are the two-per-SM kernels'. Measured (PERFORMANCE.md entries 58 and 62): q/k/v 18.6 -> 16.4
// us, the 8B step 0.4-1.0% shorter, its 16-row verify 2.3%; on every streamed matrix the gate/up lost 1.5 us (and with
// two tiles, the gate/up and LM head took a 16-row verify from 5.43 to 6.10 ms), so only those of 2-3 waves take it.
#define DF_GEMM_SMALL(T, NAME, NORM, STREAM, BPS)                                                               \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, BPS)                                            \
        NAME(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, u32 n_out, u32 k, \
             u32 m, u32 y_ld, u32 epi, const float* __restrict__ norm_w, const float* __restrict__ ss_in,        \
             float* __restrict__ ss_out, float eps, u32 pf_k) {                                                 \
        __shared__ TcSmem<T> smem;                                                                              \
        constexpr bool HALF = STREAM && T == 1; /* with SwiGLU: 8 columns per block (see ops/fused.rs) */     \
        tc_prefetch_weights(w, n_out, k, epi, pf_k, HALF && epi == EPI_SWIGLU);                                 \
        DF_GRID_DEPENDENCY();                                                                                   \
        if (epi == EPI_SWIGLU) {                                                                                \
            gemm_bf16_small<T, true, NORM, STREAM, HALF, BPS>(w, x, y, n_out, k, m, y_ld, epi, norm_w, ss_in,     \
                                                              ss_out, eps, &smem);                              \
        } else {                                                                                                \
            gemm_bf16_small<T, false, NORM, STREAM, false, BPS>(w, x, y, n_out, k, m, y_ld, epi, norm_w, ss_in,   \
                                                                ss_out, eps, &smem);                            \
        }                                                                                                       \
    }

DF_GEMM_SMALL(1, gemm_bf16_small_t1, false, false, 2)
DF_GEMM_SMALL(2, gemm_bf16_small_t2, false, false, 2)
DF_GEMM_SMALL(4, gemm_bf16_small_t4, false, false, 2)
DF_GEMM_SMALL(1, gemm_bf16_small_norm_t1, true, false, 2)
DF_GEMM_SMALL(2, gemm_bf16_small_norm_t2, true, false, 2)
DF_GEMM_SMALL(4, gemm_bf16_small_norm_t4, true, false, 2)
DF_GEMM_SMALL(1, gemm_bf16_small_stream_t1, false, true, 2)
DF_GEMM_SMALL(2, gemm_bf16_small_stream_t2, false, true, 2)
DF_GEMM_SMALL(4, gemm_bf16_small_stream_t4, false, true, 2)
DF_GEMM_SMALL(1, gemm_bf16_small_norm_stream_t1, true, true, 2)
DF_GEMM_SMALL(2, gemm_bf16_small_norm_stream_t2, true, true, 2)
DF_GEMM_SMALL(4, gemm_bf16_small_norm_stream_t4, true, true, 2)
DF_GEMM_SMALL(1, gemm_bf16_small_stream3_t1, false, true, 3)
DF_GEMM_SMALL(1, gemm_bf16_small_norm_stream3_t1, true, true, 3)
DF_GEMM_SMALL(2, gemm_bf16_small_stream3_t2, false, true, 3)
DF_GEMM_SMALL(2, gemm_bf16_small_norm_stream3_t2, true, true, 3)
