//! The matmuls of the CUDA model forward against their CPU twins, on fresh random inputs with odd sizes, outputs
//! set to NaN or (where they are added to) known values, and a write outside the output columns failing: the
//! quantized matmul (every format, row count, prologue and epilogue; each of its three kernels on every shape), the
//! f32 matmul for up to 32 rows, the bf16 GEMV with epilogues, the small tensor-core bf16 matmul (with the pre-norm
//! folded in from the sums of squares it leaves), and cuBLAS with strides and accumulation, and on TF32 tensor cores.
//! The quantized, f32 and small bf16 matmuls give each row the same bits alone as in a batch.
//!
//! Without a CUDA device every test prints a SKIP notice and passes. Tolerances are multiples of `Σ|w·x|` per
//! output (`err` = |gpu − cpu|), from `1e-6` for the f32 matmul against f64 sums to `2e-4` for the quantized matmul
//! with the RMSNorm prologue; each with its reason: docs/CUDA.md, "Parity tests".
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{bit_mismatches, check, cpu_rms_norm, device, f32_tensor, max_err_over, quant_matrix};
use common::Rng;

use dflash_runtime::cuda::ops::{self as gpu, Epilogue, FoldedNorm, MmvqArgs, QuantKernel, SmallGemmNorm};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf};
use dflash_runtime::ops as cpu;
use dflash_runtime::quant::{self, ActPrecision};
use dflash_runtime::{DType, Tensor};
use half::bf16;

/// `Σ_k |w[n, k] · x[r, k]|` for every output `[m, n]`: the scale of a dot product's rounding error.
fn abs_dot(w: &[f32], x: &[f32], n: usize, k: usize) -> Vec<f64> {
    let m = x.len() / k;
    let mut out = Vec::with_capacity(m * n);
    for r in 0..m {
        for j in 0..n {
            let s: f64 = (0..k).map(|i| (w[j * k + i] as f64 * x[r * k + i] as f64).abs()).sum();
            out.push(s.max(1e-30));
        }
    }
    out
}

/// The output buffer before a matmul: `[m, y_ld]` of NaN (poisoned), except that an `Add` epilogue starts
/// from `base(r, c)` in columns `0..n_out`.
fn y_start(epi: Epilogue, m: usize, n_out: usize, y_ld: usize, base: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * y_ld];
    if epi == Epilogue::Add {
        for r in 0..m {
            for c in 0..n_out {
                y[r * y_ld + c] = base(r, c);
            }
        }
    }
    y
}

