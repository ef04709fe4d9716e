// Quantized matmul of 40 rows and more on the int8 tensor cores, one whole tree per warp: mmvq's outputs (quant.cu),
// bit for bit, as mmq (mmq.cu) gives them.
//
// mmq splits each output's 32 leaves over a block's 8 warps and adds their subtrees through shared memory after a
// barrier, and its leaves wait on L2 for every weight block in turn (PERFORMANCE.md entry 65). Here each warp takes
// a slab of 16 weight rows (8 gate rows and their 8 up rows for SwiGLU) against one m16 tile of quantized rows (8
// activation rows with two passes, 16 with one) and adds all 32 leaves itself, in the butterfly's order (mmq.cu's
// header says why that order gives mmvq's bits). The slab is first copied into the warp's own shared memory with
// cp.async, every load in flight at once, so the leaves read it there. The block's warps share the rows' quantized
// activations (quantize_rows_smem, as mmvq and mmq, or rows quantize_act_rows quantized once for every block). No
// barrier follows the prologue but the one that publishes the rows. Below about 40 rows a layer
// matrix gives it too few warps (576 columns: 36), each walking a whole row, and mmvq is faster; from 40 rows it
// beats mmvq, and mmq at every size measured, up to 2,048-row prefill chunks (entries 78 and 79). Where a step's
// slabs and row chunks still leave SMs idle, a slab's tree splits over two warps (entry 90).
//
// Grid: x over slabs (group w of S warps of block x takes slabs x G + w, + gridDim.x G, ..., G = blockDim.x / 32 S),
// y over chunks of 16 / P activation rows. Dynamic shared memory: mmqw_smem_bytes (src/cuda/ops/quant.rs computes the
// same).

// The slab's weight rows: 16, each `wld` bytes apart in shared memory.
#define MMQW_SLAB_ROWS 16

// Most warps a block (MMQ_WARP_WARPS in src/cuda/kernels.rs): the block's warps share its rows' quantization, whose
// passes are the kernel's longest chain (PERFORMANCE.md entry 89), so blocks take as many as shared memory allows.
#define MMQW_WARPS 16

// cp.async of 16 bytes, global to shared, through L2 only.
__device__ __forceinline__ void mmqw_cp_async16(void* smem, const void* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}

// cp.async of 4 bytes, global to shared, through L1.
__device__ __forceinline__ void mmqw_cp_async4(void* smem, const void* gmem) {
    const u32 dst = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem) : "memory");
}

__device__ __forceinline__ void mmqw_cp_async_wait_all() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// Bytes of one weight row's quants.
template <int FMT>
__host__ __device__ constexpr u32 mmqw_row_quant_bytes(u32 k) {
    return FMT == QF_Q8_0 ? k : k / 2;
}

// Bytes between a slab's weight rows in shared memory: the quants plus padding that makes the row stride in words
// 4 mod 8, so a B fragment's loads (word t of row g's block, g = 0..7, t = 0..3) hit 32 banks.
template <int FMT>
__device__ __forceinline__ u32 mmqw_wld(u32 k) {
    const u32 bytes = mmqw_row_quant_bytes<FMT>(k);
    return (bytes / 4) % 8 == 4 ? bytes : bytes + 16;
}

// A weight block's scale(s) as stored: an f16 pair for Q4_1, one f16 otherwise.
template <bool PAIR>
struct MmqwScaleOf {
    typedef unsigned short type;
};
template <>
struct MmqwScaleOf<true> {
    typedef u32 type;
};
template <int FMT>
using MmqwScale = typename MmqwScaleOf<FMT == QF_Q4_1>::type;

// Scales between a slab's weight rows in shared memory, as stored (MmqwScale): the four a warp reads at once (rows
// 2 t, t = 0..3) sit in four banks, and each row starts 4-byte aligned for cp.async: odd for Q4_1's words, 2 mod 4
// for the f16 halves.
template <int FMT>
__device__ __forceinline__ u32 mmqw_sld(u32 nb) {
    return FMT == QF_Q4_1 ? (nb | 1u) : nb + ((6u - (nb & 3u)) & 3u);
}

