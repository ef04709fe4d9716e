//! NVRTC compilation of our CUDA C sources to a cubin for the device's architecture, cached on disk.
//!
//! The cache file is `<dflash cache dir>/cuda/<key>.cubin`, where the key is a SHA-256 of the NVRTC
//! version, the architecture, the options and the source: any change to one of them compiles afresh. A
//! cache that cannot be read or written only costs a compile; it is never an error.

use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use sha2::{Digest, Sha256};

use super::loader::{self, CudaLib};
use super::CudaError;

/// Bumped whenever the cache layout or meaning changes.
const CACHE_FORMAT: &str = "dflash-cuda-cubin-v1";

/// A compiled module image and how it was obtained.
#[derive(Debug)]
pub struct Compiled {
    /// The cubin, ready for `cuModuleLoadData`.
    pub cubin: Vec<u8>,
    pub report: CompileReport,
}

/// How a module came to be: from the disk cache or from NVRTC, and how long that took.
#[derive(Clone, Debug)]
pub struct CompileReport {
    /// `sm_XY`, the architecture compiled for.
    pub arch: String,
    /// Whether the cubin came from the disk cache.
    pub cache_hit: bool,
    /// Wall time of the cache read or of the compile, in milliseconds.
    pub millis: f64,
    /// The cache file (read, or written after compiling); `None` if it could not be written.
    pub cache_file: Option<PathBuf>,
}

pub use crate::cache::cache_dir;

/// The NVRTC version as `(major, minor)`.
///
/// # Errors
/// NVRTC missing ([`CudaError::LibraryMissing`]) or failing.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    loader::ensure_loaded(&[CudaLib::Nvrtc])?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: both pointers are valid for writes.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Nvrtc { what: "nvrtcVersion".into(), log: e.to_string() })?;
    Ok((major, minor))
}

