//! `dflash bench lanes`' results: one record per request, written as JSON and summarised as a Markdown table per
//! (prompt group, temperature, lane).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use dflash_engine::spec::SpecStats;
use dflash_engine::Usage;
use serde_json::json;

use super::median;

/// Draft positions shown in the table's acceptance column.
const SHOWN_POSITIONS: usize = 8;

/// One request's figures.
pub struct RunResult {
    pub group: String,
    /// Index of the prompt in the file.
    pub prompt: usize,
    pub temperature: f32,
    pub lane: String,
    pub usage: Usage,
    pub ttft_ms: f64,
}

/// Decoded tokens (after each request's first) over decode time, summed over `runs`.
fn pooled_decode_tok_s(runs: &[&RunResult]) -> f64 {
    let tokens: f64 = runs.iter().map(|r| r.usage.completion_tokens.saturating_sub(1) as f64).sum();
    let ms: f64 = runs.iter().map(|r| r.usage.decode_ms).sum();
    if ms > 0.0 {
        tokens / ms * 1e3
    } else {
        0.0
    }
}

impl RunResult {
    fn decode_tok_s(&self) -> f64 {
        pooled_decode_tok_s(&[self])
    }

    fn prefill_tok_s(&self) -> f64 {
        if self.usage.prefill_ms > 0.0 {
            self.usage.prompt_tokens as f64 / self.usage.prefill_ms * 1e3
        } else {
            0.0
        }
    }

    pub fn spec(&self) -> SpecStats {
        self.usage.spec.as_deref().copied().unwrap_or_default()
    }

    /// The progress line printed after each request.
    pub fn summary(&self) -> String {
        format!(
            "[bench] {} #{} T={} {}: {} tokens, decode {:.1} tok/s, {:.2} tokens/round, widths [{}]",
            self.group,
            self.prompt,
            self.temperature,
            self.lane,
            self.usage.completion_tokens,
            self.decode_tok_s(),
            self.usage.spec.as_deref().map_or(1.0, |s| s.tokens_per_round()),
            self.spec().widths_summary(),
        )
    }
}

/// Writes every run to `dir/lanes-<unix time>.json`; returns the path.
///
/// # Errors
/// When the directory or the file cannot be written.
pub fn write_json(dir: &Path, results: &[RunResult]) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let path = dir.join(format!("lanes-{stamp}.json"));
    let runs: Vec<_> = results
        .iter()
        .map(|r| {
            let s = r.spec();
            json!({
                "group": r.group, "prompt": r.prompt, "temperature": r.temperature, "lane": r.lane,
                "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                "ttft_ms": r.ttft_ms, "prefill_tok_s": r.prefill_tok_s(), "decode_tok_s": r.decode_tok_s(),
                "mode": s.lane.as_str(), "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                "accept_rate": s.accept_rate(), "tokens_per_round": s.tokens_per_round(),
                "tokens_per_step": tokens_per_step(&s), "policy": s.policy.as_str(), "widths": s.widths,
                "drafted_at": s.drafted_at, "accepted_at": s.accepted_at,
                "plain_steps": s.plain_steps, "gated_steps": s.gated_steps, "gate_pauses": s.gate_pauses,
                "draft_ms": s.draft_ms(),
                "fallback": s.fallback.map(|f| json!({
                    "mode": f.lane.as_str(), "rounds": f.rounds, "drafted": f.drafted, "accepted": f.accepted,
                })),
            })
        })
        .collect();
    std::fs::write(&path, serde_json::to_string_pretty(&runs)?)?;
    Ok(path)
}

/// Medians per (group, temperature, lane), plus an `all` group over every prompt: decode speed, the pooled decode
/// speed (all the cell's decoded tokens over all its decode time: what a stream of these requests gets), its
/// speedup over plain (median over prompts of the per-prompt ratio of median decode speeds), tokens per drafted
/// round and per decode step, and the acceptance rate of each draft position over all of the cell's rounds.
pub fn table(results: &[RunResult], lanes: &[String]) -> String {
    let mut cells: BTreeMap<(String, u32), Vec<&RunResult>> = BTreeMap::new();
    for r in results {
        for group in [r.group.as_str(), "all"] {
            cells.entry((group.to_string(), r.temperature.to_bits())).or_default().push(r);
        }
    }
    let mut out = String::from(
        "| group | T | lane | decode tok/s | pooled tok/s | speedup | TTFT ms | tokens/round | tokens/step | acceptance by position |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for ((group, t_bits), runs) in &cells {
        let temperature = f32::from_bits(*t_bits);
        for lane in lanes {
            let mine: Vec<&RunResult> = runs.iter().copied().filter(|r| &r.lane == lane).collect();
            if mine.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&RunResult) -> f64| median(&mine.iter().map(|r| f(r)).collect::<Vec<_>>());
            let spec = pooled_spec(&mine);
            let (tpr, tps, positions) = match spec {
                Some(s) if s.rounds > 0 => {
                    (format!("{:.2}", s.tokens_per_round()), format!("{:.2}", tokens_per_step(&s)), positions(&s))
                }
                Some(s) => ("-".into(), format!("{:.2}", tokens_per_step(&s)), "-".into()),
                None => ("-".into(), "1.00".into(), "-".into()),
            };
            out.push_str(&format!(
                "| {group} | {temperature} | {lane} | {:.1} | {:.1} | {:.2}x | {:.0} | {tpr} | {tps} | {positions} |\n",
                med(&|r| r.decode_tok_s()),
                pooled_decode_tok_s(&mine),
                speedup(runs, lane),
                med(&|r| r.ttft_ms),
            ));
        }
    }
    out
}

