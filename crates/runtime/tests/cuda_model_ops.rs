//! The fused kernels of the CUDA model forward other than the matmuls (those are in cuda_matmul_ops) against
//! their CPU twins, on fresh random inputs with odd sizes and outputs poisoned with NaN: the quantized
//! embedding, RoPE + KV write, paged attention (prompt and split-key modes, GQA, shuffled pages, head_dim up to
//! 256; split-key mode with the RoPE + KV write folded in, bit for bit), the tensor-core prompt attention, the
//! gathered final norm, the capture copy, and a CUDA graph replayed with new inputs.
//!
//! Without a CUDA device every test prints a SKIP notice and passes. Tolerances (`err` = |gpu − cpu|):
//! * exact: the quantized embedding (same dequantization arithmetic), q and K/V from RoPE + KV write
//!   without a head norm, the capture copy, the graph replay against the same step run eagerly;
//! * attention `2e-5` absolute against an f64 reference (outputs are averages of values in [-1, 1]);
//!   split-key rows bit-identical however they are batched; the tensor-core prompt kernel `1e-2` absolute
//!   and `1e-3` on average (q, k, v and the softmax weights rounded to bf16);
//! * norms `1e-5 · max(1, |cpu|)` (q and k after RoPE + KV write's head norm `1e-5` absolute).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{
    bit_mismatches, check, cpu_rms_norm, device, f32_tensor, max_err_over, quant_matrix, stream_alone, stream_shared,
};
use common::Rng;

use dflash_runtime::cuda::ops::{self as gpu, AttentionArgs, AttentionScratch, Epilogue, KeySplit, MmvqArgs};
use dflash_runtime::cuda::{CudaDevice, CudaRopeTable, DeviceBuf};
use dflash_runtime::ops::{self as cpu, RopeScaling, RopeStyle, RopeTable};
use dflash_runtime::{DType, Tensor};

fn poisoned(dev: &CudaDevice, len: usize) -> DeviceBuf<f32> {
    dev.upload(&vec![f32::NAN; len]).expect("poisoned output")
}