#[test]
fn quantized_matmul_matches_cpu_for_every_format_rows_prologue_and_epilogue() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(21);
    let eps = 1e-5;
    let cases = [DType::Q4_0, DType::Q4_1, DType::Q8_0]
        .into_iter()
        .flat_map(|dtype| [ActPrecision::Int8, ActPrecision::Int8x2].map(|act| (dtype, act)));
    for (dtype, act) in cases {
        // (m, n_out, k): up to 16 rows one row per block (decode, verify widths), 24 two per block, 40 four or
        // eight (padded), odd output counts; from 128 rows the tensor-core kernel, with blocks per lane of 1 (k 576),
        // up to 2 (1536) and up to 3 (2112).
        let shapes = [
            (1, 37, 576),
            (3, 200, 96),
            (8, 64, 1536),
            (13, 129, 320),
            (8, 64, 64),
            (8, 64, 128),
            (24, 48, 576),
            (40, 33, 320),
            (128, 40, 576),
            (150, 33, 1536),
            (129, 17, 2112),
        ];
        for (m, n_out, k) in shapes {
            for epi in [Epilogue::Store, Epilogue::Add, Epilogue::Swiglu] {
                for normed in [false, true] {
                    let n = epi.weight_rows(n_out);
                    let (bytes, deq) = quant_matrix(&mut rng, dtype, n, k);
                    let mut w = gpu::QuantMatrix::upload(dev, dtype, &bytes, n, k).expect("upload");
                    w.act = act;
                    // x rows of stride k + 32 (a wider buffer), as the forward's residual is not.
                    let x_ld = k + 32;
                    let x = rng.vec(m * x_ld, 2.0);
                    let norm_w = rng.vec(k, 1.0);
                    let xs: Vec<f32> = x.chunks_exact(x_ld).flat_map(|r| r[..k].to_vec()).collect();
                    let x_in = if normed { cpu_rms_norm(&xs, &norm_w, eps) } else { xs };
                    let mut prod = vec![0f32; m * n];
                    quant::matmul_at(act, dtype, &bytes, n, k, &x_in, m, &mut prod);
                    let scale = abs_dot(&deq, &x_in, n, k);
                    let base = |r: usize, c: usize| ((r * n_out + c) % 7) as f32;
                    let (want, scale) = expected(epi, &prod, &scale, m, n_out, base);
                    // y rows of stride n_out + 5 (the tail must stay untouched); Add starts from known values.
                    let y_ld = n_out + 5;
                    let y_host = y_start(epi, m, n_out, y_ld, base);
                    let y = dev.upload(&y_host).expect("y");
                    let (x_dev, nw_dev) = (dev.upload(&x).expect("x"), dev.upload(&norm_w).expect("norm"));
                    let norm = normed.then(|| (nw_dev.view(), eps));
                    let args = MmvqArgs { x: x_dev.view(), x_ld, m, norm, y: y.view(), y_ld, epi, scratch: None };
                    gpu::mmvq(dev, &w, args).expect("mmvq");
                    let got_all = dev.download(&y).expect("download");
                    let got: Vec<f32> = got_all.chunks_exact(y_ld).flat_map(|r| r[..n_out].to_vec()).collect();
                    assert!(
                        got_all.chunks_exact(y_ld).all(|r| r[n_out..].iter().all(|v| v.is_nan())),
                        "wrote past n_out"
                    );
                    let tol = if normed { 2e-4 } else { 2e-5 };
                    let what = format!("mmvq {dtype} {act:?} {epi:?}{}", if normed { " +norm" } else { "" });
                    check(&what, &format!("{m}x{k} . {n}x{k}"), max_err_over(&got, &want, &scale), tol);
                    // Batch invariance: each row alone (the one-row kernel) gives the same bits.
                    let mut diff = 0.0;
                    for row in 0..m {
                        let y1 = dev.upload(&y_host[row * y_ld..]).expect("y1");
                        let x1 = x_dev.view().sub(row * x_ld, x_ld).expect("row");
                        let args = MmvqArgs { x: x1, x_ld, m: 1, norm, y: y1.view(), y_ld, epi, scratch: None };
                        gpu::mmvq(dev, &w, args).expect("mmvq one row");
                        let alone = dev.download(&y1).expect("download");
                        diff += bit_mismatches(&alone[..n_out], &got[row * n_out..(row + 1) * n_out]);
                    }
                    check(&format!("{what} rows alone"), &format!("{m} rows"), diff, 0.0);
                    // Every kernel gives the batch the same bits, whichever the rows would pick; the whole-tree
                    // kernel also on rows quantized once (the scratch's tail must stay untouched).
                    let pre_len = gpu::quantized_rows_bytes(m, k, act.passes());
                    let scratch = dev.upload(&vec![0xa5u8; pre_len + 64]).expect("scratch");
                    let splits = [1, 2].map(|s| (QuantKernel::MmqWarpSplit(s), true));
                    let kernels = [QuantKernel::Mmvq, QuantKernel::Mmq, QuantKernel::MmqWarp].map(|k| (k, false));
                    for (kernel, pre) in kernels.into_iter().chain([(QuantKernel::MmqWarp, true)]).chain(splits) {
                        let y_k = dev.upload(&y_host).expect("y");
                        let scratch = pre.then(|| scratch.view());
                        let args = MmvqArgs { x: x_dev.view(), x_ld, m, norm, y: y_k.view(), y_ld, epi, scratch };
                        gpu::mmvq_on(dev, &w, args, kernel).expect("mmvq on a named kernel");
                        let all = dev.download(&y_k).expect("download");
                        assert!(all.chunks_exact(y_ld).all(|r| r[n_out..].iter().all(|v| v.is_nan())), "{kernel:?}");
                        let mine: Vec<f32> = all.chunks_exact(y_ld).flat_map(|r| r[..n_out].to_vec()).collect();
                        let on = format!("{what} on {kernel:?}{}", if pre { " (rows quantized once)" } else { "" });
                        check(&on, &format!("{m} rows"), bit_mismatches(&mine, &got), 0.0);
                    }
                    let tail = dev.download(&scratch).expect("scratch");
                    assert!(tail[pre_len..].iter().all(|&b| b == 0xa5), "wrote past the quantized rows");
                }
            }
        }
    }
}

