//! Golden parity of the DFlash v1 and DFlash2 drafters against the reference `dflash` package (fixtures from
//! tools/golden/dflash_fixtures.py), plus the loader's and the context's contracts.
//!
//! Each fixture holds a tiny drafter in the published layout and three drafting rounds against the tiny-qwen3
//! target: the prompt as context with a full block; three appended rows through the cached context; one appended
//! row with a shortened block. Our target captures the taps itself, so the chain target → drafter is checked end
//! to end: taps, projected context, every layer (and DFlash2 convolution) output, final hidden rows, logits at
//! 1e-4 relative, and identical greedy and sampled drafts (top-K candidates and walked paths for DFlash2).

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{assert_close, edited_checkpoint, fixtures, read_golden, run_sequence, Golden};
use dflash_models::config::ModelConfig;
use dflash_models::dflash::{
    BlockRequest, BlockTrace, CaptureLayout, ContextAppend, DraftKind, DraftModel, DraftProbs, DraftSampling,
    DrafterContext, InverseCdf, SamplingFilter, TargetShape, WalkMode,
};
use dflash_models::llama::load_hf_weights;
use dflash_models::llama::LlamaModel;
use dflash_models::safetensors_dir::read_json;
use dflash_models::{LoadOptions, StreamTap};
use dflash_runtime::Tensor;

const TOL: f32 = 1e-4;
const ROUNDS: usize = 3;
/// The fixtures' sampling settings (also in each golden file's metadata).
const V1_FILTER: SamplingFilter = SamplingFilter { temperature: 0.7, top_k: 20, top_p: 0.9 };
const V2_TEMPERATURE: f32 = 0.8;

fn target_spec() -> TargetShape {
    let json = read_json(&fixtures().join("tiny-qwen3/config.json")).expect("target config");
    TargetShape::of(&ModelConfig::from_hf(&json).expect("target config parses"))
}

fn load_pair(name: &str) -> (DraftModel, LlamaModel, HashMap<String, Golden>) {
    let model = DraftModel::load(&fixtures().join(name), &target_spec()).expect("load drafter");
    let opts = LoadOptions { capture_layers: model.target_layer_ids().to_vec(), ..Default::default() };
    let target = load_hf_weights(&fixtures().join("tiny-qwen3"), &opts).expect("load target");
    let golden = read_golden(&fixtures().join(name).join("golden.safetensors"));
    (model, target, golden)
}

fn ints(g: &Golden) -> Vec<u32> {
    g.data.iter().map(|&x| x as u32).collect()
}

/// Rows `a..b` of a row-major `[rows, width]` buffer.
fn rows(data: &[f32], width: usize, a: usize, b: usize) -> &[f32] {
    &data[a * width..b * width]
}

fn check_drafter(name: &str, kind: DraftKind) {
    let (model, target, g) = load_pair(name);
    assert_eq!(model.kind(), kind);
    let h = model.config().hidden_size();
    let sequence = ints(&g["sequence"]);
    // The target is causal, so one pass over the whole sequence captures the rows every round's verify would.
    let (_, captured) = run_sequence(&target, &sequence, 0, 5);
    let width = model.target_layer_ids().len() * h;
    let mut ctx = model.new_context().expect("context");
    for r in 0..ROUNDS {
        let key = |k: &str| format!("r{r}.{k}");
        let start = g[&key("start")].data[0] as usize;
        let first = start - g[&key("ctx_taps")].shape[0];
        let taps = rows(&captured, width, first, start);
        assert_close(&format!("{name} r{r} target taps"), taps, &g[&key("ctx_taps")].data, TOL);
        let projected = model.project_context(&Tensor::from_f32(taps, &[start - first, width]).expect("t")).expect("C");
        assert_close(&format!("{name} r{r} context"), projected.as_f32().expect("f32"), &g[&key("context")].data, TOL);
        model.append_context(&mut ctx, first, taps).expect("append");
        assert_eq!(ctx.len(), start);
        check_round(name, r, &model, &target, &mut ctx, &g);
    }
}

