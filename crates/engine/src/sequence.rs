//! One request's life in the engine: its committed tokens, how many of them the KV cache holds, its pages, and its
//! output stream (detokenizer, stop strings, timings).

use std::sync::Arc;
use std::time::Instant;

use dflash_models::tokenizer::Tokenizer;

use crate::grammar::GrammarState;
use crate::request::{Event, EventSink, FinishReason, Request, TokenLogprob, Usage};
use crate::sampler::TokenHistory;
use crate::spec::{DflashProposer, DraftTime, Proposal, ProposeInput, RoundStart, SpecLane};

mod text_out;
pub use text_out::TextOut;

/// How a sequence ended, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Finished(FinishReason),
    Cancelled,
    Failed,
}

/// A request being served.
///
/// `tokens` holds the prompt then every committed generated token; the cache holds the K/V of the first `computed`
/// of them. A sequence's work in a step is always "the next rows of `tokens`": a prefill chunk while more than one
/// token is uncomputed, one decode row once only the last sampled token is. After a preemption `computed` drops to
/// zero and the same rule recomputes prompt and output alike.
pub struct Sequence {
    /// A key unique among the engine's sequences, for the lifetime of the sequence (targets with per-sequence
    /// state keep it under this key). Assigned when the engine takes the request.
    pub key: u64,
    pub request: Request,
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    /// KV pages, in order.
    pub block_table: Vec<u32>,
    pub history: TokenHistory,
    /// Its detokenizer, stop strings, pending tokens and event sink.
    out: TextOut,
    pub times: Timings,
    /// The speculation lane, when armed.
    pub lane: Option<SpecLane>,
    /// Drafts to verify in this step, after the last committed token.
    pub drafts: Vec<u32>,
    /// Its place in the prefix cache.
    pub prefix: PrefixProgress,
    /// Its place in the request's grammar, when the output is constrained.
    pub grammar: Option<GrammarState>,
}

/// A sequence's place in the prefix cache.
#[derive(Clone, Debug, Default)]
pub struct PrefixProgress {
    /// Chain hashes of the prompt's full pages; computed on the first admission that uses the cache.
    pub hashes: Vec<u64>,
    /// Leading pages of the block table the cache is done with: shared from it at admission, or offered to it
    /// once computed.
    pub settled_pages: usize,
    /// Prompt tokens found in the cache at admission (the latest admission before the first token).
    pub cached_tokens: usize,
    /// The target's captured hidden states of computed prompt positions whose pages are not settled yet, to be
    /// cached with them.
    pub captured: PendingCapture,
    /// Prompt positions after which the target's recurrent state is snapshotted for the cache (ascending; empty
    /// unless the target needs state checkpoints). Planned with the page hashes.
    pub checkpoints: Vec<usize>,
    /// State snapshots taken at those positions, by position, waiting for the page that ends there to settle.
    pub snapshots: Vec<(usize, Arc<[f32]>)>,
    /// The state checkpoint the sequence resumes from, for the target to install before its next forward.
    pub restore: Option<Arc<[f32]>>,
    /// Set when a prompt chunk had to stop off the prompt-cut alignment: the rows from this position on differ in
    /// their last bits from a whole prefill, so no page or state past it is cached.
    pub inexact_from: Option<usize>,
}

impl PrefixProgress {
    /// Whether the state after position `p` should be snapshotted: one of the planned positions, computed as
    /// prompt rows, exactly.
    pub fn wants_checkpoint_at(&self, p: usize) -> bool {
        self.inexact_from.is_none_or(|x| p <= x) && self.checkpoints.binary_search(&p).is_ok()
    }

    /// Takes out the snapshot taken at position `end` (the end of the page being settled), dropping any taken
    /// before it.
    pub fn take_snapshot(&mut self, end: usize) -> Option<Arc<[f32]>> {
        self.snapshots.retain(|(p, _)| *p >= end);
        let at = self.snapshots.iter().position(|(p, _)| *p == end)?;
        Some(self.snapshots.remove(at).1)
    }
}

