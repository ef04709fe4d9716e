//! The Gated DeltaNet kernels against their CPU twins (`ops::{gdn_conv, gdn_prep, gdn_rule, gdn_gated_norm,
//! sigmoid_gate_mul}`, the ops the CPU layers run), on fresh random inputs with odd sizes, two sequences in two
//! state slots, and outputs poisoned with NaN. Also the rollback contract: a verify that leaves the state
//! alone, then a replay of the kept rows through every layer in one launch, gives bit for bit the state of a
//! forward over the kept rows alone.
//!
//! Without a CUDA device every test prints a SKIP notice and passes. Tolerances (`err` = |gpu − cpu|,
//! relative to `max(1, |cpu|)`): the convolution, the gate and the delta rule run the CPU's products and
//! sums in the CPU's order, so they differ only through `expf` (2 ulp) in SiLU/sigmoid and the decay:
//! `1e-5`; the rule after several rows compounds that: `1e-4`; q/k normalisation and the gated norm
//! reduce their sums of squares in another order: `1e-5`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::open_device;
use common::{say, Rng};
use std::sync::OnceLock;

use dflash_runtime::cuda::ops::{self as gpu, GdnConvArgs, GdnPrepArgs, GdnRuleArgs, GdnRuns, GdnStateView};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf};
use dflash_runtime::ops as cpu;

fn device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Option<CudaDevice>> = OnceLock::new();
    DEVICE.get_or_init(|| open_device("cuda GDN tests", |_| {})).as_ref()
}

fn check(kernel: &str, shape: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{kernel}");
    let err = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else {
                (g as f64 - w as f64).abs() / (w.abs() as f64).max(1.0)
            }
        })
        .fold(0.0, f64::max);
    say(&format!("{kernel:<22} {shape:<36} {err:>11.3e} {tol:>9.1e}"));
    assert!(err <= tol, "{kernel} {shape}: max error {err:e} over {tol:e}");
}

fn poisoned(dev: &CudaDevice, len: usize) -> DeviceBuf<f32> {
    dev.upload(&vec![f32::NAN; len]).expect("poisoned")
}

/// A run: first row, rows, slot, write flag.
type Run = [u32; 4];

/// Key heads, value heads, key head dim, value head dim.
type Dims = (usize, usize, usize, usize);

fn heads((k_heads, v_heads, k_head_dim, v_head_dim): Dims) -> cpu::GdnHeads {
    cpu::GdnHeads { k_heads, v_heads, k_head_dim, v_head_dim }
}

/// `ops::gdn_conv` over each run, its window from (and with the write flag back into) its slot of `state`;
/// rows outside the runs stay NaN.
fn cpu_conv(x: &[f32], x_ld: usize, w: &[f32], state: &mut [f32], runs: &[Run], c: usize, k: usize) -> Vec<f32> {
    let rows = x.len() / x_ld;
    let mut out = vec![f32::NAN; rows * c];
    for &[first, n, slot, write] in runs {
        let (run, slot) = (first as usize..(first + n) as usize, slot as usize);
        let st = &mut state[slot * (k - 1) * c..(slot + 1) * (k - 1) * c];
        let mut window = st.to_vec();
        let args = cpu::GdnConvArgs { x: &x[run.start * x_ld..run.end * x_ld], x_ld, w, channels: c, kernel: k };
        cpu::gdn_conv(args, &mut window, &mut out[run.start * c..run.end * c]).expect("cpu conv");
        if write == 1 {
            st.copy_from_slice(&window);
        }
    }
    out
}