/// The CPU result of an epilogue over the matmul `prod` `[m, n]` and the error scale of each output
/// `[m, n_out]`. SwiGLU's error follows its inputs': |Δ| <= (|u| + 1)·Δg + (|g| + 1)·Δu.
fn expected(
    epi: Epilogue,
    prod: &[f32],
    scale: &[f64],
    m: usize,
    n_out: usize,
    base: impl Fn(usize, usize) -> f32,
) -> (Vec<f32>, Vec<f64>) {
    let n = epi.weight_rows(n_out);
    let at = |i: usize| (i / n_out, i % n_out);
    match epi {
        Epilogue::Store => ((0..m * n_out).map(|i| prod[i]).collect(), scale.to_vec()),
        Epilogue::Add => {
            let want = (0..m * n_out).map(|i| base(at(i).0, at(i).1) + prod[i]).collect();
            (want, scale.to_vec())
        }
        Epilogue::Swiglu => {
            let mut act = f32_tensor(&vec![0.0; m * n_out], &[m, n_out]);
            cpu::swiglu_fused(&f32_tensor(prod, &[m, n]), &mut act).expect("swiglu");
            let s = (0..m * n_out)
                .map(|i| {
                    let (r, c) = at(i);
                    let (g, u) = (prod[r * n + c] as f64, prod[r * n + n_out + c] as f64);
                    (u.abs() + 1.0) * scale[r * n + c] + (g.abs() + 1.0) * scale[r * n + n_out + c] + 1.0
                })
                .collect();
            (act.as_f32().expect("f32").to_vec(), s)
        }
    }
}

#[test]
fn f32_rows_matmul_matches_cpu_and_is_batch_invariant() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(23);
    // (m, n_out, k): odd widths; 1 and 8 rows are whole chunks of the kernel, 3 is not; 13, 16, 32 and 40 rows
    // take several chunks, the last of 13 partial.
    let shapes = [(1, 37, 100), (3, 64, 128), (8, 129, 576), (13, 40, 96), (16, 33, 200), (32, 20, 33), (40, 24, 64)];
    for (m, n_out, k) in shapes {
        for epi in [Epilogue::Store, Epilogue::Add, Epilogue::Swiglu] {
            let n = epi.weight_rows(n_out);
            let (w, x) = (rng.vec(n * k, 1.0), rng.vec(m * k, 2.0));
            let prod: Vec<f32> = (0..m * n)
                .map(|i| (0..k).map(|l| w[(i % n) * k + l] as f64 * x[(i / n) * k + l] as f64).sum::<f64>() as f32)
                .collect();
            let base = |r: usize, c: usize| ((r * n_out + c) % 5) as f32;
            let (want, scale) = expected(epi, &prod, &abs_dot(&w, &x, n, k), m, n_out, base);
            let y_ld = n_out + 3;
            let y_host = y_start(epi, m, n_out, y_ld, base);
            let (w_dev, x_dev, y) =
                (dev.upload(&w).expect("w"), dev.upload(&x).expect("x"), dev.upload(&y_host).expect("y"));
            gpu::gemm_f32_rows(dev, &w_dev, n_out, &x_dev, m, &y, y_ld, epi).expect("gemm_f32_rows");
            let got_all = dev.download(&y).expect("download");
            assert!(got_all.chunks_exact(y_ld).all(|r| r[n_out..].iter().all(|v| v.is_nan())), "wrote past n_out");
            let got: Vec<f32> = got_all.chunks_exact(y_ld).flat_map(|r| r[..n_out].to_vec()).collect();
            let what = format!("gemm_f32_rows {epi:?}");
            check(&what, &format!("{m}x{k} . {n}x{k}"), max_err_over(&got, &want, &scale), 1e-6);
            let mut diff = 0.0;
            for row in 0..m {
                let y1 = dev.upload(&y_host[row * y_ld..row * y_ld + n_out]).expect("y1");
                let x1 = x_dev.view().sub(row * k, k).expect("row");
                gpu::gemm_f32_rows(dev, &w_dev, n_out, x1, 1, &y1, n_out, epi).expect("one row");
                diff += bit_mismatches(&dev.download(&y1).expect("download"), &got[row * n_out..(row + 1) * n_out]);
            }
            check(&format!("{what} rows alone"), &format!("{m} rows"), diff, 0.0);
        }
    }
}