/// Captured rows (`[rows, width]`) of consecutive positions from `first`, waiting for their page to fill.
#[derive(Clone, Debug, Default)]
pub struct PendingCapture {
    first: usize,
    rows: Vec<f32>,
}

impl PendingCapture {
    /// Keeps the rows of positions `first_position ..` (`[n, width]`) that lie below `end` (the prompt length).
    /// Rows that do not continue the held ones replace them.
    pub fn push(&mut self, first_position: usize, rows: &[f32], width: usize, end: usize) {
        if width == 0 {
            return;
        }
        debug_assert!(rows.len().is_multiple_of(width), "captured rows of {width} floats");
        if first_position != self.first + self.rows.len() / width {
            self.rows.clear();
        }
        if self.rows.is_empty() {
            self.first = first_position;
        }
        let keep = end.saturating_sub(first_position).min(rows.len() / width);
        self.rows.extend_from_slice(&rows[..keep * width]);
    }

    /// Takes out the rows of positions `start .. start + n` (dropping any held before them); `None` when some of
    /// them are not held.
    pub fn take(&mut self, start: usize, n: usize, width: usize) -> Option<Box<[f32]>> {
        if width == 0 || start < self.first {
            return None;
        }
        let skip = ((start - self.first) * width).min(self.rows.len());
        self.rows.drain(..skip);
        self.first = start;
        if self.rows.len() < n * width {
            return None;
        }
        let page: Box<[f32]> = self.rows.drain(..n * width).collect();
        self.first += n;
        Some(page)
    }

    pub fn clear(&mut self) {
        self.rows.clear();
    }
}

/// When things happened to a sequence.
#[derive(Clone, Copy, Debug)]
pub struct Timings {
    pub arrived: Instant,
    pub first_scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
}

impl Sequence {
    pub fn new(request: Request, sink: Box<dyn EventSink>) -> Self {
        let tokens = request.prompt.clone();
        let history = TokenHistory::new(&tokens);
        let out = TextOut::new(sink, &request.stop);
        let times = Timings { arrived: Instant::now(), first_scheduled: None, first_token: None, last_token: None };
        let request_grammar = request.grammar.as_ref().map(|g| g.start());
        Sequence {
            key: 0,
            prompt_len: tokens.len(),
            tokens,
            request,
            computed: 0,
            block_table: Vec::new(),
            history,
            out,
            times,
            lane: None,
            drafts: Vec::new(),
            prefix: PrefixProgress::default(),
            grammar: request_grammar,
        }
    }

    /// Committed tokens (prompt and generated).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose K/V the cache holds.
    pub fn computed(&self) -> usize {
        self.computed
    }

