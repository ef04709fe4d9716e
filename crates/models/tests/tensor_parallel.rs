//! Tensor parallelism on the CPU: the tiny Llama-family fixtures split over 2 ranks (threads joined by
//! `ThreadGroup`) give every rank the same logits, within rounding of the whole model's (the ranks' partial sums are
//! added in another order than one matmul adds them; with quantized activations a rounding can move an int8 step),
//! and the whole model's greedy continuation.

mod common;

use std::sync::Arc;

use common::{assert_close, fixtures, read_golden, run_sequence};
use dflash_models::llama::{load_shard_weights, open_parallel, LlamaModel, LlamaTarget};
use dflash_models::resolve::ModelSource;
use dflash_models::weights::{WeightFile, WeightStore};
use dflash_models::{
    open_target, CachePlan, Checkpoint, Device, ForwardBatch, KvPages, LoadOptions, ModelConfig, Readout, ResumeState,
    SeqRows, StepSeq, StreamTap, Target, TargetOptions,
};
use dflash_runtime::comm::{Communicator, Solo, ThreadGroup};

/// `run` on every rank of a `size`-rank split of `source`, each in its own thread: the ranks' results in rank order.
fn on_ranks<T: Send>(
    source: &ModelSource,
    size: usize,
    run: impl Fn(&dflash_models::llama::LlamaModel) -> T + Sync,
) -> Vec<T> {
    let opts = LoadOptions::default();
    let ranks = ThreadGroup::new(size);
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                let (opts, run) = (&opts, &run);
                s.spawn(move || {
                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                    let model = load_shard_weights(source, opts, comm).expect("load a shard");
                    // Each rank's ops run in a pool of its own: a rank waiting in a collective holds its worker,
                    // which must not be one another rank's ops need.
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("rank pool");
                    pool.install(|| run(&model))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Greedy tokens after `prompt`, one forward of the whole sequence per token.
fn greedy(model: &dflash_models::llama::LlamaModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let vocab = model.config().vocab_size;
    let mut tokens = prompt.to_vec();
    for _ in 0..n {
        let (logits, _) = run_sequence(model, &tokens, 0, 3);
        tokens.push(dflash_runtime::ops::argmax(&logits[(tokens.len() - 1) * vocab..]));
    }
    tokens[prompt.len()..].to_vec()
}

fn check(source: ModelSource, golden: &str, tol: f32) {
    let g = read_golden(&fixtures().join(golden).join("golden.safetensors"));
    let len = g["input_ids"].shape[1];
    let prompt: Vec<u32> = g["input_ids"].data[..len].iter().map(|&x| x as u32).collect();
    let whole = load_shard_weights(&source, &LoadOptions::default(), Arc::new(Solo)).expect("whole model");
    let (want, _) = run_sequence(&whole, &prompt, 0, 4);
    let want_tokens = greedy(&whole, &prompt, 8);
    let ranks = on_ranks(&source, 2, |model| {
        assert_eq!(model.config().num_heads * 2, whole.config().num_heads, "a rank holds half the heads");
        (run_sequence(model, &prompt, 0, 4).0, greedy(model, &prompt, 8))
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&ranks[0].0), bits(&ranks[1].0), "{golden}: every rank gets the same logits");
    assert_close(&format!("{golden}: 2 ranks against the whole model"), &ranks[0].0, &want, tol);
    assert_eq!(ranks[0].1, want_tokens, "{golden}: greedy continuation over 2 ranks");
}

#[test]
fn two_ranks_give_the_whole_models_logits_and_greedy_tokens() {
    let dir = |name: &str| ModelSource::HfDir(fixtures().join(name));
    check(dir("tiny-llama"), "tiny-llama", 1e-5);
    check(dir("tiny-qwen3"), "tiny-qwen3", 1e-5);
    // Quantized weights quantize their activations too: the ranks' partial sums, added in another order, move a
    // layer's output by a rounding, which can move an activation's int8 value by one step (amax / 254 of its
    // block) in the next layer. The logits then differ by about that much, and the greedy tokens not at all.
    check(ModelSource::GgufFile(fixtures().join("tiny-llama-gguf/tiny.gguf")), "tiny-llama-gguf", 2e-3);
}

/// One sequence through `target` as the engine drives it: the prompt in one forward, then `steps` greedy decode
/// rows, one forward each. Returns every forward's logits and the tokens chosen.
fn drive(target: &mut dyn dflash_models::Target, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>) {
    let vocab = target.config().vocab_size;
    let page_size = target.page_size();
    let table: Vec<u32> = (0..target.num_pages() as u32).rev().collect();
    let slot = |p: usize| table[p / page_size] * page_size as u32 + (p % page_size) as u32;
    let (mut logits, mut tokens) = (Vec::new(), prompt.to_vec());
    let mut context = 0;
    for _ in 0..=steps {
        let rows = &tokens[context..];
        let positions: Vec<u32> = (context..tokens.len()).map(|p| p as u32).collect();
        let slots: Vec<u32> = (context..tokens.len()).map(slot).collect();
        let seqs =
            [SeqRows { num_rows: rows.len(), context_len: context, block_table: &table, prompt_len: prompt.len() }];
        let last = [rows.len() as u32 - 1];
        let batch = ForwardBatch { tokens: rows, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &last };
        let step = [StepSeq { key: 1, verifies: false, host_capture: true }];
        let out = target.forward_step(&batch, &step, Readout::Logits).expect("forward");
        let row = out.logits.as_f32().expect("f32");
        assert_eq!(row.len(), vocab, "one whole row of logits");
        logits.extend_from_slice(row);
        context = tokens.len();
        tokens.push(dflash_runtime::ops::argmax(row));
    }
    (logits, tokens[prompt.len()..].to_vec())
}

/// The tensor-parallel target as the engine drives it, on random weights whose vocabulary (101) does not split
/// evenly over the ranks: a prompt chunk and greedy decode steps give the whole model's logits and tokens. A batch
/// the caches cannot take fails on every rank without leaving the group stuck: the next step runs.
#[test]
fn the_parallel_target_steps_as_the_whole_model_does() {
    let cfg = ModelConfig::from_hf(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 101, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": true
    }))
    .expect("config");
    let store = || WeightStore::new(WeightFile::Random { seed: 11 });
    let (pages, page_size) = (8, 4);
    let model = LlamaModel::load(cfg.clone(), &mut store(), &[], StreamTap::default()).expect("whole model");
    let mut whole = LlamaTarget::new(Arc::new(model), pages, page_size).expect("whole target");
    let mut split = open_parallel(cfg, &mut store(), &[], 2, 1, (pages, page_size)).expect("two ranks");
    assert_eq!(split.config().vocab_size, 101, "the target reports the whole model");

    let prompt = [5, 17, 99, 3, 42, 8, 100];
    let (want, want_tokens) = drive(&mut whole, &prompt, 6);
    let bad_slot = [u32::MAX];
    let seqs = [SeqRows { num_rows: 1, context_len: 0, block_table: &[0], prompt_len: 1 }];
    let bad = ForwardBatch { tokens: &[1], positions: &[0], seqs: &seqs, slots: &bad_slot, logit_rows: &[0] };
    assert!(split.forward(&bad).is_err(), "a slot past the cache");
    let (got, got_tokens) = drive(&mut split, &prompt, 6);
    assert_close("two ranks against the whole model, step by step", &got, &want, 1e-5);
    assert_eq!(got_tokens, want_tokens, "greedy tokens over two ranks");
}

/// The hybrid fixture (Gated DeltaNet, gated attention, a sparse MoE with a shared expert, a dense MLP layer) through
/// the door with 2 CPU ranks: prompt and decode steps as the whole model gives them, a verify round rolled back to
/// its anchor on every rank, and a state snapshot made of every rank's.
#[test]
fn a_hybrid_target_splits_its_linear_attention_and_experts() {
    let open = |tensor_parallel: usize| {
        let source = ModelSource::HfDir(fixtures().join("tiny-qwen3-next"));
        let checkpoint = Checkpoint::open(&source, None).expect("checkpoint");
        let cache = CachePlan {
            pages: KvPages::Fixed(16),
            page_size: 4,
            max_batch_tokens: 64,
            max_seqs: 4,
            context_window: 64,
            captured_pages: false,
        };
        let opts = TargetOptions { load: LoadOptions::default(), host_heads: true, cache, tensor_parallel };
        open_target(checkpoint, Device::Cpu, &opts).expect("open").target
    };
    let (mut whole, mut split) = (open(1), open(2));
    assert!(split.device().contains("2 ranks"), "{}", split.device());
    let prompt = [11, 200, 37, 5, 90, 4, 18, 77, 3];
    let (want, want_tokens) = drive(whole.as_mut(), &prompt, 5);
    let (got, got_tokens) = drive(split.as_mut(), &prompt, 5);
    assert_close("2 hybrid ranks against the whole model", &got, &want, 1e-5);
    assert_eq!(got_tokens, want_tokens, "greedy tokens over 2 hybrid ranks");

    // Each rank keeps its own heads' recurrent state: the target's snapshot is both, and fits back in.
    let floats = |t: &dyn Target| match t.resume_state() {
        ResumeState::Snapshot { floats } => floats,
        ResumeState::Pages => 0,
    };
    assert_eq!(floats(split.as_ref()), floats(whole.as_ref()), "the ranks' states add up to the whole one");
    let snapshot = split.snapshot_state(1).expect("a snapshot of sequence 1");
    assert_eq!(snapshot.len(), floats(split.as_ref()));
    split.restore_state(2, &snapshot).expect("restore into another sequence");

    // A verify round of three rows that keeps only its anchor, then the anchor's successor as a plain step: the
    // logits of that step match the whole model's doing the same.
    let verify_then_step = |t: &mut dyn Target| {
        let context = prompt.len() + 5;
        let table: Vec<u32> = (0..t.num_pages() as u32).rev().collect();
        let slot = |p: usize| table[p / 4] * 4 + (p % 4) as u32;
        let run = |t: &mut dyn Target, tokens: &[u32], verifies: bool| {
            let positions: Vec<u32> = (context..context + tokens.len()).map(|p| p as u32).collect();
            let slots: Vec<u32> = (context..context + tokens.len()).map(slot).collect();
            let seqs = [SeqRows { num_rows: tokens.len(), context_len: context, block_table: &table, prompt_len: 9 }];
            let rows: Vec<u32> = (0..tokens.len() as u32).collect();
            let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
            let step = [StepSeq { key: 1, verifies, host_capture: true }];
            t.forward_step(&batch, &step, Readout::Logits).expect("step").logits.as_f32().expect("f32").to_vec()
        };
        run(t, &[want_tokens[5], 1, 2], true);
        t.verified(1, 1);
        run(t, &[want_tokens[5]], false)
    };
    let (want, got) = (verify_then_step(whole.as_mut()), verify_then_step(split.as_mut()));
    assert_close("a step after a rolled-back verify, 2 hybrid ranks", &got, &want, 1e-5);
}
