//! Every CUDA kernel against its CPU twin in `dflash_runtime::ops`, on fresh random inputs (odd sizes
//! included), with outputs poisoned with NaN before each launch so an unwritten element fails the check.
//!
//! Needs the `cuda` feature. Without a CUDA device every test prints a SKIP notice and passes: CI has no
//! GPU. On a GPU machine run the test binary with `--test-threads=1` for a tidy table (docs/CUDA.md).
//!
//! Tolerances (`err` = |gpu − cpu|): exact for gathers, bf16 rounding, RoPE, the residual update and argmax
//! indices; `1e-5 · max(1, |cpu|)` for RMSNorm and `2e-5 · max(1, |cpu|)` for SwiGLU; `1e-5 · Σ|w·x|` per output
//! for the GEMV and `1e-4 · Σ|w·x|` for cuBLAS, x rounded to bf16 on both sides. Why each: docs/CUDA.md,
//! "Parity tests".

mod common;

use common::gpu::open_device;
use common::{say, Rng};
use std::sync::OnceLock;

use dflash_runtime::cuda::{self, ops as gpu, CudaDevice, CudaError, CudaRopeTable, DeviceBuf};
use dflash_runtime::ops::{self as cpu, RopeScaling, RopeStyle, RopeTable};
use dflash_runtime::{convert, DType, Tensor};
use half::bf16;

/// The shared device, or `None` (after one notice) when this machine has no usable CUDA device.
fn device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Option<CudaDevice>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            open_device("cuda parity tests", |dev| {
                let (info, report) = (dev.info(), dev.compile_report());
                say(&format!(
                    "cuda parity on {} (sm_{}{}, {} SMs, NVRTC {}.{}); kernels {} in {:.0} ms",
                    info.name,
                    info.compute_capability.0,
                    info.compute_capability.1,
                    info.multiprocessors,
                    info.nvrtc_version.0,
                    info.nvrtc_version.1,
                    if report.cache_hit { "read from cache" } else { "compiled" },
                    report.millis
                ));
                say(&format!("{:<34} {:<26} {:>11} {:>11}", "kernel", "shape", "max err", "tolerance"));
            })
        })
        .as_ref()
}

/// One table row, then the check.
fn check(kernel: &str, shape: &str, max_err: f64, tol: f64) {
    say(&format!("{kernel:<34} {shape:<26} {max_err:>11.3e} {tol:>11.1e}"));
    assert!(max_err <= tol, "{kernel} {shape}: max error {max_err:e} over tolerance {tol:e}");
}

fn poisoned(dev: &CudaDevice, len: usize) -> DeviceBuf<f32> {
    dev.upload(&vec![f32::NAN; len]).expect("poisoned output")
}

/// Largest `|got − want| / max(1, |want|)`; a NaN anywhere (an unwritten element) counts as infinite.
fn max_scaled_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else {
                (g as f64 - w as f64).abs() / (w as f64).abs().max(1.0)
            }
        })
        .fold(0.0, f64::max)
}

/// Largest bit-level difference as a count of differing elements (0 = bit-identical).
fn bit_mismatches(got: &[f32], want: &[f32]) -> f64 {
    got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count() as f64
}

/// Elements of a kernel's bf16 output that differ from its f32 output `f32_out` rounded to bf16 (the bf16 variants
/// of the norm and SwiGLU store that rounding, the cuBLAS operand).
fn bf16_cast_mismatches(dev: &CudaDevice, got: &DeviceBuf<bf16>, f32_out: &[f32]) -> f64 {
    let got = dev.download(got).expect("download bf16");
    got.iter().zip(f32_out).filter(|(g, &w)| g.to_bits() != bf16::from_f32(w).to_bits()).count() as f64
}

