//! The hybrid and sparse targets against transformers (fixtures from tools/golden/hybrid_fixtures.py), and exact
//! rollback of the Gated DeltaNet state after a verify.
//!
//! * tiny-qwen3-next: logits, every layer's output and the GDN states after a prefill (chunked rule), after six
//!   decode steps (recurrent rule) and after an 80-token prefill (two chunks); chunked prefill within tolerance.
//! * tiny-qwen3-moe: logits and every layer's output.
//! * Rollback: for every accepted count, verify + rollback leaves the states (and the next step) bit-identical
//!   to a forward over the kept rows, and to decoding them one at a time (with and without hyper-connection
//!   streams); batching does not change any bit.

mod common;

use common::hybrid::{tokens_of, Seq, PAGE_SIZE};
use common::{assert_close, fixtures, read_golden, Golden};
use dflash_models::hybrid::{load_hybrid_weights, HybridModel, HybridState};
use dflash_models::LoadOptions;
use dflash_models::{ForwardBatch, KvCache, SeqRows};
use std::collections::HashMap;

const TOL: f32 = 1e-4;

fn load(name: &str, capture: Vec<usize>) -> HybridModel {
    let opts = LoadOptions { capture_layers: capture, ..Default::default() };
    load_hybrid_weights(&fixtures().join(name), &opts).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

fn golden(name: &str) -> HashMap<String, Golden> {
    read_golden(&fixtures().join(name).join("golden.safetensors"))
}

/// Every GDN layer's conv and ssm state against `{prefix}conv.layer{L}` / `{prefix}ssm.layer{L}` (item `item`).
fn check_states(
    model: &HybridModel,
    state: &HybridState,
    g: &HashMap<String, Golden>,
    prefix: &str,
    item: usize,
    what: &str,
) {
    for (i, layer) in model.config().gdn_layers().into_iter().enumerate() {
        for (kind, got) in [("conv", state.layer(i).conv()), ("ssm", state.layer(i).ssm())] {
            let want = &g[&format!("{prefix}{kind}.layer{layer}")].data;
            let want = &want[item * got.len()..(item + 1) * got.len()];
            assert_close(&format!("{what}: {kind} state of layer {layer}"), got, want, TOL);
        }
    }
}

/// Logits and every layer's output for both golden sequences, whole and in chunks of 5.
fn check_prefill(model: &HybridModel, name: &str, g: &HashMap<String, Golden>, with_states: bool) {
    let (vocab, hidden) = (model.config().base.vocab_size, model.config().base.hidden_size);
    let taps = model.capture_layers().len();
    for s in 0..g["input_ids"].shape[0] {
        let tokens = tokens_of(&g["input_ids"], s);
        let len = tokens.len();
        for chunk in [len, 5] {
            let mut seq = Seq::new(model, len, len);
            let rows = seq.feed(model, &tokens, chunk);
            let what = format!("{name} seq {s} chunk {chunk}");
            assert_close(
                &format!("{what} logits"),
                &rows.logits,
                &g["logits"].data[s * len * vocab..(s + 1) * len * vocab],
                TOL,
            );
            for (tap, &layer) in model.capture_layers().iter().enumerate() {
                let got: Vec<f32> = rows
                    .captured
                    .chunks_exact(taps * hidden)
                    .flat_map(|r| r[tap * hidden..(tap + 1) * hidden].to_vec())
                    .collect();
                let want = &g[&format!("hidden.layer{layer}")].data[s * len * hidden..(s + 1) * len * hidden];
                assert_close(&format!("{what} hidden layer {layer}"), &got, want, TOL);
            }
            if with_states {
                check_states(model, &seq.state, g, "", s, &what);
            }
        }
    }
}

#[test]
fn qwen3_next_prefill_matches_transformers() {
    let model = load("tiny-qwen3-next", vec![0, 1, 2, 3]);
    assert_eq!(model.config().gdn_layers(), vec![0, 2, 3]);
    check_prefill(&model, "tiny-qwen3-next", &golden("tiny-qwen3-next"), true);
}

#[test]
fn qwen3_moe_matches_transformers() {
    let model = load("tiny-qwen3-moe", vec![0, 1, 2]);
    assert!(model.config().gdn.is_none());
    check_prefill(&model, "tiny-qwen3-moe", &golden("tiny-qwen3-moe"), false);
}

#[test]
fn qwen3_next_decode_matches_the_recurrent_form() {
    let model = load("tiny-qwen3-next", vec![]);
    let g = golden("tiny-qwen3-next");
    let vocab = model.config().base.vocab_size;
    let prompt = tokens_of(&g["input_ids"], 0);
    let decode = tokens_of(&g["decode_tokens"], 0);
    let mut seq = Seq::new(&model, prompt.len() + decode.len(), prompt.len());
    let first = seq.forward(&model, &prompt);
    let last = &first.logits[(prompt.len() - 1) * vocab..];
    assert_eq!(dflash_runtime::ops::argmax(last), decode[0], "greedy token after the prompt");
    for (i, &token) in decode.iter().enumerate() {
        let step = seq.forward(&model, &[token]);
        assert_close(
            &format!("decode step {i}"),
            &step.logits,
            &g["decode_logits"].data[i * vocab..(i + 1) * vocab],
            TOL,
        );
    }
    check_states(&model, &seq.state, &g, "decode_", 0, "after decode");
}

#[test]
fn qwen3_next_long_prefill_crosses_chunks() {
    let model = load("tiny-qwen3-next", vec![]);
    let g = golden("tiny-qwen3-next");
    let tokens = tokens_of(&g["long_input_ids"], 0);
    let whole = {
        let mut seq = Seq::new(&model, tokens.len(), tokens.len());
        let rows = seq.feed(&model, &tokens, tokens.len());
        assert_close("long logits", &rows.logits, &g["long_logits"].data, TOL);
        check_states(&model, &seq.state, &g, "long_", 0, "long prefill");
        (rows.logits, seq.state)
    };
    // Pieces cut at the delta rule's chunk boundary (64) and off it (30): the same results within tolerance.
    for chunk in [64, 30] {
        let mut seq = Seq::new(&model, tokens.len(), tokens.len());
        let rows = seq.feed(&model, &tokens, chunk);
        assert_close(&format!("long logits in pieces of {chunk}"), &rows.logits, &whole.0, TOL);
        for i in 0..seq.state.num_layers() {
            let what = format!("pieces of {chunk}: layer slot {i}");
            assert_close(&format!("{what} ssm"), seq.state.layer(i).ssm(), whole.1.layer(i).ssm(), TOL);
            assert_close(&format!("{what} conv"), seq.state.layer(i).conv(), whole.1.layer(i).conv(), TOL);
        }
    }
}

/// Asserts two float slices are equal bit for bit, naming the first difference.
fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
        panic!("{what}: first difference at {i}: {} vs {}", got[i], want[i]);
    }
}

