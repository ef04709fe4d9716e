// Many-row quantized matmul on the int8 tensor cores: mmvq's outputs (quant.cu), bit for bit, for steps of 128 rows
// and more (MMQ_MIN_ROWS), where mmvq's dp4a loops take every 4 activation rows through the weights again: 22% off
// a 256-row step of the default model, 27% more prefill (PERFORMANCE.md entry 65). Below 128 rows mmvq is as fast.
//
// What mmvq computes for output (row, col): lane c of a warp adds, in order, the f32 terms of blocks c, c + 32, ...
// (each term a 32-element block's exact integer dot product, scaled in f32 as mmvq_block does), starting from 0;
// then warp_sum's butterfly (xor 16, 8, 4, 2, 1) adds the 32 lane sums; with two activation passes the two sums
// are added last. The integer dot products are exact however they are computed, so here mma.sync m16n8k32 computes
// them, 16 quantized rows x 8 columns x one block at a time, and each thread redoes the f32 part in mmvq's order:
// per output, the 32 lane sums ("leaves") in bit-reversed lane order (0, 16, 8, 24, 4, ...) added pairwise, level
// by level, which is exactly the butterfly's tree of additions. Float addition is commutative, so every addition has
// mmvq's operands and gives its bits.
//
// Tiles: an m16 tile holds 16 / P activation rows. With two passes its rows 0-7 are the rows' first pass and rows
// 8-15 their second, so the two rows of a thread's C fragment are one activation row's two passes. A block takes
// MMQ_MT m16 tiles and two n8 tiles: 16 columns, or for SwiGLU 8 gate columns and their 8 up columns. Its
// MMQ_WARPS warps share the rows' quantized activations (quantize_rows_smem, as mmvq) and split the tree: warp w
// sums leaves 4 w .. 4 w + 3 (a subtree), and the block adds the eight subtrees as the tree's top three levels do.
// Splitting the leaves rather than the columns keeps each warp's chain of dependent loads short and gives small
// steps as many warps as mmvq has; a block takes several slabs in turn, so the activations it quantizes serve
// them all. Grid: x over (strided) column slabs, y over chunks of MMQ_MT * 16 / P rows.

#define MMQ_WARPS 8
#define MMQ_MT 2

