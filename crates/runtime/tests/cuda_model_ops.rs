//! The fused kernels of the CUDA model forward against their CPU twins, on fresh random inputs with odd
//! sizes and outputs poisoned with NaN: the quantized matmul (every format, row count, prologue and
//! epilogue), the quantized embedding, RoPE + KV write, paged attention (prompt and split-key modes,
//! GQA, shuffled pages, head_dim up to 256; the tensor-core prompt kernel within bf16 rounding), the bf16 GEMV with epilogues, the small tensor-core bf16
//! matmul (each row's bits the same in any batch), cuBLAS with strides and accumulation, the gathered final
//! norm, the capture copy, and a CUDA graph replayed with new inputs.
//!
//! Without a CUDA device every test prints a SKIP notice and passes. Tolerances (`err` = |gpu − cpu|):
//! * exact: the quantized embedding (same dequantization arithmetic), q and K/V from RoPE + KV write
//!   without a head norm, the capture copy;
//! * quantized matmul `err <= 2e-5 · Σ|w·x|` per output with plain input: activations quantize to the
//!   same bytes as on the CPU and each block's term rounds the same, only the order of the block sums
//!   differs; with the RMSNorm prologue `2e-4 · Σ|w·x|`: the norm's sum of squares is summed in another
//!   order, which can move an activation across a rounding boundary of its 8-bit quantization
//!   (one quant step of one element is about 1/127 of its block's largest value);
//! * attention `2e-5` absolute against an f64 reference (outputs are averages of values in [-1, 1]);
//!   split-key rows bit-identical however they are batched;
//! * bf16 GEMV `1e-5 · Σ|w·x|`, the small tensor-core matmul `2e-5 · Σ|w·x|` against bf16-rounded x, cuBLAS
//!   `1e-4 · Σ|w·x|` (bf16-rounded x on both sides), as in cuda_parity;
//!   SwiGLU epilogues add the 2e-5 of the SwiGLU kernel; norms `1e-5 · max(1, |cpu|)`.
#![cfg(feature = "cuda")]

mod common;

use common::{say, Rng};
use std::sync::OnceLock;

use dflash_runtime::cuda::ops::{self as gpu, AttentionArgs, AttentionScratch, Epilogue, KeySplit, MmvqArgs};
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf};
use dflash_runtime::ops::{self as cpu, RopeScaling, RopeStyle, RopeTable};
use dflash_runtime::quant::{self, ActPrecision};
use dflash_runtime::{DType, Tensor};
use half::bf16;

fn device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Option<CudaDevice>> = OnceLock::new();
    DEVICE
        .get_or_init(|| match CudaDevice::new(0) {
            Ok(dev) => {
                say(&format!("{:<34} {:<30} {:>11} {:>11}", "kernel", "shape", "max err", "tolerance"));
                Some(dev)
            }
            Err(e) => {
                say(&format!("SKIP cuda model-op tests: no usable CUDA device ({e})"));
                None
            }
        })
        .as_ref()
}

fn check(kernel: &str, shape: &str, max_err: f64, tol: f64) {
    say(&format!("{kernel:<34} {shape:<30} {max_err:>11.3e} {tol:>11.1e}"));
    assert!(max_err <= tol, "{kernel} {shape}: max error {max_err:e} over tolerance {tol:e}");
}

fn poisoned(dev: &CudaDevice, len: usize) -> DeviceBuf<f32> {
    dev.upload(&vec![f32::NAN; len]).expect("poisoned output")
}

/// Largest `|got − want| / scale[i]`; NaN anywhere counts as infinite.
fn max_err_over(got: &[f32], want: &[f32], scale: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((&g, &w), &s)| if g.is_nan() || w.is_nan() { f64::INFINITY } else { (g as f64 - w as f64).abs() / s })
        .fold(0.0, f64::max)
}

fn bit_mismatches(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count() as f64
}

fn f32_tensor(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_f32(v, shape).expect("f32 tensor")
}

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

