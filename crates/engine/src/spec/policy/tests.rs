//! The policy on synthetic targets: a cost curve and an acceptance stream stand in for the model, and a seeded
//! generator decides which drafts the "target" accepts, so every run is reproducible.

use super::*;
use dflash_models::StepPadding;

/// A deterministic uniform source (splitmix64).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A lane and its target: `ms(rows)` is what a step really costs, `draft_ms` what drafting costs.
struct Sim {
    policy: RoundPolicy,
    costs: CostTable,
    rng: Rng,
    drafts: usize,
    ms: Box<dyn Fn(usize) -> f64>,
    draft_ms: f64,
    tokens: f64,
    elapsed_ms: f64,
    /// Tokens of context every round runs at.
    context: usize,
    /// Steps take their curve's time times a factor drawn uniformly from `1 ± jitter`.
    jitter: f64,
}

/// What one round drafted: per draft, the drafter's confidence and the chance the target accepts it.
struct Drafts {
    confidence: Option<Vec<f32>>,
    accept: Vec<f64>,
}

impl Sim {
    fn new(mode: PolicyMode, drafts: usize, ms: impl Fn(usize) -> f64 + 'static, draft_ms: f64) -> Self {
        // The probe measures the real curve (short context, quiet machine).
        let probe: Vec<f64> = (1..=drafts + 1).map(&ms).collect();
        Self::at_context(mode, drafts, ms, draft_ms, 100, &probe)
    }

    /// A lane whose rounds run at `context` tokens, on a table the start-up probe seeded with `probe` (ms by rows,
    /// measured at a short context).
    fn at_context(
        mode: PolicyMode,
        drafts: usize,
        ms: impl Fn(usize) -> f64 + 'static,
        draft_ms: f64,
        context: usize,
        probe: &[f64],
    ) -> Self {
        let mut costs = CostTable::new(drafts + 1);
        costs.seed(probe);
        Sim {
            policy: RoundPolicy::new(mode, LaneKind::Oracle, drafts),
            costs,
            rng: Rng(7),
            drafts,
            ms: Box::new(ms),
            draft_ms,
            tokens: 0.0,
            elapsed_ms: 0.0,
            context,
            jitter: 0.0,
        }
    }

    /// Runs one round whose drafts are accepted with conditional probability `p` each; returns its verify rows.
    fn round(&mut self, p: f64) -> usize {
        let drafts = Drafts { confidence: None, accept: vec![p; self.drafts] };
        self.round_with(&drafts)
    }

    fn round_with(&mut self, drafts: &Drafts) -> usize {
        let context = self.context;
        // As the engine: a step begins, and this lane's kind runs a round in it.
        self.costs.begin_step(1);
        self.costs.count_armed_step(LaneKind::Oracle);
        if let RoundPlan::Plain = self.policy.plan(&self.costs, context, self.drafts) {
            self.step(1, 1, 0.0);
            return 1;
        }
        self.costs.observe_draft(LaneKind::Oracle, self.draft_ms);
        let confidence = drafts.confidence.as_deref();
        let keep = self.policy.choose(&self.costs, context, self.drafts, confidence, self.draft_ms).drafts;
        if keep == 0 {
            self.step(1, 1, self.draft_ms);
            return 1;
        }
        let accepted = drafts.accept[..keep].iter().take_while(|&&p| self.rng.uniform() < p).count();
        self.policy.record_verified(&mut self.costs, keep, accepted, confidence.map(|c| &c[..keep]));
        let step_ms = self.step(keep + 1, accepted + 1, self.draft_ms);
        let round = RoundTiming::alone(&self.costs, context, accepted + 1, self.draft_ms + step_ms);
        self.policy.record_round(&self.costs, context, round);
        keep + 1
    }

    /// Accounts a step of `rows` rows that committed `tokens`, feeds its cost to the table, and returns it (ms).
    fn step(&mut self, rows: usize, tokens: usize, draft_ms: f64) -> f64 {
        let jitter = if self.jitter > 0.0 { 1.0 + self.jitter * (2.0 * self.rng.uniform() - 1.0) } else { 1.0 };
        let ms = (self.ms)(rows) * jitter;
        self.costs.observe(self.context, rows, ms);
        self.tokens += tokens as f64;
        self.elapsed_ms += draft_ms + ms;
        ms
    }

