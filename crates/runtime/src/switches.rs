//! Performance switches: environment variables that turn one optimisation off, or ask for a lower SIMD level, for
//! side-by-side measurements of the same binary. Read once per process, here and nowhere else; docs/PERFORMANCE.md
//! lists them with the entries that measured what each one turns off.

use std::sync::OnceLock;

/// Every switch, as the environment set it when the process first asked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Switches {
    /// `DFLASH_SIMD=scalar|avx2|avx512`: the CPU's quantized kernels at a lower level than the best it supports.
    pub simd: Option<String>,
    /// `DFLASH_PDL=0`: CUDA kernels launched without programmatic dependent launch.
    pub no_pdl: bool,
    /// `DFLASH_GEMM_3=0`: matrices of two to three waves stay on the two-per-SM small bf16 matmul.
    pub no_gemm_three_per_sm: bool,
    /// `DFLASH_GEMM_PREFETCH=first`: the small bf16 matmul prefetches only its first 1,024 weight columns.
    pub gemm_prefetch_first_only: bool,
    /// `DFLASH_FOLD_NORM=0`: the pre-norms keep their own kernel instead of running inside the small bf16 matmul.
    pub no_fold_norm: bool,
    /// `DFLASH_FOLD_ROPE=0`: decode and verify steps keep the separate RoPE + K/V write kernel.
    pub no_fold_rope: bool,
    /// `DFLASH_MMQ=0`: quantized matmuls of many rows that the whole-tree kernel does not take (`DFLASH_MMQ_WARP=0`,
    /// or rows too long for its shared memory) stay on the dp4a kernel instead of `mmq`.
    pub no_mmq: bool,
    /// `DFLASH_MMVQ_HALF=0`: one-row quantized matmuls of short rows keep a whole warp per column.
    pub no_mmvq_half: bool,
    /// `DFLASH_TILE_QUERIES=N`: a decode or verify attention tile holds at most N query vectors (rows times the
    /// query heads of a KV head), at least one row, instead of the default (8 on models of up to 16 query heads,
    /// else 16; entry 113).
    pub decode_tile_queries: Option<usize>,
    /// `DFLASH_MMQ_WARP=0`: quantized matmuls of 40 rows and more run as before the whole-tree kernel
    /// (`mmq_warp`) took them: `mmq` from 128 rows, the dp4a kernel below.
    pub no_mmq_warp: bool,
    /// `DFLASH_MMQ_WARP_WARPS=N`: at most N warps a block of the whole-tree kernel (4 before entry 89).
    pub mmq_warp_warps: Option<usize>,
    /// `DFLASH_MMQ_WARP_MIN_ROWS=N`: the whole-tree kernel from N rows instead of `MMQ_WARP_MIN_ROWS`.
    pub mmq_warp_min_rows: Option<usize>,
    /// `DFLASH_MMQ_WARP_SPLIT=1|2`: whole-tree launches on pre-quantized rows split each slab's tree over this many
    /// warps (by default two where the launch leaves SMs idle, entry 90).
    pub mmq_warp_split: Option<usize>,
    /// `DFLASH_MMQ_WARP_WIDE=0`: quantized matmuls below 40 rows stay on `mmvq` however many columns they have,
    /// as before entry 91.
    pub no_mmq_warp_wide: bool,
    /// `DFLASH_MMQ_WARP_PRE=0`: every whole-tree block quantizes its rows itself, as before entry 90, instead of
    /// one launch quantizing them for all.
    pub no_mmq_warp_pre: bool,
    /// `DFLASH_GRAPH_KEYS=0`: a graph step's attention is launched for the cache's longest sequence, as before
    /// graphs were keyed by the step's keys (entry 94).
    pub no_graph_keys: bool,
    /// `DFLASH_GRAPH_BUCKETS=pow2`: a graph step pads its sequences to a power of two, as before finer buckets
    /// (entry 98).
    pub graph_pow2_buckets: bool,
    /// `DFLASH_MIXED_GRAPHS=0`: a step whose sequences have different row counts runs eagerly, as before such
    /// steps replayed padded graphs (entry 99).
    pub no_mixed_graphs: bool,
    /// `DFLASH_OVERLAP_STREAMS=0`: a device target's engine streams a step's tokens right after its commits
    /// instead of while the next step runs on the device (entry 96).
    pub no_overlap_streams: bool,
    /// `DFLASH_PADDED_PRICES=0`: the round policy prices a step by its rows, not by the rows of the graph the
    /// target pads it to (entry 121).
    pub no_padded_prices: bool,
    /// `DFLASH_STEP_GATE=0`: every step runs the drafter pass its lanes planned, whatever the step gate measured.
    pub no_step_gate: bool,
    /// `DFLASH_CAPTURE_PAGES=0`: a drafter on the target's device takes every step's captured rows as they come,
    /// and a cached prompt's rows from the host, as before it read them from the target's pages when it drafts
    /// (entry 101; the target still writes its pages).
    pub no_capture_pages: bool,
    /// `DFLASH_DRAFT_SUMMARY=0`: a drafter pass on a device copies every draft logit back, as before passes
    /// summarised each slot there.
    pub no_draft_summary: bool,
    /// `DFLASH_DRAFT_TOPK=sort`: the drafter's logit summary sorts each block's values to find its best k, as before
    /// warp-wide selection (entries 118, 120; the same outputs).
    pub draft_top_k_sort: bool,
    /// `DFLASH_DRAFT_WALK=plain`: DFlash2's walk reads each slot's codebook rows from global memory as it scores,
    /// as before they were staged in shared memory (entries 118, 120; the same path).
    pub draft_walk_plain: bool,
    /// `DFLASH_DRAFT_CONV_NORM=1` (not on by default until it has run on a GPU): a DFlash2 drafter layer's finish
    /// convolutions and the norms after them run as one launch each on a device instead of two (entry 122; the same
    /// outputs).
    pub draft_conv_norm: bool,
    /// `DFLASH_DRAFT_GRAPH=0`: a drafter pass on a device launches its kernels one by one every time instead of
    /// replaying a CUDA graph of them.
    pub no_draft_graph: bool,
    /// `DFLASH_DRAFT_TF32=1` (an optimisation not on by default): a drafter's (or a device MTP head's) f32 matmuls
    /// of more than 32 rows on a device (passes of many sequences, prompt appends) run on TF32 tensor cores instead
    /// of in full f32 (entries 108, 110).
    pub draft_tf32: bool,
    /// `DFLASH_DRAFT_BF16=0`: a drafter's bf16 matrices are widened to f32 on a device and its matmuls run in f32,
    /// as before they ran on bf16 tensor cores by default (entries 109-110).
    pub no_draft_bf16: bool,
    /// `DFLASH_KERNEL_TIMELINE=1`: an event after every CUDA launch, and the drafter's passes and the target's
    /// steps run eagerly, so their launches' GPU times can be logged (`cuda::timeline`).
    pub kernel_timeline: bool,
}