fn cpu_rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let (k, m) = (w.len(), x.len() / w.len());
    let mut out = f32_tensor(&vec![0.0; x.len()], &[m, k]);
    cpu::rms_norm(&f32_tensor(x, &[m, k]), &f32_tensor(w, &[k]), eps, &mut out).expect("cpu rms_norm");
    out.as_f32().expect("f32").to_vec()
}

/// A random ggml matrix of `dtype` (through the reference quantizer) and its dequantized values.
fn quant_matrix(rng: &mut Rng, dtype: DType, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let values = rng.vec(n * k, 1.0);
    let mut bytes = vec![0u8; n * dtype.bytes_for(k).expect("whole blocks")];
    let row = bytes.len() / n;
    for (src, dst) in values.chunks_exact(k).zip(bytes.chunks_exact_mut(row)) {
        quant::quantize_row(dtype, src, dst);
    }
    let mut deq = vec![0f32; n * k];
    for (src, dst) in bytes.chunks_exact(row).zip(deq.chunks_exact_mut(k)) {
        quant::dequantize_row(dtype, src, dst);
    }
    (bytes, deq)
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
        // (m, n_out, k): one row (decode), 3 (padded to 4), 8, 13 (two chunks of 8), odd output counts.
        for (m, n_out, k) in [(1, 37, 576), (3, 200, 96), (8, 64, 1536), (13, 129, 320), (8, 64, 64), (8, 64, 128)] {
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
                    let mut y_host = vec![f32::NAN; m * y_ld];
                    if epi == Epilogue::Add {
                        for r in 0..m {
                            for c in 0..n_out {
                                y_host[r * y_ld + c] = base(r, c);
                            }
                        }
                    }
                    let y = dev.upload(&y_host).expect("y");
                    let (x_dev, nw_dev) = (dev.upload(&x).expect("x"), dev.upload(&norm_w).expect("norm"));
                    let norm = normed.then(|| (nw_dev.view(), eps));
                    let args = MmvqArgs { x: x_dev.view(), x_ld, m, norm, y: y.view(), y_ld, epi };
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
                        let args = MmvqArgs { x: x1, x_ld, m: 1, norm, y: y1.view(), y_ld, epi };
                        gpu::mmvq(dev, &w, args).expect("mmvq one row");
                        let alone = dev.download(&y1).expect("download");
                        diff += bit_mismatches(&alone[..n_out], &got[row * n_out..(row + 1) * n_out]);
                    }
                    check(&format!("{what} rows alone"), &format!("{m} rows"), diff, 0.0);
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
    // (m, n_out, k): odd widths, up to the 32 rows the kernel serves.
    for (m, n_out, k) in [(1, 37, 100), (3, 64, 128), (8, 129, 576), (32, 20, 33)] {
        for epi in [Epilogue::Store, Epilogue::Add, Epilogue::Swiglu] {
            let n = epi.weight_rows(n_out);
            let (w, x) = (rng.vec(n * k, 1.0), rng.vec(m * k, 2.0));
            let prod: Vec<f32> = (0..m * n)
                .map(|i| (0..k).map(|l| w[(i % n) * k + l] as f64 * x[(i / n) * k + l] as f64).sum::<f64>() as f32)
                .collect();
            let base = |r: usize, c: usize| ((r * n_out + c) % 5) as f32;
            let (want, scale) = expected(epi, &prod, &abs_dot(&w, &x, n, k), m, n_out, base);
            let y_ld = n_out + 3;
            let mut y_host = vec![f32::NAN; m * y_ld];
            if epi == Epilogue::Add {
                for r in 0..m {
                    for c in 0..n_out {
                        y_host[r * y_ld + c] = base(r, c);
                    }
                }
            }
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
fn quantized_embedding_dequantizes_exactly() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(22);
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        let (vocab, hidden) = (300, 576);
        let (bytes, deq) = quant_matrix(&mut rng, dtype, vocab, hidden);
        let table = gpu::QuantMatrix::upload(dev, dtype, &bytes, vocab, hidden).expect("upload");
        let mut ids: Vec<u32> = (0..23).map(|_| rng.below(vocab) as u32).collect();
        ids[0] = vocab as u32 - 1;
        ids.push(vocab as u32); // past the table: NaN row
        let out = poisoned(dev, ids.len() * hidden);
        gpu::embedding_quant(dev, &table, &dev.upload(&ids).expect("ids"), &out).expect("embedding_quant");
        let got = dev.download(&out).expect("download");
        let n = ids.len() - 1;
        let want: Vec<f32> = ids[..n].iter().flat_map(|&id| deq[id as usize * hidden..][..hidden].to_vec()).collect();
        check(&format!("embedding_quant {dtype}"), "300x576, 23 ids", bit_mismatches(&got[..n * hidden], &want), 0.0);
        assert!(got[n * hidden..].iter().all(|v| v.is_nan()), "an id past the table gives NaN");
    }
}

#[test]
fn rope_kv_write_matches_cpu_norm_rope_and_kv_write() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(23);
    let eps = 1e-6;
    // (style, heads, kv heads, head_dim, rotary dims, head norm)
    let cases = [
        (RopeStyle::Interleaved, 9, 3, 64, 64, false),
        (RopeStyle::Neox, 4, 2, 32, 32, true),
        (RopeStyle::Neox, 8, 2, 128, 64, false),
        // Qwen3-Next-80B's attention heads: head norm, rotary over a quarter of 256 dims.
        (RopeStyle::Neox, 16, 2, 256, 64, true),
    ];
    for (style, nh, kvh, d, rot, head_norm) in cases {
        let (rows, pages, ps) = (11, 6, 4);
        let table = RopeTable::new(rot, 10_000.0, &RopeScaling::None, style).expect("table");
        let rope = CudaRopeTable::new(dev, &table, 512).expect("rope table");
        let (qw, kw) = (nh * d, kvh * d);
        let qkv_ld = qw + 2 * kw + 3;
        let qkv = rng.vec(rows * qkv_ld, 2.0);
        let positions: Vec<u32> = (0..rows).map(|_| rng.below(512) as u32).collect();
        let mut slots: Vec<u32> = (0..(pages * ps) as u32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.below(i + 1));
        }
        slots.truncate(rows);
        let (qn, kn) = (rng.vec(d, 1.0), rng.vec(d, 1.0));
        // CPU: split, head norm, rope, kv_write.
        let part = |off: usize, w: usize| -> Vec<f32> {
            qkv.chunks_exact(qkv_ld).flat_map(|r| r[off..off + w].to_vec()).collect()
        };
        let (mut q, mut k, v) =
            (f32_tensor(&part(0, qw), &[rows, qw]), f32_tensor(&part(qw, kw), &[rows, kw]), part(qw + kw, kw));
        if head_norm {
            cpu::head_rms_norm(&mut q, d, &f32_tensor(&qn, &[d]), eps).expect("q norm");
            cpu::head_rms_norm(&mut k, d, &f32_tensor(&kn, &[d]), eps).expect("k norm");
        }
        cpu::rope(&mut q, d, &positions, &table).expect("rope q");
        cpu::rope(&mut k, d, &positions, &table).expect("rope k");
        let shape = [pages, ps, kvh, d];
        let (mut kc, mut vc) =
            (Tensor::zeros(DType::F32, &shape).expect("k"), Tensor::zeros(DType::F32, &shape).expect("v"));
        cpu::kv_write(&mut kc, &mut vc, &k, &f32_tensor(&v, &[rows, kw]), &slots).expect("kv_write");
        // GPU, caches poisoned: unwritten slots must stay NaN.
        let (qkv_dev, q_out) = (dev.upload(&qkv).expect("qkv"), poisoned(dev, rows * qw));
        let (k_dev, v_dev) = (poisoned(dev, pages * ps * kw), poisoned(dev, pages * ps * kw));
        let (pos_dev, slots_dev) = (dev.upload(&positions).expect("pos"), dev.upload(&slots).expect("slots"));
        let (qn_dev, kn_dev) = (dev.upload(&qn).expect("qn"), dev.upload(&kn).expect("kn"));
        let args = gpu::RopeKvArgs {
            qkv: qkv_dev.view(),
            qkv_ld,
            q_out: q_out.view(),
            k_cache: k_dev.view(),
            v_cache: v_dev.view(),
            positions: pos_dev.view(),
            slots: slots_dev.view(),
            rope: &rope,
            q_norm: head_norm.then(|| qn_dev.view()),
            k_norm: head_norm.then(|| kn_dev.view()),
            eps,
            num_heads: nh,
            kv_heads: kvh,
            head_dim: d,
        };
        gpu::rope_kv_write(dev, args).expect("rope_kv_write");
        let (got_q, got_k, got_v) =
            (dev.download(&q_out).expect("q"), dev.download(&k_dev).expect("k"), dev.download(&v_dev).expect("v"));
        let written = |cache: &[f32]| -> Vec<f32> {
            slots.iter().flat_map(|&s| cache[s as usize * kw..][..kw].to_vec()).collect()
        };
        let (want_k, want_v) = (written(kc.as_f32().expect("k")), written(vc.as_f32().expect("v")));
        let shape = format!("{rows} rows, {nh}/{kvh} heads of {d}, rot {rot}");
        let name = format!("rope_kv_write {style:?}{}", if head_norm { " +norm" } else { "" });
        if head_norm {
            let ones = vec![1.0; rows * qw];
            check(&format!("{name} q"), &shape, max_err_over(&got_q, q.as_f32().expect("q"), &ones), 1e-5);
            let ones = vec![1.0; want_k.len()];
            check(&format!("{name} k"), &shape, max_err_over(&written(&got_k), &want_k, &ones), 1e-5);
        } else {
            check(&format!("{name} q"), &shape, bit_mismatches(&got_q, q.as_f32().expect("q")), 0.0);
            check(&format!("{name} k"), &shape, bit_mismatches(&written(&got_k), &want_k), 0.0);
        }
        check(&format!("{name} v"), &shape, bit_mismatches(&written(&got_v), &want_v), 0.0);
        let unwritten = (0..pages * ps).filter(|s| !slots.contains(&(*s as u32)));
        assert!(
            unwritten.into_iter().all(|s| got_k[s * kw..][..kw].iter().all(|x| x.is_nan())),
            "wrote an unnamed slot"
        );
    }
}

