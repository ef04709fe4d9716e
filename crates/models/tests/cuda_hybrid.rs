//! The CUDA hybrid forward against the CPU one ([`HybridModel`]) on the tiny parity fixtures
//! (tiny-qwen3-next: GDN + gated attention + MoE with a shared expert + a dense layer; tiny-qwen3-moe; and
//! tiny-qwen3-next-hc, the first with four hyper-connection streams, its taps read as the streams' mean):
//! logits, captured hidden states and the GDN states after a prefill and after decode steps (eager and
//! graph-replayed), and the rollback contract: a verify of `w` rows then `rollback(kept)` leaves the state of a
//! forward over the kept rows, for every kept count.
//!
//! Needs `--features cuda` and a CUDA device; without one every test prints a SKIP notice and passes.
//! Tolerances, on `|cuda − cpu| / max(1, |cpu|)`: 1e-4 with the weights widened to f32 on both sides; 0.5 with
//! bf16 weights (the device rounds activations to bf16 before dense matmuls, the CPU does not), where what
//! speculation needs is checked exactly instead: a verify's rows equal one-row decode steps bit for bit. Rollback:
//! a verify committed whole equals a plain forward bit for bit; for fewer kept rows the state equals a forward
//! over the kept rows alone within f32 rounding (1e-5). Why each: docs/CUDA.md, "Hybrid targets".
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::{fixtures, say};
use dflash_models::cuda::CudaCacheConfig;
use dflash_models::hybrid::cuda::{CudaHybridCache, CudaHybridModel, GdnSeq};
use dflash_models::hybrid::{load_hybrid_weights, HybridModel, HybridState};
use dflash_models::LoadOptions;
use dflash_models::{ForwardBatch, KvCache, SeqRows};
use dflash_runtime::cuda::CudaDevice;

const PAGE: usize = 4;

fn device() -> Option<common::DeviceTurn> {
    common::cuda_device("cuda hybrid tests")
}

fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| if g.is_nan() { f32::INFINITY } else { (g - w).abs() / w.abs().max(1.0) })
        .fold(0.0, f32::max)
}

fn check(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let err = max_rel_err(got, want);
    say(&format!("{what:<58} max err {err:.3e} (tol {tol:.0e})"));
    assert!(err <= tol, "{what}: {err:e} over {tol:e}");
}

fn load_cpu(name: &str, f32_weights: bool) -> HybridModel {
    let opts = LoadOptions { capture_layers: vec![1, 2], f32_weights, ..Default::default() };
    load_hybrid_weights(&fixtures().join(name), &opts).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

fn cache(model: &CudaHybridModel, graphs: bool) -> CudaHybridCache {
    let mut cfg = CudaCacheConfig::new(64, PAGE, 64, 4, 200);
    cfg.graphs = graphs;
    model.new_cache(cfg, 4).expect("cache")
}

/// Reversed, offset pages, so attention must follow the table.
fn table(offset: u32) -> Vec<u32> {
    (0..12u32).map(|p| offset + 11 - p).collect()
}

/// One forward of rows `pos .. pos + tokens.len()` of a sequence with `prompt` prompt tokens.
fn batch_parts(tokens: &[u32], pos: usize, table: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let n = tokens.len();
    let positions = (pos..pos + n).map(|p| p as u32).collect();
    let slots = (pos..pos + n).map(|p| table[p / PAGE] * PAGE as u32 + (p % PAGE) as u32).collect();
    (positions, slots, (0..n as u32).collect())
}

/// A sequence run on both models step by step.
struct Both<'m> {
    cpu: &'m HybridModel,
    gpu: &'m CudaHybridModel,
    kv: KvCache,
    state: HybridState,
    cache: CudaHybridCache,
    table: Vec<u32>,
    len: usize,
    prompt: usize,
}

impl<'m> Both<'m> {
    fn new(cpu: &'m HybridModel, gpu: &'m CudaHybridModel, prompt: usize, graphs: bool) -> Self {
        let kv = cpu.new_kv_cache(64, PAGE).expect("kv");
        Both { cpu, gpu, kv, state: cpu.new_state(), cache: cache(gpu, graphs), table: table(3), len: 0, prompt }
    }

