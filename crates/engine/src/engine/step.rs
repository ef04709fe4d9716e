//! The inside of a step: the flat batch from the plan, then sampling and verification of its logits.

use std::ops::Range;
use std::time::Instant;

use rayon::prelude::*;

use dflash_models::tokenizer::Tokenizer;
use dflash_models::{DeviceCaptured, ForwardBatch, ForwardOut, Readout, RowMask, RowMasks, SeqRows};

use super::draws::drawn_logprob;
use super::Engine;
use crate::grammar::GrammarState;
use crate::request::{FinishReason, TokenLogprob};
use crate::sampler;
use crate::scheduler::StepItem;
use crate::sequence::Outcome;
use crate::spec::verify::{accept_prefix, typical_accepts};
use crate::spec::{DflashProposer, LaneKind};
use crate::EngineError;
use dflash_models::{ResumeState, StepSeq};
use dflash_runtime::ops::sample::Drawn;

/// The flat inputs of one step, built from the plan.
#[derive(Default)]
struct StepInputs {
    tokens: Vec<u32>,    // [T]
    positions: Vec<u32>, // [T]
    slots: Vec<u32>,     // [T]
    logit_rows: Vec<u32>,
}

impl Engine {
    /// Builds the flat batch for `items` and runs it; returns the logits of the rows that sample or verify, in
    /// item order (`[L, vocab]`), and the hidden states captured for every row (`[T, taps · hidden]`) when the
    /// target captures any.
    pub(super) fn forward(
        &mut self,
        items: &[StepItem],
        now: Instant,
        masks: Option<&RowMasks>,
    ) -> Result<ForwardOut, EngineError> {
        self.restore_states(items)?;
        // Rows that need more than their argmax are drawn by the target where it can (see `draws`).
        let readout = self.readout(items, false);
        let draws = (masks.is_none() && readout == Readout::Logits && self.draws_on_device(items))
            .then(|| self.step_draws(items));
        // Pending tokens stream on a pool thread while the device runs this step (see `overlap`).
        let mut outs = self.take_pending_outs();
        let page_size = self.page_size;
        let mut inputs = StepInputs::default();
        for item in items {
            let seq = &mut self.sched.running[item.seq];
            seq.times.first_scheduled.get_or_insert(now);
            let start = seq.computed();
            let first_row = inputs.tokens.len() as u32;
            inputs.tokens.extend(seq.step_tokens(item.rows));
            for pos in start..start + item.rows {
                let page = seq.block_table[pos / page_size];
                // Cached pages are shared and immutable; writes only land past what a sequence has computed,
                // and only computed full pages are ever cached.
                debug_assert!(!self.sched.pages.is_cached(page), "{}: write to cached page {page}", seq.request.id);
                inputs.positions.push(pos as u32);
                inputs.slots.push(page * page_size as u32 + (pos % page_size) as u32);
            }
            let last_row = inputs.tokens.len() as u32 - 1;
            if item.drafts > 0 {
                inputs.logit_rows.extend(first_row..=last_row);
            } else if item.samples {
                inputs.logit_rows.push(last_row);
            }
        }
        let running = &self.sched.running;
        let seqs: Vec<SeqRows> = items
            .iter()
            .map(|item| {
                let seq = &running[item.seq];
                SeqRows {
                    num_rows: item.rows,
                    context_len: seq.computed(),
                    block_table: &seq.block_table,
                    prompt_len: seq.prompt_len(),
                }
            })
            .collect();
        let batch = ForwardBatch {
            tokens: &inputs.tokens,
            positions: &inputs.positions,
            seqs: &seqs,
            slots: &inputs.slots,
            logit_rows: &inputs.logit_rows,
        };
        let keyed: Vec<StepSeq> = items
            .iter()
            .map(|item| StepSeq {
                key: running[item.seq].key,
                verifies: item.drafts > 0,
                host_capture: self.needs_host_capture(item),
            })
            .collect();
        let target = &mut self.target;
        let run = move || match (masks, draws) {
            (Some(masks), _) => target.forward_step_masked(&batch, &keyed, masks),
            (None, Some(draws)) => target.forward_step_drawn(&batch, &keyed, &draws),
            (None, None) => target.forward_step(&batch, &keyed, readout),
        };
        let out = if outs.is_empty() {
            run()
        } else {
            let tok = &self.tokenizer;
            let outs = &mut outs;
            rayon::in_place_scope(|scope| {
                scope.spawn(move |_| outs.iter_mut().for_each(|(_, _, out)| out.stream_pending(tok)));
                run()
            })
        };
        self.put_outs_back(outs);
        Ok(out?)
    }