/// A batch for the attention tests: sequences of (context before the rows, rows, prompt rows).
struct AttnCase {
    seqs: Vec<(usize, usize, usize)>,
    nh: usize,
    kvh: usize,
    d: usize,
    ps: usize,
}

/// Reference attention in f64: row j of a sequence attends keys 0 ..= context + j.
fn attention_reference(case: &AttnCase, q: &[f32], kc: &[f32], vc: &[f32], tables: &[Vec<u32>]) -> Vec<f32> {
    let (nh, kvh, d, ps) = (case.nh, case.kvh, case.d, case.ps);
    let group = nh / kvh;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = Vec::new();
    let mut t = 0;
    for (s, &(ctx, rows, _)) in case.seqs.iter().enumerate() {
        let slot = |key: usize| tables[s][key / ps] as usize * ps + key % ps;
        for j in 0..rows {
            let keys = ctx + j + 1;
            for h in 0..nh {
                let qv = &q[(t * nh + h) * d..][..d];
                let at = |c: &[f32], key: usize, i: usize| c[(slot(key) * kvh + h / group) * d + i] as f64;
                let scores: Vec<f64> =
                    (0..keys).map(|key| (0..d).map(|i| qv[i] as f64 * at(kc, key, i)).sum::<f64>() * scale).collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let total: f64 = w.iter().sum();
                out.extend((0..d).map(|i| ((0..keys).map(|key| w[key] * at(vc, key, i)).sum::<f64>() / total) as f32));
            }
            t += 1;
        }
    }
    out
}