    /// Committed tokens not yet in the cache: 1 when the sequence is decoding, more while it (re)fills.
    pub fn uncomputed(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// The next `n` rows' tokens: uncomputed committed tokens, then this step's drafts.
    pub fn step_tokens(&self, n: usize) -> Vec<u32> {
        let committed = &self.tokens[self.computed..(self.computed + n).min(self.tokens.len())];
        let drafts = n - committed.len();
        committed.iter().chain(&self.drafts[..drafts]).copied().collect()
    }

    /// Asks the armed lane, if any, for this step's drafts (none unless the sequence is decoding). Drafts never
    /// run past `max_tokens`: a round commits at most drafts + 1 tokens. A lane whose block drafter drafts in the
    /// step's shared pass only plans its round here: `Some(max)` says it will propose at most `max` drafts, and
    /// [`Self::finish_shared_drafts`] ends the round with the pass's proposal.
    pub fn prepare_drafts(&mut self) -> Option<usize> {
        self.drafts.clear();
        // Not while the row left is the prompt's last token (a chunk cut one short of it, or a cached prefix): drafts
        // would make a prompt row a verify row, which a recurrent target cannot roll back.
        if !self.is_decoding() || self.computed < self.prompt_len {
            return None;
        }
        let cap = self.draft_cap();
        let lane = self.lane.as_mut()?;
        let input = ProposeInput { tokens: &self.tokens, sampling: &self.request.sampling };
        let shared = lane.proposer.block_drafter().is_some();
        // A proposer that panics (a drafter bug) must not take the engine thread, and with it every request,
        // down: the lane is dropped and the request decodes plain, with the tokens it would have had anyway.
        let planned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match shared {
            true => match lane.start_round(&input, cap) {
                RoundStart::Drafter(max) => (Some(max), Vec::new()),
                RoundStart::Drafts(drafts) => (None, drafts),
            },
            false => (None, lane.draft(&input, cap)),
        }));
        match planned {
            Ok((Some(max), _)) => return Some(max),
            Ok((None, drafts)) => self.drafts = drafts,
            Err(_) => self.drop_lane("drafting"),
        }
        self.cut_drafts_by_grammar();
        None
    }

    /// The lane's block drafter and its round's input, for the step's shared drafter pass.
    pub fn shared_pass_member(&mut self) -> Option<(&mut DflashProposer, ProposeInput<'_>)> {
        let drafter = self.lane.as_mut()?.proposer.block_drafter()?;
        Some((drafter, ProposeInput { tokens: &self.tokens, sampling: &self.request.sampling }))
    }

    /// The lane's block drafter, when it reads the target's pages, with the cache slots of the computed positions
    /// its context lacks (`page · page_size + offset` for positions `from ..` computed, `from` the context's
    /// length), for [`DflashProposer::observe_on_device`]; `None` when it lacks none.
    pub fn rows_to_catch_up(&mut self, page_size: usize) -> Option<(&mut DflashProposer, usize, Vec<u32>)> {
        let (table, computed) = (&self.block_table, self.computed);
        let drafter = self.lane.as_mut()?.proposer.block_drafter().filter(|d| d.reads_pages())?;
        let from = drafter.context_len();
        let slot = |p: usize| table.get(p / page_size).map(|&page| page * page_size as u32 + (p % page_size) as u32);
        let slots: Option<Vec<u32>> = (from..computed).map(slot).collect();
        Some((drafter, from, slots.filter(|s| !s.is_empty())?))
    }

    /// Makes the round plain after its drafts were chosen: the step's drafts gate held every draft of the step back.
    pub fn withdraw_drafts(&mut self) {
        self.drafts.clear();
        if let Some(lane) = self.lane.as_mut() {
            lane.withdraw_round();
        }
    }

    /// Ends a round [`Self::prepare_drafts`] planned for the shared pass without drafting it: the step's gate kept
    /// the pass from running, and the round is plain.
    pub fn skip_shared_round(&mut self) {
        self.drafts.clear();
        let cap = self.draft_cap();
        let Some(lane) = self.lane.as_mut() else { return };
        lane.skip_planned_round();
        // The lane's fallback (prompt lookup) may still draft the round: it needs no pass.
        let input = ProposeInput { tokens: &self.tokens, sampling: &self.request.sampling };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lane.fallback_drafts(&input, cap))) {
            Ok(drafts) => self.drafts = drafts,
            Err(_) => self.drop_lane("drafting"),
        }
        self.cut_drafts_by_grammar();
    }

    /// The most drafts a round may verify: a round commits at most drafts + 1 tokens, never past `max_tokens`.
    fn draft_cap(&self) -> usize {
        self.request.max_tokens.saturating_sub(self.generated() + 1)
    }

    /// Ends a round [`Self::prepare_drafts`] planned with the shared pass's proposal for it (`time`: this lane's
    /// share of the pass).
    pub fn finish_shared_drafts(&mut self, max: usize, drafted: Proposal, time: DraftTime) {
        let Some(lane) = self.lane.as_mut() else { return };
        let input = ProposeInput { tokens: &self.tokens, sampling: &self.request.sampling };
        let finished =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lane.shared_proposal(&input, max, drafted, time)));
        match finished {
            Ok(drafts) => self.drafts = drafts,
            Err(_) => self.drop_lane("drafting"),
        }
        self.cut_drafts_by_grammar();
    }

    /// Cuts the drafts at the first token the sequence's grammar forbids. Where it forbids the first, the round is
    /// one that accepted none of its drafts (the target samples under the same grammar, so it could not have taken
    /// it), and the lane is told so: a round with nothing to verify is otherwise never judged, and the lane would
    /// pay a drafting call every step for drafts the grammar keeps refusing.
    fn cut_drafts_by_grammar(&mut self) {
        let Some(grammar) = self.grammar.as_mut().filter(|_| !self.drafts.is_empty()) else { return };
        let valid = grammar.valid_drafts(&self.drafts);
        if valid == 0 {
            if let Some(lane) = self.lane.as_mut() {
                lane.refused_by_grammar(self.drafts.len());
            }
        }
        self.drafts.truncate(valid);
    }

    /// Moves the grammar past committed token `id`; true when the grammar is complete, or broke (see
    /// [`Self::grammar_failure`]), either of which ends the output.
    fn advance_grammar(&mut self, id: u32) -> bool {
        let Some(grammar) = self.grammar.as_mut() else { return false };
        match grammar.commit(id) {
            Ok(()) => grammar.is_finished(),
            Err(e) => {
                tracing::warn!("{}: committing token {id}: {e}", self.request.id);
                true
            }
        }
    }

    /// Why the sequence's grammar broke mid-output (a lexer limit of a pathological grammar, say): the request then
    /// fails rather than ending as if its output were complete.
    pub fn grammar_failure(&self) -> Option<String> {
        self.grammar.as_ref().and_then(|g| g.failure()).map(str::to_string)
    }

    /// Drops a lane whose proposer panicked while `doing`; the sequence goes on without speculation.
    pub fn drop_lane(&mut self, doing: &str) {
        if let Some(lane) = self.lane.take() {
            tracing::error!(
                "{}: the {} lane panicked while {doing}; decoding on without it",
                self.request.id,
                lane.stats.lane
            );
        }
        self.drafts.clear();
    }

    /// Whether the sequence is decoding: everything but its last sampled token is in the cache.
    pub fn is_decoding(&self) -> bool {
        self.computed > 0 && self.uncomputed() == 1
    }

    /// The committed tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Marks `n` more tokens as written to the cache.
    pub fn advance(&mut self, n: usize) {
        self.computed = (self.computed + n).min(self.tokens.len());
    }

    /// Forgets the cache contents (the pages were taken back); the sequence will recompute them.
    pub fn reset_computed(&mut self) {
        self.computed = 0;
        self.prefix.settled_pages = 0;
        self.prefix.captured.clear();
        self.prefix.snapshots.clear();
        self.prefix.restore = None;
        self.prefix.inexact_from = None;
    }

    /// Starts the sequence on `pages` cached prefix pages of `page_size` tokens, already in its block table: their
    /// tokens count as computed. `captured` holds the target's hidden states of their positions
    /// (`[pages · page_size, taps · hidden]`) when the lane observes the target, which reads them now, so its
    /// context holds every position before the first row it is shown. Called at admission, before any row runs.
    pub fn resume_from_cache(&mut self, pages: usize, page_size: usize, captured: &[f32]) {
        debug_assert!(self.computed == 0 && self.block_table.len() == pages);
        let tokens = pages * page_size;
        debug_assert!(tokens < self.tokens.len(), "at least one token is left to compute");
        self.computed = tokens;
        self.prefix.settled_pages = pages;
        self.prefix.captured.clear();
        if self.times.first_token.is_none() {
            self.prefix.cached_tokens = tokens;
        }
        if let Some(lane) = self.lane.as_mut().filter(|l| l.proposer.observes_target() && tokens > 0) {
            // Positions already held (a readmission after a preemption) are skipped by the lane.
            lane.proposer.observe(0, captured);
        }
    }

    /// Whether the request lets the prefix cache serve and keep its prompt.
    pub fn uses_prefix_cache(&self) -> bool {
        self.request.cache_prompt
    }

    /// Whether the sequence's lane reads the target's hidden states: it may then start only from cached pages
    /// that carry them ([`crate::prefix_cache`]).
    pub fn observes_target(&self) -> bool {
        self.lane.as_ref().is_some_and(|l| l.proposer.observes_target())
    }

    /// True once the client has gone away (false while the output is out streaming: [`Sequence::take_out`]).
    pub fn is_abandoned(&self) -> bool {
        self.out.is_closed()
    }

    /// Appends a token without streaming it (scheduler tests).
    #[cfg(test)]
    pub(crate) fn push_for_test(&mut self, id: u32) {
        self.tokens.push(id);
    }

    /// Commits a sampled token and streams its text (for a sequence without stop strings, leaves it pending:
    /// [`Sequence::stream_pending`]). Returns how the sequence finished, if it did.
    ///
    /// An end-of-sequence token ends the sequence without being emitted or counted (unless `ignore_eos`); a stop
    /// string ends it with the text before the match; the budget ends it after the token.
    pub fn commit(
        &mut self,
        tok: &Tokenizer,
        eos_ids: &[u32],
        id: u32,
        logprob: Option<TokenLogprob>,
        now: Instant,
    ) -> Option<FinishReason> {
        self.times.first_token.get_or_insert(now);
        self.times.last_token = Some(now);
        let defer = self.out.defers();
        if !self.request.ignore_eos && eos_ids.contains(&id) {
            match defer {
                true => self.out.defer_end_of_sequence(),
                false => self.out.stream_end_of_sequence(tok),
            }
            return Some(FinishReason::Stop);
        }
        self.tokens.push(id);
        self.history.push(id);
        let grammar_done = self.advance_grammar(id);
        let finish = if grammar_done {
            Some(FinishReason::Stop)
        } else {
            (self.generated() >= self.request.max_tokens).then_some(FinishReason::Length)
        };
        if defer {
            self.out.defer(id, logprob, finish.is_some());
            return finish;
        }
        match self.out.stream(tok, id, logprob, finish.is_some()) {
            true => Some(FinishReason::Stop),
            false => finish,
        }
    }

    /// Whether committed tokens wait for [`Sequence::stream_pending`].
    pub fn has_pending(&self) -> bool {
        self.out.has_pending()
    }

    /// Detokenizes and streams the tokens [`Sequence::commit`] left pending.
    pub fn stream_pending(&mut self, tok: &Tokenizer) {
        self.out.stream_pending(tok);
    }

    /// Takes the sequence's output out (a stand-in that sends nothing takes its place) so its pending tokens can
    /// stream on another thread; [`Sequence::put_out_back`] returns it.
    pub fn take_out(&mut self) -> TextOut {
        std::mem::replace(&mut self.out, TextOut::detached())
    }

    /// Returns the output [`Sequence::take_out`] took.
    pub fn put_out_back(&mut self, out: TextOut) {
        self.out = out;
    }

    /// Sends the final event, after the pending tokens.
    pub fn finish(&mut self, tok: &Tokenizer, reason: FinishReason) {
        let usage = self.usage();
        self.out.send_last(tok, Event::Finished { reason, usage });
    }

    /// Sends an error as the final event, after the pending tokens.
    pub fn fail(&mut self, tok: &Tokenizer, message: &str) {
        self.out.send_last(tok, Event::Error(message.to_string()));
    }

    /// Ends the request because the engine stops (see [`Event::Stopped`]), after the pending tokens.
    pub fn stop(&mut self, tok: &Tokenizer, message: &str) {
        self.out.send_last(tok, Event::Stopped(message.to_string()));
    }

    pub fn usage(&self) -> Usage {
        let ms = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => b.saturating_duration_since(a).as_secs_f64() * 1e3,
            _ => 0.0,
        };
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated(),
            cached_tokens: self.prefix.cached_tokens,
            prefill_ms: ms(self.times.first_scheduled, self.times.first_token),
            decode_ms: ms(self.times.first_token, self.times.last_token),
            spec: self.lane.as_ref().map(|l| Box::new(l.stats)),
        }
    }
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("id", &self.request.id)
            .field("len", &self.tokens.len())
            .field("computed", &self.computed)
            .field("pages", &self.block_table.len())
            .finish()
    }
}