fn assert_same_state(a: &HybridState, b: &HybridState, what: &str) {
    for i in 0..a.num_layers() {
        assert_bits(a.layer(i).conv(), b.layer(i).conv(), &format!("{what}: conv state of GDN slot {i}"));
        assert_bits(a.layer(i).ssm(), b.layer(i).ssm(), &format!("{what}: ssm state of GDN slot {i}"));
    }
}

/// A sequence with the 12-token prompt prefilled (prompt rows), ready for generated rows.
fn prefilled(model: &HybridModel, prompt: &[u32], room: usize) -> Seq {
    let mut seq = Seq::new(model, prompt.len() + room, prompt.len());
    seq.forward(model, prompt);
    seq
}

#[test]
fn verify_then_rollback_equals_a_forward_over_the_kept_rows() {
    // With hyper-connection streams too: they live within a forward, so the recurrent state's rollback suffices.
    for name in ["tiny-qwen3-next", "tiny-qwen3-next-hc"] {
        verify_then_rollback(name);
    }
}

fn verify_then_rollback(name: &str) {
    let model = load(name, vec![]);
    let g = golden(name);
    let prompt = tokens_of(&g["input_ids"], 0);
    let vocab = model.config().base.vocab_size;
    // An anchor and drafts; widths on both sides of the exact-matmul group of 8 rows.
    let drafts: Vec<u32> = tokens_of(&g["long_input_ids"], 0);
    for width in [4, 10] {
        let verify = &drafts[..width];
        for accepted in 0..width {
            let kept = accepted + 1;
            let what = format!("{name}: width {width}, kept {kept}");
            let mut spec = prefilled(&model, &prompt, width + 1);
            spec.state.begin_verify();
            let verified = spec.forward(&model, verify);
            spec.state.rollback_to(kept).expect("rollback");
            spec.len -= width - kept; // the engine's KV truncation
            let mut plain = prefilled(&model, &prompt, width + 1);
            let forward = plain.forward(&model, &verify[..kept]);
            assert_same_state(&spec.state, &plain.state, &what);
            assert_bits(&verified.logits[..kept * vocab], &forward.logits, &format!("{what}: kept rows' logits"));
            let mut stepped = prefilled(&model, &prompt, width + 1);
            for &t in &verify[..kept] {
                stepped.forward(&model, &[t]);
            }
            assert_same_state(&spec.state, &stepped.state, &format!("{what}, one row at a time"));
            // The next step continues from identical caches and states.
            let (a, b) = (spec.forward(&model, &[7]), plain.forward(&model, &[7]));
            assert_bits(&a.logits, &b.logits, &format!("{what}: next step logits"));
            assert_same_state(&spec.state, &plain.state, &format!("{what}, next step"));
        }
    }
}

