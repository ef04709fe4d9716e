//! `sample_rows` (kernels/sample.cu) against its host twin `ops::sample::draw_rows`, row for row: greedy and
//! temperatures 0.7 / 1 / 1.5 with every combination of top-k (0, 1, 40), top-p (1, 0.9, 0.5), min-p (0, 0.05),
//! adjustments (none; biases with a repeated id and one past the vocabulary; a repetition penalty over 300 ids;
//! the engine's bias, repetition, presence and frequency over the same ids) and logprobs (none, 0, 5, 20), over
//! peaked, Zipf-like, flat, tied, partly masked (-inf and NaN) and wholly masked rows, at random seeds and
//! positions, many rows to a launch, for a 49152 and a 1000 vocabulary. Then: a row's result alone equals its
//! result in a batch of 64 (batch invariance); windows too wide for the kernel's shared-memory sort (flat rows at
//! temperature 2 with top-p 0.99, top-k 5000, all-equal rows) take its fallback and still match; adjustment
//! lists longer than one sorting tile; and a 151936 vocabulary.
//!
//! Without a CUDA device every test prints a SKIP notice and passes. Tolerances: token ids and top-logprob ids
//! exact. Logprobs bit for bit, but for one allowance: the normaliser's f64 sum is the host's, in the host's
//! order, but its log is CUDA's, within an ulp of the host's libm; rounded to f32 that is almost always the same
//! bits, and at worst moves log_norm by one f32 ulp. A logprob `l - log_norm` may then differ by that ulp (plus
//! the subtraction's own half ulp), so values within 2 ulps of max(|log_norm|, |value|) pass and are counted.
#![cfg(feature = "cuda")]

mod common;

use std::sync::OnceLock;
use std::time::Instant;

use common::gpu::open_device;
use common::{say, Rng};

use dflash_runtime::cuda::ops::{pack_draws, sample_rows, unpack_drawn, SampleScratch, DRAWN_WORDS};
use dflash_runtime::cuda::{CudaDevice, DeviceBuf};
use dflash_runtime::ops::sample::{draw_rows, log_softmax, AdjustKind, Adjustment, Draw, DrawRow, Drawn};

fn device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Option<CudaDevice>> = OnceLock::new();
    DEVICE.get_or_init(|| open_device("cuda sample tests", |_| {})).as_ref()
}

/// The most rows one launch takes in these tests (the scratch is made for this many).
const MAX_LAUNCH_ROWS: usize = 1024;

/// Logit rows of one vocabulary: peaked, Zipf-like, flat, tied (few distinct values), partly masked (-inf and
/// NaN), wholly masked, and all equal.
fn logit_rows(rng: &mut Rng, vocab: usize) -> Vec<Vec<f32>> {
    let peaked = {
        let mut row = rng.vec(vocab, 3.0);
        for _ in 0..5 {
            let id = rng.below(vocab);
            row[id] = 10.0 + 5.0 * rng.uniform();
        }
        row
    };
    let zipf = {
        let mut rank: Vec<usize> = (0..vocab).collect();
        for i in (1..vocab).rev() {
            rank.swap(i, rng.below(i + 1));
        }
        rank.iter().map(|&r| 14.0 - 2.0 * ((1 + r) as f32).ln() + 0.5 * rng.uniform()).collect()
    };
    let flat = rng.vec(vocab, 0.25);
    let tied = (0..vocab).map(|_| (rng.uniform() * 8.0).round() * 0.5).collect();
    let masked = {
        let mut row = rng.vec(vocab, 4.0);
        for v in row.iter_mut() {
            let u = rng.uniform();
            if u < -0.2 {
                *v = f32::NEG_INFINITY;
            } else if u > 0.98 {
                *v = f32::NAN;
            }
        }
        row[0] = f32::NAN;
        row
    };
    let all_masked = (0..vocab).map(|i| if i % 7 == 3 { f32::NAN } else { f32::NEG_INFINITY }).collect();
    let equal = vec![0.5; vocab];
    vec![peaked, zipf, flat, tied, masked, all_masked, equal]
}

