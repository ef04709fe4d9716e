// GGUF block-quantized matmul and embedding (Q4_0, Q4_1, Q8_0); CPU twins in src/quant (quant::matmul,
// dequantize_row).
//
// Weight layout on the device (repacked at upload by src/cuda/ops/quant.rs, same values as the GGUF
// blocks, split into two arrays so every load is aligned):
//   qs:     [n, k / 2] bytes for Q4_0 / Q4_1, [n, k] for Q8_0. A 32-element block's quants are
//           contiguous: 16 bytes for the 4-bit types (byte j = element j in the low nibble, element j + 16
//           in the high one, as in ggml), 32 signed bytes for Q8_0.
//   scales: [n, k / 32] f16 `d` (Q4_0, Q8_0), or [n, k / 32] pairs of f16 (`d`, `m`) (Q4_1).
//
// As on the CPU (and in llama.cpp), the activations are first quantized to 8-bit blocks of 32 with an
// f32 scale d = amax / 127 and s = d * sum(q); the dot product of a block is an integer sum (dp4a),
// scaled per block in f32 with the CPU's formula and rounding. Only the order in which the blocks'
// terms are summed differs from the CPU. With P = 2 passes (the CPU's ActPrecision::Int8x2) each row's
// rounding error x - d q is quantized into a second row (see quantize_block_quarter), the pair's dot products
// are computed like two rows and added. The quantization follows the CPU's formulas and rounding step by
// step (with the RMSNorm prologue, the norm's own sum order differs).
//
// The kernels fuse what surrounds a matmul in a decoder layer:
//   prologue: the activation rows are RMS-normalised (when `norm_w` is not null) and quantized into
//             shared memory by every block (rows are short; the weights are what must be streamed);
//   epilogue: EPI_STORE, EPI_ADD (residual += y) or EPI_SWIGLU (gate and up rows at col and col + n_out).
// Grid: x strides over output columns (one warp per column, or half a warp in the _r1h kernels), y over chunks of
// R activation rows.
// Memory floor: the weight bytes (0.5625 B/elem Q4_0, 0.625 Q4_1, 1.0625 Q8_0).

#define QF_Q4_0 0
#define QF_Q4_1 1
#define QF_Q8_0 2

#define MMVQ_WARPS 8

