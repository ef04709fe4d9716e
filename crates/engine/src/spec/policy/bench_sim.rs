//! The H200 round-policy table in simulation, run and read as `dflash bench lanes` runs and reads it
//! (docs/BENCHMARKS.md, "The round policy on a sparse hybrid target").
//!
//! Per cell, each simulated engine is a fresh cost table seeded by the start-up probe at a short context; its
//! prompts (128 tokens each) go through the benchmark's five lanes in its order (plain, one draft, fixed 4, fixed
//! 8, adaptive on a block of 8), every lane a fresh policy of the one lane kind, whose typical acceptance the
//! engine's table carries from lane to lane. Steps cost the round ladder the engine measured in that table's run
//! (ms by rows, the middle of its range; 5 and 7 rows interpolated) times a factor drawn uniformly from 1 ± 5% (the
//! round trace's spread).
//!
//! The drafts are the oracle lane's: whether draft `j` of a round at position `p` is right is a pure function of
//! the prompt's seed, `p` and `j`, so every lane of a prompt sees the same drafts (`spec/oracle.rs`). The pooled
//! rate of many engines is what the policy achieves in expectation. The benchmark reads one engine per cell: the
//! median over its prompts of each lane's decode rate, its draws fixed by the prompts' seeds, so a rerun of one
//! build reads the same draws again. That reading is printed too, as its spread over the simulated engines.

use super::tests::Rng;
use super::*;
use crate::engine::round_costs::median;
use crate::spec::oracle;

/// The table's cells: context (a document of 1K, 8K or 32K tokens and the prompt), prompts per cell (one at 32K,
/// whose prefill takes 14 s), and the round ladder the engine measured there (PERFORMANCE.md entry 21's build).
const CELLS: [(usize, usize, [f64; 8]); 3] = [
    (1100, 4, [2.15, 2.94, 3.68, 4.28, 4.84, 5.40, 6.085, 6.77]),
    (8300, 4, [2.31, 3.23, 4.08, 4.77, 5.505, 6.24, 6.92, 7.60]),
    (33000, 1, [3.06, 4.605, 5.865, 6.945, 8.05, 9.16, 10.225, 11.29]),
];
/// The oracle's acceptance profiles: conditional acceptance by draft position.
const PROFILES: [(&str, [f64; 7]); 3] = [
    ("high", [0.9, 0.85, 0.8, 0.75, 0.7, 0.7, 0.7]),
    ("mid", [0.8, 0.6, 0.5, 0.4, 0.4, 0.4, 0.4]),
    ("low", [0.5, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1]),
];
/// The benchmark's lanes: (mode, drafts per round).
const LANES: [(PolicyMode, usize); 5] = [
    (PolicyMode::Fixed, 0),
    (PolicyMode::Fixed, 1),
    (PolicyMode::Fixed, 3),
    (PolicyMode::Fixed, 7),
    (PolicyMode::Adaptive, 7),
];
const ADAPTIVE: usize = 4;
const MAX_TOKENS: usize = 128;
const DRAFT_MS: f64 = 0.02;
const MAX_PROMPTS: usize = 4;

/// Whether the oracle's draft `j` of the round at `position` is right, for a prompt keyed `key`: the oracle lane's
/// own draw.
fn draft_right(key: u64, position: usize, j: usize, acceptance: f64) -> bool {
    oracle::unit(oracle::mix(key, position as u64, j as u64)) < acceptance as f32
}

/// One engine of a cell: its shared cost table, the real ladder, the drafts' acceptance by position and their
/// drafting cost, the timing noise, and what its lanes did.
pub(super) struct Engine {
    costs: CostTable,
    ladder: Vec<f64>,
    accept: Vec<f64>,
    draft_ms: f64,
    context: usize,
    noise: Rng,
    /// Per lane: tokens and ms over every prompt, and each prompt's decode rate (tokens per ms).
    tokens: [f64; 5],
    ms: [f64; 5],
    rates: [[f64; MAX_PROMPTS]; 5],
    /// The adaptive lane's rounds by verify rows.
    widths: [usize; 9],
}

impl Engine {
    /// An engine of the table's cells: its probe ran on the 1K cell's ladder, its drafts cost [`DRAFT_MS`].
    fn new(ladder: [f64; 8], accept: [f64; 7], context: usize, seed: u64) -> Self {
        Self::of(&ladder, &CELLS[0].2, &accept, DRAFT_MS, context, seed)
    }