/// `n` distinct ids below `vocab` (`n <= vocab`).
fn distinct_ids(rng: &mut Rng, vocab: usize, n: usize) -> Vec<u32> {
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let id = rng.below(vocab) as u32;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// One row's adjustments of kind `variant` (0: none; 1: biases, one id twice and one past the vocabulary; 2: a
/// repetition penalty over 300 ids; 3: the engine's list: biases, then repetition, presence and frequency over
/// the same ids).
fn adjustments(rng: &mut Rng, vocab: usize, variant: usize) -> Vec<Adjustment> {
    let add = |id, value| Adjustment { id, kind: AdjustKind::Add, value };
    let repeat = |id| Adjustment { id, kind: AdjustKind::Repeat, value: 1.3 };
    match variant {
        1 => {
            let ids = distinct_ids(rng, vocab, 12);
            let mut list: Vec<Adjustment> = ids.iter().map(|&id| add(id, 8.0 * rng.uniform())).collect();
            list.push(add(ids[3], 3.0));
            list.push(add(ids[3], -1.25));
            list.push(add(vocab as u32 + 5, 50.0));
            list
        }
        2 => distinct_ids(rng, vocab, 300.min(vocab)).into_iter().map(repeat).collect(),
        3 => {
            let ids = distinct_ids(rng, vocab, 200.min(vocab));
            let mut list: Vec<Adjustment> = ids[..4].iter().map(|&id| add(id, 5.0 * rng.uniform())).collect();
            list.extend(ids.iter().map(|&id| repeat(id)));
            list.extend(ids.iter().map(|&id| add(id, -0.4)));
            list.extend(ids.iter().map(|&id| add(id, -0.1 * (1 + rng.below(5)) as f32)));
            list
        }
        _ => Vec::new(),
    }
}

/// Rows and their adjustments being put together.
#[derive(Default)]
struct Cases {
    rows: Vec<DrawRow>,
    adjust: Vec<Adjustment>,
}

impl Cases {
    fn push(&mut self, logit_row: usize, draw: Draw, adjust: Vec<Adjustment>, top_logprobs: Option<usize>) {
        let start = self.adjust.len();
        self.adjust.extend(adjust);
        self.rows.push(DrawRow { logit_row, draw, adjust: start..self.adjust.len(), top_logprobs });
    }
}

/// A draw with a random seed and position (some past 2^32).
fn keyed(rng: &mut Rng, temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> Draw {
    let position = if rng.below(4) == 0 { rng.next_u64() } else { rng.below(1 << 16) as u64 };
    Draw { temperature, top_k, top_p, min_p, seed: rng.next_u64(), position }
}

/// Every combination of the module's draw settings, adjustments and logprobs, over each of `kinds` logit rows.
fn combinations(rng: &mut Rng, vocab: usize, kinds: usize) -> Cases {
    let mut cases = Cases::default();
    for kind in 0..kinds {
        for temperature in [0.0, 0.7, 1.0, 1.5] {
            for top_k in [0, 1, 40] {
                for top_p in [1.0, 0.9, 0.5] {
                    for min_p in [0.0, 0.05] {
                        for variant in 0..4 {
                            for top_logprobs in [None, Some(0), Some(5), Some(20)] {
                                let draw = keyed(rng, temperature, top_k, top_p, min_p);
                                let adjust = adjustments(rng, vocab, variant);
                                cases.push(kind, draw, adjust, top_logprobs);
                            }
                        }
                    }
                }
            }
        }
    }
    cases
}

/// The rows drawn on the device, `MAX_LAUNCH_ROWS` to a launch.
fn draw_on_device(dev: &CudaDevice, logits: &DeviceBuf<f32>, vocab: usize, cases: &Cases) -> Vec<Drawn> {
    let scratch = SampleScratch::new(dev, cases.rows.len().min(MAX_LAUNCH_ROWS), vocab).expect("scratch");
    let mut drawn = Vec::with_capacity(cases.rows.len());
    for rows in cases.rows.chunks(MAX_LAUNCH_ROWS) {
        let packed = dev.upload(&pack_draws(rows, &cases.adjust)).expect("packed");
        let out = dev.upload(&vec![0xdead_beef_u32; rows.len() * DRAWN_WORDS]).expect("out");
        sample_rows(dev, logits, vocab, &packed, rows.len(), &out, &scratch).expect("sample_rows");
        drawn.extend(unpack_drawn(&dev.download(&out).expect("download"), rows));
    }
    drawn
}

/// Whether two logprobs agree: the same bits, or within the module's allowance (counted in `near`).
fn logprob_agrees(got: f32, want: f32, log_norm: f32, near: &mut usize) -> bool {
    if got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()) {
        return true;
    }
    let scale = log_norm.abs().max(want.abs());
    let ulp = f32::from_bits(scale.to_bits() + 1) - scale;
    let ok = (got - want).abs() <= 2.0 * ulp;
    *near += usize::from(ok);
    ok
}

/// Holds every device row to the host's; returns how many logprobs were within the allowance but not the same
/// bits. Panics on the first disagreement, naming the row.
fn assert_same(what: &str, logits: &[f32], vocab: usize, cases: &Cases, got: &[Drawn]) -> usize {
    let want = draw_rows(logits, vocab, &cases.rows, &cases.adjust);
    assert_eq!(got.len(), want.len());
    let mut near = 0;
    for (j, ((g, w), row)) in got.iter().zip(&want).zip(&cases.rows).enumerate() {
        let context = || format!("{what}: row {j} {row:?}, adjustments {:?}", &cases.adjust[row.adjust.clone()]);
        assert_eq!(g.id, w.id, "token id; {}", context());
        match (&g.logprobs, &w.logprobs) {
            (None, None) => {}
            (Some((g_lp, g_top)), Some((w_lp, w_top))) => {
                let raw = &logits[row.logit_row * vocab..][..vocab];
                // The host's log_norm, from its logprob of the largest logit.
                let top_id = dflash_runtime::ops::filter::argmax(raw) as usize;
                let log_norm = raw[top_id] - log_softmax(raw)[top_id];
                assert!(logprob_agrees(*g_lp, *w_lp, log_norm, &mut near), "logprob {g_lp} vs {w_lp}; {}", context());
                let g_ids: Vec<u32> = g_top.iter().map(|t| t.0).collect();
                let w_ids: Vec<u32> = w_top.iter().map(|t| t.0).collect();
                assert_eq!(g_ids, w_ids, "top logprob ids; {}", context());
                for (&(_, gv), &(_, wv)) in g_top.iter().zip(w_top) {
                    assert!(logprob_agrees(gv, wv, log_norm, &mut near), "top logprob {gv} vs {wv}; {}", context());
                }
            }
            _ => panic!("logprobs {:?} vs {:?}; {}", g.logprobs, w.logprobs, context()),
        }
    }
    near
}

/// Draws `cases` over `rows` on both sides and holds them to each other.
fn check_cases(dev: &CudaDevice, what: &str, rows: &[Vec<f32>], vocab: usize, cases: &Cases) {
    let logits: Vec<f32> = rows.concat();
    let on_device = dev.upload(&logits).expect("logits");
    let start = Instant::now();
    let got = draw_on_device(dev, &on_device, vocab, cases);
    let device_ms = start.elapsed().as_secs_f64() * 1e3;
    let start = Instant::now();
    let near = assert_same(what, &logits, vocab, cases, &got);
    let host_ms = start.elapsed().as_secs_f64() * 1e3;
    let rows = cases.rows.len();
    say(&format!(
        "{what:<40} {rows:>5} rows match; {near} logprobs within an ulp of log_norm (device {device_ms:.0} ms with \
         uploads, host {host_ms:.0} ms)"
    ));
}

#[test]
fn every_setting_matches_the_host_draw() {
    let Some(dev) = device() else { return };
    for (vocab, seed) in [(49_152, 61), (1000, 62)] {
        let mut rng = Rng::new(seed);
        let rows = logit_rows(&mut rng, vocab);
        let cases = combinations(&mut rng, vocab, rows.len());
        check_cases(dev, &format!("all settings, vocab {vocab}"), &rows, vocab, &cases);
    }
}

#[test]
fn a_row_draws_the_same_alone_and_in_a_batch() {
    let Some(dev) = device() else { return };
    let vocab = 49_152;
    let mut rng = Rng::new(63);
    let rows = logit_rows(&mut rng, vocab);
    let all = combinations(&mut rng, vocab, rows.len());
    // 64 rows spread over the settings and row kinds.
    let mut batch = Cases::default();
    for j in 0..64 {
        let row = &all.rows[(j * 127 + 5) % all.rows.len()];
        batch.push(row.logit_row, row.draw, all.adjust[row.adjust.clone()].to_vec(), row.top_logprobs);
    }
    let logits = dev.upload(&rows.concat()).expect("logits");
    let together = draw_on_device(dev, &logits, vocab, &batch);
    let mut reversed = Cases::default();
    for row in batch.rows.iter().rev() {
        reversed.push(row.logit_row, row.draw, batch.adjust[row.adjust.clone()].to_vec(), row.top_logprobs);
    }
    let backwards: Vec<Drawn> = draw_on_device(dev, &logits, vocab, &reversed).into_iter().rev().collect();
    for (j, row) in batch.rows.iter().enumerate() {
        let mut alone = Cases::default();
        alone.push(row.logit_row, row.draw, batch.adjust[row.adjust.clone()].to_vec(), row.top_logprobs);
        let single = draw_on_device(dev, &logits, vocab, &alone);
        // Bit for bit: compare the bits of every float.
        let bits = |d: &Drawn| (d.id, d.logprobs.as_ref().map(|(lp, top)| (lp.to_bits(), top_bits(top))));
        assert_eq!(bits(&single[0]), bits(&together[j]), "row {j} alone and in a batch of 64: {row:?}");
        assert_eq!(bits(&backwards[j]), bits(&together[j]), "row {j} at {} in the batch: {row:?}", 63 - j);
    }
    say(&format!("{:<40} {:>5} rows the same alone, in a batch and reordered", "batch invariance", batch.rows.len()));
}

fn top_bits(top: &[(u32, f32)]) -> Vec<(u32, u32)> {
    top.iter().map(|&(id, v)| (id, v.to_bits())).collect()
}

#[test]
fn windows_past_the_shared_memory_sort_still_match() {
    let Some(dev) = device() else { return };
    let vocab = 49_152;
    let mut rng = Rng::new(64);
    // Flat rows (every value within 1/4 of the rest), a tied row and an all-equal row: any window holds far more
    // than the kernel sorts in shared memory.
    let mut rows: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(vocab, 0.5)).collect();
    rows.push((0..vocab).map(|_| (rng.uniform() * 2.0).round() * 0.125).collect());
    rows.push(vec![-1.0; vocab]);
    let settings: [(f32, usize, f32, f32); 9] = [
        (2.0, 0, 0.99, 0.0),
        (2.0, 0, 0.5, 0.0),
        (1.0, 0, 0.9, 0.05),
        (2.0, 5000, 1.0, 0.0),
        (2.0, 5000, 0.9, 0.0),
        (1.5, 40, 1.0, 0.0),
        (1.5, 1, 0.99, 0.0),
        (1.0, 20_000, 0.99, 0.05),
        (0.7, 0, 0.0, 0.0),
    ];
    let mut cases = Cases::default();
    for kind in 0..rows.len() {
        for &(temperature, top_k, top_p, min_p) in &settings {
            for j in 0..24 {
                let top_logprobs = [None, Some(20), Some(5)][j % 3];
                let adjust = adjustments(&mut rng, vocab, j % 4);
                cases.push(kind, keyed(&mut rng, temperature, top_k, top_p, min_p), adjust, top_logprobs);
            }
        }
    }
    check_cases(dev, "wide windows (fallback), vocab 49152", &rows, vocab, &cases);
}