    /// Rows of `items` (before their forward) that fill a prompt: a step with any runs eagerly on a CUDA target.
    pub(super) fn prompt_rows(&self, items: &[StepItem]) -> usize {
        let in_prompt = |i: &&StepItem| {
            let seq = &self.sched.running[i.seq];
            seq.computed() < seq.prompt_len()
        };
        items.iter().filter(in_prompt).map(|i| i.rows).sum()
    }

    /// Runs the forward of `items` while another thread computes the grammar masks of their sampled rows, so
    /// constrained requests add no mask time to the step's critical path. When every constrained row is greedy
    /// (and the step would read back only ids without them), the masks go to the target, which applies them where
    /// the logits are ([`Target::forward_step_masked`]); otherwise the logits come back and rows are masked here.
    ///
    /// # Errors
    /// The forward's.
    pub(super) fn forward_masked(&mut self, items: &[StepItem], now: Instant) -> Result<ForwardOut, EngineError> {
        let mut jobs: Vec<MaskJob> = Vec::new();
        let mut logit_row = 0;
        for item in items {
            let seq = &mut self.sched.running[item.seq];
            if let Some(grammar) = seq.grammar.take_if(|_| item.samples) {
                let (committed, drafts) = (seq.len(), seq.drafts.clone());
                jobs.push(MaskJob { seq: item.seq, first_logit_row: logit_row, committed, drafts, grammar });
            }
            logit_row += if item.drafts > 0 { 1 + item.drafts } else { usize::from(item.samples) };
        }
        if jobs.is_empty() {
            return self.forward(items, now, None);
        }
        let on_device = self.readout(items, true) == Readout::Argmax;
        let row_masks = RowMasks::default();
        // The masks go to the thread pool (no thread is started per step); this thread runs the forward, which
        // waits for them only where it applies them. The scope ends once both are done.
        let jobs_ref = &mut jobs;
        let masks_ref = &row_masks;
        let out = rayon::in_place_scope(|scope| {
            scope.spawn(move |_| {
                let publish = PublishOnDrop { masks: masks_ref, rows: Vec::new() };
                compute_masks_guarded(jobs_ref, on_device.then_some(publish));
            });
            self.forward(items, now, on_device.then_some(&row_masks))
        });
        for job in jobs {
            self.sched.running[job.seq].grammar = Some(job.grammar);
        }
        out
    }

    /// What the step reads back of its logit rows: only their argmax when that is every sampling row's whole
    /// choice (greedy requests without penalties or logprobs, and without a grammar unless `masks_on_device`: the
    /// target then applies the masks itself), so a device target copies back `L` ids instead of `L · vocab`
    /// logits; else the logits.
    fn readout(&self, items: &[StepItem], masks_on_device: bool) -> Readout {
        let running = &self.sched.running;
        let argmax_only = items.iter().filter(|item| item.samples).all(|item| {
            let seq = &running[item.seq];
            let request = &seq.request;
            let grammar_ok = masks_on_device || request.grammar.is_none();
            request.sampling.picks_argmax() && request.logprobs.is_none() && grammar_ok
        });
        if argmax_only {
            Readout::Argmax
        } else {
            Readout::Logits
        }
    }