    /// Runs `tokens` on both; returns (cpu, gpu) logits and captured states.
    fn step(&mut self, tokens: &[u32]) -> [(Vec<f32>, Vec<f32>); 2] {
        let (positions, slots, rows) = batch_parts(tokens, self.len, &self.table);
        let seqs = [SeqRows {
            num_rows: tokens.len(),
            context_len: self.len,
            block_table: &self.table,
            prompt_len: self.prompt,
        }];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
        let c = self.cpu.forward(&batch, &mut self.kv, &mut [&mut self.state]).expect("cpu forward");
        let g = self.gpu.forward(&batch, &mut self.cache, &[GdnSeq { slot: 1, verify: false }]).expect("gpu forward");
        self.len += tokens.len();
        let flat = |o: dflash_models::ForwardOut| {
            let cap = o.captured.map(|t| t.as_f32().expect("f32").to_vec()).unwrap_or_default();
            (o.logits.as_f32().expect("f32").to_vec(), cap)
        };
        [flat(c), flat(g)]
    }

    fn states(&self) -> [(Vec<f32>, Vec<f32>); 2] {
        let n = self.state.num_layers();
        let conv = (0..n).flat_map(|i| self.state.layer(i).conv().to_vec()).collect();
        let ssm = (0..n).flat_map(|i| self.state.layer(i).ssm().to_vec()).collect();
        [(conv, ssm), self.gpu.read_state(&self.cache, 1).expect("gpu state")]
    }
}

fn prompt() -> Vec<u32> {
    (0..37u32).map(|i| (i * 37 + 11) % 256).collect()
}

#[test]
fn prefill_and_decode_match_the_cpu() {
    let Some(dev) = device() else { return };
    for (name, f32_weights, tol) in [
        ("tiny-qwen3-next", true, 1e-4),
        ("tiny-qwen3-next", false, 0.5),
        ("tiny-qwen3-moe", true, 1e-4),
        ("tiny-qwen3-next-hc", true, 1e-4),
    ] {
        let cpu = load_cpu(name, f32_weights);
        let gpu = CudaHybridModel::from_host(dev.clone(), &cpu).expect("upload");
        for graphs in [false, true] {
            let what = format!("{name} {} graphs {graphs}", if f32_weights { "f32" } else { "bf16" });
            let p = prompt();
            let mut both = Both::new(&cpu, &gpu, p.len(), graphs);
            // bf16: the prompt one row per forward (see the module docs).
            let chunks: Vec<&[u32]> = if f32_weights { vec![&p] } else { p.chunks(1).collect() };
            for chunk in chunks {
                let [(cl, cc), (gl, gc)] = both.step(chunk);
                check(&format!("{what}: prefill logits"), &gl, &cl, tol);
                check(&format!("{what}: prefill captured"), &gc, &cc, tol);
            }
            if !cpu.config().gdn_layers().is_empty() {
                let [(cconv, cssm), (gconv, gssm)] = both.states();
                check(&format!("{what}: conv state after prefill"), &gconv, &cconv, tol);
                check(&format!("{what}: recurrent state after prefill"), &gssm, &cssm, tol);
            }
            let mut next = 7u32;
            for i in 0..6 {
                let [(cl, _), (gl, _)] = both.step(&[next]);
                check(&format!("{what}: decode step {i} logits"), &gl, &cl, tol);
                next = (next * 31 + 5) % 256;
            }
            if !cpu.config().gdn_layers().is_empty() {
                let [(_, cssm), (_, gssm)] = both.states();
                check(&format!("{what}: recurrent state after decode"), &gssm, &cssm, tol);
            }
            if graphs {
                // Decode steps (and, for bf16, the one-row prompt steps past the first) replay one graph.
                assert_eq!(both.cache.graph_count(), 1, "decode steps replay one graph");
            }
        }
    }
}

/// A prompt chunk that samples no row (a prompt longer than a step, on bf16 weights) runs, and the chunk after it
/// gives the logits of a run whose first chunk asked for a logit row, bit for bit. (The bf16 LM head once sent
/// zero rows to the one-row GEMV, which read a row of the empty input.)
#[test]
fn a_prompt_chunk_without_logit_rows_runs_on_bf16_weights() {
    let Some(dev) = device() else { return };
    let cpu = load_cpu("tiny-qwen3-next", false);
    let gpu = CudaHybridModel::from_host(dev.clone(), &cpu).expect("upload");
    let (p, tab) = (prompt(), table(3));
    let run = |cache: &mut CudaHybridCache, tokens: &[u32], pos: usize, logit_rows: &[u32]| -> Vec<f32> {
        let (positions, slots, _) = batch_parts(tokens, pos, &tab);
        let seqs = [SeqRows { num_rows: tokens.len(), context_len: pos, block_table: &tab, prompt_len: p.len() }];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows };
        let out = gpu.forward(&batch, cache, &[GdnSeq { slot: 1, verify: false }]).expect("forward");
        out.logits.as_f32().expect("f32").to_vec()
    };
    let (mut a, mut b) = (cache(&gpu, false), cache(&gpu, false));
    assert!(run(&mut a, &p[..20], 0, &[]).is_empty(), "no logit rows, no logits");
    run(&mut b, &p[..20], 0, &[19]);
    let rest: Vec<u32> = (0..17).collect();
    let (got, want) = (run(&mut a, &p[20..], 20, &rest), run(&mut b, &p[20..], 20, &rest));
    assert_eq!(got, want, "the rest of the prompt after a chunk without logit rows");
}