fn bf16_vec(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn bf16_tensor(v: &[bf16], shape: &[usize]) -> Tensor {
    let bytes: Vec<u8> = v.iter().flat_map(|b| b.to_le_bytes()).collect();
    Tensor::from_bytes(DType::BF16, shape, &bytes).expect("bf16 tensor")
}

fn f32_tensor(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_f32(v, shape).expect("f32 tensor")
}

#[test]
fn embedding_gathers_rows_exactly() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(1);
    let (vocab, hidden, count) = (1000, 333, 37);
    let table = rng.vec(vocab * hidden, 2.0);
    let table_bf16 = bf16_vec(&table);
    let mut ids: Vec<u32> = (0..count).map(|_| rng.below(vocab) as u32).collect();
    ids[0] = 0;
    ids[1] = vocab as u32 - 1;
    let ids_dev = dev.upload(&ids).expect("ids");
    let mut want = f32_tensor(&vec![0.0; count * hidden], &[count, hidden]);

    cpu::embedding(&f32_tensor(&table, &[vocab, hidden]), &ids, &mut want).expect("cpu f32");
    let mut out = poisoned(dev, count * hidden);
    gpu::embedding_f32(dev, &dev.upload(&table).expect("table"), &ids_dev, &mut out).expect("embedding_f32");
    let got = dev.download(&out).expect("download");
    check("embedding_f32", "1000x333, 37 ids", bit_mismatches(&got, want.as_f32().expect("want")), 0.0);

    cpu::embedding(&bf16_tensor(&table_bf16, &[vocab, hidden]), &ids, &mut want).expect("cpu bf16");
    let mut out = poisoned(dev, count * hidden);
    let table_dev = dev.upload(&table_bf16).expect("table");
    gpu::embedding_bf16(dev, &table_dev, &ids_dev, &mut out).expect("embedding_bf16");
    let got = dev.download(&out).expect("download");
    check("embedding_bf16", "1000x333, 37 ids", bit_mismatches(&got, want.as_f32().expect("want")), 0.0);

    // An id past the vocabulary (an error on the CPU) gives a NaN row; the other row is still gathered.
    let mut out = dev.alloc_zeros::<f32>(2 * hidden).expect("out");
    gpu::embedding_bf16(dev, &table_dev, &dev.upload(&[vocab as u32, 5]).expect("ids"), &mut out).expect("launch");
    let got = dev.download(&out).expect("download");
    assert!(got[..hidden].iter().all(|v| v.is_nan()), "out-of-range id must give NaN");
    assert_eq!(got[hidden], table_bf16[5 * hidden].to_f32());
}

#[test]
fn rms_norm_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(2);
    for (rows, h) in [(3, 37), (64, 4096), (5, 8195)] {
        let (x, w) = (rng.vec(rows * h, 3.0), rng.vec(h, 1.5));
        let mut want = f32_tensor(&vec![0.0; rows * h], &[rows, h]);
        cpu::rms_norm(&f32_tensor(&x, &[rows, h]), &f32_tensor(&w, &[h]), 1e-6, &mut want).expect("cpu");
        let mut out = poisoned(dev, rows * h);
        let (x_dev, w_dev) = (dev.upload(&x).expect("x"), dev.upload(&w).expect("w"));
        gpu::rms_norm(dev, &x_dev, &w_dev, 1e-6, &mut out).expect("rms_norm");
        let got = dev.download(&out).expect("download");
        check("rms_norm", &format!("{rows}x{h}"), max_scaled_err(&got, want.as_f32().expect("want")), 1e-5);
        let mut out_bf16 = dev.upload(&vec![bf16::NAN; rows * h]).expect("out bf16");
        gpu::rms_norm(dev, &x_dev, &w_dev, 1e-6, &mut out_bf16).expect("rms_norm bf16");
        check("rms_norm bf16", &format!("{rows}x{h}"), bf16_cast_mismatches(dev, &out_bf16, &got), 0.0);
    }
}