    /// Tokens per ms so far.
    fn rate(&self) -> f64 {
        self.tokens / self.elapsed_ms
    }
}

/// A dense target on this CPU class: each extra verify row adds half a percent.
fn dense(rows: usize) -> f64 {
    10.0 + 0.05 * (rows - 1) as f64
}

/// A sparse MoE target: every extra row routes to more experts (a measured 8-row verify ladder, ms).
fn sparse(rows: usize) -> f64 {
    [17.7, 25.5, 29.6, 33.6, 36.8, 42.4, 44.8, 47.9][rows - 1]
}

fn widths(sim: &mut Sim, p: f64, rounds: usize) -> Vec<usize> {
    (0..rounds).map(|_| sim.round(p)).collect()
}

fn mean(xs: &[usize]) -> f64 {
    xs.iter().sum::<usize>() as f64 / xs.len() as f64
}

#[test]
fn dense_flat_costs_widen_to_the_full_block() {
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, dense, 1.0);
    widths(&mut sim, 0.9, 20);
    let w = widths(&mut sim, 0.9, 100);
    let full = w.iter().filter(|&&r| r == 8).count();
    assert!(full >= 90, "full-block rounds: {full} of 100: {w:?}");
    let mut fixed = Sim::new(PolicyMode::Fixed, 7, dense, 1.0);
    widths(&mut fixed, 0.9, 120);
    assert!(sim.rate() >= 0.97 * fixed.rate(), "adaptive {:.4} vs fixed {:.4} tok/ms", sim.rate(), fixed.rate());
}

#[test]
fn a_steep_ladder_with_weak_acceptance_goes_plain() {
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, sparse, 2.0);
    let w = widths(&mut sim, 0.3, 400);
    let plain = w[20..].iter().filter(|&&r| r == 1).count();
    assert!(plain >= 300, "plain rounds: {plain} of 380");
    assert!(w[20..].iter().all(|&r| r <= 3), "rounds stay narrow: {w:?}");
    let plain_rate = 1.0 / sparse(1);
    assert!(sim.rate() >= 0.97 * plain_rate, "adaptive {:.4} vs plain {plain_rate:.4} tok/ms", sim.rate());
    let mut fixed = Sim::new(PolicyMode::Fixed, 7, sparse, 2.0);
    widths(&mut fixed, 0.3, 400);
    assert!(sim.rate() > fixed.rate() * 1.5, "adaptive {:.4} vs fixed {:.4}", sim.rate(), fixed.rate());
    assert!(sim.policy.backoff().period() > backoff::FIRST_PERIOD, "the gate backed off");
}

#[test]
fn a_steep_ladder_with_strong_acceptance_still_drafts_wide() {
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, sparse, 2.0);
    let w = widths(&mut sim, 0.95, 200);
    assert!(mean(&w[20..]) >= 6.0, "{w:?}");
}

#[test]
fn expensive_drafting_keeps_a_lane_near_plain_speed() {
    // This CPU's ladder for the default model (a third verify row doubles the step) and a block drafter whose
    // pass costs 60% of a plain step, accepted 45% of the time: no width pays.
    let cpu = |rows: usize| [15.9, 18.5, 38.0, 38.0, 42.0, 45.1, 49.9, 48.1][rows - 1];
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, cpu, 9.0);
    widths(&mut sim, 0.45, 400);
    let plain_rate = 1.0 / cpu(1);
    assert!(sim.rate() >= 0.96 * plain_rate, "adaptive {:.4} vs plain {plain_rate:.4} tok/ms", sim.rate());
    let mut fixed = Sim::new(PolicyMode::Fixed, 7, cpu, 9.0);
    widths(&mut fixed, 0.45, 400);
    assert!(sim.rate() > 1.5 * fixed.rate(), "adaptive {:.4} vs fixed {:.4}", sim.rate(), fixed.rate());
}

