//! What a round costs on this target and device: milliseconds per step by the step's rows and context length.
//!
//! One table per engine (one target on one device), shared by every lane. A cell is a whole step of `rows` rows,
//! whichever sequences they belong to: one sequence verifying 8 rows and 8 sequences decoding one each read the
//! weights alike, and a lane's extra verify rows cost the step what moving from its rows to the wider cell costs,
//! scaled in a step of many sequences by what such steps measured against the cells (`extra_rows`): the cells learn
//! from plain steps and a lone sequence's rounds.
//! Each context bucket models a step as `level x shape[rows]`: the level is how fast the machine runs right now,
//! the shape how much each extra row adds relative to it. A start-up probe gives the first shape (ms for 1..B rows
//! at a short context); steps wider than any cell extend the shape along its last segment. The bucket's most measured width (its anchor) moves the level quickly; every other width
//! learns its own shape cell slowly against that level. Both are clamped moving averages: a shared machine that
//! slows down for a while slows every width alike, and one stalled step must not rewrite the table. A width's
//! first few rounds price it by their middle one, so one slow round among them does not price it out. A bucket
//! nobody has measured yet borrows the nearest measured one below it. The table also keeps, per lane kind (`pld`,
//! `dflash2`, ...), what drafting costs and how often its drafts are typically accepted by position: properties
//! of the drafter on this target and device like the verify costs, so a new sequence's lane knows them from its
//! first round.

use std::fmt::Write;

use dflash_models::StepPadding;

use super::acceptance::PositionAcceptance;
use super::extra_rows::ExtraRowFactors;
use super::outlook::{RoundShare, StepOutlook};
use crate::spec::LaneKind;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// Upper bounds (exclusive, in tokens of context) of the context buckets; the last one is open.
pub const CONTEXT_BUCKETS: [usize; 5] = [1024, 4096, 16384, 65536, usize::MAX];
/// Weight of a new measurement in the level, and in a width's shape, once settled.
const LEVEL_WEIGHT: f64 = 0.2;
const SHAPE_WEIGHT: f64 = 0.05;
/// Measurements the level takes as a running mean (a width's shape: the middle of them), with a wide clamp,
/// before the moving averages take over.
const YOUNG_SAMPLES: usize = 4;
/// A measurement is clamped to these factors of what the table expected (young, settled).
const YOUNG_CLAMP: (f64, f64) = (0.5, 2.0);
const SETTLED_CLAMP: (f64, f64) = (0.8, 1.25);
/// Before any probe or measurement: a dense target where each verify row adds a tenth of a plain step.
const PRIOR_PLAIN_MS: f64 = 10.0;
const PRIOR_ROW_SLOPE: f64 = 0.1;
/// Costs are never taken below this (a zero would make every rate infinite).
const MIN_MS: f64 = 1e-3;
/// The widest step a bucket keeps a cell for; wider ones are priced along the last segment and not learned.
const MAX_STEP_ROWS: usize = 8192;

/// Milliseconds per step by rows and context bucket.
#[derive(Clone, Debug, PartialEq)]
pub struct CostTable {
    /// What buckets start from: the probe's curve, or the prior.
    start: Bucket,
    /// Whether `start` was measured on this target (the probe ran).
    probed: bool,
    /// Per context bucket; `None` until measured.
    buckets: Vec<Option<Bucket>>,
    /// Per lane kind: ms of a drafting call (moving average) and how many were measured.
    lanes: Vec<LaneRecord>,
    /// The widest round a lane may verify (the start curve's cells; the probe times these).
    widest_round: usize,
    /// The step being drafted for.
    step: StepOutlook,
    /// Steps begun so far ([`Self::begin_step`]).
    steps_begun: u64,
    /// What rows past one a sequence cost steps of many sequences against the cells' price ([`Self::step_cost`]).
    extra_rows: ExtraRowFactors,
    /// The graph buckets the target pads steps to: plain steps are kept and priced at their padded rows, and
    /// verify rows up to them are free (`None`: a step runs its own rows).
    padding: Option<StepPadding>,
}

/// What the engine knows of one lane kind across its sequences.
#[derive(Clone, Debug, PartialEq)]
struct LaneRecord {
    kind: LaneKind,
    /// Moving average of a drafting call (ms), how many were measured, and the fastest.
    draft_ms: f64,
    draft_samples: u64,
    fastest_draft_ms: f64,
    /// Conditional acceptance by draft position over every sequence's verified rounds.
    acceptance: PositionAcceptance,
    /// Steps in which a lane of this kind ran a round ([`CostTable::count_armed_step`]), the step last counted, and
    /// the count when a round of this kind was last verified: the clock its typical's staleness is read on.
    armed_steps: u64,
    last_armed_step: Option<u64>,
    verified_at_armed_step: u64,
}