fn check_round(
    name: &str,
    r: usize,
    model: &DraftModel,
    target: &LlamaModel,
    ctx: &mut DrafterContext,
    g: &HashMap<String, Golden>,
) {
    let key = |k: &str| format!("r{r}.{k}");
    let what = |k: &str| format!("{name} r{r} {k}");
    let block = ints(&g[&key("block_tokens")]);
    let (anchor, width) = (block[0], block.len());
    assert!(block[1..].iter().all(|&t| t == model.config().mask_token_id));
    let mut trace = BlockTrace::default();
    let mut requests = [BlockRequest { ctx: &mut *ctx, anchor, width }];
    let out = model
        .forward_blocks(&mut requests, target.embedding(), target.lm_head(), Some(&mut trace))
        .expect("block pass")
        .remove(0);
    for (l, lt) in trace.layers.iter().enumerate() {
        assert_close(&what(&format!("layer {l} output")), &lt.output, &g[&key(&format!("layer{l}.out"))].data, TOL);
        if model.kind() == DraftKind::DFlash2 {
            for (got, part) in [
                (&lt.attention_prepare, "attention_prepare"),
                (&lt.attention_finish, "attention_finish"),
                (&lt.mlp_prepare, "mlp_prepare"),
                (&lt.mlp_finish, "mlp_finish"),
            ] {
                assert_close(&what(&format!("layer {l} {part}")), got, &g[&key(&format!("layer{l}.{part}"))].data, TOL);
            }
        } else {
            assert!(lt.attention_prepare.is_empty() && lt.mlp_finish.is_empty(), "v1 has no convolutions");
        }
    }
    assert_close(&what("final hidden"), &trace.final_hidden, &g[&key("hidden")].data, TOL);
    assert_close(
        &what("logits"),
        out.scores.dense().expect("dense").as_f32().expect("f32"),
        &g[&key("logits")].data,
        TOL,
    );
    assert_eq!(out.start, ctx.len());
    match model.kind() {
        DraftKind::DFlash => check_v1_drafts(model, target, ctx, r, g, out),
        DraftKind::DFlash2 => check_v2_drafts(model, target, ctx, r, g, out),
    }
}

fn check_v1_drafts(
    model: &DraftModel,
    target: &LlamaModel,
    ctx: &mut DrafterContext,
    r: usize,
    g: &HashMap<String, Golden>,
    out: dflash_models::dflash::BlockOutput,
) {
    let key = |k: &str| format!("r{r}.{k}");
    let anchor = ints(&g[&key("block_tokens")])[0];
    let width = g[&key("block_tokens")].data.len();
    let greedy = model.propose(out, anchor, DraftSampling::Greedy).expect("greedy");
    assert_eq!(greedy.tokens, ints(&g[&key("greedy")]), "v1 r{r} greedy drafts");
    assert!(greedy.q.is_none());
    // Sampled, end to end through `draft` (a second block pass over the same context must not change anything).
    let mut draw = InverseCdf::new(g[&key("uniforms")].data.clone());
    let sampling = DraftSampling::Sample { filter: V1_FILTER, draw: &mut draw };
    let sampled = model.draft(ctx, anchor, width, target.embedding(), target.lm_head(), sampling).expect("draft");
    assert_eq!(sampled.tokens, ints(&g[&key("sampled")]), "v1 r{r} sampled drafts");
    let Some(DraftProbs::Dense { probs, .. }) = &sampled.q else { panic!("v1 sampled drafts carry dense q") };
    assert_close(&format!("v1 r{r} sampled q"), probs, &g[&key("sampled_q")].data, TOL);
    assert_eq!(draw.used(), width - 1);
}

