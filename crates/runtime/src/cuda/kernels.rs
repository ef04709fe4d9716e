//! Our CUDA C sources (crates/runtime/kernels/, embedded in the binary) and the loaded kernel handles.
//!
//! All sources are compiled as one NVRTC program: the prelude first, then each file. One program means
//! one compile (about a quarter of a second) and one cache entry.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum as CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::compile::{self, CompileReport};
use super::CudaError;

/// The kernel sources in the order they are compiled.
const SOURCES: [(&str, &str); 17] = [
    ("prelude.cuh", include_str!("../../kernels/prelude.cuh")),
    ("elementwise.cu", include_str!("../../kernels/elementwise.cu")),
    ("norm.cu", include_str!("../../kernels/norm.cu")),
    ("rope.cu", include_str!("../../kernels/rope.cu")),
    ("reduce.cu", include_str!("../../kernels/reduce.cu")),
    ("gemv.cu", include_str!("../../kernels/gemv.cu")),
    ("quant.cu", include_str!("../../kernels/quant.cu")),
    ("mmq.cu", include_str!("../../kernels/mmq.cu")),
    ("mmq_warp.cu", include_str!("../../kernels/mmq_warp.cu")),
    ("attention.cu", include_str!("../../kernels/attention.cu")),
    ("attention_tc.cu", include_str!("../../kernels/attention_tc.cu")),
    ("misc.cu", include_str!("../../kernels/misc.cu")),
    ("drafter.cu", include_str!("../../kernels/drafter.cu")),
    ("gdn.cu", include_str!("../../kernels/gdn.cu")),
    ("moe.cu", include_str!("../../kernels/moe.cu")),
    ("streams.cu", include_str!("../../kernels/streams.cu")),
    ("sample.cu", include_str!("../../kernels/sample.cu")),
];

/// NVRTC options beyond the architecture. NVRTC's defaults keep IEEE division and square root and allow
/// FMA contraction; the kernels that must round like the CPU spell their arithmetic with `__f*_rn`.
pub const COMPILE_OPTIONS: [&str; 1] = ["--std=c++17"];

/// The most input rows the GEMV kernels take (one kernel per row count, 1..=GEMV_MAX_ROWS).
pub const GEMV_MAX_ROWS: usize = 8;

/// Up to this many input rows `matmul_bf16` uses the GEMV, beyond it cuBLAS. Measured on the H200
/// (8192 x 8192, docs/CUDA.md): one row 36 us by the GEMV against 39 us by cuBLAS (with the bf16 cast of
/// x), but two rows already 61 us against 38 us, since each extra row re-reads x from L1 for every
/// weight load.
pub const GEMV_DISPATCH_MAX_ROWS: usize = 1;

/// Tiles of 8 activation rows the small bf16 matmul is compiled for (`gemm_bf16_small_t{T}` in gemv.cu); it
/// takes up to `8 * 4` rows.
pub const SMALL_GEMM_TILES: [usize; 3] = [1, 2, 4];

/// The most rows [`crate::cuda::ops::gemm_bf16_small`] takes.
pub const SMALL_GEMM_MAX_ROWS: usize = 32;

/// Output columns per block of the small bf16 matmul (one 16-row mma tile, its k split over 8 warps).
pub(crate) const SMALL_GEMM_COLS_PER_BLOCK: u32 = 16;

/// Weight rows per GEMV block (one warp each): `GEMV_WARPS` in gemv.cu.
pub(crate) const GEMV_ROWS_PER_BLOCK: u32 = 8;

/// Dynamic shared memory the kernels that take more than the default 48 KiB may use (the quantized
/// matmul's activation rows, the attention's query tile and key chunk). Hopper allows 227 KiB per block.
pub(crate) const MAX_DYNAMIC_SMEM: u32 = 160 * 1024;

/// Row chunks the batch-invariant f32 matmul is compiled for (`gemm_f32_rows_r{R}` in gemv.cu).
pub(crate) const F32_ROWS_CHUNKS: [usize; 2] = [1, 8];