/// One context bucket: a step of `r` rows costs `level * shape[r - 1]` ms.
#[derive(Clone, Debug, PartialEq)]
struct Bucket {
    level: f64,
    /// Relative to the level (`shape[0]` starts at 1).
    shape: Vec<f64>,
    /// Measured steps by rows.
    samples: Vec<u64>,
    /// The first measurements of each width, relative to the level (those below `samples[r]` are set).
    young: Vec<[f64; YOUNG_SAMPLES]>,
}

impl Bucket {
    /// A bucket following the curve `ms_by_rows` (at least one positive entry).
    fn from_curve(ms_by_rows: &[f64]) -> Self {
        let level = ms_by_rows[0].max(MIN_MS);
        let rows = ms_by_rows.len();
        let shape = ms_by_rows.iter().map(|m| m / level).collect();
        Bucket { level, shape, samples: vec![0; rows], young: vec![[0.0; YOUNG_SAMPLES]; rows] }
    }

    fn cost(&self, r: usize) -> f64 {
        (self.level * self.shape_at(r)).max(MIN_MS)
    }

    /// The shape of `r + 1` rows: a cell's, or past the last cell along the last segment.
    fn shape_at(&self, r: usize) -> f64 {
        let last = self.shape.len() - 1;
        if r <= last {
            return self.shape[r];
        }
        let slope = if last > 0 { (self.shape[last] - self.shape[last - 1]).max(0.0) } else { 0.0 };
        self.shape[last] + slope * (r - last) as f64
    }

    /// Cells up to `r` (extended along the last segment, unmeasured).
    fn extend_to(&mut self, r: usize) {
        while self.shape.len() <= r {
            let next = self.shape_at(self.shape.len());
            self.shape.push(next);
            self.samples.push(0);
            self.young.push([0.0; YOUNG_SAMPLES]);
        }
    }

    fn observe(&mut self, r: usize, ms: f64) {
        self.extend_to(r);
        let n = self.samples[r];
        self.samples[r] = n + 1;
        // The bucket's most measured width (the anchor) moves the level and keeps its shape; every other width
        // learns its shape against that level. Were a width's shape error, while it learns, let into the level,
        // it would reach every width's price: a lane running 3 rows priced 5% low would see 4 rows 5% dear and
        // keep choosing 3.
        let young = usize::try_from(n).ok().filter(|&i| i < YOUNG_SAMPLES);
        if self.samples.iter().all(|&s| s <= n + 1) {
            self.level = blend(self.level, ms / self.shape[r].max(MIN_MS), n, LEVEL_WEIGHT);
            if let Some(i) = young {
                self.young[r][i] = self.shape[r];
            }
            return;
        }
        let relative = ms / self.level;
        self.shape[r] = match young {
            // A young width is priced by the middle of its first rounds (the lower one of an even count): one
            // slow round among them (a stall) would lift a mean for good, and a lane would stop trying the width.
            Some(i) => {
                let (lo, hi) = YOUNG_CLAMP;
                self.young[r][i] = relative.clamp(self.shape[r] * lo, self.shape[r] * hi);
                let mut first = self.young[r];
                first[..=i].sort_by(f64::total_cmp);
                first[i / 2]
            }
            None => blend(self.shape[r], relative, n, SHAPE_WEIGHT),
        };
    }
}

/// `current` moved toward `x` (clamped around it): a running mean while `n` (samples behind it) is young, then a
/// moving average of weight `settled`.
fn blend(current: f64, x: f64, n: u64, settled: f64) -> f64 {
    let ((lo, hi), weight) =
        if n < YOUNG_SAMPLES as u64 { (YOUNG_CLAMP, 1.0 / (n + 1) as f64) } else { (SETTLED_CLAMP, settled) };
    current + weight * (x.clamp(current * lo, current * hi) - current)
}

/// One context bucket of the table, for metrics and logs: the cells of every width a lane may verify, and the
/// measured ones past them (batched steps).
#[derive(Clone, Debug, PartialEq)]
pub struct BucketView {
    /// Contexts below this many tokens (`None`: the open last bucket).
    pub context_below: Option<usize>,
    /// The cells' rows, ascending.
    pub rows: Vec<usize>,
    /// ms of each cell.
    pub ms: Vec<f64>,
    /// Measured steps of each cell.
    pub samples: Vec<u64>,
}

/// The bucket index of a context length.
pub fn bucket_of(context: usize) -> usize {
    CONTEXT_BUCKETS.iter().position(|&bound| context < bound).unwrap_or(CONTEXT_BUCKETS.len() - 1)
}