fn check_v2_drafts(
    model: &DraftModel,
    target: &LlamaModel,
    ctx: &mut DrafterContext,
    r: usize,
    g: &HashMap<String, Golden>,
    out: dflash_models::dflash::BlockOutput,
) {
    let key = |k: &str| format!("r{r}.{k}");
    let what = |k: &str| format!("v2 r{r} {k}");
    let anchor = ints(&g[&key("block_tokens")])[0];
    let width = g[&key("block_tokens")].data.len();
    let selector = model.selector().expect("selector");
    let candidates = selector.candidates(&out.scores).expect("candidates");
    assert_eq!(candidates.ids, ints(&g[&key("topk_ids")]), "{}", what("top-K ids"));
    assert_close(&what("top-K values"), &candidates.values, &g[&key("topk_values")].data, TOL);
    let projected = selector.project(&out.hidden).expect("project");
    assert_close(&what("projected hidden"), projected.as_f32().expect("f32"), &g[&key("projected")].data, TOL);
    let first_position = (out.start + 1) as u32;
    let walk = selector.walk(anchor, &candidates, &projected, first_position, WalkMode::Greedy).expect("walk");
    assert_eq!(walk.path, ints(&g[&key("greedy")]), "{}", what("greedy path"));
    assert_close(&what("greedy scores"), &walk.scores, &g[&key("greedy_scores")].data, TOL);
    let mut draw = InverseCdf::new(g[&key("uniforms")].data.clone());
    let mode = WalkMode::Sample { temperature: V2_TEMPERATURE, draw: &mut draw };
    let walk = selector.walk(anchor, &candidates, &projected, first_position, mode).expect("walk");
    assert_eq!(walk.path, ints(&g[&key("sampled")]), "{}", what("sampled path"));
    assert_close(&what("sampled scores"), &walk.scores, &g[&key("sampled_scores")].data, TOL);
    assert_close(&what("sampled q"), walk.q.as_deref().expect("q"), &g[&key("sampled_q")].data, TOL);
    // The same through `propose` and `draft`; DFlash2 ignores top-k / top-p on the draft side.
    let greedy = model.propose(out, anchor, DraftSampling::Greedy).expect("greedy");
    assert_eq!(greedy.tokens, ints(&g[&key("greedy")]));
    let mut draw = InverseCdf::new(g[&key("uniforms")].data.clone());
    let filter = SamplingFilter { temperature: V2_TEMPERATURE, top_k: 1, top_p: 0.1 };
    let sampling = DraftSampling::Sample { filter, draw: &mut draw };
    let sampled = model.draft(ctx, anchor, width, target.embedding(), target.lm_head(), sampling).expect("draft");
    assert_eq!(sampled.tokens, ints(&g[&key("sampled")]));
    let q = sampled.q.expect("q");
    for (slot, &token) in sampled.tokens.iter().enumerate() {
        let k = candidates.k;
        let ids = &candidates.ids[slot * k..(slot + 1) * k];
        let at = ids.iter().position(|&id| id == token).expect("drafts are candidates");
        assert!((q.prob(slot, token) - g[&key("sampled_q")].data[slot * k + at]).abs() < TOL);
    }
}

#[test]
fn dflash_v1_matches_the_reference() {
    check_drafter("dflash-v1", DraftKind::DFlash);
}

#[test]
fn dflash2_matches_the_reference() {
    check_drafter("dflash-v2", DraftKind::DFlash2);
}

fn load_err(dir: &Path, target: &TargetShape) -> String {
    DraftModel::load(dir, target).expect_err("load must fail").to_string()
}

