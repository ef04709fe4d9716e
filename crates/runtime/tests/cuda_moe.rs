//! The sparse mixture-of-experts block on the device (`cuda::ops::moe_forward`) against its CPU twin
//! `ops::moe_forward` (what the CPU layer runs) plus the residual: odd and vector-friendly sizes, f32 and bf16
//! weights (widened exactly on the CPU side), with and without the shared expert, renormalised picks or not,
//! exact routing ties, a masked row, 1 and 3 rows (the small-batch path: one-row plan, fused down + combine)
//! and 16 (the batch path), rows alone and in a batch of 5 against the same rows in a batch of 16, a CUDA graph
//! against eager launches, and shape errors. Without a CUDA device every test prints a SKIP notice and passes.
//!
//! Tolerance per residual element: `|gpu − cpu| <= 2e-5 · S`, `S` from [`error_scale`]: both sides sum their
//! dots in f32 in different orders, the kernels use `expf` where the CPU has its polynomial `exp`, and the
//! residual add rounds once. A wrong expert, weight or slot moves an output by one term `w · y`, about
//! 1e-3 · S at these sizes (50 times the tolerance); the errors seen on the H200 are below 1e-8 · S. Routing
//! must pick the same experts: rows whose k-th and (k+1)-th probabilities are closer than 1e-4 relative
//! without being exact ties are drawn again. Batch invariance and graph replay are checked bit for bit.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{open_device, stream_alone, stream_shared};
use common::{say, Rng};
use std::sync::OnceLock;

use dflash_runtime::cuda::ops::{self as gpu, ExpertWeights, MoeArgs, MoeScratch};
use dflash_runtime::cuda::{CudaDevice, CudaError, DevSlice, DeviceBuf};
use dflash_runtime::ops as cpu;
use dflash_runtime::{DType, Tensor};
use half::bf16;

fn device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Option<CudaDevice>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            open_device("cuda MoE tests", |_| {
                say(&format!("{:<34} {:<36} {:>11} {:>11}", "kernel", "shape", "max err", "tolerance"));
            })
        })
        .as_ref()
}

fn check(kernel: &str, shape: &str, max_err: f64, tol: f64) {
    say(&format!("{kernel:<34} {shape:<36} {max_err:>11.3e} {tol:>11.1e}"));
    assert!(max_err <= tol, "{kernel} {shape}: max error {max_err:e} over tolerance {tol:e}");
}

fn bit_mismatches(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count() as f64
}

/// One block's sizes and options.
#[derive(Clone, Copy, Debug)]
struct Case {
    hidden: usize,
    inter: usize,
    experts: usize,
    top_k: usize,
    rows: usize,
    shared: bool,
    norm_topk: bool,
    bf16: bool,
}

impl Case {
    fn name(&self) -> String {
        let ty = if self.bf16 { "bf16" } else { "f32" };
        let shared = if self.shared { " +shared" } else { "" };
        let norm = if self.norm_topk { " norm" } else { "" };
        format!("moe_forward {ty}{shared}{norm}")
    }

    fn shape(&self) -> String {
        let (h, i, e, k, t) = (self.hidden, self.inter, self.experts, self.top_k, self.rows);
        format!("T{t} H{h} I{i} {k}/{e}")
    }

    /// Logit row stride: the expert logits, the shared gate and two spare columns.
    fn ld(&self) -> usize {
        self.experts + 3
    }
}

/// Host inputs of one case; weights as the f32 values the device sees (bf16-exact when `bf16`).
struct Inputs {
    x: Vec<f32>,        // [T, H]
    logits: Vec<f32>,   // [T, ld]
    gate_up: Vec<f32>,  // [E, 2I, H]
    down: Vec<f32>,     // [E, H, I]
    shared: Vec<f32>,   // [T, H]
    residual: Vec<f32>, // [T, H]
}

