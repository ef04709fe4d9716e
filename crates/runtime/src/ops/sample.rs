//! Keyed token draws over one row of logits: the host twin of the CUDA `sample_rows` kernel and the core of the
//! engine's sampler.
//!
//! A draw is described without the engine's request types: a [`Draw`] (temperature, filters, seed, position) and a
//! list of [`Adjustment`]s to single raw logits (logit bias and penalties, already resolved against the sequence's
//! history). The engine builds both from a request; a device target samples from them where the logits are, so only
//! token ids come back. Every random draw is a pure function of (seed, absolute position, token id, stream): the
//! same row gives the same token whatever shares its batch and whether or not speculation ran.

use std::borrow::Cow;

use super::filter::{argmax, by_value_desc, filter_ids, max_finite, max_finite_of, sum_exp, top_k_ids};

/// Key stream for the target model's draws.
pub const STREAM_TARGET: u64 = 0x9E37_79B9_7F4A_7C15;
/// Key stream for the draft model's draws; distinct from [`STREAM_TARGET`] so the two never share noise.
pub const STREAM_DRAFT: u64 = 0xD1B5_4A32_D192_ED03;

/// Temperatures below this are treated as greedy (dividing by them would overflow the logits).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// Tokens whose scaled logit is this far below the best one get their Gumbel noise checked against a bound before
/// the logarithms are paid for (see [`gumbel_argmax`]).
pub const PRUNE_MARGIN: f32 = 8.0;

/// The most `top_logprobs` a row may ask for (OpenAI's limit); the device's output holds this many per row.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The splitmix64 finaliser: a bijective 64-bit mix with full avalanche.
pub fn mix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The top 53 bits of the key for (seed, pos, token, stream): the integer part of [`keyed_uniform`].
#[inline(always)]
pub fn keyed_bits(seed: u64, pos: u64, token: u32, stream: u64) -> u64 {
    mix64(seed ^ mix64(pos ^ mix64(u64::from(token) ^ stream))) >> 11
}

/// Maps 53 key bits to the open interval (0, 1).
#[inline(always)]
pub fn uniform_from_bits(bits: u64) -> f64 {
    const TWO_POW_MINUS_53: f64 = 1.0 / (1u64 << 53) as f64;
    (bits as f64 + 0.5) * TWO_POW_MINUS_53
}

/// A uniform draw in the open interval (0, 1) keyed by (seed, pos, token, stream); never exactly 0 or 1, so
/// [`gumbel`] of it is always finite.
pub fn keyed_uniform(seed: u64, pos: u64, token: u32, stream: u64) -> f64 {
    uniform_from_bits(keyed_bits(seed, pos, token, stream))
}

/// Standard Gumbel noise from a uniform draw in (0, 1).
pub fn gumbel(u: f64) -> f64 {
    -(-u.ln()).ln()
}

/// How one row's token is chosen once its logits are adjusted: greedy below [`GREEDY_TEMPERATURE`], else a keyed
/// Gumbel-max draw after temperature, top-k, top-p and min-p (0, 1 and 0 switch a filter off).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// The token's absolute position in its sequence: the key of its noise.
    pub position: u64,
}

impl Draw {
    /// Argmax of the adjusted logits.
    pub fn greedy() -> Self {
        Draw { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0, position: 0 }
    }

    /// Whether the token is the adjusted logits' argmax (temperature 0, NaN, or too small to divide by).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < GREEDY_TEMPERATURE
    }

    fn has_filters(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// What an [`Adjustment`] does to its token's raw logit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AdjustKind {
    /// `l += value`: a logit bias, or a presence / frequency penalty as a negative value.
    Add,
    /// HF's repetition penalty `value`: a positive logit divided by it, a negative one multiplied.
    Repeat,
}

/// One change to one raw logit before a draw. A row's adjustments apply in order; the order matters only between
/// adjustments of the same token (the engine lists biases, then repetition, then presence and frequency).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adjustment {
    pub id: u32,
    pub kind: AdjustKind,
    pub value: f32,
}

impl Adjustment {
    /// `l` after this adjustment.
    #[inline]
    pub fn apply(&self, l: f32) -> f32 {
        match self.kind {
            AdjustKind::Add => l + self.value,
            AdjustKind::Repeat if l > 0.0 => l / self.value,
            AdjustKind::Repeat => l * self.value,
        }
    }
}

/// The raw logits with `adjust` applied in order (ids past the row are skipped); borrowed when there is none.
pub fn adjusted<'a>(logits: &'a [f32], adjust: &[Adjustment]) -> Cow<'a, [f32]> {
    if adjust.is_empty() {
        return Cow::Borrowed(logits);
    }
    let mut out = logits.to_vec();
    for a in adjust {
        if let Some(l) = out.get_mut(a.id as usize) {
            *l = a.apply(*l);
        }
    }
    Cow::Owned(out)
}

