//! The kernels only block drafters use (kernels/drafter.cu) against their CPU twins on random inputs: DFlash2's
//! convolution bit for bit (and, as one launch with the residual's norm, against its two launches), and
//! `draft_top_k`, the summary a drafter pass reads back in place of its logits, over the default model's vocabulary
//! and small ones, rows with ties, NaN and -inf, wholly masked rows and rows shorter than k, with and without the
//! head's multiplier and softcap; its two kernels (sorting, selecting) against each other bit for bit; and DFlash2's
//! walk, either kernel, against its CPU twin's path.
//!
//! Without a CUDA device every test prints a SKIP notice and passes. Tolerances: columns exact; values bit for bit
//! without a softcap, within 4 ulps with one (CUDA's tanhf against the host's libm); top probabilities 1e-5
//! relative (the denominator is summed in another order).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{bit_mismatches, check, device, max_err_over};
use common::Rng;

use dflash_runtime::cuda::ops::{self as gpu, LogitScale, TopKKernel, DRAFT_TOP_K_MAX};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf};
use dflash_runtime::ops as cpu;

fn poisoned(dev: &CudaDevice, len: usize) -> DeviceBuf<f32> {
    dev.upload(&vec![f32::NAN; len]).expect("poisoned output")
}

/// DFlash2's convolution, written as its CPU twin computes it (models crate, `DynamicConv`): tap by tap, the base
/// product then the dynamic one, each added to the row's sum, taps restarting at every block's first row.
fn dflash_conv_reference(
    x: &[f32],
    dynamic: &[f32],
    base: &[f32],
    starts: &[u32],
    (h, taps, groups): (usize, usize, usize),
) -> Vec<f32> {
    let (ld, coefs) = (2 * taps * groups, taps * groups);
    let mut out = vec![0f32; x.len()];
    for (row, &start) in starts.iter().enumerate() {
        for c in 0..h {
            let mut acc = 0f32;
            for t in 0..taps.min(row - start as usize + 1) {
                let xv = x[(row - t) * h + c];
                acc += base[t * h + c] * xv;
                acc += dynamic[row * ld + coefs + t * groups + c / (h / groups)] * xv;
            }
            out[row * h + c] = acc;
        }
    }
    out
}

#[test]
fn dflash_conv_matches_its_cpu_twin_and_runs_with_the_norm_bit_for_bit() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(31);
    // (hidden, taps, groups, blocks' widths): the default drafter's shape and an odd one.
    for (h, taps, groups, widths) in [(576, 2, 36, vec![8, 3, 5]), (200, 3, 5, vec![1, 7])] {
        let starts: Vec<u32> = widths
            .iter()
            .scan(0u32, |at, &w| {
                let first = *at;
                *at += w as u32;
                Some(std::iter::repeat_n(first, w))
            })
            .flatten()
            .collect();
        let rows = starts.len();
        let (x, dynamic, base) =
            (rng.vec(rows * h, 1.0), rng.vec(rows * 2 * taps * groups, 0.5), rng.vec(2 * taps * h, 1.0));
        let (dx, ddyn, dbase) =
            (dev.upload(&x).expect("x"), dev.upload(&dynamic).expect("dyn"), dev.upload(&base).expect("base"));
        let dstarts = dev.upload(&starts).expect("starts");
        let out = poisoned(dev, rows * h);
        let side = gpu::ConvSide {
            base: dbase.view().sub(taps * h, taps * h).expect("finish side"),
            dynamic: ddyn.view(),
            dyn_ld: 2 * taps * groups,
            dyn_col: taps * groups,
            taps,
            groups,
        };
        gpu::dflash_conv(dev, &dx, side, &dstarts, &out).expect("dflash_conv");
        let got = dev.download(&out).expect("download");
        let want = dflash_conv_reference(&x, &dynamic, &base[taps * h..], &starts, (h, taps, groups));
        let shape = format!("{rows}x{h}, {taps} taps, {groups} groups");
        check("dflash_conv", &shape, bit_mismatches(&got, &want), 0.0);
        // The finish side with the residual's norm in one launch: the two launches' bits, residual and norm both.
        let (residual, norm) = (rng.vec(rows * h, 2.0), rng.vec(h, 1.0));
        let (two_res, one_res, dnorm) = (
            dev.upload(&residual).expect("res"),
            dev.upload(&residual).expect("res"),
            dev.upload(&norm).expect("norm"),
        );
        let (two_out, one_out) = (poisoned(dev, rows * h), poisoned(dev, rows * h));
        gpu::add_rms_norm(dev, &two_res, &out, &dnorm, 1e-5, &two_out).expect("add_rms_norm");
        gpu::dflash_conv_add_rms_norm(dev, &one_res, &dx, side, &dstarts, &dnorm, 1e-5, &one_out).expect("fused");
        for (what, two, one) in [("residual", &two_res, &one_res), ("normed", &two_out, &one_out)] {
            let (two, one) = (dev.download(two).expect("two"), dev.download(one).expect("one"));
            check("dflash_conv_add_rms_norm", &format!("{shape}, {what}"), bit_mismatches(&one, &two), 0.0);
        }
        let short = poisoned(dev, (rows - 1) * h);
        assert!(gpu::dflash_conv_add_rms_norm(dev, &short, &dx, side, &dstarts, &dnorm, 1e-5, &one_out).is_err());
    }
}