impl CostTable {
    /// A table for rounds of up to `widest_round` verify rows (at least 1), holding the prior until probed.
    pub fn new(widest_round: usize) -> Self {
        let widest_round = widest_round.max(1);
        let prior: Vec<f64> = (0..widest_round).map(|r| PRIOR_PLAIN_MS * (1.0 + PRIOR_ROW_SLOPE * r as f64)).collect();
        let buckets = vec![None; CONTEXT_BUCKETS.len()];
        let start = Bucket::from_curve(&prior);
        let step = StepOutlook::default();
        CostTable {
            start,
            probed: false,
            buckets,
            lanes: Vec::new(),
            widest_round,
            step,
            steps_begun: 0,
            extra_rows: ExtraRowFactors::default(),
            padding: None,
        }
    }

    /// This table for a target that pads its steps to `padding`'s graph buckets (`Target::step_padding`): a plain
    /// step of `n` sequences costs the cell of the rows its graph runs, and verify rows up to them cost the step
    /// nearly nothing (60 sequences and 3 verify rows run as 64: +0.07 ms on an H100, PERFORMANCE.md entry 120);
    /// past them, rows cost the cells' slope scaled by the batch size's factor, as without padding, which
    /// spreads a bucket's jump over the rows that fill it. `DFLASH_PADDED_PRICES=0` leaves it out.
    pub fn with_padding(mut self, padding: Option<StepPadding>) -> Self {
        self.padding = padding.filter(|_| !dflash_runtime::switches::switches().no_padded_prices);
        self
    }

    /// Rows the target runs for a plain step of `sequences` sequences (its graph's padded rows).
    fn plain_rows(&self, sequences: usize) -> usize {
        self.padding.map_or(sequences, |p| p.rows(sequences, sequences, 1))
    }

    /// Rows a step of `sequences` sequences with verify rows runs without paying for them: the plain step's padded
    /// rows where such steps replay graphs too ([`StepPadding::mixed`]), else none past the sequences (such a step
    /// runs eagerly, unpadded).
    fn free_rows(&self, sequences: usize) -> usize {
        match self.padding {
            Some(p) if p.mixed => self.plain_rows(sequences),
            _ => sequences,
        }
    }

    /// A new table for rounds of up to `rows` verify rows, or this one's widest if wider, for the same target (its
    /// padding kept); nothing measured carries over.
    pub fn widened(&self, rows: usize) -> Self {
        CostTable { padding: self.padding, ..CostTable::new(self.widest_round.max(rows)) }
    }

    /// Starts the step of `sequences` decoding sequences the lanes are about to draft for (the engine).
    pub fn begin_step(&mut self, sequences: usize) {
        self.step = StepOutlook::of(sequences);
        self.steps_begun += 1;
    }

    /// Marks the step being drafted for as one whose drafts without a drafter pass would be held back (the engine,
    /// from its drafts gate).
    pub fn hold_back_drafts(&mut self) {
        self.step.drafts_held_back = true;
    }

    /// Adds a lane's round to the step being drafted for (the engine, after each lane drafted).
    pub fn add_to_step(&mut self, round: RoundShare) {
        self.step.add(round);
    }

    /// The step being drafted for (a lone sequence's until the engine says otherwise).
    pub fn step(&self) -> StepOutlook {
        self.step
    }

    /// Widest round a lane may verify.
    pub fn widest_round(&self) -> usize {
        self.widest_round
    }

    /// Whether a probe seeded the table.
    pub fn is_probed(&self) -> bool {
        self.probed
    }

    /// Seeds the curve every bucket starts from with a probe: `ms_by_rows[r - 1]` is a step of `r` rows at a short
    /// context. Rows past the probe's are extrapolated along its last segment. Ignored when empty or not all
    /// positive and finite.
    pub fn seed(&mut self, ms_by_rows: &[f64]) {
        if ms_by_rows.is_empty() || !ms_by_rows.iter().all(|m| m.is_finite() && *m > 0.0) {
            return;
        }
        let n = ms_by_rows.len().min(self.widest_round);
        let last = ms_by_rows[n - 1];
        let slope = if n >= 2 { (last - ms_by_rows[n - 2]).max(0.0) } else { 0.0 };
        let curve: Vec<f64> = (0..self.widest_round)
            .map(|r| ms_by_rows.get(r).copied().unwrap_or_else(|| last + slope * (r + 1 - n) as f64))
            .collect();
        self.start = Bucket::from_curve(&curve);
        self.probed = true;
    }

