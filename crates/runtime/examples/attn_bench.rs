//! Benchmarks `paged_attention` on the default model's shapes (SmolLM2-135M: 9 query heads over 3 kv heads,
//! head_dim 64, pages of 16 slots, 30 layers, each with its own cache): a 512-row causal prefill, the 18-row
//! chunk that continues it (the 530-token bench prompt), an 8-row verify step and a decode row.
//!
//! ```text
//! cargo run --release -p dflash-runtime --example attn_bench            # RAYON_NUM_THREADS, default 2
//! cargo run --release -p dflash-runtime --example attn_bench -- --cpu-time   # 1 thread, on-CPU time
//! ```
//! Each figure is the median (and minimum) of 9 passes over the 30 layers, after one warm-up pass; GFLOP/s
//! counts 4 · head_dim flops per (query head, attended key) pair: scores and the weighted values.
//! `--cpu-time` runs on one thread and times in on-CPU time (Linux `schedstat`), which stays meaningful on
//! a machine shared with other jobs; wall-clock figures there swing with the neighbours' load.

use std::hint::black_box;
use std::time::{Duration, Instant};

use dflash_runtime::ops::{kv_write, paged_attention, AttnSeq, RowKernel};
use dflash_runtime::{threads, DType, Tensor};

const LAYERS: usize = 30;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const PAGE: usize = 16;
const REPS: usize = 9;

fn main() {
    let cpu_time = std::env::args().any(|a| a == "--cpu-time");
    let n = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let n = threads::init(Some(if cpu_time { 1 } else { n }));
    let clock = if cpu_time { "on-CPU time" } else { "wall clock" };
    println!("threads: {n} ({clock}); {LAYERS} layers of {HEADS} heads over {KV_HEADS} kv heads, head_dim {HEAD_DIM}");
    // (what, context_len, rows, kernel): the prompt's first chunk and its tail (prompt rows: tiled), a
    // verify step and a decode step (generated rows: per row).
    let shapes = [
        ("prefill 512", 0, 512, RowKernel::Tiled),
        ("chunk 18 after 512", 512, 18, RowKernel::Tiled),
        ("verify 8 after 512", 512, 8, RowKernel::PerRow),
        ("decode 1 after 530", 530, 1, RowKernel::PerRow),
    ];
    threads::install(|| {
        for (what, context_len, rows, kernel) in shapes {
            bench(what, context_len, rows, kernel, cpu_time);
        }
    });
}

/// One layer's cache holding `keys` tokens in shuffled pages.
struct Layer {
    k_cache: Tensor, // [pages, PAGE, KV_HEADS, HEAD_DIM]
    v_cache: Tensor,
}

fn bench(what: &str, context_len: usize, rows: usize, kernel: RowKernel, cpu_time: bool) {
    let keys = context_len + rows;
    let pages = keys.div_ceil(PAGE);
    // Pages in a scattered order, as the allocator hands them out after some churn (a permutation: 7 is
    // coprime to every page count here).
    let table: Vec<u32> = (0..pages as u32).map(|p| (p * 7) % pages as u32).collect();
    let layers: Vec<Layer> = (0..LAYERS).map(|l| layer(&table, keys, l as u64)).collect();
    // One batch of queries for all layers: in the model each layer's were just written, so they are
    // cache-resident as these are.
    let q = Tensor::from_f32(&random_values(rows * HEADS * HEAD_DIM, 7), &[rows, HEADS * HEAD_DIM]).expect("q");
    let seq = AttnSeq { first_row: 0, num_rows: rows, context_len, block_table: &table, kernel };
    let mut out = Tensor::zeros(DType::F32, &[rows, HEADS * HEAD_DIM]).expect("out");
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let mut pass = || {
        for l in &layers {
            paged_attention(&q, &l.k_cache, &l.v_cache, &[seq], HEADS, KV_HEADS, HEAD_DIM, scale, true, None, &mut out)
                .expect("paged_attention");
            black_box(&out);
        }
    };
    pass();
    let mut times: Vec<Duration> = (0..REPS)
        .map(|_| {
            let (start, cpu_start) = (Instant::now(), on_cpu_ns());
            pass();
            if cpu_time {
                Duration::from_nanos(on_cpu_ns() - cpu_start)
            } else {
                start.elapsed()
            }
        })
        .collect();
    times.sort();
    // Causal: row j attends context_len + j + 1 keys.
    let pairs: usize = (0..rows).map(|j| context_len + j + 1).sum();
    let gflop = (LAYERS * pairs * HEADS * 4 * HEAD_DIM) as f64 / 1e9;
    let (median, min) = (times[REPS / 2], times[0]);
    println!(
        "{what:>20}: {:8.3} ms per {LAYERS} layers (min {:.3}), {:6.1} GFLOP/s",
        median.as_secs_f64() * 1e3,
        min.as_secs_f64() * 1e3,
        gflop / median.as_secs_f64()
    );
}

fn layer(table: &[u32], keys: usize, seed: u64) -> Layer {
    let shape = [table.len(), PAGE, KV_HEADS, HEAD_DIM];
    let mut k_cache = Tensor::zeros(DType::F32, &shape).expect("k cache");
    let mut v_cache = Tensor::zeros(DType::F32, &shape).expect("v cache");
    let kv_len = KV_HEADS * HEAD_DIM;
    let k = Tensor::from_f32(&random_values(keys * kv_len, seed * 2 + 1), &[keys, kv_len]).expect("k");
    let v = Tensor::from_f32(&random_values(keys * kv_len, seed * 2 + 2), &[keys, kv_len]).expect("v");
    let slots: Vec<u32> = (0..keys).map(|t| table[t / PAGE] * PAGE as u32 + (t % PAGE) as u32).collect();
    kv_write(&mut k_cache, &mut v_cache, &k, &v, &slots).expect("kv_write");
    Layer { k_cache, v_cache }
}

/// On-CPU time of the calling thread so far, in ns (0 where `schedstat` is missing).
fn on_cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    stat.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Values in [-1, 1) from a xorshift generator: reproducible without a dependency.
fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            ((state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
