//! Finding the CUDA libraries at run time.
//!
//! cudarc opens the driver, NVRTC and cuBLAS by bare file name (so through the loader's search path) the
//! first time one of their functions is called, and panics when one is missing. Before any cudarc call
//! we open each library ourselves: first by bare name, then in the directories of `DFLASH_CUDA_LIB_DIR`
//! (a path list) and in the standard install locations below. Once a library is open, the dynamic loader
//! matches cudarc's later `dlopen` of the same name against its soname, so cudarc gets our copy; and a
//! missing library becomes one [`CudaError::LibraryMissing`] naming what was searched, not a panic.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use libloading::Library;

use super::CudaError;

/// Directories searched after the loader's own path: where the CUDA toolkit and the NVIDIA container
/// runtime put their libraries.
const DEFAULT_LIB_DIRS: [&str; 2] = ["/usr/local/cuda/lib64", "/usr/local/nvidia/lib64"];

/// Environment variable with extra directories (a `:`-separated path list) searched before the defaults.
pub const LIB_DIR_ENV: &str = "DFLASH_CUDA_LIB_DIR";

/// A CUDA library the backend needs, by the file name cudarc asks for (CUDA 13, as the `cuda-13000`
/// feature of cudarc expects).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaLib {
    /// The driver API (`libcuda.so.1`, installed with the NVIDIA driver).
    Driver,
    /// The run-time compiler (`libnvrtc.so.13`) and its builtins library beside it.
    Nvrtc,
    /// cuBLASLt (`libcublasLt.so.13`), which cuBLAS links against.
    CublasLt,
    /// cuBLAS (`libcublas.so.13`).
    Cublas,
}

impl CudaLib {
    /// The file name the dynamic loader is asked for.
    pub fn file_name(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so.1",
            CudaLib::Nvrtc => "libnvrtc.so.13",
            CudaLib::CublasLt => "libcublasLt.so.13",
            CudaLib::Cublas => "libcublas.so.13",
        }
    }
}

/// Everything the backend uses, in dependency order (cuBLASLt before cuBLAS).
pub const ALL_LIBS: [CudaLib; 4] = [CudaLib::Driver, CudaLib::Nvrtc, CudaLib::CublasLt, CudaLib::Cublas];

/// Libraries opened so far, kept open for the life of the process (cudarc holds on to its own handles
/// to the same objects, so they must never be unloaded).
fn opened() -> &'static Mutex<Vec<(CudaLib, Library)>> {
    static OPENED: OnceLock<Mutex<Vec<(CudaLib, Library)>>> = OnceLock::new();
    OPENED.get_or_init(|| Mutex::new(Vec::new()))
}

/// Opens every library in `libs` that is not open yet.
///
/// # Errors
/// [`CudaError::LibraryMissing`] for the first library found nowhere, naming the places searched.
pub fn ensure_loaded(libs: &[CudaLib]) -> Result<(), CudaError> {
    let mut opened = opened().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for &lib in libs {
        if opened.iter().any(|(have, _)| *have == lib) {
            continue;
        }
        let dirs = search_dirs(std::env::var_os(LIB_DIR_ENV));
        let (library, dir) = open_library(lib.file_name(), &dirs)?;
        if lib == CudaLib::Nvrtc {
            if let Some(dir) = &dir {
                // NVRTC opens its builtins library by bare name at its first compile; open it from the same
                // directory now, or that lookup fails when the directory is not on the loader's path.
                open_nvrtc_builtins(dir, &mut opened);
            }
        }
        opened.push((lib, library));
    }
    Ok(())
}

/// The directories searched after the loader path: `env_dirs` (the value of [`LIB_DIR_ENV`]) first,
/// then the defaults.
fn search_dirs(env_dirs: Option<std::ffi::OsString>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = env_dirs.map(|v| std::env::split_paths(&v).collect()).unwrap_or_default();
    dirs.retain(|d| !d.as_os_str().is_empty());
    dirs.extend(DEFAULT_LIB_DIRS.iter().map(PathBuf::from));
    dirs
}

/// Opens `name` through the loader's path, else from the first of `dirs` that has it; returns the library
/// and the directory it came from (`None` for the loader's path).
fn open_library(name: &str, dirs: &[PathBuf]) -> Result<(Library, Option<PathBuf>), CudaError> {
    // SAFETY: loading runs the library's initialisers; these are the vendor's CUDA libraries, which
    // cudarc would load the same way.
    if let Ok(lib) = unsafe { Library::new(name) } {
        return Ok((lib, None));
    }
    let mut failures = Vec::new();
    for dir in dirs {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        // SAFETY: as above.
        match unsafe { Library::new(&path) } {
            Ok(lib) => return Ok((lib, Some(dir.clone()))),
            Err(e) => failures.push(format!("{}: {e}", path.display())),
        }
    }
    let mut searched = format!("the loader path (LD_LIBRARY_PATH, ldconfig), ${LIB_DIR_ENV}");
    for dir in dirs {
        searched.push_str(&format!(", {}", dir.display()));
    }
    if !failures.is_empty() {
        searched.push_str(&format!("; found but failed to open: {}", failures.join("; ")));
    }
    Err(CudaError::LibraryMissing { library: name.to_string(), searched })
}

/// Opens `libnvrtc-builtins.so.13*` from `dir` if there is one, keeping it in `opened`. Failure is left
/// for NVRTC to report at compile time.
fn open_nvrtc_builtins(dir: &Path, opened: &mut Vec<(CudaLib, Library)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let builtins = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc-builtins.so.13")));
    if let Some(path) = builtins {
        // SAFETY: as in `open_library`.
        if let Ok(lib) = unsafe { Library::new(&path) } {
            opened.push((CudaLib::Nvrtc, lib));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_dirs_put_env_dirs_first_and_skip_empty_entries() {
        let dirs = search_dirs(Some("/a::/b".into()));
        let want: Vec<PathBuf> =
            ["/a", "/b"].iter().chain(DEFAULT_LIB_DIRS.iter()).map(PathBuf::from).collect::<Vec<_>>();
        assert_eq!(dirs, want);
        assert_eq!(search_dirs(None).len(), DEFAULT_LIB_DIRS.len());
    }

    #[test]
    fn a_missing_library_names_what_was_searched() {
        let dirs = [PathBuf::from("/nonexistent-dflash-dir")];
        let Err(err) = open_library("libdflash-no-such-library.so.1", &dirs) else {
            panic!("a library that does not exist was opened");
        };
        let msg = err.to_string();
        assert!(msg.contains("libdflash-no-such-library.so.1"), "{msg}");
        assert!(msg.contains("/nonexistent-dflash-dir"), "{msg}");
        assert!(msg.contains(LIB_DIR_ENV), "{msg}");
    }
}