#[cfg(test)]
mod lane_tests {
    use super::*;
    use crate::spec::{CostTable, LaneKind, PolicyMode, Proposal, Proposer, SharedCosts, SpecLane};

    struct Panics;

    impl Proposer for Panics {
        fn kind(&self) -> LaneKind {
            LaneKind::Dflash
        }

        fn propose(&mut self, _input: &ProposeInput, _max: usize) -> Proposal {
            panic!("a drafter bug");
        }
    }

    struct Drafts;

    impl Proposer for Drafts {
        fn kind(&self) -> LaneKind {
            LaneKind::Pld
        }

        fn propose(&mut self, _input: &ProposeInput, max: usize) -> Proposal {
            vec![7; max.min(3)].into()
        }
    }

    /// A sequence of the 3-token prompt `[1, 2, 3]` drafting with `proposer` on a fixed policy.
    fn drafting_with(proposer: Box<dyn Proposer>) -> Sequence {
        let request = Request { cache_prompt: false, ..Request::for_test("r", vec![1, 2, 3], 8) };
        let mut seq = Sequence::new(request, Box::new(crate::request::NullSink));
        let costs = SharedCosts::new(CostTable::new(9));
        seq.lane = Some(SpecLane::new(proposer, 4, 4, PolicyMode::Fixed, costs));
        seq
    }

