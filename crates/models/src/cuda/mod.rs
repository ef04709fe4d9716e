//! The CUDA step plumbing every family's GPU forward shares (feature `cuda`), naming no family: the device cache
//! ([`CudaCache`]: KV pages, workspaces, graphs, and what a family adds), the step's input layout and attention
//! tiling (`plan`), the shared step runner and attention core (`step`), weights on the device (`weights`) and the
//! matmul dispatch (`linear`). The families' forwards sit in their own folders (`llama/cuda`, `hybrid/cuda`).
//!
//! Per step: one host-to-device copy of the inputs, then the kernels one by one, or for a batch whose sequences
//! all decode or verify the same number of rows, the replay of a graph captured for that (batch bucket, rows);
//! then the results come back after one synchronisation. A position is computed the same way however it is
//! batched (per-row quantized matmuls, attention, elementwise kernels; the small bf16 matmul up to 32 rows),
//! except dense matmuls past 32 rows, which go to cuBLAS. docs/CUDA.md has the kernels and the figures.

mod cache;
mod error;
mod linear;
mod plan;
mod step;
mod streams;
mod weights;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dflash_runtime::cuda::CudaDevice;

pub(crate) use cache::WorkspaceShape;
pub use cache::{CudaCache, CudaCacheConfig};
pub use error::CudaModelError;
pub(crate) use error::Result;
pub(crate) use linear::{Linear, MatIn, MatOut};
pub use plan::GRAPH_CONTEXTS;
pub(crate) use plan::{StepPlan, TileRows};
pub(crate) use step::{apply_masks, attend, collect_drawn, collect_out, Step};
pub(crate) use streams::{Block, DevStreams, Next, Tap};
pub(crate) use weights::{upload_norm, DevMatrix, DevProjection, DevWeight, MatrixKind};

use crate::error::ModelError;

/// A fresh id per model, tying caches (whose graphs hold a model's weight addresses) to their model.
pub(crate) fn next_model_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Opens CUDA device `ordinal` for a target.
///
/// # Errors
/// No such device, a driver or NVRTC failure.
pub(crate) fn open_device(ordinal: usize) -> crate::error::Result<Arc<CudaDevice>> {
    CudaDevice::new(ordinal).map(Arc::new).map_err(|e| match e.is_no_device() {
        true => ModelError::NoDevice(format!("no CUDA device {ordinal}: {e}")),
        false => ModelError::Device(format!("opening CUDA device {ordinal}: {e}")),
    })
}

/// The start-up line of a target's upload: the device, its memory, the weights and the kernels' compile.
pub(crate) fn log_upload(dev: &CudaDevice, weight_bytes: usize, started: std::time::Instant) {
    let info = dev.info();
    let report = dev.compile_report();
    tracing::info!(
        "target on cuda:{} ({}, {:.0} GiB, {} MiB of weights read per decode row) in {:.0} ms; kernels for {} {} in {:.0} ms",
        info.ordinal,
        info.name,
        info.total_memory as f64 / (1u64 << 30) as f64,
        weight_bytes >> 20,
        started.elapsed().as_secs_f64() * 1e3,
        report.arch,
        if report.cache_hit { "from the disk cache" } else { "compiled" },
        report.millis,
    );
}

/// Starts a section of the device's launch timeline named `name` (`DFLASH_KERNEL_TIMELINE=1`), logging the section
/// it closes: each launch's GPU time, at info level under the target `dflash_kernel_timeline`. Nothing while the
/// timeline is off; a failure to read it is logged, never returned (it is a diagnosis, not the work).
pub(crate) fn timeline_section(dev: &CudaDevice, name: impl FnOnce() -> String) {
    if !dev.timeline_on() {
        return;
    }
    match dev.timeline_section(name) {
        Ok(Some(report)) => tracing::info!(target: "dflash_kernel_timeline", "{report}"),
        Ok(None) => {}
        Err(e) => tracing::warn!(target: "dflash_kernel_timeline", "the launch timeline failed: {e}"),
    }
}
