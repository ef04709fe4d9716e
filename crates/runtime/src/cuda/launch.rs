//! Kernel launches, with programmatic dependent launch (PDL) where the device has it.
//!
//! A decode step is a chain of a few hundred small kernels, and between two of them the GPU used to sit idle
//! while the first one's last blocks drained and the next one was launched and its blocks started. On Hopper
//! (compute capability 9.0 and up) each of our kernels is launched with programmatic stream serialization
//! allowed: the next kernel may be launched while the one before it is still running. Every kernel begins with
//! `DF_GRID_DEPENDENCY()` (prelude.cuh): it waits there until the kernel before it has completed and its writes
//! are visible, then lets the kernel after it launch. So at most two kernels are in flight, the second one's
//! blocks parked at their first statement, and a boundary costs the wait instead of a launch. Stream capture
//! turns the dependency into a programmatic edge of the CUDA graph. Kernels of other libraries (cuBLAS) and
//! copies keep the ordinary full dependency.
//!
//! `DFLASH_PDL=0` launches everything the ordinary way, for side-by-side measurements.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::{sys, CudaFunction, DeviceRepr, DriverError, LaunchConfig};

use super::device::CudaDevice;
use super::timeline::function_name;

/// Whether kernels on a device of compute capability `capability` are launched with PDL.
pub(crate) fn pdl_enabled(capability: (i32, i32)) -> bool {
    capability.0 >= 9 && !crate::switches::switches().no_pdl
}

/// One kernel launch being put together: the function, the device (whose stream it goes to) and references to
/// its arguments (what the driver reads the argument values through).
pub struct KernelLaunch<'a> {
    func: &'a CudaFunction,
    dev: &'a CudaDevice,
    pdl: bool,
    args: Vec<*mut c_void>,
}

impl<'a> KernelLaunch<'a> {
    pub(crate) fn new(func: &'a CudaFunction, dev: &'a CudaDevice, pdl: bool) -> Self {
        KernelLaunch { func, dev, pdl, args: Vec::with_capacity(16) }
    }

    /// Appends the next kernel argument; the value must match the kernel's parameter type.
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(ptr::from_ref(value).cast_mut().cast());
        self
    }

    /// Queues the kernel on the stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's signature in number, order and type, and the kernel must only
    /// touch memory the launcher checked; with PDL the kernel must begin with `DF_GRID_DEPENDENCY()`.
    ///
    /// # Errors
    /// The driver refusing the launch.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        let stream = self.dev.stream();
        stream.context().bind_to_thread()?;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &raw mut attr,
            numAttrs: u32::from(self.pdl),
        };
        // SAFETY: the configuration and the attribute outlive the call; the argument pointers point at values
        // borrowed for 'a; the caller vouches for their match with the kernel.
        unsafe {
            sys::cuLaunchKernelEx(&raw const config, self.func.cu_function(), self.args.as_mut_ptr(), ptr::null_mut())
                .result()?;
        }
        self.dev.timeline_mark(|| {
            let (g, b) = (cfg.grid_dim, cfg.block_dim);
            format!("{} grid ({}, {}, {}) block {}", function_name(self.func), g.0, g.1, g.2, b.0 * b.1 * b.2)
        });
        Ok(())
    }
}