/// Adjusted logits divided by `temperature` (above the greedy threshold), NaN turned into -inf so every later stage
/// sees one kind of masked token.
pub fn scaled(logits: &[f32], temperature: f32, adjust: &[Adjustment]) -> Vec<f32> {
    let scale = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l / temperature };
    match adjusted(logits, adjust) {
        Cow::Borrowed(raw) => raw.iter().map(|&l| scale(l)).collect(),
        Cow::Owned(mut values) => {
            values.iter_mut().for_each(|l| *l = scale(*l));
            values
        }
    }
}

/// The token a row draws: the argmax of the adjusted logits when greedy (ties to the lowest id); otherwise
/// Gumbel-max over the filtered set: the id maximising `scaled_i + gumbel(keyed_uniform(seed, position, i,
/// STREAM_TARGET))`, ties to the lowest id, which is a draw from the set's softmax that depends only on the key.
pub fn draw_token(logits: &[f32], draw: &Draw, adjust: &[Adjustment]) -> u32 {
    if draw.is_greedy() {
        return argmax(&adjusted(logits, adjust));
    }
    let scaled = scaled(logits, draw.temperature, adjust);
    let (seed, pos) = (draw.seed, draw.position);
    let chosen = if draw.has_filters() {
        let ids = filter_ids(&scaled, draw.top_k, draw.top_p, draw.min_p);
        let max = max_finite_of(ids.iter().map(|&id| scaled[id as usize]));
        gumbel_argmax(&scaled, ids.iter().copied(), max, seed, pos)
    } else {
        // No filter: every unmasked token is a candidate, so skip building the id list.
        gumbel_argmax(&scaled, 0..scaled.len() as u32, max_finite(&scaled), seed, pos)
    };
    chosen.unwrap_or_else(|| argmax(&scaled))
}

/// Gumbel-max over `ids`: the id maximising `scaled[id] + gumbel(keyed_uniform(seed, pos, id, STREAM_TARGET))`,
/// ties to the lowest id; None when every id is masked. `max` is the largest scaled value among `ids`.
///
/// Exact, but cheap over a whole vocabulary: ids within [`PRUNE_MARGIN`] of `max` are scored first; any other id
/// can then only win if its noise exceeds `best - cutoff`. Since `gumbel` is increasing, that is a bound on the key
/// bits, so the logarithms are paid only for plausible winners.
pub fn gumbel_argmax(
    scaled: &[f32],
    ids: impl Iterator<Item = u32> + Clone,
    max: f32,
    seed: u64,
    pos: u64,
) -> Option<u32> {
    if max == f32::NEG_INFINITY {
        return None;
    }
    let cutoff = max - PRUNE_MARGIN;
    let bits_of = |id: u32| keyed_bits(seed, pos, id, STREAM_TARGET);
    let mut best: Option<(f64, u32)> = None;
    for id in ids.clone().filter(|&i| scaled[i as usize] >= cutoff) {
        offer(&mut best, scaled, id, bits_of(id));
    }
    let (best_score, _) = best?;
    // Noise an id below the cutoff needs to reach best_score, less a margin covering rounding in the scores.
    let needed = best_score - f64::from(cutoff) - 1e-6;
    // gumbel(u) > needed  <=>  u > exp(-exp(-needed)); the bound is lowered by a few ulps and rounded down to whole
    // key bits, so rounding can only make us score more ids, never skip a winner.
    let u_bound = (-(-needed).exp()).exp() - 4.0 * f64::EPSILON;
    let min_bits = (u_bound * (1u64 << 53) as f64 - 0.5).floor().max(0.0) as u64;
    // Ids at or above the cutoff are offered again here; offering the same (id, draw) twice changes nothing, and
    // skipping the test keeps this loop tight.
    for id in ids {
        let bits = bits_of(id);
        if bits >= min_bits {
            offer(&mut best, scaled, id, bits);
        }
    }
    best.map(|(_, id)| id)
}

/// Replaces `best` (score, id) when `id` with key bits `bits` scores higher, or equal with a lower id.
fn offer(best: &mut Option<(f64, u32)>, scaled: &[f32], id: u32, bits: u64) {
    let score = f64::from(scaled[id as usize]) + gumbel(uniform_from_bits(bits));
    let better = match *best {
        None => true,
        Some((s, b)) => score > s || (score == s && id < b),
    };
    if better {
        *best = Some((score, id));
    }
}

/// Natural-log softmax of raw logits (all -inf when every logit is masked).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = max_finite(logits);
    if max == f32::NEG_INFINITY {
        return vec![f32::NEG_INFINITY; logits.len()];
    }
    let log_norm = max + sum_exp(logits, max).ln() as f32;
    logits.iter().map(|&l| l - log_norm).collect()
}

/// The `n` largest entries of `values` as (id, value), largest first, ties to the lowest id; NaN and -inf entries
/// (impossible tokens) are never returned.
pub fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut ids = top_k_ids(values, n);
    ids.truncate(n);
    ids.sort_unstable_by(|&a, &b| by_value_desc(values, a, b));
    ids.into_iter().map(|id| (id, values[id as usize])).collect()
}