    /// An engine whose steps cost `ladder` (ms by rows), whose start-up probe timed steps a little faster than
    /// `probed` (it times the forward alone at a short context), whose drafts cost `draft_ms` and land with
    /// conditional probability `accept` by position.
    pub(super) fn of(ladder: &[f64], probed: &[f64], accept: &[f64], draft_ms: f64, context: usize, seed: u64) -> Self {
        let mut costs = CostTable::new(ladder.len());
        costs.seed(&probed.iter().map(|ms| ms - 0.2).collect::<Vec<_>>());
        let noise = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5851_f42d);
        let (tokens, ms, rates, widths) = ([0.0; 5], [0.0; 5], [[0.0; MAX_PROMPTS]; 5], [0; 9]);
        let (ladder, accept) = (ladder.to_vec(), accept.to_vec());
        Engine { costs, ladder, accept, draft_ms, context, noise, tokens, ms, rates, widths }
    }

    /// A step of `rows` rows: its time, fed to the table.
    fn step(&mut self, rows: usize) -> f64 {
        let ms = self.ladder[rows - 1] * (1.0 + 0.05 * (2.0 * self.noise.uniform() - 1.0));
        self.costs.observe(self.context, rows, ms);
        ms
    }

    /// One round of `policy` at `generated` tokens (at most `cap` drafts) for the prompt keyed `key`: its verify
    /// rows, the tokens it committed and its ms.
    pub(super) fn round(
        &mut self,
        policy: &mut RoundPolicy,
        key: u64,
        generated: usize,
        cap: usize,
    ) -> (usize, usize, f64) {
        if let RoundPlan::Plain = policy.plan(&self.costs, self.context, cap) {
            return (1, 1, self.step(1));
        }
        let draft_ms = self.draft_ms;
        self.costs.observe_draft(LaneKind::Oracle, draft_ms);
        let keep = policy.choose(&self.costs, self.context, cap, None, draft_ms).drafts;
        if keep == 0 {
            return (1, 1, draft_ms + self.step(1));
        }
        let accepted = (0..keep).take_while(|&j| draft_right(key, generated, j, self.accept[j])).count();
        policy.record_verified(&mut self.costs, keep, accepted, None);
        let ms = draft_ms + self.step(keep + 1);
        policy.record_round(&self.costs, self.context, RoundTiming::alone(&self.costs, self.context, accepted + 1, ms));
        (keep + 1, accepted + 1, ms)
    }

    /// Prompt `prompt` (keyed `key`) on lane `lane`: the prompt's pass gives the first token, rounds the rest.
    fn request(&mut self, lane: usize, prompt: usize, key: u64) {
        let (mode, max_drafts) = LANES[lane];
        let mut policy = RoundPolicy::new(mode, LaneKind::Oracle, max_drafts);
        let (mut generated, mut ms) = (1, 0.0);
        while generated < MAX_TOKENS {
            let cap = max_drafts.min(MAX_TOKENS - generated - 1);
            let (rows, tokens, took) = self.round(&mut policy, key, generated, cap);
            generated += tokens;
            ms += took;
            if lane == ADAPTIVE {
                self.widths[rows] += 1;
            }
        }
        let decoded = (generated - 1) as f64;
        self.tokens[lane] += decoded;
        self.ms[lane] += ms;
        self.rates[lane][prompt] = decoded / ms;
    }

    /// The benchmark's reading of this engine: the adaptive lane's median decode rate over `prompts` against the
    /// better of the fixed blocks' and against plain's, each minus 1.
    fn reading(&self, prompts: usize) -> (f64, f64) {
        let lane_median = |lane: usize| median(&mut self.rates[lane][..prompts].to_vec());
        let adaptive = lane_median(ADAPTIVE);
        (adaptive / lane_median(2).max(lane_median(3)) - 1.0, adaptive / lane_median(0) - 1.0)
    }
}

/// One cell over many engines: tokens per ms of each lane pooled, the adaptive lane's rounds by rows, and each
/// engine's reading against the better fixed block and against plain (each sorted).
struct Cell {
    context: usize,
    profile: &'static str,
    rates: [f64; 5],
    widths: [usize; 9],
    vs_fixed: Vec<f64>,
    vs_plain: Vec<f64>,
}

