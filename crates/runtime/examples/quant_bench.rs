//! Benchmarks the quantized matmul kernels on the default model's shapes (SmolLM2-135M: Q4_1 layers with
//! fused q/k/v and gate/up, Q8_0 LM head): read bandwidth, decode (m = 1) per-token time against it, prefill
//! (m = 512) GFLOP/s, and the per-call dispatch overhead inside and outside the pool.
//!
//! ```text
//! cargo run --release -p dflash-runtime --example quant_bench            # RAYON_NUM_THREADS, default 2
//! cargo run --release -p dflash-runtime --example quant_bench -- --cpu-time   # on-CPU time, single thread
//! cargo run --release -p dflash-runtime --example quant_bench -- --decode     # decode part, 3 times
//! cargo run --release -p dflash-runtime --example quant_bench -- --levels avx2,avx512 --rounds 3
//! cargo run --release -p dflash-runtime --example quant_bench -- --act-precision int8   # one activation pass
//! cargo run --release -p dflash-runtime --example quant_bench -- --ladder 1,2,3,4,8   # a step's matmuls by rows
//! ```
//! The SIMD level is the CPU's best, or the one `DFLASH_SIMD` (`scalar`, `avx2`, `avx512`) asks for.
//!
//! What the options measure and why: docs/KERNELS.md, "The kernel lab".

use std::hint::black_box;
use std::time::{Duration, Instant};

use dflash_runtime::{quant, DType};
use rayon::prelude::*;

const LAYERS: usize = 30;
/// Per layer `[n, k]`: fused q/k/v, o, fused gate/up, down.
const LAYER_SHAPES: [(&str, usize, usize); 4] =
    [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)];
const LM_HEAD: (usize, usize) = (49152, 576);
const PREFILL_M: usize = 512;

fn main() {
    // The activations' precision (`quant::ActPrecision`): the library's default (two passes) unless asked.
    match arg_value("--act-precision").as_deref() {
        None | Some("int8x2") => quant::set_act_precision(quant::ActPrecision::Int8x2),
        Some("int8") => quant::set_act_precision(quant::ActPrecision::Int8),
        Some(other) => panic!("--act-precision {other}: expected int8 or int8x2"),
    }
    if std::env::args().any(|a| a == "--cpu-time") {
        return cpu_time_kernels();
    }
    if let Some(rows) = arg_value("--ladder") {
        return ladder(&rows);
    }
    if let Some(levels) = arg_value("--levels") {
        let rounds = arg_value("--rounds").and_then(|r| r.parse().ok()).unwrap_or(3);
        return compare_levels(&levels, rounds);
    }
    let threads = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    println!("simd: {}, threads: {threads}, activations {:?}", quant::simd_level(), quant::act_precision());
    let decode_only = std::env::args().any(|a| a == "--decode");
    let once = std::env::args().any(|a| a == "--decode-once");
    pool.install(|| {
        let model = Model::new();
        if once {
            let figures = decode(&model, bandwidth());
            println!("{SUMMARY} {}", figures.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(" "));
            return;
        }
        for _ in 0..if decode_only { 3 } else { 1 } {
            let bw = bandwidth();
            decode(&model, bw);
        }
        if decode_only {
            return;
        }
        prefill(&model);
        println!("\nper-call overhead, called from a pool thread (calls back to back):");
        overhead();
    });
    if decode_only || once {
        return;
    }
    println!("\nper-call overhead, called from the main thread (global pool of {threads}):");
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().expect("global pool");
    overhead();
}

/// Median and minimum of `reps` timings of `f` (after one warm-up call).
fn timings(reps: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    f();
    let mut t: Vec<Duration> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    t.sort();
    (t[reps / 2], t[0])
}

/// Read bandwidth of a parallel sum over a 256 MB buffer, GB/s (median of 7).
fn bandwidth() -> f64 {
    let buf: Vec<u64> = (0..(256usize << 20) / 8).map(|i| i as u64).collect();
    let chunk = buf.len().div_ceil(rayon::current_num_threads());
    let (t, _) = timings(7, || {
        let s: u64 = buf.par_chunks(chunk).map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v))).sum();
        black_box(s);
    });
    let gbs = (buf.len() * 8) as f64 / t.as_secs_f64() / 1e9;
    println!("read bandwidth (parallel sum over 256 MB): {gbs:.1} GB/s");
    gbs
}