// Reductions over the 8 lanes that share a block (lane groups 0-7, 8-15, ...: xor offsets below 8).
__device__ __forceinline__ float group8_max(float v) {
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(DF_FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ int group8_sum(int v) {
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(DF_FULL_MASK, v, o);
    return v;
}

// One lane's 4 elements v (elements 4 e..4 e + 3 of block b, e = lane & 7) of a 32-element block quantized by
// 8 lanes into row `qr` of xq (rows `xq_ld` bytes apart) / xd / xs: q = rn(v * 127 / amax), d = amax / 127, s = d * sum(q). With P = 2
// the rounding error err = v - d q (|err| <= d / 2) also goes into row qr + 1 with the fixed scale d / 254
// (q_err = rn(err * (254 / d)), clamped to +-127), as the CPU's second pass; both rows' sums come back from
// one reduction (|sum(q)| <= 4064 fits the low 16 bits). Every lane takes part in the shuffles; only `live`
// ones write. Max and integer sums are exact, so the bytes are the CPU's whatever the reduction order.
template <int P>
__device__ __forceinline__ void quantize_block_quarter(const float v[4], bool live, u32 qr, u32 b, u32 k, u32 xq_ld,
                                                       signed char* xq, float* xd, float* xs) {
    const u32 e = threadIdx.x & 7u, nb = k >> 5;
    const float amax = group8_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
    // Inverses that overflow (amax below about 3.7e-37) give zero quants, as on the CPU.
    float id = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    id = isinf(id) ? 0.0f : id;
    const float d = __fdiv_rn(amax, 127.0f);
    float id_err = d > 0.0f ? __fdiv_rn(254.0f, d) : 0.0f;
    id_err = isinf(id_err) ? 0.0f : id_err;
    int q[4], q_err[4] = {0, 0, 0, 0}, packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        q[i] = __float2int_rn(__fmul_rn(v[i], id));
        if (P == 2) {
            const float err = __fsub_rn(v[i], __fmul_rn((float)q[i], d));
            q_err[i] = max(-127, min(127, __float2int_rn(__fmul_rn(err, id_err))));
        }
        packed += q[i] + q_err[i] * 65536;
    }
    const int sums = group8_sum(packed);
    if (!live) return;
    const auto pack4 = [](const int* t) {
        return (u32)(t[0] & 0xff) | ((u32)(t[1] & 0xff) << 8) | ((u32)(t[2] & 0xff) << 16) | ((u32)t[3] << 24);
    };
    *reinterpret_cast<u32*>(xq + (u64)qr * xq_ld + b * 32 + 4 * e) = pack4(q);
    if (P == 2) *reinterpret_cast<u32*>(xq + (u64)(qr + 1) * xq_ld + b * 32 + 4 * e) = pack4(q_err);
    if (e == 0) {
        const int sum = P == 2 ? ((sums + 32768) & 0xffff) - 32768 : sums;
        xd[qr * nb + b] = d;
        xs[qr * nb + b] = __fmul_rn(d, (float)sum);
        if (P == 2) {
            const float d_err = __fdiv_rn(d, 254.0f);
            xd[(qr + 1) * nb + b] = d_err;
            xs[(qr + 1) * nb + b] = __fmul_rn(d_err, (float)((sums - sum) / 65536));
        }
    }
}

// A row's RMS-norm factor 1 / sqrt(mean(x^2) + eps), its squares summed by the calling warp in lane-strided order
// (every lane gets it). Every kernel that quantizes a normalised row takes it from here, so a row's bytes do not
// depend on which kernel quantized it.
__device__ __forceinline__ float row_inv_rms(const float* __restrict__ row, u32 k, float eps) {
    const u32 lane = threadIdx.x & 31u;
    float ss = 0.0f;
    for (u32 i = lane; i < k; i += 32) {
        const float v = row[i];
        ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    return 1.0f / sqrtf(ss / (float)k + eps);
}

// The lane's 4 elements of block b of `row` (elements 4 e .. 4 e + 3), (x * inv) * w when norm_w is not null.
__device__ __forceinline__ void load_block_quarter(const float* __restrict__ row, u32 b, u32 e,
                                                   const float* __restrict__ norm_w, float inv, float v[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 c = b * 32 + 4 * e + i;
        v[i] = row[c];
        if (norm_w != nullptr) v[i] = __fmul_rn(__fmul_rn(v[i], inv), norm_w[c]);
    }
}

// Quantizes up to R rows of x (row stride x_ld) into shared memory, P quantized rows per row (the row, then
// its rounding error): xq [R P][k] int8 with rows `xq_ld` bytes apart, xd / xs [R P][k/32]. Rows past `rows` are
// zeros (their outputs are never written). With `norm_w`, each row is first RMS-normalised as the CPU's rms_norm does:
// (x * inv) * w, inv = 1 / sqrt(mean(x^2) + eps).
template <int R, int P>
__device__ __forceinline__ void quantize_rows_smem(const float* __restrict__ x, u32 x_ld, u32 rows, u32 k,
                                                   const float* __restrict__ norm_w, float eps, signed char* xq,
                                                   float* xd, float* xs, u32 xq_ld) {
    __shared__ float inv_rms[R];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 nb = k >> 5;
    if (norm_w != nullptr) {
        for (u32 r = warp; r < R; r += warps) {
            const float inv = r < rows ? row_inv_rms(x + (u64)r * x_ld, k, eps) : 0.0f;
            if (lane == 0) inv_rms[r] = inv;
        }
        __syncthreads();
    }
    // Four blocks per warp and pass, eight lanes each: the prologue's latency is what a decode step's matmuls
    // wait on, and 3-deep reductions take a quarter of the passes that 5-deep ones did.
    for (u32 blk0 = 4 * warp; blk0 < R * nb; blk0 += 4 * warps) {
        const u32 blk = blk0 + (lane >> 3), e = lane & 7u;
        const bool live = blk < R * nb;
        const u32 r = live ? blk / nb : 0, b = live ? blk - r * nb : 0;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (live && r < rows) load_block_quarter(x + (u64)r * x_ld, b, e, norm_w, norm_w ? inv_rms[r] : 0.0f, v);
        quantize_block_quarter<P>(v, live, r * P, b, k, xq_ld, xq, xd, xs);
    }
    __syncthreads();
}

// Integer dot product of one 32-element block: 16 nibble bytes (w) against 32 activation quants (x0: elements
// 0..15, x1: 16..31).
__device__ __forceinline__ int dot_q4_block(uint4 w, int4 x0, int4 x1) {
    const u32 m = 0x0F0F0F0Fu;
    int s = dp4a((int)(w.x & m), x0.x, 0);
    s = dp4a((int)(w.y & m), x0.y, s);
    s = dp4a((int)(w.z & m), x0.z, s);
    s = dp4a((int)(w.w & m), x0.w, s);
    s = dp4a((int)((w.x >> 4) & m), x1.x, s);
    s = dp4a((int)((w.y >> 4) & m), x1.y, s);
    s = dp4a((int)((w.z >> 4) & m), x1.z, s);
    s = dp4a((int)((w.w >> 4) & m), x1.w, s);
    return s;
}

__device__ __forceinline__ int dot_q8_block(int4 w0, int4 w1, int4 x0, int4 x1) {
    int s = dp4a(w0.x, x0.x, 0);
    s = dp4a(w0.y, x0.y, s);
    s = dp4a(w0.z, x0.z, s);
    s = dp4a(w0.w, x0.w, s);
    s = dp4a(w1.x, x1.x, s);
    s = dp4a(w1.y, x1.y, s);
    s = dp4a(w1.z, x1.z, s);
    s = dp4a(w1.w, x1.w, s);
    return s;
}

// One lane's weight block: the quants (16 bytes for the 4-bit types, 32 for Q8_0) and the f16 scale(s).
struct WBlock {
    uint4 q0, q1;
    u32 sc;
};

template <int FMT>
__device__ __forceinline__ WBlock load_wblock(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                              u64 blk) {
    WBlock w;
    if (FMT == QF_Q8_0) {
        const uint4* q = reinterpret_cast<const uint4*>(qs + blk * 32);
        w.q0 = __ldg(q);
        w.q1 = __ldg(q + 1);
        w.sc = __ldg(sc + blk);
    } else {
        w.q0 = __ldg(reinterpret_cast<const uint4*>(qs + blk * 16));
        w.q1 = make_uint4(0, 0, 0, 0);
        w.sc = FMT == QF_Q4_1 ? __ldg(reinterpret_cast<const u32*>(sc) + blk) : (u32)__ldg(sc + blk);
    }
    return w;
}

// Adds block b's terms for the R activation rows, each rounded exactly as the CPU's scalar kernel rounds
// it.
template <int FMT, int R>
__device__ __forceinline__ void mmvq_block(const WBlock& w, u32 b, u32 k, const signed char* xq, const float* xd,
                                           const float* xs, float acc[R]) {
    const u32 nb = k >> 5;
    const float d = f16_to_f32((unsigned short)(w.sc & 0xffffu));
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int4* xv = reinterpret_cast<const int4*>(xq + (u64)r * k + b * 32);
        const float dx = xd[r * nb + b];
        if (FMT == QF_Q8_0) {
            const int4 w0 = make_int4((int)w.q0.x, (int)w.q0.y, (int)w.q0.z, (int)w.q0.w);
            const int4 w1 = make_int4((int)w.q1.x, (int)w.q1.y, (int)w.q1.z, (int)w.q1.w);
            const float sumi = (float)dot_q8_block(w0, w1, xv[0], xv[1]);
            acc[r] += __fmul_rn(__fmul_rn(d, dx), sumi);
        } else {
            const float sumi = (float)dot_q4_block(w.q0, xv[0], xv[1]);
            const float sx = xs[r * nb + b];
            if (FMT == QF_Q4_1) {
                const float m = f16_to_f32((unsigned short)(w.sc >> 16));
                acc[r] += __fadd_rn(__fmul_rn(__fmul_rn(d, dx), sumi), __fmul_rn(m, sx));
            } else {
                acc[r] += __fmul_rn(d, __fsub_rn(__fmul_rn(dx, sumi), __fmul_rn(8.0f, sx)));
            }
        }
    }
}

// Per-lane partial dot products of weight row `row` with the R quantized activation rows (lane b takes
// blocks b, b + 32, ...). `first`, with `use_first`, is this lane's first block (b = lane), loaded before the
// prologue so that its memory latency overlaps the activations' quantization.
template <int FMT, int R>
__device__ __forceinline__ void mmvq_row(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                         u32 row, u32 k, const signed char* xq, const float* xd, const float* xs,
                                         float acc[R], bool use_first, const WBlock first) {
    const u32 lane = threadIdx.x & 31u, nb = k >> 5;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (u32 b = lane; b < nb; b += 32) {
        const WBlock w = (use_first && b == lane) ? first : load_wblock<FMT>(qs, sc, (u64)row * nb + b);
        mmvq_block<FMT, R>(w, b, k, xq, xd, xs, acc);
    }
}

// Adds the warp's P per-lane partial sums of one output (its P quantized rows) into one value.
template <int P>
__device__ __forceinline__ float sum_passes(const float* acc) {
    float v = warp_sum(acc[0]);
    if (P == 2) v = __fadd_rn(v, warp_sum(acc[1]));
    return v;
}

// One activation row (R = 1, as P quantized rows) against two weight rows at once, so twice the loads are in
// flight (a decode step's matmuls are bound by memory latency, not bandwidth). `b_row` < 0: no second row.
template <int FMT, int P>
__device__ __forceinline__ void mmvq_two_rows_r1(const unsigned char* __restrict__ qs,
                                                 const unsigned short* __restrict__ sc, u32 a_row, long long b_row,
                                                 u32 k, const signed char* xq, const float* xd, const float* xs,
                                                 float& a_acc, float& b_acc, bool use_first, const WBlock a_first,
                                                 const WBlock b_first) {
    const u32 lane = threadIdx.x & 31u, nb = k >> 5;
    float a[P], b[P];
#pragma unroll
    for (int p = 0; p < P; ++p) a[p] = b[p] = 0.0f;
    for (u32 blk = lane; blk < nb; blk += 32) {
        const bool first = use_first && blk == lane;
        const WBlock wa = first ? a_first : load_wblock<FMT>(qs, sc, (u64)a_row * nb + blk);
        WBlock wb = b_first;
        if (b_row >= 0 && !first) wb = load_wblock<FMT>(qs, sc, (u64)b_row * nb + blk);
        mmvq_block<FMT, P>(wa, blk, k, xq, xd, xs, a);
        if (b_row >= 0) mmvq_block<FMT, P>(wb, blk, k, xq, xd, xs, b);
    }
    a_acc = sum_passes<P>(a);
    b_acc = sum_passes<P>(b);
}

// The R = 1 epilogue of a pair of weight rows: SwiGLU of gate `a` and up `b` into column `col`, or `a` into `col`
// and `b` into `b_row` (when >= 0), stored or added.
__device__ __forceinline__ void store_r1_pair(float* __restrict__ y, u32 col, long long b_row, float a, float b,
                                              u32 epi) {
    if (epi == EPI_SWIGLU) {
        y[col] = swiglu_value(a, b);
    } else if (epi == EPI_ADD) {
        y[col] = __fadd_rn(y[col], a);
        if (b_row >= 0) y[b_row] = __fadd_rn(y[b_row], b);
    } else {
        y[col] = a;
        if (b_row >= 0) y[b_row] = b;
    }
}

// The R = 1 matmul: each warp takes two weight rows per pass (for SwiGLU its column's gate and up rows,
// otherwise two columns).
template <int FMT, int P>
__device__ __forceinline__ void mmvq_r1(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                        const signed char* xq, const float* xd, const float* xs, float* __restrict__ y,
                                        u32 n_out, u32 k, u32 epi, u32 col0, bool prefetched, const WBlock first,
                                        const WBlock first_b) {
    const u32 lane = threadIdx.x & 31u, step = gridDim.x * MMVQ_WARPS;
    const bool swiglu = epi == EPI_SWIGLU;
    for (u32 col = col0; col < n_out; col += swiglu ? step : 2 * step) {
        const long long b_row = swiglu ? (long long)(col + n_out) : (col + step < n_out ? (long long)(col + step) : -1);
        float a, b;
        mmvq_two_rows_r1<FMT, P>(qs, sc, col, b_row, k, xq, xd, xs, a, b, prefetched && col == col0, first, first_b);
        if (lane != 0) continue;
        store_r1_pair(y, col, b_row, a, b, epi);
    }
}

// warp_sum's last four steps: the butterfly within each half warp.
__device__ __forceinline__ float half_warp_sum(float v) {
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) v += __shfl_xor_sync(DF_FULL_MASK, v, offset);
    return v;
}

