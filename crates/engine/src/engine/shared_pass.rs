//! The step's shared drafter pass: the block-drafting lanes that planned a round draft together, in one pass of
//! their drafter (its matmuls over every lane's block at once), instead of one pass each.

use std::time::Instant;

use super::Engine;
use crate::scheduler::StepItem;
use crate::sequence::Sequence;
use crate::spec::{DflashProposer, DraftTime, PolicyMode, SharedCosts, StepGate};

/// What a step's shared drafter pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct PassRun {
    /// A pass ran (the step gate let it, or did not judge the step).
    pub ran: bool,
    /// It captured a CUDA graph of the drafter's pass: the step's time includes the capture.
    pub captured_graph: bool,
}

impl Engine {
    /// Runs the step's drafter pass over the rounds `planned` when the step gate lets a step of `decoding`
    /// sequences run one, or the gates do not judge this step ([`Self::gates_judge`]); otherwise those rounds go
    /// plain.
    pub(super) fn gated_shared_pass(&mut self, planned: &[(usize, usize)], decoding: usize) -> PassRun {
        if planned.is_empty() {
            return PassRun::default();
        }
        let runs = !self.gates_judge(planned.iter().map(|&(i, _)| i)) || self.step_gate.allows_pass(decoding);
        self.metrics.record_step_pass(runs);
        if runs {
            return PassRun { ran: true, captured_graph: self.draft_in_one_pass(planned) };
        }
        for &(i, _) in planned {
            let seq = &mut self.sched.running[i];
            seq.skip_shared_round();
            add_round_to_step(&self.round_costs, seq);
        }
        PassRun::default()
    }

    /// Withdraws every decoding sequence's drafts in a step without a drafter pass (prompt lookup's, the MTP
    /// head's) unless the drafts gate lets a step of `decoding` sequences verify them, or the gates do not judge
    /// this step ([`Self::gates_judge`]): where such steps measure slower than plain ones (eight requests on an
    /// H100, entry 101), the rounds go plain.
    pub(super) fn gate_drafts(&mut self, decoding: usize) {
        let drafting = |s: &Sequence| !s.drafts.is_empty();
        let running = &self.sched.running;
        let drafters = running.iter().enumerate().filter(|(_, s)| drafting(s)).map(|(i, _)| i);
        let judged = running.iter().any(drafting) && self.gates_judge(drafters);
        if !judged || self.draft_gate.allows_pass(decoding) {
            return;
        }
        self.metrics.record_drafts_withheld();
        self.sched.running.iter_mut().filter(|s| drafting(s)).for_each(Sequence::withdraw_drafts);
    }

    /// Whether the step gates judge a step drafting for the running sequences `drafting`: not when one of their
    /// lanes drafts every round (a fixed policy), nor under `DFLASH_STEP_GATE=0`.
    fn gates_judge(&self, mut drafting: impl Iterator<Item = usize>) -> bool {
        let fixed =
            drafting.any(|i| self.sched.running[i].lane.as_ref().is_some_and(|l| l.policy.mode() == PolicyMode::Fixed));
        !fixed && !dflash_runtime::switches::switches().no_step_gate
    }

    /// Tokens the decoding sequences among `items` have generated so far.
    pub(super) fn generated_by(&self, items: &[StepItem]) -> usize {
        items.iter().filter(|i| i.samples).map(|i| self.sched.running[i.seq].generated()).sum()
    }

    /// Feeds the step gate a step of `decoding` sequences (as [`Self::gated_shared_pass`] was told) that ran
    /// decode and verify rows only: whether it ran a drafter pass, what its decoding sequences committed
    /// (`generated_before`: [`Self::generated_by`] before sampling) and its time from drafting to now.
    pub(super) fn observe_step_gate(
        &mut self,
        items: &[StepItem],
        decoding: usize,
        ran_pass: bool,
        generated_before: usize,
        started: Instant,
    ) {
        if items.is_empty() || !items.iter().all(StepItem::is_round) {
            return;
        }
        let tokens = self.generated_by(items).saturating_sub(generated_before);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        observe_gate(&mut self.step_gate, "drafter passes", (decoding, ran_pass, tokens, ms));
        if !ran_pass {
            let drafted = items.iter().any(|i| i.drafts > 0);
            observe_gate(&mut self.draft_gate, "drafts without a pass", (decoding, drafted, tokens, ms));
        }
    }

