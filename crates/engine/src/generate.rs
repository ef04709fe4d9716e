//! One sequence, start to finish: chunked prefill, then one decode row per step.
//!
//! `dflash run` and the parity tests use this loop directly; the server's batched engine schedules the same
//! steps for many sequences.

use std::time::{Duration, Instant};

use dflash_models::{ForwardBatch, KvCache, LlamaModel, SeqRows};
use dflash_runtime::Tensor;

use crate::pages::PageAllocator;
use crate::request::FinishReason;
use crate::sampler::{self, SamplingParams, TokenHistory};
use crate::EngineError;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Token ids that end generation (the model's EOS ids).
    pub stop_ids: Vec<u32>,
    /// Rows per prefill forward.
    pub prefill_chunk: usize,
}

/// Timings of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// From the start of prefill to the first generated token.
    pub ttft: Duration,
    pub prefill_time: Duration,
    /// Time spent on decode steps (after the first token).
    pub decode_time: Duration,
    /// Decode steps run (tokens after the first one).
    pub decode_steps: usize,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    pub fn decode_tok_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Runs single sequences on a model with a cache of its own.
pub struct Generator<'m> {
    model: &'m LlamaModel,
    /// The current prompt's length: rows past it are attended one at a time, as the engine does.
    prompt_len: usize,
    kv: KvCache,
    pages: PageAllocator,
}

impl<'m> Generator<'m> {
    /// A generator whose cache holds `ctx_tokens` tokens in pages of `page_size`.
    ///
    /// # Errors
    /// When the cache cannot be allocated.
    pub fn new(model: &'m LlamaModel, ctx_tokens: usize, page_size: usize) -> Result<Self, EngineError> {
        let num_pages = ctx_tokens.div_ceil(page_size).max(1);
        let kv = model.new_kv_cache(num_pages, page_size)?;
        Ok(Generator { model, prompt_len: 0, kv, pages: PageAllocator::new(num_pages) })
    }

    /// Tokens the cache can hold.
    pub fn capacity(&self) -> usize {
        self.kv.num_pages * self.kv.page_size
    }

    /// Generates from `prompt`, calling `on_token` with each new token; `on_token` returning false stops.
    ///
    /// # Errors
    /// An empty prompt, a prompt plus `max_new_tokens` beyond the cache, model errors.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, FinishReason, GenerationStats), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let total = prompt.len() + opts.max_new_tokens;
        if total > self.capacity() {
            return Err(EngineError::ContextOverflow {
                prompt: prompt.len(),
                max_new: opts.max_new_tokens,
                ctx: self.capacity(),
            });
        }
        let mut table = Vec::new();
        self.prompt_len = prompt.len();
        let result = self.run(prompt, opts, &mut table, &mut on_token);
        self.pages.release(&mut table);
        result
    }

    fn run(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        table: &mut Vec<u32>,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, FinishReason, GenerationStats), EngineError> {
        let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
        let start = Instant::now();
        let mut logits = self.prefill(prompt, opts.prefill_chunk.max(1), table)?;
        stats.prefill_time = start.elapsed();
        let mut history = TokenHistory::new(prompt);
        let mut out = Vec::new();
        let mut len = prompt.len();
        let mut first_at = None;
        let finish = loop {
            let row = logits.as_f32().map_err(dflash_models::ModelError::from)?;
            let next = sampler::sample(row, &opts.sampling, &history, len as u64);
            if first_at.is_none() {
                stats.ttft = start.elapsed();
                first_at = Some(Instant::now());
            }
            if !opts.ignore_eos && opts.stop_ids.contains(&next) {
                break FinishReason::Stop;
            }
            out.push(next);
            history.push(next);
            if !on_token(next) {
                break FinishReason::Stop;
            }
            if out.len() >= opts.max_new_tokens {
                break FinishReason::Length;
            }
            logits = self.step(&[next], len, table)?;
            len += 1;
            stats.decode_steps += 1;
        };
        stats.decode_time = first_at.map(|t| t.elapsed()).unwrap_or_default();
        stats.generated_tokens = out.len();
        Ok((out, finish, stats))
    }

    /// Prefills `prompt` in chunks; returns the last row's logits.
    fn prefill(&mut self, prompt: &[u32], chunk: usize, table: &mut Vec<u32>) -> Result<Tensor, EngineError> {
        let mut logits = None;
        for (i, part) in prompt.chunks(chunk).enumerate() {
            logits = Some(self.step(part, i * chunk, table)?);
        }
        logits.ok_or(EngineError::EmptyPrompt)
    }

    /// Runs `tokens` at positions `context_len..` and returns the last row's logits `[1, vocab]`.
    fn step(&mut self, tokens: &[u32], context_len: usize, table: &mut Vec<u32>) -> Result<Tensor, EngineError> {
        let out = self.forward_rows(tokens, context_len, table, &[tokens.len() as u32 - 1])?;
        Ok(out)
    }

    /// Teacher-forced logits for every position of `tokens`, from an empty cache: `[T, vocab]`.
    ///
    /// # Errors
    /// Context overflow or model errors.
    pub fn score(&mut self, tokens: &[u32]) -> Result<Tensor, EngineError> {
        if tokens.len() > self.capacity() {
            return Err(EngineError::ContextOverflow { prompt: tokens.len(), max_new: 0, ctx: self.capacity() });
        }
        let mut table = Vec::new();
        self.prompt_len = tokens.len();
        let rows: Vec<u32> = (0..tokens.len() as u32).collect();
        let r = self.forward_rows(tokens, 0, &mut table, &rows);
        self.pages.release(&mut table);
        r
    }

    fn forward_rows(
        &mut self,
        tokens: &[u32],
        context_len: usize,
        table: &mut Vec<u32>,
        logit_rows: &[u32],
    ) -> Result<Tensor, EngineError> {
        let page_size = self.kv.page_size;
        if !self.pages.reserve(table, context_len + tokens.len(), page_size) {
            return Err(EngineError::OutOfPages);
        }
        let positions: Vec<u32> = (context_len..context_len + tokens.len()).map(|p| p as u32).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| table[p as usize / page_size] * page_size as u32 + p % page_size as u32)
            .collect();
        let seqs = [SeqRows { num_rows: tokens.len(), context_len, block_table: table, prompt_len: self.prompt_len }];
        let batch = ForwardBatch { tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows };
        Ok(self.model.forward(&batch, &mut self.kv)?.logits)
    }
}