/// `ops::gdn_rule` (recurrent) over each run, its state from (and with the write flag back into) its slot of
/// `state`; rows outside the runs stay NaN.
fn cpu_rule(qkv: &[f32], c: usize, gb: &[f32], state: &mut [f32], runs: &[Run], dims: Dims) -> Vec<f32> {
    let heads = heads(dims);
    let (hv, vd, per_slot) = (heads.v_heads, heads.value_dim(), heads.state_len());
    let mut out = vec![f32::NAN; qkv.len() / c * vd];
    for &[first, n, slot, write] in runs {
        let (run, slot) = (first as usize..(first + n) as usize, slot as usize);
        let st = &mut state[slot * per_slot..(slot + 1) * per_slot];
        let mut s = st.to_vec();
        let args = cpu::GdnRuleArgs {
            qkv: &qkv[run.start * c..run.end * c],
            channels: c,
            gb: &gb[run.start * 2 * hv..run.end * 2 * hv],
            heads,
        };
        let out_rows = &mut out[run.start * vd..run.end * vd];
        cpu::gdn_rule(args, cpu::RuleForm::Recurrent, &mut s, out_rows).expect("cpu rule");
        if write == 1 {
            st.copy_from_slice(&s);
        }
    }
    out
}

fn runs_buf(dev: &CudaDevice, runs: &[Run]) -> DeviceBuf<u32> {
    dev.upload(&runs.concat()).expect("runs")
}

#[test]
fn conv_matches_cpu_and_writes_only_flagged_windows() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(1);
    for (c, k) in [(37usize, 4usize), (300, 4), (12, 2)] {
        let (rows, x_ld) = (7, c + 5);
        let x = rng.vec(rows * x_ld, 1.0);
        let w = rng.vec(c * k, 0.5);
        let state0 = rng.vec(2 * (k - 1) * c, 1.0);
        let runs: [Run; 2] = [[0, 4, 1, 1], [4, 3, 0, 0]];
        let (xd, wd, runs_d) = (dev.upload(&x).expect("device"), dev.upload(&w).expect("device"), runs_buf(dev, &runs));
        let state_d = dev.upload(&state0).expect("device");
        let out_d = poisoned(dev, rows * c);
        let state = GdnStateView { state: state_d.view(), layer_stride: 0, slot_stride: (k - 1) * c, slots: 2 };
        gpu::gdn_conv(
            dev,
            GdnConvArgs {
                x: xd.view(),
                x_ld,
                x_layer: 0,
                w: Some(wd.view()),
                state,
                runs: GdnRuns { runs: runs_d.view(), rows },
                layers: 1,
                channels: c,
                kernel: k,
                out: Some(out_d.view()),
            },
        )
        .expect("conv");
        let mut state_ref = state0.clone();
        let want = cpu_conv(&x, x_ld, &w, &mut state_ref, &runs, c, k);
        let shape = format!("c {c} k {k} rows 4+3");
        check("gdn_conv", &shape, &dev.download(&out_d).expect("device"), &want, 1e-5);
        check("gdn_conv state", &shape, &dev.download(&state_d).expect("device"), &state_ref, 0.0);
    }
}

#[test]
fn prep_normalises_q_k_and_computes_decay_and_strength() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(2);
    let (rows, hk, dk, hv, dv) = (5usize, 3usize, 20usize, 6usize, 9usize);
    let c = 2 * hk * dk + hv * dv;
    let qkv = rng.vec(rows * c, 2.0);
    let ba_ld = 2 * hv + 3;
    let mut ba = rng.vec(rows * ba_ld, 4.0);
    ba[hv] = 30.0; // softplus's linear branch
    let (neg_a, dt) = (rng.vec(hv, 1.0).iter().map(|x| -x.abs() - 0.1).collect::<Vec<_>>(), rng.vec(hv, 1.0));
    let qkv_d = dev.upload(&qkv).expect("device");
    let (ba_d, na_d, dt_d, gb_d) = (
        dev.upload(&ba).expect("device"),
        dev.upload(&neg_a).expect("device"),
        dev.upload(&dt).expect("device"),
        poisoned(dev, rows * 2 * hv),
    );
    let args = GdnPrepArgs {
        qkv: qkv_d.view(),
        channels: c,
        k_heads: hk,
        k_head_dim: dk,
        ba: ba_d.view(),
        ba_ld,
        neg_a: na_d.view(),
        dt_bias: dt_d.view(),
        gb: gb_d.view(),
        rows,
    };
    gpu::gdn_prep(dev, args).expect("prep");
    let mut want = qkv.clone();
    let mut gb = vec![0f32; rows * 2 * hv];
    let prep =
        cpu::GdnPrepArgs { heads: heads((hk, hv, dk, dv)), channels: c, ba: &ba, ba_ld, neg_a: &neg_a, dt_bias: &dt };
    cpu::gdn_prep(prep, &mut want, &mut gb).expect("cpu prep");
    let shape = format!("rows {rows} k {hk}x{dk} v {hv}");
    check("gdn_prep q|k|v", &shape, &dev.download(&qkv_d).expect("device"), &want, 1e-5);
    check("gdn_prep g|beta", &shape, &dev.download(&gb_d).expect("device"), &gb, 1e-5);
}

