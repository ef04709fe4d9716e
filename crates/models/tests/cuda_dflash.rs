//! The DFlash v1 and DFlash2 drafters on CUDA against the same drafters on the CPU (the CPU pass is held to the
//! reference package by parity_dflash): context appends in pieces that take the context past its first pages,
//! block passes of every width, batched passes (with the context page pool grown under them), a draft
//! vocabulary's head; the final hidden rows and logits to 1e-4 relative, and the drafts (greedy, sampled,
//! DFlash2's selector walk) identical. Passes and appends whose shapes ran before replay CUDA graphs (the warm-up's
//! appends of 1 and 64 rows, the one-row append before the last comparison). A pass that keeps only each slot's
//! best columns (the summary drafting reads) gives the CPU's top columns, their logits to 1e-4 and top
//! probabilities to 1e-4, and the same drafts. The drafter's warm-up passes run first and must leave no trace. On
//! bf16 tensor cores (`DraftMatrices::Bf16`) the rows and logits stay within 5e-2 of the CPU's.
//!
//! Without a CUDA device every test prints a SKIP notice and passes.
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{assert_close, cuda_device, fixtures};
use dflash_models::config::ModelConfig;
use dflash_models::dflash::{
    BlockOutput, BlockRequest, BlockScores, ContextAppend, DeviceAppend, DraftHead, DraftMatrices, DraftModel,
    DraftSampling, DraftVocab, DrafterContext, InverseCdf, SamplingFilter, ScoreReadback, TargetShape,
};
use dflash_models::llama::{load_hf_weights, LlamaModel};
use dflash_models::safetensors_dir::read_json;
use dflash_models::{DeviceCaptured, LoadOptions};
use dflash_runtime::cuda::CudaDevice;
use dflash_runtime::Tensor;

const TOL: f32 = 1e-4;
/// Context positions of the synthetic captured rows: past two of the context's 64-slot pages.
const POSITIONS: usize = 150;

fn target_shape() -> TargetShape {
    let json = read_json(&fixtures().join("tiny-qwen3/config.json")).expect("target config");
    TargetShape::of(&ModelConfig::from_hf(&json).expect("target config parses"))
}

/// Fixture drafter `name` with its sliding layers run windowless (`use_sliding_window: false`, as transformers
/// reads it: still causal), which the CUDA passes take: a copy of the fixture in a directory of this process's own.
fn windowless(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash-cuda-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("fixture copy");
    for entry in std::fs::read_dir(fixtures().join(name)).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.join(path.file_name().expect("name"))).expect("copy");
    }
    let mut config = read_json(&dir.join("config.json")).expect("config");
    config["use_sliding_window"] = serde_json::Value::Bool(false);
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config");
    dir
}

/// The CPU drafter `name` (windowless, see [`windowless`]), its target, and made-up captured rows for
/// [`POSITIONS`] positions.
fn cpu_pair(name: &str) -> (DraftModel, LlamaModel, Vec<f32>) {
    let model = DraftModel::load(&windowless(name), &target_shape()).expect("drafter");
    let target = load_hf_weights(&fixtures().join("tiny-qwen3"), &LoadOptions::default()).expect("target");
    let width = model.target_layer_ids().len() * target.config().hidden_size;
    let rows = (0..POSITIONS * width).map(|i| ((i * 53 % 97) as f32 - 48.0) / 24.0).collect();
    (model, target, rows)
}

/// The windowless fixture drafter `name` (see [`windowless`]) on the device, scoring the target's whole LM head, its
/// matrices in f32 (the CPU pass's rounding; the default bf16 tensor cores have their own test).
fn on_gpu(name: &str, dev: &Arc<CudaDevice>, cpu: &DraftModel, lm_head: &Tensor) -> DraftModel {
    on_gpu_with(name, dev, cpu, lm_head, DraftMatrices::F32)
}