#[test]
fn add_rms_norm_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(3);
    for (rows, h) in [(4, 576), (33, 1000)] {
        let (residual, delta, w) = (rng.vec(rows * h, 2.0), rng.vec(rows * h, 2.0), rng.vec(h, 1.0));
        let mut want_residual = f32_tensor(&residual, &[rows, h]);
        let mut want = f32_tensor(&vec![0.0; rows * h], &[rows, h]);
        let (delta_t, w_t) = (f32_tensor(&delta, &[rows, h]), f32_tensor(&w, &[h]));
        cpu::add_rms_norm(&mut want_residual, &delta_t, &w_t, 1e-5, &mut want).expect("cpu");
        let mut residual_dev = dev.upload(&residual).expect("residual");
        let mut out = poisoned(dev, rows * h);
        let (delta_dev, w_dev) = (dev.upload(&delta).expect("delta"), dev.upload(&w).expect("w"));
        gpu::add_rms_norm(dev, &mut residual_dev, &delta_dev, &w_dev, 1e-5, &mut out).expect("add_rms_norm");
        let (got_residual, got) = (dev.download(&residual_dev).expect("r"), dev.download(&out).expect("out"));
        let shape = format!("{rows}x{h}");
        check("add_rms_norm residual", &shape, bit_mismatches(&got_residual, want_residual.as_f32().expect("r")), 0.0);
        check("add_rms_norm out", &shape, max_scaled_err(&got, want.as_f32().expect("want")), 1e-5);
    }
}

#[test]
fn rope_matches_cpu_bit_for_bit() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(4);
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 1024,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: None,
        mscale: None,
        mscale_all_dim: None,
        truncate: true,
    };
    let max_pos = 4096;
    // (style, scaling, heads, head_dim, rotary_dim): full and partial rotation, odd head counts.
    let cases = [
        (RopeStyle::Neox, RopeScaling::None, 9, 64, 64),
        (RopeStyle::Interleaved, RopeScaling::None, 3, 64, 64),
        (RopeStyle::Neox, yarn, 5, 128, 128),
        (RopeStyle::Interleaved, RopeScaling::Linear { factor: 2.0 }, 7, 80, 32),
    ];
    for (style, scaling, heads, head_dim, rot) in cases {
        let table = RopeTable::new(rot, 100_000.0, &scaling, style).expect("table");
        let table_dev = CudaRopeTable::new(dev, &table, max_pos).expect("table upload");
        let rows = 19;
        let positions: Vec<u32> = (0..rows).map(|_| rng.below(max_pos) as u32).collect();
        let x = rng.vec(rows * heads * head_dim, 4.0);
        let mut want = f32_tensor(&x, &[rows, heads * head_dim]);
        cpu::rope(&mut want, head_dim, &positions, &table).expect("cpu");
        let mut x_dev = dev.upload(&x).expect("x");
        gpu::rope(dev, &mut x_dev, head_dim, &dev.upload(&positions).expect("positions"), &table_dev).expect("rope");
        let got = dev.download(&x_dev).expect("download");
        let shape = format!("{rows}x{heads}x{head_dim} rot {rot}");
        check(&format!("rope {style:?}"), &shape, bit_mismatches(&got, want.as_f32().expect("want")), 0.0);
    }
    // A position past the table turns the rotated dims of its row into NaN.
    let table = RopeTable::new(64, 10_000.0, &RopeScaling::None, RopeStyle::Neox).expect("table");
    let table_dev = CudaRopeTable::new(dev, &table, 16).expect("table upload");
    let mut x_dev = dev.upload(&[1.0f32; 64]).expect("x");
    gpu::rope(dev, &mut x_dev, 64, &dev.upload(&[16u32]).expect("pos"), &table_dev).expect("rope");
    assert!(dev.download(&x_dev).expect("download").iter().all(|v| v.is_nan()));
}