/// Output columns per warp of each `gemm_f32_rows_r{R}` (the `C` of `DF_GEMM_F32_ROWS(R, C)` in gemv.cu).
pub(crate) const F32_ROWS_COLUMNS: [usize; 2] = [4, 2];

/// Activation-row counts the quantized matmul kernels are compiled for (`mmvq_*_r{R}` in quant.cu).
pub(crate) const MMVQ_ROWS: [usize; 4] = [1, 2, 4, 8];

/// Quantized rows (activation rows times passes) one block of the tensor-core quantized matmul holds (`mmq_*` in
/// mmq.cu: `MMQ_MT` m16 tiles).
pub(crate) const MMQ_QUANT_ROWS: usize = 32;

/// Weight rows one block of the tensor-core quantized matmul takes: 16 columns (8 for SwiGLU, whose blocks also take
/// the 8 matching up rows).
pub(crate) const MMQ_COLS_PER_BLOCK: usize = 16;

/// From this many activation rows the quantized matmul runs on the tensor cores (`mmq_*`, same bits as `mmvq_*`).
pub(crate) const MMQ_MIN_ROWS: usize = 128;

/// Most warps per block of the whole-tree tensor-core quantized matmul (`MMQW_WARPS` in mmq_warp.cu); blocks take
/// as many as shared memory allows, each warp holding a slab of 16 weight rows there. The block's warps share the
/// quantization of its rows, the kernel's longest chain: 4 warps a block spent 56% of their instructions there
/// (PERFORMANCE.md entry 89).
pub(crate) const MMQ_WARP_WARPS: usize = 16;

/// The warps one slab's tree may split over in the whole-tree kernel reading pre-quantized rows
/// (`mmq_warp_pq_*_s{S}` in mmq_warp.cu; 1: the whole tree on one warp; `DFLASH_MMQ_WARP_SPLIT` picks one).
pub(crate) const MMQ_WARP_SPLITS: [usize; 2] = [1, 2];

/// A whole-tree launch on pre-quantized rows splits each slab's tree over two warps while that keeps it within
/// this many warps an SM: a launch that leaves SMs idle runs its trees' halves side by side (PERFORMANCE.md
/// entry 90).
pub(crate) const MMQ_WARP_SPLIT_MAX_WARPS_PER_SM: usize = 8;

/// Below `MMQ_WARP_MIN_ROWS`, from `MMQ_WARP_WIDE_MIN_ROWS` rows, a quantized matmul whose whole-tree launch would
/// hold at least this many warps an SM (the LM head's 3,072 slabs of 16 columns) takes it: it reads the weights
/// once, where `mmvq` reads them again for every block row (PERFORMANCE.md entry 91).
pub(crate) const MMQ_WARP_WIDE_WARPS_PER_SM: usize = 16;

/// The fewest rows a wide launch takes the whole-tree kernel at: at 2 rows `mmvq` was 1% faster, from 3 it loses
/// (entry 91).
pub(crate) const MMQ_WARP_WIDE_MIN_ROWS: usize = 3;

/// From this many activation rows the quantized matmul runs as `mmq_warp_*` where its shared memory fits (unless
/// `DFLASH_MMQ_WARP=0`): on an H100 it passes mmvq between 32 and 40 rows, and is 1.2-1.6x faster than mmvq from
/// 40 to 127 rows and 1.4-1.6x faster than `mmq_*` from 128 rows on (PERFORMANCE.md entry 79).
pub(crate) const MMQ_WARP_MIN_ROWS: usize = 40;

/// Up to this row length the one-row quantized matmul gives each column half a warp (`mmvq_*_r1h*`): a row of at
/// most 32 blocks would leave lanes of a whole warp idle.
pub(crate) const MMVQ_HALF_MAX_K: usize = 1024;

/// From this many activation rows (one per block) the half-warp kernels are used.
pub(crate) const MMVQ_HALF_MIN_ROWS: usize = 3;

/// The two-pass kernels (`mmvq_*_r{R}_x2`) stop at 4 activation rows: at 8 (16 quantized rows) their
/// accumulators spilled, and 4-row blocks ran a 16-row verify 21% faster (PERFORMANCE.md entry 35).
pub(crate) const MMVQ_X2_MAX_ROWS: usize = 4;