    /// After the forward of `items` failed with `error`: on a target whose sequences live wholly in its KV pages, a
    /// step of several sequences runs each alone, which gives every row the bits it had in the batch (rows land in
    /// the same slots; sampling is keyed), so only a sequence that fails alone fails. On targets with per-sequence
    /// state beside the pages (a failed forward may have advanced it) every item fails, as does a lone item.
    ///
    /// # Errors
    /// `error`, when the step's sequences were failed with it.
    pub(super) fn recover_failed_step(&mut self, items: &[StepItem], error: EngineError) -> Result<(), EngineError> {
        if items.len() < 2 || self.target.resume_state() != ResumeState::Pages {
            self.fail_items(items, &error.to_string());
            self.publish_gauges();
            return Err(error);
        }
        tracing::warn!("a step of {} sequences failed ({error}); running each alone", items.len());
        self.metrics.record_step_retry();
        let mut finished = Vec::new();
        for item in items {
            let one = std::slice::from_ref(item);
            match self.forward(one, Instant::now(), None) {
                Ok(out) => finished.extend(self.sample_and_stream(one, &out)),
                Err(e) => finished.push((item.seq, self.fail_seq(item.seq, &e.to_string()))),
            }
        }
        self.sched.publish_prompt_pages();
        self.retire(finished);
        self.publish_gauges();
        Ok(())
    }

    /// Installs the state checkpoint of every item's sequence that resumes from one (admitted on cached pages
    /// since its last forward), before its first rows run.
    fn restore_states(&mut self, items: &[StepItem]) -> Result<(), EngineError> {
        for item in items {
            let seq = &mut self.sched.running[item.seq];
            if let Some(snapshot) = seq.prefix.restore.take() {
                self.target.restore_state(seq.key, &snapshot)?;
            }
        }
        Ok(())
    }

    /// Snapshots the target's state of every item's sequence whose prompt forward just ended on one of its
    /// checkpoint positions, for the prefix cache (never after a verify).
    pub(super) fn keep_state_checkpoints(&mut self, items: &[StepItem]) {
        for item in items.iter().filter(|i| i.drafts == 0) {
            let Some(position) = self.sched.checkpoint_due(item.seq) else { continue };
            let key = self.sched.running[item.seq].key;
            if let Some(snapshot) = self.target.snapshot_state(key) {
                self.sched.keep_checkpoint(item.seq, position, snapshot);
            }
        }
    }

    /// Advances every item's sequence; samples plain rows and verifies drafted rounds; streams the tokens (those of
    /// sequences without stop strings beside the next forward on a device target: `overlap`). Returns the running
    /// indices that finished, with how.
    pub(super) fn sample_and_stream(&mut self, items: &[StepItem], out: &ForwardOut) -> Vec<(usize, Outcome)> {
        let finished = self.sample_and_commit(items, out);
        if !self.streams_beside_forward() {
            self.stream_pending_now();
        }
        finished
    }

    /// Fails `running[i]` with `message` (its tokens committed earlier in the step reach the client first).
    pub(super) fn fail_seq(&mut self, i: usize, message: &str) -> Outcome {
        let seq = &mut self.sched.running[i];
        tracing::error!("{} failed: {message}", seq.request.id);
        seq.fail(&self.tokenizer, message);
        Outcome::Failed
    }