#[test]
fn swiglu_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(5);
    for (rows, inter) in [(2, 21), (40, 1001), (3, 8192)] {
        let gate_up = rng.vec(rows * 2 * inter, 12.0);
        let mut want = f32_tensor(&vec![0.0; rows * inter], &[rows, inter]);
        cpu::swiglu_fused(&f32_tensor(&gate_up, &[rows, 2 * inter]), &mut want).expect("cpu");
        let mut out = poisoned(dev, rows * inter);
        let gate_up_dev = dev.upload(&gate_up).expect("gate_up");
        gpu::swiglu_fused(dev, &gate_up_dev, &mut out, rows).expect("swiglu");
        let got = dev.download(&out).expect("download");
        check("swiglu_fused", &format!("{rows}x{inter}"), max_scaled_err(&got, want.as_f32().expect("want")), 2e-5);
        let mut out_bf16 = dev.upload(&vec![bf16::NAN; rows * inter]).expect("out bf16");
        gpu::swiglu_fused(dev, &gate_up_dev, &mut out_bf16, rows).expect("swiglu bf16");
        check("swiglu_fused bf16", &format!("{rows}x{inter}"), bf16_cast_mismatches(dev, &out_bf16, &got), 0.0);
    }
}

#[test]
fn argmax_matches_cpu_with_ties_and_nans() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(6);
    // 2048 + 1 puts a lone element in a second chunk of the first pass.
    for (rows, len) in [(7, 49157), (1, 151_936), (3, 1), (2, 2049)] {
        let mut logits = rng.vec(rows * len, 20.0);
        if rows == 7 {
            let row = |r: usize| r * len;
            // Row 0: the maximum twice, the later one must lose. Row 1: NaNs around. Row 2: all NaN.
            // Row 3: all -inf. Row 4: -inf and NaN only. Rows 5, 6: plain random.
            logits[row(0) + 40_000] = 50.0;
            logits[row(0) + 123] = 50.0;
            for i in (0..len).step_by(3) {
                logits[row(1) + i] = f32::NAN;
            }
            logits[row(2)..row(3)].fill(f32::NAN);
            logits[row(3)..row(4)].fill(f32::NEG_INFINITY);
            for i in 0..len {
                logits[row(4) + i] = if i % 2 == 0 { f32::NAN } else { f32::NEG_INFINITY };
            }
        }
        let want: Vec<u32> = logits.chunks(len).map(cpu::argmax).collect();
        let mut out = dev.upload(&vec![u32::MAX; rows]).expect("poisoned out");
        let scratch = gpu::ArgmaxScratch::new(dev, rows, len).expect("scratch");
        gpu::argmax_rows(dev, &dev.upload(&logits).expect("logits"), len, &mut out, &scratch).expect("argmax");
        let got = dev.download(&out).expect("download");
        let mismatches = got.iter().zip(&want).filter(|(g, w)| g != w).count() as f64;
        check("argmax_rows", &format!("{rows}x{len}"), mismatches, 0.0);
    }
}

#[test]
fn f32_to_bf16_rounds_like_the_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(7);
    // Random bit patterns cover every exponent, subnormals and NaNs; then ties and specials.
    let mut x: Vec<f32> = (0..100_003).map(|_| f32::from_bits(rng.next_u64() as u32)).collect();
    x.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE / 3.0]);
    x.extend([0x3f80_8000u32, 0x3f81_8000, 0x7f7f_ffff, 0x0000_8000, 0x8001_8000].map(f32::from_bits));
    let mut want = x.clone();
    convert::round_to_bf16(&mut want);
    let mut out = dev.upload(&vec![bf16::from_bits(0x7fff); x.len()]).expect("poisoned out");
    gpu::f32_to_bf16(dev, &dev.upload(&x).expect("x"), &mut out).expect("f32_to_bf16");
    let got: Vec<f32> = dev.download(&out).expect("download").iter().map(|b| b.to_f32()).collect();
    check("f32_to_bf16", &format!("{}", x.len()), bit_mismatches(&got, &want), 0.0);
}