/// Verify `w` rows, roll back to `kept`: the verify leaves the state alone and blocks the next step until
/// resolved; committed whole it equals a plain forward of the same rows bit for bit; for every kept count
/// the state and the next step's logits equal a forward over the kept rows (see the module docs).
#[test]
fn rollback_after_a_verify_equals_a_forward_over_the_kept_rows() {
    let Some(dev) = device() else { return };
    for name in ["tiny-qwen3-next", "tiny-qwen3-next-hc"] {
        rollback_after_a_verify(&dev, name);
    }
}

fn rollback_after_a_verify(dev: &Arc<CudaDevice>, name: &str) {
    let cpu = load_cpu(name, true);
    let gpu = CudaHybridModel::from_host(dev.clone(), &cpu).expect("upload");
    let p = prompt();
    let tab = table(3);
    let verify: Vec<u32> = vec![9, 200, 31, 77, 5];
    let run = |cache: &mut CudaHybridCache, tokens: &[u32], pos: usize, verify: bool| -> Vec<f32> {
        let (positions, slots, rows) = batch_parts(tokens, pos, &tab);
        let seqs = [SeqRows { num_rows: tokens.len(), context_len: pos, block_table: &tab, prompt_len: p.len() }];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
        let out = gpu.forward(&batch, cache, &[GdnSeq { slot: 2, verify }]).expect("forward");
        out.logits.as_f32().expect("f32").to_vec()
    };
    let flat = |s: (Vec<f32>, Vec<f32>)| -> Vec<f32> { s.0.into_iter().chain(s.1).collect() };
    for graphs in [false, true] {
        for kept in 1..=verify.len() {
            let (mut a, mut b) = (cache(&gpu, graphs), cache(&gpu, graphs));
            run(&mut a, &p, 0, false);
            run(&mut b, &p, 0, false);
            let before = gpu.read_state(&a, 2).expect("state");
            let verified = run(&mut a, &verify, p.len(), true);
            assert_eq!(gpu.read_state(&a, 2).expect("state"), before, "a verify leaves the state alone");
            {
                let (positions, slots, rows) = batch_parts(&[1], p.len(), &tab);
                let seqs = [SeqRows { num_rows: 1, context_len: p.len(), block_table: &tab, prompt_len: p.len() }];
                let batch =
                    ForwardBatch { tokens: &[1], positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
                let blocked = gpu.forward_greedy(&batch, &mut a, &[GdnSeq { slot: 2, verify: false }]);
                assert!(blocked.is_err(), "a pending verify blocks the next step");
            }
            gpu.rollback(&mut a, &[kept]).expect("rollback");
            if kept == verify.len() {
                let plain = run(&mut b, &verify, p.len(), false);
                assert_eq!(plain, verified, "a verify's logits are a plain forward's");
                assert_eq!(gpu.read_state(&a, 2).expect("a"), gpu.read_state(&b, 2).expect("b"), "commit = forward");
            } else {
                run(&mut b, &verify[..kept], p.len(), false);
                let (sa, sb) = (flat(gpu.read_state(&a, 2).expect("a")), flat(gpu.read_state(&b, 2).expect("b")));
                check(&format!("graphs {graphs}: state after rollback to {kept} of 5"), &sa, &sb, 1e-5);
            }
            let next = [42u32];
            let (la, lb) = (run(&mut a, &next, p.len() + kept, false), run(&mut b, &next, p.len() + kept, false));
            check(&format!("graphs {graphs}: next step after rollback to {kept} of 5"), &la, &lb, 1e-5);
        }
    }
}

/// bf16 weights: the rows of a verify forward give the logits of one-row decode steps over the same tokens,
/// bit for bit (the small matmul, attention's split-key rows, the recurrent rule and the expert kernels are
/// all batch-invariant), so greedy and seeded speculation give plain decoding's tokens.
#[test]
fn bf16_verify_rows_equal_decode_steps_bit_for_bit() {
    let Some(dev) = device() else { return };
    // With hyper-connection streams too: lossless speculation on a stream target rests on the same property.
    for name in ["tiny-qwen3-next", "tiny-qwen3-next-hc"] {
        bf16_verify_rows_equal_decode_steps(&dev, name);
    }
}

fn bf16_verify_rows_equal_decode_steps(dev: &Arc<CudaDevice>, name: &str) {
    let cpu = load_cpu(name, false);
    let gpu = CudaHybridModel::from_host(dev.clone(), &cpu).expect("upload");
    let (p, tab) = (prompt(), table(3));
    let run = |cache: &mut CudaHybridCache, tokens: &[u32], pos: usize, verify: bool| -> Vec<f32> {
        let (positions, slots, rows) = batch_parts(tokens, pos, &tab);
        let seqs = [SeqRows { num_rows: tokens.len(), context_len: pos, block_table: &tab, prompt_len: p.len() }];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
        let out = gpu.forward(&batch, cache, &[GdnSeq { slot: 1, verify }]).expect("forward");
        out.logits.as_f32().expect("f32").to_vec()
    };
    let drafts: Vec<u32> = vec![9, 200, 31, 77, 5, 140, 66, 3];
    for graphs in [false, true] {
        let (mut a, mut b) = (cache(&gpu, graphs), cache(&gpu, graphs));
        run(&mut a, &p, 0, false);
        run(&mut b, &p, 0, false);
        let steps: Vec<f32> =
            drafts.iter().enumerate().flat_map(|(i, &t)| run(&mut a, &[t], p.len() + i, false)).collect();
        let verified = run(&mut b, &drafts, p.len(), true);
        let differing = steps.iter().zip(&verified).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        say(&format!("bf16 graphs {graphs}: {} verify logits, {differing} differ from decode steps", steps.len()));
        assert_eq!(differing, 0, "a verify row's logits are a decode step's, bit for bit");
    }
}

/// Two sequences in one forward give each what it gets alone (f32 weights: within f32 rounding, as
/// cuBLAS sums several rows in another order than one).
#[test]
fn batched_sequences_match_solo_runs() {
    let Some(dev) = device() else { return };
    let cpu = load_cpu("tiny-qwen3-next", true);
    let gpu = CudaHybridModel::from_host(dev.clone(), &cpu).expect("upload");
    let (ta, tb) = (table(3), table(20));
    let (pa, pb): (Vec<u32>, Vec<u32>) =
        ((0..21u32).map(|i| (i * 7 + 1) % 256).collect(), (0..13u32).map(|i| (i * 13 + 2) % 256).collect());
    let solo = |tokens: &[u32], tab: &[u32], slot: usize| -> Vec<f32> {
        let mut c = cache(&gpu, false);
        let (positions, slots, _) = batch_parts(tokens, 0, tab);
        let seqs = [SeqRows { num_rows: tokens.len(), context_len: 0, block_table: tab, prompt_len: tokens.len() }];
        let last = [tokens.len() as u32 - 1];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &last };
        gpu.forward(&batch, &mut c, &[GdnSeq { slot, verify: false }])
            .expect("solo")
            .logits
            .as_f32()
            .expect("f32")
            .to_vec()
    };
    let (la, lb) = (solo(&pa, &ta, 0), solo(&pb, &tb, 3));
    let mut c = cache(&gpu, false);
    let tokens: Vec<u32> = pa.iter().chain(&pb).copied().collect();
    let (pos_a, slots_a, _) = batch_parts(&pa, 0, &ta);
    let (pos_b, slots_b, _) = batch_parts(&pb, 0, &tb);
    let positions: Vec<u32> = pos_a.into_iter().chain(pos_b).collect();
    let slots: Vec<u32> = slots_a.into_iter().chain(slots_b).collect();
    let seqs = [
        SeqRows { num_rows: pa.len(), context_len: 0, block_table: &ta, prompt_len: pa.len() },
        SeqRows { num_rows: pb.len(), context_len: 0, block_table: &tb, prompt_len: pb.len() },
    ];
    let rows = [pa.len() as u32 - 1, tokens.len() as u32 - 1];
    let batch = ForwardBatch { tokens: &tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
    let both = gpu
        .forward(&batch, &mut c, &[GdnSeq { slot: 0, verify: false }, GdnSeq { slot: 3, verify: false }])
        .expect("batched");
    let v = cpu.config().base.vocab_size;
    let logits = both.logits.as_f32().expect("f32");
    check("batched sequence a against alone", &logits[..v], &la, 1e-4);
    check("batched sequence b against alone", &logits[v..], &lb, 1e-4);
}