#[test]
fn shifting_content_is_followed_within_a_few_rounds() {
    // A CPU-like ladder: each row adds 15% of a plain step.
    let ladder = |rows: usize| 10.0 * (1.0 + 0.15 * (rows - 1) as f64);
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, ladder, 0.5);
    let repetitive = widths(&mut sim, 0.95, 60);
    assert!(mean(&repetitive[10..]) >= 6.0, "copying: {repetitive:?}");
    let prose = widths(&mut sim, 0.05, 80);
    assert!(prose[6..].iter().all(|&r| r <= 2), "prose narrows within a few rounds: {prose:?}");
    assert!(mean(&prose[6..]) <= 1.2, "and mostly goes plain: {prose:?}");
    let back = widths(&mut sim, 0.95, 60);
    // Probes come at least every (1.5 + 0.5) / (PROBE_SHARE * 10) = 10 rounds here.
    let wide_again = back.iter().position(|&r| r >= 6).unwrap_or(usize::MAX);
    assert!(wide_again <= 15, "copying again: {back:?}");
    assert!(mean(&back[20..]) >= 6.0, "{back:?}");
}

#[test]
fn confidence_cuts_the_round_where_the_drafter_stops_being_sure() {
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, |rows| 10.0 * (1.0 + 0.2 * (rows - 1) as f64), 0.5);
    let mut rng = Rng(3);
    let mut cut_right = 0;
    for round in 0..300 {
        // The drafter is sure of a leading run of 1-6 drafts (and right about them), unsure after.
        let sure = 1 + (rng.uniform() * 6.0) as usize;
        let confidence: Vec<f32> = (0..7).map(|j| if j < sure { 0.995 } else { 0.3 }).collect();
        let accept = (0..7).map(|j| if j < sure { 0.97 } else { 0.1 }).collect();
        let rows = sim.round_with(&Drafts { confidence: Some(confidence), accept });
        cut_right += usize::from(round >= 100 && rows == sure + 1);
    }
    assert!(cut_right >= 170, "rounds cut after the sure run: {cut_right} of 200");
}

/// The H200 round-policy table (docs/BENCHMARKS.md, "The round policy on a sparse hybrid target"): the
/// Qwen3-Next-shaped target's measured verify ladders (ms by rows) at three contexts, the oracle drafter's three
/// acceptance profiles (conditional, by draft position), and 128-token requests, each served by a fresh lane
/// policy on the engine's shared cost table, which the start-up probe seeded at a short context.
const H200_LADDERS: [(usize, [f64; 8]); 3] = [
    (1000, [2.30, 3.05, 3.65, 4.20, 4.80, 5.45, 6.05, 6.60]),
    (8192, [2.27, 3.11, 3.93, 4.70, 5.47, 6.23, 7.10, 7.99]),
    (32768, [2.87, 4.39, 5.55, 6.87, 7.70, 8.58, 9.90, 11.27]),
];
const H200_PROFILES: [(&str, [f64; 7]); 3] = [
    ("high", [0.9, 0.85, 0.8, 0.75, 0.7, 0.7, 0.7]),
    ("mid", [0.8, 0.6, 0.5, 0.4, 0.4, 0.4, 0.4]),
    ("low", [0.5, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1]),
];

/// Tokens per ms of 24 requests of 128 tokens, each a fresh lane of `drafts` drafts per round, served on the
/// engine's shared table `costs` (which earlier lanes fed, as in the benchmark), and how many rounds verified each
/// number of rows.
fn serve_requests(
    mode: PolicyMode,
    drafts: usize,
    ladder: [f64; 8],
    context: usize,
    accept: [f64; 7],
    costs: &mut CostTable,
) -> (f64, [usize; 9]) {
    let probe = &H200_LADDERS[0].1[..=drafts];
    let mut sim = Sim::at_context(mode, drafts, move |rows| ladder[rows - 1], 0.02, context, probe);
    sim.costs = costs.clone();
    sim.jitter = 0.1;
    let drafted = Drafts { confidence: None, accept: accept[..drafts].to_vec() };
    let mut hist = [0usize; 9];
    for _ in 0..24 {
        sim.policy = RoundPolicy::new(mode, LaneKind::Oracle, drafts);
        let end = sim.tokens + 128.0;
        while sim.tokens < end {
            hist[sim.round_with(&drafted)] += 1;
        }
    }
    let rate = sim.rate();
    *costs = sim.costs;
    (rate, hist)
}