/// `err / Σ|w·x|` per output element of `y = x · Wᵀ` (W given as f32 values), the largest over all.
fn matmul_err(got: &[f32], want: &[f32], x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> f64 {
    let mut worst = 0.0f64;
    for r in 0..m {
        for c in 0..n {
            let magnitude: f64 = (0..k).map(|j| (x[r * k + j] as f64 * w[c * k + j] as f64).abs()).sum();
            let (g, e) = (got[r * n + c], want[r * n + c]);
            let err = if g.is_nan() || e.is_nan() { f64::INFINITY } else { (g as f64 - e as f64).abs() };
            worst = worst.max(err / magnitude.max(f64::MIN_POSITIVE));
        }
    }
    worst
}

/// Random bf16 weights `[n, k]` and f32 inputs `[m, k]`, with the weights also as f32 values.
fn matmul_inputs(rng: &mut Rng, m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<bf16>, Vec<f32>) {
    let w = bf16_vec(&rng.vec(n * k, 0.5));
    let w_f32 = w.iter().map(|b| b.to_f32()).collect();
    (rng.vec(m * k, 2.0), w, w_f32)
}

fn cpu_matmul(x: &[f32], w: &[bf16], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut y = f32_tensor(&vec![0.0; m * n], &[m, n]);
    cpu::matmul(&f32_tensor(x, &[m, k]), &bf16_tensor(w, &[n, k]), &mut y).expect("cpu matmul");
    y.as_f32().expect("y").to_vec()
}

#[test]
fn gemv_matches_cpu_matmul() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(8);
    // k a multiple of 8 takes the 16-byte path, other k the scalar one; n not a multiple of the 8 rows
    // per block leaves idle warps.
    for (m, n, k) in [(1, 1000, 4104), (3, 257, 1001), (8, 96, 2048), (1, 4096, 4096), (5, 33, 8), (2, 7, 13)] {
        let (x, w, w_f32) = matmul_inputs(&mut rng, m, n, k);
        let want = cpu_matmul(&x, &w, m, n, k);
        let mut y = poisoned(dev, m * n);
        gpu::gemv_bf16(dev, &dev.upload(&x).expect("x"), &dev.upload(&w).expect("w"), n, &mut y).expect("gemv");
        let got = dev.download(&y).expect("download");
        check("gemv_bf16", &format!("m{m} n{n} k{k}"), matmul_err(&got, &want, &x, &w_f32, m, n, k), 1e-5);
    }
}

#[test]
fn cublas_gemm_matches_cpu_matmul_on_bf16_inputs() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(9);
    for (m, n, k) in [(16, 512, 1024), (33, 300, 520), (9, 64, 4096), (128, 256, 264), (1, 96, 64)] {
        let (x, w, w_f32) = matmul_inputs(&mut rng, m, n, k);
        let mut x_rounded = x.clone();
        convert::round_to_bf16(&mut x_rounded);
        let want = cpu_matmul(&x_rounded, &w, m, n, k);
        let mut y = poisoned(dev, m * n);
        let mut scratch = dev.alloc_zeros::<bf16>(m * k + 5).expect("scratch");
        let (x_dev, w_dev) = (dev.upload(&x).expect("x"), dev.upload(&w).expect("w"));
        gpu::gemm_bf16(dev, &x_dev, &w_dev, n, &mut y, &mut scratch).expect("gemm");
        let got = dev.download(&y).expect("download");
        let err = matmul_err(&got, &want, &x_rounded, &w_f32, m, n, k);
        check("gemm_bf16 (cuBLAS)", &format!("m{m} n{n} k{k}"), err, 1e-4);
    }
}