    /// Samples, verifies and commits the step's rows ([`Engine::sample_and_stream`] without streaming the tokens
    /// that commits leave pending).
    fn sample_and_commit(&mut self, items: &[StepItem], out: &ForwardOut) -> Vec<(usize, Outcome)> {
        let vocab = out.logits.shape().last().copied().unwrap_or(0);
        let ids = out.ids.as_deref();
        let (logits, captured) = match (out.logits.as_f32(), out.captured.as_ref().map(|c| c.as_f32()).transpose()) {
            (Ok(l), Ok(c)) => (l, c),
            (Err(e), _) | (_, Err(e)) => {
                let message = format!("reading the forward's outputs: {e}");
                return items.iter().map(|i| (i.seq, self.fail_seq(i.seq, &message))).collect();
            }
        };
        let capture_width = out.captured.as_ref().map_or(0, |c| c.row_len());
        let on_device = out.device_captured.as_ref();
        let mut device_rows = Vec::new(); // (sequence, first position, rows of the step)
                                          // A drawn step's constrained rows are chosen on the host from their logits, not from its draws.
        if let Some(ids) = ids.filter(|_| out.drawn.is_none()) {
            self.advance_grammars(items, ids);
        }
        let now = Instant::now();
        let mut finished = Vec::new();
        let (mut row, mut batch_row) = (0, 0);
        for item in items {
            let start = self.sched.running[item.seq].computed();
            let kept = if !item.samples {
                self.sched.running[item.seq].advance(item.rows);
                item.rows
            } else {
                let span = row..row + 1 + item.drafts;
                row = span.end;
                let rows = match (ids, out.drawn.as_deref()) {
                    (_, Some(drawn)) if !self.needs_host_logits(item) => StepRows::Drawn(&drawn[span]),
                    (_, Some(_)) => match out.held_logits(span.clone()) {
                        Some(held) => StepRows::Logits(held, vocab),
                        None => {
                            let message = format!("the step did not return the logits of rows {span:?}");
                            finished.push((item.seq, self.fail_seq(item.seq, &message)));
                            batch_row += item.rows;
                            continue;
                        }
                    },
                    (Some(ids), None) => StepRows::Argmax(&ids[span]),
                    (None, None) => StepRows::Logits(&logits[span.start * vocab..span.end * vocab], vocab),
                };
                let (kept, finish) = if item.drafts == 0 {
                    self.sched.running[item.seq].advance(item.rows);
                    (item.rows, self.choose_commit(item.seq, rows, 0, now).1)
                } else {
                    self.verify(item.seq, rows, now)
                };
                if let Some(reason) = finish {
                    let outcome = match self.sched.running[item.seq].grammar_failure() {
                        Some(why) => self.fail_seq(item.seq, &why),
                        None => Outcome::Finished(reason),
                    };
                    finished.push((item.seq, outcome));
                }
                kept
            };
            let host = captured.map(|c| &c[batch_row * capture_width..(batch_row + kept) * capture_width]);
            if host.is_some() || on_device.is_some() {
                self.observe(item.seq, start, host, batch_row..batch_row + kept, &mut device_rows);
            }
            batch_row += item.rows;
        }
        if let Some(captured) = on_device {
            self.observe_on_device(&device_rows, captured);
        }
        finished
    }

    /// Moves the grammars of the plain constrained rows past their chosen tokens (`ids`, one per logit row) over the
    /// thread pool, ahead of the commits that stream them one sequence after another: llguidance's commit is the
    /// costly part of a constrained row once its mask is applied on the device. Verify rows commit in turn (which of
    /// their tokens are kept is known only then).
    fn advance_grammars(&mut self, items: &[StepItem], ids: &[u32]) {
        let running = &self.sched.running;
        let mut chosen = Vec::new();
        let mut row = 0;
        for item in items.iter().filter(|item| item.samples) {
            if item.drafts == 0 && running[item.seq].grammar.is_some() {
                chosen.extend(ids.get(row).map(|&token| (item.seq, token)));
            }
            row += 1 + item.drafts;
        }
        // Most steps have no constrained row, and a few are quicker here than handed to the pool.
        if chosen.len() <= SERIAL_MASK_JOBS {
            for (i, token) in chosen {
                if let Some(grammar) = self.sched.running[i].grammar.as_mut() {
                    grammar.advance_ahead(token);
                }
            }
            return;
        }
        let mut tokens = vec![None; running.len()];
        chosen.into_iter().for_each(|(i, token)| tokens[i] = Some(token));
        self.sched.running.par_iter_mut().zip(tokens).for_each(|(seq, token)| {
            if let (Some(grammar), Some(token)) = (seq.grammar.as_mut(), token) {
                grammar.advance_ahead(token);
            }
        });
    }

