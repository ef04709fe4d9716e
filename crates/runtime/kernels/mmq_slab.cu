// Quantized matmul of a few to a hundred rows on the int8 tensor cores, a block per slab of weights: mmvq's outputs
// (quant.cu), bit for bit, as mmq (mmq.cu) and mmq_warp (mmq_warp.cu) give them.
//
// mmq_warp gives each warp a slab of 16 weight rows and all 32 leaves of its tree, so a layer matrix of 576
// columns is 36 warps: nine blocks on a GPU of 132 SMs, each warp walking its whole row alone (PERFORMANCE.md
// entry 78). mmq splits the leaves over 8 warps, but each leaf waits on L2 for every weight block in turn. Here a
// block of MMQS_WARPS warps takes one slab at a time: its threads copy the slab into shared memory by cp.async, all
// loads in flight at once (overlapping the rows' quantization for the first slab, the previous slab's epilogue for
// the next), then warp w adds leaves 4 w .. 4 w + 3 from shared memory (mmqw_tree, a subtree of the butterfly) and
// the block adds the eight subtrees as the tree's top three levels do, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)):
// mmvq's operands for every addition, so its bits. Eight times mmq_warp's warps per slab, each with an eighth of
// the chain.
//
// Grid: x over slabs (block x takes slabs x, x + gridDim.x, ...), y over chunks of 16 / P activation rows. Dynamic
// shared memory: the rows' quantized activations, then one slab, as mmq_warp with one warp (src/cuda/ops/quant.rs,
// mmq_slab_smem_bytes).

#define MMQS_WARPS 8