#[test]
fn on_the_h200_hybrid_table_adaptive_keeps_up_with_the_best_fixed_block() {
    let mut misses = Vec::new();
    for (context, ladder) in H200_LADDERS {
        for (profile, accept) in H200_PROFILES {
            // The benchmark's order on one engine: plain, one draft, fixed 4 and 8, then adaptive.
            let mut costs = CostTable::new(8);
            costs.seed(&H200_LADDERS[0].1);
            let mut rng = Rng(5);
            for _ in 0..24 * 128 {
                costs.observe(context, 1, ladder[0] * (0.95 + 0.1 * rng.uniform()));
            }
            let mut rate = |mode, drafts| serve_requests(mode, drafts, ladder, context, accept, &mut costs);
            let (_, (fixed4, _), (fixed8, _), (adaptive, widths)) = (
                rate(PolicyMode::Fixed, 1),
                rate(PolicyMode::Fixed, 3),
                rate(PolicyMode::Fixed, 7),
                rate(PolicyMode::Adaptive, 7),
            );
            let plain = 1.0 / ladder[0];
            let best = fixed4.max(fixed8);
            // Printed for tuning (`--nocapture`): tokens per ms, and the adaptive lane's rounds by verify rows.
            println!(
                "{context:>6} {profile:<5} plain {plain:.3} fixed4 {fixed4:.3} fixed8 {fixed8:.3} adaptive {adaptive:.3} \
                 ({:+.1}% vs the better fixed, {:+.1}% vs plain) rounds by rows {:?}",
                100.0 * (adaptive / best - 1.0),
                100.0 * (adaptive / plain - 1.0),
                &widths[1..]
            );
            if adaptive < 0.97 * best || adaptive < 0.97 * plain {
                misses.push((context, profile));
            }
        }
    }
    assert!(misses.is_empty(), "adaptive more than 3% behind in {misses:?}");
}

#[test]
fn the_policy_is_deterministic() {
    let run = || {
        let mut sim = Sim::new(PolicyMode::Adaptive, 7, sparse, 2.0);
        let w: Vec<usize> = [0.9, 0.2, 0.6].iter().flat_map(|&p| widths(&mut sim, p, 80)).collect();
        (w, sim.policy, sim.costs)
    };
    assert_eq!(run(), run());
}

#[test]
fn fixed_always_verifies_the_full_width() {
    let mut sim = Sim::new(PolicyMode::Fixed, 7, sparse, 2.0);
    for p in [0.0, 0.3, 1.0] {
        assert!(widths(&mut sim, p, 50).iter().all(|&r| r == 8), "p = {p}");
    }
    assert_eq!(sim.policy.backoff().pauses(), 0, "no gate");
}

#[test]
fn policy_names_parse() {
    assert_eq!("fixed".parse::<PolicyMode>().ok(), Some(PolicyMode::Fixed));
    assert_eq!(PolicyMode::default().as_str().parse::<PolicyMode>().ok(), Some(PolicyMode::Adaptive));
    assert!("wide".parse::<PolicyMode>().is_err());
}

/// `sequences` lanes sharing every step, as the engine runs them: the lanes draft one after another, each pricing
/// its round as part of the step so far, and every drafting call holds up the whole step. A step of `rows` rows in
/// all costs `batch_ms(rows)`; the start-up probe measured one sequence. Drafts are accepted with conditional
/// probability `p`. Returns tokens per ms.
fn serve_batch(
    mode: PolicyMode,
    sequences: usize,
    rounds: usize,
    draft_ms: f64,
    p: f64,
    batch_ms: impl Fn(usize) -> f64,
) -> f64 {
    let case = Served {
        mode,
        sequences,
        rounds,
        request_rounds: usize::MAX,
        draft_ms,
        p,
        padding: None,
        priced_padded: false,
    };
    serve(&case, |_, rows| batch_ms(rows))
}