/// Random rule inputs with normalised q/k (as after the prep) and decays in [-2, 0).
fn rule_inputs(rng: &mut Rng, rows: usize, dims: Dims, c: usize) -> (Vec<f32>, Vec<f32>) {
    let (hk, hv, dk, _) = dims;
    let mut qkv = rng.vec(rows * c, 1.0);
    for t in 0..rows {
        for h in 0..2 * hk {
            let head = &mut qkv[t * c + h * dk..t * c + (h + 1) * dk];
            let inv = 1.0 / head.iter().map(|v| v * v).sum::<f32>().sqrt();
            head.iter_mut().for_each(|v| *v *= inv);
        }
    }
    let gb = (0..rows * 2 * hv)
        .map(|i| if i % (2 * hv) < hv { -rng.uniform().abs() * 2.0 } else { rng.uniform().abs() })
        .collect();
    (qkv, gb)
}

#[test]
fn rule_matches_cpu_over_runs_and_slots() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(3);
    for dims in [(2usize, 4usize, 16usize, 24usize), (1, 2, 128, 128), (2, 2, 40, 33)] {
        let (hk, hv, dk, dv) = dims;
        let (rows, c) = (9, 2 * hk * dk + hv * dv + 3);
        let (qkv, gb) = rule_inputs(&mut rng, rows, dims, c);
        let per_slot = hv * dk * dv;
        let state0 = rng.vec(2 * per_slot, 0.5);
        let runs: [Run; 2] = [[0, 6, 1, 1], [6, 3, 0, 0]];
        let (qkv_d, gb_d, runs_d) =
            (dev.upload(&qkv).expect("device"), dev.upload(&gb).expect("device"), runs_buf(dev, &runs));
        let (state_d, out_d) = (dev.upload(&state0).expect("device"), poisoned(dev, rows * hv * dv));
        let state = GdnStateView { state: state_d.view(), layer_stride: 0, slot_stride: per_slot, slots: 2 };
        let args = GdnRuleArgs {
            qkv: qkv_d.view(),
            channels: c,
            qkv_layer: 0,
            gb: gb_d.view(),
            gb_layer: 0,
            state,
            runs: GdnRuns { runs: runs_d.view(), rows },
            layers: 1,
            k_heads: hk,
            v_heads: hv,
            k_head_dim: dk,
            v_head_dim: dv,
            out: Some(out_d.view()),
        };
        gpu::gdn_rule(dev, args).expect("rule");
        let mut state_ref = state0.clone();
        let want = cpu_rule(&qkv, c, &gb, &mut state_ref, &runs, dims);
        let shape = format!("k {hk}x{dk} v {hv}x{dv} rows 6+3");
        check("gdn_rule", &shape, &dev.download(&out_d).expect("device"), &want, 1e-4);
        check("gdn_rule state", &shape, &dev.download(&state_d).expect("device"), &state_ref, 1e-4);
    }
}