// What a warp's threads need for the leaves of its slab: the slab and the block's quantized activations.
struct MmqwWarp {
    const u32* wq;       // [16][wld / 4] the slab's quants
    const void* wsc;     // [16][sld] the slab's scales, as stored (MmqwScale)
    const signed char* xq;
    const float* xd;
    const float* xs;
    u32 nb, ld, wwords, sld, g, t;
    u32 q_lo, q_hi;      // quantized rows of the thread's A / C rows g and g + 8
};

// The leaf of lane `lane` for the thread's 8 outputs (n8 tile nt, fragment value e at nt * 4 + e): the terms of
// blocks lane, lane + 32, ... added in order from 0, as that lane of mmvq adds them.
template <int FMT>
__device__ __forceinline__ void mmqw_leaf(const MmqwWarp& w, u32 lane, float v[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    for (u32 b = lane; b < w.nb; b += 32) {
        const signed char* lo = w.xq + (u64)w.q_lo * w.ld + b * 32 + 4 * w.t;
        const signed char* hi = w.xq + (u64)w.q_hi * w.ld + b * 32 + 4 * w.t;
        const u32 a[4] = {*reinterpret_cast<const u32*>(lo), *reinterpret_cast<const u32*>(hi),
                          *reinterpret_cast<const u32*>(lo + 16), *reinterpret_cast<const u32*>(hi + 16)};
        const float dx[2] = {w.xd[w.q_lo * w.nb + b], w.xd[w.q_hi * w.nb + b]};
        const float sx[2] = {w.xs[w.q_lo * w.nb + b], w.xs[w.q_hi * w.nb + b]};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const u32* row = w.wq + (nt * 8 + w.g) * w.wwords;
            u32 b0, b1;
            if (FMT == QF_Q8_0) {
                b0 = row[8 * b + w.t];
                b1 = row[8 * b + 4 + w.t];
            } else {
                const u32 q = row[4 * b + w.t];
                b0 = q & 0x0F0F0F0Fu;
                b1 = (q >> 4) & 0x0F0F0F0Fu;
            }
            const MmqwScale<FMT>* scales = static_cast<const MmqwScale<FMT>*>(w.wsc);
            const u32 sc0 = scales[(nt * 8 + 2 * w.t) * w.sld + b];
            const u32 sc1 = scales[(nt * 8 + 2 * w.t + 1) * w.sld + b];
            int d[4];
            mma_s8_16x8x32(d, a, b0, b1);
#pragma unroll
            for (int e = 0; e < 4; ++e) v[nt * 4 + e] += mmq_term<FMT>(d[e], (e & 1) ? sc1 : sc0, dx[e >> 1], sx[e >> 1]);
        }
    }
}