/// Log-probabilities of the raw logits (before penalties and temperature, as OpenAI reports them) and the `n` most
/// likely tokens among them.
pub fn logprobs_top(logits: &[f32], n: usize) -> (Vec<f32>, Vec<(u32, f32)>) {
    let log_probs = log_softmax(logits);
    let top = top_n(&log_probs, n);
    (log_probs, top)
}

/// One row's draw with what it reports: the token, and when asked its raw logprob and the `n` most likely tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Drawn {
    pub id: u32,
    /// `(logprob of id, top n (id, logprob))`, when the row asked for logprobs.
    pub logprobs: Option<(f32, Vec<(u32, f32)>)>,
}

/// [`draw_token`] plus, when `top_logprobs` is set, the chosen token's raw logprob and the `top_logprobs` most likely
/// tokens (at most [`MAX_TOP_LOGPROBS`]): what a device's `sample_rows` returns for the row.
pub fn draw_row(logits: &[f32], draw: &Draw, adjust: &[Adjustment], top_logprobs: Option<usize>) -> Drawn {
    let id = draw_token(logits, draw, adjust);
    let logprobs = top_logprobs.map(|n| {
        let (log_probs, top) = logprobs_top(logits, n.min(MAX_TOP_LOGPROBS));
        (log_probs.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY), top)
    });
    Drawn { id, logprobs }
}

/// One logit row a step draws from where its logits are: which row, how, its adjustments (a range of the step's
/// adjustment list) and how many top logprobs it reports (`None`: no logprobs).
#[derive(Clone, Debug, PartialEq)]
pub struct DrawRow {
    pub logit_row: usize,
    pub draw: Draw,
    pub adjust: std::ops::Range<usize>,
    pub top_logprobs: Option<usize>,
}

/// Every row of `rows` drawn on the host from `logits` (`[L, vocab]`): the twin of a device's draws, and what a
/// target whose logits are on the host does when asked to draw.
pub fn draw_rows(logits: &[f32], vocab: usize, rows: &[DrawRow], adjust: &[Adjustment]) -> Vec<Drawn> {
    rows.iter()
        .map(|row| {
            let span = row.logit_row.checked_mul(vocab).and_then(|start| Some(start..start.checked_add(vocab)?));
            let logits = span.and_then(|span| logits.get(span)).unwrap_or_default();
            let adjust = adjust.get(row.adjust.clone()).unwrap_or_default();
            draw_row(logits, &row.draw, adjust, row.top_logprobs)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjustments_of_one_token_apply_in_order() {
        let logits = [2.0f32, -2.0, 1.0];
        let adjust = [
            Adjustment { id: 0, kind: AdjustKind::Add, value: 1.0 },
            Adjustment { id: 0, kind: AdjustKind::Repeat, value: 2.0 },
            Adjustment { id: 1, kind: AdjustKind::Repeat, value: 2.0 },
            Adjustment { id: 0, kind: AdjustKind::Add, value: -0.25 },
            Adjustment { id: 9, kind: AdjustKind::Add, value: 5.0 },
        ];
        assert_eq!(&*adjusted(&logits, &adjust), &[1.25, -4.0, 1.0]);
        assert!(matches!(adjusted(&logits, &[]), Cow::Borrowed(_)));
    }

    #[test]
    fn a_greedy_draw_takes_the_adjusted_argmax_and_reports_raw_logprobs() {
        let logits = [1.0f32, 3.0, 2.0];
        let push_down = [Adjustment { id: 1, kind: AdjustKind::Add, value: -5.0 }];
        let drawn = draw_row(&logits, &Draw::greedy(), &push_down, Some(2));
        assert_eq!(drawn.id, 2);
        let (lp, top) = drawn.logprobs.expect("asked for logprobs");
        let log_probs = log_softmax(&logits);
        assert_eq!(lp, log_probs[2]);
        assert_eq!(top, vec![(1, log_probs[1]), (2, log_probs[2])]);
        assert_eq!(draw_row(&logits, &Draw::greedy(), &[], None), Drawn { id: 1, logprobs: None });
    }

    #[test]
    fn a_keyed_draw_depends_on_seed_and_position_only() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37 % 101) as f32) * 0.05).collect();
        let draw = |seed, position| Draw { temperature: 1.0, top_p: 0.9, seed, position, ..Draw::greedy() };
        let first: Vec<u32> = (0..64).map(|p| draw_token(&logits, &draw(7, p), &[])).collect();
        let again: Vec<u32> = (0..64).rev().map(|p| draw_token(&logits, &draw(7, p), &[])).collect();
        assert_eq!(first, again.into_iter().rev().collect::<Vec<_>>());
        let other: Vec<u32> = (0..64).map(|p| draw_token(&logits, &draw(8, p), &[])).collect();
        assert_ne!(first, other);
    }
}
