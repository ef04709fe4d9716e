//! The results of `dflash bench serve`: per server and concurrency level, aggregate tok/s and latency percentiles;
//! written as JSON, a Markdown table (printed too) and an SVG plot of aggregate tok/s and p99 TTFT against
//! concurrency, one line per server.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use plotters::prelude::*;
use serde::Serialize;

use super::load::Sample;

/// One concurrency level of one server.
#[derive(Clone, Debug, Serialize)]
pub struct Level {
    pub concurrency: usize,
    pub requests: usize,
    pub errors: usize,
    /// The first error's message, if any.
    pub first_error: Option<String>,
    pub tokens: usize,
    pub wall_s: f64,
    /// Completion tokens of all requests over the level's wall time.
    pub tok_s: f64,
    /// Completion tokens per second while every stream had a request in flight: from the level's start until the
    /// first stream ran out of requests. The whole level's figure also holds its drain, the last completions
    /// running beside ever fewer others, which is longer where streams drifted apart (speculation commits
    /// different counts a step, so equal-length completions stop ending together).
    pub all_busy_tok_s: f64,
    pub all_busy_s: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Gaps between content chunks.
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    /// Where the server's engine steps spent their time during the level (servers that export the counters).
    pub profile: Option<StepProfile>,
    /// Completions of a request the bench had seen answered before (same prompt, length and variant, on any
    /// server and level), and how many of them differ from that first text.
    pub texts_compared: usize,
    pub texts_differing: usize,
}

/// A level's engine steps: how many, rows per step, and ms per step by phase.
#[derive(Clone, Debug, Serialize)]
pub struct StepProfile {
    pub steps: f64,
    pub rows_per_step: f64,
    /// `None` for a server that does not count them.
    pub sequences_per_step: Option<f64>,
    /// Share of the steps with prompt rows.
    pub prompt_step_share: f64,
    /// (phase, ms per step), in step order.
    pub ms_per_step: Vec<(String, f64)>,
}

impl StepProfile {
    /// The difference of two readings of the counters, per step.
    pub fn between(before: &[(String, f64)], after: &[(String, f64)]) -> StepProfile {
        let delta = |key: &str| {
            let get = |c: &[(String, f64)]| c.iter().find(|(k, _)| k == key).map_or(0.0, |(_, v)| *v);
            get(after) - get(before)
        };
        let steps = delta("dflash_engine_steps_total");
        let per_step = |v: f64| if steps > 0.0 { v / steps } else { 0.0 };
        let ms_per_step = after
            .iter()
            .filter_map(|(k, _)| k.strip_prefix("dflash_step_seconds_total{phase=\"").map(|p| (k, p)))
            .map(|(k, p)| (p.trim_end_matches("\"}").to_string(), per_step(delta(k)) * 1e3))
            .collect();
        StepProfile {
            steps,
            rows_per_step: per_step(delta("dflash_step_rows_total")),
            sequences_per_step: after
                .iter()
                .any(|(k, _)| k == "dflash_step_sequences_total")
                .then(|| per_step(delta("dflash_step_sequences_total"))),
            prompt_step_share: per_step(delta("dflash_prompt_steps_total")),
            ms_per_step,
        }
    }

    /// Sequences per step, or "-" where the server does not count them.
    fn sequences(&self) -> String {
        self.sequences_per_step.map_or_else(|| "-".to_string(), |n| format!("{n:.1}"))
    }

    /// `phase ms` pairs and the rows per step, for logs and tables.
    pub fn summary(&self) -> String {
        let phases: Vec<String> = self.ms_per_step.iter().map(|(p, ms)| format!("{p} {ms:.3}")).collect();
        format!(
            "{:.0} steps of {:.1} rows over {} sequences ({:.0}% with prompt rows), ms per step: {}",
            self.steps,
            self.rows_per_step,
            self.sequences(),
            self.prompt_step_share * 1e2,
            phases.join(", ")
        )
    }
}