/// A batch served by [`serve`]: `sequences` lanes for `rounds` steps, each lane a new request's after
/// `request_rounds` rounds, drafting calls of `draft_ms`, drafts accepted with conditional probability `p`.
struct Served {
    mode: PolicyMode,
    sequences: usize,
    rounds: usize,
    request_rounds: usize,
    draft_ms: f64,
    p: f64,
    /// The graph buckets the simulated device pads its steps to (`None`: a step runs its own rows), and whether
    /// the cost table knows them.
    padding: Option<StepPadding>,
    priced_padded: bool,
}

/// [`serve_batch`] with a step of `s` sequences and `rows` rows in all costing `step_ms(s, rows)` (the probe
/// measured a lone sequence's steps), and requests that end and are replaced.
fn serve(case: &Served, step_ms: impl Fn(usize, usize) -> f64) -> f64 {
    let Served { mode, sequences, rounds, request_rounds, draft_ms, p, padding, priced_padded } = *case;
    // The device runs a step's padded rows.
    let step_ms = |s: usize, rows: usize, widest: usize| step_ms(s, padding.map_or(rows, |p| p.rows(s, rows, widest)));
    let (drafts, context) = (7, 100);
    let mut costs = CostTable::new(drafts + 1).with_padding(padding.filter(|_| priced_padded));
    costs.seed(&(1..=drafts + 1).map(|rows| step_ms(1, rows, rows)).collect::<Vec<_>>());
    let new_lane = || RoundPolicy::new(mode, LaneKind::Oracle, drafts);
    let mut lanes: Vec<RoundPolicy> = (0..sequences).map(|_| new_lane()).collect();
    let mut rng = Rng(11);
    let (mut tokens, mut elapsed) = (0.0, 0.0);
    for round in 0..rounds {
        // Requests end one after another, each replaced by a new one.
        if request_rounds < usize::MAX && round % request_rounds.div_ceil(sequences) == 0 {
            let ending = round / request_rounds.div_ceil(sequences) % sequences;
            lanes[ending] = new_lane();
        }
        costs.begin_step(sequences);
        let mut keeps = vec![0; sequences];
        let mut drafted = vec![false; sequences];
        for ((lane, keep), drafted) in lanes.iter_mut().zip(keeps.iter_mut()).zip(drafted.iter_mut()) {
            if let RoundPlan::Draft { .. } = lane.plan(&costs, context, drafts) {
                *drafted = true;
                costs.observe_draft(LaneKind::Oracle, draft_ms);
                let choice = lane.choose(&costs, context, drafts, None, draft_ms);
                *keep = choice.drafts;
                let extra_tokens = choice.expected_tokens - 1.0;
                costs.add_to_step(RoundShare { extra_rows: choice.drafts, extra_tokens, draft_ms });
            }
        }
        let rows: usize = keeps.iter().map(|k| k + 1).sum();
        let widest = keeps.iter().max().map_or(1, |k| k + 1);
        let step_ms = step_ms(sequences, rows, widest);
        let drafting_ms = drafted.iter().filter(|&&d| d).count() as f64 * draft_ms;
        costs.observe_step(context, sequences, rows, step_ms);
        elapsed += drafting_ms + step_ms;
        let plain_step = costs.plain_cost(context, sequences);
        let plain_ms = plain_step / sequences as f64;
        for ((lane, &keep), &drafted) in lanes.iter_mut().zip(&keeps).zip(&drafted) {
            let accepted = (0..keep).take_while(|_| rng.uniform() < p).count();
            if keep > 0 {
                lane.record_verified(&mut costs, keep, accepted, None);
                let share = keep as f64 / (rows - sequences) as f64;
                let took_ms = plain_ms + (step_ms - plain_step) * share + if drafted { draft_ms } else { 0.0 };
                lane.record_round(&costs, context, RoundTiming { tokens: accepted + 1, took_ms, plain_ms });
            }
            tokens += (accepted + 1) as f64;
        }
    }
    tokens / elapsed
}

