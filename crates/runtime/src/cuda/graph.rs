//! CUDA graphs: a sequence of launches captured once and replayed with one call.
//!
//! A replay runs the same kernels with the same arguments, so everything that changes between replays
//! must be read by the kernels from device memory at fixed addresses (written before each replay).

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use super::device::CudaDevice;
use super::{CudaError, Result};

/// A captured and instantiated graph on a device's stream.
pub struct StepGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

// SAFETY: a graph exec is not bound to the thread that made it; CUDA requires only that calls on one
// graph are not made concurrently, which `&mut`-free replays through one owner (no `Sync`) ensure.
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Queues one replay on the device's stream.
    ///
    /// # Errors
    /// The driver refusing the launch.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().map_err(CudaError::driver("cuGraphLaunch"))
    }
}

impl CudaDevice {
    /// Captures every launch `record` queues on this device's stream into a graph (nothing runs during
    /// capture). `record` must not synchronise, copy to or from the host, or allocate; the cuBLAS handle
    /// must exist already ([`CudaDevice::init_blas`]) if it launches GEMMs.
    ///
    /// # Errors
    /// Whatever `record` returns (capture is ended first), or the driver failing to capture or
    /// instantiate.
    pub fn capture<E: From<CudaError>>(&self, record: impl FnOnce() -> Result<(), E>) -> Result<StepGraph, E> {
        let stream = self.stream();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(CudaError::driver("cuStreamBeginCapture"))?;
        let recorded = record();
        let ended = stream.end_capture(CUgraphInstantiate_flags(0));
        recorded?;
        match ended.map_err(CudaError::driver("cuStreamEndCapture / cuGraphInstantiate"))? {
            Some(graph) => Ok(StepGraph { graph }),
            None => Err(CudaError::Shape("graph capture recorded no work".into()).into()),
        }
    }
}
