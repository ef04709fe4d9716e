//! The MTP lane: a multi-token-prediction head (the checkpoint's own `mtp.*`, or a head trained for the target)
//! drafts a chain of tokens from the target's last hidden state.
//!
//! Per sequence the lane keeps the head's history ([`MtpContext`]): one entry per committed position `j`, built
//! from the target's last-layer output at `j` (captured by the target and handed over through
//! [`Proposer::observe`]) and the token at `j + 1`. Hidden states arrive one step before their entry can be built
//! (the next token is not known yet), so they wait in `pending` and enter the history when the next round drafts.
//! A round appends the pending entries (the last one drafts the first token), then chains: each further step
//! feeds the previous step's output and the token just drafted, one position later. Chained steps write scratch
//! slots past the history and are never committed: rolling back is truncation.
//!
//! Drafts share the target's keyed noise: the draft for position `p` is the target sampler's own rule applied to
//! the head's logits, with the key the target uses at `p` ([`sampler::sample`]; penalties aside, which need the
//! history the lane does not keep). Verification stays the keyed rule, so output is token for token plain
//! decoding's, and a sampled draft lands on the target's token whenever the two distributions agree near the top.

use std::sync::Arc;

use dflash_models::mtp::MtpContext;
use dflash_models::{ModelError, MtpHead, TargetHeads};
use dflash_runtime::Tensor;

use super::{LaneKind, Proposal, ProposeInput, Proposer};
use crate::sampler::{self, SamplingParams, TokenHistory};

/// The deepest chain `auto` depth grows to unless `--mtp-depth` caps it.
pub const AUTO_MAX_DEPTH: usize = 6;

/// How deep each round's chain goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MtpDepth {
    /// Every round drafts this many tokens (`--mtp-depth N`).
    Fixed(usize),
    /// Grows and shrinks between 1 and `max` from each draft position's acceptance.
    Auto { max: usize },
}

impl MtpDepth {
    /// The most tokens a round may draft.
    pub fn max(&self) -> usize {
        match *self {
            MtpDepth::Fixed(n) | MtpDepth::Auto { max: n } => n,
        }
    }
}

/// The MTP lane's settings.
#[derive(Clone, Debug)]
pub struct MtpLaneConfig {
    pub head: Arc<MtpHead>,
    pub depth: MtpDepth,
    /// Opt-in lossy acceptance on sampled requests (`--mtp-typical d`): see [`super::verify::typical_accepts`].
    pub typical: Option<f32>,
}

/// One sequence's MTP lane.
pub struct MtpProposer {
    head: Arc<MtpHead>,
    /// The target's embedding and LM head.
    target: Arc<dyn TargetHeads>,
    ctx: MtpContext,
    /// Where the last layer's output sits in each captured row (`[taps · hidden]`).
    tap_col: usize,
    row_width: usize,
    hidden: usize,
    /// Last-layer outputs of observed positions `ctx.len() ..` whose entries are not built yet: `[n, hidden]`.
    pending: Vec<f32>,
    depth: DepthControl,
    /// Set after a head error: the lane stops drafting (the request goes on, plain).
    broken: bool,
}

impl MtpProposer {
    /// A lane for one sequence; the target captures `taps` layers per row, the last layer being tap `tap`.
    ///
    /// # Errors
    /// When the head's history cannot be allocated.
    pub fn new(cfg: &MtpLaneConfig, target: Arc<dyn TargetHeads>, tap: usize, taps: usize) -> Result<Self, ModelError> {
        let hidden = cfg.head.config().hidden_size();
        Ok(MtpProposer {
            ctx: cfg.head.new_context()?,
            head: Arc::clone(&cfg.head),
            target,
            tap_col: tap * hidden,
            row_width: taps * hidden,
            hidden,
            pending: Vec::new(),
            depth: DepthControl::new(cfg.depth),
            broken: false,
        })
    }

    fn pending_rows(&self) -> usize {
        self.pending.len() / self.hidden
    }

    fn fail(&mut self, what: &str, e: &ModelError) {
        tracing::warn!("mtp head: {what}: {e}; drafting off for this request");
        self.broken = true;
    }

