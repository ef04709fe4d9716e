//! Paged attention against a contiguous naive reference.

use super::*;
use crate::ops::simd;
use crate::ops::test_util::{assert_close, Rng};

const PAGE: usize = 4;

/// A test sequence: its contiguous K/V history (context + new rows) and its rows in the batch.
#[derive(Clone)]
struct SeqData {
    context_len: usize,
    num_rows: usize,
    k: Vec<f32>, // [keys, kv_heads * d]
    v: Vec<f32>,
    pages: Vec<u32>,
}

struct Case {
    page: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    seqs: Vec<SeqData>,
    q: Vec<f32>, // [rows, heads * d]
}

/// Random sequences with (context_len, num_rows) each, pages of [`PAGE`] slots.
fn make_case(rng: &mut Rng, heads: usize, kv_heads: usize, d: usize, shapes: &[(usize, usize)]) -> Case {
    make_paged_case(rng, PAGE, heads, kv_heads, d, shapes)
}

/// Random sequences with (context_len, num_rows) each, pages of `page` slots handed out in shuffled
/// order.
fn make_paged_case(
    rng: &mut Rng,
    page: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    shapes: &[(usize, usize)],
) -> Case {
    let total_pages: usize = shapes.iter().map(|(c, r)| (c + r).div_ceil(page)).sum();
    let mut free: Vec<u32> = (0..total_pages as u32 + 3).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.below(i + 1));
    }
    let mut seqs = Vec::new();
    for &(context_len, num_rows) in shapes {
        let keys = context_len + num_rows;
        let pages = free.split_off(free.len() - keys.div_ceil(page));
        let (k, v) = (rng.vec(keys * kv_heads * d), rng.vec(keys * kv_heads * d));
        seqs.push(SeqData { context_len, num_rows, k, v, pages });
    }
    let rows: usize = shapes.iter().map(|(_, r)| r).sum();
    Case { page, heads, kv_heads, d, seqs, q: rng.vec(rows * heads * d) }
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

/// Paged attention over `case`, sequence `s` on kernel `kernels[s % kernels.len()]`, each sequence's
/// rows cut into separate `AttnSeq`s of `cut` rows (all in one batch; `usize::MAX`: uncut).
fn paged_cut(
    case: &Case,
    scale: f32,
    causal: bool,
    window: Option<usize>,
    kernels: &[RowKernel],
    cut: usize,
) -> Vec<f32> {
    let num_pages = case.seqs.iter().flat_map(|s| &s.pages).max().map_or(0, |&p| p as usize + 1);
    let page = case.page;
    let shape = [num_pages, page, case.kv_heads, case.d];
    let mut kc = Tensor::zeros(DType::F32, &shape).expect("k cache");
    let mut vc = Tensor::zeros(DType::F32, &shape).expect("v cache");
    let kvd = case.kv_heads * case.d;
    let mut attn = Vec::new();
    let mut first_row = 0;
    for (i, s) in case.seqs.iter().enumerate() {
        let kernel = kernels[i % kernels.len()];
        let keys = s.context_len + s.num_rows;
        let slots: Vec<u32> = (0..keys).map(|t| s.pages[t / page] * page as u32 + (t % page) as u32).collect();
        let k = Tensor::from_f32(&s.k, &[keys, kvd]).expect("k");
        let v = Tensor::from_f32(&s.v, &[keys, kvd]).expect("v");
        kv_write(&mut kc, &mut vc, &k, &v, &slots).expect("kv_write");
        // Non-causal rows see the whole block, so only causal runs may be cut.
        let cut = if causal { cut.max(1) } else { usize::MAX };
        for skip in (0..s.num_rows).step_by(cut) {
            let num_rows = cut.min(s.num_rows - skip);
            let (context_len, block_table) = (s.context_len + skip, &s.pages[..]);
            attn.push(AttnSeq { first_row: first_row + skip, num_rows, context_len, block_table, kernel });
        }
        first_row += s.num_rows;
    }
    let hd = case.heads * case.d;
    let q = Tensor::from_f32(&case.q, &[first_row, hd]).expect("q");
    let mut out = Tensor::zeros(DType::F32, &[first_row, hd]).expect("out");
    paged_attention(&q, &kc, &vc, &attn, case.heads, case.kv_heads, case.d, scale, causal, window, &mut out)
        .expect("paged_attention");
    out.as_f32().expect("out").to_vec()
}

fn paged(case: &Case, scale: f32, causal: bool, window: Option<usize>, kernel: RowKernel) -> Vec<f32> {
    paged_cut(case, scale, causal, window, &[kernel], usize::MAX)
}

const KERNELS: [RowKernel; 2] = [RowKernel::PerRow, RowKernel::Tiled];