// The sum of leaves [FIRST, FIRST + 2^L) of the tree (positions in bit-reversed lane order) for each of the thread's
// outputs, added as the butterfly adds them; mmqw_tree<FMT, 5, 0> is warp_sum of mmvq's lane sums.
template <int FMT, int L, u32 FIRST>
__device__ __forceinline__ void mmqw_tree(const MmqwWarp& w, float v[8]) {
    if constexpr (L == 0) {
        mmqw_leaf<FMT>(w, mmq_leaf_lane(FIRST), v);
    } else {
        float left[8];
        mmqw_tree<FMT, L - 1, FIRST>(w, left);
        mmqw_tree<FMT, L - 1, FIRST + (1u << (L - 1))>(w, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = left[i] + v[i];
    }
}

// Starts copying slab rows `row_of(s)`, s = 0..15, into the warp's shared memory by cp.async: the quants, and the
// scales where their rows are 4-byte aligned (always for Q4_1; for the f16 scales when nb is even). Returns whether
// the scales still need mmqw_load_scales. Nothing here reads the step's activations, so the copy may start before the
// prologue and overlap it; mmqw_cp_async_wait_all ends it.
template <int FMT, class RowOf>
__device__ __forceinline__ bool mmqw_start_slab(const unsigned char* __restrict__ qs,
                                                const unsigned short* __restrict__ sc, u32 k, u32 nb, u32 wld,
                                                u32 sld, const RowOf& row_of, unsigned char* wq, void* wsc) {
    const u32 lane = threadIdx.x & 31u;
    const u32 row_bytes = mmqw_row_quant_bytes<FMT>(k), chunks = row_bytes / 16;
    for (u32 i = lane; i < MMQW_SLAB_ROWS * chunks; i += 32) {
        const u32 s = i / chunks, c = i - s * chunks;
        mmqw_cp_async16(wq + s * wld + c * 16, qs + (u64)row_of(s) * row_bytes + c * 16);
    }
    // Scale bytes per row, and 4-byte words of them.
    const u32 bytes = nb * (u32)sizeof(MmqwScale<FMT>), words = bytes / 4;
    if (bytes % 4 != 0) return true;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(sc);
    unsigned char* dst = static_cast<unsigned char*>(wsc);
    for (u32 i = lane; i < MMQW_SLAB_ROWS * words; i += 32) {
        const u32 s = i / words, c = i - s * words;
        mmqw_cp_async4(dst + (u64)s * sld * sizeof(MmqwScale<FMT>) + 4 * c, src + (u64)row_of(s) * bytes + 4 * c);
    }
    return false;
}

// The f16 scales of a slab whose rows are not 4-byte aligned (nb odd), by plain loads.
template <int FMT, class RowOf>
__device__ __forceinline__ void mmqw_load_scales(const unsigned short* __restrict__ sc, u32 nb, u32 sld,
                                                 const RowOf& row_of, void* wsc) {
    const u32 lane = threadIdx.x & 31u;
    MmqwScale<FMT>* dst = static_cast<MmqwScale<FMT>*>(wsc);
#pragma unroll 8
    for (u32 i = lane; i < MMQW_SLAB_ROWS * nb; i += 32) {
        const u32 s = i / nb, b = i - s * nb;
        dst[s * sld + b] = (MmqwScale<FMT>)mmq_load_scale<FMT>(sc, row_of(s), nb, b);
    }
}

// Stores a slab's outputs from the thread's fragments: column 2 t + j of n8 tile nt (for SwiGLU tile 0's gate values
// with tile 1's up values), row g (two passes: its two C rows are the row's passes, added as mmvq adds them) or rows
// g and g + 8 (one pass).
template <int P>
__device__ __forceinline__ void mmqw_store(const float v[8], u32 g, u32 t, u32 rows, float* __restrict__ y, u32 y_ld,
                                           u32 n0, u32 n_out, u32 epi) {
    const bool swiglu = epi == EPI_SWIGLU;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
        if (swiglu && nt == 1) break;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const u32 col = n0 + (swiglu ? 0u : 8u * nt) + 2 * t + j;
            if (col >= n_out) continue;
#pragma unroll
            for (int half = 0; half < (P == 2 ? 1 : 2); ++half) {
                const u32 r = g + 8 * half;
                if (r >= rows) continue;
                const auto out = [&](int tile) {
                    return P == 2 ? __fadd_rn(v[tile * 4 + j], v[tile * 4 + 2 + j]) : v[tile * 4 + 2 * half + j];
                };
                float* dst = y + (u64)r * y_ld + col;
                if (swiglu) {
                    *dst = swiglu_value(out(0), out(1));
                } else {
                    const float val = out(nt);
                    *dst = epi == EPI_ADD ? __fadd_rn(*dst, val) : val;
                }
            }
        }
    }
}

