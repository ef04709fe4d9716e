//! [`CudaDevice`]: a context on one GPU with its stream, kernels and cuBLAS handle; [`DeviceBuf`]: typed
//! device memory.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use std::ffi::c_void;

use cudarc::cublas::sys::cublasSetWorkspace_v2;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};

use super::compile::{self, CompileReport};
use super::kernels::Kernels;
use super::launch::{self, KernelLaunch};
use super::loader::{self, ALL_LIBS};
use super::timeline::Timeline;
use super::{CudaError, Result};

/// Bytes of the fixed cuBLAS workspace (what cuBLAS asks for on Hopper, with room).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// What a device is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability `(major, minor)`: (9, 0) on Hopper.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: usize,
    pub multiprocessors: i32,
    /// L2 cache in bytes.
    pub l2_bytes: usize,
    /// The NVRTC version kernels are compiled with.
    pub nvrtc_version: (i32, i32),
}

/// One GPU: a context (the device's primary context), one non-default stream that all work goes to,
/// our kernels loaded for the device's architecture, and a cuBLAS handle made on first use.
///
/// Shareable between threads: launches from several threads go to the one stream in some order, and
/// the cuBLAS handle is behind a lock.
#[derive(Debug)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub(crate) kernels: Kernels,
    /// Whether our kernels are launched with programmatic dependent launch (see [`super::launch`]).
    pdl: bool,
    blas: OnceLock<Mutex<CudaBlas>>,
    /// cuBLAS's workspace, fixed so that GEMMs can be captured into CUDA graphs (no allocation inside).
    blas_workspace: OnceLock<DeviceBuf<u8>>,
    info: DeviceInfo,
    compile_report: CompileReport,
    /// Launch timing for diagnosis (`DFLASH_KERNEL_TIMELINE=1`; see [`super::timeline`]).
    pub(crate) timeline: Option<Mutex<Timeline>>,
}