    /// Feeds a measured step of `rows` rows in all at `context` tokens that took `ms`.
    pub fn observe(&mut self, context: usize, rows: usize, ms: f64) {
        if rows == 0 || rows > MAX_STEP_ROWS || !(ms.is_finite() && ms > 0.0) {
            return;
        }
        let b = bucket_of(context);
        let bucket = match self.buckets[b].take() {
            Some(bucket) => bucket,
            // A new context range: start from the curve below, with nothing measured here yet.
            None => {
                let below = self.fallback(b);
                let cells = below.shape.len();
                Bucket { samples: vec![0; cells], young: vec![[0.0; YOUNG_SAMPLES]; cells], ..below.clone() }
            }
        };
        self.buckets[b].insert(bucket).observe(rows - 1, ms);
    }

    /// Feeds a measured step of `sequences` decoding sequences and `rows` rows in all at `context` tokens that took
    /// `ms`. A plain step feeds the cell of the rows its graph runs, a lone sequence's the cell of its rows
    /// ([`Self::observe`]); a step of many sequences with verify rows feeds its batch size's factor on the cells'
    /// price of those rows ([`Self::step_cost`]).
    pub fn observe_step(&mut self, context: usize, sequences: usize, rows: usize, ms: f64) {
        let sequences = sequences.max(1);
        if sequences == 1 || rows <= sequences {
            let rows = if rows == sequences { self.plain_rows(sequences) } else { rows };
            return self.observe(context, rows, ms);
        }
        if rows > MAX_STEP_ROWS || !(ms.is_finite() && ms > 0.0) {
            return;
        }
        self.extra_rows.observe(
            sequences,
            ms - self.plain_cost(context, sequences),
            self.extra_price(context, sequences, rows),
        );
    }

    /// Expected ms of a step of `rows` rows in all (at least 1) at `context` tokens, by the cells alone: a plain
    /// step of that many sequences, or a lone sequence verifying that many rows.
    pub fn cost(&self, context: usize, rows: usize) -> f64 {
        let b = bucket_of(context);
        self.buckets[b].as_ref().unwrap_or_else(|| self.fallback(b)).cost(rows.max(1) - 1)
    }

    /// Expected ms of a plain step of `sequences` decoding sequences at `context` tokens (the cell of the rows its
    /// graph runs).
    pub fn plain_cost(&self, context: usize, sequences: usize) -> f64 {
        self.cost(context, self.plain_rows(sequences.max(1)))
    }

    /// Expected ms of a step of `sequences` decoding sequences and `rows` rows in all at `context` tokens: a plain
    /// step of the sequences, and the cells' price of the rows past the ones its graph runs anyway, scaled by what
    /// such steps of as many sequences measured.
    pub fn step_cost(&self, context: usize, sequences: usize, rows: usize) -> f64 {
        let sequences = sequences.max(1);
        if sequences == 1 || rows <= sequences {
            return if rows == sequences { self.plain_cost(context, sequences) } else { self.cost(context, rows) };
        }
        self.plain_cost(context, sequences)
            + self.extra_rows.factor(sequences) * self.extra_price(context, sequences, rows)
    }

    /// The cells' price of a step's rows past its free ones ([`Self::free_rows`]), before the batch's factor.
    fn extra_price(&self, context: usize, sequences: usize, rows: usize) -> f64 {
        let free = self.free_rows(sequences);
        (self.cost(context, rows.max(free)) - self.cost(context, free)).max(0.0)
    }

    /// Expected ms of the step being drafted for ([`Self::step`]) with a round of `rows` verify rows of one more
    /// lane (1: a plain row).
    pub fn step_cost_with(&self, context: usize, rows: usize) -> f64 {
        self.step_cost(context, self.step.sequences, self.step.rows - 1 + rows)
    }

    /// What `extra` verify rows add to a plain step of `sequences` sequences at `context` tokens (ms).
    pub fn added_cost(&self, context: usize, sequences: usize, extra: usize) -> f64 {
        self.step_cost(context, sequences, sequences + extra) - self.plain_cost(context, sequences)
    }

    /// Feeds a drafting call of lane kind `lane` that took `ms`.
    pub fn observe_draft(&mut self, lane: LaneKind, ms: f64) {
        if !(ms.is_finite() && ms >= 0.0) {
            return;
        }
        let kind = self.lane_mut(lane);
        kind.draft_ms = match kind.draft_samples {
            0 => ms,
            // Drafting times of microseconds (prompt lookup) jump by large factors: no clamp below a microsecond.
            n => blend(kind.draft_ms.max(1e-3), ms, n, LEVEL_WEIGHT),
        };
        kind.draft_samples += 1;
        kind.fastest_draft_ms = kind.fastest_draft_ms.min(ms);
    }