/// The device inputs of an attention case, as the model's planner lays them out.
struct AttnInputs {
    row_keys: Vec<u32>,
    prompt_tiles: Vec<u32>,
    decode_tiles: Vec<u32>,
    partial_rows: Vec<u32>,
    max_prompt_rows: usize,
    max_decode_rows: usize,
    max_keys: usize,
}

fn attention_inputs(case: &AttnCase, only_seq: Option<usize>) -> AttnInputs {
    let tile_rows = gpu::ATTN_MAX_QUERIES / (case.nh / case.kvh);
    let mut a = AttnInputs {
        row_keys: Vec::new(),
        prompt_tiles: Vec::new(),
        decode_tiles: Vec::new(),
        partial_rows: Vec::new(),
        max_prompt_rows: 0,
        max_decode_rows: 0,
        max_keys: 0,
    };
    for (s, &(ctx, rows, prompt)) in case.seqs.iter().enumerate() {
        let first = a.row_keys.len();
        a.row_keys.extend((0..rows).map(|j| (ctx + j + 1) as u32));
        if only_seq.is_some_and(|o| o != s) {
            continue;
        }
        for (start, n, decode) in [(first, prompt, false), (first + prompt, rows - prompt, true)] {
            let mut r = start;
            while r < start + n {
                let m = tile_rows.min(start + n - r);
                if decode {
                    a.decode_tiles.extend([s as u32, r as u32, m as u32, a.partial_rows.len() as u32]);
                    a.partial_rows.extend((r..r + m).map(|x| x as u32));
                    a.max_decode_rows = a.max_decode_rows.max(m);
                    a.max_keys = a.max_keys.max(a.row_keys[r + m - 1] as usize);
                } else {
                    a.prompt_tiles.extend([s as u32, r as u32, m as u32, 0]);
                    a.max_prompt_rows = a.max_prompt_rows.max(m);
                }
                r += m;
            }
        }
    }
    a
}

