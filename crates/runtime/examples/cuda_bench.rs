//! Timings of the CUDA kernels against the memory-bandwidth floor (a benchmark, never a test).
//!
//! `cargo build --release -p dflash-runtime --features cuda --example cuda_bench`, then run the binary on a
//! GPU machine (docs/CUDA.md). Prints one table: per kernel and shape, the median time over repeated
//! launches (CUDA events around each launch, after a warm-up), the bytes it must move, and the
//! bandwidth that makes, against the 4.3 TB/s measured for device-to-device copies on the H200 and
//! against this run's own copy measurement.

use std::error::Error;
use std::sync::Arc;

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaEvent;
use dflash_runtime::cuda::{ops as gpu, CudaDevice, CudaRopeTable, DeviceBuf};
use dflash_runtime::ops::{RopeScaling, RopeStyle, RopeTable};
use half::bf16;

type Res<T> = Result<T, Box<dyn Error>>;

/// Copy bandwidth measured on the H200 (read + write), the floor every figure is compared with.
const FLOOR_BYTES_PER_S: f64 = 4.3e12;

/// xorshift64*: inputs are random (never zeros, which can run faster than real data).
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }

    fn bf16_vec(&mut self, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.uniform())).collect()
    }
}

struct Bench<'a> {
    dev: &'a CudaDevice,
    copy_bytes_per_s: f64,
}