#[test]
fn verify_rows_dearer_in_a_batch_than_alone_are_priced_from_the_batch() {
    // A lone sequence's step costs 0.6 ms plus 0.02 a row, but a step of 8 sequences where any verifies drafts
    // takes 1.4 ms more (another graph, a second pass of the quantized kernel: an H100 ran such a step in 2.4 ms
    // against 0.97 plain). Requests of 64 rounds follow one another. Priced by the cells, which hold no such
    // step, each new request's lane finds drafting worth a round; priced from the batch's measured steps, the
    // lanes stop once the first of them is measured.
    let step = |sequences: usize, rows: usize| {
        0.6 + 0.02 * rows as f64 + if sequences > 1 && rows > sequences { 1.4 } else { 0.0 }
    };
    let plain = 8.0 / step(8, 8);
    let case = Served {
        mode: PolicyMode::Adaptive,
        sequences: 8,
        rounds: 2000,
        request_rounds: 64,
        draft_ms: 0.05,
        p: 0.8,
        padding: None,
        priced_padded: false,
    };
    let rate = serve(&case, step);
    assert!(rate >= 0.97 * plain, "adaptive {rate:.3} vs plain {plain:.3} tok/ms");
    // Alone the same drafts pay: the batch's price is not the lone sequence's.
    let alone = Served { sequences: 1, request_rounds: usize::MAX, ..case };
    let rate = serve(&alone, step);
    assert!(rate >= 1.5 / step(1, 1), "alone: adaptive {rate:.3} vs plain {:.3} tok/ms", 1.0 / step(1, 1));
}

#[test]
fn priced_by_padded_rows_lanes_fill_the_rows_a_plain_step_pads_to() {
    // A device that pads its steps to graph buckets, a step costing what its padded rows cost (2.15 ms at 64 rows,
    // 2.46 at 80: the H100's default-model sweep, PERFORMANCE.md entry 120), free drafts right 60% of the time.
    // 60 sequences run as 64 and 72 as 80 plain, so up to 4 and 8 verify rows cost nothing; a table that knows it
    // drafts them, and elsewhere prices as before.
    let padding = StepPadding { max_rows: 256, max_seqs: 512, mixed: true };
    let ms = |rows: usize| 0.9 + 0.0195 * rows as f64;
    let run = |sequences: usize, priced_padded: bool| {
        let case = Served {
            mode: PolicyMode::Adaptive,
            sequences,
            rounds: 3000,
            request_rounds: 128,
            draft_ms: 0.0,
            p: 0.6,
            padding: Some(padding),
            priced_padded,
        };
        serve(&case, |_, rows| ms(rows))
    };
    for sequences in [6, 8, 12, 50, 56, 60, 64, 72] {
        let plain = sequences as f64 / ms(padding.rows(sequences, sequences, 1));
        let (smooth, padded) = (run(sequences, false), run(sequences, true));
        let case = format!("{sequences} sequences: plain {plain:.3}, smooth prices {smooth:.3}, padded {padded:.3}");
        assert!(padded >= 0.985 * smooth && padded >= 0.99 * plain, "{case}");
        if [60, 72].contains(&sequences) {
            assert!(padded >= 1.005 * smooth && padded >= 1.01 * plain, "free rows are taken: {case}");
        }
    }
}