    /// Builds the pending entries, then drafts `depth` tokens for positions `n ..` (`n` committed tokens).
    fn draft(&mut self, tokens: &[u32], params: &SamplingParams, depth: usize) -> Result<Proposal, ModelError> {
        let (n, h, first) = (tokens.len(), self.hidden, self.ctx.len());
        let (embedding, lm_head) = (self.target.embedding(), self.target.lm_head());
        let trunk = Tensor::from_f32(&self.pending, &[self.pending_rows(), h])?;
        let out = self.head.append(&mut self.ctx, embedding, &trunk, &tokens[first + 1..n])?;
        self.pending.clear();
        let last = out.rows() - 1;
        let mut previous = Tensor::from_f32(&out.as_f32()?[last * h..], &[1, h])?;
        let history = TokenHistory::default();
        let (mut drafts, mut confidence) = (Vec::with_capacity(depth), Vec::with_capacity(depth));
        for step in 0..depth {
            let logits = self.head.logits(lm_head, &previous)?;
            let row = logits.as_f32()?;
            let token = sampler::sample(row, params, &history, (n + step) as u64);
            confidence.push(probability_of(row, token, params));
            drafts.push(token);
            if step + 1 < depth {
                previous = self.head.chain(&mut self.ctx, embedding, &previous, token, step)?;
            }
        }
        Ok(Proposal { tokens: drafts, confidence: Some(confidence) })
    }
}

impl Proposer for MtpProposer {
    fn kind(&self) -> LaneKind {
        LaneKind::Mtp
    }

    fn propose(&mut self, input: &ProposeInput, max: usize) -> Proposal {
        let depth = self.depth.get().min(max);
        let n = input.tokens.len();
        // Every position before the anchor must be observed, the newest not yet entered.
        if self.broken || depth == 0 || self.pending_rows() == 0 || self.ctx.len() + self.pending_rows() + 1 != n {
            return Proposal::default();
        }
        // The target's own rule without penalties: they read a history the lane does not keep.
        let params = SamplingParams {
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            ..input.sampling.clone()
        };
        match self.draft(input.tokens, &params, depth) {
            Ok(p) => p,
            Err(e) => {
                self.fail("draft", &e);
                Proposal::default()
            }
        }
    }

    fn observes_target(&self) -> bool {
        true
    }

    fn observe(&mut self, first_position: usize, captured: &[f32]) {
        if self.broken || self.row_width == 0 {
            return;
        }
        let mut next = self.ctx.len() + self.pending_rows();
        for (r, row) in captured.chunks_exact(self.row_width).enumerate() {
            match first_position + r {
                // Recomputed after a preemption: already held.
                p if p < next => continue,
                p if p == next => {
                    self.pending.extend_from_slice(&row[self.tap_col..self.tap_col + self.hidden]);
                    next += 1;
                }
                p => {
                    let e = ModelError::Batch(format!("hidden state of position {p} before position {next}"));
                    self.fail("history", &e);
                    return;
                }
            }
        }
    }

    fn on_verified(&mut self, drafted: usize, accepted: usize) {
        self.depth.record(drafted, accepted);
    }
}

/// The probability of `token` under the distribution the drafts are drawn from (temperature-scaled softmax of
/// the raw logits; temperature 1 for greedy requests): the drafter's confidence, for the round policy.
fn probability_of(logits: &[f32], token: u32, params: &SamplingParams) -> f32 {
    let t = if params.is_greedy() { 1.0 } else { f64::from(params.temperature) };
    let max = logits.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
    let Some(&x) = logits.get(token as usize).filter(|x| x.is_finite() && max.is_finite()) else {
        return 0.0;
    };
    let scaled = |l: f32| ((f64::from(l) - f64::from(max)) / t).exp();
    let total: f64 = logits.iter().filter(|l| l.is_finite()).map(|&l| scaled(l)).sum();
    (scaled(x) / total) as f32
}

/// Conditional acceptance a position starts from, before any round drafted it.
const PRIOR_ACCEPT: f64 = 0.6;
/// Weight of each new observation in a position's acceptance estimate.
const ACCEPT_EMA: f64 = 0.15;
/// A position is drafted while its chance of being reached and accepted is at least this.
const MIN_REACH: f64 = 0.3;