#[test]
fn bf16_gemv_epilogues_match_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(25);
    for (n_out, k) in [(37, 576), (1000, 4096), (5, 100)] {
        for epi in [Epilogue::Store, Epilogue::Add, Epilogue::Swiglu] {
            for normed in [false, true] {
                let n = epi.weight_rows(n_out);
                let w: Vec<bf16> = rng.vec(n * k, 1.0).into_iter().map(bf16::from_f32).collect();
                let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
                let (x, norm_w) = (rng.vec(k, 2.0), rng.vec(k, 1.0));
                let x_in = if normed { cpu_rms_norm(&x, &norm_w, 1e-5) } else { x.clone() };
                let bytes: Vec<u8> = w.iter().flat_map(|b| b.to_le_bytes()).collect();
                let w_t = Tensor::from_bytes(DType::BF16, &[n, k], &bytes).expect("w");
                let mut prod = f32_tensor(&vec![0.0; n], &[1, n]);
                cpu::matmul(&f32_tensor(&x_in, &[1, k]), &w_t, &mut prod).expect("cpu matmul");
                let base = |_: usize, c: usize| (c % 5) as f32;
                let scale = abs_dot(&wf, &x_in, n, k);
                let (want, scale) = expected(epi, prod.as_f32().expect("f32"), &scale, 1, n_out, base);
                let y_init: Vec<f32> =
                    (0..n_out).map(|c| if epi == Epilogue::Add { base(0, c) } else { f32::NAN }).collect();
                let (wd, xd) = (dev.upload(&w).expect("w"), dev.upload(&x).expect("x"));
                let nd = dev.upload(&norm_w).expect("norm");
                let norm = normed.then(|| (nd.view(), 1e-5));
                let y = dev.upload(&y_init).expect("y");
                gpu::gemv_bf16_ep(dev, &wd, n_out, &xd, norm, &y, epi).expect("gemv");
                let got = dev.download(&y).expect("download");
                // The norm's sum of squares is summed in another order: 1e-5 of each normalised input.
                let tol = if epi == Epilogue::Swiglu || normed { 3e-5 } else { 1e-5 };
                let what = format!("gemv_bf16_ep {epi:?}{}", if normed { " +norm" } else { "" });
                check(&what, &format!("1x{k} . {n}x{k}"), max_err_over(&got, &want, &scale), tol);
            }
        }
    }
}

/// The small tensor-core matmul on `m` rows: output `[m, y_ld]` with `y_init` below it.
fn small_gemm_on_device(
    dev: &CudaDevice,
    w: &DeviceBuf<bf16>,
    n_out: usize,
    x: &[f32],
    y_init: &[f32],
    y_ld: usize,
    epi: Epilogue,
) -> Vec<f32> {
    let m = y_init.len() / y_ld;
    let (xd, y) = (dev.upload(x).expect("x"), dev.upload(y_init).expect("y"));
    let none = SmallGemmNorm::default();
    gpu::gemm_bf16_small(dev, w, n_out, &xd, m, &y, y_ld, epi, none).expect("gemm_bf16_small");
    dev.download(&y).expect("download")
}

