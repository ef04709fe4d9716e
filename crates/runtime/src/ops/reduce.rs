//! Reductions over one row of logits: softmax, argmax, top-k.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::simd::{self, has_avx2};

/// Softmax of `row` in place (max-subtracted, so large logits do not overflow).
///
/// A row whose maximum is -∞ (everything masked) becomes uniform rather than NaN; NaNs in the row
/// propagate to the result.
pub fn softmax_in_place(row: &mut [f32]) {
    if row.is_empty() {
        return;
    }
    let max = max_ignoring_nan(row);
    if max == f32::NEG_INFINITY {
        row.fill(1.0 / row.len() as f32);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2, FMA and F16C were detected.
        unsafe { softmax_avx2(row, max) };
        return;
    }
    softmax_impl::<false>(row, max);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_avx2(row: &mut [f32], max: f32) {
    softmax_impl::<true>(row, max);
}

#[inline(always)]
fn softmax_impl<const AVX2: bool>(row: &mut [f32], max: f32) {
    let sum = simd::exp_shifted_sum::<AVX2>(row, max);
    simd::scale(row, 1.0 / sum);
}

/// Index of the largest value; ties go to the lowest index, NaNs are skipped (0 for an empty or
/// all-NaN row).
pub fn argmax(row: &[f32]) -> u32 {
    // Two vectorizable passes (the max, then its first position) beat one branchy pass.
    let max = max_ignoring_nan(row);
    row.iter().position(|&v| v == max).map_or(0, |i| i as u32)
}

/// The largest non-NaN value (-∞ when there is none).
fn max_ignoring_nan(row: &[f32]) -> f32 {
    let (chunks, tail) = row.as_chunks::<16>();
    let mut lanes = [f32::NEG_INFINITY; 16];
    for c in chunks {
        for i in 0..16 {
            // `f32::max` returns the other operand when one is NaN.
            lanes[i] = lanes[i].max(c[i]);
        }
    }
    lanes.iter().chain(tail).copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Up to this `k`, `top_k` keeps a heap of the best `k` seen; above it, it partitions a full copy.
const TOP_K_HEAP_MAX: usize = 256;

/// The `k` largest values with their ids, in descending order; equal values are ordered by lower id
/// and NaNs rank below every number. Returns fewer than `k` entries when the row is shorter.
pub fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    if k <= TOP_K_HEAP_MAX {
        return top_k_heap(row, k);
    }
    let mut all: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    if k < all.len() {
        // Partition in O(n) so only the k winners are sorted.
        all.select_nth_unstable_by(k - 1, rank);
        all.truncate(k);
    }
    all.sort_unstable_by(rank);
    all
}

/// O(n log k) with an O(1) rejection for most entries: a max-heap (by `rank`, so its top is the
/// worst entry kept) of the best `k` so far.
fn top_k_heap(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut heap: BinaryHeap<Ranked> = row.iter().take(k).enumerate().map(|(i, &v)| Ranked(i as u32, v)).collect();
    for (i, &v) in row.iter().enumerate().skip(k) {
        let candidate = Ranked(i as u32, v);
        if let Some(mut worst) = heap.peek_mut() {
            if candidate < *worst {
                *worst = candidate;
            }
        }
    }
    heap.into_sorted_vec().into_iter().map(|Ranked(i, v)| (i, v)).collect()
}

/// A `(id, value)` entry ordered by [`rank`]: smaller is better.
#[derive(Clone, Copy, Debug)]
struct Ranked(u32, f32);

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        rank(&(self.0, self.1), &(other.0, other.1))
    }
}

/// Order for `top_k`: numbers before NaN, larger values first, then lower ids.
fn rank(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    a.1.is_nan()
        .cmp(&b.1.is_nan())
        .then_with(|| b.1.partial_cmp(&a.1).unwrap_or(Ordering::Equal))
        .then_with(|| a.0.cmp(&b.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_util::{assert_close, Rng};

    #[test]
    fn softmax_matches_naive() {
        let mut rng = Rng::new(21);
        let row: Vec<f32> = rng.vec(1001).iter().map(|v| v * 30.0).collect();
        let max = row.iter().copied().fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
        let exps: Vec<f64> = row.iter().map(|v| (*v as f64 - max).exp()).collect();
        let sum: f64 = exps.iter().sum();
        let want: Vec<f32> = exps.iter().map(|e| (e / sum) as f32).collect();
        simd::on_both_paths(|path| {
            let mut got = row.clone();
            softmax_in_place(&mut got);
            assert_close(&got, &want, 1e-6, &format!("softmax {path}"));
        });
        let mut masked = vec![f32::NEG_INFINITY; 4];
        softmax_in_place(&mut masked);
        assert_eq!(masked, vec![0.25; 4]);
        let mut with_inf = vec![0.0, f32::NEG_INFINITY, 0.0];
        softmax_in_place(&mut with_inf);
        assert_eq!(with_inf, vec![0.5, 0.0, 0.5]);
    }

    #[test]
    fn argmax_breaks_ties_low_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN, 0.5]), 3);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        let mut long: Vec<f32> = (0..100).map(|i| (i % 7) as f32).collect();
        long[40] = f32::NAN;
        long[90] = 9.0;
        long[95] = 9.0;
        assert_eq!(argmax(&long), 90);
    }

    #[test]
    fn top_k_matches_full_sort() {
        let mut rng = Rng::new(22);
        // Few distinct values force many ties.
        let row: Vec<f32> = (0..501).map(|_| (rng.below(20) as f32) - 10.0).collect();
        let mut want: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        want.sort_by(|a, b| b.1.partial_cmp(&a.1).expect("no NaN").then(a.0.cmp(&b.0)));
        // 7 and 40 use the heap, 300 and up the partition.
        for k in [1, 7, 40, 300, 501, 600] {
            let got = top_k(&row, k);
            assert_eq!(got, want[..k.min(501)].to_vec(), "k = {k}");
        }
        assert!(top_k(&row, 0).is_empty());
        let got = top_k(&[f32::NAN, 1.0, f32::NEG_INFINITY], 3);
        assert_eq!((got[0], got[1].0, got[2].0), ((1, 1.0), 2, 0));
    }
}