/// [`on_gpu`] with its matrices as `matrices` says.
fn on_gpu_with(
    name: &str,
    dev: &Arc<CudaDevice>,
    cpu: &DraftModel,
    lm_head: &Tensor,
    matrices: DraftMatrices,
) -> DraftModel {
    DraftModel::load(&windowless(name), cpu.target())
        .expect("drafter")
        .to_cuda_with(Arc::clone(dev), DraftHead::Full(lm_head), 1024, matrices)
        .expect("to cuda")
}

/// The block pass of width `w` (from an anchor of its own) on the CPU drafter's and the GPU drafter's contexts:
/// the anchor, the CPU's output and the GPU's.
fn pass_at_width(
    (cpu, gpu): (&DraftModel, &DraftModel),
    (cpu_ctx, gpu_ctx): (&mut DrafterContext, &mut DrafterContext),
    w: usize,
    heads: (&Tensor, &Tensor),
) -> (u32, BlockOutput, BlockOutput) {
    let anchor = (17 + 31 * w as u32) % 256;
    (anchor, one_pass(cpu, cpu_ctx, (anchor, w), heads), one_pass(gpu, gpu_ctx, (anchor, w), heads))
}

/// Appends `rows` in pieces of uneven sizes, as the engine's flushes would.
fn append_in_pieces(model: &DraftModel, ctx: &mut DrafterContext, rows: &[f32], width: usize) {
    let mut at = 0;
    for piece in [37, 64, 1, 48] {
        let end = (at + piece).min(rows.len() / width);
        model.append_context(ctx, at, &rows[at * width..end * width]).expect("append");
        at = end;
    }
    assert_eq!(ctx.len(), rows.len() / width);
}

/// A new context of `model` holding `rows` (`width` wide), appended in pieces.
fn appended(model: &DraftModel, rows: &[f32], width: usize) -> DrafterContext {
    let mut ctx = model.new_context().expect("context");
    append_in_pieces(model, &mut ctx, rows, width);
    ctx
}

/// One block pass of `width` rows from `anchor` on `ctx`, scoring every logit.
fn one_pass(
    model: &DraftModel,
    ctx: &mut DrafterContext,
    (anchor, width): (u32, usize),
    heads: (&Tensor, &Tensor),
) -> BlockOutput {
    let mut requests = [BlockRequest { ctx, anchor, width }];
    model.forward_blocks(&mut requests, heads.0, heads.1, None).expect("pass").remove(0)
}

fn check_block(what: &str, got: &BlockOutput, want: &BlockOutput) {
    check_block_within(what, got, want, TOL);
}

/// [`check_block`] to relative tolerance `tol`.
fn check_block_within(what: &str, got: &BlockOutput, want: &BlockOutput, tol: f32) {
    assert_eq!(got.start, want.start, "{what}: start");
    assert_eq!(
        got.scores.dense().expect("dense").shape(),
        want.scores.dense().expect("dense").shape(),
        "{what}: logits shape"
    );
    assert_close(&format!("{what} hidden"), got.hidden.as_f32().expect("f32"), want.hidden.as_f32().expect("f32"), tol);
    assert_close(
        &format!("{what} logits"),
        got.scores.dense().expect("dense").as_f32().expect("f32"),
        want.scores.dense().expect("dense").as_f32().expect("f32"),
        tol,
    );
}

/// A summarised pass (`got`) against a dense one (`want`): the same best `k` columns, their logits and each slot's
/// top probability close.
fn check_summary(what: &str, got: &BlockOutput, want: &BlockOutput, k: usize) {
    assert!(matches!(got.scores, BlockScores::Top(_)), "{what}: a summary was asked for");
    assert_eq!(got.scores.slots(), want.scores.slots(), "{what}: slots");
    let ((got_columns, got_values), (want_columns, want_values)) =
        (got.scores.top(k).expect("summary"), want.scores.top(k).expect("dense top"));
    assert_eq!(got_columns, want_columns, "{what}: top {k} columns");
    assert_close(&format!("{what} top values"), &got_values, &want_values, TOL);
    let (got_top, want_top) = (got.scores.top_probabilities(), want.scores.top_probabilities());
    assert_close(&format!("{what} top probabilities"), &got_top.expect("got"), &want_top.expect("want"), TOL);
}

