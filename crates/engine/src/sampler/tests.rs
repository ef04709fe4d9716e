//! Tests of the sampler's public behaviour.

use super::*;
use dflash_runtime::ops::filter::by_value_desc;

fn params(temperature: f32) -> SamplingParams {
    SamplingParams { temperature, seed: 7, ..SamplingParams::greedy() }
}

/// Deterministic pseudo-random logits in [-spread/2, spread/2).
fn test_logits(n: usize, salt: u64, spread: f32) -> Vec<f32> {
    (0..n as u64).map(|i| (keyed_uniform(salt, i, 0, 1) as f32 - 0.5) * spread).collect()
}

fn softmax64(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let total: f64 = w.iter().sum();
    w.into_iter().map(|x| x / total).collect()
}

/// Straightforward reference for the filter chain: full sort, then each stage over the renormalised
/// set.
fn reference_filter(scaled: &[f32], p: &SamplingParams) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..scaled.len() as u32).collect();
    ids.sort_by(|&a, &b| by_value_desc(scaled, a, b));
    if p.top_k > 0 {
        ids.truncate(p.top_k);
    }
    let probs = softmax64(&ids.iter().map(|&i| f64::from(scaled[i as usize])).collect::<Vec<_>>());
    let mut mass = 0.0;
    let keep = probs.iter().take_while(|&&pr| {
        let before = mass;
        mass += pr;
        before < f64::from(p.top_p)
    });
    ids.truncate(keep.count());
    let top = f64::from(scaled[ids[0] as usize]);
    ids.retain(|&i| (f64::from(scaled[i as usize]) - top).exp() >= f64::from(p.min_p) - 1e-9);
    ids.sort_unstable();
    ids
}