#[test]
fn quantized_embedding_dequantizes_exactly() {
    let _stream = stream_shared();
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
    let _stream = stream_shared();
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

/// How decode rows are tiled: as many rows per tile as fit (fixed splits), also cut where the split size class
/// changes (scaled splits, as the model's planner), as that with at most 8 query vectors a tile (the planner's
/// tiles on models of up to 16 query heads), or one row per tile.
#[derive(Clone, Copy, PartialEq)]
enum Tiling {
    Fixed,
    Scaled,
    ScaledEight,
    RowByRow,
}

fn attention_inputs(case: &AttnCase, only_seq: Option<usize>, tiling: Tiling) -> AttnInputs {
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
                let mut m = tile_rows.min(start + n - r);
                if decode {
                    let class = |row: usize| gpu::attn_split_keys(a.row_keys[row] as usize, case.kvh);
                    m = match tiling {
                        Tiling::Fixed => m,
                        Tiling::Scaled => (1..m).find(|&i| class(r + i) != class(r)).unwrap_or(m),
                        Tiling::ScaledEight => {
                            let m = m.min((8 / (case.nh / case.kvh)).max(1));
                            (1..m).find(|&i| class(r + i) != class(r)).unwrap_or(m)
                        }
                        Tiling::RowByRow => 1,
                    };
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
    split: KeySplit,
) {
    let up = |v: &[u32]| dev.upload(if v.is_empty() { &[0u32][..] } else { v }).expect("upload");
    let (row_keys, pt, dt) = (up(&inputs.row_keys), up(&inputs.prompt_tiles), up(&inputs.decode_tiles));
    let max_splits = match split {
        KeySplit::Fixed { max_splits, .. } | KeySplit::Scaled { max_splits, .. } => max_splits,
        KeySplit::Whole => 1,
    };
    let scratch = AttentionScratch::new(dev, inputs.partial_rows.len(), case.nh, case.d, max_splits).expect("scratch");
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
        gpu::paged_attention(dev, args(dt.view(), inputs.max_decode_rows, split), &scratch).expect("decode");
    }
}

#[test]
fn paged_attention_matches_reference_and_is_batch_invariant() {
    let _stream = stream_shared();
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
        // Qwen3-8B's grouping past 1,024 keys, where scaled splits grow: verifies across the 1,024 and 2,048 key
        // size classes, a decode row at 3,000 keys (128-key splits).
        AttnCase { seqs: vec![(1015, 16, 0), (2040, 12, 0), (3000, 1, 0)], nh: 8, kvh: 2, d: 128, ps: 16 },
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
        let shape = format!("{t} rows, {nh}/{kvh} heads of {d}, pages of {ps}");
        let row_len = nh * d;
        let run = |inputs: &AttnInputs, split: KeySplit| {
            let out = poisoned(dev, t * nh * d);
            attention_on_device(dev, &case, inputs, &q_dev, (&k_dev, &v_dev), (&tables_dev, stride), &out, split);
            dev.download(&out).expect("download")
        };
        // Bits of `got` and `want` that differ in the decode rows `inputs` names.
        let decode_mismatches = |inputs: &AttnInputs, got: &[f32], want: &[f32]| -> f64 {
            let row = |v: &[f32], r: u32| v[r as usize * row_len..][..row_len].to_vec();
            inputs.partial_rows.iter().map(|&r| bit_mismatches(&row(got, r), &row(want, r))).sum()
        };
        // Fixed 64-key splits, then splits scaled to each row's keys.
        for tiling in [Tiling::Fixed, Tiling::Scaled] {
            let inputs = attention_inputs(&case, None, tiling);
            let (name, splits) = match tiling {
                Tiling::Fixed => ("fixed", inputs.max_keys.div_ceil(64).max(1)),
                _ => ("scaled", gpu::attn_max_splits(inputs.max_keys, kvh)),
            };
            let split = |max_splits, partial_rows| match tiling {
                Tiling::Fixed => KeySplit::Fixed { keys: 64, max_splits, partial_rows },
                _ => KeySplit::Scaled { max_splits, partial_rows },
            };
            let got = run(&inputs, split(splits, inputs.partial_rows.len()));
            let err = max_err_over(&got, &want, &vec![1.0; want.len()]);
            check(&format!("paged_attention, {name} splits"), &shape, err, 2e-5);
            // Each sequence's decode rows alone, with more split blocks than needed: the same bits.
            for s in 0..case.seqs.len() {
                let alone = attention_inputs(&case, Some(s), tiling);
                if alone.decode_tiles.is_empty() {
                    continue;
                }
                let got2 = run(&alone, split(splits + 3, alone.partial_rows.len()));
                let diff = decode_mismatches(&alone, &got2, &got);
                check(&format!("{name} splits: decode rows alone"), &format!("seq {s} of {shape}"), diff, 0.0);
            }
            // Scaled: a row's cut points depend only on its own keys, so every decode row alone in a tile of its
            // own gives the same bits as in its verify tile.
            if tiling == Tiling::Scaled {
                let rows = attention_inputs(&case, None, Tiling::RowByRow);
                let got3 = run(&rows, split(splits, rows.partial_rows.len()));
                check("scaled splits: one row per tile", &shape, decode_mismatches(&rows, &got3, &got), 0.0);
                let eight = attention_inputs(&case, None, Tiling::ScaledEight);
                let got4 = run(&eight, split(splits, eight.partial_rows.len()));
                check("scaled splits: 8 vectors a tile", &shape, decode_mismatches(&eight, &got4, &got), 0.0);
            }
        }
    }
}