/// Verify 7 rows without writing, then replay the first `kept` through two layers in one launch: the
/// state equals (bit for bit) a direct forward over the kept rows, for every kept count.
#[test]
fn verify_then_replay_equals_a_forward_over_the_kept_rows() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(4);
    let dims @ (hk, hv, dk, dv) = (2usize, 4usize, 32usize, 32usize);
    let (rows, c, k, layers) = (7usize, 2 * hk * dk + hv * dv, 4usize, 2usize);
    let per_slot = hv * dk * dv;
    let conv_slot = (k - 1) * c;
    let mut inputs = Vec::new();
    let mut conv_x = Vec::new();
    for _ in 0..layers {
        let (qkv, gb) = rule_inputs(&mut rng, rows, dims, c);
        inputs.push((qkv, gb));
        conv_x.extend(rng.vec(rows * c, 1.0));
    }
    let qkv_all: Vec<f32> = inputs.iter().flat_map(|(q, _)| q.clone()).collect();
    let gb_all: Vec<f32> = inputs.iter().flat_map(|(_, g)| g.clone()).collect();
    let state0 = rng.vec(layers * per_slot, 0.5);
    let conv0 = rng.vec(layers * conv_slot, 1.0);
    let (qkv_d, gb_d, x_d) = (
        dev.upload(&qkv_all).expect("device"),
        dev.upload(&gb_all).expect("device"),
        dev.upload(&conv_x).expect("device"),
    );
    for kept in 1..=rows {
        // Slot 0, layers `per_slot` apart (one slot).
        let (state_d, conv_d) = (dev.upload(&state0).expect("device"), dev.upload(&conv0).expect("device"));
        let verify = runs_buf(dev, &[[0, rows as u32, 0, 0]]);
        let replay = runs_buf(dev, &[[0, kept as u32, 0, 1]]);
        let out_d = poisoned(dev, rows * hv * dv);
        let rule = |replaying: bool, layers: usize, with_out: bool| GdnRuleArgs {
            qkv: qkv_d.view(),
            channels: c,
            qkv_layer: rows * c,
            gb: gb_d.view(),
            gb_layer: rows * 2 * hv,
            state: GdnStateView {
                state: state_d.view(),
                layer_stride: per_slot,
                slot_stride: layers * per_slot,
                slots: 1,
            },
            runs: GdnRuns { runs: if replaying { replay.view() } else { verify.view() }, rows },
            layers,
            k_heads: hk,
            v_heads: hv,
            k_head_dim: dk,
            v_head_dim: dv,
            out: with_out.then(|| out_d.view()),
        };
        gpu::gdn_rule(dev, rule(false, 1, true)).expect("verify");
        assert_eq!(dev.download(&state_d).expect("device"), state0, "a verify must leave the state alone");
        gpu::gdn_rule(dev, rule(true, layers, false)).expect("replay");
        let conv = GdnConvArgs {
            x: x_d.view(),
            x_ld: c,
            x_layer: rows * c,
            w: None,
            state: GdnStateView {
                state: conv_d.view(),
                layer_stride: conv_slot,
                slot_stride: layers * conv_slot,
                slots: 1,
            },
            runs: GdnRuns { runs: replay.view(), rows },
            layers,
            channels: c,
            kernel: k,
            out: None,
        };
        gpu::gdn_conv(dev, conv).expect("conv replay");
        // Direct: each layer alone over the kept rows, written.
        let (direct_d, direct_conv_d) = (dev.upload(&state0).expect("device"), dev.upload(&conv0).expect("device"));
        for l in 0..layers {
            let st = direct_d.view().sub(l * per_slot, per_slot).expect("device");
            let a = GdnRuleArgs {
                qkv: qkv_d.view().sub(l * rows * c, rows * c).expect("device"),
                gb: gb_d.view().sub(l * rows * 2 * hv, rows * 2 * hv).expect("device"),
                state: GdnStateView { state: st, layer_stride: 0, slot_stride: per_slot, slots: 1 },
                layers: 1,
                out: None,
                ..rule(true, 1, false)
            };
            gpu::gdn_rule(dev, a).expect("direct rule");
            let cst = direct_conv_d.view().sub(l * conv_slot, conv_slot).expect("device");
            let ca = GdnConvArgs {
                x: x_d.view().sub(l * rows * c, rows * c).expect("device"),
                x_layer: 0,
                state: GdnStateView { state: cst, layer_stride: 0, slot_stride: conv_slot, slots: 1 },
                layers: 1,
                ..conv
            };
            gpu::gdn_conv(dev, ca).expect("direct conv");
        }
        assert_eq!(
            dev.download(&state_d).expect("device"),
            dev.download(&direct_d).expect("device"),
            "kept {kept}: recurrent state"
        );
        assert_eq!(
            dev.download(&conv_d).expect("device"),
            dev.download(&direct_conv_d).expect("device"),
            "kept {kept}: conv window"
        );
        // And the replayed state is the CPU's.
        let mut want = state0.clone();
        for (l, (qkv, gb)) in inputs.iter().enumerate() {
            let _ = cpu_rule(qkv, c, gb, &mut want[l * per_slot..(l + 1) * per_slot], &[[0, kept as u32, 0, 1]], dims);
        }
        check(
            "gdn replay state",
            &format!("kept {kept} of {rows}, 2 layers"),
            &dev.download(&state_d).expect("device"),
            &want,
            1e-4,
        );
    }
}