/// The most hyper-connection streams the stream kernels take (`STREAMS_MAX` in streams.cu: their mix weights
/// live in shared memory).
pub const STREAMS_MAX: usize = 8;

/// The whole program: every source, each preceded by a `#line` so compiler errors name the file.
pub fn program_source() -> String {
    let mut source = String::new();
    for (name, text) in SOURCES {
        source.push_str(&format!("#line 1 \"{name}\"\n"));
        source.push_str(text);
        source.push('\n');
    }
    source
}

/// Handles to every kernel of the program.
#[derive(Debug)]
pub(crate) struct Kernels {
    pub embedding_f32: CudaFunction,
    pub embedding_bf16: CudaFunction,
    pub swiglu_fused: CudaFunction,
    pub swiglu_fused_bf16: CudaFunction,
    pub f32_to_bf16: CudaFunction,
    pub rms_norm: CudaFunction,
    pub rms_norm_bf16: CudaFunction,
    pub add_rms_norm: CudaFunction,
    pub rope: CudaFunction,
    pub argmax_partial: CudaFunction,
    pub argmax_finish: CudaFunction,
    pub argmax_masked: CudaFunction,
    /// `gemv[r - 1]` takes `r` input rows.
    pub gemv: Vec<CudaFunction>,
    pub gemv_bf16_ep: CudaFunction,
    /// `gemm_f32_rows_r{R}` for the row chunks of [`F32_ROWS_CHUNKS`].
    pub gemm_f32_rows: Vec<CudaFunction>,
    /// `gemm_bf16_small_t{T}` for the tile counts of [`SMALL_GEMM_TILES`]; `[1]`: `gemm_bf16_small_stream_t{T}`,
    /// the weight loads hinted for a stream from DRAM.
    pub gemm_bf16_small: [Vec<CudaFunction>; 2],
    /// `gemm_bf16_small_norm_t{T}` / `gemm_bf16_small_norm_stream_t{T}`: the same with the pre-norm folded in.
    pub gemm_bf16_small_norm: [Vec<CudaFunction>; 2],
    /// `[norm][tile]`: `gemm_bf16_small{,_norm}_stream3_t{1,2}`, the one- and two-tile `_stream` kernels at three
    /// blocks per SM, for matrices of two to three waves at two per SM.
    pub gemm_bf16_small_stream3: [[CudaFunction; 2]; 2],
    /// `mmvq[format][passes - 1][i]`: format 0 = Q4_0, 1 = Q4_1, 2 = Q8_0; one or two activation passes
    /// (`ActPrecision`); `MMVQ_ROWS[i]` activation rows per block (two passes: up to `MMVQ_X2_MAX_ROWS`).
    pub mmvq: Vec<[Vec<CudaFunction>; 2]>,
    /// `mmvq_half[format][passes - 1]`: `mmvq_{fmt}_r1h{,_x2}`, one activation row with half a warp per column
    /// (for `k <= MMVQ_HALF_MAX_K`).
    pub mmvq_half: Vec<[CudaFunction; 2]>,
    /// `mmq[format][passes - 1]`: `mmq_{fmt}` and `mmq_{fmt}_x2`, the tensor-core matmul of many rows.
    pub mmq: Vec<[CudaFunction; 2]>,
    /// `mmq_warp[format][passes - 1]`: `mmq_warp_{fmt}{,_x2}`, the tensor-core matmul with a whole tree per warp,
    /// each block quantizing its rows.
    pub mmq_warp: Vec<[CudaFunction; 2]>,
    /// `mmq_warp_pre[format][passes - 1][i]`: `mmq_warp_pq_{fmt}{,_s2}{,_x2}`, the same reading rows
    /// `quantize_act_rows` quantized once, each slab's tree on `MMQ_WARP_SPLITS[i]` warps.
    pub mmq_warp_pre: Vec<[Vec<CudaFunction>; 2]>,
    /// `quantize_act_rows{,_x2}`: activation rows quantized once (one or two passes) for `mmq_warp_pre`.
    pub quantize_act_rows: [CudaFunction; 2],
    pub embedding_quant: CudaFunction,
    pub rope_kv_write: CudaFunction,
    pub paged_attention: CudaFunction,
    /// `paged_attention` for 128 < head_dim <= 256.
    pub paged_attention_d256: CudaFunction,
    /// `paged_attention` (head_dim <= 128, 256) with RoPE + KV write folded in.
    pub paged_attention_rope: CudaFunction,
    pub paged_attention_rope_d256: CudaFunction,
    /// `paged_attention_rope` compiled for head_dim == 128 and == 64.
    pub paged_attention_rope_hd128: CudaFunction,
    pub paged_attention_rope_hd64: CudaFunction,
    pub attn_merge_splits: CudaFunction,
    /// Prompt attention on the tensor cores, head_dim 64 and 128, and the bf16 copy of the keys it reads.
    pub kv_to_bf16: CudaFunction,
    pub prompt_attention_tc_d64: CudaFunction,
    pub prompt_attention_tc_d128: CudaFunction,
    pub gather_rms_norm: CudaFunction,
    pub copy_columns: CudaFunction,
    pub scatter_rows: CudaFunction,
    pub streams_project: CudaFunction,
    pub streams_collapse: CudaFunction,
    pub streams_head: CudaFunction,
    pub streams_expand: CudaFunction,
    pub streams_broadcast: CudaFunction,
    pub streams_mean: CudaFunction,
    pub fill_random_bf16: CudaFunction,
    pub fill_random_f32: CudaFunction,
    pub fill_random_u32: CudaFunction,
    pub fill_random_f16: CudaFunction,
    pub moe_route: CudaFunction,
    /// `moe_gate_up[i]`: i = 2 · (f32 weights) + (one row per weight load); `moe_down[i]`,
    /// `moe_down_combine[i]`: i = (f32 weights).
    pub moe_gate_up: [CudaFunction; 4],
    pub moe_down: [CudaFunction; 2],
    pub moe_down_combine: [CudaFunction; 2],
    pub moe_combine: CudaFunction,
    pub gdn_conv: CudaFunction,
    pub gdn_prep: CudaFunction,
    pub gdn_rule: CudaFunction,
    pub gdn_gated_norm: CudaFunction,
    pub sigmoid_gate_mul: CudaFunction,
    pub dflash_conv: CudaFunction,
    pub dflash_conv_add_rms_norm: CudaFunction,
    pub draft_top_k_part: CudaFunction,
    pub draft_top_k_merge: CudaFunction,
    /// The summary's two launches by selection (the default; `DFLASH_DRAFT_TOPK=sort` keeps the sorting ones; entries 118, 120).
    pub draft_top_k_part_select: CudaFunction,
    pub draft_top_k_merge_select: CudaFunction,
    pub dflash2_walk: CudaFunction,
    /// The walk with each slot's operands staged in shared memory (the default where it fits; `DFLASH_DRAFT_WALK=plain` keeps the other; entries 118, 120).
    pub dflash2_walk_staged: CudaFunction,
    pub sample_rows: CudaFunction,
}