// d = a . b + 0 for a 16x32 s8 tile (row-major) and a 32x8 s8 tile (column-major): one block of 16 quantized rows
// against 8 weight rows.
__device__ __forceinline__ void mma_s8_16x8x32(int d[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}

// One block's term for one output, rounded exactly as mmvq_block rounds it: `sc` the weight block's f16 scale(s),
// dx / sx the activation block's scale and scaled quant sum.
template <int FMT>
__device__ __forceinline__ float mmq_term(int sumi, u32 sc, float dx, float sx) {
    const float d = f16_to_f32((unsigned short)(sc & 0xffffu));
    const float s = (float)sumi;
    if (FMT == QF_Q8_0) return __fmul_rn(__fmul_rn(d, dx), s);
    if (FMT == QF_Q4_1) {
        const float m = f16_to_f32((unsigned short)(sc >> 16));
        return __fadd_rn(__fmul_rn(__fmul_rn(d, dx), s), __fmul_rn(m, sx));
    }
    return __fmul_rn(d, __fsub_rn(__fmul_rn(dx, s), __fmul_rn(8.0f, sx)));
}

// The B fragment of weight row `row`, block b (k = 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3 of the block), and
// the block's scale(s). The 4-bit types hold element j in the low nibble of byte j and element j + 16 in its high
// nibble, so one 4-byte load gives both halves; the nibbles (0..15) are valid s8 values.
template <int FMT>
__device__ __forceinline__ void mmq_load_b(const unsigned char* __restrict__ qs, u32 row, u32 nb, u32 b, u32 t,
                                           u32& b0, u32& b1) {
    const u64 blk = (u64)row * nb + b;
    if (FMT == QF_Q8_0) {
        b0 = __ldg(reinterpret_cast<const u32*>(qs + blk * 32) + t);
        b1 = __ldg(reinterpret_cast<const u32*>(qs + blk * 32 + 16) + t);
    } else {
        const u32 w = __ldg(reinterpret_cast<const u32*>(qs + blk * 16) + t);
        b0 = w & 0x0F0F0F0Fu;
        b1 = (w >> 4) & 0x0F0F0F0Fu;
    }
}

template <int FMT>
__device__ __forceinline__ u32 mmq_load_scale(const unsigned short* __restrict__ sc, u32 row, u32 nb, u32 b) {
    const u64 blk = (u64)row * nb + b;
    return FMT == QF_Q4_1 ? __ldg(reinterpret_cast<const u32*>(sc) + blk) : (u32)__ldg(sc + blk);
}

// Lane c's position in the butterfly's tree: leaves are added pairwise in bit-reversed lane order.
__host__ __device__ constexpr u32 mmq_leaf_lane(u32 i) {
    return ((i & 1u) << 4) | ((i & 2u) << 2) | (i & 4u) | ((i & 8u) >> 2) | ((i & 16u) >> 4);
}

// What a warp's threads need to compute their outputs' leaves: the weights, the block's quantized activations, and
// the thread's rows and columns.
struct MmqWarp {
    const unsigned char* qs;
    const unsigned short* sc;
    const signed char* xq;
    const float* xd;
    const float* xs;
    u32 nb, ld, t;       // blocks per row, bytes between quantized rows, lane & 3
    u32 b_row[2];        // weight row of the B fragment's column g, per n8 tile
    u32 c_row[2][2];     // weight rows of the thread's C columns 2 t and 2 t + 1, per n8 tile
    u32 q_lo[MMQ_MT];    // quantized rows of the thread's A / C rows g and g + 8, per m16 tile
    u32 q_hi[MMQ_MT];
};

// The leaf of lane `lane` for each of the thread's outputs: the terms of blocks lane, lane + 32, ... added in order
// from 0, as that lane of mmvq adds them.
template <int FMT>
__device__ __forceinline__ void mmq_leaf(const MmqWarp& w, u32 lane, float v[MMQ_MT][2][4]) {
#pragma unroll
    for (int mt = 0; mt < MMQ_MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) v[mt][nt][e] = 0.0f;
    for (u32 b = lane; b < w.nb; b += 32) {
        u32 bf[2][2], scl[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            mmq_load_b<FMT>(w.qs, w.b_row[nt], w.nb, b, w.t, bf[nt][0], bf[nt][1]);
            scl[nt][0] = mmq_load_scale<FMT>(w.sc, w.c_row[nt][0], w.nb, b);
            scl[nt][1] = mmq_load_scale<FMT>(w.sc, w.c_row[nt][1], w.nb, b);
        }
#pragma unroll
        for (int mt = 0; mt < MMQ_MT; ++mt) {
            const signed char* lo = w.xq + (u64)w.q_lo[mt] * w.ld + b * 32 + 4 * w.t;
            const signed char* hi = w.xq + (u64)w.q_hi[mt] * w.ld + b * 32 + 4 * w.t;
            const u32 a[4] = {*reinterpret_cast<const u32*>(lo), *reinterpret_cast<const u32*>(hi),
                              *reinterpret_cast<const u32*>(lo + 16), *reinterpret_cast<const u32*>(hi + 16)};
            const float dx[2] = {w.xd[w.q_lo[mt] * w.nb + b], w.xd[w.q_hi[mt] * w.nb + b]};
            const float sx[2] = {w.xs[w.q_lo[mt] * w.nb + b], w.xs[w.q_hi[mt] * w.nb + b]};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                int d[4];
                mma_s8_16x8x32(d, a, bf[nt][0], bf[nt][1]);
#pragma unroll
                for (int e = 0; e < 4; ++e) v[mt][nt][e] += mmq_term<FMT>(d[e], scl[nt][e & 1], dx[e >> 1], sx[e >> 1]);
            }
        }
    }
}

// The sum of leaves [FIRST, FIRST + 2^L) of the tree for each of the thread's outputs, added as the butterfly adds
// them; mmq_tree<FMT, 5, 0> is warp_sum of mmvq's lane sums. Templates keep every index a constant.
template <int FMT, int L, u32 FIRST>
__device__ __forceinline__ void mmq_tree(const MmqWarp& w, float v[MMQ_MT][2][4]) {
    if constexpr (L == 0) {
        mmq_leaf<FMT>(w, mmq_leaf_lane(FIRST), v);
    } else {
        float left[MMQ_MT][2][4];
        mmq_tree<FMT, L - 1, FIRST>(w, left);
        mmq_tree<FMT, L - 1, FIRST + (1u << (L - 1))>(w, v);
#pragma unroll
        for (int mt = 0; mt < MMQ_MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) v[mt][nt][e] = left[mt][nt][e] + v[mt][nt][e];
    }
}