#[test]
fn strict_loader_names_the_tensor() {
    let spec = target_spec();
    let missing = edited_checkpoint("dflash-v2", |t| t.retain(|(n, ..)| n != "layers.1.mlp_conv.base_kernel"));
    assert!(load_err(missing.path(), &spec).contains("layers.1.mlp_conv.base_kernel"));
    let extra = edited_checkpoint("dflash-v1", |t| {
        let fc = t.iter().find(|(n, ..)| n == "norm.weight").expect("norm").clone();
        t.push(("lm_head.weight".into(), fc.1, fc.2, fc.3));
    });
    assert!(load_err(extra.path(), &spec).contains("lm_head.weight"));
    let misshapen = edited_checkpoint("dflash-v2", |t| {
        let p = t.iter_mut().find(|(n, ..)| n == "candidate_selector.hidden_projection.weight").expect("projection");
        p.2 = vec![16, 64];
        p.3.truncate(16 * 64 * 2);
    });
    assert!(load_err(misshapen.path(), &spec).contains("candidate_selector.hidden_projection.weight"));
    // A plain `save_pretrained` names the codebooks with `.weight`: accepted as the same tensors.
    let suffixed = edited_checkpoint("dflash-v2", |t| {
        for (n, ..) in t.iter_mut().filter(|(n, ..)| n.ends_with("_codebook")) {
            n.push_str(".weight");
        }
    });
    DraftModel::load(suffixed.path(), &spec).expect("codebooks with a .weight suffix");
    // fc input of 2 taps x 2 streams x 64: trained on a two-stream hyper-connection target.
    let concat = edited_checkpoint("dflash-v1", |t| {
        let fc = t.iter_mut().find(|(n, ..)| n == "fc.weight").expect("fc");
        let row = fc.3.len() / 64;
        fc.3 = fc.3.chunks_exact(row).flat_map(|r| [r, r].concat()).collect();
        fc.2 = vec![64, 256];
    });
    let err = load_err(concat.path(), &spec);
    assert!(err.contains("2 hyper-connection streams"), "{err}");
    let two_streams = TargetShape { residual_streams: 2, ..spec.clone() };
    let model = DraftModel::load(concat.path(), &two_streams).expect("a two-stream target fits");
    assert_eq!(model.capture_layout(), CaptureLayout::StreamConcat { streams: 2 });
}

#[test]
fn drafters_are_checked_against_the_target() {
    let spec = target_spec();
    let dir = fixtures().join("dflash-v1");
    let err = load_err(&dir, &TargetShape { hidden_size: 32, ..spec.clone() });
    assert!(err.contains("hidden_size"), "{err}");
    let err = load_err(&dir, &TargetShape { vocab_size: 200, ..spec.clone() });
    assert!(err.contains("mask_token_id 250"), "{err}");
    let err = load_err(&fixtures().join("dflash-v2"), &TargetShape { vocab_size: 300, ..spec.clone() });
    assert!(err.contains("vocab_size"), "{err}");
    let err = load_err(&dir, &TargetShape { num_layers: 1, ..spec.clone() });
    assert!(err.contains("layer 1"), "{err}");
    let model = DraftModel::load(&dir, &spec).expect("load");
    assert_eq!(model.block_size(), 8);
    assert_eq!(model.clamp_block_size(None).expect("default"), 8);
    assert_eq!(model.clamp_block_size(Some(4)).expect("smaller"), 4);
    assert_eq!(model.clamp_block_size(Some(32)).expect("clamped"), 8);
    assert!(model.clamp_block_size(Some(1)).is_err());
}

#[test]
fn stream_mean_drafters_read_the_targets_mean_taps() {
    let spec = target_spec();
    let dir = fixtures().join("dflash-v1");
    // fc takes taps x hidden: on a three-stream target the target pools each tap, and the rows read as plain ones.
    let pooled = DraftModel::load(&dir, &TargetShape { residual_streams: 3, ..spec }).expect("pooled");
    assert_eq!(pooled.capture_layout(), CaptureLayout::Plain);
    assert_eq!(pooled.capture_layout().stream_tap(), StreamTap::Mean);
    let g = read_golden(&dir.join("golden.safetensors"));
    let taps = &g["r0.ctx_taps"];
    let rows_n = taps.shape[0];
    pooled.project_context(&Tensor::from_f32(&taps.data, &[rows_n, 128]).expect("t")).expect("mean rows");
    let raw: Vec<f32> = taps.data.iter().flat_map(|&x| [x, x, x]).collect();
    assert!(pooled.project_context(&Tensor::from_f32(&raw, &[rows_n, 384]).expect("t")).is_err(), "raw rows");
}