#[test]
fn long_adjustment_lists_and_a_large_vocabulary_match() {
    let Some(dev) = device() else { return };
    let vocab = 151_936;
    let mut rng = Rng::new(65);
    let rows = logit_rows(&mut rng, vocab);
    let mut cases = Cases::default();
    for j in 0..96 {
        let (temperature, top_k, top_p, min_p) = [(0.0, 0, 1.0, 0.0), (0.7, 20, 0.8, 0.0), (1.0, 0, 0.95, 0.05)][j % 3];
        let mut adjust = adjustments(&mut rng, vocab, 1 + j % 3);
        if j % 4 == 0 {
            // Over two sorting tiles of 4096, with repeated ids across the tiles' boundary.
            let ids = distinct_ids(&mut rng, vocab, 3000);
            adjust.extend(ids.iter().map(|&id| Adjustment { id, kind: AdjustKind::Repeat, value: 1.3 }));
            adjust.extend(ids.iter().map(|&id| Adjustment { id, kind: AdjustKind::Add, value: -0.4 }));
            adjust.extend(ids.iter().rev().map(|&id| Adjustment { id, kind: AdjustKind::Add, value: -0.7 }));
        }
        cases.push(j % rows.len(), keyed(&mut rng, temperature, top_k, top_p, min_p), adjust, [None, Some(20)][j % 2]);
    }
    check_cases(dev, "long adjustment lists, vocab 151936", &rows, vocab, &cases);
}