// Quantizes the m activation rows of x (row stride x_ld; RMS-normalised first when norm_w is not null) once, for the
// launch that reads them pre-quantized: `out` holds xq [m P][ld] bytes, then xd and xs [m P][nb] f32, laid out as
// quantize_rows_smem lays a block's rows in shared memory, with the same bytes (both go through row_inv_rms,
// load_block_quarter and quantize_block_quarter). Grid: x over groups of 4 W of a row's blocks (W warps
// a block, 4 blocks a warp, 8 lanes a block), y over rows.
template <int P>
__device__ __forceinline__ void quantize_rows_global(const float* __restrict__ x, u32 x_ld, u32 m, u32 k,
                                                     const float* __restrict__ norm_w, float eps,
                                                     signed char* __restrict__ out, u32 ld) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 r = blockIdx.y, nb = k >> 5;
    const float* row = x + (u64)r * x_ld;
    const float inv = norm_w != nullptr ? row_inv_rms(row, k, eps) : 0.0f;
    const u32 b = (blockIdx.x * warps + warp) * 4 + (lane >> 3), e = lane & 7u;
    const bool live = b < nb;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (live) load_block_quarter(row, b, e, norm_w, inv, v);
    float* xd = reinterpret_cast<float*>(out + (u64)m * P * ld);
    float* xs = xd + (u64)m * P * nb;
    quantize_block_quarter<P>(v, live, r * P, live ? b : 0u, k, ld, out, xd, xs);
}

extern "C" __global__ void __launch_bounds__(128)
    quantize_act_rows(const float* __restrict__ x, u32 x_ld, u32 m, u32 k, const float* __restrict__ norm_w,
                      float eps, signed char* __restrict__ out, u32 ld) {
    DF_GRID_DEPENDENCY();
    quantize_rows_global<1>(x, x_ld, m, k, norm_w, eps, out, ld);
}

extern "C" __global__ void __launch_bounds__(128)
    quantize_act_rows_x2(const float* __restrict__ x, u32 x_ld, u32 m, u32 k, const float* __restrict__ norm_w,
                         float eps, signed char* __restrict__ out, u32 ld) {
    DF_GRID_DEPENDENCY();
    quantize_rows_global<2>(x, x_ld, m, k, norm_w, eps, out, ld);
}

// Copies the block's quantized rows (rows `rows` from row0, P each) from quantize_rows_global's `pre` into shared
// memory, 4 bytes a copy by cp.async, all in flight at once (the caller waits).
template <int P>
__device__ __forceinline__ void mmqw_copy_rows(const signed char* __restrict__ pre, u32 m, u32 k, u32 row0, u32 rows,
                                               u32 ld, signed char* xq, float* xd, float* xs) {
    const u32 nb = k >> 5, q0 = row0 * P, qn = rows * P;
    const signed char* gq = pre + (u64)q0 * ld;
    for (u32 i = threadIdx.x; i < qn * ld / 4; i += blockDim.x) mmqw_cp_async4(xq + 4 * i, gq + 4 * i);
    const float* gd = reinterpret_cast<const float*>(pre + (u64)m * P * ld) + (u64)q0 * nb;
    const float* gs = gd + (u64)m * P * nb;
    for (u32 i = threadIdx.x; i < qn * nb; i += blockDim.x) {
        mmqw_cp_async4(xd + i, gd + i);
        mmqw_cp_async4(xs + i, gs + i);
    }
}

// The sum of a slab's tree for the thread's outputs: all 32 leaves (S = 1), or (S = 2) the 16 of part `part`, the
// other part's added by the warp beside it: mmqw_tree<FMT, 5 - log2 S, part * 32 / S>.
template <int FMT, int S>
__device__ __forceinline__ void mmqw_part(const MmqwWarp& w, u32 part, float v[8]) {
    static_assert(S == 1 || S == 2, "a slab's tree splits over one warp or two");
    if constexpr (S == 1) {
        mmqw_tree<FMT, 5, 0>(w, v);
    } else if (part == 0) {
        mmqw_tree<FMT, 4, 0>(w, v);
    } else {
        mmqw_tree<FMT, 4, 16>(w, v);
    }
}

// Waits for the S warps of group `group` (named barrier group + 1; 0 is __syncthreads').
template <int S>
__device__ __forceinline__ void mmqw_group_sync(u32 group) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(group + 1u), "r"(32u * S) : "memory");
}