    /// Expected ms of a drafting call of lane kind `lane` (0 until one was measured).
    pub fn draft_cost(&self, lane: LaneKind) -> f64 {
        self.lane(lane).map_or(0.0, |k| k.draft_ms)
    }

    /// Drafting calls of lane kind `lane` measured so far.
    pub fn draft_samples(&self, lane: LaneKind) -> u64 {
        self.lane(lane).map_or(0, |k| k.draft_samples)
    }

    /// The fastest drafting call of lane kind `lane` measured (ms; 0 before any): unlike the average, a slow first
    /// call (one-time set-up) or a busy moment does not raise it.
    pub fn fastest_draft(&self, lane: LaneKind) -> f64 {
        self.lane(lane).filter(|k| k.draft_samples > 0).map_or(0.0, |k| k.fastest_draft_ms)
    }

    /// Drafting costs by lane kind (ms), of the kinds that drafted.
    pub fn draft_costs(&self) -> Vec<(LaneKind, f64)> {
        self.lanes.iter().filter(|k| k.draft_samples > 0).map(|k| (k.kind, k.draft_ms)).collect()
    }

    /// Feeds a verified round of lane kind `lane` (any sequence's) that drafted `drafted` and accepted `accepted`.
    pub fn observe_acceptance(&mut self, lane: LaneKind, drafted: usize, accepted: usize) {
        let record = self.lane_mut(lane);
        record.acceptance.record(drafted, accepted);
        record.verified_at_armed_step = record.armed_steps;
    }

    /// Counts the step begun last as one in which a lane of kind `lane` ran a round (once per step, however many
    /// of its lanes did).
    pub fn count_armed_step(&mut self, lane: LaneKind) {
        let step = self.steps_begun;
        let record = self.lane_mut(lane);
        if record.last_armed_step != Some(step) {
            record.last_armed_step = Some(step);
            record.armed_steps += 1;
        }
    }

    /// Steps with a lane of kind `lane` running rounds since one of its rounds was last verified (`None`: none ever
    /// was): how stale its typical acceptance is. Steps of other kinds and of plain requests do not count.
    pub fn steps_since_verified(&self, lane: LaneKind) -> Option<u64> {
        let record = self.lane(lane).filter(|k| k.acceptance.is_observed())?;
        Some(record.armed_steps - record.verified_at_armed_step)
    }

    /// The typical conditional acceptance of lane kind `lane`'s first `n` draft positions on this engine; `None`
    /// before any of its rounds was verified.
    pub fn typical_acceptance(&self, lane: LaneKind, n: usize) -> Option<Vec<f64>> {
        self.lane(lane).filter(|k| k.acceptance.is_observed()).map(|k| k.acceptance.conditionals(n, None))
    }

    fn lane(&self, lane: LaneKind) -> Option<&LaneRecord> {
        self.lanes.iter().find(|k| k.kind == lane)
    }

    fn lane_mut(&mut self, lane: LaneKind) -> &mut LaneRecord {
        let index = match self.lanes.iter().position(|k| k.kind == lane) {
            Some(index) => index,
            None => {
                let acceptance = PositionAcceptance::typical(self.widest_round.saturating_sub(1));
                let record = LaneRecord {
                    kind: lane,
                    draft_ms: 0.0,
                    draft_samples: 0,
                    fastest_draft_ms: f64::INFINITY,
                    acceptance,
                    armed_steps: 0,
                    last_armed_step: None,
                    verified_at_armed_step: 0,
                };
                self.lanes.push(record);
                self.lanes.len() - 1
            }
        };
        &mut self.lanes[index]
    }

    /// Whether the costs at `context` come from this target: measured in that bucket, or probed (the probe runs at
    /// a short context, so it speaks for the first bucket).
    pub fn is_calibrated(&self, context: usize) -> bool {
        let b = bucket_of(context);
        self.buckets[b].is_some() || (b == 0 && self.probed)
    }

    /// Every measured bucket, plus the first bucket once probed.
    pub fn buckets(&self) -> Vec<BucketView> {
        (0..self.buckets.len())
            .filter_map(|b| {
                let bucket = match &self.buckets[b] {
                    Some(bucket) => bucket,
                    None if b == 0 && self.probed => &self.start,
                    None => return None,
                };
                // Every bucket holds at least the widest round's cells (the start curve's); wider ones only grow.
                let cells: Vec<usize> =
                    (0..bucket.shape.len()).filter(|&r| r < self.widest_round || bucket.samples[r] > 0).collect();
                Some(BucketView {
                    context_below: CONTEXT_BUCKETS.get(b).copied().filter(|&c| c != usize::MAX),
                    rows: cells.iter().map(|r| r + 1).collect(),
                    ms: cells.iter().map(|&r| bucket.cost(r)).collect(),
                    samples: cells.iter().map(|&r| bucket.samples[r]).collect(),
                })
            })
            .collect()
    }