/// Number of CUDA devices visible to this process.
///
/// # Errors
/// A CUDA library missing, or the driver failing to initialise ([`CudaError::NoDevice`]: no GPU, or a
/// driver too old for CUDA 13).
pub fn device_count() -> Result<usize> {
    loader::ensure_loaded(&ALL_LIBS)?;
    let count =
        CudaContext::device_count().map_err(|e| CudaError::NoDevice(format!("cuInit / cuDeviceGetCount: {e:?}")))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

impl CudaDevice {
    /// Number of CUDA devices visible to this process; see [`device_count`].
    ///
    /// # Errors
    /// As [`device_count`].
    pub fn count() -> Result<usize> {
        device_count()
    }

    /// Opens device `ordinal`: finds the libraries, creates the stream and compiles (or reads from the
    /// cache) and loads the kernels.
    ///
    /// # Errors
    /// A missing library, no such device, or a driver / NVRTC failure; each says what is wrong.
    pub fn new(ordinal: usize) -> Result<Self> {
        let count = device_count()?;
        if count == 0 {
            return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
        }
        if ordinal >= count {
            return Err(CudaError::BadOrdinal { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: every buffer of this device is used on `stream` only (see the module docs), so cudarc's
        // cross-stream events are not needed; without them launches are also capturable into graphs.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(CudaError::driver("cuStreamCreate"))?;
        let (kernels, compile_report) = Kernels::load(&ctx)?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(CudaError::driver("cuDeviceGetName"))?,
            compute_capability: ctx.compute_capability().map_err(CudaError::driver("cuDeviceGetAttribute"))?,
            total_memory: ctx.total_mem().map_err(CudaError::driver("cuDeviceTotalMem"))?,
            multiprocessors: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(CudaError::driver("cuDeviceGetAttribute"))?,
            l2_bytes: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
                .map_err(CudaError::driver("cuDeviceGetAttribute"))?
                .max(0) as usize,
            nvrtc_version: compile::nvrtc_version()?,
        };
        let pdl = launch::pdl_enabled(info.compute_capability);
        Ok(CudaDevice {
            ctx,
            stream,
            kernels,
            pdl,
            blas: OnceLock::new(),
            blas_workspace: OnceLock::new(),
            info,
            compile_report,
            timeline: crate::switches::switches().kernel_timeline.then(Mutex::default),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Device memory free now, in bytes.
    ///
    /// # Errors
    /// A driver failure.
    pub fn free_memory(&self) -> Result<usize> {
        let (free, _total) = self.ctx.mem_get_info().map_err(CudaError::driver("cuMemGetInfo"))?;
        Ok(free)
    }

    /// How the kernels were obtained (cache hit or compile, and its time).
    pub fn compile_report(&self) -> &CompileReport {
        &self.compile_report
    }

    /// The cudarc context, for work this module does not wrap (events, graphs).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all of this device's work goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A launch of our kernel `func` on the device's stream (with PDL where the device has it).
    pub(crate) fn launch_builder<'a>(&'a self, func: &'a CudaFunction) -> KernelLaunch<'a> {
        KernelLaunch::new(func, self, self.pdl)
    }

    /// Whether kernels are launched with programmatic dependent launch (compute capability 9.0 and up, unless
    /// `DFLASH_PDL=0`).
    pub fn uses_pdl(&self) -> bool {
        self.pdl
    }

    /// Waits until all work queued on the stream has finished, surfacing errors of earlier launches.
    ///
    /// # Errors
    /// Any failure of the queued work (an illegal address in a kernel, say).
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(CudaError::driver("cuStreamSynchronize"))
    }

    /// Makes the cuBLAS handle now (it is otherwise made on first use): call before capturing a CUDA
    /// graph that contains GEMMs, since creating the handle allocates.
    ///
    /// # Errors
    /// cuBLAS failing to create its handle or take its workspace.
    pub fn init_blas(&self) -> Result<()> {
        self.blas().map(|_| ())
    }

    /// The cuBLAS handle (made on first use, bound to the stream, with a fixed workspace), locked for one
    /// call.
    ///
    /// # Errors
    /// cuBLAS failing to create its handle or take its workspace.
    pub(crate) fn blas(&self) -> Result<MutexGuard<'_, CudaBlas>> {
        if self.blas.get().is_none() {
            let blas = CudaBlas::new(self.stream.clone())
                .map_err(|source| CudaError::Cublas { what: "cublasCreate".into(), source })?;
            let workspace: DeviceBuf<u8> = self.alloc_zeros(BLAS_WORKSPACE_BYTES)?;
            let ptr = workspace.view().device_ptr();
            // SAFETY: the handle is live and the workspace is a device allocation of the size given; it is
            // kept next to the handle and dropped after it (field order).
            unsafe { cublasSetWorkspace_v2(*blas.handle(), ptr as *mut c_void, BLAS_WORKSPACE_BYTES) }
                .result()
                .map_err(|source| CudaError::Cublas { what: "cublasSetWorkspace".into(), source })?;
            // Another thread may have won the race; its handle is as good as ours, and ours goes with
            // its workspace.
            if self.blas.set(Mutex::new(blas)).is_ok() {
                let _ = self.blas_workspace.set(workspace);
            }
        }
        let blas = self.blas.get().ok_or_else(|| CudaError::NoDevice("cuBLAS handle vanished".into()))?;
        Ok(blas.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// A device buffer of `len` zeroed elements.
    ///
    /// # Errors
    /// Out of device memory.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<DeviceBuf<T>> {
        let slice = self.stream.alloc_zeros(len).map_err(CudaError::driver("cuMemAllocAsync"))?;
        Ok(DeviceBuf { slice })
    }

    /// A device buffer holding a copy of `host`.
    ///
    /// # Errors
    /// Out of device memory, or the copy failing.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<DeviceBuf<T>> {
        let slice = self.stream.clone_htod(host).map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        Ok(DeviceBuf { slice })
    }

    /// Copies `host` into `dst`, which must have the same length.
    ///
    /// # Errors
    /// A length mismatch, or the copy failing.
    pub fn upload_into<T: DeviceRepr>(&self, host: &[T], dst: &mut DeviceBuf<T>) -> Result<()> {
        if host.len() != dst.len() {
            return Err(CudaError::Shape(format!("upload of {} elements into a buffer of {}", host.len(), dst.len())));
        }
        self.stream.memcpy_htod(host, &mut dst.slice).map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    /// Copies `host` into the first `host.len()` elements of `dst` (queued on the stream; the host memory
    /// may be reused as soon as this returns).
    ///
    /// # Errors
    /// `host` longer than `dst`, or the copy failing.
    pub fn upload_prefix<T: DeviceRepr>(&self, host: &[T], dst: &mut DeviceBuf<T>) -> Result<()> {
        if host.len() > dst.len() {
            return Err(CudaError::Shape(format!("upload of {} elements into a buffer of {}", host.len(), dst.len())));
        }
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice.slice_mut(0..host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    /// Copies `host` into elements `offset .. offset + host.len()` of `dst` (queued on the stream).
    ///
    /// # Errors
    /// The range past `dst`, or the copy failing.
    pub fn upload_at<T: DeviceRepr>(&self, host: &[T], dst: &mut DeviceBuf<T>, offset: usize) -> Result<()> {
        if offset + host.len() > dst.len() {
            return Err(CudaError::Shape(format!("upload of {}..+{} into {}", offset, host.len(), dst.len())));
        }
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice.slice_mut(offset..offset + host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    /// Copies all of `src` into the first `src.len()` elements of `dst` on the device (queued on the stream).
    ///
    /// # Errors
    /// `src` longer than `dst`, or the copy failing.
    pub fn copy_prefix<T: DeviceRepr>(&self, src: &DeviceBuf<T>, dst: &mut DeviceBuf<T>) -> Result<()> {
        if src.len() > dst.len() {
            return Err(CudaError::Shape(format!("copy of {} elements into a buffer of {}", src.len(), dst.len())));
        }
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice.slice_mut(0..src.len());
        self.stream.memcpy_dtod(&src.slice, &mut view).map_err(CudaError::driver("cuMemcpyDtoDAsync"))
    }

    /// Copies elements `offset .. offset + host.len()` of `src` into `host`, in stream order (after all
    /// queued work). Into pageable host memory the copy is complete when this returns; call
    /// [`CudaDevice::synchronize`] before relying on that elsewhere.
    ///
    /// # Errors
    /// The range past `src`, or the copy (or earlier queued work) failing.
    pub fn download_into<T: DeviceRepr>(&self, src: &DeviceBuf<T>, offset: usize, host: &mut [T]) -> Result<()> {
        if offset + host.len() > src.len() {
            return Err(CudaError::Shape(format!("download of {}..+{} from {}", offset, host.len(), src.len())));
        }
        if host.is_empty() {
            return Ok(());
        }
        let view = src.slice.slice(offset..offset + host.len());
        self.stream.memcpy_dtoh(&view, host).map_err(CudaError::driver("cuMemcpyDtoHAsync"))
    }

    /// Waits for the stream, then returns a copy of `buf` (so errors of earlier launches surface here).
    ///
    /// # Errors
    /// The copy or any earlier queued work failing.
    pub fn download<T: DeviceRepr + Clone + Default>(&self, buf: &DeviceBuf<T>) -> Result<Vec<T>> {
        let mut host = vec![T::default(); buf.len()];
        self.stream.memcpy_dtoh(&buf.slice, &mut host).map_err(CudaError::driver("cuMemcpyDtoHAsync"))?;
        self.synchronize()?;
        Ok(host)
    }
}

/// Typed device memory of one [`CudaDevice`], freed (in stream order) on drop.
#[derive(Debug)]
pub struct DeviceBuf<T> {
    pub(crate) slice: CudaSlice<T>,
}

impl<T> DeviceBuf<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.is_empty()
    }

    /// The cudarc slice, for work this module does not wrap.
    pub fn as_slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The cudarc slice, mutably.
    pub fn as_slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}
