//! Cross-module tests: quantize/dequantize round trips and the matmul kernels (each level vs the scalar
//! path and vs an f32 reference on dequantized weights).

use super::blocks::{put_f16, Q4K_DMIN, Q6K_D};
use super::matmul::matmul_on;
use super::*;

const TYPES: [DType; 5] = [DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q4K, DType::Q6K];

/// Deterministic pseudo-random bits (xorshift64*).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `n` values in [-1, 1) with a few larger outliers (as activations have).
pub(crate) fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|i| if i % 37 == 5 { 6.0 * rng.unit() } else { rng.unit() }).collect()
}

/// `rows` rows of `k` elements of `dtype` with every quant bit random and sane f16 scales, so kernels see
/// bit patterns a quantizer would not produce (e.g. -128 in Q8_0, all 6-bit Q4_K scales).
fn random_blocks(dtype: DType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut w: Vec<u8> = (0..rows * dtype.bytes_for(k).expect("whole blocks")).map(|_| rng.next_u64() as u8).collect();
    for blk in w.chunks_exact_mut(dtype.block_bytes()) {
        let scale = 0.01 + 0.02 * rng.unit().abs();
        match dtype {
            DType::Q4_0 | DType::Q8_0 => put_f16(blk, 0, scale),
            DType::Q4_1 => {
                put_f16(blk, 0, scale);
                put_f16(blk, 2, -0.1 * rng.unit());
            }
            DType::Q4K => {
                put_f16(blk, 0, scale / 8.0);
                put_f16(blk, Q4K_DMIN, scale / 16.0);
            }
            _ => put_f16(blk, Q6K_D, scale / 64.0),
        }
    }
    w
}

fn dequantize(dtype: DType, w: &[u8], rows: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * k];
    let row_bytes = dtype.bytes_for(k).expect("whole blocks");
    for (r, dst) in out.chunks_exact_mut(k).enumerate() {
        dequantize_row(dtype, &w[r * row_bytes..(r + 1) * row_bytes], dst);
    }
    out
}

#[test]
fn round_trip_error_is_within_each_types_resolution() {
    // RMS error relative to the RMS of uniform [-1, 1) data: about step / sqrt(12) for each type's step
    // (measured: q4_0 0.065, q4_1 0.062, q8_0 0.0039, q4_k 0.056, q6_k 0.0136). Q4_K's scale search
    // must beat plain Q4_1 min/max rounding.
    let limits =
        [(DType::Q4_0, 0.07), (DType::Q4_1, 0.067), (DType::Q8_0, 0.0045), (DType::Q4K, 0.06), (DType::Q6K, 0.016)];
    for (dtype, limit) in limits {
        let k = 1024;
        let x: Vec<f32> = {
            let mut rng = Rng::new(3);
            (0..k).map(|_| rng.unit()).collect()
        };
        let mut q = vec![0u8; dtype.bytes_for(k).expect("whole blocks")];
        quantize_row(dtype, &x, &mut q);
        let mut back = vec![0f32; k];
        dequantize_row(dtype, &q, &mut back);
        let err = (x.iter().zip(&back).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / k as f32).sqrt();
        let rms = (x.iter().map(|a| a * a).sum::<f32>() / k as f32).sqrt();
        assert!(err / rms < limit, "{dtype}: relative rms error {}", err / rms);
        assert!(err / rms > limit / 4.0, "{dtype}: error {} is implausibly small", err / rms);
    }
}

#[test]
fn simple_types_round_trip_per_element() {
    let x = random_values(256, 4);
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        let mut q = vec![0u8; dtype.bytes_for(x.len()).expect("whole blocks")];
        quantize_row(dtype, &x, &mut q);
        let mut back = vec![0f32; x.len()];
        dequantize_row(dtype, &q, &mut back);
        for (xs, bs) in x.chunks(32).zip(back.chunks(32)) {
            let (lo, hi) = xs.iter().fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            let amax = lo.abs().max(hi.abs());
            // Half a quantization step, plus f16 rounding of the scale (and min) applied to the largest level.
            // Q4_0 maps the largest magnitude to -8, so the opposite extreme clamps at +7: a whole step.
            let bound = match dtype {
                DType::Q4_0 => amax / 8.0,
                DType::Q4_1 => (hi - lo) / 30.0,
                _ => amax / 254.0,
            } + amax * 2e-3;
            for (a, b) in xs.iter().zip(bs) {
                assert!((a - b).abs() <= bound, "{dtype}: {a} -> {b} (bound {bound})");
            }
        }
    }
}

