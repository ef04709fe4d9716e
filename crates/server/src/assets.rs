//! Where the shipped assets (the default model's drafters) are found, and `dflash fetch`'s installed copy of them,
//! so a binary that is installed or copied elsewhere keeps its drafters.
//!
//! Looked for in order: `$DFLASH_ASSETS_DIR`; `assets/` beside the executable; the repository's `assets/` the binary
//! was built from, while it is there (the freshest copy on a development machine); the copy `dflash fetch` installs
//! in the cache (`<cache>/assets`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::drafters::{DEFAULT_DRAFTER, DEFAULT_MTP_HEAD};

/// The shipped checkpoints, relative to an assets directory.
const SHIPPED: [&str; 2] = [DEFAULT_DRAFTER, DEFAULT_MTP_HEAD];

/// The assets directory: `$DFLASH_ASSETS_DIR` when set, else the first place that holds the shipped drafter (see
/// the module's order), else the repository's `assets/` the binary was built from.
pub fn assets_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("DFLASH_ASSETS_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let beside_exe = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("assets")));
    let candidates: Vec<PathBuf> = beside_exe.into_iter().chain([built_assets(), installed_assets()]).collect();
    first_holding_drafter(&candidates).unwrap_or_else(built_assets)
}

/// Where `dflash fetch` installs the shipped assets: `<cache>/assets`.
pub fn installed_assets() -> PathBuf {
    dflash_runtime::cache::cache_dir().join("assets")
}

/// The repository's `assets/` this binary was built from (absent on other machines).
fn built_assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets")
}

/// The first of `candidates` that holds the default model's drafter.
fn first_holding_drafter(candidates: &[PathBuf]) -> Option<PathBuf> {
    candidates.iter().find(|d| d.join(DEFAULT_DRAFTER).join("config.json").is_file()).cloned()
}

/// Copies the shipped checkpoints from `from` into `to` (each directory written beside, then renamed into place,
/// so an interrupted copy leaves no half checkpoint); those already in `to` with the same bytes are kept, others
/// replaced. Returns how many were copied.
///
/// # Errors
/// A shipped checkpoint missing from `from`, or a file that cannot be copied.
pub fn install_shipped(from: &Path, to: &Path) -> Result<usize> {
    let mut copied = 0;
    for relative in SHIPPED {
        let (src, dst) = (from.join(relative), to.join(relative));
        if same_files(&src, &dst) {
            continue;
        }
        let parent = dst.parent().context("a shipped checkpoint has a parent directory")?;
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        let partial = dst.with_extension("partial");
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
        let entries = std::fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))?;
        for entry in entries {
            let entry = entry.with_context(|| format!("reading {}", src.display()))?;
            if entry.file_type()?.is_file() {
                std::fs::copy(entry.path(), partial.join(entry.file_name()))
                    .with_context(|| format!("copying {}", entry.path().display()))?;
            }
        }
        let _ = std::fs::remove_dir_all(&dst);
        std::fs::rename(&partial, &dst).with_context(|| format!("moving {} into place", dst.display()))?;
        copied += 1;
    }
    Ok(copied)
}

/// Whether `dst` holds exactly `src`'s files, byte for byte.
fn same_files(src: &Path, dst: &Path) -> bool {
    let files = |dir: &Path| -> Option<Vec<(std::ffi::OsString, Vec<u8>)>> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir(dir).ok()? {
            let entry = entry.ok()?;
            all.push((entry.file_name(), std::fs::read(entry.path()).ok()?));
        }
        all.sort();
        Some(all)
    };
    matches!((files(src), files(dst)), (Some(a), Some(b)) if a == b)
}

/// `dflash fetch`'s second half: the shipped drafters into the cache, from wherever this binary finds them, so a
/// later run finds them even once the binary is installed elsewhere. Prints where they are.
///
/// # Errors
/// Copying failed.
pub fn fetch_shipped() -> Result<()> {
    let installed = installed_assets();
    let source = assets_dir();
    if source != installed && first_holding_drafter(std::slice::from_ref(&source)).is_some() {
        let copied = install_shipped(&source, &installed)?;
        if copied > 0 {
            eprintln!("installed {copied} shipped drafter(s) from {} into {}", source.display(), installed.display());
        }
    }
    match first_holding_drafter(std::slice::from_ref(&installed)) {
        Some(dir) => println!("{}", dir.join(DEFAULT_DRAFTER).display()),
        None => eprintln!(
            "the shipped drafters were not found (looked in {}); put the repository's assets/ beside the binary or set \
             DFLASH_ASSETS_DIR",
            source.display()
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty directory under the system temp dir.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dflash-assets-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn the_first_place_holding_the_drafter_wins() {
        let (empty, held) = (scratch("empty"), scratch("held"));
        std::fs::create_dir_all(held.join(DEFAULT_DRAFTER)).expect("mkdir");
        std::fs::write(held.join(DEFAULT_DRAFTER).join("config.json"), "{}").expect("write");
        assert_eq!(first_holding_drafter(&[empty.clone(), held.clone()]), Some(held.clone()));
        assert_eq!(first_holding_drafter(std::slice::from_ref(&empty)), None);
        let _ = (std::fs::remove_dir_all(empty), std::fs::remove_dir_all(held));
    }

    #[test]
    fn the_shipped_drafters_install_whole_and_once() {
        let to = scratch("install");
        assert_eq!(install_shipped(&built_assets(), &to).expect("install"), 2);
        for relative in SHIPPED {
            for file in std::fs::read_dir(built_assets().join(relative)).expect("shipped") {
                let file = file.expect("entry").path();
                let copy = to.join(relative).join(file.file_name().expect("name"));
                assert_eq!(std::fs::read(&file).expect("read"), std::fs::read(&copy).expect("copied"), "{copy:?}");
            }
        }
        assert_eq!(first_holding_drafter(std::slice::from_ref(&to)), Some(to.clone()));
        assert_eq!(install_shipped(&built_assets(), &to).expect("again"), 0, "kept");
        // A stale copy (a drafter retrained since) is replaced.
        std::fs::write(to.join(DEFAULT_DRAFTER).join("config.json"), "{}").expect("stale");
        assert_eq!(install_shipped(&built_assets(), &to).expect("refresh"), 1);
        assert!(same_files(&built_assets().join(DEFAULT_DRAFTER), &to.join(DEFAULT_DRAFTER)));
        assert!(install_shipped(&to.join("nowhere"), &scratch("missing")).is_err());
        let _ = std::fs::remove_dir_all(to);
    }
}
