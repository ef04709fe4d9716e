//! `dflash run`: one chat-templated generation streamed to stdout.

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result};
use dflash_engine::{GenerateOptions, Generator};
use dflash_models::tokenizer::{ChatMessage, IncrementalDecoder};
use dflash_models::{load_model, LoadOptions, LoadedModel};

use crate::cli::{FetchArgs, ModelArgs, RunArgs};

/// Resolves, loads and reports a model.
pub fn load(args: &ModelArgs) -> Result<LoadedModel> {
    args.check_device()?;
    let threads = dflash_runtime::threads::init(args.threads);
    let source = dflash_models::resolve::resolve_model(args.model.as_deref())?;
    let t0 = Instant::now();
    let opts = LoadOptions { config_overrides: args.overrides()?, f32_weights: args.f32_weights, ..Default::default() };
    let loaded = load_model(&source, &opts).with_context(|| format!("loading {source:?}"))?;
    let cfg = loaded.model.config();
    tracing::info!(
        "loaded {} ({:?}, {} layers, hidden {}, vocab {}) in {:.0} ms; {threads} threads, {}",
        loaded.name,
        cfg.arch,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        t0.elapsed().as_secs_f64() * 1e3,
        dflash_runtime::quant::simd_level(),
    );
    Ok(loaded)
}

/// The prompt as token ids: chat-templated unless `--raw`.
fn prompt_ids(loaded: &LoadedModel, args: &RunArgs) -> Result<Vec<u32>> {
    let tok = &loaded.tokenizer;
    let text = match (args.raw, tok.chat_template()) {
        (false, Some(tpl)) => {
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(ChatMessage { role: "system".into(), content: s.clone() });
            }
            messages.push(ChatMessage { role: "user".into(), content: args.prompt.clone() });
            tpl.render(&messages, true, &serde_json::json!({}))?
        }
        _ => args.prompt.clone(),
    };
    Ok(tok.encode(&text, true)?)
}

pub fn run(args: &RunArgs) -> Result<()> {
    let loaded = load(&args.model)?;
    let ids = prompt_ids(&loaded, args)?;
    let cfg = loaded.model.config();
    let ctx = args.model.ctx_size.unwrap_or(cfg.max_position_embeddings.min(8192));
    let mut gen = Generator::new(&loaded.model, ctx, 16)?;
    let mut stop_ids = loaded.tokenizer.eos_ids().to_vec();
    stop_ids.extend(&cfg.eos_token_ids);
    let opts = GenerateOptions {
        max_new_tokens: args.max_tokens,
        sampling: args.sampling.params(&loaded.generation)?,
        ignore_eos: args.ignore_eos,
        stop_ids,
        prefill_chunk: 512,
    };
    let mut detok = IncrementalDecoder::new(&loaded.tokenizer, true);
    let mut stdout = std::io::stdout().lock();
    let mut write_err = None;
    let (_, finish, stats) = gen.generate(&ids, &opts, |id| {
        let piece = match detok.push(id) {
            Ok(p) => p,
            Err(e) => {
                write_err = Some(anyhow::Error::from(e));
                return false;
            }
        };
        if let Err(e) = stdout.write_all(piece.as_bytes()).and_then(|_| stdout.flush()) {
            write_err = Some(e.into());
            return false;
        }
        true
    })?;
    if let Some(e) = write_err {
        return Err(e);
    }
    let tail = detok.flush()?;
    writeln!(stdout, "{tail}")?;
    eprintln!(
        "[stats] prompt {} tokens, generated {} ({finish:?}), TTFT {:.1} ms, prefill {:.1} tok/s, decode {:.1} tok/s",
        stats.prompt_tokens,
        stats.generated_tokens,
        stats.ttft.as_secs_f64() * 1e3,
        stats.prefill_tok_s(),
        stats.decode_tok_s(),
    );
    Ok(())
}

/// `dflash fetch`: resolves (downloading if needed) and prints where the model is.
pub fn fetch(args: &FetchArgs) -> Result<()> {
    let source = dflash_models::resolve::resolve_model(args.model.as_deref())?;
    match source {
        dflash_models::resolve::ModelSource::GgufFile(p) | dflash_models::resolve::ModelSource::HfDir(p) => {
            println!("{}", p.display())
        }
    }
    Ok(())
}