#[test]
fn a_launch_for_a_step_of_rows_takes_this_long() {
    let Some(dev) = device() else { return };
    // Not a check: the time of one eager launch of 64 Qwen-vocabulary rows (Zipf-like, top-p 0.95 with
    // temperature 1, logprobs 5), for the record.
    let vocab = 151_936;
    let mut rng = Rng::new(66);
    let rows = logit_rows(&mut rng, vocab);
    let mut cases = Cases::default();
    for _ in 0..64 {
        cases.push(1, keyed(&mut rng, 1.0, 0, 0.95, 0.0), adjustments(&mut rng, vocab, 3), Some(5));
    }
    let logits = dev.upload(&rows.concat()).expect("logits");
    let scratch = SampleScratch::new(dev, cases.rows.len(), vocab).expect("scratch");
    let packed = dev.upload(&pack_draws(&cases.rows, &cases.adjust)).expect("packed");
    let out: DeviceBuf<u32> = dev.alloc_zeros(cases.rows.len() * DRAWN_WORDS).expect("out");
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        dev.synchronize().expect("sync");
        let start = Instant::now();
        sample_rows(dev, &logits, vocab, &packed, cases.rows.len(), &out, &scratch).expect("sample_rows");
        dev.synchronize().expect("sync");
        best = best.min(start.elapsed().as_secs_f64() * 1e6);
    }
    say(&format!("{:<40} {best:.0} us for 64 rows of 151936 (best of 5, launch included)", "sample_rows time"));
}