    #[test]
    fn a_panicking_proposer_loses_its_lane_not_the_request() {
        let mut seq = drafting_with(Box::new(Panics));
        seq.push_for_test(4);
        seq.advance(3);
        assert!(seq.is_decoding());
        seq.prepare_drafts();
        assert!(seq.lane.is_none() && seq.drafts.is_empty());
        seq.prepare_drafts();
        assert!(seq.drafts.is_empty(), "plain from then on");
    }

    /// Drafts a grammar always refuses (a drafter writing prose where a JSON schema holds): each round counts as
    /// one that accepted nothing, so the adaptive lane backs off instead of drafting, for nothing, every step.
    #[test]
    fn drafts_the_grammar_refuses_back_the_lane_off() {
        use crate::grammar::{GrammarCompiler, GrammarSpec};
        use crate::spec::StepTiming;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny-qwen3");
        let tok = dflash_models::tokenizer::Tokenizer::from_hf_dir(&dir).expect("tokenizer");
        let compiler = GrammarCompiler::new(&tok).expect("compiler");
        let grammar = compiler.compile(&GrammarSpec::Regex("yes".into())).expect("grammar");
        let refused = tok.encode("zzz", false).expect("encode")[0];
        let request = Request { cache_prompt: false, ..Request::for_test("r", vec![1, 2, 3], 200) };
        let mut seq = Sequence::new(request, Box::new(crate::request::NullSink));
        seq.grammar = Some(grammar.start());
        let mut table = CostTable::new(9);
        table.seed(&[10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0]);
        let costs = SharedCosts::new(table);
        let refusing = crate::spec::SlowProposer(vec![refused; 4], std::time::Duration::from_millis(2));
        seq.lane = Some(SpecLane::new(Box::new(refusing), 4, 0, PolicyMode::Adaptive, costs.clone()));
        seq.push_for_test(4);
        seq.advance(3);
        for step in 0..64 {
            costs.lock().begin_step(1);
            seq.prepare_drafts();
            assert!(seq.drafts.is_empty(), "step {step}: a refused draft went to verification");
            seq.lane.as_mut().expect("lane").stepped(1, Some(StepTiming::alone(1, 10.0)));
            seq.push_for_test(4);
            seq.advance(1);
        }
        let stats = &seq.lane.as_ref().expect("lane").stats;
        let calls = stats.draft_calls;
        assert!(calls <= 12, "{calls} drafting calls in 64 steps whose drafts the grammar refused");
        assert_eq!((stats.rounds, stats.plain_steps), (0, 64), "every step plain, none a verified round");
    }