#[test]
fn rollback_to_zero_and_commit() {
    let model = load("tiny-qwen3-next", vec![]);
    let g = golden("tiny-qwen3-next");
    let prompt = tokens_of(&g["input_ids"], 0);
    let before = prefilled(&model, &prompt, 4);
    let mut seq = prefilled(&model, &prompt, 4);
    seq.state.begin_verify();
    seq.forward(&model, &[1, 2, 3]);
    assert!(seq.state.has_pending_verify());
    seq.state.rollback_to(0).expect("rollback");
    assert_same_state(&seq.state, &before.state, "nothing kept");
    seq.len -= 3;
    seq.state.begin_verify();
    seq.forward(&model, &[1, 2, 3]);
    seq.state.commit();
    let mut plain = prefilled(&model, &prompt, 4);
    plain.forward(&model, &[1, 2, 3]);
    assert_same_state(&seq.state, &plain.state, "all kept");
}

#[test]
fn misuse_is_an_error() {
    let model = load("tiny-qwen3-next", vec![]);
    let mut seq = Seq::new(&model, 8, 4);
    // Armed over prompt rows: the chunked rule has no per-row replay.
    seq.state.begin_verify();
    let tokens = [1u32, 2];
    let seqs = [SeqRows { num_rows: 2, context_len: 0, block_table: &seq.table, prompt_len: 4 }];
    let batch = ForwardBatch { tokens: &tokens, positions: &[0, 1], seqs: &seqs, slots: &[8, 9], logit_rows: &[] };
    let err = model.forward(&batch, &mut seq.kv, &mut [&mut seq.state]).expect_err("prompt rows in a verify");
    assert!(err.to_string().contains("prompt rows"), "{err}");
    // A pending verify blocks the next forward; a rollback past its rows is refused.
    let mut seq = Seq::new(&model, 8, 0);
    seq.state.begin_verify();
    seq.forward(&model, &[1, 2]);
    let seqs = [SeqRows { num_rows: 1, context_len: 2, block_table: &seq.table, prompt_len: 0 }];
    let batch = ForwardBatch { tokens: &[3], positions: &[2], seqs: &seqs, slots: &[10], logit_rows: &[] };
    assert!(model.forward(&batch, &mut seq.kv, &mut [&mut seq.state]).is_err());
    assert!(seq.state.rollback_to(3).is_err());
    // Missing states.
    assert!(model.forward(&batch, &mut seq.kv, &mut []).is_err());
    // A state of another model.
    let moe = load("tiny-qwen3-moe", vec![]);
    let mut other = moe.new_state();
    assert!(model.forward(&batch, &mut seq.kv, &mut [&mut other]).is_err());
}