#[test]
fn zero_rows_quantize_to_zero() {
    for dtype in TYPES {
        let n = dtype.block_len() * 2;
        let mut q = vec![0xAAu8; dtype.bytes_for(n).expect("whole blocks")];
        quantize_row(dtype, &vec![0.0; n], &mut q);
        let mut back = vec![1f32; n];
        dequantize_row(dtype, &q, &mut back);
        assert!(back.iter().all(|&v| v == 0.0), "{dtype}");
    }
}

/// `y = x · Wᵀ` on dequantized weights in f64, and per output the bound on the error that activation
/// quantization at `precision` may add: Σ|w| · (half a step of the activation block), where a second pass
/// divides the step by another 254 (it quantizes an error of at most half the first step).
fn reference(
    dtype: DType,
    precision: ActPrecision,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> (Vec<f32>, Vec<f32>) {
    let wf = dequantize(dtype, w, n, k);
    let act_block = if dtype.block_len() == 256 { 256 } else { 32 };
    let steps = if precision == ActPrecision::Int8x2 { 254.0 * 254.0 } else { 254.0 };
    let half_step: Vec<f32> = x
        .chunks(act_block)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
            std::iter::repeat_n(amax / steps, b.len())
        })
        .collect();
    let (mut y, mut bound) = (vec![0f32; m * n], vec![0f32; m * n]);
    for i in 0..m {
        for j in 0..n {
            let (xr, wr, hs) = (&x[i * k..(i + 1) * k], &wf[j * k..(j + 1) * k], &half_step[i * k..(i + 1) * k]);
            y[i * n + j] = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
            let magnitude: f32 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
            bound[i * n + j] = wr.iter().zip(hs).map(|(w, h)| w.abs() * h).sum::<f32>() * 1.001 + magnitude * 1e-5;
        }
    }
    (y, bound)
}

#[allow(clippy::too_many_arguments)]
fn run(
    level: Level,
    precision: ActPrecision,
    dtype: DType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * n];
    matmul_on(level, precision, dtype, w, n, k, x, m, &mut y);
    y
}

const PRECISIONS: [ActPrecision; 2] = [ActPrecision::Int8, ActPrecision::Int8x2];

fn check_all_levels(dtype: DType, n: usize, k: usize, m: usize, seed: u64) {
    let w = random_blocks(dtype, n, k, seed);
    let x = random_values(m * k, seed + 1);
    // The one-pass bound also scales the tolerance between levels (it tracks the terms' magnitudes).
    let (_, scale) = reference(dtype, ActPrecision::Int8, &w, n, k, &x, m);
    for precision in PRECISIONS {
        let (want, bound) = reference(dtype, precision, &w, n, k, &x, m);
        let scalar = run(Level::Scalar, precision, dtype, &w, n, k, &x, m);
        for (idx, (&got, &want)) in scalar.iter().zip(&want).enumerate() {
            assert!(
                (got - want).abs() <= bound[idx],
                "{dtype} {precision:?} scalar m={m} n={n} k={k} at {idx}: {got} vs {want} (bound {})",
                bound[idx]
            );
        }
        for &level in simd_levels() {
            let fast = run(level, precision, dtype, &w, n, k, &x, m);
            for (idx, (&got, &s)) in fast.iter().zip(&scalar).enumerate() {
                // Same integer sums; only the f32 accumulation order differs.
                let tol = 1e-5 * (1.0 + want[idx].abs() + scale[idx] * 254.0);
                assert!(
                    (got - s).abs() <= tol,
                    "{dtype} {precision:?} {level:?} m={m} n={n} at {idx}: {got} vs scalar {s}"
                );
            }
        }
    }
}

#[test]
fn matmul_matches_reference_for_every_type_and_level() {
    for (t, dtype) in TYPES.into_iter().enumerate() {
        let k = 2 * dtype.block_len().max(64);
        for m in [1, 3, 6, 17] {
            check_all_levels(dtype, 13, k, m, 100 + t as u64 * 10 + m as u64);
        }
    }
}

#[test]
fn matmul_handles_odd_block_counts_and_empty_rows() {
    // 3 blocks per row: the 4-bit decode kernel pairs blocks and must finish the odd one alone.
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        for m in [1, 2, 5] {
            check_all_levels(dtype, 11, 96, m, 40 + m as u64);
        }
    }
    let mut y = vec![f32::NAN; 6];
    matmul(DType::Q4_1, &[], 3, 0, &[], 2, &mut y);
    assert!(y.iter().all(|&v| v == 0.0), "k = 0 gives zeros: {y:?}");
    matmul(DType::Q4_1, &[], 0, 32, &[0.0; 64], 2, &mut []);
}