/// Whether the GPU must pick the same experts: the k-th and (k+1)-th probabilities are exact ties (equal
/// logits, ranked by id on both sides) or apart by more than 1e-4 relative.
fn routing_is_stable(row: &[f32], case: &Case) -> bool {
    if case.top_k >= case.experts {
        return true;
    }
    let logits = Tensor::from_f32(row, &[1, row.len()]).expect("logit row");
    let picks = cpu::moe_route(&logits, case.experts, case.top_k + 1, false).expect("route");
    let (a, b) = (picks[0][case.top_k - 1], picks[0][case.top_k]);
    row[a.0] == row[b.0] || a.1 - b.1 > 1e-4 * a.1
}

fn inputs(rng: &mut Rng, case: &Case) -> Inputs {
    let (h, i, e, t, ld) = (case.hidden, case.inter, case.experts, case.rows, case.ld());
    let widen = |v: Vec<f32>| -> Vec<f32> {
        if case.bf16 {
            v.iter().map(|&w| bf16::from_f32(w).to_f32()).collect()
        } else {
            v
        }
    };
    let gate_up = widen(rng.vec(e * 2 * i * h, 2.0 / (h as f32).sqrt()));
    let down = widen(rng.vec(e * h * i, 2.0 / (i as f32).sqrt()));
    let mut logits = vec![0f32; t * ld];
    for r in 0..t {
        let row = &mut logits[r * ld..(r + 1) * ld];
        loop {
            for v in row.iter_mut() {
                *v = rng.uniform() * 3.0;
            }
            match r % 7 {
                // All experts equal: uniform probabilities, the lowest ids win.
                3 => row[..e].fill(0.5),
                // Logits on a coarse grid: many exact ties around the k-th pick.
                4 => row[..e].iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0),
                // Every expert masked: uniform as well (the gate column stays finite).
                5 if r > 10 => row[..e].fill(f32::NEG_INFINITY),
                _ => {}
            }
            if routing_is_stable(row, case) {
                break;
            }
        }
    }
    Inputs { x: rng.vec(t * h, 2.0), logits, gate_up, down, shared: rng.vec(t * h, 1.0), residual: rng.vec(t * h, 1.0) }
}

/// The CPU result (the residual after the block, through `ops::moe_forward`) and the error scale of each
/// element.
fn reference(inp: &Inputs, case: &Case) -> (Vec<f32>, Vec<f64>) {
    let (h, i, e, t, ld) = (case.hidden, case.inter, case.experts, case.rows, case.ld());
    let tensor = |v: &[f32], shape: &[usize]| Tensor::from_f32(v, shape).expect("tensor");
    let (x, logits) = (tensor(&inp.x, &[t, h]), tensor(&inp.logits, &[t, ld]));
    let weights: Vec<(Tensor, Tensor)> = (0..e)
        .map(|id| {
            let gate_up = tensor(&inp.gate_up[id * 2 * i * h..(id + 1) * 2 * i * h], &[2 * i, h]);
            (gate_up, tensor(&inp.down[id * h * i..(id + 1) * h * i], &[h, i]))
        })
        .collect();
    let experts: Vec<cpu::MlpWeights> =
        weights.iter().map(|(gate_up, down)| cpu::MlpWeights { gate_up, down }).collect();
    let shared = case.shared.then(|| tensor(&inp.shared, &[t, h]));
    let args = cpu::MoeArgs {
        x: &x,
        logits: &logits,
        experts: &experts,
        top_k: case.top_k,
        norm_topk: case.norm_topk,
        shared: shared.as_ref(),
    };
    let mut delta = Tensor::zeros(DType::F32, &[t, h]).expect("delta");
    cpu::moe_forward(args, &mut delta).expect("cpu moe_forward");
    let out: Vec<f32> = inp.residual.iter().zip(delta.as_f32().expect("f32")).map(|(r, d)| r + d).collect();
    let scale = error_scale(inp, case, &logits, &out);
    (out, scale)
}