#[test]
fn cuda_drafters_match_the_cpu_drafters_at_every_width() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    for name in ["dflash-v1", "dflash-v2"] {
        let (cpu, target, rows) = cpu_pair(name);
        let (embed, lm_head) = (target.embedding(), target.lm_head());
        let gpu = on_gpu(name, &dev, &cpu, lm_head);
        assert!(gpu.device().starts_with("cuda:"), "{}", gpu.device());
        // The warm-up's passes (16 sequences at once, contexts of 1 to 64 rows) leave nothing behind that the
        // checks below could see.
        gpu.warm_up(embed, lm_head).expect("warm-up");
        let width = rows.len() / POSITIONS;
        let (mut cpu_ctx, mut gpu_ctx) = (appended(&cpu, &rows, width), appended(&gpu, &rows, width));
        for w in 2..=cpu.block_size() {
            let contexts = (&mut cpu_ctx, &mut gpu_ctx);
            let (anchor, want, got) = pass_at_width((&cpu, &gpu), contexts, w, (embed, lm_head));
            check_block(&format!("{name} width {w}"), &got, &want);
            let readback = gpu.readback_for(true);
            let ScoreReadback::Top(k) = readback else { panic!("{name}: greedy drafting reads a summary") };
            let mut requests = [BlockRequest { ctx: &mut gpu_ctx, anchor, width: w }];
            let summary = gpu.forward_blocks_with(&mut requests, embed, lm_head, readback).expect("pass").remove(0);
            check_summary(&format!("{name} width {w}"), &summary, &want, k);
            // DFlash2's selector walks greedy blocks on the device; the drafts below check that walk against the host's.
            assert_eq!(summary.walked.is_some(), name == "dflash-v2", "{name} width {w}: the walk on the device");
            let greedy =
                |model: &DraftModel, block| model.propose(block, anchor, DraftSampling::Greedy).expect("greedy");
            let want_tokens = greedy(&cpu, want).tokens;
            assert_eq!(greedy(&gpu, got).tokens, want_tokens, "{name} width {w}: greedy drafts");
            assert_eq!(greedy(&gpu, summary).tokens, want_tokens, "{name} width {w}: greedy drafts from a summary");
            let uniforms: Vec<f32> = (0..w).map(|i| (i as f32 * 0.37 + 0.11) % 1.0).collect();
            let filter = SamplingFilter { temperature: 0.8, top_k: 20, top_p: 0.9 };
            let sampled = |model: &DraftModel, ctx: &mut DrafterContext| {
                let draw = &mut InverseCdf::new(uniforms.clone());
                model.draft(ctx, anchor, w, embed, lm_head, DraftSampling::Sample { filter, draw }).expect("sampled")
            };
            let (want, got) = (sampled(&cpu, &mut cpu_ctx), sampled(&gpu, &mut gpu_ctx));
            assert_eq!(got.tokens, want.tokens, "{name} width {w}: sampled drafts");
            if let ScoreReadback::Top(_) = gpu.readback_for(false) {
                let mut requests = [BlockRequest { ctx: &mut gpu_ctx, anchor, width: w }];
                let readback = gpu.readback_for(false);
                let block = gpu.forward_blocks_with(&mut requests, embed, lm_head, readback).expect("pass").remove(0);
                let draw = &mut InverseCdf::new(uniforms.clone());
                let got = gpu.propose(block, anchor, DraftSampling::Sample { filter, draw }).expect("sampled");
                assert_eq!(got.tokens, want.tokens, "{name} width {w}: sampled drafts from a summary");
            }
        }
        // Block rows were scratch: one more committed row overwrites them, and the next pass sees it.
        let row = &rows[..width];
        cpu.append_context(&mut cpu_ctx, POSITIONS, row).expect("cpu append");
        gpu.append_context(&mut gpu_ctx, POSITIONS, row).expect("gpu append");
        let w = cpu.block_size();
        let pass = |model: &DraftModel, ctx: &mut DrafterContext| {
            let mut requests = [BlockRequest { ctx, anchor: 5, width: w }];
            model.forward_blocks(&mut requests, embed, lm_head, None).expect("pass").remove(0)
        };
        let (want, got) = (pass(&cpu, &mut cpu_ctx), pass(&gpu, &mut gpu_ctx));
        check_block(&format!("{name} after a new row"), &got, &want);
    }
}