#[test]
fn matmul_splits_across_threads() {
    // Big enough to be split into jobs along both n and m on a 3-thread pool.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("pool");
    pool.install(|| {
        check_all_levels(DType::Q4_1, 37, 256, 40, 7);
        check_all_levels(DType::Q8_0, 5, 512, 70, 8);
        check_all_levels(DType::Q6K, 9, 512, 5, 9);
        check_all_levels(DType::Q4K, 9, 512, 40, 10);
    });
}

#[test]
fn matmul_on_quantized_real_values() {
    // Weights from the reference quantizers (rather than random bits), several tiles wide.
    for dtype in TYPES {
        let (n, k, m) = (9, 512, 4);
        let wf = random_values(n * k, 21);
        let mut w = vec![0u8; n * dtype.bytes_for(k).expect("whole blocks")];
        for (src, dst) in wf.chunks(k).zip(w.chunks_mut(dtype.bytes_for(k).expect("whole blocks"))) {
            quantize_row(dtype, src, dst);
        }
        let x = random_values(m * k, 22);
        for precision in PRECISIONS {
            let (want, bound) = reference(dtype, precision, &w, n, k, &x, m);
            let got = run(Level::detect(), precision, dtype, &w, n, k, &x, m);
            for i in 0..got.len() {
                let (got, want) = (got[i], want[i]);
                assert!((got - want).abs() <= bound[i], "{dtype} {precision:?} at {i}: {got} vs {want}");
            }
        }
    }
}

/// The SIMD levels this CPU supports (scalar excluded), best first.
fn simd_levels() -> &'static [Level] {
    static LEVELS: std::sync::OnceLock<Vec<Level>> = std::sync::OnceLock::new();
    LEVELS.get_or_init(|| Level::all().iter().copied().filter(|l| *l != Level::Scalar && l.is_supported()).collect())
}

#[test]
fn simd_level_is_named() {
    assert!(["avx512-vnni", "avx2", "scalar"].contains(&simd_level()));
}

#[test]
fn simd_env_never_picks_an_unsupported_level() {
    let every = |_: Level| true;
    let scalar_only = |l: Level| l == Level::Scalar;
    let best = Level::all()[0];
    assert_eq!(Level::choose(None, every), (best, None));
    assert_eq!(Level::choose(Some(" "), every), (best, None), "empty means unset");
    assert_eq!(Level::choose(Some("scalar"), every), (Level::Scalar, None));
    let (level, warning) = Level::choose(Some("sse9"), every);
    assert_eq!(level, best);
    assert!(warning.is_some_and(|w| w.contains("sse9")), "an unknown name is reported");
    #[cfg(target_arch = "x86_64")]
    {
        let no_avx512 = |l: Level| l != Level::Avx512;
        assert_eq!(Level::choose(Some("avx2"), every), (Level::Avx2, None));
        assert_eq!(Level::choose(Some("AVX512"), every), (Level::Avx512, None));
        assert_eq!(Level::choose(Some("avx512-vnni"), every), (Level::Avx512, None));
        let (level, warning) = Level::choose(Some("avx512"), no_avx512);
        assert_eq!(level, Level::Avx2, "falls back to the best supported level");
        assert!(warning.is_some_and(|w| w.contains("lacks avx512-vnni")));
        let (level, warning) = Level::choose(Some("avx2"), scalar_only);
        assert_eq!(level, Level::Scalar);
        assert!(warning.is_some());
    }
    let _ = scalar_only;
}

/// Activation rows the batch-invariance test draws its batches from.
const POOL_ROWS: usize = 80;

/// Runs [`run`] on `pool`'s threads (the matmul splits its work across the current pool).
#[allow(clippy::too_many_arguments)]
fn run_on_pool(
    pool: &rayon::ThreadPool,
    level: Level,
    precision: ActPrecision,
    dtype: DType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
) -> Vec<f32> {
    pool.install(|| run(level, precision, dtype, w, n, k, x, m))
}

