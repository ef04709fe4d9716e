//! Paged attention against a contiguous naive reference.

use super::*;
use crate::ops::test_util::{assert_close, Rng};

const PAGE: usize = 4;

thread_local! {
    /// Makes `Plan::new` split every row's keys this many ways, so small tests cover the merge.
    pub(super) static FORCE_SPLITS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// A test sequence: its contiguous K/V history (context + new rows) and its rows in the batch.
struct SeqData {
    context_len: usize,
    num_rows: usize,
    k: Vec<f32>, // [keys, kv_heads * d]
    v: Vec<f32>,
    pages: Vec<u32>,
}

struct Case {
    heads: usize,
    kv_heads: usize,
    d: usize,
    seqs: Vec<SeqData>,
    q: Vec<f32>, // [rows, heads * d]
}

/// Random sequences with (context_len, num_rows) each, pages handed out in shuffled order.
fn make_case(rng: &mut Rng, heads: usize, kv_heads: usize, d: usize, shapes: &[(usize, usize)]) -> Case {
    let total_pages: usize = shapes.iter().map(|(c, r)| (c + r).div_ceil(PAGE)).sum();
    let mut free: Vec<u32> = (0..total_pages as u32 + 3).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.below(i + 1));
    }
    let mut seqs = Vec::new();
    for &(context_len, num_rows) in shapes {
        let keys = context_len + num_rows;
        let pages = free.split_off(free.len() - keys.div_ceil(PAGE));
        let (k, v) = (rng.vec(keys * kv_heads * d), rng.vec(keys * kv_heads * d));
        seqs.push(SeqData { context_len, num_rows, k, v, pages });
    }
    let rows: usize = shapes.iter().map(|(_, r)| r).sum();
    Case { heads, kv_heads, d, seqs, q: rng.vec(rows * heads * d) }
}