// Output (i, lane) of a slab: the eight warps' subtrees added as the tree's top three levels add them,
// ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
__device__ __forceinline__ float mmq_top(const float (*subtrees)[MMQ_MT * 2 * 4][32], int i, u32 lane) {
    float p[MMQ_WARPS];
#pragma unroll
    for (int w = 0; w < MMQ_WARPS; ++w) p[w] = subtrees[w][i][lane];
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// A slab's epilogue, spread over the block: warp (mt, nt, j) writes, for each lane's (g, t), column 2 t + j of n8
// tile nt in m16 tile mt (for SwiGLU the nt = 0 warps, with the up value from tile 1). Fragment value e of a
// thread is its row g (e = 0, 1) or g + 8 (e = 2, 3), column 2 t + (e & 1).
template <int P>
__device__ __forceinline__ void mmq_store(const float (*subtrees)[MMQ_MT * 2 * 4][32], u32 warp, u32 lane, u32 rows,
                                          float* __restrict__ y, u32 y_ld, u32 n0, u32 n_out, u32 epi) {
    const u32 mt = warp >> 2, nt = (warp >> 1) & 1u, j = warp & 1u, g = lane >> 2, t = lane & 3u;
    const bool swiglu = epi == EPI_SWIGLU;
    if (swiglu && nt == 1) return;
    const u32 col = n0 + (swiglu ? 0 : 8 * nt) + 2 * t + j;
    if (col >= n_out) return;
    const auto value = [&](u32 tile, u32 e) { return mmq_top(subtrees, (int)((mt * 2 + tile) * 4 + e), lane); };
#pragma unroll
    for (int half = 0; half < (P == 2 ? 1 : 2); ++half) {
        // Two passes: C rows g and g + 8 are one row's passes. One pass: two rows.
        const u32 r = P == 2 ? mt * 8 + g : mt * 16 + g + 8 * half;
        if (r >= rows) continue;
        const auto out = [&](u32 tile) {
            return P == 2 ? __fadd_rn(value(tile, j), value(tile, 2 + j)) : value(tile, 2 * half + j);
        };
        float* dst = y + (u64)r * y_ld + col;
        if (swiglu) {
            *dst = swiglu_value(out(0), out(1));
        } else {
            const float v = out(nt);
            *dst = epi == EPI_ADD ? __fadd_rn(*dst, v) : v;
        }
    }
}

// Bytes between quantized rows in shared memory: k plus padding that puts the A fragment's eight rows (quantized
// rows g, or 2 g with two passes) four banks apart, so its 32 lanes' loads hit 32 banks. src/cuda/ops/quant.rs
// (mmq_row_bytes) computes the same.
template <int P>
__device__ __forceinline__ u32 mmq_row_bytes(u32 k) {
    const u32 words = k >> 2;
    const u32 pad = P == 2 ? (2u + 16u - (words & 15u)) & 15u : (4u + 32u - (words & 31u)) & 31u;
    return k + 4 * pad;
}

// y = epilogue(quantize(prologue(x)) . W^T), as mmvq (same arguments, same bits), for rows
// [blockIdx.y * BM, +BM) of x, BM = MMQ_MT * 16 / P, and the column slabs blockIdx.x, + gridDim.x, ... Dynamic shared memory: MMQ_MT * 16 quantized rows of
// mmq_row_bytes(k) bytes, then their two f32 per 32-element block.
template <int FMT, int P>
__device__ __forceinline__ void mmq(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                    const float* __restrict__ x, u32 x_ld, u32 m, const float* __restrict__ norm_w,
                                    float eps, float* __restrict__ y, u32 y_ld, u32 n_out, u32 k, u32 epi) {
    constexpr int BM = MMQ_MT * 16 / P;
    extern __shared__ int4 mmq_smem[];
    const u32 nb = k >> 5;
    signed char* xq = reinterpret_cast<signed char*>(mmq_smem);
    const u32 ld = mmq_row_bytes<P>(k);
    float* xd = reinterpret_cast<float*>(xq + (u64)BM * P * ld);
    float* xs = xd + BM * P * nb;
    const u32 row0 = blockIdx.y * BM;
    const u32 rows = min((u32)BM, m - row0);
    quantize_rows_smem<BM, P>(x + (u64)row0 * x_ld, x_ld, rows, k, norm_w, eps, xq, xd, xs, ld);

    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3u;
    const bool swiglu = epi == EPI_SWIGLU;
    const u32 slab_cols = swiglu ? 8u : 16u;
    MmqWarp w{qs, sc, xq, xd, xs, nb, ld, t, {}, {}, {}, {}};
#pragma unroll
    for (int mt = 0; mt < MMQ_MT; ++mt) {
        w.q_lo[mt] = P == 2 ? (mt * 8 + g) * 2 : mt * 16 + g;
        w.q_hi[mt] = P == 2 ? w.q_lo[mt] + 1 : w.q_lo[mt] + 8;
    }
    __shared__ float subtrees[MMQ_WARPS][MMQ_MT * 2 * 4][32];
    // The block's slabs of columns, each with the rows' quantized activations it holds (quantized once).
    for (u32 n0 = blockIdx.x * slab_cols; n0 < n_out; n0 += gridDim.x * slab_cols) {
        // Columns past n_out read weight row 0; their outputs are never written.
        const auto weight_row = [&](int nt, u32 c) -> u32 {
            const u32 col = swiglu ? n0 + c : n0 + 8 * nt + c;
            if (col >= n_out) return 0;
            return swiglu && nt == 1 ? col + n_out : col;
        };
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            w.b_row[nt] = weight_row(nt, g);
            w.c_row[nt][0] = weight_row(nt, 2 * t);
            w.c_row[nt][1] = weight_row(nt, 2 * t + 1);
        }
        // Warp i's subtree of leaves 4 i .. 4 i + 3.
        float sum[MMQ_MT][2][4];
        switch (warp) {
            case 0: mmq_tree<FMT, 2, 0>(w, sum); break;
            case 1: mmq_tree<FMT, 2, 4>(w, sum); break;
            case 2: mmq_tree<FMT, 2, 8>(w, sum); break;
            case 3: mmq_tree<FMT, 2, 12>(w, sum); break;
            case 4: mmq_tree<FMT, 2, 16>(w, sum); break;
            case 5: mmq_tree<FMT, 2, 20>(w, sum); break;
            case 6: mmq_tree<FMT, 2, 24>(w, sum); break;
            default: mmq_tree<FMT, 2, 28>(w, sum); break;
        }
#pragma unroll
        for (int mt = 0; mt < MMQ_MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) subtrees[warp][(mt * 2 + nt) * 4 + e][lane] = sum[mt][nt][e];
        __syncthreads();
        mmq_store<P>(subtrees, warp, lane, rows, y + (u64)row0 * y_ld, y_ld, n0, n_out, epi);
        __syncthreads();
    }
}