// sum_passes for half a warp: lane l holds the tree's leaves l (`lo`) and l + 16 (`hi`) and adds them as
// warp_sum's first step does, then the half finishes the butterfly; the bits are sum_passes'.
template <int P>
__device__ __forceinline__ float half_sum_passes(const float* lo, const float* hi) {
    float v = half_warp_sum(lo[0] + hi[0]);
    if (P == 2) v = __fadd_rn(v, half_warp_sum(lo[1] + hi[1]));
    return v;
}

// mmvq_two_rows_r1 on half a warp: lane l (of 16) takes the blocks of leaves l and l + 16 (l, l + 32, ... and
// l + 16, l + 48, ...), each leaf summed in its own chain as the 32-lane form sums it, so a weight row of at most 32
// blocks (k <= 1024) leaves no lane idle and a warp takes two pairs of rows at once.
template <int FMT, int P>
__device__ __forceinline__ void mmvq_two_rows_r1_half(const unsigned char* __restrict__ qs,
                                                      const unsigned short* __restrict__ sc, u32 a_row,
                                                      long long b_row, u32 k, const signed char* xq, const float* xd,
                                                      const float* xs, float& a_acc, float& b_acc, bool use_first,
                                                      const WBlock a_first, const WBlock b_first) {
    const u32 l = threadIdx.x & 15u, nb = k >> 5;
    float a[P], b[P], a_hi[P], b_hi[P];
#pragma unroll
    for (int p = 0; p < P; ++p) a[p] = b[p] = a_hi[p] = b_hi[p] = 0.0f;
    for (u32 blk = l; blk < nb; blk += 32) {
        const bool first = use_first && blk == l;
        const WBlock wa = first ? a_first : load_wblock<FMT>(qs, sc, (u64)a_row * nb + blk);
        WBlock wb = b_first;
        if (b_row >= 0 && !first) wb = load_wblock<FMT>(qs, sc, (u64)b_row * nb + blk);
        mmvq_block<FMT, P>(wa, blk, k, xq, xd, xs, a);
        if (b_row >= 0) mmvq_block<FMT, P>(wb, blk, k, xq, xd, xs, b);
    }
    for (u32 blk = l + 16; blk < nb; blk += 32) {
        const WBlock wa = load_wblock<FMT>(qs, sc, (u64)a_row * nb + blk);
        mmvq_block<FMT, P>(wa, blk, k, xq, xd, xs, a_hi);
        if (b_row >= 0) mmvq_block<FMT, P>(load_wblock<FMT>(qs, sc, (u64)b_row * nb + blk), blk, k, xq, xd, xs, b_hi);
    }
    a_acc = half_sum_passes<P>(a, a_hi);
    b_acc = half_sum_passes<P>(b, b_hi);
}