impl Bench<'_> {
    fn event(&self) -> Res<CudaEvent> {
        Ok(self.dev.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// Median milliseconds of `op` over `reps` launches, each between its own pair of events.
    fn median_ms(&self, reps: usize, mut op: impl FnMut(usize) -> Res<()>) -> Res<f64> {
        for i in 0..3 {
            op(i)?;
        }
        let stream = self.dev.stream();
        let mut pairs = Vec::with_capacity(reps);
        for i in 0..reps {
            let (start, end) = (self.event()?, self.event()?);
            start.record(stream)?;
            op(i)?;
            end.record(stream)?;
            pairs.push((start, end));
        }
        self.dev.synchronize()?;
        let mut times = pairs.iter().map(|(s, e)| s.elapsed_ms(e).map(f64::from)).collect::<Result<Vec<_>, _>>()?;
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Prints one row: time, bytes moved, bandwidth against the floor and against this run's copy.
    fn row(&self, what: &str, shape: &str, ms: f64, bytes: f64) {
        let bw = bytes / (ms * 1e-3);
        println!(
            "{what:<30} {shape:<22} {:>9.2} {:>9.1} {:>9.0} {:>7.0}% {:>7.0}%",
            ms * 1e3,
            bytes / 1e6,
            bw / 1e9,
            100.0 * bw / FLOOR_BYTES_PER_S,
            100.0 * bw / self.copy_bytes_per_s
        );
    }
}

fn main() -> Res<()> {
    let start = std::time::Instant::now();
    let dev = CudaDevice::new(0)?;
    let (info, report) = (dev.info(), dev.compile_report());
    println!(
        "{} (sm_{}{}, {} SMs, {:.0} GiB), NVRTC {}.{}: device open in {:.0} ms, kernels {} in {:.0} ms",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        info.total_memory as f64 / (1u64 << 30) as f64,
        info.nvrtc_version.0,
        info.nvrtc_version.1,
        start.elapsed().as_secs_f64() * 1e3,
        if report.cache_hit { "read from the cache" } else { "compiled" },
        report.millis
    );
    let copy_bytes_per_s = copy_bandwidth(&dev)?;
    println!("device-to-device copy, 1 GiB: {:.0} GB/s (read + write)\n", copy_bytes_per_s / 1e9);
    println!(
        "{:<30} {:<22} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "kernel", "shape", "us", "MB", "GB/s", "of 4.3T", "of copy"
    );
    let bench = Bench { dev: &dev, copy_bytes_per_s };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    bench_matmul(&bench, &mut rng)?;
    bench_row_ops(&bench, &mut rng)?;
    Ok(())
}

/// Bandwidth of a 1 GiB device-to-device copy (2 GiB moved), the ceiling for the memory-bound kernels.
fn copy_bandwidth(dev: &CudaDevice) -> Res<f64> {
    let len = 1usize << 30;
    let src = dev.upload(&vec![0x5au8; len])?;
    let mut dst = dev.alloc_zeros::<u8>(len)?;
    let bench = Bench { dev, copy_bytes_per_s: 1.0 };
    let ms = bench.median_ms(10, |_| {
        dev.stream().memcpy_dtod(src.as_slice(), dst.as_slice_mut())?;
        Ok(())
    })?;
    Ok(2.0 * len as f64 / (ms * 1e-3))
}

fn bench_matmul(bench: &Bench, rng: &mut Rng) -> Res<()> {
    let dev = bench.dev;
    let (n, k) = (8192usize, 8192usize);
    // Two weight matrices, used alternately: 256 MB, several times the L2.
    let weights = [dev.upload(&rng.bf16_vec(n * k))?, dev.upload(&rng.bf16_vec(n * k))?];
    let max_rows = 128;
    let mut scratch = dev.alloc_zeros::<bf16>(max_rows * k)?;
    let bytes = |m: usize| (n * k * 2 + m * k * 4 + m * n * 4) as f64;
    for m in [1usize, 2, 4, 8] {
        let xm = dev.upload(&rng.vec(m * k))?;
        let mut y = dev.alloc_zeros::<f32>(m * n)?;
        let ms = bench.median_ms(50, |i| Ok(gpu::gemv_bf16(dev, &xm, &weights[i % 2], n, &mut y)?))?;
        bench.row("gemv_bf16 (ours)", &format!("{m}x{k} . {n}x{k}"), ms, bytes(m));
    }
    gemv_graph(bench, &weights, n, k)?;
    for m in [1usize, 8, 16, 32, 128] {
        let xm = dev.upload(&rng.vec(m * k))?;
        let mut y = dev.alloc_zeros::<f32>(m * n)?;
        let ms = bench.median_ms(50, |i| Ok(gpu::gemm_bf16(dev, &xm, &weights[i % 2], n, &mut y, &mut scratch)?))?;
        bench.row("gemm_bf16 (cuBLAS + cast)", &format!("{m}x{k} . {n}x{k}"), ms, bytes(m));
    }
    Ok(())
}

/// The m = 1 GEMV replayed from a CUDA graph of 20 launches: the per-launch host cost drops out.
fn gemv_graph(bench: &Bench, weights: &[DeviceBuf<bf16>; 2], n: usize, k: usize) -> Res<()> {
    let dev = bench.dev;
    let x = dev.upload(&Rng(7).vec(k))?;
    let mut y = dev.alloc_zeros::<f32>(n)?;
    let launches = 20;
    let stream: &Arc<_> = dev.stream();
    dev.synchronize()?;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    for i in 0..launches {
        gpu::gemv_bf16(dev, &x, &weights[i % 2], n, &mut y)?;
    }
    let graph = stream.end_capture(CUgraphInstantiate_flags(0))?.ok_or("empty graph")?;
    graph.upload()?;
    let ms = bench.median_ms(20, |_| Ok(graph.launch()?))? / launches as f64;
    bench.row("gemv_bf16 in a CUDA graph", &format!("1x{k} . {n}x{k}"), ms, (n * k * 2 + k * 4 + n * 4) as f64);
    Ok(())
}

/// The row kernels at prefill sizes (4096 rows), where they are memory-bound too.
fn bench_row_ops(bench: &Bench, rng: &mut Rng) -> Res<()> {
    let dev = bench.dev;
    let (rows, h) = (4096usize, 4096usize);
    let x = dev.upload(&rng.vec(rows * h))?;
    let w = dev.upload(&rng.vec(h))?;
    let mut out = dev.alloc_zeros::<f32>(rows * h)?;
    let elems = (rows * h) as f64;
    let shape = format!("{rows}x{h}");
    let ms = bench.median_ms(20, |_| Ok(gpu::rms_norm(dev, &x, &w, 1e-6, &mut out)?))?;
    bench.row("rms_norm", &shape, ms, 8.0 * elems);
    let mut residual = dev.upload(&rng.vec(rows * h))?;
    let ms = bench.median_ms(20, |_| Ok(gpu::add_rms_norm(dev, &mut residual, &x, &w, 1e-6, &mut out)?))?;
    bench.row("add_rms_norm", &shape, ms, 16.0 * elems);

    let inter = 12288usize;
    let gate_up = dev.upload(&rng.vec(rows * 2 * inter))?;
    let mut act = dev.alloc_zeros::<f32>(rows * inter)?;
    let ms = bench.median_ms(20, |_| Ok(gpu::swiglu_fused(dev, &gate_up, &mut act, rows)?))?;
    bench.row("swiglu_fused", &format!("{rows}x{inter}"), ms, 12.0 * (rows * inter) as f64);

    let (heads, head_dim) = (32usize, 128usize);
    let table = RopeTable::new(head_dim, 1_000_000.0, &RopeScaling::None, RopeStyle::Neox)?;
    let table_dev = CudaRopeTable::new(dev, &table, rows)?;
    let positions = dev.upload(&(0..rows as u32).collect::<Vec<_>>())?;
    let mut q = dev.upload(&rng.vec(rows * heads * head_dim))?;
    let ms = bench.median_ms(20, |_| Ok(gpu::rope(dev, &mut q, head_dim, &positions, &table_dev)?))?;
    bench.row("rope neox", &format!("{rows}x{heads}x{head_dim}"), ms, 8.0 * (rows * heads * head_dim) as f64);

    let vocab = 32_000usize;
    let table = dev.upload(&rng.bf16_vec(vocab * h))?;
    let ids: Vec<u32> = (0..rows as u32).map(|i| i.wrapping_mul(7919) % vocab as u32).collect();
    let ids = dev.upload(&ids)?;
    let ms = bench.median_ms(20, |_| Ok(gpu::embedding_bf16(dev, &table, &ids, &mut out)?))?;
    bench.row("embedding_bf16", &format!("{rows} ids x {h}"), ms, 6.0 * elems);

    let vocab = 151_936usize;
    for batch in [1usize, 64] {
        let logits = dev.upload(&rng.vec(batch * vocab))?;
        let mut best = dev.alloc_zeros::<u32>(batch)?;
        let scratch = gpu::ArgmaxScratch::new(dev, batch, vocab)?;
        let ms = bench.median_ms(50, |_| Ok(gpu::argmax_rows(dev, &logits, vocab, &mut best, &scratch)?))?;
        bench.row("argmax_rows", &format!("{batch}x{vocab}"), ms, 4.0 * (batch * vocab) as f64);
    }
    Ok(())
}
