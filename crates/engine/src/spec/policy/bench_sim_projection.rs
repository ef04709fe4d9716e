//! The Qwen3-8B projection's one-request cell in simulation (`dflash bench lanes --random-target qwen3-8b
//! --random-drafter dflash2 --oracle-profile paper --oracle-pays-drafter`, PERFORMANCE.md entry 102): blocks of 16,
//! a drafting call of 4.69 ms beside steps of 7.2 ms, every draft right with probability 0.86. Measured there, the
//! adaptive lane ran 10-16% behind full blocks over four prompts; the policy alone, here, is within the goal of 5%,
//! so the rest of that gap is not the width choice.

use super::bench_sim::Engine;
use super::*;

/// Ms of a step by verify rows (1..=16), as that run's table measured them (the middle of each cell).
const LADDER: [f64; 16] =
    [7.22, 7.22, 7.22, 7.24, 7.30, 7.34, 7.36, 7.40, 7.70, 7.80, 7.90, 7.94, 8.05, 8.10, 8.15, 8.19];
const DRAFT_MS: f64 = 4.69;
const ACCEPT: [f64; DRAFTS] = [0.86; DRAFTS];
const DRAFTS: usize = 15;
const CONTEXT: usize = 1000;
const MAX_TOKENS: usize = 128;
const PROMPTS: usize = 4;

/// One request of `mode` on `engine` for the prompt keyed `key`: tokens decoded and their ms.
fn request(engine: &mut Engine, mode: PolicyMode, key: u64) -> (f64, f64) {
    let mut policy = RoundPolicy::new(mode, LaneKind::Oracle, DRAFTS);
    let (mut generated, mut ms) = (1, 0.0);
    while generated < MAX_TOKENS {
        let (_, tokens, took) = engine.round(&mut policy, key, generated, DRAFTS.min(MAX_TOKENS - generated - 1));
        generated += tokens;
        ms += took;
    }
    ((generated - 1) as f64, ms)
}

#[test]
fn the_projection_cell_in_simulation() {
    let seeds: u64 = std::env::var("BENCH_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let (mut fixed, mut adaptive) = ((0.0, 0.0), (0.0, 0.0));
    for seed in 0..seeds {
        let mut engine = Engine::of(&LADDER, &LADDER, &ACCEPT, DRAFT_MS, CONTEXT, seed);
        for prompt in 0..PROMPTS as u64 {
            let key = seed * PROMPTS as u64 + prompt + 1;
            let f = request(&mut engine, PolicyMode::Fixed, key);
            let a = request(&mut engine, PolicyMode::Adaptive, key);
            fixed = (fixed.0 + f.0, fixed.1 + f.1);
            adaptive = (adaptive.0 + a.0, adaptive.1 + a.1);
        }
    }
    let (f, a) = (fixed.0 / fixed.1, adaptive.0 / adaptive.1);
    println!("fixed16 {f:.4} tok/ms, adaptive {a:.4} ({:+.1}%)", 100.0 * (a / f - 1.0));
    assert!(a >= 0.95 * f, "adaptive {a:.4} tok/ms more than 5% behind full blocks' {f:.4}");
}