// mmvq_r1 with half a warp per pair of weight rows: the halves' units are 2 (blockIdx.x * MMVQ_WARPS + warp) + half.
// The whole warp runs every pass (the butterflies need both halves); a half past the columns computes row 0 and
// stores nothing.
template <int FMT, int P>
__device__ __forceinline__ void mmvq_r1_half(const unsigned char* __restrict__ qs,
                                             const unsigned short* __restrict__ sc, const signed char* xq,
                                             const float* xd, const float* xs, float* __restrict__ y, u32 n_out, u32 k,
                                             u32 epi, u32 unit0, bool prefetched, const WBlock first,
                                             const WBlock first_b) {
    const u32 half = (threadIdx.x >> 4) & 1u, units = gridDim.x * MMVQ_WARPS * 2;
    const bool swiglu = epi == EPI_SWIGLU;
    for (u32 base = unit0 - half; base < n_out; base += swiglu ? units : 2 * units) {
        const u32 col = base + half;
        const bool live = col < n_out;
        const u32 a_row = live ? col : 0;
        const long long b_row = swiglu ? (long long)(a_row + n_out)
                                       : (live && col + units < n_out ? (long long)(col + units) : -1);
        float a, b;
        mmvq_two_rows_r1_half<FMT, P>(qs, sc, a_row, b_row, k, xq, xd, xs, a, b, prefetched && col == unit0, first,
                                      first_b);
        if ((threadIdx.x & 15u) != 0 || !live) continue;
        store_r1_pair(y, col, b_row, a, b, epi);
    }
}