#[test]
fn batching_a_prompt_chunk_with_a_verify_changes_no_bit() {
    let model = load("tiny-qwen3-next", vec![1, 3]);
    let g = golden("tiny-qwen3-next");
    let (p0, p1) = (tokens_of(&g["input_ids"], 0), tokens_of(&g["input_ids"], 1));
    let verify = [5u32, 6, 7];
    // Alone: sequence A verifies 3 rows and keeps 2; sequence B prefills its prompt.
    let mut a_alone = prefilled(&model, &p0, 4);
    a_alone.state.begin_verify();
    let a_rows = a_alone.forward(&model, &verify);
    a_alone.state.rollback_to(2).expect("rollback");
    let mut b_alone = Seq::new(&model, p1.len(), p1.len());
    let b_rows = b_alone.forward(&model, &p1);
    // Together in one forward, B first.
    let mut a = prefilled(&model, &p0, 4);
    let mut b = Seq::new(&model, p1.len(), p1.len());
    // One cache for both: B's pages follow A's.
    let a_pages = a.table.len() as u32;
    let b_table: Vec<u32> = (0..b.table.len() as u32).map(|p| p + a_pages + 2).collect();
    let mut kv = model.new_kv_cache(a_pages as usize + 2 + b_table.len(), PAGE_SIZE).expect("cache");
    copy_cache(&a.kv, &mut kv);
    a.state.begin_verify();
    let tokens: Vec<u32> = p1.iter().chain(&verify).copied().collect();
    let mut positions: Vec<u32> = (0..p1.len() as u32).collect();
    positions.extend(p0.len() as u32..(p0.len() + 3) as u32);
    let slot = |table: &[u32], p: usize| table[p / PAGE_SIZE] * PAGE_SIZE as u32 + (p % PAGE_SIZE) as u32;
    let mut slots: Vec<u32> = (0..p1.len()).map(|p| slot(&b_table, p)).collect();
    slots.extend((p0.len()..p0.len() + 3).map(|p| slot(&a.table, p)));
    let seqs = [
        SeqRows { num_rows: p1.len(), context_len: 0, block_table: &b_table, prompt_len: p1.len() },
        SeqRows { num_rows: 3, context_len: p0.len(), block_table: &a.table, prompt_len: p0.len() },
    ];
    let rows: Vec<u32> = (0..tokens.len() as u32).collect();
    let batch = ForwardBatch { tokens: &tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
    let out = model.forward(&batch, &mut kv, &mut [&mut b.state, &mut a.state]).expect("forward");
    a.state.rollback_to(2).expect("rollback");
    let vocab = model.config().base.vocab_size;
    let logits = out.logits.as_f32().expect("f32");
    assert_bits(&logits[..p1.len() * vocab], &b_rows.logits, "prompt rows");
    assert_bits(&logits[p1.len() * vocab..], &a_rows.logits, "verify rows");
    let captured = out.captured.expect("taps");
    let width = captured.row_len();
    assert_bits(&captured.as_f32().expect("f32")[p1.len() * width..], &a_rows.captured, "verify taps");
    assert_same_state(&a.state, &a_alone.state, "verified sequence");
    assert_same_state(&b.state, &b_alone.state, "prefilled sequence");
}

/// Copies every cache layer of `src` into the first pages of `dst`.
fn copy_cache(src: &KvCache, dst: &mut KvCache) {
    for (s, d) in src.k.iter().chain(&src.v).zip(dst.k.iter_mut().chain(dst.v.iter_mut())) {
        let s = s.as_f32().expect("f32");
        d.as_f32_mut().expect("f32")[..s.len()].copy_from_slice(s);
    }
}