/// The error scale of every element, over the picks `ops::moe_route` makes:
/// `S = Σ_picks w · Σ_i |down[h, i]| · (|act_i| + (|up_i| + 1)·Σ|gate·x| + (|gate_i| + 1)·Σ|up·x| + 1)
///      + |g · shared[h]| + |out[h]|`.
/// Each dot's error is a few ulp of its Σ|terms| (taken here in f64); it passes through SwiGLU scaled by the
/// other operand plus one (as in cuda_matmul_ops' SwiGLU epilogue). The `+ 1`s cover `expf` against the CPU's
/// `exp`, about 1e-6 relative, in SiLU and in the routing weights (whose softmax sums also run in another order).
fn error_scale(inp: &Inputs, case: &Case, logits: &Tensor, out: &[f32]) -> Vec<f64> {
    let (h, i, e, ld) = (case.hidden, case.inter, case.experts, case.ld());
    let routes = cpu::moe_route(logits, e, case.top_k, case.norm_topk).expect("route");
    let mut scale = vec![0f64; out.len()];
    for (r, picks) in routes.iter().enumerate() {
        let x = &inp.x[r * h..(r + 1) * h];
        for &(id, w) in picks {
            let gu = &inp.gate_up[id * 2 * i * h..(id + 1) * 2 * i * h];
            let dot = |row: &[f32]| -> (f32, f64) {
                let s: f64 = row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let abs: f64 = row.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                (s as f32, abs)
            };
            let (pre, pre_abs): (Vec<f32>, Vec<f64>) = gu.chunks_exact(h).map(dot).unzip();
            let mut act = Tensor::zeros(DType::F32, &[1, i]).expect("act");
            cpu::swiglu_fused(&Tensor::from_f32(&pre, &[1, 2 * i]).expect("gate_up"), &mut act).expect("swiglu");
            let act = act.as_f32().expect("f32");
            // Error scale of each activation: the dots' scales through SwiGLU, plus the exp difference.
            let act_err: Vec<f64> = (0..i)
                .map(|j| {
                    let (g, u) = (pre[j] as f64, pre[i + j] as f64);
                    act[j].abs() as f64 + (u.abs() + 1.0) * pre_abs[j] + (g.abs() + 1.0) * pre_abs[i + j] + 1.0
                })
                .collect();
            let dn = &inp.down[id * h * i..(id + 1) * h * i];
            for (c, d) in dn.chunks_exact(i).enumerate() {
                scale[r * h + c] += w as f64 * d.iter().zip(&act_err).map(|(&a, &s)| a.abs() as f64 * s).sum::<f64>();
            }
        }
        for c in 0..h {
            if case.shared {
                let g = 1.0 / (1.0 + (-inp.logits[r * ld + e]).exp());
                scale[r * h + c] += (g * inp.shared[r * h + c]).abs() as f64;
            }
            scale[r * h + c] += out[r * h + c].abs() as f64 + 1e-30;
        }
    }
    scale
}

/// The device copies of one case's inputs.
struct DevInputs {
    x: DeviceBuf<f32>,
    logits: DeviceBuf<f32>,
    gu_f32: DeviceBuf<f32>,
    down_f32: DeviceBuf<f32>,
    gu_bf16: DeviceBuf<bf16>,
    down_bf16: DeviceBuf<bf16>,
    shared: DeviceBuf<f32>,
    residual: DeviceBuf<f32>,
}

impl DevInputs {
    fn new(dev: &CudaDevice, inp: &Inputs, case: &Case) -> Self {
        let to_bf16 = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&w| bf16::from_f32(w)).collect() };
        // Only one of the weight types is used; the other is a one-element placeholder.
        let (gu_f32, down_f32, gu_bf16, down_bf16) = if case.bf16 {
            (vec![0.0], vec![0.0], to_bf16(&inp.gate_up), to_bf16(&inp.down))
        } else {
            (inp.gate_up.clone(), inp.down.clone(), vec![bf16::ZERO], vec![bf16::ZERO])
        };
        let up = |v: &[f32]| dev.upload(v).expect("upload");
        DevInputs {
            x: up(&inp.x),
            logits: up(&inp.logits),
            gu_f32: up(&gu_f32),
            down_f32: up(&down_f32),
            gu_bf16: dev.upload(&gu_bf16).expect("upload"),
            down_bf16: dev.upload(&down_bf16).expect("upload"),
            shared: up(&inp.shared),
            residual: up(&inp.residual),
        }
    }

    /// The arguments for rows `first .. first + rows` (the whole case when `rows == case.rows`).
    fn args<'a>(&'a self, case: &Case, first: usize, rows: usize) -> MoeArgs<'a> {
        let (h, ld) = (case.hidden, case.ld());
        let part = |b: &'a DeviceBuf<f32>| b.view().sub(first * h, rows * h).expect("rows");
        let experts = if case.bf16 {
            ExpertWeights::Bf16 { gate_up: self.gu_bf16.view(), down: self.down_bf16.view() }
        } else {
            ExpertWeights::F32 { gate_up: self.gu_f32.view(), down: self.down_f32.view() }
        };
        MoeArgs {
            x: part(&self.x),
            logits: self.logits.view().sub(first * ld, rows * ld).expect("logit rows"),
            logit_ld: ld,
            experts,
            num_experts: case.experts,
            top_k: case.top_k,
            norm_topk: case.norm_topk,
            hidden: h,
            inter: case.inter,
            shared: case.shared.then(|| part(&self.shared)),
            residual: part(&self.residual),
        }
    }
}