/// The batch-invariance failures of one weight matrix on `level`: for every batch size and pool, each output
/// row must be bit-identical to that activation row's output from a call with it alone on one thread.
fn batch_variance(
    level: Level,
    precision: ActPrecision,
    dtype: DType,
    n: usize,
    k: usize,
    seed: u64,
    pools: &[rayon::ThreadPool],
) -> Vec<String> {
    let w = random_blocks(dtype, n, k, seed);
    let x = random_values(POOL_ROWS * k, seed + 1);
    let alone: Vec<Vec<f32>> = (0..POOL_ROWS)
        .map(|r| run_on_pool(&pools[0], level, precision, dtype, &w, n, k, &x[r * k..(r + 1) * k], 1))
        .collect();
    let mut failures = Vec::new();
    for m in [1, 2, 3, 4, 5, 8, 17, 64] {
        // Batches start at varying rows, so a row lands in different positions (tiles, lanes, jobs).
        let first = m % 16;
        for pool in pools {
            let y = run_on_pool(pool, level, precision, dtype, &w, n, k, &x[first * k..(first + m) * k], m);
            let differing = (0..m)
                .filter(|&i| {
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    bits(&y[i * n..(i + 1) * n]) != bits(&alone[first + i])
                })
                .count();
            if differing > 0 {
                let threads = pool.current_num_threads();
                failures.push(format!(
                    "{dtype} {precision:?} {level:?} n={n} k={k} m={m} threads={threads}: {differing} rows"
                ));
            }
        }
    }
    failures
}

#[test]
fn matmul_rows_are_batch_invariant() {
    // Greedy decoding with batching or speculation must equal plain decoding byte for byte, so a row's
    // output may not depend on the other rows in the call, its position, the batch size or the thread split.
    let pools: Vec<rayon::ThreadPool> =
        [1, 2, 3].map(|t| rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool")).into();
    let levels: Vec<Level> = [Level::Scalar].into_iter().chain(simd_levels().iter().copied()).collect();
    let mut failures = Vec::new();
    for (t, dtype) in TYPES.into_iter().enumerate() {
        for &level in &levels {
            // 96: an odd block count, which the 4-bit decode kernel finishes with a single block.
            for (s, (n, k)) in [(40, 512), (67, 256), (21, 96)].into_iter().enumerate() {
                if k % dtype.block_len() != 0 {
                    continue;
                }
                for precision in PRECISIONS {
                    let seed = 300 + 10 * t as u64 + s as u64;
                    failures.extend(batch_variance(level, precision, dtype, n, k, seed, &pools));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} combinations not batch-invariant:\n{}", failures.len(), failures.join("\n"));
}

/// Activations whose blocks quantize to ±127 (and 0), the extremes of the integer products.
fn extreme_values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|_| match rng.next_u64() % 3 {
            0 => 1.0,
            1 => -1.0,
            _ => 0.0,
        })
        .collect()
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_matches_avx2_bit_for_bit() {
    // The AVX-512 kernels must reproduce the AVX2 level exactly (the batch-invariance recipe), for every
    // shape: whole 16-row strips, strips with a tail the AVX2 kernels finish, fewer rows than a strip, block
    // counts that leave 1-3 blocks after steps of 4, and jobs on either side of the strip / gemm crossover.
    if !Level::Avx512.is_supported() || !Level::Avx2.is_supported() {
        eprintln!("avx512_matches_avx2_bit_for_bit: skipped, this CPU lacks AVX-512 VNNI");
        return;
    }
    let pools: Vec<rayon::ThreadPool> =
        [1, 3].map(|t| rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool")).into();
    let mut failures = Vec::new();
    let mut compared = 0;
    for (t, dtype) in TYPES.into_iter().enumerate() {
        let block_counts: &[usize] = if dtype.block_len() == 32 { &[1, 2, 3, 5, 18, 48] } else { &[1, 2, 3] };
        for (s, &blocks) in block_counts.iter().enumerate() {
            let k = blocks * dtype.block_len();
            for n in [1, 5, 15, 16, 17, 24, 37, 64, 100] {
                let seed = 500 + 100 * t as u64 + 10 * s as u64 + n as u64;
                let w = random_blocks(dtype, n, k, seed);
                for m in [1, 2, 3, 4, 5, 6, 17] {
                    for (v, x) in [random_values(m * k, seed + 1), extreme_values(m * k, seed + 2)].iter().enumerate() {
                        for (pool, precision) in pools.iter().flat_map(|p| PRECISIONS.map(|a| (p, a))) {
                            let want = run_on_pool(pool, Level::Avx2, precision, dtype, &w, n, k, x, m);
                            let got = run_on_pool(pool, Level::Avx512, precision, dtype, &w, n, k, x, m);
                            let differing = want.iter().zip(&got).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                            compared += want.len();
                            if differing > 0 {
                                let threads = pool.current_num_threads();
                                failures.push(format!(
                                    "{dtype} {precision:?} n={n} k={k} m={m} values={v} threads={threads}: {differing} \
                                     outputs"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} cases differ from AVX2:\n{}", failures.len(), failures.join("\n"));
    assert!(compared > 100_000, "compared {compared} outputs");
}