#[test]
fn cuda_batched_passes_match_single_passes() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    let (cpu, target, rows) = cpu_pair("dflash-v2");
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let gpu = on_gpu("dflash-v2", &dev, &cpu, lm_head);
    let width = rows.len() / POSITIONS;
    let short = &rows[..70 * width];
    let context = |model: &DraftModel, rows: &[f32]| {
        let mut ctx = model.new_context().expect("context");
        model.append_context(&mut ctx, 0, rows).expect("append");
        ctx
    };
    let (mut a, mut b) = (context(&gpu, &rows), context(&gpu, short));
    // More contexts than the page pool first holds (64 pages; these take 3 each): it grows, keeping a's and b's.
    let fillers: Vec<DrafterContext> = (0..25).map(|_| context(&gpu, &rows)).collect();
    drop(fillers);
    let mut requests =
        [BlockRequest { ctx: &mut a, anchor: 9, width: 8 }, BlockRequest { ctx: &mut b, anchor: 200, width: 3 }];
    let both = gpu.forward_blocks(&mut requests, embed, lm_head, None).expect("batched pass");
    for (i, (rows, anchor, w)) in [(&rows[..], 9, 8), (short, 200, 3)].into_iter().enumerate() {
        let mut ctx = context(&cpu, rows);
        let mut requests = [BlockRequest { ctx: &mut ctx, anchor, width: w }];
        let want = cpu.forward_blocks(&mut requests, embed, lm_head, None).expect("cpu pass").remove(0);
        check_block(&format!("batched request {i}"), &both[i], &want);
    }
}

/// With [`DraftMatrices::Bf16`] (the default) the drafter's bf16 matrices run on bf16 tensor cores, its activations
/// rounded to bf16 (8 bits of mantissa, 2e-3 a rounding) before every matmul: the hidden rows and logits stay within
/// a few such roundings of the CPU's through the appends (pieces of up to 64 rows: cuBLAS past 32), passes of every
/// width (the small batch-invariant kernel) and a batched pass of 40 rows (cuBLAS). DFlash2's dynamic convolution
/// multiplies coefficients computed from rounded rows into rounded rows, which compounds: its logits were off by up
/// to 0.081 (relative to max(|logit|, 1)) on an H200, against 5e-2 for DFlash v1. A wrong layout or a lost row is
/// off by the logits' own size.
#[test]
fn cuda_drafters_on_bf16_tensor_cores_stay_within_bf16_rounding_of_the_cpu() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    for (name, tol) in [("dflash-v1", 5e-2), ("dflash-v2", 0.2)] {
        let (cpu, target, rows) = cpu_pair(name);
        let (embed, lm_head) = (target.embedding(), target.lm_head());
        let gpu = on_gpu_with(name, &dev, &cpu, lm_head, DraftMatrices::Bf16);
        let width = rows.len() / POSITIONS;
        let check = |what: &str, got: &BlockOutput, want: &BlockOutput| check_block_within(what, got, want, tol);
        let (mut cpu_ctx, mut gpu_ctx) = (appended(&cpu, &rows, width), appended(&gpu, &rows, width));
        for w in 2..=cpu.block_size() {
            let (_, want, got) = pass_at_width((&cpu, &gpu), (&mut cpu_ctx, &mut gpu_ctx), w, (embed, lm_head));
            check(&format!("{name} bf16 width {w}"), &got, &want);
        }
        let w = cpu.block_size();
        let mut contexts: Vec<DrafterContext> = (0..5)
            .map(|_| {
                let mut ctx = gpu.new_context().expect("context");
                gpu.append_context(&mut ctx, 0, &rows).expect("append");
                ctx
            })
            .collect();
        let mut requests: Vec<BlockRequest> = contexts
            .iter_mut()
            .enumerate()
            .map(|(i, ctx)| BlockRequest { ctx, anchor: 3 + i as u32, width: w })
            .collect();
        let batched = gpu.forward_blocks(&mut requests, embed, lm_head, None).expect("batched pass");
        for (i, got) in batched.iter().enumerate() {
            let mut ctx = cpu.new_context().expect("context");
            cpu.append_context(&mut ctx, 0, &rows).expect("append");
            let want = one_pass(&cpu, &mut ctx, (3 + i as u32, w), (embed, lm_head));
            check(&format!("{name} bf16 batched request {i}"), got, &want);
        }
    }
}