    /// Drafts the rounds `planned` (`(index into the running sequences, most drafts)`, in order) in one drafter
    /// pass; each lane is charged an equal share of its time, unless the pass captured a CUDA graph (then its time
    /// is the capture's, and the lanes price their rounds at the table's drafting cost). A pass that panics drops
    /// those lanes (their requests decode on, plain). Returns whether the pass captured a graph.
    pub(super) fn draft_in_one_pass(&mut self, planned: &[(usize, usize)]) -> bool {
        if planned.is_empty() {
            return false;
        }
        // A catch-up is not drafting: a lane's first pass appends its whole prompt, which no later round pays.
        self.catch_up_from_pages(planned);
        let started = Instant::now();
        let mut members = Vec::with_capacity(planned.len());
        let (proposals, captured) = {
            let mut lanes = Vec::with_capacity(planned.len());
            let mut wanted = planned.iter().peekable();
            for (i, seq) in self.sched.running.iter_mut().enumerate() {
                let Some(&(_, max)) = wanted.next_if(|&&(j, _)| j == i) else { continue };
                if let Some((drafter, input)) = seq.shared_pass_member() {
                    lanes.push((drafter, input, max));
                    members.push((i, max));
                }
            }
            let captures_before: usize = lanes.iter().map(|(drafter, _, _)| drafter.pass_captures()).sum();
            let proposals =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| DflashProposer::propose_batch(&mut lanes)));
            let captures_after: usize = lanes.iter().map(|(drafter, _, _)| drafter.pass_captures()).sum();
            (proposals, captures_after != captures_before)
        };
        let share_ms = started.elapsed().as_secs_f64() * 1e3 / members.len().max(1) as f64;
        let time = if captured { DraftTime::Captured(share_ms) } else { DraftTime::Priced(share_ms) };
        match proposals {
            Ok(proposals) => {
                for (&(i, max), proposal) in members.iter().zip(proposals) {
                    let seq = &mut self.sched.running[i];
                    seq.finish_shared_drafts(max, proposal, time);
                    add_round_to_step(&self.round_costs, seq);
                }
            }
            Err(_) => members.iter().for_each(|&(i, _)| self.sched.running[i].drop_lane("drafting in a shared pass")),
        }
        captured
    }
}

impl Engine {
    /// Brings the drafter contexts of the lanes drafting `planned` up to their sequences' cached positions from the
    /// target's pages, when the drafter reads them there (entry 101): the rows of every step since each lane last
    /// drafted, or of its whole prompt, in one append per drafter.
    fn catch_up_from_pages(&mut self, planned: &[(usize, usize)]) {
        let Some(pages) = &self.captured_pages else { return };
        let mut wanted = planned.iter().peekable();
        let mut lanes = Vec::with_capacity(planned.len());
        for (i, seq) in self.sched.running.iter_mut().enumerate() {
            if wanted.next_if(|&&(j, _)| j == i).is_some() {
                lanes.extend(seq.rows_to_catch_up(self.page_size));
            }
        }
        DflashProposer::observe_on_device(&mut lanes, pages);
    }
}

/// Feeds `gate` a step (`(decoding sequences, whether it drafted, tokens, ms)`), logging when its decision at that
/// batch size turns.
fn observe_gate(gate: &mut StepGate, what: &str, (decoding, drafted, tokens, ms): (usize, bool, usize, f64)) {
    let was_open = gate.view(decoding).open;
    gate.observe(decoding, drafted, tokens, ms);
    let now = gate.view(decoding);
    if now.open != was_open {
        tracing::info!(
            "step gate at {decoding} decoding sequences: {what} {} (drafting {:.3} tok/ms over {} steps, plain \
             {:.3} over {})",
            if now.open { "run" } else { "held back" },
            now.drafted.0,
            now.drafted.1,
            now.plain.0,
            now.plain.1
        );
    }
}

/// Adds a decoding sequence's round to the step being drafted for, as far as its grammar let its drafts go.
pub(super) fn add_round_to_step(costs: &SharedCosts, seq: &Sequence) {
    if let Some(lane) = seq.lane.as_ref().filter(|_| seq.is_decoding()) {
        let mut share = lane.round_share();
        share.extra_rows = share.extra_rows.min(seq.drafts.len());
        costs.lock().add_to_step(share);
    }
}
