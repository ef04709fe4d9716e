//! The sampling filter over a whole vocabulary, shared by the engine's sampler and the block drafters: top-k,
//! top-p and min-p over scaled logits, and the maxima, exponential sums and softmax they rest on. Loops over slices
//! are written lane-wise so the compiler vectorises them; the exponential is a polynomial of its own, so the
//! results are the same bits on every machine.
//!
//! Every function here treats -inf as a masked token; callers turn NaN logits into -inf first.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Widths (in scaled-logit units below the maximum) tried, narrowest first, for the window that
/// must hold the top-p mass; only ids inside it are sorted.
const TOP_P_WINDOWS: [f32; 6] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];

/// Relative slack on a window's mass, so rounding in the vectorised sum can never leave the sorted
/// accumulation inside the window short of the target.
const TOP_P_WINDOW_SLACK: f64 = 1e-4;

const LANES: usize = 8;

/// e^x for x <= 0 (Cephes `expf`: exact range reduction plus a degree-6 polynomial, within 2 ulp);
/// 0 below -87, where the result would be subnormal. Free of branches and calls (no `floor`, which is
/// a libm call on baseline x86-64), so slice loops over it vectorise.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
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
pub fn max_finite(values: &[f32]) -> f32 {
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
pub fn max_finite_of(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
}

/// Index of the largest value among the ids set in `allowed` (bit `i % 32` of word `i / 32`; ids past it are not
/// allowed), ties to the lowest index; NaN never wins; `None` when no allowed value is a number. The host twin of
/// the CUDA `argmax_masked`: the greedy choice of a grammar-constrained row.
pub fn masked_argmax(values: &[f32], allowed: &[u32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (w, &word) in allowed.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let id = w * 32 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let Some(&v) = values.get(id) else { return best.map(|(id, _)| id) };
            if !v.is_nan() && best.is_none_or(|(_, top)| v > top) {
                best = Some((id as u32, v));
            }
        }
    }
    best.map(|(id, _)| id)
}

/// Index of the largest value, ties to the lowest index; NaN never wins; 0 when nothing beats -inf.
pub fn argmax(values: &[f32]) -> u32 {
    let max = max_finite(values);
    values.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// Σ exp(v - max), accumulated in f64.
pub fn sum_exp(values: &[f32], max: f32) -> f64 {
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
pub fn softmax(logits: &[f32]) -> Vec<f32> {
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
pub fn by_value_desc(values: &[f32], a: u32, b: u32) -> Ordering {
    values[b as usize].total_cmp(&values[a as usize]).then(a.cmp(&b))
}

/// Unmasked ids whose value is at least `floor`, ascending.
fn ids_at_or_above(scaled: &[f32], floor: f32) -> Vec<u32> {
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
pub fn top_k_ids(scaled: &[f32], k: usize) -> Vec<u32> {
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
fn top_p_ids(scaled: &[f32], top_p: f32) -> Vec<u32> {
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
fn keep_top_p(ids: &mut Vec<u32>, scaled: &[f32], max: f32, target: f64) {
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

/// Ids surviving top-k, top-p and min-p (applied in that order, each over what the previous left), ascending; 0,
/// 1 and 0 switch the stages off. Masked tokens never survive.
pub fn filter_ids(scaled: &[f32], top_k: usize, top_p: f32, min_p: f32) -> Vec<u32> {
    let top_k_on = top_k > 0 && top_k < scaled.len();
    let top_p_on = top_p < 1.0;
    if !top_k_on && !top_p_on {
        // At most min-p, over the whole vocabulary: one pass that never lists the ids it drops.
        let (max, log_min_p) = (max_finite(scaled), min_p.ln());
        return (0..scaled.len() as u32).filter(|&id| passes_min_p(scaled[id as usize], max, log_min_p)).collect();
    }
    let mut ids = if top_k_on {
        let mut ids = top_k_ids(scaled, top_k);
        if top_p_on {
            let values: Vec<f32> = ids.iter().map(|&id| scaled[id as usize]).collect();
            let max = max_finite(&values);
            let target = f64::from(top_p) * sum_exp(&values, max);
            keep_top_p(&mut ids, scaled, max, target);
        }
        ids
    } else {
        top_p_ids(scaled, top_p)
    };
    if min_p > 0.0 {
        let max = max_finite_of(ids.iter().map(|&id| scaled[id as usize]));
        let log_min_p = min_p.ln();
        ids.retain(|&id| passes_min_p(scaled[id as usize], max, log_min_p));
    }
    ids
}

/// min-p's test: p_i >= min_p * p_max  <=>  l_i - l_max >= ln(min_p), whatever the normalisation.
/// Every unmasked token passes min_p = 0 (ln 0 = -inf); masked tokens never pass.
fn passes_min_p(scaled: f32, max: f32, log_min_p: f32) -> bool {
    scaled > f32::NEG_INFINITY && scaled - max >= log_min_p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_argmax_looks_only_at_allowed_ids() {
        let values = [0.5, 9.0, f32::NAN, 2.0, 2.0, f32::NEG_INFINITY, 7.0];
        let bits = |ids: &[usize]| {
            let mut words = vec![0u32; 2];
            ids.iter().for_each(|&i| words[i / 32] |= 1 << (i % 32));
            words
        };
        assert_eq!(masked_argmax(&values, &bits(&[0, 3, 4])), Some(3), "ties to the lowest id");
        assert_eq!(masked_argmax(&values, &bits(&[1, 6])), Some(1));
        assert_eq!(masked_argmax(&values, &bits(&[2, 5])), Some(5), "NaN never wins; -inf is a number");
        assert_eq!(masked_argmax(&values, &bits(&[2])), None);
        assert_eq!(masked_argmax(&values, &bits(&[40])), None, "ids past the values are not allowed");
        assert_eq!(masked_argmax(&values, &[u32::MAX]), Some(argmax(&values)));
    }

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