#[test]
fn cuda_drafters_score_a_draft_vocabulary() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    let (cpu, target, rows) = cpu_pair("dflash-v2");
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let ids: Vec<u32> = (0..256).filter(|i| i % 3 == 0 || i % 7 == 2).collect();
    let vocab = DraftVocab::gather(lm_head, &ids).expect("vocab");
    let gpu = DraftModel::load(&windowless("dflash-v2"), cpu.target())
        .expect("drafter")
        .to_cuda_with(dev.clone(), DraftHead::Vocab(&vocab), 1024, DraftMatrices::F32)
        .expect("to cuda");
    let (mut cpu_ctx, mut gpu_ctx) = (cpu.new_context().expect("cpu"), gpu.new_context().expect("gpu"));
    cpu.append_context(&mut cpu_ctx, 0, &rows).expect("append");
    gpu.append_context(&mut gpu_ctx, 0, &rows).expect("append");
    let greedy = DraftSampling::Greedy;
    let want = cpu.draft(&mut cpu_ctx, 42, 8, embed, DraftHead::Vocab(&vocab), DraftSampling::Greedy).expect("cpu");
    let got = gpu.draft(&mut gpu_ctx, 42, 8, embed, DraftHead::Vocab(&vocab), greedy).expect("gpu");
    assert_eq!(got.scores.dense().expect("dense").shape(), &[7, vocab.len()]);
    assert_close(
        "draft vocabulary logits",
        got.scores.dense().expect("dense").as_f32().expect("f32"),
        want.scores.dense().expect("dense").as_f32().expect("f32"),
        TOL,
    );
    assert_eq!(got.tokens, want.tokens, "drafts over the draft vocabulary");
    assert_eq!(got.token_ids.as_deref(), Some(vocab.ids()));
    let err = gpu.draft(&mut gpu_ctx, 42, 8, embed, lm_head, DraftSampling::Greedy).expect_err("another head");
    assert!(err.to_string().contains("head"), "{err}");
    let mut host_ctx = cpu.new_context().expect("host context");
    assert!(
        gpu.draft(&mut host_ctx, 42, 8, embed, DraftHead::Vocab(&vocab), DraftSampling::Greedy).is_err(),
        "a host context"
    );
}

