//! The sampler's keyed randomness: the key bits of (seed, position, token, stream), and pruned Gumbel-max over a
//! vocabulary (the filter it draws over is [`dflash_runtime::ops::filter`]).

use super::{gumbel, mix64, STREAM_TARGET};

/// Tokens whose scaled logit is this far below the best one get their Gumbel noise checked against
/// a bound before the logarithms are paid for (see [`gumbel_argmax`]).
pub(super) const PRUNE_MARGIN: f32 = 8.0;

/// The top 53 bits of the key for (seed, pos, token, stream): the integer part of
/// [`super::keyed_uniform`].
#[inline(always)]
pub(super) fn keyed_bits(seed: u64, pos: u64, token: u32, stream: u64) -> u64 {
    mix64(seed ^ mix64(pos ^ mix64(u64::from(token) ^ stream))) >> 11
}

/// Maps 53 key bits to the open interval (0, 1).
#[inline(always)]
pub(super) fn uniform_from_bits(bits: u64) -> f64 {
    const TWO_POW_MINUS_53: f64 = 1.0 / (1u64 << 53) as f64;
    (bits as f64 + 0.5) * TWO_POW_MINUS_53
}

/// Gumbel-max over `ids`: the id maximising `scaled[id] + gumbel(keyed_uniform(seed, pos, id,
/// STREAM_TARGET))`, ties to the lowest id; None when every id is masked. `max` is the largest
/// scaled value among `ids`.
///
/// Exact, but cheap over a whole vocabulary: ids within [`PRUNE_MARGIN`] of `max` are scored first;
/// any other id can then only win if its noise exceeds `best - cutoff`. Since `gumbel` is
/// increasing, that is a bound on the key bits, so the logarithms are paid only for plausible
/// winners.
pub(super) fn gumbel_argmax(
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
    // Noise an id below the cutoff needs to reach best_score, less a margin covering rounding in
    // the scores.
    let needed = best_score - f64::from(cutoff) - 1e-6;
    // gumbel(u) > needed  <=>  u > exp(-exp(-needed)); the bound is lowered by a few ulps and
    // rounded down to whole key bits, so rounding can only make us score more ids, never skip a
    // winner.
    let u_bound = (-(-needed).exp()).exp() - 4.0 * f64::EPSILON;
    let min_bits = (u_bound * (1u64 << 53) as f64 - 0.5).floor().max(0.0) as u64;
    // Ids at or above the cutoff are offered again here; offering the same (id, draw) twice changes
    // nothing, and skipping the test keeps this loop tight.
    for id in ids {
        let bits = bits_of(id);
        if bits >= min_bits {
            offer(&mut best, scaled, id, bits);
        }
    }
    best.map(|(_, id)| id)
}

/// Replaces `best` (score, id) when `id` with key bits `bits` scores higher, or equal with a lower
/// id.
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