impl Level {
    /// The level's figures from its requests' samples, run in `wall`, every stream busy for the first `all_busy`.
    pub fn of(concurrency: usize, samples: &[Sample], wall: Duration, all_busy: Duration) -> Level {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
        let tokens: usize = ok.iter().map(|s| s.tokens).sum();
        let ms = |d: &Duration| d.as_secs_f64() * 1e3;
        let mut ttft: Vec<f64> = ok.iter().filter_map(|s| s.ttft.as_ref().map(ms)).collect();
        let mut gaps: Vec<f64> = ok.iter().flat_map(|s| s.gaps.iter().map(ms)).collect();
        let wall_s = wall.as_secs_f64();
        let all_busy_s = all_busy.as_secs_f64();
        let busy_tokens: f64 = ok.iter().map(|s| s.tokens_by(all_busy)).sum();
        Level {
            concurrency,
            requests: samples.len(),
            errors: samples.len() - ok.len(),
            first_error: samples.iter().find_map(|s| s.error.clone()),
            tokens,
            wall_s,
            tok_s: if wall_s > 0.0 { tokens as f64 / wall_s } else { 0.0 },
            all_busy_tok_s: if all_busy_s > 0.0 { busy_tokens / all_busy_s } else { 0.0 },
            all_busy_s,
            ttft_p50_ms: percentile(&mut ttft, 0.50),
            ttft_p99_ms: percentile(&mut ttft, 0.99),
            itl_p50_ms: percentile(&mut gaps, 0.50),
            itl_p99_ms: percentile(&mut gaps, 0.99),
            profile: None,
            texts_compared: 0,
            texts_differing: 0,
        }
    }

    /// One log line.
    pub fn summary(&self) -> String {
        let errors = match &self.first_error {
            Some(e) => format!(", {} errors (first: {e})", self.errors),
            None => String::new(),
        };
        let profile = self.profile.as_ref().map(|p| format!("; {}", p.summary())).unwrap_or_default();
        format!(
            "{:.0} tok/s ({:.0} while every stream was busy), TTFT p50 {:.1} ms p99 {:.1} ms, ITL p50 {:.2} ms p99 \
             {:.2} ms, {} requests{errors}, {}{profile}",
            self.tok_s,
            self.all_busy_tok_s,
            self.ttft_p50_ms,
            self.ttft_p99_ms,
            self.itl_p50_ms,
            self.itl_p99_ms,
            self.requests,
            self.agreement()
        )
    }

    /// How its completions agree with the first of the same request.
    pub fn agreement(&self) -> String {
        agreement(self.texts_compared, self.texts_differing)
    }
}

/// `compared` repeated requests, `differing` of them not giving their first text, in words.
fn agreement(compared: usize, differing: usize) -> String {
    match (compared, differing) {
        (0, _) => "no repeated request".to_string(),
        (n, 0) => format!("all {n} repeated requests gave the first text"),
        (n, d) => format!("{d} of {n} repeated requests DIFFER from the first text"),
    }
}

/// One server's levels.
#[derive(Clone, Debug, Serialize)]
pub struct ServerRun {
    pub name: String,
    pub levels: Vec<Level>,
}

/// The nearest-rank percentile `q` of `values` (sorted here); NaN for none.
fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// Writes `serve-load.json`, `serve-load.md` and `serve-load.svg` into `dir`; returns the Markdown table.
///
/// # Errors
/// A directory or file that cannot be written, a plot that cannot be drawn.
pub fn write_reports(dir: &Path, runs: &[ServerRun]) -> Result<String> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = |ext: &str| -> PathBuf { dir.join(format!("serve-load.{ext}")) };
    std::fs::write(path("json"), serde_json::to_string_pretty(runs)?).context("writing the JSON")?;
    let table = table(runs);
    std::fs::write(path("md"), &table).context("writing the table")?;
    plot(&path("svg"), runs)?;
    eprintln!("[bench] written to {}", path("{json,md,svg}").display());
    Ok(table)
}

/// Rows by concurrency, a column group per server.
fn table(runs: &[ServerRun]) -> String {
    let mut out = String::from("| concurrent requests |");
    for r in runs {
        let _ = write!(out, " {0} tok/s | {0} TTFT p50 / p99 ms | {0} ITL p50 / p99 ms |", r.name);
    }
    out.push_str("\n| --- |");
    out.push_str(&" --- | --- | --- |".repeat(runs.len()));
    let mut levels: Vec<usize> = runs.iter().flat_map(|r| r.levels.iter().map(|l| l.concurrency)).collect();
    levels.sort_unstable();
    levels.dedup();
    for &c in &levels {
        let _ = write!(out, "\n| {c} |");
        for r in runs {
            match r.levels.iter().find(|l| l.concurrency == c) {
                Some(l) => {
                    let errors = if l.errors > 0 { format!(" ({} errors)", l.errors) } else { String::new() };
                    let _ = write!(
                        out,
                        " {:.0}{errors} | {:.1} / {:.1} | {:.2} / {:.2} |",
                        l.tok_s, l.ttft_p50_ms, l.ttft_p99_ms, l.itl_p50_ms, l.itl_p99_ms
                    );
                }
                None => out.push_str(" | | |"),
            }
        }
    }
    out.push('\n');
    all_busy_table(&mut out, runs, &levels);
    agreement_lines(&mut out, runs);
    for r in runs {
        profile_table(&mut out, r);
    }
    out
}