// y = epilogue(quantize(prologue(x)) . W^T) for rows [blockIdx.y * R, +R) of x, each quantized in P passes.
//   x [m, x_ld] f32; y [m, y_ld] f32 (columns 0..n_out written); W [n, k] (n = n_out, or 2 n_out for
//   EPI_SWIGLU). Dynamic shared memory: R * P * k * 1.25 bytes.
template <int FMT, int R, int P, bool HALF = false>
__device__ __forceinline__ void mmvq(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                     const float* __restrict__ x, u32 x_ld, u32 m, const float* __restrict__ norm_w,
                                     float eps, float* __restrict__ y, u32 y_ld, u32 n_out, u32 k, u32 epi) {
    extern __shared__ int4 mmvq_smem[];
    const u32 nb = k >> 5;
    signed char* xq = reinterpret_cast<signed char*>(mmvq_smem);
    float* xd = reinterpret_cast<float*>(xq + (u64)R * P * k);
    float* xs = xd + R * P * nb;
    const u32 row0 = blockIdx.y * R;
    const u32 rows = min((u32)R, m - row0);
    const u32 lane = threadIdx.x & 31u;
    // HALF (R = 1 only): a half warp per column, units 2 (block warp) + half, lane l of 16 prefetching block l.
    const u32 col0 = HALF ? (blockIdx.x * MMVQ_WARPS + (threadIdx.x >> 5)) * 2 + ((threadIdx.x >> 4) & 1u)
                          : blockIdx.x * MMVQ_WARPS + (threadIdx.x >> 5);
    const u32 units = gridDim.x * MMVQ_WARPS * (HALF ? 2 : 1), first_blk = HALF ? (lane & 15u) : lane;
    // The first column's first weight blocks are loaded before the prologue (for k <= 1024 that is the
    // whole row), so the weights' latency overlaps the activations' norm and quantization.
    WBlock first = {}, first_up = {};
    const bool prefetch = col0 < n_out && first_blk < nb;
    // The R = 1 path's second row: the up row for SwiGLU, else the warp's next column.
    const u32 second = epi == EPI_SWIGLU ? col0 + n_out : col0 + units;
    const bool second_ok = epi == EPI_SWIGLU || col0 + units < n_out;
    if (prefetch) {
        first = load_wblock<FMT>(qs, sc, (u64)col0 * nb + first_blk);
        if (R == 1 ? second_ok : epi == EPI_SWIGLU) {
            first_up = load_wblock<FMT>(qs, sc, (u64)(R == 1 ? second : col0 + n_out) * nb + first_blk);
        }
    }
    quantize_rows_smem<R, P>(x + (u64)row0 * x_ld, x_ld, rows, k, norm_w, eps, xq, xd, xs, k);
    if (R == 1 && HALF) {
        mmvq_r1_half<FMT, P>(qs, sc, xq, xd, xs, y + (u64)row0 * y_ld, n_out, k, epi, col0, prefetch, first, first_up);
        return;
    }
    if (R == 1) {
        mmvq_r1<FMT, P>(qs, sc, xq, xd, xs, y + (u64)row0 * y_ld, n_out, k, epi, col0, prefetch, first, first_up);
        return;
    }
    for (u32 col = col0; col < n_out; col += gridDim.x * MMVQ_WARPS) {
        float acc_p[R * P], up_p[R * P], acc[R], up[R];
        const bool use_first = prefetch && col == col0;
        mmvq_row<FMT, R * P>(qs, sc, col, k, xq, xd, xs, acc_p, use_first, first);
        if (epi == EPI_SWIGLU) mmvq_row<FMT, R * P>(qs, sc, col + n_out, k, xq, xd, xs, up_p, use_first, first_up);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            acc[r] = sum_passes<P>(acc_p + r * P);
            if (epi == EPI_SWIGLU) up[r] = sum_passes<P>(up_p + r * P);
        }
        // Lane r writes row r, so the R stores go out in parallel.
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (lane == (u32)r && (u32)r < rows) {
                float* dst = y + (u64)(row0 + r) * y_ld + col;
                if (epi == EPI_STORE) {
                    *dst = acc[r];
                } else if (epi == EPI_ADD) {
                    *dst = __fadd_rn(*dst, acc[r]);
                } else {
                    *dst = swiglu_value(acc[r], up[r]);
                }
            }
        }
    }
}