/// What `draft_top_k` must give for one row, computed as the host drafts: each value scaled as the CPU drafter's
/// `scale_logits` does, `ops::top_k` of the scaled row, and the softmax probability of its best column over the
/// values that are numbers (1 / len for a row of -inf).
fn top_k_reference(row: &[f32], k: usize, scale: LogitScale) -> (Vec<u32>, Vec<f32>, f32) {
    let scaled: Vec<f32> = row
        .iter()
        .map(|&l| {
            let l = l * scale.multiplier;
            scale.softcap.map_or(l, |c| (l / c).tanh() * c)
        })
        .collect();
    let (columns, values): (Vec<u32>, Vec<f32>) = cpu::top_k(&scaled, k).into_iter().unzip();
    let numbers: Vec<f32> = scaled.iter().copied().filter(|v| !v.is_nan()).collect();
    let max = numbers.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let top = if max == f32::NEG_INFINITY {
        1.0 / row.len() as f32
    } else {
        1.0 / numbers.iter().map(|&v| ((v - max) as f64).exp()).sum::<f64>() as f32
    };
    (columns, values, top)
}

/// A row of `n` logits of `kind`: 0 spread values, 1 few distinct values (many ties), 2 some NaN and -inf, 3 all
/// -inf.
fn logit_row(rng: &mut Rng, n: usize, kind: usize) -> Vec<f32> {
    match kind {
        0 => rng.vec(n, 8.0),
        1 => (0..n).map(|_| (rng.below(7) as f32) - 3.0).collect(),
        2 => (0..n)
            .map(|_| match rng.below(10) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                _ => rng.uniform() * 4.0,
            })
            .collect(),
        _ => vec![f32::NEG_INFINITY; n],
    }
}

#[test]
fn draft_top_k_matches_the_host_top_k_and_softmax() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(47);
    let scales = [
        LogitScale { multiplier: 1.0, softcap: None },
        LogitScale { multiplier: 0.75, softcap: None },
        LogitScale { multiplier: 1.5, softcap: Some(30.0) },
    ];
    // (row length, k): the default model's vocabulary with DFlash2's 16 and greedy's 1, the kernel's most, a
    // length that is not a multiple of the block, rows shorter than k, and a vocabulary whose parts must grow to
    // keep the merge within its bound (Qwen3's, with the most candidates).
    let shapes = [(49_152, 16), (49_152, 1), (1000, DRAFT_TOP_K_MAX), (257, 16), (10, 16), (1, 1), (151_936, 32)];
    for (n, k) in shapes {
        for scale in scales {
            let rows = 9;
            let logits: Vec<f32> = (0..rows).flat_map(|r| logit_row(&mut rng, n, r % 4)).collect();
            let dlogits = dev.upload(&logits).expect("logits");
            let shape = format!("{rows}x{n}, k {k}, x{} cap {:?}", scale.multiplier, scale.softcap);
            let mut summaries = Vec::new();
            for kernel in [TopKKernel::Sort, TopKKernel::Select] {
                let out = dev.upload(&vec![0xdead_beef_u32; rows * (2 * k + 1)]).expect("poisoned summary");
                let scratch_len = gpu::draft_top_k_scratch(rows, n, k);
                let scratch = dev.upload(&vec![0xdead_beef_u32; scratch_len]).expect("scratch");
                gpu::draft_top_k_on(dev, &dlogits, n, k, scale, &scratch, &out, kernel).expect("draft_top_k");
                let got = dev.download(&out).expect("download");
                check_summary(&got, &logits, n, k, scale, &format!("{shape}, {kernel:?}"));
                summaries.push((got, dev.download(&scratch).expect("scratch")));
            }
            // Both ways of finding a block's best k give the same summary and the same parts, every bit (padding,
            // NaN payloads and the top probability included).
            let differing = |a: &[u32], b: &[u32]| a.iter().zip(b).filter(|(x, y)| x != y).count() as f64;
            let ((sort, sort_parts), (select, select_parts)) = (&summaries[0], &summaries[1]);
            check("draft_top_k select against sort", &shape, differing(select, sort), 0.0);
            check("draft_top_k select's parts against sort's", &shape, differing(select_parts, sort_parts), 0.0);
        }
    }
}