/// Runs both attention modes of `inputs` on the device; returns the output buffer.
#[allow(clippy::too_many_arguments)]
fn attention_on_device(
    dev: &CudaDevice,
    case: &AttnCase,
    inputs: &AttnInputs,
    q: &DeviceBuf<f32>,
    caches: (&DeviceBuf<f32>, &DeviceBuf<f32>),
    tables: (&DeviceBuf<u32>, usize),
    out: &DeviceBuf<f32>,
    max_splits: usize,
) {
    let up = |v: &[u32]| dev.upload(if v.is_empty() { &[0u32][..] } else { v }).expect("upload");
    let (row_keys, pt, dt) = (up(&inputs.row_keys), up(&inputs.prompt_tiles), up(&inputs.decode_tiles));
    let partial_rows = inputs.partial_rows.len();
    let scratch = AttentionScratch::new(dev, partial_rows, case.nh, case.d, max_splits).expect("scratch");
    let args = |tiles, rows, split| AttentionArgs {
        q: q.view(),
        k_cache: caches.0.view(),
        v_cache: caches.1.view(),
        row_keys: row_keys.view(),
        tiles,
        max_tile_rows: rows,
        tables: tables.0.view(),
        table_stride: tables.1,
        page_size: case.ps,
        out: out.view(),
        num_heads: case.nh,
        kv_heads: case.kvh,
        head_dim: case.d,
        scale: 1.0 / (case.d as f32).sqrt(),
        split,
    };
    if !inputs.prompt_tiles.is_empty() {
        gpu::paged_attention(dev, args(pt.view(), inputs.max_prompt_rows, KeySplit::Whole), &scratch).expect("prompt");
    }
    if !inputs.decode_tiles.is_empty() {
        let split = KeySplit::Fixed { keys: 64, max_splits, partial_rows };
        gpu::paged_attention(dev, args(dt.view(), inputs.max_decode_rows, split), &scratch).expect("decode");
    }
}