/// A pass shape seen twice is captured as a CUDA graph and replayed from then on: the replay gives the eager pass's
/// bits (dense and summarised), also after the context grows under the same graph and after the page pool moves
/// (which drops the graphs, since they hold its addresses).
#[test]
fn cuda_passes_replayed_from_graphs_give_the_eager_bits() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    if dflash_runtime::switches::switches().no_draft_graph {
        eprintln!("SKIP: DFLASH_DRAFT_GRAPH=0 keeps every pass eager");
        return;
    }
    let (cpu, target, rows) = cpu_pair("dflash-v2");
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let gpu = on_gpu("dflash-v2", &dev, &cpu, lm_head);
    let width = rows.len() / POSITIONS;
    let mut ctx = gpu.new_context().expect("context");
    gpu.append_context(&mut ctx, 0, &rows[..100 * width]).expect("append");
    let pass = |ctx: &mut DrafterContext, readback: ScoreReadback| {
        let mut requests = [BlockRequest { ctx, anchor: 77, width: 6 }];
        let out = gpu.forward_blocks_with(&mut requests, embed, lm_head, readback).expect("pass").remove(0);
        let scores = match &out.scores {
            BlockScores::Dense(t) => t.as_f32().expect("f32").iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            BlockScores::Top(top) => {
                top.columns.iter().copied().chain(top.values.iter().map(|v| v.to_bits())).collect::<Vec<_>>()
            }
        };
        (out.hidden.as_f32().expect("f32").iter().map(|v| v.to_bits()).collect::<Vec<_>>(), scores)
    };
    let summary = gpu.readback_for(true);
    for readback in [ScoreReadback::Dense, summary] {
        // The first pass of a readback sizes its buffers (which drops the graphs held) and runs eagerly.
        let eager = pass(&mut ctx, readback);
        let (graphs, captures) = (gpu.pass_graphs(), gpu.pass_captures());
        let captured = pass(&mut ctx, readback);
        assert_eq!(gpu.pass_graphs(), graphs + 1, "{readback:?}: the second pass is captured");
        assert_eq!(gpu.pass_captures(), captures + 1, "{readback:?}: and counted once");
        let replayed = pass(&mut ctx, readback);
        assert_eq!(gpu.pass_captures(), captures + 1, "{readback:?}: a replay captures nothing");
        assert_eq!(captured, eager, "{readback:?}: the captured pass");
        assert_eq!(replayed, eager, "{readback:?}: the replayed pass");
    }
    // Ten more committed rows: the same key (page-table stride and key splits in powers of two), new inputs.
    gpu.append_context(&mut ctx, 100, &rows[100 * width..110 * width]).expect("append");
    let graphs = gpu.pass_graphs();
    let replayed = pass(&mut ctx, ScoreReadback::Dense);
    assert_eq!(gpu.pass_graphs(), graphs, "the grown context replays a graph it has");
    let mut cpu_ctx = cpu.new_context().expect("cpu context");
    cpu.append_context(&mut cpu_ctx, 0, &rows[..110 * width]).expect("cpu append");
    let mut requests = [BlockRequest { ctx: &mut cpu_ctx, anchor: 77, width: 6 }];
    let want = cpu.forward_blocks(&mut requests, embed, lm_head, None).expect("cpu pass").remove(0);
    let replayed_logits: Vec<f32> = replayed.1.iter().map(|&b| f32::from_bits(b)).collect();
    assert_close(
        "replay over a grown context",
        &replayed_logits,
        want.scores.dense().expect("dense").as_f32().expect("f32"),
        TOL,
    );
    // Enough contexts to grow the page pool: its pages move, the graphs go, and passes are right again.
    let fillers: Vec<DrafterContext> = (0..40)
        .map(|_| {
            let mut c = gpu.new_context().expect("filler");
            gpu.append_context(&mut c, 0, &rows).expect("filler rows");
            c
        })
        .collect();
    // (The fillers' appends may hold graphs of their own by now.)
    let (graphs, captures) = (gpu.pass_graphs(), gpu.pass_captures());
    let eager = pass(&mut ctx, ScoreReadback::Dense);
    assert_eq!(gpu.pass_graphs(), graphs, "the pool moved: the pass is new again, and runs eagerly");
    assert_eq!(gpu.pass_captures(), captures, "the graphs dropped, none captured");
    pass(&mut ctx, ScoreReadback::Dense);
    assert_eq!(gpu.pass_graphs(), graphs + 1, "and is captured anew");
    assert_eq!(gpu.pass_captures(), captures + 1, "counted once more");
    assert_eq!(pass(&mut ctx, ScoreReadback::Dense), eager, "replayed over the moved pool");
    assert_eq!(eager, replayed, "the moved pool holds the same context");
    drop(fillers);
}