struct Matrix {
    dtype: DType,
    n: usize,
    k: usize,
    bytes: Vec<u8>,
}

impl Matrix {
    fn random(dtype: DType, n: usize, k: usize, seed: u64) -> Self {
        let row_bytes = dtype.bytes_for(k).expect("whole blocks");
        let mut bytes = vec![0u8; n * row_bytes];
        let vals = random_values(k * 64, seed);
        // 64 distinct quantized rows, repeated: the values do not matter for speed, only the layout.
        for (r, row) in bytes.chunks_mut(row_bytes).enumerate() {
            quant::quantize_row(dtype, &vals[(r % 64) * k..(r % 64 + 1) * k], row);
        }
        Matrix { dtype, n, k, bytes }
    }

    fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        quant::matmul(self.dtype, &self.bytes, self.n, self.k, &x[..m * self.k], m, &mut y[..m * self.n]);
    }

    fn gflop(&self, m: usize) -> f64 {
        2.0 * (m * self.n * self.k) as f64 / 1e9
    }
}

/// 30 layers of distinct weight copies (so decode streams from memory as the real model does) + LM head.
struct Model {
    layers: Vec<[Matrix; 4]>,
    lm_head: Matrix,
}

impl Model {
    fn new() -> Self {
        let proto: Vec<Matrix> = LAYER_SHAPES
            .iter()
            .enumerate()
            .map(|(i, &(_, n, k))| Matrix::random(DType::Q4_1, n, k, i as u64))
            .collect();
        let layers = (0..LAYERS)
            .map(|_| std::array::from_fn(|i| Matrix { bytes: proto[i].bytes.clone(), ..proto[i] }))
            .collect();
        let lm_head = Matrix::random(DType::Q8_0, LM_HEAD.0, LM_HEAD.1, 9);
        Model { layers, lm_head }
    }