/// Decode and verify rows' attention with RoPE + K/V write folded in, and rope_kv_write then paged_attention, on
/// the same inputs: the same output bits and the same caches after.
#[test]
fn attention_with_rope_folded_in_equals_rope_kv_write_then_attention() {
    let _stream = stream_shared();
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(28);
    let eps = 1e-6;
    // (case, rotary dims, head norm, padded sequences): padded sequences are a graph's (every row at position 0,
    // keys 1..=rows, all writing the spare page); only the real rows and pages are compared.
    let cases = [
        // Qwen3-0.6B's heads, head norm: decode rows (one over 3 key splits), an 8-row verify, two padded
        // sequences of 8 rows.
        (AttnCase { seqs: vec![(70, 1, 0), (5, 1, 0), (121, 8, 0)], nh: 16, kvh: 8, d: 128, ps: 16 }, 128, true, 2),
        // Qwen3-8B's grouping (4 rows per tile): verifies of 4, 8 and 16 rows (2 and 4 tiles, keys of one tile in
        // another's split), one across a split boundary, a verify of 2 rows over 18 splits of 64 keys, one of 8
        // rows across the 1,024-key size class, odd pages, no head norm, a padded sequence of 16 rows over 4
        // pages of 5.
        (
            AttnCase {
                seqs: vec![(30, 4, 0), (0, 1, 0), (57, 8, 0), (100, 16, 0), (1100, 2, 0), (1020, 8, 0)],
                nh: 32,
                kvh: 8,
                d: 128,
                ps: 5,
            },
            128,
            false,
            1,
        ),
        // Qwen3-Next's attention heads (the head_dim 256 kernel, 2 rows per tile), a quarter of the dims rotated,
        // a verify of 5 rows in 3 tiles.
        (AttnCase { seqs: vec![(200, 1, 0), (93, 2, 0), (27, 5, 0)], nh: 16, kvh: 2, d: 256, ps: 16 }, 64, true, 0),
        // SmolLM2's heads (64 dims, 3 query heads per kv head: tiles of 5 rows; the general RoPE path), verifies
        // of 7 rows in 2 tiles.
        (AttnCase { seqs: vec![(45, 1, 0), (90, 7, 0), (1300, 7, 0)], nh: 9, kvh: 3, d: 64, ps: 16 }, 64, true, 1),
        // Heads of 96 dims (neither size with a build of its own: the general kernel), a verify of 6 rows in 2 tiles.
        (AttnCase { seqs: vec![(33, 1, 0), (70, 6, 0)], nh: 8, kvh: 2, d: 96, ps: 16 }, 96, true, 1),
    ];
    for (mut case, rot, head_norm, pads) in cases {
        let real_seqs = case.seqs.len();
        let pad_rows = case.seqs.iter().map(|s| s.1).max().unwrap_or(1);
        case.seqs.extend(std::iter::repeat_n((0, pad_rows, 0), pads));
        let (nh, kvh, d, ps) = (case.nh, case.kvh, case.d, case.ps);
        let table = RopeTable::new(rot, 10_000.0, &RopeScaling::None, RopeStyle::Neox).expect("table");
        let rope = CudaRopeTable::new(dev, &table, 2048).expect("rope table");
        let (qw, kw) = (nh * d, kvh * d);
        let qkv_ld = qw + 2 * kw + 3;
        // Shuffled pages, the last one spare; row j of a real sequence at context c is key (and position) c + j,
        // in its table's slot; a padded sequence's every page is the spare one.
        let need: Vec<usize> = case.seqs.iter().map(|&(c, r, _)| (c + r).div_ceil(ps)).collect();
        let num_pages = need[..real_seqs].iter().sum::<usize>() + 1;
        let spare = (num_pages - 1) as u32;
        let mut pages: Vec<u32> = (0..spare).collect();
        for i in (1..pages.len()).rev() {
            pages.swap(i, rng.below(i + 1));
        }
        let stride = need.iter().max().copied().unwrap_or(1);
        let (mut flat, mut positions, mut slots, mut next) = (Vec::new(), Vec::new(), Vec::new(), 0);
        for (i, (&n, &(ctx, rows, _))) in need.iter().zip(&case.seqs).enumerate() {
            if i >= real_seqs {
                flat.extend(std::iter::repeat_n(spare, stride));
                positions.extend(std::iter::repeat_n(0, rows));
                slots.extend((0..rows).map(|j| spare * ps as u32 + (j % ps) as u32));
                continue;
            }
            let t = &pages[next..next + n];
            flat.extend(t.iter().copied().chain(std::iter::repeat_n(num_pages as u32, stride - n)));
            positions.extend((ctx..ctx + rows).map(|p| p as u32));
            slots.extend((ctx..ctx + rows).map(|p| t[p / ps] * ps as u32 + (p % ps) as u32));
            next += n;
        }
        let (rows, real_rows) = (positions.len(), case.seqs[..real_seqs].iter().map(|s| s.1).sum::<usize>());
        let cache_len = num_pages * ps * kw;
        let (qkv, kc, vc) = (rng.vec(rows * qkv_ld, 2.0), rng.vec(cache_len, 1.0), rng.vec(cache_len, 1.0));
        let (qn, kn) = (rng.vec(d, 1.0), rng.vec(d, 1.0));
        let inputs = attention_inputs(&case, None, Tiling::Scaled);
        let up = |v: &[u32]| dev.upload(v).expect("upload");
        let (row_keys, tiles, tables_dev) = (up(&inputs.row_keys), up(&inputs.decode_tiles), up(&flat));
        let (pos_dev, slots_dev) = (up(&positions), up(&slots));
        let (qkv_dev, qn_dev, kn_dev) =
            (dev.upload(&qkv).expect("qkv"), dev.upload(&qn).expect("qn"), dev.upload(&kn).expect("kn"));
        let max_splits = gpu::attn_max_splits(inputs.max_keys, kvh) + 1;
        let max_seq_rows = case.seqs.iter().map(|s| s.1).max().unwrap_or(1);
        let scratch = AttentionScratch::new(dev, inputs.partial_rows.len(), nh, d, max_splits).expect("scratch");
        let split = KeySplit::Scaled { max_splits, partial_rows: inputs.partial_rows.len() };
        let run = |fold: bool| -> (Vec<f32>, Vec<f32>, Vec<f32>) {
            let (k_dev, v_dev) = (dev.upload(&kc).expect("k"), dev.upload(&vc).expect("v"));
            let (q, out) = (poisoned(dev, rows * qw), poisoned(dev, rows * qw));
            let rope_args = gpu::RopeKvArgs {
                qkv: qkv_dev.view(),
                qkv_ld,
                q_out: q.view(),
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
            let args = AttentionArgs {
                q: q.view(),
                k_cache: k_dev.view(),
                v_cache: v_dev.view(),
                row_keys: row_keys.view(),
                tiles: tiles.view(),
                max_tile_rows: inputs.max_decode_rows,
                tables: tables_dev.view(),
                table_stride: stride,
                page_size: ps,
                out: out.view(),
                num_heads: nh,
                kv_heads: kvh,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                split,
            };
            if fold {
                gpu::paged_attention_rope(dev, args, rope_args, max_seq_rows, &scratch).expect("paged_attention_rope");
            } else {
                gpu::rope_kv_write(dev, rope_args).expect("rope_kv_write");
                gpu::paged_attention(dev, args, &scratch).expect("paged_attention");
            }
            let get = |b: &DeviceBuf<f32>| dev.download(b).expect("download");
            (get(&out), get(&k_dev), get(&v_dev))
        };
        let ((out_a, k_a, v_a), (out_b, k_b, v_b)) = (run(false), run(true));
        let shape = format!(
            "{real_rows} + {} padded rows, {nh}/{kvh} heads of {d}, rot {rot}, norm {head_norm}",
            rows - real_rows
        );
        let (real_out, real_cache) = (real_rows * qw, (num_pages - 1) * ps * kw);
        assert!(out_a[..real_out].iter().all(|x| x.is_finite()), "the reference path left rows unwritten");
        check("paged_attention_rope out", &shape, bit_mismatches(&out_b[..real_out], &out_a[..real_out]), 0.0);
        check("paged_attention_rope K cache", &shape, bit_mismatches(&k_b[..real_cache], &k_a[..real_cache]), 0.0);
        check("paged_attention_rope V cache", &shape, bit_mismatches(&v_b[..real_cache], &v_a[..real_cache]), 0.0);
        assert!(out_b[real_out..].iter().all(|x| x.is_finite()), "padded rows attend their own keys");
    }
}

#[test]
fn tensor_core_prompt_attention_matches_reference_within_bf16_rounding() {
    let _stream = stream_shared();
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(25);
    let cases = [
        // Qwen3-8B's grouping: a 200-row prompt (tiles of 64 and a short one), a chunk of 70 rows after 37 keys.
        AttnCase { seqs: vec![(0, 200, 200), (37, 70, 70)], nh: 8, kvh: 2, d: 128, ps: 16 },
        // SmolLM2's heads, odd pages, a chunk shorter than a warp's 16 rows.
        AttnCase { seqs: vec![(0, 130, 130), (10, 5, 5)], nh: 9, kvh: 3, d: 64, ps: 5 },
        // Three tiles of a chunk after 300 keys (the first copies them all), a warp's rows cut mid-tile.
        AttnCase { seqs: vec![(300, 333, 333), (0, 40, 40)], nh: 4, kvh: 1, d: 128, ps: 16 },
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
            // Each tile copies its keys to bf16 from where the tile before it ended (the plan's tiles).
            for start in (0..rows).step_by(gpu::TC_ATTN_TILE_ROWS) {
                let n = gpu::TC_ATTN_TILE_ROWS.min(rows - start);
                let key_lo = if start == 0 { 0 } else { ctx + start };
                tiles.extend([s as u32, (row_keys.len() + start) as u32, n as u32, key_lo as u32]);
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
        // The bf16 copy of the keys starts as NaN: a key the tiles fail to copy poisons its rows.
        let kv_bf16 = dev.upload(&vec![half::bf16::NAN; 2 * cache_len]).expect("bf16 keys");
        gpu::prompt_attention_tc(dev, args, kv_bf16.view()).expect("prompt_attention_tc");
        let got = dev.download(&out).expect("download");
        let shape = format!("{t} rows, {nh}/{kvh} heads of {d}");
        // q, k, v and the softmax weights rounded to bf16: a few 1e-3 on outputs of size 1.
        check("prompt_attention_tc", &shape, max_err_over(&got, &want, &vec![1.0; want.len()]), 1e-2);
        let mean = got.iter().zip(&want).map(|(g, w)| (g - w).abs() as f64).sum::<f64>() / want.len() as f64;
        check("prompt_attention_tc mean", &shape, mean, 1e-3);
    }
}

#[test]
fn gathered_final_norm_and_capture_copy_match_cpu() {
    let _stream = stream_shared();
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

    // Rows to cache slots, one slot past the pool's rows (skipped), the others in any order.
    let pool_rows = 40;
    let slots: Vec<u32> = vec![17, 3, 39, 0, pool_rows as u32, 22, 8, 31, 5];
    let pool = poisoned(dev, pool_rows * h);
    gpu::scatter_rows(dev, &x_dev, &dev.upload(&slots).expect("slots"), &pool, h).expect("scatter");
    let got = dev.download(&pool).expect("download");
    let mut want = vec![f32::NAN; pool_rows * h];
    for (r, &slot) in slots.iter().enumerate().filter(|(_, &s)| (s as usize) < pool_rows) {
        want[slot as usize * h..][..h].copy_from_slice(&x[r * h..][..h]);
    }
    check("scatter_rows", "9x576 into 40 slots", bit_mismatches(&got, &want), 0.0);
}

#[test]
fn captured_graph_replays_with_new_inputs() {
    let _stream = stream_alone();
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
            scratch: None,
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