#[test]
fn paged_attention_matches_reference_and_is_batch_invariant() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(24);
    let cases = [
        // SmolLM2's heads: a prompt, a decode row, a 5-row verify, a chunk of 4 prompt + 8 decode rows.
        AttnCase { seqs: vec![(0, 37, 37), (50, 1, 0), (530, 5, 0), (10, 12, 4)], nh: 9, kvh: 3, d: 64, ps: 16 },
        // Llama-3-8B's heads (16 rows per tile): a long verify and a prompt longer than a tile.
        AttnCase { seqs: vec![(300, 16, 0), (0, 20, 20), (64, 1, 0)], nh: 8, kvh: 2, d: 128, ps: 4 },
        // Tiny heads, an odd page size.
        AttnCase { seqs: vec![(7, 3, 1), (0, 2, 2)], nh: 4, kvh: 2, d: 16, ps: 3 },
        // Qwen3-Next-80B's attention heads (the head_dim 256 kernel, 2 rows per tile): an odd prompt, a decode
        // row over 201 keys (4 splits), an odd verify, and a chunk of 4 prompt rows over 2 key chunks + 5 decode
        // rows.
        AttnCase { seqs: vec![(0, 13, 13), (200, 1, 0), (93, 3, 0), (45, 9, 4)], nh: 16, kvh: 2, d: 256, ps: 16 },
        // Just over 128 (the head_dim 256 kernel with dims left over in each lane's last slot), odd pages.
        AttnCase { seqs: vec![(0, 5, 5), (70, 3, 0), (17, 4, 2)], nh: 6, kvh: 3, d: 132, ps: 5 },
    ];
    for case in cases {
        let (nh, kvh, d, ps) = (case.nh, case.kvh, case.d, case.ps);
        let need: Vec<usize> = case.seqs.iter().map(|&(c, r, _)| (c + r).div_ceil(ps)).collect();
        let num_pages = need.iter().sum::<usize>() + 3;
        let mut pages: Vec<u32> = (0..num_pages as u32).collect();
        for i in (1..pages.len()).rev() {
            pages.swap(i, rng.below(i + 1));
        }
        let stride = need.iter().max().copied().unwrap_or(1) + 1;
        let mut tables = Vec::new();
        let mut next = 0;
        for &n in &need {
            tables.push(pages[next..next + n].to_vec());
            next += n;
        }
        let flat: Vec<u32> = tables
            .iter()
            .flat_map(|t| t.iter().copied().chain(std::iter::repeat_n(num_pages as u32, stride - t.len())))
            .collect();
        let t: usize = case.seqs.iter().map(|s| s.1).sum();
        let cache_len = num_pages * ps * kvh * d;
        let (q, kc, vc) = (rng.vec(t * nh * d, 1.0), rng.vec(cache_len, 1.0), rng.vec(cache_len, 1.0));
        let want = attention_reference(&case, &q, &kc, &vc, &tables);
        let (q_dev, k_dev, v_dev) =
            (dev.upload(&q).expect("q"), dev.upload(&kc).expect("k"), dev.upload(&vc).expect("v"));
        let tables_dev = dev.upload(&flat).expect("tables");
        let inputs = attention_inputs(&case, None);
        let splits = inputs.max_keys.div_ceil(64).max(1);
        let out = poisoned(dev, t * nh * d);
        attention_on_device(dev, &case, &inputs, &q_dev, (&k_dev, &v_dev), (&tables_dev, stride), &out, splits);
        let got = dev.download(&out).expect("download");
        let shape = format!("{t} rows, {nh}/{kvh} heads of {d}, pages of {ps}");
        check("paged_attention", &shape, max_err_over(&got, &want, &vec![1.0; want.len()]), 2e-5);
        // Each sequence's decode rows alone, with more split blocks than needed: the same bits.
        for s in 0..case.seqs.len() {
            let alone = attention_inputs(&case, Some(s));
            if alone.decode_tiles.is_empty() {
                continue;
            }
            let out2 = poisoned(dev, t * nh * d);
            attention_on_device(dev, &case, &alone, &q_dev, (&k_dev, &v_dev), (&tables_dev, stride), &out2, splits + 3);
            let got2 = dev.download(&out2).expect("download");
            let row_len = nh * d;
            let diff: f64 = alone
                .partial_rows
                .iter()
                .map(|&r| {
                    bit_mismatches(&got2[r as usize * row_len..][..row_len], &got[r as usize * row_len..][..row_len])
                })
                .sum();
            check("paged_attention decode rows alone", &format!("seq {s} of {shape}"), diff, 0.0);
        }
    }
}