#[test]
fn drafting_that_pays_alone_is_not_done_for_a_full_batch() {
    // A drafter whose call (0.5 ms) pays for one sequence (8 rows cost 1.0 ms against 0.56 for one), but holds up a
    // step of 32 sequences that takes 2.4 ms: drafting for all of them runs at under half of plain speed.
    let batch_ms = |rows: usize| 0.5 + 0.06 * rows as f64;
    let plain_alone = 1.0 / batch_ms(1);
    let alone = serve_batch(PolicyMode::Adaptive, 1, 400, 0.5, 0.9, batch_ms);
    assert!(alone >= 1.05 * plain_alone, "one sequence: adaptive {alone:.3} vs plain {plain_alone:.3} tok/ms");
    let plain_batch = 32.0 / batch_ms(32);
    let batch = serve_batch(PolicyMode::Adaptive, 32, 400, 0.5, 0.9, batch_ms);
    assert!(batch >= 0.95 * plain_batch, "32 sequences: adaptive {batch:.3} vs plain {plain_batch:.3} tok/ms");
    let fixed = serve_batch(PolicyMode::Fixed, 32, 400, 0.5, 0.9, batch_ms);
    assert!(fixed < 0.5 * plain_batch, "the case is real: drafting every round gives {fixed:.3} tok/ms");
}

#[test]
fn a_drafting_server_is_never_slower_than_a_plain_one() {
    // Step costs of the H200 default model (0.6 ms plus 0.05 a row, a step of 64 rows 3.7 ms) and of a CPU (10 ms
    // plus 1.5 a row); drafting calls from free to 3 plain steps; acceptance from poor to excellent; 1 to 64
    // sequences. Once the lanes have learned (the first rounds' trials and probes are the price of learning), adaptive
    // rounds keep at least 97% of plain speed in every case.
    let gpu = |rows: usize| 0.6 + 0.05 * rows as f64;
    let cpu = |rows: usize| 10.0 + 1.5 * rows as f64;
    let curves: [(&str, &dyn Fn(usize) -> f64); 2] = [("gpu", &gpu), ("cpu", &cpu)];
    for (name, batch_ms) in curves {
        let one_step = batch_ms(1);
        for sequences in [1, 8, 64] {
            let plain = sequences as f64 / batch_ms(sequences);
            for draft_steps in [0.0, 0.3, 3.0] {
                for p in [0.2, 0.6, 0.9] {
                    let rate = serve_batch(PolicyMode::Adaptive, sequences, 1500, draft_steps * one_step, p, batch_ms);
                    assert!(
                        rate >= 0.97 * plain,
                        "{name}, {sequences} sequences, drafting {draft_steps} steps, p {p}: {rate:.4} vs plain \
                         {plain:.4} tok/ms"
                    );
                }
            }
        }
    }
}

#[test]
fn cheap_accurate_drafting_still_pays_in_a_batch() {
    // A drafter on the device (a tenth of a step a call) right 90% of the time, 8 sequences on the GPU curve:
    // the step's rows are cheap beside its fixed cost, so rounds widen and the step commits more per ms (full
    // blocks every round would give 1.33x).
    let gpu = |rows: usize| 0.6 + 0.05 * rows as f64;
    let plain = 8.0 / gpu(8);
    let rate = serve_batch(PolicyMode::Adaptive, 8, 400, 0.065, 0.9, gpu);
    assert!(rate >= 1.2 * plain, "adaptive {rate:.3} vs plain {plain:.3} tok/ms");
}

#[test]
fn probes_space_out_with_the_sequences_they_hold_up() {
    let mut costs = CostTable::new(8);
    costs.seed(&[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7]);
    costs.observe_draft(LaneKind::Oracle, 0.5);
    let pause = |sequences: usize| {
        let mut table = costs.clone();
        table.begin_step(sequences);
        let mut policy = RoundPolicy::new(PolicyMode::Adaptive, LaneKind::Oracle, 7);
        policy.backoff.defer(policy.probe_spacing(&table, 100));
        policy.backoff().owed()
    };
    let (one, many) = (pause(1), pause(16));
    assert!(many > 4 * one, "owed plain rounds: {one} alone, {many} in a step of 16");
}