/// A drafter of a config's shapes with random weights (benchmarks of real shapes) loads against its target and drafts a
/// block; the same seed gives the same drafts, another seed other ones.
#[test]
fn random_drafters_of_a_config_load_and_draft() {
    let (model, target, g) = load_pair("dflash-v2");
    let (taps, anchor) = prompt_taps(&g);
    let drafts = |seed: u64| {
        let random = DraftModel::random(model.config().clone(), model.target(), seed).expect("random drafter");
        let mut ctx = random.new_context().expect("context");
        random.append_context(&mut ctx, 0, &taps).expect("rows");
        let (embed, lm_head) = (target.embedding(), target.lm_head());
        random.draft(&mut ctx, anchor, 8, embed, lm_head, DraftSampling::Greedy).expect("draft").tokens
    };
    let a = drafts(1);
    assert_eq!(a.len(), 7, "a block of 8: the anchor and 7 drafts");
    assert!(a.iter().all(|&t| (t as usize) < model.target().vocab_size));
    assert_eq!(drafts(1), a, "a pure function of the seed");
    assert_ne!(drafts(2), a, "another seed, other weights");
}

/// Prompt taps of a fixture (`[12, taps·H]` rows for positions 0..12) and the round-0 anchor.
fn prompt_taps(g: &HashMap<String, Golden>) -> (Vec<f32>, u32) {
    (g["r0.ctx_taps"].data.clone(), ints(&g["r0.block_tokens"])[0])
}

#[test]
fn context_is_append_only_and_refuses_gaps() {
    let (model, target, g) = load_pair("dflash-v2");
    let (taps, anchor) = prompt_taps(&g);
    let mut ctx = model.new_context().expect("context");
    let err = model.append_context(&mut ctx, 3, &taps).expect_err("gap").to_string();
    assert!(err.contains("gap"), "{err}");
    // In two pieces, with the second piece overlapping rows already held (skipped).
    model.append_context(&mut ctx, 0, &taps[..7 * 128]).expect("first rows");
    model.append_context(&mut ctx, 5, &taps[5 * 128..]).expect("overlapping rows");
    model.append_context(&mut ctx, 0, &taps[..4 * 128]).expect("rows already held");
    assert!(model.append_context(&mut ctx, 12, &taps[..100]).is_err(), "not whole rows");
    assert_eq!(ctx.len(), 12);
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let draft = model.draft(&mut ctx, anchor, 8, embed, lm_head, DraftSampling::Greedy).expect("draft");
    assert_eq!(draft.tokens, ints(&g["r0.greedy"]));
    assert_close(
        "pieces vs golden",
        draft.scores.dense().expect("dense").as_f32().expect("f32"),
        &g["r0.logits"].data,
        TOL,
    );
    // Drafting does not commit anything: the block rows are scratch.
    assert_eq!(ctx.len(), 12);
    for width in [1, 9] {
        let err = model.draft(&mut ctx, anchor, width, embed, lm_head, DraftSampling::Greedy).expect_err("width");
        assert!(err.to_string().contains("block width"), "{err}");
    }
    let mut wrong = model.new_context().expect("context");
    assert!(model.draft(&mut wrong, 300, 8, embed, lm_head, DraftSampling::Greedy).is_err(), "anchor past vocab");
}