#[test]
fn tensor_core_prompt_attention_matches_reference_within_bf16_rounding() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(25);
    let cases = [
        // Qwen3-8B's grouping: a 200-row prompt (tiles of 64 and a short one), a chunk of 70 rows after 37 keys.
        AttnCase { seqs: vec![(0, 200, 200), (37, 70, 70)], nh: 8, kvh: 2, d: 128, ps: 16 },
        // SmolLM2's heads, odd pages, a chunk shorter than a warp's 16 rows.
        AttnCase { seqs: vec![(0, 130, 130), (10, 5, 5)], nh: 9, kvh: 3, d: 64, ps: 5 },
    ];
    for case in cases {
        let (nh, kvh, d, ps) = (case.nh, case.kvh, case.d, case.ps);
        let mut pages: Vec<u32> = Vec::new();
        let mut tables: Vec<Vec<u32>> = Vec::new();
        for &(ctx, rows, _) in &case.seqs {
            let n = (ctx + rows).div_ceil(ps);
            tables.push((pages.len() as u32..(pages.len() + n) as u32).rev().collect());
            pages.extend(0..n as u32);
        }
        let (num_pages, stride) = (pages.len(), tables.iter().map(Vec::len).max().unwrap_or(1));
        let flat: Vec<u32> = tables
            .iter()
            .flat_map(|t| t.iter().copied().chain(std::iter::repeat_n(num_pages as u32, stride - t.len())))
            .collect();
        let (mut row_keys, mut tiles) = (Vec::new(), Vec::new());
        for (s, &(ctx, rows, _)) in case.seqs.iter().enumerate() {
            for start in (0..rows).step_by(gpu::TC_ATTN_TILE_ROWS) {
                let n = gpu::TC_ATTN_TILE_ROWS.min(rows - start);
                tiles.extend([s as u32, (row_keys.len() + start) as u32, n as u32, 0]);
            }
            row_keys.extend((0..rows).map(|j| (ctx + j + 1) as u32));
        }
        let t = row_keys.len();
        let cache_len = num_pages * ps * kvh * d;
        let (q, kc, vc) = (rng.vec(t * nh * d, 1.0), rng.vec(cache_len, 1.0), rng.vec(cache_len, 1.0));
        let want = attention_reference(&case, &q, &kc, &vc, &tables);
        let up = |v: &[f32]| dev.upload(v).expect("upload");
        let (q_dev, k_dev, v_dev, out) = (up(&q), up(&kc), up(&vc), poisoned(dev, t * nh * d));
        let (keys_dev, tiles_dev, tables_dev) =
            (dev.upload(&row_keys).expect("keys"), dev.upload(&tiles).expect("tiles"), dev.upload(&flat).expect("t"));
        let args = AttentionArgs {
            q: q_dev.view(),
            k_cache: k_dev.view(),
            v_cache: v_dev.view(),
            row_keys: keys_dev.view(),
            tiles: tiles_dev.view(),
            max_tile_rows: gpu::TC_ATTN_TILE_ROWS,
            tables: tables_dev.view(),
            table_stride: stride,
            page_size: ps,
            out: out.view(),
            num_heads: nh,
            kv_heads: kvh,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            split: KeySplit::Whole,
        };
        gpu::prompt_attention_tc(dev, args).expect("prompt_attention_tc");
        let got = dev.download(&out).expect("download");
        let shape = format!("{t} rows, {nh}/{kvh} heads of {d}");
        // q, k, v and the softmax weights rounded to bf16: a few 1e-3 on outputs of size 1.
        check("prompt_attention_tc", &shape, max_err_over(&got, &want, &vec![1.0; want.len()]), 1e-2);
        let mean = got.iter().zip(&want).map(|(g, w)| (g - w).abs() as f64).sum::<f64>() / want.len() as f64;
        check("prompt_attention_tc mean", &shape, mean, 1e-3);
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
    gpu::gemm_bf16_small(dev, w, n_out, &xd, m, &y, y_ld, epi).expect("gemm_bf16_small");
    dev.download(&y).expect("download")
}