#[test]
fn a_drafter_that_cannot_pay_even_when_always_right_is_never_probed() {
    // A drafting call of 20 plain steps (a drafter on the host beside a fast GPU target): even 8 tokens a round
    // lose, so once the call's cost is known the lane stays plain, probes included.
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, dense, 200.0);
    for _ in 0..SETTLED_DRAFT_SAMPLES {
        sim.costs.observe_draft(LaneKind::Oracle, 200.0);
    }
    let w = widths(&mut sim, 0.95, 400);
    assert!(w.iter().all(|&r| r == 1), "drafted rounds: {:?}", w.iter().filter(|&&r| r > 1).count());
    let plain_rate = 1.0 / dense(1);
    assert!(sim.rate() >= 0.999 * plain_rate, "adaptive {:.5} vs plain {plain_rate:.5} tok/ms", sim.rate());
}

#[test]
fn a_slow_first_drafting_call_does_not_lock_a_lane_kind_out() {
    // A first call of 300 ms (one-time set-up), then 2 ms calls on a 10 ms step, drafts right 90% of the time: once
    // the later calls are measured the lane drafts again (the fastest call, not the average, decides that no round
    // could pay).
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, dense, 2.0);
    sim.costs.observe_draft(LaneKind::Oracle, 300.0);
    widths(&mut sim, 0.9, 4000);
    let late = widths(&mut sim, 0.9, 1000);
    let drafted = late.iter().filter(|&&r| r > 1).count();
    assert!(drafted >= 800, "drafted rounds in the last 1000: {drafted}");
}

/// The default model on a 2-core AVX2 CPU (ms by verify rows, the lanes benchmark's round-cost probe).
fn cpu(rows: usize) -> f64 {
    [5.8, 9.3, 14.2, 17.0, 19.6, 21.7, 24.6, 28.0][rows - 1]
}

/// A lane whose 4.5 ms drafting call sits beside [`cpu`]'s steps, on an engine whose earlier requests found its
/// drafts right a third of the time.
fn beside_a_weak_drafter() -> Sim {
    let mut sim = Sim::new(PolicyMode::Adaptive, 7, cpu, 4.5);
    for _ in 0..SETTLED_DRAFT_SAMPLES {
        sim.costs.observe_draft(LaneKind::Oracle, 4.5);
    }
    for i in 0..60 {
        sim.costs.observe_acceptance(LaneKind::Oracle, 1, usize::from(i % 3 == 0));
    }
    sim
}

/// Probes per 128-token request and the rate over eight such requests [`beside_a_weak_drafter`].
fn requests_beside_a_weak_drafter() -> (f64, f64) {
    let mut sim = beside_a_weak_drafter();
    let mut drafted = 0;
    for _ in 0..8 {
        sim.policy = RoundPolicy::new(PolicyMode::Adaptive, LaneKind::Oracle, 7);
        drafted += widths(&mut sim, 0.35, 128).iter().filter(|&&r| r > 1).count();
    }
    (drafted as f64 / 8.0, sim.rate())
}

#[test]
fn a_lane_kind_that_pays_only_far_above_its_typical_acceptance_probes_at_the_widest_spacing() {
    // Drafts right a third of the time pay at no width here; even right two thirds of the time they would not. Probes
    // from the narrowest spacing cost 3-4 a request (4% of plain speed); from the widest, one.
    let (probes, rate) = requests_beside_a_weak_drafter();
    assert!(probes <= 1.5, "probes per request: {probes}");
    let plain_rate = 1.0 / cpu(1);
    assert!(rate >= 0.985 * plain_rate, "adaptive {rate:.5} vs plain {plain_rate:.5} tok/ms");
}

#[test]
fn short_requests_cannot_freeze_a_lane_kinds_typical_acceptance() {
    // Requests of 40 tokens never reach a probe the widest spacing (69 rounds here) puts off. Once the kind's typical
    // has gone two such spacings unverified, lanes learn from the narrowest spacing again: probes go on, about one
    // per two widest spacings, so the typical follows the traffic.
    let mut sim = beside_a_weak_drafter();
    let mut probes = 0;
    for _ in 0..60 {
        sim.policy = RoundPolicy::new(PolicyMode::Adaptive, LaneKind::Oracle, 7);
        probes += widths(&mut sim, 0.35, 40).iter().filter(|&&r| r > 1).count();
    }
    assert!((10..=60).contains(&probes), "probes over 2,400 rounds: {probes}");
}