// Adds a split tree's halves as the butterfly's top level, into part 0's v: part 1 leaves its half in its own slab
// memory `spill` (free once its leaves are done), [8][32] floats so the lanes hit 32 banks; part 0 reads it
// `slab_floats` past its own `spill` (the warps' slabs are consecutive).
__device__ __forceinline__ void mmqw_join(float v[8], u32 part, u32 group, float* spill, u32 slab_floats) {
    const u32 lane = threadIdx.x & 31u;
    if (part != 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) spill[i * 32 + lane] = v[i];
    }
    mmqw_group_sync<2>(group);
    if (part == 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = v[i] + spill[slab_floats + i * 32 + lane];
    }
}

// y = epilogue(quantize(prologue(x)) . W^T), as mmvq (same arguments, same bits), for rows
// [blockIdx.y * 16 / P, + 16 / P) of x. Each slab's tree runs on S consecutive warps of a block (S = 1: one warp
// adds all 32 leaves; 2: half each, for steps whose slabs and row chunks leave SMs idle). With PRE the rows come
// quantized (mmqw_copy_rows) instead of quantized here. Dynamic
// shared memory: 16 quantized rows of mmq_row_bytes(k) bytes and their two f32 per block, then per warp a slab: 16
// rows of mmqw_wld(k) bytes of quants and 16 rows of mmqw_sld(nb) scales as stored, at least 1 KiB. The warp's first
// slab is copied while the block quantizes its rows.
template <int FMT, int P, int S, bool PRE>
__device__ __forceinline__ void mmq_warp(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                         const float* __restrict__ x, u32 x_ld, u32 m,
                                         const float* __restrict__ norm_w, float eps, float* __restrict__ y, u32 y_ld,
                                         u32 n_out, u32 k, u32 epi) {
    constexpr int BM = 16 / P;
    extern __shared__ int4 mmqw_smem[];
    const u32 nb = k >> 5, ld = mmq_row_bytes<P>(k), wld = mmqw_wld<FMT>(k), sld = mmqw_sld<FMT>(nb);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 part = warp % S, group = warp / S;
    signed char* xq = reinterpret_cast<signed char*>(mmqw_smem);
    float* xd = reinterpret_cast<float*>(xq + (u64)16 * ld);
    float* xs = xd + 16 * nb;
    // Each warp's region holds its slab, or (at least 1 KiB) the part it hands its group.
    const u32 slab_bytes = max(MMQW_SLAB_ROWS * (wld + sld * (u32)sizeof(MmqwScale<FMT>)), 1024u);
    unsigned char* wq = reinterpret_cast<unsigned char*>(xs + 16 * nb) + (u64)warp * slab_bytes;
    void* wsc = wq + MMQW_SLAB_ROWS * wld;
    const u32 row0 = blockIdx.y * BM;
    const u32 rows = min((u32)BM, m - row0);
    const bool swiglu = epi == EPI_SWIGLU;
    const u32 slab_cols = swiglu ? 8u : 16u, groups = warps / S;
    const u32 first = (blockIdx.x * groups + group) * slab_cols;
    // Slab row s: column n0 + s, or for SwiGLU gate column n0 + s (s < 8) and its up row; columns past n_out read
    // weight row 0 and their outputs are never written.
    const auto row_of_slab = [&](u32 n0) {
        return [=](u32 s) -> u32 {
            const u32 col = n0 + (swiglu ? (s & 7u) : s);
            if (col >= n_out) return 0;
            return swiglu && s >= 8 ? col + n_out : col;
        };
    };
    bool scales_left = first < n_out && mmqw_start_slab<FMT>(qs, sc, k, nb, wld, sld, row_of_slab(first), wq, wsc);
    if constexpr (PRE) {
        mmqw_copy_rows<P>(reinterpret_cast<const signed char*>(x), m, k, row0, rows, ld, xq, xd, xs);
        mmqw_cp_async_wait_all();  // the rows, and the first slab
        __syncthreads();
    } else {
        quantize_rows_smem<BM, P>(x + (u64)row0 * x_ld, x_ld, rows, k, norm_w, eps, xq, xd, xs, ld);
    }

    const u32 g = lane >> 2, t = lane & 3u;
    const MmqwWarp w{reinterpret_cast<const u32*>(wq), wsc, xq, xd, xs, nb, ld, wld / 4, sld, g, t,
                     P == 2 ? 2 * g : g, P == 2 ? 2 * g + 1 : g + 8};
    for (u32 n0 = first; n0 < n_out; n0 += gridDim.x * groups * slab_cols) {
        const auto row_of = row_of_slab(n0);
        if (n0 != first) {
            __syncwarp();  // the previous slab's leaves are done with the warp's shared memory
            scales_left = mmqw_start_slab<FMT>(qs, sc, k, nb, wld, sld, row_of, wq, wsc);
        }
        if (scales_left) mmqw_load_scales<FMT>(sc, nb, sld, row_of, wsc);
        mmqw_cp_async_wait_all();
        __syncwarp();
        float v[8];
        mmqw_part<FMT, S>(w, part, v);
        if constexpr (S > 1) {
            __syncwarp();  // every lane's leaves are done with the slab before its memory holds the part
            mmqw_join(v, part, group, reinterpret_cast<float*>(wq), slab_bytes / 4u);
        }
        if (part == 0) mmqw_store<P>(v, g, t, rows, y + (u64)row0 * y_ld, y_ld, n0, n_out, epi);
        if constexpr (S > 1) mmqw_group_sync<S>(group);  // part 0 has read the parts before they copy a next slab
    }
}