/// Checks a device summary `got` (`[rows, 2k + 1]`) of `logits` (rows of `n`) against the host's top k and softmax.
fn check_summary(got: &[u32], logits: &[f32], n: usize, k: usize, scale: LogitScale, shape: &str) {
    let (mut columns, mut value_err, mut top_err) = (0.0, 0.0f64, 0.0f64);
    for (r, row) in logits.chunks_exact(n).enumerate() {
        let (want_columns, want_values, want_top) = top_k_reference(row, k, scale);
        let g = &got[r * (2 * k + 1)..(r + 1) * (2 * k + 1)];
        let kept = want_columns.len();
        columns += g[..kept].iter().zip(&want_columns).filter(|(a, b)| a != b).count() as f64;
        columns += g[kept..k].iter().filter(|&&c| c != u32::MAX).count() as f64;
        let values: Vec<f32> = g[k..k + kept].iter().map(|&b| f32::from_bits(b)).collect();
        // NaN is NaN: the device's arithmetic gives the canonical NaN, the host's keeps the payload.
        columns += values.iter().zip(&want_values).filter(|(a, b)| a.is_nan() != b.is_nan()).count() as f64;
        let numbers = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| if x.is_nan() { 0.0 } else { x }).collect() };
        let (values, want_values) = (numbers(&values), numbers(&want_values));
        value_err = value_err.max(match scale.softcap {
            None => bit_mismatches(&values, &want_values),
            Some(_) => {
                let ulps: Vec<f64> = want_values.iter().map(|v| (v.abs().max(1e-30) * 1.2e-7) as f64).collect();
                max_err_over(&values, &want_values, &ulps)
            }
        });
        let top = f32::from_bits(g[2 * k]);
        top_err = top_err.max(((top - want_top) / want_top).abs() as f64);
    }
    check("draft_top_k columns", shape, columns, 0.0);
    check("draft_top_k values", shape, value_err, if scale.softcap.is_some() { 4.0 } else { 0.0 });
    check("draft_top_k top probability", shape, top_err, 1e-5);
}

#[test]
fn draft_top_k_refuses_bad_shapes() {
    let Some(dev) = device() else { return };
    let logits = poisoned(dev, 64);
    let scale = LogitScale { multiplier: 1.0, softcap: None };
    let out = dev.upload(&vec![0u32; 2 * 33]).expect("out");
    let scratch = dev.upload(&vec![0u32; 1024]).expect("scratch");
    let top_k = |row_len, k, scratch: &DeviceBuf<u32>, out: &DeviceBuf<u32>| {
        gpu::draft_top_k(dev, &logits, row_len, k, scale, scratch, out)
    };
    assert!(top_k(32, 16, &scratch, &out).is_ok(), "a shape it takes");
    assert!(top_k(32, 0, &scratch, &out).is_err(), "k = 0");
    assert!(top_k(32, DRAFT_TOP_K_MAX + 1, &scratch, &out).is_err(), "k past the kernel's");
    assert!(top_k(30, 16, &scratch, &out).is_err(), "rows that do not divide the logits");
    assert!(top_k(32, 8, &scratch, &out).is_err(), "a summary buffer of the wrong size");
    let small = dev.upload(&vec![0u32; gpu::draft_top_k_scratch(2, 32, 16) - 1]).expect("scratch");
    assert!(top_k(32, 16, &small, &out).is_err(), "a scratch buffer too small");
}

/// DFlash2's greedy walk as its CPU twin computes it (models crate, `CandidateSelector::walk`): for each slot, every
/// valid candidate scored `value + Σ_j (pred[prev][j] · proj[j]) · succ[cand][j]`, rounded term by term; the first
/// best is taken (`u32::MAX` where none is valid, and the walk goes on from the previous token).
fn walk_reference(
    summary: &[u32],
    k: usize,
    ids: &[u32],
    projected: &[f32],
    (pred, succ, rank): (&[f32], &[f32], usize),
    (first, width, anchor): (u32, u32, u32),
) -> Vec<u32> {
    let codes = (pred.len() / rank) as u32;
    let mut prev = anchor;
    let mut path = Vec::new();
    for row in (first + 1) as usize..(first + width) as usize {
        let entry = &summary[row * (2 * k + 1)..(row + 1) * (2 * k + 1)];
        let mut best: Option<(f32, u32)> = None;
        for c in 0..k {
            if entry[c] == u32::MAX {
                continue;
            }
            let id = ids[entry[c] as usize];
            if id >= codes || prev >= codes {
                continue;
            }
            let (a, b, p) = (&pred[prev as usize * rank..], &succ[id as usize * rank..], &projected[row * rank..]);
            let sum = (0..rank).fold(0f32, |sum, j| sum + (a[j] * p[j]) * b[j]);
            let score = f32::from_bits(entry[k + c]) + sum;
            if !score.is_nan() && best.is_none_or(|(s, _)| score > s) {
                best = Some((score, id));
            }
        }
        path.push(best.map_or(u32::MAX, |(_, id)| id));
        prev = best.map_or(prev, |(_, id)| id);
    }
    path
}

