//! Verification rules.
//!
//! * Keyed (every request here: a request without a seed gets a random one): the target's token at each verify
//!   row is the keyed draw for that absolute position, computed over the same history plain decoding would have
//!   had, so it *is* plain decoding's token; a draft is accepted when it equals it. Output tokens are identical
//!   with and without speculation, for greedy and sampled requests alike.
//! * Residual (for drafters that report their own distribution `q` and requests that do not need token identity):
//!   accept draft `x` with probability `min(1, p(x) / q(x))`, otherwise draw from `normalize(max(p − q, 0))`. The
//!   output is distributed exactly as `p`; deterministic drafters are the one-hot `q`.

use crate::sampler::Candidates;

/// Walks a round's rows in order. `commit_target(j)` computes the target's token at row `j` (over the history with
/// the drafts before `j` accepted), commits it, and returns it with whether the sequence just finished (EOS, stop
/// string, length). Stops at the first row whose token differs from the draft, at the bonus row after the last
/// draft, or when the sequence finishes; nothing past that is computed or committed. Returns the accepted drafts.
pub fn accept_prefix(drafts: &[u32], mut commit_target: impl FnMut(usize) -> (u32, bool)) -> usize {
    for j in 0..=drafts.len() {
        let (token, finished) = commit_target(j);
        let matched = drafts.get(j) == Some(&token);
        if finished || !matched {
            return j + usize::from(matched);
        }
    }
    drafts.len()
}

/// The lossy typical rule (opt-in, `--dflash-typical d`): keep draft `x` while its probability under the row's
/// filtered distribution exceeds `min(1, d · exp(−H))`, `H` being that distribution's entropy (in nats). Confident
/// rows (low `H`) demand a likely draft; flat rows accept any draft that is not rare. Not distribution-exact, so
/// sampled output differs from plain decoding; greedy requests never use it.
pub fn typical_accepts(candidates: &Candidates, x: u32, d: f32) -> bool {
    let entropy: f64 = candidates.probs.iter().filter(|&&p| p > 0.0).map(|&p| -f64::from(p) * f64::from(p).ln()).sum();
    let threshold = (f64::from(d) * (-entropy).exp()).min(1.0);
    let px = candidates.prob_of(x);
    f64::from(px) > threshold
}