fn check(case: &Case, causal: bool, window: Option<usize>, what: &str) {
    let scale = 1.0 / (case.d as f32).sqrt();
    let want = naive(case, scale, causal, window);
    simd::on_both_paths(|path| {
        for kernel in KERNELS {
            let got = paged(case, scale, causal, window, kernel);
            assert_close(&got, &want, 1e-5, &format!("{what} ({path}, {kernel:?})"));
        }
        // Both kernels in one batch, alternating by sequence.
        let got = paged_cut(case, scale, causal, window, &KERNELS, usize::MAX);
        assert_close(&got, &want, 1e-5, &format!("{what} ({path}, mixed kernels)"));
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
    // One row per sequence. 9 heads over 3 kv heads, head_dim 64.
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
fn tiled_runs_match_reference() {
    let mut rng = Rng::new(45);
    // The default model's shape (9 heads over 3 kv heads, head_dim 64, pages of 16): a fresh prefill,
    // chunked prefills continuing after a context (not page-aligned; row counts that leave a short
    // last block of the 16-row blocks), and a single row in the same batch.
    let case = make_paged_case(&mut rng, 16, 9, 3, 64, &[(0, 37), (21, 19), (50, 1), (13, 26)]);
    check(&case, true, None, "prefill batch");
    check(&case, false, None, "prefill batch, non-causal");
    check(&case, true, Some(5), "prefill batch, window 5");
    check(&case, true, Some(20), "prefill batch, window 20");
    // Group 5 (tiles that cut rows, a last tile of 7 vectors), head_dim 22 (kernel block tails), pages
    // of 4.
    let case = make_case(&mut rng, 10, 2, 22, &[(6, 11), (0, 9)]);
    check(&case, true, None, "group 5");
    check(&case, false, Some(7), "group 5, non-causal window 7");
    // Group 26: one row's heads span two tiles.
    let case = make_case(&mut rng, 26, 1, 8, &[(3, 2), (0, 5)]);
    check(&case, true, None, "group 26");
    check(&case, true, Some(3), "group 26, window 3");
    // No grouping: 16 rows per tile; 2 rows fill 2 lanes of one.
    let case = make_paged_case(&mut rng, 16, 2, 2, 16, &[(5, 30), (40, 2)]);
    check(&case, true, None, "group 1");
    check(&case, true, Some(9), "group 1, window 9");
}

#[test]
fn long_contexts_merge_key_chunks() {
    let mut rng = Rng::new(47);
    // Keys past one and two chunks: decode rows alone and together, a verify run and a chunked prefill
    // whose rows straddle a chunk bound.
    let case = make_paged_case(&mut rng, 16, 9, 3, 64, &[(530, 1)]);
    check(&case, true, None, "decode after 530");
    let case = make_paged_case(&mut rng, 16, 9, 3, 64, &[(600, 9), (250, 1), (255, 12)]);
    check(&case, true, None, "verify and prefill past a chunk");
    check(&case, true, Some(300), "window 300");
    check(&case, false, Some(280), "non-causal window 280");
}

/// Several sequences' data as one batch, pages renumbered apart.
fn concat_cases(cases: &[&Case]) -> Case {
    let mut seqs = Vec::new();
    let mut shift = 0;
    for case in cases {
        seqs.extend(
            case.seqs.iter().map(|s| SeqData { pages: s.pages.iter().map(|p| p + shift).collect(), ..s.clone() }),
        );
        shift += case.seqs.iter().flat_map(|s| &s.pages).max().map_or(0, |&p| p + 1);
    }
    let q = cases.iter().flat_map(|c| c.q.iter().copied()).collect();
    let first = cases[0];
    Case { page: first.page, heads: first.heads, kv_heads: first.kv_heads, d: first.d, seqs, q }
}

#[test]
fn a_rows_outputs_do_not_depend_on_the_batch() {
    let mut rng = Rng::new(46);
    // The default model's shape. 21 rows after 300 keys: a row's keys cross the first key chunk.
    let alone = make_paged_case(&mut rng, 16, 9, 3, 64, &[(300, 21)]);
    // Neighbours that change every batch-level choice: rows before it, long and short contexts.
    let before = make_paged_case(&mut rng, 16, 9, 3, 64, &[(3, 14), (700, 1)]);
    let after = make_paged_case(&mut rng, 16, 9, 3, 64, &[(40, 2)]);
    let batch = concat_cases(&[&before, &alone, &after]);
    let rows = before.q.len()..before.q.len() + alone.q.len();
    let scale = 0.125;
    simd::on_both_paths(|path| {
        for kernel in KERNELS {
            for window in [None, Some(6), Some(290)] {
                let want = paged(&alone, scale, true, window, kernel);
                let how = format!("{kernel:?}, window {window:?} ({path})");
                // Bit-identical: the same arithmetic whatever else is in the batch, and however the
                // sequence's rows were cut into runs (a prompt split into chunks, a verify into rows).
                let got = paged(&batch, scale, true, window, kernel);
                assert!(got[rows.clone()] == want[..], "in a batch: {how}");
                for cut in [1, 2, 5] {
                    let got = paged_cut(&alone, scale, true, window, &[kernel], cut);
                    assert!(got == want, "cut every {cut} rows: {how}");
                }
            }
        }
    });
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
    let seq = AttnSeq { first_row: 0, num_rows: 2, context_len: 5, block_table: &table, kernel: RowKernel::PerRow };
    for kernel in KERNELS {
        let mut out = Tensor::from_f32(&vec![7.0; 3 * heads * d], &[3, heads * d]).expect("out");
        paged_attention(&q, &kc, &vc, &[AttnSeq { kernel, ..seq }], heads, 1, d, 0.3, true, None, &mut out)
            .expect("attn");
        let out = out.as_f32().expect("out");
        assert!(out[2 * heads * d..].iter().all(|&v| v == 0.0), "{kernel:?}");
        assert!(out[..2 * heads * d].iter().all(|&v| v != 7.0), "{kernel:?}");
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