impl Switches {
    /// The switches `var` reports (a variable's value, or `None` when unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let is = |name: &str, value: &str| var(name).is_some_and(|v| v.trim() == value);
        let count = |name: &str| var(name).and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0);
        Switches {
            simd: var("DFLASH_SIMD"),
            no_pdl: is("DFLASH_PDL", "0"),
            no_gemm_three_per_sm: is("DFLASH_GEMM_3", "0"),
            gemm_prefetch_first_only: is("DFLASH_GEMM_PREFETCH", "first"),
            no_fold_norm: is("DFLASH_FOLD_NORM", "0"),
            no_fold_rope: is("DFLASH_FOLD_ROPE", "0"),
            no_mmq: is("DFLASH_MMQ", "0"),
            no_mmvq_half: is("DFLASH_MMVQ_HALF", "0"),
            decode_tile_queries: count("DFLASH_TILE_QUERIES"),
            no_mmq_warp: is("DFLASH_MMQ_WARP", "0"),
            mmq_warp_warps: count("DFLASH_MMQ_WARP_WARPS"),
            mmq_warp_min_rows: count("DFLASH_MMQ_WARP_MIN_ROWS"),
            mmq_warp_split: count("DFLASH_MMQ_WARP_SPLIT"),
            no_mmq_warp_pre: is("DFLASH_MMQ_WARP_PRE", "0"),
            no_mmq_warp_wide: is("DFLASH_MMQ_WARP_WIDE", "0"),
            no_graph_keys: is("DFLASH_GRAPH_KEYS", "0"),
            graph_pow2_buckets: is("DFLASH_GRAPH_BUCKETS", "pow2"),
            no_mixed_graphs: is("DFLASH_MIXED_GRAPHS", "0"),
            no_overlap_streams: is("DFLASH_OVERLAP_STREAMS", "0"),
            no_padded_prices: is("DFLASH_PADDED_PRICES", "0"),
            no_step_gate: is("DFLASH_STEP_GATE", "0"),
            no_capture_pages: is("DFLASH_CAPTURE_PAGES", "0"),
            no_draft_summary: is("DFLASH_DRAFT_SUMMARY", "0"),
            draft_top_k_sort: is("DFLASH_DRAFT_TOPK", "sort"),
            draft_walk_plain: is("DFLASH_DRAFT_WALK", "plain"),
            draft_conv_norm: is("DFLASH_DRAFT_CONV_NORM", "1"),
            no_draft_graph: is("DFLASH_DRAFT_GRAPH", "0"),
            draft_tf32: is("DFLASH_DRAFT_TF32", "1"),
            no_draft_bf16: is("DFLASH_DRAFT_BF16", "0"),
            kernel_timeline: is("DFLASH_KERNEL_TIMELINE", "1"),
        }
    }
}