#[test]
fn gated_norm_and_output_gate_match_cpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(5);
    let (rows, hv, dv, z_ld) = (3usize, 5usize, 36usize, 200usize);
    let core = rng.vec(rows * hv * dv, 2.0);
    let z = rng.vec(rows * z_ld, 3.0);
    let w = rng.vec(dv, 1.0);
    let (core_d, z_d, w_d) =
        (dev.upload(&core).expect("device"), dev.upload(&z).expect("device"), dev.upload(&w).expect("device"));
    gpu::gdn_gated_norm(dev, &core_d, z_d.view().sub(7, z.len() - 7).expect("device"), z_ld, &w_d, hv, 1e-6)
        .expect("norm");
    let mut want = core.clone();
    cpu::gdn_gated_norm(&mut want, &z[7..], z_ld, &w, hv, 1e-6).expect("cpu gated norm");
    check(
        "gdn_gated_norm",
        &format!("rows {rows} heads {hv}x{dv}"),
        &dev.download(&core_d).expect("device"),
        &want,
        1e-5,
    );

    let n = 70;
    let x = rng.vec(rows * n, 2.0);
    let x_d = dev.upload(&x).expect("device");
    gpu::sigmoid_gate_mul(dev, &x_d, n, z_d.view().sub(3, z.len() - 3).expect("device"), z_ld).expect("gate");
    let mut want = x.clone();
    cpu::sigmoid_gate_mul(&mut want, n, &z[3..], z_ld).expect("cpu gate");
    check("sigmoid_gate_mul", &format!("rows {rows} n {n}"), &dev.download(&x_d).expect("device"), &want, 1e-5);
}

#[test]
fn bad_shapes_are_refused_before_launch() {
    let Some(dev) = device() else { return };
    let (x, runs) = (dev.upload(&[0f32; 16]).expect("device"), dev.upload(&[0u32, 1, 0, 1]).expect("device"));
    let state = GdnStateView { state: x.view(), layer_stride: 0, slot_stride: 4, slots: 1 };
    let conv = GdnConvArgs {
        x: x.view(),
        x_ld: 4,
        x_layer: 0,
        w: None,
        state,
        runs: GdnRuns { runs: runs.view(), rows: 1 },
        layers: 1,
        channels: 4,
        kernel: 9,
        out: None,
    };
    assert!(gpu::gdn_conv(dev, conv).is_err(), "kernel past the maximum");
    assert!(gpu::gdn_conv(dev, GdnConvArgs { kernel: 3, out: Some(x.view()), ..conv }).is_err(), "out without w");
    let rule = GdnRuleArgs {
        qkv: x.view(),
        channels: 16,
        qkv_layer: 0,
        gb: x.view(),
        gb_layer: 0,
        state,
        runs: GdnRuns { runs: runs.view(), rows: 1 },
        layers: 1,
        k_heads: 2,
        v_heads: 3,
        k_head_dim: 2,
        v_head_dim: 2,
        out: None,
    };
    assert!(gpu::gdn_rule(dev, rule).is_err(), "value heads not a multiple of key heads");
}