/// A slot's candidate value: mostly uniform, with NaN (never chosen), -inf (chosen only alone) and a repeated value
/// (ties, broken by the lower lane) mixed in where `special`.
fn walk_value(rng: &mut Rng, special: bool) -> f32 {
    match (special, rng.below(8)) {
        (true, 0) => f32::NAN,
        (true, 1) => f32::NEG_INFINITY,
        (true, 2) => 0.25,
        _ => rng.uniform(),
    }
}

#[test]
fn dflash2_walk_staged_or_not_gives_the_cpu_path() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(53);
    // (rank, k, head columns mapped through ids, special values): the default drafter's selector, the 8B
    // projection's, the most candidates, odd and non-multiple-of-32 ranks, columns that are target ids, NaN / -inf /
    // ties, and a rank past the staged kernel's shared memory (it falls back).
    let cases = [
        (24, 16, true, false),
        (256, 16, true, false),
        (256, DRAFT_TOP_K_MAX, true, true),
        (37, 16, false, true),
        (100, 8, true, true),
        (400, DRAFT_TOP_K_MAX, true, false),
    ];
    for (rank, k, mapped, special) in cases {
        assert_eq!(gpu::walk_staged_fits(k, rank), rank < 400, "which cases the staged kernel takes");
        let (codes, head) = (300, if mapped { 400 } else { 300 });
        // Blocks of 1 (no slot), 8 and 16 rows; the last anchor outside the codebooks (every slot then has none).
        let (first, width, anchor) = (vec![0u32, 1, 9, 25], vec![1u32, 8, 16, 4], vec![7u32, 11, 250, codes as u32]);
        let rows = 29;
        // Head columns map to target ids through `ids` (some past the codebooks), or are target ids; some missing.
        let ids: Vec<u32> = (0..head).map(|c| if mapped { rng.below(codes + 40) as u32 } else { c as u32 }).collect();
        let summary: Vec<u32> = (0..rows)
            .flat_map(|_| {
                let cols: Vec<u32> =
                    (0..k).map(|_| if rng.below(10) == 0 { u32::MAX } else { rng.below(head) as u32 }).collect();
                let values: Vec<u32> = (0..k).map(|_| walk_value(&mut rng, special).to_bits()).collect();
                cols.into_iter().chain(values).chain([0.5f32.to_bits()]).collect::<Vec<u32>>()
            })
            .collect();
        let (pred, mut succ, projected) =
            (rng.vec(codes * rank, 1.0), rng.vec(codes * rank, 1.0), rng.vec(rows * rank, 1.0));
        if special {
            // Two target ids with the same successor row: equal scores where their values tie.
            let (from, to) = (3 * rank, 5 * rank);
            succ.copy_within(from..from + rank, to);
        }
        let up = |v: &[u32]| dev.upload(v).expect("upload");
        let (d_summary, d_ids, d_first, d_width, d_anchor) =
            (up(&summary), up(&ids), up(&first), up(&width), up(&anchor));
        let (d_pred, d_succ, d_proj) =
            (dev.upload(&pred).expect("pred"), dev.upload(&succ).expect("succ"), dev.upload(&projected).expect("proj"));
        let selector = gpu::SelectorWeights { predecessor: d_pred.view(), successor: d_succ.view(), rank };
        let blocks = gpu::WalkBlocks { first: d_first.view(), width: d_width.view(), anchor: d_anchor.view() };
        for staged in [false, true] {
            let path = dev.upload(&vec![0xdead_beef_u32; rows]).expect("path");
            let token_ids = mapped.then(|| d_ids.view());
            gpu::dflash2_walk_on(dev, &d_summary, k, token_ids, &d_proj, selector, blocks, &path, staged)
                .expect("walk");
            let got = dev.download(&path).expect("download");
            let mut wrong = 0.0;
            for b in 0..first.len() {
                let block = (first[b], width[b], anchor[b]);
                let want = walk_reference(&summary, k, &ids, &projected, (&pred, &succ, rank), block);
                let at = (first[b] + 1) as usize;
                wrong += got[at..at + want.len()].iter().zip(&want).filter(|(g, w)| g != w).count() as f64;
                wrong += f64::from(got[first[b] as usize] != 0xdead_beef);
            }
            let what = format!("rank {rank}, k {k}, mapped {mapped}, special values {special}, staged {staged}");
            check("dflash2_walk", &what, wrong, 0.0);
        }
    }
}
