//! Helpers the CUDA model-op test binaries (cuda_model_ops, cuda_matmul_ops) share: the device, opened once,
//! the table of measured errors against tolerances, error measures, and CPU references both use.

use std::sync::{OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use dflash_runtime::cuda::CudaDevice;
use dflash_runtime::ops as cpu;
use dflash_runtime::quant;
use dflash_runtime::{DType, Tensor};

use super::{say, Rng};

/// A binary's tests share one device and its stream, and a graph capture needs the stream to itself (another test's
/// synchronisation while it captures fails both): a test that captures holds [`stream_alone`], the others
/// [`stream_shared`].
static STREAM_USE: RwLock<()> = RwLock::new(());

/// The device's stream beside other tests that share it.
pub fn stream_shared() -> RwLockReadGuard<'static, ()> {
    STREAM_USE.read().unwrap_or_else(PoisonError::into_inner)
}

/// The device's stream to this test alone (a graph capture).
pub fn stream_alone() -> RwLockWriteGuard<'static, ()> {
    STREAM_USE.write().unwrap_or_else(PoisonError::into_inner)
}

/// Device 0 for the binary `tests`, `header` printed once it is open; `None`, after a SKIP line, on a machine with no
/// CUDA device. A device that is there but fails to open (a kernel that does not compile or load, a driver error)
/// fails the binary instead of skipping it.
pub fn open_device(tests: &str, header: impl FnOnce(&CudaDevice)) -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(dev) => {
            header(&dev);
            Some(dev)
        }
        Err(e) if e.is_no_device() => {
            say(&format!("SKIP {tests}: no usable CUDA device ({e})"));
            None
        }
        Err(e) => panic!("the CUDA device failed to open: {e}"),
    }
}

/// Device 0, opened once per binary (printing the table's header); `None`, after a SKIP line, without one.
pub fn device() -> Option<&'static CudaDevice> {
    static DEVICE: OnceLock<Option<CudaDevice>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            open_device("cuda model-op tests", |_| {
                say(&format!("{:<34} {:<30} {:>11} {:>11}", "kernel", "shape", "max err", "tolerance"));
            })
        })
        .as_ref()
}

/// Prints one row of the table and fails when `max_err` is over `tol`.
pub fn check(kernel: &str, shape: &str, max_err: f64, tol: f64) {
    say(&format!("{kernel:<34} {shape:<30} {max_err:>11.3e} {tol:>11.1e}"));
    assert!(max_err <= tol, "{kernel} {shape}: max error {max_err:e} over tolerance {tol:e}");
}

/// Largest `|got − want| / scale[i]`; NaN anywhere counts as infinite.
pub fn max_err_over(got: &[f32], want: &[f32], scale: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((&g, &w), &s)| if g.is_nan() || w.is_nan() { f64::INFINITY } else { (g as f64 - w as f64).abs() / s })
        .fold(0.0, f64::max)
}

/// How many elements differ in their bits (NaN against NaN of the same bits counts as equal).
pub fn bit_mismatches(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count() as f64
}

pub fn f32_tensor(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_f32(v, shape).expect("f32 tensor")
}

/// The CPU RMSNorm of each row of `x` (rows of `w.len()`).
pub fn cpu_rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let (k, m) = (w.len(), x.len() / w.len());
    let mut out = f32_tensor(&vec![0.0; x.len()], &[m, k]);
    cpu::rms_norm(&f32_tensor(x, &[m, k]), &f32_tensor(w, &[k]), eps, &mut out).expect("cpu rms_norm");
    out.as_f32().expect("f32").to_vec()
}

/// A random ggml matrix of `dtype` (through the reference quantizer) and its dequantized values.
pub fn quant_matrix(rng: &mut Rng, dtype: DType, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    let values = rng.vec(n * k, 1.0);
    let mut bytes = vec![0u8; n * dtype.bytes_for(k).expect("whole blocks")];
    let row = bytes.len() / n;
    for (src, dst) in values.chunks_exact(k).zip(bytes.chunks_exact_mut(row)) {
        quant::quantize_row(dtype, src, dst);
    }
    let mut deq = vec![0f32; n * k];
    for (src, dst) in bytes.chunks_exact(row).zip(deq.chunks_exact_mut(k)) {
        quant::dequantize_row(dtype, src, dst);
    }
    (bytes, deq)
}