// Stores a slab's outputs from the eight subtrees (`subtrees[warp][tile * 4 + e][lane]`, the fragment layout of
// mmqw_store's v): warp (half, nt, j) writes column 2 t + j of n8 tile nt (for SwiGLU the nt = 0 warps, with the up
// value from tile 1), row g + 8 half (one pass; two passes: row g, whose two C rows are its passes, and half 1 idle).
template <int P>
__device__ __forceinline__ void mmqs_store(const float (*subtrees)[8][32], u32 warp, u32 lane, u32 rows,
                                           float* __restrict__ y, u32 y_ld, u32 n0, u32 n_out, u32 epi) {
    const u32 half = warp >> 2, nt = (warp >> 1) & 1u, j = warp & 1u, g = lane >> 2, t = lane & 3u;
    const bool swiglu = epi == EPI_SWIGLU;
    if ((swiglu && nt == 1) || (P == 2 && half == 1)) return;
    const u32 col = n0 + (swiglu ? 0 : 8 * nt) + 2 * t + j, r = g + 8 * half;
    if (col >= n_out || r >= rows) return;
    const auto value = [&](u32 tile, u32 e) {
        float p[MMQS_WARPS];
#pragma unroll
        for (int w = 0; w < MMQS_WARPS; ++w) p[w] = subtrees[w][tile * 4 + e][lane];
        return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    };
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

// Warp `warp`'s subtree of the slab: leaves 4 warp .. 4 warp + 3. Templates keep every index a constant.
template <int FMT>
__device__ __forceinline__ void mmqs_subtree(const MmqwWarp& w, u32 warp, float v[8]) {
    switch (warp) {
        case 0: mmqw_tree<FMT, 2, 0>(w, v); break;
        case 1: mmqw_tree<FMT, 2, 4>(w, v); break;
        case 2: mmqw_tree<FMT, 2, 8>(w, v); break;
        case 3: mmqw_tree<FMT, 2, 12>(w, v); break;
        case 4: mmqw_tree<FMT, 2, 16>(w, v); break;
        case 5: mmqw_tree<FMT, 2, 20>(w, v); break;
        case 6: mmqw_tree<FMT, 2, 24>(w, v); break;
        default: mmqw_tree<FMT, 2, 28>(w, v); break;
    }
}

// y = epilogue(quantize(prologue(x)) . W^T), as mmvq (same arguments, same bits), for rows
// [blockIdx.y * 16 / P, + 16 / P) of x and the slabs blockIdx.x, + gridDim.x, ...
template <int FMT, int P>
__device__ __forceinline__ void mmq_slab(const unsigned char* __restrict__ qs, const unsigned short* __restrict__ sc,
                                         const float* __restrict__ x, u32 x_ld, u32 m,
                                         const float* __restrict__ norm_w, float eps, float* __restrict__ y, u32 y_ld,
                                         u32 n_out, u32 k, u32 epi) {
    constexpr int BM = 16 / P;
    extern __shared__ int4 mmqs_smem[];
    __shared__ float subtrees[MMQS_WARPS][8][32];
    const u32 nb = k >> 5, ld = mmq_row_bytes<P>(k), wld = mmqw_wld<FMT>(k), sld = mmqw_sld<FMT>(nb);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    signed char* xq = reinterpret_cast<signed char*>(mmqs_smem);
    float* xd = reinterpret_cast<float*>(xq + (u64)16 * ld);
    float* xs = xd + 16 * nb;
    unsigned char* wq = reinterpret_cast<unsigned char*>(xs + 16 * nb);
    void* wsc = wq + MMQW_SLAB_ROWS * wld;
    const u32 row0 = blockIdx.y * BM;
    const u32 rows = min((u32)BM, m - row0);
    const bool swiglu = epi == EPI_SWIGLU;
    const u32 slab_cols = swiglu ? 8u : 16u, stride = gridDim.x * slab_cols;
    // Slab row s: column n0 + s, or for SwiGLU gate column n0 + s (s < 8) and its up row; columns past n_out read
    // weight row 0 and their outputs are never written.
    const auto row_of_slab = [&](u32 n0) {
        return [=](u32 s) -> u32 {
            const u32 col = n0 + (swiglu ? (s & 7u) : s);
            if (col >= n_out) return 0;
            return swiglu && s >= 8 ? col + n_out : col;
        };
    };
    const auto start = [&](u32 n0) {
        return mmqw_start_slab<FMT>(qs, sc, k, nb, wld, sld, row_of_slab(n0), wq, wsc, threadIdx.x, blockDim.x);
    };
    u32 n0 = blockIdx.x * slab_cols;
    bool scales_left = n0 < n_out && start(n0);
    quantize_rows_smem<BM, P>(x + (u64)row0 * x_ld, x_ld, rows, k, norm_w, eps, xq, xd, xs, ld);

    const u32 g = lane >> 2, t = lane & 3u;
    const MmqwWarp w{reinterpret_cast<const u32*>(wq), wsc, xq, xd, xs, nb, ld, wld / 4, sld, g, t,
                     P == 2 ? 2 * g : g, P == 2 ? 2 * g + 1 : g + 8};
    for (; n0 < n_out; n0 += stride) {
        if (scales_left) mmqw_load_scales<FMT>(sc, nb, sld, row_of_slab(n0), wsc, threadIdx.x, blockDim.x);
        mmqw_cp_async_wait_all();
        __syncthreads();  // the slab (and the first time the quantized rows) in shared memory
        float v[8];
        mmqs_subtree<FMT>(w, warp, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) subtrees[warp][i][lane] = v[i];
        __syncthreads();  // every warp done with the slab, every subtree written
        // The next slab's copy runs under this one's epilogue; the epilogue's reads of `subtrees` end before the
        // next iteration's first barrier, after which they are written again.
        scales_left = n0 + stride < n_out && start(n0 + stride);
        mmqs_store<P>(subtrees, warp, lane, rows, y + (u64)row0 * y_ld, y_ld, n0, n_out, epi);
    }
}

DF_QUANT_MATMUL_PASSES(mmq_slab_q4_0, mmq_slab, MMQS_WARPS * 32, QF_Q4_0)
DF_QUANT_MATMUL_PASSES(mmq_slab_q4_1, mmq_slab, MMQS_WARPS * 32, QF_Q4_1)
DF_QUANT_MATMUL_PASSES(mmq_slab_q8_0, mmq_slab, MMQS_WARPS * 32, QF_Q8_0)