#[test]
fn matmul_dispatch_takes_both_paths() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(10);
    let (n, k) = (200, 512);
    for m in [cuda::GEMV_DISPATCH_MAX_ROWS, cuda::GEMV_DISPATCH_MAX_ROWS + 1, 17] {
        let (x, w, w_f32) = matmul_inputs(&mut rng, m, n, k);
        let mut x_cpu = x.clone();
        let gemm_path = m > cuda::GEMV_DISPATCH_MAX_ROWS;
        if gemm_path {
            convert::round_to_bf16(&mut x_cpu);
        }
        let want = cpu_matmul(&x_cpu, &w, m, n, k);
        let mut y = poisoned(dev, m * n);
        let mut scratch = dev.alloc_zeros::<bf16>(m * k).expect("scratch");
        let (x_dev, w_dev) = (dev.upload(&x).expect("x"), dev.upload(&w).expect("w"));
        gpu::matmul_bf16(dev, &x_dev, &w_dev, n, &mut y, &mut scratch).expect("matmul");
        let got = dev.download(&y).expect("download");
        let tol = if gemm_path { 1e-4 } else { 1e-5 };
        check("matmul_bf16", &format!("m{m} n{n} k{k}"), matmul_err(&got, &want, &x_cpu, &w_f32, m, n, k), tol);
    }
}

#[test]
fn masked_argmax_matches_cpu_over_random_masks() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(16);
    let (rows, len) = (9usize, 49_157usize);
    let words = len.div_ceil(32);
    let mut logits = rng.vec(rows * len, 20.0);
    // Row 1: its two largest allowed values tie. Row 2: every allowed value NaN (the unmasked argmax stays).
    logits[len + 77] = 60.0;
    logits[len + 40_001] = 60.0;
    // Masks of every density: a handful of ids, about half, almost all, only NaNs; rows 0, 3, 5, 7 are masked.
    let masked = [0u32, 1, 2, 3, 5, 7];
    let mut masks = vec![0u32; masked.len() * words];
    for (m, &row) in masked.iter().enumerate() {
        let mask = &mut masks[m * words..(m + 1) * words];
        for id in 0..len {
            let keep = match m {
                0 => id % 997 == 5,
                1 => id == 77 || id == 40_001 || id % 13 == 0,
                2 => id % 7 == 0,
                3 => rng.vec(1, 1.0)[0] > 0.0,
                _ => id % 50 != 0,
            };
            if keep {
                mask[id / 32] |= 1 << (id % 32);
            }
        }
        if m == 2 {
            (0..len).filter(|id| id % 7 == 0).for_each(|id| logits[row as usize * len + id] = f32::NAN);
        }
    }
    let unmasked: Vec<u32> = logits.chunks(len).map(cpu::argmax).collect();
    let mut want = unmasked.clone();
    for (m, &row) in masked.iter().enumerate() {
        let row_logits = &logits[row as usize * len..(row as usize + 1) * len];
        if let Some(id) = cpu::filter::masked_argmax(row_logits, &masks[m * words..(m + 1) * words]) {
            want[row as usize] = id;
        }
    }
    assert_eq!(want[1], 77, "ties go to the lowest id");
    assert_eq!(want[2], unmasked[2], "no allowed number leaves the row's argmax");
    let mut out = dev.upload(&unmasked).expect("ids");
    let (masks_dev, rows_dev) = (dev.upload(&masks).expect("masks"), dev.upload(&masked).expect("rows"));
    let logits_dev = dev.upload(&logits).expect("logits");
    gpu::argmax_rows_masked(dev, &logits_dev, len, (&masks_dev, words), &rows_dev, &mut out).expect("masked argmax");
    let got = dev.download(&out).expect("download");
    let mismatches = got.iter().zip(&want).filter(|(g, w)| g != w).count() as f64;
    check("argmax_rows_masked", &format!("{rows}x{len}"), mismatches, 0.0);
}

