//! Benchmarks the dense (f32 / f16 / bf16 weight) matmul: few-row calls (decode m = 1, verify m = 2..16) as
//! read bandwidth over a whole model's weights, and prefill (m = 512) in GFLOP/s, on the shapes of a
//! 135M-class model (hidden 576: fused q/k/v 960x576, o 576x576, fused gate/up 3072x576, down 576x1536)
//! and on a 4096x4096 matrix.
//!
//! ```text
//! cargo run --release -p dflash-runtime --example dense_bench                  # bf16, RAYON_NUM_THREADS or 2
//! cargo run --release -p dflash-runtime --example dense_bench -- --dtype f32   # f32 or f16 weights
//! cargo run --release -p dflash-runtime --example dense_bench -- --cpu-time    # one thread, on-CPU time
//! ```
//! Wall-clock figures swing with other jobs on a shared machine; `--cpu-time` (Linux `schedstat`) is steadier
//! for the kernels themselves, though a neighbour still evicts caches and shares memory bandwidth.

use std::time::Instant;

use dflash_runtime::{ops, DType, Tensor};

const LAYERS: usize = 30;
/// Per layer `[n, k]`: fused q/k/v, o, fused gate/up, down.
const LAYER_SHAPES: [(&str, usize, usize); 4] =
    [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)];
const BIG: (usize, usize) = (4096, 4096);
/// Copies of the big matrix cycled through, so few-row calls read from memory rather than cache.
const BIG_COPIES: usize = 4;
const FEW_ROWS: [usize; 5] = [1, 2, 4, 8, 16];
const PREFILL_M: usize = 512;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dtype = match args.iter().position(|a| a == "--dtype").and_then(|i| args.get(i + 1)).map(String::as_str) {
        Some("f32") => DType::F32,
        Some("f16") => DType::F16,
        _ => DType::BF16,
    };
    let cpu_time = args.iter().any(|a| a == "--cpu-time");
    let threads =
        if cpu_time { 1 } else { std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2) };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    let clock = if cpu_time { Clock::Cpu } else { Clock::Wall };
    println!("{dtype} weights, {threads} thread(s), {clock:?} time, medians of 9 runs");
    pool.install(|| {
        let model: Vec<Matrix> = (0..LAYERS)
            .flat_map(|l| LAYER_SHAPES.iter().enumerate().map(move |(i, &(_, n, k))| (l * 4 + i, n, k)))
            .map(|(seed, n, k)| Matrix::random(dtype, n, k, seed as u64))
            .collect();
        few_rows("135M-class model, all 120 layer matrices", &model, clock);
        let big: Vec<Matrix> = (0..BIG_COPIES).map(|c| Matrix::random(dtype, BIG.0, BIG.1, 1000 + c as u64)).collect();
        few_rows("4096x4096, 4 copies", &big, clock);
        println!("\nprefill (m = {PREFILL_M}):");
        for (i, &(name, ..)) in LAYER_SHAPES.iter().enumerate() {
            prefill(name, &model[i], clock);
        }
        prefill("4096", &big[0], clock);
    });
}

/// A pass over `mats` per row count: time per pass and the weight bytes read per second.
fn few_rows(what: &str, mats: &[Matrix], clock: Clock) {
    let bytes: usize = mats.iter().map(|m| m.w.bytes().map_or(0, <[u8]>::len)).sum();
    println!("\n{what} ({:.1} MB), one pass per call:", bytes as f64 / 1e6);
    for m in FEW_ROWS {
        let mut io: Vec<(Tensor, Tensor)> = mats.iter().map(|mat| mat.io(m)).collect();
        let t = clock.median(9, || {
            for (mat, (x, y)) in mats.iter().zip(io.iter_mut()) {
                ops::matmul(x, &mat.w, y).expect("matmul");
            }
        });
        println!("  m={m:<3} {:8.2} ms  {:6.1} GB/s", t * 1e3, bytes as f64 / t / 1e9);
    }
}

fn prefill(name: &str, mat: &Matrix, clock: Clock) {
    let (x, mut y) = mat.io(PREFILL_M);
    let t = clock.median(9, || ops::matmul(&x, &mat.w, &mut y).expect("matmul"));
    let gflop = 2.0 * (PREFILL_M * mat.n * mat.k) as f64 / 1e9;
    println!("  {name:8} {:5}x{:<5} {:8.2} ms  {:6.1} GFLOP/s", mat.n, mat.k, t * 1e3, gflop / t);
}

struct Matrix {
    w: Tensor,
    n: usize,
    k: usize,
}

impl Matrix {
    fn random(dtype: DType, n: usize, k: usize, seed: u64) -> Self {
        let vals = random_values(n * k, seed);
        let bytes: Vec<u8> = match dtype {
            DType::F16 => vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
            DType::BF16 => vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
            _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        Matrix { w: Tensor::from_bytes(dtype, &[n, k], &bytes).expect("weights"), n, k }
    }

    /// An `[m, k]` input and an `[m, n]` output.
    fn io(&self, m: usize) -> (Tensor, Tensor) {
        let x = Tensor::from_f32(&random_values(m * self.k, 7), &[m, self.k]).expect("x");
        (x, Tensor::zeros(DType::F32, &[m, self.n]).expect("y"))
    }
}

fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

#[derive(Clone, Copy, Debug)]
enum Clock {
    Wall,
    /// On-CPU time of the calling thread.
    Cpu,
}

impl Clock {
    /// Median seconds per call of `f` over `runs` runs (after a warm-up call). On-CPU time may be accounted
    /// per scheduler tick, so each run then repeats `f` for about 0.2 s.
    fn median(self, runs: usize, mut f: impl FnMut()) -> f64 {
        let start = Instant::now();
        f();
        let reps = match self {
            Clock::Wall => 1,
            Clock::Cpu => (0.2 / start.elapsed().as_secs_f64().max(1e-7)).clamp(1.0, 10_000.0) as usize,
        };
        let mut t: Vec<f64> = (0..runs)
            .map(|_| {
                let start = self.now();
                (0..reps).for_each(|_| f());
                (self.now() - start) / reps as f64
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[runs / 2]
    }

    fn now(self) -> f64 {
        match self {
            Clock::Wall => EPOCH.with(|e| e.elapsed().as_secs_f64()),
            Clock::Cpu => {
                let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("Linux schedstat");
                stat.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()).expect("on-CPU time") / 1e9
            }
        }
    }
}

thread_local! {
    static EPOCH: Instant = Instant::now();
}