    /// Hands a sequence's lane the captured hidden states of its rows that stay in the cache (positions `start ..`,
    /// `rows` of the step's), if the lane reads them: on the host (`host`), or, for a lane that takes them where the
    /// target left them, queued in `device_rows` for [`Engine::observe_on_device`]. Prompt rows on the host are also
    /// kept to be cached with their pages.
    fn observe(
        &mut self,
        i: usize,
        start: usize,
        host: Option<&[f32]>,
        rows: Range<usize>,
        device_rows: &mut Vec<(usize, usize, Range<usize>)>,
    ) {
        if let Some(host) = host {
            self.sched.keep_capture(i, start, host);
        }
        let seq = &mut self.sched.running[i];
        let Some(lane) = seq.lane.as_mut().filter(|l| l.proposer.observes_target()) else { return };
        if lane.proposer.observes_on_device() && self.target.keeps_captured_on_device() {
            device_rows.push((i, start, rows));
            return;
        }
        let Some(host) = host else {
            seq.drop_lane("its target's hidden states stayed on the device");
            return;
        };
        let observed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lane.proposer.observe(start, host)));
        if observed.is_err() {
            seq.drop_lane("reading the target's hidden states");
        }
    }

    /// Appends the step's captured rows that stayed on the device to the contexts of the lanes that take them there
    /// (`device_rows` from [`Engine::observe`]), the lanes of one drafter in one append.
    fn observe_on_device(&mut self, device_rows: &[(usize, usize, Range<usize>)], captured: &DeviceCaptured) {
        if device_rows.is_empty() {
            return;
        }
        let mut wanted: Vec<Option<(usize, Range<usize>)>> = vec![None; self.sched.running.len()];
        for (i, start, rows) in device_rows {
            wanted[*i] = Some((*start, rows.clone()));
        }
        let mut lanes: Vec<(&mut DflashProposer, usize, Vec<u32>)> = self
            .sched
            .running
            .iter_mut()
            .zip(wanted)
            .filter_map(|(seq, want)| {
                let (start, rows) = want?;
                Some((seq.lane.as_mut()?.proposer.block_drafter()?, start, rows.map(|r| r as u32).collect()))
            })
            .collect();
        DflashProposer::observe_on_device(&mut lanes, captured);
    }

    /// Whether `item`'s captured rows must come back to the host: a target that keeps them on its device hands them
    /// to the lanes there, so they must only where the prefix cache keeps a prompt's rows or the sequence's lane reads
    /// them on the host.
    fn needs_host_capture(&self, item: &StepItem) -> bool {
        if !self.target.keeps_captured_on_device() {
            return true;
        }
        let seq = &self.sched.running[item.seq];
        let prompt_rows = seq.computed() < seq.prompt_len() && self.sched.keeps_captures(item.seq);
        let host_lane =
            seq.lane.as_ref().is_some_and(|l| l.proposer.observes_target() && !l.proposer.observes_on_device());
        prompt_rows || host_lane
    }

    /// Verifies `running[i]`'s drafts against its rows (`1 + drafts` of them): commits the target's token at each
    /// row while it equals the draft, then the correction or bonus; rolls the cache back to what was committed.
    /// Returns how many of the rows stay in the cache (the anchor and the accepted drafts) and whether the sequence
    /// finished.
    fn verify(&mut self, i: usize, rows: StepRows<'_>, now: Instant) -> (usize, Option<FinishReason>) {
        let drafts = std::mem::take(&mut self.sched.running[i].drafts);
        let typical = self.typical_rule(i);
        let mut finish = None;
        let accepted = accept_prefix(&drafts, |j| {
            let seq = &self.sched.running[i];
            let keep_draft = typical.zip(drafts.get(j)).zip(rows.logits(j)).filter(|&((d, &x), row)| {
                typical_accepts(&sampler::candidates(row, &seq.request.sampling, &seq.history), x, d)
            });
            let (token, f) = match keep_draft {
                Some(((_, &x), row)) => self.commit_token(i, row, x, now),
                None => self.choose_commit(i, rows, j, now),
            };
            finish = f;
            (token, f.is_some())
        });
        let page_size = self.page_size;
        let sched = &mut self.sched;
        let seq = &mut sched.running[i];
        // The anchor and the accepted drafts are valid K/V; rows past them were computed for rejected drafts and
        // are simply overwritten later (attention never reads past a sequence's length).
        seq.advance(1 + accepted);
        let len = seq.len();
        sched.pages.truncate(&mut seq.block_table, len, page_size);
        if let Some(lane) = seq.lane.as_mut() {
            lane.verified(drafts.len(), accepted);
        }
        let key = seq.key;
        self.target.verified(key, 1 + accepted);
        self.metrics.record_spec_round(drafts.len(), accepted);
        (1 + accepted, finish)
    }

    /// The lossy typical rule's `d` when it applies to `running[i]`'s round: a block drafter's (or MTP head's) own
    /// round, not its prompt lookup fallback's, the server's `--dflash-typical`, and a sampled request (greedy
    /// requests always verify exactly).
    pub(super) fn typical_rule(&self, i: usize) -> Option<f32> {
        let seq = &self.sched.running[i];
        if seq.lane.as_ref().is_some_and(|l| l.round_is_fallbacks()) {
            return None;
        }
        let block_lane = seq.lane.as_ref().is_some_and(|l| l.stats.block_size > 0);
        let mtp_lane = seq.lane.as_ref().is_some_and(|l| l.stats.lane == LaneKind::Mtp);
        let rule = if mtp_lane { self.mtp.as_ref().and_then(|m| m.typical) } else { self.spec.dflash_typical };
        // A grammar masks each row; the rule's candidates do not, so constrained rows always verify exactly.
        rule.filter(|_| (block_lane || mtp_lane) && !seq.request.sampling.is_greedy() && seq.grammar.is_none())
    }

    /// Chooses `running[i]`'s next token from row `j` of `rows` at its absolute position (the row's argmax, or a
    /// draw from its logits) and commits it.
    fn choose_commit(&mut self, i: usize, rows: StepRows<'_>, j: usize, now: Instant) -> (u32, Option<FinishReason>) {
        match rows {
            StepRows::Argmax(ids) => self.commit_token(i, &[], ids[j], now),
            StepRows::Drawn(drawn) => {
                let logprob = drawn[j].logprobs.as_ref().map(|lp| drawn_logprob(&self.tokenizer, drawn[j].id, lp));
                self.commit_with(i, drawn[j].id, logprob, now)
            }
            StepRows::Logits(..) => {
                let row = rows.logits(j).unwrap_or_default();
                let id = self.choose_token(i, row);
                self.commit_token(i, row, id, now)
            }
        }
    }

    /// `running[i]`'s token from `row` (`[vocab]` logits) at its absolute position, among the tokens its grammar
    /// allows when it has one (a greedy constrained row takes the allowed argmax without copying the row).
    fn choose_token(&mut self, i: usize, row: &[f32]) -> u32 {
        let seq = &mut self.sched.running[i];
        let committed = seq.len();
        let Some(grammar) = seq.grammar.as_mut() else {
            return sampler::sample(row, &seq.request.sampling, &seq.history, committed as u64);
        };
        let mask = grammar.mask(committed);
        if seq.request.sampling.picks_argmax() {
            if let Some(id) = mask.argmax(row) {
                return id;
            }
        }
        let mut masked = row.to_vec();
        mask.apply(&mut masked);
        sampler::sample(&masked, &seq.request.sampling, &seq.history, committed as u64)
    }

    /// Commits `id` as `running[i]`'s next token (`row_logits`: the row it was chosen from, for logprobs; empty
    /// when only the argmax came back, which happens only for requests without logprobs).
    fn commit_token(&mut self, i: usize, row_logits: &[f32], id: u32, now: Instant) -> (u32, Option<FinishReason>) {
        let wanted = self.sched.running[i].request.logprobs;
        let logprob = wanted.map(|n| token_logprob(&self.tokenizer, row_logits, id, n));
        self.commit_with(i, id, logprob, now)
    }

    /// Commits `id` as `running[i]`'s next token with its logprob entry (when the request asked for logprobs).
    fn commit_with(
        &mut self,
        i: usize,
        id: u32,
        logprob: Option<TokenLogprob>,
        now: Instant,
    ) -> (u32, Option<FinishReason>) {
        let seq = &mut self.sched.running[i];
        let ttft = seq.times.first_token.is_none().then(|| now.duration_since(seq.times.arrived).as_secs_f64());
        let itl = seq.times.last_token.map(|t| now.duration_since(t).as_secs_f64());
        let emitting = Instant::now();
        let finish = seq.commit(&self.tokenizer, &self.eos_ids, id, logprob, now);
        self.emit_time += emitting.elapsed();
        self.metrics.record_token(ttft, itl);
        (id, finish)
    }
}