/// Tok/s while every stream had a request in flight, by level, a column per server; past the first server, also
/// its ratio to the first.
fn all_busy_table(out: &mut String, runs: &[ServerRun], levels: &[usize]) {
    let _ =
        write!(out, "\nTok/s while every stream had a request in flight (until the first ran out of requests):\n\n");
    out.push_str("| concurrent requests |");
    for r in runs {
        let _ = write!(out, " {} |", r.name);
    }
    let _ = write!(out, "\n| --- |{}", " --- |".repeat(runs.len()));
    for &c in levels {
        let _ = write!(out, "\n| {c} |");
        let first = runs.first().and_then(|r| r.levels.iter().find(|l| l.concurrency == c)).map(|l| l.all_busy_tok_s);
        for (i, r) in runs.iter().enumerate() {
            match (r.levels.iter().find(|l| l.concurrency == c), first) {
                (Some(l), Some(f)) if i > 0 && f > 0.0 => {
                    let _ = write!(out, " {:.0} ({:.2}x) |", l.all_busy_tok_s, l.all_busy_tok_s / f);
                }
                (Some(l), _) => {
                    let _ = write!(out, " {:.0} |", l.all_busy_tok_s);
                }
                (None, _) => out.push_str(" |"),
            }
        }
    }
    out.push('\n');
}

/// One line per run (server, or server and variant): how its greedy completions agree with the first text of the
/// same request.
fn agreement_lines(out: &mut String, runs: &[ServerRun]) {
    let _ = write!(out, "\nGreedy completions against the first text of the same request (any server, any level):\n");
    for r in runs {
        let compared: usize = r.levels.iter().map(|l| l.texts_compared).sum();
        let differing: usize = r.levels.iter().map(|l| l.texts_differing).sum();
        let _ = write!(out, "\n* {}: {}", r.name, agreement(compared, differing));
    }
    out.push('\n');
}

/// The engine's step profile by level, for a server that exports it: rows and sequences per step and ms per step
/// by phase.
fn profile_table(out: &mut String, run: &ServerRun) {
    let Some(first) = run.levels.iter().find_map(|l| l.profile.as_ref()) else { return };
    let phases: Vec<&str> = first.ms_per_step.iter().map(|(p, _)| p.as_str()).collect();
    let _ = write!(
        out,
        "\n{}: engine steps, ms per step by phase\n\n| concurrent requests | rows per step | sequences per step |",
        run.name
    );
    for p in &phases {
        let _ = write!(out, " {p} |");
    }
    let _ = write!(out, " step |\n| --- | --- | --- |{}", " --- |".repeat(phases.len() + 1));
    for l in &run.levels {
        let Some(p) = &l.profile else { continue };
        let _ = write!(out, "\n| {} | {:.1} | {} |", l.concurrency, p.rows_per_step, p.sequences());
        for (_, ms) in &p.ms_per_step {
            let _ = write!(out, " {ms:.3} |");
        }
        let _ = write!(out, " {:.3} |", p.ms_per_step.iter().map(|(_, ms)| ms).sum::<f64>());
    }
    out.push('\n');
}

/// Two panels side by side: aggregate tok/s and p99 TTFT against concurrency (log scale), a line per server.
fn plot(path: &Path, runs: &[ServerRun]) -> Result<()> {
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err)?;
    let (left, right) = root.split_horizontally(550);
    let tok_s = |l: &Level| l.tok_s;
    let ttft = |l: &Level| l.ttft_p99_ms;
    panel(&left, runs, "aggregate tok/s", &tok_s)?;
    panel(&right, runs, "p99 TTFT (ms)", &ttft)?;
    root.present().map_err(draw_err)
}

