//! GGUF block-quantized types: ggml's block layouts, (de)quantization and the quantized matmul.
//!
//! * [`dequantize_row`] / [`quantize_row`]: rows of Q4_0, Q4_1, Q8_0, Q4_K, Q6_K blocks to and from f32
//!   (layouts in [`blocks`], bit-exact with ggml).
//! * [`matmul`]: `y = x · Wᵀ` for a block-quantized `W`. As in llama.cpp, the activations are quantized once
//!   per call to 8-bit blocks (32 elements with scale and sum for Q4_0/Q4_1/Q8_0; 256 elements with 16-element
//!   sums for the K-quants) and the kernels run integer dot products, scaling per block in f32. Unlike
//!   llama.cpp, by default a second 8-bit pass carries each block's rounding error ([`ActPrecision`]), so the
//!   result follows the weights' exact f32 product closely enough not to flip the model's near-ties.
//!
//! The SIMD path is picked once per process ([`simd_level`]; `DFLASH_SIMD=scalar|avx2|avx512` asks for a
//! lower one, for A/B measurements) and dispatched in one place (`matmul::run_chunk`): a path is a module
//! with the same `chunk` signature plus a `Level` variant. The scalar path is the fallback and the reference
//! the others are tested against; the AVX2 and AVX-512 paths give bit-identical outputs.

mod act;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_gemm;
#[cfg(target_arch = "x86_64")]
mod avx2_k;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_gemm;
pub mod blocks;
mod dequant;
mod matmul;
mod quantize;
mod scalar;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::DType;

/// A kernel implementation level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    Scalar,
    /// AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F/BW/VL/VNNI on top of AVX2 + FMA + F16C: `vpdpbusd` kernels for the 32-element block types
    /// (16-row decode strips and a repacking gemm), the AVX2 kernels for the K-quants.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

/// The environment variable that asks for a SIMD level other than the best one.
const SIMD_ENV: &str = "DFLASH_SIMD";

impl Level {
    /// The level the kernels use (chosen once): the best this CPU supports, or the one `DFLASH_SIMD` asks
    /// for if the CPU supports it.
    pub(crate) fn detect() -> Level {
        static LEVEL: OnceLock<Level> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            let request = crate::switches::switches().simd.as_deref();
            let (level, warning) = Level::choose(request, Level::is_supported);
            if let Some(warning) = warning {
                // Once per process; the runtime has no logger of its own.
                eprintln!("warning: {warning}");
            }
            level
        })
    }

    /// Every level, best first.
    fn all() -> &'static [Level] {
        #[cfg(target_arch = "x86_64")]
        return &[Level::Avx512, Level::Avx2, Level::Scalar];
        #[cfg(not(target_arch = "x86_64"))]
        return &[Level::Scalar];
    }

    /// Whether this CPU can run the level's kernels.
    pub(crate) fn is_supported(self) -> bool {
        match self {
            Level::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => {
                Level::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
        }
    }

    /// The level for a `DFLASH_SIMD` value (`None`: unset) on a CPU where `supported` holds, and a warning
    /// when the request cannot be honoured: an unknown name or a level the CPU lacks gives the best
    /// supported level, never an unsupported one.
    fn choose(request: Option<&str>, supported: impl Fn(Level) -> bool) -> (Level, Option<String>) {
        let best = Level::all().iter().copied().find(|&l| supported(l)).unwrap_or(Level::Scalar);
        let Some(request) = request.map(str::trim).filter(|r| !r.is_empty()) else {
            return (best, None);
        };
        let wanted = Level::all()
            .iter()
            .copied()
            .find(|l| request.eq_ignore_ascii_case(l.short_name()) || request.eq_ignore_ascii_case(l.name()));
        match wanted {
            Some(level) if supported(level) => (level, None),
            Some(level) => {
                (best, Some(format!("{SIMD_ENV}={request}: this CPU lacks {}; using {}", level.name(), best.name())))
            }
            None => {
                let known = Level::all().iter().map(|l| l.short_name()).collect::<Vec<_>>().join(", ");
                (best, Some(format!("{SIMD_ENV}={request} is not one of {known}; using {}", best.name())))
            }
        }
    }

    /// The name `DFLASH_SIMD` takes (the full [`Level::name`] is accepted too).
    fn short_name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => "avx512",
            _ => self.name(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => "avx512-vnni",
        }
    }
}

/// How the quantized matmul rounds its f32 activations before the integer dot products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ActPrecision {
    /// One 8-bit pass per 32- or 256-element block (llama.cpp's `Q8_1` / `Q8_K`): an element's error is up to
    /// 1/254 of its block's largest magnitude. Fastest.
    Int8,
    /// An 8-bit pass plus an 8-bit pass over its rounding error (about 15 bits): the kernels run on twice the
    /// activation rows, which costs little in decode (the weights are read once) and about twice the integer
    /// work in prefill. Every output stays batch invariant.
    #[default]
    Int8x2,
}

impl ActPrecision {
    /// Quantized activation rows per input row.
    pub fn passes(self) -> usize {
        match self {
            ActPrecision::Int8 => 1,
            ActPrecision::Int8x2 => 2,
        }
    }
}

