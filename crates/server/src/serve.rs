//! `dflash serve`: load the model, start the engine thread, serve the OpenAI API until SIGINT/SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use dflash_engine::{EngineClient, EngineMetrics};

use crate::cli::ServeArgs;
use crate::http::{self, ConnLimits, HttpConfig};
use crate::live::LiveEngine;
use crate::memory;
use crate::setup::{Built, EnginePlan, Startup, PAGE_SIZE};
use dflash_models::{Device, KvPages};

pub fn serve(args: &ServeArgs) -> Result<()> {
    let startup = Startup::begin(&args.model, &args.spec)?;
    let context_window = startup.context_window();
    let bytes_per_token = startup.kv_bytes_per_token();
    let page_bytes = bytes_per_token * PAGE_SIZE as u64;
    let window_bytes = context_window as u64 * bytes_per_token;
    let available = memory::available();
    let pages = match (args.kv_cache_mem, startup.device()) {
        (None, Device::Cuda(_)) => KvPages::FreeMemory(args.kv_cache_fraction),
        (mem, device) => {
            let kv_mem = mem.unwrap_or_else(|| memory::default_cpu_kv(available, window_bytes));
            let tokens = kv_mem / bytes_per_token.max(1);
            if tokens < context_window as u64 {
                bail!(
                    "--kv-cache-mem {kv_mem} holds {tokens} tokens, less than one context window of {context_window}: \
                     give at least {} MiB or a smaller --ctx-size",
                    window_bytes.div_ceil(1 << 20)
                );
            }
            if device == Device::Cpu {
                memory::check_fits(startup.weight_file_bytes(), kv_mem, available)?;
            }
            KvPages::Fixed(usize::try_from(kv_mem / page_bytes.max(1)).unwrap_or(usize::MAX))
        }
    };
    let plan = EnginePlan {
        context_window,
        pages,
        max_running: args.max_concurrent,
        max_batch_tokens: args.max_batch_tokens,
        // The engine also charges captured rows and hybrid targets' state checkpoints to this budget (and keeps the
        // cache off for hybrid targets without checkpoints).
        prefix_cache: args.prefix_cache.clone(),
        spec: args.spec.config()?,
    };
    let metrics = Arc::new(EngineMetrics::default());
    let Built { mut engine, name, tokenizer, generation } = startup.build(plan, Arc::clone(&metrics))?;
    let num_pages = engine.num_pages();
    // At start-up, so the first request does not pay for the round policy's calibration.
    engine.probe_round_costs_at_start();
    tracing::info!(
        "KV cache: {num_pages} pages of {PAGE_SIZE} tokens ({:.0} MiB, {} tokens); context window {context_window}; \
         up to {} sequences, {} rows per step",
        (num_pages as u64 * PAGE_SIZE as u64 * bytes_per_token) as f64 / (1u64 << 20) as f64,
        num_pages * PAGE_SIZE,
        args.max_concurrent,
        args.max_batch_tokens.max(args.max_concurrent),
    );
    match engine.prefix_cache_pages() {
        0 => tracing::info!("prefix cache: off"),
        n => tracing::info!(
            "prefix cache: up to {n} pages ({:.0} MiB of K/V); idle cached pages are given back when requests need room",
            (n as u64 * page_bytes) as f64 / (1u64 << 20) as f64
        ),
    }
    let (client, engine_thread) =
        dflash_engine::spawn(engine, args.max_queue, metrics).context("starting the engine thread")?;
    let served_names = args.served_model_name.clone();
    let name = served_names.first().cloned().unwrap_or(name);
    let grammars = grammar_compiler(&tokenizer);
    let live = LiveEngine {
        client: client.clone(),
        tokenizer,
        name,
        served_names,
        context_window,
        defaults: generation,
        grammars,
    };
    let http_cfg = HttpConfig {
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: usize::try_from(args.max_body_bytes).unwrap_or(usize::MAX),
        retry_after_secs: 1,
        body_timeout: Duration::from_secs(args.body_timeout),
        tool_call_parser: args.tool_call_parser,
    };
    let app = http::router(Arc::new(live), http_cfg);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let grace = Duration::from_secs(args.shutdown_timeout);
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        tracing::info!("listening on http://{}", listener.local_addr()?);
        let limits = ConnLimits {
            max_connections: args.max_connections,
            header_timeout: Duration::from_secs(args.header_timeout),
        };
        http::serve(listener, app, limits, shutdown_signal(client.clone(), grace)).await?;
        anyhow::Ok(())
    });
    // Also reached when binding failed: stop the engine either way.
    client.shutdown(grace);
    drop(client);
    if engine_thread.join().is_err() {
        tracing::error!("the engine thread panicked");
    }
    runtime.shutdown_timeout(Duration::from_secs(1));
    served?;
    tracing::info!("stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM, after telling the engine to finish running streams within `grace`; a second
/// signal during the grace period ends the process at once.
async fn shutdown_signal(client: EngineClient, grace: Duration) {
    next_signal().await;
    tracing::info!(
        "shutting down: no new requests; running streams get {} s to finish (a second Ctrl-C stops at once)",
        grace.as_secs()
    );
    client.shutdown(grace);
    tokio::spawn(async {
        next_signal().await;
        tracing::warn!("second signal: stopping now");
        std::process::exit(130);
    });
}

/// Resolves on the next SIGINT or SIGTERM.
async fn next_signal() {
    let interrupt = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// The structured-output compiler for the served tokenizer; without one the server still serves, and requests
/// that ask for a grammar get a 400 saying why.
fn grammar_compiler(
    tokenizer: &dflash_models::tokenizer::Tokenizer,
) -> Option<dflash_engine::grammar::GrammarCompiler> {
    match dflash_engine::grammar::GrammarCompiler::new(tokenizer) {
        Ok(compiler) => Some(compiler),
        Err(e) => {
            tracing::warn!("structured outputs are off: {e}");
            None
        }
    }
}