/// The residual rule for one draft `x` drawn from `q`: `(true, x)` when accepted, else `(false, y)` with `y` drawn
/// from `normalize(max(p − q, 0))`. `u_accept` and `u_resample` are independent uniforms in (0, 1) (keyed draws).
/// `p` and `q` are probability vectors over the same vocabulary.
pub fn accept_or_resample(p: &[f32], q: &[f32], x: u32, u_accept: f64, u_resample: f64) -> (bool, u32) {
    let xi = x as usize;
    let (px, qx) = (f64::from(p[xi]), f64::from(q[xi]).max(f64::MIN_POSITIVE));
    if u_accept < (px / qx).min(1.0) {
        return (true, x);
    }
    let residual: Vec<f64> = p.iter().zip(q).map(|(&a, &b)| (f64::from(a) - f64::from(b)).max(0.0)).collect();
    let total: f64 = residual.iter().sum();
    if total <= 0.0 {
        // p == q: the acceptance probability was 1, so this is unreachable up to rounding; keep the draft.
        return (true, x);
    }
    let mut target = u_resample * total;
    for (i, r) in residual.iter().enumerate() {
        if target < *r {
            return (false, i as u32);
        }
        target -= r;
    }
    let last = residual.iter().rposition(|&r| r > 0.0).unwrap_or(xi);
    (false, last as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{candidates, SamplingParams, TokenHistory};

    #[test]
    fn typical_rule_demands_likely_drafts_on_confident_rows_only() {
        let params = SamplingParams { temperature: 1.0, ..SamplingParams::greedy() };
        let history = TokenHistory::new(&[]);
        // A confident row: token 0 holds almost all the mass, H is small, the threshold near d.
        let confident = candidates(&[8.0, 0.0, 0.0, 0.0], &params, &history);
        assert!(typical_accepts(&confident, 0, 0.5));
        assert!(!typical_accepts(&confident, 1, 0.5), "an unlikely draft on a confident row");
        // A flat row: H = ln 4, threshold d / 4; every token has p = 1/4.
        let flat = candidates(&[1.0, 1.0, 1.0, 1.0], &params, &history);
        assert!(typical_accepts(&flat, 3, 0.5));
        assert!(!typical_accepts(&flat, 3, 1.0), "p = 1/4 is not above 1/4");
    }
    use crate::sampler::{keyed_uniform, STREAM_DRAFT, STREAM_TARGET};

    /// A round against a fixed list of target tokens; returns (accepted, committed).
    fn round(drafts: &[u32], targets: &[u32], finish_at: Option<usize>) -> (usize, Vec<u32>) {
        let mut committed = Vec::new();
        let accepted = accept_prefix(drafts, |j| {
            committed.push(targets[j]);
            (targets[j], finish_at == Some(j))
        });
        (accepted, committed)
    }

    #[test]
    fn all_accepted_commits_the_bonus() {
        assert_eq!(round(&[5, 6, 7], &[5, 6, 7, 8], None), (3, vec![5, 6, 7, 8]));
    }

    #[test]
    fn the_first_mismatch_commits_the_correction_and_stops() {
        assert_eq!(round(&[5, 6, 7], &[9, 6, 7, 8], None), (0, vec![9]));
        assert_eq!(round(&[5, 6, 7], &[5, 9, 7, 8], None), (1, vec![5, 9]));
    }

    #[test]
    fn no_drafts_is_a_plain_step() {
        assert_eq!(round(&[], &[4], None), (0, vec![4]));
    }

    #[test]
    fn a_finish_inside_the_block_stops_committing() {
        assert_eq!(round(&[5, 6, 7], &[5, 6, 7, 8], Some(1)), (2, vec![5, 6]), "accepted, then the sequence ended");
        assert_eq!(round(&[5, 6, 7], &[5, 9, 7, 8], Some(1)), (1, vec![5, 9]));
    }

    /// Draws from `probs` by inversion.
    fn draw(probs: &[f32], u: f64) -> u32 {
        let mut acc = 0.0;
        for (i, &p) in probs.iter().enumerate() {
            acc += f64::from(p);
            if u < acc {
                return i as u32;
            }
        }
        probs.len() as u32 - 1
    }

    #[test]
    fn the_residual_rule_reproduces_the_target_distribution() {
        let p = [0.05f32, 0.40, 0.25, 0.20, 0.10];
        let q = [0.30f32, 0.10, 0.30, 0.05, 0.25];
        let n = 200_000u64;
        let mut counts = [0u64; 5];
        let mut accepted = 0;
        for i in 0..n {
            let x = draw(&q, keyed_uniform(7, i, 0, STREAM_DRAFT));
            let (ok, y) = accept_or_resample(
                &p,
                &q,
                x,
                keyed_uniform(7, i, 1, STREAM_TARGET),
                keyed_uniform(7, i, 2, STREAM_TARGET),
            );
            accepted += u64::from(ok);
            counts[y as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(p)
            .map(|(&c, pi)| {
                let expected = n as f64 * f64::from(pi);
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        // 4 degrees of freedom: P(chi2 > 18.5) = 0.001.
        assert!(chi2 < 18.5, "chi2 = {chi2}, counts {counts:?}");
        // Acceptance probability is sum(min(p, q)) = 0.05 + 0.10 + 0.25 + 0.05 + 0.10 = 0.55.
        let rate = accepted as f64 / n as f64;
        assert!((rate - 0.55).abs() < 0.01, "acceptance rate {rate}");
    }

    #[test]
    fn one_hot_q_accepts_with_probability_p_of_the_draft() {
        let p = [0.2f32, 0.5, 0.3];
        let q = [0.0f32, 1.0, 0.0];
        assert_eq!(accept_or_resample(&p, &q, 1, 0.49, 0.5), (true, 1));
        let (ok, y) = accept_or_resample(&p, &q, 1, 0.51, 0.1);
        assert!(!ok);
        assert_eq!(y, 0, "resampled from p without the draft: [0.2, 0, 0.3] normalized");
        assert_eq!(accept_or_resample(&p, &q, 1, 0.51, 0.9).1, 2);
    }
}