    fn bytes(&self) -> usize {
        self.layers.iter().flatten().chain([&self.lm_head]).map(|m| m.bytes.len()).sum()
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

/// The value after `flag` on the command line.
fn arg_value(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == flag).and_then(|p| args.get(p + 1).cloned())
}

/// Marks the line in which a `--decode-once` child reports its figures to `compare_levels`.
const SUMMARY: &str = "decode-figures:";

/// Runs the decode part once per level per round in child processes (`DFLASH_SIMD=<level>`), alternating the
/// levels, and prints the median of each figure per level.
fn compare_levels(levels: &str, rounds: usize) {
    let levels: Vec<&str> = levels.split(',').map(str::trim).filter(|l| !l.is_empty()).collect();
    let exe = std::env::current_exe().expect("path of this executable");
    // `[level][figure]`: every round's value.
    let mut figures: Vec<Vec<Vec<f64>>> = vec![Vec::new(); levels.len()];
    let mut names = vec![String::new(); levels.len()];
    for round in 0..rounds {
        for (l, level) in levels.iter().enumerate() {
            let precision = arg_value("--act-precision").unwrap_or_else(|| "int8x2".into());
            let out = std::process::Command::new(&exe)
                .args(["--decode-once", "--act-precision", &precision])
                .env("DFLASH_SIMD", level)
                .output()
                .expect("running the decode child");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "DFLASH_SIMD={level} child failed: {}", String::from_utf8_lossy(&out.stderr));
            let simd = text.lines().find_map(|l| l.strip_prefix("simd: ")).unwrap_or("?");
            names[l] = simd.split(',').next().unwrap_or(simd).to_string();
            let values: Vec<f64> = text
                .lines()
                .find_map(|l| l.strip_prefix(SUMMARY))
                .map(|v| v.split_whitespace().filter_map(|f| f.parse().ok()).collect())
                .unwrap_or_default();
            println!("round {} DFLASH_SIMD={level} ({}): {values:.1?}", round + 1, names[l]);
            for (i, v) in values.into_iter().enumerate() {
                if figures[l].len() <= i {
                    figures[l].push(Vec::new());
                }
                figures[l][i].push(v);
            }
        }
    }
    let labels: Vec<String> = LAYER_SHAPES
        .iter()
        .map(|(name, n, k)| format!("{name} {n}x{k} q4_1, us"))
        .chain([format!("lm_head {}x{} q8_0, us", LM_HEAD.0, LM_HEAD.1), "per token, ms".into(), "read GB/s".into()])
        .collect();
    println!("\nmedians of {rounds} rounds (decode, m = 1):");
    println!("  {:32} {}", "", names.iter().map(|n| format!("{n:>12}")).collect::<String>());
    for (i, label) in labels.iter().enumerate() {
        let cells: String = figures
            .iter()
            .map(|f| f.get(i).map(|v| format!("{:>12.2}", median(v))).unwrap_or_else(|| format!("{:>12}", "-")))
            .collect();
        println!("  {label:32} {cells}");
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prints the decode figures and returns them: per layer shape and for the LM head the median microseconds
/// per call, then the median milliseconds per token and the read bandwidth (GB/s).
fn decode(model: &Model, bw: f64) -> Vec<f64> {
    let mut figures = Vec::new();
    println!("\ndecode (m = 1), each shape cycled through its {LAYERS} copies; median:");
    let x = random_values(1536, 1);
    let mut y = vec![0f32; LM_HEAD.0];
    for (i, &(name, n, k)) in LAYER_SHAPES.iter().enumerate() {
        let (t, _) = timings(9, || model.layers.iter().for_each(|layer| layer[i].matmul(&x, 1, &mut y)));
        let t = t.as_secs_f64() / LAYERS as f64;
        let gbs = model.layers[0][i].bytes.len() as f64 / t / 1e9;
        println!("  {name:8} {n:5}x{k:<5} q4_1 {:8.1} us  {gbs:6.1} GB/s", t * 1e6);
        figures.push(t * 1e6);
    }
    let (t, _) = timings(9, || model.lm_head.matmul(&x, 1, &mut y));
    let gbs = model.lm_head.bytes.len() as f64 / t.as_secs_f64() / 1e9;
    println!("  lm_head  {}x{} q8_0 {:8.1} us  {gbs:6.1} GB/s", LM_HEAD.0, LM_HEAD.1, t.as_secs_f64() * 1e6);
    figures.push(t.as_secs_f64() * 1e6);
    let (median, best) = timings(9, || {
        model.layers.iter().flatten().for_each(|mat| mat.matmul(&x, 1, &mut y));
        model.lm_head.matmul(&x, 1, &mut y);
    });
    let mb = model.bytes() as f64 / 1e6;
    for (what, t) in [("median", median), ("best", best)] {
        let gbs = mb / 1e3 / t.as_secs_f64();
        println!(
            "  per token, {what} ({} calls, {mb:.1} MB): {:.2} ms = {:.0} tok/s, {gbs:.1} GB/s = {:.0}% of read bandwidth",
            LAYERS * 4 + 1,
            t.as_secs_f64() * 1e3,
            1.0 / t.as_secs_f64(),
            100.0 * gbs / bw
        );
    }
    figures.extend([median.as_secs_f64() * 1e3, bw]);
    figures
}

/// The verify ladder of the matmuls: one step's every matrix (all layers and the LM head) at each row count,
/// median ms and the ratio to one row. This is what a verify of `m` rows costs the target beyond one plain step.
fn ladder(rows: &str) {
    let rows: Vec<usize> = rows.split(',').map(|r| r.trim().parse().expect("--ladder takes row counts")).collect();
    let threads = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
    println!("simd: {}, threads: {threads}, activations {:?}", quant::simd_level(), quant::act_precision());
    pool.install(|| {
        let model = Model::new();
        let most = rows.iter().copied().max().unwrap_or(1);
        let x = random_values(most * 1536, 3);
        let mut y = vec![0f32; most * LM_HEAD.0];
        let mut one = None;
        for &m in &rows {
            let (median, _) = timings(9, || {
                model.layers.iter().flatten().for_each(|mat| mat.matmul(&x[..m * mat.k], m, &mut y[..m * mat.n]));
                model.lm_head.matmul(&x[..m * LM_HEAD.1], m, &mut y[..m * LM_HEAD.0]);
            });
            let ms = median.as_secs_f64() * 1e3;
            let base = *one.get_or_insert(ms);
            println!("  {m:3} rows: {ms:7.2} ms  {:.2}x one row", ms / base);
        }
    });
}

fn prefill(model: &Model) {
    println!("\nprefill (m = {PREFILL_M}), median (best):");
    let x = random_values(PREFILL_M * 1536, 2);
    let mut y = vec![0f32; PREFILL_M * LM_HEAD.0.max(3072)];
    let (mut gflop, mut median_s, mut best_s) = (0.0, 0.0, 0.0);
    for (i, &(name, n, k)) in LAYER_SHAPES.iter().enumerate() {
        let mat = &model.layers[0][i];
        let (median, best) = timings(7, || mat.matmul(&x, PREFILL_M, &mut y));
        let (median, best) = (median.as_secs_f64(), best.as_secs_f64());
        gflop += mat.gflop(PREFILL_M);
        median_s += median;
        best_s += best;
        let rate = mat.gflop(PREFILL_M);
        println!(
            "  {name:8} {n:5}x{k:<5} q4_1 {:7.2} ms  {:6.1} ({:.1}) GFLOP/s",
            median * 1e3,
            rate / median,
            rate / best
        );
    }
    println!(
        "  all layer shapes: {:.1} ({:.1}) GFLOP/s -> {:.0} ({:.0}) tok/s for {LAYERS} layers (matmuls only)",
        gflop / median_s,
        gflop / best_s,
        PREFILL_M as f64 / (median_s * LAYERS as f64),
        PREFILL_M as f64 / (best_s * LAYERS as f64)
    );
    let head = &model.lm_head;
    for m in [4, 64] {
        let (t, _) = timings(3, || head.matmul(&x, m, &mut y));
        println!("  lm_head q8_0 m={m}: {:.1} GFLOP/s", head.gflop(m) / t.as_secs_f64());
    }
}

/// Cost of a call split across the pool: a 256x576 Q4_1 matvec (~92 KB, ~9 us on one core).
fn overhead() {
    let calls = 2000;
    let per_call =
        |f: &mut dyn FnMut()| timings(5, || (0..calls).for_each(|_| f())).0.as_secs_f64() / calls as f64 * 1e6;
    let tiny = Matrix::random(DType::Q4_1, 8, 64, 5);
    let mut y = vec![0f32; 256];
    let x = random_values(576, 8);
    let serial = per_call(&mut || tiny.matmul(&x, 1, &mut y));
    let split = Matrix::random(DType::Q4_1, 256, 576, 7);
    let parallel = per_call(&mut || split.matmul(&x, 1, &mut y));
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    let single = one.install(|| per_call(&mut || split.matmul(&x, 1, &mut y)));
    let empty = per_call(&mut || {
        (0..4).into_par_iter().with_max_len(1).for_each(|i| {
            black_box(i);
        })
    });
    let threads = rayon::current_num_threads() as f64;
    println!("  tiny 8x64 (stays on the caller): {serial:.2} us/call");
    println!(
        "  256x576 split: {parallel:.2} us/call vs {single:.2} us on 1 thread -> overhead ~{:.1} us/call",
        parallel - single / threads
    );
    println!("  empty 4-job par_iter: {empty:.2} us/call");
}

/// Single-thread kernel timings in on-CPU time (best of 7 runs of ~0.2 s).
fn cpu_time_kernels() {
    fn cpu_ns() -> f64 {
        let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("Linux schedstat");
        stat.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()).expect("on-CPU time")
    }
    println!("single thread, best of 7 runs, on-CPU time:");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
    pool.install(|| {
        let shapes = LAYER_SHAPES.iter().map(|&(name, n, k)| (name, DType::Q4_1, n, k));
        let others =
            [("head/12", DType::Q8_0, 4096, 576), ("down", DType::Q4K, 576, 1536), ("down", DType::Q6K, 576, 1536)];
        for (name, dtype, n, k) in shapes.chain(others) {
            let mat = Matrix::random(dtype, n, k, 1);
            for m in [1usize, 2, 4, 512] {
                let x = random_values(m * k, 2);
                let mut y = vec![0f32; m * n];
                // On-CPU time may be accounted per scheduler tick: make each run ~0.2 s long.
                let start = Instant::now();
                mat.matmul(&x, m, &mut y);
                let reps = (0.2 / start.elapsed().as_secs_f64().max(1e-7)).clamp(2.0, 20_000.0) as usize;
                let mut t = f64::MAX;
                for _ in 0..7 {
                    let start = cpu_ns();
                    (0..reps).for_each(|_| mat.matmul(&x, m, &mut y));
                    t = t.min((cpu_ns() - start) / reps as f64 / 1e9);
                }
                let gbs = mat.bytes.len() as f64 / t / 1e9;
                println!(
                    "  {name:8} {dtype} m={m:3}: {:9.1} us {:6.1} GFLOP/s {gbs:6.1} GB/s",
                    t * 1e6,
                    mat.gflop(m) / t
                );
            }
        }
    });
}