    /// A prompt chunked one token short of its end leaves that token as the sequence's only row: it must not carry
    /// drafts (it is a prompt row, which a recurrent target's verify cannot hold); the row after it may.
    #[test]
    fn the_prompts_last_token_is_never_a_verify_row() {
        let mut seq = drafting_with(Box::new(Drafts));
        seq.advance(2);
        assert!(seq.is_decoding(), "one row left");
        assert_eq!((seq.prepare_drafts(), seq.drafts.len()), (None, 0), "the prompt's last token drafts nothing");
        seq.advance(1);
        seq.push_for_test(4);
        assert_eq!((seq.prepare_drafts(), seq.drafts.len()), (None, 3), "past the prompt the lane drafts");
    }
}

#[cfg(test)]
mod stream_tests {
    use super::*;
    use std::path::Path;
    use std::sync::{Arc, Mutex};

    /// Keeps every event, as the text an HTTP stream would show of it.
    struct Collect(Arc<Mutex<Vec<String>>>);

    impl EventSink for Collect {
        fn send(&mut self, event: Event) -> bool {
            self.0.lock().expect("events").push(format!("{event:?}"));
            true
        }
        fn is_closed(&self) -> bool {
            false
        }
    }

    fn tokenizer() -> Tokenizer {
        Tokenizer::from_hf_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny-qwen3"))
            .expect("tokenizer")
    }