#[test]
fn mix64_matches_splitmix64_reference() {
    // First output of splitmix64 seeded with 0: the finaliser applied to the golden-ratio
    // increment.
    assert_eq!(mix64(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
}

#[test]
fn keyed_draws_are_pure_functions_of_the_key() {
    let keys: Vec<(u64, u32)> = (0..64u64).flat_map(|pos| (0..32u32).map(move |t| (pos, t))).collect();
    let forward: Vec<f64> = keys.iter().map(|&(p, t)| keyed_uniform(3, p, t, STREAM_TARGET)).collect();
    let mut backward: Vec<f64> = keys.iter().rev().map(|&(p, t)| keyed_uniform(3, p, t, STREAM_TARGET)).collect();
    backward.reverse();
    assert_eq!(forward, backward);
    assert!(forward.iter().all(|&u| u > 0.0 && u < 1.0 && gumbel(u).is_finite()));
    let mut distinct = forward.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    assert_eq!(distinct.len(), forward.len());
    let mean = forward.iter().sum::<f64>() / forward.len() as f64;
    assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
}

#[test]
fn streams_and_seeds_give_independent_draws() {
    assert_ne!(STREAM_TARGET, STREAM_DRAFT);
    let target = keyed_uniform(1, 10, 5, STREAM_TARGET);
    assert_ne!(target, keyed_uniform(1, 10, 5, STREAM_DRAFT));
    assert_ne!(target, keyed_uniform(2, 10, 5, STREAM_TARGET));
    assert_ne!(target, keyed_uniform(1, 11, 5, STREAM_TARGET));
    assert_ne!(target, keyed_uniform(1, 10, 6, STREAM_TARGET));
}

#[test]
fn gumbel_is_increasing_with_known_zero() {
    assert!(gumbel((-1.0f64).exp()).abs() < 1e-12);
    assert!(gumbel(0.2) < gumbel(0.5) && gumbel(0.5) < gumbel(0.9));
}

#[test]
fn validate_accepts_defaults_and_names_bad_fields() {
    assert_eq!(SamplingParams::greedy().validate(), Ok(()));
    let good = SamplingParams { temperature: 2.0, top_p: 0.5, min_p: 1.0, repetition_penalty: 10.0, ..params(1.0) };
    assert_eq!(good.validate(), Ok(()));
    let bad = [
        (SamplingParams { temperature: 2.5, ..params(1.0) }, "temperature"),
        (SamplingParams { temperature: f32::NAN, ..params(1.0) }, "temperature"),
        (SamplingParams { top_p: 0.0, ..params(1.0) }, "top_p"),
        (SamplingParams { min_p: -0.1, ..params(1.0) }, "min_p"),
        (SamplingParams { repetition_penalty: 0.0, ..params(1.0) }, "repetition_penalty"),
        (SamplingParams { presence_penalty: 2.5, ..params(1.0) }, "presence_penalty"),
        (SamplingParams { frequency_penalty: -3.0, ..params(1.0) }, "frequency_penalty"),
    ];
    for (p, field) in bad {
        match p.validate() {
            Err(SamplerError::OutOfRange { name, .. }) => assert_eq!(name, field),
            Ok(()) => panic!("{field} accepted in {p:?}"),
        }
    }
    let msg = SamplingParams { top_p: 1.5, ..params(1.0) }.validate().map_err(|e| e.to_string());
    assert_eq!(msg, Err("top_p must be in (0, 1], got 1.5".to_string()));
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let p = SamplingParams::greedy();
    assert!(p.is_greedy() && params(1e-6).is_greedy() && !params(0.1).is_greedy());
    let history = TokenHistory::new(&[]);
    assert_eq!(sample(&[0.1, 3.0, -2.0, 3.0, 1.0], &p, &history, 0), 1);
    assert_eq!(sample(&[f32::NAN, 0.5, 0.7], &p, &history, 0), 2);
    let big = test_logits(49152, 11, 20.0);
    let expected = (0..big.len()).fold(0, |b, i| if big[i] > big[b] { i } else { b });
    assert_eq!(sample(&big, &p, &history, 0), expected as u32);
    let c = candidates(&big, &p, &history);
    assert_eq!((c.ids, c.probs), (vec![expected as u32], vec![1.0]));
}

#[test]
fn greedy_applies_penalties_first() {
    let mut history = TokenHistory::new(&[]);
    history.push(0);
    let logits = [3.0, 2.9];
    assert_eq!(sample(&logits, &SamplingParams::greedy(), &history, 0), 0);
    let penalised = SamplingParams { presence_penalty: 0.5, ..SamplingParams::greedy() };
    assert_eq!(sample(&logits, &penalised, &history, 0), 1);
}

#[test]
fn logit_bias_is_added_before_penalties_and_temperature() {
    let logits = [2.0, -1.0, 0.5, 3.0];
    let mut history = TokenHistory::new(&[]);
    history.push(3);
    // Id 9 lies past this row: ignored, never a panic.
    let bias = vec![(3, -100.0), (1, 3.5), (9, 50.0)];
    let greedy = SamplingParams { logit_bias: bias.clone(), ..SamplingParams::greedy() };
    assert_eq!(sample(&logits, &greedy, &history, 0), 1);
    assert!(!greedy.picks_argmax(), "a biased request needs its logits back");
    assert!(SamplingParams::greedy().picks_argmax());
    // Biased 2.5 > 2.0 before the presence penalty on 3; then everything is divided by the temperature.
    let sampled = SamplingParams { logit_bias: vec![(1, 3.5)], presence_penalty: 1.5, ..params(2.0) };
    assert_eq!(candidates(&logits, &sampled, &history).logits, vec![1.0, 1.25, 0.25, 0.75]);
    // A bias cannot revive a masked token.
    let masked = [f32::NEG_INFINITY, 0.0];
    let revive = SamplingParams { logit_bias: vec![(0, 100.0)], ..SamplingParams::greedy() };
    assert_eq!(sample(&masked, &revive, &TokenHistory::new(&[]), 0), 1);
}

#[test]
fn logit_bias_values_must_lie_in_plus_minus_100() {
    let ok = SamplingParams { logit_bias: vec![(0, -100.0), (1, 100.0)], ..params(1.0) };
    assert!(ok.validate().is_ok());
    for bad in [100.5, -101.0, f32::NAN, f32::INFINITY] {
        let p = SamplingParams { logit_bias: vec![(0, bad)], ..params(1.0) };
        assert!(matches!(p.validate(), Err(SamplerError::OutOfRange { name: "logit_bias", .. })), "{bad}");
    }
}

#[test]
fn penalties_follow_hf_and_openai_semantics() {
    let logits = [2.0, -1.0, 0.5, 3.0, -2.0];
    let mut history = TokenHistory::new(&[0, 1, 0]);
    for id in [1, 3, 3] {
        history.push(id);
    }
    // Repetition: ids 0, 1 (prompt) and 3 (output), each once: positive / 2, negative * 2.
    let repetition = SamplingParams { repetition_penalty: 2.0, ..params(1.0) };
    assert_eq!(candidates(&logits, &repetition, &history).logits, vec![1.0, -2.0, 0.5, 1.5, -2.0]);
    // Presence and frequency: generated ids only (1 once, 3 twice), prompt-only id 0 untouched.
    let openai = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..params(1.0) };
    assert_eq!(candidates(&logits, &openai, &history).logits, vec![2.0, -1.75, 0.5, 2.0, -2.0]);
    // All together, then divided by the temperature.
    let all = SamplingParams { repetition_penalty: 2.0, ..SamplingParams { temperature: 2.0, ..openai } };
    assert_eq!(candidates(&logits, &all, &history).logits, vec![0.5, -1.375, 0.25, 0.25, -1.0]);
}

#[test]
fn truncate_generated_rolls_back_counts() {
    let logits = [1.0, 1.0, 1.0, 1.0];
    let p = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, repetition_penalty: 1.5, ..params(1.0) };
    let mut rolled = TokenHistory::new(&[2]);
    for id in [0, 1, 1, 3, 1] {
        rolled.push(id);
    }
    rolled.truncate_generated(2);
    rolled.truncate_generated(5);
    let mut fresh = TokenHistory::new(&[2]);
    fresh.push(0);
    fresh.push(1);
    assert_eq!(rolled.generated(), &[0, 1]);
    assert_eq!(candidates(&logits, &p, &rolled), candidates(&logits, &p, &fresh));
    rolled.truncate_generated(0);
    assert_eq!(candidates(&logits, &p, &rolled), candidates(&logits, &p, &TokenHistory::new(&[2])));
}