/// Contexts appended together (one projection of all their rows on the device, in chunks that cross from one
/// context's rows to the next's) hold what one append each gives.
#[test]
fn cuda_joint_appends_match_one_append_each() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    let (cpu, target, rows) = cpu_pair("dflash-v2");
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let gpu = on_gpu("dflash-v2", &dev, &cpu, lm_head);
    let width = rows.len() / POSITIONS;
    let fresh = || gpu.new_context().expect("context");
    let (mut a, mut b, mut ja, mut jb) = (fresh(), fresh(), fresh(), fresh());
    let (mut c, mut jc) = (fresh(), fresh());
    for ctx in [&mut b, &mut jb] {
        gpu.append_context(ctx, 0, &rows[..7 * width]).expect("b's first rows");
    }
    gpu.append_context(&mut a, 0, &rows).expect("a");
    gpu.append_context(&mut b, 5, &rows[5 * width..80 * width]).expect("b");
    gpu.append_context(&mut c, 0, &rows).expect("c");
    // 150 + 73 + 150 new rows: more than one chunk of 256, the first chunk ending inside c's rows.
    gpu.append_contexts(&mut [
        ContextAppend { ctx: &mut ja, first_position: 0, captured: &rows },
        ContextAppend { ctx: &mut jb, first_position: 5, captured: &rows[5 * width..80 * width] },
        ContextAppend { ctx: &mut jc, first_position: 0, captured: &rows },
    ])
    .expect("joint append");
    for (name, one, joint) in [("a", &mut a, &mut ja), ("b", &mut b, &mut jb), ("c", &mut c, &mut jc)] {
        assert_eq!(joint.len(), one.len(), "{name}: length");
        let pass = |ctx: &mut DrafterContext| {
            let mut requests = [BlockRequest { ctx, anchor: 3, width: 8 }];
            gpu.forward_blocks(&mut requests, embed, lm_head, None).expect("pass").remove(0)
        };
        let (want, got) = (pass(one), pass(joint));
        check_block(&format!("joint append {name}"), &got, &want);
    }
}