// NAME_rR: one pass (Int8); NAME_rR_x2: two (Int8x2), up to 4 rows (8 would spill its 32 accumulators).
#define DF_MMVQ(NAME, FMT, R, P, SUFFIX)                                                                       \
    extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 4)                                            \
        NAME##_r##R##SUFFIX(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,        \
                            const float* __restrict__ x, u32 x_ld, u32 m, const float* __restrict__ norm_w,     \
                            float eps, float* __restrict__ y, u32 y_ld, u32 n_out, u32 k, u32 epi) {            \
        DF_GRID_DEPENDENCY();                                                                                   \
        mmvq<FMT, R, P>(qs, sc, x, x_ld, m, norm_w, eps, y, y_ld, n_out, k, epi);                               \
    }

// NAME_r1h / NAME_r1h_x2: one row, half a warp per column (k <= 1024).
#define DF_MMVQ_HALF(NAME, FMT, P, SUFFIX)                                                                     \
    extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, 4)                                            \
        NAME##_r1h##SUFFIX(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,         \
                           const float* __restrict__ x, u32 x_ld, u32 m, const float* __restrict__ norm_w,      \
                           float eps, float* __restrict__ y, u32 y_ld, u32 n_out, u32 k, u32 epi) {             \
        DF_GRID_DEPENDENCY();                                                                                   \
        mmvq<FMT, 1, P, true>(qs, sc, x, x_ld, m, norm_w, eps, y, y_ld, n_out, k, epi);                         \
    }