#[test]
fn top_k_keeps_the_k_best_with_lowest_ids_on_ties() {
    let logits = [1.0, 5.0, 3.0, 5.0, 2.0, 3.0];
    let history = TokenHistory::new(&[]);
    let p = SamplingParams { top_k: 3, ..params(1.0) };
    assert_eq!(candidates(&logits, &p, &history).ids, vec![1, 2, 3]);
    let p = SamplingParams { top_k: 100, ..params(1.0) };
    assert_eq!(candidates(&logits, &p, &history).ids.len(), logits.len());
}

#[test]
fn top_p_keeps_the_token_that_crosses_the_threshold() {
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let history = TokenHistory::new(&[]);
    let ids = |top_p| candidates(&logits, &SamplingParams { top_p, ..params(1.0) }, &history).ids;
    assert_eq!(ids(0.45), vec![0]);
    assert_eq!(ids(0.7), vec![0, 1]);
    assert_eq!(ids(0.85), vec![0, 1, 2]);
    let c = candidates(&logits, &SamplingParams { top_p: 0.7, ..params(1.0) }, &history);
    assert!((c.probs[0] - 0.625).abs() < 1e-6 && (c.probs[1] - 0.375).abs() < 1e-6);
}

#[test]
fn top_p_renormalises_after_top_k() {
    let logits: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
    let history = TokenHistory::new(&[]);
    // Over the full set 0.4 < 0.5 would keep id 1 too; after top-k=2 id 0 alone holds 4/7.
    let p = SamplingParams { top_k: 2, top_p: 0.5, ..params(1.0) };
    assert_eq!(candidates(&logits, &p, &history).ids, vec![0]);
    assert_eq!(candidates(&logits, &SamplingParams { top_p: 0.5, ..params(1.0) }, &history).ids, vec![0, 1]);
}

#[test]
fn min_p_is_relative_to_the_most_likely_token() {
    let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
    let history = TokenHistory::new(&[]);
    let ids = |min_p| candidates(&logits, &SamplingParams { min_p, ..params(1.0) }, &history).ids;
    assert_eq!(ids(0.2), vec![0, 1, 2]);
    assert_eq!(ids(0.5), vec![0, 1]);
    assert_eq!(ids(1.0), vec![0]);
}