fn panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    runs: &[ServerRun],
    what: &str,
    value: &dyn Fn(&Level) -> f64,
) -> Result<()> {
    let points = |r: &ServerRun| -> Vec<(f64, f64)> {
        r.levels.iter().map(|l| (l.concurrency as f64, value(l))).filter(|p| p.1.is_finite()).collect()
    };
    let all: Vec<(f64, f64)> = runs.iter().flat_map(points).collect();
    let x_max = all.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_max = all.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(area)
        .caption(what, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d((1.0..x_max * 1.2).log_scale(), 0.0..y_max)
        .map_err(draw_err)?;
    chart.configure_mesh().x_desc("concurrent requests").draw().map_err(draw_err)?;
    for (i, r) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let line = LineSeries::new(points(r), color.stroke_width(2));
        chart
            .draw_series(line)
            .map_err(draw_err)?
            .label(r.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(points(r).into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(draw_err)?;
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(draw_err)?;
    Ok(())
}

fn draw_err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("drawing the plot: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ttft_ms: u64, gaps_ms: &[u64], tokens: usize) -> Sample {
        Sample {
            ttft: Some(Duration::from_millis(ttft_ms)),
            gaps: gaps_ms.iter().map(|&g| Duration::from_millis(g)).collect(),
            tokens,
            ..Sample::default()
        }
    }

    #[test]
    fn a_level_counts_tokens_over_its_wall_time_and_takes_nearest_rank_percentiles() {
        let failed = Sample { error: Some("HTTP 503".into()), ..Sample::default() };
        let samples = [sample(10, &[1, 2], 3), sample(30, &[4], 2), failed];
        let l = Level::of(2, &samples, Duration::from_secs(2), Duration::from_secs(2));
        assert_eq!((l.requests, l.errors, l.tokens), (3, 1, 5));
        assert!((l.tok_s - 2.5).abs() < 1e-9);
        assert_eq!((l.ttft_p50_ms, l.ttft_p99_ms), (10.0, 30.0));
        assert_eq!((l.itl_p50_ms, l.itl_p99_ms), (2.0, 4.0));
        assert_eq!(l.first_error.as_deref(), Some("HTTP 503"));
        assert!(percentile(&mut [], 0.5).is_nan());
    }

    #[test]
    fn the_busy_window_counts_the_tokens_received_in_it_pro_rata_by_chunks() {
        // Sent at 0 and 100 ms; chunks at 10, 20, 30, 40 ms and 150, 250 ms.
        let early = sample(10, &[10, 10, 10], 8);
        let late = Sample { sent: Duration::from_millis(100), ..sample(50, &[100], 6) };
        assert_eq!(early.tokens_by(Duration::from_millis(25)), 4.0);
        assert_eq!(early.tokens_by(Duration::from_millis(20)), 4.0, "a chunk at the window's end is in it");
        assert_eq!(early.tokens_by(Duration::from_millis(9)), 0.0);
        assert_eq!(late.tokens_by(Duration::from_millis(200)), 3.0);
        assert_eq!(late.tokens_by(Duration::from_millis(100)), 0.0);
        let l = Level::of(2, &[early, late], Duration::from_millis(250), Duration::from_millis(200));
        assert!((l.tok_s - 14.0 / 0.25).abs() < 1e-9);
        // By 200 ms: all 8 of the first, 3 of the second's 6.
        assert!((l.all_busy_tok_s - 11.0 / 0.2).abs() < 1e-9, "{}", l.all_busy_tok_s);
        assert!((l.all_busy_s - 0.2).abs() < 1e-12);
    }

    #[test]
    fn reports_are_written_with_a_column_group_per_server() {
        let one = Duration::from_secs(1);
        let level = |c, tok_s| Level {
            concurrency: c,
            tok_s,
            all_busy_tok_s: tok_s * 1.1,
            ..Level::of(c, &[sample(5, &[1], 4)], one, one)
        };
        let runs = [
            ServerRun { name: "a".into(), levels: vec![level(1, 100.0), level(8, 500.0)] },
            ServerRun { name: "b".into(), levels: vec![level(1, 80.0)] },
        ];
        let dir = std::env::temp_dir().join(format!("dflash-load-report-{}", std::process::id()));
        let table = write_reports(&dir, &runs).expect("reports");
        assert!(table.contains("| 8 | 500 |"), "{table}");
        assert!(table.contains("| 1 | 100 |") && table.contains(" 80 |"), "{table}");
        assert!(table.contains("* a: no repeated request"), "{table}");
        assert!(table.contains("| 1 | 110 | 88 (0.80x) |") && table.contains("| 8 | 550 | |"), "{table}");
        let differing = Level { texts_compared: 4, texts_differing: 1, ..level(1, 1.0) };
        let agreeing = Level { texts_compared: 4, ..level(1, 1.0) };
        assert_eq!(differing.agreement(), "1 of 4 repeated requests DIFFER from the first text");
        assert_eq!(agreeing.agreement(), "all 4 repeated requests gave the first text");
        let svg = std::fs::read_to_string(dir.join("serve-load.svg")).expect("svg");
        assert!(svg.starts_with("<svg") && svg.contains("aggregate tok/s"), "an SVG with its panels");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