#[test]
fn small_bf16_matmul_matches_cpu_and_gives_each_row_the_same_bits_in_any_batch() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(26);
    // k = 104, 2056 and 136 end inside a 64-wide k-block (136 gives most warps nothing to do); n_out = 37, 5
    // and 8500 end inside a 16-column tile. 4096 x 4096 is too large to prefetch into the H200's L2 whole, so it
    // takes the kernels whose weight loads are hinted for a stream from DRAM; 5004 x 4096 (313 blocks: two to
    // three waves at two per SM on 132 SMs) the three-per-SM kernels for up to 16 rows (one and two row tiles), so
    // its rows alone must give the bits the 13-row (two tiles) and 32-row (two per SM) kernels give; so does
    // 3000 x 4096 with SwiGLU for up to 8 rows (375 blocks of 8 outputs).
    let shapes = [(37, 576), (1000, 4096), (16, 104), (5, 2056), (8500, 136), (4096, 4096), (5004, 4096), (3000, 4096)];
    for (n_out, k) in shapes {
        for epi in [Epilogue::Store, Epilogue::Add, Epilogue::Swiglu] {
            let n = epi.weight_rows(n_out);
            let w: Vec<bf16> = rng.vec(n * k, 1.0).into_iter().map(bf16::from_f32).collect();
            let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let bytes: Vec<u8> = w.iter().flat_map(|b| b.to_le_bytes()).collect();
            let w_t = Tensor::from_bytes(DType::BF16, &[n, k], &bytes).expect("w");
            let wd = dev.upload(&w).expect("w");
            // Stored outputs go to a wider row, as the fused q/k/v columns do.
            let y_ld = if epi == Epilogue::Store { n_out + 3 } else { n_out };
            let base = |r: usize, c: usize| ((r + c) % 5) as f32;
            for m in [1, 3, 8, 13, 32] {
                let x = rng.vec(m * k, 2.0);
                // The kernel rounds the activations to bf16; the CPU reference gets them rounded.
                let xr: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
                let mut prod = f32_tensor(&vec![0.0; m * n], &[m, n]);
                cpu::matmul(&f32_tensor(&xr, &[m, k]), &w_t, &mut prod).expect("cpu matmul");
                let scale = abs_dot(&wf, &xr, n, k);
                let (want, scale) = expected(epi, prod.as_f32().expect("f32"), &scale, m, n_out, base);
                let init = |rows: std::ops::Range<usize>| -> Vec<f32> {
                    rows.flat_map(|r| (0..y_ld).map(move |c| if epi == Epilogue::Add { base(r, c) } else { f32::NAN }))
                        .collect()
                };
                let got = small_gemm_on_device(dev, &wd, n_out, &x, &init(0..m), y_ld, epi);
                let cols: Vec<f32> = got.chunks_exact(y_ld).flat_map(|row| row[..n_out].to_vec()).collect();
                let tol = if epi == Epilogue::Swiglu { 3e-5 } else { 2e-5 };
                let shape = format!("{m}x{k} . {n}x{k}");
                check(&format!("gemm_bf16_small {epi:?}"), &shape, max_err_over(&cols, &want, &scale), tol);
                // Each row alone gives the bits it got inside the batch.
                let mut mismatches = 0.0;
                for r in 0..m {
                    let solo =
                        small_gemm_on_device(dev, &wd, n_out, &x[r * k..(r + 1) * k], &init(r..r + 1), y_ld, epi);
                    mismatches += bit_mismatches(&solo[..n_out], &got[r * y_ld..r * y_ld + n_out]);
                }
                check(&format!("gemm_bf16_small {epi:?} solo vs batch"), &shape, mismatches, 0.0);
            }
        }
    }
}

/// Device bf16 weights `[n, k]`, random in ±1, and their values.
fn bf16_matrix(dev: &CudaDevice, rng: &mut Rng, n: usize, k: usize) -> (DeviceBuf<bf16>, Vec<f32>) {
    let w: Vec<bf16> = rng.vec(n * k, 1.0).into_iter().map(bf16::from_f32).collect();
    (dev.upload(&w).expect("w"), w.iter().map(|v| v.to_f32()).collect())
}

/// A residual update and the folded pre-norm after it, on `m` rows: `res [m, h] += a · Wpᵀ`, leaving its sums
/// of squares, then `rms_norm(res) · nw` through `wc` with `epi`. Returns the residual, the sums of squares and
/// the consumer's output `[m, n_out]`.
#[allow(clippy::too_many_arguments)]
fn residual_then_folded_norm(
    dev: &CudaDevice,
    (wp, a, res): (&DeviceBuf<bf16>, &[f32], &[f32]),
    (wc, nw, n_out, epi): (&DeviceBuf<bf16>, &DeviceBuf<f32>, usize, Epilogue),
    h: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let m = res.len() / h;
    let slots = gpu::sum_sq_slots(h);
    let (ad, resd) = (dev.upload(a).expect("a"), dev.upload(res).expect("res"));
    let (ss, y) =
        (dev.upload(&vec![f32::NAN; m * slots]).expect("ss"), dev.upload(&vec![f32::NAN; m * n_out]).expect("y"));
    let out = SmallGemmNorm { fold: None, sum_sq_out: Some(ss.view()) };
    gpu::gemm_bf16_small(dev, wp, h, &ad, m, &resd, h, Epilogue::Add, out).expect("producer");
    let fold =
        SmallGemmNorm { fold: Some(FoldedNorm { w: nw.view(), sum_sq: ss.view(), eps: 1e-6 }), sum_sq_out: None };
    gpu::gemm_bf16_small(dev, wc, n_out, &resd, m, &y, n_out, epi, fold).expect("consumer");
    (dev.download(&resd).expect("res"), dev.download(&ss).expect("ss"), dev.download(&y).expect("y"))
}

