//! Draws where the logits are: when the engine allows it ([`Engine::with_device_draws`]) and the target draws on its
//! device ([`Target::draws_on_device`]), a step hands the target one [`DrawRow`] per logit row (the request's
//! temperature, filters, seed, the row's absolute position, and its logit bias and penalties resolved against the
//! history the row sees) and reads back only tokens and the logprobs asked for, plus the logits of the rows the host
//! chooses itself (a grammar's mask, the lossy typical rule). The draw is the sampler's own
//! ([`dflash_runtime::ops::sample::draw_token`] is its host twin), so a seeded request gets the same tokens either
//! way, and a verify row's token is the one plain decoding would have drawn at its position.
//!
//! [`Target::draws_on_device`]: dflash_models::Target::draws_on_device

use dflash_models::StepDraws;
use dflash_runtime::ops::sample::DrawRow;

use super::Engine;
use crate::request::{TokenLogprob, TopLogprob};
use crate::scheduler::StepItem;

impl Engine {
    /// Whether the target draws the sampling rows of `items`: device draws are on ([`Engine::with_device_draws`]),
    /// it draws on its device, and some row does not need its logits on the host.
    pub(super) fn draws_on_device(&self, items: &[StepItem]) -> bool {
        self.device_draws
            && self.target.draws_on_device()
            && items.iter().any(|item| item.samples && !self.needs_host_logits(item))
    }

    /// Whether `item`'s rows are chosen from their logits on the host: under a grammar (its mask) or the lossy
    /// typical rule (its candidates).
    pub(super) fn needs_host_logits(&self, item: &StepItem) -> bool {
        let seq = &self.sched.running[item.seq];
        seq.request.grammar.is_some() || (item.drafts > 0 && self.typical_rule(item.seq).is_some())
    }

    /// One draw per logit row of `items`, in order, the adjustments they name, and the rows whose logits the host
    /// reads. Row `j` of a verify is drawn at position `len + j` over the history plus the drafts before it: what
    /// plain decoding sees there when those drafts are accepted, and the row counts only then.
    pub(super) fn step_draws(&self, items: &[StepItem]) -> StepDraws {
        let mut draws = StepDraws::default();
        for item in items.iter().filter(|item| item.samples) {
            let seq = &self.sched.running[item.seq];
            let params = &seq.request.sampling;
            if self.needs_host_logits(item) {
                draws.host_rows.extend(draws.rows.len()..draws.rows.len() + 1 + item.drafts);
            }
            let mut history = None;
            for j in 0..=item.drafts {
                if let Some(&draft) = seq.drafts.get(j.wrapping_sub(1)).filter(|_| params.has_penalties()) {
                    history.get_or_insert_with(|| seq.history.clone()).push(draft);
                }
                let start = draws.adjust.len();
                draws.adjust.extend(params.adjustments(history.as_ref().unwrap_or(&seq.history)));
                draws.rows.push(DrawRow {
                    logit_row: draws.rows.len(),
                    draw: params.draw((seq.len() + j) as u64),
                    adjust: start..draws.adjust.len(),
                    top_logprobs: seq.request.logprobs,
                });
            }
        }
        draws
    }
}

/// A drawn token's logprob entry from the device's numbers (raw logprob, top `(id, logprob)`).
pub(super) fn drawn_logprob(
    tok: &dflash_models::tokenizer::Tokenizer,
    id: u32,
    (logprob, top): &(f32, Vec<(u32, f32)>),
) -> TokenLogprob {
    let text = |id: u32| tok.decode(&[id], false).unwrap_or_default();
    TokenLogprob {
        token: text(id),
        logprob: *logprob,
        top: top.iter().map(|&(t, lp)| TopLogprob { token: text(t), logprob: lp }).collect(),
    }
}
