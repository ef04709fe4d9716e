//! The Qwen3-8B projection's one-request cell in simulation (`dflash bench lanes --random-target qwen3-8b
//! --random-drafter dflash2 --oracle-profile paper --oracle-pays-drafter`, PERFORMANCE.md entry 102): blocks of 16,
//! a drafting call of 4.69 ms beside steps of 7.2 ms, every draft right with probability 0.86. Measured there, the
//! adaptive lane ran 10-16% behind full blocks over four prompts; the policy alone, here, is within the goal of 5%,
//! so the rest of that gap is not the width choice.

use super::tests::Rng;
use super::*;
use crate::spec::oracle;

/// Ms of a step by verify rows (1..=16), as that run's table measured them (the middle of each cell).
const LADDER: [f64; 16] =
    [7.22, 7.22, 7.22, 7.24, 7.30, 7.34, 7.36, 7.40, 7.70, 7.80, 7.90, 7.94, 8.05, 8.10, 8.15, 8.19];
const DRAFT_MS: f64 = 4.69;
const ACCEPT: f64 = 0.86;
const DRAFTS: usize = 15;
const MAX_TOKENS: usize = 128;
const PROMPTS: usize = 4;

struct Engine {
    costs: CostTable,
    noise: Rng,
}

impl Engine {
    fn step(&mut self, rows: usize) -> f64 {
        let ms = LADDER[rows - 1] * (1.0 + 0.03 * (2.0 * self.noise.uniform() - 1.0));
        self.costs.observe(1000, rows, ms);
        ms
    }

    /// One request of `mode`: decode tokens and ms.
    fn request(&mut self, mode: PolicyMode, key: u64) -> (f64, f64) {
        let mut policy = RoundPolicy::new(mode, LaneKind::Oracle, DRAFTS);
        let (mut generated, mut ms) = (1, 0.0);
        while generated < MAX_TOKENS {
            let cap = DRAFTS.min(MAX_TOKENS - generated - 1);
            if cap == 0 || matches!(policy.plan(&self.costs, 1000, cap), RoundPlan::Plain) {
                ms += self.step(1);
                generated += 1;
                continue;
            }
            self.costs.observe_draft(LaneKind::Oracle, DRAFT_MS);
            let keep = policy.choose(&self.costs, 1000, cap, None, DRAFT_MS).drafts;
            let right = |j: usize| oracle::unit(oracle::mix(key, generated as u64, j as u64)) < ACCEPT as f32;
            let accepted = (0..keep).take_while(|&j| right(j)).count();
            policy.record_verified(&mut self.costs, keep, accepted, None);
            let took = DRAFT_MS + self.step(keep + 1);
            policy.record_round(&self.costs, 1000, RoundTiming::alone(&self.costs, 1000, accepted + 1, took));
            ms += took;
            generated += accepted + 1;
        }
        ((generated - 1) as f64, ms)
    }
}

#[test]
fn the_projection_cell_in_simulation() {
    let seeds: u64 = std::env::var("BENCH_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let (mut fixed, mut adaptive) = ((0.0, 0.0), (0.0, 0.0));
    for seed in 0..seeds {
        let mut costs = CostTable::new(DRAFTS + 1);
        costs.seed(&LADDER.iter().map(|ms| ms - 0.2).collect::<Vec<_>>());
        let mut engine = Engine { costs, noise: Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5851_f42d) };
        for prompt in 0..PROMPTS as u64 {
            let key = seed * PROMPTS as u64 + prompt + 1;
            let f = engine.request(PolicyMode::Fixed, key);
            let a = engine.request(PolicyMode::Adaptive, key);
            fixed = (fixed.0 + f.0, fixed.1 + f.1);
            adaptive = (adaptive.0 + a.0, adaptive.1 + a.1);
        }
    }
    let (f, a) = (fixed.0 / fixed.1, adaptive.0 / adaptive.1);
    println!("fixed16 {f:.4} tok/ms, adaptive {a:.4} ({:+.1}%)", 100.0 * (a / f - 1.0));
    assert!(a >= 0.95 * f, "adaptive {a:.4} tok/ms more than 5% behind full blocks' {f:.4}");
}