    /// The events of a sequence committing `steps` (each step's tokens, then its pending streamed), ending at
    /// `max_tokens` or at an end-of-sequence id 0; `stop`: stop strings.
    fn events(tok: &Tokenizer, steps: &[Vec<u32>], max_tokens: usize, stop: Vec<String>) -> Vec<String> {
        let request = Request { ignore_eos: false, stop, ..Request::for_test("r", vec![1, 2, 3], max_tokens) };
        let events = Arc::new(Mutex::new(Vec::new()));
        let mut seq = Sequence::new(request, Box::new(Collect(events.clone())));
        'steps: for step in steps {
            for &id in step {
                let logprob = Some(TokenLogprob { token: format!("{id}"), logprob: -0.5, top: Vec::new() });
                let finished = seq.commit(tok, &[0], id, logprob, Instant::now()).is_some();
                if finished {
                    seq.stream_pending(tok);
                    break 'steps;
                }
            }
            seq.stream_pending(tok);
        }
        let out = events.lock().expect("events").clone();
        out
    }

    #[test]
    fn tokens_streamed_after_the_step_give_the_events_of_tokens_streamed_at_once() {
        let tok = tokenizer();
        let vocab = tok.vocab_size() as u32;
        // Ids across the vocabulary (bytes, merges, specials), in steps of one to four tokens.
        let ids: Vec<u32> = (0..23u32).map(|i| 3 + (i * 7919) % (vocab - 3)).collect();
        let steps: Vec<Vec<u32>> = ids.chunks(3).map(<[u32]>::to_vec).chain([vec![ids[4]]]).collect();
        // A stop string that never matches makes the sequence stream each token as it commits.
        let never = vec!["\u{7}\u{7}no such text".to_string()];
        for max_tokens in [5, 24, 100] {
            let deferred = events(&tok, &steps, max_tokens, Vec::new());
            assert!(!deferred.is_empty());
            assert_eq!(deferred, events(&tok, &steps, max_tokens, never.clone()), "budget {max_tokens}");
        }
        // An end-of-sequence token inside a step ends it, its held-back text flushed alone.
        let mut with_eos = steps.clone();
        with_eos[2].insert(1, 0);
        assert_eq!(events(&tok, &with_eos, 100, Vec::new()), events(&tok, &with_eos, 100, never));
    }
}