impl Kernels {
    /// Compiles (or reads from the cache) and loads the program for `ctx`'s device.
    ///
    /// # Errors
    /// NVRTC or driver failures; a cached cubin the driver rejects is evicted and compiled afresh first.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<(Self, CompileReport), CudaError> {
        let capability = ctx.compute_capability().map_err(CudaError::driver("cuDeviceGetAttribute"))?;
        let source = program_source();
        let compiled = compile::compile_cached(&source, capability, &COMPILE_OPTIONS)?;
        let (module, report) = match ctx.load_module(Ptx::from_binary(compiled.cubin)) {
            Ok(module) => (module, compiled.report),
            Err(e) if compiled.report.cache_hit => {
                // A damaged or foreign cache file: drop it and compile once more.
                compile::evict(&compiled.report);
                let fresh = compile::compile_cached(&source, capability, &COMPILE_OPTIONS)?;
                let module = ctx.load_module(Ptx::from_binary(fresh.cubin)).map_err(|e2| CudaError::Driver {
                    what: format!("cuModuleLoadData (cached: {e}; fresh)"),
                    source: e2,
                })?;
                (module, fresh.report)
            }
            Err(e) => return Err(CudaError::Driver { what: "cuModuleLoadData".into(), source: e }),
        };
        Ok((Self::from_module(&module)?, report))
    }

    fn from_module(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let get = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| CudaError::Driver { what: format!("cuModuleGetFunction {name}"), source: e })
        };
        let gemv = (1..=GEMV_MAX_ROWS).map(|r| get(&format!("gemv_bf16_r{r}"))).collect::<Result<Vec<_>, _>>()?;
        let big_smem = |name: &str| -> Result<CudaFunction, CudaError> {
            let f = get(name)?;
            let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(attr, MAX_DYNAMIC_SMEM as i32)
                .map_err(|e| CudaError::Driver { what: format!("cuFuncSetAttribute {name}"), source: e })?;
            Ok(f)
        };
        let small_gemm = |name: &str, variant: &str| -> Result<Vec<CudaFunction>, CudaError> {
            SMALL_GEMM_TILES.iter().map(|t| get(&format!("{name}{variant}_t{t}"))).collect()
        };
        let mmvq_rows = |fmt: &str, suffix: &str, max: usize| -> Result<Vec<CudaFunction>, CudaError> {
            MMVQ_ROWS.iter().filter(|&&r| r <= max).map(|r| big_smem(&format!("mmvq_{fmt}_r{r}{suffix}"))).collect()
        };
        let mmvq = ["q4_0", "q4_1", "q8_0"]
            .iter()
            .map(|fmt| Ok([mmvq_rows(fmt, "", usize::MAX)?, mmvq_rows(fmt, "_x2", MMVQ_X2_MAX_ROWS)?]))
            .collect::<Result<Vec<_>, CudaError>>()?;
        let mmvq_half = ["q4_0", "q4_1", "q8_0"]
            .iter()
            .map(|fmt| Ok([big_smem(&format!("mmvq_{fmt}_r1h"))?, big_smem(&format!("mmvq_{fmt}_r1h_x2"))?]))
            .collect::<Result<Vec<_>, CudaError>>()?;
        let mmq = ["q4_0", "q4_1", "q8_0"]
            .iter()
            .map(|fmt| Ok([big_smem(&format!("mmq_{fmt}"))?, big_smem(&format!("mmq_{fmt}_x2"))?]))
            .collect::<Result<Vec<_>, CudaError>>()?;
        let mmq_warp = ["q4_0", "q4_1", "q8_0"]
            .iter()
            .map(|fmt| Ok([big_smem(&format!("mmq_warp_{fmt}"))?, big_smem(&format!("mmq_warp_{fmt}_x2"))?]))
            .collect::<Result<Vec<_>, CudaError>>()?;
        let mmq_warp_splits = |fmt: &str, passes: &str| -> Result<Vec<CudaFunction>, CudaError> {
            let split = |s: usize| if s == 1 { String::new() } else { format!("_s{s}") };
            MMQ_WARP_SPLITS.iter().map(|&s| big_smem(&format!("mmq_warp_pq_{fmt}{}{passes}", split(s)))).collect()
        };
        let mmq_warp_pre = ["q4_0", "q4_1", "q8_0"]
            .iter()
            .map(|fmt| Ok([mmq_warp_splits(fmt, "")?, mmq_warp_splits(fmt, "_x2")?]))
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(Kernels {
            embedding_f32: get("embedding_f32")?,
            embedding_bf16: get("embedding_bf16")?,
            swiglu_fused: get("swiglu_fused")?,
            swiglu_fused_bf16: get("swiglu_fused_bf16")?,
            f32_to_bf16: get("f32_to_bf16")?,
            rms_norm: get("rms_norm")?,
            rms_norm_bf16: get("rms_norm_bf16")?,
            add_rms_norm: get("add_rms_norm")?,
            rope: get("rope")?,
            argmax_partial: get("argmax_partial")?,
            argmax_finish: get("argmax_finish")?,
            argmax_masked: get("argmax_masked")?,
            gemv,
            gemv_bf16_ep: big_smem("gemv_bf16_ep")?,
            gemm_f32_rows: F32_ROWS_CHUNKS
                .iter()
                .map(|r| get(&format!("gemm_f32_rows_r{r}")))
                .collect::<Result<_, _>>()?,
            gemm_bf16_small: [small_gemm("gemm_bf16_small", "")?, small_gemm("gemm_bf16_small", "_stream")?],
            gemm_bf16_small_norm: [
                small_gemm("gemm_bf16_small_norm", "")?,
                small_gemm("gemm_bf16_small_norm", "_stream")?,
            ],
            gemm_bf16_small_stream3: [
                [get("gemm_bf16_small_stream3_t1")?, get("gemm_bf16_small_stream3_t2")?],
                [get("gemm_bf16_small_norm_stream3_t1")?, get("gemm_bf16_small_norm_stream3_t2")?],
            ],
            mmvq,
            mmvq_half,
            mmq,
            mmq_warp,
            mmq_warp_pre,
            quantize_act_rows: [get("quantize_act_rows")?, get("quantize_act_rows_x2")?],
            embedding_quant: get("embedding_quant")?,
            rope_kv_write: get("rope_kv_write")?,
            paged_attention: big_smem("paged_attention")?,
            paged_attention_d256: big_smem("paged_attention_d256")?,
            paged_attention_rope: big_smem("paged_attention_rope")?,
            paged_attention_rope_d256: big_smem("paged_attention_rope_d256")?,
            paged_attention_rope_hd128: big_smem("paged_attention_rope_hd128")?,
            paged_attention_rope_hd64: big_smem("paged_attention_rope_hd64")?,
            attn_merge_splits: get("attn_merge_splits")?,
            kv_to_bf16: get("kv_to_bf16")?,
            prompt_attention_tc_d64: big_smem("prompt_attention_tc_d64")?,
            prompt_attention_tc_d128: big_smem("prompt_attention_tc_d128")?,
            gather_rms_norm: get("gather_rms_norm")?,
            copy_columns: get("copy_columns")?,
            scatter_rows: get("scatter_rows")?,
            streams_project: get("streams_project")?,
            streams_collapse: get("streams_collapse")?,
            streams_head: get("streams_head")?,
            streams_expand: get("streams_expand")?,
            streams_broadcast: get("streams_broadcast")?,
            streams_mean: get("streams_mean")?,
            fill_random_bf16: get("fill_random_bf16")?,
            fill_random_f32: get("fill_random_f32")?,
            fill_random_u32: get("fill_random_u32")?,
            fill_random_f16: get("fill_random_f16")?,
            moe_route: get("moe_route")?,
            moe_gate_up: [
                get("moe_gate_up_bf16")?,
                get("moe_gate_up_bf16_r1")?,
                get("moe_gate_up_f32")?,
                get("moe_gate_up_f32_r1")?,
            ],
            moe_down: [get("moe_down_bf16")?, get("moe_down_f32")?],
            moe_down_combine: [get("moe_down_combine_bf16")?, get("moe_down_combine_f32")?],
            moe_combine: get("moe_combine")?,
            gdn_conv: get("gdn_conv")?,
            gdn_prep: get("gdn_prep")?,
            gdn_rule: get("gdn_rule")?,
            gdn_gated_norm: get("gdn_gated_norm")?,
            sigmoid_gate_mul: get("sigmoid_gate_mul")?,
            dflash_conv: get("dflash_conv")?,
            dflash_conv_add_rms_norm: get("dflash_conv_add_rms_norm")?,
            draft_top_k_part: get("draft_top_k_part")?,
            draft_top_k_merge: get("draft_top_k_merge")?,
            draft_top_k_part_select: get("draft_top_k_part_select")?,
            draft_top_k_merge_select: get("draft_top_k_merge_select")?,
            dflash2_walk: get("dflash2_walk")?,
            dflash2_walk_staged: get("dflash2_walk_staged")?,
            sample_rows: get("sample_rows")?,
        })
    }
}