    /// The table as one log line: per bucket, ms by rows (a `*` marks widths measured there).
    pub fn summary(&self) -> String {
        let mut out = format!("[round-costs] probed={}", self.probed);
        for view in self.buckets() {
            let bound = view.context_below.map_or("inf".to_string(), |c| c.to_string());
            let _ = write!(out, " ctx<{bound}:");
            for ((rows, ms), n) in view.rows.iter().zip(&view.ms).zip(&view.samples) {
                let _ = write!(out, " {rows}={ms:.2}{}", if *n > 0 { "*" } else { "" });
            }
        }
        for (sequences, factor, _) in self.extra_rows.measured() {
            let _ = write!(out, " extra-rows[{sequences}+]={factor:.2}");
        }
        for (lane, ms) in self.draft_costs() {
            let _ = write!(out, " draft[{lane}]={ms:.2}");
        }
        for kind in self.lanes.iter().filter(|k| k.acceptance.is_observed()) {
            let typical = kind.acceptance.conditionals(kind.acceptance.len(), None);
            let shown: Vec<String> = typical.iter().map(|p| format!("{p:.2}")).collect();
            let _ = write!(out, " accept[{}]={}", kind.kind, shown.join(","));
        }
        out
    }

    /// What an unmeasured bucket `b` uses: the nearest measured bucket below it, else the start curve.
    fn fallback(&self, b: usize) -> &Bucket {
        self.buckets[..b].iter().rev().find_map(Option::as_ref).unwrap_or(&self.start)
    }
}

/// The engine's cost table as its lanes share it.
#[derive(Clone, Debug)]
pub struct SharedCosts(Arc<Mutex<CostTable>>);

impl SharedCosts {
    pub fn new(table: CostTable) -> Self {
        SharedCosts(Arc::new(Mutex::new(table)))
    }

