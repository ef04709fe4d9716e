//! The sampler's number crunching over a whole vocabulary: maxima, exponential sums, top-k
//! selection, the top-p window and pruned Gumbel-max. Loops over slices are written lane-wise so
//! the compiler vectorises them.
//!
//! Every function here treats -inf as a masked token; callers turn NaN logits into -inf first.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use super::{gumbel, mix64, STREAM_TARGET};

/// Tokens whose scaled logit is this far below the best one get their Gumbel noise checked against
/// a bound before the logarithms are paid for (see [`gumbel_argmax`]).
pub(super) const PRUNE_MARGIN: f32 = 8.0;

/// Widths (in scaled-logit units below the maximum) tried, narrowest first, for the window that
/// must hold the top-p mass; only ids inside it are sorted.
const TOP_P_WINDOWS: [f32; 6] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];

/// Relative slack on a window's mass, so rounding in the vectorised sum can never leave the sorted
/// accumulation inside the window short of the target.
const TOP_P_WINDOW_SLACK: f64 = 1e-4;

const LANES: usize = 8;

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

/// e^x for x <= 0 (Cephes `expf`: exact range reduction plus a degree-6 polynomial, within 2 ulp);
/// 0 below -87, where the result would be subnormal. Free of branches and calls (no `floor`, which is
/// a libm call on baseline x86-64), so slice loops over it vectorise.
#[inline(always)]
pub(super) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so n * LN2_HI is exact for the n that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits.
    const ROUNDER: f32 = 12_582_912.0;
    let clamped = if x > -87.0 { x } else { -87.0 };
    let shifted = clamped * LOG2_E + ROUNDER;
    let n = shifted - ROUNDER;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let poly =
        ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r + 0.5;
    let mantissa = poly * r * r + r + 1.0;
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let scale = f32::from_bits((n_int.wrapping_add(127) as u32) << 23);
    keep_if(mantissa * scale, x >= -87.0)
}

/// `value` when `keep`, else 0, as a bit mask rather than a branch.
#[inline(always)]
fn keep_if(value: f32, keep: bool) -> f32 {
    f32::from_bits(value.to_bits() & u32::from(keep).wrapping_neg())
}

/// Fills `out[i]` with `exp(values[i] - max)`.
fn exp_shifted_into(values: &[f32], max: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(values) {
        *o = exp_nonpositive(v - max);
    }
}

/// Sum of `values` in eight f64 lanes.
fn sum_f64(values: &[f32]) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(v);
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// The largest non-NaN value of a slice (-inf for none).
pub(super) fn max_finite(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = if v > *lane { v } else { *lane };
        }
    }
    let lanes_max = max_finite_of(lanes.into_iter());
    max_finite_of(tail.iter().copied()).max(lanes_max)
}