fn naive(case: &Case, scale: f32, causal: bool, window: Option<usize>) -> Vec<f32> {
    let (hd, kvd, d) = (case.heads * case.d, case.kv_heads * case.d, case.d);
    let group = case.heads / case.kv_heads;
    let mut out = Vec::new();
    let mut row = 0;
    for s in &case.seqs {
        for j in 0..s.num_rows {
            let pos = s.context_len + j;
            let end = if causal { pos + 1 } else { s.context_len + s.num_rows };
            let start = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..case.heads {
                let q = &case.q[row * hd + h * d..][..d];
                let kvh = h / group;
                let scores: Vec<f64> = (start..end)
                    .map(|t| {
                        let k = &s.k[t * kvd + kvh * d..][..d];
                        q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = w.iter().sum();
                for i in 0..d {
                    let o: f64 = (start..end).zip(&w).map(|(t, p)| p * s.v[t * kvd + kvh * d + i] as f64).sum();
                    out.push((o / total) as f32);
                }
            }
            row += 1;
        }
    }
    out
}

fn paged(case: &Case, scale: f32, causal: bool, window: Option<usize>) -> Vec<f32> {
    let num_pages = case.seqs.iter().flat_map(|s| &s.pages).max().map_or(0, |&p| p as usize + 1);
    let shape = [num_pages, PAGE, case.kv_heads, case.d];
    let mut kc = Tensor::zeros(DType::F32, &shape).expect("k cache");
    let mut vc = Tensor::zeros(DType::F32, &shape).expect("v cache");
    let kvd = case.kv_heads * case.d;
    let mut attn = Vec::new();
    let mut first_row = 0;
    for s in &case.seqs {
        let keys = s.context_len + s.num_rows;
        let slots: Vec<u32> = (0..keys).map(|t| s.pages[t / PAGE] * PAGE as u32 + (t % PAGE) as u32).collect();
        let k = Tensor::from_f32(&s.k, &[keys, kvd]).expect("k");
        let v = Tensor::from_f32(&s.v, &[keys, kvd]).expect("v");
        kv_write(&mut kc, &mut vc, &k, &v, &slots).expect("kv_write");
        attn.push(AttnSeq { first_row, num_rows: s.num_rows, context_len: s.context_len, block_table: &s.pages });
        first_row += s.num_rows;
    }
    let hd = case.heads * case.d;
    let q = Tensor::from_f32(&case.q, &[first_row, hd]).expect("q");
    let mut out = Tensor::zeros(DType::F32, &[first_row, hd]).expect("out");
    paged_attention(&q, &kc, &vc, &attn, case.heads, case.kv_heads, case.d, scale, causal, window, &mut out)
        .expect("paged_attention");
    out.as_f32().expect("out").to_vec()
}

fn check(case: &Case, causal: bool, window: Option<usize>, what: &str) {
    let scale = 1.0 / (case.d as f32).sqrt();
    let want = naive(case, scale, causal, window);
    simd::on_both_paths(|path| {
        // The plan's own choice, then every row's keys split 3 ways (some splits empty for short
        // rows) and merged.
        for splits in [None, Some(3)] {
            FORCE_SPLITS.set(splits);
            let got = paged(case, scale, causal, window);
            FORCE_SPLITS.set(None);
            assert_close(&got, &want, 1e-5, &format!("{what} ({path}, splits {splits:?})"));
        }
    });
}

#[test]
fn mixed_batch_matches_contiguous_reference() {
    let mut rng = Rng::new(41);
    // Prefill, decode and chunked-prefill sequences together; GQA 6 heads over 2 kv heads; head_dim
    // 20 exercises the dot-product tails.
    let case = make_case(&mut rng, 6, 2, 20, &[(0, 7), (9, 1), (6, 3), (3, 5)]);
    check(&case, true, None, "causal");
    check(&case, false, None, "non-causal");
    check(&case, true, Some(3), "causal window 3");
    check(&case, false, Some(5), "non-causal window 5");
    check(&case, true, Some(1), "window 1 (self only)");
}

#[test]
fn decode_rows_match_reference() {
    let mut rng = Rng::new(42);
    // One row per sequence (the plan splits keys when units are few). 9 heads over 3 kv heads,
    // head_dim 64.
    let case = make_case(&mut rng, 9, 3, 64, &[(37, 1)]);
    check(&case, true, None, "decode");
    let case = make_case(&mut rng, 4, 4, 16, &[(12, 1), (0, 1), (5, 1)]);
    check(&case, true, Some(4), "decode batch, window");
}

#[test]
fn long_prefill_matches_reference() {
    let mut rng = Rng::new(43);
    let case = make_case(&mut rng, 4, 1, 32, &[(5, 70)]);
    check(&case, true, None, "long prefill");
}

#[test]
fn rows_without_a_sequence_are_zeroed_and_bad_inputs_rejected() {
    let mut rng = Rng::new(44);
    let (heads, d) = (2, 8);
    let shape = [3, PAGE, 1, d];
    let kc = Tensor::from_f32(&rng.vec(3 * PAGE * d), &shape).expect("k");
    let vc = Tensor::from_f32(&rng.vec(3 * PAGE * d), &shape).expect("v");
    let q = Tensor::from_f32(&rng.vec(3 * heads * d), &[3, heads * d]).expect("q");
    let table = [2u32, 0];
    let seq = AttnSeq { first_row: 0, num_rows: 2, context_len: 5, block_table: &table };
    for splits in [None, Some(2)] {
        let mut out = Tensor::from_f32(&vec![7.0; 3 * heads * d], &[3, heads * d]).expect("out");
        FORCE_SPLITS.set(splits);
        let result = paged_attention(&q, &kc, &vc, &[seq], heads, 1, d, 0.3, true, None, &mut out);
        FORCE_SPLITS.set(None);
        result.expect("attn");
        let out = out.as_f32().expect("out");
        assert!(out[2 * heads * d..].iter().all(|&v| v == 0.0), "splits {splits:?}");
        assert!(out[..2 * heads * d].iter().all(|&v| v != 7.0), "splits {splits:?}");
    }
    let mut out = Tensor::zeros(DType::F32, &[3, heads * d]).expect("out");
    let run = |seqs: &[AttnSeq], window, out: &mut Tensor| {
        paged_attention(&q, &kc, &vc, seqs, heads, 1, d, 0.3, true, window, out)
    };
    let short = AttnSeq { context_len: 7, ..seq };
    assert!(run(&[short], None, &mut out).is_err(), "block table too short");
    let bad_page = [2u32, 3];
    assert!(run(&[AttnSeq { block_table: &bad_page, ..seq }], None, &mut out).is_err());
    assert!(run(&[seq, AttnSeq { first_row: 1, ..seq }], None, &mut out).is_err(), "overlap");
    assert!(run(&[AttnSeq { first_row: 2, ..seq }], None, &mut out).is_err(), "past the batch");
    assert!(run(&[seq], Some(0), &mut out).is_err());
    assert!(paged_attention(&q, &kc, &vc, &[seq], heads, 2, d, 0.3, true, None, &mut out).is_err());
    let mut kc2 = Tensor::zeros(DType::F32, &shape).expect("k");
    let mut vc2 = Tensor::zeros(DType::F32, &shape).expect("v");
    let k = Tensor::zeros(DType::F32, &[1, d]).expect("row");
    assert!(kv_write(&mut kc2, &mut vc2, &k, &k, &[12]).is_err(), "slot past the cache");
    kv_write(&mut kc2, &mut vc2, &k, &k, &[11]).expect("last slot");
}