#[test]
fn bad_shapes_are_errors_not_launches() {
    let Some(dev) = device() else { return };
    let buf = |n: usize| dev.alloc_zeros::<f32>(n).expect("buf");
    let is_shape = |r: Result<(), CudaError>| matches!(r, Err(CudaError::Shape(_)));
    let ids = dev.upload(&[0u32, 1]).expect("ids");
    assert!(is_shape(gpu::embedding_f32(dev, &buf(10), &ids, &mut buf(7))));
    assert!(is_shape(gpu::rms_norm(dev, &buf(10), &buf(3), 1e-6, &mut buf(9))));
    assert!(is_shape(gpu::rms_norm(dev, &buf(12), &buf(3), 1e-6, &mut buf(9))));
    assert!(is_shape(gpu::add_rms_norm(dev, &mut buf(12), &buf(9), &buf(3), 1e-6, &mut buf(12))));
    assert!(is_shape(gpu::swiglu_fused(dev, &buf(12), &mut buf(5), 1)));
    let mut argmax_out = dev.alloc_zeros::<u32>(2).expect("out");
    let scratch = gpu::ArgmaxScratch::new(dev, 1, 5000).expect("scratch");
    assert!(is_shape(gpu::argmax_rows(dev, &buf(12), 5, &mut argmax_out, &scratch)));
    assert!(is_shape(gpu::argmax_rows(dev, &buf(2 * 5000), 5000, &mut argmax_out, &scratch)), "scratch too small");
    let w = dev.alloc_zeros::<bf16>(64).expect("w");
    assert!(is_shape(gpu::gemv_bf16(dev, &buf(9 * 8), &w, 8, &mut buf(9 * 8))), "more rows than the GEMV takes");
    assert!(is_shape(gpu::gemv_bf16(dev, &buf(8), &w, 8, &mut buf(7))));
    let table = RopeTable::new(8, 10_000.0, &RopeScaling::None, RopeStyle::Neox).expect("table");
    let table_dev = CudaRopeTable::new(dev, &table, 4).expect("table upload");
    assert!(is_shape(gpu::rope(dev, &mut buf(12), 4, &ids, &table_dev)), "rotary dim beyond head_dim");
    assert!(is_shape(gpu::rope(dev, &mut buf(15), 8, &ids, &table_dev)), "rows not whole heads");
}

#[test]
fn second_open_reads_the_kernel_cache() {
    let Some(dev) = device() else { return };
    if dev.compile_report().cache_file.is_none() {
        say("SKIP kernel cache check: the cache directory is not writable here");
        return;
    }
    let again = CudaDevice::new(0).expect("second open");
    assert!(again.compile_report().cache_hit, "{:?}", again.compile_report());
}

/// Needs NVRTC only, not a GPU: compiles the kernels for Hopper wherever libnvrtc.so.13 can be found.
#[test]
fn kernels_compile_for_sm90_with_nvrtc_alone() {
    if let Err(e) = cuda::loader::ensure_loaded(&[cuda::loader::CudaLib::Nvrtc]) {
        say(&format!("SKIP NVRTC compile check: {e}"));
        return;
    }
    let dir = std::env::temp_dir().join(format!("dflash-cuda-compile-{}", std::process::id()));
    let compiled = cuda::compile::compile_cached_in(&dir, &cuda::program_source(), (9, 0), &cuda::COMPILE_OPTIONS)
        .expect("kernels compile");
    assert!(!compiled.report.cache_hit && compiled.cubin.len() > 1000, "{:?}", compiled.report);
    let again = cuda::compile::compile_cached_in(&dir, &cuda::program_source(), (9, 0), &cuda::COMPILE_OPTIONS)
        .expect("cached");
    assert!(again.report.cache_hit && again.cubin == compiled.cubin);
    say(&format!(
        "NVRTC: kernels compiled for sm_90 in {:.0} ms ({} bytes)",
        compiled.report.millis,
        compiled.cubin.len()
    ));
    let _ = std::fs::remove_dir_all(&dir);
}