/// The cache key of one compile: hex SHA-256 over everything that determines the cubin.
fn cache_key(nvrtc: (i32, i32), arch: &str, options: &[String], source: &str) -> String {
    let mut hasher = Sha256::new();
    for part in [CACHE_FORMAT, &format!("nvrtc {}.{}", nvrtc.0, nvrtc.1), arch] {
        hasher.update(part.as_bytes());
        hasher.update([0u8]);
    }
    for option in options {
        hasher.update(option.as_bytes());
        hasher.update([0u8]);
    }
    hasher.update(source.as_bytes());
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Compiles `source` for compute capability `(major, minor)` with `options` (beyond the architecture),
/// or reads the cubin from the disk cache under [`cache_dir`].
///
/// # Errors
/// NVRTC missing, or a compile error ([`CudaError::Nvrtc`] with the compiler's log).
pub fn compile_cached(source: &str, capability: (i32, i32), options: &[&str]) -> Result<Compiled, CudaError> {
    compile_cached_in(&cache_dir().join("cuda"), source, capability, options)
}

/// [`compile_cached`] with the cache in `dir`.
///
/// # Errors
/// As [`compile_cached`].
pub fn compile_cached_in(
    dir: &Path,
    source: &str,
    capability: (i32, i32),
    options: &[&str],
) -> Result<Compiled, CudaError> {
    let arch = format!("sm_{}{}", capability.0, capability.1);
    let mut all_options = vec![format!("--gpu-architecture={arch}")];
    all_options.extend(options.iter().map(|o| o.to_string()));
    let key = cache_key(nvrtc_version()?, &arch, &all_options, source);
    let file = dir.join(format!("{key}.cubin"));
    let start = Instant::now();
    if let Ok(cubin) = std::fs::read(&file) {
        if !cubin.is_empty() {
            let report = CompileReport { arch, cache_hit: true, millis: elapsed_ms(start), cache_file: Some(file) };
            return Ok(Compiled { cubin, report });
        }
    }
    let cubin = compile_cubin(source, &all_options)?;
    let millis = elapsed_ms(start);
    let cache_file = store(dir, &file, &cubin).then_some(file);
    Ok(Compiled { cubin, report: CompileReport { arch, cache_hit: false, millis, cache_file } })
}

/// Removes a cache file that turned out to be unusable (the driver rejected it).
pub(crate) fn evict(report: &CompileReport) {
    if let Some(file) = &report.cache_file {
        // A file that cannot be removed is overwritten by the next successful compile anyway.
        let _ = std::fs::remove_file(file);
    }
}

fn elapsed_ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// Writes `bytes` to `file` through a temporary file and a rename, so a reader never sees half a cubin.
/// Returns whether the file is now in place.
fn store(dir: &Path, file: &Path, bytes: &[u8]) -> bool {
    if std::fs::create_dir_all(dir).is_err() {
        return false;
    }
    let tmp = file.with_extension(format!("tmp.{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_err() {
        let _ = std::fs::remove_file(&tmp);
        return false;
    }
    std::fs::rename(&tmp, file).is_ok()
}

/// One NVRTC program, destroyed on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` and destroyed only here. A failure leaks the program.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

/// Compiles `source` with `options` (which must name a real `sm_XY` architecture) and returns the cubin.
fn compile_cubin(source: &str, options: &[String]) -> Result<Vec<u8>, CudaError> {
    let nvrtc_err = |what: &str, e: nvrtc::NvrtcError| CudaError::Nvrtc { what: what.into(), log: e.to_string() };
    let src = CString::new(source)
        .map_err(|_| CudaError::Nvrtc { what: "source".into(), log: "the source contains a NUL byte".into() })?;
    let name = c"dflash_kernels.cu";
    let program = Program(nvrtc::create_program(&src, Some(name)).map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?);
    // SAFETY: `program` is a live program; `src` and `name` outlive it.
    if let Err(e) = unsafe { nvrtc::compile_program(program.0, options) } {
        // SAFETY: as above.
        let log = unsafe { nvrtc::get_program_log(program.0) }.map(|log| c_chars_to_string(&log)).unwrap_or_default();
        return Err(CudaError::Nvrtc { what: format!("compile ({e}, options {options:?})"), log });
    }
    let mut size = 0usize;
    // SAFETY: `program` compiled successfully; `size` is valid for writes.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(program.0, &mut size) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the `size` bytes NVRTC asked for.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
    if cubin.is_empty() {
        return Err(CudaError::Nvrtc {
            what: "nvrtcGetCUBIN".into(),
            log: "empty cubin (was a real sm_XY arch given?)".into(),
        });
    }
    Ok(cubin)
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_changes_with_every_input() {
        let opts = vec!["--gpu-architecture=sm_90".to_string()];
        let base = cache_key((13, 0), "sm_90", &opts, "src");
        assert_eq!(base.len(), 64);
        assert_eq!(base, cache_key((13, 0), "sm_90", &opts, "src"));
        assert_ne!(base, cache_key((13, 1), "sm_90", &opts, "src"));
        assert_ne!(base, cache_key((13, 0), "sm_80", &opts, "src"));
        assert_ne!(base, cache_key((13, 0), "sm_90", &[], "src"));
        assert_ne!(base, cache_key((13, 0), "sm_90", &opts, "src "));
    }

    #[test]
    fn store_writes_through_a_rename() {
        let dir = std::env::temp_dir().join(format!("dflash-cubin-store-{}", std::process::id()));
        let file = dir.join("k.cubin");
        assert!(store(&dir, &file, b"abc"));
        assert_eq!(std::fs::read(&file).expect("stored"), b"abc");
        assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 1, "no temporary file left behind");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn nvrtc_log_is_cut_at_the_nul() {
        let raw: Vec<c_char> = b"error here\0junk".iter().map(|&b| b as c_char).collect();
        assert_eq!(c_chars_to_string(&raw), "error here");
    }
}