/// The process's switches, read from the environment on first use.
pub fn switches() -> &'static Switches {
    static SWITCHES: OnceLock<Switches> = OnceLock::new();
    SWITCHES.get_or_init(|| Switches::from_vars(|name| std::env::var(name).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_documented_values_turn_a_switch() {
        let set = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
        };
        assert_eq!(Switches::from_vars(set(&[])), Switches::default());
        let all = Switches::from_vars(set(&[
            ("DFLASH_SIMD", "avx2"),
            ("DFLASH_PDL", "0"),
            ("DFLASH_GEMM_3", " 0 "),
            ("DFLASH_GEMM_PREFETCH", "first"),
            ("DFLASH_FOLD_NORM", "0"),
            ("DFLASH_FOLD_ROPE", "0"),
            ("DFLASH_MMQ", "0"),
            ("DFLASH_MMVQ_HALF", "0"),
            ("DFLASH_TILE_QUERIES", "8"),
            ("DFLASH_MMQ_WARP", "0"),
            ("DFLASH_MMQ_WARP_WARPS", "4"),
            ("DFLASH_MMQ_WARP_MIN_ROWS", " 16"),
            ("DFLASH_MMQ_WARP_SPLIT", "1"),
            ("DFLASH_MMQ_WARP_PRE", "0"),
            ("DFLASH_MMQ_WARP_WIDE", "0"),
            ("DFLASH_GRAPH_KEYS", "0"),
            ("DFLASH_GRAPH_BUCKETS", "pow2"),
            ("DFLASH_MIXED_GRAPHS", "0"),
            ("DFLASH_OVERLAP_STREAMS", "0"),
            ("DFLASH_PADDED_PRICES", "0"),
            ("DFLASH_STEP_GATE", "0"),
            ("DFLASH_CAPTURE_PAGES", "0"),
            ("DFLASH_DRAFT_SUMMARY", "0"),
            ("DFLASH_DRAFT_TOPK", "sort"),
            ("DFLASH_DRAFT_WALK", "plain"),
            ("DFLASH_DRAFT_CONV_NORM", "1"),
            ("DFLASH_DRAFT_GRAPH", "0"),
            ("DFLASH_DRAFT_TF32", "1"),
            ("DFLASH_DRAFT_BF16", "0"),
            ("DFLASH_KERNEL_TIMELINE", "1"),
        ]));
        let want = Switches {
            simd: Some("avx2".into()),
            no_pdl: true,
            no_gemm_three_per_sm: true,
            gemm_prefetch_first_only: true,
            no_fold_norm: true,
            no_fold_rope: true,
            no_mmq: true,
            no_mmvq_half: true,
            decode_tile_queries: Some(8),
            no_mmq_warp: true,
            mmq_warp_warps: Some(4),
            mmq_warp_min_rows: Some(16),
            mmq_warp_split: Some(1),
            no_mmq_warp_pre: true,
            no_mmq_warp_wide: true,
            no_graph_keys: true,
            graph_pow2_buckets: true,
            no_mixed_graphs: true,
            no_overlap_streams: true,
            no_padded_prices: true,
            no_step_gate: true,
            no_capture_pages: true,
            no_draft_summary: true,
            draft_top_k_sort: true,
            draft_walk_plain: true,
            draft_conv_norm: true,
            no_draft_graph: true,
            draft_tf32: true,
            no_draft_bf16: true,
            kernel_timeline: true,
        };
        assert_eq!(all, want);
        let other = Switches::from_vars(set(&[
            ("DFLASH_PDL", "1"),
            ("DFLASH_GEMM_PREFETCH", "all"),
            ("DFLASH_KERNEL_TIMELINE", "yes"),
            ("DFLASH_MMQ_WARP_WARPS", "0"),
            ("DFLASH_MMQ_WARP_MIN_ROWS", "many"),
        ]));
        assert_eq!(other, Switches::default(), "other values leave the optimisations on");
    }
}