// The kernels: mmq_warp_{fmt}[_x2], each block quantizing its rows; mmq_warp_pq_{fmt}[_s2][_x2], the rows read
// pre-quantized (x: quantize_rows_global's output, x_ld and norm_w unused), a slab's tree on one warp or two (four
// were slower at every size measured, entry 90).
#define DF_MMQW_WRAPPER(NAME, S, PRE)                                                                          \
    template <int FMT, int P>                                                                                  \
    __device__ __forceinline__ void NAME(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc, \
                                         const float* __restrict__ x, u32 x_ld, u32 m,                         \
                                         const float* __restrict__ norm_w, float eps, float* __restrict__ y,   \
                                         u32 y_ld, u32 n_out, u32 k, u32 epi) {                                \
        mmq_warp<FMT, P, S, PRE>(qs, sc, x, x_ld, m, norm_w, eps, y, y_ld, n_out, k, epi);                     \
    }
DF_MMQW_WRAPPER(mmq_warp_fused, 1, false)
DF_MMQW_WRAPPER(mmq_warp_pre_s1, 1, true)
DF_MMQW_WRAPPER(mmq_warp_pre_s2, 2, true)

DF_QUANT_MATMUL_PASSES(mmq_warp_q4_0, mmq_warp_fused, MMQW_WARPS * 32, QF_Q4_0)
DF_QUANT_MATMUL_PASSES(mmq_warp_q4_1, mmq_warp_fused, MMQW_WARPS * 32, QF_Q4_1)
DF_QUANT_MATMUL_PASSES(mmq_warp_q8_0, mmq_warp_fused, MMQW_WARPS * 32, QF_Q8_0)
DF_QUANT_MATMUL_PASSES(mmq_warp_pq_q4_0, mmq_warp_pre_s1, MMQW_WARPS * 32, QF_Q4_0)
DF_QUANT_MATMUL_PASSES(mmq_warp_pq_q4_1, mmq_warp_pre_s1, MMQW_WARPS * 32, QF_Q4_1)
DF_QUANT_MATMUL_PASSES(mmq_warp_pq_q8_0, mmq_warp_pre_s1, MMQW_WARPS * 32, QF_Q8_0)
DF_QUANT_MATMUL_PASSES(mmq_warp_pq_q4_0_s2, mmq_warp_pre_s2, MMQW_WARPS * 32, QF_Q4_0)
DF_QUANT_MATMUL_PASSES(mmq_warp_pq_q4_1_s2, mmq_warp_pre_s2, MMQW_WARPS * 32, QF_Q4_1)
DF_QUANT_MATMUL_PASSES(mmq_warp_pq_q8_0_s2, mmq_warp_pre_s2, MMQW_WARPS * 32, QF_Q8_0)