#[test]
fn small_bf16_matmul_folds_the_pre_norm_from_the_sums_of_squares_it_leaves() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(27);
    // h = 1000 ends inside a 16-column slot and 136 inside a 64-wide k-block; 4096 is the Qwen3-8B shape's, and
    // 5004 outputs from it take the three-per-SM kernels for up to 16 rows (see the test above), as does the
    // 5120-wide residual's producer from 4096 (320 blocks: the Add epilogue leaving the sums of squares).
    for (h, kp, n_out) in [(1000, 576, 37), (4096, 64, 300), (136, 200, 16), (4096, 64, 5004), (5120, 4096, 300)] {
        let (wp, _) = bf16_matrix(dev, &mut rng, h, kp);
        let nw_host: Vec<f32> = rng.vec(h, 0.5).iter().map(|v| v + 1.0).collect();
        let nw = dev.upload(&nw_host).expect("nw");
        for epi in [Epilogue::Store, Epilogue::Swiglu] {
            let n = epi.weight_rows(n_out);
            let (wc, wcf) = bf16_matrix(dev, &mut rng, n, h);
            for m in [1, 5, 13, 32] {
                let (a, res0) = (rng.vec(m * kp, 1.0), rng.vec(m * h, 2.0));
                let (res, ss, got) = residual_then_folded_norm(dev, (&wp, &a, &res0), (&wc, &nw, n_out, epi), h);
                let shape = format!("{m}x{h} . {n}x{h}");
                // Each slot: the sum of squares of its 16 columns of the updated residual.
                let slots = gpu::sum_sq_slots(h);
                let mut ss_err = 0f64;
                for r in 0..m {
                    for j in 0..slots {
                        let cols = 16 * j..(16 * j + 16).min(h);
                        let want: f64 = cols.map(|c| (res[r * h + c] as f64).powi(2)).sum();
                        ss_err = ss_err.max((ss[r * slots + j] as f64 - want).abs() / want.max(1e-30));
                    }
                }
                check("gemm_bf16_small sums of squares", &shape, ss_err, 1e-5);
                // The consumer: inv · Σ w · bf16(res · nw), against 1 / rms in f64.
                let xr: Vec<f32> =
                    res.iter().enumerate().map(|(i, &v)| bf16::from_f32(v * nw_host[i % h]).to_f32()).collect();
                let mut prod = f32_tensor(&vec![0.0; m * n], &[m, n]);
                cpu::matmul(&f32_tensor(&xr, &[m, h]), &f32_tensor(&wcf, &[n, h]), &mut prod).expect("cpu matmul");
                let mut prod = prod.as_f32().expect("f32").to_vec();
                let mut scale = abs_dot(&wcf, &xr, n, h);
                for r in 0..m {
                    let mean: f64 = res[r * h..(r + 1) * h].iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h as f64;
                    let inv = 1.0 / (mean + 1e-6).sqrt();
                    prod[r * n..(r + 1) * n].iter_mut().for_each(|p| *p = (*p as f64 * inv) as f32);
                    scale[r * n..(r + 1) * n].iter_mut().for_each(|s| *s *= inv);
                }
                let (want, scale) = expected(epi, &prod, &scale, m, n_out, |_, _| 0.0);
                check(&format!("gemm_bf16_small folded norm {epi:?}"), &shape, max_err_over(&got, &want, &scale), 3e-5);
                // Each row alone leaves and takes the bits it did inside the batch.
                let mut mismatches = 0.0;
                for r in 0..m {
                    let (row_a, row_res) = (&a[r * kp..(r + 1) * kp], &res0[r * h..(r + 1) * h]);
                    let (_, s1, y1) = residual_then_folded_norm(dev, (&wp, row_a, row_res), (&wc, &nw, n_out, epi), h);
                    mismatches += bit_mismatches(&s1, &ss[r * slots..(r + 1) * slots]);
                    mismatches += bit_mismatches(&y1, &got[r * n_out..(r + 1) * n_out]);
                }
                check(&format!("gemm_bf16_small folded norm {epi:?} solo vs batch"), &shape, mismatches, 0.0);
            }
        }
    }
}