/// Whether the process runs at [`ActPrecision::Int8`] (the default is [`ActPrecision::Int8x2`]).
static INT8_ACTIVATIONS: AtomicBool = AtomicBool::new(false);

/// Sets the activation precision of [`matmul`] (and of the CUDA backend's quantized matmul, which reads it
/// when it loads a model) for the whole process: a numeric mode chosen once at start-up, like the SIMD level.
pub fn set_act_precision(precision: ActPrecision) {
    INT8_ACTIVATIONS.store(precision == ActPrecision::Int8, Ordering::Relaxed);
}

/// The activation precision [`matmul`] uses.
pub fn act_precision() -> ActPrecision {
    if INT8_ACTIVATIONS.load(Ordering::Relaxed) {
        ActPrecision::Int8
    } else {
        ActPrecision::Int8x2
    }
}

/// Which SIMD path the kernels use (`"avx512-vnni"`, `"avx2"` or `"scalar"`), for logs.
pub fn simd_level() -> &'static str {
    Level::detect().name()
}

/// Decodes one row of `dtype` into f32. `dst.len()` is the element count; `src` holds exactly those
/// elements (a whole number of blocks for the block types; dense types are converted as they are).
///
/// # Panics
/// When `src.len()` does not match `dst.len()` elements of `dtype` (a caller bug).
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) {
    if !dtype.is_quantized() {
        return crate::convert::row_to_f32(dtype, src, dst);
    }
    assert_eq!(Some(src.len()), dtype.bytes_for(dst.len()), "{} {dtype} elements", dst.len());
    let decode: fn(&[u8], &mut [f32]) = match dtype {
        DType::Q4_0 => dequant::block_q4_0,
        DType::Q4_1 => dequant::block_q4_1,
        DType::Q8_0 => dequant::block_q8_0,
        DType::Q4K => dequant::block_q4_k,
        DType::Q6K => dequant::block_q6_k,
        _ => unreachable!("dense types returned above"),
    };
    for (blk, out) in src.chunks_exact(dtype.block_bytes()).zip(dst.chunks_exact_mut(dtype.block_len())) {
        decode(blk, out);
    }
}

/// Quantizes f32 values into a row of `dtype` blocks with ggml's reference quantizers (for tests and
/// tools; not a hot path). `src.len()` must be a whole number of blocks and `dst` exactly their bytes.
///
/// # Panics
/// When `dtype` is not one of Q4_0, Q4_1, Q8_0, Q4_K, Q6_K or the lengths do not match (caller bugs).
pub fn quantize_row(dtype: DType, src: &[f32], dst: &mut [u8]) {
    assert!(dtype.is_quantized(), "quantize_row needs a block type, got {dtype}");
    assert_eq!(Some(dst.len()), dtype.bytes_for(src.len()), "{} {dtype} elements", src.len());
    let encode: fn(&[f32], &mut [u8]) = match dtype {
        DType::Q4_0 => quantize::block_q4_0,
        DType::Q4_1 => quantize::block_q4_1,
        DType::Q8_0 => quantize::block_q8_0,
        DType::Q4K => quantize::block_q4_k,
        DType::Q6K => quantize::block_q6_k,
        _ => unreachable!("checked above"),
    };
    for (x, blk) in src.chunks_exact(dtype.block_len()).zip(dst.chunks_exact_mut(dtype.block_bytes())) {
        encode(x, blk);
    }
}

/// `y[m, n] = x[m, k] · W[n, k]ᵀ` for a block-quantized `W` stored row-major (`n` rows of `k / block_len`
/// blocks). `x` and `y` are f32 row-major; `x` is rounded at the process's [`act_precision`]. Runs on rayon's
/// current pool, splitting the output across its threads; small calls stay on the calling thread.
///
/// Batch invariant: row `i` of `y` is bit-for-bit the same whatever else is in the call (the number of
/// rows, the other rows, the pool size and how the work is split), so batched or speculative forwards
/// reproduce one-row results exactly. The AVX2 and AVX-512 levels agree bit for bit; the scalar path may
/// differ from them in the last bits.
///
/// Call it from a pool thread (inside `ThreadPool::install` / `rayon::scope`) in hot loops: from any other
/// thread every split call is injected into the pool and waited for, which measured ~15-25 µs per call here
/// against ~2-5 µs from a pool thread.
///
/// # Panics
/// When `dtype` is not a block type, `k` is not a whole number of blocks, or a slice length does not match
/// the shapes (caller bugs).
pub fn matmul(dtype: DType, w: &[u8], n: usize, k: usize, x: &[f32], m: usize, y: &mut [f32]) {
    matmul_at(act_precision(), dtype, w, n, k, x, m, y);
}

/// [`matmul`] with activations at `precision` rather than the process's.
///
/// # Panics
/// As [`matmul`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_at(
    precision: ActPrecision,
    dtype: DType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) {
    matmul::matmul_on(Level::detect(), precision, dtype, w, n, k, x, m, y);
}

#[cfg(test)]
pub(crate) mod tests;