#[test]
fn small_bf16_matmul_matches_cpu_and_gives_each_row_the_same_bits_in_any_batch() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(26);
    // k = 104, 2056 and 136 end inside a 64-wide k-block (136 gives most warps nothing to do); n_out = 37, 5
    // and 8500 end inside a 16-column tile.
    for (n_out, k) in [(37, 576), (1000, 4096), (16, 104), (5, 2056), (8500, 136)] {
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

#[test]
fn gathered_final_norm_and_capture_copy_match_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(27);
    let (t, h) = (9, 576);
    let (x, w) = (rng.vec(t * h, 3.0), rng.vec(h, 1.0));
    let rows = [8u32, 0, 3, 3];
    let picked: Vec<f32> = rows.iter().flat_map(|&r| x[r as usize * h..][..h].to_vec()).collect();
    let want = cpu_rms_norm(&picked, &w, 1e-5);
    let out = poisoned(dev, (rows.len() + 1) * h);
    let mut rows_bad = rows.to_vec();
    rows_bad.push(t as u32);
    let (x_dev, w_dev) = (dev.upload(&x).expect("x"), dev.upload(&w).expect("w"));
    gpu::gather_rms_norm(dev, &x_dev, &dev.upload(&rows_bad).expect("rows"), &w_dev, 1e-5, &out).expect("gather");
    let got = dev.download(&out).expect("download");
    let scale: Vec<f64> = want.iter().map(|v| (v.abs() as f64).max(1.0)).collect();
    check("gather_rms_norm", "4 of 9x576", max_err_over(&got[..rows.len() * h], &want, &scale), 1e-5);
    assert!(got[rows.len() * h..].iter().all(|v| v.is_nan()), "a row past x gives NaN");

    let (width, dst_ld, col) = (h, 3 * h + 7, h + 3);
    let dst = poisoned(dev, t * dst_ld);
    gpu::copy_columns(dev, &x_dev, width, &dst, dst_ld, col).expect("copy");
    let got = dev.download(&dst).expect("download");
    let mut want = vec![f32::NAN; t * dst_ld];
    for r in 0..t {
        want[r * dst_ld + col..][..width].copy_from_slice(&x[r * h..][..h]);
    }
    check("copy_columns", "9x576 into 9x1735 at 579", bit_mismatches(&got, &want), 0.0);
}

#[test]
fn captured_graph_replays_with_new_inputs() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(28);
    let (vocab, hidden, n, rows) = (64, 96, 70, 3);
    let (table_bytes, _) = quant_matrix(&mut rng, DType::Q8_0, vocab, hidden);
    let table = gpu::QuantMatrix::upload(dev, DType::Q8_0, &table_bytes, vocab, hidden).expect("table");
    let (w_bytes, _) = quant_matrix(&mut rng, DType::Q4_1, n, hidden);
    let w = gpu::QuantMatrix::upload(dev, DType::Q4_1, &w_bytes, n, hidden).expect("w");
    let norm = dev.upload(&rng.vec(hidden, 1.0)).expect("norm");
    let mut ids = dev.alloc_zeros::<u32>(rows).expect("ids");
    let (x, y) = (dev.alloc_zeros::<f32>(rows * hidden).expect("x"), dev.alloc_zeros::<f32>(rows * n).expect("y"));
    let step = |ids: &DeviceBuf<u32>| -> Result<(), dflash_runtime::CudaError> {
        gpu::embedding_quant(dev, &table, ids, &x)?;
        let args = MmvqArgs {
            x: x.view(),
            x_ld: hidden,
            m: rows,
            norm: Some((norm.view(), 1e-5)),
            y: y.view(),
            y_ld: n,
            epi: Epilogue::Store,
        };
        gpu::mmvq(dev, &w, args)
    };
    let graph = dev.capture(|| step(&ids)).expect("capture");
    for round in 0..3 {
        let host_ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
        dev.upload_into(&host_ids, &mut ids).expect("ids");
        graph.launch().expect("replay");
        let replayed = dev.download(&y).expect("download");
        step(&ids).expect("eager");
        let eager = dev.download(&y).expect("download");
        check("graph replay vs eager", &format!("round {round}"), bit_mismatches(&replayed, &eager), 0.0);
    }
}