/// Sizes `(H, I, E, top_k)`: odd (scalar loads), vector-friendly, a hidden multiple of 8 with an odd inter,
/// many experts, few experts with many rows each (the 8-row chunks), and so many experts that the routing
/// kernel takes fewer rows per block.
const SIZES: [(usize, usize, usize, usize); 6] =
    [(72, 40, 9, 3), (70, 37, 9, 3), (72, 37, 9, 3), (256, 96, 64, 8), (64, 24, 4, 2), (16, 8, 3000, 6)];

#[test]
fn moe_forward_matches_cpu_reference() {
    let _stream = stream_shared();
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(61);
    // One scratch for every case (sized for the largest): stale plans or slots from an earlier case would
    // show up as errors.
    let scratch = MoeScratch::new(dev, 16, 3000, 8, 256, 96).expect("scratch");
    let mut n = 0usize;
    for (hidden, inter, experts, top_k) in SIZES {
        for rows in [1, 3, 16] {
            for bf16 in [false, true] {
                // bf16 alternates with n, so any 8 consecutive cases cover every (bf16, shared, norm).
                let shared = (n / 2).is_multiple_of(2);
                let norm_topk = (n / 4).is_multiple_of(2);
                n += 1;
                let case = Case { hidden, inter, experts, top_k, rows, shared, norm_topk, bf16 };
                let inp = inputs(&mut rng, &case);
                let (want, scale) = reference(&inp, &case);
                let d = DevInputs::new(dev, &inp, &case);
                gpu::moe_forward(dev, d.args(&case, 0, rows), &scratch).expect("moe_forward");
                let got = dev.download(&d.residual).expect("download");
                let err = got
                    .iter()
                    .zip(&want)
                    .zip(&scale)
                    .map(|((&g, &w), &s)| if g.is_nan() { f64::INFINITY } else { (g as f64 - w as f64).abs() / s })
                    .fold(0.0, f64::max);
                check(&case.name(), &case.shape(), err, 2e-5);
            }
        }
    }
}

#[test]
fn moe_forward_rows_alone_equal_rows_in_a_batch_of_16() {
    let _stream = stream_shared();
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(62);
    let scratch = MoeScratch::new(dev, 16, 3000, 8, 256, 96).expect("scratch");
    for (hidden, inter, experts, top_k) in SIZES {
        for bf16 in [false, true] {
            let case = Case { hidden, inter, experts, top_k, rows: 16, shared: bf16, norm_topk: !bf16, bf16 };
            let inp = inputs(&mut rng, &case);
            let mut d = DevInputs::new(dev, &inp, &case);
            gpu::moe_forward(dev, d.args(&case, 0, 16), &scratch).expect("batch");
            let batched = dev.download(&d.residual).expect("download");
            // Each row alone, in reverse order, from the original residual.
            dev.upload_into(&inp.residual, &mut d.residual).expect("reset");
            for r in (0..16).rev() {
                gpu::moe_forward(dev, d.args(&case, r, 1), &scratch).expect("alone");
            }
            let alone = dev.download(&d.residual).expect("download");
            check(&format!("{} alone", case.name()), &case.shape(), bit_mismatches(&alone, &batched), 0.0);
            // Rows 3..8 as a batch of 5: the small-batch path with two routing blocks and a grouping.
            dev.upload_into(&inp.residual, &mut d.residual).expect("reset");
            gpu::moe_forward(dev, d.args(&case, 3, 5), &scratch).expect("five");
            let five = dev.download(&d.residual).expect("download");
            let part = |v: &[f32]| v[3 * hidden..8 * hidden].to_vec();
            check(
                &format!("{} 5 rows", case.name()),
                &case.shape(),
                bit_mismatches(&part(&five), &part(&batched)),
                0.0,
            );
        }
    }
}