/// Each round's depth: fixed, or from per-position acceptance.
///
/// Auto keeps, per draft position `i`, an estimate `a[i]` of P(draft `i` accepted | every draft before it
/// accepted) (an EMA of the rounds that reached `i`). The depth is the deepest position whose chance of being
/// reached and accepted, `a[0] · … · a[i]`, is at least [`MIN_REACH`], at least 1, and never more than one
/// deeper than the last round's, so a new position is tried before it is trusted. A rejection at position `i`
/// lowers `a[i]` and the depth follows at once.
#[derive(Clone, Debug)]
struct DepthControl {
    mode: MtpDepth,
    accept: Vec<f64>,
    depth: usize,
}

impl DepthControl {
    fn new(mode: MtpDepth) -> Self {
        let depth = match mode {
            MtpDepth::Fixed(n) => n,
            MtpDepth::Auto { max } => max.min(1),
        };
        DepthControl { mode, accept: vec![PRIOR_ACCEPT; mode.max()], depth }
    }

    fn get(&self) -> usize {
        self.depth
    }

    /// A verified round: `drafted` drafts, the first `accepted` of them accepted.
    fn record(&mut self, drafted: usize, accepted: usize) {
        let MtpDepth::Auto { max } = self.mode else { return };
        for i in 0..drafted.min(max) {
            let hit = i < accepted;
            self.accept[i] += ACCEPT_EMA * (f64::from(u8::from(hit)) - self.accept[i]);
            if !hit {
                break;
            }
        }
        let mut reach = 1.0;
        let mut deepest = 1;
        for (i, a) in self.accept.iter().enumerate() {
            reach *= a;
            if reach < MIN_REACH {
                break;
            }
            deepest = i + 1;
        }
        self.depth = deepest.min(self.depth + 1).min(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_depth_never_moves() {
        let mut d = DepthControl::new(MtpDepth::Fixed(3));
        for _ in 0..20 {
            d.record(3, 0);
        }
        assert_eq!(d.get(), 3);
    }

    #[test]
    fn auto_depth_grows_one_step_at_a_time_and_shrinks_on_rejections() {
        let mut d = DepthControl::new(MtpDepth::Auto { max: 5 });
        assert_eq!(d.get(), 1);
        let mut seen = vec![d.get()];
        for _ in 0..40 {
            let depth = d.get();
            d.record(depth, depth);
            seen.push(d.get());
        }
        assert!(seen.windows(2).all(|w| w[1] <= w[0] + 1), "grows by one at most: {seen:?}");
        assert_eq!(d.get(), 5, "capped at its max");
        for _ in 0..30 {
            d.record(d.get(), 0);
        }
        assert_eq!(d.get(), 1, "every first draft rejected: depth 1");
        // Position 0 always accepted, position 1 never: depth 2 at most (position 1 is still tried).
        for _ in 0..60 {
            let depth = d.get();
            d.record(depth, 1.min(depth));
        }
        assert!(d.get() <= 2, "depth {}", d.get());
        assert_eq!(DepthControl::new(MtpDepth::Auto { max: 0 }).get(), 0);
    }

    #[test]
    fn confidence_is_the_drafting_distributions_probability() {
        let logits = [0.0f32, 1.0, 2.0, f32::NEG_INFINITY];
        let greedy = SamplingParams::greedy();
        let z: f32 = [0.0f32, 1.0, 2.0].iter().map(|l| l.exp()).sum();
        assert!((probability_of(&logits, 2, &greedy) - 2f32.exp() / z).abs() < 1e-6);
        let hot = SamplingParams { temperature: 2.0, ..SamplingParams::greedy() };
        let z2: f32 = [0.0f32, 0.5, 1.0].iter().map(|l| l.exp()).sum();
        assert!((probability_of(&logits, 0, &hot) - 1.0 / z2).abs() < 1e-6);
        assert_eq!(probability_of(&logits, 3, &greedy), 0.0);
        assert_eq!(probability_of(&logits, 9, &greedy), 0.0);
    }
}