impl Cell {
    fn run(
        context: usize,
        prompts: usize,
        ladder: [f64; 8],
        (profile, accept): (&'static str, [f64; 7]),
        seeds: u64,
    ) -> Self {
        let (mut tokens, mut ms, mut widths) = ([0.0; 5], [0.0; 5], [0usize; 9]);
        let (mut vs_fixed, mut vs_plain) = (Vec::new(), Vec::new());
        for seed in 0..seeds {
            let mut engine = Engine::new(ladder, accept, context, seed);
            for prompt in 0..prompts {
                let key = seed * MAX_PROMPTS as u64 + prompt as u64 + 1;
                for lane in 0..LANES.len() {
                    engine.request(lane, prompt, key);
                }
            }
            for lane in 0..LANES.len() {
                tokens[lane] += engine.tokens[lane];
                ms[lane] += engine.ms[lane];
            }
            widths.iter_mut().zip(engine.widths).for_each(|(w, e)| *w += e);
            let (fixed, plain) = engine.reading(prompts);
            vs_fixed.push(fixed);
            vs_plain.push(plain);
        }
        vs_fixed.sort_by(f64::total_cmp);
        vs_plain.sort_by(f64::total_cmp);
        let rates = std::array::from_fn(|lane| tokens[lane] / ms[lane]);
        Cell { context, profile, rates, widths, vs_fixed, vs_plain }
    }

    /// The readings' median, p10 and p90 and the share below −3%, as text.
    fn spread(readings: &[f64]) -> String {
        let at = |q: f64| 100.0 * readings[((readings.len() - 1) as f64 * q).round() as usize];
        let below = readings.iter().filter(|&&r| r < -0.03).count() as f64 / readings.len() as f64;
        format!("{:+.1}% (p10 {:+.1}%, p90 {:+.1}%, below -3%: {:.0}%)", at(0.5), at(0.1), at(0.9), 100.0 * below)
    }

    fn print(&self) {
        let [plain, one, fixed4, fixed8, adaptive] = self.rates;
        let best = fixed4.max(fixed8);
        println!(
            "{:>5} {:<4} plain {plain:.4} one {one:.4} fixed4 {fixed4:.4} fixed8 {fixed8:.4} adaptive {adaptive:.4} \
             ({:+.1}% vs best fixed, {:+.1}% vs plain) rows {:?}",
            self.context,
            self.profile,
            100.0 * (adaptive / best - 1.0),
            100.0 * (adaptive / plain - 1.0),
            &self.widths[1..],
        );
        let (fixed, plain) = (Self::spread(&self.vs_fixed), Self::spread(&self.vs_plain));
        println!("      one engine reads {fixed} vs best fixed, {plain} vs plain");
    }
}

/// The goal (docs/BENCHMARKS.md): adaptive within 3% of the better of fixed 4 and 8 in every cell, and of plain.
/// Pooled over engines the policy meets it (2,000 engines per cell, PERFORMANCE.md entry 39: −1.1%, −1.8% and −2.7%
/// at high acceptance at 1K, 8K and 32K; mid and low above the fixed blocks, low within 0.2% of plain or above).
/// One engine's reading spreads around that (p10 −4.8% and −5.3% at 1K and 8K, −9.7% at 32K with its one prompt),
/// which is where the H200's −4% to −6% at high acceptance lie: the goal is asserted on the pooled rates. Before
/// deeper positions leaned on their prior ([`acceptance`]'s `DEEP_PRIOR_WEIGHT`), an earlier form of this
/// simulation had the high cells at −2.2% (1K) and −2.8% (8K). `BENCH_SEEDS` (engines per cell, default 1,000) for
/// tuning, with `--nocapture`.
#[test]
fn the_h200_bench_table_in_simulation() {
    let seeds = std::env::var("BENCH_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let mut misses = Vec::new();
    for (context, prompts, ladder) in CELLS {
        for profile in PROFILES {
            let cell = Cell::run(context, prompts, ladder, profile, seeds);
            cell.print();
            let [plain, _, fixed4, fixed8, adaptive] = cell.rates;
            if adaptive < 0.97 * fixed4.max(fixed8) || adaptive < 0.97 * plain {
                misses.push((context, profile.0));
            }
        }
    }
    assert!(misses.is_empty(), "adaptive more than 3% behind in {misses:?}");
}