#define DF_MMVQ_ALL_R(NAME, FMT)   \
    DF_MMVQ_HALF(NAME, FMT, 1, )   \
    DF_MMVQ_HALF(NAME, FMT, 2, _x2) \
    DF_MMVQ(NAME, FMT, 1, 1, )     \
    DF_MMVQ(NAME, FMT, 2, 1, )     \
    DF_MMVQ(NAME, FMT, 4, 1, )     \
    DF_MMVQ(NAME, FMT, 8, 1, )     \
    DF_MMVQ(NAME, FMT, 1, 2, _x2)  \
    DF_MMVQ(NAME, FMT, 2, 2, _x2)  \
    DF_MMVQ(NAME, FMT, 4, 2, _x2)

DF_MMVQ_ALL_R(mmvq_q4_0, QF_Q4_0)
DF_MMVQ_ALL_R(mmvq_q4_1, QF_Q4_1)
DF_MMVQ_ALL_R(mmvq_q8_0, QF_Q8_0)

// out[t, :] = dequantize(table row ids[t]) for a repacked quantized table [vocab, hidden]; bit-identical to
// the CPU's dequantize_row. An id >= vocab gives a row of NaN. Grid: one block per id.
extern "C" __global__ void embedding_quant(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                           const u32* __restrict__ ids, float* __restrict__ out, u32 vocab,
                                           u32 hidden, u32 fmt) {
    DF_GRID_DEPENDENCY();
    const u64 t = blockIdx.x;
    const u32 id = ids[t];
    float* dst = out + t * hidden;
    const u32 nb = hidden >> 5;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) {
        if (id >= vocab) {
            dst[i] = DF_NAN;
            continue;
        }
        const u64 blk = (u64)id * nb + (i >> 5);
        const u32 j = i & 31u;
        if (fmt == QF_Q8_0) {
            const float d = f16_to_f32(sc[blk]);
            dst[i] = __fmul_rn(d, (float)(signed char)qs[blk * 32 + j]);
        } else {
            const unsigned char byte = qs[blk * 16 + (j & 15u)];
            const int q = j < 16 ? (byte & 15) : (byte >> 4);
            if (fmt == QF_Q4_1) {
                const float d = f16_to_f32(sc[2 * blk]), m = f16_to_f32(sc[2 * blk + 1]);
                dst[i] = __fadd_rn(__fmul_rn(d, (float)q), m);
            } else {
                dst[i] = __fmul_rn(f16_to_f32(sc[blk]), (float)(q - 8));
            }
        }
    }
}