    /// The table (a panic elsewhere while it was held leaves plain numbers behind, still usable).
    pub fn lock(&self) -> MutexGuard<'_, CostTable> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn buckets_split_at_their_bounds() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1023), 0);
        assert_eq!(bucket_of(1024), 1);
        assert_eq!(bucket_of(70_000), 4);
        assert_eq!(bucket_of(usize::MAX), 4);
    }

    #[test]
    fn the_probe_sets_the_shape_and_rows_past_it_follow_its_last_segment() {
        let mut t = CostTable::new(6);
        assert!(!t.is_calibrated(0));
        t.seed(&[10.0, 11.0, 13.0]);
        assert!(t.is_probed() && t.is_calibrated(0) && !t.is_calibrated(5000));
        let row: Vec<f64> = (1..=6).map(|r| t.cost(0, r)).collect();
        assert_eq!(row, vec![10.0, 11.0, 13.0, 15.0, 17.0, 19.0]);
        assert!(close(t.cost(0, 60), 127.0), "steps wider than the cells continue the last segment");
        t.seed(&[1.0, f64::NAN]);
        assert_eq!(t.cost(0, 1), 10.0, "a broken probe is ignored");
    }

    #[test]
    fn measurements_move_cells_and_unmeasured_cells_follow_their_level() {
        let mut t = CostTable::new(4);
        t.seed(&[10.0, 12.0, 14.0, 16.0]);
        for _ in 0..4 {
            t.observe(10, 1, 20.0);
        }
        assert!(close(t.cost(10, 1), 20.0), "young cells average: {}", t.cost(10, 1));
        assert!(close(t.cost(10, 3), 28.0), "an unmeasured cell scales with its bucket's level");
        // A longer context starts from the level below it, then learns its own.
        assert!(close(t.cost(2000, 2), 24.0));
        t.observe(2000, 2, 30.0);
        assert!(close(t.cost(2000, 2), 30.0));
        assert!(close(t.cost(2000, 4), 40.0));
        assert!(t.is_calibrated(2000));
    }

    #[test]
    fn a_padding_target_prices_plain_steps_by_their_graph_and_its_spare_rows_at_nothing() {
        let padding = StepPadding { max_rows: 256, max_seqs: 512, mixed: true };
        let mut t = CostTable::new(4).with_padding(Some(padding));
        t.seed(&[1.0, 1.1, 1.2, 1.3]);
        // Plain steps of 61 sequences run as 64 and feed the 64-row cell.
        for _ in 0..50 {
            t.observe_step(0, 61, 61, 2.0);
        }
        assert_eq!(t.buckets()[0].rows, vec![1, 2, 3, 4, 64]);
        assert!(close(t.plain_cost(0, 60), t.cost(0, 64)) && (t.cost(0, 64) - 2.0).abs() < 0.05);
        // 60 sequences and 4 verify rows still run 64 rows; a fifth goes past them.
        assert!(close(t.step_cost(0, 60, 64), t.plain_cost(0, 60)));
        assert_eq!(t.added_cost(0, 60, 4), 0.0);
        assert!(t.added_cost(0, 60, 5) > 0.0);
        // Without the padding the same rows are priced along the cells.
        let mut smooth = CostTable::new(4);
        smooth.seed(&[1.0, 1.1, 1.2, 1.3]);
        assert!(smooth.added_cost(0, 60, 4) > 0.0);
        // Where steps of different row counts run eagerly (no mixed graphs), no verify row is free.
        let eager = CostTable::new(4).with_padding(Some(StepPadding { mixed: false, ..padding }));
        assert!(eager.added_cost(0, 60, 1) > 0.0);
        // A lone sequence's rounds are its own rows either way.
        assert!(close(t.step_cost(0, 1, 3), t.cost(0, 3)));
        // A table widened for wider rounds keeps its target's padding, not what it measured.
        let wide = t.widened(8);
        assert_eq!((wide.widest_round(), wide.buckets().len()), (8, 0), "nothing measured carries over");
        assert_eq!(wide.added_cost(0, 60, 4), 0.0);
        assert_eq!(t.widened(2).widest_round(), 4);
    }

    #[test]
    fn batched_steps_learn_their_own_cells_past_the_widest_round() {
        // The probe timed one sequence's rounds of 1..4 rows; a server then runs steps of 64 sequences.
        let mut t = CostTable::new(4);
        t.seed(&[1.0, 1.1, 1.2, 1.3]);
        assert!(close(t.cost(0, 64), 7.3), "priced along the probe's last segment first");
        for _ in 0..50 {
            t.observe(0, 64, 4.0);
        }
        assert!((t.cost(0, 64) - 4.0).abs() < 0.05, "{}", t.cost(0, 64));
        assert!(t.cost(0, 70) >= t.cost(0, 64), "wider steps follow from the widest measured one");
        let view = &t.buckets()[0];
        assert_eq!(view.rows, vec![1, 2, 3, 4, 64], "cells of rounds a lane may verify, and measured steps");
        assert_eq!(view.samples, vec![0, 0, 0, 0, 50]);
        assert!(t.summary().contains(" 64=4.00*"), "{}", t.summary());
        t.observe(0, MAX_STEP_ROWS + 1, 1.0);
        assert_eq!(t.buckets()[0].rows.len(), 5, "absurd widths are not kept");
    }

    #[test]
    fn settled_cells_resist_outliers() {
        let mut t = CostTable::new(2);
        t.seed(&[10.0, 11.0]);
        for _ in 0..10 {
            t.observe(0, 1, 10.0);
        }
        t.observe(0, 1, 1000.0);
        let after = t.cost(0, 1);
        assert!(after < 10.7, "one stalled step moved the cost to {after}");
        t.observe(0, 1, f64::INFINITY);
        t.observe(0, 0, 5.0);
        assert!(close(t.cost(0, 1), after), "invalid measurements are ignored");
    }

    #[test]
    fn a_slower_machine_raises_every_width_alike() {
        let mut t = CostTable::new(3);
        t.seed(&[10.0, 12.0, 14.0]);
        for _ in 0..40 {
            t.observe(0, 1, 20.0);
        }
        assert!((t.cost(0, 3) / t.cost(0, 1) - 1.4).abs() < 1e-9, "the shape holds");
        assert!((t.cost(0, 1) - 20.0).abs() < 0.1, "{}", t.cost(0, 1));
        for _ in 0..200 {
            t.observe(0, 3, 20.0);
        }
        assert!((t.cost(0, 3) / t.cost(0, 1) - 1.0).abs() < 0.05, "measured widths learn their own shape");
    }

    #[test]
    fn a_new_width_learns_its_cost_without_moving_the_measured_ones() {
        // The probe's short-context curve understates wide rounds at a long context (the H200 hybrid target at
        // 32K). Lanes of one width after another feed the table, as the benchmark's do.
        let mut t = CostTable::new(8);
        t.seed(&[2.0, 2.7, 3.3, 3.8, 4.4, 4.9, 5.5, 6.0]);
        let real = [(1, 2.9), (4, 6.9), (8, 11.2), (3, 5.5)];
        for (rows, ms) in real {
            for _ in 0..40 {
                t.observe(32768, rows, ms);
            }
        }
        for (rows, ms) in real {
            let cost = t.cost(32768, rows);
            assert!((cost / ms - 1.0).abs() < 0.02, "{rows} rows: {cost} ms, measured {ms}");
        }
    }

    #[test]
    fn a_young_width_is_priced_by_the_middle_of_its_first_rounds() {
        // Widths 1 and 4 settled; 3 rows then run a stalled round and three ordinary ones.
        let mut t = CostTable::new(4);
        t.seed(&[2.0, 2.8, 3.4, 4.0]);
        for _ in 0..20 {
            t.observe(0, 1, 2.0);
            t.observe(0, 4, 4.1);
        }
        for ms in [6.0, 3.5, 3.4, 3.6] {
            t.observe(0, 3, ms);
        }
        let three = t.cost(0, 3);
        assert!((three - 3.5).abs() < 0.02, "3 rows priced {three} ms, their middle round 3.5");
        // Settled, it follows the spread of its rounds again.
        for _ in 0..100 {
            t.observe(0, 3, 3.8);
        }
        assert!((t.cost(0, 3) - 3.8).abs() < 0.05, "{}", t.cost(0, 3));
    }

    #[test]
    fn a_width_in_use_leaves_the_price_of_the_others_alone() {
        // The probe guessed 3 rows low and their first rounds ran fast; a lane then runs nothing but 3 rows.
        let mut t = CostTable::new(4);
        t.seed(&[2.0, 2.8, 3.0, 4.0]);
        for _ in 0..100 {
            t.observe(0, 1, 2.0);
        }
        for _ in 0..40 {
            t.observe(0, 4, 4.1);
        }
        for ms in [3.2, 3.3, 3.3, 3.4].into_iter().chain([3.5; 60]) {
            t.observe(0, 3, ms);
        }
        let (three, four) = (t.cost(0, 3), t.cost(0, 4));
        assert!((three / 3.5 - 1.0).abs() < 0.02, "3 rows priced {three} ms, measured 3.5");
        assert!((four / 4.1 - 1.0).abs() < 0.01, "4 rows priced {four} ms, measured 4.1 before");
    }

    #[test]
    fn drafting_costs_are_kept_per_lane_kind() {
        let mut t = CostTable::new(2);
        assert_eq!(t.draft_cost(LaneKind::Dflash2), 0.0);
        for _ in 0..4 {
            t.observe_draft(LaneKind::Dflash2, 6.0);
        }
        t.observe_draft(LaneKind::Pld, 0.01);
        assert!((t.draft_cost(LaneKind::Dflash2) - 6.0).abs() < 1e-9);
        t.observe_draft(LaneKind::Dflash2, 600.0);
        assert!(t.draft_cost(LaneKind::Dflash2) < 6.5, "clamped: {}", t.draft_cost(LaneKind::Dflash2));
        assert!((t.draft_cost(LaneKind::Pld) - 0.01).abs() < 1e-9);
    }

    #[test]
    fn typical_acceptance_is_kept_per_lane_kind() {
        let mut t = CostTable::new(4);
        assert_eq!(t.typical_acceptance(LaneKind::Pld, 3), None, "unknown before a verified round");
        t.observe_draft(LaneKind::Pld, 0.01);
        assert_eq!(t.typical_acceptance(LaneKind::Pld, 3), None, "drafting alone says nothing of acceptance");
        for _ in 0..100 {
            t.observe_acceptance(LaneKind::Pld, 3, 3);
            t.observe_acceptance(LaneKind::Dflash2, 3, 0);
        }
        let pld = t.typical_acceptance(LaneKind::Pld, 3).expect("observed");
        let dflash = t.typical_acceptance(LaneKind::Dflash2, 3).expect("observed");
        assert!(pld.iter().all(|&p| p > 0.95), "{pld:?}");
        assert!(dflash[0] < 0.05, "{dflash:?}");
        assert_eq!(t.draft_costs(), vec![(LaneKind::Pld, 0.01)], "kinds that never drafted have no drafting cost");
        assert!(
            t.summary().ends_with("draft[pld]=0.01 accept[pld]=1.00,1.00,1.00 accept[dflash2]=0.01,0.01,0.01"),
            "{}",
            t.summary()
        );
    }

    #[test]
    fn the_summary_marks_measured_cells() {
        let mut t = CostTable::new(2);
        t.seed(&[4.0, 5.0]);
        t.observe(0, 2, 5.0);
        t.observe_draft(LaneKind::Dflash2, 3.0);
        assert_eq!(t.summary(), "[round-costs] probed=true ctx<1024: 1=4.00 2=5.00* draft[dflash2]=3.00");
        let views = t.buckets();
        assert_eq!(views.len(), 1);
        assert_eq!(views[0].samples, vec![0, 1]);
    }
}