#[test]
fn joint_appends_match_one_append_each_and_commit_nothing_when_one_is_bad() {
    let (model, target, g) = load_pair("dflash-v2");
    let (taps, anchor) = prompt_taps(&g);
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let row = 128;
    let logits = |ctx: &mut DrafterContext| {
        let draft = model.draft(ctx, anchor, 8, embed, lm_head, DraftSampling::Greedy).expect("draft");
        draft.scores.dense().expect("dense").as_f32().expect("f32").to_vec()
    };
    // One append each: a fresh context, one holding 7 rows that gets rows 5.. (two already held), one whose rows are
    // all held already.
    let fresh = || model.new_context().expect("context");
    let (mut a, mut b, mut c) = (fresh(), fresh(), fresh());
    model.append_context(&mut b, 0, &taps[..7 * row]).expect("b's first rows");
    model.append_context(&mut c, 0, &taps).expect("c's rows");
    let (mut ja, mut jb, mut jc) = (fresh(), fresh(), fresh());
    model.append_context(&mut jb, 0, &taps[..7 * row]).expect("b's first rows");
    model.append_context(&mut jc, 0, &taps).expect("c's rows");
    model.append_context(&mut a, 0, &taps).expect("a");
    model.append_context(&mut b, 5, &taps[5 * row..]).expect("b");
    model.append_context(&mut c, 3, &taps[3 * row..6 * row]).expect("c");
    // A gap in one of them refuses the whole call and commits nothing.
    let mut bad = [
        ContextAppend { ctx: &mut ja, first_position: 0, captured: &taps },
        ContextAppend { ctx: &mut jb, first_position: 9, captured: &taps[9 * row..] },
    ];
    let err = model.append_contexts(&mut bad).expect_err("gap").to_string();
    assert!(err.contains("gap"), "{err}");
    assert_eq!((ja.len(), jb.len()), (0, 7), "nothing committed");
    model
        .append_contexts(&mut [
            ContextAppend { ctx: &mut ja, first_position: 0, captured: &taps },
            ContextAppend { ctx: &mut jb, first_position: 5, captured: &taps[5 * row..] },
            ContextAppend { ctx: &mut jc, first_position: 3, captured: &taps[3 * row..6 * row] },
        ])
        .expect("joint append");
    for (name, one, joint) in [("fresh", &mut a, &mut ja), ("overlap", &mut b, &mut jb), ("held", &mut c, &mut jc)] {
        assert_eq!(joint.len(), one.len(), "{name}: length");
        assert_eq!(logits(joint), logits(one), "{name}: the same context, bit for bit");
    }
}

#[test]
fn batched_blocks_match_single_blocks() {
    let (model, target, g) = load_pair("dflash-v2");
    let (taps, anchor) = prompt_taps(&g);
    let short = &taps[..5 * 128];
    let (embed, lm_head) = (target.embedding(), target.lm_head());
    let single = |t: &[f32], width: usize| {
        let mut ctx = model.new_context().expect("context");
        model.append_context(&mut ctx, 0, t).expect("append");
        let mut requests = [BlockRequest { ctx: &mut ctx, anchor, width }];
        model.forward_blocks(&mut requests, embed, lm_head, None).expect("pass").remove(0)
    };
    let (a, b) = (single(&taps, 8), single(short, 5));
    let (mut ctx_a, mut ctx_b) = (model.new_context().expect("a"), model.new_context().expect("b"));
    model.append_context(&mut ctx_a, 0, &taps).expect("append");
    model.append_context(&mut ctx_b, 0, short).expect("append");
    let mut requests =
        [BlockRequest { ctx: &mut ctx_a, anchor, width: 8 }, BlockRequest { ctx: &mut ctx_b, anchor, width: 5 }];
    let both = model.forward_blocks(&mut requests, embed, lm_head, None).expect("batched pass");
    for (got, want) in both.iter().zip([&a, &b]) {
        assert_eq!(got.start, want.start);
        assert_close(
            "batched logits",
            got.scores.dense().expect("dense").as_f32().expect("f32"),
            want.scores.dense().expect("dense").as_f32().expect("f32"),
            1e-5,
        );
    }
    assert_close(
        "batched logits vs golden",
        both[0].scores.dense().expect("dense").as_f32().expect("f32"),
        &g["r0.logits"].data,
        TOL,
    );
}