/// Up to this many constrained sequences compute their masks on one thread.
const SERIAL_MASK_JOBS: usize = 4;

/// A constrained sequence's grammar, taken out for the step so another thread can compute its masks.
struct MaskJob {
    seq: usize,
    /// Its first row among the step's logit rows.
    first_logit_row: usize,
    committed: usize,
    /// The drafts its step verifies.
    drafts: Vec<u32>,
    grammar: GrammarState,
}

/// Publishes the masks it gathered when dropped, so a target waiting for them is released even if computing
/// them panicked (rows then go unmasked, and the grammar refuses their tokens: the request fails, not the step).
struct PublishOnDrop<'a> {
    masks: &'a RowMasks,
    rows: Vec<RowMask>,
}

impl Drop for PublishOnDrop<'_> {
    fn drop(&mut self) {
        self.masks.publish(std::mem::take(&mut self.rows));
    }
}

/// [`compute_masks`], with a panic kept here: the rows go unmasked, their grammars refuse the tokens and only their
/// requests fail.
fn compute_masks_guarded(jobs: &mut [MaskJob], publish: Option<PublishOnDrop<'_>>) {
    let computed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compute_masks(jobs, publish)));
    if computed.is_err() {
        tracing::error!("computing grammar masks panicked");
    }
}