#[test]
fn moe_forward_replays_in_a_cuda_graph() {
    let _stream = stream_alone();
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(63);
    let case =
        Case { hidden: 256, inter: 96, experts: 64, top_k: 8, rows: 3, shared: true, norm_topk: true, bf16: true };
    let scratch = MoeScratch::new(dev, case.rows, case.experts, case.top_k, case.hidden, case.inter).expect("scratch");
    let first = inputs(&mut rng, &case);
    let mut d = DevInputs::new(dev, &first, &case);
    let graph = dev.capture(|| gpu::moe_forward(dev, d.args(&case, 0, case.rows), &scratch)).expect("capture");
    for round in 0..3 {
        // New routing and inputs at the same addresses.
        let next = inputs(&mut rng, &case);
        dev.upload_into(&next.logits, &mut d.logits).expect("logits");
        dev.upload_into(&next.x, &mut d.x).expect("x");
        dev.upload_into(&next.residual, &mut d.residual).expect("residual");
        graph.launch().expect("replay");
        let replayed = dev.download(&d.residual).expect("download");
        dev.upload_into(&next.residual, &mut d.residual).expect("residual");
        gpu::moe_forward(dev, d.args(&case, 0, case.rows), &scratch).expect("eager");
        let eager = dev.download(&d.residual).expect("download");
        check("moe_forward graph vs eager", &format!("round {round}"), bit_mismatches(&replayed, &eager), 0.0);
        let routed =
            Inputs { gate_up: first.gate_up.clone(), down: first.down.clone(), shared: first.shared.clone(), ..next };
        let (want, scale) = reference(&routed, &case);
        let err = replayed.iter().zip(&want).zip(&scale).map(|((&g, &w), &s)| (g as f64 - w as f64).abs() / s);
        check("moe_forward graph vs cpu", &format!("round {round}"), err.fold(0.0, f64::max), 2e-5);
    }
}

#[test]
fn moe_forward_rejects_bad_shapes_without_launching() {
    let _stream = stream_shared();
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(64);
    let case =
        Case { hidden: 72, inter: 40, experts: 9, top_k: 3, rows: 3, shared: true, norm_topk: false, bf16: false };
    let inp = inputs(&mut rng, &case);
    let d = DevInputs::new(dev, &inp, &case);
    let scratch = MoeScratch::new(dev, 3, 9, 3, 72, 40).expect("scratch");
    let small = MoeScratch::new(dev, 2, 9, 3, 72, 40).expect("small scratch");
    let good = d.args(&case, 0, 3);
    fn short(b: &DeviceBuf<f32>, len: usize) -> DevSlice<'_, f32> {
        b.view().prefix(len).expect("prefix")
    }
    let bad: Vec<(&str, MoeArgs, &MoeScratch)> = vec![
        ("x not rows of hidden", MoeArgs { x: short(&d.x, 3 * 72 - 1), ..good }, &scratch),
        ("residual rows", MoeArgs { residual: short(&d.residual, 2 * 72), ..good }, &scratch),
        ("shared rows", MoeArgs { shared: Some(short(&d.shared, 2 * 72)), ..good }, &scratch),
        ("logits short", MoeArgs { logits: short(&d.logits, 2 * case.ld() + 9), ..good }, &scratch),
        ("no gate column", MoeArgs { logit_ld: 9, ..good }, &scratch),
        ("top_k over experts", MoeArgs { top_k: 10, ..good }, &scratch),
        ("no picks", MoeArgs { top_k: 0, ..good }, &scratch),
        ("inter mismatch", MoeArgs { inter: 39, ..good }, &scratch),
        (
            "gate_up short",
            MoeArgs {
                experts: ExpertWeights::F32 { gate_up: short(&d.gu_f32, 9 * 80 * 72 - 8), down: d.down_f32.view() },
                ..good
            },
            &scratch,
        ),
        ("scratch rows", good, &small),
    ];
    for (what, args, s) in bad {
        match gpu::moe_forward(dev, args, s) {
            Err(CudaError::Shape(msg)) => say(&format!("moe_forward shape error ({what}): {msg}")),
            other => panic!("{what}: expected a shape error, got {other:?}"),
        }
    }
    dev.synchronize().expect("sync");
    let after = dev.download(&d.residual).expect("download");
    check("moe_forward bad shapes launch nothing", "residual untouched", bit_mismatches(&after, &inp.residual), 0.0);
}