#[test]
fn cublas_gemm_with_row_stride_and_accumulation_matches_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(26);
    let (m, n, k, ld, col) = (7, 300, 576, 320, 11);
    let (w, x) = (rng.vec(n * k, 1.0), rng.vec(m * k, 2.0));
    let y0 = rng.vec(m * ld, 3.0);
    for (bf16_operands, accumulate) in [(false, false), (false, true), (true, false), (true, true)] {
        let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect() };
        let (wr, xr) = if bf16_operands { (round(&w), round(&x)) } else { (w.clone(), x.clone()) };
        let mut prod = f32_tensor(&vec![0.0; m * n], &[m, n]);
        cpu::matmul(&f32_tensor(&xr, &[m, k]), &f32_tensor(&wr, &[n, k]), &mut prod).expect("cpu");
        let prod = prod.as_f32().expect("f32");
        let mut want = y0.clone();
        for r in 0..m {
            for c in 0..n {
                let base = if accumulate { y0[r * ld + col + c] } else { 0.0 };
                want[r * ld + col + c] = base + prod[r * n + c];
            }
        }
        let y = dev.upload(&y0).expect("y");
        let y_view = y.view().sub(col, m * ld - col).expect("columns");
        if bf16_operands {
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let (wd, xd) = (dev.upload(&wb).expect("w"), dev.upload(&xb).expect("x"));
            gpu::gemm(dev, gpu::GemmArgs::bf16(wd.view(), n, k, xd.view(), m, y_view, ld, accumulate)).expect("gemm");
            dev.synchronize().expect("sync");
        } else {
            let (wd, xd) = (dev.upload(&w).expect("w"), dev.upload(&x).expect("x"));
            gpu::gemm(dev, gpu::GemmArgs::f32(wd.view(), n, k, xd.view(), m, y_view, ld, accumulate)).expect("gemm");
            dev.synchronize().expect("sync");
        }
        let got = dev.download(&y).expect("download");
        let mut scale = vec![1.0; m * ld];
        let sums = abs_dot(&wr, &xr, n, k);
        for r in 0..m {
            for c in 0..n {
                scale[r * ld + col + c] = sums[r * n + c];
            }
        }
        let tol = if bf16_operands { 1e-4 } else { 1e-5 };
        let what =
            format!("gemm {}{}", if bf16_operands { "bf16" } else { "f32" }, if accumulate { " +=" } else { "" });
        check(&what, &format!("{m}x{k} . {n}x{k}, ld {ld} col {col}"), max_err_over(&got, &want, &scale), tol);
    }
}

/// A gemm on TF32 tensor cores (a drafter's many-row passes under `DFLASH_DRAFT_TF32=1`) stays within TF32's
/// rounding of the CPU's f32 product (each operand keeps a 10-bit mantissa: about 1e-3 of a product, less of a sum
/// of products of random signs) and is not the full-f32 gemm's result (the switch does something).
#[test]
fn cublas_gemm_on_tf32_stays_within_its_rounding_of_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(27);
    let (m, n, k) = (128, 512, 1024);
    let (w, x) = (rng.vec(n * k, 1.0), rng.vec(m * k, 2.0));
    let mut prod = f32_tensor(&vec![0.0; m * n], &[m, n]);
    cpu::matmul(&f32_tensor(&x, &[m, k]), &f32_tensor(&w, &[n, k]), &mut prod).expect("cpu");
    let (wd, xd) = (dev.upload(&w).expect("w"), dev.upload(&x).expect("x"));
    let run = |tf32: bool| {
        let y = dev.upload(&vec![0.0f32; m * n]).expect("y");
        let args = gpu::GemmArgs::f32(wd.view(), n, k, xd.view(), m, y.view(), n, false);
        gpu::gemm(dev, if tf32 { args.tf32() } else { args }).expect("gemm");
        dev.download(&y).expect("download")
    };
    let (tf32, full) = (run(true), run(false));
    let scale = abs_dot(&w, &x, n, k);
    check(
        "gemm f32 on tf32",
        &format!("{m}x{k} . {n}x{k}"),
        max_err_over(&tf32, prod.as_f32().expect("f32"), &scale),
        2e-3,
    );
    assert!(bit_mismatches(&tf32, &full) > 0.0, "the TF32 gemm gave the full-f32 gemm's bits: TF32 was not used");
}