/// Computes every job's masks ahead over the thread pool (each row along its sequence's drafts); with `publish`,
/// hands them to the target as logit-row masks.
fn compute_masks(jobs: &mut [MaskJob], publish: Option<PublishOnDrop<'_>>) {
    let compute = |job: &mut MaskJob| job.grammar.compute_ahead(job.committed, &job.drafts);
    // A row's mask takes microseconds: a few are quicker here than handed to the pool.
    if jobs.len() <= SERIAL_MASK_JOBS {
        jobs.iter_mut().for_each(compute);
    } else {
        jobs.par_iter_mut().for_each(compute);
    }
    if let Some(mut publish) = publish {
        for job in jobs.iter() {
            let rows = job.grammar.ahead_words().enumerate();
            publish
                .rows
                .extend(rows.map(|(j, words)| RowMask { logit_row: job.first_logit_row + j, allowed: words.to_vec() }));
        }
    }
}

/// One sampling item's rows as the step read them back.
#[derive(Clone, Copy)]
enum StepRows<'a> {
    /// The rows' logits, `[rows, vocab]`, and `vocab`.
    Logits(&'a [f32], usize),
    /// Each row's argmax ([`Readout::Argmax`]): the token itself, for requests that pick it.
    Argmax(&'a [u32]),
    /// Each row's draw by the target ([`dflash_models::Target::forward_step_drawn`]): the token and its logprobs.
    Drawn(&'a [Drawn]),
}

impl<'a> StepRows<'a> {
    /// Row `j`'s logits, when the logits came back.
    fn logits(self, j: usize) -> Option<&'a [f32]> {
        match self {
            StepRows::Logits(rows, vocab) => rows.get(j * vocab..(j + 1) * vocab),
            StepRows::Argmax(_) | StepRows::Drawn(_) => None,
        }
    }
}

/// The chosen token's logprob and the `n` most likely tokens, from the raw logits.
fn token_logprob(tok: &Tokenizer, logits: &[f32], id: u32, n: usize) -> TokenLogprob {
    let (log_probs, top) = sampler::logprobs_top(logits, n);
    let logprob = log_probs.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
    drawn_logprob(tok, id, &(logprob, top))
}