#[test]
fn filters_match_a_full_sort_reference_on_large_vocabularies() {
    let history = TokenHistory::new(&[]);
    let cases = [(0, 0.9, 0.0), (0, 0.99, 0.0), (500, 0.95, 0.0), (0, 1.0, 0.05), (40, 0.3, 0.0), (0, 0.8, 0.01)];
    for (salt, &(top_k, top_p, min_p)) in cases.iter().enumerate() {
        let logits = test_logits(5000, salt as u64, 12.0);
        let p = SamplingParams { top_k, top_p, min_p, ..params(0.8) };
        let scaled: Vec<f32> = logits.iter().map(|l| l / 0.8).collect();
        let c = candidates(&logits, &p, &history);
        assert_eq!(c.ids, reference_filter(&scaled, &p), "case {top_k} {top_p} {min_p}");
        assert!((c.probs.iter().sum::<f32>() - 1.0).abs() < 1e-4);
        assert!(c.ids.len() > 1);
    }
}

#[test]
fn masked_tokens_are_never_candidates() {
    let history = TokenHistory::new(&[]);
    let logits = [0.0, f32::NEG_INFINITY, 0.0, f32::NAN];
    let c = candidates(&logits, &params(1.0), &history);
    assert_eq!(c.ids, vec![0, 2]);
    assert!((0..200).all(|pos| sample(&logits, &params(1.0), &history, pos).is_multiple_of(2)));
    let all_masked = [f32::NEG_INFINITY; 3];
    assert_eq!(sample(&all_masked, &params(1.0), &history, 0), 0);
    assert_eq!(candidates(&all_masked, &params(1.0), &history).probs, vec![1.0]);
}

#[test]
fn sample_is_gumbel_max_over_candidates() {
    let history = TokenHistory::new(&[5, 9]);
    // (params, spread of the logits, boost of token 0 above them)
    let variants = [
        (params(1.0), 12.0, 0.0),
        (params(0.3), 30.0, 0.0), // peaked: most tokens are pruned by the noise bound
        (params(1.5), 2.0, 0.0),  // flat: nothing is pruned
        // a tail just below the pruning cutoff holding about half the mass: tail tokens win often,
        // with noise barely above the bound
        (params(1.0), 0.05, 8.1),
        (SamplingParams { top_k: 20, min_p: 0.01, repetition_penalty: 1.3, ..params(0.9) }, 12.0, 0.0),
        (SamplingParams { top_p: 0.9, presence_penalty: 1.0, ..params(0.7) }, 12.0, 0.0),
    ];
    let mut tail_wins = 0;
    for (v, (p, spread, boost)) in variants.iter().enumerate() {
        let mut logits = test_logits(3000, 100 + v as u64, *spread);
        logits[0] += boost;
        for pos in 0..300 {
            let c = candidates(&logits, p, &history);
            let score = |i: usize| f64::from(c.logits[i]) + gumbel(keyed_uniform(p.seed, pos, c.ids[i], STREAM_TARGET));
            let best = (0..c.ids.len()).fold(0, |b, i| if score(i) > score(b) { i } else { b });
            assert_eq!(sample(&logits, p, &history, pos), c.ids[best], "variant {v} pos {pos}");
            let top = c.logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            tail_wins += usize::from(c.logits[best] < top - dflash_runtime::ops::sample::PRUNE_MARGIN);
        }
    }
    assert!(tail_wins > 10, "the pruned path was barely exercised: {tail_wins} wins");
}

#[test]
fn sampling_depends_on_seed_and_position_not_call_order() {
    let logits = test_logits(1000, 5, 6.0);
    let history = TokenHistory::new(&[]);
    let p = params(1.0);
    let forward: Vec<u32> = (0..200).map(|pos| sample(&logits, &p, &history, pos)).collect();
    let mut backward: Vec<u32> = (0..200).rev().map(|pos| sample(&logits, &p, &history, pos)).collect();
    backward.reverse();
    assert_eq!(forward, backward);
    let reseeded = SamplingParams { seed: 8, ..p };
    let other: Vec<u32> = (0..200).map(|pos| sample(&logits, &reseeded, &history, pos)).collect();
    assert_ne!(forward, other);
}

/// Pearson chi-square of `draws` against `expected` probabilities.
fn chi_square(draws: &[u32], expected: &[f64]) -> f64 {
    let mut counts = vec![0usize; expected.len()];
    draws.iter().for_each(|&d| counts[d as usize] += 1);
    let n = draws.len() as f64;
    counts.iter().zip(expected).map(|(&o, &p)| (o as f64 - n * p).powi(2) / (n * p)).sum()
}