/// The lane's statistics summed over the runs (`None` when no run armed a lane).
fn pooled_spec(runs: &[&RunResult]) -> Option<SpecStats> {
    let armed: Vec<SpecStats> = runs.iter().filter_map(|r| r.usage.spec.as_deref().copied()).collect();
    let mut pooled = *armed.first()?;
    for s in &armed[1..] {
        pooled.rounds += s.rounds;
        pooled.drafted += s.drafted;
        pooled.accepted += s.accepted;
        pooled.plain_steps += s.plain_steps;
        pooled.fallback = match (pooled.fallback, s.fallback) {
            (Some(mut p), Some(f)) => {
                p.rounds += f.rounds;
                p.drafted += f.drafted;
                p.accepted += f.accepted;
                Some(p)
            }
            (p, f) => p.or(f),
        };
        for k in 0..pooled.drafted_at.len() {
            pooled.drafted_at[k] += s.drafted_at[k];
            pooled.accepted_at[k] += s.accepted_at[k];
        }
    }
    Some(pooled)
}

/// The acceptance rate of the first draft positions that were drafted at all, e.g. `.62 .35 .20`.
fn positions(s: &SpecStats) -> String {
    let shown: Vec<String> = s
        .drafted_at
        .iter()
        .zip(&s.accepted_at)
        .take(SHOWN_POSITIONS)
        .take_while(|(d, _)| **d > 0)
        .map(|(d, a)| format!("{:.2}", *a as f64 / *d as f64))
        .collect();
    if shown.is_empty() {
        "-".into()
    } else {
        shown.join(" ")
    }
}

/// Tokens committed per decode step of the lane, plain steps and its fallback's rounds included (verified rounds
/// commit accepted + 1).
fn tokens_per_step(s: &SpecStats) -> f64 {
    let (fallback_rounds, fallback_accepted) = s.fallback.map_or((0, 0), |f| (f.rounds, f.accepted));
    let steps = s.rounds + s.plain_steps + fallback_rounds;
    if steps == 0 {
        1.0
    } else {
        (s.accepted + fallback_accepted + steps) as f64 / steps as f64
    }
}

fn speedup(runs: &[&RunResult], lane: &str) -> f64 {
    let per_prompt = |l: &str, p: usize| {
        median(&runs.iter().filter(|r| r.lane == l && r.prompt == p).map(|r| r.decode_tok_s()).collect::<Vec<_>>())
    };
    let mut prompts: Vec<usize> = runs.iter().map(|r| r.prompt).collect();
    prompts.sort_unstable();
    prompts.dedup();
    let ratios: Vec<f64> =
        prompts.iter().map(|&p| per_prompt(lane, p) / per_prompt("plain", p)).filter(|x| x.is_finite()).collect();
    median(&ratios)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(group: &str, prompt: usize, lane: &str, decode_ms: f64, rounds: Option<(u64, u64)>) -> RunResult {
        let spec = rounds.map(|(drafted, accepted)| {
            let mut s = SpecStats::default();
            for _ in 0..drafted {
                s.record_round(2, usize::from(accepted > 0));
            }
            s.accepted = accepted;
            Box::new(s)
        });
        let usage = Usage { completion_tokens: 11, decode_ms, spec, ..Usage::default() };
        RunResult { group: group.into(), prompt, temperature: 0.0, lane: lane.into(), usage, ttft_ms: 5.0 }
    }

    #[test]
    fn the_table_has_a_row_per_group_and_lane_with_speedups_over_plain() {
        let runs = vec![
            run("code", 0, "plain", 100.0, None),
            run("code", 0, "pld", 50.0, Some((4, 4))),
            run("math", 1, "plain", 100.0, None),
            run("math", 1, "pld", 100.0, Some((4, 0))),
        ];
        let lanes = vec!["plain".to_string(), "pld".to_string()];
        let t = table(&runs, &lanes);
        let row = |group: &str, lane: &str| {
            t.lines().find(|l| l.starts_with(&format!("| {group} | 0 | {lane} |"))).map(str::to_string)
        };
        assert!(row("code", "pld").expect("code pld").contains("| 2.00x |"), "{t}");
        assert!(row("math", "pld").expect("math pld").contains("| 1.00x |"), "{t}");
        assert!(row("all", "pld").expect("all pld").contains("| 1.50x |"), "{t}");
        assert!(row("code", "plain").expect("code plain").contains("| - |"), "{t}");
        // The pooled speed: 20 decoded tokens in 150 ms, where the median of the two runs' speeds is 150 tok/s.
        assert!(row("all", "pld").expect("all pld").contains("| 133.3 |"), "{t}");
        // Pooled over both groups: 8 rounds drafting 2 each; position 0 accepted in the 4 code rounds.
        assert!(row("all", "pld").expect("all pld").contains("| 0.50 0.00 |"), "{t}");
    }
}