/// Rows a target left on the device (`DeviceCaptured`) appended where they are give the contexts the host's rows give:
/// the same passes after the same appends, alone and jointly, rows a context already holds skipped, and rows gathered
/// from cache slots out of order; rows of another width, past the step's, or for a drafter on the host are refused.
#[test]
fn cuda_appends_from_device_rows_match_host_appends() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    let (cpu, target, rows) = cpu_pair("dflash-v2");
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let gpu = on_gpu("dflash-v2", &dev, &cpu, lm_head);
    let width = rows.len() / POSITIONS;
    let step = DeviceCaptured::new(Arc::clone(&dev), Arc::new(dev.upload(&rows).expect("rows")), POSITIONS, width);
    assert!(gpu.takes_device_rows(&step) && !cpu.takes_device_rows(&step));
    let fresh = || gpu.new_context().expect("context");
    let (mut a, mut b, mut da, mut db) = (fresh(), fresh(), fresh(), fresh());
    for ctx in [&mut b, &mut db] {
        gpu.append_context(ctx, 0, &rows[..7 * width]).expect("b's first rows on the host");
    }
    gpu.append_context(&mut a, 0, &rows[..40 * width]).expect("a");
    gpu.append_context(&mut b, 5, &rows[5 * width..80 * width]).expect("b");
    gpu.append_contexts_device(&mut [DeviceAppend { ctx: &mut da, first_position: 0, rows: ids(0..40) }], &step)
        .expect("a from the device");
    gpu.append_contexts_device(&mut [DeviceAppend { ctx: &mut db, first_position: 5, rows: ids(5..80) }], &step)
        .expect("b from the device, its first rows skipped");
    gpu.append_context(&mut a, 40, &rows[40 * width..41 * width]).expect("a's next row");
    gpu.append_context(&mut b, 80, &rows[80 * width..83 * width]).expect("b's next rows");
    gpu.append_contexts_device(
        &mut [
            DeviceAppend { ctx: &mut da, first_position: 40, rows: ids(40..41) },
            DeviceAppend { ctx: &mut db, first_position: 80, rows: ids(80..83) },
        ],
        &step,
    )
    .expect("joint append from the device");
    // b's rows from a pool of cache slots (pages of 16 positions, in reverse order, a spare slot row between):
    // gathered by slot, in two appends.
    let slot = |p: usize| ((POSITIONS.div_ceil(16) - 1 - p / 16) * 16 + p % 16) as u32;
    let mut pool = vec![f32::NAN; (POSITIONS.div_ceil(16) * 16 + 1) * width];
    for p in 0..POSITIONS {
        pool[slot(p) as usize * width..][..width].copy_from_slice(&rows[p * width..][..width]);
    }
    let pool_rows = pool.len() / width;
    let pages = DeviceCaptured::new(Arc::clone(&dev), Arc::new(dev.upload(&pool).expect("pool")), pool_rows, width);
    let mut dp = fresh();
    for span in [0..29, 29..83] {
        let first_position = span.start;
        let rows = span.map(slot).collect();
        gpu.append_contexts_device(&mut [DeviceAppend { ctx: &mut dp, first_position, rows }], &pages)
            .expect("b from the pages");
    }
    let mut b_again = fresh();
    gpu.append_context(&mut b_again, 0, &rows[..83 * width]).expect("b again");
    for (name, host, device) in
        [("a", &mut a, &mut da), ("b", &mut b, &mut db), ("b from pages", &mut b_again, &mut dp)]
    {
        assert_eq!(device.len(), host.len(), "{name}: length");
        let pass = |ctx: &mut DrafterContext| {
            let mut requests = [BlockRequest { ctx, anchor: 3, width: 8 }];
            gpu.forward_blocks(&mut requests, embed, lm_head, None).expect("pass").remove(0)
        };
        let (want, got) = (pass(host), pass(device));
        check_block(&format!("device rows {name}"), &got, &want);
    }
    let narrow =
        DeviceCaptured::new(Arc::clone(&dev), Arc::new(dev.upload(&rows).expect("rows")), POSITIONS, width / 2);
    let mut c = fresh();
    let refused = |c: &mut DrafterContext, captured: &DeviceCaptured, rows: std::ops::Range<usize>| {
        let rows = ids(rows);
        gpu.append_contexts_device(&mut [DeviceAppend { ctx: c, first_position: 0, rows }], captured).is_err()
    };
    assert!(refused(&mut c, &narrow, 0..4), "rows of another width");
    assert!(refused(&mut c, &step, POSITIONS - 1..POSITIONS + 1), "rows past the step's");
    assert!(!refused(&mut c, &step, 0..0) && c.is_empty(), "nothing to append");
    let mut host_ctx = cpu.new_context().expect("host context");
    let host_refused = cpu
        .append_contexts_device(&mut [DeviceAppend { ctx: &mut host_ctx, first_position: 0, rows: ids(0..4) }], &step);
    assert!(host_refused.is_err(), "a drafter on the host");
}

/// Indices of captured rows.
fn ids(rows: std::ops::Range<usize>) -> Vec<u32> {
    rows.map(|r| r as u32).collect()
}

/// A drafter with sliding-window layers is named, and refused by the CUDA passes rather than run wrong; the server's
/// `--drafter-device auto` keeps such a drafter on the host.
#[test]
fn cuda_drafters_refuse_sliding_windows_by_name() {
    let Some(dev) = cuda_device("cuda_dflash") else { return };
    let (_, target, _) = cpu_pair("dflash-v2");
    let sliding = DraftModel::load(&fixtures().join("dflash-v2"), &target_shape()).expect("drafter");
    let why = sliding.cuda_refusal().expect("a sliding layer");
    assert!(why.contains("sliding window"), "{why}");
    let err = sliding.to_cuda(dev.clone(), DraftHead::Full(target.lm_head()), 1024).expect_err("refused");
    assert!(err.to_string().contains("sliding window"), "{err}");
    let windowless = DraftModel::load(&windowless("dflash-v2"), &target_shape()).expect("drafter");
    assert_eq!(windowless.cuda_refusal(), None);
}