#[test]
fn draws_over_positions_follow_the_softmax() {
    // 7 degrees of freedom: P(chi2 > 24.32) = 0.001. The keyed draws are deterministic, so this
    // either always passes or always fails.
    const CRITICAL_7_DOF: f64 = 24.32;
    let logits = [2.0f32, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3];
    let history = TokenHistory::new(&[]);
    let p = SamplingParams { seed: 1234, ..params(0.7) };
    let draws: Vec<u32> = (0..20_000).map(|pos| sample(&logits, &p, &history, pos)).collect();
    let at = |t: f64| softmax64(&logits.iter().map(|&l| f64::from(l) / t).collect::<Vec<_>>());
    let fit = chi_square(&draws, &at(0.7));
    assert!(fit < CRITICAL_7_DOF, "chi2 {fit}");
    // The test has power: the same draws are clearly not from the T=1 distribution.
    assert!(chi_square(&draws, &at(1.0)) > 10.0 * CRITICAL_7_DOF);
}

#[test]
fn draws_with_top_k_follow_the_renormalised_softmax() {
    // 2 degrees of freedom: P(chi2 > 13.82) = 0.001.
    let logits = [0.2f32, 1.0, -0.4, 0.9, 0.6, -1.0];
    let history = TokenHistory::new(&[]);
    let p = SamplingParams { top_k: 3, seed: 99, ..params(1.0) };
    let draws: Vec<u32> = (0..20_000).map(|pos| sample(&logits, &p, &history, pos)).collect();
    let c = candidates(&logits, &p, &history);
    assert_eq!(c.ids, vec![1, 3, 4]);
    let mut expected = vec![0.0; logits.len()];
    c.ids.iter().zip(&c.probs).for_each(|(&id, &pr)| expected[id as usize] = f64::from(pr));
    assert!(draws.iter().all(|d| c.ids.contains(d)));
    let kept: Vec<u32> = draws.iter().map(|d| c.ids.iter().position(|x| x == d).unwrap_or(0) as u32).collect();
    let fit = chi_square(&kept, &c.probs.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
    assert!(fit < 13.82, "chi2 {fit}");
    assert!((c.prob_of(3) - expected[3] as f32).abs() < 1e-7 && c.prob_of(0) == 0.0);
}

#[test]
fn logprobs_are_normalised_and_top_n_is_ordered() {
    let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
    let (log_probs, top) = logprobs_top(&logits, 3);
    let total: f64 = log_probs.iter().map(|&l| f64::from(l).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6);
    assert!((log_probs[1] - log_probs[0] - 2.0).abs() < 1e-6);
    let ids: Vec<u32> = top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, vec![1, 2, 0]);
    assert_eq!(top[0].1, log_probs[1]);
    assert_eq!(top_n(&[0.1, f32::NAN, 0.5, f32::NEG_INFINITY], 5), vec![(2, 0.5), (0, 0.1)]);
    assert_eq!(top_n(&[0.1, f32::NAN, 0.5, 0.5], 2), vec![(2, 0.5), (3, 0.5)]);
    assert!(top_n(&logits, 0).is_empty());
}

#[test]
fn block_drafters_draw_over_the_samplers_own_candidates() {
    use dflash_models::dflash::{filtered_probs, SamplingFilter};
    for (salt, (temperature, top_k, top_p)) in
        [(0.7f32, 20usize, 0.9f32), (1.0, 0, 0.5), (0.3, 3, 1.0), (1.3, 0, 1.0)].into_iter().enumerate()
    {
        let logits = test_logits(4096, salt as u64 + 11, 6.0);
        let p = SamplingParams { temperature, top_k, top_p, ..SamplingParams::greedy() };
        let c = candidates(&logits, &p, &TokenHistory::default());
        let q = filtered_probs(&logits, &SamplingFilter { temperature, top_k, top_p });
        let kept: Vec<u32> = (0..q.len() as u32).filter(|&id| q[id as usize] > 0.0).collect();
        assert_eq!(kept, c.ids, "T {temperature} top-k {top_k} top-p {top_p}: the same candidates");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let q_kept: Vec<f32> = c.ids.iter().map(|&id| q[id as usize]).collect();
        assert_eq!(bits(&q_kept), bits(&c.probs), "and the same probabilities, bit for bit");
    }
}