// A quantized matmul kernel of THREADS threads a block running IMPL<FMT, P> on the arguments every quantized matmul
// takes (mmvq's).
#define DF_QUANT_MATMUL(NAME, IMPL, THREADS, FMT, P)                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                       \
        NAME(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,                       \
             const float* __restrict__ x, u32 x_ld, u32 m, const float* __restrict__ norm_w, float eps,         \
             float* __restrict__ y, u32 y_ld, u32 n_out, u32 k, u32 epi) {                                      \
        DF_GRID_DEPENDENCY();                                                                                   \
        IMPL<FMT, P>(qs, sc, x, x_ld, m, norm_w, eps, y, y_ld, n_out, k, epi);                                  \
    }

// NAME: one activation pass (Int8); NAME_x2: two (Int8x2).
#define DF_QUANT_MATMUL_PASSES(NAME, IMPL, THREADS, FMT) \
    DF_QUANT_MATMUL(NAME, IMPL, THREADS, FMT, 1)         \
    DF_QUANT_MATMUL(NAME##_x2, IMPL, THREADS, FMT, 2)

DF_QUANT_MATMUL_PASSES(mmq_q4_0, mmq, MMQ_WARPS * 32, QF_Q4_0)
DF_QUANT_MATMUL_PASSES(mmq_q4_1, mmq, MMQ_WARPS * 32, QF_Q4_1)
DF_QUANT_MATMUL_PASSES(mmq_q8_0, mmq, MMQ_WARPS * 32, QF_Q8_0)