/// Decode (1 row) and verify (4, 16 rows) through Qwen3-Next-80B's MoE shape, eight layers (different
/// routings) per replay of a CUDA graph, so the weights come from HBM, not L2. Prints the time per layer; for
/// one row against the floor of the 10 routed experts' bytes at 4.3 TB/s (15 us). Needs 3.3 GB of device
/// memory: run with `--ignored`.
#[test]
#[ignore]
fn moe_decode_timing() {
    let _stream = stream_alone();
    let Some(dev) = device() else { return };
    let (h, i, e, k, layers) = (2048, 512, 512, 10, 8);
    let gate_up = dev.alloc_zeros::<bf16>(e * 2 * i * h).expect("gate_up");
    let down = dev.alloc_zeros::<bf16>(e * h * i).expect("down");
    let scale = 1.0 / (h as f32).sqrt();
    gpu::fill_random_bf16(dev, &gate_up, 1, scale, 0.0).expect("fill");
    gpu::fill_random_bf16(dev, &down, 2, scale, 0.0).expect("fill");
    let mut rng = Rng::new(65);
    for rows in [1, 4, 16] {
        let x = dev.upload(&rng.vec(rows * h, 1.0)).expect("x");
        let residual = dev.alloc_zeros::<f32>(rows * h).expect("residual");
        let logits: Vec<DeviceBuf<f32>> =
            (0..layers).map(|_| dev.upload(&rng.vec(rows * e, 4.0)).expect("logits")).collect();
        let scratch = MoeScratch::new(dev, rows, e, k, h, i).expect("scratch");
        let layers_args: Vec<MoeArgs> = logits
            .iter()
            .map(|l| MoeArgs {
                x: x.view(),
                logits: l.view(),
                logit_ld: e,
                experts: ExpertWeights::Bf16 { gate_up: gate_up.view(), down: down.view() },
                num_experts: e,
                top_k: k,
                norm_topk: true,
                hidden: h,
                inter: i,
                shared: None,
                residual: residual.view(),
            })
            .collect();
        let all = || layers_args.iter().try_for_each(|&a| gpu::moe_forward(dev, a, &scratch));
        let graph = dev.capture(all).expect("capture");
        for _ in 0..5 {
            graph.launch().expect("warm-up");
        }
        dev.synchronize().expect("sync");
        let reps = 200;
        let start = std::time::Instant::now();
        for _ in 0..reps {
            graph.launch().expect("replay");
        }
        dev.synchronize().expect("sync");
        let per_layer = start.elapsed().as_secs_f64() / (reps * layers) as f64;
        // Eager launches, for the launch overhead.
        let start = std::time::Instant::now();
        for _ in 0..reps {
            all().expect("eager");
        }
        dev.synchronize().expect("sync");
        let eager = start.elapsed().as_secs_f64() / (reps * layers) as f64;
        let floor = if rows == 1 {
            let bytes = (k * 3 * i * h * 2) as f64;
            format!(
                ", {:.0} GB/s of routed weights ({:.0}% of 4.3 TB/s)",
                bytes / per_layer / 1e9,
                bytes / per_layer / 4.3e12 * 100.0
            )
        } else {
            String::new()
        };
        say(&format!(
            "moe H{h} I{i} {k}/{e} bf16, {rows} rows: {:.1} us per layer in a graph ({:.1} eager){floor}",
            per_layer * 1e6,
            eager * 1e6
        ));
    }
}