/// The largest non-NaN value of a sequence (-inf for none).
pub(super) fn max_finite_of(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

/// Index of the largest value, ties to the lowest index; NaN never wins; 0 when nothing beats -inf.
pub(super) fn argmax(values: &[f32]) -> u32 {
    let max = max_finite(values);
    values.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// Σ exp(v - max), accumulated in f64.
pub(super) fn sum_exp(values: &[f32], max: f32) -> f64 {
    // Exponentials go through a small buffer: the f32 loop vectorises well, the f64 sum separately.
    let mut block = [0.0f32; 256];
    values
        .chunks(block.len())
        .map(|chunk| {
            let out = &mut block[..chunk.len()];
            exp_shifted_into(chunk, max, out);
            sum_f64(out)
        })
        .sum()
}

/// Softmax of `logits`; an all-masked set (only ever the sampler's fallback) shares the mass
/// evenly.
pub(super) fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = max_finite(logits);
    if max == f32::NEG_INFINITY {
        return vec![1.0 / logits.len() as f32; logits.len()];
    }
    let mut probs = vec![0.0f32; logits.len()];
    exp_shifted_into(logits, max, &mut probs);
    let inv_total = (1.0 / sum_f64(&probs)) as f32;
    probs.iter_mut().for_each(|p| *p *= inv_total);
    probs
}

/// Descending by value, ties to the lower id: the order every top-k/top-p choice is made in.
pub(super) fn by_value_desc(values: &[f32], a: u32, b: u32) -> Ordering {
    values[b as usize].total_cmp(&values[a as usize]).then(a.cmp(&b))
}

/// Unmasked ids whose value is at least `floor`, ascending.
pub(super) fn ids_at_or_above(scaled: &[f32], floor: f32) -> Vec<u32> {
    (0..scaled.len() as u32)
        .filter(|&i| scaled[i as usize] >= floor && scaled[i as usize] > f32::NEG_INFINITY)
        .collect()
}

/// The `k` largest unmasked ids (fewer if fewer are unmasked), ascending; ties go to the lowest
/// ids.
///
/// One scan with a min-heap of the best `k` so far: after the first few hundred ids almost every id
/// is rejected by a single comparison with the heap's worst, so this costs O(n) without copying the
/// logits.
pub(super) fn top_k_ids(scaled: &[f32], k: usize) -> Vec<u32> {
    if k == 0 || k >= scaled.len() {
        return ids_at_or_above(scaled, f32::NEG_INFINITY);
    }
    let mut heap: BinaryHeap<Reverse<u64>> = BinaryHeap::with_capacity(k + 1);
    // The heap's worst value, in total-order bits: ids arrive ascending, so a value that is not
    // strictly above it can never displace it (ties keep low ids), and one integer comparison
    // rejects it.
    let mut worst_value = ordered_bits(f32::NEG_INFINITY);
    for (i, &v) in scaled.iter().enumerate() {
        let value = ordered_bits(v);
        if value <= worst_value && heap.len() == k {
            continue;
        }
        if v == f32::NEG_INFINITY || v.is_nan() {
            continue;
        }
        let rank = (u64::from(value) << 32) | u64::from(u32::MAX - i as u32);
        if heap.len() < k {
            heap.push(Reverse(rank));
        } else if let Some(mut worst) = heap.peek_mut() {
            *worst = Reverse(rank);
        }
        if heap.len() == k {
            worst_value = heap.peek().map_or(worst_value, |Reverse(rank)| (rank >> 32) as u32);
        }
    }
    let mut ids: Vec<u32> = heap.into_iter().map(|Reverse(rank)| u32::MAX - rank as u32).collect();
    ids.sort_unstable();
    ids
}

/// The bits of `value` as an unsigned integer ordered like [`f32::total_cmp`].
fn ordered_bits(value: f32) -> u32 {
    let bits = value.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// The top-p set over a whole vocabulary of scaled logits, ascending.
///
/// Only ids inside a window `[max - width, max]` that surely holds the top-p mass are sorted: every
/// id below the window comes after all ids inside it in descending order, with at least the target
/// mass before it, so top-p drops it. The weights are computed once and reused for the total and
/// every window tried.
pub(super) fn top_p_ids(scaled: &[f32], top_p: f32) -> Vec<u32> {
    let max = max_finite(scaled);
    let mut weights = vec![0.0f32; scaled.len()];
    exp_shifted_into(scaled, max, &mut weights);
    let target = f64::from(top_p) * sum_f64(&weights);
    let needed = target * (1.0 + TOP_P_WINDOW_SLACK);
    let floor = TOP_P_WINDOWS
        .iter()
        .map(|width| max - width)
        .find(|&floor| sum_f64_at_or_above(&weights, scaled, floor) >= needed)
        .unwrap_or(f32::NEG_INFINITY);
    let mut ids = ids_at_or_above(scaled, floor);
    keep_top_p(&mut ids, scaled, max, target);
    ids
}

/// Σ weights[i] over the i with values[i] >= floor, in eight f64 lanes.
fn sum_f64_at_or_above(weights: &[f32], values: &[f32], floor: f32) -> f64 {
    let mut lanes = [0.0f64; LANES];
    let mut tail = 0.0;
    let (weight_chunks, value_chunks) = (weights.chunks_exact(LANES), values.chunks_exact(LANES));
    let remainder = weight_chunks.remainder().iter().zip(value_chunks.remainder());
    for (&w, &v) in remainder {
        tail += f64::from(keep_if(w, v >= floor));
    }
    for (ws, vs) in weight_chunks.zip(value_chunks) {
        for ((lane, &w), &v) in lanes.iter_mut().zip(ws).zip(vs) {
            *lane += f64::from(keep_if(w, v >= floor));
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// Keeps the most likely `ids`, in descending order, while the mass before each is below `target`
/// (so the id that crosses it stays, as in HF's top-p), then restores ascending order. Weights are
/// `exp(v - max)`, the same terms `target` was computed from.
pub(super) fn keep_top_p(ids: &mut Vec<u32>, scaled: &[f32], max: f32, target: f64) {
    ids.sort_unstable_by(|&a, &b| by_value_desc(scaled, a, b));
    let mut mass = 0.0;
    let kept = ids
        .iter()
        .take_while(|&&id| {
            let before = mass;
            mass += f64::from(exp_nonpositive(scaled[id as usize] - max));
            before < target
        })
        .count();
    ids.truncate(kept.max(1));
    ids.sort_unstable();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_nonpositive_is_accurate_and_flushes_below_range() {
        let mut worst = 0.0f64;
        for i in 0..=100_000 {
            let x = -87.0 * i as f32 / 100_000.0;
            let exact = f64::from(x).exp();
            worst = worst.max((f64::from(exp_nonpositive(x)) - exact).abs() / exact);
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn max_and_argmax_skip_nan_and_prefer_low_ids() {
        let mut values = vec![0.0f32; 37];
        values[3] = f32::NAN;
        values[20] = 2.0;
        values[33] = 2.0;
        assert_eq!(max_finite(&values), 2.0);
        assert_eq!(argmax(&values), 20);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(max_finite(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn sums_cover_every_lane_and_respect_the_floor() {
        // 19 values: two full lanes of eight plus a tail of three.
        let values: Vec<f32> = (0..19).map(|i| -0.25 * i as f32).collect();
        let weights: Vec<f32> = values.iter().map(|&v| v.exp()).collect();
        let all: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        assert!((sum_exp(&values, 0.0) - all).abs() < 1e-6);
        let above: f64 = weights[..9].iter().map(|&w| f64::from(w)).sum();
        assert!((sum_f64_at_or_above(&weights, &values, -2.0) - above).abs() < 1e-6);
        let masked = [0.0, f32::NEG_INFINITY];
        assert_eq!(sum_exp(&masked, 0.0), 1.0);
    }

    #[test]
    fn top_k_ids_break_ties_by_id_and_skip_masked() {
        let values = [1.0, 5.0, 3.0, 5.0, 2.0, 3.0, f32::NEG_INFINITY];
        assert_eq!(top_k_ids(&values, 3), vec![1, 2, 3]);
        assert_eq!(top_k_ids(&values, 1), vec![1]);
        let masked = [f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY, 0.5];
        assert_eq!(top_k_ids(&masked, 3), vec![1, 3]);
        let signed = [-0.0, 0.0, -1.0, 2.0, -3.0];
        assert_eq!(top_k_ids(&signed, 2), vec![1, 3]);
        assert_eq!(top_k_ids(&signed, 4), vec![0, 1, 2, 3]);
    }

    #[test]
    fn top_p_ids_match_a_full_sort_across_window_widths() {
        // Values spread over 40 units: each listed window width, and none at all, is the narrowest
        // that works for some top_p.
        let values: Vec<f32> = (0..4000u32).map(|i| -((i * 7919 % 4000) as f32) * 0.01).collect();
        let mut order: Vec<u32> = (0..4000).collect();
        order.sort_by(|&a, &b| by_value_desc(&values, a, b));
        let total: f64 = values.iter().map(|&v| f64::from(v).exp()).sum();
        for top_p in [0.05f32, 0.3, 0.6, 0.9, 0.99, 0.999_99] {
            let mut mass = 0.0;
            let kept = order.iter().take_while(|&&id| {
                let before = mass;
                mass += f64::from(values[id as usize]).exp() / total;
                before < f64::from(top_p)
            });
            let mut expected: Vec<u32> = kept.copied().collect();
            expected.sort_unstable();
            assert_eq!(top_p_ids(&values, top_p), expected, "top_p {top_p}");
        }
    }
}
